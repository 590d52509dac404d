"""The custom collector: one host's families, read from its L2 segment at each scrape.

:func:`read` turns the segment's metrics region and header into samples by family
(:mod:`.families`); :class:`Collector` hands them to prometheus-client; ``kvcomm top``
uses :func:`read` directly for the local host.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ..errors import SegmentError
from ..tiers.shm.counters import N_BUCKETS, MetricsRegion
from ..tiers.shm.layout import HIST, LATENCY_BOUNDS_NS, METRIC_SERIES
from .families import FAMILIES, HISTOGRAM, Labels, parse_series


@dataclass
class Histo:
    """One histogram series: cumulative counts per upper bound in seconds (the last is
    +Inf), the sum in seconds and the count."""

    buckets: list[tuple[float, int]]
    sum: float
    count: int


@dataclass
class Snapshot:
    """Every family's samples at one moment: ``values[family][labels] = value``,
    ``histograms[family][labels] = Histo``, the hot keys, the host id. ``hot_read`` is
    False when the hot keys could not be read (the writer lock was held): ``hot`` is
    empty then, not "no hot keys"."""

    values: dict[str, dict[Labels, float]] = field(default_factory=dict)
    histograms: dict[str, dict[Labels, Histo]] = field(default_factory=dict)
    hot: list[tuple[str, int]] = field(default_factory=list)
    host: str = ""
    namespace: str = ""
    hot_read: bool = True

    def value(self, family: str, **labels: str) -> float:
        """The sum of ``family``'s samples whose labels include ``labels``."""
        want = set(labels.items())
        return sum(v for lab, v in self.values.get(family, {}).items() if want <= set(lab))


def hot_label(key: str, how: str, chars: int) -> str:
    """A hot key as a label value: its first ``chars`` characters (``…`` marks a cut), or
    ``how == "hash"``: ``#`` and 16 hex digits of its xxh3 hash."""
    if how == "hash":
        return "#" + xxhash.xxh3_64_hexdigest(key.encode("utf-8", "surrogatepass"))
    return key if len(key) <= chars else key[:chars - 1] + "…"


def read(seg: Any, config: Any) -> Snapshot:
    """The host's families now, from ``seg`` (an L2Segment) and ``config`` (metrics.hot_keys
    and the hot keys' labels; cluster mode). Never waits for the writer lock: the counters
    and gauges are read without it, and the hot keys only if it is free now (else
    ``hot_read`` is False). Raises SegmentError (purged, closed)."""
    if seg.purged or seg._core is None:  # (its figures are frozen, not the namespace's)
        raise SegmentError(f"namespace {seg.name!r} was purged (or closed); open it again")
    region = MetricsRegion(seg)
    words = region.words()
    header: dict[str, int] = {**region.header(),
                              "cluster": int(bool(config.cluster.enabled or seg.info()["daemon_pid"]))}
    snap = Snapshot(host=seg.host_id, namespace=seg.name)
    for fam in FAMILIES:
        if fam.kind == HISTOGRAM:
            continue
        samples: dict[Labels, float] = {}
        if fam.header is not None:
            for labels, v in fam.header(header):
                samples[labels] = v
        snap.values[fam.name] = samples
    for i, series in enumerate(METRIC_SERIES):
        stem, labels = parse_series(series)
        name = "kvcomm_" + stem
        if name in snap.values:
            snap.values[name][labels] = words[i]
    bounds = [ns / 1e9 for ns in LATENCY_BOUNDS_NS] + [float("inf")]
    hist: dict[Labels, Histo] = {}
    for (op, tier), at in HIST.items():
        row = words[at: at + N_BUCKETS + 2]
        cum, acc = [], 0
        for le, n in zip(bounds, row[:N_BUCKETS], strict=True):
            acc += n
            cum.append((le, acc))
        hist[(("op", op), ("tier", tier))] = Histo(cum, row[N_BUCKETS] / 1e9, row[N_BUCKETS + 1])
    snap.histograms["kvcomm_op_seconds"] = hist
    m = config.metrics
    if m.hot_keys:
        # two keys cut to the same label would be two series with one name and labels,
        # which Prometheus refuses: the label keeps the hotter one (they come hottest first)
        top = seg.hot_keys_now(m.hot_keys)
        hot: dict[str, int] = {}
        for k, n in top or ():
            hot.setdefault(hot_label(k, m.hot_key_label, m.hot_key_chars), n)
        snap.hot, snap.hot_read = list(hot.items()), top is not None
    return snap


