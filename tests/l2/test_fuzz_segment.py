"""The segment fuzzer: a corrupted L2 segment never kills the process that opens it.

Each case corrupts a copy of a realistic segment (header words, consistent-looking
layouts, slots, block meta bytes, record headers with lengths near 2**64, free-list heads
and links, the feed and its head, the pin and deferred tables, the hot-key sketch and
top-k, random bytes, truncated files) and has a fresh process open it and use the whole
public API, then ``kvcomm purge`` it. The process must work or raise a KVCommError:
never a signal, another exception type, or a hang past its deadline. How cases are made
and run: tests/support/fuzz_segment.py.

Knobs (environment):

* ``FUZZ_SEED``: seeds the base segment and every case (default: random, printed).
* ``FUZZ_CASES``: random cases to run (default 40; the slow test 300; ``make fuzz`` 20000).
* ``FUZZ_CASE``: run only this case number (a replay: the failure report prints it).
* ``FUZZ_JOBS``: cases in flight at once (default 3: a hung case mostly sleeps).
* ``FUZZ_DEADLINE``: seconds a case may take before it counts as a hang (default 25: one
  lock timeout for the first writer and one for purge fit in it).
* ``FUZZ_REPORT``: where the full report goes (default /tmp/kvcomm-fuzz-<seed>.txt).
* ``FUZZ_GDB=1``: replay the first case of each signal group under gdb and put its C
  frames in the report (``make fuzz`` sets it). By hand: ``gdb -batch -ex run -ex bt
  --args .venv/bin/python -m tests.support.fuzz_segment <seed> <case>``.

Replay one failure: ``FUZZ_SEED=<seed> FUZZ_CASE=<n> .venv/bin/python -m pytest -q
tests/l2/test_fuzz_segment.py -k never_crash``. The long run: ``make fuzz``.
"""

from __future__ import annotations

import inspect
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kvcomm.tiers import l2
from tests.support import fuzz_segment as fz

pytestmark = pytest.mark.multiprocess


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    return int(v) if v else default


@pytest.fixture(scope="module")
def fuzz() -> Iterator[tuple[fz.Base, Any, int]]:
    seed = _env_int("FUZZ_SEED", random.randrange(2**32))
    print(f"FUZZ_SEED={seed}")
    ctx = fz.forkserver_context()
    base, views = fz.build_base(seed, f"fuzzbase-{os.getpid()}-{uuid.uuid4().hex[:6]}", ctx)
    yield base, ctx, seed
    views.clear()  # this process's pins were in the base: they stay live until now


def test_base_segment_has_everything_worth_corrupting(fuzz: tuple[fz.Base, Any, int]) -> None:
    base, _, _ = fuzz
    info = base.info
    a = fz.Anatomy(base.data)
    assert info["evictions"] > 0, info
    assert info["feed_events"] > 2 * info["feed_capacity"], "the change feed never wrapped"
    assert info["pinned_deferred_blocks"] >= 2, "want a live and a dead view's deferred blocks"
    assert len(a.pins) >= 3 and len(a.deferred) >= 2
    owners = {a.q[(a.lay.pins_off >> 3) + fz.PIN_WORDS * i + 1] for i in a.pins}
    assert len(owners) >= 2, "want pins of a live and of a dead process (owner tokens)"
    assert {"arr/kept", "arr/live", "arr/dead"} <= set(base.arrays)
    assert base.hot and base.hot[0][0] == "hot/0"
    assert len(base.keys) > 50 and len(a.free) > 0 and len(a.slots["tomb"]) > 0
    sizes = {1 << order for _, order, free in a.blocks if not free}
    assert len(sizes) >= 5, f"want records of several sizes, got blocks of {sorted(sizes)}"


