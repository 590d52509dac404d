"""kvcomm.aio's reads of keys only L3 holds, awaited at once by many coroutines, on a real
Redis Cluster: gathered into one pipelined read per pass of the loop (at most
``_L3_READS`` keys each), in the pool, each read answered with its own value, absence or
error, as its sync call would; a cancelled read's answer dropped.

The agent runs without a daemon (``wait_daemon=False``): no key filter, every L2 miss asks
L3. Another host's writes are pushed into L3 as its daemon would (``remote_put``)."""

from __future__ import annotations

import asyncio
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
from kvcomm.devcluster.redis_cluster import RedisCluster
from kvcomm.tiers import l2
from kvcomm.tiers.l3 import L3Record, L3Store
from kvcomm.tiers.l3.records import _wire_key
from tests.support.daemon_harness import (  # noqa: F401 (fixtures)
    host_config,
    remote_put,
    shared_cluster_fixture,
    store_fixture,
)


@pytest.fixture
def agent(cluster: RedisCluster) -> Iterator[kvcomm.Client]:
    ns = f"aio-l3-{uuid.uuid4().hex[:8]}"
    kv = kvcomm.open(config=host_config(cluster, "h-aio", ns), wait_daemon=False)
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
