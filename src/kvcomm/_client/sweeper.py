"""The expiry sweep: every process with a namespace open reclaims keys past their deadline.

Reads never serve an expired key (the getter and every Python read compare the record's
deadline with the clock), so the sweep is only about space and ``expire`` events: a
background thread per process and namespace wakes every ``cache.expiry_sweep`` and first
reads the segment's expiry hint (one word, no lock: tiers/shm/layout.py "Expiry hint"), a
lower bound of every clean record's deadline. While that bound is ahead of the clock no
record can have expired and the thread goes back to sleep: a host where no key has a
deadline never takes the lock for expiry (taking it every interval, in every process,
cost every writer). Otherwise it takes the writer lock only if it is free now (it never makes a
writer wait), looks at a bounded slice of the slot table (``SLICE`` slots, about 0.2 ms)
from the host's shared cursor, where the last slice of any process stopped, reclaims every
clean record past its deadline with an ``expire`` event in the change feed, releases the
lock and goes on with the next slice until the pass ends (``ceil(N / SLICE)`` slices over
N slots, shared by every process on the host) or the lock is busy. At a pass's end the
hint holds the least deadline left, so the sweeps stop until it passes. A read of an
expired key reclaims it at once (lazily, on access: ``Expiry._expired_seen``), and a
writer that must evict first sweeps the same pass on until it reclaims an expired clean
record or the pass ends. A dirty record (cluster mode, not yet in L3) is left until the
daemon has delivered it: an expiry reaches L3 as the record's own deadline."""

from __future__ import annotations

import _thread
import os
import threading
import time
from typing import TYPE_CHECKING

from .._threads import user_signals_blocked
from ..errors import KVCommError

if TYPE_CHECKING:
    from ..tiers.l2 import L2Segment

SLICE = 4096  # slots looked at per sweep (about 0.2 ms under the lock, measured)


class Sweeper:
    """A daemon thread sweeping one segment for this process (see the module docstring)."""

    def __init__(self, seg: L2Segment, interval: float, clock: object = time.time) -> None:
        self.seg = seg
        self.interval = float(interval)
        self.reclaimed = 0  # records reclaimed by this process's sweeps
        self.freed = 0  # their bytes
        self.looks = 0  # wake-ups (each reads the hint)
        self.sweeps = 0  # slices swept (each under the writer lock)
        self.passes = 0  # slices of this process that ended a pass
        self._clock = clock
        self._stop = threading.Event()
        # A bare thread, not a threading.Thread: a Thread object freed in the main thread
        # (after close() waited for it) runs threading's WeakSet callback there, and
        # Python drops a KeyboardInterrupt raised in it (tests/l2/test_ctrl_c_on_drop.py).
        # ``_done`` is held while it runs: stop() waits on it.
        self._done = _thread.allocate_lock()
        self._done.acquire()
        self._pid = os.getpid()
        with user_signals_blocked():  # (the user's signals are the main thread's)
            self._ident = _thread.start_new_thread(self._main, ())

    def sweep_once(self) -> int:
        """Read the hint and, while a record may have expired, sweep slices until the pass
        ends (the hint then holds the least deadline left) or the lock is busy; returns the
        records reclaimed (0 when none can have expired or the lock was busy). Raises
        SegmentError (purged).

        The whole pass in one wake-up, each slice taking and releasing the lock: one slice
        per wake-up left a key nobody read for up to ceil(N / SLICE) intervals (3.2 s for
        131,072 slots) before its ``expire`` event, not one interval."""
        now = self._clock()  # type: ignore[operator]
        self.looks += 1
        total = 0
        while self.seg.expiry_due(now):
            r = self.seg.sweep_expired(SLICE, now)
            if r is None:
                break  # (a writer holds the lock: the next wake-up goes on)
            n, freed, passed = r
            total += n
            self.reclaimed += n
            self.freed += freed
            self.sweeps += 1
            self.passes += passed
            if passed:
                break
        return total

    def _main(self) -> None:
        try:
            self._run()
        finally:
            self._done.release()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sweep_once()
            except KVCommError:
                return  # purged or closed: its clients say so at their next call
            except Exception:  # (a mapping closed under us at exit)
                return

    def stop(self) -> None:
        """Stop the thread and wait for it (at most one slice)."""
        self._stop.set()
        if os.getpid() == self._pid and _thread.get_ident() != self._ident:
            # (in a forked child the thread is the parent's: nothing to wait for)
            if self._done.acquire(timeout=5.0):
                self._done.release()
