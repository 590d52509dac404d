"""Cluster mode against its baseline, in one run: 3 hosts × 8 agents on a real Redis Cluster.

    python bench/bench_cluster.py [--seconds 10] [--quick]

The swarm: 24 agents (8 per host), each at 50 Hz reads the states of 8 neighbours
(agents i±1..±4, so some live on other hosts) plus 2 keys that do not exist (20% of
reads), and publishes its own state. KVCOMM: agents open their host's config from
``kvcomm dev-cluster``; the baseline: every agent reads and writes the same Redis Cluster
directly with redis-py (msgpack values, as KVCOMM stores them). Redis' own counters
(INFO, summed over the masters, reset before each run) give the commands and bytes.
Then cross-host propagation (put on host 1 → seen by a spinning reader on host 2) with
a 50 ms and a 5 ms window.
"""

from __future__ import annotations

import argparse
import array
import multiprocessing as mp
import random
import sys
import tempfile
import time
from typing import Any

import msgpack
import redis
from _timing import percentile, propagation_reader

import kvcomm
from kvcomm import devcluster
from kvcomm.tiers.l2 import purge
from kvcomm.tiers.l3 import GROUPS, feed_key

CTX = mp.get_context("fork")
HOSTS, PER_HOST, RATE, NEIGHBOURS, ABSENT = 3, 8, 50.0, 8, 2
RESULTS = "bench-cluster-results"
RES_CFG = kvcomm.Config.from_mapping({"cache": {"l2_size": "32MB"}})


def _agent(kind: str, target: Any, i: int, seconds: float, start_at: float) -> None:
    n = HOSTS * PER_HOST
    rng = random.Random(i)
    peers = [(i + d) % n for d in (-4, -3, -2, -1, 1, 2, 3, 4)]
    keys = [f"swarm/{j}/state" for j in peers]
    mine = f"swarm/{i}/state"
    if kind == "kvcomm":
        kv = kvcomm.open(config=target)
        get, put = kv.get, kv.put
    else:
        from redis.cluster import ClusterNode, RedisCluster

        rc = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in target])

        def get(k: str) -> Any:
            raw = rc.get(k)
            return None if raw is None else msgpack.unpackb(raw)

        def put(k: str, v: Any) -> None:
            rc.set(k, msgpack.packb(v))

    state = {"id": i, "pos": [rng.random() * 100, rng.random() * 100, 30.0], "vel": [0.1, 0.0, 0.0],
             "battery": 100.0, "ts": time.time(), "detected": []}
    put(mine, state)
    while time.time() < start_at:
        time.sleep(0.001)
    tick = 1.0 / RATE
    next_t = time.monotonic() + tick * (i % PER_HOST) / PER_HOST
    end = next_t + seconds
    ticks = array.array("I")
    absent_l3 = absent = 0
    clock = time.perf_counter_ns
    while next_t < end:
        t0 = clock()
        seen = [get(k) for k in keys]
        for _ in range(ABSENT):
            absent += 1
            if kind == "kvcomm":
                before = kv.counters["l3_reads"]
                get(f"nobody/{rng.randrange(10**9)}")
                absent_l3 += kv.counters["l3_reads"] - before
            else:
                get(f"nobody/{rng.randrange(10**9)}")
                absent_l3 += 1
        near = [s for s in seen if s is not None]
        pos = state["pos"]
        if near:
            pos = [pos[0] * 0.99 + 0.01 * sum(s["pos"][0] for s in near) / len(near),
                   pos[1] * 0.99 + 0.01 * sum(s["pos"][1] for s in near) / len(near), pos[2]]
        state = {"id": i, "pos": pos, "vel": state["vel"], "battery": state["battery"] - 0.01,
                 "ts": time.time(), "detected": []}
        put(mine, state)
        ticks.append(min(clock() - t0, 2**32 - 1))
        next_t += tick
        delay = next_t - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    stats = kv.stats() if kind == "kvcomm" else {}
    with kvcomm.open(RESULTS, config=RES_CFG) as res:
        res.put(f"{i}/ticks", ticks.tobytes())
        res.put(f"{i}/info", {"stats": stats, "absent": absent, "absent_l3": absent_l3,
                              "puts": len(ticks) + 1})
    if kind == "kvcomm":
        kv.close()


def masters(seeds: list[tuple[str, int]]) -> list[redis.Redis]:
    out = []
    for h, p in seeds:
        r = redis.Redis(host=h, port=p)
        if r.info("replication")["role"] == "master":
            out.append(r)
    return out


