"""Retry delays: capped exponential backoff with "full jitter". Pure: no clock, no sleep.

Why jitter: after an outage every host's daemon fails at the same moment; with plain
doubling they all retry at the same moments too, and each retry is a thundering herd.
"Full jitter" (AWS Architecture Blog, *Exponential Backoff and Jitter*, 2015) draws each
delay uniformly from ``[0, min(cap, base * 2**attempt)]``: the ceiling still doubles,
so a long outage costs few attempts, but the retries of many hosts spread over the
whole interval instead of arriving together. ``floor`` keeps a draw near zero from
turning a retry loop into a busy loop.

The caller passes the ``random.Random`` (seeded in tests, so a run replays exactly) and
does the waiting itself, with whatever clock or event it has.
"""

from __future__ import annotations

import random

_MAX_EXPONENT = 62  # base * 2**62 exceeds any sane cap; larger exponents only overflow


def ceiling(attempt: int, base: float, cap: float) -> float:
    """The largest delay before retry ``attempt`` (0 for the first): ``min(cap, base * 2**attempt)``.

    Raises ValueError if ``attempt`` < 0, ``base`` <= 0 or ``cap`` < ``base``.
    """
    if attempt < 0:
        raise ValueError(f"attempt must be >= 0, got {attempt}")
    if not base > 0 or not cap >= base:
        raise ValueError(f"need 0 < base <= cap, got base={base}, cap={cap}")
    return min(cap, base * float(1 << min(attempt, _MAX_EXPONENT)))


def full_jitter(attempt: int, rng: random.Random, *, base: float, cap: float,
                floor: float = 0.0) -> float:
    """A delay drawn uniformly from ``[0, ceiling(attempt, base, cap)]``, raised to ``floor``.

    Always within ``[floor, cap]`` when ``floor <= cap``. Raises ValueError as
    :func:`ceiling` does, or if ``floor`` is negative or above ``cap``.
    """
    if not 0.0 <= floor <= cap:
        raise ValueError(f"need 0 <= floor <= cap, got floor={floor}, cap={cap}")
    return max(floor, rng.uniform(0.0, ceiling(attempt, base, cap)))


class Backoff:
    """The state of one retry loop: how many attempts have failed in a row.

    ``delay = b.failed()`` after each failure (the wait before the next try),
    ``b.succeeded()`` after a success (the next failure starts again from ``base``).
    """

    def __init__(self, rng: random.Random, *, base: float, cap: float,
                 floor: float = 0.0) -> None:
        if not isinstance(rng, random.Random):
            raise TypeError("rng must be a random.Random (seed it for a replayable run)")
        full_jitter(0, random.Random(0), base=base, cap=cap, floor=floor)  # validates them
        self.rng, self.base, self.cap, self.floor = rng, base, cap, floor
        self.attempts = 0  # failures in a row

    def failed(self) -> float:
        """Count a failure; returns the delay to wait before the next attempt."""
        delay = full_jitter(self.attempts, self.rng, base=self.base, cap=self.cap,
                            floor=self.floor)
        self.attempts += 1
        return delay

    def succeeded(self) -> None:
        self.attempts = 0

    @property
    def ceiling(self) -> float:
        """The largest delay the next :meth:`failed` can return."""
        return max(self.floor, ceiling(self.attempts, self.base, self.cap))
