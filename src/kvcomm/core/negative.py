"""The negative cache: "this key was absent" remembered for ``ttl`` seconds. Pure.

A read that found nothing anywhere notes the key; reads within ``ttl`` answer "absent"
without a cluster round trip. A local put of the key forgets it at once
(:meth:`NegativeCache.invalidate`), so a host never hides its own write. At most
``max_entries`` keys are remembered; when full, the oldest note goes first. The caller
passes the time (monotonic seconds).
"""

from __future__ import annotations

from collections import OrderedDict


class NegativeCache:
    def __init__(self, ttl: float = 5.0, max_entries: int = 100_000) -> None:
        if ttl < 0 or max_entries < 1:
            raise ValueError("ttl must be >= 0 and max_entries >= 1")
        self.ttl, self.max_entries = ttl, max_entries
        self._until: OrderedDict[str, float] = OrderedDict()
        self.hits = 0
        self.evictions = 0

    def note_absent(self, key: str, now: float) -> None:
        self._until.pop(key, None)
        self._until[key] = now + self.ttl
        if len(self._until) > self.max_entries:
            self._until.popitem(last=False)
            self.evictions += 1

    def is_absent(self, key: str, now: float) -> bool:
        until = self._until.get(key)
        if until is None:
            return False
        if now >= until:
            del self._until[key]
            return False
        self.hits += 1
        return True

    def invalidate(self, key: str) -> None:
        self._until.pop(key, None)

    def __len__(self) -> int:
        return len(self._until)
