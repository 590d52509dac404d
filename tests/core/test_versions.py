"""Properties of version vectors and the hybrid logical clock."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvcomm.core.versions import (
    Ordering,
    Version,
    compare_vectors,
    hlc_receive,
    hlc_tick,
    merge_vectors,
)

actors = st.sampled_from(["h1", "h2", "h3", "h4"])
vectors = st.dictionaries(actors, st.integers(1, 50), max_size=4).map(
    lambda d: tuple(sorted(d.items()))
)


@given(vectors, vectors)
def test_merge_commutative(a: tuple, b: tuple) -> None:  # type: ignore[type-arg]
    assert merge_vectors(a, b) == merge_vectors(b, a)


@given(vectors, vectors, vectors)
def test_merge_associative(a: tuple, b: tuple, c: tuple) -> None:  # type: ignore[type-arg]
    assert merge_vectors(merge_vectors(a, b), c) == merge_vectors(a, merge_vectors(b, c))


@given(vectors)
def test_merge_idempotent(a: tuple) -> None:  # type: ignore[type-arg]
    assert merge_vectors(a, a) == a


@given(vectors, vectors)
def test_compare_agrees_with_merge(a: tuple, b: tuple) -> None:  # type: ignore[type-arg]
    m = merge_vectors(a, b)
    order = compare_vectors(a, b)
    if order is Ordering.EQUAL:
        assert dict(a) == dict(b)
    elif order is Ordering.AFTER:
        assert m == a
    elif order is Ordering.BEFORE:
        assert m == b
    else:
        assert m != a and m != b
    assert compare_vectors(m, a) in (Ordering.AFTER, Ordering.EQUAL)
    assert compare_vectors(m, b) in (Ordering.AFTER, Ordering.EQUAL)


@given(st.lists(st.integers(0, 2**40), min_size=1, max_size=50))
def test_hlc_monotonic_under_any_clock_steps(wall: list[int]) -> None:
    last = 0
    for now in wall:
        nxt = hlc_tick(last, now)
        assert nxt > last
        last = nxt


@given(st.integers(0, 2**50), st.integers(0, 2**50), st.integers(0, 2**40))
def test_hlc_receive_exceeds_both(last: int, remote: int, now: int) -> None:
    out = hlc_receive(last, remote, now)
    assert out > last and out > remote


def test_version_is_hashable_and_ordered() -> None:
    a = Version((("h1", 1),), 10)
    b = Version((("h1", 2),), 11)
    c = Version((("h2", 1),), 12)
    assert a < b and b > a and a <= a and not (a < c) and not (c < a)
    assert a.compare(c) is Ordering.CONCURRENT
    assert len({a, b, Version((("h1", 1),), 10)}) == 2


# ---------------------------------------------------------------- dots, encoding, pruning

from kvcomm.core.versions import (  # noqa: E402
    Dotted,
    add_sibling,
    decode_others,
    decode_vector,
    encode_others,
    encode_vector,
    prune,
    with_dot,
)


@given(vectors, st.integers(0, 2**63))
def test_encoding_roundtrips(v: tuple, hlc: int) -> None:  # type: ignore[type-arg]
    assert decode_vector(encode_vector(v, hlc)) == (v, hlc)


@given(vectors)
def test_others_roundtrip(v: tuple) -> None:  # type: ignore[type-arg]
    assert decode_others(encode_others(v, "h1")) == tuple(e for e in v if e[0] != "h1")


def test_malformed_encodings_raise() -> None:
    import pytest

    for bad in [b"", b"\xc1", encode_vector((("a", 1),), 1)[:-1], b"\x92\x01\x02"]:
        with pytest.raises(ValueError):
            decode_vector(bad)


def test_encoded_size_is_compact() -> None:
    v = tuple((f"host-{i:02d}", 1000 + i) for i in range(16))
    assert len(encode_vector(v, 1 << 56)) < 16 * 12 + 16


def _history(ops: list[tuple[str, str, int]]) -> list[Dotted]:
    """Writes of a causally consistent history: each host writes on top of what it has
    seen (its own writes and what it synced from others)."""
    seen: dict[str, tuple] = {h: () for h in ("h1", "h2", "h3")}  # type: ignore[type-arg]
    writes: list[Dotted] = []
    for op, host, other_or_hlc in ops:
        if op == "write":
            n = dict(seen[host]).get(host, 0) + 1
            seen[host] = with_dot(seen[host], host, n)
            writes.append(Dotted(seen[host], (host, n), other_or_hlc))
        else:
            other = ("h1", "h2", "h3")[other_or_hlc % 3]
            seen[host] = merge_vectors(seen[host], seen[other])
    return writes


histories = st.lists(
    st.tuples(st.sampled_from(["write", "sync"]), st.sampled_from(["h1", "h2", "h3"]),
              st.integers(0, 50)),
    max_size=20,
).map(_history)


@given(histories, st.randoms())
def test_sibling_set_is_order_independent(sibs: list[Dotted], rnd: object) -> None:
    a: list[Dotted] = []
    for s in sibs:
        a = add_sibling(a, s)
    shuffled = list(sibs)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    b: list[Dotted] = []
    for s in shuffled:
        b = add_sibling(b, s)
    assert {s.dot for s in a} == {s.dot for s in b}
    for x in a:  # what remains is pairwise concurrent
        for y in a:
            assert x is y or not (x.dot[1] <= dict(y.vector).get(x.dot[0], 0))


@given(st.dictionaries(st.text(min_size=1, max_size=4), st.integers(1, 99), max_size=60),
       st.dictionaries(st.text(min_size=1, max_size=4), st.integers(0, 10**7), max_size=60),
       st.integers(8, 20), st.integers(0, 10))
def test_prune_bounds_and_safety(entries: dict[str, int], active: dict[str, int],
                                 big: int, small: int) -> None:
    v = tuple(sorted(entries.items()))
    now = 10**7
    keep = [v[0][0]] if v else []
    out = prune(v, active, now, keep=keep, small=small, big=big, young_ms=1000, old_ms=10**6)
    assert set(out) <= set(v)  # only removes
    if len(v) <= small:
        assert out == v
    assert all(e in out for e in v if e[0] in keep)
    young = [e for e in v if now - active.get(e[0], 0) < 1000]
    assert all(e in out for e in young)
    assert len(out) <= max(small, big, len(young) + len(keep))
    # safety: pruning never makes the pruned vector look newer than the original
    assert compare_vectors(out, v) in (Ordering.BEFORE, Ordering.EQUAL)
