"""The two contracts of placement: the communication graph and the plan, as JSON.

Graph (``kvcomm placement observe`` writes it, ``kvcomm placement plan`` reads it)::

    {"agents": [{"id": "drone-7", "host": "host-1", "load": 12.5}, ...],
     "edges": [{"reader": "drone-7", "writer": "drone-8",
                "reads_per_s": 50.0, "bytes_per_s": 51200.0}, ...]}

* ``id``: an agent name (1-64 of letters, digits, ``_.:-``) or ``PID@HOST``, an agent
  that did not name itself (plans keep it where it is). Ids are unique.
* ``host``: where the agent runs (a ``node.host_id``), or null when it is not known (an
  agent seen only as the writer of what others read).
* ``load``: the agent's own operations per second (gets, puts, deletes), >= 0.
* an edge: ``reader`` read, per second, ``reads_per_s`` times (``bytes_per_s`` value
  bytes) a key whose last writer was ``writer``; both are agents of the list, never the
  same one; at most one edge per (reader, writer); rates >= 0. Estimated from samples.

Plan (``kvcomm placement plan`` writes it, the launcher reads it)::

    {"assignment": {"drone-7": "host-1", ...},
     "moves": [{"agent": "drone-7", "from": "host-2", "to": "host-1"}, ...],
     "predicted": {"same_host_read_share": 0.82, "before": 0.34}}

* ``assignment``: a host for every agent of the graph.
* ``moves``: the agents whose host changes (from their host in the graph).
* ``predicted``: the share of cross-agent reads (weighted by ``reads_per_s``) whose
  writer is on the reader's host, under the assignment and (``before``) under the
  graph's hosts; null when there are no such reads (or, for ``before``, no hosts).

Readers of either format ignore keys they do not know; writers write exactly these.
Every error is an InvalidArgument naming the place (``agents[3].load``) and the rule.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgument
from .agents import is_agent_id, is_named

_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:-")


def check_host(host: object, where: str) -> str:
    """``host`` if it is a valid host id (as ``node.host_id``). Raises InvalidArgument."""
    if type(host) is not str or not 1 <= len(host) <= 64 or not set(host) <= _HOST_CHARS:
        raise InvalidArgument(f"{where} must be a host id (1-64 letters, digits, '_.:-'), "
                              f"got {host!r}")
    return host


def _rate(v: object, where: str) -> float:
    try:  # (an int beyond a float, which JSON allows, overflows)
        ok = not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v) and v >= 0
    except OverflowError:
        ok = False
    if not ok:
        shown = repr(v) if len(repr(v)) <= 40 else repr(v)[:40] + "..."
        raise InvalidArgument(f"{where} must be a finite number >= 0, got {shown}")
    return float(v)  # type: ignore[arg-type]


def _items(obj: Mapping[str, Any], key: str, where: str) -> list[Any]:
    v = obj.get(key)
    if not isinstance(v, list):
        raise InvalidArgument(f"{where}{key} must be a list, got {type(v).__name__}")
    return v


@dataclass(frozen=True)
class Agent:
    """An agent of the graph: its id, its host (None: unknown), its operations per second."""

    id: str
    host: str | None
    load: float

    @property
    def named(self) -> bool:
        """False for ``PID@HOST``, an agent no plan moves."""
        return is_named(self.id)


@dataclass(frozen=True)
class Edge:
    """``reader`` reads ``reads_per_s`` times a second what ``writer`` wrote."""

    reader: str
    writer: str
    reads_per_s: float
    bytes_per_s: float


@dataclass(frozen=True)
class Graph:
    """Who reads whose state: the contract of ``kvcomm placement observe``."""

    agents: tuple[Agent, ...]
    edges: tuple[Edge, ...]

    def hosts(self) -> dict[str, str | None]:
        """Agent id → its host (None: unknown)."""
        return {a.id: a.host for a in self.agents}

    def share(self, assignment: Mapping[str, str | None]) -> float | None:
        """The share of cross-agent reads (by reads per second) whose writer is on the
        reader's host under ``assignment``; reads of an agent without a host count as not
        on it. None when there are no reads."""
        top = max((e.reads_per_s for e in self.edges), default=0.0)
        if top <= 0:
            return None
        total = same = 0.0  # (in units of the largest rate: sums near the float limit stay finite)
        for e in self.edges:
            total += e.reads_per_s / top
            h = assignment.get(e.reader)
            if h is not None and h == assignment.get(e.writer):
                same += e.reads_per_s / top
        return min(1.0, same / total)

    def to_json(self) -> dict[str, Any]:
        return {"agents": [{"id": a.id, "host": a.host, "load": a.load} for a in self.agents],
                "edges": [{"reader": e.reader, "writer": e.writer, "reads_per_s": e.reads_per_s,
                           "bytes_per_s": e.bytes_per_s} for e in self.edges]}

    @classmethod
    def from_json(cls, obj: object) -> Graph:
        """The graph in ``obj`` (parsed JSON), checked. Raises InvalidArgument."""
        if not isinstance(obj, dict):
            raise InvalidArgument(f"a graph is a JSON object, got {type(obj).__name__}")
        agents: list[Agent] = []
        seen: set[str] = set()
        for i, a in enumerate(_items(obj, "agents", "")):
            where = f"agents[{i}]"
            if not isinstance(a, dict):
                raise InvalidArgument(f"{where} must be an object with id, host, load")
            aid = a.get("id")
            if not is_agent_id(aid):
                raise InvalidArgument(f"{where}.id must be an agent name (1-64 letters, digits, "
                                      f"'_.:-') or PID@HOST, got {aid!r}")
            assert isinstance(aid, str)
            if aid in seen:
                raise InvalidArgument(f"{where}.id {aid!r} appears twice")
            seen.add(aid)
            if "host" not in a:
                raise InvalidArgument(f"{where}.host is missing (a host id, or null)")
            host = a["host"]
            if host is not None:
                check_host(host, f"{where}.host")
            agents.append(Agent(aid, host, _rate(a.get("load"), f"{where}.load")))
        edges: list[Edge] = []
        pairs: set[tuple[str, str]] = set()
        for i, e in enumerate(_items(obj, "edges", "")):
            where = f"edges[{i}]"
            if not isinstance(e, dict):
                raise InvalidArgument(f"{where} must be an object with reader, writer, "
                                      "reads_per_s, bytes_per_s")
            r, w = e.get("reader"), e.get("writer")
            for name, v in (("reader", r), ("writer", w)):
                if type(v) is not str or v not in seen:
                    raise InvalidArgument(f"{where}.{name} {v!r} is not one of the agents")
            assert isinstance(r, str) and isinstance(w, str)
            if r == w:
                raise InvalidArgument(f"{where}: an agent reading its own keys is not an edge")
            if (r, w) in pairs:
                raise InvalidArgument(f"{where}: a second edge from {r!r} to {w!r}")
            pairs.add((r, w))
            edges.append(Edge(r, w, _rate(e.get("reads_per_s"), f"{where}.reads_per_s"),
                              _rate(e.get("bytes_per_s"), f"{where}.bytes_per_s")))
        return cls(tuple(agents), tuple(edges))


@dataclass(frozen=True)
class Move:
    agent: str
    source: str | None
    target: str


@dataclass(frozen=True)
class Plan:
    """Hosts for agents: the contract of ``kvcomm placement plan``."""

    assignment: dict[str, str]
    moves: tuple[Move, ...]
    share: float | None  # predicted same-host read share under the assignment
    before: float | None  # ... under the graph's hosts

    def to_json(self) -> dict[str, Any]:
        return {"assignment": dict(self.assignment),
                "moves": [{"agent": m.agent, "from": m.source, "to": m.target} for m in self.moves],
                "predicted": {"same_host_read_share": self.share, "before": self.before}}

    @classmethod
    def from_json(cls, obj: object) -> Plan:
        """The plan in ``obj`` (parsed JSON), checked. Raises InvalidArgument."""
        if not isinstance(obj, dict) or not isinstance(obj.get("assignment"), dict):
            raise InvalidArgument("a plan is a JSON object with an \"assignment\" object "
                                  "(agent → host)")
        assignment: dict[str, str] = {}
        for aid, host in obj["assignment"].items():
            if not is_agent_id(aid):
                raise InvalidArgument(f"assignment: {aid!r} is not an agent id")
            assignment[aid] = check_host(host, f"assignment[{aid!r}]")
        moves = []
        for i, m in enumerate(_items(obj, "moves", "")):
            if not isinstance(m, dict) or type(m.get("agent")) is not str \
                    or m["agent"] not in assignment:
                raise InvalidArgument(f"moves[{i}] must name an agent of the assignment")
            src = m.get("from")
            if src is not None:
                check_host(src, f"moves[{i}].from")
            if m.get("to") != assignment[m["agent"]]:
                raise InvalidArgument(f"moves[{i}].to must be the agent's host in the assignment")
            moves.append(Move(m["agent"], src, m["to"]))
        pred = obj.get("predicted")
        if not isinstance(pred, dict):
            raise InvalidArgument("a plan has a \"predicted\" object")
        shares = []
        for k in ("same_host_read_share", "before"):
            v = pred.get(k)
            if v is not None:
                v = _rate(v, f"predicted.{k}")
                if v > 1:
                    raise InvalidArgument(f"predicted.{k} is a share in [0, 1], got {v}")
            shares.append(v)
        return cls(assignment, tuple(moves), shares[0], shares[1])


def load_json(path: str | os.PathLike[str], what: str) -> Any:
    """The JSON document in ``path``. Raises InvalidArgument naming ``what`` and the path."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise InvalidArgument(f"cannot read the {what} {os.fspath(path)!r}: {exc.strerror}") from None
    except (ValueError, RecursionError) as exc:  # (RecursionError: nested too deep)
        raise InvalidArgument(f"the {what} {os.fspath(path)!r} is not JSON: {exc}") from None


