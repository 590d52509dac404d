"""The re-planner's cost model (kvcomm.placement.cost): when a move pays for its L3 bytes,
how long its saving lasts, and that replan / the launcher's loop move only then; and the
launcher's Observer (every host's snapshot read once a round)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

import kvcomm
from kvcomm.placement.cost import (
    FETCH_SHARE,
    READ_OVERHEAD,
    REALIZED_FLOOR,
    Pricing,
    bytes_per_read,
    horizon,
    move_cost_reads,
    pays,
    persistence,
    realized,
)
from kvcomm.placement.graph import Agent, Edge, Graph, Plan
from kvcomm.placement.launcher import Launcher, replan
from kvcomm.placement.observe import Observer, observe
from tests.support.helpers import SMALL

SEED = 1212  # (hypothesis: derandomised by this seed; printed on failure)

rates = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)
positive = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False)


def _graph(edges: list[tuple[str, str, float, float]]) -> Graph:
    ids = sorted({x for e in edges for x in e[:2]})
    return Graph(tuple(Agent(a, None, 1.0) for a in ids),
                 tuple(Edge(r, w, n, b) for r, w, n, b in edges))


edge_lists = st.lists(st.tuples(st.sampled_from("abcde"), st.sampled_from("abcde"), rates, rates),
                      max_size=12).map(
    lambda es: list({(r, w): (r, w, n, b) for r, w, n, b in es if r != w}.values()))


def test_a_read_costs_the_fetched_share_of_its_value_and_overhead() -> None:
    g = _graph([("a", "b", 20.0, 5120.0), ("b", "a", 10.0, 1280.0)])  # 6400 B / 30 reads
    assert bytes_per_read(g) == pytest.approx(FETCH_SHARE * (6400 / 30 + READ_OVERHEAD))
    assert bytes_per_read(_graph([])) == pytest.approx(FETCH_SHARE * READ_OVERHEAD)
    assert bytes_per_read(g, overhead=0.0, share=1.0) == pytest.approx(6400 / 30)
    for bad in ({"overhead": -1.0}, {"share": math.inf}, {"overhead": True}):
        with pytest.raises(kvcomm.InvalidArgument):
            bytes_per_read(g, **bad)


@seed(SEED)
@settings(max_examples=200, deadline=None)
# (bytes are 0 or at least 1: a subnormal cost rounds to itself, so 1 - 1e-9 of it is no lower)
@given(edges=edge_lists, move_bytes=st.just(0.0) | st.floats(min_value=1.0, max_value=1e9), h=positive,
       gain=st.floats(min_value=0.0, max_value=1e9))
def test_a_move_pays_exactly_when_it_wins_its_cost_in_reads(
        edges: list[tuple[str, str, float, float]], move_bytes: float, h: float,
        gain: float) -> None:
    g = _graph(edges)
    cost = move_cost_reads(g, move_bytes, h)
    per = bytes_per_read(g)
    assert cost >= 0 and (move_bytes > 0 or cost == 0)
    if math.isfinite(cost) and cost > 0:
        # the planner's threshold (reads per second) is the byte model's, up to rounding
        assert pays(cost * (1 + 1e-9), per, h, move_bytes)
        assert not pays(cost * (1 - 1e-9), per, h, move_bytes)
        assert pays(gain, per, h, move_bytes) == (gain * per * h >= move_bytes)
    # dearer moves need more reads; a longer horizon fewer
    assert move_cost_reads(g, move_bytes * 2, h) >= cost
    assert move_cost_reads(g, move_bytes, h * 2) <= cost


@pytest.mark.parametrize("kwargs", [{"move_bytes": -1.0}, {"move_bytes": math.inf},
                                    {"horizon": 0.0}, {"horizon": math.nan}])
def test_bad_move_costs_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(kvcomm.InvalidArgument):
        move_cost_reads(_graph([]), **kwargs)


@seed(SEED)
@settings(max_examples=200, deadline=None)
@given(before=edge_lists, now=edge_lists)
def test_persistence_is_the_share_of_reads_that_were_there_before(
        before: list[tuple[str, str, float, float]],
        now: list[tuple[str, str, float, float]]) -> None:
    b, n = _graph(before), _graph(now)
    p = persistence(b, n)
    assert 0.0 <= p <= 1.0
    total = sum(e.reads_per_s for e in n.edges)
    assert persistence(n, n) == (1.0 if total > 0 else 0.0)
    assert persistence(None, n) == 0.0
    if not {(e.reader, e.writer) for e in b.edges} & {(e.reader, e.writer) for e in n.edges}:
        assert p == 0.0


def test_persistence_counts_the_smaller_of_the_two_rates() -> None:
    before = _graph([("a", "b", 10.0, 0.0), ("c", "d", 30.0, 0.0)])
    now = _graph([("a", "b", 20.0, 0.0), ("d", "c", 20.0, 0.0)])  # (d→c is a new pair)
    assert persistence(before, now) == pytest.approx(10.0 / 40.0)


@seed(SEED)
@settings(max_examples=200, deadline=None)
@given(every=positive, kept=st.floats(min_value=0.0, max_value=1.0),
       more=st.floats(min_value=0.0, max_value=1.0))
def test_a_moves_saving_lasts_a_round_at_least_and_longer_the_more_reads_persist(
        every: float, kept: float, more: float) -> None:
    h = horizon(every, kept)
    assert every <= h <= 8 * every * (1 + 1e-12)
    assert horizon(every, max(kept, more)) >= h
    assert horizon(every, 0.0) == every and horizon(every, 1.0) == pytest.approx(8 * every)
    assert horizon(every, 0.5) == pytest.approx(2 * every)


@pytest.mark.parametrize("args", [(0.0, 0.5), (4.0, 1.5), (4.0, -0.1), (4.0, math.nan)])
def test_bad_horizons_are_refused(args: tuple[float, float]) -> None:
    with pytest.raises(kvcomm.InvalidArgument):
        horizon(*args)


def test_realized_is_the_observed_share_of_the_predicted_gain() -> None:
    assert realized(0.5, 0.7, 0.6) == pytest.approx(0.5)
    assert realized(0.5, 0.7, 0.9) == 1.0 and realized(0.5, 0.7, 0.3) == 0.0  # (clamped)
    assert realized(0.5, 0.505, 0.6) is None  # (no gain predicted: nothing to learn)
    assert realized(None, 0.7, 0.6) is None and realized(0.5, 0.7, None) is None


@seed(SEED)
@settings(max_examples=100, deadline=None)
@given(every=positive, shares=st.lists(st.tuples(
    st.floats(min_value=0.0, max_value=1.0), st.floats(min_value=0.0, max_value=1.0),
    st.floats(min_value=0.0, max_value=1.0), st.integers(min_value=0, max_value=3)),
    max_size=8), edges=edge_lists)
def test_pricing_learns_only_from_rounds_that_moved_and_stays_bounded(
        every: float, shares: list[tuple[float, float, float, int]],
        edges: list[tuple[str, str, float, float]]) -> None:
    g = _graph(edges)
    p = Pricing(every)
    learned: list[float] = []
    pending = None
    prev: Graph | None = None
    for before, predicted, now, moved in shares:
        h = p.horizon(g, now)
        if pending is not None and (r := realized(*pending, now)) is not None:
            learned = (learned + [r])[-3:]
        expect = max(REALIZED_FLOOR, sum(learned) / len(learned)) if learned else 1.0
        assert p.factor == pytest.approx(expect)
        assert every * REALIZED_FLOOR * (1 - 1e-12) <= h <= 8 * every * (1 + 1e-12)
        assert h == pytest.approx(horizon(every, persistence(prev, g)) * expect)
        prev = g
        p.planned(before, predicted, moved)
        pending = (before, predicted) if moved else None


def test_pricing_prices_moves_dearer_when_their_gains_do_not_show() -> None:
    g = _graph([("a", "b", 10.0, 1000.0)])
    p = Pricing(4.0)
    assert p.horizon(g, 0.0) == 4.0  # (no previous graph: one round; nothing learned)
    p.planned(0.2, 0.6, moved=2)  # predicted +0.4 ...
    assert p.horizon(g, 0.3) == pytest.approx(8 * 4.0 * 0.25)  # ... +0.1 seen: a quarter
    p.planned(0.3, 0.5, moved=0)  # (no moves: nothing to learn next round)
    assert p.factor == pytest.approx(0.25)
    assert p.horizon(g, 0.0) == pytest.approx(8 * 4.0 * 0.25)
    p.planned(0.3, 0.5, moved=1)
    assert p.horizon(g, 0.1) == pytest.approx(8 * 4.0 * 0.125)  # (mean of 0.25 and 0.0)


def _pairs(hosts: dict[str, str]) -> Graph:
    """a and b read each other, c and d read each other (10 reads/s, 100 B a read)."""
    return Graph(tuple(Agent(a, hosts.get(a), 1.0) for a in "abcd"),
                 tuple(Edge(r, w, 10.0, 1000.0)
                       for r, w in (("a", "b"), ("b", "a"), ("c", "d"), ("d", "c"))))


APART = {"a": "h1", "b": "h2", "c": "h1", "d": "h2"}


def test_replan_moves_only_when_the_reads_saved_pay_for_the_moves() -> None:
    # the swap (2 moves) wins 40 reads/s: 20 a move, each read FETCH_SHARE x (100 + 96) B
    # over a 4 s horizon: a move pays up to 20 x 4 x that
    limit = 20 * 4 * bytes_per_read(_pairs({}))
    assert limit == pytest.approx(20 * 4 * FETCH_SHARE * (100 + READ_OVERHEAD))
    cheap = replan(_pairs({}), APART, ["h1", "h2"], max_moves=2, balance=1.0,
                   move_bytes=0.9 * limit, horizon=4.0)
    dear = replan(_pairs({}), APART, ["h1", "h2"], max_moves=2, balance=1.0,
                  move_bytes=1.1 * limit, horizon=4.0)
    assert len(cheap.moves) == 2 and cheap.share == 1.0
    assert dear.moves == () and dear.share == 0.0
    # a longer horizon (reads that persist) makes the same move pay
    assert len(replan(_pairs({}), APART, ["h1", "h2"], max_moves=2, balance=1.0,
                      move_bytes=1.1 * limit, horizon=8.0).moves) == 2
    # the default: moves are free (as before the cost model)
    assert len(replan(_pairs({}), APART, ["h1", "h2"], max_moves=2, balance=1.0).moves) == 2


def test_the_replan_loop_makes_no_move_that_does_not_pay() -> None:
    launcher = Launcher({"h1": "/c/h1.yaml", "h2": "/c/h2.yaml"})
    now = [0.0]
    planned: list[dict[str, Any]] = []

    def fake_observe(config: Any, window: float) -> Graph:
        now[0] += window
        return _pairs({})

    def planner(graph: Graph, hosts: list[str], **kw: Any) -> Plan:
        planned.append(kw)
        from kvcomm.placement.plan import make_plan

        return make_plan(graph, hosts, **kw)

    def sleep(s: float) -> None:
        now[0] += s

    rounds_left = [3]
    launcher.alive = lambda: APART if rounds_left[0] > 0 else {}  # type: ignore[method-assign]

    def on_round(r: Any) -> None:
        rounds_left[0] -= 1

    cost = 100_000.0  # (a move's bytes before a process shared redis-py's command table)
    rounds = launcher.replan_loop("cfg", ["true"], every=5, max_moves=2, balance=1.0,
                                  observe=fake_observe, planner=planner, clock=lambda: now[0],
                                  sleep=sleep, on_round=on_round, move_bytes=cost)
    # 100 kB a move against 20 reads/s of 68.6 B: never pays
    assert [len(r.moves) for r in rounds] == [0, 0, 0] and len(planned) == 3
    per = bytes_per_read(_pairs({}))
    # the first round knows no persistence (one round's horizon); then the same reads
    # persisted: the horizon grows to 8 rounds, the threshold falls, still above 20
    assert planned[0]["move_cost"] == pytest.approx(cost / (5 * per))
    assert planned[1]["move_cost"] == pytest.approx(cost / (40 * per))
    assert planned[1]["move_cost"] > 20
    with pytest.raises(kvcomm.InvalidArgument, match="move_bytes"):
        launcher.replan_loop("cfg", ["true"], every=5, max_moves=1, move_bytes=-1)


def test_the_observer_reads_each_snapshot_once_a_round(ns: str) -> None:
    cfg = kvcomm.Config.from_mapping({"cache": {**SMALL["cache"], "hot_key_sample": 2}})
    slept: list[float] = []
    with kvcomm.open(ns, config=cfg, agent="w") as w, kvcomm.open(ns, config=cfg, agent="r") as r:
        w.put("w/state", b"x" * 10)
        for _ in range(2000):
            r.get("w/state")
        r.hot_keys(1)  # (a flush: the report is written)
        obs = Observer(cfg, namespace=ns)
        try:
            first = obs.graph(3.0, slept.append)  # no read yet: before, the window, after
            assert obs.reads == 2 and slept == [3.0]
            assert [(e.reader, e.writer) for e in first.edges] == []  # (no reads in it)
            second = obs.graph(3.0, slept.append)  # since the previous read: one read
            assert obs.reads == 3 and slept == [3.0]
            assert second.edges == ()  # nothing read since: no rate
            assert [(e.reader, e.writer) for e in observe(cfg, 0, namespace=ns).edges] \
                == [("r", "w")]  # (since the start, the reads are there)
        finally:
            obs.close()


def test_the_replan_loops_observer_reads_every_snapshot_once_a_round(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the launcher's default observing (no observe given): the first round reads before
    # and after its window, every later round once, its graph since the previous read
    from kvcomm.placement import observe as observe_mod

    cfg = kvcomm.Config.from_mapping({"cache": SMALL["cache"]})  # (embedded: no L3)
    now = [0.0]
    reads: list[float] = []
    waits: list[float] = []

    def snapshots(config: Any, namespace: Any, l3: Any, hosts: Any = None) -> list[Any]:
        reads.append(now[0])
        t = now[0]
        return [{"f": 1, "host": "h1", "t": t, "reports": [
            {"agent": a, "host": "h1", "id": f"{a}.1", "pid": 1, "since": -100.0, "t": t,
             "ops": int(10 * (t + 100)), "edges": {b: [int(10 * (t + 100)), 0]},
             "dropped": 0, "unknown": 0} for a, b in (("a", "b"), ("b", "a"))]}]

    def sleep(s: float) -> None:
        waits.append(s)
        now[0] += s

    monkeypatch.setattr(observe_mod, "_snapshots", snapshots)
    launcher = Launcher({"h1": "/c/h1.yaml", "h2": "/c/h2.yaml"})
    left = [3]
    launcher.alive = lambda: {"a": "h1", "b": "h2"} if left[0] > 0 else {}  # type: ignore[method-assign]
    graphs: list[Graph] = []

    def planner(graph: Graph, hosts: list[str], **kw: Any) -> Plan:
        graphs.append(graph)
        return Plan({a.id: a.host or "h1" for a in graph.agents}, (), None, None)

    def on_round(r: Any) -> None:
        left[0] -= 1

    rounds = launcher.replan_loop(cfg, ["true"], every=4, window=3, max_moves=1,
                                  planner=planner, clock=lambda: now[0], sleep=sleep,
                                  on_round=on_round)
    assert len(rounds) == 3 and not any(r.skipped for r in rounds)
    assert reads == [1.0, 4.0, 8.0, 12.0]  # (1 + 3 s window; then once every 4 s)
    assert waits == [1.0, 3.0, 4.0, 4.0]
    # each graph's rates are over its own window: 10 reads/s whatever its length
    assert [[e.reads_per_s for e in g.edges] for g in graphs] == [[10.0, 10.0]] * 3
