"""Three LLM-free LangGraph agents, three processes, one shared memory: KVCommStore.

    python examples/langgraph_agents.py                    # embedded: one host's L2
    kvcomm dev-cluster up --hosts 3 --dir /tmp/kvc --strong lg/cp/h/   # (the saver's heads)
    python examples/langgraph_agents.py --configs /tmp/kvc/host-1.yaml \\
        /tmp/kvc/host-2.yaml /tmp/kvc/host-3.yaml          # one agent per dev-cluster host

* **scout** (a graph of one node, looping): reads 12 "sensor" values (a fixed
  pseudo-random sequence) and puts each as a memory in ``("field", "observations")``;
* **analyst**: waits until the observations are all in the store (``search`` by
  namespace prefix), puts their mean and the hot ones (``filter={"temp": {"$gt": 30}}``)
  in ``("field", "analysis")``;
* **writer**: waits for the analysis, writes a report in ``("field", "reports")``.

Each agent is its own process with its own ``kvcomm.open()``, its own LangGraph graph,
compiled with ``store=KVCommStore(kv)`` (the shared memory) and
``checkpointer=KVCommSaver(kv)`` (its thread, resumable on any host). The parent starts
them, waits for them, prints the report from the store and exits 0 when everything is
there (1 otherwise). No LLM, no network beyond KVCOMM's own servers in cluster mode.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import sys
import time
import uuid
from typing import Any, TypedDict

import kvcomm
from kvcomm.integrations.langgraph import KVCommSaver, KVCommStore

N_OBSERVATIONS = 12
ROOT = ("field",)


class State(TypedDict):
    done: int


def wait_for_items(store: KVCommStore, namespace: tuple[str, ...], n: int,
                   timeout: float = 60.0) -> list[Any]:
    """Poll the store until ``namespace`` holds ``n`` items (or raise after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        items = store.search(namespace, limit=1000)
        if len(items) >= n:
            return items
        if time.monotonic() > deadline:
            raise TimeoutError(f"{namespace} holds {len(items)} items, expected {n}")
        time.sleep(0.02)


def scout(store: KVCommStore, run: str) -> None:
    rng = random.Random(7)
    for i in range(N_OBSERVATIONS):
        store.put((*ROOT, run, "observations"), f"obs-{i:02d}",
                  {"sensor": f"s{i % 3}", "temp": round(15 + rng.random() * 25, 1)})


def analyst(store: KVCommStore, run: str) -> None:
    obs = wait_for_items(store, (*ROOT, run, "observations"), N_OBSERVATIONS)
    hot = store.search((*ROOT, run, "observations"), filter={"temp": {"$gt": 30}}, limit=1000)
    store.put((*ROOT, run, "analysis"), "summary",
              {"n": len(obs), "mean": round(statistics.mean(i.value["temp"] for i in obs), 2),
               "hot": [i.key for i in hot]})


def writer(store: KVCommStore, run: str) -> None:
    (summary,) = wait_for_items(store, (*ROOT, run, "analysis"), 1)
    s = summary.value
    store.put((*ROOT, run, "reports"), "daily",
              {"text": f"{s['n']} observations, mean {s['mean']} C, "
                       f"{len(s['hot'])} over 30 C: {', '.join(s['hot']) or 'none'}"})


ROLES = {"scout": scout, "analyst": analyst, "writer": writer}


def agent(role: str, run: str, namespace: str | None, config: str | None) -> None:
    """One agent process: its own client, store, checkpointer and graph."""
    from langgraph.config import get_store
    from langgraph.graph import END, START, StateGraph

    with kvcomm.open(namespace, config=config, agent=role) as kv:
        store = KVCommStore(kv)

        def work(state: State) -> dict[str, Any]:
            ROLES[role](get_store(), run)  # type: ignore[arg-type]
            return {"done": state["done"] + 1}

        g = StateGraph(State)
        g.add_node("work", work)
        g.add_edge(START, "work")
        g.add_edge("work", END)
        graph = g.compile(store=store, checkpointer=KVCommSaver(kv))
        out = graph.invoke({"done": 0}, {"configurable": {"thread_id": f"{run}/{role}"}})
        assert out["done"] == 1
        print(f"[{role}] done", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--namespace", default="lg-agents-example",
                    help="the L2 namespace in embedded mode (default lg-agents-example)")
    ap.add_argument("--configs", nargs=3, metavar="YAML",
                    help="one config per agent (cluster mode: e.g. the dev cluster's hosts)")
    args = ap.parse_args()
    run = uuid.uuid4().hex[:8]
    configs = args.configs or [None, None, None]
    namespace = None if args.configs else args.namespace
    ctx = mp.get_context("spawn")
    # (started in reverse: the readers wait for the writers through the store)
    procs = [ctx.Process(target=agent, args=(role, run, namespace, cfg), name=role)
             for role, cfg in zip(reversed(list(ROLES)), reversed(configs), strict=True)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    failed = [p.name for p in procs if p.exitcode != 0]
    with kvcomm.open(namespace, config=configs[0]) as kv:
        report = KVCommStore(kv).get((*ROOT, run, "reports"), "daily")
        print("namespaces:", KVCommStore(kv).list_namespaces(prefix=(*ROOT, run)))
    if failed or report is None:
        print(f"FAILED: agents {failed}, report {report}", file=sys.stderr)
        return 1
    print("report:", report.value["text"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
