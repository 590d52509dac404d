"""A fault: the :class:`Fault` base class and the registry of fault kinds (:data:`FAULTS`).

A fault is a class derived from :class:`Fault` and registered under its ``name`` with
:func:`register`::

    @register
    class PauseDaemon(Fault):
        name = "pause-daemon"
        summary = "SIGSTOP a host's node daemon; SIGCONT it at heal"
        requires = frozenset({"daemons"})   # what the target must be able to do
        hold = (0.5, 4.0)                   # seconds between inject and heal (drawn)

        def inject(self, rng):              # choose with rng only: replays from the seed
            self.host = rng.randrange(self.target.hosts)
            ...
            return "SIGSTOP host-2's daemon (pid 4242)"   # what it did, for the record

        def heal(self):                     # idempotent; "" when there was nothing to undo
            ...

One instance serves one injection: ``inject(rng)`` does the damage and returns a
description; ``heal()`` undoes it (restart what was killed, resume what was paused).
Faults that do their whole work at once (a stream trim, a burst of writes) have nothing
to heal. ``effect`` holds evidence that the fault took effect (evictions counted, entries
trimmed, seconds a failover took), so a test can assert the fault really happened.
Faults that write go through the target's recorders, so their writes are checked like
everyone else's.

The built-in faults live in :mod:`kvcomm.faults.kinds`. New ones (issue 9's partitions
through a per-host TCP proxy, etcd member kills, clock skew) are new classes, each
``@register``-ed with what it ``requires`` ("proxy", "etcd", "clock"); the runner
and ``kvcomm soak --faults`` pick them up by name without a change. A target advertises
its ``capabilities``; a fault whose requirements the target lacks is refused up front. A
fault that moves a host's clock sets ``skews_clocks = True``: the soak's checker then
drops its rule that relies on one shared clock.
"""

from __future__ import annotations

import abc
import random
from typing import Any, ClassVar, Protocol

from ..errors import InvalidArgument


class Target(Protocol):
    """What a fault acts on. ``capabilities`` names the levers it offers."""

    capabilities: frozenset[str]

    @property
    def hosts(self) -> int: ...


class Fault(abc.ABC):
    """One injection of one kind of fault (see the module docstring)."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    requires: ClassVar[frozenset[str]] = frozenset()
    hold: ClassVar[tuple[float, float]] = (0.0, 0.0)
    # True for a fault that moves a host's clock: the checker then stops assuming that
    # hosts share one clock (no real-time last-writer-wins rule)
    skews_clocks: ClassVar[bool] = False

    def __init__(self, target: Any) -> None:
        self.target = target
        self.effect: dict[str, Any] = {}

    @abc.abstractmethod
    def inject(self, rng: random.Random) -> str:
        """Do the damage, choosing only with ``rng``; returns what was done. May raise:
        the nemesis records the error and calls :meth:`heal`."""

    def heal(self) -> str:
        """Undo what :meth:`inject` did (idempotent); returns what was done, "" if nothing."""
        return ""


FAULTS: dict[str, type[Fault]] = {}


def register(cls: type[Fault]) -> type[Fault]:
    """Class decorator: make ``cls`` available by ``cls.name``. Raises InvalidArgument on
    a missing or taken name."""
    if not cls.name or cls.name in FAULTS and FAULTS[cls.name] is not cls:
        raise InvalidArgument(f"fault {cls.__name__}: name {cls.name!r} is missing or taken")
    lo, hi = cls.hold
    if not 0 <= lo <= hi:
        raise InvalidArgument(f"fault {cls.name}: hold must be (low, high) seconds, low <= high")
    FAULTS[cls.name] = cls
    return cls
