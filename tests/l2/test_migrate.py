"""A segment of an older layout is never silently purged: opening it names its unflushed
writes, `kvcomm purge` refuses it, `kvcomm migrate` carries its writes into a new segment.

The fixture ``tests/support/data/segment-layout2.bin.gz`` is a real segment written by KVCOMM's
layout 2 (the release before the L2 hardening; commit 968a585's parent) in cluster mode,
as host "host-a": four dirty records (drone/1/pos overwritten once, drone/2/pos a msgpack
map, shelf/7 a str, arr a numpy array) and one clean record merged from "host-b".
"""

from __future__ import annotations

import gzip
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
import yaml

import kvcomm
from kvcomm.core.versions import Version, vector_get
from kvcomm.tiers import l2
from kvcomm.tiers.shm import migrate as mig
from tests.support import DATA
from tests.support.daemon_harness import Host, record, shared_cluster_fixture, store_fixture  # noqa: F401
from tests.support.helpers import wait_for

FIXTURE = DATA / "segment-layout2.bin.gz"
DIRTY = {"drone/1/pos": b"\x01\x03", "drone/2/pos": {"x": 1.5, "y": [1, 2]},
         "shelf/7": "str value ✓"}


def _old_segment(tmp_path: pathlib.Path, ns: str, fixture: pathlib.Path
                 ) -> Iterator[tuple[str, pathlib.Path, kvcomm.Config]]:
    """An older layout's segment (``fixture``, gzipped) in a private /dev/shm stand-in,
    with a cluster config of host-a to migrate it under; purged afterwards."""
    shm = tmp_path / "shm"
    shm.mkdir()
    seg = shm / f"kvcomm.{ns}"
    seg.write_bytes(gzip.decompress(fixture.read_bytes()))
    os.chmod(seg, 0o600)
    raw = {"cache": {"l2_size": "16MB", "l2_dir": str(shm)},
           "cluster": {"redis": ["127.0.0.1:1"]}, "node": {"host_id": "host-a"}}
    cfg_file = tmp_path / "host.yaml"
    cfg_file.write_text(yaml.safe_dump(raw))
    yield ns, cfg_file, kvcomm.Config.from_mapping(raw)
    l2.purge(ns, str(shm))


@pytest.fixture
def old(tmp_path: pathlib.Path, ns: str) -> Iterator[tuple[str, pathlib.Path, kvcomm.Config]]:
    yield from _old_segment(tmp_path, ns, FIXTURE)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvcomm", *args], capture_output=True,
                          text=True, timeout=120)


def _open_local(ns: str, cfg: kvcomm.Config) -> kvcomm.Client:
    # embedded view of the same segment (no L3 reads): what this host holds
    raw = cfg.model_dump()
    raw["cluster"]["redis"] = []
    return kvcomm.open(ns, config=kvcomm.Config.model_validate(raw))


def test_the_layout2_reader_finds_exactly_the_unflushed_writes(old: tuple[str, pathlib.Path,
                                                                          kvcomm.Config]) -> None:
    ns, _, cfg = old
    got = mig.unflushed(l2.segment_path(ns, cfg.cache.l2_dir), 0o600)
    assert got is not None
    version, host, records = got
    assert (version, host) == (2, "host-a")
    assert sorted(r.key.decode() for r in records) == ["arr", "drone/1/pos", "drone/2/pos", "shelf/7"]
    assert all(r.dirty and r.counter > 0 for r in records)


def test_opening_an_old_segment_names_its_unflushed_writes(old: tuple[str, pathlib.Path,
                                                                      kvcomm.Config]) -> None:
    ns, _, cfg = old
    with pytest.raises(kvcomm.SegmentError, match=r"4 writes not yet in L3.*kvcomm migrate"):
        kvcomm.open(ns, config=cfg)


