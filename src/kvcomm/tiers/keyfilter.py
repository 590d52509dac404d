"""The host's filter of existing keys: a two-generation Bloom filter in shared memory.

The node daemon is its only writer: it fills both generations from a scan of L3 when it
starts, adds every key it sees in the change feeds and in local writes, and rotates
(clears the older generation, refills it from a fresh scan, swaps) when the filter has
seen its capacity of adds or ``rebuild_every`` seconds have passed — so deleted keys
age out while the other generation keeps answering for the keys that exist. Agents
read it lock-free on an L2 miss: "not in the filter" means the key does not exist in
the cluster (up to the feed's delay), so the read never leaves the host.

File ``/dev/shm/kvcomm.<namespace>.keys``: a 128-byte header of little-endian 64-bit
words — magic, layout version, capacity, false-positive rate (the float's bits, so a
reader derives exactly the writer's geometry), ``current`` (0/1), ``ready``, ``beat``
(the daemon's heartbeat, wall-clock ms), ``retired`` and ``learned`` — then the ring of
learned keys (:data:`RING` words), then the two generations' bits.

The keys learned
----------------
Every :meth:`KeyFilter.add` (a key seen in a feed, a local write, a scan; not a
rotation's refill, which only re-adds keys) also writes the key's 64-bit digest into the
ring, at ``learned % RING``, then bumps ``learned``: the host-wide count of keys learned.
An agent that noted a key "absent" (:mod:`kvcomm.core.negative`) stamps the note with
``learned``; a later read of the note first looks at the ring's entries since its stamp
(:meth:`KeyFilter.learned_since`): a key the daemon learned of since is asked of L3
again, at once, so no process on the host answers "absent" from its cache for a key its
daemon has learned of. The count starts at a random 62-bit value, so that a stamp taken
from another file (a restarted daemon's) reads as too old for the ring. A stamp the ring
no longer covers (more than :data:`RING` keys learned since) is judged by the filter
instead (:meth:`kvcomm._client.cluster_read.ClusterReads._still_absent`).

When to trust it
----------------
"Absent" answers are only as good as the daemon that feeds the filter: a dead daemon
no longer adds the keys other hosts create. So a reader trusts the filter
(:attr:`KeyFilter.ready`) only while it is built (``ready``), not ``retired``, and its
heartbeat, refreshed by every daemon step, is younger than :data:`STALE_MS`; otherwise
it goes to L3 and reopens the file now and then.

Rebuilding without SIGBUS
-------------------------
A file is never truncated or resized in place (a reader mapped at the old size would
die of SIGBUS touching the lost pages). A daemon that starts builds a new file under a
temporary name (``O_CREAT|O_EXCL``, mode ``cache.l2_permissions``, space reserved with
``posix_fallocate``, locked while it is built: see :func:`kvcomm.tiers.shm.files.create_temp`),
marks the old file ``retired`` in its header, then ``rename()``s the new one into place.
A daemon killed or interrupted meanwhile leaves no file at the path; the next one (or a
purge) removes its temporary file. Readers still mapping the old inode keep valid memory, see
``retired`` (or a stale heartbeat) and reopen the path.

Ownership
---------
A filter file not owned by this user, or (for readers) whose mode grants more than
``cache.l2_permissions``, is refused with :class:`~kvcomm.errors.SegmentError`: another
local user could otherwise make this host's agents answer "absent" for keys that exist.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import stat
import struct
import time

from xxhash import xxh3_64_digest, xxh3_128_digest

from .._l2core import bloom_has
from ..core.bloom import MAX_HASHES, BloomFilter, optimal_params
from ..errors import InvalidArgument, SegmentError
from .shm.files import SHM_DIR, _unlink_quietly, create_temp, filter_path, remove_dead_temps

MAGIC = int.from_bytes(b"KVCKEYS2", "little")
LAYOUT = 3
_HDR = 128
H_MAGIC, H_LAYOUT, H_CAP, H_FPR, H_CURRENT, H_READY, H_BEAT, H_RETIRED, H_LEARNED = range(9)
RING = 1 << 16  # the learned keys' digests kept (8 bytes each): 512 KiB
_RING_BYTES = RING * 8
STALE_MS = 2000  # a heartbeat older than this: the daemon is gone, trust the filter no more
_OLD_MAGICS = (MAGIC, int.from_bytes(b"KVCKEYS1", "little"))


def _now_ms() -> int:
    # wall clock, as the L2 segment's daemon heartbeat: comparable across processes and
    # PID namespaces on one host
    return time.time_ns() // 1_000_000


def _float_bits(x: float) -> int:
    return int.from_bytes(struct.pack("<d", x), "little")


def _bits_float(w: int) -> float:
    return float(struct.unpack("<d", w.to_bytes(8, "little"))[0])


def _check_file(fd: int, path: str, permissions: int | None) -> os.stat_result:
    """Refuse a file that is not a regular file of this user's, or (if ``permissions``
    is given) whose mode grants more than ``permissions``. Raises SegmentError."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise SegmentError(f"{path} is not a regular file; remove it (it is not KVCOMM's)")
    mode = stat.S_IMODE(st.st_mode)
    euid = os.geteuid()
    if st.st_uid != euid or (permissions is not None and mode & ~permissions):
        allowed = "" if permissions is None else f" with at most mode {permissions:#o}"
        raise SegmentError(
            f"key filter {path} is owned by uid {st.st_uid} with mode {mode:#o}; KVCOMM only "
            f"uses one owned by this user (uid {euid}){allowed} (cache.l2_permissions): "
            f"another user may be squatting the namespace. Remove the file if it is stale "
            f"(rm {path}) or choose another node.namespace")
    return st


class KeyFilter:
    """A mapped filter file: :meth:`create` (the daemon) or :meth:`open_reader` (agents)."""

    def __init__(self, path: str, mm: mmap.mmap, capacity: int, fpr: float) -> None:
        self.path, self._mm = path, mm
        self.capacity, self.fpr = capacity, fpr
        gen_bytes = optimal_params(capacity, fpr)[0] // 8
        self._q = memoryview(mm)[:_HDR].cast("Q")
        view = memoryview(mm)
        self._ring = view[_HDR:_HDR + _RING_BYTES].cast("Q")
        at = _HDR + _RING_BYTES
        self.gens = [BloomFilter(capacity, fpr,
                                 buffer=view[at + i * gen_bytes:at + (i + 1) * gen_bytes])
                     for i in range(2)]
        # the agents' test runs in C over both generations at once (same positions)
        self._both = view[at:at + 2 * gen_bytes]
        self._bits, self._k = self.gens[0].bits, self.gens[0].k
        view.release()

    @staticmethod
    def size_for(capacity: int, fpr: float) -> int:
        """The file size of a filter of ``capacity`` keys at rate ``fpr``."""
        return _HDR + _RING_BYTES + 2 * (optimal_params(capacity, fpr)[0] // 8)

    # ------------------------------------------------------------------ the daemon's side

    @classmethod
    def create(cls, namespace: str, capacity: int, fpr: float, *, permissions: int = 0o600,
               directory: str = SHM_DIR) -> KeyFilter:
        """A new, empty, not-yet-ready filter in place of any old one (which is retired).

        Raises InvalidArgument when ``capacity`` and ``fpr`` need more than MAX_HASHES hash
        functions (the config refuses them: cache.bloom_fpr), SegmentError when the old
        file belongs to another user, or when /dev/shm has no room for the new one
        (nothing is left behind then).
        """
        path = filter_path(namespace, directory)
        k = optimal_params(capacity, fpr)[1]
        if k > MAX_HASHES:
            raise InvalidArgument(f"a key filter of {capacity} keys at rate {fpr!r} needs {k} "
                                  f"hash functions, more than {MAX_HASHES}: raise "
                                  "cache.bloom_fpr or cache.bloom_capacity")
        size = cls.size_for(capacity, fpr)
        remove_dead_temps(path)
        try:
            tmp, fd = create_temp(path, permissions)
        except OSError as exc:
            raise SegmentError(f"cannot create the key filter {path}: {exc.strerror}") from None
        kf: KeyFilter | None = None
        try:  # (until it is renamed into place, its fd stays open: the lock says it is ours)
            try:
                os.posix_fallocate(fd, 0, size)  # no sparse file: a full /dev/shm fails here
            except OSError as exc:
                free = _free_bytes(directory)
                raise SegmentError(
                    f"cannot reserve {size} bytes for the key filter {path}: {exc.strerror}; "
                    f"{free} bytes free in {directory}. Lower cache.bloom_capacity or free "
                    "space there") from None
            kf = cls(path, mmap.mmap(fd, size), capacity, fpr)
            q = kf._q
            q[H_READY] = 0
            q[H_RETIRED] = 0
            q[H_CURRENT] = 0
            q[H_CAP] = capacity
            q[H_FPR] = _float_bits(fpr)
            q[H_LAYOUT] = LAYOUT
            q[H_BEAT] = _now_ms()
            q[H_LEARNED] = secrets.randbits(62)  # (a stamp from another file: too old to check)
            q[H_MAGIC] = MAGIC
            _retire(path)
            os.rename(tmp, path)
        except BaseException:  # (KeyboardInterrupt too: nothing is left behind)
            try:
                if kf is not None:
                    kf.close()
            finally:
                os.close(fd)
                _unlink_quietly(tmp)
            raise
        os.close(fd)
        assert kf is not None
        return kf

    def add(self, key: bytes) -> None:
        """Add ``key`` to the ring of keys learned, then bump the count (a reader that
        sees the count sees the ring's entry), then to both generations: whoever finds
        the key in the filter finds it learned too."""
        q = self._q
        n = q[H_LEARNED]
        self._ring[n % RING] = int.from_bytes(xxh3_64_digest(key), "little")
        q[H_LEARNED] = (n + 1) & _MASK
        at = self.gens[0].positions(key)  # (the generations share one geometry)
        self.gens[0].add_at(at)
        self.gens[1].add_at(at)

    def set_ready(self, ready: bool) -> None:
        self._q[H_READY] = int(ready)

    def beat(self, now_ms: int | None = None) -> None:
        """The daemon's heartbeat: readers trust the filter for STALE_MS after it."""
        self._q[H_BEAT] = _now_ms() if now_ms is None else now_ms

    def begin_rotation(self) -> BloomFilter:
        """Clear the older generation for a refill; the other keeps answering meanwhile."""
        older = 1 - self._q[H_CURRENT]
        self.gens[older].clear()
        return self.gens[older]

    def end_rotation(self) -> None:
        self._q[H_CURRENT] = 1 - self._q[H_CURRENT]

    @property
    def adds_since_rotation(self) -> int:
        return self.gens[self._q[H_CURRENT]].adds

    # ------------------------------------------------------------------ the agents' side

    @classmethod
    def open_reader(cls, namespace: str, permissions: int = 0o600,
                    directory: str = SHM_DIR) -> KeyFilter | None:
        """The filter the daemon made (read-only mapping, geometry from its header), or
        None when there is none yet or it is not a valid filter file.

        Raises SegmentError when the file belongs to another user or its mode grants more
        than ``permissions``, or when its geometry needs more hash functions than the
        membership test computes (MAX_HASHES: a daemon of another KVCOMM made it).
        """
        path = filter_path(namespace, directory)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise SegmentError(f"{path} is a symbolic link; remove it (KVCOMM never "
                                   "makes one)") from None
            raise SegmentError(f"cannot open the key filter {path}: {exc.strerror}") from None
        try:
            size = _check_file(fd, path, permissions).st_size
            if size < _HDR:
                return None
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        q = memoryview(mm)[:_HDR].cast("Q")
        try:
            magic, layout, cap, fpr = q[H_MAGIC], q[H_LAYOUT], q[H_CAP], _bits_float(q[H_FPR])
        finally:
            q.release()
        if magic != MAGIC or layout != LAYOUT or not 1 <= cap < 1 << 40 or not 0.0 < fpr < 1.0:
            mm.close()
            return None  # an old layout, or not ours: the daemon replaces it
        if cls.size_for(cap, fpr) != size:
            mm.close()
            return None
        k = optimal_params(cap, fpr)[1]
        if k > MAX_HASHES:  # loud: answering "maybe" for ever would hide it
            mm.close()
            raise SegmentError(
                f"the key filter {path} needs {k} hash functions (capacity {cap}, rate {fpr!r}); "
                f"this KVCOMM tests at most {MAX_HASHES}: set cache.bloom_fpr to 1e-12 or more "
                "and restart the node daemon (`kvcomm node`)")
        return cls(path, mm, cap, fpr)

    @property
    def built(self) -> bool:
        """The daemon finished filling it (it may since have died: see :attr:`ready`)."""
        return bool(self._q[H_READY])

    @property
    def retired(self) -> bool:
        """A newer file has replaced this one: reopen the path."""
        return bool(self._q[H_RETIRED])

    def trusted(self, now_ms: int | None = None) -> bool:
        """True while "not in the filter" may be taken for "absent": built, not retired,
        and the daemon's heartbeat is younger than STALE_MS."""
        q = self._q
        if not q[H_READY] or q[H_RETIRED]:
            return False
        now = _now_ms() if now_ms is None else now_ms
        return abs(now - q[H_BEAT]) < STALE_MS  # (abs: a clock set back is no proof of life)

    @property
    def ready(self) -> bool:
        """:meth:`trusted` now: the check an agent makes before answering "absent"."""
        return self.trusted()

    @property
    def learned(self) -> int:
        """The host-wide count of keys the daemon learned (a stamp for
        :meth:`learned_since`)."""
        return self._q[H_LEARNED]

    def learned_since(self, key: bytes, stamp: int) -> bool | None:
        """Whether the daemon learned of ``key`` after the count was ``stamp``: True,
        False, or None when the ring no longer covers ``stamp`` (more than RING keys
        learned since, or a stamp of another file). No round trip: a search of the ring's
        entries since ``stamp`` (an equal 64-bit digest of another key: True, a needless
        L3 read)."""
        q = self._q
        n = q[H_LEARNED]
        span = (n - stamp) & _MASK
        if span == 0:
            return False
        if span > RING:
            return None
        want = xxh3_64_digest(key)
        mm = self._mm
        lo, hi = stamp % RING, n % RING
        found = (_find(mm, want, lo, hi) if lo < hi else
                 _find(mm, want, lo, RING) or _find(mm, want, 0, hi))
        if (q[H_LEARNED] - stamp) & _MASK > RING:  # (the daemon wrote over what was read)
            return None
        return found

    def may_exist(self, key: bytes) -> bool:
        """False only for keys the cluster does not hold (modulo the feed's delay)."""
        return bloom_has(self._both, self._bits, self._k, 2, xxh3_128_digest(key))

    def close(self) -> None:
        self._both.release()
        self._ring.release()
        for g in self.gens:
            g._b.release()
        self._q.release()
        self._mm.close()


_MASK = (1 << 64) - 1


def _find(mm: mmap.mmap, digest: bytes, lo: int, hi: int) -> bool:
    """Whether ring slots [lo, hi) hold ``digest`` (at a slot's start)."""
    start, end = _HDR + 8 * lo, _HDR + 8 * hi
    while (at := mm.find(digest, start, end)) >= 0:
        if (at - _HDR) % 8 == 0:
            return True
        start = at + 1
    return False


def _retire(path: str) -> None:
    """Mark the filter file at ``path`` (if any) retired, so that its readers reopen.

    Only the owner is checked, not the mode: the file is being discarded, never read.
    Raises SegmentError when it belongs to another user.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise SegmentError(f"cannot replace the key filter {path}: {exc.strerror}; remove "
                           "it (rm) if it is stale") from None
    try:
        if _check_file(fd, path, None).st_size < _HDR:
            return
        mm = mmap.mmap(fd, _HDR)
    finally:
        os.close(fd)
    q = memoryview(mm).cast("Q")
    try:
        if q[H_MAGIC] in _OLD_MAGICS:
            q[H_READY] = 0
            if q[H_MAGIC] == MAGIC:
                q[H_RETIRED] = 1
    finally:
        q.release()
        mm.close()


def _free_bytes(directory: str) -> int:
    try:
        st = os.statvfs(directory)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


def remove(namespace: str, directory: str = SHM_DIR) -> None:
    path = filter_path(namespace, directory)
    try:
        _retire(path)
    except SegmentError:
        pass  # another user's file: leave it to them
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    remove_dead_temps(path)
