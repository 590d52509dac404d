"""The mapped segment's core: open or create it, the writer lock, lock-free reads and
repair. The theory of operation: docs/design/l2.md."""

from __future__ import annotations

import mmap
import os
import platform
import stat
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import xxhash

from ... import _l2core
from ..._threads import user_signals_blocked
from ..._weak import WeakRegistry
from ...core.codec import PACKED, Packed
from ...core.ext import l2_ext_problem
from ...core.sketch import CountMinSketch, TopK
from ...core.versions import MAX_COUNTER
from ...errors import InvalidArgument, SegmentError, Unavailable, WriteUnderLock
from .files import (
    SHM_DIR,
    _unlink_quietly,
    check_new_name,
    check_owner,
    check_side_name,
    create_temp,
    remove_dead_temps,
    segment_path,
)
from .geometry import SKETCH_DEPTH, Layout
from .layout import (
    FLAG_DIRTY,
    HEADER_SIZE,
    HOST_ID_AT,
    LAYOUT_VERSION,
    MAGIC,
    MIN_ORDER,
    RESV_PAGE,
    SLOT,
    STATE_OK,
    H,
    is_segment_magic,
)
from .oldlayout import unflushed

_l2core.set_errors(SegmentError, Unavailable, InvalidArgument, WriteUnderLock)  # what C raises
_l2core.set_ext_check(l2_ext_problem)  # the one rule for a record's extension field
_l2core.set_key_hasher(xxhash.xxh3_64_intdigest)  # (key_hash below, for kv.batch()'s new keys)
_l2core.set_packed(Packed, PACKED)  # (kv.batch() stores a Packed as its payload, in C)
if _l2core.MAX_COUNTER != MAX_COUNTER or not hasattr(_l2core.Core, "put_step") \
        or not hasattr(_l2core.BatchOps, "_put_ext") \
        or not hasattr(_l2core, "task_records") \
        or "chainmap" in (_l2core.step_metadata.__doc__ or ""):  # a stale build of the kernel
    raise ImportError("kvcomm._l2core was built from other sources; rebuild it (pip install -e .)")

NEW_DOT = (1 << 64) - 1  # a versioned put with this counter: a fresh local dot over the vector

# statuses of the C kernel's writes when they changed nothing
ST_SLOT_FULL = _l2core.ST_SLOT_FULL
ST_TOO_LARGE = _l2core.ST_TOO_LARGE
ST_DIRTY_FULL = _l2core.ST_DIRTY_FULL
ST_LOOK = _l2core.ST_LOOK
ST_FULL = _l2core.ST_FULL
ST_CONFLICT = _l2core.ST_CONFLICT  # (a batch's expects: writes.ExpectFailed)

DEFAULT_LOCK_TIMEOUT = 10.0

# header words used on hot paths, bound once
_H_STATE, _H_BUSY, _H_FEED_HEAD = H["STATE"], H["BUSY"], H["FEED_HEAD"]
_H_RELEASED, _H_DEFERRED = H["RELEASED"], H["DEFERRED"]
_S_FLAGS = SLOT["FLAGS"]


if platform.machine().lower() not in ("x86_64", "amd64"):  # pragma: no cover
    raise ImportError(
        "kvcomm's L2 relies on x86-64 store ordering for its lock-free readers; "
        f"this machine is {platform.machine()}"
    )



def key_hash(key_b: bytes) -> int:
    """Stable across processes and hosts (never Python's salted hash); never 0."""
    return xxhash.xxh3_64_intdigest(key_b) | 1


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
    deadline: float  # the record's expiry, epoch seconds (0.0: none; kvcomm.core.expiry)


_new_record = tuple.__new__


