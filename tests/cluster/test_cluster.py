"""Cluster mode end to end: real Redis Cluster, real `kvcomm node` daemons, several hosts."""

from __future__ import annotations

import multiprocessing as mp
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

import kvcomm
from kvcomm import devcluster
from kvcomm.tiers.l3 import record_key
from tests.support.devcluster import (
    dev_cluster_fixture,
    host,
    kill_daemon,
    l3,
    l3_value,
    l3_values,
    restart_daemon,
)
from tests.support.helpers import drawn_seed, wait_for

CTX = mp.get_context("fork")


dev = dev_cluster_fixture(3, resolvers={"set/": "tests.support.cluster_resolvers:union"})


@pytest.fixture(autouse=True)
def whole_cluster(dev: dict[str, Any]) -> Iterator[None]:
    """Every test starts, and must end, with every daemon up and the Redis Cluster whole:
    a test that kills something restores it itself (so that no test depends on the order
    they run in), and this checks that it did."""
    yield
    devcluster.wait_redis_whole(str(dev["dir"]), timeout=60)
    for h in dev["hosts"]:
        wait_for(lambda h=h: devcluster.daemon_alive(h["namespace"]), 10,
                 f"{h['host']}'s daemon to be up after the test")


def test_a_put_is_visible_on_every_host(dev: dict[str, Any]) -> None:
    a, b, c = host(dev, 0), host(dev, 1), host(dev, 2)
    try:
        a.put("vis/1", {"pos": [1, 2, 3]})
        wait_for(lambda: b.get("vis/1") == {"pos": [1, 2, 3]}, 10, "host 2 to read host 1's put")
        item = b.get_item("vis/1")
        assert item is not None and item.tier in ("l1", "l2")  # now held in host 2's L2
        a.put("vis/1", {"pos": [4, 5, 6]})  # host 2 holds it: its daemon must refresh it
        wait_for(lambda: b.get("vis/1") == {"pos": [4, 5, 6]}, 10, "the update to reach host 2")
        wait_for(lambda: c.get("vis/1") == {"pos": [4, 5, 6]}, 10, "host 3 to read it")
        assert c.get("vis/absent") is None
        assert c.get("vis/absent") is None
        assert c.stats()["l3"]["negative_hits"] >= 1
    finally:
        a.close(), b.close(), c.close()


def _writer(config: str, seed: int, n: int) -> None:
    rng = random.Random(seed)
    with kvcomm.open(config=config) as kv:
        for i in range(n):
            kv.put(f"conv/{rng.randrange(20)}", {"by": seed, "i": i})
            time.sleep(rng.random() * 0.002)


def test_concurrent_writers_on_three_hosts_converge(dev: dict[str, Any]) -> None:
    seed = drawn_seed(2**32)
    procs = [CTX.Process(target=_writer, args=(h["config"], seed + i, 300))
             for i, h in enumerate(dev["hosts"])]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    clients = [host(dev, i) for i in range(3)]
    store = l3(dev)
    keys = [f"conv/{k}" for k in range(20)]
    try:
        def converged() -> bool:
            truth = [store.get(k) for k in keys]
            for kv in clients:
                for k, rec in zip(keys, truth, strict=True):
                    item = kv.get_item(k)
                    if rec is None or item is None or item.version.vector != rec.vector:
                        return False
                    if item.version.hlc != rec.hlc:
                        return False
            return True

        wait_for(converged, 30, "every host to hold L3's version of every key")
        for k in keys:
            values = {repr(kv.get(k)) for kv in clients}
            assert len(values) == 1, f"{k} differs between hosts: {values}"
    finally:
        store.close()
        for kv in clients:
            kv.close()


