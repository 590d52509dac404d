"""kvcomm.aio's gathered L3 reads at their edges: a read left queued by a loop that
stopped, a read queued when the client is closed, the latency sample of a gathered read,
the counts of a key asked twice, a hung master, a pool that refuses the read.

The agent runs without a daemon (``wait_daemon=False``): no key filter, every L2 miss asks
L3. Another host's writes are pushed into L3 as its daemon would (``remote_put``)."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import kvcomm
import kvcomm.aio
from kvcomm.aio import AsyncClient
from kvcomm.devcluster.redis_cluster import RedisCluster
from kvcomm.tiers import l2
from kvcomm.tiers.l3 import L3Store
from tests.support.daemon_harness import (  # noqa: F401 (fixtures)
    host_config,
    remote_put,
    shared_cluster_fixture,
    store_fixture,
)


def _open(cluster: RedisCluster, **cache: Any) -> tuple[kvcomm.Client, str]:
    ns = f"aio-adv-{uuid.uuid4().hex[:8]}"
    return kvcomm.open(config=host_config(cluster, "h-aio", ns, **cache), wait_daemon=False), ns


@pytest.fixture
def agent(cluster: RedisCluster) -> Iterator[kvcomm.Client]:
    kv, ns = _open(cluster)
    try:
        yield kv
    finally:
        kv.close()
        l2.purge(ns)


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
