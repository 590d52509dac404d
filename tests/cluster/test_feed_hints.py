"""Hints that carry their feed entry (issue 12, L3 bytes): the hint of a value-less change
is ``<seq> <id> <note> <key>``, and a daemon that follows the group's sequence applies it
without reading the group's stream (XRANGE). Whatever breaks the sequence — a hint that
never came, a trimmed stream, a stream that went back, a daemon restarted — makes the
daemon read the stream (and resync from it where it must), as a plain hint does: a lost
hint costs a read, never a change. On a real Redis Cluster."""

from __future__ import annotations

from typing import Any

import pytest

from kvcomm.devcluster.redis_cluster import RedisCluster
from kvcomm.tiers.l3 import PUSH_LUA, FeedNote, L3Store, feed_key, group_of, seq_key
from tests.cluster.test_daemon_feed import same_group_keys
from tests.support.daemon_harness import Host, record, shared_cluster_fixture, store_fixture  # noqa: F401 (fixtures)
from tests.support.helpers import wait_for

BIG = "x" * 1000  # a record far over FEED_INLINE: its entry is value-less
NO_SWEEP = {"feed_sweep_rate": 1}  # a sweep slice every 256 s: only hints (and gaps) find changes


def feed_bytes(h: Host) -> int:
    assert h.daemon is not None
    return sum(h.daemon.wire_by.get("feed", [0, 0]))


def push(store: L3Store, key: str, value: Any, counter: int, hint: bool = True) -> None:
    """A push of another host's write; ``hint`` False: its hint is lost (never sent)."""
    if hint:
        out = store.push(key, record(value, "host-a", counter, counter))
        assert out.outcome in ("new", "newer"), out.outcome
        return
    keys, args = store._args(key, record(value, "host-a", counter, counter), False, hint=False)
    node = store.rc.get_node_from_key(keys[0])
    raw = store.rc.get_redis_connection(node).eval(PUSH_LUA, len(keys), *keys, *args)
    assert raw[0][0] in (b"new", b"newer"), raw  # (one reply per record)


def held(h: Host, key: str, value: Any) -> None:
    wait_for(lambda: h.kv.get(key) == value, 10, f"the host to serve {key}'s new value")
    item = h.kv.get_item(key)
    assert item is not None and item.tier in ("l1", "l2")


def settled(h: Host) -> None:
    """Until the daemon has handled every event of its host's L2 feed (an agent's fill
    from L3 makes it read the key again, for a change it skipped: a test's next change must
    not come in through that read)."""
    def done() -> bool:
        d = h.daemon
        return d is not None and d.persisted == h.kv._seg.feed_read(d.persisted)[1]

    wait_for(done, 10, "the daemon to handle its local feed")


def caught_up(h: Host, store: L3Store, g: int) -> None:
    wait_for(lambda: h.daemon is not None and h.daemon.feed_seqs.get(g) == store.feed_seqs([g])[g],
             10, "the daemon to follow the group's sequence")


def test_a_value_less_change_s_hint_carries_its_entry(cluster: RedisCluster,
                                                      store: L3Store) -> None:
    listener = L3Store(cluster.seeds)
    try:
        listener.hints()  # subscribed
        wait_for(lambda: listener._hints is not None and not listener._hints.unrouted, 10,
                 "every group subscribed")
        key, small = "hint/carried", "hint/plain"
        store.push(key, record(BIG, "host-a", 3, 3))
        store.push(small, record("s", "host-a", 1, 1))
        got: list[Any] = []
        plain: set[int] = set()

        def heard() -> bool:
            hinted, _ = listener.hints()
            plain.update(hinted)
            got.extend(listener.hint_entries())
            return bool(got) and group_of(small) in plain

        wait_for(heard, 10, "both hints")
        (g, entry), = [(g, e) for g, e in got if e.key == key]
        stream = [e for e in store.feed(g, count=100_000) if e.key == key][-1]
        assert g == group_of(key)
        assert entry == stream  # the very entry the stream holds: id, sequence, note
        assert entry.note == FeedNote("host-a", 3, False, False)
        assert all(e.key != small for _, e in got)  # an inline entry's hint: the group only
    finally:
        listener.close()


@pytest.mark.parametrize("payload", [b"1 2", b"x 1-0 1::h k", b"1 nope 1::h k", b"1 1-0 bad k",
                                     b"1 1-0 1::h ", b"1 1-0 1::h \xff"])
def test_a_hint_that_is_not_an_entry_is_a_plain_hint(payload: bytes) -> None:
    from kvcomm.tiers.l3 import _hint_entry

    assert _hint_entry(payload) is None


