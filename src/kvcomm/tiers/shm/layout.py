"""The L2 segment's layout, defined once.

Python reads the tables below directly; ``setup.py`` turns them into the C header
``_l2layout.h`` at build time (:func:`c_header`), so the C kernel and Python can never
disagree about where a field lives. Nothing in this module imports anything but the
standard library: the build runs it before ``kvcomm`` is importable.

Segment, in file order::

    header (4 KiB) | slots | block meta | data (buddy heap) | change feed | pins | deferred
                   | processes | hot keys (count-min sketch + top-k) | metrics | reservation map

Rule for the layout version: any change to these tables, to a field's meaning or width,
or to the order of the regions bumps :data:`LAYOUT_VERSION` (and with it :data:`MAGIC`).
A process meeting another version refuses the segment with SegmentError; it never
misreads it. A bump ships a reader of the previous version's unflushed records
(``tiers/shm/oldlayout.py``), so that ``kvcomm migrate`` carries them into a new segment.
The header words up to ``STATE`` keep their places across versions.

What needs no bump: a new key in a record's **extension field** (one msgpack map, stored
byte for byte; readers ignore keys they do not know), and **appending** a series to
:data:`METRIC_SERIES` or :data:`HISTOGRAMS` (within the region's fixed size). Removing,
reordering or re-meaning a series, or changing :data:`LATENCY_BOUNDS_NS`, bumps it.

Design (each region's fields: header, slot, record, feed event, pin and process entries,
metrics, the reservation map, the expiry hint; the version rule in full):
docs/design/l2.md#the-layout.
"""

from __future__ import annotations

LAYOUT_VERSION = 6  # 6: the reservation map (5: the expiry hint; 4: the metrics region; 3:
# records' extension field)
MAGIC = int.from_bytes(b"KVCOMM\x00" + bytes([LAYOUT_VERSION]), "little")
MAGIC_STEM = MAGIC & 0x00FFFFFFFFFFFFFF  # b"KVCOMM\0": a segment of any layout starts so


def is_segment_magic(word: int) -> bool:
    """Whether ``word``, a file's first 8 bytes (little-endian), begins a KVCOMM segment of
    any layout (the layout's version is its top byte)."""
    return word & 0x00FFFFFFFFFFFFFF == MAGIC_STEM

HEADER_SIZE = 4096
MIN_ORDER = 6  # the smallest heap block is 64 bytes
MAX_ORDER = 47
MAX_PROBE = 64  # slots probed from a key's home slot (32 before layout 6: windows filled)
MAX_KEY = 4096  # the largest cache.max_key_bytes a segment can be made with
RESV_PAGE = 4096  # bytes of the file per bit of the reservation map
RESV_HEAP_CHUNK = 1 << 16  # the heap is reserved this much at a time (fewer fallocate calls)

# Header words. The first group is written once by the creator; the rest is state.
HEADER_WORDS = (
    "MAGIC", "LAYOUT", "TOTAL", "NSLOTS", "SLOTS_OFF", "META_OFF", "DATA_OFF", "DATA_SIZE",
    "TOP_ORDER", "FEED_OFF", "FEED_N", "FEED_ESZ", "PINS_OFF", "NPINS", "DEFER_OFF",
    "MAX_KEY", "HOT_OFF", "SKETCH_WIDTH", "TOPK", "PROCS_OFF", "NPROCS",
    # ---- mutable state, changed under the writer lock unless noted
    "BUSY",          # nonzero while a writer mutates: a writer that finds it set recovers
    "STATE",         # STATE_OK or STATE_PURGED
    "WSEQ",          # the host's write sequence: the counter of the next dot
    "HLC",           # the host's hybrid logical clock
    "FEED_HEAD",     # sequence number of the newest feed event
    "CLOCK",         # the CLOCK eviction hand
    "RELEASED",      # views released since the last sweep of parked blocks (lock-free)
    "ENTRIES",       # live records (tombstones included)
    "USED",          # heap bytes allocated
    "DIRTY",         # records flagged dirty (not yet in L3)
    "EVICTIONS",
    "RECOVERIES",    # repairs after a writer died (or raised) mid-mutation
    "OWNER_DEATHS",  # times the lock was taken over from a dead owner
    "DEFERRED",      # replaced blocks parked while views pin them
    "PIN_HWM",       # pin entries owned by a process are all below this index
    "DEAD_CHECK_MS", # when writers next look for pins of dead processes (ms since the epoch)
    "SYNC_CURSOR",   # the node daemon's position in the feed (atomic store)
    "DAEMON_PID",
    "DAEMON_BEAT",   # the node daemon's heartbeat, ms since the epoch (atomic store)
    "SET_ASIDE",     # records the daemon could not deliver and set aside
    # ---- layout words added since (written once by the creator)
    "METRICS_OFF",   # the metrics region (METRICS_WORDS words)
    # ---- mutable state added in layout 5: the expiry hint (see "Expiry hint" above)
    "EXPIRY_NEXT",   # no clean record is past its deadline before this (ms since the epoch)
    "EXPIRY_PASS",   # the least deadline (ms) the sweep's current pass has seen or been told
    "EXPIRY_CURSOR", # the slot the next sweep slice starts at (one cursor for every process)
    # ---- layout words added in layout 6 (written once by the creator)
    "RESV_OFF",      # the reservation map (a bit per RESV_PAGE of the file; see above)
)
H = {name: i for i, name in enumerate(HEADER_WORDS)}
H_FREE = 64  # MAX_ORDER + 1 words of free-list heads, one per block order
MUTEX_AT = 1024  # byte offset of the writer lock (pthread_mutex_t, at most MUTEX_SPACE bytes)
MUTEX_SPACE = 128
HOST_ID_AT = 1536  # one length byte, then up to 64 bytes of host id

