"""A structure-aware fuzzer of the L2 shared-memory segment.

Driven by ``tests/l2/test_fuzz_segment.py`` (a few hundred cases in ``make test``) and by
``make fuzz`` (tens of thousands). The property under test: a process that opens a
corrupted segment and uses it through the public API either works or raises a
``kvcomm.KVCommError``. It never dies of a signal, never raises another exception type,
never runs past its deadline, and ``kvcomm purge`` always removes the segment.

How a run goes
--------------
1. :func:`build_base` writes one real segment through the public API from a seeded
   script: a few hundred keys, values of every codec kind and of several sizes, numpy
   arrays above ``network.zero_copy_threshold`` (one viewed by this live process and one
   by a child that died holding its view, both overwritten so that their old blocks sit
   in the deferred table), a change feed that wrapped, evictions, hot-key counts. Its
   bytes are the base of every case.
2. :func:`mutate` draws, from a ``random.Random`` seeded by ``(seed, case)``, one to a
   few structure-aware mutations (:data:`KINDS`) and turns them into byte patches of a
   copy of the base. Structure offsets come from the base's :class:`~kvcomm.tiers.l2.Layout`
   and the named constants of :mod:`kvcomm.tiers.l2`, read at run time, so the fuzzer
   follows a layout change. Where a record or slot word has no named constant yet, the
   fuzzer uses ``getattr(l2, NAME, today's index)`` and also mutates every word of the
   structure generically.
3. :func:`run_cases` writes each corrupted copy to ``/dev/shm`` as a namespace of its own
   and starts a fresh process for it, forked from a multiprocessing forkserver that has
   kvcomm and numpy imported already (a case costs a fork, not an interpreter start).
   The child runs :func:`_script`: open, get, get_item, zero-copy views, keys, put,
   put with ``expect=``, delete, update, a batch, a short watch, hot_keys, stats,
   ``L2Segment.check()``, ``kvcomm info``, close, and finally ``kvcomm purge``.
   faulthandler in the child writes the Python stack of a crash (SIGSEGV, SIGBUS, SIGFPE,
   SIGABRT) or of a hang (its deadline) to the case's log.
4. :func:`classify` makes each case ``ok`` or a failure: ``signal``, ``exception`` (any
   exception outside the KVCommError tree), ``hang``, ``purge`` (``kvcomm purge`` did not
   remove the segment), ``exit`` (any other death). :func:`summarize` groups failures by
   cause (status, exception or signal, step, innermost code location).

After the first ``Unavailable`` a child skips the remaining operations that take the
writer lock: a lock held by a live process legitimately costs one lock timeout per
writer, and one is enough to learn that. Cases slower than ``slow_after`` seconds are
listed with their mutation.

Replay: a case is determined by ``FUZZ_SEED`` (which also seeds the base) and its
number: ``FUZZ_SEED=<seed> FUZZ_CASE=<n> pytest -q tests/l2/test_fuzz_segment.py``. The
base is rebuilt from the same script, so its structure (slots, blocks, free lists, feed)
is the same; only timestamps and pids in it differ from the original run.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import io
import json
import linecache
import multiprocessing as mp
import multiprocessing.connection
import os
import random
import re
import signal
import sys
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from typing import Any

import kvcomm
from kvcomm.core.sketch import CountMinSketch, TopK
from kvcomm.tiers import l2 as _l2
from kvcomm.tiers.shm import geometry as _geometry
from kvcomm.tiers.shm import layout as _layout
from tests.support import ROOT


class _Names:
    """kvcomm.tiers.l2, plus every entry of the layout tables under its C name (H_BUSY,
    SLOT_OFF, REC_LENS, ...): the fuzzer names fields the way the C kernel does."""

    def __init__(self) -> None:
        self.table = {f"{prefix}{name}": index
                      for prefix, tab in (("H_", _layout.H), ("SLOT_", _layout.SLOT),
                                          ("REC_", _layout.REC), ("FEED_", _layout.FEED))
                      for name, index in tab.items()}

    def __getattr__(self, name: str) -> Any:
        if name in self.table:
            return self.table[name]
        for module in (_l2, _layout, _geometry):
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(name)


l2: Any = _Names()

# ---------------------------------------------------------------------------- configuration

#: The segment every case starts from: small (a copy is ~1 MiB), a feed that wraps fast,
#: a pin table that fills, every read counted for hot keys, views from 1 KiB.
CONFIG: dict[str, Any] = {
    "cache": {
        "l2_size": "2MB",
        "watch_buffer": 64,
        "max_views": 8,
        "max_key_bytes": 64,
        "max_value_size": "256KB",
        "hot_key_sample": 1,
        "l1_size": "1MB",
    },
    "network": {"zero_copy_threshold": "1KB"},
}

U64 = (1 << 64) - 1


def _const(name: str, default: int) -> int:
    """A named constant of kvcomm.tiers.l2 when it has one, else today's value."""
    value = getattr(l2, name, default)
    return value if isinstance(value, int) else default


# Word positions inside structures that l2.py documents but does not name (yet).
SLOT_SEQ = _const("SLOT_SEQ", 0)
SLOT_HASH = _const("SLOT_HASH", 1)
SLOT_OFF = _const("SLOT_OFF", 2)
SLOT_ACCESS = _const("SLOT_ACCESS", 3)
SLOT_FLAGS = _const("SLOT_FLAGS", 4)
SLOT_NAMES = {SLOT_SEQ: "seq", SLOT_HASH: "hash", SLOT_OFF: "off", SLOT_ACCESS: "access",
              SLOT_FLAGS: "flags"}
FREE_NEXT = _const("FREE_NEXT", 1)  # a free block's words: next, prev
FREE_PREV = _const("FREE_PREV", 2)
META_FREE = _const("META_FREE", 0x80)  # block meta byte: free bit | (order - MIN_ORDER + 1)
PIN_WORDS = _const("PIN_WORDS", 2)  # a pin entry: block offset, pid
FEED_KEY_AT = _const("FEED_KEY_AT", 32)  # a feed entry: seq, kind|klen<<8, counter, hlc, key
REC_WORDS = l2.REC_HEADER // 8
REC_SIZE = _const("REC_SIZE", 0)  # record header words: block size, ...
REC_INFO = _const("REC_INFO", 3)  # klen (16 bits) | tag (8) << 16 | vvlen << 32
REC_VLEN = _const("REC_VLEN", 4)
REC_VREL = _const("REC_VREL", 5)  # where the value starts, from the record
REC_PINS = _const("REC_PINS", 6)  # how many views pin the block
REC_MLEN = _const("REC_LENS", 7)  # meta length (32 bits) | extension length << 32
REC_NAMES = {0: "size", 1: "counter", 2: "hlc", 3: "info(klen|tag|vvlen)", 4: "vlen", 5: "vrel",
             6: "pins", 7: "lens(mlen|xlen)"}


def header_words() -> dict[str, int]:
    """Every named header word of the layout (``H_*``), by name."""
    return {f"H_{n}": v for n, v in _layout.H.items()}


def layout_words() -> dict[str, int]:
    """Layout field name -> header word index, found through Layout.header_words()."""
    fields = [f.name for f in dataclasses.fields(l2.Layout)]
    probe = l2.Layout(**{name: 1_000_003 + i for i, name in enumerate(fields)})
    by_value = {v: w for w, v in probe.header_words().items()}
    return {name: by_value[1_000_003 + i] for i, name in enumerate(fields)
            if 1_000_003 + i in by_value}


# ---------------------------------------------------------------------------- the base segment


@dataclass
class Base:
    """A populated segment's bytes and what the fuzzer needs to know about them."""

    data: bytes
    seed: int
    keys: list[str]  # keys present at snapshot time (the child reads them)
    arrays: list[str]  # keys of large arrays (read as zero-copy views)
    info: dict[str, Any]
    hot: list[tuple[str, int]]


def _value(rng: random.Random, np: Any) -> Any:
    r = rng.random()
    if r < 0.35:
        return rng.randbytes(rng.choice([0, 1, 7, 64, 200, 700, 1500, 3000]))
    if r < 0.45:
        return rng.randrange(-(1 << 63), 1 << 63)
    if r < 0.55:
        return "é" * rng.randrange(300)
    if r < 0.65:
        return {"x": rng.random(), "tags": ["a", "b"], "n": None, "deep": {"k": [1, 2.5]}}
    if r < 0.78:  # small array: under the zero-copy threshold, copied
        return np.arange(rng.randrange(1, 120), dtype=rng.choice(["<i4", "<f8", "|u1"]))
    return np.full(rng.randrange(256, 6000), rng.random(), dtype="<f8")  # 2-48 KiB: views


