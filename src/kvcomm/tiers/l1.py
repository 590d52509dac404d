"""L1: the agent process's own LRU of decoded values, bounded per process.

Each entry remembers the L2 slot it came from and that slot's ``seq`` at the time; a hit
is revalidated by reading that one shared-memory word, so L1 never serves a value L2 has
replaced and never decodes twice what has not changed. ``kv.get`` is the C kernel's
``Getter`` (``kvcomm._l2core``): a hit, and an L2 read of a key already seen, never run a
line of Python.

One :class:`L1Cache` per namespace per process, shared by every client of that namespace
in the process; every cache of the process draws on one budget. Entries are accounted by
what the decoded value holds in memory (``kvcomm._l2core.approx_size``: the objects and
everything they contain), not by their encoded size, which can be ten times smaller for
lists of numbers. So ``cache.l1_size`` bounds what L1 holds in the process, however many
clients and namespaces it opens: the smallest bound of the clients open at the time.

An entry is the tuple ``(value, slot word, seq, size, counter, hlc, vvx)``. The caches and
the budget are C objects whose every change happens under the GIL: no thread ever sees an
entry and its accounting disagree. LRU order is refreshed on sampled hits only
(``Client._sampled``): an approximate LRU that keeps the hit path short.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, NamedTuple

from .._l2core import L1, Budget


class L1Entry(NamedTuple):
    """The fields of an L1 entry (entries are plain tuples in this order)."""

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
        self.budget = Budget()
        self._lock = threading.Lock()
        self._bounds: Counter[int] = Counter()

    @property
    def max_bytes(self) -> int:
        return int(self.budget.max_bytes)

    @property
    def bytes(self) -> int:
        return int(self.budget.bytes)

    def register(self, max_bytes: int) -> None:
        """A client with this bound opened (0: it uses no L1)."""
        if max_bytes > 0:
            with self._lock:
                self._bounds[max_bytes] += 1
                self.budget.max_bytes = min(self._bounds)

    def unregister(self, max_bytes: int) -> None:
        if max_bytes > 0:
            with self._lock:
                self._bounds[max_bytes] -= 1
                if self._bounds[max_bytes] <= 0:
                    del self._bounds[max_bytes]
                self.budget.max_bytes = min(self._bounds) if self._bounds else 0

    def cache(self) -> L1:
        """A new, empty L1 drawing on this budget."""
        l1 = L1(self.budget)
        self.budget.add(l1)
        return l1

    def drop(self, l1: L1) -> None:
        """``l1`` is no longer used (its entries go)."""
        l1.clear()
        self.budget.remove(l1)

    def forget(self) -> None:
        """In a child of fork(): the parent's clients and caches are not this process's."""
        self.__init__()  # type: ignore[misc]


L1Cache = L1  # (the name the rest of KVCOMM uses)

_BUDGET = L1Budget()


def process_budget() -> L1Budget:
    return _BUDGET
