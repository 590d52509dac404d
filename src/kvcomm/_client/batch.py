"""kv.batch(): writes collected in C (BatchOps), applied whole or not at all."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._l2core import BatchOps, WouldBlock
from ..core.codec import Packed
from ..core.expiry import check_ttl
from ..core.versions import Version
from ..errors import InvalidArgument
from ..tiers.shm.writes import ExpectFailed
from .base import _now_ms
from .items import ABSENT, Item
from .validators import _run_validator

if TYPE_CHECKING:
    from .write import Writes


class Batch(BatchOps):
    """Writes collected in a ``with kv.batch()`` block, applied whole or not at all.

    Each ``put``/``delete`` validates its key and encodes its value at once (so a bad value
    raises at its own line); nothing is stored unless the block exits without an exception.
    On exit, under one hold of the host's writer lock, every validator runs (against the
    value each operation replaces, earlier operations of the batch included) and space is
    found for every operation before the first is published: if anything fails (a
    validator, a value too large for L2, the outbound bound in cluster mode), nothing of
    the batch is written. Other processes may observe the keys change one by one while it
    is published.

    A batch is used once: after its block (applied, refused or abandoned by an exception)
    ``put``/``delete`` and another ``with`` raise InvalidArgument, and from a validator
    (while the batch is being applied) WriteUnderLock, an InvalidArgument; on a closed
    client they raise SegmentError at once.
    """

    # (class-level defaults: a batch sets them only when it uses them)
    _packed: memoryview | None = None  # per op, two u64: a put's counter and hlc, a delete's
    # counter
    _vvxs: tuple[()] | list[bytes | None] = ()
    _versions: list[Version | bool] | None = None
    _expects: list[tuple[str, Any, bool]] | None = None  # (key, Version or ABSENT, counted)
    # checked under the lock

    def __init__(self, client: Writes) -> None:
        # put() and delete() are the kernel's (BatchOps, in C): they validate and encode at
        # once, through the client's key memo and encoder; the client's getter (closed with
        # the client) tells them the client is still usable; every put carries the
        # writer's agent id (client._batch_ops: those arguments, made once)
        super().__init__(*client._batch_ops)
        self._client = client

    def _expect(self, key: str, expect: Any, count: bool = True) -> None:
        """Apply the batch only if ``key`` is at Version ``expect`` (or ABSENT) when it is
        applied, judged under the writer lock with the validators: ConflictError otherwise,
        nothing of the batch written. Embedded mode only (in cluster mode a compare-and-set
        is decided on L3: kv.put(..., expect=)); the LangGraph saver moves a thread's head
        so, in the batch that writes the checkpoint: one lock hold per step. ``count``
        False: a refusal is not counted in ``counters["conflicts"]`` (the saver's check
        that a task's writes are new: a task run again is no conflict)."""
        if self._client._cluster:
            raise InvalidArgument("a batch's compare-and-set is for embedded mode; in cluster "
                                  "mode use kv.put(key, value, expect=)")
        if self._expects is None:
            self._expects = []
        self._expects.append((key, expect, count))

    def put(self, key: str, value: Any, *, ttl: float | None = None) -> None:
        """Add a put of ``value`` under ``key``; with ``ttl`` (seconds, counted from this
        call) the key expires, without it the key is permanent (as :meth:`Client.put`).
        Raises InvalidKey, the value errors and InvalidArgument (a bad ttl, a used batch)
        at once; the batch is unchanged then."""
        if ttl is None:
            BatchOps.put(self, key, value)
            return
        ext = self._client._ext_with(ttl, None)
        BatchOps.put(self, key, value)
        op = self._ops[-1]
        self._ops[-1] = (*op[:5], ext)

    def _put_records(self, keys: list[str], records: list[list[Any]],
                     ttl: float | None = None) -> None:
        """A put of each record (a list of str, bytes and None fields) under its key, stored
        as :class:`~kvcomm.core.codec.Packed` stores it, in one call of the C kernel
        (KVCOMM's LangGraph saver: a checkpoint's records); with ``ttl``, one deadline for
        all, counted from this call. All or nothing: what raises (InvalidKey, the value
        errors, a bad ttl) leaves the batch as it was."""
        self._put_packed(keys, records, None if ttl is None else
                         self._client._ext_with(ttl, None))

    def _version_at(self, i: int) -> Version | bool:
        """``versions[i]`` without building the others (once applied)."""
        if self._versions is not None:
            return self._versions[i]
        c, w, vvx = self._client, self._packed, self._vvxs[i]
        assert w is not None
        return w[2 * i] > 0 if vvx is None else c._version(w[2 * i], w[2 * i + 1], vvx)

    @property
    def versions(self) -> list[Version | bool]:
        """Per operation, once applied: a put's Version, whether a delete deleted."""
        if self._versions is None:
            self._versions = [] if self._packed is None else [
                self._version_at(i) for i in range(len(self._vvxs))]
        return self._versions

    def __enter__(self) -> Batch:
        """Raises InvalidArgument for a batch used before (a batch is used once), SegmentError
        when its client is closed."""
        self._check()
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self._seal()  # no op may be added from here on (a validator adding one is refused)
        self._finish(exc_type is None)

    def _finish(self, apply: bool) -> None:
        """Apply the sealed batch (if ``apply``), then use it up. WouldBlock (kvcomm.aio's
        attempt on the event loop's thread met a held lock or the network) leaves it sealed
        and unused, nothing written: kvcomm.aio calls this again in a thread."""
        done = True
        try:
            if apply and len(self):
                self._apply()
        except WouldBlock:
            done = False
            raise
        finally:
            if done:
                self._done()

    def _apply(self) -> None:
        c = self._client
        c._live()
        if c._strong_on:
            for k in self._keys:
                if c._is_strong(k, None):
                    raise InvalidArgument(
                        f"{k!r} is a strong key (cache.strong_prefixes): a batch is applied "
                        "in L2, strong keys live in etcd; write it with put()/delete() "
                        "outside the batch (nothing of this batch was written)")
        t0 = _timed(c)
        check = None
        if c._has_validators and any(c._validators.lookup(k) is not None for k in self._keys):
            if c._cluster:  # bring L3's values into L2 for the validators
                for k in set(self._keys):
                    if c._validators.lookup(k) is not None:
                        c._get_slow(k, None, True)
            check = self._validate
        expects = None
        if self._expects is not None:  # (judged by the kernel when it can: _kernel_expects)
            expects = self._kernel_expects() if check is None else None
            if expects is None:
                check = self._guard(check)
        if c._cluster:
            if self._deletes:
                # deletes of keys this host does not hold cover L3's version (L2 holds it
                # after the read); one of a key L3 does not have either writes a tombstone
                # only over what the host holds when the batch applies, as kv.delete
                ops = self._ops
                for i, (key, op) in enumerate(zip(self._keys, ops, strict=True)):
                    if len(op) == 2 and c._get_slow(key, None, True) is None:
                        ops[i] = (op[0], op[1], False)
            for key in self._keys:
                c._negative.invalidate(key)  # this host holds them now: not "absent"
            if _now_ms() >= c._daemon_check_ms:
                c._check_daemon()
        # compact results: no tuple per op (a batch's versions are built only if asked)
        try:
            packed, self._vvxs = c._seg.apply(self._ops, now_ms=_now_ms(), dirty=c._cluster,
                                              max_dirty=c._max_dirty, tombstones=c._cluster,
                                              check=check, compact=True, expects=expects)
        except ExpectFailed as failed:
            self._conflict(failed.index)
            # (the key changed back since, or the kernel's judgement is stricter than
            # Python's (a version vector written in another form): Python's, under the lock)
            packed, self._vvxs = c._seg.apply(self._ops, now_ms=_now_ms(), dirty=c._cluster,
                                              max_dirty=c._max_dirty, tombstones=c._cluster,
                                              check=self._guard(None), compact=True)
        w = self._packed = memoryview(packed).cast("Q")
        _applied(c, len(self._vvxs) - self._deletes, t0)
        if self._deletes:
            for i, (key, vvx) in enumerate(zip(self._keys, self._vvxs, strict=True)):
                if vvx is None:
                    c._l1.discard(key)
                    c.counters["deletes"] += int(w[2 * i] > 0)

    def _kernel_expects(self) -> list[tuple[Any, ...]] | None:
        """The compare-and-sets of :meth:`_expect` as the C kernel judges them, under the
        writer lock without calling back into Python: ``(key_b, h)`` for ABSENT,
        ``(key_b, h, counter, hlc)`` for a Version of this host alone (every Version in
        embedded mode). None when one is of another form: :meth:`_guard` judges them."""
        c = self._client
        out: list[tuple[Any, ...]] = []
        for key, expect, _count in self._expects or ():
            kb, h = c._key_hash(key)
            judged = _kernel_expect(c, kb, h, expect)
            if judged is None:
                return None
            out.append(judged)
        return out

    def _conflict(self, index: int) -> None:
        """The kernel found ``self._expects[index]`` failed: raise its ConflictError as
        :meth:`_guard`'s check would (counted, naming the version the key is at now).
        Returns when Python's check holds now (see _apply)."""
        c = self._client
        assert self._expects is not None
        key, expect, count = self._expects[index]
        kb, h = c._key_hash(key)
        c._checker(key, kb, h, c._expect_fn(key, expect, count), None, None)()

    def _guard(self, validate: Callable[[], None] | None) -> Callable[[], None]:
        """What runs under the writer lock: each compare-and-set of :meth:`_expect`, then
        the validators (``validate``)."""
        c = self._client
        checks = []
        for key, expect, count in self._expects or ():
            kb, h = c._key_hash(key)
            checks.append(c._checker(key, kb, h, c._expect_fn(key, expect, count), None, None))
        if validate is not None:
            checks.append(validate)

        def check() -> None:
            for fn in checks:
                fn()

        return check

    def _validate(self) -> None:
        """Under the writer lock: every validator, in order, against the state the batch's
        earlier operations leave."""
        c = self._client
        pending: dict[str, Item | None] = {}
        for key, op, value in zip(self._keys, self._ops, self._values, strict=True):
            if type(value) is Packed:  # (encoded by its caller: the validator sees the value)
                value = value.value
            if key in pending:
                old = pending[key]
            else:
                rec = c._seg.read(op[0], op[1])
                old = c._item_of(key, rec)
            fn = c._validators.lookup(key)
            if fn is not None:
                _run_validator(fn, key, old, value)
            pending[key] = None if len(op) <= 3 else Item(key, value, Version((), 0), "batch")



def _kernel_expect(c: Writes, kb: bytes, h: int, expect: Any) -> tuple[Any, ...] | None:
    """A compare-and-set of key ``(kb, h)`` as the C kernel judges it: ``(kb, h)`` for
    ABSENT, ``(kb, h, counter, hlc)`` for a Version of this host alone (every Version in
    embedded mode); None for any other (Python's check judges it: Batch._guard)."""
    judged = _judged(c, expect)
    return None if judged is None else (kb, h, *judged)


def _judged(c: Writes, expect: Any) -> tuple[int, ...] | None:
    """``expect`` as the C kernel judges it: () for ABSENT, (counter, hlc) for a Version of
    this host alone; None for any other (see _kernel_expect)."""
    if expect is ABSENT:
        return ()
    if expect is c._stepped and expect is not None:  # (the Version put_records returned
        return expect[0][0][1], expect[1]  # last, of this host alone: its shape known)
    if type(expect) is not Version:
        return None  # (_guard raises InvalidArgument, or judges a subclass)
    vec, hlc = expect
    if not (type(vec) is tuple and len(vec) == 1 and type(vec[0]) is tuple
            and len(vec[0]) == 2 and vec[0][0] == c._host):
        return None
    counter = vec[0][1]
    if not (type(counter) is int and type(hlc) is int
            and 0 <= counter < 1 << 64 and 0 <= hlc < 1 << 64):
        return None
    return counter, hlc


def _timed(c: Writes) -> int:
    """perf_counter_ns() when this batch's turn to be timed (metrics) has come, else 0."""
    c._lat_left -= 1
    if c._lat_left > 0:
        return 0
    c._lat_left = c._lat_every
    return time.perf_counter_ns()


def _untimed(c: Writes, t0: int) -> None:
    """Give back the turn of latency sampling a batch took (``t0``: its _timed) when it
    applied nothing: the next batch is timed if this one was to be."""
    c._lat_left = 1 if t0 else c._lat_left + 1


def _applied(c: Writes, puts: int, t0: int) -> None:
    """Count a batch applied with ``puts`` puts (and its latency, when timed from ``t0``)."""
    c._puts += puts
    c.counters["batches"] += 1
    if c._default_strong:
        c.counters["puts_strong"] += puts
    if t0:
        c._note_latency("batch", "l2", time.perf_counter_ns() - t0)


def put_records(c: Writes, keys: list[str], records: list[list[Any]], ttl: float | None = None,
                *, absent: list[int] | range = range(0),
                last: tuple[str, Packed, Any, float | None] | None = None) -> Version | None:
    """The batch that KVCOMM's LangGraph saver writes at each step, applied::

        with c.batch() as b:
            b._put_records(keys, records, ttl)
            for j in absent:                   # (a task's writes: new keys only)
                b._expect(keys[j], ABSENT, count=False)
            if last is not None:               # (a checkpoint's: the thread head, moved
                key, value, expect, last_ttl = last  # by a compare-and-set)
                b.put(key, value, ttl=last_ttl)
                b._expect(key, expect)

    but with both ttls counted from one instant: with ``last_ttl <= ttl`` the head never
    expires before the records it names. Returns the Version of ``last``'s put (None
    without one). Same semantics, counters and errors as that batch (ConflictError,
    nothing written, when a compare-and-set fails). In embedded mode, with no validator
    registered and no strong key, it is one call of the C kernel, which judges the
    compare-and-sets under the writer lock, without the batch's general machinery (most
    of what a LangGraph step cost beyond InMemorySaver's); otherwise, or when the kernel
    finds a compare-and-set failed, it is that batch."""
    now = time.time()
    if not keys and last is None:  # (an empty batch: nothing applied, nothing counted)
        _deadline(now, ttl)
        return None
    if c._cluster or c._strong_on or c._has_validators:
        return _put_records_batch(c, keys, records, now, ttl, absent, last)
    head = None
    if last is not None:
        key, value, expect, last_ttl = last
        judged = _judged(c, expect)
        if judged is None:
            return _put_records_batch(c, keys, records, now, ttl, absent, last)
        try:
            head_ext = None if last_ttl is None else c._ext_with(None, _deadline(now, last_ttl))
        except InvalidArgument:  # (a bad head ttl: the batch says which input it finds
            return _put_records_batch(c, keys, records, now, ttl, absent, last)  # wrong first)
        head = (key, value, head_ext, judged)
    if c._unusable:
        c._live()
    if c._lat_left > 1:  # (_timed's countdown, inline: not this batch's turn)
        c._lat_left -= 1
        t0 = 0
    else:
        t0 = _timed(c)
    # (collect (validates, encodes: what a batch's own ops raise), lock, apply, unlock: one
    # call; no result: nothing written, see below)
    now_ms = int(now * 1000)  # (the records' clock and their ttls': one instant, one read)
    try:
        ops, expects, r = c._core_step(
            c._batch_ops, keys, records,
            None if ttl is None else c._ext_with(None, _deadline(now, ttl)),
            absent, head, now_ms, c._max_dirty, c._lock_timeout)
    except BaseException:  # (refused, nothing applied)
        _untimed(c, t0)
        raise
    if r is None:  # (the careful path: looks first, repairs, raises what a status means,
        try:  # or that the segment was closed meanwhile, by another thread)
            r = c._seg.apply(ops, now_ms=now_ms, max_dirty=c._max_dirty, compact=True,
                             expects=expects)
        except ExpectFailed:  # (nothing written: the batch judges it again, and says why)
            _untimed(c, t0)
            return _put_records_batch(c, keys, records, now, ttl, absent, last)
    packed, vvxs = r
    _applied(c, len(vvxs), t0)
    if last is None:
        return None
    w = memoryview(packed).cast("Q")
    version = c._version(w[-2], w[-1], vvxs[-1])
    c._stepped = None if vvxs[-1] else version  # (of this host alone: see _judged)
    return version


def _deadline(now: float, ttl: float | None) -> float | None:
    return None if ttl is None else now + check_ttl(ttl, allow_none=False)  # type: ignore[operator]


def _step_ops(c: Writes, b: BatchOps, keys: list[str], records: list[list[Any]], now: float,
              ttl: float | None, last: tuple[str, Packed, Any, float | None] | None) -> None:
    """Add put_records' puts to ``b``, their ttls counted from ``now``, each checked where
    the batch checks it (a ttl before its puts). Without a ttl (a LangGraph step's
    common case) no deadline is made."""
    if ttl is None:
        b._put_packed(keys, records)
    else:
        b._put_packed(keys, records, c._ext_with(None, _deadline(now, ttl)))
    if last is not None:  # (the head's own deadline, checked before its key)
        b._put_ext(last[0], last[1],
                   None if last[3] is None else c._ext_with(None, _deadline(now, last[3])))


def _put_records_batch(c: Writes, keys: list[str], records: list[list[Any]], now: float,
                       ttl: float | None, absent: list[int] | range,
                       last: tuple[str, Packed, Any, float | None] | None) -> Version | None:
    with c.batch() as b:
        _step_ops(c, b, keys, records, now, ttl, last)
        for j in absent:
            b._expect(keys[j], ABSENT, count=False)
        if last is not None:
            b._expect(last[0], last[2])
    return None if last is None else b._version_at(len(b) - 1)  # type: ignore[return-value]
