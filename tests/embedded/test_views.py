"""Zero-copy numpy views: read-only, stable under overwrite/delete, reclaimed when dropped."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import kvcomm
from tests.support.helpers import wait_for

BIG = np.arange(1 << 17, dtype=np.float64)  # 1 MiB


def test_large_array_is_a_read_only_view(kv: kvcomm.Client) -> None:
    kv.put("a", BIG)
    got = kv.get("a")
    assert isinstance(got, np.ndarray) and np.array_equal(got, BIG)
    assert not got.flags.writeable and not got.flags.owndata
    with pytest.raises(ValueError):
        got[0] = 1.0
    with pytest.raises(ValueError):
        got.flags.writeable = True


def test_small_array_is_a_private_copy(kv: kvcomm.Client) -> None:
    small = np.arange(10, dtype=np.int32)
    kv.put("s", small)
    got = kv.get("s")
    assert np.array_equal(got, small) and got.flags.writeable


def test_view_never_changes_under_its_holder(kv: kvcomm.Client) -> None:
    kv.put("a", BIG)
    view = kv.get("a")
    kv.put("a", BIG * 2)
    kv.put("a", BIG * 3)
    assert np.array_equal(view, BIG)
    kv.delete("a")
    for i in range(50):  # churn the heap where the old block was
        kv.put(f"fill{i}", np.full(1 << 14, i, dtype=np.float64))
    assert np.array_equal(view, BIG)
    assert kv.get("a") is None


def test_space_reclaimed_once_views_go(kv: kvcomm.Client) -> None:
    kv.put("a", BIG)
    used_one = kv._seg.info()["used_bytes"]
    view = kv.get("a")
    kv.put("a", BIG + 1)
    assert kv._seg.info()["pinned_deferred_blocks"] == 1
    assert kv._seg.info()["used_bytes"] >= 2 * used_one
    del view
    gc.collect()
    kv.put("other", 1)  # the next write sweeps released pins
    info = kv._seg.info()
    assert info["pinned_deferred_blocks"] == 0
    assert info["used_bytes"] < 2 * used_one
    assert kv._seg.check() == []


def _hold_view(ns: str, cfg: kvcomm.Config, ready: mp.synchronize.Event) -> None:  # type: ignore[name-defined]
    kv = kvcomm.open(ns, config=cfg)
    view = kv.get("a")
    assert view is not None
    ready.set()
    signal.pause()


def test_space_reclaimed_when_holder_dies(ns: str, config: kvcomm.Config) -> None:
    ctx = mp.get_context("fork")
    with kvcomm.open(ns, config=config) as kv:
        kv.put("a", BIG)
        ready = ctx.Event()
        p = ctx.Process(target=_hold_view, args=(ns, config, ready))
        p.start()
        assert ready.wait(10)
        kv.put("a", BIG + 1)
        assert kv._seg.info()["pinned_deferred_blocks"] == 1
        os.kill(p.pid, signal.SIGKILL)
        p.join()

        def reclaimed() -> bool:
            kv.put("tick", 1)  # writers sweep dead holders' pins (at most once a second)
            return kv._seg.info()["pinned_deferred_blocks"] == 0

        wait_for(reclaimed, 5, "dead holder's pin to be swept")
        assert kv._seg.check() == []


def test_pin_table_full_falls_back_to_read_only_copy(ns: str) -> None:
    cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": "16MB", "max_views": 1}})
    with kvcomm.open(ns, config=cfg) as kv:
        kv.put("a", BIG)
        v1 = kv.get("a")
        v2 = kv.get("a")
        assert not v1.flags.owndata and v2.flags.owndata and not v2.flags.writeable
        assert np.array_equal(v1, v2)


def test_close_with_live_views_keeps_them_valid(ns: str, config: kvcomm.Config) -> None:
    kv = kvcomm.open(ns, config=config)
    kv.put("a", BIG)
    view = kv.get("a")
    kv.close()
    assert np.array_equal(view, BIG)


def _child_collects(out: mp.Queue) -> None:  # type: ignore[type-arg]
    gc.collect()
    out.put("collected")


def test_a_view_outliving_its_closed_client_is_unpinned_when_dropped_even_after_a_fork(
        ns: str, config: kvcomm.Config) -> None:
    """A view kept after the namespace's last client closed keeps the mapping and its pin.
    Dropped, it releases the pin (before, its callback found the segment closed and the
    block stayed parked until the process ended); a child forked meanwhile neither hangs
    on the parent's threads when it collects the kernel object the view's callback holds
    nor releases the parent's pin."""
    kv = kvcomm.open(ns, config=config)
    kv.put("a", BIG)
    view = kv.get("a")
    kv.close()
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    p = ctx.Process(target=_child_collects, args=(out,))
    p.start()
    try:
        assert out.get(timeout=20) == "collected"
        p.join(10)
        assert p.exitcode == 0
    finally:
        if p.is_alive():
            p.kill()
    with kvcomm.open(ns, config=config) as kv2:
        kv2.put("a", BIG + 1)
        assert kv2._seg.info()["pinned_deferred_blocks"] == 1  # (the parent's pin: kept)
        assert np.array_equal(view, BIG)
        del view
        gc.collect()
        kv2.put("other", 1)  # (the next write sweeps released pins)
        assert kv2._seg.info()["pinned_deferred_blocks"] == 0
        assert kv2._seg.check() == []


