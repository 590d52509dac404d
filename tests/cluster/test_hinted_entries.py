"""Hints that carry their feed entry, forged or hostile, never hide a real change nor stop
the daemon; a key read from L1 only is never served stale once interest decays."""

from __future__ import annotations

from typing import Any

import pytest

from kvcomm.tiers.l3 import L3Store
from tests.support.daemon_harness import Host, cluster_fixture, store_fixture  # noqa: F401 (fixtures)
from tests.support.helpers import drawn_seed, wait_for


def _spublish(store: Any, g: int, payload: bytes) -> None:
    """What anything that can publish on the group's hint channel can send, once the
    host's daemon listens there: it may follow the group (by its sweep) a moment before
    its subscription is in place, and a message published to no one is gone."""
    channel = store.groups.hint_channel(g)
    node = store.rc.get_node_from_key(channel)
    conn = store.rc.get_redis_connection(node)
    wait_for(lambda: conn.execute_command("SPUBLISH", channel, payload) >= 1, 15,
             "the daemon to subscribe to the group's hint channel (the hint received)")


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


@pytest.mark.redis
def test_a_forged_hinted_entry_never_hides_a_real_change(cluster, store) -> None:  # type: ignore[no-untyped-def]
    """A hint carrying an entry that is not in the stream (the group's next sequence
    number, an id far ahead: anything that can SPUBLISH on the channel can send it) is
    followed, so the host's cursor and sequence number jump to it. The real change that
    then takes that sequence number must still reach the host: the sweep (the group's
    counter equals the forged number) has to notice that the stream does not end where
    the host thinks, and the host resyncs.
    (found in review 18: write mark, hinted entries, unread changes)"""
    from kvcomm.tiers.l3 import group_of
    from tests.support.daemon_harness import remote_put

    seed = drawn_seed(2**32)
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


@pytest.mark.redis
@pytest.mark.parametrize("bad", ["huge", "other_group", "invalid"])
def test_a_hinted_entry_with_a_hostile_key_never_stops_the_daemon(cluster, store, bad: str) -> None:  # type: ignore[no-untyped-def]
    """A hint carrying an entry whose key no client could write (far over the key size
    limit, a key of another group, a key with characters keys may not hold) leaves the
    daemon alive, and the group's real changes still arrive.
    (found in review 18: write mark, hinted entries, unread changes)"""
    from kvcomm.tiers.l3 import group_of
    from tests.support.daemon_harness import remote_put

    seed = drawn_seed(2**32)
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


@pytest.mark.redis
def test_a_key_read_from_l1_only_is_never_served_stale_after_interest_decays(cluster, store) -> None:  # type: ignore[no-untyped-def]
    """cluster.unread_changes 1: an agent that reads a held key only from its L1 (no L2
    read sets the reference bit) may see it dropped from L2 at the next remote change;
    its next read must then bring the new value, never the old L1 copy.
    (found in review 18: write mark, hinted entries, unread changes)"""
    from tests.support.daemon_harness import remote_put

    seed = drawn_seed(2**32)
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
