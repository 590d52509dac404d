"""An acknowledged write is never replaced by an older version of its key (cluster mode).

The interleavings are forced, not hoped for under load: the host's L2 is lost (a reboot),
its write sequence restarts below the dots L3 holds from it (a clock set back), and the
restarted daemon meets the host's own pre-reboot records again while the agent's new,
acknowledged write of the same key is still dirty (not yet pushed):

* ``feed``: the daemon died before saving its feed cursor past its own last writes (the
  cursor is saved once a second); the restarted daemon replays those feed entries, and
  L2 holds the key (the agent's new write), so the replayed record is merged into L2 —
  in the same round that first reads the agent's write, before its window closes.
* ``refill``: the same replay comes while L2 does not hold the key yet: it is remembered
  as a skipped change; the agent's write then shows in the local feed, and the daemon
  applies the remembered record over it (the refill that protects an agent's late L3
  fill).
* ``resync``: the daemon has no saved cursors (lost): it starts with a resync, which
  re-reads from L3 every key L2 holds.

In each, the old record's vector names the host's old dots, which cover the new write's
dot (the sequence went back): by vector order alone L3's old record "dominates" the new
write. Before the fix the daemon installed it over the dirty write (clean: the write was
lost, and the push that followed was answered 'older' and marked delivered), so the
acknowledged write never reached L3 and the host served the old value.

Two defences now: the daemon's write mark in L3 (how far the host's pushed dots may go:
a new L2 moves its unacknowledged writes past it at the daemon's start), and, should the
mark be lost, L2's merge (a version naming this host's dots past its write sequence
moves the unacknowledged writes past them first). The tests below that delete the mark
exercise the second alone.

Run alone with ``.venv/bin/python -m pytest -q tests/cluster/test_holdback.py``.
"""

from __future__ import annotations

import random
import shutil
from typing import Any

import pytest

import kvcomm
from kvcomm.core import codec
from kvcomm.tiers import l2
from kvcomm.tiers.groups import groups as groups_of
from kvcomm.tiers.shm.layout import H
from tests.support.daemon_harness import Host, shared_cluster_fixture, store_fixture  # noqa: F401 (fixtures)
from tests.support.helpers import wait_for

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed")


def _l3_value(store: Any, key: str) -> object:
    rec = store.get(key)
    if rec is None or rec.tombstone:
        return None
    return codec.decode(rec.tag, rec.meta, rec.value)


@pytest.mark.parametrize("path,op", [("feed", "put"), ("refill", "put"), ("resync", "put"),
                                     ("feed", "delete")])
