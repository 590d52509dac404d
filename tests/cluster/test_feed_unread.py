"""Interest that decays (issue 12, L3 bytes): a host's daemon reads a remote change of a key
its L2 holds from L3 only if an agent of the host read the key since its last change;
otherwise the key leaves L2 (its next read, if any, goes to L3 and fills L2 again).
``cluster.unread_changes`` is how many such changes in a row it takes; 0 (the default)
keeps refreshing every held key. On a real Redis Cluster."""

from __future__ import annotations

from kvcomm.core.versions import Version
from kvcomm.devcluster.redis_cluster import RedisCluster
from kvcomm.tiers.l2 import key_hash
from kvcomm.tiers.l3 import L3Store, group_of
from tests.cluster.test_feed_hints import settled
from tests.support.daemon_harness import Host, record, shared_cluster_fixture, store_fixture  # noqa: F401 (fixtures)
from tests.support.helpers import wait_for

BIG = "x" * 1000  # value-less entries: the record is read from L3 only if wanted


def push(store: L3Store, key: str, value: str, counter: int) -> None:
    out = store.push(key, record(value, "host-a", counter, counter))
    assert out.outcome in ("new", "newer"), out.outcome


def caught_up(h: Host, store: L3Store, key: str) -> None:
    g = group_of(key)
    wait_for(lambda: h.daemon is not None and h.daemon.feed_seqs.get(g) == store.feed_seqs([g])[g],
             10, "the daemon to apply the change")


def in_l2(h: Host, key: str) -> bool:
    """Whether L2 holds ``key``, asked without reading it (a read would count as one)."""
    kb = key.encode()
    return bool(h.kv._seg.take_reads([(kb, key_hash(kb))])[0] != -1)


