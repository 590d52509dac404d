"""The suite's scaffolding for real clusters, written once: a dev cluster per module (Redis
Cluster, etcd, one node daemon per host: :func:`dev_cluster_fixture`) with the helpers
every cluster test uses (:func:`host`, :func:`l3`, :func:`live_record`,
:func:`all_live_in_l3`, :func:`l3_value`, :func:`l3_values`, :func:`restart_daemon`,
:func:`kill_daemon`), and a 3-member etcd cluster with agents that reach it alone
(:func:`etcd_fixture`, :class:`StrongHosts`).

A dev cluster lives as long as its module (``scope="module"``): the tests of a module share
it and each test uses keys of its own, so no test depends on the servers being fresh; a
test that kills something restores it itself (see test_cluster.py's ``whole_cluster``).
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import kvcomm
from kvcomm import devcluster
from kvcomm.devcluster.etcd_cluster import EtcdCluster
from kvcomm.tiers import l2
from kvcomm.tiers.l3 import L3Record, L3Store
from tests.support.helpers import wait_for
from tests.support.servers import starts

DevState = dict[str, Any]


def dev_cluster_fixture(hosts: int, *, dirname: str = "devcluster",
                        **up: Any) -> Callable[..., Iterator[DevState]]:
    """A module-scoped fixture: a dev cluster of ``hosts`` hosts started with
    ``devcluster.up(hosts, dir, **up)``, stopped after the module's last test. Its value is
    the cluster's state (see :func:`kvcomm.devcluster.load_state`) plus ``dir`` (the
    directory) and ``groups`` (``cluster.groups``, None for the default). Its tests are
    marked ``redis`` and ``etcd`` (skipped where either is missing). Use as
    ``dev = dev_cluster_fixture(2, ...)``."""

    @pytest.fixture(scope="module")
    @starts("redis", "etcd")
    def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevState]:
        d = tmp_path_factory.mktemp(dirname)
        state = devcluster.up(hosts, str(d), **up)
        state["dir"] = d
        state["groups"] = up.get("groups")
        try:
            yield state
        finally:
            devcluster.down(str(d))

    return dev


def host(dev: DevState, i: int, **cache: Any) -> kvcomm.Client:
    """An agent of host ``i`` (0-based) of ``dev``, with ``cache`` settings over the host's
    own config when given."""
    if not cache:
        return kvcomm.open(config=dev["hosts"][i]["config"])
    data = kvcomm.Config.load(dev["hosts"][i]["config"]).model_dump()
    data["cache"].update(cache)
    return kvcomm.open(config=kvcomm.Config.from_mapping(data))


def l3(dev: DevState) -> L3Store:
    """A direct L3 client of ``dev``'s Redis Cluster, with the cluster's ``groups``."""
    seeds = [(a.rpartition(":")[0], int(a.rpartition(":")[2])) for a in dev["redis"]]
    groups = dev.get("groups")
    return L3Store(seeds) if groups is None else L3Store(seeds, groups=groups)


def live_record(store: L3Store, key: str) -> L3Record | None:
    """L3's record of ``key`` when it is live (None when absent or a tombstone)."""
    rec = store.get(key)
    return rec if rec is not None and not rec.tombstone else None


def all_live_in_l3(store: L3Store, keys: list[str]) -> bool:
    """True when L3 holds a live record of every key of ``keys``."""
    recs = store.get_many(keys)
    return all(r is not None and not isinstance(r, Exception) and not r.tombstone
               for r in recs.values())


def l3_value(store: L3Store, key: str) -> Any:
    """The value L3 holds for ``key`` (None when absent)."""
    rec = store.get(key)
    return None if rec is None else kvcomm.core.codec.decode(rec.tag, rec.meta, rec.value)


def l3_values(store: L3Store, keys: list[str]) -> list[Any]:
    """The values L3 holds for ``keys``, in order (None when absent; a record L3 cannot
    decode raises), read in one pipeline per master (:meth:`L3Store.get_many`)."""
    recs = store.get_many(keys)
    out: list[Any] = []
    for k in keys:
        rec = recs[k]
        if isinstance(rec, Exception):
            raise rec
        out.append(None if rec is None
                    else kvcomm.core.codec.decode(rec.tag, rec.meta, rec.value))
    return out


def restart_daemon(dev: DevState, i: int) -> None:
    """Restart host ``i``'s daemon; ``dev`` then holds its new pid."""
    dev["hosts"][i]["pid"] = devcluster.restart_daemon(str(dev["dir"]), i)


