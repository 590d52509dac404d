"""watch(): per-key order, prefix filter, timeout, overflow, across processes."""

from __future__ import annotations

import multiprocessing as mp
import random
import threading
import time

import kvcomm


def test_events_in_order_with_versions(kv: kvcomm.Client) -> None:
    w = kv.watch("drone/", timeout=0.5)
    v1 = kv.put("drone/1", 1)
    kv.put("other", 1)
    v2 = kv.put("drone/1", 2)
    kv.delete("drone/1")
    events = list(w)
    assert [(e.key, e.kind) for e in events] == [
        ("drone/1", "put"), ("drone/1", "put"), ("drone/1", "delete")
    ]
    assert events[0].version == v1 and events[1].version == v2


def test_timeout_ends_iteration(kv: kvcomm.Client) -> None:
    assert list(kv.watch("x", timeout=0.05)) == []


def test_watch_sees_only_future_events(kv: kvcomm.Client) -> None:
    kv.put("a", 1)
    w = kv.watch("", timeout=0.2)
    kv.put("b", 1)
    assert [e.key for e in w] == ["b"]


def test_overflow_is_reported_once_and_watch_continues(ns: str) -> None:
    cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": "16MB", "watch_buffer": 16}})
    with kvcomm.open(ns, config=cfg) as kv:
        w = kv.watch("", timeout=0.3)
        cap = kv._seg.layout.feed_n
        for i in range(cap * 3):
            kv.put(f"k{i}", i)
        first = next(w)
        assert first.kind == "overflow"
        kv.put("after", 1)
        rest = list(w)
        assert [e.key for e in rest] == ["after"]


def test_slow_watcher_never_slows_writers(kv: kvcomm.Client) -> None:
    """Writers never wait for a watcher: with a watcher that never reads, the writes of a
    full feed ring (and more) take no longer than the same writes with no watcher; the
    watcher then gets one overflow and the newest events."""
    import statistics

    def timed_writes(n: int) -> float:
        t0 = time.perf_counter()
        for i in range(n):
            kv.put(f"k{i % 100}", i)
        return time.perf_counter() - t0

    n = kv._seg.layout.feed_n * 3
    timed_writes(n)  # warm up
    alone = statistics.median(timed_writes(n) for _ in range(3))
    w = kv.watch("", timeout=0.2)  # created and never read while the writers run
    watched = statistics.median(timed_writes(n) for _ in range(3))
    print(f"{n} puts: {alone * 1e3:.1f} ms alone, {watched * 1e3:.1f} ms with a stalled watcher")
    # the same code path either way: the ratio only reflects noise (generous bound)
    assert watched < alone * 3 + 0.05
    assert kv.get("k99") == max(i for i in range(n) if i % 100 == 99)
    assert next(w).kind == "overflow"


def test_evictions_are_their_own_event_kind(ns: str) -> None:
    """Item 1: an eviction is a local event, never shown as a delete."""
    cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": "4MB", "watch_buffer": 65536}})
    with kvcomm.open(ns, config=cfg) as kv:
        w = kv.watch("", timeout=0.2)
        for i in range(400):
            kv.put(f"big/{i}", b"x" * 40_000)
        kinds = [e.kind for e in w]
        assert kv._seg.info()["evictions"] > 0
        assert "delete" not in kinds
        assert kinds.count("evict") == kv._seg.info()["evictions"]


def _writer(ns: str, cfg: kvcomm.Config, wid: int, seed: int, n: int) -> None:
    rng = random.Random(seed + wid)
    with kvcomm.open(ns, config=cfg) as kv:
        for i in range(n):
            k = f"w/{rng.randrange(20)}"
            if rng.random() < 0.15:
                kv.delete(k)
            else:
                kv.put(k, [wid, i])


def test_last_event_per_key_matches_current_version(ns: str, config: kvcomm.Config) -> None:
    seed = random.randrange(2**32)
    print(f"seed={seed}")
    ctx = mp.get_context("fork")
    with kvcomm.open(ns, config=config) as kv:
        last: dict[str, kvcomm.Event] = {}
        w = kv.watch("w/", timeout=1.0)
        overflowed = threading.Event()

        def consume() -> None:
            for ev in w:
                if ev.kind == "overflow":
                    overflowed.set()
                else:
                    last[ev.key] = ev

        t = threading.Thread(target=consume)
        t.start()
        procs = [ctx.Process(target=_writer, args=(ns, config, i, seed, 2000)) for i in range(3)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
            assert p.exitcode == 0
        t.join()
        assert not overflowed.is_set()
        for key in {f"w/{i}" for i in range(20)}:
            item = kv.get_item(key)
            ev = last.get(key)
            if item is None:
                assert ev is None or ev.kind == "delete"
            else:
                assert ev is not None and ev.kind == "put" and ev.version == item.version