def test_resolver_is_honoured_across_hosts(dev: dict[str, Any]) -> None:
    from tests.support.cluster_resolvers import union

    clients = [host(dev, i) for i in range(3)]
    try:
        for kv in clients:
            kv.register_resolver("set/", union)  # agents settle what they merge themselves
        clients[0].put("set/crew", [])
        wait_for(lambda: all(kv.get("set/crew") == [] for kv in clients), 10, "the empty set")
        for kv, member in zip(clients, ("a", "b", "c"), strict=True):
            kv.put("set/crew", [member])  # three concurrent additions
        try:
            wait_for(lambda: all(kv.get("set/crew") == ["a", "b", "c"] for kv in clients), 20,
                     "every host to hold the union")
        except AssertionError:
            print([kv.get_item("set/crew") for kv in clients])
            raise
    finally:
        for kv in clients:
            kv.close()


def test_a_delete_reaches_hosts_that_hold_the_key(dev: dict[str, Any]) -> None:
    a, b, c = host(dev, 0), host(dev, 1), host(dev, 2)
    try:
        a.put("del/k", "a")
        wait_for(lambda: b.get("del/k") == "a", 10, "host 2 to hold the key")
        b.put("del/k", "b")  # the key's vector now names two hosts
        wait_for(lambda: a.get("del/k") == "b" and c.get("del/k") == "b", 10, "the update")
        assert a.delete("del/k") is True
        wait_for(lambda: b.get("del/k") is None and c.get("del/k") is None, 15,
                 "the delete to reach every host")
    finally:
        a.close(), b.close(), c.close()


def test_daemon_kill_and_restart_loses_no_acknowledged_write(dev: dict[str, Any]) -> None:
    a = host(dev, 0)
    store = l3(dev)
    try:
        for i in range(200):
            a.put(f"crash/{i}", i)
            if i == 100:
                kill_daemon(dev, 0)
        restart_daemon(dev, 0)
        wait_for(lambda: all(l3_value(store, f"crash/{i}") == i for i in range(200)), 30,
                 "every acknowledged write to reach L3")
    finally:
        store.close()
        a.close()
        if not devcluster.daemon_alive(dev["hosts"][0]["namespace"]):
            restart_daemon(dev, 0)


def test_bounded_outbound_queue_while_the_daemon_is_down(dev: dict[str, Any]) -> None:
    b = host(dev, 1)
    store = l3(dev)
    try:
        a = host(dev, 0)
        a.put("queue/existing", "v")
        wait_for(lambda: b.get("queue/existing") == "v", 10, "host 2 to hold a clean key")
        a.close()
        kill_daemon(dev, 1)
        written = 0
        with pytest.raises(kvcomm.Unavailable, match="waiting for L3"):
            for i in range(100_000):
                b.put(f"queue/{i}", i)
                b.put(f"queue/{i}", i)  # a rewrite of a waiting key adds nothing to wait for
                written += 1
        assert 0 < written <= 8192  # cluster.outbound_max: keys whose write waits for L3
        with pytest.raises(kvcomm.Unavailable, match="waiting for L3"):
            b.delete("queue/existing")  # deletes count too
        assert b.get("queue/existing") == "v"
        with pytest.raises(kvcomm.Unavailable, match="waiting for L3"):
            with b.batch() as batch:  # and every operation of a batch
                batch.put("queue/a", 1)
        assert b.get("queue/a") is None
        assert all(b.get(f"queue/{i}") == i for i in range(written))  # nothing lost locally
        restart_daemon(dev, 1)

        def accepted() -> bool:
            try:
                b.put("queue/after", 1)
            except kvcomm.Unavailable:
                return False  # still draining
            return True

        wait_for(accepted, 20, "puts to be accepted again")
        queued = [f"queue/{i}" for i in range(written)]
        wait_for(lambda: l3_values(store, queued) == list(range(written)), 60,
                 "every queued write to reach L3")
    finally:
        store.close()
        b.close()
        if not devcluster.daemon_alive(dev["hosts"][1]["namespace"]):
            restart_daemon(dev, 1)


