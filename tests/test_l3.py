"""L3 on a real Redis Cluster (3 masters + 3 replicas): codec, merge script, feed, faults."""

from __future__ import annotations

import random
import shutil
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcomm.core.resolve import merge_rule
from kvcomm.core.versions import Dotted
from kvcomm.errors import Unavailable
from kvcomm.testing.cluster import RedisCluster
from kvcomm.tiers.l3 import CorruptRecord, L3Record, L3Store, group_of, record_key

from .test_versions import histories

pytestmark = pytest.mark.redis
needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None,
                                 reason="redis-server is not installed")


def rec(v: Dotted, value: bytes = b"v", tomb: bool = False) -> L3Record:
    return L3Record(v.hlc, tomb, 1, b"", value, v.vector, v.dot)


@given(histories, st.binary(max_size=64), st.booleans())
def test_record_codec_roundtrips(writes: list[Dotted], value: bytes, tomb: bool) -> None:
    for w in writes:
        r = rec(w, value, tomb)
        assert L3Record.decode(r.encode()) == r


@pytest.mark.parametrize("junk", [b"", b"garbage", b"\x93\x01\x02\x03", b"\x99" + b"\x00" * 9])
def test_foreign_bytes_are_corrupt_records(junk: bytes) -> None:
    with pytest.raises(CorruptRecord):
        L3Record.decode(junk)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    with RedisCluster() as c:
        yield c


@pytest.fixture
def store(cluster: RedisCluster) -> Iterator[L3Store]:
    s = L3Store(cluster.seeds)
    yield s
    s.close()


@needs_redis
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(histories, st.data())
def test_lua_merge_agrees_with_the_pure_rule(store: L3Store, writes: list[Dotted],
                                             data: st.DataObject) -> None:
    if not writes:
        return
    key = f"agree/{data.draw(st.integers(0, 10**9))}"
    store.rc.delete(record_key(key))
    stored = data.draw(st.sampled_from([None, *writes]))
    incoming = data.draw(st.sampled_from(writes))
    siblings = data.draw(st.booleans())
    if stored is not None:
        store.merge(key, rec(stored, b"stored"))
    expected_outcome, expected_version = merge_rule(stored, incoming, keep_siblings=siblings)
    got = store.merge(key, rec(incoming, b"incoming"), keep_siblings=siblings)
    assert got.outcome == expected_outcome
    assert expected_version is not None and got.record.version == expected_version
    held = store.get(key)
    assert held is not None and held.version == expected_version


@needs_redis
def test_every_accepted_change_is_in_the_group_feed(store: L3Store) -> None:
    key = "feed/k"
    g = group_of(key)
    before = store.feed(g, count=100_000)
    last = before[-1][0] if before else b"0-0"
    a = Dotted((("a", 1),), ("a", 1), 10)
    b = Dotted((("a", 2),), ("a", 2), 11)
    store.merge(key, rec(a))
    store.merge(key, rec(b))
    store.merge(key, rec(a))  # older: refused, not fed
    rows = [r for r in store.feed(g, after=last) if r[1] == key]
    assert [L3Record.decode(r[2]).dot for r in rows] == [("a", 1), ("a", 2)]


@needs_redis
def test_a_foreign_value_is_an_error_for_that_key_only(store: L3Store) -> None:
    store.rc.set(record_key("foreign/1"), b"written by someone else")
    good = rec(Dotted((("a", 1),), ("a", 1), 1))
    out = store.merge_many([("foreign/1", good), ("foreign/ok", good)])
    assert isinstance(out[0], CorruptRecord) and "foreign/1" in str(out[0])
    assert not isinstance(out[1], Exception) and out[1].outcome in ("new", "equal")
    with pytest.raises(CorruptRecord):
        store.get("foreign/1")
    with pytest.raises(CorruptRecord):
        store.merge("foreign/1", good)
    assert store.rc.get(record_key("foreign/1")) == b"written by someone else"  # untouched


@needs_redis
def test_pipelined_merges_span_every_master(store: L3Store, cluster: RedisCluster) -> None:
    seed = random.randrange(2**32)
    print(f"seed={seed}")
    rng = random.Random(seed)
    items = [(f"spread/{i}", rec(Dotted((("h", i + 1),), ("h", i + 1), rng.randrange(99))))
             for i in range(600)]
    out = store.merge_many(items)
    assert all(not isinstance(r, Exception) for r in out)
    nodes = {store.rc.get_node_from_key(record_key(k)).name for k, _ in items}
    assert len(nodes) == len(cluster.master_ports())
    assert all(store.get(k) == r for k, r in items)


def test_unreachable_cluster_is_unavailable() -> None:
    with pytest.raises(Unavailable):
        L3Store([("127.0.0.1", 1)], timeout=0.2)


@needs_redis
def test_master_failover_keeps_replicated_writes(cluster: RedisCluster) -> None:
    store = L3Store(cluster.seeds)
    try:
        items = [(f"failover/{i}", rec(Dotted((("h", 1),), ("h", 1), i))) for i in range(200)]
        assert all(not isinstance(r, Exception) for r in store.merge_many(items))
        cluster.wait_replicated()  # replication is asynchronous: wait for it here
        victim = store.rc.get_node_from_key(record_key("failover/0")).port
        cluster.kill(victim)
        cluster.wait_healthy(30)
        got = None
        for _ in range(100):  # the client learns the new master after a refused call
            try:
                got = store.get("failover/0")
                break
            except Unavailable:
                time.sleep(0.1)
        assert got == items[0][1]
        assert all(store.get(k) == r for k, r in items)
        later = rec(Dotted((("h", 2),), ("h", 2), 999))
        assert store.merge("failover/0", later).outcome == "newer"
    finally:
        store.close()
