"""The load of a real cluster, as a :class:`~kvcomm.balance.model.ClusterView`.

Two :func:`sample`\\ s a window apart make one view (:func:`view_between`):

* **per node** (every Redis master), from ``INFO``: its load is the commands it
  processed per second over the window (``total_commands_processed``: the commands a
  script runs count too), its CPU the seconds of CPU it used per second
  (``used_cpu_sys + used_cpu_user``), its memory ``used_memory``, its latency the mean
  time of a command over the window (``INFO commandstats``) or, when Redis' latency
  monitor is on, the latest spike ``LATENCY LATEST`` reports, whichever is larger.
  Its capacity is estimated from the cluster itself: the commands a node runs per
  second of CPU, the median over the nodes busy enough to tell (at least
  MIN_CPU_TO_TELL of a core), else DEFAULT_CAPACITY — the nodes are taken to be alike.
* **per slot**, from the node daemons: each saves, for every group, the Redis commands
  it caused there (its pushes with the commands their script runs, its feed reads:
  ``kvn:{host}:load``, cumulative); summed over the hosts and taken per second over
  the window, that is the slot's load, in the unit of the nodes' loads (a group lies
  in one slot: :mod:`kvcomm.tiers.groups`). The daemons save their counts every couple
  of seconds (``node.prewarm.HOT_EVERY``): a window needs a few of those periods, or
  it sees partial counts or none. The hosts' hot keys
  (``kvn:{host}:hot``, from their read sketches) are not load on Redis — agents' reads
  are served by L1 and L2 — but they say which keys a slot holds that agents care
  about: the driver names them in its log. A slot's bytes are estimated from a sample
  of its keys (``MEMORY USAGE``) times their count, for the slots that carry load.

Load no daemon explains (other clients of the same Redis, the daemons' sweeps, agents'
L2-miss reads) shows in the nodes' loads only.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..tiers.groups import Groups
from ..tiers.l3 import L3Store
from .model import ClusterView, NodeView

__all__ = ["DEFAULT_CAPACITY", "NodeSample", "Sample", "sample", "view_between"]

DEFAULT_CAPACITY = 100_000.0  # commands per second a Redis master serves on one core
MIN_CPU_TO_TELL = 0.05  # of a core: a node busier than that tells its capacity
BYTES_SAMPLE = 8  # keys of a slot whose MEMORY USAGE is read to estimate its bytes
BYTES_SLOTS = 256  # slots per node (the most loaded) whose bytes are estimated


@dataclass(frozen=True)
class NodeSample:
    name: str
    commands: int  # total_commands_processed
    cpu: float  # used_cpu_sys + used_cpu_user, seconds
    memory: int  # used_memory
    usec: int  # the commands' total time (INFO commandstats)
    calls: int  # their count
    spike_ms: float  # LATENCY LATEST's largest latest value (0: monitor off)
    slots: frozenset[int]


@dataclass(frozen=True)
class Sample:
    time: float  # the caller's clock, seconds
    nodes: Mapping[str, NodeSample]
    group_ops: Mapping[int, int]  # group → operations, summed over the hosts (cumulative)
    hot: Mapping[str, list[str]] = field(default_factory=dict)  # host → its hot keys


def _info(conn: Any, section: str) -> dict[str, Any]:
    return dict(conn.info(section))


def _node_sample(conn: Any, name: str, slots: frozenset[int]) -> NodeSample:
    info = _info(conn, "all")
    usec = calls = 0
    for k, v in info.items():
        if k.startswith("cmdstat_") and isinstance(v, dict):
            usec += int(v.get("usec", 0))
            calls += int(v.get("calls", 0))
    spike = 0.0
    try:
        for event in conn.execute_command("LATENCY LATEST") or []:
            spike = max(spike, float(event[2]))  # [event, time, latest ms, max ms]
    except Exception:  # LATENCY refused (ACLs): the mean command time stands alone
        pass
    return NodeSample(name, int(info.get("total_commands_processed", 0)),
                      float(info.get("used_cpu_sys", 0.0)) + float(info.get("used_cpu_user", 0.0)),
                      int(info.get("used_memory", 0)), usec, calls, spike, slots)


def sample(store: L3Store, masters: Mapping[str, frozenset[int]],
           clock: Callable[[], float] = time.monotonic, hosts: list[str] | None = None) -> Sample:
    """One sample of every master in ``masters`` (name → the slots it serves) and of
    every host's per-group counts (``hosts``: found in L3 when None). Raises
    Unavailable."""
    rc: Any = store.rc
    nodes = {}
    for name, slots in masters.items():
        host, _, port = name.rpartition(":")
        node = rc.get_node(host=host, port=int(port))
        nodes[name] = store._call(lambda node=node, name=name, slots=slots: _node_sample(
            rc.get_redis_connection(node), name, slots))
    ops: dict[int, int] = {}
    hot: dict[str, list[str]] = {}
    for h in (store.hosts() if hosts is None else hosts):
        for g, n in store.load_counts(h).items():
            ops[g] = ops.get(g, 0) + n
        hot[h] = store.load_hot(h)
    return Sample(clock(), nodes, ops, hot)


def view_between(a: Sample, b: Sample, groups: Groups,
                 slot_bytes: Mapping[int, int] | None = None) -> ClusterView:
    """The cluster over the window from ``a`` to ``b`` (see the module's doc). Nodes
    present in both samples only; a count that went down (a host's daemon restarted
    without its counts) counts as 0."""
    dt = max(b.time - a.time, 1e-9)
    loads: dict[str, tuple[float, float, float, NodeSample]] = {}
    for name, nb in b.nodes.items():
        na = a.nodes.get(name)
        if na is None:
            continue
        load = max(0, nb.commands - na.commands) / dt
        cpu = max(0.0, nb.cpu - na.cpu) / dt
        calls = nb.calls - na.calls
        mean_ms = (nb.usec - na.usec) / calls / 1000 if calls > 0 else 0.0
        loads[name] = (load, cpu, max(mean_ms, nb.spike_ms), nb)
    rates = [load / cpu for load, cpu, _, _ in loads.values() if cpu >= MIN_CPU_TO_TELL]
    capacity = statistics.median(rates) if rates else DEFAULT_CAPACITY
    nodes = tuple(NodeView(name, max(capacity, 1.0), load, cpu, nb.memory, lat)
                  for name, (load, cpu, lat, nb) in sorted(loads.items()))
    owner = {s: name for name, (_, _, _, nb) in loads.items() for s in nb.slots}
    slot_load: dict[int, float] = {}
    for g, n in b.group_ops.items():
        d = n - a.group_ops.get(g, 0)
        slot = groups.slot(g)
        if d > 0 and slot in owner:
            slot_load[slot] = slot_load.get(slot, 0.0) + d / dt
    return ClusterView(nodes, slot_load, dict(slot_bytes or {}),
                       {s: owner[s] for s in slot_load}, b.time)


def estimate_bytes(store: L3Store, view: ClusterView) -> dict[int, int]:
    """Each loaded slot's bytes (the most loaded BYTES_SLOTS per node): its group's
    change feed and counter, plus the MEMORY USAGE of a few of its other keys times
    their count. Raises Unavailable."""
    rc: Any = store.rc
    out: dict[int, int] = {}
    for n in view.nodes:
        slots = sorted((s for s in view.slots_of(n.id) if view.load_of(s) > 0),
                       key=view.load_of, reverse=True)[:BYTES_SLOTS]
        if not slots:
            continue
        host, _, port = n.id.rpartition(":")
        conn = rc.get_redis_connection(rc.get_node(host=host, port=int(port)))
        conn.set_response_callback("CLUSTER GETKEYSINSLOT", lambda r, **kw: r)

        def run(conn: Any = conn, slots: list[int] = slots) -> None:
            pipe = conn.pipeline(transaction=False)
            for s in slots:
                pipe.execute_command("CLUSTER COUNTKEYSINSLOT", s)
                pipe.execute_command("CLUSTER GETKEYSINSLOT", s, BYTES_SAMPLE)
            replies = pipe.execute(raise_on_error=False)
            pipe = conn.pipeline(transaction=False)
            sampled = []
            for i, s in enumerate(slots):
                count, keys = replies[2 * i], replies[2 * i + 1]
                if isinstance(count, Exception) or isinstance(keys, Exception):
                    continue
                g = store.groups.at_slot(s)
                own = [store.groups.feed_key(g).encode(), store.groups.seq_key(g).encode()
                       ] if g is not None else []
                keys = [k for k in keys if k not in own][:BYTES_SAMPLE]
                sampled.append((s, max(0, int(count) - len(own)), len(keys), len(own)))
                for k in [*own, *keys]:  # (the feed can be most of a slot's bytes)
                    pipe.execute_command("MEMORY USAGE", k, "SAMPLES", "0")
            sizes = pipe.execute(raise_on_error=False)
            at = 0
            for s, count, n_keys, n_own in sampled:
                got = [x if isinstance(x, int) else 0 for x in sizes[at:at + n_own + n_keys]]
                at += n_own + n_keys
                fixed, rest = sum(got[:n_own]), got[n_own:]
                out[s] = fixed + (int(sum(rest) / len(rest) * count) if rest else 0)

        store._call(run)
    return out
