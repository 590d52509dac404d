"""Observing the whole cluster: each host's agent reports in L3, and the graph from them.

The node daemon of each host (:class:`HostPublisher`, driven from ``node/daemon.py``)
reads its host's table of agent reports (:mod:`kvcomm.placement.report`) every
``PUBLISH_EVERY`` seconds, removes the reports of processes that are gone, and saves the
rest in L3 under ``kvn:{host}:agents`` (beside the host's hot keys), with a TTL: a host
whose daemon stops drops out of the graph.

``kvcomm placement observe`` (:func:`observe`) reads every host's snapshot (a SCAN of
``kvn:{*}:agents`` on every master), waits ``seconds``, reads them again, and turns the
difference into rates: each report carries its agent's running totals and the time they
were taken, so an agent's rates are (totals now − totals then) / (its own time between the
two reports) — exact up to sampling, whatever the delays of reporting and publishing. An
agent that started in between is counted since it started; with ``seconds`` 0, every agent
is counted since it started. In embedded mode (no ``cluster.redis``) the host's own table
is read directly.

The snapshot in L3 (msgpack map, ``f`` 1): ``host``, ``t`` (wall clock) and ``reports``,
the host's reports as :mod:`~kvcomm.placement.report` describes them, each with its file
name under ``id``.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import msgpack

from ..config import Config
from ..errors import CorruptRecord, InvalidArgument, KVCommError, Unavailable
from ..tiers.shm.files import agents_dir
from .agents import host_of_unnamed
from .graph import Agent, Edge, Graph, check_host
from .report import _valid, read_reports

if TYPE_CHECKING:
    from ..tiers.l3 import DaemonL3

log = logging.getLogger("kvcomm.placement")
FORMAT = 1
PUBLISH_EVERY = 1.0  # seconds between a daemon's snapshots
SNAPSHOT_TTL = 30  # seconds a host's snapshot outlives its last publication
MAX_REPORTS = 4096  # reports published per host
MAX_SNAPSHOT_BYTES = 64 << 20


def snapshot_key(host: str) -> str:
    """Where ``host``'s snapshot lives in L3 (its hash tag is the host, as its hot keys)."""
    return f"kvn:{{{host}}}:agents"


def host_snapshot(host: str, table: str, now: float, clean: bool = True) -> dict[str, Any]:
    """The snapshot of the table of reports ``table`` of host ``host``."""
    return {"f": FORMAT, "host": host, "t": now,
            "reports": read_reports(table, clean=clean, now=now)[:MAX_REPORTS]}


class HostPublisher:
    """The node daemon's part: its host's agent reports, published to L3 now and then."""

    def __init__(self, config: Config, namespace: str, host: str, *,
                 wall: Callable[[], float] = time.time) -> None:
        self.host, self.wall = host, wall
        self.table = agents_dir(namespace, config.cache.l2_dir)
        self.next_at = 0.0
        self.published = 0
        self.failures = 0

    def maybe_publish(self, l3: DaemonL3, now: float) -> bool:
        """Publish the host's snapshot if ``PUBLISH_EVERY`` has passed since the last one
        (``now``: the daemon's monotonic clock). Returns whether it did. Never raises: a
        failure (L3 unreachable, say) is counted and logged, and tried again next time."""
        if now < self.next_at:
            return False
        self.next_at = now + PUBLISH_EVERY
        try:
            snap = host_snapshot(self.host, self.table, self.wall())
            data = msgpack.packb(snap)
            # (on the master of the host's own keys; not waited for while it is down)
            l3.set_own(snapshot_key(self.host), data, SNAPSHOT_TTL)
        except (KVCommError, OSError) as exc:
            self.failures += 1
            if self.failures & (self.failures - 1) == 0:  # the 1st, 2nd, 4th... in a row
                log.warning("could not publish the agents of %s for placement: %s", self.host, exc)
            return False
        self.failures = 0
        self.published += 1
        return True


def _decode_snapshot(raw: object) -> dict[str, Any] | None:
    """A snapshot of ours, its invalid reports left out; None when it is not one."""
    if not isinstance(raw, bytes) or len(raw) > MAX_SNAPSHOT_BYTES:
        return None
    try:
        snap = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception:  # not msgpack: written by something else
        return None
    if not isinstance(snap, dict) or snap.get("f") != FORMAT or not _is_host(snap.get("host")) \
            or not isinstance(snap.get("reports"), list):
        return None
    snap["reports"] = [r for r in snap["reports"] if _valid(r) and isinstance(r.get("id"), str)]
    return snap


