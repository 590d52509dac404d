"""The node daemon's ports: the narrow interfaces through which it reaches the world.

The daemon never touches the client's, the segment's or the Redis client's internals;
it goes through three ports, each implemented by the real thing and, in tests of the
delivery logic (``tests/sim/test_delivery_sim.py``), by fakes in memory:

* :class:`HostL2` — its host's L2, implemented by :class:`ClientPort` over a
  :class:`kvcomm.Client`;
* :class:`HostKeys` — the host's filter of existing keys,
  :class:`kvcomm.tiers.keyfilter.KeyFilter`;
* :class:`L3Port` — the cluster, :class:`kvcomm.tiers.l3.DaemonL3`.

What the daemon needs of L2, and nothing more:

* the local change feed (``feed_read``) and, when it overflowed, every key whose record
  is not yet in L3 (``dirty_keys``);
* a key's dirty record as an L3 record — a put or a delete's tombstone — or None when it
  is clean or gone (``dirty_record``), and acknowledging delivery (``mark_delivered``:
  the record may now be evicted);
* whether the host holds a key (``holds``; a tombstone counts: it keeps the host told of
  later writes) and which keys it holds (``held_keys``);
* merging a record from L3 into L2 (``apply_remote``), with the host's resolvers, and
  dropping a stale copy L2 cannot replace (``forget``);
* the host's write sequence, and writing a record again past dots of this host that L3
  has seen and L2 lost (``write_sequence``, ``rebase``), every unacknowledged write at
  once past the highest dot an earlier life may have pushed (``past_lost_dots``);
* the hot keys, the heartbeat, the feed position the daemon has delivered up to.

Of L3: pushing records (the L3 rule, atomically per key), the groups' change feeds,
counters, positions and hints, reading and scanning keys, and the daemon's own small
state there (feed cursors, hot keys, per-group load, the quarantine list, the write
mark: how far the host's pushed dots may go).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from typing import TYPE_CHECKING, Any, Protocol

from .._client.merge import RemoteMerges
from ..core.versions import Vector, Version
from ..tiers.l2 import TAG_TOMBSTONE, FeedEvent, key_hash

if TYPE_CHECKING:
    from .._client import Client
    from ..errors import CorruptRecord
    from ..metrics.wire import WireCounts
    from ..tiers.l3 import FeedEntry, L3Record, PushResult, Unreached


class HostL2(Protocol):
    """What the node daemon needs of its host's L2."""

    host_id: str
    namespace: str

    def feed_read(self, cursor: int) -> tuple[list[FeedEvent], int, bool]:
        """Events after ``cursor``: (events, new cursor, overflowed)."""

    def dirty_keys(self) -> list[str]:
        """Every key whose record (a put or a tombstone) is not yet in L3."""

    def dirty_record(self, key: str) -> L3Record | None:
        """The key's record as an L3 record if it is dirty, else None."""

    def held_record(self, key: str) -> L3Record | None:
        """The key's clean record (one L3 acknowledged) as an L3 record, if its vector has
        an entry of this host (its dot: the record is this host's write or descends from
        one); else None (absent, dirty — the normal push path sends it — or never written
        here). For a re-push of what L3 lost (``Puller._resync_key``, node/pull.py)."""

    def dirty_count(self) -> int:
        """Writes of the host not yet in L3 (dirty records, tombstones included)."""

    def mark_delivered(self, key: str, record: L3Record) -> bool:
        """L3 has ``record``: clear the dirty flag if the key still holds that write."""

    def holds(self, key: str) -> bool:
        """The host's L2 has a record of ``key`` (a tombstone included)."""

    def held_vector(self, key: str) -> Vector | None:
        """The version vector of the host's record of ``key`` (a tombstone included), or
        None when L2 does not hold it. Reading it is not an agent's read."""

    def held_keys(self, tombstones: bool = False) -> list[str]:
        """Every key the host's L2 holds (tombstones excluded unless ``tombstones``)."""

    def apply_remote(self, key: str, record: L3Record) -> None:
        """Merge a record from L3 into L2 (newer replaces, older is kept, concurrent is
        resolved). Raises CorruptRecord (the value does not decode), ValueTooLarge or
        another KVCommError (L2 cannot take it)."""

    def has_resolver(self, key: str) -> bool:
        """A resolver is registered for ``key``'s prefix (its conflicts are settled here)."""

    def write_sequence(self) -> int:
        """The counter of the host's newest dot."""

    def forget(self, key: str) -> bool:
        """Drop the host's clean copy of ``key`` (a local eviction: its reads go to L3)."""

    def quiet(self) -> None:
        """From now on, the calling thread's reads and writes of L2 are no agent's reads
        (see :meth:`take_reads`)."""

    def take_reads(self, keys: Sequence[str]) -> dict[str, int]:
        """For each key: -1 when L2 does not hold it, else whether an agent read or wrote
        it (1) or not (0) since the last take_reads of it, which this one clears, or since
        the daemon last wrote it (the quiet thread's reads and writes do not count)."""

    def rebase(self, key: str, record: L3Record) -> bool:
        """L3's ``record`` covers this host's dot with one of its own older ones: the
        host's write sequence restarted (its L2 was lost). Raise the sequence past the
        record's entry for this host and write the local record again as a new write
        descending from both (still dirty: the daemon pushes it). False: nothing to do."""

    def past_lost_dots(self, lost: int) -> int:
        """Dots of this host up to ``lost`` may be in L3 from an earlier life of its L2:
        raise the write sequence past ``lost`` and give every dirty record with a dot at
        most ``lost`` a new dot past it (value and HLC kept). Returns how many moved."""

    def hot_keys(self, n: int) -> list[str]:
        """The host's ``n`` most read keys."""

    def heartbeat(self) -> None:
        """Tell agents and tools that the daemon is alive."""

    def delivered_up_to(self, cursor: int) -> None:
        """Everything in the feed before ``cursor`` is in L3."""

    @property
    def delivered_cursor(self) -> int:
        """The feed position delivered up to (where a restarted daemon starts)."""


