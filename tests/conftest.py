"""Shared fixtures: every test gets its own L2 namespace, purged afterwards."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from hypothesis import settings

import kvcomm
from kvcomm.tiers import l2
from tests.support.daemon_harness import SharedRedisCluster
from tests.support.helpers import SMALL, drawn_seed
from tests.support.servers import missing, started_by, starts

# CI machines are shared and noisy: no per-example deadline; a failure prints the blob
# that replays it exactly (@reproduce_failure), as randomised tests here print their seed
settings.register_profile("kvcomm", deadline=None, print_blob=True)
settings.load_profile("kvcomm")


@pytest.fixture
def seed() -> int:
    """A random seed for a randomised test, printed (pytest shows it when the test fails);
    ``KVCOMM_TEST_SEED=N`` runs it again with seed N."""
    return drawn_seed(2**32)


@pytest.fixture
def ns() -> Iterator[str]:
    name = f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    l2.purge(name)


@pytest.fixture
def name() -> Iterator[str]:
    n = f"r7-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield n
    l2.purge(n)


@pytest.fixture
def config() -> kvcomm.Config:
    return kvcomm.Config.from_mapping(SMALL)


@pytest.fixture
def kv(ns: str, config: kvcomm.Config) -> Iterator[kvcomm.Client]:
    client = kvcomm.open(ns, config=config)
    yield client
    client.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Markers by fixture use, and one skip for a missing server: a test using a fixture
    that starts Redis or etcd (``tests.support.servers.starts``), directly or through
    another fixture, is marked ``redis`` or ``etcd``; a test marked so (by a fixture or by
    its own decorator) is skipped where that server's binary is missing."""
    absent = missing()
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        for defs in info.name2fixturedefs.values() if info is not None else ():
            for d in defs:
                for marker in started_by(d.func):
                    if item.get_closest_marker(marker) is None:
                        item.add_marker(marker)
        for marker, why in absent.items():
            if item.get_closest_marker(marker) is not None:
                item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session")
@starts("redis")
def shared_redis_cluster() -> Iterator[SharedRedisCluster]:
    """The Redis Cluster that modules taking ``daemon_harness.shared_cluster_fixture``
    share (started on first use, stopped at the session's end)."""
    shared = SharedRedisCluster()
    try:
        yield shared
    finally:
        shared.stop()
