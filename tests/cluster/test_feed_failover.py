"""A Redis failover that loses a feed entry a host has read, then reissues its sequence
number at an older stream id, on a real Redis Cluster with replicas.

The loss is forced, not left to luck: the lost entry X is written on the group's master
by the push script run with ``redis.set_repl(redis.REPL_NONE)``, so the master stores
and answers it (and publishes its hint) while its replica never gets it — exactly the
asynchronous-replication window (``cluster.wait_replicas`` 0, or a master whose replica
is disconnected: a push then waits for the replicas connected, none). A manual failover
(``CLUSTER FAILOVER`` on the replica: it waits until it has every byte the master
replicated, which X is not part of) then promotes the replica: the group's counter is
one behind the host's last sequence number, and X is gone. The old master's stream id
was set far ahead first (XSETID, also unreplicated: a master whose clock runs ahead
does the same), so X's id is past any id the new master gives: the next change takes
X's sequence number at an id *before* the host's cursor — invisible to a read after
the cursor, and its counter equal to the host's last number.

A host must still converge: every host's L2 value equals L3's final value. And when X
was an acknowledged write of a host (its push answered with no replica holding it), the
failover must not leave it only on the hosts that hold it: the writer's resync pushes
it again, unless L3 has since taken a record that covers it (a later delete).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvcomm.devcluster.redis_cluster import RedisCluster, command
from kvcomm.tiers.l3 import PUSH_LUA, DaemonL3, L3Record, L3Store, feed_key, group_of
from tests.support.daemon_harness import Host, record, store_fixture  # noqa: F401 (fixtures)
from tests.support.helpers import wait_for
from tests.support.servers import starts

BIG = "x" * 1000  # over FEED_INLINE: a value-less entry, whose hint carries the entry
UNREPLICATED = "redis.set_repl(redis.REPL_NONE)\n"  # the script's effects stay on the master
AHEAD_MS = 3_600_000  # the old master's stream ids run an hour ahead


@pytest.fixture(scope="module")
@starts("redis")
def cluster() -> Iterator[RedisCluster]:
    """A Redis Cluster of this module's own, a shard per test (see _USED)."""
    with RedisCluster(masters=10) as c:
        yield c


def _replica_of(master: int) -> int:
    info = command(master, "INFO", "replication").decode()
    return next(int(part.split("=")[1]) for line in info.splitlines()
                if line.startswith("slave") for part in line.split(",")
                if part.startswith("port="))


def _role(port: int) -> bytes:
    return b"master" if b"role:master" in command(port, "INFO", "replication") else b"slave"


def _unreplicated_push(store: L3Store, port: int, key: str, value: Any, counter: int) -> Any:
    """The push script on the master at ``port``, its effects kept from the replica."""
    keys, args = store._args(key, record(value, "host-a", counter, counter), False)
    conn = store.rc.get_redis_connection(store.rc.get_node(host="127.0.0.1", port=port))
    return conn.eval(UNREPLICATED + PUSH_LUA, len(keys), *keys, *args)


def _serving(store: L3Store, key: str) -> int | None:
    try:
        store.rc.nodes_manager.initialize()
        return int(store.rc.get_node_from_key(key).port)
    except Exception:  # (the slot map is being rebuilt)
        return None


# shards (master and replica ports) a test of this module failed over: each test takes a
# shard no earlier one touched (the old master keeps X as a replica; the module's cluster,
# a shard per test, is discarded with the module instead of healed: seconds per test)
_USED: set[int] = set()


