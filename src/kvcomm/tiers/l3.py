"""L3: Redis Cluster as the cluster tier — the record codec, the push script, the adapter.

Keys and slots
--------------
A KVCOMM key ``k`` is stored under ``kvc:{t}:k`` where ``t`` is the hash tag of its
group, ``xxh3(k) mod cluster.groups`` (:mod:`kvcomm.tiers.groups`: 1,024 groups by
default, up to one per slot, spread evenly over the 16,384 slots). The tag pins a whole
group to one Redis Cluster hash slot, so a record, its group's change feed (the stream
``kvf:{t}``) and counter (``kvs:{t}``) are in the same slot and one Lua call can update
them atomically; a slot, with everything of its group, moves between masters as one
(:mod:`kvcomm.balance.migrate`). Redis Cluster spreads the slots over the masters,
replicates them, and fails over; KVCOMM adds nothing to that. The group count is
recorded in L3 (``kvm:groups``) at the first daemon's start, and a host configured with
another count refuses to start (:meth:`L3Store.check_groups`).

Records (a msgpack map of short named fields, format 2)
-------------------------------------------------------
``{"f": 2, "h": hlc_hex, "d": tombstone, "t": tag, "m": meta, "v": value,
"vv": [actor, counter, ...], "dot": [actor, counter], "x": extension}``
(bytes as msgpack's raw/str type: the ``cmsgpack`` inside Redis cannot read ``bin``)

* ``h``: the HLC timestamp as 16 lowercase hex digits. Redis' Lua numbers are doubles
  (53 bits); as fixed-width hex the timestamp compares correctly as a string.
* ``d``: a delete, kept so that other hosts learn of it; ``t``/``m``/``v`` are the
  codec's tag, meta and payload (:mod:`kvcomm.core.codec`), never pickle.
* ``vv``: the version vector flattened, sorted by actor; ``dot`` names the write that
  made the record.
* ``x``: the extension: one msgpack map with string keys, itself packed into bytes
  (``b"\\x80"``, the empty map, by default). It is opaque to the push script, which
  copies it byte for byte: ``cmsgpack`` would turn an empty map into an array and
  integers above 2**53 into doubles if it had to unpack and pack it again. Readers
  ignore keys of ``x`` they do not know.

Everyone reads fields by name — :meth:`L3Record.decode` and the Lua script alike —
never by position. Format 1 (the array ``[1, hlc_hex, tombstone, tag, meta, value,
vector, dot_actor, dot_counter]``) is still read, by both, and rewritten as format 2 at
the key's next change; nothing writes it any more.

**When to bump FORMAT.** A new key inside ``x`` that a reader may ignore safely does
not bump it: old readers carry it through unchanged. Everything else does — a new
top-level field, a field that changes type, unit or meaning, a field removed, or a key
of ``x`` that an old reader must not ignore (one that would make it serve or merge
wrongly). A bump keeps reading every older format (decode and Lua) and writes only the
new one; a record of a format a reader does not know is refused (``CorruptRecord``,
``KVCOMMBAD``/``KVCOMMCORRUPT`` from the script), so a host that was not upgraded
fails loudly for that key instead of mis-merging it: upgrade every host's daemon and
agents before the first writer of the new format.

Decoding is defensive (:meth:`L3Record.decode`): anything in Redis may have been written
by something else, so every field is checked for type and range (actors are host ids,
counters in 1..2**53-1 (``MAX_COUNTER``: see :mod:`kvcomm.core.versions`), the value at
most ``cache.max_value_size``, ``x`` at most MAX_EXT bytes holding one map), msgpack's
length limits are set so that no length field can make the decoder allocate more than
the record's own size, and any failure is
:class:`~kvcomm.errors.CorruptRecord` for that key only. :meth:`L3Record.decode_value`
does the same for the value inside.

Change feed: entries, value-less or inline
------------------------------------------
Every change the push script stores is appended to the group's stream ``kvf:{g}``,
numbered by the group's sequence number, ``INCR`` of ``kvs:{g}`` (same hash tag, same
slot, same atomic script). An entry is one of two kinds (:class:`FeedEntry`):

* **value-less** ``{k: key, q: sequence number, n: note}`` for a record over
  ``feed_inline`` bytes (``cluster.feed_inline``, FEED_INLINE = 128 by default). The note
  is ``counter:flags:host``: the stored record's dot, ``d`` if it is a tombstone, ``m``
  if the script merged two hosts' records into it (:class:`FeedNote`). Every host reads
  every entry of a group it reads, so an entry costs each host its size: a host reads
  the record itself (``GET``, :meth:`L3Store.get_many`) only for the keys it wants, and
  the record it reads may be newer than the entry (never older, unless a failover lost
  the write; the rewind is then resynced). The sequence number is ``q``, not ``s``: a
  daemon older than value-less entries finds no ``s`` in one and resyncs the group (it
  re-reads the keys it holds) instead of missing the change.
* **inline** ``{k: key, r: record, s: sequence number}`` for a small record: the entry
  every version before value-less ones wrote, still read. A tiny record costs little
  more than a note, and reading it inline spares the host a round trip.

A reader applies both kinds in sequence order; a stream may hold both (during an
upgrade, or when ``feed_inline`` changes).

Sequence numbers
----------------
A reader that knows the last sequence number it saw can tell from any entry whether it
missed some: a first entry whose number is not last + 1 means entries were trimmed past
its cursor (a gap); a number at or below the last means the stream went backwards (a
failover lost entries that it had read). Either way the reader resyncs that group from
the records themselves (:meth:`L3Store.feed_position` then re-reads). A read that
returns nothing carries no sequence number, so a reader also compares its last sequence
number with ``kvs:{g}`` now and then (:meth:`L3Store.feed_seqs`).

A failover can also *reissue* a number: the new master never got entry X (replication is
asynchronous; a push waits only for the replicas its master has connected), so its
counter is X's number - 1, and its next entry takes X's number, at an id the new master's
clock gives — before X's id when the old master's clock (or its stream's last id) ran
ahead. A reader positioned at X reads after X's id and never sees that entry, and the
counter equals its last number. So the counter is read together with the id of the
stream's last entry (:meth:`L3Store.feed_heads`): a counter equal to the reader's last
number with a last entry that is not the reader's cursor means the number was reissued
(a rewind: the reader resyncs the group).

Hints, and the sweep
--------------------
With a thousand groups or more, reading every group's stream every poll would cost each
host thousands of Redis commands a second while nothing happens. So the push script
also announces each change on its group's sharded pub/sub channel (``SPUBLISH
kvh:{t} <seq>``, Redis 7), each daemon subscribes to every group's channel on the master
serving it (:class:`kvcomm.tiers.hints.Hints`), and reads a group's stream only when
hinted. Pub/sub is not reliable, so losing a hint must cost time, never a change:

* a subscription connection that breaks, or a channel the server unsubscribes (its slot
  moved to another master), makes the daemon check the counters of the groups it served
  at once, and subscribe again where they are now;
* a slow sweep reads every group's counter (:meth:`L3Store.feed_heads`: one read-only
  script call per master reads up to SWEEP_BATCH counters, so the sweep costs a fixed
  number of commands a second per host whatever the number of groups) and reads the
  groups whose counter moved. The sweep period bounds how late a lost hint is caught.

The hint of a value-less entry is the entry itself, ``<seq> <id> <note> <key>``
(:meth:`L3Store.hint_entries`; a plain hint is the sequence number alone): a daemon
whose last sequence number of the group is ``seq - 1`` applies it without reading the
stream, so a value-less change costs each host its hint and no XRANGE; any other
number (a hint lost in between, a rewind) and the daemon reads the stream. In one
pipeline, each push of a group with at most HINT_EACH pushes there hints its own
change; a group with more (a backlog) is hinted once, by its last script call.

The feeds' memory is bounded in total, not per group: each group's stream keeps
``cluster.feed_total / cluster.groups`` entries (at least FEED_MIN, at most
``cluster.feed_maxlen``); a reader that falls further behind sees a gap and resyncs.

The key index (prefix scans)
----------------------------
Each group keeps a sorted set ``kvi:{t}`` of its live keys (score 0, so Redis orders
them by their bytes, ``ZRANGEBYLEX``). The push script maintains it in the same atomic
call as the record (``ZADD`` for a stored value, ``ZREM`` for a stored tombstone), so it
always agrees with the records, and, carrying the group's hash tag, it moves with its
slot like everything else of the group. :meth:`L3Store.index_range` pages through every
group's index: a read-only script per master (INDEX_LUA, up to INDEX_BATCH groups a
call) runs ``ZRANGEBYLEX … LIMIT 0 n`` on each of its groups, and the client merges the
sorted answers. **A page of n keys costs G index reads (G = ``cluster.groups``, 1,024 by
default) of O(log(keys of the group) + n) each, done inside Redis in about
max(1, G / (masters x INDEX_BATCH)) round trips per master, and returns up to G x n names
to merge** (few when the prefix is selective; then at most n GETs for the values, one
pipeline per master). See bench/bench_scan.py for figures. The index costs each record
one sorted-set entry (its key plus ~20 bytes). Data written before the index existed
has no entries: the first daemon of an upgraded cluster backfills them once
(:meth:`L3Store.backfill_index`, recorded in ``kvm:index``; ``kvcomm migrate --l3-index``
runs it by hand); every host's daemon and agents must run a KVCOMM with the index before
then, or writes of older ones go unindexed.

Expiry
------
A record whose extension field carries a deadline (``x`` key ``"e"``, epoch seconds:
:mod:`kvcomm.core.expiry`) is, from that deadline on, a tombstone at its version: every
reader treats it as absent, and the push script merges it by its version like any record
(a later write wins over it; an older write replayed after it is ``older`` and changes
nothing). The script stores a record already past its deadline as a tombstone would be
(out of the key index), and gives the Redis key ``PEXPIREAT deadline +
cluster.tombstone_grace``: the expired record stays, holding the version that refuses
replays, for the grace, and then Redis reclaims it. The grace must be at least the longest
backlog a partitioned host may replay (the default is a day); a write after the deadline
without a ttl makes the key permanent again (``SET`` clears the expiry). Each group also
keeps ``kvx:{t}``: its keys that have a deadline, scored by it, kept by the push script
with each record; the node daemon that stored a record with a deadline drops the keys
past their deadline from that group's key index through it, about once a second while the
group has such records (:meth:`L3Store.expire_index`, EXPIRE_INDEX_LUA; an idle daemon
sends nothing), so scans skip them without reading their records. (``kvx`` is named in ARGV, not KEYS, for the
reason the hint channel is: a declared key missing during a slot migration would refuse
every push of the group; the script touches it only for a record with a deadline or one
replacing such a record, and such a push during a migration of its slot may be refused
and retried until the migration ends.)

Pushing a record (:meth:`L3Store.push`, :meth:`L3Store.push_many`) runs the push script
(one call for up to PUSH_BATCH records, and PUSH_BATCH_BYTES of them, of one group: a
backlog of thousands is a few calls per group, not one per record; each record is handled
as a call of its own would),
which applies the incoming record atomically against the stored one by the L3 rule,
:func:`kvcomm.core.resolve.l3_rule` (newer replaces, older is refused and the stored
record comes back, concurrent → last-writer-wins with the merged vector, or ``conflict``
for an application resolver to settle; two concurrent counters of ``kv.incr`` — records of
tag 5, or tombstones of meta ``c`` carrying a deleted counter's state — merge their states
as :func:`kvcomm.core.counter.merge` does, by generation then maximum per actor, and a
plain record wins over a concurrent counter unless the counter adopted a put stamped at or
after it), and appends every change to the group's stream,
bounded by ``MAXLEN ~``. A stored value that is not a KVCOMM record at all (garbage,
another program's value, another Redis type, counters past ``MAX_COUNTER``) is replaced
by the push as if the key were absent (``new``): that is how "rewrite the key", the
advice of every CorruptRecord, repairs a key. A record of a *newer* format is not
replaced (``KVCOMMCORRUPT``: upgrade this host), and an incoming record that is not
valid is refused (``KVCOMMBAD``). The reply is, per record, ``{outcome, record L3
holds}``, the record left empty for ``new``, ``newer`` and an ``equal`` record of the very
bytes pushed: L3 holds the caller's own record. A call's replies carry back at most
PUSH_BATCH_BYTES of stored records; the records after that get ``KVCOMMLATER`` and are
sent again in another call.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Set
from typing import Any, NamedTuple

import msgpack

from .._extras import require_cluster
from .._threads import start_quiet
from ..core import codec
from ..core.expiry import deadline_of
from ..core.ext import EMPTY_EXT, MAX_EXT
from ..core.ext import ext_problem as _check_ext
from ..core.resolve import CONFLICT, EQUAL, MERGED, NEW, NEWER, OLDER
from ..core.versions import MAX_COUNTER, Dotted, Vector
from ..errors import ConfigError, CorruptRecord, Unavailable, UnsupportedValue
from .groups import DEFAULT_GROUPS, LEGACY_GROUPS, Groups, groups
from .groups import groups as _groups
from .hints import Hints

__all__ = ["CasResult", "CorruptRecord", "FeedEntry", "FeedNote", "L3Record", "L3Store",
           "PushResult", "GROUPS",
           "DEFAULT_GROUPS", "EMPTY_EXT", "FORMAT", "Groups", "group_of", "groups", "read_record",
           "record_key", "feed_key", "seq_key"]

log = logging.getLogger("kvcomm.l3")

GROUPS = DEFAULT_GROUPS  # (the older name of the default cluster.groups)
FORMAT = 2  # the record format written (see "When to bump FORMAT" above)
FIELDS = ("f", "h", "d", "t", "m", "v", "vv", "dot", "x")  # a format-2 record's keys
FEED_MAXLEN = 100_000  # events kept per group stream at most (approximate: MAXLEN ~)
FEED_TOTAL = 1_638_400  # events kept over all groups' streams (cluster.feed_total, >= 100 x groups)
FEED_MIN = 100  # events kept per group stream at least, however many groups
FEED_INLINE = 128  # records up to this size (bytes) ride in their feed entry; larger: value-less
HISTORIES_MAX = 1024  # nodes whose replication history L3Store.histories keeps at most
UNSEEN_RETRY = 60.0  # seconds before a node whose INFO was refused or odd is asked again
DOWN_PING_EVERY = 0.2  # seconds between PINGs of a master taken for down (L3Store.down)
HINT_EACH = 4  # a group's pushes in one pipeline up to which each hints its own entry
PUSH_BATCH = 256  # records of one group one push script call takes at most (~5 ms of Redis)
# record bytes one push script call takes at most (a record larger goes alone): Redis holds
# a call's arguments, and the script copies them into Lua, all at once; PUSH_BATCH records
# near cache.max_value_size would be gigabytes
PUSH_BATCH_BYTES = 1 << 20
HINT_ENTRIES_MAX = 100_000  # entries hints carried kept for hint_entries at most
# a write mark past this is junk (load_write_mark): a write sequence starts at the clock
# in µs (~1.8e15 in 2026) and takes one per write, so no host reaches 2**52 before ~2112;
# and a new L2 lifted to MAX_COUNTER would have no dot left to give
WRITE_MARK_MAX = MAX_COUNTER >> 1
# threads that call the masters at the same time (pushes, feed reads, sweeps): one per
# master, so that a call reaching many masters that stopped answering waits one timeout
# for all of them, not one per 8 (threads are started as calls need them, kept while idle)
MASTER_THREADS = 64
SWEEP_BATCH = 256  # group counters one sweep call reads (~0.7 ms of one master's time)
INDEX_BATCH = 512  # group indexes one call of a scan reads on one master
NODE_MAP_S = 1.0  # how long a scan trusts its map of the groups' masters
META_GROUPS = "kvm:groups"  # the group count L3 was initialised with
META_INDEX = "kvm:index"  # set once the key index covers every record (backfill_index)
# which keys the cluster keeps strong, copied from etcd (kvc/config/*) by every daemon that
# checked its config there, for agents without cluster.etcd (L3Store.strong_config)
META_STRONG = "kvm:strong"
STRONG_MAX = 65536  # the most bytes of META_STRONG read: more is not a value we wrote
# Redis commands one push costs (as INFO counts them, a script's own calls included):
PUSH_STORED = 6  # GET, ZADD, INCR, XADD, SET, SPUBLISH (a delete: ZREM and ZADD: 7)
PUSH_KEPT = 1  # GET (equal, older, conflict: nothing stored)
PUSH_CALL = 1  # EVALSHA: once per call, for up to PUSH_BATCH records of one group
OUTCOMES = (NEW, NEWER, OLDER, EQUAL, MERGED, CONFLICT)
QUARANTINE_MAX = 1000  # entries kept in a host's quarantine list (kvn:{host}:quarantine)

# Bounds of a valid record (see L3Record.decode). The value's own bound is the
# configured cache.max_value_size; these are the rest.
MAX_VALUE_SIZE = 64 << 20  # cache.max_value_size's default, for callers without a config
MAX_META = 4096  # the codec's meta is an array header: [dtype, shape] of at most 64 dims
MAX_ACTORS = 1024  # hosts in one version vector
_ACTOR = re.compile(rb"[A-Za-z0-9_.:-]{1,64}\Z")  # as node.host_id
_HLC = re.compile(rb"[0-9a-f]{16}\Z")
_FIELD_SET = frozenset(f.encode() for f in FIELDS)
# the msgpack framing of a record besides its value, meta, extension and vector: ample
_RECORD_OVERHEAD = 256 + MAX_META + MAX_EXT + MAX_ACTORS * (64 + 9 + 2)


def _valid_counter(c: object) -> bool:
    return type(c) is int and 1 <= c <= MAX_COUNTER  # (type(): a bool is not a counter)


class L3Record(NamedTuple):
    hlc: int
    tombstone: bool
    tag: int
    meta: bytes
    value: bytes
    vector: Vector
    dot: tuple[str, int]
    ext: bytes = EMPTY_EXT  # the extension map, packed: carried through unchanged

    @property
    def version(self) -> Dotted:
        return Dotted(self.vector, self.dot, self.hlc)

    @property
    def deadline(self) -> float | None:
        """The record's expiry in epoch seconds, from its extension field (None: never;
        :mod:`kvcomm.core.expiry`). Past it the record reads as a tombstone."""
        return deadline_of(self.ext)

    @property
    def local_ext(self) -> bytes:
        """The extension field as an L2 record stores it (b"" for the empty map)."""
        return b"" if self.ext == EMPTY_EXT else self.ext

    def encode(self) -> bytes:
        """The record in the current FORMAT (a msgpack map)."""
        flat: list[object] = []
        for actor, counter in self.vector:
            flat += [actor, counter]
        return msgpack.packb(  # type: ignore[no-any-return]
            {"f": FORMAT, "h": f"{self.hlc:016x}", "d": self.tombstone, "t": self.tag,
             "m": self.meta, "v": self.value, "vv": flat, "dot": [self.dot[0], self.dot[1]],
             "x": self.ext}, use_bin_type=False)  # Redis' cmsgpack has no bin type

    @staticmethod
    def decode(data: object, max_value_size: int = MAX_VALUE_SIZE) -> L3Record:
        """The record encoded in ``data`` (format 2, or the older format 1).

        Raises CorruptRecord, and nothing else, for any input that is not a valid
        record: an unknown format, missing or unknown fields, wrong types, a value over
        ``max_value_size``, meta over MAX_META, an extension that is not one msgpack map
        of at most MAX_EXT bytes with string keys, counters outside 1..2**53-1, actors
        that are not host ids, an HLC that is not 16 lowercase hex digits, or more than
        MAX_ACTORS actors. Memory used is bounded by ``len(data)``, which is itself
        bounded before unpacking.
        """
        if type(data) is not bytes:
            raise CorruptRecord(f"not a KVCOMM record (a {type(data).__name__}, not bytes)")
        if len(data) > max_value_size + _RECORD_OVERHEAD:
            raise CorruptRecord(f"not a KVCOMM record ({len(data)} bytes, over "
                                f"cache.max_value_size = {max_value_size} plus its header)")
        try:
            # every limit explicit: a length field can claim no more than these, whatever
            # the msgpack version's defaults
            r = msgpack.unpackb(data, raw=True, use_list=True, max_str_len=max_value_size,
                                max_bin_len=max_value_size, max_array_len=2 * MAX_ACTORS + 9,
                                max_map_len=len(FIELDS), max_ext_len=0)
        except Exception as exc:  # msgpack's errors have no common base beyond Exception
            raise CorruptRecord(f"not a KVCOMM record (msgpack: {exc})") from None
        if type(r) is list:  # format 1: the same fields, by position
            why = _check_v1(r, max_value_size)
            if not why:
                r = dict(zip((b"f", b"h", b"d", b"t", b"m", b"v", b"vv"), r[:7], strict=True)
                         ) | {b"dot": r[7:9], b"x": EMPTY_EXT}
        else:
            why = _check(r, max_value_size)
        if why:
            raise CorruptRecord(f"not a KVCOMM record ({why})")
        flat, dot = r[b"vv"], r[b"dot"]
        vector = tuple(sorted((flat[i].decode("ascii"), flat[i + 1])
                              for i in range(0, len(flat), 2)))
        return L3Record(int(r[b"h"], 16), r[b"d"], r[b"t"], r[b"m"], r[b"v"], vector,
                        (dot[0].decode("ascii"), dot[1]), r[b"x"])

    def decode_value(self, key: str = "") -> Any:
        """The Python value this (non-tombstone) record holds.

        Raises CorruptRecord, naming ``key``, when the tag, meta or payload do not decode
        (whatever the codec or numpy raised), or for a tombstone; UnsupportedValue only
        when the value is a numpy array and numpy is not installed.
        """
        if self.tombstone:
            raise CorruptRecord(f"L3 record of {key!r} is a tombstone: it holds no value")
        try:
            return codec.decode(self.tag, self.meta, self.value)
        except UnsupportedValue:
            raise  # numpy missing: not the record's fault, and the message says what to do
        except Exception as exc:  # codec, msgpack and numpy errors alike: hostile input
            raise CorruptRecord(f"L3 value of {key!r} cannot be decoded "
                                f"({type(exc).__name__}: {exc}); remove or rewrite the key"
                                ) from None


def read_record(raw: object, key: str = "", max_value_size: int = MAX_VALUE_SIZE) -> L3Record:
    """:meth:`L3Record.decode`, with a CorruptRecord that names ``key`` and says what to do."""
    try:
        return L3Record.decode(raw, max_value_size)
    except CorruptRecord as exc:
        raise CorruptRecord(f"L3 value of {key!r}: {exc}; remove or rewrite the key") from None


def _check(r: object, max_value_size: int) -> str:
    """Why ``r`` (msgpack-decoded with raw=True) is not a format-2 record; "" if it is."""
    if type(r) is not dict:
        return "neither a map nor an array"
    fmt = r.get(b"f")
    if type(fmt) is not int or fmt != FORMAT:
        return f"format {fmt!r}, not {FORMAT} (nor 1)"
    if r.keys() != _FIELD_SET:
        return f"fields are not {', '.join(FIELDS)}"
    dot = r[b"dot"]
    if type(dot) is not list or len(dot) != 2:
        return "the dot is not [host id, counter]"
    return (_check_fields(r[b"h"], r[b"d"], r[b"t"], r[b"m"], r[b"v"], r[b"vv"], dot[0], dot[1],
                          max_value_size)
            or _check_ext(r[b"x"]))


def _check_v1(r: list[Any], max_value_size: int) -> str:
    """Why ``r`` (an array) is not a format-1 record; "" if it is."""
    if len(r) != 9:
        return "not an array of 9 fields"
    fmt, hlc, tomb, tag, meta, value, flat, actor, counter = r
    if type(fmt) is not int or fmt != 1:
        return f"format {fmt!r}, not {FORMAT} (nor 1)"
    return _check_fields(hlc, tomb, tag, meta, value, flat, actor, counter, max_value_size)


def _check_fields(hlc: object, tomb: object, tag: object, meta: object, value: object,
                  flat: object, actor: object, counter: object, max_value_size: int) -> str:
    if type(hlc) is not bytes or not _HLC.match(hlc):
        return "hlc is not 16 lowercase hex digits"
    if type(tomb) is not bool:
        return "tombstone flag is not a bool"
    if type(tag) is not int or not 0 <= tag <= 255:
        return "tag is not an int in 0..255"
    if type(meta) is not bytes or len(meta) > MAX_META:
        return f"meta is not bytes of at most {MAX_META}"
    if type(value) is not bytes or len(value) > max_value_size:
        return f"value is not bytes of at most {max_value_size} (cache.max_value_size)"
    if type(flat) is not list or not flat or len(flat) % 2 or len(flat) > 2 * MAX_ACTORS:
        return f"version vector is not 1..{MAX_ACTORS} (actor, counter) pairs"
    seen = set()
    for i in range(0, len(flat), 2):
        a, c = flat[i], flat[i + 1]
        if type(a) is not bytes or not _ACTOR.match(a) or not _valid_counter(c):
            return "a version-vector entry is not (host id, counter in 1..2**53-1)"
        seen.add(a)
    if len(seen) != len(flat) // 2:
        return "an actor appears twice in the version vector"
    if type(actor) is not bytes or not _ACTOR.match(actor) or not _valid_counter(counter):
        return "the dot is not (host id, counter in 1..2**53-1)"
    return ""


def group_of(key: str, count: int = DEFAULT_GROUPS) -> int:
    """The group of ``key`` among ``count`` (``cluster.groups``)."""
    return groups(count).of(key)


def record_key(key: str, count: int = DEFAULT_GROUPS) -> str:
    return groups(count).record_key(key)


def feed_key(group: int, count: int = DEFAULT_GROUPS) -> str:
    return groups(count).feed_key(group)


def seq_key(group: int, count: int = DEFAULT_GROUPS) -> str:
    """The group's change counter: the sequence number of its latest feed entry."""
    return groups(count).seq_key(group)


