"""REVIEW 7 (adversarial review of issue 7): reproductions of findings, on real processes.

Every test in this module is a reproduction that FAILS on the reviewed commit (0bbf05d)
for the reason its docstring gives; none of them is a fix. Run them alone with

    .venv/bin/python -m pytest -q -p no:randomly tests/test_review7.py

Every wait has a deadline; randomised tests print their seed.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

import kvcomm
from kvcomm.tiers import l2
from kvcomm.tiers.l2 import SLOT, SLOT_WORDS, key_hash
from tests.support.daemon_harness import shared_cluster_fixture, store_fixture  # noqa: F401 (fixtures)
from tests.support.helpers import wait_for

CTX = mp.get_context("fork")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(**cache: object) -> kvcomm.Config:
    return kvcomm.Config.from_mapping({"cache": {"l2_size": "16MB", "watch_buffer": 256, **cache}})


@pytest.fixture
def name() -> Iterator[str]:
    n = f"r7-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield n
    l2.purge(n)


# ---------------------------------------------------------------------------------------
# F1. A zero-copy view changes under its holder when a process in another PID namespace
#     (a container sharing /dev/shm, which the README says is supported) writes.
# ---------------------------------------------------------------------------------------

_PIDNS_WRITER = textwrap.dedent("""
    import sys, numpy as np, kvcomm
    cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": "16MB", "watch_buffer": 256}})
    kv = kvcomm.open(sys.argv[1], config=cfg)
    for i in range(200):   # an ordinary writer: its sweep frees the 'dead' pin, then reuses the block
        kv.put(f"fill/{i}", np.full(1 << 16, 0xEE, dtype=np.uint8))
    kv.close()
