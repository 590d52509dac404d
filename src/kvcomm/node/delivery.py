"""The node daemon's delivery logic, as state machines without I/O.

Nothing here reads a clock, sleeps, draws randomness of its own or touches L2 or L3:
the driver (:mod:`kvcomm.node.daemon` and its parts, :mod:`kvcomm.node.push` and
:mod:`kvcomm.node.pull`) does the I/O, passes the time in (``now``, seconds, monotonic),
and carries out what these machines answer. So every decision — what to send, what to
persist, when to resync, how long to back off — can be driven by a test from a script of
events (``tests/cluster/test_delivery.py``,
``tests/sim/test_delivery_sim.py``), without Redis.

* :class:`Outbound` (local → L3, at least once): stages the dirty records the driver
  reads from L2's feed, closes write windows, turns each L3 answer into an
  :class:`Answer` (deliver: clear the dirty flag; take: merge L3's record into L2;
  rebase; set aside), and says which feed position may be persisted
  (:meth:`Outbound.delivered`: never past an unanswered write). :class:`Unconfirmed`
  holds the writes fewer replicas took than asked.
* :class:`Inbound` (L3 → local): which groups' feeds are due (hints, the sweep of
  counters), checks each entry's sequence number (a gap or a rewind makes the group
  resync), paces the polls.
* :class:`HostActivity` (when each host's dot was last seen: the age that prunes vectors),
  :class:`Skipped` (changes to keys the host does not hold, remembered a while),
  :func:`echo`.

The driver's obligations (what it must call, in which order) are listed in the design
page; a driver that skips one loses the guarantee.

Design (the answer table, lost writes and rebases, bounded vectors, sequence numbers,
rewinds and tails, resyncs, the driver's obligations): docs/design/delivery.md.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from typing import NamedTuple

from ..core.backoff import Backoff
from ..core.resolve import MERGED, OLDER
from ..core.versions import covers, prune, vector_get
from ..core.window import ClosedWindow, WriteWindow
from ..errors import CorruptRecord
from ..tiers.l3.connection import Unreached
from ..tiers.l3.feed import FeedEntry, FeedNote
from ..tiers.l3.push import PushResult
from ..tiers.l3.records import L3Record

FEED_COUNT = 500  # entries read per group per poll
STATE_EVERY = 1.0  # seconds between saves of the feed cursors (those that changed)
SWEEP_RATE = 1024.0  # group counters the sweep reads per second (cluster.feed_sweep_rate)
SWEEP_BATCH = 256  # group counters per sweep slice (one read-only script call per master)
MIN_SWEEP_EVERY = 0.25  # seconds between sweep slices at least
# the sweep reads the streams' tails with the counters in one pass over every group of
# this many (a tail costs some 20 bytes back per written group); the counters checked
# out of turn (lost hints, the start, a heal, a hint of a reissued number) always do
TAIL_EVERY = 8
RECENT_S = 30.0  # how long a skipped remote change can still be applied over a late fill
RECENT_MAX = 65_536  # skipped remote changes remembered at most
UNCONFIRMED_MAX = 1024  # records pushed short of cluster.wait_replicas held at most

# why a group is resynced
GAP, REWIND, UNSEQUENCED = "gap", "rewind", "unsequenced"
NOT_DURABLE, CORRUPT = "not_durable", "corrupt"  # answers that are not L3 outcomes
UNREACHED = "unreached"  # not sent: its master is down (DaemonL3.down); sent again later


def _read_already(eid: bytes, cursor: bytes) -> bool:
    """Whether stream id ``eid`` is at or before ``cursor`` (ids ``ms-seq``, ordered as
    Redis orders them); False when either is not an id."""
    a, b = eid.split(b"-"), cursor.split(b"-")
    if len(a) != 2 or len(b) != 2 or not all(x.isdigit() for x in (*a, *b)):
        return False
    return (int(a[0]), int(a[1])) <= (int(b[0]), int(b[1]))


# ---------------------------------------------------------------- local → L3


class Unheld(NamedTuple):
    """A record L3 acknowledged with fewer replicas than ``cluster.wait_replicas`` asked
    (the master had fewer connected: :meth:`kvcomm.tiers.l3.replication.Replication.replicas_to_wait`)."""

    key: str
    record: L3Record  # as L2 holds it (kept dirty: what mark_delivered names, once confirmed)
    since: int  # the outbound cursor before the read that staged it
    group: int
    seq: int  # the sequence number of the feed entry the push wrote
    entry: bytes  # and its stream id
    node: str  # the master that took it
    call: int  # the pipeline that wrote it (PushResult.call)
    # the replication history that master ran, seen before the pipeline (PushResult.history;
    # "" unknown): only a WAIT in that same history confirms it
    history: str = ""


class Unconfirmed:
    """Records L3 acknowledged with fewer replicas than asked, until confirmed.

    Such a write is on the master alone (or on fewer replicas than asked): a failover
    before any host read its feed entry loses it, and keeps the state before it — the
    group's counter then equals every reader's last number and the stream ends at
    their cursors: no rewind check of a reader sees anything. So the writer remembers
    each (its key, group, and the sequence number and stream id of its entry) and
    keeps it dirty in L2 (never evicted; its feed position holds back the delivered
    cursor, so a restarted daemon sends it again), until:

    * **confirmed** (:meth:`confirm`): a later probe write on the same master, in the
      same replication history (its run and replication id, seen before the push and
      again after the probe's WAIT), was acknowledged by ``cluster.wait_replicas``
      replicas — WAIT counts replicas up to the connection's last write, which comes
      after this one on the master's replication stream. Then it is delivered (clean).
      The master's name alone would not do: after a failback (the write lost by a
      failover, the old master made master again at the same address, resynced from
      the new one) or a restart, a WAIT there counts replicas of a history without it;
    * **its history left** (:meth:`rewound`): its master was seen since in another
      history (or not as a master): the write may be lost — the driver resyncs its
      group as after a rewind, which sends it again;
    * **found lost** (:meth:`Inbound.examine`, :meth:`Inbound.to_read`): the group's
      counter below its number, or an entry with its number at another id — a rewind:
      the group is resynced and the resync sends it again (:meth:`drop_groups`);
    * **superseded**: a later write of the key was answered (it descends from this one);
    * **released**: more than ``limit`` are held; the oldest is delivered (clean,
      evictable; its loss is no longer watched for — counted, logged). A host whose
      masters stay short of replicas for long cannot keep every write dirty: the
      bound keeps the backlog (``cluster.outbound_max``) free for new writes.
    """

    def __init__(self, limit: int = UNCONFIRMED_MAX) -> None:
        self.limit = max(1, limit)
        self.by_key: dict[str, Unheld] = {}  # oldest first
        self.by_group: dict[int, dict[int, bytes]] = {}  # group → seq → entry id (Inbound)
        self._since: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self.by_key)

    def add(self, held: Unheld) -> list[Unheld]:
        """Hold ``held`` (in place of an earlier record of its key). Returns those
        released past the bound, oldest first."""
        self.drop(held.key)
        self.by_key[held.key] = held
        self.by_group.setdefault(held.group, {})[held.seq] = held.entry
        self._since[held.since] += 1
        out = []
        while len(self.by_key) > self.limit:
            out.append(self._remove(next(iter(self.by_key))))
        return out

    def drop(self, key: str) -> Unheld | None:
        """Forget ``key``'s held record (superseded). Returns it, or None."""
        return self._remove(key) if key in self.by_key else None

    def confirm(self, confirmed: Mapping[str, tuple[int, str]]) -> list[Unheld]:
        """``confirmed``: master → (the latest probe there that ``wait_replicas``
        replicas acknowledged, the replication history the master ran throughout).
        Returns the held records it covers (written there by an earlier pipeline in
        that same history), forgotten: deliver them."""
        done = []
        for h in self.by_key.values():
            call, history = confirmed.get(h.node, (0, ""))
            if h.call < call and h.history and h.history == history:
                done.append(h)
        return [self._remove(h.key) for h in done]

    def rewound(self, histories: Mapping[str, str],
                unserved: Set[tuple[str, int]] = frozenset()) -> set[int]:
        """``histories``: node → the replication history it was last seen in ("" not a
        master); ``unserved``: (node, group) pairs where the node no longer serves the
        group (its slot moved: no WAIT there can confirm what it took). Returns the
        groups of the held records whose master has left the history they were written
        in (or whose history was not known), or their group: each may be lost — resync
        them as after a rewind (:meth:`drop_groups` then sends them again)."""
        return {h.group for h in self.by_key.values()
                if h.node in histories and (histories[h.node] != h.history or not h.history)
                or (h.node, h.group) in unserved}

    def drop_groups(self, groups: Iterable[int]) -> list[Unheld]:
        """Forget the held records of ``groups`` (being resynced: the resync sends each
        again). Returns them."""
        gs = set(groups)
        return [self._remove(h.key) for h in list(self.by_key.values()) if h.group in gs]

    def since(self) -> int | None:
        """The least feed position of a held record (None: none held)."""
        return min(self._since) if self._since else None

    def nodes(self) -> dict[str, int]:
        """Master → a group of a record held there (to probe that master:
        DaemonL3.confirm_replicated)."""
        return {h.node: h.group for h in self.by_key.values()}

    def _remove(self, key: str) -> Unheld:
        held = self.by_key.pop(key)
        seqs = self.by_group.get(held.group)
        if seqs is not None:
            seqs.pop(held.seq, None)
            if not seqs:
                del self.by_group[held.group]
        self._since[held.since] -= 1
        if not self._since[held.since]:
            del self._since[held.since]
        return held