# The L3 rule (kvcomm.core.resolve.l3_rule) run inside Redis, atomically per key, for the
# records of one group in one call (one EVALSHA per group and batch, not per record: a
# healed host's backlog of thousands costs a few calls, and each record costs its key and
# its bytes only; everything a group shares is sent once per call).
# KEYS[1] the group's feed stream, KEYS[2] its sequence counter, KEYS[3] its key index (a
# sorted set: see "The key index" above), KEYS[4..3+N] the N records' keys (kvc:{t}:k, all
# of the group; the user key k is the record key past its "kvc:{t}:" prefix, which is one
# byte longer than the feed key's "kvf:{t}": not sent again)
# ARGV[1] one character per record, in order: "l" (lww) or "s" (siblings: a concurrent
# record comes back as a conflict), ARGV[2] feed MAXLEN,
# ARGV[3] the group's hint channel (an argument, not a key: during a slot migration Redis
# counts a declared key that does not exist as missing, and would refuse every push), or
# "" for no hint (a stored value-less entry's hint carries the entry: "seq id note key";
# any other hint is the sequence number); ARGV[4] "e": each change the call stores hints
# its own entry (a group with at most HINT_EACH pushes), "l": the call hints the group's
# change once, at its end, even if it stored nothing (a backlog of thousands does not send
# every subscriber thousands of hints: the change itself if the call stored exactly one,
# else the sequence number, and readers XRANGE)
# ARGV[5] the largest record (bytes) a feed entry carries inline (FEED_INLINE; "": every
# record inline), ARGV[6] cluster.tombstone_grace in ms, ARGV[7] the group's expiry index
# (kvx, same hash tag; an argument for the same reason: see "Expiry" above),
# ARGV[8..7+N] the N incoming records, ARGV[8+N] (optional) the record bytes the replies may
# carry back (stored records L3 keeps: older, conflict, merged...): once the replies hold
# that many, the call's remaining records are not pushed and each gets a KVCOMMLATER
# error (the caller sends them again, in another call): PUSH_BATCH small records answered
# with PUSH_BATCH stored records near cache.max_value_size would be gigabytes read into
# Lua and sent back at once.
# Returns one reply per record, in order: {outcome, record L3 holds} (the record "" when L3
# holds the very bytes pushed: new, newer, equal) — for a change it stored (new, newer,
# merged) followed by the sequence number and stream id of the feed entry it wrote (the
# pusher can tell that a failover lost it before anyone read it: node/delivery.py,
# Unconfirmed) —, or an error (a
# malformed record: KVCOMMBAD; a stored record of a newer format: KVCOMMCORRUPT; a Redis
# error met while storing it, WRONGTYPE say): that record alone; the others are pushed,
# as N calls of one would have been (and, as those, what was written before an error
# stays: a script is not rolled back).
PUSH_LUA = r"""
local EMPTY_EXT = '\128'
local FEED, SEQ, INDEX = KEYS[1], KEYS[2], KEYS[3]
local N = #KEYS - 3
local FLAGS, MAXLEN, CHANNEL, HINTS = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local GRACE, XKEY = ARGV[6], ARGV[7]
local INLINE = tonumber(ARGV[5] or '')  -- (none: every record inline, as before)
local P = #FEED + 2  -- where the user key starts in a record key
local stored_n, last_hint, last_seq = 0, nil, nil
-- the record's deadline (epoch seconds: kvcomm.core.expiry), nil when none
local function deadline_of(x)
  if type(x) ~= 'string' or #x == 0 then return nil end
  local ok, m = pcall(cmsgpack.unpack, x)
  if not ok or type(m) ~= 'table' then return nil end
  local d = m.e
  if type(d) ~= 'number' or not (d > 0 and d < 1e300) then return nil end
  return d
end
local MAX_COUNTER = 9007199254740991  -- 2**53-1: every larger integer is a double >= 2**53
local function counter_ok(c)
  return type(c) == 'number' and c >= 1 and c <= MAX_COUNTER
end
-- a record as a table of named fields, or nil when it is not one (fields read by name;
-- a format-1 array is read into the same names); nil, 'newer' for a record of a format
-- newer than this script's
local function read(raw)
  local ok, r = pcall(cmsgpack.unpack, raw)
  if not ok or type(r) ~= 'table' then return nil end
  if r.f == nil and r[1] == 1 and #r == 9 then
    r = {f = 1, h = r[2], d = r[3], t = r[4], m = r[5], v = r[6], vv = r[7],
         dot = {r[8], r[9]}, x = EMPTY_EXT}
  elseif type(r.f) == 'number' and r.f > 2 then
    return nil, 'newer'
  elseif r.f ~= 2 then
    return nil
  end
  if type(r.h) ~= 'string' or #r.h ~= 16 or type(r.d) ~= 'boolean'
     or type(r.t) ~= 'number' or type(r.m) ~= 'string' or type(r.v) ~= 'string'
     or type(r.x) ~= 'string' or type(r.vv) ~= 'table' or type(r.dot) ~= 'table'
     or type(r.dot[1]) ~= 'string' or not counter_ok(r.dot[2]) then
    return nil
  end
  local f = r.vv
  if #f % 2 ~= 0 then return nil end
  for i = 1, #f, 2 do
    if type(f[i]) ~= 'string' or not counter_ok(f[i + 1]) then return nil end
  end
  return r
end
-- a counter's state (kvcomm.core.counter: actor -> {p, n, bp, bn}) from a live counter
-- (tag COUNTER) or a deleted one (a tombstone of meta 'c'); nil for any other record, or
-- a state that is not one (the record then merges as a plain one)
local COUNTER = 5
local function counter_of(r)
  if not ((r.t == COUNTER and not r.d) or (r.d and r.m == 'c')) then return nil end
  local ok, st = pcall(cmsgpack.unpack, r.v)
  if not ok or type(st) ~= 'table' then return nil end
  for k, e in pairs(st) do
    if type(k) ~= 'string' or type(e) ~= 'table' or #e ~= 4 then return nil end
    for j = 1, 4 do
      if type(e[j]) ~= 'number' or e[j] < 0 or e[j] > MAX_COUNTER then return nil end
    end
  end
  return st
end
-- two states merged: the later generation (the entry '': the put a counter adopted)
-- whole; of one generation, actor by actor, the greatest of each number
local NO_GEN = {0, 0, 0, 0}
local function merge_counters(a, b)
  local ga, gb = a[''] or NO_GEN, b[''] or NO_GEN
  for j = 1, 3 do
    if ga[j] > gb[j] then return a elseif ga[j] < gb[j] then return b end
  end
  local out = {}
  for k, e in pairs(a) do out[k] = {e[1], e[2], e[3], e[4]} end
  for k, e in pairs(b) do
    local o = out[k]
    if o == nil then
      out[k] = {e[1], e[2], e[3], e[4]}
    else
      for j = 1, 4 do if e[j] > o[j] then o[j] = e[j] end end
    end
  end
  return out
end
-- whether a counter adopted a put (its generation) stamped at or after the HLC h (a
-- record's 16 hex digits): it was counted after that plain record (kvcomm._client.counters
-- .adopted_since), and wins over it
local function adopted_since(st, h)
  local g = st['']
  if g == nil then return false end
  local hi, lo = tonumber(string.sub(h, 1, 8), 16), tonumber(string.sub(h, 9, 16), 16)
  if hi == nil or lo == nil then return false end
  return g[1] > hi or (g[1] == hi and g[2] >= lo)
end
local function counter_live(st)
  for k, e in pairs(st) do
    if k ~= '' and (e[1] ~= e[3] or e[2] ~= e[4]) then return true end
  end
  return false
end
local function vv(r)
  local t = {}
  local f = r.vv
  for i = 1, #f, 2 do t[f[i]] = f[i + 1] end
  return t
end
-- a value-less entry's version note: 'counter:flags:actor', the record's dot (flags:
-- d = tombstone, m = merged here; the actor last, since a host id may hold ':')
local function note(r, merged)
  local flags = ''
  if r.d then flags = 'd' end
  if merged then flags = flags .. 'm' end
  return string.format('%d', r.dot[2]) .. ':' .. flags .. ':' .. r.dot[1]
end
local function store(rkey, key, bytes, r, merged, prev)
  -- (a script is not rolled back on error: the record goes last, once its feed entry and
  -- its index entry are in)
  local dead = r.d
  -- a record past its deadline is a tombstone at its version: out of the key index
  local d = deadline_of(r.x)
  if d ~= nil then
    local t = redis.call('TIME')
    if d <= tonumber(t[1]) + tonumber(t[2]) / 1e6 then dead = true end
  end
  -- (kvx is touched only by records with a deadline or replacing one: a key named in
  -- ARGV that is not local during a slot migration fails the push, which is retried)
  if XKEY then
    if d ~= nil and not dead then
      redis.call('ZADD', XKEY, d, key)
    elseif d ~= nil or (prev ~= nil and deadline_of(prev.x) ~= nil) then
      redis.call('ZREM', XKEY, key)
    end
  end
  if dead then
    redis.call('ZREM', INDEX, key)
    -- the empty member (no key is empty) keeps the index of a group that was ever written
    -- in existence: a push declaring it during a slot migration then finds it where the
    -- group's other keys are, instead of retrying (TRYAGAIN) until the migration ends
    redis.call('ZADD', INDEX, 0, '')
  else
    redis.call('ZADD', INDEX, 0, key)
  end
  local s = redis.pcall('INCR', SEQ)
  if type(s) ~= 'number' then  -- a foreign value: restart the sequence (readers resync)
    redis.call('DEL', SEQ)
    s = redis.call('INCR', SEQ)
  end
  local hint = s  -- (an inline entry's hint: the group's sequence number; readers XRANGE)
  local id
  if INLINE == nil or #bytes <= INLINE then  -- the record itself (the format-1 entry)
    id = redis.call('XADD', FEED, 'MAXLEN', '~', MAXLEN, '*', 'k', key, 'r', bytes, 's', s)
  else  -- value-less: readers GET the record if they want the key ('q', not 's': a
    -- reader that knows only 's' finds no sequence number and resyncs the group)
    local n = note(r, merged)
    id = redis.call('XADD', FEED, 'MAXLEN', '~', MAXLEN, '*', 'k', key, 'q', s, 'n', n)
    -- the hint carries the whole entry ("seq id note key"): a reader that follows the
    -- group's sequence applies it without reading the stream
    hint = string.format('%d', s) .. ' ' .. id .. ' ' .. n .. ' ' .. key
  end
  redis.call('SET', rkey, bytes)
  if d ~= nil and GRACE then
    -- kept past its deadline as a tombstone for the grace (so that no replayed older
    -- write comes back), then Redis reclaims it; a later write without one clears this
    -- (a deadline past 2**53 ms, some 285,000 years, is given none: Redis refused the
    -- number, after the record was stored, and the push failed every time)
    local at = math.floor(d * 1000) + tonumber(GRACE)
    if at < 9007199254740992 then
      redis.call('PEXPIREAT', rkey, string.format('%.0f', at))
    end
  end
  stored_n, last_hint, last_seq = stored_n + 1, hint, s
  -- the hint: lost hints cost time (the sweep finds the change), never the change itself;
  -- pcall: a server without sharded pub/sub (Redis 6) still stores the record
  if HINTS == 'e' and CHANNEL and CHANNEL ~= '' then
    redis.pcall('SPUBLISH', CHANNEL, hint)
  end
  return s, id
end
-- one record (the i-th): its reply
local function push(i)
  local rkey, bytes = KEYS[3 + i], ARGV[7 + i]
  local key = string.sub(rkey, P)
  local incoming = read(bytes)
  if incoming == nil then
    return redis.error_reply('KVCOMMBAD incoming record is malformed')
  end
  local raw = redis.pcall('GET', rkey)
  if type(raw) == 'table' then raw = '' end  -- another Redis type under the name (WRONGTYPE)
  -- (new, newer: L3 holds the caller's own record, which the reply does not send back)
  if not raw then
    local s, id = store(rkey, key, bytes, incoming, false)
    return {'new', '', s, id}
  end
  local stored, why = read(raw)
  if stored == nil and why == 'newer' then
    return redis.error_reply('KVCOMMCORRUPT stored record has a newer format than this ' ..
                             'host reads; upgrade this host')
  end
  if stored == nil then  -- not a KVCOMM record at all: rewriting the key replaces it
    local s, id = store(rkey, key, bytes, incoming, false)
    return {'new', '', s, id}
  end
  local a, b = vv(incoming), vv(stored)
  local a_ge, b_ge = true, true
  for k, v in pairs(b) do
    local x = a[k] or 0
    if x < v then a_ge = false elseif x > v then b_ge = false end
  end
  for k, v in pairs(a) do
    if b[k] == nil then b_ge = false end
  end
  if a_ge and b_ge then
    -- (the very bytes pushed: not sent back, as for new and newer; a replayed backlog)
    if raw == bytes then return {'equal', ''} end
    return {'equal', raw}
  end
  if a_ge then
    local s, id = store(rkey, key, bytes, incoming, false, stored)
    return {'newer', '', s, id}
  end
  if b_ge then return {'older', raw} end
  -- concurrent counters (kvcomm.core.counter) merge here, before any resolver
  local cs, ci = counter_of(stored), counter_of(incoming)
  if (cs == nil and ci == nil) and string.sub(FLAGS, i, i) == 's' then
    return {'conflict', raw}
  end
  -- concurrent: last writer wins by (hlc, dot actor, dot counter); vectors merged
  local win = stored
  if incoming.h > stored.h or (incoming.h == stored.h and (incoming.dot[1] > stored.dot[1]
     or (incoming.dot[1] == stored.dot[1] and incoming.dot[2] > stored.dot[2]))) then
    win = incoming
  end
  local counted = nil
  if cs ~= nil and ci ~= nil then
    counted = merge_counters(cs, ci)
  elseif cs ~= nil then
    -- a plain record (a put, a delete without a state) resets a counter, unless the
    -- counter adopted a put stamped at or after it
    if adopted_since(cs, incoming.h) then win = stored else win = incoming end
  elseif ci ~= nil then
    if adopted_since(ci, stored.h) then win = incoming else win = stored end
  end
  local merged = {}
  for k, v in pairs(b) do merged[k] = v end
  for k, v in pairs(a) do if (merged[k] or 0) < v then merged[k] = v end end
  local actors = {}
  for k, _ in pairs(merged) do actors[#actors + 1] = k end
  table.sort(actors)
  local flat = {}
  for _, k in ipairs(actors) do flat[#flat + 1] = k; flat[#flat + 1] = merged[k] end
  -- the winner's fields by name, in format 2; its extension copied as the bytes it was
  local out = {f = 2, h = win.h, d = win.d, t = win.t, m = win.m, v = win.v, vv = flat,
               dot = {win.dot[1], win.dot[2]}, x = win.x}
  if counted ~= nil then  -- the merged state: a counter, or a deleted one if nothing counts
    out.v = cmsgpack.pack(counted)
    if counter_live(counted) then
      out.d, out.t, out.m = false, COUNTER, ''
    else
      out.d, out.t, out.m = true, 0, 'c'
    end
  end
  local packed = cmsgpack.pack(out)
  local s, id = store(rkey, key, packed, out, true, stored)
  return {'merged', packed, s, id}
end
local replies = {}
-- the bytes of records the replies carry back (each read into Lua): past the budget the
-- call's remaining records are left for another call (their reply says so)
local BUDGET, out_bytes = tonumber(ARGV[8 + N] or ''), 0
for i = 1, N do
  if BUDGET ~= nil and out_bytes >= BUDGET then
    replies[i] = redis.error_reply('KVCOMMLATER the call\'s reply budget is spent: send again')
  else
    -- a Redis error while one record is stored (a foreign type under the group's stream,
    -- say) is that record's reply; the next records are pushed as if called one by one
    local ok, reply = pcall(push, i)
    if not ok then
      if type(reply) == 'table' and reply.err then
        reply = redis.error_reply(reply.err)
      else
        reply = redis.error_reply(tostring(reply))
      end
    end
    if type(reply) == 'table' and type(reply[2]) == 'string' then
      out_bytes = out_bytes + #reply[2]
    end
    replies[i] = reply
  end
end
-- one hint for the call ("l"): the change itself when it is the only one, else the
-- group's sequence number (also when nothing was stored: an earlier call's changes)
if HINTS == 'l' and CHANNEL and CHANNEL ~= '' then
  if stored_n == 1 then
    redis.pcall('SPUBLISH', CHANNEL, last_hint)
  elseif last_seq ~= nil then
    redis.pcall('SPUBLISH', CHANNEL, string.format('%d', last_seq))
  else
    local s = redis.pcall('GET', SEQ)
    if type(s) ~= 'string' then s = '0' end
    redis.pcall('SPUBLISH', CHANNEL, s)
  end
end
return replies
"""

