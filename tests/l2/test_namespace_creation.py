"""Creating a namespace survives its creator's death and Ctrl-C at any point, and creators
racing make exactly one segment.

The segment is built under a temporary name and linked into place once whole: a creator
killed (SIGKILL) or interrupted (SIGINT) while creating leaves the next ``open()`` a
namespace it can use, never a half-made file to purge. The kills land in real processes'
creation: at a step chosen at random (the creator waits there), or after a random time
(the seed is printed).
"""

from __future__ import annotations

import gc
import glob
import mmap
import multiprocessing as mp
import os
import random
import select
import signal
import statistics
import time
import uuid
from typing import Any

import pytest

import kvcomm
from kvcomm.tiers import l2
from kvcomm.tiers.shm import segment
from kvcomm.tiers.shm.files import create_temp, remove_dead_temps
from tests.support.helpers import wait_for

pytestmark = pytest.mark.multiprocess
CTX = mp.get_context("fork")
CFG = {"cache": {"l2_size": "64MB", "watch_buffer": 256}}


def _temps(name: str) -> list[str]:
    path = l2.segment_path(name)
    return glob.glob(os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.*.tmp"))


# The steps of a creation, by where they are looked up: a creator told to pause at one
# (before or after it) writes b"p" there and waits to be killed, so that a kill lands
# inside the creation however loaded the machine (the timed kills may all miss it)
STEPS = [
    (segment, "create_temp"),
    (os, "ftruncate"),
    (os, "posix_fallocate"),
    (mmap, "mmap"),
    (segment.SegmentCore, "_initialise"),
    (os, "link"),
]


def _pause_at(step: int, after: bool, w: int) -> None:
    owner, name = STEPS[step]
    real = getattr(owner, name)

    def paused(*args: object, **kwargs: object) -> object:
        if not after:
            _wait_for_the_signal(w)
        out = real(*args, **kwargs)
        if after:
            _wait_for_the_signal(w)
        return out

    setattr(owner, name, paused)


def _wait_for_the_signal(w: int) -> None:
    """Wait at a step of the creation until killed, or until a SIGINT is pending: the
    user's signals are blocked while a segment is created, and one comes once it is done
    (src/kvcomm/tiers/shm/segment.py), so the creation goes on to deliver it."""
    os.write(w, b"p")
    deadline = time.monotonic() + 60
    while signal.SIGINT not in signal.sigpending() and time.monotonic() < deadline:
        time.sleep(0.001)


def _wait_to_be_killed(w: int, word: bytes) -> None:
    os.write(w, word)
    for _ in range(600):  # (short sleeps: a signal the kernel handed to another thread
        time.sleep(0.1)   # is raised here within 0.1 s; one long sleep would not wake)
    os._exit(3)


def _creator(ns: str, w: int, pause: tuple[int, bool] | None = None) -> None:
    """Create ``ns`` (writes b"r" just before, b"o" once open), then wait to be killed;
    with ``pause``, wait at that step of the creation instead (writes b"p" there)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # (objects the forked pytest process left, freed here by a collection, would run
    # their weakref callbacks or __del__ in this process: Python drops a KeyboardInterrupt
    # raised inside one, which is not what this test is about: tests/l2/test_ctrl_c_on_drop.py)
    gc.collect()
    gc.freeze()
    cfg = kvcomm.Config.from_mapping(CFG)
    if pause is not None:
        _pause_at(pause[0], pause[1], w)
    os.write(w, b"r")
    kv = kvcomm.open(ns, config=cfg)
    os.write(w, b"o")
    kv.put("by-creator", 1)
    _wait_to_be_killed(w, b"")


def _open_duration() -> float:
    """How long a forked child takes to create a namespace, from its b"r" to its b"o" (the
    window to kill it in)."""
    ns = f"t-{uuid.uuid4().hex[:10]}"
    r, w = os.pipe()
    p = CTX.Process(target=_creator, args=(ns, w))
    p.start()
    try:
        got = os.read(r, 1)
        t0 = time.monotonic()
        while b"o" not in got:
            got += os.read(r, 8)
        return time.monotonic() - t0
    finally:
        p.kill()
        p.join(10)
        os.close(r)
        os.close(w)
        l2.purge(ns)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def _read_until(r: int, word: bytes, p: Any, got: bytes = b"", timeout: float = 60.0) -> bytes:
    """``got`` and what the creator wrote to the pipe ``r`` after it, until ``word`` is
    in it (a read may bring more than one word): fails when the creator exits first (the
    parent holds no write end: end of file) or says nothing for ``timeout``."""
    deadline = time.monotonic() + timeout
    while word not in got:
        ready, _, _ = select.select([r], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            pytest.fail(f"the creator said {got!r}, not {word!r}, within {timeout:g} s")
        more = os.read(r, 8)
        if not more:
            p.join(10)
            pytest.fail(f"the creator exited ({p.exitcode}) having said {got!r}, not {word!r}")
        got += more
    return got


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_a_creator_killed_while_creating_leaves_a_usable_namespace(sig: int, seed: int) -> None:
    rng = random.Random(seed)
    window = statistics.median(_open_duration() for _ in range(3))  # (one may be an outlier)
    # every step, before and after it, in a random order: the creator waits there and is
    # killed there; between them, creators killed after a random time, wherever they are
    pauses: list[tuple[int, bool] | None] = [(i, after) for i in range(len(STEPS))
                                             for after in (False, True)]
    rng.shuffle(pauses)
    pauses[3::3] = [None] * len(pauses[3::3])  # (a third of the rounds: timed kills)
    pauses += [(i, after) for i in range(len(STEPS)) for after in (False, True)
               if (i, after) not in pauses]  # (every step still met once)
    mid = temps_left = 0
    link = next(i for i, (_o, name) in enumerate(STEPS) if name == "link")
    for i, pause in enumerate(pauses):
        ns = f"t-{uuid.uuid4().hex[:10]}"
        r, w = os.pipe()
        p = CTX.Process(target=_creator, args=(ns, w, pause))
        try:
            p.start()
            os.close(w)  # (the creator's copy only: its exit is an end of file)
            w = -1
            got = _read_until(r, b"r", p)
            if pause is None:
                time.sleep(rng.uniform(0.0, window))
            else:
                got = _read_until(r, b"p", p, got)  # (its open never returns: it waits there)
            os.kill(p.pid, sig)
            p.join(10)
            assert p.exitcode is not None, "the creator outlived its signal"
            assert p.exitcode != 0
            opened = b"o" in got + os.read(r, 8)
        finally:
            if w >= 0:
                os.close(w)
            os.close(r)
            if p.is_alive():
                p.kill()
                p.join(10)
        try:
            if pause is not None:
                # a SIGKILL before the segment was linked leaves no segment; a SIGINT waits
                # for the whole creation (the user's signals are blocked meanwhile)
                linked = sig == signal.SIGINT or pause > (link, False)
                assert os.path.exists(l2.segment_path(ns)) == linked, (STEPS[pause[0]][1], pause)
            if not opened:
                mid += 1
                temps_left += bool(_temps(ns))  # (a SIGKILL's; a SIGINT removes its own)
            # a fresh process opens it: created anew, or the whole segment the creator
            # linked into place just before it died
            with kvcomm.open(ns, config=kvcomm.Config.from_mapping(CFG)) as kv:
                kv.put("k", i)
                assert kv.get("k") == i
                assert kv._seg.check() == []
            assert not _temps(ns) or not opened  # (only a dead creator leaves one)
        finally:
            l2.purge(ns)
        assert not _temps(ns), "a temporary file outlived the purge"
    print(f"{signal.Signals(sig).name}: window {window * 1000:.0f} ms, {mid} of {len(pauses)} "
          f"creators killed before their open returned ({sum(x is not None for x in pauses)} "
          f"paused at a step), {temps_left} left a temporary file")
    if sig == signal.SIGINT:
        assert temps_left == 0, "an interrupted creator left its temporary file"


def _racer(ns: str, i: int, n: int, go: mp.Event, out: mp.Queue) -> None:  # type: ignore[type-arg]
    go.wait(10)
    with kvcomm.open(ns, config=kvcomm.Config.from_mapping(CFG)) as kv:
        kv.put(f"c/{i}", i)
        wait_for(lambda: all(kv.get(f"c/{j}") == j for j in range(n)), what="every racer's key")
        out.put((i, kv._seg.created, os.stat(kv._seg.path).st_ino))
        wait_for(lambda: kv.get("done") is not None, what="the test's end")


def test_creators_racing_make_exactly_one_segment(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(4):
        ns = f"t-{uuid.uuid4().hex[:10]}"
        n = rng.randrange(2, 5)
        go, out = CTX.Event(), CTX.Queue()
        procs = [CTX.Process(target=_racer, args=(ns, i, n, go, out)) for i in range(n)]
        try:
            for p in procs:
                p.start()
            go.set()
            got = [out.get(timeout=20) for _ in range(n)]
            assert sum(created for _, created, _ in got) == 1, got
            assert len({ino for _, _, ino in got}) == 1, got
            with kvcomm.open(ns, config=kvcomm.Config.from_mapping(CFG)) as kv:
                assert not kv._seg.created
                assert {k: kv.get(k) for k in kv.keys()} == {f"c/{j}": j for j in range(n)}
                kv.put("done", 1)
            for p in procs:
                p.join(20)
                assert p.exitcode == 0
            assert not _temps(ns)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(10)
            l2.purge(ns)


def test_a_dead_creators_temporary_file_goes_and_a_live_ones_stays() -> None:
    path = l2.segment_path(f"t-{uuid.uuid4().hex[:10]}")
    live_tmp, live_fd = create_temp(path, 0o600)
    dead_tmp, dead_fd = create_temp(path, 0o600)
    os.close(dead_fd)  # (its lock goes with it, as with a creator's death)
    try:
        remove_dead_temps(path)
        assert os.path.exists(live_tmp)
        assert not os.path.exists(dead_tmp)
    finally:
        os.close(live_fd)
        os.unlink(live_tmp)
