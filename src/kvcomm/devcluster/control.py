"""``kvcomm dev-cluster up|down``: a whole local cluster, and the levers faults pull on it.

``up(hosts, directory)`` starts a Redis Cluster (3 masters + 3 replicas on free
loopback ports) and one ``kvcomm node`` daemon per host, each host being a host id plus
an L2 namespace on this machine; writes ``DIR/host-1.yaml`` … ``DIR/host-N.yaml`` (the
config an agent of that host passes to ``kvcomm.open(config=...)``, with the host's own
``metrics.port``: its daemon serves the host's metrics there) and
``DIR/cluster.json`` (its state: what ``down`` and the fault tools read); and returns
once every daemon heartbeats. ``down(directory)`` stops all of it and removes the
hosts' L2 segments.

For fault injection (tests, soaks): :func:`restart_daemon`, :func:`kill_redis` and
:func:`restart_redis`, which brings a killed Redis node back on its port and waits until
the cluster is whole again (every slot served, every master with its replicas in sync);
:func:`kill_etcd` (a member or the leader), :func:`pause_etcd` and :func:`restart_etcd`;
with ``up(proxies=True)``, :func:`partition`, :func:`drop_connections` and :func:`heal`
through each host's fault proxy; :func:`set_clock_offset` (test only). Each keeps
``cluster.json`` current, so ``down`` still stops everything.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import xxhash
import yaml

from .._extras import require_cluster
from .._wait import wait_until
from ..clock import write_clock_offset
from ..config import CacheConfig
from ..errors import KVCommError, SegmentError, Unavailable
from ..tiers.l2 import L2Segment, purge
from .etcd_cluster import EtcdCluster, etcd_path, member_argv, stop_members
from .etcd_cluster import wait_healthy as wait_etcd_healthy
from .procs import all_stopped, kill, proc_state, running, running_as, spawn, stop, wait_exiting
from .redis_cluster import RedisCluster, node_argv, wait_failed_over, wait_whole
from .redis_server import free_port

STATE_FILE = "cluster.json"


def load_state(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The state of the dev cluster in ``directory`` (its ``cluster.json``): ``redis``
    (host:port list), ``redis_pids``, ``hosts`` (host, namespace, config, pid) and how the
    Redis nodes were started. Raises Unavailable when there is none."""
    d = Path(directory).resolve()
    try:
        return json.loads((d / STATE_FILE).read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError) as exc:
        raise Unavailable(f"no dev cluster in {d} ({exc}); "
                          "start one with `kvcomm dev-cluster up --dir DIR`") from None


