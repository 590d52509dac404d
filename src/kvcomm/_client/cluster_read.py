"""The L2-miss path in cluster mode: negative cache, the host's key filter, one L3 read, an L2 fill."""

from __future__ import annotations

import threading
import time
from typing import Any

from .._l2core import WouldBlock
from .._threads import start_quiet
from ..core.expiry import expired
from ..core.versions import Version
from ..errors import KVCommError, Unavailable, ValueTooLarge
from .base import _FILL_WITHIN, _network
from .items import Item
from .merge import Merging

_OPENING = threading.Lock()  # (a client's L3 open in flight: _open_l3)
_ASK: Any = object()  # (_get_l3_many: a read L3 answers)


class L3Read(WouldBlock):
    """An L2 miss of ``key`` in cluster mode, met on an event loop's thread (kvcomm.aio's
    inline attempt): the read is for L3, nothing was read. kvcomm.aio gathers such reads
    into one :meth:`ClusterReads._get_l3_many` in a thread; anywhere else it is the
    WouldBlock it is (the whole call runs again in a thread)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"{key!r} is read from L3, a network round trip")
        self.key = key
        self.timed = False  # (the read's turn to be timed, metrics: _get_slow sets it)


class ClusterReads(Merging):
    """The L2-miss path in cluster mode."""

    def _get_l3(self, key: str, default: Any, want_item: bool) -> Any:
        """An L2 miss in cluster mode: one round trip to L3, then fill L2 (and L1 next read).

        A key L3 does not have is remembered as absent for ``cache.negative_ttl``; so is
        one the host's key filter rules out, while the filter is trusted (its daemon's
        heartbeat is fresh). A note is never older than what the host knows: one the
        daemon has learned of the key since (:meth:`_still_absent`) is dropped and L3
        asked. Raises Unavailable (L3 unreachable; at once when the host's daemon is in
        partition mode, Redis out of its reach), CorruptRecord (the L3 value of this key
        is not a valid KVCOMM record; nothing is written to L2) and ConfigError
        (``cluster.groups`` is not the count L3 was initialised with); on an event loop's
        thread (kvcomm.aio's inline attempt) L3Read, nothing read: the read is for L3.
        """
        now = time.monotonic()
        ask = self._l3_ask(key, now)
        if ask is None:
            return None if want_item else default
        self._l3_reachable(f"{key!r} is not on this host and")
        try:
            l3 = self._l3_store()  # (before counting)
        except WouldBlock:
            raise L3Read(key) from None
        self.counters["l3_reads"] += 1
        return self._l3_answer(key, l3.get(key), now, ask, default, want_item)

    def _get_l3_many(self, reads: list[tuple[str, Any, bool, bool]]) -> list[Any]:
        """kvcomm.aio's reads of keys this host does not hold (``(key, default,
        want_item, timed)``, each one whose inline attempt raised L3Read; ``timed``: its
        turn to be timed, metrics), in a thread: one pipeline of GETs per master for all
        of them, not a round trip each (a key asked twice is read once). Per read, what
        :meth:`_get_l3` returns, or the exception it raises (returned in its place:
        CorruptRecord for that key alone). The masters are read at the same time; one
        down, hung or failing fails only its own keys (L3Store.get_each). Raises what
        opening L3 raises; SegmentError on a closed client."""
        self._live()  # (a closed client reads nothing)
        now, t0 = time.monotonic(), time.perf_counter_ns()
        asks: dict[str, Any] = {}
        out: list[Any] = []
        for key, default, want_item, _timed in reads:
            self._l2_misses += 1  # (the inline attempt took its miss back)
            try:
                ask = asks[key] if key in asks else self._l3_ask(key, now)
            except KVCommError as exc:
                out.append(exc)
                continue
            if ask is None:
                out.append(None if want_item else default)
            else:
                asks[key] = ask
                out.append(_ASK)
        if not asks:
            return self._timed_many(reads, out, t0)
        try:
            self._l3_reachable("these keys are not on this host and")
        except Unavailable as exc:
            return [exc if o is _ASK else o for o in out]
        l3 = self._l3_store()
        self.counters["l3_reads"] += len(asks)
        # (the masters read at the same time; one down or hung fails its own keys alone)
        recs: dict[str, Any] = l3.get_each(asks)
        items: dict[str, Any] = {}  # (each key's answer made once: one L3 read, one count)
        for i, (key, default, want_item, _timed) in enumerate(reads):
            if out[i] is not _ASK:
                continue
            if key not in items:
                rec = recs.get(key)
                if isinstance(rec, BaseException):
                    items[key] = rec
                else:
                    try:
                        items[key] = self._l3_answer(key, rec, now, asks[key], None, True)
                    except KVCommError as exc:
                        items[key] = exc
            item = items[key]
            out[i] = item if want_item or isinstance(item, BaseException) else \
                default if item is None else item.value
        return self._timed_many(reads, out, t0)

    def _timed_many(self, reads: list[tuple[str, Any, bool, bool]], out: list[Any],
                    t0: int) -> list[Any]:
        """``out``, the latency of :meth:`_get_l3_many` since ``t0`` noted for each of its
        reads whose turn it was to be timed (tier ``l3``, or ``absent``)."""
        ns = time.perf_counter_ns() - t0
        for (_key, _default, _want_item, timed), o in zip(reads, out, strict=True):
            if timed and not isinstance(o, BaseException):
                self._note_latency("get", "absent" if o is None else getattr(o, "tier", "l3"),
                                   ns)
        return out

    def _l3_ask(self, key: str, now: float) -> tuple[int, Any] | None:
        """Whether ``key`` (an L2 miss) is for L3: None when the negative cache or the
        host's key filter answers "absent" (counted), else what :meth:`_l3_answer` needs
        of the filter as it was before the read."""
        note = self._negative.entry(key, now)
        if note is not None:
            if self._still_absent(key, note):
                self._negative.hit()
                self.counters["negative_hits"] += 1
                return None
            self._negative.invalidate(key)
            self.counters["negative_rechecks"] += 1
        kf = self._key_filter()
        m = self._kf  # (the mapping, trusted or not: its count stamps a note)
        stamp = 0 if m is None else m.learned  # (read before the answer it stamps)
        if kf is not None and not kf.may_exist(key.encode("utf-8", "surrogatepass")):
            self.counters["filter_hits"] += 1
            self._negative.note_absent(key, now, stamp, False)
            return None
        return stamp, m

    def _l3_answer(self, key: str, rec: Any, now: float, ask: tuple[int, Any], default: Any,
                   want_item: bool) -> Any:
        """What a read of ``key`` returns given L3's record ``rec`` (None: absent), read
        after ``now`` and :meth:`_l3_ask`: absent remembered, or the value filled into L2."""
        stamp, m = ask
        # (L3Record.deadline unpacks the extension field: once)
        if rec is None or rec.tombstone or expired(deadline := rec.deadline, time.time()):
            self.counters["l3_absent"] += 1
            matched = m is None or m.may_exist(key.encode("utf-8", "surrogatepass"))
            self._negative.note_absent(key, now, stamp, matched)
            return None if want_item else default
        value = rec.decode_value(key)
        self.counters["l3_hits"] += 1
        version = Version(rec.vector, rec.hlc)
        if time.monotonic() - now < _FILL_WITHIN:  # (an older read might be stale by now)
            try:
                self._merge(key, value, version, (rec.tag, rec.meta, rec.value),  # fill L2
                            rec.local_ext)
            except ValueTooLarge:
                pass  # this host's L2 can never hold it: served from L3 every time
        if want_item:
            return Item(key, value, version, "l3", deadline)
        return value

    def _still_absent(self, key: str, note: list[Any]) -> bool:
        """Whether a live negative note of ``key`` (``[until, stamp, matched]``) still
        answers "absent": no key the host's daemon learned since the note's ``stamp`` is
        this one (the filter's ring of learned keys: no round trip). Where the ring no
        longer reaches back to the stamp, the filter judges, while trusted: the key in it
        now and not when noted, it was learned since. A key it matched already
        when noted (one deleted since the filter's last rotation, or a false positive)
        keeps its note for ``negative_ttl``: a loop reading a key that stays absent costs
        at most one L3 read per ``negative_ttl``. The note is restamped when it holds. A
        filter file the daemon retired (a restarted daemon put a new one in place) no
        longer counts: the new file is opened and judges the note (its stamp is of
        another file: too old for the ring)."""
        m = self._kf
        if m is not None and m.retired:  # a restarted daemon's new file counts from now on
            # (reopened now, not within _key_filter's second: a retired file says its
            # successor is in place, and an agent whose last reopen was under a second ago
            # answered "absent" for a key the new daemon knew; once per retired mapping)
            self._kf_retry = 0.0
            self._key_filter()
            m = self._kf
            if m is None or m.retired:
                return True  # (no new file yet: judged once it is there)
        if m is None or m.learned == note[1]:  # (no filter, or nothing learned since)
            return True
        n = m.learned
        kb = key.encode("utf-8", "surrogatepass")
        seen = m.learned_since(kb, note[1])
        if seen:
            return False
        if seen is None:  # (too far back for the ring)
            kf = self._key_filter()
            if kf is None:
                return True  # (an untrusted filter: judged once it is trusted again)
            if kf.may_exist(kb):
                if not note[2]:
                    return False
            else:
                note[2] = False
        note[1] = n
        return True

    def _l3_reachable(self, what: str) -> None:
        """Raise Unavailable at once, rather than after 2 x ``cluster.timeout``, when the
        host's node daemon says it is in partition mode with Redis out of its reach (its
        status file, fresh): an operation that needs L3 cannot be answered. Partition
        mode for want of etcd alone leaves L3 reads alone. ``what`` begins the message
        ("... L3 is out of reach")."""
        st = self._host_status().status()
        if st is not None and st.get("partition") and st.get("redis_unreachable"):
            raise Unavailable(
                f"{what} L3 is out of reach: the node daemon of host {st.get('host')!r} is "
                f"in partition mode ({st.get('partition_reason') or 'Redis unreachable'}); "
                "the eventual keys this host holds stay readable and writable; retry once "
                "the partition heals")

    def _l3_store(self) -> Any:
        """The L3 adapter, opened at its first use. Raises Unavailable, ConfigError
        (``cluster.groups`` is not the count L3 was initialised with); WouldBlock on an
        event loop's thread (kvcomm.aio: every use of L3 is a round trip).

        Opening reads the slot map from the seeds, each costing ``cluster.timeout`` on a
        cut-off host: it is done in a thread of its own, and a caller waits for it at
        most 2 x ``cluster.timeout``, then gets Unavailable while the open goes on (a
        later call takes its result; a failed open is tried again by the next call)."""
        _network("L3")
        if self._l3 is None:
            self._l3 = self._open_l3()
        return self._l3

    def _open_l3(self) -> Any:
        from concurrent.futures import Future
        from concurrent.futures import TimeoutError as Pending

        with _OPENING:
            fut = self._l3_opening
            if fut is None:
                fut = self._l3_opening = Future()
                start_quiet(threading.Thread(target=self._open_l3_into, args=(fut,),
                                             daemon=True, name="kvcomm-l3-open"))
        wait = 2 * float(self.config.cluster.timeout)
        try:
            return fut.result(wait)
        except Pending:
            raise Unavailable(f"Redis Cluster did not answer within {wait:g}s (2 x "
                              "cluster.timeout); still trying in the background: retry "
                              "later") from None
        except BaseException:
            with _OPENING:
                if self._l3_opening is fut:
                    self._l3_opening = None  # (the next call tries again)
            raise

    def _open_l3_into(self, fut: Any) -> None:
        from ..tiers.l3 import AgentL3

        try:
            l3 = AgentL3.from_config(self.config.cluster,
                                     max_value_size=self.config.cache.max_value_size)
            try:  # (another count than L3's would read every key under the wrong name)
                l3.check_groups()
            except BaseException:
                l3.close()
                raise
        except BaseException as exc:
            fut.set_exception(exc)
            return
        fut.set_result(l3)

    def _key_filter(self) -> Any:
        """The daemon's filter of existing keys while it is trusted (built, not retired,
        heartbeat fresh: ``KeyFilter.ready``), else None. An untrusted one is dropped and
        the file reopened, at most once a second: the daemon may have been restarted and
        put a new file in place. Raises SegmentError for a filter file of another user or
        of too wide a mode (``cache.l2_permissions``)."""
        kf = self._kf
        if kf is not None and kf.ready:
            return kf
        now = time.monotonic()
        if now < self._kf_retry:
            return None
        # Dropped, not closed: another thread sharing this client may be between its own
        # _key_filter() and may_exist() on it; the mapping goes with the last reference.
        self._kf = None
        from ..tiers.keyfilter import KeyFilter

        # (a refused file raises at every miss, not once a second: no silent fallback)
        self._kf = KeyFilter.open_reader(self.name, self.config.cache.l2_permissions,
                                         self.config.cache.l2_dir)
        self._kf_retry = now + 1.0
        return self._kf if self._kf is not None and self._kf.ready else None