class HostKeys(Protocol):
    """What the node daemon needs of its host's filter of existing keys."""

    @property
    def adds_since_rotation(self) -> int:
        """Keys added since the last rotation."""

    def add(self, key: bytes) -> None:
        """``key`` exists (in L3)."""

    def beat(self) -> None:
        """Tell agents the filter's daemon is alive (they trust the filter only then)."""

    def set_ready(self, ready: bool) -> None:
        """Whether agents may trust the filter (built, not retired)."""

    def begin_rotation(self) -> Any:
        """Start a rotation; returns the generation to refill (it has ``add``)."""

    def end_rotation(self) -> None:
        """The refilled generation becomes the current one."""

    def close(self) -> None: ...


class L3Port(Protocol):
    """What the node daemon needs of the cluster. Every method raises Unavailable when
    the cluster cannot be reached (nothing changed, or the change is idempotent).

    The failure detector's state is read as it is: :attr:`down` (master → when it
    stopped answering: a call timed out or was refused, no PING answered since; its
    keys' calls are skipped, answered Unreached) and :attr:`ups` (masters let out of it
    so far). So is replication confirmation's: :attr:`confirmed`, :attr:`histories`,
    :attr:`unserved` (see :meth:`confirm_replicated`)."""

    down: dict[str, float]
    ups: int
    # a push's feed entry carries the record up to this size (None: always); larger
    # ones are value-less (their readers fetch the record)
    feed_inline: int | None
    # master → (the latest probe there that cluster.wait_replicas replicas acknowledged,
    # the replication history the master ran after that WAIT)
    confirmed: dict[str, tuple[int, str]]
    # node → its replication history when last seen ("" while not a master)
    histories: dict[str, str]
    # (node, group) pairs whose probe the node refused (the group's slot moved off it)
    # since the daemon last took them (it clears the set)
    unserved: set[tuple[str, int]]
    wire: WireCounts  # commands and bytes to and from Redis
    # seconds between slot-map refreshes after a failed call (the daemon spaces them out
    # in partition mode)
    refresh_every: float

    @property
    def hint_stats(self) -> dict[str, int]:
        """Counts of the hint subscriptions (``bytes``: the hint messages received)."""

    def reachable(self) -> bool:
        """Whether one master answers a PING within the timeout (no retry, no slot-map
        refresh: a host cut off learns it in one timeout). Never raises."""

    def live_master_answers(self) -> bool:
        """Whether a master not taken for :attr:`down` answers a PING within the timeout
        (False when every master is down or none answers). Never raises."""

    def down_groups(self, groups: Iterable[int]) -> set[int]:
        """The groups of ``groups`` whose master is taken for :attr:`down`. Raises
        Unavailable (no slot map)."""

    def confirm_replicated(self, group: int, node_name: str = "") -> bool:
        """With cluster.wait_replicas: a probe write and WAIT on node ``node_name`` (the
        master that took the records to confirm; ``group``'s master when empty), noting
        in :attr:`confirmed` what the replicas acknowledged and in :attr:`histories`
        the master's replication history (a node that refuses the probe: into
        :attr:`unserved`). Returns whether it was confirmed. Raises Unavailable."""

    def push_many(self, items: Sequence[tuple[str, L3Record]],
                  keep_siblings: Set[str] = frozenset(),
                  ) -> list[PushResult | CorruptRecord | Unreached]:
        """Push records by the L3 rule, atomically per key; the keys of ``keep_siblings``
        get ``conflict`` for a concurrent record instead of a merge. One answer per item,
        in order: CorruptRecord for a key whose stored value is not a record of ours,
        Unreached for one whose master is down (not sent: send it again later)."""

    def feed_many(self, cursors: Mapping[int, bytes], count: int = 500,
                  verify: Set[int] = frozenset(), checked: dict[int, bool] | None = None,
                  ) -> dict[int, list[FeedEntry] | CorruptRecord]:
        """Each group's change-feed entries after its cursor (at most ``count``), or a
        CorruptRecord for a group whose stream is not ours. For each group of ``verify``
        whose cursor could be checked, ``checked`` gets whether its stream lost the
        cursor's entry while keeping an older one."""

    def feed_seqs(self, groups: Iterable[int]) -> dict[int, int | None]:
        """Each group's sequence number now (0: no change yet; None: not a number)."""

    def feed_heads(self, groups: Iterable[int], tails: bool = True,
                   ) -> dict[int, tuple[int | None, bytes | None]]:
        """Each group's (sequence number, id of its stream's last entry) now, read
        together: :meth:`feed_seqs` with each stream's tail (None: not asked for, no
        entry, or not known)."""

    def feed_position(self, group: int) -> tuple[int | None, bytes]:
        """(sequence number, id of the last entry kept or ``0-0``), read atomically.
        Raises CorruptRecord when the group's stream is not ours."""

    def hints(self) -> tuple[set[int], set[int]]:
        """(groups hinted since the last call, groups whose hints may have been lost
        since then); the first call subscribes. Never blocks, never raises."""

    def hint_entries(self) -> list[tuple[int, FeedEntry]]:
        """The value-less feed entries that hints carried, (group, entry), in the order
        they arrived, since the last call (collected by :meth:`hints`). Never raises."""

    def get(self, key: str) -> L3Record | None:
        """The key's record, or None. Raises CorruptRecord."""

    def get_many(self, keys: Iterable[str]) -> dict[str, L3Record | None | CorruptRecord]:
        """Each key's record, or None, or a CorruptRecord for a key whose value is not a
        record of ours; read in one batch."""

    def scan_keys(self, skipped: set[int] | None = None) -> Iterable[bytes]:
        """Every key L3 holds. With ``skipped``: the masters that do not answer are
        left out, and the groups they serve added to ``skipped``."""

    def scan_group(self, group: int) -> Iterable[bytes]:
        """Every key of one group."""

    def load_cursors(self, host: str) -> tuple[dict[int, bytes], dict[int, int]]:
        """The feed cursors and sequence numbers ``host`` saved ({} for a new host)."""

    def save_cursors(self, host: str, cursors: dict[int, bytes],
                     seqs: dict[int, int] | None = None) -> None: ...

    def load_hot(self, host: str) -> list[str]:
        """The hot keys ``host`` saved ([] when none, or not ours)."""

    def save_hot(self, host: str, keys: list[str]) -> None: ...

    def save_load(self, host: str, ops: Mapping[int, int]) -> None:
        """Record ``host``'s cumulative operation count of these groups."""

    def save_write_mark(self, host: str, mark: int) -> None:
        """Record that ``host`` pushes no dot past ``mark`` until it records a higher one."""

    def load_write_mark(self, host: str) -> int:
        """The mark ``host`` saved (0: none)."""

    def quarantine(self, host: str, key: str, reason: str, when: float) -> None:
        """Record an input the daemon set aside."""

    def close(self) -> None: ...


