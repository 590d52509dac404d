"""L3 on a real Redis Cluster (3 masters + 3 replicas): codec, push script, feed, faults."""

from __future__ import annotations

import random
import struct
import tracemalloc
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcomm
from kvcomm.core import codec
from kvcomm.core.resolve import l3_rule
from kvcomm.core.versions import Dotted
from kvcomm.devcluster.redis_cluster import RedisCluster
from kvcomm.errors import ConfigError, Unavailable
from kvcomm.tiers.l3 import (
    EMPTY_EXT,
    FIELDS,
    FORMAT,
    MAX_COUNTER,
    META_GROUPS,
    CorruptRecord,
    L3Record,
    L3Store,
    feed_key,
    group_of,
    record_key,
    seq_key,
)
from tests.core.test_versions import histories
from tests.support.daemon_harness import cluster_fixture, record, store_fixture  # noqa: F401 (the fixtures)
from tests.support.helpers import drawn_seed, wait_for


def rec(v: Dotted, value: bytes = b"v", tomb: bool = False) -> L3Record:
    return L3Record(v.hlc, tomb, 1, b"", value, v.vector, v.dot)


@given(histories, st.binary(max_size=64), st.booleans())
def test_record_codec_roundtrips(writes: list[Dotted], value: bytes, tomb: bool) -> None:
    for w in writes:
        r = rec(w, value, tomb)
        assert L3Record.decode(r.encode()) == r


@pytest.mark.parametrize("junk", [b"", b"garbage", b"\x93\x01\x02\x03", b"\x99" + b"\x00" * 9])
def test_foreign_bytes_are_corrupt_records(junk: bytes) -> None:
    with pytest.raises(CorruptRecord):
        L3Record.decode(junk)


def test_corrupt_record_is_exported_in_the_error_tree() -> None:
    assert kvcomm.CorruptRecord is CorruptRecord
    assert issubclass(CorruptRecord, kvcomm.KVCommError)
    from kvcomm.errors import CorruptRecord as FromErrors

    assert FromErrors is CorruptRecord


GOOD = {"f": 2, "h": b"0000018c2f3a4b5c", "d": False, "t": codec.PACKED, "m": b"",
        "v": msgpack.packb({"a": 1}), "vv": [b"host-1", 3, b"host-2", 1], "dot": [b"host-1", 3],
        "x": b"\x80"}
NAMES = {"fmt": "f", "hlc": "h", "tomb": "d", "tag": "t", "meta": "m", "value": "v", "flat": "vv",
         "dot": "dot", "ext": "x"}


def fields(**change: Any) -> bytes:
    """A format-2 record with some fields replaced (by name; ``actor``/``counter``: the
    dot's halves; ``drop``: fields left out; ``extra``: fields added)."""
    r = dict(GOOD)
    r["dot"] = list(GOOD["dot"])
    for name in change.pop("drop", ()):
        del r[NAMES[name]]
    r.update(change.pop("extra", {}))
    if "actor" in change:
        r["dot"][0] = change.pop("actor")
    if "counter" in change:
        r["dot"][1] = change.pop("counter")
    for k, v in change.items():
        r[NAMES[k]] = v
    return msgpack.packb(r, use_bin_type=False)


def test_the_reference_record_is_valid() -> None:
    rec = L3Record.decode(fields())
    assert rec.vector == (("host-1", 3), ("host-2", 1)) and rec.dot == ("host-1", 3)
    assert rec.decode_value("k") == {"a": 1} and rec.ext == EMPTY_EXT


def test_records_are_maps_of_named_fields_and_carry_their_extension() -> None:
    ext = msgpack.packb({"agent": "a-7", "ttl": 2**60, "nested": {}})
    r = L3Record(0x18C2F3A4B5C, False, codec.PACKED, b"", b"v", (("h", 1),), ("h", 1), ext)
    raw = msgpack.unpackb(r.encode(), raw=True)
    assert sorted(raw) == sorted(f.encode() for f in FIELDS) and raw[b"f"] == FORMAT == 2
    assert L3Record.decode(r.encode()) == r  # the extension comes back byte for byte
    assert L3Record.decode(msgpack.packb(dict(reversed(raw.items())), use_bin_type=False)) == r


