"""The soak that ships with the package: its checker, its nemesis, and short real runs."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import pytest

from kvcomm.core.versions import Version
from kvcomm.errors import InvalidArgument
from kvcomm.faults import FAULTS, Fault, Nemesis, Observed, Op, check, fault_kinds, plan, register
from kvcomm.faults.checker import ABSENT
from kvcomm.faults.history import (
    DELETE,
    GET,
    INCR,
    INFO,
    OK,
    PUT,
    HistoryWriter,
    load_history,
    value_id,
)
from kvcomm.faults.soak import SoakOptions, SoakResult, run_soak
from tests.support.helpers import drawn_seed

# ---------------------------------------------------------------------- the checker


class H:
    """A hand-made history: ``h.put("p1", "k", "a", 1.0)`` records an operation."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.seq: dict[str, int] = {}
        self.counter: dict[str, int] = {}

    def _op(self, process: str, kind: str, key: str, value: str | None, t: float,
            outcome: str, **kw: Any) -> Op:
        self.seq[process] = self.seq.get(process, 0) + 1
        host = process.split("/")[0]
        op = Op(process, host, self.seq[process], kind, key, value, outcome, t, t + 0.001, **kw)
        self.ops.append(op)
        return op

    def put(self, process: str, key: str, value: str, t: float, outcome: str = OK,
            vector: tuple[tuple[str, int], ...] | None = None) -> Op:
        version = None
        if outcome == OK:
            host = process.split("/")[0]
            if vector is None:
                self.counter[host] = self.counter.get(host, 0) + 1
                vector = ((host, self.counter[host]),)
            version = Version(vector, int(t * 1000) << 16)
        return self._op(process, PUT, key, value, t, outcome, version=version)

    def delete(self, process: str, key: str, t: float, outcome: str = OK,
               deleted: bool = True) -> Op:
        return self._op(process, DELETE, key, None, t, outcome,
                        deleted=deleted if outcome == OK else None)

    def get(self, process: str, key: str, value: str | None, t: float) -> Op:
        return self._op(process, GET, key, value, t, OK)


def present(op: Op) -> Observed:
    return Observed(True, op.value, op.version)


def everywhere(state: Observed, key: str = "k") -> dict[str, dict[str, Observed]]:
    return {p: {key: state} for p in ("l3", "host-1", "host-2")}


def deleted(*vector: tuple[str, int], key: str = "k") -> dict[str, dict[str, Observed]]:
    """L3 holds a tombstone with this vector; the hosts do not hold the key."""
    return {"l3": {key: Observed(False, None, Version(vector, 0))}, "host-1": {}, "host-2": {}}


def kinds(verdict: Any) -> set[str]:
    return {a.kind for a in verdict.anomalies}


def test_checker_accepts_the_last_acknowledged_write() -> None:
    h = H()
    h.put("host-1/w0", "k", "a", 1.0)
    b = h.put("host-1/w0", "k", "b", 2.0)
    v = check(h.ops, everywhere(present(b)))
    assert v.anomalies == [] and v.ok and v.keys == 1


def test_checker_catches_a_lost_write() -> None:
    h = H()
    a = h.put("host-1/w0", "k", "a", 1.0)
    h.put("host-1/w0", "k", "b", 2.0)
    older = check(h.ops, everywhere(present(a)))  # an older value came back
    assert "lost-write" in kinds(older) and older.lost_keys == ["k"]
    gone = check(h.ops, everywhere(ABSENT))  # the key vanished
    assert "lost-write" in kinds(gone) and gone.lost_keys == ["k"]
    assert "no delete of the key was ever attempted" in str(gone.anomalies[0])
    evicted = check(h.ops, deleted(("host-1", 3)))  # a tombstone nobody asked for
    assert {a.place for a in evicted.of("lost-write")} == {"l3", "host-1", "host-2"}


