"""The push script takes a group's records in one call (issue 9: a healed host's backlog of
thousands is a few calls, not one per record), on a real Redis Cluster: each record's reply,
feed entry, index and expiry entries are what a call of its own would have made, in order,
whatever the other records of the call do."""

from __future__ import annotations

import random
import time

import pytest

from kvcomm.core.expiry import with_deadline
from kvcomm.core.versions import Dotted
from kvcomm.devcluster.redis_cluster import RedisCluster
from kvcomm.metrics import wire
from kvcomm.tiers.l3 import (
    EMPTY_EXT,
    PUSH_BATCH,
    CorruptRecord,
    L3Record,
    L3Store,
    PushResult,
    group_of,
    record_key,
)
from tests.support.daemon_harness import cluster_fixture, store_fixture  # noqa: F401 (the fixtures)
from tests.support.helpers import drawn_seed


def rec(v: Dotted, value: bytes = b"v", tomb: bool = False, ext: bytes = EMPTY_EXT) -> L3Record:
    return L3Record(v.hlc, tomb, 1, b"", value, v.vector, v.dot, ext)


def one(actor: str, counter: int, hlc: int) -> Dotted:
    return Dotted(((actor, counter),), (actor, counter), hlc)


def group_keys(prefix: str, n: int) -> list[str]:
    """``n`` keys of one group (one slot, one stream)."""
    g = group_of(f"{prefix}/0")
    keys: list[str] = []
    i = 0
    while len(keys) < n:
        if group_of(f"{prefix}/{i}") == g:
            keys.append(f"{prefix}/{i}")
        i += 1
    return keys