class Staged(NamedTuple):
    record: L3Record  # the key's dirty record, as L2 holds it
    since: int  # the outbound cursor before the read that staged it


class PushItem(NamedTuple):
    key: str
    record: L3Record  # as sent (vector pruned)
    staged: L3Record  # as L2 holds it: what delivering names
    since: int


class Push(NamedTuple):
    """One closed window's records (with ``more``, the windows after it that waited
    too), to be sent in one call."""

    items: list[PushItem]
    keep_siblings: frozenset[str]  # keys whose concurrent versions come back as conflicts
    window: ClosedWindow
    more: tuple[ClosedWindow, ...] = ()  # closed windows sent in the same call


class Answer(NamedTuple):
    """What the driver does about one pushed record (see the module's table)."""

    key: str
    sent: L3Record  # the record as L2 holds it: what mark_delivered names
    outcome: str  # an L3 outcome, NOT_DURABLE or CORRUPT
    deliver: bool  # L3 holds this write or one that saw it: clear its dirty flag
    take: L3Record | None  # L3 holds another record: merge it into L2
    set_aside: str  # why the record is set aside ("" when it is not)
    rebase: bool = False  # L2 lost dots L3 has: write it again past them, else take
    # acknowledged by fewer replicas than cluster.wait_replicas asked: not delivered (kept
    # dirty: never evicted) but held in :attr:`Outbound.unconfirmed` until confirmed
    unconfirmed: bool = False


