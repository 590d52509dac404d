"""The built-in faults, against a dev cluster (:class:`~kvcomm.faults.target.DevClusterTarget`).

=====================  ==============================================================
``pause-daemon``       SIGSTOP a host's node daemon (wherever it is, even holding the
                       host's L2 lock); SIGCONT at heal.
``kill-daemon``        SIGKILL a host's node daemon (a crash); restart it at heal.
``kill-redis-master``  SIGKILL the Redis master serving a group; at heal, wait for its
                       replica to take over, then start the killed node again from its
                       directory: having lost its data, it rejoins as a replica.
``pause-redis-master`` SIGSTOP the Redis master serving a group (hung: connections stay
                       open, nothing answers; held past the node timeout, its replica
                       takes over) and write a probe key of that group on a host; at
                       heal, SIGCONT and wait until the cluster is whole again.
``trim-stream``        XTRIM a group's change feed to nothing (MAXLEN 0) while a host's
                       daemon has not read a change of a key it holds (its daemon is
                       paused across the change and the trim).
``feed-overflow``      a burst of writes larger than a host's L2 change-feed ring (the
                       soak runs hosts with a small ``cache.watch_buffer``) while its
                       daemon is paused, with deletes of keys L3 holds at its start.
``l2-evict``           a burst of large values, 1.5 times a host's L2 (the soak runs hosts
                       with a small ``cache.l2_size``), so that L2 must evict; small
                       probe keys written just before, and in L3, are eviction victims.
``kill-etcd-member``   SIGKILL an etcd member, the leader half of the time; at heal,
                       start it again and wait until the cluster is healthy.
``pause-etcd-member``  SIGSTOP an etcd member, the leader half of the time; SIGCONT at heal.
``partition-host``     cut a host off from Redis and etcd, both directions, through its
                       fault proxy (needs ``dev-cluster up --proxies``); heal restores,
                       then measures heal -> convergence: probes written on both sides
                       while cut off, read on every host every 50 ms.
``drop-connections``   reset every live connection of a host to Redis and etcd (proxy).
=====================  ==============================================================

Faults that write use keys under ``soak/n/`` through the target's recorders (process
``nemesis/<host>``), so the soak's checker sees those writes like the workload's. Probe
keys are written once and never again, which makes a fault's damage visible at the end
of the run even when the workload would have rewritten its own keys since.
"""

from __future__ import annotations

import random
import time

from .._wait import wait_until
from ..errors import Unavailable
from ..tiers.l2 import key_hash
from ..tiers.l3 import GROUPS, feed_key, group_of
from .fault import Fault, register
from .history import DELETE, PUT, value_id
from .target import DevClusterTarget


class DevFault(Fault):
    """A fault against a dev cluster, with helpers for the ones that write."""

    target: DevClusterTarget
    pid: int | None = None  # a daemon this fault paused, until heal resumes it

    def _resume(self) -> str:
        """Resume the daemon this fault paused, if any; says what was done."""
        if self.pid is None:
            return ""
        self.target.resume_daemon(self.pid)
        self.pid = None
        return "daemon resumed"

    def _group_master(self, rng: random.Random) -> tuple[int, int]:
        """A random group and the port of the master serving it now (in the effect)."""
        group = rng.randrange(GROUPS)
        port = self.target.master_of_group(group)
        self.effect.update(group=group, port=port)
        return group, port

    def _host(self, rng: random.Random) -> int:
        i = rng.randrange(self.target.hosts)
        self.effect["host"] = self.target.host_ids[i]
        return i

    def _put(self, host: int, key: str, pad: int = 0) -> str:
        """An acknowledged put through host ``host``'s recorder; returns the value.
        Raises Unavailable when the put was not acknowledged."""
        w = self.target.recorder(host)
        value = w.new_value(pad)
        if w.put(key, value) is None:
            raise Unavailable(f"the nemesis's put of {key!r} on {w.host} was not acknowledged")
        return value

    def _in_l3(self, key: str, value: str) -> bool:
        try:
            rec = self.target.l3().get(key)
        except Unavailable:
            return False
        return rec is not None and not rec.tombstone and \
            value_id(rec.value.decode("utf-8", "replace")) == value_id(value)

    def _clean(self, host: int, keys: list[str]) -> bool:
        """True when none of ``keys`` is still waiting for L3 on ``host`` (dirty)."""
        seg = self.target.segment(host)
        for key in keys:
            kb = key.encode()
            rec = seg.read(kb, key_hash(kb))
            if rec is not None and seg.is_dirty(rec.word):
                return False
        return True


