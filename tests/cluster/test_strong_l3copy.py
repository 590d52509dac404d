"""Which keys the cluster keeps strong, for agents without ``cluster.etcd``: every node
daemon with ``cluster.etcd`` copies etcd's record (``kvc/config/*``) into L3
(``kvm:strong``, L3Store.record_strong_config), and an agent without etcd reads that copy
when it opens (L3Store.strong_config), with no node daemon needed.

One dev cluster (real Redis Cluster, real etcd, one node daemon with
``cache.strong_prefixes: ["task/"]``). The agents under test open a namespace of their own,
where no daemon runs and no status file exists: L3's copy is all they can go by.

Run alone with ``.venv/bin/python -m pytest -q tests/cluster/test_strong_l3copy.py``.
"""

from __future__ import annotations

import copy
import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import kvcomm
from kvcomm.node.presence import status_path
from kvcomm.tiers import l2
from kvcomm.tiers.l3 import META_STRONG, STRONG_MAX, L3Store
from tests.support.devcluster import DevState, dev_cluster_fixture, l3, restart_daemon
from tests.support.helpers import wait_for

dev = dev_cluster_fixture(1, dirname="strong-l3copy", strong_prefixes=["task/"])
RECORDED = {"strong_prefixes": ["task/"], "l3_consistency": "eventual"}


@pytest.fixture
def store(dev: DevState) -> Iterator[L3Store]:
    """A direct L3 client; L3's copy is put back as the daemon recorded it afterwards."""
    s = l3(dev)
    try:
        yield s
    finally:
        s.rc.set(META_STRONG, json.dumps(RECORDED).encode())
        s.close()


@pytest.fixture
def no_etcd(dev: DevState, tmp_path: Any) -> Iterator[Any]:
    """``open(**cache)``: an agent of the dev cluster's Redis without cluster.etcd, in a
    fresh namespace of its own (no daemon, no status file), closed and purged after."""
    base = kvcomm.Config.load(dev["hosts"][0]["config"]).model_dump()
    opened: list[kvcomm.Client] = []
    names: list[str] = []

    def open_(**cache: Any) -> kvcomm.Client:
        ns = f"sl3-{uuid.uuid4().hex[:10]}"
        names.append(ns)
        data = copy.deepcopy(base)
        data["node"]["namespace"] = ns
        data["cluster"]["etcd"] = []
        data["cache"].update({"strong_prefixes": [], "l3_consistency": "eventual",
                              "l2_dir": str(tmp_path), **cache})
        cfg = kvcomm.Config.from_mapping(data)
        assert not os.path.exists(status_path(ns, str(tmp_path)))  # no daemon's word
        kv = kvcomm.open(ns, config=cfg, wait_daemon=False)
        opened.append(kv)
        return kv

    try:
        yield open_
    finally:
        for kv in opened:
            kv.close()
        for ns in names:
            l2.purge(ns, str(tmp_path))


def test_the_daemon_copies_etcds_record_into_l3(dev: DevState, store: L3Store) -> None:
    """The daemon (with cluster.etcd) recorded its prefixes in etcd and copied them into
    L3; a daemon restarted after the copy was tampered with puts etcd's back."""
    assert store.strong_config() == (["task/"], "eventual")
    store.rc.set(META_STRONG, json.dumps({"strong_prefixes": [],
                                          "l3_consistency": "eventual"}).encode())
    assert store.strong_config() == ([], "eventual")
    restart_daemon(dev, 0)
    wait_for(lambda: store.strong_config() == (["task/"], "eventual"), 60,
             "the restarted daemon to copy etcd's record into L3 again")


def test_an_agent_without_etcd_or_daemon_is_refused_when_the_cluster_has_strong_keys(
        no_etcd: Any, store: L3Store) -> None:
    assert store.strong_config() == (["task/"], "eventual")  # (the daemon's copy)
    with pytest.raises(kvcomm.ConfigError, match=r"cluster\.etcd.*task/.*kvm:strong"):
        no_etcd()
    # and a cluster whose default is strong (no prefixes): refused too
    store.record_strong_config([], "strong")
    with pytest.raises(kvcomm.ConfigError, match=r"cluster\.etcd.*'strong'"):
        no_etcd()


def test_an_agent_without_etcd_opens_on_an_eventual_only_cluster(
        no_etcd: Any, store: L3Store) -> None:
    """L3's copy says no strong keys: the agent opens, and it does not wait for a daemon's
    status to write (it is not left asking)."""
    store.record_strong_config([], "eventual")
    kv = no_etcd()
    assert not kv._strong_unknown and not kv._strong_on
    kv.put("task/1", "eventual")
    assert kv.get("task/1") == "eventual"


