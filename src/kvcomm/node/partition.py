"""The node daemon's partition mode and heal (:mod:`kvcomm.node.presence` holds the
state machine, :class:`~kvcomm.node.presence.Reachability`; docs/design/daemon.md
tells the theory). In partition mode each round starts with one PING of one master
(:meth:`DaemonL3.reachable`) and, until Redis answers, only reads and stages the host's
local writes; the catch-up (the backlog retried at once, every group's counter checked,
the key filter distrusted until the feeds are read) starts at the first round Redis
answers, even while partition mode waits for etcd too.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

from .delivery import Inbound, Outbound
from .presence import Reachability

if TYPE_CHECKING:
    from .daemon import Daemon

log = logging.getLogger("kvcomm.node")
# how long the lease thread waits for the reach lock or a live master's PING at a tick:
# it renews the etcd lease and writes the status file, so it never waits on Redis (a
# PING that does not answer within this is looked at again at the next tick)
LEASE_WAIT_S = 0.2


class PartitionMode:
    """Whether Redis (and etcd) answer, partition mode entered and left, and the heal's
    catch-up; owns the reachability machine (:attr:`reach`), its lock (the loop and the
    lease thread both decide), the live-master probe and the heal's timeline."""

    def __init__(self, d: Daemon, out: Outbound, inb: Inbound) -> None:
        self.d = d
        self.l3, self.keys, self.config = d.l3, d.keys, d.config
        self.clock, self.stats = d.clock, d.stats
        self.out, self.inb = out, inb
        # partition mode (node/presence.py): Redis or an etcd majority out of reach
        # longer than the lease TTL; etcd's side is the presence thread's (NodeDaemon)
        self.reach = Reachability(d.config.cluster.lease_ttl, d.clock())
        # (decide runs in the loop, and from the lease thread while the loop is stuck
        # in Redis calls: a cut-off host's calls time out one after the other)
        self.reach_lock = threading.Lock()
        # the lease thread's PING of a live master (enter_if_due), running in a thread
        # of its own: (whether one answered, when it returned)
        self._live_probe: Future[tuple[bool, float]] | None = None
        self.probe_failed = False  # the last round found Redis silent (partition mode)
        self.redis_back = False  # this partition's catch-up was started (see catch_up)
        self.catching_up = False  # healed, the feeds not yet read up to their ends
        # the heal's timeline (logged): (when Redis answered, stats then, backlog logged)
        self.healing: tuple[float, int, int, bool] | None = None

    def backlog_sent(self) -> None:
        """After a push: log the heal's step when every closed window of writes waiting
        since Redis answered again is answered."""
        if (self.healing is not None and not self.healing[3]
                and self.stats.pushed > self.healing[1] and not self.out.unsent):
            self.heal_log("backlog sent")  # (every closed window of writes answered)
            self.healing = (*self.healing[:3], True)

    def caught_up(self) -> None:
        """The catch-up ends once the feeds are read up to their ends (nothing due,
        rechecked or pending) and no group is unscanned: the key filter is trusted
        again."""
        inb = self.inb
        if self.catching_up and not (inb.due or inb.recheck or inb.pending
                                     or self.d.key_filter.unscanned):
            self.catching_up = False  # the feeds are read up to their ends again
            self.keys.set_ready(True)
            self.stats.bump("caught_up")
            if self.healing is not None:
                self.heal_log("caught up with every group's feed")
                self.healing = None

    def redis_answers(self) -> bool:
        """In partition mode, one cheap probe before a round: a round's calls would each
        wait a timeout per seed (redis-py re-reads the slot map from every seed after a
        timeout), holding the loop for seconds; a probe waits one timeout, so the heal
        is noticed within one (the loop waits at most 200 ms between rounds here)."""
        if self.l3.reachable():
            self.reach.redis_ok(self.clock())
            # Redis is back (etcd may not be yet); or it answers at the first probe of this
            # partition: the heal came while a round's calls were still waiting on the cut
            # connections (partition mode was entered by the lease thread meanwhile)
            if self.probe_failed or not self.redis_back:
                self.catch_up()
            self.decide()  # (leaving it now: the backlog is pushed this round)
            return True
        return False

    def healed_meanwhile(self) -> bool:
        """A push failed in partition mode before the catch-up began: a call that waited on
        a cut connection (seconds: a timeout, then redis-py's slot-map refresh from every
        seed) may have ended after the heal. One probe: if Redis answers, the catch-up
        starts now (the backlog retried at once) and True is returned. At most once per
        partition (the catch-up, once begun, is not begun again)."""
        if not self.reach.partition or self.redis_back or not self.l3.reachable():
            return False
        self.reach.redis_ok(self.clock())
        self.stats.bump("healed_during_a_call")
        self.catch_up()
        return True

    def live_master_answers(self) -> bool:
        """A poll reached nothing: its calls all went to masters taken for down
        (DaemonL3.down), those of an idle host's sweep-free polls say (the unanswered
        groups it rechecks). Whether a master not taken for down answers a PING, asked
        at most every lease TTL / 2 (else nothing would tell Redis answering from a host
        cut off, and an idle host would enter partition mode over one hung master)."""
        if self.clock() - self.reach.redis_ok_at < self.reach.ttl / 2:
            return False
        if self.l3.live_master_answers():
            self.stats.bump("live_master_probes")
            return True
        return False

    def _probe_live(self, wait: float) -> bool | None:
        """:meth:`live_master_answers` for the lease thread: run in a thread of its own,
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
                    answered = self.live_master_answers()
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

    def decide(self) -> None:
        """Enter or leave partition mode (see node/presence.py). Leaving it retries the
        backlog and the feeds at once instead of after the backoff."""
        with self.reach_lock:
            self._decide()

    def enter_if_due(self) -> None:
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
                                  self.d.presence.etcd_seen_at if self.d.presence else None):
                self._decide(wait=LEASE_WAIT_S)
        finally:
            self.reach_lock.release()

    def _decide(self, wait: float | None = None) -> None:
        """``wait``: from the lease thread, how long a live master's PING is waited for
        (it runs in a thread of its own; undecided meanwhile); None: until it returns."""
        now = self.clock()
        if (not self.reach.partition and now - self.reach.redis_ok_at > self.reach.ttl
                and self.l3.down):
            # a partial cut (some masters taken for down, another answers a PING now) is
            # no partition: the loop's first call to each master that stopped answering
            # waits a timeout, one master after the other, and no call of those answered,
            # so a few of them in a row outlast the lease TTL
            answered = self.live_master_answers() if wait is None else self._probe_live(wait)
            if answered is None:  # (its PING is still out: decided at a later tick)
                return
            if answered:
                now = self.clock()
                self.reach.redis_ok(now)
        change = self.reach.update(now, self.d.presence.etcd_seen_at if self.d.presence else None)
        if change == "enter":
            self.stats.bump("partitions")
            log.warning("partition mode: %s; agents keep writing eventual keys into L2 (at "
                        "most cluster.outbound_max waiting), strong keys need etcd",
                        self.reach.reason)
            # probe often: the heal is found within ~200 ms, not after a 2 s backoff; and
            # do not spend each probe re-reading the slot map from every unreachable seed
            self.out.backoff.cap = self.inb.backoff.cap = 0.2
            self.l3.refresh_every = 10.0
            self.redis_back = False
        elif change == "leave":
            self.stats.bump("heals")
            log.warning("partition healed: replaying %d waiting writes through L3's merge",
                        self.d.backlog())
            self.out.backoff.cap = self.inb.backoff.cap = 2.0
            self.l3.refresh_every = 0.5
            if not self.redis_back:  # (else done when Redis came back, etcd still out)
                self.catch_up()

    def catch_up(self) -> None:
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
        self.distrust_filter()
        self.healing = (self.clock(), self.stats.pushed,
                        self.stats.pulled + self.stats.skipped_remote, False)
        log.info("Redis answers again: sending the backlog of %d writes, reading every "
                 "group's feed", self.d.backlog())

    def distrust_filter(self) -> None:
        """Agents stop taking the key filter's "absent" for an answer (they read L3)
        until the catch-up ends (:meth:`caught_up`: every group's feed read up to its
        end and no group unscanned); every group's hints may have been lost: every
        counter is checked now."""
        self.keys.set_ready(False)
        self.catching_up = True
        self.inb.lost(range(self.config.cluster.groups))

    def heal_log(self, what: str) -> None:
        """One step of a heal's catch-up, in the log with the time since Redis answered
        again and the records pushed and remote changes read since (the heal's timeline)."""
        assert self.healing is not None
        t0, pushed, read, _ = self.healing
        log.info("heal: %s %.2fs after Redis answered (%d records pushed, %d remote changes "
                 "read)", what, self.clock() - t0, self.stats.pushed - pushed,
                 self.stats.pulled + self.stats.skipped_remote - read)

