"""The metrics contract: agents count exactly in the host's L2 (flushed deltas, never an
atomic per operation), latency is sampled exactly 1 in N, every family is exported, and a
dev cluster under a workload exposes counters that match the workload."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import threading
import types
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvcomm
from kvcomm import errors
from kvcomm.devcluster.redis_server import free_port
from kvcomm.metrics import agent
from kvcomm.metrics.collector import Snapshot, read
from kvcomm.metrics.exporter import Exporter
from kvcomm.metrics.families import FAMILIES, HOT_KEYS, INFO
from kvcomm.metrics.snapshot import parse_text, quantile
from kvcomm.tiers import l2
from kvcomm.tiers.shm import layout
from kvcomm.tiers.shm.counters import MetricsRegion
from tests.support import ROOT
from tests.support.devcluster import dev_cluster_fixture
from tests.support.helpers import SMALL, drawn_seed, wait_for

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

    board = ROOT / "contrib" / "grafana-kvcomm.json"
    exprs = [t["expr"] for p in json.loads(board.read_text())["panels"]
             for t in p.get("targets", [])]
    used = {re.sub(r"_(bucket|sum|count)$", "", m)
            for e in exprs for m in re.findall(r"\bkvcomm_[a-z0-9_]+", e)}
    exported = {f.name for f in FAMILIES} | {HOT_KEYS.name, INFO.name}
    assert used and used <= exported, used - exported


# ---------------------------------------------------------------- a dev cluster


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


@pytest.mark.redis
def test_a_dev_cluster_under_a_workload_exposes_every_family(dev: dict[str, Any]) -> None:
    seed = drawn_seed(1 << 30)
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
        made = {dict(lab)["type"]: v - b.values.get("kvcomm_errors_total", {}).get(lab, 0)
                for lab, v in s.values.get("kvcomm_errors_total", {}).items()}
        # no error of the workload's own (the counter also counts what KVCOMM retried
        # itself: an L3 call timed out on a loaded machine, which no drone saw)
        made = {t: n for t, n in made.items() if n}
        print(f"errors made on {h['host']}: {made}")
        assert {t: n for t, n in made.items() if t not in ("Unavailable", "other")} == {}
        hist = s.histograms["kvcomm_op_seconds"]
        assert sum(x.count for lab, x in hist.items() if dict(lab)["op"] == "get") > 0
        assert hist[(("op", "put"), ("tier", "l2"))].count > 0
    # and the backlog drains
    wait_for(lambda: all(parse_text(_scrape(h["metrics"])).value("kvcomm_outbound_backlog") == 0
                         for h in hosts), 30, "the outbound backlog to drain")


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


def _metered_cfg(metrics: dict[str, Any] | None = None, cache: dict[str, Any] | None = None
         ) -> kvcomm.Config:
    return kvcomm.Config.from_mapping({"cache": {**SMALL["cache"], **(cache or {})},
                                       "metrics": {"flush_interval": "60m", **(metrics or {})}})



# ------------------------------------------------------------------ exact counters


def test_forked_child_does_not_count_the_parents_errors_again(ns: str) -> None:
    """F: a forked child re-adds every error its parent made before fork() to
    kvcomm_errors_total. errors.MADE (the process's cumulative error counts) is inherited
    through fork, but agent._after_fork_in_child resets errors_before to {}, so the
    child's first flush adds the parent's whole history once more (100 ConflictErrors in
    the parent, one fork, and the region says 200). README promises "none is counted
    twice (a forked child starts afresh)"; with multiprocessing's fork start method every
    worker multiplies the parent's errors, and an alert on errors_total fires on nothing.
    (found in review 10: metrics, kvcomm top, load tests)"""
    cfg = _metered_cfg()
    kv = kvcomm.open(ns, config=cfg)
    try:
        for _ in range(100):
            errors.ConflictError("made in the parent")
        before = _snap(kv).value("kvcomm_errors_total", type="ConflictError")
        pid = os.fork()
        if pid == 0:  # the child: open, count nothing, close (a flush), leave
            code = 1
            try:
                kvcomm.open(ns, config=cfg).close()
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        after = _snap(kv).value("kvcomm_errors_total", type="ConflictError")
        assert after == before, (f"the child made no error, yet ConflictError went "
                                 f"{before:.0f} -> {after:.0f}")
    finally:
        kv.close()


def test_errors_total_is_exact_when_threads_make_errors(ns: str) -> None:
    """F: kvcomm_errors_total loses counts when threads make errors at once. KVCommError
    counts itself with ``MADE[name] = MADE.get(name, 0) + 1`` (errors.py): a read-modify-
    write with a call in the middle, where CPython may switch threads, so concurrent
    increments overwrite each other. Every other counter is exact under threads (checked:
    4 threads of get/get_item/absent get/put match exactly); this one lost 29% of 200,000
    ConflictErrors here. The issue says counters are exact; a retried compare-and-set
    storm (many agent threads on one key) is exactly when errors come from many threads.
    The switch interval is lowered only to make the race show on every run.
    (found in review 10: metrics, kvcomm top, load tests)"""
    kv = kvcomm.open(ns, config=_metered_cfg())
    n, threads = 20_000, 4
    old = sys.getswitchinterval()
    try:
        before = _snap(kv).value("kvcomm_errors_total", type="ConflictError")

        def make() -> None:
            for _ in range(n):
                errors.ConflictError("x")

        sys.setswitchinterval(1e-6)
        ts = [threading.Thread(target=make) for _ in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        sys.setswitchinterval(old)
        made = _snap(kv).value("kvcomm_errors_total", type="ConflictError") - before
        assert made == n * threads, f"{n * threads} ConflictErrors made, {made:.0f} counted"
    finally:
        sys.setswitchinterval(old)
        kv.close()


def test_a_client_dropped_without_close_keeps_its_counts(ns: str) -> None:
    """F: the counts of a client that is garbage-collected without close() are lost. Its
    Meter holds the client by a weakref and flushes nothing once it is gone (Meter.flush:
    ``client is None: return``), and Client has no finaliser that flushes. So 1,000 reads
    and a put done through ``kvcomm.open()`` in a function that returns without closing
    never reach kvcomm_reads_total / kvcomm_writes_total: up to a flush interval of counts
    with the default 1 s, and all of them with ``flush_interval: 0`` ("only when a client
    closes"). README says counts are lost only when a process is killed outright.
    (found in review 10: metrics, kvcomm top, load tests)"""
    cfg = _metered_cfg()

    def work() -> None:
        c = kvcomm.open(ns, config=cfg)
        c.put("a", 1)
        for _ in range(1000):
            c.get("a")

    work()
    gc.collect()
    agent.flush_all()
    kv = kvcomm.open(ns, config=cfg)
    try:
        s = _snap(kv)
        assert s.value("kvcomm_writes_total", kind="put") == 1
        assert s.value("kvcomm_reads_total", tier="l1") == 1000
    finally:
        kv.close()


def test_a_failing_gauge_does_not_make_the_next_flush_count_again(ns: str) -> None:
    """F: when a gauge source raises during Meter.flush, the counter deltas were already
    added to L2, but the ``except BaseException`` block rolls ``_before`` back as if
    "nothing was added", so the next flush adds the same deltas again (double counting;
    with a gauge that keeps failing, every flush re-adds them and the counters grow without
    any operation). The daemon's feed-lag gauge (metrics/node.py) is such a source. The
    gauges should be stored apart from the counters' bookkeeping (or the rollback limited
    to what was not added).
    (found in review 10: metrics, kvcomm top, load tests)"""
    kv = kvcomm.open(ns, config=_metered_cfg())
    try:
        kv.put("a", 1)
        for _ in range(10):
            kv.get("a")

        def broken() -> dict[int, int]:
            raise RuntimeError("a gauge source failed")

        kv._meter.add_gauges(broken)
        with pytest.raises(RuntimeError):
            kv._meter.flush()
        kv._meter._gauges.clear()
        s = _snap(kv)
        assert s.value("kvcomm_writes_total", kind="put") == 1
        assert s.value("kvcomm_reads_total", tier="l1") == 10
    finally:
        kv.close()


# ------------------------------------------------------------------ the exporter


_HOLD_LOCK = """
import sys, time
from kvcomm.tiers.l2 import L2Segment
seg = L2Segment(sys.argv[1], create_layout=None, host_id="")
seg._lock()
print("held", flush=True)
sys.stdin.read()
"""


def test_a_scrape_while_a_writer_holds_the_lock_still_exports_the_counters(ns: str) -> None:
    """F: every scrape (Collector.collect -> read -> seg.hot_keys) takes the L2 writer lock
    and waits up to cache.lock_timeout (10 s by default, Prometheus' whole default scrape
    timeout) for it; when a writer holds it (a process stopped or stuck inside a write)
    the scrape raises Unavailable and prometheus-client answers HTTP 500: every family is
    lost, not only the hot keys, exactly when an operator needs to see the host (the same
    makes ``kvcomm top`` exit). The counters and gauges need no lock; hot keys could be
    read without it or left out of that scrape.
    (found in review 10: metrics, kvcomm top, load tests)"""
    cfg = _metered_cfg(cache={"lock_timeout": "200ms"})
    kv = kvcomm.open(ns, config=cfg)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, ns], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    exporter = None
    try:
        kv.put("a", 1)
        for _ in range(10):
            kv.get("a")
        agent.flush_all()
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        exporter = Exporter(kv._seg, cfg, port=0)
        try:
            text = exporter.text()
        except kvcomm.KVCommError as exc:
            pytest.fail(f"the scrape failed while a writer held the lock: {exc!r}")
        # (adapted: a put does not fill the writer's L1, so the first get is an L1 miss
        # answered by L2: 9 L1 hits and 1 miss, as without a lock holder)
        assert 'kvcomm_reads_total{result="hit",tier="l1"} 9.0' in text
        assert 'kvcomm_reads_total{result="miss",tier="l1"} 1.0' in text
    finally:
        if exporter is not None:
            exporter.close()
        holder.kill()
        holder.wait()
        kv.close()


def test_read_of_a_purged_namespace_raises_even_without_hot_keys(ns: str) -> None:
    """F: collector.read documents "Raises SegmentError (purged)", but only the hot-key
    read (which takes the lock) notices a purge; with ``metrics.hot_keys: 0`` (the setting
    for keys that must not leave the host) read() and so every scrape and ``kvcomm top``
    keep serving the purged segment's frozen figures as if the namespace were alive.
    (found in review 10: metrics, kvcomm top, load tests)"""
    cfg = _metered_cfg(metrics={"hot_keys": 0})
    kv = kvcomm.open(ns, config=cfg)
    try:
        kv.put("a", 1)
        agent.flush_all()
        l2.purge(ns)
        with pytest.raises(kvcomm.SegmentError):
            read(kv._seg, cfg)
    finally:
        kv.close()


def test_kvcomm_metrics_serves_a_namespace_recreated_after_a_purge(ns: str, tmp_path: Any
                                                                    ) -> None:
    """F: ``kvcomm metrics --name NS --port P`` keeps the segment it opened at start; once
    NS is purged (``kvcomm purge``, or a layout migration) every scrape answers HTTP 500
    (SegmentError "was purged; open it again") forever, and the process stays up, so a
    supervisor never restarts it, even after the namespace is created again and agents
    use it. It should reopen the namespace (or exit non-zero so that it is restarted).
    (found in review 10: metrics, kvcomm top, load tests)"""
    cfg_file = tmp_path / "kvcomm.yaml"
    cfg_file.write_text("cache:\n  l2_size: 16MB\n  watch_buffer: 4096\n")
    # (adapted: the agents make the namespace first; ``kvcomm metrics`` no longer creates
    # one, see test_kvcomm_metrics_of_a_namespace_that_does_not_exist_says_so)
    kvcomm.open(ns, config=kvcomm.Config.from_mapping(SMALL)).close()
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    proc = subprocess.Popen([sys.executable, "-m", "kvcomm", "metrics", "--name", ns,
                             "--port", str(port), "--config", str(cfg_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def scrape() -> str:
        with urllib.request.urlopen(url, timeout=5) as r:
            return str(r.read().decode())

    try:
        wait_for(scrape, 30, "kvcomm metrics to serve", retry_on=(OSError,))
        l2.purge(ns)
        cfg = kvcomm.Config.from_mapping(SMALL)
        with kvcomm.open(ns, config=cfg) as kv:
            for k in ("a", "b", "c"):
                kv.put(k, 1)

        def new_figures() -> bool:
            if proc.poll() is not None:
                return True  # it exited: a supervisor can restart it
            try:
                text = scrape()
            except urllib.error.HTTPError as exc:
                last[0] = f"HTTP {exc.code}"
                return False
            last[0] = "; ".join(ln for ln in text.splitlines()
                                if ln.startswith("kvcomm_l2_entries"))
            return "kvcomm_l2_entries 3.0" in text

        last = [""]
        try:
            wait_for(new_figures, 10, "the exporter to show the recreated namespace "
                     "(or to exit so that it is restarted)", retry_on=(OSError,))
        except AssertionError as exc:
            raise AssertionError(f"{exc}; its last answer: {last[0]}") from None
        if proc.poll() is not None:
            assert proc.returncode != 0, "it exited 0: a supervisor would not restart it"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class _FakeStore:
    """What metrics.registry.publish uses of the daemon's DaemonL3: set_own."""

    def __init__(self) -> None:
        self.set: dict[str, bytes] = {}

    def set_own(self, name: str, data: bytes, ttl: int | None = None) -> None:
        self.set[name] = data


@pytest.fixture
def fake_daemon(ns: str) -> Iterator[Any]:
    stats = types.SimpleNamespace(extra={}, pushed=0, windows=0, pulled=0, skipped_remote=0,
                                  resyncs=0, quarantined=0, l3_errors=0)
    made: list[Any] = []

    def make(host: str) -> Any:
        cfg = _metered_cfg(metrics={"port": free_port(), "host": host})
        kv = kvcomm.open(ns, config=cfg)
        l3 = _FakeStore()
        d = types.SimpleNamespace(kv=kv, config=cfg, stats=stats, l3=l3, store=l3,
                                  host="host-1", inb=types.SimpleNamespace(seqs={}),
                                  feed_counters={})
        made.append(d)
        return d

    yield make
    for d in made:
        d.kv.close()


@pytest.mark.parametrize("listen", ["0.0.0.0", "::"])
def test_the_published_metrics_address_is_one_another_host_can_scrape(fake_daemon: Any,
                                                                       listen: str) -> None:
    """F: with ``metrics.host: 0.0.0.0`` — what README says to set "to let a Prometheus on
    another machine scrape it" — the daemon publishes ``http://0.0.0.0:P/metrics`` in the
    cluster's registry (metrics.node.attach_daemon passes the listen address to
    registry.publish), so ``kvcomm top --cluster`` on any other machine scrapes its own
    host (wrong figures, or "unreachable"). With ``::`` the URL is not even valid
    (``http://:::P/metrics``: publish does not bracket IPv6 as Exporter.url does). The
    registry needs an address others can reach (the host's name/IP, or a config key).
    (found in review 10: metrics, kvcomm top, load tests)"""
    from kvcomm.metrics.node import attach_daemon

    daemon = fake_daemon(listen)
    try:
        exporter = attach_daemon(daemon)
    except kvcomm.ConfigError as exc:  # (no IPv6 on this machine)
        pytest.skip(f"cannot listen on {listen}: {exc}")
    assert exporter is not None
    try:
        (url,) = daemon.l3.set.values()
        parsed = urllib.parse.urlsplit(url.decode())
        try:
            port = parsed.port
        except ValueError:
            pytest.fail(f"published {url.decode()!r}: not a valid URL")
        assert port == exporter.port
        assert parsed.hostname not in ("0.0.0.0", "::", None, ""), (
            f"published {url.decode()!r}: a wildcard address, not one to scrape")
    finally:
        exporter.close()


def test_a_bad_metrics_host_is_reported_as_the_host(ns: str) -> None:
    """F: an address that cannot be listened on (``--host bogus.invalid`` or a typo in
    metrics.host) is reported as ``metrics.port: cannot serve metrics on
    bogus.invalid:P (Name or service not known); choose a free port``: the error names
    the wrong key and tells the operator to change the port, which fixes nothing.
    (found in review 10: metrics, kvcomm top, load tests)"""
    kv = kvcomm.open(ns, config=_metered_cfg())
    try:
        with pytest.raises(kvcomm.ConfigError) as info:
            Exporter(kv._seg, kv.config, port=free_port(), host="bogus.invalid")
        assert info.value.key == "metrics.host", str(info.value)
        assert "free port" not in str(info.value)
    finally:
        kv.close()


def test_hot_keys_of_an_agent_that_stopped_reading_reach_the_gauge(ns: str) -> None:
    """F: the hot keys an agent sampled reach the host's sketch (and so
    kvcomm_hot_key_reads and ``kvcomm top``) only when its getter's buffer fills, at its
    next read a second later, at hot_keys() or at close: the metrics flusher, which adds
    every other count to L2 once a second, does not flush them. An agent that reads a key
    8,000 times in a burst and then waits (for input, for a tick) never shows it as hot
    while it waits; every scrape says there are no hot keys at all.
    (found in review 10: metrics, kvcomm top, load tests)"""
    cfg = _metered_cfg(metrics={"flush_interval": "100ms"})
    kv = kvcomm.open(ns, config=cfg)
    exporter = Exporter(kv._seg, cfg, port=0)
    try:
        kv.put("burst", 1)
        for _ in range(8000):
            kv.get("burst")

        def shown() -> bool:
            agent.flush_all()
            return "kvcomm_hot_key_reads{key=\"burst\"}" in exporter.text()

        wait_for(shown, 5, "the burst's key in kvcomm_hot_key_reads")
    finally:
        exporter.close()
        kv.close()


def test_reads_that_all_succeed_count_no_errors_while_a_writer_holds_the_lock(ns: str
                                                                                ) -> None:
    """F: a read's hot-key flush only *tries* the writer lock (``_lock(0.0)``) and, when it
    is busy, keeps its counts for later; but trying makes an Unavailable, and every
    KVCommError made counts itself, so kvcomm_errors_total{type="Unavailable"} grows by one
    per deferred flush (about once a second per reading process here, while every read
    succeeds and nobody sees an error). That is the series an operator alerts on for "Redis
    / the lock is unavailable"; under write contention it fills with reads that went fine.
    README lists what errors_total includes (a retried compare-and-set or L3 call); this is
    neither.
    (found in review 10: metrics, kvcomm top, load tests)"""
    from kvcomm.tiers.shm.counters import MetricsRegion, series_word

    cfg = _metered_cfg()
    kv = kvcomm.open(ns, config=cfg)
    word = series_word("errors_total{type=Unavailable}")

    def unavailable() -> int:  # (read() takes the lock for the hot keys: the region itself)
        agent.flush_all()
        return MetricsRegion(kv._seg).words()[word]

    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, ns], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        kv.put("a", 1)
        before = unavailable()
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"

        def deferred() -> bool:
            for _ in range(10_000):
                kv.get("a")
            return bool(kv._hot_pending)  # a flush found the lock held and kept its counts

        wait_for(deferred, 10, "a read's hot-key flush to find the lock held")
        after = unavailable()
        assert after == before, (f"every read succeeded, yet errors_total{{type=Unavailable}}"
                                 f" went {before} -> {after}")
    finally:
        holder.kill()
        holder.wait()
        kv.close()  # (after the holder died: close flushes the hot keys under the lock)


