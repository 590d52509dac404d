"""One hung Redis master (SIGSTOP, and a node timeout long enough that the cluster does
not fail it over meanwhile) must not stop the rest of the cluster's traffic: the other
masters' pushes, feed reads and sweeps go on, no host enters partition mode, and what
was written for the hung master's keys is delivered once it answers again — nothing
acknowledged is lost.

Before ``L3Store.down``, every push and poll of a daemon waited a timeout on the hung
master (a push's pipelines are answered together; a poll reads every hinted group), so
for the whole hang no write of any key reached another host, and every host entered
partition mode after its lease TTL.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from kvcomm.devcluster.redis_cluster import RedisCluster
from kvcomm.node.daemon import NodeDaemon
from kvcomm.tiers.l3 import L3Store, Unreached, feed_key, group_of
from tests.support.daemon_harness import Host, record
from tests.support.helpers import wait_for

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed"),
]

HUNG_NODE_TIMEOUT_MS = 120_000  # no failover while a test holds its master stopped


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    with RedisCluster(masters=3, replicas=0, node_timeout_ms=HUNG_NODE_TIMEOUT_MS) as c:
        yield c


def _master_port(store: L3Store, key: str) -> int:
    return int(store.rc.get_node_from_key(key).port)


def _l2_daemon(h: Host) -> NodeDaemon:
    assert h.daemon is not None
    return h.daemon


def test_push_many_and_the_feed_reads_go_on_without_a_hung_master(
        cluster: RedisCluster, seed: int) -> None:
    """L3Store alone: with one master stopped, push_many answers the other masters'
    records and gives Unreached for the stopped one's (the first call waits one timeout
    for it, later ones not at all: it is down); feed_heads and feed_many leave its groups
    out, and raise Unreached when they have nothing else; once it answers a PING again
    it is used again, and its records are pushed as new (they were never sent)."""
    store = L3Store(cluster.seeds, timeout=1.0)
    try:
        keys = [f"hm/{seed}/{i}" for i in range(60)]
        port = {k: _master_port(store, feed_key(group_of(k))) for k in keys}
        victim = port[keys[0]]
        hung = [k for k in keys if port[k] == victim]
        healthy = [k for k in keys if port[k] != victim]
        assert hung and healthy
        cluster.pause(victim)
        try:
            for attempt in range(2):  # the first waits for the stopped master, then not
                out = store.push_many([(k, record(f"v{attempt}", "h", attempt + 1, attempt + 1))
                                       for k in keys])
                got = dict(zip(keys, out, strict=True))
                assert all(isinstance(got[k], Unreached) for k in hung), attempt
                assert all(not isinstance(got[k], Exception) and got[k].outcome in ("new", "newer")
                           for k in healthy), attempt
                assert f"127.0.0.1:{victim}" in store.down
            groups = {group_of(k) for k in keys}
            heads = store.feed_heads(groups)
            assert set(heads) == {group_of(k) for k in healthy}
            assert all(heads[group_of(k)][0] for k in healthy)  # (a change each)
            feeds = store.feed_many({group_of(k): b"0-0" for k in keys})
            assert set(feeds) == {group_of(k) for k in healthy}
            with pytest.raises(Unreached):
                store.feed_heads({group_of(k) for k in hung})
            with pytest.raises(Unreached):
                store.feed_many({group_of(k): b"0-0" for k in hung})
            with pytest.raises(Unreached):
                store.push(hung[0], record("v9", "h", 9, 9))
            with pytest.raises(Unreached):
                store.get(hung[0])
        finally:
            cluster.resume(victim)
        wait_for(lambda: not store.down, 15, "the resumed master to answer a PING")
        out = store.push_many([(k, record("v1", "h", 2, 2)) for k in keys])
        got = dict(zip(keys, out, strict=True))
        assert all(got[k].outcome == "new" for k in hung)  # (never sent before)
        assert all(got[k].outcome == "equal" for k in healthy)
        assert all(store.get(k).decode_value(k) == "v1" for k in keys)
    finally:
        store.close()


def test_hosts_keep_exchanging_writes_while_one_master_hangs(
        cluster: RedisCluster, seed: int) -> None:
    """Two hosts; the master of host A's own keys (its cursors, write mark, hot keys,
    agent reports) and of some of the test's keys is stopped. A's writes of the other
    keys reach B, round after round, while it stays stopped; neither host enters
    partition mode. Asserted that the fault happened: A's daemon took the master for
    down and left writes unsent (``unreached``). After SIGCONT, B and L3 end on every
    write A acknowledged, the hung master's keys included."""
    a = Host(cluster, f"hm-a-{seed % 1000}", seed)
    b = Host(cluster, f"hm-b-{seed % 1000}", seed + 1)
    try:
        da, db = _l2_daemon(a), _l2_daemon(b)
        assert isinstance(da.l3, L3Store)
        store = da.l3
        victim = _master_port(store, f"kvn:{{{a.config.node.host_id}}}:cursors")
        keys = [f"hmh/{seed}/{i}" for i in range(45)]
        port = {k: _master_port(store, feed_key(group_of(k))) for k in keys}
        hung = [k for k in keys if port[k] == victim]
        healthy = [k for k in keys if port[k] != victim]
        assert hung and healthy, "the keys must span the stopped master and the others"
        for k in keys:
            a.kv.put(k, "v0")
        wait_for(lambda: all(b.kv.get(k) == "v0" for k in keys), 20, "B to hold every key")
        cluster.pause(victim)
        try:
            for n in range(1, 4):  # rounds: the flow goes on, not only the first push
                for k in keys:
                    a.kv.put(k, f"v{n}")
                wait_for(lambda n=n: all(b.kv.get(k) == f"v{n}" for k in healthy), 20,
                         f"B to see round {n} of the other masters' keys")
            assert f"127.0.0.1:{victim}" in store.down  # the fault was seen
            assert da.stats.extra.get("unreached", 0) > 0  # writes were held, not sent
            assert all(b.kv.get(k) == "v0" for k in hung)  # (nothing came from it)
            assert not da.reach.partition and not db.reach.partition
            assert a.alive and b.alive
        finally:
            cluster.resume(victim)
        wait_for(lambda: all(b.kv.get(k) == "v3" for k in keys), 30,
                 "B to see the hung master's keys once it answers")
        check = L3Store(cluster.seeds)
        try:
            assert all(check.get(k).decode_value(k) == "v3" for k in keys)
        finally:
            check.close()
        wait_for(lambda: not store.down, 15, "A to use the master again")
        assert not da.reach.partition and not db.reach.partition
        assert a.alive and b.alive, (a.error, b.error)
    finally:
        a.close()
        b.close()
