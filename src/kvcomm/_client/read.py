"""Reads: get and get_item through L1, L2 (zero-copy views of large arrays) and, on a miss, the cluster."""

from __future__ import annotations

import time
from typing import Any

from .._l2core import WouldBlock, approx_size
from ..core import codec
from ..errors import InvalidKey, KVCommError, SegmentError
from ..tiers.l2 import TAG_TOMBSTONE
from .attach import _register_view
from .base import _BYTES, _NDARRAY
from .cluster_read import ClusterReads, L3Read
from .items import Item

_UNREAD: Any = object()  # (_get_slow: no record handed in, L2 is read)


class Reads(ClusterReads):
    """Reads."""

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key``, or ``default`` when absent.

        Treat the returned object as read-only: L1 hands the same decoded object to every
        caller in this process. Arrays of ``network.zero_copy_threshold`` bytes or more
        are read-only views of shared memory. Raises InvalidKey, SegmentError (purged or
        corrupt namespace), Unavailable (cluster mode: L3 unreachable on an L2 miss),
        CorruptRecord (cluster mode: L3 holds something that is not a KVCOMM record).
        """
        try:
            e = self._l1_entries.get(key)
        except TypeError:
            raise InvalidKey(f"keys are str, got {type(key).__name__}") from None
        if e is not None and self._q[e[1]] == e[2] and (len(e) < 8 or e[7] > time.time()):
            self._l1_hits += 1
            return e[0]
        return self._get_slow(key, default, False)

    def get_item(self, key: str) -> Item | None:
        """The value with its Version and the tier that served it, or None when absent."""
        if self._lat_left <= 1:  # this read's turn to be timed (metrics): either path below
            # counts down once (the L1 hit here, the slow path in _get_slow), reaching 0
            return self._timed("get", self.get_item, key)  # type: ignore[no-any-return]
        try:
            e = self._l1_entries.get(key)
        except TypeError:
            raise InvalidKey(f"keys are str, got {type(key).__name__}") from None
        if e is not None and self._q[e[1]] == e[2] and (len(e) < 8 or e[7] > time.time()):
            self._l1_hits += 1
            self._lat_left -= 1  # (the slow path counts itself down in _get_slow)
            return Item(key, e[0], self._version(e[4], e[5], e[6]), "l1",
                        e[7] if len(e) > 7 else None)
        return self._get_slow(key, None, True)  # type: ignore[no-any-return]

    def _get_slow(self, key: str, default: Any, want_item: bool, l3: bool = True,
                  rec: Any = _UNREAD) -> Any:
        """L2 (then, in cluster mode and if ``l3``, L3) lookup; the value, or an Item.
        ``rec``: what the caller's L2 read of the key has just returned (``_read_l2``'s
        record at ``self._zc``, or None: no record), a read this one need not repeat."""
        if self._unusable:
            self._live()
        self._lat_left -= 1
        if self._lat_left <= 0:  # this read's turn to be timed (metrics): as an Item (its tier)
            try:
                item = self._timed("get", self._get_slow, key, None, True, l3)
            except L3Read as read:  # (kvcomm.aio's gathered read times it: _get_l3_many)
                read.timed = True
                raise
            return item if want_item else default if item is None else item.value
        if self._strong_on and self._is_strong(key, None):
            item = self._strong.get_item(key)
            if want_item:
                return item
            return default if item is None else item.value
        kb, h = self._key_hash(key)
        self._getter.sampled(key)
        if rec is _UNREAD:
            rec = self._read_l2(kb, h, self._zc)
        # rec: (word, seq, tag, meta, value, counter, hlc, vvx, size, deadline)
        deadline = 0.0 if rec is None else rec[9]
        if deadline and deadline <= time.time():
            self._expired_seen(key, kb, h, rec)
            self._l2_misses += 1
            self.counters["l2_absent"] += 1
            return None if want_item else default  # expired: a tombstone at its version
        if rec is None or rec[2] == TAG_TOMBSTONE:
            self._l2_misses += 1
            if rec is None and self._cluster and l3:
                try:
                    return self._get_l3(key, default, want_item)
                except WouldBlock:  # (kvcomm.aio runs the read again, off its loop)
                    self._l2_misses -= 1
                    raise
            self.counters["l2_absent"] += 1
            return None if want_item else default  # a tombstone: deleted here, L3 told soon
        self._l2_hits += 1
        tag = rec[2]
        raw = rec[4]
        if raw is None:  # a large array: a zero-copy view
            return self._get_view(key, kb, h, default, want_item, deadline or None)
        value = raw if tag == _BYTES else self._decode(key, tag, rec[3], raw)
        if tag != _NDARRAY and self._l1_on:
            entry = (value, rec[0], rec[1], approx_size(value), rec[5], rec[6], rec[7])
            # (a deadline: the entry carries it as an 8th element, and no hit outlives it)
            self._l1.store(key, (*entry, deadline) if deadline else entry)
        if not want_item:
            return value
        return Item(key, value, self._version(rec[5], rec[6], rec[7]), "l2", deadline or None)

    def _expired_seen(self, key: str, kb: bytes, h: int, rec: Any) -> None:
        """A read found ``key``'s record past its deadline: reclaim it now (lazily, on
        access; an ``expire`` event), if it is clean and the writer lock is free — a read
        never waits for a writer; the sweep (sweeper.py) gets it otherwise."""
        self._l1.discard(key)
        if rec[2] == TAG_TOMBSTONE:
            return
        seg = self._seg
        core = seg._core
        try:
            if seg._try_lock():
                core.expire_key(kb, h, time.time())
        except KVCommError:
            pass  # (purged, damaged: the next read or write says so)
        finally:
            core.unlock()

    def _get_view(self, key: str, kb: bytes, h: int, default: Any, want_item: bool,
                  deadline: float | None = None) -> Any:
        """A large array: pin its block and hand out a read-only view of shared memory.

        The record may have been replaced between the read and the pin (by a small value,
        another type, a tombstone): what is pinned is checked again and, if it is no longer
        a large array, decoded from a copy instead.
        """
        seg = self._seg
        core = seg._core  # (the pin's, whatever a close in another thread does meanwhile)
        try:  # (the pin is dropped on any exception, KeyboardInterrupt included, until a
            #   view owns it: core.pin_kept in _register_view)
            r = seg.pin(kb, h)
            if r is None:
                return None if want_item else default
            tag, meta, pin, buf = r[2], r[3], r[8], r[9]
            if tag != _NDARRAY or len(buf) < self._zc:
                arr = self._decode(key, tag, meta, bytes(buf))  # replaced meanwhile
            else:
                try:
                    arr = codec.array_view(meta, buf)
                except ValueError as exc:
                    raise SegmentError(f"stored array of {key!r} is malformed ({exc})") from None
                if pin[0] < 0:  # the pin table was full: ``buf`` is already a private copy
                    arr = arr.copy()
                    arr.flags.writeable = False
                else:
                    _register_view(arr, core, pin)
                    self.counters["views"] += 1
        finally:
            if core is not None:
                core.drop_pending()
        if not want_item:
            return arr
        return Item(key, arr, self._version(r[4], r[5], r[6]), "l2", deadline)

