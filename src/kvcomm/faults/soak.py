"""``kvcomm soak``: a real dev cluster, a random workload, a nemesis, then a verdict.

What a run does
---------------
1. Brings up a dev cluster (:func:`kvcomm.devcluster.up`) whose hosts have a small
   L2 (``cache.l2_size``, so evictions happen) and a small change-feed ring
   (``cache.watch_buffer``, so it can overflow).
2. Starts ``workers`` agent processes per host. Each writes unique values
   (``"host-2/w1#812"``) and records every operation with its outcome
   (:mod:`kvcomm.faults.history`):

   * **owned keys** ``soak/o/<host>/w<i>/<n>``: only this process writes them (puts,
     deletes, small batches), so their final state must be exactly its last
     acknowledged operation, on every host and in L3;
   * **shared keys** ``soak/s/<n>``: every process on every host puts (and now and then
     deletes) them: the final value must be a written one, identical everywhere, and
     last-writer-wins must not have dropped an acknowledged write;
   * **counter keys** ``soak/c/<n>``: every process on every host increments them
     (``kv.incr``) by small deltas, negative ones too: the final value must be, on every
     host and in L3, the sum of every acknowledged increment (an unknown one may count);
   * reads of all of them, checked for phantoms (a value never written) and, for a
     process's own keys, for read-your-writes on its host.
3. Meanwhile the :class:`~kvcomm.faults.nemesis.Nemesis` injects faults drawn from the
   seed (:mod:`kvcomm.faults.kinds`) until the time is up and every kind has run once.
4. Stops the workload, heals everything, and waits (up to ``converge_timeout``) until
   every host agrees with L3: every host's daemon heartbeats, has nothing left to send
   (no backlog, nothing dirty) and no host's L2 changed while a full snapshot was taken,
   in which each key has the same state in L3 and on every host. A host's state of a key
   is its L2 record, or, when L2 does not hold the key, what its read path would answer
   (L3's, unless the host's filter of existing keys says it does not exist). Reading it
   this way changes nothing (a read through the API would fill L2 and could evict).
5. Checks the history against that final state (:mod:`kvcomm.faults.checker`) and prints
   one line: operations, faults injected by kind, converged (and how long it took after
   the heal), bad reads, ``lost = N`` (keys whose final state breaks a rule somewhere).
   Exit status 0 only when nothing was lost, no read was a phantom, the cluster
   converged, every fault healed and no process raised outside the KVCommError tree.

The seed (printed at the start and in the line) replays the same schedule of faults and
the same choices of operations (the interleaving of processes is the machine's).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core import codec
from ..core.versions import Version
from ..errors import InvalidArgument, KVCommError
from ..tiers.l2 import TAG_TOMBSTONE, key_hash
from ..tiers.l3 import CorruptRecord, L3Record, record_key
from .checker import ABSENT, Observed, Verdict, check
from .fault import FAULTS
from .history import DELETE, GET, INFO, OK, PUT, HistoryWriter, Recorder, load_history, value_id
from .nemesis import Injection, Nemesis, fault_kinds
from .target import DevClusterTarget

PREFIX = "soak/"


@dataclass
class SoakOptions:
    hosts: int = 3
    seconds: float = 600.0
    seed: int | None = None
    faults: list[str] | None = None  # None: every registered kind
    directory: str | None = None  # None: a temporary one, removed after a clean run
    workers: int = 2  # agent processes per host
    rate: float = 50.0  # operations per second per worker
    owned_keys: int = 32  # per worker
    shared_keys: int = 48
    counter_keys: int = 8  # kv.incr'd by every process (0: none)
    l2_size: str = "8MB"
    watch_buffer: int = 256
    converge_timeout: float = 60.0
    gap: tuple[float, float] = (0.5, 3.0)  # seconds between faults
    realtime_margin: float | None = 0.05
    shared_deletes: bool = True  # processes also delete shared keys (on any host)
    strict_reads: bool = False  # stale own reads fail the run too
    log: Callable[[str], None] | None = None  # progress lines (None: quiet)
    # the jepsen run (`kvcomm jepsen`): clients per host on a handful of strong keys,
    # their history checked for linearizability (faults/linearizability.py)
    strong_clients: int = 0
    strong_keys: int = 5
    strong_rate: float = 20.0  # operations per second per strong client
    cluster_settings: dict[str, Any] | None = None  # more cluster.* for every host
    # at least this many partition-host faults first, one after another (partition, both
    # sides keep writing, heal, heal -> convergence measured): `kvcomm jepsen --partitions`
    partitions: int = 0

    def validate(self) -> None:
        """Raises InvalidArgument naming the bad option."""
        if not 1 <= self.hosts <= 32:
            raise InvalidArgument("--hosts must be between 1 and 32")
        if not self.seconds > 0:
            raise InvalidArgument("--seconds/--minutes must be > 0")
        if not self.converge_timeout > 0:
            raise InvalidArgument("--converge-timeout must be > 0")
        if not 1 <= self.workers <= 64 or not self.rate > 0:
            raise InvalidArgument("--workers must be 1..64 and --rate > 0")
        if not 0 <= self.strong_clients <= 16 or not 1 <= self.strong_keys <= 64 \
                or not self.strong_rate > 0:
            raise InvalidArgument("--clients must be 0..16, --strong-keys 1..64, rates > 0")
        if not 0 <= self.partitions <= 10_000:
            raise InvalidArgument("--partitions must be 0..10000")
        if self.partitions and self.hosts < 2:
            raise InvalidArgument("--partitions needs at least 2 hosts (a partitioned host "
                                  "and one that is not)")
        if self.owned_keys < 1 or self.shared_keys < 1 or self.counter_keys < 0:
            raise InvalidArgument("owned_keys and shared_keys must be >= 1, counter_keys >= 0")
        if self.faults is not None:
            known = fault_kinds()
            bad = [f for f in self.faults if f not in known]
            if bad or not self.faults:
                raise InvalidArgument(f"--faults: unknown {bad}; choose from {', '.join(known)}")


@dataclass
class SoakResult:
    seed: int
    hosts: int
    workload_seconds: float = 0.0
    ops: dict[str, int] = field(default_factory=dict)  # "total", "ok", "info", per kind
    injections: list[Injection] = field(default_factory=list)
    faults: dict[str, int] = field(default_factory=dict)
    converged: bool = False
    converge_seconds: float | None = None
    verdict: Verdict = field(default_factory=Verdict)
    errors: list[str] = field(default_factory=list)  # heal failures, crashes, dead daemons
    directory: str = ""
    replay: str = ""
    strict_reads: bool = False
    # the jepsen run: the strong keys' history and its verdict, and heal -> convergence
    # of every partition (seconds; None: did not converge within the bound)
    strong: dict[str, Any] = field(default_factory=dict)
    partition_convergence: list[float | None] = field(default_factory=list)
    partitions_wanted: int = 0  # --partitions: the run fails with fewer healed and measured
    partitions_healed: int = 0  # partition-host faults injected and healed without error

    @property
    def lost(self) -> int:
        return len(self.verdict.lost_keys)

    @property
    def linearizable(self) -> bool:
        return not self.strong or self.strong.get("verdict") == "ok"

    @property
    def ok(self) -> bool:
        return (self.converged and not self.lost and not self.verdict.of("phantom-read")
                and not self.errors and not (self.strict_reads and self.verdict.of("stale-read"))
                and self.linearizable and None not in self.partition_convergence
                and len(self.partition_convergence) >= self.partitions_wanted)

    def convergence_line(self) -> str:
        """Heal -> convergence over the run's partitions: count, p50, p99, max."""
        times = sorted(t for t in self.partition_convergence if t is not None)
        n = len(self.partition_convergence)
        healed = (f"{self.partitions_healed} partitions healed"
                  + (f" ({self.partitions_wanted} wanted)" if self.partitions_wanted else ""))
        if not n:
            return f"{healed}, none measured" if self.partitions_wanted else "no partitions"
        failed = n - len(times)
        if not times:
            return f"{healed}, {n} measured, none converged"
        p50, p99 = times[len(times) // 2], times[min(len(times) - 1, int(len(times) * 0.99))]
        return (f"{healed}; {len(times)} of {n} converged after the heal: p50 {p50:.2f}s, "
                f"p99 {p99:.2f}s, max {times[-1]:.2f}s" + (f" ({failed} did not)" if failed else ""))

    def strong_line(self) -> str:
        st = self.strong
        if not st:
            return ""
        return (f"strong keys: {st['ops']:,} operations ({st['ok']:,} ok, {st['info']:,} "
                f"unknown, {st['fail']:,} failed) by {st['clients']} clients on {st['keys']} "
                f"keys: linearizable {st['verdict']}"
                + (f" ({', '.join(st['bad'])[:300]})" if st.get("bad") else ""))

    def line(self) -> str:
        faults = sum(self.faults.values())
        kinds = " ".join(f"{k} {n}" for k, n in self.faults.items())
        conv = (f"yes in {self.converge_seconds:.2f}s" if self.converged
                else "NO (timed out)")
        phantom = len(self.verdict.of("phantom-read"))
        stale = len(self.verdict.of("stale-read"))
        out = (f"kvcomm soak: seed {self.seed}, {self.hosts} hosts, "
               f"{self.workload_seconds:.0f}s: {self.ops.get('total', 0):,} operations "
               f"({self.ops.get('ok', 0):,} acknowledged, {self.ops.get('info', 0):,} unknown); "
               f"{faults} faults ({kinds}); converged {conv}; "
               f"phantom reads {phantom}, stale own reads {stale}; "
               f"{self.counter_line()}lost = {self.lost}")
        if self.errors:
            out += f"; {len(self.errors)} errors"
        if self.strong:
            out += f"; {self.strong_line()}; {self.convergence_line()}"
        elif self.partitions_wanted:
            out += f"; {self.convergence_line()}"
        if not self.ok and self.directory:
            out += f"; details in {self.directory}/report.json"
        return out

    def counter_line(self) -> str:
        """``kv.incr``'s figures: increments, counter keys, how many ended miscounted."""
        n = self.ops.get("incr", 0)
        if not n:
            return ""
        bad = len({a.key for a in self.verdict.of("miscounted")})
        return f"counters: {n:,} increments, miscounted keys {bad}; "

    def summary(self) -> list[str]:
        """The anomalies grouped by kind and class of key, one example each."""
        groups: dict[tuple[str, str], list[Any]] = {}
        for a in self.verdict.anomalies:
            groups.setdefault((a.kind, key_class(a.key)), []).append(a)
        out = []
        for (kind, cls), items in sorted(groups.items()):
            keys = len({a.key for a in items})
            out.append(f"{kind} x{len(items)} ({keys} keys, {cls}), e.g. {items[0]}")
        return out

    def to_json(self) -> dict[str, Any]:
        v = self.verdict
        return {
            "seed": self.seed, "hosts": self.hosts, "workload_seconds": self.workload_seconds,
            "ops": self.ops, "faults": self.faults,
            "injections": [i.to_json() for i in self.injections],
            "converged": self.converged, "converge_seconds": self.converge_seconds,
            "lost": self.lost, "lost_keys": v.lost_keys[:1000],
            "divergent_keys": v.divergent_keys[:1000],
            "anomalies": [{"kind": a.kind, "key": a.key, "place": a.place, "detail": a.detail}
                          for a in v.anomalies[:2000]],
            "anomaly_counts": dict(Counter(a.kind for a in v.anomalies)),
            "summary": self.summary(),
            "keys_checked": v.keys, "errors": self.errors, "ok": self.ok,
            "strong": self.strong, "partition_convergence": self.partition_convergence,
            "partitions": {"wanted": self.partitions_wanted, "healed": self.partitions_healed,
                           "measured": len(self.partition_convergence),
                           "converged": sum(t is not None for t in self.partition_convergence),
                           "summary": self.convergence_line()},
            "directory": self.directory, "replay": self.replay,
        }


def key_class(key: str) -> str:
    """What a soak key is for: "owned keys", "shared keys", or "<fault> probes"."""
    parts = key.split("/")
    if len(parts) > 2 and parts[1] == "n":
        return f"{parts[2]} probes"
    kinds = {"o": "owned keys", "s": "shared keys", "c": "counter keys"}
    return kinds.get(parts[1] if len(parts) > 1 else "", "other keys")


# ---------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class Workload:
    hosts: list[str]
    workers: int
    owned_keys: int
    shared_keys: int
    rate: float
    shared_deletes: bool = True
    counter_keys: int = 0

    def counters(self) -> list[str]:
        return [f"{PREFIX}c/{n}" for n in range(self.counter_keys)]

    def owned(self, host: str, w: int) -> list[str]:
        return [f"{PREFIX}o/{host}/w{w}/{n}" for n in range(self.owned_keys)]

    def shared(self) -> list[str]:
        return [f"{PREFIX}s/{n}" for n in range(self.shared_keys)]

    def everyone(self) -> list[str]:
        return [k for h in self.hosts for w in range(self.workers) for k in self.owned(h, w)]


def _worker(config: str, host: str, index: int, seed: str, wl: Workload, history: str,
            stop: Any, start_at: float, parent: int) -> None:
    """One agent process: random operations at ``wl.rate`` per second until ``stop``."""
    from .. import open as kv_open

    rng = random.Random(seed)
    process = f"{host}/w{index}"
    sink = HistoryWriter(Path(history) / f"{host}-w{index}.jsonl")
    errors = Path(history) / f"{host}-w{index}.errors"
    kv = kv_open(config=config)
    rec = Recorder(kv, process, host, sink)
    owned, shared, everyone = wl.owned(host, index), wl.shared(), wl.everyone()
    counters = wl.counters()
    interval = 1.0 / wl.rate
    while time.monotonic() < start_at and not stop.is_set():
        time.sleep(0.01)
    next_t = time.monotonic()
    try:
        while not stop.is_set() and os.getppid() == parent:
            r = rng.random()
            try:
                if r < 0.30:
                    rec.put(rng.choice(owned), rec.new_value())
                elif r < 0.38:
                    rec.delete(rng.choice(owned))
                elif r < 0.43:
                    keys = rng.sample(owned, rng.randint(2, 4))
                    rec.batch([(PUT, k, rec.new_value()) if rng.random() < 0.7
                               else (DELETE, k, None) for k in keys])
                elif r < 0.58:
                    rec.put(rng.choice(shared), rec.new_value())
                elif r < 0.60:
                    if wl.shared_deletes:
                        rec.delete(rng.choice(shared))
                    else:
                        rec.put(rng.choice(shared), rec.new_value())
                elif r < 0.66 and counters:
                    rec.incr(rng.choice(counters), rng.choice((1, 1, 1, 2, 5, -1, -3)))
                elif r < 0.75:
                    rec.get(rng.choice(owned))
                elif r < 0.87:
                    rec.get(rng.choice(shared))
                else:
                    rec.get(rng.choice(everyone))
            except Exception:  # outside the KVCommError tree: a bug; recorded, go on
                with open(errors, "a") as f:
                    f.write(traceback.format_exc() + "\n")
            next_t += interval * rng.uniform(0.5, 1.5)
            delay = next_t - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            elif delay < -1.0:
                next_t = time.monotonic()  # fell behind (a stopped daemon held the lock)
    finally:
        sink.close()
        kv.close()


STRONG = f"{PREFIX}strong/"  # the strong keys' prefix (cache.strong_prefixes of the run)


def _strong_worker(config: str, host: str, index: int, seed: str, keys: list[str], rate: float,
                   history: str, stop: Any, start_at: float, parent: int) -> None:
    """One client on the strong keys: get, put, compare-and-set, update and delete with
    unique values, each recorded as an invoke and its completion (ok, fail: certainly not
    applied, info: unknown) for the linearizability checker, with CLOCK_MONOTONIC times
    (one clock for every process of the machine)."""
    from .. import ABSENT, ConflictError, Unavailable
    from .. import open as kv_open

    rng = random.Random(seed)
    process = f"{host}/s{index}"
    path = Path(history) / f"{host}-s{index}.lin"
    errors = Path(history) / f"{host}-s{index}.errors"
    out = open(path, "a", buffering=1 << 16)  # noqa: SIM115 (closed in finally)
    counter = 0
    inflight: list[str] = []  # the function of the operation in flight, if any

    def event(kind: str, f: str, key: str, value: Any = None) -> None:
        if kind == "invoke":
            inflight[:] = [f]
        else:
            inflight.clear()
        out.write(json.dumps({"p": process, "t": kind, "f": f, "k": key, "v": value,
                              "at": time.monotonic()}) + "\n")

    def unknown_or_failed(exc: Exception) -> str:
        # refused at once, before anything was sent (the daemon reports etcd out of reach)
        return "fail" if isinstance(exc, Unavailable) and "partition mode" in str(exc) else "info"

    kv = kv_open(config=config)
    interval = 1.0 / rate
    while time.monotonic() < start_at and not stop.is_set():
        time.sleep(0.01)
    next_t = time.monotonic()
    try:
        while not stop.is_set() and os.getppid() == parent:
            key = rng.choice(keys)
            r = rng.random()
            counter += 1
            new = f"{process}#{counter}"
            try:
                if r < 0.40:
                    event("invoke", "get", key)
                    try:
                        v = kv.get(key)
                    except Unavailable:
                        event("fail", "get", key)  # a read of unknown outcome tells nothing
                    else:
                        event("ok", "get", key, v)
                elif r < 0.65:
                    event("invoke", "put", key, new)
                    try:
                        kv.put(key, new)
                    except Unavailable as exc:
                        event(unknown_or_failed(exc), "put", key)
                    else:
                        event("ok", "put", key)
                elif r < 0.85:
                    event("invoke", "get", key)
                    try:
                        item = kv.get_item(key)
                    except Unavailable:
                        event("fail", "get", key)
                        continue
                    old = None if item is None else item.value
                    event("ok", "get", key, old)
                    event("invoke", "cas", key, [old, new])
                    try:
                        kv.put(key, new, expect=ABSENT if item is None else item.version)
                    except ConflictError:
                        event("ok", "cas", key, False)
                    except Unavailable as exc:
                        event(unknown_or_failed(exc), "cas", key)
                    else:
                        event("ok", "cas", key, True)
                elif r < 0.95:
                    # update(): fn may run more than once; the committed value was computed
                    # from the last value fn saw: a cas(last seen, new) that succeeded
                    seen: list[Any] = []

                    def fn(old: Any, seen: list[Any] = seen, new: str = new) -> str:
                        seen.append(old)
                        return new

                    t_inv = time.monotonic()
                    try:
                        kv.update(key, fn)
                    except Unavailable as exc:
                        if seen:  # it got as far as a write: its outcome may be unknown
                            _emit(out, process, "cas", key, [seen[-1], new], t_inv,
                                  unknown_or_failed(exc), None)
                    else:
                        _emit(out, process, "cas", key, [seen[-1], new], t_inv, "ok", True)
                else:
                    event("invoke", "delete", key)
                    try:
                        deleted = kv.delete(key)
                    except Unavailable as exc:
                        event(unknown_or_failed(exc), "delete", key)
                    else:
                        event("ok", "delete", key, deleted)
            except Exception:  # outside the contract: a bug; recorded, go on
                with open(errors, "a") as f:
                    f.write(traceback.format_exc() + "\n")
                if inflight:  # what was in flight: unknown
                    event("info", inflight[0], key)
            next_t += interval * rng.uniform(0.5, 1.5)
            delay = next_t - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            elif delay < -1.0:
                next_t = time.monotonic()
    finally:
        out.close()
        kv.close()


def _emit(out: Any, process: str, f: str, key: str, value: Any, t_inv: float, outcome: str,
          result: Any) -> None:
    out.write(json.dumps({"p": process, "t": "invoke", "f": f, "k": key, "v": value,
                          "at": t_inv}) + "\n")
    out.write(json.dumps({"p": process, "t": outcome, "f": f, "k": key, "v": result,
                          "at": time.monotonic()}) + "\n")


def check_strong(history_dir: Path, clients: int, keys: int) -> dict[str, Any]:
    """Load the strong clients' histories and check them (faults/linearizability.py).
    Returns {"ops", "ok", "info", "fail", "verdict", "keys", "bad", "clients"}."""
    from . import linearizability as lin

    events: list[lin.Event] = []
    for path in sorted(history_dir.glob("*.lin")):
        for line in path.read_text().splitlines():
            try:
                d = json.loads(line)
            except ValueError:
                continue  # a worker killed mid-line
            v = d["v"]
            if d["f"] == "cas" and d["t"] == "invoke":
                v = tuple(v)
            events.append(lin.Event(d["p"], d["t"], d["f"], d["k"], v, d["at"]))
    # a worker killed with an operation in flight: its invocation stays, unknown
    # (operations() counts an invocation never completed as info)
    # The per-process ordering is fixed (a process invokes one at a time) but two
    # lines written in one microsecond keep their file order: sort is stable
    result = lin.check(events)
    counts = Counter(e.type for e in events if e.type != "invoke")
    bad = [kr.explain() for kr in result.keys.values() if kr.verdict != "ok"]
    return {"ops": sum(1 for e in events if e.type == "invoke"), "ok": counts["ok"],
            "info": counts["info"], "fail": counts["fail"], "verdict": result.verdict,
            "keys": keys, "clients": clients, "bad": bad[:5]}


# ---------------------------------------------------------------------- final state


@dataclass
class Snapshot:
    final: dict[str, dict[str, Observed]]
    quiet: bool  # every daemon alive, nothing waiting to be sent
    heads: tuple[int, ...]
    why: str = ""  # why not quiet

    def agree(self) -> list[str]:
        """Keys whose state differs between places."""
        places = list(self.final.values())
        keys = set().union(*(set(p) for p in places))
        return [k for k in keys
                if not all(p.get(k, ABSENT).same(places[0].get(k, ABSENT)) for p in places[1:])]


def _quiescence(target: DevClusterTarget) -> tuple[bool, tuple[int, ...], str]:
    heads = []
    why = []
    for i, host in enumerate(target.host_ids):
        seg = target.segment(i)
        heads.append(seg.feed_head())
        if not target.daemon_alive(i):
            why.append(f"{host}'s daemon is not heartbeating")
        backlog = seg.feed_head() - seg.sync_cursor
        if backlog:
            why.append(f"{host} has {backlog} feed events not yet in L3")
        dirty = len(seg.dirty_keys())
        if dirty:
            why.append(f"{host} has {dirty} dirty records")
    return not why, tuple(heads), "; ".join(why)


def _l3_states(target: DevClusterTarget, keys: list[str]) -> dict[str, Observed]:
    l3 = target.l3()
    out: dict[str, Observed] = {}
    raws = l3._call(lambda: l3.rc.mget_nonatomic([record_key(k) for k in keys]))
    for key, raw in zip(keys, raws, strict=True):
        if raw is None:
            continue
        try:
            rec = L3Record.decode(raw)
        except CorruptRecord:
            out[key] = Observed(True, "<corrupt record>", None)
            continue
        version = Version(rec.vector, rec.hlc)
        if rec.tombstone:
            out[key] = Observed(False, None, version)
        else:
            out[key] = Observed(True, _vid(rec.tag, rec.meta, rec.value), version)
    return out


def _vid(tag: int, meta: bytes, payload: bytes) -> str | None:
    if tag == codec.STR:  # skip decoding the padding of large values
        return payload.split(b"|", 1)[0].decode("utf-8", "replace")
    try:
        return value_id(codec.decode(tag, meta, payload))
    except (ValueError, TypeError, KVCommError):
        return "<undecodable>"


def snapshot(target: DevClusterTarget, keys: set[str]) -> Snapshot:
    """Every key's state in L3 and on every host, plus whether the cluster was quiet
    (and unchanged: the same L2 feed heads) across the whole snapshot."""
    quiet1, heads1, why = _quiescence(target)
    l3 = target.l3()
    all_keys = set(keys)
    all_keys.update(k.decode("utf-8", "surrogatepass") for k in l3._call(
        lambda: [k for k in l3.scan_keys()]) if k.startswith(PREFIX.encode()))
    for i in range(target.hosts):
        all_keys.update(k for k in target.segment(i).keys() if k.startswith(PREFIX))
    ordered = sorted(all_keys)
    l3_state = _l3_states(target, ordered)
    final: dict[str, dict[str, Observed]] = {"l3": l3_state}
    for i, host in enumerate(target.host_ids):
        client = target.client(i)
        seg = client._seg
        kf = client._key_filter()
        state: dict[str, Observed] = {}
        for key in ordered:
            kb = key.encode("utf-8", "surrogatepass")
            rec = seg.read(kb, key_hash(kb))
            if rec is not None:
                version = client._version(rec.counter, rec.hlc, rec.vvx)
                if rec.tag == TAG_TOMBSTONE:  # deleted (and the host knows it: no L3 read)
                    state[key] = Observed(False, None, version)
                else:
                    state[key] = Observed(True, _vid(rec.tag, rec.meta, rec.value or b""), version)
                continue
            if kf is not None and kf.ready and not kf.may_exist(kb):
                continue  # the host answers "absent" without asking L3
            seen = l3_state.get(key)
            if seen is not None and seen.present:
                state[key] = seen
        final[host] = state
    quiet2, heads2, why2 = _quiescence(target)
    quiet = quiet1 and quiet2 and heads1 == heads2
    return Snapshot(final, quiet, heads2, why or why2 or ("" if quiet else "L2 changed"))


def wait_converged(target: DevClusterTarget, keys: set[str], timeout: float,
                   ) -> tuple[bool, float, Snapshot]:
    """Snapshots until the cluster is quiet and every key agrees everywhere, or
    ``timeout`` seconds. Returns (converged, seconds, the last snapshot)."""
    start = time.monotonic()
    while True:
        try:
            snap = snapshot(target, keys)
        except KVCommError as exc:  # L3 still recovering, say: try again
            snap = Snapshot({}, False, (), f"snapshot failed: {exc}")
        if snap.final and snap.quiet and not snap.agree():
            return True, time.monotonic() - start, snap
        if time.monotonic() - start > timeout:
            return False, time.monotonic() - start, snap
        time.sleep(0.1)


# ---------------------------------------------------------------------- the run


def run_soak(opts: SoakOptions) -> SoakResult:
    """Run one soak (see the module docstring). Raises KVCommError when the cluster
    cannot be started; every other failure is in the result."""
    opts.validate()
    seed = opts.seed if opts.seed is not None else random.SystemRandom().getrandbits(32)
    log = opts.log or (lambda line: None)
    own_dir = opts.directory is None
    base = Path(opts.directory or tempfile.mkdtemp(prefix="kvcomm-soak-")).resolve()
    base.mkdir(parents=True, exist_ok=True)
    cluster_dir, history_dir = base / "cluster", base / "history"
    history_dir.mkdir(exist_ok=True)
    result = SoakResult(seed, opts.hosts, directory=str(base), strict_reads=opts.strict_reads)
    kinds = opts.faults if opts.faults is not None else fault_kinds()
    if opts.partitions and "partition-host" not in kinds:
        kinds = [*kinds, "partition-host"]
    result.partitions_wanted = opts.partitions
    result.replay = (f"kvcomm soak --hosts {opts.hosts} --seconds {opts.seconds:g} --seed {seed} "
                     f"--faults {','.join(sorted(kinds))} --workers {opts.workers} "
                     f"--rate {opts.rate:g}" + ("" if opts.shared_deletes
                                                 else " --no-shared-deletes")
                     + ("" if opts.counter_keys == 8 else f" --counter-keys {opts.counter_keys}"))
    if opts.strong_clients:
        result.replay = result.replay.replace("kvcomm soak", "kvcomm jepsen", 1) + \
            f" --clients {opts.strong_clients} --strong-keys {opts.strong_keys}"
    if opts.partitions:
        result.replay = result.replay.replace("kvcomm soak", "kvcomm jepsen", 1) + \
            f" --partitions {opts.partitions}"
    log(f"kvcomm soak: seed {seed}; replay with `{result.replay}`; directory {base}")
    from .. import devcluster

    # hosts go through fault proxies only when a fault needs them (partitions)
    devcluster.up(opts.hosts, str(cluster_dir), l2_size=opts.l2_size,
                  watch_buffer=opts.watch_buffer, timeout=120.0,
                  proxies=any("proxy" in FAULTS[k].requires for k in kinds),
                  strong_prefixes=[STRONG] if opts.strong_clients else (),
                  cluster_settings=opts.cluster_settings)
    target: DevClusterTarget | None = None
    procs: list[Any] = []
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    try:
        target = DevClusterTarget(cluster_dir, history_dir)
        wl = Workload(target.host_ids, opts.workers, opts.owned_keys, opts.shared_keys,
                      opts.rate, opts.shared_deletes, opts.counter_keys)
        start_at = time.monotonic() + 1.0
        for i, host in enumerate(target.host_ids):
            for w in range(opts.workers):
                p = ctx.Process(target=_worker, daemon=True, name=f"soak-{host}-w{w}",
                                args=(target.configs[i], host, w, f"{seed}/{host}/{w}", wl,
                                      str(history_dir), stop, start_at, os.getpid()))
                p.start()
                procs.append(p)
            strong_keys = [f"{STRONG}{n}" for n in range(opts.strong_keys)]
            for c in range(opts.strong_clients):
                p = ctx.Process(target=_strong_worker, daemon=True, name=f"jepsen-{host}-s{c}",
                                args=(target.configs[i], host, c, f"{seed}/{host}/s{c}",
                                      strong_keys, opts.strong_rate, str(history_dir), stop,
                                      start_at, os.getpid()))
                p.start()
                procs.append(p)
        nemesis = Nemesis(target, kinds, seed, gap=opts.gap, log=log,
                          forced=["partition-host"] * opts.partitions)
        while time.monotonic() < start_at:
            time.sleep(0.01)
        t0 = time.monotonic()
        try:
            result.injections = nemesis.run(opts.seconds)
        finally:
            stop.set()
            result.workload_seconds = time.monotonic() - t0
            for p in procs:
                p.join(60)
                if p.is_alive():
                    result.errors.append(f"worker {p.name} did not stop within 60s; killed")
                    p.kill()
                    p.join()
                elif p.exitcode:
                    result.errors.append(f"worker {p.name} exited with {p.exitcode}")
        result.faults = nemesis.counts()
        result.errors += nemesis.heal_failures
        result.errors += [f"{i.kind} (step {i.step}) failed: {i.error}"
                          for i in result.injections if i.error and "heal failed" not in i.error]
        for r in target._recorders.values():
            r.sink.flush()
        history = load_history(history_dir)
        for path in sorted(history_dir.glob("*.errors")):
            first = path.read_text().strip().splitlines()[-1:]
            result.errors.append(f"{path.stem} raised outside the KVCommError tree: "
                                 f"{first[0] if first else '?'} (see {path})")
        writes = {op.key for op in history if op.kind != GET}
        log(f"workload stopped after {result.workload_seconds:.0f}s; "
            f"{len(history):,} operations; waiting for convergence")
        converged, took, snap = wait_converged(target, writes, opts.converge_timeout)
        result.converged, result.converge_seconds = converged, round(took, 3)
        if not converged:
            result.errors.append(f"not converged after {took:.0f}s: {snap.why or 'keys differ'}")
        skewed = any(FAULTS[k].skews_clocks for k in kinds)  # no shared clock to rely on
        result.verdict = check(history, snap.final,
                               realtime_margin=None if skewed else opts.realtime_margin)
        if opts.strong_clients:
            result.strong = check_strong(history_dir, opts.strong_clients * opts.hosts,
                                         opts.strong_keys)
            log(result.strong_line())
        result.partition_convergence = [
            i.effect.get("converge_s") for i in result.injections
            if i.kind == "partition-host" and i.ok and "converge_s" in i.effect]
        result.partitions_healed = sum(1 for i in result.injections if i.kind == "partition-host"
                                       and i.ok and i.healed_at is not None)
        if len(result.partition_convergence) < opts.partitions:
            result.errors.append(
                f"{len(result.partition_convergence)} partitions measured of the "
                f"{opts.partitions} wanted (--partitions)")
        outcomes = Counter(op.outcome for op in history)
        result.ops = {"total": len(history), "ok": outcomes[OK], "info": outcomes[INFO],
                      **{kind: n for kind, n in Counter(op.kind for op in history).items()}}
    finally:
        stop.set()
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if target is not None:
            target.close()
        devcluster.down(str(cluster_dir))
    (base / "report.json").write_text(json.dumps(result.to_json(), indent=1))
    if result.ok and own_dir:
        shutil.rmtree(base, ignore_errors=True)
        result.directory = ""
    return result


def main(argv_opts: dict[str, Any], as_json: bool = False) -> int:
    """The CLI: run, print one line (or the JSON report), exit 0 only on a clean run."""
    opts = SoakOptions(**argv_opts)
    if opts.log is None:
        opts.log = lambda line: print(line, file=sys.stderr, flush=True)
    result = run_soak(opts)
    if as_json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        if not result.ok:
            for line in result.summary():
                print(f"  {line}", file=sys.stderr)
            for e in result.errors[:10]:
                print(f"  error: {e}", file=sys.stderr)
        print(result.line())
        if not result.linearizable:
            for b in result.strong.get("bad", []):
                print(f"  {b}", file=sys.stderr)
    return 0 if result.ok else 1


JEPSEN_FAULTS = ["partition-host", "kill-etcd-member", "pause-etcd-member", "drop-connections"]


def jepsen_main(argv_opts: dict[str, Any], as_json: bool = False) -> int:
    """``kvcomm jepsen``: the soak with strong clients (3 per host by default) on a handful
    of strong keys, the faults that matter to them (partitions, etcd members killed and
    paused, the leader included, connections dropped), the strong history checked for
    linearizability and every partition's heal -> convergence measured. Exit 0 only when
    the history is linearizable, nothing acknowledged was lost and every host converged."""
    opts = dict(argv_opts)
    opts.setdefault("faults", None)
    if opts["faults"] is None:
        opts["faults"] = list(JEPSEN_FAULTS)
    opts.setdefault("strong_clients", 3)
    # a delete on a host that does not see a key yet is a no-op in cluster mode (a known
    # rule of eventual keys, issue 7's soak report): the jepsen run is about strong keys
    opts.setdefault("shared_deletes", False)
    settings = {"lease_ttl": 3.0, **(opts.get("cluster_settings") or {})}
    opts["cluster_settings"] = settings
    return main(opts, as_json=as_json)


__all__ = ["SoakOptions", "SoakResult", "jepsen_main", "main", "run_soak", "snapshot",
           "wait_converged"]
