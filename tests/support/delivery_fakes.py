"""In-memory fakes of the node daemon's three ports, for tests of the delivery logic
without Redis or shared memory. Deterministic: time and randomness are passed in.

* :class:`FakeL3` — :class:`kvcomm.node.port.L3Port`: records under the pure L3 rule
  (:func:`kvcomm.core.resolve.l3_rule`, which the Lua script is tested to agree with),
  one stream per group with sequence numbers, hints to every subscriber (each daemon
  gets its own :meth:`FakeL3.view`), and the faults the daemon must survive: cut off
  (``cut``), writes not acknowledged by a replica, a failover that loses the
  unreplicated suffix of a group (records reverted, entries and counter rewound, its
  master's replication history changed), a trimmed stream, hints lost silently or
  with notice (``hint_loss_p``); a master taken for down (:meth:`FakeL3.hang`: the
  calls of its groups answer Unreached, as L3Store's failure detector has them,
  until :meth:`FakeL3.answer`); and writes stored on fewer replicas than
  ``cluster.wait_replicas`` asks (``short_p``: held by their pusher until
  :meth:`FakeL3.confirm_replicated` confirms them).
* :class:`FakeL2` — :class:`kvcomm.node.port.HostL2`: one host's records with dirty
  flags, its write counter and HLC, and a bounded change feed (it overflows). Merging a
  remote record follows ``Client._merge_plan``: newer replaces, older is kept,
  concurrent is resolved (a resolver, else last-writer-wins) with the merged vector
  and flagged dirty when the result is news to the cluster.
* :class:`FakeKeys` — :class:`kvcomm.node.port.HostKeys`: a set.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

from kvcomm.core import codec
from kvcomm.core.resolve import CONFLICT, EQUAL, MERGED, NEW, NEWER, OLDER, Sibling, l3_rule, resolve
from kvcomm.core.versions import (
    Dotted,
    Ordering,
    Vector,
    compare_vectors,
    hlc_tick,
    merge_vectors,
    vector_get,
    with_dot,
)
from kvcomm.errors import CorruptRecord, Unavailable
from kvcomm.metrics.wire import WireCounts
from kvcomm.tiers.groups import groups as groups_of
from kvcomm.tiers.l2 import KIND_DELETE, KIND_EVICT, KIND_PUT, FeedEvent
from kvcomm.tiers.l3 import FEED_INLINE, FeedEntry, FeedNote, L3Record, PushResult, Unreached

GROUPS = 16  # the simulated cluster's cluster.groups (every group is one slot)


def group_of(key: str) -> int:
    return groups_of(GROUPS).of(key)

Value = tuple[int, bytes, bytes] | None  # (tag, meta, payload); None: a tombstone


# ---------------------------------------------------------------- L3


@dataclass
class _Op:
    entry_id: bytes
    key: str
    before: L3Record | None
    durable: bool


class FakeL3:
    """The cluster, in memory. ``cut``: every call raises Unavailable (the host is cut
    off from every master: :meth:`reachable` says so too). ``down``, ``ups`` and the
    replication confirmation's state are L3Store's (:class:`kvcomm.node.port.L3Port`):
    group ``g`` is served by master ``masters[g % len(masters)]``."""

    def __init__(self, rng: random.Random, durable_p: float = 1.0,
                 hint_loss_p: float = 0.0, feed_inline: int | None = FEED_INLINE,
                 masters: int = 3, short_p: float = 0.0) -> None:
        self.rng = rng
        self.masters = [f"10.0.0.{i}:7000" for i in range(masters)]
        # a stored push acknowledged by fewer replicas than cluster.wait_replicas asks
        # (yet by one: durable), which a failover before a later confirmation loses
        self.short_p = short_p
        self.feed_inline = feed_inline  # records up to this size ride in their entry (None: all)
        self.durable_p = durable_p
        self.hint_loss_p = hint_loss_p  # a hint lost: half of them silently, half told
        self.subscribers: list[_View] = []
        self.hints_lost = {"silently": 0, "told": 0}
        self.cut = False
        # L3Store's failure detector: master → when it stopped answering (hang)
        self.down: dict[str, float] = {}
        self.ups = 0  # masters let out of down so far (answer)
        # replication confirmation (cluster.wait_replicas): master → (the latest probe
        # its replicas acknowledged, its history then); master → its replication
        # history (a failover starts a new one)
        self.confirmed: dict[str, tuple[int, str]] = {}
        self.histories: dict[str, str] = {m: f"{m}#0" for m in self.masters}
        self.unserved: set[tuple[str, int]] = set()
        self.pipelines = 0  # push pipelines and probes so far (PushResult.call)
        self.wire = WireCounts()  # (no bytes: nothing goes over a wire)
        self.refresh_every = 0.5
        self.records: dict[str, L3Record] = {}
        self.streams: dict[int, list[FeedEntry]] = {g: [] for g in range(GROUPS)}
        self.counters: dict[int, int] = dict.fromkeys(range(GROUPS), 0)
        self.ids: dict[int, int] = dict.fromkeys(range(GROUPS), 0)
        self.log: dict[int, list[_Op]] = {g: [] for g in range(GROUPS)}  # unreplicated suffix
        self.cursors: dict[str, tuple[dict[int, bytes], dict[int, int]]] = {}
        self.hot: dict[str, list[str]] = {}
        self.write_marks: dict[str, int] = {}
        self.quarantined: list[tuple[str, str, str]] = []
        self.calls: dict[str, int] = {}
        self.lost = 0  # records reverted by failovers

    def _call(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.cut:
            raise Unavailable("the fake cluster is cut off")

    def master_of(self, g: int) -> str:
        return self.masters[g % len(self.masters)]

    def _reach(self, g: int) -> None:
        """Raise Unreached at once when group ``g``'s master is taken for down."""
        if self.master_of(g) in self.down:
            raise Unreached(f"the master of group {g} is taken for down")

    def _own(self, host: str) -> None:
        """The host's own keys (``kvn:{host}:...``): Unreached while their master is down."""
        self._reach(group_of(f"kvn:{{{host}}}"))

    def _answered(self, groups: Iterable[int]) -> list[int]:
        """The groups of ``groups`` whose master is not down; Unreached when there were
        some and none is left (no master answered)."""
        gs = list(groups)
        up = [g for g in gs if self.master_of(g) not in self.down]
        if gs and not up:
            raise Unreached("every master asked is taken for down")
        return up

    # --- writes

    def push_many(self, items: Sequence[tuple[str, L3Record]],
                  keep_siblings: Set[str] = frozenset(),
                  ) -> list[PushResult | CorruptRecord | Unreached]:
        self._call("push_many")
        self._answered(group_of(key) for key, _ in items)
        durable = self.rng.random() < self.durable_p
        self.pipelines += 1
        out: list[PushResult | CorruptRecord | Unreached] = []
        touched = set()
        for key, record in items:
            if self.master_of(group_of(key)) in self.down:  # (not sent: pushed again later)
                out.append(Unreached(f"the master of {key!r} is taken for down"))
                continue
            short = durable and self.short_p > 0 and self.rng.random() < self.short_p
            res = self._push(key, record, key in keep_siblings, durable, short)
            out.append(res)
            # (a result that does not say short — nothing stored, or stored in full — is
            # a WAIT the replicas asked acknowledged: everything before it is kept)
            if not res.short:
                touched.add(group_of(key))
        if durable:  # a replica caught up with everything before (WAIT)
            for g in touched:
                self.log[g].clear()
        return out

    def push(self, key: str, record: L3Record, keep_siblings: bool = False) -> PushResult:
        res = self.push_many([(key, record)], {key} if keep_siblings else frozenset())[0]
        if isinstance(res, (CorruptRecord, Unreached)):
            raise res
        return res

    def _push(self, key: str, incoming: L3Record, siblings: bool, durable: bool,
              short: bool = False) -> PushResult:
        stored = self.records.get(key)
        outcome, after = l3_rule(None if stored is None else stored.version, incoming.version,
                                 keep_siblings=siblings)
        if outcome in (NEW, NEWER):
            held = incoming
        elif outcome in (EQUAL, OLDER, CONFLICT):
            assert stored is not None
            held = stored
        else:
            assert outcome == MERGED and stored is not None and after is not None
            winner = incoming if (incoming.dot, incoming.hlc) == (after.dot, after.hlc) else stored
            held = winner._replace(vector=after.vector)
        if held is not stored:
            self._store(key, held, stored, durable and not short, merged=outcome == MERGED)
            if short:  # (stored on fewer replicas than asked: its pusher holds it)
                g, m = group_of(key), self.master_of(group_of(key))
                return PushResult(key, outcome, held, durable, seq=self.counters[g],
                                  entry=self.streams[g][-1].id, short=True, node=m,
                                  call=self.pipelines, history=self.histories[m])
        return PushResult(key, outcome, held, durable)

    def _store(self, key: str, record: L3Record, before: L3Record | None, durable: bool,
               merged: bool = False) -> None:
        g = group_of(key)
        self.counters[g] += 1
        self.ids[g] += 1
        eid = b"%d-0" % self.ids[g]
        raw = record.encode()
        if self.feed_inline is None or len(raw) <= self.feed_inline:  # as the push script
            entry = FeedEntry(eid, key, raw, self.counters[g])
        else:
            note = FeedNote(record.dot[0], record.dot[1], record.tombstone, merged)
            entry = FeedEntry(eid, key, b"", self.counters[g], "", note)
        self.streams[g].append(entry)
        self.records[key] = record
        self.log[g].append(_Op(eid, key, before, durable))
        for view in self.subscribers:
            if self.rng.random() >= self.hint_loss_p:
                if entry.note is not None:  # as the push script: the hint carries it
                    view.entries.append((g, entry))
                else:
                    view.hinted.add(g)
            elif self.rng.random() < 0.5:
                self.hints_lost["silently"] += 1  # (only the sweep can find it)
            else:
                self.hints_lost["told"] += 1  # (a broken subscription: checked at once)
                view.lost.add(g)

    # --- the failure detector

    @property
    def hint_stats(self) -> dict[str, int]:
        return {}

    def reachable(self) -> bool:
        return not self.cut

    def live_master_answers(self) -> bool:
        return not self.cut and len(self.down) < len(self.masters)

    def down_groups(self, groups: Iterable[int]) -> set[int]:
        return {g for g in groups if self.master_of(g) in self.down}

    def confirm_replicated(self, group: int, node_name: str = "") -> bool:
        """A probe and WAIT on ``node_name`` (``group``'s master when empty): with
        probability ``durable_p`` its replicas caught up with everything it took."""
        self._call("confirm_replicated")
        m = node_name or self.master_of(group)
        if m in self.down or self.rng.random() >= self.durable_p:
            return False
        for g in range(GROUPS):
            if self.master_of(g) == m:
                self.log[g].clear()  # (now on a replica: a failover keeps it)
        self.pipelines += 1
        self.confirmed[m] = (self.pipelines, self.histories[m])
        return True

    def view(self) -> _View:
        """The cluster as one daemon sees it: its own hint subscription."""
        return _View(self)

    # --- faults

    def failover(self, g: int) -> int:
        """The group's master dies before replicating its latest writes: the suffix of
        writes no replica acknowledged is lost (records reverted, entries and counter
        rewound). Returns how many were lost."""
        lost = 0
        while self.log[g] and not self.log[g][-1].durable:
            op = self.log[g].pop()
            if op.before is None:
                self.records.pop(op.key, None)
            else:
                self.records[op.key] = op.before
            self.streams[g] = [e for e in self.streams[g] if e.id != op.entry_id]
            self.counters[g] -= 1
            lost += 1
        self.log[g].clear()
        self.lost += lost
        m = self.master_of(g)  # (a replica took over: another replication history)
        self.histories[m] = f"{m}#{self.pipelines}-{g}"
        return lost

    def hang(self, master: str, now: float = 0.0) -> None:
        """``master`` stops answering: taken for down (its groups' calls: Unreached)."""
        self.down.setdefault(master, now)

    def answer(self, master: str) -> None:
        """``master`` answers a PING again: let out of down (``ups``)."""
        if self.down.pop(master, None) is not None:
            self.ups += 1

    def trim(self, g: int, keep: int) -> None:
        """XTRIM: keep only the newest ``keep`` entries of the group's stream."""
        self.streams[g] = self.streams[g][len(self.streams[g]) - keep:] if keep else []

    # --- reads

    def feed_many(self, cursors: Mapping[int, bytes], count: int = 500,
                  verify: Set[int] = frozenset(), checked: dict[int, bool] | None = None,
                  ) -> dict[int, list[FeedEntry] | CorruptRecord]:
        self._call("feed_many")
        up = set(self._answered(cursors))  # (a group of a master down is left out)
        out: dict[int, list[FeedEntry] | CorruptRecord] = {}
        for g, cursor in cursors.items():
            if g not in up:
                continue
            after = _id_num(cursor)
            if g in verify and checked is not None:
                at = [e.id for e in self.streams[g] if _id_num(e.id) <= after]
                checked[g] = bool(at) and at[-1] != cursor  # (lost; an older one kept)
            out[g] = [e for e in self.streams[g] if _id_num(e.id) > after][:count]
        return out

    def feed_seqs(self, groups: Iterable[int]) -> dict[int, int | None]:
        self._call("feed_seqs")
        return {g: self.counters[g] for g in self._answered(groups)}

    def feed_heads(self, groups: Iterable[int], tails: bool = True,
                   ) -> dict[int, tuple[int | None, bytes | None]]:
        self._call("feed_heads")
        return {g: (self.counters[g],
                    self.streams[g][-1].id if tails and self.streams[g] else None)
                for g in self._answered(groups)}

    def feed_position(self, group: int) -> tuple[int | None, bytes]:
        self._call("feed_position")
        self._reach(group)
        stream = self.streams[group]
        return self.counters[group], (stream[-1].id if stream else b"0-0")

    def get(self, key: str) -> L3Record | None:
        self._call("get")
        self._reach(group_of(key))
        return self.records.get(key)

    def get_many(self, keys: Iterable[str]) -> dict[str, L3Record | None | CorruptRecord]:
        self._call("get_many")
        keys = list(keys)
        for key in keys:  # (nothing read when one key's master is down)
            self._reach(group_of(key))
        return {key: self.records.get(key) for key in keys}

    def scan_keys(self, skipped: set[int] | None = None) -> Iterable[bytes]:
        self._call("scan_keys")
        down = {g for g in range(GROUPS) if self.master_of(g) in self.down}
        if down and skipped is None:
            raise Unreached("a master is taken for down")
        if skipped is not None:
            skipped.update(down)
        return [k.encode() for k in self.records if group_of(k) not in down]

    def scan_group(self, group: int) -> Iterable[bytes]:
        self._call("scan_group")
        self._reach(group)
        return [k.encode() for k in self.records if group_of(k) == group]

    # --- the daemon's own state

    def load_cursors(self, host: str) -> tuple[dict[int, bytes], dict[int, int]]:
        self._call("load_cursors")
        self._own(host)
        cursors, seqs = self.cursors.get(host, ({}, {}))
        return dict(cursors), dict(seqs)

    def save_cursors(self, host: str, cursors: dict[int, bytes],
                     seqs: dict[int, int] | None = None) -> None:
        self._call("save_cursors")
        self._own(host)
        old_c, old_s = self.cursors.get(host, ({}, {}))
        self.cursors[host] = ({**old_c, **cursors}, {**old_s, **(seqs or {})})  # (HSET)

    def save_write_mark(self, host: str, mark: int) -> None:
        self._call("save_write_mark")
        self._own(host)
        self.write_marks[host] = mark

    def load_write_mark(self, host: str) -> int:
        self._call("load_write_mark")
        self._own(host)
        return self.write_marks.get(host, 0)

    def save_load(self, host: str, ops: Mapping[int, int]) -> None:
        self._call("save_load")
        self._own(host)

    def hints(self) -> tuple[set[int], set[int]]:
        return set(), set()

    def hint_entries(self) -> list[tuple[int, FeedEntry]]:
        return []

    def load_hot(self, host: str) -> list[str]:
        self._call("load_hot")
        self._own(host)
        return list(self.hot.get(host, []))

    def save_hot(self, host: str, keys: list[str]) -> None:
        self._call("save_hot")
        self._own(host)
        self.hot[host] = list(keys)

    def quarantine(self, host: str, key: str, reason: str, when: float) -> None:
        self._call("quarantine")
        self._own(host)
        self.quarantined.append((host, key, reason))

    def close(self) -> None:
        pass


