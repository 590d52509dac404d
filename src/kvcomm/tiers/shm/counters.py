"""The segment's metrics region: host-wide counters, gauges and latency histograms.

Every process that uses a namespace counts what it does in plain integers of its own (the
C getter's hit counts, the client's counters: never an atomic per operation) and
periodically adds the *deltas* to this region with atomic fetch-and-adds
(:meth:`MetricsRegion.add`), so the region holds exact host-wide totals that any process
can read (the node daemon's or ``kvcomm metrics``' exporter, ``kvcomm top``). Gauges
(feed lag) are stored by their one writer, the daemon. Latency histograms are sampled:
one operation in ``metrics.latency_sample`` is timed, into the buckets of
:data:`~kvcomm.tiers.shm.layout.LATENCY_BOUNDS_NS`.

Words are placed by :mod:`kvcomm.tiers.shm.layout` (``METRIC_SERIES``, ``HISTOGRAMS``).
A word is only ever read or added to as a whole aligned 8-byte word; a reader sees each
word's latest value, not one instant across words (a scrape that races a flush can see
``hits`` of one flush and ``misses`` of the one before).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Mapping
from typing import Any

from .layout import HIST, HIST_WORDS, LATENCY_BOUNDS_NS, METRIC, METRICS_WORDS, PIN_WORDS, H

N_BUCKETS = len(LATENCY_BOUNDS_NS) + 1  # + the +Inf bucket


class MetricsRegion:
    """The metrics words of one mapped segment (``seg``: an L2Segment)."""

    def __init__(self, seg: Any) -> None:
        self._seg = seg
        self._off = seg.layout.metrics_off

    def add(self, deltas: Iterable[tuple[int, int]]) -> None:
        """Add each ``(word, delta)`` atomically (word: an index into the region). Raises
        SegmentError when the segment was closed."""
        core = self._seg._core
        if core is None:
            from ...errors import SegmentError

            raise SegmentError(f"namespace {self._seg.name!r} is closed")
        off = self._off
        for word, delta in deltas:
            if delta:
                core.add(off + 8 * word, delta)

    def store(self, word: int, value: int) -> None:
        """Store a gauge (its one writer: the daemon)."""
        self._seg._core.store(self._off + 8 * word, max(0, int(value)))

    def words(self) -> list[int]:
        """A copy of the whole region (each word read whole)."""
        base = self._off // 8
        return self._seg._q[base: base + METRICS_WORDS].tolist()  # type: ignore[no-any-return]

    def header(self) -> dict[str, int]:
        """What the segment's header and tables say now: entries, bytes, capacity,
        evictions, pinned views, the local change feed's head and the daemon's cursor in
        it, writes waiting for L3, and whether the daemon heartbeats (1/0)."""
        seg = self._seg
        q, lay = seg._q, seg.layout
        pins = q[lay.pins_off // 8: lay.pins_off // 8 + lay.n_pins * PIN_WORDS: PIN_WORDS]
        return {"entries": q[H["ENTRIES"]], "bytes": q[H["USED"]], "capacity": lay.data_size,
                "evictions": q[H["EVICTIONS"]], "pins": sum(1 for b in pins if b),
                "feed_head": q[H["FEED_HEAD"]], "sync_cursor": q[H["SYNC_CURSOR"]],
                "dirty": q[H["DIRTY"]], "daemon_up": int(seg.daemon_alive()),
                "recoveries": q[H["RECOVERIES"]]}


def series_word(name: str) -> int:
    """The word of series ``name`` (as in ``METRIC_SERIES``, without a leading ``=``)."""
    return METRIC[name]


def hist_word(op: str, tier: str) -> int:
    """The first word of histogram ``(op, tier)``."""
    return HIST[(op, tier)]


class Histogram:
    """A process-local latency histogram in the region's shape: ``N_BUCKETS`` counts,
    the sum in ns, the count. Cumulative; :func:`deltas` turns two snapshots into adds."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts = [0] * HIST_WORDS

    def note(self, ns: int) -> None:
        c = self.counts
        c[bisect_left(LATENCY_BOUNDS_NS, ns)] += 1
        c[N_BUCKETS] += ns
        c[N_BUCKETS + 1] += 1


def deltas(now: Mapping[int, int], before: dict[int, int]) -> list[tuple[int, int]]:
    """The ``(word, delta)`` pairs that bring ``before`` up to ``now``; updates ``before``.
    A value that went down (a counter of a process-local object that was replaced) adds
    nothing and restarts from the new value."""
    out = []
    for word, value in now.items():
        d = value - before.get(word, 0)
        if d > 0:
            out.append((word, d))
        if d:
            before[word] = value
    return out
