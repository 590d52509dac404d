"""node/presence.py's pure parts: partition mode's decision and the status file agents read."""

from __future__ import annotations

from pathlib import Path

from kvcomm.node.presence import (
    STATUS_FRESH_S,
    Reachability,
    StatusReader,
    read_status,
    write_status,
)


def test_partition_mode_enters_past_the_ttl_and_leaves_when_both_answer() -> None:
    r = Reachability(ttl=6.0, now=0.0)
    assert r.update(5.0, etcd_ok_at=0.0) is None and not r.partition  # within the TTL
    assert r.update(6.5, etcd_ok_at=6.0) == "enter"  # Redis silent for 6.5 s
    assert r.partition and "Redis unreachable" in r.reason and r.entered == 1
    r.redis_ok(20.0)
    assert r.update(20.0, etcd_ok_at=7.0) is None  # Redis back, etcd silent for 13 s
    assert r.partition and "no etcd majority" in r.reason and "Redis" not in r.reason
    r.redis_ok(21.0)
    assert r.update(21.0, etcd_ok_at=21.0) == "leave" and not r.partition and r.left == 1
    # without etcd (None), only Redis counts
    assert r.update(26.0, etcd_ok_at=None) is None
    assert r.update(28.0, etcd_ok_at=None) == "enter"


def test_the_status_file_is_trusted_only_while_fresh(tmp_path: Path) -> None:
    path = str(tmp_path / "kvcomm.ns.node.json")
    now = {"mono": 0.0, "wall": 1000.0}
    reader = StatusReader(path, clock=lambda: now["mono"], wall=lambda: now["wall"])
    assert reader.status() is None and reader.etcd_unreachable() is None  # no daemon
    write_status(path, {"host": "h", "updated": 1000.0, "etcd_unreachable": True,
                        "etcd_down_s": 2.5})
    assert read_status(path) is not None
    assert reader.etcd_unreachable() is None  # cached for 50 ms
    now["mono"] = 0.06
    why = reader.etcd_unreachable()
    assert why is not None and "'h'" in why and "2.5s" in why
    now["wall"] = 1000.0 + STATUS_FRESH_S + 0.1  # the daemon stopped writing: stale
    assert reader.etcd_unreachable() is None
    (tmp_path / "kvcomm.ns.node.json").write_text("not json")
    now["mono"] = 1.0
    assert reader.status() is None
