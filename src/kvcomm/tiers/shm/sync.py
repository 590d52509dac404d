"""The node daemon's words in the segment: dirty keys, the write sequence, its cursor
and heartbeat."""

from __future__ import annotations

import time

from ...core.versions import MAX_COUNTER
from ...errors import InvalidArgument
from .layout import H
from .segment import SegmentCore


class SyncState(SegmentCore):
    """The node daemon's words in the segment."""

    def dirty_keys(self) -> list[bytes]:
        """Keys whose records (tombstones too) are flagged dirty: written here, not yet in L3."""
        return list(self._core.scan(1))

    @property
    def write_sequence(self) -> int:
        """The counter of the host's last write (its newest dot)."""
        return int(self._q[H["WSEQ"]])

    def raise_write_sequence(self, at_least: int) -> None:
        """Make the host's next dots greater than ``at_least`` (under the lock). Raises
        InvalidArgument (nothing changed) when ``at_least`` is over MAX_COUNTER."""
        if not 0 <= at_least <= MAX_COUNTER:
            raise InvalidArgument(f"write sequence {at_least} is outside 0..2**53-1 "
                                  "(kvcomm.core.versions.MAX_COUNTER)")

        def raise_() -> None:
            if self._q[H["WSEQ"]] < at_least:
                self._q[H["WSEQ"]] = at_least

        self.locked(raise_)

    def take_dot(self, now_ms: int, hlc_floor: int = 0) -> tuple[int, int]:
        """A new dot of this host (the write sequence's next counter) and an HLC timestamp
        past both the host's clock and ``hlc_floor``, taken under the lock for a write that
        is decided elsewhere first and stored here after (a conditional write decided on
        L3: _client/cas.py). A dot taken and never written leaves a gap in the sequence,
        as a key's vector never names every dot of its host anyway. Raises Unavailable
        (the lock held too long), SegmentError (purged)."""
        q = self._q
        ws, hc = H["WSEQ"], H["HLC"]

        def take() -> tuple[int, int]:
            counter = int(q[ws]) + 1
            q[ws] = counter
            hlc = max(now_ms << 16, int(q[hc]) + 1, hlc_floor + 1)
            q[hc] = hlc
            return counter, hlc

        return self.locked(take)  # type: ignore[no-any-return]

    @property
    def dirty_count(self) -> int:
        return int(self._q[H["DIRTY"]])

    @property
    def sync_cursor(self) -> int:
        return int(self._q[H["SYNC_CURSOR"]])

    @sync_cursor.setter
    def sync_cursor(self, value: int) -> None:
        self._atom.store(H["SYNC_CURSOR"] * 8, value)

    def daemon_heartbeat(self, pid: int) -> None:
        self._q[H["DAEMON_PID"]] = pid
        self._atom.store(H["DAEMON_BEAT"] * 8, time.time_ns() // 1_000_000)

    def daemon_last_beat_ms(self) -> int:
        """When the node daemon last heartbeat (ms since the epoch; 0: never)."""
        return int(self._q[H["DAEMON_BEAT"]])

    @property
    def daemon_pid(self) -> int:
        """The pid of the last node daemon that heartbeat here (0: none ever did)."""
        return int(self._q[H["DAEMON_PID"]])

    def daemon_alive(self, within_ms: int = 2000) -> bool:
        beat = self._q[H["DAEMON_BEAT"]]
        return bool(beat) and time.time_ns() // 1_000_000 - beat < within_ms

    def count_set_aside(self, n: int = 1) -> None:
        self._atom.add(H["SET_ASIDE"] * 8, n)

