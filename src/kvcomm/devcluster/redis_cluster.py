"""A real Redis Cluster on loopback: 3 masters + 3 replicas by default, free ports, temp dirs.

The L3 of ``kvcomm dev-cluster``, and what tests and benchmarks run cluster mode on. The
nodes are Debian's ``redis-server`` started with ``cluster-enabled yes`` and joined by
``redis-cli --cluster create``; :meth:`RedisCluster.start` returns once every node
reports ``cluster_state:ok`` and every slot is served. Faults are injected on purpose:
:meth:`~RedisCluster.kill` (SIGKILL) and :meth:`~RedisCluster.pause` /
:meth:`~RedisCluster.resume` (SIGSTOP / SIGCONT) of one node. A test that kills a node
heals the cluster before it ends: :meth:`~RedisCluster.restart` brings the node back on
its port (it rejoins, as a replica if its replica took over) and
:meth:`~RedisCluster.wait_restored` returns once the cluster is whole again — every node
up and agreeing that every slot is served, every master with its replicas online and
caught up — so that no later test depends on what an earlier one broke.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from functools import partial

from .._wait import wait_until
from ..errors import Unavailable
from .procs import Service, spawn
from .procs import kill as kill_proc
from .procs import stop as stop_procs
from .redis_server import ephemeral_low


def _port_range() -> tuple[int, int]:
    """Ports whose bus port (+10000) stays below the kernel's ephemeral range, so that no
    outgoing connection can take either between our check and redis-server's bind."""
    hi = ephemeral_low() - 10001
    return (10000, hi) if hi > 12000 else (20000, 55535)


def free_cluster_port(rng: random.Random | None = None) -> int:
    """A port p with p and its cluster-bus port p + 10000 both free on loopback."""
    rng = rng or random.Random()
    lo, hi = _port_range()
    for _ in range(1000):
        port = rng.randrange(lo, hi)
        try:
            for p in (port, port + 10000):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise Unavailable("no free port pair for a Redis Cluster node")


