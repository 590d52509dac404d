"""L2's memory follows its data: a namespace reserves (st_blocks) what it has held, not its
whole size at creation; and its slot table holds small keys until the heap's bytes, not the
slots, run out (tiers/shm/layout.py, "Reservation map"; README, Configuration)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import pytest

import kvcomm
from kvcomm.tiers import l2
from tests.support.helpers import mount_tmpfs


def _reserved(path: str) -> int:
    """Bytes of memory the file holds: its allocated blocks."""
    return os.stat(path).st_blocks * 512


@pytest.fixture
def shm64(tmp_path: pathlib.Path) -> Iterator[str]:
    """A 64 MB tmpfs: Docker's default /dev/shm."""
    yield from mount_tmpfs(tmp_path, "64m")


def test_a_default_namespace_reserves_what_it_holds_not_its_size(ns: str) -> None:
    """1 MB written, then overwritten 100 times, in a default (256 MB) namespace: at most
    16 MiB reserved (it was the whole 238 MiB at creation)."""
    cfg = kvcomm.Config.from_mapping({})
    with kvcomm.open(ns, config=cfg) as kv:
        path = kv._seg.path
        created = _reserved(path)
        assert created <= 12 << 20, created
        for i in range(101):
            kv.put("one-mb", bytes([i]) * (1 << 20))
        assert kv.get("one-mb") == bytes([100]) * (1 << 20)
        one = _reserved(path)
        assert one <= 16 << 20, one
        for _ in range(101):  # and 1 MB more as a thousand keys of 1 KiB (each key's slot
            for k in range(1000):  # page is reserved too: about a page a key)
                kv.put(f"kib/{k}", b"k" * 1024)
        held = _reserved(path)
        print(f"reserved: {created / 2**20:.1f} MiB at creation, {one / 2**20:.1f} MiB after "
              f"1 MB x 101, {held / 2**20:.1f} MiB after 1000 x 1 KiB x 101 more; "
              f"file {os.stat(path).st_size / 2**20:.1f} MiB")
        assert held <= 20 << 20, held
        info = kv._seg.info()
        assert info["reserved_bytes"] == held
        assert 2 << 20 <= info["used_bytes"] <= held
        assert kv._seg.check() == []


def test_the_defaults_work_in_a_64mb_shm(ns: str, shm64: str) -> None:
    """Docker's default --shm-size: a default namespace opens there and takes 20 MB; a
    second one opens beside it; `kvcomm info` shows memory reserved and used."""
    cfg = kvcomm.Config.from_mapping({"cache": {"l2_dir": shm64}})
    with pytest.warns(kvcomm.KVCommWarning, match="more than cache.l2_dir") as seen:
        kv, kv2 = kvcomm.open(ns, config=cfg), kvcomm.open(ns + "-2", config=cfg)
    assert len(seen) == 2  # (each said so once, when made: 256MB in a 64MB tmpfs)
    with kv, kv2:
        for i in range(200):
            kv.put(f"blob/{i}", bytes([i]) * 100_000)
        kv2.put("k", "v")
        assert [kv.get(f"blob/{i}") for i in range(200)] == \
            [bytes([i]) * 100_000 for i in range(200)]
        assert kv2.get("k") == "v"
        cfg_file = pathlib.Path(shm64).parent / "kvcomm.yaml"
        cfg_file.write_text(f"cache:\n  l2_dir: {shm64}\n")
        out = subprocess.run([sys.executable, "-m", "kvcomm", "info", "--name", ns,
                              "--config", str(cfg_file)], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out
        assert "MiB reserved of" in out.stdout and "in use" in out.stdout, out.stdout
        assert kv._seg.check() == []
    assert l2.purge(ns, shm64) and l2.purge(ns + "-2", shm64)


def _fill(kv: kvcomm.Client, n: int, value: bytes) -> dict[str, int]:
    for i in range(n):
        kv.put(f"key{i:07d}", value)
    return kv._seg.info()


def test_small_keys_are_held_until_the_heap_is_80_percent_full(ns: str) -> None:
    """Keys of 100-byte values (256-byte blocks) in a 16 MB namespace: none evicted until
    80% of the heap's bytes are in use (the slot table held 8,192 keys before)."""
    cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": "16MB", "l1_size": 0}})
    with kvcomm.open(ns, config=cfg) as kv:
        n = int(0.8 * kv._seg.layout.data_size / 256)
        info = _fill(kv, n, b"v" * 100)
        print(f"{n} keys: {info['entries']} held, {info['evictions']} evicted, "
              f"{info['used_bytes'] / info['data_bytes']:.1%} of the heap used")
        assert (info["entries"], info["evictions"]) == (n, 0)
        assert info["used_bytes"] >= 0.79 * info["data_bytes"]
        assert kv.get("key0000000") == b"v" * 100


def test_l2_keys_sizes_the_slot_table_for_tiny_keys(ns: str) -> None:
    """cache.l2_keys: 60,000 keys of 8-byte values (128-byte blocks) in 16 MB, none evicted;
    a table that cannot fit is a SegmentError naming the setting."""
    cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": "16MB", "l1_size": 0,
                                                "l2_keys": 60_000}})
    with kvcomm.open(ns, config=cfg) as kv:
        assert kv._seg.layout.n_slots >= 90_000
        info = _fill(kv, 60_000, b"12345678")
        assert (info["entries"], info["evictions"]) == (60_000, 0)
    too_many = kvcomm.Config.from_mapping({"cache": {"l2_size": "16MB", "l2_keys": 1 << 20}})
    with pytest.raises(kvcomm.SegmentError, match="cache.l2_keys"):
        kvcomm.open(ns + "-x", config=too_many)


@pytest.mark.slow
def test_600k_small_keys_in_the_default_namespace(ns: str) -> None:
    """The default 256 MB namespace holds 600,000 keys of 100-byte values, none evicted."""
    with kvcomm.open(ns, config=kvcomm.Config.from_mapping({"cache": {"l1_size": 0}})) as kv:
        info = _fill(kv, 600_000, b"v" * 100)
        print(f"600000 keys: {info['entries']} held, {info['evictions']} evicted, "
              f"{info['used_bytes'] / info['data_bytes']:.1%} of the heap used, "
              f"{info['reserved_bytes'] / 2**20:.1f} MiB reserved")
        assert (info["entries"], info["evictions"]) == (600_000, 0)
