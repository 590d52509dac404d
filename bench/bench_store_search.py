"""KVCommStore's semantic search beside InMemoryStore's and a numpy floor (issue 27).

    .venv/bin/python bench/bench_store_search.py [--n 10000] [--dims 384] [--ann 100000]

Items: ``--n`` memories of ``--dims`` dimensions in one namespace; the embedding is a
deterministic fake (a seeded hash of the text -> a normal vector), computed before the
timing and looked up by the embedding function, so the timings leave the embedding call
aside. Rows (p50 and p99 of each call timed alone, queries drawn from unseen texts):

* search, top 10: KVCommStore (the host's shared-memory matrix), InMemoryStore (same
  items, same embedding), numpy brute force over a private float32 copy (the floor:
  one matrix product and a top-10 partition);
* put: KVCommStore without an index, and with one (the same values).

``--ann N`` also times an approximate index (usearch's HNSW, if installed: ``pip install
usearch``; not a KVCOMM dependency) against the numpy brute force over N vectors, with
its recall@10.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from typing import Any

import numpy as np
from xxhash import xxh3_64_intdigest

sys.path.insert(0, os.path.dirname(__file__))

import kvcomm  # noqa: E402
from kvcomm.tiers import l2  # noqa: E402


def vec(text: str, dims: int) -> np.ndarray:
    return np.random.default_rng(xxh3_64_intdigest(text.encode())).standard_normal(dims)


def pcts(fn: Any, n: int) -> tuple[float, float]:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
    ts.sort()
    return ts[len(ts) // 2] / 1e6, ts[int(len(ts) * 0.99)] / 1e6


def interleaved(fns: list[Any], n: int) -> list[tuple[float, float]]:
    """``pcts`` of each of ``fns``, called in turn ``n`` times each."""
    ts: list[list[int]] = [[] for _ in fns]
    for _ in range(n):
        for f, t in zip(fns, ts, strict=True):
            t0 = time.perf_counter_ns()
            f()
            t.append(time.perf_counter_ns() - t0)
    out = []
    for t in ts:
        t.sort()
        out.append((t[len(t) // 2] / 1e6, t[int(len(t) * 0.99)] / 1e6))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--dims", type=int, default=384)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--ann", type=int, default=0)
    a = ap.parse_args()
    from langgraph.store.memory import InMemoryStore

    from kvcomm.integrations.langgraph import KVCommStore

    texts = [f"memory {i}" for i in range(a.n)]
    queries = [f"query {i}" for i in range(a.queries)]
    table = {t: vec(t, a.dims).tolist() for t in texts + queries}

    def embed(ts: list[str]) -> list[list[float]]:
        return [table[t] for t in ts]

    index = {"dims": a.dims, "embed": embed, "fields": ["text"]}
    name = f"bench-vec-{uuid.uuid4().hex[:8]}"
    cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": 512 << 20}})
    kv = kvcomm.open(name, config=cfg)
    try:
        plain = KVCommStore(kv, root="plain/")
        store = KVCommStore(kv, index=index)
        mem = InMemoryStore(index=index)
        ns = ("user", "1", "memories")
        i = iter(range(10**9))
        for k, t in enumerate(texts):
            store.put(ns, str(k), {"text": t})
            plain.put(ns, str(k), {"text": t})
            mem.put(ns, str(k), {"text": t})
        put_plain, put_index = interleaved(
            [lambda: plain.put(ns, str(next(i) % a.n), {"text": texts[next(i) % a.n]}),
             lambda: store.put(ns, str(next(i) % a.n), {"text": texts[next(i) % a.n]})], 2000)
        qi = iter(range(10**9))
        q = lambda: queries[next(qi) % len(queries)]  # noqa: E731
        m = np.asarray([table[t] for t in texts], dtype=np.float32)
        m /= np.linalg.norm(m, axis=1, keepdims=True)
        qs = [np.asarray(table[x], dtype=np.float32) for x in queries]

        def floor() -> Any:
            s = m @ qs[next(qi) % len(qs)]
            top = np.argpartition(-s, 10)[:10]
            return top[np.argsort(-s[top])]

        # (KVCommStore and the floor interleaved, call by call: the same load on both)
        s_kv, s_np = interleaved([lambda: store.search(("user", "1"), query=q(), limit=10),
                                  floor], a.queries)
        s_mem = pcts(lambda: mem.search(("user", "1"), query=q(), limit=10), a.queries // 4)
        print(f"n={a.n} dims={a.dims}, ms (p50 / p99)")
        print("| operation | p50 ms | p99 ms |")
        print("|---|---|---|")
        for label, (p50, p99) in [
            ("search top 10: KVCommStore (shared-memory matrix)", s_kv),
            ("search top 10: InMemoryStore", s_mem),
            ("search top 10: numpy brute force, private copy (floor)", s_np),
            ("put: KVCommStore without index", put_plain),
            ("put: KVCommStore with index (embedding aside)", put_index),
        ]:
            print(f"| {label} | {p50:.4f} | {p99:.4f} |")
        print(f"put with an index / without: {put_index[0] / put_plain[0]:.2f}x (p50s, "
              "interleaved; the target is 2x or less)")
    finally:
        kv.close()
        l2.purge(name)
    if a.ann:
        ann(a.ann, a.dims)


def ann(n: int, dims: int) -> None:
    try:
        from usearch.index import Index
    except ImportError:
        print("usearch is not installed: pip install usearch")
        return
    rng = np.random.default_rng(1)
    # clustered data (as embeddings are), not uniform noise
    centers = rng.standard_normal((256, dims)).astype(np.float32)
    m = centers[rng.integers(0, 256, n)] + 0.5 * rng.standard_normal((n, dims)).astype(np.float32)
    m /= np.linalg.norm(m, axis=1, keepdims=True)
    qs = m[rng.integers(0, n, 200)] + 0.1 * rng.standard_normal((200, dims)).astype(np.float32)
    t0 = time.perf_counter()
    idx = Index(ndim=dims, metric="cos", dtype="f32")
    idx.add(np.arange(n), m)
    build = time.perf_counter() - t0
    it = iter(range(10**9))

    def brute() -> Any:
        s = m @ qs[next(it) % 200]
        return np.argpartition(-s, 10)[:10]

    def approx() -> Any:
        return idx.search(qs[next(it) % 200], 10).keys

    b = pcts(brute, 200)
    h = pcts(approx, 200)
    recall = np.mean([len(set(np.argpartition(-(m @ x), 10)[:10]) & set(idx.search(x, 10).keys))
                      / 10 for x in qs[:100]])
    print(f"\nn={n} dims={dims}: numpy brute force p50 {b[0]:.2f} ms (p99 {b[1]:.2f}); "
          f"usearch HNSW p50 {h[0]:.3f} ms (p99 {h[1]:.3f}), recall@10 {recall:.3f}, "
          f"build {build:.1f} s")


if __name__ == "__main__":
    main()
