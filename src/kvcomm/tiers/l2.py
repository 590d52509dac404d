"""L2: one shared-memory segment per namespace per host, mapped by every agent process.

Theory of operation
-------------------
The segment is a file in ``cache.l2_dir`` (``/dev/shm``; owner-only by default) whose
layout is defined once, in :mod:`kvcomm.tiers.shm.layout`::

    header (4 KiB) | slots | block meta | data (buddy heap) | change feed | pins | deferred
                   | hot keys (count-min sketch + top-k, 0.1% of the segment)

* **Slots** form an open-addressing hash table (linear probing, at most ``MAX_PROBE``
  slots from a key's home). A slot points at an immutable record block.
* **Records are copy-on-write.** A writer builds the new record in a fresh block, then
  publishes it by bumping the slot's ``seq`` to odd, storing the block, and bumping ``seq``
  back to even; only then is the old block freed. So a slot changes in a few word stores
  and a reader never waits on a value copy (rewriting a slot in place starves readers).
* **Readers take no lock.** They read ``seq`` (retry while odd), the block, copy what they
  need, and re-read ``seq``: unchanged means the copy is exactly the record that was
  published, because a block is freed only after its slot's ``seq`` moved. Every field
  they read is checked before use, so a corrupt segment raises SegmentError.
* **Writers take one lock**: a process-shared, robust pthread mutex in the header (C
  kernel ``kvcomm._l2core``). Its holder may die at any instruction: the kernel hands the
  lock to the next taker, who sees ``EOWNERDEAD``. No pid is compared, so pid reuse,
  zombies and PID namespaces (containers sharing ``/dev/shm``) change nothing. Python
  code that runs under the lock (validators, compare-and-set checks) is written as
  ``try: lock … finally: unlock``, and ``unlock`` knows in C whether this thread holds
  the lock, so no exception — ``KeyboardInterrupt`` included, at any bytecode — can leave
  it held.
* **BUSY** is raised by every mutation before it changes anything and lowered after.
  A writer that takes the lock and finds it raised (the previous holder died, or found
  corruption, mid-mutation) first **recovers**: slots made even, implausible references
  dropped, the heap's free lists rebuilt from what slots and parked blocks reference, pins
  recounted, watchers told to resync. A kill at any instruction loses at most the write in
  flight (never acknowledged); nothing else.
* **Batches are all or nothing.** A batch is planned under the lock — sizes checked, a slot
  claimed for every new key, every block allocated (evicting clean entries only if the
  batch can then fit) — before its first record is published.
* **Deletes in cluster mode are tombstones**: a record with no value, flagged dirty like
  any write not yet in L3, so a delete is as durable as a put until L3 has it. Readers
  treat a tombstone as absent.
* **Zero-copy views** pin their block: under the lock the reader records ``(block, pid)``
  in the pin table and counts the pin on the block. A writer that replaces a pinned block
  parks it instead of freeing it; the view's finalizer marks its pin released (lock-free,
  and only the pinning process can), and the next writer's sweep frees the block. Pins of
  dead processes are swept too. A forked child re-pins the views it inherits.
* **Change feed**: a ring of fixed-size events (put, delete, evict, resync) appended under
  the lock. Watchers and the node daemon read it with their own cursors; a reader that
  falls a whole ring behind learns that it overflowed.
* **Eviction** (CLOCK) drops clean, unpinned entries when space or a probe window runs
  out. It is a local event (an ``evict`` feed event), never a delete: in cluster mode the
  key stays in L3.

Memory ordering: stores and loads through ``memoryview.cast("Q")`` are single aligned
8-byte moves, which x86-64 keeps in program order (TSO); everything that needs more goes
through the C kernel's atomics. On other architectures this module refuses to load.
"""

from __future__ import annotations

import mmap
import os
import platform
import pwd
import re
import stat
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import xxhash

from .. import _l2core
from ..core.sketch import CountMinSketch, TopK
from ..errors import (
    InvalidArgument,
    KVCommError,
    KVCommWarning,
    SegmentError,
    Unavailable,
    ValueTooLarge,
)
from .shm.layout import (
    FEED,
    FEED_KEY_AT,
    FLAG_DIRTY,
    H_FREE,
    HEADER_SIZE,
    HOST_ID_AT,
    KIND_DELETE,
    KIND_EVICT,
    KIND_NAMES,
    KIND_PUT,
    KIND_RESYNC,
    LAYOUT_VERSION,
    MAGIC,
    MAX_KEY,
    MIN_ORDER,
    PIN_WORDS,
    PROC_BYTES,
    REC,
    REC_HEADER,
    SLOT,
    SLOT_WORDS,
    STATE_OK,
    TAG_TOMBSTONE,
    TOKEN_SLOT_BITS,
    TOMB,
    H,
)

_l2core.set_errors(SegmentError, Unavailable, InvalidArgument)

__all__ = [
    "FLAG_DIRTY", "KIND_DELETE", "KIND_EVICT", "KIND_NAMES", "KIND_PUT", "KIND_RESYNC",
    "L2Segment", "Layout", "Record", "TAG_TOMBSTONE", "key_hash", "open_segment", "purge",
    "segment_path",
]

SHM_DIR = "/dev/shm"
NEW_DOT = (1 << 64) - 1  # a versioned put with this counter: a fresh local dot over the vector