def test_format_1_records_are_still_read() -> None:
    v1 = [1, b"0000018c2f3a4b5c", True, 0, b"", b"", [b"host-2", 1, b"host-1", 3], b"host-1", 3]
    rec = L3Record.decode(msgpack.packb(v1, use_bin_type=False))
    assert rec == L3Record(0x18C2F3A4B5C, True, 0, b"", b"", (("host-1", 3), ("host-2", 1)),
                           ("host-1", 3), EMPTY_EXT)
    for bad in ([2, *v1[1:]], v1[:8], [*v1[:2], 1, *v1[3:]]):
        with pytest.raises(CorruptRecord):
            L3Record.decode(msgpack.packb(bad, use_bin_type=False))


@pytest.mark.parametrize("change", [
    {"fmt": 0}, {"fmt": True}, {"fmt": b"2"},
    {"hlc": b"0000018C2F3A4B5C"}, {"hlc": b"000018c2f3a4b5c"}, {"hlc": b"0000018c2f3a4b5g"},
    {"hlc": 12}, {"tomb": 0}, {"tomb": None}, {"tag": -1}, {"tag": 256}, {"tag": 1.0},
    {"tag": True}, {"meta": 5}, {"meta": b"m" * 5000}, {"value": 7}, {"value": [1]},
    {"flat": []}, {"flat": [b"host-1"]}, {"flat": {b"host-1": 1}}, {"flat": [b"host-1", 0]},
    {"flat": [b"host-1", -3]}, {"flat": [b"host-1", 1e30]},
    {"flat": [b"host-1", 1.5]}, {"flat": [b"host-1", True]}, {"flat": [b"h st", 1]},
    {"flat": [b"", 1]}, {"flat": [b"h" * 65, 1]}, {"flat": [b"\xff", 1]},
    {"flat": [b"a", 1, b"a", 2]}, {"flat": [3, 1]}, {"actor": b"bad actor"},
    {"actor": 1}, {"counter": 0}, {"counter": -(2**63)}, {"counter": b"3"},
    {"fmt": 1}, {"fmt": 3}, {"dot": [b"host-1"]}, {"dot": b"host-1"},
    {"dot": [b"host-1", 3, 4]}, {"ext": {}}, {"ext": b""}, {"ext": b"\x90"},
    {"ext": b"\x81\x01\x02"}, {"ext": b"\x80\x80"}, {"ext": b"\x81\xa1\xff\x01"},
    {"ext": b"\x80" * 5000}, {"ext": 5}, {"drop": ["ext"]}, {"drop": ["tomb"]},
    {"drop": ["fmt"]}, {"extra": {"y": 1}},
])
def test_every_field_is_checked(change: dict[str, Any]) -> None:
    with pytest.raises(CorruptRecord):
        L3Record.decode(fields(**change))


def test_counters_up_to_2_64_minus_1_are_valid() -> None:
    rec = L3Record.decode(fields(flat=[b"h", MAX_COUNTER], counter=MAX_COUNTER))
    assert rec.vector == (("h", MAX_COUNTER),)


def test_a_value_over_max_value_size_is_corrupt() -> None:
    data = fields(value=b"x" * 1000)
    assert L3Record.decode(data, max_value_size=1000).value == b"x" * 1000
    with pytest.raises(CorruptRecord, match="exceeds|max_value_size"):
        L3Record.decode(data, max_value_size=999)


def _fuzz_decode(data: bytes) -> None:
    """Only CorruptRecord may come out of decoding, the record's or its value's."""
    try:
        rec = L3Record.decode(data, max_value_size=1 << 16)
    except CorruptRecord:
        return
    assert len(rec.value) <= 1 << 16 and all(1 <= c <= MAX_COUNTER for _, c in rec.vector)
    if not rec.tombstone:
        try:
            rec.decode_value("fuzz")
        except CorruptRecord:
            pass


@settings(max_examples=2000)
@given(st.binary(max_size=256))
def test_random_bytes_only_ever_raise_corrupt_record(data: bytes) -> None:
    _fuzz_decode(data)


def _valid_record(hlc: int, tomb: bool, value: Any, actors: int, v1: bool, ext: Any) -> bytes:
    flat = [x for i in range(actors) for x in (b"h%d" % i, i + 1)]
    if v1:
        return msgpack.packb([1, f"{hlc:016x}".encode(), tomb, codec.PACKED, b"",
                              msgpack.packb(value), flat, b"h0", 1], use_bin_type=False)
    return L3Record(hlc, tomb, codec.PACKED, b"", msgpack.packb(value),
                    tuple(sorted((f"h{i}", i + 1) for i in range(actors))), ("h0", 1),
                    msgpack.packb(ext)).encode()


