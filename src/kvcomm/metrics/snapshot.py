"""Snapshots of a host's families, from its L2 or from a scrape, and what ``kvcomm top``
derives from two of them: rates, hit rates and latency quantiles."""

from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass

from ..errors import Unavailable
from .collector import Histo, Snapshot
from .families import BY_NAME, HOT_KEYS, INFO, Labels


def parse_text(text: str) -> Snapshot:
    """A snapshot from Prometheus exposition text (a scrape of a KVCOMM exporter).
    Needs kvcomm[metrics] (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    snap = Snapshot()
    for fam in text_string_to_metric_families(text):
        name = fam.name
        if fam.type == "counter":
            name += "_total"
        if name == HOT_KEYS.name:
            snap.hot = sorted(((s.labels.get("key", ""), int(s.value)) for s in fam.samples),
                              key=lambda kv: -kv[1])
            continue
        if name == INFO.name:
            for s in fam.samples:
                snap.host, snap.namespace = s.labels.get("host", ""), s.labels.get("namespace", "")
            continue
        if fam.type == "histogram":
            series: dict[Labels, Histo] = {}
            for s in fam.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                h = series.setdefault(labels, Histo([], 0.0, 0))
                if s.name.endswith("_bucket"):
                    h.buckets.append((float(s.labels["le"]), int(s.value)))
                elif s.name.endswith("_sum"):
                    h.sum = s.value
                elif s.name.endswith("_count"):
                    h.count = int(s.value)
            for h in series.values():
                h.buckets.sort()
            snap.histograms[fam.name] = series
            continue
        if name not in BY_NAME:
            continue
        values = snap.values.setdefault(name, {})
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            values[tuple(sorted(s.labels.items()))] = s.value
    return snap


def scrape(url: str, timeout: float = 2.0) -> Snapshot:
    """GET ``url`` and parse it. Raises Unavailable when it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (a URL we were given)
            text = r.read().decode("utf-8", "replace")
    except (OSError, ValueError) as exc:
        raise Unavailable(f"cannot scrape {url}: {exc}") from None
    return parse_text(text)


def histo_delta(new: Histo | None, old: Histo | None) -> Histo | None:
    """The observations between two cumulative snapshots of one histogram (``new`` alone
    when ``old`` is None or the counts went down)."""
    if new is None:
        return None
    if old is None or old.count > new.count or len(old.buckets) != len(new.buckets):
        return new
    return Histo([(le, n - o) for (le, n), (_, o) in zip(new.buckets, old.buckets, strict=True)],
                 new.sum - old.sum, new.count - old.count)


def quantile(h: Histo | None, q: float) -> float | None:
    """The ``q`` quantile in seconds, interpolated within its bucket as Prometheus'
    histogram_quantile does; None without observations."""
    if h is None or not h.count or not h.buckets:
        return None
    rank = q * h.buckets[-1][1]
    prev_le, prev_n = 0.0, 0
    for le, n in h.buckets:
        if n >= rank:
            if math.isinf(le):
                return prev_le
            if n == prev_n:
                return le
            return prev_le + (le - prev_le) * (rank - prev_n) / (n - prev_n)
        prev_le, prev_n = le, n
    return prev_le


@dataclass
class View:
    """What ``top`` shows of one host between two snapshots ``dt`` seconds apart."""

    new: Snapshot
    old: Snapshot | None
    dt: float

    def rate(self, family: str, **labels: str) -> float:
        """Per second over the interval (0 when there is no earlier snapshot)."""
        now = self.new.value(family, **labels)
        if self.old is None or self.dt <= 0:
            return 0.0
        return max(0.0, now - self.old.value(family, **labels)) / self.dt

    def delta(self, family: str, **labels: str) -> float:
        """The increase over the interval (since the segment was made when there is no
        earlier snapshot)."""
        now = self.new.value(family, **labels)
        return now if self.old is None else max(0.0, now - self.old.value(family, **labels))

    def hit_rate(self, tier: str) -> tuple[float, float]:
        """``(hits, reads)`` of ``tier`` over the interval (kvcomm_reads_total); when it had
        no read of the tier, since the segment was made (as :meth:`histo` when idle)."""
        R = "kvcomm_reads_total"
        reads = self.delta(R, tier=tier)
        if not reads:
            return self.new.value(R, tier=tier, result="hit"), self.new.value(R, tier=tier)
        return self.delta(R, tier=tier, result="hit"), reads

    def histo(self, op: str, tier: str) -> Histo | None:
        key = (("op", op), ("tier", tier))
        new = _find(self.new.histograms.get("kvcomm_op_seconds", {}), key)
        old = None if self.old is None else _find(self.old.histograms.get(
            "kvcomm_op_seconds", {}), key)
        d = histo_delta(new, old)
        return d if d is not None and d.count else new  # (idle: since the start)


def _find(series: dict[Labels, Histo], key: Labels) -> Histo | None:
    want = set(key)
    for labels, h in series.items():
        if want <= set(labels):
            return h
    return None
