"""kvcomm.aio's reads of keys only L3 holds, awaited at once by many coroutines, on a real
Redis Cluster: gathered into one pipelined read per master and pass of the loop (at most
``_L3_READS`` keys a pass), in the pool, each read answered with its own value, absence or
error, as its sync call would; a cancelled read's answer dropped. At their edges: a read
left queued by a loop that stopped, reads queued when the client is closed, the latency
sample, the counts of a key asked twice, a hung master, a pool that refuses the read, a
local write while a read is in flight, tombstones and expired records, partition mode,
random cancellation, many thousands of reads at once.

The agent runs without a daemon (``wait_daemon=False``): no key filter, every L2 miss asks
L3. Another host's writes are pushed into L3 as its daemon would (``remote_put``)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import kvcomm
import kvcomm.aio
from kvcomm.aio import _L3_READS, AsyncClient
from kvcomm.core import codec
from kvcomm.core.expiry import with_deadline
from kvcomm.devcluster.redis_cluster import RedisCluster
from kvcomm.tiers import l2
from kvcomm.tiers.l3 import L3Record, L3Store
from kvcomm.tiers.l3.records import _wire_key
from tests.support.daemon_harness import (  # noqa: F401 (fixtures)
    host_config,
    record,
    remote_put,
    shared_cluster_fixture,
    store_fixture,
)


def _open(cluster: RedisCluster, **cache: Any) -> tuple[kvcomm.Client, str]:
    """An agent of host ``h-aio`` without a daemon (its own namespace), and the namespace."""
    ns = f"aio-l3-{uuid.uuid4().hex[:8]}"
    return kvcomm.open(config=host_config(cluster, "h-aio", ns, **cache), wait_daemon=False), ns


@pytest.fixture
def agent(cluster: RedisCluster) -> Iterator[kvcomm.Client]:
    kv, ns = _open(cluster)
    try:
        yield kv
    finally:
        kv.close()
        l2.purge(ns)


def _calls(l3: Any, into: dict[str, list[int]]) -> None:
    """Note the thread of every ``get`` and ``get_many`` of ``l3`` (and its keys' count)."""
    for name in ("get", "get_many", "get_each"):
        fn = getattr(l3, name)

        def wrapped(keys: Any, fn: Any = fn, name: str = name) -> Any:
            into.setdefault(name, []).append(threading.get_ident())
            into.setdefault(name + "_keys", []).append(1 if name == "get" else len(keys))
            return fn(keys)

        setattr(l3, name, wrapped)


def test_reads_awaited_at_once_go_to_l3_in_one_pipelined_read_each_answered_as_its_own(
        agent: kvcomm.Client, store: L3Store) -> None:
    run = uuid.uuid4().hex[:6]
    held = [f"r/{run}/{i:03d}" for i in range(300)]  # (more than one gathered read holds)
    for i, k in enumerate(held):
        remote_put(store, k, {"i": i}, "h-other", i + 1)
    corrupt = f"r/{run}/corrupt"
    assert store.push(corrupt, L3Record(1, False, codec.PACKED, b"", b"\xc1",
                                        (("h-other", 1),), ("h-other", 1))).outcome == "new"
    absent = [f"r/{run}/absent/{i}" for i in range(20)]
    b = AsyncClient(agent)
    agent._l3_store()  # (opened before the count)
    calls: dict[str, list[int]] = {}
    _calls(agent._l3_store(), calls)

    async def main() -> None:
        loop_thread = threading.get_ident()
        reads0, sent0 = agent.counters["l3_reads"], b.off_loop
        got = await asyncio.gather(
            *(b.get(k) for k in held),
            b.get_item(held[7]), b.get(held[7], "dup"),  # (a key asked three times)
            *(b.get(k, "none") for k in absent), b.get_item(absent[0]),
            b.get(corrupt), return_exceptions=True)
        n = len(held)
        assert got[:n] == [{"i": i} for i in range(n)]
        item = got[n]
        assert isinstance(item, kvcomm.Item) and item.value == {"i": 7} and item.tier == "l3"
        assert got[n + 1] == {"i": 7}
        assert got[n + 2:n + 22] == ["none"] * 20 and got[n + 22] is None
        assert isinstance(got[-1], kvcomm.CorruptRecord), got[-1]  # (its own error alone)
        # 323 reads awaited at once: sent 256 at most at a time (two passes), each pass
        # split by the master serving its keys: one pipelined read per master and pass,
        # in the pool; no round trip of its own per key
        l3 = agent._l3_store()
        masters = {l3.master_of(k) for k in [*held, *absent, corrupt]}
        assert len(masters) > 1
        assert b.off_loop - sent0 == len(calls["get_each"]) <= 2 * len(masters)
        assert "get" not in calls and "get_many" not in calls, calls
        assert loop_thread not in calls["get_each"]
        # (each key once per pass: held[7], read in the first, is read again in the
        # second with its two repeats, which fall after the first 256)
        assert sum(calls["get_each_keys"]) == n + 1 + 20 + 1
        assert max(calls["get_each_keys"]) <= _L3_READS
        assert agent.counters["l3_reads"] - reads0 == n + 1 + 20 + 1
        # L3's values are in L2 now: read on the loop, no L3 read
        calls.clear()
        assert await b.get(held[0]) == {"i": 0} and calls == {}

    asyncio.run(main())


def test_a_cancelled_read_is_dropped_and_the_others_answered(
        agent: kvcomm.Client, store: L3Store) -> None:
    run = uuid.uuid4().hex[:6]
    keys = [f"c/{run}/{i:02d}" for i in range(40)]
    for i, k in enumerate(keys):
        remote_put(store, k, i, "h-other", i + 1)
    b = AsyncClient(agent)
    unhandled: list[Any] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _l, ctx: unhandled.append(ctx))
        tasks = [asyncio.create_task(b.get(k)) for k in keys]
        await asyncio.sleep(0)  # (each read is waiting in the gathered read)
        for t in tasks[::2]:
            t.cancel()
        got = await asyncio.gather(*tasks, return_exceptions=True)
        for i, g in enumerate(got):
            if i % 2:
                assert g == i
            else:
                assert isinstance(g, asyncio.CancelledError)
        await b.close()  # (waits for the pipelined read still in the pool, if any)

    asyncio.run(main())
    assert unhandled == []