class Outbound:
    """The local feed cursor, the staged records, the write window and the pushes."""

    def __init__(self, host: str, cursor: int, window: WriteWindow, backoff: Backoff,
                 merge: int = 1, group_of: Callable[[str], int] = lambda key: 0,
                 unconfirmed_max: int = UNCONFIRMED_MAX) -> None:
        self.host = host
        self.group_of = group_of
        # records L3 acknowledged with fewer replicas than asked (see Unconfirmed)
        self.unconfirmed = Unconfirmed(unconfirmed_max)
        self.released: list[Unheld] = []  # held records the bound released: deliver them
        # at most this many waiting windows go in one push: a backlog (after a partition,
        # say) is sent in calls of several windows, fewer round trips and one hint per
        # group per call; an idle host has one window waiting at a time, as before
        self.merge = max(1, merge)
        self.cursor = cursor  # the local feed has been read up to here
        self.window = window
        self.backoff = backoff
        self.staged: dict[str, Staged] = {}  # key → its latest dirty record not yet answered
        self.unsent: deque[ClosedWindow] = deque()  # closed windows, oldest first
        self.in_flight: Push | None = None
        self.retry_at = float("-inf")
        self._since: Counter[int] = Counter()  # since → staged records with it
        # staged keys whose master was down (answered Unreached): in no window, so that
        # a backlog for a hung master is not re-sent every round, until :meth:`unpark`
        # (the driver calls it once a master taken for down answers again)
        self.parked: set[str] = set()

    def read(self, cursor: int, records: Iterable[tuple[str, L3Record | None]],
             now: float) -> None:
        """The driver read the local feed up to ``cursor``, and these are the dirty
        records (None: clean or gone) of the keys it named, or of every dirty key after an
        overflow."""
        since = self.cursor
        for key, record in records:
            if record is not None:
                self._stage(key, record, since, now)
        self.cursor = cursor

    def repush(self, key: str, record: L3Record, now: float, since: int | None = None
               ) -> bool:
        """Send ``record``, a record L2 holds (clean: already acknowledged once) that L3
        lost, again: staged like a local write, so that it goes out in the normal windows
        and batches and its answer is carried out like any push's (an ``older`` or
        ``equal`` answer ends it: nothing re-stages a re-push). A key with a staged record
        keeps it (that newer write descends from ``record``). ``since``: the feed position
        to hold the delivered cursor at until it is answered (a dirty record's, held
        unconfirmed: else a daemon killed meanwhile would not read its write again);
        None: the cursor. Returns whether it was staged."""
        if key in self.staged:
            return False
        self._stage(key, record, self.cursor if since is None else since, now)
        return True

    def delivered(self) -> int:
        """The local feed position before which every write is in L3 (and, with
        ``cluster.wait_replicas``, on as many replicas: an unconfirmed record holds it
        back, so that a restarted daemon sends it again): the one to persist."""
        low = min(self._since) if self._since else self.cursor
        held = self.unconfirmed.since()
        return low if held is None else min(low, held)

    def next_push(self, now: float, has_resolver: Callable[[str], bool],
                  shape: Callable[[L3Record], L3Record] = lambda r: r) -> Push | None:
        """The next push to make: the oldest closed window's keys with their latest staged
        records, each passed through ``shape`` (pruning); or None when there is nothing to
        send, a push is in flight, or the last one failed less than a backoff ago.

        ``has_resolver(key)``: concurrent versions of the key are settled by a resolver
        here, so L3 must keep them apart; never for a delete (a resolver must not bring a
        deleted key back: deletes merge last-writer-wins).
        """
        closed = self.window.poll(now)
        if closed is not None:
            self.unsent.append(closed)
        if self.in_flight is not None or now < self.retry_at:
            return None
        while self.unsent:
            window = self.unsent[0]
            items = [PushItem(w.key, shape(s.record), s.record, s.since)
                     for w in window.writes if (s := self.staged.get(w.key)) is not None
                     and w.key not in self.parked]
            if items:
                break
            self.unsent.popleft()  # each of its keys went out with an earlier push
        else:
            return None
        more: list[ClosedWindow] = []
        if self.merge > 1 and len(self.unsent) > 1:
            seen = {i.key for i in items}  # (a key in two windows: its latest record, once)
            for later in list(self.unsent)[1:self.merge]:
                for w in later.writes:
                    if (w.key not in seen and (s := self.staged.get(w.key)) is not None
                            and w.key not in self.parked):
                        items.append(PushItem(w.key, shape(s.record), s.record, s.since))
                        seen.add(w.key)
                more.append(later)
        keep = frozenset(i.key for i in items if not i.record.tombstone and has_resolver(i.key))
        self.in_flight = Push(items, keep, window, tuple(more))
        return self.in_flight

    def pushed(self, push: Push, results: Sequence[PushResult | CorruptRecord | Unreached],
               now: float,
               write_sequence: int) -> list[Answer]:
        """L3 answered ``push`` (one result per item, in order); ``write_sequence``: the
        counter of the host's newest dot, read after the push. Returns what to do about
        each record. Raises ValueError when the results do not match the items."""
        if len(results) != len(push.items):
            raise ValueError(f"{len(results)} answers for {len(push.items)} pushed records")
        self._settle(push)
        self.backoff.succeeded()
        for _ in range(1 + len(push.more)):  # (push.window and push.more: nothing else
            self.unsent.popleft()  # leaves the queue while in flight)
        answers = []
        for item, res in zip(push.items, results, strict=True):
            staged = self.staged.get(item.key)
            if staged is not None and staged.record is item.staged:
                self._unstage(item.key)
            answer = self._answer(item, res, now, write_sequence)
            if answer.unconfirmed and isinstance(res, PushResult) and res.seq is not None:
                self.released += self.unconfirmed.add(Unheld(
                    item.key, item.staged, item.since, self.group_of(item.key), res.seq,
                    res.entry, res.node, res.call, res.history))
            elif answer.deliver:  # (this write, or one that saw it, is answered for)
                self.unconfirmed.drop(item.key)
            answers.append(answer)
        return answers

    def push_failed(self, push: Push, now: float) -> float:
        """L3 could not be reached: the push stays first in line (with whatever is staged
        then). Returns the delay before the next try."""
        self._settle(push)
        delay = self.backoff.failed()
        self.retry_at = now + delay
        return delay

    def flush(self, now: float) -> None:
        """Close the open window now (shutdown): what it holds is pushed next."""
        closed = self.window.flush(now)
        if closed is not None:
            self.unsent.append(closed)

    @property
    def waiting(self) -> bool:
        """Closed windows wait to be pushed."""
        return bool(self.unsent)

    def wake_at(self) -> float | None:
        """When :meth:`next_push` will next have something to do (for the driver's sleep);
        None when only new writes can give it any."""
        times = [t for t in (self.window.deadline(),
                             self.retry_at if self.unsent else None) if t is not None]
        return min(times) if times else None

    def _answer(self, item: PushItem, res: PushResult | CorruptRecord | Unreached, now: float,
                write_sequence: int) -> Answer:
        if isinstance(res, CorruptRecord):
            return Answer(item.key, item.staged, CORRUPT, True, None, str(res))
        if isinstance(res, Unreached) or not res.durable:
            # not sent (its master is down: parked until one answers again), or no
            # replica has it yet: send again next window
            if item.key not in self.staged:  # (a newer staged write descends from it anyway)
                self._stage(item.key, item.staged, item.since, now,
                            park=isinstance(res, Unreached))
            return Answer(item.key, item.staged,
                          UNREACHED if isinstance(res, Unreached) else NOT_DURABLE, False, None, "")
        held, sent = res.record, item.record
        if (res.outcome in (OLDER, MERGED) and sent.dot[0] == self.host and held.dot != sent.dot
                and vector_get(held.vector, self.host) > write_sequence):
            return Answer(item.key, item.staged, res.outcome, False, held, "", rebase=True)
        same = held.dot == sent.dot and held.hlc == sent.hlc and held.vector == sent.vector
        deliver = covers(held.vector, sent.dot)
        if deliver and res.short and res.seq is not None:  # (a change stored: new, newer,
            # merged) on fewer replicas than asked: a failover may lose it before any host
            # reads its entry, which no rewind check of the readers would see
            return Answer(item.key, item.staged, res.outcome, False, None if same else held,
                          "", unconfirmed=True)
        return Answer(item.key, item.staged, res.outcome, deliver, None if same else held, "")


    def unpark(self, now: float) -> int:
        """A master taken for down answers again: the parked keys go into the write
        window again (those still staged), to be pushed. Returns how many."""
        n = 0
        for key in self.parked:
            s = self.staged.get(key)
            if s is not None:
                self._window(key, s.record, now)
                n += 1
        self.parked.clear()
        return n

    def _stage(self, key: str, record: L3Record, since: int, now: float,
               park: bool = False) -> None:
        if key in self.staged:
            self._unstage(key)
        self.staged[key] = Staged(record, since)
        self._since[since] += 1
        if park:
            self.parked.add(key)
        else:
            self._window(key, record, now)

    def _window(self, key: str, record: L3Record, now: float) -> None:
        size_hint = None if record.tombstone else record.value
        closed = self.window.add(key, size_hint, record.vector, record.hlc, now)
        if closed is not None:
            self.unsent.append(closed)

    def _unstage(self, key: str) -> None:
        self.parked.discard(key)
        since = self.staged.pop(key).since
        self._since[since] -= 1
        if not self._since[since]:
            del self._since[since]

    def _settle(self, push: Push) -> None:
        if push is not self.in_flight:
            raise ValueError("an answer for a push that is not in flight")
        self.in_flight = None


