"""Value-less feed entries (issue 12): a push's feed entry carries its key and version,
and the record itself only when it is small (FEED_INLINE); a host reads from L3 only the
records of keys it wants (held in L2, or watched), in one batch. Old-format entries
(the record inline, ``s``) still in a stream are read as before, in sequence with the
new ones (a mixed cluster during an upgrade)."""

from __future__ import annotations

import random

import pytest

from kvcomm.core.backoff import Backoff
from kvcomm.core.versions import MAX_COUNTER
from kvcomm.devcluster.redis_cluster import RedisCluster
from kvcomm.errors import CorruptRecord
from kvcomm.node.delivery import UNSEQUENCED, Inbound, echo
from kvcomm.tiers.l2 import key_hash
from kvcomm.tiers.l3 import (
    FEED_INLINE,
    FeedEntry,
    FeedNote,
    L3Record,
    L3Store,
    feed_key,
    group_of,
    record_key,
)
from tests.support.daemon_harness import Host, record, shared_cluster_fixture, store_fixture  # noqa: F401 (fixtures)
from tests.support.helpers import wait_for

BIG = "x" * 1000  # a value whose record is far over FEED_INLINE


def raw_entries(store: L3Store, key: str, after: bytes = b"0-0") -> list[dict[bytes, bytes]]:
    """The fields of the feed entries of ``key`` after ``after``, as Redis holds them."""
    rows = store.rc.xrange(feed_key(group_of(key)), min=b"(" + after)
    return [f for _, f in rows if f.get(b"k") == key.encode()]


def last_id(store: L3Store, key: str) -> bytes:
    rows = store.rc.xrevrange(feed_key(group_of(key)), count=1)
    return rows[0][0] if rows else b"0-0"


def entries(store: L3Store, key: str, after: bytes) -> list[FeedEntry]:
    return [e for e in store.feed(group_of(key), after=after, count=100_000) if e.key == key]


def test_small_records_ride_inline_large_ones_are_value_less(store: L3Store) -> None:
    key = "vl/shape"
    start = last_id(store, key)
    small = record("s", "host-a", 1, 1)
    big = record(BIG, "host-a", 2, 2)
    assert len(small.encode()) <= FEED_INLINE < len(big.encode())
    store.push(key, small)
    store.push(key, big)
    raw = raw_entries(store, key, start)
    # inline: exactly the entry every earlier version wrote; value-less: no record, and
    # its sequence number under "q", not "s", so a reader that knows only inline entries
    # finds none and resyncs the group instead of missing the change
    assert [set(f) for f in raw] == [{b"k", b"r", b"s"}, {b"k", b"q", b"n"}]
    got = entries(store, key, start)
    assert got[0].note is None and L3Record.decode(got[0].record) == small
    assert got[1].record == b"" and got[1].note == FeedNote("host-a", 2, False, False)
    assert got[1].seq == got[0].seq + 1  # (both kinds share the group's sequence)


def test_notes_carry_tombstones_merges_and_any_counter(cluster: RedisCluster) -> None:
    store = L3Store(cluster.seeds, feed_inline=0)  # every entry value-less
    try:
        key = "vl/notes:host"
        start = last_id(store, key)
        store.push(key, record("a", "host-a", MAX_COUNTER, 5))
        store.push(key, record("b", "b:host.2", 3, 9))  # concurrent: merged, b wins (hlc)
        tomb = L3Record(12, True, 0, b"", b"", (("b:host.2", 4), ("host-a", MAX_COUNTER)),
                        ("b:host.2", 4))
        store.push(key, tomb)
        notes = [e.note for e in entries(store, key, start)]
        assert notes == [FeedNote("host-a", MAX_COUNTER, False, False),
                         FeedNote("b:host.2", 3, False, True),
                         FeedNote("b:host.2", 4, True, False)]
    finally:
        store.close()


@pytest.mark.parametrize("note", [b"", b"1::", b"zz::h", b"0::h", b"1:x:h", b"1:dd:h", b"-1::h",
                                  b"99999999999999999::h", b"9007199254740992::h", b"1::h h"])
def test_a_note_that_is_not_ours_is_a_problem_not_an_error(store: L3Store, note: bytes) -> None:
    key = "vl/bad-note"
    start = last_id(store, key)
    store.rc.xadd(feed_key(group_of(key)), {b"k": key.encode(), b"q": b"1", b"n": note})
    got = [e for e in store.feed(group_of(key), after=start)]
    assert len(got) == 1 and got[0].key is None and "note" in got[0].problem


def test_get_many_reads_across_masters_and_reports_each_key(store: L3Store) -> None:
    keys = [f"vl/many/{i}" for i in range(40)]
    for i, k in enumerate(keys[:30]):
        store.push(k, record(f"v{i}", "host-a", 1, 1))
    assert len({store.rc.nodes_manager.get_node_from_slot(store.groups.slot(group_of(k))).name
                for k in keys}) > 1  # (the batch spans masters)
    store.rc.set(record_key("vl/many/foreign"), b"someone else's")
    store.rc.hset(record_key("vl/many/typed"), "f", "v")
    out = store.get_many([*keys, "vl/many/foreign", "vl/many/typed", "bad\udc80key", keys[0]])
    assert all(out[k] == store.get(k) for k in keys[:30])
    assert all(out[k] is None for k in keys[30:])
    assert all(isinstance(out[k], CorruptRecord)
               for k in ("vl/many/foreign", "vl/many/typed", "bad\udc80key"))
    assert len(out) == 43


