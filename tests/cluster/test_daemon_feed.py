"""A running daemon notices a group stream that lost entries (trimmed, or rewound by a
failover) on every read, resyncs that group, and serves the new values."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvcomm.core import codec
from kvcomm.core.versions import vector_get, with_dot
from kvcomm.devcluster.redis_cluster import RedisCluster
from kvcomm.tiers.l3 import GROUPS, PUSH_LUA, L3Record, L3Store, feed_key, group_of, seq_key
from tests.support.daemon_harness import (  # noqa: F401 (fixtures)
    Host,
    atomically,
    record,
    remote_put,
    shared_cluster_fixture,
    store_fixture,
)
from tests.support.helpers import drawn_seed, wait_for


@pytest.fixture
def host(cluster: RedisCluster) -> Iterator[Host]:
    seed = drawn_seed(2**32)
    h = Host(cluster, "host-b", seed)
    yield h
    h.close()


def same_group_keys(prefix: str, n: int) -> list[str]:
    """``n`` keys of one group (so that one stream holds all their changes)."""
    keys: list[str] = []
    g = group_of(f"{prefix}/0")
    i = 0
    while len(keys) < n:
        k = f"{prefix}/{i}"
        if group_of(k) == g:
            keys.append(k)
        i += 1
    return keys


def hold(host: Host, store: L3Store, key: str, value: object) -> int:
    """Until the host holds ``key`` at ``value`` in L2 and its daemon has read the key's
    group feed up to date; returns the group."""
    wait_for(lambda: host.kv.get(key) == value, 10, f"host b to hold {key}")
    item = host.kv.get_item(key)
    assert item is not None and item.tier in ("l1", "l2")
    g = group_of(key)
    wait_for(lambda: host.daemon is not None
             and host.daemon.feed_seqs[g] == store.feed_seqs([g])[g],
             10, "the daemon to read the group's feed up to date")
    return g


def test_a_gap_in_a_running_daemon_s_feed_is_resynced(host: Host, store: L3Store) -> None:
    k, other = same_group_keys("gap", 2)
    remote_put(store, k, "v1", "host-a", 1)
    g = hold(host, store, k, "v1")
    before = host.stats.resyncs
    # v2 of k and a change of another key, then the stream keeps only the last entry:
    # the daemon's next read starts at sequence last + 2
    atomically(store, g, [(k, "v2", 2), (other, "x", 1)], trim_to=1)
    wait_for(lambda: host.kv.get(k) == "v2", 10, "host b to serve v2 after a resync")
    assert host.stats.resyncs > before
    assert host.stats.extra.get("resync_gap", 0) >= 1
    assert host.alive


def test_a_stream_trimmed_to_nothing_is_resynced(host: Host, store: L3Store) -> None:
    (k,) = same_group_keys("empty", 1)
    remote_put(store, k, "v1", "host-a", 1)
    g = hold(host, store, k, "v1")
    before = host.stats.resyncs
    # XTRIM while the daemon is running and holding the key: every read now returns
    # nothing, so only the group counter tells that a change was missed
    atomically(store, g, [(k, "v2", 2)], trim_to=0)
    assert store.rc.xlen(feed_key(g)) == 0
    wait_for(lambda: host.kv.get(k) == "v2", 10, "host b to serve v2 after a resync")
    assert host.stats.resyncs > before
    assert host.alive


def test_a_stream_that_went_backwards_is_resynced(host: Host, store: L3Store) -> None:
    (k,) = same_group_keys("rewind", 1)
    remote_put(store, k, "v1", "host-a", 1)
    g = hold(host, store, k, "v1")
    before = host.stats.extra.get("resync_rewind", 0)
    # what a failover that lost the latest entries looks like: the stream and its
    # counter are behind what the daemon read (here: gone altogether)
    node = store.rc.get_node_from_key(feed_key(g))
    conn = store.rc.get_redis_connection(node)
    pipe = conn.pipeline(transaction=True)
    pipe.delete(feed_key(g), seq_key(g))
    keys, args = store._args(k, record("v2", "host-a", 2, 2), False)
    pipe.eval(PUSH_LUA, len(keys), *keys, *args)
    pipe.execute()
    assert store.feed_seqs([g])[g] == 1
    wait_for(lambda: host.kv.get(k) == "v2", 10, "host b to serve v2")
    wait_for(lambda: host.stats.extra.get("resync_rewind", 0) > before, 10, "a rewind resync")
    assert host.daemon is not None and host.daemon.feed_seqs[g] == store.feed_seqs([g])[g]


def test_a_new_host_starts_at_each_group_s_current_sequence(cluster: RedisCluster,
                                                            store: L3Store) -> None:
    for i in range(20):
        remote_put(store, f"fresh/{i}", i, "host-a", 1)
    seqs = store.feed_seqs(range(GROUPS))
    h = Host(cluster, "host-new", 1)
    try:
        assert h.daemon is not None
        assert {g: s for g, s in h.daemon.feed_seqs.items()} == seqs
        assert h.stats.resyncs == 0  # a fresh start is not a resync
        remote_put(store, "fresh/0", "later", "host-a", 2)
        assert h.kv.get("fresh/0") == "later"  # (read path) and now held
        remote_put(store, "fresh/0", "later still", "host-a", 3)
        wait_for(lambda: h.kv.get("fresh/0") == "later still", 10, "the feed to carry it")
        assert h.stats.resyncs == 0
    finally:
        h.close()


def test_a_restarted_daemon_resumes_its_sequence_and_sees_what_it_missed(
        host: Host, store: L3Store) -> None:
    k, other = same_group_keys("resume", 2)
    remote_put(store, k, "v1", "host-a", 1)
    g = hold(host, store, k, "v1")
    host.stop()  # a clean stop saves cursors and sequence numbers
    saved_cursors, saved_seqs = store.load_cursors("host-b")
    assert saved_seqs[g] == store.feed_seqs([g])[g]
    atomically(store, g, [(k, "v2", 2), (other, "y", 1)], trim_to=1)
    host.start()
    wait_for(lambda: host.kv.get(k) == "v2", 10, "the restarted daemon to resync")
    assert host.stats.extra.get("resync_gap", 0) >= 1


# A resync re-reads the keys the host holds as tombstones too: a key deleted here and
# written again elsewhere while the daemon missed the feed must come back, not stay
# "deleted" on this host for good (its agents answer a tombstone without asking L3).


def deleted_here(host: Host, store: L3Store, key: str) -> L3Record:
    """The host holds ``key``, deletes it, and L3 has the tombstone; returns a record
    of another host's that supersedes that tombstone."""
    remote_put(store, key, "v1", "host-a", 1)
    wait_for(lambda: host.kv.get(key) == "v1", 10, "the host to hold the key")
    host.kv.delete(key)
    wait_for(lambda: (r := store.get(key)) is not None and r.tombstone, 10, "the delete in L3")
    tomb = store.get(key)
    assert tomb is not None
    vector = with_dot(tomb.vector, "host-a", vector_get(tomb.vector, "host-a") + 1)
    return record("v2", "host-a", vector_get(vector, "host-a"), tomb.hlc + 1, vector)