plain = st.none() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8) | st.binary(max_size=8)
values = st.recursive(plain, lambda c: st.lists(c, max_size=3)
                      | st.dictionaries(st.text(max_size=4), c, max_size=3), max_leaves=8)
valid_records = st.builds(
    _valid_record, st.integers(0, 2**64 - 1), st.booleans(), values, st.integers(1, 4),
    st.booleans(), st.dictionaries(st.text(max_size=4), values, max_size=3))


@settings(max_examples=500)
@given(valid_records, st.data())
def test_mutated_records_only_ever_raise_corrupt_record(data: bytes, draw: st.DataObject) -> None:
    """500 valid records, each mutated (`make test-slow` runs 1500)."""
    _mutate_and_decode(data, draw)


@pytest.mark.slow
@settings(max_examples=1500)
@given(valid_records, st.data())
def test_1500_mutated_records_only_ever_raise_corrupt_record(data: bytes,
                                                             draw: st.DataObject) -> None:
    _mutate_and_decode(data, draw)


def _mutate_and_decode(data: bytes, draw: st.DataObject) -> None:
    L3Record.decode(data)  # the unmutated record is valid
    buf = bytearray(data)
    for _ in range(draw.draw(st.integers(1, 4))):
        op = draw.draw(st.sampled_from(["flip", "set", "cut", "insert", "length"]))
        i = draw.draw(st.integers(0, max(0, len(buf) - 1)))
        if op == "flip" and buf:
            buf[i] ^= 1 << draw.draw(st.integers(0, 7))
        elif op == "set" and buf:
            buf[i] = draw.draw(st.integers(0, 255))
        elif op == "cut":
            del buf[i:]
        elif op == "insert":
            buf[i:i] = draw.draw(st.binary(min_size=1, max_size=8))
        elif op == "length":  # a msgpack 32-bit length header claiming up to 4 GiB
            buf[i:i] = bytes([draw.draw(st.sampled_from([0xdb, 0xc6, 0xdd, 0xdf]))]) + \
                struct.pack(">I", draw.draw(st.integers(0, 2**32 - 1)))
    _fuzz_decode(bytes(buf))


@settings(max_examples=1500)
@given(st.integers(0, 6), st.binary(max_size=64), st.binary(max_size=128))
def test_a_value_that_does_not_decode_is_corrupt_for_that_key(tag: int, meta: bytes,
                                                               payload: bytes) -> None:
    rec = L3Record(1, False, tag, meta, payload, (("h", 1),), ("h", 1))
    try:
        rec.decode_value("the/key")
    except CorruptRecord as exc:
        assert "the/key" in str(exc)


HUGE_CLAIMS = [
    b"\x99\xdb\xff\xff\xff\xff",  # record: a str of 4 GiB
    b"\x99\x01\xc6\x7f\xff\xff\xff",  # a bin of 2 GiB
    b"\xdd\xff\xff\xff\xff",  # an array of 4 G elements
    b"\x99" + b"\xdd\x10\x00\x00\x00" * 9,  # nested arrays of 256 M elements each
    b"\xdf\xff\xff\xff\xff",  # a map of 4 G entries
    b"\xc9\xff\xff\xff\xff\x01",  # an ext of 4 GiB
    b"\x91" * 100_000,  # 100,000 nested arrays
    fields(value=300_000_000),  # an int where the value's bytes belong (bytes(n) allocates n)
    fields(meta=300_000_000),
]


@pytest.mark.parametrize("data", HUGE_CLAIMS)
def test_a_length_field_never_allocates_what_it_claims(data: bytes) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(CorruptRecord):
            L3Record.decode(data)
        for tag, meta, payload in [
            (codec.PACKED, b"", data),
            (codec.NDARRAY, msgpack.packb(["<f8", [2**31, 2**31]]), b""),
            (codec.NDARRAY, msgpack.packb(["<f8", [0, 2**62]]), b""),
            (codec.NDARRAY, msgpack.packb(["V2000000000", [1]]), b""),
            (codec.NDARRAY, msgpack.packb(["(100000,100000)f8", [1]]), b""),
        ]:
            try:
                L3Record(1, False, tag, meta, payload, (("h", 1),), ("h", 1)).decode_value("k")
            except CorruptRecord:
                pass
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"decoding {data[:12]!r} peaked at {peak} bytes"


