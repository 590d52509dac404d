"""Review of the L3 client's small command table (metrics/wire.py) and the sweep's one-string
answer (SWEEP_LUA), on a Redis Cluster of this module's own (a test pauses a master)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvcomm.devcluster.redis_cluster import RedisCluster
from kvcomm.metrics import wire
from kvcomm.tiers.l3 import L3Store

from .daemon_harness import cluster_fixture  # noqa: F401 (the fixture)

pytestmark = pytest.mark.redis


@pytest.fixture(name="fresh")
def fresh_fixture(cluster: RedisCluster) -> Iterator[L3Store]:
    """A client of a process that has read no command table yet (the part only)."""
    wire._TABLES.clear()
    s = L3Store(cluster.seeds)
    yield s
    s.close()
    wire._TABLES.clear()


def test_a_container_command_missing_from_the_part_table_is_routed_on_first_use(
        cluster: RedisCluster, fresh: L3Store) -> None:
    """MEMORY USAGE and OBJECT ENCODING are named by two words; redis-py, meeting a
    command it has no entry for, reads the whole table but goes on with the name unsplit:
    it finds no key and raised "No way to dispatch this command" on the first use in a
    process (a plain RedisCluster, which starts with the whole table, routes it)."""
    assert not next(iter(wire._TABLES.values()))[1]  # (the client started with the part)
    rc = fresh.rc
    keys = [f"rev22/container/{i}" for i in range(8)]
    for k in keys:
        rc.set(k, b"x" * 100)
    assert "memory" not in rc.commands_parser.commands
    usage = rc.memory_usage(keys[0])  # the first command the part table has no entry for
    assert isinstance(usage, int) and usage > 100
    assert next(iter(wire._TABLES.values()))[1]  # (the whole table was read for it)
    assert all(isinstance(rc.memory_usage(k), int) for k in keys[1:])
    wire._TABLES.clear()
    other = L3Store(cluster.seeds)
    try:
        assert "object" not in other.rc.commands_parser.commands
        assert other.rc.object("encoding", keys[0]) in (b"raw", b"embstr")
    finally:
        other.close()
