"""Batches are all or nothing; validators run under the lock of the write they vet."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import random
import re
import subprocess
import sys

import numpy as np
import pytest

import kvcomm
from kvcomm.core.codec import Packed
from kvcomm.tiers.l2 import SLOT, SLOT_WORDS, key_hash
from tests.support.daemon_harness import Host, shared_cluster_fixture, store_fixture  # noqa: F401 (fixtures)
from tests.support.helpers import drawn_seed, wait_for

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


def test_a_batch_compare_and_set_applies_all_or_nothing(kv: kvcomm.Client) -> None:
    """Batch._expect (the LangGraph saver's head move): the batch applies only if the key
    is at the expected Version (or absent, for ABSENT) under the writer lock; otherwise
    ConflictError and nothing of the batch is written. A validator still runs."""
    with kv.batch() as b:
        b.put("rec/1", [1])
        b.put("head", {"id": 1})
        b._expect("head", kvcomm.ABSENT)
    v1 = b._version_at(1)
    assert v1 == kv.get_item("head").version and kv.get("rec/1") == [1]
    kv.put("head", {"id": "other"})  # (another writer moves it)
    with pytest.raises(kvcomm.ConflictError):
        with kv.batch() as b:
            b.put("rec/2", [2])
            b.put("head", {"id": 2})
            b._expect("head", v1)
    assert kv.get("rec/2") is None and kv.get("head") == {"id": "other"}
    seen: list[object] = []
    kv.register_validator("rec/", lambda key, old, new: seen.append(new))
    with kv.batch() as b:
        b.put("rec/3", Packed(["3"]))
        b.put("head", {"id": 3})
        b._expect("head", kv.get_item("head").version)
    assert kv.get("rec/3") == ["3"] and kv.get("head") == {"id": 3}
    assert seen == [["3"]]  # (a Packed value's validator sees the value)
    kv.put("rec/4", Packed(["4", None]))  # (and kv.put's: the list it stores)
    assert seen == [["3"], ["4", None]] and kv.get("rec/4") == ["4", None]


def test_a_batch_compare_and_set_is_judged_in_the_kernel_as_python_judges_it(
        kv: kvcomm.Client) -> None:
    """Without validators the C kernel judges a batch's expects under the writer lock:
    ABSENT holds over a missing, deleted or expired key and fails over a live one; a
    Version holds only at that exact write. Each refusal is a ConflictError naming the
    version the key is at, counted, and nothing of the batch is written. A Version of
    another shape (other hosts' entries) is judged in Python, with the same answer."""
    def attempt(key: str, expect: object) -> bool:
        kv.put("side", None)
        try:
            with kv.batch() as b:
                b.put("side", key)
                b._expect(key, expect)
        except kvcomm.ConflictError:
            assert kv.get("side") != key  # (nothing of the batch written)
            return False
        return kv.get("side") == key

    v = kv.put("live", 1)
    kv.put("gone", 1)
    kv.delete("gone")
    kv.put("expired", 1, ttl=0.01)
    wait_for(lambda: kv.get("expired") is None, 5, "the key to expire")
    conflicts = kv.counters["conflicts"]
    assert not attempt("live", kvcomm.ABSENT)
    assert [attempt(k, kvcomm.ABSENT) for k in ("missing", "gone", "expired")] == [True] * 3
    assert attempt("live", v)
    assert not attempt("live", v._replace(hlc=v.hlc + 1))
    (host, counter), = v.vector
    assert not attempt("live", kvcomm.Version(((host, counter + 1),), v.hlc))
    assert not attempt("missing2", v)
    other = kvcomm.Version(((host, counter), ("another-host", 3)), v.hlc)
    assert not attempt("live", other)  # (judged by Python: not of this host alone)
    assert kv.counters["conflicts"] == conflicts + 5
    with pytest.raises(kvcomm.ConflictError, match="is at v"):
        with kv.batch() as b:
            b.put("side", 0)
            b._expect("live", v._replace(hlc=v.hlc + 1))
    v2 = kv.put("live", 2)
    assert not attempt("live", v) and attempt("live", v2)


def test_a_kernel_refusal_python_would_accept_is_judged_again_in_python(
        kv: kvcomm.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's judgement of a Version compares the record's fields; should it ever
    refuse a write that Python's Version comparison accepts (the key changed back, or
    the record's vector written in another form), the batch is judged again in Python
    under the lock and applied: a compare-and-set never fails for nothing."""
    from kvcomm._client.batch import Batch

    v = kv.put("head", 1)
    real = Batch._kernel_expects

    def off_by_one(self: Batch) -> object:
        out = real(self)
        return [(kb, h, counter + 1, hlc) for kb, h, counter, hlc in out]  # (always refused)

    monkeypatch.setattr(Batch, "_kernel_expects", off_by_one)
    with kv.batch() as b:
        b.put("rec", "r")
        b._expect("head", v)
    assert kv.get("rec") == "r"
    kv.put("head", 2)
    with pytest.raises(kvcomm.ConflictError):
        with kv.batch() as b:
            b.put("rec", "s")
            b._expect("head", v)
    assert kv.get("rec") == "r"


def test_a_malformed_expect_leaves_the_segment_usable(kv: kvcomm.Client) -> None:
    """The kernel's expects are checked: a malformed one is a TypeError under the lock,
    nothing written, and the next write goes through (no repair left pending)."""
    seg = kv._seg
    kb, h = kv._key_hash("k")
    op = (kb, h, 1, b"", b"v")
    for bad in ([("k", h)], [(kb,)], [(kb, h, 1)], [(kb, -1)], ["x"]):
        try:
            seg._lock()
            with pytest.raises((TypeError, OverflowError)):
                seg._core.apply([op], 0, 0, 0, False, True, bad)
        finally:
            seg._core.unlock()
    assert kv.get("k") is None
    kv.put("k", 1)
    assert kv.get("k") == 1 and not kv._seg.check()


def test_a_packed_value_over_max_value_size_is_refused_at_its_put(kv: kvcomm.Client) -> None:
    """A Packed is stored as its payload straight from the batch's C put; one over
    cache.max_value_size takes the Python path and is refused there, the batch unchanged."""
    big = Packed([b"x" * (kv.config.cache.max_value_size + 1)])
    with kv.batch() as b:
        b.put("small", Packed(["s", None]))
        with pytest.raises(kvcomm.ValueTooLarge):
            b.put("big", big)
        assert len(b) == 1
    assert kv.get("small") == ["s", None] and kv.get("big") is None


def test_put_records_is_all_or_nothing_and_stores_what_put_would(kv: kvcomm.Client) -> None:
    """Batch._put_records (the LangGraph saver's records, one C call): each list of plain
    fields stored as Packed stores it; another list through the codec; whatever one
    record's key or fields get wrong, none of the call's puts is in the batch."""
    seen: list[object] = []
    kv.register_validator("r/v", lambda key, old, new: seen.append(new))
    with kv.batch() as b:
        b.put("first", 1)
        for keys, records, error in (
                (["r/a", "", "r/b"], [["a"], ["x"], ["b"]], kvcomm.InvalidKey),
                (["r/a", "r/\x00"], [["a"], ["x"]], kvcomm.InvalidKey),
                (["r/a", "r/b"], [["a"], ["\ud800"]], kvcomm.UnsupportedValue),
                (["r/a", "r/b"], [["a"], [b"x" * (kv.config.cache.max_value_size + 1)]],
                 kvcomm.ValueTooLarge)):
            with pytest.raises(error):
                b._put_records(keys, records)
            assert len(b) == 1 and b._keys == ["first"]
        with pytest.raises(kvcomm.InvalidArgument):
            b._put_records(["r/a"], [["a"]], ttl=-1)
        b._put_records(["r/a", "r/n", "r/v"], [["a", b"b", None], ["n", 1, 2.5], ["v"]])
        b._put_records(["r/t"], [["t"]], ttl=60)
    assert kv.get("r/a") == ["a", b"b", None] and kv.get("r/n") == ["n", 1, 2.5]
    assert kv.get("r/v") == ["v"] and seen == [["v"]]  # (a validator sees the list)
    item = kv.get_item("r/t")
    assert item is not None and item.expires_at is not None
    raw = kv._seg.read(*kv._key_hash("r/a"))
    assert raw is not None and raw.value == Packed(["a", b"b", None]).payload


def test_put_records_in_one_kernel_call_does_what_its_batch_does(
        kv: kvcomm.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """batch.put_records (the saver's step: records, new-only writes, a head moved by a
    compare-and-set) in one call of the kernel stores, versions, counts and refuses
    exactly as the batch it stands for: run both ways, the same keys, values, ttls,
    counters and errors; a failed new-only write is not counted as a conflict, a failed
    head is; a validator on a key sends it the batch's way (the validator sees it)."""
    from kvcomm._client import batch as batch_mod

    def run(way: str, tag: str) -> list[object]:
        if way == "batch":  # (the general path, as with a validator or in cluster mode)
            monkeypatch.setattr(kv, "_has_validators", True)
            monkeypatch.setattr(kv._validators, "lookup", lambda key: None)
        seen: list[object] = []
        p = f"{tag}/"
        v1 = batch_mod.put_records(kv, [p + "c1", p + "b1"], [["c", None], ["b", b"x"]], 60,
                                   last=(p + "h", Packed.built({"id": "1"}), kvcomm.ABSENT, 30))
        seen.append(v1 == kv.get_item(p + "h").version)
        item = kv.get_item(p + "c1")
        seen.append(item is not None and item.expires_at is not None)
        head = kv.get_item(p + "h")  # (the head's own ttl, 30 s, both ways: not its records')
        assert head is not None and item is not None and item.expires_at is not None
        assert head.expires_at is not None and item.expires_at - head.expires_at > 25
        counters = dict(kv.counters)
        assert batch_mod.put_records(kv, [p + "w0", p + "w1"], [["w", "0"], ["w", "1"]],
                                     absent=[0, 1]) is None
        seen.append((kv.counters["batches"] - counters["batches"],))
        for stored_write in (True, False):
            conflicts = kv.counters["conflicts"]
            with pytest.raises(kvcomm.ConflictError) as err:
                if stored_write:  # (a write stored already: not counted)
                    batch_mod.put_records(kv, [p + "x", p + "w1"], [["x"], ["again"]],
                                          absent=[1])
                else:  # (the head moved on meanwhile: counted)
                    kv.put(p + "h", {"id": "other"})
                    batch_mod.put_records(kv, [p + "y"], [["y"]],
                                          last=(p + "h", Packed.built({"id": "2"}), v1, None))
            said = re.sub(r"v\[[^ ]*", "V", str(err.value).replace(tag, "T"))
            seen.append((said, kv.counters["conflicts"] - conflicts,
                         kv.get(p + "x"), kv.get(p + "y")))
        v3 = batch_mod.put_records(kv, [p + "z"], [["z"]], last=(
            p + "h", Packed.built({"id": "3"}), kv.get_item(p + "h").version, None))
        seen.append((v3 == kv.get_item(p + "h").version, kv.get(p + "h"), kv.get(p + "w1"),
                     kv.get_item(p + "h").expires_at))
        monkeypatch.undo()
        return seen

    one_call = run("kernel", "q-one")
    assert one_call[0] is True and one_call[1] is True
    assert one_call[3][1:] == (0, None, None) and one_call[4][1:] == (1, None, None)
    assert one_call[5][:3] == (True, {"id": "3"}, ["w", "1"]) and one_call[5][3] is None
    as_batch = run("batch", "q-two")
    assert [x for i, x in enumerate(one_call) if i != 2] == \
        [x for i, x in enumerate(as_batch) if i != 2]
    assert one_call[2][0] == as_batch[2][0] == 1  # (one batch each)
    seen: list[object] = []
    kv.register_validator("v/", lambda key, old, new: seen.append((key, new)))
    batch_mod.put_records(kv, ["v/a"], [["a"]], last=("v/h", Packed.built({"id": "1"}),
                                                       kvcomm.ABSENT, None))
    assert seen == [("v/a", ["a"]), ("v/h", {"id": "1"})]
    assert kv._seg.check() == []


def test_put_records_one_call_hands_what_it_cannot_do_to_the_careful_path(
        kv: kvcomm.Client, ns: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """put_records takes the writer lock, applies and releases it in one kernel call; what
    that call leaves to Python (a segment to repair first, a namespace purged, corruption
    the kernel found) goes the careful way, as a batch's apply: the repair is made and the
    step written, the purge raises SegmentError, nothing is written twice."""
    from kvcomm._client import batch as batch_mod
    from kvcomm.tiers import l2

    head = ("s/h", Packed.built({"id": "1"}), kvcomm.ABSENT, None)
    core = kv._seg._core
    core.lock(5.0)
    core.set_busy(1)  # (a writer died mid-write: the next lock must repair first)
    core.unlock()
    recoveries = kv._seg.info()["recoveries"]
    v1 = batch_mod.put_records(kv, ["s/c1"], [["c1"]], last=head)
    assert kv._seg.info()["recoveries"] == recoveries + 1
    assert (kv.get("s/c1"), kv.get_item("s/h").version) == (["c1"], v1)

    calls: list[int] = []
    step = kv._core_step

    def corrupt(*args: object) -> object:  # (a writer dies mid-write between two steps)
        calls.append(1)
        core.lock(5.0)
        core.set_busy(1)
        core.unlock()
        return step(*args)
    monkeypatch.setattr(kv, "_core_step", corrupt)
    v2 = batch_mod.put_records(kv, ["s/c2"], [["c2"]], last=(
        "s/h", Packed.built({"id": "2"}), v1, None))
    assert calls == [1] and kv.get("s/c2") == ["c2"] and kv.get_item("s/h").version == v2
    assert kv._seg.info()["recoveries"] == recoveries + 2
    monkeypatch.undo()

    def closed_meanwhile(*args: object) -> tuple[list[object], None, None]:  # (another
        monkeypatch.setattr(kv._seg, "_core", None)  # thread closes the segment between
        return [], None, None  # the kernel's "look first" and the careful path, as
    monkeypatch.setattr(kv, "_core_step", closed_meanwhile)  # SegmentCore.close does)
    with pytest.raises(kvcomm.SegmentError, match="closed in this process"):
        batch_mod.put_records(kv, ["s/c9"], [["c9"]])
    monkeypatch.undo()

    batches = kv.counters["batches"]
    l2.purge(ns)
    with pytest.raises(kvcomm.SegmentError, match="purged"):
        batch_mod.put_records(kv, ["s/c3"], [["c3"]], last=(
            "s/h", Packed.built({"id": "3"}), v2, None))
    assert kv.counters["batches"] == batches


_HOLDS_THE_LOCK = """
import sys, time
import kvcomm
kv = kvcomm.open(sys.argv[1], config=kvcomm.Config.from_mapping({"cache": {"l2_size": "16MB"}}))
core = kv._seg._core
core.lock(5.0)
if sys.argv[2] == "busy":  # (mid-write: what it changed is to be repaired by the next writer)
    core.set_busy(1)
print("held", flush=True)
time.sleep(60)
"""


def test_a_saver_step_against_another_process_holding_or_killed_with_the_lock(
        ns: str) -> None:
    """The saver's step (put_records with its head) on real processes: another process holds
    the writer lock: Unavailable after the lock timeout, nothing written, the head as it was;
    that process killed in the middle of a write (BUSY raised, the lock held): the next step
    repairs the segment (one owner death, one recovery) and writes, and every step
    acknowledged before the kill reads back."""
    from kvcomm._client import batch as batch_mod

    cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": "16MB", "lock_timeout": "1s"}})
    kv = kvcomm.open(ns, config=cfg)
    try:
        v = kvcomm.ABSENT
        for i in range(3):  # (acknowledged steps)
            v = batch_mod.put_records(kv, [f"s/c{i}"], [[f"c{i}"]], last=(
                "s/h", Packed.built({"id": str(i)}), v, None))
        for how in ("held", "busy"):
            holder = subprocess.Popen([sys.executable, "-c", _HOLDS_THE_LOCK, ns, how],
                                      stdout=subprocess.PIPE, text=True)
            try:
                assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
                info = kv._seg.info()
                if how == "held":
                    with pytest.raises(kvcomm.Unavailable):
                        batch_mod.put_records(kv, ["s/late"], [["late"]], last=(
                            "s/h", Packed.built({"id": "late"}), v, None))
                    assert kv.get("s/late") is None and kv.get_item("s/h").version == v
                    continue
                holder.kill()
                holder.wait(10)
                v = batch_mod.put_records(kv, ["s/c3"], [["c3"]], last=(
                    "s/h", Packed.built({"id": "3"}), v, None))
                after = kv._seg.info()
                assert after["owner_deaths"] == info["owner_deaths"] + 1
                assert after["recoveries"] == info["recoveries"] + 1
            finally:
                holder.kill()
                holder.wait(10)
        assert [kv.get(f"s/c{i}") for i in range(4)] == [[f"c{i}"] for i in range(4)]
        head = kv.get_item("s/h")
        assert head is not None and head.value == {"id": "3"} and head.version == v
        assert kv._seg.check() == []
    finally:
        kv.close()


def test_put_records_closed_while_it_collects_its_batch_writes_nothing(ns: str) -> None:
    """Collecting a step's batch may run Python code (the client's encode for a head that is
    not Packed, a finalizer), and another thread's close with it: the call then raises
    SegmentError and writes nothing, never touching the unmapped segment (SIGSEGV). Here
    the encode closes the client itself, in a process of its own."""
    out = _run(f"""
import kvcomm
from kvcomm._client.batch import put_records
kv = kvcomm.open({ns!r}, config=kvcomm.Config.from_mapping({{"cache": {{"l2_size": "8MB"}}}}))
memo, key_hash, encode, *rest = kv._batch_ops
def closing(value):
    kv.close()
    return encode(value)
kv._batch_ops = (memo, key_hash, closing, *rest)
try:
    put_records(kv, ["c/1"], [["x"]], last=("c/h", {{"id": "1"}}, kvcomm.ABSENT, None))
except kvcomm.SegmentError as exc:
    print("refused:", exc)
""")
    assert out.returncode == 0, (out.returncode, out.stderr[-800:])
    assert "closed while this call collected its batch" in out.stdout, out.stdout
    with kvcomm.open(ns, config=kvcomm.Config.from_mapping({"cache": {"l2_size": "8MB"}})) as kv:
        assert kv.get("c/1") is None and kv.get("c/h") is None and kv._seg.check() == []


def test_put_records_edges_its_review_found(kv: kvcomm.Client) -> None:
    """(Found in review, each a difference from the batch put_records stands for, or from
    the saver's promise.) The head's deadline is never after its records', however long
    they take to encode (its ttl was counted from after them: 4,000 records put it 8 ms
    later); an empty call applies and counts nothing; a bad head ttl is refused before a
    bad head key, as the batch does; a refused compare-and-set takes one turn of latency
    sampling, not two."""
    from kvcomm._client import batch as batch_mod

    keys = [f"t/r{i}" for i in range(4000)]
    batch_mod.put_records(kv, keys, [[f"value {i}" * 4] for i in range(4000)], 60,
                          last=("t/h", Packed.built({"id": "1"}), kvcomm.ABSENT, 60))
    head = kv.get_item("t/h")
    assert head is not None and head.expires_at is not None
    assert head.expires_at <= min(kv.get_item(k).expires_at for k in keys)  # type: ignore[union-attr]
    batches, turn = kv.counters["batches"], kv._lat_left
    assert batch_mod.put_records(kv, [], []) is None
    assert (kv.counters["batches"], kv._lat_left) == (batches, turn)
    with pytest.raises(kvcomm.InvalidArgument, match="ttl"):
        batch_mod.put_records(kv, [], [], -1)
    with pytest.raises(kvcomm.InvalidArgument, match="ttl"):
        batch_mod.put_records(kv, ["t/x"], [["x"]], last=("", Packed.built({}), kvcomm.ABSENT, -1))
    with pytest.raises(kvcomm.InvalidKey):
        batch_mod.put_records(kv, ["t/x"], [["x"]], last=("", Packed.built({}), kvcomm.ABSENT, 5))
    for bad_record in (["t/\x00"], [["x"]]), (["t/x"], [[object()]]):  # (and a bad record
        with pytest.raises((kvcomm.InvalidKey, kvcomm.UnsupportedValue)):  # before a bad head
            batch_mod.put_records(kv, *bad_record, last=(  # ttl: as the batch finds them)
                "t/h2", Packed.built({}), kvcomm.ABSENT, -1))
    with pytest.raises(IndexError):  # (absent names records, never the head after them)
        batch_mod.put_records(kv, ["t/x"], [["x"]], absent=[1], last=(
            "t/h2", Packed.built({}), kvcomm.ABSENT, None))
    assert kv.get("t/x") is None and kv.get("t/h2") is None
    turn = kv._lat_left  # (a refused call, nothing applied, takes no turn of sampling)
    with pytest.raises(kvcomm.InvalidKey):
        batch_mod.put_records(kv, ["t/\x00"], [["x"]])
    assert kv._lat_left == turn
    turn = kv._lat_left
    with pytest.raises(kvcomm.ConflictError):
        batch_mod.put_records(kv, ["t/y"], [["y"]], last=("t/h", Packed.built({}), kvcomm.ABSENT, None))
    assert kv._lat_left in (turn - 1, kv._lat_every) and kv.get("t/y") is None


def test_a_batchs_new_keys_are_checked_and_hashed_as_the_client_does(kv: kvcomm.Client) -> None:
    """New keys are validated and hashed in the batch's C kernel (no call back into
    Python): the same bytes and hash as segment.key_hash, the same refusals as the
    client's _key, over random keys (the seed printed), and the key memo stays bounded. A
    put remembers its key in the memo; a record's (_put_packed: written once) does not."""
    from kvcomm._l2core import KEY_MEMO

    seed = drawn_seed(2**32)
    rng = random.Random(seed)
    alphabet = "ab/é\x00\ud800\U0001f600 "
    max_key = kv._max_key
    b = kv.batch()  # (never applied: its puts only collect)
    for _ in range(3000):
        n = rng.choice([0, 1, 5, max_key // 4, max_key // 4 + 1, max_key, max_key + 1])
        key = "".join(rng.choice(alphabet) for _ in range(n))
        try:
            kb = key.encode("utf-8")
            ok = 0 < len(kb) <= max_key and b"\x00" not in kb
        except UnicodeEncodeError:
            ok = False
        kv._keys.clear()  # (a new key each time: the kernel's own path)
        if ok:
            b._put_packed([key], [["v"]])
            assert b._ops[-1][:2] == (kb, key_hash(kb)) and key not in kv._keys
            b.put(key, "v")
            assert b._ops[-1][:2] == (kb, key_hash(kb)) and kv._keys[key] == b._ops[-1][:2]
        else:
            with pytest.raises(kvcomm.InvalidKey):
                b._put_packed([key], [["v"]])
            with pytest.raises(kvcomm.InvalidKey):
                b.put(key, "v")
    kv._keys.clear()
    for i in range(KEY_MEMO + 10):
        b.put(f"m/{i}", "v")
    assert 0 < len(kv._keys) <= KEY_MEMO and len(b) >= KEY_MEMO + 10


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
    seed = drawn_seed(2**32)
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


def _cfg(**cache: object) -> kvcomm.Config:
    return kvcomm.Config.from_mapping({"cache": {"l2_size": "16MB", "watch_buffer": 256, **cache}})


# ---------------------------------------------------------------------------------------
# F2. A batch that raises ("Nothing was written") was partly applied.
# ---------------------------------------------------------------------------------------

def test_a_batch_deleting_and_reputting_a_key_is_applied_whole_or_not_at_all(name: str) -> None:
    """Embedded mode, batch [delete k, put k, put y]. The plan lets `put k` reuse k's slot
    and claims for new key y the only free slot F of y's probe window; at publish time
    (_l2core.c publish, planned=0 for n > 1) `put k` re-probes and takes F (the first
    free slot in k's window), so y finds no slot: set_corrupt('a planned slot was taken')
    mid-publish. l2.py apply() then recovers and retries the whole batch, which now
    fails with ST_SLOT_FULL (y's window is full of pinned views) and raises Unavailable
    '... Nothing was written' — yet k already holds the batch's new value.
    (found in review 7: embedded and cluster mode on real processes)"""
    kv = kvcomm.open(name, config=_cfg(l2_size="2MB", watch_buffer=64, l1_size=0))
    try:
        n = kv._seg.layout.n_slots
        mask = n - 1

        def home(k: str) -> int:
            return key_hash(k.encode()) & mask  # (always odd: key_hash sets bit 0)

        y_home = n - 21  # y's window: slots n-21 .. n-1, 0 .. 10
        fillers = list(itertools.islice(
            (f"f{i}" for i in itertools.count() if home(f"f{i}") == y_home), 32))
        k_key = next(f"k{i}" for i in itertools.count() if home(f"k{i}") == 1)
        y_key = next(f"y{i}" for i in itertools.count() if home(f"y{i}") == y_home)
        arr = np.arange(4096, dtype=np.uint8)
        for k in fillers:  # fill y's whole window, in order
            kv.put(k, arr)
        kv.put(k_key, "old")  # k's window 1..32: slots 1..10 are taken, k lands in 11
        views = [kv.get(k) for k in fillers]  # pinned: never evictable
        slot_word = kv._seg.layout.slots_off // 8 + 5 * SLOT_WORDS
        victim = fillers[26]  # the filler in slot 5
        assert kv._q[slot_word + SLOT["HASH"]] == key_hash(victim.encode())
        del views[26]
        kv.delete(victim)  # slot 5 becomes a tombstone (slot 6 is used)
        recoveries = kv._seg.info()["recoveries"]
        try:
            with kv.batch() as b:
                b.delete(k_key)
                b.put(k_key, "NEW")
                b.put(y_key, "y")
        except kvcomm.KVCommError as exc:  # all or nothing: then nothing
            print("batch raised:", type(exc).__name__, exc)
            assert kv.get(y_key) is None
            assert kv.get(k_key) == "old", "the batch raised, yet its put of k was applied"
        else:  # (the batch fits: y takes the slot the delete of the filler freed)
            assert kv.get(k_key) == "NEW" and kv.get(y_key) == "y"
        assert kv._seg.info()["recoveries"] == recoveries  # no spurious repair
        assert kv._seg.check() == []
        del views
    finally:
        kv.close()


# ---------------------------------------------------------------------------------------
# F3. A validator that only READS a large array is reported as a write.
# ---------------------------------------------------------------------------------------

def test_validator_may_read_a_large_array(name: str) -> None:
    """register_validator: 'It may read from KVCOMM but not write'. Reading an array of
    zero_copy_threshold bytes or more takes a pin, which takes the writer lock
    (l2.py L2Segment.pin -> _lock -> take_lock), so the read raises InvalidArgument
    ('called to write from inside a validator') and the put is rejected.
    (found in review 7: embedded and cluster mode on real processes)"""
    with kvcomm.open(name, config=_cfg()) as kv:
        kv.put("map/grid", np.zeros(1 << 14, dtype=np.uint8))

        def cell_free(key: str, old: object, new: object) -> None:
            if kv.get("map/grid")[int(new)] != 0:
                raise ValueError("occupied")

        kv.register_validator("shelf/", cell_free)
        kv.put("shelf/A1", 3)
        assert kv.get("shelf/A1") == 3


def _run(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout)


# ----------------------------------------------------------------------------- batches

def test_batchops_without_init_does_not_segfault() -> None:
    """F: kvcomm.Batch (public) created without __init__ (a subclass that forgets
    super().__init__, or Batch.__new__) segfaults on put(): BatchOps fields are NULL.
    (found in review 8: kv.batch())"""
    out = _run("import kvcomm\n"
               "b = kvcomm.Batch.__new__(kvcomm.Batch)\n"
               "for call in (lambda: b.put('k', b'v'), lambda: b.delete('k'), lambda: len(b),\n"
               "             lambda: b.__enter__(), lambda: b.__exit__(None, None, None)):\n"
               "    try:\n        call()\n    except kvcomm.KVCommError as e:\n"
               "        print(type(e).__name__)\n")
    assert out.returncode == 0, (out.returncode, out.stderr[-500:])
    # put, delete, __enter__ and __exit__ say how to make a batch; len() is 0
    assert out.stdout.split() == ["InvalidArgument"] * 4, out.stdout


def test_a_batch_used_after_its_block_raises(kv: kvcomm.Client) -> None:
    """F: b.put() after the with-block is accepted silently and never applied; entering
    the same batch again replays its old ops over newer writes.
    (found in review 8: kv.batch())"""
    b = kv.batch()
    with b:
        b.put("a", b"1")
    kv.put("a", b"2")
    with pytest.raises(kvcomm.KVCommError):
        b.put("z", b"late")  # silently accepted today, never stored
    with pytest.raises(kvcomm.KVCommError):
        b.delete("a")
    assert b.versions[0] is not False and len(b.versions) == 1  # the results stay readable


def test_a_batch_abandoned_by_an_exception_is_closed_too(kv: kvcomm.Client) -> None:
    """(The same rule when the block raised: the batch was discarded, not kept for later.)
    (found in review 8: kv.batch())"""
    b = kv.batch()
    with pytest.raises(RuntimeError):
        with b:
            b.put("a", b"1")
            raise RuntimeError("the agent's own error")
    with pytest.raises(kvcomm.InvalidArgument):
        b.put("a", b"2")
    assert kv.get("a") is None and b.versions == []


def test_reentering_a_batch_does_not_replay_old_writes(kv: kvcomm.Client) -> None:
    """F: the second `with b:` applies the first block's ops again: the newer "2" is
    overwritten by the batch's stale "1".
    (found in review 8: kv.batch())"""
    b = kv.batch()
    with b:
        b.put("a", b"1")
    kv.put("a", b"2")
    try:
        with b:
            pass
    except kvcomm.KVCommError:
        pass
    assert kv.get("a") == b"2"


def test_a_validator_cannot_write_through_the_batch(kv: kvcomm.Client) -> None:
    """F: validators "may read, not write" (kv.put inside one is refused), but a validator
    that calls b.put() on the batch being validated adds writes that are then applied
    (and one that keeps adding, e.g. b.delete(key) in a delete's validator, never ends).
    (found in review 8: kv.batch())"""
    holder: dict[str, kvcomm.Batch] = {}

    def v(key: str, old: object, new: object) -> None:
        b = holder["b"]
        if len(b) < 3:
            b.put(f"v/x{len(b)}", b"from-validator")

    kv.register_validator("v/", v)
    with pytest.raises(kvcomm.KVCommError):
        with kv.batch() as b:
            holder["b"] = b
            b.put("v/a", b"1")
    assert kv.get("v/x1") is None
    assert kv.get("v/a") is None  # the batch raised: nothing of it was written


def test_validator_writing_raises_invalid_argument_as_documented(kv: kvcomm.Client) -> None:
    """F (docs/error type): register_validator says a write from a validator raises
    InvalidArgument; it raises ValidationError.
    (found in review 8: kv.batch())"""
    kv.register_validator("w/", lambda k, o, n: kv.put("w/other", b"x"))
    with pytest.raises(kvcomm.InvalidArgument):
        kv.put("w/a", b"1")
    holder: dict[str, kvcomm.Batch] = {}
    kv.register_validator("b/", lambda k, o, n: holder["b"].delete("b/other"))
    with pytest.raises(kvcomm.InvalidArgument):
        with kv.batch() as b:
            holder["b"] = b
            b.put("b/a", b"1")
    assert kv.get("w/a") is None and kv.get("b/a") is None and len(b) == 1


def test_a_validator_raising_invalid_argument_itself_still_rejects_as_validation_error(
        kv: kvcomm.Client) -> None:
    """(The other side of the line: only a *write* from the validator is InvalidArgument;
    a validator's own exception, whatever its type, is its verdict: ValidationError.)
    (found in review 8: kv.batch())"""
    def v(key: str, old: object, new: object) -> None:
        raise kvcomm.InvalidArgument("the validator's own verdict")

    kv.register_validator("x/", v)
    with pytest.raises(kvcomm.ValidationError):
        kv.put("x/a", b"1")


def test_an_oversized_batch_in_embedded_mode_does_not_blame_l3(ns: str) -> None:
    """F (message): a batch of more new keys than a probe window can take, in embedded
    mode, says 'full of writes not yet in L3; retry after the node daemon syncs' —
    there is no L3 and no daemon. (A 16 MB namespace: the default one's slot table, sized
    for small keys, takes a 200,000-key batch whole.)
    (found in review 8: kv.batch())"""
    with kvcomm.open(ns, config=kvcomm.Config.from_mapping({"cache": {"l2_size": "16MB"}})) as kv:
        with pytest.raises(kvcomm.Unavailable) as ei:
            with kv.batch() as b:
                for i in range(200_000):
                    b.put(f"h/{i}", b"x")
        assert "L3" not in str(ei.value) and "daemon" not in str(ei.value), str(ei.value)
        assert "split the batch" in str(ei.value), str(ei.value)


def test_batch_put_still_takes_keyword_arguments(kv: kvcomm.Client) -> None:
    """F (API regression): Batch.put(key, value) was a Python method; BatchOps.put is
    METH_FASTCALL without keywords: b.put(key="a", value=b"v") raises TypeError.
    (found in review 8: kv.batch())"""
    with kv.batch() as b:
        b.put(key="a", value=b"v")  # type: ignore[call-arg]
        b.put("b", value=b"w")  # type: ignore[call-arg]
        b.delete(key="c")  # type: ignore[call-arg]
    assert kv.get("a") == b"v" and kv.get("b") == b"w"
    with kv.batch() as b:
        for bad in ({"key": "a"}, {"key": "a", "value": b"v", "other": 1},
                    {"value": b"v", "k": "a"}):
            with pytest.raises(TypeError):
                b.put(**bad)
        with pytest.raises(TypeError):
            b.put("a", b"v", key="a")  # type: ignore[misc]


def test_batch_put_on_a_closed_client_raises_at_once(ns: str) -> None:
    """F (regression, minor): the Python Batch.put checked c._live(); BatchOps.put does not,
    so puts into a batch of a closed (or forked-away) client are accepted and the error
    only comes at the end of the block.
    (found in review 8: kv.batch())"""
    kv = kvcomm.open(ns)
    b = kv.batch()
    kv.close()
    with pytest.raises(kvcomm.SegmentError):
        b.put("k", b"v")
    with pytest.raises(kvcomm.SegmentError):
        b.delete("k")


# ----------------------------------------------------------------------------- cluster


def test_a_batch_delete_of_an_absent_key_writes_nothing_in_cluster_mode(
        cluster: object, store: object) -> None:
    """F (minor): kv.delete of a key absent here and in L3 writes nothing ("nothing to tell
    L3"); the same delete in a batch writes a dirty tombstone that the daemon pushes to L3
    (and that counts against cluster.outbound_max).
    (found in review 8: kv.batch())"""
    h1 = Host(cluster, "host-1", seed=1)  # type: ignore[arg-type]
    try:
        assert h1.kv.delete("never/1") is False
        with h1.kv.batch() as b:
            b.delete("never/2")
        assert b.versions == [False]
        wait_for(lambda: h1.kv._seg.dirty_count == 0, 20, "the daemon settled")
        assert store.get("never/1") is None  # type: ignore[attr-defined]
        assert store.get("never/2") is None  # type: ignore[attr-defined]
    finally:
        h1.close()


def test_a_batch_delete_still_covers_what_the_host_or_l3_holds(
        cluster: object, store: object) -> None:
    """(The other side: a batch delete of a key held here, written earlier in the batch,
    or only in L3, leaves a tombstone that reaches L3, as kv.delete does.)
    (found in review 8: kv.batch())"""
    h1 = Host(cluster, "host-1", seed=1)  # type: ignore[arg-type]
    h2 = Host(cluster, "host-2", seed=2)  # type: ignore[arg-type]
    try:
        h1.kv.put("here", b"1")
        h2.kv.put("elsewhere", b"1")
        wait_for(lambda: store.get("here") is not None  # type: ignore[attr-defined]
                 and store.get("elsewhere") is not None, 20, "both writes in L3")  # type: ignore[attr-defined]
        # (until host-1's key filter has host-2's key, host-1 rightly answers "absent")
        wait_for(lambda: (kf := h1.kv._key_filter()) is not None and kf.may_exist(b"elsewhere"),
                 20, "host-1's key filter has the key")
        with h1.kv.batch() as b:
            b.delete("here")
            b.delete("elsewhere")
            b.put("new", b"1")
            b.delete("new")
        assert b.versions[:2] == [True, True] and b.versions[3] is True, b.versions
        for key in ("here", "elsewhere", "new"):
            wait_for(lambda k=key: (r := store.get(k)) is not None  # type: ignore[attr-defined, misc]
                     and r.tombstone, 20, f"the tombstone of {key} in L3")
        wait_for(lambda: h2.kv.get("elsewhere") is None, 20, "host-2 sees the delete")
    finally:
        h1.close()
        h2.close()
