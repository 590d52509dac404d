"""Per-key expiry of strong keys (one etcd lease per bucket of deadlines) and of far
deadlines pushed to L3, on a dev cluster of two hosts."""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Iterator
from typing import Any

import pytest

import kvcomm
from kvcomm import devcluster
from kvcomm._client.strong import etcd_key
from kvcomm.tiers.l3 import L3Record, L3Store
from tests.support.helpers import wait_for
from tests.support.servers import starts

_BYTES_TAG = 1


def _f64(x: float) -> bytes:
    return b"\xcb" + struct.pack(">d", x)


# ---------------------------------------------------------------- F4: a lost bucket lease

@pytest.fixture(scope="module")
@starts("redis", "etcd")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    d = tmp_path_factory.mktemp("devcluster")
    state = devcluster.up(2, str(d), groups=64, strong_prefixes=["lock/"])
    yield state
    devcluster.down(str(d))


def test_a_strong_put_with_a_ttl_gets_a_new_lease_when_its_buckets_is_gone(
        dev: dict[str, Any]) -> None:
    """A process keeps one etcd lease per 1-second bucket of deadlines. When that lease
    is gone before the bucket's end (revoked by an operator, an etcd restored from a
    backup, or this host's wall clock stepped back past it), every later put with a
    deadline in the bucket failed with Unavailable ("requested lease not found") until the
    clock passed the bucket.
    (found in review 14: per-key TTL and presence)"""
    a = kvcomm.open(config=dev["hosts"][0]["config"])
    b = kvcomm.open(config=dev["hosts"][1]["config"])
    try:
        bucket = math.ceil(time.time() + 30)
        a.put("lock/x", "1", ttl=bucket - 0.5 - time.time())
        kv = a._strong.etcd.get(etcd_key("lock/x"))
        assert kv is not None and kv.lease
        assert a._strong.etcd.lease_revoke(kv.lease)  # the lease is gone, and its keys
        assert b.get("lock/x") is None
        a.put("lock/y", "2", ttl=bucket - 0.4 - time.time())  # the same bucket
        y = a._strong.etcd.get(etcd_key("lock/y"))
        assert y is not None and y.lease not in (0, kv.lease)
        assert b.get("lock/y") == "2"
        assert a.touch("lock/y", bucket - 0.3 - time.time())  # a touch into it too
        assert b.get_item("lock/y").expires_at is not None  # type: ignore[union-attr]
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------- F5: expect=ABSENT, strong

def test_an_expired_strong_key_is_absent_to_expect_absent_and_update(
        dev: dict[str, Any]) -> None:
    """A strong key stays in etcd until its bucket's lease ends (up to a second, or etcd's
    minimum lease TTL, after its deadline) although every read finds it absent from its
    deadline on; put(expect=ABSENT) raised ConflictError in that window, and update()
    (which writes with expect=ABSENT over an absent key) lost every race.
    (found in review 14: per-key TTL and presence)"""
    a = kvcomm.open(config=dev["hosts"][0]["config"])
    b = kvcomm.open(config=dev["hosts"][1]["config"])
    try:
        a.put("lock/shelf", "robot-1", ttl=0.3)
        a.put("lock/count", 5, ttl=0.3)
        d = a.get_item("lock/shelf").expires_at  # type: ignore[union-attr]
        assert d is not None
        wait_for(lambda: time.time() > d, 5, "the deadline")
        assert b.get("lock/shelf") is None
        # the fault's condition: etcd still holds both (their lease has not ended)
        assert a._strong.etcd.get(etcd_key("lock/shelf")) is not None
        assert a._strong.etcd.get(etcd_key("lock/count")) is not None
        b.put("lock/shelf", "robot-2", expect=kvcomm.ABSENT)  # the claim lapsed: take it
        assert a.get("lock/shelf") == "robot-2"
        assert a.get_item("lock/shelf").expires_at is None  # type: ignore[union-attr]
        assert b.update("lock/count", lambda n: n + 1, default=0) == 1  # absent: from 0
        assert a.get("lock/count") == 1
        with pytest.raises(kvcomm.ConflictError):  # a live key still conflicts
            a.put("lock/shelf", "robot-3", expect=kvcomm.ABSENT)
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------- F6: expect=Version, strong

def test_an_expired_strong_key_is_not_at_its_old_version(dev: dict[str, Any]) -> None:
    """After its deadline a key is absent: put(expect=its old Version) raises
    ConflictError, as on an eventual key (tests/embedded/test_ttl.py); on a strong key etcd still
    held it at that revision until the lease ended, and the put succeeded, reviving it
    (as touch() did for a key that expired between its read and its write).
    (found in review 14: per-key TTL and presence)"""
    a = kvcomm.open(config=dev["hosts"][0]["config"])
    try:
        v1 = a.put("lock/v", "robot-1", ttl=0.3)
        d = a.get_item("lock/v").expires_at  # type: ignore[union-attr]
        assert d is not None
        wait_for(lambda: time.time() > d, 5, "the deadline")
        assert a.get("lock/v") is None
        assert a._strong.etcd.get(etcd_key("lock/v")) is not None  # still in etcd
        with pytest.raises(kvcomm.ConflictError):
            a.put("lock/v", "robot-1-again", expect=v1)
        assert a.get("lock/v") is None
    finally:
        a.close()


# ---------------------------------------------------------------- F7: a far deadline in L3

def test_a_record_with_a_far_deadline_is_pushed_to_l3_without_error(dev: dict[str, Any]) -> None:
    """Every reader takes a deadline up to 1e300 s; L3's push script gave such a key
    ``PEXPIREAT deadline*1000 + grace``, which Lua formats as "1e+15" from 1e14 ms on
    (about the year 5138): Redis refused it and the script stopped after storing the
    record, so the push raised CorruptRecord — every time, for a host whose update()
    carried such a deadline (update keeps the deadline it read), whose write then never
    left its backlog.
    (found in review 14: per-key TTL and presence)"""
    store = L3Store([(a.rpartition(":")[0], int(a.rpartition(":")[2])) for a in dev["redis"]],
                    groups=64)
    try:
        for i, d in enumerate((1e12, 1e17, 1e200)):
            rec = L3Record(hlc=1 << 20, tombstone=False, tag=_BYTES_TAG, meta=b"", value=b"v",
                           vector=(("far", i + 1),), dot=("far", i + 1),
                           ext=b"\x81\xa1e" + _f64(d))
            out = store.push(f"far/{i}", rec)  # raised CorruptRecord
            assert out.outcome == "new"
            got = store.get(f"far/{i}")
            assert got is not None and got.deadline == d and not got.tombstone
    finally:
        store.close()
