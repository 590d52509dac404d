"""``kvcomm placement plan``: hosts for agents, from the communication graph.

The problem: assign every agent to one of ``hosts`` so that the reads between agents on
the same host (by reads per second) are as many as possible, every host's load stays
within ``balance`` times the mean, and — when the agents already run somewhere — at most
``max_moves`` of them move, each move being worth at least ``move_cost`` reads per second
(incremental re-placement, as Orleans repartitions its actors: a plan that gains little
should not reshuffle a running system). Agents that did not name themselves (``PID@HOST``)
stay where they are: nothing could restart them elsewhere; their load and reads count.

How (graph partitioning is NP-hard; this is the usual multilevel recipe, small):

1. **Communities** — networkx's Louvain method (``louvain_communities``, seeded: the same
   graph gives the same plan) finds groups of agents that mostly read each other: a
   flock of drones, a warehouse zone. Beyond COARSEN_ABOVE agents, label propagation
   coarsens the graph first (Louvain alone grows faster than quadratically).
2. **Packing** — communities, largest load first, go whole to the host they have most
   reads with (the agents already placed there, the unnamed ones included), then the one
   most of them already run on, among the hosts with room under ``balance`` × mean; a
   community too large for any host is placed agent by agent the same way. If that does
   not balance, agents are placed one by one, largest load first, on the host with room
   they read most (list scheduling: it always balances when no agent's load exceeds
   (``balance`` − 1) × mean).
3. **Refinement** — greedy moves of single agents and swaps of pairs between hosts
   (Fiduccia–Mattheyses style), each kept only if it raises same-host reads by more than
   its cost and keeps every host within balance, until none helps or a round gains less
   than REFINE_TOL (0.1%) of all reads.

With ``max_moves``, the search starts from where the agents run: first the moves that are
unavoidable (agents on hosts not in ``hosts``) and those that restore balance, then
either refinement within the remaining moves, or the packing's plan taken one community
at a time, most gain per move first, within the budget, then refined; the better of the
two wins. Without it, the packing's plan and refinement of the current placement compete
(so a plan never predicts fewer same-host reads than a balanced current placement).
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from .._extras import require
from ..errors import InvalidArgument
from .agents import host_of_unnamed
from .graph import Graph, Move, Plan, check_host

_EPS = 1e-9
REFINE_TOL = 1e-3  # a refinement round worth less than this share of all reads ends it


class _State:
    """An assignment and what the search needs of it, kept current move by move: each
    host's load, each agent's read weight towards each host, how many agents moved. An
    agent not placed yet has host None (it counts towards no host)."""

    def __init__(self, assign: dict[str, str | None], adj: dict[str, dict[str, float]],
                 load: dict[str, float], hosts: Sequence[str], origin: dict[str, str | None]) -> None:
        self.assign, self.adj, self.load, self.hosts, self.origin = assign, adj, load, hosts, origin
        self.host_load = dict.fromkeys(hosts, 0.0)
        for a, h in assign.items():
            if h in self.host_load:
                self.host_load[h] += load[a]
        self.conn: dict[str, dict[str | None, float]] = {a: defaultdict(float) for a in assign}
        for a, nbrs in adj.items():
            for b, w in nbrs.items():
                self.conn[a][assign[b]] += w
        self.moved = sum(1 for a in assign if self._is_moved(a, assign[a]))

    def _is_moved(self, a: str, h: str | None) -> bool:
        o = self.origin.get(a)
        return o is not None and h is not None and o != h

    def move_delta(self, a: str, h: str) -> int:
        """How the number of moved agents changes if ``a`` goes to ``h``."""
        return int(self._is_moved(a, h)) - int(self._is_moved(a, self.assign[a]))

    def gain(self, a: str, h: str) -> float:
        """Same-host read weight won by moving ``a`` to ``h``."""
        c = self.conn[a]
        cur = self.assign[a]
        return c.get(h, 0.0) - (c.get(cur, 0.0) if cur is not None else 0.0)

    def move(self, a: str, h: str | None) -> None:
        old = self.assign[a]
        if old == h:
            return
        if h is not None:
            self.moved += self.move_delta(a, h)
        elif self._is_moved(a, old):
            self.moved -= 1
        self.assign[a] = h
        la = self.load[a]
        if old in self.host_load:
            self.host_load[old] -= la
        if h in self.host_load:
            self.host_load[h] += la
        for b, w in self.adj.get(a, {}).items():
            cb = self.conn[b]
            cb[old] -= w
            cb[h] += w

    def same(self) -> float:
        """Same-host read weight (each read counted once)."""
        return sum(w for a, nbrs in self.adj.items() for b, w in nbrs.items()
                   if a < b and self.assign[a] is not None and self.assign[a] == self.assign[b])


class _Problem:
    def __init__(self, graph: Graph, hosts: Sequence[str], balance: float,
                 move_cost: float, seed: int) -> None:
        # loads and read weights in units of the largest of each: sums of rates near the
        # float limit (the contract bounds them only by "finite") stay finite
        self.lscale = max((a.load for a in graph.agents), default=0.0) or 1.0
        wscale = max((e.reads_per_s for e in graph.edges), default=0.0) or 1.0
        self.graph, self.hosts, self.balance, self.seed = graph, hosts, balance, seed
        self.cost = move_cost / wscale
        self.load = {a.id: a.load / self.lscale for a in graph.agents}
        self.origin: dict[str, str | None] = {}
        self.pinned: dict[str, str] = {}
        self.movable: list[str] = []
        for a in graph.agents:
            if a.named:
                self.movable.append(a.id)
                self.origin[a.id] = a.host
            else:
                host = a.host or host_of_unnamed(a.id)
                assert host is not None
                self.pinned[a.id] = host
        adj: dict[str, dict[str, float]] = defaultdict(dict)
        for e in graph.edges:
            if e.reads_per_s > 0:
                w = e.reads_per_s / wscale
                adj[e.reader][e.writer] = adj[e.reader].get(e.writer, 0.0) + w
                adj[e.writer][e.reader] = adj[e.writer].get(e.reader, 0.0) + w
        self.adj = dict(adj)
        self.total = sum(w for nbrs in self.adj.values() for w in nbrs.values()) / 2
        on_hosts = sum(self.load[a] for a in self.movable) + sum(
            self.load[a] for a, h in self.pinned.items() if h in hosts)
        self.cap = balance * on_hosts / len(hosts)
        self.limit = self.cap * (1 + _EPS) + _EPS
        base = dict.fromkeys(hosts, 0.0)
        for pa, ph in self.pinned.items():
            if ph in base:
                base[ph] += self.load[pa]
        for h, v in base.items():
            if v > self.limit:
                raise InvalidArgument(
                    f"the unnamed agents on {h} alone have load {v * self.lscale:g}, over "
                    f"--balance {balance:g} x the mean ({self.cap * self.lscale:g}); they cannot "
                    "move (they have no name): raise --balance, or name those agents")
        for m in self.movable:
            if self.load[m] > self.limit:
                raise InvalidArgument(
                    f"agent {m!r} alone has load {self.load[m] * self.lscale:g}, over --balance "
                    f"{balance:g} x the mean host load ({self.cap * self.lscale:g}): raise "
                    "--balance or add hosts")

    def state(self, placed: dict[str, str | None]) -> _State:
        """The pinned agents where they are, the movable ones as ``placed`` says (None or
        missing: not placed)."""
        assign: dict[str, str | None] = {a: placed.get(a) for a in self.movable}
        return _State({**self.pinned, **assign}, self.adj, self.load, self.hosts, self.origin)

    def fits(self, s: _State, a: str, h: str) -> bool:
        extra = 0.0 if s.assign[a] == h else self.load[a]
        return s.host_load[h] + extra <= self.limit

    def balanced(self, s: _State) -> bool:
        return all(v <= self.limit for v in s.host_load.values()) and all(
            s.assign[a] is not None for a in self.movable)

    def score(self, s: _State) -> float:
        return s.same() - self.cost * s.moved

    # ------------------------------------------------------------------ placing

    def place(self, s: _State, a: str, budget: float = math.inf) -> bool:
        """Place ``a`` (not placed yet) on the host with room it reads most (then: its own
        host, the least loaded); False when it fits nowhere (it goes to the least loaded)."""
        best = None
        for h in self.hosts:
            if self.fits(s, a, h) and s.moved + s.move_delta(a, h) <= budget:
                key = (s.conn[a].get(h, 0.0), h == self.origin.get(a), -s.host_load[h])
                if best is None or key > best[0]:
                    best = (key, h)
        if best is None:
            s.move(a, min(self.hosts, key=lambda h: s.host_load[h]))
            return False
        s.move(a, best[1])
        return True

    def communities(self) -> list[list[str]]:
        """Louvain communities of the movable agents (read weights), largest load first."""
        nx = require("networkx", extra="placement", purpose="kvcomm placement plan")
        g = nx.Graph()
        g.add_nodes_from(self.movable)
        for a in self.movable:
            for b, w in self.adj.get(a, {}).items():
                if b in self.origin and a < b:
                    g.add_edge(a, b, weight=w)
        parts = _louvain(nx, g, self.seed)
        comms = [sorted(p) for p in parts]
        comms.sort(key=lambda c: (-sum(self.load[a] for a in c), c[0]))
        return comms

    def packed(self, comms: list[list[str]]) -> _State:
        """Step 2: communities packed whole where they read most; list scheduling when
        that does not balance."""
        s = self.state({})
        for comm in comms:
            cload = sum(self.load[a] for a in comm)
            best = None
            for h in self.hosts:
                if s.host_load[h] + cload > self.limit:
                    continue
                aff = sum(s.conn[a].get(h, 0.0) for a in comm)
                here = sum(self.load[a] + _EPS for a in comm if self.origin.get(a) == h)
                key = (aff, here, -s.host_load[h])
                if best is None or key > best[0]:
                    best = (key, h)
            for a in comm:
                if best is not None:
                    s.move(a, best[1])
                else:  # too large for any host: agent by agent
                    self.place(s, a)
        if self.balanced(s):
            return s
        s = self.state({})
        for a in sorted(self.movable, key=lambda a: (-self.load[a], a)):  # list scheduling
            self.place(s, a)
        return s

    # ------------------------------------------------------------------ improving

    def refine(self, s: _State, budget: float) -> None:
        """Step 3: single moves, then pair swaps, each kept when it gains more than its
        cost and keeps balance and the move budget; until none helps, or a round of both
        gains less than REFINE_TOL of all reads (on a graph without communities, passes
        of O(agents x hosts) each went on for hundreds of rounds of crumbs)."""
        tol = REFINE_TOL * self.total
        before = self.score(s)
        for _ in range(1000):
            if not (self._moves_pass(s, budget) | self._swaps_pass(s, budget)):
                return
            after = self.score(s)
            if after - before <= tol:
                return
            before = after

    def _moves_pass(self, s: _State, budget: float) -> bool:
        cands = []
        for a in self.movable:
            for h in self.hosts:
                if h != s.assign[a]:
                    g = s.gain(a, h) - self.cost * s.move_delta(a, h)
                    if g > _EPS:
                        cands.append((-g, a, h))
        cands.sort()
        done: set[str] = set()
        changed = False
        for _, a, h in cands:
            if a in done:
                continue
            d = s.move_delta(a, h)
            g = s.gain(a, h) - self.cost * d  # (neighbours may have moved meanwhile)
            if g > _EPS and self.fits(s, a, h) and s.moved + d <= budget:
                s.move(a, h)
                done.add(a)
                changed = True
        return changed

    def _swaps_pass(self, s: _State, budget: float, per_side: int = 16) -> bool:
        changed = False
        for i, x in enumerate(self.hosts):
            for y in self.hosts[i + 1:]:
                best = None
                eager_b = self._eager(s, y, x, per_side)  # (nothing moves until the pair's best)
                for a in self._eager(s, x, y, per_side):
                    for b in eager_b:
                        d = s.move_delta(a, y) + s.move_delta(b, x)
                        if s.moved + d > budget:
                            continue
                        la, lb = self.load[a], self.load[b]
                        if s.host_load[x] - la + lb > self.limit or s.host_load[y] - lb + la > self.limit:
                            continue
                        w = self.adj.get(a, {}).get(b, 0.0)
                        g = s.gain(a, y) + s.gain(b, x) - 2 * w - self.cost * d
                        if g > _EPS and (best is None or g > best[0]):
                            best = (g, a, b)
                if best is not None:
                    s.move(best[1], y)
                    s.move(best[2], x)
                    changed = True
        return changed

    def _eager(self, s: _State, x: str, y: str, n: int) -> list[str]:
        """The agents on ``x`` that would most like to be on ``y``."""
        on = (a for a in self.movable if s.assign[a] == x)
        return heapq.nsmallest(n, on, key=lambda a: (-s.gain(a, y), a))  # (= sorted()[:n])

    def rebalance(self, s: _State, budget: float) -> bool:
        """Move agents off hosts over balance, losing as few same-host reads as possible;
        False when the budget or the loads do not allow it."""
        for _ in range(len(self.movable) + 1):
            over = [h for h in self.hosts if s.host_load[h] > self.limit]
            if not over:
                return True
            x = max(over, key=lambda h: s.host_load[h])
            best = None
            for a in self.movable:
                if s.assign[a] != x:
                    continue
                for h in self.hosts:
                    if h != x and self.fits(s, a, h) and s.moved + s.move_delta(a, h) <= budget:
                        key = (s.gain(a, h) - self.cost * s.move_delta(a, h), self.load[a])
                        if best is None or key > best[0]:
                            best = (key, a, h)
            if best is None:
                return False
            s.move(best[1], best[2])
        return self.balanced(s)

    def guided(self, s: _State, target: _State, comms: list[list[str]], budget: float) -> None:
        """Take ``target``'s placement a community at a time (the agents of one Louvain
        community that it puts elsewhere, together), most gain per move first, within the
        budget and balance.

        Each group's trial (its gain, its moves, what it does to each host's load) is
        kept, and redone only for the groups next to one that moved: nothing else changes
        a group's gain (its own agents move only with it), and the budget and balance
        are checked against the kept moves and loads, O(hosts) a group per round, where
        trying every group again each round grew with the square of the agents."""
        away = [[a for a in c if target.assign[a] != s.assign[a]] for c in comms]
        pending = dict(enumerate(grp for grp in away if grp))
        group_of = {a: i for i, grp in pending.items() for a in grp}
        trials = {i: self._trial(s, grp, target) for i, grp in pending.items()}
        while pending:
            best = None
            for i in pending:
                g, moves, delta = trials[i]
                if g <= _EPS or s.moved + moves > budget or any(
                        s.host_load[h] + d > self.limit for h, d in delta.items()):
                    continue
                per_move = g / max(1, moves)
                if best is None or per_move > best[0]:
                    best = (per_move, i)
            if best is None:
                return
            grp = pending.pop(best[1])
            for a in grp:
                s.move(a, target.assign[a])
            near = {group_of[b] for a in grp for b in self.adj.get(a, {}) if b in group_of}
            for i in sorted(near & pending.keys()):
                trials[i] = self._trial(s, pending[i], target)

    def _trial(self, s: _State, grp: list[str], target: _State
               ) -> tuple[float, int, dict[str, float]]:
        """What moving ``grp`` where ``target`` has it would do now: (same-host reads won
        less the moves' cost, moves, each host's change of load)."""
        before = [(a, s.assign[a]) for a in grp]
        moved0, same0 = s.moved, 0.0
        loads0 = dict(s.host_load)
        for a in grp:
            same0 += s.gain(a, target.assign[a] or "")
            s.move(a, target.assign[a])
        moves = s.moved - moved0
        delta = {h: v - loads0[h] for h, v in s.host_load.items() if v != loads0[h]}
        for a, h in reversed(before):
            s.move(a, h)
        return same0 - self.cost * moves, moves, delta


COARSEN_ABOVE = 2000  # agents beyond which label propagation coarsens the graph first


def _louvain(nx: Any, g: Any, seed: int) -> list[set[str]]:
    """Louvain communities of ``g``. networkx's Louvain grows faster than quadratically
    on the sparse graphs agents make (a ring of 4,000 agents: 10 s; 100,000: hours), so
    a graph of more than COARSEN_ABOVE nodes is first coarsened by label propagation
    (linear per round: each group of agents that agree becomes one node, its inner
    reads a self-loop, as Louvain's own levels do) until it is that small or stops
    shrinking; Louvain then runs on the coarse graph and its communities are expanded."""
    members: dict[Any, list[str]] = {v: [v] for v in g}
    h = g
    while h.number_of_nodes() > COARSEN_ABOVE:
        groups = list(nx.community.asyn_lpa_communities(h, weight="weight", seed=seed))
        if len(groups) > 0.9 * h.number_of_nodes():
            break  # (no longer shrinking)
        of = {v: i for i, grp in enumerate(groups) for v in grp}
        q = nx.Graph()
        q.add_nodes_from(range(len(groups)))
        for u, v, w in h.edges(data="weight"):
            a, b = of[u], of[v]
            old = q.get_edge_data(a, b)
            q.add_edge(a, b, weight=(old["weight"] if old else 0.0) + w)
        members = {i: [m for v in grp for m in members[v]] for i, grp in enumerate(groups)}
        h = q
    parts = nx.community.louvain_communities(h, weight="weight", seed=seed)
    return [{m for v in p for m in members[v]} for p in parts]


def make_plan(graph: Graph, hosts: Sequence[str], *, balance: float = 1.1,
              max_moves: int | None = None, move_cost: float = 0.0, seed: int = 0) -> Plan:
    """Hosts for the agents of ``graph`` (see the module's docstring for how).

    ``hosts``: the host ids to use (unnamed agents stay on theirs, even one not listed).
    ``balance`` >= 1: every host's load at most this times the mean. ``max_moves``: at most
    this many agents with a host in the graph get another (None: no limit).
    ``move_cost`` >= 0: reads per second a move must win. Returns the Plan (assignment,
    moves, predicted shares). Raises InvalidArgument for bad arguments and for loads that
    cannot be balanced (an agent heavier than the bound, unnamed agents alone over it, a
    current placement that needs more than ``max_moves`` moves to balance); ConfigError
    when networkx is not installed (``pip install 'kvcomm[placement]'``).
    """
    hosts = _check_args(hosts, balance, max_moves, move_cost, seed)
    p = _Problem(graph, hosts, balance, move_cost, seed)
    budget = math.inf if max_moves is None else max_moves
    comms = p.communities()
    candidates: list[_State] = []
    # from where the agents run now: unavoidable moves, balance, then refinement
    homeless = [a for a in p.movable if p.origin[a] not in hosts]
    forced = sum(1 for a in homeless if p.origin[a] is not None)
    if forced > budget:
        raise InvalidArgument(
            f"{forced} agents run on hosts not in --hosts and must move; --max-moves is "
            f"{max_moves}: raise it to at least {forced}")
    have_hosts = len(homeless) < len(p.movable)
    if have_hosts:
        current = p.state({a: p.origin[a] for a in p.movable if a not in homeless})
        for a in sorted(homeless, key=lambda a: (-p.load[a], a)):
            p.place(current, a)
        if p.rebalance(current, budget):
            guided = p.state(dict(current.assign))
            p.refine(current, budget)
            candidates.append(current)
            target = p.packed(comms)  # the packing's plan, a community at a time
            p.refine(target, math.inf)
            p.guided(guided, target, comms, budget)
            p.refine(guided, budget)
            candidates.append(guided)
        elif max_moves is not None:
            raise InvalidArgument(
                f"the current placement is out of --balance {balance:g} and --max-moves "
                f"{max_moves} moves cannot bring every host within {p.cap * p.lscale:g}: raise "
                "--max-moves or --balance")
    if max_moves is None or not have_hosts:
        fresh = p.packed(comms)
        p.refine(fresh, budget)
        candidates.append(fresh)
    candidates = [s for s in candidates if p.balanced(s) and s.moved <= budget]
    if not candidates:
        heavy = sorted(p.load, key=p.load.__getitem__)[-3:]
        raise InvalidArgument(
            f"no placement found that keeps every host within --balance {balance:g} x the "
            f"mean load ({p.cap * p.lscale:g}); raise --balance (heaviest agents: "
            f"{', '.join(f'{a}={p.load[a] * p.lscale:g}' for a in heavy)})")
    best = max(candidates, key=lambda s: (p.score(s), -s.moved))
    return _plan_of(graph, p, best)


def _plan_of(graph: Graph, p: _Problem, s: _State) -> Plan:
    assignment: dict[str, str] = {}
    for a in graph.agents:
        h = s.assign[a.id]
        assert h is not None
        assignment[a.id] = h
    moves = tuple(Move(a, src, assignment[a]) for a in p.movable
                  if (src := p.origin[a]) is not None and src != assignment[a])
    have_hosts = any(a.host is not None for a in graph.agents)
    before = graph.share(graph.hosts()) if have_hosts else None
    return Plan(assignment, moves, graph.share(assignment), before)


def _check_args(hosts: Any, balance: Any, max_moves: Any, move_cost: Any, seed: Any) -> list[str]:
    if isinstance(hosts, str) or not isinstance(hosts, Sequence) or not hosts:
        raise InvalidArgument("hosts must be a non-empty list of host ids (--hosts h1,h2,...)")
    out = [check_host(h, "each of --hosts") for h in hosts]
    if len(set(out)) != len(out):
        raise InvalidArgument(f"--hosts lists a host twice: {','.join(out)}")
    if isinstance(balance, bool) or not isinstance(balance, int | float) or not 1 <= balance < math.inf:
        raise InvalidArgument(f"--balance must be a number >= 1 (1.1: 10% over the mean), got {balance!r}")
    if max_moves is not None and (type(max_moves) is not int or max_moves < 0):
        raise InvalidArgument(f"--max-moves must be an integer >= 0, got {max_moves!r}")
    if isinstance(move_cost, bool) or not isinstance(move_cost, int | float) \
            or not 0 <= move_cost < math.inf:
        raise InvalidArgument(f"--move-cost must be a number >= 0, got {move_cost!r}")
    if type(seed) is not int:
        raise InvalidArgument(f"seed must be an integer, got {seed!r}")
    return out