def test_checker_catches_an_undone_delete() -> None:
    h = H()
    a = h.put("host-1/w0", "k", "a", 1.0)
    h.delete("host-1/w0", "k", 2.0)
    v = check(h.ops, everywhere(present(a)))
    assert "undone-delete" in kinds(v) and v.lost_keys == ["k"]
    # the tombstone in L3, absent on hosts: fine
    tomb = Observed(False, None, Version((("host-1", 2),), 2000 << 16))
    ok = check(h.ops, {"l3": {"k": tomb}, "host-1": {}, "host-2": {}})
    assert ok.anomalies == []


def test_checker_does_not_flag_a_write_legitimately_overwritten() -> None:
    h = H()
    h.put("host-1/w0", "k", "a", 1.0)
    b = h.put("host-2/w0", "k", "b", 2.0, vector=(("host-1", 1), ("host-2", 1)))
    assert check(h.ops, everywhere(present(b))).anomalies == []
    # concurrent writes (overlapping in time, concurrent vectors): either may win
    h2 = H()
    x = h2.put("host-1/w0", "k", "x", 1.0)
    y = h2.put("host-2/w0", "k", "y", 1.0)
    merged = Version((("host-1", 1), ("host-2", 1)), y.version.hlc)  # type: ignore[union-attr]
    for winner in (x, y):
        assert check(h2.ops, everywhere(Observed(True, winner.value, merged))).anomalies == []


def test_checker_flags_a_value_older_in_real_time_than_an_acknowledged_write() -> None:
    """Last-writer-wins by a clock the hosts share: a put that began after another put
    ended must not lose to it (the realtime rule; off when clocks are skewed on purpose)."""
    h = H()
    a = h.put("host-1/w0", "k", "a", 1.0)
    h.put("host-2/w0", "k", "b", 5.0)
    merged = Observed(True, "a", Version((("host-1", 1), ("host-2", 1)), a.version.hlc))  # type: ignore[union-attr]
    assert "lost-write" in kinds(check(h.ops, everywhere(merged)))
    assert check(h.ops, everywhere(merged), realtime_margin=None).anomalies == []
    # a later delete from another host, even one that found nothing to delete there
    h2 = H()
    a2 = h2.put("host-1/w0", "k", "a", 1.0)
    h2.delete("host-2/w0", "k", 5.0, deleted=False)
    v = check(h2.ops, everywhere(present(a2)))
    assert "undone-delete" in kinds(v) and "returned False" in str(v.anomalies[0])


def test_checker_allows_unknown_writes_without_requiring_them() -> None:
    h = H()
    a = h.put("host-1/w0", "k", "a", 1.0)
    b = h.put("host-1/w0", "k", "b", 2.0, outcome=INFO)
    h.delete("host-1/w0", "k", 3.0, outcome=INFO)
    assert check(h.ops, everywhere(present(a))).anomalies == []
    assert check(h.ops, everywhere(Observed(True, "b", Version((("host-1", 2),), 1)))).anomalies == []
    assert check(h.ops, deleted(("host-1", 3))).anomalies == []
    assert b.outcome == INFO
    # an unknown write then an acknowledged one: the unknown one may not be the last
    h.put("host-1/w0", "k", "c", 4.0)
    assert "lost-write" in kinds(check(h.ops, everywhere(present(b))))


