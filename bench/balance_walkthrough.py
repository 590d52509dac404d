"""The balancing walkthrough of docs/balancing.md, end to end: a dev cluster whose hot groups all
sit on one Redis master, ``kvcomm balance --once`` moving some of them away, and each
master's load and command latency before and after.

    python bench/balance_walkthrough.py [--window 10] [--hot-groups 4] [--keys 60]
                                        [--policy threshold|learned] [--dry-run]

Load: on each of 3 hosts, agents write ``--keys`` keys in each of ``--hot-groups`` groups
whose slots are served by the same master (the hot ones), plus background keys spread
over every group, each key rewritten every few milliseconds (the daemons push each once
per 50 ms window). Per-node load is the commands each master processed per second
(INFO); latency is the p50/p99 of its EVALSHA calls (the daemons' pushes) from
``INFO latencystats``, reset at the start of each measurement.

Nothing lost: when the writers stop, each writes every one of its keys a last time
(``{"n": -1}``, acknowledged by ``put``); then every host must read exactly that for
every key (its L2, fed by the change feed through the moves), within a deadline.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import subprocess
import sys
import tempfile
import time
from typing import Any

import redis

import kvcomm
from kvcomm import devcluster
from kvcomm.tiers.groups import groups as groups_of

CTX = mp.get_context("fork")


def _writer(config: str, keys: list[str], stop: Any) -> None:
    with kvcomm.open(config=config) as kv:
        n = 0
        while not stop.is_set():
            for k in keys:
                kv.put(k, {"n": n, "pad": "x" * 200})
            n += 1
            time.sleep(0.01)
        for k in keys:  # the last, acknowledged write of each key: every host must see it
            kv.put(k, {"n": -1})


def converged(configs: list[str], keys: list[str], deadline_s: float) -> dict[str, int]:
    """Per host, the keys it does not read as their last write after ``deadline_s``."""
    missing: dict[str, int] = {}
    for c in configs:
        with kvcomm.open(config=c) as kv:
            t_end = time.monotonic() + deadline_s
            while True:
                bad = [k for k in keys if (kv.get(k) or {}).get("n") != -1]
                if not bad or time.monotonic() > t_end:
                    break
                time.sleep(0.2)
            missing[c] = len(bad)
    return missing


def masters(seeds: list[tuple[str, int]]) -> dict[str, redis.Redis]:
    out = {}
    for h, p in seeds:
        r = redis.Redis(host=h, port=p)
        if r.info("replication")["role"] == "master":
            out[f"{h}:{p}"] = r
    return out


def slot_owner(nodes: dict[str, redis.Redis]) -> dict[int, str]:
    owner = {}
    r = next(iter(nodes.values()))
    for lo, hi, master, *_ in r.execute_command("CLUSTER SLOTS"):
        for s in range(lo, hi + 1):
            owner[s] = f"{master[0].decode()}:{master[1]}"
    return owner


def measure(nodes: dict[str, redis.Redis], seconds: float) -> dict[str, dict[str, float]]:
    for r in nodes.values():
        r.config_resetstat()
    t0 = time.monotonic()
    before = {n: int(r.info("stats")["total_commands_processed"]) for n, r in nodes.items()}
    time.sleep(seconds)
    dt = time.monotonic() - t0
    out = {}
    for n, r in nodes.items():
        ops = (int(r.info("stats")["total_commands_processed"]) - before[n]) / dt
        lat = r.info("latencystats").get("latency_percentiles_usec_evalsha", {})
        out[n] = {"ops_per_s": round(ops), "p50_ms": lat.get("p50", 0) / 1000,
                  "p99_ms": lat.get("p99", 0) / 1000}
    return out


def table(title: str, m: dict[str, dict[str, float]]) -> None:
    print(f"\n{title}")
    print(f"{'master':<18} {'ops/s':>9} {'EVALSHA p50':>12} {'p99':>9}")
    for n, v in sorted(m.items()):
        print(f"{n:<18} {v['ops_per_s']:>9,.0f} {v['p50_ms']:>10.3f}ms {v['p99_ms']:>7.3f}ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=float, default=10.0)
    ap.add_argument("--hot-groups", type=int, default=4)
    ap.add_argument("--keys", type=int, default=60, help="keys per hot group")
    ap.add_argument("--policy", choices=["threshold", "learned"], default="threshold")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="kvcomm-balance-")
    state = devcluster.up(3, d)
    seeds = [(a.rpartition(":")[0], int(a.rpartition(":")[2])) for a in state["redis"]]
    procs: list[Any] = []
    try:
        nodes = masters(seeds)
        owner = slot_owner(nodes)
        g = groups_of(kvcomm.Config.load(state["hosts"][0]["config"]).cluster.groups)
        hot_node = sorted(nodes)[0]
        hot = [x for x in g if owner[g.slot(x)] == hot_node][:args.hot_groups]
        keys: dict[int, list[str]] = {x: [] for x in hot}
        i = 0
        while any(len(v) < args.keys for v in keys.values()):
            k = f"hot/{i}/state"
            if g.of(k) in keys and len(keys[g.of(k)]) < args.keys:
                keys[g.of(k)].append(k)
            i += 1
        background = [f"bg/{i}/state" for i in range(90)]
        hot_keys = [k for v in keys.values() for k in v]
        print(f"dev cluster in {d}: hot groups {hot} (slots "
              f"{[g.slot(x) for x in hot]}) all on {hot_node}, {len(hot_keys)} hot keys, "
              f"{len(background)} background keys")
        stop = CTX.Event()
        for h, host in enumerate(state["hosts"]):
            mine = hot_keys[h::3]
            for part in (mine[: len(mine) // 2], mine[len(mine) // 2:], background[h::3]):
                p = CTX.Process(target=_writer, args=(host["config"], part, stop))
                p.start()
                procs.append(p)
        time.sleep(args.window)  # the writers warm up (and the daemons' first sweeps end)
        before = measure(nodes, args.window)
        table("before", before)
        out = subprocess.run(
            [sys.executable, "-m", "kvcomm", "balance", "--config", state["hosts"][0]["config"],
             "--once", "--window", f"{args.window:g}s", "--policy", args.policy,
             *(["--dry-run"] if args.dry_run else [])],
            capture_output=True, text=True, timeout=10 * args.window + 120)
        sys.stderr.write(out.stderr)
        report = json.loads(out.stdout.strip().splitlines()[-1])
        print("\nkvcomm balance --once:", json.dumps({k: report[k] for k in (
            "moves", "bytes_moved", "load_before", "load_after")}))
        for dec in report["decisions"]:
            print(f"  slot {dec['slot']}: {dec['reason']}")
        after = measure(nodes, args.window)
        table("after", after)
        top_b = max(v["ops_per_s"] for v in before.values())
        top_a = max(v["ops_per_s"] for v in after.values())
        print(f"\nbusiest master: {top_b:,.0f} -> {top_a:,.0f} ops/s "
              f"({100 * (top_a - top_b) / top_b:+.0f}%); slots moved: {len(report['moves'])}, "
              f"{report['bytes_moved']:,} bytes")
        stop.set()
        for p in procs:
            p.join(60)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        missing = converged([h["config"] for h in state["hosts"]], hot_keys + background, 60)
        print(f"nothing lost: every host reads every key's last acknowledged write: "
              f"{'yes' if not any(missing.values()) else 'NO'} "
              f"({len(hot_keys) + len(background)} keys x {len(missing)} hosts; missing "
              f"{sum(missing.values())})")
        if any(missing.values()):
            return 1
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join()
        devcluster.down(d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
