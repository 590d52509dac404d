"""Review of stop 23 (partial cuts), as an adversary, on real Redis Clusters:

1. The masters' calls of a sweep, feed read or push ran at the same time on a pool of 8
   threads: a host cut off from more than 8 masters waited a timeout per 8 of them.
2. Whether a live master answers (the PING that keeps a host cut off from some masters
   out of partition mode) asked one master not taken for down, the next in turn: one
   the host is cut off from too, not yet taken for down, said no, and the host entered
   partition mode while another master answered. And the lease thread (etcd lease,
   status file) waited on that PING, or on the loop's, a timeout or two.
3. A feed read of several masters noted each group as read where it was before the call
   returned: when another master's part failed (Unavailable), the caller discarded the
   read with its cursor checks, and the next read of a group whose node had changed (a
   failover's loss to detect) was not checked again.
"""

from __future__ import annotations

import random
import shutil
import threading
import time
from collections.abc import Iterator

import pytest

from kvcomm.devcluster.redis_cluster import RedisCluster
from kvcomm.tiers.l3 import L3Store, feed_key, group_of
from tests.support.daemon_harness import Host
from tests.support.helpers import wait_for

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed"),
]


HUNG_NODE_TIMEOUT_MS = 120_000  # no failover while a test holds its masters stopped


def test_a_sweep_reaching_more_hung_masters_than_eight_waits_one_timeout() -> None:
    """A sweep (``feed_heads``) of every group of a 10-master cluster, 9 of them stopped
    (SIGSTOP): the masters are called at the same time, one thread each, so the sweep
    waits about as long as it does for one stopped master — not twice that (8 threads:
    the 9th stopped master's call waited for a thread, then its own timeout), which
    grows with the masters a host is cut off from, past the lease TTL."""
    with RedisCluster(masters=10, replicas=0, node_timeout_ms=HUNG_NODE_TIMEOUT_MS) as c:
        store = L3Store(c.seeds, timeout=1.0)
        paused: list[int] = []
        try:
            groups = list(store.groups)
            store.feed_heads(groups)  # (every master's connection made)
            masters = sorted({int(n.port) for n in store.rc.get_primaries()})
            assert len(masters) == 10
            # one stopped master: what one timeout costs a sweep here
            c.pause(masters[0])
            paused.append(masters[0])
            t0 = time.monotonic()
            store.feed_heads(groups)
            one = time.monotonic() - t0
            assert f"127.0.0.1:{masters[0]}" in store.down  # (the fault happened)
            c.resume(masters[0])
            paused.remove(masters[0])
            wait_for(lambda: not store.down, 20, "the master to answer again")
            store.feed_heads(groups)
            for p in masters[:9]:
                c.pause(p)
                paused.append(p)
            t0 = time.monotonic()
            store.feed_heads(groups)
            nine = time.monotonic() - t0
            print(f"a sweep with 1 master stopped: {one:.2f}s; with 9: {nine:.2f}s")
            assert set(store.down) == {f"127.0.0.1:{p}" for p in masters[:9]}, store.down
            assert nine < 1.5 * one + 0.3, (one, nine)
        finally:
            for p in paused:
                c.resume(p)
            store.close()


@pytest.fixture(scope="module")
def cluster3() -> Iterator[RedisCluster]:
    with RedisCluster(masters=3, replicas=0, node_timeout_ms=HUNG_NODE_TIMEOUT_MS) as c:
        yield c


def _three(store: L3Store, seed: int) -> tuple[int, int, int]:
    """(a master, another, the third), the first two at random."""
    masters = sorted({int(n.port) for n in store.rc.get_primaries()})
    assert len(masters) == 3
    random.Random(seed).shuffle(masters)
    return masters[0], masters[1], masters[2]


def test_a_live_master_is_found_while_a_cut_master_is_not_yet_taken_for_down(
        cluster3: RedisCluster, seed: int) -> None:
    """Two of three masters stopped, only the first taken for down yet (a sweep's call
    there timed out; the loop has not called the second since): whether a live master
    answers is asked of every master not taken for down, so the answer is yes however
    often it is asked — asking one, the next in turn, found the stopped one every other
    time (and the daemon entered partition mode, a master answering)."""
    store = L3Store(cluster3.seeds, timeout=1.0)
    paused: list[int] = []
    try:
        first, second, live = _three(store, seed)
        groups = list(store.groups)
        store.feed_heads(groups)  # (every master's connection made)
        cluster3.pause(first)
        paused.append(first)
        store.feed_heads(groups)
        assert set(store.down) == {f"127.0.0.1:{first}"}, store.down
        cluster3.pause(second)
        paused.append(second)
        answers = [store.live_master_answers() for _ in range(2)]
        print(f"stopped {first} (down) and {second}; {live} answers: {answers}; "
              f"down {sorted(store.down)}")
        assert answers == [True, True]
        assert f"127.0.0.1:{live}" not in store.down
    finally:
        for p in paused:
            cluster3.resume(p)
        store.close()


