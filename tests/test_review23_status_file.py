"""Review of stop 23 (partial cuts, parked writes at their bounds), as an adversary: the
node daemon's status file, which a write refused at ``cluster.outbound_max`` reads for its
message, is another process's file. A FIFO at its path held the write for ever (and a
batch's refusal held the segment's writer lock meanwhile: every agent of the host
waited); an ``updated`` too large for a float raised OverflowError instead of
Unavailable; a ``masters_down`` of thousands of long names made a message of megabytes;
``kvcomm info`` crashed on a ``masters_down`` that is not a list, an ``updated`` that is
not a number, a ``lease`` that is not an integer.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

import kvcomm
from kvcomm.node.presence import StatusReader, read_status, status_path, write_status
from kvcomm.tiers import l2
from tests.support.helpers import wait_for


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvcomm", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def full(ns: str) -> Iterator[tuple[kvcomm.Client, str]]:
    """A client of a cluster-mode namespace (no daemon: its writes never leave L2) whose
    outbound bound (2) is reached; yields it and its status file's path."""
    cfg = kvcomm.Config.from_mapping({
        "node": {"host_id": "adversary", "namespace": ns},
        "cache": {"l2_size": "4MB", "lock_timeout": 2.0},
        "cluster": {"redis": ["127.0.0.1:1"], "outbound_max": 2}})
    kv = kvcomm.open(config=cfg, wait_daemon=False)
    path = status_path(ns, cfg.cache.l2_dir)
    try:
        kv.put("k1", 1)
        kv.put("k2", 2)
        yield kv, path
    finally:
        kv.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
        l2.purge(ns)


def _refused(fn: Callable[[], object], within: float, unblock: Callable[[], None]
             ) -> BaseException | None:
    """Run ``fn`` in a thread; what it raised, once it returned within ``within`` seconds.
    Fails the test if it did not (``unblock`` then lets it go, for the clean-up)."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            out.append(None)
        except BaseException as exc:  # (what the write raised: the test looks at it)
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        wait_for(lambda: bool(out), within, "the refused write to return")
    finally:
        if t.is_alive():
            unblock()
            t.join(10)
    return out[0]


def test_a_fifo_at_the_status_path_neither_holds_a_refused_write_nor_the_writer_lock(
        full: tuple[kvcomm.Client, str]) -> None:
    """A FIFO where the daemon's status file belongs (anything another process put
    there): a put and a batch refused at ``cluster.outbound_max`` raise Unavailable at
    once, and while the batch is refused no writer lock is held (a write of a key
    already waiting goes through from another thread)."""
    kv, path = full
    os.mkfifo(path, 0o600)

    def unblock() -> None:  # (a reader blocked opening the FIFO: a writer lets it go)
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))

    exc = _refused(lambda: kv.put("k3", 3), 5.0, unblock)
    assert isinstance(exc, kvcomm.Unavailable) and "cluster.outbound_max" in str(exc), exc
    assert "is `kvcomm node` running" in str(exc), exc
    assert read_status(path) is None

    def batch() -> None:
        with kv.batch() as b:
            b.put("k4", 4)
            b.put("k5", 5)

    exc = _refused(batch, 5.0, unblock)
    assert isinstance(exc, kvcomm.Unavailable) and "cluster.outbound_max" in str(exc), exc
    kv.put("k2", 22)  # (the writer lock is free: a key already waiting takes a newer write)
    assert kv.get("k2") == 22


@pytest.mark.parametrize("raw, says", [
    # an ``updated`` no float holds: OverflowError, not Unavailable
    (b'{"updated": 1' + b"0" * 400 + b', "masters_down": ["m:1"]}', "is `kvcomm node` running"),
    (b'{"updated": "soon", "masters_down": ["m:1"]}', "is `kvcomm node` running"),
    (b'{"updated": NaN, "partition": true}', "is `kvcomm node` running"),
    (b'{"updated": Infinity, "partition": true}', "is `kvcomm node` running"),
    (b'{"updated": NOW, "masters_down": 5}', "the node daemon is sending them"),
    (b'{"updated": NOW, "masters_down": "abc"}', "the node daemon is sending them"),
    (b'{"updated": NOW, "lease": "abc", "masters_down": {}}', "the node daemon is sending them"),
])
def test_a_hostile_status_file_makes_a_refusal_that_says_no_more_than_it_knows(
        full: tuple[kvcomm.Client, str], raw: bytes, says: str) -> None:
    """What another process wrote at the status file's path: the refused write still
    raises Unavailable (never OverflowError, ValueError...), trusting nothing stale or
    not a number, and ``kvcomm info`` and an agent's status reader do not crash on it."""
    kv, path = full
    with open(path, "wb") as f:
        f.write(raw.replace(b"NOW", str(time.time()).encode()))
    with pytest.raises(kvcomm.Unavailable, match="cluster.outbound_max") as exc:
        kv.put("k3", 3)
    assert says in str(exc.value), exc.value
    assert StatusReader(path).etcd_unreachable() is None
    out = _run("info", "--name", kv.name)
    assert out.returncode == 0, out.stderr
    assert "masters down" not in out.stdout, out.stdout


def test_a_status_file_naming_thousands_of_masters_makes_a_bounded_message(
        full: tuple[kvcomm.Client, str]) -> None:
    """A fresh status naming 5,000 long "masters" (and control characters): the refusal
    names a few (and how many more), in a message of a few hundred characters; so does
    ``kvcomm info``."""
    kv, path = full
    names = [f"10.0.{i // 256}.{i % 256}:6379\n" + "x" * 100 for i in range(5000)]
    write_status(path, {"updated": time.time(), "masters_down": names, "parked": 3})
    with pytest.raises(kvcomm.Unavailable, match="cluster.outbound_max") as exc:
        kv.put("k3", 3)
    msg = str(exc.value)
    print(msg)
    assert "10.0.0.0:6379?" in msg and "and 4992 more" in msg and "\n" not in msg, msg
    assert len(msg) < 1500, len(msg)
    out = _run("info", "--name", kv.name)
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("masters down"))
    assert "and 4992 more" in line and len(line) < 1000, line



def test_a_watch_takes_no_number_of_the_status_file_that_is_not_one(
        full: tuple[kvcomm.Client, str]) -> None:
    """A fresh status whose ``watch_applied`` and ``watch_missed`` are not integers (the
    file is another process's): ``watch`` starts (nothing applied: it does not wait for
    the daemon) instead of raising ValueError or TypeError."""
    kv, path = full
    write_status(path, {"updated": time.time(), "watch_applied": "soon",
                        "watch_missed": [1]})
    t0 = time.monotonic()
    events = list(kv.watch("w/", timeout=0.05))
    assert events == [] and time.monotonic() - t0 < 2.0
