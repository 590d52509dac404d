"""What a re-planning move costs in L3 bytes, and when it pays for itself.

A move is not free: the agent stops on one host and starts on another, and every
client opens its own L3 (Redis Cluster) client at its first L2 miss. That start-up was
about 92 kB (measured on the 3-host dev cluster, Redis 7.0: 90.2 kB of it the reply to
redis-py's ``COMMAND``, the whole command table). A client now starts with the entries
of the few commands KVCOMM routes by key (:mod:`kvcomm.metrics.wire`: 6.2 kB in all), and
a process keeps its table once per cluster. ``bench/bench_placement.py
--move-cost-only`` measures a move's pieces:

- what ``kvcomm placement launch`` does, a new process on the new host reading one key
  that host does not hold: 7.2 kB (``moved_process_reads_unheld``; 93.4 kB before);
- a client moved into a host process that already has an L3 client, reading one such
  key: 2.6 kB (``moved_agent_reads_unheld``); reading a key the host holds: 0.

:data:`MOVE_BYTES` (the launcher's, new processes) rounds the first up to 8 kB and
:data:`MOVE_BYTES_IN_PROCESS` (the bench's moves) the second to 4 kB: the start, the
first reads of the few keys an agent reads (a swarm drone: 4), and its neighbours'
first reads of its key where their host did not hold it.

What a move saves: every read per second of another agent's key whose writer is on
another host costs L3 traffic — the reader's host fetches the changes of the key it
holds (the record: about the value's bytes, plus READ_OVERHEAD of header, command and
reply framing). Not one fetch per read: the writer's window folds several writes into
one change stored, a read of a key that did not change costs nothing, and readers on
one host share a fetch. FETCH_SHARE is the fetched bytes per cross-host read over
``value + READ_OVERHEAD``, measured on the swarm bench (fetch bytes against cross-host
reads across its placements: about 120 B a read of a 256-B value, 0.35 of 352). A move
that turns ``r`` reads per second same-host (net: the plan's gain, reads won less reads
lost) saves about ``r x`` :func:`bytes_per_read` bytes a second, for as long as the
placement holds: ``horizon`` seconds — at least the time until the next re-planning
round, longer when the observed reads persist from round to round (:func:`horizon`).

So a move pays when ``r x per_read x horizon >= move_bytes``: :func:`move_cost_reads`
turns that into the planner's unit (``make_plan(move_cost=...)``: reads per second a
move must win).

The planner's gain is a prediction, and on a drifting workload only part of it shows:
measured on the swarm bench, a round predicting 53→72% was followed by ~59% observed.
:class:`Pricing` (what the launcher's loop keeps between rounds) scales the horizon by
the share of the last rounds' predicted gains that the next round's graph showed
(:func:`realized`), all from observed traffic. Pure functions: no clock, no I/O.
"""

from __future__ import annotations

import math

from ..errors import InvalidArgument
from .graph import Graph

MOVE_BYTES = 8_000.0  # L3 bytes one move of the launcher's costs (a new process: measured)
MOVE_BYTES_IN_PROCESS = 4_000.0  # the same, into a host process that has an L3 client
READ_OVERHEAD = 96.0  # L3 bytes a fetched record costs beyond its value's bytes
FETCH_SHARE = 0.35  # fetched bytes per cross-host read over (value + READ_OVERHEAD): measured
MAX_HORIZON_ROUNDS = 8.0  # a move's saving counted over at most this many rounds


def bytes_per_read(graph: Graph, overhead: float = READ_OVERHEAD,
                   share: float = FETCH_SHARE) -> float:
    """The L3 bytes one cross-host read costs: ``share`` x (the graph's value bytes per
    read, all its edges' bytes over all their reads, + ``overhead``); ``share`` x
    ``overhead`` when the graph has no reads. Raises InvalidArgument for a negative or
    non-finite ``overhead`` or ``share``."""
    _check("overhead", overhead)
    _check("share", share)
    reads = math.fsum(e.reads_per_s for e in graph.edges)
    value = math.fsum(e.bytes_per_s for e in graph.edges) / reads if reads > 0 else 0.0
    return share * ((value if math.isfinite(value) else 0.0) + overhead)


def persistence(before: Graph | None, now: Graph) -> float:
    """The share of ``now``'s reads (by reads per second) between pairs that already
    read each other as much in ``before`` (per (reader, writer): the smaller of the two
    rates): 1.0 for a graph that did not change, 0.0 when every pair is new (or there is
    no ``before``, or ``now`` has no reads)."""
    total = math.fsum(e.reads_per_s for e in now.edges)
    if before is None or total <= 0 or not math.isfinite(total):
        return 0.0
    then = {(e.reader, e.writer): e.reads_per_s for e in before.edges}
    kept = math.fsum(min(e.reads_per_s, then.get((e.reader, e.writer), 0.0)) for e in now.edges)
    return min(1.0, kept / total)


