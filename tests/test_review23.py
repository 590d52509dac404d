"""Stop 23: faults the whole suite's order found (each failed CI or a local run of the
suite's neighbours, not the test alone)."""

from __future__ import annotations

from typing import Any

import pytest

from kvcomm.balance import migrate
from kvcomm.balance.migrate import NodeInfo, SlotMover
from kvcomm.errors import Unavailable


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def _owner() -> NodeInfo:
    return NodeInfo("b" * 40, "127.0.0.1:7002", True, frozenset({21}), {}, {})


@pytest.mark.parametrize("answers_after", [1, 5])
def test_an_importer_that_has_not_heard_of_the_promotion_is_told_again(
        monkeypatch: pytest.MonkeyPatch, answers_after: int) -> None:
    """test_review11's failover test failed in the suite: right after the source failed
    over, the importer did not yet know the promoted replica for a master (gossip) and
    answered "Target node is not a master"; the settle gave up until the balancer's next
    cycle, its keys out of sight meanwhile. The settle now waits for the importer to
    hear of it (bounded) and tells it again."""
    clock = _Clock()
    mover = SlotMover.__new__(SlotMover)
    mover.clock, mover.sleep = clock, clock.sleep
    calls: list[tuple[Any, ...]] = []

    def cmd(name: str, *args: Any) -> Any:
        calls.append((name, *args))
        if len(calls) <= answers_after:
            raise Unavailable("Redis Cluster refused: ERR Target node is not a master")
        return b"OK"

    monkeypatch.setattr(mover, "_cmd", cmd)
    mover._tell_owner("127.0.0.1:7001", 21, _owner())
    assert len(calls) == answers_after + 1  # the fault happened, then it was told again
    assert calls[-1] == ("127.0.0.1:7001", "CLUSTER SETSLOT", 21, "NODE", "b" * 40)
    assert 0 < clock.now <= migrate.PROMOTION_WAIT_S


def test_telling_the_importer_gives_up_after_the_wait_and_on_other_errors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounded: an importer that never hears raises Unavailable after PROMOTION_WAIT_S
    (the next cycle tries again); any other refusal raises at once."""
    clock = _Clock()
    mover = SlotMover.__new__(SlotMover)
    mover.clock, mover.sleep = clock, clock.sleep
    monkeypatch.setattr(mover, "_cmd", lambda *a: (_ for _ in ()).throw(
        Unavailable("Redis Cluster refused: ERR Target node is not a master")))
    with pytest.raises(Unavailable, match="not a master"):
        mover._tell_owner("127.0.0.1:7001", 21, _owner())
    assert migrate.PROMOTION_WAIT_S <= clock.now <= migrate.PROMOTION_WAIT_S + 0.2
    clock.now = 0.0
    monkeypatch.setattr(mover, "_cmd", lambda *a: (_ for _ in ()).throw(
        Unavailable("Redis Cluster unreachable: refused")))
    with pytest.raises(Unavailable, match="unreachable"):
        mover._tell_owner("127.0.0.1:7001", 21, _owner())
    assert clock.now == 0.0
