"""Prefix scans: ``kv.scan(prefix, limit=, after=)``, every live key under a prefix, in order.

(Cluster mode's sources and the cost of a page: :meth:`Scanning._scan_cluster` and
:mod:`kvcomm.tiers.l3`, "The key index".)

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
import time
from collections.abc import Iterator
from typing import Any

from ..core.codec import is_text
from ..core.expiry import expired
from ..core.sortedkeys import SortedKeys
from ..core.versions import Version
from ..errors import InvalidArgument, InvalidKey
from ..tiers.l2 import FLAG_DIRTY, KIND_PUT, TAG_TOMBSTONE, L2Segment
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

    @property
    def built(self) -> bool:
        """Whether the index was made (its first sync walks every slot: O(keys))."""
        return self._keys is not None

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
    if not is_text(prefix):
        raise InvalidKey(f"the scan prefix {prefix!r} is not valid UTF-8 (a lone surrogate?): "
                         "no key starts with it")
    if limit is not None and (type(limit) is not int or limit < 1):
        raise InvalidArgument(f"limit is a page size, an int >= 1 (or None: no limit), got {limit!r}")
    if after is not None and type(after) is not str:
        raise InvalidArgument(f"after is the last key of the previous page (a str) or None, "
                              f"got {type(after).__name__}")
    if after is not None and not is_text(after):
        raise InvalidArgument(f"after={after!r} is not valid UTF-8 (a lone surrogate?): pass "
                              "the last key of the previous page")


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
        costs O(log n + limit + writes since this process's last scan). Cluster mode:
        every live key of the cluster under the prefix, merged from L3's key index, this
        host's L2 (its writes not yet in L3 included) and etcd (strong keys); a page of n
        costs G index reads of O(log(keys of a group) + n) each inside Redis (G =
        ``cluster.groups``; one read-only script call per master per 512 groups), at
        most n GETs, and one etcd range read when strong keys may be under the prefix;
        a key another host deleted or put is absent or present as soon as L3 has the
        change, but the value of a key this host holds may be the one before another
        host's put until its daemon applied it (as ``get``). See :mod:`kvcomm._client.scan`. Raises
        InvalidKey (a prefix that is not a str), InvalidArgument (a bad limit or after),
        SegmentError; in cluster mode, while iterating, Unavailable (L3 or etcd out of
        reach: scan again from the last key received) and CorruptRecord (a foreign value
        under an indexed key). Nothing is changed, and nothing is put in L2.
        """
        check_scan_args(prefix, limit, after)
        self._live()
        index = self._key_index()
        index.sync()
        if self._cluster:
            return self._scan_cluster(index, prefix, after or "", limit)
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

    # ------------------------------------------------------------ cluster mode

    def _strong_kinds(self, prefix: str) -> tuple[bool, bool]:
        """(may keys under ``prefix`` be eventual, may they be strong)."""
        st = self._strong
        if st is None or not self._strong_on:
            return True, False
        if st._default_strong or any(prefix.startswith(p) for p in st._prefixes):
            return False, True  # every key under it is strong (a key's longest prefix wins)
        return True, self._strong_possible(prefix)

    def _scan_cluster(self, index: KeyIndex, prefix: str, after: str,
                      limit: int | None) -> Iterator[Item]:
        """Cluster mode: the merge, in key order, of three sorted sources, page by page:
        L3's key index (every group, :meth:`L3Store.index_range`), this host's L2 (its
        ordered index: keys written here and not yet in L3 among them) and, for strong
        keys, etcd's range reads. Each round reads up to ``step`` keys from each source;
        the merged candidates are final up to the smallest last key of a source that had
        more (``bound``). A candidate is served from L2 when L2's record is this host's
        write not yet in L3 (a tombstone: a delete not yet in L3, skipped) or a value
        L3's index lists; any other, from L3's record (a tombstone: skipped), so that
        L2's view of another host's change the daemon has not applied yet (a delete, a
        put over this host's delete) is never served. Nothing read is put in L2.
        """
        eventual, strong = self._strong_kinds(prefix)
        if eventual:
            self._l3_reachable(f"a scan of {prefix!r} reads L3, and")  # (at once)
        l3 = self._l3_store() if eventual else None
        st = self._strong
        left = limit if limit is not None else -1
        while left != 0:
            step = _CHUNK if left < 0 else min(max(left, 16), _CHUNK)
            bounds: list[str] = []
            cands: dict[str, Item | None] = {}  # key → its strong Item, or None: eventual
            if eventual:
                assert l3 is not None
                keys3, bound3 = l3.index_range(prefix, after, step)
                local = index.range(prefix, after, step)
                if bound3 is not None:
                    bounds.append(bound3)
                if len(local) >= step:
                    bounds.append(local[-1])
                is_strong = st.is_strong if strong else None
                for k in keys3 + local:
                    if (is_strong is None or not is_strong(k)) and self._is_key(k):
                        cands[k] = None
            if strong:
                items, more = st.range(prefix, after, step)
                if more and items:
                    bounds.append(items[-1].key)
                for it in items:
                    cands[it.key] = it
            bound = min(bounds) if bounds else None
            order = sorted(k for k in cands if bound is None or k <= bound)
            indexed = set(keys3) if eventual else set()
            from_l3 = [k for k in order
                       if cands[k] is None and not self._l2_serves(k, k in indexed)]
            recs = l3.get_many(from_l3) if from_l3 and l3 is not None else {}
            for k in order:
                item = cands[k] if cands[k] is not None else self._scan_item(k, recs)
                if item is not None:
                    yield item
                    left -= 1
                    if left == 0:
                        return
            if bound is None:
                return
            after = bound

    def _is_key(self, key: str) -> bool:
        """Whether ``key`` is a valid key (an L3 index member that is not, NUL in it or
        too long, was put there by something else than KVCOMM: no live key)."""
        try:
            self._key_hash(key)
        except InvalidKey:
            return False
        return True

    def _l2_serves(self, key: str, indexed: bool) -> bool:
        """Whether L2's record of ``key`` is the one to serve: this host's write not yet
        in L3 (dirty: a put, or a delete to skip), or a value L3's index lists. Any other
        record L2 holds may be older than what L3 acknowledged (another host's delete or
        put the daemon has not applied yet): L3's record is read instead."""
        kb, h = self._key_hash(key)
        v = self._seg.version(kb, h)
        if v is None:
            return False
        if v[6] & FLAG_DIRTY:
            return True
        return indexed and v[2] != TAG_TOMBSTONE

    def _scan_item(self, key: str, recs: dict[str, Any]) -> Item | None:
        """The Item of an eventual candidate: from L2 when it holds the key (a tombstone:
        None), else from L3's record read for this page (a tombstone, absent: None)."""
        if key not in recs:
            kb, h = self._key_hash(key)
            rec = self._read_l2(kb, h, self._zc)
            if rec is not None:  # (a tombstone: deleted here, L3 told soon)
                return None if rec[2] == TAG_TOMBSTONE else self._get_slow(key, None, True,
                                                                           False, rec)
            recs = self._l3_store().get_many([key])  # evicted since: L3 has it
        rec3 = recs.get(key)
        if rec3 is None:
            return None
        if isinstance(rec3, Exception):
            raise rec3
        # (L3Record.deadline unpacks the extension field: once)
        if rec3.tombstone or expired(deadline := rec3.deadline, time.time()):
            return None
        return Item(key, rec3.decode_value(key), Version(rec3.vector, rec3.hlc), "l3",
                    deadline)