def test_a_key_no_agent_read_since_its_last_change_leaves_l2(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    h = Host(cluster, "unread", seed, cluster_keys={"unread_changes": 1})
    try:
        key = "unread/k"
        push(store, key, f"0{BIG}", 1)
        wait_for(lambda: h.kv.get(key) == f"0{BIG}", 10, "a read: from L3, into L2")
        caught_up(h, store, key)
        settled(h)
        fetched = h.stats.extra.get("fetched", 0)
        push(store, key, f"1{BIG}", 2)  # read since it came in: refreshed in L2
        caught_up(h, store, key)
        assert h.stats.extra.get("fetched", 0) == fetched + 1
        assert h.stats.extra.get("unread_dropped", 0) == 0
        assert in_l2(h, key)
        push(store, key, f"2{BIG}", 3)  # nobody read 1: not read from L3, dropped from L2
        caught_up(h, store, key)
        assert h.stats.extra.get("unread_dropped", 0) == 1
        assert h.stats.extra.get("fetched", 0) == fetched + 1
        assert not in_l2(h, key)
        item = h.kv.get_item(key)  # the next read: from L3, the latest, into L2 again
        assert item is not None and item.value == f"2{BIG}" and item.tier == "l3"
        settled(h)
        push(store, key, f"3{BIG}", 4)  # read since: refreshed again
        caught_up(h, store, key)
        assert h.stats.extra.get("fetched", 0) == fetched + 2
        item = h.kv.get_item(key)
        assert item is not None and item.value == f"3{BIG}" and item.tier in ("l1", "l2")
        assert h.alive
    finally:
        h.close()


def test_by_default_every_held_key_is_refreshed(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    h = Host(cluster, "keep-unread", seed)  # (cluster.unread_changes: 0)
    try:
        key = "keep-unread/k"
        push(store, key, f"0{BIG}", 1)
        wait_for(lambda: h.kv.get(key) == f"0{BIG}", 10, "a read: from L3, into L2")
        caught_up(h, store, key)
        settled(h)
        fetched = h.stats.extra.get("fetched", 0)
        for i in range(1, 4):  # no reads in between
            push(store, key, f"{i}{BIG}", i + 1)
            caught_up(h, store, key)
        assert h.stats.extra.get("unread_dropped", 0) == 0
        assert h.stats.extra.get("fetched", 0) >= fetched + 1
        item = h.kv.get_item(key)
        assert item is not None and item.value == f"3{BIG}" and item.tier in ("l1", "l2")
    finally:
        h.close()


def test_unread_changes_2_drops_a_key_at_its_second_unread_change(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    h = Host(cluster, "unread-2", seed, cluster_keys={"unread_changes": 2})
    try:
        key = "unread-2/k"
        push(store, key, f"0{BIG}", 1)
        wait_for(lambda: h.kv.get(key) == f"0{BIG}", 10, "a read: from L3, into L2")
        caught_up(h, store, key)
        settled(h)
        fetched = h.stats.extra.get("fetched", 0)
        push(store, key, f"1{BIG}", 2)  # read since it came in: refreshed
        caught_up(h, store, key)
        push(store, key, f"2{BIG}", 3)  # unread once: still refreshed
        caught_up(h, store, key)
        assert h.stats.extra.get("fetched", 0) == fetched + 2
        assert in_l2(h, key) and h.stats.extra.get("unread_dropped", 0) == 0
        push(store, key, f"3{BIG}", 4)  # unread twice in a row: dropped
        caught_up(h, store, key)
        assert h.stats.extra.get("unread_dropped", 0) == 1
        assert not in_l2(h, key)
        assert h.kv.get(key) == f"3{BIG}"
    finally:
        h.close()


def dropped(h: Host, store: L3Store, key: str) -> int:
    """Make ``key`` a dropped one: read once (into L2), then two changes no agent reads
    (``cluster.unread_changes`` 1: the second drops it, its note remembered as skipped).
    Returns the daemon's ``fetched`` count then."""
    push(store, key, f"0{BIG}", 1)
    wait_for(lambda: h.kv.get(key) == f"0{BIG}", 10, "a read: from L3, into L2")
    caught_up(h, store, key)
    settled(h)
    push(store, key, f"1{BIG}", 2)
    caught_up(h, store, key)
    push(store, key, f"2{BIG}", 3)
    caught_up(h, store, key)
    assert h.stats.extra.get("unread_dropped", 0) == 1 and not in_l2(h, key)
    return int(h.stats.extra.get("fetched", 0))


def test_a_dropped_key_read_again_costs_one_get_not_two(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    """The agent's read fills L2 with the latest record; the change the daemon skipped
    meanwhile is covered by it, so the daemon does not read the key again."""
    h = Host(cluster, "unread-once", seed, cluster_keys={"unread_changes": 1})
    try:
        key = "unread-once/k"
        fetched = dropped(h, store, key)
        refills = h.stats.extra.get("refills", 0)
        covered = h.stats.extra.get("refills_covered", 0)  # (the first read's fill: 1)
        item = h.kv.get_item(key)  # from L3: the latest, into L2
        assert item is not None and item.value == f"2{BIG}" and item.tier == "l3"
        settled(h)  # the fill is in the local feed: the skipped change is due
        assert h.stats.extra.get("refills", 0) == refills + 1, "the skipped change was not due"
        assert h.stats.extra.get("refills_covered", 0) == covered + 1, h.stats
        assert h.stats.extra.get("fetched", 0) == fetched
        assert h.kv.get(key) == f"2{BIG}"
    finally:
        h.close()


def test_a_fill_older_than_the_skipped_change_is_still_read_again(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    """The race the refill is for: an agent read the key from L3 before a change and
    filled L2 after the daemon skipped it. The fill does not cover the change: the daemon
    reads the key and L2 ends with the change."""
    h = Host(cluster, "unread-late", seed, cluster_keys={"unread_changes": 1})
    try:
        key = "unread-late/k"
        dropped(h, store, key)
        covered = h.stats.extra.get("refills_covered", 0)
        refills = h.stats.extra.get("refills", 0)
        old = record(f"1{BIG}", "host-a", 2, 2)  # what a read before change 3 returned
        h.kv._merge(key, f"1{BIG}", Version(old.vector, old.hlc),
                    (old.tag, old.meta, old.value), old.local_ext)  # the agent's late fill
        settled(h)
        wait_for(lambda: h.kv.get(key) == f"2{BIG}", 10, "the skipped change over the late fill")
        assert h.stats.extra.get("refills", 0) == refills + 1, h.stats
        assert h.stats.extra.get("refills_covered", 0) == covered, h.stats
    finally:
        h.close()


def test_a_fill_with_a_corrupt_vector_does_not_stop_the_daemon(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    """A skipped change is due when the key is filled; the daemon asks whether L2's record
    covers it (its vector). A record whose stored vector is not one (hostile or broken
    bytes in the shared segment) is that key's problem: set aside and counted, as every
    per-key path of the daemon does, not a SegmentError that ends the daemon (which
    then pushed and read nothing more for the whole host)."""
    from kvcomm._client.base import _now_ms
    from kvcomm.core import codec

    h = Host(cluster, "unread-junk", seed, cluster_keys={"unread_changes": 1})
    try:
        key = "unread-junk/k"
        dropped(h, store, key)
        quarantined = h.stats.quarantined
        kb = key.encode()
        tag, meta, payload = codec.encode(f"1{BIG}")
        # a fill whose vector bytes are no msgpack (0xc1 is never used by msgpack)
        h.kv._seg.apply([(kb, key_hash(kb), tag, meta, payload, 0, 2, b"\xc1", b"")],
                        now_ms=_now_ms(), dirty=False)
        wait_for(lambda: h.stats.quarantined > quarantined or not h.alive, 10,
                 "the daemon to meet the corrupt vector")
        assert h.alive, h.error
        other = "unread-junk/other"  # (and it goes on: a later write is pushed)
        h.kv.put(other, "after")
        wait_for(lambda: store.get(other) is not None, 10, "a later write pushed")
        assert h.alive, h.error
    finally:
        h.close()