class Scene:
    """One group's failover: its key, master and replica, the host that follows it, and
    the sequence number and stream id of X (the entry the failover loses)."""

    def __init__(self, cluster: RedisCluster, store: L3Store, seed: int, name: str,
                 value_less: bool, cluster_keys: dict[str, Any] | None = None) -> None:
        self.cluster, self.store = cluster, store
        self.pad = BIG if value_less else ""
        self.key = next(k for k in (f"fo/{name}/{seed}/{i}" for i in range(10**6))
                        if int(store.rc.get_node_from_key(feed_key(group_of(k))).port)
                        not in _USED)
        self.g = group_of(self.key)
        self.master = int(store.rc.get_node_from_key(feed_key(self.g)).port)
        self.replica = _replica_of(self.master)
        _USED.update((self.master, self.replica))
        self.h = Host(cluster, f"fo-{name}-{seed % 1000}", seed, cluster_keys)
        self.seq0 = 0
        self.x_id = b""

    def other_key(self) -> str:
        """Another key of the group."""
        return next(k for k in (f"{self.key}/{i}" for i in range(10**6))
                    if group_of(k) == self.g)

    def put(self, key: str, value: str, counter: int) -> None:
        out = self.store.push(key, record(f"{value}{self.pad}", "host-a", counter, counter))
        assert out.outcome in ("new", "newer"), out.outcome

    def holds(self, key: str, value: str, what: str) -> None:
        wait_for(lambda: self.h.kv.get(key) == f"{value}{self.pad}", 15, what)

    def ids_ahead(self) -> int:
        """Once v1 is replicated (only X is to be lost), the master's stream ids for the
        group set an hour ahead, unreplicated (``self.ahead``). Returns (and keeps as
        ``seq0``) the group's sequence number at v1."""
        store, g = self.store, self.g
        seq0 = store.feed_seqs([g])[g]
        assert seq0 is not None
        self.seq0 = seq0
        self.cluster.wait_replicated()  # (v1 is on the replica: only X is lost)
        conn = store.rc.get_redis_connection(
            store.rc.get_node(host="127.0.0.1", port=self.master))
        self.ahead = f"{int(time.time() * 1000) + AHEAD_MS}-0"
        conn.eval(UNREPLICATED + "return redis.call('XSETID', KEYS[1], ARGV[1])", 1,
                  feed_key(g), self.ahead)
        return seq0

    def read_x(self) -> None:
        """v1 (replicated), then X = v2 on the master alone at an id an hour ahead; the
        host reads both and is positioned at X."""
        h, store, g = self.h, self.store, self.g
        self.put(self.key, "v1", 1)
        self.holds(self.key, "v1", "the host to hold v1")
        seq0 = self.ids_ahead()
        ahead = self.ahead
        raw = _unreplicated_push(store, self.master, self.key, f"v2{self.pad}", 2)
        assert raw[0][0] in (b"new", b"newer"), raw  # (one reply per record of the call)
        self.x_id = store.feed(g, count=100_000)[-1].id
        assert self.x_id > ahead.encode()
        self.holds(self.key, "v2", "the host to read X (v2)")
        wait_for(lambda: h.daemon is not None and h.daemon.inb.cursors.get(g) == self.x_id
                 and h.daemon.inb.seqs.get(g) == seq0 + 1, 10, "the host to be positioned at X")

    def write_x_here(self, reader: Host) -> None:
        """v1 (replicated, written by host-a), then X = v2 put by the scene's host itself:
        its daemon's push runs unreplicated on the master (a master whose replica is
        disconnected: the push waits for none) and is acknowledged, so X is clean in the
        host's L2. ``reader``, another host, reads both and holds X too."""
        h, store, g = self.h, self.store, self.g
        self.put(self.key, "v1", 1)
        self.holds(self.key, "v1", "the host to hold v1")
        wait_for(lambda: reader.kv.get(self.key) == f"v1{self.pad}", 15, "the reader to hold v1")
        seq0 = self.ids_ahead()
        ahead = self.ahead
        d = h.daemon
        assert d is not None and isinstance(d.l3, DaemonL3)
        script = d.l3._pushes._script
        d.l3._pushes._script = d.l3.rc.register_script(UNREPLICATED + PUSH_LUA)
        try:
            accepted = d.stats.accepted
            h.kv.put(self.key, f"v2{self.pad}")
            wait_for(lambda: d.stats.accepted > accepted and d.port.dirty_count() == 0, 10,
                     "the host's push of X to be acknowledged (X clean in its L2)")
        finally:
            d.l3._pushes._script = script
        self.x_id = store.feed(g, count=100_000)[-1].id
        assert self.x_id > ahead.encode()
        wait_for(lambda: reader.kv.get(self.key) == f"v2{self.pad}", 15, "the reader to read X")
        wait_for(lambda: d.inb.seqs.get(g) == seq0 + 1, 10, "the host to read its X's entry")
        assert d.port.held_record(self.key) is not None  # (X carries the host's dot)

    def fail_over(self) -> None:
        """The replica, which never got X, takes over; asserts that X and its sequence
        number are gone from L3."""
        store, g = self.store, self.g
        assert command(self.replica, "CLUSTER", "FAILOVER").startswith(b"+OK")
        wait_for(lambda: _role(self.replica) == b"master"
                 and _serving(store, feed_key(g)) == self.replica,
                 30, "the replica to take the group's slot over")
        wait_for(lambda: _try(lambda: store.feed_seqs([g])[g]) == self.seq0, 10,
                 "the new master's counter (X's INCR lost)")
        assert store.feed(g, count=100_000)[-1].id < self.x_id  # (X is gone)

    def reissue(self, key: str, value: str, counter: int) -> None:
        """The next change of the group: it takes X's sequence number, at an id before
        the host's cursor (asserted: the interleaving is forced)."""
        self.put(key, value, counter)
        y = self.store.feed(self.g, count=100_000)[-1]
        assert y.seq == self.seq0 + 1 and y.id < self.x_id, (y, self.x_id)

    def restarted(self) -> None:
        """Stop the host's daemon (it saves its position: X), so that the failover and
        what follows happen while it is down."""
        self.h.stop()
        assert self.store.load_cursors(self.h.config.node.host_id)[0].get(self.g) == self.x_id
        self.cluster.wait_replicated()  # (the saved position survives the failover)

    def hold_checks(self) -> threading.Event:
        """Hold the running host's next check of counters at a gate (a host busy or
        slow at that moment) until the returned event is set."""
        d = self.h.daemon
        assert d is not None
        heads = d.l3.feed_heads
        gate, held = threading.Event(), threading.Event()

        def gated(*args: Any, **kwargs: Any) -> Any:
            held.set()
            gate.wait(30)
            return heads(*args, **kwargs)

        d.l3.feed_heads = gated  # type: ignore[method-assign]
        wait_for(held.is_set, 10, "the host's next check to wait at the gate")
        self.gate = gate
        return gate

    def split(self) -> str:
        """After the reissue (Y1), the new master's ids pass X's (as its clock does) and
        the next change, Y2, lands after the host's cursor with X's number + 1. Returns
        Y2's key."""
        past = b"%d-0" % (int(self.x_id.split(b"-")[0]) + 1)
        self.store.rc.execute_command("XSETID", feed_key(self.g), past)
        other = self.other_key()
        self.put(other, "w1", 1)  # Y2
        y2 = self.store.feed(self.g, count=100_000)[-1]
        assert y2.seq == self.seq0 + 2 and y2.id > self.x_id, (y2, self.x_id)
        return other

    def close(self) -> None:
        gate = getattr(self, "gate", None)
        if gate is not None:
            gate.set()
        self.h.close()


