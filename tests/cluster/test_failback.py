"""A failback loses a write acknowledged short of its replicas; the master's address
survives it. On a real Redis Cluster with replicas (a small one of this module's own).

With ``cluster.wait_replicas`` 1 and the group's replica cut off (a wrong masterauth:
it cannot reconnect), the host's push of X is acknowledged by none of the replicas
asked for and held unconfirmed (delivery.Unconfirmed). The replica is then forced to
take over (X lost: it never had it); the old master, still up at the same address,
turns into its replica and resyncs from it (losing X too); then a manual failover on
the old master makes it master again, the other its replica. A WAIT on that master now
reaches the target — but counts replicas of a history without X. Confirmation tied to
the master's name (host:port) would deliver X (clean: evictable, its loss no longer
watched for) while L3 has lost it; tied to the replication history X was written in
(run_id and master_replid, seen before the push), the probe finds the master in
another history: a rewind, and X is pushed again.

And when the failover loses nothing (the replica caught up before a clean failover),
the held record's master, now a replica, has left its history too: probed there (not
at the group's new master, whose WAITs never covered it), its group is resynced, the
re-push answered ``equal``, and the record delivered instead of held until the bound.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvcomm.devcluster.redis_cluster import RedisCluster, command
from kvcomm.node.delivery import Unheld
from kvcomm.tiers.l3 import DaemonL3, L3Store, feed_key, group_of
from tests.support.daemon_harness import Host, record
from tests.support.helpers import wait_for
from tests.support.servers import starts

# (lease_ttl: the hosts' polls are held for seconds below, which would otherwise count
# as Redis silent, and partition mode's heal reads every group's counter at once)
SHORT = {"wait_replicas": 1, "wait_timeout": "100ms", "lease_ttl": "120s"}


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


def _info(port: int) -> dict[str, str]:
    """INFO server and replication of the node at ``port``, as a dict."""
    out: dict[str, str] = {}
    for section in ("server", "replication"):
        for line in command(port, "INFO", section).decode().splitlines():
            name, sep, value = line.partition(":")
            if sep:
                out[name] = value.strip()
    return out


def _role(port: int) -> str:
    return _info(port)["role"]


def _history(port: int) -> str:
    """The node's replication history as L3Store.histories spells it."""
    info = _info(port)
    return f"{info['run_id']}:{info['master_replid']}" if info["role"] == "master" else ""


def _replica_of(master: int) -> int:
    info = _info(master)
    return next(int(part.split("=")[1]) for name, value in info.items()
                if name.startswith("slave") and name[5:].isdigit()
                for part in value.split(",") if part.startswith("port="))


def _try(fn: Any) -> Any:
    try:
        return fn()
    except Exception:
        return None


def _serving(store: L3Store, key: str) -> int | None:
    store.rc.nodes_manager.initialize()
    return int(store.rc.get_node_from_key(key).port)


_USED: set[int] = set()  # masters and replicas a test failed over (a shard per test)


def _shard(store: L3Store, name: str, seed: int) -> tuple[str, int, int]:
    """A key of a shard no earlier test used: (the key, its group's master, replica).
    Fails at once when every master was used (a module's cluster has 3 shards)."""
    masters = {int(n.port) for n in store.rc.get_primaries()}
    if masters <= _USED:
        raise AssertionError(f"no shard left: masters {sorted(masters)} were all failed over "
                             "by earlier tests of this module; give the test a cluster of its own")
    for i in range(10**6):
        key = f"fb/{name}/{seed}/{i}"
        master = _try(lambda key=key: _serving(store, feed_key(group_of(key))))
        if master is not None and master not in _USED:
            replica = _replica_of(master)
            _USED.update((master, replica))
            return key, master, replica
    raise AssertionError("no shard left")


def _value(store: L3Store, key: str) -> Any:
    rec = store.get(key)
    return None if rec is None else rec.decode_value(key)