def load_graph(path: str | os.PathLike[str]) -> Graph:
    """The graph in the JSON file ``path``. Raises InvalidArgument (naming the place)."""
    try:
        return Graph.from_json(load_json(path, "graph"))
    except InvalidArgument as exc:
        raise InvalidArgument(f"{os.fspath(path)}: {exc}") from None


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """The plan in the JSON file ``path``. Raises InvalidArgument (naming the place)."""
    try:
        return Plan.from_json(load_json(path, "plan"))
    except InvalidArgument as exc:
        raise InvalidArgument(f"{os.fspath(path)}: {exc}") from None


def write_json(path: str | os.PathLike[str], doc: Mapping[str, Any]) -> None:
    """Write ``doc`` to ``path`` whole (a temporary file of a new random name beside it,
    created exclusively: never a planted file or symlink, then renamed). Raises
    InvalidArgument when the file cannot be written (nothing is left behind then)."""
    target = os.fspath(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(target) + ".",
                                   suffix=".tmp", dir=os.path.dirname(target) or ".")
        mask = os.umask(0)  # (mkstemp makes 0600: give the file open()'s usual mode)
        os.umask(mask)
        os.fchmod(fd, 0o666 & ~mask)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        os.replace(tmp, target)
    except OSError as exc:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        raise InvalidArgument(f"cannot write {target!r}: {exc.strerror}") from None
