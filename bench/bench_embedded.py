"""Embedded KVCOMM against its peers, measured in one run on this machine.

    python bench/bench_embedded.py [--quick] [--json FILE]

Every row prints our p50 beside each peer's p50 from the same run and the ratio
peer/ours (> 1: we are faster). Peers that are not installed are skipped with a note:
Redis (redis-server over loopback TCP and a unix socket, redis-py + hiredis), a
``multiprocessing`` manager dict, LMDB (one transaction per operation, as a shared cache
would use it) and UltraDict. Values are 1 KiB unless a row says otherwise; small
operations are timed in blocks of 100 and divided, larger ones one by one.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from _timing import clock, p50_blocks, p50_each, run_all

import kvcomm
from kvcomm.devcluster import RedisServer, redis_server_path
from kvcomm.tiers.l2 import purge

CTX = mp.get_context("fork")
VALUE = os.urandom(1024)
NS = "bench-embedded"
ROWS: list[dict[str, Any]] = []


def row(name: str, ours_ns: float, peers: dict[str, float | None], target: str = "") -> None:
    ROWS.append({"name": name, "ours_ns": ours_ns, "peers": peers, "target": target})
    print(f"\n{name}" + (f"   [target: {target}]" if target else ""))
    print(f"  {'kvcomm':<34} {ours_ns / 1000:>10.2f} µs")
    for peer, ns in peers.items():
        if ns is None:
            print(f"  {peer:<34} {'(not available)':>13}")
        else:
            print(f"  {peer:<34} {ns / 1000:>10.2f} µs   ratio peer/kvcomm {ns / ours_ns:>7.1f}x")
    sys.stdout.flush()


# ---------------------------------------------------------------- peers


class Peers:
    """Open connections to every installed peer, each holding key 'k' = VALUE."""

    def __init__(self) -> None:
        self.redis_server: RedisServer | None = None
        self.redis_tcp: Any = None
        self.redis_unix: Any = None
        self.manager: Any = None
        self.mdict: Any = None
        self.lmdb_env: Any = None
        self.lmdb_dir: str | None = None
        self.ultra: Any = None
        if redis_server_path():
            import redis

            self.redis_server = RedisServer().start()
            self.redis_tcp = redis.Redis(host="127.0.0.1", port=self.redis_server.port)
            self.redis_unix = redis.Redis(unix_socket_path=self.redis_server.unix_socket)
        self.manager = CTX.Manager()
        self.mdict = self.manager.dict()
        try:
            import lmdb

            self.lmdb_dir = tempfile.mkdtemp(prefix="kvcomm-lmdb-", dir="/dev/shm")
            self.lmdb_env = lmdb.open(self.lmdb_dir, map_size=1 << 30, sync=False,
                                      metasync=False, max_readers=256)
        except ImportError:
            pass
        try:
            from UltraDict import UltraDict

            self.ultra = UltraDict(name=f"kvb{os.getpid()}", create=True,
                                   buffer_size=64 << 20, shared_lock=True)
        except Exception:  # not installed, or its optional 'atomics' dependency missing
            self.ultra = None

    def set_all(self, key: str, value: bytes) -> None:
        if self.redis_tcp is not None:
            self.redis_tcp.set(key, value)
        self.mdict[key] = value
        if self.lmdb_env is not None:
            with self.lmdb_env.begin(write=True) as txn:
                txn.put(key.encode(), value)
        if self.ultra is not None:
            self.ultra[key] = value

    def getters(self, key: str) -> dict[str, Callable[[], Any] | None]:
        kb = key.encode()
        env = self.lmdb_env

        def lmdb_get() -> Any:
            with env.begin() as txn:
                return txn.get(kb)

        return {
            "redis-py GET, loopback TCP": (lambda: self.redis_tcp.get(key)) if self.redis_tcp else None,
            "redis-py GET, unix socket": (lambda: self.redis_unix.get(key)) if self.redis_unix else None,
            "multiprocessing manager dict": lambda: self.mdict.get(key),
            "LMDB get (txn per op)": lmdb_get if env is not None else None,
            "UltraDict get": (lambda: self.ultra[key]) if self.ultra is not None else None,
        }

    def setters(self, key: str, value: bytes) -> dict[str, Callable[[], Any] | None]:
        kb = key.encode()
        env = self.lmdb_env

        def lmdb_put() -> None:
            with env.begin(write=True) as txn:
                txn.put(kb, value)

        return {
            "redis-py SET, loopback TCP":
                (lambda: self.redis_tcp.set(key, value)) if self.redis_tcp else None,
            "redis-py SET, unix socket":
                (lambda: self.redis_unix.set(key, value)) if self.redis_unix else None,
            "multiprocessing manager dict": lambda: self.mdict.__setitem__(key, value),
            "LMDB put (txn per op)": lmdb_put if env is not None else None,
            "UltraDict set": (lambda: self.ultra.__setitem__(key, value)) if self.ultra is not None else None,
        }

    def close(self) -> None:
        if self.redis_server is not None:
            self.redis_server.stop()
        self.manager.shutdown()
        if self.lmdb_env is not None:
            self.lmdb_env.close()
            shutil.rmtree(self.lmdb_dir or "", ignore_errors=True)
        if self.ultra is not None:
            self.ultra.unlink()


def measure_peers(fns: dict[str, Callable[[], Any] | None], blocks: int,
                  per_block: int = 100) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name, fn in fns.items():
        if fn is None:
            out[name] = None
            continue
        slow = "redis" in name or "manager" in name
        out[name] = p50_blocks(fn, max(5, blocks // 10) if slow else blocks,
                               10 if slow else per_block)
    return out


# ---------------------------------------------------------------- cross-process helpers


def _writer_once(cfg: kvcomm.Config, items: dict[str, Any], done: Any) -> None:
    with kvcomm.open(NS, config=cfg) as kv:
        for k, v in items.items():
            kv.put(k, v)
    done.set()


def _handoff_receiver(peer: Any, n: int, out: Any) -> None:
    """Spin on 'handoff' until each new value appears; record now - the writer's timestamp.

    ``peer`` is a kvcomm config (our run) or a Redis port (the peer's run)."""
    if isinstance(peer, kvcomm.Config):
        kv = kvcomm.open(NS, config=peer)
        get, ack = kv.get, kv.put
    else:
        import redis

        r = redis.Redis(host="127.0.0.1", port=peer)
        get, ack = r.get, r.set
    last = 0
    lat = []
    while len(lat) < n:
        v = get("handoff")
        if v is None:
            continue
        stamp = int.from_bytes(v[:8], "little")
        if stamp != last:
            lat.append(clock() - stamp)
            last = stamp
            ack("ack", stamp)
    out.put(statistics.median(lat))


def _incrementer(cfg: kvcomm.Config, n: int) -> None:
    with kvcomm.open(NS, config=cfg) as kv:
        for _ in range(n):
            kv.update("counter", lambda x: x + 1, default=0)


def _counter_incrementer(cfg: kvcomm.Config, n: int) -> None:
    with kvcomm.open(NS, config=cfg) as kv:
        for _ in range(n):
            kv.incr("counter2")


def _redis_incrementer(port: int, n: int) -> None:
    import redis

    r = redis.Redis(host="127.0.0.1", port=port)
    for _ in range(n):
        r.incr("counter")


# ---------------------------------------------------------------- the benchmarks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    args = ap.parse_args()
    blocks = 50 if args.quick else 400
    purge(NS)
    cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": "256MB"}})
    no_l1 = kvcomm.Config.from_mapping({"cache": {"l2_size": "256MB", "l1_size": 0}})
    print(f"kvcomm {kvcomm.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} cpus, "
          f"pid {os.getpid()}; p50 of {blocks} samples unless noted")
    peers = Peers()
    try:
        peers.set_all("k", VALUE)
        kv = kvcomm.open(NS, config=cfg)
        raw = kvcomm.open(NS, config=no_l1)

        # values written by another process
        done = CTX.Event()
        p = CTX.Process(target=_writer_once, args=(cfg, {"k": VALUE}, done))
        p.start()
        done.wait(30)
        p.join()

        kv.get("k")
        row("L1 hit (validated against L2), 1 KiB", p50_blocks(lambda: kv.get("k"), blocks),
            {"dict lookup (floor)": p50_blocks(lambda: {"k": VALUE}.get("k"), blocks)},
            "p50 <= 0.5 µs")
        untracked = kvcomm.open(NS, config=kvcomm.Config.from_mapping(
            {"cache": {"l2_size": "256MB", "hot_key_sample": 0}}))
        untracked.get("k")
        off_ns = p50_blocks(lambda: untracked.get("k"), blocks)
        on_ns = p50_blocks(lambda: kv.get("k"), blocks)
        row("L1 hit with hot-key tracking (1 read in 16 sampled)", on_ns,
            {"L1 hit, tracking off (hot_key_sample: 0)": off_ns}, "adds <= 10%")
        print(f"  => tracking adds {100 * (on_ns - off_ns) / off_ns:+.1f}% to an L1 hit")
        untracked.close()
        row("L2 get of a value another process wrote, 1 KiB", p50_blocks(lambda: raw.get("k"), blocks),
            measure_peers(peers.getters("k"), blocks), "p50 <= 1.5 µs; >= 30x redis TCP")
        row("L2 put, 1 KiB", p50_blocks(lambda: kv.put("k", VALUE), blocks),
            measure_peers(peers.setters("k", VALUE), blocks), "p50 <= 3 µs")

        keys = [f"b/{i}" for i in range(100)]

        def single100() -> None:
            for k in keys:
                kv.put(k, VALUE)

        def batch100() -> None:
            with kv.batch() as b:
                for k in keys:
                    b.put(k, VALUE)

        single = p50_blocks(single100, max(10, blocks // 4), 1) / 100
        batched = p50_blocks(batch100, max(10, blocks // 4), 1) / 100
        peer_batch: dict[str, float | None] = {}
        if peers.redis_tcp is not None:
            def redis_pipe() -> None:
                pipe = peers.redis_tcp.pipeline(transaction=False)
                for k in keys:
                    pipe.set(k, VALUE)
                pipe.execute()
            peer_batch["redis-py pipeline of 100 SETs, per op"] = p50_blocks(redis_pipe, 20, 1) / 100
        if peers.lmdb_env is not None:
            env = peers.lmdb_env

            def lmdb_batch() -> None:
                with env.begin(write=True) as txn:
                    for k in keys:
                        txn.put(k.encode(), VALUE)
            peer_batch["LMDB 100 puts in one txn, per op"] = p50_blocks(lmdb_batch, 50, 1) / 100
        peer_batch["kvcomm single puts (same run), per op"] = single
        row("batch() of 100 puts, per op", batched, peer_batch,
            "per-put throughput >= 5x single puts")
        print(f"  => batch speed-up over single puts: {single / batched:.2f}x")

        # 10 KiB cross-process handoff: put in A -> B (spinning) gets it
        n_hand = 300 if args.quick else 2000
        out: Any = CTX.Queue()
        rx = CTX.Process(target=_handoff_receiver, args=(cfg, n_hand, out))
        rx.start()
        body = os.urandom(10 * 1024 - 8)
        for _ in range(n_hand):
            stamp = clock()
            kv.put("handoff", stamp.to_bytes(8, "little") + body)
            deadline = time.monotonic() + 5
            while kv.get("ack") != stamp and time.monotonic() < deadline:
                pass
        ours_hand = out.get(timeout=60)
        rx.join()
        hand_peers: dict[str, float | None] = {"redis-py SET → GET (polling), TCP": None}
        if peers.redis_server is not None:
            r = peers.redis_tcp
            rx = CTX.Process(target=_handoff_receiver,
                             args=(peers.redis_server.port, n_hand // 4, out))
            rx.start()
            for _ in range(n_hand // 4):
                stamp = clock()
                r.set("handoff", stamp.to_bytes(8, "little") + body)
                deadline = time.monotonic() + 5
                while r.get("ack") != str(stamp).encode() and time.monotonic() < deadline:
                    pass
            hand_peers["redis-py SET → GET (polling), TCP"] = out.get(timeout=60)
            rx.join()
        row("10 KiB cross-process handoff (put in A → get in B)", ours_hand, hand_peers,
            "p50 <= 10 µs (seeds: 150 µs)")

        # 1 MiB numpy array read by another process: a view, not a copy
        try:
            import numpy as np
        except ImportError:
            np = None  # type: ignore[assignment]
        if np is not None:
            arr = np.random.default_rng(1).random(1 << 17)  # 1 MiB of float64
            done = CTX.Event()
            p = CTX.Process(target=_writer_once, args=(cfg, {"arr": arr, "arr64k": arr[:8192]}, done))
            p.start()
            done.wait(30)
            p.join()
            ours_arr = p50_each(lambda: kv.get("arr"), 2000 if not args.quick else 200)
            small_arr = p50_each(lambda: kv.get("arr64k"), 2000 if not args.quick else 200)
            arr_peers: dict[str, float | None] = {
                "kvcomm 64 KiB array (same run)": small_arr,
            }
            if peers.redis_tcp is not None:
                peers.redis_tcp.set("arr", arr.tobytes())
                arr_peers["redis-py GET 1 MiB + np.frombuffer"] = p50_each(
                    lambda: np.frombuffer(peers.redis_tcp.get("arr")), 50)
            arr_peers["memcpy of 1 MiB (np.copy)"] = p50_each(lambda: arr.copy(), 200)
            row("1 MiB numpy array get in another process (zero-copy view)", ours_arr, arr_peers,
                "p50 <= 5 µs, not scaling with size")

        # update() from 4 processes
        n_upd = 500 if args.quick else 3000
        kv.delete("counter")
        el = run_all(CTX.Process(target=_incrementer, args=(cfg, n_upd)) for _ in range(4))
        total = kv.get("counter")
        ours_upd = el / (4 * n_upd) * 1e9
        upd_peers: dict[str, float | None] = {"redis INCR from 4 processes, per op": None}
        if peers.redis_server is not None:
            peers.redis_tcp.delete("counter")
            took = run_all(CTX.Process(target=_redis_incrementer, args=(peers.redis_server.port, n_upd))
                           for _ in range(4))
            upd_peers["redis INCR from 4 processes, per op"] = took / (4 * n_upd) * 1e9
        row("update() from 4 processes, wall time per increment", ours_upd, upd_peers,
            "throughput, zero lost increments")
        print(f"  => {4 * n_upd / el:,.0f} increments/s; counter = {total} "
              f"(expected {4 * n_upd}, lost {4 * n_upd - total})")
        # incr() from 4 processes: the counter (a CRDT in cluster mode), one locked write
        kv.delete("counter2")
        el = run_all(CTX.Process(target=_counter_incrementer, args=(cfg, n_upd))
                     for _ in range(4))
        total = kv.get("counter2")
        row("incr() from 4 processes, wall time per increment", el / (4 * n_upd) * 1e9,
            {"update() from 4 processes (same run)": ours_upd, **upd_peers},
            "throughput, zero lost increments")
        print(f"  => {4 * n_upd / el:,.0f} increments/s; counter = {total} "
              f"(expected {4 * n_upd}, lost {4 * n_upd - total})")
        kv.close()
        raw.close()
    finally:
        peers.close()
        purge(NS)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(ROWS, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
