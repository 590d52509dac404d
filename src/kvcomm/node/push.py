"""The node daemon's local → L3 path: the host's writes read from L2's change feed and
pushed to L3, and L3's answers carried out (docs/design/daemon.md, theory of
operation, 1). The decisions are :class:`kvcomm.node.delivery.Outbound`'s; this part
drives it: it reads L2, reserves the host's write mark, sends each push, counts its
load, and applies what L3 answered.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..core.resolve import CONFLICT, EQUAL, MERGED, NEW, NEWER, OLDER
from ..errors import CorruptRecord, KVCommError, Unavailable
from ..tiers.l2 import KIND_DELETE, KIND_PUT
from ..tiers.l3 import (
    PUSH_BATCH,
    PUSH_BATCH_BYTES,
    PUSH_CALL,
    PUSH_KEPT,
    PUSH_STORED,
    WRITE_MARK_MAX,
    L3Record,
    PushResult,
    Unreached,
    approx_size,
)
from .delivery import CORRUPT, NOT_DURABLE, UNREACHED, Answer, Outbound, Push

if TYPE_CHECKING:
    from .daemon import Daemon

log = logging.getLogger("kvcomm.node")
CONFIRM_EVERY = 1.0  # seconds between probes of the masters holding unconfirmed records
UNREACHED_RETRY = 0.05  # seconds before a push none of whose masters answered is tried again
WRITE_MARK_BLOCK = 1 << 20  # dots reserved ahead in L3's write mark (one save per block)
OWN_SENT_MAX = 1 << 17  # own pushes remembered until their echo (Pusher.own_sent)
OWN_SENT_BYTES = 8 << 20  # and their bytes at most (an entry may be cluster.feed_inline: 1 MiB)


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


class Pusher:
    """The host's writes to L3: owns the outbound machine (:attr:`out`), the delivered
    cursor L2 holds, the write mark, the own pushes awaiting their echo, and the groups
    whose key index holds deadlines."""

    def __init__(self, d: Daemon, out: Outbound) -> None:
        self.d = d
        self.port, self.l3, self.keys, self.q = d.port, d.l3, d.keys, d.quarantine
        self.clock, self.host, self.stats, self.groups = d.clock, d.host, d.stats, d.groups
        self.load, self.hosts = d.load, d.hosts
        self.out = out
        self.persisted = out.cursor  # the delivered cursor L2 holds
        self.confirm_at = d.clock()  # the next probe of the masters holding unconfirmed records
        # groups this host stored records with a deadline in: group -> (next check, last
        # deadline), for dropping expired keys from L3's key index (_note_deadline)
        self.ttl_groups: dict[int, tuple[float, float]] = {}
        self.ups_seen = 0  # DaemonL3.ups when the parked writes were last sent again
        # key -> the bytes of this daemon's last push of it that L3 stored as sent (new,
        # newer): its inline feed entry, when it comes back, is known without decoding it
        self.own_sent: dict[str, bytes] = {}
        self.own_sent_bytes = 0  # (the bytes own_sent holds: bounded by OWN_SENT_BYTES)
        # how far this host's pushed dots may go, in any life of its L2 (_reserve): a new
        # L2 (nothing delivered from it yet) whose sequence restarted lower (a clock set
        # back) moves past it before any record of L3 is merged in, so that no old dot
        # covers a new write (an L2 that delivered already has moved, or never needed to)
        self.write_mark = self.l3.load_write_mark(self.host)

    def push_local(self, now: float, push: bool = True) -> None:
        """Read the local feed, push what is due, persist the delivered cursor. Without
        ``push`` (partition mode, Redis silent), only read and stage: the host's writes
        are read from L2 as they are made, not all at once on the heal, which then only
        sends them (and the skipped changes whose records must be read from L3 wait in
        ``refetch``)."""
        events, cursor, overflowed = self.port.feed_read(self.out.cursor)
        written = [ev.key for ev in events
                   if ev.kind in (KIND_PUT, KIND_DELETE)]  # evictions stay local
        keys: Iterable[str] = written
        if overflowed:
            self.stats.feed_overflows += 1
            keys = [*self.port.dirty_keys(), *written]
        records: list[tuple[str, L3Record | None]] = []
        for key in dict.fromkeys(keys):
            record = self.q.guarded(key, "local write", self.port.dirty_record, key)
            if isinstance(record, L3Record):  # (None: clean or gone; False: set aside)
                if not record.tombstone:
                    self.keys.add(key.encode("utf-8", "surrogateescape"))
                records.append((key, record))
        self.out.read(cursor, records, now)
        due = self.d.puller.refetch  # (notes whose records could not be read last time)
        self.d.puller.refetch = {}
        for key in written:  # a fill from L3 may be older than a change skipped meanwhile
            if (skipped := self.d.puller.skipped.take(key, now)) is not None:
                due[key] = skipped
        if due:
            self.d.puller.refill(due, fetch=push)
        if push and not self.push(now) and self.d.partition.healed_meanwhile():
            # the heal came while the failed call waited (seconds, on a cut connection):
            # what was written meanwhile is read, and the whole backlog pushed, now,
            # before this round reads the other hosts' changes
            self.push_local(self.clock())
            return
        delivered = self.out.delivered()
        if delivered != self.persisted:  # everything before it is in L3
            self.port.delivered_up_to(delivered)
            self.persisted = delivered

    def push(self, now: float) -> bool:
        """Push every closed window that is due, each answered (and its answers carried
        out) before the next; stop at the first failure. Returns False if one failed.
        The writes parked for a master taken for down (Outbound.parked) go again once a
        master leaves DaemonL3.down (or none is down)."""
        if self.out.parked:
            ups = self.l3.ups
            if ups != self.ups_seen or not self.l3.down:
                self.ups_seen = ups
                self.stats.bump("unparked", self.out.unpark(now))
        while True:
            push = self.out.next_push(now, self.port.has_resolver, self._shape)
            if push is None:
                return True
            try:
                self._reserve(push)
            except Unavailable as exc:
                self._push_failed(push, exc)
                return False
            items = [(i.key, i.record) for i in push.items]
            try:
                with self.d.metered("push"):
                    results = self.l3.push_many(items, push.keep_siblings)
            except Unreached as exc:  # every item's master is down (DaemonL3.down)
                self._unreached(push, exc)
                return False
            except Unavailable as exc:
                self._push_failed(push, exc)
                return False
            self._pushed(push, results)

    def _unreached(self, push: Push, exc: Unreached) -> None:
        """No item of ``push`` was sent: their masters are down (the others answer, or
        the whole cluster is cut off: then partition mode comes, as no call is answered).
        They are staged again, to go with the next window, no sooner than UNREACHED_RETRY
        from now (an idle wait: nothing is sent to a master taken for down)."""
        self.out.pushed(push, [exc] * len(push.items), self.clock(), self.port.write_sequence())
        self.stats.bump("unreached", len(push.items))
        self.out.retry_at = self.clock() + UNREACHED_RETRY

    def _reserve(self, push: Push) -> None:
        """Before ``push`` goes out: make L3's write mark cover its dots (and a block
        more, so that the mark is saved once per WRITE_MARK_BLOCK writes). Dots leave
        the host only in pushes, so every dot of this host in L3 is at most the mark.
        Raises Unavailable (the push is not sent)."""
        top = max((i.record.dot[1] for i in push.items if i.record.dot[0] == self.host),
                  default=0)
        if top > self.write_mark:
            mark = min(top + WRITE_MARK_BLOCK, max(top, WRITE_MARK_MAX))
            self.l3.save_write_mark(self.host, mark)
            self.write_mark = mark

    def _push_failed(self, push: Push, exc: Exception) -> None:
        delay = self.out.push_failed(push, self.clock())
        if not isinstance(exc, Unavailable):
            log.warning("a push failed (%s: %s); retried", type(exc).__name__, exc)
        self.d.l3_failed(self.out.backoff, "sending to L3", exc, delay)

    def _pushed(self, push: Push, results: list[PushResult | CorruptRecord | Unreached]) -> None:
        """Carry out L3's answers to ``push``."""
        self.stats.windows += 1 + len(push.more)
        self.stats.pushed += len(push.items)
        self.d.partition.reach.redis_ok(self.clock())
        self.stats.bump("window_in", push.window.ops_in + sum(w.ops_in for w in push.more))
        per_group: dict[int, int] = {}
        group_bytes: dict[int, int] = {}  # (a call also takes at most PUSH_BATCH_BYTES)
        inline = self.l3.feed_inline  # (larger: a value-less entry, see echo)
        if len(self.own_sent) > OWN_SENT_MAX or self.own_sent_bytes > OWN_SENT_BYTES:
            self.own_sent.clear()  # (echoes never read: a resync skipped them)
            self.own_sent_bytes = 0
        for item, res in zip(push.items, results, strict=False):
            if isinstance(res, Unreached):  # (not sent)
                continue
            g = self.groups.of(item.key)  # (counted in Redis commands, as INFO counts)
            stored = isinstance(res, PushResult) and res.outcome in (NEW, NEWER, MERGED)
            self.load[g] = self.load.get(g, 0) + (PUSH_STORED if stored else PUSH_KEPT)
            per_group[g] = per_group.get(g, 0) + 1
            group_bytes[g] = group_bytes.get(g, 0) + approx_size(item.record)
            if (isinstance(res, PushResult) and res.sent and res.outcome in (NEW, NEWER)
                    and (inline is None or len(res.sent) <= inline)):
                if self.own_sent_bytes + len(res.sent) > OWN_SENT_BYTES:
                    self.own_sent.clear()  # (as above: bytes, not only entries, bounded)
                    self.own_sent_bytes = 0
                old = self.own_sent.get(item.key)
                self.own_sent[item.key] = res.sent
                self.own_sent_bytes += len(res.sent) - (0 if old is None else len(old))
            if stored and b"\xa1e" in item.record.ext:  # (a deadline, maybe: see expiry)
                self._note_deadline(g, item.record.deadline)
        for g, n in per_group.items():  # (one script call per group and PUSH_BATCH records)
            self.load[g] += PUSH_CALL * max(-(-n // PUSH_BATCH),
                                            -(-group_bytes[g] // PUSH_BATCH_BYTES))
        answers = self.out.pushed(push, results, self.clock(), self.port.write_sequence())
        for answer in answers:
            try:  # every answer is carried out: they have left the staged set
                self.q.guarded(answer.key, "push to L3", self._carry_out, answer)
            except Unavailable as exc:  # L2's merge lost races to local writers: the
                # newer local write is pushed in turn, and its answer taken then
                self.stats.bump("answers_not_taken")
                log.warning("could not take L3's answer for %r: %s", answer.key, exc)
        self._settle_unconfirmed()

    def _settle_unconfirmed(self) -> None:
        """Deliver (clean in L2) the unconfirmed records a probe acknowledged by
        ``cluster.wait_replicas`` replicas since covers (on their master, in the
        replication history they were written in), and those the bound released;
        publish the count held (stats ``unconfirmed``)."""
        released, self.out.released = self.out.released, []
        if released:
            self.stats.bump("unconfirmed_released", len(released))
            log.warning("%d record(s) acknowledged by fewer Redis replicas than "
                        "cluster.wait_replicas are no longer held (over %d held): a failover "
                        "before any host reads them may lose them", len(released),
                        self.out.unconfirmed.limit)
        confirmed = self.out.unconfirmed.confirm(self.l3.confirmed)
        self.stats.bump("unconfirmed_confirmed", len(confirmed))
        for held in (*released, *confirmed):
            self.q.guarded(held.key, "deliver", self._deliver, held.key, held.record)
        self.stats.extra["unconfirmed"] = len(self.out.unconfirmed)

    def probe_unconfirmed(self, now: float) -> None:
        """Every CONFIRM_EVERY seconds while records are held unconfirmed: a probe write
        and WAIT on each master holding some (:meth:`DaemonL3.confirm_replicated`): an idle
        host learns when its replicas caught up; and the groups of those whose master
        left the history they were written in are resynced as after a rewind (which
        sends them again). Raises Unavailable."""
        if not len(self.out.unconfirmed) or now < self.confirm_at:
            return
        self.confirm_at = now + CONFIRM_EVERY
        for node, group in self.out.unconfirmed.nodes().items():
            self.l3.confirm_replicated(group, node)
        # a master seen in another replication history than a held record was written in
        # (a failover and back at the same address, a restart) may have lost it: a rewind
        # (and a group whose slot moved off the master that took its held records)
        unserved = self.l3.unserved
        taken = set(unserved)
        unserved.clear()
        rewound = self.out.unconfirmed.rewound(self.l3.histories, taken)
        if rewound:
            self.stats.bump("unconfirmed_rewound", len(rewound))
            self.d.puller.resync(rewound, reason="rewind")
        self._settle_unconfirmed()

    def own_echo(self, key: str, record: bytes) -> bool:
        """Whether ``record`` (a feed entry's bytes) is this daemon's own last push of
        ``key`` as L3 stored it (then forgotten: its echo came back)."""
        if self.own_sent.get(key) != record:
            return False
        self.own_sent_bytes -= len(self.own_sent.pop(key))
        return True

    def _note_deadline(self, g: int, deadline: float | None) -> None:
        """This host stored a record with ``deadline`` in group ``g``: the group's key index
        is to be cleaned once it passes (``ttl_groups``: group -> (next check, last
        deadline); the I/O driver's _maybe_expire_index does it)."""
        if deadline is None:
            return
        lo, hi = self.ttl_groups.get(g, (deadline, deadline))
        self.ttl_groups[g] = (min(lo, deadline), max(hi, deadline))

    def _deliver(self, key: str, record: L3Record) -> None:
        """Mark ``record`` delivered; then merge what L3 sent of the key meanwhile (held
        back while the write was dirty: Puller.apply)."""
        self.port.mark_delivered(key, record)
        self.d.puller.release(key)

    def _shape(self, record: L3Record) -> L3Record:
        return self.hosts.shape(record, _ms(self.clock()))

    def _carry_out(self, answer: Answer) -> None:
        """Apply L3's answer to one pushed record. Raises what L2 raises (the caller sets
        the record aside)."""
        if answer.rebase and answer.take is not None:  # this host's L2 was lost: the
            self.stats.bump("rebased")  # write is new, not older: written again past L3's
            try:
                if not self.port.rebase(answer.key, answer.take):
                    self.d.puller.apply(answer.key, answer.take)
            except BaseException:
                self._release_quietly(answer.key)
                raise
            self.d.puller.release(answer.key)
            return
        if answer.outcome in (NEW, NEWER, EQUAL):
            self.stats.accepted += 1
        elif answer.outcome in (OLDER, MERGED):
            self.stats.refreshed += 1
        elif answer.outcome == CONFLICT:  # a resolver's prefix: L2 settles it (a new write)
            self.stats.bump("resolved")
        elif answer.outcome == NOT_DURABLE:
            self.stats.bump("not_durable")
        elif answer.outcome == UNREACHED:  # (its master is down: staged again)
            self.stats.bump("unreached")
        if answer.unconfirmed:  # (kept dirty: Unconfirmed)
            self.stats.bump("unconfirmed_held")
        if answer.deliver:
            self.port.mark_delivered(answer.key, answer.sent)
        try:
            if answer.set_aside:  # retrying cannot help
                if answer.outcome == CORRUPT:
                    self.stats.corrupt += 1
                self.q.set_aside(answer.key, f"push to L3: CorruptRecord: {answer.set_aside}")
            elif answer.take is not None:
                self.d.puller.apply(answer.key, answer.take)
        except BaseException:
            if answer.deliver:  # (delivered all the same: what was held back for the
                self._release_quietly(answer.key)  # write is due; the first error stands)
            raise
        if answer.deliver:
            self.d.puller.release(answer.key)

    def _release_quietly(self, key: str) -> None:
        """Puller.release after an error that the caller raises (sets the key aside):
        the write was delivered, so what was held back for it is merged (or read again)
        now, not left waiting for an answer that has come; an error of the release itself
        is left to the first's (the key is set aside once)."""
        try:
            self.d.puller.release(key)
        except KVCommError:
            pass

