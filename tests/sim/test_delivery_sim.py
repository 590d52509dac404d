"""The node daemon (the real driver and its delivery machines) on several hosts over
in-memory fakes of L2 and L3, under seeded scripts of writes and faults: L3 down,
one master taken for down (its groups' calls answered Unreached: the writes of its keys
parked, its groups' reads put off, until it answers), writes no replica acknowledged,
failovers that lose them (the feed goes back), trimmed streams (gaps), daemons crashed
at any point or paused until the local feed overflows,
evictions, resolvers, hints lost (silently: only the sweep finds the change; or with
notice: the group's counter is checked at once). No Redis, no shared memory; the clock
is the script's.

After the faults heal, every host must converge on L3 and nothing written may be lost:
every write's dot is covered by the key's final record in L3, nothing stays dirty, and
every host that holds a key holds L3's version of it.

A failure prints its seed; ``DELIVERY_SEED=<seed>`` replays that one run exactly,
``DELIVERY_SEEDS=<n>`` runs more.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import pytest

import kvcomm
from kvcomm.core.versions import covers
from kvcomm.node.daemon import Daemon
from kvcomm.node.delivery import Answer
from kvcomm.node.pull import REREAD
from tests.support import ROOT
from tests.support.delivery_fakes import GROUPS, FakeKeys, FakeL2, FakeL3, Value, group_of

HOSTS = ("h1", "h2", "h3")
KEYS = [f"k/{i}" for i in range(10)] + [f"r/{i}" for i in range(3)]  # r/: a resolver's


def config(host: str, unread_changes: int = 0) -> kvcomm.Config:
    return kvcomm.Config.from_mapping({
        "node": {"host_id": host, "namespace": f"sim-{host}"},
        "cache": {"l2_sync_interval": "10ms", "max_batch_ops": 4},
        "cluster": {"redis": ["127.0.0.1:1"], "feed_poll": "10ms", "groups": GROUPS,
                    "unread_changes": unread_changes},
    })


def larger(key: str, values: list[Value]) -> Value:
    return max(v for v in values if v is not None)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


@dataclass
class Host:
    name: str
    l2: FakeL2
    keys: FakeKeys = field(default_factory=FakeKeys)
    daemon: Daemon | None = None
    paused_until: float = 0.0
    stats: dict[str, int] = field(default_factory=dict)  # of daemons gone (crashed, stopped)


# A daemon started while a master is down puts off the resync of that master's groups
# (a new host's, or one whose cursors were not saved). The deferred resync re-read the
# live keys L2 holds but not its tombstones, and took the group's position as it was
# then: a change another host made meanwhile to a key this host holds deleted was never
# read (seed 2769318152 with PYTHONHASHSEED=0; fixed: a resync with no known reason
# re-reads the tombstones too: the test
# test_a_daemon_started_while_a_master_hangs_reads_what_changed_under_its_tombstones).
# (It was off: with it on, one seed in ~1,500 lost a write, seed 10389: h2's delete of
# k/0, merged into L3 but answered not durable; the merge, fetched for its feed entry,
# made the write clean; the daemon was killed, a failover lost the merge, and the key was
# dropped unread. Fixed: test_a_record_read_over_a_write_not_answered_durable_keeps_it_dirty.)
START_WHILE_HUNG = True
# Writes stored on fewer replicas than cluster.wait_replicas asks (FakeL3.short_p: held
# dirty until a probe confirms them, sent again after a failover changed their master's
# history). (With 0.15, one seed in 250-500 lost a write, seed 5422 with PYTHONHASHSEED=0,
# for two reasons. The daemon's: a record read from L3 that covered a dirty write of the
# host made it clean though no push of it was answered durable — a merge answered short,
# or not durable and read back — so that, after a failover lost the merge, the key could
# leave L2 unsent: test_a_merge_stored_short_keeps_the_write_dirty_until_confirmed. The
# fake's: it drew "short" for a push that stored nothing, answered it durable and not
# short, yet kept its group's earlier write undurable:
# test_the_fakes_durable_answer_keeps_what_came_before.)
SHORT_P = 0.15

# feed entries: every one value-less, a mix (the sim's records are 60-80 bytes), all inline
INLINE = (0, 70, None)
UNREAD = (0, 1, 2)  # cluster.unread_changes: held keys refreshed always, or dropped unread
# (Puller.held_back_max, Puller.dropped_max): as cluster.outbound_max sets them (None:
# the defaults), or a bound of 2, crossed often (more of the sim's keys are held back at
# once: the oldest dropped, read again once delivered), with its remembered keys at most 1
# in a quarter of the seeds (the oldest then read again early, while still dirty). Set on
# the puller alone: outbound_max 2 would also release held-short writes from Unconfirmed,
# which gives up watching for their loss by design. (The recorded seeds below keep the
# defaults.)
HELD_BACK: tuple[tuple[int | None, int | None], ...] = (
    (None, None), (2, None), (None, None), (2, 1))


class Sim:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.clock = Clock()
        self.inline = INLINE[seed % len(INLINE)]
        self.unread_changes = UNREAD[seed // len(INLINE) % len(UNREAD)]
        self.held_back = HELD_BACK[seed // (len(INLINE) * len(UNREAD)) % len(HELD_BACK)]
        self.l3 = FakeL3(random.Random(self.rng.random()), durable_p=0.8, hint_loss_p=0.1,
                         feed_inline=self.inline, short_p=SHORT_P)
        self.hung_until: dict[str, float] = {}  # master taken for down → when it answers
        self.hosts = [Host(h, FakeL2(h, feed_capacity=24, resolvers={"r/": larger},
                                     clock=self.clock)) for h in HOSTS]
        self.down_until = 0.0
        self.faults: dict[str, int] = {}
        self.n = 0

    def fault(self, name: str) -> None:
        self.faults[name] = self.faults.get(name, 0) + 1

    def start(self, h: Host) -> Daemon | None:
        if h.daemon is None and self.l3.down and not START_WHILE_HUNG:
            return None  # (see START_WHILE_HUNG)
        if h.daemon is None:
            try:
                h.daemon = Daemon(config(h.name, self.unread_changes), h.l2, self.l3.view(), h.keys,  # type: ignore[arg-type]
                                  rng=random.Random(self.rng.random()), clock=self.clock,
                                  sleep=self.clock.sleep, wall=self.clock)
            except kvcomm.Unavailable:
                return None  # L3 down at start: the CLI waits and retries too
            held_back_max, dropped_max = self.held_back
            if held_back_max is not None:
                h.daemon.puller.held_back_max = held_back_max
            if dropped_max is not None:
                h.daemon.puller.dropped_max = dropped_max
        return h.daemon

    def retire(self, h: Host) -> None:
        """Forget a daemon (crashed or stopped), keeping its counts."""
        assert h.daemon is not None
        s = h.daemon.stats
        for name, n in [("resyncs", s.resyncs), ("feed_overflows", s.feed_overflows),
                        ("l3_errors", s.l3_errors), ("hinted", s.hinted), ("swept", s.swept),
                        ("lost_hints", s.lost_hints), *s.extra.items()]:
            h.stats[name] = h.stats.get(name, 0) + n
        h.daemon.l3.close()  # its hint subscription ends with it
        h.daemon = None

    def step(self, h: Host) -> None:
        d = self.start(h)
        if d is not None:
            d.step()

    def event(self) -> None:
        rng, l3, clock = self.rng, self.l3, self.clock
        clock.t += rng.uniform(0, 0.006)
        if clock.t >= self.down_until:
            l3.cut = False
        for m, until in list(self.hung_until.items()):
            if clock.t >= until:
                l3.answer(m)
                del self.hung_until[m]
        h = rng.choice(self.hosts)
        key = rng.choice(KEYS)
        r = rng.random()
        self.n += 1
        if r < 0.30:
            h.l2.put(key, f"{h.name}:{self.n}".encode())
        elif r < 0.35:
            h.l2.delete(key, l3)
        elif r < 0.45:
            h.l2.read(key, l3)
        elif r < 0.47:
            h.l2.evict(rng)
        elif r < 0.88:
            if clock.t >= h.paused_until:
                self.step(h)
        elif r < 0.895:
            l3.cut = True
            self.down_until = clock.t + rng.uniform(0.01, 0.3)
            self.fault("down")
        elif r < 0.915:
            g = rng.randrange(GROUPS)
            if l3.failover(g):
                self.fault("failover")
        elif r < 0.93:
            g = rng.randrange(GROUPS)
            if l3.streams[g]:
                l3.trim(g, rng.randrange(3))
                self.fault("trim")
        elif r < 0.95:
            if h.daemon is not None:
                self.retire(h)  # killed: nothing flushed, nothing saved
                self.fault("crash")
        elif r < 0.96:
            if h.daemon is not None:
                h.daemon.flush(timeout=0.5)
                self.retire(h)
                self.fault("stop")
        elif r < 0.97:
            m = rng.choice(l3.masters)
            l3.hang(m, clock.t)
            self.hung_until[m] = max(self.hung_until.get(m, 0.0),
                                     clock.t + rng.uniform(0.02, 0.5))
            self.fault("hang")
        else:
            h.paused_until = clock.t + rng.uniform(0.05, 0.5)
            self.fault("pause")

    def quiet(self) -> str:
        """Why the cluster has not settled yet ("" when it has)."""
        l3 = self.l3
        for h in self.hosts:
            d = h.daemon
            if d is None:
                return f"{h.name} has no daemon"
            if h.l2.dirty_keys():
                return f"{h.name} holds dirty {h.l2.dirty_keys()}"
            if d.out.staged or d.out.waiting or d.inb.pending:
                return f"{h.name}'s daemon is busy"
            if h.l2.sync_cursor != h.l2.seq:
                return f"{h.name}'s delivered cursor is behind its feed"
            for g in range(GROUPS):
                last = l3.streams[g][-1].id if l3.streams[g] else None
                if d.inb.seqs.get(g) != l3.counters[g] or (last and d.inb.cursors[g] != last):
                    return f"{h.name} has not read group {g}"
        return ""

    def heal(self) -> None:
        self.l3.cut = False
        self.down_until = 0.0
        self.l3.durable_p = 1.0
        self.l3.short_p = 0.0
        for m in self.hung_until:
            self.l3.answer(m)
        self.hung_until.clear()
        for h in self.hosts:
            h.paused_until = 0.0
        why = "not tried"
        for _ in range(3000):
            self.clock.t += 0.011
            for h in self.hosts:
                self.step(h)
            why = self.quiet()
            if not why:
                return
        raise AssertionError(f"seed {self.seed}: no convergence after healing: {why}")

    def check(self) -> None:
        l3 = self.l3
        for h in self.hosts:
            assert not h.l2.anomalies, (self.seed, h.l2.anomalies)
            assert h.l2.sync_cursor == h.l2.seq, (self.seed, h.name, "cursor behind")
            for key, dot in h.l2.writes:  # no write lost: L3's record saw every one
                held = l3.records.get(key)
                assert held is not None and covers(held.vector, dot), \
                    f"seed {self.seed}: {h.name}'s write {dot} of {key!r} is lost: L3 has {held}"
            for key, rec in h.l2.recs.items():  # and every host holds L3's version
                held = l3.records[key]
                mine = None if rec.value is None else rec.value
                theirs = None if held.tombstone else (held.tag, held.meta, held.value)
                assert (rec.vector, rec.hlc, mine) == (held.vector, held.hlc, theirs), \
                    f"seed {self.seed}: {h.name} holds {key!r} as {rec}, L3 as {held}"

    def run(self, events: int) -> None:
        for _ in range(events):
            self.event()
        self.heal()
        self.check()

    def totals(self) -> dict[str, int]:
        out = dict(self.faults)
        for h in self.hosts:
            if h.daemon is not None:
                self.retire(h)
            for name, n in h.stats.items():
                out[name] = out.get(name, 0) + n
        out["lost_in_failovers"] = self.l3.lost
        out["hints_lost_silently"] = self.l3.hints_lost["silently"]
        out["hints_lost_told"] = self.l3.hints_lost["told"]
        return out


def _seeds() -> list[int]:
    if "DELIVERY_SEED" in os.environ:
        return [int(os.environ["DELIVERY_SEED"])]
    base = random.randrange(2**32)
    return [base + i for i in range(int(os.environ.get("DELIVERY_SEEDS", "30")))]


FAULTS = ("down", "failover", "trim", "crash", "stop", "pause", "lost_in_failovers",
          "resyncs", "resync_gap", "resync_rewind", "feed_overflows", "l3_errors",
          "not_durable", "resolved", "hinted", "swept", "lost_hints",
          "hints_lost_silently", "hints_lost_told",
          "fetched", "echoes", "refills",  # (value-less entries: read, skipped, refilled)
          "hint_entries",  # (value-less entries applied from their hints, no feed read)
          "unread_dropped",  # (held keys no agent read since their last change: dropped)
          "hang", "unreached", "unparked", "unreached_sweeps",  # (a master taken for down)
          "held_back",  # (records read over a write not answered durable: merged once delivered)
          "held_back_dropped")  # (past held_back_max 2: dropped, read again once delivered)


def test_hosts_converge_and_lose_nothing_under_faults() -> None:
    totals: dict[str, int] = {}
    seeds = _seeds()
    # the rarer faults (a failover that rewinds a feed) may miss a run of 30 seeds: more
    # seeds follow, up to 4x as many, until every one happened
    extra = iter(range(seeds[-1] + 1, seeds[-1] + 1 + 3 * len(seeds)))
    for seed in seeds + ([] if "DELIVERY_SEED" in os.environ else list(extra)):
        if seed > seeds[-1] and all(totals.get(n, 0) > 0 for n in FAULTS):
            break
        sim = Sim(seed)
        print(f"seed={seed} feed_inline={sim.inline} unread_changes={sim.unread_changes} "
              f"held_back_max, dropped_max={sim.held_back}")
        sim.run(600)
        for name, n in sim.totals().items():
            totals[name] = totals.get(name, 0) + n
    print(totals)
    if "DELIVERY_SEED" in os.environ:
        return
    # every fault this test claims to survive happened, and was noticed
    for name in FAULTS:
        assert totals.get(name, 0) > 0, f"{name} never happened: {totals}"


def _one_host(l3: FakeL3) -> tuple[Daemon, FakeL2, Clock]:
    clock = Clock()
    l2 = FakeL2("h1", clock=clock)
    d = Daemon(config("h1"), l2, l3.view(), FakeKeys(),  # type: ignore[arg-type]
               rng=random.Random(2), clock=clock, sleep=clock.sleep, wall=clock)
    return d, l2, clock


def _successor(l2: FakeL2, l3: FakeL3, clock: Clock) -> Daemon:
    """A new daemon of h1 over the L2 of one killed (its staged pushes gone with it)."""
    return Daemon(config("h1"), l2, l3.view(), FakeKeys(),  # type: ignore[arg-type]
                  rng=random.Random(3), clock=clock, sleep=clock.sleep, wall=clock)


def _rounds(d: Daemon, clock: Clock, n: int, dt: float = 0.02) -> None:
    for _ in range(n):
        d.step()
        clock.sleep(dt)


def test_writes_stored_short_of_their_replicas_are_held_until_a_probe_confirms_them() -> None:
    """cluster.wait_replicas over the fakes: every stored push is acknowledged by fewer
    replicas than asked; the writes stay dirty (held) until the probe of their master
    (every CONFIRM_EVERY) confirms them, then they are delivered."""
    l3 = FakeL3(random.Random(1), short_p=1.0)
    d, l2, clock = _one_host(l3)
    d.confirm_at = float("inf")  # (no probe until they are all held)
    keys = [f"k/{i}" for i in range(6)]
    for k in keys:
        l2.put(k, b"v")
    _rounds(d, clock, 5)
    assert set(l3.records) == set(keys)
    assert len(d.out.unconfirmed) == len(keys) and all(l2.recs[k].dirty for k in keys)
    assert d.stats.extra.get("unconfirmed_held") == len(keys)
    d.confirm_at = 0.0
    _rounds(d, clock, 5)
    assert l3.calls.get("confirm_replicated", 0) >= 1
    assert not d.out.unconfirmed and not any(l2.recs[k].dirty for k in keys)
    assert d.stats.extra.get("unconfirmed_confirmed") == len(keys)


def test_writes_held_short_are_sent_again_when_a_failover_lost_them() -> None:
    """A failover before the probe loses the writes stored short (records reverted, the
    master's replication history changed): the probe finds the history left, the groups
    are resynced as after a rewind, and the held writes are sent again."""
    l3 = FakeL3(random.Random(1), short_p=1.0)
    d, l2, clock = _one_host(l3)
    d.confirm_at = float("inf")
    keys = [f"k/{i}" for i in range(6)]
    for k in keys:
        l2.put(k, b"v")
    _rounds(d, clock, 5)
    assert len(d.out.unconfirmed) == len(keys)
    for g in range(GROUPS):
        l3.failover(g)
    assert not l3.records  # (every write was short: all lost)
    l3.short_p = 0.0
    d.confirm_at = 0.0
    _rounds(d, clock, 80)
    assert set(l3.records) == set(keys) and not any(l2.recs[k].dirty for k in keys)
    assert not d.out.unconfirmed and d.stats.extra.get("repushed", 0) >= len(keys)
    assert d.stats.extra.get("unconfirmed_rewound", 0) >= 1, d.stats.extra  # (the probe saw it)


def test_a_master_taken_for_down_parks_its_writes_and_the_others_go_on() -> None:
    """Per-master outage over the fakes: the writes of the keys of a master taken for
    down are parked (Unreached), the other masters' are delivered; once it answers
    (``ups``) the parked writes are sent, and its groups' feeds read."""
    l3 = FakeL3(random.Random(1))
    d, l2, clock = _one_host(l3)
    own = l3.master_of(group_of("kvn:{h1}"))  # (the host's own keys: cursors, write mark)
    hung = next(m for m in l3.masters if m != own)
    keys = [f"k/{i}" for i in range(30)]
    l3.hang(hung)
    for k in keys:
        l2.put(k, b"v")
    _rounds(d, clock, 10)
    on_hung = {k for k in keys if l3.master_of(group_of(k)) == hung}
    assert on_hung and on_hung != set(keys)
    assert set(l3.records) == set(keys) - on_hung
    assert all(l2.recs[k].dirty for k in on_hung)
    assert d.stats.extra.get("unreached", 0) >= 1 and d.masters_down() == [hung]
    l3.answer(hung)
    _rounds(d, clock, 10)
    assert set(l3.records) == set(keys) and not any(r.dirty for r in l2.recs.values())
    assert d.stats.extra.get("unparked", 0) >= len(on_hung) and not d.masters_down()


def test_the_feed_lag_metric_reads_the_pull_parts_counters() -> None:
    """``kvcomm_feed_lag_events{feed="cluster"}`` over a real Daemon (the fakes): the
    entries of a group's feed past what the daemon read. (Found by a fresh reader after
    the daemon's split: the metric read a daemon attribute that had moved into the pull
    part, and said 0 whatever the lag.)"""
    from kvcomm.metrics.node import cluster_lag

    d, _l2, clock = _one_host(FakeL3(random.Random(1)))
    _rounds(d, clock, 50)
    assert cluster_lag(d) == 0
    d.puller.feed_counters[0] = (d.inb.seqs.get(0) or 0) + 7  # 7 entries not read yet
    assert cluster_lag(d) == 7


def test_a_daemon_started_while_a_master_hangs_reads_what_changed_under_its_tombstones(
        ) -> None:
    """A daemon that starts while a master hangs resyncs that master's groups once it
    answers; a key this host holds deleted, which another host wrote meanwhile, is read
    then (before, the deferred resync skipped L2's tombstones and the write was never
    read: h3 kept its tombstone of r/1 under h2's later write). The recorded seed, in a
    fresh interpreter: the run depends on PYTHONHASHSEED (set ordering)."""
    code = ("import tests.sim.test_delivery_sim as m; m.START_WHILE_HUNG = True; "
            "m.SHORT_P = 0.0; m.Sim(2769318152).run(600)")
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_recorded_seeds_of_lost_writes_lose_nothing() -> None:
    """The seeds that found the write losses of the scripted tests below (5422: SHORT_P;
    10389: START_WHILE_HUNG), and 213642 (both on: a group whose hints were told lost,
    whose counter then matched the entries hints brought, was not read, and a write L3
    reissued under a number the host had applied before a failover was never read:
    Inbound.to_read now reads a group waiting to be verified), replayed in a fresh
    interpreter with PYTHONHASHSEED=0 (the runs depend on set ordering)."""
    code = ("import tests.sim.test_delivery_sim as m; m.START_WHILE_HUNG = False; "
            "m.Sim(5422).run(600); m.START_WHILE_HUNG = True; m.SHORT_P = 0.0; "
            "m.Sim(10389).run(600); m.SHORT_P = 0.15; m.Sim(213642).run(600)")
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def _theirs(l3: FakeL3, key: str) -> None:
    """Another host's write of ``key``, stored in L3 in full (durable, not short)."""
    other = FakeL2("h3")
    other.put(key, b"theirs")
    record = other.dirty_record(key)
    assert record is not None
    durable_p, short_p = l3.durable_p, l3.short_p
    l3.durable_p, l3.short_p = 1.0, 0.0
    assert l3.push(key, record).outcome == "new"
    l3.durable_p, l3.short_p = durable_p, short_p


def _holds_l3s(l2: FakeL2, l3: FakeL3, key: str) -> bool:
    rec, held = l2.recs[key], l3.records[key]
    return (not rec.dirty and (rec.vector, rec.hlc) == (held.vector, held.hlc)
            and rec.value == (held.tag, held.meta, held.value))


def test_a_record_read_over_a_write_not_answered_durable_keeps_it_dirty() -> None:
    """A push merged into L3 with another host's write but answered not durable (no
    replica has it): the merge read back from the feed covers the write, yet must not make
    it clean: a daemon killed then loses the push it staged again, a failover loses the
    merge, and the key, clean, could leave L2 (evicted, dropped unread) with nothing left
    to send the write again (found by the simulation: seed 10389 with START_WHILE_HUNG,
    seed 5422 with SHORT_P, PYTHONHASHSEED=0). The record is held back until the write is
    delivered; the next daemon sends it again."""
    key = "k/0"
    l3 = FakeL3(random.Random(1))
    _theirs(l3, key)
    l3.durable_p = 0.0  # (no push is answered durable)
    d, l2, clock = _one_host(l3)
    l2.put(key, b"mine")
    dot, mine = l2.writes[-1][1], l2.recs[key].value
    _rounds(d, clock, 10)
    assert covers(l3.records[key].vector, dot)  # (merged, on the master alone)
    assert l3.calls.get("feed_many", 0) >= 1 and d.stats.extra.get("not_durable", 0) >= 1
    assert l2.recs[key].dirty and l2.recs[key].value == mine
    assert key in d.puller.held_back and d.stats.extra.get("held_back") == 1
    d.l3.close()  # killed: its staged push gone with it
    assert l3.failover(group_of(key)) >= 1 and not covers(l3.records[key].vector, dot)
    assert not l2.forget(key)  # (dirty: it stays)
    l3.durable_p = 1.0
    _rounds(_successor(l2, l3, clock), clock, 20)
    assert covers(l3.records[key].vector, dot) and _holds_l3s(l2, l3, key)


def test_a_merge_stored_short_keeps_the_write_dirty_until_confirmed() -> None:
    """A push merged into L3 with another host's write on fewer replicas than asked
    (short): the merge is held back, the write kept dirty (it used to be taken at once,
    the write clean: evictable before any probe, and lost with the merge in a failover).
    A probe's confirmation delivers it and merges what was held back; a failover before
    it has the held write sent again."""
    l3 = FakeL3(random.Random(1), short_p=1.0)
    lost = "k/0"
    kept = next(k for k in KEYS if l3.master_of(group_of(k)) != l3.master_of(group_of(lost)))
    for key in (lost, kept):
        _theirs(l3, key)
    d, l2, clock = _one_host(l3)
    d.confirm_at = float("inf")  # (no probe until both are held)
    dots = {}
    for key in (lost, kept):
        l2.put(key, b"mine")
        dots[key] = l2.writes[-1][1]
    _rounds(d, clock, 5)
    for key in (lost, kept):
        assert key in d.out.unconfirmed.by_key and l2.recs[key].dirty
        assert covers(d.puller.held_back[key].vector, dots[key])
    assert l3.failover(group_of(lost)) >= 1 and not covers(l3.records[lost].vector, dots[lost])
    assert not l2.forget(lost)
    l3.short_p = 0.0
    d.confirm_at = 0.0
    _rounds(d, clock, 80)
    assert d.stats.extra.get("unconfirmed_confirmed", 0) >= 1
    assert d.stats.extra.get("unconfirmed_rewound", 0) >= 1
    for key in (lost, kept):
        assert covers(l3.records[key].vector, dots[key]) and _holds_l3s(l2, l3, key)
    assert not d.puller.held_back and not d.out.unconfirmed


def test_the_fakes_durable_answer_keeps_what_came_before() -> None:
    """FakeL3: an answer that says durable and not short (a WAIT the replicas asked
    acknowledged) keeps every earlier write of its group through a failover, whether or
    not the push stored anything. (The fake drew `short` for a push that stored nothing,
    answered it durable and not short, and kept its group's earlier write undurable: a
    failover then lost a write the daemon had been told was kept, seed 5422 with SHORT_P.)"""
    key = "k/0"
    l3 = FakeL3(random.Random(1), durable_p=0.0)
    other = FakeL2("h3")
    other.put(key, b"theirs")
    record = other.dirty_record(key)
    assert record is not None
    assert not l3.push(key, record).durable  # (on the master alone)
    l3.durable_p, l3.short_p = 1.0, 1.0
    again = l3.push(key, record)
    assert again.outcome == "equal" and again.durable and not again.short
    assert l3.failover(group_of(key)) == 0 and l3.records[key] == record


def test_a_held_write_sent_again_holds_the_delivered_cursor() -> None:
    """A write held short (dirty, unconfirmed) whose group is resynced after a rewind is
    sent again; until that push is answered, the delivered cursor L2 holds stays before
    the write, so that a daemon killed meanwhile has its successor read the write again
    (it was staged again at the cursor then: the successor never read it, and the write
    stayed dirty, unsent, for good; found by the simulation with SHORT_P on, seed 373)."""
    key = "k/0"
    l3 = FakeL3(random.Random(1), short_p=1.0)
    d, l2, clock = _one_host(l3)
    d.confirm_at = float("inf")
    l2.put(key, b"mine")
    dot, at = l2.writes[-1][1], l2.seq
    _rounds(d, clock, 5)
    assert key in d.out.unconfirmed.by_key
    assert l3.failover(group_of(key)) == 1  # (lost)
    d.puller.resync({group_of(key)}, reason="rewind")  # (as the probe finds it)
    assert key in d.out.staged and d.stats.extra.get("repushed") == 1
    d.step()  # (the same instant: its window still open) the delivered cursor persisted
    assert l2.delivered_cursor < at
    d.l3.close()  # killed before the push went out
    l3.short_p = 0.0
    _rounds(_successor(l2, l3, clock), clock, 20)
    assert covers(l3.records[key].vector, dot) and _holds_l3s(l2, l3, key)


def test_a_copy_of_writes_l3_lost_is_replaced_by_l3s_record() -> None:
    """A host holds (clean) another host's write that a failover then took from L3; L3's
    next record of the key, concurrent with it, replaces the copy: a merge would be a
    record to publish with no dot of this host in it (FakeL2 reports it as an anomaly;
    Redis refuses such a record). The lost write is its writer's to send again. Found by
    the simulation with SHORT_P on (seeds 203, 310)."""
    key = "k/0"
    l3 = FakeL3(random.Random(1), durable_p=0.0)
    d, l2, clock = _one_host(l3)
    h2 = FakeL2("h2")
    h2.put(key, b"lost")
    assert not l3.push(key, h2.dirty_record(key)).durable  # type: ignore[arg-type]
    l2.read(key, l3)  # (an agent's read fills L2)
    _rounds(d, clock, 5)
    assert l3.failover(group_of(key)) == 1 and key not in l3.records
    _theirs(l3, key)
    _rounds(d, clock, 20)
    assert not l2.anomalies and _holds_l3s(l2, l3, key)
    assert d.stats.extra.get("replaced_lost") == 1


def test_a_skipped_change_l3_lost_is_not_applied_over_a_later_fill() -> None:
    """A change skipped (the key not held here) that a failover then took from L3 is not
    applied over the fill an agent made since: the fill, read from L3 after the loss, is
    concurrent with it, and L2 would hold what L3 lost. Found by the simulation with
    SHORT_P on (seed 310)."""
    key = "k/0"
    l3 = FakeL3(random.Random(1), durable_p=0.0)
    d, l2, clock = _one_host(l3)
    _rounds(d, clock, 3)
    h2 = FakeL2("h2")
    h2.put(key, b"lost")
    assert not l3.push(key, h2.dirty_record(key)).durable  # type: ignore[arg-type]
    _rounds(d, clock, 5)
    assert d.stats.skipped_remote == 1 and not l2.holds(key)
    assert l3.failover(group_of(key)) == 1
    _theirs(l3, key)
    l2.read(key, l3)  # (a fill of L3's record now)
    _rounds(d, clock, 20)
    assert d.stats.extra.get("refills_lost") == 1
    assert not l2.anomalies and _holds_l3s(l2, l3, key)


@pytest.mark.parametrize("inline", [None, 0], ids=["inline_entries", "value_less_entries"])
def test_a_late_fill_of_a_record_l3_lost_does_not_shadow_l3s_current_record(
        inline: int | None) -> None:
    """The reverse of test_a_skipped_change_l3_lost_is_not_applied_over_a_later_fill:
    here the *fill* is the record a failover took from L3, and the skipped change is L3's
    current record. An agent's L2 miss reads F (h2's write) from L3; before its fill lands
    a failover loses F and h3 writes R (durable); the daemon reads R's entry while the key
    is not held (skipped); then the fill lands. R is concurrent with the fill: the refill
    reads L3 again and applies what it holds (R), where it had dropped R and kept F, which
    L3 no longer has (found by the adversary's review; inline and value-less entries)."""
    key = "k/0"
    l3 = FakeL3(random.Random(1), durable_p=0.0, feed_inline=inline)
    d, l2, clock = _one_host(l3)
    _rounds(d, clock, 3)
    h2 = FakeL2("h2")
    h2.put(key, b"F")
    assert not l3.push(key, h2.dirty_record(key)).durable  # type: ignore[arg-type]
    fill = l3.get(key)  # the agent's read of L3 (its fill not yet in L2)
    assert fill is not None
    assert l3.failover(group_of(key)) == 1 and key not in l3.records  # F lost
    _theirs(l3, key)  # R: L3's record now, durable
    _rounds(d, clock, 5)  # R's entry read while the key is not held: skipped
    assert d.stats.skipped_remote >= 1 and not l2.holds(key)
    l2.apply_remote(key, fill)  # the late fill lands (FakeL2.read's install)
    l2.referenced.add(key)
    _rounds(d, clock, 40)
    refills_lost = d.stats.extra.get("refills_lost", 0)
    assert _holds_l3s(l2, l3, key), (
        f"h1 holds {l2.recs[key]} (refills_lost={refills_lost}), L3 holds {l3.records[key]}")


@pytest.mark.parametrize("dropped_max", [None, 1], ids=["remembered", "remembered_keys_full"])
def test_held_records_past_the_bound_are_dropped_and_read_again_once_delivered(
        dropped_max: int | None) -> None:
    """More records held back than Puller.held_back_max (2 here, as cluster.outbound_max
    2 sets it): each a merge of this host's write, answered short (kept dirty until a
    probe confirms it), with another host's write. Past the bound the oldest held record
    was merged, which made its write clean before any durable answer (the loss the
    hold-back closes); it is dropped instead, its key remembered, and read from L3 again
    once the write is delivered: no write is made clean early, and the other host's
    writes reach this host all the same. With the remembered keys full (dropped_max 1)
    the oldest is read again at the next round: held back again while its write is dirty."""
    l3 = FakeL3(random.Random(1), short_p=1.0)
    keys = [f"k/{i}" for i in range(5)]
    for key in keys:
        _theirs(l3, key)
    theirs = {key: l3.records[key].dot for key in keys}
    d, l2, clock = _one_host(l3)
    d.confirm_at = float("inf")  # (no probe: every write stays held short)
    d.puller.held_back_max = 2
    if dropped_max is not None:
        d.puller.dropped_max = dropped_max
    dots = {}
    for key in keys:
        l2.put(key, b"mine")
        dots[key] = l2.writes[-1][1]
    for _ in range(20):
        _rounds(d, clock, 1)
        for key in keys:  # no held write made clean before its push was answered
            assert l2.recs[key].dirty, (key, l2.recs[key], d.puller.held_back.keys())
        assert len(d.puller.held_back) <= 2 and len(d.puller.dropped) <= d.puller.dropped_max
    for key in keys:
        assert key in d.out.unconfirmed.by_key and covers(l3.records[key].vector, theirs[key])
    extra = d.stats.extra
    assert extra.get("held_back", 0) >= len(keys) and extra.get("held_back_dropped", 0) >= 3
    if dropped_max is not None:
        assert extra.get("held_back_early", 0) >= 1  # (read again while still dirty)
    l3.short_p = 0.0
    d.confirm_at = 0.0
    _rounds(d, clock, 40)
    assert extra.get("unconfirmed_confirmed", 0) >= 1 and not d.out.unconfirmed
    assert extra.get("held_back_reread", 0) >= 1  # (dropped keys read at their delivery)
    for key in keys:  # nothing lost: this host holds L3's merge of both writes
        assert covers(l3.records[key].vector, dots[key]) and _holds_l3s(l2, l3, key), \
            (key, l2.recs[key], l3.records[key])
        assert covers(l2.recs[key].vector, theirs[key])
    assert not d.puller.held_back and not d.puller.dropped and not d.puller.refetch
    assert not l2.anomalies


def test_a_dropped_key_delivered_while_l3_is_down_is_read_at_a_later_round() -> None:
    """A write whose held record was dropped past the bound is delivered (as a probe's
    confirmation does) while L3 cannot be read: the key is read again at a later round
    (Puller.refetch) instead, and the host then holds L3's merge of both hosts' writes."""
    l3 = FakeL3(random.Random(1), short_p=1.0)
    keys = [f"k/{i}" for i in range(3)]
    for key in keys:
        _theirs(l3, key)
    d, l2, clock = _one_host(l3)
    d.confirm_at = float("inf")
    d.puller.held_back_max = 1
    for key in keys:
        l2.put(key, b"mine")
    _rounds(d, clock, 5)
    assert len(d.puller.dropped) >= 2 and all(l2.recs[k].dirty for k in keys)
    key = next(k for k in d.puller.dropped if k not in d.puller.held_back)
    record = l2.dirty_record(key)
    assert record is not None
    l3.cut = True
    d.pusher._deliver(key, record)  # (its confirmation, L3 unreadable right after)
    l3.cut = False
    assert not l2.recs[key].dirty and d.puller.refetch.get(key) is REREAD
    assert key not in d.puller.dropped and not _holds_l3s(l2, l3, key)
    _rounds(d, clock, 2)
    assert _holds_l3s(l2, l3, key) and key not in d.puller.refetch
    l3.short_p = 0.0
    d.confirm_at = 0.0
    _rounds(d, clock, 40)
    for key in keys:
        assert _holds_l3s(l2, l3, key), (key, l2.recs[key], l3.records[key])
    assert not d.puller.held_back and not d.puller.dropped and not l2.anomalies


def test_a_delivered_write_releases_what_was_held_back_even_when_taking_the_answer_fails(
        ) -> None:
    """A push answered delivered with L3's record to take: when taking it raises (L2
    refuses it; the key is set aside), the write is delivered all the same, so what was
    held back for it is merged now (Puller.release), not left waiting for an answer that
    has come and gone; the error still reaches the caller."""
    l3 = FakeL3(random.Random(1), short_p=1.0)
    key = "k/0"
    _theirs(l3, key)
    d, l2, clock = _one_host(l3)
    d.confirm_at = float("inf")
    l2.put(key, b"mine")
    _rounds(d, clock, 5)
    assert key in d.puller.held_back and l2.recs[key].dirty
    record = l2.dirty_record(key)
    assert record is not None
    take = d.puller.held_back[key]
    released: list[str] = []
    release = d.puller.release

    def note_release(k: str) -> None:
        released.append(k)
        release(k)

    def refuse(k: str, r: Any) -> bool:
        raise kvcomm.ValueTooLarge("L2 cannot take it (the test)")

    d.puller.release = note_release  # type: ignore[method-assign]
    d.puller.apply = refuse  # type: ignore[method-assign]
    answer = Answer(key, record, "merged", True, take, "")
    with pytest.raises(kvcomm.ValueTooLarge):
        d.pusher._carry_out(answer)
    assert released == [key] and key not in d.puller.held_back
