"""Review of issue 9 (strong keys on etcd, leases, partition mode): what broke, and stays fixed.

Every test runs on a real 3-member etcd cluster (``EtcdCluster``) of its own module. The
agents are in cluster mode with no Redis answering (``cluster.redis`` points nowhere):
strong operations need etcd alone. Where a test needs etcd to answer with bytes no real
member sends (malformed JSON, garbage base64), a hostile HTTP server stands in for a
member: a fault injected on the wire, as the fault proxy injects a partition.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import kvcomm
from kvcomm._client.strong import KEY_PREFIX
from kvcomm.devcluster.etcd_cluster import EtcdCluster, etcd_path
from kvcomm.tiers import l2
from kvcomm.tiers.etcd import EtcdClient

pytestmark = pytest.mark.skipif(etcd_path() is None, reason="needs etcd (apt-get install etcd-server)")

PREFIXES = ["task/"]
TIMEOUT = 1.0


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdCluster]:
    with EtcdCluster() as ec:
        yield ec


class Hosts:
    def __init__(self, etcd: EtcdCluster) -> None:
        self.etcd = etcd
        self.namespaces: list[str] = []
        self.clients: list[kvcomm.Client] = []

    def config(self, host: str, ns: str, **cache: Any) -> kvcomm.Config:
        cache = {"l2_size": "16MB", "watch_buffer": 4096, "strong_prefixes": PREFIXES, **cache}
        return kvcomm.Config.from_mapping({
            "node": {"host_id": host, "namespace": ns},
            "cache": cache,
            "cluster": {"redis": ["127.0.0.1:1"], "etcd": self.etcd.addresses,
                        "timeout": TIMEOUT},
        })

    def open(self, host: str, **cache: Any) -> kvcomm.Client:
        ns = f"tr9-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.namespaces.append(ns)
        c = kvcomm.open(ns, config=self.config(host, ns, **cache))
        self.clients.append(c)
        return c


@pytest.fixture
def hosts(etcd: EtcdCluster) -> Iterator[Hosts]:
    h = Hosts(etcd)
    yield h
    for c in h.clients:
        c.close()
    for ns in h.namespaces:
        l2.purge(ns)


def _key(name: str) -> str:
    return f"task/{uuid.uuid4().hex[:10]}/{name}"


def test_l3_consistency_is_the_clusters_too(hosts: Hosts) -> None:
    """F1: cache.l3_consistency decides whether a key under no strong prefix is strong,
    yet only cache.strong_prefixes was recorded and compared: an agent with
    ``l3_consistency: strong`` started beside agents with ``eventual`` and wrote
    ``plain/x`` to etcd, where the other agents (reading L3) never saw it, and the other
    way round: acknowledged writes invisible to the rest of the cluster."""
    hosts.open("host-a")  # records the cluster's rule: task/ strong, others eventual
    with pytest.raises(kvcomm.ConfigError, match="cache.l3_consistency"):
        hosts.open("host-b", l3_consistency="strong")
    hosts.open("host-c")  # the same rule: accepted


@pytest.mark.parametrize("raw", [b"", b"\x01", b"\xff\x00\x00\x00\x10abc",
                                 b"\x05\x00\x00\x00\x00garbage", b"\x01\x00\x00\x00\xff"])
def test_a_strong_value_that_is_no_kvcomm_record_is_corrupt_record(hosts: Hosts,
                                                                   etcd: EtcdCluster,
                                                                   raw: bytes) -> None:
    """F2: a value under kvc/k/ that KVCOMM did not write (etcdctl, another program, a
    future version) crashed get/get_item with struct.error or a bare ValueError from
    the codec, outside the KVCommError tree."""
    a = hosts.open("host-a")
    k = _key("bad")
    with EtcdClient(etcd.endpoints) as e:
        e.put(KEY_PREFIX + k.encode(), raw)
    with pytest.raises(kvcomm.CorruptRecord, match=k):
        a.get(k)
    with pytest.raises(kvcomm.CorruptRecord, match=k):
        a.get_item(k)
    # a validated write reads the value first: it says the same, and writes nothing
    a.register_validator("task/", lambda key, old, new: None)
    with pytest.raises(kvcomm.CorruptRecord, match=k):
        a.put(k, 1)
    # overwriting without reading it works: the key is usable again
    b = hosts.open("host-b")
    b.put(k, "fixed")
    assert a.get(k) == "fixed"
