"""The one policy contract (balance/model.py) and the policies behind it
(balance/policy.py) on views shaped like the live driver's: only the slots that carry
load, nodes' loads that slots do not fully explain. Pure, driven by scripts of views."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kvcomm
from kvcomm.balance.driver import load_policy
from kvcomm.balance.model import ClusterView, Move, NodeView, SlotArray
from kvcomm.balance.policy import (
    FEATURES,
    LearnedPolicy,
    ThresholdParams,
    ThresholdPolicy,
    make_policy,
    threshold_params,
)
from kvcomm.errors import ConfigError, InvalidArgument, KVCommError


def view(t: float, loads: dict[str, dict[int, float]], cap: float = 10_000,
         other: dict[str, float] | None = None) -> ClusterView:
    """Nodes a, b, c... with their slots' loads (ops/s); ``other``: load no slot explains."""
    nodes = tuple(NodeView(n, cap, sum(s.values()) + (other or {}).get(n, 0.0))
                  for n, s in loads.items())
    slot_load = {s: v for slots in loads.values() for s, v in slots.items()}
    owner = {s: n for n, slots in loads.items() for s in slots}
    return ClusterView(nodes, slot_load, {s: 1000 for s in slot_load}, owner, t)


# a is at 55%, b and c at 6% and 5%: a is hot by any k
HOT = {"a": {1: 3000.0, 2: 2000.0, 3: 500.0}, "b": {10: 600.0}, "c": {20: 500.0}}


def test_a_node_hot_for_the_grace_period_sheds_its_excess_to_the_others() -> None:
    p = ThresholdPolicy(ThresholdParams(k=1.0, monitor_s=10, grace_s=20))
    assert p.decide(view(0, HOT)) == []  # hot since 0
    assert p.decide(view(5, HOT)) == []  # between checks
    assert p.decide(view(10, HOT)) == []  # hot for 10 s < grace
    moves = p.decide(view(20, HOT))
    assert moves and all(m.source == "a" and m.target in ("b", "c") for m in moves)
    assert "mean" in moves[0].reason
    before, after = view(20, HOT), view(20, HOT).after(moves)
    assert max(after.loads().values()) < max(before.loads().values())


def test_a_burst_shorter_than_the_grace_period_moves_nothing() -> None:
    p = ThresholdPolicy(ThresholdParams(k=1.0, monitor_s=0, grace_s=10))
    calm = {"a": {1: 850.0}, "b": {10: 850.0}, "c": {20: 850.0}}
    assert p.decide(view(0, HOT)) == [] and p.decide(view(5, calm)) == []
    assert p.decide(view(12, HOT)) == []  # hot again: the period starts over


def test_an_idle_or_even_cluster_is_left_alone() -> None:
    p = ThresholdPolicy(ThresholdParams(k=0.5, monitor_s=0, grace_s=0, min_utilisation=0.05))
    idle = {"a": {1: 30.0}, "b": {10: 1.0}, "c": {20: 2.0}}  # uneven, but 0.3% busy
    even = {"a": {1: 3000.0}, "b": {10: 3000.0}, "c": {20: 3000.0}}
    assert p.decide(view(0, idle)) == [] and p.decide(view(1, even)) == []
    # the same unevenness, busy enough: now it moves
    busy = {n: {s: v * 100 for s, v in slots.items()} for n, slots in idle.items()}
    busy["a"] |= {2: 1.0}
    assert p.decide(view(2, busy))


def test_the_live_driver_gets_the_same_policies_and_a_one_window_threshold() -> None:
    once = load_policy("threshold", once=True)
    assert isinstance(once, ThresholdPolicy)
    assert once.params.monitor_s == 0 and once.params.grace_s == 0
    assert once.decide(view(0, HOT))  # one window is enough with --once
    tuned = load_policy("threshold")  # the knobs tuned in the simulator, as shipped
    assert isinstance(tuned, ThresholdPolicy) and tuned.params == threshold_params()
    assert tuned.params.monitor_s > 0
    assert isinstance(load_policy("learned"), LearnedPolicy)
    with pytest.raises(ConfigError, match="threshold, learned"):
        load_policy("anna")


