"""L3: Redis Cluster as the cluster tier — the record codec, the push script, the adapter.

Keys and slots
--------------
A KVCOMM key ``k`` is stored under ``kvc:{g}:k`` where ``g = xxh3(k) % GROUPS``. The
hash tag ``{g}`` pins a whole group to one Redis Cluster hash slot, so a record and its
group's change feed (the stream ``kvf:{g}``) are in the same slot and one Lua call
can update both atomically. Redis Cluster spreads the groups' slots over the masters,
replicates them, and fails over; KVCOMM adds nothing to that.

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
counters in 1..2**64-1, the value at most ``cache.max_value_size``, ``x`` at most
MAX_EXT bytes holding one map), msgpack's length limits are set so that no length field
can make the decoder allocate more than the record's own size, and any failure is
:class:`~kvcomm.errors.CorruptRecord` for that key only. :meth:`L3Record.decode_value`
does the same for the value inside.

Change feed and its sequence numbers
------------------------------------
Every change the push script stores is appended to the group's stream ``kvf:{g}``
with a field ``s``: the group's sequence number, ``INCR`` of ``kvs:{g}`` (same hash
tag, same slot, same atomic script). A reader that knows the last sequence number it
saw can tell from any entry whether it missed some: a first entry whose ``s`` is not
last + 1 means entries were trimmed past its cursor (a gap); an ``s`` at or below the
last means the stream went backwards (a failover lost entries that it had read). Either
way the reader resyncs that group from the records themselves (:meth:`L3Store.feed_position`
then re-reads). A read that returns nothing carries no sequence number, so a reader also
compares its last sequence number with ``kvs:{g}`` now and then (:meth:`L3Store.feed_seqs`).

Pushing a record (:meth:`L3Store.push`, :meth:`L3Store.push_many`) runs the push script,
which applies the incoming record atomically against the stored one by the L3 rule,
:func:`kvcomm.core.resolve.l3_rule` (newer replaces, older is refused and the stored
record comes back, concurrent → last-writer-wins with the merged vector, or ``conflict``
for an application resolver to settle), and appends every change to the group's stream,
bounded by ``MAXLEN ~``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Set
from typing import Any, NamedTuple

import msgpack
import xxhash

from .._extras import require_cluster
from ..core import codec
from ..core.resolve import CONFLICT, EQUAL, MERGED, NEW, NEWER, OLDER
from ..core.versions import Dotted, Vector
from ..errors import CorruptRecord, Unavailable, UnsupportedValue

__all__ = ["CorruptRecord", "FeedEntry", "L3Record", "L3Store", "PushResult", "GROUPS",
           "EMPTY_EXT", "FORMAT", "group_of", "read_record", "record_key", "feed_key",
           "seq_key"]

log = logging.getLogger("kvcomm.l3")

# Hash-slot groups: each group is one slot, one stream. Daemons read every group's stream
# every feed_poll, and Redis Cluster cannot read streams of different slots in one command,
# so the feed costs GROUPS reads per poll per host: 16 keeps that small (measured in
# bench/bench_cluster.py); it is also the unit a slot balancer can move.
GROUPS = 16
FORMAT = 2  # the record format written (see "When to bump FORMAT" above)
FIELDS = ("f", "h", "d", "t", "m", "v", "vv", "dot", "x")  # a format-2 record's keys
EMPTY_EXT = b"\x80"  # the empty msgpack map: the extension of a record that has none
FEED_MAXLEN = 100_000  # events kept per group stream (approximate: MAXLEN ~)
OUTCOMES = (NEW, NEWER, OLDER, EQUAL, MERGED, CONFLICT)
QUARANTINE_MAX = 1000  # entries kept in a host's quarantine list (kvn:{host}:quarantine)

# Bounds of a valid record (see L3Record.decode). The value's own bound is the
# configured cache.max_value_size; these are the rest.
MAX_VALUE_SIZE = 64 << 20  # cache.max_value_size's default, for callers without a config
MAX_META = 4096  # the codec's meta is an array header: [dtype, shape] of at most 64 dims
MAX_EXT = 4096  # the packed extension map
MAX_ACTORS = 1024  # hosts in one version vector
MAX_COUNTER = 2**64 - 1
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
        of at most MAX_EXT bytes with string keys, counters outside 1..2**64-1, actors
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
            return "a version-vector entry is not (host id, counter in 1..2**64-1)"
        seen.add(a)
    if len(seen) != len(flat) // 2:
        return "an actor appears twice in the version vector"
    if type(actor) is not bytes or not _ACTOR.match(actor) or not _valid_counter(counter):
        return "the dot is not (host id, counter in 1..2**64-1)"
    return ""


def _check_ext(x: object) -> str:
    """Why ``x`` is not a packed extension map; "" if it is."""
    if type(x) is not bytes or len(x) > MAX_EXT:
        return f"the extension is not bytes of at most {MAX_EXT}"
    try:
        m = msgpack.unpackb(x, raw=False, max_str_len=MAX_EXT, max_bin_len=MAX_EXT,
                            max_array_len=MAX_EXT, max_map_len=MAX_EXT, max_ext_len=0)
    except Exception:  # msgpack's errors have no common base; bad UTF-8 in a key too
        return "the extension is not one msgpack value"
    if type(m) is not dict or not all(type(k) is str for k in m):
        return "the extension is not a map with string keys"
    return ""


def group_of(key: str) -> int:
    return xxhash.xxh3_64_intdigest(key.encode("utf-8", "surrogatepass")) % GROUPS


def record_key(key: str) -> str:
    return f"kvc:{{{group_of(key)}}}:{key}"


def feed_key(group: int) -> str:
    # its own prefix (same hash tag, so the same slot): a user key named "feed" is safe
    return f"kvf:{{{group}}}"


def seq_key(group: int) -> str:
    """The group's change counter: the sequence number of its latest feed entry."""
    return f"kvs:{{{group}}}"