def _hold(cluster: RedisCluster, h: Host, store: L3Store, key: str, a: int, b: int) -> Unheld:
    """v1 on L3 and the host; then X (v2) pushed with A's replica B cut off: held; then B
back and caught up. Returns X as held."""
    d = h.daemon
    assert d is not None and isinstance(d.l3, DaemonL3)
    assert store.push(key, record("v1", "host-a", 1, 1)).outcome == "new"
    wait_for(lambda: h.kv.get(key) == "v1", 15, "the host to hold v1")
    cluster.wait_replicated()
    d.confirm_at = float("inf")  # (the probe waits until the fault is done)
    assert command(b, "CONFIG", "SET", "masterauth", "bogus").startswith(b"+OK")
    command(a, "CLIENT", "KILL", "TYPE", "replica")
    wait_for(lambda: _info(a)["connected_slaves"] == "0", 10, "B to be cut off")
    h.kv.put(key, "v2")
    wait_for(lambda: d.stats.extra.get("unconfirmed_held", 0) >= 1, 10,
             "X to be acknowledged short of its replica, and held")
    x = d.out.unconfirmed.by_key[key]
    assert x.node == f"127.0.0.1:{a}"
    assert command(b, "CONFIG", "SET", "masterauth", '""').startswith(b"+OK")
    wait_for(lambda: _info(a)["connected_slaves"] == "1", 15, "B to be back")
    cluster.wait_replicated()  # (B has X)
    return x


