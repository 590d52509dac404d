"""Review 18: adversarial checks of the write mark, hints carrying their entry,
interest decay, L2 layout 5 and the getter's miss path.

Run alone with ``.venv/bin/python -m pytest -q tests/test_review18.py``.
"""

from __future__ import annotations

import random
import shutil
from typing import Any

import pytest

import kvcomm
from kvcomm.core.versions import MAX_COUNTER
from kvcomm.tiers.l3 import L3Store
from tests.support.daemon_harness import Host, cluster_fixture, store_fixture  # noqa: F401 (fixtures)
from tests.support.helpers import wait_for

needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None,
                                 reason="redis-server is not installed")


@needs_redis
@pytest.mark.parametrize("junk", [str(MAX_COUNTER), str(MAX_COUNTER - 5), "9" * 30, "-7",
                                  "abc", "1e9"])
def test_a_junk_write_mark_never_stops_the_hosts_writes(cluster, store, junk: str) -> None:  # type: ignore[no-untyped-def]
    """A write mark in L3 that no daemon of this host could have written (junk, or so
    near MAX_COUNTER that the host could not write past it) must not lift a new L2's
    write sequence to where every write is refused: the daemon starts, the host's
    writes are acknowledged and reach L3."""
    seed = random.randrange(2**32)
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
    written), never acknowledged with a dot past MAX_COUNTER that L3 refuses."""
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


def _spublish(store: Any, g: int, payload: bytes) -> None:
    """What anything that can publish on the group's hint channel can send."""
    channel = store.groups.hint_channel(g)
    node = store.rc.get_node_from_key(channel)
    store.rc.get_redis_connection(node).execute_command("SPUBLISH", channel, payload)


def _held_and_followed(h: Host, store: L3Store, key: str, big: str) -> int:
    """Put ``key`` from another host, wait until ``h`` holds it and its daemon follows the
    key's group; return the group's last feed sequence number."""
    from kvcomm.tiers.l3 import group_of
    from tests.support.daemon_harness import remote_put

    g = group_of(key)
    remote_put(store, key, f"0{big}", "host-a", 1)
    wait_for(lambda: h.kv.get(key) == f"0{big}", 15, "the host to hold the key")
    wait_for(lambda: h.daemon is not None
             and h.daemon.feed_seqs.get(g) == store.feed_seqs([g])[g], 15,
             "the daemon to follow the group")
    assert h.daemon is not None
    last = h.daemon.feed_seqs[g]
    assert last is not None
    return last


@needs_redis
def test_a_forged_hinted_entry_never_hides_a_real_change(cluster, store) -> None:  # type: ignore[no-untyped-def]
    """A hint carrying an entry that is not in the stream (the group's next sequence
    number, an id far ahead: anything that can SPUBLISH on the channel can send it) is
    followed, so the host's cursor and sequence number jump to it. The real change that
    then takes that sequence number must still reach the host: the sweep (the group's
    counter equals the forged number) has to notice that the stream does not end where
    the host thinks, and the host resyncs."""
    from kvcomm.tiers.l3 import group_of
    from tests.support.daemon_harness import remote_put

    seed = random.randrange(2**32)
    print(f"seed={seed}")
    big = "x" * 1000  # value-less entries (over FEED_INLINE)
    h = Host(cluster, f"fh{seed % 100000}", seed, cluster_keys={"feed_sweep_rate": 2000})
    key = f"fh/{seed}"
    g = group_of(key)
    try:
        last = _held_and_followed(h, store, key, big)
        forged = f"{last + 1} 99999999999999-0 1::host-z {key}".encode()
        _spublish(store, g, forged)
        wait_for(lambda: h.daemon is not None and h.daemon.feed_seqs.get(g) == last + 1, 15,
                 "the daemon to follow the forged entry")
        assert h.daemon.inb.cursors.get(g) == b"99999999999999-0"  # (the fault is in place)
        remote_put(store, key, f"1{big}", "host-a", 2)  # the real change, seq last + 1
        h.kv._l1.clear()
        wait_for(lambda: (h.kv._l1.clear(), h.kv.get(key))[1] == f"1{big}", 20,
                 "the host to serve the real change (it was hidden by the forged hint)")
        assert h.stats.extra.get("hints_false", 0) >= 1, h.stats  # (found by the sweep)
        assert h.alive, h.error
    finally:
        h.close()


@needs_redis
@pytest.mark.parametrize("bad", ["huge", "other_group", "invalid"])
def test_a_hinted_entry_with_a_hostile_key_never_stops_the_daemon(cluster, store, bad: str) -> None:  # type: ignore[no-untyped-def]
    """A hint carrying an entry whose key no client could write (far over the key size
    limit, a key of another group, a key with characters keys may not hold) leaves the
    daemon alive, and the group's real changes still arrive."""
    from kvcomm.tiers.l3 import group_of
    from tests.support.daemon_harness import remote_put

    seed = random.randrange(2**32)
    print(f"seed={seed} bad={bad}")
    big = "x" * 1000
    h = Host(cluster, f"hk{seed % 100000}", seed, cluster_keys={"feed_sweep_rate": 2000})
    key = f"hk/{seed}"
    g = group_of(key)
    try:
        last = _held_and_followed(h, store, key, big)
        ms = int(h.daemon.inb.cursors[g].split(b"-")[0])
        hostile = {"huge": "k" * 2_000_000,
                   "other_group": next(f"o/{i}" for i in range(10**6)
                                       if group_of(f"o/{i}") != g),
                   "invalid": "bad\udcffkey"}[bad]
        payload = f"{last + 1} {ms}-999 1::host-z ".encode() + hostile.encode(
            "utf-8", "surrogateescape")
        before = h.daemon.l3.hint_stats["hints"]
        _spublish(store, g, payload)
        wait_for(lambda: h.daemon is None or not h.alive
                 or h.daemon.l3.hint_stats["hints"] > before, 15,
                 "the daemon to receive the hostile hint")
        remote_put(store, key, f"1{big}", "host-a", 2)
        wait_for(lambda: (h.kv._l1.clear(), h.kv.get(key))[1] == f"1{big}" or not h.alive, 20,
                 "the host to serve the real change")
        assert h.alive, h.error
        assert h.kv.get(key) == f"1{big}"
    finally:
        h.close()