# The L3 rule (kvcomm.core.resolve.l3_rule) run inside Redis, atomically per key.
# KEYS[1] record key, KEYS[2] the group's feed stream, KEYS[3] the group's sequence counter
# ARGV[1] incoming record, ARGV[2] "lww" | "siblings", ARGV[3] feed MAXLEN, ARGV[4] user key
PUSH_LUA = r"""
local EMPTY_EXT = '\128'
-- a record as a table of named fields, or nil when it is not one (fields read by name;
-- a format-1 array is read into the same names)
local function read(raw)
  local ok, r = pcall(cmsgpack.unpack, raw)
  if not ok or type(r) ~= 'table' then return nil end
  if r.f == nil and r[1] == 1 and #r == 9 then
    r = {f = 1, h = r[2], d = r[3], t = r[4], m = r[5], v = r[6], vv = r[7],
         dot = {r[8], r[9]}, x = EMPTY_EXT}
  elseif r.f ~= 2 then
    return nil
  end
  if type(r.h) ~= 'string' or #r.h ~= 16 or type(r.d) ~= 'boolean'
     or type(r.t) ~= 'number' or type(r.m) ~= 'string' or type(r.v) ~= 'string'
     or type(r.x) ~= 'string' or type(r.vv) ~= 'table' or type(r.dot) ~= 'table'
     or type(r.dot[1]) ~= 'string' or type(r.dot[2]) ~= 'number' then
    return nil
  end
  local f = r.vv
  if #f % 2 ~= 0 then return nil end
  for i = 1, #f, 2 do
    if type(f[i]) ~= 'string' or type(f[i + 1]) ~= 'number' then return nil end
  end
  return r
end
local function vv(r)
  local t = {}
  local f = r.vv
  for i = 1, #f, 2 do t[f[i]] = f[i + 1] end
  return t
end
local function store(bytes)
  -- (a script is not rolled back on error: the record goes last, once its feed entry is in)
  local s = redis.pcall('INCR', KEYS[3])
  if type(s) ~= 'number' then  -- a foreign value: restart the sequence (readers resync)
    redis.call('DEL', KEYS[3])
    s = redis.call('INCR', KEYS[3])
  end
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'k', ARGV[4], 'r', bytes, 's', s)
  redis.call('SET', KEYS[1], bytes)
end
local incoming = read(ARGV[1])
if incoming == nil then
  return redis.error_reply('KVCOMMBAD incoming record is malformed')
end
local raw = redis.call('GET', KEYS[1])
if not raw then
  store(ARGV[1])
  return {'new', ARGV[1]}
end
local stored = read(raw)
if stored == nil then
  return redis.error_reply('KVCOMMCORRUPT stored value is not a KVCOMM record')
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
if a_ge and b_ge then return {'equal', raw} end
if a_ge then
  store(ARGV[1])
  return {'newer', ARGV[1]}
end
if b_ge then return {'older', raw} end
if ARGV[2] == 'siblings' then return {'conflict', raw} end
-- concurrent: last writer wins by (hlc, dot actor, dot counter); vectors merged
local win = stored
if incoming.h > stored.h or (incoming.h == stored.h and (incoming.dot[1] > stored.dot[1]
   or (incoming.dot[1] == stored.dot[1] and incoming.dot[2] > stored.dot[2]))) then
  win = incoming
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
local packed = cmsgpack.pack(out)
store(packed)
return {'merged', packed}
"""

