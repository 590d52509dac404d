"""``kv.get()`` never swallows Ctrl-C: a KeyboardInterrupt delivered while the C getter's
decoder runs (an L1 miss) reaches the caller, as anywhere else.

Real processes loop ``kv.get`` over a value that takes milliseconds to decode, with L1
off (every read decodes); SIGINT lands at a random point (the seed is printed), and each
must end with KeyboardInterrupt.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
import traceback

import pytest

import kvcomm
from tests.support.children import reap
from tests.support.helpers import wait_for

pytestmark = pytest.mark.multiprocess
CTX = mp.get_context("fork")
IN_DECODE, ELSEWHERE = 42, 43  # the reader's exit codes: where its KeyboardInterrupt came from


def _config() -> kvcomm.Config:
    return kvcomm.Config.from_mapping(
        {"cache": {"l2_size": "16MB", "watch_buffer": 256, "l1_size": 0}})


def _reader(ns: str, w: int) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    kv = kvcomm.open(ns, config=_config())
    try:
        os.write(w, b"r")
        while True:
            kv.get("big")
    except KeyboardInterrupt as exc:
        names = {f.name for f in traceback.extract_tb(exc.__traceback__)}
        os._exit(IN_DECODE if "decode" in names else ELSEWHERE)


def test_ctrl_c_inside_get_always_reaches_the_caller(ns: str, seed: int) -> None:
    rng = random.Random(seed)
    with kvcomm.open(ns, config=_config()) as kv:
        kv.put("big", list(range(20000)))
        t0 = time.perf_counter()
        for _ in range(5):
            kv.get("big")
        per_get = (time.perf_counter() - t0) / 5
    rounds, where = 20, {IN_DECODE: 0, ELSEWHERE: 0}
    for _ in range(rounds):
        r, w = os.pipe()
        p = CTX.Process(target=_reader, args=(ns, w))
        try:
            p.start()
            assert os.read(r, 1) == b"r"
            time.sleep(rng.uniform(0.0, 3 * per_get))
            os.kill(p.pid, signal.SIGINT)
            wait_for(lambda p=p: p.exitcode is not None, timeout=10,  # type: ignore[misc]
                     what="the reader to stop on its KeyboardInterrupt (swallowed?)")
            assert p.exitcode in where, f"the reader ended with {p.exitcode}"
            where[p.exitcode] += 1
        finally:
            reap(p, r, w)
    print(f"{rounds} SIGINTs (a get takes {per_get * 1000:.1f} ms): {where[IN_DECODE]} "
          f"raised inside the decoder, {where[ELSEWHERE]} elsewhere; none swallowed")
    assert where[IN_DECODE] >= rounds // 4, "too few signals landed inside the decoder"
