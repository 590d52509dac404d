"""KVCOMM's background threads leave the user's signals to the user's main thread.

The kernel delivers a process-directed signal (Ctrl-C's SIGINT, SIGTERM, SIGHUP) to any
thread that does not block it. Python runs its handlers in the main thread, but only once
that thread runs bytecode again: a signal that lands on one of KVCOMM's threads (the
expiry sweeper, the metrics flusher, a presence refresher) leaves a main thread blocked
in ``time.sleep()`` or a ``select()`` asleep until that call returns by itself, so Ctrl-C
seems ignored. Every thread the library starts therefore starts through
:func:`start_quiet`, with those signals blocked: the kernel hands them to a thread that
takes them, the main thread among them, which wakes at once.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_USER_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})


@contextmanager
def user_signals_blocked() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP blocked in this thread for the block: a thread started
    inside it inherits the mask (the old one is restored on leaving, and a signal that
    arrived meanwhile is delivered then)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _USER_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def start_quiet(thread: threading.Thread) -> None:
    """Start ``thread`` with SIGINT, SIGTERM and SIGHUP blocked in it."""
    with user_signals_blocked():
        thread.start()
