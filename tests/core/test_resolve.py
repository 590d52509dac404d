"""Conflict resolution: the same winner everywhere, whatever the order; hooks by prefix."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvcomm
from kvcomm.core.resolve import PrefixTable, Sibling, lww_key, resolve
from kvcomm.core.versions import Dotted, Version

hosts = st.sampled_from(["a", "b", "c"])
siblings = st.lists(
    st.builds(lambda host, n, hlc, val: Sibling(val, Dotted(((host, n),), (host, n), hlc)),
              hosts, st.integers(1, 5), st.integers(0, 50), st.integers()),
    min_size=1, max_size=6, unique_by=lambda s: s.version.dot,
)


@given(siblings, st.randoms())
def test_lww_is_order_independent(sibs: list[Sibling[int]], rnd: random.Random) -> None:
    a = resolve(sibs)
    shuffled = list(sibs)
    rnd.shuffle(shuffled)
    b = resolve(shuffled)
    assert (a.value, a.vector, a.winner) == (b.value, b.vector, b.winner)


@given(siblings)
def test_winner_has_the_greatest_lww_key_and_vector_is_lub(sibs: list[Sibling[int]]) -> None:
    res = resolve(sibs)
    assert res.winner is not None
    live = [s for s in sibs if not any(
        t.version.dot != s.version.dot and dict(t.version.vector).get(s.version.dot[0], 0)
        >= s.version.dot[1] for t in sibs)]
    assert lww_key(res.winner) == max(lww_key(s.version) for s in live)
    for s in sibs:
        for host, n in s.version.vector:
            assert dict(res.vector)[host] >= n


def test_resolver_is_used_and_failures_fall_back() -> None:
    s1 = Sibling(1, Dotted((("a", 1),), ("a", 1), 10))
    s2 = Sibling(2, Dotted((("b", 1),), ("b", 1), 20))
    made = resolve([s1, s2], lambda live: sum(s.value for s in live))
    assert made.value == 3 and made.winner is None and made.vector == (("a", 1), ("b", 1))

    def boom(live: list[Sibling[int]]) -> int:
        raise RuntimeError("bad hook")

    fell = resolve([s1, s2], boom)
    assert fell.value == 2 and fell.fallback
    refused = resolve([s1, s2], lambda live: object(), lambda v: isinstance(v, int))
    assert refused.value == 2 and refused.fallback
    with pytest.raises(ValueError):
        resolve([])


def test_prefix_table_longest_wins() -> None:
    t: PrefixTable[str] = PrefixTable()
    assert not t and t.lookup("x") is None
    t.set("", "any")
    t.set("shelf/", "shelf")
    t.set("shelf/A/", "shelfA")
    assert (t.lookup("shelf/A/1"), t.lookup("shelf/B"), t.lookup("drone")) == ("shelfA", "shelf", "any")
    t.remove("shelf/A/")
    assert t.lookup("shelf/A/1") == "shelf"


# ---------------------------------------------------------------- through the public API


def remote(host: str, n: int, hlc: int) -> Version:
    return Version(((host, n),), hlc)


def test_merge_remote_newer_older_concurrent(kv: kvcomm.Client) -> None:
    v_local = kv.put("k", "local")
    # concurrent remote with an older HLC: LWW keeps the local value, vector merged
    stored = kv.merge_remote("k", "remote", remote("hostB", 3, 1))
    assert kv.get("k") == "local"
    assert dict(stored.vector) == {"local": dict(v_local.vector)["local"], "hostB": 3}
    # a remote version that descends from what is stored replaces it
    newer = Version(tuple(sorted(dict(stored.vector, hostB=4).items())), stored.hlc + 1)
    assert kv.merge_remote("k", "remote2", newer) == newer
    assert kv.get("k") == "remote2"
    # an older one is ignored
    assert kv.merge_remote("k", "stale", remote("hostB", 2, 10**15)) == newer
    assert kv.get("k") == "remote2"
    # a local write after the merge descends from it
    after = kv.put("k", "mine")
    assert after > newer


def test_concurrent_newer_hlc_wins_without_resolver(kv: kvcomm.Client) -> None:
    kv.put("k", "local")
    kv.merge_remote("k", "remote", remote("hostB", 1, 2**62))
    assert kv.get("k") == "remote"


def test_registered_resolver_merges_counters(kv: kvcomm.Client) -> None:
    seen: list[list[kvcomm.Item]] = []

    def add_counts(key: str, sibs: list[kvcomm.Item]) -> object:
        seen.append(sibs)
        return sum(s.value for s in sibs)

    kv.register_resolver("count/", add_counts)
    kv.put("count/x", 5)
    stored = kv.merge_remote("count/x", 7, remote("hostB", 1, 1))
    assert kv.get("count/x") == 12
    assert len(seen) == 1 and {s.value for s in seen[0]} == {5, 7}
    assert {s.tier for s in seen[0]} == {"l2", "l3"}
    assert dict(stored.vector)["hostB"] == 1 and dict(stored.vector)["local"] > 1


def test_raising_resolver_falls_back_to_lww_and_is_counted(kv: kvcomm.Client) -> None:
    kv.register_resolver("", lambda key, sibs: 1 / 0)
    kv.put("k", "local")
    kv.merge_remote("k", "remote", remote("hostB", 1, 2**62))
    assert kv.get("k") == "remote"
    kv.register_resolver("bad/", lambda key, sibs: object())  # not storable
    kv.put("bad/1", "local")
    kv.merge_remote("bad/1", "remote", remote("hostB", 1, 1))
    assert kv.get("bad/1") == "local"
    assert kv.stats()["ops"]["resolver_failures"] == 2


def test_register_errors(kv: kvcomm.Client) -> None:
    with pytest.raises(kvcomm.InvalidArgument):
        kv.register_resolver("x", 5)  # type: ignore[arg-type]
    with pytest.raises(kvcomm.InvalidKey):
        kv.register_resolver(3, lambda k, s: 1)  # type: ignore[arg-type]
    with pytest.raises(kvcomm.InvalidArgument):
        kv.merge_remote("k", 1, ("not", "a version"))  # type: ignore[arg-type]
