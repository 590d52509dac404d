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
from .history import DELETE, GET, INFO, OK, PUT, HistoryWriter, Recorder, load_history, value_id
from .nemesis import FAULTS, Injection, Nemesis, fault_kinds
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
    l2_size: str = "8MB"
    watch_buffer: int = 256
    converge_timeout: float = 60.0
    gap: tuple[float, float] = (0.5, 3.0)  # seconds between faults
    realtime_margin: float | None = 0.05
    shared_deletes: bool = True  # processes also delete shared keys (on any host)
    strict_reads: bool = False  # stale own reads fail the run too
    log: Callable[[str], None] | None = None  # progress lines (None: quiet)

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
        if self.owned_keys < 1 or self.shared_keys < 1:
            raise InvalidArgument("owned_keys and shared_keys must be >= 1")
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

    @property
    def lost(self) -> int:
        return len(self.verdict.lost_keys)

    @property
    def ok(self) -> bool:
        return (self.converged and not self.lost and not self.verdict.of("phantom-read")
                and not self.errors and not (self.strict_reads and self.verdict.of("stale-read")))

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
               f"phantom reads {phantom}, stale own reads {stale}; lost = {self.lost}")
        if self.errors:
            out += f"; {len(self.errors)} errors"
        if not self.ok and self.directory:
            out += f"; details in {self.directory}/report.json"
        return out

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
            "directory": self.directory, "replay": self.replay,
        }


def key_class(key: str) -> str:
    """What a soak key is for: "owned keys", "shared keys", or "<fault> probes"."""
    parts = key.split("/")
    if len(parts) > 2 and parts[1] == "n":
        return f"{parts[2]} probes"
    return {"o": "owned keys", "s": "shared keys"}.get(parts[1] if len(parts) > 1 else "",
                                                      "other keys")


# ---------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class Workload:
    hosts: list[str]
    workers: int
    owned_keys: int
    shared_keys: int
    rate: float
    shared_deletes: bool = True

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
    result.replay = (f"kvcomm soak --hosts {opts.hosts} --seconds {opts.seconds:g} --seed {seed} "
                     f"--faults {','.join(sorted(kinds))} --workers {opts.workers} "
                     f"--rate {opts.rate:g}" + ("" if opts.shared_deletes
                                                 else " --no-shared-deletes"))
    log(f"kvcomm soak: seed {seed}; replay with `{result.replay}`; directory {base}")
    from .. import devcluster

    # hosts go through fault proxies only when a fault needs them (partitions)
    devcluster.up(opts.hosts, str(cluster_dir), l2_size=opts.l2_size,
                  watch_buffer=opts.watch_buffer, timeout=120.0,
                  proxies=any("proxy" in FAULTS[k].requires for k in kinds))
    target: DevClusterTarget | None = None
    procs: list[Any] = []
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    try:
        target = DevClusterTarget(cluster_dir, history_dir)
        wl = Workload(target.host_ids, opts.workers, opts.owned_keys, opts.shared_keys,
                      opts.rate, opts.shared_deletes)
        start_at = time.monotonic() + 1.0
        for i, host in enumerate(target.host_ids):
            for w in range(opts.workers):
                p = ctx.Process(target=_worker, daemon=True, name=f"soak-{host}-w{w}",
                                args=(target.configs[i], host, w, f"{seed}/{host}/{w}", wl,
                                      str(history_dir), stop, start_at, os.getpid()))
                p.start()
                procs.append(p)
        nemesis = Nemesis(target, kinds, seed, gap=opts.gap, log=log)
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
    return 0 if result.ok else 1


__all__ = ["SoakOptions", "SoakResult", "main", "run_soak", "snapshot", "wait_converged"]
