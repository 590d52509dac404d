"""Affinity placement, measured: what putting agents that share state on one host changes.

    python bench/bench_placement.py [--quick] [--seconds S] [--json FILE] [--plot FILE.png]
                                    [--replan-every S] [--max-moves M] [--move-bytes B]
                                    [--workloads swarm] [--placements random,planned,...]
    python bench/bench_placement.py --probe-only             # only the visibility probe
    python bench/bench_placement.py --move-cost-only         # what a move's pieces cost
    python bench/bench_placement.py --replot FILE.json --plot FILE.png

A 3-host dev cluster (a real Redis Cluster and one node daemon per host, on this
machine). Two workloads, each run under three placements of its agents on the hosts:

* **swarm** — 36 drones in 6 flocks flying over a torus; every tick a drone writes its
  state and reads its 4 nearest drones'. Flocks drift and cross, and a third of the
  drones wander to the next flock every 12 s: neighbourhoods drift.
* **warehouse** — 36 robots in 6 zones and 3 shelf keepers; every tick a robot writes
  its pose and reads 3 zone-mates' and the stock of the shelf it picks from (which
  changes every 10 s); a keeper writes its shelf's stock and reads 4 of its pickers.

Placements: **random** (a random permutation dealt evenly), **round-robin** (agent i on
host i mod 3), **planned** (a run under round-robin, ``kvcomm placement observe`` of its
last seconds, ``kvcomm placement plan --balance 1.1``; then the measured run, which
continues the workload where the observed run stopped: the plan only saw the past), and
**replanned** (the planned start, then every ``--replan-every`` seconds what
``kvcomm placement launch --replan-every S --max-moves M`` does, ``Launcher.replan_loop``:
observe the time since the previous round (``observe.Observer``: every host's snapshot
read once a round; the first round the last S - 1 seconds), ``replan`` from where the
agents run with at most M moves, each of which must save its ``--move-bytes`` (default
``placement.cost.MOVE_BYTES_IN_PROCESS``: this bench moves agents between host processes)
in cross-host reads' L3 bytes over the horizon the observed reads' persistence and the
last plans' realized gains give
(``placement.cost.Pricing``), move them: the old host's
process closes the agent's client, the new host's opens one, which first reads the
agent's own state back; the rounds' and the moves' L3 traffic is in the measured bytes;
moves per minute, what observing cost a round, the moved clients' own L3 traffic and the
Redis commands per second it adds to planned's are reported). **replanned-free**
(``--placements``; not run by default): the same with moves that cost nothing, the
re-planner before it weighed them.
Every agent runs as its own client (``kvcomm.open(config=host's, agent=name)``); the
agents of one host share one process (a tick loop over them).

Every host runs with ``cluster.unread_changes: 1`` (``--unread-changes``; the config's
default is 0): a held key that no agent of the host read since its last remote change
leaves L2 at the next one instead of being read from L3 again.

Measured over each run (after 2 s of warm-up):

* **same-host share** — of the reads of another agent's key, the share whose writer is
  on the reader's host (counted, not sampled);
* **L3 bytes** — bytes in and out of every Redis node for clients (``INFO stats``
  ``total_net_input_bytes`` + ``total_net_output_bytes``, less their replication part,
  ``total_net_repl_*``: Redis 7 counts replication in the totals), per second; and where
  they go (the daemons' own count by purpose, in their status files);
* **staleness** of cross-agent reads, p50 / p99 / mean and the share of reads that
  missed a write, for all, same-host and cross-host pairs: how long before the read
  began had a newer write been acknowledged (its ``put`` returned) than the one the read
  returned (0: it returned the newest);
* agents' L3 reads (L2 misses that went to L3) and the observed graph's prediction.

In the workloads, the agents of one host share a process, so a same-host read never
runs concurrently with a write. Then a **visibility probe** across processes: one writer
(a write every 4-6 ms), one reader in another process spinning on ``get``, on the same
host and on another host: the time from the start of each ``put`` to the reader seeing
it (p50 / p99: on a loaded machine, mostly how long the reader waits for a CPU), and the
staleness, as above, of every one of the reader's reads (p50 / p99 / max).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import multiprocessing as mp
import os
import random
import struct
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import kvcomm
from kvcomm import devcluster
from kvcomm.config import load_config
from kvcomm.placement.cost import MOVE_BYTES_IN_PROCESS, Pricing, move_cost_reads
from kvcomm.placement.launcher import replan as replan_plan
from kvcomm.placement.observe import Observer, observe
from kvcomm.placement.plan import make_plan

CTX = mp.get_context("fork")
HOSTS = ["host-1", "host-2", "host-3"]
RATE = 20.0  # ticks per second
WARMUP = 2.0  # seconds of each run left out of the figures
SLACK = 10.0  # seconds the observed run goes on after observe's window (a loaded machine)
VALUE = 256  # bytes of an agent's state
NAMES = ("random", "round-robin", "planned", "replanned", "replanned-free")
DEFAULT_NAMES = NAMES[:4]  # (replanned-free: --placements; the replanner before moves had a cost)
KINDS = ("swarm", "warehouse")
_HEAD = struct.Struct("<Q")


# ---------------------------------------------------------------- workloads


class Swarm:
    """Drones in flocks over the unit torus; a drone reads its k nearest."""

    kind = "swarm"

    def __init__(self, n: int = 36, flocks: int = 6, k: int = 4, seed: int = 1) -> None:
        rng = random.Random(seed)
        self.n, self.flocks, self.k = n, flocks, k
        self.agents = [f"drone-{i}" for i in range(n)]
        self.centre = [(rng.random(), rng.random(), rng.uniform(-0.02, 0.02), rng.uniform(-0.02, 0.02))
                       for _ in range(flocks)]
        self.offset = [(rng.uniform(-0.04, 0.04), rng.uniform(-0.04, 0.04)) for _ in range(n)]
        self.wander = [rng.random() < 1 / 3 for _ in range(n)]  # a third change flock
        self.phase = [rng.uniform(0, 12) for _ in range(n)]

    def flock(self, i: int, t: float) -> int:
        hops = int((t + self.phase[i]) // 12) if self.wander[i] else 0
        return (i * self.flocks // self.n + hops) % self.flocks  # (flocks of consecutive ids)

    def pos(self, i: int, t: float) -> tuple[float, float]:
        x, y, vx, vy = self.centre[self.flock(i, t)]
        dx, dy = self.offset[i]
        return ((x + vx * t + dx) % 1.0, (y + vy * t + dy) % 1.0)

    def tick(self, t: float) -> dict[int, list[int]]:
        """Every drone's reads at model time ``t`` (agent index → writer indices)."""
        p = [self.pos(i, t) for i in range(self.n)]

        def d(a: int, b: int) -> float:
            dx = abs(p[a][0] - p[b][0])
            dy = abs(p[a][1] - p[b][1])
            return min(dx, 1 - dx) ** 2 + min(dy, 1 - dy) ** 2

        return {i: sorted((j for j in range(self.n) if j != i), key=lambda j: d(i, j))[:self.k]
                for i in range(self.n)}


