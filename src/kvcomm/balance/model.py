"""What a slot-balancing policy sees and what it decides: the interface between the
policies (``balance/policy.py``), the simulator (``balance/sim.py``) and the live driver.

A :class:`ClusterView` is one observation of a Redis Cluster: every master's capacity and
load, and the load, size and owner of each hash slot. A :class:`Policy` turns a view into
:class:`Move` s. Nothing here does I/O or reads a clock: the view carries its own time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class NodeView:
    """One Redis master as a policy sees it."""

    id: str
    capacity: float  # ops/s it serves before requests queue
    load: float  # ops/s it served over the view's window
    cpu: float  # busy fraction of its core (0..1, more when overloaded)
    memory: int  # bytes of data it holds
    latency_ms: float  # its p99 latency over the window


@dataclass(frozen=True)
class ClusterView:
    """The whole cluster at ``time`` (seconds): its masters, and per hash slot the load
    (ops/s), the bytes and the owning master's id."""

    time: float
    nodes: tuple[NodeView, ...]
    slot_load: Mapping[int, float]
    slot_bytes: Mapping[int, int]
    owner: Mapping[int, str]


@dataclass(frozen=True)
class Move:
    """Migrate hash slot ``slot`` from master ``source`` to master ``target``; ``reason``
    says why, for the log."""

    slot: int
    source: str
    target: str
    reason: str


class Policy(Protocol):
    """Decides slot moves from a view of the cluster."""

    def decide(self, view: ClusterView) -> list[Move]:
        """The moves to make now (possibly none)."""
        ...
