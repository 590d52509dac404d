"""kv.incr: a counter that counts exactly among a host's processes and, in cluster mode,
across hosts (a PN-counter merged by L2 and L3: core/counter.py, _client/counters.py)."""

from __future__ import annotations

import time
from typing import Any

from ..core import codec, counter
from ..core.versions import Version
from ..errors import InvalidArgument, Unavailable
from ..tiers.l2 import TAG_TOMBSTONE
from . import counters
from .base import _now_ms
from .write import Writes


class Counting(Writes):
    """Counters."""

    def incr(self, key: str, delta: int = 1) -> int:
        """Add ``delta`` (an int, negative allowed) to the counter ``key``; returns its
        value as this host sees it after the increment. ``get`` of the key returns that int.

        An absent key starts at 0; a key holding a plain int starts from it (adopted once,
        however many hosts adopt the same write); any other value raises InvalidArgument,
        and so does a counter's total of increments (or decrements) past 2**53-1.

        Guarantees. Embedded, and among the processes of a host: atomic, each increment
        counted exactly once (under the host's L2 writer lock). Cluster mode, eventual keys:
        every acknowledged increment of every host is counted exactly once on every host
        once they have exchanged their writes — the counter is a CRDT (per-host counts,
        merged by maximum in L2 and in L3's push script, its value their sum), so it keeps
        counting on a cut-off host (partition mode) and across a heal, a daemon restart or a
        Redis failover (bar what a failover loses of any Redis write: an unreplicated push,
        which the node daemon pushes again). The value returned is this host's view:
        another host's increments count once they arrive. Strong keys
        (``cache.strong_prefixes``): one etcd transaction, linearizable (Unavailable in
        partition mode).

        Deletes and puts. A ``delete`` of a counter removes every increment it has seen,
        on every host; an increment it has not seen (made concurrently on another host)
        survives it, and the key reappears holding just those (observed-remove). A ``put``
        of a plain value replaces the counter and wins over concurrent increments it has
        not seen (a reset; incrementing its int starts a new generation, which wins whole
        over counters that never saw the put). Either way no increment made before an
        acknowledged put or delete ever comes back.

        TTL: an increment keeps the key's deadline (set by ``put(..., ttl=)`` or
        ``touch``, which are puts: resets); once it passes, the counter is absent and the
        next increment counts from 0. Use :meth:`update` instead for a conditional read-modify-write of any
        value. Raises InvalidKey, InvalidArgument, Unavailable (L2 full of unflushed
        writes: ``cluster.outbound_max``), SegmentError; nothing is counted then.
        """
        if type(delta) is not int or not -counter.MAX_COUNT <= delta <= counter.MAX_COUNT:
            raise InvalidArgument(f"incr's delta is an int of at most 2**53-1 in magnitude, "
                                  f"got {delta!r:.100}")
        if self._unusable:
            self._live()
        if self._strong_on and self._is_strong(key, None):
            return int(self._strong.incr(key, delta))
        kb, h = self._key_hash(key)
        if self._cluster:
            self._negative.invalidate(key)  # this host will hold it: no longer "absent"
            if self._seg.read(kb, h, 0) is None:
                self._fill_counter(key)
        seg, host = self._seg, self._host
        out: list[int] = []

        def count() -> None:
            # under the writer lock: the op is made from exactly the record it replaces
            # (apply hands the kernel the list it was given, after this check)
            rec = seg.read(kb, h)
            version = None if rec is None else self._version(rec.counter, rec.hlc, rec.vvx)
            state, deadline = counters.start_of(key, rec, version, time.time())
            state = counters.add(key, state, host, seg.write_sequence + 1, delta)
            ext = self._ext if deadline is None else self._extc.ext(deadline)
            ops[0] = (kb, h, codec.COUNTER, b"", counter.encode(state), ext)
            out.append(counter.value(state))

        ops: list[tuple[Any, ...]] = [(kb, h, codec.COUNTER, b"", b"")]  # (made by count)
        self._seg.apply(ops, now_ms=_now_ms(), dirty=self._cluster,
                        max_dirty=self._max_dirty, check=count)
        self._puts += 1
        return out[-1]

    def _fill_counter(self, key: str) -> None:
        """Bring L3's record of ``key`` (a deleted counter's tombstone too: its state keeps
        the delete's baseline) into L2 before the host's first increment of it, so that the
        increment counts from the cluster's value and returns it. Skipped in partition
        mode or when L3 cannot answer: the increment then counts into a new entry of this
        host, merged with the cluster's state once the host is back (nothing is lost)."""
        st = self._host_status().status()
        if st is not None and st.get("partition"):
            return
        try:
            rec = self._l3_store().get(key)
        except Unavailable:
            return
        if rec is None:
            return
        version = Version(rec.vector, rec.hlc)
        if rec.tombstone:
            self._merge(key, None, version, (TAG_TOMBSTONE, rec.meta, rec.value), rec.local_ext)
        else:
            self._merge(key, rec.decode_value(key), version, (rec.tag, rec.meta, rec.value),
                        rec.local_ext)