def _dead_pinner(ns: str, cfg_map: dict[str, Any], seed: int) -> None:
    """Take a zero-copy view, overwrite its key, and die holding the view."""
    import numpy as np

    kv = kvcomm.open(ns, config=kvcomm.Config.from_mapping(cfg_map))
    rng = np.random.default_rng(seed)
    kv.put("arr/dead", rng.random(3000))
    view = kv.get("arr/dead")
    kv.put("arr/dead", rng.random(2500))
    assert view is not None
    os._exit(0)  # no finalizers: the pin stays, owned by a dead pid


def build_base(seed: int, ns: str, ctx: Any) -> tuple[Base, list[Any]]:
    """Populate namespace ``ns`` from a seeded script and snapshot it.

    Returns the base and the views this process still holds (keep them alive while the
    cases run: their pins belong to a live process). ``ns`` is purged before returning.
    """
    import numpy as np

    rng = random.Random(seed)
    # (no periodic metrics flush: the flusher thread hands the sampled reads to the hot
    # keys under the writer lock, which may sweep the dead child's pin: see below)
    cfg = kvcomm.Config.from_mapping({**CONFIG, "metrics": {"flush_interval": 0}})
    pool = ([f"k/{i}" for i in range(260)] + [f"ключ/{i}" for i in range(20)]
            + ["m" * 64, "é" * 32])  # the longest keys: 64 bytes of UTF-8
    kv = kvcomm.open(ns, config=cfg)
    try:
        for _ in range(1400):
            op = rng.random()
            k = rng.choice(pool)
            if op < 0.62:
                kv.put(k, _value(rng, np))
            elif op < 0.72:
                kv.delete(k)
            elif op < 0.78:
                kv.update(f"ctr/{rng.randrange(8)}", lambda n: n + 1, default=0)
            elif op < 0.82:
                with kv.batch() as b:
                    for _ in range(rng.randrange(1, 6)):
                        if rng.random() < 0.8:
                            b.put(rng.choice(pool), _value(rng, np))
                        else:
                            b.delete(rng.choice(pool))
            else:
                kv.get(k)
        for i in range(4):  # a skewed read load: hot keys to find
            kv.put(f"hot/{i}", i)
            for _ in range(40 * (4 - i)):
                kv.get(f"hot/{i}")
        hot = kv.hot_keys(4)
        views = []
        kv.put("arr/kept", np.arange(2000, dtype="<f8"))
        views.append(kv.get("arr/kept"))  # pinned by this (live) process
        kv.put("arr/live", np.arange(3000, dtype="<i8"))
        views.append(kv.get("arr/live"))
        kv.put("arr/live", np.arange(2500, dtype="<i8"))  # the pinned block is deferred
        p = ctx.Process(target=_dead_pinner, args=(ns, CONFIG, seed))
        p.start()
        p.join(60)
        if p.exitcode != 0:
            raise RuntimeError(f"the dead-pinner child exited with {p.exitcode}")
        # Nothing of this process takes the writer lock from here on, a read included:
        # every taker (a write, a read's hot-key flush as kv.keys() makes, the metrics
        # flusher thread) sweeps the pins of dead processes once H_DEAD_CHECK_MS has passed
        # (a second after the last sweep: soon, on a loaded machine) and frees the dead
        # child's deferred block, before the snapshot or, from another thread, during it (a
        # torn copy: a header counting 2 parked blocks, a table holding 1, and a block
        # nothing references). So the keys come from the lock-free scan.
        seg = l2.L2Segment(ns, create_layout=None, host_id="")
        try:
            keys = sorted(seg.keys())
            info = seg.info()
        finally:
            seg.close()
        with open(l2.segment_path(ns), "rb") as f:
            data = f.read()
        q = memoryview(data).cast("Q")
        lay = l2.Layout.from_header(q, len(data))
        parked = sum(1 for i in range(lay.n_pins) if q[(lay.defer_off >> 3) + i])
        if not parked == q[l2.H_DEFERRED] == info["pinned_deferred_blocks"] >= 2:
            raise RuntimeError(
                f"the base lost a deferred block while it was read (a sweep): {parked} in "
                f"the table, the header says {q[l2.H_DEFERRED]}, before the copy "
                f"{info['pinned_deferred_blocks']}")
    finally:
        kv.close()
        l2.purge(ns)
    arrays = [k for k in ("arr/kept", "arr/live", "arr/dead") if k in keys]
    return Base(data, seed, keys, arrays, info, hot), views


# ---------------------------------------------------------------------------- anatomy


