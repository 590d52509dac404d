"""REVIEW 8 (adversarial review of issue 8), data findings: migrate, purge, L3 records,
the key filter, the write sequence. Each test is the reviewer's reproduction of a
finding (the docstring says what it found); each failed on main at 4669990.

Run them alone with ``.venv/bin/python -m pytest -q -p no:randomly tests/test_review8_data.py``.
"""

from __future__ import annotations

import gzip
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import pytest
import yaml

import kvcomm
from kvcomm.core.versions import Version, vector_get
from kvcomm.tiers import l2
from kvcomm.tiers.shm import migrate as mig
from tests.l2.test_migrate import _old_segment
from tests.support import DATA
from tests.support.daemon_harness import Host, record, shared_cluster_fixture, store_fixture  # noqa: F401
from tests.support.helpers import wait_for

FIXTURE = DATA / "segment-layout2.bin.gz"


# ----------------------------------------------------------------------------- migration and purge

@pytest.fixture
def old(tmp_path: pathlib.Path, ns: str) -> Iterator[tuple[str, pathlib.Path, kvcomm.Config]]:
    yield from _old_segment(tmp_path, ns, FIXTURE)


def _open_local(ns: str, cfg: kvcomm.Config) -> kvcomm.Client:
    raw = cfg.model_dump()
    raw["cluster"]["redis"] = []
    return kvcomm.open(ns, config=kvcomm.Config.model_validate(raw))


def test_migrate_does_not_drop_an_unflushed_write_for_an_older_clean_copy(
        old: tuple[str, pathlib.Path, kvcomm.Config]) -> None:
    """F (acknowledged write lost): migrate skips an old dirty record whenever the new
    segment holds the key at all ("a write made after the upgrade: newer"). But the new
    segment also fills with L3's *older* copies: an agent's L2-miss read, the daemon's
    prewarm of hot keys, a pulled change — clean records. Here the new segment holds a
    clean, causally older copy of drone/1/pos (host-a's previous write, as L3 has it);
    migrate counts the dirty newer write "superseded", drops it, and the new segment keeps
    the old value, clean: the daemon never pushes the acknowledged write."""
    ns, _, cfg = old
    path = l2.segment_path(ns, cfg.cache.l2_dir)
    recs = {r.key.decode(): r for r in mig.unflushed(path, 0o600)[2]}  # type: ignore[index]
    dirty = recs["drone/1/pos"]
    os.rename(path, mig.aside_path(path, 2))  # migrate died after its rename (or is running)
    with _open_local(ns, cfg) as kv:  # an agent / the daemon fills the key from L3
        older = Version((("host-a", dirty.counter - 1),), dirty.hlc - 1)
        kv.merge_remote("drone/1/pos", b"previous value, already in L3", older)
    done = mig.migrate(ns, cfg)
    with _open_local(ns, cfg) as kv:
        item = kv.get_item("drone/1/pos")
        assert item is not None
        assert item.value == b"\x01\x03", (done, item)  # the acknowledged write
        assert vector_get(item.version.vector, "host-a") >= dirty.counter


@pytest.mark.parametrize("remote_is_later", [False, True])
def test_migrate_merges_a_concurrent_clean_copy_last_writer_wins(
        old: tuple[str, pathlib.Path, kvcomm.Config], remote_is_later: bool) -> None:
    """(Added with the fix.) The new segment holds a clean copy from L3 that is
    *concurrent* with the old unflushed write (another host's write that never saw it):
    migrate merges the two as L3 would, last-writer-wins by HLC with the merged vector,
    dirty either way (L3 must learn that the old write was seen), never dropping the old
    dot from the vector."""
    ns, _, cfg = old
    path = l2.segment_path(ns, cfg.cache.l2_dir)
    dirty = {r.key.decode(): r for r in mig.unflushed(path, 0o600)[2]}["drone/1/pos"]  # type: ignore[index]
    os.rename(path, mig.aside_path(path, 2))
    hlc = dirty.hlc + (1 if remote_is_later else -1)
    with _open_local(ns, cfg) as kv:
        kv.merge_remote("drone/1/pos", b"host-b's write", Version((("host-b", 5),), hlc))
    done = mig.migrate(ns, cfg)
    assert done.carried == 4 and done.superseded == 0, done
    with _open_local(ns, cfg) as kv:
        item = kv.get_item("drone/1/pos")
        assert item is not None
        assert item.value == (b"host-b's write" if remote_is_later else b"\x01\x03")
        assert vector_get(item.version.vector, "host-a") == dirty.counter
        assert vector_get(item.version.vector, "host-b") == 5
        assert kv._seg.dirty_count == 4
        assert kv._seg.check() == []


