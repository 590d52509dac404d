"""The faces of L3: the store a caller holds, composed of parts that own their state
(:mod:`.connection`, :mod:`.replication`, :mod:`.push`, :mod:`.reads`, :mod:`.feeds`,
:mod:`.keyindex`, :mod:`.hostkeys`, :mod:`.meta`), one set of parts per store.

* :class:`AgentL3` — what an agent (the client library) asks of L3: records read,
  conditional writes, prefix scans, the write mark, the cluster's strong keys.
* :class:`DaemonL3` — what a host's node daemon asks: pushes and their replication,
  feed reads and hints, the host's own keys, the key index's upkeep, the masters down.
* :class:`L3Store` — both, and what tools and tests use besides (scans of every key,
  retired hosts, the parts' internals under their former names): the one every
  existing caller holds.

Each face builds the parts the same way (one constructor, :class:`_L3Base`); a method of
a face calls its part. ``from_config`` chooses the settings each kind of caller needs
(the daemon: feed bound and WAIT settings; an agent: calls bounded by about 2 x
``cluster.timeout``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Set
from typing import Any

from ...core.versions import Vector
from ...errors import CorruptRecord, KVCommError
from ..groups import DEFAULT_GROUPS
from .connection import Connection, Unreached
from .feed import FEED_INLINE, FEED_MAXLEN, FEED_TOTAL, FeedEntry
from .feeds import FeedReader
from .hostkeys import QUARANTINE_MAX, HostRecords
from .keyindex import ClusterKeyIndex
from .meta import ClusterMeta
from .push import CasResult, L3Pushes, PushResult
from .reads import RecordReads
from .records import MAX_VALUE_SIZE, L3Record, _wire_key, read_record
from .replication import Replication


def _via(part: str, name: str) -> Any:
    """An attribute of a face that is a part's own: read (and set) there. (A property
    over attrgetter: read at C speed.)"""
    def put(face: Any, value: Any) -> None:
        setattr(getattr(face, part), name, value)

    return property(operator.attrgetter(f"{part}.{name}"), put,
                    doc=f"The store's ``{name}`` (its part ``{part}`` holds it).")


def _settings(cluster: Any, max_value_size: int, daemon: bool, agent: bool) -> dict[str, Any]:
    """The constructor's arguments for a host's ``cluster`` config: its seeds and every
    node routed through ``cluster.address_remap``, credentials, TLS files, timeout (and,
    for the node daemon, the feed bound and WAIT settings; for an agent, calls that fail
    within about 2 x ``cluster.timeout``: no redis-py retries, a bounded slot-map
    refresh)."""
    cl = cluster
    kw: dict[str, Any] = {"feed_inline": cl.feed_inline}
    if daemon:
        kw |= {"feed_maxlen": cl.feed_maxlen, "wait_replicas": cl.wait_replicas,
               "wait_ms": int(cl.wait_timeout * 1000), "feed_total": cl.feed_total}
    if agent:  # an agent's call: bounded by about 2 x cluster.timeout (_bound_refresh)
        kw |= {"retries": 0, "bounded_refresh": True}
    return dict(seeds=cl.seeds(), username=cl.redis_username, password=cl.redis_password,
                tls=cl.redis_tls, timeout=cl.timeout, max_value_size=max_value_size,
                groups=cl.groups, tls_ca=cl.redis_ca, tls_cert=cl.redis_cert,
                tls_key=cl.redis_key,
                address_remap=cl.remap_address if cl.address_remap else None,
                tombstone_grace=cl.tombstone_grace, **kw)


class _L3Base:
    """The parts of one store, and what every face offers: records read and pushed, the
    group count checked, the write mark.

    The cluster tier over redis-py's RedisCluster (MOVED/ASK and failover are its own).
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
        self._conn = Connection(
            seeds, password=password, username=username, tls=tls, timeout=timeout,
            max_value_size=max_value_size, groups=groups, tls_ca=tls_ca, tls_cert=tls_cert,
            tls_key=tls_key, address_remap=address_remap, retries=retries,
            bounded_refresh=bounded_refresh)
        self._repl = Replication(self._conn, wait_replicas, wait_ms)
        self._pushes = L3Pushes(self._conn, self._repl, feed_maxlen=feed_maxlen,
                              feed_total=feed_total, feed_inline=feed_inline,
                              tombstone_grace=tombstone_grace)
        self._reads = RecordReads(self._conn)
        self._feeds = FeedReader(self._conn)
        self._keyindex = ClusterKeyIndex(self._conn)
        self._hostkeys = HostRecords(self._conn, self._repl)
        self._meta = ClusterMeta(self._conn)

    groups = _via("_conn", "groups")  # the group layout (cluster.groups)
    rc = _via("_conn", "rc")  # redis-py's RedisCluster
    wire = _via("_conn", "wire")  # commands and bytes to and from Redis (kvcomm metrics)
    timeout = _via("_conn", "timeout")  # cluster.timeout, seconds
    # masters taken for down, and those let out of it so far (Connection.down, .ups)
    down = _via("_conn", "down")
    ups = _via("_conn", "ups")
    max_value_size = _via("_conn", "max_value_size")  # cache.max_value_size: the bound of a record read back

    def decode(self, raw: object, key: str = "") -> L3Record:
        """:func:`read_record` under this store's bound; CorruptRecord names ``key``."""
        return read_record(raw, key, self._conn.max_value_size)

    def group_of(self, key: str) -> int:
        return self._conn.groups.of(key)

    def close(self) -> None:
        """Stop the pinger, close the hint subscriptions, the threads and the connections."""
        self._conn.close()

    def get(self, key: str) -> L3Record | None:
        """The record of ``key``, or None. (See :meth:`RecordReads.get`.)"""
        return self._reads.get(key)

    def get_many(self, keys: Iterable[str]) -> dict[str, L3Record | None | CorruptRecord]:
        """The records of ``keys`` (None: absent; a CorruptRecord for a foreign value): one
        pipeline of GETs per master. (See :meth:`RecordReads.get_many`.)"""
        return self._reads.get_many(keys)

    def master_of(self, key: str) -> str:
        """The name of the master serving ``key`` by the client's slot map (no round trip).
        Raises what the slot map raises when the key's slot is not covered."""
        name = _wire_key(self._conn.groups.record_key(key))
        return self._conn.rc.get_node_from_key(name).name  # type: ignore[no-untyped-call,no-any-return]

    def get_each(self, keys: Iterable[str]) -> dict[str, L3Record | None | KVCommError]:
        """The records of ``keys``, each key with its own answer or error, the masters
        read at the same time. (See :meth:`RecordReads.get_each`.)"""
        return self._reads.get_each(keys)

    def push(self, key: str, record: L3Record, keep_siblings: bool = False) -> PushResult:
        """Push one record into L3: the L3 rule, applied atomically (``keep_siblings``:
        a concurrent record comes back as ``conflict`` instead of being merged
        last-writer-wins); as :meth:`push_many`. Raises Unavailable, CorruptRecord (the
        stored value is foreign, or the key cannot be sent); nothing is stored then."""
        out = self.push_many([(key, record)], {key} if keep_siblings else frozenset())[0]
        if isinstance(out, (CorruptRecord, Unreached)):
            raise out
        return out

    def push_many(self, items: Sequence[tuple[str, L3Record]],
                  keep_siblings: Set[str] = frozenset(),
                  ) -> list[PushResult | CorruptRecord | Unreached]:
        """Push many records: one pipeline of script calls per master, an answer per item, in
        order. (See :meth:`L3Pushes.push_many`.)"""
        return self._pushes.push_many(items, keep_siblings)

    def check_groups(self, record: bool = False) -> int:
        """Check ``cluster.groups`` against the count L3 was initialised with. (See
        :meth:`ClusterMeta.check_groups`.)"""
        return self._meta.check_groups(record)

    def load_write_mark(self, host: str) -> int:
        """The mark :meth:`save_write_mark` saved; 0 when there is none or it is not ours. (See
        :meth:`HostRecords.load_write_mark`.)"""
        return self._hostkeys.load_write_mark(host)

    def save_write_mark(self, host: str, mark: int) -> None:
        """Record that ``host``'s daemons push no dot with a counter past ``mark``
        (``kvn:{host}:wseq``), as durable as a push. (See :meth:`HostRecords.save_write_mark`.)"""
        return self._hostkeys.save_write_mark(host, mark)


