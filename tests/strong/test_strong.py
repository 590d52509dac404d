"""Strong keys in cluster mode (kvcomm._client.strong) on a real 3-member etcd cluster.

The agents here are in cluster mode (``cluster.redis`` set) but no node daemon runs and
no Redis answers at that address: strong operations go from the agent to etcd and need
neither (the contract: a strong write never waits for the daemon). Two "hosts" are two
L2 namespaces with their own host ids, as in the dev cluster.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import kvcomm
from kvcomm._client.strong import KEY_PREFIX, PREFIXES_KEY, revision_of
from kvcomm.devcluster.etcd_cluster import EtcdCluster
from kvcomm.devcluster.procs import running
from kvcomm.tiers.etcd import EtcdClient
from tests.support.devcluster import StrongHosts, etcd_fixture, strong_hosts_fixture
from tests.support.helpers import drawn_seed

PREFIXES = ["task/", "shelf/"]
TIMEOUT = 1.5


etcd = etcd_fixture()


@pytest.fixture
def healthy(etcd: EtcdCluster) -> Iterator[EtcdCluster]:
    yield etcd
    for i in range(len(etcd.names)):
        if etcd.alive(i):
            etcd.resume(i)
        else:
            etcd._spawn(i)
    etcd.wait_healthy(60)


hosts = strong_hosts_fixture(PREFIXES, TIMEOUT, "ts")


def _key(name: str) -> str:
    return f"task/{uuid.uuid4().hex[:10]}/{name}"


def test_a_strong_put_is_read_by_another_host_and_never_cached(hosts: StrongHosts,
                                                               etcd: EtcdCluster) -> None:
    a, b = hosts.open("host-a"), hosts.open("host-b")
    k = _key("x")
    assert a.get(k) is None and b.get_item(k) is None
    v1 = a.put(k, {"n": 1})
    rev = revision_of(v1)
    assert rev is not None and rev > 0
    item = b.get_item(k)
    assert item is not None and item.value == {"n": 1} and item.version == v1
    assert item.tier == "etcd"
    v2 = b.put(k, {"n": 2})
    assert revision_of(v2) > rev  # type: ignore[operator]
    assert a.get(k) == {"n": 2}  # a second read on host-a sees the newer write: no L1 copy
    # the value lives in etcd only: not in either host's L2
    assert k not in a._seg.keys() and k not in b._seg.keys()
    with EtcdClient(etcd.endpoints) as raw:
        kv = raw.get(KEY_PREFIX + k.encode())
        assert kv is not None and kv.mod_revision == revision_of(v2)
    assert b.delete(k) is True and a.get(k, "gone") == "gone"
    assert a.delete(k) is False
    # an eventual key in the same client still goes to L2
    a.put("plain/1", 5)
    assert "plain/1" in a._seg.keys()


def test_compare_and_set_compares_the_etcd_revision(hosts: StrongHosts) -> None:
    a, b = hosts.open("host-a"), hosts.open("host-b")
    k = _key("cas")
    v1 = a.put(k, 1, expect=kvcomm.ABSENT)
    with pytest.raises(kvcomm.ConflictError, match="expected it absent"):
        b.put(k, 2, expect=kvcomm.ABSENT)
    v2 = b.put(k, 2, expect=v1)
    with pytest.raises(kvcomm.ConflictError, match="re-read"):
        a.put(k, 3, expect=v1)  # lost the race: v1 is stale
    assert a.get(k) == 2
    # an eventual key's Version (no etcd revision) never matches
    ev = a.put("plain/cas", 1)
    with pytest.raises(kvcomm.ConflictError, match="etcd revision"):
        a.put(k, 4, expect=ev)
    with pytest.raises(kvcomm.ConflictError):
        a.delete(k, expect=v1)
    assert a.get(k) == 2
    assert a.delete(k, expect=v2) is True
    with pytest.raises(kvcomm.InvalidArgument, match="expect="):
        a.put(k, 1, expect=7)


def test_update_loses_no_increment_across_hosts(hosts: StrongHosts) -> None:
    clients = [hosts.open("host-a"), hosts.open("host-b"), hosts.open("host-c")]
    k = _key("ctr")
    per, runs = 15, [0]

    def inc(v: int) -> int:
        runs[0] += 1
        return v + 1

    def worker(c: kvcomm.Client) -> None:
        for _ in range(per):
            c.update(k, inc, default=0)

    ts = [threading.Thread(target=worker, args=(c,)) for c in clients for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert clients[0].get(k) == per * len(ts)
    print(f"{per * len(ts)} increments, fn ran {runs[0]} times (retries on a failed txn)")


def test_a_validator_sees_the_value_it_replaces_and_reruns_on_a_race(hosts: StrongHosts) -> None:
    a, b = hosts.open("host-a"), hosts.open("host-b")
    k = _key("val")
    a.put(k, 0)
    seen: list[Any] = []
    raced = threading.Event()

    def monotonic(key: str, old: kvcomm.Item | None, new: Any) -> None:
        seen.append(None if old is None else old.value)
        if old is not None and new is not None and new < old.value:
            raise ValueError(f"{new} < {old.value}")
        if not raced.is_set():  # another host writes between the read and the txn
            raced.set()
            b.put(k, 10)

    a.register_validator("task/", monotonic)
    a.put(k, 11)  # validated against 0, the txn fails (b wrote 10), validated against 10
    assert seen == [0, 10] and a.get(k) == 11
    assert a._strong.counters["retries"] == 1
    with pytest.raises(kvcomm.ValidationError):
        a.put(k, 5)
    assert b.get(k) == 11


def test_consistency_must_match_the_key_in_cluster_mode(hosts: StrongHosts, ns: str) -> None:
    a = hosts.open("host-a")
    with pytest.raises(kvcomm.InvalidArgument, match="cache.strong_prefixes"):
        a.put("plain/x", 1, consistency="strong")
    with pytest.raises(kvcomm.InvalidArgument, match="cache.strong_prefixes"):
        a.put(_key("y"), 1, consistency="eventual")
    a.put(_key("z"), 1, consistency="strong")
    a.put("plain/z", 1, consistency="eventual")
    # embedded mode: accepted on any key, as before
    with kvcomm.open(ns, config=kvcomm.Config.from_mapping(
            {"cache": {"l2_size": "16MB", "strong_prefixes": PREFIXES}})) as e:
        e.put("plain/x", 1, consistency="strong")
        e.put("task/x", 1, consistency="eventual")
        assert e.get("task/x") == 1 and "task/x" in e.keys()


def test_a_value_over_the_etcd_limit_is_value_too_large(hosts: StrongHosts) -> None:
    a = hosts.open("host-a")
    k = _key("big")
    with pytest.raises(kvcomm.ValueTooLarge, match="etcd"):
        a.put(k, b"x" * (2 << 20))
    assert a.get(k) is None
    a.put(k, b"x" * (1 << 20))  # 1 MiB fits
    assert len(a.get(k)) == 1 << 20


def test_a_batch_refuses_strong_keys_and_writes_nothing(hosts: StrongHosts) -> None:
    a = hosts.open("host-a")
    k = _key("b")
    with pytest.raises(kvcomm.InvalidArgument, match="strong key"):
        with a.batch() as b:
            b.put("plain/b", 1)
            b.put(k, 2)
    assert "plain/b" not in a._seg.keys() and a.get(k) is None


def test_disagreeing_prefixes_refuse_to_start(hosts: StrongHosts, etcd: EtcdCluster) -> None:
    hosts.open("host-a")  # records (or agrees with) PREFIXES
    with EtcdClient(etcd.endpoints) as raw:
        assert raw.get(PREFIXES_KEY) is not None
    with pytest.raises(kvcomm.ConfigError, match="cache.strong_prefixes"):
        hosts.open("host-x", strong_prefixes=["task/"])
    with pytest.raises(kvcomm.ConfigError, match="cache.strong_prefixes"):
        hosts.open("host-y", strong_prefixes=[])
    hosts.open("host-z", strong_prefixes=list(reversed(PREFIXES)))  # order does not matter


def test_strong_prefixes_in_cluster_mode_need_etcd(ns: str) -> None:
    cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": "16MB", "strong_prefixes": ["task/"]},
                                      "cluster": {"redis": ["127.0.0.1:1"]}})
    with pytest.raises(kvcomm.ConfigError, match="cluster.etcd"):
        kvcomm.open(ns, config=cfg)


def test_no_majority_is_unavailable_within_twice_the_timeout(hosts: StrongHosts,
                                                             healthy: EtcdCluster) -> None:
    seed = drawn_seed(1 << 30)
    rng = random.Random(seed)
    a = hosts.open("host-a")
    k = _key("maj")
    v = a.put(k, 1)
    a.register_validator("task/val/", lambda key, old, new: None)
    victims = rng.sample(range(3), 2)
    for i in victims:
        healthy.kill(i)
    assert all(not running(healthy.pids[i]) for i in victims)
    ops = {"put": lambda: a.put(k, 2), "get": lambda: a.get(k), "get_item": lambda: a.get_item(k),
           "cas": lambda: a.put(k, 3, expect=v), "delete": lambda: a.delete(k),
           "update": lambda: a.update(k, lambda x: x + 1),
           "validated": lambda: a.put("task/val/1", 1)}
    bound = 2 * TIMEOUT + 0.5
    times: dict[str, list[float]] = {name: [] for name in ops}
    for name, op in ops.items():
        for _ in range(2):  # a machine stall can stretch one call, not both: a second
            t0 = time.monotonic()  # try only when the first one was over the bound
            with pytest.raises(kvcomm.Unavailable):
                op()
            times[name].append(time.monotonic() - t0)
            if times[name][-1] < bound:
                break
    print("Unavailable after (s):", {n: [round(t, 2) for t in ts] for n, ts in times.items()})
    for name, ts in times.items():
        assert min(ts) < bound, (name, ts)
    for i in victims:
        healthy._spawn(i)
    healthy.wait_healthy(60)
    assert a.get(k) in (1, 2, 3)  # an outcome-unknown write may have landed, nothing else


def test_an_l1_or_l2_copy_from_before_the_prefix_was_declared_is_never_served(
        hosts: StrongHosts, etcd: EtcdCluster) -> None:
    """A key written as an eventual key (no strong prefixes yet) sits in the host's L2 and
    in the process's L1; once its prefix is declared, reads of it must come from etcd:
    neither the C getter (L1, or L2 for a memoised key) nor get_item may serve the
    planted copy, on the first read or any later one."""
    k = _key("planted")
    ns = hosts.new_namespace()
    # before: cluster mode, no etcd, no strong prefixes: the key is an eventual one, in
    # this host's L2 (no daemon runs: it stays there, dirty) and, once read, in L1
    old_cfg = kvcomm.Config.from_mapping({
        "node": {"host_id": "host-a", "namespace": ns},
        "cache": {"l2_size": "16MB", "watch_buffer": 4096},
        "cluster": {"redis": ["127.0.0.1:1"], "timeout": TIMEOUT}})
    old = kvcomm.open(ns, config=old_cfg, wait_daemon=False)  # (no daemon)
    hosts.clients.append(old)
    old.put(k, "planted in L2")
    assert old.get(k) == "planted in L2" and old.get(k) == "planted in L2"
    assert old.get_item(k).tier in ("l1", "l2")  # type: ignore[union-attr]
    assert k in old._l1_entries  # the planted L1 copy, shared by this process's clients
    assert old._read_l2(*old._key_hash(k), 1 << 40) is not None  # the planted L2 record

    # after: the prefix declared (the cluster's), the same namespace, the same process
    new = kvcomm.open(ns, config=hosts.config("host-a", ns), wait_daemon=False)
    hosts.clients.append(new)
    for _ in range(3):  # etcd has no value: absent, every time (memoised or not)
        assert new.get(k) is None
        assert new.get(k, "dflt") == "dflt"
        assert new.get_item(k) is None
    assert k not in new._l1_entries
    other = hosts.open("host-b")
    v = other.put(k, "from etcd")
    for _ in range(3):
        assert new.get(k) == "from etcd"
        item = new.get_item(k)
        assert item is not None and item.value == "from etcd" and item.tier == "etcd"
        assert item.version == v
    assert new.stats()["strong"]["gets"] >= 12  # every read went to etcd
    assert k not in new._l1_entries and k not in new._keys
    other.delete(k)


def test_a_planted_l2_copy_is_not_served_after_this_client_puts_the_key(
        hosts: StrongHosts) -> None:
    """As above, but the client that reads the key also writes it: a strong put must not
    put the key back in the key memo (the C getter reads L2 for a memoised key), or the
    next get serves the L2 record planted before the prefix was declared."""
    k = _key("planted-put")
    ns = hosts.new_namespace()
    old = kvcomm.open(ns, wait_daemon=False, config=kvcomm.Config.from_mapping({
        "node": {"host_id": "host-a", "namespace": ns},
        "cache": {"l2_size": "16MB", "watch_buffer": 4096},
        "cluster": {"redis": ["127.0.0.1:1"], "timeout": TIMEOUT}}))
    hosts.clients.append(old)
    old.put(k, "planted in L2")
    assert old._read_l2(*old._key_hash(k), 1 << 40) is not None  # the planted L2 record
    new = kvcomm.open(ns, config=hosts.config("host-a", ns), wait_daemon=False)
    hosts.clients.append(new)
    v = new.put(k, "from etcd")
    assert k not in new._keys
    for _ in range(3):
        assert new.get(k) == "from etcd"
        item = new.get_item(k)
        assert item is not None and item.value == "from etcd" and item.version == v
    new.delete(k)