def evalsha_calls(store: L3Store, key: str) -> int:
    """EVALSHA calls the master of ``key``'s slot has answered (INFO commandstats)."""
    node = store.rc.get_node_from_key(record_key(key))
    stats = store.rc.get_redis_connection(node).info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def test_one_call_pushes_a_group_of_records_with_mixed_outcomes(store: L3Store) -> None:
    """Stored, newer, kept older, equal, a conflict for a resolver, a merge, a delete, a
    record with a deadline and a malformed record, all of one group in one EVALSHA: each
    reply is the one the L3 rule gives that record alone, the malformed one is set aside
    (CorruptRecord) without stopping the others, and the group's feed holds one entry per
    stored change, in the order of the call, numbered one after the other."""
    seed = drawn_seed(2**32)
    names = ["new", "newer", "older", "equal", "conflict", "merged", "delete", "ttl", "bad"]
    k = dict(zip(names, group_keys(f"batch/{seed}", len(names)), strict=True))
    g = group_of(k["new"])
    deadline = time.time() + 3600
    stored = {"newer": rec(one("a", 1, 10)), "older": rec(one("a", 2, 20)),
              "equal": rec(one("a", 1, 10)), "conflict": rec(one("a", 1, 10)),
              "merged": rec(one("a", 1, 10)), "delete": rec(one("a", 1, 10))}
    for name, r in stored.items():
        assert store.push(k[name], r).outcome == "new"
    pushed = {"new": rec(one("b", 1, 30), b"fresh"),
              "newer": rec(Dotted((("a", 2),), ("a", 2), 11), b"second"),
              "older": rec(one("a", 1, 10), b"stale"),
              "equal": rec(one("a", 1, 10)),
              "conflict": rec(one("b", 1, 5), b"theirs"),
              "merged": rec(one("b", 1, 40), b"later"),
              "delete": rec(Dotted((("a", 2),), ("a", 2), 12), b"", tomb=True),
              "ttl": rec(one("b", 2, 50), b"short-lived",
                         ext=with_deadline(b"", deadline)),
              # a counter past 2**53-1: the script refuses it (KVCOMMBAD)
              "bad": rec(one("b", 2**53, 60))}
    seq0, last0 = store.feed_position(g)
    calls0 = evalsha_calls(store, k["new"])
    out = store.push_many([(k[n], pushed[n]) for n in names], keep_siblings={k["conflict"]})
    assert evalsha_calls(store, k["new"]) - calls0 == 1  # one call for the whole group
    got = dict(zip(names, out, strict=True))
    assert isinstance(got["bad"], CorruptRecord) and "malformed" in str(got["bad"])
    res = {n: r for n, r in got.items() if isinstance(r, PushResult)}
    assert {n: r.outcome for n, r in res.items()} == {
        "new": "new", "newer": "newer", "older": "older", "equal": "equal",
        "conflict": "conflict", "merged": "merged", "delete": "newer", "ttl": "new"}
    for n in ("new", "newer", "delete", "ttl"):  # L3 holds what was pushed
        assert res[n].record == pushed[n] and store.get(k[n]) == pushed[n]
    for n in ("older", "equal", "conflict"):  # L3 kept what it held
        assert res[n].record == stored[n] and store.get(k[n]) == stored[n]
    merged = res["merged"].record
    assert merged.vector == (("a", 1), ("b", 1)) and merged.dot == ("b", 1)
    assert merged.value == b"later" and store.get(k["merged"]) == merged
    assert store.get(k["bad"]) is None  # nothing stored for the malformed record
    # the key index and the expiry index, as the records say
    index = {m.decode() for m in store.rc.zrange(store.groups.index_key(g), 0, -1)}
    assert {k["new"], k["newer"], k["merged"], k["ttl"]} <= index
    assert k["delete"] not in index and k["bad"] not in index
    assert store.rc.zscore(store.groups.expiry_key(g), k["ttl"]) == pytest.approx(deadline)
    assert store.rc.pttl(record_key(k["ttl"])) > 3600_000  # (the deadline plus the grace)
    assert store.rc.pttl(record_key(k["new"])) == -1
    # the feed: the stored changes, in the call's order, numbered one after the other
    entries = store.feed(g, after=last0)
    assert [e.key for e in entries] == [k[n] for n in ("new", "newer", "merged", "delete", "ttl")]
    assert [e.seq for e in entries] == list(range(seq0 + 1, seq0 + 6))
    decoded = [L3Record.decode(e.record) for e in entries]  # (small records ride inline)
    assert decoded == [pushed["new"], pushed["newer"], merged, pushed["delete"], pushed["ttl"]]
    assert store.feed_position(g)[0] == seq0 + 5


def test_a_redis_error_in_one_record_of_a_call_leaves_the_others_pushed(store: L3Store) -> None:
    """The group's expiry index holds a foreign type: the record with a deadline gets the
    Redis error (WRONGTYPE, as a CorruptRecord for its key, as a call of its own did); the records
    before and after it in the same call are stored and fed."""
    a, ttl, b = group_keys(f"batcherr/{random.randrange(2**32)}", 3)
    g = group_of(a)
    xkey = store.groups.expiry_key(g)
    store.rc.set(xkey, b"not a sorted set")
    try:
        seq0, last0 = store.feed_position(g)
        out = store.push_many([
            (a, rec(one("h", 1, 1), b"a")),
            (ttl, rec(one("h", 2, 2), b"t", ext=with_deadline(b"", time.time() + 60))),
            (b, rec(one("h", 3, 3), b"b"))])
        assert isinstance(out[0], PushResult) and out[0].outcome == "new"
        assert isinstance(out[1], CorruptRecord) and "wrong kind" in str(out[1]), out[1]
        assert isinstance(out[2], PushResult) and out[2].outcome == "new"
        assert store.get(ttl) is None
        entries = store.feed(g, after=last0)
        assert [(e.key, e.seq) for e in entries] == [(a, seq0 + 1), (b, seq0 + 2)]
    finally:
        store.rc.delete(xkey)


