"""Shared fixtures: every test gets its own L2 namespace, purged afterwards."""

from __future__ import annotations

import os
import random
import uuid
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
from hypothesis import settings

import kvcomm
from kvcomm._wait import wait_until
from kvcomm.tiers import l2

from .daemon_harness import SharedRedisCluster

T = TypeVar("T")

# CI machines are shared and noisy: no per-example deadline; a failure prints the blob
# that replays it exactly (@reproduce_failure), as randomised tests here print their seed
settings.register_profile("kvcomm", deadline=None, print_blob=True)
settings.load_profile("kvcomm")

SMALL = {"cache": {"l2_size": "16MB", "watch_buffer": 4096}}


def _replicas_sync_at_once_at_start() -> None:
    """A Redis Cluster the suite starts in this process (``RedisCluster.start``, which
    ``devcluster.up`` calls too) starts its nodes with ``repl-diskless-sync-delay 0``:
    Redis 7's default (5 s) makes each master wait 5 s for more replicas before the full
    sync that ``start`` waits for, so every cluster start cost 5 s more. Once started,
    every node is set back to the default, so what the tests see of replication
    afterwards (failovers, a killed node's rejoin, a failback) is unchanged: with the
    delay at 0 throughout, test_failback's failback test times out. Clusters started by
    a ``kvcomm`` subprocess (test_cli, test_partition, test_devcluster_faults) keep the
    default from their start."""
    from kvcomm.devcluster import redis_cluster

    cls = redis_cluster.RedisCluster
    if getattr(cls.start, "sync_at_once", False):
        return
    base_argv, base_start = redis_cluster.node_argv, cls.start
    starting: list[bool] = []  # (non-empty while a start runs: its nodes get the flag)

    def node_argv(port: int, node_dir: str,
                  node_timeout_ms: int = redis_cluster.NODE_TIMEOUT_MS) -> list[str]:
        argv = base_argv(port, node_dir, node_timeout_ms)
        return [*argv, "--repl-diskless-sync-delay", "0"] if starting else argv

    def start(self: redis_cluster.RedisCluster, timeout: float = 60.0,
              attempts: int = 3) -> redis_cluster.RedisCluster:
        starting.append(True)
        try:
            base_start(self, timeout, attempts)
        finally:
            starting.clear()
        # the 5 s hid that start returns before gossip has told every node which nodes
        # are replicas (a node's CLUSTER NODES still lists them as masters: test_review11's
        # slot mover then met "masters" redis-py did not know): wait until every node
        # lists them all in their roles
        def roles_agree() -> bool:
            for port in self.ports:
                lines = redis_cluster.command(port, "CLUSTER", "NODES").decode().splitlines()
                flags = [line.split()[2].split(",") for line in lines if len(line.split()) >= 8]
                if (len(flags) != len(self.ports) or any(
                        f in fl for fl in flags for f in ("handshake", "noaddr", "fail", "fail?"))
                        or sum("master" in fl for fl in flags) != self.masters):
                    return False
            return True

        wait_until(roles_agree, timeout, "every node to know every node's role", interval=0.05,
                   retry_on=(OSError,))
        for port in self.ports:  # (the default again, for everything after the start)
            reply = redis_cluster.command(port, "CONFIG", "SET", "repl-diskless-sync-delay", "5")
            assert reply.startswith(b"+OK"), (port, reply)
        return self

    start.sync_at_once = True  # type: ignore[attr-defined]
    redis_cluster.node_argv = node_argv
    cls.start = start  # type: ignore[method-assign]


_replicas_sync_at_once_at_start()


@pytest.fixture
def seed() -> int:
    """A random seed for a randomised test, printed (pytest shows it when the test fails)."""
    s = random.randrange(2**32)
    print(f"seed={s}")
    return s


@pytest.fixture
def ns() -> Iterator[str]:
    name = f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    l2.purge(name)


@pytest.fixture
def config() -> kvcomm.Config:
    return kvcomm.Config.from_mapping(SMALL)


@pytest.fixture
def kv(ns: str, config: kvcomm.Config) -> Iterator[kvcomm.Client]:
    client = kvcomm.open(ns, config=config)
    yield client
    client.close()


@pytest.fixture(scope="session")
def shared_redis_cluster() -> Iterator[SharedRedisCluster]:
    """The Redis Cluster that modules taking ``daemon_harness.shared_cluster_fixture``
    share (started on first use, stopped at the session's end)."""
    shared = SharedRedisCluster()
    try:
        yield shared
    finally:
        shared.stop()


def wait_for(cond: Callable[[], T], timeout: float = 10.0, what: str = "condition", *,
             retry_on: tuple[type[BaseException], ...] = ()) -> T:
    """:func:`kvcomm._wait.wait_until` for tests: polls ``cond`` (every 2 ms) until it
    returns a true value, which it returns; fails the test (AssertionError) after
    ``timeout`` seconds. No sleeping-and-hoping."""
    return wait_until(cond, timeout, what, interval=0.002, retry_on=retry_on, error=AssertionError)