@pytest.mark.redis
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(histories, st.data())
def test_lua_push_agrees_with_the_pure_rule(store: L3Store, writes: list[Dotted],
                                             data: st.DataObject) -> None:
    if not writes:
        return
    key = f"agree/{data.draw(st.integers(0, 10**9))}"
    store.rc.delete(record_key(key))
    stored = data.draw(st.sampled_from([None, *writes]))
    incoming = data.draw(st.sampled_from(writes))
    siblings = data.draw(st.booleans())
    if stored is not None:
        store.push(key, rec(stored, b"stored"))
    expected_outcome, expected_version = l3_rule(stored, incoming, keep_siblings=siblings)
    got = store.push(key, rec(incoming, b"incoming"), keep_siblings=siblings)
    assert got.outcome == expected_outcome
    assert expected_version is not None and got.record.version == expected_version
    held = store.get(key)
    assert held is not None and held.version == expected_version


@pytest.mark.redis
def test_the_push_script_carries_the_extension_through_a_merge(store: L3Store) -> None:
    """A merge (concurrent writes) is the one path where the script packs a record
    itself: the winner's extension must come out byte for byte, though cmsgpack would
    turn its empty map into an array and its big integer into a double."""
    key = "ext/merge"
    store.rc.delete(record_key(key))
    ext = msgpack.packb({"big": 2**60 + 1, "empty": {}, "f": 1.5})
    a = Dotted((("a", 1),), ("a", 1), 10)
    b = Dotted((("b", 1),), ("b", 1), 20)  # later: wins last-writer-wins
    store.push(key, rec(a))
    out = store.push(key, rec(b)._replace(ext=ext))
    assert out.outcome == "merged" and out.record.dot == ("b", 1)
    assert out.record.ext == ext and out.record.vector == (("a", 1), ("b", 1))
    raw = msgpack.unpackb(store.rc.get(record_key(key)), raw=True)
    assert raw[b"f"] == 2 and raw[b"x"] == ext


@pytest.mark.redis
def test_the_push_script_reads_format_1_records_by_name(store: L3Store) -> None:
    """A format-1 record stored before the upgrade is merged like any other; the
    result is written in format 2."""
    key = "ext/v1"
    old = [1, b"%016x" % 10, False, codec.PACKED, b"", msgpack.packb("old"), [b"a", 1], b"a", 1]
    store.rc.set(record_key(key), msgpack.packb(old, use_bin_type=False))
    assert store.get(key) == L3Record(10, False, codec.PACKED, b"", msgpack.packb("old"),
                                      (("a", 1),), ("a", 1))
    assert store.push(key, rec(Dotted((("a", 1),), ("a", 1), 10))).outcome == "equal"
    out = store.push(key, rec(Dotted((("b", 1),), ("b", 1), 5), b"new"))
    assert out.outcome == "merged" and out.record.dot == ("a", 1)  # the older HLC lost
    assert out.record.value == msgpack.packb("old") and out.record.ext == EMPTY_EXT
    assert msgpack.unpackb(store.rc.get(record_key(key)), raw=True)[b"f"] == 2
    newer = store.push(key, rec(Dotted((("a", 2), ("b", 1)), ("a", 2), 30)))
    assert newer.outcome == "newer"


@pytest.mark.redis
def test_records_the_script_cannot_read_are_refused(store: L3Store) -> None:
    key = "ext/bad"
    good = rec(Dotted((("a", 1),), ("a", 1), 1))
    future = msgpack.unpackb(good.encode(), raw=True) | {b"f": 3}
    store.rc.set(record_key(key), msgpack.packb(future, use_bin_type=False))
    with pytest.raises(CorruptRecord):  # a newer format: refused, not mis-merged
        store.push(key, good)
    store.rc.delete(record_key(key))
    with pytest.raises(CorruptRecord):
        store.push(key, good._replace(ext=None))  # type: ignore[arg-type]
    assert store.rc.get(record_key(key)) is None