@needs_redis
def test_a_key_read_from_l1_only_is_never_served_stale_after_interest_decays(cluster, store) -> None:  # type: ignore[no-untyped-def]
    """cluster.unread_changes 1: an agent that reads a held key only from its L1 (no L2
    read sets the reference bit) may see it dropped from L2 at the next remote change;
    its next read must then bring the new value, never the old L1 copy."""
    from tests.support.daemon_harness import remote_put

    seed = random.randrange(2**32)
    print(f"seed={seed}")
    big = "x" * 1000
    h = Host(cluster, f"ud{seed % 100000}", seed, cluster_keys={"unread_changes": 1})
    key = f"ud/{seed}"
    try:
        remote_put(store, key, f"0{big}", "host-a", 1)
        wait_for(lambda: h.kv.get(key) == f"0{big}", 15, "the host to hold the key")
        for _ in range(50):  # (L1 hits)
            assert h.kv.get(key) == f"0{big}"
        from kvcomm.tiers.l3 import group_of
        g = group_of(key)
        for i in range(1, 4):  # changes the agent does not read: the key leaves L2
            remote_put(store, key, f"{i}{big}", "host-a", i + 1)
            wait_for(lambda: h.daemon is not None
                     and h.daemon.feed_seqs.get(g) == store.feed_seqs([g])[g], 15,
                     "the daemon to take the change")
        assert h.kv.get(key) == f"3{big}"
        # the fault happened: the key left L2 at a change, unread there
        assert h.stats.extra.get("unread_dropped", 0) >= 1, h.stats
        assert h.alive, h.error
    finally:
        h.close()


@needs_redis
def test_a_push_waits_until_the_write_mark_covering_it_is_replicated(cluster, store) -> None:  # type: ignore[no-untyped-def]
    """cluster.wait_replicas 1: a push is durable only once a replica has it, so a
    failover keeps it; the write mark that covers its dots must be as durable (a failover
    that kept the records but lost the mark would leave dots of this host in L3 past
    the mark: after a reboot the host's new writes could again be covered by them). With
    the replica of the mark's master stopped, the host's first push is not sent (the
    mark could not be replicated); once the replica answers it is, and the replica holds
    a mark covering it."""
    from kvcomm.devcluster.redis_cluster import command

    seed = random.randrange(2**32)
    print(f"seed={seed}")
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


def test_an_agent_opened_before_its_daemon_never_writes_strong_keys_as_eventual(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The agent opens while no daemon runs (nothing to compare with: it opens); the
    daemon then starts with cache.strong_prefixes ["task/"]; the agent's put of a key
    under that prefix must be refused (ConfigError: it has no etcd), not acknowledged
    as an eventual write."""
    import time
    import uuid

    import kvcomm
    from kvcomm.node.presence import status_path, write_status

    ns = f"r18s-{uuid.uuid4().hex[:10]}"
    cfg = kvcomm.Config.from_mapping({
        "node": {"host_id": "h1", "namespace": ns},
        "cache": {"l2_size": "4MB", "l2_dir": str(tmp_path)},
        "cluster": {"redis": ["127.0.0.1:1"], "groups": 16}})
    kv = kvcomm.open(ns, config=cfg, wait_daemon=False)  # no daemon yet: opens (it may)
    try:
        # the daemon starts (the status it publishes, as Daemon.status() writes it)
        write_status(status_path(ns, str(tmp_path)),
                     {"host": "h1", "strong_prefixes": ["task/"], "l3_consistency": "eventual",
                      "updated": time.time()})
        # (the agent reads the status file at most every 50 ms)
        wait_for(lambda: kv._status_reader.status() is not None, 10, "the status to be read")
        with pytest.raises(kvcomm.ConfigError, match="cluster.etcd"):
            kv.put("task/1", "as eventual")
        with pytest.raises(kvcomm.ConfigError, match="cluster.etcd"):
            kv.delete("task/1")
        assert kv._seg.dirty_count == 0  # nothing was written
    finally:
        kv.close()
        from kvcomm.tiers import l2
        l2.purge(ns, str(tmp_path))
    # a daemon without strong keys: the agent's writes go on, and it stops asking
    ns2 = f"r18s-{uuid.uuid4().hex[:10]}"
    cfg2 = kvcomm.Config.from_mapping({
        "node": {"host_id": "h1", "namespace": ns2},
        "cache": {"l2_size": "4MB", "l2_dir": str(tmp_path)},
        "cluster": {"redis": ["127.0.0.1:1"], "groups": 16}})
    kv = kvcomm.open(ns2, config=cfg2, wait_daemon=False)
    try:
        kv.put("task/1", "eventual")  # (no daemon yet: eventual)
        write_status(status_path(ns2, str(tmp_path)),
                     {"host": "h1", "strong_prefixes": [], "l3_consistency": "eventual",
                      "updated": time.time()})
        wait_for(lambda: kv._status_reader.status() is not None, 10, "the status to be read")
        kv.put("task/2", "eventual")
        assert not kv._strong_on and not kv._strong_unknown
        assert kv.get("task/2") == "eventual"
    finally:
        kv.close()
        from kvcomm.tiers import l2
        l2.purge(ns2, str(tmp_path))
