"""Ctrl-C reaches the caller in a program that drops kvcomm's objects in a loop: clients
(``with kvcomm.open(...) as kv:`` per request), segments, zero-copy array views.

Python drops an exception raised inside a weakref callback or a ``__del__`` ("Exception
ignored in ..."): a KeyboardInterrupt whose handler runs there is lost and the program
runs on. So nothing of kvcomm runs Python code when a closed client or a dropped segment
goes: the process's registries (clients, segments, meters) let members go through a C
builtin (kvcomm._weak.WeakRegistry), and only an open client has a ``__del__``. Real
processes loop; SIGINT lands at a random point (the seed is printed) and each must end
with KeyboardInterrupt.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import random
import signal
import time
from multiprocessing.connection import Connection

import numpy as np
import pytest

import kvcomm
from kvcomm.tiers import l2
from kvcomm.tiers.shm.geometry import Layout
from tests.support.children import reap
from tests.support.helpers import wait_for

# slow: `make test-slow`, or run alone. The loopers start from a fresh interpreter (a fork
# server that imported kvcomm and this module, nothing of the suite): forked from the
# suite's long-lived pytest process, they failed 2 of 3 variants in full runs and never
# alone, as objects of earlier tests (other libraries' too) finalised inside the loop
# dropped the signal as kvcomm's did, which is not what this checks.
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["numpy", "kvcomm", __name__])
STOPPED = 42  # the looper's exit code when its KeyboardInterrupt reached it
ROUNDS = 24


def _config() -> kvcomm.Config:
    return kvcomm.Config.from_mapping({"cache": {"l2_size": "16MB", "watch_buffer": 256}})


def _clients(ns: str, cfg: kvcomm.Config, i: int) -> None:
    with kvcomm.open(ns, config=cfg) as kv:
        kv.put("k", i)
        kv.get("k")


def _segments(ns: str, cfg: kvcomm.Config, i: int) -> None:
    c = cfg.cache
    layout = Layout.plan(c.l2_size, c.max_key_bytes, c.watch_buffer, c.max_views,
                         c.max_value_size)
    seg = l2.open_segment(ns, layout, "h", 0o600)
    assert seg.host_id  # (then dropped, never closed: the registry lets it go)


def _views(ns: str, cfg: kvcomm.Config, i: int) -> None:
    with kvcomm.open(ns, config=cfg) as kv:
        for _ in range(100):
            arr = kv.get("arr")  # a read-only view of shared memory (16 KiB)
            assert arr[1] == 1.0
            del arr  # (its pin is released by a weakref callback)


def _looper(ns: str, w: Connection, what: str) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cfg = _config()
    step = {"clients": _clients, "namespaces": _clients, "segments": _segments,
            "views": _views}[what]
    # another client keeps L2 mapped, except for "namespaces": each close then detaches the
    # namespace and stops its expiry thread
    held = kvcomm.open(ns, config=cfg) if what != "namespaces" else None
    gc.collect()  # (what the test process left behind is freed now, not in the loop: the
    gc.freeze()  # finalizers of other libraries' objects are not under test)
    try:
        w.send_bytes(b"r")
        i = 0
        while True:
            step(ns, cfg, i)
            i += 1
    except KeyboardInterrupt:
        os._exit(STOPPED)
    finally:
        if held is not None:
            held.close()


@pytest.mark.parametrize("what", ["clients", "namespaces", "segments", "views"])
def test_ctrl_c_reaches_a_loop_that_opens_and_drops(what: str, ns: str, seed: int) -> None:
    rng = random.Random(seed)
    with kvcomm.open(ns, config=_config()) as kv:
        kv.put("k", 0)  # (the namespace exists: the loop only attaches)
        kv.put("arr", np.arange(2048, dtype=np.float64))
    stopped = 0
    for _ in range({"views": 60, "namespaces": 60}.get(what, ROUNDS)):
        r, w = CTX.Pipe(duplex=False)
        p = CTX.Process(target=_looper, args=(ns, w, what))
        try:
            p.start()
            assert r.poll(60) and r.recv_bytes() == b"r"
            time.sleep(rng.uniform(0.005, 0.03))
            os.kill(p.pid, signal.SIGINT)
            wait_for(lambda p=p: p.exitcode is not None, timeout=5,  # type: ignore[misc]
                     what=f"the {what} loop to stop on its KeyboardInterrupt (swallowed?)")
            assert p.exitcode == STOPPED, f"the loop ended with {p.exitcode}"
            stopped += 1
        finally:
            reap(p)
            r.close()
            w.close()
    print(f"{stopped} SIGINTs into a loop of {what} opened and dropped: all reached "
          "the caller")
