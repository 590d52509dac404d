"""What the LangGraph integration needs of a client beyond get/put: ordered prefix scans,
and reads of records that must exist (referenced by a thread's head) on another host."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

from ..._client import Client, Item
from ..._wait import wait_until
from ...aio import AsyncClient, _Opening
from ...errors import InvalidArgument, Unavailable, UsageError

R = TypeVar("R")

_ABSENT: Any = object()


def scan(kv: Client, prefix: str) -> Iterator[Item]:
    """Every live key under ``prefix``, in key order (UTF-8 bytes), with its value:
    ``kv.scan(prefix)`` (cluster-wide in cluster mode)."""
    return kv.scan(prefix)


def get_referenced(kv: Client, key: str, timeout: float, what: str,
                   counters: dict[str, int] | None = None) -> Any:
    """The value of ``key``, a record that exists because a newer record (a thread's head)
    names it, though its eventual write may not have reached this host yet.

    In embedded mode the host's L2 is the whole truth: the value or None at once. In
    cluster mode a miss is retried (the host's negative cache of absent keys forgotten
    for this key each time, so that L3 is asked again) until ``timeout`` seconds have
    passed; then Unavailable, naming ``what``. Never an older value: the records read
    so are immutable, written once before the head that names them. ``counters``
    ("waits", "wait_timeouts") counts the reads that had to wait and those that gave up.
    """
    value = kv.get(key, _ABSENT)
    if value is not _ABSENT or not kv.config.cluster.enabled:
        return None if value is _ABSENT else value

    if counters is not None:
        counters["waits"] += 1

    def again() -> Any:
        kv._negative.invalidate(key)  # (this key was remembered absent: ask L3 again)
        v = kv.get(key, _ABSENT)
        return None if v is _ABSENT else (v,)

    try:
        found = wait_until(again, timeout, f"{what} (KVCOMM key {key!r}), which the thread's "
                           "head names, to reach this host: its writer's host may be down or "
                           "cut off from L3 before flushing it", interval=0.005, error=Unavailable)
    except Unavailable:
        if counters is not None:
            counters["wait_timeouts"] += 1
        raise
    return found[0]


def sync_and_aio(kv: Any, who: str) -> tuple[Client, AsyncClient | None]:
    """(the sync client, the ``kvcomm.aio`` client or None) of what ``who`` was given.
    Raises InvalidArgument for anything but an open client of either face."""
    if isinstance(kv, AsyncClient):
        return kv.sync, kv
    if isinstance(kv, Client):
        return kv, None
    if isinstance(kv, _Opening):
        raise UsageError(f"{who} was given kvcomm.aio.open(...) not awaited, so there is no "
                         f"client yet: write `kv = await kvcomm.aio.open(...)` or `async with "
                         f"kvcomm.aio.open(...) as kv:`, then {who}(kv)")
    raise InvalidArgument(f"{who} needs an open kvcomm client (kvcomm.open() or "
                          f"kvcomm.aio.open()), got {type(kv).__name__}")


def run_async(aio: AsyncClient | None, fn: Callable[..., R], args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> Awaitable[R]:
    """An async method of the saver or the store: its sync method ``fn``, one
    implementation for both faces, run as ``kvcomm.aio`` runs the client's own methods.

    On a ``kvcomm.aio`` client: **inline on the event loop** (an L1/L2 operation takes
    microseconds; no thread hop, no executor). The first client call in it that would wait
    (a round trip to L3 or etcd, another process holding the host's writer lock) raises
    WouldBlock before doing anything, and ``fn`` runs again, whole, in the aio client's
    pool, awaited: the loop never waits. Running ``fn`` again must be safe: what it wrote
    before the call that would wait is immutable records put again with the same values,
    deletes, and compare-and-sets judged afresh (each method of the saver is written so),
    or nothing: a store's batch runs one op per attempt (each op's write is its last call
    that may wait), so a rerun never puts back a value another process replaced since.
    On a sync client: ``fn`` in the loop's default thread executor (it may block).
    What it returns is awaited by the caller: no coroutine of its own (one per step
    of a graph).
    """
    return runner(aio)(fn, args, kwargs)


def runner(aio: AsyncClient | None) -> Callable[[Callable[..., R], tuple[Any, ...],
                                                  dict[str, Any]], Awaitable[R]]:
    """:func:`run_async` with its client bound, for a saver to keep: ``aio._attempt`` itself
    on a ``kvcomm.aio`` client (a graph step's two calls then run no Python frame of this
    module), else the executor."""
    if aio is not None:
        return aio._attempt

    def in_executor(fn: Callable[..., R], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Awaitable[R]:
        return asyncio.get_running_loop().run_in_executor(
            None, functools.partial(fn, *args, **kwargs))
    return in_executor
