"""Bloom filter: no false negatives, the configured false-positive rate, union, bytes, rotation."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcomm.core.bloom import BloomFilter
from kvcomm.core.negative import NegativeCache
from tests.support.helpers import drawn_seed


@given(st.lists(st.binary(max_size=20), max_size=200))
def test_no_false_negatives(keys: list[bytes]) -> None:
    f = BloomFilter(max(1, len(keys)), 0.01)
    for k in keys:
        f.add(k)
    assert all(k in f for k in keys)


def test_measured_fpr_at_capacity() -> None:
    seed = drawn_seed(2**32)
    rng = random.Random(seed)
    f = BloomFilter(20_000, 0.001)
    for i in range(20_000):
        f.add(f"key-{i}".encode())
    trials = 200_000
    fp = sum(f"absent-{rng.random()}".encode() in f for _ in range(trials))
    # 200 false positives expected at 0.1%; the bound leaves room for sampling noise
    assert fp / trials <= 0.001 * 1.3, fp / trials


def test_union_and_bytes_roundtrip() -> None:
    a, b = BloomFilter(1000, 0.01), BloomFilter(1000, 0.01)
    a.add(b"x")
    b.add(b"y")
    a.union(b)
    assert b"x" in a and b"y" in a
    c = BloomFilter.from_bytes(a.to_bytes(), 1000, 0.01)
    assert b"x" in c and b"y" in c and c.adds == 2
    with pytest.raises(ValueError):
        a.union(BloomFilter(2000, 0.01))
    with pytest.raises(ValueError):
        BloomFilter.from_bytes(a.to_bytes(), 2000, 0.01)
    with pytest.raises(ValueError):
        BloomFilter.from_bytes(b"junk", 1000, 0.01)


def test_stable_across_instances() -> None:
    a, b = BloomFilter(100, 0.01), BloomFilter(100, 0.01)
    a.add(b"drone/7")
    assert a.to_bytes() != b.to_bytes()
    b.add(b"drone/7")
    assert a.to_bytes() == b.to_bytes()


def test_saturation_flag() -> None:
    f = BloomFilter(3, 0.01)
    for k in (b"a", b"b"):
        f.add(k)
    assert not f.saturated
    f.add(b"c")
    assert f.saturated


def test_negative_cache_ttl_invalidate_bound() -> None:
    n = NegativeCache(ttl=5.0, max_entries=2)
    n.note_absent("a", now=0.0)
    assert n.is_absent("a", now=4.9) and not n.is_absent("a", now=5.0)
    n.note_absent("a", now=10.0)
    n.invalidate("a")
    assert not n.is_absent("a", now=10.1)
    for k in ("x", "y", "z"):
        n.note_absent(k, now=20.0)
    assert len(n) == 2 and n.evictions == 1 and not n.is_absent("x", now=20.0)
    with pytest.raises(ValueError):
        NegativeCache(ttl=-1)
