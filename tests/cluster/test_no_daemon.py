"""An agent on a host with no node daemon, and a daemon that dies while agents run.

``kvcomm.open()`` in cluster mode waits up to ``cluster.daemon_wait`` for the host's
daemon to heartbeat, then raises Unavailable naming the command that starts it;
``wait_daemon=False`` opens without one. A daemon that dies leaves the agents' writes
acknowledged into L2 (one KVCommWarning says so; the metrics, ``kvcomm info`` and
``kvcomm cluster status`` show them waiting, and since when), and a daemon started
again delivers every one of them: a real ``kvcomm node`` killed with SIGKILL (or stopped
with SIGTERM) and restarted, on a real dev cluster.

The first tests need no server: the daemon's heartbeat in L2 is beaten by the test
itself (what a daemon does every round of its loop), on a cluster config whose Redis
is nowhere (they never reach L3).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

import kvcomm
from kvcomm._client.attach import _Shared
from kvcomm.devcluster.procs import running
from kvcomm.metrics import collector
from kvcomm.tiers import l2
from kvcomm.tiers.shm.layout import H
from tests.support.devcluster import (
    dev_cluster_fixture,
    host,
    kill_daemon,
    l3,
    live_record,
    restart_daemon,
)
from tests.support.helpers import wait_for


def _mapping(ns: str, **cluster: Any) -> dict[str, Any]:
    """A cluster-mode config whose Redis is nowhere (refused at once) and without etcd."""
    return {"node": {"host_id": "lonely", "namespace": ns},
            "cache": {"l2_size": "4MB", "watch_buffer": 256},
            "cluster": {"redis": ["127.0.0.1:1"], "timeout": 0.2, **cluster}}


def _config(ns: str, **cluster: Any) -> kvcomm.Config:
    return kvcomm.Config.from_mapping(_mapping(ns, **cluster))


@contextmanager
def _beating(seg: Any, after: float = 0.0) -> Iterator[threading.Event]:
    """Beat ``seg``'s daemon heartbeat every 50 ms (as a daemon's loop does), from
    ``after`` seconds on, until the block ends or the returned event is set."""
    stop = threading.Event()

    def beat() -> None:
        stop.wait(after)
        while not stop.is_set():
            seg.daemon_heartbeat(os.getpid())
            stop.wait(0.05)

    t = threading.Thread(target=beat, daemon=True)
    t.start()
    try:
        yield stop
    finally:
        stop.set()
        t.join(5)


def _silence(seg: Any, stop: threading.Event) -> None:
    """The beating daemon dies: its last heartbeat 10 s ago."""
    stop.set()
    time.sleep(0.06)  # (a beat under way lands before the heartbeat is aged)
    seg._q[H["DAEMON_BEAT"]] = time.time_ns() // 1_000_000 - 10_000


def _daemon_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, kvcomm.KVCommWarning)
            and "does not heartbeat" in str(w.message)]


# ---------------------------------------------------------------- without servers


def test_open_without_a_daemon_raises_unavailable_naming_the_command(
        ns: str, tmp_path: Path) -> None:
    path = tmp_path / "host.yaml"
    path.write_text(yaml.safe_dump(_mapping(ns, daemon_wait="300ms")))
    t0 = time.monotonic()
    try:
        with pytest.raises(kvcomm.Unavailable) as err:
            kvcomm.open(config=path)
        waited = time.monotonic() - t0
        msg = str(err.value)
        print(msg)
        assert f"`kvcomm node --config {path}`" in msg, msg
        assert "cluster.daemon_wait" in msg and "wait_daemon=False" in msg, msg
        assert "no node daemon" in msg and repr(ns) in msg, msg
        assert waited >= 0.3, waited  # it waited daemon_wait (a lower bound)
        assert ns not in _Shared.attached  # a refused open leaves nothing open
        # another namespace than the config's: the command names it
        with pytest.raises(kvcomm.Unavailable, match=f"--config {path} --name {ns}-b`"):
            kvcomm.open(f"{ns}-b", config=path)
    finally:
        l2.purge(f"{ns}-b")


def test_an_agent_beside_a_daemon_that_cannot_start_is_told_it_runs_and_why(
        ns: str, tmp_path: Path) -> None:
    """A node daemon started before its cluster is up (or with a wrong cluster.redis)
    runs and retries: an agent that waits for it is told that it runs but cannot reach
    L3, its pid and why, not that none runs ("start it": it is started). Its word is
    no started daemon's to anything that reads the status file. Stopped before it
    started, it leaves no word behind."""
    from kvcomm.node.presence import read_status, starting_status, status_fresh, status_path

    path = tmp_path / "host.yaml"
    path.write_text(yaml.safe_dump(_mapping(ns, daemon_wait="500ms")))
    status = status_path(ns, kvcomm.Config.from_mapping(_mapping(ns)).cache.l2_dir)
    proc = subprocess.Popen([sys.executable, "-m", "kvcomm", "node", "--config", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: "cannot reach L3" in str((starting_status(status) or {}).get(
            "starting")), 60, "the daemon's word that it cannot start yet, and why")
        assert not status_fresh(read_status(status))
        with pytest.raises(kvcomm.Unavailable) as err:
            kvcomm.open(config=path)
        msg = str(err.value)
        print(msg)
        assert "runs but has not started" in msg and f"pid {proc.pid} " in msg, msg
        assert "cannot reach L3" in msg and "cluster.redis" in msg, msg
        assert "Start it" not in msg, msg
        out = _kvcomm("info", "--config", str(path))  # (the operator's view: the same)
        assert out.returncode == 0, out.stderr
        assert f"node daemon    runs, not started: pid {proc.pid} has been starting" \
            in out.stdout and "cannot reach L3" in out.stdout \
            and "no node daemon" not in out.stdout, out.stdout
    finally:
        proc.terminate()
        _out, err_text = proc.communicate(timeout=30)
        l2.purge(ns)
    assert proc.returncode == 0, err_text
    assert "cannot start yet" in err_text, err_text
    assert read_status(status) is None  # (stopped before it started: no word left)


def test_a_daemon_stopped_during_a_try_to_start_exits_at_once(ns: str, tmp_path: Path) -> None:
    """A cluster that does not answer (a seed that takes connections and never replies)
    makes one try to start last cluster.timeout on each seed; SIGTERM in the middle of
    it ends the daemon at once, not when the try gives up."""
    from kvcomm.node.presence import starting_status, status_path

    mute = socket.socket()  # (listens and never accepts: a connection waits for a reply)
    mute.bind(("127.0.0.1", 0))
    mute.listen(64)
    timeout = 20.0  # (one try: at least this long)
    mapping = _mapping(ns)
    mapping["cluster"].update(redis=[f"127.0.0.1:{mute.getsockname()[1]}"], timeout=timeout)
    path = tmp_path / "host.yaml"
    path.write_text(yaml.safe_dump(mapping))
    status = status_path(ns, kvcomm.Config.from_mapping(mapping).cache.l2_dir)
    proc = subprocess.Popen([sys.executable, "-m", "kvcomm", "node", "--config", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: "first try" in str((starting_status(status) or {}).get("starting")),
                 60, "the daemon's word that its first try goes on")
        t0 = time.monotonic()
        proc.terminate()
        _out, err_text = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
        mute.close()
        l2.purge(ns)
    print(f"stopped {took:.2f} s after SIGTERM, in a try of at least {timeout:g} s")
    assert proc.returncode == 0, err_text
    assert "cannot start yet" not in err_text, err_text  # (still in its first try)
    assert took < timeout / 2, f"the daemon took {took:.1f} s to stop: it finished its try"


def test_a_daemon_that_cannot_start_never_talks_over_a_started_one(
        ns: str, tmp_path: Path) -> None:
    """Two daemons of one namespace on one host, one started (its status written by the
    test, fresh, in partition mode) and one that cannot start: the starting one never
    replaces the started one's status (the agents would lose its partition mode), nor
    removes it when stopped."""
    from kvcomm.node.presence import read_status, starting_status, status_path, write_status

    path = tmp_path / "host.yaml"
    path.write_text(yaml.safe_dump(_mapping(ns)))
    status = status_path(ns, kvcomm.Config.from_mapping(_mapping(ns)).cache.l2_dir)
    proc = subprocess.Popen([sys.executable, "-m", "kvcomm", "node", "--config", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = {"pid": os.getpid(), "partition": True, "partition_reason": "the test's"}
    try:
        wait_for(lambda: starting_status(status) is not None, 60,
                 "the daemon's word that it cannot start yet")
        write_status(status, {**started, "updated": time.time()})
        time.sleep(1.2)  # (a write of its word under way when ours landed: done by now)
        for _ in range(12):  # (its word, every second, would land within these 2.4 s)
            write_status(status, {**started, "updated": time.time()})
            time.sleep(0.2)
            st = read_status(status)
            assert st is not None and st.get("partition") and "starting" not in st, st
    finally:
        proc.terminate()
        proc.wait(30)
        st = read_status(status)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(status)
        l2.purge(ns)
    assert proc.returncode == 0
    assert st is not None and st.get("pid") == os.getpid(), st  # (not its to remove)


def test_a_daemons_word_is_said_while_its_first_try_to_start_still_waits(ns: str) -> None:
    """One try to start may wait cluster.timeout on every seed (a cluster that does not
    answer): the word is said from a thread from the start, kept fresh every second, and
    removed when the daemon stops before it started (kept when it started: its own
    status replaces it)."""
    from kvcomm.node.daemon import _StartingWord
    from kvcomm.node.presence import STATUS_FRESH_S, read_status, starting_status, status_path

    cfg = _config(ns)
    status = status_path(ns, cfg.cache.l2_dir)
    word = _StartingWord(cfg, None)
    try:
        wait_for(lambda: starting_status(status) is not None, 10, "the word")
        first = starting_status(status)
        assert first is not None and "first try" in first["starting"], first
        t0 = time.time()  # (a try that outlasts the word's freshness: it stays fresh)
        wait_for(lambda: time.time() > t0 + STATUS_FRESH_S + 0.5, 10, "the clock to move")
        assert starting_status(status) is not None
    finally:
        word.close(started=False)
    assert read_status(status) is None
    word = _StartingWord(cfg, None)
    wait_for(lambda: starting_status(status) is not None, 10, "the word")
    word.close(started=True)
    try:
        assert read_status(status) is not None  # (the started daemon's status replaces it)
    finally:
        os.unlink(status)


@pytest.mark.parametrize("since", [10**400, float("nan"), True, "x", None, -1.0])
def test_a_starting_word_with_junk_is_read_without_raising(ns: str, since: Any) -> None:
    """The status file is advisory: whatever another process wrote as a starting daemon's
    word makes a message, never an exception, and never a started daemon's status."""
    from kvcomm.node.presence import StatusReader, status_path, write_status

    kv = kvcomm.open(ns, config=_config(ns), wait_daemon=False)
    try:
        path = status_path(ns, kv.config.cache.l2_dir)
        with open(path, "w") as f:  # (json writes NaN and a 400-digit int as they are)
            json.dump({"starting": "why\x00" * 200, "since": since, "pid": [1],
                       "updated": time.time()}, f)
        said = kv._daemon_starting()
        assert "pid unknown has been starting" in said and len(said) < 600, said
        assert all(c.isprintable() for c in said), said
        assert StatusReader(path).status() is None and not kv._daemon_beats()
        write_status(path, {"partition": True, "updated": time.time()})
        assert kv._daemon_starting() == "" and StatusReader(path).status() is not None
    finally:
        kv.close()
        os.unlink(path)
        l2.purge(ns)


