"""Bounds crossed with faults of Redis masters, on real daemons and a real Redis Cluster.

1. ``cluster.outbound_max`` reached while the writes of a stopped master (SIGSTOP, a node
   timeout long enough that the cluster does not fail it over) are parked
   (``Outbound.parked``): ``put`` raises Unavailable instead of losing a write, the other
   masters' writes acknowledged before and after still cross, and after SIGCONT every
   acknowledged write — and no refused one — ends in L3 and on the other host.
2. A partial cut: one host cut off (its own fault proxies, in blackhole) from 2 of the 3
   masters, the other host untouched. It is not partition mode (one master answers);
   the reachable master's writes cross both ways; the others park and arrive after the
   heal; both hosts end on L3's value for every key.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvcomm
from kvcomm.devcluster.procs import stop
from kvcomm.devcluster.redis_cluster import RedisCluster
from kvcomm.faults.proxy import ProxyControl, start_proxy
from kvcomm.node.daemon import NodeDaemon
from kvcomm.node.presence import STATUS_FRESH_S, read_status, status_path, write_status
from kvcomm.tiers import l2
from kvcomm.tiers.l3 import DaemonL3, L3Store, feed_key, group_of
from tests.cluster.test_hung_master import _master_port
from tests.cluster.test_hung_master import cluster as cluster  # noqa: F401 (the fixture: 3 masters, no failover)
from tests.support.daemon_harness import Host
from tests.support.helpers import wait_for

TIMEOUT = 1.0  # cluster.timeout: how long the first call to a stopped master waits
BOUND = 16  # cluster.outbound_max of the writing host


def _key_master(store: L3Store, key: str) -> int:
    """The port of the master serving ``key``'s record and feed (one slot: its group's)."""
    return _master_port(store, feed_key(group_of(key)))


def _daemon(h: Host) -> NodeDaemon:
    assert h.daemon is not None
    return h.daemon


def _l3_values(cluster: RedisCluster, keys: list[str]) -> dict[str, object]:
    check = L3Store(cluster.seeds)
    try:
        out: dict[str, object] = {}
        for k in keys:
            r = check.get(k)
            out[k] = None if r is None or r.tombstone else r.decode_value(k)
        return out
    finally:
        check.close()


@pytest.mark.parametrize("status, says", [
    (None, "is `kvcomm node` running"),
    ({"partition": True, "partition_reason": "Redis unreachable for 7.0s"},
     "partition mode (Redis unreachable for 7.0s)"),
    ({"masters_down": ["10.0.0.7:6379"], "parked": 3},
     "Redis master(s) 10.0.0.7:6379 not answering"),
    ({"masters_down": []}, "the node daemon is sending them"),
    ({"masters_down": ["10.0.0.7:6379"], "stale": True}, "is `kvcomm node` running"),
])
def test_a_write_refused_at_outbound_max_says_what_holds_the_writes_back(
        ns: str, status: dict[str, object] | None, says: str) -> None:
    """The Unavailable of a write refused at ``cluster.outbound_max`` says what the host's
    node daemon last reported (its status file, while fresh): no daemon, partition
    mode, masters down (a partial cut or a hung master), or only a slow L3. No Redis:
    puts never call L3; the status file is written as the daemon writes it."""
    cfg = kvcomm.Config.from_mapping({
        "node": {"host_id": "refused", "namespace": ns},
        "cache": {"l2_size": "4MB"},
        "cluster": {"redis": ["127.0.0.1:1"], "outbound_max": 2}})
    kv = kvcomm.open(config=cfg, wait_daemon=False)  # (the status file plays the daemon)
    try:
        if status is not None:
            stale = bool(status.pop("stale", False))
            updated = time.time() - (STATUS_FRESH_S + 1 if stale else 0)
            write_status(status_path(ns, cfg.cache.l2_dir), {**status, "updated": updated})
        kv.put("k1", 1)
        kv.put("k2", 2)
        kv.put("k2", 3)  # (a key already waiting adds nothing)
        with pytest.raises(kvcomm.Unavailable, match="cluster.outbound_max") as exc:
            kv.put("k3", 3)
        print(exc.value)
        assert says in str(exc.value) and "Nothing was written" in str(exc.value)
        assert kv.get("k2") == 3
    finally:
        kv.close()
        with contextlib.suppress(OSError):
            os.unlink(status_path(ns, cfg.cache.l2_dir))
        l2.purge(ns)


def test_outbound_max_reached_with_writes_parked_for_a_stopped_master(
        cluster: RedisCluster, seed: int) -> None:
    """Host A (``cluster.outbound_max`` BOUND) writes keys of every master while one
    master (not the one of A's own keys) is stopped. Its writes park; the other
    masters' writes cross to B meanwhile. Once BOUND writes wait, ``put`` raises
    Unavailable — for any key, a new write of a key already waiting excepted (it adds
    nothing to the count) — and saying what to do. After SIGCONT, L3 and B end on
    every acknowledged write; no refused write is anywhere."""
    rng = random.Random(seed)
    a = Host(cluster, f"pb-a-{seed % 1000}", seed, {"outbound_max": BOUND, "timeout": TIMEOUT})
    b = Host(cluster, f"pb-b-{seed % 1000}", seed + 1, {"timeout": TIMEOUT})
    try:
        da = _daemon(a)
        assert isinstance(da.l3, DaemonL3)
        store = da.l3
        own = _master_port(store, f"kvn:{{{a.config.node.host_id}}}:cursors")
        victim = rng.choice([p for p in sorted({int(n.port) for n in store.rc.get_primaries()})
                             if p != own])
        keys = [f"pb/{seed}/{i}" for i in range(400)]
        hung = [k for k in keys if _key_master(store, k) == victim]
        healthy = [k for k in keys if _key_master(store, k) != victim]
        rng.shuffle(hung)
        rng.shuffle(healthy)
        assert len(hung) > BOUND + 4 and len(healthy) > 40
        a.kv.put("pb/warm", 0)
        wait_for(lambda: b.kv.get("pb/warm") == 0, 20, "B to see A's first write")
        wait_for(lambda: da.backlog() == 0, 20, "A's backlog to drain")
        acked: dict[str, str | None] = {}  # (None: deleted)
        refused: dict[str, str] = {}
        errors: list[str] = []

        def put(key: str, value: str) -> bool:
            try:
                a.kv.put(key, value)
            except kvcomm.Unavailable as exc:
                refused[key] = value
                errors.append(str(exc))
                return False
            acked[key] = value
            return True

        cluster.pause(victim)
        try:
            # half the bound of the stopped master's keys: parked, they stay waiting
            first = hung[:BOUND // 2]
            for k in first:
                assert put(k, f"{k}=1"), errors[-1:]
            wait_for(lambda: len(da.out.parked) == len(first), 20,
                     "A to park the stopped master's writes")
            assert f"127.0.0.1:{victim}" in store.down
            # the other masters' writes, a few at a time (within the room left), cross
            # while those wait: rounds of every healthy key
            for rnd in (1, 2):
                for i in range(0, 40, 4):
                    for k in healthy[i:i + 4]:
                        assert put(k, f"{k}={rnd}"), errors[-1:]
                    wait_for(lambda: da.backlog() == len(first), 20,
                             "A to send the other masters' writes")
                wait_for(lambda rnd=rnd: all(b.kv.get(k) == f"{k}={rnd}" for k in healthy[:40]),
                         20, f"B to see round {rnd} of the other masters' keys")
            # now the stopped master's keys fill the bound: the next write is refused
            filled = 0
            for k in hung[BOUND // 2:]:
                if not put(k, f"{k}=1"):
                    break
                filled += 1
            assert refused, "no put was refused at cluster.outbound_max"
            assert len(first) + filled == BOUND, (len(first), filled)
            msg = errors[-1]
            print("refused:", msg)
            assert "cluster.outbound_max" in msg and "Nothing was written" in msg, msg
            # (the daemon's status file names the master the writes wait for)
            assert f"Redis master(s) 127.0.0.1:{victim} not answering" in msg, msg
            assert da.backlog() == BOUND
            wait_for(lambda: len(da.out.parked) == BOUND, 20, "every waiting write parked")
            # any key is refused now (the bound is the host's)...
            assert not put(healthy[40], f"{healthy[40]}=1")
            assert not put(hung[-1], f"{hung[-1]}=1")
            # ...but a key already waiting takes a newer write (it adds nothing)
            assert put(first[0], f"{first[0]}=2"), errors[-1:]
            assert a.kv.delete(first[1])  # (a delete of one too: its tombstone waits instead)
            acked[first[1]] = None
            assert da.backlog() == BOUND
            wait_for(lambda: da.stats.extra.get("unreached", 0) >= BOUND + 2
                     and len(da.out.parked) == BOUND, 20, "the newer writes parked again")
            st = da.status()
            print("A's status while parked at the bound:", st)
            assert st["partition"] is False and st["backlog"] == BOUND
            assert st["masters_down"] == [f"127.0.0.1:{victim}"] and st["parked"] > 0, st
            published = read_status(da.status_file)
            assert published is not None and published["masters_down"] == st["masters_down"]
            assert not da.reach.partition and not _daemon(b).reach.partition
            # nothing of the stopped master's keys crossed (the fault held)
            assert all(b.kv.get(k) is None for k in hung)
        finally:
            cluster.resume(victim)
        wait_for(lambda: all(b.kv.get(k) == v for k, v in acked.items()), 30,
                 "B to see every acknowledged write after SIGCONT")
        wait_for(lambda: da.backlog() == 0, 20, "A's backlog to drain after SIGCONT")
        assert da.stats.extra.get("unparked", 0) >= BOUND
        assert da.stats.extra.get("unreached", 0) >= BOUND
        wait_for(lambda: da.status()["masters_down"] == [] and da.status()["parked"] == 0, 10,
                 "A's status to show no master down")
        a.kv.put(hung[-1], "after")  # (room again)
        acked[hung[-1]] = "after"
        wait_for(lambda: b.kv.get(hung[-1]) == "after", 20, "B to see a write after the bound")
        l3 = _l3_values(cluster, sorted(set(acked) | set(refused)))
        assert {k: l3[k] for k in acked} == acked
        for k, v in refused.items():  # a refused write is nowhere
            assert l3[k] == acked.get(k), (k, v, l3[k])
            assert b.kv.get(k) == acked.get(k), k
            assert a.kv.get(k) == acked.get(k), k
        print(f"acknowledged {len(acked)} writes, refused {len(refused)}; "
              f"parked then unparked {da.stats.extra.get('unparked')}")
        assert a.alive and b.alive, (a.error, b.error)
    finally:
        a.close()
        b.close()


TTL = 1.0  # cluster.lease_ttl (its least): a host that hears no Redis this long enters partition mode


@pytest.fixture
def cut_proxies(cluster: RedisCluster, tmp_path: Path, seed: int
                ) -> Iterator[tuple[ProxyControl, dict[str, str], list[int], int]]:
    """Host A's own fault proxies: one in front of 2 of the 3 masters (the one of A's
    own keys among them: see the test), one in front of the third. Yields (the first's
    control, the remap of both, the 2 masters behind it, the third)."""
    store = L3Store(cluster.seeds)
    try:
        masters = sorted({int(n.port) for n in store.rc.get_primaries()})
        own = _master_port(store, f"kvn:{{pc-a-{seed % 1000}}}:cursors")
    finally:
        store.close()
    assert len(masters) == 3 and own in masters
    rng = random.Random(seed)
    survivor = rng.choice([p for p in masters if p != own])
    cut = [p for p in masters if p != survivor]
    pdir = tmp_path / "proxy"
    pdir.mkdir(mode=0o700)
    pids: list[int] = []
    try:
        pid1, remap1 = start_proxy([f"127.0.0.1:{p}" for p in cut], pdir / "cut.sock",
                                   pdir / "cut.json", tmp_path / "cut-proxy.log")
        pids.append(pid1)
        pid2, remap2 = start_proxy([f"127.0.0.1:{survivor}"], pdir / "live.sock",
                                   pdir / "live.json", tmp_path / "live-proxy.log")
        pids.append(pid2)
        ctl = ProxyControl(pdir / "cut.sock")
        yield ctl, {**remap1, **remap2}, cut, survivor
        ctl.set("pass")
    finally:
        stop(pids)


@pytest.mark.parametrize("how", ["proxy", "sigstop"])
def test_a_host_cut_off_from_two_of_three_masters(
        cluster: RedisCluster, seed: int, tmp_path: Path, how: str,
        cut_proxies: tuple[ProxyControl, dict[str, str], list[int], int]) -> None:
    """Host A cannot reach 2 of the 3 masters (the one of its own keys among them):
    ``proxy``, its fault proxy in front of them goes blackhole and B is untouched;
    ``sigstop``, both masters are stopped, for every host. For 2 lease TTLs and more,
    round after round: A's writes of the third master's keys reach B and B's reach A;
    A's others park (A takes both masters for down) and B's writes of those keys stay
    away from A; A's agent reads a key of the live master that only L3 holds, and one of
    a cut master fails with Unavailable (not a hang); no host enters partition mode.
    After the heal, both hosts end on L3's value for every key, and that value is the
    last acknowledged write of its key (of A or B for the keys both wrote)."""
    ctl, remap, cut, survivor = cut_proxies

    def cut_off() -> None:
        if how == "proxy":
            ctl.set("blackhole")
        else:
            for p in cut:
                cluster.pause(p)

    def heal() -> None:
        if how == "proxy":
            ctl.set("pass")
        else:
            for p in cut:
                cluster.resume(p)

    rng = random.Random(seed)
    common = {"timeout": TIMEOUT, "lease_ttl": TTL}
    a = Host(cluster, f"pc-a-{seed % 1000}", seed, {**common, "address_remap": remap})
    b = Host(cluster, f"pc-b-{seed % 1000}", seed + 1, common)
    try:
        da, db = _daemon(a), _daemon(b)
        assert isinstance(db.l3, DaemonL3) and isinstance(da.l3, DaemonL3)
        keys = [f"pc/{seed}/{i}" for i in range(150)]
        rng.shuffle(keys)
        port = {k: _key_master(db.l3, k) for k in keys}  # (B's view: the real ports)
        live = [k for k in keys if port[k] == survivor]
        dark = [k for k in keys if port[k] != survivor]
        assert len(live) >= 12 and len(dark) >= 24, (len(live), len(dark))
        # A alone writes these; B alone these; both write ``both`` (concurrently)
        a_live, b_live = live[:len(live) // 2], live[len(live) // 2:]
        third = len(dark) // 3
        a_dark, b_dark, both = dark[:third], dark[third:2 * third], dark[2 * third:]
        for k in keys:
            a.kv.put(k, "v0")
        wait_for(lambda: all(b.kv.get(k) == "v0" for k in keys), 30, "B to hold every key")
        wait_for(lambda: da.backlog() == 0, 20, "A's backlog to drain")
        last: dict[str, set[str | None]] = {}  # key -> the values it may end on
        # keys A's L2 does not hold: one of a cut master that B writes before the cut (A's
        # key filter learns it exists: a read must ask L3), one of the live master B
        # writes during the cut
        fresh = [f"pc/{seed}/fresh/{i}" for i in range(200)]
        fresh_live = next(k for k in fresh if _key_master(db.l3, k) == survivor)
        fresh_dark = next(k for k in fresh if _key_master(db.l3, k) != survivor)
        b.kv.put(fresh_dark, "before the cut")
        last[fresh_dark] = {"before the cut"}
        wait_for(lambda: da.keys.may_exist(fresh_dark.encode()), 20,
                 "A's key filter to learn of B's new key")
        cut_off()
        t_cut = time.monotonic()
        rounds = 0
        parked_max = 0
        while rounds < 3 or time.monotonic() - t_cut < 4 * TTL:
            rounds += 1
            n = rounds
            for k in a_live + a_dark:
                a.kv.put(k, f"a{n}")
                last[k] = {f"a{n}"}
            for k in b_live + b_dark:
                b.kv.put(k, f"b{n}")
                last[k] = {f"b{n}"}
            for k in both:
                a.kv.put(k, f"a{n}")
                b.kv.put(k, f"b{n}")
                last[k] = {f"a{n}", f"b{n}"}
            wait_for(lambda n=n: all(b.kv.get(k) == f"a{n}" for k in a_live), 20,
                     f"B to see A's round {n} of the reachable master's keys")
            wait_for(lambda n=n: all(a.kv.get(k) == f"b{n}" for k in b_live), 20,
                     f"A to see B's round {n} of the reachable master's keys")
            parked_max = max(parked_max, len(da.out.parked))
            assert not da.reach.partition and not db.reach.partition, da.reach.reason
        cut_for = time.monotonic() - t_cut
        down = set(da.l3.down)
        print(f"cut for {cut_for:.1f}s, {rounds} rounds; A's masters down: {sorted(down)}; "
              f"most parked {parked_max}; A's backlog {da.backlog()}; groups whose hints "
              f"were lost: A {da.stats.lost_hints}, B {db.stats.lost_hints}")
        # the fault happened: both cut masters down for A, its writes of them parked, and
        # none of it crossed either way
        cut_names = {da.l3.rc.get_node_from_key(feed_key(group_of(k))).name for k in dark}
        assert len(cut_names) == 2 and down == cut_names, (down, cut_names)
        assert parked_max > 0 and da.backlog() >= len(a_dark) + len(both)
        assert all(b.kv.get(k) == "v0" for k in a_dark)
        assert all(a.kv.get(k) == "v0" for k in b_dark)
        assert (da.reach.entered, db.reach.entered) == (0, 0)  # (never, not just not now)
        # the operator sees the partial cut: A's status names the masters (as they announce
        # themselves, not A's proxy ports) and the writes parked for them; B's names none
        st = da.status()
        assert st["masters_down"] == sorted(f"127.0.0.1:{p}" for p in cut), st
        assert st["parked"] > 0 and st["partition"] is False, st
        assert db.status()["masters_down"] == ([] if how == "proxy" else st["masters_down"])
        # A's agent: a key only L3 holds is read from the live master; one of a cut master
        # fails (Unavailable, once its master is down for the agent: at once)
        b.kv.put(fresh_live, "only-in-l3")
        last[fresh_live] = {"only-in-l3"}
        wait_for(lambda: _l3_values(cluster, [fresh_live])[fresh_live] == "only-in-l3", 20,
                 "B's write of a fresh key of the live master to reach L3")
        # (as for fresh_dark: until A's daemon has read the key's feed entry, A's filter
        # rightly answers "absent", and the read below would be None, not L3's value)
        wait_for(lambda: da.keys.may_exist(fresh_live.encode()), 20,
                 "A's key filter to learn of B's new key of the live master")
        took = []
        for _ in range(3):
            t0 = time.monotonic()
            with pytest.raises(kvcomm.Unavailable):
                a.kv.get(fresh_dark)
            took.append(time.monotonic() - t0)
        t0 = time.monotonic()
        assert a.kv.get(fresh_live) == "only-in-l3"
        print(f"A's agent: a cut master's key failed in {[round(t, 2) for t in took]}s, "
              f"a live master's key read in {time.monotonic() - t0:.3f}s")
        # (the later ones did not wait: the agent's own L3 adapter took the master for down)
        agent_store = a.kv._l3_store()
        assert da.l3.rc.get_node_from_key(feed_key(group_of(fresh_dark))).name \
            in agent_store.down, agent_store.down
        cfg = tmp_path / "a.yaml"  # (JSON is YAML)
        cfg.write_text(json.dumps(a.config.model_dump(mode="json")))
        info = subprocess.run([sys.executable, "-m", "kvcomm", "info", "--config", str(cfg)],
                              capture_output=True, text=True, timeout=60)
        print(info.stdout)
        line = next((ln for ln in info.stdout.splitlines() if ln.startswith("masters down")), "")
        assert all(f"127.0.0.1:{p}" in line for p in cut) and "parked" in line, info.stdout
        heal()
        t_heal = time.monotonic()
        wait_for(lambda: not da.l3.down, 20, "A to use both masters again")
        assert da.status()["masters_down"] == []
        wait_for(lambda: da.backlog() == 0, 30, "A's parked writes to reach L3")

        def settled() -> bool:
            l3 = _l3_values(cluster, sorted(last))
            return all(l3[k] in last[k] and a.kv.get(k) == l3[k] and b.kv.get(k) == l3[k]
                       for k in last)

        # (an agent's own L3 adapter takes a master for down too, until its PING answers)
        wait_for(settled, 30, "both hosts to end on L3's value of every key",
                 retry_on=(kvcomm.Unavailable,))
        print(f"heal -> every key settled on both hosts in {time.monotonic() - t_heal:.2f}s")
        assert da.reach.entered == 0 and db.reach.entered == 0
        assert a.alive and b.alive, (a.error, b.error)
    finally:
        heal()  # (a failed test leaves no master stopped for the next)
        a.close()
        b.close()


def test_partition_mode_is_decided_by_a_live_master_while_some_are_down(
        cluster: RedisCluster, seed: int) -> None:
    """The loop of a host cut off from some masters waits a timeout on each at its first
    call there, one after the other, hearing no answer meanwhile: with a few of them the
    lease TTL passes. Partition mode is then decided by a PING of a master not taken for
    down: one answers, so not partition mode. With every master silent, partition mode
    (after one more timeout). The daemon's loop is stopped: its clock of Redis answers
    is set back by hand, as those timeouts leave it."""
    rng = random.Random(seed)
    a = Host(cluster, f"pp-a-{seed % 1000}", seed, {"timeout": TIMEOUT, "lease_ttl": 1.0})
    paused: list[int] = []
    try:
        da = _daemon(a)
        assert isinstance(da.l3, DaemonL3)
        masters = sorted({int(n.port) for n in da.l3.rc.get_primaries()})
        victim = rng.choice(masters)
        key = next(k for k in (f"pp/{seed}/{i}" for i in range(100))
                   if _key_master(da.l3, k) == victim)
        cluster.pause(victim)
        paused.append(victim)
        a.kv.put(key, 1)
        wait_for(lambda: f"127.0.0.1:{victim}" in da.l3.down, 20, "A to take the master for down")
        a.stop(close=False)  # (the loop, not the daemon: decided by hand below)
        probes = da.stats.extra.get("live_master_probes", 0)
        with da.reach_lock:
            da.reach.redis_ok_at = da.clock() - 3 * da.reach.ttl
        da.decide_partition()
        assert not da.reach.partition and da.reach.entered == 0, da.reach.reason
        assert da.stats.extra.get("live_master_probes", 0) == probes + 1  # (asked, answered)
        for p in masters:  # now every master is silent
            if p not in paused:
                cluster.pause(p)
                paused.append(p)
        with da.reach_lock:
            da.reach.redis_ok_at = da.clock() - 3 * da.reach.ttl
        da.decide_partition()  # (its PING times out: that master is down too)
        if not da.reach.partition:  # (a third master, not yet taken for down: one more)
            da.decide_partition()
        assert da.reach.partition and da.reach.entered == 1, da.l3.down
        print("partition mode:", da.reach.reason, "; masters down:", sorted(da.l3.down))
    finally:
        for p in paused:
            cluster.resume(p)
        a.close()


def test_a_slot_map_refresh_leaves_the_hint_subscriptions_alone(cluster: RedisCluster) -> None:
    """A slot-map refresh (the pinger's, twice a second while a master is down; the one
    after a failed call) must not reset the hint subscriptions: redis-py resets the
    connections of the seed it read the map from, and each refresh broke that master's
    subscription (its groups counted lost, checked and subscribed again)."""
    store = L3Store(cluster.seeds, groups=16)
    try:
        store.hints()  # (the first call subscribes every group)
        assert store._hints is not None and len(store._hints.where) == 16
        for _ in range(4):
            store._refresh_topology(force=True)
            hinted, lost = store.hints()
            assert not lost, lost
        assert store._hints.stats["breaks"] == 0 and store._hints.stats["subscribed"] == 16
    finally:
        store.close()


def test_a_start_up_read_through_a_stale_slot_map_asks_the_successor(
        cluster: RedisCluster, caplog: pytest.LogCaptureFixture) -> None:
    """A balancer (or daemon) starting right after a failover read its slot map from a
    node whose gossip lagged: it named the dead master for ``kvm:groups``, and the start
    failed with Unavailable (CI: test_migrate_interrupted's failover test, with this branch's
    partial-cut changes). A start-up meta read refused by its master now re-reads the map
    and asks the master the map names then, once. (The stale map is made by hand: the
    slot of ``kvm:groups`` pointed at a port nothing listens on.)"""
    import socket

    from redis.cluster import PRIMARY, ClusterNode

    from kvcomm.tiers.l3 import META_GROUPS

    store = L3Store(cluster.seeds)
    try:
        store.check_groups()  # (written if new: the real count)
        with socket.socket() as s:  # a port nothing listens on: connections are refused
            s.bind(("127.0.0.1", 0))
            dead = s.getsockname()[1]
        nm = store.rc.nodes_manager
        slot = store.rc.keyslot(META_GROUPS)
        ghost = ClusterNode("127.0.0.1", dead, PRIMARY)
        nm.nodes_cache[ghost.name] = ghost
        nm.slots_cache[slot] = [ghost]
        assert store.rc.get_node_from_key(META_GROUPS).name == ghost.name  # (the stale map)
        assert store.check_groups() == len(store.groups)  # asked the successor
        # the fault happened: the stale master refused (taken for down; the pinger lets
        # it go once the map no longer names it)
        assert any(ghost.name in r.getMessage() and "did not answer" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        assert store.rc.get_node_from_key(META_GROUPS).name != ghost.name  # map read again
    finally:
        store.close()