# A group's feed position, read atomically: {sequence number, id of the last entry kept
# or "0-0"}. A reader that resumes from there misses nothing and re-reads nothing.
# KEYS[1] the group's feed stream, KEYS[2] its sequence counter
POSITION_LUA = r"""
local s = tonumber(redis.call('GET', KEYS[2]) or '0') or -1
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #last == 0 then return {s, '0-0'} end
return {s, last[1][1]}
"""

# Redis errors that say "not now" (a failover, a slot on the move, a restarted node)
# rather than "not this key": they become Unavailable, and the caller retries.
_TRANSIENT = ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN", "LOADING", "MASTERDOWN", "READONLY",
              "NOSCRIPT", "BUSY", "NOREPLICAS", "OOM", "NOPERM", "NOAUTH")


def _key_error(msg: str) -> bool:
    """True when a Redis error concerns the value under one key (a foreign value)."""
    return ("KVCOMMCORRUPT" in msg or "KVCOMMBAD" in msg or "WRONGTYPE" in msg
            or "not an integer" in msg)


class FeedEntry(NamedTuple):
    """One change-feed entry. ``key`` is None and ``problem`` says why when the entry
    cannot be used (a key field that is not strict UTF-8, say); ``seq`` is None when
    the entry has no valid sequence number (written by something else)."""

    id: bytes
    key: str | None
    record: bytes
    seq: int | None
    problem: str = ""


def _entry(eid: Any, fields: Any) -> FeedEntry:
    """Parse one XRANGE row, never raising: whatever is wrong goes into ``problem``."""
    eid = eid if isinstance(eid, bytes) else str(eid).encode()
    if not isinstance(fields, dict):
        return FeedEntry(eid, None, b"", None, "entry fields are not a map")
    raw_seq = fields.get(b"s")
    seq = int(raw_seq) if isinstance(raw_seq, bytes) and raw_seq.isdigit() and len(raw_seq) < 20 else None
    kb, rec = fields.get(b"k"), fields.get(b"r")
    if not isinstance(kb, bytes) or not isinstance(rec, bytes):
        return FeedEntry(eid, None, b"", seq, "entry lacks its key (k) or record (r) field")
    try:
        key = kb.decode("utf-8")  # strict: no lone surrogates, nothing redis-py cannot send
    except UnicodeDecodeError:
        return FeedEntry(eid, None, rec, seq, f"key {kb[:80]!r} is not valid UTF-8")
    if not key or "\0" in key:
        return FeedEntry(eid, None, rec, seq, f"key {kb[:80]!r} is empty or holds NUL")
    return FeedEntry(eid, key, rec, seq)


class PushResult(NamedTuple):
    """L3's answer to one pushed record."""

    key: str
    outcome: str  # one of OUTCOMES
    record: L3Record  # what L3 holds afterwards (for "conflict": what it holds now)
    durable: bool = True  # a replica acknowledged it (WAIT), so a failover keeps it


