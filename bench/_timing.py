"""Timing helpers every benchmark in bench/ shares (run a script as ``python bench/X.py``:
its folder is on ``sys.path``, so ``from _timing import ...`` finds this file).

Small operations are timed in blocks and divided, so that the clock's own cost is
amortised; the figure reported is the median of the blocks (robust to a noisy neighbour
on a shared machine).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")

clock = time.perf_counter_ns


def p50_blocks(fn: Callable[[], Any], blocks: int, per_block: int = 100) -> float:
    """Median ns per call of ``fn`` over ``blocks`` blocks of ``per_block`` calls each."""
    samples = []
    for _ in range(blocks):
        t0 = clock()
        for _ in range(per_block):
            fn()
        samples.append((clock() - t0) / per_block)
    return statistics.median(samples)


def p50_each(fn: Callable[[], Any], n: int) -> float:
    """Median ns of ``n`` calls of ``fn``, each timed on its own (for calls of µs and up)."""
    samples = []
    for _ in range(n):
        t0 = clock()
        fn()
        samples.append(clock() - t0)
    return statistics.median(samples)


def ns_per_item(fn: Callable[[T], Any], items: Sequence[T]) -> float:
    """Mean ns of ``fn(item)`` over one pass through ``items``."""
    t0 = clock()
    for item in items:
        fn(item)
    return (clock() - t0) / len(items)


@contextmanager
def stopwatch() -> Iterator[list[float]]:
    """``with stopwatch() as took:`` ... then ``took[0]`` is the seconds the block took."""
    took: list[float] = []
    t0 = time.perf_counter()
    try:
        yield took
    finally:
        took.append(time.perf_counter() - t0)


def run_all(procs: Iterable[Any]) -> float:
    """Start every process, join them all; returns the wall seconds that took."""
    procs = list(procs)
    with stopwatch() as took:
        for p in procs:
            p.start()
        for p in procs:
            p.join()
    return took[0]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` (nearest rank), NaN when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def heading(text: str) -> None:
    print(f"\n== {text}", flush=True)


def propagation_reader(config: str, n: int, out: Any, done: Any, give_up_s: float = 60.0) -> None:
    """A process that reads ``prop/x`` (a writer's ``perf_counter_ns`` stamp) through
    KVCOMM on another host until it has seen ``n`` new values (or ``give_up_s`` passed), then
    sets ``done`` and puts the write-to-read delays (ns) on ``out``. The first read fills
    this host's L2 from L3. (Both hosts share one machine, so one clock.)"""
    import kvcomm
    from kvcomm._wait import wait_until

    with kvcomm.open(config=config) as kv:
        wait_until(lambda: kv.get("prop/x") is not None, 60, "prop/x on host 2")
        last, lat = kv.get("prop/x"), []
        deadline = time.monotonic() + give_up_s
        while len(lat) < n and time.monotonic() < deadline:
            v = kv.get("prop/x")
            if v != last:
                lat.append(time.perf_counter_ns() - v)
                last = v
            else:
                time.sleep(0.0002)
        done.set()
        out.put(lat)
