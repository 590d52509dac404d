"""The vector index file at its edges: closed twice, written after close, a child forked
during a write, a mutex whose holder vanished, writers in two PID namespaces, a corrupt
key table."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

import kvcomm
from kvcomm import _l2core
from kvcomm.tiers import vectors
from kvcomm.tiers.shm import segment  # noqa: F401  (C raises kvcomm's errors once imported)
from kvcomm.tiers.vectors import VectorFile
from tests.support.helpers import proc_state, proc_syscall, process_in, wait_for

np = pytest.importorskip("numpy")
pytestmark = pytest.mark.multiprocess
CTX = mp.get_context("fork")
ROW = np.array([1, 0, 0, 0], dtype="<f4").tobytes()


@pytest.fixture
def vf() -> Iterator[VectorFile]:
    d = tempfile.mkdtemp(dir="/dev/shm", prefix="kvcomm-test-adv3-")
    f = VectorFile.open(np, "adv3", "0123456789abcdef", 4, 8, 32, 0o600, d)
    yield f
    try:
        f.close()
    except Exception:
        pass
    for n in os.listdir(d):
        os.unlink(os.path.join(d, n))
    os.rmdir(d)


def test_closing_a_vector_file_twice_closes_no_other_file(vf: VectorFile) -> None:
    assert vf.update(b"k", lambda: (5, [ROW]), lambda _k: None)
    vf.close()
    r, w = os.pipe()
    try:
        vf.close()
        os.fstat(r)  # (EBADF when the second close took the pipe's fd)
    finally:
        for fd in (r, w):
            try:
                os.close(fd)
            except OSError:
                pass


def test_a_write_after_close_raises_a_kvcomm_error(vf: VectorFile) -> None:
    vf.close()
    with pytest.raises(kvcomm.KVCommError):
        vf.update(b"k", lambda: (5, [ROW]), lambda _k: None)


def _child_writes(vf: VectorFile) -> None:
    vf.update(b"child", lambda: (7, [ROW]), lambda _k: None)
    os._exit(0)


def test_a_child_forked_while_a_thread_writes_can_write(vf: VectorFile) -> None:
    inside, go = threading.Event(), threading.Event()

    def change() -> tuple[int, list[bytes]]:
        inside.set()
        assert go.wait(60)
        return 5, [ROW]

    t = threading.Thread(target=vf.update, args=(b"parent", change, lambda _k: None))
    t.start()
    assert inside.wait(60)
    p = CTX.Process(target=_child_writes, args=(vf,))
    p.start()
    go.set()
    t.join(60)
    p.join(20)  # (the parent's thread has released the mutex: the child's write is quick)
    alive = p.is_alive()
    if alive:
        p.kill()
        p.join()
    assert not alive and p.exitcode == 0
    assert vf.rows_of(b"child")


def _lock_stuck(path: str, q: mp.Queue) -> None:  # type: ignore[type-arg]
    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, 4096)
    try:
        _l2core.mutex_lock(mm, 128, 1.0)  # (VectorFile.update: MUTEX_TIMEOUT)
        q.put("locked")
    except BaseException as exc:  # noqa: BLE001
        q.put(f"{type(exc).__name__}: {exc}")
    q.close()
    q.join_thread()  # (flushed before the exit: os._exit does not wait for the feeder)
    os._exit(0)


def _answer_within(target: Any, args: tuple[Any, ...], seconds: float, what: str) -> str:
    """What a child running ``target(*args, queue)`` put on its queue, failing the test
    (the child killed) when it is still running after ``seconds``."""
    q: mp.Queue = CTX.Queue()  # type: ignore[type-arg]
    p = CTX.Process(target=target, args=(*args, q))
    p.start()
    p.join(seconds)
    alive = p.is_alive()
    if alive:
        p.kill()
        p.join()
    assert not alive, f"{what} after {seconds:g} s"
    return q.get(timeout=5)  # type: ignore[no-any-return]


def test_a_mutex_held_by_a_vanished_thread_is_reported_not_waited_on_forever() -> None:
    path = f"/dev/shm/kvcomm-test-adv3-mutex-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 4096)
        with mmap.mmap(fd, 4096) as mm:
            _l2core.mutex_init(mm, 128)
            mm[128:132] = struct.pack("<I", 4_000_000)  # (a TID above pid_max's default)
        answer = _answer_within(_lock_stuck, (path,), 15, "mutex_lock still waiting")
        assert answer.startswith("Unavailable") and "4000000" in answer, answer
    finally:
        os.close(fd)
        os.unlink(path)


def test_a_vector_write_behind_a_holder_that_never_lets_go_is_refused_in_bounded_time(
        vf: VectorFile, monkeypatch: pytest.MonkeyPatch) -> None:
    """VectorFile.update waits at most MUTEX_TIMEOUT for the file's mutex, then
    Unavailable: nothing written, the item's rows and the intent area unchanged."""
    from kvcomm.tiers import vectors

    assert vf.update(b"k", lambda: (5, [ROW]), lambda _k: None)
    before = vf.rows_of(b"k")
    word = vectors.MUTEX_AT // 8
    vf.hdr[word] = 4_000_000  # (the lock word of a holder that is gone, no owner-died mark)
    monkeypatch.setattr(vectors, "MUTEX_TIMEOUT", 0.3)
    t0 = time.monotonic()
    with pytest.raises(kvcomm.Unavailable, match="held for over"):
        vf.update(b"k", lambda: (6, [ROW]), lambda _k: None)
    assert time.monotonic() - t0 < 5.0
    assert vf.intent_key() is None and vf.rows_of(b"k") == before
    vf.hdr[word] = 0  # (let go: the next write goes through)
    assert vf.update(b"k", lambda: (7, [ROW]), lambda _k: None)