def test_echo_needs_no_read_only_for_this_life_s_unmerged_own_writes() -> None:
    n = FeedNote("h1", 5, False, False)
    assert echo(n, "h1", 5) and echo(n, "h1", 9)
    assert not echo(n, "h2", 9)  # another host's write
    assert not echo(n._replace(merged=True), "h1", 9)  # a merge: the vector is news
    assert not echo(n, "h1", 4)  # a dot past the write sequence: before L2 was lost


def test_an_old_reader_resyncs_over_a_value_less_entry() -> None:
    """What a daemon that predates value-less entries makes of one: it parses the entry
    as ``{k, r, s}`` and finds neither ``r`` nor ``s``; with no sequence number its
    Inbound resyncs the group (re-reads the keys it holds) rather than skip a change."""
    inb = Inbound(4, 0.01, Backoff(random.Random(1), base=0.05, cap=2.0), 0.0)
    inb.resume({0: b"1-0"}, {0: 1})
    old_view = FeedEntry(b"2-0", None, b"", None, "entry lacks its key (k) or record (r) field")
    assert inb.examine(0, [old_view]).problem == UNSEQUENCED


def holds(h: Host, key: str) -> bool:
    kb = key.encode()
    return h.kv._seg.read(kb, key_hash(kb), 0) is not None


def test_a_host_reads_the_values_of_the_keys_it_holds_and_no_others(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    holder = Host(cluster, "vl-holder", seed)
    other = Host(cluster, "vl-other", seed + 1)
    try:
        store.push("vl/held", record("v0", "host-a", 1, 1))
        wait_for(lambda: holder.kv.get("vl/held") == "v0", 10, "the holder to read the key")
        fetched0 = other.stats.extra.get("fetched", 0)
        got0 = other.daemon.l3.wire.received  # type: ignore[union-attr]
        for i in range(2, 22):
            store.push("vl/held", record(f"{i}{BIG}", "host-a", i, i))
        wait_for(lambda: holder.kv.get("vl/held") == f"21{BIG}", 10, "the holder to see the last")
        wait_for(lambda: other.daemon is not None
                 and other.daemon.feed_seqs.get(group_of("vl/held")) == store.feed_seqs(
                     [group_of("vl/held")])[group_of("vl/held")], 10, "the other host to read the feed")
        assert holder.stats.extra.get("fetched", 0) >= 1
        assert other.stats.extra.get("fetched", 0) == fetched0  # it holds none of them
        assert not holds(other, "vl/held")
        received = other.daemon.l3.wire.received - got0  # type: ignore[union-attr]
        assert received < 20 * len(BIG), f"{received} bytes: the values came along"
        print(f"the other host received {received} bytes for 20 writes of {len(BIG)} bytes")
    finally:
        holder.close()
        other.close()


def test_a_watched_key_is_read_though_not_held(cluster: RedisCluster, store: L3Store,
                                              seed: int) -> None:
    h = Host(cluster, "vl-watch", seed)
    try:
        assert h.daemon is not None
        h.daemon.watching = lambda key: key.startswith("vl/watched/")
        store.push("vl/watched/1", record(BIG, "host-a", 1, 1))
        store.push("vl/unwatched/1", record(BIG, "host-a", 1, 1))
        wait_for(lambda: holds(h, "vl/watched/1"), 10, "the watched key to come into L2")
        assert h.kv.get("vl/watched/1") == BIG
        assert not holds(h, "vl/unwatched/1")
    finally:
        h.close()


def test_old_and_new_entries_in_one_stream_are_applied_in_order(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    """A cluster mid-upgrade: an old daemon (every entry inline, ``s``) and a new one
    (value-less entries, ``q``) write the same keys of one group; a new host holding
    them applies every change, in sequence, with no resync."""
    old = L3Store(cluster.seeds, feed_inline=None)  # pushes exactly as an old daemon does
    h = Host(cluster, "vl-mixed", seed)
    try:
        key = "vl/mixed"
        g = group_of(key)
        store.push(key, record("v1", "host-a", 1, 1))
        wait_for(lambda: h.kv.get(key) == "v1", 10, "the host to read the key")
        start = last_id(store, key)
        resyncs = h.stats.resyncs
        writers = [old, store]
        for i in range(2, 12):
            value = f"{i}{BIG}" if i % 3 else f"v{i}"  # big and small, both writers
            writers[i % 2].push(key, record(value, "host-a", i, i))
        kinds = [frozenset(f) for f in raw_entries(store, key, start)]
        assert frozenset({b"k", b"r", b"s"}) in kinds and frozenset({b"k", b"q", b"n"}) in kinds
        wait_for(lambda: h.kv.get(key) == f"11{BIG}", 10, "the host to apply every change")
        wait_for(lambda: h.daemon is not None and h.daemon.feed_seqs.get(g)
                 == store.feed_seqs([g])[g], 10, "the host to read the whole feed")
        assert h.stats.resyncs == resyncs, "a mixed stream made the host resync"
        assert h.alive
    finally:
        old.close()
        h.close()


