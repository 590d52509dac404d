"""An agent that stores memories in one process and recalls them by meaning in another.

    .venv/bin/python examples/langgraph_memory.py        # embedded: one host's L2
    .venv/bin/python examples/langgraph_memory.py --config /tmp/kvc/host-2.yaml   # a dev-cluster host

* a **learner** process (a LangGraph graph with one node) puts what a user told it as
  memories in ``("memories", user)``: ``KVCommStore(kv, index=...)`` embeds each one and
  keeps its vector in the item's record and in the host's shared-memory index;
* a **recaller** process (another graph, its own ``kvcomm.open()``) asks questions and
  recalls the memories closest in meaning with ``store.search(ns, query=...)``, with a
  ``filter`` too.

The embedding is a toy, so the example runs offline: a hashed bag of words, with a few
words mapped onto shared concepts ("bike" and "cycling" are near; "tea" and "coffee" are
near). Put a real model in its place (``"embed": init_embeddings("openai:text-embedding-3-
small")``, ``"dims": 1536``): nothing else changes. The parent exits 0 when every
question recalled the memory it should (1 otherwise).

Embedded, it uses its own namespace (``--namespace``, default ``lg-memory-example``), a
small index (``INDEX_CAPACITY`` vectors: the host's index file is reserved in full when it
is made, about 1.3 MB here against 132 MB at the default 100,000) and purges the namespace
(its segment and its index file, which would otherwise stay in /dev/shm) when it ends;
``--keep`` leaves them for ``kvcomm info --name lg-memory-example``. With ``--config`` the
namespace is the config's and is left alone (a cluster host's index is not kept in
/dev/shm: a search scores the records).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import multiprocessing as mp
import sys
import uuid
from typing import Any, TypedDict

import kvcomm
from kvcomm.integrations.langgraph import KVCommStore
from kvcomm.tiers.l2 import purge

DIMS = 256
CONCEPTS = {"bike": "cycling", "bicycle": "cycling", "cycling": "cycling", "ride": "cycling",
            "tea": "drink", "coffee": "drink", "espresso": "drink", "drink": "drink",
            "dog": "pet", "puppy": "pet", "pet": "pet", "cat": "pet"}
MEMORIES = {
    "m1": ({"text": "I ride my bicycle to work every day", "kind": "habit"}),
    "m2": ({"text": "I drink green tea in the morning", "kind": "habit"}),
    "m3": ({"text": "My dog is called Pixel", "kind": "fact"}),
    "m4": ({"text": "I live in Lisbon", "kind": "fact"}),
}
QUESTIONS = [("what about cycling", None, "m1"), ("any coffee preference", None, "m2"),
             ("tell me about the puppy", {"kind": "fact"}, "m3")]


def embed(texts: list[str]) -> list[list[float]]:
    """A toy embedding: each word adds a hashed +-1 at a few places; a word with a concept
    adds its concept's, three times as much (the "meaning")."""
    out = []
    for text in texts:
        v = [0.0] * DIMS
        for word in text.lower().split():
            word = word.strip("?.,!")
            weight = 3.0 if word in CONCEPTS else 1.0
            h = hashlib.blake2b(CONCEPTS.get(word, word).encode(), digest_size=8).digest()
            for i in range(4):
                v[h[i] % DIMS] += weight if h[4 + i] & 1 else -weight
        n = math.sqrt(sum(x * x for x in v)) or 1.0
        out.append([x / n for x in v])
    return out


INDEX = {"dims": DIMS, "embed": embed, "fields": ["text"]}
INDEX_CAPACITY = 1_000  # vectors in the host's index file (reserved in full when made)


class State(TypedDict):
    user: str
    notes: list[str]


def run_node(kv: kvcomm.Client, node: Any, user: str) -> dict[str, Any]:
    """Run a graph of the one node ``node``, its store a KVCommStore with the index."""
    from langgraph.graph import END, START, StateGraph

    g = StateGraph(State)
    g.add_node(node.__name__, node)
    g.add_edge(START, node.__name__)
    g.add_edge(node.__name__, END)
    store = KVCommStore(kv, index=INDEX, index_capacity=INDEX_CAPACITY)
    return g.compile(store=store).invoke({"user": user, "notes": []})


def learner(namespace: str | None, config: str | None, user: str) -> None:
    from langgraph.store.base import BaseStore

    def remember(state: State, *, store: BaseStore) -> dict[str, Any]:
        for key, value in MEMORIES.items():
            store.put(("memories", state["user"]), key, value)
        return {"notes": list(MEMORIES)}

    kv = kvcomm.open(namespace, config=config)
    try:
        run_node(kv, remember, user)
        print(f"[learner] stored {len(MEMORIES)} memories")
    finally:
        kv.close()


def recaller(namespace: str | None, config: str | None, user: str, out: Any) -> None:
    from langgraph.store.base import BaseStore

    def recall(state: State, *, store: BaseStore) -> dict[str, Any]:
        notes = []
        for question, filt, _want in QUESTIONS:
            hits = store.search(("memories", state["user"]), query=question, filter=filt,
                                limit=1)
            notes.append(hits[0].key if hits else "")
            if hits:
                print(f"[recaller] {question!r} -> {hits[0].value['text']!r} "
                      f"(score {hits[0].score:.2f})")
        return {"notes": notes}

    kv = kvcomm.open(namespace, config=config)
    try:
        res = run_node(kv, recall, user)
        out.put(res["notes"])
    finally:
        kv.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="a kvcomm config (a dev-cluster host's)")
    ap.add_argument("--namespace", default="lg-memory-example",
                    help="the L2 namespace in embedded mode (default lg-memory-example)")
    ap.add_argument("--keep", action="store_true",
                    help="leave the namespace in /dev/shm at the end (embedded mode)")
    a = ap.parse_args()
    namespace = None if a.config else a.namespace
    user = f"user-{uuid.uuid4().hex[:6]}"
    ctx = mp.get_context("spawn")
    try:
        p = ctx.Process(target=learner, args=(namespace, a.config, user))
        p.start()
        p.join()
        out = ctx.Queue()
        r = ctx.Process(target=recaller, args=(namespace, a.config, user, out))
        r.start()
        got = out.get(timeout=120)
        r.join()
    finally:
        if namespace is not None and not a.keep:
            purge(namespace, kvcomm.Config().cache.l2_dir)  # the segment and the index file
    want = [w for _q, _f, w in QUESTIONS]
    print("recalled", got, "expected", want)
    return 0 if got == want and p.exitcode == 0 and r.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
