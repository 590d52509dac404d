"""What a balancing policy sees and what it decides: the one contract between the
policies (:mod:`kvcomm.balance.policy`: threshold and learned, tuned and trained in the
simulator) and the two drivers that feed them: the real cluster's
(:mod:`kvcomm.balance.driver`) and the simulator's (:mod:`kvcomm.balance.sim`).

A :class:`ClusterView` is one moment of a Redis Cluster, at the level of hash slots:
every master node (its capacity and load in operations per second, CPU, memory, latency)
and, per slot, its load, its bytes and the node that serves it. A policy turns a view
into a list of :class:`Move`\\ s (``Policy.decide``); the driver carries them out and
builds the next view. Nothing here does I/O, reads a clock or draws randomness: a view
carries its own ``time`` (seconds, monotonic, of whoever built it), so a policy with a
memory (monitor and grace periods) replays exactly from a script of views.

The simulator hands a policy every one of its 16,384 slots each decision: it passes
:class:`SlotArray`\\ s (slot i at index i, checked in bulk) instead of dicts.

Units: loads are operations per second, sizes bytes, latencies milliseconds, CPU the
fraction of one core in use (1.0 = one core busy; may exceed 1), ``time`` seconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Protocol, TypeVar

from ..errors import InvalidArgument

__all__ = ["SLOTS", "ClusterView", "Move", "NodeView", "Policy", "SlotArray"]

SLOTS = 16384  # Redis Cluster's hash slots
V = TypeVar("V")


@dataclass(frozen=True)
class NodeView:
    """One Redis master at one moment."""

    id: str  # the node's name ("host:port"): what Move.source / Move.target name
    capacity: float  # operations per second it can serve (> 0)
    load: float  # operations per second it serves now
    cpu: float = 0.0  # fraction of one core in use
    memory: int = 0  # bytes used
    latency_ms: float = 0.0  # a recent latency (the driver says which: p99 or a spike)

    def __post_init__(self) -> None:
        if not self.id:
            raise InvalidArgument("a node needs an id")
        if not self.capacity > 0:
            raise InvalidArgument(f"node {self.id}: capacity must be > 0 ops/s, got {self.capacity}")
        for name in ("load", "cpu", "memory", "latency_ms"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"node {self.id}: {name} cannot be negative")

    @property
    def utilisation(self) -> float:
        """load / capacity."""
        return self.load / self.capacity


class SlotArray(Mapping[int, V]):
    """A read-only slot → value mapping over a sequence (slot i at index i, every slot
    from 0 to ``len - 1`` present): what the simulator hands a policy for all 16,384
    slots without building a dict per decision. Raises InvalidArgument for more values
    than there are slots."""

    __slots__ = ("_v",)

    def __init__(self, values: Sequence[V]) -> None:
        if len(values) > SLOTS:
            raise InvalidArgument(f"{len(values)} slot values: there are {SLOTS} slots")
        self._v = list(values)

    def __getitem__(self, slot: int) -> V:
        if type(slot) is not int or not 0 <= slot < len(self._v):
            raise KeyError(slot)
        return self._v[slot]

    def get(self, slot: int, default: V | None = None) -> V | None:  # type: ignore[override]
        # (the simulator's policies call it 16,384 times a decision: no KeyError round trip)
        if type(slot) is int and 0 <= slot < len(self._v):
            return self._v[slot]
        return default

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self._v)))

    def __len__(self) -> int:
        return len(self._v)

    def values_list(self) -> list[V]:
        """Every value, slot i at index i (a copy)."""
        return list(self._v)


def _frozen(m: Mapping[int, object] | None) -> Mapping[int, object]:
    if isinstance(m, SlotArray):  # read-only already, its keys 0..len-1 by construction
        return m
    return MappingProxyType(dict(m or {}))


@dataclass(frozen=True)
class ClusterView:
    """The cluster at ``time``: its masters, and per slot the load, bytes and owner.

    ``slot_load`` and ``slot_bytes`` may leave slots out (they count 0);
    ``slot_node`` names the owner of every slot that holds data or load (a slot left
    out is not the policy's to move). The mappings are read-only copies. Raises
    InvalidArgument for a slot outside 0..16383, an owner that is not among ``nodes``,
    a negative load or size, or two nodes with one id.
    """

    nodes: tuple[NodeView, ...]
    slot_load: Mapping[int, float] = field(default_factory=dict)
    slot_bytes: Mapping[int, int] = field(default_factory=dict)
    slot_node: Mapping[int, str] = field(default_factory=dict)
    time: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        for name in ("slot_load", "slot_bytes", "slot_node"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))
        ids = [n.id for n in self.nodes]
        if len(set(ids)) != len(ids):
            raise InvalidArgument(f"two nodes share an id: {sorted(ids)}")
        known = set(ids)
        for name in ("slot_load", "slot_bytes", "slot_node"):
            m = getattr(self, name)
            if isinstance(m, SlotArray):  # (checked in bulk: its keys are valid slots)
                values = m.values_list()
                if name == "slot_node" and not set(values) <= known:
                    raise InvalidArgument(f"slot_node names {sorted(set(values) - known)!r}, "
                                          "not nodes of the view")
                if name != "slot_node" and values and min(values) < 0:
                    raise InvalidArgument(f"{name} holds a negative value")
                continue
            for slot, v in m.items():
                if type(slot) is not int or not 0 <= slot < SLOTS:
                    raise InvalidArgument(f"{name}: slot {slot!r} is not in 0..{SLOTS - 1}")
                if name == "slot_node":
                    if v not in known:
                        raise InvalidArgument(f"slot {slot} is owned by {v!r}, not a node of the view")
                elif v < 0:
                    raise InvalidArgument(f"{name}[{slot}] cannot be negative")

    # ------------------------------------------------------------------ reading

    def node(self, node_id: str) -> NodeView:
        """The node named ``node_id``. Raises InvalidArgument when there is none."""
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise InvalidArgument(f"no node {node_id!r} in the view")

    def slots_of(self, node_id: str) -> list[int]:
        """The slots ``node_id`` owns (of those the view names), in order."""
        return sorted(s for s, n in self.slot_node.items() if n == node_id)

    def load_of(self, slot: int) -> float:
        return float(self.slot_load.get(slot, 0.0))

    def bytes_of(self, slot: int) -> int:
        return int(self.slot_bytes.get(slot, 0))

    def loads(self) -> dict[str, float]:
        """Each node's load, ops/s, by id."""
        return {n.id: n.load for n in self.nodes}

    # ------------------------------------------------------------------ what-if

    def after(self, moves: Iterable[Move]) -> ClusterView:
        """The view as it would be once ``moves`` are done: each slot's owner changed and
        its load taken from the source's load and added to the target's (CPU, memory and
        latency are left as they were: a model cannot know them). Raises InvalidArgument
        for a move of a slot its source does not own, or to a node not in the view."""
        owner = dict(self.slot_node)
        load = self.loads()
        for m in moves:
            if owner.get(m.slot) != m.source:
                raise InvalidArgument(f"move of slot {m.slot}: {m.source!r} does not own it "
                                      f"({owner.get(m.slot)!r} does)")
            if m.target not in load:
                raise InvalidArgument(f"move of slot {m.slot}: no node {m.target!r}")
            owner[m.slot] = m.target
            shift = self.load_of(m.slot)
            load[m.source] = max(0.0, load[m.source] - shift)
            load[m.target] += shift
        nodes = tuple(replace(n, load=load[n.id]) for n in self.nodes)
        return replace(self, nodes=nodes, slot_node=owner)


@dataclass(frozen=True)
class Move:
    """Move ``slot`` from ``source`` to ``target`` (node ids), because ``reason``."""

    slot: int
    source: str
    target: str
    reason: str = ""

    def __post_init__(self) -> None:
        if type(self.slot) is not int or not 0 <= self.slot < SLOTS:
            raise InvalidArgument(f"slot {self.slot!r} is not in 0..{SLOTS - 1}")
        if self.source == self.target:
            raise InvalidArgument(f"move of slot {self.slot}: source and target are both "
                                  f"{self.source!r}")


class Policy(Protocol):
    """A balancing policy: what to move, given the cluster now. A policy may keep state
    between calls (a monitor period, a grace period), read from ``view.time`` only."""

    def decide(self, view: ClusterView) -> list[Move]:
        """The moves to make now (possibly none), each with its reason."""
        ...
