"""The metrics contract: agents count exactly in the host's L2 (flushed deltas, never an
atomic per operation), latency is sampled exactly 1 in N, every family is exported, and a
dev cluster under a workload exposes counters that match the workload."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import shutil
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvcomm
from kvcomm.metrics import agent
from kvcomm.metrics.collector import Snapshot, read
from kvcomm.metrics.exporter import Exporter
from kvcomm.metrics.families import FAMILIES, HOT_KEYS, INFO
from kvcomm.metrics.snapshot import parse_text, quantile
from kvcomm.tiers.shm import layout
from kvcomm.tiers.shm.counters import MetricsRegion
from tests.support.devcluster import dev_cluster_fixture
from tests.support.helpers import SMALL, wait_for

R = "kvcomm_reads_total"


def _cfg(**metrics: Any) -> kvcomm.Config:
    return kvcomm.Config.from_mapping({**SMALL, "metrics": metrics})


def _snap(kv: kvcomm.Client) -> Snapshot:
    agent.flush_all()
    return read(kv._seg, kv.config)


def test_the_layout_keeps_series_and_histograms_apart() -> None:
    assert len(set(layout.METRIC_SERIES)) == len(layout.METRIC_SERIES)
    assert len(layout.METRIC_SERIES) <= layout.HIST_AT
    ends = sorted((at, at + layout.HIST_WORDS) for at in layout.HIST.values())
    assert ends[0][0] == layout.HIST_AT and ends[-1][1] <= layout.METRICS_WORDS
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:], strict=False))
    # every counted family of the region has a Family entry (so it is exported)
    stems = {s.lstrip("=").partition("{")[0] for s in layout.METRIC_SERIES}
    assert stems <= {f.stem for f in FAMILIES}


def test_reads_and_writes_are_counted_exactly(ns: str) -> None:
    with kvcomm.open(ns, config=_cfg(latency_sample=0)) as kv:
        kv.put("a", b"x")
        kv.put("b", {"v": 1}, consistency="strong")
        for _ in range(1000):
            kv.get("a")  # 1 L2 read, then L1 hits
        kv.get_item("a")
        for i in range(7):
            kv.get(f"absent/{i}")
        kv.delete("b")
        kv.delete("never-there")
        with kv.batch() as b:
            b.put("c", b"1")
            b.put("d", b"2")
        kv.update("n", lambda n: n + 1, default=0)
        s = _snap(kv)
    assert s.value(R, tier="l1", result="hit") == 999 + 1
    # L1 misses: the first get of "a", 7 absent, update's get_item of "n"
    assert s.value(R, tier="l1", result="miss") == 1 + 7 + 1
    assert s.value(R, tier="l2", result="hit") == 1
    assert s.value(R, tier="l2", result="absent") == 7 + 1
    assert s.value(R, tier="l2", result="miss") == 0  # (embedded: nothing goes on to L3)
    assert s.value("kvcomm_writes_total", kind="put", consistency="strong") == 1
    assert s.value("kvcomm_writes_total", kind="put", consistency="eventual") == 1 + 2 + 1
    assert s.value("kvcomm_writes_total", kind="delete") == 1
    assert s.value("kvcomm_batches_total") == 1 and s.value("kvcomm_updates_total") == 1
    assert s.value("kvcomm_l2_entries") >= 4


def test_counts_stay_in_the_process_until_flushed_and_are_added_once(ns: str) -> None:
    with kvcomm.open(ns, config=_cfg(flush_interval=0)) as kv:  # no flusher thread
        kv.put("a", b"x")
        for _ in range(100):
            kv.get("a")
        region = MetricsRegion(kv._seg)
        word = layout.METRIC["reads_total{tier=l1,result=hit}"]
        assert region.words()[word] == 0  # counted in the process only
        agent.flush_all()
        agent.flush_all()  # (a second flush adds nothing)
        assert region.words()[word] == 99
        for _ in range(10):
            kv.get("a")
    with kvcomm.open(ns, config=_cfg()) as kv:  # close flushed the last 10
        assert MetricsRegion(kv._seg).words()[word] == 109


def _reader(ns: str, n: int) -> None:
    with kvcomm.open(ns, config=_cfg(flush_interval=0.05)) as kv:
        for _ in range(n):
            kv.get("shared")


def test_processes_add_up_exactly(ns: str) -> None:
    with kvcomm.open(ns, config=_cfg()) as kv:
        kv.put("shared", b"v")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_reader, args=(ns, 5000 + i)) for i in range(3)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        s = _snap(kv)
    reads = sum(5000 + i for i in range(3))
    assert s.value(R, tier="l1") == reads  # every read counted once, hit or miss
    assert s.value(R, tier="l1", result="hit") == reads - 3  # one L2 read per process


def test_the_flusher_thread_flushes_without_a_close(ns: str) -> None:
    with kvcomm.open(ns, config=_cfg(flush_interval=0.05)) as kv:
        kv.put("a", b"x")
        for _ in range(50):
            kv.get("a")
        region = MetricsRegion(kv._seg)
        word = layout.METRIC["reads_total{tier=l1,result=hit}"]
        wait_for(lambda: region.words()[word] == 49, 10, "the background flush")


def test_latency_is_sampled_exactly_one_in_n(ns: str) -> None:
    with kvcomm.open(ns, config=_cfg(latency_sample=4)) as kv:
        kv.put("a", b"x")
        kv.get("a")
        for _ in range(399):
            kv.get("a")
        for i in range(40):
            kv.put(f"k{i}", b"v")
        s = _snap(kv)
    h = s.histograms["kvcomm_op_seconds"]
    get_l1 = h[(("op", "get"), ("tier", "l1"))]
    get_l2 = h[(("op", "get"), ("tier", "l2"))]
    put = h[(("op", "put"), ("tier", "l2"))]
    # one countdown in the getter (400 reads: 100 timed), one in the client (41 puts: 10)
    assert get_l1.count + get_l2.count == 100
    assert put.count == 10
    assert 0 < get_l1.sum < 1 and get_l1.buckets[-1][1] == get_l1.count
    q = quantile(get_l1, 0.5)
    assert q is not None and 0 < q < 0.01


def test_get_item_is_sampled_one_in_n_on_either_path(ns: str) -> None:
    with kvcomm.open(ns, config=_cfg(latency_sample=8)) as kv:
        kv.put("a", b"x")  # (the put's countdown: 1 of 8)
        for _ in range(79):  # the first from L2, then L1 hits
            kv.get_item("a")
        s = _snap(kv)
    h = s.histograms["kvcomm_op_seconds"]
    get_l1 = h[(("op", "get"), ("tier", "l1"))]
    get_l2 = h[(("op", "get"), ("tier", "l2"))]
    # 80 operations, 1 in 8 timed: the 8th, 16th... all L1 hits (the L2 read was the 2nd)
    assert (get_l1.count, get_l2.count) == (10, 0)
    assert s.value(R, tier="l1", result="hit") == 78


def test_latency_off_times_nothing(ns: str) -> None:
    with kvcomm.open(ns, config=_cfg(latency_sample=0)) as kv:
        kv.put("a", b"x")
        for _ in range(100):
            kv.get("a")
        s = _snap(kv)
    assert all(h.count == 0 for h in s.histograms["kvcomm_op_seconds"].values())


def test_errors_are_counted_by_class(ns: str) -> None:
    with kvcomm.open(ns, config=_cfg()) as kv:
        before = _snap(kv).value("kvcomm_errors_total", type="ConflictError")
        v = kv.put("a", b"x")
        kv.put("a", b"y")
        for _ in range(3):
            with pytest.raises(kvcomm.ConflictError):
                kv.put("a", b"z", expect=v)
        with pytest.raises(kvcomm.InvalidKey):
            kv.get("")
        s = _snap(kv)
    assert s.value("kvcomm_errors_total", type="ConflictError") == before + 3
    assert s.value("kvcomm_errors_total", type="InvalidKey") >= 1
    assert s.value("kvcomm_conflicts_total") == 3


def test_a_forked_child_never_flushes_its_parents_counts(ns: str) -> None:
    with kvcomm.open(ns, config=_cfg(flush_interval=0)) as kv:
        kv.put("a", b"x")
        for _ in range(100):
            kv.get("a")
        pid = os.fork()
        if pid == 0:  # the child: exits through atexit-less _exit after a flush attempt
            try:
                agent.flush_all()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        word = layout.METRIC["reads_total{tier=l1,result=hit}"]
        assert MetricsRegion(kv._seg).words()[word] == 0
        agent.flush_all()
        assert MetricsRegion(kv._seg).words()[word] == 99


def test_every_family_is_exported_and_parses(ns: str) -> None:
    cfg = _cfg(hot_keys=3, hot_key_label="hash")
    with kvcomm.open(ns, config=cfg) as kv:
        for i in range(20):
            kv.put(f"hot/{i}", b"v")
            for _ in range(50 * (i + 1)):
                kv.get(f"hot/{i}")
        kv.hot_keys()
        agent.flush_all()
        ex = Exporter(kv._seg, cfg, port=0)
        try:
            with urllib.request.urlopen(ex.url, timeout=5) as r:
                text = r.read().decode()
        finally:
            ex.close()
    names = set()
    for fam in text_string_to_metric_families(text):
        names.add(fam.name + ("_total" if fam.type == "counter" else ""))
    assert {f.name for f in FAMILIES} | {HOT_KEYS.name, INFO.name} <= names
    snap = parse_text(text)
    assert snap.value(R, tier="l1", result="hit") == sum(50 * (i + 1) for i in range(20)) - 20
    assert len(snap.hot) == 3 and all(k.startswith("#") and len(k) == 17 for k, _ in snap.hot)
    assert snap.host == "local" and snap.namespace == ns


def test_hot_keys_cut_to_one_label_give_one_series(ns: str) -> None:
    cfg = _cfg(hot_keys=5, hot_key_label="truncate", hot_key_chars=8)
    with kvcomm.open(ns, config=cfg) as kv:
        for i in range(4):  # four keys whose first 7 characters are the same
            kv.put(f"sensor/{i}-long", b"v")
            for _ in range(64 * (i + 1)):
                kv.get(f"sensor/{i}-long")
        kv.put("short", b"v")
        for _ in range(64):
            kv.get("short")
        kv.hot_keys()  # (flushes this process's samples into the host's sketch)
        snap = read(kv._seg, cfg)
        top = kv.hot_keys(5)
    labels = [k for k, _ in snap.hot]
    assert len(labels) == len(set(labels)) <= 5
    assert "sensor/…" in labels and "short" in labels
    # the cut label keeps the hottest of the keys it stands for
    assert dict(snap.hot)["sensor/…"] == max(n for k, n in top if k.startswith("sensor/"))


def test_the_grafana_dashboard_asks_only_for_exported_families() -> None:
    import json
    import re
    from pathlib import Path

    board = Path(__file__).resolve().parents[1] / "contrib" / "grafana-kvcomm.json"
    exprs = [t["expr"] for p in json.loads(board.read_text())["panels"]
             for t in p.get("targets", [])]
    used = {re.sub(r"_(bucket|sum|count)$", "", m)
            for e in exprs for m in re.findall(r"\bkvcomm_[a-z0-9_]+", e)}
    exported = {f.name for f in FAMILIES} | {HOT_KEYS.name, INFO.name}
    assert used and used <= exported, used - exported


# ---------------------------------------------------------------- a dev cluster

needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None,
                                 reason="redis-server is not installed")


dev = dev_cluster_fixture(2)


def _swarm(config: str, me: int, drones: int, ticks: int, seed: int) -> None:
    rng = random.Random(seed)
    with kvcomm.open(config=config) as kv:
        for t in range(ticks):
            kv.put(f"drone/{me}/state", {"t": t, "pos": [me, t]})
            for other in rng.sample(range(drones), 4):
                kv.get(f"drone/{other}/state")


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()  # type: ignore[no-any-return]


@needs_redis
@pytest.mark.redis
def test_a_dev_cluster_under_a_workload_exposes_every_family(dev: dict[str, Any]) -> None:
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    hosts = dev["hosts"]
    base = [parse_text(_scrape(h["metrics"])) for h in hosts]
    ctx = mp.get_context("spawn")
    drones, ticks = 6, 400
    procs = [ctx.Process(target=_swarm, args=(hosts[i % 2]["config"], i, drones, ticks, seed + i))
             for i in range(drones)]
    for p in procs:
        p.start()
    try:
        # during the workload: the counters move on both hosts
        def moving() -> bool:
            return all(parse_text(_scrape(h["metrics"])).value(R, tier="l1")
                       > b.value(R, tier="l1") for h, b in zip(hosts, base, strict=True))
        wait_for(moving, 60, "reads to show in both hosts' metrics during the workload")
    finally:
        for p in procs:
            p.join(120)
    assert all(p.exitcode == 0 for p in procs)
    reads = drones * ticks * 4
    puts = drones * ticks

    def totals() -> tuple[float, float]:
        snaps = [parse_text(_scrape(h["metrics"])) for h in hosts]
        return (sum(s.value(R, tier="l1") - b.value(R, tier="l1")
                    for s, b in zip(snaps, base, strict=True)),
                sum(s.value("kvcomm_writes_total", kind="put")
                    - b.value("kvcomm_writes_total", kind="put")
                    for s, b in zip(snaps, base, strict=True)))

    # agents closed: their last flush is in L2, so the totals are exact
    assert totals() == (reads, puts)
    hot_k = kvcomm.Config.load(hosts[0]["config"]).metrics.hot_keys
    texts = [_scrape(h["metrics"]) for h in hosts]
    for h, text, b in zip(hosts, texts, base, strict=True):
        names = {f.name + ("_total" if f.type == "counter" else "")
                 for f in text_string_to_metric_families(text)}
        assert {f.name for f in FAMILIES} | {HOT_KEYS.name, INFO.name} <= names, h["host"]
        snap = parse_text(text)

        def d(family: str, s: Snapshot = snap, b: Snapshot = b, **labels: str) -> float:
            return s.value(family, **labels) - b.value(family, **labels)

        assert snap.host == h["host"] and snap.value("kvcomm_daemon_up") == 1
        # every L1 miss was read in L2; every L2 miss was answered by L3 or a guard
        assert d(R, tier="l1", result="miss") == d(R, tier="l2")
        assert d(R, tier="l2", result="miss") == (d(R, tier="l3")
                                                   + d("kvcomm_guard_answers_total"))
        assert d(R, tier="l2", result="hit") > 0
        # the hot keys: the drones' state keys, at most metrics.hot_keys of them
        assert 0 < len(snap.hot) <= hot_k
        assert all(k.startswith("drone/") and k.endswith("/state") for k, _ in snap.hot)
        # the daemon pushed this host's writes, read the other host's and counted its L3
        # traffic (flushed every metrics.flush_interval: waited for)
        def daemon_counted(h: dict[str, Any] = h) -> bool:
            s = parse_text(_scrape(h["metrics"]))
            return (s.value("kvcomm_window_writes_total", side="out") > 0
                    and s.value("kvcomm_window_batches_total") > 0
                    and s.value("kvcomm_feed_events_total", feed="cluster") > 0
                    and s.value("kvcomm_l3_bytes_total", direction="sent") > 0
                    and s.value("kvcomm_l3_bytes_total", direction="received") > 0)
        wait_for(daemon_counted, 30, "the daemon's pushes, feed reads and L3 traffic")
        s = parse_text(_scrape(h["metrics"]))
        # each L3 read is one command at least, and the daemon's pushes are more
        assert d("kvcomm_l3_commands_total", s=s) > d(R, s=s, tier="l3")
        assert s.value("kvcomm_l2_entries") > 0 and 0 < s.value("kvcomm_l2_bytes") \
            <= s.value("kvcomm_l2_capacity_bytes")
        assert d("kvcomm_errors_total", s=s) == 0
        hist = s.histograms["kvcomm_op_seconds"]
        assert sum(x.count for lab, x in hist.items() if dict(lab)["op"] == "get") > 0
        assert hist[(("op", "put"), ("tier", "l2"))].count > 0
    # and the backlog drains
    wait_for(lambda: all(parse_text(_scrape(h["metrics"])).value("kvcomm_outbound_backlog") == 0
                         for h in hosts), 30, "the outbound backlog to drain")


@needs_redis
@pytest.mark.redis
def test_l3_wire_counts_every_command(dev: dict[str, Any]) -> None:
    from kvcomm.tiers.l3 import L3Store

    cfg = kvcomm.Config.load(dev["hosts"][0]["config"])
    store = L3Store(cfg.cluster.seeds())
    try:
        for i in range(25):  # every master's connection made (handshakes count too)
            store.get(f"absent/{i}")
        before = (store.wire.commands, store.wire.sent, store.wire.received)
        for i in range(25):
            store.get(f"absent/{i}")
        assert store.wire.commands - before[0] == 25
        assert store.wire.sent - before[1] >= 25 * len(b"*2\r\n$3\r\nGET\r\n")
        # a nil reply: "$-1\r\n" (RESP2) or "_\r\n" (RESP3, redis-py's default from 8)
        assert store.wire.received - before[2] in (25 * 5, 25 * 3)
    finally:
        store.close()


@needs_redis
@pytest.mark.redis
def test_the_registry_lists_every_host_with_its_metrics_address(dev: dict[str, Any]) -> None:
    from kvcomm.metrics.registry import L3Registry
    from kvcomm.tiers.l3 import L3Store

    cfg = kvcomm.Config.load(dev["hosts"][0]["config"])
    store = L3Store(cfg.cluster.seeds())
    try:
        entries = {e.host: e.metrics_url for e in L3Registry(store).hosts()}
    finally:
        store.close()
    assert entries == {h["host"]: h["metrics"] for h in dev["hosts"]}


@needs_redis
@pytest.mark.redis
def test_top_cluster_once_shows_every_host(dev: dict[str, Any]) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kvcomm", "top", "--cluster", "--once",
                          "--interval", "0.2", "--config", dev["hosts"][0]["config"]],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "100"})
    assert out.returncode == 0, out.stderr
    for h in dev["hosts"]:
        assert h["host"] in out.stdout
    assert "unreachable" not in out.stdout and "no metrics" not in out.stdout


def test_partition_mode_and_the_lease_are_exported_from_the_daemons_state(ns: str) -> None:
    """The daemon's cluster state (node/presence.py Reachability, HostPresence) reaches
    kvcomm_partition_mode, kvcomm_lease_live and kvcomm_partitions_total through the same
    gauge path as its feed lag (metrics/node.py cluster_state)."""
    from types import SimpleNamespace

    from kvcomm.metrics.node import cluster_state

    daemon = SimpleNamespace(reach=SimpleNamespace(partition=True, entered=3),
                             presence=SimpleNamespace(lease=0x1234))
    with kvcomm.open(ns, config=_cfg(latency_sample=0)) as kv:
        kv._meter.add_gauges(lambda: cluster_state(daemon))
        kv._meter.flush()
        s = _snap(kv)
        assert (s.value("kvcomm_partition_mode"), s.value("kvcomm_lease_live"),
                s.value("kvcomm_partitions_total")) == (1, 1, 3)
        daemon.reach.partition, daemon.presence = False, None  # healed; etcd not configured
        kv._meter.flush()
        s = _snap(kv)
        assert (s.value("kvcomm_partition_mode"), s.value("kvcomm_lease_live")) == (0, 0)
