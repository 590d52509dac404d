"""One hung Redis master: how long other hosts take to see writes of the other masters' keys.

    python bench/bench_hung_master.py [--seconds S] [--keys N]

A Redis Cluster of 3 masters (no replicas, a node timeout of 120 s: the cluster does not
fail the hung master over meanwhile) and two hosts, A and B: a node daemon each (in this
process, a thread each) and an agent client each. B holds every key. Then, for S seconds
a phase, A writes one key of the *other* masters at a time and waits until B reads the
new value (at most 3 s): the lag from the ``put`` to B seeing it.

* **healthy** — every master answers (the peer: what a write costs to cross hosts here);
* **hung** — the master of A's own keys and of some of the keys is stopped (SIGSTOP) for
  the phase, then resumed; the time until B sees A's writes of *its* keys after SIGCONT.

Printed: writes made, lag p50 / p99 / max, writes that B did not see within 3 s, whether
either host entered partition mode, the ratio of the hung phase's p50 to the healthy
one's. Before ``L3Store.down`` (one hung master is skipped, not waited for), the hung
phase made a write every ~3 s (each waited the cap) and both hosts entered partition
mode; see docs/strong-keys.md, "Partition mode".
"""

from __future__ import annotations

import argparse
import logging
import random
import threading
import time
import uuid
from typing import Any

import kvcomm
from kvcomm.devcluster.redis_cluster import RedisCluster
from kvcomm.node.daemon import NodeDaemon
from kvcomm.tiers import l2
from kvcomm.tiers.l3 import L3Store, feed_key, group_of

CAP = 3.0  # seconds a write may take to reach B before it counts as not seen


class Host:
    """A node daemon in a thread and an agent client, on ``cluster``."""

    def __init__(self, cluster: RedisCluster, host_id: str) -> None:
        self.ns = f"bhm-{uuid.uuid4().hex[:8]}"
        self.config = kvcomm.Config.from_mapping({
            "node": {"host_id": host_id, "namespace": self.ns},
            "cache": {"l2_size": "16MB", "l2_sync_interval": "10ms", "negative_ttl": 0},
            "cluster": {"redis": [f"127.0.0.1:{p}" for p in cluster.ports],
                        "feed_poll": "10ms", "wait_replicas": 0}})
        self.daemon = NodeDaemon(self.config, rng=random.Random(1))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.daemon.run, args=(self.stop,), daemon=True)
        self.thread.start()
        self.kv = kvcomm.open(config=self.config)
        self.partitions = 0

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)
        self.daemon.close()
        self.kv.close()
        l2.purge(self.ns)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def phase(a: Host, b: Host, keys: list[str], seconds: float) -> dict[str, Any]:
    lags: list[float] = []
    unseen = 0
    entered = False
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
        key, value = keys[n % len(keys)], f"w{n}-{uuid.uuid4().hex[:6]}"
        a.kv.put(key, value)
        t0 = time.monotonic()
        while b.kv.get(key) != value and time.monotonic() - t0 < CAP:
            time.sleep(0.002)
        lag = time.monotonic() - t0
        unseen += lag >= CAP
        lags.append(lag)
        entered = entered or a.daemon.reach.partition or b.daemon.reach.partition
    return {"writes": n, "p50": _pct(lags, 0.5), "p99": _pct(lags, 0.99), "max": max(lags),
            "unseen": unseen, "partition": entered}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds a phase (default 10)")
    ap.add_argument("--keys", type=int, default=45, help="keys written (default 45)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    with RedisCluster(masters=3, replicas=0, node_timeout_ms=120_000) as cluster:
        a, b = Host(cluster, "host-a"), Host(cluster, "host-b")
        try:
            store = a.daemon.l3
            assert isinstance(store, L3Store)
            victim = int(store.rc.get_node_from_key("kvn:{host-a}:cursors").port)  # type: ignore[no-untyped-call]
            keys = [f"bhm/{i}" for i in range(args.keys)]
            on = {k: int(store.rc.get_node_from_key(feed_key(group_of(k))).port)  # type: ignore[no-untyped-call]
                  for k in keys}
            others = [k for k in keys if on[k] != victim]
            mine = [k for k in keys if on[k] == victim]
            for k in keys:
                a.kv.put(k, "v0")
            deadline = time.monotonic() + 30
            while any(b.kv.get(k) != "v0" for k in keys) and time.monotonic() < deadline:
                time.sleep(0.01)
            rows = {"healthy": phase(a, b, others, args.seconds)}
            cluster.pause(victim)
            try:
                rows["hung"] = phase(a, b, others, args.seconds)
                for k in mine:
                    a.kv.put(k, "last")
            finally:
                cluster.resume(victim)
            t0 = time.monotonic()
            while any(b.kv.get(k) != "last" for k in mine) and time.monotonic() - t0 < 60:
                time.sleep(0.005)
            after = time.monotonic() - t0
        finally:
            a.close()
            b.close()
    print(f"3 masters, 2 hosts; {len(others)} keys on the other masters, {len(mine)} on the "
          f"stopped one (which also holds host A's own keys); {args.seconds:g} s a phase\n")
    print("| phase | writes | B sees it after p50 / p99 / max | not seen in 3 s | partition mode |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in rows.items():
        print(f"| {name} | {r['writes']} | {r['p50'] * 1e3:.1f} / {r['p99'] * 1e3:.1f} / "
              f"{r['max'] * 1e3:.0f} ms | {r['unseen']} | {'yes' if r['partition'] else 'no'} |")
    ratio = rows["hung"]["p50"] / rows["healthy"]["p50"]
    print(f"\nhung / healthy p50: {ratio:.2f}x; writes {rows['hung']['writes']} / "
          f"{rows['healthy']['writes']} = {rows['hung']['writes'] / rows['healthy']['writes']:.2f}x")
    print(f"the stopped master's keys seen on B {after * 1e3:.0f} ms after SIGCONT")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