# A conditional write (L3Store.push_if): the expectation checked against the record L3
# holds, then, if it holds, the push script itself (PUSH_LUA, appended whole: one record,
# pushed as push() pushes it), all in one atomic call on the key's master. The call's
# keys and arguments are those of a push of the one record (L3Store._args) followed by
# three more, taken off ARGV before the push script runs: the expectation "a" (the key
# absent: no record, a tombstone, or past its deadline) or "v" (a version), then two
# msgpack arrays of flattened vectors [actor, counter, ...]: ``check`` and ``basis``.
# Passes when L3 holds no record (nothing to contradict: a write of this host not yet
# pushed, or one a failover lost); with "a" when the record is dead or its vector is
# at most ``check`` (the host's own delete not yet in L3 covers it; [] otherwise); with
# "v" when the record's vector is at most ``check`` (the expected version, or one it
# descends from: the host's own write not yet in L3 being the expected one, pushing it
# first would have been "newer"), unless it is the expected version itself and dead.
# The pushed record's vector is ``basis`` (which covers ``check``) plus a new dot, so a
# record that passes is older than it and the push stores it ("new" or "newer"); only a
# dead record "a" passes over may be newer than ``basis`` in part: then "stale" comes
# back, with that record, and the caller pushes again with its vector merged in.
# Returns a list of one reply, as the push script does: {"conflict", the record L3 holds
# ("" none)}, {"stale", that record}, or the push script's own reply.
CAS_LUA = r"""
local CAS_MODE, CAS_CHECK, CAS_BASIS = ARGV[#ARGV - 2], ARGV[#ARGV - 1], ARGV[#ARGV]
for _ = 1, 3 do ARGV[#ARGV] = nil end
local function cas_vv(flat)
  if type(flat) ~= 'table' or #flat % 2 ~= 0 then return nil end
  local t = {}
  for i = 1, #flat, 2 do
    if type(flat[i]) ~= 'string' or type(flat[i + 1]) ~= 'number' then return nil end
    t[flat[i]] = flat[i + 1]
  end
  return t
end
local function cas_le(a, b)
  for k, v in pairs(a) do if (b[k] or 0) < v then return false end end
  return true
end
local cas_ok1, cas_check = pcall(cmsgpack.unpack, CAS_CHECK or '')
local cas_ok2, cas_basis = pcall(cmsgpack.unpack, CAS_BASIS or '')
cas_check, cas_basis = cas_vv(cas_check), cas_vv(cas_basis)
if not (cas_ok1 and cas_ok2) or cas_check == nil or cas_basis == nil
   or (CAS_MODE ~= 'a' and CAS_MODE ~= 'v') then
  return {redis.error_reply('KVCOMMBAD the expectation of a conditional write is malformed')}
end
local cas_raw = redis.pcall('GET', KEYS[#KEYS])
local cas_s, cas_dead = nil, false
if type(cas_raw) == 'string' then
  local ok, r = pcall(cmsgpack.unpack, cas_raw)
  if ok and type(r) == 'table' then
    if r.f == nil and r[1] == 1 and #r == 9 then
      r = {f = 1, vv = r[7], d = r[3], x = ''}
    elseif type(r.f) == 'number' and r.f > 2 then
      return {redis.error_reply('KVCOMMCORRUPT stored record has a newer format than this ' ..
                                'host reads; upgrade this host')}
    end
    if r.f == 1 or r.f == 2 then cas_s = cas_vv(r.vv) end
    if cas_s ~= nil then
      cas_dead = r.d == true
      if not cas_dead and type(r.x) == 'string' and #r.x > 0 then
        local okx, m = pcall(cmsgpack.unpack, r.x)
        if okx and type(m) == 'table' and type(m.e) == 'number' and m.e > 0 and m.e < 1e300 then
          local t = redis.call('TIME')
          if m.e <= tonumber(t[1]) + tonumber(t[2]) / 1e6 then cas_dead = true end
        end
      end
    end
  end
else
  cas_raw = ''  -- (none; or another Redis type, which the push replaces as it would)
end
if cas_s ~= nil then
  local pass
  if CAS_MODE == 'a' then
    pass = cas_dead or cas_le(cas_s, cas_check)
  else
    pass = cas_le(cas_s, cas_check) and not (cas_dead and cas_le(cas_check, cas_s))
  end
  if not pass then return {{'conflict', cas_raw}} end
  if not cas_le(cas_s, cas_basis) then return {{'stale', cas_raw}} end
end
""" + PUSH_LUA

# A group's feed position, read atomically: {sequence number, id of the last entry kept
# or "0-0"}. A reader that resumes from there misses nothing and re-reads nothing.
# KEYS[1] the group's feed stream, KEYS[2] its sequence counter
POSITION_LUA = r"""
local s = tonumber(redis.call('GET', KEYS[2]) or '0') or -1
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #last == 0 then return {s, '0-0'} end
return {s, last[1][1]}
"""

# Group counters of many slots of one master in one call: a GET each (redis.pcall: a slot
# that is not this node's, or is being migrated, answers an error instead, and the caller
# reads that counter again through the cluster client), and the id of the last entry of
# each group's stream (its *tail*: a reader whose last sequence number is the counter must
# be positioned there, or the number was reissued: see "Sequence numbers"). Read-only, and
# declared cross-slot: Redis 7 lets a script touch keys of several slots of its node that
# way. ARGV[1] "1": read the tails too ("0": the counters alone); ARGV[2] the groups' hash
# tags, space-separated (the counter is ``kvs:{t}``, the stream ``kvf:{t}``): ~4 bytes a
# group on the wire, where the key names as arguments took ~22 — the sweep reads every
# group's counter every second, from every host. Returns one string, a field per group
# separated by commas: "" (no counter), the counter's digits, "?" (a foreign value), or
# "E" (an error: read again), then, with tails, a space and the tail's id when the group
# has one. Nothing of a value but digits goes into it (no separator can be smuggled).
SWEEP_LUA = r"""#!lua flags=no-writes,allow-cross-slot-keys
local out = {}
local tails = ARGV[1] == '1'
for t in string.gmatch(ARGV[2], '%S+') do
  local r = redis.pcall('GET', 'kvs:{' .. t .. '}')
  local f
  if type(r) == 'table' then f = 'E'
  elseif not r then f = ''
  elseif #r < 20 and string.match(r, '^%d+$') then f = r
  else f = '?' end
  if tails and f ~= 'E' then
    local x = redis.pcall('XREVRANGE', 'kvf:{' .. t .. '}', '+', '-', 'COUNT', 1)
    if type(x) == 'table' and not x.err and #x == 1 then f = f .. ' ' .. x[1][1] end
  end
  out[#out + 1] = f
end
return table.concat(out, ',')
"""

# Whether a group's stream lost the entry at a reader's cursor while keeping an older
# one: 1 then, else 0 (the cursor's entry is there, or nothing at or before it is: trimmed
# past it, which removes the oldest entries first, never an entry while keeping an older
# one). Only a failover (or a foreign XDEL) loses an entry that way, and the next entries
# may then follow the reader's last sequence number while the entries that reissued its
# numbers lie before its cursor. KEYS[1] the stream, ARGV[1] the cursor. Read-only.
CURSOR_LUA = r"""#!lua flags=no-writes
local at = redis.call('XREVRANGE', KEYS[1], ARGV[1], '-', 'COUNT', 1)
if #at == 1 and at[1][1] ~= ARGV[1] then return 1 end
return 0
"""

# One page of many groups' key indexes on one master in one call (L3Store.index_range):
# ZRANGEBYLEX ARGV[1] ARGV[2] LIMIT 0 ARGV[3] of each index named from ARGV[4] on. Returns,
# per index, its keys in order, or an error text (a slot not served here, or moving: the
# caller reads that group again through the cluster client). The merge is the caller's:
# Lua's string order follows the server's locale, not the bytes. Read-only, cross-slot.
INDEX_LUA = r"""#!lua flags=no-writes,allow-cross-slot-keys
local out = {}
local limit = tonumber(ARGV[3])
for i = 4, #ARGV do
  local r = redis.pcall('ZRANGEBYLEX', ARGV[i], ARGV[1], ARGV[2], 'LIMIT', 0, limit)
  if type(r) == 'table' and r.err then out[i - 3] = 'ERR ' .. r.err else out[i - 3] = r end
end
return out
"""

# Keys past their deadline leave their groups' key indexes (L3Store.expire_index): ARGV[1]
# now (epoch seconds), ARGV[2] at most this many keys per group, ARGV[3..] pairs of a
# group's expiry index (kvx) and key index (kvi), all of one master. The push script keeps
# each kvx score equal to the key's current deadline, so a due member is an expired key.
# Returns the keys dropped.
EXPIRE_INDEX_LUA = r"""#!lua flags=allow-cross-slot-keys
local n = 0
for i = 3, #ARGV, 2 do
  local due = redis.pcall('ZRANGEBYSCORE', ARGV[i], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
  if type(due) == 'table' and not due.err then
    for _, k in ipairs(due) do
      redis.call('ZREM', ARGV[i + 1], k)
      redis.call('ZREM', ARGV[i], k)
      n = n + 1
    end
  end
end
return n
"""

# One record's key index entry from the record itself (L3Store.backfill_index), atomically
# with it: KEYS[1] the record, KEYS[2] the group's index; ARGV[1] the user key. A record
# the script cannot read as one (foreign) is left out of the index, as a tombstone is.
BACKFILL_LUA = r"""
local raw = redis.pcall('GET', KEYS[1])
local live = false
if type(raw) == 'string' then
  local ok, r = pcall(cmsgpack.unpack, raw)
  if ok and type(r) == 'table' then
    if r.f == nil and r[1] == 1 then live = r[3] == false else live = r.d == false end
  end
end
if live then
  redis.call('ZADD', KEYS[2], 0, ARGV[1])
else
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('ZADD', KEYS[2], 0, '')
end
return live and 1 or 0
"""

# Redis errors that say "not now" (a failover, a slot on the move, a restarted node)
# rather than "not this key": they become Unavailable, and the caller retries.
_TRANSIENT = ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN", "LOADING", "MASTERDOWN", "READONLY",
              "NOSCRIPT", "BUSY", "NOREPLICAS", "OOM", "NOPERM", "NOAUTH")




def _noscript(reply: object) -> bool:
    """True when ``reply`` is Redis's NOSCRIPT error (a node that lost its scripts: a
    restart). redis-py raises it as NoScriptError, whose text lacks the word."""
    return isinstance(reply, Exception) and (type(reply).__name__ == "NoScriptError"
                                             or "NOSCRIPT" in str(reply))


def _key_error(msg: str) -> bool:
    """True when a Redis error concerns the value under one key (a foreign value)."""
    return ("KVCOMMCORRUPT" in msg or "KVCOMMBAD" in msg or "WRONGTYPE" in msg
            or "not an integer" in msg)


class FeedNote(NamedTuple):
    """The version a value-less feed entry announces, the record's dot and two flags
    (the record itself stays in L3)."""

    writer: str  # the host of the write that made the record (its dot's actor)
    counter: int  # the dot's counter
    tombstone: bool
    merged: bool  # the push script merged two hosts' records (the vector is a new one)


class FeedEntry(NamedTuple):
    """One change-feed entry. ``key`` is None and ``problem`` says why when the entry
    cannot be used (a key field that is not strict UTF-8, say); ``seq`` is None when
    the entry has no valid sequence number (written by something else). An entry
    carries either the record (``record``, ``note`` None: inline) or only its version
    (``note``, ``record`` b"": value-less; read the record from L3 if the key is wanted)."""

    id: bytes
    key: str | None
    record: bytes
    seq: int | None
    problem: str = ""
    note: FeedNote | None = None


def _seq(raw: object) -> int | None:
    return int(raw) if isinstance(raw, bytes) and raw.isdigit() and len(raw) < 20 else None


def _note(raw: bytes) -> FeedNote | None:
    """A value-less entry's note (``counter:flags:actor``), or None if it is not one."""
    parts = raw.split(b":", 2)
    if len(parts) != 3:
        return None
    counter, flags, actor = parts
    if (not counter.isdigit() or len(counter) > 16 or not _valid_counter(int(counter))
            or not _ACTOR.match(actor) or flags not in (b"", b"d", b"m", b"dm")):
        return None
    return FeedNote(actor.decode("ascii"), int(counter), b"d" in flags, b"m" in flags)


