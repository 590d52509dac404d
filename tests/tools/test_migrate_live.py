"""Live slot migration (balance/migrate.py) on a real Redis Cluster: slots move back and
forth between masters while three hosts' daemons push a swarm's writes through them, and
nothing acknowledged is lost; a batch that fails mid-move is sent again and the keys
left on both sides are settled from the source.

A failure prints its seed; ``MIGRATE_SEED=<seed>`` replays the workload's choices.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvcomm.balance import migrate
from kvcomm.balance.migrate import NodeInfo, SlotMover, parse_nodes
from kvcomm.devcluster.redis_cluster import RedisCluster
from kvcomm.errors import Unavailable
from kvcomm.tiers.l3 import L3Store
from tests.sim.test_delivery_sim import Clock
from tests.support.daemon_harness import Host, cluster_fixture, record  # noqa: F401 (the fixture)
from tests.support.helpers import wait_for


def keys_in_group(store: L3Store, group: int, n: int, prefix: str) -> list[str]:
    out: list[str] = []
    i = 0
    while len(out) < n:
        k = f"{prefix}/{i}/state"
        if store.groups.of(k) == group:
            out.append(k)
        i += 1
    return out


@pytest.fixture(name="store")
def store_fixture(cluster: RedisCluster) -> Iterator[L3Store]:
    s = L3Store(cluster.seeds, wait_replicas=1)
    yield s
    s.close()


def test_slots_move_back_and_forth_under_a_swarm_and_nothing_is_lost(
        cluster: RedisCluster, store: L3Store) -> None:
    seed = int(os.environ.get("MIGRATE_SEED", random.randrange(2**32)))
    print(f"seed={seed}")
    rng = random.Random(seed)
    hosts = [Host(cluster, f"mh-{i}", seed=seed + i, cluster_keys={"wait_replicas": 1, "wait_timeout": 2.0})
             for i in range(3)]
    try:
        # 4 groups the mover moves, 30 keys each, and 60 keys elsewhere; each key has
        # one writer (a host's thread), so its last acknowledged write is its final value
        moved_groups = rng.sample(range(len(store.groups)), 4)
        keys = [k for g in moved_groups for k in keys_in_group(store, g, 30, f"mv{g}")]
        keys += [f"other/{i}/state" for i in range(60)]
        rng.shuffle(keys)
        owner = {k: i % 6 for i, k in enumerate(keys)}  # 6 writers: 2 threads per host
        last: dict[str, int] = {}
        stop = threading.Event()
        failures: list[BaseException] = []
        puts = [0] * 6
        during = {"first": 0.0, "last": 0.0, "puts": 0}

        def writer(w: int) -> None:
            kv = hosts[w // 2].kv
            mine = [k for k in keys if owner[k] == w]
            r = random.Random(seed * 7 + w)
            n = 0
            try:
                while not stop.is_set():
                    k = r.choice(mine)
                    n += 1
                    kv.put(k, {"w": w, "n": n})
                    last[k] = n  # acknowledged: it is in the host's L2
                    puts[w] += 1
                    if during["first"] and not during["last"]:
                        during["puts"] += 1
                    for other in r.sample(keys, 4):  # neighbours' states (fills L2 from L3)
                        kv.get(other)
                    time.sleep(r.uniform(0.001, 0.004))
            except BaseException as exc:  # an agent's operation failed: the test fails
                failures.append(exc)

        threads = [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(6)]
        for t in threads:
            t.start()
        wait_for(lambda: sum(puts) > 300, 60, "the swarm to write")
        mover = SlotMover(store, batch=8)  # small batches: many MIGRATEs, writes between
        masters = sorted(n.name for n in mover.masters())
        slots = [store.groups.slot(g) for g in moved_groups]
        results = []
        during["first"] = time.monotonic()
        for rnd in range(3):
            for slot in slots:
                src = mover.owner(slot).name
                target = masters[(masters.index(src) + 1 + rnd % 2) % len(masters)]
                before = _count_on(mover, target, slot)
                res = mover.move(slot, target)
                results.append(res)
                # the move really happened: the owner changed and the target holds the keys
                assert mover.owner(slot).name == target and res.source == src
                assert res.keys >= 1 and _count_on(mover, target, slot) >= before + res.keys
                assert _count_on(mover, src, slot) == 0
        during["last"] = time.monotonic()
        time.sleep(0.2)  # (let the writers go on a moment past the last move)
        stop.set()
        for t in threads:
            t.join(30)
        assert not failures, failures  # no agent operation failed

        # every host converges on L3, and L3 holds every key's last acknowledged write
        def converged() -> bool:
            for k in keys:
                rec = store.get(k)
                if rec is None or rec.decode_value(k)["n"] != last[k]:
                    return False
                for h in hosts:
                    if h.kv.get(k) != {"w": owner[k], "n": last[k]}:
                        return False
            return True

        def differences() -> str:  # (what the timeout reports: where it stopped)
            out = []
            for k in keys:
                rec = store.get(k)
                got = None if rec is None else rec.decode_value(k)
                if got != {"w": owner[k], "n": last[k]}:
                    out.append(f"L3 {k!r}: {got}")
                out += [f"{h.daemon.host if h.daemon else '?'} {k!r}: {h.kv.get(k)}"
                        for h in hosts if h.kv.get(k) != {"w": owner[k], "n": last[k]}]
            return (f"every host and L3 to hold every key's last write; {len(out)} "
                    f"differ, first: {out[:6]}")

        wait_for(converged, 90, differences)
        lost = [k for k in keys if store.get(k).decode_value(k)["n"] != last[k]]  # type: ignore[union-attr]
        redirects = {r: sum(h.daemon.l3.redirects[r] for h in hosts)  # type: ignore[union-attr]
                     for r in ("moved", "ask", "tryagain")}
        hint_moves = sum(h.daemon.l3.hint_stats.get("moved", 0) for h in hosts)  # type: ignore[union-attr]
        print(f"moves {len(results)}, keys moved {sum(r.keys for r in results)}, bytes "
              f"{sum(r.bytes for r in results)}, puts {sum(puts)} ({during['puts']} during the "
              f"moves), redirects retried {redirects}, hint channels moved {hint_moves}, "
              f"lost {len(lost)}")
        assert not lost
        assert sum(redirects.values()) > 0  # writes did run into the moves, and were retried
        assert hint_moves > 0  # subscriptions followed the slots
        for h in hosts:
            st = h.stats
            assert h.alive and st.step_errors == 0 and st.quarantined == 0, st
            assert st.l3_errors == 0, st  # no round failed: every redirect was retried
            # (not_durable: a push whose WAIT timed out (cluster.wait_timeout, 100 ms) is
            # sent again next window; on a loaded machine a replica can lag that long, so
            # it is reported, not asserted: it never proved that retried pushes WAIT, only
            # that no WAIT timed out, and nothing was lost either way (checked above))
            print(f"{h.daemon.host}: not durable at first {st.extra.get('not_durable', 0)}")
    finally:
        for h in hosts:
            h.close()


def _count_on(mover: SlotMover, name: str, slot: int) -> int:
    return int(mover._conn(name).execute_command("CLUSTER COUNTKEYSINSLOT", slot))


def test_a_failed_batch_is_sent_again_and_keys_on_both_sides_keep_the_source_s(
        cluster: RedisCluster, store: L3Store) -> None:
    g = 17
    keys = keys_in_group(store, g, 12, "both")
    for i, k in enumerate(keys):
        store.push(k, record(f"v{i}", "h", 1, 1))
    slot = store.groups.slot(g)
    port_of = {f"127.0.0.1:{p}": p for p in cluster.ports}
    events: list[str] = []

    def fault(slot_: int, batch: list[bytes]) -> None:
        if not events:  # 1st batch: a copy of it on the target, then a newer write on the
            events.append("copied")  # source (as a MIGRATE that timed out half-way leaves)
            host, _, port = target.rpartition(":")
            mover._conn(src).execute_command("MIGRATE", host, int(port), "", 0, 5000, "COPY",
                                             "REPLACE", "KEYS", *batch)
            key = batch[0].decode().split("}:", 1)[1]
            store.push(key, record("newer", "h", 2, 2))  # the source still has it: runs there
            events.append(key)
        elif len(events) == 2:  # 2nd batch: the target stops answering (an IOERR)
            events.append("paused")
            cluster.pause(port_of[target])
            threading.Timer(0.6, cluster.resume, args=(port_of[target],)).start()

    mover = SlotMover(store, batch=4, timeout_ms=150, before_batch=fault)
    src = mover.owner(slot).name
    target = next(n.name for n in mover.masters() if n.name != src)
    res = mover.move(slot, target)
    print(res, events)
    assert events[0] == "copied" and events[2] == "paused"
    assert res.retries >= 1  # the paused target's batch failed and was sent again
    assert mover.owner(slot).name == target and _count_on(mover, src, slot) == 0
    for i, k in enumerate(keys):
        want = "newer" if k == events[1] else f"v{i}"
        assert store.get(k).decode_value(k) == want, k  # type: ignore[union-attr]


def test_a_sweep_on_a_stale_slot_map_reads_a_moved_group_again_where_it_now_lives(
        cluster: RedisCluster, store: L3Store) -> None:
    """The sweep's script runs on the master the client's slot map names; for a group
    whose slot moved since, that master answers an error for it (``E`` in the script's
    answer), and the counter is read again through the cluster client (MOVED followed):
    the sweep still gives the group's counter, and the other groups of the call theirs."""
    g = 41
    keys = keys_in_group(store, g, 3, "stale")
    before = store.feed_heads([g])[g][0] or 0  # (the module's other tests, in any order, may
    for i, k in enumerate(keys):                # have written to this group too)
        store.push(k, record(f"v{i}", "h", 1, 1 + i))
    stale = L3Store(cluster.seeds)  # (its slot map read now, before the move)
    try:
        neighbours = [x for x in range(len(store.groups))
                      if x != g and store._by_node([x]).keys() == store._by_node([g]).keys()][:5]
        want = store.feed_heads([g, *neighbours])
        assert want[g][0] == before + 3
        mover = SlotMover(store)
        slot = store.groups.slot(g)
        src = mover.owner(slot).name
        target = next(n.name for n in mover.masters() if n.name != src)
        mover.move(slot, target)
        assert stale._by_node([g]).keys() == {src}  # (stale: the script goes to src)
        got = stale.feed_heads([g, *neighbours])
        assert got[g][0] == want[g][0]
        assert got[g][1] is None  # (read again alone: no tail)
        assert {x: got[x] for x in neighbours} == {x: want[x] for x in neighbours}
        mover.move(slot, src)  # (back: the module's other tests expect nothing moved)
    finally:
        stale.close()


