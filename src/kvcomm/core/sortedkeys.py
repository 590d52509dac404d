"""SortedKeys: an ordered set of str keys (a list of sorted blocks), for prefix scans.

Keys are compared as Python strs. For the keys KVCOMM accepts (valid Unicode without
lone surrogates) code-point order is exactly the order of their UTF-8 bytes, the order
etcd and Redis (``ZRANGEBYLEX``) use, so no key is encoded to be compared.

A sorted list of blocks of at most ``2 * BLOCK`` keys (the layout of the well-known
"sorted containers" design): an insert or a removal costs a bisect over the blocks'
last keys plus a shift inside one block, O(log n + BLOCK); a range read costs
O(log n + its length). The memory is the keys themselves plus one pointer each (about
8 bytes a key over the strs), never more.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator

BLOCK = 512


class SortedKeys:
    """An ordered set of strs. Not thread-safe: its owner locks."""

    __slots__ = ("_blocks", "_maxes", "_len")

    def __init__(self, keys: Iterable[str] = ()) -> None:
        ordered = sorted(dict.fromkeys(keys))  # (a set would sort slower: its order is random)
        self._blocks: list[list[str]] = [ordered[i:i + BLOCK]
                                         for i in range(0, len(ordered), BLOCK)]
        self._maxes: list[str] = [b[-1] for b in self._blocks]
        self._len = len(ordered)

    def __len__(self) -> int:
        return self._len

    def __contains__(self, key: str) -> bool:
        i = bisect_left(self._maxes, key)
        if i == len(self._maxes):
            return False
        b = self._blocks[i]
        j = bisect_left(b, key)
        return j < len(b) and b[j] == key

    def add(self, key: str) -> None:
        """Insert ``key`` (nothing happens when it is there already)."""
        maxes = self._maxes
        if not maxes:
            self._blocks.append([key])
            maxes.append(key)
            self._len = 1
            return
        i = bisect_left(maxes, key)
        if i == len(maxes):  # past every key: the last block grows
            i -= 1
            self._blocks[i].append(key)
            maxes[i] = key
            self._len += 1
        else:
            b = self._blocks[i]
            j = bisect_left(b, key)
            if b[j] == key:
                return
            b.insert(j, key)
            self._len += 1
        b = self._blocks[i]
        if len(b) > 2 * BLOCK:  # split: blocks stay between BLOCK/2 and 2 * BLOCK keys
            half = b[BLOCK:]
            del b[BLOCK:]
            self._blocks.insert(i + 1, half)
            maxes[i] = b[-1]
            maxes.insert(i + 1, half[-1])

    def discard(self, key: str) -> None:
        """Remove ``key`` if it is there."""
        maxes = self._maxes
        i = bisect_left(maxes, key)
        if i == len(maxes):
            return
        b = self._blocks[i]
        j = bisect_left(b, key)
        if j == len(b) or b[j] != key:
            return
        del b[j]
        self._len -= 1
        if not b:
            del self._blocks[i]
            del maxes[i]
        elif j == len(b):
            maxes[i] = b[-1]

    def range(self, after: str, prefix: str, limit: int) -> list[str]:
        """At most ``limit`` keys greater than ``after`` and starting with ``prefix``, in
        order (``after`` below ``prefix`` starts at the prefix)."""
        start = max(after, prefix)
        maxes = self._maxes
        i = bisect_right(maxes, start) if start == after else bisect_left(maxes, start)
        out: list[str] = []
        while i < len(maxes) and len(out) < limit:
            b = self._blocks[i]
            j = bisect_right(b, start) if start == after else bisect_left(b, start)
            for k in b[j:j + limit - len(out)]:
                if not k.startswith(prefix):
                    return out
                out.append(k)
            start = b[-1]
            after = start  # (from now on: strictly after the last block's last key)
            i += 1
        return out

    def __iter__(self) -> Iterator[str]:
        for b in self._blocks:
            yield from b

