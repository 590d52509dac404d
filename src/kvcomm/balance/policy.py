"""Slot-balancing policies behind one interface (:class:`~.model.Policy`): a threshold
policy as in Anna, and a policy learned in the simulator (a cost model).

Both choose *which* slots to move the same way (:func:`plan_moves`): from a master over
its load limit, the hottest slots that fit, each to the master with the most room under
its limit, until the source is under its limit. Moving the hottest slot that does not
overshoot moves the fewest slots for the load shed. They differ in *when* to move and
*how far* to go:

- :class:`ThresholdPolicy` checks every ``monitor_s`` seconds; a master whose
  utilisation exceeds the mean plus ``k`` standard deviations (and ``min_utilisation``:
  an idle real cluster is left alone) is hot; once it has stayed
  hot for ``grace_s`` seconds, ``drain`` of its excess over the mean is moved to the
  coldest masters. Its knobs are tuned by search on training seeds (``train.py``).
- :class:`LearnedPolicy` considers doing nothing and a few rebalancing plans of
  increasing reach, predicts for each the latency cost over the next minutes with a
  model trained on counterfactual runs of the simulator, and takes the plan whose
  predicted cost plus a price per moved slot is lowest. The model is a JSON file of
  numbers (``balance_model.json``, which also holds the threshold policy's tuned knobs):
  no pickle, and no numpy needed to decide.

Both serve the simulator and the live driver (``kvcomm balance``) through one
contract, :mod:`kvcomm.balance.model`. Policies are deterministic and keep only their
own small state (time of the last check, how long each master has been hot, recent
loads); they never do I/O.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import InvalidArgument
from .model import ClusterView, Move, Policy

POLICIES = ("threshold", "learned")


# ---------------------------------------------------------------------- shared planning


def _pairs(mapping: Mapping[int, Any]) -> tuple[list[int], list[Any]]:
    """(keys, values) of a slot mapping, fast for the simulator's list-backed views."""
    fast = getattr(mapping, "values_list", None)
    if fast is not None:
        values = fast()
        return list(range(len(values))), values
    keys = list(mapping.keys())
    return keys, [mapping[k] for k in keys]


def slots_by_node(view: ClusterView, nodes: Iterable[str] | None = None) -> dict[str, list[int]]:
    """Each master's slots (of ``nodes``, or all), hottest first."""
    want = set(nodes) if nodes is not None else None
    slots, owners = _pairs(view.slot_node)
    out: dict[str, list[int]] = {}
    for s, o in zip(slots, owners, strict=True):
        if want is None or o in want:
            out.setdefault(o, []).append(s)
    load = view.slot_load
    for lst in out.values():
        lst.sort(key=lambda s: (-load.get(s, 0.0), s))
    return out


def plan_moves(view: ClusterView, limit: Mapping[str, float], reason: str,
               max_moves: int = 2000, overshoot: float = 1.0,
               by_node: Mapping[str, list[int]] | None = None) -> list[Move]:
    """Moves that bring every master at or under ``limit`` (ops/s per master id): from
    each master over it (the worst first), its hottest slots with load at most
    ``overshoot`` x the excess still to shed, each to the master with the most room left
    under its own limit, if the slot fits there. At most ``max_moves``. ``by_node``:
    :func:`slots_by_node` of the view, when the caller has it. Returns the moves
    (possibly none: nothing over, or nothing fits)."""
    load = {n.id: n.load for n in view.nodes}
    donors = sorted((n for n in load if load[n] > limit.get(n, math.inf)),
                    key=lambda n: load[n] - limit[n], reverse=True)
    if not donors:
        return []
    receivers = [n for n in load if load[n] < limit.get(n, math.inf)]
    if not receivers:
        return []
    if by_node is None:
        by_node = slots_by_node(view, donors)
    slot_load = view.slot_load
    moves: list[Move] = []
    for d in donors:
        excess = load[d] - limit[d]
        for s in by_node.get(d, []):
            if excess <= 0 or len(moves) >= max_moves:
                break
            ls = slot_load.get(s, 0.0)
            if ls <= 0:
                break
            if ls > overshoot * excess:
                continue
            r = max(receivers, key=lambda n: (limit.get(n, math.inf) - load[n], n))
            if load[r] + ls > limit.get(r, math.inf):
                continue
            moves.append(Move(s, d, r, reason))
            load[r] += ls
            load[d] -= ls
            excess -= ls
    return moves


