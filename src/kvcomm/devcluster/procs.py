"""Starting and stopping the dev cluster's processes: the one place that signals them.

Servers (``redis-server``) and node daemons are started with :func:`spawn` and ended
with :func:`stop`; faults use :func:`proc_state`, :func:`running` and
:func:`wait_gone` to see what a signal did. A pid may be a child of this process (it is
then reaped here, so that it does not linger as a zombie) or not (a dev cluster started
by another command: its pids come from ``cluster.json``).
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Self

from .._wait import wait_until
from ..errors import Unavailable

Proc = int | subprocess.Popen[bytes]


def spawn(argv: list[str], log: str | os.PathLike[str] | None = None,
          detached: bool = True) -> subprocess.Popen[bytes]:
    """Start ``argv`` with stdout and stderr appended to ``log`` (discarded when None).

    ``detached`` puts it in a session of its own, so that it outlives this process and a
    terminal's Ctrl-C does not reach it (``kvcomm dev-cluster up`` returns while the
    cluster runs on). Raises OSError when ``argv[0]`` cannot be executed.
    """
    if log is None:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=detached)
    with open(Path(log), "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=detached)


def proc_state(pid: int) -> str:
    """The state letter of ``pid`` in /proc (R, S, T, Z, ...), or "" when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return ""
    return data[data.rfind(b")") + 2: data.rfind(b")") + 3].decode()


def all_stopped(pid: int) -> bool:
    """True once every thread of ``pid`` is stopped (state T): a SIGSTOP is delivered to
    each thread of a multithreaded process (etcd's) on its way back to user space, so
    for a moment after ``kill`` some may still answer."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    states = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue  # (a thread that exited)
        states.append(data[data.rfind(b")") + 2: data.rfind(b")") + 3])
    return bool(states) and all(st in (b"T", b"t") for st in states)


def _threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def running(pid: int) -> bool:
    """True while ``pid`` exists and has not exited; reaps it when it is our child and
    has exited. A zombie has exited once its last thread has: a killed process's first
    thread turns zombie while the others still close its files (etcd's listening port,
    its database's lock) for some milliseconds."""
    if pid <= 0:  # (a damaged state file: waitpid(-1) would reap any child of ours)
        return False
    try:
        if os.waitpid(pid, os.WNOHANG)[0]:
            return False  # our child, just reaped
    except ChildProcessError:
        pass  # not our child (or already reaped)
    state = proc_state(pid)
    if state in ("Z", "X"):
        return _threads(pid) > 1
    return state != ""


def running_as(pid: int, *markers: str) -> bool:
    """True while ``pid`` runs (:func:`running`) with one of ``markers`` among its command
    line's arguments, or among the words of its first (a server that rewrote its title:
    ``redis-server 127.0.0.1:PORT [cluster]``). That is the process a dev cluster
    recorded, not another that took its pid once it had exited: pids wrap at
    ``kernel.pid_max`` (32768 on many machines; a test run goes through that many), and
    after a reboot every recorded pid may be anyone's. A process whose first thread has
    exited while others still run has an empty command line: False, though
    :func:`running` says True."""
    if not running(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except OSError:
        return False
    words = set(args) | set(args[0].split())
    return any(m and os.fsencode(m) in words for m in markers)


def wait_exiting(pid: int, timeout: float = 10.0) -> None:
    """When ``pid``'s first thread has exited while its others still close its files (its
    ports), wait until they have: a process started in its place binds them then. Returns
    at once for any other process (it is not signalled)."""
    if pid > 0 and proc_state(pid) == "Z":
        wait_gone(pid, timeout)


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    """True once ``pid`` has exited (reaped when it is our child); False after ``timeout``."""
    try:
        wait_until(lambda: not running(pid), timeout, f"pid {pid} to exit")
    except Unavailable:
        return False
    return True


def _gone(p: Proc) -> bool:
    if isinstance(p, subprocess.Popen):
        return p.poll() is not None
    return not running(p)


def _signal(p: Proc, sig: int) -> None:
    try:
        if isinstance(p, subprocess.Popen):
            if p.poll() is None:
                p.send_signal(sig)
        elif p > 0:  # (0 and -1 would signal our process group, or every process)
            os.kill(p, sig)
    except ProcessLookupError:
        pass


def kill(p: Proc, timeout: float = 10.0) -> bool:
    """SIGKILL ``p`` (a crash) and wait until it is gone; True when it is."""
    _signal(p, signal.SIGCONT)  # a stopped process dies as well, but be plain about it
    _signal(p, signal.SIGKILL)
    if isinstance(p, subprocess.Popen):
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True
    return wait_gone(p, timeout)


def stop(procs: Iterable[Proc], timeout: float = 10.0) -> None:
    """End every process in ``procs`` (pids or Popen objects): SIGCONT (one a fault left
    stopped could not act on SIGTERM) and SIGTERM, then SIGKILL what is still running
    after ``timeout`` seconds. Returns once all are gone; children are reaped."""
    procs = list(procs)
    for p in procs:
        _signal(p, signal.SIGCONT)
        _signal(p, signal.SIGTERM)
    try:
        wait_until(lambda: all(_gone(p) for p in procs), timeout, "processes to exit",
                   interval=0.02)
    except Unavailable:
        for p in procs:
            if not _gone(p):
                kill(p, timeout)


class Service:
    """Servers started in a directory of their own: ``with Server() as s:`` starts them
    (:meth:`start`) and always stops them and removes the directory (:meth:`stop`)."""

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
