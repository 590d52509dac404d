"""``kvcomm balance``: watch the Redis Cluster behind L3, decide with a policy, move slots.

One *cycle*: measure the cluster over a window (:mod:`kvcomm.balance.signals`: two
samples ``window`` seconds apart make a :class:`~kvcomm.balance.model.ClusterView`),
ask the policy (:class:`~kvcomm.balance.model.Policy`) what to move, log every decision
with its reason, and carry the moves out one slot at a time
(:class:`~kvcomm.balance.migrate.SlotMover`: writes keep flowing, nothing is lost),
unless it is a dry run. ``kvcomm balance`` repeats cycles until SIGTERM or SIGINT;
``--once`` runs one cycle, measures the window after it (when it moved anything; a dry
run predicts it instead, :meth:`ClusterView.after`), and prints one JSON object on its
last line::

    {"moves": [{"slot", "from", "to", "keys", "bytes"}], "bytes_moved",
     "load_before": {node: ops_per_s}, "load_after": {node: ops_per_s}, ...}

with, besides: ``policy``, ``window_s``, ``dry_run``, ``predicted`` (load_after is a
prediction), ``decisions`` (each move's reason), ``failed`` (moves that could not be
made, and why), ``recovered`` (moves left open by an earlier run, a stuck node or a
failover, finished before measuring: :meth:`Balancer.recover`),
``latency_ms_before``/``latency_ms_after`` (per node, see signals).

Policies (:mod:`kvcomm.balance.policy`, the ones the simulator evaluates):
``threshold`` (its knobs tuned in the simulator; with ``--once`` the window itself is
its monitor and grace period) and ``learned`` (the cost model trained in the simulator);
both ship in the package as JSON (``balance_model.json``); a missing or malformed
model is a ConfigError.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..config import Config
from ..errors import ConfigError, InvalidArgument, KVCommError, Unavailable
from ..tiers.l3 import L3Store
from .migrate import BATCH, MoveResult, SlotMover
from .model import ClusterView, Move, Policy
from .policy import POLICIES, make_policy
from .signals import estimate_bytes, sample, view_between

log = logging.getLogger("kvcomm.balance")

def load_policy(name: str, once: bool = False) -> Policy:
    """The policy called ``name`` (:func:`kvcomm.balance.policy.make_policy`: the
    threshold knobs tuned and the learned model trained in the simulator, shipped with
    the package). With ``once`` the threshold policy acts on what one window shows (the
    window is its monitor and grace period). Raises ConfigError for an unknown name or a
    learned model that is missing or malformed."""
    try:
        if name == "threshold" and once:
            return make_policy(name, monitor_s=0.0, grace_s=0.0)
        return make_policy(name)
    except InvalidArgument as exc:
        raise ConfigError("--policy", f"{exc}; the policies are {', '.join(POLICIES)}, and "
                          "`kvcomm balance train` writes a learned model") from None


@dataclass
class Cycle:
    """What one cycle saw, decided and did."""

    view: ClusterView
    moves: list[Move]
    done: list[tuple[Move, MoveResult]] = field(default_factory=list)
    failed: list[tuple[Move, str]] = field(default_factory=list)


class Balancer:
    """The balancer of the cluster named in ``config`` (``cluster.redis``, its
    credentials and ``cluster.groups``). Raises ConfigError (no cluster, another group
    count than L3's), Unavailable (the cluster cannot be reached)."""

    def __init__(self, config: Config, policy: Policy, *, window: float = 30.0,
                 policy_name: str | None = None,
                 dry_run: bool = False, batch: int = BATCH,
                 clock: Callable[[], float] = time.monotonic,
                 wait: Callable[[float], bool] | None = None) -> None:
        if not config.cluster.enabled:
            raise ConfigError("cluster.redis", "kvcomm balance needs the Redis Cluster seed "
                              "nodes (host:port list) of the cluster to balance")
        if not window > 0:
            raise InvalidArgument(f"--window must be more than 0 seconds, got {window}")
        from ..node.prewarm import HOT_EVERY

        if window < 2 * HOT_EVERY:  # (a window sees 0 or 1 save of each host's counts)
            log.warning("a --window of %gs is short: the daemons save their per-group counts "
                        "every %gs, so slot loads will be partial or missing; use %gs or more",
                        window, HOT_EVERY, 3 * HOT_EVERY)
        cl = config.cluster
        self.store = L3Store.from_config(cl)  # (routing, credentials, TLS: as a host's)
        try:
            self.store.check_groups()
        except BaseException:
            self.store.close()
            raise
        self.policy, self.window, self.dry_run = policy, window, dry_run
        self.policy_name = policy_name or type(policy).__name__
        self.mover = SlotMover(self.store, batch=batch)
        self.clock = clock
        self._stop = threading.Event()
        self.wait = wait if wait is not None else self._stop.wait  # True: stop asked
        self.recovered: list[MoveResult] = []  # moves left open and finished (recover)
        try:
            self.recover()
        except Unavailable as exc:  # (a master not answering: every cycle tries again)
            log.warning("could not settle the moves left open: %s; the next cycle tries "
                        "again", exc)
        except BaseException:
            self.store.close()
            raise

    def recover(self) -> list[MoveResult]:
        """Settle the moves left open (a balancer killed mid-move, a node that stopped
        answering, a source failed over: :meth:`SlotMover.recover`): their keys would be
        out of sight and their groups' writes refused. A dry run only logs them.
        Returns the moves finished. Raises Unavailable."""
        if self.dry_run:
            for slot, towards in sorted(self.mover.open_slots().items()):
                log.warning("slot %d is left open towards %s (a move interrupted): a run "
                            "that is not a dry run settles it", slot, ", ".join(sorted(towards)))
            return []
        done = self.mover.recover()
        self.recovered.extend(done)
        for r in done:
            log.warning("finished the move of slot %d to %s left open: %d keys", r.slot,
                        r.target, r.keys)
        return done

    def close(self) -> None:
        self.store.close()

    def stop(self) -> None:
        self._stop.set()

    def measure(self) -> ClusterView:
        """The cluster over the next ``window`` seconds. Raises Unavailable; KVCommError
        when stopped meanwhile."""
        masters = {n.name: n.slots for n in self.mover.masters()}
        hosts = self.store.hosts()
        a = sample(self.store, masters, self.clock, hosts)
        if self.wait(self.window):
            raise KVCommError("stopped")
        b = sample(self.store, masters, self.clock, hosts)
        view = view_between(a, b, self.store.groups)
        for host, keys in b.hot.items():
            for k in keys[:5]:
                log.debug("hot key of %s: %r in slot %d", host, k,
                          self.store.groups.slot(self.store.groups.of(k)))
        return view_between(a, b, self.store.groups, estimate_bytes(self.store, view))

    def cycle(self) -> Cycle:
        """Measure, decide, move (unless a dry run); every decision is logged with its
        reason. A move that fails is logged and reported, and the others go on.
        Raises Unavailable when the cluster cannot be measured."""
        self.recover()
        view = self.measure()
        log.info("window of %.0fs: %s", self.window, ", ".join(
            f"{n.id} {n.load:.0f} ops/s ({n.utilisation:.0%}, cpu {n.cpu:.2f}, "
            f"{n.latency_ms:.2f} ms)" for n in view.nodes))
        moves = self.policy.decide(view)
        cycle = Cycle(view, moves)
        if not moves:
            log.info("no move: %s", "the load is even enough" if view.slot_load
                     else "no slot carries load the daemons report")
        for m in moves:
            src = view.node(m.source)
            log.info("%s slot %d (%.0f ops/s, ~%d bytes) from %s (%.0f ops/s, %.0f%% of "
                     "capacity) to %s: %s", "would move" if self.dry_run else "move", m.slot,
                     view.load_of(m.slot), view.bytes_of(m.slot), m.source, src.load,
                     100 * src.utilisation, m.target, m.reason)
            if self.dry_run:
                continue
            try:
                res = self.mover.move(m.slot, m.target)
            except (Unavailable, InvalidArgument) as exc:
                log.warning("moving slot %d to %s failed: %s", m.slot, m.target, exc)
                cycle.failed.append((m, str(exc)))
                continue
            cycle.done.append((m, res))
        return cycle

    def once(self) -> dict[str, Any]:
        """One cycle, then the load after it: the report ``--once`` prints."""
        c = self.cycle()
        predicted = self.dry_run or not c.done
        after = c.view.after(c.moves) if self.dry_run else (
            self.measure() if c.done else c.view)
        rows = ([{"slot": m.slot, "from": m.source, "to": m.target, "keys": r.keys,
                  "bytes": r.bytes} for m, r in c.done] if not self.dry_run else
                [{"slot": m.slot, "from": m.source, "to": m.target, "keys": None,
                  "bytes": c.view.bytes_of(m.slot)} for m in c.moves])
        return {
            "moves": rows,
            "bytes_moved": sum(r.bytes for _, r in c.done),
            "load_before": {n.id: round(n.load, 1) for n in c.view.nodes},
            "load_after": {n.id: round(n.load, 1) for n in after.nodes},
            "latency_ms_before": {n.id: round(n.latency_ms, 3) for n in c.view.nodes},
            "latency_ms_after": {n.id: round(n.latency_ms, 3) for n in after.nodes},
            "policy": self.policy_name, "window_s": self.window,
            "dry_run": self.dry_run, "predicted": predicted,
            "decisions": [{"slot": m.slot, "from": m.source, "to": m.target,
                           "reason": m.reason} for m in c.moves],
            "failed": [{"slot": m.slot, "to": m.target, "why": why} for m, why in c.failed],
            "recovered": [{"slot": r.slot, "from": r.source, "to": r.target, "keys": r.keys,
                           "bytes": r.bytes} for r in self.recovered],
        }

    def run(self) -> None:
        """Cycles until :meth:`stop`. A cycle that cannot measure the cluster is logged
        and retried after a window."""
        while not self._stop.is_set():
            try:
                self.cycle()
            except Unavailable as exc:
                log.warning("cycle failed: %s; next in %.0fs", exc, self.window)
                if self.wait(self.window):
                    return
            except KVCommError:
                if self._stop.is_set():
                    return
                raise


def main(config: Config, policy: str = "threshold", window: float = 30.0,
         once: bool = False, dry_run: bool = False) -> int:
    """``kvcomm balance``: returns the exit status (0). Raises ConfigError, Unavailable."""
    import signal

    logging.basicConfig(level=logging.INFO, format="%(asctime)s kvcomm-balance %(message)s")
    b = Balancer(config, load_policy(policy, once), window=window, dry_run=dry_run,
                 policy_name=policy)
    try:
        if once:
            print(json.dumps(b.once()), flush=True)
            return 0
        signal.signal(signal.SIGTERM, lambda *_: b.stop())
        signal.signal(signal.SIGINT, lambda *_: b.stop())
        b.run()
        return 0
    finally:
        b.close()