def test_a_master_taken_for_down_fails_only_its_own_keys_reads(
        agent: kvcomm.Client, store: L3Store) -> None:
    """A master taken for down (Connection.down: its calls refused at once) answers for
    its own keys alone: their reads raise Unreached, the other masters' keys are read and
    answered in the same gathered read (L3Store.get_each)."""
    run = uuid.uuid4().hex[:6]
    keys = [f"u/{run}/{i}" for i in range(30)]
    for i, k in enumerate(keys):
        remote_put(store, k, i, "h-other", i + 1)
    l3 = agent._l3_store()
    conn = l3._conn
    master = {k: conn.rc.get_node_from_key(_wire_key(conn.groups.record_key(k))).name
              for k in keys}
    down = master[keys[0]]
    assert len(set(master.values())) > 1  # (the keys span the masters)
    conn.down[down] = time.monotonic()
    b = AsyncClient(agent)

    async def main() -> list[Any]:
        return await asyncio.gather(*(b.get(k) for k in keys), return_exceptions=True)

    try:
        got = asyncio.run(main())
    finally:
        conn.down.pop(down, None)
    for i, (k, g) in enumerate(zip(keys, got, strict=True)):
        if master[k] == down:
            assert isinstance(g, kvcomm.Unavailable) and "down" in str(g), (k, g)
        else:
            assert g == i, (k, g)


