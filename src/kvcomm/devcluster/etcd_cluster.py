"""A real etcd cluster on loopback: 3 members by default, free ports, data on tmpfs.

What ``kvcomm dev-cluster up`` starts beside the Redis Cluster, and what the etcd tests
run on: Debian's ``etcd`` binary (package ``etcd-server``), never a mock.

Tuned for a small, busy machine: the data directories are on tmpfs (``/dev/shm``: an
fsync costs nothing, so a loaded disk cannot stall raft), and the heartbeat (200 ms) and
election timeout (2 s) are ten times etcd's defaults, so that two cores shared with test
suites do not make members call elections while the leader is merely slow. A leader
killed on purpose is replaced after about one election timeout. Watches get a progress
notification every 2 s (``--experimental-watch-progress-notify-interval``), so an idle
stream is never mistaken for a dead one.

:meth:`EtcdCluster.start` returns once every member answers and all follow one leader.
Faults: :meth:`~EtcdCluster.kill` (SIGKILL), :meth:`~EtcdCluster.pause` /
:meth:`~EtcdCluster.resume` (SIGSTOP / SIGCONT), :meth:`~EtcdCluster.restart` (the same
name, ports and data directory: it rejoins), :meth:`~EtcdCluster.leader`. The functions
:func:`member_argv`, :func:`leader_index` and :func:`wait_healthy` serve ``cluster.json``
users too (``dev-cluster kill-etcd``, ``restart-etcd``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._wait import wait_until
from ..errors import KVCommError, Unavailable
from ..tiers.etcd import EtcdClient
from .procs import Service, all_stopped, spawn
from .procs import kill as kill_proc
from .procs import stop as stop_procs
from .redis_cluster import free_cluster_port

HEARTBEAT_MS = 200
ELECTION_MS = 2000
PROGRESS_NOTIFY = "2s"


def etcd_path() -> str | None:
    """Where the ``etcd`` server binary is (PATH, then Debian's /usr/bin), or None."""
    found = shutil.which("etcd")
    if found is None and os.access("/usr/bin/etcd", os.X_OK):
        found = "/usr/bin/etcd"
    return found


def tmpfs_dir(prefix: str) -> str:
    """A new directory on tmpfs (``/dev/shm``; a temporary directory where there is none)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix=prefix, dir=base)


def member_argv(name: str, data_dir: str, client_port: int, peer_port: int,
                initial_cluster: str, token: str, heartbeat_ms: int = HEARTBEAT_MS,
                election_ms: int = ELECTION_MS) -> list[str]:
    """The command line of one member (also how a killed member is started again: the
    same name, ports and data directory, so it rejoins with its log)."""
    exe = etcd_path()
    if exe is None:
        raise Unavailable("etcd is not installed (Debian: apt-get install etcd-server)")
    client = f"http://127.0.0.1:{client_port}"
    peer = f"http://127.0.0.1:{peer_port}"
    return [exe, "--name", name, "--data-dir", data_dir,
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", initial_cluster, "--initial-cluster-state", "new",
            "--initial-cluster-token", token,
            "--heartbeat-interval", str(heartbeat_ms), "--election-timeout", str(election_ms),
            "--experimental-watch-progress-notify-interval", PROGRESS_NOTIFY,
            "--logger", "zap", "--log-level", "warn"]


def _statuses(ports: Sequence[int], timeout: float) -> dict[int, dict[str, Any]]:
    """``/v3/maintenance/status`` of every member that answers, by client port."""
    out: dict[int, dict[str, Any]] = {}
    client = EtcdClient([("127.0.0.1", p) for p in ports], timeout=timeout)
    try:
        for p in ports:
            try:
                out[p] = client.status(("127.0.0.1", p), timeout=timeout)
            except Unavailable:
                continue
    finally:
        client.close()
    return out


def leader_index(ports: Sequence[int], timeout: float = 1.0) -> int | None:
    """The index in ``ports`` of the member that leads now (as the members that answer
    agree), or None when there is none or they disagree."""
    st = _statuses(ports, timeout)
    leaders = {int(s.get("leader", 0)) for s in st.values()}
    if len(leaders) != 1 or 0 in leaders:
        return None
    (lead,) = leaders
    for i, p in enumerate(ports):
        if p in st and int(st[p]["header"]["member_id"]) == lead:
            return i
    return None


def stop_members(procs: Sequence[subprocess.Popen[bytes] | int], client_ports: Sequence[int],
                 timeout: float = 5.0) -> None:
    """End the members ``procs`` (in the order of ``client_ports``): the followers first,
    then the leader. Stopped together, a leader spends etcd's request timeout (5 s plus two
    election timeouts) handing its leadership to a follower that is stopping too; with no
    follower left it has none to try and exits at once. Returns once all are gone (what
    is still running after ``timeout`` seconds is killed)."""
    if not procs:
        return
    lead = leader_index(client_ports, timeout=1.0)  # None: no leader agreed, stop them all
    stop_procs([p for i, p in enumerate(procs) if i != lead], timeout=timeout)
    stop_procs(procs, timeout=timeout)


def wait_healthy(ports: Sequence[int], timeout: float = 30.0,
                 alive: Sequence[int] | None = None,
                 check: Callable[[], None] | None = None) -> int:
    """Until every member in ``alive`` (default: all) answers, they follow one leader
    among them, and a linearizable read succeeds. Returns the leader's index. Raises
    Unavailable naming what was missing. ``check`` is called before each try; what it
    raises, an Unavailable aside, ends the wait (a member's process that exited)."""
    want = list(ports if alive is None else alive)
    state = {"why": "no answer yet"}

    def healthy() -> int:
        if check is not None:
            check()
        st = _statuses(want, 1.0)
        if len(st) < len(want):
            state["why"] = f"members {sorted(set(want) - set(st))} do not answer"
            return 0
        lead = leader_index(want, 1.0)
        if lead is None:
            state["why"] = "no leader all members agree on"
            return 0
        c = EtcdClient([("127.0.0.1", p) for p in want], timeout=2.0)
        try:
            c.get(b"kvc/health")
        finally:
            c.close()
        return list(ports).index(want[lead]) + 1  # +1: index 0 is a true value too

    found: int = wait_until(healthy, timeout, lambda: f"etcd to be healthy ({state['why']})",
                            interval=0.05, retry_on=(Unavailable,))
    return found - 1


class EtcdCluster(Service):
    """``members`` etcd members on 127.0.0.1, data on tmpfs (see the module docstring).

    ``detached`` starts them in a session of their own (they outlive this process: the
    dev cluster). ``stop()`` ends them and removes their data.
    """

    def __init__(self, members: int = 3, *, detached: bool = False,
                 heartbeat_ms: int = HEARTBEAT_MS, election_ms: int = ELECTION_MS) -> None:
        if etcd_path() is None:
            raise Unavailable("etcd is not installed (Debian: apt-get install etcd-server)")
        if not 1 <= members <= 9:
            raise KVCommError("an etcd cluster has 1 to 9 members")
        self.detached = detached
        self.heartbeat_ms, self.election_ms = heartbeat_ms, election_ms
        self.dir = tmpfs_dir("kvcomm-etcd-")
        self.names = [f"m{i + 1}" for i in range(members)]
        self.token = f"kvcomm-{os.path.basename(self.dir)}"
        self._pick_ports()
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def _pick_ports(self) -> None:
        taken: set[int] = set()
        ports: list[int] = []
        while len(ports) < 2 * len(self.names):
            p = free_cluster_port()  # below the ephemeral range: a restart can bind it again
            if p not in taken:
                ports.append(p)
                taken.add(p)
        self.client_ports = ports[:len(self.names)]
        self.peer_ports = ports[len(self.names):]

    @property
    def initial_cluster(self) -> str:
        return ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(self.names, self.peer_ports,
                                                                      strict=True))

    @property
    def endpoints(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", p) for p in self.client_ports]

    @property
    def addresses(self) -> list[str]:
        """The members as ``host:port`` (what ``cluster.etcd`` lists)."""
        return [f"127.0.0.1:{p}" for p in self.client_ports]

    @property
    def pids(self) -> list[int]:
        return [self.procs[i].pid for i in range(len(self.names))]

    def argv(self, i: int) -> list[str]:
        return member_argv(self.names[i], os.path.join(self.dir, self.names[i]),
                           self.client_ports[i], self.peer_ports[i], self.initial_cluster,
                           self.token, self.heartbeat_ms, self.election_ms)

    def _spawn(self, i: int) -> None:
        log = os.path.join(self.dir, f"{self.names[i]}.log")
        self.procs[i] = spawn(self.argv(i), log, detached=self.detached)

    def start(self, timeout: float = 60.0, attempts: int = 3) -> EtcdCluster:
        """Start every member; returns once they are healthy (:func:`wait_healthy`).
        Raises Unavailable (nothing left running) when they are not within ``timeout``."""
        deadline = time.monotonic() + timeout
        for attempt in range(attempts):
            for i in range(len(self.names)):
                self._spawn(i)
            try:
                wait_healthy(self.client_ports, max(1.0, deadline - time.monotonic()) /
                             (attempts - attempt))
                return self
            except Unavailable as exc:
                stop_procs(self.procs.values(), timeout=5.0)
                self.procs.clear()
                if attempt == attempts - 1 or time.monotonic() > deadline:
                    logs = self.tail_logs()
                    self.stop()
                    raise Unavailable(f"etcd did not start: {exc}\n{logs}") from None
                # a port taken between our check and etcd's bind: other ports, fresh data
                shutil.rmtree(self.dir, ignore_errors=True)
                os.makedirs(self.dir)
                self._pick_ports()
        raise AssertionError("unreachable")

    def tail_logs(self, lines: int = 5) -> str:
        out = []
        for n in self.names:
            try:
                with open(os.path.join(self.dir, f"{n}.log"), "rb") as f:
                    tail = f.read().decode(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            out.append(f"--- {n}\n" + "\n".join(tail))
        return "\n".join(out)

    def alive(self, i: int) -> bool:
        return i in self.procs and self.procs[i].poll() is None

    def leader(self, timeout: float = 30.0) -> int:
        """The index of the leader the live members agree on (waits up to ``timeout``
        for an election to finish). Raises Unavailable."""
        live = [self.client_ports[i] for i in range(len(self.names)) if self.alive(i)]
        return wait_healthy(self.client_ports, timeout, alive=live)

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (a crash; its data stays for :meth:`restart`)."""
        kill_proc(self.procs[i])

    def pause(self, i: int, timeout: float = 10.0) -> None:
        """SIGSTOP member ``i`` and return once every one of its threads has stopped."""
        self.procs[i].send_signal(signal.SIGSTOP)
        pid = self.procs[i].pid
        wait_until(lambda: all_stopped(pid), timeout, f"etcd member {self.names[i]} to stop")

    def resume(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGCONT)

    def restart(self, i: int, timeout: float = 30.0) -> None:
        """Start the killed member ``i`` again (same name, ports and data) and wait until
        every live member is healthy again. Raises Unavailable."""
        if self.alive(i):
            raise Unavailable(f"etcd member {self.names[i]} is still running: kill it first")
        self._spawn(i)
        self.wait_healthy(timeout)

    def wait_healthy(self, timeout: float = 30.0) -> int:
        live = [self.client_ports[i] for i in range(len(self.names)) if self.alive(i)]
        return wait_healthy(self.client_ports, timeout, alive=live)

    def stop(self) -> None:
        """End every member (:func:`stop_members`) and remove the data directory."""
        stop_members([self.procs[i] for i in sorted(self.procs)],
                     [self.client_ports[i] for i in sorted(self.procs)])
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def state(self) -> dict[str, Any]:
        """What ``cluster.json`` keeps to stop, kill and restart the members later."""
        return {"names": self.names, "client_ports": self.client_ports,
                "peer_ports": self.peer_ports, "pids": self.pids, "dir": self.dir,
                "token": self.token, "initial_cluster": self.initial_cluster,
                "heartbeat_ms": self.heartbeat_ms, "election_ms": self.election_ms}
