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