def test_a_read_for_l3_inside_another_call_runs_that_call_in_the_pool(
        agent: kvcomm.Client, store: L3Store) -> None:
    """Only get and get_item are answered by the gathered read; another call that meets
    an L3 read (update reads the key first) runs again, whole, in the pool."""
    key = f"o/{uuid.uuid4().hex[:6]}"
    remote_put(store, key, 41, "h-other", 1)
    b = AsyncClient(agent)
    assert asyncio.run(b.update(key, lambda n: n + 1)) == 42
    assert b.off_loop == 1 and agent.get(key) == 42


def test_a_read_queued_by_a_loop_that_stopped_does_not_hang_the_next_loops_reads(
        agent: kvcomm.Client, store: L3Store) -> None:
    """A loop stopped (run_until_complete returned) while a get was queued for the gathered
    read, never run again and closed: the client's next gathered read, on a new loop, is
    still sent (not left waiting behind the dead loop's entry)."""
    run = uuid.uuid4().hex[:6]
    k1, k2 = f"q/{run}/1", f"q/{run}/2"
    remote_put(store, k1, 1, "h-other", 1)
    remote_put(store, k2, 2, "h-other", 1)
    b = AsyncClient(agent)

    async def fire_and_forget() -> None:
        asyncio.ensure_future(b.get(k1))  # (its first step runs in the loop's last pass)

    loop1 = asyncio.new_event_loop()
    try:
        loop1.run_until_complete(fire_and_forget())
    finally:
        loop1.close()

    async def main() -> Any:
        return await asyncio.wait_for(b.get(k2), 10.0)

    assert asyncio.run(main()) == 2  # (TimeoutError: k2's read was never sent)


def test_a_get_awaited_before_aclose_is_answered_not_run_on_the_closed_client(
        cluster: RedisCluster, store: L3Store) -> None:
    """``aclose()`` while a get waits for its gathered read (sent on the loop's next pass,
    after close was handed to the pool): close waits for the calls it started in the pool,
    so a get awaited before it is answered with its value (as when every L3 read was a
    pool call of its own), never run on the client close released (L3 closed: its
    connections reopened and leaked; L2 unmapped). The pool may run the two in either
    order; here the read's thread is made to start after close's has ended."""
    kv, ns = _open(cluster)
    key = f"cl/{uuid.uuid4().hex[:6]}"
    remote_put(store, key, 7, "h-other", 1)
    b = AsyncClient(kv)
    kv._l3_store()  # (opened: close closes it)
    closed = threading.Event()
    ran_after_close: list[bool] = []
    many, real_close = kv._get_l3_many, kv.close

    def after_close(reads: Any) -> Any:
        closed.wait(5.0)  # (close, submitted first, ends first; bounded if it waits for us)
        ran_after_close.append(kv._closed)
        return many(reads)

    def close_then_tell() -> None:
        real_close()
        closed.set()

    kv._get_l3_many = after_close  # type: ignore[method-assign]
    kv.close = close_then_tell  # type: ignore[method-assign]

    async def main() -> Any:
        t = asyncio.create_task(b.get(key))
        await asyncio.sleep(0)  # (t waits for its gathered read, sent on the next pass)
        await b.aclose()  # (handed to the pool before the gathered read is)
        return (await asyncio.gather(t, return_exceptions=True))[0]

    try:
        got = asyncio.run(main())
    finally:
        kv.close = real_close  # type: ignore[method-assign]
        real_close()
        l2.purge(ns)
    assert got == 7 and ran_after_close == [False], (got, ran_after_close)


def _counts(kv: kvcomm.Client) -> dict[str, Any]:
    st = kv.stats()
    c = kv.counters
    return {"l2_misses": kv._l2_misses, "l1_misses": st["l1"]["misses"],
            **{n: c[n] for n in ("l3_reads", "l3_hits", "l3_absent", "negative_hits",
                                 "l2_absent")}}


