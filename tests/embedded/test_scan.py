"""kv.scan's contract in embedded mode, as a user meets it: order, pages, deletes, other
processes' writes, concurrent writers, and the ordered index kept in step by the feed."""

from __future__ import annotations

import multiprocessing as mp
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvcomm
from kvcomm.core.sortedkeys import SortedKeys
from tests.support.helpers import drawn_seed

CTX = mp.get_context("fork")


def pages(kv: kvcomm.Client, prefix: str, limit: int) -> list[list[str]]:
    out: list[list[str]] = []
    after = None
    while True:
        page = [i.key for i in kv.scan(prefix, limit=limit, after=after)]
        assert len(page) <= limit
        if not page:
            return out
        out.append(page)
        after = page[-1]


def utf8_sorted(keys: set[str]) -> list[str]:
    return sorted(keys, key=lambda k: k.encode("utf-8"))


def test_scan_is_ordered_by_utf8_bytes_and_sees_only_the_prefix(kv: kvcomm.Client) -> None:
    keys = {"z/1", "z/10", "z/2", "z/é", "z/\u4e2d", "z/\U0001f600", "z/Z", "z/", "za", "y/1"}
    for k in keys:
        kv.put(k, k.upper())
    items = list(kv.scan("z/"))
    assert [i.key for i in items] == utf8_sorted({k for k in keys if k.startswith("z/")})
    assert all(i.value == i.key.upper() and i.version is not None for i in items)
    assert [i.key for i in kv.scan()] == utf8_sorted(keys)
    assert list(kv.scan("nothing/")) == []


def test_pages_cover_every_key_once(kv: kvcomm.Client) -> None:
    for i in range(1000):
        kv.put(f"drone/{i:04d}", i)
        kv.put(f"shelf/{i:04d}", i)
    got = pages(kv, "drone/", 37)
    assert [len(p) for p in got[:-1]] == [37] * (len(got) - 1)
    flat = [k for p in got for k in p]
    assert flat == [f"drone/{i:04d}" for i in range(1000)]
    assert [i.key for i in kv.scan("drone/", after="drone/0997")] == ["drone/0998", "drone/0999"]
    # after below the prefix starts at the prefix; after past it ends at once
    assert next(kv.scan("drone/", after="a")).key == "drone/0000"
    assert list(kv.scan("drone/", after="e")) == []
    assert kv.keys("shelf/") == [f"shelf/{i:04d}" for i in range(1000)]


def test_deleted_keys_never_appear(kv: kvcomm.Client) -> None:
    for i in range(300):
        kv.put(f"k/{i:03d}", i)
    list(kv.scan("k/"))  # the index exists: the deletes below reach it through the feed
    for i in range(0, 300, 3):
        kv.delete(f"k/{i:03d}")
    assert [i.key for i in kv.scan("k/")] == [f"k/{i:03d}" for i in range(300) if i % 3]
    kv.put("k/000", "back")
    assert next(kv.scan("k/")).value == "back"


def test_a_key_deleted_while_a_scan_runs_is_skipped(kv: kvcomm.Client) -> None:
    for i in range(600):
        kv.put(f"k/{i:03d}", i)
    it = kv.scan("k/")
    assert next(it).key == "k/000"
    kv.delete("k/500")  # after the index was brought up to date: still never yielded
    rest = [i.key for i in it]
    assert "k/500" not in rest and len(rest) == 598


def test_bad_arguments(kv: kvcomm.Client) -> None:
    with pytest.raises(kvcomm.InvalidKey):
        kv.scan(5)  # type: ignore[arg-type]
    for bad in (0, -1, 1.5, True, "3"):
        with pytest.raises(kvcomm.InvalidArgument, match="page size"):
            kv.scan("", limit=bad)  # type: ignore[arg-type]
    with pytest.raises(kvcomm.InvalidArgument, match="last key"):
        kv.scan("", after=b"x")  # type: ignore[arg-type]
    kv.close()
    with pytest.raises(kvcomm.SegmentError, match="closed"):
        kv.scan("")


def _writer(ns: str, cfg: kvcomm.Config, first: int, n: int) -> None:
    with kvcomm.open(ns, config=cfg) as kv:
        for i in range(first, first + n):
            kv.put(f"p/{i:05d}", i)