class AgentL3(_L3Base):
    """L3 as an agent (the client library) uses it: records read, conditional writes,
    prefix scans, the write mark, the cluster's strong keys (and :class:`_L3Base`'s)."""

    @classmethod
    def from_config(cls, cluster: Any, *, max_value_size: int = MAX_VALUE_SIZE) -> AgentL3:
        """The store an agent of a host with this ``cluster`` config uses: a call fails
        within about 2 x ``cluster.timeout`` (no redis-py retries, a bounded slot-map
        refresh). Raises Unavailable, ConfigError."""
        return cls(**_settings(cluster, max_value_size, daemon=False, agent=True))

    def push_if(self, key: str, record: L3Record, absent: bool, check: Vector,
                basis: Vector, wait_replicas: int = 0, wait_ms: int = 100) -> CasResult:
        """Push ``record`` if L3's record of ``key`` meets the expectation, in one atomic call
        on the key's master (CAS_LUA). (See :meth:`L3Pushes.push_if`.)"""
        return self._pushes.push_if(key, record, absent, check, basis, wait_replicas, wait_ms)

    def index_range(self, prefix: str, after: str, limit: int,
                    groups: Iterable[int] | None = None) -> tuple[list[str], str | None]:
        """Indexed keys under ``prefix`` after ``after``, in key order, from every group (or
        ``groups``). (See :meth:`ClusterKeyIndex.index_range`.)"""
        return self._keyindex.index_range(prefix, after, limit, groups)

    def strong_config(self) -> tuple[list[str], str] | None:
        """The cluster's strong prefixes and ``cache.l3_consistency`` as L3's copy of etcd's
        records them (:meth:`record_strong_config`), or None when none is recorded (no
        daemon with ``cluster.etcd`` has started since KVCOMM copied it). (See
        :meth:`ClusterMeta.strong_config`.)"""
        return self._meta.strong_config()