@register
class PauseDaemon(DevFault):
    name = "pause-daemon"
    summary = "SIGSTOP a host's node daemon; SIGCONT at heal"
    requires = frozenset({"daemons"})
    hold = (0.5, 4.0)

    def inject(self, rng: random.Random) -> str:
        self.host = self._host(rng)
        self.pid = self.target.pause_daemon(self.host)
        return f"SIGSTOP {self.target.host_ids[self.host]}'s daemon (pid {self.pid})"

    def heal(self) -> str:
        return self._resume() and "SIGCONT"


@register
class KillDaemon(DevFault):
    name = "kill-daemon"
    summary = "SIGKILL a host's node daemon; start it again at heal"
    requires = frozenset({"daemons"})
    hold = (0.2, 3.0)

    def inject(self, rng: random.Random) -> str:
        self.host: int | None = self._host(rng)
        pid = self.target.kill_daemon(self.host)
        self.effect["killed_pid"] = pid
        return f"SIGKILL {self.target.host_ids[self.host]}'s daemon (pid {pid})"

    def heal(self) -> str:
        if getattr(self, "host", None) is None:
            return ""
        assert self.host is not None
        pid = self.target.restart_daemon(self.host)
        self.host = None
        self.effect["restarted_pid"] = pid
        return f"restarted (pid {pid}), heartbeating"


@register
class KillRedisMaster(DevFault):
    name = "kill-redis-master"
    summary = "SIGKILL a Redis master (its replica fails over); restart it as a replica at heal"
    requires = frozenset({"redis"})
    hold = (0.5, 3.0)

    def inject(self, rng: random.Random) -> str:
        group, port = self._group_master(rng)
        self.killed_at = time.monotonic()
        pid = self.target.kill_redis(port)
        self.port: int | None = port
        return f"SIGKILL the Redis master on port {port} (pid {pid}, serves group {group})"

    def heal(self) -> str:
        if getattr(self, "port", None) is None:
            return ""
        port = self.port
        assert port is not None
        self.target.wait_failover(port)
        took = time.monotonic() - self.killed_at
        self.effect["failover_s"] = round(took, 2)
        pid = self.target.restart_redis(port)
        self.port = None
        self.effect["rejoined"] = True
        return (f"a replica took over {took:.1f}s after the kill; port {port} restarted "
                f"(pid {pid}) and in sync as a replica")


@register
class PauseRedisMaster(DevFault):
    name = "pause-redis-master"
    summary = "SIGSTOP a Redis master (hung) and write to its group; SIGCONT at heal"
    requires = frozenset({"redis"})
    hold = (0.5, 4.0)

    def inject(self, rng: random.Random) -> str:
        group, port = self._group_master(rng)
        host = self._host(rng)
        self.paused_at = time.monotonic()
        self.paused: int | None = self.target.pause_redis(port)
        # a write the stopped master must take once it answers (or its successor)
        key = key_in_group(f"soak/n/pm{int(self.paused_at * 1000) % 10**9}-", group)
        self._put(host, key)
        self.effect["probe"] = key
        return (f"SIGSTOP the Redis master on port {port} (pid {self.paused}, serves group "
                f"{group}); wrote {key} on {self.target.host_ids[host]}")

    def heal(self) -> str:
        pid = getattr(self, "paused", None)
        if pid is None:
            return ""
        self.paused = None
        held = time.monotonic() - self.paused_at
        self.target.resume_redis(pid)
        port = self.effect["port"]
        still = any(n["port"] == port and "master" in n["flags"]
                    for n in self.target.cluster_nodes())
        self.effect.update(held_s=round(held, 2), failed_over=not still)
        return (f"SIGCONT after {held:.1f}s; " + ("still the master" if still else
                "its replica had taken over: it rejoined as a replica") + "; cluster whole")


def key_in_group(prefix: str, group: int) -> str:
    """The first key ``prefix + n`` of hash-slot group ``group``."""
    n = 0
    while group_of(f"{prefix}{n}") != group:
        n += 1
    return f"{prefix}{n}"


@register
class TrimStream(DevFault):
    name = "trim-stream"
    summary = "XTRIM a group's change feed to nothing while a host has an unread change"
    requires = frozenset({"daemons", "l3"})

    def inject(self, rng: random.Random) -> str:
        t = self.target
        group = rng.randrange(GROUPS)
        self.effect["group"] = group
        h = self._host(rng)
        paused = ""
        if t.hosts > 1:
            a = (h + 1 + rng.randrange(t.hosts - 1)) % t.hosts
            key = key_in_group(f"soak/n/trim/{rng.getrandbits(32):08x}/", group)
            self.effect["probe"] = key
            v1 = self._put(a, key)
            wait_until(lambda: self._in_l3(key, v1), 15, f"{key} to reach L3")
            reader = t.recorder(h)

            def held() -> bool:  # read on h: L2 fills from L3, so h's daemon tracks the key
                ok, got = reader.get(key)
                return ok and value_id(got) == value_id(v1) and \
                    t.segment(h).read(key.encode(), key_hash(key.encode())) is not None

            wait_until(held, 15, f"{t.host_ids[h]} to hold {key}")
            self.pid = t.pause_daemon(h, avoid_lock=True)
            v2 = self._put(a, key)
            wait_until(lambda: self._in_l3(key, v2), 15, f"the change of {key} to reach L3")
            paused = (f" while {t.host_ids[h]}'s daemon was paused; probe {key} changed on "
                      f"{t.host_ids[a]} in between")
        n = t.l3()._call(lambda: t.l3().rc.xtrim(feed_key(group), maxlen=0, approximate=False))
        self.effect["trimmed"] = int(n)
        self.heal()
        return f"XTRIM {feed_key(group)} MAXLEN 0 removed {n} entries{paused}"

    def heal(self) -> str:
        return self._resume()