def server_counters(nodes: list[redis.Redis]) -> dict[str, int]:
    tot: dict[str, int] = {}
    for r in nodes:
        info = r.info("all")
        for k in ("total_commands_processed", "total_net_input_bytes", "total_net_output_bytes"):
            tot[k] = tot.get(k, 0) + int(info[k])
        for cmd in ("evalsha", "xrange", "xadd", "get", "set", "scan", "hset", "hgetall"):
            tot[cmd] = tot.get(cmd, 0) + int(info.get(f"cmdstat_{cmd}", {}).get("calls", 0))
    return tot


def run_swarm(kind: str, targets: list[Any], seconds: float, nodes: list[redis.Redis]) -> dict[str, Any]:
    purge(RESULTS)
    for r in nodes:
        r.config_resetstat()
    start_at = time.time() + 1.0 + 0.05 * HOSTS * PER_HOST
    procs = [CTX.Process(target=_agent, args=(kind, targets[i // PER_HOST], i, seconds, start_at))
             for i in range(HOSTS * PER_HOST)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"{kind} agent failed with {p.exitcode}")
    counters = server_counters(nodes)
    ticks: list[int] = []
    agg: dict[str, int] = {"l1": 0, "l2": 0, "miss": 0, "l3_reads": 0, "filter": 0, "negative": 0,
                           "absent": 0, "absent_l3": 0, "puts": 0}
    with kvcomm.open(RESULTS, config=RES_CFG) as res:
        for i in range(HOSTS * PER_HOST):
            ticks.extend(array.array("I", res.get(f"{i}/ticks")))
            info = res.get(f"{i}/info")
            agg["absent"] += info["absent"]
            agg["absent_l3"] += info["absent_l3"]
            agg["puts"] += info["puts"]
            st = info["stats"]
            if st:
                agg["l1"] += st["l1"]["hits"]
                agg["l2"] += st["l2"]["hits"]
                agg["miss"] += st["l2"]["misses"]
                agg["l3_reads"] += st["l3"]["reads"]
                agg["filter"] += st["l3"]["filter_hits"]
                agg["negative"] += st["l3"]["negative_hits"]
    purge(RESULTS)
    return {"ticks": ticks, "server": counters, **agg}


def pct(xs: list[int], q: float) -> float:
    """The ``q`` quantile of ``xs`` (ns), in ms."""
    return percentile(xs, q) / 1e6




def propagation(window: str, poll: str, n: int, inline: int | None = None) -> tuple[float, float]:
    """(p50, p99) ms from a put on host 1 to a reader on host 2 seeing it; ``inline``:
    ``cluster.feed_inline`` (0: every feed entry value-less, the record read by GET)."""
    d = tempfile.mkdtemp(prefix="kvcomm-prop-")
    state = devcluster.up(2, d, sync_interval=window, feed_poll=poll,
                          cluster_settings=None if inline is None else {"feed_inline": inline})
    try:
        a = kvcomm.open(config=state["hosts"][0]["config"])
        a.put("prop/x", time.perf_counter_ns())
        out: Any = CTX.Queue()
        done = CTX.Event()
        rx = CTX.Process(target=propagation_reader, args=(state["hosts"][1]["config"], n, out, done))
        rx.start()
        deadline = time.monotonic() + 90
        while not done.is_set() and time.monotonic() < deadline:
            a.put("prop/x", time.perf_counter_ns())
            time.sleep(0.1)  # longer than any propagation: samples do not overlap
        lat = out.get(timeout=60)
        rx.join()
        a.close()
        return pct(lat, 0.5), pct(lat, 0.99)
    finally:
        devcluster.down(d)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--quick", action="store_true", help="3 s runs, fewer propagation samples")
    ap.add_argument("--plot", metavar="PNG", help="write the agents' tick-time CDFs, kvcomm vs "
                    "the baseline, to this PNG (needs kvcomm[plot])")
    args = ap.parse_args()
    seconds = 3.0 if args.quick else args.seconds
    d = tempfile.mkdtemp(prefix="kvcomm-bench-")
    state = devcluster.up(HOSTS, d)
    seeds = [(a.rpartition(":")[0], int(a.rpartition(":")[2])) for a in state["redis"]]
    try:
        nodes = masters(seeds)
        print(f"{HOSTS} hosts x {PER_HOST} agents, {RATE:g} Hz, {NEIGHBOURS} neighbour reads + "
              f"{ABSENT} absent-key reads per tick, {seconds:g} s per run; Redis Cluster "
              f"{len(nodes)} masters + {len(seeds) - len(nodes)} replicas")
        ours = run_swarm("kvcomm", [h["config"] for h in state["hosts"]], seconds, nodes)
        from redis.cluster import ClusterNode, RedisCluster

        rc = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in seeds])
        feed_mem = sum(int(rc.memory_usage(feed_key(g)) or 0) for g in range(GROUPS))
        feed_len = sum(int(rc.xlen(feed_key(g))) for g in range(GROUPS))
        rc.close()
        base = run_swarm("baseline", [seeds] * HOSTS, seconds, nodes)
    finally:
        devcluster.down(d)

    reads_real = ours["l1"] + ours["l2"] + ours["miss"] - ours["absent"]
    print("\n== the swarm: kvcomm vs every agent on Redis Cluster directly")
    row = "{:<52} {:>14} {:>14} {:>9}"
    print(row.format("", "kvcomm", "baseline", "ratio"))

    def line(name: str, a: float, b: float | None, fmt: str = "{:,.0f}", inverse: bool = False) -> None:
        ratio = "" if b in (None, 0) else f"{(b / a if inverse else a / b):.2f}"
        print(row.format(name, fmt.format(a), "" if b is None else fmt.format(b), ratio))

    line("ticks flown", len(ours["ticks"]), len(base["ticks"]))
    sv, bv = ours["server"], base["server"]
    line("commands to Redis (masters)", sv["total_commands_processed"], bv["total_commands_processed"])
    line("bytes sent to Redis (masters' net input)", sv["total_net_input_bytes"], bv["total_net_input_bytes"])
    line("bytes from Redis (masters' net output)", sv["total_net_output_bytes"], bv["total_net_output_bytes"])
    line("writes to L3 (EVALSHA merges / SETs)", sv["evalsha"], bv["set"])
    line("agent puts", ours["puts"], base["puts"])
    line("tick time p50 (ms)", pct(ours["ticks"], 0.5), pct(base["ticks"], 0.5), "{:.3f}")
    line("tick time p99 (ms)", pct(ours["ticks"], 0.99), pct(base["ticks"], 0.99), "{:.3f}")
    total_reads = ours["l1"] + ours["l2"] + ours["miss"]
    print(f"\nreads served on the host (L1 + L2): {100 * (ours['l1'] + ours['l2']) / total_reads:.2f}% "
          f"of all reads; of reads of existing keys: "
          f"{100 * (ours['l1'] + ours['l2']) / max(1, reads_real):.2f}% "
          f"(L1 {ours['l1']:,}, L2 {ours['l2']:,}, L3 reads {ours['l3_reads']:,})")
    print(f"absent-key reads: {ours['absent']:,}; reached L3: {ours['absent_l3']:,} "
          f"({100 * (1 - ours['absent_l3'] / max(1, ours['absent'])):.3f}% stayed on the host; "
          f"key filter {ours['filter']:,}, negative cache {ours['negative']:,})")
    print(f"write coalescing: {ours['puts']:,} puts became {sv['evalsha']:,} L3 merges "
          f"({ours['puts'] / max(1, sv['evalsha']):.2f}x fewer writes); the baseline sends "
          f"{bv['set']:,} SETs")
    print(f"change feed: {sv['xrange']:,} XRANGE reads ({sv['xrange'] / seconds:,.0f}/s for {HOSTS} hosts), "
          f"{feed_len:,} stream entries kept, {feed_mem / 1024:,.0f} KiB of stream memory")

    if args.plot:
        from kvcomm.loadtest.plots import cdf

        print("wrote", cdf({"kvcomm": [t / 1e3 for t in ours["ticks"]],
                            "Redis Cluster directly": [t / 1e3 for t in base["ticks"]]},
                           f"bench_cluster: agent tick time ({HOSTS} hosts x {PER_HOST} agents, "
                           f"{RATE:g} Hz, {NEIGHBOURS} neighbours + {ABSENT} absent keys)",
                           args.plot, xlabel="tick time (µs, log scale)"))
    n = 20 if args.quick else 60
    print("\n== cross-host propagation (put on host 1 -> a spinning reader on host 2 sees it)")
    for window, poll, inline in (("50ms", "20ms", None), ("5ms", "5ms", None), ("5ms", "5ms", 0)):
        p50, p99 = propagation(window, poll, n, inline)
        how = "" if inline is None else ", every feed entry value-less (feed_inline 0)"
        print(f"window {window}, feed poll {poll}{how}: p50 {p50:.1f} ms, p99 {p99:.1f} ms "
              f"({n} samples)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