def test_a_backlog_of_one_group_goes_in_batches_in_order(store: L3Store,
                                                         cluster: RedisCluster) -> None:
    """More records of one group than one call takes (PUSH_BATCH): a few calls, every
    record stored, the feed in the order pushed; a second push of the same records is
    all 'equal' (a replay stores nothing, feeds nothing, and gets no record back)."""
    n = 2 * PUSH_BATCH + 10
    keys = group_keys(f"backlog/{random.randrange(2**32)}", n)
    g = group_of(keys[0])
    items = [(key, rec(one("h", i + 1, i + 1), str(i).encode())) for i, key in enumerate(keys)]
    seq0, last0 = store.feed_position(g)
    calls0 = evalsha_calls(store, keys[0])
    out = store.push_many(items)
    assert evalsha_calls(store, keys[0]) - calls0 == 3
    assert all(isinstance(r, PushResult) and r.outcome == "new" for r in out)
    entries = store.feed(g, after=last0, count=n + 10)
    assert [e.key for e in entries] == keys
    assert [e.seq for e in entries] == list(range(seq0 + 1, seq0 + n + 1))
    received = store.wire.received
    again = store.push_many(items)
    assert all(isinstance(r, PushResult) and r.outcome == "equal" for r in again)
    assert all(r.record == item[1] for r, item in zip(again, items, strict=True))  # type: ignore[union-attr]
    # (an equal record of the very bytes pushed is not sent back: ~22 bytes a reply)
    assert store.wire.received - received < 40 * n
    assert store.feed_position(g)[0] == seq0 + n


def test_a_call_refused_for_a_slot_on_the_move_falls_back_to_one_record_a_call(
        store: L3Store) -> None:
    """A slot half migrated (two of the group's records moved to the importing master,
    its feed, counter and index still on the source): the group's call declares keys on
    both sides and is refused (TRYAGAIN) as a whole; sent again one record a call, the
    records still on the source are pushed there, as calls of one record always were,
    and only the moved ones stay refused until the move ends (Unavailable)."""
    from kvcomm.balance.migrate import SlotMover
    from kvcomm.errors import Unavailable
    from tests.tools.test_migrate_interrupted import _cleanup, _keys_of_slot

    g = group_of(f"moving/{random.randrange(2**32)}")
    slot = store.groups.slot(g)
    keys = _keys_of_slot(store, slot, 6, f"moving/{g}")
    for i, k in enumerate(keys):
        assert store.push(k, rec(one("h", 1, i + 1))).outcome == "new"
    source = store.rc.get_node_from_key(record_key(keys[0]))
    target = next(n for n in store.rc.get_primaries() if n.name != source.name)
    src, dst = store.rc.get_redis_connection(source), store.rc.get_redis_connection(target)
    mover = SlotMover(store)
    try:
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING",
                            src.execute_command("CLUSTER", "MYID"))
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING",
                            dst.execute_command("CLUSTER", "MYID"))
        moved = keys[:2]
        src.execute_command("MIGRATE", target.host, target.port, "", 0, 5000, "KEYS",
                            *(record_key(k) for k in moved))
        tried = store.redirects["tryagain"]
        with pytest.raises(Unavailable, match="still redirected"):
            store.push_many([(k, rec(one("h", 2, 10 + i), b"new")) for i, k in enumerate(keys)])
        assert store.redirects["tryagain"] > tried  # (the fault happened)
        for k in keys[2:]:  # on the source: pushed, one call each
            raw = src.get(record_key(k))
            assert raw is not None and L3Record.decode(raw).value == b"new", k
        for k in moved:  # moved: the old record, on the target
            raw = dst.execute_command("ASKING") and dst.get(record_key(k))
            assert raw is not None and L3Record.decode(raw).value == b"v", k
    finally:
        _cleanup(mover, slot)


