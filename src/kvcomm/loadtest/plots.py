"""Plots of a load test (matplotlib, Agg: no display needed; kvcomm[plot]): latency CDFs of
every operation, KVCOMM's tiers against the Redis baseline, and throughput and hit rate
over time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_STYLE = {"kvcomm": "-", "redis": "--"}


def plot_all(scenario: str, results: dict[str, dict[str, Any]], prefix: str) -> list[str]:
    """Write ``PREFIX-latency.png`` and ``PREFIX-timeline.png``; returns their paths.
    Raises ConfigError when matplotlib is missing."""
    from .._extras import require

    require("matplotlib", extra="plot", purpose="kvcomm loadtest --plot")
    import matplotlib

    matplotlib.use("Agg")
    return [latency_cdf(scenario, results, f"{prefix}-latency.png"),
            timeline(scenario, results, f"{prefix}-timeline.png")]


def cdf(series: dict[str, Sequence[float]], title: str, path: str,
        xlabel: str = "latency (µs, log scale)") -> str:
    """A CDF per named series of latencies in µs, on a log scale, written to ``path``
    (matplotlib, Agg); returns ``path``. For benchmarks (``bench/bench_cluster.py
    --plot``). Raises ConfigError when matplotlib is missing."""
    from .._extras import require

    require("matplotlib", extra="plot", purpose="a latency plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for label, xs in series.items():
        lat = sorted(xs)
        if len(lat) < 2:
            continue
        p50, p99 = lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))]
        ax.plot(lat, [(i + 1) / len(lat) for i in range(len(lat))],
                label=f"{label} (p50 {p50:.1f} µs, p99 {p99:.1f} µs, n={len(lat):,})")
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def latency_cdf(scenario: str, results: dict[str, dict[str, Any]], path: str) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for store, r in results.items():
        for name, op in sorted(r["ops"].items()):
            lat = op.get("cdf_us") or []
            if len(lat) < 2:
                continue
            ys = [(i + 1) / len(lat) for i in range(len(lat))]
            ax.plot(lat, ys, _STYLE.get(store, "-"), label=f"{store}: {name} "
                    f"(p50 {op['p50_us']:.1f} µs, p99 {op['p99_us']:.1f} µs)")
    ax.set_xscale("log")
    ax.set_xlabel("latency (µs, log scale)")
    ax.set_ylabel("fraction of operations")
    ax.set_title(f"kvcomm loadtest --scenario {scenario}: latency by operation and tier")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def timeline(scenario: str, results: dict[str, dict[str, Any]], path: str) -> str:
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.5), dpi=100, sharex=True)
    for store, r in results.items():
        rows = r.get("timeline", [])
        if not rows:
            continue
        ts = [row["t"] for row in rows]
        total = [sum(v for k, v in row.items() if k != "t") for row in rows]
        top.plot(ts, total, _STYLE.get(store, "-"), label=f"{store}: operations/s")
        gets = [sum(v for k, v in row.items() if k.startswith("get")) for row in rows]
        if store == "kvcomm":
            l1 = [row.get("get l1", 0) for row in rows]
            host = [row.get("get l1", 0) + row.get("get l2", 0) + row.get("get guard", 0)
                    for row in rows]
            bottom.plot(ts, [100 * a / g if g else 0 for a, g in zip(l1, gets, strict=True)],
                        label="kvcomm: reads served by L1 (%)")
            bottom.plot(ts, [100 * a / g if g else 0 for a, g in zip(host, gets, strict=True)],
                        label="kvcomm: reads answered on the host, L1+L2+guards (%)")
    top.set_ylabel("operations / s")
    top.grid(True, alpha=0.3)
    top.legend(fontsize=8)
    bottom.set_ylabel("% of reads")
    bottom.set_xlabel("seconds into the run")
    bottom.set_ylim(0, 105)
    bottom.grid(True, alpha=0.3)
    bottom.legend(fontsize=8, loc="lower right")
    top.set_title(f"kvcomm loadtest --scenario {scenario}: throughput and hit rate over time")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