@pytest.mark.redis
def test_every_accepted_change_is_in_the_group_feed(store: L3Store) -> None:
    key = "feed/k"
    g = group_of(key)
    before = store.feed(g, count=100_000)
    last = before[-1][0] if before else b"0-0"
    a = Dotted((("a", 1),), ("a", 1), 10)
    b = Dotted((("a", 2),), ("a", 2), 11)
    store.push(key, rec(a))
    store.push(key, rec(b))
    store.push(key, rec(a))  # older: refused, not fed
    rows = [r for r in store.feed(g, after=last) if r[1] == key]
    assert [L3Record.decode(r[2]).dot for r in rows] == [("a", 1), ("a", 2)]


@pytest.mark.redis
def test_a_foreign_value_is_an_error_for_reads_and_replaced_by_a_push(store: L3Store) -> None:
    """A value that is not a KVCOMM record makes reads of that key (only) raise
    CorruptRecord, whose advice is "remove or rewrite the key": a push rewrites it (as if
    the key were absent), so a write made after the error is not dropped (review 8)."""
    store.rc.set(record_key("foreign/1"), b"written by someone else")
    store.rc.set(record_key("foreign/2"), b"written by someone else")
    good = rec(Dotted((("a", 1),), ("a", 1), 1))
    with pytest.raises(CorruptRecord, match="rewrite the key"):
        store.get("foreign/1")
    assert store.get("foreign/ok") is None  # (other keys unaffected)
    out = store.push_many([("foreign/1", good), ("foreign/ok", good)])
    assert not isinstance(out[0], Exception) and out[0].outcome == "new"
    assert not isinstance(out[1], Exception) and out[1].outcome in ("new", "equal")
    assert store.get("foreign/1") == good
    assert store.push("foreign/2", good).outcome == "new"
    assert store.get("foreign/2") == good


@pytest.mark.redis
def test_counters_are_bounded_alike_by_the_reader_and_the_push_script(store: L3Store) -> None:
    """Counters run 1..2**53-1 (MAX_COUNTER), in Python and in Lua alike: past it Lua's
    doubles are inexact, and a host's write sequence raised there could reach the L2
    kernel's fresh-dot sentinel (review 8)."""
    assert MAX_COUNTER == 2**53 - 1
    at = rec(Dotted((("a", MAX_COUNTER),), ("a", MAX_COUNTER), 1))
    assert store.push("bound/1", at).outcome == "new"
    assert store.get("bound/1") == at
    for bad in (Dotted((("a", MAX_COUNTER + 1),), ("a", MAX_COUNTER + 1), 1),
                Dotted((("a", 1), ("b", 2**64 - 2)), ("a", 1), 1)):
        over = rec(bad)
        with pytest.raises(CorruptRecord):
            L3Record.decode(over.encode())
        with pytest.raises(CorruptRecord):
            store.push("bound/2", over)
    assert store.get("bound/2") is None
    # one written there by something else is replaced by the next push
    store.rc.set(record_key("bound/3"), rec(Dotted((("a", 2**60),), ("a", 2**60), 1)).encode())
    with pytest.raises(CorruptRecord):
        store.get("bound/3")
    assert store.push("bound/3", at).outcome == "new"


@pytest.mark.redis
def test_a_record_of_a_newer_format_is_not_replaced(store: L3Store) -> None:
    """A record of a format this host cannot read is refused by a push, not replaced: a
    host that was not upgraded fails loudly for that key (see "When to bump FORMAT")."""
    newer = msgpack.packb({"f": FORMAT + 1, "h": "0" * 16}, use_bin_type=False)
    store.rc.set(record_key("newer/1"), newer)
    good = rec(Dotted((("a", 1),), ("a", 1), 1))
    with pytest.raises(CorruptRecord, match="upgrade"):
        store.push("newer/1", good)
    assert store.rc.get(record_key("newer/1")) == newer  # untouched


@pytest.mark.redis
def test_pipelined_pushes_span_every_master(store: L3Store, cluster: RedisCluster) -> None:
    seed = drawn_seed(2**32)
    rng = random.Random(seed)
    items = [(f"spread/{i}", rec(Dotted((("h", i + 1),), ("h", i + 1), rng.randrange(99))))
             for i in range(600)]
    out = store.push_many(items)
    assert all(not isinstance(r, Exception) for r in out)
    nodes = {store.rc.get_node_from_key(record_key(k)).name for k, _ in items}
    assert len(nodes) == len(cluster.master_ports())
    assert all(store.get(k) == r for k, r in items)


