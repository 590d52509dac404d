"""kvcomm.aio: the asyncio face of the client — one client, two faces.

::

    import kvcomm.aio
    async with kvcomm.aio.open(name="agents") as kv:     # the arguments of kvcomm.open
        await kv.put("drone/7/pos", b"...", ttl=5)
        pos = await kv.get("drone/7/pos")
        async with kv.batch() as b:
            b.put("a", 1); b.delete("b")
        async for item in kv.scan("drone/"): ...
        async for event in kv.watch("drone/", timeout=1.0): ...
        p = await kv.presence("alive/", "drone-7"); await p.stop()

``kv = await kvcomm.aio.open(...)`` works too (then ``await kv.aclose()``).

Every public method of :class:`kvcomm.Client` is here under the same name with the same
signature, awaited (``scan`` and ``watch`` are async iterators, ``batch`` an async context
manager); ``kv.sync`` is the sync client underneath. Semantics, errors and guarantees are
the sync client's: the calls below *are* the sync client's calls.

Each call runs **inline on the event loop's thread** unless it would wait: the writer
lock held past 200 µs (``_l2core.set_inline_wait``) or the network (L3, etcd:
``_client.base._network``) raise ``WouldBlock`` before anything is done, and the whole
call runs again in a bounded thread pool (32 threads, shared by the process's async
clients), awaited. Reads of keys only L3 holds, awaited at once by many coroutines, are
gathered: the reads met in one pass of the loop go to L3 as one pipeline per master, in
one thread (a round trip per key, each in a thread of its own, would take the pool and
the interpreter's lock from the loop). A watch waits on a *bell* thread that wakes the loop only when the
feed's head moved. A cancelled call still running in the pool is waited for, then the
cancellation reaches the task (a write it made may or may not have been applied).

Design (why the async face is built on the sync code, where a call would wait, the bell,
scans, cancellation): docs/design/aio.md.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import islice
from typing import TYPE_CHECKING, Any, NoReturn

from ._client import Client, Event, Item, Presence
from ._client import open as _open_sync
from ._client.client import _NOT_SENT
from ._client.cluster_read import L3Read
from ._client.scan import check_scan_args
from ._client.watch import WatchFeed
from ._l2core import WouldBlock, set_inline_wait
from .config import Config
from .errors import UsageError
from .tiers.l2 import deferred_warnings, warn_outside_kvcomm

__all__ = ["AsyncBatch", "AsyncClient", "AsyncPresence", "open"]

INLINE_LOCK_WAIT = 0.0002  # s: the longest a call on the loop waits for a held writer lock
_LOCK_BUSY_FOR = 0.005  # s: after a call met the lock held that long, the client's calls on
# the loop only try it for this long (a few µs of spinning, no sleep): N coroutines meeting one long hold
# cost the loop one INLINE_LOCK_WAIT, not N of them
POOL_SIZE = 32  # threads for calls that must wait (the network, a held lock), per process
_SCAN_CHUNK = 256  # items of a scan read per step (inline, or per thread hop)
_L3_READS = 256  # keys of L3 reads gathered into one thread's pipelined read, at most
_BELL_IDLE_MAX = 0.005  # s: the bell's longest pause between two looks at the feed head
_CLUSTER_POLL = 0.005  # s: a cluster-mode watch's look at its etcd watch and daemon status

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0


def _executor() -> ThreadPoolExecutor:
    """The process's pool for calls that wait (made at first use; anew in a forked child)."""
    global _pool, _pool_pid
    pool = _pool
    if pool is None or _pool_pid != os.getpid():
        with _pool_lock:
            if _pool is None or _pool_pid != os.getpid():
                _pool = ThreadPoolExecutor(POOL_SIZE, thread_name_prefix="kvcomm-aio")
                _pool_pid = os.getpid()
            pool = _pool
    return pool


_WOULD_WAIT: Any = object()  # (_inline: the call would have waited; nothing was done)


