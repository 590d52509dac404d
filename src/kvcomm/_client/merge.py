"""Merging a version from elsewhere into this host's L2 — the one port the node daemon
(and an L3 fill) uses: vector order, then a resolver or last-writer-wins."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..core import codec
from ..core.resolve import Sibling
from ..core.resolve import resolve as resolve_siblings
from ..core.versions import (
    Dotted,
    Ordering,
    Version,
    as_sibling,
    compare_vectors,
    counters_valid,
    encode_others,
    merge_vectors,
    vector_get,
)
from ..errors import ConflictError, InvalidArgument, InvalidKey, KVCommError, Unavailable
from ..tiers import l2 as l2mod
from ..tiers.l2 import TAG_TOMBSTONE, key_hash
from . import counters
from .base import _HUGE, _now_ms
from .hotkeys import HotKeys
from .items import _TOMB_ENCODED, _TOMBSTONE, Item
from .validators import _MAX_UPDATE_RETRIES


class Merging(HotKeys):
    """Merging a version from elsewhere into this host's L2."""

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
        stored with the merged vector. Returns the version stored afterwards. Raises
        InvalidArgument (nothing stored) for a vector that is not (host id, counter in
        1..2**53-1) pairs: a counter past that bound would carry this host's write
        sequence with it; and for a strong key (cluster mode: it lives in etcd only).
        """
        if not isinstance(version, Version):
            raise InvalidArgument(f"version must be a kvcomm.Version, got {type(version).__name__}")
        if not counters_valid(version.vector):
            raise InvalidArgument(f"version {version.vector!r:.200} is not (host id, counter in "
                                  "1..2**53-1) pairs (kvcomm.core.versions.MAX_COUNTER)")
        if self._strong_on and self._is_strong(key, None):
            raise InvalidArgument(f"{key!r} is a strong key (cache.strong_prefixes): it lives "
                                  "in etcd only, where no merge applies; write it with put()")
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
               remote_encoded: tuple[int, bytes, bytes | memoryview],
               remote_ext: bytes = b"") -> Version:
        """:meth:`merge_remote` with the value already encoded (an L3 record's bytes) and
        the record's extension field (``remote_ext``, b"": none).

        ``remote_encoded[0] == TAG_TOMBSTONE``: the remote version is a delete; it is kept
        as a clean tombstone. Deletes (on either side) merge last-writer-wins. The stored
        record carries the extension field of the side whose value it keeps (none for a
        resolver's new value).
        """
        if self._unusable:
            self._live()
        kb, h = self._key_hash(key)
        remote_value = _TOMBSTONE if remote_encoded[0] == TAG_TOMBSTONE else value
        # this host's entry in ``version`` past its write sequence names dots of an earlier
        # life of its L2 (lost, and its sequence restarted lower: a clock set back), which
        # by vector order alone cover this life's writes although they never saw them
        lost = vector_get(version.vector, self._host)
        if lost <= self._seg.write_sequence:
            lost = 0
        elif not self._unseen_write(kb, h, lost):  # (else _restamp below does it)
            self._past_lost_dots(lost, kb)
        for _ in range(_MAX_UPDATE_RETRIES):
            if lost and self._unseen_write(kb, h, lost):
                # an acknowledged write L3 has not taken yet: not older than ``version``
                # but unseen by it; written again past it first (as the daemon rebases a
                # write L3 answered 'older' for such dots), so that it is kept, not undone
                if self._restamp(key, version):
                    self.counters["lost_dots"] += 1
                continue  # (False: a local write came meanwhile: look again)
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

            if encoded is remote_encoded:
                ext = remote_ext
            else:  # (read before the check, which fails if the local record moved since)
                ext = b"" if new_write or local is None else self._local_ext(kb, h)
            try:
                r = self._seg.apply([(kb, h, *encoded, *explicit, ext)], now_ms=_now_ms(),
                                    dirty=publish and self._cluster, check=unchanged)[0]
            except ConflictError:
                continue  # a local write raced us: merge against it
            self.counters["merges"] += 1
            self._l1.discard(key)
            return self._version(r[0], r[1], r[2])
        raise Unavailable(f"merge of {key!r} lost {_MAX_UPDATE_RETRIES} races in a row")

    def _local_ext(self, kb: bytes, h: int) -> bytes:
        """The extension field of this host's record of ``kb`` (b"": none or absent)."""
        v = self._seg.version(kb, h)
        return b"" if v is None else v[7]

    def _unseen_write(self, kb: bytes, h: int, lost: int) -> bool:
        """Whether this host's record of ``kb`` is a write of its own not yet in L3 (dirty)
        whose dot is at most ``lost``: covered, by counter only, by another version's
        dots of an earlier life of this host's L2."""
        rec = self._seg.read(kb, h, 0)
        return rec is not None and 0 < rec.counter <= lost and self._seg.is_dirty(rec.word)

    def _past_lost_dots(self, lost: int, skip: bytes = b"") -> int:
        """Raise the host's write sequence past ``lost``, a dot of an earlier life of its
        L2 that a version from elsewhere names, and give every write of this host not yet
        in L3 (dirty; but ``skip``'s, which the caller writes again itself) whose dot is at
        most ``lost`` a new dot past it: value, HLC, extension field and other hosts'
        entries unchanged. Those writes may be covered, by counter only, by the old dots
        of other keys' records, which never saw them; once the sequence is raised, those
        dots no longer stand out as an earlier life's (``lost`` > write sequence), so every
        such write is moved past them now, not only the key that showed them. Returns how
        many were. Raises what L2 raises (SegmentError, Unavailable)."""
        seg = self._seg
        if lost <= seg.write_sequence:
            return 0
        seg.raise_write_sequence(lost)  # (first: a write from now on has a dot past it)
        moved = 0
        for kb in seg.dirty_keys():
            if kb == skip:
                continue
            h = key_hash(kb)
            for _ in range(_MAX_UPDATE_RETRIES):
                rec = self._read_l2(kb, h, _HUGE)
                if rec is None or rec[5] > lost or not seg.is_dirty(rec[0]):
                    break
                seen = (rec[5], rec[6], rec[7])

                def unchanged(kb: bytes = kb, h: int = h, seen: tuple[int, int, bytes] = seen
                              ) -> None:
                    now = seg.read(kb, h, 0)
                    if now is None or (now.counter, now.hlc, now.vvx) != seen:
                        raise ConflictError("changed while moving past lost dots")

                op = (kb, h, rec[2], rec[3], rec[4], max(lost, seg.write_sequence) + 1,
                      rec[6], rec[7], self._local_ext(kb, h))
                try:
                    seg.apply([op], now_ms=_now_ms(), dirty=True, check=unchanged)
                except ConflictError:
                    continue  # a local write came meanwhile (its dot is past ``lost``)
                self._l1.discard(kb.decode("utf-8", "surrogateescape"))
                moved += 1
                break
        self.counters["lost_dots"] += moved
        return moved

    def _restamp(self, key: str, other: Version) -> bool:
        """Write this host's record of ``key`` again as a new local write that descends
        from both itself and ``other`` (L3's version, which covers the local dot because
        the host's write sequence restarted). The write sequence is first raised past
        ``other``'s entry for this host. Returns False when there is nothing to restamp:
        no record, a clean one (not a write of this host waiting for L3: ``other`` is
        merged as it is instead), or one a local write replaced meanwhile."""
        kb, h = self._key_hash(key)
        self._past_lost_dots(vector_get(other.vector, self._host), kb)
        rec = self._read_l2(kb, h, _HUGE)
        if rec is None or not self._seg.is_dirty(rec[0]):
            return False
        seen = self._version(rec[5], rec[6], rec[7])
        merged = merge_vectors(seen.vector, other.vector)

        def unchanged() -> None:
            now = self._seg.read(kb, h)
            if now is None or self._version(now.counter, now.hlc, now.vvx) != seen:
                raise ConflictError("changed while restamping")

        op = (kb, h, rec[2], rec[3], rec[4], l2mod.NEW_DOT, max(seen.hlc, other.hlc),
              encode_others(merged, self._host), self._local_ext(kb, h))
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
        counted = self._counter_plan(key, local, remote_encoded, remote)
        if counted is not None:
            return counted
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

    def _counter_plan(self, key: str, local: Item, remote_encoded: tuple[int, bytes,
                      bytes | memoryview], remote: Version,
                      ) -> tuple[tuple[int, bytes, bytes | memoryview], Version, bool] | None:
        """:meth:`_merge_plan` for concurrent versions one of which is a counter (or a
        deleted one: _client/counters.py): two counters merge into a new local write; a
        plain record wins over a counter that did not adopt a put stamped at or after it.
        None when neither is a counter."""
        kb, h = self._key_hash(key)
        rec = self._read_l2(kb, h, _HUGE)
        if rec is None or rec[4] is None:
            return None  # (gone meanwhile: the caller's check sees it and merges again)
        plan = counters.merge_plan((rec[2], rec[3], rec[4]), remote_encoded,
                                   local.version.hlc, remote.hlc)
        if plan is None:
            return None
        side, encoded = plan
        vector = merge_vectors(local.version.vector, remote.vector)
        if side == "new":
            return encoded, Version(vector, max(local.version.hlc, remote.hlc)), True
        hlc = local.version.hlc if side == "local" else remote.hlc
        return encoded, Version(vector, hlc), False


def _dotted(v: Version, other: Version) -> Dotted:
    """``v`` as a sibling of the concurrent ``other`` (:func:`~kvcomm.core.versions.as_sibling`)."""
    return as_sibling(v.vector, v.hlc, other.vector)


def _storable(value: Any) -> bool:
    try:
        codec.encode(value)
    except KVCommError:
        return False
    return True



class RemoteMerges:
    """The node daemon's way into this host's L2 through its own client (node/port.py's
    ClientPort): versions from elsewhere merged in, this host's records restamped, and
    what else the daemon asks of the client, without reaching into its private state.
    Every method raises what the client's write path raises (SegmentError, Unavailable
    when a key keeps changing); a failed merge leaves L2 as it was."""

    def __init__(self, kv: Merging) -> None:
        self._kv = kv
        self.segment = kv._seg  # the host's L2 segment (the daemon reads its feed, flags)

    def version_of(self, counter: int, hlc: int, vvx: bytes) -> Version:
        """The Version of an L2 record of this host: its own entry ``counter``, the other
        hosts' entries (``vvx``, encoded) and its ``hlc``. Raises CorruptRecord (a bad
        ``vvx``)."""
        return self._kv._version(counter, hlc, vvx)

    def apply(self, key: str, value: Any, version: Version,
              encoded: tuple[int, bytes, bytes | memoryview], ext: bytes = b"") -> Version:
        """Merge ``version`` of ``key`` (from L3: ``value`` decoded, ``encoded`` its tag,
        meta and bytes, ``ext`` its extension field) into L2 by the vector order, then a
        resolver or last-writer-wins; returns the version L2 holds then (see
        :meth:`kvcomm.Client.merge_remote`). A tombstone's tag keeps a clean tombstone."""
        return self._kv._merge(key, value, version, encoded, ext)

    def restamp(self, key: str, other: Version) -> bool:
        """Write this host's record of ``key`` again as a new local write descending from
        itself and ``other`` (L3's version, which covers the local dot after the host's
        write sequence restarted). False when there is nothing to restamp."""
        return self._kv._restamp(key, other)

    def past_lost_dots(self, lost: int) -> int:
        """Raise the host's write sequence past ``lost`` (a dot of an earlier life of its
        L2) and give its writes not yet in L3 at or below it new dots; returns how many
        were given new dots."""
        return self._kv._past_lost_dots(lost)

    def has_resolver(self, key: str) -> bool:
        """Whether an application resolver is registered for ``key``'s prefix."""
        resolvers = self._kv._resolvers
        return bool(resolvers) and resolvers.lookup(key) is not None

    def forget_cached(self, key: str) -> None:
        """Drop this process's L1 copy of ``key`` (before L2 evicts it)."""
        self._kv._l1.discard(key)