def test_wait_daemon_false_opens_and_open_waits_for_a_daemon_that_starts(ns: str) -> None:
    cfg = _config(ns, daemon_wait=60)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tool = kvcomm.open(ns, config=cfg, wait_daemon=False)  # no daemon: opens at once
        try:
            tool.put("k", 1)
            assert tool.get("k") == 1 and not tool._seg.daemon_alive()
            # a daemon that starts while an agent waits: open returns once it beats
            with _beating(tool._seg, after=0.3):
                kv = kvcomm.open(ns, config=cfg)
                assert kv._seg.daemon_alive()
                kv.put("k", 2)
                kv.close()
            for i in range(20):  # a tool writes without a daemon: never warned
                tool.put(f"t/{i}", i)
        finally:
            tool.close()
    assert not _daemon_warnings(caught), _daemon_warnings(caught)


def test_a_daemon_that_stops_beating_is_warned_of_once_and_again_after_a_restart(
        ns: str) -> None:
    cfg = _config(ns, daemon_wait=10)
    tool = kvcomm.open(ns, config=cfg, wait_daemon=False)
    try:
        with _beating(tool._seg) as stop:
            kv = kvcomm.open(ns, config=cfg)
            kv.put("before", 0)
            _silence(tool._seg, stop)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            n = 0

            def write() -> bool:
                nonlocal n
                kv.put(f"w/{n}", n)  # (acknowledged: into L2)
                n += 1
                return bool(_daemon_warnings(caught))

            wait_for(write, 10, "the warning")  # (a write checks at most once a second)
            for i in range(50):
                kv.put(f"more/{i}", i)
            with kv.batch() as b:
                b.put("batched", 1)
            kv._daemon_check_ms = 0  # (the next write checks again: still one warning)
            kv.put("again", 1)
            said = _daemon_warnings(caught)
            assert len(said) == 1, said
            print(said[0])
            assert "writes are still acknowledged into L2" in said[0], said[0]
            assert "kvcomm node --config" in said[0] and "outbound_max" in said[0], said[0]
            assert kv.get("more/49") == 49 and kv._seg.dirty_count >= n + 52
            # a daemon beats again: the next death is said again
            with _beating(tool._seg) as stop:
                kv._daemon_check_ms = 0
                kv.put("beating", 1)
                _silence(tool._seg, stop)
            kv._daemon_check_ms = 0
            kv.put("dead again", 1)
            assert len(_daemon_warnings(caught)) == 2, _daemon_warnings(caught)
        kv.close()
    finally:
        tool.close()


