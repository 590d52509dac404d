"""A slot-level model of a Redis Cluster under a workload, driven by a balancing policy.

Theory of operation. Time advances in ticks of ``dt`` seconds (1 s). Each tick:

1. The workload gives every hash slot's request rate (ops/s).
2. Each master serves the slots it owns. A slot being migrated is split: the keys already
   moved are asked for at the source, which answers ``-ASK`` (costing it the request
   anyway), and then at the target, paying one more round trip (``redirect_ms``).
   Migrating also costs both ends CPU per byte moved (``migrate_ops_per_kb``): DUMP on
   one side, RESTORE on the other.
3. Latency per master is M/M/1 with service rate = capacity: a request's response time is
   ``base_ms`` (network and parsing) + the wait behind the backlog (when arrivals
   exceeded capacity, the backlog grows by the excess and drains at the spare capacity;
   clients give up after ``max_wait_s``) + an exponential sojourn of rate
   ``capacity - arrivals`` (floored at ``min_spare`` of capacity, where M/M/1 has no
   steady state). The cluster's latency
   is the mixture of the masters' weighted by the requests each served; its p99 per tick
   decides an SLO violation (``slo_ms``), and the whole run's distribution (accumulated on
   a log-spaced grid) gives the reported p50 and p99.
4. Migrations progress: each source master migrates its queued slots one at a time (as
   ``CLUSTER SETSLOT`` + ``MIGRATE`` do), each taking ``slot_overhead_s`` + its bytes /
   ``migrate_bytes_per_s``; a slot changes owner when its last key has moved.
Runs start from ``redis-cli --cluster create``'s contiguous slot ranges, which a hot
range can overload; the first ``warmup_s`` seconds let the policy settle from there and
are not measured (neither latency nor moves): a run measures ``minutes`` after that.

5. Every ``decide_every`` seconds, when no migration is in flight (a driver decides,
   migrates, then looks again), the policy sees a :class:`~.model.ClusterView` of the
   loads averaged over the last ``decide_every`` seconds and returns moves, which are
   checked (:class:`InvalidMove`) and queued.

Everything random comes from one ``numpy.random.Generator`` seeded by the run's seed
(the workload has its own child generator), so a run is a function of (config, workload,
policy, seed). Nothing reads a clock. The simulator needs numpy (``kvcomm[numpy]``).
"""

from __future__ import annotations

import copy
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgument, KVCommError
from .model import SLOTS, ClusterView, Move, NodeView, Policy, SlotArray

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from .workloads import Workload

    FloatArray = npt.NDArray[np.float64]
    IntArray = npt.NDArray[np.int64]

_LN100 = math.log(100)


class InvalidMove(KVCommError, ValueError):
    """A policy asked to move a slot its source does not own, to a master that does not
    exist, or a slot already being moved; the run stops with nothing else changed."""


def need_numpy(purpose: str = "the slot-balancing simulator") -> None:
    """Raise ConfigError naming ``pip install 'kvcomm[numpy]'`` when numpy is missing."""
    from .._extras import require

    require("numpy", extra="numpy", purpose=purpose)