def test_the_base_keeps_both_deferred_blocks_however_late_its_snapshot(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A loaded machine: the base's snapshot comes over a second after the dead child's
    last sweep (H_DEAD_CHECK_MS has passed), and the metrics flusher thread's round comes
    then. A writer-lock taker of this process (a read's hot-key flush, as kv.keys()
    makes; the flusher thread) sweeps the dead child's pin and frees its deferred block:
    before the snapshot (one parked block) or during it, from the flusher (a torn copy:
    the header counting 2 parked blocks, the table holding 1, a block that nothing
    references, so a clean case's check() finds a problem: FUZZ_SEED=1222714837 in CI)."""
    import multiprocessing.context as mpc

    from kvcomm.metrics import agent

    start, join = mpc.ForkServerProcess.start, mpc.ForkServerProcess.join
    pinners: dict[int, str] = {}  # the dead pinner's process -> its namespace

    def start_pinner(self: Any) -> None:
        target, args = self._target, self._args  # (start() deletes them)
        start(self)
        if target is fz._dead_pinner:
            pinners[id(self)] = args[0]

    def late_join(self: Any, timeout: float | None = None) -> None:
        join(self, timeout)
        if id(self) not in pinners:
            return
        seg = l2.L2Segment(pinners.pop(id(self)), create_layout=None, host_id="")
        try:
            seg._q[fz.l2.H_DEAD_CHECK_MS] = 0  # the next lock taker looks for dead pins
        finally:
            seg.close()
        for meter in list(agent._STATE.meters):  # the flusher thread's round comes now
            meter.due = 0.0
        agent.flush_all(due_only=True)

    monkeypatch.setattr(mpc.ForkServerProcess, "start", start_pinner)
    monkeypatch.setattr(mpc.ForkServerProcess, "join", late_join)
    base, views = fz.build_base(1222714837, f"fuzzlate-{os.getpid()}-{uuid.uuid4().hex[:6]}",
                                fz.forkserver_context())
    try:
        a = fz.Anatomy(base.data)
        parked = (base.info["pinned_deferred_blocks"], a.q[fz.l2.H_DEFERRED], len(a.deferred))
        assert parked == (2, 2, 2), "(info, header, table): the dead child's block was swept"
        assert not pinners, "the dead pinner was never joined (late_join missed it)"
    finally:
        views.clear()


def test_harness_tells_every_failure_apart(fuzz: tuple[fz.Base, Any, int], tmp_path: Any) -> None:
    """The fuzzer can fail: a clean copy passes every step, and a planted crash, exception
    and hang are each classified as such (so a passing run means something)."""
    base, ctx, seed = fuzz
    control = {0: "", 1: "segv", 2: "exception", 3: "hang"}
    results = fz.run_cases(base, seed, control, jobs=4, deadline=30, workdir=str(tmp_path),
                           ctx=ctx, control=control)
    clean, segv, exc, hang = results
    assert clean.status == "ok", fz.summarize(results, seed)
    assert all(outcome == "ok" for _, outcome, _ in clean.steps), clean.steps
    assert clean.hits >= 10 and clean.problems == 0
    assert {s[0] for s in clean.steps} >= {"open", "get", "get_view", "put", "delete", "update",
                                           "batch", "watch", "hot_keys", "check", "purge"}
    assert (segv.status, segv.cause, segv.step) == ("signal", "SIGSEGV", "get")
    assert (exc.status, exc.cause) == ("exception", "KeyError")
    assert hang.status == "hang" and hang.step == "get" and "fuzz_segment.py" in hang.where


def test_corrupted_segments_never_crash(fuzz: tuple[fz.Base, Any, int], tmp_path: Any) -> None:
    """Every crafted case and FUZZ_CASES random ones (default 40 in `make test`; the slow
    test below runs 300, `make fuzz` 20000)."""
    _never_crash(fuzz, tmp_path, _env_int("FUZZ_CASES", 40))


@pytest.mark.slow
def test_300_random_corrupted_segments(fuzz: tuple[fz.Base, Any, int], tmp_path: Any) -> None:
    """The same with 300 random cases (`make test-slow`; its name leaves it out of `make
    fuzz`'s ``-k never_crash``)."""
    _never_crash(fuzz, tmp_path, 300)


def _never_crash(fuzz: tuple[fz.Base, Any, int], tmp_path: Any, random_cases: int) -> None:
    base, ctx, seed = fuzz
    a = fz.Anatomy(base.data)
    one = os.environ.get("FUZZ_CASE")
    if one:
        cases = [int(one)]
    else:
        cases = sorted(fz.crafted_cases(a).values()) + list(range(random_cases))
    t0 = time.monotonic()
    results = fz.run_cases(base, seed, cases, jobs=_env_int("FUZZ_JOBS", 3),
                           deadline=float(_env_int("FUZZ_DEADLINE", 25)), workdir=str(tmp_path),
                           ctx=ctx, progress=len(cases) > 1000)
    if os.environ.get("FUZZ_GDB"):
        fz.add_native_frames(results, seed)
    report = fz.summarize(results, seed)
    report += f"\n{len(results)} cases in {time.monotonic() - t0:.0f}s"
    path = os.environ.get("FUZZ_REPORT", f"/tmp/kvcomm-fuzz-{seed}.txt")
    with open(path, "w") as f:
        f.write(report + "\n")
    print(report)
    print(f"report: {path}")
    assert len(results) == len(cases)
    failed = [r for r in results if r.status != "ok"]
    head = report.splitlines()
    short = "\n".join(head[:150] + ([f"... (full report: {path})"] if len(head) > 150 else []))
    assert not failed, short


def test_cli_purge_removes_any_corrupted_segment(fuzz: tuple[fz.Base, Any, int]) -> None:
    """`kvcomm purge` (the real command, in its own process) removes every corrupted
    segment: the crafted ones, one whose writer lock a live process holds, and random ones."""
    base, _, seed = fuzz
    a = fz.Anatomy(base.data)
    table = fz.crafted(a)
    if hasattr(l2, "H_LOCK"):  # a pid lock word (a robust mutex replaces it: issue 7, item 8)
        live_lock = fz.Mutation("crafted", "H_LOCK held by a live process (this test)")
        live_lock.set_word(l2.H_LOCK * 8, os.getpid())
    else:  # the robust mutex's owner word names a live thread (this test's)
        from kvcomm.tiers.shm.layout import MUTEX_AT

        live_lock = fz.Mutation("crafted", "the writer lock held by a live thread (this test)")
        live_lock.set_word(MUTEX_AT, os.getpid())  # glibc: the futex word, the owner's tid
    table["lock_held_by_live_process"] = [live_lock]
    for case in range(8):
        table[f"random case {case}"] = fz.mutate(seed, case, a)
    failures = []
    for name, muts in table.items():
        ns = f"fuzzcli-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        path = l2.segment_path(ns)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, fz.apply(base.data, muts))
        finally:
            os.close(fd)
        try:
            p = subprocess.run([sys.executable, "-m", "kvcomm", "purge", "--name", ns],
                               capture_output=True, text=True, timeout=60)
            rc, err = p.returncode, (p.stderr or p.stdout).strip()[-300:]
        except subprocess.TimeoutExpired:
            rc, err = None, "no answer in 60s"
        if rc != 0 or os.path.exists(path):
            failures.append(f"{name}: rc={rc}, file left={os.path.exists(path)}: {err}\n"
                            f"    mutation: {'; '.join(m.what for m in muts)[:300]}")
        if os.path.exists(path):
            os.unlink(path)
    assert not failures, f"FUZZ_SEED={seed}: `kvcomm purge` failed on:\n" + "\n".join(failures)


# ------------------------------------------------------------------ the segment fuzzer


def test_the_segment_fuzzer_covers_the_metrics_region_and_its_readers() -> None:
    """F: layout 4 added the metrics region to every segment, but tests/support/fuzz_segment.py
    neither mutates it on purpose (no mutation kind aims at it: only ``anywhere`` and
    ``byte_flips`` can land there by chance) nor reads it: its child script never scrapes
    (collector.read / the exporter) nor draws ``kvcomm top``, so nothing checks that a
    corrupt region, hot-key table or header makes a scrape raise only KVCommErrors. (A
    quick fuzz of my own, 150 cases of corrupt metrics/hot-key/header words through
    read(), top's frame and Exporter.text(), found no crash: this is coverage that would
    keep it so.)
    (found in review 10: metrics, kvcomm top, load tests)"""
    from tests.support import fuzz_segment

    kinds = " ".join(fuzz_segment.KINDS)
    assert "metric" in kinds, f"no mutation kind aims at the metrics region: {kinds}"
    script = inspect.getsource(fuzz_segment._script) + inspect.getsource(fuzz_segment._ops)
    assert "collector" in script or "Exporter" in script or "metrics" in script, (
        "the fuzz child never scrapes the corrupt segment")
