"""What the expiry sweep costs every process: the writer lock it holds, per second.

    python bench/bench_sweep.py [--seconds 10] [--procs 4] [--src OTHER_SRC]

Opens one namespace (``--l2`` bytes, ``cache.expiry_sweep`` 100 ms, the default) in
``--procs`` fresh processes of this checkout (or of ``OTHER_SRC``, a ``src`` directory with
its C helper built: a checkout before the expiry hint), in three states, and
prints, summed over the processes, the time the sweep held the writer lock per second of
wall time (each call of ``sweep_expired`` timed, the lock's taking and release included)
and the slices swept:

* ``permanent``: 10,000 keys, none with a deadline;
* ``deadlines ahead``: the same, and 1,000 keys with a deadline an hour away;
* ``presence``: the same, and 100 keys re-put every 0.5 s with ``ttl=2`` (so that some
  deadline has always just passed: the hint is always due).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time

CHILD = textwrap.dedent("""
    import json, sys, time, threading
    import kvcomm
    from kvcomm._client.attach import _Shared
    ns, l2, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": l2}})
    with kvcomm.open(ns, config=cfg) as kv:
        sw = _Shared.attached[ns].sweeper
        seg = sw.seg
        held = [0, 0]
        real = seg.sweep_expired
        def timed(*a):
            t0 = time.perf_counter_ns()
            try:
                return real(*a)
            finally:
                held[0] += time.perf_counter_ns() - t0
                held[1] += 1
        seg.sweep_expired = timed
        t0 = time.time()
        time.sleep(seconds)
        wall = time.time() - t0
        print(json.dumps({"held_ms_per_s": held[0] / 1e6 / wall, "calls_per_s": held[1] / wall}))
""")


def run(src: str, ns: str, l2: str, seconds: float, procs: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": src}
    ps = [subprocess.Popen([sys.executable, "-c", CHILD, ns, l2, str(seconds)], env=env,
                           stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    outs = [json.loads(p.communicate(timeout=seconds + 120)[0]) for p in ps]
    return {k: sum(o[k] for o in outs) for k in outs[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--l2", default="256MB")
    ap.add_argument("--src", default=os.path.join(os.path.dirname(__file__), "..", "src"))
    a = ap.parse_args()
    sys.path.insert(0, a.src)
    import kvcomm
    from kvcomm.tiers.l2 import purge

    ns = f"bench-sweep-{os.getpid()}"
    cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": a.l2, "expiry_sweep": "60s"}})
    try:
        with kvcomm.open(ns, config=cfg) as kv:
            with kv.batch() as b:
                for i in range(10_000):
                    b.put(f"p/{i}", b"v" * 64)
            print(f"src {a.src}: {kv._seg.layout.n_slots} slots, {a.procs} processes, "
                  f"{a.seconds:.0f} s each state")
            r = run(a.src, ns, a.l2, a.seconds, a.procs)
            print(f"  permanent        lock held {r['held_ms_per_s']:.3f} ms/s, "
                  f"{r['calls_per_s']:.1f} slices/s")
            with kv.batch() as b:
                for i in range(1000):
                    b.put(f"t/{i}", b"v" * 64, ttl=3600)
            r = run(a.src, ns, a.l2, a.seconds, a.procs)
            print(f"  deadlines ahead  lock held {r['held_ms_per_s']:.3f} ms/s, "
                  f"{r['calls_per_s']:.1f} slices/s")
            stop = time.time() + a.seconds + 30
            refresher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
                import time, kvcomm
                cfg = kvcomm.Config.from_mapping({{"cache": {{"l2_size": {a.l2!r},
                                                              "expiry_sweep": "60s"}}}})
                with kvcomm.open({ns!r}, config=cfg) as kv:
                    while time.time() < {stop}:
                        for i in range(100):
                            kv.put(f"alive/{{i}}", b"here", ttl=2)
                        time.sleep(0.5)
            """)], env={**os.environ, "PYTHONPATH": a.src})
            time.sleep(3)  # the first deadlines pass
            r = run(a.src, ns, a.l2, a.seconds, a.procs)
            refresher.kill()
            refresher.wait()
            print(f"  presence         lock held {r['held_ms_per_s']:.3f} ms/s, "
                  f"{r['calls_per_s']:.1f} slices/s")
    finally:
        purge(ns)


if __name__ == "__main__":
    main()