def test_no_copy_in_l3_falls_back_to_the_daemons_status(no_etcd: Any, store: L3Store) -> None:
    """No copy (a cluster whose daemons predate it): the agent opens, and asks the
    daemon's status before every write, as before (the agent opened before its daemon,
    below, covers the asking)."""
    store.rc.delete(META_STRONG)
    assert store.strong_config() is None
    kv = no_etcd()
    assert kv._strong_unknown


@pytest.mark.parametrize("junk", ["not json", "\xff\xfe", "[1, 2]", "null", "{}",
                                  '{"strong_prefixes": "task/", "l3_consistency": "eventual"}',
                                  '{"strong_prefixes": [1], "l3_consistency": "eventual"}',
                                  '{"strong_prefixes": [], "l3_consistency": "linear"}',
                                  '{"strong_prefixes": [], "l3_consistency": ["strong"]}',
                                  "[" * 30000 + "]" * 30000,
                                  "cos\nsystem\n(S'touch /tmp/kvcomm-pwned'\ntR.",
                                  "huge", "list"])
def test_a_junk_copy_in_l3_is_a_clear_config_error(no_etcd: Any, store: L3Store, junk: str,
                                                   ) -> None:
    """Whatever else is under kvm:strong (not JSON, too big, wrong types, another Redis
    type, a pickle), opening raises ConfigError naming the key and what to do; nothing
    is run (the pickle's command leaves no file)."""
    store.rc.delete(META_STRONG)
    if junk == "huge":
        store.rc.set(META_STRONG, b'{"strong_prefixes": ["' + b"a" * (4 * STRONG_MAX) + b'"]}')
    elif junk == "list":
        store.rc.rpush(META_STRONG, b"task/")
    else:
        store.rc.set(META_STRONG, junk.encode("latin-1") if junk.startswith("\xff")
                     else junk.encode())
    with pytest.raises(kvcomm.ConfigError, match=r"kvm:strong.*DEL kvm:strong"):
        no_etcd()
    assert not os.path.exists("/tmp/kvcomm-pwned")


def test_an_agent_opened_before_its_daemon_never_writes_strong_keys_as_eventual(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The agent opens while no daemon runs (nothing to compare with: it opens); the
    daemon then starts with cache.strong_prefixes ["task/"]; the agent's put of a key
    under that prefix must be refused (ConfigError: it has no etcd), not acknowledged
    as an eventual write.
    (found in review 18: write mark, hinted entries, unread changes)"""
    import time
    import uuid

    import kvcomm
    from kvcomm.node.presence import status_path, write_status

    ns = f"r18s-{uuid.uuid4().hex[:10]}"
    cfg = kvcomm.Config.from_mapping({
        "node": {"host_id": "h1", "namespace": ns},
        "cache": {"l2_size": "4MB", "l2_dir": str(tmp_path)},
        "cluster": {"redis": ["127.0.0.1:1"], "groups": 16}})
    kv = kvcomm.open(ns, config=cfg, wait_daemon=False)  # no daemon yet: opens (it may)
    try:
        # the daemon starts (the status it publishes, as Daemon.status() writes it)
        write_status(status_path(ns, str(tmp_path)),
                     {"host": "h1", "strong_prefixes": ["task/"], "l3_consistency": "eventual",
                      "updated": time.time()})
        # (the agent reads the status file at most every 50 ms)
        wait_for(lambda: kv._status_reader.status() is not None, 10, "the status to be read")
        with pytest.raises(kvcomm.ConfigError, match="cluster.etcd"):
            kv.put("task/1", "as eventual")
        with pytest.raises(kvcomm.ConfigError, match="cluster.etcd"):
            kv.delete("task/1")
        assert kv._seg.dirty_count == 0  # nothing was written
    finally:
        kv.close()
        from kvcomm.tiers import l2
        l2.purge(ns, str(tmp_path))
    # a daemon without strong keys: the agent's writes go on, and it stops asking
    ns2 = f"r18s-{uuid.uuid4().hex[:10]}"
    cfg2 = kvcomm.Config.from_mapping({
        "node": {"host_id": "h1", "namespace": ns2},
        "cache": {"l2_size": "4MB", "l2_dir": str(tmp_path)},
        "cluster": {"redis": ["127.0.0.1:1"], "groups": 16}})
    kv = kvcomm.open(ns2, config=cfg2, wait_daemon=False)
    try:
        kv.put("task/1", "eventual")  # (no daemon yet: eventual)
        write_status(status_path(ns2, str(tmp_path)),
                     {"host": "h1", "strong_prefixes": [], "l3_consistency": "eventual",
                      "updated": time.time()})
        wait_for(lambda: kv._status_reader.status() is not None, 10, "the status to be read")
        kv.put("task/2", "eventual")
        assert not kv._strong_on and not kv._strong_unknown
        assert kv.get("task/2") == "eventual"
    finally:
        kv.close()
        from kvcomm.tiers import l2
        l2.purge(ns2, str(tmp_path))
