"""A Bloom filter of existing keys: "absent" answered without a cluster round trip.

Why not rbloom or pyprobables (both measured against this in ``bench/bench_core.py``):
the node daemon keeps the host's filter in **shared memory**, where every agent process
checks it lock-free, and neither library can work over a buffer it did not allocate.
Beyond that the needs are few and fixed — stable hashing across processes and hosts
(xxh3-128 split for double hashing, never Python's salted ``hash``), union, a portable
byte form — so the filter is 60 lines over any buffer.

Deletes cannot be removed from a Bloom filter, so the host's filter
(:mod:`kvcomm.tiers.keyfilter`) keeps two of these generations in shared memory: adds go
to both, checks ask either (in C there: the same positions, held to these by a test), and
a rotation clears the older one, refilled from the keys that exist. A filter sized for
``capacity`` keys at rate ``fpr`` holds its rate until it has seen ``capacity`` adds;
:attr:`saturated` says when to rotate.
"""

from __future__ import annotations

import math
import struct

import xxhash

_MAGIC = b"KVBF"
_HDR = struct.Struct("<4sIIQQ")  # magic, k, seed, bits, adds


#: The most hash functions a filter may use: the agents' membership test in C
#: (``bloom_has`` in ``_l2core_c/bloom.c``) computes at most this many positions. A rate
#: below about 2**-64 (fewer for tiny capacities, whose bits round up) needs more.
MAX_HASHES = 64


def optimal_params(capacity: int, fpr: float) -> tuple[int, int]:
    """(bits, hash count) for ``capacity`` keys at false-positive rate ``fpr``."""
    if capacity < 1 or not 0.0 < fpr < 1.0:
        raise ValueError("capacity must be >= 1 and 0 < fpr < 1")
    bits = math.ceil(-capacity * math.log(fpr) / (math.log(2) ** 2))
    bits = (bits + 63) // 64 * 64
    k = max(1, round(bits / capacity * math.log(2)))
    return bits, k


class BloomFilter:
    """Bits in ``buffer`` (a bytearray by default; shared memory for the host filter)."""

    def __init__(self, capacity: int, fpr: float = 0.001, *,
                 buffer: bytearray | memoryview | None = None, seed: int = 0) -> None:
        self.capacity, self.fpr, self.seed = capacity, fpr, seed
        self.bits, self.k = optimal_params(capacity, fpr)
        nbytes = self.bits // 8
        buf = memoryview(buffer if buffer is not None else bytearray(nbytes))
        if buf.nbytes < nbytes:
            raise ValueError(f"buffer of {buf.nbytes} bytes, filter needs {nbytes}")
        self._b = buf[:nbytes]
        self.adds = 0

    @property
    def nbytes(self) -> int:
        return self.bits // 8

    def _positions(self, key: bytes) -> list[int]:
        h = xxhash.xxh3_128_intdigest(key, self.seed)
        h1, h2 = h & 0xFFFFFFFFFFFFFFFF, (h >> 64) | 1
        m = self.bits
        return [(h1 + i * h2) % m for i in range(self.k)]

    def add(self, key: bytes) -> None:
        self.add_at(self._positions(key))

    def positions(self, key: bytes) -> list[int]:
        """The bits ``key`` sets (for :meth:`add_at` on filters of the same geometry)."""
        return self._positions(key)

    def add_at(self, positions: list[int]) -> None:
        """Add the key whose :meth:`positions` (in a filter of this geometry) these are."""
        b = self._b
        for p in positions:
            b[p >> 3] |= 1 << (p & 7)
        self.adds += 1

    def __contains__(self, key: bytes) -> bool:
        b = self._b
        return all(b[p >> 3] & (1 << (p & 7)) for p in self._positions(key))

    @property
    def saturated(self) -> bool:
        return self.adds >= self.capacity

    def union(self, other: BloomFilter) -> None:
        """Add every key of ``other`` (same capacity, rate and seed) into this filter."""
        if (other.bits, other.k, other.seed) != (self.bits, self.k, self.seed):
            raise ValueError("only filters of the same size, hash count and seed can be merged")
        merged = int.from_bytes(self._b, "little") | int.from_bytes(other._b, "little")
        self._b[:] = merged.to_bytes(self.nbytes, "little")
        self.adds += other.adds

    def clear(self) -> None:
        self._b[:] = bytes(self.nbytes)
        self.adds = 0

    def to_bytes(self) -> bytes:
        return _HDR.pack(_MAGIC, self.k, self.seed, self.bits, self.adds) + bytes(self._b)

    @classmethod
    def from_bytes(cls, data: bytes, capacity: int, fpr: float = 0.001) -> BloomFilter:
        """Rebuild a filter written by :meth:`to_bytes`. Raises ValueError if it does not fit."""
        if len(data) < _HDR.size:
            raise ValueError("not a serialised Bloom filter")
        magic, k, seed, bits, adds = _HDR.unpack_from(data)
        f = cls(capacity, fpr, seed=seed)
        if magic != _MAGIC or (bits, k) != (f.bits, f.k) or len(data) != _HDR.size + bits // 8:
            raise ValueError("serialised Bloom filter does not match capacity/fpr")
        f._b[:] = data[_HDR.size :]
        f.adds = adds
        return f