# statuses of the C kernel's writes when they changed nothing
ST_SLOT_FULL = _l2core.ST_SLOT_FULL
ST_TOO_LARGE = _l2core.ST_TOO_LARGE
ST_DIRTY_FULL = _l2core.ST_DIRTY_FULL
ST_LOOK = _l2core.ST_LOOK
ST_FULL = _l2core.ST_FULL

SKETCH_DEPTH = 4
HOT_TOPK = 64
DEFAULT_LOCK_TIMEOUT = 10.0

# header words used on hot paths, bound once
_H_STATE, _H_BUSY, _H_FEED_HEAD = H["STATE"], H["BUSY"], H["FEED_HEAD"]
_H_RELEASED, _H_DEFERRED = H["RELEASED"], H["DEFERRED"]
_S_FLAGS = SLOT["FLAGS"]

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

if platform.machine().lower() not in ("x86_64", "amd64"):  # pragma: no cover
    raise ImportError(
        "kvcomm's L2 relies on x86-64 store ordering for its lock-free readers; "
        f"this machine is {platform.machine()}"
    )


def segment_path(name: str, directory: str = SHM_DIR) -> str:
    """The file backing namespace ``name``. Raises SegmentError on a bad name."""
    if type(name) is not str or not _NAME_RE.match(name):
        raise SegmentError(
            f"namespace {name!r} is invalid: use 1-64 letters, digits, '.', '_' or '-'"
        )
    return os.path.join(directory, f"kvcomm.{name}")


def key_hash(key_b: bytes) -> int:
    """Stable across processes and hosts (never Python's salted hash); never 0."""
    return xxhash.xxh3_64_intdigest(key_b) | 1


def pid_alive(pid: int) -> bool:
    """True when ``pid`` runs and is not a zombie (a zombie cannot release anything)."""
    if pid <= 0 or pid > 1 << 22:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    # the state letter follows the command name, which is in parentheses
    end = data.rfind(b")")
    return data[end + 2 : end + 3] not in (b"Z", b"X")


def _order_for(nbytes: int) -> int:
    return max(MIN_ORDER, (nbytes - 1).bit_length())


