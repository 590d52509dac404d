"""The threshold policy: move slots off a node whose load stands out, as Anna does.

A node is *hot* when its utilisation (load / capacity) exceeds the mean over the nodes
plus ``k`` standard deviations — and the mean by at least ``min_spread`` of it (in a
nearly even cluster some node is always a standard deviation above the mean) — and is
at least ``min_utilisation`` (an idle cluster is never rebalanced). It must stay hot
for ``monitor_s`` seconds before anything moves (a burst is not a trend). Then, up to
``max_moves`` times per decision: the hottest node gives the slot that best evens it
with the coldest node — the slot minimising the larger of the two loads afterwards (on
a tie, the lighter, then the smaller) — provided that this lowers the hotter of the
two by at least ``min_gain`` (a slot hotter than the gap between them would only move
the hot spot; then nothing moves). A slot moved rests for ``grace_s`` seconds (no
ping-pong while the load measurements catch up with the move).

Pure: the time is the view's (:attr:`kvcomm.balance.model.ClusterView.time`); the
simulator tunes ``k``, ``monitor_s``, ``grace_s`` by search on training seeds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import InvalidArgument
from .model import ClusterView, Move

__all__ = ["ThresholdPolicy"]


@dataclass
class ThresholdPolicy:
    """Hot = utilisation over mean + k·std for ``monitor_s``; see the module's doc."""

    k: float = 1.0
    monitor_s: float = 10.0
    grace_s: float = 60.0
    min_utilisation: float = 0.05
    min_spread: float = 0.1
    min_gain: float = 0.05
    max_moves: int = 4

    def __post_init__(self) -> None:
        if min(self.k, self.monitor_s, self.grace_s, self.max_moves, self.min_spread,
               self.min_utilisation) < 0:
            raise InvalidArgument("the threshold policy's parameters cannot be negative")
        if not 0 <= self.min_gain < 1:
            raise InvalidArgument(f"min_gain must be in [0, 1), got {self.min_gain}")
        self.hot_since: dict[str, float] = {}  # node → when it was first seen hot, in a row
        self.rested: dict[int, float] = {}  # slot → when it may move again

    def decide(self, view: ClusterView) -> list[Move]:
        """The moves to make now, each with its reason (see the module's doc)."""
        now = view.time
        util = {n.id: n.utilisation for n in view.nodes}
        cap = {n.id: n.capacity for n in view.nodes}
        if len(util) < 2:
            return []
        mean = sum(util.values()) / len(util)
        std = math.sqrt(sum((u - mean) ** 2 for u in util.values()) / len(util))
        bar = max(mean + max(self.k * std, self.min_spread * mean), self.min_utilisation)
        hot = {n for n, u in util.items() if u > bar}
        for n in list(self.hot_since):
            if n not in hot:
                del self.hot_since[n]
        for n in hot:
            self.hot_since.setdefault(n, now)
        ready = {n for n in hot if now - self.hot_since[n] >= self.monitor_s}
        self.rested = {s: t for s, t in self.rested.items() if t > now}
        owner = dict(view.slot_node)
        moves: list[Move] = []
        while len(moves) < self.max_moves and ready:
            src = max(ready, key=lambda n: util[n])
            dst = min(util, key=lambda n: util[n])
            if dst == src:
                break
            best: tuple[float, float, int, int] | None = None
            for slot, node in owner.items():
                load = view.load_of(slot)
                if node != src or load <= 0 or slot in self.rested:
                    continue
                after = max(util[src] - load / cap[src], util[dst] + load / cap[dst])
                # (ties: the lighter slot, then the smaller: less to move for the same gain)
                cand = (round(after, 9), load, view.bytes_of(slot), slot)
                if best is None or cand < best:
                    best = cand
            if best is None or best[0] > util[src] * (1 - self.min_gain):
                ready.discard(src)  # nothing of it would help: leave it
                continue
            after, _, _, slot = best
            load = view.load_of(slot)
            held = f" for {now - self.hot_since[src]:.0f}s" if self.monitor_s else ""
            reason = (f"{src} at {util[src]:.0%} of capacity, over mean {mean:.0%} + "
                      f"{self.k:g}·std {std:.0%}{held}; slot "
                      f"{slot} ({load:.0f} ops/s, {view.bytes_of(slot)} bytes) to {dst} "
                      f"({util[dst]:.0%}): the busier of the two at {after:.0%} afterwards")
            moves.append(Move(slot, src, dst, reason))
            owner[slot] = dst
            util[src] -= load / cap[src]
            util[dst] += load / cap[dst]
            self.rested[slot] = now + self.grace_s
            if util[src] <= bar:
                ready.discard(src)
        return moves
