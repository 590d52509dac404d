"""The L2 segment as a file: permissions, foreign/stale/corrupt segments, purge, eviction."""

from __future__ import annotations

import os
import random
import stat

import pytest

import kvcomm
from kvcomm.tiers import l2


def test_segment_is_owner_only(kv: kvcomm.Client) -> None:
    mode = os.stat(kv._seg.path).st_mode
    assert stat.S_IMODE(mode) == 0o600


def test_foreign_file_refused(ns: str, config: kvcomm.Config) -> None:
    path = l2.segment_path(ns)
    with open(path, "wb") as f:
        f.write(os.urandom(8192))
    with pytest.raises(kvcomm.SegmentError, match="foreign"):
        kvcomm.open(ns, config=config)
    assert os.path.getsize(path) == 8192  # untouched


def test_never_initialised_file_refused(ns: str, config: kvcomm.Config) -> None:
    with open(l2.segment_path(ns), "wb") as f:
        f.write(b"\0" * 8192)
    with pytest.raises(kvcomm.SegmentError, match="never initialised"):
        kvcomm.open(ns, config=config)


def test_other_layout_version_refused(ns: str, config: kvcomm.Config) -> None:
    with kvcomm.open(ns, config=config) as kv:
        kv.put("k", 1)
        kv._seg._q[l2.H_LAYOUT] = l2.LAYOUT_VERSION + 1
    with pytest.raises(kvcomm.SegmentError, match="layout version"):
        kvcomm.open(ns, config=config)


def test_inconsistent_header_refused(ns: str, config: kvcomm.Config) -> None:
    with kvcomm.open(ns, config=config) as kv:
        kv._seg._q[l2.H_NSLOTS] = 1000  # not a power of two
    with pytest.raises(kvcomm.SegmentError, match="corrupt"):
        kvcomm.open(ns, config=config)


def test_bad_namespace_names(config: kvcomm.Config) -> None:
    for name in ["", "../etc", "a/b", "x" * 65]:
        with pytest.raises(kvcomm.SegmentError):
            kvcomm.open(name, config=config)


def test_purge_while_open(ns: str, config: kvcomm.Config) -> None:
    kv = kvcomm.open(ns, config=config)
    kv.put("k", 1)
    assert l2.purge(ns) is True
    with pytest.raises(kvcomm.SegmentError, match="purged"):
        kv.put("k", 2)
    kv.close()
    assert l2.purge(ns) is False
    with kvcomm.open(ns, config=config) as kv2:
        assert kv2.get("k") is None


def test_full_segment_evicts_clean_entries(ns: str) -> None:
    cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": "4MB"}})
    with kvcomm.open(ns, config=cfg) as kv:
        for i in range(4000):
            kv.put(f"k{i}", b"x" * 2000)
        info = kv._seg.info()
        assert info["evictions"] > 0
        assert kv.get("k3999") == b"x" * 2000  # the newest survives
        assert kv._seg.check() == []


def test_random_ops_match_a_model(ns: str, config: kvcomm.Config) -> None:
    seed = random.randrange(2**32)
    print(f"seed={seed}")
    rng = random.Random(seed)
    model: dict[str, object] = {}
    with kvcomm.open(ns, config=config) as kv:
        for _ in range(5000):
            k = f"k{rng.randrange(300)}"
            op = rng.random()
            if op < 0.5:
                v = rng.choice([b"x" * rng.randrange(3000), rng.randrange(10**6), "s" * 10])
                kv.put(k, v)
                model[k] = v
            elif op < 0.7:
                assert kv.delete(k) == (k in model)
                model.pop(k, None)
            else:
                assert kv.get(k) == model.get(k)
        assert kv._seg.check() == []
        for k, v in model.items():
            assert kv.get(k) == v
        assert kv._seg.info()["evictions"] == 0


def test_recovery_rebuilds_a_consistent_heap(ns: str, config: kvcomm.Config) -> None:
    with kvcomm.open(ns, config=config) as kv:
        for i in range(500):
            kv.put(f"k{i}", b"v" * (i * 7))
        for i in range(0, 500, 3):
            kv.delete(f"k{i}")
        seg = kv._seg
        seg._q[l2.H_BUSY] = 1  # as if a writer died mid-operation
        kv.put("after", 1)  # the next writer recovers first
        assert seg.info()["recoveries"] == 1
        assert seg.check() == []
        assert all(kv.get(f"k{i}") == b"v" * (i * 7) for i in range(500) if i % 3)
