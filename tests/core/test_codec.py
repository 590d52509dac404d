"""Property tests of the value codec: what goes in comes out (tuples as lists)."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcomm.core import codec
from kvcomm.errors import UnsupportedValue

scalars = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False) | st.text() | st.binary()
)
trees = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=30,
)


def roundtrip(value: Any) -> Any:
    tag, meta, payload = codec.encode(value)
    return codec.decode(tag, meta, bytes(payload))


@given(trees)
def test_trees_roundtrip(value: Any) -> None:
    assert roundtrip(value) == value


@given(st.lists(st.integers(0, 10), max_size=4).map(tuple))
def test_tuples_come_back_as_lists(value: tuple[int, ...]) -> None:
    assert roundtrip(value) == list(value)


@given(st.binary())
def test_bytes_like(value: bytes) -> None:
    assert roundtrip(bytearray(value)) == value
    assert roundtrip(memoryview(value)) == value


@pytest.mark.parametrize("dtype", ["u1", "i4", "<f8", "f4", "c16", "bool", ">i8"])
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 4), (2, 3, 4)])
def test_arrays_roundtrip(dtype: str, shape: tuple[int, ...]) -> None:
    arr = (np.arange(int(np.prod(shape))) % 3).astype(dtype).reshape(shape)
    out = roundtrip(arr)
    assert out.dtype == arr.dtype and out.shape == arr.shape
    assert np.array_equal(out, arr)


def test_non_contiguous_array_is_stored_contiguous() -> None:
    arr = np.arange(20).reshape(4, 5)[:, ::2]
    assert np.array_equal(roundtrip(arr), arr)


@pytest.mark.parametrize(
    "value",
    [np.array(["a", "b"]), np.array([object()]), {"x": np.arange(3)}, [np.arange(2)],
     {1: 2}, object(), {1.5}, 2**64],
)
def test_rejected(value: Any) -> None:
    with pytest.raises(UnsupportedValue):
        codec.encode(value)


def test_view_is_read_only() -> None:
    tag, meta, payload = codec.encode(np.arange(4.0))
    view = codec.array_view(meta, bytearray(payload))
    with pytest.raises(ValueError):
        view[0] = 1
    with pytest.raises(ValueError):
        view.flags.writeable = True


def test_malformed_payloads_raise_value_error() -> None:
    with pytest.raises(ValueError):
        codec.decode(99, b"", b"")
    with pytest.raises(ValueError):
        codec.array_view(codec.encode(np.arange(2))[1].replace(b"<i8", b"|O8"), b"\0" * 16)


@pytest.mark.parametrize(
    "tag,meta,payload",
    [
        # found by the segment fuzzer (seed 20261130, case 5085): a flipped dtype byte
        (codec.NDARRAY, msgpack.packb(["<f_", [3]]), b"\0" * 8),
        (codec.NDARRAY, msgpack.packb([1, [3]]), b"\0" * 8),
        (codec.NDARRAY, msgpack.packb(["<i8", 3]), b"\0" * 8),
        (codec.NDARRAY, b"\xc1", b"\0" * 8),
        (codec.NDARRAY, msgpack.packb(["<i8", [3]]), b"\0" * 7),
        # a map whose key is a list: msgpack raises TypeError (unhashable)
        (codec.PACKED, b"", b"\x81\x92\x01\x02\x03"),
        (codec.PACKED, b"", b"\xc1"),
        # msgpack extension types, which encode never writes: someone else's bytes
        (codec.PACKED, b"", msgpack.packb(msgpack.ExtType(5, b"abc"))),
        (codec.PACKED, b"", msgpack.packb({"a": [1, msgpack.ExtType(7, b"")]})),
        (codec.PACKED, b"", b"\xd4\xff\x00"),  # a timestamp extension of a bad length
    ],
)
def test_corrupt_bytes_raise_value_error_only(tag: int, meta: bytes, payload: bytes) -> None:
    # the L2 read path turns ValueError into CorruptRecord; anything else would escape
    with pytest.raises(ValueError):
        codec.decode(tag, meta, payload)


@given(st.lists(trees, min_size=1, max_size=4))
def test_a_refused_value_leaves_the_next_encoding_whole(values: list[Any]) -> None:
    """The codec reuses one msgpack Packer per thread: a value refused halfway through
    (a lone surrogate deep in a list, an int over 64 bits) must not leave its bytes in
    front of the next value's."""
    for value in values:
        for bad in (["ok" * 50, {"k": "\ud800"}], [b"x" * 300, 2**70]):
            with pytest.raises(UnsupportedValue):
                codec.encode(bad)
            assert roundtrip(value) == value
            tag, _meta, payload = codec.encode(value)
            if tag == codec.PACKED:
                assert payload == msgpack.packb(value, use_bin_type=True)


