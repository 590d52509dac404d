"""kv.scan and kv.watch in cluster mode, on a real dev cluster of two hosts: every live
key of the cluster under the prefix (not only what this host holds), strong keys from etcd
merged in, writes not yet in L3 included, deletes never shown, pages, concurrent writers,
the key index backfilled for data written before it existed; a watch on host 2 sees host
1's changes, and overflows tell a watcher to rescan."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import shutil
import signal
from collections.abc import Iterator
from typing import Any

import pytest

import kvcomm
from kvcomm.tiers.l3 import META_INDEX
from tests.support.devcluster import all_live_in_l3, dev_cluster_fixture, host, l3
from tests.support.helpers import wait_for

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed"),
    pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed"),
]
CTX = mp.get_context("fork")


# a small feed ring: the overflow test fills it on purpose
dev = dev_cluster_fixture(2, strong_prefixes=["lock/"], groups=64, watch_buffer=1024)


def scan_keys(kv: kvcomm.Client, prefix: str, **kw: Any) -> list[str]:
    return [i.key for i in kv.scan(prefix, **kw)]


def pages(kv: kvcomm.Client, prefix: str, limit: int) -> list[list[str]]:
    out: list[list[str]] = []
    after = None
    while True:
        page = scan_keys(kv, prefix, limit=limit, after=after)
        assert len(page) <= limit
        if not page:
            return out
        out.append(page)
        after = page[-1]


def test_host_2_scan_finds_keys_host_1_wrote(dev: dict[str, Any]) -> None:
    a, b, store = host(dev, 0), host(dev, 1), l3(dev)
    try:
        keys = [f"drone/{i:03d}/state" for i in range(250)]
        for i, k in enumerate(keys):
            a.put(k, {"i": i})
        a.put("drones", 1)  # outside the prefix "drone/"
        wait_for(lambda: all_live_in_l3(store, keys), 20, "host 1's writes to reach L3")
        assert b.keys("drone/") == keys  # host 2 never read one of them
        items = list(b.scan("drone/"))
        assert [i.value["i"] for i in items] == list(range(250))
        assert all(i.tier == "l3" for i in items)  # (scans do not fill host 2's L2)
        assert items[7].version == a.get_item(keys[7]).version  # the full version
        got = pages(b, "drone/", 40)
        assert [len(p) for p in got] == [40] * 6 + [10]
        assert [k for p in got for k in p] == keys
        assert scan_keys(b, "drone/", limit=3, after="drone/100/state") == keys[101:104]
    finally:
        a.close(), b.close(), store.close()


def test_deleted_keys_never_appear(dev: dict[str, Any]) -> None:
    a, b, store = host(dev, 0), host(dev, 1), l3(dev)
    try:
        keys = [f"del/{i:02d}" for i in range(30)]
        for k in keys:
            a.put(k, 1)
        wait_for(lambda: all_live_in_l3(store, keys), 20, "the puts to reach L3")
        for k in keys[::2]:
            a.delete(k)
        # on the deleting host at once: its tombstones hide L3's records
        assert scan_keys(a, "del/") == keys[1::2]
        wait_for(lambda: all(r is not None and not isinstance(r, Exception) and r.tombstone
                             for r in store.get_many(keys[::2]).values()),
                 20, "the deletes to reach L3")
        assert scan_keys(b, "del/") == keys[1::2]
        # a key host 2 holds (it read it) and host 1 deletes: gone from host 2's scan once
        # L3 has the delete and host 2's daemon applied it
        # (host 2 never read it: "absent" from its key filter until its daemon has read the
        # put's feed entry, 10-20 ms after L3 had it (measured), then 5 s of negative cache)
        wait_for(lambda: b.get("del/01") == 1, 20, "host 2 to read del/01")
        a.delete("del/01")
        wait_for(lambda: "del/01" not in scan_keys(b, "del/"), 20, "host 2 to drop del/01")
    finally:
        a.close(), b.close(), store.close()


def test_writes_not_yet_in_l3_appear(dev: dict[str, Any]) -> None:
    """Host 1's daemon is stopped: its writes stay dirty in L2, and its scans show them
    (merged with L3's keys), and its deletes hide L3's keys."""
    a, store = host(dev, 0), l3(dev)
    pid = dev["hosts"][0]["pid"]
    try:
        a.put("dirty/b", "in L3")
        a.put("dirty/d", "in L3, deleted while the daemon is stopped")
        wait_for(lambda: all_live_in_l3(store, ["dirty/b", "dirty/d"]), 20, "the puts to reach L3")
        os.kill(pid, signal.SIGSTOP)
        try:
            a.put("dirty/a", "local")
            a.put("dirty/c", "local")
            a.delete("dirty/d")
            assert a._seg.dirty_count >= 3  # (the condition under test: not yet in L3)
            assert store.get("dirty/a") is None
            assert [(i.key, i.value) for i in a.scan("dirty/")] == [
                ("dirty/a", "local"), ("dirty/b", "in L3"), ("dirty/c", "local")]
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: all_live_in_l3(store, ["dirty/a", "dirty/c"]), 20, "the writes to reach L3")
    finally:
        a.close(), store.close()


def test_strong_keys_come_from_etcd_merged_in_order(dev: dict[str, Any]) -> None:
    a, b, store = host(dev, 0), host(dev, 1), l3(dev)
    try:
        for i in range(5):
            a.put(f"lock/{i}", f"held-{i}")  # strong: etcd only
        a.put("lo/x", 1)
        a.put("lock", 2)
        a.put("lockz", 3)
        wait_for(lambda: all_live_in_l3(store, ["lo/x", "lock", "lockz"]), 20, "the puts to reach L3")
        want = ["lo/x", "lock", *[f"lock/{i}" for i in range(5)], "lockz"]
        assert scan_keys(b, "lo") == want
        assert [i.version.vector[0][0] for i in b.scan("lock/")] == ["@etcd"] * 5
        assert [i.value for i in b.scan("lock/", limit=2, after="lock/1")] == ["held-2", "held-3"]
        assert [k for p in pages(b, "lo", 2) for k in p] == want
        a.delete("lock/3")
        assert "lock/3" not in scan_keys(b, "lock/")
    finally:
        a.close(), b.close(), store.close()


def _churn(config: str, seed: int, n: int) -> None:
    rng = random.Random(seed)
    with kvcomm.open(config=config) as kv:
        for _ in range(n):
            k = f"cw/{rng.randrange(300):03d}"
            if rng.random() < 0.5:
                kv.put(k, rng.random())
            else:
                kv.delete(k)


def test_concurrent_writes_never_hide_an_acknowledged_key(dev: dict[str, Any]) -> None:
    """Keys acknowledged by L3 before a scan began and never deleted always appear in
    every scan of both hosts while both hosts put and delete other keys under the prefix."""
    seed = random.randrange(1 << 30)
    print("seed", seed)
    a, b, store = host(dev, 0), host(dev, 1), l3(dev)
    try:
        stable = [f"cw/{i:03d}s" for i in range(0, 300, 11)]  # never touched by churners
        for k in stable:
            a.put(k, "stable")
        wait_for(lambda: all_live_in_l3(store, stable), 20, "the stable keys to reach L3")
        procs = [CTX.Process(target=_churn, args=(h["config"], seed + j, 1500))
                 for j, h in enumerate(dev["hosts"])]
        for p in procs:
            p.start()
        scans = 0
        while any(p.is_alive() for p in procs) or scans < 5:
            for kv in (a, b):
                got = scan_keys(kv, "cw/")
                assert got == sorted(set(got), key=lambda k: k.encode())
                assert set(stable) <= set(got)
                paged = [k for p in pages(kv, "cw/", 17) for k in p]
                assert set(stable) <= set(paged)
                scans += 1
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        assert scans >= 5
    finally:
        a.close(), b.close(), store.close()


def test_backfill_indexes_records_written_before_the_index(dev: dict[str, Any]) -> None:
    a, b, store = host(dev, 0), host(dev, 1), l3(dev)
    try:
        keys = [f"old/{i:02d}" for i in range(20)]
        for k in keys:
            a.put(k, 1)
        a.put("old/gone", 1)
        wait_for(lambda: all_live_in_l3(store, [*keys, "old/gone"]), 20, "the puts to reach L3")
        a.delete("old/gone")
        wait_for(lambda: store.get("old/gone").tombstone, 20, "the delete to reach L3")  # type: ignore[union-attr]
        # as an L3 written before the index existed: no entries, no marker
        for k in [*keys, "old/gone"]:
            store.rc.zrem(store.groups.index_key(store.groups.of(k)), k)
        store.rc.delete(META_INDEX)
        assert scan_keys(b, "old/") == []
        assert not store.index_ready()
        assert store.backfill_index() >= 21
        assert store.index_ready()
        assert scan_keys(b, "old/") == keys  # the tombstone stays out
    finally:
        a.close(), b.close(), store.close()


def test_the_index_is_in_l3_and_follows_deletes(dev: dict[str, Any]) -> None:
    a, store = host(dev, 0), l3(dev)
    try:
        a.put("ix/1", 1)
        wait_for(lambda: all_live_in_l3(store, ["ix/1"]), 20, "the put to reach L3")
        idx = store.groups.index_key(store.groups.of("ix/1"))
        assert store.rc.zscore(idx, "ix/1") == 0
        a.delete("ix/1")
        wait_for(lambda: store.rc.zscore(idx, "ix/1") is None, 20, "the index to drop ix/1")
        assert store.rc.zscore(idx, "") == 0  # the set stays in existence
        g = store.groups.of("ix/1")
        page, bound = store.index_range("", "", 1, groups=[g])
        assert "" not in page and bound != ""  # the empty member is no key, nor a bound
        assert store.index_ready()  # the daemons backfilled (an empty L3) at their start
    finally:
        a.close(), store.close()


def collect(it: Iterator[kvcomm.Event], done: Any, timeout: float = 20.0) -> list[kvcomm.Event]:
    """Events of a watch (opened with a timeout) until ``done(events)`` or ``timeout``."""
    import time

    out: list[kvcomm.Event] = []
    deadline = time.monotonic() + timeout
    for ev in it:
        out.append(ev)
        if done(out) or time.monotonic() > deadline:
            break
    return out


def seen(*pairs: tuple[str, str]) -> Any:
    return lambda evs: set(pairs) <= {(e.key, e.kind) for e in evs}


def test_a_watch_on_host_2_sees_host_1s_changes(dev: dict[str, Any]) -> None:
    a, b = host(dev, 0), host(dev, 1)
    try:
        w = b.watch("wx/", timeout=20)  # returns once host 2's daemon has the prefix
        v1 = a.put("wx/a", 1)  # a key host 2 never read
        v2 = a.put("wx/a", 2)
        a.put("wy/other", 0)  # outside the prefix
        v3 = a.put("wx/b", 3)
        a.delete("wx/a")
        events = collect(w, seen(("wx/a", "delete"), ("wx/b", "put")))
        by_key: dict[str, list[tuple[str, Any]]] = {}
        for ev in events:
            by_key.setdefault(ev.key, []).append((ev.kind, ev.version))
        # host 1 sends L3 each key's latest write of a window (the puts of wx/a may never
        # reach L3 apart from its delete), but what arrives keeps its order and carries
        # the full version of its write
        assert by_key["wx/a"][-1][0] == "delete"
        assert all(k == "put" and v in (v1, v2) for k, v in by_key["wx/a"][:-1])
        assert by_key["wx/b"] == [("put", v3)]
        assert "wy/other" not in by_key
        v4 = a.put("wx/b", 4)  # a key host 2 holds now: the same path
        assert collect(w, seen(("wx/b", "put")))[-1].version == v4
        w.close()
        # the registration is gone with the watch: the daemon no longer installs wx/
        from kvcomm.node.watched import watch_dir

        wait_for(lambda: not os.listdir(watch_dir(b.name, b.config.cache.l2_dir)), 5,
                 "the registration to be removed")
    finally:
        a.close(), b.close()


def test_a_watch_sees_strong_keys_from_etcd(dev: dict[str, Any]) -> None:
    a, b = host(dev, 0), host(dev, 1)
    try:
        w = b.watch("lock/w", timeout=20)
        v = a.put("lock/w1", "mine")
        a.delete("lock/w1")
        events = collect(w, seen(("lock/w1", "delete")))
        assert [(e.key, e.kind) for e in events] == [("lock/w1", "put"), ("lock/w1", "delete")]
        assert events[0].version == v
        w.close()
    finally:
        a.close(), b.close()


def test_a_slow_watcher_gets_an_overflow_and_rescans(dev: dict[str, Any]) -> None:
    a, b, store = host(dev, 0), host(dev, 1), l3(dev)
    try:
        w = b.watch("ov/", timeout=20)
        start = b._seg.feed_head()  # (at or after the watch's cursor)
        ring = b._seg.layout.feed_n
        keys = [f"ov/{i:05d}" for i in range(ring + 200)]
        for k in keys:  # host 1 writes; host 2's daemon installs them; nobody reads w
            a.put(k, 1)
        wait_for(lambda: b._seg.feed_head() - start > ring, 30,
                 "host 2's daemon to install more than a ring of host 1's writes")
        first = next(w)
        assert first.kind == "overflow"  # the watcher fell a whole ring behind
        wait_for(lambda: all_live_in_l3(store, keys[-5:]), 20, "the writes to reach L3")
        assert b.keys("ov/") == keys  # the rescan the overflow asks for
        w.close()
    finally:
        a.close(), b.close(), store.close()


def test_a_gap_in_the_cluster_feed_tells_watchers_to_rescan(dev: dict[str, Any]) -> None:
    """A group's feed skips a sequence number (entries lost: here its counter is bumped
    by hand): host 2's daemon resyncs the group, and its watcher gets an overflow."""
    import kvcomm.node.presence as presence

    a, b, store = host(dev, 0), host(dev, 1), l3(dev)
    try:
        status = presence.status_path(b.name, b.config.cache.l2_dir)
        before = presence.read_status(status)["watch_missed"]  # type: ignore[index]
        w = b.watch("gap/", timeout=20)
        g = store.groups.of("gap/1")
        store.rc.incr(store.groups.seq_key(g))  # the next entry's number skips one
        a.put("gap/1", 1)
        wait_for(lambda: presence.read_status(status)["watch_missed"] > before,  # type: ignore[index]
                 20, "host 2's daemon to resync the group")
        events = collect(w, lambda evs: evs[-1].kind == "overflow")
        assert events[-1].kind == "overflow"
        w.close()
    finally:
        a.close(), b.close(), store.close()