class Anatomy:
    """Where everything is in the base: read once, used by every mutation."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.size = len(data)
        self.q = memoryview(bytearray(data)).cast("Q")
        lay = self.lay = l2.Layout.from_header(self.q, len(data))
        self.data_end = lay.data_off + lay.data_size
        self.blocks: list[tuple[int, int, bool]] = []  # (offset, order, free)
        pos = lay.data_off
        while pos < self.data_end:
            m = data[lay.meta_off + ((pos - lay.data_off) >> l2.MIN_ORDER)]
            if m == 0:
                break
            order = (m & ~META_FREE & 0xFF) + l2.MIN_ORDER - 1
            self.blocks.append((pos, order, bool(m & META_FREE)))
            pos += 1 << order
        self.free = [b for b in self.blocks if b[2]]
        self.slots: dict[str, list[int]] = {"live": [], "tomb": [], "empty": []}
        for i in range(lay.n_slots):
            off = self.q[self.slot_word(i, SLOT_OFF)]
            kind = "empty" if off == l2.EMPTY else "tomb" if off == l2.TOMB else "live"
            self.slots[kind].append(i)
        self.records = sorted(self.q[self.slot_word(i, SLOT_OFF)] for i in self.slots["live"])
        self.pins = [i for i in range(lay.n_pins) if self.q[(lay.pins_off >> 3) + PIN_WORDS * i]]
        self.deferred = [i for i in range(lay.n_pins) if self.q[(lay.defer_off >> 3) + i]]
        self.sketch_size = CountMinSketch.size_for(lay.sketch_width, l2.SKETCH_DEPTH)
        self.topk_size = TopK.size_for(lay.topk, lay.max_key)
        self.regions = {
            "header": (0, l2.HEADER_SIZE),
            "slots": (lay.slots_off, lay.meta_off),
            "meta": (lay.meta_off, lay.meta_off + (lay.data_size >> l2.MIN_ORDER)),
            "data": (lay.data_off, self.data_end),
            "feed": (lay.feed_off, lay.feed_off + lay.feed_n * lay.feed_esz),
            "pins": (lay.pins_off, lay.defer_off),
            "deferred": (lay.defer_off, lay.defer_off + lay.n_pins * 8),
            "hot": (lay.hot_off, lay.hot_off + self.sketch_size + self.topk_size),
            "metrics": (lay.metrics_off, lay.metrics_off + 8 * _layout.METRICS_WORDS),
        }

    def slot_word(self, i: int, k: int) -> int:
        return (self.lay.slots_off >> 3) + i * l2.SLOT_WORDS + k

    def word(self, byte_off: int) -> int:
        return int.from_bytes(self.data[byte_off : byte_off + 8], "little")


# ---------------------------------------------------------------------------- mutations


@dataclass
class Mutation:
    """One corruption: byte patches (and optionally a new file size), with a description."""

    kind: str
    what: str
    patches: list[tuple[int, bytes]] = field(default_factory=list)
    size: int | None = None  # truncate (or extend with zeros) the file to this size

    def set_word(self, byte_off: int, value: int) -> None:
        self.patches.append((byte_off, (value & U64).to_bytes(8, "little")))


INTERESTING = [0, 1, 2, 3, 7, 8, 63, 64, 65, 127, 255, 4095, 4096, 0xFFFF, 0x10000,
               (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, 1 << 40, 1 << 48, (1 << 63) - 1,
               1 << 63, U64 - 4095, U64 - 63, U64 - 7, U64 - 1, U64]


def _structural(rng: random.Random, a: Anatomy) -> int:
    """An offset that means something in this segment (or is just outside something)."""
    lay = a.lay
    choices: list[Callable[[], int]] = [
        lambda: a.size, lambda: a.size - 8, lambda: a.size - 64, lambda: a.size + 4096,
        lambda: lay.data_off, lambda: lay.data_off - 64, lambda: a.data_end,
        lambda: a.data_end - 64, lambda: lay.feed_off, lambda: lay.pins_off,
        lambda: lay.hot_off, lambda: lay.slots_off, lambda: 0, lambda: 8,
        lambda: rng.randrange(a.size) & ~7, lambda: rng.randrange(lay.data_off, a.data_end) & ~63,
    ]
    if a.records:
        r = rng.choice(a.records)
        choices += [lambda: r, lambda: r + 8, lambda: r + 64, lambda: r + l2.REC_HEADER]
    if a.free:
        f = rng.choice(a.free)[0]
        choices += [lambda: f, lambda: f + 64]
    if a.blocks:
        b = rng.choice(a.blocks)[0]
        choices += [lambda: b, lambda: b + 1]
    return rng.choice(choices)() & U64


def _relative(rng: random.Random, cur: int) -> int:
    op = rng.randrange(10)
    if op == 0:
        return cur + 1
    if op == 1:
        return cur - 1
    if op == 2:
        return cur ^ (1 << rng.randrange(64))
    if op == 3:
        return cur << 1
    if op == 4:
        return cur >> 1
    if op == 5:
        return cur + (1 << 63)
    if op == 6:
        return -cur
    if op == 7:
        return cur + (1 << rng.randrange(6, 48))
    if op == 8:
        return cur - (1 << rng.randrange(6, 48))
    return cur ^ rng.getrandbits(64)


def _value64(rng: random.Random, a: Anatomy, cur: int) -> int:
    r = rng.random()
    if r < 0.35:
        return rng.choice(INTERESTING)
    if r < 0.6:
        return _structural(rng, a)
    if r < 0.9:
        return _relative(rng, cur) & U64
    return rng.getrandbits(64)


def _fmt(v: int) -> str:
    return f"{v:#x}" if v > 4096 else str(v)


def m_header_word(rng: random.Random, a: Anatomy) -> Mutation:
    names = header_words()
    name = rng.choice(sorted(n for n in names if n != "H_FREE"))
    w = names[name]
    cur = a.q[w]
    if name == "H_LOCK" and rng.random() < 0.5:  # an owner: dead, ourselves, live, garbage
        new = rng.choice([os.getpid(), 1, (1 << 22) + rng.randrange(1 << 20), U64, 1 << 32])
    else:
        new = _value64(rng, a, cur)
    m = Mutation("header_word", f"{name} (word {w}) {_fmt(cur)} -> {_fmt(new & U64)}")
    m.set_word(w * 8, new)
    return m


_LAYOUT_TARGETS = ["n_slots", "feed_n", "feed_esz", "n_pins", "top_order", "data_size",
                   "sketch_width", "topk", "max_key", "hot_off", "total", "data_off", "metrics_off"]


def _fix_layout(lay: l2.Layout, changed: str) -> l2.Layout:
    """Recompute what depends on ``changed`` so that the header looks consistent (today's
    relations; Layout.from_header decides whether it really is)."""
    d = dataclasses.asdict(lay)
    if changed == "n_slots":
        d["meta_off"] = d["slots_off"] + d["n_slots"] * l2.SLOT_WORDS * 8
    if changed in ("data_size", "data_off"):
        d["feed_off"] = d["data_off"] + d["data_size"]
    d["pins_off"] = d["feed_off"] + d["feed_n"] * d["feed_esz"]
    d["defer_off"] = d["pins_off"] + d["n_pins"] * 8 * PIN_WORDS
    if changed != "hot_off":
        d["hot_off"] = max(d["hot_off"], (d["defer_off"] + d["n_pins"] * 8 + 63) // 64 * 64)
    if changed != "metrics_off":  # (the metrics region follows the hot keys)
        d["metrics_off"] = _geometry._metrics_off(d["hot_off"], d["sketch_width"], d["topk"], d["max_key"])
    return l2.Layout(**d)


def m_layout_consistent(rng: random.Random, a: Anatomy) -> Mutation:
    """Change a layout field and its dependents; prefer headers that Layout.from_header accepts."""
    words = layout_words()
    base = a.lay
    last: tuple[str, int, l2.Layout] | None = None
    for _ in range(40):
        name = rng.choice([n for n in _LAYOUT_TARGETS if n in words])
        cur = getattr(base, name)
        new = rng.choice([0, 1, 2, cur - 1, cur + 1, cur // 2, cur * 2, cur + 64, cur - 64,
                          rng.choice(INTERESTING), cur + 4096, cur - 4096]) & U64
        if new == cur:
            continue
        lay = _fix_layout(dataclasses.replace(base, **{name: new}), name)
        last = (name, new, lay)
        q = memoryview(bytearray(a.data[: l2.HEADER_SIZE])).cast("Q")
        for field_name, w in words.items():
            q[w] = getattr(lay, field_name) & U64
        try:
            l2.Layout.from_header(q, a.size)
        except kvcomm.KVCommError:
            continue
        except Exception:
            continue  # from_header itself failing on a header is the child's finding to make
        break
    assert last is not None
    name, new, lay = last
    changed = {f: getattr(lay, f) for f in words if getattr(lay, f) != getattr(base, f)}
    m = Mutation("layout_consistent",
                 f"{name} {_fmt(getattr(base, name))} -> {_fmt(new)}; header now "
                 + ", ".join(f"{k}={_fmt(v)}" for k, v in changed.items()))
    for f, v in changed.items():
        m.set_word(words[f] * 8, v)
    return m


def m_free_head(rng: random.Random, a: Anatomy) -> Mutation:
    h_free = _const("H_FREE", 40)
    if rng.random() < 0.85:
        order = rng.randrange(l2.MIN_ORDER, a.lay.top_order + 1)
    else:
        order = rng.randrange(64)
    w = h_free + order
    cur = a.q[w]
    new = _structural(rng, a) if rng.random() < 0.7 else _value64(rng, a, cur)
    m = Mutation("free_head", f"free-list head of order {order} (word {w}) {_fmt(cur)} -> {_fmt(new)}")
    m.set_word(w * 8, new)
    return m


def m_free_link(rng: random.Random, a: Anatomy) -> Mutation:
    if not a.free:
        return m_free_head(rng, a)
    off, order, _ = rng.choice(a.free)
    k = rng.choice([FREE_NEXT, FREE_PREV])
    cur = a.word(off + 8 * k)
    new = _structural(rng, a) if rng.random() < 0.6 else rng.choice([off, 0, *INTERESTING[:6]])
    m = Mutation("free_link", f"{'next' if k == FREE_NEXT else 'prev'} of free block {off:#x} "
                 f"(order {order}) {_fmt(cur)} -> {_fmt(new)}")
    m.set_word(off + 8 * k, new)
    return m


def m_block_meta(rng: random.Random, a: Anatomy) -> Mutation:
    lay = a.lay
    r = rng.random()
    if r < 0.7 and a.blocks:
        off, order, free = rng.choice(a.blocks)
        label = f"{'free' if free else 'allocated'} block {off:#x} (order {order})"
    else:
        off = lay.data_off + (rng.randrange(lay.data_size >> l2.MIN_ORDER) << l2.MIN_ORDER)
        label = f"unit {off:#x}"
    at = lay.meta_off + ((off - lay.data_off) >> l2.MIN_ORDER)
    cur = a.data[at]
    top_code = lay.top_order - l2.MIN_ORDER + 1
    new = rng.choice([0, META_FREE, 0xFF, 0x7F, cur ^ META_FREE, cur + 1, cur - 1,
                      top_code + 1, top_code + 5, META_FREE | (top_code + 1), rng.randrange(256),
                      1, META_FREE | 1]) & 0xFF
    m = Mutation("block_meta", f"meta byte of {label} at {at:#x} {cur:#x} -> {new:#x}")
    m.patches.append((at, bytes([new])))
    return m


def m_record_header(rng: random.Random, a: Anatomy) -> Mutation:
    pool = a.records or [b[0] for b in a.blocks if not b[2]]
    if a.deferred and rng.random() < 0.2:
        pool = [a.q[(a.lay.defer_off >> 3) + i] for i in a.deferred]
    off = rng.choice(pool)
    words = [a.word(off + 8 * i) for i in range(REC_WORDS)]
    m = Mutation("record_header", f"record {off:#x}:")
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        i = rng.randrange(REC_WORDS)
        r = rng.random()
        if r < 0.3:  # a sum that wraps past 2**64 onto a plausible value
            j, k = rng.randrange(REC_WORDS), rng.randrange(REC_WORDS)
            new = (words[j] - words[k] + rng.choice([0, 0, 1, 64, -64])) & U64
            if new == words[i]:
                new = (-words[k] + words[0]) & U64
        elif r < 0.5:  # a bit field (packed word): all ones or random bits in [lo, hi)
            lo = rng.randrange(64)
            hi = rng.randrange(lo + 1, 65)
            mask = ((1 << (hi - lo)) - 1) << lo
            fill = mask if rng.random() < 0.5 else rng.getrandbits(64) & mask
            new = (words[i] & ~mask) | fill
        else:
            new = _value64(rng, a, words[i])
        new &= U64
        m.what += f" {REC_NAMES.get(i, f'word {i}')} {_fmt(words[i])} -> {_fmt(new)};"
        words[i] = new
        m.set_word(off + 8 * i, new)
    return m


def m_record_body(rng: random.Random, a: Anatomy) -> Mutation:
    off = rng.choice(a.records or [a.lay.data_off])
    size = min(a.word(off), a.data_end - off)
    lo, hi = off + l2.REC_HEADER, max(off + l2.REC_HEADER + 1, off + size)
    m = Mutation("record_body", f"record {off:#x}: bytes")
    for _ in range(rng.randrange(1, 9)):
        at = rng.randrange(lo, hi)
        new = rng.randrange(256)
        m.what += f" [{at - off}]={new:#x}"
        m.patches.append((at, bytes([new])))
    return m


def m_slot(rng: random.Random, a: Anatomy) -> Mutation:
    kind = rng.choices(["live", "tomb", "empty"], [0.75, 0.1, 0.15])[0]
    if not a.slots[kind]:
        kind = "live"
    i = rng.choice(a.slots[kind])
    if rng.random() < 0.12 and len(a.slots["live"]) > 1:  # a copy of another live slot
        j = rng.choice(a.slots["live"])
        m = Mutation("slot", f"{kind} slot {i} := copy of live slot {j} (a block referenced twice)")
        for k in range(l2.SLOT_WORDS):
            m.set_word(a.slot_word(i, k) * 8, a.q[a.slot_word(j, k)])
        return m
    k = rng.randrange(l2.SLOT_WORDS)
    cur = a.q[a.slot_word(i, k)]
    if k == SLOT_SEQ and rng.random() < 0.5:
        new = rng.choice([cur + 1, cur + 3, U64, 1])
    elif k == SLOT_OFF:
        pool: list[int] = [l2.EMPTY, l2.TOMB]
        pool += [a.q[(a.lay.defer_off >> 3) + d] for d in a.deferred]
        pool += [f[0] for f in a.free[:8]]
        new = rng.choice(pool) if rng.random() < 0.4 else _structural(rng, a)
    else:
        new = _value64(rng, a, cur)
    name = SLOT_NAMES.get(k, f"word {k}")
    m = Mutation("slot", f"{kind} slot {i} {name} {_fmt(cur)} -> {_fmt(new & U64)}")
    m.set_word(a.slot_word(i, k) * 8, new)
    return m


def m_feed_entry(rng: random.Random, a: Anatomy) -> Mutation:
    lay = a.lay
    e = rng.randrange(lay.feed_n)
    at = lay.feed_off + e * lay.feed_esz
    if rng.random() < 0.25:
        m = Mutation("feed_entry", f"feed entry {e}: key bytes")
        for _ in range(rng.randrange(1, 6)):
            p = at + FEED_KEY_AT + rng.randrange(max(1, lay.feed_esz - FEED_KEY_AT))
            m.patches.append((p, bytes([rng.choice([0x80, 0xFF, 0xC0, 0, rng.randrange(256)])])))
        return m
    k = rng.randrange(FEED_KEY_AT // 8)
    cur = a.word(at + 8 * k)
    head = a.q[l2.H_FEED_HEAD]
    new = rng.choice([head, head + 1, head - lay.feed_n, cur | 0xFF, cur | (0xFFFF << 8),
                      _value64(rng, a, cur), cur | 0xFFFFFFFFFFFF00])
    m = Mutation("feed_entry", f"feed entry {e} word {k} {_fmt(cur)} -> {_fmt(new & U64)}")
    m.set_word(at + 8 * k, new)
    return m


def m_feed_head(rng: random.Random, a: Anatomy) -> Mutation:
    w = l2.H_FEED_HEAD
    cur = a.q[w]
    n = a.lay.feed_n
    new = rng.choice([0, 1, cur + 1, cur + n, cur + n + 1, cur - 1, cur - n, cur - n - 1,
                      U64, U64 - n, 1 << 63, cur + (1 << 32), rng.getrandbits(64)]) & U64
    m = Mutation("feed_head", f"H_FEED_HEAD {_fmt(cur)} -> {_fmt(new)}")
    m.set_word(w * 8, new)
    if rng.random() < 0.3 and hasattr(l2, "H_SYNC_CURSOR"):
        c = rng.choice([new, new + 5, 0, U64]) & U64
        m.what += f"; H_SYNC_CURSOR -> {_fmt(c)}"
        m.set_word(l2.H_SYNC_CURSOR * 8, c)
    return m


def m_pin_table(rng: random.Random, a: Anatomy) -> Mutation:
    lay = a.lay
    if rng.random() < 0.2 and hasattr(l2, "H_PIN_HWM"):
        cur = a.q[l2.H_PIN_HWM]
        new = rng.choice([0, lay.n_pins + 1, lay.n_pins * 4, 1 << 20, U64, cur + 1])
        m = Mutation("pin_table", f"H_PIN_HWM {cur} -> {_fmt(new)}")
        m.set_word(l2.H_PIN_HWM * 8, new)
        return m
    i = rng.choice(a.pins) if a.pins and rng.random() < 0.6 else rng.randrange(lay.n_pins)
    at = lay.pins_off + i * PIN_WORDS * 8
    m = Mutation("pin_table", f"pin {i}:")
    if rng.random() < 0.6:
        cur = a.word(at)
        new = _structural(rng, a) if rng.random() < 0.7 else _value64(rng, a, cur)
        m.what += f" block {_fmt(cur)} -> {_fmt(new)};"
        m.set_word(at, new)
    if rng.random() < 0.6 or len(m.patches) == 0:
        cur = a.word(at + 8)
        new = rng.choice([0, 1, os.getpid(), (1 << 22) + rng.randrange(1 << 20), U64, 1 << 32])
        m.what += f" pid {cur} -> {_fmt(new)};"
        m.set_word(at + 8, new)
    if a.records and rng.random() < 0.3:  # a record's pin count
        off = rng.choice(a.records)
        new = rng.choice([1, 2, U64, 1 << 32])
        m.what += f" record {off:#x} pins -> {_fmt(new)};"
        m.set_word(off + 8 * REC_PINS, new)
    return m


def m_defer_table(rng: random.Random, a: Anatomy) -> Mutation:
    lay = a.lay
    if rng.random() < 0.25 and hasattr(l2, "H_DEFERRED"):
        cur = a.q[l2.H_DEFERRED]
        new = rng.choice([0, cur + 1, cur - 1, U64, lay.n_pins + 1])
        m = Mutation("defer_table", f"H_DEFERRED {cur} -> {_fmt(new & U64)}")
        m.set_word(l2.H_DEFERRED * 8, new)
        return m
    i = rng.choice(a.deferred) if a.deferred and rng.random() < 0.5 else rng.randrange(lay.n_pins)
    at = lay.defer_off + 8 * i
    cur = a.word(at)
    pool = a.records[:]  # a block a slot still references: a double free in waiting
    pool += [f[0] for f in a.free[:8]]
    new = rng.choice(pool) if pool and rng.random() < 0.6 else _structural(rng, a)
    m = Mutation("defer_table", f"deferred {i} {_fmt(cur)} -> {_fmt(new)}")
    m.set_word(at, new)
    return m


def m_hot(rng: random.Random, a: Anatomy) -> Mutation:
    lay = a.lay
    r = rng.random()
    if r < 0.25:  # the sketch's header words (additions, reserved)
        k = rng.randrange(2)
        at = lay.hot_off + 8 * k
        cur = a.word(at)
        new = _value64(rng, a, cur)
        m = Mutation("hot", f"sketch header word {k} {_fmt(cur)} -> {_fmt(new & U64)}")
        m.set_word(at, new)
        return m
    if r < 0.5:  # counters
        m = Mutation("hot", "sketch counters:")
        for _ in range(rng.randrange(1, 8)):
            at = lay.hot_off + 16 + 4 * rng.randrange((a.sketch_size - 16) // 4)
            new = rng.choice([0, 1, 0xFFFFFFFF, 0x80000000, rng.getrandbits(32)])
            m.what += f" [{at - lay.hot_off}]={new:#x}"
            m.patches.append((at, new.to_bytes(4, "little")))
        return m
    slot = 16 + (lay.max_key + 7) // 8 * 8
    i = rng.randrange(lay.topk)
    at = lay.hot_off + a.sketch_size + i * slot
    k = rng.randrange(slot // 8)
    cur = a.word(at + 8 * k)
    new = rng.choice([0, 1, 0xFFFF, U64, lay.max_key + 1, 1 << 63, _value64(rng, a, cur)])
    m = Mutation("hot", f"top-k entry {i} word {k} {_fmt(cur)} -> {_fmt(new & U64)}")
    m.set_word(at + 8 * k, new)
    return m


def m_metrics(rng: random.Random, a: Anatomy) -> Mutation:
    """The metrics region, which every scrape and ``kvcomm top`` read: counters and gauges
    (``METRIC_SERIES``), histogram buckets, sums and counts, or whole histogram rows."""
    off = a.lay.metrics_off
    hist_words = len(_layout.HISTOGRAMS) * _layout.HIST_WORDS
    m = Mutation("metrics", "metrics words:")
    if rng.random() < 0.2:  # a whole histogram row: buckets that disagree with the count
        first = _layout.HIST_AT + _layout.HIST_WORDS * rng.randrange(len(_layout.HISTOGRAMS))
        words = list(range(first, first + _layout.HIST_WORDS))
    else:
        words = [rng.randrange(len(_layout.METRIC_SERIES)) if rng.random() < 0.5
                 else _layout.HIST_AT + rng.randrange(hist_words)
                 for _ in range(rng.choice([1, 1, 2, 8]))]
    for word in words:
        at = off + 8 * word
        cur = a.word(at)
        new = _value64(rng, a, cur)
        m.what += f" [{word}] {_fmt(cur)}->{_fmt(new & U64)}"
        m.set_word(at, new)
    return m


def m_byte_flips(rng: random.Random, a: Anatomy) -> Mutation:
    region = rng.choice(sorted(a.regions))
    lo, hi = a.regions[region]
    n = rng.choice([1, 1, 2, 4, 8, 16, 64])
    m = Mutation("byte_flips", f"{n} flips in {region}:")
    for _ in range(n):
        at = rng.randrange(lo, max(lo + 1, hi))
        old = a.data[at]
        new = old ^ (1 << rng.randrange(8)) if rng.random() < 0.6 else rng.randrange(256)
        m.what += f" {at:#x}:{old:#x}->{new:#x}"
        m.patches.append((at, bytes([new])))
    return m


def m_anywhere(rng: random.Random, a: Anatomy) -> Mutation:
    n = rng.choice([1, 4, 32, 256])
    m = Mutation("byte_flips", f"{n} random bytes anywhere:")
    for _ in range(n):
        at = rng.randrange(a.size)
        new = rng.randrange(256)
        if n <= 32:
            m.what += f" {at:#x}={new:#x}"
        m.patches.append((at, bytes([new])))
    return m


def m_truncate(rng: random.Random, a: Anatomy) -> Mutation:
    lay = a.lay
    size = rng.choice([0, 1, 8, l2.HEADER_SIZE - 1, l2.HEADER_SIZE, l2.HEADER_SIZE + 8,
                       lay.meta_off, lay.data_off, lay.data_off + 4096, lay.feed_off,
                       lay.pins_off, lay.hot_off, a.size - 4096, a.size - 1, a.size + 4096,
                       rng.randrange(a.size)])
    m = Mutation("truncate", f"file size {a.size} -> {size}", size=size)
    if rng.random() < 0.5 and size >= l2.HEADER_SIZE:  # and a header that agrees with it
        m.what += "; H_TOTAL set to match"
        m.set_word(l2.H_TOTAL * 8, size)
    return m


def crafted(a: Anatomy) -> dict[str, list[Mutation]]:
    """Hand-made corruptions of known danger (issue 7, item 9 and friends), by name."""
    lay = a.lay
    words = layout_words()
    out: dict[str, list[Mutation]] = {}

    zero = _fix_layout(dataclasses.replace(lay, feed_n=0), "feed_n")
    m = Mutation("crafted", "a consistent header with zero feed entries (feed_n=0)")
    for f, w in words.items():
        if getattr(zero, f) != getattr(lay, f):
            m.set_word(w * 8, getattr(zero, f))
    out["zero_feed"] = [m]
    if hasattr(l2, "H_BUSY"):  # (the crafted cases skip header words that no longer exist)
        busy = Mutation("crafted", "... and a writer died mid-operation (H_BUSY=1): recovery "
                        "feeds a resync")
        busy.set_word(l2.H_BUSY * 8, 1)
        out["zero_feed_after_crash"] = [m, busy]

    rec = a.records[len(a.records) // 2]
    size = a.word(rec + 8 * REC_SIZE)
    m = Mutation("crafted", f"record {rec:#x}: vlen 2**28, vrel = size - vlen (mod 2**64): "
                 "the value 'starts' 256 MiB before the record")
    m.set_word(rec + 8 * REC_VREL, size - (1 << 28))
    m.set_word(rec + 8 * REC_VLEN, 1 << 28)
    out["value_length_wraps"] = [m]

    info = a.word(rec + 8 * REC_INFO)
    fixed = l2.REC_HEADER + (info & 0xFFFF) + (info >> 24)
    m = Mutation("crafted", f"record {rec:#x}: mlen so that header+klen+vvlen+mlen wraps")
    m.set_word(rec + 8 * REC_MLEN, (1 << 64) - fixed + l2.REC_HEADER)
    out["meta_length_wraps"] = [m]

    order = max((b[1] for b in a.free), default=lay.top_order)
    m = Mutation("crafted", f"free-list head of order {order} points past the mapping")
    m.set_word((_const("H_FREE", 40) + order) * 8, a.size + (1 << 20))
    out["free_head_outside"] = [m]

    m = Mutation("crafted", f"free-list head of order {l2.MIN_ORDER} points into a live record")
    m.set_word((_const("H_FREE", 40) + l2.MIN_ORDER) * 8, rec + 64)
    out["free_head_into_record"] = [m]

    if a.free:
        off, order, _ = a.free[0]
        m = Mutation("crafted", f"free block {off:#x} says order {lay.top_order + 3}")
        at = lay.meta_off + ((off - lay.data_off) >> l2.MIN_ORDER)
        m.patches.append((at, bytes([META_FREE | (lay.top_order + 3 - l2.MIN_ORDER + 1)])))
        out["free_block_order_too_big"] = [m]

    i = a.slots["live"][0]
    m = Mutation("crafted", f"live slot {i} left odd (a writer died mid-publish, busy clear)")
    m.set_word(a.slot_word(i, SLOT_SEQ) * 8, a.q[a.slot_word(i, SLOT_SEQ)] + 1)
    out["slot_left_odd"] = [m]

    if hasattr(l2, "H_PIN_HWM"):
        m = Mutation("crafted", "H_PIN_HWM far past the pin table")
        m.set_word(l2.H_PIN_HWM * 8, 1 << 20)
        out["pin_hwm_huge"] = [m]

    m = Mutation("crafted", f"the last deferred entry holds live record {rec:#x} (to be freed "
                 "while a slot still uses it)")
    m.set_word(lay.defer_off + 8 * (lay.n_pins - 1), rec)
    if hasattr(l2, "H_DEFERRED"):
        m.set_word(l2.H_DEFERRED * 8, a.q[l2.H_DEFERRED] + 1)
    out["deferred_live_block"] = [m]

    m = Mutation("crafted", "H_FEED_HEAD = 2**64 - 1")
    m.set_word(l2.H_FEED_HEAD * 8, U64)
    out["feed_head_max"] = [m]

    out["truncated_empty"] = [Mutation("crafted", "an empty file", size=0)]
    out["truncated_by_one_byte"] = [Mutation("crafted", "one byte short (not a whole word)",
                                             size=a.size - 1)]
    half = Mutation("crafted", f"truncated to {a.size // 2} bytes, H_TOTAL to match",
                    size=a.size // 2)
    half.set_word(l2.H_TOTAL * 8, a.size // 2)
    out["truncated_half"] = [half]
    return out


#: kind -> (generator, weight)
KINDS: dict[str, tuple[Callable[[random.Random, Anatomy], Mutation], int]] = {
    "header_word": (m_header_word, 10),
    "layout_consistent": (m_layout_consistent, 7),
    "free_head": (m_free_head, 6),
    "free_link": (m_free_link, 6),
    "block_meta": (m_block_meta, 6),
    "record_header": (m_record_header, 12),
    "record_body": (m_record_body, 4),
    "slot": (m_slot, 10),
    "feed_entry": (m_feed_entry, 5),
    "feed_head": (m_feed_head, 3),
    "pin_table": (m_pin_table, 5),
    "defer_table": (m_defer_table, 5),
    "hot": (m_hot, 5),
    "metrics": (m_metrics, 4),
    "byte_flips": (m_byte_flips, 5),
    "anywhere": (m_anywhere, 2),
    "truncate": (m_truncate, 3),
}


def mutate(seed: int, case: int, a: Anatomy) -> list[Mutation]:
    """The mutations of case ``case`` of a run seeded ``seed`` (deterministic)."""
    rng = random.Random(f"kvcomm-fuzz/{seed}/{case}")
    names = sorted(KINDS)
    weights = [KINDS[n][1] for n in names]
    count = 1 if rng.random() < 0.7 else rng.randrange(2, 5)  # 30%: a combination
    return [KINDS[n][0](rng, a) for n in rng.choices(names, weights, k=count)]


CRAFTED_BASE = 1_000_000  # case numbers from here on are the crafted cases, by sorted name


def case_mutations(seed: int, case: int, a: Anatomy) -> list[Mutation]:
    """Case ``case``: a crafted one (``CRAFTED_BASE + i``) or a seeded random one."""
    if case >= CRAFTED_BASE:
        table = crafted(a)
        return table[sorted(table)[case - CRAFTED_BASE]]
    return mutate(seed, case, a)


def crafted_cases(a: Anatomy) -> dict[str, int]:
    """Crafted case name -> case number."""
    return {name: CRAFTED_BASE + i for i, name in enumerate(sorted(crafted(a)))}


def apply(base: bytes, muts: list[Mutation]) -> bytes:
    buf = bytearray(base)
    size: int | None = None
    for m in muts:
        for at, b in m.patches:
            if 0 <= at and at + len(b) <= len(buf):
                buf[at : at + len(b)] = b
        if m.size is not None:
            size = m.size
    if size is not None:
        buf = buf[:size] if size <= len(buf) else buf + bytes(size - len(buf))
    return bytes(buf)


# ---------------------------------------------------------------------------- the child


class _Failed(Exception):
    """Ends the child's script after a failure (already recorded)."""


