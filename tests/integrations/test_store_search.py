"""KVCommStore's semantic search (index=, search(query=...)): LangGraph's contract, checked
against LangGraph's own InMemoryStore, and the host's shared-memory index."""

from __future__ import annotations

import asyncio
import glob
import os
import random
import re
import time
from typing import Any

import pytest

import kvcomm
from kvcomm._wait import wait_until
from kvcomm.tiers import l2

pytest.importorskip("langgraph.store.memory")
np = pytest.importorskip("numpy")

from langgraph.store.base import GetOp, PutOp, SearchOp  # noqa: E402
from langgraph.store.memory import InMemoryStore  # noqa: E402
from xxhash import xxh3_64_intdigest  # noqa: E402

from kvcomm.integrations.langgraph import KVCommStore  # noqa: E402
from kvcomm.tiers import vectors  # noqa: E402
from kvcomm.tiers.vectors import H_INTENT, H_LAYOUT, LAYOUT_FLOCK, MUTEX_AT  # noqa: E402
from tests.support import ROOT  # noqa: E402

DIMS = 16
WORDS = ["apple", "pear", "rust", "python", "cloud", "river", "stone", "tiger", "violet",
         "amber", "piano", "quartz", "maple", "delta", "orbit", "ember"]


def fake_embed(texts: list[str], dims: int = DIMS) -> list[list[float]]:
    """A deterministic embedding: each word a seeded random vector, a text their sum (texts
    sharing words are near), so scores vary and rarely tie."""
    out = []
    for text in texts:
        v = np.zeros(dims)
        for w in text.split():
            v += np.random.default_rng(xxh3_64_intdigest(w.encode())).standard_normal(dims)
        out.append(v.tolist())
    return out


def index_config(**kw: Any) -> dict[str, Any]:
    return {"dims": DIMS, "embed": fake_embed, "fields": ["text", "extra"], **kw}


def vector_files(kv: kvcomm.Client) -> list[str]:
    return glob.glob(os.path.join(kv.config.cache.l2_dir, f"kvcomm.{kv.name}.vec.*"))


NAMESPACES = [("a",), ("a", "b"), ("ab",), ("b", "x"), ("a", "b", "c")]
PREFIXES = [(), ("a",), ("a", "b"), ("ab",), ("b",), ("zz",)]


def _value(rng: random.Random) -> dict[str, Any]:
    v: dict[str, Any] = {"text": " ".join(rng.choices(WORDS, k=rng.randint(1, 4))),
                         "n": rng.randint(0, 9), "color": rng.choice(["red", "blue"])}
    if rng.random() < 0.4:
        # (never the same string as "text": InMemoryStore fails on a put whose two fields
        # hold one text, ValueError "Number of embeddings (1) does not match...")
        v["extra"] = "also " + " ".join(rng.choices(WORDS, k=rng.randint(1, 3)))
    if rng.random() < 0.1:
        del v["text"]
    return v


def _check(got: list[Any], ref_full: list[Any], ref: list[Any], what: str) -> None:
    """``got`` agrees with InMemoryStore's ``ref`` (same search) and ``ref_full`` (the same
    search without limit/offset): equal scores in the same order (float32 tolerance), each
    item scored as the reference scores it, the unscored fill drawn from its unscored items."""
    ref_score = {(i.namespace, i.key): i.score for i in ref_full}
    assert len(got) == len(ref), (what, got, ref)
    gs = [i.score for i in got if i.score is not None]
    rs = [i.score for i in ref if i.score is not None]
    assert gs == pytest.approx(rs, abs=1e-5), what
    assert gs == sorted(gs, reverse=True), what
    for i in got:
        k = (i.namespace, i.key)
        assert k in ref_score, (what, k)
        if i.score is None:
            assert ref_score[k] is None, (what, k)
        else:
            assert ref_score[k] == pytest.approx(i.score, abs=1e-5), (what, k)


