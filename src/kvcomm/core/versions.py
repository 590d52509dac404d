"""Versions: per-key version vectors whose actors are hosts, dots, and a hybrid logical clock.

Theory of operation
-------------------
Every write is stamped by the host that makes it with:

* a **dot** ``(host, counter)``: the counter is the host's write sequence (one per host,
  shared by all its keys, kept in the L2 header), so a dot names exactly one write;
* the **version vector** of the key after that write: the vector of what the write
  replaced, with the host's entry raised to the new dot. The dot is the writer's entry.
* a **hybrid logical clock** timestamp ``(physical_ms << 16) | logical`` that never runs
  backwards on a host (:func:`hlc_tick`); last-writer-wins ties are broken by it, then by
  host id. The L2 kernel keeps each host's HLC in the segment header and stamps writes
  by the same rules in C (``hlc_next`` in ``_l2core_c/feed.c``: :func:`hlc_tick`; a
  versioned put with a fresh dot: :func:`hlc_receive`); ``tests/core/test_hlc.py`` holds the
  two to each other. Remote timestamps further ahead than ``cluster.max_clock_skew``
  are refused (:func:`hlc_receive` with ``max_skew_ms``) or, where a write must not be
  dropped, counted (:class:`SkewMonitor`). The physical time comes from the caller
  (``kvcomm.clock``: the wall clock, plus a test-only offset per host).

Why vectors with dots, and not full dotted version vector sets: the classic sibling
explosion that DVVs (Preguiça et al.) cure comes from actors that are *servers* writing
on behalf of many unsynchronised clients. KVCOMM's actors are hosts, and a host
serialises every write of a key through its L2 (linearizable on the host), so each
host's history of a key is a chain. Concurrency arises only *between* hosts. A plain
vector per value, plus the value's own dot, is therefore exact: a sibling is obsolete
iff its dot is covered by another sibling's vector (the DVV rule, :func:`add_sibling`),
and vectors stay as small as the number of hosts that wrote the key.

Bounding vectors (:func:`prune`) follows Riak's small/big/young/old settings, but ages
are those of *hosts* (their last lease activity, passed in), not of entries: a vector
with at most ``small`` entries is never pruned; above ``big`` entries, or for hosts idle
longer than ``old_ms``, the least recently active hosts are dropped — never one active
within ``young_ms``. Safety condition: pruning only removes information, so a pruned
newer version can look *concurrent* with an old one, never *older*; the conflict is then
resolved by HLC last-writer-wins, which picks the newer write as long as host clocks are
within ``old_ms`` of each other. No acknowledged write is lost to pruning.

Counters are bounded: 1..:data:`MAX_COUNTER` (2**53-1). A host's write sequence starts at
the wall clock in microseconds when its L2 segment is made (about 2**51 today, 2**53 in
the year 2255), so no real dot comes near it; the bound is where L3's push script (Lua
numbers are doubles) stops comparing counters exactly, and it keeps every host's
sequence far below the kernel's "fresh dot" sentinel (2**64-1) however it is raised.
A counter past it is refused where it enters: an L3 record (CorruptRecord), a version
given to ``merge_remote`` (InvalidArgument), an L2 write with a given version.

Everything here is pure: callers pass the time and the host activity in.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import msgpack

LOGICAL_BITS = 16
_LOGICAL_MASK = (1 << LOGICAL_BITS) - 1

Vector = tuple[tuple[str, int], ...]  # sorted by actor, counters in 1..MAX_COUNTER

#: The largest counter a dot or a vector entry may hold (see the module docstring).
MAX_COUNTER = (1 << 53) - 1


class Ordering(enum.Enum):
    """How two versions of a key are ordered causally (:meth:`Version.compare`)."""

    BEFORE = "before"
    AFTER = "after"
    EQUAL = "equal"
    CONCURRENT = "concurrent"


# ---------------------------------------------------------------- hybrid logical clock


def hlc_tick(last: int, now_ms: int) -> int:
    """The next local HLC timestamp after ``last`` at wall time ``now_ms``; always > last."""
    physical = now_ms << LOGICAL_BITS
    return physical if physical > last else last + 1


def hlc_receive(last: int, remote: int, now_ms: int, max_skew_ms: int | None = None) -> int:
    """The local HLC after seeing a remote timestamp; > both ``last`` and ``remote``.

    With ``max_skew_ms``, refuses a remote timestamp whose physical part is more than
    that far ahead of ``now_ms`` (its host's clock runs ahead, or it is corrupt: adopting
    it would drag this host's clock, and every last-writer-wins decision, into the
    future): raises :class:`ClockSkewError`, and the caller keeps ``last``.
    """
    if max_skew_ms is not None:
        ahead = hlc_ahead_ms(remote, now_ms)
        if ahead > max_skew_ms:
            raise ClockSkewError(ahead, max_skew_ms)
    return max(hlc_tick(last, now_ms), remote + 1)


def hlc_ahead_ms(remote: int, now_ms: int) -> int:
    """How many milliseconds the physical part of ``remote`` runs ahead of ``now_ms``
    (zero or negative: not ahead)."""
    return (remote >> LOGICAL_BITS) - now_ms


class ClockSkewError(ValueError):
    """A remote HLC timestamp is further ahead of the local clock than allowed
    (``cluster.max_clock_skew``). ``ahead_ms`` says by how much."""

    def __init__(self, ahead_ms: int, max_skew_ms: int) -> None:
        super().__init__(f"a remote timestamp is {ahead_ms} ms ahead of this host's clock, "
                         f"over cluster.max_clock_skew ({max_skew_ms} ms): check the hosts' "
                         "clock synchronisation (NTP)")
        self.ahead_ms, self.max_skew_ms = ahead_ms, max_skew_ms


class SkewMonitor:
    """Counts remote timestamps beyond ``max_skew_ms`` where refusing them is not an
    option (a remote write already acknowledged on its host must still be merged: it is
    kept, its timestamp adopted, and the skew counted and reported).

    Pure: the caller passes the local time. ``beyond`` counts offending timestamps,
    ``max_ahead_ms`` is the largest lead seen, ``last_ahead_ms`` the latest offender's.
    """

    __slots__ = ("max_skew_ms", "beyond", "max_ahead_ms", "last_ahead_ms")

    def __init__(self, max_skew_ms: int) -> None:
        self.max_skew_ms = max_skew_ms
        self.beyond = 0
        self.max_ahead_ms = 0
        self.last_ahead_ms = 0

    def observe(self, remote: int, now_ms: int) -> bool:
        """Note a remote timestamp seen at ``now_ms``; True when it is beyond the bound."""
        ahead = hlc_ahead_ms(remote, now_ms)
        if ahead <= self.max_skew_ms:
            return False
        self.beyond += 1
        self.last_ahead_ms = ahead
        self.max_ahead_ms = max(self.max_ahead_ms, ahead)
        return True


def hlc_millis(ts: int) -> int:
    """The physical part of an HLC timestamp, in milliseconds since the epoch."""
    return ts >> LOGICAL_BITS


# ---------------------------------------------------------------- vectors


def compare_vectors(a: Vector, b: Vector) -> Ordering:
    """Causal order of two version vectors (one pass over ``b``, one dict of ``a``)."""
    if a == b:
        return Ordering.EQUAL
    rest = dict(a)
    a_ge = b_ge = True
    for k, v in b:
        x = rest.pop(k, 0)
        if x < v:
            a_ge = False
        elif x > v:
            b_ge = False
    if rest:  # entries only a has (counters are > 0)
        b_ge = False
    if a_ge and b_ge:
        return Ordering.EQUAL
    if a_ge:
        return Ordering.AFTER
    if b_ge:
        return Ordering.BEFORE
    return Ordering.CONCURRENT


def merge_vectors(a: Vector, b: Vector) -> Vector:
    """Least upper bound of two version vectors."""
    if a == b or not b:
        return a
    if not a:
        return b
    out = dict(a)
    for k, v in b:
        if v > out.get(k, 0):
            out[k] = v
    return tuple(sorted(out.items()))


def vector_get(v: Vector, actor: str) -> int:
    for a, c in v:
        if a == actor:
            return c
    return 0


def with_dot(v: Vector, actor: str, counter: int) -> Vector:
    """``v`` with ``actor``'s entry set to ``counter`` (a new write by ``actor``)."""
    out = dict(v)
    out[actor] = counter
    return tuple(sorted(out.items()))