def test_checker_catches_phantoms_and_version_anomalies() -> None:
    h = H()
    a = h.put("host-1/w0", "k", "a", 1.0)
    h.put("host-1/w0", "k", "never-acked", 2.0, outcome="fail")
    assert "phantom" in kinds(check(h.ops, everywhere(Observed(True, "zzz", a.version))))
    assert "phantom" in kinds(check(h.ops, everywhere(Observed(True, "never-acked", a.version))))
    assert "phantom" in kinds(check([], everywhere(Observed(True, "x", None), "stray")))
    h2 = H()
    h2.put("host-1/w0", "k", "a", 1.0)
    b = h2.put("host-2/w0", "k", "b", 2.0, vector=(("host-1", 1), ("host-2", 1)))
    old = Observed(True, "b", Version((("host-2", 1),), b.version.hlc))  # type: ignore[union-attr]
    v = check(h2.ops, everywhere(old), realtime_margin=None)
    assert {"version-regressed", "lost-write"} <= kinds(v)  # host-1's dot is not covered
    h3 = H()
    h3.put("host-1/w0", "k", "a", 1.0, vector=(("host-1", 5),))
    x = h3.put("host-2/w0", "k", "x", 1.0, vector=(("host-2", 1),))
    stale = Observed(True, "x", Version((("host-1", 4), ("host-2", 1)), 0))
    assert "dominated" not in kinds(check(h3.ops, everywhere(stale), realtime_margin=None))
    assert "lost-write" in kinds(check(h3.ops, everywhere(stale), realtime_margin=None))
    assert x.version is not None
    dom = Observed(True, "x", Version((("host-1", 4),), 0))
    assert "dominated" in kinds(check(h3.ops, everywhere(dom), realtime_margin=None))
    # a tombstone that never merged an acknowledged put: that put never reached L3
    h5 = H()
    h5.put("host-2/w0", "k", "a", 1.0)
    h5.delete("host-1/w0", "k", 2.0)
    assert "never reached the merge" in str(check(h5.ops, deleted(("host-1", 5))).anomalies)
    assert check(h5.ops, deleted(("host-1", 5), ("host-2", 1))).anomalies == []
    # L3 with no record at all although puts were acknowledged
    h4 = H()
    h4.put("host-1/w0", "k", "a", 1.0)
    h4.delete("host-2/w0", "k", 1.0, outcome=INFO)
    v4 = check(h4.ops, {"l3": {}, "host-1": {}})
    assert "has no record at all" in str(v4.of("lost-write")[0])


def test_checker_reports_divergence_and_bad_reads() -> None:
    h = H()
    a = h.put("host-1/w0", "k", "a", 1.0)
    b = h.put("host-1/w0", "k", "b", 2.0)
    split = {"l3": {"k": present(b)}, "host-1": {"k": present(b)}, "host-2": {"k": present(a)}}
    v = check(h.ops, split)
    assert v.divergent_keys == ["k"] and not v.ok
    assert [x.place for x in v.of("lost-write")] == ["host-2"]
    r = H()
    r.put("host-1/w0", "k", "a", 1.0)
    r.get("host-2/w0", "k", "ghost", 1.5)  # never written
    r.get("host-2/w0", "k", "b", 1.6)  # written, but only later
    r.put("host-1/w0", "k", "b", 3.0)
    r.delete("host-1/w0", "k", 4.0)
    r.get("host-1/w0", "k", "b", 5.0)  # its own key, after its own delete
    r.get("host-1/w0", "k", None, 6.0)
    rv = check(r.ops, deleted(("host-1", 3)))
    assert len(rv.of("phantom-read")) == 2 and len(rv.of("stale-read")) == 1
    assert rv.lost_keys == [] and not rv.ok  # phantom reads fail a run


def test_checker_leaves_keys_with_unknown_operations_alone() -> None:
    h = H()
    h.put("host-1/w0", "k", "a", 1.0)
    h._op("host-1/w0", "cas", "k", "b", 2.0, OK)
    v = check(h.ops, everywhere(Observed(True, "b", None)))
    assert v.anomalies == [] and v.unchecked == ["k"]


