"""Worker processes for tests/sim/test_model.py: each holds its own kvcomm client, driven over a pipe.

A worker answers one request at a time. A request is ``(op, args, notify)``; with
``notify`` the worker first sends ``("started",)``, so that the driver can SIGKILL it
while the operation runs. The answer is one of::

    ("ok", result, evictions_before, evictions_after)
    ("err", exception class name, message, evictions_before, evictions_after)  # a KVCommError
    ("bug", exception class name, traceback)  # anything else: a failure of the library

Values travel as small descriptors, never as the values: ``("b", uid, n)`` is ``n`` bytes
after an 8-byte uid, ``("a", uid, n)`` an int64 array of ``n`` copies of uid, and so on.
:func:`make` builds the value, :func:`describe` checks every byte of a value read back and
returns its descriptor (``("?", ...)`` for anything that is not exactly a value we wrote).
"""

from __future__ import annotations

import collections
import faulthandler
import multiprocessing as mp
import signal
import threading
import traceback
from typing import Any

import kvcomm
from kvcomm._wait import wait_until
from kvcomm.tiers import l2

Desc = tuple[Any, ...]


def make(desc: Desc) -> Any:
    kind, uid, n = desc
    if kind == "b":
        return uid.to_bytes(8, "little") + bytes([uid % 251]) * n
    if kind == "s":
        return f"s:{uid}:" + "é" * n
    if kind == "i":
        return uid
    if kind == "d":
        return {"id": uid, "pad": "z" * n}
    if kind == "a":
        import numpy as np

        return np.full(n, uid, dtype="<i8")
    raise ValueError(desc)


def describe(value: Any) -> Desc | None:
    """The descriptor of a value read back (checked in full), None for absent."""
    if value is None:
        return None
    t = type(value)
    if t is bytes and len(value) >= 8:
        uid = int.from_bytes(value[:8], "little")
        if value == make(("b", uid, len(value) - 8)):
            return ("b", uid, len(value) - 8)
    elif t is str and value.startswith("s:"):
        _, uid_s, pad = value.split(":", 2)
        if value == make(("s", int(uid_s), len(pad))):
            return ("s", int(uid_s), len(pad))
    elif t is int:
        return ("i", value, 0)
    elif t is dict and set(value) == {"id", "pad"}:
        if value == make(("d", value["id"], len(value["pad"]))):
            return ("d", value["id"], len(value["pad"]))
    elif t.__name__ == "ndarray" and value.ndim == 1 and value.dtype.str == "<i8":
        if len(value) and (value == value[0]).all():
            return ("a", int(value[0]), len(value))
    return ("?", repr(value)[:120])


def _increment(v: Any) -> int:
    return v + 1 if type(v) is int else 1