def check_owner(path: str, st: os.stat_result, permissions: int) -> None:
    """Refuse a shared file another user could have planted or can reach.

    Raises SegmentError naming the owner and the mode when ``st`` is not owned by this
    process's effective user or grants more than ``permissions``.
    """
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid() or mode & ~permissions:
        try:
            owner = pwd.getpwuid(st.st_uid).pw_name
        except KeyError:
            owner = str(st.st_uid)
        raise SegmentError(
            f"{path} is owned by {owner!r} with mode {oct(mode)}; this process runs as uid "
            f"{os.geteuid()} and allows {oct(permissions)} (cache.l2_permissions): not using a "
            "file another user could have created or can read. Remove it (as its owner) or "
            "use another namespace"
        )


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
    procs_off: int = 0
    n_procs: int = 0

    _WORDS = ("TOTAL", "NSLOTS", "SLOTS_OFF", "META_OFF", "DATA_OFF", "DATA_SIZE", "TOP_ORDER",
              "FEED_OFF", "FEED_N", "FEED_ESZ", "PINS_OFF", "NPINS", "DEFER_OFF", "MAX_KEY",
              "HOT_OFF", "SKETCH_WIDTH", "TOPK", "PROCS_OFF", "NPROCS")

    @staticmethod
    def plan(l2_size: int, max_key: int, feed_n: int, n_pins: int, max_value: int) -> Layout:
        """Carve ``l2_size`` bytes. Raises SegmentError when it is too small to be useful."""
        if not 1 <= max_key <= MAX_KEY:
            raise SegmentError(f"cache.max_key_bytes={max_key} is outside 1..{MAX_KEY}")
        n_slots = 1024
        while n_slots * 2048 < l2_size:
            n_slots *= 2
        feed_esz = (FEED_KEY_AT + max_key + 63) // 64 * 64
        feed_n = max(16, min(feed_n, l2_size // 8 // feed_esz))  # the feed takes <= 1/8
        n_pins = max(n_pins, 1)
        n_procs = min(n_pins, (1 << TOKEN_SLOT_BITS) - 2)
        fixed = (HEADER_SIZE + n_slots * SLOT_WORDS * 8 + feed_n * feed_esz + n_pins * 24
                 + n_procs * PROC_BYTES)
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
        defer_off = pins_off + n_pins * PIN_WORDS * 8
        procs_off = (defer_off + n_pins * 8 + 63) // 64 * 64
        hot_off = procs_off + n_procs * PROC_BYTES
        topk = HOT_TOPK
        hot_budget = max(l2_size // 1000, 32 << 10)  # the sketch's share: 0.1% (32 KiB floor)
        width = max(64, (hot_budget - TopK.size_for(topk, max_key) - 16) // (4 * SKETCH_DEPTH))
        hot_size = CountMinSketch.size_for(width, SKETCH_DEPTH) + TopK.size_for(topk, max_key)
        total = (hot_off + hot_size + 4095) // 4096 * 4096
        return Layout(total, n_slots, slots_off, meta_off, data_off, data_size, top_order,
                      feed_off, feed_n, feed_esz, pins_off, n_pins, defer_off, max_key,
                      hot_off, width, topk, procs_off, n_procs)

    def header_words(self) -> dict[int, int]:
        return {H[w]: getattr(self, f) for w, f in zip(self._WORDS, _FIELDS, strict=True)}

    @staticmethod
    def from_header(q: memoryview, file_size: int) -> Layout:
        """The layout a header describes. Raises SegmentError unless it is exactly one that
        :meth:`plan` could have made for a file of ``file_size`` bytes."""
        lay = Layout(*(int(q[H[w]]) for w in Layout._WORDS))
        ok = (
            lay.total == file_size
            and 0 < lay.n_slots <= 1 << 32 and lay.n_slots & (lay.n_slots - 1) == 0
            and lay.slots_off == HEADER_SIZE
            and lay.meta_off == lay.slots_off + lay.n_slots * SLOT_WORDS * 8
            and MIN_ORDER <= lay.top_order < 48 and 0 < lay.data_size < file_size
            and lay.data_size % (1 << lay.top_order) == 0
            and lay.data_off % 4096 == 0 and lay.data_off >= lay.meta_off + (lay.data_size >> MIN_ORDER)
            and 1 <= lay.max_key <= MAX_KEY and 16 <= lay.feed_n <= 1 << 22
            and lay.feed_esz == (FEED_KEY_AT + lay.max_key + 63) // 64 * 64
            and lay.feed_off == lay.data_off + lay.data_size
            and 1 <= lay.n_pins <= 1 << 16
            and lay.pins_off == lay.feed_off + lay.feed_n * lay.feed_esz
            and lay.defer_off == lay.pins_off + lay.n_pins * PIN_WORDS * 8
            and lay.procs_off % 64 == 0 and lay.procs_off >= lay.defer_off + lay.n_pins * 8
            and 1 <= lay.n_procs <= min(lay.n_pins, (1 << TOKEN_SLOT_BITS) - 2)
            and lay.hot_off == lay.procs_off + lay.n_procs * PROC_BYTES
            and 64 <= lay.sketch_width < (1 << 28) and 1 <= lay.topk <= 4096
            and lay.hot_off + CountMinSketch.size_for(lay.sketch_width, SKETCH_DEPTH)
            + TopK.size_for(lay.topk, lay.max_key) <= lay.total
        )
        if not ok:
            raise SegmentError("L2 segment header is inconsistent (corrupt); purge the namespace")
        return lay


_FIELDS = ("total", "n_slots", "slots_off", "meta_off", "data_off", "data_size", "top_order",
           "feed_off", "feed_n", "feed_esz", "pins_off", "n_pins", "defer_off", "max_key",
           "hot_off", "sketch_width", "topk", "procs_off", "n_procs")


class Record(NamedTuple):
    """A copy of one record, taken consistently by a lock-free read."""

    word: int  # index of the slot's seq word, for L1 revalidation
    seq: int
    tag: int  # TAG_TOMBSTONE (0): the key is deleted, L3 not yet told
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
    kind: int  # KIND_PUT, KIND_DELETE, KIND_EVICT (KIND_RESYNC is reported as an overflow)
    key: str
    counter: int
    hlc: int


class L2Segment:
    """One mapped L2 segment. Thread-safe; one instance per process per namespace.

    Public methods raise SegmentError (unusable segment), ValueTooLarge (a record can never
    fit), Unavailable (full of pinned or unflushed data, lock held too long), InvalidArgument
    (a write from inside a validator). None of them leaves the segment in a state another
    process cannot use.
    """

    def __init__(self, name: str, *, create_layout: Layout | None, host_id: str,
                 permissions: int = 0o600, attach_timeout: float = 2.0,
                 directory: str = SHM_DIR, lock_timeout: float = DEFAULT_LOCK_TIMEOUT) -> None:
        self.name = name
        self.path = segment_path(name, directory)
        self.directory = directory
        self.lock_timeout = float(lock_timeout)
        self._pid = os.getpid()
        self._next_dead_sweep = 0.0
        self._core: Any = None
        self._atom: Any = None
        fd, created = self._open_file(create_layout, permissions)
        try:
            size = create_layout.total if created and create_layout else os.fstat(fd).st_size
            if size < HEADER_SIZE:
                size = self._wait_for_size(fd, attach_timeout)
            if size % 4096:
                raise SegmentError(f"{self.path} is {size} bytes, not a whole number of pages: "
                                   "not a KVCOMM segment (foreign or truncated); not touching it")
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            if created:
                _unlink_quietly(self.path)
            raise
        os.close(fd)
        self._buf = memoryview(self._mm)
        self._q = self._buf.cast("Q")
        self._ro = self._buf.toreadonly()
        try:
            if created:
                assert create_layout is not None
                self._initialise(create_layout, host_id)
            else:
                self._wait_for_magic(attach_timeout)
                self.layout = Layout.from_header(self._q, size)
                self._bind_layout()
        except BaseException:
            self.close()
            if created:
                _unlink_quietly(self.path)
            raise
        hb = bytes(self._buf[HOST_ID_AT + 1 : HOST_ID_AT + 1 + min(64, self._buf[HOST_ID_AT])])
        self.host_id = hb.decode("utf-8", "replace")
        self.created = created
        _LIVE.add(self)

    # ---------------------------------------------------------------- opening

    def _open_file(self, layout: Layout | None, permissions: int) -> tuple[int, bool]:
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        if layout is not None:
            try:
                fd = os.open(self.path, flags | os.O_CREAT | os.O_EXCL, permissions & 0o777)
            except FileExistsError:
                pass
            except OSError as exc:
                raise SegmentError(f"cannot create {self.path}: {exc.strerror}") from None
            else:
                try:
                    os.fchmod(fd, permissions & 0o777)  # exactly, whatever the umask
                    os.posix_fallocate(fd, 0, layout.total)  # memory reserved now, not on SIGBUS
                except OSError as exc:
                    os.close(fd)
                    _unlink_quietly(self.path)
                    raise SegmentError(self._no_room(layout.total, exc)) from None
                return fd, True
        try:
            fd = os.open(self.path, flags)
        except FileNotFoundError:
            raise SegmentError(f"no L2 segment for namespace {self.name!r}") from None
        except OSError as exc:
            raise SegmentError(f"cannot open {self.path}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SegmentError(f"{self.path} is not a regular file; remove it")
            check_owner(self.path, st, permissions)
        except BaseException:
            os.close(fd)
            raise
        return fd, False

    def _no_room(self, size: int, exc: OSError) -> str:
        try:
            vfs = os.statvfs(self.directory)
            free = f"{vfs.f_bavail * vfs.f_frsize / 2**20:.1f} MiB are free there"
        except OSError:
            free = "its free space is unknown"
        return (f"cannot reserve {size / 2**20:.1f} MiB for L2 segment {self.name!r} in "
                f"{self.directory} ({exc.strerror}); {free}. Lower cache.l2_size, free space, "
                "or point cache.l2_dir at a larger tmpfs (Docker: --shm-size)")

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
        while q[H["MAGIC"]] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        magic, layout = q[H["MAGIC"]], q[H["LAYOUT"]]
        if magic == 0:
            raise SegmentError(
                f"{self.path} was never initialised (its creator died?); "
                f"run `kvcomm purge --name {self.name}`"
            )
        if magic & 0x00FFFFFFFFFFFFFF != MAGIC & 0x00FFFFFFFFFFFFFF:
            raise SegmentError(f"{self.path} is not a KVCOMM segment (foreign file); not touching it")
        if magic != MAGIC or layout != LAYOUT_VERSION:
            raise SegmentError(
                f"{self.path} has layout version {layout}, this kvcomm uses {LAYOUT_VERSION}; "
                f"stop its users and run `kvcomm purge --name {self.name}`"
            )

    def _initialise(self, lay: Layout, host_id: str) -> None:
        q = self._q
        q[H["LAYOUT"]] = LAYOUT_VERSION
        for w, v in lay.header_words().items():
            q[w] = v
        hb = host_id.encode()[:64]
        self._buf[HOST_ID_AT] = len(hb)
        self._buf[HOST_ID_AT + 1 : HOST_ID_AT + 1 + len(hb)] = hb
        # The host's write sequence (the counter of its dots) starts at the time in
        # microseconds, not at 1: a host whose L2 is lost (a reboot) must never reuse the
        # dots of writes L3 already has (they would read as older than themselves). The
        # node daemon also rebases a write L3 finds covered by the host's own older dots.
        q[H["WSEQ"]] = time.time_ns() // 1000
        self.layout = lay
        self._bind_layout()
        self._core.init_lock()
        self._core.init_heap()
        self._atom.store(H["MAGIC"] * 8, MAGIC)  # last: attachers wait for it

    def _bind_layout(self) -> None:
        lay = self.layout
        self._meta = self._buf[lay.meta_off : lay.meta_off + (lay.data_size >> MIN_ORDER)]
        self._max_record = 1 << lay.top_order
        sk = CountMinSketch.size_for(lay.sketch_width, SKETCH_DEPTH)
        self.sketch = CountMinSketch(lay.sketch_width, SKETCH_DEPTH,
                                     buffer=self._buf[lay.hot_off : lay.hot_off + sk])
        self.topk = TopK(lay.topk, lay.max_key,
                         buffer=self._buf[lay.hot_off + sk : lay.hot_off + sk
                                          + TopK.size_for(lay.topk, lay.max_key)])
        self._core = _l2core.Core(self._mm)
        self._atom = self._core  # the same object gives the atomics on any header word

    # ---------------------------------------------------------------- lock

    def _lock(self) -> None:
        """Take the writer lock and make the segment fit to use (purged? repair? sweep?).

        The caller's ``finally`` must call ``self._core.unlock()``, which releases the lock
        only if this thread holds it: call ``_lock`` inside the ``try``.
        """
        if self._core.lock(self.lock_timeout):
            self._after_lock()

    def _after_lock(self) -> None:
        q = self._q
        if q[_H_STATE] != STATE_OK:
            raise SegmentError(f"namespace {self.name!r} was purged; open it again")
        if q[_H_BUSY]:
            self._recover()
        if q[_H_DEFERRED] and time.time_ns() // 1_000_000 >= q[H["DEAD_CHECK_MS"]]:
            self._sweep_dead()

    def locked(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` under the writer lock (for tools and tests); returns what it returns."""
        core = self._core
        try:
            self._lock()
            return fn()
        finally:
            core.unlock()

    @property
    def purged(self) -> bool:
        """True once the namespace was purged (every read and write raises SegmentError)."""
        return self._core is not None and self._q[_H_STATE] != STATE_OK

    def lock_owner(self) -> int:
        """The thread id holding the writer lock (a process's main thread id is its pid),
        0 when free. For tools; meaningful only in this PID namespace, with glibc."""
        return int(self._core.owner()) if self._core is not None else 0

    def holds_lock(self) -> bool:
        """True when this thread holds the writer lock (inside a validator, say)."""
        return bool(self._core is not None and self._core.held())

    # ---------------------------------------------------------------- reads (lock-free)

    def read(self, key_b: bytes, h: int, zero_copy: int = 1 << 62) -> Record | None:
        """A consistent copy of the record for ``key_b`` (tombstones included: tag 0), or
        None when absent. Lock-free unless a writer is stuck or the segment needs repair.

        An array value of ``zero_copy`` bytes or more is not copied: ``value`` is None and
        the caller takes a view with :meth:`pin`. Raises SegmentError (purged; corrupt and
        not repairable), Unavailable (a writer stopped mid-publish for over the lock timeout).
        """
        r = self._read_or_repair(lambda: self._core.read(key_b, h, zero_copy))
        return None if r is None else _new_record(Record, r)

    def version(self, key_b: bytes, h: int) -> tuple[int, int, int, int, int, bytes, int] | None:
        """``(word, seq, tag, counter, hlc, vvx, flags)`` of ``key_b``'s record, or None."""
        r = self._read_or_repair(lambda: self._core.version(key_b, h))
        return None if r is None else tuple(r)

    def _read_or_repair(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` (a lock-free read), seeing through damage and stuck writers.

        A corrupt record: the segment is repaired (under the lock) and read once more. A
        slot that stays odd: its writer is slow, stopped, or died mid-publish — so take the
        lock (which recovers from a death, and waits for a slow writer, at most
        ``lock_timeout``: Unavailable for a stopped one). Under the lock no writer
        publishes: a slot still odd then is damage, repaired there.
        """
        try:
            r = fn()
        except SegmentError:
            if self._q[_H_STATE] != STATE_OK:
                raise
            self.repair()
            return fn()
        if type(r) is not int:
            return r
        core = self._core
        try:
            self._lock()
            r = fn()
            if type(r) is int:
                core.set_busy(1)
                self._recover()
                r = fn()
                if type(r) is int:
                    raise SegmentError(f"an L2 slot of {self.name!r} cannot be repaired; "
                                       "purge the namespace")
            return r
        finally:
            core.unlock()

    def repair(self) -> None:
        """Under the lock, rebuild the segment's structures (as after a writer's death)."""
        core = self._core
        try:
            self._lock()
            core.set_busy(1)
            self._recover()
        finally:
            core.unlock()

    # ---------------------------------------------------------------- writes (locked)

    def put(self, key_b: bytes, h: int, tag: int, meta: bytes, value: bytes | memoryview,
            now_ms: int, dirty: bool, max_dirty: int) -> tuple[int, int, bytes, int, int]:
        """Store one record: ``(counter, hlc, vvx, slot word, seq)``. One C call in the common
        case. Raises ValueTooLarge, Unavailable, SegmentError; on any error nothing changed."""
        r = self._core.put(key_b, h, tag, meta, value, now_ms, FLAG_DIRTY if dirty else 0,
                           max_dirty, self.lock_timeout)
        if type(r) is tuple:
            return r
        return self.put_status(r, key_b, h, tag, meta, value, now_ms, dirty, max_dirty)

    def put_status(self, r: int, key_b: bytes, h: int, tag: int, meta: bytes,
                   value: bytes | memoryview, now_ms: int, dirty: bool,
                   max_dirty: int) -> tuple[int, int, bytes, int, int]:
        """The kernel's put answered status ``r`` (nothing written): look first and write
        (ST_LOOK), or raise what the status means."""
        if r == ST_LOOK:  # purged, repair or pins first: the general path does it
            out: tuple[int, int, bytes, int, int] = self.apply(
                [(key_b, h, tag, meta, value)], now_ms=now_ms, dirty=dirty, max_dirty=max_dirty)[0]
            return out
        self._raise_status(r, 0, [(key_b, h, tag, meta, value)], max_dirty)
        raise AssertionError("unreachable")

    def apply(self, ops: list[tuple[Any, ...]], *, now_ms: int, dirty: bool = False,
              max_dirty: int = 0, tombstones: bool = False,
              check: Callable[[], None] | None = None) -> list[Any]:
        """Apply ``ops`` under one lock, all or nothing.

        Ops: ``(key_b, h)`` delete, ``(key_b, h, tag, meta, value)`` put, or
        ``(key_b, h, tag, meta, value, counter, hlc, vvx)`` put with a given version (tag 0:
        a tombstone with that version). ``tombstones``: deletes leave dirty tombstones
        (cluster mode). ``check`` runs under the lock before anything changes (validators,
        compare-and-set) and may raise to abort. Returns per op ``(counter, hlc, vvx, word,
        seq)`` for a put, the delete's counter (0: nothing to delete) for a delete.
        Raises ValueTooLarge, Unavailable, SegmentError, or what ``check`` raises; on any
        error nothing changed (clean entries may have been evicted to make room).
        """
        core = self._core
        flags = FLAG_DIRTY if dirty else 0
        try:
            self._lock()
            if check is not None:
                check()
            for attempt in range(2):
                try:
                    r = core.apply(ops, now_ms, flags, max_dirty, tombstones)
                    break
                except SegmentError:
                    if attempt or not self._q[_H_BUSY] or self._q[_H_STATE] != STATE_OK:
                        raise
                    self._recover()  # corruption found before anything was published
            if type(r) is tuple:
                self._raise_status(r[0], r[1], ops, max_dirty)
            return r  # type: ignore[no-any-return]
        finally:
            core.unlock()

    def _raise_status(self, status: int, index: int, ops: list[tuple[Any, ...]],
                      max_dirty: int) -> None:
        op = ops[index] if 0 <= index < len(ops) else ops[-1]
        key = bytes(op[0]).decode("utf-8", "replace")
        if status == ST_TOO_LARGE:
            size = len(op[4]) if len(op) > 2 else 0
            if len(ops) > 1:
                raise ValueTooLarge(
                    f"this batch cannot fit in L2 of {self.name!r} (largest block "
                    f"{self._max_record} bytes, heap {self.layout.data_size} bytes; at {key!r}, "
                    f"{size} value bytes); raise cache.l2_size or split it. Nothing was written")
            raise ValueTooLarge(
                f"a record of {size} value bytes can never fit in L2 of {self.name!r} "
                f"(largest block {self._max_record} bytes); raise cache.l2_size or store less")
        if status == ST_DIRTY_FULL:
            raise Unavailable(
                f"{self._q[H['DIRTY']]} writes on this host are waiting for L3 (bound "
                f"{max_dirty}, cluster.outbound_max); is `kvcomm node` running for namespace "
                f"{self.name!r} and the cluster up? Nothing was written")
        if status == ST_SLOT_FULL:
            raise Unavailable(
                f"the L2 hash window of {key!r} is full of writes not yet in L3; retry after "
                "the node daemon syncs. Nothing was written")
        if status == ST_FULL:
            raise Unavailable(
                f"L2 of {self.name!r} is full: {self._q[_H_DEFERRED]} blocks are pinned by "
                "zero-copy views and the rest cannot be evicted (unflushed or pinned); release "
                "views or raise cache.l2_size. Nothing was written")
        raise SegmentError(f"L2 of {self.name!r} refused a write (status {status}); purge it")

    def mark_clean(self, key_b: bytes, h: int, counter: int, hlc: int) -> bool:
        """Clear the dirty flag if the key still holds the write (counter, hlc)."""
        core = self._core
        try:
            self._lock()
            return bool(core.mark_clean(key_b, h, counter, hlc))
        finally:
            core.unlock()

    def evict(self, key_b: bytes, h: int) -> bool:
        """Drop ``key_b``'s record from this host's L2 if it is clean (a local eviction);
        False when it is absent or dirty."""
        core = self._core
        try:
            self._lock()
            return bool(core.evict_key(key_b, h))
        finally:
            core.unlock()

    def is_dirty(self, word: int) -> bool:
        try:
            return bool(self._q[word + _S_FLAGS] & FLAG_DIRTY)
        except IndexError:
            return False

    # ---------------------------------------------------------------- pins (zero-copy views)

    def pin(self, key_b: bytes, h: int) -> tuple[Any, ...] | None:
        """Pin the block of ``key_b`` so that it outlives overwrites; None when absent.
        Lock-free (a hazard entry of this process names the block; see the C kernel).

        Returns ``(word, seq, tag, meta, counter, hlc, vvx, size, pin, view)``: ``view`` is a
        read-only memoryview of the value, valid until :meth:`unpin` of ``pin`` (an
        ``(index, hazard word)`` pair); when the pin table is full ``pin`` is ``(-1, 0)``
        and ``view`` is a private copy instead. Until :meth:`pin_kept`, the pin is pending:
        :meth:`drop_pending` releases it (call it in a ``finally``).
        """
        r = self._read_or_repair(lambda: self._core.pin(key_b, h))
        if r is None:
            return None
        if r[8] < 0:  # pin table full: a consistent private copy keeps the promise
            return (*r[:8], (-1, 0), memoryview(r[10]).toreadonly())
        voff, vlen = r[9], r[10]
        return (*r[:8], (r[8], r[11]), self._ro[voff : voff + vlen])

    def pin_kept(self) -> None:
        """The last pin now belongs to a view (its finalizer releases it)."""
        if self._core is not None:
            self._core.pin_kept()

    def drop_pending(self) -> None:
        """Release the last pin unless a view took it (:meth:`pin_kept`)."""
        if self._core is not None:
            self._core.drop_pending()

    def unpin(self, index: int, word: int) -> None:
        """Called from a view's finalizer in any thread: lock-free; releases exactly the
        pin ``(index, word)`` of this process (a forked child's copy of the finalizer,
        or a second call, does nothing)."""
        core = self._core
        if core is None:
            return
        try:
            core.unpin(index, word)
        except (ValueError, SegmentError):
            pass  # mapping already closed: the entry is swept as a dead process's

    def repin(self, indexes: list[int]) -> list[tuple[int, int]]:
        """After fork: pins of this process on the blocks the parent's pin entries
        ``indexes`` name (the parent's pins protect them meanwhile). Returns the new
        ``(index, word)`` pins, ``(-1, 0)`` where none could be taken."""
        core = self._core
        return [core.pin_block(off) if (off := core.pinned_block(i)) else (-1, 0) for i in indexes]

    def _sweep_dead(self) -> None:
        """Under the lock: clear the pin entries of processes that are gone (whatever
        their pid or PID namespace: see the process table in tiers/shm/layout.py) and free
        the parked blocks they held; next time in a second."""
        self._core.sweep(time.time_ns() // 1_000_000 + 1000)

    # ---------------------------------------------------------------- change feed

    def feed_head(self) -> int:
        return int(self._q[_H_FEED_HEAD])

    def feed_read(self, cursor: int, limit: int = 1 << 30) -> tuple[list[FeedEvent], int, bool]:
        """Events after ``cursor``: (events, new cursor, overflowed). Lock-free.

        ``overflowed``: events after the cursor were overwritten before they were read (or a
        writer died and the segment was repaired): the reader must rescan what it tracks.
        """
        q = self._q
        lay = self.layout
        head = int(q[_H_FEED_HEAD])
        if cursor > head or head - cursor > lay.feed_n:
            return [], head, True
        out: list[FeedEvent] = []
        buf = self._buf
        end = min(head, cursor + limit)
        for seq in range(cursor + 1, end + 1):
            e = lay.feed_off + ((seq - 1) % lay.feed_n) * lay.feed_esz
            ei = e >> 3
            if q[ei + FEED["SEQ"]] != seq:
                return out, head, True
            info = q[ei + FEED["INFO"]]
            klen = min(info >> 8, lay.max_key)
            key = bytes(buf[e + FEED_KEY_AT : e + FEED_KEY_AT + klen])
            counter, hlc = q[ei + FEED["COUNTER"]], q[ei + FEED["HLC"]]
            if q[ei + FEED["SEQ"]] != seq:
                return out, head, True
            kind = info & 0xFF
            if kind == KIND_RESYNC:
                return out, seq, True
            if kind in (KIND_PUT, KIND_DELETE, KIND_EVICT):
                out.append(FeedEvent(seq, kind, key.decode("utf-8", "surrogateescape"), counter, hlc))
        return out, end, False

    # ---------------------------------------------------------------- recovery

    def _recover(self) -> None:
        """Under the lock, with BUSY raised: make every structure whole (see the C kernel's
        ``recover``). Pins of live processes are kept."""
        self._core.recover()

    # ---------------------------------------------------------------- node daemon support

    def dirty_keys(self) -> list[bytes]:
        """Keys whose records (tombstones too) are flagged dirty: written here, not yet in L3."""
        return list(self._core.scan(1))

    @property
    def write_sequence(self) -> int:
        """The counter of the host's last write (its newest dot)."""
        return int(self._q[H["WSEQ"]])

    def raise_write_sequence(self, at_least: int) -> None:
        """Make the host's next dots greater than ``at_least`` (under the lock)."""
        def raise_() -> None:
            if self._q[H["WSEQ"]] < at_least:
                self._q[H["WSEQ"]] = at_least

        self.locked(raise_)

    @property
    def dirty_count(self) -> int:
        return int(self._q[H["DIRTY"]])

    @property
    def sync_cursor(self) -> int:
        return int(self._q[H["SYNC_CURSOR"]])

    @sync_cursor.setter
    def sync_cursor(self, value: int) -> None:
        self._atom.store(H["SYNC_CURSOR"] * 8, value)

    def daemon_heartbeat(self, pid: int) -> None:
        self._q[H["DAEMON_PID"]] = pid
        self._atom.store(H["DAEMON_BEAT"] * 8, time.time_ns() // 1_000_000)

    def daemon_alive(self, within_ms: int = 2000) -> bool:
        beat = self._q[H["DAEMON_BEAT"]]
        return bool(beat) and time.time_ns() // 1_000_000 - beat < within_ms

    def count_set_aside(self, n: int = 1) -> None:
        self._atom.add(H["SET_ASIDE"] * 8, n)

    # ---------------------------------------------------------------- hot keys

    def count_accesses(self, counts: dict[bytes, int]) -> bool:
        """Add a process's buffered access counts to the host sketch (under the lock).
        Returns False, counting nothing, when this thread already holds the lock."""
        core = self._core
        if core.held():
            return False
        try:
            self._lock()
            before = self.sketch.additions
            add = self.sketch.add
            offers = [(kb, add(kb, n)) for kb, n in counts.items()]
            if self.sketch.additions < before:  # the sketch aged: age the top-k with it
                self.topk.halve()
            self.topk.offer_many(offers)
        finally:
            core.unlock()
        return True

    def hot_keys(self, n: int) -> list[tuple[str, int]]:
        core = self._core
        if core.held():  # (from a validator: this thread holds the lock already)
            top = self.topk.top(n)
        else:
            try:
                self._lock()
                top = self.topk.top(n)
            finally:
                core.unlock()
        return [(k.decode("utf-8", "replace"), c) for k, c in top]

    # ---------------------------------------------------------------- invariants

    def check(self) -> list[str]:
        """Under the lock, verify every invariant; returns the problems found (none: []).

        Independent of the C kernel on purpose: it walks the structures its own way."""
        core = self._core
        try:
            self._lock()
            try:
                return self._check_locked()
            except (IndexError, ValueError, OverflowError) as exc:
                return [f"checker stopped on a malformed structure: {exc}"]
        finally:
            core.unlock()

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
            order = (m & 0x7F) + MIN_ORDER - 1
            if m & 0x7F == 0 or order > lay.top_order or (pos - base) % (1 << order):
                problems.append(f"heap walk hit a non-block at {pos}")
                break
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
        referenced: dict[int, int] = {}
        entries = dirty = 0
        sbase = lay.slots_off // 8
        for i in range(lay.n_slots):
            w = sbase + i * SLOT_WORDS
            if q[w + SLOT["SEQ"]] & 1:
                problems.append(f"slot {i} left odd")
            off = q[w + SLOT["OFF"]]
            if off > TOMB:
                entries += 1
                dirty += bool(q[w + SLOT["FLAGS"]] & FLAG_DIRTY)
                if off not in allocated:
                    problems.append(f"slot {i} points at {off}, not an allocated block")
                elif q[(off >> 3) + REC["SIZE"]] > 1 << allocated[off]:
                    problems.append(f"slot {i}'s record is larger than its block")
                if off in referenced:
                    problems.append(f"block {off} referenced twice")
                referenced[off] = 0
        for i in range(lay.n_pins):
            off = q[(lay.defer_off >> 3) + i]
            if off:
                if off in referenced:
                    problems.append(f"parked block {off} is also referenced")
                if off not in allocated:
                    problems.append(f"parked block {off} is not an allocated block")
                referenced[off] = 0
        if q[H["PIN_HWM"]] > lay.n_pins:
            problems.append("the pin table's high-water mark is past its end")
        leaked = set(allocated) - set(referenced)
        if leaked:
            problems.append(f"{len(leaked)} allocated blocks are referenced by nothing")
        if q[H["USED"]] != sum(1 << o for o in allocated.values()):
            problems.append("used-bytes counter disagrees with the heap")
        if q[H["ENTRIES"]] != entries:
            problems.append(f"entries counter {q[H['ENTRIES']]} != {entries} live slots")
        if q[H["DIRTY"]] != dirty:
            problems.append(f"dirty counter {q[H['DIRTY']]} != {dirty} dirty slots")
        if q[_H_BUSY]:
            problems.append("BUSY is raised outside a mutation")
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
            "used_bytes": q[H["USED"]],
            "entries": q[H["ENTRIES"]],
            "dirty": q[H["DIRTY"]],
            "slots": lay.n_slots,
            "evictions": q[H["EVICTIONS"]],
            "recoveries": q[H["RECOVERIES"]],
            "owner_deaths": q[H["OWNER_DEATHS"]],
            "pinned_deferred_blocks": q[_H_DEFERRED],
            "writes": q[H["WSEQ"]],
            "feed_events": q[_H_FEED_HEAD],
            "feed_capacity": lay.feed_n,
            "daemon_pid": q[H["DAEMON_PID"]],
            "daemon_alive": self.daemon_alive(),
            "sync_backlog": q[H["DIRTY"]],
            "set_aside": q[H["SET_ASIDE"]],
            "max_record_bytes": self._max_record,
        }

    def keys(self) -> Iterator[str]:
        """Every live key present now (a scan; concurrent writes may or may not show)."""
        for kb in self._core.scan(0):
            yield kb.decode("utf-8", "surrogateescape")

    def mark_purged(self) -> None:
        """Mark the namespace purged: every process's reads and writes raise SegmentError
        from now on, L1 hits included (every slot's seq moves on). Needs no lock."""
        if self._core is not None:
            self._core.purge_mark()

    def close(self) -> None:
        """Drop this process's mapping. Views still alive keep it mapped until they go."""
        _LIVE.discard(self)
        core = self._core
        self._core = self._atom = None
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
        except (BufferError, AttributeError):
            pass  # zero-copy views still reference it; unmapped when they are gone

    def _after_fork(self) -> None:
        self._pid = os.getpid()
        if self._core is not None:
            self._core.forked()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


_LIVE: weakref.WeakSet[L2Segment] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for seg in list(_LIVE):
        seg._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def open_segment(name: str, layout: Layout, host_id: str, permissions: int,
                 directory: str = SHM_DIR, lock_timeout: float = DEFAULT_LOCK_TIMEOUT) -> L2Segment:
    """Attach to namespace ``name``, creating it with ``layout`` if it does not exist.

    Warns (KVCommWarning) when the namespace exists with another size than ``layout``'s:
    the existing segment is used as it is. Raises SegmentError.
    """
    try:
        seg = L2Segment(name, create_layout=layout, host_id=host_id, permissions=permissions,
                        directory=directory, lock_timeout=lock_timeout)
    except KVCommError:
        raise
    except OSError as exc:
        raise SegmentError(f"cannot map L2 segment {name!r}: {exc.strerror}") from None
    if not seg.created and seg.layout.total != layout.total:
        warnings.warn(
            f"namespace {name!r} already exists with a segment of {seg.layout.total} bytes; "
            f"the configured cache.l2_size (a {layout.total}-byte segment) is ignored until "
            f"the namespace is purged (`kvcomm purge --name {name}`)", KVCommWarning, stacklevel=3)
    return seg


def purge(name: str, directory: str = SHM_DIR) -> bool:
    """Remove namespace ``name``'s files and mark its segment purged (its users get
    SegmentError from then on, L1 hits included).

    Always removes the segment file, even a corrupt, foreign or locked one; the segment
    is marked purged only once its file is gone (a file that cannot be removed is left as
    it was, unmarked). Returns False when there was no segment. Raises SegmentError for a
    bad name, OSError when the file cannot be removed (the caller says what to do).
    """
    path = segment_path(name, directory)
    if not os.path.lexists(path):
        from .keyfilter import remove

        remove(name, directory)
        return False
    try:
        seg: L2Segment | None = L2Segment(name, create_layout=None, host_id="", attach_timeout=0,
                                          directory=directory, lock_timeout=1.0)
    except Exception:  # foreign, broken or not ours: removing the file is all we can do
        seg = None
    try:
        os.unlink(path)
        if seg is not None:
            try:
                seg.mark_purged()
            except (KVCommError, OSError, ValueError):
                pass  # a lock held by a stopped process, say: new users get a new segment
    finally:
        if seg is not None:
            seg.close()
    from .keyfilter import remove  # (keyfilter builds on this module)

    remove(name, directory)  # the daemon's filter of existing keys goes with the namespace
    return True
