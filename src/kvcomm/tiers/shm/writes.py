"""Writes under the writer lock: one put in one C call, a batch all or nothing,
and what a refused write means."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...errors import SegmentError, Unavailable, ValueTooLarge
from .layout import FLAG_DIRTY, STATE_OK, H
from .segment import (
    _H_BUSY,
    _H_DEFERRED,
    _H_STATE,
    ST_CONFLICT,
    ST_DIRTY_FULL,
    ST_FULL,
    ST_LOOK,
    ST_SLOT_FULL,
    ST_TOO_LARGE,
    SegmentCore,
)

_H_EXPIRY_NEXT = H["EXPIRY_NEXT"]


class ExpectFailed(Exception):
    """:meth:`Writes.apply`'s ``expects[index]`` did not hold: nothing was written (the
    caller raises the ConflictError, naming the key)."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.index = index


class Writes(SegmentCore):
    """Writes under the writer lock."""

    def put(self, key_b: bytes, h: int, tag: int, meta: bytes, value: bytes | memoryview,
            now_ms: int, dirty: bool, max_dirty: int,
            ext: bytes = b"") -> tuple[int, int, bytes, int, int]:
        """Store one record: ``(counter, hlc, vvx, slot word, seq)``; ``ext`` is its
        extension field (b"": none). One C call in the common case. Raises ValueTooLarge,
        Unavailable, SegmentError; on any error nothing changed."""
        r = self._core.put(key_b, h, tag, meta, value, now_ms, FLAG_DIRTY if dirty else 0,
                           max_dirty, self.lock_timeout, ext)
        if type(r) is tuple:
            return r
        return self.put_status(r, key_b, h, tag, meta, value, now_ms, dirty, max_dirty, ext)

    def put_status(self, r: int, key_b: bytes, h: int, tag: int, meta: bytes,
                   value: bytes | memoryview, now_ms: int, dirty: bool,
                   max_dirty: int, ext: bytes = b"") -> tuple[int, int, bytes, int, int]:
        """The kernel's put answered status ``r`` (nothing written): look first and write
        (ST_LOOK), or raise what the status means."""
        op = (key_b, h, tag, meta, value, ext)
        if r == ST_LOOK:  # purged, repair or pins first: the general path does it
            out: tuple[int, int, bytes, int, int] = self.apply(
                [op], now_ms=now_ms, dirty=dirty, max_dirty=max_dirty)[0]
            return out
        self._raise_status(r, 0, [op], dirty, max_dirty)
        raise AssertionError("unreachable")

    def apply(self, ops: list[tuple[Any, ...]], *, now_ms: int, dirty: bool = False,
              max_dirty: int = 0, tombstones: bool = False,
              check: Callable[[], None] | None = None, compact: bool = False,
              expects: list[tuple[Any, ...]] | None = None) -> Any:
        """Apply ``ops`` under one lock, all or nothing.

        Ops: ``(key_b, h)`` delete, ``(key_b, h, tag, meta, value)`` put, or
        ``(key_b, h, tag, meta, value, counter, hlc, vvx)`` put with a given version (tag 0:
        a tombstone with that version); either put may end with ``ext``, the record's
        extension field (bytes: an encoded msgpack map, stored as it is; see
        :meth:`version`). A given version's counter is at most MAX_COUNTER (or NEW_DOT).
        ``tombstones``: deletes leave dirty tombstones (cluster mode). ``check`` runs under
        the lock before anything changes (validators, compare-and-set) and may raise to
        abort. ``expects``, a compare-and-set judged by the kernel after ``check``:
        ``(key_b, h)`` for absent, ``(key_b, h, counter, hlc)`` for this host's Version
        ``((host, counter),), hlc)``; the first that fails raises :class:`ExpectFailed`
        (its index), nothing changed. Returns per op ``(counter, hlc, vvx, word,
        seq)`` for a put, the delete's counter (0: nothing to delete) for a delete; with
        ``compact``, ``(packed, vvxs)`` instead: two native u64 per op in ``packed`` (a put's
        counter and hlc, a delete's counter and 0) and each put's vvx (None for a delete).
        Raises ValueTooLarge, Unavailable, SegmentError, InvalidArgument (an extension
        field L3's readers would refuse, a counter over MAX_COUNTER), or what ``check``
        raises; on any error nothing changed (clean entries may have been evicted to make
        room).
        """
        core = self._core
        if core is None:  # (closed by another thread since its caller checked)
            raise self._closed("this write was under way; nothing was written")
        flags = FLAG_DIRTY if dirty else 0
        try:
            self._lock()
            if check is not None:
                check()
            for attempt in range(2):
                try:
                    r = core.apply(ops, now_ms, flags, max_dirty, tombstones, compact, expects)
                    break
                except SegmentError:
                    if attempt or not self._q[_H_BUSY] or self._q[_H_STATE] != STATE_OK:
                        raise
                    self._recover()  # corruption found before anything was published
            if not (type(r) is tuple and type(r[0]) is int):
                return r
        finally:
            core.unlock()
        # (status, index): nothing written. Raised outside the writer lock: a refusal at
        # cluster.outbound_max reads the node daemon's status file for its message
        if r[0] == ST_CONFLICT:
            raise ExpectFailed(r[1])
        self._raise_status(r[0], r[1], ops, dirty, max_dirty)
        raise AssertionError("unreachable")

    def _raise_status(self, status: int, index: int, ops: list[tuple[Any, ...]], dirty: bool,
                      max_dirty: int) -> None:
        """Raise what the kernel's status means for ``ops`` (``dirty``: cluster mode, whose
        writes wait for L3)."""
        op = ops[index] if 0 <= index < len(ops) else ops[-1]
        key = bytes(op[0]).decode("utf-8", "replace")
        batch = len(ops) > 1
        if status == ST_TOO_LARGE:
            size = len(op[4]) if len(op) > 3 else 0
            if len(ops) > 1:
                raise ValueTooLarge(
                    f"this batch cannot fit in L2 of {self.name!r} (largest block "
                    f"{self._max_record} bytes, heap {self.layout.data_size} bytes; at {key!r}, "
                    f"{size} value bytes); raise cache.l2_size or split it. Nothing was written")
            raise ValueTooLarge(
                f"a record of {size} value bytes can never fit in L2 of {self.name!r} "
                f"(largest block {self._max_record} bytes); raise cache.l2_size or store less")
        if status == ST_DIRTY_FULL:
            raise Unavailable(
                f"{self._q[H['DIRTY']]} writes on this host are waiting for L3 (bound "
                f"{max_dirty}, cluster.outbound_max); {self._held_back()}. Nothing was written")
        if status == ST_SLOT_FULL:
            # (what can hold a window's slots: writes waiting for L3 only where there are
            # any, which embedded mode never has, pins, and the batch's own new keys)
            unflushed = dirty or self._q[H["DIRTY"]] > 0
            held = ["writes not yet in L3"] if unflushed else []
            held.append("entries pinned by zero-copy views")
            hints = ["retry after the node daemon syncs"] if unflushed else []
            if batch:
                held.append("new keys of this batch")
                hints.append("split the batch")
            hints.append("release views or raise cache.l2_size")
            raise Unavailable(
                f"the L2 hash window of {key!r} has no slot left that can be evicted (held by "
                f"{', '.join(held)}); {', '.join(hints)}. Nothing was written")
        if status == ST_FULL:
            raise Unavailable(
                f"L2 of {self.name!r} is full: {self._q[_H_DEFERRED]} blocks are pinned by "
                "zero-copy views and the rest cannot be evicted (unflushed or pinned); release "
                "views or raise cache.l2_size. Nothing was written")
        raise SegmentError(f"L2 of {self.name!r} refused a write (status {status}); purge it")

    def _held_back(self) -> str:
        """What holds this host's writes back from L3, as the host's node daemon last told
        (its status file), with what to do: for the message of a write refused at
        ``cluster.outbound_max``. Never raises; bounded (the file is another process's)."""
        from ...node.presence import (
            masters_down_text,
            read_status,
            starting_status,
            starting_text,
            status_fresh,
        )
        from .files import status_path

        path = status_path(self.name, self.directory)
        word = starting_status(path)
        if word is not None:
            return (f"the node daemon runs but has not started ({starting_text(word)}): they "
                    "are sent once it reaches L3; check cluster.redis and that the cluster "
                    "is up")
        st = read_status(path)
        if st is None or not status_fresh(st):
            return (f"is `kvcomm node` running for namespace {self.name!r} and the cluster up? "
                    "Start it, or retry once it has sent them")
        if st.get("partition"):
            reason = "".join(c if c.isprintable() else "?"
                             for c in str(st.get("partition_reason"))[:200])
            return (f"the node daemon is in partition mode ({reason}): they "
                    "are sent once Redis answers again; retry then, or raise "
                    "cluster.outbound_max for a longer outage")
        down = masters_down_text(st)
        if down:
            return (f"the node daemon finds Redis master(s) {down} not "
                    "answering: the writes of their keys wait (parked; the other masters' writes "
                    "go on) until those answer or fail over; retry then, or raise "
                    "cluster.outbound_max to outlast such a hang")
        return ("the node daemon is sending them (L3 slower than this host writes?); retry "
                "shortly, or raise cluster.outbound_max")

    def mark_clean(self, key_b: bytes, h: int, counter: int, hlc: int) -> bool:
        """Clear the dirty flag if the key still holds the write (counter, hlc)."""
        core = self._core
        try:
            self._lock()
            return bool(core.mark_clean(key_b, h, counter, hlc))
        finally:
            core.unlock()

    def expire(self, key_b: bytes, h: int, now: float) -> bool:
        """Reclaim ``key_b``'s record if it is past its deadline at ``now`` (epoch seconds)
        and clean, feeding an ``expire`` event; False when it is absent, live, dirty (it
        reaches L3 first) or a tombstone. Raises Unavailable (lock held too long),
        SegmentError (purged)."""
        core = self._core
        try:
            self._lock()
            return bool(core.expire_key(key_b, h, float(now)))
        finally:
            core.unlock()

    def expiry_due(self, now: float) -> bool:
        """Whether a clean record may be past its deadline at ``now`` (epoch seconds): the
        segment's expiry hint (tiers/shm/layout.py), read without the lock. False means
        no record can have expired: a sweep has nothing to do."""
        nxt = self._q[_H_EXPIRY_NEXT]
        return bool(nxt) and nxt <= now * 1000.0

    def sweep_expired(self, count: int, now: float) -> tuple[int, int, bool] | None:
        """One slice of the host's expiry pass: look at ``count`` slots from where the last
        slice of any process stopped and reclaim every clean record past its deadline at
        ``now`` (an ``expire`` event each). Returns (records reclaimed, bytes freed, whether
        the slice ended a pass over the whole table), or None when the writer lock is busy
        now (the sweep never waits for writers). Raises SegmentError (purged)."""
        core = self._core
        try:
            if not self._try_lock():
                return None
            return core.sweep_expired(count, float(now))  # type: ignore[no-any-return]
        finally:
            core.unlock()

    def quiet(self) -> None:
        """From now on, the calling thread's reads and writes of L2 through this segment
        (of this process: clients of one namespace share it) leave keys' reference bits
        as they are, or unset for a key it brings in (the node daemon's loop:
        :meth:`take_reads` then tells whether an agent read a key). One thread at a time.
        Never raises."""
        self._core.set_quiet(True)

    def take_reads(self, keys: list[tuple[bytes, int]]) -> list[int]:
        """For each (key, hash) of ``keys``: -1 when L2 does not hold it, else 1 if it
        was read (or written) since the last take_reads of it and 0 if not (its CLOCK
        reference bit, cleared here; a quiet thread's reads and writes leave it be).
        One hold of the writer lock for all. Raises Unavailable (lock held too long),
        SegmentError (purged)."""
        core = self._core
        try:
            self._lock()
            return [core.take_ref(kb, h) for kb, h in keys]
        finally:
            core.unlock()

    def evict(self, key_b: bytes, h: int) -> bool:
        """Drop ``key_b``'s record from this host's L2 if it is clean (a local eviction);
        False when it is absent or dirty."""
        core = self._core
        try:
            self._lock()
            return bool(core.evict_key(key_b, h))
        finally:
            core.unlock()