def _stats(view: ClusterView) -> tuple[dict[str, float], float, float]:
    """(utilisation per master, mean, population standard deviation)."""
    util = {n.id: n.load / n.capacity if n.capacity > 0 else 0.0 for n in view.nodes}
    vals = list(util.values())
    mean = sum(vals) / len(vals) if vals else 0.0
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals)) if vals else 0.0
    return util, mean, std


# ---------------------------------------------------------------------- threshold


@dataclass(frozen=True)
class ThresholdParams:
    """The threshold policy's knobs: hot when utilisation > mean + ``k`` x std, checked
    every ``monitor_s`` s, acted on after ``grace_s`` s hot, moving ``drain`` of the
    excess over the mean; at most ``max_moves`` slots a decision."""

    k: float = 1.5
    monitor_s: float = 30.0
    grace_s: float = 30.0
    drain: float = 1.0
    max_moves: int = 2000
    # a master under this utilisation is never hot: on a real, nearly idle cluster some
    # node is always k std over the mean (an idle dev cluster's masters measure ~1%: the
    # daemons' sweeps; the walkthrough's hot master 6%)
    min_utilisation: float = 0.05

    def validate(self) -> None:
        """Raise InvalidArgument naming the first knob that is not a finite number (an
        integer for max_moves) or is out of range."""
        for name in ("k", "monitor_s", "grace_s", "drain", "max_moves", "min_utilisation"):
            v = getattr(self, name)
            if not _finite_number(v):
                raise InvalidArgument(f"threshold {name} must be a finite number, not {v!r}")
        if not isinstance(self.max_moves, numbers.Integral):
            raise InvalidArgument(f"threshold max_moves must be an integer, not {self.max_moves!r}")
        if not self.k >= 0:
            raise InvalidArgument(f"threshold k must be at least 0, not {self.k}")
        if not (self.monitor_s >= 0 and self.grace_s >= 0):
            raise InvalidArgument("threshold monitor_s and grace_s must be at least 0")
        if not 0 < self.drain <= 1:
            raise InvalidArgument(f"threshold drain must be in (0, 1], not {self.drain}")
        if not self.max_moves >= 1:
            raise InvalidArgument(f"threshold max_moves must be at least 1, not {self.max_moves}")
        if not 0 <= self.min_utilisation < 1:
            raise InvalidArgument("threshold min_utilisation must be in [0, 1), not "
                                  f"{self.min_utilisation}")


def threshold_params(model: str | Path | None = None) -> ThresholdParams:
    """The threshold knobs tuned by ``kvcomm balance train`` (search on training seeds),
    as recorded in a model file (default: the one shipped in the package). Raises
    InvalidArgument for a file without them."""
    data = _read_json(model, MODEL_FILE).get("threshold")
    if not isinstance(data, dict):
        raise InvalidArgument(f"{model or MODEL_FILE} has no tuned threshold knobs; retrain "
                              "with `kvcomm balance train`")
    try:
        params = ThresholdParams(**data)
    except TypeError as exc:
        raise InvalidArgument(f"{model or MODEL_FILE}: bad threshold knobs ({exc})") from None
    params.validate()
    return params


REACH_OF_K = 0.9  # k is capped at this fraction of the largest z-score n masters reach