def test_purge_without_force_refuses_a_segment_made_with_wider_permissions(
        tmp_path: pathlib.Path, ns: str) -> None:
    """F (acknowledged write lost): with cache.l2_permissions 0o660 (a documented setting),
    `kvcomm purge --name NS --config FILE` (no --force) removes a segment holding writes
    not yet in L3. l2.purge opens the segment with the default 0o600 (not the config's),
    the open fails, and the fallback (migrate.unflushed) ignores the current layout."""
    raw = {"cache": {"l2_size": "16MB", "l2_dir": str(tmp_path), "l2_permissions": 0o660},
           "cluster": {"redis": ["127.0.0.1:1"]}, "node": {"host_id": "host-a"}}
    cfg_file = tmp_path / "host.yaml"
    cfg_file.write_text(yaml.safe_dump(raw))
    with kvcomm.open(ns, config=str(cfg_file), wait_daemon=False) as kv:  # (no daemon)
        kv.put("k", b"acknowledged, not yet in L3")
        assert kv._seg.dirty_count == 1
    out = subprocess.run([sys.executable, "-m", "kvcomm", "purge", "--name", ns, "--config",
                          str(cfg_file)], capture_output=True, text=True, timeout=60)
    present = os.path.exists(l2.segment_path(ns, str(tmp_path)))
    l2.purge(ns, str(tmp_path))
    assert out.returncode == 2 and present, (out.returncode, out.stdout, out.stderr)


def test_migrate_after_a_crash_keeps_writes_the_daemon_prewarmed_over(
        cluster: object, store: object) -> None:
    """F (acknowledged write lost, real cluster): the same loss, end to end. host-a had
    written drone/1/pos twice: the first write reached L3 (and the hot-key list the daemon
    saves), the second was still dirty when host-a was upgraded. `kvcomm migrate` died
    right after renaming the old segment aside (nothing else knows the aside file: open,
    info, the daemon all carry on). The node daemon restarts on the fresh segment and
    prewarms its hot keys from L3 — the *first* write, clean. Rerunning migrate then
    counts the second write "superseded" and deletes the aside file: L3 and every host
    keep the first write for ever."""
    import random
    import threading
    import uuid

    from kvcomm.node.daemon import NodeDaemon
    from tests.support.daemon_harness import host_config

    ns = f"td-{uuid.uuid4().hex[:10]}"
    path = l2.segment_path(ns)
    old_path = mig.aside_path(path, 2)
    with open(old_path, "wb") as f:
        f.write(gzip.decompress(FIXTURE.read_bytes()))
    os.chmod(old_path, 0o600)
    dirty = {r.key.decode(): r for r in mig.unflushed(old_path, 0o600)[2]}["drone/1/pos"]  # type: ignore[index]
    first = record(b"first write", "host-a", dirty.counter - 1, dirty.hlc - 1)
    assert store.push("drone/1/pos", first).outcome == "new"  # type: ignore[attr-defined]
    store.save_hot("host-a", ["drone/1/pos"])  # type: ignore[attr-defined]
    cfg = host_config(cluster, "host-a", ns)  # type: ignore[arg-type]
    daemon = NodeDaemon(cfg, rng=random.Random(1))
    stop = threading.Event()
    t = threading.Thread(target=daemon.run, args=(stop,), daemon=True)
    t.start()
    try:
        wait_for(lambda: daemon.stats.extra.get("prewarmed", 0) >= 1, 20, "the prewarm")
        done = mig.migrate(ns, cfg)
        wait_for(lambda: daemon.kv._seg.dirty_count == 0, 20, "delivery")
        rec = store.get("drone/1/pos")  # type: ignore[attr-defined]
        assert rec is not None and rec.value == b"\x01\x03", (done, rec)
    finally:
        stop.set()
        t.join(30)
        daemon.close()
        l2.purge(ns)
        if os.path.exists(old_path):
            os.unlink(old_path)