def _entry(eid: Any, fields: Any) -> FeedEntry:
    """Parse one XRANGE row, never raising: whatever is wrong goes into ``problem``.
    Both kinds of entry are read: inline ``{k, r, s}`` (every entry before value-less
    ones existed) and value-less ``{k, q, n}``."""
    eid = eid if isinstance(eid, bytes) else str(eid).encode()
    if not isinstance(fields, dict):
        return FeedEntry(eid, None, b"", None, "entry fields are not a map")
    kb, rec, raw_note = fields.get(b"k"), fields.get(b"r"), fields.get(b"n")
    note = None
    if isinstance(raw_note, bytes) and rec is None:  # value-less
        seq = _seq(fields.get(b"q"))
        note = _note(raw_note)
        if note is None:
            return FeedEntry(eid, None, b"", seq, f"entry's version note {raw_note[:80]!r} "
                             "is not counter:flags:host")
        rec = b""
    else:
        seq = _seq(fields.get(b"s"))
    if not isinstance(kb, bytes) or not isinstance(rec, bytes):
        return FeedEntry(eid, None, b"", seq, "entry lacks its key (k) or record (r) field")
    try:
        key = kb.decode("utf-8")  # strict: no lone surrogates, nothing redis-py cannot send
    except UnicodeDecodeError:
        return FeedEntry(eid, None, rec, seq, f"key {kb[:80]!r} is not valid UTF-8")
    if not key or "\0" in key:
        return FeedEntry(eid, None, rec, seq, f"key {kb[:80]!r} is empty or holds NUL")
    return FeedEntry(eid, key, rec, seq, "", note)


def _hint_entry(data: bytes) -> FeedEntry | None:
    """The value-less feed entry a hint carries (``seq id note key``: see the push
    script), or None when ``data`` is not one (never raising: a hint may come from
    anything that can publish)."""
    parts = data.split(b" ", 3)
    if len(parts) != 4:
        return None
    raw_seq, eid, raw_note, kb = parts
    seq, note = _seq(raw_seq), _note(raw_note)
    if seq is None or note is None or not _valid_id(eid):
        return None
    try:
        key = kb.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if not key or "\0" in key:
        return None
    return FeedEntry(eid, key, b"", seq, "", note)


class Unreached(Unavailable):
    """Not sent: the master that serves it did not answer lately (a timeout, a refused
    connection) and is skipped until it answers a PING (:attr:`L3Store.down`), so that
    one hung master does not hold up the work of the others. In :meth:`L3Store.push_many`'s
    answers, in the place of a record not pushed (send it again later); raised by a
    call that reached nothing."""


class PushResult(NamedTuple):
    """L3's answer to one pushed record."""

    key: str
    outcome: str  # one of OUTCOMES
    record: L3Record  # what L3 holds afterwards (for "conflict": what it holds now)
    durable: bool = True  # a replica acknowledged it (WAIT), so a failover keeps it
    # new, newer (and equal, when L3 held these very bytes): the record's bytes as pushed,
    # which L3 holds (a new or newer one's feed entry carries them, when inline): the
    # pusher can tell its own echo without decoding it
    sent: bytes = b""
    # a change stored (new, newer, merged): its feed entry's sequence number and stream id
    seq: int | None = None
    entry: bytes = b""
    # acknowledged (durable) by fewer replicas than cluster.wait_replicas asked: the master
    # had fewer connected, and the wait was lowered to those (_replicas_to_wait); a
    # failover may still lose it. ``node`` and ``call`` name the master and the pipeline
    # that wrote it, ``history`` the replication history that master ran when last seen
    # before the pipeline (L3Store.histories): a later probe there that reaches the
    # target in that same history (``L3Store.confirmed``) covers it, since WAIT counts
    # replicas up to the connection's last write
    short: bool = False
    node: str = ""
    call: int = 0
    history: str = ""


class CasResult(NamedTuple):
    """L3's answer to a conditional write (:meth:`L3Store.push_if`)."""

    outcome: str  # "won" (stored), "conflict" (refused), "stale" (push again: see CAS_LUA)
    record: L3Record | None  # won: the record pushed; else what L3 holds (None: nothing)
    durable: bool = True  # won: cluster.wait_replicas replicas (those connected) took it