def test_unreachable_cluster_is_unavailable() -> None:
    with pytest.raises(Unavailable):
        L3Store([("127.0.0.1", 1)], timeout=0.2)


@pytest.mark.redis
def test_every_change_carries_the_next_sequence_number_of_its_group(store: L3Store) -> None:
    key = "seq/k"
    g = group_of(key)
    start_seq, start_id = store.feed_position(g)
    assert start_seq is not None
    for i in range(1, 6):
        store.push(key, rec(Dotted((("a", i),), ("a", i), i)))
    store.push(key, rec(Dotted((("a", 1),), ("a", 1), 1)))  # older: refused, not counted
    rows = store.feed(g, after=start_id)
    assert [r.seq for r in rows] == list(range(start_seq + 1, start_seq + 6))
    assert all(r.key == key and not r.problem for r in rows)
    assert store.feed_seqs([g]) == {g: start_seq + 5}
    assert store.feed_position(g) == (start_seq + 5, rows[-1].id)


@pytest.mark.redis
def test_a_foreign_sequence_counter_restarts_the_sequence(store: L3Store) -> None:
    key = "seq/foreign"
    g = group_of(key)
    store.rc.set(seq_key(g), b"not a number")
    assert store.feed_seqs([g]) == {g: None}
    _, last = store.feed_position(g)
    out = store.push(key, rec(Dotted((("a", 1),), ("a", 1), 1)))
    assert out.outcome in ("new", "equal")
    assert store.feed_seqs([g]) == {g: 1}  # readers see the sequence go back and resync
    store.rc.delete(seq_key(g))
    store.rc.hset(seq_key(g), "x", "y")  # another type altogether
    store.push(key, rec(Dotted((("a", 2),), ("a", 2), 2)))
    assert store.feed_seqs([g]) == {g: 1}


def test_the_sweep_reads_foreign_counters_as_foreign_whatever_they_hold(store: L3Store) -> None:
    """The sweep's one-string answer (SWEEP_LUA: a field per group, split on commas and a
    space) carries nothing of a counter's value but digits: a foreign value holding the
    separators, a counter too long to be one, or another type read as foreign (None),
    and the groups after them keep their own answers (a smuggled separator would shift
    them). The sweep names the groups by their tags, a few bytes each on the wire."""
    keys = [f"sweep/hostile/{i}" for i in range(6)]
    gs = sorted({group_of(k) for k in keys})
    assert len(gs) >= 5
    for i, k in enumerate(keys):
        store.push(k, rec(Dotted((("a", 10 + i),), ("a", 10 + i), 1)))
    good = store.feed_heads(gs)
    assert all(seq is not None and seq > 0 and tail is not None for seq, tail in good.values())
    hostile = {gs[0]: b"1,2 3-4,5", gs[1]: b"9" * 20, gs[2]: b"7 1-1,8 2-2"}
    for g, v in hostile.items():
        store.rc.set(seq_key(g), v)
    store.rc.delete(seq_key(gs[3]))
    store.rc.hset(seq_key(gs[3]), "x", "y")  # another type: GET fails in the script
    heads = store.feed_heads(gs)
    assert {g: heads[g][0] for g in gs[:4]} == dict.fromkeys(gs[:4], None), heads
    for g in gs[4:]:
        assert heads[g] == good[g]  # untouched by the fields before them
    for g in gs[:3]:
        assert heads[g][1] == good[g][1]  # (the tail is the stream's own)
    assert store.feed_heads(gs, tails=False)[gs[4]] == (good[gs[4]][0], None)
    before = store.wire.sent
    store.feed_heads(range(store.groups.count))
    sent = store.wire.sent - before
    print(f"a sweep of all {store.groups.count} groups sent {sent} B")
    assert sent < 8 * store.groups.count  # (the key names took ~22 B a group)


