"""``kvcomm placement observe | plan | launch``: affinity placement from the command line
(:mod:`kvcomm.placement` has the theory; docs/placement.md the usage)."""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

from ..config import load_config
from ..errors import InvalidArgument


def _observe(args: argparse.Namespace) -> int:
    """Observe which agents read whose keys, over the whole cluster, for --seconds, and
    write the communication graph (agents with their host and load, edges with reads and
    bytes per second) to --out as JSON. In cluster mode every host's node daemon must
    run; in embedded mode this host's agents are observed."""
    from ..placement.graph import write_json
    from ..placement.observe import observe

    cfg = load_config(args.config)
    graph = observe(cfg, args.seconds, namespace=args.name)
    write_json(args.out, graph.to_json())
    reads = sum(e.reads_per_s for e in graph.edges)
    print(f"{len(graph.agents)} agents, {len(graph.edges)} edges, {reads:.1f} cross-agent "
          f"reads/s; same-host share now {_pct(graph.share(graph.hosts()))}; wrote {args.out}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    """Assign every agent of a graph to one of --hosts so that as many cross-agent reads as
    possible stay on one host, each host's load stays within --balance times the mean, and
    at most --max-moves agents leave the host they run on. Writes the plan (assignment,
    moves, predicted same-host read share before and after) to --out and prints both
    shares. Needs pip install 'kvcomm[placement]'."""
    from ..placement.graph import load_graph, write_json
    from ..placement.plan import make_plan

    graph = load_graph(args.graph)
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    plan = make_plan(graph, hosts, balance=args.balance, max_moves=args.max_moves,
                     move_cost=args.move_cost, seed=args.seed)
    write_json(args.out, plan.to_json())
    print(f"same-host read share: before {_pct(plan.before)}, planned {_pct(plan.share)}; "
          f"{len(plan.moves)} moves; wrote {args.out}")
    return 0


def _launch(args: argparse.Namespace) -> int:
    """Start one process per named agent of a plan on its host of a dev cluster: COMMAND
    (after --) with {agent}, {host} and {config} replaced, and KVCOMM_AGENT, KVCOMM_HOST
    and KVCOMM_CONFIG in its environment, so that it opens
    kvcomm.open(config=..., agent=...). Waits for them all (Ctrl-C or SIGTERM stops them);
    the exit status is the first non-zero one of theirs. With --replan-every S, every S
    seconds it observes the cluster, plans again from where the agents run with at most
    --max-moves moves, and moves those agents (stopped, started on their new host), until
    they have all ended."""
    from ..placement.graph import load_plan
    from ..placement.launcher import Launcher

    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise InvalidArgument("give the agent's command after --, e.g. "
                              "-- python agent.py --agent {agent} --config {config}")
    if args.replan_every is not None and not 0 < args.replan_every < 1e6:
        raise InvalidArgument(f"--replan-every must be seconds > 0, got {args.replan_every:g}")
    if args.max_moves < 0:
        raise InvalidArgument(f"--max-moves must be >= 0, got {args.max_moves}")
    launcher = Launcher.for_dev_cluster(args.dir)
    plan = load_plan(args.plan)

    def stopped(signum: int, frame: Any) -> None:
        raise _Stopped(signum)

    # SIGTERM (kill, a supervisor) stops the agents as Ctrl-C does: they are this
    # process's to stop, and left running they would double the next plan's
    main = threading.current_thread() is threading.main_thread()  # (signals: main only)
    previous = signal.signal(signal.SIGTERM, stopped) if main else None
    try:
        launcher.apply(plan, command, log_dir=args.logs)
        print(f"started {len(launcher.running)} agents: " + ", ".join(
            f"{h}: {n}" for h, n in sorted(launcher.per_host().items())), flush=True)
        if args.replan_every is not None:
            cfg = load_config(launcher.configs[sorted(launcher.configs)[0]])
            launcher.replan_loop(cfg, command, every=args.replan_every,
                                 max_moves=args.max_moves, balance=args.balance,
                                 log_dir=args.logs, on_round=_print_round)
        return launcher.wait()
    except KeyboardInterrupt:
        return 130
    except _Stopped as exc:
        return 128 + exc.signum
    except OSError as exc:
        raise InvalidArgument(f"cannot start the agents ({exc}); check the command after "
                              "-- and --logs") from None
    finally:
        if main:  # (a second SIGTERM must not cut the stopping short)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        launcher.stop_all()
        if main:
            signal.signal(signal.SIGTERM, previous)


def _print_round(r: Any) -> None:
    if r.skipped:
        print(f"re-plan: skipped ({r.skipped})", flush=True)
    else:
        print(f"re-plan: same-host read share {_pct(r.before)} → {_pct(r.share)}; moved "
              + (", ".join(f"{m.agent} {m.source}→{m.target}" for m in r.moves) or "none"),
              flush=True)


class _Stopped(BaseException):
    """SIGTERM arrived: stop the agents and exit 128 + the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _pct(share: float | None) -> str:
    return "n/a (no cross-agent reads)" if share is None else f"{100 * share:.1f}%"


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return v


def add_placement(sub: Any, command: Any) -> None:
    """Register ``kvcomm placement`` and its subcommands (``command`` is the CLI's helper
    that makes a subcommand from its handler)."""
    def run(args: argparse.Namespace) -> int:
        """Affinity placement: observe who reads whose state (observe), plan hosts for
        agents from that graph (plan), start agents on a dev cluster by a plan (launch)."""
        status: int = args.placement_func(args)
        return status

    p = command(sub, "placement", run, "observe who reads whom, and plan hosts for agents")
    ps = p.add_subparsers(dest="placement_command", required=True, metavar="ACTION",
                          help="observe, plan or launch")

    def action(name: str, fn: Any, summary: str) -> argparse.ArgumentParser:
        a: argparse.ArgumentParser = ps.add_parser(name, help=summary, description=fn.__doc__)
        a.set_defaults(placement_func=fn)
        return a

    o = action("observe", _observe, "export the cluster's communication graph as JSON")
    o.add_argument("--config", metavar="FILE",
                   help="a kvcomm YAML config: a host's (cluster mode), or this host's")
    o.add_argument("--seconds", type=_positive, default=10.0, metavar="N",
                   help="how long to observe (default 10; 0: since each agent started)")
    o.add_argument("--out", required=True, metavar="GRAPH.json", help="where to write the graph")
    o.add_argument("--name", metavar="NS",
                   help="embedded mode: the namespace (default: node.namespace of the config)")

    pl = action("plan", _plan, "assign agents to hosts from a graph")
    pl.add_argument("--graph", required=True, metavar="GRAPH.json",
                    help="the graph (kvcomm placement observe --out)")
    pl.add_argument("--hosts", required=True, metavar="H1,H2,...",
                    help="the hosts to place agents on (comma-separated host ids)")
    pl.add_argument("--balance", type=float, default=1.1, metavar="B",
                    help="each host's load at most B times the mean (default 1.1; >= 1)")
    pl.add_argument("--max-moves", type=int, metavar="M",
                    help="at most M agents leave the host the graph says they run on "
                    "(default: no limit)")
    pl.add_argument("--move-cost", type=_positive, default=0.0, metavar="R",
                    help="reads per second a move must bring onto one host to be worth "
                    "making (default 0)")
    pl.add_argument("--seed", type=int, default=0, metavar="N",
                    help="seed of the partitioner (default 0: the same plan every run)")
    pl.add_argument("--out", required=True, metavar="PLAN.json", help="where to write the plan")

    la = action("launch", _launch, "start agents on a dev cluster's hosts by a plan")
    la.add_argument("--plan", required=True, metavar="PLAN.json",
                    help="the plan (kvcomm placement plan --out)")
    la.add_argument("--dir", required=True, metavar="DIR",
                    help="the dev cluster's directory (kvcomm dev-cluster up --dir)")
    la.add_argument("--logs", metavar="DIR",
                    help="write each agent's output to DIR/AGENT.log (default: inherited)")
    la.add_argument("--replan-every", type=float, metavar="S",
                    help="re-place the agents every S seconds as they run (observe, plan from "
                    "where they run, move; default: never)")
    la.add_argument("--max-moves", type=int, default=4, metavar="M",
                    help="with --replan-every: at most M agents move a round (default 4)")
    la.add_argument("--balance", type=float, default=1.1, metavar="B",
                    help="with --replan-every: each host's load at most B times the mean "
                    "(default 1.1)")
    la.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                    help="the agent's command line, with {agent}, {host}, {config}")
