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

_USER_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})


def start_quiet(thread: threading.Thread) -> None:
    """Start ``thread`` with SIGINT, SIGTERM and SIGHUP blocked in it (a new thread
    inherits its starter's mask; the starter's own mask is restored at once, and a signal
    that arrived meanwhile is delivered then)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _USER_SIGNALS)
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
