"""kvcomm.aio on a real dev cluster (2 hosts, Redis Cluster, etcd): L3 reads (gathered)
and strong keys go to the network off the event loop (never on its thread), a cluster scan and a
cluster watch work through the async face."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from kvcomm.aio import AsyncClient
from tests.integrations.test_aio import Ticker
from tests.support.devcluster import all_live_in_l3, dev_cluster_fixture, host, l3
from tests.support.helpers import wait_for

dev = dev_cluster_fixture(2, strong_prefixes=["lock/"], groups=64)


def record_threads(obj: Any, name: str, into: list[int]) -> None:
    """Wrap ``obj.name`` so that every call notes the thread it ran on."""
    fn: Callable[..., Any] = getattr(obj, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        into.append(threading.get_ident())
        return fn(*args, **kwargs)

    setattr(obj, name, wrapped)


def test_l3_reads_and_strong_keys_never_run_on_the_loop(dev: dict[str, Any]) -> None:
    a, store = host(dev, 0), l3(dev)
    keys = [f"aio/{i:03d}" for i in range(100)]
    try:
        for i, k in enumerate(keys):
            a.put(k, {"i": i})
        wait_for(lambda: all_live_in_l3(store, keys), 30, "host 0's writes to reach L3")
        sync_b = host(dev, 1)
        # (until host 1's daemon has learned them, its key filter rightly says "absent")
        wait_for(lambda: (kf := sync_b._key_filter()) is not None
                 and all(kf.may_exist(k.encode()) for k in keys), 30,
                 "host 1's key filter to learn host 0's keys")
        b = AsyncClient(sync_b)
        l3_threads: list[int] = []
        etcd_threads: list[int] = []
        record_threads(sync_b._l3_store(), "get", l3_threads)
        record_threads(sync_b._l3_store(), "get_each", l3_threads)
        record_threads(sync_b._strong, "get_item", etcd_threads)
        record_threads(sync_b._strong, "put", etcd_threads)

        async def main() -> None:
            loop_thread = threading.get_ident()
            reads0 = sync_b.counters["l3_reads"]
            misses0 = sync_b.stats()["l2"]["misses"]
            with Ticker() as ticker:
                got = await asyncio.gather(*(b.get(k) for k in keys))
                assert got == [{"i": i} for i in range(100)]
                assert sync_b.counters["l3_reads"] - reads0 == 100  # (host 1 held none)
                # counted once each, though each read stopped on the loop and ran again
                assert sync_b.stats()["l2"]["misses"] - misses0 == 100
                # (the 100 reads awaited at once: one pipelined read per master, in the pool)
                assert 1 <= len(l3_threads) <= 3 and loop_thread not in l3_threads
                # strong keys: every operation asks etcd, off the loop
                v = await b.put("lock/aio", {"owner": "b"})
                item = await b.get_item("lock/aio")
                assert item is not None and item.version == v and item.tier == "etcd"
                assert await b.update("lock/n", lambda n: n + 1, default=0) == 1
                assert len(etcd_threads) >= 4 and loop_thread not in etcd_threads
                # the now-local copies of L3's keys are read on the loop (L2 hits)
                l3_threads.clear()
                assert await b.get(keys[0]) == {"i": 0} and l3_threads == []
            print(f"worst lag {ticker.worst * 1000:.1f} ms over {ticker.ticks} ticks")
            assert ticker.ticks > 0
            # a cluster scan (L3's key index, in the pool) sees every key of the cluster
            assert [i.key async for i in b.scan("aio/")] == keys
            assert [i.key async for i in b.scan("aio/", limit=10, after=keys[9])] == keys[10:20]
            # a cluster watch on host 1 sees host 0's put
            w = b.watch("aiow/", timeout=30)
            first = asyncio.ensure_future(w.__anext__())
            n = 0
            while not first.done():  # (until the daemon took the prefix: host 0 writes on)
                n += 1
                await asyncio.to_thread(a.put, "aiow/1", n)
                await asyncio.wait([first], timeout=0.2)
            ev = first.result()
            assert (ev.key, ev.kind) == ("aiow/1", "put")
            await w.aclose()  # type: ignore[attr-defined]
            await b.aclose()

        asyncio.run(main())
    finally:
        a.close()
        store.close()
