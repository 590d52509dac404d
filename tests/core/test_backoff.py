"""The one retry helper: capped exponential backoff with full jitter (pure, seeded)."""

from __future__ import annotations

import random
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcomm.core.backoff import Backoff, ceiling, full_jitter
from tests.support.helpers import drawn_seed

bases = st.floats(min_value=1e-4, max_value=10.0)
attempts = st.integers(min_value=0, max_value=10_000)


@given(attempts, bases, st.floats(min_value=1.0, max_value=1000.0), st.integers(0, 2**32))
def test_delay_is_within_floor_and_ceiling(attempt: int, base: float, scale: float,
                                           seed: int) -> None:
    cap = base * scale
    floor = min(cap, base / 2)
    d = full_jitter(attempt, random.Random(seed), base=base, cap=cap, floor=floor)
    assert floor <= d <= max(floor, ceiling(attempt, base, cap)) <= cap


@given(bases, st.floats(min_value=1.0, max_value=1e6), st.integers(0, 200))
def test_ceiling_doubles_until_the_cap_then_stays(base: float, scale: float, n: int) -> None:
    cap = base * scale
    c0, c1 = ceiling(n, base, cap), ceiling(n + 1, base, cap)
    assert c0 <= c1 <= cap
    assert c1 == cap or c1 == pytest.approx(2 * c0)
    assert ceiling(10**9, base, cap) == cap  # huge attempt counts never overflow


@given(st.integers(0, 2**32), st.integers(1, 50))
def test_same_seed_same_delays(seed: int, n: int) -> None:
    a = Backoff(random.Random(seed), base=0.05, cap=2.0)
    b = Backoff(random.Random(seed), base=0.05, cap=2.0)
    assert [a.failed() for _ in range(n)] == [b.failed() for _ in range(n)]


def test_success_starts_again_from_base() -> None:
    b = Backoff(random.Random(1), base=0.1, cap=5.0)
    for _ in range(20):
        b.failed()
    assert b.attempts == 20 and b.ceiling == 5.0
    b.succeeded()
    assert b.attempts == 0 and b.ceiling == pytest.approx(0.1)
    assert b.failed() <= 0.1


def test_hosts_that_fail_together_do_not_retry_together() -> None:
    """The point of jitter: 100 hosts failing at the same moment, with differently
    seeded generators, spread their retries over the interval instead of all retrying
    at the ceiling (plain doubling) at the same instant."""
    seed = drawn_seed(2**32)
    master = random.Random(seed)
    hosts = [Backoff(random.Random(master.randrange(2**64)), base=0.05, cap=2.0)
             for _ in range(100)]
    for _ in range(6):  # the 7th retry: ceiling 0.05 * 2**6 = 3.2 → capped at 2.0
        for h in hosts:
            h.failed()
    delays = [h.failed() for h in hosts]
    assert all(0 <= d <= 2.0 for d in delays)
    assert len({round(d, 6) for d in delays}) >= 95  # not in lockstep
    # uniform on [0, 2]: mean 1, and both halves of the interval are used
    assert 0.7 < statistics.mean(delays) < 1.3
    assert sum(d < 1.0 for d in delays) >= 25 and sum(d >= 1.0 for d in delays) >= 25


@pytest.mark.parametrize("kwargs", [{"base": 0, "cap": 1}, {"base": 2, "cap": 1},
                                    {"base": 1, "cap": 2, "floor": 3},
                                    {"base": 1, "cap": 2, "floor": -1}])
def test_bad_parameters_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Backoff(random.Random(0), **kwargs)


def test_a_random_generator_is_required() -> None:
    with pytest.raises(TypeError):
        Backoff(None, base=0.1, cap=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ceiling(-1, 0.1, 1.0)