@pytest.mark.redis
def test_feed_entries_that_are_not_ours_are_reported_not_raised(store: L3Store) -> None:
    g = group_of("seq/k")
    _, last = store.feed_position(g)
    store.rc.xadd(feed_key(g), {b"k": b"\xff\xfe", b"r": b"x", b"s": b"1"})
    store.rc.xadd(feed_key(g), {b"k": b"\xed\xa0\x80", b"r": b"x", b"s": b"2"})  # lone surrogate
    store.rc.xadd(feed_key(g), {b"other": b"field"})
    rows = store.feed_many({g: last})[g]
    assert not isinstance(rows, Exception)
    assert [r.key for r in rows] == [None, None, None]
    assert "UTF-8" in rows[0].problem and "UTF-8" in rows[1].problem
    assert rows[2].seq is None and "field" in rows[2].problem


@pytest.mark.redis
def test_a_value_of_another_type_is_an_error_for_reads_and_replaced_by_a_push(
        store: L3Store) -> None:
    store.rc.hset(record_key("typed/1"), "f", "v")
    good = rec(Dotted((("a", 1),), ("a", 1), 1))
    with pytest.raises(CorruptRecord, match="typed/1"):
        store.get("typed/1")
    out = store.push_many([("typed/1", good), ("typed/ok", good), ("bad\udc80key", good)])
    assert not isinstance(out[0], Exception) and out[0].outcome == "new"
    assert not isinstance(out[1], Exception)
    assert isinstance(out[2], CorruptRecord) and "UTF-8" in str(out[2])
    assert store.get("typed/1") == good


@pytest.mark.redis
def test_master_failover_keeps_replicated_writes(cluster: RedisCluster) -> None:
    store = L3Store(cluster.seeds)
    victim = None
    try:
        items = [(f"failover/{i}", rec(Dotted((("h", 1),), ("h", 1), i))) for i in range(200)]
        assert all(not isinstance(r, Exception) for r in store.push_many(items))
        cluster.wait_replicated()  # replication is asynchronous: wait for it here
        victim = store.rc.get_node_from_key(record_key("failover/0")).port
        cluster.kill(victim)
        cluster.wait_healthy(30)
        # the client learns the new master after a refused call
        got = wait_for(lambda: store.get("failover/0"), 10, "a read after the failover",
                       retry_on=(Unavailable,))
        assert got == items[0][1]
        assert store.rc.get_node_from_key(record_key("failover/0")).port != victim  # failed over
        assert all(store.get(k) == r for k, r in items)
        later = rec(Dotted((("h", 2),), ("h", 2), 999))
        assert store.push("failover/0", later).outcome == "newer"
    finally:
        store.close()
        if victim is not None:  # heal: later tests in any order get a whole cluster
            cluster.restart(victim)
            cluster.wait_restored(60)


@pytest.mark.redis
def test_a_killed_node_rejoins_and_the_cluster_is_whole_again(cluster: RedisCluster) -> None:
    from kvcomm.devcluster.redis_cluster import cluster_whole

    cluster.wait_restored(60)
    master = cluster.master_ports()[0]
    cluster.kill(master)
    why, _ = cluster_whole(cluster.ports, cluster.replicas)
    assert why  # a node short: not whole
    cluster.wait_healthy(30)
    cluster.restart(master)
    cluster.wait_restored(60)
    assert cluster_whole(cluster.ports, cluster.replicas)[0] == ""
    assert master not in cluster.master_ports()  # it came back as a replica
    assert len(cluster.master_ports()) == cluster.masters


@pytest.mark.redis
def test_a_master_without_replicas_does_not_hold_writes_back(cluster: RedisCluster) -> None:
    """cluster.wait_replicas=1, but the master's only replica is down (a lost node, or
    the time a promoted master has none): a write must still count as delivered once
    every connected replica has it, or the host's dirty writes would never drain."""
    import redis

    from kvcomm.devcluster.redis_cluster import command

    cluster.wait_restored(60)
    store = L3Store(cluster.seeds, wait_replicas=1, wait_ms=1000)  # (WAIT returns when acked)
    try:
        master = store.rc.get_node_from_key(record_key("degraded/k")).port
        replica = next(p for p in cluster.ports if p != master and f":{master}".encode()
                       in command(p, "INFO", "replication").split(b"master_port")[-1][:12])
        cluster.kill(replica)
        try:
            v = Dotted((("h", 1),), ("h", 1), 1 << 20)
            res = store.push_many([("degraded/k", rec(v))])[0]
            if not isinstance(res, Exception) and not res.durable:  # it had one last time
                res = store.push_many([("degraded/k", rec(v))])[0]
            # durable although WAIT 1 could never be acknowledged: it asked only for the
            # replicas that are connected (no wall-time assertion: a loaded CI is slow)
            assert not isinstance(res, Exception) and res.durable
            assert store.degraded  # counted (and logged once)
            healthy = store.push_many([(f"degraded/{i}", rec(v)) for i in range(20)])
            assert all(not isinstance(r, Exception) and r.durable for r in healthy)
        finally:
            cluster._start_node(replica)
            cluster.wait_restored(60)
        assert isinstance(store.rc, redis.cluster.RedisCluster)
    finally:
        store.close()


