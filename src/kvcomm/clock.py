"""The wall clock a host's hybrid logical clock reads, with a test-only offset per host.

Hosts of a dev cluster share one machine and so one clock; last-writer-wins and leases
rest on wall clocks, so the fault tools must be able to move one host's clock. A host's
config may name a file (``node.test_clock_offset_file``, TEST ONLY: never set it in
production) holding an offset in milliseconds; every process of that host adds it to
``time.time()``. The file is re-read at most every ``refresh`` seconds (a monotonic
check, no system call in between), so a nemesis can skew a running host
(:func:`write_clock_offset`; ``kvcomm.devcluster.set_clock_offset``).

Without the file, :func:`wall_ms` is the clock: ``time.time_ns() // 1_000_000``, as the
client has always used. The pure HLC (:mod:`kvcomm.core.versions`) takes the time as an
argument: this module is where it comes from.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ConfigError

if TYPE_CHECKING:
    from .config import Config

MAX_OFFSET_MS = 10 * 365 * 24 * 3600 * 1000  # ten years: a sane bound for a test skew


def wall_ms() -> int:
    """Milliseconds since the epoch, from the system clock."""
    return time.time_ns() // 1_000_000


def read_clock_offset(path: str | os.PathLike[str]) -> int:
    """The offset in milliseconds a clock file holds (a missing or empty file: 0).
    Raises ConfigError when it holds anything but an integer within ten years."""
    try:
        text = Path(path).read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return 0
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("node.test_clock_offset_file", f"cannot read {path}: {exc}") from None
    if not text:
        return 0
    try:
        ms = int(text)
    except ValueError:
        raise ConfigError("node.test_clock_offset_file",
                          f"{path} must hold an offset in milliseconds, got {text[:40]!r}") from None
    if abs(ms) > MAX_OFFSET_MS:
        raise ConfigError("node.test_clock_offset_file", f"{path}: {ms} ms is over ten years")
    return ms


def write_clock_offset(path: str | os.PathLike[str], offset_s: float) -> None:
    """Set the offset in ``path`` to ``offset_s`` seconds (rounded to milliseconds), at
    once for every reader (written aside, then renamed over it)."""
    ms = round(offset_s * 1000)
    if abs(ms) > MAX_OFFSET_MS:
        raise ConfigError("node.test_clock_offset_file", f"{offset_s} s is over ten years")
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(f"{ms}\n", encoding="ascii")
    tmp.replace(p)


class OffsetClock:
    """:func:`wall_ms` plus the offset in ``path``, re-read every ``refresh`` seconds.

    ``now_ms()`` never raises: a file that turns unreadable keeps the last good offset
    (``errors`` counts such reads). The constructor raises ConfigError for a bad file."""

    def __init__(self, path: str | os.PathLike[str], refresh: float = 0.05,
                 wall: Callable[[], int] = wall_ms,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.path = str(path)
        self.refresh = refresh
        self._wall, self._mono = wall, monotonic
        self.offset_ms = read_clock_offset(self.path)
        self._next = monotonic() + refresh
        self.errors = 0

    def now_ms(self) -> int:
        now = self._mono()
        if now >= self._next:
            self._next = now + self.refresh
            try:
                self.offset_ms = read_clock_offset(self.path)
            except ConfigError:
                self.errors += 1
        return self._wall() + self.offset_ms


def clock_for(config: Config) -> Callable[[], int]:
    """The millisecond clock of the host ``config`` describes: :func:`wall_ms`, or an
    :class:`OffsetClock` when ``node.test_clock_offset_file`` is set. Raises ConfigError
    for a bad offset file."""
    path = config.node.test_clock_offset_file
    return wall_ms if path is None else OffsetClock(path).now_ms