""")


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="needs unshare(1) and root for a PID namespace")
def test_review7_view_changes_when_a_writer_runs_in_another_pid_namespace(name: str) -> None:
    """README: 'the view never changes under its holder' and the lock section says
    processes in another PID namespace sharing /dev/shm are fine. But pins are owned by
    pid (l2.py _sweep_released / pid_alive, _l2core.c Core_sweep): a writer in another
    PID namespace sees this process's pid as dead, drops its pin, frees the parked block
    and reuses it, so the holder's read-only view now shows another key's bytes."""
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                           capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"unshare not permitted here: {probe.stderr!r}")
    with kvcomm.open(name, config=_cfg()) as kv:
        kv.put("arr", np.full(1 << 16, 7, dtype=np.uint8))
        view = kv.get("arr")
        kv.put("arr", np.full(1 << 16, 9, dtype=np.uint8))  # parks the view's block
        assert kv._seg.info()["pinned_deferred_blocks"] == 1
        r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable,
                            "-c", _PIDNS_WRITER, name], capture_output=True, text=True,
                           timeout=120, cwd=REPO)
        assert r.returncode == 0, r.stderr[-2000:]
        assert bool((view == 7).all()), (
            f"the view changed under its holder: now holds {np.unique(view)[:4]}")


# ---------------------------------------------------------------------------------------
# F2. A batch that raises ("Nothing was written") was partly applied.
# ---------------------------------------------------------------------------------------

def test_review7_failed_batch_delete_then_reput_is_partly_applied(name: str) -> None:
    """Embedded mode, batch [delete k, put k, put y]. The plan lets `put k` reuse k's slot
    and claims for new key y the only free slot F of y's probe window; at publish time
    (_l2core.c publish, planned=0 for n > 1) `put k` re-probes and takes F (the first
    free slot in k's window), so y finds no slot: set_corrupt('a planned slot was taken')
    mid-publish. l2.py apply() then recovers and retries the whole batch, which now
    fails with ST_SLOT_FULL (y's window is full of pinned views) and raises Unavailable
    '... Nothing was written' — yet k already holds the batch's new value."""
    kv = kvcomm.open(name, config=_cfg(l2_size="2MB", watch_buffer=64, l1_size=0))
    try:
        n = kv._seg.layout.n_slots
        mask = n - 1

        def home(k: str) -> int:
            return key_hash(k.encode()) & mask  # (always odd: key_hash sets bit 0)

        y_home = n - 21  # y's window: slots n-21 .. n-1, 0 .. 10
        fillers = list(itertools.islice(
            (f"f{i}" for i in itertools.count() if home(f"f{i}") == y_home), 32))
        k_key = next(f"k{i}" for i in itertools.count() if home(f"k{i}") == 1)
        y_key = next(f"y{i}" for i in itertools.count() if home(f"y{i}") == y_home)
        arr = np.arange(4096, dtype=np.uint8)
        for k in fillers:  # fill y's whole window, in order
            kv.put(k, arr)
        kv.put(k_key, "old")  # k's window 1..32: slots 1..10 are taken, k lands in 11
        views = [kv.get(k) for k in fillers]  # pinned: never evictable
        slot_word = kv._seg.layout.slots_off // 8 + 5 * SLOT_WORDS
        victim = fillers[26]  # the filler in slot 5
        assert kv._q[slot_word + SLOT["HASH"]] == key_hash(victim.encode())
        del views[26]
        kv.delete(victim)  # slot 5 becomes a tombstone (slot 6 is used)
        recoveries = kv._seg.info()["recoveries"]
        try:
            with kv.batch() as b:
                b.delete(k_key)
                b.put(k_key, "NEW")
                b.put(y_key, "y")
        except kvcomm.KVCommError as exc:  # all or nothing: then nothing
            print("batch raised:", type(exc).__name__, exc)
            assert kv.get(y_key) is None
            assert kv.get(k_key) == "old", "the batch raised, yet its put of k was applied"
        else:  # (the batch fits: y takes the slot the delete of the filler freed)
            assert kv.get(k_key) == "NEW" and kv.get(y_key) == "y"
        assert kv._seg.info()["recoveries"] == recoveries  # no spurious repair
        assert kv._seg.check() == []
        del views
    finally:
        kv.close()


# ---------------------------------------------------------------------------------------
# F3. A validator that only READS a large array is reported as a write.
# ---------------------------------------------------------------------------------------

def test_review7_validator_may_read_a_large_array(name: str) -> None:
    """register_validator: 'It may read from KVCOMM but not write'. Reading an array of
    zero_copy_threshold bytes or more takes a pin, which takes the writer lock
    (l2.py L2Segment.pin -> _lock -> take_lock), so the read raises InvalidArgument
    ('called to write from inside a validator') and the put is rejected."""
    with kvcomm.open(name, config=_cfg()) as kv:
        kv.put("map/grid", np.zeros(1 << 14, dtype=np.uint8))

        def cell_free(key: str, old: object, new: object) -> None:
            if kv.get("map/grid")[int(new)] != 0:
                raise ValueError("occupied")

        kv.register_validator("shelf/", cell_free)
        kv.put("shelf/A1", 3)
        assert kv.get("shelf/A1") == 3


# ---------------------------------------------------------------------------------------
# F4. Empty multi-dimensional numpy arrays leak TypeError.
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(0, 3), (3, 0), (2, 0, 2)])
def test_review7_empty_multidimensional_array(name: str, shape: tuple[int, ...]) -> None:
    """np.zeros((0, 3)) (e.g. 'no detections this frame') is a numeric array: it must be
    stored, or refused with a KVCommError. codec.encode (core/codec.py:109,
    memoryview(arr).cast('B')) raises TypeError 'cannot cast view with zeros in shape'."""
    with kvcomm.open(name, config=_cfg()) as kv:
        try:
            kv.put("empty", np.zeros(shape))
        except kvcomm.KVCommError:
            return
        assert kv.get("empty").shape == shape


# ---------------------------------------------------------------------------------------
# F5. Purge while a writer holds the lock for more than a second: old clients keep using
#     a ghost segment forever (reads and writes), split from the new one.
# ---------------------------------------------------------------------------------------

def _hold_lock_then_stop(name: str, ready: mp.synchronize.Event) -> None:  # type: ignore[name-defined]
    kv = kvcomm.open(name, config=_cfg(lock_timeout="3s"))
    kv._seg._core.lock(5.0)  # as a writer mid-put that is then stopped (SIGSTOP, a debugger)
    ready.set()
    os.kill(os.getpid(), signal.SIGSTOP)
    kv._seg._core.unlock()
    time.sleep(60)