def test_a_host_restarted_past_the_failover_converges(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    """The host's daemon is down (its position at X saved) across the failover and the
    reissue: it comes back with the group's counter equal to its last sequence number and
    the reissued entry before its cursor — nothing a read after the cursor, or a counter
    compared by number, can see. (X is value-less: the host's position came from X's
    hint.)"""
    s = Scene(cluster, store, seed, "restart", value_less=True)
    try:
        s.read_x()
        assert s.h.stats.extra.get("hint_entries", 0) >= 1  # (X came by its hint)
        s.restarted()
        s.fail_over()
        s.reissue(s.key, "v3", 3)
        s.h.start()
        s.holds(s.key, "v3", "the host to converge on L3's final value (v3)")
        assert s.h.stats.extra.get("resync_rewind", 0) >= 1, s.h.stats
        assert s.h.alive, s.h.error
    finally:
        s.close()


def test_a_running_host_whose_check_follows_the_reissue_converges(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    """The host keeps running, but its next check of the group's counter comes only after
    the failover and the reissue. The reissue's hint (X and Y are inline: a plain hint)
    has it read after its cursor, which finds nothing; the counter equals its last
    number."""
    s = Scene(cluster, store, seed, "gate", value_less=False)
    try:
        s.read_x()
        gate = s.hold_checks()
        resyncs = s.h.stats.resyncs
        s.fail_over()
        s.reissue(s.key, "v3", 3)
        gate.set()
        s.holds(s.key, "v3", "the host to converge on L3's final value (v3)")
        assert s.h.stats.extra.get("resync_rewind", 0) >= 1 and s.h.stats.resyncs > resyncs
        assert s.h.alive, s.h.error
    finally:
        s.close()


@pytest.mark.parametrize("host", ["restarted", "running"])
def test_a_reissued_number_followed_by_a_readable_entry_converges(
        cluster: RedisCluster, store: L3Store, seed: int, host: str) -> None:
    """After the reissue (Y1, X's number, before the cursor) the new master's ids pass X's
    and the next change Y2 (X's number + 1) lands after the cursor: the host reads Y2,
    whose number follows its last one, and must still not miss Y1. Its daemon is down
    across all that, or running with its checks held until Y2 is in."""
    s = Scene(cluster, store, seed, f"split-{host}", value_less=False)
    try:
        s.read_x()
        if host == "restarted":
            s.restarted()
        else:
            gate = s.hold_checks()
        s.fail_over()
        s.reissue(s.key, "v3", 3)  # Y1
        s.split()  # Y2
        if host == "restarted":
            s.h.start()
        else:
            gate.set()
        wait_for(lambda: s.h.daemon is not None
                 and s.h.daemon.inb.seqs.get(s.g, 0) >= s.seq0 + 2, 10,
                 "the host to read Y2 (or resync past it)")
        s.holds(s.key, "v3", "the host to converge on L3's final value (v3)")
        assert s.h.stats.extra.get("resync_rewind", 0) >= 1, s.h.stats
        assert s.h.alive, s.h.error
    finally:
        s.close()


def _try(fn: Any) -> Any:
    try:
        return fn()
    except Exception:
        return None


def test_an_acknowledged_write_lost_by_a_failover_is_pushed_again(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    """X was acknowledged with no replica holding it (``cluster.wait_replicas`` 0, or a
    master whose replicas were all disconnected: a push then waits for none), and the
    failover lost it; nothing is written afterwards. The writer host resyncs the group
    (its counter went back), finds L3's record (v1) older than the X it holds, and
    pushes X again: L3, a new reader, the writer and another host that held X all end
    on X. (Without the re-push every host holding X kept it while L3 stayed on v1.)"""
    s = Scene(cluster, store, seed, "acked", value_less=False)
    reader = Host(cluster, f"fo-acked-reader-{seed % 1000}", seed + 1)
    try:
        s.write_x_here(reader)
        # the writer's polls held until the loss is asserted: running, it saw the rewind
        # and re-pushed X some 40 ms after the new master served the group (measured),
        # a margin a loaded machine loses (then the counter never read v1's, nor L3 v1)
        poll = _hold_polls(s.h)
        s.fail_over()
        assert store.get(s.key).decode_value(s.key) == "v1"  # (X is gone from L3)
        _resume_polls(s.h, poll)
        wait_for(lambda: s.h.stats.extra.get("resync_rewind", 0) >= 1, 10,
                 "the host to see the rewind")
        wait_for(lambda: s.h.stats.extra.get("repushed", 0) >= 1, 10, "the host to re-push X")
        wait_for(lambda: _try(lambda: store.get(s.key).decode_value(s.key)) == "v2", 10,
                 "L3 to hold X again")
        assert s.h.kv.get(s.key) == "v2" and reader.kv.get(s.key) == "v2"
        late = Host(cluster, f"fo-acked-late-{seed % 1000}", seed + 2)
        try:
            assert late.kv.get(s.key) == "v2"  # (a new reader, from L3)
        finally:
            late.close()
        assert s.h.alive and reader.alive, (s.h.error, reader.error)
    finally:
        reader.close()
        s.close()


def test_a_lost_write_deleted_since_is_not_pushed_back(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    """As above, but between the failover and the writer's resync (its checks held at a
    gate) another host, which had read X, deletes the key: its tombstone covers X and
    is stored over v1 (taking X's sequence number). The writer's resync finds L3's
    tombstone newer than its X: it takes the delete and pushes nothing; the key stays
    deleted everywhere."""
    s = Scene(cluster, store, seed, "deleted", value_less=False)
    reader = Host(cluster, f"fo-deleted-reader-{seed % 1000}", seed + 1)
    try:
        s.write_x_here(reader)
        d = s.h.daemon
        assert d is not None
        x = d.port.held_record(s.key)
        assert x is not None
        gate = s.hold_checks()
        s.fail_over()
        vector = dict(x.vector)
        vector["host-b"] = 1
        tomb = L3Record(x.hlc + 1, True, 0, b"", b"", tuple(sorted(vector.items())),
                        ("host-b", 1))
        out = store.push(s.key, tomb)
        assert out.outcome == "newer", out.outcome  # (over v1: X is gone)
        gate.set()
        # (the hint check may see the loss first: X's hinted entry is not in the stream)
        wait_for(lambda: s.h.stats.extra.get("resync_rewind", 0)
                 + s.h.stats.extra.get("resync_false_hint", 0) >= 1, 10,
                 "the host to see the rewind")
        wait_for(lambda: s.h.kv.get(s.key) is None and not d.inb.pending, 10,
                 "the host to take the delete, its resync done")
        wait_for(lambda: reader.kv.get(s.key) is None, 10, "the reader to take the delete")
        assert s.h.stats.extra.get("repushed", 0) == 0, s.h.stats
        rec = store.get(s.key)
        assert rec is not None and rec.tombstone, rec  # (not resurrected)
        # and were X sent again anyway (a host that had not yet read the delete), the
        # push script's vector compare refuses it: the delete covers it
        assert store.push(s.key, x).outcome == "older"
        assert store.get(s.key) == rec
        assert s.h.alive and reader.alive, (s.h.error, reader.error)
    finally:
        reader.close()
        s.close()


def _unreplicated_write(h: Host, write: Any) -> None:
    """``write()`` on host ``h``, its daemon's push run unreplicated on the master (a
    master whose replica is disconnected: the push waits for none) and acknowledged."""
    d = h.daemon
    assert d is not None and isinstance(d.l3, DaemonL3)
    script = d.l3._pushes._script
    d.l3._pushes._script = d.l3.rc.register_script(UNREPLICATED + PUSH_LUA)
    try:
        accepted = d.stats.accepted
        write()
        wait_for(lambda: d.stats.accepted > accepted and d.port.dirty_count() == 0, 10,
                 "the host's push to be acknowledged (clean in its L2)")
    finally:
        d.l3._pushes._script = script


def test_a_lost_delete_of_a_lost_key_is_not_undone_by_the_writers_repush(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    """A key created by host A (X, acknowledged), read and deleted by host B (its
    tombstone acknowledged too), and both pushes lost by the failover: L3 has no record
    of the key. B's resync (its feed went back) finds no record in L3 and holds only its
    tombstone; A's (its daemon down meanwhile, restarted) re-pushes X, which L3, having
    nothing, stores. Unless B's tombstone goes back too, the delete B was told is
    durable is undone, and B (whose tombstone is newer than X) disagrees with L3 and
    every other host forever."""
    s = Scene(cluster, store, seed, "lostdel", value_less=False)
    b = Host(cluster, f"fo-lostdel-b-{seed % 1000}", seed + 1)
    try:
        g = s.g
        s.put(s.other_key(), "w", 1)  # (a replicated entry: the stream outlives the loss)
        seq0 = store.feed_seqs([g])[g]
        assert seq0 is not None
        s.seq0 = seq0
        cluster.wait_replicated()
        _unreplicated_write(s.h, lambda: s.h.kv.put(s.key, "x"))
        wait_for(lambda: b.kv.get(s.key) == "x", 15, "B to read X")
        d = s.h.daemon
        assert d is not None
        wait_for(lambda: d.inb.seqs.get(g) == seq0 + 1, 10, "A to read its X's entry")
        s.h.stop()  # (A's L2 keeps X, clean; its position at X is saved)
        _unreplicated_write(b, lambda: b.kv.delete(s.key))
        db = b.daemon
        assert db is not None
        wait_for(lambda: db.inb.seqs.get(g) == seq0 + 2, 10, "B to read its delete's entry")
        s.x_id = store.feed(g, count=100_000)[-1].id
        poll = _hold_polls(b)  # (B's re-push of its tombstone waits for the fault's check)
        s.fail_over()
        assert store.get(s.key) is None  # (X and the delete: both gone)
        _resume_polls(b, poll)
        wait_for(lambda: db.stats.extra.get("resync_rewind", 0) >= 1 and not db.inb.pending,
                 15, "B to see the rewind and resync")
        s.h.start()
        wait_for(lambda: s.h.stats.extra.get("resync_rewind", 0) >= 1, 15,
                 "A to see the rewind")
        a = s.h.daemon
        assert a is not None
        wait_for(lambda: not a.inb.pending and not a.out.staged and not db.out.staged, 15,
                 "both resyncs and re-pushes answered")
        rec = _try(lambda: store.get(s.key))
        assert rec is None or rec.tombstone, rec  # (the delete stands in L3)
        wait_for(lambda: s.h.kv.get(s.key) is None, 10, "A to take the delete")
        assert b.kv.get(s.key) is None
        assert db.stats.extra.get("repushed", 0) >= 1, db.stats  # (B's tombstone went back)
        assert s.h.alive and b.alive, (s.h.error, b.error)
    finally:
        b.close()
        s.close()  # (its host's daemon and agent: left open, they counted errors into later tests)


# ------------------------------------------------------------------ pushed short, lost unread
#
# cluster.wait_replicas 1, but the group's master has its replica disconnected (the
# replica's masterauth is wrong, so it cannot reconnect: ROLE lists none): a push waits
# for the replicas connected, none (Replication.replicas_to_wait), and is acknowledged with 0 of the
# 1 asked. The writer holds such a record unconfirmed (dirty in L2, its entry's number
# remembered) until a WAIT there reaches 1, or a rewind shows it lost.

SHORT = {"wait_replicas": 1, "wait_timeout": "100ms"}


def _connected_replicas(port: int) -> int:
    info = command(port, "INFO", "replication").decode()
    return next(int(line.split(":")[1]) for line in info.splitlines()
                if line.startswith("connected_slaves:"))


def _cut_replica(s: Scene) -> None:
    """Disconnect the group's replica from its master, for good (until _mend_replica)."""
    assert command(s.replica, "CONFIG", "SET", "masterauth", "bogus").startswith(b"+OK")
    command(s.master, "CLIENT", "KILL", "TYPE", "replica")
    wait_for(lambda: _connected_replicas(s.master) == 0, 10, "the replica to be cut off")


def _mend_replica(port: int) -> None:
    command(port, "CONFIG", "SET", "masterauth", '""')


def _hold_polls(h: Host) -> float:
    """The host's feed polls stop (a host busy elsewhere): it reads and checks nothing
    until _resume_polls. Returns the poll interval to restore."""
    d = h.daemon
    assert d is not None
    poll, d.inb.poll = d.inb.poll, float("inf")
    return poll


def _resume_polls(h: Host, poll: float) -> None:
    assert h.daemon is not None
    h.daemon.inb.poll = poll


def _put_short(s: Scene) -> None:
    """X = v2, put on the scene's host with the group's replica cut off: acknowledged
    with 0 replicas of the 1 asked, and held unconfirmed (dirty, not evictable)."""
    d = s.h.daemon
    assert d is not None
    held = d.stats.extra.get("unconfirmed_held", 0)
    s.h.kv.put(s.key, f"v2{s.pad}")
    wait_for(lambda: d.stats.extra.get("unconfirmed_held", 0) > held, 10,
             "the host's push of X to be acknowledged short of its replica")
    assert _try(lambda: store_value(s.store, s.key)) == "v2"  # (the master has X)
    assert d.stats.extra["unconfirmed"] == 1 and d.port.dirty_count() == 1, d.stats
    x = d.out.unconfirmed.by_key[s.key]
    assert x.seq == s.seq0 + 1 and x.group == s.g and x.node.endswith(f":{s.master}"), x


def store_value(store: L3Store, key: str) -> Any:
    rec = store.get(key)
    return None if rec is None else rec.decode_value(key)


def test_an_acknowledged_write_lost_before_its_entry_was_read_is_pushed_again(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    """X, the host's write acknowledged with none of the replicas cluster.wait_replicas
    asked (its master had none connected), is lost by a failover (the cut-off replica
    forced to take over) before any host read X's feed entry: every host's position is
    v1's, which the failover kept — the group's counter equals each host's last number
    and the stream ends at its cursor. The writer remembered X's entry number, so the
    counter below it is a rewind: it resyncs and pushes X again. L3, the writer and
    another host (its reads held too) end on X."""
    s = Scene(cluster, store, seed, "unread", value_less=False, cluster_keys=SHORT)
    reader = Host(cluster, f"fo-unread-reader-{seed % 1000}", seed + 1)
    try:
        d = s.h.daemon
        assert d is not None
        s.put(s.key, "v1", 1)
        s.holds(s.key, "v1", "the host to hold v1")
        wait_for(lambda: reader.kv.get(s.key) == "v1", 15, "the reader to hold v1")
        seq0 = store.feed_seqs([s.g])[s.g]
        assert seq0 is not None
        s.seq0 = seq0
        wait_for(lambda: d.inb.seqs.get(s.g) == seq0, 10, "the host to read v1's entry")
        cluster.wait_replicated()  # (v1 is on the replica: only X is lost)
        polls = [(h, _hold_polls(h)) for h in (s.h, reader)]
        _cut_replica(s)
        _put_short(s)
        assert command(s.replica, "CLUSTER", "FAILOVER", "FORCE").startswith(b"+OK")
        wait_for(lambda: _role(s.replica) == b"master"
                 and _serving(store, feed_key(s.g)) == s.replica,
                 30, "the cut-off replica to take the group's slot over")
        _mend_replica(s.replica)
        wait_for(lambda: _try(lambda: store.feed_seqs([s.g])[s.g]) == seq0
                 and _try(lambda: store_value(store, s.key)) == "v1", 10,
                 "the new master without X (its counter v1's)")
        # nobody read X: the host's position is v1's, which the new master holds
        assert d.inb.seqs.get(s.g) == seq0 and reader.daemon is not None
        assert reader.daemon.inb.seqs.get(s.g) == seq0
        for h, poll in polls:
            _resume_polls(h, poll)
        wait_for(lambda: s.h.stats.extra.get("resync_rewind", 0) >= 1, 15,
                 "the writer to see the rewind (the counter below X's number)")
        wait_for(lambda: s.h.stats.extra.get("repushed", 0) >= 1, 10,
                 "the writer to push X again")
        wait_for(lambda: _try(lambda: store_value(store, s.key)) == "v2", 10,
                 "L3 to hold X again")
        assert s.h.kv.get(s.key) == "v2"
        wait_for(lambda: reader.kv.get(s.key) == "v2", 15, "the reader to take X")
        # the re-push is held in turn until its new master's replica (the old master,
        # resynced from it) acknowledges it: then X is clean (evictable) again
        wait_for(lambda: s.h.stats.extra.get("unconfirmed") == 0
                 and d.port.dirty_count() == 0, 15, "the re-pushed X to be confirmed")
        assert s.h.alive and reader.alive, (s.h.error, reader.error)
    finally:
        _mend_replica(s.replica)
        reader.close()
        s.close()


def test_a_short_push_is_confirmed_once_the_replica_is_back(
        cluster: RedisCluster, store: L3Store, seed: int) -> None:
    """X acknowledged short of its replica is held (dirty: never evicted; the delivered
    cursor held back) until the replica is back: the host's probe's WAIT then reaches
    cluster.wait_replicas, and what is held is delivered (clean) with nothing pushed
    again. A push acknowledged by the full count is never held. The bound
    (outbound_max 8: 2 held at most): two more short pushes release X, the oldest —
    delivered (clean) at once, its loss no longer watched for."""
    s = Scene(cluster, store, seed, "confirm", value_less=False,
              cluster_keys={**SHORT, "outbound_max": 8})
    try:
        d = s.h.daemon
        assert d is not None
        s.put(s.key, "v1", 1)
        s.holds(s.key, "v1", "the host to hold v1")
        seq0 = store.feed_seqs([s.g])[s.g]
        assert seq0 is not None
        s.seq0 = seq0
        other = s.other_key()  # (the same group and master)
        s.h.kv.put(other, "full")  # the replica connected: acknowledged by it
        wait_for(lambda: d.port.dirty_count() == 0 and d.stats.accepted >= 1, 10,
                 "the full push to be delivered")
        assert d.stats.extra.get("unconfirmed_held", 0) == 0 and not d.out.unconfirmed
        cluster.wait_replicated()
        seq0 = store.feed_seqs([s.g])[s.g]
        assert seq0 is not None
        s.seq0 = seq0
        _cut_replica(s)
        _put_short(s)
        delivered = d.out.delivered()
        assert delivered <= d.out.unconfirmed.by_key[s.key].since < d.out.cursor
        assert d.backlog() == 0  # (L3 has it: not a write waiting to be sent)
        resyncs = d.stats.resyncs
        assert d.out.unconfirmed.limit == 2
        more = [k for k in (f"{s.key}/{i}" for i in range(10**6)) if group_of(k) == s.g][:2]
        for n, k in enumerate(more, start=2):
            s.h.kv.put(k, f"w{n}")
            wait_for(lambda n=n: d.stats.extra.get("unconfirmed_held", 0) >= n, 10,
                     f"short push {n} to be held")
        wait_for(lambda: d.stats.extra.get("unconfirmed_released", 0) == 1
                 and d.port.dirty_count() == 2, 10, "X, the oldest, to be released")
        assert list(d.out.unconfirmed.by_key) == more and d.stats.extra["unconfirmed"] == 2
        _mend_replica(s.replica)
        wait_for(lambda: _connected_replicas(s.master) == 1, 15, "the replica to reconnect")
        wait_for(lambda: d.stats.extra.get("unconfirmed") == 0 and d.port.dirty_count() == 0,
                 10, "X to be confirmed and delivered")
        assert d.stats.extra.get("unconfirmed_confirmed", 0) == 2, d.stats
        assert d.stats.extra.get("repushed", 0) == 0 and d.stats.resyncs == resyncs
        assert d.out.delivered() == d.out.cursor
        assert store_value(store, s.key) == "v2"
        assert s.h.alive, s.h.error
    finally:
        _mend_replica(s.replica)
        s.close()