def test_gathered_reads_count_each_l3_hit_as_an_l3_read(
        cluster: RedisCluster, store: L3Store) -> None:
    """The same reads (values only L3 holds, absent keys, a key asked twice), made by the
    sync client one by one and by the async one awaited at once: the same answers, and
    each client's L3 counters add up: every L3 hit and absence is an L3 read counted
    (the key asked twice, read once from L3 in the gathered read, counts one read and
    must not count two hits)."""
    run = uuid.uuid4().hex[:6]
    held = [f"cn/{run}/{i}" for i in range(5)]
    for i, k in enumerate(held):
        remote_put(store, k, i, "h-other", 1)
    keys = [*held, f"cn/{run}/absent/0", f"cn/{run}/absent/1", held[0]]
    out: dict[str, Any] = {}
    for mode in ("sync", "aio"):
        kv, ns = _open(cluster)
        try:
            if mode == "sync":
                got = [kv.get(k, "d") for k in keys]
            else:
                b = AsyncClient(kv)

                async def main(b: AsyncClient = b) -> list[Any]:
                    return await asyncio.gather(*(b.get(k, "d") for k in keys))

                got = asyncio.run(main())
            out[mode] = (got, _counts(kv))
        finally:
            kv.close()
            l2.purge(ns)
    assert out["aio"][0] == out["sync"][0] == [0, 1, 2, 3, 4, "d", "d", 0]
    for mode in ("sync", "aio"):
        c = out[mode][1]
        assert c["l3_reads"] == c["l3_hits"] + c["l3_absent"], (mode, c)


def test_a_sampled_gathered_read_is_timed_as_an_l3_read(
        cluster: RedisCluster, store: L3Store) -> None:
    """metrics.latency_sample = 1: every slow get is timed, into ``("get", tier)``. The
    async client's reads of keys only L3 holds were (the whole call ran again in the pool,
    timed there); gathered, each must still be: ``("get", "l3")`` holds a sample each."""
    run = uuid.uuid4().hex[:6]
    keys = [f"lat/{run}/{i}" for i in range(4)]
    for i, k in enumerate(keys):
        remote_put(store, k, i, "h-other", 1)
    ns = f"aio-adv-{uuid.uuid4().hex[:8]}"
    cfg = kvcomm.Config.from_mapping({
        "node": {"host_id": "h-aio", "namespace": ns},
        "cache": {"l2_size": "16MB", "negative_ttl": 0},
        "cluster": {"redis": [f"127.0.0.1:{p}" for p in cluster.ports], "wait_replicas": 0},
        "metrics": {"latency_sample": 1}})
    kv = kvcomm.open(config=cfg, wait_daemon=False)
    try:
        b = AsyncClient(kv)

        async def main() -> list[Any]:
            return await asyncio.gather(*(b.get(k) for k in keys))

        assert asyncio.run(main()) == [0, 1, 2, 3]
        h = kv._lat.get(("get", "l3"))
        assert h is not None and h.counts[-1] == len(keys), sorted(kv._lat)  # (the count)
    finally:
        kv.close()
        l2.purge(ns)


def _master_port(l3: Any, key: str) -> int:
    conn = l3._conn
    node = conn.rc.get_node_from_key(conn.groups.record_key(key).encode())
    return int(node.port)


