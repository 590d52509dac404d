"""L2: one shared-memory segment per namespace per host, mapped by every agent process.

Theory of operation
-------------------
The segment is a file in ``/dev/shm`` (owner-only by default), laid out as::

    header (4 KiB) | slots | block meta | data (buddy heap) | change feed | pins | deferred
                   | hot keys (count-min sketch + top-k, 0.1% of the segment)

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
  the small C helper ``kvcomm._l2core``). A writer sets ``busy`` while it mutates. A waiter
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
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import xxhash

from .. import _l2core
from ..core.sketch import CountMinSketch, TopK
from ..errors import KVCommError, SegmentError, Unavailable, ValueTooLarge

_l2core.set_segment_error(SegmentError)

MAGIC = int.from_bytes(b"KVCOMM\x00\x02", "little")
LAYOUT_VERSION = 2
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
H_HOT_OFF, H_HOT_SIZE, H_SKETCH_WIDTH, H_TOPK = 30, 31, 32, 33
H_SYNC_CURSOR, H_DAEMON_PID, H_DAEMON_BEAT = 34, 35, 36  # the node daemon's state
H_FREE = 40  # 64 words of free-list heads, one per block order
HOST_ID_AT = 1024  # 1 length byte + up to 64 bytes

NEW_DOT = (1 << 64) - 1  # put(..., counter=NEW_DOT): a fresh local dot over a given vector
# Statuses of _l2core.Core.put when it changed nothing.
NEED_SPACE, NEED_SLOT, TOO_LARGE, CORRUPT = 1, 2, 3, 4

STATE_OK = 0
STATE_PURGED = 1

SKETCH_DEPTH = 4
HOT_TOPK = 64

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
    hot_off: int = 0
    sketch_width: int = 0
    topk: int = 0

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
        hot_off = (defer_off + n_pins * 8 + 63) // 64 * 64
        topk = HOT_TOPK
        hot_budget = max(l2_size // 1000, 32 << 10)  # the sketch's share: 0.1% (32 KiB floor)
        width = max(64, (hot_budget - TopK.size_for(topk, max_key) - 16) // (4 * SKETCH_DEPTH))
        hot_size = CountMinSketch.size_for(width, SKETCH_DEPTH) + TopK.size_for(topk, max_key)
        total = (hot_off + hot_size + 4095) // 4096 * 4096
        return Layout(total, n_slots, slots_off, meta_off, data_off, data_size, top_order,
                      feed_off, feed_n, feed_esz, pins_off, n_pins, defer_off, max_key,
                      hot_off, width, topk)

    def header_words(self) -> dict[int, int]:
        return {
            H_TOTAL: self.total, H_NSLOTS: self.n_slots, H_SLOTS_OFF: self.slots_off,
            H_META_OFF: self.meta_off, H_DATA_OFF: self.data_off, H_DATA_SIZE: self.data_size,
            H_TOP_ORDER: self.top_order, H_FEED_OFF: self.feed_off, H_FEED_N: self.feed_n,
            H_FEED_ESZ: self.feed_esz, H_PINS_OFF: self.pins_off, H_NPINS: self.n_pins,
            H_DEFER_OFF: self.defer_off, H_MAX_KEY: self.max_key, H_HOT_OFF: self.hot_off,
            H_SKETCH_WIDTH: self.sketch_width, H_TOPK: self.topk,
        }

    @staticmethod
    def from_header(q: memoryview, file_size: int) -> Layout:
        lay = Layout(q[H_TOTAL], q[H_NSLOTS], q[H_SLOTS_OFF], q[H_META_OFF], q[H_DATA_OFF],
                     q[H_DATA_SIZE], q[H_TOP_ORDER], q[H_FEED_OFF], q[H_FEED_N], q[H_FEED_ESZ],
                     q[H_PINS_OFF], q[H_NPINS], q[H_DEFER_OFF], q[H_MAX_KEY], q[H_HOT_OFF],
                     q[H_SKETCH_WIDTH], q[H_TOPK])
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
            and lay.hot_off >= lay.defer_off + lay.n_pins * 8
            and 64 <= lay.sketch_width < (1 << 28) and 1 <= lay.topk <= 4096
            and lay.hot_off + CountMinSketch.size_for(lay.sketch_width, SKETCH_DEPTH)
            + TopK.size_for(lay.topk, lay.max_key) <= lay.total
        )
        if not ok:
            raise SegmentError("L2 segment header is inconsistent (corrupt); purge the namespace")
        return lay


class Record(NamedTuple):
    """A copy of one record, taken consistently by a lock-free read."""

    word: int  # index of the slot's seq word, for L1 revalidation
    seq: int
    tag: int
    meta: bytes
    value: bytes | None  # None: a large array, to be pinned and viewed instead
    counter: int
    hlc: int
    vvx: bytes
    size: int


_new_record = tuple.__new__


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
                 permissions: int = 0o600, attach_timeout: float = 2.0) -> None:
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
                size = self._wait_for_size(fd, attach_timeout)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._buf = memoryview(self._mm)
        self._q = self._buf.cast("Q")
        self._ro = self._buf.toreadonly()
        if created:
            assert create_layout is not None
            self._initialise(create_layout, host_id)
        else:
            self._wait_for_magic(attach_timeout)
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

    def _wait_for_size(self, fd: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            size = os.fstat(fd).st_size
            if size >= HEADER_SIZE:
                return size
            if time.monotonic() >= deadline:
                break
            time.sleep(0.001)
        raise SegmentError(
            f"{self.path} was never sized by its creator; run `kvcomm purge --name {self.name}`"
        )

    def _wait_for_magic(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
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
            self._core.push_free(off, lay.top_order)
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
        sk = CountMinSketch.size_for(lay.sketch_width, SKETCH_DEPTH)
        self.sketch = CountMinSketch(lay.sketch_width, SKETCH_DEPTH,
                                     buffer=self._buf[lay.hot_off : lay.hot_off + sk])
        self.topk = TopK(lay.topk, lay.max_key,
                         buffer=self._buf[lay.hot_off + sk : lay.hot_off + sk
                                          + TopK.size_for(lay.topk, lay.max_key)])
        self._core = _l2core.Core(self._mm, lay.data_off, lay.data_size, lay.top_order,
                                  lay.slots_off, lay.n_slots, lay.meta_off, lay.feed_off,
                                  lay.feed_n, lay.feed_esz, lay.defer_off, lay.n_pins, lay.max_key)
        self._atom = self._core  # the same object gives the atomics on any header word

    # ---------------------------------------------------------------- lock

    def _acquire(self) -> None:
        self._tlock.acquire()
        try:
            status = self._core.try_lock(self._pid)
            if status:
                if status == 1:
                    self._acquire_slow()
                self._after_lock()
        except BaseException:
            self._tlock.release()
            raise

    def _after_lock(self) -> None:
        """Lock held, busy not yet set: refuse a purged segment, recover from a dead writer."""
        q = self._q
        if q[H_STATE] != STATE_OK:
            self._atom.store(H_LOCK * 8, 0)
            raise SegmentError(f"namespace {self.name!r} was purged; open it again")
        if q[H_BUSY]:
            try:
                self._recover()
            except BaseException:
                self._atom.store(H_LOCK * 8, 0)  # busy stays set: the next writer retries
                raise
        q[H_BUSY] = 1

    def _release(self) -> None:
        self._core.unlock()
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

    # ---------------------------------------------------------------- reads (lock-free)

    def read(self, key_b: bytes, h: int, zero_copy: int = 1 << 62) -> Record | None:
        """A consistent copy of the record for ``key_b``, or None when absent. Lock-free.

        An array value of ``zero_copy`` bytes or more is not copied: ``value`` is None and
        the caller takes a view with :meth:`pin`. Raises SegmentError on a corrupt record.
        """
        r = self._core.read(key_b, h, zero_copy)
        while isinstance(r, int):  # a slot stayed odd: its writer is slow, or died mid-publish
            self._help_stuck_writer()
            r = self._core.read(key_b, h, zero_copy)
        return None if r is None else _new_record(Record, r)

    def _help_stuck_writer(self) -> None:
        """If the lock owner is dead, take the lock (which recovers); else let it run."""
        owner = self._atom.load(H_LOCK * 8)
        if owner == 0 or not _pid_alive(owner):
            self._acquire()
            self._release()
        else:
            time.sleep(0.0001)

    # ---------------------------------------------------------------- writes (locked)

    def write(self, key_b: bytes, h: int, tag: int, meta: bytes, value: bytes | memoryview,
              *, now_ms: int, expect: Callable[[Record | None], None] | None = None,
              dirty: bool = False, version: tuple[int, int, bytes] | None = None,
              ) -> tuple[int, int, bytes, int, int]:
        """Store one record under the lock. Returns (counter, hlc, vvx, slot word, seq).

        ``expect`` is called with the current record (or None) before anything changes and
        may raise to abort. Raises ValueTooLarge / Unavailable; on any error nothing changed.
        """
        self._acquire()
        try:
            return self._write_locked(key_b, h, tag, meta, value, now_ms, expect, dirty, version)
        finally:
            self._release()

    def write_fast(self, key_b: bytes, h: int, tag: int, meta: bytes, value: bytes | memoryview,
                   now_ms: int, flags: int = 0) -> tuple[int, int, bytes, int, int]:
        """:meth:`write` without ``expect``: a single C call under the lock in the common case."""
        with self._tlock:
            core = self._core
            status = core.try_lock(self._pid)
            if status == 0:
                r = core.put(key_b, h, tag, meta, value, now_ms, flags)
                core.unlock()
                if isinstance(r, tuple):
                    return r
            elif status == 2:  # locked, but pins to sweep or a dead writer to recover from
                self._after_lock()
                try:
                    return self._write_locked(key_b, h, tag, meta, value, now_ms, None,
                                              bool(flags))
                finally:
                    core.unlock()
        # contended, or the put needs eviction first: the general path
        return self.write(key_b, h, tag, meta, value, now_ms=now_ms, dirty=bool(flags))

    def write_many(
        self, ops: list[tuple[Any, ...]], now_ms: int, dirty: bool = False
    ) -> list[tuple[int, int, bytes, int, int] | bool]:
        """Apply puts ``(key_b, h, tag, meta, value)`` and deletes ``(key_b, h)`` under one lock."""
        out: list[tuple[int, int, bytes, int, int] | bool] = []
        self._acquire()
        try:
            if self._q[H_RELEASED] or self._q[H_DEFERRED]:
                self._sweep_released()
            put = self._core.put
            for op in ops:
                if len(op) == 2:
                    out.append(self._core.delete(op[0], op[1], now_ms) > 0)
                    continue
                r = put(op[0], op[1], op[2], op[3], op[4], now_ms, FLAG_DIRTY if dirty else 0)
                if not isinstance(r, tuple):  # needs eviction first
                    r = self._write_locked(op[0], op[1], op[2], op[3], op[4], now_ms, None, dirty)
                out.append(r)
        finally:
            self._release()
        return out

    def _write_locked(self, key_b: bytes, h: int, tag: int, meta: bytes,
                      value: bytes | memoryview, now_ms: int,
                      expect: Callable[[Record | None], None] | None,
                      dirty: bool, version: tuple[int, int, bytes] | None = None,
                      ) -> tuple[int, int, bytes, int, int]:
        q = self._q
        core = self._core
        if q[H_RELEASED] or q[H_DEFERRED]:
            self._sweep_released()
        if expect is not None:
            w, _ = core.find(key_b, h)
            expect(self._record_locked(w) if w >= 0 else None)
        flags = FLAG_DIRTY if dirty else 0
        extra = () if version is None else version
        r = core.put(key_b, h, tag, meta, value, now_ms, flags, *extra)
        while not isinstance(r, tuple):
            if r == NEED_SPACE:
                w, _ = core.find(key_b, h)
                self._make_space(REC_HEADER + len(key_b) + len(meta) + len(value) + 64, protect=w)
            elif r == NEED_SLOT:
                self._evict_in_window(h)
            elif r == TOO_LARGE:
                raise ValueTooLarge(
                    f"a record of {len(value)} value bytes can never fit in L2 of {self.name!r} "
                    f"(largest block {self._max_record} bytes); raise cache.l2_size or store less"
                )
            else:
                raise SegmentError(f"L2 of {self.name!r} is corrupt; purge the namespace")
            r = core.put(key_b, h, tag, meta, value, now_ms, flags, *extra)
        return r

    def delete(self, key_b: bytes, h: int, *, now_ms: int,
               expect: Callable[[Record | None], None] | None = None) -> int:
        """Remove ``key_b``. Returns the delete's write counter (the one its change-feed
        event carries), 0 when the key was absent. ``expect`` as for :meth:`write`."""
        self._acquire()
        try:
            return self._delete_locked(key_b, h, now_ms, expect)
        finally:
            self._release()

    def _delete_locked(self, key_b: bytes, h: int, now_ms: int,
                       expect: Callable[[Record | None], None] | None) -> int:
        if expect is not None:
            w, _ = self._core.find(key_b, h)
            expect(self._record_locked(w) if w >= 0 else None)
        return self._core.delete(key_b, h, now_ms)

    def _record_locked(self, w: int) -> Record:
        q = self._q
        off = q[w + 2]
        bi = off >> 3
        info = q[bi + 3]
        klen = info & 0xFFFF
        vvlen = (info >> 24) & 0xFFFFFFFF
        p = off + REC_HEADER + klen
        return Record(w, q[w], (info >> 16) & 0xFF, self._mm[p + vvlen : p + vvlen + q[bi + 7]],
                      b"", q[bi + 1], q[bi + 2], self._mm[p : p + vvlen], q[bi])

    # ---------------------------------------------------------------- eviction

    def _evict_slot(self, w: int) -> None:
        self._core.evict(w)
        self._q[H_EVICTIONS] += 1

    def _has_free(self, order: int) -> bool:
        q = self._q
        return any(q[H_FREE + j] for j in range(order, self._top + 1))

    def _make_space(self, size: int, protect: int) -> None:
        """CLOCK over all slots: evict clean, unreferenced entries until ``size`` fits."""
        q = self._q
        order = max(MIN_ORDER, (size - 1).bit_length())
        self._sweep_pins(check_dead=True)
        if self._has_free(order):
            return
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
            if self._has_free(order):
                q[H_CLOCK] = hand
                return
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
                if q[w + 2] <= TOMB:
                    return  # a slot came free meanwhile
                if q[w + 4] & FLAG_DIRTY:
                    continue
                if q[w + 3] and rnd == 0:
                    q[w + 3] = 0
                    continue
                self._evict_slot(w)
                return
        raise Unavailable("L2 hash window is full of unflushed writes; retry after the daemon syncs")

    # ---------------------------------------------------------------- pins (zero-copy views)

    def pin(self, key_b: bytes, h: int) -> tuple[Any, ...] | None:
        """Pin the block of ``key_b`` so that it outlives overwrites; None when absent.

        Returns ``(word, seq, tag, meta, counter, hlc, vvx, size, pin, view)``: ``view`` is a
        read-only memoryview of the value, valid until :meth:`unpin` of ``pin``; when the pin
        table is full ``pin`` is -1 and ``view`` is a private copy instead.
        """
        self._acquire()
        try:
            if self._q[H_RELEASED]:
                self._sweep_pins(check_dead=False)
            r = self._core.pin(key_b, h, self._pid)
            if r is None:
                return None
            voff, vlen = r[9], r[10]
            if r[8] < 0:  # pin table full: a copy taken under the lock keeps the promise
                return (*r[:9], self._mm[voff : voff + vlen])
            return (*r[:9], self._ro[voff : voff + vlen])
        finally:
            self._release()

    def unpin(self, index: int) -> None:
        """Called from a view's finalizer in any thread: lock-free, the next writer sweeps."""
        if self._atom is None:
            return
        p = (self.layout.pins_off >> 3) + 2 * index + 1
        try:
            self._atom.store(p * 8, 0)
            self._atom.add(H_RELEASED * 8, 1)
        except (ValueError, SegmentError):
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
                    self._core.free(off)

    # ---------------------------------------------------------------- change feed

    def feed_head(self) -> int:
        return int(self._q[H_FEED_HEAD])

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
                self._core.push_free(pos, order)
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
        self._core.feed(KIND_RESYNC, b"", q[H_WSEQ], q[H_HLC])

    # ---------------------------------------------------------------- node daemon support

    def dirty_keys(self) -> list[bytes]:
        """Keys whose records are flagged dirty (written here, not yet in L3). A scan."""
        q = self._q
        out = []
        for i in range(self.layout.n_slots):
            w = self._sbase + i * SLOT_WORDS
            s = q[w]
            off = q[w + 2]
            if off > TOMB and q[w + 4] & FLAG_DIRTY:
                klen = q[(off >> 3) + 3] & 0xFFFF
                kb = self._mm[off + REC_HEADER : off + REC_HEADER + klen]
                if q[w] == s:
                    out.append(kb)
        return out

    def mark_clean(self, key_b: bytes, h: int, counter: int, hlc: int) -> bool:
        """Clear the dirty flag if the key still holds the write (counter, hlc)."""
        self._acquire()
        try:
            w, _ = self._core.find(key_b, h)
            if w < 0:
                return False
            bi = self._q[w + 2] >> 3
            if self._q[bi + 1] != counter or self._q[bi + 2] != hlc:
                return False
            self._q[w + 4] &= ~FLAG_DIRTY
            return True
        finally:
            self._release()

    def is_dirty(self, word: int) -> bool:
        return bool(self._q[word + 4] & FLAG_DIRTY)

    @property
    def sync_cursor(self) -> int:
        return int(self._q[H_SYNC_CURSOR])

    @sync_cursor.setter
    def sync_cursor(self, value: int) -> None:
        self._atom.store(H_SYNC_CURSOR * 8, value)

    def daemon_heartbeat(self, pid: int) -> None:
        self._q[H_DAEMON_PID] = pid
        self._atom.store(H_DAEMON_BEAT * 8, time.time_ns() // 1_000_000)

    def daemon_alive(self, within_ms: int = 2000) -> bool:
        beat = self._q[H_DAEMON_BEAT]
        return bool(beat) and time.time_ns() // 1_000_000 - beat < within_ms

    # ---------------------------------------------------------------- hot keys

    def count_accesses(self, counts: dict[bytes, int]) -> None:
        """Add a process's buffered access counts to the host sketch (under the lock)."""
        self._acquire()
        try:
            before = self.sketch.additions
            add = self.sketch.add
            offers = [(kb, add(kb, n)) for kb, n in counts.items()]
            if self.sketch.additions < before:  # the sketch aged: age the top-k with it
                self.topk.halve()
            self.topk.offer_many(offers)
        finally:
            self._release()

    def hot_keys(self, n: int) -> list[tuple[str, int]]:
        self._acquire()
        try:
            top = self.topk.top(n)
        finally:
            self._release()
        return [(k.decode("utf-8", "replace"), c) for k, c in top]

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
            "daemon_pid": q[H_DAEMON_PID],
            "daemon_alive": self.daemon_alive(),
            "sync_backlog": q[H_FEED_HEAD] - q[H_SYNC_CURSOR],
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
        self._atom = None  # type: ignore[assignment]
        core = getattr(self, "_core", None)
        if core is not None:
            core.release()
        for obj in (getattr(self, "sketch", None), getattr(self, "topk", None)):
            for mv in vars(obj).values() if obj is not None and hasattr(obj, "__dict__") else ():
                if isinstance(mv, memoryview):
                    mv.release()
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
        seg = L2Segment(name, create_layout=None, host_id="", attach_timeout=0)
        seg.mark_purged()
        seg.close()
    except SegmentError:
        pass  # foreign or broken: removing the file is all we can do
    os.unlink(path)
    from .keyfilter import remove  # (keyfilter builds on this module)

    remove(name)  # the daemon's filter of existing keys goes with the namespace
    return True