class ThresholdPolicy:
    """Anna's rule on Redis masters (see the module docstring); ``params`` default to
    the tuned ones shipped in the package."""

    def __init__(self, params: ThresholdParams | None = None) -> None:
        self.params = params or threshold_params()
        self.params.validate()
        self._last_check = -math.inf
        self._hot_since: dict[str, float] = {}

    def decide(self, view: ClusterView) -> list[Move]:
        """Moves off masters hot for the grace period (none between checks)."""
        p = self.params
        if view.time - self._last_check < p.monitor_s - 1e-9:
            return []
        self._last_check = view.time
        util, mean, std = _stats(view)
        # n values reach at most sqrt(n - 1) standard deviations over their mean: a k
        # above that (1.25 on 2 masters) would never find a master hot
        bar = mean + min(p.k, REACH_OF_K * math.sqrt(max(len(util) - 1, 0))) * std
        hot = {n for n, u in util.items() if u > bar and std > 0 and u >= p.min_utilisation}
        for n in list(self._hot_since):
            if n not in hot:
                del self._hot_since[n]
        for n in hot:
            self._hot_since.setdefault(n, view.time)
        due = [n for n in hot if view.time - self._hot_since[n] >= p.grace_s - 1e-9]
        if not due:
            return []
        cap = {n.id: n.capacity for n in view.nodes}
        limit = {n: mean * cap[n] for n in util}
        for n in due:
            limit[n] = (util[n] - p.drain * (util[n] - mean)) * cap[n]
        for n in hot:
            if n not in due:
                limit[n] = math.inf  # neither a donor yet nor a receiver
        moves = plan_moves(view, limit, f"utilisation above mean {mean:.0%} + {p.k:g} std "
                           f"({std:.0%}) for {p.grace_s:g}s", p.max_moves)
        for m in moves:
            self._hot_since.pop(m.source, None)
        return moves


# ---------------------------------------------------------------------- learned

MODEL_FILE = "balance_model.json"
MODEL_FORMAT = "kvcomm-balance-learned/1"  # what train.py writes and load() accepts


def _finite_number(x: object) -> bool:
    """A real number (not a bool, not a string) that is finite."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
# the plans the learned policy chooses among: each caps every master at (1 + reach) x the
# mean utilisation; the first action is to do nothing
REACHES = (0.4, 0.2, 0.1, 0.03)
TREND_S = 30.0  # how far ahead the features project each master's recent trend


def _q(u: float) -> float:
    """M/M/1's blow-up near capacity: 1 / (1 - u), bounded."""
    return 1.0 / max(1.0 - u, 0.02)


FEATURES = ("dp99", "dp99_future", "dq_max", "dq_future", "du_max", "dpeak_future",
            "slots", "gib", "slots_x_q", "gib_x_q", "gib_x_over")


def queue_p99_ms(util: Mapping[str, float], capacity: Mapping[str, float]) -> float:
    """The p99 (ms) of the queueing part of latency over the whole cluster if each
    master were an M/M/1 queue at utilisation ``util`` of ``capacity`` ops/s, its share
    of requests its load: the x where the share of requests slower than x is 1%. A
    policy-side estimate: the simulator computes the real thing."""
    weight = {n: u * capacity[n] for n, u in util.items()}
    rates = {n: max(1.0 - u, 0.005) * capacity[n] / 1000 for n, u in util.items()}  # per ms
    total = sum(max(weight.get(n, 0.0), 0.0) for n in util)
    if total <= 0:
        return 0.0
    lo, hi = 0.0, 1000.0
    for _ in range(40):
        mid = (lo + hi) / 2
        share = sum(max(weight.get(n, 0.0), 0.0) * math.exp(-rates[n] * mid) for n in util) / total
        if share > 0.01:
            lo = mid
        else:
            hi = mid
    return hi


