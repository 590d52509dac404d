"""L1: the agent process's own LRU of decoded values, bounded per process.

Each entry remembers the L2 slot it came from and that slot's ``seq`` at the time; a
hit is revalidated by reading that one shared-memory word (``Client.get`` does it inline,
as the hottest path in KVCOMM), so L1 never serves a value L2 has replaced and never
decodes twice what has not changed.

One :class:`L1Cache` per namespace per process, shared by every client of that namespace
in the process; every cache of the process draws on one :class:`L1Budget`. Entries are
accounted by what the decoded value holds in memory (``kvcomm._l2core.approx_size``: the
objects and everything they contain), not by their encoded size, which can be ten times
smaller for lists of numbers. So ``cache.l1_size`` bounds what L1 holds in the process,
however many clients and namespaces it opens.

Thread safety: lookups are plain dict reads (atomic under the GIL); inserts and
evictions happen under the budget's lock. The client refreshes LRU order on sampled hits
only (``Client._sampled``): an approximate LRU that keeps the hit path short.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter, OrderedDict
from typing import Any, NamedTuple


class L1Entry(NamedTuple):
    value: Any
    word: int  # L2 slot seq word
    seq: int  # seq seen when the value was read
    size: int  # bytes accounted against the budget
    counter: int
    hlc: int
    vvx: bytes


class L1Budget:
    """The process's bound on bytes held by every L1 cache: the smallest ``cache.l1_size``
    of the clients open in the process (so every client's bound holds)."""

    def __init__(self) -> None:
        self.max_bytes = 0
        self.bytes = 0
        self.lock = threading.Lock()
        self.caches: weakref.WeakSet[L1Cache] = weakref.WeakSet()
        self._bounds: Counter[int] = Counter()

    def register(self, max_bytes: int) -> None:
        """A client with this bound opened (0: it uses no L1)."""
        if max_bytes > 0:
            with self.lock:
                self._bounds[max_bytes] += 1
                self._reset_locked()

    def unregister(self, max_bytes: int) -> None:
        if max_bytes > 0:
            with self.lock:
                self._bounds[max_bytes] -= 1
                if self._bounds[max_bytes] <= 0:
                    del self._bounds[max_bytes]
                self._reset_locked()

    def forget(self) -> None:
        """In a child of fork(): the parent's clients and caches are not this process's."""
        self.lock = threading.Lock()
        self.caches = weakref.WeakSet()
        self._bounds = Counter()
        self.bytes = self.max_bytes = 0

    def _reset_locked(self) -> None:
        self.max_bytes = min(self._bounds) if self._bounds else 0
        for cache in list(self.caches):
            cache._shrink_locked(None)


_BUDGET = L1Budget()


def process_budget() -> L1Budget:
    return _BUDGET


class L1Cache:
    """LRU of decoded values drawing on ``budget``; an entry over the bound is not kept."""

    def __init__(self, budget: L1Budget | None = None) -> None:
        self.budget = budget or _BUDGET
        self.entries: OrderedDict[str, L1Entry] = OrderedDict()
        self.bytes = 0
        self.evictions = 0
        self.budget.caches.add(self)

    @property
    def max_bytes(self) -> int:
        return self.budget.max_bytes

    def store(self, key: str, entry: L1Entry) -> None:
        size = entry[3]
        budget = self.budget
        with budget.lock:
            entries = self.entries
            old = entries.pop(key, None)
            if old is not None:
                self.bytes -= old[3]
                budget.bytes -= old[3]
            if size > budget.max_bytes:
                return
            entries[key] = entry
            self.bytes += size
            budget.bytes += size
            self._shrink_locked(key)

    def _shrink_locked(self, keep: str | None) -> None:
        """Evict least recently used entries, here first, then from the process's other
        caches, until the budget holds."""
        budget = self.budget
        if budget.bytes <= budget.max_bytes:
            return
        for cache in [self, *(c for c in list(budget.caches) if c is not self)]:
            entries = cache.entries
            floor = 1 if cache is self and keep is not None else 0  # (keep is the newest)
            while budget.bytes > budget.max_bytes and len(entries) > floor:
                _, victim = entries.popitem(last=False)
                cache.bytes -= victim[3]
                budget.bytes -= victim[3]
                cache.evictions += 1
            if budget.bytes <= budget.max_bytes:
                return

    def discard(self, key: str) -> None:
        with self.budget.lock:
            old = self.entries.pop(key, None)
            if old is not None:
                self.bytes -= old.size
                self.budget.bytes -= old.size

    def clear(self) -> None:
        with self.budget.lock:
            self.budget.bytes -= self.bytes
            self.entries.clear()
            self.bytes = 0
