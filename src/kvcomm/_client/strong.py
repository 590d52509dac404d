"""Strong keys in cluster mode: every operation goes to etcd, from the agent itself.

Theory of operation
-------------------
A key is **strong** when it starts with one of ``cache.strong_prefixes`` (the longest
prefix wins), or when it matches none and ``cache.l3_consistency`` is ``"strong"``. In
cluster mode a strong key lives in etcd only, under ``kvc/k/<key>`` (like L3, shared by
every host whatever its L2 namespace): never in L1, L2 or L3, so that no cache can serve
a stale value and no merge can bring one back.

* **put / delete** are etcd writes: they return once a majority has them. ``expect=``
  is a transaction comparing the key's ``mod_revision`` with the Version's revision
  (``ABSENT``: ``create_revision == 0``); the failure branch reads the current value so
  that ConflictError can say what it found.
* **get / get_item** are quorum range reads (``serializable=false``: etcd's ReadIndex
  confirms the leader with a majority before answering), so a read never returns a value
  older than one whose write had returned anywhere. Measured in docs/benchmarks.md
  (``bench/bench_strong.py``): one HTTP round trip, about the price of a put. Caching in
  L1/L2 behind an etcd watch with a revision fence would make hits cheaper, but a
  watch lags the commit it reports, and a fence needs a quorum round trip anyway: the
  quorum read is the simplest correct choice.
* **Validators and update()**: a validator runs against the value read from etcd, then a
  transaction commits the write only if the key's ``mod_revision`` is still the one read;
  when another writer got there first the value is read again and the validator runs
  again (so it may run more than once). ``update()`` is get_item + put(expect=) in a loop:
  ``fn`` may run more than once too. Either way the committed result was always computed
  from exactly the value it replaced.
* **Version**: ``Version(((STRONG_ACTOR, mod_revision),), 0)``; :func:`revision_of`
  returns the revision. ``STRONG_ACTOR`` ("@etcd") is no valid host id, so a strong
  version is never mistaken for a host's.
* **Expiry**: a put with a ttl stores its deadline in the value (the tag byte's high bit
  says a big-endian double follows the header) and attaches the key to an etcd lease:
  one lease per 1-second bucket of deadlines per process (granted at the bucket's first
  use, with a TTL reaching the bucket's end), never one per key. Reads compare the
  deadline with the clock, so the key is absent from its deadline on; etcd deletes it
  when the lease ends (at most about a second later, or etcd's minimum lease TTL). A
  later put without a ttl detaches it (lease 0). A bucket's lease that etcd no longer has
  (revoked, or this host's clock stepped back past it) is replaced by a new one at the
  put that finds it gone (etcd wrote nothing then). A key past its deadline
  that etcd still holds (its lease not ended) is absent to ``expect=ABSENT`` as to reads:
  the write then replaces exactly that revision; and it is at no version: a write with
  ``expect=`` a Version reads the key first (one round trip more) and raises
  ConflictError for an expired one.
* **Failures**: no majority reachable raises Unavailable within ``2 x cluster.timeout``
  (every operation has that budget; a write whose outcome is unknown says so), and at
  once while the host's node daemon reports etcd unreachable (partition mode, see
  ``node/daemon.py``). A value over etcd's request limit raises ValueTooLarge.

The prefixes are the cluster's: the first daemon (or agent) records them in etcd under
``kvc/config/strong_prefixes``; one whose config disagrees raises ConfigError
(:func:`check_prefixes`). Every node daemon with ``cluster.etcd`` copies what etcd
records into L3 (``kvm:strong``) at start; an agent without ``cluster.etcd`` reads that
copy when it opens and refuses (ConfigError) when the cluster keeps strong keys. Only
when L3 cannot answer then, holds no copy, or the host is in partition mode does it go by
its host daemon's status file instead (``_client/base.py`` ``_check_no_strong_keys``):
the agent must never write a strong key as an eventual one, and the daemon's status is
the one other witness that does not need etcd.
"""

from __future__ import annotations

