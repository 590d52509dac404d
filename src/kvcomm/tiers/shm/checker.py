"""The invariant checker: walks every structure its own way, independent of the C kernel."""

from __future__ import annotations

from ...core.expiry import deadline_of
from .layout import FLAG_DIRTY, H_FREE, MIN_ORDER, REC, REC_HEADER, SLOT, SLOT_WORDS, TOMB, H
from .segment import _H_BUSY, SegmentCore


class Checker(SegmentCore):
    """The invariant checker."""

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
        least = 0  # the least deadline (ms) of a clean record: the expiry hint's bound
        for o in (*allocated, *free):
            if not self.page_reserved(o):
                problems.append(f"block {o} is in use but its page was never reserved")
        sbase = lay.slots_off // 8
        for i in range(lay.n_slots):
            w = sbase + i * SLOT_WORDS
            if not (self.page_reserved(w * 8) and self.page_reserved(w * 8 + SLOT_WORDS * 8 - 1)):
                continue  # never written: EMPTY (and not to be read: layout.py)
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
                elif not q[w + SLOT["FLAGS"]] & FLAG_DIRTY:
                    ms = self._deadline_ms(off)
                    if ms and (not least or ms < least):
                        least = ms
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
        nxt = q[H["EXPIRY_NEXT"]]
        if least and not 0 < nxt <= least:
            problems.append(f"the expiry hint {nxt} is past a clean record's deadline {least} "
                            "(the sweep would never reclaim it)")
        if q[H["EXPIRY_CURSOR"]] >= lay.n_slots:
            problems.append("the expiry sweep's cursor is past the slot table")
        return problems

    def _deadline_ms(self, off: int) -> int:
        """The deadline of the record at ``off`` in the hint's ms (0: none), read with
        Python's reader (kvcomm.core.expiry), not the kernel's."""
        q = self._q
        info, lens = q[(off >> 3) + REC["INFO"]], q[(off >> 3) + REC["LENS"]]
        at = off + REC_HEADER + (info & 0xFFFF) + (info >> 32) + (lens & 0xFFFFFFFF)
        d = deadline_of(bytes(self._buf[at:at + (lens >> 32)]))
        if d is None:
            return 0
        return 1 << 62 if d >= 4e15 else max(1, int(d * 1000.0))

