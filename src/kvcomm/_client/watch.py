"""Watching: the host's change feed, filtered by prefix, as Events."""

from __future__ import annotations

import time
from collections.abc import Iterator

from ..errors import InvalidArgument, InvalidKey, SegmentError
from ..tiers.l2 import KIND_NAMES
from .items import Event
from .write import Writes


class Watching(Writes):
    """Watching."""

    def watch(self, prefix: str = "", *, timeout: float | None = None) -> Iterator[Event]:
        """Changes under ``prefix`` from now on, in per-key order.

        Kinds: ``put``, ``delete``, ``evict`` (L2 dropped the key to make room: in embedded
        mode it is gone, in cluster mode L3 still has it) and ``overflow``. With
        ``timeout``, iteration ends after that many seconds without an event. A watcher
        that falls a whole feed (``cache.watch_buffer`` events) behind receives one
        ``overflow`` event and continues from the newest; it should then re-read what it
        tracks. Writers are never slowed by a watcher. Raises InvalidKey, InvalidArgument.
        """
        if type(prefix) is not str:
            raise InvalidKey("a watch prefix is a str ('' watches every key)")
        if timeout is not None and (type(timeout) not in (int, float) or not timeout >= 0
                                    or timeout != timeout):
            raise InvalidArgument(f"timeout must be a number of seconds >= 0, got {timeout!r}")
        self._live()
        return self._watch(prefix, timeout, self._seg.feed_head())  # "from now": cursor taken here

    def _watch(self, prefix: str, timeout: float | None, cursor: int) -> Iterator[Event]:
        seg = self._seg
        last_event = time.monotonic()
        idle = 0.0001
        while not self._closed:
            if seg.purged:
                raise SegmentError(f"namespace {self.name!r} was purged while watched; "
                                   "open it again and watch anew")
            events, cursor, overflowed = seg.feed_read(cursor)
            got = False
            if overflowed:
                got = True
                yield Event("", "overflow", None)
            for ev in events:
                if ev.key.startswith(prefix):
                    got = True
                    yield Event(ev.key, KIND_NAMES[ev.kind], self._version(ev.counter, ev.hlc, b""))
            now = time.monotonic()
            if got:
                last_event = now
                idle = 0.0001
                continue
            if timeout is not None and now - last_event >= timeout:
                return
            time.sleep(idle)
            idle = min(idle * 2, 0.005)

