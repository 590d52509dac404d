"""Training the learned policy and tuning the threshold policy, in the simulator.

Theory of operation. The learned policy (:class:`~.policy.LearnedPolicy`) scores each
option (do nothing, or one of a few rebalancing plans) by a linear model of the option's
latency cost relative to doing nothing, plus a price per slot moved. Its training data
are counterfactual: at each decision point of a training run, the simulator is copied
once per option, the option is applied to the copy, and the copy runs ``horizon``
seconds on its own; the option's cost is the latency cost of those seconds (each
second: its p99 in ms, capped at the SLO, plus the SLO again if p99 broke it), plus what
the state it ends in is worth: its last seconds' cost rate held ``persist`` seconds. The run itself goes on
with the best option by those measured costs (with probability ``explore``, a random
one), so the data come from the states a good policy visits. The model is ridge
regression of (option's cost - doing nothing's cost) on the option's features: no
intercept, so doing nothing scores 0.

The threshold policy's knobs are tuned by grid search on the same training seeds for the
same objective: the latency cost of the whole run plus the same price per slot moved.

Everything is seeded: training seeds are ``seed * 1000 + i`` (held-out evaluation seeds
start at 10**6, so the two never meet), jobs run in a process pool but are combined in a
fixed order, so ``kvcomm balance train --seed S`` writes the same model for the same
``S`` (given the same numpy). The model is written as JSON numbers, never pickled.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from ..errors import InvalidArgument
from .model import ClusterView, Move
from .policy import (
    FEATURES,
    MODEL_FORMAT,
    Candidate,
    LearnedPolicy,
    ThresholdParams,
    ThresholdPolicy,
)
from .sim import SimConfig, Simulator, need_numpy
from .workloads import WORKLOADS

T = TypeVar("T")
R = TypeVar("R")

EVAL_SEED_BASE = 10**6  # held-out seeds: EVAL_SEED_BASE + i; training: seed * 1000 + i
DEFAULT_PRICE = 0.5  # ms x s of latency cost one slot move is worth (see docs/balancing.md)


@dataclass(frozen=True)
class TrainConfig:
    """How much to train: ``seeds`` runs per workload of ``sim.minutes`` minutes,
    counterfactuals of ``horizon`` s, ridge penalty ``ridge``, the threshold grid."""

    seeds: int = 4
    horizon: float = 60.0
    persist: float = 240.0
    explore: float = 0.2
    ridge: float = 1.0
    price: float = DEFAULT_PRICE
    workers: int = 2
    sim: SimConfig = SimConfig(minutes=20.0)
    grid_k: tuple[float, ...] = (0.75, 1.25, 2.0, 3.0)
    grid_monitor: tuple[float, ...] = (10.0, 30.0)
    grid_grace: tuple[float, ...] = (0.0, 30.0, 60.0)
    grid_drain: tuple[float, ...] = (0.5, 1.0)


def latency_cost(p99_ms: Sequence[float], slo_ms: float) -> float:
    """The objective's latency part over some seconds of p99 (one value per tick), in
    ms x s: each second's p99 (at most the SLO), plus the SLO again when it was broken."""
    return float(sum(min(p, slo_ms) + (slo_ms if p > slo_ms else 0.0) for p in p99_ms))


def training_seeds(seed: int, n: int) -> list[int]:
    """The training seeds of training seed ``seed``."""
    return [seed * 1000 + i for i in range(n)]


def eval_seeds(n: int) -> list[int]:
    """The held-out evaluation seeds (never among training seeds for seeds < 1000)."""
    return [EVAL_SEED_BASE + i for i in range(n)]


def pool_map(fn: Callable[[T], R], jobs: Iterable[T], workers: int) -> list[R]:
    """``[fn(j) for j in jobs]``, in ``workers`` processes when over 1 (order kept)."""
    jobs = list(jobs)
    if workers <= 1 or len(jobs) <= 1:
        return [fn(j) for j in jobs]
    import multiprocessing

    ctx = multiprocessing.get_context("fork" if hasattr(__import__("os"), "fork") else "spawn")
    with ctx.Pool(min(workers, len(jobs))) as pool:
        return pool.map(fn, jobs, chunksize=1)


# ---------------------------------------------------------------------- counterfactuals


class _Explorer:
    """The training run's policy: at each decision, branches the simulator once per
    candidate, records (features, cost relative to doing nothing), and goes on with the
    best candidate by measured cost + price (or a random one)."""

    def __init__(self, horizon: float, price: float, explore: float, rng: random.Random,
                 persist: float) -> None:
        self.persist = persist
        self.helper = LearnedPolicy({f: 0.0 for f in FEATURES}, price=0.0, gate=0.0)
        self.horizon = horizon
        self.price = price
        self.explore = explore
        self.rng = rng
        self.sim: Simulator | None = None
        self.rows: list[tuple[list[float], float]] = []

    def decide(self, view: ClusterView) -> list[Move]:
        assert self.sim is not None
        cands = self.helper.candidates(view)
        if len(cands) == 1:
            return []
        costs = [self._rollout(c) for c in cands]
        for c, cost in zip(cands[1:], costs[1:], strict=True):
            self.rows.append((c.features, cost - costs[0]))
        if self.rng.random() < self.explore:
            pick = self.rng.randrange(len(cands))
        else:
            pick = min(range(len(cands)),
                       key=lambda i: (costs[i] + self.price * len(cands[i].moves), i))
        return list(cands[pick].moves)

    def _rollout(self, c: Candidate) -> float:
        assert self.sim is not None
        branch = self.sim.snapshot(policy=False)
        branch.apply(c.moves)
        for _ in range(max(1, round(self.horizon / branch.config.dt))):
            branch.step()
        p99, _, _ = branch.latency()
        lat = p99.tolist()
        # what the end state is worth beyond the horizon: its rate, held `persist` s
        tail = lat[-10:]
        return latency_cost(lat, branch.config.slo_ms) + \
            self.persist * latency_cost(tail, branch.config.slo_ms) / len(tail)


