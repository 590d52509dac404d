"""The node daemon's L3 → local path: the groups' change feeds read and what this host
wants of them merged into L2 (docs/design/daemon.md, theory of operation, 2). The
decisions are :class:`kvcomm.node.delivery.Inbound`'s; this part drives it: hints, the
sweep of counters, feed reads, the records of value-less entries, resyncs, and the
saved cursors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Set
from typing import TYPE_CHECKING

from ..core.backoff import Backoff
from ..core.versions import Ordering, SkewMonitor, compare_vectors, vector_get
from ..errors import CorruptRecord, Unavailable, ValueTooLarge
from ..tiers.l3 import FeedEntry, FeedNote, L3Record, Unreached, read_record
from .delivery import FEED_COUNT, Inbound, Outbound, Poll, Reading, Skipped, echo

if TYPE_CHECKING:
    from .daemon import Daemon

log = logging.getLogger("kvcomm.node")


def nobody(key: str) -> bool:
    """No key is watched (the default of :attr:`Puller.watching`)."""
    return False


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def _raise(exc: BaseException) -> None:
    raise exc


# keys whose held-back record was dropped past Puller.held_back_max, remembered at most
# (each to be read from L3 again once its write is delivered: Puller.release)
DROPPED_MAX = 65_536
# what Puller.refetch holds for a key to read from L3 again whatever L2 holds (refill: a
# merged note is never taken as covered, and its record is read)
REREAD = FeedNote("", 0, False, True)


class Puller:
    """Other hosts' changes into L2: owns the inbound machine (:attr:`inb`), the
    skipped changes and those to read again, the unread counts, the clock-skew monitor
    and what the last poll found."""

    def __init__(self, d: Daemon, out: Outbound, hlc_ms: Callable[[], int]) -> None:
        self.d = d
        self.port, self.l3, self.keys, self.q = d.port, d.l3, d.keys, d.quarantine
        self.clock, self.wall, self.host, self.stats = d.clock, d.wall, d.host, d.stats
        self.groups, self.load, self.hosts = d.groups, d.load, d.hosts
        self.out = out
        c, cl = d.config.cache, d.config.cluster
        now = d.clock()
        self.inb = Inbound(cl.groups, cl.feed_poll,
                           Backoff(d.rng, base=0.05, cap=2.0, floor=0.01),
                           now, sweep_rate=cl.feed_sweep_rate)
        self.inb.expected = out.unconfirmed.by_group  # (shared: a rewind check's input)
        self.skipped = Skipped()  # remote changes to keys not held here, for a while
        self.refetch: dict[str, L3Record | FeedNote] = {}  # skipped changes to read again
        # keys a local watcher wants from the feeds though L2 does not hold them (a hook
        # for cluster-wide watches: see wants())
        self.watching: Callable[[str], bool] = nobody
        self.max_value_size = c.max_value_size
        # held keys leave L2 at this many remote changes in a row no agent read before
        # (0: never): unread[key] counts them (_fetch_wanted)
        self.unread_changes = cl.unread_changes
        self.unread: dict[str, int] = {}
        self.last_pull = now  # the last feed read that succeeded (feed lag)
        # remote timestamps beyond cluster.max_clock_skew: counted and logged, not
        # refused (the write was acknowledged on its host); hlc_ms: this host's HLC clock
        self.hlc_ms = hlc_ms
        self.skew = SkewMonitor(max(1, round(cl.max_clock_skew * 1000)))
        self.feed_counters: dict[int, int | None] = {}  # groups' counters at the last check
        # this poll's checks whose master was down, and whether a call reached nothing
        self.unanswered: set[int] = set()
        self.poll_skipped = False
        # how often changes to watched prefixes (node/watched.py: NodeDaemon sets
        # ``watching`` from them) may have been missed (a resync after a gap: the
        # watchers are told to rescan)
        self.watch_missed = 0
        # groups whose position came from hinted entries since the sweep last found their
        # stream ending there (_verify_hinted)
        self.hint_placed: set[int] = set()
        # key -> the latest record read from L3 that covers a write of this host L2 holds
        # dirty (its push not answered durable yet): not merged until that write is
        # delivered (see apply), then merged (release). Past held_back_max the oldest is
        # dropped, its key kept in ``dropped`` (oldest first; at most dropped_max): read
        # from L3 again once the write is delivered (_hold_back)
        self.held_back: dict[str, L3Record] = {}
        self.held_back_max = max(1, cl.outbound_max)
        self.dropped: dict[str, None] = {}
        self.dropped_max = max(DROPPED_MAX, self.held_back_max)

    def start_feeds(self) -> None:
        """Subscribe to the groups' hints, then resume every group's feed from the saved
        cursor and sequence number; a group without both (a new host) starts from its
        current position, re-reading any keys L2 already holds (a group never written
        starts at 0 without a call). The first poll checks every group's counter."""
        self.inb.lost(self.l3.hints()[1])  # subscribed before any position is taken
        fresh = self.inb.resume(*self.l3.load_cursors(self.host))
        if fresh:
            try:  # (those of a master taken for down are left out: resynced once it answers)
                seqs = self.l3.feed_seqs(fresh)
            except Unreached:  # (every one of them is on such a master)
                seqs = {}
            empty = {g for g, n in seqs.items() if n == 0}
            self.resync(fresh, reason="", held=self.d.key_filter.held_at_start, empty=empty)

    def resync(self, groups: set[int], reason: str, held: Iterable[str] = (),
                empty: Set[int] = frozenset()) -> None:
        """Take ``groups``' current feed positions, then re-read from L3 the keys of those
        groups that L2 holds (changes after the position come through the feed): the live
        ones, the tombstones among ``held``, and the tombstones found by the scan of a
        group. A ``reason`` (a gap, a rewind) counts as a resync and scans the groups'
        keys into the key filter, since the missed entries may have created keys. The
        groups of ``empty`` were found never written: their position is (0, ``0-0``).

        Raises Unavailable; the groups stay pending (their old cursors are what is
        saved) and are resynced again on the next round.
        """
        self.inb.begin_resync(groups, missed=bool(reason))
        # (those of a master taken for down stay pending: resynced once it answers, by
        # the next poll's; else every poll would fail on them for as long as it hangs)
        down = self.l3.down_groups(groups)
        if down:
            self.stats.bump("unreached_resyncs", len(down))
            groups = groups - down
        if reason:
            self.watch_missed += 1  # (a watched key of these groups may have changed unseen)
            self.stats.resyncs += len(groups)
            self.stats.bump(f"resync_{reason}", len(groups))
            log.warning("resyncing group(s) %s of the L3 feed (%s)", sorted(groups), reason)
        # a hinted entry missing from its stream is, but for a forged hint, the same loss
        # as a rewind seen first by the hint check (a failover lost the entry it names)
        rewound = reason in ("rewind", "false_hint")
        # (after a rewind the tombstones too: a delete of this host L3 lost, the key's
        # record with it, is found by no scan of L3, and is sent again: _resync_key.
        # And at a start or a resumed resync (no reason): a group put off at the start
        # (its master was down, its keys not scanned) would otherwise take its position
        # later and never read another host's write, made meanwhile, to a key whose
        # tombstone L2 holds)
        tombstones = rewound or not reason
        held = {key for key in (*self.port.held_keys(tombstones=tombstones), *held)
                if self.groups.of(key) in groups}
        for g in sorted(groups):
            try:
                seq, last_id = (0, b"0-0") if g in empty else self.l3.feed_position(g)
            except CorruptRecord as exc:  # a foreign value under the group's stream key
                self.q.set_aside(f"feed of group {g}", f"resync: {exc}")
                seq, last_id = None, b"0-0"  # (the first real entry then resyncs it again)
            if self.inb.positioned(g, seq, last_id):  # the missed entries may have made keys
                self.d.key_filter.scan_into(self.d.key_filter.scanned_into(held),
                                            self.l3.scan_group(g))
                self.inb.scanned(g)
        for key in sorted(held):
            self.q.guarded(key, "resync", self._resync_key, key, rewound)
        # this host's records of these groups acknowledged by fewer replicas than asked
        # (kept dirty, so _resync_key passed them), after a rewind (or a resync whose
        # reason is not known: resumed): whatever the failover kept, each is sent again —
        # a new push is answered as any (older or equal ends it; stored, it is held again
        # under its new entry). A rewind found through one of them is the only sign of
        # its loss: no reader's position had passed it. (A gap or a foreign entry loses
        # nothing: they stay held, their entries' numbers still to be checked.)
        lost = groups if reason in ("rewind", "false_hint", "") else set()
        for unheld in self.out.unconfirmed.drop_groups(lost):
            rec = self.q.guarded(unheld.key, "resync", self.port.dirty_record, unheld.key)
            if isinstance(rec, L3Record) and self.out.repush(unheld.key, rec, self.clock(),
                                                             since=unheld.since):
                self.stats.bump("repushed")
                log.warning("re-sending %r, acknowledged by fewer Redis replicas than "
                            "cluster.wait_replicas, after a resync of its group (%s)",
                            unheld.key, reason or "resumed")
        self.stats.extra["unconfirmed"] = len(self.out.unconfirmed)
        self.inb.resynced(groups)

    def _resync_key(self, key: str, rewound: bool) -> bool:
        """Re-read ``key`` from L3 into L2 (a tombstone too); then, when L2 holds a record
        with this host's dot that L3's does not cover (newer, or concurrent), push that
        record again (:meth:`Outbound.repush`; counted ``repushed``). L3 lost an
        acknowledged write — a failover that promoted a replica without it
        (``cluster.wait_replicas`` 0, or fewer replicas connected than asked): every host
        holding it merged L3's older record under it and kept it, and nothing else sends
        it again. The push script decides as for any push (a record L3 holds that covers
        it — a later delete — answers ``older`` and L2 takes it; ``equal``: another host
        re-pushed it first), and nothing re-stages a re-push: no loop. A key L3 has no
        record of is sent again only after a ``rewound`` feed (the lost write may have
        created it; a hinted entry missing from its stream counts too); otherwise an absent
        key is an expired record Redis reclaimed, or an operator's wipe, not to be undone;
        and never a record past its deadline. A tombstone is sent again too: the failover
        may have lost a key's creation and its delete, and the creator's re-push of its
        record (L3 having none) would undo the delete, which only the deleter can send
        again.
        Returns whether L3 had a record. Raises Unavailable and what ``_apply`` raises."""
        rec = self.l3.get(key)
        if rec is not None:
            self.apply_or_forget(key, rec)
        held = self.port.held_record(key)
        if held is None:  # (absent, or no dot of this host: its writer re-pushes it)
            return rec is not None
        if rec is None:
            if not rewound:
                return False
        elif compare_vectors(held.vector, rec.vector) in (Ordering.BEFORE, Ordering.EQUAL):
            return True
        deadline = held.deadline
        if deadline is not None and deadline <= self.wall():
            return rec is not None
        if self.out.repush(key, held, self.clock()):
            self.stats.bump("repushed")
            log.warning("L3 lost a write of %r that this host holds (its record there is %s):"
                        " pushing it again", key, "gone" if rec is None else "older or concurrent")
        return rec is not None

    def poll(self, poll: Poll, now: float) -> None:
        """One poll the inbound machine found due: :meth:`pull_remote`, the cursors saved
        when due, and whether Redis answered (a poll whose every call went to masters
        taken for down is no answer: a live master is asked). Raises Unavailable."""
        reach = self.d.partition.reach
        self.unanswered, self.poll_skipped = set(), False
        self.pull_remote(poll)
        if poll.save:
            try:
                self.save_state()
            except Unreached:  # (the host's own keys' master is down: next time)
                self.stats.bump("unreached_saves")
                self.poll_skipped = True
        if not self.poll_skipped:  # (a call that reached nothing is no answer: the
            reach.redis_ok(self.clock())  # metered blocks count those that were)
        elif self.d.partition.live_master_answers():
            reach.redis_ok(self.clock())
        self.last_pull = self.clock()
        self.inb.polled(poll, now)
        self.inb.recheck |= self.unanswered

    def pull_remote(self, poll: Poll) -> None:
        """Read the feeds of the groups that changed and apply what this host holds: first
        the counters of ``poll.check`` (a sweep slice, groups whose hints may have been
        lost), then the feeds of the groups hinted or whose counter moved. Raises
        Unavailable."""
        if self.inb.pending:  # an earlier resync was interrupted
            self.resync(set(self.inb.pending), reason="")  # (keeps whether to scan)
        counters: dict[int, int | None] = {}
        tails: dict[int, bytes | None] = {}  # (the id of each stream's last entry)
        heads: dict[int, tuple[int | None, bytes | None]] = {}
        try:
            with self.d.metered("sweep"):
                if poll.check:
                    with_tails = self.inb.tails_for(poll)
                    heads = dict(self.l3.feed_heads(with_tails)) if with_tails else {}
                    if poll.check - with_tails:
                        heads.update(self.l3.feed_heads(poll.check - with_tails, tails=False))
        except Unreached:  # (only masters taken for down: the reads of the others go on)
            self.stats.bump("unreached_sweeps")
            self.poll_skipped = True
        counters = {g: seq for g, (seq, _) in heads.items()}
        tails = {g: tail for g, (_, tail) in heads.items()}
        # groups whose master is down are checked again once it answers (Inbound.recheck,
        # put back after the poll: see poll)
        self.unanswered = set(poll.check - heads.keys())
        if counters:
            self.feed_counters.update(counters)  # (the cluster feed's lag, for metrics)
            self._verify_hinted(counters)
        read = self.inb.to_read(counters, tails)
        noted = self.inb.take_noted()  # (entries hints carried, of groups not read now)
        if not read and not noted:
            return
        self.stats.hinted += len(read - counters.keys())
        self.stats.swept += len(read & counters.keys())
        try:
            self._pull(read, noted, counters, tails)
        except BaseException:  # (Unavailable, say) the noted groups are read next time
            self.inb.hinted(noted)
            raise

    def _verify_hinted(self, counters: Mapping[int, int | None]) -> None:
        """Groups whose position was last taken from hints (their entries applied without
        reading the stream), now checked and found at the group's counter: the stream must
        end at that position. A hint is anything that can SPUBLISH on the channel; one
        carrying an entry the stream does not hold (the next sequence number, an id far
        ahead) would otherwise hide the real change that takes its number (the counter
        matches, and the stream is read after the false id): resync the group instead.
        One position read per such group and sweep. Raises Unavailable."""
        for g in sorted(self.hint_placed & counters.keys()):
            counter = counters[g]
            if counter is None or counter != self.inb.seqs.get(g) or g in self.inb.noted:
                continue  # (moved on: read, or checked at a later sweep)
            seq, last_id = self.l3.feed_position(g)
            if seq != counter:
                continue  # (a change meanwhile: checked at a later sweep)
            self.hint_placed.discard(g)
            if last_id != self.inb.cursors.get(g):
                self.stats.bump("hints_false")
                log.warning("group %d: a hinted entry is not in its stream (a forged or "
                            "garbled hint); resyncing it", g)
                self.resync({g}, reason="false_hint")

    def _pull(self, read: set[int], noted: dict[int, list[FeedEntry]],
              counters: dict[int, int | None],
              tails: Mapping[int, bytes | None] | None = None) -> None:
        """Read the feeds of ``read`` and apply their entries and the ``noted`` ones (by
        group, entries that hints carried). Raises Unavailable."""
        problems: dict[str, set[int]] = {}
        readings: list[tuple[int, Reading, int]] = []
        feeds: dict[int, list[FeedEntry] | CorruptRecord] = {}
        checked: dict[int, bool] = {}  # group -> its stream lost the cursor's entry
        if read:
            try:
                with self.d.metered("feed"):
                    feeds = self.l3.feed_many({g: self.inb.cursors.get(g, b"0-0") for g in read},
                                              count=FEED_COUNT, verify=self.inb.verify & read,
                                              checked=checked)
            except Unreached:  # (every group's master is down: read when it answers)
                self.stats.bump("unreached_reads")
                self.poll_skipped = True
            self.inb.verified(g for g, lost in checked.items() if not lost)
            # (a group of a master taken for down stays due: read once it answers)
            self.inb.hinted(read - feeds.keys())
        for g, entries in noted.items():  # (in sequence, each after the last read: examined)
            self.stats.bump("hint_entries", len(entries))
            self.hint_placed.add(g)  # (verified by the group's next sweep: _verify_hinted)
            readings.append((g, Reading(entries, ""), -len(entries)))
        for g, rows in feeds.items():
            if isinstance(rows, CorruptRecord):
                self.q.guarded(f"feed of group {g}", "feed read", _raise, rows)
                self.inb.read(g, 0)
                continue
            readings.append((g, self.inb.examine(g, rows, counters.get(g), (tails or {}).get(g),
                                                 lost=checked.get(g, False)), len(rows)))
        # the records of the value-less entries this host wants, in one batch, before any
        # entry is applied or cursor advanced (Unavailable: the poll is made again)
        fetched = self._fetch_wanted([e for _, r, _ in readings for e in r.entries])
        applied: set[str] = set()  # (keys whose fetched record was applied this poll)
        for g, reading, n in readings:
            for entry in reading.entries:
                self._pull_entry(g, entry, fetched, applied)
                self.inb.advance(g, entry)
            if n >= 0:  # (n < 0: entries a hint carried, no XRANGE)
                self.load[g] = self.load.get(g, 0) + 1  # one XRANGE
            self.inb.read(g, max(0, n))
            if reading.problem:
                problems.setdefault(reading.problem, set()).add(g)
        for why in sorted(problems):
            self.resync(problems[why], reason=why)

    def wants(self, key: str) -> bool:
        """Whether this host takes ``key``'s changes from the feeds into L2: L2 holds it,
        or :attr:`watching` (a hook for cluster-wide watches; by default nobody's) says
        a local watcher asks for it. Other keys' changes are left to the read path."""
        return self.port.holds(key) or self.watching(key)

    def _fetch_wanted(self, entries: list[FeedEntry]) -> dict[str, L3Record | None | CorruptRecord]:
        """The records, read from L3 in one batch (a pipeline per master), of the keys of
        value-less ``entries`` this host wants and does not hold already (see
        :func:`~kvcomm.node.delivery.echo`). A key L2 holds that no agent read before
        this change nor the ``cluster.unread_changes - 1`` before it is not read: it leaves
        L2 (clean; a dirty one is read, to merge), and its change is remembered as a
        skipped one, for a fill. Raises Unavailable."""
        ws = self.port.write_sequence()
        named = dict.fromkeys(e.key for e in entries if e.key is not None and e.note is not None
                              and not echo(e.note, self.host, ws))
        want = [k for k in named if self.watching(k)]
        rest = [k for k in named if not self.watching(k)]
        if not self.unread_changes:
            want += [k for k in rest if self.port.holds(k)]
        elif rest:
            if len(self.unread) > 65_536:  # (keys evicted meanwhile: counting starts again)
                self.unread.clear()
            for key, read in self.port.take_reads(rest).items():
                if read == 1:
                    want.append(key)
                    self.unread.pop(key, None)
                elif read == 0:
                    n = self.unread.pop(key, 0) + 1
                    if n >= self.unread_changes and self.port.forget(key):
                        self.stats.bump("unread_dropped")  # (its next read, if any, goes to L3)
                    elif self.port.holds(key):  # (dirty, or not unread long enough)
                        want.append(key)
                        self.unread[key] = n
        if not want:
            return {}
        with self.d.metered("fetch"):
            fetched = self.l3.get_many(want)
        self.stats.bump("fetched", len(fetched))
        for key in fetched:  # (one GET each, as INFO counts)
            g = self.groups.of(key)
            self.load[g] = self.load.get(g, 0) + 1
        return fetched

    def _pull_entry(self, g: int, entry: FeedEntry,
                    fetched: dict[str, L3Record | None | CorruptRecord], applied: set[str]
                    ) -> None:
        """Apply one feed entry of group ``g`` (set aside if it fails): its record (inline),
        or the record ``fetched`` for its key (value-less; applied at the key's first
        entry, which adds the key to ``applied``). Raises Unavailable."""
        if entry.key is None:
            self.q.set_aside(f"feed entry {entry.id.decode(errors='replace')} of group {g}",
                            entry.problem)
            return
        key = entry.key
        if entry.note is not None:
            self._pull_note(key, entry.note, fetched, applied)
            return
        if self.d.pusher.own_echo(key, entry.record):
            # this daemon's own push, stored by L3 exactly as sent (not a merge), coming
            # back: L2 holds it (delivered) or a newer write of its own (dirty, never to be
            # replaced by it), and the key filter has the key since it was staged; nothing
            # to decode or merge. (A record of an earlier life of the host, the replays the
            # holdback defences are for, is never in own_sent: it is decoded and merged.)
            self.stats.bump("echoes")
            return
        try:
            rec = read_record(entry.record, key, self.max_value_size)
        except CorruptRecord as exc:
            self.stats.corrupt += 1
            self.q.set_aside(key, f"feed: {exc}")
            return
        self.hosts.saw(rec.dot[0], _ms(self.clock()))
        if self.skew.observe(rec.hlc, self.hlc_ms()):
            self._skewed(key, rec)
        # our own writes come back too: the merge finds them equal (a no-op), but a
        # record L3 merged from ours and another host's must still be taken
        if not rec.tombstone:
            self.keys.add(key.encode("utf-8"))
        if not self.wants(key):
            self.stats.skipped_remote += 1
            self.skipped.remember(key, rec, self.clock())
            return  # not held here: the next read goes to L3
        if self.q.guarded(key, "feed", self.apply_or_forget, key, rec):
            self.stats.pulled += 1

    def _skewed(self, key: str, rec: L3Record) -> None:
        """A remote write stamped further ahead of this host's clock than
        cluster.max_clock_skew: merged all the same (acknowledged on its host), counted,
        and logged at the 1st, 2nd, 4th, 8th... such write."""
        self.stats.bump("clock_skew")
        n = self.skew.beyond
        if n & (n - 1) == 0:
            log.warning("a write of host %s to %r is stamped %d ms ahead of this host's "
                        "clock, over cluster.max_clock_skew (%d ms): it is merged, and wins "
                        "last-writer-wins over this host's later writes of the key until the "
                        "clocks agree; check the hosts' clock sync (%d such writes so far)",
                        rec.dot[0], key, self.skew.last_ahead_ms, self.skew.max_skew_ms, n)

    def _pull_note(self, key: str, note: FeedNote,
                   fetched: dict[str, L3Record | None | CorruptRecord], applied: set[str]
                   ) -> None:
        """A value-less entry: apply the record read for it, if any (once per poll)."""
        self.hosts.saw(note.writer, _ms(self.clock()))
        if not note.tombstone:
            self.keys.add(key.encode("utf-8"))
        if key in applied:  # an earlier entry of this poll applied the record read
            return
        if key not in fetched:
            if self.wants(key) and echo(note, self.host, self.port.write_sequence()):
                self.stats.bump("echoes")  # this host's own write: L2 has it, or newer
            else:  # (wanted only since the batch was read: as a skipped change, for a fill)
                self.stats.skipped_remote += 1
                self.skipped.remember(key, note, self.clock())
            return
        applied.add(key)
        rec = fetched[key]
        if rec is None:  # gone from L3 since (a failover lost it: the rewind is resynced)
            self.stats.bump("fetch_missing")
            return
        if isinstance(rec, CorruptRecord):
            self.stats.corrupt += 1
            self.q.set_aside(key, f"feed: {rec}")
            return
        if vector_get(rec.vector, note.writer) < note.counter:
            self.stats.bump("fetch_behind")  # L3 lost the entry's write: a rewind, resynced
        if self.q.guarded(key, "feed", self.apply_or_forget, key, rec):
            self.stats.pulled += 1

    def refill(self, due: dict[str, L3Record | FeedNote], fetch: bool = True) -> None:
        """Apply the skipped changes ``due`` over late fills: a record as it is, a note's
        key read from L3 (all in one batch; when L3 cannot be reached, or not ``fetch``,
        the notes are kept in ``refetch`` for the next round)."""
        self.stats.bump("refills", len(due))
        reread: set[str] = set()  # skipped records concurrent with the fill: L3 says which
        for key, got in list(due.items()):
            if got is REREAD and not self.wants(key):
                del due[key]  # (left L2 since: its next read goes to L3)
                continue
            # (guarded: a record whose stored vector is junk is that key's problem, set
            # aside, not a SegmentError that would end the daemon)
            if isinstance(got, FeedNote) and self.q.guarded(key, "refill", self._covers_note,
                                                           key, got) is True:
                del due[key]  # (the fill is that change, or newer: a second GET for nothing)
                self.stats.bump("refills_covered")
            elif isinstance(got, L3Record) and self.q.guarded(key, "refill", self._lost_since,
                                                              key, got) is True:
                reread.add(key)
                self.stats.bump("refills_lost")
        notes = [key for key, got in due.items() if isinstance(got, FeedNote) or key in reread]
        fetched: dict[str, L3Record | None | CorruptRecord] = {}
        try:
            if notes and not fetch:
                raise Unavailable("partition mode")
            if notes:
                with self.d.metered("fetch"):
                    fetched = self.l3.get_many(notes)
        except Unavailable:
            for key in notes:
                self.refetch[key] = due.pop(key)
        for key, got in due.items():
            rec = got if isinstance(got, L3Record) and key not in reread else fetched.get(key)
            if isinstance(rec, CorruptRecord):
                self.stats.corrupt += 1
                self.q.set_aside(key, f"feed: {rec}")
            elif rec is not None:
                self.q.guarded(key, "feed", self.apply_or_forget, key, rec)

    def _lost_since(self, key: str, record: L3Record) -> bool:
        """Whether the skipped ``record`` is concurrent with the clean record L2 holds of
        ``key`` (a fill): L3 held both, and each descends from every record L3 held before
        it, so a failover took one of them from L3 between the two. Not merged (L2 would
        hold what L3 lost, under no dot of this host): :meth:`refill` reads L3's record
        now and applies that (a clean copy of what L3 lost is replaced: :meth:`apply`).
        Which one was lost depends on the order: the skipped change (its writer sends it
        again), or a fill read before the failover that landed after it."""
        if self.port.dirty_record(key) is not None:
            return False
        vector = self.port.held_vector(key)
        return vector is not None and compare_vectors(record.vector, vector) is Ordering.CONCURRENT

    def _covers_note(self, key: str, note: FeedNote) -> bool:
        """Whether L2's record of ``key`` already holds the change ``note`` announces, or
        one that saw it: its vector covers the note's dot. Not for a merge (its vector
        is news to every host) nor a dot of this host (L2 may have lost it: a dot past the
        host's write sequence is from an earlier life of L2, see ``echo``)."""
        if note.merged or note.writer == self.host:
            return False
        vector = self.port.held_vector(key)
        return vector is not None and vector_get(vector, note.writer) >= note.counter

    def apply(self, key: str, record: L3Record) -> bool:
        """Write an L3 record into L2 (clean), unless L2 already holds something newer.
        Returns True.

        A record that covers a write of this host L2 holds dirty is held back instead
        (:attr:`held_back`) until that write is delivered (:meth:`release`): merged now, it
        would make the write clean — evictable, and left out of a restarted daemon's
        replay — on the strength of a record no durable answer vouched for (the write's
        own push answered not durable, or short of cluster.wait_replicas: the record read
        is that push's, or a merge of it, which a failover may still lose, and with the
        write gone from L2 nothing would send it again). The write's pending push is
        answered in turn, and its answer brings L3's record.

        A clean record of L2 with no write of this host in it that is concurrent with
        L3's holds writes a failover took from L3 (L3's record descends from every one it
        held): it is replaced, not merged. Their writers send them again (see
        :meth:`_resync_key`); a merge would be a record to publish with no dot of this
        host to publish it under.

        Raises CorruptRecord (the value does not decode), ValueTooLarge or another
        KVCommError (L2 cannot take it): the caller sets the record aside.
        """
        local = self.port.held_vector(key)
        if local is not None:
            mine = vector_get(local, self.host)
            if mine == 0:
                if (compare_vectors(record.vector, local) is Ordering.CONCURRENT
                        and self.port.forget(key)):
                    self.stats.bump("replaced_lost")
            elif vector_get(record.vector, self.host) >= mine and self._hold_back(key, record):
                return True
        self.port.apply_remote(key, record)
        return True

    def _hold_back(self, key: str, record: L3Record) -> bool:
        """Whether ``record`` covers the dot of the dirty record L2 holds of ``key`` (then
        kept in :attr:`held_back`, the newer of it and what was kept).

        Past :attr:`held_back_max` (records can be large) the oldest held record is
        dropped, not merged (merged, it would make its write clean: the loss the hold-back
        is for), counted ``held_back_dropped``, and its key remembered in :attr:`dropped`:
        once the write is delivered, :meth:`release` has the key read from L3 again, and
        what L3 holds then (the dropped record or one that descends from it) is applied,
        so no other host's write in it is lost to this host. A held record that no longer
        covers a dirty write (its write was delivered, or superseded, and no release came)
        is merged, as release would. Past :attr:`dropped_max` remembered keys the oldest
        is read again at the next round (:attr:`refetch`, counted ``held_back_early``):
        what L3 answers is applied through :meth:`apply` like any record, so it is held back
        again while its write is still dirty, and merged once it is not — a read too
        early, never a write made clean or missed."""
        if not self._covers_dirty(key, record):
            return False
        kept = self.held_back.pop(key, None)
        if kept is not None and compare_vectors(record.vector, kept.vector) is Ordering.BEFORE:
            record = kept
        self.held_back[key] = record
        if kept is None:
            self.stats.bump("held_back")
        while len(self.held_back) > self.held_back_max:
            old = next(iter(self.held_back))
            rec = self.held_back.pop(old)
            if self._stale(old, rec):
                self.q.guarded(old, "feed", self.apply_or_forget, old, rec)
                continue
            self.stats.bump("held_back_dropped")
            self.dropped.pop(old, None)
            self.dropped[old] = None
            while len(self.dropped) > self.dropped_max:
                first = next(iter(self.dropped))
                del self.dropped[first]
                self.stats.bump("held_back_early")
                self._reread_later(first)
        return True

    def _covers_dirty(self, key: str, record: L3Record) -> bool:
        """Whether ``record`` covers the dot of the dirty record L2 holds of ``key``. Dots
        of this host past its write sequence are an earlier life's (L2's merge rebases
        the write)."""
        dirty = self.port.dirty_record(key)
        if dirty is None:
            return False
        own = vector_get(record.vector, self.host)
        return 0 < dirty.dot[1] <= own <= self.port.write_sequence()

    def _stale(self, key: str, record: L3Record) -> bool:
        """Whether the held ``record`` no longer covers a dirty write of ``key`` (False
        when L2 cannot say: a junk record, set aside elsewhere). Raises Unavailable."""
        try:
            return not self._covers_dirty(key, record)
        except Unavailable:
            raise
        except Exception:  # (kept as a dropped one: read again, never merged unknown)
            return False

    def release(self, key: str) -> None:
        """A push of ``key`` was answered (its write delivered, or written again): merge
        the record held back for it, if any (held back again if it still covers a dirty
        write); a key whose held record was dropped past the bound is read from L3 again
        now, and what L3 holds applied (when L3 cannot be read: :attr:`refetch`, at the
        next round's refill). Raises what :meth:`apply` raises."""
        if key in self.dropped:
            del self.dropped[key]
            self.stats.bump("held_back_reread")
            try:  # (now, not at the next round: a daemon killed meanwhile would leave
                # the write clean without what L3 merged into it, the feed read past it)
                self.q.guarded(key, "feed", self._read_again, key)
            except Unavailable:
                self._reread_later(key)
        record = self.held_back.pop(key, None)
        if record is not None:
            self.apply_or_forget(key, record)

    def _read_again(self, key: str) -> bool:
        """Read ``key`` from L3 and apply what L3 holds. Raises Unavailable, CorruptRecord
        and what :meth:`apply` raises."""
        record = self.l3.get(key)
        if record is not None:
            self.apply_or_forget(key, record)
        return True

    def _reread_later(self, key: str) -> None:
        """Have ``key`` read from L3 again and what L3 holds applied at the next round
        (:meth:`refill`, with the skipped changes; kept while L3 cannot be read)."""
        self.refetch[key] = REREAD

    def apply_or_forget(self, key: str, record: L3Record) -> bool:
        """:meth:`_apply`; if this host's L2 can never hold ``record``, drop the host's
        stale copy instead (its reads then go to L3), and still raise (set aside)."""
        try:
            return self.apply(key, record)
        except ValueTooLarge:
            if self.port.forget(key):
                self.stats.bump("forgotten")
            raise

    def save_state(self) -> None:
        """Save the feed cursors and sequence numbers that changed (not those of a
        pending resync). Raises Unavailable."""
        cursors, seqs = self.inb.saveable()
        if cursors and self.q.guarded(f"kvn:{{{self.host}}}:cursors", "saving feed cursors",
                                     self._save_cursors, cursors, seqs):
            self.inb.saved(cursors, seqs)

    def _save_cursors(self, cursors: dict[int, bytes], seqs: dict[int, int]) -> bool:
        self.l3.save_cursors(self.host, cursors, seqs)
        return True