def test_search_agrees_with_inmemorystore(kv: kvcomm.Client, seed: int) -> None:
    rng = random.Random(seed)
    store = KVCommStore(kv, index=index_config())
    ref = InMemoryStore(index=index_config())
    live: set[tuple[tuple[str, ...], str]] = set()
    for step in range(300):
        roll = rng.random()
        ns, key = rng.choice(NAMESPACES), f"k{rng.randrange(25)}"
        if roll < 0.55:
            value = _value(rng)
            index: Any = rng.choice([None, None, False, ["extra"], ["text", "extra"]])
            # (InMemoryStore keeps an item's old vectors when a new put has none for a path;
            # KVCommStore's put replaces them: the reference deletes first)
            ref.delete(ns, key)
            ref.put(ns, key, value, index=index)
            store.put(ns, key, value, index=index)
            live.add((ns, key))
        elif roll < 0.7:
            ref.delete(ns, key)
            store.delete(ns, key)
            live.discard((ns, key))
        else:
            prefix = rng.choice(PREFIXES)
            query = " ".join(rng.choices(WORDS, k=rng.randint(1, 3)))
            filt = rng.choice([None, None, {"color": "red"}, {"n": {"$gt": 4}}])
            limit, offset = rng.choice([1, 3, 10, 50]), rng.choice([0, 0, 1, 4])
            what = f"step {step}: search({prefix}, query={query!r}, filter={filt}, " \
                   f"limit={limit}, offset={offset})"
            got = store.search(prefix, query=query, filter=filt, limit=limit, offset=offset)
            want = ref.search(prefix, query=query, filter=filt, limit=limit, offset=offset)
            full = ref.search(prefix, query=query, filter=filt, limit=1000)
            _check(got, full, want, what)
            for i in got:
                assert i.namespace[:len(prefix)] == prefix, what
    assert vector_files(kv), "the index lives in a shared-memory file"


def test_namespace_scoping_is_exact(kv: kvcomm.Client) -> None:
    store = KVCommStore(kv, index=index_config())
    store.put(("tenant", "a"), "m", {"text": "apple pear"})
    store.put(("tenant", "ab"), "m", {"text": "apple pear"})
    store.put(("tenant",), "m", {"text": "apple pear"})
    got = store.search(("tenant", "a"), query="apple pear", limit=10)
    assert [(i.namespace, i.key) for i in got] == [(("tenant", "a"), "m")]
    assert got[0].score == pytest.approx(1.0, abs=1e-5)
    assert len(store.search(("tenant",), query="apple", limit=10)) == 3
    assert store.search(("other",), query="apple", limit=10) == []


def test_query_and_filter_together(kv: kvcomm.Client) -> None:
    store = KVCommStore(kv, index=index_config())
    store.put(("m",), "1", {"text": "rust stone", "kind": "fact"})
    store.put(("m",), "2", {"text": "rust", "kind": "chat"})
    store.put(("m",), "3", {"text": "python", "kind": "fact"})
    got = store.search(("m",), query="rust", filter={"kind": "fact"}, limit=2)
    assert [i.key for i in got] == ["1", "3"] and got[0].score > got[1].score


def test_async_embedding_and_asearch(kv: kvcomm.Client) -> None:
    calls = []

    async def aembed(texts: list[str]) -> list[list[float]]:
        calls.append(len(texts))
        return fake_embed(texts)

    store = KVCommStore(kv, index={"dims": DIMS, "embed": aembed, "fields": ["text"]})

    async def main() -> list[Any]:
        await store.aput(("u",), "1", {"text": "maple river"})
        await store.aput(("u",), "2", {"text": "orbit ember"})
        return await store.asearch(("u",), query="river maple", limit=1)

    got = asyncio.run(main())
    assert [i.key for i in got] == ["1"] and got[0].score == pytest.approx(1.0, abs=1e-5)
    assert calls, "the async embedding function was called"


