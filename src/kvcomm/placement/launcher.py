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
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..errors import InvalidArgument
from .agents import is_named
from .graph import Plan

_FIELD = re.compile(r"\{(agent|host|config)\}")


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
