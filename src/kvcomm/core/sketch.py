"""Hot keys: a Count-Min Sketch with conservative update and aging, and a top-k list.

Both live in a buffer the caller provides — a ``bytearray`` in tests, a region of the L2
segment for the host-wide tracker — so the same code counts for one process or a whole
host. Nothing here locks, sleeps or reads a clock; the host-wide caller serialises
writers with the L2 lock.

* **Count-Min Sketch** (Cormode & Muthukrishnan): ``depth`` rows of ``width`` uint32
  counters; a key's estimate is the minimum of its ``depth`` counters, never below its
  true count. **Conservative update** raises only the counters that are below the new
  estimate, which cuts the overestimate of cold keys sharply. **Aging** (as TinyLFU):
  after ``reset_every`` additions every counter is halved, so yesterday's hot keys fade.
  Hashing is xxh3-128, split into two 64-bit halves for double hashing: stable across
  processes and hosts, never Python's salted ``hash``.
* **Top-k**: a fixed table of (estimate, key) slots; a key enters when its estimate beats
  the smallest entry. Heavy hitters are found without storing every key.

Buffer layout: ``[additions u64][reserved u64][counters u32 × depth × width]`` then, for
:class:`TopK`, ``k`` slots of ``[estimate u64][key length u16][pad 6][key bytes]``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator

import xxhash

_HEADER = 16
_MAX32 = 0xFFFFFFFF


class CountMinSketch:
    """``depth`` × ``width`` counters in ``buffer`` (zeroed on first use by the caller)."""

    def __init__(self, width: int, depth: int = 4, buffer: bytearray | memoryview | None = None,
                 reset_every: int | None = None, seed: int = 0) -> None:
        if width < 8 or not 1 <= depth <= 16:
            raise ValueError("width must be >= 8 and depth in 1..16")
        need = self.size_for(width, depth)
        buf = memoryview(buffer if buffer is not None else bytearray(need))
        if buf.nbytes < need:
            raise ValueError(f"buffer of {buf.nbytes} bytes, sketch needs {need}")
        self.width, self.depth, self.seed = width, depth, seed
        self.reset_every = reset_every if reset_every is not None else 10 * width
        self._hdr = buf[:_HEADER].cast("Q")
        self._c = buf[_HEADER:need].cast("I")

    @staticmethod
    def size_for(width: int, depth: int) -> int:
        return _HEADER + 4 * width * depth

    @classmethod
    def for_budget(cls, nbytes: int, depth: int = 4, **kw: object) -> CountMinSketch:
        """The widest sketch that fits in ``nbytes``."""
        return cls(max(8, (nbytes - _HEADER) // (4 * depth)), depth, **kw)  # type: ignore[arg-type]

    def _cells(self, key: bytes) -> list[int]:
        h = xxhash.xxh3_128_intdigest(key, self.seed)
        w = self.width  # (row i's cell: (h1 + i * h2) % w, in small ints)
        h1, h2 = (h & 0xFFFFFFFFFFFFFFFF) % w, ((h >> 64) | 1) % w
        return [i * w + (h1 + i * h2) % w for i in range(self.depth)]

    def add(self, key: bytes, n: int = 1) -> int:
        """Count ``n`` more accesses of ``key`` (conservative update); returns its estimate."""
        return self._count(key, n)[0]

    def add_many(self, counts: Iterable[tuple[bytes, int]],
                 on_halve: Callable[[], None] | None = None) -> list[tuple[bytes, int]]:
        """:meth:`add` of each ``(key, n)`` in turn (a process's buffered reads, under the
        host's lock: one call, not one per key). Returns the keys' estimates, each aged
        with every halving that came after its add, its own included (as the counters
        were); ``on_halve()`` runs at each halving (the caller's top-k ages with it)."""
        out: list[tuple[bytes, int, int]] = []  # (key, estimate, halvings before its add)
        halvings = 0
        for key, n in counts:
            est, halved = self._count(key, n)
            out.append((key, est, halvings))
            if halved:
                halvings += 1
                if on_halve is not None:
                    on_halve()
        return [(k, e >> (halvings - h)) for k, e, h in out]

    def _count(self, key: bytes, n: int) -> tuple[int, bool]:
        """(estimate before any halving, whether this add halved the sketch)."""
        c = self._c
        cells = self._cells(key)
        est = min([c[j] for j in cells]) + n
        if est > _MAX32:
            est = _MAX32
        for j in cells:
            if c[j] < est:
                c[j] = est
        hdr = self._hdr
        total = hdr[0] + n  # (in shared memory the word may hold anything: never overflow)
        if total >= self.reset_every:
            hdr[0] = min(total, self.reset_every)
            self.halve()
            return est, True
        hdr[0] = total
        return est, False

    def estimate(self, key: bytes) -> int:
        """Never below the true count since the last halving (halved with it)."""
        c = self._c
        return min(c[j] for j in self._cells(key))

    def halve(self) -> None:
        """Age every counter by half (and the addition count with them)."""
        c = self._c
        try:
            import numpy as np

            arr = np.frombuffer(c, dtype=np.uint32)
            np.right_shift(arr, 1, out=arr)
        except ImportError:  # pragma: no cover - numpy is optional
            for i in range(len(c)):
                c[i] >>= 1
        self._hdr[0] //= 2

    @property
    def additions(self) -> int:
        return int(self._hdr[0])

    @property
    def nbytes(self) -> int:
        return self.size_for(self.width, self.depth)


class TopK:
    """The ``k`` keys with the highest estimates offered so far, in ``buffer``."""

    def __init__(self, k: int, max_key: int, buffer: bytearray | memoryview | None = None) -> None:
        if k < 1 or max_key < 1:
            raise ValueError("k and max_key must be positive")
        self.k, self.max_key = k, max_key
        self.slot = 16 + (max_key + 7) // 8 * 8
        need = self.size_for(k, max_key)
        buf = memoryview(buffer if buffer is not None else bytearray(need))
        if buf.nbytes < need:
            raise ValueError(f"buffer of {buf.nbytes} bytes, top-k needs {need}")
        self._buf = buf[:need]
        self._q = self._buf.cast("Q")

    @staticmethod
    def size_for(k: int, max_key: int) -> int:
        return k * (16 + (max_key + 7) // 8 * 8)

    def _key_at(self, i: int) -> bytes:
        base = i * self.slot
        n = self._q[base // 8 + 1] & 0xFFFF
        return bytes(self._buf[base + 16 : base + 16 + min(n, self.max_key)])

    def offer(self, key: bytes, estimate: int) -> None:
        """Record ``key`` at ``estimate`` if it is (or beats the least of) the top k."""
        if len(key) > self.max_key or estimate <= 0:
            return
        q = self._q
        words = self.slot // 8
        low_i, low = -1, None
        for i in range(self.k):
            est = q[i * words]
            if est and self._key_at(i) == key:
                if estimate > est:
                    q[i * words] = estimate
                return
            if low is None or est < low:
                low_i, low = i, est
        if low is not None and estimate > low:
            base = low_i * self.slot
            self._buf[base + 16 : base + 16 + len(key)] = key
            q[base // 8 + 1] = len(key)
            q[base // 8] = estimate

    def offer_many(self, offers: list[tuple[bytes, int]]) -> None:
        """:meth:`offer` for many keys, reading the table once (what a flush uses): the
        victim found in a heap, not by a scan of the k slots per offer (4,096 offers to a
        full table of 64 took 51 ms, under the host's writer lock)."""
        words = self.slot // 8
        q = self._q
        table: dict[bytes, int] = {}  # key -> slot
        free: list[int] = []  # empty slots, the last one first (offer takes the first)
        for i in range(self.k):
            if q[i * words]:
                table[self._key_at(i)] = i
            else:
                free.append(i)
        free.reverse()
        # (estimate, slot) of every held slot: the victim offer picks is the least
        # estimate, the first slot among equals (another tie-break would keep other keys
        # than offer does). A slot's estimate only grows here: an entry whose estimate is
        # no longer the slot's is stale, dropped when it comes up.
        low = [(q[i * words], i) for i in table.values()]
        heapq.heapify(low)
        for key, est in offers:
            if len(key) > self.max_key or est <= 0:
                continue
            held = table.get(key)
            if held is not None:
                if est > q[held * words]:
                    q[held * words] = est
                    heapq.heappush(low, (est, held))
                continue
            if free:
                i = free.pop()
            else:
                while low[0][0] != q[low[0][1] * words]:
                    heapq.heappop(low)
                least, i = low[0]
                if est <= least:
                    continue
                heapq.heappop(low)
                del table[self._key_at(i)]
            base = i * self.slot
            self._buf[base + 16 : base + 16 + len(key)] = key
            q[base // 8 + 1] = len(key)
            q[base // 8] = est
            table[key] = i
            heapq.heappush(low, (est, i))

    def items(self) -> Iterator[tuple[bytes, int]]:
        words = self.slot // 8
        for i in range(self.k):
            est = self._q[i * words]
            if est:
                yield self._key_at(i), int(est)

    def top(self, n: int) -> list[tuple[bytes, int]]:
        return sorted(self.items(), key=lambda kv: (-kv[1], kv[0]))[:n]

    def halve(self) -> None:
        words = self.slot // 8
        for i in range(self.k):
            self._q[i * words] //= 2
