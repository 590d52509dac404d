"""The shared waiting loop (kvcomm._wait) and process helpers (kvcomm.devcluster.procs)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvcomm import Unavailable
from kvcomm._wait import wait_until
from kvcomm.devcluster import RedisServer
from kvcomm.devcluster.procs import (
    kill,
    proc_state,
    running,
    running_as,
    spawn,
    stop,
    wait_exiting,
    wait_gone,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def test_wait_until_returns_the_first_true_value() -> None:
    clock = FakeClock()
    answers = iter([None, 0, [], "ready"])
    got = wait_until(lambda: next(answers), 10, "it", interval=0.5, clock=clock, sleep=clock.sleep)
    assert got == "ready" and clock.sleeps == [0.5, 0.5, 0.5]


def test_wait_until_gives_up_after_the_timeout_saying_what_it_waited_for() -> None:
    clock = FakeClock()
    calls = []
    with pytest.raises(Unavailable, match=r"timed out after 2s waiting for the server"):
        wait_until(lambda: calls.append(1), 2, "the server", interval=0.5, clock=clock,
                   sleep=clock.sleep)
    assert len(calls) == 6  # at 0, 0.5, ..., 2.5: one poll past the deadline, then no more
    with pytest.raises(AssertionError, match=r"waiting for x \(still 3 behind\)"):
        wait_until(lambda: False, 1, lambda: "x (still 3 behind)", error=AssertionError,
                   clock=clock, sleep=clock.sleep)


def test_wait_until_polls_once_even_with_no_time_left() -> None:
    clock = FakeClock()
    assert wait_until(lambda: 7, 0, "it", clock=clock, sleep=clock.sleep) == 7
    assert clock.sleeps == []


def test_wait_until_retries_only_the_exceptions_it_is_told_to() -> None:
    clock = FakeClock()
    answers = iter([ConnectionRefusedError(), ConnectionRefusedError(), True])

    def cond() -> bool:
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    assert wait_until(cond, 10, "it", retry_on=(OSError,), clock=clock, sleep=clock.sleep)
    with pytest.raises(ValueError):  # not retried: the wait ends at once
        wait_until(lambda: int("x"), 10, "it", retry_on=(OSError,), clock=clock,
                   sleep=clock.sleep)


# ---------------------------------------------------------------- processes


def _child(code: str, *args: str, argv0: str = sys.executable) -> subprocess.Popen[bytes]:
    """A Python child that runs ``code``, then says "ready" and sleeps; ``args`` and
    ``argv0`` for its command line."""
    proc = subprocess.Popen([argv0, "-c", code + "\nprint('ready', flush=True)\n"
                             "import time\nwhile True: time.sleep(1)\n", *args],
                            executable=sys.executable, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    return proc


def test_stop_ends_a_stopped_process_and_one_that_ignores_sigterm() -> None:
    stubborn = _child("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    polite = _child("")
    polite.send_signal(signal.SIGSTOP)
    wait_until(lambda: proc_state(polite.pid) in ("T", "t"), 10, "the child to stop")
    stop([stubborn, polite.pid], timeout=1.0)
    assert stubborn.poll() == -signal.SIGKILL  # SIGTERM ignored: killed after the timeout
    assert not running(polite.pid)  # continued, then ended by SIGTERM, and reaped here
    assert proc_state(polite.pid) == ""


def test_running_and_wait_gone_see_exit_through_zombies() -> None:
    proc = _child("")
    assert running(proc.pid) and proc_state(proc.pid) in ("S", "R")
    assert kill(proc.pid)
    assert not running(proc.pid) and wait_gone(proc.pid, 0)
    assert proc_state(proc.pid) == ""  # reaped: no zombie left behind


_LEADER_EXITS_FIRST = """
import ctypes, socket, sys, threading
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 0))
s.listen()
print(s.getsockname()[1], flush=True)
threading.Thread(target=lambda: (sys.stdin.readline(), s.close())).start()
ctypes.CDLL(None).pthread_exit(None)  # (a CDLL call lets go of the GIL first)
"""


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_a_process_whose_first_thread_exited_runs_until_its_last_thread_has() -> None:
    """A killed process's first thread turns zombie while its other threads still close
    its files: etcd's port was still bound for up to 9 ms after its pid read "Z" (a member
    restarted at once could not bind it)."""
    proc = subprocess.Popen([sys.executable, "-c", _LEADER_EXITS_FIRST],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    live = _child("")
    try:
        t0 = time.monotonic()
        wait_exiting(live.pid)  # a process that runs: not waited on
        assert time.monotonic() - t0 < 0.5 and running(live.pid)
        port = int(proc.stdout.readline())  # type: ignore[union-attr]
        wait_until(lambda: proc_state(proc.pid) == "Z", 10, "the first thread to exit")
        assert running(proc.pid) and not _bindable(port)
        assert not wait_gone(proc.pid, 0.2)
        threading.Timer(0.3, lambda: (proc.stdin.write(b"go\n"),  # type: ignore[union-attr]
                                      proc.stdin.flush())).start()  # type: ignore[union-attr]
        t0 = time.monotonic()
        wait_exiting(proc.pid)  # (what restart-etcd, -daemon and -redis do first)
        assert time.monotonic() - t0 > 0.2 and not running(proc.pid)
        assert _bindable(port)
    finally:
        proc.kill()
        proc.wait()
        kill(live)


def test_running_as_knows_a_process_by_an_argument_or_a_word_of_its_title() -> None:
    titled = _child("", "--dir", "/d/7")
    try:
        assert running_as(titled.pid, "/d/7") and running_as(titled.pid, "x", "/d/7")
        assert not running_as(titled.pid, "/d/70") and not running_as(titled.pid, "/d")
        # a server that rewrote its command line into one title (redis-server does)
        other = _child("", argv0="redis-server 127.0.0.1:16379 [cluster]")
        try:
            assert running_as(other.pid, "127.0.0.1:16379")
            assert not running_as(other.pid, "127.0.0.1:1637")
        finally:
            kill(other)
        assert not running_as(other.pid, "127.0.0.1:16379")  # exited
    finally:
        kill(titled)


def test_down_after_a_reboot_signals_none_of_the_processes_that_took_the_pids(
        tmp_path: Path) -> None:
    """After a reboot, cluster.json's pids are anyone's, and `up` asks for a `down`
    first: down must leave those processes alone and still remove the state."""
    from kvcomm.devcluster import control

    others = [_child("") for _ in range(5)]
    try:
        pids = [o.pid for o in others]
        etcd_dir = tmp_path / "etcd"
        etcd_dir.mkdir()
        control.save_state(tmp_path, {
            "hosts": [{"host": "host-1", "namespace": "kvcommtestreboot-host-1",
                       "config": str(tmp_path / "host-1.yaml"), "pid": pids[0],
                       "proxy": {"pid": pids[1], "control": str(tmp_path / "p.sock")}}],
            "redis_pids": [pids[2]], "redis": ["127.0.0.1:16379"],
            "redis_dir": str(tmp_path / "redis"),
            "etcd": {"names": ["m1", "m2"], "pids": pids[3:], "dir": str(etcd_dir),
                     "client_ports": [1, 2], "peer_ports": [3, 4]}})
        assert control.down(str(tmp_path))
        assert all(o.poll() is None and proc_state(o.pid) in ("S", "R") for o in others)
        assert not (tmp_path / control.STATE_FILE).exists() and not etcd_dir.exists()
    finally:
        for o in others:
            kill(o)


def test_a_pid_of_zero_or_below_is_never_waited_on_nor_signalled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A damaged cluster.json: waitpid(-1) would reap any child of ours, kill(0) and
    kill(-1) signal our process group or every process."""
    import os

    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(7)"])
    wait_until(lambda: proc_state(child.pid) == "Z", 10, "the child to exit")
    assert not running(0) and not running(-1) and not running_as(-1, "x")
    assert child.wait(10) == 7  # still ours to reap, with its status
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    stop([0, -1], timeout=0.1)
    assert kill(0, 0.1) and sent == []


def test_spawn_appends_output_to_a_log(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("before\n")
    proc = spawn([sys.executable, "-c", "print('hello')"], log, detached=True)
    assert proc.wait(30) == 0
    assert log.read_text() == "before\nhello\n"


@pytest.mark.redis
def test_redis_server_starts_answers_and_leaves_nothing_behind() -> None:
    with RedisServer() as server:
        assert server.proc is not None
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.sendall(b"PING\r\n")
            assert s.recv(16).startswith(b"+PONG")
        pid, directory = server.proc.pid, server.dir
    assert server.proc.poll() is not None and proc_state(pid) == ""
    assert not Path(directory).exists()
