"""kv.scan and kv.watch in cluster mode, on a real dev cluster of two hosts: every live
key of the cluster under the prefix (not only what this host holds), strong keys from etcd
merged in, writes not yet in L3 included, deletes never shown, pages, concurrent writers,
the key index backfilled for data written before it existed; a watch on host 2 sees host
1's changes, and overflows tell a watcher to rescan."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import kvcomm
from kvcomm.tiers.l3 import META_INDEX, L3Store
from tests.support.devcluster import all_live_in_l3, dev_cluster_fixture, host, l3, stop_daemon
from tests.support.helpers import drawn_seed, wait_for

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
        stop_daemon(pid, a)
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
    seed = drawn_seed(1 << 30)
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


def scan_in_thread(kv: kvcomm.Client, prefix: str, **kw: Any) -> list[str] | BaseException:
    """``[key...]`` of ``kv.scan(prefix, **kw)`` or what it raised, run in a thread so
    that a scan that never ends fails the test instead of hanging it."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append([i.key for i in kv.scan(prefix, **kw)])
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    wait_for(lambda: out, 60, f"the scan of {prefix!r} to end")
    return out[0]  # type: ignore[no-any-return]


@pytest.mark.redis
def test_hostile_index_members_are_skipped_and_the_scan_ends(dev: dict[str, Any]) -> None:
    """F2: members planted in a group's key index (kvi:{t}) by a non-KVCOMM client: 600
    that are not UTF-8 made ``scan`` loop for ever (the page bound, decoded with
    "replace", sorted below the member it came from, so every round re-read the same
    page); one holding NUL or one of 1 MB made it raise InvalidKey, so no scan of the
    prefix could ever list the live keys. Members that cannot be keys are not live keys:
    they are skipped, and every live key still appears, in order.
    (found in review 13: kv.scan, cluster-wide kv.watch, LangGraph)"""
    b, store = host(dev, 1), l3(dev)
    try:
        live = [f"hx/{i:02d}" for i in range(5)] + ["hx/\u00e9", "hx/\U0001f600"]
        for k in live:
            b.put(k, 1)
        wait_for(lambda: all(r is not None for r in store.get_many(live).values()), 30,
                 "the keys in L3")
        idx = store.groups.index_key(store.groups.of("hx/00"))
        junk: dict[bytes, int] = {}
        for lead in (b"\xf0", b"\xfe"):
            junk.update({b"hx/" + lead + bytes([1 + i // 200, 1 + i % 200]): 0 for i in range(300)})
        junk[b"hx/\x00nul"] = 0
        junk[b"hx/" + b"y" * (1 << 20)] = 0
        store.rc.zadd(idx, junk)  # type: ignore[arg-type]
        got = scan_in_thread(b, "hx/")
        assert got == sorted(live, key=lambda k: k.encode()), got
        paged: list[str] = []
        after = None
        while True:
            page = scan_in_thread(b, "hx/", limit=2, after=after)
            assert isinstance(page, list), page
            if not page:
                break
            paged += page
            after = page[-1]
        assert paged == sorted(live, key=lambda k: k.encode())
    finally:
        b.close()
        store.close()


@pytest.mark.redis
def test_foreign_strong_records_in_etcd_raise_kvcomm_errors(dev: dict[str, Any]) -> None:
    """F4: a value under a strong key in etcd that KVCOMM did not write (4 bytes) made
    ``get`` and every ``scan`` over it raise struct.error (no KVCommError: callers
    catching KVCommError crashed), and a key there that is not UTF-8 made ``scan`` raise
    UnicodeDecodeError. The value raises CorruptRecord; the key, no key, is skipped.
    (found in review 13: kv.scan, cluster-wide kv.watch, LangGraph)"""
    from kvcomm.tiers.etcd import EtcdClient

    eps = [("127.0.0.1", p) for p in dev["etcd"]["client_ports"]]
    b = host(dev, 1)
    try:
        b.put("lock/f4/ok", "v")
        with EtcdClient(eps) as raw:
            raw.put(b"kvc/k/lock/f4/\xff\xfe", b"junk-not-a-record")
        assert [(i.key, i.value) for i in b.scan("lock/f4/")] == [("lock/f4/ok", "v")]
        with EtcdClient(eps) as raw:
            raw.put(b"kvc/k/lock/f4/bad", b"junk")
        with pytest.raises(kvcomm.CorruptRecord):
            b.get("lock/f4/bad")
        with pytest.raises(kvcomm.CorruptRecord):
            list(b.scan("lock/f4/"))
    finally:
        b.close()


@pytest.mark.redis
def test_a_late_watch_event_never_names_a_writer_that_did_not_write(dev: dict[str, Any]) -> None:
    """F5: a watcher on host 2 that read host 1's put after the key had changed again got
    Version((("host-2", 0),), hlc): a version saying host 2 wrote it, at counter 0. When
    the full version is gone the event carries what is known (its HLC, and this host's
    entry only when this host wrote it), never an invented entry.
    (found in review 13: kv.scan, cluster-wide kv.watch, LangGraph)"""
    a, b = host(dev, 0), host(dev, 1)
    try:
        w = b.watch("f5/", timeout=5)
        a.put("f5/k", 1)
        wait_for(lambda: b.get("f5/k") == 1, 30, "host 2 to hold f5/k")
        a.put("f5/k", 2)
        wait_for(lambda: b.get("f5/k") == 2, 30, "host 2 to hold the second put")
        events = []
        for e in w:  # read only now: the first put's full version is gone from L2
            events.append(e)
            if e.kind == "put" and len([x for x in events if x.kind == "put"]) == 2:
                break
        host2 = dev["hosts"][1]["name"] if "name" in dev["hosts"][1] else "host-2"
        puts = [e for e in events if e.kind == "put"]
        # (the first put, replaced before it was read, may be coalesced into the second)
        assert 1 <= len(puts) <= 2, events
        for e in puts:
            assert e.version is not None
            assert all(h != host2 for h, _ in e.version.vector), e
        assert puts[-1].version.vector and puts[-1].version.vector[0][0] != host2
    finally:
        a.close(), b.close()


def _l3_state(store: L3Store, key: str) -> str:
    r = store.get_many([key])[key]
    return "absent" if r is None else "error" if isinstance(r, Exception) else (
        "tombstone" if r.tombstone else "live")


def _dirty(kv: kvcomm.Client, key: str) -> bool:
    from kvcomm.tiers.l2 import FLAG_DIRTY, key_hash

    kb = key.encode()
    v = kv._seg.version(kb, key_hash(kb))
    return v is not None and bool(v[6] & FLAG_DIRTY)


@pytest.mark.redis
def test_a_scan_never_serves_l2s_stale_view_of_what_l3_acknowledged(dev: dict[str, Any]) -> None:
    """F6: in cluster mode a scan served every key this host's L2 holds from L2, so until
    the host's daemon applied other hosts' changes (here: stopped; in life, the feed's
    lag) a key another host deleted, acknowledged by L3 before the scan began, still
    appeared ("deleted keys never appear" broken), and a key this host had deleted and
    another host put again (acknowledged) was missing ("always appears" broken). L2 now
    serves only this host's writes not yet in L3, and keys L3's index lists; others are
    read from L3.
    (found in review 13: kv.scan, cluster-wide kv.watch, LangGraph)"""
    a, b, store = host(dev, 0), host(dev, 1), l3(dev)
    pid = int(dev["hosts"][1]["pid"])
    stopped = False
    try:
        a.put("f6/gone", 1)
        a.put("f6/stay", 1)
        b.put("f6/back", 1)
        wait_for(lambda: all(_l3_state(store, k) == "live" for k in ("f6/gone", "f6/stay", "f6/back")),
                 30, "the puts in L3")
        wait_for(lambda: b.get("f6/gone") == 1 and b.get("f6/stay") == 1, 30, "host 2 to hold them")
        b.delete("f6/back")
        wait_for(lambda: _l3_state(store, "f6/back") == "tombstone" and not _dirty(b, "f6/back"),
                 30, "host 2's delete in L3")
        stop_daemon(pid, b)  # (SIGSTOP: host 2's daemon applies nothing from now on)
        stopped = True
        a.delete("f6/gone")
        a.put("f6/back", 2)
        wait_for(lambda: _l3_state(store, "f6/gone") == "tombstone"
                 and _l3_state(store, "f6/back") == "live", 30, "host 1's changes in L3")
        got = [(i.key, i.value) for i in b.scan("f6/")]
        assert got == [("f6/back", 2), ("f6/stay", 1)], got
    finally:
        if stopped:
            os.kill(pid, 18)  # SIGCONT
        a.close(), b.close(), store.close()


@pytest.mark.redis
def test_a_slow_watcher_of_strong_keys_is_told_to_rescan_and_holds_bounded_memory(
        dev: dict[str, Any]) -> None:
    """F7: the strong keys of a cluster watch come from an etcd watch whose reader thread
    queued every event without bound: a watcher that does not read (a slow one, or one
    whose generator sits unstarted) held every strong change of the prefix in memory for
    ever and was never told to rescan, unlike L2's feed (``cache.watch_buffer``). The
    queue now holds at most ``cache.watch_buffer`` events; past it the watcher gets one
    ``overflow`` event and the changes after it.
    (found in review 13: kv.scan, cluster-wide kv.watch, LangGraph)"""
    a, b = host(dev, 0), host(dev, 1)
    try:
        buffer = b.config.cache.watch_buffer
        w = b.watch("lock/f7/", timeout=10)
        n = buffer + 200
        for i in range(n):
            a.put(f"lock/f7/{i:05d}", i)
        sub_watch = w.gi_frame.f_locals["feed"].sub.etcd_watch  # type: ignore[attr-defined]

        def queued() -> int:
            return sum(len(x) for x in list(sub_watch._queue.queue) if isinstance(x, list))

        a.put("lock/f7/last", "end")
        wait_for(lambda: any(isinstance(x, list) and x[-1].kv.key.endswith(b"/last")
                             for x in list(sub_watch._queue.queue)), 30,
                 "the etcd watch to queue the last put")
        assert queued() <= buffer, f"{queued()} events queued for a watcher that reads none"
        kinds = []
        for e in w:
            kinds.append((e.kind, e.key))
            if e.key == "lock/f7/last":
                break
        assert ("overflow", "") in kinds, kinds[:5]
        assert len(kinds) <= buffer + 2, len(kinds)
    finally:
        a.close(), b.close()