def test_large_records_of_one_group_are_not_packed_into_one_call(store: L3Store) -> None:
    """A call carries at most PUSH_BATCH_BYTES of records (a record larger goes alone):
    PUSH_BATCH records near cache.max_value_size (64 MiB) in one EVALSHA would be
    gigabytes Redis holds as arguments and copies into Lua at once (a pipeline of calls of
    one record each held one record at a time), and seconds of a script no other client
    is served during. Six records of 0.4 MiB of one group: three calls, each stored."""
    from kvcomm.tiers.l3 import PUSH_BATCH_BYTES

    size = 4 * PUSH_BATCH_BYTES // 10
    keys = group_keys(f"bigbatch/{random.randrange(2**32)}", 6)
    items = [(key, rec(one("h", i + 1, i + 1), bytes([i]) * size))
             for i, key in enumerate(keys)]
    calls0 = evalsha_calls(store, keys[0])
    out = store.push_many(items)
    assert all(isinstance(r, PushResult) and r.outcome == "new" for r in out), out
    assert evalsha_calls(store, keys[0]) - calls0 == 3
    for key, r in items:
        assert store.get(key) == r


def test_small_records_answered_with_large_stored_ones_take_several_calls(
        store: L3Store) -> None:
    """Small records of one group, each older than a large record L3 holds: each reply
    carries the stored record back (read into Lua, held in the call's reply). A call's
    replies stop at PUSH_BATCH_BYTES of records; its remaining records are sent again in
    other calls (a backlog of PUSH_BATCH small writes over keys rewritten with 64 MiB
    values was one call of 16 GiB of replies). Every reply is still the right one."""
    from kvcomm.tiers.l3 import PUSH_BATCH_BYTES

    size = 4 * PUSH_BATCH_BYTES // 10
    keys = group_keys(f"bigreply/{random.randrange(2**32)}", 6)
    big = {k: rec(one("b", 2, 20 + i), bytes([i]) * size) for i, k in enumerate(keys)}
    for k, r in big.items():
        assert store.push(k, r).outcome == "new"
    calls0 = evalsha_calls(store, keys[0])
    out = store.push_many([(k, rec(one("b", 1, 1), b"small")) for k in keys])
    assert [r.outcome for r in out] == ["older"] * len(keys), out  # type: ignore[union-attr]
    assert [r.record for r in out] == [big[k] for k in keys]  # type: ignore[union-attr]
    assert evalsha_calls(store, keys[0]) - calls0 == 2  # (3 replies of 0.4 MiB a call)


def test_calls_whose_reply_budget_is_spent_are_not_cut_by_the_redirect_deadline(
        store: L3Store) -> None:
    """The records a call's reply budget left are sent again however long the push has
    taken: each call answers one record at least, so the rounds end. (Counted against the
    deadline meant for a slot on the move, a backlog answered with large stored records
    failed as a whole past ``timeout`` seconds, and was sent again from the start, forever.)
    ``timeout`` 0: any second round would be past it."""
    from kvcomm.tiers.l3 import PUSH_BATCH_BYTES

    size = 4 * PUSH_BATCH_BYTES // 10
    keys = group_keys(f"latedeadline/{random.randrange(2**32)}", 6)
    for i, k in enumerate(keys):
        assert store.push(k, rec(one("b", 2, 20 + i), bytes([i]) * size)).outcome == "new"
    timeout = store.timeout
    store.timeout = 0
    try:
        out = store.push_many([(k, rec(one("b", 1, 1), b"small")) for k in keys])
    finally:
        store.timeout = timeout
    assert [r.outcome for r in out] == ["older"] * len(keys), out  # type: ignore[union-attr]