class L3Store:
    """The cluster tier over redis-py's RedisCluster (MOVED/ASK and failover are its own).

    Credentials and TLS come from the caller's config, never from code. Redis errors are
    translated: connection trouble → Unavailable, a foreign value under one key →
    CorruptRecord for that key. ``max_value_size`` (``cache.max_value_size``) bounds
    what a record read back may hold. ``groups`` is ``cluster.groups``; each group's
    stream keeps ``feed_total / groups`` entries, within FEED_MIN..``feed_maxlen``. A
    push's feed entry carries its record when that is at most ``feed_inline`` bytes
    (``cluster.feed_inline``), else only the key and the record's dot (value-less); None
    writes every entry inline, as KVCOMM did before value-less entries.
    """

    def __init__(self, seeds: Sequence[tuple[str, int]], *, password: str | None = None,
                 username: str | None = None, tls: bool = False, timeout: float = 2.0,
                 feed_maxlen: int = FEED_MAXLEN, wait_replicas: int = 0,
                 wait_ms: int = 100, max_value_size: int = MAX_VALUE_SIZE,
                 groups: int = DEFAULT_GROUPS, feed_total: int = FEED_TOTAL,
                 tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None,
                 address_remap: Callable[[tuple[str, int]], tuple[str, int]] | None = None,
                 retries: int | None = None,
                 feed_inline: int | None = FEED_INLINE,
                 tombstone_grace: float = 86400.0,
                 bounded_refresh: bool = False) -> None:
        require_cluster()  # a ConfigError naming kvcomm[cluster] when redis-py is missing
        from redis.cluster import ClusterNode

        from ..metrics.wire import counting_cluster

        extra: dict[str, Any] = {}
        if address_remap is not None:  # cluster.address_remap: every node through it
            extra["address_remap"] = address_remap
        if retries is not None:
            # redis-py retries a command that timed out up to 10 times, re-reading the slot
            # map from the seeds before each (every seed costs a timeout when the host is
            # cut off): one call could hold its caller for tens of timeouts. The node
            # daemon passes 0: its loop has its own backoff, and must come back quickly
            # to decide partition mode and to notice the heal
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            extra["retry"] = Retry(NoBackoff(), retries)
        try:
            self.groups: Groups = _groups(groups)
        except ValueError as exc:
            raise ConfigError("cluster.groups", str(exc)) from None
        try:
            self.rc = counting_cluster()(
                startup_nodes=[ClusterNode(h, p) for h, p in seeds],  # type: ignore[no-untyped-call]
                decode_responses=False,
                password=password, username=username, ssl=tls, socket_timeout=timeout,
                socket_connect_timeout=timeout, require_full_coverage=True,
                # cluster.redis_ca / redis_cert / redis_key (None: redis-py's defaults)
                ssl_ca_certs=tls_ca, ssl_certfile=tls_cert, ssl_keyfile=tls_key, **extra,
            )
        except Exception as exc:
            raise Unavailable(f"cannot reach Redis Cluster at {list(seeds)}: {exc}") from None
        if address_remap is not None:  # (MOVED and ASK too: tiers/routing.py)
            from .routing import follow_remap

            follow_remap(self.rc, address_remap)
        if bounded_refresh:
            _bound_refresh(self.rc.nodes_manager, timeout)
        self.wire = self.rc.wire  # type: ignore[attr-defined]  # commands and bytes to and from Redis (kvcomm metrics)
        self.feed_maxlen = min(feed_maxlen, max(FEED_MIN, feed_total // groups))
        # a push's feed entry carries the record up to this size (None: always)
        self.feed_inline = feed_inline
        self.timeout = timeout
        self.auth = (username, password)  # (for MIGRATE's AUTH: kvcomm.balance.migrate)
        self.wait_replicas, self.wait_ms = wait_replicas, wait_ms
        self.degraded: dict[str, int] = {}  # master → writes acknowledged by fewer replicas
        # master → (the latest probe (confirm_replicated) there that cluster.wait_replicas
        # replicas acknowledged, the replication history the master ran after that WAIT):
        # every write on that master before the probe, in that history, is on that many
        # replicas (WAIT counts up to the connection's last write). A node name alone is
        # not enough: a failback (the master fails over, losing a write, then is made
        # master again at the same address) or a restart keeps the name, not the write
        self.confirmed: dict[str, tuple[int, str]] = {}
        # node → its replication history when last seen (INFO): "<run_id>:<master_replid>"
        # while a master, "" while not one. A master's replid changes whenever its data
        # may stop being a prefix of what it had (promoted, demoted and resynced, full
        # sync) and run_id on every restart (which may reload the replid from the RDB
        # file: the replid alone would not do), and neither ever comes back: a node seen
        # twice with one history was a master throughout, appending to the same data
        self.histories: dict[str, str] = {}
        # node → monotonic time before which its INFO is not asked again: it was refused
        # (an ACL without INFO, a proxy) or not INFO's — else every push pipeline there
        # would send it again, forever; its history stays unknown (what it took short
        # of its replicas is held until the bound: never confirmable)
        self._unseen: dict[str, float] = {}
        # (node, group) pairs whose probe the node refused with MOVED since the daemon
        # last took them: the group's slot moved off the master that took its held
        # records (a migration), so no WAIT there could ever confirm them
        self.unserved: set[tuple[str, int]] = set()
        self._calls = itertools.count(1)  # (next() is atomic: pipelines run in threads)
        self.connected: dict[str, int] = {}  # master → replicas it had at the last write
        self.max_value_size = max_value_size
        self.tombstone_grace_ms = int(tombstone_grace * 1000)  # (cluster.tombstone_grace)
        self.redirects: dict[str, int] = {"moved": 0, "ask": 0, "tryagain": 0}  # pushes retried
        self._script = self.rc.register_script(PUSH_LUA)
        self._position = self.rc.register_script(POSITION_LUA)
        self._sweep = self.rc.register_script(SWEEP_LUA)
        self._cursor = self.rc.register_script(CURSOR_LUA)
        self._backfill = self.rc.register_script(BACKFILL_LUA)
        self._index = self.rc.register_script(INDEX_LUA)
        self._expire_index = self.rc.register_script(EXPIRE_INDEX_LUA)
        self._cas = self.rc.register_script(CAS_LUA)  # (push_if)
        self._nodes: list[Any] | None = None  # every group's master (_by_node_cached)
        self._nodes_at = 0.0
        self._loaded: set[tuple[str, bytes]] = set()  # (node, script sha) known loaded
        # group -> the node its feed was last read from (feed_many: a read from another
        # node, a failover's new master say, checks the cursor's entry)
        self._feed_node: dict[int, str] = {}
        self._refreshed = 0.0
        self._hints: Hints | None = None
        self._hint_entries: list[tuple[int, FeedEntry]] = []  # (hint_entries)
        self._pool: Any = None  # threads that send the masters' pipelines together
        # master (node name) → when it stopped answering: a master whose pipeline timed
        # out or whose connection was refused is skipped by push_many, feed_many and
        # feed_heads (Unreached: the other masters' work goes on, where one hung master
        # would otherwise hold every push and poll a timeout each) until a PING of it,
        # in a thread of its own every DOWN_PING_EVERY seconds, is answered
        self.down: dict[str, float] = {}
        self.ups = 0  # masters let out of down so far (the daemon then sends what it parked)
        self._down_lock = threading.Lock()
        self._pinger: threading.Thread | None = None
        self._closed = False
        self._ping_turn = 0  # (reachable: the masters in turn)
        # seconds between slot-map refreshes after a failed call: each one may try every
        # seed for cluster.timeout; the daemon spaces them out in partition mode
        self.refresh_every = 0.5

    @classmethod
    def from_config(cls, cluster: Any, *, max_value_size: int = MAX_VALUE_SIZE,
                    daemon: bool = False, agent: bool = False) -> L3Store:
        """The store a host's ``cluster`` config describes: its seeds and every node
        routed through ``cluster.address_remap``, credentials, TLS files, timeout (and,
        for the node daemon, the feed bound and WAIT settings; for an agent, calls that
        fail within about 2 x ``cluster.timeout``: no redis-py retries, a bounded
        slot-map refresh). Raises Unavailable, ConfigError."""
        cl = cluster
        kw: dict[str, Any] = {"feed_inline": cl.feed_inline}
        if daemon:
            kw |= {"feed_maxlen": cl.feed_maxlen, "wait_replicas": cl.wait_replicas,
                   "wait_ms": int(cl.wait_timeout * 1000), "feed_total": cl.feed_total}
        if agent:  # an agent's call: bounded by about 2 x cluster.timeout (_bound_refresh)
            kw |= {"retries": 0, "bounded_refresh": True}
        return cls(cl.seeds(), username=cl.redis_username, password=cl.redis_password,
                   tls=cl.redis_tls, timeout=cl.timeout, max_value_size=max_value_size, groups=cl.groups,
                   tls_ca=cl.redis_ca, tls_cert=cl.redis_cert, tls_key=cl.redis_key,
                   address_remap=cl.remap_address if cl.address_remap else None,
                   tombstone_grace=cl.tombstone_grace, **kw)

    def decode(self, raw: object, key: str = "") -> L3Record:
        """:func:`read_record` under this store's bound; CorruptRecord names ``key``."""
        return read_record(raw, key, self.max_value_size)

    def group_of(self, key: str) -> int:
        return self.groups.of(key)

    # ------------------------------------------------------------------ the group count

    def record_strong_config(self, prefixes: Sequence[str], default: str) -> None:
        """Record which keys the cluster keeps strong (``cache.strong_prefixes`` and
        ``cache.l3_consistency``) in L3's :data:`META_STRONG`, replacing what is there. Only
        a daemon whose config etcd just confirmed calls it: etcd holds the cluster's
        choice, this is its copy for agents without ``cluster.etcd``. Raises Unavailable
        (nothing written)."""
        doc = {"strong_prefixes": sorted(set(prefixes)), "l3_consistency": default}
        data = json.dumps(doc, separators=(",", ":")).encode()
        self._call(lambda: self.rc.set(META_STRONG, data), META_STRONG)

    def strong_config(self) -> tuple[list[str], str] | None:
        """The cluster's strong prefixes and ``cache.l3_consistency`` as L3's copy of etcd's
        records them (:meth:`record_strong_config`), or None when none is recorded (no
        daemon with ``cluster.etcd`` has started since KVCOMM copied it; an empty value
        reads the same). Raises ConfigError when :data:`META_STRONG` holds anything else
        (not JSON, over STRONG_MAX bytes, not a string, wrong types: parsed as JSON data
        only, never run), Unavailable when L3 cannot be reached."""
        def bad(what: str) -> ConfigError:
            return ConfigError("cluster.etcd", f"L3's {META_STRONG} (which keys the cluster "
                               f"keeps strong, copied from etcd) {what}: it was not written "
                               "by KVCOMM; give this agent the host's cluster.etcd (it then "
                               f"asks etcd), or DEL {META_STRONG} and restart a node daemon "
                               "that has cluster.etcd (it copies etcd's again)")

        try:
            raw = self._call(lambda: self.rc.getrange(META_STRONG, 0, STRONG_MAX), META_STRONG)
        except CorruptRecord:  # (WRONGTYPE: a list, a hash... under that name)
            raise bad("is not a string") from None
        if not raw:
            return None
        if len(raw) > STRONG_MAX:
            raise bad(f"is over {STRONG_MAX} bytes")
        try:
            doc = json.loads(bytes(raw).decode("utf-8"))
        except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
            raise bad(f"is not JSON ({bytes(raw)[:40]!r})") from None
        prefixes = doc.get("strong_prefixes") if isinstance(doc, dict) else None
        default = doc.get("l3_consistency") if isinstance(doc, dict) else None
        if (not isinstance(prefixes, list) or not all(isinstance(p, str) for p in prefixes)
                or default not in ("eventual", "strong")):
            raise bad("is not {\"strong_prefixes\": [str, ...], \"l3_consistency\": "
                      "\"eventual\" | \"strong\"}")
        return sorted(set(prefixes)), str(default)

    def check_groups(self, record: bool = False) -> int:
        """Check ``cluster.groups`` against the count L3 was initialised with; with
        ``record`` (a daemon starting), record it when L3 has none yet. Returns the count.

        Raises ConfigError naming both counts when they differ, or when L3 holds data an
        earlier KVCOMM wrote with 16 groups (before the count was recorded) and this host
        is configured with another, or (recording) when no count is recorded but a
        sample of the records (a SCAN) shows another count wrote them (``kvm:groups``
        lost: a failover before it replicated, a deletion); Unavailable when L3 cannot be
        reached. Nothing is written then.
        """
        count = len(self.groups)
        raw = self._get_meta(META_GROUPS)
        if raw is None:
            if count != LEGACY_GROUPS and record and self._legacy_data():
                raise ConfigError(
                    "cluster.groups",
                    f"L3 holds data that an earlier KVCOMM wrote with {LEGACY_GROUPS} groups "
                    f"({seq_key(0, LEGACY_GROUPS)} …), and this host is configured with "
                    f"{count}: set cluster.groups: {LEGACY_GROUPS} on every host to keep "
                    "using that data (the count of an L3 cannot change while it holds data)")
            if not record:
                return count
            foreign = self._foreign_record()
            if foreign is not None:
                raise ConfigError(
                    "cluster.groups",
                    f"L3 holds records that another group count wrote ({foreign!r:.80} is "
                    f"not where {count} groups put its key), and {META_GROUPS}, which "
                    "recorded that count, is gone (lost in a failover, or deleted): set "
                    "cluster.groups to the count the data was written with on every host, "
                    f"then SET {META_GROUPS} <count> in the Redis Cluster")
            self._call(lambda: self.rc.set(META_GROUPS, count, nx=True), META_GROUPS)
            raw = self._get_meta(META_GROUPS)
        stored = _as_seq(raw)
        if stored is None:
            raise ConfigError("cluster.groups", f"L3's {META_GROUPS} holds {raw!r:.40}, not a "
                              "group count: it was written by something else; remove it")
        if stored != count:
            raise ConfigError(
                "cluster.groups",
                f"L3 was initialised with {stored} groups, and this host is configured with "
                f"{count}: set cluster.groups: {stored} (the count of an L3 cannot change "
                "while it holds data)")
        return count

    def _get_meta(self, name: str) -> Any:
        """GET ``name`` (a key of KVCOMM's own) on its master, without redis-py's
        retries: a hung master costs one timeout (and is taken for :attr:`down`), not
        one per retry. Raises Unavailable, CorruptRecord; Unreached at once while its
        master is down."""
        from redis import exceptions as rex

        refused: list[str] = []

        def get(node: Any) -> Any:
            try:
                return self._on(node, "GET", name)
            except rex.ConnectionError as exc:  # (not a TimeoutError, which costs one)
                if _refused(exc):  # (not AUTH, nor the server's client limit)
                    refused.append(node.name)
                raise

        node = self._master_up(name, name)
        try:
            return self._call(lambda: get(node), name, node=node)
        except Unavailable:
            if not refused:
                raise
            # a master that refuses the connection was failed over, and this client's
            # slot map (read from a node whose gossip lags) still names it: read the map
            # again and ask the successor, once (a balancer or daemon starting right
            # after a failover). Within one timeout: the pinger's refresh may be the one
            # running (ours then returns at once), or the map read from a lagging node
            deadline = time.monotonic() + self.timeout
            while True:
                self._refresh_topology(force=True)
                again = self._call(lambda: self.rc.get_node_from_key(name))  # type: ignore[no-untyped-call]
                if again.name != node.name and again.name not in self.down:
                    return self._call(lambda n=again: get(n), name, node=again)
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)

    def _foreign_record(self, sample: int = 64) -> bytes | None:
        """The name of a record (of the first ``sample`` a SCAN finds) whose hash tag is
        not the one this store's group count gives its key, or None. Raises
        Unavailable."""
        def run() -> bytes | None:
            seen = 0
            for raw in self.rc.scan_iter(match="kvc:{*", count=1000):
                tag, sep, key = raw[5:].partition(b"}:")
                if not sep or not key:
                    continue  # (a foreign name under our prefix is no record of ours)
                try:
                    name = key.decode("utf-8")
                except UnicodeDecodeError:
                    continue
                if self.groups.tags[self.groups.of(name)].encode() != tag:
                    return bytes(raw)
                seen += 1
                if seen >= sample:
                    break
            return None

        return self._call(run)  # type: ignore[no-any-return]

    def _legacy_data(self) -> bool:
        """Whether any of the 16 groups of the layout before cluster.groups was written."""
        old = _groups(LEGACY_GROUPS)
        return any(self._call(lambda g=g: self.rc.exists(old.seq_key(g))) for g in old)

    # ------------------------------------------------------------------ reads and pushes

    def reachable(self) -> bool:
        """Whether one master of the slot map answers a PING within the timeout (the
        masters in turn). On the node's own connection: no retry, no slot-map refresh,
        so that a host cut off learns it in one timeout, not in one per seed. Never
        raises."""
        try:
            masters = self.rc.get_primaries()  # type: ignore[no-untyped-call]
            node = masters[self._ping_turn % len(masters)]
            self._ping_turn += 1
            return bool(self.rc.get_redis_connection(node).ping())
        except Exception:  # unreachable, refused, no slot map: not reachable now
            return False

    def live_master_answers(self) -> bool:
        """Whether a master not taken for :attr:`down` answers a PING within the timeout:
        the daemon's evidence that Redis answers when its calls of a round all went to
        masters taken for down (skipped). Every such master is asked at the same time, and
        the first answer decides: a host cut off from some masters may not have taken
        them all for down yet (its loop still waits on one of them), and asking only one
        of them — the next in turn — found one that does not answer and put the host in
        partition mode, another master answering. False when every master is down or
        none answers (those that do not are then taken for down). Never raises."""
        try:
            masters = [m for m in self.rc.get_primaries()  # type: ignore[no-untyped-call]
                       if m.name not in self.down]
        except Exception:  # no slot map: not reachable now
            return False

        def ping(node: Any) -> bool:
            try:
                return bool(self._call(lambda: self.rc.get_redis_connection(node).ping(),
                                       node=node))
            except Exception:  # unreachable, refused: not this one
                return False

        if len(masters) <= 1:
            return bool(masters) and ping(masters[0])
        from concurrent.futures import as_completed

        try:
            futures = [self._threads().submit(ping, m) for m in masters]
        except RuntimeError:  # (closed)
            return False
        # (the PINGs still out when one answered go on: those that time out are down)
        return any(fut.result() for fut in as_completed(futures))

    def _threads(self) -> Any:
        """The threads that call the masters at the same time (MASTER_THREADS)."""
        with self._down_lock:  # (the loop's and the lease thread's first calls: one pool)
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(max_workers=MASTER_THREADS,
                                                thread_name_prefix="kvcomm-push")
            return self._pool

    def get(self, key: str) -> L3Record | None:
        """The record of ``key``, or None. Raises Unavailable, CorruptRecord; Unreached
        at once while its master is :attr:`down`."""
        name = _wire_key(self.groups.record_key(key))
        node = self._master_up(name, f"{key!r}")
        raw = self._call(lambda: self.rc.get(name), key, node=node)
        return None if raw is None else self.decode(raw, key)

    def get_many(self, keys: Iterable[str]) -> dict[str, L3Record | None | CorruptRecord]:
        """The records of ``keys`` (None: absent): one pipeline of GETs per master node
        (by the client's slot map); a GET redirected (its slot moved) is sent again
        through the cluster client, redirects followed. A key whose value is foreign or
        that cannot be sent gets a CorruptRecord in its place. Raises Unavailable; a
        read changes nothing, so the caller may simply read again. Raises Unreached at
        once, nothing read, when a key's master is :attr:`down` (a daemon's refetch of
        skipped changes would otherwise wait a timeout on it every round)."""
        out: dict[str, L3Record | None | CorruptRecord] = {}
        by_node: dict[str, tuple[Any, list[tuple[str, bytes]]]] = {}
        for key in dict.fromkeys(keys):
            try:
                name = _wire_key(self.groups.record_key(key))
            except CorruptRecord as exc:
                out[key] = exc
                continue
            node = self._master_up(name, f"{key!r}")  # (as get: the caller reads again)
            by_node.setdefault(node.name, (node, []))[1].append((key, name))
        for node, names in by_node.values():
            def run(node: Any = node, names: list[tuple[str, bytes]] = names) -> list[Any]:
                pipe = self.rc.get_redis_connection(node).pipeline(transaction=False)
                for _, name in names:
                    pipe.get(name)
                return pipe.execute(raise_on_error=False)

            for (key, name), raw in zip(names, self._call(run, node=node), strict=True):
                try:
                    if isinstance(raw, Exception):  # moved, or a foreign type: one GET
                        if _key_error(str(raw)) and not str(raw).startswith(_TRANSIENT):
                            raise CorruptRecord(f"L3 value of {key!r}: {raw}")
                        raw = self._call(lambda name=name: self.rc.get(name), key)
                    out[key] = None if raw is None else self.decode(raw, key)
                except CorruptRecord as exc:
                    out[key] = exc
        return out

    def push(self, key: str, record: L3Record, keep_siblings: bool = False) -> PushResult:
        """Push one record into L3: the L3 rule, applied atomically (``keep_siblings``:
        a concurrent record comes back as ``conflict`` instead of being merged
        last-writer-wins); as :meth:`push_many`. Raises Unavailable, CorruptRecord (the
        stored value is foreign, or the key cannot be sent); nothing is stored then."""
        out = self.push_many([(key, record)], {key} if keep_siblings else frozenset())[0]
        if isinstance(out, (CorruptRecord, Unreached)):
            raise out
        return out

    def push_if(self, key: str, record: L3Record, absent: bool, check: Vector,
                basis: Vector, wait_replicas: int = 0, wait_ms: int = 100) -> CasResult:
        """Push ``record`` if L3's record of ``key`` meets the expectation, in one atomic
        call on the key's master (CAS_LUA): ``absent`` (no record, a tombstone, past its
        deadline; or, with ``check``, a vector at most ``check``) or a record whose vector
        is at most ``check`` (not itself when dead); ``record``'s vector is ``basis``
        plus a new dot. With ``wait_replicas``, WAIT on the same connection for that many
        replicas (those the master has connected, if fewer: :meth:`_replicas_to_wait`),
        up to ``wait_ms``; ``durable`` says whether they took it. A redirect (MOVED, ASK)
        is followed within ``timeout``. Raises Unavailable (nothing decided, or not known
        to be: a timeout may leave the write stored), Unreached (the master is
        :attr:`down`: nothing sent), CorruptRecord (the key cannot be sent, or L3's record
        has a newer format)."""
        from redis.exceptions import AskError, MovedError

        keys, args = self._args(key, record, False)
        args += ["a" if absent else "v", _packed_vector(check), _packed_vector(basis)]
        node = self._master_up(keys[-1], f"{key!r}")
        asking = False
        deadline = time.monotonic() + self.timeout
        while True:
            def run(node: Any = node, asking: bool = asking) -> list[Any]:
                conn = self.rc.get_redis_connection(node)
                self._load(node, conn, self._cas)
                pipe = conn.pipeline(transaction=False)
                if asking:
                    pipe.execute_command("ASKING")  # type: ignore[no-untyped-call]
                pipe.evalsha(self._cas.sha, len(keys), *keys, *args)
                if wait_replicas:
                    pipe.execute_command("ROLE")  # type: ignore[no-untyped-call]
                    pipe.execute_command("WAIT", wait_replicas, wait_ms)  # type: ignore[no-untyped-call]
                return pipe.execute(raise_on_error=False)

            raws = self._call(run, key, node=node)
            reply = raws[1 if asking else 0]
            if isinstance(reply, MovedError):  # (a MovedError is an AskError: first)
                self.redirects["moved"] += 1
                self.rc.nodes_manager.move_slot(reply)
                node, asking = self._node(reply.host, reply.port), False
            elif isinstance(reply, AskError):
                self.redirects["ask"] += 1
                node, asking = self._node(reply.host, reply.port), True
            elif _noscript(reply):
                self._loaded.discard((node.name, self._cas.sha))
            elif isinstance(reply, Exception) or not isinstance(reply, list) or len(reply) != 1:
                return self._cas_refused(key, reply)
            else:
                break
            if time.monotonic() > deadline:
                raise Unavailable(f"a conditional write of {key!r} was still redirected after "
                                  f"{self.timeout:g}s: a slot is on the move; retry")
        one = reply[0]
        if isinstance(one, Exception):
            return self._cas_refused(key, one)
        try:
            outcome, data = one[0].decode(), one[1]
        except Exception:
            raise CorruptRecord(f"unexpected conditional write reply {one!r:.200} for "
                                f"{key!r}") from None
        if outcome in ("conflict", "stale"):
            return CasResult(outcome, self.decode(data, key) if data else None)
        if outcome not in (NEW, NEWER):  # (the script's check makes the record newer)
            return CasResult("conflict", self._result(key, one, record).record)
        durable = True
        if wait_replicas:
            role, acked = raws[-2], raws[-1]
            durable = isinstance(acked, int) and acked >= self._replicas_to_wait(node, role)
        return CasResult("won", record, durable)

    def _cas_refused(self, key: str, reply: object) -> CasResult:
        """Raise what an error reply to a conditional write means."""
        msg = str(reply)
        if _key_error(msg) and not msg.startswith(_TRANSIENT):
            raise CorruptRecord(f"L3 value of {key!r}: {msg.split(' ', 1)[-1]}")
        raise Unavailable(f"Redis Cluster refused a conditional write of {key!r}: {msg:.200}")

    def push_many(self, items: Sequence[tuple[str, L3Record]],
                  keep_siblings: Set[str] = frozenset(),
                  ) -> list[PushResult | CorruptRecord | Unreached]:
        """Push many records: one pipeline of script calls per master node (a call per
        group and PUSH_BATCH records of it), then (with ``wait_replicas``) a WAIT on the
        same connection. The keys in ``keep_siblings``
        get ``conflict`` for a concurrent record (as :meth:`push`).

        Returns one answer per item, in order. A key whose stored value is foreign, or
        that cannot be sent (not strict UTF-8), yields a CorruptRecord in its place; the
        others are pushed. A push redirected (its slot moved: MOVED; or is moving: ASK,
        TRYAGAIN) is sent again where Redis says, with its own WAIT — a retried push is
        durable only when a replica acknowledged it there — until ``timeout`` seconds
        have passed; pushes are idempotent (a repeated record is ``equal``), so a retry
        never stores anything twice. Raises Unavailable when the cluster cannot be
        reached, or a slot stayed on the move past the timeout; what was pushed before
        stays pushed, and pushing it again is harmless.

        A master taken for down (:attr:`down`: it timed out or refused the connection,
        now or before, and has not answered a PING since) is not waited for: its items
        get an Unreached in their place, the others are pushed. Raises Unreached when no
        item reached a master.
        """
        from redis.exceptions import AskError, MovedError, TryAgainError

        out: list[PushResult | CorruptRecord | Unreached | None] = [None] * len(items)
        route: dict[int, tuple[Any, bool]] = {}  # item → (node, send ASKING first)
        at: dict[int, Any] = {}  # group → its master (every key of a group shares a slot)
        for i, (key, _) in enumerate(items):
            try:
                _wire_key(key)
            except CorruptRecord as exc:
                out[i] = exc
                continue
            g = self.groups.of(key)
            node = at.get(g)
            if node is None:
                node = at[g] = self._call(lambda key=key: self.rc.get_node_from_key(  # type: ignore[no-untyped-call]
                    self.groups.record_key(key)))
            route[i] = (node, False)
        deadline = time.monotonic() + self.timeout
        waits = 0
        sent: dict[int, tuple[bytes, L3Record]] = {}  # item → (its encoding, its record)
        alone: set[int] = set()  # items sent in calls of their own (after a TRYAGAIN)
        while route:
            batches: dict[tuple[str, bool], tuple[Any, list[int]]] = {}
            for i, (node, asking) in route.items():
                if node.name in self.down:  # (not waited for: see down)
                    out[i] = Unreached(f"Redis master {node.name} is down; sent again later")
                    continue
                batches.setdefault((node.name, asking), (node, []))[1].append(i)
            route = {}
            busy = ""
            later: set[int] = set()  # items a call's spent reply budget left (KVCOMMLATER)
            replies = self._pipelines(
                [(node, idxs, asking) for (_, asking), (node, idxs) in batches.items()],
                items, keep_siblings, sent, alone)
            for (_, asking), (node, idxs) in batches.items():
                reply = replies[node.name, asking]
                if isinstance(reply, Unreached):  # (that master timed out: now down)
                    for i in idxs:
                        out[i] = reply
                    continue
                raws, durable, short, call, history = reply
                for i, raw in zip(idxs, raws, strict=True):
                    key = items[i][0]
                    if not isinstance(raw, Exception):
                        try:
                            out[i] = self._result(key, raw, items[i][1], sent.get(i)
                                                  )._replace(durable=durable, short=short,
                                                             node=node.name, call=call,
                                                             history=history)
                        except CorruptRecord as exc:
                            out[i] = exc
                    elif _key_error(str(raw)):
                        out[i] = CorruptRecord(f"L3 value of {key!r}: {str(raw).split(' ', 1)[-1]}")
                    elif isinstance(raw, MovedError):  # (a MovedError is an AskError: first)
                        self.redirects["moved"] += 1
                        self.rc.nodes_manager.move_slot(raw)
                        route[i] = (self._node(raw.host, raw.port), False)
                    elif isinstance(raw, AskError):
                        self.redirects["ask"] += 1
                        route[i] = (self._node(raw.host, raw.port), True)
                    elif "KVCOMMLATER" in str(raw):  # (the call's reply budget was spent)
                        route[i] = (node, asking)
                        later.add(i)
                    elif isinstance(raw, TryAgainError) or _noscript(raw):
                        # a multi-key call in a slot half migrated, or a node that lost
                        # the script (loaded again by _pipeline): again, by the slot map
                        # (after a TRYAGAIN one record a call, as before calls took many:
                        # the call of a whole group would wait for all its keys to move)
                        self.redirects["tryagain"] += not _noscript(raw)
                        if not _noscript(raw):
                            alone.add(i)
                        busy = busy or str(raw)
                        route[i] = (self._call(lambda key=key: self.rc.get_node_from_key(  # type: ignore[no-untyped-call]
                            self.groups.record_key(key))), False)
                    else:
                        raise Unavailable(f"Redis Cluster refused a push: {raw}")
            if route:
                # (only redirects count against the deadline: each call answers one record
                # at least, so the rounds of a spent reply budget end by themselves)
                if time.monotonic() > deadline and route.keys() - later:
                    raise Unavailable(f"{len(route)} push(es) still redirected after "
                                      f"{self.timeout:g}s ({busy or 'MOVED/ASK'}): a slot "
                                      "is on the move; retried later")
                if busy:  # TRYAGAIN: the migration of a batch of keys is under way
                    waits += 1
                    time.sleep(min(0.1, 0.002 * 2 ** min(waits, 6)))
        if out and all(isinstance(o, Unreached) for o in out):
            raise out[0]  # type: ignore[misc]
        return out  # type: ignore[return-value]

    def _node(self, host: str, port: int) -> Any:
        """The cluster node at ``host:port`` (a redirect's target)."""
        node = self.rc.get_node(host=host, port=port)  # type: ignore[no-untyped-call]
        if node is None:  # a node the slot map does not know yet
            self._refresh_topology(force=True)
            node = self.rc.get_node(host=host, port=port)  # type: ignore[no-untyped-call]
            if node is None:
                raise Unavailable(f"Redis Cluster redirected to {host}:{port}, a node it "
                                  "does not list")
        return node

    def _replicas_to_wait(self, node: Any, role: Any) -> int:
        """``cluster.wait_replicas``, or every replica the master has connected if it has
        fewer: after a failover the promoted master has none until its old master comes
        back, and its writes must not wait for a replica that does not exist (they would
        stay dirty, and the host would stop taking writes). Counted and logged."""
        try:
            connected = len(role[2]) if role[0] in (b"master", "master") else self.wait_replicas
        except (TypeError, IndexError):
            connected = self.wait_replicas
        self.connected[node.name] = connected
        if connected < self.wait_replicas:
            self.degraded[node.name] = self.degraded.get(node.name, 0) + 1
            if self.degraded[node.name] == 1:
                log.warning("Redis master %s has %d replica(s) connected, fewer than "
                            "cluster.wait_replicas=%d: its writes wait for those only",
                            node.name, connected, self.wait_replicas)
        else:
            self.degraded.pop(node.name, None)
        return min(self.wait_replicas, connected)

    def _pipelines(self, jobs: list[tuple[Any, list[int], bool]],
                   items: Sequence[tuple[str, L3Record]], keep_siblings: Set[str],
                   sent: dict[int, tuple[bytes, L3Record]], alone: Set[int] = frozenset(),
                   ) -> dict[tuple[str, bool], tuple[list[Any], bool, bool, int, str] | Unreached]:
        """:meth:`_pipeline` for each (node, item indexes, asking) of ``jobs``, the
        nodes' pipelines in flight together (threads: each master runs its scripts while
        the others do, instead of one master after another). Returns the replies by
        (node name, asking); an Unreached for a master that timed out or refused the
        connection (now :attr:`down`). Raises what another pipeline raised (Unavailable,
        CorruptRecord), once every pipeline has returned: what was pushed stays pushed."""
        replies = self._on_masters([
            (node, functools.partial(self._pipeline, node, items, idxs, keep_siblings,
                                     asking, sent, alone))
            for node, idxs, asking in jobs])
        return {(node.name, asking): reply if reply is not None else Unreached(
                    f"Redis master {node.name} did not answer; sent again later")
                for (node, _, asking), reply in zip(jobs, replies, strict=True)}

    def _pipeline(self, node: Any, items: Sequence[tuple[str, L3Record]], idxs: list[int],
                  keep_siblings: Set[str], asking: bool = False,
                  sent: dict[int, tuple[bytes, L3Record]] | None = None,
                  alone: Set[int] = frozenset(),
                  ) -> tuple[list[Any], bool, bool, int, str]:
        """The push script for ``items[idxs]`` on ``node``: one call per group and
        PUSH_BATCH records of it, in the items' order (each call after ASKING if
        ``asking``; the items of ``alone`` in calls of their own), then ROLE and WAIT on
        the same connection. A group with at most HINT_EACH records here hints each change;
        one with more is hinted once, by its last call. With ``wait_replicas``, a node
        not seen as a master before (:attr:`histories`) is seen first, in the same
        pipeline (INFO: once per node and history, not per push). Returns (one reply or
        exception per item of ``idxs``, in order: a call refused as a whole, MOVED say,
        gives each of its items that exception; whether a replica acknowledged them;
        whether fewer than ``wait_replicas`` did (:attr:`PushResult.short`); this
        pipeline's number; the history ``node`` ran when last seen before these writes:
        a probe that sees it still (:meth:`confirm_replicated`) covers them);
        ``sent`` gets each item's encoding."""
        call = next(self._calls)
        conn = self.rc.get_redis_connection(node)
        self._load(node, conn, self._script)
        pipe = conn.pipeline(transaction=False)
        # (a node seen as a master keeps its history until a probe sees another: a write
        # made in a history it left since is then sent again, never confirmed)
        see = (bool(self.wait_replicas) and not self.histories.get(node.name)
               and self._unseen.get(node.name, 0.0) <= time.monotonic())
        if see:
            pipe.execute_command("INFO", "server")  # type: ignore[no-untyped-call]
            pipe.execute_command("INFO", "replication")  # type: ignore[no-untyped-call]
        by_group: dict[int, list[int]] = {}
        for i in idxs:
            by_group.setdefault(self.groups.of(items[i][0]), []).append(i)
        calls: list[list[int]] = []
        for g, members in by_group.items():
            each = len(members) <= HINT_EACH
            batches: list[list[int]] = [[]]
            size = 0  # (record bytes in the last batch)
            for i in members:  # (in order: a key pushed twice is pushed in that order)
                n = approx_size(items[i][1])  # (near enough: not encoded twice)
                if (i in alone or len(batches[-1]) >= PUSH_BATCH
                        or (batches[-1] and size + n > PUSH_BATCH_BYTES)):
                    batches.append([])
                    size = 0
                batches[-1].append(i)
                size += n
                if i in alone:
                    batches.append([])
                    size = 0
            batches = [b for b in batches if b]
            for b, batch in enumerate(batches):
                keys, args = self._batch_args(
                    g, [(items[i][0], items[i][1], items[i][0] in keep_siblings) for i in batch],
                    # (a backlog: the group's last call hints for all of them)
                    hint=each or b == len(batches) - 1, each=each)
                if sent is not None:
                    for n, i in enumerate(batch):
                        sent[i] = (args[7 + n], items[i][1])
                if asking:  # (it holds for the next command only)
                    pipe.execute_command("ASKING")  # type: ignore[no-untyped-call]
                pipe.evalsha(self._script.sha, len(keys), *keys, *args)
                calls.append(batch)
        if self.wait_replicas:
            # wait only for the replicas the master had last time (none: no wait at all)
            want = min(self.wait_replicas, self.connected.get(node.name, self.wait_replicas))
            pipe.execute_command("ROLE")  # type: ignore[no-untyped-call]
            pipe.execute_command("WAIT", want, self.wait_ms)  # type: ignore[no-untyped-call]
        raws: list[Any] = pipe.execute(raise_on_error=False)
        if see:
            self._see(node.name, raws.pop(0), raws.pop(0))
        history = self.histories.get(node.name, "")
        if any(_noscript(r) for r in raws):
            self._loaded.discard((node.name, self._script.sha))  # a restarted node
        durable, short = True, False
        if self.wait_replicas:
            acked, role = raws.pop(), raws.pop()
            durable = isinstance(acked, int) and acked >= self._replicas_to_wait(node, role)
            short = not isinstance(acked, int) or acked < self.wait_replicas
        got: dict[int, Any] = {}
        for batch, raw in zip(calls, raws[1::2] if asking else raws, strict=True):
            if isinstance(raw, Exception):  # the call as a whole: each of its records
                got.update((i, raw) for i in batch)
            elif not isinstance(raw, list) or len(raw) != len(batch):
                raise Unavailable(f"Redis Cluster answered a push of {len(batch)} record(s) "
                                  f"with {raw!r:.200}")
            else:
                got.update(zip(batch, raw, strict=True))
        return [got[i] for i in idxs], durable, short, call, history

    def _see(self, name: str, server: Any, repl: Any) -> str:
        """Note node ``name``'s replication history from its ``INFO server`` and ``INFO
        replication`` replies (:attr:`histories`; and its replicas connected,
        :attr:`connected`). Returns it ("" when the node is not a master, or the replies
        are not INFO's: an error, say — then nothing is noted)."""
        try:
            master = str(repl["role"]) == "master"
            history = f"{server['run_id']}:{repl['master_replid']}" if master else ""
            connected = int(repl.get("connected_slaves", 0))
        except (KeyError, TypeError, ValueError, AttributeError):
            if name not in self._unseen:
                log.warning("Redis node %s answered INFO with %.200r: its replication history "
                            "cannot be seen, so writes it acknowledges short of "
                            "cluster.wait_replicas are never confirmed (held until the bound); "
                            "asked again in %gs", name, repl, UNSEEN_RETRY)
            if len(self._unseen) >= HISTORIES_MAX:
                self._unseen.clear()
            self._unseen[name] = time.monotonic() + UNSEEN_RETRY
            return ""
        self._unseen.pop(name, None)
        self._note(name, history)
        if master:
            self.connected[name] = connected
        return history

    def _note(self, name: str, history: str) -> None:
        """:attr:`histories`: node ``name`` seen in ``history`` ("" not a master)."""
        if name not in self.histories and len(self.histories) >= HISTORIES_MAX:
            try:  # (the oldest seen: bounded; push pipelines run in threads)
                del self.histories[next(iter(self.histories))]
            except (KeyError, RuntimeError, StopIteration):
                pass
        self.histories[name] = history

    def confirm_replicated(self, group: int, node_name: str = "") -> bool:
        """With ``wait_replicas``: a probe write on node ``node_name`` (the master that
        took the records to confirm; ``group``'s master when empty or not in the slot
        map) under ``kvw:{t}`` (the group's tag, gone after 10 s: a node that no longer
        serves the group refuses it), then WAIT there and INFO (server, replication), in
        one pipeline: when ``wait_replicas`` replicas acknowledge it and the master still
        runs the history it ran when it was seen before (:attr:`histories`), every
        earlier write on that master in that history is on that many replicas too, and
        :attr:`confirmed` records (this probe's number, the history) (a host with
        records pushed short, and nothing more to push there, learns when they became
        durable). The INFO notes the master's history (and its replicas) every time:
        a master seen in another history than a record was written in (a failover and
        back, a restart) has left that history, which may have lost the record. Nothing
        is written, and nothing waited for, while the master was last seen with fewer
        replicas connected than ``wait_replicas`` (or not as a master): that probe only
        looks. Returns whether it was confirmed. Raises Unavailable."""
        if not self.wait_replicas:
            return False
        from redis.exceptions import MovedError

        probe = "kvw:" + self.groups.feed_key(group)[4:]
        # (that very node: demoted since, a failover's replica, it shows that its history
        # was left — which the group's new master would not)
        node = self.rc.get_node(node_name=node_name) if node_name else None  # type: ignore[no-untyped-call]
        if node is None and node_name:
            # gone from the slot map (dead for good, readdressed, or serving no slot):
            # not seen as a master, so the records it took are sent again — else
            # nothing would ever confirm them, or show a history left
            self._note(node_name, "")
            return False
        if node is None:
            node = self._call(lambda: self.rc.get_node_from_key(probe))  # type: ignore[no-untyped-call]
        if node.name in self.down:
            return False  # (not waited for: probed again once it answers a PING)
        call = next(self._calls)
        conn = self.rc.get_redis_connection(node)
        before = self.histories.get(node.name, "")
        if not before and self._unseen.get(node.name, 0.0) > time.monotonic():
            return False  # (its INFO was refused just now: asked again later)
        write = bool(before) and self.connected.get(node.name, 0) >= self.wait_replicas

        def run() -> list[Any]:
            pipe = conn.pipeline(transaction=False)
            if write:
                pipe.execute_command("SET", probe, b"1", "PX", 10_000)  # type: ignore[no-untyped-call]
                pipe.execute_command("WAIT", self.wait_replicas, self.wait_ms)  # type: ignore[no-untyped-call]
            pipe.execute_command("INFO", "server")  # type: ignore[no-untyped-call]
            pipe.execute_command("INFO", "replication")  # type: ignore[no-untyped-call]
            return pipe.execute(raise_on_error=False)

        try:
            raws = self._call(run, node=node)
        except Unavailable:
            # a master that cannot be reached, and that the slot map (re-read by _call)
            # no longer has serving the group: failed over, dead for good maybe — it
            # left the history (redis-py may keep it in its slot map: the probe would
            # fail every second, and the records it took stay held)
            try:
                serving = self.rc.get_node_from_key(probe).name  # type: ignore[no-untyped-call]
            except Exception:
                serving = node.name
            if not node_name or serving == node.name:
                raise
            self._note(node.name, "")
            return False
        history = self._see(node.name, raws[-2], raws[-1])  # (after the WAIT: seen since)
        if not write or not history or history != before:
            return False
        stored, acked = raws[0], raws[1]
        if isinstance(stored, MovedError):  # (an AskError too: ASK is not one)
            # the group's slot left this master (a migration; ASK, a migration under
            # way, is waited out): its records here are to be sent again, to the slot's
            # master now
            self.unserved.add((node.name, group))
            self._refresh_topology()
            return False
        if isinstance(stored, Exception) or not isinstance(acked, int):
            return False  # (moved, say: the node is no longer the group's master)
        if acked < self.wait_replicas:
            return False
        self.confirmed[node.name] = (call, history)
        return True

    def _load(self, node: Any, conn: Any, script: Any) -> None:
        """Load ``script`` on ``node`` once (EVALSHA then finds it)."""
        if (node.name, script.sha) not in self._loaded:
            conn.script_load(script.script)
            self._loaded.add((node.name, script.sha))

    def _eval_on(self, node: Any, script: Any, *args: Any) -> Any:
        """``script`` run on master ``node`` with no keys (its names come in ``args``: the
        caller has grouped them by node), loaded there first if need be. A node that lost
        its scripts (restarted) raises NOSCRIPT once: the next call loads it again.
        Raises what redis-py raises (the caller's _call turns it into Unavailable)."""
        conn = self.rc.get_redis_connection(node)
        self._load(node, conn, script)
        try:
            return conn.evalsha(script.sha, 0, *args)
        except Exception as exc:
            if _noscript(exc):
                self._loaded.discard((node.name, script.sha))
            raise

    # ------------------------------------------------------------------ the change feed

    def feed(self, group: int, after: bytes = b"0-0", count: int = 1000) -> list[FeedEntry]:
        """Change-feed entries of one group after stream id ``after``."""
        name = self.groups.feed_key(group)
        rows = self._call(lambda: self.rc.xrange(name, min=b"(" + after, count=count))
        return [_entry(eid, f) for eid, f in rows]

    def _by_node(self, groups: Iterable[int]) -> dict[str, tuple[Any, list[int]]]:
        """``groups`` by the master serving their slot now (the client's slot map)."""
        out: dict[str, tuple[Any, list[int]]] = {}
        for g in groups:
            node = self._call(lambda g=g: self.rc.nodes_manager.get_node_from_slot(
                self.groups.slot(g)))
            out.setdefault(node.name, (node, []))[1].append(g)
        return out

    def feed_many(self, cursors: Mapping[int, bytes], count: int = 500,
                  verify: Set[int] = frozenset(), checked: dict[int, bool] | None = None,
                  ) -> dict[int, list[FeedEntry] | CorruptRecord]:
        """:meth:`feed` for many groups: one pipeline of XRANGEs per master node.

        A group whose stream cannot be read as one (a foreign value under its key) gets
        a CorruptRecord in place of its entries. The XRANGE of each group of ``verify``
        is followed by a check of its cursor (CURSOR_LUA, one integer back), whose
        answer goes into ``checked``: True when the stream lost the cursor's entry while
        keeping an older one — a failover lost what the reader read there, and the
        entries read now may follow its last sequence number only because the lost
        numbers were reissued before the cursor —, False when it did not (a group whose
        check got no answer is left out). With ``checked``, a group read from another
        node than its last read (a failover's new master, a migrated slot) or read again
        through the cluster client (its slot moved) is checked too, whether in ``verify``
        or not. Raises Unavailable when the cluster cannot be reached.

        The groups of a master taken for down (:attr:`down`), or that times out now, are
        left out (read them later); raises Unreached when no master answered.
        """
        out: dict[int, list[FeedEntry] | CorruptRecord] = {}
        skipped = answered = 0
        jobs: list[tuple[Any, Callable[[], Any]]] = []
        by_node: list[list[int]] = []
        for node, gs in self._by_node(cursors).values():
            if node.name in self.down:
                skipped += 1
                continue

            def run(node: Any = node, gs: list[int] = gs) -> list[Any]:
                conn = self.rc.get_redis_connection(node)
                mine = [g for g in gs if checked is not None and (
                    g in verify or self._feed_node.get(g) != node.name)]
                if mine:
                    self._load(node, conn, self._cursor)
                pipe = conn.pipeline(transaction=False)
                for g in gs:
                    pipe.xrange(self.groups.feed_key(g), min=b"(" + cursors[g], count=count)
                for g in mine:  # (after the reads: their replies keep their places)
                    pipe.evalsha(self._cursor.sha, 1, self.groups.feed_key(g), cursors[g])
                raws: list[Any] = pipe.execute(raise_on_error=False)
                answers = raws[len(gs):]
                if any(_noscript(r) for r in answers):
                    self._loaded.discard((node.name, self._cursor.sha))  # (restarted)
                for g, lost in zip(mine, answers, strict=True):
                    if lost in (0, 1) and checked is not None:
                        checked[g] = lost == 1
                return raws[:len(gs)]

            jobs.append((node, run))
            by_node.append(gs)
        # (where each group was read, noted only once the read is returned: a read that
        # ends in Unavailable — another master's error — is discarded with its checks, and
        # the next read of a group that changed node must check again)
        read_at: dict[int, str] = {}
        for (node, _), gs, replies in zip(jobs, by_node, self._on_masters(jobs), strict=True):
            if replies is None:
                skipped += 1
                continue
            answered += 1
            read_at.update((g, node.name) for g, rows in zip(gs, replies, strict=False)
                           if not isinstance(rows, Exception))
            for g, rows in zip(gs, replies, strict=True):
                name = self.groups.feed_key(g)
                try:
                    if isinstance(rows, Exception):  # the slot moved: one call, redirects followed
                        if _key_error(str(rows)):
                            raise CorruptRecord(f"L3 feed of group {g}: {rows}")
                        rows = self._call(lambda g=g, name=name: self.rc.xrange(
                            name, min=b"(" + cursors[g], count=count), name)
                        self._feed_node.pop(g, None)  # (the next read checks, and notes it)
                        if checked is not None:  # (a new master's, maybe: checked too)
                            lost = self._call(lambda g=g, name=name: self._cursor(
                                keys=[name], args=[cursors[g]]), name)
                            if lost in (0, 1):
                                checked[g] = lost == 1
                    out[g] = [_entry(eid, f) for eid, f in rows]
                except CorruptRecord as exc:
                    out[g] = exc
        if skipped and not answered:
            raise Unreached(f"the Redis master(s) of {len(cursors)} feed(s) are down; "
                            "read again later")
        self._feed_node.update(read_at)
        return out

    def _master_up(self, name: str | bytes, what: str) -> Any:
        """The master serving key ``name`` (the client's slot map). Raises Unreached at
        once when it is :attr:`down` (``what``: the message's name for what is not
        served), Unavailable when there is no slot map."""
        node = self._call(lambda: self.rc.get_node_from_key(name))  # type: ignore[no-untyped-call]
        if node.name in self.down:
            raise Unreached(f"Redis master {node.name} (of {what}) is down; tried again later")
        return node

    def _on_masters(self, jobs: Sequence[tuple[Any, Callable[[], Any]]]) -> list[Any]:
        """Each ``(node, run)`` of ``jobs`` as :meth:`_down_or_raise` (its answer, or None
        when its master is down or timed out now), the masters' calls at the same time
        (the push pipelines' threads): a call that reaches several masters that stopped
        answering waits one timeout for all of them, not one each in turn — the daemon's
        loop must come back within the lease TTL, or a host cut off from some masters
        would enter partition mode. Answers in the order of ``jobs``; raises the first
        error (Unavailable) once every call has returned."""
        if len(jobs) <= 1:
            return [self._down_or_raise(run, node) for node, run in jobs]
        futures = [self._threads().submit(self._down_or_raise, run, node) for node, run in jobs]
        out: list[Any] = []
        first: BaseException | None = None
        for fut in futures:
            try:
                out.append(fut.result())
            except BaseException as exc:  # (every call is waited for first)
                first = first or exc
                out.append(None)
        if first is not None:
            raise first
        return out

    def _down_or_raise(self, run: Callable[[], Any], node: Any) -> Any:
        """``run()`` on master ``node``: its answer, or None when it timed out or refused
        the connection (it is then :attr:`down`). Raises Unavailable for other errors."""
        try:
            return self._call(run, node=node)
        except Unavailable:
            if node.name in self.down:
                return None
            raise

    def feed_seqs(self, groups: Iterable[int]) -> dict[int, int | None]:
        """Each group's sequence number now (0: no change yet; None: a foreign value).
        :meth:`feed_heads` without the tails. Raises Unavailable."""
        return {g: seq for g, (seq, _) in self.feed_heads(groups, tails=False).items()}

    def feed_heads(self, groups: Iterable[int], tails: bool = True,
                   ) -> dict[int, tuple[int | None, bytes | None]]:
        """Each group's (sequence number, tail) now: the counter (0: no change yet; None:
        a foreign value) and, with ``tails``, the id of the stream's last entry, read
        together (None: not asked, no entry, not a stream, or the counter had to be read
        on its own).

        One read-only script call per master per SWEEP_BATCH groups (SWEEP_LUA); a
        counter that call cannot read (its slot moved or is moving) is read again through
        the cluster client, redirects followed, without its tail. Raises Unavailable.
        The groups of a master :attr:`down` (or that times out now) are left out;
        raises Unreached when no master answered.
        """
        out: dict[int, tuple[int | None, bytes | None]] = {}
        skipped = answered = 0
        jobs: list[tuple[Any, Callable[[], Any]]] = []
        for node, gs in self._by_node(groups).values():
            if node.name in self.down:
                skipped += 1
                continue

            def run(node: Any = node, gs: list[int] = gs) -> list[tuple[list[int], Any]]:
                # (a master's slices in turn; one that times out leaves the rest out:
                # _down_or_raise answers None for the master)
                parts = [gs[at:at + SWEEP_BATCH] for at in range(0, len(gs), SWEEP_BATCH)]
                return [(part, self._eval_on(node, self._sweep, "1" if tails else "0",
                                             " ".join(self.groups.tags[g] for g in part)))
                        for part in parts]

            jobs.append((node, run))
        for slices in self._on_masters(jobs):
            if slices is None:
                skipped += 1
                continue
            answered += 1
            for part, reply in slices:
                fields = reply.split(b",") if isinstance(reply, bytes) else []
                if len(fields) != len(part):  # (not SWEEP_LUA's answer: read each again)
                    fields = [b"E"] * len(part)
                for g, f in zip(part, fields, strict=True):
                    raw, _, tail = f.partition(b" ")
                    if raw == b"E":  # not served here (its slot moved, or is moving)
                        name = self.groups.seq_key(g)
                        try:
                            got = self._call(lambda name=name: self.rc.get(name), name)
                        except CorruptRecord:
                            got = b"?"
                        out[g] = (0 if got is None else _as_seq(got), None)  # (no tail read)
                        continue
                    out[g] = (0 if raw == b"" else _as_seq(raw),
                              tail if tails and _valid_id(tail) else None)
        if skipped and not answered:
            raise Unreached("the Redis masters of the groups to sweep are down; swept later")
        return out

    def down_groups(self, groups: Iterable[int]) -> set[int]:
        """The groups of ``groups`` whose master is taken for :attr:`down` (by the slot
        map). Raises Unavailable (no slot map)."""
        if not self.down:
            return set()
        return {g for node, gs in self._by_node(groups).values() if node.name in self.down
                for g in gs}

    def feed_position(self, group: int) -> tuple[int | None, bytes]:
        """(sequence number, id of the last entry kept or ``0-0``) of one group, read
        atomically: resuming from there misses no later change. Raises Unavailable;
        Unreached at once when the group's master is :attr:`down`."""
        from redis import exceptions as rex

        fk, sk = self.groups.feed_key(group), self.groups.seq_key(group)
        node = self._master_up(fk, f"group {group}")

        def run() -> Any:
            try:  # (on its master: one timeout, no redis-py retry, if it hangs)
                return self._position(keys=[fk, sk], client=self.rc.get_redis_connection(node))
            except (rex.MovedError, rex.AskError):  # (its slot moved: redirects followed)
                return self._position(keys=[fk, sk])

        raw = self._call(run, fk, node=node)
        seq = raw[0] if type(raw[0]) is int and raw[0] >= 0 else None
        return seq, _as_id(raw[1])

    def feed_bounds(self, group: int) -> tuple[bytes | None, bytes]:
        """(first id still kept, or None when trimmed empty; last id ever added)."""
        name = self.groups.feed_key(group)
        try:
            info = self._call(lambda: self.rc.xinfo_stream(name), name)
        except Unavailable as exc:
            if "no such key" in str(exc).lower():
                return None, b"0-0"
            raise
        first = info.get("first-entry")
        return (_as_id(first[0]) if first else None,
                _as_id(info.get("last-generated-id", b"0-0")))

    # ------------------------------------------------------------------ hints

    def hints(self) -> tuple[set[int], set[int]]:
        """(groups hinted since the last call, groups whose hints may have been lost
        since the last call); the first call subscribes every group's hint channel
        (:class:`kvcomm.tiers.hints.Hints`). Never blocks; never raises for what Redis
        does (trouble is reported as lost hints)."""
        if self._hints is None:
            self._hints = Hints(self.rc, self.groups, self._refresh_topology, down=self.down)
        hinted, lost = self._hints.poll()
        for g, data in self._hints.take_entries():
            entry = _hint_entry(data)
            if entry is None:  # (not one we can use: read the group's stream instead)
                hinted.add(g)
            else:
                self._hint_entries.append((g, entry))
        if len(self._hint_entries) > HINT_ENTRIES_MAX:  # (not taken: their streams are read)
            hinted.update(g for g, _ in self._hint_entries)
            self._hint_entries.clear()
        return hinted, lost

    def hint_entries(self) -> list[tuple[int, FeedEntry]]:
        """The value-less feed entries that hints carried since the last call, (group,
        entry), in the order they arrived: collected by :meth:`hints`. Never raises."""
        out, self._hint_entries = self._hint_entries, []
        return out

    @property
    def hint_stats(self) -> dict[str, int]:
        """Counts of the hint subscriptions: hints, breaks, moved, subscribed."""
        return dict(self._hints.stats) if self._hints is not None else {}

    # ------------------------------------------------------------------ the key index

    def index_range(self, prefix: str, after: str, limit: int,
                    groups: Iterable[int] | None = None) -> tuple[list[str], str | None]:
        """Indexed keys under ``prefix`` after ``after``, in key order, from every group
        (or ``groups``): ``(keys, bound)``. ``keys`` is every indexed key in
        (after, bound] (``bound`` None: through the prefix's end); at most ``limit`` per
        group are read, so keys past ``bound`` need another call (from ``after=bound``).
        Cost: one ZRANGEBYLEX per group, pipelined per master (see "The key index").
        Raises Unavailable."""
        pb, ab = _wire_key(prefix), _wire_key(after)
        lo = b"(" + ab if ab >= pb else b"[" + pb  # (prefix and after "": "(" skips b"")
        hi = b"[" + pb + b"\xff" if pb else b"+"  # (no UTF-8 key holds a 0xff byte)
        rows: list[list[bytes]] = []
        bound: bytes | None = None
        for node, gs in self._by_node_cached(self.groups if groups is None else groups).values():
            for at in range(0, len(gs), INDEX_BATCH):
                part = gs[at:at + INDEX_BATCH]

                def run(node: Any = node, part: list[int] = part) -> list[Any]:
                    names = [self.groups.index_key(g) for g in part]
                    return list(self._eval_on(node, self._index, lo, hi, limit, *names))

                for g, got in zip(part, self._call(run), strict=True):
                    name = self.groups.index_key(g)
                    if not isinstance(got, list):  # its slot moved: redirects followed
                        got = self._call(lambda name=name: self.rc.zrangebylex(
                            name, lo, hi, start=0, num=limit), name)
                    row = [k for k in got if _utf8(k)]  # (the empty member is no key either)
                    # A member that is not UTF-8 (written by something else than KVCOMM)
                    # is no key, and cannot be a page's bound (the next page starts after
                    # the bound as a str): a group read to its limit bounds the page at
                    # its last key, read further past members that are no keys.
                    while len(got) >= limit and not row:
                        last = got[-1]
                        got = self._call(lambda name=name, last=last: self.rc.zrangebylex(
                            name, b"(" + last, hi, start=0, num=limit), name)
                        row = [k for k in got if _utf8(k)]
                    if len(got) >= limit and (bound is None or row[-1] < bound):
                        bound = row[-1]
                    rows.append(row)
        keys = [k.decode("utf-8") for k in heapq.merge(*rows) if bound is None or k <= bound]
        return keys, None if bound is None else bound.decode("utf-8")

    def expire_index(self, now: float, groups: Iterable[int] | None = None,
                     limit: int = 256, skipped: set[int] | None = None) -> int:
        """Drop the keys past their deadline at ``now`` from the key index of ``groups``
        (None: every group; at most ``limit`` keys per group): one script call per master
        per INDEX_BATCH groups. Returns how many were dropped. Raises Unavailable.

        The groups of a master :attr:`down` (or that times out now) are left out and
        added to ``skipped`` (do them later); raises Unreached when no master answered
        (the node daemon does this once a second: it must not wait on a hung master)."""
        dropped = answered = missed = 0
        for node, gs in self._by_node_cached(self.groups if groups is None else groups).values():
            for at in range(0, len(gs), INDEX_BATCH):
                part = gs[at:at + INDEX_BATCH]
                names: list[str] = []
                for g in part:
                    names += [self.groups.expiry_key(g), self.groups.index_key(g)]

                def run(node: Any = node, names: list[str] = names) -> Any:
                    return self._eval_on(node, self._expire_index, repr(now), limit, *names)

                got = None if node.name in self.down else self._down_or_raise(run, node)
                if got is None:
                    missed += 1
                    if skipped is not None:
                        skipped.update(gs[at:])
                    break
                answered += 1
                dropped += int(got)
        if missed and not answered:
            raise Unreached("the Redis master(s) of the key index groups to expire are "
                            "down; expired later")
        return dropped

    def _by_node_cached(self, groups: Iterable[int]) -> dict[str, tuple[Any, list[int]]]:
        """:meth:`_by_node` from a map of every group's master kept for NODE_MAP_S: a scan
        page would otherwise spend more on G slot lookups than on Redis. A stale entry
        costs a redirect (the caller reads that group again through the cluster client)."""
        now = time.monotonic()
        if self._nodes is None or now - self._nodes_at > NODE_MAP_S:
            nm = self.rc.nodes_manager
            self._nodes = self._call(lambda: [nm.get_node_from_slot(s) for s in self.groups.slots])
            self._nodes_at = now
        nodes = self._nodes
        out: dict[str, tuple[Any, list[int]]] = {}
        for g in groups:
            node = nodes[g]
            out.setdefault(node.name, (node, []))[1].append(g)
        return out

    def index_ready(self) -> bool:
        """Whether the key index covers data written before it existed (``kvm:index``
        set by :meth:`backfill_index`). Raises Unavailable."""
        node = self._master_up(META_INDEX, META_INDEX)  # (one timeout if it hangs)
        return bool(self._call(lambda: self._on(node, "EXISTS", META_INDEX), META_INDEX,
                               node=node))

    def backfill_index(self, batch: int = 500) -> int:
        """Index every record L3 holds (once, after an upgrade; see "The key index"):
        each group's keys are listed (its slot's keys), and each is indexed by a script
        that reads its record atomically (live: ZADD; a tombstone or gone: ZREM), so a
        push racing the backfill is never undone. Records ``kvm:index`` when done;
        idempotent. Returns the keys looked at. Raises Unavailable (run it again)."""
        seen = 0
        for g in self.groups:
            names = list(self.scan_group(g))
            idx = self.groups.index_key(g)
            for at in range(0, len(names), batch):
                part = names[at:at + batch]
                slot = self.groups.slot(g)
                node = self._call(lambda slot=slot: self.rc.nodes_manager.get_node_from_slot(slot))
                prefix = self.groups.record_prefix(g)

                def run(node: Any = node, part: list[bytes] = part, idx: str = idx,
                        prefix: bytes = prefix) -> list[Any]:
                    conn = self.rc.get_redis_connection(node)
                    self._load(node, conn, self._backfill)
                    pipe = conn.pipeline(transaction=False)
                    for k in part:
                        pipe.evalsha(self._backfill.sha, 2, prefix + k, idx, k)
                    return pipe.execute(raise_on_error=False)

                for r in self._call(run):
                    if isinstance(r, Exception):
                        raise Unavailable(f"the key index backfill of group {g} was "
                                          f"refused ({r}); run it again")
                seen += len(part)
        self._call(lambda: self.rc.set(META_INDEX, 1), META_INDEX)
        return seen

    # ------------------------------------------------------------------ scans

    def scan_keys(self, skipped: set[int] | None = None) -> Iterator[bytes]:
        """Every KVCOMM key L3 holds, from every master (a SCAN: for rebuilds, not hot
        paths). Raises Unavailable.

        One master at a time. A master taken for :attr:`down`, or that times out or
        refuses the connection during its scan (it is then taken for down), raises
        Unreached; with ``skipped``, it is left out instead (a hung master would
        otherwise fail the whole scan), and the groups it serves (by the slot map) are
        added to ``skipped``: their keys may be missing (read them with
        :meth:`scan_group` once it answers)."""
        by_node = self._by_node(self.groups)
        primaries = self._call(lambda: self.rc.get_primaries())  # type: ignore[no-untyped-call]
        masters = {m.name: m for m in primaries}
        masters.update((name, node) for name, (node, _) in by_node.items())
        for name, node in masters.items():
            def scan(node: Any = node) -> list[bytes]:
                conn = self.rc.get_redis_connection(node)
                return list(conn.scan_iter(match="kvc:{*", count=1000))

            raws = None if name in self.down else self._down_or_raise(scan, node)
            if raws is None:
                if skipped is None:
                    raise Unreached(f"Redis master {name} did not answer the scan of "
                                    "KVCOMM's keys; scan again once it answers")
                skipped.update(by_node.get(name, (node, []))[1])
                continue
            yield from _record_names(raws)

    def slot_keys(self, slot: int) -> list[bytes]:
        """Every key Redis holds in ``slot`` (on the master serving it: CLUSTER
        GETKEYSINSLOT). Raises Unavailable."""
        def run() -> list[bytes]:
            node = self.rc.nodes_manager.get_node_from_slot(slot)
            conn = self.rc.get_redis_connection(node)
            # the names as bytes: redis-py's own callback decodes them, and a name that
            # is not UTF-8 would come back altered (a slot migration would miss it)
            conn.set_response_callback("CLUSTER GETKEYSINSLOT", _raw)
            n = int(conn.execute_command("CLUSTER COUNTKEYSINSLOT", slot))  # type: ignore[no-untyped-call]
            if not n:
                return []
            return list(conn.execute_command(  # type: ignore[no-untyped-call]
                "CLUSTER GETKEYSINSLOT", slot, n + 100))

        return self._call(run)  # type: ignore[no-any-return]

    def scan_group(self, group: int) -> Iterator[bytes]:
        """Every KVCOMM key of one group (the keys of its slot with its record prefix)."""
        prefix = self.groups.record_prefix(group)
        for raw in self.slot_keys(self.groups.slot(group)):
            if raw.startswith(prefix) and len(raw) > len(prefix):
                yield raw[len(prefix):]

    # ------------------------------------------------------------------ per-host state

    def forget_host(self, host: str) -> int:
        """Delete a retired host's keys of KVCOMM's own (feed cursors, hot keys,
        quarantine list); returns how many existed. Raises Unavailable."""
        names = [f"kvn:{{{host}}}:{n}" for n in ("cursors", "hot", "quarantine")]
        return int(self._call(lambda: self.rc.delete(*names)))

    def save_hot(self, host: str, keys: list[str]) -> None:
        """This host's hot-key list, for the next daemon run to prewarm L2 with."""
        packed = msgpack.packb(keys)
        self._own_key(f"kvn:{{{host}}}:hot",
                      lambda name, node: self._on(node, "SET", name, packed))

    def load_hot(self, host: str) -> list[str]:
        """The hot-key list :meth:`save_hot` saved; [] when there is none or it is not
        ours. Raises Unavailable."""
        try:
            raw = self._call(lambda: self.rc.get(f"kvn:{{{host}}}:hot"))
        except CorruptRecord:  # another type under the name: start without a list
            return []
        try:
            keys = msgpack.unpackb(raw, max_array_len=100_000) if raw else []
        except Exception:  # written by something else: start without a list
            return []
        return [k for k in keys if isinstance(k, str)] if isinstance(keys, list) else []

    def save_write_mark(self, host: str, mark: int) -> None:
        """Record that ``host``'s daemons push no dot with a counter past ``mark`` until
        they record a higher one (``kvn:{host}:wseq``; one daemon per host writes it).
        With ``wait_replicas``, as durable as a push (ROLE and WAIT on the master's
        connection): the records it covers are kept by a failover, and so must it be, or
        dots of this host in L3 would pass it. Raises Unavailable (also when fewer
        replicas than a push waits for took it; the pushes it covers are not sent)."""
        self._own_key(f"kvn:{{{host}}}:wseq",
                      lambda name, node: self._set_replicated(name, int(mark), node))

    def _set_replicated(self, name: str, value: int, node: Any) -> None:
        """``SET name value``, then (``wait_replicas``) WAIT for the replicas a push
        waits for. Raises what redis-py raises (the caller's _call translates it),
        Unavailable (too few replicas took it; it may be on the master)."""
        if not self.wait_replicas:
            self._on(node, "SET", name, value)
            return
        from redis import exceptions as rex

        pipe = self.rc.get_redis_connection(node).pipeline(transaction=False)
        pipe.set(name, value)
        pipe.execute_command("ROLE")  # type: ignore[no-untyped-call]
        pipe.execute_command("WAIT", self.wait_replicas, self.wait_ms)  # type: ignore[no-untyped-call]
        try:
            _, role, acked = pipe.execute()
        except rex.ResponseError as exc:
            if str(exc).startswith(("MOVED", "ASK")):  # (the slot moved: re-read the map)
                self._refresh_topology(force=True)
            raise
        want = self._replicas_to_wait(node, role)
        if not isinstance(acked, int) or acked < want:
            raise Unavailable(f"the write mark {name} reached {acked} of {want} replica(s) "
                              f"within cluster.wait_timeout; the pushes it covers wait")

    def load_write_mark(self, host: str) -> int:
        """The mark :meth:`save_write_mark` saved; 0 when there is none or it is not ours
        (not a decimal integer, or past WRITE_MARK_MAX: a host could never have written
        that far, and a sequence lifted there would leave it no dots to write with).
        Raises Unavailable."""
        try:  # (a start's first call to the host's own keys' master: one timeout if it hangs)
            raw = self._get_meta(f"kvn:{{{host}}}:wseq")
        except CorruptRecord:  # another type under the name: none
            return 0
        try:
            mark = int(raw) if raw else 0
        except ValueError:  # written by something else
            return 0
        if not 0 < mark <= WRITE_MARK_MAX:
            if mark:
                log.warning("ignored %s's write mark in L3 (%d: out of 1..%d)", host, mark,
                            WRITE_MARK_MAX)
            return 0
        return mark

    def save_load(self, host: str, ops: Mapping[int, int]) -> None:
        """Record ``host``'s cumulative operation counts of these groups (a hash
        ``kvn:{host}:load``: group → count). Raises Unavailable."""
        if ops:
            mapping: dict[Any, Any] = {str(g): n for g, n in ops.items()}
            self._own_key(f"kvn:{{{host}}}:load", lambda name, node: self._on(
                node, "HSET", name, *itertools.chain.from_iterable(mapping.items())))

    def load_counts(self, host: str) -> dict[int, int]:
        """What :meth:`save_load` recorded for ``host`` ({} when nothing, or not ours).
        Raises Unavailable."""
        try:
            raw = self._call(lambda: self.rc.hgetall(f"kvn:{{{host}}}:load"))
        except CorruptRecord:
            return {}
        out = {}
        for k, v in raw.items():
            n = _as_seq(v)
            if k.isdigit() and int(k) < len(self.groups) and n is not None:
                out[int(k)] = n
        return out

    def hosts(self) -> list[str]:
        """The hosts whose daemons left state in L3 (their ``kvn:{host}:cursors``), by
        a SCAN of every master: for tools, not hot paths. Raises Unavailable."""
        found = set()
        for raw in self._call(lambda: list(self.rc.scan_iter(match="kvn:{*}:cursors", count=1000))):
            host = raw[5:raw.rfind(b"}")].decode("utf-8", "replace")
            if host:
                found.add(host)
        return sorted(found)

    def load_cursors(self, host: str) -> tuple[dict[int, bytes], dict[int, int]]:
        """The feed cursors and last sequence numbers this host saved, by group.

        Malformed fields (written by something else) are left out: those groups start
        afresh. Raises Unavailable.
        """
        try:
            raw = self._call(lambda: self.rc.hgetall(f"kvn:{{{host}}}:cursors"))
        except CorruptRecord:  # another type under the name: start afresh
            raw = {}
        cursors: dict[int, bytes] = {}
        seqs: dict[int, int] = {}
        for k, v in raw.items():
            name = k.decode("ascii", "replace")
            if name.isdigit() and int(name) < len(self.groups) and _valid_id(v):
                cursors[int(name)] = v
            elif name[:1] == "s" and name[1:].isdigit() and int(name[1:]) < len(self.groups):
                seq = _as_seq(v)
                if seq is not None:
                    seqs[int(name[1:])] = seq
        return cursors, seqs

    def save_cursors(self, host: str, cursors: dict[int, bytes],
                     seqs: dict[int, int] | None = None) -> None:
        mapping: dict[Any, Any] = {str(g): c for g, c in cursors.items()}
        mapping.update({f"s{g}": s for g, s in (seqs or {}).items()})
        if mapping:
            self._own_key(f"kvn:{{{host}}}:cursors", lambda name, node: self._on(
                node, "HSET", name, *itertools.chain.from_iterable(mapping.items())))

    def quarantine(self, host: str, key: str, reason: str, when: float,
                   keep: int = QUARANTINE_MAX) -> None:
        """Set an input aside: push ``[key, reason, when]`` (msgpack) onto the host's capped
        list ``kvn:{host}:quarantine`` (newest first, ``keep`` kept). Raises Unavailable."""
        entry = msgpack.packb([_printable(key)[:1000], _printable(reason)[:1000], when])

        def run(name: str, node: Any) -> None:
            self._on(node, "LPUSH", name, entry)
            self._on(node, "LTRIM", name, 0, keep - 1)

        self._own_key(f"kvn:{{{host}}}:quarantine", run)

    def quarantined(self, host: str) -> list[tuple[str, str, float]]:
        """What :meth:`quarantine` set aside for ``host``, newest first."""
        out = []
        for raw in self._call(lambda: self.rc.lrange(f"kvn:{{{host}}}:quarantine", 0, -1)):
            try:
                key, reason, when = msgpack.unpackb(raw)
                out.append((str(key), str(reason), float(when)))
            except Exception:  # not an entry of ours
                continue
        return out

    def close(self) -> None:
        self._closed = True  # (the pinger, if any, ends at its next turn)
        if self._hints is not None:
            self._hints.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.rc.close()

    def _own_key(self, name: str, write: Any) -> None:
        """``write(name, node)`` to a key of KVCOMM's own (``kvn:``) on its master
        ``node`` (with :meth:`_on`); if something else left a value of another type
        there, replace it. Raises Unavailable, CorruptRecord; Unreached at once when the
        key's master is :attr:`down`."""
        node = self._master_up(name, name)
        try:
            self._call(lambda: write(name, node), name, node=node)
        except CorruptRecord:
            self._call(lambda: self._on(node, "DEL", name), node=node)
            self._call(lambda: write(name, node), name, node=node)

    def _on(self, node: Any, *args: Any) -> Any:
        """One command for master ``node`` through the cluster client (a MOVED
        followed), without redis-py's retries: a command with its target node named is
        not retried, where one routed by key is retried after each timeout, re-reading
        the slot map each time (with the daemon's client, five timeouts and more before
        a hung master is taken for down: every round of the host held meanwhile).
        Raises what redis-py raises (the caller's _call translates it). A connection
        error (not a timeout) is tried once more, on a new connection: a pooled one a
        restarted master closed fails at once, where redis-py's retry used to reconnect;
        a master that refuses fails the second try as fast."""
        from redis import exceptions as rex

        try:
            return self.rc.execute_command(*args, target_nodes=node)  # type: ignore[no-untyped-call]
        except rex.TimeoutError:
            raise
        except rex.ConnectionError:
            return self.rc.execute_command(*args, target_nodes=node)  # type: ignore[no-untyped-call]

    # ------------------------------------------------------------------ helpers

    def _args(self, key: str, record: L3Record, keep_siblings: bool, hint: bool = True,
              speak: bool | None = None) -> tuple[list[bytes | str], list[Any]]:
        """The push script's keys and arguments for one record alone (its reply is a list
        of one reply). ``hint``: a change this push stores is hinted; ``speak`` (default:
        ``hint``): the call hints at its end even if it stores nothing (as the last call of
        a backlog's group does)."""
        speak = hint if speak is None else speak
        return self._batch_args(self.groups.of(key), [(key, record, keep_siblings)],
                                hint=hint or speak, each=not speak)

    def _batch_args(self, group: int, records: Sequence[tuple[str, L3Record, bool]],
                    hint: bool = True, each: bool = True,
                    ) -> tuple[list[bytes | str], list[Any]]:
        """The push script's keys and arguments for ``records`` (key, record, keep
        siblings), every key of ``group``, in order (see PUSH_LUA). ``hint``: the call
        hints its changes on the group's channel (``each``: each change its own entry;
        else once, at the end of the call, even if it stores nothing). Raises
        CorruptRecord when a key cannot be sent."""
        g = self.groups
        return ([g.feed_key(group), g.seq_key(group), g.index_key(group),
                 *(_wire_key(g.record_key(k)) for k, _, _ in records)],
                ["".join("s" if s else "l" for _, _, s in records), self.feed_maxlen,
                 g.hint_channel(group) if hint else "", "e" if each else "l",
                 # ("": every entry inline, as a daemon before value-less ones)
                 "" if self.feed_inline is None else self.feed_inline,
                 self.tombstone_grace_ms, g.expiry_key(group),
                 *(r.encode() for _, r, _ in records), PUSH_BATCH_BYTES])

    def _result(self, key: str, raw: Any, pushed: L3Record,
                sent: tuple[bytes, L3Record] | None = None,
                ) -> PushResult:
        """One push's reply. ``pushed``: the record pushed (a new or newer reply does not
        send it back: L3 holds it); ``sent``: the record pushed and its encoding; a reply that
        holds those very bytes (a push stored as sent, or found equal) is that record,
        not decoded again (a backlog of thousands is answered mostly so)."""
        try:
            outcome = raw[0].decode()
            data = raw[1]
        except Exception:
            raise CorruptRecord(f"unexpected push reply {raw!r:.200} for {key!r}") from None
        if outcome not in OUTCOMES:
            raise CorruptRecord(f"unexpected push outcome {outcome!r} for {key!r}")
        seq, entry = (_as_seq(raw[2]), _as_id(raw[3])) if len(raw) >= 4 else (None, b"")
        if seq is None or not _valid_id(entry):  # (a script before entries were returned)
            seq, entry = None, b""
        if outcome in (NEW, NEWER, EQUAL) and data == b"":  # L3 holds what was pushed
            return PushResult(key, outcome, pushed, sent=b"" if sent is None else sent[0],
                              seq=seq, entry=entry)
        if sent is not None and data == sent[0]:
            return PushResult(key, outcome, sent[1], seq=seq, entry=entry)
        return PushResult(key, outcome, self.decode(data, key), seq=seq, entry=entry)

    def _call(self, fn: Any, key: str | None = None, node: Any = None) -> Any:
        """Run one Redis call; errors translated (``key`` names the value a key error is
        about; ``node``: the master the call went to, taken for down (:attr:`down`) if
        it timed out or refused the connection)."""
        from redis import exceptions as rex

        try:
            return fn()
        except rex.ResponseError as exc:
            msg = str(exc)
            if _key_error(msg) and not msg.startswith(_TRANSIENT):
                where = f"L3 value of {key!r}: " if key is not None else ""
                raise CorruptRecord(f"{where}{msg.split(' ', 1)[-1]}") from None
            raise Unavailable(f"Redis Cluster refused: {msg}") from None
        except (rex.ConnectionError, rex.TimeoutError, rex.ClusterDownError,
                rex.ClusterError, rex.RedisClusterException) as exc:
            # (RedisClusterException: redis-py re-read the slot map after a timeout and
            # no seed answered: "Redis Cluster cannot be connected")
            if node is not None and isinstance(exc, (rex.ConnectionError, rex.TimeoutError)):
                self._went_down(node, exc)
            # (a master now down: no refresh here but in the pinger, see _refresh_topology)
            self._refresh_topology()
            raise Unavailable(f"Redis Cluster unreachable: {exc}; the write stays in L2") from None

    # ------------------------------------------------------------------ masters down

    def _went_down(self, node: Any, why: object) -> None:
        """Take master ``node`` for down (:attr:`down`) and make sure the pinger runs."""
        with self._down_lock:
            if node.name in self.down or self._closed:
                return
            self.down[node.name] = time.monotonic()
            log.warning("Redis master %s did not answer (%s): skipped until it answers a "
                        "PING; the other masters' pushes and feeds go on", node.name, why)
            if self._pinger is None or not self._pinger.is_alive():  # (a dead one: replaced)
                self._pinger = threading.Thread(target=self._ping_down, daemon=True,
                                                name="kvcomm-down")
                start_quiet(self._pinger)

    def _ping_down(self) -> None:
        """The pinger: PING every master taken for down, each DOWN_PING_EVERY seconds,
        and let those that answer (or that left the slot map) be used again; re-read the
        slot map while one is still down. Ends when none is down (or on close)."""
        while not self._closed:
            with self._down_lock:
                if not self.down:
                    self._pinger = None
                    return
                names = list(self.down)
            try:  # (the only way out of down: an error must not end the thread)
                self._ping_round(names)
            except Exception:
                log.exception("pinging the Redis masters taken for down failed; "
                              "pinged again in %gs", DOWN_PING_EVERY)
            time.sleep(DOWN_PING_EVERY)
        with self._down_lock:
            self._pinger = None

    def _ping_round(self, names: list[str]) -> None:
        """One round of the pinger: PING each master of ``names``; let go of those that
        answer or left the slot map; re-read the slot map if one is still down."""
        for name in names:
            node = self.rc.get_node(node_name=name)  # type: ignore[no-untyped-call]
            try:  # (gone from the slot map: nothing routes there any more)
                back = node is None or bool(self.rc.get_redis_connection(node).ping())
            except Exception:
                back = False
            if back:
                with self._down_lock:
                    since = self.down.pop(name, None)
                    self.ups += 1
                if since is not None:
                    log.warning("Redis master %s answers again (after %.1fs)", name,
                                time.monotonic() - since)
        if self.down:  # (a master dead for good: the slot map names its successor;
            self._refresh_topology()  # the calls that skip it make no call to learn it)

    def _refresh_topology(self, force: bool = False) -> None:
        """Re-read the slot map (after a failover our per-node pipelines would keep
        dialling the dead master: redis-py only refreshes on its own command path); at
        most twice a second unless ``force``; while a master is :attr:`down`, only in the
        pinger's thread (unless ``force``)."""
        now = time.monotonic()
        if now - self._refreshed < self.refresh_every and not force:
            return
        if self.down and not force and threading.current_thread() is not self._pinger:
            # (the pinger re-reads the map while a master is down: here it would hold the
            # caller, the daemon's loop say, a timeout per seed that does not answer)
            return
        self._refreshed = now
        try:
            self.rc.nodes_manager.initialize()
        except Exception:  # the cluster may still be electing: the next call retries
            pass


def _refused(exc: BaseException) -> bool:
    """Whether redis-py's ``exc`` came of a refused connection (the OSError it was raised
    from: nothing listens there, a dead or failed-over master), not of an AUTH error or
    the server's client limit, which a new slot map does not mend."""
    seen: BaseException | None = exc
    for _ in range(8):  # (a chain of causes, bounded)
        if seen is None:
            return False
        if isinstance(seen, ConnectionRefusedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _bound_refresh(nodes_manager: Any, timeout: float) -> None:
    """Make ``nodes_manager.initialize`` (redis-py re-reads the slot map from every seed
    after a timeout, inside the failed call: each seed of a cut-off host costs a
    timeout) return after at most ``timeout`` seconds: it runs in a thread of its own,
    one at a time; the caller that starts it waits for it that long, one that finds it
    running does not wait (the refresh goes on, and later calls find its result). An
    agent's operation then fails within about twice ``cluster.timeout`` (its own call,
    then this) instead of one timeout per seed."""
    real = nodes_manager.initialize
    lock = threading.Lock()
    running: list[threading.Thread] = []

    def run(*args: Any, **kwargs: Any) -> None:
        try:
            real(*args, **kwargs)
        except Exception:  # (unreachable: the caller's call already failed; next time)
            pass

    def initialize(*args: Any, **kwargs: Any) -> None:
        with lock:
            if running and running[0].is_alive():
                return
            t = threading.Thread(target=run, args=args, kwargs=kwargs, daemon=True,
                                 name="kvcomm-slot-map")
            running[:] = [t]
            start_quiet(t)
        t.join(timeout)

    nodes_manager.initialize = initialize


def _record_names(raws: Iterable[bytes]) -> Iterator[bytes]:
    """The keys of the record names ``raws`` (``kvc:{tag}:key``)."""
    for raw in raws:
        _, sep, key = raw.partition(b"}:")
        if sep and key:  # (a foreign name under our prefix is no key of ours)
            yield key


def _raw(r: Any, **kwargs: Any) -> Any:
    return r


def _utf8(member: bytes) -> bool:
    """Whether a key index member can be a key: not empty, strict UTF-8."""
    if not member:
        return False
    try:
        member.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def approx_size(record: L3Record) -> int:
    """The bytes of ``record``'s value, meta and extension (its size in a push call, near
    enough; a field of another type, which the push script refuses, counts 0)."""
    return sum(len(b) for b in (record.value, record.meta, record.ext)
               if isinstance(b, (bytes, bytearray, memoryview)))


def _packed_vector(v: Vector) -> bytes:
    """A vector as CAS_LUA reads it: a msgpack array [actor, counter, ...]."""
    flat: list[object] = []
    for actor, counter in v:
        flat += [actor, counter]
    return msgpack.packb(flat, use_bin_type=False)  # type: ignore[no-any-return]


def _wire_key(key: str) -> bytes:
    """``key`` as sent to Redis: strict UTF-8. Raises CorruptRecord (a lone surrogate, say)."""
    try:
        return key.encode("utf-8")
    except UnicodeEncodeError:
        raise CorruptRecord(f"key {key!r} is not valid UTF-8 (a lone surrogate?): it cannot "
                            "be stored in L3; rename it") from None


def _printable(s: str) -> str:
    """``s`` with anything UTF-8 cannot carry (lone surrogates) escaped."""
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


def _as_id(v: Any) -> bytes:
    return v if isinstance(v, bytes) else str(v).encode()


_ID = re.compile(rb"\d{1,20}-\d{1,20}\Z")


def _valid_id(v: object) -> bool:
    return isinstance(v, bytes) and bool(_ID.match(v))


def _as_seq(v: object) -> int | None:
    """A sequence number from Redis (bytes of digits), or None if it is not one."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v if v >= 0 else None
    if isinstance(v, bytes) and v.isdigit() and len(v) < 20:
        return int(v)
    return None