def test_a_replayed_own_record_never_replaces_a_newer_dirty_write(  # type: ignore[no-untyped-def]
        cluster, store, path: str, op: str) -> None:
    """The acknowledged write after the reboot (a put, or a delete) reaches L3 and stays
    in L2; the daemon did meet the host's own older record (the fault is forced)."""
    seed = random.randrange(2**32)
    print(f"seed={seed} path={path} op={op}")
    after = "after-reboot" if op == "put" else None

    def write() -> None:  # acknowledged
        if op == "put":
            h.kv.put(key, "after-reboot")
        else:  # (over a value of its own: a key not held would be looked up in L3 first)
            h.kv.put(key, "doomed")
            assert h.kv.delete(key)

    h = Host(cluster, f"hb{seed % 100000}", seed)
    key = f"hb/{seed}"
    host = h.config.node.host_id
    g = groups_of(h.config.cluster.groups).of(key)
    try:
        for i in range(10):
            h.kv.put(key, f"before-{i}")
        wait_for(lambda: _l3_value(store, key) == "before-9", 30, "L3 to have before-9")
        mark = store.feed_position(g)  # the feed cursor a daemon killed here had saved
        for i in range(10, 20):
            h.kv.put(key, f"before-{i}")
        wait_for(lambda: _l3_value(store, key) == "before-19", 30, "L3 to have before-19")
        end = store.feed_position(g)[0]
        old_dot = store.get(key).dot[1]
        assert mark[0] is not None and end is not None and end > mark[0]
        h.stop()  # (its flush saves its feed cursors: set back below, as a kill leaves them)
        store.rc.delete(f"kvn:{{{host}}}:wseq")  # no write mark (lost): the merge's net alone
        if path == "resync":
            store.rc.delete(f"kvn:{{{host}}}:cursors")
        else:
            store.save_cursors(host, {g: mark[1]}, {g: mark[0]})
        # the reboot: L2 lost, and the new L2's write sequence below the dots L3 has
        h.kv.close()
        l2.purge(h.ns)
        h.kv = kvcomm.open(config=h.config, wait_daemon=False)  # (before its daemon)
        h.kv._seg._q[H["WSEQ"]] = 0  # as if the clock had gone back years
        if path == "refill":
            h.start()
            wait_for(lambda: h.daemon is not None and h.daemon.feed_seqs.get(g) == end, 30,
                     "the restarted daemon to replay its own feed entries")
            assert h.stats.skipped_remote >= 1, "the replayed entries were not skipped"
            write()
        else:
            write()  # (dirty; then the daemon starts)
            h.start()
        wait_for(lambda: h.kv._seg.dirty_count == 0, 30, "the daemon to settle the new write")
        h.kv._l1.clear()
        assert (_l3_value(store, key), h.kv.get(key)) == (after, after), \
            "an acknowledged write was replaced by an older version of its key"
        # the fault happened: the host's old record met the dirty write in L2's merge
        assert h.daemon is not None
        if path == "feed":
            assert h.stats.pulled >= 1, h.stats
        elif path == "refill":
            assert h.stats.extra.get("refills", 0) >= 1, h.stats
        assert h.daemon.kv.counters.get("lost_dots", 0) >= 1, \
            "the old record never met the dirty write"
        assert h.kv._seg.write_sequence > old_dot  # past every dot L3 has of the host
    finally:
        h.close()


def test_lost_dots_met_on_one_key_do_not_hide_them_on_another(cluster, store) -> None:  # type: ignore[no-untyped-def]
    """Two keys written after the reboot, both covered by the host's old dots. Meeting
    key a's old record raises the host's write sequence past a's old dots — past key b's
    too (b was written before a, in the earlier life). b's old record, met next (the
    start's resync re-reads held keys in order), no longer looks like an earlier life's
    by the write sequence; b's new, dirty write must not be replaced by it all the same."""
    seed = random.randrange(2**32)
    print(f"seed={seed}")
    h = Host(cluster, f"hx{seed % 100000}", seed)
    a, b = f"hx/{seed}/a", f"hx/{seed}/b"
    host = h.config.node.host_id
    try:
        h.kv.put(b, "b-old")  # b's old dot below a's
        h.kv.put(a, "a-old")
        wait_for(lambda: (_l3_value(store, a), _l3_value(store, b)) == ("a-old", "b-old"), 30,
                 "L3 to have both old values")
        h.stop()
        store.rc.delete(f"kvn:{{{host}}}:cursors")  # the restarted daemon starts with a resync
        store.rc.delete(f"kvn:{{{host}}}:wseq")  # no write mark (lost): the merge's net alone
        h.kv.close()
        l2.purge(h.ns)
        h.kv = kvcomm.open(config=h.config, wait_daemon=False)  # (before its daemon)
        h.kv._seg._q[H["WSEQ"]] = 0  # as if the clock had gone back years
        h.kv.put(b, "b-new")  # acknowledged, dirty
        h.kv.put(a, "a-new")
        h.start()
        wait_for(lambda: h.kv._seg.dirty_count == 0, 30, "the daemon to settle the new writes")
        h.kv._l1.clear()
        got = {k: (_l3_value(store, k), h.kv.get(k)) for k in (a, b)}
        assert got == {a: ("a-new", "a-new"), b: ("b-new", "b-new")}, \
            "an acknowledged write was replaced by an older version of its key"
        assert h.daemon is not None and h.daemon.kv.counters.get("lost_dots", 0) >= 1
    finally:
        h.close()


