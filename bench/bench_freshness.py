"""How fresh another host's view is, with the shipped defaults, in one run.

    python bench/bench_freshness.py [--samples 100] [--partitions 3] [--keys 400 8000]
                                    [--no-heal] [--seed N]

One dev cluster of 3 hosts behind fault proxies (``kvcomm dev-cluster up --proxies``, its
settings as shipped: ``cache.negative_ttl`` 5 s, ``cluster.timeout`` 2 s,
``cluster.lease_ttl`` 6 s); every agent opens its host's config as it is (never
``negative_ttl`` 0).

**Freshness.** Samples alternate, in the same run: a *new key* (host 2 reads it, absent,
then host 1 creates it) and an *update* (host 1 writes a key host 2 already holds); host 2
polls every millisecond until it reads the write. Printed: p50 / p99 of each, and the
ratio of the p99s. Targets: new-key p99 <= 250 ms and <= 2 x the update p99.

**Heal.** Per partition: host 2 is cut off; host 1 and host 2 each write ``--keys`` keys
(half of them created before the cut, half new); once host 2 is in partition mode every
host reads its sample once (500 keys, fixed per host: 250 it held before the cut, 250 it
never held), then the heal; each host's probe process re-reads its sample (a pass every
50 ms at most) until every key reads its last write. Printed per partition: heal ->
every host reads every sampled key's last write; over the partitions: p50 and max.
Targets: p50 <= 1 s, max <= 3 s.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import sys
import tempfile
import time
from typing import Any

from _timing import heading, percentile

import kvcomm
from kvcomm.devcluster import control
from kvcomm.node.presence import read_status, status_path

CTX = mp.get_context("spawn")
SAMPLE = 500  # keys per host and partition, half of them never held there
DEBUG = False  # (per probe pass: keys read, left, the slowest read)


def freshness(cfgs: list[str], samples: int, run: str) -> dict[str, list[float]]:
    """Seconds from host 1's put to host 2 reading it: new keys and updates, alternating."""
    a, b = kvcomm.open(config=cfgs[0]), kvcomm.open(config=cfgs[1])
    out: dict[str, list[float]] = {"new": [], "update": []}
    try:
        held = f"fresh/{run}/held"
        a.put(held, -1)
        deadline = time.monotonic() + 30
        while b.get(held) != -1:  # (host 2 holds it from here on: updates reach its L2)
            assert time.monotonic() < deadline, "host 2 never read the held key"
            time.sleep(0.001)
        for i in range(samples):
            for kind in ("new", "update"):
                key = f"fresh/{run}/new/{i}" if kind == "new" else held
                if kind == "new":
                    assert b.get(key) is None  # read just before its creation
                t0 = time.monotonic()
                a.put(key, i)
                while b.get(key) != i:
                    if time.monotonic() - t0 > 30:
                        raise SystemExit(f"{kind} {key} not seen on host 2 within 30 s")
                    time.sleep(0.001)
                out[kind].append(time.monotonic() - t0)
        out["stats"] = [b.counters["negative_hits"], b.counters["negative_rechecks"],
                        b.counters["l3_reads"]]
    finally:
        a.close()
        b.close()
    return out


def _probe(cfg: str, keys: list[str], want: dict[str, Any], warm: list[str], ready: Any,
           start: Any, t_heal: Any, out: Any) -> None:
    """A host's probe (a process of its own): says ``ready`` once open; once ``start`` is
    set, re-reads ``keys`` until each reads ``want``; puts the seconds after ``t_heal``
    (a shared wall time) at which the last one did, or None after 60 s."""
    kv = kvcomm.open(config=cfg)
    try:
        for k in warm:  # (an agent that has been running has its L3 connections open)
            try:
                kv.get(k)
            except kvcomm.Unavailable:
                pass  # (the cut-off host: it opens L3 in the background)
        ready.put(1)
        start.wait()
        pending = list(keys)
        deadline = time.time() + 60
        passes = 0
        while pending and time.time() < deadline:
            passes += 1
            left = []
            t_pass = time.time()
            slow = (0.0, "")
            for k in pending:
                t_get = time.time()
                try:
                    ok = kv.get(k) == want[k]
                except kvcomm.Unavailable:
                    ok = False
                if time.time() - t_get > slow[0]:
                    slow = (time.time() - t_get, k)
                if not ok:
                    left.append(k)
            if DEBUG:
                print(f"    {cfg[-11:]} pass {passes} at {t_pass - t_heal.value:.2f}s: "
                      f"{len(pending)} read in {time.time() - t_pass:.2f}s, {len(left)} left, "
                      f"slowest {slow[0]:.3f}s {slow[1]}", flush=True)
            pending = left
            if pending:  # (a pass every 50 ms at most: the probes must not starve the daemons)
                time.sleep(max(0.0, 0.05 - (time.time() - t_pass)))
        out.put((None if pending else time.time() - t_heal.value, passes))
    finally:
        kv.close()


def _status(ns: str) -> dict[str, Any]:
    return read_status(status_path(ns, "/dev/shm")) or {}


