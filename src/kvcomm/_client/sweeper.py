"""The expiry sweep: every process with a namespace open reclaims keys past their deadline.

Reads never serve an expired key (the getter and every Python read compare the record's
deadline with the clock), so the sweep is only about space and ``expire`` events: a
background thread per process and namespace takes the writer lock only if it is free now
(it never makes a writer wait), looks at a bounded slice of the slot table from where it
stopped last (``SLICE`` slots, about 0.2 ms), reclaims every clean record
past its deadline with an ``expire`` event in the change feed, and sleeps
``cache.expiry_sweep``. A whole table of N slots is swept every
``ceil(N / SLICE) * expiry_sweep`` seconds at most; every other process on the host sweeps
too (from its own place), and a read of an expired key reclaims it at once (lazily, on
access: ``Expiry._expired_seen``). A dirty record (cluster mode, not yet in L3) is left
until the daemon has delivered it: an expiry reaches L3 as the record's own deadline.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

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
        self.sweeps = 0
        self._clock = clock
        self._cursor = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvcomm-expiry-{seg.name}",
                                        daemon=True)
        self._thread.start()

    def sweep_once(self) -> int:
        """One slice; returns the records reclaimed (0 when the lock was busy). Raises
        SegmentError (purged)."""
        r = self.seg.sweep_expired(self._cursor, SLICE, self._clock())  # type: ignore[operator]
        if r is None:
            return 0
        self._cursor, n, freed = r
        self.reclaimed += n
        self.freed += freed
        self.sweeps += 1
        return n

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
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