@register
class FeedOverflow(DevFault):
    name = "feed-overflow"
    summary = "a burst of writes larger than a host's L2 change-feed ring, daemon paused"
    requires = frozenset({"daemons", "l2"})
    PROBES = 8

    def inject(self, rng: random.Random) -> str:
        t = self.target
        h = self._host(rng)
        host = t.host_ids[h]
        seg = t.segment(h)
        ring = seg.layout.feed_n
        bound = t.client(h)._max_dirty
        tag = f"{rng.getrandbits(32):08x}"
        probes = [f"soak/n/ovf/{tag}/d{i}" for i in range(self.PROBES)]
        for p in probes:
            self._put(h, p)
        wait_until(lambda: self._clean(h, probes), 15, f"the probes to reach L3 from {host}")
        # a few keys rewritten over and over: every write is a feed event, but a rewrite of
        # a key already waiting for L3 adds nothing to cluster.outbound_max's count
        fillers = [f"soak/n/ovf/{host}/f{i % 16}" for i in range(ring + 16)]
        w = t.recorder(h)
        ok = False
        events = 0
        for _ in range(3):  # a single check of the write bound guards today's batches
            wait_until(lambda: seg.feed_head() - seg.sync_cursor < bound // 4, 15,
                 f"{host}'s sync backlog to drain")
            self.pid = t.pause_daemon(h, avoid_lock=True)
            head = seg.feed_head()
            ok = w.batch([(DELETE, p, None) for p in probes]
                         + [(PUT, f, w.new_value()) for f in fillers])
            events = seg.feed_head() - head
            self.heal()
            if ok:
                break
        self.effect.update(ring=ring, events=events, overflowed=ok and events > ring,
                           refused=not ok)
        if not ok:
            return (f"{host}: a batch of {len(probes) + len(fillers)} writes (ring {ring}) was "
                    "refused three times (Unavailable): no overflow")
        return (f"{host}: daemon paused, one batch deleted {len(probes)} probes in L3 and "
                f"wrote {len(fillers)} keys: {events} feed events into a ring of {ring}")

    def heal(self) -> str:
        return self._resume()


