"""Adversarial review of issue 13 (kv.scan, cluster-wide kv.watch, the LangGraph
integration): every test here reproduced a finding before its fix (docstrings "F<n>:")."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Any

import ormsgpack
import pytest

import kvcomm
from kvcomm.tiers.l3 import L3Store
from tests.support.helpers import wait_for

lg = pytest.importorskip("langgraph.checkpoint.serde.jsonplus")

from kvcomm.integrations.langgraph import KVCommSaver, KVCommStore  # noqa: E402
from tests.support.devcluster import dev_cluster_fixture, host, l3  # noqa: E402

needs_cluster = [
    pytest.mark.redis,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed"),
    pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed"),
]


def _constructor_call(module: str, name: str, arg: Any) -> bytes:
    """msgpack bytes that LangGraph's default JsonPlusSerializer turns into a call of
    ``module.name(arg)`` when it loads them (its EXT_CONSTRUCTOR_SINGLE_ARG ext type)."""
    return ormsgpack.packb(ormsgpack.Ext(0, ormsgpack.packb([module, name, arg])))


def test_crafted_msgpack_in_kvcomm_never_runs_code_in_the_store(kv: kvcomm.Client,
                                                               tmp_path: Path) -> None:
    """F1: LangGraph's default JsonPlusSerializer imports any module and calls any
    function a msgpack ext record names (``os.system``...). A record planted under a
    KVCommStore key by any process that can write the namespace ran code in every reader:
    the same hazard as a pickle, which KVCOMM refuses. Now nothing is called (the record
    loads as its raw fields, LangGraph's strict mode), and a serializer that would call
    anything is refused."""
    marker = tmp_path / "pwned"
    store = KVCommStore(kv)
    store.put(("mem",), "k", {"x": 1})
    key = store.keys.item(("mem",), "k")
    raw = kv.get(key)
    kv.put(key, ["msgpack", _constructor_call("os", "system", f"touch {marker}"), raw[2], raw[3]])
    try:
        store.get(("mem",), "k")
    except kvcomm.KVCommError:
        pass
    assert not marker.exists(), "a record read from KVCOMM ran os.system"
    with pytest.raises(kvcomm.ConfigError, match="any function"):
        KVCommStore(kv, serde=lg.JsonPlusSerializer(allowed_msgpack_modules=True))
    with pytest.raises(kvcomm.ConfigError, match="any function"):
        KVCommSaver(kv, serde=lg.JsonPlusSerializer(allowed_json_modules=True))
    KVCommSaver(kv, serde=lg.JsonPlusSerializer(allowed_msgpack_modules=[("uuid", "UUID")]))


def test_crafted_msgpack_in_kvcomm_never_runs_code_in_the_saver(kv: kvcomm.Client,
                                                               tmp_path: Path) -> None:
    """F1: the same through KVCommSaver: a checkpoint whose channel value is a crafted
    constructor call ran it on get_tuple."""
    marker = tmp_path / "pwned"
    saver = KVCommSaver(kv)
    cfg = {"configurable": {"thread_id": "t", "checkpoint_ns": ""}}
    from langgraph.checkpoint.base import empty_checkpoint

    cp = empty_checkpoint()
    cp["channel_values"] = {"c": 1}
    cp["channel_versions"] = {"c": "1"}
    saver.put(cfg, cp, {}, {"c": "1"})
    blobs = [i.key for i in kv.scan(saver.keys.blobs)]
    planted = 0
    for k in blobs:
        v = kv.get(k)
        if isinstance(v, list) and v and v[0] == "msgpack":
            kv.put(k, ["msgpack", _constructor_call("os", "system", f"touch {marker}")])
            planted += 1
    assert planted, f"no msgpack record found to plant into among {blobs}"
    try:
        saver.get_tuple(cfg)
    except kvcomm.KVCommError:
        pass
    assert not marker.exists(), "a record read from KVCOMM ran os.system"


# ---------------------------------------------------------------- a dev cluster


dev = dev_cluster_fixture(2, strong_prefixes=["lock/"], groups=64, watch_buffer=1024)


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
    they are skipped, and every live key still appears, in order."""
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


# ---------------------------------------------------------------- watch registrations


def test_a_planted_watch_directory_is_refused(tmp_path: Path) -> None:
    """F3: ``kvcomm.NS.watch`` lives in /dev/shm, which every user can write: one another
    user created first (or one with a wider mode) was used as it was, so that user could
    delete a watcher's registration (the watch then silently misses other hosts'
    changes) or plant prefixes for the daemon. It is refused (SegmentError) as the
    segment and the placement table are."""
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
    file as a prefix. Only regular files of this user are read, without waiting."""
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


@pytest.mark.redis
def test_foreign_strong_records_in_etcd_raise_kvcomm_errors(dev: dict[str, Any]) -> None:
    """F4: a value under a strong key in etcd that KVCOMM did not write (4 bytes) made
    ``get`` and every ``scan`` over it raise struct.error (no KVCommError: callers
    catching KVCommError crashed), and a key there that is not UTF-8 made ``scan`` raise
    UnicodeDecodeError. The value raises CorruptRecord; the key, no key, is skipped."""
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
    entry only when this host wrote it), never an invented entry."""
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
    read from L3."""
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
        os.kill(pid, 19)  # SIGSTOP: host 2's daemon applies nothing from now on
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
    ``overflow`` event and the changes after it."""
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


@pytest.mark.parametrize("planted", [5, "x", ["msgpack"], [1, 2, 3, 4, 5, 6]])
def test_malformed_records_under_langgraph_keys_raise_corrupt_record(kv: kvcomm.Client,
                                                                      planted: Any) -> None:
    """F8: a value of another shape under a KVCommSaver or KVCommStore key (written by
    another program, or an older layout) made get_tuple, list, get and search raise
    TypeError, ValueError or NotImplementedError: not KVCommError, so callers handling
    KVCOMM's errors crashed. They raise CorruptRecord naming what to delete."""
    from langgraph.checkpoint.base import empty_checkpoint

    saver, store = KVCommSaver(kv), KVCommStore(kv)
    cfg = {"configurable": {"thread_id": "t", "checkpoint_ns": ""}}
    cp = empty_checkpoint()
    saver.put(cfg, cp, {}, {})
    kv.put(saver.keys.checkpoint("t", "", cp["id"]), planted)
    with pytest.raises(kvcomm.CorruptRecord):
        saver.get_tuple(cfg)
    with pytest.raises(kvcomm.CorruptRecord):
        list(saver.list(cfg))
    store.put(("m",), "k", {"a": 1})
    kv.put(store.keys.item(("m",), "k"), planted)
    with pytest.raises(kvcomm.CorruptRecord):
        store.get(("m",), "k")
    with pytest.raises(kvcomm.CorruptRecord):
        store.search(("m",))
    if not isinstance(planted, list):
        kv.put(saver.keys.head("t", ""), planted)
        with pytest.raises(kvcomm.CorruptRecord):
            saver.get_tuple(cfg)


def test_prefixes_and_afters_that_are_not_utf8_are_refused_as_arguments(kv: kvcomm.Client) -> None:
    """F9: a prefix (or ``after``) holding a lone surrogate made ``watch`` raise
    UnicodeEncodeError (no KVCommError; in cluster mode after leaving a half-made
    registration file) and a cluster ``scan`` raise CorruptRecord ("rename it", about a
    key that is only an argument). Both refuse it up front: InvalidKey for a prefix,
    InvalidArgument for ``after``."""
    with pytest.raises(kvcomm.InvalidKey, match="UTF-8"):
        kv.scan("a\ud800")
    with pytest.raises(kvcomm.InvalidArgument, match="UTF-8"):
        kv.scan("a", after="a\ud800")
    with pytest.raises(kvcomm.InvalidKey, match="UTF-8"):
        kv.watch("a\ud800")
