"""kvcomm.aio: the asyncio face, as users call it (embedded), its loop never waiting for a
held writer lock, a watch woken by another process, cancellation at random points."""

from __future__ import annotations

import asyncio
import gc
import inspect
import multiprocessing
import os
import random
import signal
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

import kvcomm
import kvcomm.aio
import kvcomm.tiers.l2
from kvcomm.aio import AsyncClient
from tests.support.helpers import SMALL


def run(coro_fn: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(coro_fn())  # type: ignore[arg-type]


class Ticker:
    """A 1 ms ticker on the running loop: its worst lag is how long the loop was stalled."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.ticks = 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            self.worst = max(self.worst, time.perf_counter() - t - 0.001)
            self.ticks += 1

    def __enter__(self) -> Ticker:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


@pytest.fixture
def aconfig() -> kvcomm.Config:
    return kvcomm.Config.from_mapping(SMALL)


def test_every_public_sync_method_has_an_awaited_face_with_its_signature() -> None:
    sync = {n: f for n, f in inspect.getmembers(kvcomm.Client, inspect.isfunction)
            if not n.startswith("_")}
    assert {"put", "get", "get_item", "delete", "update", "incr", "touch", "batch", "scan",
            "watch", "presence", "present", "close"} <= set(sync)
    for name, fn in sync.items():
        face = getattr(AsyncClient, name, None)
        assert face is not None, f"kvcomm.aio has no face for Client.{name}"
        want = list(inspect.signature(fn).parameters.values())
        got = list(inspect.signature(face).parameters.values())
        assert got == want, f"{name}: {got} != {want}"
        if name in ("batch", "scan", "watch"):  # (an async context manager, async iterators)
            assert not inspect.iscoroutinefunction(face), name
        else:
            assert inspect.iscoroutinefunction(face), f"{name} is not awaited"
    open_params = inspect.signature(kvcomm.aio.open).parameters
    assert list(open_params) == list(inspect.signature(kvcomm.open).parameters)


def test_the_contract_as_users_call_it_in_both_open_styles(ns: str,
                                                           aconfig: kvcomm.Config) -> None:
    async def main() -> None:
        async with kvcomm.aio.open(name=ns, config=aconfig) as kv:
            assert kv.name == ns and isinstance(kv.sync, kvcomm.Client)
            v1 = await kv.put("k", {"a": 1}, ttl=None, expect=kvcomm.ABSENT)
            assert await kv.get("k") == {"a": 1} and await kv.get("nope", default=7) == 7
            item = await kv.get_item("k")
            assert item is not None and item.version == v1 and item.value == {"a": 1}
            with pytest.raises(kvcomm.ConflictError):
                await kv.put("k", 2, expect=kvcomm.ABSENT)
            v2 = await kv.put("k", 2, expect=v1)
            assert v2 > v1
            assert await kv.update("n", lambda v: v + 1, default=10) == 11
            assert await kv.update("n", lambda v: v * 2, default=0, ttl=30) == 22
            assert await kv.touch("k", 60) is True and await kv.touch("absent", 1) is False
            assert await kv.incr("ctr") == 1 and await kv.incr("ctr", delta=-3) == -2
            assert await kv.get("ctr") == -2
            got = await kv.get_item("k")
            assert got is not None and got.expires_at is not None
            with pytest.raises(kvcomm.ConflictError):
                await kv.delete("k", expect=kvcomm.ABSENT)
            assert await kv.delete("k") is True and await kv.get("k") is None
            async with kv.batch() as b:
                b.put("b/1", 1)
                await b.put("b/2", 2, ttl=30)  # (awaited or not: collected at once)
                await b.delete("n")
                with pytest.raises(kvcomm.InvalidKey):
                    await b.put("", 0)
                assert len(b) == 3
            assert len(b.versions) == 3 and b.versions[2] is True
            assert [i.key async for i in kv.scan("b/")] == ["b/1", "b/2"]
            page = [i.key async for i in kv.scan("b/", limit=1, after="b/1")]
            assert page == ["b/2"]
            assert await kv.keys("b/") == ["b/1", "b/2"]
            p = await kv.presence("alive/", "a1", ttl=0.3)
            assert p.key == "alive/a1" and p.alive
            assert await kv.present("alive/") == ["a1"]
            await p.stop(remove=True)
            assert await kv.present("alive/") == []
            stats = await kv.stats()
            assert stats["ops"]["puts"] >= 4
            assert isinstance(await kv.hot_keys(3), list)
        with pytest.raises(kvcomm.SegmentError):
            await kv.get("b/1")  # closed by the block
        kv2 = await kvcomm.aio.open(ns, config=aconfig)
        try:
            assert await kv2.get("b/1") == 1
            assert await kv2.delete("b/1") is True and await kv2.delete("b/1") is False
        finally:
            await kv2.aclose()
        await kv2.aclose()  # idempotent

    run(main)


def test_an_open_asking_another_size_is_warned_at_the_callers_line(
        ns: str, aconfig: kvcomm.Config) -> None:
    """``kvcomm.aio.open`` opens in its pool: the warning that the namespace keeps its size
    is warned on the loop, at the caller's line, not the pool thread's (review of stop
    37: it named concurrent/futures/thread.py)."""
    other = kvcomm.Config.from_mapping({**aconfig.model_dump(mode="json"),
                                        "cache": {**aconfig.cache.model_dump(mode="json"),
                                                  "l2_size": "8MB"}})

    async def run() -> None:
        async with kvcomm.aio.open(ns, config=aconfig):
            with pytest.warns(kvcomm.KVCommWarning, match="is ignored until") as seen:
                kv = await kvcomm.aio.open(ns, config=other)
            await kv.aclose()
            assert seen[0].filename == __file__, seen[0].filename

    asyncio.run(run())


def test_the_first_scan_builds_the_key_index_off_the_loop(ns: str,
                                                           aconfig: kvcomm.Config) -> None:
    async def main() -> None:
        async with kvcomm.aio.open(ns, config=aconfig) as kv:
            async with kv.batch() as b:
                for i in range(600):
                    b.put(f"s/{i:04d}", i)
            off0 = kv.off_loop
            first = [i.value async for i in kv.scan("s/")]  # (the index is made: O(keys))
            assert first == list(range(600)) and kv.off_loop == off0 + 1
            await kv.put("s/0600", 600)
            again = [i.key async for i in kv.scan("s/", after="s/0597")]  # (kept in step)
            assert again == ["s/0598", "s/0599", "s/0600"] and kv.off_loop == off0 + 1

    run(main)


def test_errors_are_the_sync_clients(ns: str, aconfig: kvcomm.Config) -> None:
    sync = kvcomm.open(ns, config=aconfig)

    def reject(key: str, old: kvcomm.Item | None, new: Any) -> None:
        if new == "bad":
            raise ValueError("no")

    async def main() -> None:
        async with kvcomm.aio.open(ns, config=aconfig) as kv:
            await kv.register_validator("v/", reject)
            calls: list[tuple[Callable[[], Any], Callable[[], Awaitable[Any]]]] = [
                (lambda: sync.put("", 1), lambda: kv.put("", 1)),
                (lambda: sync.get(3), lambda: kv.get(3)),
                (lambda: sync.put("x", 1, ttl=-1), lambda: kv.put("x", 1, ttl=-1)),
                (lambda: sync.put("x", object()), lambda: kv.put("x", object())),
                (lambda: sync.update("x", 5), lambda: kv.update("x", 5)),
                (lambda: sync.put("x", 1, expect=3), lambda: kv.put("x", 1, expect=3)),
                (lambda: sync.presence("a/", "", ttl=1), lambda: kv.presence("a/", "", ttl=1)),
            ]
            for s, a in calls:
                with pytest.raises(kvcomm.KVCommError) as want:
                    s()
                with pytest.raises(kvcomm.KVCommError) as got:
                    await a()
                assert type(got.value) is type(want.value) and str(got.value) == str(want.value)
            with pytest.raises(kvcomm.ValidationError):
                await kv.put("v/1", "bad")
            with pytest.raises(kvcomm.ValidationError):
                async with kv.batch() as b:
                    b.put("v/2", "ok")
                    b.put("v/3", "bad")
            assert await kv.get("v/2") is None  # all or nothing
            with pytest.raises(KeyError):
                async with kv.batch() as b:
                    b.put("v/4", 1)
                    raise KeyError("abandoned")
            assert await kv.get("v/4") is None
            with pytest.raises(kvcomm.InvalidArgument):
                b.put("v/5", 1)  # a batch is used once
            # bad arguments of the iterators raise at the call, as the sync ones do
            with pytest.raises(kvcomm.InvalidKey):
                kv.scan(5)  # type: ignore[arg-type]
            with pytest.raises(kvcomm.InvalidArgument):
                kv.scan("", limit=0)
            with pytest.raises(kvcomm.InvalidArgument):
                kv.watch("", timeout=-1)

    try:
        run(main)
    finally:
        sync.close()


@pytest.fixture
def lock_holder(ns: str, aconfig: kvcomm.Config) -> Iterator[Callable[[float], threading.Event]]:
    """``hold(seconds)``: another thread takes the host's L2 writer lock of ``ns`` and keeps
    it that long; returns the Event set once it holds it."""
    other = kvcomm.open(ns, config=aconfig)
    threads: list[threading.Thread] = []

    def hold(seconds: float) -> threading.Event:
        held = threading.Event()

        def keep() -> None:
            held.set()
            time.sleep(seconds)

        t = threading.Thread(target=other._seg.locked, args=(keep,), daemon=True)
        t.start()
        threads.append(t)
        assert held.wait(10)
        return held

    yield hold
    for t in threads:
        t.join(10)
    other.close()


def test_a_held_writer_lock_never_stalls_the_loop(ns: str, aconfig: kvcomm.Config,
                                                   lock_holder: Any) -> None:
    """Another writer holds the lock for 0.3 s: the put waits for it off the loop (and is
    then applied), while a 1 ms ticker keeps ticking."""

    async def main() -> None:
        async with kvcomm.aio.open(ns, config=aconfig) as kv:
            await kv.put("warm", 1)
            with Ticker() as ticker:
                await asyncio.sleep(0.02)
                lock_holder(0.3)
                t0, ticks0 = time.monotonic(), ticker.ticks
                v = await kv.put("k", b"v")
                waited, ticked = time.monotonic() - t0, ticker.ticks - ticks0
                async with kv.batch() as b:  # (free again: applied inline)
                    b.put("k2", 2)
                updates0, off0 = kv.sync.counters["updates"], kv.off_loop
                lock_holder(0.1)
                assert await kv.update("n", lambda n: n + 1, default=0) == 1
                assert kv.off_loop == off0 + 1  # (it met the lock: ran again in the pool)
                assert kv.sync.counters["updates"] == updates0 + 1  # (counted once)
            assert waited >= 0.2, "the put did not meet the held lock"
            assert (await kv.get_item("k")).version == v  # type: ignore[union-attr]
            assert await kv.get("k2") == 2
            print(f"worst lag {ticker.worst * 1000:.1f} ms; {ticked} ticks while the put waited")
            assert ticked >= 5  # the loop ran while the put waited (inline: not once)

    run(main)


async def running_in_the_pool(kv: AsyncClient, what: str) -> None:
    """Until a call of ``kv`` met the held lock and runs in the pool (one cancelled while
    still queued there never runs: on a loaded machine the pool's thread can be late)."""
    deadline = time.monotonic() + 10
    while not any(f.running() for f in kv._inflight):
        assert time.monotonic() < deadline, f"{what} never ran in the pool"
        await asyncio.sleep(0.001)


def short_lock() -> kvcomm.Config:
    """A config whose calls give up on a held writer lock after 0.1 s (Unavailable)."""
    return kvcomm.Config.from_mapping({**SMALL, "cache": {**SMALL["cache"], "lock_timeout": 0.1}})


def asyncio_log() -> list[dict[str, Any]]:
    """What the running loop's exception handler is given from now on (asyncio's log:
    "Future exception was never retrieved"...)."""
    logged: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: logged.append(ctx))
    return logged


@pytest.mark.parametrize("outlasts", [False, True])
def test_a_cancellation_waits_for_the_write_under_way(ns: str, aconfig: kvcomm.Config,
                                                      lock_holder: Any, outlasts: bool) -> None:
    """A put waiting in the pool for a held lock is cancelled: the task ends once the put
    did (so no write of a cancelled task lands later, over a newer one). ``outlasts``: the
    hold outlasts cache.lock_timeout, so the put fails there after its task was cancelled;
    asyncio logs nothing ("Future exception was never retrieved ... Unavailable" was
    logged for each such call)."""

    async def main() -> None:
        logged = asyncio_log()
        async with kvcomm.aio.open(ns, config=short_lock() if outlasts else aconfig) as kv:
            lock_holder(0.6 if outlasts else 0.3)
            task = asyncio.create_task(kv.put("d", 1))
            await running_in_the_pool(kv, "the put")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            del task
            gc.collect()  # (an unretrieved error is logged when its future is collected)
            await asyncio.sleep(0)
            # (applied before the cancellation reached it; or failed: nothing written)
            assert kv.sync.get("d") == (None if outlasts else 1)
            assert not kv._inflight
        assert not logged, [c.get("message") for c in logged]

    run(main)


def test_many_calls_meeting_one_long_hold_wait_on_the_loop_once(
        ns: str, aconfig: kvcomm.Config, lock_holder: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls on the loop wait at most INLINE_LOCK_WAIT for a held writer lock, then run in
    the pool. Once one met a long hold, the next ones only try the lock (for
    _LOCK_BUSY_FOR): 300 coroutines meeting one hold stalled the loop 300 x 200 µs."""
    budgets: list[float] = []
    real = kvcomm.aio.set_inline_wait

    def recorded(seconds: float) -> float:
        if seconds >= 0:
            budgets.append(seconds)
        return real(seconds)

    monkeypatch.setattr(kvcomm.aio, "set_inline_wait", recorded)
    monkeypatch.setattr(kvcomm.aio, "_LOCK_BUSY_FOR", 60.0)  # (the whole test: no timing)

    async def main() -> None:
        async with kvcomm.aio.open(ns, config=aconfig) as kv:
            await kv.put("warm", 0)
            assert budgets == [kvcomm.aio.INLINE_LOCK_WAIT]  # (free: no hold met yet)
            budgets.clear()
            lock_holder(0.3)
            off0 = kv.off_loop
            await asyncio.gather(*(kv.put(f"k/{i}", i) for i in range(50)))
            assert kv.off_loop - off0 == 50  # (each met the hold, and ran in the pool)
            assert budgets[0] == kvcomm.aio.INLINE_LOCK_WAIT and budgets[1:] == [0.0] * 49
            # (only a call that met the hold for its whole budget opens the window: those
            # within it, meeting holds of any length, leave its end where it was; a steady
            # run of microsecond holds sent each call to the pool for as long as it lasted)
            opened = kv._busy_until
            lock_holder(0.2)
            await kv.put("in-window", 1)
            assert kv._busy_until == opened and budgets[-1] == 0.0
            budgets.clear()  # (the window is this client's: another namespace's waits)
            async with kvcomm.aio.open(f"{ns}-b", config=aconfig) as other:
                await other.put("x", 1)
            kvcomm.tiers.l2.purge(f"{ns}-b")
            assert budgets == [kvcomm.aio.INLINE_LOCK_WAIT]
            assert [await kv.get(f"k/{i}") for i in range(50)] == list(range(50))
            kv._busy_until = 0.0  # (the window over: the budget is back)
            budgets.clear()
            await kv.put("after", 1)  # (free again: applied inline)
            assert budgets == [kvcomm.aio.INLINE_LOCK_WAIT] and kv.off_loop - off0 == 51

    run(main)


def _hold_the_lock_until_killed(ns: str, cfg: dict[str, Any], held: Any) -> None:
    kv = kvcomm.open(ns, config=kvcomm.Config.from_mapping(cfg))
    kv._seg._core.lock(5.0)
    held.set()
    time.sleep(60)  # (SIGKILLed holding it)


def test_a_holder_process_killed_while_many_calls_wait_loses_no_acknowledged_put(
        ns: str, aconfig: kvcomm.Config) -> None:
    """Another process takes the writer lock and is SIGKILLed holding it while 50
    coroutines' puts meet the hold (the first waits its budget on the loop, the others
    only try, in the busy window, then wait in the pool): the lock passes on from the dead
    holder, every put is acknowledged and reads back, and the loop kept ticking."""
    ctx = multiprocessing.get_context("spawn")
    held = ctx.Event()
    proc = ctx.Process(target=_hold_the_lock_until_killed, args=(ns, SMALL, held))

    async def main() -> None:
        async with kvcomm.aio.open(ns, config=aconfig) as kv:
            await kv.put("warm", 0)
            proc.start()
            assert held.wait(30), "the holder never took the lock"
            off0 = kv.off_loop
            with Ticker() as ticker:
                puts = asyncio.gather(*(kv.put(f"k/{i}", i) for i in range(50)))
                deadline = time.monotonic() + 10
                while kv.off_loop - off0 < 50:  # (all met the hold: in the pool, waiting)
                    assert time.monotonic() < deadline, "the puts never met the hold"
                    await asyncio.sleep(0.001)
                assert kv._busy_until > time.monotonic() - 1  # (the window)
                os.kill(proc.pid, signal.SIGKILL)
                versions = await puts
            print(f"worst lag {ticker.worst * 1000:.1f} ms")
            assert len(versions) == 50
            assert [await kv.get(f"k/{i}") for i in range(50)] == list(range(50))
            assert kv.sync._seg.check() == []

    try:
        run(main)
    finally:
        proc.join(30)
    assert proc.exitcode == -signal.SIGKILL


def test_a_close_cancelled_while_it_waits_leaves_the_client_open_and_its_watches_on(
        ns: str, aconfig: kvcomm.Config, lock_holder: Any) -> None:
    """close() waits for the calls still in the pool; cancelled then (a timeout around it),
    the client stays open and usable, its watches with it (they ended at once: close had
    already told them so)."""

    async def main() -> None:
        async with kvcomm.aio.open(ns, config=aconfig) as kv:
            watch = kv.watch("x/", timeout=10)
            lock_holder(0.4)
            put = asyncio.create_task(kv.put("x/0", 0))
            await running_in_the_pool(kv, "the put")
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(kv.aclose(), 0.05)
            await put
            assert not kv.sync._closed
            await kv.put("x/1", 1)
            got = [(await watch.__anext__()).key, (await watch.__anext__()).key]
            assert got == ["x/0", "x/1"]
            await watch.aclose()  # type: ignore[attr-defined]

    run(main)


def test_a_close_leaves_no_error_of_a_call_in_flight_unretrieved(ns: str,
                                                                 lock_holder: Any) -> None:
    """close() waits for the calls in flight; one that fails meanwhile (the lock held past
    cache.lock_timeout) raises to its own caller, and asyncio logs nothing (close's wait
    left its copy of the error unretrieved, logged when collected)."""
    async def main() -> None:
        logged = asyncio_log()
        kv = await kvcomm.aio.open(ns, config=short_lock())
        lock_holder(0.6)
        put = asyncio.create_task(kv.put("d", 1))
        await running_in_the_pool(kv, "the put")
        await kv.aclose()
        with pytest.raises(kvcomm.Unavailable):
            await put
        del put
        gc.collect()
        await asyncio.sleep(0)
        assert not logged, [c.get("message") for c in logged]

    run(main)


def test_a_watch_ends_when_its_client_closes_even_while_the_close_is_slow(
        ns: str, aconfig: kvcomm.Config, monkeypatch: pytest.MonkeyPatch) -> None:
    """An async watch without a timeout ends when its client closes, as the sync watch
    does. close() stops the watches' bell first, then closes the sync client in the pool;
    a watch woken in between looked again, saw the client still open and waited for ever
    on a bell nobody rang any more (another process holding the writer lock makes close
    slow enough; a delay stands for it here)."""

    async def main() -> None:
        kv = await kvcomm.aio.open(ns, config=aconfig)
        events: list[str] = []

        watch = kv.watch("w/")  # (changes from this call on)

        async def watcher() -> str:
            async for e in watch:
                events.append(e.key)
            return "ended"

        task = asyncio.create_task(watcher())
        await kv.put("w/1", 1)
        deadline = time.monotonic() + 10
        while not events:  # (the watch runs, and waits on the bell)
            assert time.monotonic() < deadline, "the watch saw no event"
            await asyncio.sleep(0.001)
        sync_close = kv.sync.close

        def slow_close() -> None:
            time.sleep(0.1)
            sync_close()

        monkeypatch.setattr(kv.sync, "close", slow_close)
        await kv.aclose()
        assert await asyncio.wait_for(task, 10) == "ended"
        assert events == ["w/1"]

    run(main)


def test_a_presence_made_for_a_cancelled_task_is_stopped_and_removed(
        ns: str, aconfig: kvcomm.Config, lock_holder: Any) -> None:
    """await kv.presence(...) waiting in the pool for a held lock is cancelled: the handle
    the call then made reached nobody, and its thread refreshed the agent's key until the
    client closed (the adversary's find: 3 of 11 cancelled calls left agents present).
    Now it is stopped and its key removed; close waits for that."""

    async def main() -> None:
        async with kvcomm.aio.open(ns, config=aconfig) as kv:
            lock_holder(0.3)
            task = asyncio.create_task(kv.presence("alive/", "ghost", ttl=0.5))
            await running_in_the_pool(kv, "the presence")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            deadline = time.monotonic() + 10
            while "ghost" in await kv.present("alive/"):
                assert time.monotonic() < deadline, "the cancelled call's agent stays present"
                await asyncio.sleep(0.01)
            assert not [t for t in threading.enumerate() if "ghost" in t.name and t.is_alive()]
        for i in range(8):  # (closed at once after the cancel: close waits for the
            # clean-up, which joins its calls in flight late; the review's find: 2-3 of 5-8
            # such closes left the agent present)
            async with kvcomm.aio.open(ns, config=aconfig) as kv:
                lock_holder(0.05)
                task = asyncio.create_task(kv.presence("alive/", f"late{i}", ttl=30))
                await running_in_the_pool(kv, "the presence")
                task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        with kvcomm.open(ns, config=aconfig) as other:
            assert other.present("alive/") == [], "close left agents present"

    run(main)


def _put_later(ns: str, cfg: dict[str, Any], delay: float) -> None:
    kv = kvcomm.open(ns, config=kvcomm.Config.from_mapping(cfg))
    time.sleep(delay)
    kv.put("w/from-other", {"pid": 1})
    kv.put("elsewhere", 1)
    kv.close()


def test_a_watch_is_woken_by_another_processes_put(ns: str, aconfig: kvcomm.Config) -> None:
    async def main() -> None:
        async with kvcomm.aio.open(ns, config=aconfig) as kv:
            watch = kv.watch("w/", timeout=20)
            proc = multiprocessing.get_context("spawn").Process(
                target=_put_later, args=(ns, SMALL, 0.3))
            proc.start()
            try:
                with Ticker() as ticker:
                    t0 = time.monotonic()
                    ev = await watch.__anext__()
                    assert ev.key == "w/from-other" and ev.kind == "put"
                    assert ev.version == (await kv.get_item("w/from-other")).version  # type: ignore[union-attr]
                    assert time.monotonic() - t0 < 19  # woken, not timed out
                print(f"worst lag {ticker.worst * 1000:.1f} ms")
                await watch.aclose()  # type: ignore[attr-defined]
            finally:
                proc.join(30)
            assert proc.exitcode == 0
            # an idle watch ends at its timeout, as the sync one
            assert [e async for e in kv.watch("w/", timeout=0.05)] == []

    run(main)


def test_an_idle_watch_leaves_the_loop_asleep(ns: str, aconfig: kvcomm.Config) -> None:
    """While a watch waits 0.5 s for an event that does not come, the loop is woken a few
    times (its timeout), not every millisecond; then a put wakes it."""

    async def main() -> None:
        async with kvcomm.aio.open(ns, config=aconfig) as kv:
            loop = asyncio.get_running_loop()
            selector = loop._selector  # type: ignore[attr-defined]
            wakeups = 0
            select = selector.select

            def counting(timeout: float | None = None) -> Any:
                nonlocal wakeups
                wakeups += 1
                return select(timeout)

            selector.select = counting
            try:
                assert [e async for e in kv.watch("idle/", timeout=0.5)] == []
                idle_wakeups = wakeups
                w = kv.watch("idle/", timeout=20)
                nxt = asyncio.ensure_future(w.__anext__())
                await asyncio.sleep(0.05)
                await kv.put("idle/1", 1)
                assert (await nxt).key == "idle/1"
                await w.aclose()  # type: ignore[attr-defined]
            finally:
                selector.select = select
            assert idle_wakeups < 20, f"the loop was woken {idle_wakeups} times in 0.5 s"

    run(main)


def test_a_watch_sees_the_same_events_as_the_sync_watch(ns: str, aconfig: kvcomm.Config) -> None:
    async def main() -> None:
        async with kvcomm.aio.open(ns, config=aconfig) as kv:
            sync_watch = kv.sync.watch("e/", timeout=0.3)
            aw = kv.watch("e/", timeout=0.3)
            await kv.put("e/1", 1)
            await kv.put("e/2", 2, ttl=30)
            await kv.delete("e/1")
            await kv.put("other", 1)
            got = [e async for e in aw]
            want = await asyncio.to_thread(list, sync_watch)
            assert got == want and [e.kind for e in got] == ["put", "put", "delete"]

    run(main)


def test_a_watch_that_falls_a_feed_behind_gets_one_overflow(ns: str) -> None:
    cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": "16MB", "watch_buffer": 64}})

    async def main() -> None:
        async with kvcomm.aio.open(ns, config=cfg) as kv:
            aw = kv.watch("", timeout=0.2)
            for i in range(200):
                await kv.put(f"o/{i}", i)
            events = [e async for e in aw]
            assert events[0].kind == "overflow"
            assert sum(e.kind == "overflow" for e in events) == 1

    run(main)


def test_cancelled_at_random_points_no_lock_held_no_half_write(ns: str, aconfig: kvcomm.Config,
                                                               seed: int) -> None:
    """Workers write under load (another thread takes the writer lock now and then, so
    calls wait in the pool, where cancellation can strike) and are cancelled at random,
    each restarted where it stopped. After: the lock is free, every batch is whole, every
    acknowledged write is there (no write of a cancelled task landed over a later one),
    and every counter holds at least its acknowledged increments and at most its
    attempts."""
    rng = random.Random(seed)
    other = kvcomm.open(ns, config=aconfig)
    stop = threading.Event()

    def interfere() -> None:
        r = random.Random(seed + 1)
        while not stop.is_set():
            other._seg.locked(lambda: time.sleep(r.uniform(0.0005, 0.004)))
            time.sleep(r.uniform(0.0005, 0.003))

    acked: dict[str, int] = {}  # key -> last acknowledged value (each key has one writer)
    seq: dict[int, int] = {}  # worker -> its last operation's number (across restarts)
    incr_acked: dict[str, int] = {}
    incr_tried: dict[str, int] = {}
    cancelled = 0
    off_loop = 0

    async def worker(kv: AsyncClient, w: int) -> None:
        while True:
            i = seq[w] = seq.get(w, 0) + 1
            op = i % 3
            if op == 0:
                await kv.put(f"p/{w}", i)
                acked[f"p/{w}"] = i
            elif op == 1:
                async with kv.batch() as b:
                    b.put(f"b/{w}/x", i)
                    b.put(f"b/{w}/y", i)
            else:
                k = f"c/{w % 4}"
                incr_tried[k] = incr_tried.get(k, 0) + 1
                if i % 2:
                    await kv.update(k, lambda v: v + 1, default=0)
                else:
                    await kv.incr(k)
                incr_acked[k] = incr_acked.get(k, 0) + 1
            await asyncio.sleep(0)

    async def main() -> None:
        nonlocal cancelled, off_loop
        async with kvcomm.aio.open(ns, config=aconfig) as kv:
            tasks = {w: asyncio.create_task(worker(kv, w)) for w in range(24)}
            # (2 s at least, and on until the faults happened enough: a loaded machine may
            # give the interfering thread few turns)
            t0 = time.monotonic()
            while (time.monotonic() < t0 + 2.0 or cancelled <= 50 or kv.off_loop <= 20) \
                    and time.monotonic() < t0 + 30.0:
                await asyncio.sleep(rng.uniform(0, 0.004))
                w = rng.randrange(24)
                tasks[w].cancel()
                try:
                    await tasks[w]
                except asyncio.CancelledError:
                    cancelled += 1
                tasks[w] = asyncio.create_task(worker(kv, w))
            for t in tasks.values():
                t.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            off_loop = kv.off_loop
        # (the block's close waited for every call still running in the pool)

    t = threading.Thread(target=interfere, daemon=True)
    t.start()
    try:
        run(main)
    finally:
        stop.set()
        t.join(10)
    kv = other
    try:
        print(f"cancelled {cancelled} tasks; {off_loop} calls waited in the pool")
        assert cancelled > 50 and off_loop > 20  # (the lock was met: awaits to cancel at)
        assert kv._seg.lock_owner() == 0
        kv.put("after", 1)  # the lock can be taken
        for w in range(24):
            assert kv.get(f"b/{w}/x") == kv.get(f"b/{w}/y"), f"batch {w} half written"
        for k, v in acked.items():
            assert kv.get(k) >= v, f"{k}: acknowledged {v}, holds {kv.get(k)}"
        for k, n in incr_acked.items():
            assert n <= kv.get(k, 0) <= incr_tried[k], (k, n, kv.get(k), incr_tried[k])
        assert sum(incr_acked.values()) > 50
    finally:
        other.close()


def test_a_client_method_on_an_open_not_awaited_says_to_await_it(ns: str) -> None:
    opening = kvcomm.aio.open(ns)
    with pytest.raises(kvcomm.UsageError, match="was not awaited"):
        opening.get("k")  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        opening._private  # type: ignore[attr-defined]  # noqa: B018


def test_the_first_hour_mistakes_of_the_async_face_say_what_to_write(
        ns: str, aconfig: kvcomm.Config) -> None:
    """A newcomer's mistakes got Python's own errors, naming no fix: `for` over an aio scan
    or watch ('async_generator' object is not iterable), `with` on an aio batch, and the
    sync client's watch waiting on the event loop's thread said nothing at all."""
    from kvcomm.integrations.langgraph import KVCommSaver, KVCommStore

    async def main() -> None:
        async with kvcomm.aio.open(ns, config=aconfig) as kv:
            await kv.put("s/a", 1)
            for what, it in (("scan", kv.scan("s/")), ("watch", kv.watch("s/", timeout=0.01))):
                with pytest.raises(kvcomm.UsageError, match=f"async for x in kv.{what}"):
                    for _x in it:  # type: ignore[attr-defined]
                        pass
            assert [i.key async for i in kv.scan("s/")] == ["s/a"]  # (async for: as before)
            it = kv.scan("s/")
            assert (await anext(it)).key == "s/a"
            await it.aclose()  # type: ignore[attr-defined]
            with pytest.raises(kvcomm.UsageError, match="async with kv.batch"):
                with kv.batch() as b:  # type: ignore[attr-defined]
                    b.put("s/b", 2)
            assert await kv.get("s/b") is None  # (nothing applied)
            with pytest.warns(kvcomm.KVCommWarning, match="asyncio event loop"):
                assert list(kv.sync.watch("s/", timeout=0.01)) == []
        opening = kvcomm.aio.open(ns, config=aconfig)
        for cls in (KVCommSaver, KVCommStore):
            with pytest.raises(kvcomm.UsageError, match=f"await kvcomm.aio.open.*{cls.__name__}"):
                cls(opening)  # type: ignore[arg-type]

    asyncio.run(main())
    with warnings.catch_warnings():  # (no loop on this thread: no warning)
        warnings.simplefilter("error")
        with kvcomm.open(ns, config=aconfig) as kv:
            assert list(kv.watch("s/", timeout=0.01)) == []