def plan_features(now: Mapping[str, float], after: Mapping[str, float],
                  trend: Mapping[str, float], capacity: Mapping[str, float], slots: int,
                  gib: float) -> list[float]:
    """The features of a plan (see :data:`FEATURES`), from utilisation per master now and
    after the plan, each master's trend (utilisation per second), capacity (ops/s) and
    the plan's size.
    Every feature is 0 for doing nothing, so the model predicts a plan's cost relative to
    doing nothing."""
    u_now = max(now.values())
    u_after = max(after.values())
    fut_now = max(now[n] + TREND_S * max(trend.get(n, 0.0), 0.0) for n in now)
    fut_after = max(after[n] + TREND_S * max(trend.get(n, 0.0), 0.0) for n in after)
    qn = _q(u_now)
    over = max(0.0, u_now - 0.9) * 10
    fnow = {n: now[n] + TREND_S * trend.get(n, 0.0) for n in now}
    fafter = {n: after[n] + TREND_S * trend.get(n, 0.0) for n in after}
    p99_now = queue_p99_ms(now, capacity)
    p99_fut = queue_p99_ms(fnow, capacity)
    return [queue_p99_ms(after, capacity) - p99_now, queue_p99_ms(fafter, capacity) - p99_fut,
            _q(u_after) - qn, _q(fut_after) - _q(fut_now),
            u_after - u_now, max(fut_after, 0.9) - max(fut_now, 0.9), slots / 100, gib,
            slots / 100 * qn / 10, gib * qn / 10, gib * over]


@dataclass(frozen=True)
class Candidate:
    """One option of the learned policy: its moves and its features."""

    reach: float
    moves: list[Move]
    features: list[float]


class LearnedPolicy:
    """Chooses, every decision, among doing nothing and the plans of :data:`REACHES`
    the one with the lowest predicted latency cost (a linear model over
    :func:`plan_features`, fitted by ``train.py`` on counterfactual simulator runs)
    plus ``price`` per slot moved. ``gate``: below this utilisation (now and projected)
    nothing is worth moving and no plan is computed."""

    def __init__(self, weights: Mapping[str, float], price: float, gate: float = 0.5,
                 meta: Mapping[str, Any] | None = None) -> None:
        missing = [f for f in FEATURES if f not in weights]
        if missing:
            raise InvalidArgument(f"learned model has no weight for {', '.join(missing)}; "
                                  "retrain it with `kvcomm balance train`")
        if not _finite_number(price) or price < 0:
            raise InvalidArgument(f"learned policy price must be a finite number >= 0, "
                                  f"not {price!r}")
        if not _finite_number(gate) or gate < 0:
            raise InvalidArgument(f"learned policy gate must be a finite number >= 0 (a "
                                  f"utilisation), not {gate!r}")
        bad = [f for f in FEATURES if not _finite_number(weights[f])]
        if bad:
            raise InvalidArgument(f"learned model holds weights that are not finite numbers "
                                  f"({', '.join(bad)}); retrain it with `kvcomm balance train`")
        self.weights = [float(weights[f]) for f in FEATURES]
        self.price = price
        self.gate = gate
        self.meta = dict(meta or {})
        self._history: list[tuple[float, dict[str, float]]] = []
        self.last: list[Candidate] = []  # the options of the last decision (for training)

    @classmethod
    def load(cls, model: str | Path | Mapping[str, Any] | None = None,
             price: float | None = None, gate: float | None = None) -> LearnedPolicy:
        """The policy of a model file (JSON written by ``train.py``; default: the one
        shipped in the package) or dict. Raises InvalidArgument for a malformed model."""
        data = dict(model) if isinstance(model, Mapping) else _read_json(model, MODEL_FILE)
        if data.get("format") != MODEL_FORMAT:
            raise InvalidArgument(f"learned model has format {data.get('format')!r:.40}, not "
                                  f"{MODEL_FORMAT!r}: retrain it with `kvcomm balance train` "
                                  "(or use the kvcomm that wrote it)")
        try:
            weights = data["weights"]
            p = price if price is not None else data["price"]
            g = gate if gate is not None else data.get("gate", 0.5)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"learned model is malformed ({exc!r}); retrain it with "
                                  "`kvcomm balance train`") from None
        if not isinstance(weights, Mapping):
            raise InvalidArgument("learned model's weights are not a JSON object")
        p = float(p) if _finite_number(p) else p
        g = float(g) if _finite_number(g) else g
        return cls(weights, p, g, meta={k: v for k, v in data.items() if k != "weights"})

    def trend(self, view: ClusterView) -> dict[str, float]:
        """Each master's utilisation trend (per second) over about TREND_S seconds, from
        the views seen before (recorded here)."""
        util = {n.id: n.load / n.capacity if n.capacity > 0 else 0.0 for n in view.nodes}
        self._history.append((view.time, util))
        while len(self._history) > 2 and view.time - self._history[1][0] >= TREND_S:
            self._history.pop(0)
        t0, old = self._history[0]
        span = view.time - t0
        if span <= 0:
            return {n: 0.0 for n in util}
        return {n: (u - old.get(n, u)) / span for n, u in util.items()}

    def candidates(self, view: ClusterView) -> list[Candidate]:
        """Doing nothing, then each plan of :data:`REACHES` (with its features)."""
        trend = self.trend(view)
        util, mean, _ = _stats(view)
        none = Candidate(0.0, [], [0.0] * len(FEATURES))
        future = max(util[n] + TREND_S * max(trend[n], 0.0) for n in util)
        if max(max(util.values()), future) < self.gate:
            return [none]
        cap = {n.id: n.capacity for n in view.nodes}
        out = [none]
        by_node: dict[str, list[int]] | None = None
        seen: set[tuple[Move, ...]] = set()
        for reach in REACHES:
            limit = {n: (1 + reach) * mean * cap[n] for n in util}
            if all(util[n] * cap[n] <= limit[n] for n in util):
                continue
            if by_node is None:
                by_node = slots_by_node(view, [n for n in util if util[n] > (1 + REACHES[-1]) * mean])
            moves = plan_moves(view, limit, f"predicted to cut latency (reach {reach:g})",
                               by_node=by_node)
            key = tuple(moves)
            if not moves or key in seen:
                continue
            seen.add(key)
            after = {n: util[n] * cap[n] for n in util}
            nbytes = 0
            for m in moves:
                ls = view.slot_load.get(m.slot, 0.0)
                after[m.source] -= ls
                after[m.target] += ls
                nbytes += view.slot_bytes.get(m.slot, 0)
            after_u = {n: after[n] / cap[n] if cap[n] > 0 else 0.0 for n in after}
            out.append(Candidate(reach, moves, plan_features(util, after_u, trend, cap,
                                                             len(moves), nbytes / 2**30)))
        return out

    def score(self, c: Candidate) -> float:
        """Predicted latency cost relative to doing nothing, plus the price of its moves."""
        return sum(w * f for w, f in zip(self.weights, c.features, strict=True)) + \
            self.price * len(c.moves)

    def decide(self, view: ClusterView) -> list[Move]:
        """The moves of the candidate with the lowest score (ties: fewer moves)."""
        self.last = self.candidates(view)
        best = min(self.last, key=lambda c: (self.score(c), len(c.moves)))
        return list(best.moves)


