"""What a re-planning move costs in L3 bytes, and when it pays for itself.

A move is not free: the agent stops on one host and starts on another, and the new
process's client opens its own L3 (Redis Cluster) client at its first L2 miss — which
is at once, since it reads its own state back and its new host holds few of the keys it
reads. Measured on the 3-host dev cluster (Redis 7.0, redis-py's cluster client; see
``bench/bench_placement.py``): the cluster client's start-up is about 92 kB (``COMMAND``:
~90 kB of command table, ``CLUSTER SLOTS``, a ``HELLO`` per node), and the moved agent's
first reads from L3 on its new host a few kB more; MOVE_BYTES rounds that to 100 kB.

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
move must win). Pure functions: no clock, no I/O.
"""

from __future__ import annotations

import math

from ..errors import InvalidArgument
from .graph import Graph

MOVE_BYTES = 100_000.0  # L3 bytes one move costs (measured: see the module's docstring)
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