def test_purge_refuses_an_old_segment_with_unflushed_writes_unless_forced(
        old: tuple[str, pathlib.Path, kvcomm.Config]) -> None:
    ns, cfg_file, cfg = old
    path = l2.segment_path(ns, cfg.cache.l2_dir)
    out = _cli("purge", "--name", ns, "--config", str(cfg_file))
    assert out.returncode == 2, out
    assert "4 writes" in out.stderr and "kvcomm migrate" in out.stderr
    assert os.path.exists(path)  # nothing was removed
    with pytest.raises(kvcomm.UnflushedWrites):
        l2.purge(ns, cfg.cache.l2_dir, keep_unflushed=True)
    out = _cli("purge", "--name", ns, "--config", str(cfg_file), "--force")
    assert out.returncode == 0, out
    assert not os.path.exists(path)


def test_migrate_carries_every_unflushed_write_with_its_version(
        old: tuple[str, pathlib.Path, kvcomm.Config]) -> None:
    ns, cfg_file, cfg = old
    before = {r.key.decode(): r for r in mig.unflushed(
        l2.segment_path(ns, cfg.cache.l2_dir), 0o600)[2]}  # type: ignore[index]
    out = _cli("migrate", "--name", ns, "--config", str(cfg_file))
    assert out.returncode == 0, out
    assert "4 writes carried" in out.stdout and "from layout 2" in out.stdout
    with _open_local(ns, cfg) as kv:
        for key, value in DIRTY.items():
            item = kv.get_item(key)
            assert item is not None and item.value == value
            # the same dot: L3's merge weighs it as the write it was
            assert vector_get(item.version.vector, "host-a") == before[key].counter
            assert item.version.hlc == before[key].hlc
        assert np.array_equal(kv.get("arr"), np.arange(10, dtype="<i4"))
        assert kv.get("remote/1") is None  # clean: L3 has it; not carried
        assert kv._seg.dirty_count == 4  # the daemon delivers them
        assert kv._seg.write_sequence >= max(r.counter for r in before.values())
        assert kv._seg.check() == []
    # nothing left to do, and the aside file is gone
    out = _cli("migrate", "--name", ns, "--config", str(cfg_file))
    assert out.returncode == 0 and "nothing to migrate" in out.stdout
    assert not os.path.exists(mig.aside_path(l2.segment_path(ns, cfg.cache.l2_dir), 2))
    # a purge now refuses the new segment too: its writes are still not in L3
    out = _cli("purge", "--name", ns, "--config", str(cfg_file))
    assert out.returncode == 2 and "4 writes not yet in L3" in out.stderr


def test_a_migration_that_died_halfway_is_finished_and_newer_writes_win(
        old: tuple[str, pathlib.Path, kvcomm.Config]) -> None:
    ns, _, cfg = old
    path = l2.segment_path(ns, cfg.cache.l2_dir)
    os.rename(path, mig.aside_path(path, 2))  # as if migrate died right after its rename
    with _open_local(ns, cfg) as kv:  # an agent of the new version meanwhile
        kv.put("shelf/7", "written after the upgrade")
    done = mig.migrate(ns, cfg)
    assert (done.carried, done.superseded, done.from_version) == (3, 1, 2)
    with _open_local(ns, cfg) as kv:
        assert kv.get("shelf/7") == "written after the upgrade"
        assert kv.get("drone/1/pos") == b"\x01\x03"
    assert not os.path.exists(mig.aside_path(path, 2))


def test_migrate_under_another_host_id_keeps_the_old_hosts_entry(
        old: tuple[str, pathlib.Path, kvcomm.Config]) -> None:
    ns, _, cfg = old
    raw = cfg.model_dump()
    raw["node"]["host_id"] = "host-z"
    done = mig.migrate(ns, kvcomm.Config.model_validate(raw))
    assert done.carried == 4
    with _open_local(ns, kvcomm.Config.model_validate(raw)) as kv:
        item = kv.get_item("shelf/7")
        assert item is not None and vector_get(item.version.vector, "host-a") > 0