def test_a_failback_does_not_confirm_the_write_it_lost(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    """X, held unconfirmed on master A (its replica B cut off), is lost by a failover
    to B and A's resync from it; A is then made master again, at the same address, B
    its replica. Asserted: the fault (X gone from L3, the group's counter back, A a
    replica then a master again with another replication history, the same process);
    the probe's WAIT there reaching the target confirms nothing (``unconfirmed_confirmed``
    stays 0), the master's new history is a rewind, and X is pushed again: L3, the
    writer, another host and a new host all end on X."""
    key, a, b = _shard(store, "back", seed)
    g = group_of(key)
    h = Host(cluster, f"fb-{seed % 1000}", seed, SHORT)
    reader = Host(cluster, f"fb-reader-{seed % 1000}", seed + 1, SHORT)
    polls: list[tuple[Host, float]] = []
    try:
        d, dr = h.daemon, reader.daemon
        assert d is not None and dr is not None and isinstance(d.l3, DaemonL3)
        assert store.push(key, record("v1", "host-a", 1, 1)).outcome == "new"
        wait_for(lambda: h.kv.get(key) == "v1" and reader.kv.get(key) == "v1", 15,
                 "both hosts to hold v1")
        seq0 = store.feed_seqs([g])[g]
        assert seq0 is not None
        wait_for(lambda: d.inb.seqs.get(g) == seq0 and dr.inb.seqs.get(g) == seq0, 10,
                 "both hosts to read v1's entry")
        cluster.wait_replicated()  # (v1 is on B: only X is lost)
        # nothing reads X's entry, or checks the group's counter (a rewind check would
        # find X's loss by its number, as test_feed_failover's tests show): this test is
        # about the probe, the only check an idle writer has once it has read its own
        # entry; and the probe waits until the failback is done
        for host in (h, reader):
            assert host.daemon is not None
            polls.append((host, host.daemon.inb.poll))
            host.daemon.inb.poll = float("inf")
        d.confirm_at = float("inf")

        # X, acknowledged with none of the replica asked for (B cut off)
        assert command(b, "CONFIG", "SET", "masterauth", "bogus").startswith(b"+OK")
        command(a, "CLIENT", "KILL", "TYPE", "replica")
        wait_for(lambda: _info(a)["connected_slaves"] == "0", 10, "B to be cut off")
        h1 = _history(a)
        h.kv.put(key, "v2")
        wait_for(lambda: d.stats.extra.get("unconfirmed_held", 0) >= 1, 10,
                 "X to be acknowledged short of its replica, and held")
        assert _value(store, key) == "v2"  # (A has X)
        x = d.out.unconfirmed.by_key[key]
        assert x.node == f"127.0.0.1:{a}" and x.seq == seq0 + 1 and x.history == h1, (x, h1)

        # the failover: B (without X) takes over; A, still up, resyncs from it
        assert command(b, "CLUSTER", "FAILOVER", "FORCE").startswith(b"+OK")
        wait_for(lambda: _role(b) == "master" and _try(lambda: _serving(store, feed_key(g))) == b,
                 30, "B to take the group's slot over")
        command(b, "CONFIG", "SET", "masterauth", '""')  # (B may replicate again)
        wait_for(lambda: _info(a).get("role") == "slave"
                 and _info(a).get("master_link_status") == "up"
                 and _info(a).get("master_port") == str(b), 30,
                 "A to be B's replica, in sync")
        assert _try(lambda: _value(store, key)) == "v1"  # (X is gone)
        # the failback: A master again at the same address, B its replica
        assert command(a, "CLUSTER", "FAILOVER").startswith(b"+OK")
        wait_for(lambda: _role(a) == "master" and _try(lambda: _serving(store, feed_key(g))) == a
                 and _info(a)["connected_slaves"] == "1" and _role(b) == "slave", 30,
                 "A to be the group's master again, B its replica")
        wait_for(lambda: _try(lambda: store.feed_seqs([g])[g]) == seq0, 10,
                 "A's counter back at v1's (X's INCR lost)")
        assert _value(store, key) == "v1"  # (X lost by the master at X's own address)
        h3 = _history(a)
        assert h3 != h1 and h3.split(":")[0] == h1.split(":")[0], (h1, h3)  # (same process)
        assert key in d.out.unconfirmed.by_key and d.port.dirty_count() == 1

        # the writer's probe, its slot map refreshed (as its next call's MOVED would)
        d.l3.rc.nodes_manager.initialize()
        d.confirm_at = 0.0
        wait_for(lambda: d.stats.extra.get("repushed", 0) >= 1
                 or d.stats.extra.get("unconfirmed_confirmed", 0) >= 1, 15,
                 "the probe of A to decide about X")
        assert d.stats.extra.get("unconfirmed_confirmed", 0) == 0, d.stats  # (not by A)
        assert d.stats.extra.get("unconfirmed_rewound", 0) >= 1, d.stats
        assert d.stats.extra.get("resync_rewind", 0) >= 1, d.stats
        wait_for(lambda: _try(lambda: _value(store, key)) == "v2", 10, "L3 to hold X again")
        wait_for(lambda: d.port.dirty_count() == 0 and not d.out.unconfirmed, 10,
                 "the re-pushed X acknowledged by B, delivered")
        for host, poll in polls:
            assert host.daemon is not None
            host.daemon.inb.poll = poll
        polls.clear()
        wait_for(lambda: reader.kv.get(key) == "v2", 15, "the other host to take X")
        assert h.kv.get(key) == "v2"
        late = Host(cluster, f"fb-late-{seed % 1000}", seed + 2)
        try:
            assert late.kv.get(key) == "v2"  # (a new host, from L3)
        finally:
            late.close()
        assert d.stats.extra.get("unconfirmed_confirmed", 0) == 0, d.stats
        assert not d.stats.extra.get("partitions") and not dr.stats.extra.get("partitions")
        assert h.alive and reader.alive, (h.error, reader.error)
    finally:
        for host, poll in polls:
            if host.daemon is not None:
                host.daemon.inb.poll = poll
        _try(lambda: command(b, "CONFIG", "SET", "masterauth", '""'))
        reader.close()
        h.close()


def test_a_write_held_on_a_master_that_failed_over_cleanly_is_let_go(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    """X, held unconfirmed on master A (its replica B cut off), reaches B once B is back
    (before any probe confirmed it), and a clean manual failover makes B master: X
    survives. A's WAITs can no longer confirm X (A is a replica), nor can B's (another
    node). The probe of A (the node X was written on) sees it left X's history: its
    group is resynced, X pushed again (``equal``: L3 holds it) and delivered. Nothing
    confirmed X without a replica; nothing lost it."""
    key, a, b = _shard(store, "clean", seed)
    g = group_of(key)
    h = Host(cluster, f"fbc-{seed % 1000}", seed, SHORT)
    try:
        d = h.daemon
        assert d is not None
        x = _hold(cluster, h, store, key, a, b)
        assert x.history == _history(a), x
        assert command(b, "CLUSTER", "FAILOVER").startswith(b"+OK")
        wait_for(lambda: _role(b) == "master" and _try(lambda: _serving(store, feed_key(g))) == b
                 and _role(a) == "slave", 30, "B to be the group's master, A its replica")
        assert _value(store, key) == "v2"  # (X survived)
        assert key in d.out.unconfirmed.by_key  # (still held: nothing confirmed it)
        d.confirm_at = 0.0
        wait_for(lambda: not d.out.unconfirmed and d.port.dirty_count() == 0, 15,
                 "X to be let go (delivered)")
        assert d.stats.extra.get("unconfirmed_rewound", 0) >= 1, d.stats
        assert d.stats.extra.get("repushed", 0) >= 1, d.stats
        assert d.stats.extra.get("unconfirmed_confirmed", 0) == 0, d.stats
        assert _value(store, key) == "v2" and h.kv.get(key) == "v2"
        assert h.alive, h.error
    finally:
        _try(lambda: command(b, "CONFIG", "SET", "masterauth", '""'))
        h.close()


def test_a_restarted_master_does_not_confirm_the_write_it_lost(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    """As the failback, without a failover: master A (its replica B cut off, and told
    not to take over) restarts at the same address from an RDB file saved before X,
    and B resyncs from it. A WAIT on A reaches the target again, in a history without
    X (another run; on Redis 7 another replid too — a restart may reload the replid
    from the RDB file, which is why the run id is part of the history). Asserted: the
    fault (X gone, A another run at the same address), nothing confirmed, X pushed
    again, and L3 and the host end on X."""
    key, a, b = _shard(store, "restart", seed)
    g = group_of(key)
    h = Host(cluster, f"fbr-{seed % 1000}", seed, SHORT)
    poll = 0.0
    try:
        d = h.daemon
        assert d is not None and isinstance(d.l3, DaemonL3)
        assert store.push(key, record("v1", "host-a", 1, 1)).outcome == "new"
        wait_for(lambda: h.kv.get(key) == "v1", 15, "the host to hold v1")
        seq0 = store.feed_seqs([g])[g]
        wait_for(lambda: d.inb.seqs.get(g) == seq0, 10, "the host to read v1's entry")
        cluster.wait_replicated()
        assert command(a, "SAVE").startswith(b"+OK")  # (what the restart reloads: v1)
        poll, d.inb.poll = d.inb.poll, float("inf")  # (no counter check: see the failback)
        d.confirm_at = float("inf")
        assert command(b, "CONFIG", "SET", "cluster-replica-no-failover", "yes").startswith(b"+OK")
        assert command(b, "CONFIG", "SET", "masterauth", "bogus").startswith(b"+OK")
        command(a, "CLIENT", "KILL", "TYPE", "replica")
        wait_for(lambda: _info(a)["connected_slaves"] == "0", 10, "B to be cut off")
        h1 = _history(a)
        h.kv.put(key, "v2")
        wait_for(lambda: d.stats.extra.get("unconfirmed_held", 0) >= 1, 10,
                 "X to be acknowledged short of its replica, and held")
        assert d.out.unconfirmed.by_key[key].history == h1
        cluster.kill(a)
        cluster._start_node(a)
        command(b, "CONFIG", "SET", "masterauth", '""')
        wait_for(lambda: _try(lambda: _role(a)) == "master"
                 and _info(a)["connected_slaves"] == "1"
                 and _try(lambda: _serving(store, feed_key(g))) == a, 30,
                 "A back as the group's master, B its replica")
        assert _try(lambda: _value(store, key)) == "v1"  # (X lost by the restart)
        h2 = _history(a)
        assert h2.split(":")[0] != h1.split(":")[0], (h1, h2)  # (another run)
        d.l3.rc.nodes_manager.initialize()
        d.confirm_at = 0.0
        wait_for(lambda: d.stats.extra.get("repushed", 0) >= 1
                 or d.stats.extra.get("unconfirmed_confirmed", 0) >= 1, 15,
                 "the probe of A to decide about X")
        assert d.stats.extra.get("unconfirmed_confirmed", 0) == 0, d.stats
        assert d.stats.extra.get("unconfirmed_rewound", 0) >= 1, d.stats
        wait_for(lambda: _try(lambda: _value(store, key)) == "v2", 10, "L3 to hold X again")
        wait_for(lambda: d.port.dirty_count() == 0 and not d.out.unconfirmed, 10,
                 "the re-pushed X acknowledged by B, delivered")
        d.inb.poll, poll = poll, 0.0
        assert h.kv.get(key) == "v2" and h.alive, h.error
    finally:
        if poll and h.daemon is not None:
            h.daemon.inb.poll = poll
        _try(lambda: command(b, "CONFIG", "SET", "masterauth", '""'))
        _try(lambda: command(b, "CONFIG", "SET", "cluster-replica-no-failover", "no"))
        h.close()


def test_a_master_that_lost_its_scripts_takes_pushes_again(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    """A restarted master has no scripts: the push script's EVALSHA gets NOSCRIPT, which
    redis-py raises as NoScriptError (its text without the word). The store loads the
    script again and the push goes through (it was refused for good: Unavailable on
    every try, the host's writes never reaching that master)."""
    key = f"fb/noscript/{seed}"
    v = record("v1", "host-a", 1, 1)
    assert store.push(key, v).outcome == "new"
    port = int(store.rc.get_node_from_key(feed_key(group_of(key))).port)
    assert command(port, "SCRIPT", "FLUSH").startswith(b"+OK")
    assert store.push(key, record("v2", "host-a", 2, 2)).outcome == "newer"
    assert _value(store, key) == "v2"
