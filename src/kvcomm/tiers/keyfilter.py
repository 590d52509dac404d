"""The host's filter of existing keys: a two-generation Bloom filter in shared memory.

The node daemon is its only writer: it fills both generations from a scan of L3 when it
starts, adds every key it sees in the change feeds and in local writes, and rotates
(clears the older generation, refills it from a fresh scan, swaps) when the filter has
seen its capacity of adds or ``rebuild_every`` seconds have passed — so deleted keys
age out while the other generation keeps answering for the keys that exist. Agents
read it lock-free on an L2 miss: "not in the filter" means the key does not exist in
the cluster (up to the feed's delay), so the read never leaves the host.

File ``/dev/shm/kvcomm.<namespace>.keys`` (owner-only): a 64-byte header — magic,
layout version, capacity, false-positive rate in parts per billion, ``current`` (0/1),
``ready`` — then the two generations' bits. A reader ignores a filter that is not
``ready`` (being built) and goes to L3.
"""

from __future__ import annotations

import mmap
import os

from ..core.bloom import BloomFilter, optimal_params
from .l2 import SHM_DIR, segment_path

MAGIC = int.from_bytes(b"KVCKEYS1", "little")
_HDR = 64
H_MAGIC, H_LAYOUT, H_CAP, H_FPR, H_CURRENT, H_READY = range(6)


def filter_path(namespace: str) -> str:
    segment_path(namespace)  # validates the name
    return os.path.join(SHM_DIR, f"kvcomm.{namespace}.keys")


class KeyFilter:
    """Open (reader) or create (the daemon) the filter of ``namespace``."""

    def __init__(self, namespace: str, capacity: int, fpr: float, *, create: bool = False,
                 permissions: int = 0o600) -> None:
        bits, _ = optimal_params(capacity, fpr)
        gen_bytes = bits // 8
        size = _HDR + 2 * gen_bytes
        path = filter_path(namespace)
        flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0)
        if create:
            old = os.umask(0)
            try:
                fd = os.open(path, flags | os.O_CREAT, permissions)
            finally:
                os.umask(old)
            os.ftruncate(fd, size)
        else:
            fd = os.open(path, flags)
        try:
            if os.fstat(fd).st_size != size:
                raise ValueError(f"{path} has another size; the daemon rebuilds it")
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._q = memoryview(self._mm)[:_HDR].cast("Q")
        if create:
            self._q[H_READY] = 0
            self._q[H_MAGIC] = MAGIC
            self._q[H_LAYOUT] = 1
            self._q[H_CAP] = capacity
            self._q[H_FPR] = int(fpr * 1e9)
        elif self._q[H_MAGIC] != MAGIC or self._q[H_CAP] != capacity:
            self.close()
            raise ValueError(f"{path} is not a key filter of this configuration")
        self.gens = [BloomFilter(capacity, fpr, buffer=memoryview(self._mm)[_HDR + i * gen_bytes:
                                                                          _HDR + (i + 1) * gen_bytes])
                     for i in range(2)]

    @classmethod
    def open_reader(cls, namespace: str, capacity: int, fpr: float) -> KeyFilter | None:
        """The filter if the daemon has made one of this configuration, else None."""
        try:
            return cls(namespace, capacity, fpr)
        except (OSError, ValueError):
            return None

    @property
    def ready(self) -> bool:
        return bool(self._q[H_READY])

    def may_exist(self, key: bytes) -> bool:
        """False only for keys the cluster does not hold (modulo the feed's delay)."""
        return key in self.gens[0] or key in self.gens[1]

    # ------------------------------------------------------------------ the daemon's side

    def add(self, key: bytes) -> None:
        self.gens[0].add(key)
        self.gens[1].add(key)

    def set_ready(self, ready: bool) -> None:
        self._q[H_READY] = int(ready)

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

    def close(self) -> None:
        for g in getattr(self, "gens", []):
            g._b.release()
        self._q.release()
        self._mm.close()


def remove(namespace: str) -> None:
    try:
        os.unlink(filter_path(namespace))
    except FileNotFoundError:
        pass