def test_keys_written_by_other_processes_appear(ns: str, config: kvcomm.Config) -> None:
    with kvcomm.open(ns, config=config) as kv:
        assert list(kv.scan("p/")) == []  # this process's index is made now, empty
        procs = [CTX.Process(target=_writer, args=(ns, config, j * 500, 500)) for j in range(3)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        assert [i.key for i in kv.scan("p/")] == [f"p/{i:05d}" for i in range(1500)]
        assert [i.value for i in kv.scan("p/", limit=3, after="p/00499")] == [500, 501, 502]


def _churn(ns: str, cfg: kvcomm.Config, seed: int, stop: mp.synchronize.Event) -> None:
    rng = random.Random(seed)
    with kvcomm.open(ns, config=cfg) as kv:
        while not stop.is_set():
            k = f"c/{rng.randrange(400):03d}"
            if rng.random() < 0.5:
                kv.put(k, 1)
            else:
                kv.delete(k)


def test_concurrent_writes_never_hide_a_stable_key(ns: str, config: kvcomm.Config) -> None:
    """Every key written before the scan began and not deleted meanwhile appears, while
    other processes put and delete keys around it (the index follows their events, or is
    rebuilt when it fell a ring behind)."""
    seed = drawn_seed(1 << 30)
    stable = {f"c/{i:03d}x" for i in range(0, 400, 7)}  # keys the churners never touch
    with kvcomm.open(ns, config=config) as kv:
        for k in stable:
            kv.put(k, 0)
        stop = CTX.Event()
        procs = [CTX.Process(target=_churn, args=(ns, config, seed + j, stop)) for j in range(2)]
        for p in procs:
            p.start()
        try:
            index_rebuilds = []
            for _ in range(40):
                seen = [i.key for i in kv.scan("c/", limit=10_000)]
                assert seen == utf8_sorted(set(seen)), "out of order or twice"
                assert stable <= set(seen)
                for k in seen:  # what appears was live at some point: never a stale key
                    assert k in stable or len(k) == 5
                index_rebuilds.append(kv._attached.index.rebuilds)
                paged = {k for p in pages(kv, "c/", 13) for k in p}
                assert stable <= paged
        finally:
            stop.set()
            for p in procs:
                p.join(30)
        assert all(p.exitcode == 0 for p in procs)
        assert index_rebuilds[0] >= 1


def test_the_index_follows_the_feed_and_rebuilds_after_an_overflow(kv: kvcomm.Client) -> None:
    for i in range(100):
        kv.put(f"i/{i:03d}", i)
    list(kv.scan("i/"))
    index = kv._attached.index
    assert index.rebuilds == 1
    kv.put("i/new", 1)
    kv.delete("i/000")
    assert [i.key for i in kv.scan("i/", limit=2)] == ["i/001", "i/002"]
    assert index.rebuilds == 1 and index.events == 2  # two events applied, no walk
    feed = kv._seg.layout.feed_n
    for i in range(feed + 10):  # the index's cursor falls a whole ring behind
        kv.put(f"o/{i % 50}", i)
    kv.delete("i/001")
    assert next(kv.scan("i/")).key == "i/002"
    assert index.rebuilds == 2
    assert "i/new" in kv.keys("i/")


@given(st.lists(st.tuples(st.booleans(), st.text("ab/\u00e9\U0001f600", min_size=1, max_size=5)),
                max_size=300),
       st.text("ab/", max_size=2), st.text("ab/\u00e9", max_size=3), st.integers(1, 20))
def test_sorted_keys_is_a_sorted_set(ops: list[tuple[bool, str]], prefix: str, after: str,
                                     limit: int) -> None:
    import kvcomm.core.sortedkeys as sk

    old = sk.BLOCK
    sk.BLOCK = 2  # small blocks: every split and every emptied block is exercised
    try:
        s, ref = SortedKeys(), set()
        for add, k in ops:
            if add:
                s.add(k)
                ref.add(k)
            else:
                s.discard(k)
                ref.discard(k)
        want = utf8_sorted(ref)
        assert list(s) == want and len(s) == len(ref)
        assert all(k in s for k in ref)
        assert s.range(after, prefix, limit) == [k for k in want
                                                 if k.startswith(prefix) and k > after][:limit]
    finally:
        sk.BLOCK = old


def test_prefixes_and_afters_that_are_not_utf8_are_refused_as_arguments(kv: kvcomm.Client) -> None:
    """F9: a prefix (or ``after``) holding a lone surrogate made ``watch`` raise
    UnicodeEncodeError (no KVCommError; in cluster mode after leaving a half-made
    registration file) and a cluster ``scan`` raise CorruptRecord ("rename it", about a
    key that is only an argument). Both refuse it up front: InvalidKey for a prefix,
    InvalidArgument for ``after``.
    (found in review 13: kv.scan, cluster-wide kv.watch, LangGraph)"""
    with pytest.raises(kvcomm.InvalidKey, match="UTF-8"):
        kv.scan("a\ud800")
    with pytest.raises(kvcomm.InvalidArgument, match="UTF-8"):
        kv.scan("a", after="a\ud800")
    with pytest.raises(kvcomm.InvalidKey, match="UTF-8"):
        kv.watch("a\ud800")
