"""The L3 client's small command table (metrics/wire.py) and the sweep's one-string reads
of every group's counter and tail, on a real Redis Cluster."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from redis.exceptions import AskError, ResponseError

from kvcomm.devcluster.redis_cluster import RedisCluster
from kvcomm.metrics import wire
from kvcomm.tiers.l3 import L3Store
from tests.support.daemon_harness import cluster_fixture, record  # noqa: F401 (the fixture)
from tests.support.helpers import drawn_seed


@pytest.fixture(name="fresh")
def fresh_fixture(cluster: RedisCluster) -> Iterator[L3Store]:
    """A client of a process that has read no command table yet (the part only)."""
    wire._TABLES.clear()
    s = L3Store(cluster.seeds)
    yield s
    s.close()
    wire._TABLES.clear()



def test_a_container_command_missing_from_the_part_table_is_routed_on_first_use(
        cluster: RedisCluster, fresh: L3Store) -> None:
    """MEMORY USAGE and OBJECT ENCODING are named by two words; redis-py, meeting a
    command it has no entry for, reads the whole table but goes on with the name unsplit:
    it finds no key and raised "No way to dispatch this command" on the first use in a
    process (a plain RedisCluster, which starts with the whole table, routes it).
    (found in review 22: the L3 client's command table, sweeps)"""
    assert not next(iter(wire._TABLES.values()))[1]  # (the client started with the part)
    rc = fresh.rc
    keys = [f"rev22/container/{i}" for i in range(8)]
    for k in keys:
        rc.set(k, b"x" * 100)
    assert "memory" not in rc.commands_parser.commands
    usage = rc.memory_usage(keys[0])  # the first command the part table has no entry for
    assert isinstance(usage, int) and usage > 100
    assert next(iter(wire._TABLES.values()))[1]  # (the whole table was read for it)
    assert all(isinstance(rc.memory_usage(k), int) for k in keys[1:])
    wire._TABLES.clear()
    other = L3Store(cluster.seeds)
    try:
        assert "object" not in other.rc.commands_parser.commands
        assert other.rc.object("encoding", keys[0]) in (b"raw", b"embstr")
    finally:
        other.close()


def test_the_first_command_the_part_table_lacks_is_sent_while_the_default_node_is_down(
        cluster: RedisCluster) -> None:
    """redis-py reads the table it lacks from its *default node* (the first seed), before
    its retry loop: with that master paused, the first command the part table has no
    entry for (STRLEN here) raised a timeout, where a client that started with the whole
    table sends it to its key's master, which is up. The whole table now comes from
    another master when the default node does not answer.
    (found in review 22: the L3 client's command table, sweeps)"""
    wire._TABLES.clear()
    store = L3Store(cluster.seeds, timeout=0.3)
    try:
        rc = store.rc
        default = rc.get_default_node()
        key = next(k for k in (f"rev22/down/{i}" for i in range(100))
                   if rc.get_node_from_key(k).name != default.name)
        rc.set(key, b"abc")
        assert "strlen" not in rc.commands_parser.commands
        cluster.pause(default.port)
        try:
            with pytest.raises(Exception):  # noqa: B017,PT011 (the fault is real: it is down)
                default.redis_connection.ping()
            assert rc.strlen(key) == 3
        finally:
            cluster.resume(default.port)
        assert next(iter(wire._TABLES.values()))[1]  # (the whole table, from another master)
    finally:
        store.close()
        wire._TABLES.clear()
    cluster.wait_healthy()


def test_a_part_table_read_while_the_whole_was_kept_does_not_replace_it() -> None:
    """A client starting (its part table, COMMAND INFO, read outside the lock) while
    another client of the process reads the whole table: the part, stored last, replaced
    the whole, and the process's next command the part lacks read the ~90 kB again.
    (found in review 22: the L3 client's command table, sweeps)"""
    wire._TABLES.clear()
    cluster = frozenset({"127.0.0.1:race"})
    whole = {"get": 1, "strlen": 1, "memory": 1}

    def part_read_while_the_whole_is_read() -> dict[str, int]:
        assert wire._command_table(cluster, lambda: dict(whole)) == whole  # (another client)
        return {"get": 1}

    try:
        wire._command_table(cluster, part_read_while_the_whole_is_read, whole=False)
        reads = []
        got = wire._command_table(cluster, lambda: reads.append(1) or dict(whole))
        assert got == whole and reads == []  # the whole table kept: not read again
    finally:
        wire._TABLES.clear()


def test_a_sweep_mid_migration_reads_a_moved_counter_through_ask(cluster: RedisCluster) -> None:
    """A group's slot MIGRATING, its counter and stream already moved to the target (a
    migration's last batch), the slot map still naming the source: the script's GET there
    fails (``E``) and the counter is read again, the ASK redirect followed; the legacy
    16-group tags ("0".."15") are what the script is given.
    (found in review 22: the L3 client's command table, sweeps)"""
    store = L3Store(cluster.seeds, groups=16)
    try:
        assert store.groups.tags[3] == "3"
        g = 3
        keys = [k for k in (f"rev22/mig/{i}" for i in range(400)) if store.groups.of(k) == g][:2]
        for i, k in enumerate(keys):
            store.push(k, record(f"v{i}", "h", 1, 1 + i))
        others = [x for x in range(16) if x != g]
        want = store.feed_heads(range(16))
        assert want[g][0] == 2 and want[g][1] is not None
        slot = store.groups.slot(g)
        src = store.rc.get_node_from_key(store.groups.seq_key(g))
        dst = next(n for n in store.rc.get_primaries() if n.name != src.name)
        s, d = store.rc.get_redis_connection(src), store.rc.get_redis_connection(dst)
        d.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", s.execute_command("CLUSTER MYID"))
        s.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", d.execute_command("CLUSTER MYID"))
        s.execute_command("MIGRATE", dst.host, dst.port, "", 0, 5000, "KEYS",
                          store.groups.seq_key(g), store.groups.feed_key(g))
        with pytest.raises(AskError):  # (moved: the source sends its readers on)
            s.get(store.groups.seq_key(g))
        got = store.feed_heads(range(16))
        assert got[g][0] == want[g][0]
        assert {x: got[x] for x in others} == {x: want[x] for x in others}
        # (finish the migration: the slot's other keys, then its owner everywhere)
        rest = s.execute_command("CLUSTER GETKEYSINSLOT", slot, 1000)
        if rest:
            s.execute_command("MIGRATE", dst.host, dst.port, "", 0, 5000, "KEYS", *rest)
        dst_id = d.execute_command("CLUSTER MYID")
        for n in store.rc.get_primaries():
            store.rc.get_redis_connection(n).execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
        assert store.feed_heads(range(16))[g][0] == want[g][0]
    finally:
        store.close()


def test_the_clients_command_method_still_answers_the_whole_table(fresh: L3Store) -> None:
    """``rc.command()`` is redis-py's public COMMAND ("details about all Redis commands"):
    only the client's start may take the part table; a tool calling it got 11 entries.
    (found in review 22: the L3 client's command table, sweeps)"""
    assert not next(iter(wire._TABLES.values()))[1]  # (the client started with the part)
    table = fresh.rc.command()
    assert "strlen" in table and len(table) > 100, sorted(table)
    assert next(iter(wire._TABLES.values()))[1]  # (kept whole for the process's clients)
    assert fresh.rc.strlen("rev22/none") == 0


def test_threads_meeting_a_command_the_part_lacks_read_the_whole_table_once(
        fresh: L3Store) -> None:
    """Sixteen threads of one client (a thread pool's pipelines, say) sending, together,
    their first command the part table lacks: each read the ~90 kB table (measured: 733
    kB received), where the module promises once per process and cluster.
    (found in review 22: the L3 client's command table, sweeps)"""
    rc = fresh.rc
    keys = [f"rev22/threads/{i}" for i in range(16)]
    for k in keys:
        rc.set(k, b"abc")
    start = threading.Barrier(len(keys))

    def first(k: str) -> int:
        start.wait(10)
        return int(rc.strlen(k))

    before = rc.wire.received
    with ThreadPoolExecutor(len(keys)) as pool:
        assert list(pool.map(first, keys)) == [3] * len(keys)
    received = rc.wire.received - before
    print(f"16 threads' first STRLEN: {received} B received")
    assert next(iter(wire._TABLES.values()))[1]
    assert received < 2 * 90_000  # the whole table once (~90 kB), and 16 small replies


def test_a_sweep_of_16384_groups_matches_each_counter_and_tail_read_alone(
        cluster: RedisCluster) -> None:
    """Every group of the largest count (one a slot), random hostile counters among them
    (separators, signs, spaces, 19 and 20 digits, other types): the one-string answer
    gives each group what reading its counter and its stream's last id alone gives.
    (found in review 22: the L3 client's command table, sweeps)"""
    seed = drawn_seed(1 << 30)
    rnd = random.Random(seed)
    store = L3Store(cluster.seeds, groups=16384)
    try:
        n = store.groups.count
        picked = rnd.sample(range(n), 200)
        values: list[bytes | None] = [b"7", b"0", b"9" * 19, b"9" * 20, b"-5", b"+5", b" 5",
                                      b"5 ", b"1,2", b"3 4-0", b"", b"E", b"?", b"\xff", None]
        for g in picked:
            v = rnd.choice(values)
            if v is None:
                store.rc.hset(store.groups.seq_key(g), "x", "y")
            else:
                store.rc.set(store.groups.seq_key(g), v)
            if rnd.random() < 0.5:
                store.rc.xadd(store.groups.feed_key(g), {"k": "v"})
        heads = store.feed_heads(range(n))
        assert len(heads) == n
        for g in picked:
            try:
                raw = store.rc.get(store.groups.seq_key(g))
            except ResponseError:  # another type: foreign, read again alone (no tail)
                assert heads[g] == (None, None), g
                continue
            want = 0 if raw is None else (int(raw) if raw.isdigit() and len(raw) < 20
                                          else None)
            last = store.rc.xrevrange(store.groups.feed_key(g), count=1)
            assert heads[g] == (want, last[0][0] if last else None), (g, raw)
        assert all(heads[g] == (0, None) for g in set(range(n)) - set(picked))
    finally:
        store.close()
