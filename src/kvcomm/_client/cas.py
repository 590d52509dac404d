"""Conditional writes in cluster mode: decided on the key's L3 master, not on the host's copy.

``put(..., expect=)``, ``delete(..., expect=)`` and so ``update()`` and ``touch()`` of an
eventual key in cluster mode are decided against the key's latest version in the
cluster: one call of L3's conditional-write script (:data:`kvcomm.tiers.l3.CAS_LUA`) on
the key's master checks the expectation against the record L3 holds and, if it holds,
stores the new record there, atomically; two hosts can never both win. The agent waits
for that answer (one Redis round trip; plain puts stay local), then stores the result
in its host's L2 as a record L3 already has (clean: the node daemon does not push it
again), or as a write still to push (dirty) when fewer replicas than
``cluster.wait_replicas`` took it in ``cluster.wait_timeout``: the daemon's own push then
waits for them, as for any write.

What is compared: the expectation (a Version, or ABSENT) is the key's state as the agent
last saw it. While this host holds a write of its own not yet in L3 (dirty), that write
is the key's latest version here: the expectation must name it (else ConflictError at
once, no round trip), and L3 passes a record that the write descends from — what pushing
the write first, then comparing, would give, in one call. Otherwise L3 passes exactly
the expected version (or a dead record for ABSENT; or none at all: nothing in the
cluster contradicts the expectation). On a conflict, L3's record comes back and is
stored in L2 (as the daemon would), so the caller's next ``get_item`` reads it and a
retry (``update``) needs no other round trip.

The new record's version is the host's record's vector, the expected one and what L3
holds merged, plus a new dot of this host (taken from L2's write sequence before the
call: :meth:`kvcomm.tiers.shm.sync.SyncState.take_dot`), so it descends from everything
it replaced, everywhere. Before a dot past the host's write mark in L3 leaves the host,
the mark is raised (as the daemon does before its pushes): a host whose L2 is lost never
restarts its sequence below a dot of its in L3.

A conditional delete of a live counter (the host's copy at the expected version) writes
a tombstone that carries the counter's state, every baseline raised, as a plain delete
does (:mod:`kvcomm._client.counters`): increments it did not see survive it. A deleted
counter's tombstone that L3 sends back (a conflict) keeps its state in L2 likewise.

Partition mode (the host's daemon says so): Unavailable at once, nothing written — a
decision on the host's copy could grant what another host already holds. A Redis failover
can still undo a write the master acknowledged before its replicas had it, as for any
Redis write; with ``cluster.wait_replicas`` (1 by default) a write is acknowledged only
once that many replicas took it, or else it stays dirty until the daemon's push has them.
"""

from __future__ import annotations

import time
from typing import Any

from ..core import codec, counter
from ..core.expiry import deadline_of
from ..core.versions import Version, encode_others, merge_vectors, vector_get, with_dot
from ..errors import ConflictError, CorruptRecord, InvalidArgument, Unavailable, ValueTooLarge
from ..tiers.l2 import FLAG_DIRTY, TAG_TOMBSTONE
from ..tiers.l3 import EMPTY_EXT, L3Record
from .base import _now_ms
from .items import ABSENT
from .read import Reads

_STALE_TRIES = 8  # pushes again after "stale" (L3 held a dead record newer in part than ours)