def test_a_hung_master_does_not_hold_back_reads_of_keys_on_the_others(
        cluster: RedisCluster, store: L3Store) -> None:
    """One master stops answering (CLIENT PAUSE) while reads of keys on two masters are
    awaited at once: the read of a key whose master answers is answered before the read
    of the hung master's key fails (its cluster.timeout) — as when each L3 read was a pool
    call of its own — not held back until the pipeline to the hung master times out."""
    import redis

    ns = f"aio-adv-{uuid.uuid4().hex[:8]}"
    kv = kvcomm.open(config=host_config(cluster, "h-aio", ns, cluster_keys={"timeout": "0.5s"}),
                     wait_daemon=False)
    try:
        l3 = kv._l3_store()
        run = uuid.uuid4().hex[:6]
        keys = [f"hm/{run}/{i}" for i in range(40)]
        for k in keys:
            remote_put(store, k, k, "h-other", 1)
        ports = {k: _master_port(l3, k) for k in keys}
        hung_port = ports[keys[0]]
        healthy = next(k for k in keys if ports[k] != hung_port)
        b = AsyncClient(kv)

        async def main() -> tuple[bool, Any, Any]:
            with redis.Redis(port=hung_port, socket_timeout=5) as r:
                r.execute_command("CLIENT", "PAUSE", "3000", "ALL")
            try:
                t_hung = asyncio.create_task(b.get(keys[0]))
                t_ok = asyncio.create_task(b.get(healthy))
                await asyncio.wait_for(asyncio.wait([t_ok]), 30)
                hung_pending = not t_hung.done()
                got = await asyncio.gather(t_ok, t_hung, return_exceptions=True)
            finally:
                with redis.Redis(port=hung_port, socket_timeout=5) as r:
                    r.execute_command("CLIENT", "UNPAUSE")
            return hung_pending, got[0], got[1]

        hung_pending, ok, hung = asyncio.run(main())
        assert ok == healthy, ok
        assert isinstance(hung, kvcomm.Unavailable), hung
        assert hung_pending, "the healthy key's read waited for the hung master's timeout"
    finally:
        kv.close()
        l2.purge(ns)



