"""Write coalescing: the seeds' "batch commit" as a pure state machine.

Writes enter an open window. The window closes — and comes out as one
:class:`ClosedWindow` (not to be confused with the user's ``kvcomm.Batch``) —
when ``interval`` seconds have passed since its first write, or when it holds
``max_ops`` keys or ``max_bytes`` bytes. Within a window the last write of a key wins;
the replaced writes' vectors are merged into it (so the closed window's version of the key
descends from every write it absorbed); a delete stays as a tombstone, since other
hosts must learn of it.

Memory is bounded by construction: a window never holds more than ``max_ops`` keys or
``max_bytes`` bytes (plus one write), because :meth:`WriteWindow.add` closes and returns
the window that a write fills. The driver (the node daemon) must send each closed window
it is handed before adding more — that is the back-pressure: it is applied where sending
happens, with the driver's own bounded outbound queue.

The caller passes the time (``now``, seconds, monotonic); nothing here sleeps or reads
a clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .versions import Vector, merge_vectors


@dataclass(slots=True)
class Write:
    key: str
    value: bytes | None  # None: a tombstone
    vector: Vector
    hlc: int
    size: int  # bytes accounted: key + value

    @property
    def tombstone(self) -> bool:
        return self.value is None


@dataclass(slots=True)
class ClosedWindow:
    """One closed window: the last write per key, in first-write order."""

    writes: list[Write]
    ops_in: int  # writes that entered the window
    bytes_in: int
    opened_at: float
    closed_at: float

    @property
    def ops_out(self) -> int:
        return len(self.writes)

    @property
    def bytes_out(self) -> int:
        return sum(w.size for w in self.writes)


@dataclass
class WriteWindow:
    interval: float
    max_ops: int = 1000
    max_bytes: int = 1 << 20
    _pending: dict[str, Write] = field(default_factory=dict)
    _bytes: int = 0
    _ops_in: int = 0
    _bytes_in: int = 0
    _opened_at: float | None = None

    def __post_init__(self) -> None:
        if self.interval <= 0 or self.max_ops < 1 or self.max_bytes < 1:
            raise ValueError("interval, max_ops and max_bytes must be positive")

    def add(self, key: str, value: bytes | None, vector: Vector, hlc: int,
            now: float) -> ClosedWindow | None:
        """Add one write (``value`` None: delete). Returns the window if this write filled it."""
        size = len(key) + (0 if value is None else len(value))
        if self._opened_at is None:
            self._opened_at = now
        old = self._pending.pop(key, None)
        if old is not None:
            vector = merge_vectors(old.vector, vector)
            hlc = max(hlc, old.hlc)
            self._bytes -= old.size
        self._pending[key] = Write(key, value, vector, hlc, size)
        self._bytes += size
        self._ops_in += 1
        self._bytes_in += size
        if len(self._pending) >= self.max_ops or self._bytes >= self.max_bytes:
            return self._close(now)
        return None

    def poll(self, now: float) -> ClosedWindow | None:
        """The window, closed, if ``interval`` has passed since its first write; else None."""
        if self._opened_at is not None and now - self._opened_at >= self.interval:
            return self._close(now)
        return None

    def flush(self, now: float) -> ClosedWindow | None:
        """Close the window now (shutdown, a strong write that must not wait)."""
        return self._close(now) if self._pending else None

    def deadline(self) -> float | None:
        """When :meth:`poll` will next close the window (for the driver's sleep)."""
        return None if self._opened_at is None else self._opened_at + self.interval

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def pending_bytes(self) -> int:
        return self._bytes

    def _close(self, now: float) -> ClosedWindow:
        assert self._opened_at is not None
        closed = ClosedWindow(list(self._pending.values()), self._ops_in, self._bytes_in,
                              self._opened_at, now)
        self._pending = {}
        self._bytes = self._ops_in = self._bytes_in = 0
        self._opened_at = None
        return closed