def heal_round(d: str, state: dict[str, Any], n: int, rnd: str, rng: random.Random) -> float:
    """One partition of host 2 with ``n`` keys written on each side; the seconds from the
    heal until every host reads every sampled key's last write."""
    cfgs = [h["config"] for h in state["hosts"]]
    kvs = [kvcomm.open(config=c) for c in cfgs]
    try:
        sides = {0: [f"heal/{rnd}/a/{i}" for i in range(n)],
                 1: [f"heal/{rnd}/b/{i}" for i in range(n)]}
        before = [k for s in sides.values() for k in s[: n // 2]]  # created before the cut
        new = [k for s in sides.values() for k in s[n // 2:]]
        for side, keys in sides.items():
            for k in keys[: n // 2]:
                kvs[side].put(k, "before")
        samples: list[list[str]] = []
        warm: list[list[str]] = []
        for h in range(3):
            held = rng.sample(before, min(SAMPLE // 2, len(before)))
            never = rng.sample(new, min(SAMPLE // 2, len(new)))
            samples.append(held + never)
            warm.append([k for k in before if k not in set(held)][:2])
            deadline = time.monotonic() + 60
            for k in held:
                while kvs[h].get(k) != "before":
                    assert time.monotonic() < deadline, f"host {h + 1} never read {k}"
                    time.sleep(0.002)
        ns2 = state["hosts"][1]["namespace"]
        control.partition(d, "host-2")
        want = {}
        for side, keys in sides.items():
            for k in keys:
                kvs[side].put(k, f"{side}:{rnd}")
                want[k] = f"{side}:{rnd}"
        t_cut = time.monotonic()
        while not _status(ns2).get("partition"):
            assert time.monotonic() - t_cut < 60, "host 2 never entered partition mode"
            time.sleep(0.05)
        for h in range(3):  # every host reads its sample once, during the partition
            for k in samples[h]:
                try:
                    kvs[h].get(k)
                except kvcomm.Unavailable:
                    pass
        ready, start, t_heal, out = CTX.Queue(), CTX.Event(), CTX.Value("d", 0.0), CTX.Queue()
        procs = [CTX.Process(target=_probe,
                             args=(cfgs[h], samples[h], want, warm[h], ready, start, t_heal,
                                   out))
                 for h in range(3)]
        for p in procs:
            p.start()
        for _ in procs:
            ready.get(timeout=120)
        control.heal(d)
        t_heal.value = time.time()
        start.set()
        left = None
        while out.qsize() < len(procs) and time.time() - t_heal.value < 120:
            if left is None and not _status(ns2).get("partition"):
                left = time.time() - t_heal.value
            time.sleep(0.01)
        got = [out.get(timeout=120) for _ in procs]
        times = [t for t, _ in got]
        print("  (probe passes: " + ", ".join(str(n) for _, n in got) + ")")
        for p in procs:
            p.join()
        if any(t is None for t in times):
            raise SystemExit(f"a host did not read every sampled key within 60 s: {times}")
        while _status(ns2).get("partition"):  # (the next round starts from a healed host)
            time.sleep(0.05)
        print(f"  (host 2 left partition mode after {left if left is not None else -1:.2f}s;"
              f" hosts done after " + ", ".join(f"{t:.2f}s" for t in times) + ")")
        return max(times)
    finally:
        for kv in kvs:
            kv.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=100, help="new keys and updates, each")
    ap.add_argument("--partitions", type=int, default=3, help="partitions per key count")
    ap.add_argument("--keys", type=int, nargs="*", default=[400, 8000],
                    help="keys written on each side of a partition")
    ap.add_argument("--no-heal", action="store_true", help="freshness only")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)
    d = tempfile.mkdtemp(prefix="kvcomm-fresh-")
    state = control.up(3, d, proxies=True)
    try:
        cfgs = [h["config"] for h in state["hosts"]]
        c = kvcomm.Config.load(cfgs[1])
        print(f"shipped defaults: cache.negative_ttl {c.cache.negative_ttl:g}s, "
              f"cluster.timeout {c.cluster.timeout:g}s, cluster.lease_ttl {c.cluster.lease_ttl:g}s")
        heading("Freshness on host 2 of a write on host 1 (polled every 1 ms)")
        f = freshness(cfgs, args.samples, str(seed))
        new, upd = f["new"], f["update"]
        p = {k: (percentile(v, 0.5) * 1e3, percentile(v, 0.99) * 1e3)
             for k, v in (("new", new), ("update", upd))}
        print(f"new key (read just before its creation): p50 {p['new'][0]:7.1f} ms   "
              f"p99 {p['new'][1]:7.1f} ms   ({len(new)} keys)")
        print(f"update of a key host 2 holds:            p50 {p['update'][0]:7.1f} ms   "
              f"p99 {p['update'][1]:7.1f} ms   ({len(upd)} writes)")
        ratio = p["new"][1] / p["update"][1]
        print(f"new-key p99 / update p99: {ratio:.2f}  (targets: new-key p99 <= 250 ms: "
              f"{'met' if p['new'][1] <= 250 else 'MISSED'}; <= 2x: "
              f"{'met' if ratio <= 2 else 'MISSED'})")
        print(f"host 2's reader: negative hits {f['stats'][0]}, notes re-asked "
              f"{f['stats'][1]}, L3 reads {f['stats'][2]}")
        if not args.no_heal:
            for n in args.keys:
                heading(f"Heal: {n} keys written on each side, {SAMPLE} sampled keys per host")
                times = []
                for r in range(args.partitions):
                    t = heal_round(d, state, n, f"{seed}-{n}-{r}", rng)
                    times.append(t)
                    print(f"partition {r + 1}: heal -> every host reads every sampled key's "
                          f"last write in {t:.2f}s")
                p50, top = percentile(times, 0.5), max(times)
                print(f"over {len(times)} partitions: p50 {p50:.2f}s, max {top:.2f}s  "
                      f"(targets: p50 <= 1 s: {'met' if p50 <= 1 else 'MISSED'}; max <= 3 s: "
                      f"{'met' if top <= 3 else 'MISSED'})")
    finally:
        control.heal(d)
        control.down(d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
