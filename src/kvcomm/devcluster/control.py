"""``kvcomm dev-cluster up|down``: a whole local cluster for people, tests and benchmarks.

``up --hosts N --dir DIR`` starts a Redis Cluster (3 masters + 3 replicas on free
loopback ports) and one ``kvcomm node`` daemon per host, each host being a host id plus
an L2 namespace on this machine; writes ``DIR/host-1.yaml`` … ``DIR/host-N.yaml`` (the
config an agent of that host passes to ``kvcomm.open(config=...)``) and
``DIR/cluster.json`` (what ``down`` needs); and returns once every daemon heartbeats.
``down --dir DIR`` stops all of it and removes the hosts' L2 segments.

For fault injection (tests, soaks): :func:`restart_daemon`, :func:`kill_redis` and
:func:`restart_redis`, which brings a killed Redis node back on its port and waits until
the cluster is whole again (every slot served, every master with its replicas in sync).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import xxhash
import yaml

from ..errors import KVCommError, SegmentError, Unavailable
from ..testing.cluster import RedisCluster, node_argv, wait_failed_over, wait_whole
from ..tiers.l2 import L2Segment, purge


def up(hosts: int, directory: str, l2_size: str = "64MB", sync_interval: str = "50ms",
       feed_poll: str = "20ms", timeout: float = 60.0,
       resolvers: dict[str, str] | None = None,
       watch_buffer: int | None = None) -> dict[str, Any]:
    d = Path(directory).resolve()
    d.mkdir(parents=True, exist_ok=True)
    state_file = d / "cluster.json"
    if state_file.exists():
        raise KVCommError(
            f"a dev cluster is already up in {d}; run `kvcomm dev-cluster down --dir {d}`")
    if not 1 <= hosts <= 32:
        raise KVCommError("--hosts must be between 1 and 32")
    cluster = RedisCluster(directory=str(d / "redis"), detached=True).start(timeout)
    tag = f"{xxhash.xxh32_intdigest(str(d).encode()) % 10**6:06d}"  # unique per directory
    state: dict[str, Any] = {"redis_pids": cluster.pids,
                             "redis": [f"127.0.0.1:{p}" for p in cluster.ports], "hosts": [],
                             "redis_dir": cluster.dir, "replicas": cluster.replicas,
                             "node_timeout_ms": cluster.node_timeout_ms}
    state_file.write_text(json.dumps(state, indent=2))  # from here on, `down` can clean up
    try:
        for i in range(1, hosts + 1):
            host = f"host-{i}"
            ns = f"dev{tag}-{host}"
            cache: dict[str, Any] = {"l2_size": l2_size, "l2_sync_interval": sync_interval}
            if watch_buffer is not None:  # a small feed ring: the soak overflows it on purpose
                cache["watch_buffer"] = watch_buffer
            cfg = {"node": {"host_id": host, "namespace": ns}, "cache": cache,
                   "cluster": {"redis": state["redis"], "feed_poll": feed_poll,
                               "resolvers": resolvers or {}}}
            path = d / f"{host}.yaml"
            path.write_text(yaml.safe_dump(cfg, sort_keys=False))
            purge(ns)
            state["hosts"].append({"host": host, "namespace": ns, "config": str(path),
                                   "pid": _spawn_daemon(d, host, path)})
        state_file.write_text(json.dumps(state, indent=2))
        deadline = time.monotonic() + timeout
        for h in state["hosts"]:
            while not _daemon_alive(h["namespace"]):
                if time.monotonic() > deadline:
                    raise Unavailable(
                        f"the node daemon of {h['host']} did not start; see {d}/{h['host']}.log")
                time.sleep(0.05)
    except BaseException:
        down(str(d))
        raise
    return state


def _spawn_daemon(d: Path, host: str, config: Path) -> int:
    with open(d / f"{host}.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvcomm", "node", "--config", str(config)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc.pid


def restart_daemon(directory: str, index: int, timeout: float = 30.0) -> int:
    """Start host ``index``'s daemon again (after a crash, say); returns its pid."""
    d = Path(directory).resolve()
    state = json.loads((d / "cluster.json").read_text())
    h = state["hosts"][index]
    _stop([h["pid"]])
    h["pid"] = _spawn_daemon(d, h["host"], Path(h["config"]))
    (d / "cluster.json").write_text(json.dumps(state, indent=2))
    deadline = time.monotonic() + timeout
    while not _daemon_alive(h["namespace"]):
        if time.monotonic() > deadline:
            raise Unavailable(
                f"the node daemon of {h['host']} did not start; see {d}/{h['host']}.log")
        time.sleep(0.05)
    return int(h["pid"])


