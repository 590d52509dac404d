"""What metrics cost agents: the same client with metrics sampling on (the default: 1
operation in 64 timed) and off (``latency_sample: 0``), toggled in place, in many short
interleaved blocks; plus what one flush of a client's counts into L2 costs (the
background thread does one per client per ``flush_interval``, 1 s).

    python bench/bench_metrics.py [--blocks 400]

Counting itself has no on/off: hits were always counted in plain C integers by the
getter, and the client's other counts are plain Python ints on paths that already did
work; the metrics add a countdown per operation (a decrement and a branch: in C on the
getter's path, in Python on put's), two clock reads per sampled operation, and the flush.

Rows (on/off is the ratio; target: at most a few percent). Each side's figure is the
best of its blocks (the intrinsic cost: a shared machine only ever adds to a block) and,
in brackets, the median:

* **L1 hit** — ``kv.get`` over 100 distinct cached keys of 1 KiB.
* **get_item L1 hit** — ``kv.get_item`` over the same keys (the Python path: its value,
  Version and tier).
* **fresh L2 read** — ``kv.get`` of keys another client just rewrote.
* **put** — ``kv.put`` of 1 KiB bytes over 100 keys.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

from _timing import clock

import kvcomm
from kvcomm.metrics import agent
from kvcomm.tiers.l2 import purge
from kvcomm.tiers.shm.layout import LATENCY_BOUNDS_NS

CFG = kvcomm.Config.from_mapping({"cache": {"l2_size": "64MB", "l1_size": "64MB"},
                                  "metrics": {"latency_sample": 64, "flush_interval": 1}})
KEYS = [f"drone/{i}/state" for i in range(100)]
VALUE = b"x" * 1024
SAMPLE = 64


def per_op(fn: Callable[[str], Any], reps: int) -> float:
    """ns per call of ``fn(key)`` over ``reps`` passes over the keys (loop included)."""
    t0 = clock()
    for _ in range(reps):
        for k in KEYS:
            fn(k)
    return (clock() - t0) / (reps * len(KEYS))


def sampling(kv: kvcomm.Client, on: bool) -> None:
    """Turn latency sampling on (1 in SAMPLE) or off, in the getter and the client."""
    kv._getter.time_every(SAMPLE if on else 0, LATENCY_BOUNDS_NS)
    kv._lat_every = SAMPLE if on else 0
    kv._lat_left = SAMPLE if on else 1 << 62  # (as the client when off: never reaches 0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=400)
    args = ap.parse_args()
    name = f"bench-metrics-{os.getpid()}"
    kv = kvcomm.open(name, config=CFG)
    writer = kvcomm.open(name, config=CFG)
    out: dict[str, dict[bool, list[float]]] = {"l1": {}, "item": {}, "fresh": {}, "put": {}}
    try:
        for k in KEYS:
            kv.put(k, VALUE)
            kv.get(k)
        put = kv.put
        for b in range(args.blocks):
            for on in (True, False) if b % 2 else (False, True):
                sampling(kv, on)
                out["l1"].setdefault(on, []).append(per_op(kv.get, 20))
                out["item"].setdefault(on, []).append(per_op(kv.get_item, 5))
                out["put"].setdefault(on, []).append(per_op(lambda k: put(k, VALUE), 2))
                for k in KEYS:
                    writer.put(k, VALUE)  # every L1 entry of kv is now stale
                out["fresh"].setdefault(on, []).append(per_op(kv.get, 1))
        t0 = clock()
        for _ in range(200):
            kv._meter.flush()
        flush_us = (clock() - t0) / 200 / 1000
        hist = agent.client_counts(kv)
    finally:
        writer.close()
        kv.close()
        purge(name)
    print(f"kvcomm, python {sys.version.split()[0]}, {os.cpu_count()} cpus, load average "
          f"{os.getloadavg()[0]:.1f}; {args.blocks} interleaved blocks per side")
    print(f"{'measurement':<30} {'sampling on':>22} {'sampling off':>22} {'on/off':>7}  target")
    for key, label in (("l1", "L1 hit (100 keys, 1 KiB)"), ("item", "get_item L1 hit"),
                       ("fresh", "fresh L2 read"), ("put", "put 1 KiB")):
        on, off = out[key][True], out[key][False]
        best_on, best_off = min(on), min(off)
        print(f"{label:<30} {best_on:>8.1f} ns ({statistics.median(on):>7.1f}) "
              f"{best_off:>8.1f} ns ({statistics.median(off):>7.1f}) {best_on / best_off:>7.3f}  "
              "<= 1.05")
    print(f"{'one flush of a client':<30} {flush_us:>8.1f} µs (once per flush_interval: "
          f"{flush_us / 1e4:.4f}% of a second)")
    print(f"(counted by this client: {len(hist)} series)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