def test_a_gathered_read_the_pool_refuses_fails_its_get_not_hangs_it(
        agent: kvcomm.Client, store: L3Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool refuses new calls (it is shut down: at interpreter exit, concurrent.futures
    refuses every submit): a get whose L3 read cannot be sent raises, as a call sent to
    the pool on its own did (its submit raised into the caller), instead of waiting
    forever for an answer no one will give."""
    from concurrent.futures import ThreadPoolExecutor

    key = f"pr/{uuid.uuid4().hex[:6]}"
    remote_put(store, key, 1, "h-other", 1)
    b = AsyncClient(agent)
    refused = ThreadPoolExecutor(1)
    refused.shutdown()
    monkeypatch.setattr(kvcomm.aio, "_executor", lambda: refused)

    async def main() -> Any:
        return (await asyncio.gather(asyncio.wait_for(b.get(key), 5.0),
                                     return_exceptions=True))[0]

    got = asyncio.run(main())
    assert isinstance(got, RuntimeError) and "shutdown" in str(got), repr(got)


@pytest.mark.parametrize("when", ["before the L3 read", "between the L3 read and the fill"])
def test_a_local_write_while_a_gathered_read_is_in_flight_is_kept(
        agent: kvcomm.Client, store: L3Store, when: str) -> None:
    key = f"lw/{uuid.uuid4().hex[:6]}"
    remote_put(store, key, "old", "h-other", 1)
    b = AsyncClient(agent)
    l3 = agent._l3_store()
    get_each = l3.get_each

    def put_then_read(keys: Any) -> Any:  # (in the pool's thread)
        if when == "before the L3 read":
            agent.put(key, "local")
        got = get_each(keys)
        if when != "before the L3 read":
            agent.put(key, "local")
        return got

    l3.get_each = put_then_read

    async def main() -> Any:
        return await b.get_item(key)

    try:
        item = asyncio.run(main())
    finally:
        l3.get_each = get_each
    assert item is not None and item.value in ("old", "local")
    for _ in range(2):  # (L2, then L1)
        now = agent.get_item(key)
        assert now is not None and now.value == "local", now
        assert now.version >= item.version


def test_l3_tombstones_and_expired_records_read_as_absent(
        agent: kvcomm.Client, store: L3Store) -> None:
    run = uuid.uuid4().hex[:6]
    dead, gone, live = f"t/{run}/dead", f"t/{run}/expired", f"t/{run}/live"
    remote_put(store, live, "v", "h-other", 1)
    assert store.push(dead, record("x", "h-other", 1, 1)).outcome == "new"
    assert store.push(dead, L3Record(3, True, codec.PACKED, b"", b"", (("h-other", 3),),
                                     ("h-other", 3))).outcome == "newer"
    rec = record("y", "h-other", 1, 1)
    past = with_deadline(b"", time.time() - 5)  # (an expiry field 5 s in the past)
    assert store.push(gone, L3Record(1, False, rec.tag, rec.meta, rec.value, rec.vector,
                                     rec.dot, past)).outcome == "new"
    b = AsyncClient(agent)
    before = dict(agent.counters)

    async def main() -> list[Any]:
        return await asyncio.gather(b.get(dead, "d"), b.get_item(dead), b.get(gone, "d"),
                                    b.get_item(gone), b.get(live, "d"))

    assert asyncio.run(main()) == ["d", None, "d", None, "v"]
    # (each key read once in the gathered read: one absence each, as one L3 read each)
    assert agent.counters["l3_absent"] - before["l3_absent"] == 2
    assert agent.get(dead, "d") == "d" and agent.get(gone, "d") == "d"


def test_partition_mode_fails_each_gathered_read_with_unavailable(
        agent: kvcomm.Client, store: L3Store) -> None:
    run = uuid.uuid4().hex[:6]
    keys = [f"p/{run}/{i}" for i in range(5)]
    for k in keys:
        remote_put(store, k, 1, "h-other", 1)
    b = AsyncClient(agent)
    agent._l3_store()

    class Cut:
        def status(self) -> dict[str, Any]:
            return {"partition": True, "redis_unreachable": True, "host": "h-aio"}

    real = agent._host_status
    agent._host_status = Cut  # type: ignore[method-assign,assignment]

    async def main() -> list[Any]:
        return await asyncio.gather(*(b.get(k) for k in keys), return_exceptions=True)

    try:
        got = asyncio.run(main())
    finally:
        agent._host_status = real  # type: ignore[method-assign]
    assert all(isinstance(g, kvcomm.Unavailable) and "partition" in str(g) for g in got), got
    with pytest.raises(kvcomm.Unavailable, match="partition"):
        agent._host_status = Cut  # type: ignore[method-assign,assignment]
        try:
            agent.get(keys[0])
        finally:
            agent._host_status = real  # type: ignore[method-assign]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_reads_cancelled_at_random_points_leave_the_others_answered(
        agent: kvcomm.Client, store: L3Store, seed: int) -> None:
    rng = random.Random(seed)
    print("seed", seed)
    run = uuid.uuid4().hex[:6]
    keys = [f"rc/{run}/{i}" for i in range(600)]
    for i, k in enumerate(keys[::3]):
        remote_put(store, k, i, "h-other", 1)
    want = {k: (i // 3 if i % 3 == 0 else "absent") for i, k in enumerate(keys)}
    b = AsyncClient(agent)
    unhandled: list[Any] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _l, ctx: unhandled.append(ctx))
        tasks = []
        for k in keys:
            tasks.append(asyncio.create_task(b.get(k, "absent")))
            if rng.random() < 0.05:
                await asyncio.sleep(0)
            if rng.random() < 0.1:
                rng.choice(tasks).cancel()
        for _ in range(rng.randrange(4)):
            await asyncio.sleep(0)
        for t in rng.sample(tasks, 50):
            t.cancel()
        got = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
        for k, t, g in zip(keys, tasks, got, strict=True):
            if not t.cancelled():
                assert g == want[k], (k, g)
        await b.close()

    asyncio.run(main())
    assert unhandled == []


def test_twenty_thousand_reads_awaited_at_once_are_all_answered(
        agent: kvcomm.Client, store: L3Store) -> None:
    run = uuid.uuid4().hex[:6]
    held = [f"m/{run}/{i}" for i in range(200)]
    for i, k in enumerate(held):
        remote_put(store, k, i, "h-other", 1)
    keys = [held[i % 200] if i % 2 else f"m/{run}/absent/{i}" for i in range(20_000)]
    b = AsyncClient(agent)

    async def main() -> list[Any]:
        return await asyncio.wait_for(
            asyncio.gather(*(b.get_item(k) for k in keys)), 120)

    got = asyncio.run(main())
    for i, g in enumerate(got):
        if i % 2:
            assert g is not None and g.value == (i % 200), (i, g)
        else:
            assert g is None
    assert b._l3_waiting == []


def test_a_read_in_the_pool_when_its_loop_closes_ends_quietly(
        agent: kvcomm.Client, store: L3Store, caplog: pytest.LogCaptureFixture) -> None:
    """``asyncio.run(main())`` where main returns while another task's get is in the pool
    (its gathered read): asyncio.run cancels that task and closes the loop; the read ends
    later in its thread. Nothing may be logged as an error then (a pool call of its own
    was waited for by the cancelled task before the loop closed)."""
    key = f"lc/{uuid.uuid4().hex[:6]}"
    remote_put(store, key, 1, "h-other", 1)
    b = AsyncClient(agent)
    l3 = agent._l3_store()
    get_each = l3.get_each
    started, release = threading.Event(), threading.Event()

    def slow(keys: Any) -> Any:
        started.set()
        release.wait(10.0)
        return get_each(keys)

    l3.get_each = slow

    async def main() -> None:
        asyncio.create_task(b.get(key))  # (never awaited: cancelled by asyncio.run)
        while not started.is_set():  # (its gathered read is in the pool)
            await asyncio.sleep(0.001)

    try:
        asyncio.run(main())
        release.set()
        pending = list(b._inflight)
        for f in pending:
            f.result(10.0)
        deadline = time.monotonic() + 5.0  # (the pool's done callbacks have run)
        while b._inflight and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        release.set()
        l3.get_each = get_each
    errors = [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    assert errors == [], [r.getMessage() for r in errors]


def test_one_client_gathers_reads_on_consecutive_loops(
        agent: kvcomm.Client, store: L3Store) -> None:
    """The same async client used by two asyncio.run calls in turn (a new loop each): each
    loop's gathered reads are sent on that loop and answered."""
    run = uuid.uuid4().hex[:6]
    keys = [f"cl2/{run}/{i}" for i in range(10)]
    for i, k in enumerate(keys):
        remote_put(store, k, i, "h-other", 1)
    b = AsyncClient(agent)

    async def main(part: list[str]) -> list[Any]:
        return await asyncio.wait_for(asyncio.gather(*(b.get(k) for k in part)), 30)

    assert asyncio.run(main(keys[:5])) == [0, 1, 2, 3, 4]
    assert asyncio.run(main(keys[5:])) == [5, 6, 7, 8, 9]
    assert b._l3_waiting == []


def test_a_gathered_absence_is_noted_and_answers_the_next_read_on_the_loop(
        cluster: RedisCluster, store: L3Store) -> None:
    """cache.negative_ttl 30 s: an absent key read three times in one gathered read is
    asked of L3 once and noted absent; the next read is answered by the note, on the loop
    (no pool call, no L3 read); a held key in the same read is filled into L2."""
    ns = f"aio-advs-{uuid.uuid4().hex[:8]}"
    kv = kvcomm.open(config=host_config(cluster, "h-aio", ns, negative_ttl="30s"),
                     wait_daemon=False)
    run = uuid.uuid4().hex[:6]
    absent, held = f"n/{run}/absent", f"n/{run}/held"
    remote_put(store, held, "h", "h-other", 1)
    try:
        b = AsyncClient(kv)

        async def main() -> None:
            reads0 = kv.counters["l3_reads"]
            got = await asyncio.gather(b.get(absent, "d"), b.get_item(absent),
                                       b.get(absent, "e"), b.get(held))
            assert got == ["d", None, "e", "h"]
            assert kv.counters["l3_reads"] - reads0 == 2
            sent, hits = b.off_loop, kv.counters["negative_hits"]
            assert await b.get(absent, "f") == "f" and await b.get_item(absent) is None
            assert await b.get(held) == "h"
            assert b.off_loop == sent and kv.counters["l3_reads"] - reads0 == 2
            assert kv.counters["negative_hits"] - hits == 2

        asyncio.run(main())
    finally:
        kv.close()
        l2.purge(ns)
