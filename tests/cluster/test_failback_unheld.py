"""Held unconfirmed writes whose master stops serving them without a replication
history change the probe could see. On a real Redis Cluster with replicas (a small one
of this module's own: each test fails over a shard of its own, and the failback tests'
cluster has none left).

* The group's slot moved by a migration while X is held on master A: A keeps its
  history, but the probe key of the group (``kvw:{t}``) is no longer A's to take
  (MOVED): nothing could ever confirm X there, nor show a history left.
* A dies and never comes back (its replica took over): the probe by name finds no
  node, or one that cannot be reached (every second: Unavailable, which also failed
  the round's feed poll), and A's last seen history is X's own.

Before: X stayed held (dirty, unevictable, holding the delivered cursor back) until
the bound released it. Now its group is resynced as after a rewind: X pushed again
(to the group's master now), acknowledged, delivered. (Found in the review of the
failback work.)
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from kvcomm.balance.migrate import SlotMover
from kvcomm.devcluster.redis_cluster import RedisCluster, command
from kvcomm.tiers.l3 import DaemonL3, L3Store, feed_key, group_of
from tests.cluster.test_failback import SHORT, _hold, _serving, _shard, _try, _value
from tests.support.daemon_harness import Host, record
from tests.support.helpers import wait_for
from tests.support.servers import starts


@pytest.fixture(scope="module")
@starts("redis")
def cluster() -> Iterator[RedisCluster]:
    with RedisCluster(masters=3) as c:
        yield c


@pytest.fixture
def store(cluster: RedisCluster) -> Iterator[L3Store]:
    s = L3Store(cluster.seeds)
    yield s
    s.close()


def test_a_write_held_on_a_master_whose_slot_moved_is_let_go(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    """X held on A; the group's slot moved to master C (SlotMover: X moves with it).
    A runs the same history, so no history check lets X go, and A refuses the
    group's probe key (MOVED). Asserted: the move (C serves the group, X there), then
    X's group resynced (``unconfirmed_rewound``), X delivered, L3 and the host on X.
    (found in the review of failback)"""
    key, a, b = _shard(store, "moved", seed)
    g = group_of(key)
    h = Host(cluster, f"fbm-{seed % 1000}", seed, SHORT)
    try:
        d = h.daemon
        assert d is not None and isinstance(d.l3, DaemonL3)
        _hold(cluster, h, store, key, a, b)
        c = next(p for p in cluster.master_ports() if p != a)
        SlotMover(store).move(store.rc.keyslot(feed_key(g)), f"127.0.0.1:{c}")
        assert _serving(store, feed_key(g)) == c and _value(store, key) == "v2"
        assert key in d.out.unconfirmed.by_key and d.port.dirty_count() == 1
        d.confirm_at = 0.0
        wait_for(lambda: not d.out.unconfirmed and d.port.dirty_count() == 0, 15,
                 "X to be let go (delivered)")
        assert d.stats.extra.get("unconfirmed_rewound", 0) >= 1, d.stats
        assert d.stats.extra.get("unconfirmed_confirmed", 0) == 0, d.stats
        assert _value(store, key) == "v2" and h.kv.get(key) == "v2"
        assert h.alive, h.error
    finally:
        _try(lambda: command(b, "CONFIG", "SET", "masterauth", '""'))
        h.close()


def test_a_write_held_on_a_master_that_died_for_good_is_let_go(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    """X held on A, then on A's replica B too; A is killed and never restarted: B
    takes over (X survives). A cannot be reached (redis-py may keep it in its slot map,
    or drop it); its last seen history is X's. Asserted: the fault (B serves the
    group in the writer's slot map), then X's group resynced, X delivered, L3 and the
    host on X.
    (found in the review of failback)"""
    key, a, b = _shard(store, "dead", seed)
    g = group_of(key)
    h = Host(cluster, f"fbd-{seed % 1000}", seed, SHORT)
    try:
        d = h.daemon
        assert d is not None and isinstance(d.l3, DaemonL3)
        _hold(cluster, h, store, key, a, b)
        cluster.kill(a)
        wait_for(lambda: _try(lambda: _serving(store, feed_key(g))) == b, 30,
                 "B to take the group's slot over")
        assert _value(store, key) == "v2"  # (X survived)
        rc = d.l3.rc
        wait_for(lambda: (rc.nodes_manager.initialize(),  # (as its next failed call would)
                          _try(lambda: int(rc.get_node_from_key(feed_key(g)).port)) == b)[1],
                 15, "the writer's slot map to show B serving the group")
        assert key in d.out.unconfirmed.by_key
        d.confirm_at = 0.0
        wait_for(lambda: not d.out.unconfirmed and d.port.dirty_count() == 0, 15,
                 "X to be let go (delivered)")
        assert d.stats.extra.get("unconfirmed_rewound", 0) >= 1, d.stats
        assert _value(store, key) == "v2" and h.kv.get(key) == "v2"
        assert h.alive, h.error
    finally:
        _try(lambda: command(b, "CONFIG", "SET", "masterauth", '""'))
        h.close()


def test_a_master_that_refuses_info_is_not_asked_on_every_push(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    """With ``wait_replicas``, a push pipeline asks a master not seen yet for its
    replication history (INFO server and replication). A master that refuses INFO (an
    ACL without it; ``-@dangerous`` would take ROLE too) was asked again in every push
    pipeline: two more commands per push, for good. Asserted: the refusal happened
    (INFO's rejected calls on that node), at most once for a dozen pushes; the pushes
    themselves went through.
    (found in the review of failback)"""
    key = f"fb/noinfo/{seed}"
    port = int(store.rc.get_node_from_key(feed_key(group_of(key))).port)
    s = L3Store(cluster.seeds, wait_replicas=1)
    try:
        assert command(port, "CONFIG", "RESETSTAT").startswith(b"+OK")
        assert command(port, "ACL", "SETUSER", "default", "-info").startswith(b"+OK")
        for n in range(1, 13):
            assert s.push(key, record(f"v{n}", "host-a", n, n)).outcome in ("new", "newer")
        assert not s.histories
    finally:
        command(port, "ACL", "SETUSER", "default", "+info")
        s.close()
    stats = command(port, "INFO", "commandstats").decode()
    rejected = re.search(r"cmdstat_info:.*rejected_calls=(\d+)", stats)
    assert rejected is not None, stats
    assert 1 <= int(rejected.group(1)) <= 2, stats  # (the first pipeline's two)
    assert _value(store, key) == "v12"
