"""L3: Redis Cluster as the cluster tier — the record codec, the push script, the adapter.

The package, one concept a module (a reader finds each by its noun):

==================  =====================================================================
``records.py``      the record format and version rule, its defensive decoding (pure)
``feed.py``         feed entries, notes and hints, parsed never raising (pure)
``scripts.py``      the Lua scripts (``lua/*.lua``, package data), loaded once at import
``connection.py``   the connection and the failure detector: calls, masters down, pinger
``replication.py``  replication confirmation: WAIT, histories, probes
``push.py``         pushes (the push script) and conditional writes
``reads.py``        record reads (GET, one pipeline per master)
``feeds.py``        feed reads, counters and tails (the sweep), hints
``keyindex.py``     the key index (prefix scans, expiry, backfill) and scans of every key
``hostkeys.py``     a host's own keys: cursors, write mark, hot keys, loads, quarantine
``meta.py``         cluster metadata: the group count, the index mark, strong keys
``store.py``        the faces: :class:`AgentL3`, :class:`DaemonL3`, :class:`L3Store`
==================  =====================================================================

Every name is importable from ``kvcomm.tiers.l3`` itself, as before the package.

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

from ..._extras import require_cluster as require_cluster
from ..._threads import start_quiet as start_quiet
from ...core import codec as codec
from ...core.expiry import deadline_of as deadline_of
from ...core.ext import EMPTY_EXT as EMPTY_EXT
from ...core.ext import MAX_EXT as MAX_EXT
from ...core.ext import ext_problem as _check_ext  # noqa: F401
from ...core.resolve import CONFLICT as CONFLICT
from ...core.resolve import EQUAL as EQUAL
from ...core.resolve import MERGED as MERGED
from ...core.resolve import NEW as NEW
from ...core.resolve import NEWER as NEWER
from ...core.resolve import OLDER as OLDER
from ...core.versions import MAX_COUNTER as MAX_COUNTER
from ...core.versions import Dotted as Dotted
from ...core.versions import Vector as Vector
from ...errors import ConfigError as ConfigError
from ...errors import CorruptRecord as CorruptRecord
from ...errors import Unavailable as Unavailable
from ...errors import UnsupportedValue as UnsupportedValue
from ..groups import DEFAULT_GROUPS as DEFAULT_GROUPS
from ..groups import LEGACY_GROUPS as LEGACY_GROUPS
from ..groups import Groups as Groups
from ..groups import groups as _groups  # noqa: F401
from ..groups import groups as groups
from ..hints import Hints as Hints
from .connection import _TRANSIENT as _TRANSIENT
from .connection import DOWN_PING_EVERY as DOWN_PING_EVERY
from .connection import MASTER_THREADS as MASTER_THREADS
from .connection import Connection as Connection
from .connection import Unreached as Unreached
from .connection import _bound_refresh as _bound_refresh
from .connection import _key_error as _key_error
from .connection import _noscript as _noscript
from .connection import _refused as _refused
from .connection import log as log
from .feed import _ID as _ID
from .feed import FEED_INLINE as FEED_INLINE
from .feed import FEED_MAXLEN as FEED_MAXLEN
from .feed import FEED_MIN as FEED_MIN
from .feed import FEED_TOTAL as FEED_TOTAL
from .feed import FeedEntry as FeedEntry
from .feed import FeedNote as FeedNote
from .feed import _as_id as _as_id
from .feed import _as_seq as _as_seq
from .feed import _entry as _entry
from .feed import _hint_entry as _hint_entry
from .feed import _note as _note
from .feed import _seq as _seq
from .feed import _valid_id as _valid_id
from .feeds import HINT_ENTRIES_MAX as HINT_ENTRIES_MAX
from .feeds import SWEEP_BATCH as SWEEP_BATCH
from .hostkeys import QUARANTINE_MAX as QUARANTINE_MAX
from .hostkeys import WRITE_MARK_MAX as WRITE_MARK_MAX
from .keyindex import INDEX_BATCH as INDEX_BATCH
from .keyindex import NODE_MAP_S as NODE_MAP_S
from .keyindex import _raw as _raw
from .keyindex import _record_names as _record_names
from .keyindex import _utf8 as _utf8
from .meta import META_GROUPS as META_GROUPS
from .meta import META_INDEX as META_INDEX
from .meta import META_STRONG as META_STRONG
from .meta import STRONG_MAX as STRONG_MAX
from .push import HINT_EACH as HINT_EACH
from .push import OUTCOMES as OUTCOMES
from .push import PUSH_BATCH as PUSH_BATCH
from .push import PUSH_BATCH_BYTES as PUSH_BATCH_BYTES
from .push import PUSH_CALL as PUSH_CALL
from .push import PUSH_KEPT as PUSH_KEPT
from .push import PUSH_STORED as PUSH_STORED
from .push import CasResult as CasResult
from .push import PushResult as PushResult
from .records import _ACTOR as _ACTOR
from .records import _FIELD_SET as _FIELD_SET
from .records import _HLC as _HLC
from .records import _RECORD_OVERHEAD as _RECORD_OVERHEAD
from .records import FIELDS as FIELDS
from .records import FORMAT as FORMAT
from .records import GROUPS as GROUPS
from .records import MAX_ACTORS as MAX_ACTORS
from .records import MAX_META as MAX_META
from .records import MAX_VALUE_SIZE as MAX_VALUE_SIZE
from .records import L3Record as L3Record
from .records import _check as _check
from .records import _check_fields as _check_fields
from .records import _check_v1 as _check_v1
from .records import _packed_vector as _packed_vector
from .records import _printable as _printable
from .records import _valid_counter as _valid_counter
from .records import _wire_key as _wire_key
from .records import approx_size as approx_size
from .records import feed_key as feed_key
from .records import group_of as group_of
from .records import read_record as read_record
from .records import record_key as record_key
from .records import seq_key as seq_key
from .replication import HISTORIES_MAX as HISTORIES_MAX
from .replication import UNSEEN_RETRY as UNSEEN_RETRY
from .scripts import BACKFILL_LUA as BACKFILL_LUA
from .scripts import CAS_LUA as CAS_LUA
from .scripts import CURSOR_LUA as CURSOR_LUA
from .scripts import EXPIRE_INDEX_LUA as EXPIRE_INDEX_LUA
from .scripts import INDEX_LUA as INDEX_LUA
from .scripts import POSITION_LUA as POSITION_LUA
from .scripts import PUSH_LUA as PUSH_LUA
from .scripts import SWEEP_LUA as SWEEP_LUA
from .store import AgentL3 as AgentL3
from .store import DaemonL3 as DaemonL3
from .store import L3Store as L3Store

__all__ = ["CasResult", "CorruptRecord", "FeedEntry", "FeedNote", "L3Record", "L3Store",
           "AgentL3", "DaemonL3", "PushResult", "GROUPS",
           "DEFAULT_GROUPS", "EMPTY_EXT", "FORMAT", "Groups", "group_of", "groups", "read_record",
           "record_key", "feed_key", "seq_key"]