def _where(tb_text: str) -> str:
    """The innermost kvcomm frame of a traceback ('l2.py:612 _sweep_pins'), else the last."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', tb_text)
    if not frames:
        return "?"
    mine = [f for f in frames if "/kvcomm/" in f[0]] or frames
    f = mine[-1]
    return f"{os.path.basename(f[0])}:{f[1]} {f[2]}"


def child_main(ns: str, cfg_map: dict[str, Any], keys: list[str], arrays: list[str],
               result_path: str, log_path: str, deadline: float, control: str) -> None:
    """One case, in a fresh process: run the script, write the result, exit."""
    log = open(log_path, "w", buffering=1)  # noqa: SIM115 - closed by os._exit
    faulthandler.enable(file=log, all_threads=True)
    faulthandler.dump_traceback_later(deadline, exit=True, file=log)
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    except (ImportError, ValueError, OSError):
        pass
    result: dict[str, Any] = {"steps": [], "failure": None, "hits": 0, "problems": None}
    try:
        _script(ns, cfg_map, keys, arrays, control, log, result)
    except _Failed:
        pass
    except BaseException as exc:  # the harness itself broke: report it as a failure too
        result["failure"] = {"step": "harness", "type": type(exc).__name__, "message": str(exc),
                             "traceback": traceback.format_exc(), "where": "harness"}
    with open(result_path + ".tmp", "w") as f:
        json.dump(result, f)
    os.rename(result_path + ".tmp", result_path)
    log.flush()
    os._exit(0)


def _script(ns: str, cfg_map: dict[str, Any], keys: list[str], arrays: list[str], control: str,
            log: Any, result: dict[str, Any]) -> None:
    import numpy as np

    from kvcomm import cli

    cfg = kvcomm.Config.from_mapping(cfg_map)
    writes_ok = [True]  # False after the first Unavailable: skip what takes the lock
    steps: list[Any] = result["steps"]

    def step(name: str, fn: Callable[[], Any], detail: str = "", locks: bool = False) -> Any:
        if locks and not writes_ok[0]:
            steps.append([name, "skipped", 0.0])
            return None
        log.write(f"step {name} {detail}\n")
        t0 = time.monotonic()
        try:
            out = fn()
        except kvcomm.KVCommError as exc:
            steps.append([name, type(exc).__name__, time.monotonic() - t0])
            log.write(f"done {name} {type(exc).__name__} {time.monotonic() - t0:.3f}\n")
            if isinstance(exc, kvcomm.Unavailable):
                writes_ok[0] = False
            return None
        except BaseException as exc:
            tb = traceback.format_exc()
            failure = {"step": name, "detail": detail, "type": type(exc).__name__,
                       "message": str(exc)[:500], "traceback": tb, "where": _where(tb)}
            if result["failure"] is None:
                result["failure"] = failure
            else:  # e.g. purge after an earlier failure: the first one is the cause
                result.setdefault("also", []).append(failure)
            steps.append([name, "FAILED", time.monotonic() - t0])
            raise _Failed from None
        steps.append([name, "ok", time.monotonic() - t0])
        log.write(f"done {name} ok {time.monotonic() - t0:.3f}\n")
        return out

    if control == "segv":
        step("get", lambda: os.kill(os.getpid(), signal.SIGSEGV), "control")
    elif control == "hang":
        step("get", lambda: time.sleep(3600), "control")
    elif control == "exception":
        step("get", lambda: {}["control"], "control")

    kv = step("open", lambda: kvcomm.open(ns, config=cfg))
    try:
        if kv is not None:
            _ops(kv, np, keys, arrays, step, result)
        seg = step("open_segment", lambda: l2.L2Segment(ns, create_layout=None, host_id=""))
        if seg is not None:
            problems = step("check", seg.check, locks=True)
            result["problems"] = None if problems is None else len(problems)
            step("segment_close", seg.close)
        out = io.StringIO()
        with redirect_stdout(out), redirect_stderr(out):
            rc = step("cli_info", lambda: cli.main(["info", "--name", ns]))
        if rc not in (0, 2):
            result["failure"] = {"step": "cli_info", "type": "rc", "message": f"rc={rc} {out.getvalue()}",
                                 "traceback": "", "where": "cli info"}
            raise _Failed
    finally:
        if kv is not None:
            try:
                step("close", kv.close)
            except _Failed:
                pass  # recorded; purge must still work
        out = io.StringIO()
        with redirect_stdout(out), redirect_stderr(out):
            rc = step("purge", lambda: cli.main(["purge", "--name", ns]))
        if rc == 2 and "not yet in L3" in out.getvalue() and os.path.exists(l2.segment_path(ns)):
            # refused: the (possibly corrupt) segment says it holds unflushed writes; a
            # forced purge must then remove it, whatever it holds
            out = io.StringIO()
            with redirect_stdout(out), redirect_stderr(out):
                rc = step("purge", lambda: cli.main(["purge", "--name", ns, "--force"]))
        if rc != 0 or os.path.exists(l2.segment_path(ns)):
            if result["failure"] is None:
                result["failure"] = {
                    "step": "purge", "type": "purge", "where": "kvcomm purge",
                    "message": f"`kvcomm purge` rc={rc}, file left={os.path.exists(l2.segment_path(ns))}:"
                               f" {out.getvalue().strip()[:300]}",
                    "traceback": ""}


class OutOfBoundsRead(AssertionError):
    """A read returned more bytes than the whole segment holds: it read outside it."""


def _in_bounds(value: Any, limit: int) -> Any:
    """``value``, after checking that it could have come from a segment of ``limit`` bytes."""
    v = value.value if isinstance(value, kvcomm.Item) else value
    n = v.nbytes if hasattr(v, "nbytes") else len(v) if isinstance(v, bytes | str) else 0
    if n > limit:
        raise OutOfBoundsRead(f"read a value of {n} bytes from a segment of {limit} bytes")
    return value


def _ops(kv: kvcomm.Client, np: Any, keys: list[str], arrays: list[str],
         step: Callable[..., Any], result: dict[str, Any]) -> None:
    limit = os.path.getsize(l2.segment_path(kv.name))
    for k in keys:  # every key: a corrupt record is found only by reading its key
        if step("get", lambda k=k: _in_bounds(kv.get(k), limit), k) is not None:
            result["hits"] += 1
    for k in keys[1::10]:
        step("get_item", lambda k=k: _in_bounds(kv.get_item(k), limit), k)
    reads = keys[:: max(1, len(keys) // 4)][:4]
    views = []
    for k in arrays:
        v = step("get_view", lambda k=k: _in_bounds(kv.get(k), limit), k, locks=True)
        if v is not None:
            views.append(v)
            step("view_sum", lambda v=v: float(np.asarray(v).sum()), k)
    step("keys", lambda: kv.keys())
    step("keys_prefix", lambda: kv.keys("k/"))
    new_values: list[Any] = [b"", b"x" * 100, b"y" * 3000, 12345, "str", {"a": [1, 2]},
                             np.arange(40, dtype="<i4"), np.ones(1500)]
    for i, v in enumerate(new_values):
        step("put", lambda i=i, v=v: kv.put(f"fuzz/new/{i}", v), f"fuzz/new/{i}", locks=True)
    for k in keys[::53][:4]:
        step("put_over", lambda k=k: kv.put(k, b"over"), k, locks=True)
    step("put_absent", lambda: kv.put("fuzz/cas", 1, expect=kvcomm.ABSENT), locks=True)
    item = step("get_item", lambda: kv.get_item("fuzz/cas"), "fuzz/cas")
    if item is not None:
        step("put_expect", lambda: kv.put("fuzz/cas", 2, expect=item.version), locks=True)
    for k in keys[5::41][:3] + ["fuzz/never-written"]:
        step("delete", lambda k=k: kv.delete(k), k, locks=True)
    for _ in range(2):
        step("update", lambda: kv.update("ctr/0", lambda n: (n or 0) + 1, default=0), locks=True)

    def batch() -> None:
        with kv.batch() as b:
            b.put("fuzz/b/1", b"1" * 500)
            b.put("fuzz/b/2", np.arange(700, dtype="<f8"))
            b.delete(keys[-1] if keys else "fuzz/b/none")
            b.delete("fuzz/new/0")

    step("batch", batch, locks=True)

    def watch() -> int:
        w = kv.watch(timeout=0.02)
        kv.put("fuzz/watched", 1)
        n = 0
        for _ in w:
            n += 1
            if n >= 200:
                break
        return n

    step("watch", watch, locks=True)
    step("watch_prefix", lambda: sum(1 for _ in kv.watch("fuzz/", timeout=0.01)))
    step("hot_keys", lambda: kv.hot_keys(5), locks=True)
    step("stats", kv.stats)
    step("metrics_scrape", lambda: _scrape(kv))  # (the collector, the exposition, top)
    for k in reads:
        step("get_again", lambda k=k: _in_bounds(kv.get(k), limit), k)
    views.clear()


def _scrape(kv: kvcomm.Client) -> int:
    """What the exporter and ``kvcomm top`` read of the (corrupt) segment: the metrics
    region, the header's gauges and the hot keys, through the collector, prometheus-client's
    exposition and top's frame. Returns the exposition's length."""
    from prometheus_client import CollectorRegistry, generate_latest
    from rich.console import Console

    from kvcomm.cli import top
    from kvcomm.metrics import agent
    from kvcomm.metrics.collector import Collector, read
    from kvcomm.metrics.snapshot import View

    agent.flush_all()  # (this client's counts added to the corrupt region first)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector(kv._seg, kv.config))
    text = generate_latest(registry)
    old = read(kv._seg, kv.config)
    new = read(kv._seg, kv.config)
    Console(file=io.StringIO(), width=80).print(top.host_frame(View(new, old, 1.0), "fuzz"))
    return len(text)


# ---------------------------------------------------------------------------- the parent


@dataclass
class CaseResult:
    case: int
    mutations: list[Mutation]
    status: str  # ok | signal | exception | hang | purge | exit
    cause: str = ""  # SIGSEGV, IndexError, ...
    step: str = ""
    where: str = ""
    message: str = ""
    trace: str = ""
    seconds: float = 0.0
    steps: list[Any] = field(default_factory=list)
    hits: int = 0
    problems: int | None = None
    native: str = ""  # C frames from a gdb replay (FUZZ_GDB=1)

    @property
    def kinds(self) -> str:
        return "+".join(m.kind for m in self.mutations)

    def describe(self) -> str:
        return "; ".join(f"[{m.kind}] {m.what}" for m in self.mutations)


def forkserver_context() -> Any:
    """A forkserver context whose server has kvcomm, its CLI and numpy imported."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["kvcomm", "kvcomm.cli", "kvcomm.tiers.l2", "numpy",
                                __name__])
    return ctx