class _Worker:
    def __init__(self, cfg_map: dict[str, Any], watch: bool) -> None:
        self.ns = ""
        self.cfg = kvcomm.Config.from_mapping(cfg_map)
        self.kv: kvcomm.Client | None = None
        self.views: collections.deque[Any] = collections.deque(maxlen=2)  # held: live pins
        self.watch = watch
        self.events: list[tuple[str, str]] = []
        self.events_lock = threading.Lock()
        self.sync = 0

    # the client ------------------------------------------------------------

    def open(self) -> None:
        self.kv = kvcomm.open(self.ns, config=self.cfg)
        if self.watch:
            threading.Thread(target=self._watcher, args=(self.kv,), daemon=True).start()

    def _watcher(self, kv: kvcomm.Client) -> None:
        """Collect (key, kind) of every change-feed event until the client closes."""
        try:
            for ev in kv.watch():
                with self.events_lock:
                    self.events.append((ev.key, ev.kind))
        except kvcomm.KVCommError:
            pass

    def close(self) -> None:
        self.views.clear()
        if self.kv is not None:
            try:
                self.kv.close()
            except kvcomm.KVCommError:
                pass
            self.kv = None

    def reopen(self) -> None:
        self.close()
        self.open()

    def evictions(self) -> int:
        try:
            return int(self.kv.stats()["l2"]["evictions"]) if self.kv is not None else -1
        except kvcomm.KVCommError:
            return -1

    # operations --------------------------------------------------------------

    def op_attach(self, ns: str) -> None:
        """Use namespace ``ns`` from now on (a new state machine run)."""
        self.close()
        self.ns = ns
        self.open()

    def op_detach(self) -> None:
        self.close()

    def op_reopen(self) -> None:
        self.reopen()

    def op_put(self, key: str, desc: Desc, expect: Any) -> Any:
        assert self.kv is not None
        if expect is None:
            return self.kv.put(key, make(desc))
        return self.kv.put(key, make(desc), expect=kvcomm.ABSENT if expect == "ABSENT" else expect)

    def op_get(self, key: str, hold: bool = False) -> Desc | None:
        assert self.kv is not None
        v = self.kv.get(key)
        if hold and v is not None and type(v).__name__ == "ndarray":
            self.views.append(v)  # keep the zero-copy view (its pin) alive for a while
        return describe(v)

    def op_get_item(self, key: str) -> tuple[Desc | None, Any] | None:
        assert self.kv is not None
        item = self.kv.get_item(key)
        return None if item is None else (describe(item.value), item.version)

    def op_delete(self, key: str, expect: Any) -> bool:
        assert self.kv is not None
        if expect is None:
            return self.kv.delete(key)
        return self.kv.delete(key, expect=kvcomm.ABSENT if expect == "ABSENT" else expect)

    def op_update(self, key: str) -> Any:
        assert self.kv is not None
        return self.kv.update(key, _increment)

    def op_batch(self, ops: list[tuple[Any, ...]], bad_key_at: int | None) -> list[Any]:
        assert self.kv is not None
        with self.kv.batch() as b:
            for i, op in enumerate([*ops, None]):
                if i == bad_key_at:
                    b.put(12345, b"a key that is not a str")  # type: ignore[arg-type]
                if op is None:
                    break
                if op[0] == "put":
                    b.put(op[1], make(op[2]))
                else:
                    b.delete(op[1])
        return list(b.versions)

    def op_read_all(self, keys: list[str]) -> dict[str, Desc | None]:
        assert self.kv is not None
        return {k: describe(self.kv.get(k)) for k in keys}

    def op_keys(self) -> list[str]:
        assert self.kv is not None
        return sorted(self.kv.keys())

    def op_stats(self) -> dict[str, Any]:
        assert self.kv is not None
        return dict(self.kv.stats()["l2"])

    def op_check(self) -> list[str]:
        seg = l2.L2Segment(self.ns, create_layout=None, host_id="")
        try:
            return seg.check()
        finally:
            seg.close()

    def op_purge(self) -> bool:
        return l2.purge(self.ns)

    def op_drain_events(self) -> list[tuple[str, str]]:
        """Every event up to now: write a marker, wait until the watcher has seen it."""
        assert self.kv is not None and self.watch
        self.sync += 1
        marker = f"__sync/{self.sync}"
        self.kv.put(marker, self.sync)

        def drained() -> tuple[list[tuple[str, str]]] | None:  # (events,): true even when empty
            with self.events_lock:
                if (marker, "put") not in self.events:
                    return None
                out = [e for e in self.events if not e[0].startswith("__sync/")]
                self.events.clear()
                return (out,)

        (got,) = wait_until(drained, 10, "the watcher to see the sync marker", interval=0.001,
                            error=AssertionError)
        return got


def worker_main(conn: Any, cfg_map: dict[str, Any], watch: bool, dump_path: str) -> None:
    """Serve requests until "exit" (the first is "attach"). SIGUSR1 writes every thread's
    stack to ``dump_path`` (the driver asks for it when an answer is late)."""
    dump = open(dump_path, "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    faulthandler.enable(file=dump, all_threads=True)
    w = _Worker(cfg_map, watch)
    while True:
        try:
            op, args, notify = conn.recv()
        except EOFError:
            return
        if op == "exit":
            w.close()
            conn.send(("ok", None, -1, -1))
            return
        if notify:
            conn.send(("started",))
        ev0 = w.evictions()
        try:
            out = getattr(w, f"op_{op}")(*args)
        except kvcomm.KVCommError as exc:
            conn.send(("err", type(exc).__name__, str(exc), ev0, w.evictions()))
        except BaseException as exc:
            conn.send(("bug", type(exc).__name__, traceback.format_exc()))
        else:
            conn.send(("ok", out, ev0, w.evictions()))


def context() -> Any:
    """A forkserver context with kvcomm and numpy imported once (a worker costs a fork)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["kvcomm", "kvcomm.tiers.l2", "numpy", __name__])
    return ctx
