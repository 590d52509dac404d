"""L3's push script merges concurrent counters as kvcomm.core.counter does (a real Redis
Cluster): per-actor maximum whatever the order of the pushes, a deleted counter's state
kept in its tombstone, a plain record winning over a counter."""

from __future__ import annotations

import random
from typing import Any

import pytest

import kvcomm
from kvcomm.core import codec, counter
from kvcomm.tiers.l3 import L3Record, L3Store
from tests.support.daemon_harness import Host, shared_cluster_fixture, store_fixture  # noqa: F401 (fixtures)
from tests.support.helpers import wait_for


def _state(rng: random.Random) -> counter.State:
    out: counter.State = {}
    for a in rng.sample(["h1~1", "h2~7", "h3~3", "=00ff", "h1~2"], rng.randint(0, 4)):
        p, n = rng.randint(0, 2**40), rng.randint(0, 1000)
        out[a] = [p, n, rng.randint(0, p), rng.randint(0, n)]
    if rng.random() < 0.3:  # a generation (a put the counter adopted)
        out[counter.GEN] = [rng.randint(0, 2), rng.randint(0, 2**32 - 1), 5, 0]
    return out


def _record(state: counter.State, host: str, hlc: int, deleted: bool = False) -> L3Record:
    payload = counter.encode(counter.reset(state) if deleted else state)
    if deleted or not counter.live(state):
        return L3Record(hlc, True, 0, counter.TOMBSTONE_META, payload, ((host, 1),), (host, 1))
    return L3Record(hlc, False, codec.COUNTER, b"", payload, ((host, 1),), (host, 1))


def _held(store: L3Store, key: str) -> counter.State:
    rec = store.get(key)
    assert rec is not None
    assert rec.tag == codec.COUNTER or (rec.tombstone and rec.meta == counter.TOMBSTONE_META)
    state = counter.decode(rec.value)
    assert rec.tombstone is not counter.live(state)  # a tombstone exactly when nothing counts
    return state


def test_the_push_script_merges_concurrent_counters_in_any_order(store: L3Store,
                                                                   seed: int) -> None:
    rng = random.Random(seed)
    for case in range(25):
        states = [_state(rng) for _ in range(3)]
        deleted = [rng.random() < 0.2 for _ in range(3)]
        recs = [_record(s, f"h{i + 1}", 1000 + rng.randint(0, 5), d)
                for i, (s, d) in enumerate(zip(states, deleted, strict=True))]
        want: counter.State = {}
        for r in recs:
            want = counter.merge(want, counter.decode(r.value))
        for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
            key = f"cl3/{seed}/{case}/{''.join(map(str, order))}"
            for i in order:
                store.push(key, recs[i])
            assert _held(store, key) == want, (case, order)
            # the same records again: nothing counts twice
            for i in order:
                assert store.push(key, recs[i]).outcome in ("older", "equal")
            assert counter.value(_held(store, key)) == counter.value(want)


def test_a_plain_record_wins_over_a_concurrent_counter_whatever_the_clocks(
        store: L3Store, seed: int) -> None:
    c = _record({"h1~1": [5, 0, 0, 0]}, "h1", 2000)  # the later clock
    plain = L3Record(1000, False, *codec.encode("reset"), ((("h2", 1),)), ("h2", 1))
    tomb = L3Record(1000, True, 0, b"", b"", (("h2", 1),), ("h2", 1))
    for name, r in (("value", plain), ("tombstone", tomb)):
        for first, second in ((c, r), (r, c)):
            key = f"cl3/{seed}/plain/{name}/{first is c}"
            store.push(key, first)
            out = store.push(key, second)
            assert out.outcome in ("merged", "older", "newer"), out.outcome
            held = store.get(key)
            assert held is not None and held.tag == r.tag and held.value == r.value
            assert held.tombstone is r.tombstone and dict(held.vector) == {"h1": 1, "h2": 1}


_BAD_STATES = {  # counter states no host writes: each must read as a corrupt record
    "not msgpack": b"\xc1\xc1",
    "not a map": b"\xa5hello",
    "an int actor": b"\x81\x01\x94\x01\x00\x00\x00",
    "past 2**53": b"\x81\xa4h9~1\x94\xcf\x10\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00",
}


