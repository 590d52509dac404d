"""The host key filter: trusted only while its daemon beats, rebuilt without SIGBUS,
refused when another user owns it."""

from __future__ import annotations

import multiprocessing as mp
import os
import pathlib
import stat
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xxhash import xxh3_128_digest

import kvcomm
from kvcomm._l2core import bloom_has
from kvcomm.core.bloom import BloomFilter
from kvcomm.tiers import keyfilter, l2
from kvcomm.tiers.keyfilter import STALE_MS, KeyFilter, filter_path
from tests.support.daemon_harness import Host, record, shared_cluster_fixture, store_fixture  # noqa: F401
from tests.support.helpers import wait_for

CTX = mp.get_context("fork")


@pytest.fixture
def fname() -> Iterator[str]:
    name = f"kf-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    keyfilter.remove(name)
    for leftover in (filter_path(name),):
        if os.path.exists(leftover):
            os.unlink(leftover)


def test_trusted_only_while_the_daemon_beats(fname: str) -> None:
    w = KeyFilter.create(fname, 1000, 0.01)
    r = KeyFilter.open_reader(fname)
    try:
        assert r is not None
        assert not r.ready  # being built
        w.add(b"k")
        w.set_ready(True)
        w.beat(now_ms=1_000_000)
        assert r.trusted(now_ms=1_000_000 + STALE_MS - 1)
        assert not r.trusted(now_ms=1_000_000 + STALE_MS + 1)  # the daemon stopped beating
        w.beat()
        assert r.ready and r.may_exist(b"k") and not r.may_exist(b"other")
    finally:
        w.close()
        if r is not None:
            r.close()


def test_a_reader_takes_its_geometry_from_the_file(fname: str) -> None:
    w = KeyFilter.create(fname, 12_345, 0.0123)
    r = KeyFilter.open_reader(fname)
    try:
        assert r is not None and (r.capacity, r.fpr) == (12_345, 0.0123)
        assert os.path.getsize(filter_path(fname)) == KeyFilter.size_for(12_345, 0.0123)
    finally:
        w.close()
        if r is not None:
            r.close()


def test_new_files_are_owner_only_whatever_the_umask(fname: str) -> None:
    old = os.umask(0)
    try:
        w = KeyFilter.create(fname, 100, 0.01, permissions=0o600)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(filter_path(fname)).st_mode) == 0o600
        assert not [p for p in os.listdir("/dev/shm") if p.startswith(f"kvcomm.{fname}.keys.")]
    finally:
        w.close()


def _reader(name: str, conn: object, capacity: int) -> None:
    """A reader mapped at the old size: it touches every byte of its mapping while the
    daemon replaces the file, then reopens and reports the capacity it finds."""
    r = KeyFilter.open_reader(name)
    assert r is not None and r.capacity == capacity
    conn.send("mapped")  # type: ignore[attr-defined]
    seen_retired = False
    for _ in range(200_000):
        for g in r.gens:  # every page of the old mapping, beyond the new file's size
            _ = bytes(g._b[-4096:])
            _ = bytes(g._b[:64])
        r.may_exist(b"k")
        if r.retired:
            seen_retired = True
            break
    r.close()

    def placed() -> KeyFilter | None:  # (the old file is retired just before the new one
        f = KeyFilter.open_reader(name)  # is renamed into place: reopen until it is there)
        if f is not None and f.retired:
            f.close()
            return None
        return f

    new = wait_for(placed, what="the new filter in place")
    conn.send((seen_retired, new.capacity))  # type: ignore[attr-defined]


def test_resizing_never_sigbuses_a_reader_and_the_reader_picks_up_the_new_file(fname: str) -> None:
    big, small = 400_000, 1000  # the new file is far smaller than the old mapping
    w = KeyFilter.create(fname, big, 0.001)
    w.set_ready(True)
    w.beat()
    parent, child = CTX.Pipe()
    p = CTX.Process(target=_reader, args=(fname, child, big))
    p.start()
    try:
        assert parent.poll(30) and parent.recv() == "mapped"
        w2 = KeyFilter.create(fname, small, 0.001)  # the daemon restarts with another size
        w.close()
        w2.set_ready(True)
        w2.beat()
        assert parent.poll(60)
        seen_retired, capacity = parent.recv()
        p.join(30)
        assert p.exitcode == 0, f"reader died with {p.exitcode} (-7 is SIGBUS)"
        assert seen_retired
        assert capacity == small
        w2.close()
    finally:
        if p.is_alive():
            p.kill()
            p.join()