def test_a_foreign_value_in_l3_does_not_stop_the_daemon(dev: dict[str, Any]) -> None:
    c = host(dev, 2)
    store = l3(dev)
    try:
        store.rc.set(record_key("foreign/x"), b"not ours")
        c.put("foreign/x", 1)
        c.put("foreign/y", 2)
        wait_for(lambda: store.get("foreign/y") is not None, 10, "the other key to sync")
        # the put rewrites the foreign value (an acknowledged write is not set
        # aside because what it replaces is not a KVCOMM record)
        wait_for(lambda: store.rc.get(record_key("foreign/x")) != b"not ours", 10,
                 "foreign/x rewritten")
        rec = store.get("foreign/x")
        assert rec is not None and rec.decode_value("foreign/x") == 1
        assert devcluster.daemon_alive(dev["hosts"][2]["namespace"])
    finally:
        store.close()
        c.close()


def test_absent_keys_never_leave_the_host(dev: dict[str, Any]) -> None:
    a, c = host(dev, 0), host(dev, 2)
    try:
        wait_for(lambda: c._key_filter() is not None and c._key_filter().ready, 10,
                 "host 3's daemon to build its key filter")
        before = c.stats()["l3"]["reads"]
        for i in range(3000):
            assert c.get(f"absent/{i}") is None
        s = c.stats()["l3"]
        assert s["reads"] - before <= 3000 * 0.003  # the filter's rate is 0.1%
        assert s["filter_hits"] >= 3000 * 0.997
        a.put("absent/made-later", 1)  # created elsewhere: the feed adds it to the filter
        wait_for(lambda: c.get("absent/made-later") == 1, 10, "the new key to be readable")
    finally:
        a.close(), c.close()


def test_a_dead_daemon_s_key_filter_is_not_trusted(dev: dict[str, Any]) -> None:
    """The filter only learns keys from its daemon: once the daemon is dead, "not in the
    filter" no longer means absent, so agents go to L3 (issue 7, item 6)."""
    a, c = host(dev, 0), host(dev, 2)
    store = l3(dev)
    try:
        wait_for(lambda: c._key_filter() is not None, 10, "host 3's key filter")
        assert c.get("deadfilter/k") is None
        kill_daemon(dev, 2)
        a.put("deadfilter/k", "made while host 3's daemon is dead")
        wait_for(lambda: store.get("deadfilter/k") is not None, 10, "the key to reach L3")
        wait_for(lambda: c.get("deadfilter/k") == "made while host 3's daemon is dead", 10,
                 "host 3 to stop trusting its dead daemon's filter and read L3")
        assert c._key_filter() is None
    finally:
        store.close()
        a.close(), c.close()
        restart_daemon(dev, 2)
    c = host(dev, 2)
    try:  # the restarted daemon's new filter file is picked up and trusted again
        wait_for(lambda: c._key_filter() is not None, 10, "host 3 to trust the new filter")
        assert c._key_filter().may_exist(b"deadfilter/k")
    finally:
        c.close()


def test_resync_after_the_feed_was_trimmed_past_a_stopped_daemon(dev: dict[str, Any]) -> None:
    from kvcomm.tiers.l3 import feed_key, group_of

    a, b = host(dev, 0), host(dev, 1)
    store = l3(dev)
    g = group_of("trim/k")
    try:
        a.put("trim/k", "v1")
        wait_for(lambda: b.get("trim/k") == "v1", 10, "host 2 to hold the key")
        # cursors are saved once a second: wait until host 2 has recorded this position
        wait_for(lambda: store.load_cursors("host-2")[1].get(g) == store.feed_seqs([g])[g],
                 10, "host 2 to save its position in the group's feed")
        kill_daemon(dev, 1)
        a.put("trim/k", "v2")
        wait_for(lambda: (r := store.get("trim/k")) is not None and r.value.endswith(b"v2"),
                 10, "v2 to reach L3")
        store.rc.xtrim(feed_key(g), maxlen=0)  # the feed forgot v2
        assert b.get("trim/k") == "v1"  # stale: its daemon is down
        restart_daemon(dev, 1)
        wait_for(lambda: b.get("trim/k") == "v2", 10, "host 2 to resync from L3")
    finally:
        store.close()
        a.close(), b.close()
        if not devcluster.daemon_alive(dev["hosts"][1]["namespace"]):
            restart_daemon(dev, 1)


