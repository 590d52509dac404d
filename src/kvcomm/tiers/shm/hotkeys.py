"""Hot keys: the host's Count-Min Sketch and top-k in the segment."""

from __future__ import annotations

from .segment import SegmentCore


class HotKeys(SegmentCore):
    """Hot keys."""

    def count_accesses(self, counts: dict[bytes, int]) -> bool:
        """Add a process's buffered access counts to the host sketch (under the lock).
        Returns False, counting nothing, when this thread already holds the lock."""
        core = self._core
        if core.held():
            return False
        try:
            self._lock()
            before = self.sketch.additions
            add = self.sketch.add
            offers = [(kb, add(kb, n)) for kb, n in counts.items()]
            if self.sketch.additions < before:  # the sketch aged: age the top-k with it
                self.topk.halve()
            self.topk.offer_many(offers)
        finally:
            core.unlock()
        return True

    def hot_keys(self, n: int) -> list[tuple[str, int]]:
        core = self._core
        if core.held():  # (from a validator: this thread holds the lock already)
            top = self.topk.top(n)
        else:
            try:
                self._lock()
                top = self.topk.top(n)
            finally:
                core.unlock()
        return [(k.decode("utf-8", "replace"), c) for k, c in top]

