"""L3's conditional-write script (CAS_LUA, L3Store.push_if) against a real Redis Cluster:
what passes, what is refused, what comes back."""

from __future__ import annotations

import time

import msgpack
import pytest

from kvcomm.core.expiry import ExtCache
from kvcomm.core.versions import Vector
from kvcomm.errors import CorruptRecord
from kvcomm.tiers.l3 import EMPTY_EXT, L3Record, L3Store
from tests.support.daemon_harness import shared_cluster_fixture, store_fixture  # noqa: F401 (the fixtures)


def _rec(vector: Vector, dot: tuple[str, int], hlc: int, value: bytes = b"v",
         tomb: bool = False, ext: bytes = EMPTY_EXT) -> L3Record:
    return L3Record(hlc, tomb, 1, b"", value, vector, dot, ext)


def _put(store: L3Store, key: str, r: L3Record) -> None:
    assert store.push(key, r).outcome in ("new", "newer")


def test_absent_passes_over_nothing_a_tombstone_or_an_expired_record(store: L3Store) -> None:
    won = store.push_if("c/none", _rec((("h1", 1),), ("h1", 1), 10), True, (), ())
    assert won.outcome == "won" and store.get("c/none") == won.record
    # a tombstone the pushed record descends from: won; one it does not know: "stale",
    # then won once its vector is merged in
    _put(store, "c/tomb", _rec((("h2", 5),), ("h2", 5), 20, b"", tomb=True))
    stale = store.push_if("c/tomb", _rec((("h1", 1),), ("h1", 1), 30), True, (), ())
    assert stale.outcome == "stale" and stale.record is not None and stale.record.tombstone
    won = store.push_if("c/tomb", _rec((("h1", 2), ("h2", 5)), ("h1", 2), 31), True, (),
                        (("h2", 5),))
    assert won.outcome == "won" and store.get("c/tomb").value == b"v"  # type: ignore[union-attr]
    # an expired record is dead too
    past = ExtCache(EMPTY_EXT).ext(time.time() - 1)
    _put(store, "c/exp", _rec((("h2", 1),), ("h2", 1), 40, ext=past))
    won = store.push_if("c/exp", _rec((("h1", 1), ("h2", 1)), ("h1", 1), 41), True, (),
                        (("h2", 1),))
    assert won.outcome == "won"
    # a live record: refused, and it comes back
    lost = store.push_if("c/exp", _rec((("h3", 1),), ("h3", 1), 50), True, (), ())
    assert lost.outcome == "conflict" and lost.record == won.record


def test_a_version_passes_when_l3_holds_it_or_what_it_descends_from(store: L3Store) -> None:
    v1 = _rec((("h1", 1),), ("h1", 1), 10)
    _put(store, "c/v", v1)
    won = store.push_if("c/v", _rec((("h1", 2),), ("h1", 2), 11), False, v1.vector, v1.vector)
    assert won.outcome == "won"
    # the expected version is gone: refused, whoever asks
    lost = store.push_if("c/v", _rec((("h2", 1), ("h1", 1)), ("h2", 1), 12), False,
                         v1.vector, v1.vector)
    assert lost.outcome == "conflict" and lost.record == won.record
    # expecting a version descending from L3's (the host's own write not yet in L3)
    mine = (("h1", 3),)
    won = store.push_if("c/v", _rec((("h1", 4),), ("h1", 4), 14), False, mine, mine)
    assert won.outcome == "won"
    # a concurrent expectation: refused
    lost = store.push_if("c/v", _rec((("h1", 3), ("h2", 2)), ("h2", 2), 15), False,
                         (("h1", 3), ("h2", 1)), (("h1", 3), ("h2", 1)))
    assert lost.outcome == "conflict"
    # nothing in L3: nothing contradicts the expectation
    assert store.push_if("c/nothing", _rec((("h1", 2),), ("h1", 2), 16), False,
                         (("h1", 1),), (("h1", 1),)).outcome == "won"


def test_an_expected_version_that_expired_is_refused(store: L3Store) -> None:
    past = ExtCache(EMPTY_EXT).ext(time.time() - 1)
    v1 = _rec((("h1", 1),), ("h1", 1), 10, ext=past)
    _put(store, "c/gone", v1)
    lost = store.push_if("c/gone", _rec((("h1", 2),), ("h1", 2), 11), False, v1.vector,
                         v1.vector)
    assert lost.outcome == "conflict"


def test_a_refused_write_changes_nothing_and_a_won_one_is_in_the_feed(store: L3Store) -> None:
    v1 = _rec((("h1", 1),), ("h1", 1), 10)
    _put(store, "c/feed", v1)
    g = store.group_of("c/feed")
    before = store.feed(g)
    assert store.push_if("c/feed", _rec((("h2", 1),), ("h2", 1), 11), True, (), ()
                         ).outcome == "conflict"
    assert store.feed(g) == before and store.get("c/feed") == v1
    assert store.push_if("c/feed", _rec((("h1", 2),), ("h1", 2), 12), False, v1.vector,
                         v1.vector).outcome == "won"
    assert [e.key for e in store.feed(g)[len(before):]] == ["c/feed"]


def test_a_newer_format_or_a_malformed_expectation_is_refused(store: L3Store) -> None:
    name = store.groups.record_key("c/newer")
    store.rc.set(name, msgpack.packb({"f": 9}))
    with pytest.raises(CorruptRecord, match="newer format"):
        store.push_if("c/newer", _rec((("h1", 1),), ("h1", 1), 10), True, (), ())
    assert store.rc.get(name) == msgpack.packb({"f": 9})
    keys, args = store._args("c/bad", _rec((("h1", 1),), ("h1", 1), 10), False)
    reply = store.rc.evalsha(store._cas.sha, len(keys), *keys, *args, "x", b"", b"")
    assert isinstance(reply, list) and "KVCOMMBAD" in str(reply[0]), reply
