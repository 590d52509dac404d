"""Stop 23: faults the whole suite's order found (each failed CI or a local run of the
suite's neighbours, not the test alone)."""

from __future__ import annotations

from typing import Any

import pytest

from kvcomm.balance import migrate
from kvcomm.balance.migrate import NodeInfo, SlotMover
from kvcomm.errors import Unavailable
from tests.sim.test_delivery_sim import Clock


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
    clock = Clock()
    start = clock.t
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
    assert 0 < clock.t - start <= migrate.PROMOTION_WAIT_S


def test_telling_the_importer_gives_up_after_the_wait_and_on_other_errors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounded: an importer that never hears raises Unavailable after PROMOTION_WAIT_S
    (the next cycle tries again); any other refusal raises at once."""
    clock = Clock()
    start = clock.t
    mover = SlotMover.__new__(SlotMover)
    mover.clock, mover.sleep = clock, clock.sleep
    monkeypatch.setattr(mover, "_cmd", lambda *a: (_ for _ in ()).throw(
        Unavailable("Redis Cluster refused: ERR Target node is not a master")))
    with pytest.raises(Unavailable, match="not a master"):
        mover._tell_owner("127.0.0.1:7001", 21, _owner())
    assert migrate.PROMOTION_WAIT_S <= clock.t - start <= migrate.PROMOTION_WAIT_S + 0.2
    start = clock.t
    monkeypatch.setattr(mover, "_cmd", lambda *a: (_ for _ in ()).throw(
        Unavailable("Redis Cluster unreachable: refused")))
    with pytest.raises(Unavailable, match="unreachable"):
        mover._tell_owner("127.0.0.1:7001", 21, _owner())
    assert clock.t == start


def test_telling_the_importer_again_logs_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """(Review.) Told again every 0.1 s for up to 10 s: one log line, not a hundred."""
    clock = Clock()
    mover = SlotMover.__new__(SlotMover)
    mover.clock, mover.sleep = clock, clock.sleep
    calls: list[int] = []

    def cmd(*args: Any) -> Any:
        calls.append(1)
        if len(calls) < 50:
            raise Unavailable("Redis Cluster refused: ERR Target node is not a master")
        return b"OK"

    monkeypatch.setattr(mover, "_cmd", cmd)
    with caplog.at_level("INFO", logger="kvcomm.balance"):
        mover._tell_owner("127.0.0.1:7001", 21, _owner())
    assert len(calls) == 50  # (told 49 times in vain)
    said = [r for r in caplog.records if "does not know" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]


def test_only_a_refused_connection_sends_a_start_up_read_to_the_successor() -> None:
    """(Review.) redis-py raises AUTH failures and the server's client limit as
    ConnectionError too; a new slot map mends neither, so only a refused connection (a
    dead or failed-over master: redis-py's error raised from ConnectionRefusedError)
    re-reads the map. Real: redis-py dialling a port nothing listens on."""
    import socket

    import redis
    from redis import exceptions as rex

    from kvcomm.tiers.l3 import _refused

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(rex.ConnectionError) as refused:
        redis.Redis(port=port, socket_connect_timeout=1, retry_on_error=[]).ping()
    assert _refused(refused.value)
    assert not _refused(rex.AuthenticationError("invalid username-password pair"))
    assert not _refused(rex.ConnectionError("max number of clients reached"))
    assert not _refused(rex.TimeoutError("Timeout connecting to server"))


def test_the_status_file_is_never_written_through_a_planted_link(tmp_path: Any) -> None:
    """(Review.) write_status wrote a fixed temporary name (path.PID.tmp) with O_TRUNC,
    following a symlink left there: another user's link made the daemon overwrite the
    file it points at. The name is now unlinked first and created with O_EXCL and
    O_NOFOLLOW."""
    import json
    import os

    from kvcomm.node.presence import read_status, write_status

    path = str(tmp_path / "status")
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, f"{path}.{os.getpid()}.tmp")
    write_status(path, {"updated": 1.0, "partition": False})
    assert victim.read_text() == "precious"  # not written through the link
    assert read_status(path) == {"updated": 1.0, "partition": False}
    assert not os.path.islink(path) and json.loads(open(path).read())["updated"] == 1.0
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o600)


def test_what_hosts_publish_as_masters_down_is_bounded() -> None:
    """(Review.) ``kvcomm cluster status`` printed every name a host published in
    ``masters_down``: now 64 names of 200 characters at most in the JSON, and the
    table's column names 8 (masters_down_text)."""
    from kvcomm.node.presence import _names, masters_down_text

    names = _names([f"10.0.0.{i}:7000" + "x" * 500 for i in range(1000)])
    assert len(names) == 64 and all(len(n) == 200 for n in names)
    assert _names("not a list") == []
    text = masters_down_text({"masters_down": names})
    assert text.endswith("and 56 more") and text.count(",") == 7
