"""``kvcomm demo``: a drone swarm flying on KVCOMM, then the same swarm on a central store.

N agent processes fly a flocking (boids) simulation. Every tick each drone reads the
states of its neighbours (``drone/<j>/state``), steers (cohesion, alignment,
separation), drains a little battery, "detects" objects near it, and publishes its own
state. A mission-control process follows ``drone/`` and keeps a map of the swarm.

The identical scenario then runs against a central store (Redis over loopback when
``redis-server`` is installed, else a ``multiprocessing`` manager dict), with msgpack
encoding so both sides pay for serialisation. Agents report their latencies through a
KVCOMM namespace of their own, not a pickled queue.
"""

from __future__ import annotations

import argparse
import array
import math
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import msgpack

from .._client import Client
from .._client import open as kv_open
from .._extras import available, require, require_cluster
from ..config import Config, load_config
from ..tiers.l2 import purge

WORLD = 200.0


class Store:
    """What an agent needs from a shared store: get a state, put a state, say its tiers."""

    def get(self, key: str) -> Any: ...
    def put(self, key: str, value: Any) -> None: ...
    def stats(self) -> dict[str, Any]:
        return {}
    def close(self) -> None: ...


class KvcommStore(Store):
    def __init__(self, name: str | None, config: Config) -> None:
        self.kv: Client = kv_open(name, config=config)

    def get(self, key: str) -> Any:
        return self.kv.get(key)

    def put(self, key: str, value: Any) -> None:
        self.kv.put(key, value)

    def stats(self) -> dict[str, Any]:
        return self.kv.stats()

    def close(self) -> None:
        self.kv.close()


class RedisStore(Store):
    def __init__(self, port: int) -> None:
        import redis

        self.r = redis.Redis(host="127.0.0.1", port=port)

    def get(self, key: str) -> Any:
        raw = self.r.get(key)
        return None if raw is None else msgpack.unpackb(raw)

    def put(self, key: str, value: Any) -> None:
        self.r.set(key, msgpack.packb(value))

    def close(self) -> None:
        self.r.close()


class RedisClusterStore(RedisStore):
    def __init__(self, seeds: list[tuple[str, int]]) -> None:  # noqa: D107 - same store, other client
        from redis.cluster import ClusterNode, RedisCluster

        self.r = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in seeds])  # type: ignore[no-untyped-call,assignment]


class ManagerStore(Store):
    def __init__(self, proxy: Any) -> None:
        self.d = proxy

    def get(self, key: str) -> Any:
        raw = self.d.get(key)
        return None if raw is None else msgpack.unpackb(raw)

    def put(self, key: str, value: Any) -> None:
        self.d[key] = msgpack.packb(value)


# ---------------------------------------------------------------- the swarm