def _is_host(host: object) -> bool:
    try:
        check_host(host, "host")
    except InvalidArgument:
        return False
    return True


def load_snapshots(l3: Any, hosts: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Every host's snapshot in L3 (a SCAN of every master: for tools, not hot paths), or
    with ``hosts`` only those hosts' (a GET each: a SCAN reads every key name of the
    cluster, which a launcher re-planning every few seconds would pay each round).
    Snapshots that are not ours, and hosts with none, are skipped. Raises Unavailable."""
    def names() -> list[bytes]:
        return list(l3.rc.scan_iter(match="kvn:{*}:agents", count=1000))

    out = []
    found = [snapshot_key(h).encode() for h in hosts] if hosts is not None else l3._call(names)
    for name in sorted(set(found)):
        try:
            raw = l3._call(lambda name=name: l3.rc.get(name), name.decode("utf-8", "replace"))
        except CorruptRecord:  # another type under the name
            continue
        snap = _decode_snapshot(raw)
        if snap is not None:
            out.append(snap)
    return out


def _reports(snapshots: Iterable[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(s["host"], r["id"]): r for s in snapshots for r in s["reports"]}


def graph_from(before: Iterable[dict[str, Any]], after: Iterable[dict[str, Any]]) -> Graph:
    """The graph of the rates between two sets of host snapshots (``before`` may be empty:
    rates since each agent started)."""
    then = _reports(before)
    load: dict[str, float] = {}
    hosts: dict[str, dict[str, float]] = {}  # agent → host → its ops per second there
    edges: dict[tuple[str, str], list[float]] = {}
    for key, r in sorted(_reports(after).items()):
        p = then.get(key)
        if p is not None and p["since"] == r["since"]:
            dt = r["t"] - p["t"]
            base_ops, base_edges = p["ops"], p["edges"]
        else:  # started since (or not yet reported then): since it started
            dt = r["t"] - r["since"]
            base_ops, base_edges = 0, {}
        agent = r["agent"]
        try:
            rate = max(0.0, (r["ops"] - base_ops) / dt) if dt > 0 else 0.0
            mine = []
            if dt > 0:
                for writer, (reads, nbytes) in r["edges"].items():
                    b = base_edges.get(writer, (0, 0))
                    dr, db = max(0.0, reads - b[0]) / dt, max(0.0, nbytes - b[1]) / dt
                    if dr > 0 and writer != agent:
                        mine.append((writer, dr, db))
        except (OverflowError, ZeroDivisionError):
            continue
        if not all(math.isfinite(v) for v in (rate, *(x for m in mine for x in m[1:]))):
            continue  # (a report no clock could give: left out, not the whole graph)
        load[agent] = _sum(load.get(agent, 0.0), rate)
        at = hosts.setdefault(agent, {})
        at[r["host"]] = _sum(at.get(r["host"], 0.0), rate)
        for writer, dr, db in mine:
            e = edges.setdefault((agent, writer), [0.0, 0.0])
            e[0] = _sum(e[0], dr)
            e[1] = _sum(e[1], db)
    agents = [Agent(a, max(sorted(at), key=lambda h: at[h]), round(load[a], 3))
              for a, at in sorted(hosts.items())]
    known = set(load)
    for _, writer in sorted(edges):  # seen only as a writer: no report of its own here
        if writer not in known:
            known.add(writer)
            agents.append(Agent(writer, host_of_unnamed(writer), 0.0))
    return Graph(tuple(agents),
                 tuple(Edge(r, w, round(v[0], 3), round(v[1], 3))
                       for (r, w), v in sorted(edges.items())))


def _sum(a: float, b: float) -> float:
    """a + b, kept finite (the graph's numbers are finite by its contract)."""
    return min(a + b, sys.float_info.max)


def _snapshots(config: Config, namespace: str | None, l3: Any,
               hosts: Sequence[str] | None = None) -> list[dict[str, Any]]:
    if l3 is not None:
        return load_snapshots(l3, hosts)
    ns = namespace or config.node.namespace
    return [host_snapshot(config.node.host_id, agents_dir(ns, config.cache.l2_dir), time.time())]


def observe(config: Config, seconds: float, *, namespace: str | None = None,
            hosts: Sequence[str] | None = None, store: Any = None,
            sleep: Callable[[float], None] = time.sleep) -> Graph:
    """The whole cluster's communication graph over the next ``seconds`` (0: since each
    agent started). In cluster mode it reads every host's snapshot from L3 (each daemon
    publishes once a second, so the rates cover about ``seconds``), or with ``hosts`` only
    those hosts' (cheaper: no SCAN; what a launcher that knows its hosts passes); in
    embedded mode the table of the namespace ``namespace`` (default ``node.namespace``)
    on this host. ``store``: an open L3Store (cluster mode) to read with, left open; by
    default one is opened and closed, and opening one costs about 100 kB of L3 traffic
    (the cluster client's start-up: measured on the dev cluster), which a launcher that
    observes every few seconds keeps one store to save. Raises InvalidArgument
    (``seconds`` < 0, a bad host id), Unavailable (L3 cannot be reached), ConfigError
    (cluster mode without ``kvcomm[cluster]``)."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 <= seconds < 1e6:
        raise InvalidArgument(f"seconds must be a number >= 0, got {seconds!r}")
    if hosts is not None:
        hosts = [check_host(h, "hosts") for h in hosts]
    l3 = store if config.cluster.enabled else None
    if config.cluster.enabled and store is None:
        from ..tiers.l3 import L3Store

        cl = config.cluster
        l3 = L3Store.from_config(cl)
    try:
        before = _snapshots(config, namespace, l3, hosts) if seconds > 0 else []
        if seconds > 0:
            sleep(seconds)
        after = _snapshots(config, namespace, l3, hosts)
    finally:
        if l3 is not None and l3 is not store:
            l3.close()
    if not after and l3 is not None:
        raise Unavailable("no host has published its agents to L3: is `kvcomm node` running "
                          "on the hosts, and are the agents reading (hot_key_sample > 0)?")
    return graph_from(before, after)


class Observer:
    """Observing again and again, every host's snapshot read once a time: what a
    re-planning launcher does each round. :func:`observe` reads every snapshot twice
    (before and after its window), so a round every S seconds of an S - 1 s window read
    each twice; here each read is the next one's "before": half the L3 reads, and the
    window is the whole time between two rounds (no traffic left unobserved).

    ``config``, ``namespace``, ``hosts``: as :func:`observe`. ``store``: an open L3Store
    to read with (left open); by default one is opened at the first read and kept until
    :meth:`close` (opening one costs about 100 kB of L3 traffic)."""

    def __init__(self, config: Config, *, namespace: str | None = None,
                 hosts: Sequence[str] | None = None, store: Any = None) -> None:
        self.config, self.namespace = config, namespace
        self.hosts = [check_host(h, "hosts") for h in hosts] if hosts is not None else None
        self.store, self._own = store, False
        self.last: list[dict[str, Any]] | None = None  # the previous read's snapshots
        self.reads = 0  # reads of every host's snapshot so far

    def read(self) -> list[dict[str, Any]]:
        """Every host's snapshot now (kept as the next graph's "before"). Raises
        Unavailable (L3 cannot be reached), ConfigError (no ``kvcomm[cluster]``)."""
        l3 = None
        if self.config.cluster.enabled:
            if self.store is None:
                from ..tiers.l3 import L3Store

                self.store, self._own = L3Store.from_config(self.config.cluster), True
            l3 = self.store
        snaps = _snapshots(self.config, self.namespace, l3, self.hosts)
        self.reads += 1
        if not snaps and l3 is not None:
            raise Unavailable("no host has published its agents to L3: is `kvcomm node` "
                              "running on the hosts, and are the agents reading "
                              "(hot_key_sample > 0)?")
        self.last = snaps
        return snaps

    def graph(self, window: float = 1.0,
              sleep: Callable[[float], None] = time.sleep) -> Graph:
        """The graph of the rates since the previous read; with none yet (the first
        call, or the previous read failed), of the next ``window`` seconds, as
        :func:`observe`. Raises what :meth:`read` raises (the previous read is then
        forgotten: the next call observes its window again)."""
        before = self.last
        self.last = None
        if before is None:
            before = self.read()
            sleep(window)
        return graph_from(before, self.read())

    def close(self) -> None:
        """Close the store this observer opened (not one it was given)."""
        if self._own and self.store is not None:
            self.store.close()
            self.store, self._own = None, False
