"""Exact figures of a load test, beside Locust's own: every operation's latency in
microseconds (Locust rounds to whole milliseconds in its percentiles), and a timeline of
operations per second by name. Written as JSON to ``--kvcomm-out`` when the test stops;
``kvcomm loadtest`` prints it and plots it."""

from __future__ import annotations

import json
import random
import time
from typing import Any

KEEP = 200_000  # latencies kept per operation name (a uniform reservoir beyond that)
CDF_POINTS = 4000  # latencies written per name for the CDF plots


class Recorder:
    def __init__(self, seed: int) -> None:
        self.t0 = time.monotonic()
        self.rng = random.Random(seed)
        self.samples: dict[str, list[float]] = {}
        self.counts: dict[str, int] = {}
        self.failures: dict[str, int] = {}
        self.errors: dict[str, str] = {}
        self.timeline: dict[int, dict[str, int]] = {}
        self.first: float | None = None
        self.last = 0.0

    def on_request(self, request_type: str, name: str, response_time: float,
                   exception: Any = None, **kwargs: Any) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = now
        self.last = now
        n = self.counts.get(name, 0) + 1
        self.counts[name] = n
        sec = int(now - self.t0)
        bucket = self.timeline.setdefault(sec, {})
        bucket[name] = bucket.get(name, 0) + 1
        if exception is not None:
            self.failures[name] = self.failures.get(name, 0) + 1
            self.errors.setdefault(name, f"{type(exception).__name__}: {exception}")
            return
        us = response_time * 1000.0
        kept = self.samples.setdefault(name, [])
        if len(kept) < KEEP:
            kept.append(us)
        else:
            j = self.rng.randrange(n)
            if j < KEEP:
                kept[j] = us

    def summary(self, environment: Any) -> dict[str, Any]:
        opts = environment.parsed_options
        # rates over the time operations ran (from the first to the last)
        seconds = max(self.last - (self.first or self.last), 1e-9)
        ops: dict[str, Any] = {}
        for name, n in sorted(self.counts.items()):
            lat = sorted(self.samples.get(name, []))
            step = max(1, len(lat) // CDF_POINTS)
            ops[name] = {"count": n, "failures": self.failures.get(name, 0),
                         "error": self.errors.get(name, ""), "per_s": n / seconds,
                         "p50_us": _q(lat, 0.50), "p90_us": _q(lat, 0.90), "p99_us": _q(lat, 0.99),
                         "p999_us": _q(lat, 0.999), "mean_us": sum(lat) / len(lat) if lat else None,
                         "max_us": lat[-1] if lat else None, "cdf_us": lat[::step]}
        return {"backend": opts.kvcomm_backend, "users": getattr(opts, "num_users", None),
                "seconds": seconds, "ops": ops,
                "timeline": [{"t": t, **self.timeline[t]} for t in sorted(self.timeline)]}


def _q(lat: list[float], q: float) -> float | None:
    if not lat:
        return None
    return lat[min(len(lat) - 1, int(q * len(lat)))]


_REC: Recorder | None = None


def start(environment: Any) -> None:
    global _REC
    _REC = Recorder(environment.parsed_options.kvcomm_seed or 0)
    environment.events.request.add_listener(_REC.on_request)


def stop(environment: Any) -> None:
    rec = _REC
    if rec is None:
        return
    out = environment.parsed_options.kvcomm_out
    if out:
        with open(out, "w") as f:
            json.dump(rec.summary(environment), f)
