"""An agent for the placement tests, started by the launcher on a dev cluster's host:

    python -m tests.support.placement_agent --agent NAME --config FILE --dir DIR --roles ROLES

ROLES says, per agent, what it writes and reads: ``w1=put:s/w1:1024;r1=get:s/w1:4000,get:s/w2:2000``
(``put:KEY:SIZE`` writes a value of SIZE bytes once; ``get:KEY:N`` waits until KEY is
readable, then reads it N times). Then it makes its agent report (a flush a second after
the last report), writes ``DIR/NAME.done`` and stays (its report stays in the host's
table) until ``DIR/stop`` exists or it is stopped.
"""

from __future__ import annotations

import argparse
import os
import time

import kvcomm


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--agent", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--roles", required=True)
    args = ap.parse_args()
    roles = dict(part.split("=", 1) for part in args.roles.split(";"))
    steps = [s.split(":") for s in roles.get(args.agent, "").split(",") if s]
    with kvcomm.open(config=args.config, agent=args.agent) as kv:
        for op, key, n in steps:
            if op == "put":
                kv.put(key, b"v" * int(n))
                continue
            end = time.monotonic() + 60
            while kv.get(key) is None:  # (an absent key is cached as absent for a while)
                if time.monotonic() > end:
                    raise SystemExit(f"{key} never became readable on {args.config}")
                time.sleep(0.05)
            for _ in range(int(n)):
                kv.get(key)
        time.sleep(1.1)  # the next flush makes a report, with every read in it
        kv.hot_keys(1)
        open(os.path.join(args.dir, f"{args.agent}.done"), "w").close()
        while not os.path.exists(os.path.join(args.dir, "stop")):
            time.sleep(0.05)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