def test_the_vector_travels_in_the_record(kv: kvcomm.Client, ns: str) -> None:
    store = KVCommStore(kv, index=index_config())
    store.put(("m",), "1", {"text": "tiger"})
    raw = kv.get(store.keys.item(("m",), "1"))
    assert len(raw) == 6 and raw[4] is None and raw[5][2][0][0] == "text"
    v = np.frombuffer(raw[5][2][0][1], dtype="<f4")
    want = np.asarray(fake_embed(["tiger"])[0])
    assert np.allclose(v, want / np.linalg.norm(want), atol=1e-6)
    # a plain get still reads it as an item
    got = store.get(("m",), "1")
    assert got is not None and got.value == {"text": "tiger"}
    # put with index=False: no vectors, and the item comes last, unscored
    store.put(("m",), "2", {"text": "tiger"}, index=False)
    assert len(kv.get(store.keys.item(("m",), "2"))) == 4
    res = store.search(("m",), query="tiger", limit=5)
    assert [(i.key, i.score is None) for i in res] == [("1", False), ("2", True)]


def test_a_stale_row_is_detected_and_repaired(kv: kvcomm.Client) -> None:
    store = KVCommStore(kv, index=index_config())
    store.put(("m",), "1", {"text": "apple"})
    store.put(("m",), "2", {"text": "violet"})
    sem = store._sem
    assert sem is not None and sem.file is not None
    f = sem.file
    key = store.keys.item(("m",), "1")
    # the record rewritten behind the index's back (new vector, new stamp): the host's row
    # still says "apple" under the old stamp
    part = sem.record_part(["text"], sem.blobs(fake_embed(["violet"])))
    kv.put(key, [*kv.get(key)[:4], part])
    assert int(f.hdr[H_INTENT]) == 0
    got = store.search(("m",), query="violet", limit=2)
    # the stale row is detected: both items are "violet" now, the record says
    assert [i.score for i in got] == pytest.approx([1.0, 1.0], abs=1e-5)
    assert [int(f.stamps[r]) for r in f.rows_of(key.encode())] == [part[1]], "row repaired"


def test_a_full_index_warns_and_searches_the_records(kv: kvcomm.Client) -> None:
    store = KVCommStore(kv, index=index_config(), index_capacity=3)
    ref = InMemoryStore(index=index_config())
    with pytest.warns(kvcomm.KVCommWarning, match="full"):
        for i, w in enumerate(WORDS[:6]):
            store.put(("m",), str(i), {"text": w})
            ref.put(("m",), str(i), {"text": w})
    assert store._sem is not None and store._sem.file is not None and store._sem.file.overflow
    got = store.search(("m",), query="rust apple", limit=4)
    want = ref.search(("m",), query="rust apple", limit=4)
    assert [(i.key, round(i.score, 5)) for i in got] == [(i.key, round(i.score, 5)) for i in want]


def test_purge_removes_the_vector_index(ns: str, config: kvcomm.Config) -> None:
    kv = kvcomm.open(ns, config=config)
    try:
        KVCommStore(kv, index=index_config()).put(("m",), "1", {"text": "apple"})
        files = vector_files(kv)
        assert len(files) == 1 and os.stat(files[0]).st_mode & 0o777 == 0o600
    finally:
        kv.close()
    l2.purge(ns)
    assert not os.path.exists(files[0])


def test_bad_index_configurations(kv: kvcomm.Client) -> None:
    with pytest.raises(kvcomm.ConfigError, match="IndexConfig"):
        KVCommStore(kv, index={"embed": fake_embed})
    with pytest.raises(kvcomm.ConfigError, match="dims"):
        KVCommStore(kv, index={"dims": 0, "embed": fake_embed})
    store = KVCommStore(kv, index={"dims": DIMS + 1, "embed": fake_embed})
    with pytest.raises(kvcomm.ConfigError, match="dimensions"):
        store.put(("m",), "1", {"text": "apple"})
    assert store.get(("m",), "1") is None, "nothing written"


_DIE_MID_PUT = r"""
import json, os, sys
import kvcomm
from kvcomm.integrations.langgraph import KVCommStore
sys.path.insert(0, sys.argv[3])
from tests.integrations.test_store_search import index_config
kv = kvcomm.open(sys.argv[1], config=kvcomm.Config.from_mapping(json.loads(sys.argv[2])))
store = KVCommStore(kv, index=index_config())
sem = store._sem
real = sem.file.set_rows
def die(*args):
    os._exit(3)  # killed after its record is written, before its rows
sem.file.set_rows = die
store.put(("m",), "1", {"text": "violet"})
"""