def test_info_says_no_node_daemon_and_the_writes_waiting(ns: str, tmp_path: Path) -> None:
    path = tmp_path / "host.yaml"
    path.write_text(yaml.safe_dump(_mapping(ns)))
    with kvcomm.open(ns, config=path, wait_daemon=False) as kv:
        for i in range(7):
            kv.put(f"k/{i}", i)
        out = _kvcomm("info", "--config", str(path))
        assert out.returncode == 0, out.stderr
        print(out.stdout)
        assert "no node daemon: 7 writes waiting for L3 (none has run on this namespace); " \
               f"start it: kvcomm node --config {path}" in out.stdout, out.stdout
        with _beating(kv._seg):  # a daemon beats: no such line
            out = _kvcomm("info", "--config", str(path))
            assert "no node daemon" not in out.stdout, out.stdout
        kv._seg._q[H["DAEMON_BEAT"]] = time.time_ns() // 1_000_000 - 60_000
        out = _kvcomm("info", "--config", str(path))
        assert "no node daemon: 7 writes waiting for L3 (the last daemon's last heartbeat: " \
               in out.stdout and "s ago)" in out.stdout, out.stdout


def _kvcomm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvcomm", *args], capture_output=True,
                          text=True, timeout=120)


# ---------------------------------------------------------------- a real dev cluster

