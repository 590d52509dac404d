"""The nemesis: pluggable faults, a schedule drawn from a seed, a record of what it did.

Faults are :mod:`kvcomm.faults.fault`'s (the base class and the registry); the built-in
ones live in :mod:`kvcomm.faults.kinds`.

Schedule and replay
-------------------
:func:`plan` turns a seed into an endless sequence of steps: first every enabled kind
once, in a seeded order (so even a short run exercises them all), then kinds drawn at
random; each step with its gap before injection, its hold before heal and its own seed
for the fault's choices (which host, which group). The same seed and the same kinds give
the same steps: the same faults, the same targets, the same timing. :class:`Nemesis`
runs steps one at a time until its time is up (and, by default, every kind has run
once), records each :class:`Injection` with its times, and heals whatever is still
active on the way out, whatever happens.
"""

from __future__ import annotations

import random
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import InvalidArgument
from .fault import FAULTS, Fault, Target


def fault_kinds() -> list[str]:
    """Every registered fault name (the built-in ones included), sorted."""
    from .kinds import DevFault  # noqa: F401  (importing kinds registers the built-in faults)

    return sorted(FAULTS)


@dataclass(frozen=True, slots=True)
class Step:
    index: int
    kind: str
    gap: float  # seconds to wait before injecting
    hold: float  # seconds between inject and heal
    seed: int  # the fault's own choices


def plan(seed: int, kinds: Sequence[str], gap: tuple[float, float] = (0.5, 3.0),
         forced: Sequence[str] = ()) -> Iterator[Step]:
    """The endless schedule of ``seed`` over ``kinds`` (see the module docstring); the
    kinds of ``forced`` come first, in that order (``kvcomm jepsen --partitions N``: N
    partitions in a row), each also counted among ``kinds``."""
    names = sorted(set(kinds) | set(forced))
    if not names:
        raise InvalidArgument("the nemesis needs at least one fault kind")
    unknown = [k for k in names if k not in FAULTS]
    if unknown:
        raise InvalidArgument(f"unknown fault kinds {unknown}; known: {sorted(FAULTS)}")
    rng = random.Random(seed)
    first = list(names)
    rng.shuffle(first)
    first = [*forced, *first]
    i = 0
    while True:
        kind = first[i] if i < len(first) else rng.choice(names)
        lo, hi = FAULTS[kind].hold
        yield Step(i, kind, rng.uniform(*gap), rng.uniform(lo, hi), rng.getrandbits(63))
        i += 1


@dataclass
class Injection:
    """One step as it ran: times are seconds since the nemesis started."""

    step: int
    kind: str
    seed: int
    at: float
    description: str = ""
    healed_at: float | None = None
    heal_description: str = ""
    effect: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Nemesis:
    """Runs the schedule of ``seed`` over ``kinds`` against ``target``.

    Raises InvalidArgument for an unknown kind or one the target cannot serve.
    """

    def __init__(self, target: Target, kinds: Sequence[str] | None = None,
                 seed: int | None = None, *, gap: tuple[float, float] = (0.5, 3.0),
                 log: Callable[[str], None] | None = None, forced: Sequence[str] = ()) -> None:
        all_kinds = fault_kinds()
        self.forced = list(forced)  # injected first, in this order, whatever the time
        self.kinds = sorted(set(kinds) | set(self.forced)) if kinds is not None else all_kinds
        for k in self.kinds:
            if k not in FAULTS:
                raise InvalidArgument(f"unknown fault kind {k!r}; known: {', '.join(all_kinds)}")
            missing = FAULTS[k].requires - target.capabilities
            if missing:
                raise InvalidArgument(f"fault {k!r} needs {sorted(missing)}, which this "
                                      f"cluster does not have")
        self.target = target
        self.seed = seed if seed is not None else random.SystemRandom().getrandbits(32)
        self.gap = gap
        self.log = log or (lambda line: None)
        self.record: list[Injection] = []
        self._active: list[tuple[Fault, Injection]] = []
        self.heal_failures: list[str] = []
        self._t0 = time.monotonic()

    def _now(self) -> float:
        return time.monotonic() - self._t0

    def run(self, seconds: float, stop: threading.Event | None = None,
            every_kind_once: bool = True) -> list[Injection]:
        """Inject, hold, heal, step after step, for ``seconds`` (and, with
        ``every_kind_once``, at least until every kind has run once), and in any case
        until the ``forced`` steps have run. Stops early when a heal fails. Everything is
        healed when this returns or raises. Returns the record."""
        stop = stop or threading.Event()
        self._t0 = time.monotonic()
        must = len(self.forced) + (len(self.kinds) if every_kind_once else 0)
        try:
            for step in plan(self.seed, self.kinds, self.gap, self.forced):
                time_up = self._now() >= seconds
                if stop.is_set() or (time_up and step.index >= must):
                    break
                if stop.wait(step.gap):
                    break
                self._inject(step)
                stop.wait(step.hold)
                self.heal_all()
                if self.heal_failures:
                    self.log(f"[{self._now():7.1f}s] a fault could not be healed: no more "
                             "faults (the cluster stays damaged)")
                    break
        finally:
            self.heal_all()
        return self.record

    def _inject(self, step: Step) -> None:
        fault = FAULTS[step.kind](self.target)
        inj = Injection(step.index, step.kind, step.seed, round(self._now(), 3))
        self.record.append(inj)
        self._active.append((fault, inj))
        try:
            inj.description = fault.inject(random.Random(step.seed))
        except Exception as exc:  # recorded: a fault that cannot be injected is reported
            inj.error = f"{type(exc).__name__}: {exc}"
            self.log(f"[{inj.at:7.1f}s] {step.kind}: FAILED to inject: {inj.error}\n"
                     + traceback.format_exc(limit=3))
        else:
            self.log(f"[{inj.at:7.1f}s] {step.kind}: {inj.description}")
        inj.effect = fault.effect

    def heal_all(self) -> None:
        """Heal every active fault, most recent first. A heal that fails is recorded in
        the injection's ``error`` and in :attr:`heal_failures` (the cluster may be left
        damaged: a soak reports it as a failure)."""
        while self._active:
            fault, inj = self._active.pop()
            try:
                inj.heal_description = fault.heal()
            except Exception as exc:
                msg = f"heal failed: {type(exc).__name__}: {exc}"
                inj.error = f"{inj.error}; {msg}" if inj.error else msg
                self.heal_failures.append(f"{inj.kind} (step {inj.step}): {msg}")
                self.log(f"[{self._now():7.1f}s] {inj.kind}: {msg}")
            inj.healed_at = round(self._now(), 3)
            inj.effect = fault.effect
            if inj.heal_description:
                self.log(f"[{inj.healed_at:7.1f}s] {inj.kind}: healed: {inj.heal_description}")

    def counts(self) -> dict[str, int]:
        """Successful injections by kind."""
        return dict(sorted(Counter(i.kind for i in self.record if i.ok).items()))