def counters_valid(v: Iterable[tuple[str, int]]) -> bool:
    """True when every entry of ``v`` is (a str actor, an int counter in 1..MAX_COUNTER).
    False, never an exception, for anything else (an entry that is not a pair, say)."""
    try:
        return all(type(a) is str and type(c) is int and 0 < c <= MAX_COUNTER for a, c in v)
    except (TypeError, ValueError):
        return False


def covers(v: Vector, dot: tuple[str, int]) -> bool:
    """True when the write named by ``dot`` happened before (or is) what ``v`` describes."""
    return vector_get(v, dot[0]) >= dot[1]


def prune(v: Vector, last_active_ms: Mapping[str, int], now_ms: int, *, keep: Iterable[str] = (),
          small: int = 8, big: int = 32, young_ms: int = 60_000,
          old_ms: int = 86_400_000) -> Vector:
    """Bound a vector's size (see the module docstring for the rule and its safety).

    ``last_active_ms`` maps hosts to their last activity (hosts missing from it count as
    inactive since time 0); ``keep`` names entries never to drop (the writer's own dot).
    """
    if len(v) <= small:
        return v
    protected = set(keep)

    def age(actor: str) -> int:
        return now_ms - last_active_ms.get(actor, 0)

    entries = sorted(v, key=lambda e: -age(e[0]))  # least recently active first
    out = dict(v)
    for actor, _ in entries:
        if len(out) <= small:
            break
        a = age(actor)
        if actor in protected or a < young_ms:
            continue
        if len(out) > big or a > old_ms:
            del out[actor]
    return tuple(sorted(out.items()))


