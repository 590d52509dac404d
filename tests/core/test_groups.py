"""Hash-slot groups (tiers/groups.py): every count's tags land where they should, the
count L3 was initialised with is enforced, the feeds' memory is bounded in total, and an
idle daemon's Redis commands per second do not grow with the number of groups."""

from __future__ import annotations

import os
import random
import time
import uuid
from collections.abc import Iterator

import pytest
from redis.crc import key_slot as redis_key_slot

import kvcomm
from kvcomm.devcluster.redis_cluster import RedisCluster
from kvcomm.errors import ConfigError
from kvcomm.tiers.groups import LEGACY_GROUPS, SLOTS, Groups, groups, key_slot, slot_tag
from kvcomm.tiers.l3 import FEED_MIN, META_GROUPS, L3Store
from kvcomm.tiers.shm.files import segment_path
from tests.support.daemon_harness import Host, record, shared_cluster_fixture  # noqa: F401 (the fixture)
from tests.support.helpers import wait_for


@pytest.mark.parametrize("count", [32, 1024, 16384])
def test_groups_are_spread_evenly_one_slot_each(count: int) -> None:
    g = groups(count)
    step = SLOTS // count
    assert list(g.slots) == [i * step for i in range(count)]
    for i in random.Random(count).sample(range(count), min(count, 200)):
        tag = g.tags[i]
        for name in (g.feed_key(i), g.seq_key(i), g.hint_channel(i), f"kvc:{{{tag}}}:any/key"):
            assert redis_key_slot(name.encode()) == key_slot(name.encode()) == g.slot(i)
        assert g.at_slot(g.slot(i)) == i and g.of_channel(g.hint_channel(i).encode()) == i


def test_the_tags_are_a_data_format_that_never_changes() -> None:
    # (pinned: a change here would put every existing record under a new name)
    assert [slot_tag(s) for s in (0, 1, 16, 8191, 16383)] == ["06S", "2Gx", "04b", "6xN", "6ZJ"]
    assert groups(1024).tags[:5] == ("06S", "04b", "021", "2TJ", "5n3")
    assert all(key_slot(slot_tag(s).encode()) == s for s in range(SLOTS))
    legacy = groups(LEGACY_GROUPS)  # the layout before cluster.groups
    assert legacy.tags == tuple(str(i) for i in range(16)) and legacy.feed_key(3) == "kvf:{3}"


def test_every_key_has_one_group_and_keys_spread_over_them() -> None:
    g = groups(1024)
    seen = {g.of(f"drone/{i}/state") for i in range(20_000)}
    assert len(seen) == 1024  # every group gets keys
    assert g.record_key("a/b").startswith(f"kvc:{{{g.tags[g.of('a/b')]}}}:")


@pytest.mark.parametrize("bad", [0, 8, 1000, 32768, 1.5, "16", True])
def test_a_count_that_is_not_a_power_of_two_in_range_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="power of two from 16 to 16384"):
        Groups(bad)  # type: ignore[arg-type]
    if isinstance(bad, int) and not isinstance(bad, bool):
        with pytest.raises(ConfigError, match="cluster.groups"):
            kvcomm.Config.from_mapping({"cluster": {"groups": bad}})


# ---------------------------------------------------------------- on a real cluster


@pytest.fixture
def fresh(cluster: RedisCluster) -> Iterator[RedisCluster]:
    """The cluster with no group count recorded and no data of the old layout."""
    def clean() -> None:
        s = L3Store(cluster.seeds, groups=LEGACY_GROUPS)
        s.rc.delete(META_GROUPS)
        for g in s.groups:  # (one call per key: they are in different slots)
            s.rc.delete(s.groups.seq_key(g))
        s.close()

    clean()
    yield cluster
    clean()


def test_the_first_start_records_the_count_and_another_count_is_refused(fresh: RedisCluster) -> None:
    a = L3Store(fresh.seeds, groups=1024)
    b = L3Store(fresh.seeds, groups=4096)
    try:
        assert b.check_groups() == 4096  # a reader does not record anything
        assert a.rc.get(META_GROUPS) is None
        assert a.check_groups(record=True) == 1024
        assert int(a.rc.get(META_GROUPS)) == 1024
        assert a.check_groups(record=True) == 1024  # (again: fine)
        for rec in (False, True):
            with pytest.raises(ConfigError, match=r"initialised with 1024 groups.*configured "
                               r"with 4096.*cluster.groups: 1024") as info:
                b.check_groups(record=rec)
            assert info.value.key == "cluster.groups"
        assert int(a.rc.get(META_GROUPS)) == 1024  # nothing written by the refused host
    finally:
        a.close()
        b.close()


