"""In-process node daemons on a real Redis Cluster, for tests that read the daemon's stats.

A :class:`Host` is one host: an L2 namespace, its config, a :class:`NodeDaemon` running
in a thread (stoppable, restartable) and an agent client. Another host's writes are
made by pushing records straight into L3 (:func:`remote_put`), the way its daemon would.
"""

from __future__ import annotations

import random
import threading
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import redis

import kvcomm
from kvcomm.core import codec
from kvcomm.devcluster.redis_cluster import RedisCluster, cluster_ok
from kvcomm.node.daemon import NodeDaemon
from kvcomm.tiers import l2
from kvcomm.tiers.l3 import PUSH_LUA, L3Record, L3Store, feed_key
from tests.support.servers import starts


@pytest.fixture(scope="module", name="cluster")
@starts("redis")
def cluster_fixture() -> Iterator[RedisCluster]:
    """A Redis Cluster of the test module's own: faults injected there stay there."""
    with RedisCluster() as c:
        yield c


@pytest.fixture(scope="module", name="cluster")
def shared_cluster_fixture(shared_redis_cluster: SharedRedisCluster) -> RedisCluster:
    """The suite's one shared Redis Cluster, emptied for this module (see
    :class:`SharedRedisCluster`): for modules that only read and write keys. A module
    that kills, pauses or partitions a node, moves a slot or changes a node's config
    takes :func:`cluster_fixture` (a cluster of its own) instead."""
    return shared_redis_cluster.take()


class SharedRedisCluster:
    """One Redis Cluster (3 masters, 3 replicas, as :func:`cluster_fixture`'s) that the
    modules taking :func:`shared_cluster_fixture` use in turn, so that they pay its start
    (~7 s on 2 cores) once. Each module gets it empty: :meth:`take` runs FLUSHALL on every
    master and waits for the replicas to apply it, so no key, feed stream, cursor, write
    mark or group count of an earlier module is left (what a fresh cluster would hold).
    A module that finds it broken (a node down, a slot unserved) gets a fresh one."""

    def __init__(self) -> None:
        self.cluster: RedisCluster | None = None

    def _whole(self) -> bool:
        c = self.cluster
        if c is None or any(p.poll() is not None for p in c.procs.values()):
            return False
        try:
            return (all(cluster_ok(p) for p in c.ports)
                    and len(c.master_ports()) == c.masters)
        except OSError:
            return False

    def take(self) -> RedisCluster:
        """The cluster, whole and empty (a fresh one when the last module broke it)."""
        if self.cluster is not None and not self._whole():
            warnings.warn("the shared Redis Cluster was broken by the previous module that "
                          "used it: starting a fresh one", stacklevel=1)
            self.stop()
        if self.cluster is None:
            self.cluster = RedisCluster().start()
        c = self.cluster
        for port in c.master_ports():
            # one connection: WAIT counts the replicas that applied this client's FLUSHALL
            # (and asks them at once, where wait_replicated waits for their 1 s ACKs)
            with redis.Redis(host="127.0.0.1", port=port, socket_timeout=30) as r:
                r.flushall()
                acked = r.wait(c.replicas, 20_000)
            assert acked >= c.replicas, f"the replicas of {port} did not apply FLUSHALL"
        return c

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None


@pytest.fixture(name="store")
def store_fixture(cluster: RedisCluster) -> Iterator[L3Store]:
    s = L3Store(cluster.seeds)
    yield s
    s.close()


def host_config(cluster: RedisCluster, host_id: str, ns: str,
                cluster_keys: dict[str, Any] | None = None, **cache: Any) -> kvcomm.Config:
    """A host's config; ``cache`` and ``cluster_keys`` override keys of those sections."""
    return kvcomm.Config.from_mapping({
        "node": {"host_id": host_id, "namespace": ns},
        "cache": {"l2_size": "16MB", "l2_sync_interval": "10ms", "watch_buffer": 4096,
                  "negative_ttl": 0, **cache},
        "cluster": {"redis": [f"127.0.0.1:{p}" for p in cluster.ports], "feed_poll": "10ms",
                    "wait_replicas": 0, **(cluster_keys or {})},
    })


class Host:
    def __init__(self, cluster: RedisCluster, host_id: str, seed: int,
                 cluster_keys: dict[str, Any] | None = None, *, ns: str | None = None,
                 **cache: Any) -> None:
        self.ns = ns or f"td-{uuid.uuid4().hex[:10]}"
        self.config = host_config(cluster, host_id, self.ns, cluster_keys, **cache)
        self.seed = seed
        self.daemon: NodeDaemon | None = None
        self.thread: threading.Thread | None = None
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        try:
            self.start()
            self.kv = kvcomm.open(config=self.config)
        except BaseException:  # (a daemon that refuses to start: its namespace goes too;
            self.stop()  # it was left in /dev/shm at every run of the suite)
            l2.purge(self.ns)
            raise

    def start(self) -> None:
        self.daemon = NodeDaemon(self.config, rng=random.Random(self.seed))
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        assert self.daemon is not None
        try:
            self.daemon.run(self.stop_event)
        except BaseException as exc:  # a test asserts the daemon never died
            self.error = exc

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive() and self.error is None

    def stop(self, close: bool = True) -> None:
        """Stop the loop (and release the daemon, unless ``close`` is False: a daemon
        that stopped beating without saying so, as a killed one does)."""
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(30)
        if close and self.daemon is not None:
            self.daemon.close()
            self.daemon = None

    def close(self) -> None:
        self.stop()
        self.kv.close()
        l2.purge(self.ns)

    @property
    def stats(self) -> Any:
        assert self.daemon is not None
        return self.daemon.stats


def record(value: Any, actor: str, counter: int, hlc: int, vector: Any = None) -> L3Record:
    tag, meta, payload = codec.encode(value)
    vec = tuple(sorted(vector)) if vector is not None else ((actor, counter),)
    return L3Record(hlc, False, tag, bytes(meta), bytes(payload), vec, (actor, counter))


def remote_put(store: L3Store, key: str, value: Any, actor: str, counter: int) -> None:
    """What another host's daemon does for a put: push a newer record into L3."""
    out = store.push(key, record(value, actor, counter, counter))
    assert out.outcome in ("new", "newer"), out.outcome


def atomically(store: L3Store, group: int, merges: list[tuple[str, object, int]],
               trim_to: int, raw: dict[str, bytes] | None = None) -> None:
    """Merge records (``(key, value, counter)``, written as host-a's), set the ``raw``
    Redis keys (bytes no KVCOMM writer made; they must hash to the group's slot) and trim
    the group's stream to ``trim_to`` entries, in one MULTI/EXEC on the group's master: no
    daemon read can fall in between, so what the trimmed entries carried can only reach
    a host by a resync."""
    node = store.rc.get_node_from_key(feed_key(group))
    conn = store.rc.get_redis_connection(node)
    sha = conn.script_load(PUSH_LUA)
    pipe = conn.pipeline(transaction=True)
    for name, data in (raw or {}).items():
        pipe.set(name, data)
    for key, value, counter in merges:
        keys, args = store._args(key, record(value, "host-a", counter, counter), False)
        pipe.evalsha(sha, len(keys), *keys, *args)
    pipe.xtrim(feed_key(group), maxlen=trim_to, approximate=False)
    out = pipe.execute()[len(raw or {}):]
    assert all(r[0][0] in (b"new", b"newer") for r in out[:-1]), out