# ---------------------------------------------------------------------- factory


def make_policy(name: str, **params: Any) -> Policy:
    """The policy ``name`` (one of :data:`POLICIES`) with knobs ``params`` (for
    threshold: those of ThresholdParams; for learned: ``model`` (a path or dict) and
    ``price``). Raises InvalidArgument for an unknown name or knob."""
    if name == "threshold":
        try:
            tp = ThresholdParams(**{**threshold_params().__dict__, **params})
        except TypeError as exc:
            raise InvalidArgument(f"threshold policy: {exc}") from None
        return ThresholdPolicy(tp)
    if name == "learned":
        try:
            return LearnedPolicy.load(**params)
        except TypeError as exc:
            raise InvalidArgument(f"learned policy: {exc}") from None
    raise InvalidArgument(f"unknown policy {name!r}: choose one of {', '.join(POLICIES)}")


def _read_json(path: str | Path | None, default: str) -> dict[str, Any]:
    """A JSON object from ``path`` or this package's data file ``default``. Raises
    InvalidArgument when it cannot be read or is not a JSON object."""
    try:
        if path is None:
            text = resources.files("kvcomm.balance").joinpath(default).read_text()
        else:
            text = Path(path).read_text()
        data = json.loads(text)
    except (OSError, ValueError, RecursionError) as exc:  # (RecursionError: nested too deep)
        raise InvalidArgument(f"cannot read the balancing model {path or default}: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidArgument(f"{path or default} does not hold a JSON object")
    return data