dev = dev_cluster_fixture(2, dirname="nodaemon", cluster_settings={"lease_ttl": 2})


def _status(dev: dict[str, Any], i: int) -> dict[str, dict[str, Any]]:
    """``kvcomm cluster status --json`` run with host ``i``'s config, by host."""
    out = _kvcomm("cluster", "status", "--config", dev["hosts"][i]["config"], "--json")
    assert out.returncode == 0, out.stderr
    return {h["host"]: h for h in json.loads(out.stdout)["hosts"]}


@pytest.fixture
def daemons_back(dev: dict[str, Any]) -> Iterator[None]:
    """Every daemon of ``dev`` runs again after the test."""
    yield
    for i, h in enumerate(dev["hosts"]):
        if not running(int(h["pid"])):
            restart_daemon(dev, i)


@pytest.mark.redis
@pytest.mark.etcd
def test_a_killed_daemons_writes_wait_in_l2_and_arrive_after_a_restart(
        dev: dict[str, Any], daemons_back: None) -> None:
    a, b = host(dev, 0), host(dev, 1)
    store = l3(dev)
    keys = [f"nd/{uuid.uuid4().hex[:8]}/{i}" for i in range(100)]
    try:
        pid = int(dev["hosts"][0]["pid"])
        kill_daemon(dev, 0)
        wait_for(lambda: not running(pid), 10, "the daemon to die")
        # (its L2 heartbeat is 2 s old at most, its status file 3 s: then it is gone)
        wait_for(lambda: not a._daemon_beats(), 10, "host-1's daemon to be seen gone")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i, k in enumerate(keys):
                a.put(k, i)  # acknowledged into L2
            said = _daemon_warnings(caught)
        assert len(said) == 1, said  # once, not per write
        print(said[0])
        assert a._seg.dirty_count == len(keys)
        assert all(live_record(store, k) is None for k in keys[:10])  # not in L3
        # the metrics say so
        snap = collector.read(a._seg, a.config)
        assert snap.value("kvcomm_daemon_up") == 0
        assert snap.value("kvcomm_outbound_backlog") == len(keys)
        # kvcomm info says so
        info = _kvcomm("info", "--config", dev["hosts"][0]["config"])
        print(info.stdout)
        assert f"no node daemon: {len(keys)} writes waiting for L3" in info.stdout, info.stdout
        # kvcomm cluster status, run on the host: the backlog its L2 holds, and since when
        st = _status(dev, 0)["host-1"]
        print(st)
        beat = a._seg.daemon_last_beat_ms() / 1000
        assert st["daemon"] == "gone" and st["backlog"] == len(keys), st
        assert st["backlog_known"] and st["backlog_source"] == "l2", st
        assert abs(st["daemon_gone_since"] - beat) < 0.01, (st, beat)
        restart_daemon(dev, 0)
        # everything waiting arrives: in L3, and on the other host
        wait_for(lambda: all(live_record(store, k) is not None for k in keys), 30,
                 "every waiting write in L3")
        for i, k in enumerate(keys):
            assert wait_for(lambda k=k, i=i: b.get(k) == i, 10, f"{k} on host-2"), k
        wait_for(lambda: a._seg.dirty_count == 0, 30, "host-1's backlog sent")
        assert _status(dev, 0)["host-1"]["daemon"] == "running"
    finally:
        a.close()
        b.close()
        store.close()


