"""The client every agent opens: ``kvcomm.open()`` → :class:`Client`.

Read path: L1 (this process, revalidated by one shared-memory word) → L2 (this host's
segment, lock-free) → (cluster mode) L3. Write path: validate and encode here, then one
locked copy-on-write store into L2. Everything shared is checked on the way in, so an
error never leaves a half-done write behind.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ._extras import require_cluster
from ._l2core import BatchOps, Getter, approx_size
from .config import Config, load_config
from .core import codec
from .core.negative import NegativeCache
from .core.resolve import PrefixTable, Sibling
from .core.resolve import resolve as resolve_siblings
from .core.versions import (
    Dotted,
    Ordering,
    Version,
    compare_vectors,
    decode_others,
    encode_others,
    merge_vectors,
    vector_get,
)
from .errors import (
    ConflictError,
    InvalidArgument,
    InvalidKey,
    KVCommError,
    KVCommWarning,
    SegmentError,
    Unavailable,
    ValidationError,
    ValueTooLarge,
)
from .tiers import l2 as l2mod
from .tiers.l1 import L1Cache, process_budget
from .tiers.l2 import KIND_NAMES, TAG_TOMBSTONE, L2Segment, Layout, Record, key_hash

_new_version = tuple.__new__  # skips NamedTuple's Python-level __new__
_BYTES, _NDARRAY = codec.BYTES, codec.NDARRAY
_CONSISTENCY = (None, "eventual", "strong")
_MAX_UPDATE_RETRIES = 100_000
_KEY_MEMO = 65536  # validated keys remembered per client (cleared when full)
# An L3 read fills L2 only if it took less than this: the node daemon applies a remote
# change of a key not held here over a fill for 30 s (node/daemon.py RECENT_S)
_FILL_WITHIN = 10.0


class _Absent:
    """``expect=kvcomm.ABSENT``: the write succeeds only if the key does not exist."""

    _instance: _Absent | None = None

    def __new__(cls) -> _Absent:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "kvcomm.ABSENT"

    def __reduce__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()
_NO_CHECK: Any = object()


@dataclass(frozen=True, slots=True)
class Item:
    """One stored value with its version and the tier that served it."""

    key: str
    value: Any
    version: Version
    tier: str  # "l1" | "l2" | "l3"


@dataclass(frozen=True, slots=True)
class Event:
    """A change seen by :meth:`Client.watch`. ``overflow`` has key "" and version None."""

    key: str
    kind: str  # "put" | "delete" | "evict" | "overflow"
    version: Version | None


class _Attached:
    """A namespace this process has mapped: its segment, its L1 and how many clients use it."""

    __slots__ = ("seg", "l1", "refs")

    def __init__(self, seg: L2Segment, l1: L1Cache) -> None:
        self.seg, self.l1, self.refs = seg, l1, 0


class _Shared:
    """One L2 mapping and one L1 per (process, namespace), shared by every Client on it."""

    lock = threading.Lock()
    attached: dict[str, _Attached] = {}

    @classmethod
    def acquire(cls, name: str, config: Config) -> _Attached:
        with cls.lock:
            entry = cls.attached.get(name)
            if entry is not None and entry.seg.purged:
                del cls.attached[name]  # its clients keep it (and get SegmentError) until closed
                entry = None
            if entry is None:
                c = config.cache
                layout = Layout.plan(c.l2_size, c.max_key_bytes, c.watch_buffer, c.max_views,
                                     c.max_value_size)
                seg = l2mod.open_segment(name, layout, config.node.host_id, c.l2_permissions,
                                         directory=c.l2_dir, lock_timeout=c.lock_timeout)
                entry = cls.attached[name] = _Attached(seg, process_budget().cache())
            entry.refs += 1
            return entry

    @classmethod
    def release(cls, entry: _Attached) -> None:
        with cls.lock:
            entry.refs -= 1
            if entry.refs > 0:
                return
            if cls.attached.get(entry.seg.name) is entry:
                del cls.attached[entry.seg.name]
        process_budget().drop(entry.l1)
        entry.seg.close()


_CLIENTS: weakref.WeakSet[Client] = weakref.WeakSet()
# live zero-copy views: id(weakref) -> (weakref, segment, (pin index, hazard word))
_VIEWS: dict[int, tuple[Any, L2Segment, tuple[int, int]]] = {}


def _register_view(arr: Any, seg: L2Segment, pin: tuple[int, int]) -> None:
    """Tie ``pin`` to the life of ``arr``: released when the last reference goes. Once
    registered, the pin is the view's (``seg.pin_kept``): no longer the caller's to drop."""
    def unpin(ref: Any) -> None:
        _VIEWS.pop(id(ref), None)
        # (exactly this pin: never a later pin of the same entry, never the parent's in a
        # forked child)
        seg.unpin(*pin)

    # a weakref callback costs a tenth of weakref.finalize; the registry keeps the weakref
    ref = weakref.ref(arr, unpin)
    _VIEWS[id(ref)] = (ref, seg, pin)
    seg.pin_kept()


def _mark_forked() -> None:
    """In a child of fork(): the parent's clients are unusable here (their locks and caches
    are the parent's), and the views the child inherited get pins of their own, so they stay
    valid when the parent drops its copies (and the child dropping them frees nothing of
    the parent's)."""
    for c in list(_CLIENTS):
        c._forked = c._unusable = True
        c._l1_entries = {}
        c._getter.close()
        c.__dict__.pop("get", None)
    _Shared.attached = {}
    _Shared.lock = threading.Lock()
    process_budget().forget()
    inherited = list(_VIEWS.values())
    _VIEWS.clear()
    for ref, seg, pin in inherited:
        arr = ref()
        if arr is None or seg._core is None:
            continue
        try:
            new = seg.repin([pin[0]])[0]
        except KVCommError as exc:
            warnings.warn(f"a zero-copy view inherited through fork() could not be pinned "
                          f"({exc}); copy it if the child keeps it", KVCommWarning, stacklevel=1)
            continue
        if new[0] >= 0:
            _register_view(arr, seg, new)


os.register_at_fork(after_in_child=_mark_forked)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class _TombstoneValue:
    """The value of a local tombstone while a merge weighs it against a remote version."""

    def __repr__(self) -> str:
        return "<deleted>"


_TOMBSTONE = _TombstoneValue()
_TOMB_ENCODED: tuple[int, bytes, bytes] = (TAG_TOMBSTONE, b"", b"")
_HUGE = 1 << 62


class Client:
    """An agent's handle on KVCOMM. Thread-safe. Use :func:`kvcomm.open` to make one."""

    def __init__(self, name: str = "default", config: Config | None = None) -> None:
        self.config = config or Config()
        self.name = name
        c = self.config.cache
        self._attached = _Shared.acquire(name, self.config)
        self._seg = self._attached.seg
        self._core_read = self._seg._core.read
        self._q = self._seg._q
        self._host = self._seg.host_id
        self._l1 = self._attached.l1
        self._l1_on = c.l1_size > 0
        process_budget().register(c.l1_size)
        self._l1_entries = self._l1.entries if self._l1_on else {}
        self._max_key = min(c.max_key_bytes, self._seg.layout.max_key)
        self._max_value = c.max_value_size
        self._zc = self.config.network.zero_copy_threshold
        self._default_consistency = c.l3_consistency
        self._validators: PrefixTable[Callable[[str, Item | None, Any], None]] = PrefixTable()
        self._resolvers: PrefixTable[Callable[[str, list[Item]], Any]] = PrefixTable()
        self._sample_every = c.hot_key_sample
        cluster = self.config.cluster
        self._cluster = cluster.enabled  # writes are dirty (await L3); deletes are tombstones
        self._max_dirty = cluster.outbound_max if self._cluster else 0
        self._dirty_flag = l2mod.FLAG_DIRTY if self._cluster else 0
        self._lock_timeout = float(c.lock_timeout)
        self._core_put = self._seg._core.put
        self._has_validators = False
        self._l3: Any = None  # the L3 adapter, opened on the first L2 miss
        self._kf: Any = None  # the daemon's filter of existing keys
        self._kf_retry = 0.0
        self._negative = NegativeCache(c.negative_ttl, c.negative_max_entries)
        self._closed = False
        self._forked = False
        self._unusable = False  # closed, or inherited through fork(): every call checks this
        _CLIENTS.add(self)
        self.counters = dict.fromkeys(
            ("deletes", "conflicts", "views", "merges", "resolver_failures",
             "l3_reads", "negative_hits", "filter_hits"), 0
        )
        self._keys: dict[str, tuple[bytes, int]] = {}  # validated keys (the getter reads it)
        # kv.get is the C getter itself (an instance attribute: no Python frame on a hit);
        # Client.get below is what it does, and what a closed client falls back to
        self._getter = Getter(self._l1, self._seg._core, self._keys, codec.decode,
                              self._get_slow, self._flush_hot, self._sample_every,
                              self._zc, self._l1_on)
        self.get = self._getter  # type: ignore[method-assign]
        self._l1_hits = 0  # (get_item's; get's are counted by the getter)
        self._l2_hits = 0
        self._l2_misses = 0
        self._puts = 0
        self._host_vec = ((self._host, 0),)

    # ------------------------------------------------------------------ helpers

    def _key_hash(self, key: Any) -> tuple[bytes, int]:
        """(UTF-8 bytes, stable hash) of a valid key, memoised: agents reuse their keys."""
        kh = self._keys.get(key) if type(key) is str else None
        if kh is None:
            kb = self._key(key)
            kh = (kb, key_hash(kb))
            if len(self._keys) >= _KEY_MEMO:
                self._keys.clear()
            self._keys[key] = kh
        return kh

    def _key(self, key: Any) -> bytes:
        if type(key) is not str:
            raise InvalidKey(f"keys are str, got {type(key).__name__}: {key!r}")
        try:
            kb = key.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidKey(
                f"key {key!r} is not valid Unicode (a lone surrogate); keys must encode to UTF-8"
            ) from None
        if not kb or len(kb) > self._max_key or b"\x00" in kb:
            if not kb:
                raise InvalidKey("the key is empty; use a non-empty str such as 'drone/7/pos'")
            if b"\x00" in kb:
                raise InvalidKey(f"key {key!r} contains NUL; remove it")
            raise InvalidKey(
                f"key is {len(kb)} bytes of UTF-8, over cache.max_key_bytes={self._max_key}"
            )
        return kb

    def _live(self) -> None:
        if self._closed:
            raise SegmentError("this kvcomm client is closed; open a new one")
        if self._forked:
            raise SegmentError(
                "this client was opened before fork(); call kvcomm.open() in the child process"
            )

    def _version(self, counter: int, hlc: int, vvx: bytes) -> Version:
        """The Version of a record: this host's entry (``counter``) and the others (``vvx``)."""
        if not vvx:  # tuple.__new__ skips NamedTuple's Python-level __new__ (hot path)
            return _new_version(Version, (((self._host, counter),), hlc))
        try:
            others = decode_others(vvx)
        except ValueError as exc:
            raise SegmentError(f"a stored version vector is corrupt ({exc}); purge the namespace") from None
        own = ((self._host, counter),) if counter else ()
        return Version(tuple(sorted(others + own)), hlc)

    def _encode(self, value: Any) -> tuple[int, bytes, bytes | memoryview]:
        """(tag, meta, payload) of a value. Raises UnsupportedValue, ValueTooLarge."""
        tag, meta, payload = codec.encode(value)
        if len(payload) > self._max_value:
            raise ValueTooLarge(
                f"value is {len(payload)} bytes, over cache.max_value_size={self._max_value}"
            )
        return tag, meta, payload

    def _prepare(self, key: Any, value: Any) -> tuple[bytes, int, int, bytes, bytes | memoryview]:
        """Everything a write needs, checked before anything is stored:
        (key bytes, key hash, tag, meta, payload). Raises InvalidKey and the value errors."""
        # the common case inline (a memoised key, a bytes value): one call per write
        kh = self._keys.get(key) if type(key) is str else None
        kb, h = kh if kh is not None else self._key_hash(key)
        payload: bytes | memoryview
        if type(value) is bytes and len(value) <= self._max_value:
            tag, meta, payload = codec.BYTES, b"", value
        else:
            tag, meta, payload = self._encode(value)
        if self._cluster:
            self._negative.invalidate(key)  # this host will hold it: no longer "absent"
        return kb, h, tag, meta, payload

    def _decode(self, key: str, tag: int, meta: bytes, raw: bytes | memoryview) -> Any:
        try:
            return codec.decode(tag, meta, raw)
        except KVCommError:
            raise
        except Exception as exc:  # msgpack and numpy raise many unrelated types
            raise SegmentError(f"stored value of {key!r} cannot be decoded ({exc}); "
                               "overwrite or delete it") from None

    def _item_of(self, key: str, rec: Record | None) -> Item | None:
        """The Item of a record read under the lock (None for absent or a tombstone)."""
        if rec is None or rec.tag == TAG_TOMBSTONE:
            return None
        value = self._decode(key, rec.tag, rec.meta, rec.value or b"")
        return Item(key, value, self._version(rec.counter, rec.hlc, rec.vvx), "l2")

    # ------------------------------------------------------------------ reads

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
        if e is not None and self._q[e[1]] == e[2]:
            self._l1_hits += 1
            return e[0]
        return self._get_slow(key, default, False)

    def _flush_hot(self) -> None:
        """Add the reads the getter sampled (1 in ``cache.hot_key_sample``, scaled back
        up) to the host-wide sketch. Called by the getter when its buffer is full or a
        second old, and before hot_keys()."""
        if self._unusable:
            return
        counts = self._getter.take_hot()
        if not counts:
            return
        by_bytes = {k.encode("utf-8", "surrogatepass"): n for k, n in counts.items()}
        # (from a validator this thread holds the L2 lock: the counts are dropped, which
        # sampling, an estimate, can afford)
        self._seg.count_accesses(by_bytes)

    def hot_keys(self, n: int = 10) -> list[tuple[str, int]]:
        """The host's ``n`` most read keys with estimated read counts, from every process.

        Counts come from a Count-Min Sketch fed by 1 read in ``cache.hot_key_sample``
        (scaled back up); counters age by half periodically, and concurrent processes
        serialise their updates, so estimates are approximate but never low by more than
        the sampling error. Empty when tracking is off (``hot_key_sample: 0``).
        """
        if type(n) is not int or n < 0:
            raise InvalidArgument(f"n must be an int >= 0, got {n!r}")
        self._live()
        self._flush_hot()
        return self._seg.hot_keys(n)

    def get_item(self, key: str) -> Item | None:
        """The value with its Version and the tier that served it, or None when absent."""
        try:
            e = self._l1_entries.get(key)
        except TypeError:
            raise InvalidKey(f"keys are str, got {type(key).__name__}") from None
        if e is not None and self._q[e[1]] == e[2]:
            self._l1_hits += 1
            return Item(key, e[0], self._version(e[4], e[5], e[6]), "l1")
        return self._get_slow(key, None, True)  # type: ignore[no-any-return]

    def _read_l2(self, kb: bytes, h: int, zc: int) -> Any:
        """The raw L2 record (tombstones too) or None. Repairs a corrupt segment once."""
        try:
            rec = self._core_read(kb, h, zc)
        except SegmentError:
            return self._seg.read(kb, h, zc)  # repairs once, or raises
        if type(rec) is int:  # a slot stayed odd: a slow, stopped or dead writer
            return self._seg.read(kb, h, zc)
        return rec

    def _get_slow(self, key: str, default: Any, want_item: bool, l3: bool = True) -> Any:
        """L2 (then, in cluster mode and if ``l3``, L3) lookup; the value, or an Item."""
        if self._unusable:
            self._live()
        kb, h = self._key_hash(key)
        self._getter.sampled(key)
        rec = self._read_l2(kb, h, self._zc)
        # rec: (word, seq, tag, meta, value, counter, hlc, vvx, size)
        if rec is None or rec[2] == TAG_TOMBSTONE:
            self._l2_misses += 1
            if rec is None and self._cluster and l3:
                return self._get_l3(key, default, want_item)
            return None if want_item else default  # a tombstone: deleted here, L3 told soon
        self._l2_hits += 1
        tag = rec[2]
        raw = rec[4]
        if raw is None:  # a large array: a zero-copy view
            return self._get_view(key, kb, h, default, want_item)
        value = raw if tag == _BYTES else self._decode(key, tag, rec[3], raw)
        if tag != _NDARRAY and self._l1_on:
            self._l1.store(key, (value, rec[0], rec[1], approx_size(value), rec[5], rec[6],
                                 rec[7]))
        if not want_item:
            return value
        return Item(key, value, self._version(rec[5], rec[6], rec[7]), "l2")

    def _get_l3(self, key: str, default: Any, want_item: bool) -> Any:
        """An L2 miss in cluster mode: one round trip to L3, then fill L2 (and L1 next read).

        A key L3 does not have is remembered as absent for ``cache.negative_ttl``; so is
        one the host's key filter rules out, while the filter is trusted (its daemon's
        heartbeat is fresh). Raises Unavailable (L3 unreachable) and CorruptRecord (the
        L3 value of this key is not a valid KVCOMM record; nothing is written to L2).
        """
        now = time.monotonic()
        if self._negative.is_absent(key, now):
            self.counters["negative_hits"] += 1
            return None if want_item else default
        kf = self._key_filter()
        if kf is not None and not kf.may_exist(key.encode("utf-8", "surrogatepass")):
            self.counters["filter_hits"] += 1
            self._negative.note_absent(key, now)
            return None if want_item else default
        if self._l3 is None:
            from .tiers.l3 import L3Store

            cl = self.config.cluster
            self._l3 = L3Store(cl.seeds(), username=cl.redis_username,
                               password=cl.redis_password, tls=cl.redis_tls, timeout=cl.timeout,
                               max_value_size=self.config.cache.max_value_size)
        self.counters["l3_reads"] += 1
        rec = self._l3.get(key)
        if rec is None or rec.tombstone:
            self._negative.note_absent(key, now)
            return None if want_item else default
        value = rec.decode_value(key)
        version = Version(rec.vector, rec.hlc)
        if time.monotonic() - now < _FILL_WITHIN:  # (an older read might be stale by now)
            try:
                self._merge(key, value, version, (rec.tag, rec.meta, rec.value))  # fill L2
            except ValueTooLarge:
                pass  # this host's L2 can never hold it: served from L3 every time
        if want_item:
            return Item(key, value, version, "l3")
        return value

    def _key_filter(self) -> Any:
        """The daemon's filter of existing keys while it is trusted (built, not retired,
        heartbeat fresh: ``KeyFilter.ready``), else None. An untrusted one is closed and
        the file reopened, at most once a second: the daemon may have been restarted and
        put a new file in place. Raises SegmentError for a filter file of another user or
        of too wide a mode (``cache.l2_permissions``)."""
        kf = self._kf
        if kf is not None and kf.ready:
            return kf
        now = time.monotonic()
        if now < self._kf_retry:
            return None
        if kf is not None:
            self._kf = None
            kf.close()
        from .tiers.keyfilter import KeyFilter

        # (a refused file raises at every miss, not once a second: no silent fallback)
        self._kf = KeyFilter.open_reader(self.name, self.config.cache.l2_permissions,
                                         self.config.cache.l2_dir)
        self._kf_retry = now + 1.0
        return self._kf if self._kf is not None and self._kf.ready else None

    def _get_view(self, key: str, kb: bytes, h: int, default: Any, want_item: bool) -> Any:
        """A large array: pin its block and hand out a read-only view of shared memory.

        The record may have been replaced between the read and the pin (by a small value,
        another type, a tombstone): what is pinned is checked again and, if it is no longer
        a large array, decoded from a copy instead.
        """
        seg = self._seg
        try:  # (the pin is dropped on any exception, KeyboardInterrupt included, until a
            #   view owns it: seg.pin_kept in _register_view)
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
                    _register_view(arr, seg, pin)
                    self.counters["views"] += 1
        finally:
            seg.drop_pending()
        if not want_item:
            return arr
        return Item(key, arr, self._version(r[4], r[5], r[6]), "l2")

    # ------------------------------------------------------------------ writes

    def put(self, key: str, value: Any, *, consistency: str | None = None,
            expect: Any = _NO_CHECK) -> Version:
        """Store ``value`` under ``key``; returns its Version.

        ``expect`` is a Version from an earlier get_item/put, or ABSENT; on mismatch
        ConflictError is raised and nothing changes. ``consistency`` is "eventual" or
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
        # the common case inline (a key seen before, a bytes value, no checks): every call
        # saved here is a tenth of a put
        kh = self._keys.get(key) if type(key) is str else None
        kb, h = kh if kh is not None else self._key_hash(key)
        payload: bytes | memoryview
        if type(value) is bytes and len(value) <= self._max_value:
            tag, meta, payload = _BYTES, b"", value
        else:
            tag, meta, payload = self._encode(value)
        if self._cluster:
            self._negative.invalidate(key)  # this host will hold it: no longer "absent"
        if expect is not _NO_CHECK or self._has_validators:
            return self._put_checked(key, kb, h, value, (tag, meta, payload), expect)
        r = self._core_put(kb, h, tag, meta, payload, time.time_ns() // 1_000_000,
                           self._dirty_flag, self._max_dirty, self._lock_timeout)
        if type(r) is not tuple:  # purged, repair due, no room...: the careful path
            r = self._seg.put_status(r, kb, h, tag, meta, payload, _now_ms(), self._cluster,
                                     self._max_dirty)
        self._puts += 1
        if not r[2]:  # (no other host's entries: the Version without decoding anything)
            return _new_version(Version, (((self._host, r[0]),), r[1]))
        return self._version(r[0], r[1], r[2])

    def _put_checked(self, key: str, kb: bytes, h: int, value: Any,
                     encoded: tuple[int, bytes, bytes | memoryview], expect: Any) -> Version:
        """put() with expect= and/or a validator: both run under the writer lock."""
        cas = None if expect is _NO_CHECK else self._expect_fn(key, expect)
        validator = self._validators.lookup(key) if self._validators else None
        if cas is None and validator is None:
            counter, hlc, vvx, _, _ = self._seg.put(kb, h, *encoded, _now_ms(), self._cluster,
                                                    self._max_dirty)
            self._puts += 1
            return self._version(counter, hlc, vvx)
        if validator is not None and self._cluster:
            self._get_slow(key, None, True)  # bring L3's value into L2 for the validator
        check = self._checker(key, kb, h, cas, validator, value)
        counter, hlc, vvx, _, _ = self._seg.apply(
            [(kb, h, *encoded)], now_ms=_now_ms(), dirty=self._cluster,
            max_dirty=self._max_dirty, check=check)[0]
        self._puts += 1
        return self._version(counter, hlc, vvx)

    def _checker(self, key: str, kb: bytes, h: int, cas: Callable[[Record | None], None] | None,
                 validator: Callable[[str, Item | None, Any], None] | None,
                 new_value: Any) -> Callable[[], None]:
        """What runs under the writer lock before a write of ``key``: compare-and-set, then
        the validator against the value the write replaces."""
        def check() -> None:
            rec = self._seg.read(kb, h)
            if rec is not None and rec.tag == TAG_TOMBSTONE:
                rec = None
            if cas is not None:
                cas(rec)
            if validator is not None:
                _run_validator(validator, key, self._item_of(key, rec), new_value)

        return check

    def _expect_fn(self, key: str, expect: Any) -> Callable[[Record | None], None]:
        if expect is not ABSENT and not isinstance(expect, Version):
            raise InvalidArgument(
                f"expect= takes a kvcomm.Version or kvcomm.ABSENT, got {type(expect).__name__}"
            )

        def check(rec: Record | None) -> None:
            if expect is ABSENT:
                if rec is not None:
                    self.counters["conflicts"] += 1
                    raise ConflictError(f"{key!r} exists; expected it absent")
                return
            current = None if rec is None else self._version(rec.counter, rec.hlc, rec.vvx)
            if current != expect:
                self.counters["conflicts"] += 1
                raise ConflictError(
                    f"{key!r} is at {current if current else 'absent'}, expected {expect}; "
                    "re-read it and retry"
                )

        return check

    def delete(self, key: str, *, expect: Any = _NO_CHECK) -> bool:
        """Remove ``key``. True when something was deleted. Raises as :meth:`put`.

        In cluster mode the delete is a tombstone kept in L2 (dirty, never evicted) until
        L3 has it, so it is as durable as a put; a key this host does not hold is looked up
        in L3 first, so that the delete covers the version the cluster has.
        """
        return self._delete(key, expect) > 0

    def _delete(self, key: str, expect: Any = _NO_CHECK) -> int:
        """:meth:`delete`, returning the delete's write counter (0: nothing was there)."""
        self._live()
        kb, h = self._key_hash(key)
        cas = None if expect is _NO_CHECK else self._expect_fn(key, expect)
        validator = self._validators.lookup(key) if self._validators else None
        if self._cluster and self._get_slow(key, None, True) is None:
            local = self._read_l2(kb, h, _HUGE)
            if local is None and cas is None and validator is None:
                return 0  # absent here and in L3: nothing to delete, nothing to tell L3
        check = None if cas is None and validator is None else \
            self._checker(key, kb, h, cas, validator, None)
        counter: int = self._seg.apply([(kb, h)], now_ms=_now_ms(), dirty=self._cluster,
                                       max_dirty=self._max_dirty, tombstones=self._cluster,
                                       check=check)[0]
        self._l1.discard(key)
        if counter:
            self.counters["deletes"] += 1
        return counter

    def update(self, key: str, fn: Callable[[Any], Any], *, default: Any = None) -> Any:
        """Atomic read-modify-write: stores and returns ``fn(old value or default)``.

        ``fn`` may run more than once when other writers race; it must not have side
        effects. No increment is ever lost, whatever the number of processes. Raises
        InvalidArgument when ``fn`` is not callable, and what :meth:`put` raises.
        """
        if not callable(fn):
            raise InvalidArgument(f"update() needs a callable, got {type(fn).__name__}")
        for _ in range(_MAX_UPDATE_RETRIES):
            item = self.get_item(key)
            new = fn(default if item is None else item.value)
            try:
                self.put(key, new, expect=ABSENT if item is None else item.version)
                return new
            except ConflictError:
                continue
        raise Unavailable(f"update of {key!r} lost {_MAX_UPDATE_RETRIES} races in a row")

    def batch(self) -> Batch:
        """``with kv.batch() as b: b.put(...); b.delete(...)`` — applied whole, or not at all."""
        self._live()
        return Batch(self)

    # ------------------------------------------------------------------ validators

    def register_validator(self, prefix: str, fn: Callable[[str, Item | None, Any], None]) -> None:
        """Run ``fn(key, old_item, new_value)`` before every write under ``prefix`` in this
        client; raising rejects the write with ValidationError (``new_value`` is None for a
        delete). The longest matching prefix wins.

        ``fn`` runs under the host's L2 writer lock, against exactly the value the write
        replaces (in a batch, earlier operations of the batch on the same key count, with an
        empty version). It may read from KVCOMM but not write (InvalidArgument), and should
        be quick: every writer on the host waits for it.
        """
        if type(prefix) is not str:
            raise InvalidKey("a validator prefix is a str ('' matches every key)")
        if not callable(fn):
            raise InvalidArgument("register_validator needs a callable")
        self._validators.set(prefix, fn)
        self._has_validators = True

    def register_resolver(self, prefix: str, fn: Callable[[str, list[Item]], Any]) -> None:
        """Resolve concurrent versions of keys under ``prefix`` with ``fn(key, siblings)``.

        ``siblings`` are the concurrent Items (oldest first by HLC); ``fn`` returns the
        value to keep (e.g. merged counters, a union of sets). If it raises or returns a
        value that cannot be stored, last-writer-wins decides instead and
        ``stats()["ops"]["resolver_failures"]`` counts it; a host never crashes on it.
        The longest matching prefix wins. Deletes always merge last-writer-wins.
        """
        if type(prefix) is not str:
            raise InvalidKey("a resolver prefix is a str ('' matches every key)")
        if not callable(fn):
            raise InvalidArgument("register_resolver needs a callable")
        self._resolvers.set(prefix, fn)

    def merge_remote(self, key: str, value: Any, version: Version) -> Version:
        """Merge a version of ``key`` written on another host into this host's L2.

        This is how the node daemon applies cluster changes (and how tests drive
        conflicts): a newer ``version`` replaces the local value, an older or equal one
        is ignored, a concurrent one is resolved (resolver, else last-writer-wins) and
        stored with the merged vector. Returns the version stored afterwards.
        """
        if not isinstance(version, Version):
            raise InvalidArgument(f"version must be a kvcomm.Version, got {type(version).__name__}")
        return self._merge(key, value, version, self._encode(value))

    def _local_item(self, kb: bytes, h: int, key: str) -> Item | None:
        """This host's record of ``key`` as an Item; a tombstone's value is ``_TOMBSTONE``."""
        rec = self._read_l2(kb, h, _HUGE)
        if rec is None:
            return None
        version = self._version(rec[5], rec[6], rec[7])
        if rec[2] == TAG_TOMBSTONE:
            return Item(key, _TOMBSTONE, version, "l2")
        return Item(key, self._decode(key, rec[2], rec[3], rec[4]), version, "l2")

    def _merge(self, key: str, value: Any, version: Version,
               remote_encoded: tuple[int, bytes, bytes | memoryview]) -> Version:
        """:meth:`merge_remote` with the value already encoded (an L3 record's bytes).

        ``remote_encoded[0] == TAG_TOMBSTONE``: the remote version is a delete; it is kept
        as a clean tombstone. Deletes (on either side) merge last-writer-wins.
        """
        if self._unusable:
            self._live()
        kb, h = self._key_hash(key)
        remote_value = _TOMBSTONE if remote_encoded[0] == TAG_TOMBSTONE else value
        for _ in range(_MAX_UPDATE_RETRIES):
            local = self._local_item(kb, h, key)
            plan = self._merge_plan(key, local, remote_value, remote_encoded, version)
            if plan is None:
                assert local is not None
                return local.version
            encoded, stored, new_write = plan
            seen = None if local is None else local.version
            explicit = self._explicit(stored)
            if new_write:  # a resolver made a new value: a new local write over the merge
                explicit = (l2mod.NEW_DOT, stored.hlc, explicit[2])
            # a merge of concurrent versions (or a resolver's new value) is new information
            # that the cluster must learn: dirty, so the node daemon publishes it
            publish = new_write or stored != version

            def unchanged(seen: Version | None = seen) -> None:
                rec = self._seg.read(kb, h)
                now = None if rec is None else self._version(rec.counter, rec.hlc, rec.vvx)
                if now != seen:
                    raise ConflictError("changed while merging")

            try:
                r = self._seg.apply([(kb, h, *encoded, *explicit)], now_ms=_now_ms(),
                                    dirty=publish and self._cluster, check=unchanged)[0]
            except ConflictError:
                continue  # a local write raced us: merge against it
            self.counters["merges"] += 1
            self._l1.discard(key)
            return self._version(r[0], r[1], r[2])
        raise Unavailable(f"merge of {key!r} lost {_MAX_UPDATE_RETRIES} races in a row")

    def _restamp(self, key: str, other: Version) -> bool:
        """Write this host's record of ``key`` again as a new local write that descends
        from both itself and ``other`` (L3's version, which covers the local dot because
        the host's write sequence restarted). The write sequence is first raised past
        ``other``'s entry for this host. Returns False when there is nothing to restamp."""
        kb, h = self._key_hash(key)
        self._seg.raise_write_sequence(vector_get(other.vector, self._host))
        rec = self._read_l2(kb, h, _HUGE)
        if rec is None:
            return False
        seen = self._version(rec[5], rec[6], rec[7])
        merged = merge_vectors(seen.vector, other.vector)

        def unchanged() -> None:
            now = self._seg.read(kb, h)
            if now is None or self._version(now.counter, now.hlc, now.vvx) != seen:
                raise ConflictError("changed while restamping")

        op = (kb, h, rec[2], rec[3], rec[4], l2mod.NEW_DOT, max(seen.hlc, other.hlc),
              encode_others(merged, self._host))
        try:
            self._seg.apply([op], now_ms=_now_ms(), dirty=True, check=unchanged)
        except ConflictError:
            return False  # a newer local write came meanwhile: it is pushed as it is
        self._l1.discard(key)
        return True

    def _explicit(self, v: Version) -> tuple[int, int, bytes]:
        return vector_get(v.vector, self._host), v.hlc, encode_others(v.vector, self._host)

    def _merge_plan(self, key: str, local: Item | None, value: Any,
                    remote_encoded: tuple[int, bytes, bytes | memoryview], remote: Version,
                    ) -> tuple[tuple[int, bytes, bytes | memoryview], Version, bool] | None:
        """What to store: (encoded value, version, is a new local write), or None to keep."""
        if local is None:
            return remote_encoded, remote, False
        order = compare_vectors(remote.vector, local.version.vector)
        if order in (Ordering.BEFORE, Ordering.EQUAL):
            return None
        if order is Ordering.AFTER:
            return remote_encoded, remote, False
        sibs = [Sibling(local.value, _dotted(local.version, remote)),
                Sibling(value, _dotted(remote, local.version))]
        deletes = local.value is _TOMBSTONE or value is _TOMBSTONE
        fn = None if deletes or not self._resolvers else self._resolvers.lookup(key)
        hook = None
        if fn is not None:
            def hook(live: list[Sibling[Any]], fn: Callable[[str, list[Item]], Any] = fn) -> Any:
                return fn(key, [Item(key, s.value, Version(s.version.vector, s.version.hlc),
                                     "l2" if s is sibs[0] else "l3") for s in live])
        res = resolve_siblings(sibs, hook, _storable)
        if res.fallback:
            self.counters["resolver_failures"] += 1
        merged = Version(res.vector, max(local.version.hlc, remote.hlc))
        if res.winner is None:  # the resolver made a new value
            return self._encode(res.value), merged, True
        if res.value is local.value:
            encoded = _TOMB_ENCODED if local.value is _TOMBSTONE else codec.encode(local.value)
        else:
            encoded = remote_encoded
        return encoded, Version(res.vector, res.winner.hlc), False

    # ------------------------------------------------------------------ watch

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

    # ------------------------------------------------------------------ admin

    def stats(self) -> dict[str, Any]:
        """Per-tier hits/misses of this process, entries, bytes used and evictions."""
        c = self.counters
        l1_hits = self._l1_hits + self._getter.hits
        l2_hits, l2_misses = self._l2_hits + self._getter.l2_hits, self._l2_misses
        l2_lookups = l2_hits + l2_misses
        info = self._seg.info() if not self._closed else {}
        return {
            "l1": {"hits": l1_hits, "misses": l2_lookups, "entries": len(self._l1_entries),
                   "bytes": self._l1.bytes, "max_bytes": self._l1.max_bytes,
                   "evictions": self._l1.evictions},
            "l2": {"hits": l2_hits, "misses": l2_misses,
                   "entries": info.get("entries", 0), "bytes": info.get("used_bytes", 0),
                   "capacity_bytes": info.get("data_bytes", 0),
                   "evictions": info.get("evictions", 0),
                   "recoveries": info.get("recoveries", 0),
                   "dirty": info.get("dirty", 0),
                   "views_taken": c["views"]},
            "l3": {"reads": c["l3_reads"], "negative_hits": c["negative_hits"],
                   "filter_hits": c["filter_hits"]},
            "ops": {"puts": self._puts, "deletes": c["deletes"],
                    "conflicts": c["conflicts"], "merges": c["merges"],
                    "resolver_failures": c["resolver_failures"]},
        }

    def keys(self, prefix: str = "") -> list[str]:
        """The keys under ``prefix`` present in L2 now (a scan: for tools, not hot paths).
        Raises InvalidKey for a prefix that is not a str."""
        if type(prefix) is not str:
            raise InvalidKey(f"a key prefix is a str ('' lists every key), got {type(prefix).__name__}")
        self._live()
        return [k for k in self._seg.keys() if k.startswith(prefix)]

    def close(self) -> None:
        """Release this client's share of the process's L2 mapping and L1. Idempotent."""
        if self._closed:
            return
        if not self._unusable:
            try:
                self._flush_hot()
            except KVCommError:
                pass  # e.g. the namespace was purged: its counts no longer matter
        self._closed = self._unusable = True
        if self._l3 is not None:
            self._l3.close()
        if self._kf is not None:
            self._kf.close()
        self._l1_entries = {}
        self._getter.close()
        self.__dict__.pop("get", None)  # Client.get: it says the client is closed
        if not self._forked:
            process_budget().unregister(self.config.cache.l1_size)
            _Shared.release(self._attached)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<kvcomm.Client name={self.name!r} host={self._host!r}{' closed' if self._closed else ''}>"


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
    """

    _results: list[Any]
    _versions: list[Version | bool] | None

    def __init__(self, client: Client) -> None:
        # put() and delete() are the kernel's (BatchOps, in C): they validate and encode at
        # once, through the client's key memo and encoder
        super().__init__(client._keys, client._key_hash, client._encode, client._max_value)
        self._client = client
        self._results = []
        self._versions = None

    @property
    def versions(self) -> list[Version | bool]:
        """Per operation, once applied: a put's Version, whether a delete deleted."""
        if self._versions is None:
            c = self._client
            self._versions = [c._version(r[0], r[1], r[2]) if isinstance(r, tuple) else r > 0
                              for r in self._results]
        return self._versions

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None or not self._ops:
            return
        c = self._client
        c._live()
        check = None
        if c._has_validators and any(c._validators.lookup(k) is not None for k in self._keys):
            if c._cluster:  # bring L3's values into L2 for the validators
                for k in set(self._keys):
                    if c._validators.lookup(k) is not None:
                        c._get_slow(k, None, True)
            check = self._validate
        if c._cluster:
            if self._deletes:  # deletes of keys this host does not hold cover L3's version
                for key, op in zip(self._keys, self._ops, strict=True):
                    if len(op) == 2:
                        c._get_slow(key, None, True)
            for key in self._keys:
                c._negative.invalidate(key)  # this host holds them now: not "absent"
        results = c._seg.apply(self._ops, now_ms=_now_ms(), dirty=c._cluster,
                               max_dirty=c._max_dirty, tombstones=c._cluster, check=check)
        self._results = results
        c._puts += len(results) - self._deletes
        if self._deletes:
            for key, r in zip(self._keys, results, strict=True):
                if type(r) is not tuple:
                    c._l1.discard(key)
                    c.counters["deletes"] += int(r > 0)

    def _validate(self) -> None:
        """Under the writer lock: every validator, in order, against the state the batch's
        earlier operations leave."""
        c = self._client
        pending: dict[str, Item | None] = {}
        for key, op, value in zip(self._keys, self._ops, self._values, strict=True):
            if key in pending:
                old = pending[key]
            else:
                rec = c._seg.read(op[0], op[1])
                old = c._item_of(key, rec)
            fn = c._validators.lookup(key)
            if fn is not None:
                _run_validator(fn, key, old, value)
            pending[key] = None if len(op) == 2 else Item(key, value, Version((), 0), "batch")


def _dotted(v: Version, other: Version) -> Dotted:
    """``v`` as a sibling of the concurrent ``other``: its dot is an entry ``other`` has not
    seen (one always exists between concurrent versions — the real dot is among them), the
    greatest, so that every host picks the same one."""
    unseen = [e for e in v.vector if e[1] > vector_get(other.vector, e[0])] or list(v.vector)
    actor, counter = max(unseen, key=lambda e: (e[1], e[0])) if unseen else ("", 0)
    return Dotted(v.vector, (actor, counter), v.hlc)


def _storable(value: Any) -> bool:
    try:
        codec.encode(value)
    except KVCommError:
        return False
    return True


def _bad_consistency(consistency: Any) -> None:
    raise InvalidArgument(f"consistency must be 'eventual' or 'strong', got {consistency!r}")


def _run_validator(fn: Callable[[str, Item | None, Any], None], key: str, old: Item | None,
                   new_value: Any) -> None:
    try:
        fn(key, old, new_value)
    except ValidationError:
        raise
    except Exception as exc:
        raise ValidationError(f"write to {key!r} rejected by validator: {exc}") from exc


def open(name: str | None = None, *,  # noqa: A001
         config: Config | str | os.PathLike[str] | None = None) -> Client:
    """Open namespace ``name`` on this host (creating its L2 segment if needed).

    ``name`` defaults to the config's ``node.namespace`` ("default"). ``config`` is a
    path to a YAML file or a :class:`kvcomm.Config`; with ``cluster.redis`` set, the
    client works in cluster mode (a node daemon syncs the host with L3). Raises
    ConfigError, SegmentError.
    """
    cfg = load_config(config)
    if cfg.cluster.redis:
        require_cluster()  # at open(), not at the first L2 miss
    if name is None:
        name = cfg.node.namespace
    if type(name) is not str:
        raise SegmentError(f"namespace must be a str, got {type(name).__name__}")
    return Client(name, cfg)


__all__ = ["ABSENT", "Batch", "Client", "Event", "Item", "open"]