def save_state(directory: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Replace ``cluster.json`` in ``directory`` at once (a reader never sees half of it)."""
    path = Path(directory).resolve() / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(path)


def redis_ports(state: dict[str, Any]) -> list[int]:
    """The client ports of the Redis Cluster's nodes, in the order of ``redis_pids``."""
    return [int(a.rpartition(":")[2]) for a in state["redis"]]


def up(hosts: int, directory: str, l2_size: str = "64MB", sync_interval: str = "50ms",
       feed_poll: str = "20ms", timeout: float = 60.0,
       resolvers: dict[str, str] | None = None,
       watch_buffer: int | None = None, strong_prefixes: Sequence[str] = (),
       proxies: bool = False, groups: int | None = None,
       cluster_settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """Start a dev cluster of ``hosts`` hosts in ``directory``; returns its state (see
    :func:`load_state`) once every daemon heartbeats.

    Besides the Redis Cluster, a 3-member etcd cluster (data on tmpfs) whose members go
    into every host's ``cluster.etcd``; ``strong_prefixes`` into every host's
    ``cache.strong_prefixes``. With ``proxies``, each host reaches Redis and etcd
    through its own fault proxy (:mod:`kvcomm.faults.proxy`; its config's
    ``cluster.address_remap``), which :func:`partition`, :func:`heal` and
    :func:`drop_connections` drive. Every host's ``node.test_clock_offset_file`` is
    ``DIR/clock/host-N`` (:func:`set_clock_offset`).

    ``l2_size``, ``sync_interval`` (``cache.l2_sync_interval``), ``feed_poll``,
    ``resolvers``, ``watch_buffer`` and ``groups`` (``cluster.groups``) go into every
    host's config, and ``cluster_settings`` (more ``cluster.*`` settings: ``timeout``,
    ``lease_ttl``, ``outbound_max``...) too. Raises KVCommError
    when a dev cluster is already up there or ``hosts`` is not 1 to 32, ConfigError when
    redis-py is not installed or a strong prefix is invalid, Unavailable when a server
    or daemon does not start (everything started is stopped again).
    """
    if not 1 <= hosts <= 32:
        raise KVCommError("--hosts must be between 1 and 32")
    require_cluster("the dev cluster's node daemons")
    CacheConfig(strong_prefixes=list(strong_prefixes))  # a bad prefix: ConfigError, nothing started
    d = Path(directory).resolve()
    d.mkdir(parents=True, exist_ok=True)
    if (d / STATE_FILE).exists():
        raise KVCommError(
            f"a dev cluster is already up in {d}; run `kvcomm dev-cluster down --dir {d}`")
    if etcd_path() is None:
        raise Unavailable("etcd is not installed (Debian: apt-get install etcd-server)")
    cluster = RedisCluster(directory=str(d / "redis"), detached=True).start(timeout)
    tag = f"{xxhash.xxh32_intdigest(str(d).encode()) % 10**6:06d}"  # unique per directory
    state: dict[str, Any] = {"redis_pids": cluster.pids,
                             "redis": [f"127.0.0.1:{p}" for p in cluster.ports], "hosts": [],
                             "redis_dir": cluster.dir, "replicas": cluster.replicas,
                             "node_timeout_ms": cluster.node_timeout_ms}
    save_state(d, state)  # from here on, `down` can clean up
    try:
        etcd = EtcdCluster(detached=True).start(timeout)  # (stops itself if it fails)
        state["etcd"] = etcd.state()
        save_state(d, state)
        etcd_addresses = etcd.addresses
        (d / "clock").mkdir(exist_ok=True)
        for i in range(1, hosts + 1):
            host = f"host-{i}"
            ns = f"dev{tag}-{host}"
            cache: dict[str, Any] = {"l2_size": l2_size, "l2_sync_interval": sync_interval,
                                     "strong_prefixes": list(strong_prefixes)}
            if watch_buffer is not None:  # a small feed ring: the soak overflows it on purpose
                cache["watch_buffer"] = watch_buffer
            path = d / f"{host}.yaml"
            clock = d / "clock" / host
            metrics = free_port()  # each host's own exporter
            # recorded (and saved) before each process starts: a failure at any point
            # leaves `down` (below) everything started so far to stop
            h: dict[str, Any] = {"host": host, "namespace": ns, "config": str(path),
                                 "proxy": None, "clock": str(clock), "pid": 0,
                                 "metrics": f"http://127.0.0.1:{metrics}/metrics"}
            state["hosts"].append(h)
            save_state(d, state)
            remap: dict[str, str] = {}
            if proxies:
                from ..faults.proxy import start_proxy

                pdir = d / "proxy"
                pdir.mkdir(mode=0o700, exist_ok=True)
                ppid, remap = start_proxy(state["redis"] + etcd_addresses, pdir / f"{host}.sock",
                                          pdir / f"{host}.json", d / f"{host}-proxy.log", timeout)
                h["proxy"] = {"pid": ppid, "control": str(pdir / f"{host}.sock")}
                save_state(d, state)
            clock.write_text("0\n")
            cfg = {"node": {"host_id": host, "namespace": ns, "test_clock_offset_file": str(clock)},
                   "cache": cache,
                   "cluster": {"redis": state["redis"], "etcd": etcd_addresses,
                               "address_remap": remap, "feed_poll": feed_poll,
                               "resolvers": resolvers or {}, **(cluster_settings or {})},
                   "metrics": {"port": metrics}}
            if groups is not None:
                cfg["cluster"]["groups"] = groups
            path.write_text(yaml.safe_dump(cfg, sort_keys=False))
            purge(ns)
            h["pid"] = spawn_daemon(path, d / f"{host}.log").pid
            save_state(d, state)
        for h in state["hosts"]:
            _wait_heartbeat(d, h, timeout)
    except BaseException:
        down(str(d))
        raise
    return state


def spawn_daemon(config: str | os.PathLike[str], log: str | os.PathLike[str],
                 detached: bool = True) -> subprocess.Popen[bytes]:
    """Start ``kvcomm node --config CONFIG`` (this Python) with its output appended to
    ``log``; returns at once (see :func:`daemon_alive`)."""
    return spawn([sys.executable, "-m", "kvcomm", "node", "--config", str(config)], log,
                 detached=detached)


def daemon_alive(namespace: str, pid: int | None = None) -> bool:
    """True when the node daemon of the L2 ``namespace`` heartbeats (and, given ``pid``,
    is that process); False when it does not or there is no segment."""
    try:
        seg = L2Segment(namespace, create_layout=None, host_id="", attach_timeout=0)
    except SegmentError:
        return False
    try:
        info = seg.info()
    finally:
        seg.close()
    return bool(info["daemon_alive"]) and (pid is None or info["daemon_pid"] == pid)


def _wait_heartbeat(d: Path, host: dict[str, Any], timeout: float) -> None:
    """Until the daemon process ``host["pid"]`` itself heartbeats (the last beat of one
    that was killed stays fresh for a while). Raises Unavailable when it exits or stays
    silent for ``timeout`` seconds."""
    pid, log = int(host["pid"]), d / f"{host['host']}.log"

    def beating() -> bool:
        if not running(pid):
            raise Unavailable(f"the node daemon of {host['host']} (pid {pid}) exited; see {log}")
        return daemon_alive(host["namespace"], pid)

    wait_until(beating, timeout, f"the node daemon of {host['host']} to start (see {log})",
               interval=0.02)


def restart_daemon(directory: str, index: int, timeout: float = 30.0) -> int:
    """Start host ``index``'s daemon again (stopping it first if it still runs); returns
    its new pid once that process heartbeats. Raises Unavailable when it does not."""
    d = Path(directory).resolve()
    state = load_state(d)
    h = state["hosts"][index]
    wait_exiting(int(h["pid"]))
    if _daemon_up(h):
        stop([int(h["pid"])])
    h["pid"] = spawn_daemon(h["config"], d / f"{h['host']}.log").pid
    save_state(d, state)
    _wait_heartbeat(d, h, timeout)
    return int(h["pid"])


def _daemon_up(host: dict[str, Any]) -> bool:
    """The host's recorded daemon runs (``--config`` its config), not a process that
    took its pid (see :func:`~kvcomm.devcluster.procs.running_as`)."""
    return running_as(int(host["pid"]), str(host["config"]))


def _redis_up(d: Path, state: dict[str, Any], i: int) -> bool:
    """Redis node ``i``'s recorded process runs: its title names its port (its ``--dir``
    before it has set its title)."""
    port = redis_ports(state)[i]
    node_dir = str(Path(state.get("redis_dir", d / "redis")) / str(port))
    return running_as(int(state["redis_pids"][i]), f"127.0.0.1:{port}", node_dir)


def _redis_index(state: dict[str, Any], port: int) -> int:
    try:
        return redis_ports(state).index(port)
    except ValueError:
        raise KVCommError(f"no Redis node on port {port} in this dev cluster") from None


def kill_redis(directory: str, port: int) -> int:
    """SIGKILL the Redis node on ``port`` (a crash: its replica takes over after the
    node timeout). Returns its pid once the process is gone."""
    d = Path(directory).resolve()
    state = load_state(d)
    i = _redis_index(state, port)
    if not _redis_up(d, state, i):
        raise KVCommError(f"the Redis node on port {port} is already down")
    pid = int(state["redis_pids"][i])
    kill(pid)
    return pid


def restart_redis(directory: str, port: int, timeout: float = 60.0) -> int:
    """Start the killed Redis node on ``port`` again and wait until the cluster is whole:
    every node agrees every slot is served and every master has its replicas online and
    caught up (having lost its data, the node rejoins as a replica of the one that took
    over). Returns the node's new pid; raises Unavailable if it is still running or the
    cluster does not heal within ``timeout`` seconds."""
    d = Path(directory).resolve()
    state = load_state(d)
    i = _redis_index(state, port)
    wait_exiting(int(state["redis_pids"][i]))
    if _redis_up(d, state, i):
        raise Unavailable(f"the Redis node on port {port} is still running: kill it first")
    ports = redis_ports(state)
    wait_failed_over(ports, port, timeout)  # (restarted before that, a master comes back empty)
    node_dir = str(Path(state.get("redis_dir", d / "redis")) / str(port))
    proc = spawn(node_argv(port, node_dir, int(state.get("node_timeout_ms", 2000))))
    state["redis_pids"][i] = proc.pid
    save_state(d, state)
    wait_whole(ports, int(state.get("replicas", 1)), timeout)
    return proc.pid


def wait_redis_whole(directory: str, timeout: float = 60.0) -> None:
    """Until the dev cluster's Redis Cluster is whole (see :func:`restart_redis`)."""
    state = load_state(directory)
    wait_whole(redis_ports(state), int(state.get("replicas", 1)), timeout)


def down(directory: str) -> bool:
    """Stop the dev cluster in ``directory`` and remove its hosts' L2 segments; False
    (nothing done) when there is none. Only processes that are still the ones recorded
    (by their command lines) are signalled: after a reboot, ``cluster.json``'s pids may
    be anyone's, and `up` asks for a `down` first."""
    d = Path(directory).resolve()
    if not (d / STATE_FILE).exists():
        return False
    state = load_state(d)
    stop([int(h["pid"]) for h in state["hosts"] if _daemon_up(h)])
    stop([int(p) for i, p in enumerate(state["redis_pids"]) if _redis_up(d, state, i)])
    etcd = state.get("etcd")
    if etcd:
        live = [i for i in range(len(etcd["names"])) if _member_up(etcd, i)]
        stop_members([int(etcd["pids"][i]) for i in live],
                     [etcd["client_ports"][i] for i in live], timeout=10.0)
        shutil.rmtree(etcd["dir"], ignore_errors=True)
    stop([int(h["proxy"]["pid"]) for h in state["hosts"]
          if h.get("proxy") and running_as(int(h["proxy"]["pid"]), str(h["proxy"]["control"]))])
    for h in state["hosts"]:
        purge(h["namespace"])
    (d / STATE_FILE).unlink()
    return True


# ---------------------------------------------------------------- etcd faults


def _etcd(state: dict[str, Any]) -> dict[str, Any]:
    etcd = state.get("etcd")
    if not etcd:
        raise KVCommError("this dev cluster has no etcd (started by an older kvcomm?): "
                          "run `kvcomm dev-cluster down` and `up` again")
    return etcd  # type: ignore[no-any-return]


def _member_dir(etcd: dict[str, Any], i: int) -> str:
    return os.path.join(str(etcd["dir"]), str(etcd["names"][i]))


def _member_up(etcd: dict[str, Any], i: int) -> bool:
    """Member ``i``'s recorded process runs, and is that member (its ``--data-dir``), not
    a process that took its pid after it died."""
    return running_as(int(etcd["pids"][i]), _member_dir(etcd, i))


def _member_index(etcd: dict[str, Any], member: int) -> int:
    if not 0 <= member < len(etcd["names"]):
        raise KVCommError(f"etcd member {member + 1} does not exist "
                          f"(members 1 to {len(etcd['names'])})")
    return member


def etcd_leader(directory: str, timeout: float = 30.0) -> int:
    """The index (0-based) of the etcd member that leads now, once the live members
    agree on one. Raises Unavailable."""
    etcd = _etcd(load_state(directory))
    ports = etcd["client_ports"]
    live = [p for i, p in enumerate(ports) if _member_up(etcd, i)]
    return wait_etcd_healthy(ports, timeout, alive=live)


def kill_etcd(directory: str, member: int | None = None, leader: bool = False) -> int:
    """SIGKILL etcd member ``member`` (0-based), or the leader with ``leader``, or (with
    neither) the first member still running. Returns the index of the member killed,
    once its process is gone. Raises KVCommError for a bad member, Unavailable when no
    leader can be found or the process outlives the signal."""
    etcd = _etcd(load_state(directory))
    if leader:
        member = etcd_leader(directory)
    elif member is None:
        member = next((i for i in range(len(etcd["names"])) if _member_up(etcd, i)), None)
        if member is None:
            raise KVCommError("every etcd member is already down; `restart-etcd` first")
    member = _member_index(etcd, member)
    if not _member_up(etcd, member):
        raise KVCommError(f"etcd member {member + 1} is already down; `restart-etcd` first")
    pid = int(etcd["pids"][member])
    if not kill(pid):
        raise Unavailable(f"etcd member {member + 1} (pid {pid}) still runs 10 s after "
                          f"SIGKILL; see `ps -o stat,wchan -p {pid}`")
    return member


def pause_etcd(directory: str, member: int, resume: bool = False) -> int:
    """SIGSTOP (SIGCONT with ``resume``) etcd member ``member``; returns its pid, once
    every thread of it has stopped (a signal reaches each thread on its way back to user
    space). Raises KVCommError when that member is not running."""
    etcd = _etcd(load_state(directory))
    member = _member_index(etcd, member)
    if not _member_up(etcd, member):
        raise KVCommError(f"etcd member {member + 1} is not running; `restart-etcd` first")
    pid = int(etcd["pids"][member])
    os.kill(pid, signal.SIGCONT if resume else signal.SIGSTOP)
    if not resume:
        wait_until(lambda: all_stopped(pid) or not running(pid), 10,
                   f"etcd member {member + 1} (pid {pid}) to stop", interval=0.001)
    return pid


#: How many times :func:`restart_etcd` starts a member whose port another program held
#: for a moment (a check that a port is free binds it) before it gives up.
RESTART_BIND_TRIES = 10


class _MemberExited(KVCommError):
    """A restarted member exited (not an Unavailable: that would be waited on)."""


def restart_etcd(directory: str, member: int | None = None, timeout: float = 60.0) -> list[int]:
    """Start killed etcd members again (``member``, or every one that is down) with their
    names, ports and data, resume paused ones, and wait until every member is healthy.
    Returns the indexes started or resumed. A member of those that dies while this waits (a kill
    not yet acted on when it looked) is started too. Raises Unavailable, with the
    members' states and logs, when one exits (one whose port was taken for a moment is
    started again, up to :data:`RESTART_BIND_TRIES` times) or the cluster does not heal
    within ``timeout``."""
    d = Path(directory).resolve()
    state = load_state(d)
    etcd = _etcd(state)
    n = len(etcd["names"])
    mine = [_member_index(etcd, member)] if member is not None else list(range(n))
    started: dict[int, tuple[subprocess.Popen[bytes], int]] = {}  # process, log offset
    tries = dict.fromkeys(mine, 0)

    def log_of(i: int) -> str:
        return os.path.join(etcd["dir"], f"{etcd['names'][i]}.log")

    def said(i: int) -> str:
        """What member ``i``'s log gained since its last start."""
        try:
            with open(log_of(i), "rb") as f:
                f.seek(started[i][1])
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def start(i: int) -> None:
        wait_exiting(int(etcd["pids"][i]))
        log = log_of(i)
        offset = os.path.getsize(log) if os.path.exists(log) else 0
        argv = member_argv(etcd["names"][i], _member_dir(etcd, i), etcd["client_ports"][i],
                           etcd["peer_ports"][i], etcd["initial_cluster"], etcd["token"],
                           etcd["heartbeat_ms"], etcd["election_ms"])
        started[i] = (spawn(argv, log), offset)
        tries[i] += 1
        etcd["pids"][i] = started[i][0].pid
        save_state(d, state)

    def exited() -> None:
        for i in mine:
            if i not in started and not _member_up(etcd, i):
                start(i)  # it died since we looked
        for i, (proc, _) in list(started.items()):
            if proc.poll() is None:
                continue
            text = said(i)
            if "address already in use" in text and tries[i] < RESTART_BIND_TRIES:
                start(i)
                continue
            raise _MemberExited(f"etcd member {i + 1} exited with status {proc.returncode} "
                                f"when restarted ({tries[i]} starts); its log:\n"
                                f"{text[-2000:]}")

    resumed = []
    for i in mine:
        if _member_up(etcd, i):
            pid = int(etcd["pids"][i])
            if proc_state(pid) in ("T", "t"):
                resumed.append(i)
            try:
                os.kill(pid, signal.SIGCONT)  # a paused member: resume it
            except ProcessLookupError:
                pass  # died since: started while waiting (exited() below)
        else:
            start(i)
    try:
        wait_etcd_healthy(etcd["client_ports"], timeout, check=exited)
    except _MemberExited as exc:
        raise Unavailable(str(exc)) from None
    except Unavailable as exc:
        def described(i: int) -> str:
            pid = int(etcd["pids"][i])
            text = f"--- member {i + 1}: pid {pid}, state {proc_state(pid) or 'gone'}"
            return text + (f", {tries.get(i, 0)} starts; its log:\n{said(i)[-1000:]}"
                           if i in started else "")
        raise Unavailable(f"{exc}\n" + "\n".join(described(i) for i in range(n))) from None
    return sorted(set(started) | set(resumed))


# ---------------------------------------------------------------- network and clock faults


def _proxy(state: dict[str, Any], host: str) -> Any:
    from ..faults.proxy import ProxyControl

    for h in state["hosts"]:
        if h["host"] == host:
            if not h.get("proxy"):
                raise KVCommError(f"{host} has no fault proxy: start the dev cluster with "
                                  "`kvcomm dev-cluster up --proxies`")
            return ProxyControl(h["proxy"]["control"])
    raise KVCommError(f"no host {host!r} in this dev cluster "
                      f"({', '.join(h['host'] for h in state['hosts'])})")


def partition(directory: str, host: str, mode: str = "blackhole",
              delay_ms: float = 0.0) -> dict[str, Any]:
    """Cut ``host`` off from Redis and etcd in both directions (``mode`` blackhole), or
    slow it (``delay`` by ``delay_ms``), or reset its live connections once (``drop``),
    until :func:`heal`. Returns its proxy's status. Raises KVCommError (no such host, no
    proxies), Unavailable (the proxy does not answer), InvalidArgument (a bad mode)."""
    ctl = _proxy(load_state(directory), host)
    if mode == "drop":
        return ctl.drop()  # type: ignore[no-any-return]
    return ctl.set(mode, delay_ms)  # type: ignore[no-any-return]


def drop_connections(directory: str, host: str) -> int:
    """Reset every live connection of ``host`` to Redis and etcd; returns how many."""
    return int(partition(directory, host, "drop")["dropped_now"])


def heal(directory: str, host: str | None = None) -> list[str]:
    """End every network fault of ``host`` (default: every host with a proxy); returns
    the hosts healed."""
    state = load_state(directory)
    hosts = [host] if host else [h["host"] for h in state["hosts"] if h.get("proxy")]
    for h in hosts:
        _proxy(state, h).set("pass")
    return hosts


def set_clock_offset(directory: str, host: str, offset_s: float) -> None:
    """TEST ONLY: move ``host``'s clock by ``offset_s`` seconds (every process of that
    host reads its offset file: :mod:`kvcomm.clock`)."""
    state = load_state(directory)
    for h in state["hosts"]:
        if h["host"] == host:
            write_clock_offset(h["clock"], offset_s)
            return
    raise KVCommError(f"no host {host!r} in this dev cluster")
