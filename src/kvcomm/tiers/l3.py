"""L3: Redis Cluster as the cluster tier — the record codec, the merge script, the adapter.

Keys and slots
--------------
A KVCOMM key ``k`` is stored under ``kvc:{g}:k`` where ``g = xxh3(k) % GROUPS``. The
hash tag ``{g}`` pins a whole group to one Redis Cluster hash slot, so a record and its
group's change feed (the stream ``kvf:{g}``) are in the same slot and one Lua call
can update both atomically. Redis Cluster spreads the groups' slots over the masters,
replicates them, and fails over; KVCOMM adds nothing to that.

Records (one compact msgpack array, format 1)
---------------------------------------------
``[1, hlc_hex, tombstone, tag, meta, value, [actor, counter, ...], dot_actor, dot_counter]``
(bytes as msgpack's raw/str type: the ``cmsgpack`` inside Redis cannot read ``bin``)

* ``hlc_hex``: the HLC timestamp as 16 lowercase hex digits. Redis' Lua numbers are
  doubles (53 bits); as fixed-width hex the timestamp compares correctly as a string.
* ``tombstone``: a delete, kept so that other hosts learn of it; ``tag``/``meta``/
  ``value`` are the codec's (:mod:`kvcomm.core.codec`), never pickle.
* the version vector flattened, sorted by actor; the dot names the write that made it.

The merge script applies one incoming record atomically against the stored one, by the
rule of :func:`kvcomm.core.resolve.merge_rule` (newer replaces, older is refused and the
stored record comes back, concurrent → last-writer-wins with the merged vector, or
``conflict`` for an application resolver to settle), and appends every change to the
group's stream, bounded by ``MAXLEN ~``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import msgpack
import xxhash

from ..core.resolve import CONFLICT, EQUAL, MERGED, NEW, NEWER, OLDER
from ..core.versions import Dotted, Vector
from ..errors import KVCommError, Unavailable

# Hash-slot groups: each group is one slot, one stream. Daemons read every group's stream
# every feed_poll, and Redis Cluster cannot read streams of different slots in one command,
# so the feed costs GROUPS reads per poll per host: 16 keeps that small (measured in
# bench/bench_cluster.py); it is also the unit a slot balancer can move.
GROUPS = 16
FORMAT = 1
FEED_MAXLEN = 100_000  # events kept per group stream (approximate: MAXLEN ~)
OUTCOMES = (NEW, NEWER, OLDER, EQUAL, MERGED, CONFLICT)


class CorruptRecord(KVCommError):
    """An L3 value under a KVCOMM key is not a KVCOMM record (written by something else)."""


class L3Record(NamedTuple):
    hlc: int
    tombstone: bool
    tag: int
    meta: bytes
    value: bytes
    vector: Vector
    dot: tuple[str, int]

    @property
    def version(self) -> Dotted:
        return Dotted(self.vector, self.dot, self.hlc)

    def encode(self) -> bytes:
        flat: list[object] = []
        for actor, counter in self.vector:
            flat += [actor, counter]
        return msgpack.packb(  # type: ignore[no-any-return]
            [FORMAT, f"{self.hlc:016x}", self.tombstone, self.tag, self.meta, self.value, flat,
             self.dot[0], self.dot[1]], use_bin_type=False)  # Redis' cmsgpack has no bin type

    @staticmethod
    def decode(data: bytes) -> L3Record:
        """Raises CorruptRecord on anything that is not a format-1 record."""
        try:
            r = msgpack.unpackb(data, raw=True)
            if not (isinstance(r, list) and len(r) == 9 and r[0] == FORMAT):
                raise ValueError("not a format-1 record")
            flat = r[6]
            vector = tuple(sorted((flat[i].decode(), int(flat[i + 1]))
                                  for i in range(0, len(flat), 2)))
            hlc = int(r[1].decode(), 16)
            if len(r[1]) != 16 or type(r[3]) is not int or not all(c > 0 for _, c in vector):
                raise ValueError("malformed fields")
            return L3Record(hlc, bool(r[2]), r[3], bytes(r[4]), bytes(r[5]), vector,
                            (r[7].decode(), int(r[8])))
        except CorruptRecord:
            raise
        except Exception as exc:  # msgpack and field errors alike
            raise CorruptRecord(f"not a KVCOMM record ({exc}); remove or rewrite the key") from None


def group_of(key: str) -> int:
    return xxhash.xxh3_64_intdigest(key.encode("utf-8", "surrogatepass")) % GROUPS


def record_key(key: str) -> str:
    return f"kvc:{{{group_of(key)}}}:{key}"


def feed_key(group: int) -> str:
    # its own prefix (same hash tag, so the same slot): a user key named "feed" is safe
    return f"kvf:{{{group}}}"


# KEYS[1] record key, KEYS[2] the group's feed stream
# ARGV[1] incoming record, ARGV[2] "lww" | "siblings", ARGV[3] feed MAXLEN, ARGV[4] user key
MERGE_LUA = r"""
local function valid(r)
  if type(r) ~= 'table' or r[1] ~= 1 or type(r[2]) ~= 'string' or #r[2] ~= 16
     or type(r[7]) ~= 'table' or type(r[8]) ~= 'string' or type(r[9]) ~= 'number' then
    return false
  end
  local f = r[7]
  if #f % 2 ~= 0 then return false end
  for i = 1, #f, 2 do
    if type(f[i]) ~= 'string' or type(f[i + 1]) ~= 'number' then return false end
  end
  return true