def test_a_gap_brings_back_a_key_the_host_holds_deleted(host: Host, store: L3Store) -> None:
    key = "tomb/gap"
    v2 = deleted_here(host, store, key)
    g = group_of(key)
    before = host.stats.extra.get("resync_gap", 0)
    conn = store.rc.get_redis_connection(store.rc.get_node_from_key(feed_key(g)))
    pipe = conn.pipeline(transaction=True)  # pushed and trimmed away before any read
    keys, args = store._args(key, v2, False)
    pipe.eval(PUSH_LUA, len(keys), *keys, *args)
    pipe.xtrim(feed_key(g), maxlen=0, approximate=False)
    assert pipe.execute()[0][0][0] == b"newer"
    wait_for(lambda: host.stats.extra.get("resync_gap", 0) > before, 10, "a gap resync")
    wait_for(lambda: host.kv.get(key) == "v2", 10, "the key to come back after the resync")


def test_a_fresh_start_brings_back_a_key_the_host_holds_deleted(host: Host,
                                                                store: L3Store) -> None:
    key = "tomb/fresh"
    v2 = deleted_here(host, store, key)
    host.stop()
    store.rc.delete("kvn:{host-b}:cursors")  # no saved cursors: every group starts afresh
    assert store.push(key, v2).outcome == "newer"
    host.start()
    wait_for(lambda: host.kv.get(key) == "v2", 10, "the key to come back after the start")


def test_the_extension_field_travels_between_l2_and_l3(host: Host, store: L3Store) -> None:
    """The one extension map rides with its write: pushed from L2 into L3's ``x``, pulled
    from L3 into L2 (a change of a key held here, and an L2 miss's fill), byte for byte."""
    import msgpack

    from kvcomm.tiers.l2 import key_hash

    seg = host.kv._seg
    x = msgpack.packb({"agent": "drone-7", "later": {"k": [1, 2]}})
    kb = b"ext/pushed"
    seg.apply([(kb, key_hash(kb), codec.BYTES, b"", b"v", x)], now_ms=1, dirty=True)
    wait_for(lambda: (r := store.get("ext/pushed")) is not None and r.ext == x, 10,
             "the write and its extension in L3")
    wait_for(lambda: seg.dirty_count == 0, 10, "the write to be delivered")

    remote_put(store, "ext/pulled", b"v1", "host-a", 40)
    hold(host, store, "ext/pulled", b"v1")  # the host holds it: remote changes are merged
    y = msgpack.packb({"agent": "robot-2"})
    out = store.push("ext/pulled", record(b"v2", "host-a", 50, 50)._replace(ext=y))
    assert out.outcome in ("new", "newer"), out.outcome
    wait_for(lambda: host.kv.get("ext/pulled") == b"v2", 10, "the remote change")
    assert seg.version(b"ext/pulled", key_hash(b"ext/pulled"))[7] == y

    out = store.push("ext/filled", record(b"w", "host-a", 60, 60)._replace(ext=y))
    assert out.outcome == "new"
    wait_for(lambda: host.kv.get("ext/filled") == b"w", 10, "an L2 miss's read of L3")
    assert seg.version(b"ext/filled", key_hash(b"ext/filled"))[7] == y
