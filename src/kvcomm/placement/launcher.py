"""An example launcher: start agents on a dev cluster's hosts as a plan says.

Applying a plan is the job of whatever starts the agents (systemd, Kubernetes, Ray, a
script); this one does it for the hosts of a dev cluster (``kvcomm dev-cluster up``),
where "host N" is the config ``DIR/host-N.yaml``. An agent is a command line, run once
per named agent of the plan with ``{agent}``, ``{host}`` and ``{config}`` replaced in its
arguments (any other brace is left alone) and ``KVCOMM_AGENT``, ``KVCOMM_HOST`` and
``KVCOMM_CONFIG`` set in its environment, so that it opens ``kvcomm.open(config=..., agent=...)``::

    launcher = Launcher.for_dev_cluster("/tmp/kvc")
    launcher.apply(load_plan("plan.json"), ["python", "agent.py", "--agent", "{agent}"])
    ...                                    # later, a new plan with a few moves:
    launcher.apply(load_plan("plan2.json"), [...])   # restarts only the agents that move
    launcher.stop_all()

An agent that moves is stopped (SIGTERM, then SIGKILL after ``stop_timeout``) and
started on its new host: its state is in KVCOMM, so it picks up where it was from any
host. Unnamed agents of the plan are left alone (no plan moves them). ``kvcomm
placement launch`` is this, from the command line.

Re-placing a drifting workload: who reads whom changes (a swarm's neighbourhoods drift),
so a plan made once goes stale. :meth:`Launcher.replan_loop` re-places periodically:
every ``every`` seconds it observes the time since its previous round (an
:class:`~kvcomm.placement.observe.Observer`: every host's snapshot read once a round),
plans incrementally from where the agents run now with at most ``max_moves`` moves
(:func:`replan`: ``make_plan(..., max_moves=M)`` on the observed graph with the hosts the
launcher knows), and moves the agents that plan moves (stop on the old host, start on the
new). A move costs L3 traffic (a new client opens its L3 client at its first L2 miss,
~92 kB: :mod:`~kvcomm.placement.cost`), so a move is made only when the cross-host reads
it turns same-host save more bytes than that for as long as they last (at least until
the next round; longer as far as the observed reads persist). The bench
(``bench/bench_placement.py``, "replanned") applies the same rounds to its in-process
agents.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import InvalidArgument, KVCommError
from .agents import is_named
from .graph import Agent, Graph, Move, Plan

_FIELD = re.compile(r"\{(agent|host|config)\}")


def replan(graph: Graph, current: Mapping[str, str], hosts: Sequence[str], *, max_moves: int,
           balance: float = 1.1, move_cost: float = 0.0,
           planner: Callable[..., Plan] | None = None, move_bytes: float = 0.0,
           horizon: float = 4.0) -> Plan:
    """The incremental plan for ``graph`` from ``current`` (agent → the host it runs on
    now, as the launcher knows it: it wins over the graph's host, which is where the agent
    did most of its operations over the observed window, so may be the one it just left).
    At most ``max_moves`` agents move; every host's load within the larger of ``balance``
    and the current :func:`imbalance` times the mean. ``planner`` is ``make_plan`` (the
    default; a test may pass its own). ``move_bytes`` > 0: what a move costs in L3 bytes
    (:data:`~kvcomm.placement.cost.MOVE_BYTES` measured): a move is made only when the
    reads it turns same-host save that over ``horizon`` seconds (how long the saving
    lasts: the launcher's loop gives :func:`~kvcomm.placement.cost.horizon`), i.e.
    ``move_cost`` is raised to :func:`~kvcomm.placement.cost.move_cost_reads` of the
    graph. The defaults (``move_bytes`` 0) make moves free, as ``make_plan``'s.
    Returns the Plan. Raises what ``make_plan`` raises (InvalidArgument:
    bad arguments, a placement ``max_moves`` cannot balance; ConfigError: no networkx),
    and InvalidArgument for a bad ``move_bytes`` or ``horizon``."""
    from .cost import move_cost_reads

    if planner is None:
        from .plan import make_plan

        planner = make_plan
    agents = tuple(replace(a, host=current.get(a.id, a.host)) for a in graph.agents)
    by_bytes = move_cost_reads(graph, move_bytes, horizon)
    if math.isinf(by_bytes):  # (reads that cost nothing: no move can pay)
        max_moves, by_bytes = 0, 0.0
    return planner(Graph(agents, graph.edges), hosts,
                   balance=max(balance, imbalance(agents, hosts)), max_moves=max_moves,
                   move_cost=max(move_cost, by_bytes))


def imbalance(agents: Sequence[Agent], hosts: Sequence[str]) -> float:
    """The heaviest of ``hosts``' loads over their mean, the agents where they are (1.0
    when there is no load). :func:`replan` plans within the larger of this and its
    ``balance``: loads measured over a few seconds vary (a host's agents slowed by its
    CPU, an agent just restarted), and a placement a little out of balance that
    ``max_moves`` moves cannot restore would otherwise stop every re-plan (make_plan
    refuses it); this way a round never leaves the hosts less balanced than they were."""
    load = dict.fromkeys(hosts, 0.0)
    for a in agents:
        if a.host in load:
            load[a.host] += a.load
    total = sum(load.values())
    if not hosts or total <= 0:
        return 1.0
    return max(load.values()) / (total / len(hosts))


@dataclass(frozen=True)
class Round:
    """One re-planning round of :meth:`Launcher.replan_loop`: when (the clock's), the
    moves made, the predicted same-host share before and after, or why none was made."""

    at: float
    moves: tuple[Move, ...]
    before: float | None
    share: float | None
    skipped: str | None = None


class Launcher:
    """Agent processes on the hosts ``configs`` (host id → the config its agents open)."""

    def __init__(self, configs: Mapping[str, str], stop_timeout: float = 10.0) -> None:
        self.configs = dict(configs)
        self.stop_timeout = stop_timeout
        self.running: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}  # agent → (host, proc)
        self.exited: dict[str, int] = {}  # agent → exit status, of those that ended by themselves

    @classmethod
    def for_dev_cluster(cls, directory: str | os.PathLike[str]) -> Launcher:
        """The hosts of the dev cluster in ``directory``. Raises Unavailable when there is
        none."""
        from ..devcluster import load_state

        state = load_state(directory)
        return cls({h["host"]: h["config"] for h in state["hosts"]})

    def start(self, agent: str, host: str, command: Sequence[str],
              log_dir: str | os.PathLike[str] | None = None) -> subprocess.Popen[bytes]:
        """Start ``command`` as ``agent`` on ``host``. Raises InvalidArgument (an unknown
        host, an agent already running), OSError (the command cannot be run)."""
        if host not in self.configs:
            raise InvalidArgument(f"host {host!r} is not one of this cluster's "
                                  f"({', '.join(sorted(self.configs))})")
        if agent in self.running:
            raise InvalidArgument(f"agent {agent!r} already runs on {self.running[agent][0]}")
        config = self.configs[host]
        fields = {"agent": agent, "host": host, "config": config}
        # only the three fields: any other brace (a JSON argument, python -c "d = {}") is
        # the command's own (str.format would raise on it)
        argv = [_FIELD.sub(lambda m: fields[m.group(1)], arg) for arg in command]
        env = {**os.environ, "KVCOMM_AGENT": agent, "KVCOMM_HOST": host, "KVCOMM_CONFIG": config}
        if log_dir is None:
            proc = subprocess.Popen(argv, env=env)
        else:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            with open(Path(log_dir) / f"{agent}.log", "ab") as out:
                proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.running[agent] = (host, proc)
        return proc

    def stop(self, agent: str) -> int | None:
        """Stop ``agent`` (SIGTERM, then SIGKILL); its exit status, None if it did not run."""
        entry = self.running.pop(agent, None)
        if entry is None:
            return None
        proc = entry[1]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                return proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
        return proc.wait()

    def apply(self, plan: Plan, command: Sequence[str],
              log_dir: str | os.PathLike[str] | None = None) -> list[str]:
        """Run every named agent of ``plan`` on its host: start those not running, move
        (stop, then start) those running elsewhere, leave the others. Returns the agents
        started or moved. Raises InvalidArgument when the plan names a host this cluster
        does not have (nothing is started or stopped then)."""
        wanted = {a: h for a, h in plan.assignment.items() if is_named(a)}
        unknown = sorted({h for h in wanted.values() if h not in self.configs})
        if unknown:
            raise InvalidArgument(f"the plan puts agents on {', '.join(unknown)}, not hosts of "
                                  f"this cluster ({', '.join(sorted(self.configs))})")
        changed = []
        for agent, host in sorted(wanted.items()):
            entry = self.running.get(agent)
            if entry is not None and entry[0] == host and entry[1].poll() is None:
                continue
            self.stop(agent)
            self.start(agent, host, command, log_dir)
            changed.append(agent)
        return changed

    def move(self, moves: Sequence[Move], command: Sequence[str],
             log_dir: str | os.PathLike[str] | None = None) -> list[str]:
        """Move each agent of ``moves`` that runs (on any host but its target): stop it,
        start it on the target. An agent that is not running (it ended, or never ran here)
        is not started: a re-plan moves agents, it does not revive them. Returns the agents
        moved. Raises InvalidArgument when a target is not a host of this cluster (nothing
        is moved then)."""
        unknown = sorted({m.target for m in moves if m.target not in self.configs})
        if unknown:
            raise InvalidArgument(f"the plan moves agents to {', '.join(unknown)}, not hosts of "
                                  f"this cluster ({', '.join(sorted(self.configs))})")
        moved = []
        for m in moves:
            entry = self.running.get(m.agent)
            if entry is None or entry[0] == m.target or entry[1].poll() is not None:
                continue
            self.stop(m.agent)
            self.start(m.agent, m.target, command, log_dir)
            moved.append(m.agent)
        return moved

    def alive(self) -> dict[str, str]:
        """The agents still running → their hosts."""
        return {a: h for a, (h, p) in self.running.items() if p.poll() is None}

    def replan_loop(self, config: Any, command: Sequence[str], *, every: float,
                    max_moves: int, window: float | None = None, balance: float = 1.1,
                    move_cost: float = 0.0, log_dir: str | os.PathLike[str] | None = None,
                    observe: Callable[[Any, float], Graph] | None = None,
                    planner: Callable[..., Plan] | None = None,
                    clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep,
                    on_round: Callable[[Round], None] | None = None,
                    move_bytes: float | None = None) -> list[Round]:
        """Re-place the running agents every ``every`` seconds until none runs: observe,
        :func:`replan` from where they run with at most ``max_moves`` moves, each of which
        must pay for itself (``move_bytes``, default
        :data:`~kvcomm.placement.cost.MOVE_BYTES`: a move's L3 bytes, weighed against
        the bytes of the cross-host reads it saves over
        :func:`~kvcomm.placement.cost.horizon`: until the next round, longer as far as
        the observed reads persisted from the previous round, shorter as far as the
        last rounds' predicted gains were not observed after their moves,
        :class:`~kvcomm.placement.cost.Pricing`; 0: moves are free), and :meth:`move`
        them.

        Observing: by default (``observe`` None) an
        :class:`~kvcomm.placement.observe.Observer` of this launcher's hosts (one L3
        client kept for every round) reads every host's snapshot once a round, so a
        round's graph covers the ``every`` seconds since the previous round's read (the
        first round's: the last ``window`` seconds). A given ``observe(config, window)``
        is called each round for the last ``window`` seconds (default: ``every`` less
        one second, at least one second).

        A round whose observation or plan fails (InvalidArgument, e.g. a balance the
        budget cannot restore; Unavailable: L3 down) moves nothing and is recorded with
        ``skipped``; the loop goes on. Returns the rounds (each also given to
        ``on_round``). Raises InvalidArgument for bad arguments (before any round)."""
        from .cost import MOVE_BYTES

        for name, v in (("every", every), ("window", window)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)
                                  or not 0 < v < 1e6):
                raise InvalidArgument(f"{name} must be seconds > 0, got {v!r}")
        if isinstance(max_moves, bool) or not isinstance(max_moves, int) or max_moves < 0:
            raise InvalidArgument(f"max_moves must be an integer >= 0, got {max_moves!r}")
        if move_bytes is None:
            move_bytes = MOVE_BYTES
        if isinstance(move_bytes, bool) or not isinstance(move_bytes, int | float) \
                or not 0 <= move_bytes < math.inf:
            raise InvalidArgument(f"move_bytes must be a finite number >= 0, got {move_bytes!r}")
        if window is None:
            window = max(1.0, every - 1.0)
        observer = None
        if observe is None:
            from .observe import Observer

            # (our hosts': no SCAN; one store for every round: opening one costs ~100 kB)
            observer = Observer(config, hosts=sorted(self.configs))
        try:
            return self._rounds(config, command, every, max_moves, window, balance, move_cost,
                                float(move_bytes), log_dir, observe, observer, planner, clock,
                                sleep, on_round)
        finally:
            if observer is not None:
                observer.close()

    def _rounds(self, config: Any, command: Sequence[str], every: float, max_moves: int,
                window: float, balance: float, move_cost: float, move_bytes: float,
                log_dir: str | os.PathLike[str] | None,
                observe: Callable[[Any, float], Graph] | None, observer: Any,
                planner: Callable[..., Plan] | None,
                clock: Callable[[], float], sleep: Callable[[float], None],
                on_round: Callable[[Round], None] | None) -> list[Round]:
        from .cost import Pricing

        rounds: list[Round] = []
        due = clock() + every
        pricing = Pricing(every)
        while self.alive():
            # (an observer with a read from the previous round observes since then)
            lead = 0.0 if observer is not None and observer.last is not None else window
            wait = due - lead - clock()
            if wait > 0:
                sleep(wait)
            due += every
            try:
                if observer is not None:
                    graph = observer.graph(window, sleep)
                else:
                    assert observe is not None
                    graph = observe(config, window)
                current = self.alive()
                if not current:
                    break
                # (a move's saving lasts as long as the reads it serves, and is what the
                # last rounds' plans turned out to be worth: cost.Pricing)
                lasts = pricing.horizon(graph, graph.share(
                    {a.id: current.get(a.id, a.host) for a in graph.agents}))
                plan = replan(graph, current, list(self.configs), max_moves=max_moves,
                              balance=balance, move_cost=move_cost, planner=planner,
                              move_bytes=move_bytes, horizon=lasts)
                done = set(self.move(plan.moves, command, log_dir))
                pricing.planned(plan.before, plan.share, len(done))
                r = Round(clock(), tuple(m for m in plan.moves if m.agent in done),
                          plan.before, plan.share)
            except KVCommError as e:
                r = Round(clock(), (), None, None, skipped=str(e))
            rounds.append(r)
            if on_round is not None:
                on_round(r)
        return rounds

    def per_host(self) -> dict[str, int]:
        """How many agents run on each host."""
        out = dict.fromkeys(self.configs, 0)
        for host, _ in self.running.values():
            out[host] += 1
        return out

    def wait(self) -> int:
        """Wait until every agent has exited; the first non-zero exit status, else 0."""
        status = 0
        for agent, (_, proc) in list(self.running.items()):
            rc = proc.wait()
            self.exited[agent] = rc
            del self.running[agent]
            if rc and not status:
                status = rc if rc > 0 else 128 - rc  # (killed by signal N: 128 + N, as a shell)
        return status

    def stop_all(self) -> None:
        """Stop every agent still running."""
        for agent in list(self.running):
            self.stop(agent)