def test_kvcomm_metrics_of_a_namespace_that_does_not_exist_says_so(ns: str, tmp_path: Any
                                                                   ) -> None:
    """F: ``kvcomm metrics --name NS`` with a mistyped NS creates a new, empty namespace
    (a segment of cache.l2_size in /dev/shm) and serves its zeros for ever: the dashboard
    is flat, nothing says why, and the stray segment stays until purged. ``kvcomm top
    --name NS`` refuses the same typo ("no L2 segment for namespace ..."). The exporter
    should not create the namespace: refuse it (exit 2), or wait for agents to create it
    (an exporter started at boot before its agents), serving nothing meanwhile.
    (found in review 10: metrics, kvcomm top, load tests)"""
    cfg_file = tmp_path / "kvcomm.yaml"
    cfg_file.write_text("cache:\n  l2_size: 16MB\n  watch_buffer: 4096\n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvcomm", "metrics", "--name", ns,
                             "--port", str(port), "--config", str(cfg_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def serving() -> bool:  # (any answer: a 503 "no such namespace yet" is one)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5):
                return True
        except urllib.error.HTTPError:
            return True

    try:
        wait_for(lambda: proc.poll() is not None or serving(), 30,
                 "kvcomm metrics to exit or serve", retry_on=(OSError,))
        assert not os.path.exists(l2.segment_path(ns)), "it created the namespace"
        assert proc.poll() is None or proc.returncode != 0, "it exited 0"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_a_sampled_read_is_filed_under_its_own_tier_when_other_threads_read(ns: str) -> None:
    """F: the tier a sampled read's latency is filed under (Client._timed) is found by
    comparing the *client's* shared hit counters before and after the read, so when
    another thread of the process has a get_item L1 hit meanwhile (a GIL switch in the
    middle of the read: agents of one process share one client, as the load tests run
    them), an L2 read (or an L3 read of milliseconds) is filed as an L1 latency: the L1
    p99 of kvcomm_op_seconds and of ``kvcomm top`` shows L2/L3 times, and the L2 series
    misses them. Here the interleaving is made deterministic: while the timed L2 read
    decodes its value, another thread does one get_item L1 hit.
    (found in review 10: metrics, kvcomm top, load tests)"""
    cfg = _metered_cfg(metrics={"latency_sample": 1000})
    kv = kvcomm.open(ns, config=cfg)
    try:
        kv.put("hot", 1)
        kv.get_item("hot")  # now in L1
        kv.put("cold", {"a": 1})
        kv._l1_entries.pop("cold", None)  # (an L2 read, with a decode)
        agent.flush_all()
        decode = kv._decode

        def decode_while_another_thread_reads(*args: Any) -> Any:
            t = threading.Thread(target=kv.get_item, args=("hot",))
            t.start()
            t.join()
            return decode(*args)

        kv._decode = decode_while_another_thread_reads  # type: ignore[method-assign]
        before = read(kv._seg, cfg).histograms["kvcomm_op_seconds"]
        kv._lat_left = 1  # this read's turn to be timed
        item = kv.get_item("cold")
        assert item is not None and item.tier == "l2"
        del kv._decode
        after = _snap(kv).histograms["kvcomm_op_seconds"]
        got = {tier: after[(("op", "get"), ("tier", tier))].count
               - before[(("op", "get"), ("tier", tier))].count for tier in ("l1", "l2")}
        assert got == {"l1": 0, "l2": 1}, f"one timed L2 read was filed as {got}"
    finally:
        kv.close()


def test_latency_sampling_survives_threads_reading_and_writing_at_once(ns: str) -> None:
    """F: the client's latency countdown (``_lat_left``, shared by its threads) can step
    over 0: get_item checks ``_lat_left == 1`` and decrements it later on its L1 path (a
    call, hence a possible thread switch, in between), so a put in another thread that
    takes it from 2 to 1 meanwhile leaves the L1 hit taking it to 0 unchecked. From then
    on every operation decrements a negative number and none is ever timed again: the
    put / get_item / slow-read / delete / update / batch histograms of kvcomm_op_seconds
    stop for the rest of the client's life (seen without any help in 2 of 3 runs of two
    threads doing get_item and put with a 1 µs switch interval: _lat_left -33,925). The
    interleaving is made deterministic here: a put from another thread runs in the middle
    of a get_item's L1 lookup.
    (found in review 10: metrics, kvcomm top, load tests)"""
    cfg = _metered_cfg(metrics={"latency_sample": 4})
    kv = kvcomm.open(ns, config=cfg)
    entries = kv._l1_entries
    try:
        kv.put("hot", 1)
        kv.get_item("hot")  # in L1
        done: list[bool] = []

        class PutMeanwhile(dict):  # type: ignore[type-arg]
            def get(self, key: Any, default: Any = None) -> Any:
                if not done:
                    done.append(True)
                    t = threading.Thread(target=kv.put, args=("other", 1))
                    t.start()
                    t.join()
                return super().get(key, default)

        kv._l1_entries = PutMeanwhile(entries)
        kv._lat_left = 2
        assert kv.get_item("hot") is not None and done
        kv._l1_entries = entries

        def puts_timed() -> int:
            return _snap(kv).histograms["kvcomm_op_seconds"][(("op", "put"), ("tier", "l2"))].count

        before = puts_timed()
        for i in range(4000):
            kv.put(f"k{i % 10}", i)
        timed = puts_timed() - before
        assert timed >= 900, (f"{timed} of 4,000 puts timed at 1 in 4 (the countdown is at "
                              f"{kv._lat_left})")
    finally:
        kv._l1_entries = entries
        kv.close()


def test_hot_keys_read_equally_often_are_all_shown_with_their_reads(ns: str) -> None:
    """F: kvcomm_hot_key_reads (and ``kvcomm top``'s hot keys) alias with the pattern of
    the reads: the getter samples every ``cache.hot_key_sample``-th read (16) by a fixed
    countdown, so an agent that reads 4 keys in turn (8 neighbours per tick, as the swarm
    does, is the same) has every sampled read land on the same key: one key is reported
    at 8,000 reads (4 times its own) and the other three, read as often, not at all. With
    a period that shares a factor with 16 (6 keys: 2) half the keys vanish and the others
    double. An operator looking for the host's hot keys is shown the wrong ones; a random
    sampling (a random skip between samples) has no such alias.
    (found in review 10: metrics, kvcomm top, load tests)"""
    kv = kvcomm.open(ns, config=_metered_cfg())
    try:
        keys = [f"neighbour/{i}" for i in range(4)]
        for k in keys:
            kv.put(k, 1)
        for _ in range(2000):
            for k in keys:
                kv.get(k)
        hot = dict(kv.hot_keys(10))
        assert set(keys) <= set(hot), f"read 2,000 times each, the hot keys say {hot}"
        for k in keys:
            assert 1000 <= hot[k] <= 3000, f"{k} read 2,000 times, estimated {hot[k]}: {hot}"
    finally:
        kv.close()


def test_a_latency_series_new_while_a_close_counts_does_not_stop_the_close(
        config: kvcomm.Config, ns: str) -> None:
    """Closing counts the client's latency series while another thread's write may add the
    first of a new one: the count (a snapshot) takes it or not, and the close completes.
    (It raised RuntimeError "dictionary changed size during iteration" and left the client
    open.) The other thread is stood for by a series whose counts add one when read."""
    kv = kvcomm.open(ns, config=config)
    kv._note_latency("put", "l2", 1000)  # (a series sampled: latencies are one in N)
    real = kv._lat["put", "l2"]

    class Adding:  # (read in the count's loop: a write of another thread gets in there)
        @property
        def counts(self) -> Any:
            kv._lat.setdefault(("delete", "l2"), real)
            return real.counts

    kv._lat[("batch", "l2")] = Adding()  # type: ignore[assignment]
    kv.close()
    assert kv._closed
    with pytest.raises(kvcomm.SegmentError, match="closed"):
        kv.put("k", b"again")