def _set_header_word(path: str, name: str, value: int) -> None:
    from kvcomm.tiers.shm.layout import H

    with open(path, "r+b") as f:
        f.seek(H[name] * 8)
        f.write(value.to_bytes(8, "little"))


def test_purge_trusts_a_corrupt_dirty_count(tmp_path: pathlib.Path, ns: str) -> None:
    """F (flaky suite + wrong refusal): `kvcomm purge` decides "writes not yet in L3" from
    the header's DIRTY counter alone. An embedded-mode segment (never any dirty record)
    whose counter is corrupt is refused: this is what made
    tests/l2/test_fuzz_segment.py::test_cli_purge_removes_any_corrupted_segment fail in the
    reviewer's full-suite run (FUZZ_SEED=339990849, random case 4: H_DIRTY 0 -> 65); every
    run draws a new seed, so the suite fails now and then."""
    raw = {"cache": {"l2_size": "16MB", "l2_dir": str(tmp_path)}}
    cfg_file = tmp_path / "e.yaml"
    cfg_file.write_text(yaml.safe_dump(raw))
    with kvcomm.open(ns, config=str(cfg_file)) as kv:
        kv.put("k", b"v")  # embedded: clean
    path = l2.segment_path(ns, str(tmp_path))
    _set_header_word(path, "DIRTY", 65)
    out = subprocess.run([sys.executable, "-m", "kvcomm", "purge", "--name", ns, "--config",
                          str(cfg_file)], capture_output=True, text=True, timeout=60)
    l2.purge(ns, str(tmp_path))
    assert out.returncode == 0, out.stderr


# ----------------------------------------------------------------------------- L3 records, key filter


def test_an_l3_record_with_a_huge_counter_does_not_wrap_the_hosts_write_sequence(
        cluster: object, store: object) -> None:
    """F (acknowledged writes lost, cluster mode): L3 accepts counters up to 2**64-1. A
    record (corrupt, hostile, or a bug elsewhere) whose vector names host-1 at 2**64-2,
    read once by an agent of host-1 (L3 fill → merge), raises host-1's write sequence to
    2**64-2: host-1's next dots are 2**64-1 (= NEW_DOT, the 'fresh dot' sentinel), then 0,
    1, 2... — every later write of every key on host-1 is older than the earlier ones, so
    L3's rule refuses it and other hosts never see it.

    Fixed by bounding counters at 2**53-1 (kvcomm.core.versions.MAX_COUNTER) where they
    enter: the push script refuses such a record, a reader refuses one written there by
    anything else (CorruptRecord), and L2 refuses a version or a write sequence past the
    bound (InvalidArgument). The reviewer's scenario then runs as before, with the poison
    written raw into Redis: the read raises CorruptRecord, and host-1's writes reach
    host-2."""
    from redis.cluster import RedisCluster as RC

    from kvcomm.core.versions import MAX_COUNTER
    from kvcomm.tiers.l3 import record_key
    from kvcomm.tiers.shm.segment import key_hash
    from tests.support.daemon_harness import remote_put

    h1 = Host(cluster, "host-1", seed=1)  # type: ignore[arg-type]
    h2 = Host(cluster, "host-2", seed=2)  # type: ignore[arg-type]
    rc = RC(host="127.0.0.1", port=cluster.ports[0])  # type: ignore[attr-defined]
    try:
        hostile = record(b"poison", "host-1", 2**64 - 2, 1)
        with pytest.raises(kvcomm.CorruptRecord):
            store.push("poison", hostile)  # type: ignore[attr-defined]
        # a valid record first (the key filters learn the key), then the poison over it,
        # written by something that is not KVCOMM
        remote_put(store, "poison", b"valid", "host-3", 1)  # type: ignore[arg-type]
        rc.set(record_key("poison"), hostile.encode())

        def refused() -> bool:
            try:
                h1.kv.get("poison")  # None until host-1's key filter has the key
            except kvcomm.CorruptRecord:
                return True
            return False

        wait_for(refused, 20, "host-1 reads the record from L3 and refuses it")
        before = h1.kv._seg.write_sequence
        assert before <= MAX_COUNTER
        huge = kvcomm.Version((("host-1", 2**64 - 2),), 1)
        with pytest.raises(kvcomm.InvalidArgument):
            h1.kv.merge_remote("poison", b"x", huge)
        kb = b"poison"
        with pytest.raises(kvcomm.InvalidArgument):
            h1.kv._seg.apply([(kb, key_hash(kb), 1, b"", b"x", 2**64 - 2, 1, b"")], now_ms=0)
        with pytest.raises(kvcomm.InvalidArgument):
            h1.kv._seg.raise_write_sequence(2**64 - 2)
        assert h1.kv._seg.write_sequence == before
        h1.kv.put("y", b"first")
        wait_for(lambda: h2.kv.get("y") == b"first", 20, "host-2 sees the first write")
        v2 = h1.kv.put("y", b"second (acknowledged)")
        assert all(0 < c <= MAX_COUNTER for _, c in v2.vector), v2
        wait_for(lambda: h2.kv.get("y") == b"second (acknowledged)", 20,
                 "host-2 sees the second write")
    finally:
        rc.close()
        h1.close()
        h2.close()


