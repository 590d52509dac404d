"""Hot keys: the getter's sampled reads into the host's Count-Min Sketch, and the top keys."""

from __future__ import annotations

from ..errors import InvalidArgument
from ..placement.report import REPORT_PUTS
from .base import ClientBase


class HotKeys(ClientBase):
    """Hot keys."""

    def _flush_hot(self) -> None:
        """Add the reads the getter sampled (1 in ``cache.hot_key_sample``, scaled back
        up) to the host-wide sketch. Called by the getter when its buffer is full or a
        second old, and before hot_keys()."""
        if self._unusable:
            return
        counts = self._getter.take_hot()
        if counts:
            by_bytes = {k.encode("utf-8", "surrogatepass"): n for k, n in counts.items()}
            # (from a validator this thread holds the L2 lock: the counts are dropped, which
            # sampling, an estimate, can afford)
            self._seg.count_accesses(by_bytes)
        obs = self._observer
        if obs is not None:  # placement: who wrote what was read, and now and then a report
            if counts:
                obs.sampled(counts, self._keys, self._key_hash, self._seg._core.writers)
            if obs.report_due():
                obs.report(self._ops())

    def _report_writes(self) -> None:
        """Every REPORT_PUTS puts: report if a report is due (an agent that only writes
        never reaches the flush of sampled reads)."""
        self._report_at = self._puts + REPORT_PUTS
        obs = self._observer
        if obs is not None and not self._unusable and obs.report_due():
            obs.report(self._ops())

    def _ops(self) -> int:
        """This client's operations so far: gets, puts (batched ones too) and deletes."""
        g = self._getter
        return (g.hits + g.l2_hits + self._l1_hits + self._l2_hits + self._l2_misses
                + self._puts + self.counters["deletes"])

    def hot_keys(self, n: int = 10) -> list[tuple[str, int]]:
        """The host's ``n`` most read keys with estimated read counts, from every process.

        Counts come from a Count-Min Sketch fed by 1 read in ``cache.hot_key_sample``
        (scaled back up); counters age by half periodically, and concurrent processes
        serialise their updates, so estimates are approximate but never low by more than
        the sampling error. Empty when tracking is off (``hot_key_sample: 0``).
        """
        if type(n) is not int or n < 0:
            raise InvalidArgument(f"n must be an int >= 0, got {n!r}")
        self._live()
        self._flush_hot()
        return self._seg.hot_keys(n)