def _inline(client: AsyncClient, fn: Callable[..., Any], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:
    """``fn(*args, **kwargs)`` (a method of ``client``'s sync client) on this (the loop's)
    thread, with the inline budget set: its result, or _WOULD_WAIT when it stopped at a
    held lock or the network (WouldBlock, raised before it did anything). The budget is
    INLINE_LOCK_WAIT, or 0 (the kernel's few µs of spinning, no sleep) within
    _LOCK_BUSY_FOR of a call of ``client`` that met its lock held for its whole budget."""
    budget = INLINE_LOCK_WAIT
    if client._busy_until:  # (a window open: the clock read only then)
        if time.monotonic() < client._busy_until:
            budget = 0.0
        else:
            client._busy_until = 0.0
    prev = set_inline_wait(budget)
    try:
        return fn(*args, **kwargs)
    except L3Read as read:  # (a read for L3: kvcomm.aio may gather it with others)
        return read
    except WouldBlock as exc:
        if exc.__class__ is WouldBlock and budget:  # (the kernel's, after the whole budget:
            # a long hold; not the network's, nor a short hold met within the window)
            client._busy_until = time.monotonic() + _LOCK_BUSY_FOR
        return _WOULD_WAIT
    finally:
        set_inline_wait(prev)


def _public(cls: type) -> dict[str, Callable[..., Any]]:
    """The public methods of ``cls`` (what the async face must cover)."""
    return {n: f for n, f in inspect.getmembers(cls, inspect.isfunction)
            if not n.startswith("_")}


def _awaited(name: str, sync_fn: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    """The async face of sync method ``name``: inline on the loop, or, if it would wait
    (WouldBlock, raised before anything was done), again in the pool."""

    async def method(self: AsyncClient, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self._kv, name)
        out = _inline(self, fn, args, kwargs)
        if out.__class__ is L3Read:
            if name in _GATHERED and out.key == (args[0] if args else kwargs.get("key")):
                item = await self._read_l3(out.key, out.timed)
                if name == "get_item":
                    return item
                return (args[1] if len(args) > 1 else kwargs.get("default")) if item is None \
                    else item.value
            out = _WOULD_WAIT
        if out is _WOULD_WAIT:
            out = await self._off_loop(fn, args, kwargs)
        return out

    functools.update_wrapper(method, sync_fn)  # name, docstring; signature via __wrapped__
    method.__qualname__, method.__module__ = f"AsyncClient.{name}", __name__  # (its own)
    method.__doc__ = f"Awaited :meth:`kvcomm.Client.{name}`.\n\n{sync_fn.__doc__ or ''}"
    return method


_GATHERED = frozenset({"get", "get_item"})  # (their answer is the L3 read's: _read_l3)


class AsyncClient:
    """The asyncio face of a :class:`kvcomm.Client` (see :mod:`kvcomm.aio`). Make one with
    :func:`kvcomm.aio.open`. Use it from one event loop at a time. ``AsyncClient(kv)``
    wraps a sync client opened already: the two are one client, and closing this face
    (``await kv.close()``, the end of ``async with``) closes that client too."""

    def __init__(self, client: Client) -> None:
        if not isinstance(client, Client):  # (an AsyncClient would hand back coroutines as
            # values, a name or None fail at the first call: say it now)
            raise UsageError(f"AsyncClient wraps an open sync client (kvcomm.open()); got "
                             f"{type(client).__name__}: to open one, write `kv = await "
                             f"kvcomm.aio.open(...)` or `async with kvcomm.aio.open(...) as kv:`")
        self._kv = client
        self._inflight: set[Future[Any]] = set()  # calls running in the pool
        self.off_loop = 0  # calls that ran in the pool (they would have waited on the loop)
        self._bell: _FeedBell | None = None
        self._closing = False  # (close() began: watches end, as the sync client's on close)
        self._busy_until = 0.0  # (time.monotonic(): its lock met held long; _LOCK_BUSY_FOR)
        # L3 reads awaited, not yet sent (_read_l3): one per awaiting coroutine, so bounded
        # by the caller's own concurrency; sent _L3_READS at a time, by the loop they
        # were awaited on (_l3_loop)
        self._l3_waiting: list[tuple[str, bool, asyncio.Future[Any]]] = []
        self._l3_loop: asyncio.AbstractEventLoop | None = None

    @property
    def sync(self) -> Client:
        """The sync client underneath (the same state: use it from threads)."""
        return self._kv

    @property
    def name(self) -> str:
        return self._kv.name

    @property
    def config(self) -> Config:
        return self._kv.config

    # ---------------------------------------------------------------- the machinery

    async def _attempt(self, fn: Callable[..., Any], args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> Any:
        """``fn(*args, **kwargs)`` inline, or in the pool if it would wait."""
        out = _inline(self, fn, args, kwargs)
        if out is _WOULD_WAIT or out.__class__ is L3Read:
            out = await self._off_loop(fn, args, kwargs)
        return out

    def _read_l3(self, key: str, timed: bool = False) -> asyncio.Future[Any]:
        """The Item (or None) of ``key``, an L2 miss for L3 (:class:`L3Read`), read with
        the other L3 reads awaited in this pass of the loop: one
        ``Client._get_l3_many`` in the pool for up to _L3_READS keys, one pipeline of
        GETs per master. A read changes nothing the caller sees: cancelled, its answer is
        dropped (the pipeline goes on; :meth:`close` waits for it)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if loop is not self._l3_loop:  # (reads left by a loop that stopped before sending
            # them: their coroutines went with it, nobody awaits them)
            self._l3_waiting.clear()
            self._l3_loop = loop
        if not self._l3_waiting:
            loop.call_soon(self._send_l3_reads, loop)
        self._l3_waiting.append((key, timed, fut))
        return fut

    def _send_l3_reads(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop is not self._l3_loop:
            return  # (another loop took the client over: its reads are its own)
        reads = self._l3_waiting[:_L3_READS]
        del self._l3_waiting[:_L3_READS]
        if self._l3_waiting:
            loop.call_soon(self._send_l3_reads, loop)
        reads = [r for r in reads if not r[2].done()]  # (cancelled: dropped)
        for part in self._by_master(reads):  # (a master that hangs holds up its own keys)
            try:
                cf = _executor().submit(self._kv._get_l3_many,
                                        [(key, None, True, timed) for key, timed, _f in part])
            except BaseException as exc:  # (the pool refuses: the interpreter shuts down)
                for _key, _timed, fut in part:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            self.off_loop += 1
            self._track(cf)
            asyncio.wrap_future(cf, loop=loop).add_done_callback(
                functools.partial(_answer_l3_reads, part))

    def _by_master(self, reads: list[Any]) -> list[list[Any]]:
        """``reads`` split by the Redis master serving each key (the L3 client's slot map,
        no round trip), one pool call each, the masters read at the same time; whole
        while L3 is not open yet (its first read opens it) or a key's slot is not mapped."""
        l3 = self._kv._l3
        if l3 is None or len(reads) <= 1:
            return [reads] if reads else []
        parts: dict[str, list[Any]] = {}
        try:
            for r in reads:
                parts.setdefault(l3.master_of(r[0]), []).append(r)
        except Exception:  # (a slot map without this slot: the read finds out, whole)
            return [reads]
        return list(parts.values())

    async def _off_loop(self, fn: Callable[..., Any], args: tuple[Any, ...],
                        kwargs: dict[str, Any],
                        made: Callable[[Any], Future[Any]] | None = None) -> Any:
        """``fn(*args, **kwargs)`` in the pool, awaited. Cancelled while the call is still
        queued, it never runs; once it runs, the cancellation waits for it to end (a
        thread cannot be stopped mid-call), then reaches the task: when a cancelled task
        has ended, none of its calls is still running. ``made``: what is done with the
        result of a call that ended after its task was cancelled (a resource nobody else
        will release; it returns the Future of that clean-up, which close() waits for)."""
        cf = _executor().submit(fn, *args, **kwargs)
        self.off_loop += 1
        self._track(cf)
        fut = asyncio.wrap_future(cf)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if not cf.cancel():  # (running: let it end first)
                cleanup: Future[None] | None = None
                if made is not None:  # (in flight at once, so close() waits for it too)
                    cleanup = Future()
                    self._track(cleanup)
                while not fut.done():
                    try:
                        await asyncio.wait([fut])
                    except asyncio.CancelledError:
                        continue
                if not fut.cancelled():  # (its error, if any, went with the cancelled
                    fut.exception()  # task: retrieved, not logged as never retrieved)
                if cleanup is not None:
                    try:
                        if made is not None and not cf.cancelled() and cf.exception() is None:
                            made(cf.result()).add_done_callback(
                                lambda _f: cleanup.set_result(None))
                        else:
                            cleanup.set_result(None)
                    except BaseException:
                        cleanup.set_result(None)
                        raise
            raise

    # ------------------------------------------------- methods with a face of their own

    def batch(self) -> AsyncBatch:
        """``async with kv.batch() as b: b.put(...); b.delete(...)`` — applied whole, or not
        at all, when the block exits (see :class:`kvcomm.Batch`). ``b.put`` and
        ``b.delete`` only collect (no I/O): they are not awaited."""
        return AsyncBatch(self, self._kv.batch())

    def scan(self, prefix: str = "", *, limit: int | None = None,
             after: str | None = None) -> AsyncIterator[Item]:
        """``async for item in kv.scan(prefix, limit=, after=)``: :meth:`kvcomm.Client.scan`
        (same contract, same errors; bad arguments raise here, at the call). The process's
        first scan of a namespace builds its key index (a walk of every slot) in the pool,
        at the first iteration."""
        kv = self._kv
        check_scan_args(prefix, limit, after)
        kv._live()
        index = kv._attached.index
        if index is None or not index.built:
            return _AsyncOnly(self._scan(None, (prefix, limit, after)), "scan")
        it = kv.scan(prefix, limit=limit, after=after)  # (the sync scan: lock-free)
        return _AsyncOnly(self._scan(it, None), "scan")

    async def _scan(self, it: Iterator[Item] | None,
                    start: tuple[str, int | None, str | None] | None) -> AsyncIterator[Item]:
        off = self._kv._cluster  # (cluster mode: pages come from L3)
        if it is None:
            assert start is not None
            prefix, limit, after = start
            it = await self._off_loop(self._kv.scan, (prefix,), {"limit": limit, "after": after})
        while True:
            chunk = (await self._off_loop(_take, (it, _SCAN_CHUNK), {}) if off
                     else _take(it, _SCAN_CHUNK))
            for item in chunk:
                yield item
            if len(chunk) < _SCAN_CHUNK:
                return
            if not off:
                await asyncio.sleep(0)  # (a long scan lets the loop's other tasks run)

    def watch(self, prefix: str = "", *, timeout: float | None = None) -> AsyncIterator[Event]:
        """``async for event in kv.watch(prefix, timeout=)``: :meth:`kvcomm.Client.watch`
        (same events, same overflow rule; changes from this call on; bad arguments raise
        here). Between events the loop is woken only when the host's feed moves. It ends
        when the client closes (:meth:`close`, once the calls it waits for are done):
        events not yet delivered then are not, as the sync watch's."""
        feed = self._kv._watch_start(prefix, timeout, subscribe=False)
        return _AsyncOnly(self._watch(feed, timeout), "watch")

    async def _watch(self, feed: WatchFeed, timeout: float | None) -> AsyncIterator[Event]:
        kv = self._kv
        seg = kv._seg
        try:
            if kv._cluster:  # (waits for the node daemon to take the prefix: off the loop)
                feed.sub = await self._off_loop(kv._subscribe, (feed.prefix,), {})
            if self._bell is None:
                self._bell = _FeedBell(seg)
            bell = self._bell
            last = time.monotonic()
            while not kv._closed and not self._closing:
                head = seg.feed_head()  # (before the step: a write after it rings the bell)
                events = feed.step()
                if events:
                    for e in events:
                        yield e
                    last = time.monotonic()
                    continue
                wait = None if timeout is None else last + timeout - time.monotonic()
                if wait is not None and wait <= 0:
                    return
                if feed.sub is not None:
                    wait = _CLUSTER_POLL if wait is None else min(wait, _CLUSTER_POLL)
                await bell.wait(head, wait)
        finally:
            feed.close()

    async def presence(self, prefix: str, agent_id: str, ttl: float = 2.0,
                       value: Any = b"") -> AsyncPresence:
        """Awaited :meth:`kvcomm.Client.presence`: returns an :class:`AsyncPresence`
        (its refreshes run in the sync handle's thread, never on the loop)."""
        fn, args = self._kv.presence, (prefix, agent_id, ttl, value)
        handle = _inline(self, fn, args, {})
        if handle is _WOULD_WAIT or handle.__class__ is L3Read:
            # (in the pool; should its task be cancelled meanwhile, the handle made is
            # stopped and its key removed: nobody else holds it)
            handle = await self._off_loop(fn, args, {}, made=self._stop_presence)
        return AsyncPresence(self, handle)

    def _stop_presence(self, handle: Presence) -> Future[None]:
        """A presence made for a task cancelled meanwhile: stopped and its key removed, in
        the pool (stop waits for the refresh thread); :meth:`close` waits for it."""
        return _executor().submit(handle.stop, remove=True)

    def _track(self, cf: Future[Any]) -> None:
        """``cf`` is in flight until done: :meth:`close` waits for it."""
        self._inflight.add(cf)
        cf.add_done_callback(self._inflight.discard)

    async def close(self) -> None:
        """Close the client: waits for its calls still running in the pool (cancelled ones
        included), then :meth:`kvcomm.Client.close` (off the loop: it may wait for the
        writer lock). Idempotent."""
        loop = asyncio.get_running_loop()
        while self._l3_waiting and self._l3_loop is loop:  # (awaited before close: sent now,
            self._send_l3_reads(loop)  # and waited for below, not run on the closed client)
        while self._inflight:  # (until none is left: a cancelled call's clean-up joins late)
            done, _ = await asyncio.wait([asyncio.wrap_future(f) for f in list(self._inflight)])
            for f in done:  # (each call's error is its caller's: this wait's copy of it
                if not f.cancelled():  # retrieved, not logged as never retrieved)
                    f.exception()
        # (cancelled up to here, the client stays open, its watches running; from here on
        # the sync close runs whatever befalls this task)
        self._closing = True  # (before the bell stops: a watch it wakes then ends, not
        # waits on a bell no thread rings any more while the sync close runs in the pool)
        if self._bell is not None:
            self._bell.stop()
        if not self._kv._closed:
            await asyncio.wrap_future(_executor().submit(self._kv.close))

    aclose = close

    async def __aenter__(self) -> AsyncClient:
        self._kv._live()  # (a closed client: SegmentError saying so, as the sync face's)
        return self

    def __enter__(self) -> NoReturn:
        raise UsageError("kvcomm.aio's client is entered with `async with`: write `async with "
                         "kvcomm.aio.open(...) as kv:` (a plain `with` is the sync client's, "
                         "kvcomm.open())")

    def __exit__(self, *exc: object) -> None:
        return None

    def __reduce__(self) -> NoReturn:
        raise UsageError(_NOT_SENT.format(open="kvcomm.aio.open"))

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<kvcomm.aio.AsyncClient of {self._kv!r}>"

    if TYPE_CHECKING:  # the generated faces (below): each a sync method's name, awaited
        def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]: ...


# every other public method of the sync client: the same name and signature, awaited
_OWN_FACES = {"batch", "scan", "watch", "presence", "close"}
for _name, _fn in _public(Client).items():
    if _name not in _OWN_FACES:
        setattr(AsyncClient, _name, _awaited(_name, _fn))
del _name, _fn


def _answer_l3_reads(reads: list[tuple[str, bool, asyncio.Future[Any]]],
                     done: asyncio.Future[list[Any]]) -> None:
    """Hand each awaiting read its answer from ``Client._get_l3_many`` (an exception in
    an answer's place is that read's own), or the exception the whole read raised."""
    exc = None if done.cancelled() else done.exception()
    answers: list[Any] = [] if exc is not None or done.cancelled() else done.result()
    for i, (_key, _timed, fut) in enumerate(reads):
        if fut.done():
            continue
        if done.cancelled():
            fut.cancel()
        elif exc is not None:
            fut.set_exception(exc)
        elif isinstance(answers[i], BaseException):
            fut.set_exception(answers[i])
        else:
            fut.set_result(answers[i])


def _take(it: Iterator[Item], n: int) -> list[Item]:
    return list(islice(it, n))


class _Collected:
    """What ``AsyncBatch.put``/``delete`` return: the op is collected at once, so there is
    nothing to wait for, and ``await b.put(...)`` (the async face invites it) works too."""

    __slots__ = ()

    def __await__(self) -> Iterator[None]:
        return iter(())

    def __repr__(self) -> str:
        return "<collected: applied when the batch's block ends>"


_COLLECTED = _Collected()


class _AsyncOnly:
    """What ``scan`` and ``watch`` return: their async generator, for ``async for`` (which
    iterates the generator itself; ``anext``, ``aclose()``... reach it too), and a
    UsageError saying so for a plain ``for`` (Python's own error named no fix)."""

    __slots__ = ("_gen", "_what")

    def __init__(self, gen: AsyncIterator[Any], what: str) -> None:
        self._gen, self._what = gen, what

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._gen

    def __anext__(self) -> Awaitable[Any]:
        return self._gen.__anext__()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gen, name)

    def __iter__(self) -> NoReturn:
        raise UsageError(f"kvcomm.aio's {self._what}() is iterated with `async for`: write "
                         f"`async for x in kv.{self._what}(...)` (a plain `for` is the sync "
                         "client's, kvcomm.open())")


class AsyncBatch:
    """``async with kv.batch() as b`` (see :class:`kvcomm.Batch`): ``b.put`` and
    ``b.delete`` collect at once (and raise at once for bad input), awaited or not; the
    block's exit applies the batch whole, or not at all, on the loop or (a held lock, the
    network) in the pool."""

    def __init__(self, client: AsyncClient, batch: Any) -> None:
        self._client = client
        self.sync = batch

    def put(self, key: str, value: Any, *, ttl: float | None = None) -> _Collected:
        """:meth:`kvcomm.Batch.put`: collected now (``await`` it or not)."""
        self.sync.put(key, value, ttl=ttl)
        return _COLLECTED

    def delete(self, key: str) -> _Collected:
        """:meth:`kvcomm.Batch.delete`: collected now (``await`` it or not)."""
        self.sync.delete(key)
        return _COLLECTED

    @property
    def versions(self) -> list[Any]:
        """Per operation, once applied: a put's Version, whether a delete deleted."""
        return self.sync.versions  # type: ignore[no-any-return]

    def __len__(self) -> int:
        return len(self.sync)

    async def __aenter__(self) -> AsyncBatch:
        self.sync.__enter__()
        return self

    def __enter__(self) -> NoReturn:
        raise UsageError("kvcomm.aio's batch() is applied by `async with`: write `async with "
                         "kv.batch() as b:` (a plain `with` is the sync client's, kvcomm.open())")

    def __exit__(self, *exc: object) -> None:
        return None

    async def __aexit__(self, exc_type: object, *rest: object) -> None:
        b = self.sync
        b._seal()
        await self._client._attempt(b._finish, (exc_type is None,), {})


class AsyncPresence:
    """The handle of :meth:`AsyncClient.presence`: the sync :class:`kvcomm.Presence`
    (``key``, ``ttl``, ``refreshes``, ``failures``, ``alive``... read through) with
    ``await stop()``."""

    def __init__(self, client: AsyncClient, handle: Presence) -> None:
        self._client = client
        self.sync = handle

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sync, name)

    async def stop(self, *, remove: bool = False) -> None:
        """:meth:`kvcomm.Presence.stop`, off the loop (it waits for the refresh thread)."""
        await self._client._off_loop(self.sync.stop, (), {"remove": remove})

    async def __aenter__(self) -> AsyncPresence:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def __repr__(self) -> str:
        return f"<kvcomm.aio.AsyncPresence of {self.sync!r}>"


