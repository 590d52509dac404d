"""``kvcomm loadtest``: Locust, headless, with users that act like agents.

Scenarios (user classes in :mod:`.users`, shipped locustfile :data:`LOCUSTFILE`):

* ``swarm`` — drones put their state at 50 Hz and read 8 neighbours' states;
* ``warehouse`` — robots claim shelves with compare-and-set and a validator (strong keys
  once they exist) and release them;
* ``hotkeys`` — a hot-key storm: most reads on a few keys;
* ``penetration`` — a storm of reads of keys that do not exist.

:func:`run` runs one scenario against KVCOMM (``--config``: a host of a cluster, else an
embedded namespace made for the run) and, with ``baseline="redis"``, the same scenario
against Redis directly (``--redis host:port``, or a local ``redis-server`` started for
the run); prints Locust's summary and the exact figures side by side; writes Locust's
CSVs (``csv``) and plots (``plot``). Needs kvcomm[loadtest].
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

LOCUSTFILE = str(Path(__file__).with_name("locustfile.py"))
SCENARIOS = {"swarm": "SwarmDrone", "warehouse": "WarehouseRobot", "hotkeys": "HotKeyReader",
             "penetration": "PenetrationProber"}


def locust_argv(scenario: str, users: int, seconds: float, backend: str, out: str, *,
                config: str | None = None, name: str | None = None, redis: str | None = None,
                rate: float = 0.0, csv: str | None = None, seed: int = 0) -> list[str]:
    """The ``locust`` command line of one headless run."""
    argv = [sys.executable, "-m", "locust", "-f", LOCUSTFILE, "--headless",
            "-u", str(users), "-r", str(users), "-t", f"{max(1, round(seconds))}s",
            "--only-summary", "--stop-timeout", "5", "--exit-code-on-error", "1",
            "--kvcomm-backend", backend, "--kvcomm-out", out, "--kvcomm-seed", str(seed)]
    if config:
        argv += ["--kvcomm-config", config]
    if name:
        argv += ["--kvcomm-name", name]
    if redis:
        argv += ["--kvcomm-redis", redis]
    if rate:
        argv += ["--kvcomm-rate", str(rate)]
    if csv:
        argv += ["--csv", csv]
    return [*argv, SCENARIOS[scenario]]


def run_one(argv: list[str], out: str, quiet: bool = False) -> tuple[int, dict[str, Any]]:
    """Run Locust; returns its exit status and the exact figures it wrote."""
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL if quiet else None,
                          stderr=subprocess.DEVNULL if quiet else None, timeout=None)
    try:
        figures = json.loads(Path(out).read_text())
    except (OSError, ValueError):
        figures = {"ops": {}, "timeline": [], "seconds": 0, "backend": "?"}
    return proc.returncode, figures


def run(scenario: str, users: int = 16, seconds: float = 30.0, config: str | None = None,
        baseline: str = "none", redis: str | None = None, csv: str | None = None,
        plot: str | None = None, rate: float = 0.0, seed: int = 0, quiet: bool = False,
        json_out: str | None = None) -> int:
    """Run ``scenario`` (and its Redis baseline); print the figures. Returns 0 when every
    run finished with no failure. Raises InvalidArgument (an unknown scenario or
    baseline), ConfigError (Locust or, for the baseline, redis-py/redis-server missing)."""
    from .._extras import require
    from ..errors import InvalidArgument

    if scenario not in SCENARIOS:
        raise InvalidArgument(f"unknown scenario {scenario!r}; choose one of "
                              f"{', '.join(SCENARIOS)}")
    if baseline not in ("none", "redis"):
        raise InvalidArgument(f"unknown baseline {baseline!r}; choose none or redis")
    require("locust", extra="loadtest", purpose="kvcomm loadtest")
    tmp = tempfile.mkdtemp(prefix="kvcomm-loadtest-")
    results: dict[str, dict[str, Any]] = {}
    status = 0
    name = None
    if config is None:
        name = f"loadtest-{os.getpid()}"  # an embedded namespace of its own, purged after
    try:
        out = os.path.join(tmp, "kvcomm.json")
        rc, results["kvcomm"] = run_one(locust_argv(
            scenario, users, seconds, "kvcomm", out, config=config, name=name, rate=rate,
            csv=f"{csv}-kvcomm" if csv else None, seed=seed), out, quiet)
        status |= rc
        if baseline == "redis":
            rc, results["redis"] = _run_redis(scenario, users, seconds, redis, tmp, rate, csv,
                                              seed, quiet)
            status |= rc
    finally:
        if name is not None:
            from ..tiers.l2 import purge

            purge(name)
    failures = sum(op["failures"] for r in results.values() for op in r["ops"].values())
    print(report(scenario, results))
    if json_out:
        Path(json_out).write_text(json.dumps({"scenario": scenario, **results}))
    if plot:
        from .plots import plot_all

        for path in plot_all(scenario, results, plot):
            print(f"wrote {path}")
    return 0 if status == 0 and failures == 0 else 1


def _run_redis(scenario: str, users: int, seconds: float, redis: str | None, tmp: str,
               rate: float, csv: str | None, seed: int, quiet: bool) -> tuple[int, dict[str, Any]]:
    from .._extras import require_cluster

    require_cluster("the Redis baseline")
    server = None
    if redis is None:
        from ..devcluster.redis_server import RedisServer

        server = RedisServer().start()
        redis = f"127.0.0.1:{server.port}"
    try:
        out = os.path.join(tmp, "redis.json")
        return run_one(locust_argv(scenario, users, seconds, "redis", out, redis=redis,
                                   rate=rate, csv=f"{csv}-redis" if csv else None, seed=seed),
                       out, quiet)
    finally:
        if server is not None:
            server.stop()


def _us(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if v < 1000 else f"{v / 1000:.2f}ms"


def report(scenario: str, results: dict[str, dict[str, Any]]) -> str:
    """The figures as a plain table: per operation, per store, ops/s and p50/p99 (µs)."""
    stores = list(results)
    lines = [f"scenario {scenario}: " + ", ".join(
        f"{s} {results[s].get('users')} users, {results[s].get('seconds', 0):.0f}s" for s in stores)]
    head = f"{'operation':<16}" + "".join(f"{s + ' ops/s':>14}{'p50 µs':>10}{'p99 µs':>10}{'fail':>6}"
                                        for s in stores)
    lines += [head, "-" * len(head)]
    names = sorted({n for r in results.values() for n in r["ops"]})
    for n in names:
        row = f"{n:<16}"
        for s in stores:
            op = results[s]["ops"].get(n)
            if op is None:
                row += f"{'':>14}{'':>10}{'':>10}{'':>6}"
            else:
                row += (f"{op['per_s']:>14.0f}{_us(op['p50_us']):>10}{_us(op['p99_us']):>10}"
                        f"{op['failures']:>6}")
        lines.append(row)
    row = f"{'all':<16}"
    for s in stores:
        ops = results[s]["ops"].values()
        total = sum(o["per_s"] for o in ops)
        fails = sum(o["failures"] for o in ops)
        row += f"{total:>14.0f}{'':>10}{'':>10}{fails:>6}"
    lines.append(row)
    for s in stores:
        for n, op in results[s]["ops"].items():
            if op["failures"]:
                lines.append(f"{s} {n}: {op['failures']} failures, e.g. {op['error']}")
    return "\n".join(lines)
