"""LangGraph checkpointers in one run: KVCommSaver against LangGraph's InMemorySaver and
SqliteSaver; with ``--async``, the async savers.

    python bench/bench_langgraph.py [--n 2000] [--rounds 5] [--graphs 20] [--cluster]
    python bench/bench_langgraph.py --async [--n 500] [--rounds 3] [--concurrency 50]
    python bench/bench_langgraph.py --graph-only [--n 300] [--rounds 15] [--graphs 2]
    python bench/bench_langgraph.py --bytecodes

For each saver, interleaved in ``--rounds`` rounds (a noisy neighbour hits all alike):

* **put**: one checkpoint of 3 channels (~1 KB each, all new versions) appended to a
  thread, p50 of ``--n`` puts, each timed on its own;
* **get_tuple**: the latest checkpoint of that thread (3 channel values, 2 pending
  writes), p50 of ``--n`` reads;
* **20-step graph**: wall time of ``graph.invoke`` of a graph whose one node loops 20
  times (each step: a checkpoint put, a task's writes), median of ``--graphs`` runs, a
  new thread each.

Savers: ``InMemorySaver()`` (a dict in the process), ``SqliteSaver`` on a file in a
temporary directory (its default journal; what a single-host deployment persists with),
``KVCommSaver`` on an embedded client (the host's shared memory: every process of the
host sees the threads). With ``--cluster``, also ``KVCommSaver`` on a one-host dev
cluster (Redis Cluster + etcd + a node daemon) with strong heads
(``cache.strong_prefixes: ["lg/cp/h/"]``): each put then also moves the head in etcd.
Ratios are KVCommSaver's time over each peer's (below 1: faster).

``--async``: ``KVCommSaver`` over ``kvcomm.aio`` (embedded) beside ``InMemorySaver``'s
async methods, ``AsyncSqliteSaver`` (aiosqlite, a file in a temporary directory) and
``AsyncPostgresSaver`` (langgraph-checkpoint-postgres, a connection pool of 20, on a real
PostgreSQL 15 that the benchmark starts itself: ``initdb`` and ``pg_ctl`` from
``--pg-bin``, in a temporary directory, on a free port, run as the ``postgres`` user when
run as root, stopped at the end). Per saver: ``aput`` and ``aget_tuple`` p50 (as above,
each awaited on its own), and the throughput of a 20-step graph of an async node under
``--concurrency`` concurrent threads (``asyncio.gather`` of that many ``ainvoke``, each a
new thread; graphs per second over ``--graphs`` such waves, of wall time and of the
process's CPU time). Ratios: KVCommSaver's
throughput over each peer's (above 1: faster), and the peer's put/get_tuple time over
KVCommSaver's (above 1: KVCommSaver faster).

``--graph-only``: the graph target alone, steadier. First a graph step's cost to each
sync saver (the calls a 20-step graph made, recorded once, replayed ``--n`` times on new
threads, interleaved: min and median µs per step). Then KVCommSaver (over
``kvcomm.aio``) and InMemorySaver in ``--rounds`` interleaved pairs of ``--graphs`` waves
of ``--concurrency`` concurrent 20-step graphs: the median of the pairs' ratios of graphs
per CPU-second (after three such untimed rounds of each; the heap collected before each
side's waves; a new InMemorySaver for each pair, so that the threads it keeps in the
process do not slow every later collection of both sides); and the ratio of each side's
best pair (a noisy neighbour only adds CPU time, so each side's least is nearest its own
cost).

``--bytecodes``: the Python bytecodes (and calls) a graph step runs in each sync saver,
counted with ``sys.settrace`` over one replay of the recorded calls: a count, which the
machine's speed does not move (the C a call runs is not in it).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import functools
import gc
import os
import resource
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from typing import Any, TypedDict

from _timing import heading, p50_each, stopwatch
from langgraph.checkpoint.base import BaseCheckpointSaver, Checkpoint
from langgraph.checkpoint.base.id import uuid6
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, StateGraph

import kvcomm
from kvcomm.devcluster.redis_server import free_port  # (below the ephemeral range)
from kvcomm.integrations.langgraph import KVCommSaver
from kvcomm.tiers import l2

VALUE = "x" * 1000


def checkpoints(saver: BaseCheckpointSaver[Any], n: int) -> list[tuple[Checkpoint, dict[str, Any]]]:
    """``n`` successive checkpoints of one thread, each with new versions of 3 channels
    (made by the saver's own ``get_next_version``)."""
    out = []
    versions: dict[str, Any] = {}
    for i in range(n):
        versions = {ch: saver.get_next_version(versions.get(ch), None) for ch in ("a", "b", "c")}
        cp = Checkpoint(v=1, id=str(uuid6(clock_seq=i)), ts=datetime.now(UTC).isoformat(),
                        channel_values={ch: f"{VALUE}{i}" for ch in versions},
                        channel_versions=dict(versions), versions_seen={"node": dict(versions)},
                        updated_channels=None)
        out.append((cp, dict(versions)))
    return out


class Loop(TypedDict):
    n: int


def graph(saver: BaseCheckpointSaver[Any]) -> Any:
    g = StateGraph(Loop)
    g.add_node("step", lambda s: {"n": s["n"] + 1})
    g.add_edge(START, "step")
    g.add_conditional_edges("step", lambda s: END if s["n"] >= 20 else "step")
    return g.compile(checkpointer=saver)


def bench_saver(saver: BaseCheckpointSaver[Any], n: int, graphs: int) -> dict[str, float]:
    thread = f"bench-{uuid.uuid4().hex[:8]}"
    cfg: dict[str, Any] = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    made = checkpoints(saver, n)
    it: Iterator[tuple[Checkpoint, dict[str, Any]]] = iter(made)

    def put() -> None:
        nonlocal cfg
        cp, versions = next(it)
        cfg = saver.put(cfg, cp, {"source": "loop", "step": 1, "parents": {}}, versions)

    put_ns = p50_each(put, n)
    saver.put_writes(cfg, [("a", "w1"), ("b", "w2")], "task-1")
    latest: dict[str, Any] = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    tup = saver.get_tuple(latest)
    assert tup is not None and len(tup.pending_writes or []) == 2
    get_ns = p50_each(lambda: saver.get_tuple(latest), n)
    g = graph(saver)
    walls = []
    for _ in range(graphs):
        with stopwatch() as took:
            out = g.invoke({"n": 0}, {"configurable": {"thread_id": f"g-{uuid.uuid4().hex}"}})
        assert out["n"] == 20
        walls.append(took[0])
    return {"put": put_ns / 1e3, "get_tuple": get_ns / 1e3, "graph": statistics.median(walls) * 1e3}


@contextmanager
def savers(tmp: str, cluster: bool) -> Iterator[dict[str, Callable[[], BaseCheckpointSaver[Any]]]]:
    with ExitStack() as stack:
        ns = f"bench-lg-{os.getpid()}"
        kv = stack.enter_context(kvcomm.open(ns))  # (the shipped defaults)
        stack.callback(l2.purge, ns)
        conn = sqlite3.connect(os.path.join(tmp, "cp.sqlite"), check_same_thread=False)
        stack.callback(conn.close)
        out: dict[str, Callable[[], BaseCheckpointSaver[Any]]] = {
            "InMemorySaver": InMemorySaver,
            "SqliteSaver": lambda: SqliteSaver(conn),
            "KVCommSaver": lambda: KVCommSaver(kv),
        }
        if cluster:
            from kvcomm import devcluster

            d = os.path.join(tmp, "dc")
            state = devcluster.up(1, d, strong_prefixes=["lg/cp/h/"])
            stack.callback(devcluster.down, d)
            ckv = stack.enter_context(kvcomm.open(config=state["hosts"][0]["config"]))
            out["KVCommSaver (cluster)"] = lambda: KVCommSaver(ckv)
        yield out


# ---------------------------------------------------------------- the async savers


def async_graph(saver: BaseCheckpointSaver[Any]) -> Any:
    async def step(s: Loop) -> dict[str, Any]:
        return {"n": s["n"] + 1}

    g = StateGraph(Loop)
    g.add_node("step", step)
    g.add_edge(START, "step")
    g.add_conditional_edges("step", lambda s: END if s["n"] >= 20 else "step")
    return g.compile(checkpointer=saver)


async def abench_saver(saver: BaseCheckpointSaver[Any], n: int, waves: int,
                       concurrency: int) -> dict[str, float]:
    thread = f"bench-{uuid.uuid4().hex[:8]}"
    cfg: dict[str, Any] = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    made = iter(checkpoints(saver, n))
    samples = []
    for _ in range(n):
        cp, versions = next(made)
        t0 = time.perf_counter_ns()
        cfg = await saver.aput(cfg, cp, {"source": "loop", "step": 1, "parents": {}}, versions)
        samples.append(time.perf_counter_ns() - t0)
    put_ns = statistics.median(samples)
    await saver.aput_writes(cfg, [("a", "w1"), ("b", "w2")], "task-1")
    latest: dict[str, Any] = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    tup = await saver.aget_tuple(latest)
    assert tup is not None and len(tup.pending_writes or []) == 2
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        await saver.aget_tuple(latest)
        samples.append(time.perf_counter_ns() - t0)
    get_ns = statistics.median(samples)
    g = async_graph(saver)
    await asyncio.gather(*(  # (a wave untimed: the graph's first runs warm LangGraph's caches)
        g.ainvoke({"n": 0}, {"configurable": {"thread_id": f"w-{uuid.uuid4().hex}"}})
        for _ in range(concurrency)))
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(waves):
        outs = await asyncio.gather(*(
            g.ainvoke({"n": 0}, {"configurable": {"thread_id": f"g-{uuid.uuid4().hex}"}})
            for _ in range(concurrency)))
        assert all(o["n"] == 20 for o in outs)
    graphs = waves * concurrency
    return {"put": put_ns / 1e3, "get_tuple": get_ns / 1e3,
            "graphs/s": graphs / (time.perf_counter() - t0),
            # (per second of this process's CPU: what the load of other processes on a
            # shared machine does not skew; a server's CPU, PostgreSQL's, is not counted)
            "graphs/cpu-s": graphs / (time.process_time() - c0)}


@contextmanager
def postgres(tmp: str, bin_dir: str) -> Iterator[str]:
    """A PostgreSQL server of its own (``initdb`` in ``tmp``, a free port); its URI."""
    d = os.path.join(tmp, "pg")
    os.makedirs(d)
    as_user: list[str] = []
    if os.geteuid() == 0:  # (PostgreSQL refuses to run as root)
        shutil.chown(tmp, "postgres")
        shutil.chown(d, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    run = functools.partial(subprocess.run, check=True, capture_output=True)
    run([*as_user, os.path.join(bin_dir, "initdb"), "-D", d, "-A", "trust", "-U", "postgres",
         "--no-sync"])
    run([*as_user, os.path.join(bin_dir, "pg_ctl"), "-D", d, "-w", "-l", os.path.join(d, "log"),
         "-o", f"-p {port} -k {d} -c listen_addresses=127.0.0.1 -c fsync=on", "start"])
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        run([*as_user, os.path.join(bin_dir, "pg_ctl"), "-D", d, "-m", "fast", "stop"])


async def amain(args: argparse.Namespace) -> None:
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
    from psycopg.rows import dict_row
    from psycopg_pool import AsyncConnectionPool

    import kvcomm.aio

    with tempfile.TemporaryDirectory() as tmp, postgres(tmp, args.pg_bin) as uri:
        ns = f"bench-lg-aio-{os.getpid()}"
        async with kvcomm.aio.open(ns) as akv, \
                AsyncSqliteSaver.from_conn_string(os.path.join(tmp, "cp.sqlite")) as sqlite, \
                AsyncConnectionPool(uri, min_size=4, max_size=20, open=False, kwargs={
                    "autocommit": True, "prepare_threshold": 0, "row_factory": dict_row}) as pool:
            try:
                pg = AsyncPostgresSaver(pool)  # type: ignore[arg-type]
                await pg.setup()
                makers: dict[str, Callable[[], BaseCheckpointSaver[Any]]] = {
                    "InMemorySaver": InMemorySaver,
                    "AsyncSqliteSaver": lambda: sqlite,
                    "AsyncPostgresSaver": lambda: pg,
                    "KVCommSaver (aio)": lambda: KVCommSaver(akv),
                }
                results: dict[str, list[dict[str, float]]] = {name: [] for name in makers}
                for r in range(args.rounds):
                    for name, make in makers.items():
                        results[name].append(await abench_saver(make(), args.n, args.graphs,
                                                                args.concurrency))
                    print(f"round {r + 1}/{args.rounds} done", flush=True)
                off_loop = akv.off_loop
            finally:
                l2.purge(ns)
    keys = ("put", "get_tuple", "graphs/s", "graphs/cpu-s")
    med = {name: {m: statistics.median(x[m] for x in rs) for m in keys}
           for name, rs in results.items()}
    heading(f"LangGraph async checkpointers: p50 over {args.rounds} rounds (n={args.n} aputs and "
            f"aget_tuples; {args.graphs} waves of {args.concurrency} concurrent 20-step graphs)")
    print(f"{'saver':<22}{'aput µs':>10}{'aget_tuple µs':>15}{'graphs/s':>11}{'graphs/cpu-s':>14}")
    for name, m in med.items():
        print(f"{name:<22}{m['put']:>10.1f}{m['get_tuple']:>15.1f}{m['graphs/s']:>11.1f}"
              f"{m['graphs/cpu-s']:>14.1f}")
    heading("ratios: graph throughput KVCommSaver/peer; put and get_tuple time peer/KVCommSaver "
            "(above 1: KVCommSaver faster)")
    ours = med["KVCommSaver (aio)"]
    print(f"(KVCommSaver's calls that left the event loop for the aio client's pool: {off_loop})")
    for peer in ("InMemorySaver", "AsyncSqliteSaver", "AsyncPostgresSaver"):
        p = med[peer]
        print(f"vs {peer:<19} graph {ours['graphs/s'] / p['graphs/s']:6.2f}x (per CPU-s "
              f"{ours['graphs/cpu-s'] / p['graphs/cpu-s']:5.2f}x)   put "
              f"{p['put'] / ours['put']:7.2f}x   get_tuple {p['get_tuple'] / ours['get_tuple']:7.2f}x")


# ---------------------------------------------------------------- the graph target alone


async def graph_pairs(pairs: int, waves: int,
                      concurrency: int) -> tuple[list[float], float, dict[str, list[float]]]:
    """KVCommSaver's graph throughput over InMemorySaver's, per CPU-second, in ``pairs``
    interleaved pairs of ``waves`` waves each (one process, one loop): a noisy neighbour
    hits both sides of a pair alike. Returns the pairs' ratios, the ratio of each side's
    best pair (a neighbour only ever adds CPU time: each side's least is its own cost, as
    timeit takes the least of its repeats), and each side's totals over all pairs: user
    and system CPU seconds, minor page faults, graphs (``getrusage``)."""
    import kvcomm.aio

    ns = f"bench-lg-pairs-{os.getpid()}"
    async with kvcomm.aio.open(ns) as akv:  # (the shipped defaults)
        try:
            graphs = {"mem": async_graph(InMemorySaver()), "kv": async_graph(KVCommSaver(akv))}

            totals = {"mem": [0.0] * 4, "kv": [0.0] * 4}  # (user s, system s, faults, graphs)

            async def rate(g: Any, side: str | None = None) -> float:
                # (each side starts from a collected heap: a full collection, which grows
                # with everything the process holds, InMemorySaver's threads included,
                # then lands in either side's waves alike, not at random in one of them)
                gc.collect()
                r0 = resource.getrusage(resource.RUSAGE_SELF)
                for _ in range(waves):
                    outs = await asyncio.gather(*(g.ainvoke(
                        {"n": 0}, {"configurable": {"thread_id": f"g-{uuid.uuid4().hex}"}})
                        for _ in range(concurrency)))
                    assert all(o["n"] == 20 for o in outs)
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                user, system = r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime
                if side is not None:
                    t = totals[side]
                    t[0] += user
                    t[1] += system
                    t[2] += r1.ru_minflt - r0.ru_minflt
                    t[3] += waves * concurrency
                return waves * concurrency / (user + system)

            for g in graphs.values():  # (untimed: LangGraph's caches warmed, and the
                for _ in range(3):  # namespace's first pages touched)
                    await rate(g)
            ratios, best = [], {"mem": 0.0, "kv": 0.0}
            for _ in range(pairs):
                # (a new InMemorySaver each pair: the threads it keeps in the process would
                # otherwise grow every later collection, on both sides, pair after pair;
                # KVCommSaver keeps its threads in the segment, and its bounded memos)
                graphs["mem"] = async_graph(InMemorySaver())
                mem = await rate(graphs["mem"], "mem")
                kv = await rate(graphs["kv"], "kv")
                ratios.append(kv / mem)
                best = {"mem": max(best["mem"], mem), "kv": max(best["kv"], kv)}
            return ratios, best["kv"] / best["mem"], totals
        finally:
            l2.purge(ns)


def recorded_steps() -> tuple[list[tuple[str, Any]], int]:
    """The calls (("put" | "writes", args)) a 20-step graph made, recorded once from
    InMemorySaver, and its number of steps (puts)."""
    calls: list[tuple[str, Any]] = []

    class Recording(InMemorySaver):
        def put(self, config: Any, checkpoint: Any, metadata: Any, new_versions: Any) -> Any:
            calls.append(("put", copy.deepcopy((config, checkpoint, metadata, new_versions))))
            return super().put(config, checkpoint, metadata, new_versions)

        def put_writes(self, config: Any, writes: Any, task_id: str, task_path: str = "") -> None:
            calls.append(("writes", copy.deepcopy((config, writes, task_id, task_path))))
            super().put_writes(config, writes, task_id, task_path)

    graph(Recording()).invoke({"n": 0}, {"configurable": {"thread_id": "recorded"}})
    return calls, sum(kind == "put" for kind, _a in calls)


def replay(saver: BaseCheckpointSaver[Any], calls: list[tuple[str, Any]], thread: str) -> None:
    """The recorded calls, on ``thread`` (a new thread id each replay)."""
    for kind, args in calls:
        cfg = args[0]
        args = ({**cfg, "configurable": {**cfg["configurable"], "thread_id": thread}}, *args[1:])
        (saver.put if kind == "put" else saver.put_writes)(*args)


@contextmanager
def step_savers() -> Iterator[dict[str, BaseCheckpointSaver[Any]]]:
    """InMemorySaver and a KVCommSaver on an embedded namespace of this process (purged at
    the end), with the shipped defaults."""
    ns = f"bench-lg-steps-{os.getpid()}"
    with kvcomm.open(ns) as kv:
        try:
            yield {"InMemorySaver": InMemorySaver(), "KVCommSaver": KVCommSaver(kv)}
        finally:
            l2.purge(ns)


def step_costs(reps: int) -> dict[str, list[float]]:
    """µs per graph step (a put and a task's writes) of each sync saver, replaying the
    calls a 20-step graph made on a new thread id per replay: the saver's own CPU, without
    LangGraph's."""
    calls, steps = recorded_steps()
    out: dict[str, list[float]] = {"InMemorySaver": [], "KVCommSaver": []}
    with step_savers() as made:
        for rep in range(reps):
            for name, saver in made.items():  # (interleaved)
                t0 = time.perf_counter_ns()
                replay(saver, calls, f"{name}-{rep}")
                out[name].append((time.perf_counter_ns() - t0) / steps / 1e3)
    return out


def step_bytecodes() -> dict[str, tuple[float, float]]:
    """(Python bytecodes, Python calls) per graph step of each sync saver: one replay
    (after two untimed ones) traced by ``sys.settrace`` with opcode events. A count, not a
    time: the machine's speed does not move it (C code counts as the one call that runs it)."""
    calls, steps = recorded_steps()
    out: dict[str, tuple[float, float]] = {}
    with step_savers() as made:
        for name, saver in made.items():
            counts = [0, 0]

            def tracer(frame: Any, event: str, arg: Any, counts: list[int] = counts) -> Any:
                if event == "call":
                    if frame.f_code is replay.__code__:
                        return None  # (the replay loop itself: not the saver's)
                    frame.f_trace_opcodes = True
                    counts[1] += 1
                elif event == "opcode":
                    counts[0] += 1
                return tracer

            for rep in range(2):
                replay(saver, calls, f"{name}-warm-{rep}")
            sys.settrace(tracer)
            try:
                replay(saver, calls, f"{name}-traced")
            finally:
                sys.settrace(None)
            out[name] = (counts[0] / steps, counts[1] / steps)
    return out


def bytecodes() -> None:
    heading("Python bytecodes and calls per graph step (a put and a task's writes; one "
            "traced replay of a recorded 20-step graph)")
    counted = step_bytecodes()
    for name, (ops, calls) in counted.items():
        print(f"{name:<16} bytecodes {ops:8.1f}   calls {calls:6.1f}")
    print(f"KVCommSaver / InMemorySaver: {counted['KVCommSaver'][0] / counted['InMemorySaver'][0]:.2f}x"
          " the bytecodes")


def graph_only(args: argparse.Namespace) -> None:
    costs = step_costs(args.n)
    heading(f"a graph step's cost to each saver (a put and a task's writes, replayed {args.n} "
            "times; µs)")
    for name, xs in costs.items():
        print(f"{name:<16} min {min(xs):6.1f}   median {statistics.median(xs):6.1f}")
    ratios, of_best, totals = asyncio.run(
        graph_pairs(args.rounds, args.graphs, args.concurrency))
    heading(f"graph throughput per CPU-second, KVCommSaver (aio) / InMemorySaver: "
            f"{args.rounds} interleaved pairs of {args.graphs} waves of {args.concurrency} "
            "concurrent 20-step graphs (target >= 0.9)")
    print(f"median {statistics.median(ratios):.3f}   pairs "
          + " ".join(f"{r:.2f}" for r in sorted(ratios)))
    print(f"each side's best pair: {of_best:.3f}")
    # (the sides' totals over every pair: where the CPU a graph costs goes. System time
    # is mostly new memory: KVCommSaver's namespace grows by what it stores, each new page
    # of the segment faulted in once; InMemorySaver's dicts reuse the memory the previous
    # pair's saver freed)
    cpu = {side: (t[0] + t[1]) / t[3] for side, t in totals.items()}
    for side, name in (("mem", "InMemorySaver"), ("kv", "KVCommSaver")):
        t = totals[side]
        print(f"{name:<16} CPU per graph {cpu[side] * 1e3:6.2f} ms (user {t[0] / t[3] * 1e3:6.2f}, "
              f"system {t[1] / t[3] * 1e3:5.2f})   page faults per graph {t[2] / t[3]:5.1f}")
    print(f"the totals' ratio: {cpu['mem'] / cpu['kv']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="puts and reads per round")
    ap.add_argument("--rounds", type=int, default=5,
                    help="interleaved rounds (--graph-only: pairs of KVCommSaver and InMemorySaver)")
    ap.add_argument("--graphs", type=int, default=20, help="20-step graph runs per round")
    ap.add_argument("--cluster", action="store_true",
                    help="also KVCommSaver on a one-host dev cluster (needs redis-server, etcd)")
    ap.add_argument("--async", dest="aio", action="store_true",
                    help="the async savers (KVCommSaver over kvcomm.aio, AsyncSqliteSaver, "
                         "AsyncPostgresSaver on a PostgreSQL started here)")
    ap.add_argument("--concurrency", type=int, default=50, help="--async: concurrent graphs")
    ap.add_argument("--pg-bin", default="/usr/lib/postgresql/15/bin",
                    help="--async: the folder of PostgreSQL's initdb and pg_ctl")
    ap.add_argument("--graph-only", action="store_true",
                    help="only the graph target (KVCommSaver's graph throughput over "
                         "InMemorySaver's, >= 0.9): a step's cost to each sync saver (--n "
                         "replays), then --rounds interleaved pairs of --graphs waves")
    ap.add_argument("--bytecodes", action="store_true",
                    help="only the Python bytecodes a graph step runs in each sync saver (a "
                         "count: steady on any machine)")
    args = ap.parse_args()
    if args.bytecodes:
        bytecodes()
        return
    if args.graph_only:
        graph_only(args)
        return
    if args.aio:
        asyncio.run(amain(args))
        return
    with tempfile.TemporaryDirectory() as tmp, savers(tmp, args.cluster) as makers:
        results: dict[str, list[dict[str, float]]] = {name: [] for name in makers}
        for r in range(args.rounds):
            for name, make in makers.items():
                results[name].append(bench_saver(make(), args.n, args.graphs))
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    med = {name: {m: statistics.median(x[m] for x in rs) for m in ("put", "get_tuple", "graph")}
           for name, rs in results.items()}
    heading(f"LangGraph checkpointers: p50 over {args.rounds} rounds (n={args.n} puts and "
            f"get_tuples, {args.graphs} graphs per round)")
    print(f"{'saver':<24}{'put µs':>10}{'get_tuple µs':>14}{'20-step graph ms':>18}")
    for name, m in med.items():
        print(f"{name:<24}{m['put']:>10.1f}{m['get_tuple']:>14.1f}{m['graph']:>18.2f}")
    heading("ratios: KVCommSaver / peer (below 1: KVCommSaver faster)")
    ours = med["KVCommSaver"]
    for peer in ("InMemorySaver", "SqliteSaver"):
        p = med[peer]
        print(f"vs {peer:<14} put {ours['put'] / p['put']:5.2f}x   get_tuple "
              f"{ours['get_tuple'] / p['get_tuple']:5.2f}x   graph {ours['graph'] / p['graph']:5.2f}x")
    if "KVCommSaver (cluster)" in med:
        c = med["KVCommSaver (cluster)"]
        print(f"cluster / embedded    put {c['put'] / ours['put']:5.2f}x   get_tuple "
              f"{c['get_tuple'] / ours['get_tuple']:5.2f}x   graph {c['graph'] / ours['graph']:5.2f}x")


if __name__ == "__main__":
    main()