def test_a_corrupt_old_segment_is_refused_not_misread(
        old: tuple[str, pathlib.Path, kvcomm.Config]) -> None:
    ns, _, cfg = old
    path = l2.segment_path(ns, cfg.cache.l2_dir)
    data = bytearray(pathlib.Path(path).read_bytes())
    data[24:32] = (1 << 40).to_bytes(8, "little")  # the slot count, far past the file
    pathlib.Path(path).write_bytes(bytes(data))
    with pytest.raises(kvcomm.SegmentError, match="corrupt"):
        mig.unflushed(path, 0o600)
    with pytest.raises(kvcomm.SegmentError, match="corrupt"):
        mig.migrate(ns, cfg)
    assert os.path.exists(mig.aside_path(path, 2)) or os.path.exists(path)  # kept


# ---------------------------------------------------------------- layout 3 → 4
# ``tests/support/data/segment-layout3.bin.gz`` is a real segment written by KVCOMM's layout 3 (the
# layout before the metrics region; commit 6a53a04) in cluster mode, as host "host-a": five
# dirty records (drone/1/pos overwritten once, drone/2/pos a msgpack map, shelf/7 a str,
# arr a numpy array, robot/3 with an extension field {"agent": "r3"}) and one clean record
# merged from "host-b" (remote/1, extension {"a": "agent-9"}).
FIXTURE3 = DATA / "segment-layout3.bin.gz"


@pytest.fixture
def old3(tmp_path: pathlib.Path, ns: str) -> Iterator[tuple[str, pathlib.Path, kvcomm.Config]]:
    yield from _old_segment(tmp_path, ns, FIXTURE3)


def test_the_layout3_reader_finds_exactly_the_unflushed_writes_with_their_extension(
        old3: tuple[str, pathlib.Path, kvcomm.Config]) -> None:
    ns, _, cfg = old3
    got = mig.unflushed(l2.segment_path(ns, cfg.cache.l2_dir), 0o600)
    assert got is not None
    version, host, records = got
    assert (version, host) == (3, "host-a")
    by_key = {r.key.decode(): r for r in records}
    assert sorted(by_key) == ["arr", "drone/1/pos", "drone/2/pos", "robot/3", "shelf/7"]
    assert by_key["robot/3"].ext == msgpack.packb({"agent": "r3"})
    assert by_key["shelf/7"].ext == b"" and by_key["drone/1/pos"].value == b"\x01\x03"


def test_opening_a_layout3_segment_names_its_unflushed_writes(
        old3: tuple[str, pathlib.Path, kvcomm.Config]) -> None:
    ns, _, cfg = old3
    with pytest.raises(kvcomm.SegmentError, match=r"layout version 3.*5 writes not yet in L3"):
        kvcomm.open(ns, config=cfg)


def test_migrate_from_layout3_carries_values_versions_and_extensions(
        old3: tuple[str, pathlib.Path, kvcomm.Config]) -> None:
    ns, cfg_file, cfg = old3
    before = {r.key.decode(): r for r in mig.unflushed(
        l2.segment_path(ns, cfg.cache.l2_dir), 0o600)[2]}  # type: ignore[index]
    out = _cli("migrate", "--name", ns, "--config", str(cfg_file))
    assert out.returncode == 0, out
    assert "5 writes carried" in out.stdout and "from layout 3" in out.stdout
    with _open_local(ns, cfg) as kv:
        for key, value in {**DIRTY, "robot/3": b"claimed"}.items():
            item = kv.get_item(key)
            assert item is not None and item.value == value, key
            assert vector_get(item.version.vector, "host-a") == before[key].counter
            assert item.version.hlc == before[key].hlc
        assert np.array_equal(kv.get("arr"), np.arange(10, dtype="<i4"))
        kb = b"robot/3"
        assert kv._seg.version(kb, l2.key_hash(kb))[7] == msgpack.packb({"agent": "r3"})
        assert kv.get("remote/1") is None  # clean: L3 has it; not carried
        assert kv._seg.dirty_count == 5
        assert kv._seg.check() == []