def test_a_small_bloom_fpr_does_not_break_every_cluster_miss(cluster: object) -> None:
    """F (crash with a non-KVCommError on every L2 miss): cache.bloom_fpr is valid for any
    0 < fpr < 1, but below ~5e-20 the filter's hash count k exceeds 64 and the C
    membership test (bloom_has) raises ValueError for every key the negative cache does
    not answer: kv.get of a missing key raises ValueError in every agent of the host.

    Fixed by refusing such a rate in the config (ConfigError naming cache.bloom_fpr); a
    rate just inside the bound (k = 63) answers a cluster miss."""
    from kvcomm.core.bloom import MAX_HASHES, optimal_params

    with pytest.raises(kvcomm.ConfigError, match="cache.bloom_fpr"):
        Host(cluster, "host-1", seed=1, bloom_fpr=1e-20, bloom_capacity=1000)  # type: ignore[arg-type]
    assert optimal_params(1000, 1e-19)[1] == MAX_HASHES - 1
    h1 = Host(cluster, "host-1", seed=1, bloom_fpr=1e-19, bloom_capacity=1000)  # type: ignore[arg-type]
    try:
        h1.kv.put("present", b"1")
        wait_for(lambda: h1.kv._key_filter() is not None, 20, "the key filter is trusted")
        assert h1.kv.get("absent/1") is None
        assert h1.kv.stats()["l3"]["filter_hits"] >= 1  # the filter answered it
    finally:
        h1.close()


