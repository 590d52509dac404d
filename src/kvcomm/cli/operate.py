"""The operator's commands: ``kvcomm metrics`` (the embedded mode's exporter), ``kvcomm
top`` (a live view) and ``kvcomm loadtest`` (Locust scenarios against KVCOMM and Redis)."""

from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Callable
from typing import Any

from ..config import load_config
from ..errors import ConfigError, SegmentError


def _metrics(args: argparse.Namespace) -> int:
    """Serve a namespace's metrics for Prometheus (embedded mode; in cluster mode the node
    daemon serves them at metrics.port) until SIGTERM or Ctrl-C. The namespace must exist
    (its agents made it): it is never created here; once purged, scrapes fail until the
    agents make it again, then serve the new one. Needs pip install 'kvcomm[metrics]'."""
    from ..metrics.collector import NamedSegment
    from ..metrics.exporter import Exporter

    cfg = load_config(args.config)
    port = args.port if args.port is not None else cfg.metrics.port
    if port is None or not 0 < port < 65536:
        raise ConfigError("metrics.port", "give --port P (1 to 65535) or set metrics.port")
    name = args.name or cfg.node.namespace
    source = NamedSegment(name, cfg)
    try:
        try:
            source()
        except SegmentError as exc:
            raise SegmentError(f"{exc}: kvcomm metrics serves a namespace its agents made "
                               "(check --name, or start it after them)") from None
        exporter = Exporter(source, cfg, port=port, host=args.host)
        print(f"serving the metrics of namespace {name!r} at {exporter.url}", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        exporter.close()
    finally:
        source.close()
    return 0


def _top(args: argparse.Namespace) -> int:
    """A live view of a host (its L2's metrics: ops/s and hit rate per tier, p50/p99,
    backlog, feed lag, hot keys) or, with --cluster, of every host the cluster knows
    (scraped from their exporters). --once prints one frame. Needs pip install
    'kvcomm[metrics]'."""
    from .._extras import require
    from ..metrics.snapshot import View
    from . import top

    require("rich", extra="metrics", purpose="kvcomm top")
    cfg = load_config(args.config)
    if args.interval <= 0:
        raise ConfigError("", "--interval must be a positive number of seconds")
    snap: Callable[[], Any]
    if args.cluster:
        if not cfg.cluster.enabled:
            raise ConfigError("cluster.redis", "kvcomm top --cluster needs the config of a "
                              "cluster host (cluster.redis set)")
        require("prometheus_client", extra="metrics", purpose="kvcomm top --cluster")
        snap, close = top.cluster_source(cfg)

        def render_cluster(new: Any, old: Any, dt: float) -> Any:
            before = {h: s for h, _, s in old} if old else {}
            return top.cluster_frame([(h, st, None if s is None else View(s, before.get(h), dt))
                                      for h, st, s in new])

        render: Callable[[Any, Any, float], Any] = render_cluster
    else:
        snap, close = top.local_source(args.name or cfg.node.namespace, cfg)

        def render_host(new: Any, old: Any, dt: float) -> Any:
            return top.host_frame(View(new, old, dt),
                                  f"{new.host} · {new.namespace} · every {args.interval:g}s")

        render = render_host
    try:
        return top.run(snap, render, args.interval, args.once)
    finally:
        close()


def _loadtest(args: argparse.Namespace) -> int:
    """Run a scenario of agents under Locust (headless) against KVCOMM — a host of a
    cluster with --config, else an embedded namespace made for the run — and, with
    --baseline redis, the same scenario against Redis directly; prints Locust's summary
    and the exact figures side by side. Exit status 0 only with no failure. Needs pip
    install 'kvcomm[loadtest]' (and kvcomm[cluster] plus redis-server for the baseline).
    For Locust's web UI, run the shipped locustfile yourself (README: Operating KVCOMM)."""
    from .. import loadtest

    if args.users < 1 or args.seconds <= 0:
        raise ConfigError("", "--users must be at least 1 and --seconds positive")
    return loadtest.run(args.scenario, users=args.users, seconds=args.seconds,
                        config=args.config, baseline=args.baseline, redis=args.redis,
                        csv=args.csv, plot=args.plot, rate=args.rate, seed=args.seed,
                        quiet=args.quiet, json_out=args.json)


def _duration(text: str) -> float:
    """``--interval``: ``2``, ``0.5``, ``500ms``, ``1s`` (argparse reports a bad one)."""
    from ..config import parse_duration

    try:
        seconds = parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if seconds <= 0:  # (rates need time between two frames)
        raise argparse.ArgumentTypeError(f"the interval must be more than 0, got {text!r}")
    return seconds


def add_commands(sub: Any, command: Callable[..., argparse.ArgumentParser]) -> None:
    """Register metrics, top and loadtest (``command``: the CLI's subcommand helper)."""
    m = command(sub, "metrics", _metrics, "serve a namespace's metrics for Prometheus (embedded mode)")
    m.add_argument("--name", metavar="NS", help="the namespace (default: node.namespace of the config)")
    m.add_argument("--port", type=int, metavar="P", help="the HTTP port (default: metrics.port)")
    m.add_argument("--host", metavar="ADDR",
                   help="the address to listen on (default: metrics.host, 127.0.0.1)")
    m.add_argument("--config", metavar="FILE", help="a kvcomm YAML config (default: built-in defaults)")

    t = command(sub, "top", _top, "a live view of a host, or of every host of the cluster")
    t.add_argument("--name", metavar="NS", help="the namespace (default: node.namespace of the config)")
    t.add_argument("--config", metavar="FILE", help="a kvcomm YAML config (the host's)")
    t.add_argument("--cluster", action="store_true",
                   help="every host the cluster knows (needs a cluster host's --config)")
    t.add_argument("--interval", type=_duration, default=1.0, metavar="S",
                   help="time between frames: seconds or a duration such as 500ms, 2s "
                   "(default 1s)")
    t.add_argument("--once", action="store_true",
                   help="print one frame (rates over one interval) and exit")

    lt = command(sub, "loadtest", _loadtest,
                 "Locust scenarios of agents against KVCOMM (and Redis, side by side)")
    lt.add_argument("--scenario", required=True,
                    choices=["swarm", "warehouse", "hotkeys", "penetration"],
                    help="swarm: drones put state at 50 Hz and read neighbours; warehouse: "
                    "robots claim shelves (compare-and-set + validator); hotkeys: a hot-key "
                    "storm; penetration: reads of absent keys")
    lt.add_argument("--users", type=int, default=16, metavar="N", help="agents (default 16)")
    lt.add_argument("--seconds", type=float, default=30.0, metavar="S",
                    help="run time of each run (default 30)")
    lt.add_argument("--config", metavar="FILE",
                    help="the config the agents open (a cluster host's; default: an embedded "
                    "namespace made for the run)")
    lt.add_argument("--baseline", choices=["none", "redis"], default="none",
                    help="redis: also run the scenario against Redis directly (default none)")
    lt.add_argument("--redis", metavar="HOST:PORT",
                    help="the baseline's Redis (default: a local redis-server started for the run)")
    lt.add_argument("--rate", type=float, default=0.0, metavar="HZ",
                    help="ticks per second per agent (default: the scenario's own)")
    lt.add_argument("--csv", metavar="PREFIX",
                    help="write Locust's CSV stats (PREFIX-kvcomm_stats.csv, PREFIX-redis_...)")
    lt.add_argument("--plot", metavar="PREFIX",
                    help="write PREFIX-latency.png and PREFIX-timeline.png (needs kvcomm[plot])")
    lt.add_argument("--json", metavar="FILE", help="write the exact figures as JSON")
    lt.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the agents' choices")
    lt.add_argument("--quiet", action="store_true", help="no Locust output, only the figures")

