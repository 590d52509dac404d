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

What a caller must know: a key ``k`` lives under ``kvc:{t}:k`` (``t``: its group's hash
tag, :mod:`kvcomm.tiers.groups`), beside its group's change feed ``kvf:{t}``, counter
``kvs:{t}`` and key index ``kvi:{t}``, so one Lua call updates them atomically. A record is
a msgpack map of short named fields (format 2), read by name, decoded defensively: anything
that is not a valid record is :class:`~kvcomm.errors.CorruptRecord` for that key only.
A push merges under the L3 rule (:func:`kvcomm.core.resolve.l3_rule`) and answers, per
record, the outcome and the record L3 holds. Every change is a feed entry numbered by the
group's sequence number (inline, or value-less over ``cluster.feed_inline`` bytes); a gap
or a rewind in those numbers makes the reader resync the group.

Design (keys and slots, the record format and when to bump it, the change feed, sequence
numbers, hints and the sweep, the key index, expiry, what a push does): docs/design/l3.md.
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
