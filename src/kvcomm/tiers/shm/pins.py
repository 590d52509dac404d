"""Pins: zero-copy views of large arrays keep their block alive, lock-free."""

from __future__ import annotations

from typing import Any

from ...errors import SegmentError
from .segment import SegmentCore


class Pins(SegmentCore):
    """Pins."""

    def pin(self, key_b: bytes, h: int) -> tuple[Any, ...] | None:
        """Pin the block of ``key_b`` so that it outlives overwrites; None when absent.
        Lock-free (a hazard entry of this process names the block; see the C kernel).

        Returns ``(word, seq, tag, meta, counter, hlc, vvx, size, pin, view)``: ``view`` is a
        read-only memoryview of the value, valid until :meth:`unpin` of ``pin`` (an
        ``(index, hazard word)`` pair); when the pin table is full ``pin`` is ``(-1, 0)``
        and ``view`` is a private copy instead. Until the kernel's ``pin_kept`` (on this
        thread: each thread has its own pending pin), the pin is pending: ``drop_pending``
        releases it (call it in a ``finally``; ``_client/read.py`` ``_get_view``).
        """
        r = self._read_or_repair(lambda core: core.pin(key_b, h))
        if r is None:
            return None
        if r[8] < 0:  # pin table full: a consistent private copy keeps the promise
            return (*r[:8], (-1, 0), memoryview(r[10]).toreadonly())
        voff, vlen = r[9], r[10]
        try:
            view = self._ro[voff : voff + vlen]
        except (AttributeError, ValueError):  # (released by another thread's close since:
            raise self._closed("this read was under way") from None  # the pin is pending)
        return (*r[:8], (r[8], r[11]), view)

    def unpin(self, index: int, word: int) -> None:
        """Called from a view's finalizer in any thread: lock-free; releases exactly the
        pin ``(index, word)`` of this process (a forked child's copy of the finalizer,
        or a second call, does nothing)."""
        core = self._core
        if core is None:
            return
        try:
            core.unpin(index, word)
        except (ValueError, SegmentError):
            pass  # mapping already closed: the entry is swept as a dead process's
