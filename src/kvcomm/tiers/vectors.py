"""A host's vector index: one float32 matrix per index in shared memory, every process mapping it.

File ``<cache.l2_dir>/kvcomm.<namespace>.vec.<index id>`` (16 hex digits), beside the L2
segment, of mode ``cache.l2_permissions``, made whole under a temporary name and linked
into place (:func:`kvcomm.tiers.shm.files.create_temp`), never resized; ``kvcomm purge``
removes it with the namespace. Layout (little-endian):

* a 256-byte header of 64-bit words: magic, layout, dims, capacity, key bytes, ``high``
  (rows ever used: a search reads rows ``[0, high)``), ``overflow`` (a put found no free
  row: the index no longer holds every vector), ``intent`` (the length of the key in the
  intent area, 0 when none);
* the intent area (key bytes): the key of the item whose record and rows a writer is
  changing;
* the row table: per row a 64-bit ``stamp`` (0: free), the key's 64-bit hash, its length,
  and its bytes;
* the matrix: ``capacity`` rows of ``dims`` float32, each a unit vector (or zero).

The items' records are the truth; a row is a copy of one of an item's vectors, tagged
with the stamp the item's record carries, so that a reader can tell a current row from a
stale one. Writers serialize on an ``flock`` of the file (and a thread lock): a writer
names its item in the intent area, changes the record, then the item's rows (a row's
stamp is zeroed before it is rewritten and set last), then clears the intent. A writer
killed in between leaves the intent set; the next writer to take the lock rebuilds that
item's rows from its record (:meth:`VectorFile.lock`'s ``repair``). Readers take no
lock: they read the matrix in one pass and check every row they keep against the item's
record.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from xxhash import xxh3_64_intdigest

from ..errors import SegmentError
from .shm.files import SHM_DIR, _unlink_quietly, check_owner, create_temp, remove_dead_temps, segment_path

MAGIC = int.from_bytes(b"KVCVEC01", "little")
LAYOUT = 1
_HDR = 256
H_MAGIC, H_LAYOUT, H_DIMS, H_CAP, H_KEYB, H_HIGH, H_OVERFLOW, H_INTENT = range(8)
_ID_RE = re.compile(r"^[0-9a-f]{16}$")


def vector_path(namespace: str, index_id: str, directory: str = SHM_DIR) -> str:
    segment_path(namespace)  # validates the name
    if not _ID_RE.match(index_id):
        raise ValueError(f"bad index id {index_id!r}")
    return os.path.join(directory, f"kvcomm.{namespace}.vec.{index_id}")


def remove_all(namespace: str, directory: str = SHM_DIR) -> None:
    """Remove namespace ``namespace``'s vector files (and dead builders' temporary ones)."""
    pattern = re.compile(rf"kvcomm\.{re.escape(namespace)}\.vec\.[0-9a-f]{{16}}")
    try:
        names = [n for n in os.listdir(directory) if pattern.fullmatch(n)]
    except OSError:
        return
    for name in names:
        path = os.path.join(directory, name)
        try:
            if os.stat(path, follow_symlinks=False).st_uid == os.geteuid():
                os.unlink(path)
        except OSError:
            pass
        remove_dead_temps(path)


def _align(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


def _geometry(dims: int, capacity: int, key_bytes: int) -> tuple[int, ...]:
    """Offsets of the intent area, stamps, hashes, lengths, keys, matrix; and the size."""
    intent = _HDR
    stamps = _align(intent + key_bytes)
    hashes = stamps + 8 * capacity
    lens = hashes + 8 * capacity
    keys = _align(lens + 4 * capacity)
    matrix = _align(keys + key_bytes * capacity)
    return intent, stamps, hashes, lens, keys, matrix, matrix + 4 * dims * capacity


class VectorFile:
    """A mapped vector file: :meth:`open` (creating it when missing)."""

    def __init__(self, path: str, fd: int, mm: mmap.mmap, np: Any) -> None:
        self.path, self._fd, self._mm, self._np = path, fd, mm, np
        hdr = np.frombuffer(mm, dtype="<u8", count=_HDR // 8)
        self.hdr = hdr
        self.dims, self.capacity, self.key_bytes = (int(hdr[H_DIMS]), int(hdr[H_CAP]),
                                                    int(hdr[H_KEYB]))
        it, st, ha, ln, ks, mx, _size = _geometry(self.dims, self.capacity, self.key_bytes)
        cap, kb = self.capacity, self.key_bytes
        self.intent = np.frombuffer(mm, dtype="u1", count=kb, offset=it)
        self.stamps = np.frombuffer(mm, dtype="<u8", count=cap, offset=st)
        self.hashes = np.frombuffer(mm, dtype="<u8", count=cap, offset=ha)
        self.lens = np.frombuffer(mm, dtype="<u4", count=cap, offset=ln)
        self.keys = np.frombuffer(mm, dtype="u1", count=cap * kb, offset=ks).reshape(cap, kb)
        self.matrix = np.frombuffer(mm, dtype="<f4", count=cap * self.dims,
                                    offset=mx).reshape(cap, self.dims)
        self._tlock = threading.Lock()

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, np: Any, namespace: str, index_id: str, dims: int, capacity: int,
             key_bytes: int, permissions: int = 0o600, directory: str = SHM_DIR) -> VectorFile:
        """The index file (made when missing, of ``capacity`` rows; an existing one keeps
        its own capacity). Raises SegmentError for a file another user owns or could read,
        one of other dimensions, or no room in ``directory``."""
        path = vector_path(namespace, index_id, directory)
        key_bytes = _align(key_bytes, 8)
        for _ in range(3):
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                cls._create(np, path, dims, capacity, key_bytes, permissions)
                continue
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise SegmentError(f"{path} is a symbolic link; remove it (KVCOMM never "
                                       "makes one)") from None
                raise SegmentError(f"cannot open the vector index {path}: {exc.strerror}") from None
            try:
                st = os.fstat(fd)
                check_owner(path, st, permissions)
                if st.st_size < _HDR:
                    raise SegmentError(f"{path} is not a KVCOMM vector index (too short); "
                                       f"remove it (rm {path})")
                mm = mmap.mmap(fd, st.st_size)
                vf = cls(path, fd, mm, np)
                if int(vf.hdr[H_MAGIC]) != MAGIC or int(vf.hdr[H_LAYOUT]) != LAYOUT \
                        or _geometry(vf.dims, vf.capacity, vf.key_bytes)[-1] > st.st_size:
                    raise SegmentError(f"{path} is not a KVCOMM vector index of this version; "
                                       f"remove it (rm {path}) or purge the namespace")
                if vf.dims != dims or vf.key_bytes < key_bytes:
                    raise SegmentError(
                        f"the vector index {path} holds {vf.dims}-dimension vectors of keys up "
                        f"to {vf.key_bytes} bytes; this store needs {dims} and {key_bytes}. "
                        "Use another root for another embedding model, or purge the namespace")
                return vf
            except BaseException:
                os.close(fd)
                raise
        raise SegmentError(f"cannot open the vector index {path}: it keeps disappearing")

    @staticmethod
    def _create(np: Any, path: str, dims: int, capacity: int, key_bytes: int,
                permissions: int) -> None:
        size = _geometry(dims, capacity, key_bytes)[-1]
        remove_dead_temps(path)
        try:
            tmp, fd = create_temp(path, permissions)
        except OSError as exc:
            raise SegmentError(f"cannot create the vector index {path}: {exc.strerror}") from None
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise SegmentError(f"cannot reserve {size} bytes for the vector index {path}: "
                                   f"{exc.strerror}; lower the store's index capacity or free "
                                   f"space in {os.path.dirname(path)}") from None
            with mmap.mmap(fd, _HDR) as mm:
                hdr = np.frombuffer(mm, dtype="<u8", count=_HDR // 8)
                hdr[H_DIMS], hdr[H_CAP], hdr[H_KEYB] = dims, capacity, key_bytes
                hdr[H_LAYOUT] = LAYOUT
                hdr[H_MAGIC] = MAGIC
                del hdr
            try:
                os.link(tmp, path)  # (never over another creator's file)
            except FileExistsError:
                pass
        finally:
            os.close(fd)
            _unlink_quietly(tmp)

    def close(self) -> None:
        for name in ("hdr", "intent", "stamps", "hashes", "lens", "keys", "matrix"):
            setattr(self, name, None)
        try:
            self._mm.close()
        except BufferError:
            pass  # (a search still holds a view: the mapping goes with it)
        os.close(self._fd)

    # ------------------------------------------------------------------ writers
    @contextmanager
    def lock(self, repair: Callable[[bytes], None]) -> Iterator[None]:
        """Hold the writers' lock; first, an intent a dead writer left is repaired:
        ``repair(key)`` rebuilds that key's rows from its record."""
        with self._tlock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                n = int(self.hdr[H_INTENT])
                if n:
                    repair(self.intent[:n].tobytes())
                    self.hdr[H_INTENT] = 0
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def begin(self, key: bytes) -> None:
        """Name ``key`` as the item being changed (under the lock)."""
        self.intent[:len(key)] = memoryview(key)
        self.hdr[H_INTENT] = len(key)

    def end(self) -> None:
        self.hdr[H_INTENT] = 0

    def rows_of(self, key: bytes) -> Any:
        high = int(self.hdr[H_HIGH])
        h = xxh3_64_intdigest(key)
        rows = self._np.flatnonzero((self.hashes[:high] == h) & (self.stamps[:high] != 0))
        return [int(r) for r in rows if self.key_at(int(r)) == key]

    def key_at(self, row: int) -> bytes:
        return self.keys[row, :int(self.lens[row])].tobytes()

    def room_for(self, key: bytes, n: int) -> bool:
        """Whether ``n`` vectors of ``key`` fit (its current rows freed first)."""
        high = int(self.hdr[H_HIGH])
        free = self.capacity - high + int(self._np.count_nonzero(self.stamps[:high] == 0))
        return n <= free + len(self.rows_of(key))

    def set_rows(self, key: bytes, stamp: int, vectors: Any) -> bool:
        """Replace ``key``'s rows by ``vectors`` (unit float32 rows) tagged ``stamp`` (under
        the lock). False (and the index marked overflowed, its rows of ``key`` gone) when
        they do not fit."""
        np = self._np
        for r in self.rows_of(key):
            self.stamps[r] = 0
        if vectors is None or len(vectors) == 0:
            return True
        if not self.room_for(key, len(vectors)):
            self.hdr[H_OVERFLOW] = 1
            return False
        high = int(self.hdr[H_HIGH])
        free = [int(r) for r in np.flatnonzero(self.stamps[:high] == 0)[:len(vectors)]]
        while len(free) < len(vectors):
            free.append(high)
            high += 1
        h = xxh3_64_intdigest(key)
        for r, v in zip(free, vectors, strict=True):
            self.hashes[r] = h
            self.lens[r] = len(key)
            self.keys[r, :len(key)] = memoryview(key)
            self.matrix[r] = v
        self.hdr[H_HIGH] = max(high, int(self.hdr[H_HIGH]))
        for r in free:
            self.stamps[r] = stamp
        return True

    # ------------------------------------------------------------------ readers
    @property
    def overflow(self) -> bool:
        return bool(self.hdr[H_OVERFLOW])

    def scores(self, q: Any) -> tuple[Any, Any]:
        """``(scores, stamps)`` of rows ``[0, high)``: the matrix times the unit vector
        ``q``, free rows at -inf; the stamps as read (copied) before the product."""
        np = self._np
        high = int(self.hdr[H_HIGH])
        stamps = self.stamps[:high].copy()
        s = self.matrix[:high] @ q
        s[stamps == 0] = -np.inf
        return s, stamps