@dataclass(frozen=True)
class SimConfig:
    """The modelled cluster and how a run is measured (every knob has a realistic
    default; sizes in bytes, rates in ops/s, times in seconds unless named _ms)."""

    nodes: int = 8
    minutes: float = 30.0
    slots: int = SLOTS
    capacity: float = 50_000.0
    base_ms: float = 0.3
    min_spare: float = 0.005
    slo_ms: float = 10.0
    dt: float = 1.0
    decide_every: float = 10.0
    mean_slot_bytes: float = 2 * 2**20
    slot_bytes_sigma: float = 0.6
    migrate_bytes_per_s: float = 20e6
    migrate_ops_per_kb: float = 0.25
    slot_overhead_s: float = 0.05
    redirect_ms: float = 0.3
    max_wait_s: float = 1.0
    warmup_s: float = 120.0

    def validate(self) -> None:
        """Raise InvalidArgument naming the first knob out of range."""
        if not 2 <= self.nodes <= 1000:
            raise InvalidArgument(f"nodes must be 2 to 1000, not {self.nodes}")
        if not 1 <= self.slots <= SLOTS or self.slots < self.nodes:
            raise InvalidArgument(f"slots must be {self.nodes} to {SLOTS}, not {self.slots}")
        if not 0 < self.minutes <= 24 * 60:
            raise InvalidArgument(f"minutes must be over 0 and at most a day, not {self.minutes}")
        if not 0 < self.slo_ms < math.inf:  # (an infinite one would print as non-JSON)
            raise InvalidArgument(f"slo_ms must be positive and finite, not {self.slo_ms}")
        if 0 < self.dt and self.minutes * 60 < self.dt:
            raise InvalidArgument(f"minutes must be at least one tick ({self.dt:g} s: "
                                  f"{self.dt / 60:.4g} min), not {self.minutes}")
        for name in ("capacity", "base_ms", "dt", "decide_every", "mean_slot_bytes",
                     "migrate_bytes_per_s", "min_spare", "max_wait_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"{name} must be positive, not {getattr(self, name)}")
        for name in ("slot_bytes_sigma", "migrate_ops_per_kb", "slot_overhead_s", "redirect_ms",
                     "warmup_s"):
            if not getattr(self, name) >= 0:
                raise InvalidArgument(f"{name} must be at least 0, not {getattr(self, name)}")


@dataclass
class SimResult:
    """What a run measured (``summary()`` is the CLI's JSON object)."""

    policy: str
    workload: str
    seed: int
    nodes: int
    seconds: float
    migrations: int = 0
    bytes_moved: int = 0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    slo_violation_s: float = 0.0
    max_node_load: float = 0.0
    mean_max_node_load: float = 0.0
    decisions: int = 0
    migrating_s: float = 0.0
    moved: list[tuple[float, int, int, int, int]] = field(default_factory=list)
    trace: dict[str, list[float]] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """The scalar figures as a JSON-ready dict (no per-move log, no trace)."""
        out = asdict(self)
        out.pop("moved")
        out.pop("trace")
        return out


@dataclass
class _Migration:
    slot: int
    source: int
    target: int
    seconds: float
    done: float = 0.0


class Simulator:
    """One run: a cluster, a workload and a policy. :meth:`run` returns the result;
    :meth:`step` and :meth:`snapshot` let training branch a run (see ``train.py``)."""

    def __init__(self, config: SimConfig, workload: str | Workload, seed: int,
                 policy: Policy | None = None, policy_name: str = "", *,
                 trace: bool = False, workload_params: Mapping[str, float] | None = None) -> None:
        need_numpy()
        import numpy as np

        from .workloads import make_workload

        config.validate()
        if not isinstance(seed, int) or seed < 0:
            raise InvalidArgument(f"seed must be a non-negative integer, not {seed!r}")
        self.np = np
        self.config = c = config
        self.seconds = c.warmup_s + c.minutes * 60
        root = np.random.default_rng(seed)
        wl_rng, own_rng = root.spawn(2)
        self.rng = own_rng
        if isinstance(workload, str):
            workload = make_workload(workload, wl_rng, slots=c.slots, nodes=c.nodes,
                                     capacity=c.capacity, seconds=self.seconds,
                                     **dict(workload_params or {}))
        self.workload = workload
        self.policy = policy
        self.ids = [f"n{i}" for i in range(c.nodes)]
        self.capacity: FloatArray = np.full(c.nodes, c.capacity)
        # contiguous ranges, as `redis-cli --cluster create` assigns them
        self.owner: IntArray = (np.arange(c.slots) * c.nodes // c.slots).astype(np.int64)
        sizes = own_rng.lognormal(0.0, c.slot_bytes_sigma, c.slots)
        self.slot_bytes: IntArray = np.maximum(
            1, np.round(sizes / sizes.mean() * c.mean_slot_bytes)).astype(np.int64)
        self.backlog: FloatArray = np.zeros(c.nodes)
        self.queues: list[deque[_Migration]] = [deque() for _ in range(c.nodes)]
        self.in_flight: set[int] = set()
        self.t = 0.0
        self.next_decision = c.decide_every
        # the latency grid: log-spaced from 0.1 ms to 60 s (9% apart)
        self.grid_ms: FloatArray = np.geomspace(0.1, 60_000.0, 150)
        self._comps: list[tuple[FloatArray, FloatArray, FloatArray]] = []
        self._order: IntArray | None = None
        self._starts: IntArray = np.zeros(0, dtype=np.int64)
        self._empty = np.zeros(0, dtype=bool)
        self.w_ticks = 0
        self._last_window: tuple[FloatArray, FloatArray, FloatArray, FloatArray, int] | None = None
        self._reset_window()
        self.result = SimResult(policy=policy_name, workload=self.workload.name, seed=seed,
                                nodes=c.nodes, seconds=c.minutes * 60)
        self._max_load_sum = 0.0
        self._ticks = 0
        self._trace = trace
        if trace:
            self.result.trace = {k: [] for k in ("t", "max_load", "mean_load", "moves")}

    # ------------------------------------------------------------------ one tick

    def _reset_window(self) -> None:
        np = self.np
        if self.w_ticks:  # (an empty window's view is the last full one)
            self._last_window = (self.w_slot, self.w_load, self.w_cpu, self.w_lat, self.w_ticks)
        self.w_slot: FloatArray = np.zeros(self.config.slots)
        self.w_load: FloatArray = np.zeros(self.config.nodes)
        self.w_cpu: FloatArray = np.zeros(self.config.nodes)
        self.w_lat: FloatArray = np.zeros(self.config.nodes)
        self.w_ticks = 0

    def _node_loads(self, rates: FloatArray) -> FloatArray:
        """Ops/s each master serves, by owner (the slot order is kept sorted by owner
        and rebuilt only when an owner changes: a weighted bincount costs 10x more)."""
        np = self.np
        if self._order is None:
            self._order = np.argsort(self.owner, kind="stable")
            counts = np.bincount(self.owner, minlength=self.config.nodes)
            self._starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
            self._empty = counts == 0
        sums: FloatArray = np.add.reduceat(rates[self._order], self._starts)
        if self._empty.any():  # reduceat gives the next element for an empty range
            sums[self._empty] = 0.0
        return sums

    def step(self) -> None:
        """Advance one tick (and let the policy decide when one is due)."""
        np, c = self.np, self.config
        dt = c.dt
        n = c.nodes
        rates = self.workload.rates(self.t, dt)
        load = self._node_loads(rates)
        total = load.copy()  # + migration CPU, in ops/s
        # mixture components: one per master, then one per migration's redirected requests
        w = np.zeros(2 * n)
        w[:n] = load
        red_src: list[int] = []
        red_tgt: list[int] = []
        busy = 0.0
        mig_rate = c.migrate_bytes_per_s * c.migrate_ops_per_kb / 1024
        for q in self.queues:
            if not q:
                continue
            m = q[0]
            f = m.done / m.seconds if m.seconds > 0 else 1.0
            r = float(rates[m.slot]) * f
            # the source still answers those requests (-ASK), the target serves them
            total[m.target] += r + mig_rate
            total[m.source] += mig_rate
            w[m.source] -= r
            w[n + len(red_tgt)] = r
            red_src.append(m.source)
            red_tgt.append(m.target)
            busy = dt
        old = self.backlog
        # clients time out after max_wait_s: the backlog never holds more than that
        self.backlog = np.clip(old + (total - self.capacity) * dt, 0.0, self.capacity * c.max_wait_s)
        wait_ms = (old + self.backlog) * (500.0 / self.capacity)
        spare = np.maximum(self.capacity - total, c.min_spare * self.capacity)
        shift = c.base_ms + wait_ms
        sh = np.empty(2 * n)
        sh[:n] = shift
        k = np.empty(2 * n)
        k[:n] = spare
        if red_tgt:
            sh[n:n + len(red_tgt)] = shift[red_tgt] + c.redirect_ms
            k[n:n + len(red_tgt)] = spare[red_tgt]
        util = load / self.capacity
        res = self.result
        peak = float(util.max())
        if self.t >= c.warmup_s:
            used = n + len(red_tgt)
            self._comps.append((w[:used], sh[:used], k[:used] / 1000.0))  # latency: at the end
            if peak > res.max_node_load:
                res.max_node_load = peak
            self._max_load_sum += peak
            self._ticks += 1
            res.migrating_s += busy
        self.w_slot += rates
        self.w_load += load
        self.w_cpu += total / self.capacity
        self.w_lat += shift + _LN100 * 1000.0 / spare
        self.w_ticks += 1
        if self._trace and self.t >= c.warmup_s:
            tr = res.trace
            tr["t"].append(self.t)
            tr["max_load"].append(peak)
            tr["mean_load"].append(float(util.mean()))
            tr["moves"].append(float(res.migrations))
        self._advance_migrations(dt)
        self.t += dt
        if self.t + 1e-9 >= self.next_decision:
            self.next_decision += c.decide_every
            if not self.in_flight and self.policy is not None:
                self.apply(self.policy.decide(self.view()))
            self._reset_window()

    def latency(self, first: int = 0) -> tuple[FloatArray, FloatArray, float]:
        """(p99 ms of each tick from tick ``first`` on, requests slower than each point
        of ``grid_ms`` over those ticks, their request count)."""
        np = self.np
        g = self.grid_ms
        comps = self._comps[first:]
        p99 = np.zeros(len(comps))
        tail = np.zeros_like(g)
        requests = 0.0
        dt = self.config.dt
        for lo in range(0, len(comps), 256):
            chunk = comps[lo:lo + 256]
            width = max(len(c[0]) for c in chunk)
            w = np.zeros((len(chunk), width))
            sh = np.zeros((len(chunk), width))
            k = np.ones((len(chunk), width))
            for j, (cw, cs, ck) in enumerate(chunk):
                w[j, :len(cw)] = cw
                sh[j, :len(cw)] = cs
                k[j, :len(cw)] = ck
            over = np.exp(-np.maximum(g[None, None, :] - sh[:, :, None], 0.0) * k[:, :, None])
            t = np.einsum("tc,tcg->tg", w, over)  # ops/s slower than each point, per tick
            wsum = w.sum(axis=1)
            p99[lo:lo + len(chunk)] = _quantiles(g, t, wsum, 0.99)
            tail += t.sum(axis=0) * dt
            requests += float(wsum.sum()) * dt
        return p99, tail, requests

    def _advance_migrations(self, dt: float) -> None:
        for q in self.queues:
            budget = dt
            while q and budget > 0:
                m = q[0]
                use = min(budget, m.seconds - m.done)
                m.done += use
                budget -= use
                if m.done >= m.seconds - 1e-12:
                    q.popleft()
                    self.owner[m.slot] = m.target
                    self._order = None
                    self.in_flight.discard(m.slot)
                    if self.t >= self.config.warmup_s:  # the settling moves are not counted
                        b = int(self.slot_bytes[m.slot])
                        self.result.migrations += 1
                        self.result.bytes_moved += b
                        self.result.moved.append((self.t + dt - budget, m.slot, m.source, m.target, b))

    # ------------------------------------------------------------------ the policy's side

    def view(self) -> ClusterView:
        """What a policy sees now: loads averaged over the window since the last
        decision point (right at a decision point, over the window that just ended)."""
        w_slot, w_load, w_cpu, w_lat, n = (
            (self.w_slot, self.w_load, self.w_cpu, self.w_lat, self.w_ticks)
            if self.w_ticks or self._last_window is None else self._last_window)
        n = max(n, 1)
        nodes = []
        mem = self.np.bincount(self.owner, weights=self.slot_bytes, minlength=self.config.nodes)
        for i, nid in enumerate(self.ids):
            nodes.append(NodeView(id=nid, capacity=float(self.capacity[i]),
                                  load=float(w_load[i] / n), cpu=float(w_cpu[i] / n),
                                  memory=int(mem[i]), latency_ms=float(w_lat[i] / n)))
        ids = self.ids
        return ClusterView(
            time=self.t, nodes=tuple(nodes),
            slot_load=SlotArray((w_slot / n).tolist()),
            slot_bytes=SlotArray(self.slot_bytes.tolist()),
            slot_node=SlotArray([ids[o] for o in self.owner.tolist()]))

    def apply(self, moves: Sequence[Move]) -> None:
        """Check and queue ``moves``. Raises InvalidMove (nothing queued) when one moves a
        slot its source does not own, to an unknown master or itself, or twice."""
        index = {nid: i for i, nid in enumerate(self.ids)}
        seen: set[int] = set()
        queued: list[_Migration] = []
        c = self.config
        for m in moves:
            if not isinstance(m, Move) or not isinstance(m.slot, int) or not 0 <= m.slot < c.slots:
                raise InvalidMove(f"not a move of a slot 0..{c.slots - 1}: {m!r}")
            src, dst = index.get(m.source), index.get(m.target)
            if src is None or dst is None or src == dst:
                raise InvalidMove(f"move of slot {m.slot} between unknown or equal masters: {m!r}")
            if int(self.owner[m.slot]) != src:
                raise InvalidMove(f"slot {m.slot} is owned by {self.ids[int(self.owner[m.slot])]},"
                                  f" not {m.source}: {m!r}")
            if m.slot in seen or m.slot in self.in_flight:
                raise InvalidMove(f"slot {m.slot} is already being moved: {m!r}")
            seen.add(m.slot)
            secs = c.slot_overhead_s + float(self.slot_bytes[m.slot]) / c.migrate_bytes_per_s
            queued.append(_Migration(m.slot, src, dst, secs))
        for mig in queued:
            self.queues[mig.source].append(mig)
            self.in_flight.add(mig.slot)
        self.result.decisions += 1
        if self._trace and moves:
            self.result.trace.setdefault("decided", []).append(self.t)

    # ------------------------------------------------------------------ whole runs

    def done(self) -> bool:
        """True once the run's time is up."""
        return self.t + 1e-9 >= self.seconds

    def run(self) -> SimResult:
        """Step to the end and return the result (p50 and p99 filled in)."""
        while not self.done():
            self.step()
        return self.finish()

    def finish(self) -> SimResult:
        """Fill in the run-level figures (latency, SLO violations) from the ticks so far."""
        np = self.np
        res = self.result
        p99, tail, requests = self.latency()
        one = np.array([requests])
        res.p99_ms = float(_quantiles(self.grid_ms, tail[None, :], one, 0.99)[0])
        res.p50_ms = float(_quantiles(self.grid_ms, tail[None, :], one, 0.50)[0])
        res.slo_violation_s = float((p99 > self.config.slo_ms).sum()) * self.config.dt
        res.mean_max_node_load = self._max_load_sum / max(self._ticks, 1)
        if self._trace:
            res.trace["p99_ms"] = p99.tolist()
        return res

    def snapshot(self, policy: bool = True) -> Simulator:
        """An independent copy of the state (workload, generators and, if ``policy``,
        the policy included; else the copy has none): stepping it does not affect this
        one. Its latency record starts empty, so its :meth:`latency` covers only the ticks
        stepped after the copy."""
        new = copy.copy(self)
        new.workload = copy.deepcopy(self.workload)
        new.policy = copy.deepcopy(self.policy) if policy else None
        new.rng = copy.deepcopy(self.rng)
        new.owner = self.owner.copy()
        new.backlog = self.backlog.copy()
        new.queues = [deque(_Migration(m.slot, m.source, m.target, m.seconds, m.done) for m in q)
                      for q in self.queues]
        new.in_flight = set(self.in_flight)
        new.w_slot, new.w_load = self.w_slot.copy(), self.w_load.copy()
        new.w_cpu, new.w_lat = self.w_cpu.copy(), self.w_lat.copy()
        new._comps = []
        new.result = copy.copy(self.result)
        new.result.moved = list(self.result.moved)
        new.result.trace = {k: list(v) for k, v in self.result.trace.items()}
        return new


def _quantiles(grid: FloatArray, tail: FloatArray, total: FloatArray, q: float) -> FloatArray:
    """Per row of ``tail`` (requests slower than each grid point, non-increasing), the
    latency (ms) below which a fraction ``q`` of the row's ``total`` requests fall;
    log-linear between grid points, 0 for a row without requests."""
    import numpy as np

    want = (1 - q) * total
    below = tail <= want[:, None]
    i = np.where(below.any(axis=1), below.argmax(axis=1), len(grid) - 1)
    lo = np.maximum(i - 1, 0)
    rows = np.arange(len(i))
    t0, t1 = tail[rows, lo], tail[rows, i]
    with np.errstate(divide="ignore", invalid="ignore"):
        frac = (np.log(t0) - np.log(want)) / (np.log(t0) - np.log(t1))
    ok = (i > 0) & (t0 > t1) & (t1 > 0) & np.isfinite(frac)
    frac = np.where(ok, np.clip(frac, 0.0, 1.0), 1.0)
    lg = np.log(grid)
    out: FloatArray = np.exp(lg[lo] + frac * (lg[i] - lg[lo]))
    return np.where(total > 0, out, 0.0)


def simulate(policy: str | Policy, workload: str, seed: int, *, config: SimConfig | None = None,
             policy_params: Mapping[str, Any] | None = None, trace: bool = False) -> SimResult:
    """Run ``workload`` under ``policy`` (a name for :func:`~.policy.make_policy` or a
    Policy) with ``seed``. Returns the SimResult. Raises InvalidArgument for a bad name
    or knob, ConfigError when numpy is not installed, InvalidMove for a policy bug."""
    from .policy import make_policy

    config = config or SimConfig()
    if isinstance(policy, str):
        name = policy
        pol: Policy = make_policy(policy, **dict(policy_params or {}))
    else:
        name, pol = type(policy).__name__, policy
    return Simulator(config, workload, seed, pol, name, trace=trace).run()
