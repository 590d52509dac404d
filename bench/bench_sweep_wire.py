"""What the feed sweep and an L3 client's start cost on the wire: bytes, not time.

    .venv/bin/python bench/bench_sweep_wire.py [--groups 1024] [--with-data 300] [--json FILE]

Every daemon reads every group's counter (and its stream's last id) once per sweep
period: a budget paid every second by every host, whatever the traffic
(``cluster.feed_sweep_rate``). On a fresh Redis Cluster (3 masters + 3 replicas, this
machine), the bytes one sweep of ``--groups`` groups sends and receives
(``L3Store.feed_heads``: one read-only script call per master and 256 groups, naming the
groups by their hash tags), beside the peer: the same counters and last ids read with
pipelined ``GET`` and ``XREVRANGE … COUNT 1`` on each group's master, as a client without
the script would (one pipeline per master). Both are counted on the client's socket
(:mod:`kvcomm.metrics.wire`), both with every group empty and with ``--with-data``
groups holding a counter and a stream entry. Then what a new process's L3 client costs
at its start (redis-py's command table, the slot map; ``L3Store``), beside the whole
table redis-py reads by default (``COMMAND``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from typing import Any

from kvcomm.devcluster.redis_cluster import RedisCluster
from kvcomm.tiers.l3 import L3Store

# a new process's L3 client: bytes through its sockets at start and at one GET
_START = """
import json, sys
from kvcomm.tiers.l3 import L3Store
store = L3Store([tuple(s) for s in json.loads(sys.argv[1])])
store.rc.get("bench/none")
print(store.wire.sent + store.wire.received)
"""


def wire(store: L3Store) -> int:
    return int(store.wire.sent + store.wire.received)


def sweep_bytes(store: L3Store, groups: list[int]) -> int:
    store.feed_heads(groups)  # (scripts loaded on every master first)
    before = wire(store)
    store.feed_heads(groups)
    return wire(store) - before


def pipelined_bytes(store: L3Store, groups: list[int]) -> int:
    """The peer: GET and XREVRANGE COUNT 1 of every group, one pipeline per master."""
    before = wire(store)
    for node, gs in store._by_node(groups).values():
        pipe = store.rc.get_redis_connection(node).pipeline(transaction=False)
        for g in gs:
            pipe.get(store.groups.seq_key(g))
            pipe.xrevrange(store.groups.feed_key(g), count=1)
        pipe.execute()
    return wire(store) - before


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=1024)
    ap.add_argument("--with-data", type=int, default=300, metavar="N")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    out: dict[str, Any] = {"groups": args.groups, "with_data": args.with_data}
    with tempfile.TemporaryDirectory(prefix="kvcomm-sweep-wire-") as d:
        cluster = RedisCluster(directory=d, detached=True).start(60)
        try:
            store = L3Store(cluster.seeds, groups=args.groups)
            try:
                groups = list(range(args.groups))
                for label in ("empty", "with_data"):
                    if label == "with_data":
                        step = max(1, args.groups // max(1, args.with_data))
                        for g in groups[::step][:args.with_data]:
                            store.rc.set(store.groups.seq_key(g), g + 1)
                            store.rc.xadd(store.groups.feed_key(g), {"k": "bench"})
                    out[f"sweep_{label}"] = sweep_bytes(store, groups)
                    out[f"pipelined_{label}"] = pipelined_bytes(store, groups)
                    print(f"a sweep of {args.groups} groups ({label.replace('_', ' ')}): "
                          f"{out[f'sweep_{label}']:,} B; pipelined GET + XREVRANGE (the "
                          f"peer): {out[f'pipelined_{label}']:,} B; ratio "
                          f"{out[f'sweep_{label}'] / out[f'pipelined_{label}']:.2f}")
                start = subprocess.run(
                    [sys.executable, "-c", _START, json.dumps([list(s) for s in cluster.seeds])],
                    capture_output=True, text=True, check=True, timeout=60)
                out["client_start"] = int(start.stdout)
                before = wire(store)
                # (the whole table, as redis-py's default client reads it at start)
                store.rc.execute_command("COMMAND")
                out["whole_command_table"] = wire(store) - before
                print(f"a new process's L3 client, started and one GET: "
                      f"{out['client_start']:,} B; redis-py's whole command table (the "
                      f"peer, read at every client's start by default): "
                      f"{out['whole_command_table']:,} B; ratio "
                      f"{out['client_start'] / out['whole_command_table']:.2f}")
            finally:
                store.close()
        finally:
            cluster.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
