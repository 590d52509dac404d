"""Prefix scans: ``kv.scan(prefix, limit=, after=)``, every live key under a prefix, in order.

The contract
------------
``scan`` yields the live keys under ``prefix`` in key order (the order of their UTF-8
bytes, as etcd and Redis order them), each with its value and full Version, at most
``limit`` of them (a page) and only keys after ``after`` (the last key of the previous
page). Deleted keys never appear; a key written on this host, or (cluster mode)
acknowledged by L3, before the scan began and not deleted during it always appears.
Keys written while a scan runs may or may not appear; no key appears twice.

Embedded mode: the ordered index
--------------------------------
L2 is a hash table: its keys have no order, and listing them means walking every slot
(``Core.scan``: 1,000,000 keys take about a second). So each process keeps an ordered
index of the segment's keys (:class:`KeyIndex`, one per process and namespace, shared by
its clients, made at its first scan) and keeps it in step with the segment through the
change feed, the ring every write appends its event to under the writer lock:

* made: the feed head is read first, then every slot is walked once and the keys sorted;
* before every scan: the feed's events since the index's cursor are applied (a put adds
  its key, a delete or an eviction removes it). A write acknowledged before the scan
  began has its event below the head read then, so it is in the index;
* a cursor that fell a whole ring behind (``cache.watch_buffer`` events) or a repair of
  the segment (a ``resync`` event) rebuilds the index as when it was made.

A page then costs O(log n + events since the last scan + limit) instead of a walk of
every slot, and each key found is read from L2 (lock-free) so that what the index says
is never trusted: a key deleted since is skipped. Memory: one str per key of L2 (about
50 bytes + the key's length, in the process that scans, and only there) — bounded by the
segment's slots. A sorted index in the segment itself would be shared by all processes
but would make every write under the lock pay an ordered insert; the per-process index
costs only the processes that scan (see bench/bench_scan.py for figures).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from ..core.sortedkeys import SortedKeys
from ..errors import InvalidArgument, InvalidKey
from ..tiers.l2 import KIND_PUT, L2Segment
from .items import Item
from .watch import Watching

_CHUNK = 256  # keys taken from an index per step of an unlimited scan


class KeyIndex:
    """The ordered keys of one segment, for one process (see the module docstring).

    Thread-safe. Counters (``rebuilds``, ``events``) are for tests and benchmarks.
    """

    def __init__(self, seg: L2Segment) -> None:
        self._seg = seg
        self._lock = threading.Lock()
        self._keys: SortedKeys | None = None
        self._cursor = 0
        self.rebuilds = 0
        self.events = 0

    def sync(self) -> None:
        """Bring the index up to the feed's head now. Raises SegmentError."""
        with self._lock:
            if self._keys is None:
                self._rebuild()
                return
            events, cursor, overflowed = self._seg.feed_read(self._cursor)
            if overflowed:
                self._rebuild()
                return
            keys = self._keys
            for ev in events:
                if ev.kind == KIND_PUT:
                    keys.add(ev.key)
                else:  # a delete (a tombstone in cluster mode) or an eviction
                    keys.discard(ev.key)
            self.events += len(events)
            self._cursor = cursor

    def _rebuild(self) -> None:
        head = self._seg.feed_head()  # first: a write after it is applied from the feed
        self._keys = SortedKeys(self._seg.keys())
        self._cursor = head
        self.rebuilds += 1

    def range(self, prefix: str, after: str, limit: int) -> list[str]:
        """At most ``limit`` indexed keys under ``prefix`` after ``after``, in order."""
        with self._lock:
            return [] if self._keys is None else self._keys.range(after, prefix, limit)

    def __len__(self) -> int:
        with self._lock:
            return 0 if self._keys is None else len(self._keys)


def check_scan_args(prefix: Any, limit: Any, after: Any) -> None:
    """Raise InvalidKey / InvalidArgument for arguments ``scan`` does not take."""
    if type(prefix) is not str:
        raise InvalidKey(f"a scan prefix is a str ('' scans every key), got {type(prefix).__name__}")
    if limit is not None and (type(limit) is not int or limit < 1):
        raise InvalidArgument(f"limit is a page size, an int >= 1 (or None: no limit), got {limit!r}")
    if after is not None and type(after) is not str:
        raise InvalidArgument(f"after is the last key of the previous page (a str) or None, "
                              f"got {type(after).__name__}")


class Scanning(Watching):
    """Prefix scans."""

    def scan(self, prefix: str = "", *, limit: int | None = None,
             after: str | None = None) -> Iterator[Item]:
        """Every live key under ``prefix``, as Items in key order (by UTF-8 bytes).

        ``limit``: at most that many Items (a page); ``after``: only keys after it (the
        last key of the previous page). Deleted keys never appear; a key written on this
        host (or, in cluster mode, acknowledged by L3) before this call and not deleted
        since always appears. The index is brought up to date here, when ``scan`` is
        called, and the Items are read as the iterator is consumed. Embedded mode: a page
        costs O(log n + limit + writes since this process's last scan); see
        :mod:`kvcomm._client.scan`. Raises InvalidKey (a prefix that is not a str),
        InvalidArgument (a bad limit or after), SegmentError; nothing changes.
        """
        check_scan_args(prefix, limit, after)
        self._live()
        index = self._key_index()
        index.sync()
        return self._scan_local(index, prefix, after or "", limit)

    def _key_index(self) -> KeyIndex:
        att = self._attached
        with att.lock:
            if att.index is None:
                att.index = KeyIndex(self._seg)
            return att.index  # type: ignore[no-any-return]

    def _scan_local(self, index: KeyIndex, prefix: str, after: str,
                    limit: int | None) -> Iterator[Item]:
        left = limit if limit is not None else -1
        while left != 0:
            step = _CHUNK if left < 0 else min(left, _CHUNK)
            keys = index.range(prefix, after, step)
            if not keys:
                return
            for k in keys:
                item = self._get_slow(k, None, True, False)
                if item is not None:
                    yield item
                    left -= 1
                    if left == 0:
                        return
            after = keys[-1]