# ---------------------------------------------------------------- layouts 4 and 5 → now
# ``tests/support/data/segment-layout4.bin.gz`` is a real segment written by KVCOMM's layout 4 (the
# layout before the expiry hint; commit e07be59) in cluster mode, as host "host-a": five
# dirty records (drone/1/pos overwritten once, drone/2/pos a msgpack map, shelf/7 a str,
# arr a numpy array, robot/3 with a deadline about 9.5 years after it was written).
# ``tests/support/data/segment-layout5.bin.gz`` holds the same records written by layout 5 (the
# layout before the reservation map; commit db0892c).
FIXTURES = {v: DATA / f"segment-layout{v}.bin.gz"
            for v in (4, 5)}


@pytest.fixture(params=sorted(FIXTURES))
def old45(request: pytest.FixtureRequest, tmp_path: pathlib.Path, ns: str
          ) -> Iterator[tuple[int, str, pathlib.Path, kvcomm.Config]]:
    for ns_, cfg_file, cfg in _old_segment(tmp_path, ns, FIXTURES[request.param]):
        yield request.param, ns_, cfg_file, cfg


def test_migrate_carries_writes_and_deadlines(
        old45: tuple[int, str, pathlib.Path, kvcomm.Config]) -> None:
    layout, ns, cfg_file, cfg = old45
    path = l2.segment_path(ns, cfg.cache.l2_dir)
    got = mig.unflushed(path, 0o600)
    assert got is not None
    version, host, records = got
    assert (version, host) == (layout, "host-a")
    before = {r.key.decode(): r for r in records}
    assert sorted(before) == ["arr", "drone/1/pos", "drone/2/pos", "robot/3", "shelf/7"]
    with pytest.raises(kvcomm.SegmentError,
                       match=rf"layout version {layout}.*5 writes not yet in L3"):
        kvcomm.open(ns, config=cfg)
    out = _cli("migrate", "--name", ns, "--config", str(cfg_file))
    assert out.returncode == 0, out
    assert "5 writes carried" in out.stdout and f"from layout {layout}" in out.stdout
    with _open_local(ns, cfg) as kv:
        for key, value in {**DIRTY, "robot/3": b"claimed"}.items():
            item = kv.get_item(key)
            assert item is not None and item.value == value, key
            assert vector_get(item.version.vector, "host-a") == before[key].counter
        assert np.array_equal(kv.get("arr"), np.arange(10, dtype="<i4"))
        robot = kv.get_item("robot/3")
        assert robot is not None and robot.expires_at is not None
        assert robot.expires_at > 2.0e9  # the deadline carried, not dropped
        assert kv._seg.dirty_count == 5
        assert kv._seg.check() == []
        assert os.stat(path).st_blocks * 512 < os.stat(path).st_size  # the new one: sparse


def test_migrate_does_not_drop_an_unflushed_write_for_an_older_clean_copy(
        old: tuple[str, pathlib.Path, kvcomm.Config]) -> None:
    """F (acknowledged write lost): migrate skips an old dirty record whenever the new
    segment holds the key at all ("a write made after the upgrade: newer"). But the new
    segment also fills with L3's *older* copies: an agent's L2-miss read, the daemon's
    prewarm of hot keys, a pulled change — clean records. Here the new segment holds a
    clean, causally older copy of drone/1/pos (host-a's previous write, as L3 has it);
    migrate counts the dirty newer write "superseded", drops it, and the new segment keeps
    the old value, clean: the daemon never pushes the acknowledged write.
    (found in review 8: data)"""
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
    dot from the vector.
    (found in review 8: data)"""
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


def test_migrate_after_a_crash_keeps_writes_the_daemon_prewarmed_over(
        cluster: object, store: object) -> None:
    """F (acknowledged write lost, real cluster): the same loss, end to end. host-a had
    written drone/1/pos twice: the first write reached L3 (and the hot-key list the daemon
    saves), the second was still dirty when host-a was upgraded. `kvcomm migrate` died
    right after renaming the old segment aside (nothing else knows the aside file: open,
    info, the daemon all carry on). The node daemon restarts on the fresh segment and
    prewarms its hot keys from L3 — the *first* write, clean. Rerunning migrate then
    counts the second write "superseded" and deletes the aside file: L3 and every host
    keep the first write for ever.
    (found in review 8: data)"""
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