def test_review7_purge_while_a_stopped_process_holds_the_lock(name: str) -> None:
    """README: `kvcomm purge` 'marks the segment purged once its file is gone: every
    reader, L1 hits included, then gets SegmentError'. l2.purge unlinks the file, then
    mark_purged takes the lock with a 1 s timeout; Unavailable is swallowed (l2.py purge,
    'a lock held by a stopped process, say'), so the old segment is never marked. Its
    clients — and every later kvcomm.open() in the same process (_Shared.acquire reuses
    the unmarked mapping) — keep reading and writing a segment no new process sees."""
    cfg = _cfg(lock_timeout="3s")
    kv = kvcomm.open(name, config=cfg)
    kv.put("k", "old")
    ready = CTX.Event()
    p = CTX.Process(target=_hold_lock_then_stop, args=(name, ready))
    p.start()
    try:
        assert ready.wait(20)
        r = subprocess.run([sys.executable, "-m", "kvcomm", "purge", "--name", name],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
        assert r.returncode == 0, r.stderr
        os.kill(p.pid, signal.SIGCONT)  # the holder goes on and releases the lock
        wait_for(lambda: kv._seg.lock_owner() == 0, 10, "the lock to be released")
        with pytest.raises(kvcomm.SegmentError):
            kv.get("k")  # observed: 'old', from a segment that no longer exists
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        kv.close()


# ---------------------------------------------------------------------------------------
# Cluster mode (real Redis Cluster, in-process daemons: tests/support/daemon_harness.py)
# ---------------------------------------------------------------------------------------

_redis = pytest.mark.skipif(shutil.which("redis-server") is None,
                            reason="redis-server is not installed")


def _l3_value(store: object, key: str) -> object:
    rec = store.get(key)  # type: ignore[attr-defined]
    if rec is None or rec.tombstone:
        return None
    return kvcomm.core.codec.decode(rec.tag, rec.meta, rec.value)


@_redis
def test_review7_writes_after_a_host_lost_its_l2_are_undone(cluster, store) -> None:  # type: ignore[no-untyped-def]
    """F6 (data loss). The host's write counter (the dot of every local write) lives only
    in the L2 header (H_WSEQ). When the host's L2 is lost — a reboot, /dev/shm gone, or
    `kvcomm purge` — it restarts at 1 while L3 still holds the host's old dots. A new,
    acknowledged put of a key the host wrote before carries the dot (host, 1), which L3's
    vector (host, 200) covers: the Lua merge answers 'older', the daemon writes L3's old
    record back into L2 (daemon.py _handle_result -> _apply), and the write is undone on
    the host and never reaches the cluster. The README promises only that writes not yet
    in L3 *at the crash* are lost."""
    from tests.support.daemon_harness import Host

    seed = random.randrange(2**32)
    print(f"seed={seed}")
    h = Host(cluster, f"rb{seed % 10000}", seed)
    try:
        for i in range(200):
            h.kv.put("rb/k", f"before-{i}")
        wait_for(lambda: _l3_value(store, "rb/k") == "before-199", 20, "L3 to have before-199")
        # the host reboots: daemon gone, its shared memory gone, daemon started again
        h.stop()
        h.kv.close()
        l2.purge(h.ns)
        h.start()
        h.kv = kvcomm.open(config=h.config)
        h.kv.put("rb/k", "after-reboot")  # acknowledged
        wait_for(lambda: _l3_value(store, "rb/k") == "after-reboot", 10,
                 "L3 to hold the write acknowledged after the host's L2 was lost (undone?)")
        h.kv._l1.clear()
        assert (_l3_value(store, "rb/k"), h.kv.get("rb/k")) == ("after-reboot", "after-reboot"), \
            "an acknowledged write made after the host's L2 was lost was undone"
    finally:
        h.close()


@_redis
def test_a_host_whose_write_sequence_went_backwards_is_rebased(cluster, store) -> None:  # type: ignore[no-untyped-def]
    """The safety net under the time-based write sequence: a host's new L2 whose sequence
    starts below the dots L3 has from it (a clock set back before the reboot) — the daemon
    sees L3 answer 'older' with the host's own newer entry, raises the sequence and writes
    the local record again over L3's version; nothing acknowledged is undone.

    Which of two ways protects the write depends on timing, and either must: the push's
    answer (``rebased``), or — when the restarted daemon meets one of the host's own
    pre-reboot records first (it replays its feed entries the old daemon had not read
    yet, which is likely under load) — L2's merge (``lost_dots``). Until both did, the
    second way undid the write (tests/cluster/test_holdback.py forces it), and this test timed
    out under load waiting for the write in L3."""
    from kvcomm.tiers.shm.layout import H
    from tests.support.daemon_harness import Host

    seed = random.randrange(2**32)
    print(f"seed={seed}")
    h = Host(cluster, f"rs{seed % 10000}", seed)
    try:
        for i in range(50):
            h.kv.put("rs/k", f"before-{i}")
        wait_for(lambda: _l3_value(store, "rs/k") == "before-49", 60, "L3 to have before-49")
        h.stop()
        h.kv.close()
        l2.purge(h.ns)
        h.start()
        h.kv = kvcomm.open(config=h.config)
        h.kv._seg._q[H["WSEQ"]] = 0  # as if the clock had gone back years
        h.kv.put("rs/k", "after-reboot")
        # (not L3's value: L3 holds the write before the daemon has taken L3's answer
        # and counted it; once the write is clean here, the daemon is done with it)
        wait_for(lambda: h.kv._seg.dirty_count == 0, 60, "the daemon to settle the new write")
        h.kv._l1.clear()
        assert (_l3_value(store, "rs/k"), h.kv.get("rs/k")) == ("after-reboot", "after-reboot"), \
            "an acknowledged write was undone by the host's own older record"
        assert h.daemon is not None
        protected = (h.daemon.stats.extra.get("rebased", 0), h.daemon.kv.counters["lost_dots"])
        print(f"rebased, lost_dots = {protected}")
        assert sum(protected) >= 1, "neither the rebase nor the merge met the lost dots"
    finally:
        h.close()


@_redis
def test_review7_a_host_whose_l2_cannot_hold_a_remote_value_serves_the_old_one(cluster, store) -> None:  # type: ignore[no-untyped-def]
    """F7 (stale forever). Hosts may have different cache.l2_size. A key held by a host
    with a 2 MB L2 is rewritten elsewhere with a 1.5 MB value: applying it raises
    ValueTooLarge, the daemon sets it aside (daemon.py _pull_entry -> _guarded) and the
    host keeps answering the old value from L2 forever, with no error, although L3 and
    every other host moved on ('Then other hosts converge'). Expected: the stale copy is
    dropped (the read then goes to L3 and raises ValueTooLarge), or the read raises.
    (tests/cluster/test_daemon_input.py asserts the current behaviour: 'the host keeps what it
    had'.)"""
    from tests.support.daemon_harness import Host, record

    def hold(h: Host, key: str, value: object) -> None:
        wait_for(lambda: h.kv.get(key) == value, 10, f"the host to hold {key}")

    seed = random.randrange(2**32)
    print(f"seed={seed}")
    small = Host(cluster, f"sm{seed % 10000}", seed, l2_size="2MB", watch_buffer=1024)
    try:
        out = store.push("big/k", record("v1", "host-a", 1, 1))
        assert out.outcome == "new"
        hold(small, "big/k", "v1")
        big = record(b"x" * (3 << 19), "host-a", 2, 2)  # 1.5 MiB: fits a 16 MB host
        assert store.push("big/k", big).outcome == "newer"
        wait_for(lambda: small.stats.quarantined >= 1, 10, "the record to be set aside")
        time.sleep(0.5)
        small.kv._l1.clear()
        try:
            got = small.kv.get("big/k")
        except kvcomm.KVCommError:
            return
        assert got != "v1", "the host serves a value L3 replaced, with no error, forever"
    finally:
        small.close()


# ---------------------------------------------------------------------------------------
# F8. A watcher of a purged namespace never learns it: it waits on the old ring forever.
# ---------------------------------------------------------------------------------------

def test_review7_watch_notices_a_purge(name: str) -> None:
    """Issue item 5: 'Every read path ... notices a purged or replaced segment: it returns
    the new segment's data or raises SegmentError.' Client._watch (_client/watch.py) loops on
    seg.feed_read, which never looks at the header's STATE: after `kvcomm purge` and new
    writes in the new segment, a watcher sees nothing and (timeout=None) waits forever;
    here, with a timeout, it just ends as if all were quiet."""
    import threading

    cfg = _cfg()
    kv = kvcomm.open(name, config=cfg)
    got: list[object] = []

    def watcher() -> None:
        try:
            for ev in kv.watch("", timeout=3.0):
                got.append(ev.key)
            got.append("ended quietly")
        except kvcomm.SegmentError as exc:
            got.append(exc)

    t = threading.Thread(target=watcher, daemon=True)
    t.start()
    try:
        time.sleep(0.2)
        kv.put("before", 1)
        wait_for(lambda: "before" in got, 10, "the watcher to see the first put")
        assert l2.purge(name)
        code = ("import kvcomm, sys; kv = kvcomm.open(sys.argv[1], config=kvcomm.Config."
                "from_mapping({'cache': {'l2_size': '16MB', 'watch_buffer': 256}}));"
                "[kv.put('after', i) for i in range(5)]")
        subprocess.run([sys.executable, "-c", code, name], check=True, timeout=60, cwd=REPO)
        t.join(15)
        assert not t.is_alive()
        assert "after" in got or isinstance(got[-1], kvcomm.SegmentError), got
    finally:
        kv.close()


# ---------------------------------------------------------------------------------------
# F9. A segment file truncated while mapped kills its readers with SIGBUS.
# ---------------------------------------------------------------------------------------

_TRUNC = textwrap.dedent("""
    import os, sys, kvcomm
    kv = kvcomm.open(sys.argv[1], config=kvcomm.Config.from_mapping(
        {"cache": {"l2_size": "8MB", "watch_buffer": 64, "l1_size": 0}}))
    for i in range(100):
        kv.put(f"k{i}", b"x" * 1000)
    os.truncate(kv._seg.path, 4096)   # another process (same user) shrinks the file
    for op in (lambda: kv.get("k50"), lambda: kv.put("k1", b"y"), lambda: kv.keys(),
               lambda: kv.stats(), lambda: kv.delete("k2"), lambda: kv.get("k50")):
        try:
            op()
            print("ok")
        except kvcomm.KVCommError as exc:
            print("KVCommError", exc)
    kv.close()
""")


def test_review7_truncated_segment_never_kills_the_reader(name: str) -> None:
    """README: a corrupt segment is 'repaired by the next writer, or SegmentError: never
    a crash of the reading process'. A file shrunk under the mapping (truncate, a
    cleanup script) makes the first read fault: the process dies of SIGBUS. Nothing
    checks st_size against the mapping, and no SIGBUS is turned into SegmentError."""
    r = subprocess.run([sys.executable, "-c", _TRUNC, name], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == 0, f"reader died with status {r.returncode} ({r.stderr[-300:]!r})"
    assert "truncated" in r.stdout, r.stdout


# ---------------------------------------------------------------------------------------
# F10. The key filter ignores cache.l2_dir: it always lives in /dev/shm.
# ---------------------------------------------------------------------------------------

@_redis
def test_review7_key_filter_lives_in_l2_dir(cluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """cache.l2_dir is 'where segments live (a tmpfs; Docker's is 64MB: --shm-size)'.
    The daemon's key filter is always /dev/shm/kvcomm.<namespace>.keys
    (tiers/keyfilter.py filter_path uses SHM_DIR): two deployments that share a
    namespace name but not an l2_dir (two dev clusters, two containers sharing the
    host's /dev/shm) use and rename each other's filter, so agents answer 'absent' for
    keys of the other cluster; `kvcomm purge --name X` (any l2_dir) deletes it."""
    from tests.support.daemon_harness import Host

    d = tmp_path / "shm"
    d.mkdir()
    seed = random.randrange(2**32)
    h = Host(cluster, f"kf{seed % 10000}", seed, l2_dir=str(d))
    try:
        assert os.path.exists(d / f"kvcomm.{h.ns}"), os.listdir(d)
        assert os.path.exists(d / f"kvcomm.{h.ns}.keys"), (
            f"the key filter is not in l2_dir; /dev/shm has it: "
            f"{os.path.exists(f'/dev/shm/kvcomm.{h.ns}.keys')}")
    finally:
        h.stop()
        h.kv.close()
        l2.purge(h.ns, str(d))


# ---------------------------------------------------------------------------------------
# F11. Read-fill race: an L2 fill from L3 that lands after the daemon skipped the newer
#      feed entry leaves the host serving the old value forever.
# ---------------------------------------------------------------------------------------

@_redis
def test_review7_l3_fill_racing_the_feed_serves_a_stale_value_forever(cluster, store) -> None:  # type: ignore[no-untyped-def]
    """An agent misses L2 and GETs key k from L3 (v1). Before it writes v1 into L2
    (_client/cluster_read.py _get_l3 -> _merge), another host writes v2; this host's daemon reads the
    feed entry for v2, finds k not held here and skips it (daemon.py _pull_entry:
    'not held here: the next read goes to L3'). The agent's fill then lands: L2 holds v1,
    clean, and nothing will ever refresh it (no later feed entry, no resync: the group's
    sequence numbers have no gap). The window is the agent's GET round trip plus the fill:
    milliseconds on a loaded host, and the daemon polls every 20 ms. The hook below only
    widens that window in the agent (no mock of the product's logic)."""
    from tests.support.daemon_harness import Host, remote_put

    seed = random.randrange(2**32)
    print(f"seed={seed}")
    h = Host(cluster, f"rf{seed % 10000}", seed)
    try:
        remote_put(store, "race/k", "v1", "host-a", 1)
        remote_put(store, "race/open", "x", "host-a", 1)
        # a read that goes to L3 opens the agent's L3 connection
        wait_for(lambda: h.kv.get("race/open") == "x" and h.kv._l3 is not None, 10,
                 "the agent's L3 connection")
        real_get = h.kv._l3.get

        def slow_get(key: str):  # type: ignore[no-untyped-def]
            rec = real_get(key)
            if key == "race/k":  # the agent is descheduled right after its GET...
                before = h.stats.skipped_remote
                remote_put(store, "race/k", "v2", "host-a", 2)  # ...another host writes
                wait_for(lambda: h.stats.skipped_remote > before, 10,
                         "the daemon to skip the entry (k not held here)")
            return rec

        h.kv._l3.get = slow_get
        assert h.kv.get("race/k") == "v1"  # fine: v1 was current when it was read
        h.kv._l3.get = real_get
        assert _l3_value(store, "race/k") == "v2"
        wait_for(lambda: h.kv.get("race/k") == "v2", 20, "the host to serve v2, which L3 has "
                 "(it serves v1 forever?)")
    finally:
        h.close()


# ---------------------------------------------------------------------------------------
# F12. A process stopped while holding the lock makes every large-array READ on the host
#      wait cache.lock_timeout and fail, although README says other slots stay readable.
# ---------------------------------------------------------------------------------------

def test_review7_arrays_stay_readable_while_a_writer_is_stopped(name: str) -> None:
    """README, embedded mode: 'a process stopped with SIGSTOP (other writers get
    Unavailable after cache.lock_timeout, other slots stay readable; nothing is lost)'.
    A zero-copy read pins its block under the writer lock (l2.py L2Segment.pin), so with
    the holder stopped, get() of any array >= network.zero_copy_threshold (4 KiB) waits
    lock_timeout and raises Unavailable — readers of camera frames or maps stall with the
    writers. (Falling back to a copy, as when the pin table is full, would keep them
    readable.)"""
    cfg = _cfg(lock_timeout="1s")
    with kvcomm.open(name, config=cfg) as kv:
        kv.put("frame", np.arange(1 << 12, dtype=np.float64))
        ready = CTX.Event()
        p = CTX.Process(target=_hold_lock_then_stop, args=(name, ready))
        p.start()
        try:
            assert ready.wait(20)
            wait_for(lambda: kv._seg.lock_owner() == p.pid, 10, "the child to hold the lock")
            kv._l1.clear()
            t0 = time.monotonic()
            frame = kv.get("frame")  # observed: Unavailable after lock_timeout
            assert frame is not None and frame[5] == 5.0
            assert time.monotonic() - t0 < 0.5
        finally:
            os.kill(p.pid, signal.SIGKILL)
            p.join(10)


def test_review7_keys_with_a_non_str_prefix(name: str) -> None:
    """F13 (wrong error). keys(5) leaks TypeError from str.startswith
    (_client/client.py Client.keys); every other entry point raises InvalidKey for a non-str
    prefix (watch, register_validator)."""
    with kvcomm.open(name, config=_cfg()) as kv:
        kv.put("a", 1)
        with pytest.raises(kvcomm.KVCommError):
            kv.keys(5)  # type: ignore[arg-type]