class L3Store:
    """The cluster tier over redis-py's RedisCluster (MOVED/ASK and failover are its own).

    Credentials and TLS come from the caller's config, never from code. Redis errors are
    translated: connection trouble → Unavailable, a foreign value under one key →
    CorruptRecord for that key. ``max_value_size`` (``cache.max_value_size``) bounds
    what a record read back may hold.
    """

    def __init__(self, seeds: Sequence[tuple[str, int]], *, password: str | None = None,
                 username: str | None = None, tls: bool = False, timeout: float = 2.0,
                 feed_maxlen: int = FEED_MAXLEN, wait_replicas: int = 0,
                 wait_ms: int = 100, max_value_size: int = MAX_VALUE_SIZE,
                 tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None,
                 address_remap: Callable[[tuple[str, int]], tuple[str, int]] | None = None
                 ) -> None:
        require_cluster()  # a ConfigError naming kvcomm[cluster] when redis-py is missing
        from redis.cluster import ClusterNode

        from ..metrics.wire import counting_cluster

        extra: dict[str, Any] = {}
        if address_remap is not None:  # cluster.address_remap: every node through it
            extra["address_remap"] = address_remap
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
        self.wire = self.rc.wire  # type: ignore[attr-defined]  # commands and bytes to and from Redis (kvcomm metrics)
        self.feed_maxlen = feed_maxlen
        self.wait_replicas, self.wait_ms = wait_replicas, wait_ms
        self.degraded: dict[str, int] = {}  # master → writes acknowledged by fewer replicas
        self.connected: dict[str, int] = {}  # master → replicas it had at the last write
        self.max_value_size = max_value_size
        self._script = self.rc.register_script(PUSH_LUA)
        self._position = self.rc.register_script(POSITION_LUA)
        self._loaded: set[str] = set()  # nodes known to hold the push script
        self._refreshed = 0.0
        # seconds between slot-map refreshes after a failed call: each one may try every
        # seed for cluster.timeout; the daemon spaces them out in partition mode
        self.refresh_every = 0.5

    @classmethod
    def from_config(cls, cluster: Any, *, max_value_size: int = MAX_VALUE_SIZE,
                    daemon: bool = False) -> L3Store:
        """The store a host's ``cluster`` config describes: its seeds and every node
        routed through ``cluster.address_remap``, credentials, TLS files, timeout (and,
        for the node daemon, the feed bound and WAIT settings). Raises Unavailable,
        ConfigError."""
        cl = cluster
        kw: dict[str, Any] = {}
        if daemon:
            kw = {"feed_maxlen": cl.feed_maxlen, "wait_replicas": cl.wait_replicas,
                  "wait_ms": int(cl.wait_timeout * 1000)}
        return cls(cl.seeds(), username=cl.redis_username, password=cl.redis_password,
                   tls=cl.redis_tls, timeout=cl.timeout, max_value_size=max_value_size,
                   tls_ca=cl.redis_ca, tls_cert=cl.redis_cert, tls_key=cl.redis_key,
                   address_remap=cl.remap_address if cl.address_remap else None, **kw)

    def decode(self, raw: object, key: str = "") -> L3Record:
        """:func:`read_record` under this store's bound; CorruptRecord names ``key``."""
        return read_record(raw, key, self.max_value_size)

    def get(self, key: str) -> L3Record | None:
        """The record of ``key``, or None. Raises Unavailable, CorruptRecord."""
        raw = self._call(lambda: self.rc.get(_wire_key(record_key(key))), key)
        return None if raw is None else self.decode(raw, key)

    def push(self, key: str, record: L3Record, keep_siblings: bool = False) -> PushResult:
        """Push one record into L3: the L3 rule, applied atomically (``keep_siblings``:
        a concurrent record comes back as ``conflict`` instead of being merged
        last-writer-wins). Raises Unavailable, CorruptRecord (the stored value is
        foreign, or the key cannot be sent); nothing is stored then."""
        args = self._args(key, record, keep_siblings)
        raw = self._call(lambda: self._script(keys=args[0], args=args[1]), key)
        return self._result(key, raw)

    def push_many(self, items: Sequence[tuple[str, L3Record]],
                  keep_siblings: Set[str] = frozenset()) -> list[PushResult | CorruptRecord]:
        """Push many records: one pipeline of script calls per master node. The keys in
        ``keep_siblings`` get ``conflict`` for a concurrent record (as :meth:`push`).

        Returns one answer per item, in order. A key whose stored value is foreign, or
        that cannot be sent (not strict UTF-8), yields a CorruptRecord in its place; the
        others are pushed. A key whose slot
        moved meanwhile is retried through the cluster client (which follows MOVED/ASK).
        Raises Unavailable when the cluster cannot be reached.
        """
        by_node: dict[str, tuple[Any, list[int]]] = {}
        out: list[PushResult | CorruptRecord | None] = [None] * len(items)
        for i, (key, _) in enumerate(items):
            try:
                _wire_key(key)
            except CorruptRecord as exc:
                out[i] = exc
                continue
            node = self._call(lambda key=key: self.rc.get_node_from_key(record_key(key)))  # type: ignore[no-untyped-call]
            by_node.setdefault(node.name, (node, []))[1].append(i)
        for node, idxs in by_node.values():
            raws = self._call(lambda node=node, idxs=idxs: self._pipeline(node, items, idxs,
                                                                           keep_siblings))
            durable = True
            if self.wait_replicas:
                acked, role = raws.pop(), raws.pop()
                durable = isinstance(acked, int) and acked >= self._replicas_to_wait(node, role)
            for i, raw in zip(idxs, raws, strict=True):
                key, record = items[i]
                try:
                    if not isinstance(raw, Exception):
                        out[i] = self._result(key, raw)._replace(durable=durable)
                    elif _key_error(str(raw)):
                        out[i] = CorruptRecord(f"L3 value of {key!r}: {str(raw).split(' ', 1)[-1]}")
                    else:  # MOVED / ASK / NOSCRIPT after a failover: one call, redirects followed
                        out[i] = self.push(key, record, key in keep_siblings)
                except CorruptRecord as exc:
                    out[i] = exc
        return out  # type: ignore[return-value]

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

    def _pipeline(self, node: Any, items: Sequence[tuple[str, L3Record]], idxs: list[int],
                  keep_siblings: Set[str]) -> list[Any]:
        conn = self.rc.get_redis_connection(node)
        if node.name not in self._loaded:
            conn.script_load(PUSH_LUA)
            self._loaded.add(node.name)
        pipe = conn.pipeline(transaction=False)
        for i in idxs:
            keys, args = self._args(items[i][0], items[i][1], items[i][0] in keep_siblings)
            pipe.evalsha(self._script.sha, len(keys), *keys, *args)
        if self.wait_replicas:
            # wait only for the replicas the master had last time (none: no wait at all)
            want = min(self.wait_replicas, self.connected.get(node.name, self.wait_replicas))
            pipe.execute_command("ROLE")  # type: ignore[no-untyped-call]
            pipe.execute_command("WAIT", want, self.wait_ms)  # type: ignore[no-untyped-call]
        raws: list[Any] = pipe.execute(raise_on_error=False)
        if any("NOSCRIPT" in str(r) for r in raws if isinstance(r, Exception)):
            self._loaded.discard(node.name)  # a restarted node: load again next time
        return raws

    # ------------------------------------------------------------------ the change feed

    def feed(self, group: int, after: bytes = b"0-0", count: int = 1000) -> list[FeedEntry]:
        """Change-feed entries of one group after stream id ``after``."""
        rows = self._call(lambda: self.rc.xrange(feed_key(group), min=b"(" + after, count=count))
        return [_entry(eid, f) for eid, f in rows]

    def feed_many(self, cursors: Mapping[int, bytes], count: int = 500,
                  ) -> dict[int, list[FeedEntry] | CorruptRecord]:
        """:meth:`feed` for many groups: one pipeline of XRANGEs per master node.

        A group whose stream cannot be read as one (a foreign value under its key) gets
        a CorruptRecord in place of its entries. Raises Unavailable when the cluster
        cannot be reached.
        """
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for g in cursors:
            node = self._call(lambda g=g: self.rc.get_node_from_key(feed_key(g)))  # type: ignore[no-untyped-call]
            by_node.setdefault(node.name, (node, []))[1].append(g)
        out: dict[int, list[FeedEntry] | CorruptRecord] = {}
        for node, groups in by_node.values():
            def run(node: Any = node, groups: list[int] = groups) -> list[Any]:
                pipe = self.rc.get_redis_connection(node).pipeline(transaction=False)
                for g in groups:
                    pipe.xrange(feed_key(g), min=b"(" + cursors[g], count=count)
                return pipe.execute(raise_on_error=False)

            for g, rows in zip(groups, self._call(run), strict=True):
                try:
                    if isinstance(rows, Exception):  # the slot moved: one call, redirects followed
                        if _key_error(str(rows)):
                            raise CorruptRecord(f"L3 feed of group {g}: {rows}")
                        rows = self._call(lambda g=g: self.rc.xrange(
                            feed_key(g), min=b"(" + cursors[g], count=count), feed_key(g))
                    out[g] = [_entry(eid, f) for eid, f in rows]
                except CorruptRecord as exc:
                    out[g] = exc
        return out

    def feed_seqs(self, groups: Iterable[int]) -> dict[int, int | None]:
        """Each group's sequence number now (0: no change yet; None: a foreign value).

        One pipeline of GETs per master node. Raises Unavailable.
        """
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for g in groups:
            node = self._call(lambda g=g: self.rc.get_node_from_key(seq_key(g)))  # type: ignore[no-untyped-call]
            by_node.setdefault(node.name, (node, []))[1].append(g)
        out: dict[int, int | None] = {}
        for node, gs in by_node.values():
            def run(node: Any = node, gs: list[int] = gs) -> list[Any]:
                pipe = self.rc.get_redis_connection(node).pipeline(transaction=False)
                for g in gs:
                    pipe.get(seq_key(g))
                return pipe.execute(raise_on_error=False)

            for g, raw in zip(gs, self._call(run), strict=True):
                if isinstance(raw, Exception):  # moved: one call, redirects followed
                    try:
                        raw = self._call(lambda g=g: self.rc.get(seq_key(g)), seq_key(g))
                    except CorruptRecord:
                        raw = b"?"
                out[g] = 0 if raw is None else _as_seq(raw)
        return out

    def feed_position(self, group: int) -> tuple[int | None, bytes]:
        """(sequence number, id of the last entry kept or ``0-0``) of one group, read
        atomically: resuming from there misses no later change. Raises Unavailable."""
        raw = self._call(lambda: self._position(keys=[feed_key(group), seq_key(group)]),
                         feed_key(group))
        seq = raw[0] if type(raw[0]) is int and raw[0] >= 0 else None
        return seq, _as_id(raw[1])

    def feed_bounds(self, group: int) -> tuple[bytes | None, bytes]:
        """(first id still kept, or None when trimmed empty; last id ever added)."""
        try:
            info = self._call(lambda: self.rc.xinfo_stream(feed_key(group)), feed_key(group))
        except Unavailable as exc:
            if "no such key" in str(exc).lower():
                return None, b"0-0"
            raise
        first = info.get("first-entry")
        return (_as_id(first[0]) if first else None,
                _as_id(info.get("last-generated-id", b"0-0")))

    # ------------------------------------------------------------------ scans

    def scan_keys(self) -> Iterator[bytes]:
        """Every KVCOMM key L3 holds, from every master (a SCAN: for rebuilds, not hot paths)."""
        def run() -> list[bytes]:
            return list(self.rc.scan_iter(match="kvc:{*", count=1000))

        for raw in self._call(run):
            _, sep, key = raw.partition(b"}:")
            if sep and key:  # (a foreign name under our prefix is no key of ours)
                yield key

    def scan_group(self, group: int) -> Iterator[bytes]:
        """Every KVCOMM key of one group (a SCAN of the master serving its slot)."""
        prefix = f"kvc:{{{group}}}:".encode()

        def run() -> list[bytes]:
            node = self.rc.get_node_from_key(feed_key(group))  # type: ignore[no-untyped-call]
            conn = self.rc.get_redis_connection(node)
            return list(conn.scan_iter(match=prefix + b"*", count=1000))

        for raw in self._call(run):
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
        self._call(lambda: self.rc.set(f"kvn:{{{host}}}:hot", msgpack.packb(keys)))

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
            if name.isdigit() and int(name) < GROUPS and _valid_id(v):
                cursors[int(name)] = v
            elif name[:1] == "s" and name[1:].isdigit() and int(name[1:]) < GROUPS:
                seq = _as_seq(v)
                if seq is not None:
                    seqs[int(name[1:])] = seq
        return cursors, seqs

    def save_cursors(self, host: str, cursors: dict[int, bytes],
                     seqs: dict[int, int] | None = None) -> None:
        mapping: dict[Any, Any] = {str(g): c for g, c in cursors.items()}
        mapping.update({f"s{g}": s for g, s in (seqs or {}).items()})
        if mapping:
            self._own_key(f"kvn:{{{host}}}:cursors",
                          lambda name: self.rc.hset(name, mapping=mapping))

    def quarantine(self, host: str, key: str, reason: str, when: float,
                   keep: int = QUARANTINE_MAX) -> None:
        """Set an input aside: push ``[key, reason, when]`` (msgpack) onto the host's capped
        list ``kvn:{host}:quarantine`` (newest first, ``keep`` kept). Raises Unavailable."""
        entry = msgpack.packb([_printable(key)[:1000], _printable(reason)[:1000], when])

        def run(name: str) -> None:
            pipe = self.rc.pipeline()  # type: ignore[no-untyped-call]
            pipe.lpush(name, entry)
            pipe.ltrim(name, 0, keep - 1)
            pipe.execute()

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
        self.rc.close()

    def _own_key(self, name: str, write: Any) -> None:
        """``write(name)`` to a key of KVCOMM's own (``kvn:``); if something else left a
        value of another type there, replace it. Raises Unavailable, CorruptRecord."""
        try:
            self._call(lambda: write(name), name)
        except CorruptRecord:
            self._call(lambda: self.rc.delete(name))
            self._call(lambda: write(name), name)

    # ------------------------------------------------------------------ helpers

    def _args(self, key: str, record: L3Record, keep_siblings: bool,
              ) -> tuple[list[bytes | str], list[Any]]:
        g = group_of(key)
        return ([_wire_key(record_key(key)), feed_key(g), seq_key(g)],
                [record.encode(), "siblings" if keep_siblings else "lww", self.feed_maxlen,
                 _wire_key(key)])

    def _result(self, key: str, raw: Any) -> PushResult:
        try:
            outcome = raw[0].decode()
            data = raw[1]
        except Exception:
            raise CorruptRecord(f"unexpected push reply {raw!r:.200} for {key!r}") from None
        if outcome not in OUTCOMES:
            raise CorruptRecord(f"unexpected push outcome {outcome!r} for {key!r}")
        return PushResult(key, outcome, self.decode(data, key))

    def _call(self, fn: Any, key: str | None = None) -> Any:
        """Run one Redis call; errors translated (``key`` names the value a key error is about)."""
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
                rex.ClusterError) as exc:
            self._refresh_topology()
            raise Unavailable(f"Redis Cluster unreachable: {exc}; the write stays in L2") from None

    def _refresh_topology(self) -> None:
        """Re-read the slot map (after a failover our per-node pipelines would keep
        dialling the dead master: redis-py only refreshes on its own command path)."""
        import time

        now = time.monotonic()
        if now - self._refreshed < self.refresh_every:
            return
        self._refreshed = now
        try:
            self.rc.nodes_manager.initialize()
        except Exception:  # the cluster may still be electing: the next call retries
            pass



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
