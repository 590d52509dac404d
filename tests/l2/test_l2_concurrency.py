"""Several processes on one L2 segment: no lost updates, no torn reads, survive SIGKILL."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import struct
import time

import pytest
import xxhash

import kvcomm
from tests.support.helpers import drawn_seed, wait_for

pytestmark = pytest.mark.multiprocess
CTX = mp.get_context("fork")


def checked_value(rng: random.Random, size: int) -> bytes:
    """A value that carries its own checksum: a torn read cannot pass check()."""
    body = rng.randbytes(size)
    return struct.pack("<Q", xxhash.xxh3_64_intdigest(body)) + body


def check(value: bytes) -> bool:
    return struct.unpack_from("<Q", value)[0] == xxhash.xxh3_64_intdigest(value[8:])


def _incrementer(ns: str, cfg: kvcomm.Config, n: int) -> None:
    with kvcomm.open(ns, config=cfg) as kv:
        for _ in range(n):
            kv.update("counter", lambda x: x + 1, default=0)


def test_update_from_four_processes_loses_nothing(ns: str, config: kvcomm.Config) -> None:
    procs = [CTX.Process(target=_incrementer, args=(ns, config, 1500)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    with kvcomm.open(ns, config=config) as kv:
        assert kv.get("counter") == 6000


def _overwriter(ns: str, cfg: kvcomm.Config, seed: int, stop_at: float) -> None:
    rng = random.Random(seed)
    with kvcomm.open(ns, config=cfg) as kv:
        while time.monotonic() < stop_at:
            k = f"k{rng.randrange(8)}"
            kv.put(k, checked_value(rng, rng.choice([16, 1000, 10_000, 60_000])))


def _reader(ns: str, cfg: kvcomm.Config, stop_at: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    seen = bad = 0
    with kvcomm.open(ns, config=cfg) as kv:
        while time.monotonic() < stop_at:
            for i in range(8):
                v = kv.get(f"k{i}")
                if v is not None:
                    seen += 1
                    bad += not check(v)
    out.put((seen, bad))


def test_readers_never_see_torn_values(ns: str, config: kvcomm.Config) -> None:
    seed = drawn_seed(2**32)
    stop_at = time.monotonic() + 3.0
    out: mp.Queue = CTX.Queue()  # type: ignore[type-arg]
    procs = [CTX.Process(target=_overwriter, args=(ns, config, seed + i, stop_at)) for i in range(2)]
    procs += [CTX.Process(target=_reader, args=(ns, config, stop_at, out)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=30) for _ in range(2)]
    for p in procs:
        p.join()
        assert p.exitcode == 0
    assert sum(s for s, _ in results) > 1000
    assert sum(b for _, b in results) == 0


def _ack_writer(ns: str, cfg: kvcomm.Config, n: int, acked: mp.Value) -> None:  # type: ignore[type-arg]
    with kvcomm.open(ns, config=cfg) as kv:
        for i in range(1, n + 1):
            kv.put("seq", i)
            acked.value = i


def test_a_read_after_an_acknowledged_put_sees_it(ns: str, config: kvcomm.Config) -> None:
    acked = CTX.Value("q", 0, lock=False)
    with kvcomm.open(ns, config=config) as kv:
        p = CTX.Process(target=_ack_writer, args=(ns, config, 20000, acked))
        p.start()
        checks = 0
        while p.is_alive() or checks == 0:
            floor = acked.value
            got = kv.get("seq", 0)
            assert got >= floor, f"read {got} after put {floor} was acknowledged"
            checks += 1
        p.join()
        assert kv.get("seq") == 20000


def _chaos_writer(ns: str, cfg: kvcomm.Config, seed: int) -> None:
    rng = random.Random(seed)
    with kvcomm.open(ns, config=cfg) as kv:
        while True:
            k = f"k{rng.randrange(64)}"
            r = rng.random()
            if r < 0.6:  # large values: the copy under the lock is long, kills land in it
                kv.put(k, checked_value(rng, rng.choice([100, 20_000, 200_000, 600_000])))
            elif r < 0.8:
                kv.delete(k)
            else:
                with kv.batch() as b:
                    for j in range(rng.randrange(1, 6)):
                        b.put(f"k{rng.randrange(64)}", checked_value(rng, 100 + j * 50_000))


def test_sigkill_mid_write_never_wedges_or_corrupts(ns: str, config: kvcomm.Config) -> None:
    """Writers are SIGKILLed at random instants until some died holding the lock, some of
    them mid-mutation (both counted by the segment); after every round a survivor writes
    at once, and at the end every invariant and every value's checksum holds."""
    seed = drawn_seed(2**32)
    rng = random.Random(seed)
    with kvcomm.open(ns, config=config) as kv:
        kv.put("k0", checked_value(rng, 10))
        rounds = 0
        while rounds < 25 or (rounds < 400 and (kv._seg.info()["owner_deaths"] < 3
                                                 or kv._seg.info()["recoveries"] < 1)):
            procs = [CTX.Process(target=_chaos_writer, args=(ns, config, seed + rounds * 10 + i))
                     for i in range(2)]
            writes = kv._seg.info()["write_seq"]
            for p in procs:
                p.start()
            wait_for(lambda w=writes: kv._seg.info()["write_seq"] > w + 20, 10, "writers to start")
            time.sleep(rng.uniform(0.0, 0.02))  # let them run into the middle of writes
            for p in procs:
                os.kill(p.pid, signal.SIGKILL)
            for p in procs:
                p.join()
            # a survivor must be able to write promptly (a dead lock owner is detected)
            t0 = time.monotonic()
            kv.put("probe", rounds)
            assert time.monotonic() - t0 < 1.0
            assert kv.get("probe") == rounds
            rounds += 1
        assert kv._seg.check() == []
        for k in kv.keys():
            v = kv.get(k)
            if k.startswith("k"):
                assert check(v), f"{k} corrupt after crashes"
        info = kv._seg.info()
        print(f"rounds {rounds}, owner deaths {info['owner_deaths']}, recoveries {info['recoveries']}")
        # the faults happened: writers died holding the lock, some of them mid-mutation
        assert info["owner_deaths"] >= 3
        assert info["recoveries"] >= 1
