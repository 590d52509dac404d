"""A cached "absent" is never older than what the host knows, on a real dev cluster of two
hosts whose agents are opened with the shipped defaults (``cache.negative_ttl`` 5 s): a
key read on host 2 just before host 1 creates it shows there as soon as host 2's daemon
learns of it (its key filter's ring of learned keys), not once the note expires; a key
deleted and created again too; and a key that stays absent still costs at most one L3
read per ``negative_ttl``."""

from __future__ import annotations

import time
import uuid
from typing import Any

import kvcomm
from kvcomm.config import CacheConfig
from kvcomm.tiers.keyfilter import KeyFilter
from kvcomm.tiers.l3 import group_of
from tests.support.devcluster import dev_cluster_fixture, host, l3, live_record, restart_daemon
from tests.support.helpers import wait_for

TTL = float(CacheConfig().negative_ttl)  # the shipped default, which these agents use
KEYS = 20

dev = dev_cluster_fixture(2, groups=64)


def _filter_of(dev: dict[str, Any], i: int) -> KeyFilter:
    kf = KeyFilter.open_reader(dev["hosts"][i]["namespace"])
    assert kf is not None
    return kf


def _noted_absent(kv: kvcomm.Client, key: str) -> None:
    """Read ``key`` on ``kv``'s host, absent, and check a negative note was made."""
    before = kv.counters["filter_hits"] + kv.counters["l3_absent"]
    assert kv.get(key) is None
    assert kv.counters["filter_hits"] + kv.counters["l3_absent"] == before + 1
    assert kv.get(key) is None and kv.counters["negative_hits"] > 0  # (the note answers)


def test_the_agents_use_the_shipped_negative_ttl(dev: dict[str, Any]) -> None:
    b = host(dev, 1)
    try:
        assert b.config.cache.negative_ttl == TTL == 5.0
    finally:
        b.close()


def test_a_key_read_absent_just_before_another_host_creates_it_shows_at_once(
        dev: dict[str, Any]) -> None:
    """One read once host 2's daemon has learned of the key (its filter has it): the
    value, not the note's "absent" (no polling: a polled key would come in with the hot
    keys' prewarm, every couple of seconds, and hide the note)."""
    a, b = host(dev, 0), host(dev, 1)
    kf = _filter_of(dev, 1)
    run = uuid.uuid4().hex[:8]
    try:
        for i in range(KEYS):
            key = f"fresh/{run}/{i}"
            _noted_absent(b, key)
            a.put(key, i)
            wait_for(lambda k=key: kf.may_exist(k.encode()), 10,  # type: ignore[misc]
                     "host 2's daemon learned of the key")
            assert b.get(key) == i, f"host 2 answers 'absent' for {key}, which its daemon knows"
        assert b.counters["negative_rechecks"] == KEYS  # each note dropped: the daemon learned it
    finally:
        kf.close()
        a.close()
        b.close()


def test_a_key_deleted_then_created_again_shows_at_once(dev: dict[str, Any]) -> None:
    """The filter already matches a deleted key (until its rotation): only the ring of
    learned keys tells the note that the key came back. A new marker key of the same
    group, written after it, says when host 2's daemon has read the key's feed entry."""
    a, b, store = host(dev, 0), host(dev, 1), l3(dev)
    kf = _filter_of(dev, 1)
    key = f"again/{uuid.uuid4().hex[:8]}"
    g = group_of(key, dev["groups"])
    marker = next(m for i in range(100_000)
                  if group_of(m := f"{key}/marker{i}", dev["groups"]) == g)
    try:
        a.put(key, 1)
        wait_for(lambda: live_record(store, key) and kf.may_exist(key.encode()), 10,
                 "host 2's filter knows the key")
        assert a.delete(key)
        wait_for(lambda: (r := store.get(key)) is not None and r.tombstone, 10, "the delete in L3")
        reads = b.counters["l3_reads"]
        _noted_absent(b, key)  # (the filter matches: L3 answered "absent")
        assert b.counters["l3_reads"] == reads + 1 and kf.may_exist(key.encode())
        a.put(key, 2)
        a.put(marker, 0)
        wait_for(lambda: kf.may_exist(marker.encode()), 10, "host 2's daemon read the marker")
        assert b.get(key) == 2, "host 2 answers 'absent' for a key its daemon knows"
    finally:
        kf.close()
        a.close()
        b.close()
        store.close()


def test_a_key_that_stays_absent_costs_one_l3_read_per_negative_ttl(dev: dict[str, Any]) -> None:
    """Another host keeps creating keys (the daemon learns them: the notes are checked
    against the ring) while host 2 reads, in a loop, a key the filter matches (deleted)
    and one it does not: one L3 read in all, for the deleted one."""
    a, b, store = host(dev, 0), host(dev, 1), l3(dev)
    kf = _filter_of(dev, 1)
    run = uuid.uuid4().hex[:8]
    gone, never = f"gone/{run}", f"never/{run}"
    try:
        a.put(gone, 1)
        wait_for(lambda: live_record(store, gone) and kf.may_exist(gone.encode()), 10,
                 "host 2's filter knows the key")
        a.delete(gone)
        wait_for(lambda: (r := store.get(gone)) is not None and r.tombstone, 10, "the delete in L3")
        reads, learned = b.counters["l3_reads"], kf.learned
        t0 = time.monotonic()
        n = 0
        while n < 200 and time.monotonic() - t0 < TTL / 2:  # (within one negative_ttl)
            a.put(f"other/{run}/{n}", n)  # keys host 2's daemon learns
            assert b.get(gone) is None and b.get(never) is None
            n += 1
            time.sleep(0.005)  # (a pace, not a wait: the daemons keep up)
        wait_for(lambda: kf.learned_since(f"other/{run}/0".encode(), learned), 10,
                 "host 2's daemon learned the other keys")  # (the notes were checked)
        assert b.get(gone) is None and b.get(never) is None
        assert b.counters["l3_reads"] - reads == 1, b.stats()["l3"]
        assert b.counters["negative_hits"] >= 2 * n - 2
    finally:
        kf.close()
        a.close()
        b.close()
        store.close()


def test_a_note_made_before_a_daemon_restart_yields_to_what_the_new_daemon_learns(
        dev: dict[str, Any]) -> None:
    """A restarted daemon puts a new filter file in place (the old one retired): an
    agent's note stamped with the old file's count must not answer "absent" for a key the
    new daemon has learned. (The agent's negative_ttl is long here so that the restart's
    own duration cannot expire the note: the promise does not depend on the TTL.)"""
    a, b = host(dev, 0), host(dev, 1, negative_ttl=120.0)
    key = f"restart/{uuid.uuid4().hex[:8]}"
    kf: KeyFilter | None = None
    try:
        _noted_absent(b, key)
        old = b._kf
        restart_daemon(dev, 1)
        wait_for(lambda: old is not None and old.retired, 10, "the old filter file retired")
        a.put(key, 1)
        kf = _filter_of(dev, 1)
        wait_for(lambda: kf.ready and kf.may_exist(key.encode()), 20,  # type: ignore[union-attr]
                 "host 2's new daemon learned of the key")
        # (as if b had reopened the file under a second ago, as a loaded run did (ci4): a
        # retired file is reopened at once all the same, not after _key_filter's second)
        b._kf_retry = time.monotonic() + 1.0
        assert b.get(key) == 1, "host 2 answers 'absent' for a key its new daemon knows"
    finally:
        if kf is not None:
            kf.close()
        a.close()
        b.close()
