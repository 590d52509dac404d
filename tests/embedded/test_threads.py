"""One client shared by threads: L1 stays consistent, update() loses nothing."""

from __future__ import annotations

import threading
from collections.abc import Callable

import kvcomm


def run_threads(work: Callable[[int], None], n: int = 4) -> list[BaseException]:
    """Run ``work(tid)`` in ``n`` threads; the exceptions they raised."""
    errors: list[BaseException] = []

    def guarded(tid: int) -> None:
        try:
            work(tid)
        except BaseException as exc:  # pragma: no cover - reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_threads_update_and_read(kv: kvcomm.Client) -> None:
    def work(tid: int) -> None:
        for i in range(500):
            kv.update("n", lambda x: x + 1, default=0)
            kv.put(f"t{tid}", i)
            assert kv.get(f"t{tid}") == i

    assert not run_threads(work)
    assert kv.get("n") == 2000
    assert kv._seg.check() == []


def test_threads_share_an_l1_under_churn(ns: str) -> None:
    cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": "16MB", "l1_size": "8KB"}})
    with kvcomm.open(ns, config=cfg) as kv:

        def work(tid: int) -> None:
            for i in range(2000):
                k = f"k{(i * 7 + tid) % 50}"
                kv.put(k, k.encode() * 20)
                v = kv.get(k)
                assert v == k.encode() * 20

        assert not run_threads(work)
        assert kv.stats()["l1"]["bytes"] <= 8 * 1024
