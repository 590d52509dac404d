"""L1: the agent process's own byte-bounded LRU of decoded values.

Each entry remembers the L2 slot it came from and that slot's ``seq`` at the time; a
hit is revalidated by reading that one shared-memory word (``Client.get`` does it inline,
as the hottest path in KVCOMM), so L1 never serves a value L2 has replaced and never
decodes twice what has not changed.

Thread safety: lookups are plain dict reads (atomic under the GIL); inserts and
evictions happen under a lock. The client refreshes LRU order on sampled hits only
(``Client._sampled``): an approximate LRU that keeps the hit path short. Entries are
accounted by their encoded size.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, NamedTuple


class L1Entry(NamedTuple):
    value: Any
    word: int  # L2 slot seq word
    seq: int  # seq seen when the value was read
    size: int  # bytes accounted against the bound
    counter: int
    hlc: int
    vvx: bytes


class L1Cache:
    """Byte-bounded LRU. ``max_bytes`` of 0 disables it; an entry over the bound is not kept."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, L1Entry] = OrderedDict()
        self.bytes = 0
        self.evictions = 0
        self._lock = threading.Lock()

    def store(self, key: str, entry: L1Entry) -> None:
        size = entry[3]
        if size > self.max_bytes:
            if self.entries:
                self.discard(key)
            return
        with self._lock:
            entries = self.entries
            old = entries.pop(key, None)
            entries[key] = entry
            self.bytes += size if old is None else size - old[3]
            while self.bytes > self.max_bytes:
                _, victim = entries.popitem(last=False)
                self.bytes -= victim[3]
                self.evictions += 1

    def discard(self, key: str) -> None:
        with self._lock:
            old = self.entries.pop(key, None)
            if old is not None:
                self.bytes -= old.size

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()
            self.bytes = 0
