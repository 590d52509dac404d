"""What tests share besides fixtures: the small L2 config, waiting on a condition with a
deadline, a tmpfs to stand in for a small /dev/shm."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

from kvcomm._wait import wait_until

T = TypeVar("T")

SMALL = {"cache": {"l2_size": "16MB", "watch_buffer": 4096}}


def drawn_seed(*bounds: int) -> int:
    """A randomised test's seed: ``random.randrange(*bounds)``, or ``KVCOMM_TEST_SEED`` when
    set (it replays a failure); printed as ``seed=N`` (pytest shows it when the test fails).
    The ``seed`` fixture is this with a 32-bit bound."""
    s = int(os.environ["KVCOMM_TEST_SEED"]) if os.environ.get("KVCOMM_TEST_SEED") \
        else random.randrange(*bounds)
    print(f"seed={s}")
    return s


def wait_for(cond: Callable[[], T], timeout: float = 10.0,
             what: str | Callable[[], str] = "condition", *,
             retry_on: tuple[type[BaseException], ...] = ()) -> T:
    """:func:`kvcomm._wait.wait_until` for tests: polls ``cond`` (every 2 ms) until it
    returns a true value, which it returns; fails the test (AssertionError) after
    ``timeout`` seconds (``what`` may be a callable: the message, made then). No
    sleeping-and-hoping."""
    return wait_until(cond, timeout, what, interval=0.002, retry_on=retry_on, error=AssertionError)


def mount_tmpfs(tmp_path: os.PathLike[str], size: str) -> Iterator[str]:
    """A tmpfs of ``size`` (``6m``) at ``tmp_path/shm``, unmounted afterwards (the test is
    skipped where mount is not allowed): a small /dev/shm stand-in, for cache.l2_dir."""
    import pathlib
    import subprocess

    d = pathlib.Path(tmp_path) / "shm"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)],
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode()[:200]}")
    yield str(d)
    subprocess.run(["umount", "-l", str(d)], check=False)


def proc_state(pid: int) -> bytes:
    """The state letter of process ``pid`` (``b"S"`` asleep, ``b"T"`` stopped...), or
    ``b""`` when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return b""
    return data[data.rfind(b")") + 2 : data.rfind(b")") + 3]


def proc_syscall(pid: int) -> str:
    """The number of the system call process ``pid`` is in ("202": futex, on x86-64), or
    "gone"."""
    try:
        with open(f"/proc/{pid}/syscall") as f:
            return f.read().split()[0]
    except (OSError, IndexError):
        return "gone"


def process_in(root: int, marker: bytes) -> int:
    """The pid of the Python (this interpreter's executable) under ``root`` (itself or a
    descendant, in this PID namespace's numbers) whose command line holds ``marker``:
    the program that a wrapper (``unshare``, a shell) started."""
    import sys

    todo = [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            if cmd.split(b"\0")[0] == sys.executable.encode() and marker in cmd:
                return pid
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    raise AssertionError(f"no process with {marker!r} in its command line under {root}")
