"""The slot-balancing evaluation: the learned policy against the tuned threshold policy on
held-out seeds, every workload; prints the table in docs/balancing.md and draws docs/balance-sim.png.

    .venv/bin/python bench/balance_eval.py [--seeds 20] [--model FILE] [--workers 2]
                                           [--plot docs/balance-sim.png] [--json FILE]

(``make balance-eval``). Held-out seeds are 1000000 + i: training uses seed * 1000 + i
for training seeds below 1000, so none is ever seen in training. Each run is the CLI's
``kvcomm balance simulate`` with its defaults (8 masters, 30 measured minutes, SLO 10 ms).

Statistics: per workload and policy, the mean of each figure with a 95% confidence
interval (Student t over seeds). Comparisons are paired by seed: for p99 and the SLO
violation time, the upper end of the 95% interval of mean(learned - threshold), against
5% of the threshold's mean; that interval both by Student t and by a paired bootstrap
(10000 resamples of the seeds, a fixed generator seed), since p99 over seeds is
heavy-tailed (one run's 988 ms among 0.6 ms ones widens a t interval both ways); and
how many seeds the learned policy did more than 5% worse on. ``--runs FILE`` analyses
the runs saved by an earlier ``--json`` again, without simulating. Slots moved are
pooled over the workloads: the reduction is 1 - sum(learned) / sum(threshold), its
interval from 10000 bootstrap resamples of the seeds (a fixed generator seed, so the
output is reproducible).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from kvcomm.balance.policy import LearnedPolicy, ThresholdPolicy, threshold_params
from kvcomm.balance.sim import SimConfig, Simulator
from kvcomm.balance.train import eval_seeds, pool_map
from kvcomm.balance.workloads import WORKLOADS

POLICIES = ("threshold", "learned")
METRICS = ("migrations", "bytes_moved", "p99_ms", "slo_violation_s", "max_node_load")
TOLERANCE = 0.05

# two-sided 95% Student t quantiles by degrees of freedom (no scipy)
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131,
        16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080, 22: 2.074,
        23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045,
        30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def t95(df: int) -> float:
    """The two-sided 95% t quantile for ``df`` degrees of freedom (conservative between
    tabulated values)."""
    if df < 1:
        return math.inf
    keys = sorted(k for k in _T95 if k <= df)
    return _T95[keys[-1]] if df <= 120 else 1.96


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% confidence interval)."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, math.inf
    return m, t95(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))


def _run(job: tuple[str, str, int, str | None]) -> dict[str, Any]:
    policy, workload, seed, model = job
    pol = ThresholdPolicy(threshold_params(model)) if policy == "threshold" else \
        LearnedPolicy.load(model)
    res = Simulator(SimConfig(), workload, seed, pol, policy).run()
    return res.summary()


def evaluate(seeds: list[int], model: str | None, workers: int) -> list[dict[str, Any]]:
    """Every (policy, workload, seed) run's summary."""
    jobs = [(p, w, s, model) for w in WORKLOADS for p in POLICIES for s in seeds]
    return pool_map(_run, jobs, workers)