def test_data_of_the_layout_before_cluster_groups_is_refused_under_another_count(
        fresh: RedisCluster) -> None:
    old = L3Store(fresh.seeds, groups=LEGACY_GROUPS)
    new = L3Store(fresh.seeds, groups=1024)
    try:
        old.push("legacy/k", record("v", "old-host", 1, 1))  # as a version without the count
        assert old.rc.get(META_GROUPS) is None
        with pytest.raises(ConfigError, match=r"earlier KVCOMM wrote with 16 groups.*configured "
                           r"with 1024.*cluster.groups: 16"):
            new.check_groups(record=True)
        assert old.check_groups(record=True) == 16  # the old layout goes on, recorded now
        assert old.get("legacy/k") is not None
        with pytest.raises(ConfigError, match="initialised with 16 groups"):
            new.check_groups()
    finally:
        old.close()
        new.close()


def test_a_daemon_configured_with_another_count_refuses_to_start(fresh: RedisCluster) -> None:
    cluster = fresh
    s = L3Store(cluster.seeds)
    s.rc.set(META_GROUPS, 2048)
    ns = f"td-wrong-count-{uuid.uuid4().hex[:8]}"
    try:
        with pytest.raises(ConfigError, match="initialised with 2048 groups.*configured with 1024"):
            Host(cluster, "host-wrong-count", seed=1, ns=ns)
        assert not os.path.lexists(segment_path(ns))  # (purged: not left in /dev/shm)
    finally:
        s.rc.delete(META_GROUPS)
        s.close()


def test_feed_memory_is_bounded_in_total_not_per_group(cluster: RedisCluster) -> None:
    for count, want in ((16, 100_000), (1024, 1562), (16384, FEED_MIN)):
        s = L3Store(cluster.seeds, groups=count, feed_total=1_600_000)
        assert s.feed_maxlen == want, count
        s.close()
    s = L3Store(cluster.seeds, groups=16384, feed_total=1_600_000)
    try:  # a stream is trimmed to its share (MAXLEN ~: within one stream node of it)
        g = s.groups.of("trimmed/0")
        keys = [k for k in (f"trimmed/{i}" for i in range(200_000)) if s.groups.of(k) == g][:3]
        for n in range(400):
            s.push(keys[n % 3], record(n, "h", n + 1, n + 1))
        assert FEED_MIN <= s.rc.xlen(s.groups.feed_key(g)) <= 2 * FEED_MIN
    finally:
        s.close()


def test_an_idle_daemon_costs_a_fixed_number_of_commands_whatever_the_group_count(
        fresh: RedisCluster) -> None:
    """Per-group polling would cost groups x 50 commands a second; the sweep costs the
    same few whatever the count (measured on the masters' own counters)."""
    cluster = fresh
    rates = {}
    for count in (1024, 16384):
        s = L3Store(cluster.seeds)
        s.rc.set(META_GROUPS, count)
        s.close()
        host = Host(cluster, f"idle-{count}", seed=count, cluster_keys={"groups": count})
        try:
            assert host.daemon is not None
            wait_for(lambda host=host: host.daemon.inb.sweep_next > 0, 30, "a sweep slice")  # type: ignore[union-attr]
            masters = [m for m in cluster.master_ports()]
            before = _commands(masters)
            t0 = time.monotonic()
            time.sleep(4.0)  # (a measurement over a span of time, not a wait for a condition)
            after, dt = _commands(masters), time.monotonic() - t0
            rates[count] = {k: round((after[k] - before.get(k, 0)) / dt, 1) for k in after}
        finally:
            host.close()
            s = L3Store(cluster.seeds)
            s.rc.delete(META_GROUPS)
            s.close()
    print(f"idle daemon, commands/s on the masters: {rates}")
    for count, r in rates.items():
        # 4 sweep slices a second, one script call per master a slice touches; each
        # call reads its counters with one GET each inside the script (Redis counts
        # those in total_commands_processed): the sweep rate, 1024/s by default
        # the sweep rate, 1024/s by default; and the last entry id of each group a slice
        # covers (an XREVRANGE inside the script) on the passes that check tails (one in
        # TAIL_EVERY, and every group's first after a start: a failover's reissued number)
        assert r.get("evalsha", 0) <= 16 and r.get("get", 0) <= 1100, (count, r)
        assert r.get("xrevrange", 0) <= 1100, (count, r)
        # (INFO, and the replicas' REPLCONF ACKs to their masters: once a second each)
        assert (r["total"] - r.get("get", 0) - r.get("evalsha", 0) - r.get("replconf", 0)
                - r.get("xrevrange", 0) <= 5), (count, r)


def _commands(ports: list[int]) -> dict[str, int]:
    """Commands the masters processed, in total and by name."""
    from kvcomm.devcluster.redis_cluster import _info, command

    out: dict[str, int] = {}
    for p in ports:
        out["total"] = out.get("total", 0) + int(
            _info(command(p, "INFO", "stats"))["total_commands_processed"])
        for k, v in _info(command(p, "INFO", "commandstats")).items():
            name = k.removeprefix("cmdstat_")
            calls = int(v.split(",")[0].split("=")[1])
            out[name] = out.get(name, 0) + calls
    return out