def test_a_count_recorded_then_lost_does_not_let_another_count_in(cluster: RedisCluster) -> None:
    """F: check_groups guards against a second count only through kvm:groups (and data
    of the 16-group layout): if kvm:groups is lost (its master failed over before the
    unacknowledged SET replicated, a FLUSH of one master) a host configured with another
    count records its own and starts: every key then hashes to another group and slot,
    and the data written under the first count is invisible. Data of another count must
    be refused like the legacy layout's.
    (found in review 11: slot balancing)"""
    a = L3Store(cluster.seeds, groups=1024)
    b = L3Store(cluster.seeds, groups=2048)
    try:
        a.rc.delete(META_GROUPS)
        assert a.check_groups(record=True) == 1024
        k = next(f"moves/count/{i}" for i in range(100) if a.groups.of(f"moves/count/{i}"))
        a.push(k, record("v", "h1", 1, 1))
        assert b.get(k) is None  # what a host of the other count would see: nothing
        a.rc.delete(META_GROUPS)  # lost
        with pytest.raises(ConfigError, match="cluster.groups"):
            b.check_groups(record=True)
    finally:
        a.rc.delete(META_GROUPS)
        a.close()
        b.close()


def test_a_change_whose_hint_subscription_was_killed_is_still_seen(cluster: RedisCluster) -> None:
    """(Held.) Every hint subscription killed on every master (CLIENT KILL TYPE pubsub)
    right before another host's write: the holder still sees the change (the broken
    subscriptions count as lost hints, their groups' counters are read).
    (found in review 11: slot balancing)"""
    from kvcomm.devcluster.redis_cluster import command
    from tests.support.daemon_harness import Host
    from tests.support.helpers import wait_for

    h1 = Host(cluster, "r11-hint-1", seed=1)
    h2 = Host(cluster, "r11-hint-2", seed=2)
    try:
        h2.kv.put("moves/hint/k", {"n": 0})
        wait_for(lambda: h1.kv.get("moves/hint/k") == {"n": 0}, 30, "h1 to read the key")
        assert h1.daemon is not None
        wait_for(lambda: h1.daemon.l3.hint_stats.get("subscribed", 0) >= 1024, 30,  # type: ignore[union-attr]
                 "h1 to subscribe every group")
        killed = sum(int(command(p, "CLIENT", "KILL", "TYPE", "pubsub").strip(b":\r\n") or 0)
                     for p in cluster.master_ports())
        assert killed >= 2  # the fault happened (both hosts' subscriptions)
        h2.kv.put("moves/hint/k", {"n": 1})
        wait_for(lambda: h1.kv.get("moves/hint/k") == {"n": 1}, 60, "h1 to see the change")
        assert h1.stats.lost_hints > 0
    finally:
        h1.close()
        h2.close()


def test_only_a_refused_connection_sends_a_start_up_read_to_the_successor() -> None:
    """(Review.) redis-py raises AUTH failures and the server's client limit as
    ConnectionError too; a new slot map mends neither, so only a refused connection (a
    dead or failed-over master: redis-py's error raised from ConnectionRefusedError)
    re-reads the map. Real: redis-py dialling a port nothing listens on.
    (found in review 23: faults the whole suite's order found)"""
    import socket

    import redis
    from redis import exceptions as rex

    from kvcomm.tiers.l3 import _refused

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(rex.ConnectionError) as refused:
        redis.Redis(port=port, socket_connect_timeout=1, retry_on_error=[]).ping()
    assert _refused(refused.value)
    assert not _refused(rex.AuthenticationError("invalid username-password pair"))
    assert not _refused(rex.ConnectionError("max number of clients reached"))
    assert not _refused(rex.TimeoutError("Timeout connecting to server"))