STATE_OK = 0
STATE_PURGED = 1

SLOT_WORDS_NAMES = (
    "SEQ",     # seqlock: odd while a writer publishes
    "HASH",    # the key's stable hash (never 0 in a used slot)
    "OFF",     # the record's block, or EMPTY / TOMB (a free slot that keeps probe chains)
    "REF",     # CLOCK reference bit
    "FLAGS",   # FLAG_DIRTY
)
SLOT = {name: i for i, name in enumerate(SLOT_WORDS_NAMES)}
SLOT_WORDS = len(SLOT_WORDS_NAMES)
EMPTY = 0
TOMB = 1
FLAG_DIRTY = 1

REC_WORDS_NAMES = (
    "SIZE",     # bytes of the whole record (<= its block)
    "COUNTER",  # this host's dot counter for the write that made the record
    "HLC",
    "INFO",     # key length (16 bits) | tag << 16 (8 bits) | vvx length << 32 (32 bits)
    "VLEN",     # value bytes
    "VREL",     # offset of the value from the record's start
    "SPARE",    # zero (reserved)
    "LENS",     # meta length (32 bits) | extension length << 32 (32 bits)
)
REC = {name: i for i, name in enumerate(REC_WORDS_NAMES)}
REC_HEADER = 8 * len(REC_WORDS_NAMES)
TAG_TOMBSTONE = 0  # a delete kept until L3 has it (cluster mode); codec tags are 1..15

FEED_WORDS_NAMES = ("SEQ", "INFO", "COUNTER", "HLC")  # INFO: kind | key length << 8
FEED = {name: i for i, name in enumerate(FEED_WORDS_NAMES)}
FEED_KEY_AT = 8 * len(FEED_WORDS_NAMES)

# Change-feed event kinds: the one list (watch maps them to Event.kind names).
KIND_PUT = 1
KIND_DELETE = 2
KIND_RESYNC = 3  # a writer died mid-operation and the segment was repaired: re-read
KIND_EVICT = 4  # L2 dropped a clean entry to make room (a local event; never sent to L3)
# a clean entry past its deadline was reclaimed (local; L3 holds the record and its deadline)
KIND_EXPIRE = 5
KIND_NAMES = {KIND_PUT: "put", KIND_DELETE: "delete", KIND_RESYNC: "resync", KIND_EVICT: "evict",
              KIND_EXPIRE: "expire"}

PIN_WORDS = 2  # (block offset or 0, owner token or 0): a hazard entry, see tiers/l2.py