def _one_down(cluster3: RedisCluster, seed: int, name: str, timeout: float,
              ) -> tuple[Host, tuple[int, int, int], list[int]]:
    """A host (``cluster.timeout`` ``timeout``, lease TTL 1 s) that took the first of the
    masters (_three) for down, stopped, its loop stopped then (partition mode is decided
    by hand). Returns it, the three masters' ports and the masters stopped (for the
    clean-up)."""
    a = Host(cluster3, f"{name}-{seed % 1000}", seed, {"timeout": timeout, "lease_ttl": 1.0})
    paused: list[int] = []
    try:
        da = a.daemon
        assert da is not None and isinstance(da.l3, L3Store)
        three = _three(da.l3, seed)
        key = next(k for k in (f"{name}/{seed}/{i}" for i in range(200))
                   if int(da.l3.rc.get_node_from_key(feed_key(group_of(k))).port) == three[0])
        cluster3.pause(three[0])
        paused.append(three[0])
        a.kv.put(key, 1)
        wait_for(lambda: f"127.0.0.1:{three[0]}" in da.l3.down, 20,
                 "A to take the master for down")
        a.stop(close=False)  # (the loop, not the daemon: decided by hand)
    except BaseException:
        for p in paused:
            cluster3.resume(p)
        a.close()
        raise
    return a, three, paused


def test_a_host_cut_off_from_a_master_not_yet_down_stays_out_of_partition_mode(
        cluster3: RedisCluster, seed: int) -> None:
    """A daemon that takes one stopped master for down and has not called a second
    stopped one yet, whose loop heard no answer for a lease TTL: partition mode is
    decided by a live master (the third answers), however often it is decided — not by
    whichever master not taken for down came next in turn."""
    a, (first, second, live), paused = _one_down(cluster3, seed, "lm-a", 1.0)
    try:
        da = a.daemon
        assert da is not None and isinstance(da.l3, L3Store)
        cluster3.pause(second)
        paused.append(second)
        for _ in range(2):
            with da.reach_lock:
                da.reach.redis_ok_at = da.clock() - 3 * da.reach.ttl
            da.decide_partition()
            assert not da.reach.partition and da.reach.entered == 0, (
                da.reach.reason, sorted(da.l3.down))
        print(f"stopped {first}, {second}; {live} answers; down: {sorted(da.l3.down)}")
        assert f"127.0.0.1:{live}" not in da.l3.down
    finally:
        for p in paused:
            cluster3.resume(p)
        a.close()


def _cut_host(cluster3: RedisCluster, seed: int, name: str) -> tuple[Host, list[int]]:
    """A host (cluster.timeout 2 s) that takes one stopped master for down, its loop
    stopped, then every master stopped (a full cut: two not yet taken for down), its
    clock of Redis answers set back past the lease TTL. Returns it and the masters
    stopped (for the clean-up)."""
    a, (_, second, third), paused = _one_down(cluster3, seed, name, 2.0)
    try:
        da = a.daemon
        assert da is not None and isinstance(da.l3, L3Store)
        for p in (second, third):
            cluster3.pause(p)
            paused.append(p)
        assert len(da.l3.down) == 1, da.l3.down
        with da.reach_lock:
            da.reach.redis_ok_at = da.clock() - 3 * da.reach.ttl
    except BaseException:
        for p in paused:
            cluster3.resume(p)
        a.close()
        raise
    return a, paused