class Skipped:
    """Remote changes to keys the host does not hold, each kept ``keep_s`` seconds (at
    most ``limit``, the oldest dropped first), to apply over an agent's late fill: the
    record of an inline feed entry, or the note of a value-less one (the driver then
    reads the key's record from L3: as new as the note's, or newer)."""

    def __init__(self, keep_s: float = RECENT_S, limit: int = RECENT_MAX) -> None:
        self.keep_s, self.limit = keep_s, limit
        self._recent: dict[str, tuple[float, L3Record | FeedNote]] = {}  # in the order remembered

    def remember(self, key: str, record: L3Record | FeedNote, now: float) -> None:
        if len(self._recent) >= self.limit:
            for k in list(self._recent)[: max(1, self.limit // 4)]:  # the oldest quarter
                del self._recent[k]
        self._recent.pop(key, None)
        self._recent[key] = (now, record)

    def take(self, key: str, now: float) -> L3Record | FeedNote | None:
        """The change remembered for ``key`` if it is recent (forgotten either way)."""
        seen = self._recent.pop(key, None)
        return None if seen is None or now - seen[0] >= self.keep_s else seen[1]


def echo(note: FeedNote, host: str, write_sequence: int) -> bool:
    """Whether a value-less feed entry announces a record this host's L2 already holds,
    or holds something newer than: its own write, stored by L3 as it was pushed (not a
    merge, whose vector is news), from this life of its L2 (a dot past the host's write
    sequence is from before L2 was lost: L2 does not hold it). Such an entry needs no
    read of the record; any other entry of a key the host wants does."""
    return note.writer == host and not note.merged and note.counter <= write_sequence


# ---------------------------------------------------------------- bounded vectors


class HostActivity:
    """When this daemon last saw each host write (a dot in the feeds), in ms of the
    driver's clock: the ages by which vectors are pruned before a push."""

    def __init__(self, own: str, now_ms: int, *, small: int = 8, big: int = 32,
                 young_ms: int = 60_000, old_ms: int = 86_400_000, limit: int = 4096) -> None:
        self.own = own
        self.started_ms = now_ms  # hosts never seen count as seen then
        self.small, self.big, self.young_ms, self.old_ms = small, big, young_ms, old_ms
        self.limit = limit
        self.seen: dict[str, int] = {}

    def saw(self, actor: str, now_ms: int) -> None:
        """A write of ``actor`` came through the feeds."""
        self.seen[actor] = max(now_ms, self.seen.get(actor, now_ms))
        if len(self.seen) > self.limit:  # (actors come from L3: bound what they cost)
            oldest = sorted(self.seen, key=self.seen.__getitem__)[: self.limit // 2]
            for a in oldest:
                del self.seen[a]

    def last_active(self, vector: Iterable[tuple[str, int]]) -> Mapping[str, int]:
        return {a: self.seen.get(a, self.started_ms) for a, _ in vector}

    def shape(self, record: L3Record, now_ms: int) -> L3Record:
        """``record`` with its vector pruned; this host's and the writer's entries kept."""
        if len(record.vector) <= self.small:
            return record
        vector = prune(record.vector, self.last_active(record.vector), now_ms,
                       keep=(self.own, record.dot[0]), small=self.small, big=self.big,
                       young_ms=self.young_ms, old_ms=self.old_ms)
        return record if vector == record.vector else record._replace(vector=vector)


# ---------------------------------------------------------------- L3 → local


class Reading(NamedTuple):
    entries: list[FeedEntry]  # in sequence: apply in order, Inbound.advance after each
    problem: str  # "", GAP, REWIND or UNSEQUENCED: resync the group afterwards


class Poll(NamedTuple):
    """One poll of the feeds: read ``check``'s counters first, then the feeds of the
    groups :meth:`Inbound.to_read` names; save the cursors afterwards if ``save``."""

    check: frozenset[int]  # groups whose counters to read first (a sweep slice, lost hints)
    save: bool  # save the cursors that changed, afterwards
    sweep: int = 0  # groups of ``check`` that are the sweep's slice (0: no slice this poll)


class Inbound:
    """Every group's feed cursor and last sequence number, which groups to read (hinted,
    or found changed by a counter check), the sweep over every group's counter, the
    resyncs, the poll's pace."""

    def __init__(self, groups: int, poll: float, backoff: Backoff, now: float,
                 state_every: float = STATE_EVERY, sweep_rate: float = SWEEP_RATE,
                 sweep_batch: int = SWEEP_BATCH) -> None:
        self.groups = range(groups)
        self.cursors: dict[int, bytes] = {}  # group → id of the last entry read
        self.seqs: dict[int, int | None] = {}  # group → sequence number of that entry
        self.pending: dict[int, bool] = {}  # group resyncing → its keys still go to the filter
        self.due: set[int] = set()  # groups to read at the next poll (hinted, or more to read)
        # entries hints carried, each group's following its last sequence number without a
        # hole: applied at the next poll without reading the group's stream (noted)
        self.noted: dict[int, list[FeedEntry]] = {}
        self.recheck: set[int] = set(self.groups)  # counters to read at the next poll: all at start
        # groups whose next read checks that the stream still holds the cursor's entry
        # (a failover may have lost it): those whose hints may have been lost — a
        # failover breaks the subscription of the slots it moves —, all at start
        self.verify: set[int] = set(self.groups)
        self.poll, self.backoff, self.state_every = poll, backoff, state_every
        # the sweep: a slice of the groups' counters every sweep_every seconds, in turn
        self.slice = max(1, min(groups, sweep_batch))
        self.sweep_every = max(MIN_SWEEP_EVERY, self.slice / sweep_rate)
        self.sweep_next = 0  # the group the next slice starts at
        self.swept = 0  # groups the sweep's slices covered so far (its passes: TAIL_EVERY)
        self.sweep_at = now + self.sweep_every
        self.last_poll = float("-inf")
        self.retry_at = float("-inf")
        self.state_at = now + state_every
        self._saved: dict[int, tuple[bytes, int | None]] = {}  # group → what L3 holds of it
        # group → seq → stream id of the entries this host's unconfirmed pushes wrote
        # (Unconfirmed.by_group, shared by the driver): a counter below one, or an entry
        # with its number at another id, is a rewind, whatever this host read
        self.expected: Mapping[int, Mapping[int, bytes]] = {}

    @property
    def sweep_period(self) -> float:
        """Seconds between two reads of one group's counter by the sweep: how late a
        change whose hint was lost is found, at most (plus one poll)."""
        return self.sweep_every * -(-len(self.groups) // self.slice)

    def resume(self, cursors: Mapping[int, bytes], seqs: Mapping[int, int]) -> set[int]:
        """Start from saved cursors and sequence numbers. Returns the groups that lack
        either: start them afresh (a resync without a reason). Every group's counter is
        checked at the first poll (changes made while no daemon listened sent hints to
        nobody)."""
        fresh = set()
        for g in self.groups:
            if g in cursors and g in seqs:
                self.cursors[g], self.seqs[g] = cursors[g], seqs[g]
                self._saved[g] = (cursors[g], seqs[g])
            else:
                fresh.add(g)
        return fresh

    def hinted(self, groups: Iterable[int]) -> None:
        """Hints arrived: these groups changed (read them at the next poll)."""
        for g in groups:
            if g in self.groups:
                self.due.add(g)
                self.noted.pop(g, None)  # (the read brings those entries too)

    def noted_entry(self, group: int, entry: FeedEntry) -> None:
        """A hint carried ``entry`` of ``group``'s feed. If it is the next one (its
        sequence number is the last read's, or the last noted one's, + 1) it is kept for
        :meth:`take_noted`, to be applied without reading the stream; otherwise (a hint
        lost or not carrying its entry, a rewind, a group resyncing or already to be
        read) the group is read at the next poll, as for a plain hint. The last number
        read at another id, at or before the cursor, is a number a failover reissued:
        the group's counter and tail are checked at the next poll (:meth:`to_read`)."""
        if group not in self.groups or group in self.due:
            return  # (the read brings it)
        mine = self.expected.get(group)
        if mine and entry.seq is not None and mine.get(entry.seq, entry.id) != entry.id:
            self.hinted((group,))  # (the number of an unconfirmed push: the read examines it)
            return
        kept = self.noted.get(group)
        last = kept[-1].seq if kept else self.seqs.get(group)
        cursor = self.cursors.get(group, b"0-0")
        if (not kept and entry.seq is not None and last is not None and entry.seq <= last
                and _read_already(entry.id, cursor)):
            if entry.seq == last and entry.id != cursor:
                self.recheck.add(group)  # (not the entry read under that number)
            return  # the hint of an entry read already (a read overtook it): no news
        if (group in self.pending or entry.seq is None or last is None
                or entry.seq != last + 1 or (kept is not None and len(kept) >= FEED_COUNT)):
            self.hinted((group,))
            return
        self.noted.setdefault(group, []).append(entry)

    def take_noted(self) -> dict[int, list[FeedEntry]]:
        """The noted entries of the groups not read at this poll (call after
        :meth:`to_read`), by group, in sequence: apply each as a read entry, calling
        :meth:`advance` after each, then :meth:`read` with their count."""
        out, self.noted = self.noted, {}
        return out

    def lost(self, groups: Iterable[int]) -> None:
        """Hints of these groups may have been lost (a subscription broke or moved):
        check their counters (with their tails) at the next poll, and their cursors'
        entries at their next reads (:attr:`verify`)."""
        mine = {g for g in groups if g in self.groups}
        self.recheck |= mine
        self.verify |= mine

    def verified(self, groups: Iterable[int]) -> None:
        """A read found the stream of each of ``groups`` holding its cursor's entry (or
        nothing at or before it): their next reads need not check it."""
        self.verify.difference_update(groups)

    def to_read(self, counters: Mapping[int, int | None],
                tails: Mapping[int, bytes | None] | None = None) -> set[int]:
        """The groups to read at this poll: those due, and those whose counter (read
        just now, ``counters``) is not the last sequence number read, or is but whose
        tail (the id of the stream's last entry, read with it: ``tails``; None: not
        known) is not the last entry read (a reissued number: :meth:`examine` says
        rewind)."""
        out = set(self.due)
        for g, counter in counters.items():
            kept = self.noted.get(g)
            last = kept[-1].seq if kept else self.seqs.get(g)
            at = kept[-1].id if kept else self.cursors.get(g)
            tail = tails.get(g) if tails else None
            mine = self.expected.get(g)
            if (counter is None or counter != last or (kept and g in self.verify)
                    or (tail is not None and at is not None and tail != at)
                    or (mine and counter < max(mine))):
                out.add(g)
        for g in out:
            self.noted.pop(g, None)  # (the read brings those entries too)
        return out

    def read(self, group: int, rows: int) -> None:
        """``group``'s feed was read (``rows`` entries came back) and what
        :meth:`examine` returned was applied: it stays due only if there may be more."""
        if rows >= FEED_COUNT:
            self.due.add(group)
        else:
            self.due.discard(group)

    def examine(self, group: int, rows: Sequence[FeedEntry],
                counter: int | None = None, tail: bytes | None = None,
                lost: bool = False) -> Reading:
        """The entries of one read of ``group``'s feed to apply, and whether the group
        must be resynced. ``counter``: the group's counter read *before* the feed (None:
        not read, or not a number); ``tail``: the id of the stream's last entry, read
        with it (None: not known); ``lost``: the read found the stream without the
        cursor's entry but with an older one. Changes nothing: :meth:`advance` does."""
        before = last = self.seqs.get(group)
        cursor = self.cursors.get(group)
        mine = self.expected.get(group) or {}
        if lost or (counter is not None and counter == before and tail is not None
                    and cursor is not None and tail != cursor) or (
                mine and counter is not None and counter < max(mine)):
            # (the last: an unconfirmed push of this host wrote an entry under a number the
            # counter no longer reaches — a failover lost it before this host read it)
            # the entry read under the last number is gone (the last number is another
            # entry's now): a failover lost it, and reissued its number, and maybe more,
            # at ids at or before the cursor, where this read (after the cursor) misses
            # them. Nothing read after it is applied: the resync re-reads the held keys
            return Reading([], REWIND)
        entries: list[FeedEntry] = []
        for entry in rows:
            if entry.seq is None or last is None:
                return Reading(entries, UNSEQUENCED)
            if entry.seq != last + 1:
                return Reading(entries, GAP if entry.seq > last + 1 else REWIND)
            if entry.seq in mine and mine[entry.seq] != entry.id:
                return Reading(entries, REWIND)  # (an unconfirmed push's number, reissued)
            entries.append(entry)
            last = entry.seq
        if counter is None or before is None or last is None:
            return Reading(entries, "")
        if counter < before:
            return Reading(entries, REWIND)  # the counter went back: a failover lost entries
        if len(rows) < FEED_COUNT and last < counter:
            return Reading(entries, GAP)  # counted before this read, and the read missed them
        return Reading(entries, "")

    def advance(self, group: int, entry: FeedEntry) -> None:
        """``entry`` (one :meth:`examine` returned) is applied or set aside."""
        self.cursors[group], self.seqs[group] = entry.id, entry.seq

    def begin_resync(self, groups: Iterable[int], missed: bool) -> None:
        """Resync ``groups``; ``missed``: entries were missed (a gap, a rewind), so their
        keys go to the key filter too."""
        for g in groups:
            self.pending[g] = self.pending.get(g, False) or missed
            self.noted.pop(g, None)  # (noted against the old position)

    def positioned(self, group: int, seq: int | None, last_id: bytes) -> bool:
        """The group's position, read atomically from L3. Returns True when the group's
        keys must be added to the key filter (then :meth:`scanned`)."""
        self.cursors[group], self.seqs[group] = last_id, seq
        return self.pending[group]

    def scanned(self, group: int) -> None:
        self.pending[group] = False

    def resynced(self, groups: Iterable[int]) -> None:
        """The held keys of ``groups`` were re-read: the resync is complete."""
        for g in groups:
            self.pending.pop(g, None)

    def saveable(self) -> tuple[dict[int, bytes], dict[int, int]]:
        """The cursors and sequence numbers to save: those that changed since the last
        :meth:`saved`, not those of a pending group."""
        cursors: dict[int, bytes] = {}
        seqs: dict[int, int] = {}
        for g, c in self.cursors.items():
            if g in self.pending:
                continue
            s = self.seqs.get(g)
            if self._saved.get(g) == (c, s):
                continue
            cursors[g] = c
            if s is not None:
                seqs[g] = s
        return cursors, seqs

    def saved(self, cursors: Mapping[int, bytes], seqs: Mapping[int, int]) -> None:
        """L3 holds these cursors and sequence numbers now (what :meth:`saveable` gave)."""
        for g, c in cursors.items():
            self._saved[g] = (c, seqs.get(g))

    def poll_due(self, now: float) -> Poll | None:
        """A poll to make now, or None: nothing to read, check or save, or too soon
        (polls keep to the poll interval, and to the backoff after a failure)."""
        if now - self.last_poll < self.poll or now < self.retry_at:
            return None
        check = set(self.recheck)
        sweep = 0
        if now >= self.sweep_at:
            n = len(self.groups)
            check |= {(self.sweep_next + i) % n for i in range(self.slice)}
            sweep = self.slice
        save = now >= self.state_at
        if not (check or save or self.due or self.pending or self.noted):
            return None
        self.last_poll = now
        return Poll(frozenset(check), save, sweep)

    def tails_for(self, poll: Poll) -> frozenset[int]:
        """The groups of ``poll.check`` whose streams' tails to read with their counters
        (:meth:`to_read`): those checked out of turn (a failover breaks the subscription
        of its slots' hints: their counters are checked at once), and the sweep's slice
        in one pass of every TAIL_EVERY (a reissued number that nothing else showed is
        found within TAIL_EVERY sweep periods)."""
        out = poll.check & self.recheck
        if poll.sweep and (self.swept // len(self.groups)) % TAIL_EVERY == 0:
            return poll.check
        return frozenset(out)

    def polled(self, poll: Poll, now: float) -> None:
        self.backoff.succeeded()
        self.recheck -= poll.check
        if poll.sweep:
            self.swept += poll.sweep
            self.sweep_next = (self.sweep_next + self.slice) % len(self.groups)
            self.sweep_at = now + self.sweep_every
        if poll.save:
            self.state_at = now + self.state_every

    def poll_failed(self, now: float) -> float:
        """L3 could not be reached; returns the delay before the next poll."""
        delay = self.backoff.failed()
        self.retry_at = now + delay
        return delay
