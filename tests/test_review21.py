"""Review 21: one hung Redis master (SIGSTOP, no failover) against the calls that
commit 00e9202 (``L3Store.down``) left waiting on it.

Each finding: a call of the node daemon's loop that still went to a master taken for
down, so that every round of the host waited a timeout on it again (the stall that
``L3Store.down`` exists to end), or that left work undone for good.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Iterator

import pytest

from kvcomm.devcluster.redis_cluster import RedisCluster
from kvcomm.errors import Unavailable
from kvcomm.node.delivery import UNREACHED
from kvcomm.tiers.l3 import L3Store, Unreached, feed_key, group_of
from tests.cluster.test_delivery import WSEQ, outbound, rec
from tests.cluster.test_hung_master import _master_port
from tests.cluster.test_hung_master import cluster as cluster  # noqa: F401 (the fixture: 3 masters, no failover)
from tests.support.daemon_harness import Host, record
from tests.support.helpers import wait_for

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed"),
]



def _split(store: L3Store, keys: list[str], victim: int) -> tuple[list[str], list[str]]:
    port = {k: _master_port(store, feed_key(group_of(k))) for k in keys}
    return [k for k in keys if port[k] == victim], [k for k in keys if port[k] != victim]


def _take_down(store: L3Store, key: str) -> None:
    """A push of ``key`` (whose master is stopped) times out: its master is now down."""
    with pytest.raises(Unreached):
        store.push(key, record("x", "h", 1, 1))
    assert store.down


def test_get_many_and_expire_index_do_not_wait_for_a_master_taken_for_down(
        cluster: RedisCluster, seed: int) -> None:
    """With a master taken for down, ``get_many`` (the daemon's refetch of skipped
    changes, its reads of value-less entries) raises Unreached at once instead of
    waiting a timeout on it — every round of a daemon with a refetch pending would —
    and ``expire_index`` (once a second in the daemon, for the groups it stored
    records with a deadline in) does the other masters' groups, names the skipped ones,
    and raises Unreached only when it reached none."""
    store = L3Store(cluster.seeds, timeout=1.0)
    try:
        keys = [f"r21/{seed}/{i}" for i in range(40)]
        victim = _master_port(store, feed_key(group_of(keys[0])))
        hung, healthy = _split(store, keys, victim)
        assert hung and healthy
        cluster.pause(victim)
        try:
            _take_down(store, hung[0])
            name = f"127.0.0.1:{victim}"
            assert name in store.down
            with pytest.raises(Unreached):  # (was: a timeout, then a plain Unavailable)
                store.get_many(hung[:1] + healthy[:1])
            assert store.get_many(healthy) == {k: None for k in healthy}
            skipped: set[int] = set()
            groups = {group_of(k) for k in keys}
            assert store.expire_index(time.time(), groups, skipped=skipped) == 0
            assert skipped == {group_of(k) for k in hung}
            with pytest.raises(Unreached):
                store.expire_index(time.time(), {group_of(k) for k in hung})
            assert name in store.down  # (none of it waited for the master: still down)
        finally:
            cluster.resume(victim)
        wait_for(lambda: not store.down, 15, "the resumed master to answer a PING")
        assert store.expire_index(time.time(), {group_of(k) for k in keys}) == 0
    finally:
        store.close()


def test_the_daemons_index_expiry_skips_a_hung_master_and_does_it_once_it_answers(
        cluster: RedisCluster, seed: int, caplog: pytest.LogCaptureFixture) -> None:
    """A host stored a key with a TTL in a group of the master then stopped: its
    daemon's once-a-second expiry of the key index used to go to that master every
    time (a timeout each second: the whole host's rounds held, a warning each time).
    Now the group is skipped while the master is down (counted ``unreached_index``,
    nothing logged) and kept: once the master answers, the expired key leaves the
    index."""
    a = Host(cluster, f"r21-a-{seed % 1000}", seed)
    try:
        da = a.daemon
        assert da is not None and isinstance(da.l3, L3Store)
        store = da.l3
        keys = [f"r21t/{seed}/{i}" for i in range(40)]
        victim = _master_port(store, feed_key(group_of(keys[0])))
        hung, healthy = _split(store, keys, victim)
        assert hung and healthy
        # the expiry held until the master is taken for down: a push answered late (a
        # loaded machine) or a test thread slow to SIGSTOP it let the 1 s deadline pass
        # first, and the expiry then did the group while it answered (expired_unindexed
        # moved, the group left ttl_groups) or met the stopped master before any push
        # (its timeout logged). (Written here while ttl_groups is empty: the loop then
        # never writes it.)
        assert not da.ttl_groups
        da._expire_index_at = float("inf")
        a.kv.put(hung[0], "short", ttl=1.0)
        wait_for(lambda: group_of(hung[0]) in da.ttl_groups, 10, "the TTL key to be pushed")
        before = da.stats.expired_unindexed
        caplog.set_level(logging.WARNING, logger="kvcomm")
        cluster.pause(victim)
        try:
            a.kv.put(hung[1], "v")  # (its push times out: the master is taken for down)
            wait_for(lambda: f"127.0.0.1:{victim}" in store.down, 20, "the master taken for down")
            da._expire_index_at = 0.0  # (its once-a-second expiry, from now on)
            wait_for(lambda: da.stats.extra.get("unreached_index", 0) > 0, 20,
                     "the expiry to skip the hung master's group")
            assert group_of(hung[0]) in da.ttl_groups  # (kept: done once it answers)
            assert da.stats.expired_unindexed == before
            assert not [r for r in caplog.records
                        if "dropping expired keys" in r.getMessage()], "waited on the hung master"
        finally:
            cluster.resume(victim)
        wait_for(lambda: da.stats.expired_unindexed > before, 20,
                 "the expired key to leave the index once the master answers")
        assert a.alive, a.error
    finally:
        a.close()


def test_writes_held_for_a_hung_master_are_not_resent_every_round(
        cluster: RedisCluster, seed: int) -> None:
    """A backlog of writes for the hung master used to be staged again after every
    push (the items Unreached), and every UNREACHED_RETRY (50 ms) pushed again to find
    it still down: thousands of records re-staged and re-windowed per second for as
    long as it hung (measured: 6,000 keys, ~39,000 re-stagings a second, 0.84 of a
    core, and every write of the other masters queued behind them: 0.2-0.3 s to reach
    another host instead of ~20 ms). Now they are parked (staged, held dirty, in no
    window) until a master taken for down answers again: each is answered Unreached
    about once while the master hangs, the other masters' writes still flow, and the
    parked ones reach L3 once it answers."""
    a = Host(cluster, f"r21-pa-{seed % 1000}", seed)
    b = Host(cluster, f"r21-pb-{seed % 1000}", seed + 1)
    try:
        da = a.daemon
        assert da is not None and isinstance(da.l3, L3Store)
        store = da.l3
        keys = [f"r21p/{seed}/{i}" for i in range(900)]
        victim = _master_port(store, feed_key(group_of(keys[0])))
        hung, healthy = _split(store, keys, victim)
        assert len(hung) > 100 and len(healthy) > 10
        # (a first write before the hang: the host's write mark is saved — with its own
        # keys on the hung master, a new host's first push would wait for it: see the
        # review's report)
        a.kv.put(healthy[-1], "warm")
        wait_for(lambda: b.kv.get(healthy[-1]) == "warm", 20, "B to see A's first write")
        cluster.pause(victim)
        try:
            for k in hung:
                a.kv.put(k, "held")
            wait_for(lambda: f"127.0.0.1:{victim}" in store.down, 20, "the master taken for down")
            wait_for(lambda: da.stats.extra.get("unreached", 0) >= len(hung), 20,
                     "every held write answered Unreached once")
            for n in range(8):  # rounds of the other masters' writes, to another host
                for k in healthy[:10]:
                    a.kv.put(k, f"h{n}")
                wait_for(lambda n=n: all(b.kv.get(k) == f"h{n}" for k in healthy[:10]), 20,
                         f"B to see round {n}")
            assert f"127.0.0.1:{victim}" in store.down  # (it hung throughout)
            unreached = da.stats.extra.get("unreached", 0)
            # (twice: Outbound counts each answer, the driver each item of a push that
            # reached nothing; a re-push every 50 ms would be thousands more)
            assert unreached <= 3 * len(hung), unreached
        finally:
            cluster.resume(victim)
        wait_for(lambda: all(b.kv.get(k) == "held" for k in hung), 30,
                 "B to see the held writes once the master answers")
        assert a.alive and b.alive, (a.error, b.error)
    finally:
        a.close()
        b.close()


def test_outbound_parks_unreached_writes_until_unpark() -> None:
    """Outbound alone: a write answered Unreached stays staged (the delivered cursor
    held: it is dirty) but in no window, so no push takes it again, until ``unpark``;
    a newer write of a parked key is windowed at once (and no longer parked)."""
    out = outbound()
    out.read(1, [("a", rec("h", 1)), ("b", rec("h", 2))], 0.0)
    push = out.next_push(1.0, lambda k: False)
    assert push is not None and {i.key for i in push.items} == {"a", "b"}
    answers = out.pushed(push, [Unreached("down")] * 2, 1.0, WSEQ)
    assert [a.outcome for a in answers] == [UNREACHED] * 2
    assert not any(a.deliver for a in answers)
    assert out.parked == {"a", "b"} and out.delivered() == 0
    assert out.next_push(5.0, lambda k: False) is None  # (parked: nothing to send)
    out.read(2, [("b", rec("h", 3))], 5.0)  # a newer write of b: sent, not parked
    assert out.parked == {"a"}
    push = out.next_push(6.0, lambda k: False)
    assert push is not None and [i.key for i in push.items] == ["b"]
    out.pushed(push, [Unreached("down")], 6.0, WSEQ)
    assert out.unpark(7.0) == 2 and not out.parked
    push = out.next_push(8.0, lambda k: False)
    assert push is not None and {i.key for i in push.items} == {"a", "b"}
    assert {i.record.dot for i in push.items} == {("h", 1), ("h", 3)}
    assert out.delivered() == 0  # (still not answered)


@pytest.fixture(scope="module")
def replicated() -> Iterator[RedisCluster]:
    """3 masters with a replica each and the default (2 s) node timeout: a master
    stopped longer is failed over."""
    with RedisCluster(masters=3, replicas=1) as c:
        yield c


def test_a_master_failed_over_while_down_is_let_go_and_its_successor_used(
        replicated: RedisCluster, seed: int) -> None:
    """A master stopped past the node timeout is failed over: the pinger, which re-reads
    the slot map while one is down, must let it go (it left the map) rather than PING
    it for ever while its keys stay Unreached; the records it did not take are pushed to
    its successor. (And it rejoins as a replica after SIGCONT.)"""
    c = replicated
    store = L3Store(c.seeds, timeout=1.0)
    try:
        keys = [f"r21f/{seed}/{i}" for i in range(40)]
        victim = _master_port(store, feed_key(group_of(keys[0])))
        hung, healthy = _split(store, keys, victim)
        assert hung and healthy
        c.pause(victim)
        try:
            out = store.push_many([(k, record("v1", "h", 1, 1)) for k in keys])
            assert all(isinstance(o, Unreached) for k, o in zip(keys, out, strict=True)
                       if k in hung)
            name = f"127.0.0.1:{victim}"
            assert name in store.down
            wait_for(lambda: name not in store.down, 30,
                     "the stopped master, failed over, to be let go")
            assert _master_port(store, feed_key(group_of(hung[0]))) != victim  # (the successor)
            assert store.ups >= 1
            out = store.push_many([(k, record("v1", "h", 1, 1)) for k in keys])
            got = dict(zip(keys, out, strict=True))
            assert all(got[k].outcome == "new" for k in hung)  # (never taken before)
            assert all(got[k].outcome == "equal" for k in healthy)
        finally:
            c.resume(victim)
        c.wait_restored()
        assert all(store.get(k).decode_value(k) == "v1" for k in keys)
    finally:
        store.close()


def test_an_idle_host_stays_out_of_partition_mode_while_one_master_hangs(
        cluster: RedisCluster, seed: int) -> None:
    """An idle host's only Redis calls are its polls: the sweep's slice of group
    counters, and the groups left unanswered (``recheck``: those of the hung master),
    checked at every poll. A poll that checks only the hung master's groups reaches
    nothing (Unreached) and does not count as Redis answering; so between two sweep
    slices (``slice / feed_sweep_rate`` seconds: 2 s here) nothing did, and once that
    exceeds the lease TTL (1 s here; or many slices in a row on the hung master, with
    16384 groups) the host entered partition mode although two masters of three
    answered. Now a poll that reached nothing while some master is not taken for
    down PINGs one of those (at most every TTL / 2)."""
    a = Host(cluster, f"r21-i-{seed % 1000}", seed,
             cluster_keys={"lease_ttl": 1, "feed_sweep_rate": 128})
    try:
        da = a.daemon
        assert da is not None and isinstance(da.l3, L3Store)
        store = da.l3
        keys = [f"r21i/{seed}/{i}" for i in range(40)]
        victim = _master_port(store, feed_key(group_of(keys[0])))
        hung, _ = _split(store, keys, victim)
        wait_for(lambda: da.inb.swept >= 2 * da.inb.slice, 20, "the sweep to be running")
        assert not da.reach.entered
        cluster.pause(victim)
        try:
            a.kv.put(hung[0], "v")  # (its push times out: the master is taken for down)
            wait_for(lambda: f"127.0.0.1:{victim}" in store.down, 20, "the master taken for down")
            mine = store.down_groups(range(len(store.groups)))  # (every group of it)
            assert mine
            wait_for(lambda: bool(mine & da.inb.recheck), 30,
                     "a sweep to leave the hung master's groups unanswered (rechecked)")
            swept = da.inb.swept
            wait_for(lambda: da.inb.swept >= swept + 2 * da.inb.slice, 30,
                     "two more sweep slices (4 s) with the master down")
            # what kept it out: a poll that reached nothing probed a live master (a
            # loaded machine's polls may reach a live master for a while: wait for one)
            wait_for(lambda: da.stats.extra.get("live_master_probes", 0) > 0, 30,
                     "a poll that reached nothing to probe a live master")
            assert f"127.0.0.1:{victim}" in store.down  # (it hung throughout)
            assert not da.reach.entered, da.reach.reason
        finally:
            cluster.resume(victim)
        wait_for(lambda: a.kv.get(hung[0]) == "v" and not store.down, 20, "the master back")
        assert a.alive, a.error
    finally:
        a.close()


def test_the_pinger_survives_an_error_and_a_dead_one_is_replaced(
        cluster: RedisCluster, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pinger is the only way out of ``down``: if an unexpected error (here redis-py's
    node lookup raising once) ended its thread, ``_pinger`` stayed set to the dead
    thread, no new one was ever started, and the master's keys stayed Unreached (and
    a daemon's writes for it parked) for good, though it answered again. Now a round's
    error is logged and the pinger goes on; and a dead pinger is replaced when a
    master is next taken for down."""
    store = L3Store(cluster.seeds, timeout=1.0)
    try:
        keys = [f"r21g/{seed}/{i}" for i in range(40)]
        victim = _master_port(store, feed_key(group_of(keys[0])))
        hung, _ = _split(store, keys, victim)
        real = store.rc.get_node
        failed: list[int] = []

        def get_node(*args: object, **kwargs: object) -> object:
            if kwargs.get("node_name") and not failed:
                failed.append(1)
                raise RuntimeError("a bug in the node lookup")
            return real(*args, **kwargs)

        monkeypatch.setattr(store.rc, "get_node", get_node)
        cluster.pause(victim)
        try:
            _take_down(store, hung[0])
            wait_for(lambda: bool(failed), 10, "the pinger to hit the error")
        finally:
            cluster.resume(victim)
        wait_for(lambda: not store.down, 15, "the resumed master to be let out of down")
        assert store.push(hung[0], record("v", "h", 2, 2)).outcome == "new"
    finally:
        store.close()


@pytest.mark.parametrize("call", ["save_cursors"])
def test_the_first_own_key_write_to_a_hung_master_waits_one_timeout(
        cluster: RedisCluster, seed: int, call: str) -> None:
    """The daemon's client keeps redis-py's retries (6147892), and its own-key writes
    (cursors, hot keys, load counts, the write mark, the agents' snapshot) and ``get``
    went through the cluster client routed by key: redis-py retried each timeout three
    times, re-reading the slot map before each (measured: 11 s at a 1 s timeout, where
    a push pipeline takes one), the daemon's whole loop held meanwhile, before the
    master was taken for down: a new host's first push (its write mark) stalled past
    the lease TTL. Now they name their node (no retry): one timeout, one slot-map
    re-read by redis-py (counted here), then the master is down."""
    store = L3Store(cluster.seeds, timeout=1.0)  # (redis-py's retries, as the daemon's)
    nm = store.rc.nodes_manager
    real = nm.initialize
    reads: list[int] = []

    me = threading.get_ident()

    def initialize(*args: object, **kwargs: object) -> object:
        if threading.get_ident() == me:  # (the call's own: not the pinger's re-reads)
            reads.append(1)
        return real(*args, **kwargs)

    try:
        host = f"r21o-{seed}"
        key = f"r21o/{seed}/k"
        name = f"kvn:{{{host}}}:cursors" if call == "save_cursors" else feed_key(group_of(key))
        victim = _master_port(store, name)
        nm.initialize = initialize
        cluster.pause(victim)
        try:
            with pytest.raises(Unavailable) as got:
                if call == "save_cursors":
                    store.save_cursors(host, {0: b"1-1"}, {0: 1})
                else:
                    store.get(key)
            assert not isinstance(got.value, Unreached)  # (the call that found it hung)
            assert f"127.0.0.1:{victim}" in store.down
            assert len(reads) <= 2, f"{len(reads)} slot-map reads: retried"
            with pytest.raises(Unreached):
                store.save_cursors(host, {0: b"1-1"}, {0: 1}) if call == "save_cursors" \
                    else store.get(key)
        finally:
            cluster.resume(victim)
        wait_for(lambda: not store.down, 15, "the resumed master to answer a PING")
        if call == "save_cursors":
            store.save_cursors(host, {0: b"1-1"}, {0: 1})
            assert store.load_cursors(host) == ({0: b"1-1"}, {0: 1})
        else:
            assert store.get(key) is None
    finally:
        nm.initialize = real
        store.close()


def test_a_group_pending_resync_on_a_hung_master_does_not_fail_every_poll(
        cluster: RedisCluster, seed: int) -> None:
    """A group left pending resync (a gap or rewind found, a resync interrupted) is
    resynced first at every poll, by feed_position through the cluster client: on a
    hung master, redis-py's retries (five timeouts and more), then Unavailable, and the
    poll failed — no group read at all, every poll, for as long as it hung. Now the
    groups of a master taken for down stay pending (``unreached_resyncs``) while the
    others are resynced and the poll goes on; feed_position raises Unreached at once
    for them. The daemon is stepped by hand here (its thread stopped): deterministic."""
    a = Host(cluster, f"r21r-{seed % 1000}", seed)
    try:
        da = a.daemon
        assert da is not None and isinstance(da.l3, L3Store)
        store = da.l3
        own = _master_port(store, f"kvn:{{{a.config.node.host_id}}}:cursors")
        victim = next(p for p in cluster.master_ports() if p != own)
        keys = [f"r21r/{seed}/{i}" for i in range(40)]
        hung, healthy = _split(store, keys, victim)
        assert hung and healthy
        a.stop(close=False)  # (the loop's thread ended: steps below are the test's)
        gv, gh = group_of(hung[0]), group_of(healthy[0])
        cluster.pause(victim)
        try:
            a.kv.put(hung[0], "v")
            wait_for(lambda: (da.step(), f"127.0.0.1:{victim}" in store.down)[1], 20,
                     "the master taken for down (a push timed out)")
            with pytest.raises(Unreached):
                store.feed_position(gv)
            errors = da.stats.l3_errors
            da.inb.begin_resync({gv, gh}, missed=False)
            da.inb.last_poll = float("-inf")  # (a poll now)
            da.step()
            assert da.stats.l3_errors == errors  # (the poll did not fail)
            assert gv in da.inb.pending and gh not in da.inb.pending
            assert da.stats.extra.get("unreached_resyncs", 0) > 0
        finally:
            cluster.resume(victim)
        wait_for(lambda: (da.step(), gv not in da.inb.pending)[1], 20,
                 "the pending group resynced once its master answers")
    finally:
        a.stop_event.set()
        a.close()


def test_hint_subscriptions_skip_a_master_taken_for_down(
        cluster: RedisCluster, seed: int) -> None:
    """Hints.poll subscribes the groups not yet subscribed (all at the first call; those
    of a broken subscription later), one SSUBSCRIBE each: on a hung master each group
    waited a connection timeout with redis-py's retries (seconds each, hundreds of
    groups: the daemon's loop held for minutes; test_review21's idle-host test hung on
    it). Now a master taken for down is not subscribed at (its groups are reported
    lost: their counters are checked, and they are subscribed once it answers), and
    after one failure the node's other groups wait for the next try."""
    store = L3Store(cluster.seeds, timeout=0.5, groups=16)
    try:
        keys = [f"r21h/{seed}/{i}" for i in range(40)]
        victim = _master_port(store, feed_key(group_of(keys[0], 16), 16))
        name = f"127.0.0.1:{victim}"
        mine = {g for g in range(16) if _master_port(store, feed_key(g, 16)) == victim}
        assert mine and len(mine) < 16
        cluster.pause(victim)
        try:
            with pytest.raises(Unreached):
                store.push(next(k for k in keys if group_of(k, 16) in mine), record("x", "h", 1, 1))
            assert name in store.down
            _, lost = store.hints()  # (the first call: every group subscribed)
            assert mine <= lost
            assert store._hints is not None and name not in store._hints.subs
            assert store._hints.stats["subscribed"] == 16 - len(mine)
        finally:
            cluster.resume(victim)
        wait_for(lambda: not store.down, 15, "the resumed master to answer a PING")
        # (every group where it is subscribed: a count of subscriptions would also count
        # those made again after a slot-map refresh broke one, which the pinger's may do)
        wait_for(lambda: (store.hints(), store._hints is not None
                          and len(store._hints.where) == 16 and not store._hints.unrouted)[1],
                 15, "its groups subscribed once it answers")
    finally:
        store.close()
