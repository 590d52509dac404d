"""What other processes do to a segment never breaks a reader: a writer in another PID
namespace, one stopped holding the writer lock, a purge, a truncated file."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import kvcomm
from kvcomm.tiers import l2
from tests.support import ROOT
from tests.support.daemon_harness import shared_cluster_fixture, store_fixture  # noqa: F401 (fixtures)
from tests.support.helpers import wait_for

CTX = mp.get_context("fork")


REPO = str(ROOT)


def _cfg(**cache: object) -> kvcomm.Config:
    return kvcomm.Config.from_mapping({"cache": {"l2_size": "16MB", "watch_buffer": 256, **cache}})


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
def test_view_changes_when_a_writer_runs_in_another_pid_namespace(name: str) -> None:
    """README: 'the view never changes under its holder' and the lock section says
    processes in another PID namespace sharing /dev/shm are fine. But pins are owned by
    pid (l2.py _sweep_released / pid_alive, _l2core.c Core_sweep): a writer in another
    PID namespace sees this process's pid as dead, drops its pin, frees the parked block
    and reuses it, so the holder's read-only view now shows another key's bytes.
    (found in review 7: embedded and cluster mode on real processes)"""
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


def test_purge_while_a_stopped_process_holds_the_lock(name: str) -> None:
    """README: `kvcomm purge` 'marks the segment purged once its file is gone: every
    reader, L1 hits included, then gets SegmentError'. l2.purge unlinks the file, then
    mark_purged takes the lock with a 1 s timeout; Unavailable is swallowed (l2.py purge,
    'a lock held by a stopped process, say'), so the old segment is never marked. Its
    clients — and every later kvcomm.open() in the same process (_Shared.acquire reuses
    the unmarked mapping) — keep reading and writing a segment no new process sees.
    (found in review 7: embedded and cluster mode on real processes)"""
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
# F8. A watcher of a purged namespace never learns it: it waits on the old ring forever.
# ---------------------------------------------------------------------------------------

def test_watch_notices_a_purge(name: str) -> None:
    """Issue item 5: 'Every read path ... notices a purged or replaced segment: it returns
    the new segment's data or raises SegmentError.' Client._watch (_client/watch.py) loops on
    seg.feed_read, which never looks at the header's STATE: after `kvcomm purge` and new
    writes in the new segment, a watcher sees nothing and (timeout=None) waits forever;
    here, with a timeout, it just ends as if all were quiet.
    (found in review 7: embedded and cluster mode on real processes)"""
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


def test_truncated_segment_never_kills_the_reader(name: str) -> None:
    """README: a corrupt segment is 'repaired by the next writer, or SegmentError: never
    a crash of the reading process'. A file shrunk under the mapping (truncate, a
    cleanup script) makes the first read fault: the process dies of SIGBUS. Nothing
    checks st_size against the mapping, and no SIGBUS is turned into SegmentError.
    (found in review 7: embedded and cluster mode on real processes)"""
    r = subprocess.run([sys.executable, "-c", _TRUNC, name], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == 0, f"reader died with status {r.returncode} ({r.stderr[-300:]!r})"
    assert "truncated" in r.stdout, r.stdout


# ---------------------------------------------------------------------------------------
# F12. A process stopped while holding the lock makes every large-array READ on the host
#      wait cache.lock_timeout and fail, although README says other slots stay readable.
# ---------------------------------------------------------------------------------------

def test_arrays_stay_readable_while_a_writer_is_stopped(name: str) -> None:
    """README, embedded mode: 'a process stopped with SIGSTOP (other writers get
    Unavailable after cache.lock_timeout, other slots stay readable; nothing is lost)'.
    A zero-copy read pins its block under the writer lock (l2.py L2Segment.pin), so with
    the holder stopped, get() of any array >= network.zero_copy_threshold (4 KiB) waits
    lock_timeout and raises Unavailable — readers of camera frames or maps stall with the
    writers. (Falling back to a copy, as when the pin table is full, would keep them
    readable.)
    (found in review 7: embedded and cluster mode on real processes)"""
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
