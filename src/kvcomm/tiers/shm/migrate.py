"""Segments of an older layout: what they still owe L3, and carrying it into a new one.

A segment made by an older KVCOMM is refused by this one (its layout version differs:
tiers/shm/layout.py). In cluster mode it may still hold **writes not yet in L3** (dirty
records): acknowledged writes that an upgrade must not drop. So an old segment is never
silently purged: opening it names the unflushed writes, ``kvcomm purge`` refuses it while
it holds any (``--force`` discards them, knowingly), and ``kvcomm migrate`` carries them
into a new segment, where the node daemon delivers them as it delivers any local write.

Each layout version that may be met in the wild has a reader here (``READERS``): pure
Python over a read-only mapping, every offset and length checked before use (the file is
shared memory another process wrote), returning the dirty records with their versions.
Only words 0 and 1 (magic and layout version) are common to every version.

Migration (:func:`migrate`), with the old segment's users stopped:

1. the old file is renamed aside (``kvcomm.NS.v<old>.migrating``): new users now create a
   new segment, and a crash leaves the old records in the aside file, where the next
   ``kvcomm migrate`` finds them again;
2. every dirty record is written into the new segment with its own version, dirty (the
   daemon pushes it to L3, whose merge keeps whichever version is newer). Where the new
   segment already holds the key, the two are merged by L3's rule
   (:func:`kvcomm.core.resolve.l3_rule`), not by presence: what the new segment holds may
   be a write made after the upgrade (its dot is above the old ones: the new segment's
   write sequence starts at the wall clock, and step 2 raises it past the carried dots),
   but it may as well be an *older* copy from L3 (an agent's L2-miss read, the daemon's
   prewarm or a pulled change, made while a crashed migration left the records aside).
   A record that covers the old write's dot keeps its place (``superseded``); one older
   than it is replaced; a concurrent one is merged last-writer-wins with the merged
   vector (as L3 would; application resolvers are not consulted), dirty so that L3
   learns the merge;
3. the aside file is removed.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
import time
from dataclasses import dataclass
from typing import Any

from ...core.resolve import EQUAL, NEW, OLDER, l3_rule
from ...core.versions import (
    MAX_COUNTER,
    Dotted,
    as_sibling,
    counters_valid,
    decode_others,
    encode_others,
    vector_get,
)
from ...errors import ConflictError, SegmentError, Unavailable
from .files import check_owner
from .layout import LAYOUT_VERSION, MAGIC

_MAGIC_STEM = MAGIC & 0x00FFFFFFFFFFFFFF  # b"KVCOMM\0" + the version byte on top


@dataclass(frozen=True, slots=True)
class OldRecord:
    """A record an older segment holds, as the current segment takes it."""

    key: bytes
    tag: int
    meta: bytes
    value: bytes
    counter: int
    hlc: int
    vvx: bytes
    dirty: bool
    ext: bytes = b""  # the extension field (layout 3 on; b"": none)


def _read_v2(mm: Any) -> tuple[str, list[OldRecord]]:
    """Layout 2 (KVCOMM before the hardening of the L2 tier): host id at byte 1024; slots
    of 5 words (seq, hash, record offset, reference bit, flags: 1 = dirty); records with a
    64-byte header (size, counter, hlc, info = key length | tag << 16 | vvx length << 24,
    value length, value offset, -, meta length), then key, vvx, meta, and the value."""
    return _read_slots(mm, 2, host_at=1024, vv_shift=24, ext=False)


def _read_v3(mm: Any) -> tuple[str, list[OldRecord]]:
    """Layout 3 (the layout before the metrics region; slots and records as in layout 4):
    host id at byte 1536; slots as layout 2's; records with a 64-byte header (size,
    counter, hlc, info = key length | tag << 16 | vvx length << 32, value length, value
    offset, -, lens = meta length | extension length << 32), then key, vvx, meta, the
    extension field, and the value."""
    return _read_slots(mm, 3, host_at=1536, vv_shift=32, ext=True)


def _read_slots(mm: Any, version: int, *, host_at: int, vv_shift: int,
                ext: bool) -> tuple[str, list[OldRecord]]:
    """The dirty records of a layout-2, -3 or -4 segment (their header words up to MAX_KEY,
    slots and record headers are placed alike; the record's info word and the extension
    field differ)."""
    size = len(mm)
    where = f"layout-{version} segment"

    def word(off: int) -> int:
        if off < 0 or off + 8 > size:
            raise SegmentError(f"{where}: a field lies outside the file (corrupt)")
        return int(struct.unpack_from("<Q", mm, off)[0])

    n_slots, slots_off, data_off, data_size = word(24), word(32), word(48), word(56)
    max_key = word(15 * 8)
    if not (0 < n_slots <= 1 << 32 and slots_off + n_slots * 40 <= size
            and data_off + data_size <= size and 0 < max_key <= 1 << 16):
        raise SegmentError(f"{where}: its header is inconsistent (corrupt)")
    hlen = min(mm[host_at], 64)
    host = bytes(mm[host_at + 1:host_at + 1 + hlen]).decode("utf-8", "replace")
    out: list[OldRecord] = []
    for i in range(n_slots):
        s = slots_off + i * 40
        off, flags = word(s + 16), word(s + 32)
        if off <= 1 or not flags & 1:  # empty, deleted, or already in L3
            continue
        if not data_off <= off <= data_off + data_size - 64:
            raise SegmentError(f"{where}: slot {i} points outside the heap (corrupt)")
        rsize, counter, hlc, info = word(off), word(off + 8), word(off + 16), word(off + 24)
        if not 0 < counter <= MAX_COUNTER:
            raise SegmentError(f"{where}: the record of slot {i} has counter "
                               f"{counter}, outside 1..2**53-1 (corrupt)")
        vlen, vrel, lens = word(off + 32), word(off + 40), word(off + 56)
        klen, tag = info & 0xFFFF, (info >> 16) & 0xFF
        vvlen = (info >> vv_shift) & 0xFFFFFFFF
        mlen, xlen = (lens & 0xFFFFFFFF, lens >> 32) if ext else (lens, 0)
        if not (64 <= rsize <= data_off + data_size - off and 0 < klen <= max_key
                and 64 + klen + vvlen + mlen + xlen <= vrel and vrel + vlen == rsize):
            raise SegmentError(f"{where}: the record of slot {i} is malformed (corrupt)")
        p = off + 64
        key = bytes(mm[p:p + klen])
        vvx = bytes(mm[p + klen:p + klen + vvlen])
        meta = bytes(mm[p + klen + vvlen:p + klen + vvlen + mlen])
        xf = bytes(mm[p + klen + vvlen + mlen:p + klen + vvlen + mlen + xlen])
        value = bytes(mm[off + vrel:off + vrel + vlen])
        try:
            others = decode_others(vvx)
            key.decode("utf-8")
        except (ValueError, UnicodeDecodeError):
            raise SegmentError(f"{where}: the record of slot {i} is malformed "
                               "(corrupt)") from None
        if not counters_valid(others):
            raise SegmentError(f"{where}: the record of slot {i} has a counter "
                               "outside 1..2**53-1 (corrupt)")
        out.append(OldRecord(key, tag, meta, value, counter, hlc, vvx, True, xf))
    return host, out


def _read_v4(mm: Any) -> tuple[str, list[OldRecord]]:
    """Layout 4 (the layout before the expiry hint: slots, records and host id as in
    layout 3; the metrics region, which holds no writes, added)."""
    return _read_slots(mm, 4, host_at=1536, vv_shift=32, ext=True)


def _read_v5(mm: Any) -> tuple[str, list[OldRecord]]:
    """Layout 5 (the layout before the reservation map: slots, records and host id as in
    layout 4; the expiry hint's header words added, and the file fully reserved)."""
    return _read_slots(mm, 5, host_at=1536, vv_shift=32, ext=True)


READERS = {2: _read_v2, 3: _read_v3, 4: _read_v4, 5: _read_v5}


def layout_version(path: str, permissions: int) -> int | None:
    """The layout version of the KVCOMM segment at ``path``; None when it is not one (too
    short, foreign). Raises SegmentError for a file of another user or too wide a mode."""
    with _mapped(path, permissions) as mm:
        if mm is None or len(mm) < 16:
            return None
        magic, version = struct.unpack_from("<QQ", mm, 0)
        if magic & 0x00FFFFFFFFFFFFFF != _MAGIC_STEM:
            return None
        return int(version)


def unflushed(path: str, permissions: int) -> tuple[int, str, list[OldRecord]] | None:
    """``(layout version, host id, dirty records)`` of an older segment with a reader, or
    None for the current layout, an unknown one, or a file that is not a segment. Raises
    SegmentError (corrupt, or another user's)."""
    with _mapped(path, permissions) as mm:
        if mm is None or len(mm) < 4096:
            return None
        magic, version = struct.unpack_from("<QQ", mm, 0)
        if magic & 0x00FFFFFFFFFFFFFF != _MAGIC_STEM or version == LAYOUT_VERSION:
            return None
        reader = READERS.get(int(version))
        if reader is None:
            return None
        host, records = reader(mm)
        return int(version), host, records


class _mapped:
    """``with _mapped(path, permissions) as mm``: a read-only mapping (None: no such file)."""

    def __init__(self, path: str, permissions: int) -> None:
        self.path, self.permissions = path, permissions
        self.mm: Any = None

    def __enter__(self) -> Any:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise SegmentError(f"cannot open {self.path}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SegmentError(f"{self.path} is not a regular file; remove it")
            check_owner(self.path, st, self.permissions)
            if st.st_size == 0:
                return None
            self.mm = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        return self.mm

    def __exit__(self, *exc: object) -> None:
        if self.mm is not None:
            self.mm.close()


def aside_path(path: str, version: int) -> str:
    return f"{path}.v{version}.migrating"


@dataclass(frozen=True, slots=True)
class Migrated:
    """What :func:`migrate` did: records carried (written into the new segment, alone or
    merged with what it held), records skipped because the new segment already held a
    write that covers theirs, and the old layout version (0: nothing to do)."""

    carried: int
    superseded: int
    from_version: int


def migrate(name: str, config: Any) -> Migrated:
    """Carry the unflushed writes of namespace ``name``'s older segment into a new one.

    ``config`` is the :class:`kvcomm.Config` the namespace is used with (its L2 geometry
    makes the new segment). Stop the old segment's users first. Idempotent: a migration
    that died half-way is finished by the next call (the aside file is found again).
    Raises SegmentError (the old segment is corrupt or another user's; it is left where
    it is) and what writing the new segment raises (e.g. Unavailable when more writes wait
    than ``cluster.outbound_max``: raise it for the migration).
    """
    from ..l2 import open_segment, segment_path  # (l2 builds on this package)
    from .geometry import Layout

    c = config.cache
    path = segment_path(name, c.l2_dir)
    found = None
    for v in sorted(READERS):
        if os.path.exists(aside_path(path, v)):
            found = (aside_path(path, v), v)
    if found is None:
        version = layout_version(path, c.l2_permissions)
        if version is None or version == LAYOUT_VERSION:
            return Migrated(0, 0, 0)
        if version not in READERS:
            raise SegmentError(f"{path} has layout version {version}, which this KVCOMM "
                               "cannot read; migrate it with the version that wrote it")
        found = (aside_path(path, version), version)
        os.rename(path, found[0])  # new users now get a new segment; the records wait aside
    aside, version = found
    got = unflushed(aside, c.l2_permissions)
    records = [] if got is None else got[2]
    layout = Layout.plan(c.l2_size, c.max_key_bytes, c.watch_buffer, c.max_views,
                         c.max_value_size, c.l2_keys)
    seg = open_segment(name, layout, config.node.host_id, c.l2_permissions,
                       directory=c.l2_dir, lock_timeout=c.lock_timeout)
    carried = superseded = 0
    try:
        host = config.node.host_id
        old_host = "" if got is None else got[1]
        # the new segment's own dots must stay above the carried ones (first: a write made
        # while this runs must not reuse one of their dots)
        seg.raise_write_sequence(max((r.counter for r in records if old_host == host),
                                     default=0))
        for rec in records:
            if _carry(seg, host, old_host, rec):
                carried += 1
            else:
                superseded += 1
    finally:
        seg.close()
    os.unlink(aside)
    return Migrated(carried, superseded, version)


def _carry(seg: Any, host: str, old_host: str, rec: OldRecord) -> bool:
    """Write the old dirty record ``rec`` into ``seg``, merged with what ``seg`` holds of
    its key by L3's rule (see the module docstring). Returns False when ``seg`` holds a
    write that covers it (nothing written). Raises what the write raises (Unavailable
    when ``seg`` keeps changing under it)."""
    from .segment import key_hash

    h = key_hash(rec.key)
    # the record's whole vector, told again from the new segment's host (the same one,
    # unless the config names another host: then the old entry is an "other")
    vector = tuple(sorted(decode_others(rec.vvx) + ((old_host, rec.counter),)))
    incoming = Dotted(vector, (old_host, rec.counter), rec.hlc)
    for _ in range(100):
        cur = seg.read(rec.key, h)
        op: tuple[Any, ...]
        if cur is None:
            outcome, after = NEW, incoming
        else:
            held = tuple(sorted(decode_others(cur.vvx)
                                + (((host, cur.counter),) if cur.counter else ())))
            outcome, merged = l3_rule(as_sibling(held, cur.hlc, vector), incoming)
            assert merged is not None
            after = merged
        if outcome in (OLDER, EQUAL):
            return False
        counter, vvx = vector_get(after.vector, host), encode_others(after.vector, host)
        if after.dot == incoming.dot and after.hlc == incoming.hlc:  # the old write wins
            op = (rec.key, h, rec.tag, rec.meta, rec.value, counter, after.hlc, vvx)
            if rec.ext:
                op = (*op, rec.ext)
        else:  # merged, and what the new segment holds wins: it learns the old dot
            assert cur is not None and cur.value is not None
            ext = seg.version(rec.key, h)
            op = (rec.key, h, cur.tag, cur.meta, cur.value, counter, after.hlc, vvx,
                  b"" if ext is None else ext[7])

        def unchanged(kb: bytes = rec.key, h: int = h, seen: Any = cur) -> None:
            now = seg.read(kb, h)
            if (None if now is None else (now.word, now.seq)) != (
                    None if seen is None else (seen.word, seen.seq)):
                raise ConflictError("the key changed while it was merged")

        try:
            seg.apply([op], now_ms=time.time_ns() // 1_000_000, dirty=True, check=unchanged)
        except ConflictError:
            continue  # a write raced this one: merge against it
        return True
    raise Unavailable(f"migrating {rec.key!r}: the key kept changing; run `kvcomm migrate` "
                      "again (the records wait in the aside file)")