import json
import math
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..core import codec, counter
from ..core.versions import Version
from ..errors import (
    ConfigError,
    ConflictError,
    CorruptRecord,
    InvalidArgument,
    KVCommError,
    Unavailable,
    ValueTooLarge,
)
from ..tiers.etcd import (
    Compare,
    EtcdClient,
    KeyValue,
    _LeaseNotFound,
    delete_op,
    get_op,
    put_op,
)
from .items import ABSENT, Item
from .validators import _MAX_UPDATE_RETRIES, _run_validator

if TYPE_CHECKING:
    from ..config import Config

STRONG_ACTOR = "@etcd"  # the version-vector actor of a strong key ('@' is in no host id)
CONFIG_PREFIX = b"kvc/config/"
PREFIXES_KEY = CONFIG_PREFIX + b"strong_prefixes"
# cache.l3_consistency: whether a key under no strong prefix is strong (the cluster's too)
DEFAULT_KEY = CONFIG_PREFIX + b"l3_consistency"
_HEADER = struct.Struct(">BI")  # tag, meta length; then meta, then the payload
_HAS_DEADLINE = 0x80  # in the tag byte: a deadline (a big-endian double) follows the header
_DEADLINE = struct.Struct(">d")
# etcd's --max-request-bytes default (1.5 MiB); the gateway base64-encodes the value
ETCD_VALUE_LIMIT = 1536 * 1024 - 4096


def revision_of(version: Version) -> int | None:
    """The etcd revision a strong key's Version carries, or None for another Version."""
    if len(version.vector) == 1 and version.vector[0][0] == STRONG_ACTOR:
        return version.vector[0][1]
    return None


def strong_version(revision: int) -> Version:
    return Version(((STRONG_ACTOR, revision),), 0)


KEY_PREFIX = b"kvc/k/"


def etcd_key(key: str) -> bytes:
    """Where strong key ``key`` lives in etcd."""
    return KEY_PREFIX + key.encode("utf-8")


def check_prefixes(etcd: EtcdClient, config: Config, *, timeout: float | None = None) -> list[str]:
    """Record this config's ``cache.strong_prefixes`` and ``cache.l3_consistency`` (which
    together say which keys are strong) in etcd if none are recorded yet, else compare
    them with the recorded ones; returns the cluster's prefixes.

    Raises ConfigError when they differ (the host or agent must not start: it would treat
    keys differently from the rest of the cluster, writing to etcd what the others read
    from L3 or the other way round), Unavailable when etcd cannot answer. Nothing is
    changed when they differ. A cluster whose prefixes were recorded before the default
    was gets this config's default recorded, once.
    """
    mine = sorted(set(config.cache.strong_prefixes))
    default = config.cache.l3_consistency
    deadline = time.monotonic() + (etcd.timeout if timeout is None else timeout)
    # a (quorum) read first: once recorded, checking is a read, whose failure says so
    found = {kv.key: kv for kv in etcd.range(CONFIG_PREFIX, timeout=timeout).kvs}
    kv: KeyValue | int | None = found.get(PREFIXES_KEY)
    kd: KeyValue | int | None = found.get(DEFAULT_KEY)
    if kv is None:
        try:
            rec = etcd.txn([Compare.create(PREFIXES_KEY, "=", 0)],
                           [put_op(PREFIXES_KEY, json.dumps(mine).encode()),
                            put_op(DEFAULT_KEY, default.encode())],
                           [get_op(PREFIXES_KEY), get_op(DEFAULT_KEY)],
                           timeout=max(0.001, deadline - time.monotonic()))
        except Unavailable as exc:
            raise Unavailable(f"recording the cluster's strong prefixes in etcd failed ({exc}); "
                              "harmless: the next strong operation checks again") from None
        if rec.succeeded:
            return mine
        kv, kd = rec.results[0], rec.results[1]
    try:
        theirs = sorted(json.loads(kv.value)) if isinstance(kv, KeyValue) and kv.value else []
    except (ValueError, TypeError):
        raise ConfigError("cache.strong_prefixes", f"etcd's {PREFIXES_KEY.decode()} is not a "
                          "JSON list of prefixes: with every host stopped, delete it (the "
                          "next host records its own)") from None
    if theirs != mine:
        raise ConfigError("cache.strong_prefixes",
                          f"this config has {mine}, the cluster records {theirs} (in etcd, "
                          f"{PREFIXES_KEY.decode()}): every host and agent must list the same "
                          "strong prefixes; fix this host's config (or, with every host "
                          "stopped, delete that etcd key)")
    if not isinstance(kd, KeyValue):  # recorded by a version that did not record it
        try:
            r = etcd.txn([Compare.create(DEFAULT_KEY, "=", 0)],
                         [put_op(DEFAULT_KEY, default.encode())], [get_op(DEFAULT_KEY)],
                         timeout=max(0.001, deadline - time.monotonic()))
        except Unavailable as exc:
            raise Unavailable(f"recording the cluster's cache.l3_consistency in etcd failed "
                              f"({exc}); harmless: the next strong operation checks again"
                              ) from None
        kd = None if r.succeeded else r.results[0]
    recorded = kd.value.decode("utf-8", "replace") if isinstance(kd, KeyValue) else default
    if recorded != default:
        raise ConfigError("cache.l3_consistency",
                          f"this config has {default!r}, the cluster records {recorded!r} (in "
                          f"etcd, {DEFAULT_KEY.decode()}): it decides whether keys under no "
                          "strong prefix are strong, so every host and agent must say the "
                          "same; fix this host's config (or, with every host stopped, delete "
                          "that etcd key)")
    return theirs