PROC_BYTES = 64
PROC_MUTEX_AT = 0  # a pthread_mutex_t, at most PROC_WORDS_AT bytes
PROC_WORDS_AT = 48
PROC_WORDS_NAMES = ("GEN", "PID")  # from PROC_WORDS_AT: the entry's generation, a pid (info)
PROC = {name: PROC_WORDS_AT // 8 + i for i, name in enumerate(PROC_WORDS_NAMES)}
TOKEN_SLOT_BITS = 16


# The metrics region. Each series is one word: "family" or "family{label=value,...}" (the
# family without the kvcomm_ prefix). Counters are added to with atomic adds by the
# process that counted (each process counts in plain ints and flushes the deltas: see
# tiers/shm/counters.py); gauges (marked "=") are stored by their one writer, the daemon.
# APPEND ONLY (see the rule above); kvcomm/metrics/families.py says what each family means.
METRICS_WORDS = 2048
_ERROR_TYPES = ("InvalidKey", "UnsupportedValue", "ValueTooLarge", "ConflictError",
                "ValidationError", "InvalidArgument", "ConfigError", "SegmentError",
                "Unavailable", "CorruptRecord", "UnflushedWrites", "other")
METRIC_SERIES: tuple[str, ...] = (
    *(f"reads_total{{tier={t},result={r}}}" for t, rs in
      (("l1", ("hit", "miss")), ("l2", ("hit", "miss", "absent")), ("l3", ("hit", "absent")))
      for r in rs),
    *(f"writes_total{{kind={k},consistency={c}}}" for k in ("put", "delete")
      for c in ("eventual", "strong")),
    "guard_answers_total{guard=filter}", "guard_answers_total{guard=negative}",
    *(f"errors_total{{type={t}}}" for t in _ERROR_TYPES),
    "l3_commands_total", "l3_bytes_total{direction=sent}", "l3_bytes_total{direction=received}",
    "window_writes_total{side=in}", "window_writes_total{side=out}", "window_batches_total",
    "feed_events_total{feed=cluster}", "=feed_lag_events{feed=cluster}",
    "conflicts_total", "merges_total", "resolver_failures_total", "views_total",
    "daemon_resyncs_total", "daemon_set_aside_total", "daemon_l3_errors_total",
    "batches_total", "updates_total",
    # (appended: the cluster features' state, stored by the node daemon)
    "=partition_mode", "=lease_live", "=partitions_total",
)
METRIC = {name.lstrip("="): i for i, name in enumerate(METRIC_SERIES)}
HIST_AT = 1024  # the first word of the histograms
LATENCY_BOUNDS_NS = (250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000,
                     500_000, 1_000_000, 2_500_000, 5_000_000, 10_000_000, 25_000_000,
                     50_000_000, 100_000_000, 250_000_000, 1_000_000_000)
HIST_WORDS = len(LATENCY_BOUNDS_NS) + 3  # the buckets, +Inf, the sum (ns), the count
HISTOGRAMS: tuple[tuple[str, str], ...] = (  # (op, tier): kvcomm_op_seconds{op,tier}
    ("get", "l1"), ("get", "l2"), ("get", "l3"), ("get", "absent"), ("put", "l2"),
    ("delete", "l2"), ("batch", "l2"), ("update", "l2"),
    ("get", "etcd"),  # (appended: a strong key's quorum read)
)
HIST = {series: HIST_AT + i * HIST_WORDS for i, series in enumerate(HISTOGRAMS)}
assert len(METRIC_SERIES) <= HIST_AT and HIST_AT + len(HISTOGRAMS) * HIST_WORDS <= METRICS_WORDS


def token_of(index: int, generation: int) -> int:
    """The owner token of process entry ``index`` at ``generation``."""
    return ((generation & ((1 << (64 - TOKEN_SLOT_BITS)) - 1)) << TOKEN_SLOT_BITS) | (index + 1)


def c_header() -> str:
    """The C header for ``_l2core.c``: every constant above as a #define."""
    lines = ["/* Generated from kvcomm/tiers/shm/layout.py by setup.py: do not edit. */",
             "#pragma once"]

    def define(name: str, value: int) -> None:
        lines.append(f"#define {name} {value}ULL")

    for name, value in (("LAYOUT_VERSION", LAYOUT_VERSION), ("MAGIC", MAGIC),
                        ("HEADER_SIZE", HEADER_SIZE), ("MIN_ORDER", MIN_ORDER),
                        ("MAX_ORDER", MAX_ORDER), ("MAX_PROBE", MAX_PROBE),
                        ("MAX_KEY", MAX_KEY), ("RESV_PAGE", RESV_PAGE),
                        ("RESV_HEAP_CHUNK", RESV_HEAP_CHUNK), ("H_FREE", H_FREE), ("MUTEX_AT", MUTEX_AT),
                        ("MUTEX_SPACE", MUTEX_SPACE), ("HOST_ID_AT", HOST_ID_AT),
                        ("STATE_OK", STATE_OK), ("STATE_PURGED", STATE_PURGED),
                        ("SLOT_WORDS", SLOT_WORDS), ("EMPTY", EMPTY), ("TOMB", TOMB),
                        ("FLAG_DIRTY", FLAG_DIRTY), ("REC_HEADER", REC_HEADER),
                        ("TAG_TOMBSTONE", TAG_TOMBSTONE), ("FEED_KEY_AT", FEED_KEY_AT),
                        ("PIN_WORDS", PIN_WORDS), ("PROC_BYTES", PROC_BYTES),
                        ("PROC_MUTEX_AT", PROC_MUTEX_AT), ("PROC_WORDS_AT", PROC_WORDS_AT),
                        ("TOKEN_SLOT_BITS", TOKEN_SLOT_BITS), ("METRICS_WORDS", METRICS_WORDS),
                        ("LAT_BUCKETS", len(LATENCY_BOUNDS_NS) + 1)):
        define(name, value)
    for prefix, table in (("H_", H), ("SLOT_", SLOT), ("REC_", REC), ("FEED_", FEED),
                          ("PROC_", PROC)):
        for name, index in table.items():
            define(prefix + name, index)
    for kind, name in KIND_NAMES.items():
        define("KIND_" + name.upper(), kind)
    return "\n".join(lines) + "\n"
