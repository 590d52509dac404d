"""A host's write mark in L3 and its write sequence at the limit: a junk mark never stops
the host's writes, a write with no dot left is refused, a push waits for its mark's
replica."""

from __future__ import annotations

import pytest

import kvcomm
from kvcomm.core.versions import MAX_COUNTER
from tests.support.daemon_harness import Host, cluster_fixture, store_fixture  # noqa: F401 (fixtures)
from tests.support.helpers import drawn_seed, wait_for


@pytest.mark.redis
@pytest.mark.parametrize("junk", [str(MAX_COUNTER), str(MAX_COUNTER - 5), "9" * 30, "-7",
                                  "abc", "1e9"])
def test_a_junk_write_mark_never_stops_the_hosts_writes(cluster, store, junk: str) -> None:  # type: ignore[no-untyped-def]
    """A write mark in L3 that no daemon of this host could have written (junk, or so
    near MAX_COUNTER that the host could not write past it) must not lift a new L2's
    write sequence to where every write is refused: the daemon starts, the host's
    writes are acknowledged and reach L3.
    (found in review 18: write mark, hinted entries, unread changes)"""
    seed = drawn_seed(2**32)
    print(f"seed={seed} junk={junk}")
    host = f"wm{seed % 100000}"
    store.rc.set(f"kvn:{{{host}}}:wseq", junk)
    h = Host(cluster, host, seed)
    try:
        wait_for(lambda: h.daemon is not None and h.daemon.started, 30, "the daemon to start")
        assert h.alive, h.error
        assert h.daemon is not None
        # the daemon read the mark (the fault is in place)
        assert store.rc.get(f"kvn:{{{host}}}:wseq") is not None
        key = f"wm/{seed}"
        for i in range(3):
            h.kv.put(key, f"v{i}")
        wait_for(lambda: h.kv._seg.dirty_count == 0, 30, "the writes to reach L3")
        rec = store.get(key)
        assert rec is not None and rec.dot[0] == host
        assert h.kv._seg.write_sequence < MAX_COUNTER // 2, h.kv._seg.write_sequence
        assert h.alive, h.error
    finally:
        h.close()


@pytest.mark.parametrize("how", ["raised", "merged"])
def test_a_write_with_no_dot_left_is_refused_not_acknowledged(kv, how: str) -> None:  # type: ignore[no-untyped-def]
    """A host's write sequence lifted to MAX_COUNTER (raise_write_sequence, or a merged
    version naming this host's dot there: what a junk mark or a hostile record does)
    leaves no dot for the next write: the put is refused (a KVCommError, nothing
    written), never acknowledged with a dot past MAX_COUNTER that L3 refuses.
    (found in review 18: write mark, hinted entries, unread changes)"""
    from kvcomm.core.versions import Version

    kv.put("k", "before")
    if how == "raised":
        kv._seg.raise_write_sequence(MAX_COUNTER)
    else:
        kv.merge_remote("other", "x", Version(((kv._host, MAX_COUNTER),), 1 << 40))
    assert kv._seg.write_sequence == MAX_COUNTER  # (the fault is in place)
    with pytest.raises(kvcomm.KVCommError):
        kv.put("k", "after")
    with pytest.raises(kvcomm.KVCommError):
        kv.delete("k")
    kv._l1.clear()
    assert kv.get("k") == "before"
    assert kv._seg.write_sequence == MAX_COUNTER


@pytest.mark.redis
def test_a_push_waits_until_the_write_mark_covering_it_is_replicated(cluster, store) -> None:  # type: ignore[no-untyped-def]
    """cluster.wait_replicas 1: a push is durable only once a replica has it, so a
    failover keeps it; the write mark that covers its dots must be as durable (a failover
    that kept the records but lost the mark would leave dots of this host in L3 past
    the mark: after a reboot the host's new writes could again be covered by them). With
    the replica of the mark's master stopped, the host's first push is not sent (the
    mark could not be replicated); once the replica answers it is, and the replica holds
    a mark covering it.
    (found in review 18: write mark, hinted entries, unread changes)"""
    from kvcomm.devcluster.redis_cluster import command

    seed = drawn_seed(2**32)
    host = f"wr{seed % 100000}"
    mark_name = f"kvn:{{{host}}}:wseq"
    mark_node = store.rc.get_node_from_key(mark_name)
    key = next(f"wr/{seed}/{i}" for i in range(10**6)
               if store.rc.get_node_from_key(f"wr/{seed}/{i}").port != mark_node.port)
    info = command(mark_node.port, "INFO", "replication").decode()
    replica = next(int(part.split("=")[1]) for line in info.splitlines()
                   if line.startswith("slave") for part in line.split(",")
                   if part.startswith("port="))
    h = Host(cluster, host, seed, cluster_keys={"wait_replicas": 1, "wait_timeout": "100ms"})
    paused = False
    try:
        wait_for(lambda: h.daemon is not None and h.daemon.started, 30, "the daemon to start")
        cluster.pause(replica)
        paused = True
        h.kv.put(key, "v")
        wait_for(lambda: store.get(key) is not None or h.stats.l3_errors >= 1, 30,
                 "the daemon to try its first push")
        assert store.get(key) is None, \
            "pushed while the write mark covering it was not on any replica"
        assert h.stats.l3_errors >= 1  # (the mark's save was refused: the fault happened)
        cluster.resume(replica)
        paused = False
        wait_for(lambda: h.kv._seg.dirty_count == 0, 30, "the push once the replica answers")
        rec = store.get(key)
        assert rec is not None and rec.dot[0] == host
        assert store.load_write_mark(host) >= rec.dot[1]
        assert h.alive, h.error
    finally:
        if paused:
            cluster.resume(replica)
        h.close()
