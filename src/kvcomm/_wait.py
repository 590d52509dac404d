"""Polling until a condition holds or a deadline passes: the one loop of its kind.

Tools (the dev cluster, the fault injectors), tests and benchmarks all wait for another
process to do something (a server to answer, a daemon to heartbeat, a cluster to heal).
They call :func:`wait_until` rather than write the deadline loop again, so that every
wait has a deadline, says what it waited for when it gives up, and sleeps between polls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from .errors import Unavailable

T = TypeVar("T")


def wait_until(cond: Callable[[], T], timeout: float, what: str | Callable[[], str], *,
               interval: float = 0.01,
               retry_on: tuple[type[BaseException], ...] = (),
               error: type[Exception] = Unavailable,
               clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], object] = time.sleep) -> T:
    """Call ``cond`` every ``interval`` seconds until it returns a true value; return it.

    ``cond`` is called at least once, however small ``timeout``. An exception of a type in
    ``retry_on`` (a server not listening yet: OSError) counts as "not yet"; any other
    propagates at once, so ``cond`` can fail the wait early (a process that exited). After
    ``timeout`` seconds, raises ``error`` (Unavailable by default; tests pass
    AssertionError) with the message ``timed out after <timeout>s waiting for <what>``;
    ``what`` may be a function, called then, to say what was still missing at the end.
    ``clock`` and ``sleep`` are there for tests of this function.
    """
    deadline = clock() + timeout
    while True:
        try:
            value = cond()
        except retry_on:
            pass
        else:
            if value:
                return value
        if clock() > deadline:
            text = what if isinstance(what, str) else what()
            raise error(f"timed out after {timeout:g}s waiting for {text}")
        sleep(interval)