def test_a_file_of_another_user_is_refused(fname: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to chown a file to another user")
    w = KeyFilter.create(fname, 100, 0.01)
    w.close()
    os.chown(filter_path(fname), 65534, 65534)
    with pytest.raises(kvcomm.SegmentError, match=r"uid 65534.*mode 0o600"):
        KeyFilter.open_reader(fname)
    with pytest.raises(kvcomm.SegmentError, match="uid 65534"):
        KeyFilter.create(fname, 100, 0.01)  # the daemon does not take it over either
    assert os.stat(filter_path(fname)).st_uid == 65534
    assert not [p for p in os.listdir("/dev/shm") if p.startswith(f"kvcomm.{fname}.keys.")]


def test_a_file_with_a_wider_mode_is_refused_by_readers(fname: str) -> None:
    w = KeyFilter.create(fname, 100, 0.01)
    os.chmod(filter_path(fname), 0o666)
    try:
        with pytest.raises(kvcomm.SegmentError, match=r"mode 0o666.*at most mode 0o600"):
            KeyFilter.open_reader(fname, permissions=0o600)
        r = KeyFilter.open_reader(fname, permissions=0o666)  # as configured: accepted
        assert r is not None
        r.close()
    finally:
        w.close()
    w = KeyFilter.create(fname, 100, 0.01, permissions=0o600)  # the daemon replaces it
    w.close()
    assert stat.S_IMODE(os.stat(filter_path(fname)).st_mode) == 0o600


def test_a_symlink_is_refused(fname: str, tmp_path: object) -> None:
    target = os.path.join(str(tmp_path), "elsewhere")
    open(target, "wb").close()
    os.symlink(target, filter_path(fname))
    try:
        with pytest.raises(kvcomm.SegmentError, match="symbolic link"):
            KeyFilter.open_reader(fname)
        with pytest.raises(kvcomm.SegmentError):
            KeyFilter.create(fname, 100, 0.01)
    finally:
        os.unlink(filter_path(fname))


def _temps(fname: str) -> list[str]:
    """The filter's temporary files (whatever their naming)."""
    base = os.path.basename(filter_path(fname))
    return [n for n in os.listdir(os.path.dirname(filter_path(fname)))
            if base + "." in n and n.endswith(".tmp")]


def test_stale_temporary_files_are_cleaned_up(fname: str) -> None:
    # a daemon killed while building a filter: its temporary file is locked no more (the
    # pid in its name, this live one's, changes nothing: pids are no proof across PID
    # namespaces)
    path = filter_path(fname)
    stale = os.path.join(os.path.dirname(path),
                         f".{os.path.basename(path)}.{os.getpid()}.deadbeef.tmp")
    open(stale, "wb").close()
    w = KeyFilter.create(fname, 100, 0.01)
    w.close()
    assert not os.path.exists(stale)
    assert not _temps(fname)


def test_an_interrupted_create_leaves_nothing(fname: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while the daemon builds its filter (here: as the mapping is wrapped) leaves
    no temporary file behind, and the next daemon's filter works."""
    def interrupted(*a: object, **k: object) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(KeyFilter, "__init__", interrupted)
        with pytest.raises(KeyboardInterrupt):
            KeyFilter.create(fname, 100, 0.01)
    assert not os.path.exists(filter_path(fname))
    assert not _temps(fname)
    w = KeyFilter.create(fname, 100, 0.01)
    w.close()
    r = KeyFilter.open_reader(fname)
    assert r is not None
    r.close()


def test_a_closed_daemon_filter_is_untrusted_at_once(fname: str) -> None:
    w = KeyFilter.create(fname, 100, 0.01)
    w.set_ready(True)
    w.beat()
    r = KeyFilter.open_reader(fname)
    assert r is not None and r.ready
    keyfilter.remove(fname)  # a purge: readers mapping it stop trusting it
    assert not r.ready and r.retired
    r.close()
    w.close()


def _cluster_client(ns: str) -> kvcomm.Client:
    """A cluster-mode agent whose L3 cannot be reached: any read that leaves the host
    raises Unavailable, so a None proves the key filter answered."""
    return kvcomm.open(ns, config=kvcomm.Config.from_mapping({
        "node": {"namespace": ns}, "cache": {"l2_size": "4MB", "watch_buffer": 1024,
                                             "negative_ttl": 0},
        "cluster": {"redis": ["127.0.0.1:1"], "timeout": 0.2}}), wait_daemon=False)


def test_an_agent_trusts_the_filter_only_while_the_daemon_beats(ns: str) -> None:
    w = KeyFilter.create(ns, 1000, 0.001)
    kv = _cluster_client(ns)
    try:
        w.set_ready(True)
        w.beat()
        assert kv.get("surely/absent") is None  # answered by the filter: L3 is unreachable
        assert kv.stats()["l3"]["filter_hits"] == 1
        w.beat(now_ms=1)  # the daemon's last beat is long past: it is dead
        with pytest.raises(kvcomm.Unavailable):
            kv.get("surely/absent")  # so the agent asks L3 (unreachable here)
    finally:
        kv.close()
        w.close()


def test_an_agent_refuses_a_filter_of_another_user(ns: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to chown a file to another user")
    w = KeyFilter.create(ns, 1000, 0.001)
    w.set_ready(True)
    w.beat()
    w.close()
    os.chown(filter_path(ns), 65534, 65534)
    kv = _cluster_client(ns)
    try:
        for _ in range(2):  # every time, not once a second
            with pytest.raises(kvcomm.SegmentError, match="uid 65534"):
                kv.get("k")
    finally:
        kv.close()
        os.unlink(filter_path(ns))


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 5000), fpr=st.sampled_from([0.5, 0.1, 0.01, 0.001, 1e-6]),
       added=st.lists(st.binary(max_size=40), max_size=60),
       probes=st.lists(st.binary(max_size=40), max_size=60))
def test_c_membership_agrees_with_the_python_filter(capacity: int, fpr: float,
                                                    added: list[bytes], probes: list[bytes]) -> None:
    # agents test in C (bloom_has), the daemon adds in Python (BloomFilter): same positions
    gens = [BloomFilter(capacity, fpr), BloomFilter(capacity, fpr)]
    for i, key in enumerate(added):
        gens[i % 2].add(key)
    both = bytes(gens[0]._b) + bytes(gens[1]._b)
    for key in added + probes:
        expected = key in gens[0] or key in gens[1]
        got = bloom_has(both, gens[0].bits, gens[0].k, 2, xxh3_128_digest(key))
        assert got == expected, key
        assert bloom_has(bytes(gens[0]._b), gens[0].bits, gens[0].k, 1,
                         xxh3_128_digest(key)) == (key in gens[0])
    for key in added:
        assert bloom_has(both, gens[0].bits, gens[0].k, 2, xxh3_128_digest(key))


def test_c_membership_rejects_a_short_buffer_and_bad_geometry() -> None:
    d = xxh3_128_digest(b"k")
    with pytest.raises(ValueError):
        bloom_has(bytes(8), 128, 3, 1, d)  # 16 bytes needed
    with pytest.raises(ValueError):
        bloom_has(bytes(64), 100, 3, 1, d)  # not a multiple of 64
    with pytest.raises(ValueError):
        bloom_has(bytes(64), 64, 0, 1, d)
    with pytest.raises(TypeError):
        bloom_has(bytes(64), 64, 3, 1, b"short")


def test_two_rotations_forget_a_deleted_key_and_keep_the_rest(fname: str) -> None:
    kf = KeyFilter.create(fname, 1000, 0.001)
    try:
        kf.add(b"deleted")
        kf.add(b"kept")
        for rotation in range(2):
            kf.begin_rotation()
            assert kf.may_exist(b"kept")  # the current generation answers meanwhile
            assert kf.may_exist(b"deleted") == (rotation == 0)  # until refilled without it
            kf.add(b"kept")  # the refill: only keys that still exist
            kf.end_rotation()
            assert kf.adds_since_rotation == 1
        assert kf.may_exist(b"kept") and not kf.may_exist(b"deleted")
    finally:
        kf.close()


def test_the_ring_says_which_keys_were_learned_since_a_stamp(fname: str) -> None:
    w = KeyFilter.create(fname, 1000, 0.01)
    r = KeyFilter.open_reader(fname)
    try:
        assert r is not None
        w.add(b"old")
        stamp = r.learned
        assert r.learned_since(b"old", stamp) is False  # (nothing learned since)
        w.add(b"a")
        w.add(b"b")
        assert r.learned == (stamp + 2) % (1 << 64)
        assert r.learned_since(b"a", stamp) and r.learned_since(b"b", stamp)
        assert r.learned_since(b"old", stamp) is False and not r.learned_since(b"c", stamp)
        assert r.learned_since(b"b", stamp + 1) and not r.learned_since(b"a", stamp + 1)
        # a stamp the ring no longer covers, or another file's: unknown (the filter judges)
        for i in range(keyfilter.RING):
            w.add(b"x%d" % i)
        assert r.learned_since(b"a", stamp) is None
        assert r.learned_since(b"x5", r.learned - keyfilter.RING) is True
        other = KeyFilter.create(fname + "2", 1000, 0.01)
        try:
            assert other.learned_since(b"a", stamp) is None
        finally:
            other.close()
            keyfilter.remove(fname + "2")
    finally:
        w.close()
        if r is not None:
            r.close()


def test_the_ring_wraps_around_its_end(fname: str) -> None:
    w = KeyFilter.create(fname, 1000, 0.01)
    try:
        w._q[keyfilter.H_LEARNED] = 5 * keyfilter.RING - 2  # two slots before the end
        stamp = w.learned
        for k in (b"p", b"q", b"r", b"s"):
            w.add(k)
        assert all(w.learned_since(k, stamp) for k in (b"p", b"q", b"r", b"s"))
        assert not w.learned_since(b"t", stamp)
        assert w.learned_since(b"p", stamp + 1) is False and w.learned_since(b"s", stamp + 3)
    finally:
        w.close()


def test_a_negative_note_the_ring_no_longer_covers_is_judged_by_the_filter(fname: str) -> None:
    """ClusterReads._still_absent past the ring: the key in the filter now and not when
    noted was learned (read again); one the filter matched already when noted (deleted,
    a false positive) keeps its note; one it still does not match keeps it, restamped;
    with the filter untrusted, the note holds, unstamped, until it is trusted again."""
    from types import SimpleNamespace

    from kvcomm._client.cluster_read import ClusterReads

    w = KeyFilter.create(fname, 200_000, 0.001)  # (room for the ring's keys: no false match)
    r = KeyFilter.open_reader(fname)
    try:
        assert r is not None
        w.set_ready(True)
        w.add(b"deleted")  # (in the filter before the notes)
        trusted: list[Any] = [r]
        reader = SimpleNamespace(_kf=r, _key_filter=lambda: trusted[0])
        stamp = r.learned
        notes = {k: [0.0, stamp, k == "deleted"] for k in ("new", "deleted", "never")}
        for i in range(keyfilter.RING + 1):  # the ring no longer reaches back to the notes
            w.add(b"other%d" % i)
        w.add(b"new")
        assert r.learned_since(b"new", stamp) is None
        trusted[0] = None  # untrusted: every note holds, none restamped
        assert all(ClusterReads._still_absent(reader, k, n)  # type: ignore[arg-type]
                   for k, n in notes.items())
        assert all(n[1] == stamp for n in notes.values())
        trusted[0] = r
        assert not ClusterReads._still_absent(reader, "new", notes["new"])  # type: ignore[arg-type]
        assert ClusterReads._still_absent(reader, "deleted", notes["deleted"])  # type: ignore[arg-type]
        assert ClusterReads._still_absent(reader, "never", notes["never"])  # type: ignore[arg-type]
        assert notes["never"][1] == notes["deleted"][1] == r.learned  # (restamped)
        w.add(b"deleted")  # learned again since the new stamp: the ring says so
        assert not ClusterReads._still_absent(reader, "deleted", notes["deleted"])  # type: ignore[arg-type]
        assert ClusterReads._still_absent(reader, "never", notes["never"])  # type: ignore[arg-type]
    finally:
        w.close()
        if r is not None:
            r.close()


def test_a_small_bloom_fpr_does_not_break_every_cluster_miss(cluster: object) -> None:
    """F (crash with a non-KVCommError on every L2 miss): cache.bloom_fpr is valid for any
    0 < fpr < 1, but below ~5e-20 the filter's hash count k exceeds 64 and the C
    membership test (bloom_has) raises ValueError for every key the negative cache does
    not answer: kv.get of a missing key raises ValueError in every agent of the host.

    Fixed by refusing such a rate in the config (ConfigError naming cache.bloom_fpr); a
    rate just inside the bound (k = 63) answers a cluster miss.
    (found in review 8: data)"""
    from kvcomm.core.bloom import MAX_HASHES, optimal_params

    with pytest.raises(kvcomm.ConfigError, match="cache.bloom_fpr"):
        Host(cluster, "host-1", seed=1, bloom_fpr=1e-20, bloom_capacity=1000)  # type: ignore[arg-type]
    assert optimal_params(1000, 1e-19)[1] == MAX_HASHES - 1
    h1 = Host(cluster, "host-1", seed=1, bloom_fpr=1e-19, bloom_capacity=1000)  # type: ignore[arg-type]
    try:
        h1.kv.put("present", b"1")
        wait_for(lambda: h1.kv._key_filter() is not None, 20, "the key filter is trusted")
        assert h1.kv.get("absent/1") is None
        assert h1.kv.stats()["l3"]["filter_hits"] >= 1  # the filter answered it
    finally:
        h1.close()


def test_keyfilter_reader_refuses_a_hash_count_bloom_has_cannot_use(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same, without a cluster: a filter file whose header (capacity, fpr) gives k > 64.
    KeyFilter.create refuses such a geometry (InvalidArgument); a file made by a daemon
    that allowed it (MAX_HASHES raised here) is refused by the reader with SegmentError,
    not a ValueError at every membership test.
    (found in review 8: data)"""
    from kvcomm.tiers import keyfilter
    from kvcomm.tiers.keyfilter import KeyFilter

    with pytest.raises(kvcomm.InvalidArgument):
        KeyFilter.create("bf", 1000, 1e-20, directory=str(tmp_path))
    monkeypatch.setattr(keyfilter, "MAX_HASHES", 128)  # another KVCOMM's daemon
    w = KeyFilter.create("bf", 1000, 1e-20, directory=str(tmp_path))
    monkeypatch.undo()
    w.set_ready(True)
    w.beat()
    try:
        with pytest.raises(kvcomm.SegmentError, match="hash functions"):
            KeyFilter.open_reader("bf", directory=str(tmp_path))
    finally:
        w.close()


def test_a_key_filter_closed_by_another_thread_does_not_raise_valueerror(
        tmp_path: pathlib.Path, ns: str) -> None:
    """F (non-KVCommError, threads): ClusterReads._get_l3 takes kf = self._key_filter()
    and then calls kf.may_exist(). Another thread sharing the client that calls
    _key_filter() in between, when the filter just became untrusted (heartbeat stale,
    retired by a restarted daemon), closes that same KeyFilter; the first thread's
    may_exist then raises ValueError ("operation forbidden on released memoryview").
    The interleaving is replayed here step by step.
    (found in review 8: data)"""
    from kvcomm.tiers.keyfilter import KeyFilter

    raw = {"cache": {"l2_size": "16MB", "l2_dir": str(tmp_path)},
           "cluster": {"redis": ["127.0.0.1:1"]}, "node": {"host_id": "host-a"}}
    w = KeyFilter.create(ns, 1000, 0.01, directory=str(tmp_path))
    w.set_ready(True)
    w.beat()
    with kvcomm.open(ns, config=kvcomm.Config.from_mapping(raw), wait_daemon=False) as kv:
        kf = kv._key_filter()  # thread A, in _get_l3
        assert kf is not None
        w.set_ready(False)  # the daemon restarts (or stops beating)
        kv._kf_retry = 0.0
        kv._key_filter()  # thread B, in its own _get_l3: closes kf
        try:
            kf.may_exist(b"absent")  # thread A continues
        except kvcomm.KVCommError:
            pass
    w.close()
    l2.purge(ns, str(tmp_path))