def test_parse_nodes_reads_slot_ranges_and_open_migrations() -> None:
    text = ("a1 127.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5 7 [8->-b2]\n"
            "b2 127.0.0.1:7001@17001 master - 0 0 2 connected 9 [8-<-a1]\n"
            "c3 127.0.0.1:7002@17002 slave a1 0 0 1 connected\n"
            "d4 127.0.0.1:7003@17003 master,fail - 0 0 3 disconnected 10-12\n")
    nodes: Any = {n.id: n for n in parse_nodes(text)}
    assert set(nodes) == {"a1", "b2", "c3"}
    assert nodes["a1"].slots == frozenset({0, 1, 2, 3, 4, 5, 7}) and nodes["a1"].migrating == {8: "b2"}
    assert nodes["b2"].importing == {8: "a1"} and nodes["b2"].name == "127.0.0.1:7001"
    assert not nodes["c3"].master

def _owner() -> NodeInfo:
    return NodeInfo("b" * 40, "127.0.0.1:7002", True, frozenset({21}), {}, {})


@pytest.mark.parametrize("answers_after", [1, 5])
def test_an_importer_that_has_not_heard_of_the_promotion_is_told_again(
        monkeypatch: pytest.MonkeyPatch, answers_after: int) -> None:
    """The failover test of test_migrate_interrupted failed in the suite: right after the source failed
    over, the importer did not yet know the promoted replica for a master (gossip) and
    answered "Target node is not a master"; the settle gave up until the balancer's next
    cycle, its keys out of sight meanwhile. The settle now waits for the importer to
    hear of it (bounded) and tells it again.
    (found in review 23: faults the whole suite's order found)"""
    clock = Clock()
    start = clock.t
    mover = SlotMover.__new__(SlotMover)
    mover.clock, mover.sleep = clock, clock.sleep
    calls: list[tuple[Any, ...]] = []

    def cmd(name: str, *args: Any) -> Any:
        calls.append((name, *args))
        if len(calls) <= answers_after:
            raise Unavailable("Redis Cluster refused: ERR Target node is not a master")
        return b"OK"

    monkeypatch.setattr(mover, "_cmd", cmd)
    mover._tell_owner("127.0.0.1:7001", 21, _owner())
    assert len(calls) == answers_after + 1  # the fault happened, then it was told again
    assert calls[-1] == ("127.0.0.1:7001", "CLUSTER SETSLOT", 21, "NODE", "b" * 40)
    assert 0 < clock.t - start <= migrate.PROMOTION_WAIT_S