def analyse(runs: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    """The table: per workload and policy, mean and CI of each metric; the paired
    comparisons; the pooled reduction of slots moved."""
    import numpy as np

    by = {(r["policy"], r["workload"], r["seed"]): r for r in runs}
    out: dict[str, Any] = {"seeds": seeds, "workloads": {}}
    for w in WORKLOADS:
        row: dict[str, Any] = {}
        for p in POLICIES:
            row[p] = {m: mean_ci([float(by[(p, w, s)][m]) for s in seeds]) for m in METRICS}
        checks = {}
        rng = np.random.default_rng(12345)
        idx = rng.integers(0, len(seeds), size=(10000, len(seeds)))
        for m in ("p99_ms", "slo_violation_s"):
            diff = [by[("learned", w, s)][m] - by[("threshold", w, s)][m] for s in seeds]
            d, h = mean_ci(diff)
            base = row["threshold"][m][0]
            boot = float(np.percentile(np.array(diff)[idx].mean(axis=1), 97.5))
            checks[m] = {"diff": d, "upper": d + h, "allowed": TOLERANCE * base,
                         "ok": d + h <= TOLERANCE * base + 1e-12,
                         "boot_upper": boot, "boot_ok": boot <= TOLERANCE * base + 1e-12,
                         "seeds_worse": sum(by[("learned", w, s)][m] >
                                            (1 + TOLERANCE) * by[("threshold", w, s)][m] + 1e-9
                                            for s in seeds)}
        row["checks"] = checks
        out["workloads"][w] = row
    # pooled slots moved: resample seeds, the same seeds for every workload and policy
    mig = {p: np.array([[by[(p, w, s)]["migrations"] for w in WORKLOADS] for s in seeds],
                       dtype=float) for p in POLICIES}
    red = 1 - mig["learned"].sum() / mig["threshold"].sum()
    rng = np.random.default_rng(12345)
    idx = rng.integers(0, len(seeds), size=(10000, len(seeds)))
    boot = 1 - mig["learned"][idx].sum(axis=(1, 2)) / mig["threshold"][idx].sum(axis=(1, 2))
    lo, hi = np.percentile(boot, [2.5, 97.5])
    out["pooled"] = {"threshold": float(mig["threshold"].sum()),
                     "learned": float(mig["learned"].sum()), "reduction": float(red),
                     "ci": [float(lo), float(hi)], "ok": bool(lo >= 0.20)}
    return out


def _fmt(m: str, v: tuple[float, float]) -> str:
    mean, half = v
    if m == "migrations":
        return f"{mean:.0f} ± {half:.0f}"
    if m == "bytes_moved":
        return f"{mean / 2**30:.2f} ± {half / 2**30:.2f}"
    if m == "p99_ms":
        return f"{mean:.3f} ± {half:.3f}"
    if m == "slo_violation_s":
        return f"{mean:.1f} ± {half:.1f}"
    return f"{mean:.3f} ± {half:.3f}"


def table(a: dict[str, Any]) -> str:
    """The markdown table of docs/balancing.md and verdict lines."""
    lines = ["| workload | policy | slots moved | GiB moved | p99 (ms) | SLO violation (s) "
             "| peak node load |", "|---|---|---:|---:|---:|---:|---:|"]
    for w in WORKLOADS:
        for p in POLICIES:
            r = a["workloads"][w][p]
            lines.append(f"| {w} | {p} | " + " | ".join(_fmt(m, r[m]) for m in METRICS) + " |")
    lines.append("")
    lines.append("| workload | p99 ms: learned - threshold (upper 95%: t; bootstrap) "
                 "| allowed (5%) | SLO s: learned - threshold (upper 95%: t; bootstrap) "
                 "| allowed (5%) | within: t; bootstrap | seeds >5% worse (p99, SLO) |")
    lines.append("|---|---:|---:|---:|---:|---|---|")
    for w in WORKLOADS:
        c = a["workloads"][w]["checks"]
        p, s = c["p99_ms"], c["slo_violation_s"]
        ok = "yes" if p["ok"] and s["ok"] else "**no**"
        bok = "yes" if p["boot_ok"] and s["boot_ok"] else "**no**"
        lines.append(f"| {w} | {p['diff']:+.3f} ({p['upper']:+.3f}; {p['boot_upper']:+.3f}) "
                     f"| {p['allowed']:.3f} | {s['diff']:+.1f} ({s['upper']:+.1f}; "
                     f"{s['boot_upper']:+.1f}) | {s['allowed']:.1f} | {ok}; {bok} "
                     f"| {p['seeds_worse']}, {s['seeds_worse']} of {len(a['seeds'])} |")
    pl = a["pooled"]
    lines.append("")
    lines.append(f"Slots moved, pooled over the workloads: threshold {pl['threshold']:.0f}, "
                 f"learned {pl['learned']:.0f}: {100 * pl['reduction']:.1f}% fewer "
                 f"(95% CI {100 * pl['ci'][0]:.1f}% to {100 * pl['ci'][1]:.1f}%; "
                 f"{len(a['seeds'])} held-out seeds per workload).")
    return "\n".join(lines)


def plot(a: dict[str, Any], path: str) -> None:
    """Bars (mean, 95% CI) of each metric, per workload, both policies."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("migrations", "slots moved"), ("p99_ms", "p99 latency (ms)"),
               ("slo_violation_s", "SLO (10 ms) violated (s)"),
               ("max_node_load", "peak node load / capacity")]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    x = range(len(WORKLOADS))
    for ax, (m, label) in zip(axes, metrics, strict=True):
        for j, (p, colour) in enumerate((("threshold", "#d62728"), ("learned", "#1f77b4"))):
            means = [a["workloads"][w][p][m][0] for w in WORKLOADS]
            errs = [a["workloads"][w][p][m][1] for w in WORKLOADS]
            ax.bar([i + (j - 0.5) * 0.38 for i in x], means, 0.38, yerr=errs, capsize=3,
                   color=colour, label=f"{p} policy")
        ax.set_xticks(list(x), WORKLOADS)
        ax.set_title(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(loc="upper left", fontsize=8)
    pl = a["pooled"]
    fig.suptitle(f"Slot balancing in the simulator: {len(a['seeds'])} held-out seeds per workload, "
                 f"mean and 95% CI; learned moves {100 * pl['reduction']:.0f}% fewer slots overall")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=20, help="held-out seeds per workload (>= 10)")
    ap.add_argument("--model", help="a model from kvcomm balance train (default: the shipped one)")
    ap.add_argument("--workers", type=int, default=2, help="processes (default 2)")
    ap.add_argument("--plot", default="docs/balance-sim.png", help="where to draw the plot")
    ap.add_argument("--json", default="docs/balance-sim.json",
                    help="where to write every run's figures and the analysis")
    ap.add_argument("--runs", metavar="FILE",
                    help="analyse the runs of an earlier --json file instead of running them")
    args = ap.parse_args(argv)
    if args.seeds < 10:
        print("balance_eval: use at least 10 held-out seeds", file=sys.stderr)
        return 2
    start = time.monotonic()
    if args.runs:
        saved = json.loads(Path(args.runs).read_text())
        runs, seeds = saved["runs"], saved["analysis"]["seeds"]
        elapsed = saved["analysis"].get("seconds", 0.0)
    else:
        seeds = eval_seeds(args.seeds)
        runs = evaluate(seeds, args.model, args.workers)
        elapsed = round(time.monotonic() - start, 1)
    a = analyse(runs, seeds)
    a["seconds"] = elapsed
    print(table(a))
    print(f"\n({len(runs)} runs in {a['seconds']:g} s)")
    plot(a, args.plot)
    Path(args.json).write_text(json.dumps({"analysis": a, "runs": runs}, indent=1) + "\n")
    print(f"plot: {args.plot}; figures: {args.json}")
    ok = a["pooled"]["ok"] and all(c["ok"] for w in WORKLOADS
                                   for c in a["workloads"][w]["checks"].values())
    bok = a["pooled"]["ok"] and all(c["boot_ok"] for w in WORKLOADS
                                    for c in a["workloads"][w]["checks"].values())
    print(f"target met (t intervals): {'yes' if ok else 'NO'}; "
          f"with paired bootstrap intervals: {'yes' if bok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