def _last_step(log: str) -> str:
    steps = re.findall(r"^step (\S+)", log, re.M)
    return steps[-1] if steps else "?"


def _fault_frames(log: str) -> list[tuple[str, str, str]]:
    """The main thread's frames in a faulthandler dump, most recent first."""
    m = re.search(r"\(most recent call first\):\n((?:  File .*\n)+)", log)
    return re.findall(r'File "([^"]+)", line (\d+) in (\S+)', m.group(1)) if m else []


def _fault_where(log: str) -> str:
    """The innermost kvcomm frame of a faulthandler dump, with its source line: a signal
    in the C kernel shows as the Python line that called it (``r = core.put(...)``)."""
    frames = _fault_frames(log)
    mine = [f for f in frames if "/kvcomm/" in f[0]] or frames
    if not mine:
        return "?"
    f = mine[0]
    src = linecache.getline(f[0], int(f[1])).strip()
    return f"{os.path.basename(f[0])}:{f[1]} {f[2]}" + (f" `{src[:60]}`" if src else "")


def _fault_trace(log: str) -> str:
    """The head of a faulthandler dump: what happened and the innermost frames."""
    head = [ln for ln in log.splitlines()
            if ln.startswith(("Fatal Python error", "Timeout (", "Current thread", "Thread 0x"))][:1]
    frames = [f'  File "{f}", line {n} in {fn}' for f, n, fn in _fault_frames(log)[:6]]
    done = re.findall(r"^done (\S+) (\S+) (\S+)$", log, re.M)
    slow = [f"{n} {o} {float(t):.1f}s" for n, o, t in done if float(t) > 1.0]
    return "\n".join(head + frames + ([f"slow steps before: {', '.join(slow)}"] if slow else []))


