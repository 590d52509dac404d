"""REVIEW 8 (adversarial review of issue 8): the findings about ``kv.batch()`` (the C
``BatchOps`` and ``kvcomm._client.batch``), validators and the read path's hot-key flush.

Each test asserts what the project promises; every one of them failed on main at
4669990 for the reason its docstring gives (the reviewer's reproduction, kept as found).
"""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys
import time

import pytest
import yaml

import kvcomm
from kvcomm.tiers import l2
from tests.support.daemon_harness import Host, shared_cluster_fixture, store_fixture  # noqa: F401 (fixtures)
from tests.support.helpers import wait_for


def _run(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout)


# ----------------------------------------------------------------------------- batches

def test_batchops_without_init_does_not_segfault() -> None:
    """F: kvcomm.Batch (public) created without __init__ (a subclass that forgets
    super().__init__, or Batch.__new__) segfaults on put(): BatchOps fields are NULL."""
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
    the same batch again replays its old ops over newer writes."""
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
    """(The same rule when the block raised: the batch was discarded, not kept for later.)"""
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
    overwritten by the batch's stale "1"."""
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
    (and one that keeps adding, e.g. b.delete(key) in a delete's validator, never ends)."""
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
    InvalidArgument; it raises ValidationError."""
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
    a validator's own exception, whatever its type, is its verdict: ValidationError.)"""
    def v(key: str, old: object, new: object) -> None:
        raise kvcomm.InvalidArgument("the validator's own verdict")

    kv.register_validator("x/", v)
    with pytest.raises(kvcomm.ValidationError):
        kv.put("x/a", b"1")


def test_an_oversized_batch_in_embedded_mode_does_not_blame_l3(ns: str) -> None:
    """F (message): a batch of more new keys than a probe window can take, in embedded
    mode, says 'full of writes not yet in L3; retry after the node daemon syncs' —
    there is no L3 and no daemon. (A 16 MB namespace: the default one's slot table, sized
    for small keys, takes a 200,000-key batch whole.)"""
    with kvcomm.open(ns, config=kvcomm.Config.from_mapping({"cache": {"l2_size": "16MB"}})) as kv:
        with pytest.raises(kvcomm.Unavailable) as ei:
            with kv.batch() as b:
                for i in range(200_000):
                    b.put(f"h/{i}", b"x")
        assert "L3" not in str(ei.value) and "daemon" not in str(ei.value), str(ei.value)
        assert "split the batch" in str(ei.value), str(ei.value)


def test_batch_put_still_takes_keyword_arguments(kv: kvcomm.Client) -> None:
    """F (API regression): Batch.put(key, value) was a Python method; BatchOps.put is
    METH_FASTCALL without keywords: b.put(key="a", value=b"v") raises TypeError."""
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
    only comes at the end of the block."""
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
    (and that counts against cluster.outbound_max)."""
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
    or only in L3, leaves a tombstone that reaches L3, as kv.delete does.)"""
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


# ----------------------------------------------------------------------------- reads


def test_reads_stay_available_while_a_stopped_process_holds_the_writer_lock(
        tmp_path: pathlib.Path) -> None:
    """F (hang, then a read raises): README: a process stopped with SIGSTOP makes other
    *writers* wait cache.lock_timeout; "other slots stay readable". But kv.get flushes the
    sampled hot-key counts into the host sketch under the writer lock (Client._flush_hot,
    called by the C getter every 256 samples or second): a reader blocks for
    lock_timeout and then kv.get raises Unavailable ("Nothing was written")."""
    cfg = tmp_path / "e.yaml"
    cfg.write_text(yaml.safe_dump({"cache": {"l2_size": "16MB", "l2_dir": str(tmp_path),
                                             "lock_timeout": "3s"}}))
    holder = subprocess.Popen([sys.executable, "-c", (
        "import kvcomm, time\n"
        f"kv = kvcomm.open('hk', config={str(cfg)!r})\n"
        "[kv.put(f'k{i}', b'v') for i in range(100)]\n"
        "def v(key, old, new):\n    print('inlock', flush=True); time.sleep(1000)\n"
        "kv.register_validator('v/', v)\nkv.put('v/x', b'1')\n")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "inlock"
        holder.send_signal(signal.SIGSTOP)
        with kvcomm.open("hk", config=str(cfg)) as kv:
            # reads until the getter has tried a flush (due at least once a second), which
            # found the lock busy and kept its counts for later; then reads go on
            t0 = time.monotonic()
            while not kv._hot_pending:
                assert time.monotonic() - t0 < 10.0, "no flush was tried in 10 s of reads"
                for i in range(100):
                    kv.get(f"k{i}")
            t1 = time.monotonic()
            while time.monotonic() - t1 < 1.5:  # (another flush, also kept)
                for i in range(100):
                    kv.get(f"k{i}")
            assert kv._hot_pending, "the flush was tried and kept its counts for later"
            # the lock is still held: a read does not wait, a write does
            with pytest.raises(kvcomm.Unavailable):
                kv.put("k0", b"w")
    finally:
        holder.kill()
        holder.wait()
        l2.purge("hk", str(tmp_path))


def test_hot_counts_kept_while_the_lock_was_busy_are_added_later(kv: kvcomm.Client) -> None:
    """(The flush tried while the lock was busy keeps its counts: they reach the sketch
    with the next flush that gets the lock, so estimates are not lowered by contention.)"""
    kv.put("hot", b"1")
    try:
        kv._seg._core.lock(1.0)  # this thread holds the lock: the flush cannot take it
        for _ in range(1000):
            kv.get("hot")
        kv._flush_hot()
    finally:
        kv._seg._core.unlock()
    assert kv._hot_pending
    kept = kv._hot_pending.get("hot", 0)  # (1 in 16 at random gaps: about 1000, scaled)
    assert kept > 0
    counts = dict(kv.hot_keys(5))
    assert counts.get("hot", 0) >= kept, (counts, kept)  # (a Count-Min never counts low)
    assert not kv._hot_pending


def test_a_flush_that_spans_agings_ages_the_top_keys_with_the_sketch(kv: kvcomm.Client) -> None:
    """(Found while fixing the above: a flush kept while the lock was busy is larger. A
    flush whose additions cross the sketch's aging point once or more halved the top-k at
    most once, and only if the addition count ended lower than it began; the estimates of
    keys added before an aging were stored unhalved. A top-k entry then stood above its
    key's estimate, for good: a key read far less than it holds its place.)"""
    seg = kv._seg
    reset = seg.sketch.reset_every
    counts = {f"a/{i}".encode(): reset // 10 for i in range(25)}  # 2.5 agings in one flush
    assert seg.count_accesses(counts)
    assert seg.sketch.additions < reset
    for key, held in seg.topk.items():
        assert held <= seg.sketch.estimate(key), (key, held, seg.sketch.estimate(key))
