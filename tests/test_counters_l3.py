"""L3's push script merges concurrent counters as kvcomm.core.counter does (a real Redis
Cluster): per-actor maximum whatever the order of the pushes, a deleted counter's state
kept in its tombstone, a plain record winning over a counter."""

from __future__ import annotations

import random
import shutil

import pytest

from kvcomm.core import codec, counter
from kvcomm.tiers.l3 import L3Record, L3Store

from .daemon_harness import shared_cluster_fixture, store_fixture  # noqa: F401 (fixtures)

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed"),
]


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
