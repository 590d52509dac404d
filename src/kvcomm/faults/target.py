"""What faults act on: a running dev cluster (``kvcomm dev-cluster up``), as one handle.

:class:`DevClusterTarget` reads the cluster's ``cluster.json`` and gives faults the
levers they pull: signal, kill and restart a host's node daemon; find, kill and restart
a Redis Cluster node; an L3 connection; a client and a recording writer per host (for
faults that write, so that their writes are checked like any other). It keeps
``cluster.json`` current (a restarted node's pid), so ``dev-cluster down`` still stops
everything.

``capabilities`` names what this target can do; a fault lists what it ``requires``,
and the nemesis refuses a fault the target cannot serve (a partition fault will need
per-host proxies, an etcd fault an etcd cluster: a target that has them says so).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from .._client import Client
from .._client import open as kv_open
from ..errors import Unavailable
from ..testing.cluster import _command, node_argv
from ..tiers.l2 import L2Segment
from ..tiers.l3 import L3Store, feed_key
from ..tiers.shm.layout import H
from .history import HistoryWriter, Recorder


def proc_state(pid: int) -> str:
    """The state letter of ``pid`` in /proc (R, S, T, Z, ...), or "" when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return ""
    return data[data.rfind(b")") + 2: data.rfind(b")") + 3].decode()


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    """Reap ``pid`` if it is our child; True once it has exited (zombies count as gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return True
        except ChildProcessError:
            pass  # not our child (or already reaped)
        if proc_state(pid) in ("", "Z", "X"):
            return True
        time.sleep(0.01)
    return False


class DevClusterTarget:
    """A dev cluster in ``directory`` (its ``cluster.json``). Not thread-safe."""

    capabilities = frozenset({"daemons", "redis", "l2", "l3"})

    def __init__(self, directory: str | os.PathLike[str],
                 history_dir: str | os.PathLike[str] | None = None) -> None:
        self.dir = Path(directory).resolve()
        self.state_file = self.dir / "cluster.json"
        state = self._state()
        self.host_ids: list[str] = [h["host"] for h in state["hosts"]]
        self.configs: list[str] = [h["config"] for h in state["hosts"]]
        self.redis_ports: list[int] = [int(a.rpartition(":")[2]) for a in state["redis"]]
        self.history_dir = Path(history_dir) if history_dir is not None else None
        self._clients: dict[int, Client] = {}
        self._recorders: dict[int, Recorder] = {}
        self._l3: L3Store | None = None

    @property
    def hosts(self) -> int:
        return len(self.host_ids)

    def _state(self) -> dict[str, Any]:
        try:
            return json.loads(self.state_file.read_text())  # type: ignore[no-any-return]
        except (OSError, ValueError) as exc:
            raise Unavailable(f"no dev cluster in {self.dir} ({exc}); "
                              "start one with `kvcomm dev-cluster up`") from None

    def _save(self, state: dict[str, Any]) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_file)

    # ------------------------------------------------------------------ per host

    def client(self, i: int) -> Client:
        """A client of host ``i`` in this process (opened once)."""
        if i not in self._clients:
            self._clients[i] = kv_open(config=self.configs[i])
        return self._clients[i]

    def segment(self, i: int) -> L2Segment:
        return self.client(i)._seg

    def recorder(self, i: int) -> Recorder:
        """The nemesis's recording writer on host ``i`` (process ``nemesis/<host>``)."""
        if self.history_dir is None:
            raise Unavailable("this target has no history directory: faults cannot write")
        if i not in self._recorders:
            host = self.host_ids[i]
            sink = HistoryWriter(self.history_dir / f"nemesis-{host}.jsonl")
            self._recorders[i] = Recorder(self.client(i), f"nemesis/{host}", host, sink)
        return self._recorders[i]

    def daemon_pid(self, i: int) -> int:
        return int(self._state()["hosts"][i]["pid"])

    def pause_daemon(self, i: int, avoid_lock: bool = False, timeout: float = 10.0) -> int:
        """SIGSTOP host ``i``'s daemon; returns its pid. With ``avoid_lock``, never leave it
        stopped while it holds the host's L2 writer lock (the caller is about to write)."""
        pid = self.daemon_pid(i)
        deadline = time.monotonic() + timeout
        delay = 0.002
        while True:
            os.kill(pid, signal.SIGSTOP)
            while proc_state(pid) not in ("T", "t", "", "Z"):  # the signal is asynchronous
                if time.monotonic() > deadline:
                    raise Unavailable(f"{self.host_ids[i]}'s daemon (pid {pid}) did not stop")
                time.sleep(0.001)
            if not avoid_lock or self.segment(i).lock_owner() != pid:
                return pid
            os.kill(pid, signal.SIGCONT)  # stopped holding the lock: let it finish, retry
            if time.monotonic() > deadline:
                raise Unavailable(f"{self.host_ids[i]}'s daemon holds its L2 lock at every stop")
            time.sleep(delay)
            delay = min(0.05, delay * 2)

    def resume_daemon(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def kill_daemon(self, i: int) -> int:
        """SIGKILL host ``i``'s daemon (a crash); returns the pid it had."""
        pid = self.daemon_pid(i)
        try:
            os.kill(pid, signal.SIGCONT)  # a stopped process dies just as well, but be plain
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        wait_gone(pid)
        return pid

    def restart_daemon(self, i: int, timeout: float = 30.0) -> int:
        """Start host ``i``'s daemon again; returns its new pid once that process itself
        heartbeats. Raises Unavailable when it exits or stays silent for ``timeout`` s."""
        from ..cli import devcluster

        pid = devcluster.restart_daemon(str(self.dir), i, timeout)
        # devcluster's wait can be satisfied by the killed daemon's last heartbeat (fresh
        # for 2 s): wait for one signed with the new pid
        seg = self.segment(i)
        deadline = time.monotonic() + timeout
        while not (seg._q[H["DAEMON_PID"]] == pid and seg.daemon_alive()):
            if proc_state(pid) in ("", "Z"):
                wait_gone(pid, 1.0)
                raise Unavailable(f"{self.host_ids[i]}'s restarted daemon (pid {pid}) exited; "
                                  f"see {self.dir}/{self.host_ids[i]}.log")
            if time.monotonic() > deadline:
                raise Unavailable(f"{self.host_ids[i]}'s restarted daemon (pid {pid}) did not "
                                  f"heartbeat within {timeout:.0f}s")
            time.sleep(0.02)
        return pid

    def daemon_alive(self, i: int) -> bool:
        return self.segment(i).daemon_alive() and proc_state(self.daemon_pid(i)) not in ("", "Z")

    # ------------------------------------------------------------------ Redis Cluster

    def l3(self) -> L3Store:
        if self._l3 is None:
            self._l3 = L3Store([("127.0.0.1", p) for p in self.redis_ports], timeout=2.0)
        return self._l3

    def redis_pid(self, port: int) -> int:
        state = self._state()
        return int(state["redis_pids"][self.redis_ports.index(port)])

    def live_redis(self) -> list[int]:
        return [p for p in self.redis_ports if proc_state(self.redis_pid(p)) not in ("", "Z")]

    def cluster_nodes(self) -> list[dict[str, Any]]:
        """CLUSTER NODES as a live node sees it: port, flags, master id, slot ranges."""
        for port in self.live_redis():
            try:
                raw = _command(port, "CLUSTER", "NODES")
            except OSError:
                continue
            if not raw.startswith(b"$"):
                continue
            out = []
            for line in raw.split(b"\r\n", 1)[1].decode().splitlines():
                parts = line.split()
                if len(parts) < 8:
                    continue
                slots = []
                for s in parts[8:]:
                    if s.startswith("["):
                        continue  # a slot being migrated
                    lo, _, hi = s.partition("-")
                    slots.append((int(lo), int(hi or lo)))
                out.append({"id": parts[0], "port": int(parts[1].split("@")[0].rpartition(":")[2]),
                            "flags": set(parts[2].split(",")), "master": parts[3],
                            "slots": slots})
            return out
        raise Unavailable("no Redis Cluster node answers CLUSTER NODES")

    def master_of_group(self, group: int) -> int:
        """The port of the master that serves ``group``'s hash slot now."""
        from redis.crc import key_slot

        slot = key_slot(feed_key(group).encode())
        for n in self.cluster_nodes():
            if "master" in n["flags"] and "fail" not in n["flags"] and any(
                    lo <= slot <= hi for lo, hi in n["slots"]):
                return int(n["port"])
        raise Unavailable(f"no master serves slot {slot} (group {group})")

    def kill_redis(self, port: int) -> int:
        pid = self.redis_pid(port)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        wait_gone(pid)
        return pid

    def wait_failover(self, port: int, timeout: float = 60.0) -> float:
        """Until the slots of the dead node ``port`` are served by others and every live
        node reports ``cluster_state:ok``. Returns the seconds waited. Raises Unavailable."""
        start = time.monotonic()
        while True:
            try:
                nodes = self.cluster_nodes()
                dead = [n for n in nodes if n["port"] == port]
                covered = sum(hi - lo + 1 for n in nodes if n["port"] != port
                              and "master" in n["flags"] and "fail" not in n["flags"]
                              for lo, hi in n["slots"])
                if (covered == 16384 and not (dead and dead[0]["slots"])
                        and all(b"cluster_state:ok" in _command(p, "CLUSTER", "INFO")
                                for p in self.live_redis())):
                    return time.monotonic() - start
            except (OSError, Unavailable):
                pass
            if time.monotonic() - start > timeout:
                raise Unavailable(f"Redis node {port} died and no replica took over within "
                                  f"{timeout:.0f}s")
            time.sleep(0.1)

    def restart_redis(self, port: int, timeout: float = 60.0) -> int:
        """Start the killed node ``port`` again from its directory (its nodes.conf makes it
        rejoin; having lost its data, it comes back as a replica of the node that took
        over). Returns once it is a replica in sync. Raises Unavailable."""
        pid = self.redis_pid(port)
        if proc_state(pid) not in ("", "Z"):
            raise Unavailable(f"Redis node {port} (pid {pid}) is still running")
        node_dir = self.dir / "redis" / str(port)
        proc = subprocess.Popen(node_argv(port, str(node_dir)), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        state = self._state()
        state["redis_pids"][self.redis_ports.index(port)] = proc.pid
        self._save(state)
        deadline = time.monotonic() + timeout
        while True:
            try:
                info = _command(port, "INFO", "replication")
                if b"role:slave" in info and b"master_link_status:up" in info and \
                        b"cluster_state:ok" in _command(port, "CLUSTER", "INFO"):
                    return proc.pid
            except OSError:
                pass
            if proc.poll() is not None:
                raise Unavailable(f"restarted Redis node {port} exited ({proc.returncode})")
            if time.monotonic() > deadline:
                raise Unavailable(f"restarted Redis node {port} did not rejoin as a synced "
                                  f"replica within {timeout:.0f}s")
            time.sleep(0.1)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        for r in self._recorders.values():
            r.sink.close()
        for c in self._clients.values():
            c.close()
        if self._l3 is not None:
            self._l3.close()
        self._recorders.clear()
        self._clients.clear()
        self._l3 = None
