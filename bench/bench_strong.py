"""Strong keys against etcd itself, in one run; and whether strong traffic slows eventual reads.

    python bench/bench_strong.py [--n 500] [--quick]

A 3-member etcd on loopback (:class:`kvcomm.devcluster.EtcdCluster`, the dev cluster's
settings, data on tmpfs). Interleaved, in rounds, so that a noisy neighbour hits both
sides alike:

* **etcd directly from Python**: :class:`kvcomm.tiers.etcd.EtcdClient` put, quorum get,
  and a compare-and-set transaction (``mod_revision`` compare, put);
* **KVCOMM strong keys**: ``kv.put``, ``kv.get``, ``kv.get_item`` and ``kv.put(...,
  expect=version)`` of a key under ``cache.strong_prefixes`` (an agent in cluster mode;
  no Redis and no daemon are needed for strong keys);

then the p50 of an eventual read served by L2 (a key the host holds) alone, and again
while two other processes of the same host do strong puts and gets as fast as they can.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
import uuid
from typing import Any

from _timing import heading, p50_blocks, percentile

import kvcomm
from kvcomm.devcluster.etcd_cluster import EtcdCluster
from kvcomm.tiers import l2
from kvcomm.tiers.etcd import Compare, EtcdClient, put_op

CTX = mp.get_context("fork")


def _config(ec: EtcdCluster, ns: str) -> kvcomm.Config:
    return kvcomm.Config.from_mapping({
        "node": {"host_id": "bench", "namespace": ns},
        "cache": {"l2_size": "32MB", "strong_prefixes": ["task/"]},
        "cluster": {"redis": ["127.0.0.1:1"], "etcd": ec.addresses}})


def _hammer(cfg: kvcomm.Config, ns: str, stop: Any, done: Any) -> None:
    kv = kvcomm.open(ns, config=cfg, wait_daemon=False)  # (strong keys only: no daemon)
    n = 0
    while not stop.is_set():
        kv.put(f"task/hammer/{os.getpid()}", n)
        kv.get(f"task/hammer/{os.getpid()}")
        n += 2
    done.put(n)
    kv.close()


def _spin(stop: Any, done: Any) -> None:
    n = 0
    while not stop.is_set():
        n += 1
    done.put(0)


def _beside(kind: Any, args: tuple[Any, ...], fn: Any) -> tuple[float, int]:
    """p50 ns of ``fn`` while two processes run ``kind``; and what they did."""
    stop, done = CTX.Event(), CTX.Queue()
    procs = [CTX.Process(target=kind, args=(*args, stop, done)) for _ in range(2)]
    for p in procs:
        p.start()
    time.sleep(1.0)
    p50 = p50_blocks(fn, 500, 200)
    stop.set()
    n = sum(done.get(timeout=30) for _ in procs)
    for p in procs:
        p.join()
    return p50, n


def _ms(values: list[float]) -> str:
    return f"p50 {percentile(values, 0.5) / 1e6:6.2f} ms   p99 {percentile(values, 0.99) / 1e6:6.2f} ms"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=500, help="operations of each kind")
    ap.add_argument("--quick", action="store_true", help="100 of each (a smoke run)")
    args = ap.parse_args()
    n = 100 if args.quick else args.n
    ns = f"bench-strong-{uuid.uuid4().hex[:8]}"
    with EtcdCluster() as ec:
        cfg = _config(ec, ns)
        kv = kvcomm.open(ns, config=cfg, wait_daemon=False)  # (strong keys only: no daemon)
        raw = EtcdClient(ec.endpoints)
        try:
            samples: dict[str, list[float]] = {k: [] for k in (
                "etcd put", "etcd get (quorum)", "etcd txn (CAS)",
                "kv.put (strong)", "kv.get (strong)", "kv.get_item (strong)",
                "kv.put expect= (strong)")}
            rk, sk = b"bench/raw", "task/bench"
            raw.put(rk, b"0")
            kv.put(sk, 0)
            for _ in range(20):  # warm-up: connections, the prefix check
                raw.get(rk)
                kv.get(sk)

            def timed(name: str, fn: Any) -> Any:
                t0 = time.perf_counter_ns()
                out = fn()
                samples[name].append(time.perf_counter_ns() - t0)
                return out

            for i in range(n):  # interleaved: each round does every kind once
                value = f"value-{i}".encode()
                rev = timed("etcd put", lambda v=value: raw.put(rk, v))
                timed("etcd get (quorum)", lambda: raw.get(rk))
                timed("etcd txn (CAS)", lambda v=value, r=rev: raw.txn([Compare.mod(rk, "=", r)],
                                                                      [put_op(rk, v)]))
                timed("kv.put (strong)", lambda i=i: kv.put(sk, i))
                timed("kv.get (strong)", lambda: kv.get(sk))
                item = timed("kv.get_item (strong)", lambda: kv.get_item(sk))
                timed("kv.put expect= (strong)",
                      lambda i=i, it=item: kv.put(sk, -i, expect=it.version))
            heading(f"strong keys vs etcd directly from Python ({n} of each, interleaved; "
                    "3-member etcd on loopback)")
            for name, values in samples.items():
                print(f"  {name:<26} {_ms(values)}")

            ek = "plain/bench"
            kv.put(ek, b"x" * 64)  # an eventual key, held in this host's L2
            heading("eventual reads (L2 hit) alone, beside strong traffic, beside CPU-bound "
                    "processes (the control: same CPU load, no strong ops)")
            for name, read in (("kv.get", lambda: kv.get(ek)),
                               ("kv.get_item", lambda: kv.get_item(ek))):
                alone = p50_blocks(read, 500, 200)
                busy, strong_ops = _beside(_hammer, (cfg, ns), read)
                spin, _ = _beside(_spin, (), read)
                print(f"  {name:<12} alone p50 {alone:7.0f} ns | 2 processes doing strong "
                      f"ops p50 {busy:7.0f} ns ({strong_ops} ops) | 2 spinning processes "
                      f"p50 {spin:7.0f} ns")
        finally:
            raw.close()
            kv.close()
            l2.purge(ns)


if __name__ == "__main__":
    main()
