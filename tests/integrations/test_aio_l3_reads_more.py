"""kvcomm.aio's gathered L3 reads against the sync client's semantics: a local write
while a gathered read is in flight is kept (the L2 fill is a merge),
L3 tombstones and expired records read as absent, partition mode fails each read with
Unavailable, reads cancelled at random points leave the others answered and nothing
unretrieved, many thousands of reads awaited at once are all answered.

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
from kvcomm.aio import AsyncClient
from kvcomm.core import codec
from kvcomm.core.expiry import with_deadline
from kvcomm.devcluster.redis_cluster import RedisCluster
from kvcomm.tiers import l2
from kvcomm.tiers.l3 import L3Record, L3Store
from tests.support.daemon_harness import (  # noqa: F401 (fixtures)
    host_config,
    record,
    remote_put,
    shared_cluster_fixture,
    store_fixture,
)


@pytest.fixture
def agent(cluster: RedisCluster) -> Iterator[kvcomm.Client]:
    ns = f"aio-advs-{uuid.uuid4().hex[:8]}"
    kv = kvcomm.open(config=host_config(cluster, "h-aio", ns), wait_daemon=False)
    try:
        yield kv
    finally:
        kv.close()
        l2.purge(ns)


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
