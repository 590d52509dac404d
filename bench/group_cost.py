"""What the number of hash-slot groups (``cluster.groups``) costs: Redis commands per
second per host on an idle dev cluster, and cross-host propagation, for 16, 1,024 and
16,384 groups (docs/balancing.md: the group-count cost table).

    .venv/bin/python bench/group_cost.py [--groups 16,1024,16384] [--hosts 3]
                                         [--idle 20] [--settle 20] [--samples 40]
                                         [--swarm 0] [--json FILE]

For each group count: a fresh dev cluster of ``--hosts`` hosts (``kvcomm dev-cluster``:
3 masters + 3 replicas, default windows: 50 ms L2 sync, 20 ms feed poll), left to
settle ``--settle`` seconds (the daemons' start: scans, first sweeps); then Redis'
counters are reset and read again ``--idle`` seconds later: the commands every master
processed (INFO ``total_commands_processed``, the two INFO calls of the measurement
taken off), divided by the seconds and the hosts, is the idle cost per host; the
commands by name say where it goes. With ``--swarm S``, bench_cluster.py's swarm (8
agents per host at 50 Hz) runs S seconds and the same counters are read. Then
propagation: a put on host 1, seen by a spinning reader on host 2, ``--samples`` times
(p50/p99).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
from _timing import percentile, propagation_reader

import kvcomm
from kvcomm import devcluster

CTX = mp.get_context("fork")


def masters(addresses: list[str]) -> list[redis.Redis]:
    out = []
    for a in addresses:
        h, _, p = a.rpartition(":")
        r = redis.Redis(host=h, port=int(p))
        if r.info("replication")["role"] == "master":
            out.append(r)
    return out


def counters(nodes: list[redis.Redis]) -> tuple[int, dict[str, int]]:
    by: dict[str, int]
    total, by = 0, {}
    for r in nodes:
        info = r.info("all")
        total += int(info["total_commands_processed"])
        for k, v in info.items():
            if k.startswith("cmdstat_") and isinstance(v, dict):
                by[k[8:]] = by.get(k[8:], 0) + int(v.get("calls", 0))
    return total, by


def measure(nodes: list[redis.Redis], seconds: float, hosts: int) -> dict[str, Any]:
    for r in nodes:
        r.config_resetstat()
    t0 = time.monotonic()
    time.sleep(seconds)
    total, by = counters(nodes)
    dt = time.monotonic() - t0
    total -= len(nodes)  # this measurement's own INFO on each master
    by["info"] = by.get("info", 0) - len(nodes)
    return {"seconds": round(dt, 2), "commands_per_s_per_host": round(total / dt / hosts, 1),
            "by_command_per_s_per_host": {k: round(v / dt / hosts, 1)
                                          for k, v in sorted(by.items(), key=lambda kv: -kv[1])
                                          if v > 0}}




def propagation(state: dict[str, Any], n: int) -> dict[str, Any]:
    a = kvcomm.open(config=state["hosts"][0]["config"])
    try:
        a.put("prop/x", time.perf_counter_ns())
        out: Any = CTX.Queue()
        done = CTX.Event()
        rx = CTX.Process(target=propagation_reader,
                         args=(state["hosts"][1]["config"], n, out, done, 120.0))
        rx.start()
        deadline = time.monotonic() + 150
        while not done.is_set() and time.monotonic() < deadline:
            a.put("prop/x", time.perf_counter_ns())
            time.sleep(0.1)  # longer than any propagation: samples do not overlap
        lat = out.get(timeout=60)
        rx.join()
    finally:
        a.close()
    return {"samples": len(lat), "p50_ms": round(percentile(lat, 0.5) / 1e6, 1),
            "p99_ms": round(percentile(lat, 0.99) / 1e6, 1)}


def one(groups: int, args: argparse.Namespace) -> dict[str, Any]:
    d = tempfile.mkdtemp(prefix=f"kvcomm-groups{groups}-")
    t0 = time.monotonic()
    state = devcluster.up(args.hosts, d, groups=groups)
    row: dict[str, Any] = {"groups": groups, "hosts": args.hosts,
                           "up_s": round(time.monotonic() - t0, 1)}
    try:
        nodes = masters(state["redis"])
        time.sleep(args.settle)
        row["idle"] = measure(nodes, args.idle, args.hosts)
        print(f"groups {groups}: idle {row['idle']['commands_per_s_per_host']:,} commands/s "
              f"per host ({row['idle']['by_command_per_s_per_host']})", flush=True)
        if args.swarm > 0:
            sys.path.insert(0, str(Path(__file__).parent))
            import bench_cluster

            for r in nodes:
                r.config_resetstat()
            t1 = time.monotonic()
            res = bench_cluster.run_swarm("kvcomm", [h["config"] for h in state["hosts"]],
                                          args.swarm, nodes)
            dt = time.monotonic() - t1
            sv = res["server"]
            row["swarm"] = {"seconds": round(dt, 1), "puts": res["puts"],
                            "commands_per_s_per_host": round(
                                sv["total_commands_processed"] / dt / args.hosts, 1)}
            print(f"groups {groups}: swarm {row['swarm']}", flush=True)
        row["propagation"] = propagation(state, args.samples)
        print(f"groups {groups}: propagation {row['propagation']}", flush=True)
    finally:
        devcluster.down(d)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", default="16,1024,16384")
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--idle", type=float, default=20.0, help="seconds measured idle")
    ap.add_argument("--settle", type=float, default=20.0, help="seconds after start, unmeasured")
    ap.add_argument("--samples", type=int, default=40, help="propagation samples")
    ap.add_argument("--swarm", type=float, default=0.0, help="seconds of swarm (0: none)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    rows = [one(int(g), args) for g in args.groups.split(",")]
    print("\n| groups | idle commands/s per host | swarm commands/s per host "
          "| propagation p50 | p99 |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        sw = r.get("swarm", {}).get("commands_per_s_per_host")
        print(f"| {r['groups']:,} | {r['idle']['commands_per_s_per_host']:,} | "
              f"{'not measured' if sw is None else f'{sw:,}'} | "
              f"{r['propagation']['p50_ms']} ms | {r['propagation']['p99_ms']} ms |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
