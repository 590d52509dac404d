"""L2: one shared-memory segment per namespace per host, mapped by every agent process.

Theory of operation
-------------------
The segment is a file in ``/dev/shm`` (owner-only by default), laid out as::

    header (4 KiB) | slots | block meta | data (buddy heap) | change feed | pins | deferred

* **Slots** form an open-addressing hash table (linear probing, at most ``MAX_PROBE``
  slots from a key's home). A slot is five words: ``seq, hash, off, access, flags``.
  ``off`` points at an immutable record block (``EMPTY``/``TOMB`` otherwise).
* **Records are copy-on-write.** A writer builds the new record in a fresh block, then
  publishes it by bumping the slot's ``seq`` to odd, storing ``off``, and bumping ``seq``
  back to even; only then is the old block freed. So a slot changes in a few word stores
  and a reader never waits on a value copy (FACTS.md: rewriting a slot in place starves
  readers).
* **Readers take no lock.** They read ``seq`` (retry while odd), ``off``, copy what they
  need from the block, and re-read ``seq``: unchanged means the copy is exactly the
  record that was published, because a block is freed only after its slot's ``seq`` moved.
* **Writers take one lock**, a compare-and-set word holding the owner's pid (atomics from
  the tiny C helper ``kvcomm._atomic``). A writer sets ``busy`` while it mutates. A waiter
  that finds the owner dead (or a zombie) steals the lock; a holder that finds ``busy``
  set knows the previous one died mid-operation and runs :meth:`L2Segment._recover`,
  which makes every slot's ``seq`` even and rebuilds the heap's free lists from the
  blocks the slots reference. A SIGKILL at any instruction therefore loses at most the
  write in flight, and the others carry on within milliseconds.
* **Zero-copy views** pin their block: under the lock the reader records ``(block, pid)``
  in the pin table and bumps the block's pin count. A writer that replaces a pinned block
  parks it in the deferred table instead of freeing it; the view's finalizer marks its
  pin released, and the next writer's sweep frees the block. Pins of dead processes are
  swept too, so space comes back when the holder dies.
* **Change feed**: a ring of fixed-size events (``put``/``delete``/``resync``) appended
  under the lock. Watchers poll it with their own cursor; a watcher that falls a whole
  ring behind sees that its events were overwritten and reports ``overflow``.

Memory ordering: stores and loads through ``memoryview.cast("Q")`` are single aligned
8-byte moves, which x86-64 keeps in program order (TSO); the one store→load pattern
that needs a full barrier (publish vs. pin) uses the C helper's sequentially consistent
atomics, and pins are taken under the writer lock anyway. ``tests/test_l2_concurrency.py``
checks the race with self-checksummed values. On other architectures this module refuses
to run rather than risk torn reads.
"""

from __future__ import annotations

import mmap
import os
import platform
import re
import stat
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import xxhash

from .._atomic import Atomics
from ..core.versions import hlc_tick
from ..errors import KVCommError, SegmentError, Unavailable, ValueTooLarge

MAGIC = int.from_bytes(b"KVCOMM\x00\x02", "little")
LAYOUT_VERSION = 1
SHM_DIR = "/dev/shm"
HEADER_SIZE = 4096
MIN_ORDER = 6  # 64-byte blocks
MAX_PROBE = 32
SLOT_WORDS = 5
REC_HEADER = 64
EMPTY = 0
TOMB = 1
FLAG_DIRTY = 1

KIND_PUT = 1
KIND_DELETE = 2
KIND_RESYNC = 3

# Header words (index into the segment's uint64 view).
H_MAGIC, H_LAYOUT, H_TOTAL, H_NSLOTS, H_SLOTS_OFF, H_META_OFF = 0, 1, 2, 3, 4, 5
H_DATA_OFF, H_DATA_SIZE, H_TOP_ORDER, H_FEED_OFF, H_FEED_N, H_FEED_ESZ = 6, 7, 8, 9, 10, 11
H_PINS_OFF, H_NPINS, H_DEFER_OFF, H_MAX_KEY = 12, 13, 14, 15
H_LOCK, H_BUSY, H_WSEQ, H_HLC, H_FEED_HEAD, H_CLOCK, H_STATE, H_RELEASED = (
    16, 17, 18, 19, 20, 21, 22, 23,
)
H_ENTRIES, H_USED, H_EVICTIONS, H_RECOVERIES, H_DEFERRED, H_PIN_HWM = 24, 25, 26, 27, 28, 29
H_FREE = 40  # 64 words of free-list heads, one per block order
HOST_ID_AT = 1024  # 1 length byte + up to 64 bytes

# A record header (8 words) and a feed entry header (4 words). Packing them with one
# struct call is safe only because the block / entry is not yet published when written
# (struct stores are not atomic, see FACTS.md); reads unpack them and then re-check seq.
_REC = struct.Struct("<8Q")
_FEED = struct.Struct("<4Q")

STATE_OK = 0
STATE_PURGED = 1

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_LOCK_TIMEOUT = 10.0

if platform.machine().lower() not in ("x86_64", "amd64"):  # pragma: no cover
    raise ImportError(
        "kvcomm's L2 relies on x86-64 store ordering for its lock-free readers; "
        f"this machine is {platform.machine()}"
    )


def segment_path(name: str) -> str:
    """The file backing namespace ``name``. Raises SegmentError on a bad name."""
    if not _NAME_RE.match(name):
        raise SegmentError(
            f"namespace {name!r} is invalid: use 1-64 letters, digits, '.', '_' or '-'"
        )
    return os.path.join(SHM_DIR, f"kvcomm.{name}")


def key_hash(key_b: bytes) -> int:
    """Stable across processes and hosts (never Python's salted hash); never 0."""
    return xxhash.xxh3_64_intdigest(key_b) | 1