def classify(case: int, muts: list[Mutation], exitcode: int | None, killed: bool,
             result_path: str, log_path: str, seconds: float) -> CaseResult:
    try:
        with open(log_path) as f:
            log = f.read()
    except OSError:
        log = ""
    res: dict[str, Any] | None = None
    try:
        with open(result_path) as f:
            res = json.load(f)
    except (OSError, ValueError):
        res = None
    cr = CaseResult(case, muts, "ok", seconds=seconds)
    if res is not None:
        cr.steps, cr.hits, cr.problems = res["steps"], res["hits"], res["problems"]
    if killed or "Timeout (" in log:
        cr.status, cr.cause, cr.step = "hang", "hang", _last_step(log)
        cr.where, cr.trace = _fault_where(log), _fault_trace(log)
        cr.message = f"still running after {seconds:.1f}s"
    elif exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        cr.status, cr.cause, cr.step = "signal", name, _last_step(log)
        cr.where, cr.trace = _fault_where(log), _fault_trace(log)
    elif exitcode != 0 or res is None:
        cr.status, cr.cause, cr.step = "exit", f"exit code {exitcode}", _last_step(log)
        cr.trace = log[-3000:]
    elif res["failure"] is not None:
        f = res["failure"]
        cr.status = "purge" if f["type"] == "purge" else "exception"
        cr.cause, cr.step, cr.where = f["type"], f["step"], f["where"]
        cr.message, cr.trace = f["message"], f["traceback"]
    return cr