class ClientPort:
    """:class:`HostL2` over a client of the host's namespace (the daemon's own)."""

    def __init__(self, kv: Client) -> None:
        self.kv = kv
        self.merges = RemoteMerges(kv)  # the client's face for the daemon
        self.seg = self.merges.segment
        self.host_id = self.seg.host_id
        self.namespace = kv.name

    def feed_read(self, cursor: int) -> tuple[list[FeedEvent], int, bool]:
        return self.seg.feed_read(cursor)

    def dirty_keys(self) -> list[str]:
        return [kb.decode("utf-8", "surrogateescape") for kb in self.seg.dirty_keys()]

    def dirty_count(self) -> int:
        """Writes of the host not yet in L3."""
        return self.seg.dirty_count

    def dirty_record(self, key: str) -> L3Record | None:
        return self._record(key, dirty=True)

    def held_record(self, key: str) -> L3Record | None:
        return self._record(key, dirty=False)

    def _record(self, key: str, dirty: bool) -> L3Record | None:
        from ..tiers.l3 import EMPTY_EXT, L3Record

        kb = key.encode("utf-8", "surrogateescape")
        h = key_hash(kb)
        for _ in range(100):
            rec = self.seg.read(kb, h)
            if rec is None or self.seg.is_dirty(rec.word) != dirty:
                return None  # evicted (clean), or not an agent's write (already in L3);
                # (held_record: a dirty one is the normal push path's)
            if not dirty and rec.counter == 0:
                return None  # no entry of this host: no dot of its own to push it under
            ver = self.seg.version(kb, h)  # the extension field, of the same write
            if ver is not None and (ver[3], ver[4]) == (rec.counter, rec.hlc):
                break
        else:  # rewritten under us a hundred times: the next feed event names it again
            return None
        ext = ver[7] or EMPTY_EXT
        vector = self.merges.version_of(rec.counter, rec.hlc, rec.vvx).vector
        dot = (self.host_id, rec.counter)
        if rec.tag == TAG_TOMBSTONE:  # (a deleted counter's carries its state: meta, value)
            return L3Record(rec.hlc, True, 0, rec.meta, rec.value or b"", vector, dot, ext)
        return L3Record(rec.hlc, False, rec.tag, rec.meta, rec.value or b"", vector, dot, ext)

    def mark_delivered(self, key: str, record: L3Record) -> bool:
        kb = key.encode("utf-8", "surrogateescape")
        return self.seg.mark_clean(kb, key_hash(kb), record.dot[1], record.hlc)

    def holds(self, key: str) -> bool:
        kb = key.encode("utf-8", "surrogateescape")
        return self.seg.read(kb, key_hash(kb), 0) is not None

    def held_vector(self, key: str) -> Vector | None:
        kb = key.encode("utf-8", "surrogateescape")
        rec = self.seg.read(kb, key_hash(kb), 0)
        return None if rec is None else self.merges.version_of(rec.counter, rec.hlc, rec.vvx).vector

    def held_keys(self, tombstones: bool = False) -> list[str]:
        return list(self.seg.keys(tombstones))

    def apply_remote(self, key: str, record: L3Record) -> None:
        version = Version(record.vector, record.hlc)
        if record.tombstone:  # kept as a clean tombstone; deletes merge last-writer-wins
            self.merges.apply(key, None, version, (TAG_TOMBSTONE, record.meta, record.value),
                              record.local_ext)
            return
        value = record.decode_value(key)
        self.merges.apply(key, value, version, (record.tag, record.meta, record.value),
                          record.local_ext)

    def has_resolver(self, key: str) -> bool:
        return self.merges.has_resolver(key)

    def write_sequence(self) -> int:
        return self.seg.write_sequence

    def forget(self, key: str) -> bool:
        kb = key.encode("utf-8", "surrogateescape")
        self.merges.forget_cached(key)
        return self.seg.evict(kb, key_hash(kb))

    def quiet(self) -> None:
        self.seg.quiet()

    def take_reads(self, keys: Sequence[str]) -> dict[str, int]:
        pairs = [(kb, key_hash(kb)) for kb in (k.encode("utf-8", "surrogateescape") for k in keys)]
        return dict(zip(keys, self.seg.take_reads(pairs), strict=True))

    def rebase(self, key: str, record: L3Record) -> bool:
        return self.merges.restamp(key, Version(record.vector, record.hlc))

    def past_lost_dots(self, lost: int) -> int:
        return self.merges.past_lost_dots(lost)

    def register_resolver(self, prefix: str, fn: Callable[[str, list[Any]], Any]) -> None:
        self.kv.register_resolver(prefix, fn)

    def hot_keys(self, n: int) -> list[str]:
        return [k for k, _ in self.kv.hot_keys(n)]

    def heartbeat(self) -> None:
        self.seg.daemon_heartbeat(os.getpid())

    def delivered_up_to(self, cursor: int) -> None:
        self.seg.sync_cursor = cursor

    @property
    def delivered_cursor(self) -> int:
        return self.seg.sync_cursor
