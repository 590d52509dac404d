"""Batches are all or nothing; validators run under the lock of the write they vet."""

from __future__ import annotations

import multiprocessing as mp
import random

import pytest

import kvcomm

CTX = mp.get_context("fork")


def test_a_failed_batch_changes_nothing(kv: kvcomm.Client) -> None:
    """Item 2: put a, delete b, then a put larger than the whole L2."""
    kv.put("a", "old")
    kv.put("b", "keep")
    before = kv._seg.info()
    huge = b"x" * (kv._seg.layout.data_size + 1)
    with pytest.raises(kvcomm.ValueTooLarge):
        with kv.batch() as b:
            b.put("a", "new")
            b.delete("b")
            b.put("c", huge)
    assert kv.get("a") == "old" and kv.get("b") == "keep" and kv.get("c") is None
    after = kv._seg.info()
    assert after["write_seq"] == before["write_seq"] and after["feed_events"] == before["feed_events"]
    assert kv._seg.check() == []


def test_a_batch_too_large_in_total_changes_nothing(ns: str) -> None:
    """Each value fits, the batch does not: refused before anything is evicted or written."""
    cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": "4MB"}})
    with kvcomm.open(ns, config=cfg) as kv:
        for i in range(20):
            kv.put(f"keep/{i}", b"k" * 1000)
        chunk = b"z" * (kv._seg.layout.data_size // 4)
        evictions = kv._seg.info()["evictions"]
        with pytest.raises((kvcomm.ValueTooLarge, kvcomm.Unavailable)):
            with kv.batch() as b:
                for i in range(6):
                    b.put(f"big/{i}", chunk)
        assert all(kv.get(f"big/{i}") is None for i in range(6))
        assert all(kv.get(f"keep/{i}") == b"k" * 1000 for i in range(20))
        assert kv._seg.info()["evictions"] == evictions
        assert kv._seg.check() == []


def test_a_batch_that_fits_after_evictions_is_applied_whole(ns: str) -> None:
    cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": "4MB"}})
    with kvcomm.open(ns, config=cfg) as kv:
        for i in range(200):
            kv.put(f"old/{i}", b"o" * 10_000)
        with kv.batch() as b:
            for i in range(100):
                b.put(f"new/{i}", b"n" * 10_000)
        assert all(kv.get(f"new/{i}") == b"n" * 10_000 for i in range(100))
        assert kv._seg.info()["evictions"] > 0
        assert kv._seg.check() == []


def test_same_key_several_times_in_one_batch(kv: kvcomm.Client) -> None:
    kv.put("k", 0)
    with kv.batch() as b:
        b.put("k", 1)
        b.delete("k")
        b.put("k", 2)
        b.put("n", 1)
        b.delete("n")
        b.delete("never")
    assert kv.get("k") == 2 and kv.get("n") is None
    assert b.versions[1] is True and b.versions[4] is True and b.versions[5] is False
    assert kv._seg.check() == []


def test_batch_validators_run_at_apply_time_under_the_lock(kv: kvcomm.Client) -> None:
    """Item 19: a validator sees the value its write replaces when the batch is applied,
    not when ``b.put`` was called; deletes are vetted too."""
    seen: list[tuple[str, object, object]] = []

    def vet(key: str, old: kvcomm.Item | None, new: object) -> None:
        seen.append((key, None if old is None else old.value, new))
        assert kv._seg.holds_lock()
        if new == "forbidden":
            raise ValueError("no")

    kv.register_validator("v/", vet)
    kv.put("v/1", "a")
    seen.clear()
    with kv.batch() as b:
        b.put("v/1", "b")
        kv.put("v/1", "changed meanwhile")  # after b.put, before the batch applies
        b.put("v/1", "c")
        b.delete("v/1")
    assert seen == [("v/1", "a", "changed meanwhile"),  # the plain put, vetted at once
                    ("v/1", "changed meanwhile", "b"), ("v/1", "b", "c"), ("v/1", "c", None)]
    assert kv.get("v/1") is None
    kv.put("v/2", "x")
    with pytest.raises(kvcomm.ValidationError):
        with kv.batch() as b:
            b.put("v/3", "ok")
            b.put("v/2", "forbidden")
    assert kv.get("v/3") is None and kv.get("v/2") == "x"


def test_delete_validator_sees_the_value_it_deletes(kv: kvcomm.Client) -> None:
    olds: list[object] = []
    kv.register_validator("d/", lambda k, old, new: olds.append(old.value if old else None))
    kv.put("d/1", 1)
    assert kv.delete("d/1") is True
    assert kv.delete("d/1") is False
    assert olds == [None, 1, None]  # the put (nothing replaced), the delete, the no-op delete


def _batcher(ns: str, cfg: kvcomm.Config, seed: int, rounds: int) -> None:
    rng = random.Random(seed)
    with kvcomm.open(ns, config=cfg) as kv:
        for r in range(rounds):
            tag = f"{seed}-{r}"
            with kv.batch() as b:
                for i in range(10):
                    b.put(f"g/{i}", tag)
            if rng.random() < 0.3:
                with pytest.raises(kvcomm.ValueTooLarge):
                    with kv.batch() as b:
                        for i in range(10):
                            b.put(f"g/{i}", "never")
                        b.put("g/huge", b"x" * (kv._seg.layout.data_size + 1))


@pytest.mark.multiprocess
def test_readers_never_see_a_failed_batch(ns: str, config: kvcomm.Config) -> None:
    seed = random.randrange(2**32)
    print(f"seed={seed}")
    procs = [CTX.Process(target=_batcher, args=(ns, config, seed + i, 150)) for i in range(2)]
    for p in procs:
        p.start()
    with kvcomm.open(ns, config=config) as kv:
        while any(p.is_alive() for p in procs):
            for i in range(10):
                assert kv.get(f"g/{i}") != "never"
    for p in procs:
        p.join()
        assert p.exitcode == 0
    with kvcomm.open(ns, config=config) as kv:
        values = {kv.get(f"g/{i}") for i in range(10)}
        assert "never" not in values
        assert kv._seg.check() == []