def run_cases(base: Base, seed: int, cases: Iterable[int], *, jobs: int = 2,
              deadline: float = 25.0, workdir: str, ctx: Any,
              control: dict[int, str] | None = None, progress: bool = False) -> list[CaseResult]:
    """Run every case (at most ``jobs`` at a time); returns one CaseResult per case."""
    anatomy = Anatomy(base.data)
    tag = f"{os.getpid()}-{seed % 100000}"
    todo = iter(cases)
    running: dict[int, tuple[Any, int, list[Mutation], float, str]] = {}
    out: list[CaseResult] = []
    control = control or {}
    next_report = time.monotonic() + 30
    exhausted = False
    while True:
        while not exhausted and len(running) < jobs:
            case = next(todo, None)
            if case is None:
                exhausted = True
                break
            muts = [] if case in control else case_mutations(seed, case, anatomy)
            ns = f"fuzz-{tag}-{case}"
            path = l2.segment_path(ns)
            data = apply(base.data, muts)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            rp = os.path.join(workdir, f"{case}.json")
            lp = os.path.join(workdir, f"{case}.log")
            p = ctx.Process(target=child_main,
                            args=(ns, CONFIG, base.keys, base.arrays, rp, lp,
                                  2.0 if control.get(case) == "hang" else deadline,
                                  control.get(case, "")))
            p.start()
            running[case] = (p, case, muts, time.monotonic(), ns)
        if not running:
            break
        ready = set(mp.connection.wait([r[0].sentinel for r in running.values()], timeout=0.5))
        now = time.monotonic()
        for case in list(running):
            p, _, muts, t0, ns = running[case]
            hard = (2.0 if control.get(case) == "hang" else deadline) + 10
            killed = False
            if p.sentinel not in ready:
                if now - t0 < hard:
                    continue
                p.kill()
                killed = True
            p.join()
            del running[case]
            rp = os.path.join(workdir, f"{case}.json")
            lp = os.path.join(workdir, f"{case}.log")
            out.append(classify(case, muts, p.exitcode, killed, rp, lp, now - t0))
            p.close()
            for leftover in (l2.segment_path(ns), rp, lp):
                try:
                    os.unlink(leftover)
                except FileNotFoundError:
                    pass
        if progress and now >= next_report:
            next_report = now + 30
            bad = sum(r.status != "ok" for r in out)
            print(f"fuzz: {len(out)} cases done, {bad} failed", file=sys.stderr, flush=True)
    out.sort(key=lambda r: r.case)
    return out


