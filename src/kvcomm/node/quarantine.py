"""The node daemon's bad input: what it sets aside instead of dying of it.

Everything the daemon reads from L3 may have been written by something else. A record
that fails — it does not decode (CorruptRecord), L2 cannot take it (ValueTooLarge or
any KVCommError), its key cannot be sent to Redis, or anything unexpected happens while
handling that one record — is logged, counted (``stats.quarantined``), pushed to the
capped L3 list ``kvn:{host}:quarantine`` ("set aside") when L3 is reachable, and
skipped (:mod:`kvcomm.node.daemon`, "Input never kills the daemon").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import CorruptRecord, Unavailable
from .port import L3Port

if TYPE_CHECKING:
    from .daemon import DaemonStats

log = logging.getLogger("kvcomm.node")
QUARANTINE_QUIET = 60.0  # the same key is pushed to the quarantine list at most this often


class Quarantine:
    """Sets inputs aside: counted every time, logged and recorded in L3 at most once a
    minute per key (:attr:`set_aside_at`)."""

    def __init__(self, l3: L3Port, host: str, stats: DaemonStats,
                 clock: Callable[[], float], wall: Callable[[], float]) -> None:
        self.l3, self.host, self.stats, self.clock, self.wall = l3, host, stats, clock, wall
        self.set_aside_at: dict[str, float] = {}  # key → when last pushed to quarantine

    def set_aside(self, key: str, reason: str) -> None:
        """Count, log and (if L3 answers) record an input the daemon skips. A key that
        keeps failing is logged and recorded once a minute, counted every time."""
        self.stats.quarantined += 1
        now = self.clock()
        if now - self.set_aside_at.get(key, -QUARANTINE_QUIET) < QUARANTINE_QUIET:
            log.debug("set aside %r again: %s", key, reason)
            return
        log.error("set aside %r: %s", key, reason)
        if len(self.set_aside_at) > 10_000:
            self.set_aside_at.clear()
        self.set_aside_at[key] = now
        try:
            self.l3.quarantine(self.host, key, reason, self.wall())
        except Unavailable as exc:
            log.warning("could not record %r in the quarantine list: %s", key, exc)

    def guarded(self, key: str, where: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` for one record, or False when it failed. Any failure but
        Unavailable (which means "not now": the caller's round is retried) sets the
        record aside."""
        try:
            return fn(*args)
        except Unavailable:
            raise
        except Exception as exc:  # one record's failure, whatever it is, stops nothing else
            if isinstance(exc, CorruptRecord):
                self.stats.corrupt += 1
            self.set_aside(key, f"{where}: {type(exc).__name__}: {exc}")
            return False
