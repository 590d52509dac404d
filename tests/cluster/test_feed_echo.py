"""A daemon's own pushes come back through the feed (every host reads every entry of the
groups it reads): an inline entry that holds exactly the bytes this daemon pushed and L3
stored as sent is its own echo, known without decoding or merging it (issue 9: a healed
host's backlog of 10,000 came back as 10,000 decodes and no-op merges). Anything else of
the key (another host's write, a merge) is decoded and merged as before; replays of an
earlier life of the host are covered by tests/cluster/test_holdback.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvcomm.devcluster.redis_cluster import RedisCluster
from kvcomm.tiers.l3 import L3Store, group_of
from tests.support.daemon_harness import Host, record, shared_cluster_fixture, store_fixture  # noqa: F401
from tests.support.helpers import drawn_seed, wait_for


@pytest.fixture
def host(cluster: RedisCluster) -> Iterator[Host]:
    seed = drawn_seed(2**32)
    h = Host(cluster, "host-e", seed)
    yield h
    h.close()


def caught_up(h: Host, store: L3Store, keys: list[str]) -> None:
    groups = {group_of(k) for k in keys}

    def done() -> bool:
        d = h.daemon
        seqs = store.feed_seqs(groups)
        return d is not None and all(d.feed_seqs.get(g) == seqs[g] for g in groups)

    wait_for(done, 20, "the daemon to read its groups' feeds up to date")


def test_own_echoes_are_not_decoded_and_other_writes_still_are(host: Host, store: L3Store) -> None:
    keys = [f"echo/{i}" for i in range(30)]
    assert host.daemon is not None
    pulled, echoes = host.stats.pulled, host.stats.extra.get("echoes", 0)
    for i, k in enumerate(keys):
        host.kv.put(k, i)
    wait_for(lambda: all(store.get(k) is not None for k in keys), 20, "the writes in L3")
    caught_up(host, store, keys)
    wait_for(lambda: not any(k in host.daemon.own_sent for k in keys)  # type: ignore[union-attr]
             , 20, "every echo read")
    assert host.stats.extra.get("echoes", 0) - echoes >= len(keys)
    assert host.stats.pulled == pulled  # nothing decoded and merged for them
    assert [host.kv.get(k) for k in keys] == list(range(len(keys)))
    # another host's write of the same keys is an entry like any other: merged into L2
    for i, k in enumerate(keys[:5]):
        rec = store.get(k)
        assert rec is not None
        newer = record(f"theirs-{i}", "host-a", 1, rec.hlc + 1, [*rec.vector, ("host-a", 1)])
        assert store.push(k, newer).outcome == "newer"
    for i, k in enumerate(keys[:5]):
        wait_for(lambda k=k, i=i: host.kv.get(k) == f"theirs-{i}", 20, "the remote write")
    assert host.stats.pulled >= pulled + 5
    assert host.alive


def test_own_sent_is_bounded_in_bytes_when_echoes_are_not_read(cluster: RedisCluster) -> None:
    """With cluster.feed_inline at its largest (1 MiB) a pushed record of up to 1 MiB is
    remembered until its echo is read; echoes a resync skips (a heal's backlog overflowed
    the group's stream) are never read, and OWN_SENT_MAX entries of up to 1 MiB were
    128 GiB. Here the daemon reads no feed at all: 300 writes of 60 KB are pushed, and
    what own_sent holds stays within OWN_SENT_BYTES (plus one record)."""
    from kvcomm.node.push import OWN_SENT_BYTES

    seed = drawn_seed(2**32)
    h = Host(cluster, "host-big", seed, {"feed_inline": 1 << 20}, l2_size="64MB")
    try:
        d = h.daemon
        assert d is not None
        d.puller.pull_remote = lambda poll: None  # type: ignore[method-assign] (echoes never read)
        value = "x" * 60_000
        n = max(300, 2 * OWN_SENT_BYTES // len(value))
        pushed = d.stats.pushed
        for i in range(n):
            h.kv.put(f"bigecho/{seed}/{i}", value)
        # pushed counts a push before its answers are taken (own_sent filled, cleared at
        # the bound, the writes delivered): read own_sent once the daemon is done with them
        # (the loop, another thread, would change it under the sum, or be between a clear
        # at the bound and the next entry)
        wait_for(lambda: d.stats.pushed - pushed >= n and d.port.dirty_count() == 0, 60,
                 "every write pushed and delivered")
        held = sum(len(b) for b in d.own_sent.values())
        assert 0 < held <= OWN_SENT_BYTES + (1 << 20), held
        assert h.alive, h.error
    finally:
        h.close()
