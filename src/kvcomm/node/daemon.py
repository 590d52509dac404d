"""``kvcomm node``: the host daemon that keeps one host's L2 in sync with the cluster (L3).

Agents only ever touch L2 (and, on an L2 miss, read L3 once); the daemon does the rest,
in one loop. :class:`Daemon` is that loop, composing parts that own their state:
:class:`~kvcomm.node.push.Pusher` (local → L3), :class:`~kvcomm.node.pull.Puller`
(L3 → local), :class:`~kvcomm.node.keys.KeyFilterKeeper` (the host's key filter),
:mod:`kvcomm.node.prewarm` (hot keys, load), :class:`~kvcomm.node.partition.PartitionMode`
(partition mode and heal) and :mod:`kvcomm.node.quarantine` (bad input set aside).
The decisions are the state machines of :mod:`kvcomm.node.delivery` (no I/O); the
daemon reaches L2, the key filter and L3 through the ports of :mod:`kvcomm.node.port`.
:class:`NodeDaemon` adds the host's presence and placement reports.

Rules a reader of this loop must keep:

* a push is made in the loop and its answers carried out before anything else;
* the feed position persisted is the outbound machine's delivered cursor, never later
  (a daemon killed at any point replays from there);
* when L3 is unreachable nothing is dropped: unsent windows are retried with capped
  exponential backoff with jitter, and ``put`` raises ``Unavailable`` once
  ``cluster.outbound_max`` writes wait;
* input never kills the daemon: a record that fails is logged, counted, set aside and
  skipped. The process exits only on SIGTERM/SIGINT, a ConfigError, or a SegmentError
  of its own L2 segment or key filter.

Design (the theory of operation, numbered 1–7: push, pull, prewarm, the key filter,
load, heartbeat, placement; partition mode; input never kills the daemon):
docs/design/daemon.md.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .._client import Client
from .._client import open as kv_open
from .._threads import start_quiet
from ..clock import clock_for
from ..config import Config
from ..core.backoff import Backoff
from ..core.window import WriteWindow
from ..errors import ConfigError, CorruptRecord, SegmentError, Unavailable
from ..placement.observe import HostPublisher
from ..tiers.groups import groups as groups_of
from ..tiers.keyfilter import KeyFilter
from ..tiers.l3 import DaemonL3, Unreached
from ..tiers.shm.files import segment_path
from .delivery import UNCONFIRMED_MAX, HostActivity, Inbound, Outbound
from .keys import KeyFilterKeeper
from .partition import PartitionMode
from .port import ClientPort, HostKeys, HostL2, L3Port
from .presence import (
    HostPresence,
    Reachability,
    read_status,
    status_fresh,
    status_path,
    write_status,
)
from .prewarm import Prewarm
from .pull import Puller, nobody
from .push import Pusher
from .quarantine import Quarantine
from .watched import WatchedPrefixes

log = logging.getLogger("kvcomm.node")
MERGE_WINDOWS = 8  # closed windows waiting together go out in one push (a backlog)


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

    The loop composes parts that own their state: :attr:`pusher` (local → L3,
    :mod:`kvcomm.node.push`), :attr:`puller` (L3 → local, :mod:`kvcomm.node.pull`),
    :attr:`key_filter` (:mod:`kvcomm.node.keys`), :attr:`prewarm` (hot keys and load
    counts, :mod:`kvcomm.node.prewarm`), :attr:`partition` (partition mode and heal,
    :mod:`kvcomm.node.partition`) and :attr:`quarantine` (bad input,
    :mod:`kvcomm.node.quarantine`). What they share is the daemon's: its ports, clock,
    stats, per-group load counts and the hosts' activity (vector pruning).

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
        self.load: dict[int, int] = {}  # group → operations made on it (cumulative)
        self.hosts = HostActivity(self.host, _ms(now))
        self.wire_by: dict[str, list[int]] = {}  # push/feed/fetch/sweep → [sent, received]
        self.status_lock = threading.Lock()  # (write_status: the loop's and the lease thread's)
        self.presence: HostPresence | None = None
        self.last_flush: dict[str, Any] | None = None
        # (records pushed short of cluster.wait_replicas stay dirty until confirmed: a
        # quarter of the backlog's bound at most, the rest left to new writes)
        out = Outbound(self.host, port.delivered_cursor,
                       WriteWindow(c.l2_sync_interval, c.max_batch_ops, c.max_batch_bytes),
                       Backoff(rng, base=0.05, cap=2.0, floor=0.01), merge=MERGE_WINDOWS,
                       group_of=self.groups.of,
                       unconfirmed_max=min(UNCONFIRMED_MAX, max(1, cl.outbound_max // 4)))
        self.quarantine = Quarantine(l3, self.host, self.stats, clock, wall)
        self.puller = Puller(self, out, hlc_ms if hlc_ms is not None else clock_for(config))
        self.pusher = Pusher(self, out)  # (reads the host's write mark from L3)
        self.key_filter = KeyFilterKeeper(self)
        self.prewarm = Prewarm(self)
        self.partition = PartitionMode(self, out, self.puller.inb)
        if port.delivered_cursor == 0:  # (a new L2: past the write mark, see push.py)
            moved = self.port.past_lost_dots(self.pusher.write_mark)
            if moved:
                self.stats.bump("lost_dots_moved", moved)
        self.key_filter.fill(initial=True)
        self.puller.start_feeds()
        self.key_filter.held_at_start.clear()
        self.prewarm.hot_saved = clock()
        self.stats.bump("prewarmed", self.prewarm.warm(self.l3.load_hot(self.host)))
        self.started = True

    # ------------------------------------------------------------------ the parts' state
    # (read by tests, metrics and tools)

    @property
    def out(self) -> Outbound:
        """The outbound machine (:class:`kvcomm.node.delivery.Outbound`)."""
        return self.pusher.out

    @property
    def inb(self) -> Inbound:
        """The inbound machine (:class:`kvcomm.node.delivery.Inbound`)."""
        return self.puller.inb

    @property
    def feed_seqs(self) -> dict[int, int | None]:
        """The last sequence number read, by group."""
        return self.puller.inb.seqs

    @property
    def feed_counters(self) -> dict[int, int | None]:
        """Each group's feed counter as last checked (what ``kvcomm_feed_lag_events``
        measures the reads against)."""
        return self.puller.feed_counters

    @property
    def reach(self) -> Reachability:
        """Whether Redis and etcd answer (:class:`kvcomm.node.presence.Reachability`)."""
        return self.partition.reach

    @property
    def reach_lock(self) -> threading.Lock:
        """Held while partition mode is decided (the loop's and the lease thread's)."""
        return self.partition.reach_lock

    @property
    def probe_failed(self) -> bool:
        """The last round found Redis silent (partition mode)."""
        return self.partition.probe_failed

    @property
    def catching_up(self) -> bool:
        """Healed (or started with groups unscanned), the feeds not yet read up to their
        ends: the key filter is distrusted."""
        return self.partition.catching_up

    @property
    def unscanned(self) -> set[int]:
        """Groups whose keys the key filter may lack (their master did not answer)."""
        return self.key_filter.unscanned

    @property
    def filter_built(self) -> float:
        """When the key filter was last built or rotated (the daemon's clock)."""
        return self.key_filter.filter_built

    @property
    def rebuild_every(self) -> float:
        """Seconds between rotations of the key filter (cluster.key_filter_rebuild)."""
        return self.key_filter.rebuild_every

    @property
    def ttl_groups(self) -> dict[int, tuple[float, float]]:
        """Groups whose key index holds this host's deadlines: group -> (next check,
        last deadline)."""
        return self.pusher.ttl_groups

    @property
    def own_sent(self) -> dict[str, bytes]:
        """Own pushes awaiting their echo: key -> the bytes L3 stored."""
        return self.pusher.own_sent

    @property
    def persisted(self) -> int:
        """The delivered cursor L2 holds."""
        return self.pusher.persisted

    @property
    def confirm_at(self) -> float:
        """The next probe of the masters holding unconfirmed records (the clock's)."""
        return self.pusher.confirm_at

    @confirm_at.setter
    def confirm_at(self, at: float) -> None:
        self.pusher.confirm_at = at

    @property
    def watching(self) -> Callable[[str], bool]:
        """Keys a local watcher wants from the feeds though L2 does not hold them."""
        return self.puller.watching

    @watching.setter
    def watching(self, wants: Callable[[str], bool]) -> None:
        self.puller.watching = wants

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
        part, inb = self.partition, self.puller.inb
        part.probe_failed = part.reach.partition and not part.redis_answers()
        if part.probe_failed:
            self.stats.bump("partition_probes_failed")
            part.redis_back = False  # (Redis silent again: caught up again when it answers)
            # the local feed is read and staged meanwhile (dirty keys stay dirty): the
            # heal then only pushes, instead of first reading a backlog of thousands
            self.pusher.push_local(now, push=False)
            return
        self.pusher.push_local(now)
        part.backlog_sent()
        hinted, lost = self.l3.hints()
        inb.hinted(hinted)
        for g, entry in self.l3.hint_entries():  # (after hinted: a read brings them too)
            inb.noted_entry(g, entry)
        inb.lost(lost)
        self.stats.lost_hints += len(lost)
        try:
            poll = inb.poll_due(now)
            if poll is not None:
                self.puller.poll(poll, now)
            if self.key_filter.unscanned:
                self.key_filter.scan_unscanned()
            part.caught_up()
            self.key_filter.maybe_rotate()
            self.prewarm.maybe_prewarm()
            self.pusher.probe_unconfirmed(now)
        except Unavailable as exc:
            delay = inb.poll_failed(self.clock())
            self.l3_failed(inb.backoff, "reading the L3 feed", exc, delay)

    def decide_partition(self) -> None:
        """Enter or leave partition mode (see node/presence.py). Leaving it retries the
        backlog and the feeds at once instead of after the backoff."""
        self.partition.decide()

    def enter_partition_if_due(self) -> None:
        """Enter partition mode if it is due (:meth:`PartitionMode.enter_if_due`: the
        lease thread calls this every second at least)."""
        self.partition.enter_if_due()

    @contextmanager
    def metered(self, what: str) -> Iterator[None]:
        """Count the L3 bytes sent and received inside the block under ``what``
        (``wire_by``: for ``status()``, which reports where a host's L3 traffic goes).
        A block that returns is an L3 call that worked: Redis answered (partition mode
        must not be entered by the lease thread while a long round, a heal's catch-up on
        a loaded host, is still getting answers)."""
        wire = self.l3.wire
        sent, received = wire.sent, wire.received
        try:
            yield
            self.partition.reach.redis_ok(self.clock())
        finally:
            row = self.wire_by.setdefault(what, [0, 0])
            row[0] += wire.sent - sent
            row[1] += wire.received - received

    def l3_failed(self, backoff: Backoff, what: str, exc: Exception, delay: float) -> None:
        """Count an L3 failure. Logged at the 1st, 2nd, 4th, 8th… failure in a row, so a
        long outage does not flood the log."""
        self.stats.l3_errors += 1
        if backoff.attempts & (backoff.attempts - 1) == 0:
            log.warning("%s failed (%s); retry %d in %.2fs", what, exc, backoff.attempts, delay)

    # ------------------------------------------------------------------ partition mode

    def backlog(self) -> int:
        """Writes of this host not yet in L3 (dirty L2 entries, less those L3 acknowledged
        with fewer replicas than asked: held dirty until confirmed, see Unconfirmed)."""
        return max(0, self.port.dirty_count() - len(self.pusher.out.unconfirmed))

    def masters_down(self) -> list[str]:
        """The Redis masters this daemon takes for down (DaemonL3.down: a call timed out
        or was refused, no PING answered since), as they announce themselves (``host:port``
        before ``cluster.address_remap``), sorted: a partial cut, which is not partition
        mode (another master answers) but parks the writes of those masters' keys."""
        down = self.l3.down
        if not down:
            return []
        announced = {reached: name for name, reached in
                     self.config.cluster.address_remap.items()}
        return sorted(announced.get(n, n) for n in list(down))  # (list: the pinger edits it)

    def status(self) -> dict[str, Any]:
        """What the daemon tells its agents (the status file) and the cluster (etcd)."""
        now = self.clock()
        p, reach = self.presence, self.partition.reach
        return {"host": self.host, "namespace": self.port.namespace,
                "pid": os.getpid(), "updated": self.wall(),
                "partition": reach.partition, "partition_reason": reach.reason,
                # (agents refuse L3 reads at once then: _client/cluster_read.py)
                "redis_unreachable": reach.partition and reach.redis_cut(now),
                "partitions": reach.entered, "backlog": self.backlog(),
                "masters_down": self.masters_down(), "parked": len(self.pusher.out.parked),
                "feed_lag_s": round(max(0.0, now - self.puller.last_pull), 3),
                "etcd_unreachable": bool(p and p.etcd_unreachable),
                "etcd_down_s": round(p.etcd_down_s(), 3) if p else 0.0,
                "lease": p.lease if p else 0, "watch_missed": self.puller.watch_missed,
                "watch_applied": self._watch_applied(),
                "clock_skew": {"beyond": self.puller.skew.beyond,
                               "max_ahead_ms": self.puller.skew.max_ahead_ms},
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
        wire = self.l3.wire
        out = {k: list(v) for k, v in dict(self.wire_by).items()}  # (a copy: other threads call)
        hinted = self.l3.hint_stats
        if "bytes" in hinted:
            out["hints"] = [0, int(hinted["bytes"])]
        sent, received = wire.sent, wire.received
        out["other"] = [sent - sum(v[0] for v in out.values()),
                        received - sum(v[1] for v in out.values())]
        out["total"] = [sent, received]
        return out

    def run(self, stop: threading.Event) -> None:
        """Step until ``stop`` is set, then flush (for at most
        ``cluster.shutdown_flush_timeout`` seconds). A failed round is logged, counted and
        retried with backoff; only SegmentError (the host's L2 or key filter is gone or
        foreign) ends the loop early, raised."""
        poll = self.config.cluster.feed_poll
        backoff = Backoff(self.rng, base=max(poll, 0.01), cap=2.0)
        if self.puller.unread_changes:  # (this loop's reads and writes of L2 are no agent's:
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
                partitioned = self.partition.reach.partition
                stop.wait(min(backoff.failed(), 0.2) if partitioned else backoff.failed())
                continue
            self.decide_partition()
            self.after_step()
            if self.partition.probe_failed:  # (partition mode, Redis silent: probe again soon)
                stop.wait(0.2)
                continue
            wake = self.pusher.out.wake_at()
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
        pushed0, out = self.stats.pushed, self.pusher.out
        out.backoff.succeeded()
        out.retry_at = float("-inf")
        while True:
            try:
                self.pusher.push_local(self.clock())
            except Unavailable:
                pass
            out.flush(self.clock())
            if out.waiting:
                self.pusher.push(self.clock())
            if not out.waiting and not self.backlog() or self.clock() >= end:
                break
            # failed: wait as the backoff says, within the timeout (or for the feed)
            self.sleep(max(0.01, min(out.retry_at, end) - self.clock())
                       if out.waiting else 0.01)
        try:
            self.puller.save_state()
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


def _copy_strong_config(kv: Client, l3: DaemonL3) -> None:
    """Make L3's copy of which keys the cluster keeps strong (DaemonL3.strong_config, read
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
        l3: DaemonL3 | None = None
        keys: KeyFilter | None = None
        try:
            port = ClientPort(self.kv)  # the one way to the host's L2
            cl, c = config.cluster, config.cache
            resolvers = {prefix: _import(path) for prefix, path in cl.resolvers.items()}
            l3 = DaemonL3.from_config(cl, max_value_size=c.max_value_size)
            l3.check_groups(record=True)  # (a ConfigError for another count: not retried)
            _index_l3(l3)
            if cl.etcd:
                _copy_strong_config(self.kv, l3)
            for prefix, fn in resolvers.items():  # the operator's own code, named in config
                port.register_resolver(prefix, fn)  # (agents of the host register theirs)
            keys = KeyFilter.create(self.kv.name, c.bloom_capacity, c.bloom_fpr,
                                    permissions=c.l2_permissions, directory=c.l2_dir)
            super().__init__(config, port, l3, keys, rng=rng)
            self.store = l3  # (self.l3, typed as the daemon's face of L3, not the port)
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
            self.puller.watching = self.watched.wants if self.watched.prefixes else nobody
            log.info("watched prefixes of this host: %s", list(self.watched.prefixes))
        if self.watched.applied != applied:
            self.status_written = float("-inf")  # new watchers wait for the status: now
        super().step()
        self.agents.maybe_publish(self.store, self.clock())  # (never raises)
        self._maybe_expire_index()

    def _maybe_expire_index(self) -> None:
        """About once a second: keys this host stored with a deadline that has passed
        leave L3's key index (only the groups it stored such records in: an idle daemon
        sends nothing; a group is checked every second until its last deadline passed).
        An L3 failure is logged and tried again next time, never raised."""
        now = self.clock()
        if now < self._expire_index_at or not self.pusher.ttl_groups:
            return
        self._expire_index_at = now + 1.0
        wall = time.time()
        due = [g for g, (lo, _) in self.pusher.ttl_groups.items() if lo <= wall]
        if not due:
            return
        skipped: set[int] = set()  # (groups of a master taken for down: done once it answers)
        try:
            self.stats.expired_unindexed += self.store.expire_index(wall, due, skipped=skipped)
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
            _, hi = self.pusher.ttl_groups[g]
            if hi <= wall:
                del self.pusher.ttl_groups[g]
            else:
                self.pusher.ttl_groups[g] = (wall + 1.0, hi)

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


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def _index_l3(l3: DaemonL3) -> None:
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


class _StartingWord:
    """A daemon's word, while it cannot start yet, in the namespace's status file:
    ``{"starting": why, "since", "pid", ...}``, rewritten every second from a thread (one
    try to start may wait cluster.timeout on every seed), so that the agents waiting for
    it say that it runs but has not started, and why, not that none runs (presence.py
    starting_status; to every reader the word is no started daemon's status). Never
    written over a started daemon's fresh status (two daemons of a namespace on a host:
    the agents would lose the started one's partition mode); removed by :meth:`close`
    when this daemon stops before it started. Never raises."""

    def __init__(self, config: Config, name: str | None) -> None:
        self.ns = name if name is not None else config.node.namespace
        self.permissions = config.cache.l2_permissions
        try:
            segment_path(self.ns)  # (validates the name: the file lies in cache.l2_dir)
            self.path = status_path(self.ns, config.cache.l2_dir)
        except SegmentError:
            self.path = ""  # (a bad name: NodeDaemon says so)
        self.why = "its first try to reach L3 is under way"
        self.since = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvcomm-node-starting",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self.path and not self._stop.is_set():
            if not status_fresh(read_status(self.path)):  # (else a started daemon speaks)
                try:
                    write_status(self.path, {"starting": self.why[:500], "since": self.since,
                                             "pid": os.getpid(), "namespace": self.ns,
                                             "updated": time.time()}, self.permissions)
                except OSError as exc:
                    log.warning("cannot write %s: %s", self.path, exc)
                    return
            self._stop.wait(1.0)

    def close(self, started: bool) -> None:
        """Stop saying it; unless the daemon ``started`` (its own status replaces the word),
        remove the word if it is still this daemon's."""
        self._stop.set()
        self._thread.join(5)
        st = read_status(self.path) if self.path and not started else None
        if st is not None and st.get("starting") and st.get("pid") == os.getpid():
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def _try_to_start(config: Config, name: str | None, rng: random.Random,
                  stop: threading.Event) -> NodeDaemon | None:
    """One try to start the daemon (what NodeDaemon raises propagates), made in a thread
    so that SIGTERM/SIGINT (``stop``) ends the wait at once: a cluster that does not
    answer makes one try wait ``cluster.timeout`` on every seed (16 s seen). None when
    stopped first: the try is left to its thread (a daemon thread), which closes the
    daemon it still makes (its etcd lease revoked, not left to expire)."""
    out: list[Any] = []
    handoff = threading.Lock()  # (the daemon made goes to the main thread or is closed)

    def attempt() -> None:
        try:
            made = NodeDaemon(config, name, rng=rng)
        except BaseException as exc:  # (re-raised in the main thread)
            out.append(exc)
            return
        with handoff:
            if not stop.is_set():
                out.append(made)
                return
        made.close()

    t = threading.Thread(target=attempt, name="kvcomm-node-start", daemon=True)
    start_quiet(t)  # (the user's signals stay the main thread's)
    while t.is_alive():
        if stop.wait(0.05):
            # (a daemon the try made before the stop is closed here, one made after it there)
            with handoff:
                made = next((d for d in out if isinstance(d, NodeDaemon)), None)
            if made is not None:
                made.close()
            return None
    if isinstance(out[0], BaseException):
        raise out[0]
    daemon: NodeDaemon = out[0]
    return daemon


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
    word = _StartingWord(config, name)
    try:
        while True:  # a host may boot before its cluster: agents write into L2 meanwhile
            try:
                daemon = _try_to_start(config, name, rng, stop)
                if daemon is None:  # (stopped during the try)
                    word.close(started=False)
                    return 0
                break
            except Unavailable as exc:
                delay = backoff.failed()
                log.warning("cannot start yet (%s); retrying in %.1fs", exc, delay)
                word.why = f"it cannot reach L3 and retries: {exc}"
                if stop.wait(delay):
                    word.close(started=False)
                    return 0
    except BaseException:
        word.close(started=False)
        raise
    word.close(started=True)
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
