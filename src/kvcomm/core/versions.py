"""Versions: per-key version vectors whose actors are hosts, and a hybrid logical clock.

Theory of operation
-------------------
Every write is stamped by the host that makes it with two things:

* a **version vector** entry ``host → counter``. The counter is the host's own write
  sequence (one per host, shared by every key on it, kept in the L2 header), so it is
  monotonic per actor as version vectors require, and it also names one write on the
  host uniquely, which is what ``expect=`` compares. Actors are hosts, not agents: the
  vector of a key stays as small as the number of hosts that ever wrote it.
* a **hybrid logical clock** timestamp: ``(physical_ms << 16) | logical``. It never goes
  backwards on a host even when the wall clock does (:func:`hlc_tick`), so
  last-writer-wins between concurrent writes is decided by it, then by host id.

This module is pure: the caller passes the time in.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

LOGICAL_BITS = 16
_LOGICAL_MASK = (1 << LOGICAL_BITS) - 1


class Ordering(enum.Enum):
    BEFORE = "before"
    AFTER = "after"
    EQUAL = "equal"
    CONCURRENT = "concurrent"


def hlc_tick(last: int, now_ms: int) -> int:
    """The next local HLC timestamp after ``last`` at wall time ``now_ms``; always > last."""
    physical = now_ms << LOGICAL_BITS
    return physical if physical > last else last + 1


def hlc_receive(last: int, remote: int, now_ms: int) -> int:
    """The local HLC after seeing a remote timestamp; > both ``last`` and ``remote``."""
    return max(hlc_tick(last, now_ms), remote + 1)


def hlc_millis(ts: int) -> int:
    """The physical part of an HLC timestamp, in milliseconds since the epoch."""
    return ts >> LOGICAL_BITS


class Version(NamedTuple):
    """The version of one stored value: a version vector and the HLC timestamp of the write.

    Equal versions name the same write. ``compare`` gives the causal order of two
    versions of the same key; ``<`` / ``>`` are "happened before/after" (a partial order:
    two concurrent versions are neither). Immutable and hashable (a NamedTuple: it is
    built on every put, and a frozen dataclass costs twice as much to make).
    """

    vector: tuple[tuple[str, int], ...]
    hlc: int

    def compare(self, other: Version) -> Ordering:
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


def compare_vectors(
    a: tuple[tuple[str, int], ...], b: tuple[tuple[str, int], ...]
) -> Ordering:
    """Causal order of two version vectors (sorted tuples of (actor, counter))."""
    da, db = dict(a), dict(b)
    a_ge = all(da.get(k, 0) >= v for k, v in db.items())
    b_ge = all(db.get(k, 0) >= v for k, v in da.items())
    if a_ge and b_ge:
        return Ordering.EQUAL
    if a_ge:
        return Ordering.AFTER
    if b_ge:
        return Ordering.BEFORE
    return Ordering.CONCURRENT


def merge_vectors(
    a: tuple[tuple[str, int], ...], b: tuple[tuple[str, int], ...]
) -> tuple[tuple[str, int], ...]:
    """Least upper bound of two version vectors."""
    out = dict(a)
    for k, v in b:
        if v > out.get(k, 0):
            out[k] = v
    return tuple(sorted(out.items()))