def test_meeting_lost_dots_moves_every_unacknowledged_write_past_them(cluster) -> None:  # type: ignore[no-untyped-def]
    """L2's side alone (no daemon: every write stays dirty). A version naming the host's
    old dots — met by a merge (the feed, a fill) or by a push's answer (the rebase) —
    moves every dirty write of the host with a dot at most that far past it, value and
    HLC kept, and raises the sequence; a clean record, L3's already, is left alone."""
    from kvcomm.core.versions import Version
    from tests.support.daemon_harness import host_config

    seed = random.randrange(2**32)
    print(f"seed={seed}")
    host = f"hu{seed % 100000}"
    cfg = host_config(cluster, host, f"hu-{seed}")
    kv = kvcomm.open(config=cfg, wait_daemon=False)  # (no daemon)
    try:
        kv._seg._q[H["WSEQ"]] = 0  # a new L2 below the host's old dots
        for k in ("a", "b", "c"):
            kv.put(k, f"{k}-new")
        kv.merge_remote("clean", "theirs", Version((("other", 1),), 5))
        before = {k: kv.get_item(k).version for k in ("a", "b", "c", "clean")}  # type: ignore[union-attr]
        # a merge of a's old record: a written again over it, b and c moved past it
        kv.merge_remote("a", "a-old", Version(((host, 1000),), 1 << 50))
        after = {k: kv.get_item(k) for k in ("a", "b", "c", "clean")}
        assert {k: it.value for k, it in after.items() if it} == {
            "a": "a-new", "b": "b-new", "c": "c-new", "clean": "theirs"}
        for k in ("b", "c"):
            v = after[k].version  # type: ignore[union-attr]
            assert dict(v.vector)[host] > 1000 and v.hlc == before[k].hlc, (k, v, before[k])
        assert dict(after["a"].version.vector)[host] > 1000  # type: ignore[union-attr]
        assert after["clean"].version == before["clean"]  # type: ignore[union-attr]
        assert kv._seg.write_sequence > 1000 and kv._seg.dirty_count == 3
        assert kv.counters["lost_dots"] == 3
        # a push's answer (the daemon's rebase) does the same for dots further still
        assert kv._restamp("b", Version(((host, 5000),), 1 << 50))
        assert all(dict(kv.get_item(k).version.vector)[host] > 5000  # type: ignore[union-attr]
                   for k in ("a", "b", "c"))
        assert kv.get("a") == "a-new" and kv._seg.dirty_count == 3
        # a clean record is not a write of this host's waiting for L3: nothing to restamp
        assert not kv._restamp("clean", Version(((host, 9000),), 1 << 50))
    finally:
        kv.close()
        l2.purge(cfg.node.namespace)


def test_old_dots_below_the_write_sequence_do_not_cover_a_new_write(cluster, store) -> None:  # type: ignore[no-untyped-def]
    """The new L2's sequence, started below the host's old dots, may pass one of them
    before the key's old record is met (many writes since the reboot): that dot then
    looks like one of this life. The daemon's write mark in L3 (how far the host's
    pushed dots may go) moves the new L2's unacknowledged writes past every old dot at
    start, before any record of L3 is merged in."""
    seed = random.randrange(2**32)
    print(f"seed={seed}")
    h = Host(cluster, f"hm{seed % 100000}", seed)
    key = f"hm/{seed}"
    host = h.config.node.host_id
    try:
        h.kv.put(key, "old")
        wait_for(lambda: _l3_value(store, key) == "old", 30, "L3 to have the old value")
        old_dot = store.get(key).dot[1]
        assert store.load_write_mark(host) >= old_dot
        h.stop()
        store.rc.delete(f"kvn:{{{host}}}:cursors")  # the restarted daemon starts with a resync
        h.kv.close()
        l2.purge(h.ns)
        h.kv = kvcomm.open(config=h.config, wait_daemon=False)  # (before its daemon)
        h.kv._seg._q[H["WSEQ"]] = 0  # as if the clock had gone back years
        h.kv.put(key, "new")  # acknowledged, dirty: its dot is 1
        h.kv._seg._q[H["WSEQ"]] = old_dot + 10  # as if many writes had been made since
        h.start()
        wait_for(lambda: h.kv._seg.dirty_count == 0, 30, "the daemon to settle the new write")
        h.kv._l1.clear()
        assert (_l3_value(store, key), h.kv.get(key)) == ("new", "new"), \
            "an acknowledged write was replaced by an older version of its key"
        assert h.stats.extra.get("lost_dots_moved", 0) == 1
    finally:
        h.close()