def horizon(every: float, kept: float, max_rounds: float = MAX_HORIZON_ROUNDS) -> float:
    """How long a move's saving lasts, from how much of the reads persisted from the
    previous round to this one (``kept``, :func:`persistence`): if each round keeps
    that share of the reads, a read relationship lasts ``1 / (1 - kept)`` rounds on
    average (geometric); at least one round (``every`` seconds: until the next round,
    which may undo the move), at most ``max_rounds``. Raises InvalidArgument (``every``
    not > 0, ``kept`` outside 0..1, ``max_rounds`` < 1)."""
    _check("every", every)
    if every <= 0:
        raise InvalidArgument(f"every must be seconds > 0, got {every!r}")
    if isinstance(kept, bool) or not isinstance(kept, int | float) or not 0 <= kept <= 1:
        raise InvalidArgument(f"kept must be a share within 0..1, got {kept!r}")
    _check("max_rounds", max_rounds)
    if max_rounds < 1:
        raise InvalidArgument(f"max_rounds must be >= 1, got {max_rounds!r}")
    rounds = max_rounds if kept >= 1 else min(max_rounds, 1.0 / (1.0 - kept))
    return every * max(1.0, rounds)


def move_cost_reads(graph: Graph, move_bytes: float = MOVE_BYTES, horizon: float = 4.0,
                    overhead: float = READ_OVERHEAD) -> float:
    """The reads per second a move must turn same-host to pay for its ``move_bytes``
    over ``horizon`` seconds, each read costing :func:`bytes_per_read` (``graph``'s):
    ``move_bytes / (horizon x bytes_per_read)`` (0 when ``move_bytes`` is 0; infinite
    would refuse every move: a read that costs nothing gives ``math.inf`` only when a
    move costs something). Returns it. Raises InvalidArgument (negative or non-finite
    arguments, ``horizon`` 0)."""
    _check("move_bytes", move_bytes)
    _check("horizon", horizon)
    if horizon <= 0:
        raise InvalidArgument(f"horizon must be seconds > 0, got {horizon!r}")
    if move_bytes == 0:
        return 0.0
    per = bytes_per_read(graph, overhead) * horizon
    if per <= 0:
        return math.inf
    cost = move_bytes / per
    return cost if math.isfinite(cost) else math.inf


def pays(gain_reads: float, per_read: float, horizon: float, move_bytes: float) -> bool:
    """Whether ``gain_reads`` reads per second turned same-host, ``per_read`` L3 bytes
    each, save at least ``move_bytes`` over ``horizon`` seconds."""
    return gain_reads * per_read * horizon >= move_bytes


def _check(name: str, v: float) -> None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < math.inf:
        raise InvalidArgument(f"{name} must be a finite number >= 0, got {v!r}")


MIN_PREDICTED_GAIN = 0.01  # a round's predicted share gain below this tells nothing
REALIZED_FLOOR = 0.1  # the realized share never prices moves at more than 10x the model
REALIZED_KEEP = 3  # rounds whose realized share is averaged


def realized(before: float | None, predicted: float | None, now: float | None) -> float | None:
    """The share of a round's predicted gain that the next round observed: the same-host
    share of cross-agent reads went from ``before`` to ``predicted`` in the plan, and is
    ``now`` on the next round's graph under the placement the moves made; ``(now -
    before) / (predicted - before)`` within 0..1. None when a share is unknown or the
    round predicted less than MIN_PREDICTED_GAIN (nothing to learn from)."""
    if before is None or predicted is None or now is None:
        return None
    gain = predicted - before
    if not gain >= MIN_PREDICTED_GAIN:
        return None
    return min(1.0, max(0.0, (now - before) / gain))


class Pricing:
    """What a re-planning loop learns between rounds to price moves, from the observed
    graphs only: how long reads persist (:func:`persistence` of the previous graph, the
    :func:`horizon`), and how much of what the planner predicted was then observed
    (:func:`realized`, the mean of the last REALIZED_KEEP rounds that moved agents, 1.0
    before any: the model is trusted until measured; at least REALIZED_FLOOR). A move is
    priced over the horizon times that share (:meth:`horizon`): when the plans' gains
    show up only in part — the reads drift within the round, readers on one host share
    what a move saves — moves must win more. ``every``: seconds between rounds."""

    def __init__(self, every: float, max_rounds: float = MAX_HORIZON_ROUNDS) -> None:
        horizon(every, 0.0, max_rounds)  # (validates)
        self.every, self.max_rounds = every, max_rounds
        self.previous: Graph | None = None
        self.pending: tuple[float | None, float | None] | None = None  # (before, predicted)
        self.seen: list[float] = []  # the last realized shares

    @property
    def factor(self) -> float:
        """The mean realized share of the recent rounds' predictions (1.0: none yet)."""
        if not self.seen:
            return 1.0
        return max(REALIZED_FLOOR, math.fsum(self.seen) / len(self.seen))

    def horizon(self, graph: Graph, now_share: float | None) -> float:
        """The seconds over which this round prices a move: the :func:`horizon` of the
        reads' persistence since the previous graph, times :attr:`factor` after
        learning from ``now_share`` (the same-host share of ``graph``'s reads under the
        placement the agents have now, the previous round's moves made). Returns it;
        ``graph`` becomes the previous graph."""
        if self.pending is not None:
            r = realized(*self.pending, now_share)
            if r is not None:
                self.seen = (self.seen + [r])[-REALIZED_KEEP:]
            self.pending = None
        lasts = horizon(self.every, persistence(self.previous, graph), self.max_rounds)
        self.previous = graph
        return lasts * self.factor

    def planned(self, before: float | None, predicted: float | None, moved: int) -> None:
        """Record a round's plan (its shares, and how many agents it moved): a round that
        moved agents is measured against the next round's graph."""
        self.pending = (before, predicted) if moved else None