def _collect(job: tuple[str, int, TrainConfig]) -> list[tuple[list[float], float]]:
    workload, seed, tc = job
    ex = _Explorer(tc.horizon, tc.price, tc.explore, random.Random(seed), tc.persist)
    sim = Simulator(replace(tc.sim, warmup_s=0.0), workload, seed, ex, "explore")
    ex.sim = sim
    sim.run()
    return ex.rows


def fit(rows: Sequence[tuple[Sequence[float], float]], ridge: float) -> dict[str, float]:
    """Ridge regression (no intercept) of the costs on the features, on standardised
    features; returns the weight of each feature name in original units."""
    import numpy as np

    if not rows:
        raise InvalidArgument("no training data: every decision point was below the gate")
    x = np.array([r[0] for r in rows], dtype=np.float64)
    y = np.array([r[1] for r in rows], dtype=np.float64)
    scale = np.sqrt((x * x).mean(axis=0))
    scale[scale == 0] = 1.0
    xs = x / scale
    a = xs.T @ xs + ridge * np.eye(x.shape[1])
    w = np.linalg.solve(a, xs.T @ y) / scale
    return {f: float(v) for f, v in zip(FEATURES, w, strict=True)}


# ---------------------------------------------------------------------- the threshold's grid


def _threshold_run(job: tuple[ThresholdParams, str, int, SimConfig]) -> tuple[float, int]:
    params, workload, seed, cfg = job
    sim = Simulator(cfg, workload, seed, ThresholdPolicy(params), "threshold")
    res = sim.run()
    p99, _, _ = sim.latency()
    return latency_cost(p99.tolist(), cfg.slo_ms), res.migrations


def threshold_grid(tc: TrainConfig) -> list[ThresholdParams]:
    """Every threshold configuration the search tries."""
    return [ThresholdParams(k=k, monitor_s=m, grace_s=g, drain=d) for k, m, g, d in
            itertools.product(tc.grid_k, tc.grid_monitor, tc.grid_grace, tc.grid_drain)]


def tune_threshold(seed: int, tc: TrainConfig, log: Callable[[str], None] = lambda s: None
                   ) -> tuple[ThresholdParams, list[dict[str, Any]]]:
    """The grid's configuration with the lowest objective (latency cost + price x
    slots moved, summed over every workload and training seed), and every config's
    figures."""
    grid = threshold_grid(tc)
    seeds = training_seeds(seed, tc.seeds)
    jobs = [(p, w, s, tc.sim) for p in grid for w in WORKLOADS for s in seeds]
    out = pool_map(_threshold_run, jobs, tc.workers)
    per = len(WORKLOADS) * len(seeds)
    table = []
    for i, p in enumerate(grid):
        chunk = out[i * per:(i + 1) * per]
        lat = sum(c for c, _ in chunk)
        moves = sum(m for _, m in chunk)
        table.append({**asdict(p), "latency_cost": lat, "migrations": moves,
                      "objective": lat + tc.price * moves})
    best = min(range(len(grid)), key=lambda i: (table[i]["objective"], i))
    log(f"threshold: best of {len(grid)} configs {grid[best]} objective "
        f"{table[best]['objective']:.1f}")
    return grid[best], table


# ---------------------------------------------------------------------- the whole of training


def train(seed: int, tc: TrainConfig | None = None, log: Callable[[str], None] = lambda s: None
          ) -> dict[str, Any]:
    """Collect counterfactuals on the training seeds of ``seed``, fit the model, tune
    the threshold policy. Returns the model (a JSON-ready dict: ``weights``, ``price``,
    ``gate``, ``threshold`` (the tuned knobs), and how it was made)."""
    need_numpy("training the learned balancing policy")
    tc = tc or TrainConfig()
    if not isinstance(seed, int) or not 0 <= seed < 1000:
        raise InvalidArgument(f"training seed must be an integer 0..999, not {seed!r}")
    seeds = training_seeds(seed, tc.seeds)
    jobs = [(w, s, tc) for w in WORKLOADS for s in seeds]
    rows = [r for part in pool_map(_collect, jobs, tc.workers) for r in part]
    log(f"learned: {len(rows)} counterfactual rows from {len(jobs)} runs")
    weights = fit(rows, tc.ridge)
    best, _ = tune_threshold(seed, tc, log)
    return {"format": MODEL_FORMAT, "features": list(FEATURES),
            "weights": weights, "price": tc.price, "gate": 0.5, "threshold": asdict(best),
            "trained": {"seed": seed, "seeds": seeds, "rows": len(rows),
                        "horizon": tc.horizon, "ridge": tc.ridge, "explore": tc.explore,
                        "minutes": tc.sim.minutes}}


def write_model(model: dict[str, Any], path: str | Path) -> None:
    """Write ``model`` as JSON (numbers and names only)."""
    text = json.dumps(model, indent=1, sort_keys=True, allow_nan=False)
    Path(path).write_text(text + "\n")


def _finite(x: float) -> bool:
    return math.isfinite(x)