end
local function vv(r)
  local t = {}
  local f = r[7]
  for i = 1, #f, 2 do t[f[i]] = f[i + 1] end
  return t
end
local function store(bytes)
  redis.call('SET', KEYS[1], bytes)
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'k', ARGV[4], 'r', bytes)
end
local ok, incoming = pcall(cmsgpack.unpack, ARGV[1])
if not ok or not valid(incoming) then
  return redis.error_reply('KVCOMMBAD incoming record is malformed')
end
local raw = redis.call('GET', KEYS[1])
if not raw then
  store(ARGV[1])
  return {'new', ARGV[1]}
end
local ok2, stored = pcall(cmsgpack.unpack, raw)
if not ok2 or not valid(stored) then
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
if incoming[2] > stored[2] or (incoming[2] == stored[2] and (incoming[8] > stored[8]
   or (incoming[8] == stored[8] and incoming[9] > stored[9]))) then
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
local out = {win[1], win[2], win[3], win[4], win[5], win[6], flat, win[8], win[9]}
local packed = cmsgpack.pack(out)
store(packed)
return {'merged', packed}
"""


class MergeResult(NamedTuple):
    key: str
    outcome: str  # one of OUTCOMES
    record: L3Record  # what L3 holds afterwards (for "conflict": what it holds now)
    durable: bool = True  # a replica acknowledged it (WAIT), so a failover keeps it


class L3Store:
    """The cluster tier over redis-py's RedisCluster (MOVED/ASK and failover are its own).

    Credentials and TLS come from the caller's config, never from code. Redis errors are
    translated: connection trouble → Unavailable, a foreign value → CorruptRecord.
    """

    def __init__(self, seeds: Sequence[tuple[str, int]], *, password: str | None = None,
                 username: str | None = None, tls: bool = False, timeout: float = 2.0,
                 feed_maxlen: int = FEED_MAXLEN, wait_replicas: int = 0,
                 wait_ms: int = 100) -> None:
        from redis.cluster import ClusterNode, RedisCluster

        try:
            self.rc = RedisCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in seeds],  # type: ignore[no-untyped-call]
                decode_responses=False,
                password=password, username=username, ssl=tls, socket_timeout=timeout,
                socket_connect_timeout=timeout, require_full_coverage=True,
            )
        except Exception as exc:
            raise Unavailable(f"cannot reach Redis Cluster at {list(seeds)}: {exc}") from None
        self.feed_maxlen = feed_maxlen
        self.wait_replicas, self.wait_ms = wait_replicas, wait_ms
        self._script = self.rc.register_script(MERGE_LUA)
        self._loaded: set[str] = set()  # nodes known to hold the script
        self._refreshed = 0.0

    def get(self, key: str) -> L3Record | None:
        """The record of ``key``, or None. Raises Unavailable, CorruptRecord."""
        raw = self._call(lambda: self.rc.get(record_key(key)))
        if raw is None:
            return None
        try:
            return L3Record.decode(raw)
        except CorruptRecord as exc:
            raise CorruptRecord(f"L3 value of {key!r}: {exc}") from None

    def merge(self, key: str, record: L3Record, keep_siblings: bool = False) -> MergeResult:
        """Merge one record into L3 atomically. Raises Unavailable, CorruptRecord."""
        args = self._args(key, record, keep_siblings)
        raw = self._call(lambda: self._script(keys=args[0], args=args[1]))
        return self._result(key, raw)

    def merge_many(self, items: Sequence[tuple[str, L3Record]], keep_siblings: bool = False,
                   ) -> list[MergeResult | CorruptRecord]:
        """Merge many records: one pipeline of script calls per master node.

        A key whose stored value is foreign yields a CorruptRecord in its place; the
        others are merged. A key whose slot moved meanwhile is retried through the
        cluster client (which follows MOVED/ASK). Raises Unavailable when the cluster
        cannot be reached.
        """
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for i, (key, _) in enumerate(items):
            node = self._call(lambda key=key: self.rc.get_node_from_key(record_key(key)))  # type: ignore[no-untyped-call]
            by_node.setdefault(node.name, (node, []))[1].append(i)
        out: list[MergeResult | CorruptRecord | None] = [None] * len(items)
        for node, idxs in by_node.values():
            raws = self._call(lambda node=node, idxs=idxs: self._pipeline(node, items, idxs,
                                                                           keep_siblings))
            durable = True
            if self.wait_replicas:
                acked = raws.pop()
                durable = isinstance(acked, int) and acked >= self.wait_replicas
            for i, raw in zip(idxs, raws, strict=True):
                key, record = items[i]
                if not isinstance(raw, Exception):
                    out[i] = self._result(key, raw)._replace(durable=durable)
                elif "KVCOMM" in str(raw):
                    out[i] = CorruptRecord(f"L3 value of {key!r}: {str(raw).split(' ', 1)[-1]}")
                else:  # MOVED / ASK / NOSCRIPT after a failover: one call, redirects followed
                    try:
                        out[i] = self.merge(key, record, keep_siblings)
                    except CorruptRecord as exc:
                        out[i] = exc
        return out  # type: ignore[return-value]

    def _pipeline(self, node: Any, items: Sequence[tuple[str, L3Record]], idxs: list[int],
                  keep_siblings: bool) -> list[Any]:
        conn = self.rc.get_redis_connection(node)
        if node.name not in self._loaded:
            conn.script_load(MERGE_LUA)
            self._loaded.add(node.name)
        pipe = conn.pipeline(transaction=False)
        for i in idxs:
            keys, args = self._args(items[i][0], items[i][1], keep_siblings)
            pipe.evalsha(self._script.sha, 2, *keys, *args)
        if self.wait_replicas:
            pipe.execute_command("WAIT", self.wait_replicas, self.wait_ms)  # type: ignore[no-untyped-call]
        raws: list[Any] = pipe.execute(raise_on_error=False)
        if any("NOSCRIPT" in str(r) for r in raws if isinstance(r, Exception)):
            self._loaded.discard(node.name)  # a restarted node: load again next time
        return raws

    def feed(self, group: int, after: bytes = b"0-0", count: int = 1000,
             ) -> list[tuple[bytes, str, bytes]]:
        """Change-feed entries of one group after stream id ``after``: (id, key, record)."""
        rows = self._call(lambda: self.rc.xrange(feed_key(group), min=b"(" + after, count=count))
        return [(eid, f[b"k"].decode("utf-8", "surrogatepass"), f[b"r"]) for eid, f in rows]

    def feed_many(self, cursors: dict[int, bytes], count: int = 500,
                  ) -> dict[int, list[tuple[bytes, str, bytes]]]:
        """:meth:`feed` for many groups: one pipeline of XRANGEs per master node."""
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for g in cursors:
            node = self._call(lambda g=g: self.rc.get_node_from_key(feed_key(g)))  # type: ignore[no-untyped-call]
            by_node.setdefault(node.name, (node, []))[1].append(g)
        out: dict[int, list[tuple[bytes, str, bytes]]] = {}
        for node, groups in by_node.values():
            def run(node: Any = node, groups: list[int] = groups) -> list[Any]:
                pipe = self.rc.get_redis_connection(node).pipeline(transaction=False)
                for g in groups:
                    pipe.xrange(feed_key(g), min=b"(" + cursors[g], count=count)
                return pipe.execute(raise_on_error=False)

            for g, rows in zip(groups, self._call(run), strict=True):
                if isinstance(rows, Exception):  # the slot moved: one call, redirects followed
                    rows = self._call(lambda g=g: self.rc.xrange(feed_key(g), min=b"(" + cursors[g],
                                                                 count=count))
                out[g] = [(eid, f[b"k"].decode("utf-8", "surrogatepass"), f[b"r"]) for eid, f in rows]
        return out

    def feed_bounds(self, group: int) -> tuple[bytes | None, bytes]:
        """(first id still kept, or None when trimmed empty; last id ever added)."""
        try:
            info = self._call(lambda: self.rc.xinfo_stream(feed_key(group)))
        except Unavailable as exc:
            if "no such key" in str(exc).lower():
                return None, b"0-0"
            raise
        first = info.get("first-entry")
        return (_as_id(first[0]) if first else None,
                _as_id(info.get("last-generated-id", b"0-0")))

    def scan_keys(self) -> Any:
        """Every KVCOMM key L3 holds, from every master (a SCAN: for rebuilds, not hot paths)."""
        def run() -> list[bytes]:
            return list(self.rc.scan_iter(match="kvc:{*", count=1000))

        for raw in self._call(run):
            yield raw.split(b"}:", 1)[1]

    def save_hot(self, host: str, keys: list[str]) -> None:
        """This host's hot-key list, for the next daemon run to prewarm L2 with."""
        self._call(lambda: self.rc.set(f"kvn:{{{host}}}:hot", msgpack.packb(keys)))

    def load_hot(self, host: str) -> list[str]:
        raw = self._call(lambda: self.rc.get(f"kvn:{{{host}}}:hot"))
        try:
            keys = msgpack.unpackb(raw) if raw else []
        except Exception:  # written by something else: start without a list
            return []
        return [k for k in keys if isinstance(k, str)] if isinstance(keys, list) else []

    def load_cursors(self, host: str) -> dict[int, bytes]:
        raw = self._call(lambda: self.rc.hgetall(f"kvn:{{{host}}}:cursors"))
        return {int(k): v for k, v in raw.items()}

    def save_cursors(self, host: str, cursors: dict[int, bytes]) -> None:
        if cursors:
            self._call(lambda: self.rc.hset(f"kvn:{{{host}}}:cursors",
                                            mapping={str(g): c for g, c in cursors.items()}))

    def close(self) -> None:
        self.rc.close()

    # ------------------------------------------------------------------ helpers

    def _args(self, key: str, record: L3Record, keep_siblings: bool,
              ) -> tuple[list[str], list[Any]]:
        return ([record_key(key), feed_key(group_of(key))],
                [record.encode(), "siblings" if keep_siblings else "lww", self.feed_maxlen,
                 key.encode("utf-8", "surrogatepass")])

    def _result(self, key: str, raw: Any) -> MergeResult:
        outcome, data = raw[0].decode(), raw[1]
        if outcome not in OUTCOMES:
            raise CorruptRecord(f"unexpected merge outcome {outcome!r} for {key!r}")
        return MergeResult(key, outcome, L3Record.decode(data))

    def _call(self, fn: Any) -> Any:
        from redis import exceptions as rex

        try:
            return fn()
        except rex.ResponseError as exc:
            msg = str(exc)
            if "KVCOMMCORRUPT" in msg or "KVCOMMBAD" in msg:
                raise CorruptRecord(msg.split(" ", 1)[-1]) from None
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
        if now - self._refreshed < 0.5:
            return
        self._refreshed = now
        try:
            self.rc.nodes_manager.initialize()
        except Exception:  # the cluster may still be electing: the next call retries
            pass


def _as_id(v: Any) -> bytes:
    return v if isinstance(v, bytes) else str(v).encode()