def test_a_client_starts_with_the_keyed_commands_table_and_a_process_reads_the_whole_once(
        cluster: RedisCluster) -> None:
    """redis-py reads COMMAND (~90 kB from Redis 7) at every cluster client's start: an
    agent moved to another host's process paid it again (measured: 91.7 kB of a 93 kB
    start-up). A client now starts with the entries of the commands KVCOMM routes by key
    (COMMAND INFO: a few kB); the first command it has no entry for reads the whole table,
    kept for the process's later clients. Every command still finds its keys' slot."""
    wire._TABLES.clear()
    first = L3Store(cluster.seeds)
    try:
        first.push("ct/a", rec(one("h1", 1, 1)))
        first_in = first.rc.wire.received
        assert first.rc.get("kvcomm-no-such-key") is None  # (a keyed command: its slot found)
        assert first.rc.wire.received - first_in < 5_000  # (an entry it started with)
        before = first.rc.wire.received
        assert first.rc.strlen("ct/none") == 0  # no entry: the whole table, then routed
        unknown_in = first.rc.wire.received - before
        assert first.rc.strlen("ct/other") == 0
        again_in = first.rc.wire.received - before - unknown_in
    finally:
        first.close()
    second = L3Store(cluster.seeds)
    try:
        second.push("ct/b", rec(one("h2", 1, 2)))
        second_in = second.rc.wire.received
        got = second.get("ct/a")
        assert got is not None and got.value == b"v"
        assert second.rc.strlen("ct/none") == 0  # (the whole table kept: no read)
        second_after = second.rc.wire.received
    finally:
        second.close()
    print(f"received at start: first client {first_in} B, the first unknown command "
          f"{unknown_in} B, the next {again_in} B; a second client {second_in} B, "
          f"{second_after} B after a get and a strlen")
    assert first_in < 20_000  # (the whole table is ~90 kB)
    assert unknown_in > 50_000  # the whole table was read: the fallback is real
    assert again_in < 1_000
    assert second_after < 20_000
    assert len(wire._TABLES) == 1 and next(iter(wire._TABLES.values()))[1]  # (whole)


def test_a_client_without_command_info_reads_the_whole_table(cluster: RedisCluster,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that does not know one of KEYED_COMMANDS (a nil entry in COMMAND INFO's
    reply) gives the client the whole table at start: nothing is left unroutable."""
    wire._TABLES.clear()
    monkeypatch.setattr(wire, "KEYED_COMMANDS", (*wire.KEYED_COMMANDS, "kvcomm-no-such-command"))
    store = L3Store(cluster.seeds)
    try:
        assert store.rc.wire.received > 50_000
        assert store.rc.get("kvcomm-no-such-key") is None
    finally:
        store.close()
        wire._TABLES.clear()


def test_the_command_tables_kept_are_bounded() -> None:
    """At most COMMAND_TABLES clusters' tables, the least recently used forgotten."""
    wire._TABLES.clear()
    reads = []
    for i in range(wire.COMMAND_TABLES + 3):
        wire._command_table(frozenset({f"127.0.0.1:{i}"}), lambda i=i: reads.append(i) or {"GET": i})
    assert len(wire._TABLES) == wire.COMMAND_TABLES
    table = wire._command_table(frozenset({"127.0.0.1:0"}), lambda: {"GET": "again"})
    assert table == {"GET": "again"}  # (forgotten: read again)
    kept = wire._command_table(frozenset({f"127.0.0.1:{wire.COMMAND_TABLES + 2}"}), lambda: {})
    assert kept == {"GET": wire.COMMAND_TABLES + 2}
    kept.pop("GET")  # a copy: the parser renames entries of what it is given
    assert wire._command_table(frozenset({f"127.0.0.1:{wire.COMMAND_TABLES + 2}"}), dict) == \
        {"GET": wire.COMMAND_TABLES + 2}
    # a part of the table (whole=False) does for a start, never for a command it lacks
    part = frozenset({"127.0.0.1:part"})
    assert wire._command_table(part, lambda: {"get": 1}, whole=False) == {"get": 1}
    assert wire._command_table(part, lambda: {"get": 2}, whole=False) == {"get": 1}
    assert wire._command_table(part, lambda: {"get": 3, "strlen": 3}) == {"get": 3, "strlen": 3}
    assert wire._command_table(part, lambda: {}, whole=False) == {"get": 3, "strlen": 3}