class DaemonL3(_L3Base):
    """L3 as a host's node daemon uses it: pushes and their replication, feed reads and
    hints, the host's own keys, the key index's upkeep, the masters taken for down (and
    :class:`_L3Base`'s)."""

    @classmethod
    def from_config(cls, cluster: Any, *, max_value_size: int = MAX_VALUE_SIZE) -> DaemonL3:
        """The store a host's node daemon uses: with the feed bound and WAIT settings of
        its ``cluster`` config. Raises Unavailable, ConfigError."""
        return cls(**_settings(cluster, max_value_size, daemon=True, agent=False))

    def set_own(self, name: str, data: bytes, ttl: int | None = None) -> None:
        """Set ``name``, a key of KVCOMM's own (``kvn:``: a host's placement snapshot or
        metrics address), to ``data`` (expiring in ``ttl`` seconds, if given) on its
        master. Raises Unavailable; Unreached at once when its master is down. (See
        :meth:`Connection.own_key`.)"""
        conn, expiry = self._conn, ("EX", ttl) if ttl is not None else ()
        conn.own_key(name, lambda key, node: conn.on(node, "SET", key, data, *expiry))

    refresh_every = _via("_conn", "refresh_every")  # seconds between slot-map refreshes after a failure
    # what the replicas took (Replication)
    confirmed = _via("_repl", "confirmed")
    histories = _via("_repl", "histories")
    unserved = _via("_repl", "unserved")
    degraded = _via("_repl", "degraded")
    connected = _via("_repl", "connected")
    redirects = _via("_pushes", "redirects")  # pushes retried: moved, ask, tryagain
    feed_inline = _via("_pushes", "feed_inline")  # cluster.feed_inline (None: every entry inline)

    def reachable(self) -> bool:
        """Whether one master of the slot map answers a PING within the timeout (the masters in
        turn). (See :meth:`Connection.reachable`.)"""
        return self._conn.reachable()

    def live_master_answers(self) -> bool:
        """Whether a master not taken for :attr:`down` answers a PING within the timeout. (See
        :meth:`Connection.live_master_answers`.)"""
        return self._conn.live_master_answers()

    def confirm_replicated(self, group: int, node_name: str = "") -> bool:
        """With ``wait_replicas``: a probe write and WAIT on the master that took the records
        to confirm; whether it confirmed them. (See :meth:`Replication.confirm_replicated`.)"""
        return self._repl.confirm_replicated(group, node_name)

    # ------------------------------------------------------------------ the change feed

    def feed_many(self, cursors: Mapping[int, bytes], count: int = 500,
                  verify: Set[int] = frozenset(), checked: dict[int, bool] | None = None,
                  ) -> dict[int, list[FeedEntry] | CorruptRecord]:
        """:meth:`feed` for many groups. (See :meth:`FeedReader.feed_many`.)"""
        return self._feeds.feed_many(cursors, count, verify, checked)

    def feed_seqs(self, groups: Iterable[int]) -> dict[int, int | None]:
        """Each group's sequence number now (0: no change yet; None: a foreign value).
        :meth:`feed_heads` without the tails. Raises Unavailable."""
        return {g: seq for g, (seq, _) in self.feed_heads(groups, tails=False).items()}

    def feed_heads(self, groups: Iterable[int], tails: bool = True,
                   ) -> dict[int, tuple[int | None, bytes | None]]:
        """Each group's (sequence number, tail) now. (See :meth:`FeedReader.feed_heads`.)"""
        return self._feeds.feed_heads(groups, tails)

    def down_groups(self, groups: Iterable[int]) -> set[int]:
        """The groups of ``groups`` whose master is taken for :attr:`down` (by the slot map).
        (See :meth:`FeedReader.down_groups`.)"""
        return self._feeds.down_groups(groups)

    def feed_position(self, group: int) -> tuple[int | None, bytes]:
        """(sequence number, id of the last entry kept or ``0-0``) of one group, read
        atomically. (See :meth:`FeedReader.feed_position`.)"""
        return self._feeds.feed_position(group)

    def hints(self) -> tuple[set[int], set[int]]:
        """(groups hinted since the last call, groups whose hints may have been lost since the
        last call). (See :meth:`FeedReader.hints`.)"""
        return self._feeds.hints()

    def hint_entries(self) -> list[tuple[int, FeedEntry]]:
        """The value-less feed entries that hints carried since the last call, (group, entry),
        in the order they arrived. (See :meth:`FeedReader.hint_entries`.)"""
        return self._feeds.hint_entries()

    @property
    def hint_stats(self) -> dict[str, int]:
        """Counts of the hint subscriptions: hints, breaks, moved, subscribed."""
        return self._feeds.hint_stats

    # ------------------------------------------------------------------ the key index

    def expire_index(self, now: float, groups: Iterable[int] | None = None,
                     limit: int = 256, skipped: set[int] | None = None) -> int:
        """Drop the keys past their deadline at ``now`` from the key index of ``groups`` (None:
        every group); how many were dropped. (See :meth:`ClusterKeyIndex.expire_index`.)"""
        return self._keyindex.expire_index(now, groups, limit, skipped)

    def index_ready(self) -> bool:
        """Whether the key index covers data written before it existed (``kvm:index`` set by
        :meth:`backfill_index`). (See :meth:`ClusterKeyIndex.index_ready`.)"""
        return self._keyindex.index_ready()

    def backfill_index(self, batch: int = 500) -> int:
        """Index every record L3 holds (once, after an upgrade); the keys looked at. (See
        :meth:`ClusterKeyIndex.backfill_index`.)"""
        return self._keyindex.backfill_index(batch)

    def scan_keys(self, skipped: set[int] | None = None) -> Iterator[bytes]:
        """Every KVCOMM key L3 holds, from every master (a SCAN: for rebuilds, not hot paths).
        (See :meth:`ClusterKeyIndex.scan_keys`.)"""
        return self._keyindex.scan_keys(skipped)

    def scan_group(self, group: int) -> Iterator[bytes]:
        """Every KVCOMM key of one group (the keys of its slot with its record prefix). (See
        :meth:`ClusterKeyIndex.scan_group`.)"""
        return self._keyindex.scan_group(group)

    def record_strong_config(self, prefixes: Sequence[str], default: str) -> None:
        """Record which keys the cluster keeps strong (``cache.strong_prefixes`` and
        ``cache.l3_consistency``) in L3's :data:`META_STRONG`, replacing what is there. (See
        :meth:`ClusterMeta.record_strong_config`.)"""
        return self._meta.record_strong_config(prefixes, default)

    # ------------------------------------------------------------------ a host's own keys

    def load_cursors(self, host: str) -> tuple[dict[int, bytes], dict[int, int]]:
        """The feed cursors and last sequence numbers this host saved, by group. (See
        :meth:`HostRecords.load_cursors`.)"""
        return self._hostkeys.load_cursors(host)

    def save_cursors(self, host: str, cursors: dict[int, bytes],
                     seqs: dict[int, int] | None = None) -> None:
        """Save this host's feed cursors and last sequence numbers, by group. (See
        :meth:`HostRecords.save_cursors`.)"""
        return self._hostkeys.save_cursors(host, cursors, seqs)

    def load_hot(self, host: str) -> list[str]:
        """The hot-key list :meth:`save_hot` saved; [] when there is none or it is not ours.
        (See :meth:`HostRecords.load_hot`.)"""
        return self._hostkeys.load_hot(host)

    def save_hot(self, host: str, keys: list[str]) -> None:
        """This host's hot-key list, for the next daemon run to prewarm L2 with. (See
        :meth:`HostRecords.save_hot`.)"""
        return self._hostkeys.save_hot(host, keys)

    def save_load(self, host: str, ops: Mapping[int, int]) -> None:
        """Record ``host``'s cumulative operation counts of these groups (a hash
        ``kvn:{host}:load``). (See :meth:`HostRecords.save_load`.)"""
        return self._hostkeys.save_load(host, ops)

    def quarantine(self, host: str, key: str, reason: str, when: float,
                   keep: int = QUARANTINE_MAX) -> None:
        """Set an input aside on the host's capped list ``kvn:{host}:quarantine``. (See
        :meth:`HostRecords.quarantine`.)"""
        return self._hostkeys.quarantine(host, key, reason, when, keep)


