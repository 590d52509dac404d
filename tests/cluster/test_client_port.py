"""The node daemon's port to the host's L2 (node/port.py's ClientPort) over a real client,
through the client's merge face (kvcomm._client.merge.RemoteMerges), without a cluster:
what it merges in, reads back, forgets and restamps."""

from __future__ import annotations

from typing import Any

import kvcomm
from kvcomm._client.merge import RemoteMerges
from kvcomm.core import codec
from kvcomm.node.port import ClientPort
from kvcomm.tiers.l3 import L3Record


def _remote(value: Any, vector: tuple[tuple[str, int], ...], hlc: int) -> L3Record:
    """A record of ``value`` written on another host (the last entry of ``vector``)."""
    tag, meta, raw = codec.encode(value)
    return L3Record(hlc, False, tag, meta, bytes(raw), vector, vector[-1])


def test_remote_versions_merge_by_vector_order(kv: kvcomm.Client) -> None:
    port = ClientPort(kv)
    older = _remote("v1", (("host-b", 1),), 1_000)
    newer = _remote("v2", (("host-b", 2),), 2_000)
    port.apply_remote("k", newer)
    assert kv.get("k") == "v2" and port.holds("k")
    assert port.held_vector("k") == (("host-b", 2),)
    port.apply_remote("k", older)  # covered by what L2 holds: kept as it is
    assert kv.get("k") == "v2" and port.held_vector("k") == (("host-b", 2),)
    assert port.dirty_record("k") is None  # a merged version is clean (L3 has it)


def test_a_local_write_is_read_under_this_hosts_dot(kv: kvcomm.Client) -> None:
    """Embedded, a write owes L3 nothing (clean): the daemon's held_record reads it."""
    port = ClientPort(kv)
    version = kv.put("mine", {"a": 1})
    assert port.dirty_record("mine") is None and port.dirty_count() == 0
    rec = port.held_record("mine")
    assert rec is not None and rec.dot[0] == port.host_id
    assert rec.vector == version.vector
    assert port.merges.version_of(rec.dot[1], rec.hlc, b"") == version


def test_resolvers_forgetting_and_restamps(kv: kvcomm.Client) -> None:
    port = ClientPort(kv)
    assert not port.has_resolver("doc/1")
    port.register_resolver("doc/", lambda key, items: items[0].value)
    assert port.has_resolver("doc/1") and not port.has_resolver("other")
    kv.put("gone", 1)
    assert kv.get("gone") == 1  # (now in this process's L1 too)
    assert port.forget("gone") is True
    assert kv.get("gone") is None and not port.holds("gone")
    # nothing of this host's to restamp; no dot of an earlier life past the sequence
    assert port.rebase("absent", _remote(1, ((port.host_id, 5),), 1)) is False
    assert port.past_lost_dots(0) == 0


def test_the_merge_face_is_the_clients_own_segment(kv: kvcomm.Client) -> None:
    merges = RemoteMerges(kv)
    assert merges.segment is ClientPort(kv).seg
    assert all(not name.startswith("_") for name in vars(RemoteMerges) if
               callable(getattr(RemoteMerges, name)) and name != "__init__" and
               not name.startswith("__"))