def test_the_learned_policy_decides_on_a_sparse_live_view() -> None:
    p = LearnedPolicy.load()
    calm = {"a": {1: 900.0}, "b": {10: 800.0}, "c": {20: 850.0}}
    assert p.decide(view(0, calm)) == []  # under its gate: nothing is worth moving
    hot = {"a": {s: 1500.0 for s in range(1, 7)}, "b": {10: 1000.0}, "c": {20: 900.0}}
    moves = p.decide(view(10, hot))  # a at 90%, b, c at 10%
    assert moves and all(m.source == "a" and m.target in ("b", "c") for m in moves)
    view(10, hot).after(moves)  # valid against the view (raises otherwise)


def test_the_view_validates_and_predicts_moves() -> None:
    v = view(0, HOT)
    with pytest.raises(InvalidArgument, match="does not own"):
        v.after([Move(10, "a", "b")])
    with pytest.raises(InvalidArgument, match="not in 0..16383"):
        Move(16384, "a", "b")
    with pytest.raises(InvalidArgument, match="both"):
        Move(1, "a", "a")
    with pytest.raises(InvalidArgument, match="not a node"):
        ClusterView((NodeView("a", 1, 0),), slot_node={1: "z"})
    with pytest.raises(InvalidArgument, match="capacity"):
        NodeView("a", 0, 0)
    after = v.after([Move(1, "a", "b")])
    assert after.slot_node[1] == "b" and after.loads() == {"a": 2500.0, "b": 3600.0, "c": 500.0}
    assert v.slot_node[1] == "a"  # the view itself is unchanged
    with pytest.raises(TypeError):
        v.slot_node[1] = "b"  # type: ignore[index]


def test_a_slot_array_is_a_read_only_mapping_checked_in_bulk() -> None:
    nodes = (NodeView("a", 10, 1), NodeView("b", 10, 1))
    arr = SlotArray(["a", "b", "a"])
    v = ClusterView(nodes, SlotArray([1.0, 0.0, 2.0]), SlotArray([5, 5, 5]), arr, time=1.0)
    assert dict(v.slot_node) == {0: "a", 1: "b", 2: "a"} and v.slots_of("a") == [0, 2]
    assert v.load_of(2) == 2.0 and v.load_of(3) == 0.0 and 3 not in v.slot_node
    assert v.after([Move(2, "a", "b")]).loads() == {"a": 0.0, "b": 3.0}
    with pytest.raises(InvalidArgument, match="not nodes"):
        ClusterView(nodes, slot_node=SlotArray(["a", "z"]))
    with pytest.raises(InvalidArgument, match="negative"):
        ClusterView(nodes, slot_load=SlotArray([1.0, -1.0]))
    with pytest.raises(InvalidArgument, match="16384 slots"):
        SlotArray([0] * 16385)
    with pytest.raises(KeyError):
        arr[3]


MODEL = json.loads((Path(kvcomm.__file__).parent / "balance" / "balance_model.json").read_text())


# ---------------------------------------------------------------- hostile model files


def _write(tmp_path: Path, data: Any, raw: str | None = None) -> str:
    p = tmp_path / "model.json"
    p.write_text(raw if raw is not None else json.dumps(data))
    return str(p)


def test_a_deeply_nested_model_file_is_a_kvcomm_error(tmp_path: Path) -> None:
    """F: a model file of 100,000 nested arrays made json.loads raise RecursionError, a
    traceback out of `kvcomm balance --model` instead of a KVCommError saying what to do.
    (found in review 11: slot balancing)"""
    path = _write(tmp_path, None, "[" * 100_000)
    with pytest.raises(KVCommError, match="balancing model"):
        threshold_params(path)
    with pytest.raises(KVCommError, match="balancing model"):
        LearnedPolicy.load(path)


@pytest.mark.parametrize("weight", ["x", [1], {"a": 1}, None, True])
def test_a_learned_model_with_weights_of_the_wrong_type_is_a_kvcomm_error(weight: object) -> None:
    """F: a weight that is a string or a list escaped LearnedPolicy.load as a raw
    ValueError/TypeError (a bool was taken as 1.0): a malformed model must be a
    KVCommError (the driver turns those into ConfigError for --policy).
    (found in review 11: slot balancing)"""
    with pytest.raises(KVCommError, match="learned model"):
        LearnedPolicy.load({**MODEL, "weights": {f: weight for f in FEATURES}})