def test_checker_requires_a_counter_to_hold_the_sum_of_its_acknowledged_increments() -> None:
    h = H()
    for t, (p, d) in enumerate([("host-1/w0", 1), ("host-2/w0", 5), ("host-2/w1", -2),
                                ("host-1/w1", 3)]):
        h._op(p, INCR, "c", str(d), float(t), OK)
    h.get("host-1/w0", "c", "=4", 9.0)  # (reads of a counter are not judged)

    def at(n: int) -> dict[str, dict[str, Observed]]:
        return everywhere(Observed(True, value_id(n), Version((("host-1", 1),), 5)), "c")

    assert check(h.ops, at(7)).ok
    for wrong in (6, 8, 2):  # one lost, one counted twice, a host's only
        v = check(h.ops, at(wrong))
        assert kinds(v) == {"miscounted"} and v.lost_keys == ["c"], wrong
    split = at(7)
    split["host-2"] = {"c": Observed(True, value_id(6), Version((("host-1", 1),), 5))}
    v = check(h.ops, split)
    assert kinds(v) == {"miscounted", "divergent"} and [a.place for a in v.of("miscounted")] == \
        ["host-2"]
    assert kinds(check(h.ops, everywhere(ABSENT, "c"))) == {"miscounted"}
    # an increment of unknown outcome may count or not, nothing else
    h._op("host-1/w0", INCR, "c", "10", 10.0, INFO)
    h._op("host-2/w0", INCR, "c", "-1", 11.0, INFO)
    for ok_value in (6, 7, 16, 17):
        assert check(h.ops, at(ok_value)).ok, ok_value
    for bad_value in (5, 18):
        assert not check(h.ops, at(bad_value)).ok, bad_value
    h.put("host-1/w0", "c", "x", 12.0)  # a put among increments: not judged here
    assert check(h.ops, at(99)).unchecked == ["c"]


def test_history_round_trips_and_survives_a_cut_last_line(tmp_path: Path) -> None:
    h = H()
    h.put("host-1/w0", "k", "a", 1.0)
    h.delete("host-1/w0", "k", 2.0, deleted=False)
    h.get("host-1/w0", "k", None, 3.0)
    w = HistoryWriter(tmp_path / "p.jsonl")
    for op in h.ops:
        w.write(op)
    w.close()
    with open(tmp_path / "p.jsonl", "a") as f:
        f.write('{"p": "host-1/w0", "i"')  # the writer was killed mid-line
    assert load_history(tmp_path) == h.ops


# ---------------------------------------------------------------------- the nemesis


class FakeTarget:
    capabilities = frozenset({"toy"})
    hosts = 3

    def __init__(self) -> None:
        self.log: list[str] = []


@pytest.fixture
def toy_faults() -> Iterator[list[str]]:
    class Toy(Fault):
        name = "toy"
        requires = frozenset({"toy"})
        hold = (0.0, 0.01)

        def inject(self, rng: random.Random) -> str:
            self.host = rng.randrange(self.target.hosts)
            self.target.log.append(f"inject {self.host}")
            self.effect["host"] = self.host
            return f"toy on {self.host}"

        def heal(self) -> str:
            self.target.log.append(f"heal {self.host}")
            return "healed"

    class Broken(Fault):
        name = "broken"

        def inject(self, rng: random.Random) -> str:
            self.target.log.append("broken inject")
            raise RuntimeError("cannot")

        def heal(self) -> str:
            self.target.log.append("broken heal")
            return ""

    class NeedsEtcd(Fault):
        name = "needs-etcd"
        requires = frozenset({"etcd"})

        def inject(self, rng: random.Random) -> str:
            return ""

    for cls in (Toy, Broken, NeedsEtcd):
        register(cls)
    yield ["toy", "broken"]
    for name in ("toy", "broken", "needs-etcd"):
        FAULTS.pop(name, None)


def test_the_schedule_replays_from_its_seed(toy_faults: list[str]) -> None:
    a = list(islice(plan(42, toy_faults), 30))
    assert a == list(islice(plan(42, list(reversed(toy_faults))), 30))  # order of kinds irrelevant
    assert {s.kind for s in a[:2]} == set(toy_faults)  # every kind first, once
    assert a != list(islice(plan(43, toy_faults), 30))
    with pytest.raises(InvalidArgument, match="unknown fault"):
        next(plan(1, ["no-such-fault"]))