@register
class L2Evict(DevFault):
    name = "l2-evict"
    summary = "a burst of large values, 1.5 times a host's L2, forcing evictions"
    requires = frozenset({"l2"})
    PROBES = 8

    def inject(self, rng: random.Random) -> str:
        t = self.target
        h = self._host(rng)
        host = t.host_ids[h]
        seg = t.segment(h)
        tag = f"{rng.getrandbits(32):08x}"
        probes = [f"soak/n/evict/{tag}/p{i}" for i in range(self.PROBES)]
        for p in probes:
            self._put(h, p)
        wait_until(lambda: self._clean(h, probes), 15, f"the probes to reach L3 from {host}")
        data = seg.layout.data_size
        size = max(4096, data // 256)
        count = int(1.5 * data / size) + 1
        w = t.recorder(h)
        before = seg.info()["evictions"]
        refused = 0
        for i in range(count):
            if w.put(f"soak/n/evict/{host}/b{i}", w.new_value(pad=size)) is None:
                refused += 1  # L2 full of writes not yet in L3: give the daemon a moment
                time.sleep(0.05)
        evictions = seg.info()["evictions"] - before
        gone = sum(seg.read(p.encode(), key_hash(p.encode())) is None for p in probes)
        self.effect.update(evictions=evictions, probes_evicted=gone, values=count,
                           value_bytes=size, refused=refused)
        return (f"{host}: {count} values of {size // 1024} KiB into an L2 of "
                f"{data / 2**20:.1f} MiB: {evictions} evictions, {gone}/{len(probes)} probes "
                f"evicted, {refused} puts refused")


@register
class KillEtcdMember(DevFault):
    name = "kill-etcd-member"
    summary = "SIGKILL an etcd member (the leader half of the time); restart it at heal"
    requires = frozenset({"etcd"})
    hold = (0.5, 4.0)

    def inject(self, rng: random.Random) -> str:
        t = self.target
        leader = rng.random() < 0.5
        member = None if leader else rng.randrange(t.etcd_members())
        pid = t.etcd_pid(t.etcd_leader()) if leader else t.etcd_pid(member or 0)
        self.member: int | None = t.kill_etcd(member, leader=leader)
        self.effect.update(member=self.member + 1, leader=leader, pid=pid)
        return f"SIGKILL etcd member {self.member + 1}" + (" (the leader)" if leader else "")

    def heal(self) -> str:
        if getattr(self, "member", None) is None:
            return ""
        t0 = time.monotonic()
        self.target.restart_etcd(self.member)
        self.member = None
        self.effect["healthy_after_s"] = round(time.monotonic() - t0, 2)
        return "restarted; the cluster is healthy"


@register
class PauseEtcdMember(DevFault):
    name = "pause-etcd-member"
    summary = "SIGSTOP an etcd member; SIGCONT at heal"
    requires = frozenset({"etcd"})
    hold = (0.5, 4.0)

    def inject(self, rng: random.Random) -> str:
        leader = rng.random() < 0.5  # the leader half of the time: a stalled election
        t = self.target
        self.member: int | None = t.etcd_leader() if leader else rng.randrange(t.etcd_members())
        assert self.member is not None
        pid = t.pause_etcd(self.member)
        self.effect.update(member=self.member + 1, pid=pid, leader=leader)
        return f"SIGSTOP etcd member {self.member + 1} (pid {pid})" + (" (the leader)" if leader
                                                                      else "")

    def heal(self) -> str:
        if getattr(self, "member", None) is None:
            return ""
        assert self.member is not None
        self.target.resume_etcd(self.member)
        self.member = None
        return "SIGCONT"


PROBES = "soak/n/"
CONVERGE_BOUND = 30.0  # seconds a partition's heal waits for every host to converge


@register
class PartitionHost(DevFault):
    name = "partition-host"
    summary = "cut a host off from Redis and etcd (both directions) through its proxy"
    requires = frozenset({"proxy"})
    hold = (1.0, 6.0)

    def inject(self, rng: random.Random) -> str:
        self.host: int | None = self._host(rng)
        st = self.target.partition(self.host, "blackhole")
        self.held_before = int(st["held_chunks"]) + int(st["held_connections"])
        # probes written on both sides while cut off: at heal, the time until every host
        # reads both is the heal -> convergence time (effect["converge_s"])
        t = self.target
        self.probes: dict[str, str] = {}
        if t.hosts > 1 and t.history_dir is not None:
            tag = f"{PROBES}partition-host/{t.host_ids[self.host]}/{time.time_ns()}"
            other = (self.host + 1 + rng.randrange(t.hosts - 1)) % t.hosts
            for side, h in (("in", self.host), ("out", other)):
                try:
                    self.probes[f"{tag}/{side}"] = self._put(h, f"{tag}/{side}")
                except Unavailable:
                    pass  # (the measure then covers the side that was written)
        return f"{self.target.host_ids[self.host]} cut off from Redis and etcd"

    def heal(self) -> str:
        if getattr(self, "host", None) is None:
            return ""
        assert self.host is not None
        # evidence: traffic the host tried to send while cut off
        st = self.target.proxy_status(self.host)
        held = int(st["held_chunks"]) + int(st["held_connections"]) - self.held_before
        self.target.heal_network(self.host)
        t0 = time.monotonic()
        self.effect["held"] = held
        self.host = None
        if not self.probes:
            return f"healed ({held} requests and connections were held while cut off)"
        converged = self._converged_within(CONVERGE_BOUND)
        took = time.monotonic() - t0
        self.effect["converge_s"] = round(took, 3) if converged else None
        return (f"healed ({held} requests and connections were held while cut off); every "
                + (f"host converged in {took:.2f}s" if converged
                   else f"host had NOT converged after {CONVERGE_BOUND:g}s"))

    def _converged_within(self, bound: float) -> bool:
        """Probe every host every 50 ms until each reads every probe's value."""
        t = self.target
        end = time.monotonic() + bound
        pending = {(i, k) for i in range(t.hosts) for k in self.probes}
        while time.monotonic() < end:
            for i, k in sorted(pending):
                try:
                    if value_id(t.probe_client(i).get(k)) == value_id(self.probes[k]):
                        pending.discard((i, k))
                except Unavailable:
                    pass
            if not pending:
                return True
            time.sleep(0.05)
        return False


@register
class DropConnections(DevFault):
    name = "drop-connections"
    summary = "reset every live connection of a host to Redis and etcd"
    requires = frozenset({"proxy"})

    def inject(self, rng: random.Random) -> str:
        h = self._host(rng)
        n = self.target.drop_connections(h)
        self.effect["dropped"] = n
        return f"{self.target.host_ids[h]}: {n} live connections reset"

    def heal(self) -> str:
        return ""