# ---------------------------------------------------------------- the public version


class Version(NamedTuple):
    """The version of one stored value: a version vector and the HLC timestamp of the write.

    Equal versions name the same write. ``compare`` gives the causal order of two
    versions of the same key; ``<`` / ``>`` are "happened before/after" (a partial order:
    two concurrent versions are neither). Immutable and hashable (a NamedTuple: it is
    built on every put, and a frozen dataclass costs twice as much to make).
    """

    vector: Vector
    hlc: int

    def compare(self, other: Version) -> Ordering:
        """The causal order of this version against ``other`` (of the same key): BEFORE,
        AFTER, EQUAL or CONCURRENT (an :class:`Ordering`). Raises nothing."""
        return compare_vectors(self.vector, other.vector)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Version):
            return NotImplemented
        return self.compare(other) is Ordering.BEFORE

    def __gt__(self, other: object) -> bool:
        if not isinstance(other, Version):
            return NotImplemented
        return self.compare(other) is Ordering.AFTER

    def __le__(self, other: object) -> bool:
        if not isinstance(other, Version):
            return NotImplemented
        return self.compare(other) in (Ordering.BEFORE, Ordering.EQUAL)

    def __ge__(self, other: object) -> bool:
        if not isinstance(other, Version):
            return NotImplemented
        return self.compare(other) in (Ordering.AFTER, Ordering.EQUAL)

    def __str__(self) -> str:
        vv = ",".join(f"{a}:{c}" for a, c in self.vector)
        return f"v[{vv}]@{hlc_millis(self.hlc)}.{self.hlc & _LOGICAL_MASK}"


class Dotted(NamedTuple):
    """A sibling's version: its vector, the dot of the write that made it, its HLC."""

    vector: Vector
    dot: tuple[str, int]
    hlc: int


def as_sibling(vector: Vector, hlc: int, other: Vector) -> Dotted:
    """A version as a sibling of the concurrent ``other``: its dot is an entry ``other``
    has not seen (one always exists between concurrent versions — the real dot is among
    them), the greatest, so that every host picks the same one."""
    unseen = [e for e in vector if e[1] > vector_get(other, e[0])] or list(vector)
    actor, counter = max(unseen, key=lambda e: (e[1], e[0])) if unseen else ("", 0)
    return Dotted(vector, (actor, counter), hlc)


def add_sibling(siblings: list[Dotted], new: Dotted) -> list[Dotted]:
    """The sibling set after ``new`` arrives (the DVV rule; order of arrival is irrelevant).

    Siblings whose dot ``new`` covers are obsolete and dropped; ``new`` itself is dropped
    if an existing sibling covers its dot. Equal dots are the same write.
    """
    if any(s.dot == new.dot or covers(s.vector, new.dot) for s in siblings):
        return list(siblings)
    return [s for s in siblings if not covers(new.vector, s.dot)] + [new]


# ---------------------------------------------------------------- compact encoding


def encode_vector(v: Vector, hlc: int) -> bytes:
    """``[hlc, actor1, counter1, actor2, counter2, ...]`` as msgpack: ~3 bytes + actor
    name + 1-9 bytes per entry."""
    flat: list[object] = [hlc]
    for a, c in v:
        flat.append(a)
        flat.append(c)
    return msgpack.packb(flat)  # type: ignore[no-any-return]


def decode_vector(data: bytes) -> tuple[Vector, int]:
    """Inverse of :func:`encode_vector`. Raises ValueError on malformed input."""
    try:
        flat = msgpack.unpackb(data)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"malformed version: {exc}") from None
    if not isinstance(flat, list) or not flat or len(flat) % 2 != 1 or type(flat[0]) is not int:
        raise ValueError("malformed version")
    pairs = list(zip(flat[1::2], flat[2::2], strict=True))
    if not all(type(a) is str and type(c) is int and c > 0 for a, c in pairs):
        raise ValueError("malformed version entry")
    return tuple(sorted(pairs)), flat[0]


def encode_others(v: Vector, host: str) -> bytes:
    """The entries of hosts other than ``host``, as stored beside an L2 record (b"" if none)."""
    others = [(a, c) for a, c in v if a != host]
    return b"" if not others else msgpack.packb([x for pair in others for x in pair])


def decode_others(data: bytes) -> Vector:
    """Inverse of :func:`encode_others`. Raises ValueError on malformed input."""
    if not data:
        return ()
    try:
        flat = msgpack.unpackb(data)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"malformed version vector: {exc}") from None
    if not isinstance(flat, list) or len(flat) % 2:
        raise ValueError("malformed version vector")
    pairs = list(zip(flat[0::2], flat[1::2], strict=True))
    if not all(type(a) is str and type(c) is int and 0 < c < 1 << 64 for a, c in pairs):
        raise ValueError("malformed version vector entry")
    return tuple(sorted(pairs))