def _redis_index(state: dict[str, Any], port: int) -> int:
    try:
        return [int(a.rpartition(":")[2]) for a in state["redis"]].index(port)
    except ValueError:
        raise KVCommError(f"no Redis node on port {port} in this dev cluster") from None


def kill_redis(directory: str, port: int) -> None:
    """SIGKILL the Redis node on ``port`` (a crash: its replica takes over after the
    node timeout). Returns once the process is gone."""
    d = Path(directory).resolve()
    state = json.loads((d / "cluster.json").read_text())
    pid = int(state["redis_pids"][_redis_index(state, port)])
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    _stop([pid])  # (reaps it when it is our child; waits for it to be gone otherwise)


def restart_redis(directory: str, port: int, timeout: float = 60.0) -> int:
    """Start the killed Redis node on ``port`` again and wait until the cluster is whole:
    every node agrees every slot is served and every master has its replicas online and
    caught up. Returns the node's new pid; raises Unavailable if it does not heal."""
    d = Path(directory).resolve()
    state = json.loads((d / "cluster.json").read_text())
    i = _redis_index(state, port)
    if _pid_running(int(state["redis_pids"][i])):
        raise KVCommError(f"the Redis node on port {port} is still running: kill it first")
    ports = [int(a.rpartition(":")[2]) for a in state["redis"]]
    wait_failed_over(ports, port, timeout)  # (restarted before that, a master comes back empty)
    node_dir = str(Path(state.get("redis_dir", d / "redis")) / str(port))
    proc = subprocess.Popen(node_argv(port, node_dir, int(state.get("node_timeout_ms", 2000))),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    state["redis_pids"][i] = proc.pid
    (d / "cluster.json").write_text(json.dumps(state, indent=2))
    wait_whole(ports, int(state.get("replicas", 1)), timeout)
    return proc.pid


def wait_redis_whole(directory: str, timeout: float = 60.0) -> None:
    """Until the dev cluster's Redis Cluster is whole (see :func:`restart_redis`)."""
    state = json.loads((Path(directory).resolve() / "cluster.json").read_text())
    wait_whole([int(a.rpartition(":")[2]) for a in state["redis"]],
               int(state.get("replicas", 1)), timeout)


def _pid_running(pid: int) -> bool:
    try:
        if os.waitpid(pid, os.WNOHANG)[0]:
            return False  # our child, just reaped
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _daemon_alive(namespace: str) -> bool:
    try:
        seg = L2Segment(namespace, create_layout=None, host_id="", attach_timeout=0)
    except SegmentError:
        return False
    try:
        return seg.daemon_alive()
    finally:
        seg.close()


def _stop(pids: list[int], timeout: float = 10.0) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
            except ChildProcessError:
                pass
            time.sleep(0.02)
        else:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def down(directory: str) -> bool:
    d = Path(directory).resolve()
    state_file = d / "cluster.json"
    if not state_file.exists():
        return False
    state = json.loads(state_file.read_text())
    _stop([h["pid"] for h in state["hosts"]])
    _stop(state["redis_pids"])
    for h in state["hosts"]:
        purge(h["namespace"])
    state_file.unlink()
    return True