def _steer(me: dict[str, Any], others: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    px, py, pz = me["pos"]
    vx, vy, vz = me["vel"]
    if others:
        n = len(others)
        cx = sum(o["pos"][0] for o in others) / n
        cy = sum(o["pos"][1] for o in others) / n
        cz = sum(o["pos"][2] for o in others) / n
        ax = sum(o["vel"][0] for o in others) / n
        ay = sum(o["vel"][1] for o in others) / n
        az = sum(o["vel"][2] for o in others) / n
        vx += 0.01 * (cx - px) + 0.05 * (ax - vx)
        vy += 0.01 * (cy - py) + 0.05 * (ay - vy)
        vz += 0.01 * (cz - pz) + 0.05 * (az - vz)
        for o in others:
            dx, dy, dz = px - o["pos"][0], py - o["pos"][1], pz - o["pos"][2]
            d2 = dx * dx + dy * dy + dz * dz
            if d2 < 25.0:
                vx, vy, vz = vx + 0.05 * dx, vy + 0.05 * dy, vz + 0.05 * dz
    speed = math.sqrt(vx * vx + vy * vy + vz * vz) or 1.0
    if speed > 4.0:
        vx, vy, vz = vx * 4.0 / speed, vy * 4.0 / speed, vz * 4.0 / speed
    pos = [(px + vx * 0.1) % WORLD, (py + vy * 0.1) % WORLD, min(max(pz + vz * 0.1, 5.0), 120.0)]
    return pos, [vx, vy, vz]


def _agent(make_store: Callable[[int], Store], results: tuple[str, Config], i: int, n: int,
           rate: float, seconds: float, neighbours: int, start_at: float) -> None:
    store = make_store(i)
    rng = random.Random(i)
    me: dict[str, Any] = {
        "id": i,
        "pos": [rng.uniform(0, WORLD), rng.uniform(0, WORLD), rng.uniform(20, 80)],
        "vel": [rng.uniform(-1, 1), rng.uniform(-1, 1), 0.0],
        "battery": 100.0, "ts": time.time(), "detected": [],
    }
    half = max(1, neighbours // 2)
    peers = [(i + d) % n for d in range(-half, half + 1) if d and (i + d) % n != i][:neighbours]
    keys = [f"drone/{j}/state" for j in peers]
    my_key = f"drone/{i}/state"
    store.put(my_key, me)
    gets, puts = array.array("I"), array.array("I")
    clock = time.perf_counter_ns
    while time.time() < start_at:
        time.sleep(0.001)
    tick = 1.0 / rate
    # drones do not share a clock phase: spread their ticks over the period (same in both runs)
    next_t = time.monotonic() + tick * i / n
    end = next_t + seconds
    ticks = 0
    while next_t < end:
        others = []
        for k in keys:
            t0 = clock()
            s = store.get(k)
            gets.append(min(clock() - t0, 2**32 - 1))
            if s is not None:
                others.append(s)
        pos, vel = _steer(me, others)
        detected = [{"kind": "obstacle", "x": round(p, 1)} for p in pos[:2] if rng.random() < 0.1]
        me = {"id": i, "pos": pos, "vel": vel, "battery": me["battery"] - 0.01,
              "ts": time.time(), "detected": detected}
        t0 = clock()
        store.put(my_key, me)
        puts.append(min(clock() - t0, 2**32 - 1))
        ticks += 1
        next_t += tick
        delay = next_t - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    with kv_open(results[0], config=results[1]) as res:
        res.put(f"{i}/get", gets.tobytes())
        res.put(f"{i}/put", puts.tobytes())
        res.put(f"{i}/info", {"ticks": ticks, "stats": store.stats()})
    store.close()


def _mission_control(make_store: Callable[[int], Store], results: tuple[str, Config], n: int,
                     rate: float, seconds: float, start_at: float, use_watch: bool) -> None:
    store = make_store(0)
    swarm: dict[int, list[float]] = {}
    updates = 0
    while time.time() < start_at:
        time.sleep(0.001)
    end = time.monotonic() + seconds
    if use_watch and isinstance(store, KvcommStore):
        for j in range(n):  # hold every drone on this host, so that its updates arrive here
            store.kv.get(f"drone/{j}/state")
        for ev in store.kv.watch("drone/", timeout=0.2):
            if time.monotonic() > end:
                break
            if ev.kind == "put":
                s = store.kv.get(ev.key)
                if s is not None:
                    swarm[s["id"]] = s["pos"]
                    updates += 1
    else:  # a central store has no change feed: poll every drone every tick
        keys = [f"drone/{j}/state" for j in range(n)]
        while time.monotonic() < end:
            for k in keys:
                s = store.get(k)
                if s is not None:
                    swarm[s["id"]] = s["pos"]
                    updates += 1
            time.sleep(1.0 / rate)
    with kv_open(results[0], config=results[1]) as res:
        res.put("mission", {"tracked": len(swarm), "updates": updates})
    store.close()


def _run_swarm(label: str, make_store: Callable[[int], Store], args: argparse.Namespace,
               results: tuple[str, Config], use_watch: bool) -> dict[str, Any]:
    """Fly one swarm; agents report through the KVCOMM namespace ``results[0]``."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    purge(results[0])
    ctx = mp.get_context("fork")
    start_at = time.time() + 0.5 + 0.05 * args.agents
    procs = [ctx.Process(target=_agent, args=(make_store, results, i, args.agents, args.rate,
                                              args.seconds, args.neighbours, start_at))
             for i in range(args.agents)]
    procs.append(ctx.Process(target=_mission_control,
                             args=(make_store, results, args.agents, args.rate, args.seconds,
                                   start_at, use_watch)))
    for p in procs:
        p.start()
    with Progress(TextColumn(f"[bold]{label:<28}"), BarColumn(), TimeRemainingColumn(),
                  transient=False) as bar:
        task = bar.add_task(label, total=args.seconds)
        while any(p.is_alive() for p in procs):
            bar.update(task, completed=min(max(0.0, time.time() - start_at), args.seconds))
            time.sleep(0.1)
        bar.update(task, completed=args.seconds)
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed:
        raise SystemExit(f"{label}: {len(failed)} agent processes failed (exit codes {failed})")
    gets: list[int] = []
    puts: list[int] = []
    ticks = 0
    tiers = {"l1": 0, "l2": 0, "miss": 0}
    with kv_open(results[0], config=results[1]) as res:
        for i in range(args.agents):
            gets.extend(array.array("I", res.get(f"{i}/get")))
            puts.extend(array.array("I", res.get(f"{i}/put")))
            info = res.get(f"{i}/info")
            ticks += info["ticks"]
            st = info["stats"]
            if st:
                tiers["l1"] += st["l1"]["hits"]
                tiers["l2"] += st["l2"]["hits"]
                tiers["miss"] += st["l2"]["misses"]
        mission = res.get("mission")
    purge(results[0])
    return {"gets": gets, "puts": puts, "ticks": ticks, "tiers": tiers, "mission": mission}


def _pct(values: list[int], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] / 1000.0


def _choose_baseline(choice: str) -> str:
    """The baseline to run: ``auto`` is Redis when both redis-server and redis-py are
    installed, else the manager. Raises ConfigError when ``redis`` is asked for without
    redis-py."""
    from ..devcluster.redis_server import redis_server_path

    if choice == "auto":
        return "redis" if redis_server_path() and available("redis") else "manager"
    if choice == "redis":
        require_cluster("the demo's Redis baseline")
    return choice


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo as ``kvcomm demo`` was asked; returns the exit status. Raises
    ConfigError (before anything runs) when an extra it needs is missing."""
    require("rich", extra="demo", purpose="kvcomm demo")
    if args.plot:
        require("matplotlib", extra="plot", purpose="kvcomm demo --plot")
    if args.cluster:
        require_cluster("kvcomm demo --cluster")
    from rich.console import Console

    if args.agents < 2 or args.seconds <= 0 or args.rate <= 0 or args.neighbours < 1:
        print("kvcomm demo: need --agents >= 2, --seconds > 0, --rate > 0, --neighbours >= 1",
              file=sys.stderr)
        return 2
    baseline = _choose_baseline(args.baseline)
    console = Console()
    cfg = load_config(args.config)
    results = (f"{args.name}-results", Config.from_mapping({"cache": {"l2_size": "64MB"}}))
    purge(args.name, cfg.cache.l2_dir)
    console.print(f"[bold]KVCOMM swarm demo[/]: {args.agents} drones, {args.rate:g} Hz, "
                  f"{args.seconds:g} s, {args.neighbours} neighbours read per tick")
    console.print(f"baseline: {baseline}; this demo's pid {os.getpid()}")
    if args.cluster:
        return _run_cluster_demo(args, console, results)
    ours = _run_swarm("kvcomm (L1+L2, embedded)", lambda i: KvcommStore(args.name, cfg), args,
                      results, use_watch=True)
    purge(args.name, cfg.cache.l2_dir)
    theirs: dict[str, Any] | None = None
    server = manager = None
    try:
        if baseline == "redis":
            from ..devcluster.redis_server import RedisServer

            server = RedisServer().start()
            port = server.port
            theirs = _run_swarm("central store: redis (TCP)", lambda i: RedisStore(port), args,
                                results, use_watch=False)
        elif baseline == "manager":
            manager = mp.get_context("fork").Manager()
            proxy = manager.dict()
            theirs = _run_swarm("central store: mp manager", lambda i: ManagerStore(proxy), args,
                                results, use_watch=False)
    finally:
        if server is not None:
            server.stop()
        if manager is not None:
            manager.shutdown()

    _report(console, args, ours, theirs, baseline)
    purge(args.name, cfg.cache.l2_dir)
    return 0


def _run_cluster_demo(args: argparse.Namespace, console: Any,
                      results: tuple[str, Config]) -> int:
    """The swarm over 3 hosts of a local cluster, against every agent on Redis Cluster."""
    import shutil
    import tempfile

    from .. import devcluster

    if shutil.which("redis-server") is None:
        console.print("--cluster needs Redis: apt-get install redis-server (Debian), then retry")
        return 2
    d = tempfile.mkdtemp(prefix="kvcomm-demo-cluster-")
    console.print(f"starting a local cluster in {d}: Redis Cluster (3 masters + 3 replicas) "
                  "and 3 hosts, each with its node daemon")
    state = devcluster.up(3, d)
    configs = [h["config"] for h in state["hosts"]]
    seeds = [(a.rpartition(":")[0], int(a.rpartition(":")[2])) for a in state["redis"]]
    try:
        ours = _run_swarm("kvcomm, 3 hosts (L1+L2+L3)",
                          lambda i: KvcommStore(None, load_config(configs[i % 3])),
                          args, results, use_watch=True)
        theirs = _run_swarm("every agent on Redis Cluster", lambda i: RedisClusterStore(seeds),
                            args, results, use_watch=False)
    finally:
        devcluster.down(d)
    _report(console, args, ours, theirs, "redis cluster")
    return 0


def _report(console: Any, args: argparse.Namespace, ours: dict[str, Any],
            theirs: dict[str, Any] | None, baseline: str) -> None:
    from rich.table import Table

    table = Table(title="drone swarm: kvcomm vs central store")
    table.add_column("metric")
    table.add_column("kvcomm", justify="right")
    table.add_column(baseline if theirs else "baseline", justify="right")
    table.add_column("kvcomm's gain", justify="right")

    def row(name: str, ours_v: float, theirs_v: float | None, fmt: str = "{:.1f}",
            better: str = "") -> None:
        """A row; ``better``: which way a gain goes (see _gain)."""
        table.add_row(name, fmt.format(ours_v), "" if theirs_v is None else fmt.format(theirs_v),
                      _gain(ours_v, theirs_v, better))

    def both(fn: Callable[[dict[str, Any]], float]) -> tuple[float, float | None]:
        return fn(ours), (None if theirs is None else fn(theirs))

    row("ticks flown", *both(lambda r: r["ticks"]), "{:.0f}", "higher")
    row("get ops", *both(lambda r: len(r["gets"])), "{:.0f}", "higher")
    row("put ops", *both(lambda r: len(r["puts"])), "{:.0f}", "higher")
    for op in ("gets", "puts"):
        for q, qn in ((0.5, "p50"), (0.99, "p99")):
            ours_p = _pct(ours[op], q)
            theirs_p = None if theirs is None else _pct(theirs[op], q)
            row(f"{op[:-1]} latency {qn} (µs)", ours_p, theirs_p, "{:.2f}", "lower")
    t = ours["tiers"]
    lookups = t["l1"] + t["l2"] + t["miss"]
    if lookups:
        table.add_row("served by L1 (this process)", f"{100 * t['l1'] / lookups:.1f}%", "", "")
        table.add_row("served by L2 (host shm)", f"{100 * t['l2'] / lookups:.1f}%", "", "")
        table.add_row("L2 misses (L3 in a cluster)",
                      f"{100 * t['miss'] / lookups:.2f}%", "", "")
    m = ours["mission"]
    tm = theirs["mission"] if theirs else None
    table.add_row("mission: drones tracked", f"{m['tracked']}/{args.agents}",
                  f"{tm['tracked']}/{args.agents}" if tm else "", "")
    table.add_row("mission: updates seen", _share(m["updates"], len(ours["puts"]), "watch"),
                  _share(tm["updates"], len(theirs["puts"]), "polling") if tm and theirs else "",
                  _gain(m["updates"], tm["updates"] if tm else None, "higher"))
    console.print(table)
    console.print(f"({args.agents} drone processes and mission control on {os.cpu_count()} "
                  "cores: latencies include their scheduling, and move from run to run; "
                  "bench/ times one operation at a time)")
    if args.plot:
        _plot(args.plot, ours, theirs, baseline)
        console.print(f"latency plot written to {args.plot}")


def _share(seen: int, of: int, how: str) -> str:
    """The updates mission control saw, as a share of the drones' puts."""
    return f"{100 * seen / of:.0f}% ({how})" if of else f"{seen} ({how})"


def _gain(ours: float, theirs: float | None, better: str) -> str:
    """The report's last cell: ``better`` "lower" (a latency: "2.0x faster" or
    "slower"), "higher" (work done: "1.2x more" or "fewer"), "" (no gain to show); two
    figures ("17x", "1.6x"), "same" when the ratio shows as 1.0; "none" when kvcomm did
    no work and the baseline did; empty when either side has no figure (NaN: nothing was
    timed) or a latency is 0."""
    if theirs is None or not better or math.isnan(ours) or math.isnan(theirs):
        return ""
    if better == "higher" and (not ours or not theirs):
        return "same" if ours == theirs else "none" if not ours else "more (baseline: none)"
    if not ours or not theirs:
        return ""
    r = theirs / ours if better == "lower" else ours / theirs
    big = max(r, 1 / r)  # (to two figures: one run of processes on a few cores, no more)
    shown = f"{big:.0f}" if big >= 10 else f"{big:.1f}"
    if shown == "1.0":
        return "same"
    return f"{shown}x " + ("faster", "slower", "more", "fewer")[(r < 1) + 2 * (better == "higher")]


def _plot(path: str, ours: dict[str, Any], theirs: dict[str, Any] | None, baseline: str) -> None:
    import matplotlib  # (run_demo checked that it is installed before the run)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, op in zip(axes, ("gets", "puts"), strict=True):
        for label, res in (("kvcomm", ours), (baseline, theirs)):
            if res is None or not res[op]:
                continue
            xs = sorted(v / 1000.0 for v in res[op])
            ys = [(k + 1) / len(xs) for k in range(len(xs))]
            ax.plot(xs, ys, label=f"{label} (p50 {statistics.median(xs):.1f} µs)")
        ax.set_xscale("log")
        ax.set_xlabel(f"{op[:-1]} latency (µs, log)")
        ax.set_ylabel("fraction of operations")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("drone swarm: latency CDF, kvcomm vs central store")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
