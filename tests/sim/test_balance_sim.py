"""The slot-balancing simulator and its policies (kvcomm.balance): the simulator's
invariants under random valid moves (property tests), every policy's decisions valid,
training deterministic for a seed, the shipped model is JSON numbers (not pickle), and
the ``kvcomm balance simulate`` contract."""

from __future__ import annotations

import contextlib
import io
import json
import random
from dataclasses import replace
from importlib import resources
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcomm.balance.model import ClusterView, Move, Policy
from kvcomm.balance.policy import (
    FEATURES,
    MODEL_FILE,
    LearnedPolicy,
    ThresholdParams,
    ThresholdPolicy,
    make_policy,
    plan_moves,
    threshold_params,
)
from kvcomm.balance.sim import InvalidMove, SimConfig, Simulator, simulate
from kvcomm.balance.train import TrainConfig, eval_seeds, train, training_seeds
from kvcomm.balance.workloads import WORKLOADS
from kvcomm.cli import main
from kvcomm.errors import InvalidArgument

pytest.importorskip("numpy")

# small clusters keep each run to a fraction of a second
SMALL = SimConfig(nodes=4, slots=512, minutes=2.0, warmup_s=0.0, decide_every=5.0)


class RandomMoves:
    """Moves up to ``per`` random slots of the view to random other masters."""

    def __init__(self, seed: int, per: int) -> None:
        self.rng = random.Random(seed)
        self.per = per
        self.views: list[ClusterView] = []

    def decide(self, view: ClusterView) -> list[Move]:
        self.views.append(view)
        ids = [n.id for n in view.nodes]
        slots = self.rng.sample(sorted(view.slot_node), min(self.per, len(view.slot_node)))
        out = []
        for s in slots:
            src = view.slot_node[s]
            out.append(Move(s, src, self.rng.choice([i for i in ids if i != src]), "random"))
        return out