def open_segment(name: str, config: Any) -> Any:
    """Namespace ``name``'s L2 segment on this host, opened to be read and never created
    (an exporter or a viewer must not make a namespace out of a typo). Raises
    SegmentError when there is none."""
    from ..tiers.l2 import L2Segment

    c = config.cache
    return L2Segment(name, create_layout=None, host_id="", directory=c.l2_dir,
                     permissions=c.l2_permissions, lock_timeout=c.lock_timeout)


class NamedSegment:
    """Namespace ``name``'s segment for a process that outlives it (``kvcomm metrics``):
    calling it returns the segment, opened again once it was purged and made anew by its
    agents. Raises SegmentError while there is none. Thread-safe."""

    def __init__(self, name: str, config: Any) -> None:
        self.name, self.config = name, config
        self._seg: Any = None
        self._lock = threading.Lock()

    def __call__(self) -> Any:
        with self._lock:
            seg = self._seg
            if seg is None or seg.purged:
                if seg is not None:
                    seg.close()
                    self._seg = None
                self._seg = seg = open_segment(self.name, self.config)
            return seg

    def close(self) -> None:
        with self._lock:
            if self._seg is not None:
                self._seg.close()
                self._seg = None


class Collector:
    """A prometheus-client collector of one namespace's families (needs kvcomm[metrics]).
    ``seg``: an L2Segment, or a callable that returns the one to read at each scrape (a
    :class:`NamedSegment`)."""

    def __init__(self, seg: Any, config: Any) -> None:
        self._seg_now: Callable[[], Any] = seg if callable(seg) else (lambda: seg)
        self.config = config
        self._hot: list[tuple[str, int]] = []  # the last hot keys read (see collect)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        from .families import HOT_KEYS, INFO

        snap = read(self._seg_now(), self.config)
        if snap.hot_read:
            self._hot = snap.hot
        else:  # (the writer lock was held: the last ones read, rather than none this time)
            snap.hot = self._hot
        for fam in FAMILIES:
            if fam.kind == HISTOGRAM:
                series = snap.histograms.get(fam.name, {})
                keys = [k for k, _ in next(iter(series))] if series else []
                h = HistogramMetricFamily(fam.name.removesuffix("_seconds") + "_seconds",
                                          fam.help, labels=keys, unit="")
                for labels, histo in series.items():
                    h.add_metric([v for _, v in labels],
                                 [(_le(le), n) for le, n in histo.buckets], histo.sum)
                yield h
                continue
            samples = snap.values.get(fam.name, {})
            keys = sorted({k for labels in samples for k, _ in labels},
                          key=lambda k: [k2 for lab in samples for k2, _ in lab].index(k))
            c: Any
            if fam.kind == "counter":
                c = CounterMetricFamily(fam.name.removesuffix("_total"), fam.help, labels=keys)
            else:
                c = GaugeMetricFamily(fam.name, fam.help, labels=keys)
            for labels, v in samples.items():
                d = dict(labels)
                c.add_metric([d.get(k, "") for k in keys], v)
            yield c
        hot = GaugeMetricFamily(HOT_KEYS.name, HOT_KEYS.help, labels=["key"])
        for key, n in snap.hot:
            hot.add_metric([key], n)
        yield hot
        info = GaugeMetricFamily(INFO.name, INFO.help, labels=["host", "namespace"])
        info.add_metric([snap.host, snap.namespace], 1)
        yield info


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)