def _child_keeps_its_view(ns: str, cfg: kvcomm.Config, out: mp.Queue, go: mp.Event,  # type: ignore[type-arg]
                          done: mp.Event) -> None:  # type: ignore[type-arg]
    import kvcomm._client.attach as client_mod

    view = next(v for ref, _, _ in client_mod._VIEWS.values() if (v := ref()) is not None)
    out.put("ready")
    go.wait(30)
    out.put(bool(np.array_equal(view, BIG)))
    done.wait(30)


def test_a_child_keeps_a_view_it_inherited_from_a_closed_client(
        ns: str, config: kvcomm.Config) -> None:
    """The review's find on the view callback: a view whose client had closed got no pin
    of its own in a forked child (only open segments were repinned); once the parent
    dropped its copy (now really unpinned), the block was reused under the child's view."""
    kv = kvcomm.open(ns, config=config)
    kv.put("a", BIG)
    view = kv.get("a")
    kv.close()
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    go, done = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_child_keeps_its_view, args=(ns, config, out, go, done))
    p.start()
    try:
        assert out.get(timeout=20) == "ready"
        del view
        gc.collect()
        with kvcomm.open(ns, config=config) as kv2:
            for i in range(40):  # (the parent's pin gone: its block is free to reuse)
                kv2.put("a", np.full(1 << 17, float(i)))
                kv2.put(f"churn{i % 4}", np.full(1 << 14, float(i)))
            assert kv2._seg.info()["pinned_deferred_blocks"] >= 1  # (the child's pin)
            go.set()
            assert out.get(timeout=20) is True
    finally:
        done.set()
        p.join(10)
        if p.is_alive():
            p.kill()


def _get_running_between_pin_and_view(monkeypatch: pytest.MonkeyPatch, kv: kvcomm.Client,
                                      key: str, hook: Callable[[], Any]) -> Any:
    """``kv.get(key)`` of a large array, ``hook`` run once in another thread (joined)
    after the get's pin, before its view is registered."""
    from kvcomm._client import read

    orig, ran = read.codec.array_view, []

    def view_after_hook(meta: bytes, buf: memoryview) -> np.ndarray:
        if not ran:
            ran.append(True)
            t = threading.Thread(target=hook)
            t.start()
            t.join()
        return orig(meta, buf)

    monkeypatch.setattr(read.codec, "array_view", view_after_hook)
    try:
        return kv.get(key)
    finally:
        monkeypatch.setattr(read.codec, "array_view", orig)


def _assert_every_pin_released(kv: kvcomm.Client) -> None:
    """Once the views are dropped and collected, the next write sweeps their released
    pins: no block stays parked, and the segment checks clean."""
    gc.collect()
    kv.put("sweep", 1)
    assert kv._seg.info()["pinned_deferred_blocks"] == 0
    assert kv._seg.check() == []