class Checked:
    """Wraps a policy; asserts every decision is valid for the view it was made on."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.moves = 0

    def decide(self, view: ClusterView) -> list[Move]:
        moves = self.inner.decide(view)
        ids = {n.id for n in view.nodes}
        slots = [m.slot for m in moves]
        assert len(slots) == len(set(slots)), "a slot moved twice in one decision"
        for m in moves:
            assert view.slot_node[m.slot] == m.source, f"{m} moves a slot its source does not own"
            assert m.target in ids and m.target != m.source, f"{m} targets no other master"
            assert m.reason
        self.moves += len(moves)
        return moves


# ---------------------------------------------------------------- the simulator's invariants


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), workload=st.sampled_from(WORKLOADS),
       nodes=st.integers(2, 6), per=st.integers(0, 40))
def test_slots_are_conserved_and_bytes_moved_adds_up(seed: int, workload: str, nodes: int,
                                                     per: int) -> None:
    print(f"seed {seed} workload {workload} nodes {nodes} moves/decision {per}")
    cfg = replace(SMALL, nodes=nodes)
    sim = Simulator(cfg, workload, seed, RandomMoves(seed, per), "random", trace=True)
    total_bytes = int(sim.slot_bytes.sum())
    res = sim.run()
    owner = sim.owner.tolist()
    assert len(owner) == cfg.slots and set(owner) <= set(range(nodes))
    view = sim.view()
    assert sorted(view.slot_node) == list(range(cfg.slots))
    assert sum(n.memory for n in view.nodes) == total_bytes  # no slot lost or doubled
    assert res.migrations == len(res.moved)
    assert res.bytes_moved == sum(int(sim.slot_bytes[s]) for _, s, _, _, _ in res.moved)
    if per:
        assert res.migrations > 0  # the random policy did move slots
    assert all(v >= 0 for v in res.trace["max_load"]) and all(v >= 0 for v in res.trace["mean_load"])
    assert all(n.load >= 0 and n.cpu >= 0 and n.latency_ms > 0 for n in view.nodes)
    assert all(v >= 0 for v in view.slot_load.values())
    assert res.p99_ms >= res.p50_ms > 0 and res.slo_violation_s >= 0
    assert 0 <= res.slo_violation_s <= cfg.minutes * 60


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31), workload=st.sampled_from(WORKLOADS))
def test_a_run_is_a_function_of_its_seed(seed: int, workload: str) -> None:
    print(f"seed {seed} workload {workload}")
    runs = [Simulator(SMALL, workload, seed, RandomMoves(seed, 5), "random").run().summary()
            for _ in range(2)]
    assert runs[0] == runs[1]
    other = Simulator(SMALL, workload, seed + 1, RandomMoves(seed, 5), "random").run().summary()
    assert other != runs[0]


def test_a_snapshot_runs_on_its_own() -> None:
    sim = Simulator(SMALL, "flash", 7, RandomMoves(7, 3), "random")
    for _ in range(30):
        sim.step()
    copy = sim.snapshot()
    for _ in range(30):
        copy.step()
    assert sim.t == 30 and copy.t == 60
    a = Simulator(SMALL, "flash", 7, RandomMoves(7, 3), "random")
    for _ in range(60):
        a.step()
    assert copy.owner.tolist() == a.owner.tolist()  # the copy went on exactly as the original would
    assert copy.result.migrations == a.result.migrations


def test_an_overloaded_master_breaks_the_slo_and_balancing_fixes_it() -> None:
    # the hotspot's hot window starts on one or two masters: left alone, they stay overloaded
    cfg = SimConfig(minutes=3.0)
    idle = simulate(NoMoves(), "hotspot", 3, config=cfg)
    assert idle.max_node_load > 1.0 and idle.slo_violation_s > 150 and idle.migrations == 0
    # (knobs of its own, not the shipped ones: retraining must not change what this proves)
    bal = simulate(ThresholdPolicy(ThresholdParams(k=1.25, monitor_s=10.0, grace_s=0.0)),
                   "hotspot", 3, config=cfg)
    assert bal.migrations > 0 and bal.slo_violation_s < idle.slo_violation_s / 2


class NoMoves:
    def decide(self, view: ClusterView) -> list[Move]:
        return []


@pytest.mark.parametrize("bad", [
    Move(0, "n1", "n2", "slot 0 is n0's"),
    Move(0, "n0", "n9", "no such master"),
    Move(600, "n0", "n1", "no such slot (the small cluster has 512)"),
])
def test_an_invalid_move_is_refused_and_nothing_is_queued(bad: Move) -> None:
    sim = Simulator(SMALL, "zipf", 1, None, "")
    good = Move(1, "n0", "n1", "fine")
    with pytest.raises(InvalidMove):
        sim.apply([good, bad])
    assert not sim.in_flight and not any(sim.queues)
    sim.apply([good])
    with pytest.raises(InvalidMove, match="already being moved"):
        sim.apply([good])
    # the contract refuses the other invalid moves before any driver sees them
    with pytest.raises(InvalidArgument, match="both 'n0'"):
        Move(0, "n0", "n0", "to itself")
    with pytest.raises(InvalidArgument, match="not in 0..16383"):
        Move(99999, "n0", "n1", "no such slot")


def test_bad_arguments_say_what_is_wrong() -> None:
    with pytest.raises(InvalidArgument, match="unknown workload"):
        simulate("threshold", "tsunami", 1, config=SMALL)
    with pytest.raises(InvalidArgument, match="unknown policy"):
        simulate("oracle", "zipf", 1, config=SMALL)
    with pytest.raises(InvalidArgument, match="nodes"):
        simulate("threshold", "zipf", 1, config=replace(SMALL, nodes=1))
    with pytest.raises(InvalidArgument, match="seed"):
        simulate("threshold", "zipf", -1, config=SMALL)
    with pytest.raises(InvalidArgument, match="drain"):
        make_policy("threshold", drain=0)
    with pytest.raises(InvalidArgument, match="no weight"):
        LearnedPolicy({}, price=0.1)


# ---------------------------------------------------------------- the policies


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("make", [
    lambda: ThresholdPolicy(ThresholdParams(k=0.5, monitor_s=5, grace_s=0)),
    lambda: ThresholdPolicy(),
    lambda: LearnedPolicy.load(),
    lambda: LearnedPolicy.load(price=0.0, gate=0.0),
], ids=["eager-threshold", "tuned-threshold", "learned", "learned-free-moves"])
def test_every_decision_moves_owned_slots_to_existing_masters(workload: str, make: Any) -> None:
    checked = Checked(make())
    cfg = SimConfig(nodes=5, minutes=3.0, warmup_s=0.0, decide_every=5.0)
    res = Simulator(cfg, workload, 11, checked, "checked").run()
    assert res.migrations <= checked.moves


def test_plan_moves_sheds_the_excess_with_the_hottest_slots_that_fit() -> None:
    from kvcomm.balance.model import NodeView

    loads = {0: 50.0, 1: 30.0, 2: 10.0, 3: 10.0, 4: 5.0, 5: 1.0}
    nodes = (NodeView("a", 100, 106, 1.06, 0, 1.0), NodeView("b", 100, 20, 0.2, 0, 1.0))
    view = ClusterView(nodes, {**loads, 6: 20.0}, dict.fromkeys(range(7), 1),
                       {**dict.fromkeys(range(6), "a"), 6: "b"}, time=0.0)
    moves = plan_moves(view, {"a": 63.0, "b": 63.0}, "test")
    # excess 43: slot 0 (50) overshoots it; 30 then 10 fit (3 left to shed); slots 3 (10)
    # and 4 (5) would overshoot those 3; slot 5 (1) does not
    assert [m.slot for m in moves] == [1, 2, 5]
    assert all(m.source == "a" and m.target == "b" for m in moves)


def test_the_threshold_policy_waits_for_the_grace_period() -> None:
    from kvcomm.balance.model import NodeView

    p = ThresholdPolicy(ThresholdParams(k=1.0, monitor_s=10, grace_s=20))
    nodes = tuple(NodeView(f"n{i}", 100.0, load, load / 100, 0, 1.0)
                  for i, load in enumerate([90.0, 40.0, 40.0, 40.0]))
    slot_load = {i: 9.0 for i in range(10)} | {i: 4.0 for i in range(10, 40)}
    owner = {i: "n0" for i in range(10)} | {i: f"n{1 + (i - 10) // 10}" for i in range(10, 40)}

    def at(t: float) -> ClusterView:
        return ClusterView(nodes, slot_load, dict.fromkeys(range(40), 1), owner, time=t)

    assert p.decide(at(0.0)) == []  # hot since 0
    assert p.decide(at(5.0)) == []  # between checks
    assert p.decide(at(10.0)) == []  # hot 10 s < grace
    moves = p.decide(at(20.0))
    assert moves and all(m.source == "n0" for m in moves)
    # drain 1: n0 sheds towards the mean (52.5) what the receivers take without going over
    # it: one 9 ops/s slot each (40 + 9 <= 52.5; a second would be 58)
    after = at(20.0).after(moves).loads()
    assert sorted(m.target for m in moves) == ["n1", "n2", "n3"]
    assert after["n0"] == 90 - 27 and all(after[f"n{i}"] <= 52.5 for i in (1, 2, 3))


# ---------------------------------------------------------------- the model and training


def test_the_shipped_model_is_json_numbers_and_loads() -> None:
    raw = resources.files("kvcomm.balance").joinpath(MODEL_FILE).read_bytes()
    assert raw[:1] == b"{" and not raw.startswith(b"\x80")  # JSON, not a pickle stream
    data = json.loads(raw)
    assert set(data["weights"]) == set(FEATURES)
    assert all(isinstance(v, float) for v in data["weights"].values())
    policy = LearnedPolicy.load()
    assert policy.price == data["price"] > 0
    assert threshold_params() == ThresholdParams(**data["threshold"])
    assert isinstance(make_policy("learned"), LearnedPolicy)
    assert isinstance(make_policy("threshold"), ThresholdPolicy)


def test_a_malformed_model_is_refused(tmp_path: Any) -> None:
    f = tmp_path / "m.json"
    f.write_text("[1, 2]")
    with pytest.raises(InvalidArgument, match="JSON object"):
        LearnedPolicy.load(f)
    f.write_text('{"weights": {"dp99": 1}, "price": 1}')
    with pytest.raises(InvalidArgument, match="retrain"):
        LearnedPolicy.load(f)
    with pytest.raises(InvalidArgument, match="cannot read"):
        LearnedPolicy.load(tmp_path / "absent.json")


def test_a_tiny_training_run_is_deterministic_for_a_seed() -> None:
    tc = TrainConfig(seeds=1, workers=1, sim=SimConfig(nodes=4, slots=1024, minutes=1.5),
                     horizon=20.0, grid_k=(1.0, 2.0), grid_monitor=(10.0,), grid_grace=(0.0,),
                     grid_drain=(1.0,))
    a = train(3, tc)
    b = train(3, tc)
    assert a == b
    assert a["trained"]["rows"] > 0 and set(a["weights"]) == set(FEATURES)
    assert json.loads(json.dumps(a, allow_nan=False)) == a
    LearnedPolicy.load(a)  # what training writes, the policy reads
    assert train(4, tc)["weights"] != a["weights"]


def test_training_and_evaluation_seeds_never_meet() -> None:
    train_seeds = {s for seed in range(1000) for s in training_seeds(seed, 16)}
    assert not train_seeds & set(eval_seeds(1000))


# ---------------------------------------------------------------- the command


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_kvcomm_balance_simulate_prints_one_json_object() -> None:
    code, out, err = _cli(["balance", "simulate", "--policy", "learned", "--workload", "flash",
                           "--seed", "5", "--nodes", "4", "--minutes", "1", "--slo-ms", "5",
                           "--json"])
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1
    got = json.loads(lines[0])
    for key in ("migrations", "bytes_moved", "p99_ms", "slo_violation_s", "max_node_load"):
        assert key in got
    assert got["slo_ms"] == 5 and got["nodes"] == 4 and got["seconds"] == 60
    code, out, _ = _cli(["balance", "simulate", "--policy", "threshold", "--workload", "zipf",
                         "--seed", "5", "--nodes", "4", "--minutes", "1"])
    assert code == 0 and "slots moved" in out and "p99" in out


def test_kvcomm_balance_says_what_is_missing() -> None:
    code, _, err = _cli(["balance", "simulate", "--policy", "learned", "--workload", "zipf"])
    assert code == 2 and "--seed" in err
    code, _, err = _cli(["balance", "train"])
    assert code == 2 and "--seed" in err