def _made_by_layout_2(store: KVCommStore) -> None:
    """The store's vector file made as the version before the mutex made it (layout 2:
    the header's mutex bytes zero; its writers flock the file)."""
    sem = store._sem
    assert sem is not None and sem._file is None
    c = store.kv.config.cache
    f = vectors.VectorFile.open(sem.np, store.kv.name, sem.id, sem.dims, sem.capacity,
                                c.max_key_bytes, c.l2_permissions, c.l2_dir)
    f._mm[MUTEX_AT:MUTEX_AT + 64] = bytes(64)
    f.hdr[H_LAYOUT] = LAYOUT_FLOCK
    f.close()


def test_a_vector_file_of_layout_2_is_used_under_its_flock(
        kv: kvcomm.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file an older version made is read and written as it is: this version's writers
    flock it too (they exclude the older version's writers), once per put."""
    import fcntl

    store = KVCommStore(kv, index=index_config())
    _made_by_layout_2(store)
    calls: list[int] = []
    real = fcntl.flock
    monkeypatch.setattr(vectors.fcntl, "flock", lambda fd, op: calls.append(op) or real(fd, op))
    store.put(("m",), "1", {"text": "apple"})
    store.put(("m",), "2", {"text": "violet"})
    store.put(("m",), "1", {"text": "violet"})
    assert store._sem is not None and store._sem.file is not None
    assert not store._sem.file._mutex
    assert calls == [fcntl.LOCK_EX, fcntl.LOCK_UN] * 3
    got = store.search(("m",), query="violet", limit=2)
    assert sorted(i.key for i in got) == ["1", "2"]
    assert [i.score for i in got] == pytest.approx([1.0, 1.0], abs=1e-5)


@pytest.mark.parametrize("layout", [vectors.LAYOUT, LAYOUT_FLOCK])
def test_a_process_killed_between_record_and_rows_is_repaired_by_the_next_writer(
        kv: kvcomm.Client, ns: str, monkeypatch: pytest.MonkeyPatch, layout: int) -> None:
    """The writer dies holding the lock: the file's mutex (handed on) or, layout 2, its
    flock (released by the kernel)."""
    import json
    import subprocess
    import sys

    from tests.support.helpers import SMALL

    store = KVCommStore(kv, index=index_config())
    if layout == LAYOUT_FLOCK:
        _made_by_layout_2(store)
    store.put(("m",), "1", {"text": "apple"})
    store.put(("m",), "2", {"text": "violet"})
    root = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", _DIE_MID_PUT, ns, json.dumps(SMALL), root],
                          capture_output=True, timeout=60)
    assert proc.returncode == 3, proc.stderr.decode()[-2000:]
    sem = store._sem
    assert sem is not None and sem.file is not None
    f = sem.file
    assert f._mutex == (layout != LAYOUT_FLOCK) and int(f.hdr[H_LAYOUT]) == layout
    key = store.keys.item(("m",), "1").encode()
    assert int(f.hdr[H_INTENT]) == len(key), "the dead writer left its item named"
    raw = kv.get(key.decode())
    assert [int(f.stamps[r]) for r in f.rows_of(key)] != [raw[5][1]], "its rows are stale"
    # a search meanwhile scores the named item from its record, without a scan of records
    scanned = []
    real_scan = KVCommStore._scan_search
    monkeypatch.setattr(KVCommStore, "_scan_search",
                        lambda *a: scanned.append(1) or real_scan(*a))
    got = store.search(("m",), query="violet", limit=1)
    assert [i.score for i in got] == pytest.approx([1.0], abs=1e-5) and not scanned
    monkeypatch.undo()
    store.put(("m",), "3", {"text": "amber"})  # the next writer repairs
    assert int(f.hdr[H_INTENT]) == 0
    assert [int(f.stamps[r]) for r in f.rows_of(key)] == [raw[5][1]]
    got = store.search(("m",), query="violet", limit=2)
    assert sorted(i.key for i in got) == ["1", "2"]
    assert [i.score for i in got] == pytest.approx([1.0, 1.0], abs=1e-5)


def test_items_of_equal_score_are_all_found_however_many(kv: kvcomm.Client) -> None:
    """Many rows of one score (the same text) and a small namespace among a large one:
    the candidate rows are walked in rounds, none skipped at a round's edge."""
    store = KVCommStore(kv, index=index_config())
    for i in range(150):
        store.put(("big",), f"{i:03}", {"text": "apple"})
    for i in range(70):
        store.put(("t",), f"{i:03}", {"text": "apple"})
    store.put(("t",), "zz", {"text": "apple pear"})
    got = store.search(("t",), query="apple", limit=100)
    assert len(got) == 71 and {i.key for i in got} == {f"{i:03}" for i in range(70)} | {"zz"}
    assert got[-1].key == "zz" and got[0].score == pytest.approx(1.0, abs=1e-5)
    assert len(store.search(("big",), query="apple", limit=200)) == 150


def test_without_numpy_the_error_says_what_to_install(kv: kvcomm.Client,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "numpy", None)  # (import numpy now fails)
    from kvcomm._extras import install_hint

    with pytest.raises(kvcomm.ConfigError, match=re.escape(install_hint("numpy"))):
        KVCommStore(kv, index=index_config())


# ---------------------------------------------------------------- vectors and ttl together


def test_an_item_with_a_ttl_and_vectors_keeps_both(kv: kvcomm.Client) -> None:
    """One record holds the ttl (minutes, 5th) and the vectors (6th); a re-put keeps
    created_at; a search with refresh_ttl gives the items it returns their ttl again
    (without it, not); an expired item is never a search result."""
    store = KVCommStore(kv, index=index_config())
    key = store.keys.item(("m",), "1")
    store.put(("m",), "1", {"text": "tiger maple"}, ttl=2)
    raw = kv.get(key)
    assert len(raw) == 6 and raw[4] == 2.0 and raw[5][2][0][0] == "text"
    e1 = kv.get_item(key).expires_at
    assert e1 is not None and time.time() + 119 < e1 <= time.time() + 120
    created = store.get(("m",), "1", refresh_ttl=False).created_at
    t0 = time.time()
    wait_until(lambda: time.time() > t0 + 0.05, 5, "the clock to move")
    got = store.search(("m",), query="tiger", refresh_ttl=False)
    assert [i.key for i in got] == ["1"] and got[0].score is not None
    assert kv.get_item(key).expires_at == e1
    assert [i.key for i in store.search(("m",), query="tiger")] == ["1"]  # (refreshes)
    e2 = kv.get_item(key).expires_at
    assert e2 > e1 + 0.04
    store.put(("m",), "1", {"text": "orbit"}, ttl=None)  # (no ttl now; vectors replaced)
    raw = kv.get(key)
    assert len(raw) == 6 and raw[4] is None and kv.get_item(key).expires_at is None
    assert store.get(("m",), "1").created_at == created
    assert store.search(("m",), query="orbit")[0].score == pytest.approx(1.0, abs=1e-5)
    store.put(("m",), "2", {"text": "tiger"}, ttl=1, index=False)  # (ttl only: 5 elements)
    assert kv.get(store.keys.item(("m",), "2"))[4:] == [1.0]
    store.put(("m",), "short", {"text": "tiger"}, ttl=0.01)  # 0.6 s
    assert store.search(("m",), query="tiger", refresh_ttl=False)[0].key == "short"
    wait_until(lambda: store.get(("m",), "short", refresh_ttl=False) is None, 20,
               "the item to expire")
    assert [(i.key, i.score is None) for i in store.search(("m",), query="tiger")] == [
        ("1", False), ("2", True)]


def test_records_of_the_older_layouts_are_read_and_bad_ones_refused(kv: kvcomm.Client) -> None:
    """``[type, bytes, created, updated, ttl]`` (no vectors) and ``[..., vectors]`` (no
    ttl) are read; a 5th or 6th element of the wrong kind is CorruptRecord."""
    store = KVCommStore(kv, index=index_config())
    sem = store._sem
    assert sem is not None
    t, b = store.serde.dumps_typed({"text": "amber"})
    kv.put(store.keys.item(("o",), "ttl"), [t, b, 1, 2, 5])
    store.put(("o",), "vec", {"text": "amber"})  # (its rows in the host's index)
    part = kv.get(store.keys.item(("o",), "vec"))[5]
    kv.put(store.keys.item(("o",), "vec"), [t, b, 1, 2, part])  # (same vectors and stamp)
    assert store.get(("o",), "ttl").value == {"text": "amber"}
    got = store.search(("o",), query="amber")
    assert [(i.key, i.score is None) for i in got] == [("vec", False), ("ttl", True)]
    for bad in ([t, b, 1, 2, None], [t, b, 1, 2, "x"], [t, b, 1, 2, 0], [t, b, 1, 2, 5, None],
                [t, b, 1, 2, -1, part], [t, b, 1, 2, None, part, 1]):
        kv.put(store.keys.item(("bad",), "k"), bad)
        with pytest.raises(kvcomm.CorruptRecord, match="not one KVCommStore wrote"):
            store.get(("bad",), "k")


def test_abatch_with_an_index_is_native_on_an_aio_client(ns: str, config: kvcomm.Config) -> None:
    """On a ``kvcomm.aio`` client, an indexed store's async methods embed in the loop and
    run the rest on it: the loop's default executor is never used."""
    import kvcomm.aio
    from tests.integrations.test_langgraph import _NoExecutor

    async def aembed(texts: list[str]) -> list[list[float]]:
        return fake_embed(texts)

    async def run() -> tuple[Any, ...]:
        asyncio.get_running_loop().set_default_executor(_NoExecutor(1))
        async with kvcomm.aio.open(ns, config=config) as akv:
            store = KVCommStore(akv, index={"dims": DIMS, "embed": aembed, "fields": ["text"]})
            await store.aput(("u",), "1", {"text": "maple river"}, ttl=1)
            await store.aput(("u",), "2", {"text": "orbit ember"})
            found = await store.asearch(("u",), query="river maple", limit=1)
            raw = await akv.get(store.keys.item(("u",), "1"))
            return found, raw, akv.off_loop

    found, raw, off_loop = asyncio.run(run())
    assert [i.key for i in found] == ["1"] and found[0].score == pytest.approx(1.0, abs=1e-5)
    assert raw[4] == 1.0 and len(raw) == 6 and off_loop == 0


@pytest.mark.parametrize("stamp", [-1, 0, 2**63, 2**64 - 1])  # (msgpack stores no more)
def test_a_record_with_a_stamp_out_of_range_is_refused_and_poisons_nothing(
        kv: kvcomm.Client, stamp: int) -> None:
    """A record's vectors part whose stamp is not one record_part draws (1 .. 2**63 - 1)
    is a malformed record (CorruptRecord to the search that meets it), not a row to
    repair: before, the repair raised under the vector file's intent, which then named
    the key for every later writer, and no indexed put of any item succeeded on the host
    again (found by the adversary's review)."""
    store = KVCommStore(kv, index=index_config())
    store.put(("m",), "1", {"text": "apple"})
    store.put(("m",), "2", {"text": "violet"})
    sem = store._sem
    assert sem is not None and sem.file is not None
    key = store.keys.item(("m",), "1")
    part = sem.record_part(["text"], sem.blobs(fake_embed(["violet"])))
    part[1] = stamp
    kv.put(key, [*kv.get(key)[:4], part])  # a hostile (or buggy) writer
    with pytest.raises(kvcomm.CorruptRecord):
        store.search(("m",), query="violet", limit=2)
    assert int(sem.file.hdr[H_INTENT]) == 0
    store.put(("m",), "3", {"text": "amber"})  # an unrelated item: indexed as ever
    assert [i.key for i in store.search(("m",), query="amber", limit=1)] == ["3"]


def test_blobs_are_unit_rows_as_numpy_makes_them(kv: kvcomm.Client) -> None:
    """blobs (the C pass for a list of floats, struct and NumPy for anything else) agree
    with unit() (NumPy's float32 rows) within float32 rounding, whatever the numbers:
    zero, tiny, huge, inf and nan vectors, ints, bools, NumPy scalars, tuples, arrays."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from kvcomm import _l2core

    store = KVCommStore(kv, index=index_config())
    sem = store._sem
    assert sem is not None
    special = st.sampled_from([0.0, -0.0, 1e-45, 1e-30, 1e-20, 1e19, 1e20, 3.4e38, 3.5e38,
                               1e300, float("inf"), -float("inf"), float("nan")])
    number = st.one_of(st.floats(-1e6, 1e6), st.floats(allow_nan=True, allow_infinity=True),
                       special, st.integers(-1000, 1000), st.booleans())
    vector = st.one_of(st.lists(number, min_size=DIMS, max_size=DIMS),
                       st.lists(st.floats(-1e6, 1e6), min_size=DIMS, max_size=DIMS),
                       st.lists(special, min_size=DIMS, max_size=DIMS))
    shape = st.sampled_from(["list", "tuple", "array", "np-scalars"])

    @settings(max_examples=400, deadline=None)
    @given(vector, shape)
    def check(v: list[Any], how: str) -> None:
        given_v: Any = {"list": v, "tuple": tuple(v),
                        "array": np.asarray(v, dtype=np.float64),
                        "np-scalars": [np.float64(x) for x in v]}[how]
        with np.errstate(all="ignore"):
            want = sem.unit([v])[0]
            got = np.frombuffer(sem.blobs([given_v])[0], dtype="<f4")
        assert got.shape == want.shape
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6, equal_nan=True), (v, got, want)
        fast = _l2core.unit_f32(given_v, DIMS)
        if fast is not None:  # (the C pass: a unit row, of finite numbers)
            row = np.frombuffer(fast, dtype="<f4")
            assert np.isfinite(row).all() and abs(float(np.linalg.norm(row)) - 1) < 1e-5

    check()
    assert _l2core.unit_f32([1.0] * (DIMS - 1), DIMS) is None, "not of dims numbers"
    with pytest.raises(kvcomm.ConfigError, match="dimensions"):
        sem.blobs([[1.0] * (DIMS + 1)])


def _putter(ns: str, cfg: dict[str, Any], seed: int, n: int) -> None:
    kv = kvcomm.open(ns, config=kvcomm.Config.from_mapping(cfg))
    try:
        store = KVCommStore(kv, index=index_config())
        rng = random.Random(seed)
        for _ in range(n):
            k = str(rng.randrange(40))
            if rng.random() < 0.1:
                store.delete(("m",), k)
            else:
                store.put(("m",), k, {"text": " ".join(rng.choices(WORDS, k=2)),
                                      **({"extra": "also " + rng.choice(WORDS)}
                                         if rng.random() < 0.3 else {})})
    finally:
        kv.close()
    os._exit(0)


@pytest.mark.multiprocess
def test_writers_of_several_processes_keep_the_rows_in_step(
        kv: kvcomm.Client, ns: str, seed: int) -> None:
    """Three processes put and delete the same 40 items at once (one and two vectors each):
    the file's mutex serializes them, and every item's rows end as its record says."""
    import multiprocessing as mp

    from tests.support.helpers import SMALL

    store = KVCommStore(kv, index=index_config())
    store.put(("m",), "0", {"text": "apple"})  # (the file made, by this version)
    assert store._sem is not None and store._sem.file is not None
    f = store._sem.file
    assert f._mutex
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_putter, args=(ns, SMALL, seed + i, 300)) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert int(f.hdr[H_INTENT]) == 0
    for i in range(40):
        key = store.keys.item(("m",), str(i))
        raw = kv.get(key)
        rows = f.rows_of(key.encode())
        if raw is None or len(raw) < 6:
            assert rows == [], (i, rows)
            continue
        assert [int(f.stamps[r]) for r in rows] == [raw[5][1]] * len(raw[5][2]), i
        want = np.frombuffer(b"".join(b for _p, b in raw[5][2]), dtype="<f4")
        assert np.array_equal(np.concatenate([f.matrix[r] for r in rows]), want), i


def test_a_users_first_mistakes_get_clear_errors_and_store_nothing(kv: kvcomm.Client) -> None:
    """A value that is not a dict, a namespace given as a str, an embedding function that
    returns None or a vector holding NaN or a number beyond float32: each raises a
    kvcomm error that says what to do, and nothing is stored (no record, no row)."""
    bad_vector: list[float] = [0.1] * DIMS

    def embed(texts: list[str]) -> Any:
        if texts == ["none"]:
            return None
        return [bad_vector for _t in texts] if texts[0].startswith("bad") else fake_embed(texts)

    store = KVCommStore(kv, index={"dims": DIMS, "embed": embed, "fields": ["text"]})
    ns = ("user", "1")
    with pytest.raises(kvcomm.InvalidArgument, match="value is a dict"):
        store.put(ns, "a", "just text")  # type: ignore[arg-type]
    with pytest.raises(kvcomm.InvalidArgument, match="tuple of str labels"):
        store.put("mem", "a", {"text": "x"})  # type: ignore[arg-type]
    with pytest.raises(kvcomm.ConfigError, match="returned a NoneType"):
        store.put(ns, "a", {"text": "none"})
    for poison in (float("nan"), float("inf"), 1e39):
        bad_vector = [0.1] * (DIMS - 1) + [poison]
        with pytest.raises(kvcomm.ConfigError, match="NaN or a number beyond float32"):
            store.put(ns, "a", {"text": "bad"})
        with pytest.raises(kvcomm.ConfigError, match="NaN or a number beyond float32"):
            store.batch([PutOp(ns, "b", {"text": "bad"}), PutOp(ns, "c", {"text": "ok"})])
    assert store.get(ns, "a") is None and store.get(ns, "b") is None
    assert store.get(ns, "c") is None and store.search(("user",), query="ok") == []
    store.put(ns, "a", {"text": "fine"})
    assert [i.key for i in store.search(("user",), query="fine")] == ["a"]


def test_a_batch_checks_every_op_before_any_runs_or_is_embedded(kv: kvcomm.Client) -> None:
    """A batch whose later op is bad (a value not a dict, a ttl not in minutes, a key too
    long, a search's negative limit) raised only when that op ran, the earlier puts
    written, and embedded its texts first (a paid call); superseded puts of one item were
    embedded too, which InMemoryStore never does. Now all is checked first, nothing runs
    or is embedded for a bad batch, and only the puts that run are embedded."""
    calls: list[list[str]] = []

    def embed(texts: list[str]) -> Any:
        calls.append(list(texts))
        return fake_embed(texts)

    ns = ("u",)
    for semantic in (False, True):
        store = KVCommStore(kv, root=f"chk{int(semantic)}/", index={
            "dims": DIMS, "embed": embed, "fields": ["text"]} if semantic else None)
        for bad, err in ((PutOp(ns, "b", "notadict"), kvcomm.InvalidArgument),  # type: ignore[arg-type]
                         (PutOp(ns, "b", {"text": "x"}, ttl=-5), kvcomm.InvalidArgument),
                         (PutOp(ns, "b", {"text": "x"}, ttl="x"), kvcomm.InvalidArgument),  # type: ignore[arg-type]
                         (PutOp(ns, "k" * 600, {"text": "x"}), kvcomm.InvalidKey),
                         (GetOp(ns, "k" * 600), kvcomm.InvalidKey),
                         (SearchOp(ns, None, -1, 0), kvcomm.InvalidArgument)):
            with pytest.raises(err):
                store.batch([PutOp(ns, "a", {"text": "first"}), bad])
            assert store.get(ns, "a") is None and calls == []
        class Weird:
            namespace = ns

        with pytest.raises(kvcomm.InvalidArgument, match="unknown LangGraph store operation"):
            store.batch([PutOp(ns, "a", {"text": "first"}), Weird()])  # type: ignore[list-item]
        assert store.get(ns, "a") is None and calls == []
        store.batch([PutOp(ns, "a", {"text": f"v{i}"}) for i in range(5)]
                    + [PutOp(ns, "a", {"text": "last"}), PutOp(ns, "z", None)])
        assert calls == ([["last"]] if semantic else [])
        assert store.get(ns, "a").value == {"text": "last"}  # type: ignore[union-attr]
        calls.clear()
