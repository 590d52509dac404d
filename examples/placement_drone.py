"""A drone for the placement example: it writes its state and reads its two neighbours'
on a ring (drone-i reads drone-(i-1) and drone-(i+1)), at --rate Hz, for --seconds.

Run by the launcher, one process per agent of a plan (docs/placement.md)::

    kvcomm placement launch --plan plan.json --dir /tmp/kvc -- \\
        python examples/placement_drone.py --drones 12 --seconds 60

Or re-placed as it runs (every 10 s: observe, plan from where the drones run, move at
most 2 of them)::

    kvcomm placement launch --plan plan.json --dir /tmp/kvc --replan-every 10 \\
        --max-moves 2 -- python examples/placement_drone.py --drones 12 --seconds 60

A moved drone starts on its new host and reads its own state back first (it is in
KVCOMM), so its tick goes on from where it was.

It opens ``kvcomm.open(config=$KVCOMM_CONFIG, agent=$KVCOMM_AGENT)``: the host's config
the launcher chose, and its own name.
"""

from __future__ import annotations

import argparse
import os
import time

import kvcomm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drones", type=int, default=12, help="drones on the ring (default 12)")
    ap.add_argument("--rate", type=float, default=50.0, help="ticks per second (default 50)")
    ap.add_argument("--seconds", type=float, default=60.0, help="how long to fly (default 60)")
    args = ap.parse_args()
    agent = os.environ["KVCOMM_AGENT"]  # "drone-7": set by the launcher
    i = int(agent.rpartition("-")[2])
    left, right = (i - 1) % args.drones, (i + 1) % args.drones
    with kvcomm.open(config=os.environ["KVCOMM_CONFIG"], agent=agent) as kv:
        end = time.monotonic() + args.seconds
        mine = kv.get(f"drone/{i}/state")  # (moved: its state is where it left it)
        tick = mine["tick"] + 1 if isinstance(mine, dict) else 0
        while time.monotonic() < end:
            kv.put(f"drone/{i}/state", {"tick": tick, "pos": [i, tick * 0.1, 30.0]})
            for n in (left, right):
                kv.get(f"drone/{n}/state")
            tick += 1
            time.sleep(1 / args.rate)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
