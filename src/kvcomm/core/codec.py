"""Value codec: Python value ⇄ (tag, meta bytes, payload buffer). Pure, no I/O.

Never pickle: every tag decodes to plain data, so nothing read from shared memory or
the network can make this process run code.

======  ==================================  ====================================
tag     values                              payload
======  ==================================  ====================================
BYTES   bytes, bytearray, memoryview        the bytes (comes back as ``bytes``)
STR     str                                 UTF-8
PACKED  None, bool, int, float, list,       msgpack (tuples come back as lists;
        tuple, dict with str keys, nested;  dict keys must be str; NumPy scalars
        NumPy bool/int/float scalars        come back as bool, int, float)
NDARRAY numpy.ndarray of a numeric dtype    raw C-order data; meta = msgpack
                                            [dtype.str, shape]
COUNTER a counter kv.incr keeps (read as    its state: :mod:`kvcomm.core.counter`
        its int)                            (per-actor counts, merged by maximum)
======  ==================================  ====================================

Small values are not compressed: ``FACTS.md`` measured 1 KiB of drone state shrinking
by 30% for more time than the copy it saves.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import msgpack

from ..errors import UnsupportedValue
from . import counter

BYTES = 1
STR = 2
PACKED = 3
NDARRAY = 4
COUNTER = 5  # written only by kv.incr (core/counter.py); decodes to its int

_NUMERIC_KINDS = frozenset("biufc")
_MAX_DEPTH = 64


def _numpy() -> Any:
    """NumPy when this process has imported it, else None: a value is a NumPy array or
    scalar only once numpy is imported, so the encoder never imports it to check. (numpy
    is optional; importing it costs a process that never stores an array ~90 ms at its
    first ``kvcomm.open`` and ~7,000 objects that every full garbage collection walks.)
    While another thread is importing numpy, its half-made module is in sys.modules:
    this waits for that import to end (the import lock) instead of using it."""
    np = sys.modules.get("numpy")
    if np is not None and getattr(getattr(np, "__spec__", None), "_initializing", False):
        import numpy as np
    return np


def _numpy_to_read() -> Any:
    """NumPy, imported now if need be (a value another process stored as an array is being
    read); UnsupportedValue saying what to install when it is not installed."""
    np = _numpy()
    if np is None:
        try:
            import numpy as np
        except ImportError:
            from .._extras import install_hint

            raise UnsupportedValue(f"this value is a numpy array: install numpy "
                                   f"({install_hint('numpy')}) to read it") from None
    return np


def _check_tree(value: Any, depth: int = 0) -> None:
    """Reject what msgpack would store but could not give back as the user gave it."""
    if depth > _MAX_DEPTH:
        raise UnsupportedValue(f"value nests deeper than {_MAX_DEPTH} levels; flatten it")
    t = type(value)
    if t is dict:
        for k, v in value.items():
            if type(k) is not str:
                raise UnsupportedValue(
                    f"dict keys must be str, got {type(k).__name__} key {k!r}; convert keys to str"
                )
            if type(v) in (dict, list, tuple):
                _check_tree(v, depth + 1)
            elif type(v) not in _SCALARS:
                _reject(v)
    elif t is list or t is tuple:
        for v in value:
            if type(v) in (dict, list, tuple):
                _check_tree(v, depth + 1)
            elif type(v) not in _SCALARS:
                _reject(v)


_SCALARS = frozenset({type(None), bool, int, float, str, bytes})


def _reject(value: Any) -> None:
    """Raise UnsupportedValue for ``value``, unless it is a NumPy bool, int or float
    scalar: those are stored as the Python number (``_number``, msgpack's ``default``)."""
    np = _numpy()
    if np is not None and isinstance(value, np.generic):
        _number(value)
        return
    if np is not None and isinstance(value, np.ndarray):
        raise UnsupportedValue("numpy arrays can only be stored as the whole value, not nested: "
                               "give the array a key of its own, or store arr.tolist()")
    raise UnsupportedValue(
        f"cannot store a value of type {type(value).__name__}: use bytes, str, int, float, "
        "bool, None, lists, dicts with str keys, or a numeric numpy array (values are never "
        "pickled)"
    )


def _number(value: Any) -> bool | int | float:
    """A NumPy bool, int or float scalar as the Python number (``np.float64`` -> float,
    ``np.int64`` -> int, ``np.bool_`` -> bool); UnsupportedValue for any other NumPy
    scalar (complex, long double, datetime, str...)."""
    np = _numpy()
    if np is not None and isinstance(value, np.bool_ | np.integer | np.floating):
        n: bool | int | float = value.item()
        if type(n) in (bool, int, float):
            return n
    raise UnsupportedValue(
        f"cannot store a numpy {type(value).__name__}: numpy bool, int and float scalars are "
        "stored as Python numbers; convert this one yourself (or store an array)")


try:  # (Packed's msgpack in C; the core also runs without the C kernel: the Python path)
    from .._l2core import pack_plain
except ImportError:  # pragma: no cover
    def pack_plain(fields: Any) -> bytes | None:
        return None

_local = threading.local()
_KEEP_PACKER = 1 << 16  # bytes: a thread's Packer is dropped after a larger value (its buffer)


def packb(value: Any) -> bytes:
    """``msgpack.packb(value, use_bin_type=True)`` (no checks: :func:`encode` checks
    first; raises what msgpack raises), with this thread's Packer (packb makes
    one per call: most of the time it takes for a small value). The Packer is taken out
    while it packs (a nested call, from a finalizer the collector runs mid-pack, makes its
    own) and put back only after a value of at most 64 KiB: a Packer keeps a buffer as
    large as the largest value it packed (bounded memory), and after a refused value
    nothing of it may stay in front of the next."""
    packer = _local.__dict__.pop("packer", None)
    if packer is None:
        packer = msgpack.Packer(use_bin_type=True, buf_size=4096)  # (it grows as needed;
        # msgpack's default reserves 256 KiB up front, kept per thread)
    out: bytes = packer.pack(value)
    if len(out) <= _KEEP_PACKER:
        _local.packer = packer
    return out


_PLAIN = (str, bytes, type(None))


class Packed:
    """A list of plain fields (str, bytes, None) with its msgpack encoding, made once by
    its caller (the LangGraph saver's records, re-sent on a retry): stored as the PACKED
    payload byte for byte, as :func:`encode` would store the list. The payload is always
    made here from the fields, never given: what is stored is what a validator sees
    (``value``), and it always decodes. Raises TypeError (not a list of plain fields),
    UnicodeEncodeError (a lone surrogate). Private to KVCOMM's own integrations."""

    __slots__ = ("payload", "value")

    def __init__(self, fields: list[str | bytes | None]) -> None:
        payload = pack_plain(fields)  # (in C: msgpack's bytes, or None: the checks below)
        if payload is None:
            if type(fields) is not list or any(type(x) not in _PLAIN for x in fields):
                raise TypeError("Packed holds a list of str, bytes and None fields")
            payload = packb(fields)  # (raises UnicodeEncodeError for a lone surrogate)
        self.value = fields
        self.payload = payload

    @classmethod
    def built(cls, value: dict[str, Any] | list[Any]) -> Packed:
        """``value`` packed as :func:`encode` would pack it, without its checks: for a
        value KVCOMM's own code built of str, int, None, and dicts and lists of them (the
        LangGraph saver's thread head, written at every step), never a caller's."""
        self = cls.__new__(cls)
        self.value = value  # type: ignore[assignment]
        self.payload = packb(value)
        return self


def is_text(s: str) -> bool:
    """Whether the str ``s`` encodes to UTF-8 (holds no lone surrogate)."""
    if s.isascii():  # (most: without making the bytes)
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _surrogate(exc: UnicodeEncodeError) -> UnsupportedValue:
    return UnsupportedValue(
        f"a str holds a lone surrogate ({exc.object[exc.start:exc.end]!r} at {exc.start}), "
        "which is not text in UTF-8, at the top level or nested alike: store it as bytes "
        "(s.encode('utf-8', 'surrogatepass')) or fix the text")


def encode(value: Any) -> tuple[int, bytes, bytes | memoryview]:
    """Return ``(tag, meta, payload)``. Raises UnsupportedValue; never mutates ``value``.

    NumPy bool, int and float scalars are stored as the Python number (they come back as
    ``bool``, ``int``, ``float``). A str with a lone surrogate is refused wherever it is
    (UTF-8 cannot hold it: every other reader, L3 and MCP included, would choke)."""
    t = type(value)
    if t is bytes:
        return BYTES, b"", value
    if t is str:
        try:
            return STR, b"", value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise _surrogate(exc) from None
    if t is bytearray:
        return BYTES, b"", bytes(value)
    if t is memoryview:
        return BYTES, b"", value.tobytes()
    if t is Packed:
        return PACKED, b"", value.payload
    if t in (dict, list, tuple):
        _check_tree(value)
    elif t not in _SCALARS:
        np = _numpy()
        if np is not None and isinstance(value, np.ndarray):
            return _encode_array(value)
        _reject(value)
        value = _number(value)  # (_reject returns only for a NumPy scalar)
    try:
        return PACKED, b"", packb(value)
    except TypeError:  # (a NumPy scalar nested: _check_tree let it through; the slow path)
        pass
    except UnicodeEncodeError as exc:
        raise _surrogate(exc) from None
    except (OverflowError, ValueError) as exc:
        raise _unencodable(exc) from None
    try:
        return PACKED, b"", msgpack.packb(value, use_bin_type=True, default=_number)
    except UnicodeEncodeError as exc:
        raise _surrogate(exc) from None
    except (OverflowError, ValueError, TypeError) as exc:
        raise _unencodable(exc) from None


def _unencodable(exc: BaseException) -> UnsupportedValue:
    if isinstance(exc, OverflowError) or "out of range" in str(exc):
        return UnsupportedValue(
            f"cannot encode value: an int in it is outside msgpack's range, -2**63 to 2**64-1 "
            f"({exc}); store such a number as a str (str(n), and int() when read)")
    return UnsupportedValue(f"cannot encode value: {exc}")


def _encode_array(arr: Any) -> tuple[int, bytes, memoryview]:
    if arr.dtype.kind not in _NUMERIC_KINDS or arr.dtype.hasobject:
        raise UnsupportedValue(
            f"numpy dtype {arr.dtype} is not numeric; store bool/int/uint/float/complex arrays"
        )
    if not arr.flags.c_contiguous:  # (ascontiguousarray would turn 0-d into 1-d)
        arr = arr.copy(order="C")
    meta = msgpack.packb([arr.dtype.str, list(arr.shape)])
    if arr.size == 0:  # (memoryview cannot cast an empty array of several dimensions)
        return NDARRAY, meta, memoryview(b"")
    return NDARRAY, meta, memoryview(arr).cast("B")


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code}, which KVCOMM never writes")