class SegmentCore:
    """The mapped segment: opening, the writer lock, lock-free reads, repair, closing.

    The other nouns (writes, pins, feed, hot keys, checker, the daemon's state) are mixins
    over this class, combined in :class:`kvcomm.tiers.l2.L2Segment`.
    """

    def __init__(self, name: str, *, create_layout: Layout | None, host_id: str,
                 permissions: int = 0o600, attach_timeout: float = 2.0,
                 directory: str = SHM_DIR, lock_timeout: float = DEFAULT_LOCK_TIMEOUT) -> None:
        self.name = name
        self.path = segment_path(name, directory)
        check_side_name(name, self.path)
        self.directory = directory
        self.lock_timeout = float(lock_timeout)
        self._pid = os.getpid()
        self._next_dead_sweep = 0.0
        self._core: Any = None
        self._atom: Any = None
        # (the user's signals wait while a segment is created: a Ctrl-C then comes once it
        # is whole and linked, or gone, never between two steps; KVCOMM's own threads
        # block them too, so the kernel keeps them pending for this one)
        with user_signals_blocked():
            fd, tmp = self._open_file(create_layout, permissions)
            while tmp is not None:
                assert create_layout is not None
                if self._create(fd, tmp, create_layout, host_id):
                    break
                # another creator's segment went into place first: attach to that one
                fd, tmp = self._open_file(create_layout, permissions)
        created = tmp is not None
        if not created:
            self._attach(fd, attach_timeout)
        hb = bytes(self._buf[HOST_ID_AT + 1 : HOST_ID_AT + 1 + min(64, self._buf[HOST_ID_AT])])
        self.host_id = hb.decode("utf-8", "replace")
        self.created = created
        _LIVE.add(self)

    def _attach(self, fd: int, attach_timeout: float) -> None:
        """Map the existing segment open at ``fd`` (closed here) and read its layout."""
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_SIZE:
                size = self._wait_for_size(fd, attach_timeout)
            if size % 4096:
                raise SegmentError(f"{self.path} is {size} bytes, not a whole number of pages: "
                                   "not a KVCOMM segment (foreign or truncated); not touching it")
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._buf = memoryview(self._mm)
            self._q = self._buf.cast("Q")
            self._ro = self._buf.toreadonly()
            try:
                self._wait_for_magic(attach_timeout)
                self.layout = Layout.from_header(self._q, size)
                self._bind_layout(fd)
            except BaseException:
                self.close()
                raise
        finally:
            os.close(fd)  # (the Core keeps a duplicate: writers reserve memory through it)

    def _create(self, fd: int, tmp: str, lay: Layout, host_id: str) -> bool:
        """Build the segment in the temporary file ``tmp`` (open at ``fd``, locked, sized:
        :meth:`_new_file`) and link it into place once whole, so that a creator killed or
        interrupted at any instruction never leaves a half-made segment at the path (only
        its temporary file, which the next creator removes). link(2), unlike rename(2),
        never replaces: of creators racing, exactly one installs its segment. Returns
        False when another's went in first (this one is dropped). Closes ``fd`` and
        removes ``tmp`` in every case."""
        installed = False
        try:
            self._mm = mmap.mmap(fd, lay.total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._buf = memoryview(self._mm)
            self._q = self._buf.cast("Q")
            self._ro = self._buf.toreadonly()
            self._initialise(lay, host_id, fd)
            try:
                os.link(tmp, self.path, follow_symlinks=False)
                installed = True
            except FileExistsError:
                pass
            except OSError as exc:
                raise _cannot_create(self.path, exc) from None
        finally:
            try:
                if not installed:
                    self.close()
            finally:
                os.close(fd)  # (the lock on it goes with it)
                _unlink_quietly(tmp)
        return installed

    def _open_file(self, layout: Layout | None, permissions: int) -> tuple[int, str | None]:
        """``(fd, None)``: the segment's file, open. When there is none and ``layout`` is
        given: ``(fd, temporary path)``, a new file to build it in (:meth:`_new_file`)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            if layout is not None:
                check_new_name(self.name)
                return self._new_file(layout, permissions)
            raise SegmentError(f"no L2 segment for namespace {self.name!r} on this host: "
                               f"kvcomm.open({self.name!r}) creates it (nothing opened it "
                               "here since the machine started or since its purge)") from None
        except IsADirectoryError:  # (a namespace's own directory, by its name: say so)
            check_new_name(self.name)
            raise SegmentError(f"{self.path} is a directory, not a segment; remove it") from None
        except OSError as exc:
            raise _cannot_create(self.path, exc, "open") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SegmentError(f"{self.path} is not a regular file; remove it")
            check_owner(self.path, st, permissions)
        except BaseException:
            os.close(fd)
            raise
        return fd, None

    def _new_file(self, layout: Layout, permissions: int) -> tuple[int, str]:
        """A new file of the segment's size under a temporary name, locked while this
        process builds the segment in it; the temporary files of dead creators go."""
        remove_dead_temps(self.path)
        try:
            tmp, fd = create_temp(self.path, permissions)
        except OSError as exc:
            raise _cannot_create(self.path, exc) from None
        try:
            os.ftruncate(fd, layout.total)  # sparse: the slots and heap as they fill
            for off, n in layout.up_front():  # the rest reserved now, not on SIGBUS
                os.posix_fallocate(fd, off, n)
        except BaseException as exc:  # (KeyboardInterrupt too: nothing is left behind)
            os.close(fd)
            _unlink_quietly(tmp)
            if isinstance(exc, OSError):
                raise SegmentError(self._no_room(sum(n for _, n in layout.up_front()),
                                                 exc)) from None
            raise
        return fd, tmp

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
        if not is_segment_magic(magic):
            raise SegmentError(f"{self.path} is not a KVCOMM segment (foreign file); not touching it")
        if magic != MAGIC or layout != LAYOUT_VERSION:
            raise SegmentError(self._other_layout(layout))

    def _other_layout(self, layout: int) -> str:
        """What to do with a segment of another layout: never a purge that drops writes
        L3 has not got (see tiers/shm/oldlayout.py)."""
        head = f"{self.path} has layout version {layout}, this kvcomm uses {LAYOUT_VERSION}; "
        try:
            old = unflushed(self.path, 0o7777)  # (its owner was checked when it was opened)
        except SegmentError as exc:
            return head + (f"it cannot be read for unflushed writes ({exc}); stop its users "
                           f"and run `kvcomm purge --name {self.name} --force` to discard it")
        if old is not None and old[2]:
            return head + (f"it holds {len(old[2])} writes not yet in L3: stop its users and "
                           f"run `kvcomm migrate --name {self.name}` to carry them into a new "
                           "segment (the node daemon then delivers them)")
        return head + f"stop its users and run `kvcomm purge --name {self.name}`"

    def _initialise(self, lay: Layout, host_id: str, fd: int) -> None:
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
        self._mark_reserved(lay)
        self._bind_layout(fd)
        self._core.init_lock()
        self._core.init_heap()
        self._atom.store(H["MAGIC"] * 8, MAGIC)  # last: attachers wait for it

    def _mark_reserved(self, lay: Layout) -> None:
        """Set the reservation map's bits of what the creator reserved (layout.py,
        "Reservation map"); writers reserve the rest as they first use it."""
        q, base = self._q, lay.resv_off // 8
        for off, n in lay.up_front():
            first, end = off // RESV_PAGE, (off + n + RESV_PAGE - 1) // RESV_PAGE
            for w in range(first >> 6, (end + 63) >> 6):
                lo, hi = max(first, w << 6), min(end, (w + 1) << 6)
                if lo < hi:
                    q[base + w] |= ((1 << (hi - lo)) - 1) << (lo & 63)

    def page_reserved(self, off: int) -> bool:
        """Whether byte ``off``'s page is reserved: one that is not must not be read (a
        read through the mapping would allocate it; a slot there was never written)."""
        p = off // RESV_PAGE
        return bool(self._q[(self.layout.resv_off >> 3) + (p >> 6)] >> (p & 63) & 1)

    def reserved_bytes(self) -> int:
        """Bytes of memory the segment's file holds (its allocated blocks, ``st_blocks``):
        what the namespace has used so far, never more than its size."""
        try:
            return os.stat(self.path).st_blocks * 512
        except OSError:  # (purged under us): what the reservation map counts
            return int(self._core.reserved()) if self._core is not None else 0

    def _bind_layout(self, fd: int) -> None:
        """Bind the layout's regions and the C kernel (which keeps its own duplicate of
        ``fd``, the segment's file: writers reserve memory through it)."""
        lay = self.layout
        self._meta = self._buf[lay.meta_off : lay.meta_off + (lay.data_size >> MIN_ORDER)]
        self._max_record = 1 << lay.top_order
        sk = CountMinSketch.size_for(lay.sketch_width, SKETCH_DEPTH)
        self.sketch = CountMinSketch(lay.sketch_width, SKETCH_DEPTH,
                                     buffer=self._buf[lay.hot_off : lay.hot_off + sk])
        self.topk = TopK(lay.topk, lay.max_key,
                         buffer=self._buf[lay.hot_off + sk : lay.hot_off + sk
                                          + TopK.size_for(lay.topk, lay.max_key)])
        self._core = _l2core.Core(self._mm, fd)
        self._atom = self._core  # the same object gives the atomics on any header word

    def _lock(self, timeout: float | None = None) -> None:
        """Take the writer lock within ``timeout`` seconds (default ``lock_timeout``; 0: only
        if free now) and make the segment fit to use (purged? repair? sweep?). Raises
        Unavailable when it stays held.

        The caller's ``finally`` must call ``self._core.unlock()``, which releases the lock
        only if this thread holds it: call ``_lock`` inside the ``try``.
        """
        if self._core.lock(self.lock_timeout if timeout is None else timeout):
            self._after_lock()

    def _try_lock(self) -> bool:
        """Take the writer lock if it is free now, as :meth:`_lock`; False (nothing raised,
        nothing counted in kvcomm_errors_total) when another thread holds it. The caller's
        ``finally`` must call ``self._core.unlock()``."""
        looked = self._core.try_lock()
        if looked < 0:
            return False
        if looked:
            self._after_lock()
        return True

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

    def read(self, key_b: bytes, h: int, zero_copy: int = 1 << 62) -> Record | None:
        """A consistent copy of the record for ``key_b`` (tombstones included: tag 0), or
        None when absent. Lock-free unless a writer is stuck or the segment needs repair.

        An array value of ``zero_copy`` bytes or more is not copied: ``value`` is None and
        the caller takes a view with :meth:`pin`. Raises SegmentError (purged; corrupt and
        not repairable), Unavailable (a writer stopped mid-publish for over the lock timeout).
        """
        r = self._read_or_repair(lambda core: core.read(key_b, h, zero_copy))
        return None if r is None else _new_record(Record, r)

    def version(self, key_b: bytes, h: int) -> tuple[int, int, int, int, int, bytes, int, bytes] | None:
        """``(word, seq, tag, counter, hlc, vvx, flags, ext)`` of ``key_b``'s record, or None.

        ``ext`` is the record's extension field (``b""``: none): an encoded msgpack map that
        a write may attach (the 6th element of a put op, the 9th of a versioned one); L2
        checks it once, when it is written (:mod:`kvcomm.core.ext`: what L3's readers
        accept), and stores it byte for byte. Lock-free, as :meth:`read`."""
        r = self._read_or_repair(lambda core: core.version(key_b, h))
        return None if r is None else tuple(r)

    def _closed(self, what: str) -> SegmentError:
        """The error of a call under way (``what``) when another thread closed the
        segment: its Core gone meanwhile, nothing more done through it."""
        return SegmentError(f"namespace {self.name!r} was closed in this process while "
                            f"{what}: open it again")

    def _read_or_repair(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(core)`` (a lock-free read of the Core), seeing through damage and stuck
        writers; SegmentError when another thread closed the segment meanwhile.

        A corrupt record: the segment is repaired (under the lock) and read once more. A
        slot that stays odd: its writer is slow, stopped, or died mid-publish — so take the
        lock (which recovers from a death, and waits for a slow writer, at most
        ``lock_timeout``: Unavailable for a stopped one). Under the lock no writer
        publishes: a slot still odd then is damage, repaired there.
        """
        core = self._core
        if core is None:
            raise self._closed("this read was under way")
        try:
            r = fn(core)
        except SegmentError:
            if self._core is None or self._q[_H_STATE] != STATE_OK:
                raise  # (closed by another thread meanwhile, or purged: what it says)
            self.repair()
            return fn(core)
        if type(r) is not int:
            return r
        try:
            self._lock()
            r = fn(core)
            if type(r) is int:
                core.set_busy(1)
                self._recover()
                r = fn(core)
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

    def _sweep_dead(self) -> None:
        """Under the lock: clear the pin entries of processes that are gone (whatever
        their pid or PID namespace: see the process table in tiers/shm/layout.py) and free
        the parked blocks they held; next time in a second."""
        self._core.sweep(time.time_ns() // 1_000_000 + 1000)

    def _recover(self) -> None:
        """Under the lock, with BUSY raised: make every structure whole (see the C kernel's
        ``recover``). Pins of live processes are kept."""
        self._core.recover()

    def is_dirty(self, word: int) -> bool:
        try:
            return bool(self._q[word + _S_FLAGS] & FLAG_DIRTY)
        except IndexError:
            return False

    def keys(self, tombstones: bool = False) -> Iterator[str]:
        """Every live key present now, and with ``tombstones`` every deleted one too (a
        scan; concurrent writes may or may not show)."""
        for kb in self._core.scan(2 if tombstones else 0):
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


_LIVE: WeakRegistry[SegmentCore] = WeakRegistry()  # (never a WeakSet: _weak.py)


def _after_fork_in_child() -> None:
    for seg in list(_LIVE):
        seg._after_fork()



os.register_at_fork(after_in_child=_after_fork_in_child)


def _cannot_create(path: str, exc: OSError, what: str = "create") -> SegmentError:
    """The error of a segment file that could not be made (or opened), naming the config
    key whose directory it is (cache.l2_dir) and, when that is no directory, what to do."""
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        return SegmentError(f"cannot {what} {path}: cache.l2_dir {directory!r} is not a "
                            "directory; create it (a tmpfs, as /dev/shm is) or set "
                            "cache.l2_dir to one")
    return SegmentError(f"cannot {what} {path}: {exc.strerror} (in cache.l2_dir {directory!r})")