class StrongStore:
    """The strong keys of one client's namespace (see the module docstring)."""

    def __init__(self, config: Config, namespace: str,
                 unreachable: Callable[[], str | None] | None = None) -> None:
        cl = config.cluster
        self.config = config
        self.namespace = namespace
        self.timeout = float(cl.timeout)
        self.etcd = EtcdClient.from_config(cl)
        self._prefix = KEY_PREFIX
        self._default_strong = config.cache.l3_consistency == "strong"
        self._prefixes = tuple(config.cache.strong_prefixes)
        self._unreachable = unreachable  # the daemon's word: etcd majority unreachable
        self._checked = False
        self._leases: dict[int, int] = {}  # deadline bucket (epoch s) -> its etcd lease
        self._lease_lock = threading.Lock()
        self.counters = dict.fromkeys(("gets", "puts", "deletes", "retries", "conflicts"), 0)

    # ------------------------------------------------------------ classification

    def is_strong(self, key: str) -> bool:
        for p in self._prefixes:
            if key.startswith(p):
                return True
        return self._default_strong

    def check(self, timeout: float | None = None) -> None:
        """Compare (or record) the prefixes once (within ``timeout``, cluster.timeout by
        default). Raises ConfigError, Unavailable (saying what it was checking: the check
        records the prefixes when nobody has, so etcd calls it a write, but repeating it
        is harmless)."""
        if not self._checked:
            try:
                check_prefixes(self.etcd, self.config, timeout=timeout)
            except Unavailable as exc:
                raise Unavailable(f"strong keys: cannot compare cache.strong_prefixes with "
                                  f"the cluster's (recorded in etcd) yet, so no strong "
                                  f"operation was sent: {exc}") from None
            self._checked = True

    # ------------------------------------------------------------ encoding

    def _forget_lease(self, deadline: float, lease: int) -> None:
        """Drop ``lease`` from ``deadline``'s bucket (etcd no longer has it), so that the
        next :meth:`_lease_for` of that bucket grants a new one."""
        bucket = math.ceil(deadline)
        with self._lease_lock:
            if self._leases.get(bucket) == lease:
                del self._leases[bucket]

    def _lease_for(self, deadline: float) -> int:
        """The lease of ``deadline``'s bucket (the whole second at or after it), granted
        at its first use in this process with a TTL reaching the bucket's end: one lease
        per bucket, not one per key. Raises Unavailable."""
        bucket = math.ceil(deadline)
        with self._lease_lock:
            lease = self._leases.get(bucket)
            if lease is not None:
                return lease
        now = time.time()
        lease = self.etcd.lease_grant(max(1, math.ceil(bucket - now)), timeout=self.timeout)
        with self._lease_lock:
            for b in [b for b in self._leases if b < now]:  # (expired buckets)
                del self._leases[b]
            return self._leases.setdefault(bucket, lease)

    def _encode(self, encoded: tuple[int, bytes, bytes | memoryview],
                deadline: float | None = None) -> bytes:
        tag, meta, payload = encoded
        if deadline is None:
            data = _HEADER.pack(tag, len(meta)) + meta + bytes(payload)
        else:  # (the tag's high bit: the deadline follows the header)
            data = _HEADER.pack(tag | _HAS_DEADLINE, len(meta)) + _DEADLINE.pack(deadline) + \
                meta + bytes(payload)
        if len(data) > ETCD_VALUE_LIMIT:
            raise ValueTooLarge(f"a strong value is stored in etcd, whose request limit "
                                f"(--max-request-bytes, 1.5 MiB by default) this one "
                                f"({len(data)} bytes encoded) exceeds: store it under an "
                                "eventual key and keep a reference in the strong one")
        return data

    @staticmethod
    def _decode(key: str, data: bytes) -> Any:
        """The value stored in etcd. Raises CorruptRecord for bytes KVCOMM did not write
        (etcdctl, another program): whatever is wrong with them, only this key is
        concerned."""
        try:
            tag, n = _HEADER.unpack_from(data)
            at = _HEADER.size
            if tag & _HAS_DEADLINE:
                tag, at = tag & ~_HAS_DEADLINE, at + _DEADLINE.size
            if at + n > len(data):
                raise ValueError(f"{n} bytes of metadata announced, {len(data)} in all")
            meta = data[at:at + n]
            return codec.decode(tag, meta, data[at + n:])
        except KVCommError:
            raise
        except Exception as exc:  # (struct.error, the codec's ValueError, msgpack's...)
            raise CorruptRecord(f"strong key {key!r}: etcd holds {len(data)} bytes under "
                                f"{(KEY_PREFIX + key.encode()).decode(errors='replace')} that "
                                f"are not a KVCOMM value ({type(exc).__name__}: {exc}); "
                                "overwrite or delete the key") from None

    @staticmethod
    def _deadline(data: bytes) -> float | None:
        """The deadline a strong value carries (None: none, or too short to hold one:
        :meth:`_decode` then says what is wrong)."""
        if not data or not data[0] & _HAS_DEADLINE or len(data) < _HEADER.size + _DEADLINE.size:
            return None
        return float(_DEADLINE.unpack_from(data, _HEADER.size)[0])

    def _item(self, key: str, kv: KeyValue | None) -> Item | None:
        """The Item of an etcd key-value; None when absent or past its deadline (its
        lease may not have ended yet: the deadline decides, not the lease)."""
        if kv is None:
            return None
        d = self._deadline(kv.value)
        if d is not None and d <= time.time():
            return None
        return Item(key, self._decode(key, kv.value), strong_version(kv.mod_revision), "etcd",
                    d)

    # ------------------------------------------------------------ budget

    def _begin(self) -> float:
        """The deadline of one operation (2 x cluster.timeout); raises Unavailable at once
        while the host's daemon says etcd's majority is out of reach."""
        if self._unreachable is not None:
            why = self._unreachable()
            if why:
                raise Unavailable(f"strong keys are unavailable: {why} (partition mode); "
                                  "eventual keys keep working on this host")
        deadline = time.monotonic() + 2 * self.timeout
        if not self._checked:  # (the first operation: within its own budget)
            self.check(timeout=self._left(deadline))
        return deadline

    def _left(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Unavailable(f"etcd did not complete the operation within 2 x "
                              f"cluster.timeout={self.timeout:g}s")
        return min(left, self.timeout)

    # ------------------------------------------------------------ operations

    def get_item(self, key: str) -> Item | None:
        """The key's value and Version, read linearizably. Raises Unavailable."""
        deadline = self._begin()
        self.counters["gets"] += 1
        return self._item(key, self.etcd.get(self._prefix + key.encode(),
                                             timeout=self._left(deadline)))

    def range(self, prefix: str, after: str, limit: int) -> tuple[list[Item], bool]:
        """Strong keys under ``prefix`` after ``after``, in key order (etcd's own order:
        the keys' bytes), at most ``limit``, read linearizably in one range read:
        ``(items, more)``, ``more`` when keys past the last one remain. Raises Unavailable."""
        deadline = self._begin()
        self.counters["gets"] += 1
        start = None
        if after and after >= prefix:
            start = self._prefix + after.encode("utf-8") + b"\0"
        n = len(self._prefix)
        items: list[Item | None] = []
        while True:
            r = self.etcd.range(self._prefix + prefix.encode("utf-8"), limit=limit, start=start,
                                timeout=self._left(deadline))
            for kv in r.kvs:
                try:  # (a name that is not UTF-8 was not written by KVCOMM: no key)
                    key = kv.key[n:].decode("utf-8")
                except UnicodeDecodeError:
                    continue
                items.append(self._item(key, kv))
            if items or not r.more or not r.kvs:  # (more, and only such names: read past them)
                return [i for i in items if i is not None], r.more
            start = r.kvs[-1].key + b"\0"

    def put(self, key: str, value: Any, encoded: tuple[int, bytes, bytes | memoryview],
            expect: Any, validator: Callable[[str, Item | None, Any], None] | None,
            deadline: float | None = None) -> Version:
        """Write ``value`` (``encoded``) once a majority has it; with ``deadline`` (epoch
        seconds) the value carries it, and the key is attached to the lease of its
        deadline's 1-second bucket (see "Expiry" above). Raises ConflictError,
        ValidationError, ValueTooLarge, Unavailable (outcome unknown when it says so)."""
        lease = 0 if deadline is None else self._lease_for(deadline)
        data = self._encode(encoded, deadline)
        try:
            version = self._write(key, value, data, expect, validator, lease)
        except _LeaseNotFound:
            # the bucket's lease ended early (revoked, an etcd restored from a backup, this
            # host's clock stepped back past it): etcd wrote nothing; a new lease, once
            assert deadline is not None
            self._forget_lease(deadline, lease)
            lease = self._lease_for(deadline)
            version = self._write(key, value, data, expect, validator, lease)
        assert version is not None  # (a put always returns one)
        return version

    def delete(self, key: str, expect: Any,
               validator: Callable[[str, Item | None, Any], None] | None) -> bool:
        """Delete the key; True when it existed. Raises as :meth:`put`."""
        return self._write(key, None, None, expect, validator) is not None

    def _write(self, key: str, value: Any, data: bytes | None, expect: Any,
               validator: Callable[[str, Item | None, Any], None] | None,
               lease: int = 0) -> Version | None:
        deadline = self._begin()
        ek = self._prefix + key.encode()
        want = _expected_revision(key, expect)
        op = put_op(ek, data, lease) if data is not None else delete_op(ek)
        over = 0  # expect=ABSENT over this revision: a key past its deadline
        for _ in range(_MAX_UPDATE_RETRIES):
            compare: list[Compare] = []
            if validator is not None:
                kv = self.etcd.get(ek, timeout=self._left(deadline))
                # (an expired key is absent, whatever etcd still holds: see below)
                over = kv.mod_revision if want == 0 and kv is not None and \
                    self._item(key, kv) is None else 0
                current = 0 if kv is None or over else kv.mod_revision
                if want is not None and current != want:
                    self._conflict(key, kv, expect)
                current = over or current
                _run_validator(validator, key, self._item(key, kv), value)
                compare.append(Compare.mod(ek, "=", current))
            elif want:
                # expect=Version: a key past its deadline is at no version any more, though
                # etcd holds it until its lease ends; the deadline is in the value, which a
                # compare cannot read: read it first (a deadline passing during
                # the txn's round trip is not seen)
                kv = self.etcd.get(ek, timeout=self._left(deadline))
                if kv is None or kv.mod_revision != want or self._item(key, kv) is None:
                    self._conflict(key, None if kv is None or self._item(key, kv) is None
                                   else kv, expect)
                compare.append(Compare.mod(ek, "=", want))
            elif want is not None:
                compare.append(Compare.mod(ek, "=", over or want))
            elif data is not None:  # a plain put: no compare, one round trip
                rev = self.etcd.put(ek, data, lease=lease, timeout=self._left(deadline))
                self.counters["puts"] += 1
                return strong_version(rev)
            r = self.etcd.txn(compare, [op], [get_op(ek)], timeout=self._left(deadline))
            if r.succeeded:
                if data is None:
                    self.counters["deletes"] += 1
                    deleted = r.results[0]
                    return strong_version(r.revision) if deleted else None
                self.counters["puts"] += 1
                return strong_version(r.revision)
            found = r.results[0]
            kv = found if isinstance(found, KeyValue) else None
            if want == 0 and (kv is None or self._item(key, kv) is None):
                # past its deadline, its lease not ended yet: absent to every read, so
                # absent to expect=ABSENT too; replace exactly that revision (or, once
                # etcd has deleted it, none)
                over = 0 if kv is None else kv.mod_revision
                self.counters["retries"] += 1
                continue
            if validator is None or (want is not None and (0 if kv is None else kv.mod_revision) != want):
                self._conflict(key, kv, expect)
            self.counters["retries"] += 1  # another writer came between the read and the txn
        raise Unavailable(f"a write of strong key {key!r} lost {_MAX_UPDATE_RETRIES} races")

    def incr(self, key: str, delta: int) -> int:
        """Add ``delta`` to the int under ``key`` (absent, or past its deadline: 0) in one
        etcd transaction that commits only if the key's ``mod_revision`` is still the one
        read (its failure branch reads the key again for the next try); the key keeps its
        deadline and lease. Returns the new value. Raises InvalidArgument (the key holds
        something else than an int; a value past 2**53-1), Unavailable, CorruptRecord."""
        deadline = self._begin()
        ek = self._prefix + key.encode()
        kv = self.etcd.get(ek, timeout=self._left(deadline))
        for _ in range(_MAX_UPDATE_RETRIES):
            item = self._item(key, kv)
            old = 0 if item is None else item.value
            if type(old) is not int:
                raise InvalidArgument(f"incr: strong key {key!r} holds a {type(old).__name__}, "
                                      "not an int: incr counts only ints; delete the key, or "
                                      "put an int, first")
            new = old + delta
            if not -counter.MAX_COUNT <= new <= counter.MAX_COUNT:
                raise InvalidArgument(f"incr of {key!r}: the value would pass 2**53-1 in "
                                      "magnitude")
            keep = None if item is None else item.expires_at
            data = self._encode(codec.encode(new), keep)
            lease = 0 if item is None or kv is None else kv.lease
            compare = [Compare.mod(ek, "=", 0 if kv is None else kv.mod_revision)]
            r = self.etcd.txn(compare, [put_op(ek, data, lease)], [get_op(ek)],
                              timeout=self._left(deadline))
            if r.succeeded:
                self.counters["puts"] += 1
                return new
            found = r.results[0]
            kv = found if isinstance(found, KeyValue) else None
            self.counters["retries"] += 1  # another writer came between the read and the txn
        raise Unavailable(f"an incr of strong key {key!r} lost {_MAX_UPDATE_RETRIES} races")

    def _conflict(self, key: str, kv: KeyValue | None, expect: Any) -> None:
        self.counters["conflicts"] += 1
        if expect is ABSENT:
            raise ConflictError(f"{key!r} exists (etcd revision {kv.mod_revision if kv else 0}); "
                                "expected it absent")
        found = f"etcd revision {kv.mod_revision}" if kv is not None else "absent"
        raise ConflictError(f"{key!r} is at {found}, expected {expect}; re-read it and retry")

    def close(self) -> None:
        self.etcd.close()


def _expected_revision(key: str, expect: Any) -> int | None:
    """The mod_revision ``expect=`` requires (0: absent), or None (no check). Raises
    InvalidArgument for what is neither a Version nor ABSENT."""
    from .items import _NO_CHECK

    if expect is _NO_CHECK:
        return None
    if expect is ABSENT:
        return 0
    if not isinstance(expect, Version):
        raise InvalidArgument(f"expect= takes a kvcomm.Version or kvcomm.ABSENT, got "
                              f"{type(expect).__name__}")
    rev = revision_of(expect)
    if rev is None:
        raise ConflictError(f"{key!r} is a strong key (cache.strong_prefixes): its Version "
                            f"carries an etcd revision, and {expect} does not; re-read it "
                            "with get_item and retry")
    return rev