def test_two_threads_between_a_pin_and_its_view_keep_their_own_pins(kv: kvcomm.Client,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The review's find, older than the callback: the pending pin (taken, not yet a
    view's) was one per client, so thread B's get released thread A's, and A's view read a
    block reused under it. Deterministic: B's get runs inside A's, between pin and view."""
    kv.put("a", np.full(1 << 15, 1.0))
    kv.put("b", np.full(1 << 15, 2.0))
    got: dict[str, Any] = {}
    va = _get_running_between_pin_and_view(
        monkeypatch, kv, "a", lambda: got.__setitem__("b", kv.get("b")))
    for i in range(30):
        kv.put("a", np.full(1 << 15, 100.0 + i))
        kv.put(f"x{i % 3}", np.full(1 << 15, -1.0 * i))
    assert (va == 1.0).all() and (got["b"] == 2.0).all()
    del va, got["b"]
    _assert_every_pin_released(kv)


def test_a_close_in_another_thread_between_a_pin_and_its_view(
        ns: str, config: kvcomm.Config, monkeypatch: pytest.MonkeyPatch) -> None:
    """The review's find on the callback's first version: it read the segment's kernel
    object after the pin, which a close in another thread had set to None (AttributeError,
    and the pin leaked). The get returns its view; dropped, its pin is released."""
    from kvcomm._client import attach

    kv = kvcomm.open(ns, config=config)
    kv.put("a", BIG)
    view = _get_running_between_pin_and_view(monkeypatch, kv, "a", kv.close)
    assert np.array_equal(view, BIG)
    del view
    with kvcomm.open(ns, config=config) as kv2:
        kv2.put("a", 1)
        _assert_every_pin_released(kv2)
        assert not attach._VIEWS


def test_a_view_overwritten_by_a_non_array_while_it_is_read(kv: kvcomm.Client) -> None:
    """Item 7: the record changes between the lock-free read (an array: pin it) and the
    pin; what is pinned is checked again."""
    seg = kv._seg
    real_pin = seg.pin
    swaps = [b"not an array", 7, {"a": 1}, None]

    def pin_after_overwrite(kb: bytes, h: int):  # type: ignore[no-untyped-def]
        value = swaps.pop(0) if swaps else BIG
        if value is None:
            kv.delete("race")
        else:
            kv.put("race", value)
        return real_pin(kb, h)

    seg.pin = pin_after_overwrite  # type: ignore[method-assign]
    try:
        for expect in (b"not an array", 7, {"a": 1}, None):
            kv.put("race", BIG)
            kv._l1.clear()
            assert kv.get("race") == expect
    finally:
        del seg.pin
    assert kv._seg.check() == []


def _child_drops_inherited_view(ns: str, cfg: kvcomm.Config, out: mp.Queue) -> None:  # type: ignore[type-arg]
    import kvcomm._client.attach as client_mod

    views = [ref() for ref, _, _ in client_mod._VIEWS.values()]
    out.put(len([v for v in views if v is not None]))
    del views
    for key in list(client_mod._VIEWS):
        client_mod._VIEWS.pop(key)
    gc.collect()  # the child's copies go
    out.put("dropped")


def test_a_forked_child_dropping_a_view_does_not_unpin_the_parents(ns: str, config: kvcomm.Config) -> None:
    """Item 17: the child gets pins of its own; dropping its copy leaves the parent's."""
    ctx = mp.get_context("fork")
    with kvcomm.open(ns, config=config) as kv:
        kv.put("a", BIG)
        view = kv.get("a")
        out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
        p = ctx.Process(target=_child_drops_inherited_view, args=(ns, config, out))
        p.start()
        assert out.get(timeout=20) >= 1
        assert out.get(timeout=20) == "dropped"
        p.join(10)
        kv.put("a", BIG * 5)  # replaces the block: the parent's pin must still park it
        for i in range(40):
            kv.put(f"churn{i}", np.full(1 << 14, i, dtype=np.float64))
        assert np.array_equal(view, BIG)
        assert kv._seg.check() == []


def _child_keeps_inherited_view(ns: str, cfg: kvcomm.Config, go: mp.Event, out: mp.Queue) -> None:  # type: ignore[type-arg]
    import kvcomm._client.attach as client_mod

    views = [ref() for ref, _, _ in client_mod._VIEWS.values()]
    view = next(v for v in views if v is not None)
    out.put("ready")
    go.wait(30)
    out.put(bool(np.array_equal(view, BIG)))


def test_a_forked_child_keeps_a_valid_view_after_the_parent_drops_it(ns: str, config: kvcomm.Config) -> None:
    ctx = mp.get_context("fork")
    with kvcomm.open(ns, config=config) as kv:
        kv.put("a", BIG)
        view = kv.get("a")
        go = ctx.Event()
        out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
        p = ctx.Process(target=_child_keeps_inherited_view, args=(ns, config, go, out))
        p.start()
        assert out.get(timeout=20) == "ready"
        del view
        gc.collect()
        kv.put("a", BIG * 7)  # the parent's pin is gone; the child's must keep the block
        for i in range(40):
            kv.put(f"churn{i}", np.full(1 << 14, i, dtype=np.float64))
        go.set()
        assert out.get(timeout=20) is True
        p.join(10)


def _child_holds_inherited_view(out: mp.Queue) -> None:  # type: ignore[type-arg]
    import kvcomm._client.attach as client_mod

    views = [ref() for ref, _, _ in client_mod._VIEWS.values()]
    assert any(v is not None for v in views)  # (repinned as the child's own at the fork)
    out.put("holding")
    signal.pause()


def test_a_forked_child_killed_while_holding_an_inherited_view(ns: str,
                                                                config: kvcomm.Config) -> None:
    """The child's repinned copy of the parent's view dies with it (SIGKILL: nothing of
    its own runs): the parent's pin still parks the block, its view still reads the old
    value, and once the parent drops it the block is freed, no pin of the dead child
    left behind."""
    ctx = mp.get_context("fork")
    with kvcomm.open(ns, config=config) as kv:
        kv.put("a", BIG)
        view = kv.get("a")
        out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
        p = ctx.Process(target=_child_holds_inherited_view, args=(out,))
        p.start()
        assert out.get(timeout=20) == "holding"
        kv.put("a", BIG + 1)  # (the old block: pinned by the parent and by the child)
        assert kv._seg.info()["pinned_deferred_blocks"] == 1
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        assert p.exitcode == -signal.SIGKILL
        for i in range(40):  # (the dead child's pin swept meanwhile; the parent's stays)
            kv.put(f"churn{i}", np.full(1 << 14, i, dtype=np.float64))
        assert kv._seg.info()["pinned_deferred_blocks"] == 1
        assert np.array_equal(view, BIG)
        del view
        gc.collect()

        def freed() -> bool:
            kv.put("tick", 1)  # (writers sweep released pins, dead holders' at most once a second)
            return kv._seg.info()["pinned_deferred_blocks"] == 0

        wait_for(freed, 5, "the block to be freed once the parent dropped its view")
        assert kv._seg.check() == []


def test_a_stale_release_never_withdraws_a_later_pin(kv: kvcomm.Client) -> None:
    """A finalizer that runs twice (or a release after an exception and again from the
    view) aims at an entry the same process may have reused for a later view of the same
    block: each pin carries a generation, and only its own release withdraws it."""
    import kvcomm._client.attach as client_mod

    kv.put("a", BIG)
    v1 = kv.get("a")
    (_, _, pin1), = [e for e in client_mod._VIEWS.values() if e[0]() is v1]
    del v1
    gc.collect()
    v2 = kv.get("a")
    (_, _, pin2), = [e for e in client_mod._VIEWS.values() if e[0]() is v2]
    assert pin2[0] == pin1[0] and pin2[1] != pin1[1]  # the same entry, a new generation
    kv._seg.unpin(*pin1)  # the stale release
    kv.put("a", BIG * 3)
    for i in range(50):
        kv.put(f"churn{i}", np.full(1 << 14, i, dtype=np.float64))
    assert np.array_equal(v2, BIG)
    assert kv._seg.check() == []


def test_an_exception_between_pin_and_view_leaks_no_pin(kv: kvcomm.Client) -> None:
    """KeyboardInterrupt (or any error) after the kernel pinned the block and before a view
    owns the pin: the pin is released, the block is freed once replaced."""
    import kvcomm.core.codec as codec_mod

    kv.put("a", BIG)
    real = codec_mod.array_view

    def interrupted(meta: bytes, buf: object) -> object:
        raise KeyboardInterrupt

    codec_mod.array_view = interrupted  # type: ignore[assignment]
    try:
        with pytest.raises(KeyboardInterrupt):
            kv.get("a")
    finally:
        codec_mod.array_view = real  # type: ignore[assignment]
    kv.put("a", BIG * 2)  # the old block: not named by any pin, so freed at once
    assert kv._seg.info()["pinned_deferred_blocks"] == 0
    assert kv._seg.check() == []


def _cfg(**cache: object) -> kvcomm.Config:
    return kvcomm.Config.from_mapping({"cache": {"l2_size": "16MB", "watch_buffer": 256, **cache}})


# ---------------------------------------------------------------------------------------
# F4. Empty multi-dimensional numpy arrays leak TypeError.
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(0, 3), (3, 0), (2, 0, 2)])
def test_empty_multidimensional_array(name: str, shape: tuple[int, ...]) -> None:
    """np.zeros((0, 3)) (e.g. 'no detections this frame') is a numeric array: it must be
    stored, or refused with a KVCommError. codec.encode (core/codec.py:109,
    memoryview(arr).cast('B')) raises TypeError 'cannot cast view with zeros in shape'.
    (found in review 7: embedded and cluster mode on real processes)"""
    with kvcomm.open(name, config=_cfg()) as kv:
        try:
            kv.put("empty", np.zeros(shape))
        except kvcomm.KVCommError:
            return
        assert kv.get("empty").shape == shape
