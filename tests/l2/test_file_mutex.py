"""The mutex in a mapped file (``_l2core.mutex_*``: the vector index's writer lock): it
excludes other processes, and a holder that dies hands it on, saying so."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import threading
from collections.abc import Iterator

import pytest

from kvcomm import _l2core
from kvcomm.errors import SegmentError

pytestmark = pytest.mark.multiprocess
CTX = mp.get_context("fork")
AT = 128


@pytest.fixture
def mapped(tmp_path: object) -> Iterator[mmap.mmap]:
    path = f"/dev/shm/kvcomm-test-mutex-{os.getpid()}-{id(tmp_path)}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 4096)
        mm = mmap.mmap(fd, 4096)
        _l2core.mutex_init(mm, AT)
        yield mm
        mm.close()
    finally:
        os.close(fd)
        os.unlink(path)


def _hold(mm: mmap.mmap, held: mp.Event, go: mp.Event, die: bool) -> None:  # type: ignore[type-arg]
    assert _l2core.mutex_lock(mm, AT) is False
    held.set()
    go.wait(60)
    if die:
        os._exit(0)  # (holding it)
    _l2core.mutex_unlock(mm, AT)
    os._exit(0)


@pytest.mark.parametrize("die", [False, True])
def test_another_process_waits_for_the_holder_and_learns_of_its_death(
        mapped: mmap.mmap, die: bool) -> None:
    held, go = CTX.Event(), CTX.Event()
    p = CTX.Process(target=_hold, args=(mapped, held, go, die))
    p.start()
    try:
        assert held.wait(60)
        got: list[bool] = []

        def take() -> None:
            got.append(_l2core.mutex_lock(mapped, AT))
            _l2core.mutex_unlock(mapped, AT)

        t = threading.Thread(target=take)
        t.start()
        assert not got, "taken while another process holds it"
        go.set()
        t.join(60)
        assert got == [die], "a dead holder is reported (and only then)"
        assert _l2core.mutex_lock(mapped, AT) is False, "consistent again after a death"
        _l2core.mutex_unlock(mapped, AT)
    finally:
        go.set()
        p.join(60)


def test_misuse_is_refused(mapped: mmap.mmap) -> None:
    # (a second lock by the holding thread is not refused: the mutex is a NORMAL one, so
    # that a writer of another PID namespace with the holder's thread number waits;
    # VectorFile's thread lock keeps a thread from taking it twice)
    assert _l2core.mutex_lock(mapped, AT) is False
    _l2core.mutex_unlock(mapped, AT)
    with pytest.raises(SegmentError, match="cannot release"):
        _l2core.mutex_unlock(mapped, AT)  # (not held: a robust mutex checks its owner)
    for off in (-8, 4, 4096 - 56):
        with pytest.raises(ValueError, match="8-aligned"):
            _l2core.mutex_lock(mapped, off)
    with pytest.raises(BufferError):
        _l2core.mutex_lock(b"x" * 256, 0)  # (read-only)