def test_threads_encoding_at_once_each_get_their_own_bytes() -> None:
    """One Packer per thread: 8 threads encoding different values at once."""
    import threading

    errors: list[str] = []

    def work(n: int) -> None:
        value = [n, "x" * n, {"n": [n] * (n % 7)}]
        want = msgpack.packb(value, use_bin_type=True)
        for _ in range(2000):
            if codec.encode(value)[2] != want:
                errors.append(f"thread {n} got another value's bytes")
                return

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@given(st.lists(st.one_of(st.text(), st.binary(), st.none()), max_size=8))
def test_a_packed_value_is_stored_as_its_payload(value: Any) -> None:
    """codec.Packed (a list of plain fields, encoded once by an integration): stored as
    encode would store the list, under the PACKED tag; it reads back as the value."""
    try:
        packed = codec.Packed(value)
    except UnicodeEncodeError:  # (a lone surrogate: refused, as encode refuses it)
        return
    tag, meta, out = codec.encode(packed)
    assert (tag, meta, bytes(out)) == (codec.PACKED, b"", msgpack.packb(value, use_bin_type=True))
    assert codec.encode(value)[2] == out
    assert codec.decode(tag, meta, bytes(out)) == value


_EDGES = (0, 1, 15, 16, 31, 32, 255, 256, 65535, 65536)  # msgpack's length formats change here


@given(st.lists(st.one_of(
    st.none(),
    st.builds(lambda n, c: c * n, st.sampled_from(_EDGES), st.sampled_from(["a", "é", "\U0001f600"])),
    st.builds(lambda n: b"\xc1" * n, st.sampled_from(_EDGES)),
    st.text(), st.binary()), max_size=20), st.sampled_from([0, 1, 16, 65536]))
def test_pack_plain_is_msgpacks_bytes(fields: list[Any], more: int) -> None:
    """Packed's encoder in C (_l2core.pack_plain) makes msgpack's bytes exactly, for every
    length format of the array, str and bin (lengths at each format's edges)."""
    from kvcomm._l2core import pack_plain
    fields = fields + [None] * more  # (arrays of 16 and 65,536+ fields: array16, array32)
    try:
        want = msgpack.packb(fields, use_bin_type=True)
    except UnicodeEncodeError:
        assert pack_plain(fields) is None  # (a lone surrogate: the Python path refuses it)
        return
    assert pack_plain(fields) == want


def test_pack_plain_takes_only_a_list_of_plain_fields() -> None:
    from kvcomm._l2core import pack_plain
    for bad in (("x",), [1], [True], [["x"]], [bytearray(b"x")], ["\ud800"], "x", None,
                [type("S", (str,), {})("x")]):
        assert pack_plain(bad) is None, bad


def test_a_packed_value_takes_no_payload_and_only_plain_fields() -> None:
    """Its payload is made from its fields, never given (a given one could be anything a
    validator never saw, or undecodable), and only a list of str/bytes/None is one."""
    with pytest.raises(TypeError):
        codec.Packed(["x"], b"\xc1")  # type: ignore[call-arg]
    for bad in (("x",), [1], [["x"]], {"x": 1}, "x"):
        with pytest.raises(TypeError):
            codec.Packed(bad)  # type: ignore[arg-type]


def test_a_thread_keeps_no_packer_buffer_after_a_large_value() -> None:
    """The per-thread Packer's buffer grows to the largest value it packed: after a value
    over 64 KiB (or a refused one) the thread drops it, so what a thread keeps is bounded."""
    codec.encode([1, 2])
    assert hasattr(codec._local, "packer")
    big = [b"x" * (1 << 17)]
    assert roundtrip(big) == big
    assert not hasattr(codec._local, "packer")
    codec.encode([1, 2])
    with pytest.raises(UnsupportedValue):
        codec.encode(["\ud800"])
    assert not hasattr(codec._local, "packer")
    assert roundtrip([1, 2]) == [1, 2]


def test_a_threads_packer_keeps_a_small_buffer() -> None:
    """msgpack's Packer reserves 256 KiB up front unless told otherwise: kept per thread,
    1,000 agent threads that ever encoded a value would keep 250 MiB. packb's Packer
    starts small and grows as a value needs (found by the adversary's review)."""
    import threading
    import tracemalloc

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        done = threading.Event()
        ready = threading.Barrier(33)

        def work() -> None:
            codec.packb({"a": 1})
            ready.wait()
            done.wait()

        ts = [threading.Thread(target=work) for _ in range(32)]
        for t in ts:
            t.start()
        ready.wait()
        per_thread = (tracemalloc.get_traced_memory()[0] - base) / 32
        done.set()
        for t in ts:
            t.join()
    finally:
        tracemalloc.stop()
    assert per_thread <= 16_384, f"{per_thread / 1024:.0f} KiB per thread"


def test_a_planted_extension_type_reads_as_an_error_and_a_timestamp_as_its_nanoseconds(
        ) -> None:
    """A value of the L2 or L3 is decoded by the codec; encode refuses msgpack's extension
    types (ExtType, Timestamp), so one read back was written by someone else: refused
    (ValueError: the read path's CorruptRecord/SegmentError), never handed to the caller
    as an object kv.put would refuse. msgpack decodes its timestamp extension itself,
    before any hook: it comes back as its integer nanoseconds, a value kv.put takes."""
    for value in (msgpack.ExtType(5, b"abc"), msgpack.Timestamp(1, 0)):
        with pytest.raises(UnsupportedValue):
            codec.encode(value)
    with pytest.raises(ValueError, match="extension type 5"):
        codec.decode(codec.PACKED, b"", msgpack.packb([1, msgpack.ExtType(5, b"abc")]))
    got = codec.decode(codec.PACKED, b"", msgpack.packb([1, msgpack.Timestamp(2, 5)]))
    assert got == [1, 2_000_000_005] and type(got[1]) is int
