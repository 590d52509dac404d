"""Hot keys: the getter's sampled reads into the host's Count-Min Sketch, and the top keys."""

from __future__ import annotations

import heapq
from operator import itemgetter

from ..errors import InvalidArgument
from ..placement.report import REPORT_PUTS, AgentStats
from .base import ClientBase

# sampled read counts kept while the writer lock was busy (beyond: the least read dropped,
# which sampling, an estimate, can afford)
_HOT_PENDING_MAX = 4096
# keys a read's flush adds to the sketch, at most (the most read; the others at the next
# flush): it runs inside a get, under the host's writer lock (about 2 ms for 512 keys;
# all 4,096 kept while the lock was busy took 76 ms before the top-k's heap and add_many,
# the longest lag of a kvcomm.aio event loop)
_HOT_FLUSH_MAX = 512


class HotKeys(ClientBase):
    """Hot keys."""

    def _flush_hot(self, wait: bool = False) -> None:
        """Add the reads the getter sampled (1 in ``cache.hot_key_sample``, scaled back
        up) to the host-wide sketch. Called by the getter when its buffer is full or a
        second old (``wait`` false), and before hot_keys() and at close (``wait``).

        Without ``wait`` a read never waits for the writer lock: while it is held (by a
        writer, by a process stopped inside it, by this thread in a validator) the counts
        are kept for the next flush, up to _HOT_PENDING_MAX keys (the most read ones)."""
        if self._unusable:
            return
        counts = self._getter.take_hot()
        obs = self._observer
        if obs is not None:  # placement: who wrote what was read (these samples: pending
            with self._obs_lock:  # ones were attributed when taken), now and then a report
                if counts:
                    obs.sampled(counts, self._keys, self._key_hash, self._seg._core.writers)
                self._report_if_due(obs)
        if self._hot_pending:  # (threads flush at once: each takes what it adds, whole)
            with self._hot_lock:
                pending, self._hot_pending = self._hot_pending, {}
            _add(pending, counts)
            counts = pending
        if not counts:
            return
        later: dict[str, int] = {}
        if not wait and len(counts) > _HOT_FLUSH_MAX:
            now = dict(heapq.nlargest(_HOT_FLUSH_MAX, counts.items(), key=itemgetter(1)))
            later = {k: n for k, n in counts.items() if k not in now}
            counts = now
        by_bytes = {k.encode("utf-8", "surrogatepass"): n for k, n in counts.items()}
        if not self._seg.count_accesses(by_bytes, wait):
            _add(later, counts)
        if later:
            self._keep_hot(later)

    def _keep_hot(self, counts: dict[str, int]) -> None:
        """Keep ``counts`` for the next flush, with those kept already, at most
        _HOT_PENDING_MAX keys (the most read)."""
        with self._hot_lock:
            _add(counts, self._hot_pending)
            if len(counts) > _HOT_PENDING_MAX:
                counts = dict(heapq.nlargest(_HOT_PENDING_MAX, counts.items(), key=itemgetter(1)))
            self._hot_pending = counts

    def _report_writes(self) -> None:
        """Every REPORT_PUTS puts: report if a report is due (an agent that only writes
        never reaches the flush of sampled reads)."""
        self._report_at = self._puts + REPORT_PUTS
        obs = self._observer
        if obs is not None and not self._unusable:
            with self._obs_lock:
                self._report_if_due(obs)

    def _report_if_due(self, obs: AgentStats) -> None:
        """The placement report, when due (under ``_obs_lock``; once the namespace is
        purged, ``obs`` writes none: AgentStats.report)."""
        if obs.report_due():
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
        self._flush_hot(wait=True)
        return self._seg.hot_keys(n)


def _add(into: dict[str, int], counts: dict[str, int]) -> None:
    for k, n in counts.items():
        into[k] = into.get(k, 0) + n