def test_an_incr_over_a_planted_malformed_counter_raises_corrupt_record(
        cluster: Any, store: L3Store, seed: int) -> None:
    """Records planted in L3 under a key (a live counter or a deleted one whose state
    does not decode, pushed through the push script): the host's incr raises
    CorruptRecord, counts nothing and copies nothing into L2; the daemon lives on; a put
    of the key repairs it, and counting starts again from it."""
    h = Host(cluster, "h1", seed)
    try:
        for name, payload in _BAD_STATES.items():
            for deleted in (False, True):
                key = f"cl3/{seed}/bad/{name}/{deleted}"
                planted = (L3Record(1000, True, 0, counter.TOMBSTONE_META, payload,
                                    (("h9", 1),), ("h9", 1)) if deleted else
                           L3Record(1000, False, codec.COUNTER, b"", payload,
                                    (("h9", 1),), ("h9", 1)))
                assert store.push(key, planted).outcome == "new"
                with pytest.raises(kvcomm.CorruptRecord):
                    h.kv.incr(key)
                assert h.kv._seg.read(*h.kv._key_hash(key)) is None, (name, deleted)
                h.kv.put(key, 0)
                assert h.kv.incr(key) == 1, (name, deleted)
        assert h.alive
    finally:
        h.close()


def test_a_malformed_deleted_counter_pulled_into_l2_reads_as_corrupt(
        cluster: Any, store: L3Store, seed: int) -> None:
    """A host holds a counter; a deleted counter whose state does not decode, newer than
    the host's, comes in through the feed: the next incr raises CorruptRecord (the key's
    record, not the host's L2, is bad) and a put repairs the key."""
    h = Host(cluster, "h1", seed)
    key = f"cl3/{seed}/pulled"
    try:
        assert h.kv.incr(key, 5) == 5
        wait_for(lambda: (r := store.get(key)) is not None and r.tag == codec.COUNTER, 10,
                 "the counter in L3")
        rec = store.get(key)
        assert rec is not None
        newer = L3Record(rec.hlc + 1, True, 0, counter.TOMBSTONE_META, b"\xa5hello",
                         (*rec.vector, ("h9", 1)), ("h9", 1))
        assert store.push(key, newer).outcome == "newer"
        wait_for(lambda: (r := h.kv._seg.read(*h.kv._key_hash(key))) is not None
                 and r.tag == 0, 10, "the planted delete pulled into L2")
        with pytest.raises(kvcomm.CorruptRecord):
            h.kv.incr(key)
        h.kv.put(key, 1)
        assert h.kv.incr(key) == 2
        assert h.alive
    finally:
        h.close()


def test_a_counter_that_adopted_a_put_at_or_after_a_plain_record_wins_over_it(
        store: L3Store, seed: int) -> None:
    """A plain record (a merged copy of a put, concurrent with the counter in name only)
    against a counter whose generation is a put stamped at or after it: the counter wins,
    in L3's script and in L2's rule alike, whatever the order; an older generation (or
    none) loses to it."""
    from kvcomm._client import counters

    hlc = (7 << 32) | 5000
    plain = L3Record(hlc, False, *codec.encode(100), (("h2", 1),), ("h2", 1))
    for gen_hlc, counter_wins in ((hlc, True), (hlc + 1, True), (hlc - 1, False)):
        state = {counter.GEN: [gen_hlc >> 32, gen_hlc & 0xFFFFFFFF, 9, 0],
                 "=ab": [100, 0, 0, 0], "h1~1": [1, 0, 0, 0]}
        c = _record(state, "h1", hlc + 10)
        want = c if counter_wins else plain
        for first, second in ((c, plain), (plain, c)):
            key = f"cl3/{seed}/adopted/{gen_hlc}/{first is c}"
            store.push(key, first)
            store.push(key, second)
            held = store.get(key)
            assert held is not None and (held.tag, held.value) == (want.tag, want.value), \
                (gen_hlc, first is c)
        enc_c = (c.tag, c.meta, c.value)
        enc_p = (plain.tag, plain.meta, plain.value)
        side = "local" if counter_wins else "remote"
        assert counters.merge_plan(enc_c, enc_p, c.hlc, plain.hlc) == (side, enc_c if
                                                                        counter_wins else enc_p)
        assert counters.merge_plan(enc_p, enc_c, plain.hlc, c.hlc)[0] == (
            "remote" if counter_wins else "local")