def kill_daemon(dev: DevState, i: int) -> None:
    """SIGKILL host ``i``'s daemon (a crash; :func:`restart_daemon` brings it back)."""
    os.kill(dev["hosts"][i]["pid"], signal.SIGKILL)


def stop_daemon(pid: int, client: kvcomm.Client, tries: int = 100) -> None:
    """SIGSTOP the node daemon ``pid`` at a moment it does not hold its host's L2 writer
    lock (``client``: a client of that host). The daemon takes the lock to mark what it
    delivered clean; stopped inside it, every writer of the host waits
    ``cache.lock_timeout`` and fails (a CI run of test_writes_not_yet_in_l3_appear did).
    These tests mean a daemon that delivers nothing, not a stuck lock: stopped inside it,
    it is let go on and stopped again. Waits for the stop to take effect (kill() returns
    before the process is stopped)."""
    for _ in range(tries):
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: _stopped(pid), 10, f"every thread of process {pid} to stop")
        owner = client._seg.lock_owner()
        if owner == 0 or not os.path.exists(f"/proc/{pid}/task/{owner}"):
            return
        os.kill(pid, signal.SIGCONT)
        wait_for(lambda held=owner: client._seg.lock_owner() != held, 10,
                 "the daemon to leave the lock")
    raise AssertionError(f"daemon {pid} held the writer lock at each of {tries} stops")


def _stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (a group stop reaches them one by one)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "T":
                    return False
        except FileNotFoundError:  # (a thread that ended meanwhile)
            continue
    return True


# ---------------------------------------------------------------- etcd alone


def etcd_fixture() -> Callable[..., Iterator[EtcdCluster]]:
    """A module-scoped fixture: a real 3-member etcd cluster (``EtcdCluster``). Use as
    ``etcd = etcd_fixture()``."""

    @pytest.fixture(scope="module")
    @starts("etcd")
    def etcd() -> Iterator[EtcdCluster]:
        with EtcdCluster() as ec:
            yield ec

    return etcd


class StrongHosts:
    """Agents in cluster mode that reach etcd alone: ``cluster.redis`` points nowhere (no
    Redis answers there, and the tests using these never reach L3), so only strong
    operations work. Each :meth:`open` is a "host" of its own L2 namespace; :meth:`close`
    closes every agent and purges every namespace."""

    def __init__(self, etcd: EtcdCluster, prefixes: list[str], timeout: float,
                 ns_prefix: str = "ts") -> None:
        self.etcd = etcd
        self.prefixes = prefixes
        self.timeout = timeout
        self.ns_prefix = ns_prefix
        self.namespaces: list[str] = []
        self.clients: list[kvcomm.Client] = []

    def config(self, host: str, ns: str, **cache: Any) -> kvcomm.Config:
        """The config of agent ``host`` in namespace ``ns`` (``cache`` over the defaults)."""
        cache = {"l2_size": "16MB", "watch_buffer": 4096, "strong_prefixes": self.prefixes,
                 **cache}
        return kvcomm.Config.from_mapping({
            "node": {"host_id": host, "namespace": ns},
            "cache": cache,
            "cluster": {"redis": ["127.0.0.1:1"], "etcd": self.etcd.addresses,
                        "timeout": self.timeout},
        })

    def new_namespace(self) -> str:
        """A fresh L2 namespace that :meth:`close` purges."""
        ns = f"{self.ns_prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.namespaces.append(ns)
        return ns

    def open(self, host: str, **cache: Any) -> kvcomm.Client:
        """A new agent of ``host`` in a namespace of its own (closed by :meth:`close`)."""
        ns = self.new_namespace()
        c = kvcomm.open(ns, config=self.config(host, ns, **cache), wait_daemon=False)  # (none)
        self.clients.append(c)
        return c

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for ns in self.namespaces:
            l2.purge(ns)


def strong_hosts_fixture(prefixes: list[str], timeout: float,
                         ns_prefix: str) -> Callable[..., Iterator[StrongHosts]]:
    """A function-scoped fixture ``hosts``: a :class:`StrongHosts` on the module's ``etcd``
    fixture, closed after the test."""

    @pytest.fixture
    def hosts(etcd: EtcdCluster) -> Iterator[StrongHosts]:
        h = StrongHosts(etcd, prefixes, timeout, ns_prefix)
        try:
            yield h
        finally:
            h.close()

    return hosts
