"""Hot keys: the host's Count-Min Sketch and top-k in the segment."""

from __future__ import annotations

from .segment import SegmentCore


class HotKeys(SegmentCore):
    """Hot keys."""

    def count_accesses(self, counts: dict[bytes, int], wait: bool = True) -> bool:
        """Add a process's buffered access counts to the host sketch (under the lock).

        Returns False, counting nothing, when this thread already holds the lock, or when
        ``wait`` is false and the lock is held now: a reader's flush never waits for a
        writer (one stopped inside the lock would stall every read). With ``wait`` it
        waits up to ``lock_timeout``, then raises Unavailable, as writes do. Raises
        SegmentError (purged namespace)."""
        core = self._core
        if core.held():
            return False
        try:
            if wait:
                self._lock()
            elif not self._try_lock():
                return False
            # (the sketch may age during the adds, several times: the top-k ages with
            # it, and the estimates taken before each aging are aged too)
            self.topk.offer_many(self.sketch.add_many(counts.items(), self.topk.halve))
        finally:
            core.unlock()
        return True

    def hot_keys(self, n: int) -> list[tuple[str, int]]:
        """The ``n`` hottest keys with their estimates, hottest first. Waits for the writer
        lock up to ``lock_timeout``; raises Unavailable, SegmentError (purged)."""
        return self.hot_keys_now(n, wait=True) or []

    def hot_keys_now(self, n: int, wait: bool = False) -> list[tuple[str, int]] | None:
        """:meth:`hot_keys`, or without ``wait`` None when the writer lock is held now (a
        scrape must not wait for a writer: one stopped inside the lock would fail it)."""
        core = self._core
        if core.held():  # (from a validator: this thread holds the lock already)
            top = self.topk.top(n)
        else:
            try:
                if wait:
                    self._lock()
                elif not self._try_lock():
                    return None
                top = self.topk.top(n)
            finally:
                core.unlock()
        return [(k.decode("utf-8", "replace"), c) for k, c in top]