def command(port: int, *args: str, timeout: float = 1.0) -> bytes:
    """The raw reply to one inline command sent to 127.0.0.1:``port`` over a plain socket
    (no client library needed: the dev cluster runs without redis-py). Raises OSError."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall((" ".join(args) + "\r\n").encode())
        data = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
            if data.startswith((b"+", b"-", b":")) and data.endswith(b"\r\n"):
                break
            if data.startswith(b"$"):
                head, _, rest = data.partition(b"\r\n")
                if len(rest) >= int(head[1:]) + 2:
                    break
        return data


NODE_TIMEOUT_MS = 2000
SYNC_DELAY_S = 5  # Redis 7's repl-diskless-sync-delay, which a cluster runs with once started


def node_argv(port: int, node_dir: str, node_timeout_ms: int = NODE_TIMEOUT_MS,
              sync_delay_s: int = SYNC_DELAY_S) -> list[str]:
    """The command line of one cluster node (also how a killed node is started again: the
    same port and directory, so its ``nodes.conf`` makes it rejoin the cluster)."""
    return ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", node_dir,
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(node_timeout_ms), "--save", "",
            "--repl-diskless-sync-delay", str(sync_delay_s),
            "--appendonly", "no", "--protected-mode", "yes", "--loglevel", "warning"]


def _info(text: bytes) -> dict[str, str]:
    out = {}
    for line in text.decode(errors="replace").splitlines():
        k, sep, v = line.partition(":")
        if sep:
            out[k.strip()] = v.strip()
    return out


def cluster_whole(ports: list[int], replicas: int) -> tuple[str, dict[int, int]]:
    """Why the cluster on ``ports`` is not whole yet ("" when it is), and each master's
    replication offset: every node answers and sees ``cluster_state:ok`` with all 16384
    slots served and every node known; there are ``len(ports) / (1 + replicas)`` masters,
    each with ``replicas`` replicas online and linked."""
    masters: dict[int, int] = {}
    for port in ports:
        try:
            cinfo = _info(command(port, "CLUSTER", "INFO"))
            rinfo = _info(command(port, "INFO", "replication"))
        except OSError:
            return f"node {port} does not answer", {}
        if cinfo.get("cluster_state") != "ok" or cinfo.get("cluster_slots_ok") != "16384":
            return f"node {port} sees cluster_state {cinfo.get('cluster_state')}", {}
        if cinfo.get("cluster_known_nodes") != str(len(ports)):
            return f"node {port} knows {cinfo.get('cluster_known_nodes')} nodes", {}
        if rinfo.get("role") == "master":
            online = [v for k, v in rinfo.items() if k.startswith("slave") and "state=online" in v]
            if len(online) < replicas:
                return f"master {port} has {len(online)} replicas online", {}
            masters[port] = int(rinfo.get("master_repl_offset", "0"))
        elif rinfo.get("master_link_status") != "up":
            return f"replica {port} is not linked to its master", {}
    if len(masters) != len(ports) // (1 + replicas):
        return f"{len(masters)} masters", {}
    return "", masters


def cluster_ok(port: int) -> bool:
    """True when the node on ``port`` reports ``cluster_state:ok``. Raises OSError."""
    return b"cluster_state:ok" in command(port, "CLUSTER", "INFO")


def _replicas_online(port: int, replicas: int) -> bool:
    return command(port, "INFO", "replication").count(b"state=online") >= replicas


def _replicas_reached(port: int, target: int) -> bool:
    rinfo = _info(command(port, "INFO", "replication"))
    offsets = [int(dict(p.split("=", 1) for p in v.split(",") if "=" in p).get("offset", "-1"))
               for k, v in rinfo.items() if k.startswith("slave")]
    return bool(offsets) and min(offsets) >= target


def wait_failed_over(ports: list[int], port: int, timeout: float = 30.0) -> None:
    """Until the live nodes have marked the (killed) node on ``port`` as failed and it
    serves no slot: its replica has taken over. A master restarted before that would
    come back empty and still a master, and its replica would copy the empty data set.
    Raises Unavailable."""
    others = [p for p in ports if p != port]

    def failed_over() -> bool:
        for live in others:  # the first live node's view is enough
            try:
                nodes = command(live, "CLUSTER", "NODES").decode(errors="replace")
            except OSError:
                continue
            for line in nodes.splitlines():
                parts = line.split()  # a line with no slot ranges: the node serves none
                if len(parts) == 8 and parts[1].split("@")[0].endswith(f":{port}") \
                        and "fail" in parts[2].split(","):
                    return cluster_ok(live)
            return False
        return False

    wait_until(failed_over, timeout, f"node {port} to be failed over", interval=0.05,
               retry_on=(OSError,))


def wait_whole(ports: list[int], replicas: int, timeout: float = 60.0) -> None:
    """Until :func:`cluster_whole`, and every replica has acknowledged what its master
    held at that moment. Raises Unavailable naming what is still missing."""
    why = "not checked"
    pending: dict[int, int] | None = None  # once whole: master -> offset its replicas must reach

    def healed() -> bool:
        nonlocal why, pending
        try:
            if pending is None:
                why, masters = cluster_whole(ports, replicas)
                if why:
                    return False
                pending = masters
            pending = {p: t for p, t in pending.items() if not _replicas_reached(p, t)}
        except (OSError, ValueError) as exc:
            why, pending = f"a node answered oddly ({exc})", None
            return False
        why = f"the replicas of {sorted(pending)} are behind"
        return not pending

    wait_until(healed, timeout, lambda: f"the Redis Cluster to heal ({why})", interval=0.05)


class RedisCluster(Service):
    """``masters`` masters with ``replicas`` replicas each, on 127.0.0.1."""

    def __init__(self, masters: int = 3, replicas: int = 1,
                 node_timeout_ms: int = NODE_TIMEOUT_MS,
                 directory: str | None = None, detached: bool = False) -> None:
        if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
            raise Unavailable("redis-server and redis-cli are needed (apt-get install redis-server)")
        self.masters, self.replicas, self.node_timeout_ms = masters, replicas, node_timeout_ms
        self.detached = detached  # nodes in their own session: they outlive this process
        self.dir = directory or tempfile.mkdtemp(prefix="kvcomm-cluster-")
        self.ports = self._pick_ports(masters * (1 + replicas))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @staticmethod
    def _pick_ports(n: int) -> list[int]:
        ports: list[int] = []
        taken: set[int] = set()  # client and bus ports alike: no node may take another's
        while len(ports) < n:
            port = free_cluster_port()
            if port not in taken and port + 10000 not in taken:
                ports.append(port)
                taken.update((port, port + 10000))
        return ports

    def _all_answer(self, deadline: float) -> bool:
        """True once every node answers PING; False as soon as one has exited."""
        pending = list(self.ports)

        def answered() -> bool:
            if any(self.procs[p].poll() is not None for p in self.ports):
                raise Unavailable("a node exited")
            while pending and command(pending[0], "PING").startswith(b"+PONG"):
                pending.pop(0)
            return not pending

        try:
            wait_until(answered, max(0.0, deadline - time.monotonic()), "the nodes to answer",
                       interval=0.02, retry_on=(OSError,))
        except Unavailable:
            return False
        return True

    @property
    def seeds(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", p) for p in self.ports]

    def _start_node(self, port: int, sync_delay_s: int = SYNC_DELAY_S) -> None:
        node_dir = os.path.join(self.dir, str(port))
        os.makedirs(node_dir, exist_ok=True)
        self.procs[port] = spawn(node_argv(port, node_dir, self.node_timeout_ms, sync_delay_s),
                                 detached=self.detached)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def start(self, timeout: float = 60.0, attempts: int = 3) -> RedisCluster:
        """Start the nodes, create the cluster, and wait until every node sees it ok, every
        replica has made its first sync and every node lists every node in its role.
        The nodes start with ``repl-diskless-sync-delay`` 0 (Redis 7 waits 5 s for more
        replicas before a full sync, which every start waited for) and run with the
        default once started: later syncs (a failover, a killed node's rejoin) are
        Redis's own. Raises Unavailable (the nodes started are stopped)."""
        deadline = time.monotonic() + timeout
        for attempt in range(attempts):
            for port in self.ports:
                self._start_node(port, sync_delay_s=0)
            if self._all_answer(deadline):
                break
            # a node could not bind (a port race): stop them all, try other ports
            stop_procs(self.procs.values(), timeout=5.0)
            self.procs.clear()
            if attempt == attempts - 1:
                self.stop()
                raise Unavailable("redis-server nodes did not start (ports busy?)")
            self.ports = self._pick_ports(len(self.ports))
        out = subprocess.run(
            ["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
             "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            capture_output=True, text=True, timeout=max(5.0, deadline - time.monotonic()),
        )
        if out.returncode != 0:
            self.stop()
            raise Unavailable(f"redis-cli --cluster create failed: {out.stdout[-500:]}{out.stderr}")
        for port in self.ports:
            self._wait(partial(cluster_ok, port), deadline, f"node {port} to see the cluster ok")
        # a replica that has not finished its first sync cannot take over: wait for them
        for port in self.master_ports():
            self._wait(partial(_replicas_online, port, self.replicas), deadline,
                       f"the replicas of {port} to sync")
        # (gossip may not yet have told every node which nodes are replicas: a client that
        # reads CLUSTER NODES from one of those would take a replica for a master)
        self._wait(self._roles_agree, deadline, "every node to know every node's role")
        for port in self.ports:
            reply = command(port, "CONFIG", "SET", "repl-diskless-sync-delay", str(SYNC_DELAY_S))
            if not reply.startswith(b"+OK"):
                self.stop()
                raise Unavailable(f"Redis node {port} refused CONFIG SET: {reply[:200]!r}")
        return self

    def _roles_agree(self) -> bool:
        """Every node lists every node, none in handshake or failing, ``masters`` of
        them as masters."""
        for port in self.ports:
            lines = command(port, "CLUSTER", "NODES").decode(errors="replace").splitlines()
            flags = [line.split()[2].split(",") for line in lines if len(line.split()) >= 8]
            if (len(flags) != len(self.ports)
                    or any(f in fl for fl in flags for f in ("handshake", "noaddr", "fail", "fail?"))
                    or sum("master" in fl for fl in flags) != self.masters):
                return False
        return True

    def _wait(self, cond: Callable[[], bool], deadline: float, what: str) -> None:
        """:func:`wait_until` ``deadline``; stops the whole cluster when it times out."""
        try:
            wait_until(cond, max(0.0, deadline - time.monotonic()), what, interval=0.05,
                       retry_on=(OSError,))
        except Unavailable:
            self.stop()
            raise

    def master_ports(self) -> list[int]:
        out = []
        for port in self.ports:
            if self.procs[port].poll() is not None:
                continue
            try:
                if b"role:master" in command(port, "INFO", "replication"):
                    out.append(port)
            except OSError:
                continue
        return out

    def wait_replicated(self, timeout: float = 10.0) -> None:
        """Until every replica has acknowledged everything its master had when called
        (replication is asynchronous: a master killed earlier may lose recent writes)."""
        deadline = time.monotonic() + timeout
        for port in self.master_ports():
            target = int(_info(command(port, "INFO", "replication"))["master_repl_offset"])
            self._wait(partial(_replicas_reached, port, target), deadline,
                       f"replicas of {port} to catch up")

    def kill(self, port: int) -> None:
        """SIGKILL one node (a crash: its replica takes over after the node timeout)."""
        kill_proc(self.procs[port])

    def restart(self, port: int, timeout: float = 30.0) -> None:
        """Start a killed node again on its port and directory, once the cluster has
        failed it over (:func:`wait_failed_over`): it rejoins as a replica of the node
        that took its slots over. Raises Unavailable if it is still running or the
        failover does not happen within ``timeout``."""
        if self.procs[port].poll() is None:
            raise Unavailable(f"node {port} is still running: kill it first")
        wait_failed_over(self.ports, port, timeout)
        self._start_node(port)

    def wait_restored(self, timeout: float = 60.0) -> None:
        """Until the cluster is whole again (see :func:`cluster_whole`): after
        :meth:`restart`, say. Raises Unavailable naming what is still missing."""
        wait_whole(self.ports, self.replicas, timeout)

    def pause(self, port: int) -> None:
        self.procs[port].send_signal(signal.SIGSTOP)

    def resume(self, port: int) -> None:
        self.procs[port].send_signal(signal.SIGCONT)

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Until every live node reports cluster_state:ok (after a failover, say)."""
        deadline = time.monotonic() + timeout
        for port in self.ports:
            if self.procs[port].poll() is None:
                self._wait(partial(cluster_ok, port), deadline,
                           f"node {port} to see the cluster ok again")

    def stop(self) -> None:
        stop_procs(self.procs.values(), timeout=5.0)
        shutil.rmtree(self.dir, ignore_errors=True)
