"""``kvcomm node``: the host daemon that keeps one host's L2 in sync with the cluster (L3).

Theory of operation
-------------------
Agents only ever touch L2 (and, on an L2 miss, read L3 once). The daemon does the rest,
in one loop. Its decisions — what to push and when, what L3's answers mean, which
cursor may be persisted, when a group's feed must be resynced, how long to back off —
are made by the state machines of :mod:`kvcomm.node.delivery`, which hold the whole
theory of delivery and do no I/O. This module is their *driver*: it reaches L2, the
key filter and L3 through the three ports of :mod:`kvcomm.node.port`, hands the
machines what it read, and carries out what they answer.

1. **Local → L3.** It reads the host's L2 change feed after the outbound cursor, hands
   the dirty record of every key put or deleted (every dirty key after an overflow) to
   the outbound machine, and pushes each closed write window to L3 in one pipeline of
   push-script calls per master node, one call per group of records
   (:class:`kvcomm.tiers.l3.L3Store`). L3's answers
   are carried out: writes L3 holds are marked delivered (L2 may now evict them);
   where L3 holds another record (newer, merged, a conflict for a resolver) that record
   is merged into L2. The feed position stored in the L2 header is the machine's
   delivered cursor: a daemon killed at any point replays from there. Vectors are
   pruned, by host activity, before they are pushed. Before a push, the host's *write
   mark* in L3 (``kvn:{host}:wseq``) is made to cover its dots (a block ahead: one save
   per WRITE_MARK_BLOCK writes); a daemon that starts on a new L2 (nothing delivered from
   it yet) first moves that L2's unacknowledged writes past the mark, so that a write
   sequence restarted lower (a clock set back) never lets an old dot of the host cover a
   new write. (Should the mark be lost, L2's merge does the same on meeting a version
   that names this host's dots past its sequence: ``Client._merge``.) A push is made in
   the loop and its answers carried out before anything else (a push sent from a thread
   and answered a round later was tried and removed: it widened the window in which the
   host met its own old records before the push was answered).
2. **L3 → local.** It reads a group's L3 change feed (Redis Streams, one per
   hash-slot group, bounded) after a per-group cursor that lives in L3
   (``kvn:{host}:cursors``, so a restarted daemon — or one whose connection dropped —
   resumes where it was) when the group changed: a hint on the group's sharded pub/sub
   channel says so, or the group's counter does (the sweep reads every counter, a slice
   at a time; the groups whose hints may have been lost are checked at once). The hint
   of a value-less entry carries the entry: one that follows the group's last sequence
   number is applied without reading the stream at all. A change to a key this host
   wants (L2 holds it, or a local watcher asks for it: ``wants``) is merged into L2
   (its own writes echo back as no-ops); keys it does not want are left to the read
   path. Entries of large records are value-less (key and dot,
   :mod:`kvcomm.tiers.l3`): the records of the wanted keys among them are read from L3
   in one batch per poll, before any entry of the poll is applied — so a host pays for
   the values of the keys it holds only; and of those, only for the keys an agent read
   since their last changes (a key no agent read leaves L2 instead: interest decays, see
   ``cluster.unread_changes``; the loop's own reads and writes of L2 are quiet).
   A group whose sequence numbers show a gap or a rewind is resynced: its position
   taken, its keys added to the key filter, its keys that L2 holds re-read from L3. An
   idle cluster costs each daemon the sweep's few commands a second, whatever the
   number of groups.
3. **Prewarm.** Every couple of seconds the host's hot keys (the host-wide sketch of
   agents' reads) are saved to L3 and any of them missing from L2 (evicted, say) are
   read back in; a daemon that starts prewarms L2 from the list its predecessor saved.
4. **The host's filter of existing keys** (:mod:`kvcomm.tiers.keyfilter`): built from a
   scan of L3 at start, fed with every key seen in the feeds, rotated now and then so
   deleted keys age out. Agents ask it before an L3 read: absent keys stay on the host.
   A master that does not answer the start's scan (it hangs) is left out, and the
   filter distrusted as during a heal's catch-up until its groups are scanned, once it
   answers (``unscanned``); no rotation is made while a master is taken for down.
5. **Load.** The Redis commands it causes on each group (a push that stores: the six
   commands the script runs for it; one that does not: one; each script call, of up to
   PUSH_BATCH records of the group: one more; a feed read: one) are
   counted and saved to L3 (``kvn:{host}:load``, cumulative) every couple of seconds
   when they changed: ``kvcomm balance`` adds them up over every host into the load of
   each slot, in the unit Redis' INFO counts a node's.
6. **Heartbeat** in the L2 header and in the key filter's header, so agents and tools
   can see the daemon is alive (agents trust the filter only while it beats).
6. **Placement** (:class:`NodeDaemon` only): once a second, the host's agent reports
   (who read whose keys, sampled) are published to L3 as ``kvn:{host}:agents``
   (:mod:`kvcomm.placement.observe`), for ``kvcomm placement observe``.

In partition mode (node/presence.py) each round starts with one PING of one master
(:meth:`L3Store.reachable`) and, until Redis answers, only reads and stages the host's
local writes (nothing is sent), so that the heal is seen within one ``cluster.timeout``
instead of after a round of calls that each wait a timeout per seed, and the heal's
first round only sends the backlog. The catch-up (the backlog retried at once, every
group's counter checked, the key filter distrusted until the feeds are read) starts at
the first round Redis answers, even while partition mode waits for etcd too.

When L3 is unreachable, nothing is dropped: the unsent windows are kept and retried with
capped exponential backoff with jitter (:mod:`kvcomm.core.backoff`, so that hosts do
not retry in lockstep after an outage), agents keep writing into L2, and once
``cluster.outbound_max`` writes are waiting, ``put`` raises ``Unavailable`` instead of
losing them.

Input never kills the daemon
----------------------------
Everything the daemon reads from L3 may have been written by something else. A record
that fails — it does not decode (CorruptRecord), L2 cannot take it (ValueTooLarge or
any KVCommError), its key cannot be sent to Redis, or anything unexpected happens while
handling that one record — is logged, counted (``stats.quarantined``), pushed to the
capped L3 list ``kvn:{host}:quarantine`` ("set aside") when L3 is reachable, and
skipped; the loop goes on. A round that fails as a whole is retried with backoff. The
process exits only on SIGTERM/SIGINT, on a configuration error (ConfigError: bad
cluster settings or resolvers), or when its own L2 segment or key filter cannot be used
(SegmentError: purged, foreign, or another user's).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Set
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .._client import Client
from .._client import open as kv_open
from ..clock import clock_for
from ..config import Config
from ..core.backoff import Backoff
from ..core.resolve import CONFLICT, EQUAL, MERGED, NEW, NEWER, OLDER
from ..core.versions import Ordering, SkewMonitor, compare_vectors, vector_get
from ..core.window import WriteWindow
from ..errors import ConfigError, CorruptRecord, SegmentError, Unavailable, ValueTooLarge
from ..placement.observe import HostPublisher
from ..tiers.groups import groups as groups_of
from ..tiers.keyfilter import KeyFilter
from ..tiers.l2 import KIND_DELETE, KIND_PUT
from ..tiers.l3 import (
    PUSH_BATCH,
    PUSH_BATCH_BYTES,
    PUSH_CALL,
    PUSH_KEPT,
    PUSH_STORED,
    WRITE_MARK_MAX,
    FeedEntry,
    FeedNote,
    L3Record,
    L3Store,
    PushResult,
    Unreached,
    approx_size,
    read_record,
)
from .delivery import (
    CORRUPT,
    FEED_COUNT,
    NOT_DURABLE,
    UNCONFIRMED_MAX,
    UNREACHED,
    Answer,
    HostActivity,
    Inbound,
    Outbound,
    Poll,
    Push,
    Reading,
    Skipped,
    echo,
)
from .port import ClientPort, HostKeys, HostL2, L3Port
from .presence import HostPresence, Reachability, status_path, write_status
from .watched import WatchedPrefixes

log = logging.getLogger("kvcomm.node")
HOT_KEYS = 64  # hot keys saved and kept in L2 per host
HOT_EVERY = 2.0  # seconds between saves of the hot keys (and the prewarm that follows)
QUARANTINE_QUIET = 60.0  # the same key is pushed to the quarantine list at most this often
CONFIRM_EVERY = 1.0  # seconds between probes of the masters holding unconfirmed records
MERGE_WINDOWS = 8  # closed windows waiting together go out in one push (a backlog)
UNREACHED_RETRY = 0.05  # seconds before a push none of whose masters answered is tried again
WRITE_MARK_BLOCK = 1 << 20  # dots reserved ahead in L3's write mark (one save per block)
OWN_SENT_MAX = 1 << 17  # own pushes remembered until their echo (Daemon.own_sent)
# how long the lease thread waits for the reach lock or a live master's PING at a tick:
# it renews the etcd lease and writes the status file, so it never waits on Redis (a
# PING that does not answer within this is looked at again at the next tick)
LEASE_WAIT_S = 0.2
OWN_SENT_BYTES = 8 << 20  # and their bytes at most (an entry may be cluster.feed_inline: 1 MiB)


@dataclass
class DaemonStats:
    pushed: int = 0  # records sent to L3
    windows: int = 0  # pushes (one closed window each)
    accepted: int = 0  # new / newer / equal
    refreshed: int = 0  # older / merged: L3's record written back into L2
    pulled: int = 0  # remote changes merged into L2
    skipped_remote: int = 0  # remote changes to keys this host does not hold
    corrupt: int = 0  # records that did not decode (each also counted in quarantined)
    l3_errors: int = 0
    resyncs: int = 0  # group resyncs: a gap or a rewind seen in a group's feed
    hinted: int = 0  # groups read because a hint said they changed
    swept: int = 0  # groups read because their counter said so (the sweep, lost hints)
    lost_hints: int = 0  # groups whose hints may have been lost (their counters checked)
    expired_unindexed: int = 0  # keys past their deadline dropped from L3's key index
    feed_overflows: int = 0
    quarantined: int = 0  # inputs set aside (logged, pushed to kvn:{host}:quarantine)
    step_errors: int = 0  # rounds that failed as a whole (retried with backoff)
    extra: dict[str, int] = field(default_factory=dict)

    def bump(self, name: str, n: int = 1) -> None:
        self.extra[name] = self.extra.get(name, 0) + n


class Daemon:
    """One host's sync loop over its ports: ``step()`` does one round, ``run()`` loops
    until stopped. The clock, the sleep and the wall clock (for the quarantine list's
    timestamps) are passed in; tests drive it over fakes.

    Starting builds the key filter, resumes the feeds and prewarms L2. Raises
    Unavailable (L3 cannot be reached: retry later) and SegmentError (the host's L2 or
    key filter cannot be used); the ports stay open: the caller closes them.
    """

    def __init__(self, config: Config, port: HostL2, l3: L3Port, keys: HostKeys, *,
                 rng: random.Random, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 wall: Callable[[], float] = time.time,
                 hlc_ms: Callable[[], int] | None = None) -> None:
        self.config, self.port, self.l3, self.keys = config, port, l3, keys
        self.rng, self.clock, self.sleep, self.wall = rng, clock, sleep, wall
        self.started = False  # __init__ done: the L2 heartbeat says so to tools
        self.host = port.host_id
        c, cl = config.cache, config.cluster
        now = clock()
        self.stats = DaemonStats()
        self.groups = groups_of(cl.groups)
        # (records pushed short of cluster.wait_replicas stay dirty until confirmed: a
        # quarter of the backlog's bound at most, the rest left to new writes)
        self.out = Outbound(self.host, port.delivered_cursor,
                            WriteWindow(c.l2_sync_interval, c.max_batch_ops, c.max_batch_bytes),
                            Backoff(rng, base=0.05, cap=2.0, floor=0.01), merge=MERGE_WINDOWS,
                            group_of=self.groups.of,
                            unconfirmed_max=min(UNCONFIRMED_MAX, max(1, cl.outbound_max // 4)))
        self.persisted = self.out.cursor  # the delivered cursor L2 holds
        self.inb = Inbound(cl.groups, cl.feed_poll, Backoff(rng, base=0.05, cap=2.0, floor=0.01),
                           now, sweep_rate=cl.feed_sweep_rate)
        self.inb.expected = self.out.unconfirmed.by_group  # (shared: a rewind check's input)
        self.confirm_at = now  # the next probe of the masters holding unconfirmed records
        self.load: dict[int, int] = {}  # group → operations made on it (cumulative)
        # groups this host stored records with a deadline in: group -> (next check, last
        # deadline), for dropping expired keys from L3's key index (_note_deadline)
        self.ttl_groups: dict[int, tuple[float, float]] = {}
        self.load_saved: dict[int, int] = {}  # what L3 holds of it
        self.hot_list: list[str] = []  # the hot keys last saved
        self.hosts = HostActivity(self.host, _ms(now))
        self.skipped = Skipped()  # remote changes to keys not held here, for a while
        self.refetch: dict[str, L3Record | FeedNote] = {}  # skipped changes to read again
        # keys a local watcher wants from the feeds though L2 does not hold them (a hook
        # for cluster-wide watches: see wants())
        self.watching: Callable[[str], bool] = _nobody
        self.wire_by: dict[str, list[int]] = {}  # push/feed/fetch/sweep → [sent, received]
        self.max_value_size = c.max_value_size
        # held keys leave L2 at this many remote changes in a row no agent read before
        # (0: never): unread[key] counts them (_fetch_wanted)
        self.unread_changes = cl.unread_changes
        self.unread: dict[str, int] = {}
        self.rebuild_every = cl.key_filter_rebuild
        self.set_aside_at: dict[str, float] = {}  # key → when last pushed to quarantine
        self.held_at_start: set[str] = set()
        # partition mode (node/presence.py): Redis or an etcd majority out of reach
        # longer than the lease TTL; etcd's side is the presence thread's (NodeDaemon)
        self.reach = Reachability(cl.lease_ttl, now)
        # (decide_partition runs in the loop, and from the lease thread while the loop is
        # stuck in Redis calls: a cut-off host's calls time out one after the other)
        self.reach_lock = threading.Lock()
        self.status_lock = threading.Lock()  # (write_status: the loop's and the lease thread's)
        # the lease thread's PING of a live master (enter_partition_if_due), running in a
        # thread of its own: (whether one answered, when it returned)
        self._live_probe: Future[tuple[bool, float]] | None = None
        self.presence: HostPresence | None = None
        self.last_pull = now  # the last feed read that succeeded (feed lag)
        # remote timestamps beyond cluster.max_clock_skew: counted and logged, not
        # refused (the write was acknowledged on its host); hlc_ms: this host's HLC clock
        self.hlc_ms = hlc_ms if hlc_ms is not None else clock_for(config)
        self.skew = SkewMonitor(max(1, round(cl.max_clock_skew * 1000)))
        self.last_flush: dict[str, Any] | None = None
        self.feed_counters: dict[int, int | None] = {}  # groups' counters at the last check
        self.probe_failed = False  # the last round found Redis silent (partition mode)
        # this poll's checks whose master was down, and whether a call reached nothing
        self.unanswered: set[int] = set()
        self.poll_skipped = False
        self.ups_seen = 0  # L3Store.ups when the parked writes were last sent again
        self.redis_back = False  # this partition's catch-up was started (see _catch_up)
        self.catching_up = False  # healed, the feeds not yet read up to their ends
        # groups whose keys the key filter may lack: their master did not answer the
        # start's scan (it hangs); scanned once it answers (_scan_unscanned), the filter
        # distrusted until then (the catch-up's: see step)
        self.unscanned: set[int] = set()
        self.unscanned_ups = -1  # L3Store.ups at the last try of those scans
        # key -> the bytes of this daemon's last push of it that L3 stored as sent (new,
        # newer): its inline feed entry, when it comes back, is known without decoding it
        self.own_sent: dict[str, bytes] = {}
        self.own_sent_bytes = 0  # (the bytes own_sent holds: bounded by OWN_SENT_BYTES)
        # the heal's timeline (logged): (when Redis answered, stats then, backlog logged)
        self.healing: tuple[float, int, int, bool] | None = None
        # how often changes to watched prefixes (node/watched.py: NodeDaemon sets
        # ``watching`` from them) may have been missed (a resync after a gap: the
        # watchers are told to rescan)
        self.watch_missed = 0
        # groups whose position came from hinted entries since the sweep last found their
        # stream ending there (_verify_hinted)
        self.hint_placed: set[int] = set()
        # how far this host's pushed dots may go, in any life of its L2 (_reserve): a new
        # L2 (nothing delivered from it yet) whose sequence restarted lower (a clock set
        # back) moves past it before any record of L3 is merged in, so that no old dot
        # covers a new write (an L2 that delivered already has moved, or never needed to)
        self.write_mark = self.l3.load_write_mark(self.host)
        if port.delivered_cursor == 0:
            moved = self.port.past_lost_dots(self.write_mark)
            if moved:
                self.stats.bump("lost_dots_moved", moved)
        self._fill_key_filter(initial=True)
        self._start_feeds()
        self.held_at_start.clear()
        self.hot_saved = clock()
        self.stats.bump("prewarmed", self._prewarm(self.l3.load_hot(self.host)))
        self.started = True

    @property
    def feed_seqs(self) -> dict[int, int | None]:
        """The last sequence number read, by group."""
        return self.inb.seqs

    # ------------------------------------------------------------------ bad input

    def _set_aside(self, key: str, reason: str) -> None:
        """Count, log and (if L3 answers) record an input the daemon skips. A key that
        keeps failing is logged and recorded once a minute, counted every time."""
        self.stats.quarantined += 1
        now = self.clock()
        if now - self.set_aside_at.get(key, -QUARANTINE_QUIET) < QUARANTINE_QUIET:
            log.debug("set aside %r again: %s", key, reason)
            return
        log.error("set aside %r: %s", key, reason)
        if len(self.set_aside_at) > 10_000:
            self.set_aside_at.clear()
        self.set_aside_at[key] = now
        try:
            self.l3.quarantine(self.host, key, reason, self.wall())
        except Unavailable as exc:
            log.warning("could not record %r in the quarantine list: %s", key, exc)

    def _guarded(self, key: str, where: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` for one record, or False when it failed. Any failure but
        Unavailable (which means "not now": the caller's round is retried) sets the
        record aside."""
        try:
            return fn(*args)
        except Unavailable:
            raise
        except Exception as exc:  # one record's failure, whatever it is, stops nothing else
            if isinstance(exc, CorruptRecord):
                self.stats.corrupt += 1
            self._set_aside(key, f"{where}: {type(exc).__name__}: {exc}")
            return False

    # ------------------------------------------------------------------ local → L3

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
            record = self._guarded(key, "local write", self.port.dirty_record, key)
            if isinstance(record, L3Record):  # (None: clean or gone; False: set aside)
                if not record.tombstone:
                    self.keys.add(key.encode("utf-8", "surrogateescape"))
                records.append((key, record))
        self.out.read(cursor, records, now)
        due = self.refetch  # (notes whose records could not be read last time)
        self.refetch = {}
        for key in written:  # a fill from L3 may be older than a change skipped meanwhile
            if (skipped := self.skipped.take(key, now)) is not None:
                due[key] = skipped
        if due:
            self._refill(due, fetch=push)
        if push and not self._push(now) and self._healed_meanwhile():
            # the heal came while the failed call waited (seconds, on a cut connection):
            # what was written meanwhile is read, and the whole backlog pushed, now,
            # before this round reads the other hosts' changes
            self.push_local(self.clock())
            return
        delivered = self.out.delivered()
        if delivered != self.persisted:  # everything before it is in L3
            self.port.delivered_up_to(delivered)
            self.persisted = delivered

    def _refill(self, due: dict[str, L3Record | FeedNote], fetch: bool = True) -> None:
        """Apply the skipped changes ``due`` over late fills: a record as it is, a note's
        key read from L3 (all in one batch; when L3 cannot be reached, or not ``fetch``,
        the notes are kept in ``refetch`` for the next round)."""
        self.stats.bump("refills", len(due))
        for key, got in list(due.items()):
            # (guarded: a record whose stored vector is junk is that key's problem, set
            # aside, not a SegmentError that would end the daemon)
            if isinstance(got, FeedNote) and self._guarded(key, "refill", self._covers_note,
                                                           key, got) is True:
                del due[key]  # (the fill is that change, or newer: a second GET for nothing)
                self.stats.bump("refills_covered")
        notes = [key for key, got in due.items() if isinstance(got, FeedNote)]
        fetched: dict[str, L3Record | None | CorruptRecord] = {}
        try:
            if notes and not fetch:
                raise Unavailable("partition mode")
            if notes:
                with self._metered("fetch"):
                    fetched = self.l3.get_many(notes)
        except Unavailable:
            for key in notes:
                self.refetch[key] = due.pop(key)
        for key, got in due.items():
            rec = got if isinstance(got, L3Record) else fetched.get(key)
            if isinstance(rec, CorruptRecord):
                self.stats.corrupt += 1
                self._set_aside(key, f"feed: {rec}")
            elif rec is not None:
                self._guarded(key, "feed", self._apply_or_forget, key, rec)

    def _covers_note(self, key: str, note: FeedNote) -> bool:
        """Whether L2's record of ``key`` already holds the change ``note`` announces, or
        one that saw it: its vector covers the note's dot. Not for a merge (its vector
        is news to every host) nor a dot of this host (L2 may have lost it: a dot past the
        host's write sequence is from an earlier life of L2, see ``echo``)."""
        if note.merged or note.writer == self.host:
            return False
        vector = self.port.held_vector(key)
        return vector is not None and vector_get(vector, note.writer) >= note.counter

    def _push(self, now: float) -> bool:
        """Push every closed window that is due, each answered (and its answers carried
        out) before the next; stop at the first failure. Returns False if one failed.
        The writes parked for a master taken for down (Outbound.parked) go again once a
        master leaves L3Store.down (or none is down)."""
        if self.out.parked:
            ups = getattr(self.l3, "ups", 0)
            if ups != self.ups_seen or not getattr(self.l3, "down", None):
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
                with self._metered("push"):
                    results = self.l3.push_many(items, push.keep_siblings)
            except Unreached as exc:  # every item's master is down (L3Store.down)
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

    def _healed_meanwhile(self) -> bool:
        """A push failed in partition mode before the catch-up began: a call that waited on
        a cut connection (seconds: a timeout, then redis-py's slot-map refresh from every
        seed) may have ended after the heal. One probe: if Redis answers, the catch-up
        starts now (the backlog retried at once) and True is returned. At most once per
        partition (the catch-up, once begun, is not begun again)."""
        probe = getattr(self.l3, "reachable", None)  # (the test fakes have none)
        if not self.reach.partition or self.redis_back or probe is None or not probe():
            return False
        self.reach.redis_ok(self.clock())
        self.stats.bump("healed_during_a_call")
        self._catch_up()
        return True

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
        self._l3_failed(self.out.backoff, "sending to L3", exc, delay)

    def _pushed(self, push: Push, results: list[PushResult | CorruptRecord | Unreached]) -> None:
        """Carry out L3's answers to ``push``."""
        self.stats.windows += 1 + len(push.more)
        self.stats.pushed += len(push.items)
        self.reach.redis_ok(self.clock())
        self.stats.bump("window_in", push.window.ops_in + sum(w.ops_in for w in push.more))
        per_group: dict[int, int] = {}
        group_bytes: dict[int, int] = {}  # (a call also takes at most PUSH_BATCH_BYTES)
        inline = getattr(self.l3, "feed_inline", None)  # (larger: a value-less entry, see echo)
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
                self._guarded(answer.key, "push to L3", self._carry_out, answer)
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
        confirmed = self.out.unconfirmed.confirm(getattr(self.l3, "confirmed", {}))
        self.stats.bump("unconfirmed_confirmed", len(confirmed))
        for held in (*released, *confirmed):
            self._guarded(held.key, "deliver", self.port.mark_delivered, held.key, held.record)
        self.stats.extra["unconfirmed"] = len(self.out.unconfirmed)

    def _probe_unconfirmed(self, now: float) -> None:
        """Every CONFIRM_EVERY seconds while records are held unconfirmed: a probe write
        and WAIT on each master holding some (:meth:`L3Store.confirm_replicated`): an idle
        host learns when its replicas caught up; and the groups of those whose master
        left the history they were written in are resynced as after a rewind (which
        sends them again). Raises Unavailable."""
        if not len(self.out.unconfirmed) or now < self.confirm_at:
            return
        self.confirm_at = now + CONFIRM_EVERY
        probe = getattr(self.l3, "confirm_replicated", None)  # (the test fakes have none)
        if probe is None:
            return
        for node, group in self.out.unconfirmed.nodes().items():
            probe(group, node)
        # a master seen in another replication history than a held record was written in
        # (a failover and back at the same address, a restart) may have lost it: a rewind
        # (and a group whose slot moved off the master that took its held records)
        unserved: set[tuple[str, int]] = getattr(self.l3, "unserved", set())
        taken = set(unserved)
        unserved.clear()
        rewound = self.out.unconfirmed.rewound(getattr(self.l3, "histories", {}), taken)
        if rewound:
            self.stats.bump("unconfirmed_rewound", len(rewound))
            self._resync(rewound, reason="rewind")
        self._settle_unconfirmed()

    def _note_deadline(self, g: int, deadline: float | None) -> None:
        """This host stored a record with ``deadline`` in group ``g``: the group's key index
        is to be cleaned once it passes (``ttl_groups``: group -> (next check, last
        deadline); the I/O driver's _maybe_expire_index does it)."""
        if deadline is None:
            return
        lo, hi = self.ttl_groups.get(g, (deadline, deadline))
        self.ttl_groups[g] = (min(lo, deadline), max(hi, deadline))

    def _shape(self, record: L3Record) -> L3Record:
        return self.hosts.shape(record, _ms(self.clock()))

    def _carry_out(self, answer: Answer) -> None:
        """Apply L3's answer to one pushed record. Raises what L2 raises (the caller sets
        the record aside)."""
        if answer.rebase and answer.take is not None:  # this host's L2 was lost: the
            self.stats.bump("rebased")  # write is new, not older: written again past L3's
            if not self.port.rebase(answer.key, answer.take):
                self._apply(answer.key, answer.take)
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
        if answer.set_aside:  # retrying cannot help
            if answer.outcome == CORRUPT:
                self.stats.corrupt += 1
            self._set_aside(answer.key, f"push to L3: CorruptRecord: {answer.set_aside}")
        elif answer.take is not None:
            self._apply(answer.key, answer.take)

    def _apply(self, key: str, record: L3Record) -> bool:
        """Write an L3 record into L2 (clean), unless L2 already holds something newer.
        Returns True.

        Raises CorruptRecord (the value does not decode), ValueTooLarge or another
        KVCommError (L2 cannot take it): the caller sets the record aside.
        """
        self.port.apply_remote(key, record)
        return True

    def _apply_or_forget(self, key: str, record: L3Record) -> bool:
        """:meth:`_apply`; if this host's L2 can never hold ``record``, drop the host's
        stale copy instead (its reads then go to L3), and still raise (set aside)."""
        try:
            return self._apply(key, record)
        except ValueTooLarge:
            if self.port.forget(key):
                self.stats.bump("forgotten")
            raise

    # ------------------------------------------------------------------ the key filter

    def _fill_key_filter(self, initial: bool = False) -> None:
        """Initial fill (both generations) or a rotation (the older one, refilled)."""
        skipped: set[int] = set()  # (groups of masters that did not answer: not scanned)
        if initial:  # (and note the keys L2 holds, tombstones too, for the start's resync)
            self.keys.set_ready(False)
            self._scan_into(lambda kb: self._scanned(kb, self.held_at_start),
                            self.l3.scan_keys(skipped))
            if skipped:
                # a hung master must not keep the host from starting, nor its keys be
                # answered "absent": agents ask L3 (which answers Unreached for them)
                # until they are scanned and every feed is read
                self.unscanned = skipped
                self.stats.bump("unscanned_at_start", len(skipped))
                log.warning("the key filter lacks the keys of %d group(s) whose Redis master "
                            "did not answer: agents read L3 until it answers and they are "
                            "scanned", len(skipped))
                self._distrust_filter()
            else:
                self.keys.set_ready(True)
        else:
            target = self.keys.begin_rotation()
            self._scan_into(target.add, self.l3.scan_keys(skipped))
            if skipped:  # (a master hung meanwhile: the current generation keeps answering;
                self.stats.bump("key_filter_rotations_put_off")  # tried again once it answers)
                return
            self.keys.end_rotation()
            self.stats.bump("key_filter_rotations")
        self.filter_built = self.clock()

    def _scan_unscanned(self) -> None:
        """Scan into the key filter the groups the start's scan left out (their master
        did not answer), those whose master answers now: tried at start and after each
        master the pinger let go of (L3Store.ups). Raises Unavailable; the groups not
        scanned yet stay :attr:`unscanned`."""
        ups = getattr(self.l3, "ups", 0)
        if ups == self.unscanned_ups:
            return
        self.unscanned_ups = ups
        down: Set[int] = getattr(self.l3, "down_groups", lambda gs: set())(self.unscanned)
        try:
            for g in sorted(self.unscanned - down):
                self._scan_into(self.keys.add, self.l3.scan_group(g))
                self.unscanned.discard(g)
        except Unavailable:
            self.unscanned_ups = -1  # (tried again next round, not at the next ups only)
            raise
        if not self.unscanned:
            log.info("the key filter holds the keys of every group again")

    def _scan_into(self, add: Any, keys: Iterable[bytes]) -> None:
        for n, kb in enumerate(keys):
            add(kb)
            if n % 4096 == 0:  # a long scan must not look like a dead daemon to agents
                self.keys.beat()
                if self.started:  # (L2's heartbeat also says "started": not before that)
                    self.port.heartbeat()

    def _maybe_rotate_filter(self) -> None:
        if (self.clock() - self.filter_built > self.rebuild_every
                or self.keys.adds_since_rotation >= self.config.cache.bloom_capacity):
            if self.unscanned or getattr(self.l3, "down", None):
                return  # (a scan now would leave a hung master's keys out: once it answers)
            self._fill_key_filter()

    # ------------------------------------------------------------------ prewarm

    def _prewarm(self, keys: list[str]) -> int:
        """Read into L2 the keys of ``keys`` it does not hold; returns how many came in.

        A key whose L3 record fails is set aside. Raises Unavailable."""
        n = 0
        for key in keys:
            if self.port.holds(key):
                continue
            try:
                n += bool(self._guarded(key, "prewarm", self._fetch_and_apply, key, False))
            except Unreached:  # (its master is taken for down: the others' keys come in)
                self.stats.bump("unreached_prewarm")
        return n

    def _fetch_and_apply(self, key: str, tombstones: bool) -> bool:
        """Read ``key``'s record from L3 into L2 (a tombstone only if ``tombstones``);
        True if there was one to apply."""
        rec = self.l3.get(key)
        if rec is None or (rec.tombstone and not tombstones):
            return False
        return self._apply_or_forget(key, rec)

    def _maybe_prewarm(self) -> None:
        if self.clock() - self.hot_saved < HOT_EVERY:
            return
        self.hot_saved = self.clock()
        hot = self.port.hot_keys(HOT_KEYS)
        try:
            if hot and hot != self.hot_list:  # (unchanged: L3 has it; an idle host sends nothing)
                self.l3.save_hot(self.host, hot)
                self.hot_list = hot
            if hot:
                self.stats.bump("prewarmed", self._prewarm(hot))
            self._save_load()
        except Unreached:  # (a master down: the host's own keys', or a hot key's; next time)
            self.stats.bump("unreached_saves")

    def _save_load(self) -> None:
        """Save the per-group operation counts that changed (for ``kvcomm balance``).
        Raises Unavailable."""
        changed = {g: n for g, n in self.load.items() if self.load_saved.get(g) != n}
        if changed:
            self._guarded(f"kvn:{{{self.host}}}:load", "saving load counts",
                          self.l3.save_load, self.host, changed)
            self.load_saved.update(changed)

    # ------------------------------------------------------------------ L3 → local

    def _start_feeds(self) -> None:
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
            self._resync(fresh, reason="", held=self.held_at_start, empty=empty)

    def _resync(self, groups: set[int], reason: str, held: Iterable[str] = (),
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
        down: Set[int] = getattr(self.l3, "down_groups", lambda gs: set())(groups)
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
        # record with it, is found by no scan of L3, and is sent again: _resync_key)
        held = {key for key in (*self.port.held_keys(tombstones=rewound), *held)
                if self.groups.of(key) in groups}
        for g in sorted(groups):
            try:
                seq, last_id = (0, b"0-0") if g in empty else self.l3.feed_position(g)
            except CorruptRecord as exc:  # a foreign value under the group's stream key
                self._set_aside(f"feed of group {g}", f"resync: {exc}")
                seq, last_id = None, b"0-0"  # (the first real entry then resyncs it again)
            if self.inb.positioned(g, seq, last_id):  # the missed entries may have made keys
                self._scan_into(lambda kb: self._scanned(kb, held), self.l3.scan_group(g))
                self.inb.scanned(g)
        for key in sorted(held):
            self._guarded(key, "resync", self._resync_key, key, rewound)
        # this host's records of these groups acknowledged by fewer replicas than asked
        # (kept dirty, so _resync_key passed them), after a rewind (or a resync whose
        # reason is not known: resumed): whatever the failover kept, each is sent again —
        # a new push is answered as any (older or equal ends it; stored, it is held again
        # under its new entry). A rewind found through one of them is the only sign of
        # its loss: no reader's position had passed it. (A gap or a foreign entry loses
        # nothing: they stay held, their entries' numbers still to be checked.)
        lost = groups if reason in ("rewind", "false_hint", "") else set()
        for unheld in self.out.unconfirmed.drop_groups(lost):
            rec = self._guarded(unheld.key, "resync", self.port.dirty_record, unheld.key)
            if isinstance(rec, L3Record) and self.out.repush(unheld.key, rec, self.clock()):
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
            self._apply_or_forget(key, rec)
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

    def _scanned(self, kb: bytes, held: set[str]) -> None:
        """A key exists in L3: into the key filter; and if L2 holds it, a tombstone
        included (``held_keys`` leaves those out), into ``held``: the keys a resync
        re-reads, since the missed entries may have brought it back."""
        self.keys.add(kb)
        try:
            key = kb.decode("utf-8")
        except UnicodeDecodeError:  # not a key of ours: L3 keys are strict UTF-8
            return
        if key not in held and self.port.holds(key):
            held.add(key)

    def pull_remote(self, poll: Poll) -> None:
        """Read the feeds of the groups that changed and apply what this host holds: first
        the counters of ``poll.check`` (a sweep slice, groups whose hints may have been
        lost), then the feeds of the groups hinted or whose counter moved. Raises
        Unavailable."""
        if self.inb.pending:  # an earlier resync was interrupted
            self._resync(set(self.inb.pending), reason="")  # (keeps whether to scan)
        counters: dict[int, int | None] = {}
        tails: dict[int, bytes | None] = {}  # (the id of each stream's last entry)
        heads: dict[int, tuple[int | None, bytes | None]] = {}
        try:
            with self._metered("sweep"):
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
        # put back after the poll: see step)
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
                self._resync({g}, reason="false_hint")

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
                with self._metered("feed"):
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
                self._guarded(f"feed of group {g}", "feed read", _raise, rows)
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
            self._resync(problems[why], reason=why)

    @contextmanager
    def _metered(self, what: str) -> Iterator[None]:
        """Count the L3 bytes sent and received inside the block under ``what``
        (``wire_by``: for ``status()``, which reports where a host's L3 traffic goes).
        A block that returns is an L3 call that worked: Redis answered (partition mode
        must not be entered by the lease thread while a long round, a heal's catch-up on
        a loaded host, is still getting answers)."""
        wire = getattr(self.l3, "wire", None)
        if wire is None:  # (the test fakes count nothing)
            yield
            self.reach.redis_ok(self.clock())
            return
        sent, received = wire.sent, wire.received
        try:
            yield
            self.reach.redis_ok(self.clock())
        finally:
            row = self.wire_by.setdefault(what, [0, 0])
            row[0] += wire.sent - sent
            row[1] += wire.received - received

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
        with self._metered("fetch"):
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
            self._set_aside(f"feed entry {entry.id.decode(errors='replace')} of group {g}",
                            entry.problem)
            return
        key = entry.key
        if entry.note is not None:
            self._pull_note(key, entry.note, fetched, applied)
            return
        if self.own_sent.get(key) == entry.record:
            # this daemon's own push, stored by L3 exactly as sent (not a merge), coming
            # back: L2 holds it (delivered) or a newer write of its own (dirty, never to be
            # replaced by it), and the key filter has the key since it was staged; nothing
            # to decode or merge. (A record of an earlier life of the host, the replays the
            # holdback defences are for, is never in own_sent: it is decoded and merged.)
            self.own_sent_bytes -= len(self.own_sent.pop(key))
            self.stats.bump("echoes")
            return
        try:
            rec = read_record(entry.record, key, self.max_value_size)
        except CorruptRecord as exc:
            self.stats.corrupt += 1
            self._set_aside(key, f"feed: {exc}")
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
        if self._guarded(key, "feed", self._apply_or_forget, key, rec):
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
            self._set_aside(key, f"feed: {rec}")
            return
        if vector_get(rec.vector, note.writer) < note.counter:
            self.stats.bump("fetch_behind")  # L3 lost the entry's write: a rewind, resynced
        if self._guarded(key, "feed", self._apply_or_forget, key, rec):
            self.stats.pulled += 1

    def _save_state(self) -> None:
        """Save the feed cursors and sequence numbers that changed (not those of a
        pending resync). Raises Unavailable."""
        cursors, seqs = self.inb.saveable()
        if cursors and self._guarded(f"kvn:{{{self.host}}}:cursors", "saving feed cursors",
                                     self._save_cursors, cursors, seqs):
            self.inb.saved(cursors, seqs)

    def _save_cursors(self, cursors: dict[int, bytes], seqs: dict[int, int]) -> bool:
        self.l3.save_cursors(self.host, cursors, seqs)
        return True

    # ------------------------------------------------------------------ the loop

    def step(self) -> None:
        """One round: heartbeat, local changes to L3, the hints that arrived, and (at
        most every feed_poll) the feeds of the groups that changed.

        Raises SegmentError when the host's L2 can no longer be used; L3 failures are
        counted and backed off from, not raised.
        """
        now = self.clock()
        self.port.heartbeat()
        self.keys.beat()
        self.probe_failed = self.reach.partition and not self._redis_answers()
        if self.probe_failed:
            self.stats.bump("partition_probes_failed")
            self.redis_back = False  # (Redis silent again: caught up again when it answers)
            # the local feed is read and staged meanwhile (dirty keys stay dirty): the
            # heal then only pushes, instead of first reading a backlog of thousands
            self.push_local(now, push=False)
            return
        self.push_local(now)
        if (self.healing is not None and not self.healing[3]
                and self.stats.pushed > self.healing[1] and not self.out.unsent):
            self._heal_log("backlog sent")  # (every closed window of writes answered)
            self.healing = (*self.healing[:3], True)
        hinted, lost = self.l3.hints()
        self.inb.hinted(hinted)
        for g, entry in self.l3.hint_entries():  # (after hinted: a read brings them too)
            self.inb.noted_entry(g, entry)
        self.inb.lost(lost)
        self.stats.lost_hints += len(lost)
        try:
            poll = self.inb.poll_due(now)
            if poll is not None:
                self.unanswered, self.poll_skipped = set(), False
                self.pull_remote(poll)
                if poll.save:
                    try:
                        self._save_state()
                    except Unreached:  # (the host's own keys' master is down: next time)
                        self.stats.bump("unreached_saves")
                        self.poll_skipped = True
                if not self.poll_skipped:  # (a call that reached nothing is no answer: the
                    self.reach.redis_ok(self.clock())  # metered blocks count those that were)
                elif self._live_master_answers():
                    self.reach.redis_ok(self.clock())
                self.last_pull = self.clock()
                self.inb.polled(poll, now)
                self.inb.recheck |= self.unanswered
            if self.unscanned:
                self._scan_unscanned()
            if self.catching_up and not (self.inb.due or self.inb.recheck or self.inb.pending
                                         or self.unscanned):
                self.catching_up = False  # the feeds are read up to their ends again
                self.keys.set_ready(True)
                self.stats.bump("caught_up")
                if self.healing is not None:
                    self._heal_log("caught up with every group's feed")
                    self.healing = None
            self._maybe_rotate_filter()
            self._maybe_prewarm()
            self._probe_unconfirmed(now)
        except Unavailable as exc:
            delay = self.inb.poll_failed(self.clock())
            self._l3_failed(self.inb.backoff, "reading the L3 feed", exc, delay)

    def _live_master_answers(self) -> bool:
        """A poll reached nothing: its calls all went to masters taken for down
        (L3Store.down), those of an idle host's sweep-free polls say (the unanswered
        groups it rechecks). Whether a master not taken for down answers a PING, asked
        at most every lease TTL / 2 (else nothing would tell Redis answering from a host
        cut off, and an idle host would enter partition mode over one hung master)."""
        probe = getattr(self.l3, "live_master_answers", None)  # (the test fakes have none)
        if probe is None or self.clock() - self.reach.redis_ok_at < self.reach.ttl / 2:
            return False
        if probe():
            self.stats.bump("live_master_probes")
            return True
        return False

    def _probe_live(self, wait: float) -> bool | None:
        """:meth:`_live_master_answers` for the lease thread: run in a thread of its own,
        waited for ``wait`` seconds at most; None while it runs (the next call looks
        again). An answer older than half the lease TTL is not used: asked again."""
        fut = self._live_probe
        if fut is not None and fut.done():
            self._live_probe = None
            answered, at = fut.result()
            if self.clock() - at <= self.reach.ttl / 2:
                return answered
            fut = None
        if fut is None:
            fut = self._live_probe = Future()

            def probe(fut: Future[tuple[bool, float]] = fut) -> None:
                try:
                    answered = self._live_master_answers()
                except Exception:  # (it never raises; a bug must not leave the probe out)
                    log.exception("asking whether a live Redis master answers failed")
                    answered = False
                fut.set_result((answered, self.clock()))

            threading.Thread(target=probe, daemon=True, name="kvcomm-live-probe").start()
        try:
            answered, _ = fut.result(timeout=wait)
        except FutureTimeout:
            return None
        self._live_probe = None
        return answered

    def _redis_answers(self) -> bool:
        """In partition mode, one cheap probe before a round: a round's calls would each
        wait a timeout per seed (redis-py re-reads the slot map from every seed after a
        timeout), holding the loop for seconds; a probe waits one timeout, so the heal
        is noticed within one (the loop waits at most 200 ms between rounds here)."""
        probe = getattr(self.l3, "reachable", None)  # (the test fakes have none)
        if probe is None:
            return True
        if probe():
            self.reach.redis_ok(self.clock())
            # Redis is back (etcd may not be yet); or it answers at the first probe of this
            # partition: the heal came while a round's calls were still waiting on the cut
            # connections (partition mode was entered by the lease thread meanwhile)
            if self.probe_failed or not self.redis_back:
                self._catch_up()
            self.decide_partition()  # (leaving it now: the backlog is pushed this round)
            return True
        return False

    def _l3_failed(self, backoff: Backoff, what: str, exc: Exception, delay: float) -> None:
        """Count an L3 failure. Logged at the 1st, 2nd, 4th, 8th… failure in a row, so a
        long outage does not flood the log."""
        self.stats.l3_errors += 1
        if backoff.attempts & (backoff.attempts - 1) == 0:
            log.warning("%s failed (%s); retry %d in %.2fs", what, exc, backoff.attempts, delay)

    # ------------------------------------------------------------------ partition mode

    def backlog(self) -> int:
        """Writes of this host not yet in L3 (dirty L2 entries, less those L3 acknowledged
        with fewer replicas than asked: held dirty until confirmed, see Unconfirmed)."""
        count = getattr(self.port, "dirty_count", None)  # (the test fakes have none)
        return max(0, int(count()) - len(self.out.unconfirmed)) if count is not None else 0

    def masters_down(self) -> list[str]:
        """The Redis masters this daemon takes for down (L3Store.down: a call timed out
        or was refused, no PING answered since), as they announce themselves (``host:port``
        before ``cluster.address_remap``), sorted: a partial cut, which is not partition
        mode (another master answers) but parks the writes of those masters' keys."""
        down = getattr(self.l3, "down", None)  # (the test fakes have none)
        if not down:
            return []
        announced = {reached: name for name, reached in
                     self.config.cluster.address_remap.items()}
        return sorted(announced.get(n, n) for n in list(down))  # (list: the pinger edits it)

    def status(self) -> dict[str, Any]:
        """What the daemon tells its agents (the status file) and the cluster (etcd)."""
        now = self.clock()
        p = self.presence
        return {"host": self.host, "namespace": getattr(self.port, "namespace", None),
                "pid": os.getpid(), "updated": self.wall(),
                "partition": self.reach.partition, "partition_reason": self.reach.reason,
                # (agents refuse L3 reads at once then: _client/cluster_read.py)
                "redis_unreachable": self.reach.partition and self.reach.redis_cut(now),
                "partitions": self.reach.entered, "backlog": self.backlog(),
                "masters_down": self.masters_down(), "parked": len(self.out.parked),
                "feed_lag_s": round(max(0.0, now - self.last_pull), 3),
                "etcd_unreachable": bool(p and p.etcd_unreachable),
                "etcd_down_s": round(p.etcd_down_s(), 3) if p else 0.0,
                "lease": p.lease if p else 0, "watch_missed": self.watch_missed,
                "watch_applied": self._watch_applied(),
                "clock_skew": {"beyond": self.skew.beyond,
                               "max_ahead_ms": self.skew.max_ahead_ms},
                # (which keys are strong: agents without cluster.etcd check theirs here)
                "strong_prefixes": sorted(set(self.config.cache.strong_prefixes)),
                "l3_consistency": self.config.cache.l3_consistency}

    def _watch_applied(self) -> int:
        """The mtime of the watch registrations the daemon applies (node/watched.py)."""
        return 0

    def l3_bytes(self) -> dict[str, list[int]]:
        """Bytes [sent, received] between this daemon and L3 so far, by what they were
        for: push (windows), feed (stream reads), fetch (records of value-less entries),
        sweep (group counters), hints (the hint messages received, on subscriptions of
        their own), other (resyncs, prewarm, cursors, load, reports), total."""
        wire = getattr(self.l3, "wire", None)
        out = {k: list(v) for k, v in dict(self.wire_by).items()}  # (a copy: other threads call)
        if wire is not None:
            hinted = getattr(self.l3, "hint_stats", None)
            if isinstance(hinted, dict) and "bytes" in hinted:
                out["hints"] = [0, int(hinted["bytes"])]
            sent, received = wire.sent, wire.received
            out["other"] = [sent - sum(v[0] for v in out.values()),
                            received - sum(v[1] for v in out.values())]
            out["total"] = [sent, received]
        return out

    def decide_partition(self) -> None:
        """Enter or leave partition mode (see node/presence.py). Leaving it retries the
        backlog and the feeds at once instead of after the backoff."""
        with self.reach_lock:
            self._decide_partition()

    def enter_partition_if_due(self) -> None:
        """Enter partition mode if it is due, leaving it to the loop to leave it (after
        a Redis round that worked). The lease thread calls this every second at least,
        so that a loop stuck in Redis calls that time out one after the other (a
        cut-off host's redis-py tries every seed node in turn) does not delay partition
        mode by far more than the lease TTL."""
        # (never waiting on Redis: this thread renews the etcd lease and writes the status
        # file. The loop holds the lock while it PINGs a live master: it decides then)
        if not self.reach_lock.acquire(timeout=LEASE_WAIT_S):
            return
        try:
            if self.reach.overdue(self.clock(),
                                  self.presence.etcd_seen_at if self.presence else None):
                self._decide_partition(wait=LEASE_WAIT_S)
        finally:
            self.reach_lock.release()

    def _decide_partition(self, wait: float | None = None) -> None:
        """``wait``: from the lease thread, how long a live master's PING is waited for
        (it runs in a thread of its own; undecided meanwhile); None: until it returns."""
        now = self.clock()
        if (not self.reach.partition and now - self.reach.redis_ok_at > self.reach.ttl
                and getattr(self.l3, "down", None)):
            # a partial cut (some masters taken for down, another answers a PING now) is
            # no partition: the loop's first call to each master that stopped answering
            # waits a timeout, one master after the other, and no call of those answered,
            # so a few of them in a row outlast the lease TTL
            answered = self._live_master_answers() if wait is None else self._probe_live(wait)
            if answered is None:  # (its PING is still out: decided at a later tick)
                return
            if answered:
                now = self.clock()
                self.reach.redis_ok(now)
        change = self.reach.update(now, self.presence.etcd_seen_at if self.presence else None)
        if change == "enter":
            self.stats.bump("partitions")
            log.warning("partition mode: %s; agents keep writing eventual keys into L2 (at "
                        "most cluster.outbound_max waiting), strong keys need etcd",
                        self.reach.reason)
            # probe often: the heal is found within ~200 ms, not after a 2 s backoff; and
            # do not spend each probe re-reading the slot map from every unreachable seed
            self.out.backoff.cap = self.inb.backoff.cap = 0.2
            if hasattr(self.l3, "refresh_every"):
                self.l3.refresh_every = 10.0
            self.redis_back = False
        elif change == "leave":
            self.stats.bump("heals")
            log.warning("partition healed: replaying %d waiting writes through L3's merge",
                        self.backlog())
            self.out.backoff.cap = self.inb.backoff.cap = 2.0
            if hasattr(self.l3, "refresh_every"):
                self.l3.refresh_every = 0.5
            if not self.redis_back:  # (else done when Redis came back, etcd still out)
                self._catch_up()

    def _catch_up(self) -> None:
        """Redis answers again after a partition (or the partition is left): the backlog
        and the feeds are retried at once instead of after the backoff, and every group
        is read up to its end before the key filter is trusted again. Done as soon as
        Redis answers, not when partition mode is left (which also waits for etcd): the
        host's writes and the other hosts' converge meanwhile."""
        self.redis_back = True
        self.out.backoff.succeeded()
        self.inb.backoff.succeeded()
        self.out.retry_at = self.inb.retry_at = float("-inf")
        self.inb.last_poll = float("-inf")
        # keys made elsewhere while cut off are not in the key filter until the feeds
        # are read: agents must not trust its "absent" (they ask L3) until then
        self._distrust_filter()
        self.healing = (self.clock(), self.stats.pushed,
                        self.stats.pulled + self.stats.skipped_remote, False)
        log.info("Redis answers again: sending the backlog of %d writes, reading every "
                 "group's feed", self.backlog())

    def _distrust_filter(self) -> None:
        """Agents stop taking the key filter's "absent" for an answer (they read L3)
        until the catch-up ends (:meth:`step`: every group's feed read up to its end and
        no group :attr:`unscanned`); every group's hints may have been lost: every
        counter is checked now."""
        self.keys.set_ready(False)
        self.catching_up = True
        self.inb.lost(range(self.config.cluster.groups))

    def _heal_log(self, what: str) -> None:
        """One step of a heal's catch-up, in the log with the time since Redis answered
        again and the records pushed and remote changes read since (the heal's timeline)."""
        assert self.healing is not None
        t0, pushed, read, _ = self.healing
        log.info("heal: %s %.2fs after Redis answered (%d records pushed, %d remote changes "
                 "read)", what, self.clock() - t0, self.stats.pushed - pushed,
                 self.stats.pulled + self.stats.skipped_remote - read)

    def run(self, stop: threading.Event) -> None:
        """Step until ``stop`` is set, then flush (for at most
        ``cluster.shutdown_flush_timeout`` seconds). A failed round is logged, counted and
        retried with backoff; only SegmentError (the host's L2 or key filter is gone or
        foreign) ends the loop early, raised."""
        poll = self.config.cluster.feed_poll
        backoff = Backoff(self.rng, base=max(poll, 0.01), cap=2.0)
        if self.unread_changes:  # (this loop's reads and writes of L2 are no agent's:
            self.port.quiet()  # take_reads; off, CLOCK sees them as before)
        while not stop.is_set():
            try:
                self.step()
                backoff.succeeded()
            except SegmentError:
                raise
            except Exception as exc:  # never die of one bad round: back off and go on
                if isinstance(exc, Unavailable):
                    self.stats.l3_errors += 1
                    log.warning("%s", exc)
                else:
                    self.stats.step_errors += 1
                    log.exception("a daemon round failed; retrying")
                self.decide_partition()
                self.after_step()
                stop.wait(min(backoff.failed(), 0.2) if self.reach.partition else backoff.failed())
                continue
            self.decide_partition()
            self.after_step()
            if self.probe_failed:  # (partition mode, Redis silent: probe again soon)
                stop.wait(0.2)
                continue
            wake = self.out.wake_at()
            stop.wait(poll if wake is None else max(0.0, min(poll, wake - self.clock())))
        self.flush(self.config.cluster.shutdown_flush_timeout)

    def after_step(self) -> None:
        """Publish the daemon's status (NodeDaemon: the status file)."""

    def flush(self, timeout: float = 5.0) -> dict[str, Any]:
        """Send what is waiting (on shutdown: SIGTERM); gives up after ``timeout``
        seconds (0: one try, no waiting). Returns ``{"sent", "left", "seconds"}``:
        records pushed, writes still not in L3 (they stay dirty in L2: the next daemon
        sends them), time taken."""
        t0 = self.clock()
        end = t0 + timeout
        pushed0 = self.stats.pushed
        self.out.backoff.succeeded()
        self.out.retry_at = float("-inf")
        while True:
            try:
                self.push_local(self.clock())
            except Unavailable:
                pass
            self.out.flush(self.clock())
            if self.out.waiting:
                self._push(self.clock())
            if not self.out.waiting and not self.backlog() or self.clock() >= end:
                break
            # failed: wait as the backoff says, within the timeout (or for the feed)
            self.sleep(max(0.01, min(self.out.retry_at, end) - self.clock())
                       if self.out.waiting else 0.01)
        try:
            self._save_state()
        except Unavailable:
            pass
        self.last_flush = {"sent": self.stats.pushed - pushed0, "left": self.backlog(),
                           "seconds": round(self.clock() - t0, 3)}
        return self.last_flush

    def close(self) -> None:
        """Tell agents to stop trusting the key filter now (not in STALE_MS), and release
        the key filter and L3."""
        self.keys.set_ready(False)
        self.keys.close()
        self.l3.close()


def _copy_strong_config(kv: Client, l3: L3Store) -> None:
    """Make L3's copy of which keys the cluster keeps strong (L3Store.strong_config, read
    by agents without cluster.etcd) equal etcd's: once etcd confirmed (or recorded) this
    host's cache.strong_prefixes and cache.l3_consistency, they are the cluster's. Raises
    ConfigError when etcd records others (the host must not start). When etcd cannot
    answer now, L3's copy is left as it is (logged): the next daemon start copies it."""
    strong = getattr(kv, "_strong", None)
    if strong is None:
        return
    c = kv.config.cache
    try:
        strong.check()  # (done at kv's open unless etcd was out of reach then)
        l3.record_strong_config(c.strong_prefixes, c.l3_consistency)
    except Unavailable as exc:
        log.warning("L3's copy of the cluster's strong prefixes not checked against "
                    "etcd's (%s): agents without cluster.etcd read the copy as it is", exc)


class NodeDaemon(Daemon):
    """The daemon of a host, over its real L2 (a client of the host's namespace), its
    key filter and the Redis Cluster named in ``config``.

    Raises ConfigError (bad cluster settings or resolvers), SegmentError (the host's L2
    or key filter cannot be used), Unavailable (L3 cannot be reached: retry later). A
    failed start releases everything it opened.
    """

    def __init__(self, config: Config, name: str | None = None,
                 rng: random.Random | None = None) -> None:
        if not config.cluster.enabled:
            raise ConfigError("cluster.redis",
                              "kvcomm node needs the Redis Cluster seed nodes (host:port list)")
        config.cluster.seeds()  # validate before touching the host's L2
        # jitter must differ between hosts: an unseeded Random draws its seed from the OS
        rng = rng if rng is not None else random.Random()
        self.kv: Client = kv_open(name, config=config, wait_daemon=False)  # (it is the daemon)
        l3: L3Store | None = None
        keys: KeyFilter | None = None
        try:
            port = ClientPort(self.kv)  # the one way to the host's L2
            cl, c = config.cluster, config.cache
            resolvers = {prefix: _import(path) for prefix, path in cl.resolvers.items()}
            l3 = L3Store.from_config(cl, max_value_size=c.max_value_size, daemon=True)
            l3.check_groups(record=True)  # (a ConfigError for another count: not retried)
            _index_l3(l3)
            if cl.etcd:
                _copy_strong_config(self.kv, l3)
            for prefix, fn in resolvers.items():  # the operator's own code, named in config
                port.register_resolver(prefix, fn)  # (agents of the host register theirs)
            keys = KeyFilter.create(self.kv.name, c.bloom_capacity, c.bloom_fpr,
                                    permissions=c.l2_permissions, directory=c.l2_dir)
            super().__init__(config, port, l3, keys, rng=rng)
            # placement: the host's agent reports, published to L3 (kvn:{host}:agents)
            self.agents = HostPublisher(config, self.kv.name, self.host)
            self.status_file = status_path(self.kv.name, c.l2_dir)
            self.watched = WatchedPrefixes(self.kv.name, c.l2_dir)
            self.status_written = float("-inf")
            self._expire_index_at = 0.0  # (the clock's next expire_index)
            if cl.etcd:
                self.presence = HostPresence(config, self.status,
                                             on_change=self._lease_tick).start()
        except BaseException:  # L3 unreachable at start, say: release what we opened
            if keys is not None:
                keys.close()
            if l3 is not None:
                l3.close()
            self.kv.close()
            raise

    def _watch_applied(self) -> int:
        return self.watched.applied

    def step(self) -> None:
        applied = self.watched.applied
        if self.watched.poll(self.clock()):
            self.watching = self.watched.wants if self.watched.prefixes else _nobody
            log.info("watched prefixes of this host: %s", list(self.watched.prefixes))
        if self.watched.applied != applied:
            self.status_written = float("-inf")  # new watchers wait for the status: now
        super().step()
        self.agents.maybe_publish(self.l3, self.clock())  # (never raises)
        self._maybe_expire_index()

    def _maybe_expire_index(self) -> None:
        """About once a second: keys this host stored with a deadline that has passed
        leave L3's key index (only the groups it stored such records in: an idle daemon
        sends nothing; a group is checked every second until its last deadline passed).
        An L3 failure is logged and tried again next time, never raised."""
        now = self.clock()
        if now < self._expire_index_at or not self.ttl_groups:
            return
        self._expire_index_at = now + 1.0
        wall = time.time()
        due = [g for g, (lo, _) in self.ttl_groups.items() if lo <= wall]
        if not due:
            return
        skipped: set[int] = set()  # (groups of a master taken for down: done once it answers)
        try:
            assert isinstance(self.l3, L3Store)
            self.stats.expired_unindexed += self.l3.expire_index(wall, due, skipped=skipped)
        except Unreached:  # (every such group's master is down: not waited for, not logged)
            self.stats.bump("unreached_index")
            return
        except Unavailable as exc:
            log.warning("dropping expired keys from L3's key index: %s", exc)
            return
        if skipped:
            self.stats.bump("unreached_index")
        for g in due:
            if g in skipped:
                continue
            _, hi = self.ttl_groups[g]
            if hi <= wall:
                del self.ttl_groups[g]
            else:
                self.ttl_groups[g] = (wall + 1.0, hi)

    def after_step(self) -> None:
        """Write the status file for the host's agents and ``kvcomm info`` (every 200 ms
        at most; a failure is logged, not raised)."""
        now = self.clock()
        if now - self.status_written < 0.2:
            return
        self.status_written = now
        self.write_status()

    def _lease_tick(self) -> None:
        """From the lease thread (every second at least): partition mode when due, then
        the status file."""
        self.enter_partition_if_due()
        self.write_status()

    def write_status(self) -> None:
        """Write the status file now (also from the lease thread, when etcd's
        reachability changes). Never raises."""
        try:
            # (one writer at a time, the snapshot taken inside: the loop's status, taken
            # before the lease thread entered partition mode, written after the lease
            # thread's, would say "connected" until the loop's next round)
            with self.status_lock:
                write_status(self.status_file, {**self.status(), "l3_bytes": self.l3_bytes()},
                             self.config.cache.l2_permissions)
        except OSError as exc:
            log.warning("cannot write %s: %s", self.status_file, exc)

    def close(self) -> None:
        """Revoke the host's lease (others see it leave at once), remove the status file,
        release everything."""
        if self.presence is not None:
            self.presence.stop(revoke=True)
        try:
            os.unlink(self.status_file)
        except OSError:
            pass
        super().close()
        self.kv.close()


def _nobody(key: str) -> bool:
    return False


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def _raise(exc: BaseException) -> None:
    raise exc


def _index_l3(l3: L3Store) -> None:
    """Backfill L3's key index once per cluster (records written before it existed; see
    tiers/l3.py, "The key index"). A failure is logged, not fatal: the next daemon start
    (or ``kvcomm migrate --l3-index``) does it; until then scans may miss those records."""
    try:
        if not l3.index_ready():
            n = l3.backfill_index()
            log.info("kvcomm: L3 key index backfilled (%d records looked at)", n)
    except (Unavailable, CorruptRecord) as exc:
        log.warning("kvcomm: the L3 key index backfill did not complete (%s); prefix scans "
                    "may miss records written before the index existed until it does", exc)


def _import(path: str) -> Any:
    """``"module:function"`` → the function. Raises ConfigError naming the config entry."""
    import importlib

    module, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except Exception as exc:  # ImportError, AttributeError, or the module's own failure
        raise ConfigError("cluster.resolvers",
                          f"cannot load {path!r} ({type(exc).__name__}: {exc}); give "
                          "\"module:function\" of an importable module") from None
    if not callable(fn):
        raise ConfigError("cluster.resolvers", f"{path!r} is not callable")
    return fn


def main(config: Config, name: str | None = None) -> int:
    """Run until SIGTERM/SIGINT. Returns the exit status.

    Waits (with backoff and jitter) for a cluster that cannot be reached yet; raises
    ConfigError or SegmentError, which the CLI reports, for what waiting cannot fix.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s kvcomm-node %(message)s")
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # `kill -USR1 <pid>`: every thread's stack to stderr (a daemon that seems stuck)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    rng = random.Random()  # seeded by the OS: hosts that boot together wait differently
    backoff = Backoff(rng, base=0.1, cap=5.0, floor=0.05)
    while True:  # a host may boot before its cluster: agents write into L2 meanwhile
        try:
            daemon = NodeDaemon(config, name, rng=rng)
            break
        except Unavailable as exc:
            delay = backoff.failed()
            log.warning("cannot start yet (%s); retrying in %.1fs", exc, delay)
            if stop.wait(delay):
                return 0
    log.info("host %s, namespace %s, %d seed nodes; %d hot keys prewarmed", daemon.host,
             daemon.kv.name, len(config.cluster.redis), daemon.stats.extra.get("prewarmed", 0))
    from ..metrics.node import attach_daemon

    try:
        exporter = attach_daemon(daemon)  # (metrics.port: the host's metrics endpoint)
    except BaseException:
        daemon.close()
        raise
    try:
        daemon.run(stop)  # (it flushes when stopped)
        report = daemon.last_flush or {}
        msg = (f"stopping: flushed {report.get('sent', 0)} writes to L3 in "
               f"{report.get('seconds', 0)}s; {report.get('left', 0)} not yet in L3")
        if report.get("left") and report.get("seconds", 0) >= config.cluster.shutdown_flush_timeout:
            msg += f" after cluster.shutdown_flush_timeout ({config.cluster.shutdown_flush_timeout:g}s)"

        if report.get("left"):
            msg += " (they stay in L2, dirty: the next daemon of this host sends them)"
        log.info("%s", msg)
        print(f"kvcomm node: {msg}", file=sys.stderr, flush=True)
    finally:
        if exporter is not None:
            exporter.close()
        daemon.close()
    return 0