def test_a_scan_of_everything_pages_through_the_whole_cluster(dev: dict[str, Any]) -> None:
    a, b, store = host(dev, 0), host(dev, 1), l3(dev)
    try:
        mine = [f"all/{i:02d}" for i in range(50)]
        for k in mine:
            a.put(k, 1)
        a.put("lock/all", 1)  # strong: merged in
        wait_for(lambda: all_live_in_l3(store, mine), 20, "the puts to reach L3")
        every = [k for p in pages(b, "", 97) for k in p]  # (prefix "": the empty member)
        assert every == sorted(set(every), key=lambda k: k.encode())
        assert {*mine, "lock/all"} <= set(every)
        assert scan_keys(a, "", limit=1) == every[:1]
        assert [k for p in pages(a, "", 1000) for k in p] == every
    finally:
        a.close(), b.close(), store.close()


def test_a_watch_dropped_unstarted_unregisters(dev: dict[str, Any]) -> None:
    import gc

    from kvcomm.node.watched import watch_dir

    b = host(dev, 1)
    try:
        d = watch_dir(b.name, b.config.cache.l2_dir)
        before = set(os.listdir(d)) if os.path.isdir(d) else set()
        w = b.watch("dropped/")
        assert len(set(os.listdir(d)) - before) == 1  # registered at watch()
        del w
        gc.collect()
        assert set(os.listdir(d)) - before == set()
    finally:
        b.close()