def test_telling_the_importer_gives_up_after_the_wait_and_on_other_errors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounded: an importer that never hears raises Unavailable after PROMOTION_WAIT_S
    (the next cycle tries again); any other refusal raises at once.
    (found in review 23: faults the whole suite's order found)"""
    clock = Clock()
    start = clock.t
    mover = SlotMover.__new__(SlotMover)
    mover.clock, mover.sleep = clock, clock.sleep
    monkeypatch.setattr(mover, "_cmd", lambda *a: (_ for _ in ()).throw(
        Unavailable("Redis Cluster refused: ERR Target node is not a master")))
    with pytest.raises(Unavailable, match="not a master"):
        mover._tell_owner("127.0.0.1:7001", 21, _owner())
    assert migrate.PROMOTION_WAIT_S <= clock.t - start <= migrate.PROMOTION_WAIT_S + 0.2
    start = clock.t
    monkeypatch.setattr(mover, "_cmd", lambda *a: (_ for _ in ()).throw(
        Unavailable("Redis Cluster unreachable: refused")))
    with pytest.raises(Unavailable, match="unreachable"):
        mover._tell_owner("127.0.0.1:7001", 21, _owner())
    assert clock.t == start


def test_telling_the_importer_again_logs_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """(Review.) Told again every 0.1 s for up to 10 s: one log line, not a hundred.
    (found in review 23: faults the whole suite's order found)"""
    clock = Clock()
    mover = SlotMover.__new__(SlotMover)
    mover.clock, mover.sleep = clock, clock.sleep
    calls: list[int] = []

    def cmd(*args: Any) -> Any:
        calls.append(1)
        if len(calls) < 50:
            raise Unavailable("Redis Cluster refused: ERR Target node is not a master")
        return b"OK"

    monkeypatch.setattr(mover, "_cmd", cmd)
    with caplog.at_level("INFO", logger="kvcomm.balance"):
        mover._tell_owner("127.0.0.1:7001", 21, _owner())
    assert len(calls) == 50  # (told 49 times in vain)
    said = [r for r in caplog.records if "does not know" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