class Warehouse:
    """Robots in zones reading zone-mates and a shelf; keepers reading their pickers."""

    kind = "warehouse"

    def __init__(self, robots: int = 36, zones: int = 6, shelves: int = 3, seed: int = 2) -> None:
        self.rng = random.Random(seed)
        self.robots, self.zones, self.shelves = robots, zones, shelves
        self.agents = [f"robot-{i}" for i in range(robots)] + [f"shelf-{s}" for s in range(shelves)]
        self.n = len(self.agents)
        per = robots // zones
        self.zone = {i: i // per for i in range(robots)}
        self.mates = {i: [z for z in range(robots) if self.zone[z] == self.zone[i] and z != i]
                      for i in range(robots)}

    def shelf_of(self, robot: int, t: float) -> int:
        return (self.zone[robot] + int(t // 10)) % self.shelves

    def tick(self, t: float) -> dict[int, list[int]]:
        tick = int(round(t * RATE))
        out: dict[int, list[int]] = {}
        for i in range(self.robots):
            mates = self.mates[i]
            out[i] = [mates[(tick + j) % len(mates)] for j in range(3)] + \
                [self.robots + self.shelf_of(i, t)]
        for s in range(self.shelves):
            pickers = [i for i in range(self.robots) if self.shelf_of(i, t) == s]
            out[self.robots + s] = [pickers[(tick * 4 + j) % len(pickers)] for j in range(4)]
        return out


def workload(kind: str) -> Swarm | Warehouse:
    return Swarm() if kind == "swarm" else Warehouse()


# ---------------------------------------------------------------- a host's agents


def host_worker(kind: str, run: str, config: str, me: int, host_of: Any, epoch: Any,
                t_model0: float, start: Any, seconds: float, barrier: Any, out: str) -> None:
    """The agents of workload ``kind`` whose ``host_of`` entry is ``me`` (this host, of
    ``config``), as one tick loop: first each writes its key once, then every host meets
    at ``barrier`` twice (between the two, the parent sets ``start``, monotonic, a moment
    later: for L3 and the hosts' key filters to know every key), then ``seconds`` of
    ticks from ``start``. When the parent moves agents (``host_of`` changed, ``epoch``
    raised), at the next tick this host closes the agents it lost and opens those it
    gained, each of which first reads its own state (a moved agent picks up where it was:
    its state is in KVCOMM). Writes the logs to ``out``."""
    model = workload(kind)
    names = model.agents
    clients = {i: kvcomm.open(config=config, agent=names[i]) for i in range(model.n)
               if host_of[i] == me}
    key = [f"{run}/{names[i]}" for i in range(model.n)]
    pad = b"s" * (VALUE - _HEAD.size)
    w_agent, w_seq, w_t = array("q"), array("q"), array("q")
    r_t, r_reader, r_writer, r_seq = array("q"), array("q"), array("q"), array("q")
    stats: dict[str, Any] = {}
    instance = dict.fromkeys(clients, 0)
    seen_epoch = epoch.value
    moved_in = 0
    # a moved-in client's own L3 traffic (bytes its L3 client sent and received, and
    # whether it opened one at all: it does at its first L2 miss). (A peek at the
    # client's private L3 adapter: the bench's diagnosis of what a move costs.)
    moved_wire: list[tuple[int, int]] = []
    # every agent's own L3 traffic over the measured window (from the end of the warm-up):
    # [L3 clients opened, bytes], clients closed since added at their close
    base: tuple[int, int] | None = None
    closed = [0, 0]

    def wire_of(kv: Any) -> tuple[int, int]:
        l3 = getattr(kv, "_l3", None)
        return (0, 0) if l3 is None else (1, l3.wire.sent + l3.wire.received)
    for i, kv in clients.items():
        kv.put(key[i], _HEAD.pack(0) + pad)
    barrier.wait(60)
    barrier.wait(60)
    start_at = start.value
    period = 1.0 / RATE
    ticks = int(seconds * RATE)
    now_ns = time.monotonic_ns
    try:
        for k in range(ticks):
            due = start_at + k * period
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if epoch.value != seen_epoch:  # agents moved: close the lost, open the gained
                seen_epoch = epoch.value
                for i in [i for i in clients if host_of[i] != me]:
                    kv = clients.pop(i)
                    stats[f"{names[i]}#{me}.{instance[i]}"] = kv.stats()
                    if instance[i] > 0:
                        moved_wire.append(wire_of(kv))
                    closed[0] += wire_of(kv)[0]
                    closed[1] += wire_of(kv)[1]
                    kv.close()
                for i in range(model.n):
                    if host_of[i] == me and i not in clients:
                        instance[i] = instance.get(i, -1) + 1
                        clients[i] = kvcomm.open(config=config, agent=names[i])
                        clients[i].get(key[i])  # (its own state: where it was)
                        moved_in += 1
            if k == int(WARMUP * RATE):
                now = [wire_of(kv) for kv in clients.values()]
                base = (sum(o for o, _ in now), sum(b for _, b in now))
            reads = model.tick(t_model0 + k * period)
            for i, kv in clients.items():
                kv.put(key[i], _HEAD.pack(k + 1) + pad)
                t = now_ns()
                w_agent.append(i)
                w_seq.append(k + 1)
                w_t.append(t)
                for j in reads[i]:
                    t0 = now_ns()
                    v = kv.get(key[j])
                    r_t.append(t0)
                    r_reader.append(i)
                    r_writer.append(j)
                    r_seq.append(-1 if v is None else _HEAD.unpack_from(v)[0])
        stats.update({f"{names[i]}#{me}.{instance[i]}": kv.stats() for i, kv in clients.items()})
        moved_wire.extend(wire_of(kv) for i, kv in clients.items() if instance[i] > 0)
        now = [wire_of(kv) for kv in clients.values()]
        if base is not None:
            stats["_agents_l3"] = [closed[0] + sum(o for o, _ in now) - base[0],
                                   closed[1] + sum(b for _, b in now) - base[1]]
    finally:
        for kv in clients.values():
            kv.close()
    with open(out, "w") as f:
        json.dump({"start": start_at, "end": time.monotonic(),
                   "w": [w_agent.tolist(), w_seq.tolist(), w_t.tolist()],
                   "r": [r_t.tolist(), r_reader.tolist(), r_writer.tolist(), r_seq.tolist()],
                   "stats": stats, "moved_in": moved_in, "moved_wire": moved_wire}, f)


# ---------------------------------------------------------------- one run


def redis_bytes(dev: dict[str, Any]) -> tuple[int, int]:
    """(client bytes, replication bytes) in and out of every Redis node so far."""
    import redis

    client = repl = 0
    for addr in dev["redis"]:
        host, _, port = addr.rpartition(":")
        r = redis.Redis(host=host, port=int(port))
        try:
            s = r.info("stats")
        finally:
            r.close()
        # (Redis 7's totals include replication: the repl_ counters are a part of them)
        r_bytes = int(s.get("total_net_repl_input_bytes", 0)) + int(s.get("total_net_repl_output_bytes", 0))
        client += int(s["total_net_input_bytes"]) + int(s["total_net_output_bytes"]) - r_bytes
        repl += r_bytes
    return client, repl


def daemon_bytes(dev: dict[str, Any]) -> dict[str, list[int]]:
    """Every host daemon's L3 bytes so far, [sent, received] by purpose (push, feed,
    fetch, sweep, other, total: ``l3_bytes`` in its status file), summed over hosts."""
    from kvcomm.node.presence import read_status, status_path

    out: dict[str, list[int]] = {}
    for h in dev["hosts"]:
        st = read_status(status_path(h["namespace"], "/dev/shm")) or {}
        for what, (sent, received) in (st.get("l3_bytes") or {}).items():
            row = out.setdefault(what, [0, 0])
            row[0] += sent
            row[1] += received
    return out


def hints_sent(dev: dict[str, Any]) -> int:
    """SPUBLISH calls so far on every master (a hint per change stored, or per group of a
    pipeline: see tiers/l3.py, HINT_EACH)."""
    import redis

    n = 0
    for addr in dev["redis"]:
        host, _, port = addr.rpartition(":")
        r = redis.Redis(host=host, port=int(port))
        try:
            if r.info("replication")["role"] == "master":
                n += int(r.info("commandstats").get("cmdstat_spublish", {}).get("calls", 0))
        finally:
            r.close()
    return n


def command_calls(dev: dict[str, Any]) -> dict[str, int]:
    """Calls so far of each Redis command, summed over every node (INFO commandstats)."""
    import redis

    out: dict[str, int] = {}
    for addr in dev["redis"]:
        host, _, port = addr.rpartition(":")
        r = redis.Redis(host=host, port=int(port))
        try:
            for name, st in r.info("commandstats").items():
                out[name.removeprefix("cmdstat_")] = out.get(name.removeprefix("cmdstat_"), 0) \
                    + int(st.get("calls", 0))
        finally:
            r.close()
    return out


def changes_stored(dev: dict[str, Any]) -> int:
    """Changes L3 stored so far: the sum of every group's sequence number (one per change
    stored; hints are no count of them: a pipeline's pushes of one group may share one)."""
    from kvcomm.tiers.l3 import L3Store

    cfg = load_config(dev["hosts"][0]["config"])
    store = L3Store.from_config(cfg.cluster)
    try:
        return sum(n or 0 for n in store.feed_seqs(range(cfg.cluster.groups)).values())
    finally:
        store.close()


def hint_bytes() -> int:
    """Bytes of one hint as a subscriber receives it (RESP ``smessage``, a 6-digit
    sequence number): what every host pays per change stored."""
    from kvcomm.tiers.groups import groups

    ch = groups(1024).hint_channel(0)
    return len(f"*3\r\n$8\r\nsmessage\r\n${len(ch)}\r\n{ch}\r\n$6\r\n123456\r\n")


def run_once(dev: dict[str, Any], kind: str, assignment: dict[str, str], t_model0: float,
             seconds: float, work: Path, tag: str, observe_last: float = 0.0,
             replan: tuple[float, int, float] | None = None) -> dict[str, Any]:
    """One run of ``kind`` with ``assignment`` (agent → host); its figures, and with
    ``observe_last`` the graph observed over the run's last seconds. With ``replan``
    (every S seconds, at most M moves), the run is re-placed as the example launcher's
    ``replan_loop`` does it (observe the last S - 1 seconds, ``replan``, move), from
    the end of the warm-up on."""
    model = workload(kind)
    configs = {h["host"]: h["config"] for h in dev["hosts"]}
    host_of = CTX.Array("i", [HOSTS.index(assignment[a]) for a in model.agents], lock=False)
    epoch = CTX.Value("i", 0, lock=False)
    run = f"{tag}-{os.getpid()}-{time.monotonic_ns() % 10**9}"
    barrier = CTX.Barrier(len(HOSTS) + 1)
    start = CTX.Value("d", 0.0)
    procs, outs = [], {h: str(work / f"{run}-{h}.json") for h in HOSTS}
    for me, h in enumerate(HOSTS):
        p = CTX.Process(target=host_worker, args=(kind, run, configs[h], me, host_of, epoch,
                                                  t_model0, start, seconds, barrier, outs[h]))
        p.start()
        procs.append(p)
    barrier.wait(60)  # every first write is in L2
    start_at = start.value = time.monotonic() + 1.0  # (L3 and the key filters catch up)
    barrier.wait(60)
    graph = None
    while time.monotonic() < start_at + WARMUP:
        time.sleep(0.01)
    # (the bench's own calls first: changes_stored opens a cluster client, and its setup
    # and reads are the bench's bytes, not KVCOMM's; b1 is read before theirs at the end)
    d0, h0, s0 = daemon_bytes(dev), hints_sent(dev), changes_stored(dev)
    c0 = command_calls(dev)
    b0 = redis_bytes(dev)
    t_b0 = time.monotonic()
    if observe_last:  # (ending well before the agents stop: reports go when they close)
        time.sleep(max(0.0, start_at + seconds - observe_last - SLACK - time.monotonic()))
        graph = observe(load_config(configs["host-1"]), observe_last)
        assert graph.edges and time.monotonic() < start_at + seconds, "observed too late"
    timeline: list[tuple[int, dict[str, str]]] = [(0, dict(assignment))]
    rounds: list[dict[str, Any]] = []
    if replan is not None:
        every, max_moves, move_bytes = replan
        window = max(1.0, every - 1.0)
        current = dict(assignment)
        cfg = load_config(configs["host-1"])
        # (one store for every round, as the launcher; each round reads every host's
        # snapshot once: the launcher's Observer, its window the time since the last round)
        observer = Observer(cfg, hosts=HOSTS)
        pricing = Pricing(every)
        due = time.monotonic() + every
        # (the launcher's loop, with the bench's agents: a move sets host_of, and the
        # hosts' tick loops close and open the agents at their next tick)
        while due <= start_at + seconds - 0.5:
            lead = 0.0 if observer.last is not None else window
            time.sleep(max(0.0, due - lead - time.monotonic()))
            due += every
            t_r = time.monotonic()
            w0 = (observer.store.wire.sent + observer.store.wire.received
                  if observer.store is not None else 0)
            try:
                seen = observer.graph(window)
                lasts = pricing.horizon(seen, seen.share(
                    {a.id: current.get(a.id, a.host) for a in seen.agents}))
                plan = replan_plan(seen, current, HOSTS, max_moves=max_moves, balance=1.1,
                                   move_bytes=move_bytes, horizon=lasts)
                pricing.planned(plan.before, plan.share, len(plan.moves))
            except kvcomm.KVCommError as e:
                rounds.append({"t": t_r - start_at, "moves": 0, "skipped": str(e)})
                continue
            assert observer.store is not None
            for m in plan.moves:
                current[m.agent] = m.target
                host_of[model.agents.index(m.agent)] = HOSTS.index(m.target)
            if plan.moves:
                epoch.value += 1
                timeline.append((time.monotonic_ns(), dict(current)))
            rounds.append({"t": t_r - start_at, "moves": len(plan.moves),
                           "plan_s": time.monotonic() - t_r,
                           "observe_bytes": observer.store.wire.sent
                           + observer.store.wire.received - w0,
                           "horizon_s": lasts, "realized": pricing.factor,
                           "move_cost_reads": move_cost_reads(seen, move_bytes, lasts),
                           "before": plan.before, "predicted": plan.share})
        observer.close()
    while time.monotonic() < start_at + seconds:
        time.sleep(0.01)
    b1 = redis_bytes(dev)
    d1, h1, s1 = daemon_bytes(dev), hints_sent(dev), changes_stored(dev)
    c1 = command_calls(dev)
    t_b1 = time.monotonic()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0, f"a host process failed ({p.exitcode})"
    logs = [json.loads(Path(outs[h]).read_text()) for h in HOSTS]
    figures = analyse(model, timeline, logs, int((start_at + WARMUP) * 1e9))
    figures["rounds"] = rounds
    figures["moves"] = sum(r["moves"] for r in rounds)
    figures["moves_per_min"] = figures["moves"] / (seconds - WARMUP) * 60
    figures["moved_in"] = sum(log.get("moved_in", 0) for log in logs)
    moved_wire = [w for log in logs for w in log.get("moved_wire", [])]
    figures["moved_l3_opened"] = sum(o for o, _ in moved_wire)
    figures["moved_l3_bytes"] = sum(b for _, b in moved_wire)
    own = [log["stats"].get("_agents_l3", [0, 0]) for log in logs]
    figures["agents_l3_opened"] = sum(o for o, _ in own)  # (in the measured window)
    figures["agents_l3_bytes_per_s"] = sum(b for _, b in own) / (t_b1 - t_b0)
    figures["l3_bytes_per_s"] = (b1[0] - b0[0]) / (t_b1 - t_b0)
    figures["repl_bytes_per_s"] = (b1[1] - b0[1]) / (t_b1 - t_b0)
    # where the bytes go: the daemons' own count by purpose (Redis in = sent, out =
    # received), the hints every host receives (counted by the daemons; older ones: estimated)
    figures["daemon_bytes_per_s"] = {
        what: [(d1[what][i] - d0.get(what, [0, 0])[i]) / (t_b1 - t_b0) for i in (0, 1)]
        for what in d1}
    if "hints" in d1:  # (the daemons count the hint messages they receive)
        figures["hint_bytes_per_s"] = (d1["hints"][1] - d0.get("hints", [0, 0])[1]) / (t_b1 - t_b0)
    else:
        figures["hint_bytes_per_s"] = (h1 - h0) * len(HOSTS) * hint_bytes() / (t_b1 - t_b0)
    # per change stored in L3 (the groups' counters): how many writes the window folds into one
    # push depends on how far behind a loaded machine's daemons run, and bytes/s follows
    writes = sum(1 for log in logs for t in log["w"][2] if t_b0 * 1e9 <= t < t_b1 * 1e9)
    figures["writes_per_s"] = writes / (t_b1 - t_b0)
    figures["stores_per_s"] = (s1 - s0) / (t_b1 - t_b0)
    figures["hints_per_s"] = (h1 - h0) / (t_b1 - t_b0)
    figures["l3_bytes_per_store"] = (b1[0] - b0[0]) / max(1, s1 - s0)
    figures["graph"] = graph
    figures["calls_per_s"] = {k: (v - c0.get(k, 0)) / (t_b1 - t_b0) for k, v in c1.items()
                              if v != c0.get(k, 0)}
    return figures


def _pct(xs: Sequence[int], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return float(s[min(len(s) - 1, int(q * len(s)))])


def analyse(model: Swarm | Warehouse, timeline: list[tuple[int, dict[str, str]]],
            logs: list[dict[str, Any]], from_ns: int) -> dict[str, Any]:
    """The figures of a run's logs from ``from_ns`` on; ``timeline``: (from when, agent →
    host) in time order, the placements the run had (a read is same-host by the one in
    force when it began)."""
    names = model.agents
    starts = [t for t, _ in timeline]
    acked: dict[int, dict[int, int]] = {i: {} for i in range(model.n)}  # writer → seq → t_ack
    for log in logs:
        for a, s, t in zip(*log["w"], strict=True):
            acked[a][s] = t
    reads = same = 0
    stale: dict[str, list[int]] = {"all": [], "same": [], "cross": []}
    for log in logs:
        for t, r, w, s in zip(*log["r"], strict=True):
            if t < from_ns:
                continue
            assignment = timeline[bisect.bisect_right(starts, t) - 1][1]
            cls = "same" if assignment[names[r]] == assignment[names[w]] else "cross"
            reads += 1
            same += cls == "same"
            nxt = acked[w].get(max(s, 0) + 1)
            age = t - nxt if nxt is not None and nxt <= t else 0
            stale["all"].append(age)
            stale[cls].append(age)
    clients = [st for log in logs for name, st in log["stats"].items() if name != "_agents_l3"]
    l3_reads = sum(st["l3"]["reads"] for st in clients)
    l2 = [st["l2"] for st in clients]
    hits, misses = sum(x["hits"] for x in l2), sum(x["misses"] for x in l2)
    out: dict[str, Any] = {
        "reads": reads, "same_host_share": same / reads if reads else float("nan"),
        "l3_reads": l3_reads, "l2_hit_rate": hits / (hits + misses) if hits + misses else 1.0}
    for cls, xs in stale.items():
        out[f"stale_{cls}_mean_us"] = sum(xs) / len(xs) / 1000 if xs else float("nan")
        out[f"stale_{cls}_missed"] = sum(1 for x in xs if x) / len(xs) if xs else float("nan")
        out[f"stale_{cls}_p50_us"] = _pct(xs, 0.50) / 1000
        out[f"stale_{cls}_p99_us"] = _pct(xs, 0.99) / 1000
        out[f"stale_{cls}_n"] = len(xs)
    return out


# ---------------------------------------------------------------- placements


def placements(model: Swarm | Warehouse, seed: int) -> dict[str, dict[str, str]]:
    rng = random.Random(seed)
    shuffled = list(model.agents)
    rng.shuffle(shuffled)
    return {"random": {a: HOSTS[i % len(HOSTS)] for i, a in enumerate(shuffled)},
            "round-robin": {a: HOSTS[i % len(HOSTS)] for i, a in enumerate(model.agents)}}


def scenario(dev: dict[str, Any], kind: str, seconds: float, observe_s: float, work: Path,
             seed: int, replan: tuple[float, int, float],
             names: Sequence[str] = DEFAULT_NAMES) -> dict[str, Any]:
    model = workload(kind)
    rows: dict[str, Any] = {}
    places = placements(model, seed)
    # the planned placement: observe a round-robin run, plan, then run on from there
    observed_run = WARMUP + observe_s + SLACK + 1.0
    obs_run = run_once(dev, kind, places["round-robin"], 0.0, observed_run, work,
                       f"{kind}-observe", observe_last=observe_s)
    graph = obs_run["graph"]
    plan = make_plan(graph, HOSTS, balance=1.1)
    places["planned"] = {a: plan.assignment.get(a, places["round-robin"][a]) for a in model.agents}
    t0 = observed_run  # the measured runs continue the workload from there
    # (the planned start, re-placed as it runs; -free: moves cost nothing, as before
    # the replanner weighed them)
    places["replanned"] = places["replanned-free"] = places["planned"]
    free = (replan[0], replan[1], 0.0)
    for name in [n for n in NAMES if n in names]:
        print(f"  {kind}: {name} ...", file=sys.stderr, flush=True)
        fig = run_once(dev, kind, places[name], t0, seconds, work, f"{kind}-{name}",
                       replan=replan if name == "replanned" else
                       free if name == "replanned-free" else None)
        fig.pop("graph")
        rows[name] = fig
        if name == "planned":
            fig["predicted_share"] = plan.share
            fig["observed_before"] = plan.before
            fig["moves_from_round_robin"] = len(plan.moves)
        if name.startswith("replanned"):
            fig["replan_every_s"], fig["max_moves"], fig["move_bytes"] = \
                replan if name == "replanned" else free
        if name == "round-robin":
            fig["observed_share"] = obs_run["same_host_share"]
    return rows


# ---------------------------------------------------------------- visibility probe


def _probe_writer(config: str, key: str, n: int, ready: Any, go: Any, out: Any,
                  acked: Any) -> None:
    with kvcomm.open(config=config, agent="probe-writer") as kv:
        kv.put(key, _HEAD.pack(0) + b"p" * 56)
        ready.wait(30)
        go.wait(30)
        for s in range(1, n + 1):
            time.sleep(0.004 + random.random() * 0.002)
            t = time.monotonic_ns()
            kv.put(key, _HEAD.pack(s) + b"p" * 56)
            acked[s] = time.monotonic_ns()  # (put returned: acknowledged)
            out[s] = t


def _probe_reader(config: str, key: str, n: int, ready: Any, go: Any, out: Any,
                  acked: Any, stale: Any) -> None:
    """Spin on ``get``: when each write is first seen (``out``), and the staleness of
    every read (as the workloads': how long before the read began had a newer write been
    acknowledged): ``stale`` gets [reads, stale reads, p50, p99, max] (ns)."""
    with kvcomm.open(config=config, agent="probe-reader") as kv:
        end = time.monotonic() + 30
        while kv.get(key) is None and time.monotonic() < end:
            time.sleep(0.01)
        ready.set()
        go.wait(30)
        last = 0
        reads = 0
        late: list[int] = []
        now_ns = time.monotonic_ns
        end = time.monotonic() + 2 + n * 0.02
        while last < n and time.monotonic() < end:
            t0 = now_ns()
            v = kv.get(key)
            if v is not None:
                s = _HEAD.unpack_from(v)[0]
                reads += 1
                nxt = acked[s + 1] if s < n else 0
                if nxt and nxt <= t0:
                    late.append(t0 - nxt)
                if s > last:
                    t = now_ns()
                    for x in range(last + 1, s + 1):
                        out[x] = t  # (writes it skipped were visible by then too)
                    last = s
        late.sort()
        zeros = reads - len(late)

        def pct(q: float) -> float:  # (reads that returned the newest count as 0)
            i = min(reads - 1, int(q * reads))
            return 0.0 if i < zeros else float(late[i - zeros])

        stale[:] = [reads, len(late), pct(0.50), pct(0.99), late[-1] if late else 0]


def visibility(dev: dict[str, Any], n: int) -> dict[str, Any]:
    configs = {h["host"]: h["config"] for h in dev["hosts"]}
    res: dict[str, Any] = {}
    for cls, reader_host in (("same", "host-1"), ("cross", "host-2")):
        key = f"probe/{cls}/{os.getpid()}"
        wrote, seen = CTX.Array("q", n + 1), CTX.Array("q", n + 1)
        acked = CTX.Array("q", n + 1, lock=False)  # (read on every get: no lock)
        stale = CTX.Array("d", 5)
        ready, go = CTX.Event(), CTX.Event()
        w = CTX.Process(target=_probe_writer,
                        args=(configs["host-1"], key, n, ready, go, wrote, acked))
        r = CTX.Process(target=_probe_reader,
                        args=(configs[reader_host], key, n, ready, go, seen, acked, stale))
        w.start()
        time.sleep(1.0)
        r.start()
        ready.wait(60)
        go.set()
        w.join(120)
        r.join(120)
        lat = [seen[s] - wrote[s] for s in range(1, n + 1) if seen[s] and wrote[s]]
        res[cls] = {"n": len(lat), "p50_us": _pct(lat, 0.5) / 1000, "p99_us": _pct(lat, 0.99) / 1000,
                    "reads": int(stale[0]), "stale_reads": int(stale[1]),
                    "stale_p50_us": stale[2] / 1000, "stale_p99_us": stale[3] / 1000,
                    "stale_max_us": stale[4] / 1000}
    return res


# ---------------------------------------------------------------- what a move costs


def move_cost_probe(dev: dict[str, Any]) -> dict[str, Any]:
    """What a move's pieces cost in L3 bytes, each counted by its own L3 client (the
    bytes its sockets sent and received, exactly): opening an L3 client (the cluster
    client's start-up: COMMAND, CLUSTER SLOTS, HELLO), and a moved agent's client on its
    new host reading its own state back when the host does not hold it (an L2 miss: it
    opens its L3 client) and when it does (another agent of the host reads it)."""
    from kvcomm.tiers.l3 import L3Store

    configs = {h["host"]: h["config"] for h in dev["hosts"]}
    store = L3Store.from_config(load_config(configs["host-1"]).cluster)
    out: dict[str, Any] = {"l3_client_open": store.wire.sent + store.wire.received}
    store.close()
    key, held = f"probe/move/{os.getpid()}", f"probe/held/{os.getpid()}"
    with kvcomm.open(config=configs["host-1"], agent="mover") as old, \
            kvcomm.open(config=configs["host-2"], agent="neighbour") as nb:
        old.put(key, b"m" * VALUE)
        old.put(held, b"h" * VALUE)
        end = time.monotonic() + 30
        while nb.get(held) is None and time.monotonic() < end:  # (host-2 holds it now)
            time.sleep(0.01)
        for name, k in (("moved_agent_reads_unheld", key), ("moved_agent_reads_held", held)):
            with kvcomm.open(config=configs["host-2"], agent="mover") as new:
                got = new.get(k)
                l3 = getattr(new, "_l3", None)
                out[name] = 0 if l3 is None else l3.wire.sent + l3.wire.received
                out[name + "_found"] = got is not None
        # what `kvcomm placement launch` does: the moved agent is a new process (its L3
        # client's start-up is not shared with a host process that already has one)
        fresh = f"probe/process/{os.getpid()}"
        old.put(fresh, b"p" * VALUE)
        wait_for_l3(configs["host-1"], fresh)
        child = subprocess.run(
            [sys.executable, "-c", _MOVED_PROCESS, configs["host-2"], fresh],
            capture_output=True, text=True, timeout=60, check=True)
        moved = json.loads(child.stdout)
        out["moved_process_reads_unheld"] = moved["bytes"]
        out["moved_process_reads_unheld_found"] = moved["found"]
    return out


# a moved agent's new process: open a client on its new host, read one key the host does
# not hold (an L2 miss: the client opens its L3 client), print that client's L3 bytes
_MOVED_PROCESS = """
import json, sys
import kvcomm
with kvcomm.open(config=sys.argv[1], agent="mover-process") as kv:
    got = kv.get(sys.argv[2])
    l3 = getattr(kv, "_l3", None)
    print(json.dumps({"bytes": 0 if l3 is None else l3.wire.sent + l3.wire.received,
                      "found": got is not None}))
"""


def wait_for_l3(config: str, key: str, timeout: float = 30.0) -> None:
    """Until ``key`` is in L3 (its write window pushed)."""
    from kvcomm._wait import wait_until
    from kvcomm.tiers.l3 import L3Store

    store = L3Store.from_config(load_config(config).cluster)
    try:
        wait_until(lambda: store.get(key) is not None, timeout, f"{key} to reach L3")
    finally:
        store.close()


# ---------------------------------------------------------------- report


def table(results: dict[str, Any]) -> str:
    lines = ["| workload | placement | same-host share | L3 bytes/s (per change stored) "
             "| staleness p50 / p99 (all) | mean, reads that missed a write | same-host pairs p99 "
             "| cross-host pairs p50 / p99 "
             "| L2 hit rate (L3 reads) | moves/min |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for kind in KINDS:
        if kind not in results:
            continue
        for name in [n for n in NAMES if n in results[kind]]:
            f = results[kind][name]
            lines.append(
                f"| {kind} | {name} | {100 * f['same_host_share']:.0f}% | "
                f"{f['l3_bytes_per_s'] / 1e6:.2f} MB/s ({f['l3_bytes_per_store']:.0f} B) | "
                f"{f['stale_all_p50_us'] / 1000:.1f} / {f['stale_all_p99_us'] / 1000:.1f} ms | "
                f"{f['stale_all_mean_us'] / 1000:.1f} ms, {100 * f['stale_all_missed']:.0f}% | "
                f"{_us(f['stale_same_p99_us'])} | "
                f"{f['stale_cross_p50_us'] / 1000:.1f} / {f['stale_cross_p99_us'] / 1000:.1f} ms | "
                f"{100 * f['l2_hit_rate']:.2f}% ({f['l3_reads']}) | "
                f"{f.get('moves_per_min', 0.0):.0f} |")
    return "\n".join(lines)


def breakdown(results: dict[str, Any]) -> str:
    """Where the L3 bytes go: bytes per change stored into Redis / out of it, by purpose."""
    parts = ("push", "feed", "fetch", "sweep", "other")  # (hints: a column of their own)
    # (the daemons count the hints they receive in their total, and in "other" before they
    # counted them apart: older figures' "other" holds them, their hint column estimates)
    lines = ["| workload | placement | writes/s | stored/s | L3 total | " + " | ".join(parts)
             + " | hints | rest (agents' L3 reads, unattributed) |",
             "| --- " * (len(parts) + 7) + "|"]

    for kind in KINDS:
        if kind not in results:
            continue
        for name in [n for n in NAMES if n in results[kind]]:
            f = results[kind][name]
            per = max(1.0, f["stores_per_s"])

            def kb(x: float, per: float = per) -> str:
                return f"{x / per:.0f}"

            d = f.get("daemon_bytes_per_s") or {}
            cells = [f"{kb(d[p][0])} / {kb(d[p][1])}" if p in d else "-" for p in parts]
            total_d = sum(d.get("total", [0, 0]))  # (the hints received: in it)
            rest = f["l3_bytes_per_s"] - total_d
            lines.append(f"| {kind} | {name} | {f['writes_per_s']:.0f} | {f['stores_per_s']:.0f} | "
                         f"{kb(f['l3_bytes_per_s'])} | "
                         + " | ".join(cells)
                         + f" | {kb(f.get('hint_bytes_per_s', 0.0))} | {kb(rest)} |")
    return "\n".join(lines)


def probe_line(v: dict[str, Any]) -> str:
    lines = [f"load average {os.getloadavg()[0]:.1f}; visibility probe (another process, "
             f"spinning on get):"]
    for cls, where in (("same", "same host"), ("cross", "other host")):
        p = v[cls]
        lines.append(
            f"  {where}: put start → seen p50 {p['p50_us']:.0f} µs, p99 {p['p99_us']:.0f} µs "
            f"({p['n']} writes); staleness of its {p['reads']} reads p50 "
            f"{p['stale_p50_us']:.0f} µs, p99 {p['stale_p99_us']:.0f} µs, max "
            f"{p['stale_max_us']:.0f} µs ({p['stale_reads']} reads missed an acknowledged write)")
    return "\n".join(lines)


def _us(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.0f} µs"


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in KINDS if k in results]
    names = [n for n in NAMES if all(n in results[k] for k in kinds)]
    colours = ["#bbbbbb", "#8899aa", "#2b7bba", "#e08a2c", "#d4b483"][:len(names)]
    width = 0.8 / len(names)
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    panels = [("same-host share of cross-agent reads (%)",
               lambda f: 100 * f["same_host_share"]),
              ("L3 traffic (MB/s, all Redis nodes)", lambda f: f["l3_bytes_per_s"] / 1e6),
              ("staleness of cross-agent reads, mean (ms)",
               lambda f: f["stale_all_mean_us"] / 1000),
              ("L2 hit rate of reads (%)", lambda f: 100 * f["l2_hit_rate"])]
    for ax, (title, get) in zip(axes, panels, strict=True):
        for j, name in enumerate(names):
            xs = [k + (j - (len(names) - 1) / 2) * width for k in range(len(kinds))]
            ys = [get(results[kind][name]) for kind in kinds]
            bars = ax.bar(xs, ys, width, label=name, color=colours[j])
            fmt = "%.0f" if "share" in title else "%.2f" if "hit" in title else "%.1f"
            ax.bar_label(bars, fmt=fmt, fontsize=7)
        ax.set_xticks(range(len(kinds)), kinds)
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle("Affinity placement on a 3-host dev cluster (bench/bench_placement.py)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short runs (a smoke run)")
    ap.add_argument("--seconds", type=float, default=20.0, help="measured seconds per run (default 20)")
    ap.add_argument("--observe", type=float, default=8.0, help="seconds observed before planning (default 8)")
    ap.add_argument("--seed", type=int, default=12, help="seed of the random placement (default 12)")
    ap.add_argument("--json", help="write every figure to this file")
    ap.add_argument("--plot", help="write the plot to this PNG (needs kvcomm[plot])")
    ap.add_argument("--probe", type=int, default=300, help="writes in each visibility probe (default 300)")
    ap.add_argument("--probe-only", action="store_true", help="only the visibility probe")
    ap.add_argument("--move-cost-only", action="store_true",
                    help="only measure what a move's pieces cost in L3 bytes")
    ap.add_argument("--replot", metavar="JSON", help="only plot (--plot) the figures of --json's file")
    ap.add_argument("--unread-changes", type=int, default=1, metavar="N",
                    help="every host's cluster.unread_changes: a held key leaves L2 at the Nth "
                    "remote change in a row no agent of the host read it before (default 1; "
                    "0: every held key is refreshed at every change, the config's default)")
    ap.add_argument("--replan-every", type=float, default=4.0, metavar="S",
                    help="the replanned placement re-plans every S seconds (default 4)")
    ap.add_argument("--max-moves", type=int, default=4, metavar="M",
                    help="... moving at most M agents a round (default 4)")
    ap.add_argument("--move-bytes", type=float, default=MOVE_BYTES_IN_PROCESS, metavar="B",
                    help="... each move made only when it saves B L3 bytes before the next "
                    f"round (default {MOVE_BYTES_IN_PROCESS:g}: "
                         "kvcomm.placement.cost.MOVE_BYTES_IN_PROCESS, this bench's moves "
                         "being between host processes)")
    ap.add_argument("--placements", default=",".join(DEFAULT_NAMES),
                    help=f"comma-separated, of {', '.join(NAMES)} (default "
                    f"{','.join(DEFAULT_NAMES)}; random is always run: the others are "
                    "compared with it)")
    ap.add_argument("--workloads", default=",".join(KINDS),
                    help=f"comma-separated, of {', '.join(KINDS)} (default both)")
    args = ap.parse_args()
    kinds = [k for k in args.workloads.split(",") if k]
    if not kinds or not set(kinds) <= set(KINDS):
        ap.error(f"--workloads: some of {', '.join(KINDS)}")
    names = [n for n in NAMES if n == "random" or n in args.placements.split(",")]
    if not set(args.placements.split(",")) <= set(NAMES):
        ap.error(f"--placements: some of {', '.join(NAMES)}")
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), args.plot or "placement.png")
        return 0
    if args.move_cost_only:
        with tempfile.TemporaryDirectory(prefix="kvcomm-placement-") as d:
            dev = devcluster.up(3, str(Path(d) / "dev"),
                                cluster_settings={"unread_changes": args.unread_changes})
            try:
                print(json.dumps(move_cost_probe(dev)))
            finally:
                devcluster.down(str(Path(d) / "dev"))
        return 0
    if args.probe_only:
        with tempfile.TemporaryDirectory(prefix="kvcomm-placement-") as d:
            dev = devcluster.up(3, str(Path(d) / "dev"))
            try:
                v = visibility(dev, args.probe)
            finally:
                devcluster.down(str(Path(d) / "dev"))
        print(probe_line(v))
        return 0
    seconds, observe_s = (6.0, 4.0) if args.quick else (args.seconds, args.observe)
    print(f"kvcomm {kvcomm.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} cpus, "
          f"load average {os.getloadavg()[0]:.1f}; "
          f"3 hosts, {RATE:.0f} ticks/s, {seconds:.0f} s measured per run; "
          f"cluster.unread_changes {args.unread_changes}; replanned: every "
          f"{args.replan_every:g} s, at most {args.max_moves} moves, a move "
          f"{args.move_bytes:g} B; placements {','.join(names)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvcomm-placement-") as d:
        work = Path(d)
        dev = devcluster.up(3, str(work / "dev"),
                            cluster_settings={"unread_changes": args.unread_changes})
        try:
            results: dict[str, Any] = {}
            for kind in kinds:
                results[kind] = scenario(dev, kind, seconds, observe_s, work, args.seed,
                                         (args.replan_every, args.max_moves,
                                          args.move_bytes), names)
            results["visibility"] = visibility(dev, args.probe if not args.quick else 60)
        finally:
            devcluster.down(str(work / "dev"))
    print(table(results))
    print("\nWhere the L3 bytes go, bytes per change stored, into Redis / out of Redis "
          "(the daemons' count):")
    print(breakdown(results))
    v = results["visibility"]
    print(probe_line(v))
    print("\nPlanned and replanned against random, per workload (target: at most 0.70x "
          "random's L3 bytes per change stored):")
    for kind in kinds:
        r = results[kind]
        rnd = r["random"]
        hits = ", ".join(f"{n} {100 * r[n]['l2_hit_rate']:.2f}%" for n in NAMES if n in r)
        for name in [n for n in NAMES[2:] if n in r]:
            pl = r[name]
            per_store = pl["l3_bytes_per_store"] / rnd["l3_bytes_per_store"]
            print(f"{kind}: L3 bytes per change stored {name}/random {per_store:.3f} "
                  f"({pl['l3_bytes_per_store']:.0f} / {rnd['l3_bytes_per_store']:.0f} B), per "
                  f"second {pl['l3_bytes_per_s'] / rnd['l3_bytes_per_s']:.3f}")
        for name in [n for n in NAMES[3:] if n in r]:
            rp = r[name]
            rounds = rp["rounds"]
            obs = [x["observe_bytes"] for x in rounds if "observe_bytes" in x]
            print(f"{kind}: {name}: {rp['moves']} moves in {len(rounds)} rounds "
                  f"({rp['moves_per_min']:.0f} a minute; "
                  f"{sum(1 for x in rounds if x.get('skipped'))} rounds skipped; observing: "
                  f"{sum(obs) / max(1, len(obs)):.0f} B a round; a move must win "
                  + ", ".join(f"{x['move_cost_reads']:.0f} ({x['horizon_s']:.0f} s)"
                              for x in rounds if "move_cost_reads" in x)
                  + " reads/s), predicted share per round "
                  + ", ".join(f"{100 * (x.get('before') or 0):.0f}→"
                              f"{100 * (x.get('predicted') or 0):.0f}%"
                              for x in rounds if not x.get("skipped")))
            print(f"{kind}: {name}: the {rp['moved_in']} moved-in clients: "
                  f"{rp['moved_l3_opened']} opened an L3 client (at an L2 miss), "
                  f"{rp['moved_l3_bytes'] / 1000:.0f} kB of their own L3 traffic "
                  f"({rp['moved_l3_bytes'] / max(1, rp['moved_in']) / 1000:.1f} kB a move)")
        if "planned" in r:  # (the Redis commands the re-planning runs add, per second)
            base = r["planned"]["calls_per_s"]
            for name in [n for n in NAMES[3:] if n in r]:
                diff = {k: v - base.get(k, 0.0) for k, v in r[name]["calls_per_s"].items()}
                top = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:8]
                print(f"{kind}: {name} - planned, Redis calls per second: "
                      + ", ".join(f"{k} {v:+.1f}" for k, v in top))
        print(f"{kind}: the agents' own L3 traffic (their L3 clients' bytes, from the "
              "warm-up's end), B per change stored: " + ", ".join(
                  f"{n} {r[n]['agents_l3_bytes_per_s'] / max(1.0, r[n]['stores_per_s']):.0f} "
                  f"({r[n]['agents_l3_opened']} L3 clients opened)" for n in NAMES if n in r))
        print(f"{kind}: L2 hit rate {hits}")
    for kind in kinds:
        r = results[kind]
        if "planned" not in r or "replanned" not in r:
            continue
        rnd, pl = r["random"], r["planned"]
        ratio = pl["same_host_share"] / rnd["same_host_share"]
        print(f"{kind}: planned/random same-host share {ratio:.2f}x; "
              f"L3 bytes {100 * (pl['l3_bytes_per_s'] / rnd['l3_bytes_per_s'] - 1):+.0f}% vs random "
              f"per second, {100 * (pl['l3_bytes_per_store'] / rnd['l3_bytes_per_store'] - 1):+.0f}% "
              f"per change stored ({pl['l3_bytes_per_store']:.0f} vs {rnd['l3_bytes_per_store']:.0f} B); "
              f"plan predicted {100 * (pl['predicted_share'] or 0):.0f}% "
              f"(observed before: {100 * (pl['observed_before'] or 0):.0f}%); replanned "
              f"{r['replanned']['same_host_share'] / rnd['same_host_share']:.2f}x")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