def test_the_nemesis_records_injects_heals_and_survives_a_broken_fault(
        toy_faults: list[str]) -> None:
    target = FakeTarget()
    nem = Nemesis(target, toy_faults, seed=7, gap=(0.0, 0.01))
    record = nem.run(0.05)
    assert {i.kind for i in record} >= set(toy_faults)
    toy = [i for i in record if i.kind == "toy"]
    assert all(i.ok and i.healed_at is not None and i.heal_description == "healed" for i in toy)
    assert toy[0].description.startswith("toy on ") and "host" in toy[0].effect
    broken = [i for i in record if i.kind == "broken"]
    assert broken and all("cannot" in (i.error or "") for i in broken)
    assert target.log.count("broken heal") == len(broken)  # healed even when inject failed
    assert target.log.count("heal " + str(toy[0].effect["host"])) >= 1
    assert nem.counts() == {"toy": len(toy)}
    again = Nemesis(FakeTarget(), toy_faults, seed=7, gap=(0.0, 0.01))
    assert [(i.kind, i.description) for i in again.run(0.05)][:len(record)] == \
        [(i.kind, i.description) for i in record][:len(again.record)]
    with pytest.raises(InvalidArgument, match="etcd"):
        Nemesis(target, ["needs-etcd"])
    with pytest.raises(InvalidArgument, match="unknown fault kind"):
        Nemesis(target, ["nope"])


def test_forced_faults_run_first_in_a_row_whatever_the_time(toy_faults: list[str]) -> None:
    """`kvcomm jepsen --partitions N`: N faults of one kind first, one after another, each
    healed before the next, even when the run's time is already up; then every kind once."""
    steps = list(islice(plan(5, ["broken"], forced=["toy"] * 4), 10))
    assert [s.kind for s in steps[:4]] == ["toy"] * 4
    assert {s.kind for s in steps[4:6]} == {"toy", "broken"}  # then every kind once
    assert steps == list(islice(plan(5, ["broken"], forced=["toy"] * 4), 10))  # replays
    target = FakeTarget()
    nem = Nemesis(target, ["broken"], seed=3, gap=(0.0, 0.0), forced=["toy"] * 6)
    record = nem.run(0.0)  # no time at all: the forced steps run anyway
    assert [i.kind for i in record[:6]] == ["toy"] * 6  # then every kind once: 8 in all
    assert len(record) == 8 and {i.kind for i in record[6:]} == {"toy", "broken"}
    assert all(i.ok and i.healed_at is not None for i in record[:6])
    assert target.log[:12] == [x for i in record[:6]
                               for x in (f"inject {i.effect['host']}", f"heal {i.effect['host']}")]


