"""LangGraph checkpointers in one run: KVCommSaver against LangGraph's InMemorySaver and
SqliteSaver.

    python bench/bench_langgraph.py [--n 2000] [--rounds 5] [--graphs 20] [--cluster]

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
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import tempfile
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
        kv = stack.enter_context(kvcomm.open(ns, config=kvcomm.Config.from_mapping(
            {"cache": {"l2_size": "256MB"}})))
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="puts and reads per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--graphs", type=int, default=20, help="20-step graph runs per round")
    ap.add_argument("--cluster", action="store_true",
                    help="also KVCommSaver on a one-host dev cluster (needs redis-server, etcd)")
    args = ap.parse_args()
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
