"""The write-coalescing window: never drops a key's last write, never exceeds its bounds."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcomm.core.versions import Ordering, compare_vectors
from kvcomm.core.window import ClosedWindow, WriteWindow

ops = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c", "d", "e"]),
              st.none() | st.binary(max_size=40), st.integers(1, 50),
              st.floats(0, 0.02)),
    max_size=200,
)


@given(ops, st.integers(1, 6), st.integers(20, 400))
def test_last_write_per_key_survives_and_bounds_hold(stream: list, max_ops: int,
                                                     max_bytes: int) -> None:
    w = WriteWindow(interval=0.05, max_ops=max_ops, max_bytes=max_bytes)
    now = 0.0
    batches: list[ClosedWindow] = []
    last: dict[str, bytes | None] = {}
    for key, value, counter, dt in stream:
        now += dt
        b = w.add(key, value, (("h", counter),), counter, now)
        last[key] = value
        if b:
            batches.append(b)
        b = w.poll(now)
        if b:
            batches.append(b)
        assert len(w) <= max_ops
        assert w.pending_bytes <= max_bytes + 41 + 1
    final = w.flush(now)
    if final:
        batches.append(final)
    # replaying the batches in order gives the last write of every key
    replay: dict[str, bytes | None] = {}
    for b in batches:
        assert b.ops_out <= b.ops_in and b.bytes_out <= b.bytes_in
        assert len({x.key for x in b.writes}) == b.ops_out
        for x in b.writes:
            replay[x.key] = x.value
    assert replay == last
    assert sum(b.ops_in for b in batches) == len(stream)


def test_versions_merge_and_tombstones_stay() -> None:
    w = WriteWindow(interval=1.0)
    w.add("k", b"1", (("a", 1),), 10, 0.0)
    w.add("k", b"2", (("b", 1),), 5, 0.1)
    w.add("k", None, (("a", 2),), 7, 0.2)
    b = w.flush(0.3)
    assert b is not None and b.ops_in == 3 and b.ops_out == 1
    x = b.writes[0]
    assert x.tombstone and x.hlc == 10
    assert compare_vectors(x.vector, (("a", 2), ("b", 1))) is Ordering.EQUAL


def test_window_closes_on_time_and_size() -> None:
    w = WriteWindow(interval=0.05, max_ops=3)
    assert w.add("a", b"x", (), 1, 0.0) is None
    assert w.deadline() == 0.05
    assert w.poll(0.049) is None
    b = w.poll(0.05)
    assert b is not None and [x.key for x in b.writes] == ["a"]
    assert w.deadline() is None and w.poll(10.0) is None
    w.add("a", b"x", (), 1, 1.0)
    w.add("b", b"x", (), 1, 1.0)
    full = w.add("c", b"x", (), 1, 1.0)
    assert full is not None and full.ops_out == 3
    with pytest.raises(ValueError):
        WriteWindow(interval=0)
