"""Hot keys: the getter's sampled reads into the host's Count-Min Sketch, and the top keys."""

from __future__ import annotations

import heapq
from operator import itemgetter

from ..errors import InvalidArgument
from ..placement.report import REPORT_PUTS, AgentStats
from .base import ClientBase

# sampled read counts kept while the writer lock was busy (beyond twice as many keys: the
# least read dropped down to this many, which sampling, an estimate, can afford)
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
        are kept for the next flush (at most 2 x _HOT_PENDING_MAX keys, the most read), and
        a flush adds at most _HOT_FLUSH_MAX keys, the most read (the others at the next)."""
        if self._unusable:
            return
        counts = self._getter.take_hot()
        obs = self._observer
        if obs is not None:  # placement: who wrote what was read (these samples: pending
            with self._obs_lock:  # ones were attributed when taken), now and then a report
                if counts:
                    obs.sampled(counts, self._keys, self._key_hash, self._seg._core.writers)
                self._report_if_due(obs)
        if not wait and self._seg.lock_owner():  # (held now: the new counts kept, a merge
            if counts:  # of their own keys, nothing selected or trimmed: the next flush
                self._keep_hot(counts)  # adds them)
            return
        if self._hot_pending:  # (threads flush at once: each takes what it adds, whole)
            with self._hot_lock:
                pending, self._hot_pending = self._hot_pending, {}
            _add(pending, counts)
            counts = pending
        if not counts:
            return
        if not wait and len(counts) > _HOT_FLUSH_MAX:
            now = dict(heapq.nlargest(_HOT_FLUSH_MAX, counts.items(), key=itemgetter(1)))
            # (kept before the flush, not after: a close() flushing meanwhile adds them)
            self._keep_hot({k: n for k, n in counts.items() if k not in now})
            counts = now
        by_bytes = {k.encode("utf-8", "surrogatepass"): n for k, n in counts.items()}
        if not self._seg.count_accesses(by_bytes, wait):
            self._keep_hot(counts)

    def _keep_hot(self, counts: dict[str, int]) -> None:
        """Keep ``counts`` (a dict of the caller's, merged into) for the next flush, added
        to those kept already. Past 2 x _HOT_PENDING_MAX keys the _HOT_PENDING_MAX most
        read are kept: trimmed now and then, not at every flush (while the lock stays
        busy, a read's flush merges its own counts, about 256 keys, nothing more)."""
        with self._hot_lock:
            pending = self._hot_pending
            if len(counts) > len(pending):
                pending, counts = counts, pending
            _add(pending, counts)
            if len(pending) > 2 * _HOT_PENDING_MAX:
                pending = dict(heapq.nlargest(_HOT_PENDING_MAX, pending.items(),
                                              key=itemgetter(1)))
            self._hot_pending = pending

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
