"""The hot paths alone, with the public API only, to compare two checkouts A/B:

    python bench/ab_hot_paths.py                         # this checkout
    PYTHONPATH=/path/to/other/src python bench/ab_hot_paths.py

``--ab OTHER_SRC`` runs both, alternating, ``--runs`` times each in fresh processes, and
prints each row's medians side by side (this checkout / the other). Rows: a single put of
1 KiB (100 keys), and L1 hits of 8 and of 100 keys written by another client.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROUNDS = 300


def measure() -> dict[str, float]:
    import kvcomm
    from kvcomm.tiers.l2 import purge

    ns = f"ab-hot-{os.getpid()}"
    cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": "64MB", "l1_size": "16MB"}})
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
                ks = [f"drone/{i}/state" for i in range(n)]
                for k in ks:
                    w.put(k, {"x": 1.0, "y": 2.0})
                    kv.get(k)
                batch = ks * (1000 // n)
                get = kv.get
                samples = []
                for _ in range(ROUNDS):
                    t0 = time.perf_counter_ns()
                    for k in batch:
                        get(k)
                    samples.append((time.perf_counter_ns() - t0) / len(batch))
                out[f"L1 hit, {n} keys"] = statistics.median(samples)
    finally:
        purge(ns)
    return out


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
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    runs: dict[str, list[dict[str, float]]] = {"this": [], "other": []}
    for _ in range(args.runs):
        for side, src in (("this", here), ("other", args.ab)):
            env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
            r = subprocess.run([sys.executable, __file__, "--json"], env=env, check=True,
                               capture_output=True, text=True)
            runs[side].append(json.loads(r.stdout))
    for name in runs["this"][0]:
        a = statistics.median(r[name] for r in runs["this"])
        b = statistics.median(r[name] for r in runs["other"])
        print(f"{name:<20} this {a:8.1f} ns | other {b:8.1f} ns | this/other {a / b:5.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