def replay_command(seed: int, case: int) -> str:
    return (f"FUZZ_SEED={seed} FUZZ_CASE={case} "
            ".venv/bin/python -m pytest -q tests/l2/test_fuzz_segment.py -k never_crash")


def add_native_frames(results: list[CaseResult], seed: int) -> None:
    """Replay under gdb the first case of each signal group, to name the C function."""
    seen: set[tuple[str, str]] = set()
    for r in results:
        if r.status == "signal" and (r.cause, r.where) not in seen:
            seen.add((r.cause, r.where))
            r.native = gdb_backtrace(seed, r.case)


def summarize(results: list[CaseResult], seed: int, slow_after: float = 3.0) -> str:
    """A report: failures grouped by cause, rates per mutation kind, slow cases."""
    failed = [r for r in results if r.status != "ok"]
    lines = [f"segment fuzzer, FUZZ_SEED={seed}: {len(failed)} of {len(results)} cases failed"]
    by_cause: dict[tuple[str, str, str], list[CaseResult]] = defaultdict(list)
    for r in failed:
        by_cause[(r.status, r.cause, r.where)].append(r)
    by_status = Counter(f"{r.status}:{r.cause}" for r in failed)
    if failed:
        lines.append("  by cause: " + ", ".join(f"{n} {c}" for c, n in by_status.most_common()))
    for (status, cause, where), rs in sorted(by_cause.items(), key=lambda kv: -len(kv[1])):
        ex = rs[0]
        kinds = Counter(r.kinds for r in rs).most_common(4)
        steps = Counter(r.step for r in rs).most_common(6)
        lines.append("")
        lines.append(f"- {len(rs)} x {status} {cause} at {where}")
        lines.append(f"  in steps: {', '.join(f'{k} {n}' for k, n in steps)}")
        lines.append(f"  mutation kinds: {', '.join(f'{k} {n}' for k, n in kinds)}")
        lines.append(f"  cases: {', '.join(str(r.case) for r in rs[:12])}"
                     f"{' ...' if len(rs) > 12 else ''}")
        lines.append(f"  example case {ex.case}: {ex.describe()[:600]}")
        if ex.message:
            lines.append(f"  message: {ex.message[:300]}")
        tail = [ln for ln in ex.trace.strip().splitlines() if ln.strip()][-8:]
        lines.extend("    | " + ln for ln in tail)
        if ex.native:
            lines.extend("    C " + ln for ln in ex.native.splitlines())
        lines.append(f"  replay: {replay_command(seed, ex.case)}")
    kinds_total: Counter[str] = Counter()
    kinds_failed: Counter[str] = Counter()
    for r in results:
        for k in {m.kind for m in r.mutations}:
            kinds_total[k] += 1
            kinds_failed[k] += r.status != "ok"
    lines.append("")
    lines.append("failure rate by mutation kind (a case with several kinds counts for each): "
                 + ", ".join(f"{k} {kinds_failed[k]}/{kinds_total[k]}" for k in sorted(kinds_total)))
    errs: Counter[str] = Counter()
    for r in results:
        for name, outcome, _ in r.steps:
            if outcome not in ("ok", "FAILED", "skipped"):
                errs[f"{name}:{outcome}"] += 1
    lines.append("KVCommErrors raised (fine): " + ", ".join(f"{k} {n}" for k, n in errs.most_common(12)))
    slow = [r for r in results if r.seconds > slow_after and r.status == "ok"]
    if slow:
        lines.append(f"slow cases (> {slow_after:.0f}s, not failures):")
        for r in sorted(slow, key=lambda r: -r.seconds)[:10]:
            worst = max(r.steps, key=lambda s: s[2]) if r.steps else ["?", "?", 0.0]
            lines.append(f"  case {r.case}: {r.seconds:.1f}s, slowest step {worst[0]} "
                         f"({worst[1]}, {worst[2]:.1f}s): {r.describe()[:200]}")
    return "\n".join(lines)


def gdb_backtrace(seed: int, case: int, timeout: float = 120.0) -> str:
    """The C frames where case ``case`` dies, replayed in-process under gdb ('' if no gdb).

    In-process the wild pointer may land elsewhere than in the forkserver child (what is
    mapped next to the segment differs), so the replay can die in a later step, or not.
    """
    import shutil
    import subprocess

    gdb = shutil.which("gdb")
    if gdb is None:
        return ""
    root = str(ROOT)
    ns = f"fuzzgdb-{os.getpid()}-{case}"
    try:
        p = subprocess.run([gdb, "-q", "-batch", "-ex", "run", "-ex", "bt 12", "--args",
                            sys.executable, "-m", "tests.support.fuzz_segment", str(seed), str(case), ns],
                           capture_output=True, text=True, timeout=timeout, cwd=root)
    except subprocess.TimeoutExpired:
        return "gdb: no answer"
    finally:
        if os.path.exists(l2.segment_path(ns)):  # the replay died before its purge
            os.unlink(l2.segment_path(ns))
    frames = [ln for ln in p.stdout.splitlines() if re.match(r"#\d ", ln)]
    sig = [ln for ln in p.stdout.splitlines() if "received signal" in ln]
    if not frames:
        return "gdb replay: no signal in-process"
    mine = [f for f in frames if "_l2core" in f or f.startswith("#0 ")][:4]
    return "\n".join(sig[:1] + [re.sub(r" \(.*?\) at ", " at ", f)[:160] for f in mine])


def _replay_main(argv: list[str]) -> int:
    """``python -m tests.support.fuzz_segment SEED CASE [NAMESPACE]``: run one case in this process.

    For a C backtrace of a signal: ``gdb -batch -ex run -ex bt --args .venv/bin/python -m
    tests.support.fuzz_segment SEED CASE``. Prints the mutation, then the steps as they run.
    """
    import tempfile

    seed, case = int(argv[0]), int(argv[1])
    ctx = forkserver_context()
    base, views = build_base(seed, f"fuzzreplay-{os.getpid()}", ctx)
    muts = case_mutations(seed, case, Anatomy(base.data))
    print(f"FUZZ_SEED={seed} case {case}: " + "; ".join(f"[{m.kind}] {m.what}" for m in muts))
    ns = argv[2] if len(argv) > 2 else f"fuzzreplay-{os.getpid()}-{case}"
    with open(l2.segment_path(ns), "xb") as f:
        f.write(apply(base.data, muts))
    os.chmod(l2.segment_path(ns), 0o600)
    with tempfile.TemporaryDirectory() as d:
        result: dict[str, Any] = {"steps": [], "failure": None, "hits": 0, "problems": None}
        try:
            _script(ns, CONFIG, base.keys, base.arrays, "", sys.stdout, result)
        except _Failed:
            pass
        finally:
            if os.path.exists(l2.segment_path(ns)):
                os.unlink(l2.segment_path(ns))
        print(json.dumps(result["failure"], indent=2) if result["failure"] else "no failure", d)
    views.clear()
    return 1 if result["failure"] else 0


if __name__ == "__main__":
    sys.exit(_replay_main(sys.argv[1:]))
