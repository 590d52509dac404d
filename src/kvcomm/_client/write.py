"""Writes: put, delete, update, batch; compare-and-set and validators run under the host's writer lock."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import CoroutineType
from typing import Any

from .._l2core import WouldBlock
from ..core.expiry import check_ttl
from ..core.versions import Version, vector_get
from ..errors import ConflictError, InvalidArgument, InvalidKey, Unavailable
from ..tiers.l2 import TAG_TOMBSTONE, Record
from . import counters
from .base import (
    _BYTES,
    _CONSISTENCY,
    _HUGE,
    _new_version,
    _now_ms,
)
from .batch import Batch
from .cas import ClusterWrites
from .items import _NO_CHECK, ABSENT, Item
from .validators import _MAX_UPDATE_RETRIES, _run_validator

_time_ns = time.time_ns


class Writes(ClusterWrites):
    """Writes."""

    def put(self, key: str, value: Any, *, consistency: str | None = None,
            expect: Any = _NO_CHECK, ttl: float | None = None,
            _deadline: float | None = None) -> Version:
        """Store ``value`` under ``key``; returns its Version.

        ``ttl`` (seconds): the key expires that long from now — every read, on every host,
        then finds it absent, and watchers see an ``expire`` event; None (the default)
        makes the key permanent, whatever deadline it had (as Redis SET). Raises
        InvalidArgument for a ttl that is not a finite number above 0 and at most ten
        years (``kvcomm.core.expiry.MAX_TTL``; NumPy numbers are numbers).

        ``expect`` is a Version from an earlier get_item/put, or ABSENT; on mismatch
        ConflictError is raised and nothing changes. In cluster mode an eventual key's
        ``expect`` is decided on the key's L3 master against the cluster's latest version
        (one round trip: two hosts never both win; _client/cas.py), and raises Unavailable
        at once in partition mode. ``consistency`` is "eventual" or
        "strong" (both linearizable on one host). A validator registered for the key's
        prefix runs under the host's writer lock, against the value this put replaces.
        Raises InvalidKey, UnsupportedValue, ValueTooLarge, ConflictError,
        ValidationError, Unavailable (L2 full of pinned or unflushed data; in cluster mode
        ``cluster.outbound_max`` writes waiting for L3), SegmentError; on any of them the
        stored data is unchanged.
        """
        if consistency is not None and consistency not in _CONSISTENCY:
            _bad_consistency(consistency)
        if self._unusable:
            self._live()
        self._lat_left -= 1
        if self._lat_left <= 0:  # this put's turn to be timed (metrics)
            return self._timed("put", self.put, key, value, consistency=consistency,  # type: ignore[no-any-return]
                               expect=expect, ttl=ttl, _deadline=_deadline)
        deadline = _deadline
        if ttl is not None:
            deadline = time.time() + check_ttl(ttl, allow_none=False)  # type: ignore[operator]
        ext = self._ext if deadline is None else self._extc.ext(deadline)
        if self._strong_on or consistency is not None and self._cluster:
            strong = self._is_strong(key, consistency)  # (validates the key)
            if strong:
                validator = self._validators.lookup(key) if self._has_validators else None
                version: Version = self._strong.put(key, value, self._encode(value), expect,
                                                    validator, deadline)
                self.counters["puts_strong"] += 1  # (metrics: agent.py)
                return version
        # the common case inline (a key seen before, a bytes value, no checks): every call
        # saved here is a tenth of a put
        kh = self._keys.get(key) if type(key) is str else None
        kb, h = kh if kh is not None else self._key_hash(key)
        payload: bytes | memoryview
        if type(value) is bytes and len(value) <= self._max_value:
            tag, meta, payload = _BYTES, b"", value
        else:
            tag, meta, payload = self._encode(value)
        now_ms = _time_ns() // 1_000_000
        if self._cluster:
            self._negative.invalidate(key)  # this host will hold it: no longer "absent"
            if now_ms >= self._daemon_check_ms:  # (once a second: is the daemon alive?)
                self._check_daemon(now_ms)
        if expect is not _NO_CHECK or self._has_validators:
            version = self._put_checked(key, kb, h, value, (tag, meta, payload), expect, ext)
            if consistency is not None or self._default_strong:
                self._count_consistency(consistency)
            return version
        r = self._core_put(kb, h, tag, meta, payload, now_ms,
                           self._dirty_flag, self._max_dirty, self._lock_timeout, ext)
        if type(r) is not tuple:  # purged, repair due, no room...: the careful path
            r = self._seg.put_status(r, kb, h, tag, meta, payload, _now_ms(), self._cluster,
                                     self._max_dirty, ext)
        self._puts += 1
        if consistency is not None or self._default_strong:
            self._count_consistency(consistency)
        if self._puts >= self._report_at:  # (an agent that only writes reports its load too)
            self._report_writes()
        if not r[2]:  # (no other host's entries: the Version without decoding anything)
            return _new_version(Version, (((self._host, r[0]),), r[1]))
        return self._version(r[0], r[1], r[2])

    def _count_consistency(self, consistency: str | None) -> None:
        """A put succeeded: count it as strong if it was (puts are eventual otherwise)."""
        if consistency == "strong" or (consistency is None and self._default_strong):
            self.counters["puts_strong"] += 1

    def _ext_with(self, ttl: Any, deadline: float | None) -> bytes:
        """This client's extension field with the deadline of ``ttl`` (from now) or the
        absolute ``deadline``. Raises InvalidArgument for a bad ttl."""
        if ttl is not None:
            deadline = time.time() + check_ttl(ttl, allow_none=False)  # type: ignore[operator]
        return self._extc.ext(deadline)

    def _put_checked(self, key: str, kb: bytes, h: int, value: Any,
                     encoded: tuple[int, bytes, bytes | memoryview], expect: Any,
                     ext: bytes) -> Version:
        """put() with expect= and/or a validator: both run under the writer lock (in
        cluster mode, expect= is decided on L3: _client/cas.py; the validator first)."""
        validator = self._validators.lookup(key) if self._validators else None
        if self._cluster and expect is not _NO_CHECK:
            self._validate_now(key, kb, h, validator, value)
            return self._cas_write(key, kb, h, encoded, expect, ext, value)
        cas = None if expect is _NO_CHECK else self._expect_fn(key, expect)
        if cas is None and validator is None:
            counter, hlc, vvx, _, _ = self._seg.put(kb, h, *encoded, _now_ms(), self._cluster,
                                                    self._max_dirty, ext)
            self._puts += 1
            return self._version(counter, hlc, vvx)
        if validator is not None and self._cluster:
            self._get_slow(key, None, True)  # bring L3's value into L2 for the validator
        check = self._checker(key, kb, h, cas, validator, value)
        counter, hlc, vvx, _, _ = self._seg.apply(
            [(kb, h, *encoded, ext)], now_ms=_now_ms(), dirty=self._cluster,
            max_dirty=self._max_dirty, check=check)[0]
        self._puts += 1
        return self._version(counter, hlc, vvx)

    def _validate_now(self, key: str, kb: bytes, h: int,
                      validator: Callable[[str, Item | None, Any], None] | None,
                      new_value: Any) -> None:
        """Run ``validator`` (if any) under the writer lock against the host's record of
        ``key``, L3's brought in first (before a conditional write decided on L3)."""
        if validator is not None:
            self._get_slow(key, None, True)
            self._seg.locked(self._checker(key, kb, h, None, validator, new_value))

    def _checker(self, key: str, kb: bytes, h: int, cas: Callable[[Record | None], None] | None,
                 validator: Callable[[str, Item | None, Any], None] | None,
                 new_value: Any) -> Callable[[], None]:
        """What runs under the writer lock before a write of ``key``: compare-and-set, then
        the validator against the value the write replaces."""
        def check() -> None:
            rec = self._seg.read(kb, h)
            if rec is not None and (rec.tag == TAG_TOMBSTONE or
                                    0 < rec.deadline <= time.time()):
                rec = None  # (an expired key is absent: expect=ABSENT succeeds over it)
            if cas is not None:
                cas(rec)
            if validator is not None:
                _run_validator(validator, key, self._item_of(key, rec), new_value)

        return check

    def _expect_fn(self, key: str, expect: Any,
                   count: bool = True) -> Callable[[Record | None], None]:
        if expect is not ABSENT and not isinstance(expect, Version):
            raise InvalidArgument(
                f"expect= takes a kvcomm.Version or kvcomm.ABSENT, got {type(expect).__name__}"
            )

        def check(rec: Record | None) -> None:
            if expect is ABSENT:
                if rec is not None:
                    self.counters["conflicts"] += count
                    raise ConflictError(f"{key!r} exists; expected it absent")
                return
            current = None if rec is None else self._version(rec.counter, rec.hlc, rec.vvx)
            if current != expect:
                self.counters["conflicts"] += count
                raise ConflictError(
                    f"{key!r} is at {current if current else 'absent'}, expected {expect}; "
                    "re-read it and retry"
                )

        return check

    def delete(self, key: str, *, expect: Any = _NO_CHECK) -> bool:
        """Remove ``key``. True when something was deleted; False for an absent key, an
        expired one included (its ``expire`` event is fed then, not a ``delete``). Raises
        as :meth:`put`.

        In cluster mode the delete is a tombstone kept in L2 (dirty, never evicted) until
        L3 has it, so it is as durable as a put; a key this host does not hold is looked up
        in L3 first, so that the delete covers the version the cluster has. With
        ``expect``, decided on L3 as :meth:`put`'s (with ABSENT it deletes nothing and
        returns False, or raises ConflictError).
        """
        return self._delete(key, expect) > 0

    def _delete(self, key: str, expect: Any = _NO_CHECK) -> int:
        """:meth:`delete`, returning the delete's write counter (0: nothing was there)."""
        self._live()
        self._lat_left -= 1
        if self._lat_left <= 0:  # this delete's turn to be timed (metrics)
            return self._timed("delete", self._delete, key, expect)  # type: ignore[no-any-return]
        if self._strong_on and self._is_strong(key, None):
            validator = self._validators.lookup(key) if self._has_validators else None
            return int(self._strong.delete(key, expect, validator))
        kb, h = self._key_hash(key)
        validator = self._validators.lookup(key) if self._validators else None
        if self._cluster and _now_ms() >= self._daemon_check_ms:
            self._check_daemon()
        if self._cluster and expect is not _NO_CHECK:  # (decided on L3: _client/cas.py)
            self._validate_now(key, kb, h, validator, None)
            self._l1.discard(key)
            version = self._cas_write(key, kb, h, None, expect, b"", None)
            return 0 if expect is ABSENT else vector_get(version.vector, self._host)
        cas = None if expect is _NO_CHECK else self._expect_fn(key, expect)
        if self._cluster and self._get_slow(key, None, True) is None:
            local = self._read_l2(kb, h, _HUGE)
            if (local is None or 0 < local[9] <= time.time()) and cas is None \
                    and validator is None:
                # absent here and in L3, or expired (its deadline reaches L3 with it, and
                # the sweep feeds its expire event): nothing to delete, nothing to tell L3
                return 0
        check = None if cas is None and validator is None else \
            self._checker(key, kb, h, cas, validator, None)
        ops: list[tuple[Any, ...]] = [(kb, h)]
        now_ms = _now_ms()
        if self._cluster:  # a counter's tombstone keeps what it saw: _client/counters.py
            check = counters.delete_check(self._seg, kb, h, ops, now_ms, check)
        r = self._seg.apply(ops, now_ms=now_ms, dirty=self._cluster, max_dirty=self._max_dirty,
                            tombstones=self._cluster, check=check)[0]
        counter: int = r if type(r) is int else r[0]
        self._l1.discard(key)
        if counter:
            self.counters["deletes"] += 1
        return counter

    def update(self, key: str, fn: Callable[[Any], Any], *, default: Any = None,
               ttl: float | None = None) -> Any:
        """Atomic read-modify-write: stores and returns ``fn(old value or default)``.

        To count (exactly across hosts too, and on through a partition), use :meth:`incr`;
        ``update`` is for a conditional read-modify-write of any value.

        ``fn`` may run more than once when other writers race; it must not have side
        effects. No increment is ever lost, whatever the number of processes — and, in
        cluster mode, of hosts: each attempt is a conditional write decided on the key's
        L3 master (one round trip; a conflict brings L3's value in for the next attempt),
        and in partition mode it raises Unavailable at once, nothing written. The key keeps
        its deadline unless ``ttl`` (seconds from now) is given; an expired key counts as
        absent. Raises InvalidArgument when ``fn`` is not callable or ``ttl`` is bad, and
        what :meth:`put` raises.
        """
        if not callable(fn):
            raise InvalidArgument(f"update() needs a callable, got {type(fn).__name__}")

        check_ttl(ttl)
        self._lat_left -= 1
        if self._lat_left <= 0:  # this update's turn to be timed (metrics)
            return self._timed("update", self.update, key, fn, default=default, ttl=ttl)
        self.counters["updates"] += 1
        try:
            for _ in range(_MAX_UPDATE_RETRIES):
                item = self.get_item(key)
                new = fn(default if item is None else item.value)
                if type(new) is CoroutineType:  # (an async def: stored, it would be refused
                    new.close()  # as a value of type coroutine, naming no fix)
                    raise InvalidArgument("update()'s function is a plain function, not an "
                                          "async def (it may run more than once): await what "
                                          "it needs first, then update(key, lambda old: ...)")
                try:
                    self.put(key, new, expect=ABSENT if item is None else item.version,
                             ttl=ttl, _deadline=None if ttl is not None or item is None
                             else item.expires_at)
                    return new
                except ConflictError:
                    continue
        except WouldBlock:  # (kvcomm.aio runs the update again, off its loop: counted once)
            self.counters["updates"] -= 1
            raise
        raise Unavailable(f"update of {key!r} lost {_MAX_UPDATE_RETRIES} races in a row")

    def touch(self, key: str, ttl: float | None) -> bool:
        """Set (or extend, or shorten) ``key``'s deadline to ``ttl`` seconds from now; None
        makes it permanent. The value stays; the key gets a new version (a touch is a
        write, and wins over older writes as one). Returns False when the key is absent
        (or already expired): nothing is written then. A conditional write of the value
        read (in cluster mode decided on L3, as ``put(..., expect=)``: it never brings back
        a value another host replaced; Unavailable in partition mode). Raises
        InvalidArgument for a bad ttl, and what :meth:`put` raises.
        """
        check_ttl(ttl)
        for _ in range(_MAX_UPDATE_RETRIES):
            item = self.get_item(key)
            if item is None:
                return False
            try:
                self.put(key, item.value, expect=item.version, ttl=ttl)
                return True
            except ConflictError:
                continue
        raise Unavailable(f"touch of {key!r} lost {_MAX_UPDATE_RETRIES} races in a row")

    def batch(self) -> Batch:
        """``with kv.batch() as b: b.put(...); b.delete(...)`` — applied whole, or not at all."""
        self._live()
        return Batch(self)

    def register_validator(self, prefix: str, fn: Callable[[str, Item | None, Any], None]) -> None:
        """Run ``fn(key, old_item, new_value)`` before every write under ``prefix`` in this
        client; raising rejects the write with ValidationError (``new_value`` is None for a
        delete). The longest matching prefix wins.

        ``fn`` runs under the host's L2 writer lock, against exactly the value the write
        replaces (in a batch, earlier operations of the batch on the same key count, with an
        empty version). It may read from KVCOMM but not write: a write from it (into the
        batch it vets, too) raises WriteUnderLock, an InvalidArgument, out of the write being
        vetted, which then changes nothing. It should be quick: every writer on the host
        waits for it.
        """
        if type(prefix) is not str:
            raise InvalidKey("a validator prefix is a str ('' matches every key)")
        if not callable(fn):
            raise InvalidArgument("register_validator needs a callable")
        self._validators.set(prefix, fn)
        self._has_validators = True



def _bad_consistency(consistency: Any) -> None:
    raise InvalidArgument(f"consistency must be 'eventual' or 'strong', got {consistency!r}")