@pytest.mark.parametrize("gate", [float("nan"), "nan", -1.0, float("inf"), True])
def test_a_learned_model_with_a_gate_that_is_not_a_number_in_range_is_refused(gate: object) -> None:
    """F: a gate of NaN (or the string "nan", or a bool) was accepted: every comparison
    with NaN is false, so a hostile or corrupt model silently changes when the balancer
    moves slots. The gate is a utilisation: a finite number >= 0.
    (found in review 11: slot balancing)"""
    with pytest.raises(KVCommError):
        LearnedPolicy.load({**MODEL, "gate": gate})


@pytest.mark.parametrize("fmt", ["kvcomm-balance-learned/99", None, 7])
def test_a_learned_model_of_another_format_is_refused(fmt: object) -> None:
    """F: the model file carries "format": "kvcomm-balance-learned/1", but nothing reads it:
    a model of a later format (other features, other units behind the same names) or of
    none at all was loaded and used to move slots. Another format must be refused, saying
    to retrain or upgrade.
    (found in review 11: slot balancing)"""
    with pytest.raises(KVCommError, match="format"):
        LearnedPolicy.load({**MODEL, "format": fmt})


@pytest.mark.parametrize("knob,value", [("k", "x"), ("k", True), ("max_moves", 1.5),
                                        ("grace_s", float("inf")), ("monitor_s", "30"),
                                        ("drain", None)])
def test_threshold_knobs_of_the_wrong_type_are_a_kvcomm_error(
        tmp_path: Path, knob: str, value: object) -> None:
    """F: threshold knobs are validated by comparison only: a string raised a raw
    TypeError from validate(), and max_moves 1.5, k True, grace_s inf were accepted.
    (found in review 11: slot balancing)"""
    path = _write(tmp_path, {"threshold": {**MODEL["threshold"], knob: value}})
    with pytest.raises(KVCommError):
        threshold_params(path)
    with pytest.raises(KVCommError):
        make_policy("threshold", **{knob: value})


def test_the_threshold_policy_can_act_on_two_masters() -> None:
    """F: with n masters the largest z-score one can reach is sqrt(n - 1) (population
    std), so with 2 masters "mean + 1.25 std" (the shipped k) is never exceeded: a master
    at 95% next to one at 5% was never balanced, live or in `simulate --nodes 2` (0
    migrations on every workload). k must be capped at what n masters can reach.
    (found in review 11: slot balancing)"""
    from kvcomm.balance.model import ClusterView, NodeView

    nodes = (NodeView("a", 100.0, 95.0), NodeView("b", 100.0, 5.0))
    load = {s: 9.5 for s in range(10)} | {100 + s: 1.0 for s in range(5)}
    owner = {s: "a" for s in range(10)} | {100 + s: "b" for s in range(5)}
    view = ClusterView(nodes, load, {}, owner, 0.0)
    moves = make_policy("threshold", monitor_s=0.0, grace_s=0.0).decide(view)
    assert moves and all(m.source == "a" and m.target == "b" for m in moves)


@pytest.mark.parametrize("opt,value", [("--slo-ms", "inf"), ("--minutes", "0.0001")])
def test_simulate_prints_strict_consistent_json_or_refuses(opt: str, value: str) -> None:
    """F: `simulate --slo-ms inf --json` printed `"slo_ms": Infinity`, which is not JSON
    (a strict parser, jq, JavaScript refuse the whole line); `--minutes 0.0001` (less than
    one 1 s tick) reported "seconds": 0.006 with "slo_violation_s": 1.0, more violation
    than time. Either is refused (a clear error), or the JSON is strict and consistent.
    (found in review 11: slot balancing)"""
    out = subprocess.run([sys.executable, "-m", "kvcomm", "balance", "simulate", "--policy",
                          "threshold", "--workload", "flash", "--seed", "1", "--minutes", "0.05",
                          opt, value, "--json"], capture_output=True, text=True, timeout=300)
    if out.returncode == 0:
        res = json.loads(out.stdout.strip().splitlines()[-1],
                         parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
        assert res["slo_violation_s"] <= res["seconds"], res
    else:
        assert opt.lstrip("-").replace("-", "_") in out.stderr and "Traceback" not in out.stderr
