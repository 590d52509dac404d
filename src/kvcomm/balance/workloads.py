"""Workloads for the slot-balancing simulator: the request rate of every hash slot over
time, as a seeded generator (no clock, no global randomness).

A workload is built once per run with its own ``numpy.random.Generator`` and then asked,
tick by tick and in order, for the ops/s of each slot (:meth:`Workload.rates`). Four
kinds, each a stress a balancer meets in production:

``zipf``     key popularity Zipf(theta 0.99) over a million keys hashed to slots; the
             skew is static, so the question is how much moving it is worth (and whether
             a policy keeps moving after the cluster is as balanced as it can be).
``hotspot``  YCSB's hotspot distribution (a hot fraction of the data takes a fixed
             fraction of the operations, uniformly within each part) whose hot window of
             contiguous slots slides through the slot space, so hot slots keep arriving on
             the same node.
``diurnal``  Zipf popularity whose total load follows a compressed day (low at night, a
             peak near capacity) and whose hot keys change between day and night.
``flash``    Zipf background plus flash crowds: a few slots go from nothing to most of a
             node's capacity within seconds, hold, and decay.

On every kind each slot's rate also wanders (a slow multiplicative AR(1) noise), as real
per-slot rates do; a policy that chases it moves slots for nothing.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..errors import InvalidArgument

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    FloatArray = npt.NDArray[np.float64]

WORKLOADS = ("zipf", "hotspot", "diurnal", "flash")

ZIPF_THETA = 0.99
ZIPF_KEYS = 1_000_000


def zipf_slot_weights(rng: np.random.Generator, slots: int, keys: int = ZIPF_KEYS,
                      theta: float = ZIPF_THETA) -> FloatArray:
    """The share of all requests each slot receives when ``keys`` keys of Zipf(``theta``)
    popularity are hashed to ``slots`` slots (a seeded random slot per key, as CRC16 of
    arbitrary key names is). Returns an array summing to 1."""
    import numpy as np

    ranks = np.arange(1, keys + 1, dtype=np.float64)
    p = ranks ** -theta
    p /= p.sum()
    slot_of_key = rng.integers(0, slots, size=keys)
    w: FloatArray = np.bincount(slot_of_key, weights=p, minlength=slots).astype(np.float64)
    w /= w.sum()
    return w


class Workload:
    """Per-slot request rates over time. Subclasses set ``name`` and define :meth:`_shape`.

    ``utilisation`` is the mean total load as a fraction of the cluster's capacity
    (``nodes * capacity``); ``noise`` the standard deviation of each slot's log-rate
    wander, ``noise_tau`` its correlation time and ``noise_step`` how often it moves, in
    seconds.
    """

    name = ""

    def __init__(self, rng: np.random.Generator, *, slots: int, nodes: int, capacity: float,
                 seconds: float, utilisation: float, noise: float = 0.15,
                 noise_tau: float = 120.0, noise_step: float = 10.0) -> None:
        import numpy as np

        self.rng = rng
        self.slots = slots
        self.total_capacity = nodes * capacity
        self.capacity = capacity
        self.seconds = seconds
        self.utilisation = utilisation
        self.noise = noise
        self.noise_tau = noise_tau
        self.noise_step = noise_step
        self._log_noise: FloatArray = rng.standard_normal(slots) * noise
        self._next_noise = 0.0
        self._mult: FloatArray | None = None
        self._cached: FloatArray | None = None
        self._cache_key: int | None = None
        self._scaled: FloatArray = np.zeros(slots)
        self._scaled_for = -1.0

    def rates(self, t: float, dt: float) -> FloatArray:
        """Ops/s of every slot over the tick [t, t + dt). Call with increasing ``t``: the
        noise advances in steps of ``noise_step`` seconds. Returns a non-negative array
        the caller must not modify (it may be returned again)."""
        import numpy as np
        if t >= self._next_noise:
            steps = 0
            while t >= self._next_noise:
                self._next_noise += self.noise_step
                steps += 1
            if self._mult is not None:  # the first draw is the stationary one
                a = math.exp(-self.noise_step * steps / self.noise_tau)
                self._log_noise *= a
                self._log_noise += self.rng.standard_normal(self.slots) * (
                    self.noise * math.sqrt(1 - a * a))
            self._mult = np.exp(self._log_noise - self.noise * self.noise / 2)
            self._cache_key = None
        total, shape = self._shape(t)
        assert self._mult is not None  # drawn at t = 0
        if id(shape) != self._cache_key or self._cached is None:
            unit: FloatArray = shape * self._mult
            unit /= unit.sum()
            self._cached, self._cache_key = unit, id(shape)
            self._scaled_for = -1.0
        if total != self._scaled_for:
            self._scaled = self._cached * total
            self._scaled_for = total
        return self._scaled

    def _shape(self, t: float) -> tuple[float, FloatArray]:
        """(total ops/s, each slot's share summing to 1) at time ``t``."""
        raise NotImplementedError


class ZipfWorkload(Workload):
    """Static Zipf(0.99) skew at a constant total load."""

    name = "zipf"

    def __init__(self, rng: np.random.Generator, **kw: float) -> None:
        kw.setdefault("utilisation", 0.6)
        super().__init__(rng, **kw)  # type: ignore[arg-type]
        self.weights = zipf_slot_weights(rng, self.slots)

    def _shape(self, t: float) -> tuple[float, FloatArray]:
        return self.utilisation * self.total_capacity, self.weights


class HotspotWorkload(Workload):
    """YCSB hotspot: ``hot_fraction`` of the slots (a contiguous window) takes
    ``hot_ops`` of the operations; the window slides ``speed`` slots per second."""

    name = "hotspot"

    def __init__(self, rng: np.random.Generator, *, hot_fraction: float = 0.02,
                 hot_ops: float = 0.3, window_passes: float = 3.0, **kw: float) -> None:
        kw.setdefault("utilisation", 0.5)
        super().__init__(rng, **kw)  # type: ignore[arg-type]
        self.width = max(1, round(hot_fraction * self.slots))
        self.hot_ops = hot_ops
        # the window crosses its own width `window_passes` times over the run
        self.speed = window_passes * self.width / max(self.seconds, 1.0)
        self.start = float(rng.integers(0, self.slots))
        self._first = -1
        self._w: FloatArray | None = None

    def _shape(self, t: float) -> tuple[float, FloatArray]:
        import numpy as np
        first = int(self.start + self.speed * t) % self.slots
        if first != self._first or self._w is None:
            w = np.full(self.slots, (1 - self.hot_ops) / (self.slots - self.width))
            w[(first + np.arange(self.width)) % self.slots] = self.hot_ops / self.width
            self._first, self._w = first, w
        return self.utilisation * self.total_capacity, self._w


class DiurnalWorkload(Workload):
    """Zipf skew whose total follows a compressed day of ``period`` seconds between
    ``low`` and ``high`` utilisation, with different hot keys by day and by night."""

    name = "diurnal"

    def __init__(self, rng: np.random.Generator, *, low: float = 0.25, high: float = 0.8,
                 period: float = 1200.0, **kw: float) -> None:
        kw.setdefault("utilisation", (low + high) / 2)
        super().__init__(rng, **kw)  # type: ignore[arg-type]
        self.low, self.high, self.period = low, high, period
        self.phase = float(rng.uniform(0, 2 * math.pi))
        self.day = zipf_slot_weights(rng, self.slots)
        self.night = zipf_slot_weights(rng, self.slots)
        self._step = -1
        self._mix: FloatArray | None = None

    def _shape(self, t: float) -> tuple[float, FloatArray]:
        # the mix of day and night keys changes in 10 s steps (the total every tick)
        level = self._level(t)
        step = int(t // 10)
        if step != self._step or self._mix is None:
            lv = self._level(step * 10.0)
            self._step, self._mix = step, lv * self.day + (1 - lv) * self.night
        return (self.low + (self.high - self.low) * level) * self.total_capacity, self._mix

    def _level(self, t: float) -> float:
        return 0.5 + 0.5 * math.sin(2 * math.pi * t / self.period + self.phase)  # 0..1


class FlashWorkload(Workload):
    """Zipf background plus ``crowds`` flash crowds at random times: each puts
    ``extra`` (a fraction of the cluster's capacity) on ``width`` random slots (shares
    falling as 1/rank), ramping up over ``ramp`` s, holding ``hold`` s, then decaying with
    time constant ``decay`` s."""

    name = "flash"

    def __init__(self, rng: np.random.Generator, *, crowds: int = 2, extra: float = 0.25,
                 width: int = 16, ramp: float = 20.0, hold: float = 120.0, decay: float = 180.0,
                 **kw: float) -> None:
        kw.setdefault("utilisation", 0.45)
        super().__init__(rng, **kw)  # type: ignore[arg-type]
        import numpy as np
        self.base = zipf_slot_weights(rng, self.slots)
        self.ramp, self.hold, self.decay = ramp, hold, decay
        self.crowds: list[tuple[float, npt.NDArray[np.int64], FloatArray]] = []
        for i in range(crowds):
            # spread the starts over the run, each in its own stretch of it
            lo = self.seconds * (0.1 + 0.8 * i / crowds)
            hi = self.seconds * (0.1 + 0.8 * (i + 0.6) / crowds)
            start = float(rng.uniform(lo, hi))
            shares = 1.0 / np.arange(1, width + 1)
            shares *= extra * self.total_capacity / shares.sum()
            hit = rng.choice(self.slots, size=width, replace=False).astype(np.int64)
            self.crowds.append((start, hit, shares))

    def _intensity(self, dt: float) -> float:
        if dt < 0:
            return 0.0
        if dt < self.ramp:
            return dt / self.ramp
        if dt < self.ramp + self.hold:
            return 1.0
        return math.exp(-(dt - self.ramp - self.hold) / self.decay)

    def _shape(self, t: float) -> tuple[float, FloatArray]:
        return self.utilisation * self.total_capacity, self.base

    def rates(self, t: float, dt: float) -> FloatArray:
        out = super().rates(t, dt)
        active = [(k, idx, add) for start, idx, add in self.crowds
                  if (k := self._intensity(t - start)) > 1e-4]
        if active:
            out = out.copy()
            for k, idx, add in active:
                out[idx] += k * add
        return out


def make_workload(name: str, rng: np.random.Generator, *, slots: int, nodes: int,
                  capacity: float, seconds: float, **params: float) -> Workload:
    """The workload ``name`` (one of :data:`WORKLOADS`) for a cluster of ``nodes`` masters
    of ``capacity`` ops/s over ``seconds``; ``params`` override its knobs. Raises
    InvalidArgument for an unknown name or knob."""
    kinds: dict[str, type[Workload]] = {
        "zipf": ZipfWorkload, "hotspot": HotspotWorkload, "diurnal": DiurnalWorkload,
        "flash": FlashWorkload}
    if name not in kinds:
        raise InvalidArgument(f"unknown workload {name!r}: choose one of {', '.join(WORKLOADS)}")
    try:
        return kinds[name](rng, slots=slots, nodes=nodes, capacity=capacity, seconds=seconds,
                           **params)
    except TypeError as exc:
        raise InvalidArgument(f"workload {name!r}: {exc}") from None
