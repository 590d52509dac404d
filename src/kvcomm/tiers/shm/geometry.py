"""The segment's geometry: how a size in the config becomes regions (:class:`Layout`),
and the check that a header describes one that could have been made."""

from __future__ import annotations

from dataclasses import dataclass

from ...core.sketch import CountMinSketch, TopK
from ...errors import SegmentError
from .layout import (
    FEED_KEY_AT,
    HEADER_SIZE,
    MAX_KEY,
    METRICS_WORDS,
    MIN_ORDER,
    PIN_WORDS,
    PROC_BYTES,
    REC_HEADER,
    RESV_PAGE,
    SLOT_WORDS,
    TOKEN_SLOT_BITS,
    H,
)

SKETCH_DEPTH = 4
HOT_TOPK = 64  # hot keys kept in the top-k
SLOT_SHARE = 256  # by default, a slot per this many bytes of cache.l2_size
KEYS_LOAD = 1.75  # with cache.l2_keys: slots per key (windows fill from about 65% in use)


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
    procs_off: int = 0
    n_procs: int = 0
    metrics_off: int = 0
    resv_off: int = 0

    _WORDS = ("TOTAL", "NSLOTS", "SLOTS_OFF", "META_OFF", "DATA_OFF", "DATA_SIZE", "TOP_ORDER",
              "FEED_OFF", "FEED_N", "FEED_ESZ", "PINS_OFF", "NPINS", "DEFER_OFF", "MAX_KEY",
              "HOT_OFF", "SKETCH_WIDTH", "TOPK", "PROCS_OFF", "NPROCS", "METRICS_OFF", "RESV_OFF")

    @staticmethod
    def plan(l2_size: int, max_key: int, feed_n: int, n_pins: int, max_value: int,
             keys: int = 0) -> Layout:
        """Carve ``l2_size`` bytes, with a slot table for ``keys`` keys (0: a slot per
        ``SLOT_SHARE`` bytes). Raises SegmentError when it is too small to be useful."""
        if not 1 <= max_key <= MAX_KEY:
            raise SegmentError(f"cache.max_key_bytes={max_key} is outside 1..{MAX_KEY}")
        # (by default a slot per SLOT_SHARE bytes, at most the 2**32 a segment has)
        want = int(keys * KEYS_LOAD) if keys else min(l2_size // SLOT_SHARE, 1 << 32)
        n_slots = 1024
        while n_slots < want:
            n_slots *= 2
        if n_slots > 1 << 32:
            raise SegmentError(f"cache.l2_keys={keys} needs {n_slots} slots, over the 2**32 a "
                               f"segment has: lower it (at most {(1 << 32) / KEYS_LOAD:.0f})")
        if n_slots * SLOT_WORDS * 8 > l2_size // 2:
            raise SegmentError(f"cache.l2_keys={keys} needs {n_slots} slots "
                               f"({n_slots * SLOT_WORDS * 8 >> 20} MiB), over half of "
                               f"cache.l2_size={l2_size}: lower it or raise cache.l2_size")
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
        # smaller tiles waste less of the budget, larger ones hold larger values: keep >= 3/4
        # of it, blocks >= 1 MiB
        while top_order > 20 and (data_budget >> top_order << top_order) < data_budget * 3 // 4:
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
        metrics_off = _metrics_off(hot_off, width, topk, max_key)
        resv_off = metrics_off + METRICS_WORDS * 8
        total = _total(resv_off)
        return Layout(total, n_slots, slots_off, meta_off, data_off, data_size, top_order,
                      feed_off, feed_n, feed_esz, pins_off, n_pins, defer_off, max_key,
                      hot_off, width, topk, procs_off, n_procs, metrics_off, resv_off)

    def up_front(self) -> list[tuple[int, int]]:
        """The ``(offset, length)`` ranges the creator reserves at once: every region but
        the slots and the heap (which writers reserve as they first use them)."""
        return [(0, self.slots_off), (self.meta_off, self.data_off - self.meta_off),
                (self.feed_off, self.total - self.feed_off)]

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
            and lay.metrics_off == _metrics_off(lay.hot_off, lay.sketch_width, lay.topk,
                                                lay.max_key)
            and lay.resv_off == lay.metrics_off + METRICS_WORDS * 8
            and lay.total == _total(lay.resv_off)
        )
        if not ok:
            raise SegmentError("L2 segment header is inconsistent (corrupt); purge the namespace")
        return lay


_FIELDS = ("total", "n_slots", "slots_off", "meta_off", "data_off", "data_size", "top_order",
           "feed_off", "feed_n", "feed_esz", "pins_off", "n_pins", "defer_off", "max_key",
           "hot_off", "sketch_width", "topk", "procs_off", "n_procs", "metrics_off", "resv_off")


def _total(resv_off: int) -> int:
    """The file's size: the reservation map (a bit per page of the whole file, itself
    included, in 64-bit words) at ``resv_off``, then whole pages."""
    pages = (resv_off + RESV_PAGE - 1) // RESV_PAGE
    while True:
        total = (resv_off + (pages + 63) // 64 * 8 + RESV_PAGE - 1) // RESV_PAGE * RESV_PAGE
        if total // RESV_PAGE <= pages:
            return total
        pages = total // RESV_PAGE


def _metrics_off(hot_off: int, width: int, topk: int, max_key: int) -> int:
    """The metrics region: right after the hot keys, 64-byte aligned."""
    end = hot_off + CountMinSketch.size_for(width, SKETCH_DEPTH) + TopK.size_for(topk, max_key)
    return (end + 63) // 64 * 64