class _View:
    """:class:`FakeL3` with a hint subscription of its own (made at the first
    :meth:`hints`; a subscriber is told of changes made after it, as in Redis)."""

    def __init__(self, l3: FakeL3) -> None:
        self.l3 = l3
        self.hinted: set[int] = set()
        self.lost: set[int] = set()
        self.entries: list[tuple[int, FeedEntry]] = []  # hints that carry their entry
        self.taken: list[tuple[int, FeedEntry]] = []

    def hints(self) -> tuple[set[int], set[int]]:
        if self not in self.l3.subscribers:
            self.l3.subscribers.append(self)
        hinted, lost = self.hinted, self.lost
        self.hinted, self.lost = set(), set()
        self.taken, self.entries = self.entries, []
        return hinted, lost

    def hint_entries(self) -> list[tuple[int, FeedEntry]]:
        out, self.taken = self.taken, []
        return out

    def close(self) -> None:
        if self in self.l3.subscribers:  # (a crashed daemon's connection is gone too)
            self.l3.subscribers.remove(self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.l3, name)


def _id_num(eid: bytes) -> int:
    return int(eid.split(b"-")[0])


# ---------------------------------------------------------------- L2


@dataclass
class Rec:
    value: Value
    vector: Vector
    hlc: int
    dirty: bool