def _pid_alive(pid: int) -> bool:
    """True when ``pid`` runs and is not a zombie (a zombie cannot release anything)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    # the state letter follows the command name, which is in parentheses
    state = data[data.rfind(b")") + 2 : data.rfind(b")") + 3]
    return state not in (b"Z", b"X")


def _order_for(nbytes: int) -> int:
    return max(MIN_ORDER, (nbytes - 1).bit_length())


@dataclass(frozen=True, slots=True)
class Layout:
    """Sizes of one segment, derived from config on create and read from the header on attach."""

    total: int
    n_slots: int
    slots_off: int
    meta_off: int
    data_off: int
    data_size: int
    top_order: int
    feed_off: int
    feed_n: int
    feed_esz: int
    pins_off: int
    n_pins: int
    defer_off: int
    max_key: int

    @staticmethod
    def plan(l2_size: int, max_key: int, feed_n: int, n_pins: int, max_value: int) -> Layout:
        """Carve ``l2_size`` bytes. Raises SegmentError when it is too small to be useful."""
        n_slots = 1024
        while n_slots * 2048 < l2_size:
            n_slots *= 2
        feed_esz = (32 + max_key + 63) // 64 * 64
        feed_n = max(16, min(feed_n, l2_size // 8 // feed_esz))  # the feed takes <= 1/8
        n_pins = max(n_pins, 1)
        fixed = HEADER_SIZE + n_slots * SLOT_WORDS * 8 + feed_n * feed_esz + n_pins * 24
        remaining = l2_size - fixed
        # data + meta (1 byte per 64-byte unit) must fit in what is left
        data_budget = remaining * 64 // 65
        want_top = _order_for(max(max_value + REC_HEADER + 1024, 1 << 24))
        top_order = min(want_top, max(MIN_ORDER, data_budget.bit_length() - 1))
        # smaller tiles waste less of the budget; keep >= 7/8 of it, blocks >= 1 MiB
        while top_order > 20 and (data_budget >> top_order << top_order) < data_budget * 7 // 8:
            top_order -= 1
        if data_budget < (1 << 16):
            raise SegmentError(
                f"cache.l2_size={l2_size} leaves no room for data; use at least 2MB"
            )
        data_size = data_budget >> top_order << top_order
        slots_off = HEADER_SIZE
        meta_off = slots_off + n_slots * SLOT_WORDS * 8
        data_off = (meta_off + (data_size >> MIN_ORDER) + 4095) // 4096 * 4096
        feed_off = data_off + data_size
        pins_off = feed_off + feed_n * feed_esz
        defer_off = pins_off + n_pins * 16
        total = (defer_off + n_pins * 8 + 4095) // 4096 * 4096
        return Layout(total, n_slots, slots_off, meta_off, data_off, data_size, top_order,
                      feed_off, feed_n, feed_esz, pins_off, n_pins, defer_off, max_key)

    def header_words(self) -> dict[int, int]:
        return {
            H_TOTAL: self.total, H_NSLOTS: self.n_slots, H_SLOTS_OFF: self.slots_off,
            H_META_OFF: self.meta_off, H_DATA_OFF: self.data_off, H_DATA_SIZE: self.data_size,
            H_TOP_ORDER: self.top_order, H_FEED_OFF: self.feed_off, H_FEED_N: self.feed_n,
            H_FEED_ESZ: self.feed_esz, H_PINS_OFF: self.pins_off, H_NPINS: self.n_pins,
            H_DEFER_OFF: self.defer_off, H_MAX_KEY: self.max_key,
        }

    @staticmethod
    def from_header(q: memoryview, file_size: int) -> Layout:
        lay = Layout(q[H_TOTAL], q[H_NSLOTS], q[H_SLOTS_OFF], q[H_META_OFF], q[H_DATA_OFF],
                     q[H_DATA_SIZE], q[H_TOP_ORDER], q[H_FEED_OFF], q[H_FEED_N], q[H_FEED_ESZ],
                     q[H_PINS_OFF], q[H_NPINS], q[H_DEFER_OFF], q[H_MAX_KEY])
        ok = (
            lay.total == file_size
            and lay.n_slots > 0 and lay.n_slots & (lay.n_slots - 1) == 0
            and lay.slots_off == HEADER_SIZE
            and lay.meta_off == lay.slots_off + lay.n_slots * SLOT_WORDS * 8
            and lay.data_off % 4096 == 0 and lay.data_off >= lay.meta_off
            and MIN_ORDER <= lay.top_order < 48 and lay.data_size % (1 << lay.top_order) == 0
            and lay.feed_off == lay.data_off + lay.data_size
            and lay.pins_off == lay.feed_off + lay.feed_n * lay.feed_esz
            and lay.defer_off == lay.pins_off + lay.n_pins * 16
            and lay.defer_off + lay.n_pins * 8 <= lay.total
        )
        if not ok:
            raise SegmentError("L2 segment header is inconsistent (corrupt); purge the namespace")
        return lay


@dataclass(slots=True)
class Record:
    """A copy of one record, taken consistently by a lock-free read."""

    word: int  # index of the slot's seq word, for L1 revalidation
    seq: int
    tag: int
    meta: bytes
    value: bytes | None
    counter: int
    hlc: int
    vvx: bytes
    size: int


@dataclass(slots=True)
class FeedEvent:
    seq: int
    kind: int
    key: str
    counter: int
    hlc: int


class L2Segment:
    """One mapped L2 segment. Thread-safe; one instance per process per namespace.

    Public methods raise SegmentError (unusable segment), ValueTooLarge (record can never
    fit) or Unavailable (full of pinned/unflushed data, lock held too long). None of them
    leaves the segment in a state another process cannot use.
    """

    def __init__(self, name: str, *, create_layout: Layout | None, host_id: str,
                 permissions: int = 0o600) -> None:
        self.name = name
        self.path = segment_path(name)
        self._pid = os.getpid()
        self._tlock = threading.Lock()
        self._next_dead_sweep = 0.0
        fd, created = self._open_file(create_layout, permissions)
        try:
            size = os.fstat(fd).st_size
            if created:
                assert create_layout is not None
                os.ftruncate(fd, create_layout.total)
                size = create_layout.total
            if size < HEADER_SIZE:
                size = self._wait_for_size(fd)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._buf = memoryview(self._mm)
        self._q = self._buf.cast("Q")
        self._ro = self._buf.toreadonly()
        self._atom = Atomics(self._mm)
        if created:
            assert create_layout is not None
            self._initialise(create_layout, host_id)
        else:
            self._wait_for_magic()
        self.layout = Layout.from_header(self._q, size)
        self._bind_layout()
        hb = bytes(self._buf[HOST_ID_AT + 1 : HOST_ID_AT + 1 + self._buf[HOST_ID_AT]])
        self.host_id = hb.decode("utf-8", "replace")
        self.created = created
        _LIVE.add(self)

    # ---------------------------------------------------------------- opening

    def _open_file(self, layout: Layout | None, permissions: int) -> tuple[int, bool]:
        flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0)
        if layout is not None:
            try:
                old = os.umask(0)
                try:
                    fd = os.open(self.path, flags | os.O_CREAT | os.O_EXCL, permissions)
                finally:
                    os.umask(old)
                return fd, True
            except FileExistsError:
                pass
        try:
            fd = os.open(self.path, flags)
        except FileNotFoundError:
            raise SegmentError(f"no L2 segment for namespace {self.name!r}") from None
        except OSError as exc:
            raise SegmentError(f"cannot open {self.path}: {exc.strerror}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise SegmentError(f"{self.path} is not a regular file; remove it")
        return fd, False

    def _wait_for_size(self, fd: int) -> int:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            size = os.fstat(fd).st_size
            if size >= HEADER_SIZE:
                return size
            time.sleep(0.001)
        raise SegmentError(
            f"{self.path} was never sized by its creator; run `kvcomm purge --name {self.name}`"
        )

    def _wait_for_magic(self) -> None:
        deadline = time.monotonic() + 2.0
        q = self._q
        while q[H_MAGIC] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        if q[H_MAGIC] == 0:
            self.close()
            raise SegmentError(
                f"{self.path} was never initialised (its creator died?); "
                f"run `kvcomm purge --name {self.name}`"
            )
        if q[H_MAGIC] != MAGIC:
            self.close()
            raise SegmentError(f"{self.path} is not a KVCOMM segment (foreign file); not touching it")
        if q[H_LAYOUT] != LAYOUT_VERSION:
            found = q[H_LAYOUT]
            self.close()
            raise SegmentError(
                f"{self.path} has layout version {found}, this kvcomm uses {LAYOUT_VERSION}; "
                f"stop its users and run `kvcomm purge --name {self.name}`"
            )

    def _initialise(self, lay: Layout, host_id: str) -> None:
        q = self._q
        q[H_LAYOUT] = LAYOUT_VERSION
        for w, v in lay.header_words().items():
            q[w] = v
        hb = host_id.encode()[:64]
        self._buf[HOST_ID_AT] = len(hb)
        self._buf[HOST_ID_AT + 1 : HOST_ID_AT + 1 + len(hb)] = hb
        self.layout = lay
        self._bind_layout()
        # the whole data area is free: one block of top order per tile
        step = 1 << lay.top_order
        for off in range(lay.data_off, lay.data_off + lay.data_size, step):
            self._push_free(off, lay.top_order)
        self._atom.store(H_MAGIC * 8, MAGIC)  # last: attachers wait for it

    def _bind_layout(self) -> None:
        lay = self.layout
        self._mask = lay.n_slots - 1
        self._sbase = lay.slots_off // 8
        self._meta = self._buf[lay.meta_off : lay.meta_off + (lay.data_size >> MIN_ORDER)]
        self._max_record = 1 << lay.top_order
        self._data_off = lay.data_off
        self._top = lay.top_order
        self._feed_off = lay.feed_off
        self._feed_n = lay.feed_n
        self._feed_esz = lay.feed_esz

    # ---------------------------------------------------------------- lock

    def _acquire(self) -> None:
        self._tlock.acquire()
        try:
            if not self._atom.cas(H_LOCK * 8, 0, self._pid):
                self._acquire_slow()
            q = self._q
            if q[H_STATE] != STATE_OK:
                self._atom.store(H_LOCK * 8, 0)
                raise SegmentError(f"namespace {self.name!r} was purged; open it again")
            if q[H_BUSY]:
                self._recover()
            q[H_BUSY] = 1
        except BaseException:
            self._tlock.release()
            raise

    def _release(self) -> None:
        self._q[H_BUSY] = 0
        self._atom.store(H_LOCK * 8, 0)
        self._tlock.release()

    def _acquire_slow(self) -> None:
        atom = self._atom
        start = time.monotonic()
        next_check = start + 0.002
        spins = 0
        while True:
            spins += 1
            if atom.cas(H_LOCK * 8, 0, self._pid):
                return
            if spins < 64:
                continue
            now = time.monotonic()
            if now >= next_check:
                owner = atom.load(H_LOCK * 8)
                if owner and not _pid_alive(owner) and atom.cas(H_LOCK * 8, owner, self._pid):
                    return  # stolen from a dead owner; busy (if set) triggers recovery
                if now - start > _LOCK_TIMEOUT:
                    raise Unavailable(
                        f"L2 writer lock of {self.name!r} held by pid {owner} for over "
                        f"{_LOCK_TIMEOUT:.0f}s; is that process stopped?"
                    )
                next_check = now + 0.005
            if spins < 2000:
                os.sched_yield()
            else:
                time.sleep(0.0001)

    # ---------------------------------------------------------------- heap

    def _push_free(self, off: int, order: int) -> None:
        q = self._q
        head = q[H_FREE + order]
        bi = off >> 3
        q[bi + 1] = head
        q[bi + 2] = 0
        if head:
            q[(head >> 3) + 2] = off
        q[H_FREE + order] = off
        self._meta[(off - self._data_off) >> MIN_ORDER] = 0x80 | (order - MIN_ORDER + 1)

    def _unlink_free(self, off: int, order: int) -> None:
        q = self._q
        bi = off >> 3
        nxt = q[bi + 1]
        prv = q[bi + 2]
        if prv:
            q[(prv >> 3) + 1] = nxt
        else:
            q[H_FREE + order] = nxt
        if nxt:
            q[(nxt >> 3) + 2] = prv
        self._meta[(off - self._data_off) >> MIN_ORDER] = 0

    def _alloc(self, order: int) -> int:
        """A block of 2**order bytes, or 0 when none is free."""
        q = self._q
        off = q[H_FREE + order]
        if off:  # the common case: a block of exactly this order is free
            nxt = q[(off >> 3) + 1]
            q[H_FREE + order] = nxt
            if nxt:
                q[(nxt >> 3) + 2] = 0
        else:
            top = self._top
            j = order + 1
            while j <= top and q[H_FREE + j] == 0:
                j += 1
            if j > top:
                return 0
            off = q[H_FREE + j]
            self._unlink_free(off, j)
            while j > order:
                j -= 1
                self._push_free(off + (1 << j), j)
        self._meta[(off - self._data_off) >> MIN_ORDER] = order - MIN_ORDER + 1
        q[H_USED] += 1 << order
        return off

    def _free(self, off: int) -> None:
        meta = self._meta
        base = self._data_off
        top = self._top
        order = (meta[(off - base) >> MIN_ORDER] & 0x7F) + MIN_ORDER - 1
        self._q[H_USED] -= 1 << order
        while order < top:
            buddy = ((off - base) ^ (1 << order)) + base
            if meta[(buddy - base) >> MIN_ORDER] != (0x80 | (order - MIN_ORDER + 1)):
                break
            self._unlink_free(buddy, order)
            meta[(max(off, buddy) - base) >> MIN_ORDER] = 0
            off = min(off, buddy)
            order += 1
        self._push_free(off, order)

    def _release_block(self, off: int) -> None:
        """Free a block no slot references any more, or park it while views pin it."""
        q = self._q
        if q[(off >> 3) + 6] == 0:
            self._free(off)
            return
        self._defer(off)

    def _defer(self, off: int) -> None:
        q = self._q
        d0 = self.layout.defer_off >> 3
        for i in range(self.layout.n_pins):
            if q[d0 + i] == 0:
                q[d0 + i] = off
                q[H_DEFERRED] += 1
                return
        raise SegmentError("deferred table overflow (corrupt pin counts); purge the namespace")

    # ---------------------------------------------------------------- reads (lock-free)

    def read(self, key_b: bytes, h: int, zero_copy: int = 1 << 62) -> Record | None:
        """A consistent copy of the record for ``key_b``, or None when absent.

        An array value of ``zero_copy`` bytes or more is not copied: ``value`` is None and
        the caller takes a view with :meth:`pin`.
        """
        q = self._q
        mm = self._mm
        unpack = _REC.unpack_from
        mask = self._mask
        sbase = self._sbase
        i = h & mask
        for _ in range(MAX_PROBE):
            w = sbase + i * SLOT_WORDS
            spins = 0
            while True:
                s = q[w]
                if s & 1:
                    spins += 1
                    self._wait_odd(spins)
                    continue
                off = q[w + 2]
                if off == EMPTY:
                    return None
                if off == TOMB or q[w + 1] != h:
                    break
                rlen, counter, hlc, info, vlen, vrel, _, mlen = unpack(mm, off)
                klen = info & 0xFFFF
                p = off + REC_HEADER
                same_key = mm[p : p + klen] == key_b
                tag = (info >> 16) & 0xFF
                if not same_key or vlen > rlen:
                    value: bytes | None = b""
                elif tag == 4 and vlen >= zero_copy:
                    value = None
                else:
                    value = mm[off + vrel : off + vrel + vlen]
                vvlen = info >> 24
                if vvlen or mlen:
                    p += klen
                    vvx = mm[p : p + vvlen]
                    meta = mm[p + vvlen : p + vvlen + mlen]
                else:
                    vvx = meta = b""
                if q[w] != s:
                    continue  # changed under us: retry this slot
                if not same_key:
                    break
                if rlen > self._max_record or (value is not None and len(value) != vlen):
                    raise SegmentError(f"corrupt record in {self.name!r}; purge the namespace")
                if not q[w + 3]:
                    q[w + 3] = 1
                return Record(w, s, tag, meta, value, counter, hlc, vvx, rlen)
            i = (i + 1) & mask
        return None

    def seq_at(self, word: int) -> int:
        return self._q[word]  # type: ignore[no-any-return]

    def _wait_odd(self, spins: int) -> None:
        """A slot stays odd only while a writer publishes; if that writer died, recover."""
        if spins < 100:
            return
        if spins % 100 == 0:
            owner = self._atom.load(H_LOCK * 8)
            if owner == 0 or not _pid_alive(owner):
                self._acquire()  # runs recovery if the dead writer left busy set
                self._release()
                return
        if spins > 200:
            time.sleep(0.00005)

    # ---------------------------------------------------------------- writes (locked)

    def _find(self, key_b: bytes, h: int) -> tuple[int, int]:
        """Under the lock: (slot word of key or -1, first reusable slot word or -1)."""
        q = self._q
        mm = self._mm
        mask = self._mask
        sbase = self._sbase
        i = h & mask
        free = -1
        for _ in range(MAX_PROBE):
            w = sbase + i * SLOT_WORDS
            off = q[w + 2]
            if off == EMPTY:
                return -1, (w if free < 0 else free)
            if off == TOMB:
                if free < 0:
                    free = w
            elif q[w + 1] == h:
                p = off + REC_HEADER
                if mm[p : p + (q[(off >> 3) + 3] & 0xFFFF)] == key_b:
                    return w, free
            i = (i + 1) & mask
        return -1, free

    def fits(self, size: int) -> bool:
        return size <= self._max_record

    def write(self, key_b: bytes, h: int, tag: int, meta: bytes, value: bytes | memoryview,
              *, now_ms: int, expect: Callable[[Record | None], None] | None = None,
              dirty: bool = False) -> tuple[int, int, bytes, int, int]:
        """Store one record under the lock. Returns (counter, hlc, vvx, slot word, seq).

        ``expect`` is called with the current record (or None) before anything changes and
        may raise to abort. Raises ValueTooLarge / Unavailable; on any error nothing changed.
        """
        self._acquire()
        try:
            return self._write_locked(key_b, h, tag, meta, value, now_ms, expect, dirty)
        finally:
            self._release()

    def write_many(
        self, ops: list[tuple[Any, ...]], now_ms: int
    ) -> list[tuple[int, int, bytes, int, int] | bool]:
        """Apply puts ``(key_b, h, tag, meta, value)`` and deletes ``(key_b, h)`` under one lock."""
        out: list[tuple[int, int, bytes, int, int] | bool] = []
        self._acquire()
        try:
            for op in ops:
                if len(op) == 2:
                    out.append(self._delete_locked(op[0], op[1], now_ms, None))
                else:
                    out.append(self._write_locked(*op, now_ms, None, False))
        finally:
            self._release()
        return out

    def _write_locked(self, key_b: bytes, h: int, tag: int, meta: bytes,
                      value: bytes | memoryview, now_ms: int,
                      expect: Callable[[Record | None], None] | None,
                      dirty: bool) -> tuple[int, int, bytes, int, int]:
        q = self._q
        mm = self._mm
        if q[H_RELEASED] or q[H_DEFERRED]:
            self._sweep_released()
        w, free = self._find(key_b, h)
        old = q[w + 2] if w >= 0 else 0
        vvx = b""
        if old:
            info = q[(old >> 3) + 3]
            if info >> 24:  # the replaced write's vector entries of other hosts carry over
                p = old + REC_HEADER + (info & 0xFFFF)
                vvx = mm[p : p + (info >> 24)]
        if expect is not None:
            expect(self._record_locked(w) if w >= 0 else None)
        klen = len(key_b)
        vlen = len(value)
        vrel = REC_HEADER + klen + len(vvx) + len(meta)
        if tag == 4:  # arrays start 64-aligned so that views of them are aligned
            vrel = (vrel + 63) & ~63
        size = vrel + vlen
        if size > self._max_record:
            raise ValueTooLarge(
                f"record of {size} bytes can never fit in L2 of {self.name!r} (largest block "
                f"{self._max_record} bytes); raise cache.l2_size or store less"
            )
        order = (size - 1).bit_length()
        if order < MIN_ORDER:
            order = MIN_ORDER
        off = self._alloc(order) or self._alloc_evicting(order, protect=w)
        if w < 0:  # eviction may have moved where the first reusable slot is
            _, free = self._find(key_b, h)
            if free < 0:
                self._evict_in_window(h)
                _, free = self._find(key_b, h)
        # build the record in its fresh block, unpublished, so plain stores are fine
        counter = q[H_WSEQ] + 1
        q[H_WSEQ] = counter
        hlc = now_ms << 16
        last = q[H_HLC]
        if hlc <= last:
            hlc = last + 1
        q[H_HLC] = hlc
        _REC.pack_into(mm, off, size, counter, hlc, klen | (tag << 16) | (len(vvx) << 24),
                       vlen, vrel, 0, len(meta))
        p = off + REC_HEADER
        if vvx or meta:
            mm[p : p + klen + len(vvx) + len(meta)] = key_b + vvx + meta
        else:
            mm[p : p + klen] = key_b
        mm[off + vrel : off + size] = value
        # publish: seq odd, swap, seq even (the atomic add is the full barrier before pins)
        add = self._atom.add
        flags = FLAG_DIRTY if dirty else 0
        if w >= 0:
            add(w * 8, 1)
            q[w + 2] = off
            q[w + 4] = flags
            seq = add(w * 8, 1)
            q[w + 3] = 1
            if q[(old >> 3) + 6]:
                self._defer(old)
            else:
                self._free(old)
        else:
            w = free
            add(w * 8, 1)
            q[w + 1] = h
            q[w + 2] = off
            q[w + 4] = flags
            seq = add(w * 8, 1)
            q[w + 3] = 1
            q[H_ENTRIES] += 1
        self._feed_append(KIND_PUT, key_b, counter, hlc)
        return counter, hlc, vvx, w, seq

    def delete(self, key_b: bytes, h: int, *, now_ms: int,
               expect: Callable[[Record | None], None] | None = None) -> bool:
        """Remove ``key_b``; True when it existed. ``expect`` as for :meth:`write`."""
        self._acquire()
        try:
            return self._delete_locked(key_b, h, now_ms, expect)
        finally:
            self._release()

    def _delete_locked(self, key_b: bytes, h: int, now_ms: int,
                       expect: Callable[[Record | None], None] | None) -> bool:
        q = self._q
        w, _ = self._find(key_b, h)
        if expect is not None:
            expect(self._record_locked(w) if w >= 0 else None)
        if w < 0:
            return False
        counter = q[H_WSEQ] + 1
        q[H_WSEQ] = counter
        hlc = hlc_tick(q[H_HLC], now_ms)
        q[H_HLC] = hlc
        self._unlink_slot(w)
        self._feed_append(KIND_DELETE, key_b, counter, hlc)
        return True

    def _unlink_slot(self, w: int) -> None:
        q = self._q
        atom = self._atom
        old = q[w + 2]
        atom.add(w * 8, 1)
        q[w + 2] = TOMB
        q[w + 1] = 0
        atom.add(w * 8, 1)
        q[H_ENTRIES] -= 1
        self._release_block(old)
        # a tombstone followed by an empty slot ends every probe chain: turn trailing
        # tombstones back into empty slots so misses stay short
        nxt = self._sbase + (((w - self._sbase) // SLOT_WORDS + 1) & self._mask) * SLOT_WORDS
        if q[nxt + 2] != EMPTY:
            return
        while q[w + 2] == TOMB:
            atom.add(w * 8, 1)
            q[w + 2] = EMPTY
            atom.add(w * 8, 1)
            w = self._sbase + (((w - self._sbase) // SLOT_WORDS - 1) & self._mask) * SLOT_WORDS

    def _record_locked(self, w: int) -> Record:
        q = self._q
        off = q[w + 2]
        bi = off >> 3
        info = q[bi + 3]
        klen = info & 0xFFFF
        vvlen = (info >> 24) & 0xFFFFFFFF
        p = off + REC_HEADER + klen
        return Record(w, q[w], (info >> 16) & 0xFF, b"", b"", q[bi + 1], q[bi + 2],
                      self._buf[p : p + vvlen].tobytes(), q[bi])

    # ---------------------------------------------------------------- eviction

    def _evict_slot(self, w: int) -> None:
        q = self._q
        off = q[w + 2]
        klen = q[(off >> 3) + 3] & 0xFFFF
        key_b = self._buf[off + REC_HEADER : off + REC_HEADER + klen].tobytes()
        counter = q[H_WSEQ] + 1
        q[H_WSEQ] = counter
        self._unlink_slot(w)
        q[H_EVICTIONS] += 1
        self._feed_append(KIND_DELETE, key_b, counter, q[H_HLC])

    def _alloc_evicting(self, order: int, protect: int) -> int:
        """CLOCK over all slots: evict clean, unreferenced entries until ``order`` fits."""
        q = self._q
        self._sweep_pins(check_dead=True)
        off = self._alloc(order)
        if off:
            return off
        n = self.layout.n_slots
        hand = q[H_CLOCK] % n
        for _ in range(2 * n + 1):
            w = self._sbase + hand * SLOT_WORDS
            hand = (hand + 1) % n
            o = q[w + 2]
            if o <= TOMB or w == protect or q[w + 4] & FLAG_DIRTY:
                continue
            if q[w + 3]:
                q[w + 3] = 0
                continue
            self._evict_slot(w)
            off = self._alloc(order)
            if off:
                q[H_CLOCK] = hand
                return off
        q[H_CLOCK] = hand
        raise Unavailable(
            f"L2 of {self.name!r} is full: {q[H_DEFERRED]} blocks are pinned by zero-copy views "
            "and the rest cannot be evicted; release views or raise cache.l2_size"
        )

    def _evict_in_window(self, h: int) -> None:
        """All MAX_PROBE slots of a key's window are taken: evict one (CLOCK within it)."""
        q = self._q
        base = h & self._mask
        for rnd in range(2):
            for k in range(MAX_PROBE):
                w = self._sbase + ((base + k) & self._mask) * SLOT_WORDS
                if q[w + 4] & FLAG_DIRTY:
                    continue
                if q[w + 3] and rnd == 0:
                    q[w + 3] = 0
                    continue
                self._evict_slot(w)
                return
        raise Unavailable("L2 hash window is full of unflushed writes; retry after the daemon syncs")

    # ---------------------------------------------------------------- pins (zero-copy views)

    def pin(self, key_b: bytes, h: int) -> tuple[Record, int, int] | None:
        """Pin the block of ``key_b``. Returns (record, pin index, block offset) or None when
        absent; pin index -1 when the pin table is full (then the caller must copy)."""
        self._acquire()
        try:
            self._sweep_released()
            w, _ = self._find(key_b, h)
            if w < 0:
                return None
            q = self._q
            off = q[w + 2]
            bi = off >> 3
            rec = self._record_locked(w)
            p = off + REC_HEADER + (q[bi + 3] & 0xFFFF) + len(rec.vvx)
            rec.meta = self._buf[p : p + q[bi + 7]].tobytes()
            q[w + 3] = 1
            lay = self.layout
            p0 = lay.pins_off >> 3
            for i in range(lay.n_pins):
                if q[p0 + 2 * i] == 0:
                    q[p0 + 2 * i] = off
                    q[p0 + 2 * i + 1] = self._pid
                    q[bi + 6] += 1
                    if i >= q[H_PIN_HWM]:
                        q[H_PIN_HWM] = i + 1
                    return rec, i, off
            # pin table full: hand out a copy taken under the lock instead of a view
            vrel, vlen = q[bi + 5], q[bi + 4]
            rec.value = self._buf[off + vrel : off + vrel + vlen].tobytes()
            return rec, -1, off
        finally:
            self._release()

    def view(self, off: int, rec: Record) -> memoryview:
        bi = off >> 3
        vrel, vlen = self._q[bi + 5], self._q[bi + 4]
        return self._ro[off + vrel : off + vrel + vlen]

    def unpin(self, index: int) -> None:
        """Called from a view's finalizer in any thread: lock-free, the next writer sweeps."""
        if self._atom is None:
            return
        p = (self.layout.pins_off >> 3) + 2 * index + 1
        try:
            self._atom.store(p * 8, 0)
            self._atom.add(H_RELEASED * 8, 1)
        except ValueError:
            pass  # mapping already closed: the pin is swept as a dead process's pin

    def _sweep_released(self) -> None:
        """Cheap unless views were released; checks for dead holders at most once a second."""
        q = self._q
        if q[H_RELEASED]:
            self._sweep_pins(check_dead=False)
        elif q[H_DEFERRED]:
            now = time.monotonic()
            if now >= self._next_dead_sweep:
                self._next_dead_sweep = now + 1.0
                self._sweep_pins(check_dead=True)

    def _sweep_pins(self, check_dead: bool) -> None:
        """Under the lock: drop released pins (and those of dead processes); free what they held."""
        q = self._q
        atom = self._atom
        lay = self.layout
        released = atom.load(H_RELEASED * 8)
        if not released and not check_dead:
            return
        p0 = lay.pins_off >> 3
        alive: dict[int, bool] = {}
        for i in range(q[H_PIN_HWM]):
            off = q[p0 + 2 * i]
            if not off:
                continue
            pid = q[p0 + 2 * i + 1]
            if pid:
                if not check_dead:
                    continue
                if pid not in alive:
                    alive[pid] = _pid_alive(pid)
                if alive[pid]:
                    continue
            q[p0 + 2 * i + 1] = 0
            q[p0 + 2 * i] = 0
            q[(off >> 3) + 6] -= 1
        if released:
            atom.add(H_RELEASED * 8, -released)
        if q[H_DEFERRED]:
            d0 = lay.defer_off >> 3
            for i in range(lay.n_pins):
                off = q[d0 + i]
                if off and q[(off >> 3) + 6] == 0:
                    q[d0 + i] = 0
                    q[H_DEFERRED] -= 1
                    self._free(off)

    # ---------------------------------------------------------------- change feed

    def _feed_append(self, kind: int, key_b: bytes, counter: int, hlc: int) -> None:
        q = self._q
        head = q[H_FEED_HEAD]
        seq = head + 1
        e = self._feed_off + (head % self._feed_n) * self._feed_esz
        _FEED.pack_into(self._mm, e, 0, kind | (len(key_b) << 8), counter, hlc)
        self._mm[e + 32 : e + 32 + len(key_b)] = key_b
        self._atom.store(e, seq)
        self._atom.store(H_FEED_HEAD * 8, seq)

    def feed_head(self) -> int:
        return self._q[H_FEED_HEAD]  # type: ignore[no-any-return]

    def feed_read(self, cursor: int) -> tuple[list[FeedEvent], int, bool]:
        """Events after ``cursor``: (events, new cursor, overflowed). Lock-free."""
        q = self._q
        lay = self.layout
        head = q[H_FEED_HEAD]
        if head - cursor > lay.feed_n:
            return [], head, True
        out: list[FeedEvent] = []
        buf = self._buf
        for seq in range(cursor + 1, head + 1):
            e = lay.feed_off + ((seq - 1) % lay.feed_n) * lay.feed_esz
            ei = e >> 3
            if q[ei] != seq:
                return out, head, True
            info = q[ei + 1]
            klen = info >> 8
            key = bytes(buf[e + 32 : e + 32 + min(klen, lay.max_key)])
            counter, hlc = q[ei + 2], q[ei + 3]
            if q[ei] != seq:
                return out, head, True
            kind = info & 0xFF
            if kind == KIND_RESYNC:
                return out, seq, True
            out.append(FeedEvent(seq, kind, key.decode("utf-8", "replace"), counter, hlc))
        return out, head, False

    # ---------------------------------------------------------------- recovery

    def _recover(self) -> None:
        """Under the lock, after a writer died mid-operation: make every structure whole.

        Slots: odd seqs made even, references to implausible blocks dropped. Heap: free
        lists rebuilt from the blocks that slots and the deferred table reference. Pins:
        counts recomputed from the pin table. Watchers are told to resync.
        """
        q = self._q
        lay = self.layout
        base, end = lay.data_off, lay.data_off + lay.data_size
        live: dict[int, int] = {}  # block offset -> order
        entries = 0

        def plausible(off: int) -> int:
            if off < base or off >= end or (off - base) % 64:
                return 0
            size = q[off >> 3]
            if size < REC_HEADER or size > self._max_record:
                return 0
            order = _order_for(size)
            if (off - base) % (1 << order) or off + (1 << order) > end:
                return 0
            return order

        for i in range(lay.n_slots):
            w = self._sbase + i * SLOT_WORDS
            if q[w] & 1:
                q[w] += 1
            off = q[w + 2]
            if off <= TOMB:
                continue
            order = plausible(off)
            if not order or off in live:
                q[w] += 1
                q[w + 2] = TOMB
                q[w] += 1
                continue
            live[off] = order
            entries += 1
        # pins: keep those of live processes, recount per block
        p0 = lay.pins_off >> 3
        counts: dict[int, int] = {}
        q[H_PIN_HWM] = lay.n_pins
        for i in range(lay.n_pins):
            off, pid = q[p0 + 2 * i], q[p0 + 2 * i + 1]
            if off and pid and _pid_alive(pid):
                counts[off] = counts.get(off, 0) + 1
            else:
                q[p0 + 2 * i] = q[p0 + 2 * i + 1] = 0
        q[H_RELEASED] = 0
        d0 = lay.defer_off >> 3
        deferred = 0
        for i in range(lay.n_pins):
            off = q[d0 + i]
            order = plausible(off) if off else 0
            if off and order and off not in live and counts.get(off):
                live[off] = order
                deferred += 1
            else:
                q[d0 + i] = 0
        for off in live:
            q[(off >> 3) + 6] = counts.get(off, 0)
        # heap: everything not live is free, in maximal aligned blocks
        self._meta[:] = bytes(len(self._meta))
        for k in range(64):
            q[H_FREE + k] = 0
        used = 0
        pos = base
        for off in sorted(live) + [end]:
            if off < pos:  # overlaps the previous live block: corrupt, drop it
                continue
            while pos < off:
                order = min(((pos - base) & -(pos - base)).bit_length() - 1 if pos > base
                             else lay.top_order, lay.top_order, (off - pos).bit_length() - 1)
                self._push_free(pos, order)
                pos += 1 << order
            if off == end:
                break
            order = live[off]
            self._meta[(off - base) >> MIN_ORDER] = order - MIN_ORDER + 1
            used += 1 << order
            pos = off + (1 << order)
        q[H_USED] = used
        q[H_ENTRIES] = entries
        q[H_DEFERRED] = deferred
        q[H_RECOVERIES] += 1
        self._feed_append(KIND_RESYNC, b"", q[H_WSEQ], q[H_HLC])

    def check(self) -> list[str]:
        """Under the lock, verify every invariant; returns the problems found (none: [])."""
        self._acquire()
        try:
            return self._check_locked()
        finally:
            self._release()

    def _check_locked(self) -> list[str]:
        q = self._q
        lay = self.layout
        base, end = lay.data_off, lay.data_off + lay.data_size
        problems: list[str] = []
        allocated: dict[int, int] = {}
        free: dict[int, int] = {}
        pos = base
        while pos < end:
            m = self._meta[(pos - base) >> MIN_ORDER]
            if m == 0:
                problems.append(f"heap walk hit a non-block at {pos}")
                break
            order = (m & 0x7F) + MIN_ORDER - 1
            (free if m & 0x80 else allocated)[pos] = order
            pos += 1 << order
        for order in range(MIN_ORDER, lay.top_order + 1):
            off, prev, seen = q[H_FREE + order], 0, 0
            while off:
                if free.get(off) != order:
                    problems.append(f"free list {order} holds {off}, not a free block of that order")
                    break
                if q[(off >> 3) + 2] != prev:
                    problems.append(f"free list {order} has a bad back link at {off}")
                prev, off, seen = off, q[(off >> 3) + 1], seen + 1
                if seen > len(free):
                    problems.append(f"free list {order} loops")
                    break
            if seen != sum(1 for o in free.values() if o == order):
                problems.append(f"free list {order} holds {seen} blocks, heap has a different count")
        referenced: set[int] = set()
        entries = 0
        for i in range(lay.n_slots):
            w = self._sbase + i * SLOT_WORDS
            if q[w] & 1:
                problems.append(f"slot {i} left odd")
            off = q[w + 2]
            if off > TOMB:
                entries += 1
                if off not in allocated:
                    problems.append(f"slot {i} points at {off}, not an allocated block")
                if off in referenced:
                    problems.append(f"block {off} referenced twice")
                referenced.add(off)
        for i in range(lay.n_pins):
            off = q[(lay.defer_off >> 3) + i]
            if off:
                referenced.add(off)
        leaked = set(allocated) - referenced
        if leaked:
            problems.append(f"{len(leaked)} allocated blocks are referenced by nothing")
        if q[H_USED] != sum(1 << o for o in allocated.values()):
            problems.append("used-bytes counter disagrees with the heap")
        if q[H_ENTRIES] != entries:
            problems.append(f"entries counter {q[H_ENTRIES]} != {entries} live slots")
        return problems

    # ---------------------------------------------------------------- info & lifecycle

    def info(self) -> dict[str, Any]:
        q = self._q
        lay = self.layout
        return {
            "name": self.name,
            "path": self.path,
            "host_id": self.host_id,
            "size_bytes": lay.total,
            "data_bytes": lay.data_size,
            "used_bytes": q[H_USED],
            "entries": q[H_ENTRIES],
            "slots": lay.n_slots,
            "evictions": q[H_EVICTIONS],
            "recoveries": q[H_RECOVERIES],
            "pinned_deferred_blocks": q[H_DEFERRED],
            "writes": q[H_WSEQ],
            "feed_events": q[H_FEED_HEAD],
            "feed_capacity": lay.feed_n,
            "max_record_bytes": self._max_record,
        }

    def keys(self) -> Iterator[str]:
        """Every key present now (a lock-free scan; concurrent writes may or may not show)."""
        q = self._q
        for i in range(self.layout.n_slots):
            w = self._sbase + i * SLOT_WORDS
            s = q[w]
            off = q[w + 2]
            if s & 1 or off <= TOMB:
                continue
            klen = q[(off >> 3) + 3] & 0xFFFF
            kb = self._buf[off + REC_HEADER : off + REC_HEADER + klen].tobytes()
            if q[w] == s:
                yield kb.decode("utf-8", "replace")

    def mark_purged(self) -> None:
        self._acquire()
        try:
            self._q[H_STATE] = STATE_PURGED
        finally:
            self._release()

    def close(self) -> None:
        """Drop this process's mapping. Views still alive keep it mapped until they go."""
        _LIVE.discard(self)
        atom = getattr(self, "_atom", None)
        if atom is not None:
            atom.release()
            self._atom = None  # type: ignore[assignment]
        for name in ("_meta", "_q", "_ro", "_buf"):
            mv = getattr(self, name, None)
            if mv is not None:
                try:
                    mv.release()
                except BufferError:
                    pass
        try:
            self._mm.close()
        except BufferError:
            pass  # zero-copy views still reference it; unmapped when they are gone

    def _after_fork(self) -> None:
        self._pid = os.getpid()
        self._tlock = threading.Lock()


_LIVE: weakref.WeakSet[L2Segment] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for seg in list(_LIVE):
        seg._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def open_segment(name: str, layout: Layout, host_id: str, permissions: int) -> L2Segment:
    """Attach to namespace ``name``, creating it with ``layout`` if it does not exist."""
    try:
        return L2Segment(name, create_layout=layout, host_id=host_id, permissions=permissions)
    except KVCommError:
        raise
    except OSError as exc:
        raise SegmentError(f"cannot map L2 segment {name!r}: {exc.strerror}") from None


def purge(name: str) -> bool:
    """Mark namespace ``name`` purged (live users get SegmentError) and remove its file."""
    path = segment_path(name)
    if not os.path.exists(path):
        return False
    try:
        seg = L2Segment(name, create_layout=None, host_id="")
        seg.mark_purged()
        seg.close()
    except SegmentError:
        pass  # foreign or broken: removing the file is all we can do
    os.unlink(path)
    return True