@pytest.mark.redis
@pytest.mark.etcd
def test_cluster_status_of_a_stopped_daemon_says_what_is_known_and_since_when(
        dev: dict[str, Any], daemons_back: None) -> None:
    """A daemon stopped by SIGTERM published "stopped, backlog 0"; 100 writes made on its
    host since wait in its L2. Run on that host, ``cluster status`` counts them (its L2);
    run on another host, it says the backlog is the stopped daemon's last report, and
    when that was."""
    a, b = host(dev, 0), host(dev, 1)
    store = l3(dev)
    keys = [f"ns/{uuid.uuid4().hex[:8]}/{i}" for i in range(100)]
    try:
        pid = int(dev["hosts"][0]["pid"])
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not running(pid), 30, "the daemon to exit")
        stopped_at = time.time()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (said once: the test above checks it)
            for i, k in enumerate(keys):
                a.put(k, i)
        here, there = _status(dev, 0)["host-1"], _status(dev, 1)["host-1"]
        print(here, there, sep="\n")
        assert here["lease"] == there["lease"] == "stopped", (here, there)
        assert here["backlog"] == len(keys) and here["backlog_known"], here
        assert here["daemon"] == "gone" and here["daemon_gone_since"] <= stopped_at, here
        assert there["daemon"] == "gone" and not there["backlog_known"], there
        assert there["backlog"] == 0 and there["backlog_source"] == "etcd", there
        assert there["daemon_gone_since"] <= stopped_at, there  # (its last report)
        table = _kvcomm("cluster", "status", "--config", dev["hosts"][0]["config"]).stdout
        print(table)
        assert "no node daemon since " in table and \
            f"{len(keys)} writes waiting for L3 in this host's L2" in table, table
        table = _kvcomm("cluster", "status", "--config", dev["hosts"][1]["config"]).stdout
        print(table)
        row = next(ln for ln in table.splitlines() if ln.startswith("host-1 "))
        assert "stopped" in row and " 0? " in row, row
        assert "backlog 0 is its last report to etcd" in table, table
        # the other host is running: no note for it
        assert _status(dev, 1)["host-2"]["daemon"] == "running"
        restart_daemon(dev, 0)
        wait_for(lambda: all(live_record(store, k) is not None for k in keys), 30,
                 "every waiting write in L3")
        wait_for(lambda: _status(dev, 1)["host-1"]["daemon"] == "running", 30,
                 "host-1's daemon seen running again")
    finally:
        a.close()
        b.close()
        store.close()
