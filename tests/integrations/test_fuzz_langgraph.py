"""Hostile records under the LangGraph integration's keys never raise outside KVCommError,
and the thread and namespace stay usable (tests/support/fuzz_langgraph.py says how cases are made).

Knobs (environment): ``LG_FUZZ_SEED`` (default: random, printed), ``LG_FUZZ_CASES`` (the
bounded run's cases, default 40), ``LG_FUZZ_CASE`` (run only this case: a replay)."""

from __future__ import annotations

import os
import random
import time

import pytest

import kvcomm

pytest.importorskip("langgraph.checkpoint.base")

from tests.support import fuzz_langgraph as fz  # noqa: E402


def _seed() -> int:
    seed = int(os.environ.get("LG_FUZZ_SEED") or random.randrange(2**32))
    print(f"LG_FUZZ_SEED={seed}")
    return seed


def _run(kv: kvcomm.Client, n: int) -> list[fz.Outcome]:
    seed = _seed()
    one = os.environ.get("LG_FUZZ_CASE")
    cases = [int(one)] if one else list(range(n))
    t0 = time.monotonic()
    outcomes = [fz.run_case(kv, seed, case) for case in cases]
    report = fz.summarize(outcomes, seed)
    print(f"{report}\n{len(cases)} cases in {time.monotonic() - t0:.1f}s")
    assert not any(o.failures for o in outcomes), report
    return outcomes


def test_the_fuzzer_can_fail(kv: kvcomm.Client) -> None:
    """A planted record is found (CorruptRecord counted), and an exception of another type
    from a method is reported as a failure, naming the step."""
    out = fz.Outcome(0)
    fz._step(out, "boom", lambda: {}["missing"])
    fz._step(out, "typed", lambda: (_ for _ in ()).throw(kvcomm.CorruptRecord("x")))
    assert out.corrupt == 1 and [f.step for f in out.failures] == ["boom"]
    assert out.failures[0].error.startswith("KeyError")
    w = fz.World(kv, 10**6)
    head = w.saver.keys.head(w.thread, "")
    kv.put(head, ["not", "a", "head"])
    with pytest.raises(kvcomm.CorruptRecord, match="the thread head"):
        w.saver.get_tuple(w.cfg)


def test_hostile_langgraph_records_stay_typed_bounded(kv: kvcomm.Client) -> None:
    """LG_FUZZ_CASES (default 100) random cases: a few seconds."""
    outcomes = _run(kv, int(os.environ.get("LG_FUZZ_CASES") or 100))
    assert sum(o.corrupt for o in outcomes) > 0  # (the plants were found)


@pytest.mark.slow
def test_hostile_langgraph_records_stay_typed_long(kv: kvcomm.Client) -> None:
    """1500 random cases (`make test-slow`)."""
    _run(kv, 1500)