def decode(tag: int, meta: bytes, payload: bytes | memoryview) -> Any:
    """Decode a copied payload. Raises ValueError on anything malformed."""
    if tag == BYTES:
        return bytes(payload)
    if tag == STR:
        return bytes(payload).decode("utf-8", "surrogatepass")
    if tag == PACKED:
        try:
            # (msgpack's extension types: encode never writes one, so one read is someone
            # else's bytes: refused (_no_ext), not handed on as an ExtType; the timestamp
            # extension, which msgpack decodes itself before any hook, comes back as its
            # integer nanoseconds, a type kv.put takes, not a msgpack.Timestamp)
            return msgpack.unpackb(payload, raw=False, strict_map_key=False, ext_hook=_no_ext,
                                   timestamp=2)
        except (TypeError, ValueError, msgpack.UnpackException) as e:  # e.g. an unhashable map key
            raise ValueError(f"malformed packed value: {e}") from None
    if tag == COUNTER:
        return counter.value(counter.decode(payload))
    if tag == NDARRAY:
        arr = array_view(meta, payload)
        out = arr.copy()
        return out
    raise ValueError(f"unknown value tag {tag}")


_HEADERS: dict[bytes, tuple[Any, tuple[int, ...]]] = {}  # parsed array headers, bounded


def _array_header(meta: bytes) -> tuple[Any, tuple[int, ...]]:
    hdr = _HEADERS.get(meta)
    if hdr is None:
        np = _numpy_to_read()
        try:
            dtype_str, shape = msgpack.unpackb(meta, raw=False)
            if type(dtype_str) is not str or type(shape) is not list:
                raise ValueError("malformed array header")
            # a corrupt header can name anything; numpy raises TypeError/ValueError
            dtype = np.dtype(dtype_str)
        except (TypeError, ValueError, msgpack.UnpackException) as e:
            raise ValueError(f"malformed array header: {e}") from None
        if dtype.kind not in _NUMERIC_KINDS or not all(type(n) is int and n >= 0 for n in shape):
            raise ValueError("malformed array header")
        hdr = (dtype, tuple(shape))
        if len(_HEADERS) > 4096:
            _HEADERS.clear()
        _HEADERS[meta] = hdr
    return hdr


def array_view(meta: bytes, payload: bytes | memoryview) -> Any:
    """A read-only ndarray over ``payload`` (no copy). Raises ValueError if malformed."""
    np = _numpy_to_read()
    dtype, shape = _array_header(meta)
    mv = payload if isinstance(payload, memoryview) else memoryview(payload)
    if not mv.readonly:
        mv = mv.toreadonly()
    # frombuffer keeps the read-only memoryview as the base, so WRITEABLE can never be
    # switched back on (np.ndarray(buffer=...) would expose the writable mapping)
    arr = np.frombuffer(mv, dtype=dtype)
    return arr if len(shape) == 1 else arr.reshape(shape)
