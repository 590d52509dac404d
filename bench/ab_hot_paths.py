"""The hot paths alone, with the public API only, to compare two checkouts A/B:

    python bench/ab_hot_paths.py                         # this checkout
    PYTHONPATH=/path/to/other/src python bench/ab_hot_paths.py

``--ab OTHER_SRC`` runs both, alternating, ``--runs`` times each in fresh processes, and
prints each row's medians side by side (this checkout / the other). Rows: a single put of
1 KiB (100 keys; and with a ttl), L1 hits of 8 and of 100 keys written by another client,
get_item's L1 hit, L2 hits of get and get_item (a client without L1) and a get of an
absent key (embedded: L2's answer).

Other benchmarks import :func:`l1_hits_ns`, :func:`run_ab` and :func:`print_ab` from here
(bench/bench_ttl.py): one A/B harness.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

ROUNDS = 300


def l1_hits_ns(w: Any, kv: Any, keys: list[str], **put_kw: Any) -> float:
    """Median ns of an L1 hit of ``kv`` over ROUNDS rounds of 1000 reads cycling through
    ``keys``, which ``w`` (another client) writes first with ``put_kw`` (ttl=...) and
    ``kv`` reads once (into its L1)."""
    for k in keys:
        w.put(k, {"x": 1.0, "y": 2.0}, **put_kw)
        kv.get(k)
    return _per_call_ns(kv.get, keys, 1000)


def _per_call_ns(fn: Any, args: list[str], per_round: int = 100) -> float:
    """Median ns of ``fn(a)`` over ROUNDS rounds of about ``per_round`` calls cycling
    through ``args`` (a round of 100 µs calls stays well under the interpreter's 5 ms
    switch interval: a round the GIL was taken away in, to a background thread of this
    process, is an outlier the median drops, not most rounds)."""
    batch = args * max(1, per_round // len(args))
    samples = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter_ns()
        for a in batch:
            fn(a)
        samples.append((time.perf_counter_ns() - t0) / len(batch))
    return statistics.median(samples)


def measure() -> dict[str, float]:
    import kvcomm
    from kvcomm.tiers.l2 import purge

    ns = f"ab-hot-{os.getpid()}"
    cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": "64MB", "l1_size": "16MB"}})
    no_l1 = kvcomm.Config.from_mapping({"cache": {"l2_size": "64MB", "l1_size": 0}})
    out: dict[str, float] = {}
    try:
        with kvcomm.open(ns, config=cfg) as w, kvcomm.open(ns, config=cfg) as kv:
            value = os.urandom(1024)
            keys = [f"shelf/{i}" for i in range(100)]
            put = kv.put
            samples = []
            for _ in range(ROUNDS):
                t0 = time.perf_counter_ns()
                for k in keys:
                    put(k, value)
                samples.append((time.perf_counter_ns() - t0) / len(keys))
            out["put 1 KiB"] = statistics.median(samples)
            for n in (8, 100):
                out[f"L1 hit, {n} keys"] = l1_hits_ns(w, kv, [f"drone/{i}/state" for i in range(n)])
            ks = [f"drone/{i}/state" for i in range(8)]
            out["get_item, L1 hit"] = _per_call_ns(kv.get_item, ks)
            with kvcomm.open(ns, config=no_l1) as raw:
                out["get, L2 hit"] = _per_call_ns(raw.get, ks)
                out["get_item, L2 hit"] = _per_call_ns(raw.get_item, ks)
            absent = [f"absent/{i}" for i in range(8)]
            out["get, miss"] = _per_call_ns(kv.get, absent)
            # last: the first put with a ttl starts the process's expiry sweep (a thread)
            if "ttl" in (kvcomm.Client.put.__kwdefaults__ or {}):  # (a checkout without TTL)
                out["put 1 KiB, ttl"] = _per_call_ns(lambda k: put(k, value, ttl=3600.0), keys)
    finally:
        purge(ns)
    return out


def run_ab(script: str, other_src: str, runs: int) -> dict[str, list[dict[str, float]]]:
    """``python script --json`` (which prints its rows as a JSON object) in fresh
    processes, ``runs`` times a side, alternating this checkout's src and ``other_src``
    (a checkout's ``src`` directory with its C helper built), each pair in the other
    order than the last (ABBA: neither side always runs first): each side's rows, run
    by run (pair by pair)."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    out: dict[str, list[dict[str, float]]] = {"this": [], "other": []}
    sides = [("this", here), ("other", other_src)]
    for i in range(runs):
        for side, src in sides if i % 2 == 0 else sides[::-1]:
            env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
            r = subprocess.run([sys.executable, script, "--json"], env=env, check=True,
                               capture_output=True, text=True)
            out[side].append(json.loads(r.stdout))
    return out


def print_ab(runs: dict[str, list[dict[str, float]]], width: int = 20) -> None:
    """Each row's median of the runs' medians, this side against the other, and the
    median of the ratios pair by pair (robust to a machine whose speed drifts); a row
    only this side has (a feature the other lacks) alone."""
    for name in runs["this"][0]:
        a = statistics.median(r[name] for r in runs["this"])
        if name not in runs["other"][0]:
            print(f"{name:<{width}} this {a:8.1f} ns")
            continue
        b = statistics.median(r[name] for r in runs["other"])
        pairs = statistics.median(x[name] / y[name]
                                  for x, y in zip(runs["this"], runs["other"], strict=True))
        print(f"{name:<{width}} this {a:8.1f} ns | other {b:8.1f} ns | this/other {a / b:5.3f}"
              f" ({a - b:+.1f} ns), pair by pair {pairs:5.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ab", metavar="OTHER_SRC", help="the other checkout's src directory")
    ap.add_argument("--runs", type=int, default=6, help="fresh processes per side (default 6)")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.json:
        print(json.dumps(measure()))
        return 0
    if not args.ab:
        for name, ns in measure().items():
            print(f"{name:<20} {ns:8.1f} ns")
        return 0
    print_ab(run_ab(__file__, args.ab, args.runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
