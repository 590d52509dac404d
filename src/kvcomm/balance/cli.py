"""``kvcomm balance``: the live balancer, the simulator and the training of the policies
from the command line (docs/balancing.md).

    kvcomm balance --config FILE [--policy threshold|learned] [--window 30s] [--once]
                   [--dry-run]
    kvcomm balance simulate --policy threshold|learned --workload zipf|hotspot|diurnal|flash
                            --seed S [--nodes N] [--minutes M] [--slo-ms MS] [--model FILE]
                            [--json]
    kvcomm balance train --seed S [--seeds N] [--out FILE] [--workers N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ..errors import ConfigError, InvalidArgument
from .policy import POLICIES
from .workloads import WORKLOADS


def _simulate(args: argparse.Namespace) -> int:
    from .sim import SimConfig, simulate

    if args.policy is None or args.workload is None or args.seed is None:
        raise InvalidArgument("kvcomm balance simulate needs --policy, --workload and --seed "
                              "(e.g. --policy learned --workload zipf --seed 1)")
    cfg = SimConfig(nodes=args.nodes, minutes=args.minutes, slo_ms=args.slo_ms)
    params: dict[str, Any] = {}
    if args.model:
        if args.policy == "learned":
            params["model"] = args.model
        else:
            from .policy import threshold_params

            params = dict(threshold_params(args.model).__dict__)
    res = simulate(args.policy, args.workload, args.seed, config=cfg, policy_params=params)
    out = res.summary()
    out["slo_ms"] = args.slo_ms
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{args.policy} on {args.workload} (seed {args.seed}, {args.nodes} masters, "
          f"{args.minutes:g} min): {out['migrations']} slots moved "
          f"({out['bytes_moved'] / 2**30:.2f} GiB), p99 {out['p99_ms']:.3f} ms, "
          f"SLO ({args.slo_ms:g} ms) broken {out['slo_violation_s']:g} s, "
          f"busiest master at {100 * out['max_node_load']:.0f}% of capacity at worst")
    return 0


def _train(args: argparse.Namespace) -> int:
    from .train import TrainConfig, train, write_model

    if args.seed is None:
        raise InvalidArgument("kvcomm balance train needs --seed (e.g. --seed 1)")
    if args.seeds < 1 or args.workers < 1:
        raise InvalidArgument("--seeds and --workers must be at least 1")
    tc = TrainConfig(seeds=args.seeds, workers=args.workers)
    start = time.monotonic()
    model = train(args.seed, tc, log=lambda line: print(line, file=sys.stderr))
    model["trained"]["seconds"] = round(time.monotonic() - start, 1)
    write_model(model, args.out)
    print(f"wrote {args.out} in {model['trained']['seconds']:g} s (threshold knobs "
          f"{model['threshold']}); use it with kvcomm balance simulate --model {args.out}")
    return 0


def _live(args: argparse.Namespace) -> int:
    from .._extras import require_cluster
    from ..config import load_config, parse_duration
    from .driver import main as balance_main

    if args.config is None:
        raise ConfigError("--config", "kvcomm balance needs --config FILE naming the cluster "
                          "(a host's config will do), or an action: simulate, train")
    cfg = load_config(args.config)
    try:
        window = parse_duration(args.window)
    except ValueError as exc:
        raise ConfigError("--window", str(exc)) from None
    if cfg.cluster.redis:
        require_cluster("kvcomm balance")
    return balance_main(cfg, policy=args.policy or "threshold", window=window,
                        once=args.once, dry_run=args.dry_run)


def _run(args: argparse.Namespace) -> int:
    """Load-aware slot balancing of the Redis Cluster under L3. Without an action: watch
    every Redis master (ops/s, CPU, memory, latency from INFO and LATENCY) and each
    slot's load (the node daemons' per-group command counts), decide moves with a policy,
    move slots live (writes keep flowing, nothing is lost) and log each decision with
    its reason, until SIGTERM or SIGINT; --once runs one cycle and prints one JSON object
    on its last line (moves, bytes_moved, load_before, load_after); --dry-run decides
    without moving. Needs pip install 'kvcomm[cluster]'. `simulate` runs a slot-level
    model of a Redis Cluster (16384 slots, M/M/1 masters, migrations that cost bytes,
    CPU and ASK redirects) under a workload and a policy and prints what it measured;
    `train` fits the learned policy and tunes the threshold policy on training seeds and
    writes both as one JSON model. Both need pip install 'kvcomm[numpy]'."""
    if args.action is None:
        return _live(args)
    for opt in ("config", "once", "dry_run"):
        if getattr(args, opt):
            raise InvalidArgument(f"--{opt.replace('_', '-')} is for the live balancer "
                                  f"(kvcomm balance --config FILE), not `{args.action}`")
    if args.action == "simulate":
        return _simulate(args)
    return _train(args)


def register_balance_tools(sub: Any) -> argparse.ArgumentParser:
    """Add ``kvcomm balance [simulate|train]`` to the subparsers ``sub``; returns its
    parser."""
    b: argparse.ArgumentParser = sub.add_parser(
        "balance", help="move Redis Cluster slots by load (live), or simulate and train the "
        "policies", description=_run.__doc__)
    b.set_defaults(func=_run)
    b.add_argument("action", nargs="?", choices=["simulate", "train"],
                   help="none: the live balancer (needs --config); simulate: one simulated "
                   "run, its figures; train: fit the learned policy and tune the threshold one")
    b.add_argument("--config", metavar="FILE",
                   help="live: a config naming the cluster (cluster.redis, its credentials, "
                   "cluster.groups): a host's config will do")
    b.add_argument("--policy", choices=list(POLICIES),
                   help="the balancing policy: threshold (a master over mean + k std of load "
                   "gives slots away) or learned (the cost model trained in the simulator); "
                   "live default threshold, required by simulate")
    b.add_argument("--window", default="30s", metavar="DURATION",
                   help="live: how long each measurement of the load lasts (default 30s)")
    b.add_argument("--once", action="store_true",
                   help="live: one cycle, then print one JSON object on the last line: moves, "
                   "bytes_moved, load_before, load_after")
    b.add_argument("--dry-run", action="store_true",
                   help="live: decide and log, move nothing (load_after is then predicted)")
    b.add_argument("--workload", choices=list(WORKLOADS),
                   help="the workload (simulate): zipf, hotspot, diurnal or flash")
    b.add_argument("--seed", type=int, metavar="S",
                   help="the run's seed (simulate), or the training seed 0..999 (train)")
    b.add_argument("--nodes", type=int, default=8, metavar="N",
                   help="Redis masters (simulate; default 8)")
    b.add_argument("--minutes", type=float, default=30.0, metavar="M",
                   help="measured minutes, after 2 minutes of settling (simulate; default 30)")
    b.add_argument("--slo-ms", type=float, default=10.0, metavar="MS",
                   help="the p99 latency SLO in ms (simulate; default 10)")
    b.add_argument("--model", metavar="FILE",
                   help="a model written by `kvcomm balance train` (simulate; default: "
                   "the one shipped in the package)")
    b.add_argument("--json", action="store_true", help="print one JSON object (simulate)")
    b.add_argument("--seeds", type=int, default=4, metavar="N",
                   help="training runs per workload (train; default 4)")
    b.add_argument("--out", default="balance_model.json", metavar="FILE",
                   help="where to write the model (train; default balance_model.json)")
    b.add_argument("--workers", type=int, default=2, metavar="N",
                   help="processes to train with (train; default 2)")
    return b
