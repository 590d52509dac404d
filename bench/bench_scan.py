"""Prefix scans: a page of the keys under one prefix among many, KVCOMM against Redis
``SCAN MATCH`` and etcd range reads, in one run.

    python bench/bench_scan.py [--keys 1000000] [--match 100] [--groups 1024] [--rounds 20]

``--keys`` keys ``k/NNNNNNN`` plus ``--match`` keys under ``zone/42/`` (the prefix
scanned), 8-byte values, loaded into:

* **embedded**: one L2 segment; ``kv.scan("zone/42/", limit=100)`` (the per-process
  ordered index, warm) against the walk of every slot that ``kv.keys`` did before
  (``Core.scan`` + a prefix filter), and the index's first build and its catch-up after
  1,000 writes;
* **cluster**: a 3-master Redis Cluster (no replicas) whose records and key index are
  written directly (a pipeline of SET + ZADD per key, the state the push script leaves,
  minus the feeds: loading through the script would take minutes on 2 cores), scanned by
  an agent in cluster mode that holds none of the keys (``kv.scan`` merges every group's
  index: G ZRANGEBYLEX in one round trip per master, then the values); against
  ``SCAN 0 MATCH kvc:{*}:zone/42/* COUNT 1000`` until the cursor returns to 0 on every
  master (the only way Redis finds keys under a prefix without an index), and against
  an etcd range read of the same prefix in a 3-member etcd holding the same keys (and
  ``kv.scan`` of a strong prefix, which is that range read through KVCOMM).

Each figure is the median of ``--rounds`` runs; the kinds are interleaved per round.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import struct
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from _timing import heading

import kvcomm
from kvcomm.core import codec
from kvcomm.devcluster.etcd_cluster import EtcdCluster
from kvcomm.devcluster.redis_cluster import RedisCluster
from kvcomm.tiers import l2
from kvcomm.tiers.etcd import EtcdClient, put_op
from kvcomm.tiers.l3 import L3Record, L3Store

PREFIX = "zone/42/"
print = functools.partial(print, flush=True)  # noqa: A001  (progress shows in a log)


def _keys(n: int, match: int) -> list[str]:
    return [f"k/{i:07d}" for i in range(n)] + [f"{PREFIX}{i:04d}" for i in range(match)]


def _median_ms(fn: Callable[[], Any], rounds: int) -> float:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1000


def embedded(keys: list[str], match: int, rounds: int) -> dict[str, float]:
    ns = f"bench-scan-{uuid.uuid4().hex[:8]}"
    # MB: L2 has a slot per 2 KiB of segment, and 1M keys need 2M slots (probe windows)
    size = max(64, len(keys) * 2600 >> 20)
    cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": f"{size}MB"}})
    kv = kvcomm.open(ns, config=cfg)
    try:
        t0 = time.perf_counter()
        for at in range(0, len(keys), 1000):
            with kv.batch() as b:
                for k in keys[at:at + 1000]:
                    b.put(k, b"12345678")
        load = time.perf_counter() - t0
        info = kv._seg.info()
        # (a few may be evicted when a probe window is full: never the matching ones,
        # written last)
        assert info["entries"] >= len(keys) - 1000, info
        print(f"  loaded {len(keys):,} keys into a {size} MB segment in {load:.1f} s "
              f"({info['entries']:,} held, {info['evictions']} evicted)")
        t0 = time.perf_counter()
        first = [i.key for i in kv.scan(PREFIX, limit=100)]
        build = (time.perf_counter() - t0) * 1000
        assert len(first) == min(100, match)

        def walk() -> list[str]:
            return sorted(k for k in kv._seg.keys() if k.startswith(PREFIX))[:100]

        def scan() -> list[str]:
            return [i.key for i in kv.scan(PREFIX, limit=100)]

        assert walk() == scan() == first
        idx = kv._attached.index._keys
        mem = sum(sys.getsizeof(k) + 8 for k in idx) + sum(
            sys.getsizeof(b) for b in idx._blocks)  # the strs, the pointers, the blocks
        w = _median_ms(walk, max(3, rounds // 4))
        s = _median_ms(scan, rounds)

        def after_writes() -> None:
            for i in range(1000):
                kv.put(f"k/{i:07d}", b"87654321")
            t0 = time.perf_counter()
            scan()
            catch.append(time.perf_counter() - t0)

        catch: list[float] = []
        for _ in range(max(3, rounds // 4)):
            after_writes()
        return {"scan": s, "walk": w, "build": build, "mem": mem / 2**20,
                "catchup": statistics.median(catch) * 1000}
    finally:
        kv.close()
        l2.purge(ns)


def _load_l3(store: L3Store, keys: list[str]) -> float:
    rec = L3Record(hlc=1 << 40, tombstone=False, tag=codec.BYTES, meta=b"", value=b"12345678",
                   vector=(("bench", 1),), dot=("bench", 1))
    t0 = time.perf_counter()
    g = store.groups
    by_node: dict[str, tuple[Any, list[str]]] = {}
    for k in keys:
        node = store.rc.nodes_manager.get_node_from_slot(g.slot(g.of(k)))
        by_node.setdefault(node.name, (node, []))[1].append(k)
    for node, ks in by_node.values():
        conn = store.rc.get_redis_connection(node)
        for at in range(0, len(ks), 5000):
            pipe = conn.pipeline(transaction=False)
            for k in ks[at:at + 5000]:
                r = rec._replace(dot=("bench", 1 + (hash(k) & 0xFFFF)))
                pipe.set(g.record_key(k), r.encode())
                pipe.zadd(g.index_key(g.of(k)), {k: 0})
            pipe.execute()
    return time.perf_counter() - t0


def _load_etcd(ec: EtcdCluster, keys: list[str]) -> float:
    raw = EtcdClient(ec.endpoints, timeout=30)
    strong_value = struct.pack(">BI", codec.BYTES, 0) + b"12345678"  # (_client/strong.py)
    t0 = time.perf_counter()
    try:
        for at in range(0, len(keys), 128):  # (etcd's --max-txn-ops default)
            raw.txn([], [put_op(b"kvc/k/" + k.encode(), strong_value)
                         for k in keys[at:at + 128]])
    finally:
        raw.close()
    return time.perf_counter() - t0


def cluster(keys: list[str], match: int, groups: int, rounds: int,
            etcd_keys: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with RedisCluster(masters=3, replicas=0) as rc, EtcdCluster() as ec:
        store = L3Store(rc.seeds, groups=groups, timeout=30)
        store.check_groups(record=True)
        took = _load_l3(store, keys)
        print(f"  loaded {len(keys):,} records and index entries into L3 ({groups} groups) "
              f"in {took:.1f} s")
        ekeys = keys[len(keys) - match - etcd_keys:]  # the last etcd_keys + the matching ones
        took = _load_etcd(ec, [f"s{k}" for k in ekeys])
        print(f"  loaded {len(ekeys):,} keys into etcd in {took:.1f} s")
        ns = f"bench-scan-{uuid.uuid4().hex[:8]}"
        cfg = kvcomm.Config.from_mapping({
            "node": {"host_id": "bench", "namespace": ns}, "cache": {
                "l2_size": "64MB", "strong_prefixes": ["s"]},
            "cluster": {"redis": [f"{h}:{p}" for h, p in rc.seeds], "etcd": ec.addresses,
                        "groups": groups, "timeout": 30}})
        kv = kvcomm.open(ns, config=cfg, wait_daemon=False)  # (reads L3 and etcd only: no daemon)
        etcd = EtcdClient(ec.endpoints, timeout=30)
        try:
            def scan() -> list[str]:
                return [i.key for i in kv.scan(PREFIX, limit=100)]

            def strong_scan() -> list[str]:
                return [i.key for i in kv.scan("s" + PREFIX, limit=100)]

            def etcd_range() -> list[bytes]:
                return [x.key for x in etcd.range(b"kvc/k/s" + PREFIX.encode(), limit=100).kvs]

            def scan_match() -> list[bytes]:
                found: list[bytes] = []
                for node in store.rc.get_primaries():
                    conn = store.rc.get_redis_connection(node)
                    cursor = 0
                    while True:
                        cursor, got = conn.scan(cursor, match=f"kvc:{{*}}:{PREFIX}*", count=1000)
                        found += got
                        if cursor == 0:
                            break
                return sorted(found)[:100]

            want = [f"{PREFIX}{i:04d}" for i in range(min(100, match))]
            assert scan() == want, scan()[:5]
            assert strong_scan() == ["s" + k for k in want]
            assert len(etcd_range()) == len(want)
            assert len(scan_match()) == len(want)
            samples: dict[str, list[float]] = {k: [] for k in ("scan", "strong", "etcd", "match")}
            fns = {"scan": scan, "strong": strong_scan, "etcd": etcd_range}
            for r in range(rounds):
                for name, fn in fns.items():
                    t0 = time.perf_counter()
                    fn()
                    samples[name].append(time.perf_counter() - t0)
                if r < max(3, rounds // 4):  # (seconds each with 1M keys)
                    t0 = time.perf_counter()
                    scan_match()
                    samples["match"].append(time.perf_counter() - t0)
            out = {k: statistics.median(v) * 1000 for k, v in samples.items()}
            out["groups"] = groups
        finally:
            etcd.close()
            kv.close()
            l2.purge(ns)
            store.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=1_000_000, help="keys outside the prefix")
    ap.add_argument("--match", type=int, default=100, help="keys under the prefix")
    ap.add_argument("--groups", type=int, default=1024, help="cluster.groups")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--etcd-keys", type=int, default=None,
                    help="keys loaded into etcd besides the matching ones (default: --keys)")
    ap.add_argument("--skip-cluster", action="store_true")
    args = ap.parse_args()
    keys = _keys(args.keys, args.match)
    heading(f"embedded: scan of {args.match} keys under {PREFIX!r} among {len(keys):,}")
    e = embedded(keys, args.match, args.rounds)
    print(f"  kv.scan(limit=100), index warm       {e['scan']:9.3f} ms")
    print(f"  walk of every slot (old kv.keys)     {e['walk']:9.3f} ms   "
          f"({e['walk'] / e['scan']:.0f}x the scan)")
    print(f"  first scan (builds the index)        {e['build']:9.3f} ms   "
          f"(index: {e['mem']:.0f} MiB in the scanning process)")
    print(f"  scan after 1,000 writes (catch-up)   {e['catchup']:9.3f} ms")
    if args.skip_cluster:
        return
    etcd_keys = args.keys if args.etcd_keys is None else args.etcd_keys
    heading(f"cluster: scan of {args.match} keys under {PREFIX!r} among {len(keys):,} "
            f"(L3: 3 masters, {args.groups} groups; etcd: {etcd_keys + args.match:,} keys)")
    c = cluster(keys, args.match, args.groups, args.rounds, etcd_keys)
    print(f"  kv.scan(limit=100), eventual keys    {c['scan']:9.3f} ms")
    print(f"  Redis SCAN MATCH (every master)      {c['match']:9.3f} ms   "
          f"({c['match'] / c['scan']:.1f}x kv.scan)")
    print(f"  etcd range read (limit 100)          {c['etcd']:9.3f} ms   "
          f"(kv.scan is {c['scan'] / c['etcd']:.1f}x it)")
    print(f"  kv.scan(limit=100), strong keys      {c['strong']:9.3f} ms   "
          f"({c['strong'] / c['etcd']:.2f}x the etcd range read)")
    print(f"  embedded kv.scan vs Redis SCAN MATCH: {c['match'] / e['scan']:.0f}x faster")


if __name__ == "__main__":
    main()