def test_dropped_connections_lose_nothing(dev: dict[str, Any]) -> None:
    a, c = host(dev, 0), host(dev, 2)
    store = l3(dev)
    try:
        c.get("drop/9")  # host 3 will hold these keys, so updates must reach it by the feed
        for i in range(10):
            a.put(f"drop/{i}", 0)
        wait_for(lambda: all(c.get(f"drop/{i}") == 0 for i in range(10)), 15, "first sync")
        for round_ in range(1, 4):
            for node in store.rc.get_primaries():
                store.rc.get_redis_connection(node).client_kill_filter(_type="normal",
                                                                       skipme=True)
            for i in range(10):
                a.put(f"drop/{i}", round_)
        wait_for(lambda: all(c.get(f"drop/{i}") == 3 for i in range(10)), 20,
                 "host 3 to see the last round despite dropped connections")
    finally:
        store.close()
        a.close(), c.close()


def test_master_killed_mid_writes_loses_no_acknowledged_write(dev: dict[str, Any]) -> None:
    """A Redis master is SIGKILLed mid-writes; its replica takes over and every
    acknowledged write reaches L3. The killed node is brought back (as a replica) and
    the test ends only once the cluster is whole again."""
    from kvcomm.devcluster.redis_cluster import command

    a = host(dev, 0)
    store = l3(dev)
    victim = store.rc.get_node_from_key(record_key("failover/0")).port
    killed = False
    try:
        for i in range(300):
            a.put(f"failover/{i}", i)
            if i == 150:
                devcluster.kill_redis(str(dev["dir"]), victim)
                killed = True

        def failed_over() -> bool:
            try:
                others = [int(x.rpartition(":")[2]) for x in dev["redis"]
                          if int(x.rpartition(":")[2]) != victim]
                return (all(b"cluster_state:ok" in command(p, "CLUSTER", "INFO") for p in others)
                        and store.rc.get_node_from_key(record_key("failover/0")).port != victim)
            except (OSError, kvcomm.Unavailable):
                return False

        def all_there() -> bool:
            try:
                return all(l3_value(store, f"failover/{i}") == i for i in range(300))
            except kvcomm.Unavailable:
                return False

        wait_for(all_there, 60, "every acknowledged write to be in L3 after the failover")
        wait_for(failed_over, 30, "the replica to have taken over the killed master's slots")
    finally:
        store.close()
        a.close()
        if killed:
            devcluster.restart_redis(str(dev["dir"]), victim, timeout=60)


def test_a_restarted_host_is_prewarmed_with_its_hot_keys(dev: dict[str, Any]) -> None:
    from kvcomm.tiers.l2 import L2Segment, key_hash

    a, b = host(dev, 0), host(dev, 1)
    store = l3(dev)
    ns = dev["hosts"][1]["namespace"]
    try:
        for i in range(5):
            a.put(f"warm/{i}", i)
        wait_for(lambda: b.get("warm/0") == 0, 10, "host 2 to read the key")
        for _ in range(2000):
            b.get("warm/0")
        b.hot_keys(1)  # flush this agent's counts into the host sketch
        wait_for(lambda: "warm/0" in store.load_hot("host-2"), 10,
                 "host 2's daemon to save its hot list")
        assert "warm/3" not in store.load_hot("host-2")
    finally:
        store.close()
        a.close(), b.close()
    kill_daemon(dev, 1)
    kvcomm.tiers.l2.purge(ns)  # the host comes back with an empty L2
    restart_daemon(dev, 1)
    seg = L2Segment(ns, create_layout=None, host_id="")
    try:
        assert seg.read(b"warm/0", key_hash(b"warm/0")) is not None  # there before any read
        assert seg.read(b"warm/3", key_hash(b"warm/3")) is None  # not hot: left to the read path
    finally:
        seg.close()

