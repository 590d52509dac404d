"""Conflict resolution and the prefix table that routes keys to application hooks. Pure.

Rule (the same on every host, whatever order siblings arrive in):

1. obsolete siblings are dropped first (a sibling whose dot another covers: see
   :func:`kvcomm.core.versions.add_sibling`);
2. of the concurrent rest, an application resolver registered for the key's longest
   matching prefix produces the value; if there is none, or it raises, or it returns a
   value that cannot be stored, **last writer wins**: the greatest HLC timestamp, then the
   greatest dot (host id, counter) — a total order, so every host picks the same winner;
3. the result's vector is the least upper bound of all siblings' vectors. A value the
   resolver *made* is a new write and gets a new dot from the host that stores it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, NamedTuple, TypeVar

from .versions import Dotted, Ordering, Vector, add_sibling, compare_vectors, merge_vectors

T = TypeVar("T")
V = TypeVar("V")


class Sibling(NamedTuple, Generic[V]):
    value: V
    version: Dotted


class Resolution(NamedTuple, Generic[V]):
    value: V
    vector: Vector  # LUB of every sibling's vector
    winner: Dotted | None  # the LWW winner's version; None when a resolver made the value
    fallback: bool  # True when a resolver failed and LWW decided instead


def lww_key(version: Dotted) -> tuple[int, str, int]:
    """The total order of last-writer-wins: HLC, then host id, then counter."""
    return (version.hlc, version.dot[0], version.dot[1])


def concurrent_set(siblings: Iterable[Sibling[V]]) -> list[Sibling[V]]:
    """The siblings that are not obsolete, in a canonical order (by LWW key)."""
    by_dot: dict[tuple[str, int], Sibling[V]] = {}
    live: list[Dotted] = []
    for s in siblings:
        by_dot.setdefault(s.version.dot, s)
        live = add_sibling(live, s.version)
    return sorted((by_dot[d.dot] for d in live), key=lambda s: lww_key(s.version))


def resolve(siblings: Iterable[Sibling[V]],
            resolver: Callable[[list[Sibling[V]]], V] | None = None,
            acceptable: Callable[[V], bool] = lambda v: True) -> Resolution[V]:
    """One winner for a key's siblings. Raises ValueError on an empty set.

    ``resolver`` gets the concurrent siblings (canonical order) when there are two or
    more; ``acceptable`` vets what it returns (e.g. "can the codec store it").
    """
    live = concurrent_set(siblings)
    if not live:
        raise ValueError("resolve() needs at least one sibling")
    vector: Vector = ()
    for s in live:
        vector = merge_vectors(vector, s.version.vector)
    if len(live) > 1 and resolver is not None:
        try:
            made = resolver(live)
            if acceptable(made):
                return Resolution(made, vector, None, False)
        except Exception:  # an application hook must never crash a host
            pass
        winner = live[-1]
        return Resolution(winner.value, vector, winner.version, True)
    winner = live[-1]
    return Resolution(winner.value, vector, winner.version, False)


class PrefixTable(Generic[T]):
    """Hooks by key prefix; the longest matching prefix wins. '' matches every key."""

    def __init__(self) -> None:
        self._hooks: dict[str, T] = {}
        self._memo: dict[str, T | None] = {}

    def __bool__(self) -> bool:
        return bool(self._hooks)

    def set(self, prefix: str, hook: T) -> None:
        self._hooks[prefix] = hook
        self._memo.clear()

    def remove(self, prefix: str) -> None:
        self._hooks.pop(prefix, None)
        self._memo.clear()

    def lookup(self, key: str) -> T | None:
        try:
            return self._memo[key]
        except KeyError:
            pass
        best: str | None = None
        for prefix in self._hooks:
            if key.startswith(prefix) and (best is None or len(prefix) > len(best)):
                best = prefix
        hook = None if best is None else self._hooks[best]
        if len(self._memo) > 65536:
            self._memo.clear()
        self._memo[key] = hook
        return hook


# ---------------------------------------------------------------- the L3 rule

#: outcomes of pushing an incoming record into what L3 holds
NEW, NEWER, OLDER, EQUAL, MERGED, CONFLICT = "new", "newer", "older", "equal", "merged", "conflict"


def l3_rule(stored: Dotted | None, incoming: Dotted,
            keep_siblings: bool = False) -> tuple[str, Dotted | None]:
    """The L3 rule: what L3 does with a pushed ``incoming`` version given the ``stored``
    one. Returns (outcome, version stored after).

    new/newer: incoming replaces; older/equal: stored stays; concurrent: last-writer-wins
    by :func:`lww_key`, stored with the merged vector (``merged``) — or, with
    ``keep_siblings``, nothing changes and the caller resolves (``conflict``). The
    server-side Lua script in :mod:`kvcomm.tiers.l3` implements exactly this; a test
    checks the two agree on generated histories.
    """
    if stored is None:
        return NEW, incoming
    order = compare_vectors(incoming.vector, stored.vector)
    if order is Ordering.EQUAL:
        return EQUAL, stored
    if order is Ordering.AFTER:
        return NEWER, incoming
    if order is Ordering.BEFORE:
        return OLDER, stored
    if keep_siblings:
        return CONFLICT, stored
    winner = max((stored, incoming), key=lww_key)
    return MERGED, Dotted(merge_vectors(stored.vector, incoming.vector), winner.dot, winner.hlc)