def test_the_lease_threads_tick_never_waits_on_a_redis_ping(
        cluster3: RedisCluster, seed: int) -> None:
    """The lease thread (which renews the etcd lease and writes the status file) decides
    partition mode when it is overdue; with masters taken for down it asks a live master
    first. Every master stopped, two not yet taken for down: each tick returns at once
    (the PING runs in a thread of its own; before, the tick waited its timeout, 2 s —
    a lease renewal and the status file late by as much), and once the PING timed out a
    tick enters partition mode."""
    a, paused = _cut_host(cluster3, seed, "lt")
    try:
        da = a.daemon
        assert da is not None
        ticks: list[float] = []

        def tick() -> bool:
            t0 = time.monotonic()
            da.enter_partition_if_due()
            ticks.append(time.monotonic() - t0)
            return da.reach.partition

        wait_for(tick, 15, "a tick to enter partition mode")
        print(f"{len(ticks)} ticks, the longest {max(ticks):.2f}s; {da.reach.reason}; "
              f"down {sorted(da.l3.down)}")
        assert max(ticks) < 1.2, ticks  # (a tick that waited the PING: 2 s and more)
        assert da.reach.entered == 1 and len(da.l3.down) == 3, da.l3.down
    finally:
        for p in paused:
            cluster3.resume(p)
        a.close()


def test_the_lease_threads_tick_does_not_wait_for_the_loops_ping(
        cluster3: RedisCluster, seed: int) -> None:
    """The loop decides partition mode under the reach lock, PINGing the masters not
    taken for down (a timeout, 2 s, when none answers). A lease-thread tick meanwhile
    returns at once, leaving the decision to the loop (before, it waited for the lock:
    the lease renewal and the status file late by a timeout)."""
    a, paused = _cut_host(cluster3, seed, "lw")
    try:
        da = a.daemon
        assert da is not None
        loop = threading.Thread(target=da.decide_partition, daemon=True)
        loop.start()
        wait_for(lambda: da.reach_lock.locked() or not loop.is_alive(), 10,
                 "the loop to decide partition mode")
        t0 = time.monotonic()
        da.enter_partition_if_due()
        took = time.monotonic() - t0
        contended = loop.is_alive()
        loop.join(30)
        print(f"the tick took {took:.2f}s while the loop PINGed; {da.reach.reason}")
        assert took < 1.2, took  # (a tick that waited for the loop's PING: 2 s and more)
        assert contended, "the loop's PING returned before the tick: no contention"
        assert da.reach.partition and da.reach.entered == 1
    finally:
        for p in paused:
            cluster3.resume(p)
        a.close()


def test_a_feed_read_that_fails_on_one_master_leaves_the_others_checks_to_do(
        cluster3: RedisCluster) -> None:
    """A feed read with checks (``checked``) of two masters' groups, one master busy (a
    script that runs on: BUSY, an Unavailable that is no master down). The caller gets
    Unavailable and discards what it read, the other master's cursor checks included;
    so the next read of that master's group checks it again (it was noted as read
    there: the check of a group whose node changed — a failover's loss — was lost)."""
    import redis

    from kvcomm.errors import Unavailable

    store = L3Store(cluster3.seeds, timeout=2.0)
    busy_port = 0
    try:
        masters = sorted({int(n.port) for n in store.rc.get_primaries()})
        owner = {g: int(store.rc.get_node_from_key(store.groups.feed_key(g)).port)
                 for g in store.groups}
        g1 = next(g for g in store.groups if owner[g] == masters[0])
        g2 = next(g for g in store.groups if owner[g] == masters[1])
        busy_port = masters[1]
        busy = redis.Redis(port=busy_port)
        busy.config_set("busy-reply-threshold", 50)
        spin = threading.Thread(target=lambda: _quietly(
            lambda: redis.Redis(port=busy_port).eval("while true do end", 0)), daemon=True)
        spin.start()

        def is_busy() -> bool:
            try:
                redis.Redis(port=busy_port, socket_timeout=1).ping()
            except redis.exceptions.ResponseError as exc:
                return "BUSY" in str(exc)
            return False

        wait_for(is_busy, 10, "the master to run a script that does not end")
        first: dict[int, bool] = {}
        with pytest.raises(Unavailable, match="BUSY"):
            store.feed_many({g1: b"0-0", g2: b"0-0"}, checked=first)
        assert g1 in first  # (the fault: its check was made, then discarded with the read)
        redis.Redis(port=busy_port).script_kill()
        spin.join(10)
        busy_port = 0
        again: dict[int, bool] = {}
        store.feed_many({g1: b"0-0"}, checked=again)
        assert again.get(g1) is False, again  # checked again (nothing lost there)
        later: dict[int, bool] = {}
        store.feed_many({g1: b"0-0"}, checked=later)
        assert g1 not in later  # (read there and returned: not checked again)
    finally:
        if busy_port:
            _quietly(lambda: redis.Redis(port=busy_port).script_kill())
        store.close()


def _quietly(fn: object) -> None:
    try:
        fn()  # type: ignore[operator]
    except Exception:  # (the script killed, or none running)
        pass