def test_keyfilter_reader_refuses_a_hash_count_bloom_has_cannot_use(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same, without a cluster: a filter file whose header (capacity, fpr) gives k > 64.
    KeyFilter.create refuses such a geometry (InvalidArgument); a file made by a daemon
    that allowed it (MAX_HASHES raised here) is refused by the reader with SegmentError,
    not a ValueError at every membership test."""
    from kvcomm.tiers import keyfilter
    from kvcomm.tiers.keyfilter import KeyFilter

    with pytest.raises(kvcomm.InvalidArgument):
        KeyFilter.create("bf", 1000, 1e-20, directory=str(tmp_path))
    monkeypatch.setattr(keyfilter, "MAX_HASHES", 128)  # another KVCOMM's daemon
    w = KeyFilter.create("bf", 1000, 1e-20, directory=str(tmp_path))
    monkeypatch.undo()
    w.set_ready(True)
    w.beat()
    try:
        with pytest.raises(kvcomm.SegmentError, match="hash functions"):
            KeyFilter.open_reader("bf", directory=str(tmp_path))
    finally:
        w.close()


def test_rewriting_a_key_whose_l3_record_is_corrupt_is_not_silently_dropped(
        cluster: object, store: object) -> None:
    """F (acknowledged write lost, cluster mode): an L3 value that is not a KVCOMM record
    makes reads raise CorruptRecord "...; remove or rewrite the key". But rewriting it
    with kv.put is acknowledged and then dropped: the daemon's push gets CorruptRecord,
    delivery.Outbound answers CORRUPT with deliver=True (dirty flag cleared), the write
    goes to the quarantine list, L3 keeps the garbage and other hosts never see the
    write. Expected: the put reaches L3 (the Lua push replaces a foreign value), or the
    put raises, or the write stays dirty."""
    from redis.cluster import RedisCluster as RC

    from kvcomm.tiers.l3 import record_key

    h1 = Host(cluster, "host-1", seed=1)  # type: ignore[arg-type]
    try:
        port = cluster.ports[0]  # type: ignore[attr-defined]
        rc = RC(host="127.0.0.1", port=port)
        rc.set(record_key("k"), b"\xc1\xc1")  # not msgpack: a foreign/corrupt value
        with pytest.raises(kvcomm.CorruptRecord):
            store.get("k")  # type: ignore[attr-defined]
        h1.kv.put("k", b"rewritten, acknowledged")
        wait_for(lambda: h1.kv._seg.dirty_count == 0, 20, "the daemon handled the write")
        rec = store.get("k")  # type: ignore[attr-defined]
        assert rec is not None and rec.value == b"rewritten, acknowledged"
    finally:
        h1.close()


def test_a_key_filter_closed_by_another_thread_does_not_raise_valueerror(
        tmp_path: pathlib.Path, ns: str) -> None:
    """F (non-KVCommError, threads): ClusterReads._get_l3 takes kf = self._key_filter()
    and then calls kf.may_exist(). Another thread sharing the client that calls
    _key_filter() in between, when the filter just became untrusted (heartbeat stale,
    retired by a restarted daemon), closes that same KeyFilter; the first thread's
    may_exist then raises ValueError ("operation forbidden on released memoryview").
    The interleaving is replayed here step by step."""
    from kvcomm.tiers.keyfilter import KeyFilter

    raw = {"cache": {"l2_size": "16MB", "l2_dir": str(tmp_path)},
           "cluster": {"redis": ["127.0.0.1:1"]}, "node": {"host_id": "host-a"}}
    w = KeyFilter.create(ns, 1000, 0.01, directory=str(tmp_path))
    w.set_ready(True)
    w.beat()
    with kvcomm.open(ns, config=kvcomm.Config.from_mapping(raw), wait_daemon=False) as kv:
        kf = kv._key_filter()  # thread A, in _get_l3
        assert kf is not None
        w.set_ready(False)  # the daemon restarts (or stops beating)
        kv._kf_retry = 0.0
        kv._key_filter()  # thread B, in its own _get_l3: closes kf
        try:
            kf.may_exist(b"absent")  # thread A continues
        except kvcomm.KVCommError:
            pass
    w.close()
    l2.purge(ns, str(tmp_path))


@pytest.mark.parametrize("ext", [b"\x81\xa1a" + b"\xda\x13\x88" + b"x" * 5000,  # a 5000-byte map
                                 b"not msgpack"])
def test_an_l2_extension_l3_cannot_hold_is_refused_at_the_l2_boundary(
        cluster: object, store: object, ext: bytes) -> None:
    """F (design gap, minor today: only internal callers write ext): L2 stores any bytes as
    a record's extension (any size up to 4 GiB, not checked to be one msgpack map), the
    daemon pushes it, the Lua push accepts any string as `x` — and then every reader's
    L3Record.decode refuses the record (MAX_EXT 4096, map with str keys): the key raises
    CorruptRecord on every other host. Expected: L2Segment.apply (or ClientPort.dirty_record)
    refuses such an ext before it is acknowledged."""
    from kvcomm.tiers.shm.segment import key_hash

    h1 = Host(cluster, "host-1", seed=1)  # type: ignore[arg-type]
    h2 = Host(cluster, "host-2", seed=2)  # type: ignore[arg-type]
    try:
        kb = b"x/1"
        try:
            h1.kv._seg.apply([(kb, key_hash(kb), 1, b"", b"value", ext)], now_ms=0, dirty=True)
        except kvcomm.KVCommError:
            return  # refused at the boundary: fine
        wait_for(lambda: h1.kv._seg.dirty_count == 0, 20, "delivery")
        assert h2.kv.get("x/1") == b"value"
    finally:
        h1.close()
        h2.close()