_NS_PROC = """
import mmap, os, sys
from kvcomm.tiers.shm import segment
from kvcomm import _l2core
mm = mmap.mmap(os.open(sys.argv[1], os.O_RDWR), 4096)
print("trying", flush=True)
try:
    print("got", _l2core.mutex_lock(mm, 128), flush=True)
except Exception as exc:
    print("raised", type(exc).__name__, exc, flush=True)
    sys.exit(0)
sys.stdin.readline()
_l2core.mutex_unlock(mm, 128)
"""


def _unshare_works() -> bool:
    import shutil
    import subprocess
    if not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-Urpf", "true"], capture_output=True,
                          timeout=30).returncode == 0


@contextmanager
def _mutex_file(tag: str) -> Iterator[tuple[str, mmap.mmap]]:
    """A file of /dev/shm with a fresh writers' mutex at byte 128: (its path, a mapping);
    removed after."""
    path = f"/dev/shm/kvcomm-test-adv3-{tag}-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 4096)
        with mmap.mmap(fd, 4096) as mm:
            _l2core.mutex_init(mm, 128)
            yield path, mm
    finally:
        os.close(fd)
        os.unlink(path)


def _in_namespaces(path: str, procs: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    """_NS_PROC on ``path`` as its own user and PID namespace's pid 1 (--kill-child: a
    SIGKILL of unshare kills the namespace), told "trying" before it takes the mutex."""
    if not _unshare_works():
        pytest.skip("unshare -Urpf (user and PID namespaces) is not permitted here")
    procs.append(subprocess.Popen(
        ["unshare", "-Urpf", "--kill-child", sys.executable, "-c", _NS_PROC, path],
        text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
    assert procs[-1].stdout is not None
    assert procs[-1].stdout.readline().strip() == "trying"
    return procs[-1]


def _end(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_a_waiter_with_the_holders_thread_id_that_is_killed_frees_nothing() -> None:
    """Two containers, each python its namespace's pid 1: the same thread id. The
    second waits for the file's mutex; its container is killed while it waits. Were it
    asleep in the mutex, the kernel would take the live holder for dead (the lock word
    names the dying thread's id) and hand the mutex on: it polls instead, so the mutex
    stays the holder's."""
    procs: list[subprocess.Popen[str]] = []
    with _mutex_file("pidkill") as (path, mm):
        try:
            holder = _in_namespaces(path, procs)
            assert holder.stdout is not None and holder.stdin is not None
            assert holder.stdout.readline().strip() == "got False"
            waiter = _in_namespaces(path, procs)
            py = process_in(waiter.pid, b"mutex_lock")
            wait_for(lambda: proc_state(py) == b"S", 10, "the waiter to wait")
            waiter.kill()  # (--kill-child: the namespace goes with it)
            waiter.wait(20)
            wait_for(lambda: proc_state(py) == b"", 10, "the waiter to be gone")
            with pytest.raises(kvcomm.Unavailable):
                _l2core.mutex_lock(mm, 128, 0.3)  # still the live holder's
            holder.stdin.write("\n")
            holder.stdin.flush()
            assert holder.wait(20) == 0
            assert _l2core.mutex_lock(mm, 128, 5.0) is False  # released, not "died"
            _l2core.mutex_unlock(mm, 128)
        finally:
            _end(procs)


_SPINS = """
import mmap, os, sys, threading
from kvcomm.tiers.shm import segment
from kvcomm import _l2core
mm = mmap.mmap(os.open(sys.argv[1], os.O_RDWR), 4096)
print("trying", flush=True)
while True:
    try:
        _l2core.mutex_lock(mm, 128, 0.0)
        break
    except Exception:
        pass
print("got", threading.get_native_id(), flush=True)
sys.stdin.readline()
_l2core.mutex_unlock(mm, 128)
"""


_TAKES = """
import mmap, os, sys
from kvcomm.tiers.shm import segment
from kvcomm import _l2core
mm = mmap.mmap(os.open(sys.argv[1], os.O_RDWR), 4096)
_l2core.mutex_lock(mm, 128, 600.0)
_l2core.mutex_unlock(mm, 128)
"""


def test_a_waiter_asleep_when_a_thread_with_its_id_takes_the_mutex_then_killed_frees_nothing(
        ) -> None:
    """W waits while this process holds the mutex; H2, another container's thread with
    W's id, takes it when this process lets go; W, still asleep, is killed. Asleep inside
    pthread_mutex_lock, W named the mutex as its pending robust lock, and the kernel took
    H2 for dead: the next taker got it with EOWNERDEAD while H2 held it. W sleeps on the
    lock word instead: H2 keeps it. (Up to 5 tries for the moment the test needs: W
    asleep in futex(2) once H2 holds; the moment seen at least once.)"""
    seen = 0
    for _ in range(10):
        procs: list[subprocess.Popen[str]] = []
        with _mutex_file("asleep") as (path, mm):
            try:
                assert _l2core.mutex_lock(mm, 128, 5.0) is False  # (this process holds)
                for _ in range(2):  # (asleep first: the wake-up at the release goes to one)
                    procs.append(subprocess.Popen([sys.executable, "-c", _TAKES, path],
                                                  text=True, stdout=subprocess.PIPE))
                    wait_for(lambda p=procs[-1]: proc_syscall(p.pid) == "202", 10, "a sleeper")
                waiter = _in_namespaces(path, procs)
                py = process_in(waiter.pid, b"mutex_lock")
                wait_for(lambda py=py: proc_syscall(py) == "202", 10, "the waiter to sleep")
                procs.append(subprocess.Popen(
                    ["unshare", "-Urpf", "--kill-child", sys.executable, "-c", _SPINS, path],
                    text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
                h2 = procs[-1]
                assert h2.stdout is not None and h2.stdin is not None
                assert h2.stdout.readline().strip() == "trying"
                _l2core.mutex_unlock(mm, 128)
                assert waiter.stdout is not None
                first, _w, _x = select.select([h2.stdout, waiter.stdout], [], [], 20)
                if waiter.stdout in first:
                    continue  # (W took it: not the moment)
                assert h2.stdout.readline().split()[:1] == ["got"]
                deadline = time.monotonic() + 2  # (W, woken for nothing, goes back to sleep)
                while proc_syscall(py) != "202" and time.monotonic() < deadline:
                    time.sleep(0.001)
                if proc_syscall(py) != "202":
                    continue
                seen += 1
                waiter.kill()
                waiter.wait(20)
                wait_for(lambda py=py: proc_state(py) == b"", 10, "the waiter to be gone")
                with pytest.raises(kvcomm.Unavailable):
                    _l2core.mutex_lock(mm, 128, 0.3)  # H2 still holds it
                h2.stdin.write("\n")
                h2.stdin.flush()
                assert h2.wait(20) == 0
                assert _l2core.mutex_lock(mm, 128, 5.0) is False  # released, not "died"
                _l2core.mutex_unlock(mm, 128)
            finally:
                _end(procs)
    assert seen, "the waiter was never asleep when the mutex changed hands"


def test_a_ctrl_c_while_a_write_waits_for_the_mutex_leaves_it_free(vf: VectorFile) -> None:
    """A KeyboardInterrupt while a write waits for the file's mutex leaves it free. (One
    that CPython raised just after the wait took the mutex left it held by a live thread:
    every writer of the index got Unavailable after 30 s, until the process ended; the
    mutex is now taken inside the write's try and released in its finally only if this
    thread holds it, mutex_release.) Tries until the interrupt lands while the write
    waits (at most 20 times)."""
    for _ in range(20):
        ready = CTX.Event()
        holder = CTX.Process(target=_hold_for, args=(vf.path, 0.03, ready))
        holder.start()
        assert ready.wait(10)
        timer = threading.Timer(0.01, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.start()
        try:
            vf.update(b"k", lambda: (0, None), lambda _k: None)
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        timer.join()
        holder.join(10)
        assert _l2core.mutex_lock(vf._mm, vectors.MUTEX_AT, 2.0) is False  # free again
        _l2core.mutex_release(vf._mm, vectors.MUTEX_AT)
        if interrupted:
            return
    pytest.fail("the interrupt never landed while the write waited")


def _hold_for(path: str, seconds: float, ready: Any) -> None:
    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, os.fstat(fd).st_size)
    _l2core.mutex_lock(mm, vectors.MUTEX_AT, 5.0)
    ready.set()
    time.sleep(seconds)  # (the holder's own hold: what the write waits behind)
    _l2core.mutex_unlock(mm, vectors.MUTEX_AT)
    os._exit(0)


def test_writers_in_two_pid_namespaces_exclude_each_other_without_error() -> None:
    procs: list[subprocess.Popen[str]] = []
    with _mutex_file("pidns") as (path, _mm):
        try:
            first = _in_namespaces(path, procs)
            assert first.stdout is not None and first.stdin is not None
            assert first.stdout.readline().strip() == "got False"
            second = _in_namespaces(path, procs)
            assert second.stdout is not None
            # (the second waits while the first holds: it answers nothing until released;
            # an answer now is its error)
            ready, _w, _x = select.select([second.stdout], [], [], 2.0)
            assert not ready, second.stdout.readline()
            first.stdin.write("\n")
            first.stdin.flush()
            assert second.stdout.readline().strip() == "got False"
            assert second.stdin is not None
            second.stdin.write("\n")
            second.stdin.flush()
            assert first.wait(30) == 0 and second.wait(30) == 0
        finally:
            _end(procs)


def _write_once(vf: VectorFile, q: mp.Queue) -> None:  # type: ignore[type-arg]
    try:
        vf.update(b"a", lambda: (5, [ROW]), lambda k: vf.set_rows(k, 1, [ROW]))
        q.put("ok")
    except BaseException as exc:  # noqa: BLE001
        q.put(f"{type(exc).__name__}")
    q.close()
    q.join_thread()  # (the answer sent before the exit, which skips the queue's flush)
    os._exit(0)


def test_a_key_table_without_an_empty_slot_is_repaired_or_refused(vf: VectorFile) -> None:
    assert vf.update(b"z", lambda: (5, [ROW]), lambda _k: None)
    vf._slots_np[:] = vf.rows_of(b"z")[0]  # (every slot: row 0, key b"z")
    answer = _answer_within(_write_once, (vf,), 15, "the write still probing")
    assert answer in ("ok", "SegmentError")