def _dotted(vector: Vector, hlc: int, other: Vector) -> Dotted:
    """As ``kvcomm._client._dotted``: a sibling's dot is the greatest entry ``other`` has
    not seen, so that every host picks the same one."""
    unseen = [e for e in vector if e[1] > vector_get(other, e[0])] or list(vector)
    actor, counter = max(unseen, key=lambda e: (e[1], e[0])) if unseen else ("", 0)
    return Dotted(vector, (actor, counter), hlc)


@dataclass
class FakeL2:
    """One host's L2. Agents write with :meth:`put`, :meth:`delete`, :meth:`read`."""

    host_id: str
    feed_capacity: int = 64
    resolvers: dict[str, Callable[[str, list[Value]], Value]] = field(default_factory=dict)
    namespace: str = ""
    recs: dict[str, Rec] = field(default_factory=dict)
    counter: int = 0
    hlc: int = 0
    seq: int = 0
    feed: deque[FeedEvent] = field(default_factory=deque)
    sync_cursor: int = 0
    writes: list[tuple[str, tuple[str, int]]] = field(default_factory=list)  # (key, dot)
    anomalies: list[str] = field(default_factory=list)
    clock: Callable[[], float] = lambda: 0.0  # seconds; the HLC's physical part comes from it
    referenced: set[str] = field(default_factory=set)  # agents read or wrote, since take_reads

    def now_ms(self) -> int:
        return 1_700_000_000_000 + int(self.clock() * 1000)

    def _event(self, kind: int, key: str, rec: Rec | None) -> None:
        self.seq += 1
        self.feed.append(FeedEvent(self.seq, kind, key, 0, 0 if rec is None else rec.hlc))
        while len(self.feed) > self.feed_capacity:
            self.feed.popleft()

    def _write(self, key: str, value: Value, base: Vector | None = None) -> None:
        """A new local write of ``key`` (a new dot), over ``base`` or what L2 holds."""
        old = self.recs.get(key)
        self.counter += 1
        vector = with_dot(base if base is not None else (old.vector if old else ()),
                          self.host_id, self.counter)
        self.hlc = hlc_tick(max(self.hlc, old.hlc if old else 0), self.now_ms())
        rec = Rec(value, vector, self.hlc, dirty=True)
        self.recs[key] = rec
        self.referenced.add(key)
        self.writes.append((key, (self.host_id, self.counter)))
        self._event(KIND_DELETE if value is None else KIND_PUT, key, rec)

    # --- agents

    def put(self, key: str, value: bytes) -> None:
        tag, meta, payload = codec.encode(value)
        self._write(key, (tag, bytes(meta), bytes(payload)))

    def delete(self, key: str, l3: FakeL3) -> None:
        """As ``Client.delete`` in cluster mode: a key not held is looked up in L3 first,
        so the delete covers the cluster's version; absent everywhere: nothing to do."""
        if key not in self.recs:
            self.read(key, l3)
        if key in self.recs and self.recs[key].value is not None:
            self._write(key, None)

    def read(self, key: str, l3: FakeL3) -> None:
        """An agent's read: an L2 miss reads L3 once and fills L2 (Unavailable: nothing)."""
        if key in self.recs:
            self.referenced.add(key)
            return
        try:
            rec = l3.get(key)
        except Unavailable:
            return
        if rec is not None and not rec.tombstone:
            self.apply_remote(key, rec)
            self.referenced.add(key)  # (a fill: the agent read it)

    def evict(self, rng: random.Random) -> None:
        clean = sorted(k for k, r in self.recs.items() if not r.dirty)
        if clean:
            key = rng.choice(clean)
            self._event(KIND_EVICT, key, self.recs.pop(key))

    # --- HostL2

    def feed_read(self, cursor: int) -> tuple[list[FeedEvent], int, bool]:
        first = self.feed[0].seq if self.feed else self.seq + 1
        return [e for e in self.feed if e.seq > cursor], self.seq, first > cursor + 1

    def dirty_keys(self) -> list[str]:
        return sorted(k for k, r in self.recs.items() if r.dirty)

    def dirty_record(self, key: str) -> L3Record | None:
        rec = self.recs.get(key)
        if rec is None or not rec.dirty:
            return None
        counter = vector_get(rec.vector, self.host_id)
        if counter == 0:  # a dirty record must carry this host's entry: it is its dot
            self.anomalies.append(f"dirty {key!r} without an entry of {self.host_id}: {rec}")
        dot = (self.host_id, counter)
        if rec.value is None:
            return L3Record(rec.hlc, True, 0, b"", b"", rec.vector, dot)
        return L3Record(rec.hlc, False, *rec.value, rec.vector, dot)

    def held_record(self, key: str) -> L3Record | None:
        rec = self.recs.get(key)
        counter = 0 if rec is None else vector_get(rec.vector, self.host_id)
        if rec is None or rec.dirty or counter == 0:
            return None
        dot = (self.host_id, counter)
        if rec.value is None:
            return L3Record(rec.hlc, True, 0, b"", b"", rec.vector, dot)
        return L3Record(rec.hlc, False, *rec.value, rec.vector, dot)

    def mark_delivered(self, key: str, record: L3Record) -> bool:
        rec = self.recs.get(key)
        if (rec is None or not rec.dirty or rec.hlc != record.hlc
                or vector_get(rec.vector, self.host_id) != record.dot[1]):
            return False
        rec.dirty = False
        return True

    def holds(self, key: str) -> bool:
        return key in self.recs

    def held_vector(self, key: str) -> Vector | None:
        rec = self.recs.get(key)
        return None if rec is None else rec.vector

    def held_keys(self, tombstones: bool = False) -> list[str]:
        return sorted(k for k, r in self.recs.items() if tombstones or r.value is not None)

    def apply_remote(self, key: str, record: L3Record) -> None:
        remote: Value = None if record.tombstone else (record.tag, record.meta, record.value)
        local = self.recs.get(key)
        lost = vector_get(record.vector, self.host_id)  # (as Client._merge: dots of a lost
        if (local is not None and local.dirty and lost > self.counter  # L2 never saw a
                and 0 < vector_get(local.vector, self.host_id) <= lost):  # dirty write)
            self.rebase(key, record)
            local = self.recs.get(key)
        self.hlc = max(self.hlc, record.hlc)  # the host's clock absorbs what it saw
        if local is None:
            self._set(key, Rec(remote, record.vector, record.hlc, False))
            return
        order = compare_vectors(record.vector, local.vector)
        if order in (Ordering.BEFORE, Ordering.EQUAL):
            return
        if order is Ordering.AFTER:
            self._set(key, Rec(remote, record.vector, record.hlc, False))
            return
        sibs = [Sibling(local.value, _dotted(local.vector, local.hlc, record.vector)),
                Sibling(remote, _dotted(record.vector, record.hlc, local.vector))]
        deletes = local.value is None or remote is None
        fn = None if deletes else self._resolver(key)
        hook = None if fn is None else (lambda live: fn(key, [s.value for s in live]))
        res = resolve(sibs, hook)
        if res.winner is None:  # the resolver made a value: a new write over the merge
            self._write(key, res.value, base=res.vector)
            return
        stored = (res.vector, res.winner.hlc)
        self._set(key, Rec(res.value, res.vector, res.winner.hlc,
                           dirty=stored != (record.vector, record.hlc)))

    def _set(self, key: str, rec: Rec) -> None:  # (the daemon's: not an agent's read)
        self.recs[key] = rec
        self.referenced.discard(key)
        self._event(KIND_DELETE if rec.value is None else KIND_PUT, key, rec)

    def _resolver(self, key: str) -> Callable[[str, list[Value]], Value] | None:
        best = max((p for p in self.resolvers if key.startswith(p)), key=len, default=None)
        return None if best is None else self.resolvers[best]

    def has_resolver(self, key: str) -> bool:
        return self._resolver(key) is not None

    def write_sequence(self) -> int:
        return self.counter

    def dirty_count(self) -> int:
        return sum(r.dirty for r in self.recs.values())

    def forget(self, key: str) -> bool:
        rec = self.recs.get(key)
        if rec is None or rec.dirty:
            return False
        self._event(KIND_EVICT, key, self.recs.pop(key))
        return True

    def quiet(self) -> None:
        pass  # (applies never count as reads here: _set)

    def take_reads(self, keys: Sequence[str]) -> dict[str, int]:
        out = {k: -1 if k not in self.recs else int(k in self.referenced) for k in keys}
        self.referenced.difference_update(keys)
        return out

    def rebase(self, key: str, record: L3Record) -> bool:
        """As ``Client._restamp``: the write sequence past L3's entry for this host, then
        the local record written again over both."""
        self.counter = max(self.counter, vector_get(record.vector, self.host_id))
        rec = self.recs.get(key)
        if rec is None or not rec.dirty:
            return False
        self.hlc = max(self.hlc, record.hlc)
        self._write(key, rec.value, base=merge_vectors(rec.vector, record.vector))
        return True

    def past_lost_dots(self, lost: int) -> int:
        """As ``Client._past_lost_dots``: the sequence past ``lost``, and every dirty
        record with a dot at most that far given a new dot past it (value, HLC kept)."""
        if lost <= self.counter:
            return 0
        self.counter = lost
        moved = 0
        for key, rec in sorted(self.recs.items()):
            if rec.dirty and vector_get(rec.vector, self.host_id) <= lost:
                self.counter += 1
                others = tuple(e for e in rec.vector if e[0] != self.host_id)
                vector = tuple(sorted((*others, (self.host_id, self.counter))))
                self._set(key, Rec(rec.value, vector, rec.hlc, True))
                moved += 1
        return moved

    def hot_keys(self, n: int) -> list[str]:
        return self.held_keys()[:n]

    def heartbeat(self) -> None:
        pass

    def delivered_up_to(self, cursor: int) -> None:
        assert cursor <= self.seq, (cursor, self.seq)
        self.sync_cursor = cursor

    @property
    def delivered_cursor(self) -> int:
        return self.sync_cursor


class FakeKeys:
    """The key filter: exact, so a test can read what went in."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()
        self.ready = False
        self.adds_since_rotation = 0

    def add(self, key: bytes) -> None:
        self.keys.add(key)
        self.adds_since_rotation += 1

    def beat(self) -> None:
        pass

    def set_ready(self, ready: bool) -> None:
        self.ready = ready

    def begin_rotation(self) -> Any:
        self.adds_since_rotation = 0
        return self

    def end_rotation(self) -> None:
        pass

    def close(self) -> None:
        pass
