"""The threshold policy (balance/policy_threshold.py) and the view it reads
(balance/model.py): pure, driven by scripts of views."""

from __future__ import annotations

import pytest

from kvcomm.balance.model import ClusterView, Move, NodeView
from kvcomm.balance.policy_threshold import ThresholdPolicy
from kvcomm.errors import InvalidArgument


def view(t: float, loads: dict[str, dict[int, float]], cap: float = 10_000,
         other: dict[str, float] | None = None) -> ClusterView:
    """Nodes a, b, c... with their slots' loads (ops/s); ``other``: load no slot explains."""
    nodes = tuple(NodeView(n, cap, sum(s.values()) + (other or {}).get(n, 0.0))
                  for n, s in loads.items())
    slot_load = {s: v for slots in loads.values() for s, v in slots.items()}
    owner = {s: n for n, slots in loads.items() for s in slots}
    return ClusterView(nodes, slot_load, {s: 1000 for s in slot_load}, owner, t)


HOT = {"a": {1: 3000.0, 2: 2000.0, 3: 500.0}, "b": {10: 600.0}, "c": {20: 500.0}}


def test_a_node_hot_for_the_monitor_period_gives_the_slot_that_evens_it_best() -> None:
    p = ThresholdPolicy(k=1.0, monitor_s=10, grace_s=60)
    assert p.decide(view(0, HOT)) == []  # hot, but not for long enough yet
    assert p.decide(view(5, HOT)) == []
    moves = p.decide(view(10, HOT))
    assert [(m.slot, m.source, m.target) for m in moves] == [(2, "a", "c")]
    assert "over mean" in moves[0].reason and "slot 2" in moves[0].reason
    after = view(10, HOT).after(moves)
    assert max(after.loads().values()) < max(view(10, HOT).loads().values())


def test_a_burst_shorter_than_the_monitor_period_moves_nothing() -> None:
    p = ThresholdPolicy(monitor_s=10)
    calm = {"a": {1: 900.0}, "b": {10: 800.0}, "c": {20: 850.0}}
    assert p.decide(view(0, HOT)) == [] and p.decide(view(5, calm)) == []
    assert p.decide(view(12, HOT)) == []  # hot again: the period starts over


def test_a_moved_slot_rests_for_the_grace_period() -> None:
    p = ThresholdPolicy(monitor_s=0, grace_s=30, max_moves=1)
    first = p.decide(view(0, HOT))
    assert first
    # the measurements have not caught up with the move: the same view again
    again = p.decide(view(1, HOT))
    assert all(m.slot != first[0].slot for m in again)
    assert p.decide(view(40, HOT))[0].slot == first[0].slot  # rested: it may move again


def test_a_single_hot_slot_that_would_only_move_the_hot_spot_stays() -> None:
    p = ThresholdPolicy(monitor_s=0)
    single = {"a": {1: 6000.0}, "b": {10: 300.0}, "c": {20: 200.0}}
    assert p.decide(view(0, single)) == []  # c would be at 6200 > a's 6000
    # with background load on a that no slot explains, moving the hot slot helps
    moves = p.decide(view(1, single, other={"a": 2000.0}))
    assert [(m.slot, m.target) for m in moves] == [(1, "c")]


def test_an_idle_or_even_cluster_is_left_alone() -> None:
    p = ThresholdPolicy(monitor_s=0, min_utilisation=0.05)
    idle = {"a": {1: 30.0}, "b": {10: 1.0}, "c": {20: 2.0}}  # uneven, but 0.3% busy
    even = {"a": {1: 3000.0}, "b": {10: 3000.0}, "c": {20: 3000.0}}
    assert p.decide(view(0, idle)) == [] and p.decide(view(0, even)) == []


def test_several_moves_per_decision_until_the_node_is_no_longer_hot() -> None:
    p = ThresholdPolicy(k=0.5, monitor_s=0, max_moves=4)
    many = {"a": {s: 700.0 for s in range(1, 9)}, "b": {10: 500.0}, "c": {20: 500.0}}
    moves = p.decide(view(0, many))
    assert 2 <= len(moves) <= 4 and all(m.source == "a" for m in moves)
    assert {m.target for m in moves} == {"b", "c"}


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