class _FeedBell:
    """Wakes the watches of one async client when the host's feed head moves: a thread
    looks at the head word while some watch waits (0.1 ms, doubling up to 5 ms while
    nothing moves) and ends 1 s after the last one stopped waiting."""

    def __init__(self, seg: Any) -> None:
        self._seg = seg
        self._lock = threading.Lock()
        self._waiters: dict[asyncio.Future[None], tuple[asyncio.AbstractEventLoop, int]] = {}
        self._thread: threading.Thread | None = None
        self._stopped = False

    async def wait(self, head: int, timeout: float | None) -> None:
        """Return once the feed head is no longer ``head`` (or after ``timeout`` s)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._stopped:  # (no thread rings a stopped bell: the caller looks again)
                return
            self._waiters[fut] = (loop, head)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="kvcomm-aio-bell")
                self._thread.start()
        timer = loop.call_later(timeout, _wake, fut) if timeout is not None else None
        try:
            await fut
        finally:
            if timer is not None:
                timer.cancel()
            with self._lock:
                self._waiters.pop(fut, None)

    def _run(self) -> None:
        idle = 0.0001
        quiet_since = time.monotonic()
        while True:
            with self._lock:
                waiting = list(self._waiters.items())
                now = time.monotonic()
                if self._stopped or (not waiting and now - quiet_since > 1.0):
                    self._thread = None
                    ring = waiting if self._stopped else []
                    break
            if waiting:
                quiet_since = now
            try:
                head = self._seg.feed_head()
            except Exception:  # (the segment was closed under the watch: wake everyone)
                head = -1
            rang = False
            for fut, (loop, h0) in waiting:
                if head != h0:
                    rang = True
                    with self._lock:
                        self._waiters.pop(fut, None)
                    _ring(loop, fut)
            idle = 0.0001 if rang else min(idle * 2, _BELL_IDLE_MAX)
            time.sleep(idle)
        for fut, (loop, _) in ring:
            _ring(loop, fut)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _ring(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> None:
    try:
        loop.call_soon_threadsafe(_wake, fut)
    except RuntimeError:
        pass  # (that loop is closed)


class _Opening:
    """What :func:`open` returns: awaited, the client; as ``async with``, the client,
    closed at the block's end."""

    def __init__(self, name: str | None, kwargs: dict[str, Any]) -> None:
        self._args = (name,)
        self._kwargs = kwargs
        self._client: AsyncClient | None = None

    async def _open(self) -> AsyncClient:
        # in the pool: opening maps the segment and, in cluster mode, asks L3 and etcd;
        # its warnings are warned here, on the loop, at the caller's line
        said: list[str] = []
        cf = _executor().submit(_open_deferring, said, self._args, self._kwargs)
        try:
            kv = await asyncio.wrap_future(cf)
        except asyncio.CancelledError:  # (an open still under way: closed once made)
            cf.add_done_callback(_close_made)
            raise
        for message in said:
            warn_outside_kvcomm(message)
        return AsyncClient(kv)

    def __await__(self) -> Generator[Any, None, AsyncClient]:
        return self._open().__await__()

    async def __aenter__(self) -> AsyncClient:
        self._client = await self._open()
        return self._client

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.aclose()

    def __enter__(self) -> NoReturn:
        raise UsageError("kvcomm.aio.open() is the asyncio face: write `async with "
                         "kvcomm.aio.open(...) as kv:` or `kv = await kvcomm.aio.open(...)`, "
                         "or `with kvcomm.open(...) as kv:` for the sync client")

    def __exit__(self, *exc: object) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        # (a client's method on what open() returned: the open was not awaited)
        if name.startswith("_"):
            raise AttributeError(name)
        raise UsageError(
            f"kvcomm.aio.open() was not awaited, so there is no client to call .{name} on: "
            "write `kv = await kvcomm.aio.open(...)` (then `await kv.aclose()`) or "
            "`async with kvcomm.aio.open(...) as kv:`")


def _open_deferring(said: list[str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Client:
    """:func:`kvcomm.open` on this (a pool) thread, its warnings kept in ``said``."""
    deferred_warnings(said)
    try:
        return _open_sync(*args, **kwargs)
    finally:
        deferred_warnings(None)


def _close_made(f: Future[Client]) -> None:
    if not f.cancelled() and f.exception() is None:
        f.result().close()


def open(name: str | None = None, *,  # noqa: A001
         config: Config | str | os.PathLike[str] | None = None,
         agent: str | None = None, wait_daemon: bool = True) -> _Opening:
    """``async with kvcomm.aio.open(...) as kv`` or ``kv = await kvcomm.aio.open(...)``:
    an :class:`AsyncClient` over :func:`kvcomm.open` with the same arguments (opened in
    the pool: the loop never waits for it, nor for the node daemon in cluster mode).
    Raises what :func:`kvcomm.open` raises."""
    return _Opening(name, {"config": config, "agent": agent, "wait_daemon": wait_daemon})