class ClusterWrites(Reads):
    """Conditional writes of eventual keys in cluster mode."""

    _cas_marked = 0  # the host's write mark in L3 as this client last knew it

    def _cas_write(self, key: str, kb: bytes, h: int,
                   encoded: tuple[int, bytes, bytes | memoryview] | None, expect: Any,
                   ext: bytes, value: Any) -> Version:
        """Write ``encoded`` (None: a delete) under ``key`` if the cluster's latest
        version of it is ``expect`` (a Version, or ABSENT), decided on L3. Returns the
        new version. Raises ConflictError (L3's record, stored in L2, contradicts it),
        Unavailable (partition mode, Redis unreachable: nothing decided — or, after a
        timeout, not known to be), CorruptRecord, InvalidArgument (a bad ``expect``)."""
        if expect is not ABSENT and not isinstance(expect, Version):
            raise InvalidArgument(f"expect= takes a kvcomm.Version or kvcomm.ABSENT, got "
                                  f"{type(expect).__name__}")
        l3 = self._cas_store(key)
        seen: list[L3Record] = []  # dead records L3 answered "stale" with
        for _ in range(_STALE_TRIES):
            before = self._seg.version(kb, h)
            local = None if before is None else self._version(before[3], before[4], before[5])
            check = self._cas_check(key, before, local, expect)
            basis, floor = check, expect.hlc if isinstance(expect, Version) else 0
            for v in ([] if local is None else [local]) + [Version(r.vector, r.hlc) for r in seen]:
                basis, floor = merge_vectors(basis, v.vector), max(floor, v.hlc)
            lost = vector_get(basis, self._host)
            if lost > self._seg.write_sequence:  # (dots of an earlier life of this L2)
                self._past_lost_dots(lost)
            dot, hlc = self._seg.take_dot(_now_ms(), floor)
            self._cas_mark(l3, dot)
            vector = with_dot(basis, self._host, dot)
            if encoded is None:
                meta, state = self._cas_counter_tombstone(kb, h, before, local, expect)
                record = L3Record(hlc, True, 0, meta, state, vector, (self._host, dot))
            else:
                record = L3Record(hlc, False, encoded[0], bytes(encoded[1]), bytes(encoded[2]),
                                  vector, (self._host, dot), ext or EMPTY_EXT)
            cl = self.config.cluster
            res = l3.push_if(key, record, expect is ABSENT, check, basis,
                             cl.wait_replicas, int(cl.wait_timeout * 1000))
            if res.outcome == "stale":
                assert res.record is not None
                seen.append(res.record)
                continue
            if res.outcome == "conflict":
                self._cas_conflict(key, res.record, expect)
            self._cas_install(key, kb, h, before, record, value, res.durable)
            return Version(vector, hlc)
        raise Unavailable(f"a conditional write of {key!r} met {_STALE_TRIES} newer deletes "
                          "in a row in L3; retry")

    def _cas_store(self, key: str) -> Any:
        """The L3 adapter for a conditional write; Unavailable at once in partition mode."""
        st = self._host_status().status()
        if st is not None and st.get("partition"):
            why = "".join(c if c.isprintable() else "?" for c in str(st.get("partition_reason"))[:200])
            raise Unavailable(
                f"a conditional write of {key!r} (expect=, update, touch) is decided on the "
                f"key's Redis master, and this host is in partition mode ({why}): it is not "
                "decided on the host's copy, which may be stale. Nothing was written; retry "
                "once Redis answers again, or write without expect= (last-writer-wins)")
        return self._l3_store()

    def _cas_counter_tombstone(self, kb: bytes, h: int, before: Any, local: Version | None,
                               expect: Any) -> tuple[bytes, bytes]:
        """The (meta, payload) of a conditional delete's tombstone: when it deletes the
        live counter this host holds at the expected version, the counter's state with
        every baseline raised (as a plain delete's: _client/counters.py delete_check), so
        that increments it did not see survive it; else a plain tombstone's."""
        if before is None or before[2] != codec.COUNTER or local != expect:
            return b"", b""
        rec = self._seg.read(kb, h)
        if (rec is None or rec.tag != codec.COUNTER or rec.value is None
                or (rec.counter, rec.hlc, rec.vvx) != tuple(before[3:6])
                or 0 < rec.deadline <= time.time()):
            return b"", b""
        try:
            state = counter.decode(rec.value)
        except ValueError:
            return b"", b""  # (a corrupt state: deleted as any record)
        return counter.TOMBSTONE_META, counter.encode(counter.reset(state))

    def _cas_check(self, key: str, before: Any, local: Version | None, expect: Any) -> Any:
        """The vector L3's record must be at most (CAS_LUA's ``check``). A write of this
        host not yet in L3 (dirty) is the key's latest version here: ``expect`` must name
        it, or ConflictError at once."""
        if before is None or not before[6] & FLAG_DIRTY:
            return () if expect is ABSENT else expect.vector
        assert local is not None
        deadline = deadline_of(before[7])
        live = before[2] != TAG_TOMBSTONE and not (deadline and deadline <= time.time())
        if expect is ABSENT and not live:
            return local.vector
        if expect is not ABSENT and live and local == expect:
            return expect.vector
        self.counters["conflicts"] += 1
        raise ConflictError(f"{key!r} is at {local if live else 'absent'} on this host (its "
                            f"write not yet in L3), expected "
                            f"{'it absent' if expect is ABSENT else expect}; re-read it and retry")

    def _cas_conflict(self, key: str, rec: L3Record | None, expect: Any) -> None:
        """L3 refused: store its record in L2 (a later read sees it) and raise ConflictError."""
        now = "absent"
        if rec is not None:
            self._cas_learn(key, rec)
            dead = rec.tombstone or (rec.deadline is not None and rec.deadline <= time.time())
            now = "absent" if dead else str(Version(rec.vector, rec.hlc))
        self.counters["conflicts"] += 1
        raise ConflictError(f"{key!r} is at {now} in the cluster, expected "
                            f"{'it absent' if expect is ABSENT else expect}; re-read it and "
                            "retry")

    def _cas_learn(self, key: str, rec: L3Record) -> None:
        """Merge L3's record ``rec`` into L2, as the daemon would (a value L2 cannot
        hold, or L3 cannot decode, is left to the read path)."""
        try:
            value = None if rec.tombstone else rec.decode_value(key)
            enc = (TAG_TOMBSTONE, rec.meta, rec.value) if rec.tombstone else (
                rec.tag, rec.meta, rec.value)  # (a deleted counter's tombstone keeps its state)
            self._merge(key, value, Version(rec.vector, rec.hlc), enc, rec.local_ext)
        except (ValueTooLarge, CorruptRecord):
            pass

    def _cas_install(self, key: str, kb: bytes, h: int, before: Any, record: L3Record,
                     value: Any, durable: bool) -> None:
        """Store the record L3 took in L2: over the record the write was based on, clean
        (dirty when not ``durable``: the daemon pushes it again and waits for replicas);
        if a local write replaced that record meanwhile, merged as any version from L3."""
        seen = None if before is None else tuple(before[3:6])
        enc = (TAG_TOMBSTONE, record.meta, record.value) if record.tombstone else (
            record.tag, record.meta, record.value)
        ext = record.local_ext

        def unchanged() -> None:
            now = self._seg.version(kb, h)
            if (None if now is None else tuple(now[3:6])) != seen:
                raise ConflictError("changed during the conditional write")

        op = (kb, h, *enc, record.dot[1], record.hlc, encode_others(record.vector, self._host),
              ext)
        try:
            try:
                self._seg.apply([op], now_ms=_now_ms(), dirty=not durable, check=unchanged)
            except ConflictError:
                self._merge(key, value, Version(record.vector, record.hlc), enc, ext)
        except ValueTooLarge:  # (L2 can never hold it: reads are served from L3)
            self._seg.evict(kb, h)
        self._l1.discard(key)
        if record.tombstone:
            self.counters["deletes"] += 1
        else:
            self._puts += 1

    def _cas_mark(self, l3: Any, dot: int) -> None:
        """Make the host's write mark in L3 cover ``dot`` before it leaves the host (the
        daemon's invariant: every dot of the host in L3 is at most the mark). Costs a
        round trip the first time, and when the daemon's block ahead is used up."""
        if dot <= self._cas_marked:
            return
        from ..node.push import WRITE_MARK_BLOCK

        mark = l3.load_write_mark(self._host)
        if dot > mark:
            mark = dot + WRITE_MARK_BLOCK
            l3.save_write_mark(self._host, mark)
        self._cas_marked = mark
