"""A host's vector index: one float32 matrix per index in shared memory, every process mapping it.

File ``<cache.l2_dir>/kvcomm.<namespace>.vec.<index id>`` (16 hex digits), beside the L2
segment, of mode ``cache.l2_permissions``, made whole under a temporary name and linked
into place (:func:`kvcomm.tiers.shm.files.create_temp`), never resized; ``kvcomm purge``
removes it with the namespace. Layout (little-endian):

* a 256-byte header of 64-bit words: magic, layout, dims, capacity, key bytes, ``high``
  (rows ever used: a search reads rows ``[0, high)``), ``overflow`` (a put found no free
  row: the index no longer holds every vector), ``intent`` (the length of the key in the
  intent area, 0 when none); and at byte 128 (``MUTEX_AT``, layout 3) the writers' mutex;
* the intent area (key bytes): the key of the item whose record and rows a writer is
  changing;
* the row table: per row a 64-bit ``stamp`` (0: free), the key's 64-bit hash, its length,
  the next row of the same key (-1: none), and the key's bytes; the stack of free rows;
  and the table of keys (open addressing on the key's hash, linear probing, ``2 *
  capacity`` slots or more: a key's first row, -1 empty, -2 deleted), so that a writer
  finds an item's rows and a free row in O(1), whatever the index holds;
* the matrix: ``capacity`` rows of ``dims`` float32, each a unit vector (or zero).

The items' records are the truth; a row is a copy of one of an item's vectors, tagged
with the stamp the item's record carries, so that a reader can tell a current row from a
stale one. Writers serialize on the file's mutex (a process-shared robust pthread mutex,
``_l2core.mutex_lock``: two atomic instructions uncontended, where the flock it replaced
was two system calls, a twentieth of an indexed put; a holder that dies hands it to the
next taker) and a thread lock. A file of layout 2 (made by a version before the mutex)
is read and written as it is, its writers serializing on an ``flock`` of the file as
that version's do (the kernel releases a dead holder's), so that both versions' writers
exclude each other; a version before this one refuses a file of layout 3. A writer
names its item in the intent area, changes the record, then the item's rows (a row's
stamp is zeroed before it is rewritten and set last), then clears the intent. A writer
killed in between leaves the intent set; the next writer to take the lock rebuilds that
item's rows from its record (:meth:`VectorFile.update`'s ``repair``), after rebuilding
the free stack and the key table from the row table (what a killed writer may have left
half-changed; a row's stamp, set last, says whether the row is whole). Readers take no
lock: they read the matrix in one pass and check every row they keep against the item's
record.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

from xxhash import xxh3_64_intdigest

from .._l2core import mutex_forget, mutex_init, mutex_lock, mutex_release
from ..errors import SegmentError, WriteUnderLock
from .shm import segment as _segment  # noqa: F401 (the C kernel's errors are SegmentError once it is loaded)
from .shm.files import (
    SHM_DIR,
    _unlink_quietly,
    check_owner,
    create_temp,
    remove_dead_temps,
    vector_path,
    vector_paths_re,
)

MAGIC = int.from_bytes(b"KVCVEC01", "little")
LAYOUT = 3  # (what this version makes)
LAYOUT_FLOCK = 2  # (the layout before the mutex: read and written, under the flock)
_HDR = 256
(H_MAGIC, H_LAYOUT, H_DIMS, H_CAP, H_KEYB, H_HIGH, H_OVERFLOW, H_INTENT, H_NFREE, H_USED,
 H_TOMBS) = range(11)
MUTEX_AT = 128  # (the writers' mutex, layout 3: header bytes 128..191)
# s: the longest a writer waits for the file's mutex (holds take microseconds; a rebuild
# after a dead writer, about a second), then Unavailable: a holder that never lets go
# (stopped, or a copied file's lock word) is reported, not waited on forever
MUTEX_TIMEOUT = 30.0
_OPEN: weakref.WeakSet[VectorFile] = weakref.WeakSet()  # (this process's open files)


def _after_fork() -> None:
    """In a forked child: each open file's thread lock anew (another thread of the parent
    may have held it at the fork; that thread does not exist here)."""
    for vf in list(_OPEN):
        vf._tlock = threading.Lock()
    _HELD.__dict__.clear()  # (the forking thread's writes are not the child's)
    mutex_forget()


_HELD = threading.local()  # .files: the vector files (device, inode) this thread writes


def _held() -> set[tuple[int, int]]:
    """The vector files this thread is writing (VectorFile.update): a write into one of
    them from inside (a validator writing to a store on the same index, through any
    VectorFile of it) is refused, not left waiting on itself."""
    files: set[tuple[int, int]] | None = getattr(_HELD, "files", None)
    if files is None:
        files = _HELD.files = set()
    return files


os.register_at_fork(after_in_child=_after_fork)
_EMPTY, _TOMB = -1, -2


def remove_all(namespace: str, directory: str = SHM_DIR) -> None:
    """Remove namespace ``namespace``'s vector files (and dead builders' temporary ones)."""
    pattern = vector_paths_re(namespace)
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


def _table_size(capacity: int) -> int:
    return max(8, 1 << (2 * capacity - 1).bit_length())


def _geometry(dims: int, capacity: int, key_bytes: int) -> tuple[int, ...]:
    """Offsets of the intent area, stamps, hashes, lengths, next rows, free stack, key
    table, keys, matrix; and the size."""
    intent = _HDR
    stamps = _align(intent + key_bytes)
    hashes = stamps + 8 * capacity
    lens = hashes + 8 * capacity
    nxt = lens + 4 * capacity
    free = nxt + 4 * capacity
    slots = free + 4 * capacity
    keys = _align(slots + 4 * _table_size(capacity))
    matrix = _align(keys + key_bytes * capacity)
    return (intent, stamps, hashes, lens, nxt, free, slots, keys, matrix,
            matrix + 4 * dims * capacity)


class VectorFile:
    """A mapped vector file: :meth:`open` (creating it when missing)."""

    def __init__(self, path: str, fd: int, mm: mmap.mmap, np: Any) -> None:
        self.path, self._fd, self._mm, self._np = path, fd, mm, np
        hdr = np.frombuffer(mm, dtype="<u8", count=_HDR // 8)
        self.hdr = hdr
        self.dims, self.capacity, self.key_bytes = (int(hdr[H_DIMS]), int(hdr[H_CAP]),
                                                    int(hdr[H_KEYB]))
        it, st, ha, ln, nx, fr, sl, ks, mx, _size = _geometry(self.dims, self.capacity,
                                                              self.key_bytes)
        cap, kb = self.capacity, self.key_bytes
        self._tsize = _table_size(cap)
        self._rb = 4 * self.dims  # (a row's bytes)
        view = memoryview(mm)
        # (the writers' structures, walked item by item: memoryviews index faster than numpy)
        self._hq = view[:_HDR].cast("Q")
        self._st = view[st:st + 8 * cap].cast("Q")
        self._ha = view[ha:ha + 8 * cap].cast("Q")
        self._ln = view[ln:ln + 4 * cap].cast("I")
        self._nx = view[nx:nx + 4 * cap].cast("i")
        self._fr = view[fr:fr + 4 * cap].cast("i")
        self._sl = view[sl:sl + 4 * self._tsize].cast("i")
        self._slots_np = np.frombuffer(mm, dtype="<i4", count=self._tsize, offset=sl)
        self._ks, self._it, self._mx = ks, it, mx
        view.release()
        self.intent = np.frombuffer(mm, dtype="u1", count=kb, offset=it)
        self.stamps = np.frombuffer(mm, dtype="<u8", count=cap, offset=st)
        self.hashes = np.frombuffer(mm, dtype="<u8", count=cap, offset=ha)
        self.lens = np.frombuffer(mm, dtype="<u4", count=cap, offset=ln)
        self.keys = np.frombuffer(mm, dtype="u1", count=cap * kb, offset=ks).reshape(cap, kb)
        self.matrix = np.frombuffer(mm, dtype="<f4", count=cap * self.dims,
                                    offset=mx).reshape(cap, self.dims)
        self._tlock = threading.Lock()
        fst = os.fstat(fd)
        self._ident = (fst.st_dev, fst.st_ino)  # (the file, however many times it is mapped)
        self._closed = False
        _OPEN.add(self)  # (a forked child gets a fresh _tlock: _after_fork)
        # (a file an older version made has no mutex: its writers, this version's too,
        # serialize on an flock of the file)
        self._mutex = int(hdr[H_LAYOUT]) != LAYOUT_FLOCK

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
                if int(vf.hdr[H_MAGIC]) != MAGIC \
                        or int(vf.hdr[H_LAYOUT]) not in (LAYOUT, LAYOUT_FLOCK) \
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
                mutex_init(mm, MUTEX_AT)
                slots = _geometry(dims, capacity, key_bytes)[6]
                mm2 = mmap.mmap(fd, slots + 4 * _table_size(capacity))
                np.frombuffer(mm2, dtype="<i4", count=_table_size(capacity),
                              offset=slots)[:] = _EMPTY
                mm2.close()
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
        """Unmap and close the file (idempotent; later writes raise SegmentError)."""
        if self._ident in _held():
            raise WriteUnderLock("a vector index closed from inside a write of it (a "
                                 "validator closing the store's client?); close it after")
        with self._tlock:  # (no writer of this process holds the mutex of the mapping)
            if self._closed:
                return
            self._closed = True
            _OPEN.discard(self)
            for name in ("_hq", "_st", "_ha", "_ln", "_nx", "_fr", "_sl"):
                getattr(self, name).release()
            for name in ("hdr", "intent", "stamps", "hashes", "lens", "keys", "matrix",
                         "_slots_np"):
                setattr(self, name, None)
            try:
                self._mm.close()
            except BufferError:
                pass  # (a search still holds a view: the mapping goes with it)
            os.close(self._fd)

    # ------------------------------------------------------------------ writers
    def update(self, key: bytes, change: Callable[[], tuple[int, Any]],
               repair: Callable[[bytes], None]) -> bool:
        """Change the item ``key`` and its rows, as the module docstring says: under the
        writers' lock (first repairing what a dead writer left: the free stack and key
        table rebuilt from the rows, then ``repair(its key)``, which rebuilds that key's
        rows from its record with :meth:`set_rows`), name ``key`` in the intent area, run
        ``change()``, which writes the item's record and returns ``(stamp, rows)`` of its
        vectors now (``(0, None)``: none), set its rows (:meth:`set_rows`), clear the
        intent. Returns :meth:`set_rows`'s answer (False: the index overflowed). What
        ``change`` or ``repair`` raises is raised with the intent left set and the lock
        released: the next writer repairs. (One call, not a context manager and four
        calls: those were a tenth of an indexed put's time.) The writers' lock is the
        file's mutex (its holder dying hands it on: the intent it left says what to
        repair), or for a file of layout 2 an flock of it (released by the kernel when
        its holder dies). A write from inside another (a validator writing to the store)
        raises WriteUnderLock: it would wait on itself."""
        held = _held()
        if self._ident in held:
            raise WriteUnderLock("a write into a vector index from inside a write of it (a "
                                 "validator writing to the store?); validators may read, "
                                 "not write")
        with self._tlock:
            if self._closed:
                raise SegmentError("this vector index is closed (its store's client was "
                                   "closed); open the store again")
            hq, mm = self._hq, self._mm
            held.add(self._ident)
            try:  # (the lock taken inside: a KeyboardInterrupt just after leaves none held)
                if self._mutex:
                    mutex_lock(mm, MUTEX_AT, MUTEX_TIMEOUT)
                else:
                    fcntl.flock(self._fd, fcntl.LOCK_EX)
                n = hq[H_INTENT]
                if n:
                    self.rebuild()
                    repair(self.intent[:n].tobytes())
                    hq[H_INTENT] = 0
                n = len(key)
                mm[self._it:self._it + n] = key
                hq[H_INTENT] = n
                stamp, rows = change()
                fits = self.set_rows(key, stamp, rows if stamp else None)
                hq[H_INTENT] = 0
                return fits
            finally:
                held.discard(self._ident)
                if self._mutex:
                    mutex_release(mm, MUTEX_AT)  # (only if this thread holds it)
                else:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)

    def intent_key(self) -> bytes | None:
        """The key a writer named (:meth:`update`), None when none (read without the lock:
        a key torn by a writer's next intent names no item)."""
        n = int(self._hq[H_INTENT])
        return bytes(self.intent[:n]) if 0 < n <= self.key_bytes else None

    def key_at(self, row: int) -> bytes:
        at = self._ks + row * self.key_bytes
        return self._mm[at:at + self._ln[row]]

    def _find(self, key: bytes, h: int) -> tuple[int, int, int]:
        """``(slot, first row, slot to insert at)`` of ``key`` (slot and row -1: absent)."""
        sl, ha, mask, mm, ks, kb = self._sl, self._ha, self._tsize - 1, self._mm, self._ks, \
            self.key_bytes
        i, tomb = h & mask, -1
        for _ in range(mask + 1):  # (a table with no empty slot: corrupt, see below)
            r = sl[i]
            if r == _EMPTY:
                return -1, -1, (i if tomb < 0 else tomb)
            if r == _TOMB:
                if tomb < 0:
                    tomb = i
            elif ha[r] == h and mm[ks + r * kb:ks + r * kb + self._ln[r]] == key:  # (key_at)
                return i, r, i
            i = (i + 1) & mask
        if tomb >= 0:  # (every slot taken or deleted: insert at the first deleted one)
            return -1, -1, tomb
        raise SegmentError(f"the vector index {self.path} is corrupt (its key table has no "
                           "empty slot); purge the namespace or remove the file")

    def rows_of(self, key: bytes) -> list[int]:
        r = self._find(key, xxh3_64_intdigest(key))[1]
        out = []
        while r >= 0:
            out.append(r)
            r = self._nx[r]
        return out

    def set_rows(self, key: bytes, stamp: int, vectors: Any) -> bool:
        """Replace ``key``'s rows by ``vectors`` (unit float32 rows: a C-ordered array's
        rows, or each row's little-endian bytes) tagged ``stamp`` (under the lock, ``key``
        named by :meth:`update`). False (and the index marked overflowed, its rows of
        ``key`` gone) when they do not fit."""
        h = xxh3_64_intdigest(key)
        n = 0 if vectors is None else len(vectors)
        hq, st, nx, fr, sl = self._hq, self._st, self._nx, self._fr, self._sl
        mm, rb = self._mm, self._rb
        # (_find's first probe inline: the key is most often in the slot of its hash)
        slot = h & (self._tsize - 1)
        r = sl[slot]
        if r >= 0 and self._ha[r] == h \
                and mm[self._ks + r * self.key_bytes:self._ks + r * self.key_bytes
                       + self._ln[r]] == key:  # (key_at)
            at = slot
        else:
            slot, r, at = self._find(key, h)
        if r >= 0 and n == 1 and nx[r] < 0:
            # (the common re-put: one row before and after, rewritten in place; what
            # freeing it and taking the top of the free stack, the same row, would do)
            st[r] = 0
            mm[self._mx + r * rb:self._mx + (r + 1) * rb] = vectors[0]
            st[r] = stamp
            return True
        while r >= 0:  # free the old rows
            st[r] = 0
            fr[hq[H_NFREE]] = r
            hq[H_NFREE] += 1
            r = nx[r]
        fits = n <= hq[H_NFREE] + self.capacity - hq[H_HIGH]
        if not fits:
            hq[H_OVERFLOW] = 1
        if n == 0 or not fits:
            if slot >= 0:
                sl[slot] = _TOMB
                hq[H_TOMBS] += 1
            return fits
        rows = []
        for _ in range(n):
            if hq[H_NFREE]:
                hq[H_NFREE] -= 1
                rows.append(fr[hq[H_NFREE]])
            else:
                rows.append(hq[H_HIGH])
                hq[H_HIGH] += 1
        ks, kb, mx = self._ks, self.key_bytes, self._mx
        for j, r in enumerate(rows):
            self._ha[r] = h
            self._ln[r] = len(key)
            mm[ks + r * kb:ks + r * kb + len(key)] = key
            mm[mx + r * rb:mx + (r + 1) * rb] = vectors[j]
            nx[r] = rows[j + 1] if j + 1 < n else -1
            st[r] = stamp
        if slot < 0:
            if sl[at] == _TOMB:
                hq[H_TOMBS] -= 1
            else:
                hq[H_USED] += 1
        sl[at] = rows[0]
        if 4 * hq[H_USED] > 3 * self._tsize or 4 * hq[H_TOMBS] > self._tsize:
            self.rebuild()
        return True

    def rebuild(self) -> None:
        """The free stack and the key table again from the rows (their stamps, keys and
        hashes): after a writer died, or when deleted slots pile up (under the lock)."""
        np, hq = self._np, self._hq
        high = int(hq[H_HIGH])
        stamps = self.stamps[:high]
        free = np.flatnonzero(stamps == 0).astype("<i4")
        np.frombuffer(self._fr, dtype="<i4")[:len(free)] = free
        hq[H_NFREE] = len(free)
        self._slots_np[:] = _EMPTY
        hq[H_USED] = hq[H_TOMBS] = 0
        heads: dict[bytes, int] = {}
        nx, sl, mask = self._nx, self._sl, self._tsize - 1
        for r in map(int, np.flatnonzero(stamps != 0)):
            key = self.key_at(r)
            nx[r] = heads.get(key, -1)
            heads[key] = r
        for r in heads.values():
            i = self._ha[r] & mask
            while sl[i] != _EMPTY:
                i = (i + 1) & mask
            sl[i] = r
        hq[H_USED] = len(heads)

    # ------------------------------------------------------------------ readers
    @property
    def overflow(self) -> bool:
        return bool(self.hdr[H_OVERFLOW])

    def scores(self, q: Any) -> tuple[Any, Any]:
        """``(scores, stamps)`` of rows ``[0, high)``: the matrix times the unit vector
        ``q``, free rows at -inf; the stamps as read (copied) before the product."""
        if self._closed:
            raise SegmentError("this vector index is closed (its store's client was closed); "
                               "open the store again")
        np = self._np
        high = int(self.hdr[H_HIGH])
        stamps = self.stamps[:high].copy()
        s = self.matrix[:high] @ q
        s[stamps == 0] = -np.inf
        return s, stamps