def test_a_host_follows_hinted_entries_without_reading_the_feed(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    h = Host(cluster, "hint-follow", seed, cluster_keys=NO_SWEEP)
    try:
        key = "hint/follow"
        push(store, key, f"0{BIG}", 1)
        held(h, key, f"0{BIG}")
        caught_up(h, store, group_of(key))
        before, entries = feed_bytes(h), h.stats.extra.get("hint_entries", 0)
        for i in range(1, 21):
            push(store, key, f"{i}{BIG}", i + 1)
        held(h, key, f"20{BIG}")
        caught_up(h, store, group_of(key))
        assert h.stats.extra.get("hint_entries", 0) >= entries + 20
        assert feed_bytes(h) == before, "the host read the stream though hints carried it all"
        assert h.stats.resyncs == 0
    finally:
        h.close()


def test_a_lost_hint_makes_the_next_one_read_the_feed(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    """No sweep here: only the hole in the hints' sequence can find the change whose hint
    was lost."""
    h = Host(cluster, "hint-lost", seed, cluster_keys=NO_SWEEP)
    try:
        a, b = same_group_keys("hint-lost", 2)
        push(store, a, f"a0{BIG}", 1)
        push(store, b, f"b0{BIG}", 1)
        held(h, a, f"a0{BIG}")
        held(h, b, f"b0{BIG}")
        caught_up(h, store, group_of(a))
        settled(h)
        before = feed_bytes(h)
        push(store, a, f"a1{BIG}", 2, hint=False)  # its hint lost
        push(store, b, f"b1{BIG}", 2)  # one sequence number too far: read the stream
        held(h, b, f"b1{BIG}")
        held(h, a, f"a1{BIG}")
        assert feed_bytes(h) > before
        assert h.stats.resyncs == 0
    finally:
        h.close()


def test_lost_hints_over_a_trimmed_stream_resync(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    h = Host(cluster, "hint-trim", seed, cluster_keys=NO_SWEEP)
    try:
        a, b = same_group_keys("hint-trim", 2)
        g = group_of(a)
        push(store, a, f"a0{BIG}", 1)
        held(h, a, f"a0{BIG}")
        caught_up(h, store, g)
        settled(h)
        push(store, a, f"a1{BIG}", 2, hint=False)
        push(store, b, f"b1{BIG}", 1, hint=False)
        store.rc.xtrim(feed_key(g), maxlen=0, approximate=False)  # the stream lost them
        push(store, b, f"b2{BIG}", 2)  # hinted: two past the host's last
        held(h, a, f"a1{BIG}")
        wait_for(lambda: h.stats.extra.get("resync_gap", 0) >= 1, 10, "a gap's resync")
        assert h.alive
    finally:
        h.close()


def test_a_hinted_entry_from_a_stream_that_went_back_resyncs(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    h = Host(cluster, "hint-rewind", seed, cluster_keys=NO_SWEEP)
    try:
        (k,) = same_group_keys("hint-rewind", 1)
        g = group_of(k)
        for i in range(1, 4):
            push(store, k, f"{i}{BIG}", i)
        held(h, k, f"3{BIG}")
        caught_up(h, store, g)
        settled(h)
        # a failover that lost the latest entries: stream and counter gone, then a write
        # whose hint carries sequence number 1
        store.rc.delete(feed_key(g))
        store.rc.delete(seq_key(g))
        push(store, k, f"4{BIG}", 4)
        held(h, k, f"4{BIG}")
        wait_for(lambda: h.stats.extra.get("resync_rewind", 0) >= 1, 10, "a rewind resync")
        caught_up(h, store, g)
    finally:
        h.close()


def test_a_restarted_daemon_follows_hints_again(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    h = Host(cluster, "hint-restart", seed)
    try:
        key = "hint/restart"
        push(store, key, f"0{BIG}", 1)
        held(h, key, f"0{BIG}")
        caught_up(h, store, group_of(key))
        h.stop()  # (saves its cursors); the hints of what follows go to nobody
        for i in range(1, 4):
            push(store, key, f"{i}{BIG}", i + 1)
        h.start()
        held(h, key, f"3{BIG}")  # found by the first poll's check of every counter
        caught_up(h, store, group_of(key))
        for i in range(4, 8):
            push(store, key, f"{i}{BIG}", i + 1)
        held(h, key, f"7{BIG}")
        assert h.stats.extra.get("hint_entries", 0) >= 1
    finally:
        h.close()
