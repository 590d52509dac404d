"""watch(): per-key order, prefix filter, timeout, overflow, across processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import threading
import time
from pathlib import Path

import pytest

import kvcomm
from tests.support.helpers import drawn_seed, wait_for


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


def test_last_event_per_key_matches_current_version(ns: str) -> None:
    seed = drawn_seed(2**32)
    # a feed that holds all 6,000 events: the consumer may fall any way behind (a loaded
    # CI machine: it overflowed a 4,096-event feed once) and still read every one
    config = kvcomm.Config.from_mapping({"cache": {"l2_size": "16MB", "watch_buffer": 8192}})
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


# ---------------------------------------------------------------- watch registrations


def test_a_planted_watch_directory_is_refused(tmp_path: Path) -> None:
    """F3: ``kvcomm.NS.watch`` lives in /dev/shm, which every user can write: one another
    user created first (or one with a wider mode) was used as it was, so that user could
    delete a watcher's registration (the watch then silently misses other hosts'
    changes) or plant prefixes for the daemon. It is refused (SegmentError) as the
    segment and the placement table are.
    (found in review 13: kv.scan, cluster-wide kv.watch, LangGraph)"""
    from kvcomm.node.watched import register, watch_dir

    d = watch_dir("ns", str(tmp_path))
    os.mkdir(d, 0o777)
    os.chmod(d, 0o777)
    with pytest.raises(kvcomm.SegmentError, match="remove it"):
        register("ns", str(tmp_path), "p/", 0o600)
    os.chmod(d, 0o700)
    os.chown(d, 12345, 12345) if os.geteuid() == 0 else None
    if os.geteuid() == 0:
        with pytest.raises(kvcomm.SegmentError, match="remove it"):
            register("ns", str(tmp_path), "p/", 0o600)
    os.rmdir(d)
    os.symlink(str(tmp_path), d)
    with pytest.raises(kvcomm.SegmentError, match="remove it"):
        register("ns", str(tmp_path), "p/", 0o600)


def test_the_daemon_never_blocks_on_or_follows_planted_registrations(tmp_path: Path) -> None:
    """F3: the daemon read every ``PID-ID`` file with open(), following symlinks and
    waiting on FIFOs: a FIFO planted under a live pid's name blocked the node daemon's
    loop for ever (no more syncing for the whole host), and a symlink made it read any
    file as a prefix. Only regular files of this user are read, without waiting.
    (found in review 13: kv.scan, cluster-wide kv.watch, LangGraph)"""
    from kvcomm.node.watched import WatchedPrefixes, register, watch_dir

    path, _ = register("ns", str(tmp_path), "good/", 0o600)
    d = watch_dir("ns", str(tmp_path))
    os.mkfifo(os.path.join(d, f"{os.getpid()}-fifo"))
    target = tmp_path / "secret"
    target.write_text("planted/")
    os.symlink(str(target), os.path.join(d, f"{os.getpid()}-link"))
    wp = WatchedPrefixes("ns", str(tmp_path))
    done: list[bool] = []
    t = threading.Thread(target=lambda: done.append(wp.poll(0.0)), daemon=True)
    t.start()
    try:
        wait_for(lambda: done, 30, "the daemon's poll of the registrations to return")
    finally:
        if not done:  # unblock the thread: open the FIFO's other end
            fd = os.open(os.path.join(d, f"{os.getpid()}-fifo"), os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
    assert wp.prefixes == ("good/",)
    os.unlink(path)