def test_partitions_option_is_validated() -> None:
    for bad, why in ((SoakOptions(partitions=-1), "--partitions must be"),
                     (SoakOptions(partitions=2, hosts=1), "at least 2 hosts")):
        with pytest.raises(InvalidArgument, match=why):
            bad.validate()
    r = SoakResult(1, 3, partitions_wanted=3, partitions_healed=3,
                   partition_convergence=[0.5, 1.0, 2.0], converged=True)
    assert r.ok and "3 partitions healed (3 wanted); 3 of 3 converged" in r.convergence_line()
    assert "p50 1.00s" in r.convergence_line() and "p99 2.00s" in r.convergence_line()
    short = SoakResult(1, 3, partitions_wanted=3, partitions_healed=2,
                       partition_convergence=[0.5, 1.0], converged=True)
    assert not short.ok  # fewer measured than wanted fails the run
    out = subprocess.run([sys.executable, "-m", "kvcomm", "jepsen", "--partitions", "-1",
                          "--seconds", "1", "--quiet"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "--partitions must be 0..10000" in out.stderr, out.stderr


def test_a_stopped_nemesis_heals_what_is_active(toy_faults: list[str]) -> None:
    class Long(Fault):
        name = "long"
        hold = (30.0, 30.0)

        def inject(self, rng: random.Random) -> str:
            self.target.log.append("inject")
            return "long"

        def heal(self) -> str:
            self.target.log.append("heal")
            return "healed"

    register(Long)
    try:
        target = FakeTarget()
        stop = threading.Event()
        nem = Nemesis(target, ["long"], seed=1, gap=(0.0, 0.0))
        threading.Timer(0.2, stop.set).start()
        nem.run(60, stop=stop)
        assert target.log == ["inject", "heal"]
    finally:
        FAULTS.pop("long", None)


def test_a_heal_that_fails_is_recorded_and_stops_the_nemesis(toy_faults: list[str]) -> None:
    class Unhealable(Fault):
        name = "unhealable"

        def inject(self, rng: random.Random) -> str:
            return "done"

        def heal(self) -> str:
            raise RuntimeError("the node will not come back")

    register(Unhealable)
    try:
        nem = Nemesis(FakeTarget(), ["toy", "unhealable"], seed=3, gap=(0.0, 0.0))
        record = nem.run(60)  # would run for a minute; stops at the first failed heal
        assert record[-1].kind == "unhealable" and len(record) <= 2
        assert "will not come back" in (record[-1].error or "")
        assert nem.heal_failures and nem.counts().get("unhealable") is None
    finally:
        FAULTS.pop("unhealable", None)


def test_the_built_in_faults_are_registered() -> None:
    assert set(fault_kinds()) >= {"pause-daemon", "kill-daemon", "kill-redis-master", "pause-redis-master",
                                  "trim-stream", "feed-overflow", "l2-evict"}


def test_soak_rejects_bad_options() -> None:
    with pytest.raises(InvalidArgument, match="--faults"):
        run_soak(SoakOptions(faults=["no-such-fault"]))
    with pytest.raises(InvalidArgument, match="--hosts"):
        run_soak(SoakOptions(hosts=0))
    out = subprocess.run([sys.executable, "-m", "kvcomm", "soak", "--faults", "nope",
                          "--seconds", "1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "pause-daemon" in out.stderr


def test_the_one_line() -> None:
    r = SoakResult(seed=5, hosts=3, workload_seconds=61.2, ops={"total": 1234, "ok": 1200,
                                                               "info": 34},
                   faults={"kill-daemon": 2, "pause-daemon": 1}, converged=True,
                   converge_seconds=0.5)
    line = r.line()
    assert "\n" not in line and r.ok
    for part in ("seed 5", "1,234 operations", "3 faults (kill-daemon 2 pause-daemon 1)",
                 "converged yes in 0.50s", "lost = 0"):
        assert part in line


# ---------------------------------------------------------------------- real runs


def _soak(tmp_path: Path, faults: list[str], seconds: float, **kw: Any) -> SoakResult:
    seed = drawn_seed(2**32)
    lines: list[str] = []
    result = run_soak(SoakOptions(hosts=3, seconds=seconds, seed=seed, faults=faults,
                                  directory=str(tmp_path / "soak"), converge_timeout=30,
                                  log=lines.append, **kw))
    print("\n".join(lines))
    print(result.line())
    print(f"replay: {result.replay}")
    ran = {i.kind for i in result.injections if i.ok}
    assert ran == set(faults), f"not injected: {set(faults) - ran}; errors {result.errors}"
    return result


def _assert_clean(result: SoakResult) -> None:
    assert result.ok, "\n".join([result.line(), *result.summary(), *result.errors])
    assert result.ops["ok"] > 1000 and result.converged
    assert result.ops.get("incr", 0) > 50  # counters were counted (and checked: ok above)
    assert "miscounted keys 0" in result.line()


def _effects(result: SoakResult, kind: str) -> list[dict[str, Any]]:
    return [i.effect for i in result.injections if i.kind == kind and i.ok]


@pytest.mark.redis
def test_soak_with_every_fault_kind(tmp_path: Path) -> None:
    """Every fault once, in a row with short gaps; nothing acknowledged may be lost. On a
    main without the fixes of issue 7 (items 1, 3, 4) this fails: evicted keys deleted
    cluster-wide, deletes lost with an overflowed feed, a host stale after a stream trim.
    (`make test-slow` runs the same for 30 s with the soak's own gaps.)"""
    _assert_every_fault_kind(_soak(tmp_path, fault_kinds(), 5, gap=(0.2, 0.8)))


@pytest.mark.slow
@pytest.mark.redis
def test_soak_with_every_fault_kind_for_30_s(tmp_path: Path) -> None:
    """The same for 30 s with the soak's own gaps between faults."""
    _assert_every_fault_kind(_soak(tmp_path, fault_kinds(), 30))


def _assert_every_fault_kind(result: SoakResult) -> None:
    assert all(e["evictions"] > 0 for e in _effects(result, "l2-evict"))
    assert all(e["trimmed"] > 0 for e in _effects(result, "trim-stream"))
    assert all(e["rejoined"] and e["failover_s"] > 0 for e in _effects(result, "kill-redis-master"))
    hung = _effects(result, "pause-redis-master")
    assert hung and all(e["probe"] and "failed_over" in e for e in hung)
    assert all(e["restarted_pid"] != e["killed_pid"] for e in _effects(result, "kill-daemon"))
    assert all(e["overflowed"] or e["refused"] for e in _effects(result, "feed-overflow"))
    _assert_clean(result)


@pytest.mark.slow
@pytest.mark.redis
def test_soak_with_the_faults_that_no_known_bug_affects(tmp_path: Path) -> None:
    """Paused and killed daemons, killed Redis masters: nothing lost, every host converges.
    (`make test-slow`: `make test` crosses these faults in test_soak_with_every_fault_kind.)
    Agents do not delete keys other hosts write here: a delete on a host whose L2 does not
    hold the key is a no-op in cluster mode today (see the soak's report to issue 7)."""
    result = _soak(tmp_path, ["kill-daemon", "kill-redis-master", "pause-daemon"], 25,
                   shared_deletes=False)
    _assert_clean(result)


# ---------------------------------------------------------------------- the jepsen run


def test_check_strong_catches_a_stale_read_in_the_recorded_history(tmp_path: Path) -> None:
    """The jepsen run's loader + checker on files as the strong workers write them: a
    read that returns a value older than one whose write had returned is illegal."""
    from kvcomm.faults.soak import check_strong

    def line(p: str, t: str, f: str, v: Any, at: float) -> str:
        return json.dumps({"p": p, "t": t, "f": f, "k": "soak/strong/0", "v": v, "at": at})

    good = [line("a", "invoke", "put", "x", 1), line("a", "ok", "put", None, 2),
            line("b", "invoke", "cas", ["x", "y"], 3), line("b", "ok", "cas", True, 4),
            line("a", "invoke", "get", None, 5), line("a", "ok", "get", "y", 6)]
    (tmp_path / "h-s0.lin").write_text("\n".join(good) + "\n")
    ok = check_strong(tmp_path, 2, 1)
    assert ok["verdict"] == "ok" and ok["ops"] == 3 and ok["ok"] == 3
    stale = good + [line("c", "invoke", "get", None, 7), line("c", "ok", "get", "x", 8)]
    (tmp_path / "h-s0.lin").write_text("\n".join(stale) + "\n")
    bad = check_strong(tmp_path, 3, 1)
    assert bad["verdict"] == "illegal" and "NOT linearizable" in bad["bad"][0]


@pytest.mark.etcd
@pytest.mark.redis
def test_a_jepsen_run_with_one_partition_first_then_every_jepsen_fault(tmp_path: Path) -> None:
    """`kvcomm jepsen --partitions 1` in short, `make test`'s stand-in for the two slow
    runs below: the nemesis first partitions a host (both sides keep writing, the heal ->
    convergence measured and reported), then kills and pauses etcd members and drops
    connections, with short gaps. The strong history must be linearizable, nothing
    acknowledged lost, the partition healed and converged."""
    from kvcomm.faults.soak import JEPSEN_FAULTS

    result = _soak(tmp_path, JEPSEN_FAULTS, 3, workers=1, rate=20, strong_clients=2,
                   strong_keys=4, cluster_settings={"lease_ttl": 3.0}, shared_deletes=False,
                   partitions=1, gap=(0.2, 0.8))
    line = result.convergence_line()
    print(result.strong_line())
    print(line)
    assert result.strong["ops"] > 200 and result.strong["ok"] > 100
    assert result.strong["verdict"] == "ok", result.strong
    parts = [i for i in result.injections if i.kind == "partition-host"]
    assert parts and parts[0].step == 0  # the forced one, before anything else
    assert all(i.ok and i.healed_at is not None for i in parts)
    assert all(e["held"] > 0 for e in _effects(result, "partition-host"))  # really cut off
    assert result.partitions_healed >= 1 and None not in result.partition_convergence
    assert f"{result.partitions_healed} partitions healed (1 wanted)" in line and "p99" in line
    assert result.ok, "\n".join([result.line(), *result.summary(), *result.errors])


@pytest.mark.etcd
@pytest.mark.slow
@pytest.mark.redis
def test_a_short_jepsen_run_is_linearizable_and_loses_nothing(tmp_path: Path) -> None:
    """`kvcomm jepsen` in short: 3 hosts x 2 strong clients on 4 strong keys, while the
    nemesis partitions hosts, kills and pauses etcd members and drops connections. The
    strong history must be linearizable, nothing acknowledged lost, every partition
    converged after its heal."""
    from kvcomm.faults.soak import JEPSEN_FAULTS

    # (no deletes of other hosts' keys: a delete on a host that does not see the key yet
    # is a no-op in cluster mode, the known rule test_soak_with_the_faults_that_no_known_
    # bug_affects avoids too; it is not what this run is about)
    result = _soak(tmp_path, JEPSEN_FAULTS, 15, workers=1, rate=20, strong_clients=2,
                   strong_keys=4, cluster_settings={"lease_ttl": 3.0}, shared_deletes=False)
    print(result.strong_line())
    print(result.convergence_line())
    assert result.strong["ops"] > 200 and result.strong["ok"] > 100
    assert result.strong["verdict"] == "ok", result.strong
    assert result.partition_convergence and None not in result.partition_convergence
    assert all(e["held"] > 0 for e in _effects(result, "partition-host"))  # really cut off
    assert result.ok, "\n".join([result.line(), *result.summary(), *result.errors])


@pytest.mark.etcd
@pytest.mark.slow
@pytest.mark.redis
def test_partitions_in_a_row_are_all_healed_and_measured(tmp_path: Path) -> None:
    """`kvcomm jepsen --partitions 2` in short (`make partitions` runs 20): the nemesis
    partitions hosts twice in a row before anything else, both sides keep writing, every
    heal is followed by a measured convergence; the count healed and converged and the
    p50/p99 are reported, and the run passes only with all of them."""
    result = _soak(tmp_path, ["partition-host"], 3, workers=1, rate=20, strong_clients=1,
                   strong_keys=2, cluster_settings={"lease_ttl": 3.0}, shared_deletes=False,
                   partitions=2)
    line = result.convergence_line()
    print(line)
    parts = [i for i in result.injections if i.kind == "partition-host"]
    assert len(parts) >= 2 and all(i.ok and i.healed_at is not None for i in parts)
    assert [i.step for i in parts[:2]] == [0, 1]  # the first two steps, in a row
    assert all(e["held"] > 0 for e in _effects(result, "partition-host"))  # really cut off
    assert result.partitions_healed >= 2 and len(result.partition_convergence) >= 2
    assert f"{result.partitions_healed} partitions healed (2 wanted)" in line and "p99" in line
    assert result.to_json()["partitions"]["converged"] == len(result.partition_convergence)
    assert result.ok, "\n".join([result.line(), *result.summary(), *result.errors])
