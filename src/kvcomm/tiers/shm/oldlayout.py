"""Segments of an older layout: reading what they still owe L3.

A segment made by an older KVCOMM is refused by this one (its layout version differs:
tiers/shm/layout.py), but in cluster mode it may still hold writes not yet in L3 (dirty
records). Each layout version that may be met in the wild has a reader here
(``READERS``): pure Python over a read-only mapping, every offset and length checked
before use (the file is shared memory another process wrote), returning the dirty records
with their versions. Only words 0 and 1 (magic and layout version) are common to every
version. The segment's open (its refusal message), ``kvcomm purge`` (its refusal) and
``kvcomm migrate`` (tiers/shm/migrate.py: carrying them into a new segment) read them
through :func:`unflushed`.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from dataclasses import dataclass
from typing import Any

from ...core.versions import MAX_COUNTER, counters_valid, decode_others
from ...errors import SegmentError
from .files import check_owner
from .layout import LAYOUT_VERSION, is_segment_magic


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
        if not is_segment_magic(magic):
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
        if not is_segment_magic(magic) or version == LAYOUT_VERSION:
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
