"""The operator's commands: ``kvcomm top --once`` (wide and narrow), ``kvcomm metrics``
(the embedded exporter), and short headless load tests of every scenario that must
finish with 0 failures (part of ``make test``: together under 30 s)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

import kvcomm
from kvcomm.metrics.collector import Snapshot
from kvcomm.metrics.snapshot import parse_text
from kvcomm.tiers.l2 import purge
from tests.support.helpers import SMALL, wait_for


def kvcomm_cli(*args: str, env: dict[str, str] | None = None,
               timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvcomm", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def _busy(ns: str) -> kvcomm.Client:
    kv = kvcomm.open(ns, config=kvcomm.Config.from_mapping(SMALL))
    for i in range(50):
        kv.put(f"drone/{i}/state", {"pos": [i, 0]})
    for _ in range(20):
        for i in range(50):
            kv.get(f"drone/{i}/state")
    kv.get("absent")
    kv.hot_keys()
    return kv


@pytest.mark.parametrize("columns", ["120", "40"])
def test_top_once_prints_one_frame_of_the_host(ns: str, columns: str) -> None:
    kv = _busy(ns)
    kv.close()  # (its counts are flushed into L2 now)
    out = kvcomm_cli("top", "--name", ns, "--once", "--interval", "0.2",
                     env={"COLUMNS": columns, "TERM": "dumb"})
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for word in ("L1", "L2", "L3", "put", "backlog", "hot keys", "drone/"):
        assert word in text, (word, text)
    assert "94.9%" in text  # L1: 950 hits of 1001 reads (the 1st read of each key, one absent)
    assert max(len(line) for line in text.splitlines()) <= int(columns)


def test_top_without_a_segment_says_so(ns: str) -> None:
    out = kvcomm_cli("top", "--name", ns, "--once")
    assert out.returncode == 2 and "no L2 segment" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("interval", ["0", "soon"])
def test_top_refuses_an_interval_that_is_not_a_positive_duration(ns: str, interval: str) -> None:
    out = kvcomm_cli("top", "--name", ns, "--once", "--interval", interval)
    assert out.returncode == 2 and "--interval" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_kvcomm_metrics_serves_a_namespace_until_sigterm(ns: str) -> None:
    from kvcomm.devcluster.redis_server import free_port

    kv = _busy(ns)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvcomm", "metrics", "--name", ns,
                             "--port", str(port)], stdout=subprocess.PIPE, text=True)
    try:
        def scrape() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                return r.read().decode()  # type: ignore[no-any-return]

        kv.close()
        snap = parse_text(wait_for(scrape, 30, "the exporter to answer", retry_on=(OSError,)))
        assert snap.namespace == ns
        wait_for(lambda: parse_text(scrape()).value("kvcomm_reads_total", tier="l1") == 1001,
                 10, "the closed client's reads")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    purge(ns)


# ---------------------------------------------------------------- load tests


def test_every_scenario_runs_headless_with_no_failure(tmp_path: Path, ns: str) -> None:
    """The four scenarios' agents together in one headless Locust run (what `kvcomm
    loadtest` runs one at a time): every operation reported, none failed."""
    from kvcomm import loadtest

    out = tmp_path / "r.json"
    argv = loadtest.locust_argv("swarm", 8, 3, "kvcomm", str(out), name=ns,
                                csv=str(tmp_path / "s"))
    argv = [*argv[:-1], *loadtest.SCENARIOS.values()]  # (2 agents of each scenario)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ops = json.loads(out.read_text())["ops"]
    assert sum(op["failures"] for op in ops.values()) == 0, ops
    assert (tmp_path / "s_stats.csv").exists()  # Locust's own CSV
    # each scenario did its part: drones put and read, robots claimed, the storms read
    for name in ("put", "get l1", "get l2", "get absent", "read shelf", "claim", "release"):
        assert ops.get(name, {}).get("count", 0) > 0, name


@pytest.mark.redis
def test_the_redis_baseline_runs_side_by_side(tmp_path: Path) -> None:
    out = kvcomm_cli("loadtest", "--scenario", "swarm", "--users", "4", "--seconds", "1",
                     "--baseline", "redis", "--quiet", "--json", str(tmp_path / "r.json"),
                     "--plot", str(tmp_path / "swarm"), timeout=90)
    assert out.returncode == 0, out.stdout + out.stderr
    got = json.loads((tmp_path / "r.json").read_text())
    assert got["redis"]["ops"]["get hit"]["count"] > 0 and got["redis"]["ops"]["put"]["failures"] == 0
    assert "redis ops/s" in out.stdout
    for name in ("swarm-latency.png", "swarm-timeline.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ kvcomm top


def _reads(l1_hit: int, l1_miss: int) -> Snapshot:
    R = "kvcomm_reads_total"
    return Snapshot(values={R: {(("tier", "l1"), ("result", "hit")): l1_hit,
                                (("tier", "l1"), ("result", "miss")): l1_miss}},
                    host="h", namespace="n")


def test_top_shows_the_hit_rate_of_the_interval_not_since_the_segment_was_made() -> None:
    """F: ``kvcomm top`` shows reads/s over the last interval next to a hit rate computed
    from the cumulative counters (since the segment was created): a host that served a
    million L1 hits yesterday and now misses every read shows "reads/s 100, hit 99.99%".
    README presents the frame as "rates over one interval"; p50/p99 are per interval
    (histo_delta), the hit rate is not, so a collapse of the hit rate, the first thing an
    operator looks for, does not show (the --cluster view's L1/L2 hit columns alike).
    (found in review 10: metrics, kvcomm top, load tests)"""
    import io

    from rich.console import Console

    from kvcomm.cli import top
    from kvcomm.metrics.snapshot import View

    old = _reads(1_000_000, 0)
    new = _reads(1_000_000, 100)  # this interval: 100 reads, every one an L1 miss
    out = io.StringIO()
    Console(file=out, width=100).print(top.host_frame(View(new, old, 1.0), "t"))
    l1_row = next(ln for ln in out.getvalue().splitlines() if "L1" in ln)
    cells = [c.strip() for c in l1_row.replace("│", "|").split("|") if c.strip()]
    assert cells[:3] == ["L1", "100", "0.0%"], f"the L1 row of an interval of misses: {l1_row!r}"
