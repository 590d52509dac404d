"""What faults act on: a running dev cluster (``kvcomm dev-cluster up``), as one handle.

:class:`DevClusterTarget` reads the cluster's ``cluster.json`` and gives faults the
levers they pull: signal, kill and restart a host's node daemon; find, kill and restart
a Redis Cluster node; an L3 connection; a client and a recording writer per host (for
faults that write, so that their writes are checked like any other). It keeps
``cluster.json`` current (a restarted node's pid), so ``dev-cluster down`` still stops
everything.

``capabilities`` names what this target can do; a fault lists what it ``requires``,
and the nemesis refuses a fault the target cannot serve: ``"etcd"`` (the dev cluster's
etcd members: kill, pause, restart, find the leader), ``"proxy"`` (every host behind its
fault proxy, ``dev-cluster up --proxies``: partition, delay, drop connections, heal) and
``"clock"`` (every host reads a test-only clock offset file: skew one host's clock).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from .._client import Client
from .._client import open as kv_open
from .._extras import require_cluster
from .._wait import wait_until
from ..devcluster import control
from ..devcluster.procs import kill, proc_state, running
from ..devcluster.redis_cluster import cluster_ok, command
from ..errors import Unavailable
from ..tiers.l2 import L2Segment
from ..tiers.l3 import L3Store, feed_key
from .history import HistoryWriter, Recorder


class DevClusterTarget:
    """A dev cluster in ``directory`` (its ``cluster.json``). Not thread-safe."""

    capabilities = frozenset({"daemons", "redis", "l2", "l3"})

    def __init__(self, directory: str | os.PathLike[str],
                 history_dir: str | os.PathLike[str] | None = None) -> None:
        require_cluster("the fault tools")
        self.dir = Path(directory).resolve()
        state = self._state()
        caps = set(type(self).capabilities)
        if state.get("etcd"):
            caps.add("etcd")
        if state["hosts"] and all(h.get("proxy") for h in state["hosts"]):
            caps.add("proxy")
        if state["hosts"] and all(h.get("clock") for h in state["hosts"]):
            caps.add("clock")
        self.capabilities = frozenset(caps)
        self.host_ids: list[str] = [h["host"] for h in state["hosts"]]
        self.configs: list[str] = [h["config"] for h in state["hosts"]]
        self.redis_ports: list[int] = control.redis_ports(state)
        self.history_dir = Path(history_dir) if history_dir is not None else None
        self._clients: dict[int, Client] = {}
        self._probe_clients: dict[int, Client] = {}
        self._recorders: dict[int, Recorder] = {}
        self._l3: L3Store | None = None

    @property
    def hosts(self) -> int:
        return len(self.host_ids)

    def _state(self) -> dict[str, Any]:
        return control.load_state(self.dir)

    # ------------------------------------------------------------------ per host

    def client(self, i: int) -> Client:
        """A client of host ``i`` in this process (opened once)."""
        if i not in self._clients:
            self._clients[i] = kv_open(config=self.configs[i], wait_daemon=False)  # (a tool)
        return self._clients[i]

    def probe_client(self, i: int) -> Client:
        """A client of host ``i`` with the host's own configuration, as its agents have it
        (``cache.negative_ttl`` included: a cached "absent" is never older than what the
        host knows), that does not wait for the host's daemon: probes measure how soon a
        key is seen as a user would see it."""
        if i not in self._probe_clients:
            from ..config import Config

            self._probe_clients[i] = kv_open(config=Config.load(self.configs[i]),
                                             wait_daemon=False)
        return self._probe_clients[i]

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
            wait_until(lambda: proc_state(pid) in ("T", "t", "", "Z"),  # signals are asynchronous
                       max(0.0, deadline - time.monotonic()),
                       f"{self.host_ids[i]}'s daemon (pid {pid}) to stop", interval=0.001)
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
        kill(pid)
        return pid

    def restart_daemon(self, i: int, timeout: float = 30.0) -> int:
        """Start host ``i``'s daemon again; returns its new pid once that process itself
        heartbeats. Raises Unavailable when it exits or stays silent for ``timeout`` s."""
        return control.restart_daemon(str(self.dir), i, timeout)

    def daemon_alive(self, i: int) -> bool:
        return self.segment(i).daemon_alive() and running(self.daemon_pid(i))

    # ------------------------------------------------------------------ Redis Cluster

    def l3(self) -> L3Store:
        if self._l3 is None:
            self._l3 = L3Store([("127.0.0.1", p) for p in self.redis_ports], timeout=2.0)
        return self._l3

    def redis_pid(self, port: int) -> int:
        state = self._state()
        return int(state["redis_pids"][self.redis_ports.index(port)])

    def live_redis(self) -> list[int]:
        return [p for p in self.redis_ports if running(self.redis_pid(p))]

    def cluster_nodes(self) -> list[dict[str, Any]]:
        """CLUSTER NODES as a live node sees it: port, flags, master id, slot ranges."""
        for port in self.live_redis():
            try:
                raw = command(port, "CLUSTER", "NODES")
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
        """SIGKILL the Redis node on ``port``; returns its pid once it is gone."""
        return control.kill_redis(str(self.dir), port)

    def wait_failover(self, port: int, timeout: float = 60.0) -> float:
        """Until the slots of the dead node ``port`` are served by others and every live
        node reports ``cluster_state:ok``. Returns the seconds waited. Raises Unavailable."""
        start = time.monotonic()

        def taken_over() -> bool:
            nodes = self.cluster_nodes()
            dead = [n for n in nodes if n["port"] == port]
            covered = sum(hi - lo + 1 for n in nodes if n["port"] != port
                          and "master" in n["flags"] and "fail" not in n["flags"]
                          for lo, hi in n["slots"])
            return (covered == 16384 and not (dead and dead[0]["slots"])
                    and all(cluster_ok(p) for p in self.live_redis()))

        wait_until(taken_over, timeout, f"a replica to take over from the dead Redis node {port}",
                   interval=0.1, retry_on=(OSError, Unavailable))
        return time.monotonic() - start

    def pause_redis(self, port: int) -> int:
        """SIGSTOP the Redis node on ``port`` (hung: its connections stay open, nothing
        answers); returns its pid."""
        pid = self.redis_pid(port)
        os.kill(pid, signal.SIGSTOP)
        return pid

    def resume_redis(self, pid: int, timeout: float = 60.0) -> None:
        """SIGCONT a node :meth:`pause_redis` stopped, then wait until the cluster is
        whole (failed over meanwhile, it rejoins as its successor's replica)."""
        os.kill(pid, signal.SIGCONT)
        control.wait_redis_whole(str(self.dir), timeout)

    def restart_redis(self, port: int, timeout: float = 60.0) -> int:
        """Start the killed node ``port`` again from its directory (its nodes.conf makes it
        rejoin; having lost its data, it comes back as a replica of the node that took
        over). Returns its pid once the cluster is whole again. Raises Unavailable."""
        return control.restart_redis(str(self.dir), port, timeout)

    # ------------------------------------------------------------------ etcd

    def etcd_members(self) -> int:
        return len(self._state()["etcd"]["pids"])

    def etcd_pid(self, member: int) -> int:
        return int(self._state()["etcd"]["pids"][member])

    def etcd_leader(self, timeout: float = 30.0) -> int:
        """The index of the etcd member leading now (waits for an election to end)."""
        return control.etcd_leader(str(self.dir), timeout)

    def kill_etcd(self, member: int | None = None, leader: bool = False) -> int:
        """SIGKILL an etcd member (``member``, or the leader); returns its index."""
        return control.kill_etcd(str(self.dir), member, leader)

    def pause_etcd(self, member: int) -> int:
        """SIGSTOP an etcd member; returns its pid once it is stopped."""
        return control.pause_etcd(str(self.dir), member)

    def resume_etcd(self, member: int) -> None:
        control.pause_etcd(str(self.dir), member, resume=True)

    def restart_etcd(self, member: int | None = None, timeout: float = 60.0) -> list[int]:
        """Start killed etcd members again; returns once every member is healthy."""
        return control.restart_etcd(str(self.dir), member, timeout)

    # ------------------------------------------------------------------ network, clocks

    def partition(self, i: int, mode: str = "blackhole", delay_ms: float = 0.0) -> dict[str, Any]:
        """Cut host ``i`` off from Redis and etcd (or delay it); returns its proxy's status."""
        return control.partition(str(self.dir), self.host_ids[i], mode, delay_ms)

    def drop_connections(self, i: int) -> int:
        """Reset every live connection of host ``i``; returns how many."""
        return control.drop_connections(str(self.dir), self.host_ids[i])

    def heal_network(self, i: int | None = None) -> None:
        """End the network faults of host ``i`` (default: every host)."""
        control.heal(str(self.dir), None if i is None else self.host_ids[i])

    def proxy_status(self, i: int) -> dict[str, Any]:
        from .proxy import ProxyControl

        return ProxyControl(self._state()["hosts"][i]["proxy"]["control"]).status()

    def set_clock_offset(self, i: int, offset_s: float) -> None:
        """TEST ONLY: move host ``i``'s clock by ``offset_s`` seconds (0: back to true)."""
        control.set_clock_offset(str(self.dir), self.host_ids[i], offset_s)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        for r in self._recorders.values():
            r.sink.close()
        for c in [*self._clients.values(), *self._probe_clients.values()]:
            c.close()
        if self._l3 is not None:
            self._l3.close()
        self._recorders.clear()
        self._clients.clear()
        self._l3 = None
