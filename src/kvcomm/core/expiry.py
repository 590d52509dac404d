"""Per-key expiry: the deadline in a record's extension field, and the rules around it.

A key written with ``ttl=`` carries its deadline — absolute, in epoch seconds (a float) —
in the record's extension field (:mod:`kvcomm.core.ext`) under the key ``"e"``, so the
deadline is part of the record: it travels with the record to L3 and to every host's L2,
and merges with it under the version rules. A record whose deadline the clock has passed
is a tombstone at the record's version: every read treats it as absent; a later write (a
higher version) wins over it, and an older write replayed later loses to it, exactly as
against a delete. Reclaiming its space (L2's sweep, L3's script) changes nothing a reader
can see.

The C kernel reads the same field (``_l2core_c/read.c`` ``ext_deadline``) without
allocating, and L3's push script with Redis's cmsgpack; all three read a field the same
way (readers that disagreed would find a key expired for one and live for
another): any map header, the key ``"e"`` in any str encoding, the last ``"e"`` when it
repeats, any integer or float encoding, and anything else (a malformed field, bytes after
the map, a value that is not a number above 0 and below 1e300) as no deadline. Pure: the
clock is always passed in.
"""

from __future__ import annotations

import math
import numbers
import struct
from typing import Any

import msgpack

from ..errors import InvalidArgument

DEADLINE_KEY = "e"  # the deadline (epoch seconds), in a record's extension map
MAX_TTL = 10 * 365 * 86400.0  # ten years: longer is a mistake (ms against s), not a TTL
_F64 = struct.Struct(">d")
_MAX_EXT = 4096


def check_ttl(ttl: Any, *, allow_none: bool = True) -> float | None:
    """``ttl`` as float seconds (None stays None when ``allow_none``).

    Raises InvalidArgument (nothing is written) unless ``ttl`` is a real number (an int or
    float, NumPy's included; not a bool), finite, above 0 and at most ten years
    (``MAX_TTL``, 315,360,000 s).
    """
    if ttl is None and allow_none:
        return None
    if type(ttl) not in (int, float) and (isinstance(ttl, bool)
                                          or not isinstance(ttl, numbers.Real)):
        # (NumPy's ints and floats are numbers.Real, its bool is not)
        raise InvalidArgument(
            f"ttl is seconds as an int or float (such as 2.5; at most {MAX_TTL:.0f} s, ten "
            f"years), or None for a key that never expires; got {type(ttl).__name__}: {_short(ttl)}")
    try:
        t = float(ttl)
    except (OverflowError, ValueError, TypeError):  # (an int past float's range: 10**400)
        t = math.inf
    if not math.isfinite(t) or t <= 0 or t > MAX_TTL:
        raise InvalidArgument(
            f"ttl must be finite, above 0 and at most {MAX_TTL:.0f} s (ten years); got "
            f"{_short(ttl)}: "
            "to remove a key now use delete(), for a key that never expires pass ttl=None")
    return t


def _short(value: Any) -> str:
    r = repr(value)
    return r if len(r) <= 40 else r[:30] + f"... ({len(r)} characters)"


def deadline_of(ext: bytes) -> float | None:
    """The deadline in a packed extension field (b"": none), or None. Never raises: a
    field that is not a readable map, or an ``"e"`` that is not a positive finite number,
    is no deadline (as the C reader decides)."""
    if not ext or len(ext) > _MAX_EXT:
        return None
    if ext[0] & 0xF0 != 0x80 and ext[0] not in (0xDE, 0xDF):
        return None
    try:
        m = msgpack.unpackb(ext, raw=False, strict_map_key=False, max_str_len=_MAX_EXT,
                            max_bin_len=_MAX_EXT, max_array_len=_MAX_EXT,
                            max_map_len=_MAX_EXT, max_ext_len=0)
    except Exception:  # written by something else: no deadline of ours
        return None
    if type(m) is not dict:
        return None
    d: Any = m.get(DEADLINE_KEY)
    if type(d) not in (int, float) or not (0 < d < 1e300):  # (NaN fails the comparison)
        return None
    return float(d)


def with_deadline(ext: bytes, deadline: float | None) -> bytes:
    """The extension field ``ext`` (b"": none) with its deadline set to ``deadline`` (None:
    removed); the map's other keys are kept. Packed as a float64, as the C reader expects."""
    m: dict[Any, Any] = {}
    if ext:
        try:
            got = msgpack.unpackb(ext, raw=False, strict_map_key=False)
        except Exception:
            got = None
        if isinstance(got, dict):
            m = got
    m.pop(DEADLINE_KEY, None)
    if deadline is not None:
        m[DEADLINE_KEY] = float(deadline)
    if not m:
        return b""
    return msgpack.packb(m, use_bin_type=True, use_single_float=False)  # type: ignore[no-any-return]


class ExtCache:
    """``with_deadline(base, d)`` for one client's fixed ``base`` field, without unpacking
    it on every write: the base map's entries are kept packed and the deadline appended.
    A base that is not a small map (fixmap) goes through :func:`with_deadline`."""

    __slots__ = ("base", "_head", "_body")

    def __init__(self, base: bytes) -> None:
        self.base = base
        n = base[0] & 0x0F if base and base[0] & 0xF0 == 0x80 else -1
        if base and n >= 0 and deadline_of(base) is None and n < 15:
            self._head: int | None = 0x80 | (n + 1)
            self._body = base[1:]
        elif not base:
            self._head, self._body = 0x81, b""
        else:
            self._head, self._body = None, b""

    def ext(self, deadline: float | None) -> bytes:
        """The field to write: ``base`` with ``deadline`` (None: ``base`` itself)."""
        if deadline is None:
            return self.base
        if self._head is None:
            return with_deadline(self.base, deadline)
        return bytes((self._head,)) + self._body + b"\xa1e\xcb" + _F64.pack(float(deadline))


def expired(deadline: float | None, now: float) -> bool:
    """Whether a record with ``deadline`` (None or 0: none) is expired at ``now``: at the
    deadline itself it is."""
    return bool(deadline) and deadline <= now  # type: ignore[operator]