class L3Store(AgentL3, DaemonL3):
    """Every face of L3 in one (:class:`AgentL3` and :class:`DaemonL3`), with what tools
    use besides (every key, retired hosts, load counts) and the parts' internals under
    the names tests and tools have used."""

    @classmethod
    def from_config(cls, cluster: Any, *, max_value_size: int = MAX_VALUE_SIZE,
                    daemon: bool = False, agent: bool = False) -> L3Store:
        """The store a host's ``cluster`` config describes: its seeds and every node
        routed through ``cluster.address_remap``, credentials, TLS files, timeout (and,
        for the node daemon, the feed bound and WAIT settings; for an agent, calls that
        fail within about 2 x ``cluster.timeout``: no redis-py retries, a bounded
        slot-map refresh). Raises Unavailable, ConfigError."""
        return cls(**_settings(cluster, max_value_size, daemon, agent))

    auth = _via("_conn", "auth")  # (username, password): for MIGRATE's AUTH (kvcomm.balance.migrate)
    feed_maxlen = _via("_pushes", "feed_maxlen")
    tombstone_grace_ms = _via("_pushes", "tombstone_grace_ms")
    wait_replicas = _via("_repl", "wait_replicas")
    wait_ms = _via("_repl", "wait_ms")
    _script = _via("_pushes", "_script")  # the push script (a test may replace it)
    _cas = _via("_pushes", "_cas")
    _hints = _via("_feeds", "_hints")

    def feed(self, group: int, after: bytes = b"0-0", count: int = 1000) -> list[FeedEntry]:
        """Change-feed entries of one group after stream id ``after``. (See
        :meth:`FeedReader.feed`.)"""
        return self._feeds.feed(group, after, count)

    def feed_bounds(self, group: int) -> tuple[bytes | None, bytes]:
        """(first id still kept, or None when trimmed empty; last id ever added). (See
        :meth:`FeedReader.feed_bounds`.)"""
        return self._feeds.feed_bounds(group)

    def slot_keys(self, slot: int) -> list[bytes]:
        """Every key Redis holds in ``slot`` (on the master serving it: CLUSTER GETKEYSINSLOT).
        (See :meth:`ClusterKeyIndex.slot_keys`.)"""
        return self._keyindex.slot_keys(slot)

    def forget_host(self, host: str) -> int:
        """Delete a retired host's keys of KVCOMM's own (feed cursors, hot keys, quarantine
        list). (See :meth:`HostRecords.forget_host`.)"""
        return self._hostkeys.forget_host(host)

    def hosts(self) -> list[str]:
        """The hosts whose daemons left state in L3 (their ``kvn:{host}:cursors``), by a SCAN
        of every master. (See :meth:`HostRecords.hosts`.)"""
        return self._hostkeys.hosts()

    def load_counts(self, host: str) -> dict[int, int]:
        """What :meth:`save_load` recorded for ``host`` ({} when nothing, or not ours). (See
        :meth:`HostRecords.load_counts`.)"""
        return self._hostkeys.load_counts(host)

    def quarantined(self, host: str) -> list[tuple[str, str, float]]:
        """What :meth:`quarantine` set aside for ``host``, newest first. (See
        :meth:`HostRecords.quarantined`.)"""
        return self._hostkeys.quarantined(host)

    # ------------------------------------------------------------------ internals

    def _call(self, fn: Any, key: str | None = None, node: Any = None) -> Any:
        """Run one Redis call. (See :meth:`Connection.call`.)"""
        return self._conn.call(fn, key, node)

    def _on(self, node: Any, *args: Any) -> Any:
        """One command for master ``node`` through the cluster client (a MOVED followed),
        without redis-py's retries. (See :meth:`Connection.on`.)"""
        return self._conn.on(node, *args)

    def _own_key(self, name: str, write: Any) -> None:
        """``write(name, node)`` to a key of KVCOMM's own (``kvn:``) on its master ``node``
        (with :meth:`Connection.on`). (See :meth:`Connection.own_key`.)"""
        return self._conn.own_key(name, write)

    def _master_up(self, name: str | bytes, what: str) -> Any:
        """The master serving key ``name`` (the client's slot map). (See
        :meth:`Connection.master_up`.)"""
        return self._conn.master_up(name, what)

    def _get_meta(self, name: str) -> Any:
        """GET ``name`` (a key of KVCOMM's own) on its master, without redis-py's retries. (See
        :meth:`Connection.get_own`.)"""
        return self._conn.get_own(name)

    def _by_node(self, groups: Iterable[int]) -> dict[str, tuple[Any, list[int]]]:
        """``groups`` by the master serving their slot now (the client's slot map). (See
        :meth:`Connection.by_node`.)"""
        return self._conn.by_node(groups)

    def _refresh_topology(self, force: bool = False) -> None:
        """Re-read the slot map (at most twice a second unless ``force``). (See
        :meth:`Connection.refresh_topology`.)"""
        return self._conn.refresh_topology(force)

    def _args(self, key: str, record: L3Record, keep_siblings: bool, hint: bool = True,
              speak: bool | None = None) -> tuple[list[bytes | str], list[Any]]:
        """The push script's keys and arguments for one record alone (its reply is a list of
        one reply). (See :meth:`L3Pushes.args`.)"""
        return self._pushes.args(key, record, keep_siblings, hint, speak)
