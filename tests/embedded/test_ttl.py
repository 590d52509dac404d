"""Per-key expiry, embedded: the API, reads around the deadline (L1, L2, scan), the version
rules, expire events, the sweep and what it reclaims, across processes."""

from __future__ import annotations

import json
import math
import os
import random
import struct
import subprocess
import sys
import textwrap
import time
from typing import Any

import msgpack
import pytest

import kvcomm
from kvcomm._client.attach import _Shared
from kvcomm._client.sweeper import SLICE
from kvcomm.core.expiry import MAX_TTL, ExtCache, check_ttl, deadline_of, expired, with_deadline
from kvcomm.tiers.l2 import H, key_hash
from tests.support import ROOT
from tests.support.helpers import SMALL, drawn_seed, wait_for


def _until(t: float) -> None:
    """Return once the clock has reached ``t`` (a deadline): a test then asserts what must
    hold from that instant on, not after some sleep that might not be long enough."""
    while time.time() < t:
        time.sleep(max(0.0, min(0.01, t - time.time())))


def test_put_with_ttl_is_absent_from_its_deadline_on_every_read_path(kv: kvcomm.Client) -> None:
    kv.put("a", b"bytes", ttl=1.0)
    kv.put("b", {"n": 1}, ttl=1.0)
    kv.put("c", "permanent")
    hits0 = kv.stats()["l1"]["hits"]
    for _ in range(3):  # fills L1 and hits it (the C getter), then Python's get_item
        assert kv.get("a") == b"bytes" and kv.get("b") == {"n": 1}
    assert kv.stats()["l1"]["hits"] > hits0
    item = kv.get_item("b")
    assert item is not None and item.tier == "l1"
    deadline = item.expires_at
    assert deadline is not None and time.time() < deadline <= time.time() + 1.0
    assert kv.get_item("c").expires_at is None  # type: ignore[union-attr]
    _until(deadline)
    # from the deadline on: no L1 hit, no L2 read, no scan returns them
    assert kv.get("a") is None and kv.get("b", "dflt") == "dflt"
    assert kv.get_item("a") is None and kv.get_item("b") is None
    assert [i.key for i in kv.scan("")] == ["c"]
    assert kv.keys() == ["c"]
    assert kv.get("c") == "permanent"


def test_l1_entry_never_outlives_the_deadline_in_a_tight_loop(kv: kvcomm.Client) -> None:
    """Reading as fast as possible across the deadline: every read that starts at or after
    the deadline (by the clock read just before it) finds the key absent."""
    kv.put("k", b"v", ttl=0.2)
    deadline = kv.get_item("k").expires_at  # type: ignore[union-attr]
    assert deadline is not None
    late = 0
    while True:
        before = time.time()
        got = kv.get("k")
        after = time.time()
        if before >= deadline:
            assert got is None, f"served {before - deadline:.6f} s after the deadline"
            late += 1
            if late > 1000:
                break
        elif got is None:  # (the read may have started after the deadline: not before it)
            assert after >= deadline, "absent before its deadline"


def test_a_large_array_view_carries_the_deadline(kv: kvcomm.Client) -> None:
    np = pytest.importorskip("numpy")
    arr = np.arange(100_000, dtype=np.float64)
    kv.put("arr", arr, ttl=30)
    item = kv.get_item("arr")
    assert item is not None and not item.value.flags.writeable  # (a zero-copy view)
    assert item.expires_at is not None and item.expires_at > time.time() + 20


def test_put_without_ttl_makes_the_key_permanent(kv: kvcomm.Client) -> None:
    kv.put("k", 1, ttl=0.2)
    kv.put("k", 2)
    item = kv.get_item("k")
    assert item is not None and item.expires_at is None
    _until(time.time() + 0.25)
    assert kv.get("k") == 2


def test_touch_sets_extends_and_clears_the_deadline(kv: kvcomm.Client) -> None:
    assert kv.touch("nothing", 1.0) is False
    kv.put("k", {"v": 1})
    assert kv.touch("k", 1.0) is True
    d1 = kv.get_item("k").expires_at  # type: ignore[union-attr]
    assert d1 is not None
    assert kv.touch("k", 5.0) is True
    d2 = kv.get_item("k").expires_at  # type: ignore[union-attr]
    assert d2 is not None and d2 > d1 + 4
    _until(d1)
    assert kv.get("k") == {"v": 1}  # extended
    assert kv.touch("k", None) is True and kv.get_item("k").expires_at is None  # type: ignore[union-attr]
    assert kv.touch("k", 0.1) is True
    d3 = kv.get_item("k").expires_at  # type: ignore[union-attr]
    _until(d3)  # type: ignore[arg-type]
    assert kv.get("k") is None
    assert kv.touch("k", 1.0) is False  # expired: absent, nothing written
    assert kv.get("k") is None


def test_update_keeps_the_deadline_unless_ttl_is_given(kv: kvcomm.Client) -> None:
    assert kv.update("n", lambda v: (v or 0) + 1, ttl=30) == 1
    d = kv.get_item("n").expires_at  # type: ignore[union-attr]
    assert d is not None
    assert kv.update("n", lambda v: v + 1) == 2
    assert kv.get_item("n").expires_at == d  # type: ignore[union-attr]
    assert kv.update("n", lambda v: v + 1, ttl=60) == 3
    assert kv.get_item("n").expires_at > d + 20  # type: ignore[operator, union-attr]
    kv.put("m", 5, ttl=0.1)
    _until(kv.get_item("m").expires_at)  # type: ignore[arg-type, union-attr]
    assert kv.update("m", lambda v: (v or 0) + 1) == 1  # expired counts as absent


def test_batch_ops_take_ttl(kv: kvcomm.Client) -> None:
    with kv.batch() as b:
        b.put("q1", b"1", ttl=1.0)
        b.put("q2", {"x": 2})
        b.delete("nothing")
    d = kv.get_item("q1").expires_at  # type: ignore[union-attr]
    assert d is not None and kv.get_item("q2").expires_at is None  # type: ignore[union-attr]
    _until(d)
    assert kv.get("q1") is None and kv.get("q2") == {"x": 2}
    with pytest.raises(kvcomm.InvalidArgument, match="ttl"), kv.batch() as b2:
        b2.put("q3", b"3")
        b2.put("q4", b"4", ttl=-1)
    assert kv.get("q3") is None  # the batch raised: nothing of it was written


@pytest.mark.parametrize("bad", [0, -1, 0.0, float("nan"), float("inf"), -float("inf"), "3",
                                 True, 1e12, [1]])
def test_bad_ttl_is_refused_and_nothing_is_written(kv: kvcomm.Client, bad: Any) -> None:
    with pytest.raises(kvcomm.InvalidArgument, match="ttl"):
        kv.put("k", b"v", ttl=bad)
    assert kv.get("k") is None
    kv.put("k", b"v")
    with pytest.raises(kvcomm.InvalidArgument, match="ttl"):
        kv.touch("k", bad)
    with pytest.raises(kvcomm.InvalidArgument, match="ttl"):
        kv.update("k", lambda v: v, ttl=bad)
    assert kv.get_item("k").expires_at is None  # type: ignore[union-attr]


def test_a_write_after_the_deadline_wins_and_expect_absent_sees_it_gone(kv: kvcomm.Client) -> None:
    v1 = kv.put("k", 1, ttl=0.5)
    _until(kv.get_item("k").expires_at)  # type: ignore[arg-type, union-attr]
    with pytest.raises(kvcomm.ConflictError):
        kv.put("k", 9, expect=v1)  # the key is absent (expired): not at v1 any more
    v2 = kv.put("k", 2, expect=kvcomm.ABSENT)
    assert kv.get("k") == 2 and kv.get_item("k").version == v2  # type: ignore[union-attr]


def test_expire_event_within_the_sweep_interval_and_space_reclaimed(ns: str) -> None:
    cfg = kvcomm.Config.from_mapping({**SMALL, "cache": {**SMALL["cache"], "expiry_sweep": "50ms"}})
    with kvcomm.open(ns, config=cfg) as kv:
        w = kv.watch("p/", timeout=5.0)
        kv.put("p/keep", b"k")
        n = 500
        with kv.batch() as b:
            for i in range(n):
                b.put(f"p/{i}", b"x" * 200, ttl=1.0)
        deadline = kv.get_item("p/0").expires_at  # type: ignore[union-attr]
        used = kv.stats()["l2"]["bytes"]
        entries = kv.stats()["l2"]["entries"]
        expired_at: dict[str, float] = {}
        for ev in w:  # nobody reads the keys: the sweep alone reclaims them
            if ev.kind == "expire":
                expired_at[ev.key] = time.time()
                if len(expired_at) == n:
                    break
        assert set(expired_at) == {f"p/{i}" for i in range(n)}
        late = max(expired_at.values()) - deadline  # type: ignore[operator]
        slices = math.ceil(kv._seg.layout.n_slots / SLICE)
        print(f"expire events: last {late * 1000:.0f} ms after the deadline "
              f"(bound: {slices} slices x 50 ms + scheduling)")
        assert min(expired_at.values()) >= deadline  # type: ignore[operator]
        after = kv.stats()["l2"]
        assert after["entries"] == entries - n
        print(f"reclaimed {used - after['bytes']} of {used} bytes")
        assert after["bytes"] < used - n * 200
        assert kv.get("p/keep") == b"k"


def test_a_read_reclaims_an_expired_key_at_once(ns: str) -> None:
    cfg = kvcomm.Config.from_mapping({**SMALL, "cache": {**SMALL["cache"], "expiry_sweep": "60s"}})
    with kvcomm.open(ns, config=cfg) as kv:
        kv.put("k", b"v", ttl=0.5)
        w = kv.watch("", timeout=2.0)
        _until(kv.get_item("k").expires_at)  # type: ignore[arg-type, union-attr]
        assert kv.stats()["l2"]["entries"] == 1  # the sweep sleeps 60 s
        assert kv.get("k") is None
        assert kv.stats()["l2"]["entries"] == 0
        assert [(e.key, e.kind) for e in w] == [("k", "expire")]


_WRITER = textwrap.dedent("""
    import json, sys, kvcomm
    cfg = kvcomm.Config.from_mapping(json.loads(sys.argv[2]))
    kv = kvcomm.open(sys.argv[1], config=cfg)
    kv.put("shared/k", {"from": "writer"}, ttl=float(sys.argv[3]))
    print(json.dumps(kv.get_item("shared/k").expires_at), flush=True)
    kv.close()
""")


def test_crossing_the_deadline_in_another_process(ns: str, config: kvcomm.Config) -> None:
    """Another process writes a key with a ttl and exits; this one has the key in L1 and
    in a watch: from the deadline on it is absent here, and the watch sees one expire."""
    with kvcomm.open(ns, config=config) as kv:
        w = kv.watch("shared/", timeout=5.0)
        out = subprocess.run([sys.executable, "-c", _WRITER, ns, json.dumps(SMALL), "3.0"],
                             check=True, capture_output=True, text=True, timeout=60,
                             cwd=str(ROOT))
        deadline = json.loads(out.stdout)
        got = kv.get("shared/k")
        assert time.time() < deadline and got == {"from": "writer"}
        assert kv.get("shared/k") == {"from": "writer"}  # an L1 hit
        _until(deadline)
        assert kv.get("shared/k") is None
        kinds = []
        for e in w:
            kinds.append(e.kind)
            if e.kind == "expire":
                break
        assert kinds == ["put", "expire"]


# ---------------------------------------------------------------- pure logic, properties

def _random_value(rng: random.Random, depth: int = 0) -> Any:
    r = rng.randrange(9 if depth < 2 else 7)
    if r == 0:
        return rng.randrange(-2**63, 2**64)
    if r == 1:
        return rng.choice([rng.random() * 1e10, -rng.random(), float("nan"), float("inf"), 0.0])
    if r == 2:
        return "".join(rng.choice("abcé") for _ in range(rng.randrange(40)))
    if r == 3:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(300)))
    if r == 4:
        return rng.choice([None, True, False])
    if r == 5:
        return rng.randrange(128)
    if r == 6:
        return rng.randrange(2**16, 2**40)
    if r == 7:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(20))]
    return {str(rng.randrange(50)): _random_value(rng, depth + 1) for _ in range(rng.randrange(20))}


def test_c_and_python_read_the_same_deadline_from_random_fields(kv: kvcomm.Client,
                                                                 seed: int) -> None:
    rng = random.Random(seed)
    seg = kv._seg
    for i in range(600):
        m = {rng.choice(["a", "e", "x", "ee", "E", str(i)]): _random_value(rng)
             for _ in range(rng.randrange(18))}
        if rng.random() < 0.5:
            m["e"] = rng.choice([time.time() + 1 + rng.random() * 100, rng.randrange(1, 2**40),
                                 _random_value(rng), rng.randrange(1, 2**64)])
        ext = msgpack.packb(m, use_bin_type=True, use_single_float=rng.random() < 0.2)
        if len(ext) > 4096:
            continue
        kb = f"k{i}".encode()
        seg.put(kb, key_hash(kb), 1, b"", b"v", 0, False, 0, ext)
        rec = seg.read(kb, key_hash(kb))
        py = deadline_of(ext)
        if rec is None:  # (a deadline already past, 5 say, or now + 1 s as a float32, which
            # rounds to 128 s: the client's sweeper may expire it before the read)
            assert py is not None and py <= time.time(), (seed, m)
            continue
        assert (rec.deadline or None) == (py if py is None else pytest.approx(py, rel=1e-7)), \
            (seed, m)


def test_ext_cache_matches_with_deadline() -> None:
    seed = drawn_seed(2**32)
    rng = random.Random(seed)
    for base in (b"", msgpack.packb({"a": "drone-7"}), msgpack.packb({"a": "x", "z": [1, 2]}),
                 msgpack.packb({"e": 5.0, "a": "y"})):
        c = ExtCache(base)
        assert c.ext(None) == base
        for _ in range(50):
            d = time.time() + rng.random() * 1e6
            got = c.ext(d)
            assert msgpack.unpackb(got) == msgpack.unpackb(with_deadline(base, d))
            assert deadline_of(got) == d


def test_check_ttl_and_expired() -> None:
    assert check_ttl(None) is None and check_ttl(2) == 2.0 and check_ttl(0.001) == 0.001
    with pytest.raises(kvcomm.InvalidArgument):
        check_ttl(None, allow_none=False)
    assert not expired(None, 1e9) and not expired(0.0, 1e9)
    assert expired(10.0, 10.0) and expired(10.0, 11.0) and not expired(10.0, 9.999)
    assert with_deadline(with_deadline(b"", 5.0), None) == b""


# ---------------------------------------------------------------- presence

_AGENT = textwrap.dedent("""
    import json, sys, time, kvcomm
    cfg = kvcomm.Config.from_mapping(json.loads(sys.argv[2])) if sys.argv[2].startswith("{") \\
        else sys.argv[2]
    kv = kvcomm.open(sys.argv[1], config=cfg)
    p = kv.presence("alive/", sys.argv[3], ttl=float(sys.argv[4]))
    print("up", flush=True)
    while True:
        time.sleep(1)
""")


def spawn_agent(ns: str, config: str, agent: str, ttl: float) -> subprocess.Popen[str]:
    """A process that keeps ``alive/<agent>`` present until it is killed; returns once its
    presence is written."""
    p = subprocess.Popen([sys.executable, "-c", _AGENT, ns, config, agent, str(ttl)],
                         stdout=subprocess.PIPE, text=True,
                         cwd=str(ROOT))
    assert p.stdout is not None and p.stdout.readline().strip() == "up"
    return p


def test_presence_refreshes_and_stop_lets_it_lapse(kv: kvcomm.Client) -> None:
    with pytest.raises(kvcomm.InvalidArgument):
        kv.presence("alive/", "x", ttl=0)
    with pytest.raises(kvcomm.InvalidKey):
        kv.presence("alive/", "")
    p = kv.presence("alive/", "me", ttl=1.2)
    q = kv.presence("alive/", "you", ttl=1.2)
    assert kv.present("alive/") == ["me", "you"]
    first = kv.get_item("alive/me").expires_at  # type: ignore[union-attr]
    _until(first + 0.4)  # type: ignore[operator]
    assert kv.present("alive/") == ["me", "you"]  # refreshed past its first deadline
    assert p.refreshes >= 2 and p.failures == 0
    p.stop()
    last = kv.get_item("alive/me").expires_at  # type: ignore[union-attr]
    assert last is not None and last <= time.time() + 1.2
    _until(last)
    assert kv.present("alive/") == ["you"]
    q.stop(remove=True)
    assert kv.present("alive/") == [] and kv.get("alive/you") is None


def test_presence_of_a_killed_process_lapses_within_ttl_and_a_refresh(
        ns: str, config: kvcomm.Config) -> None:
    ttl = 1.2
    with kvcomm.open(ns, config=config) as kv:
        agent = spawn_agent(ns, json.dumps(SMALL), "drone-9", ttl)
        try:
            assert kv.present("alive/") == ["drone-9"]
            wait_for(lambda: kv.get_item("alive/drone-9").expires_at  # type: ignore[union-attr]
                     > time.time() + ttl * 0.5, what="a refresh")
            assert agent.poll() is None
            os.kill(agent.pid, 9)
            killed = time.time()
            agent.wait(timeout=30)
            assert agent.returncode == -9
        finally:
            if agent.poll() is None:
                agent.kill()
        # every refresh happened before the kill: from kill + ttl + ttl / 3 on, nobody
        # lists it (checked once at that instant, not waited for)
        _until(killed + ttl + ttl / 3)
        assert kv.present("alive/") == [] and kv.get("alive/drone-9") is None


# ---------------------------------------------------------------- ttl arguments


@pytest.mark.parametrize("bad", [10**400, -(10**400), 10**9, MAX_TTL + 1])
def test_a_ttl_past_the_limit_is_invalidargument_everywhere(kv: kvcomm.Client, bad: Any) -> None:
    """An int past float's range raised OverflowError from put, update, touch and
    batch.put; every one says InvalidArgument, names the ten-year bound, writes nothing."""
    kv.put("t", 1)
    v = kv.get_item("t").version
    for call in (lambda: kv.put("t", 2, ttl=bad), lambda: kv.update("t", lambda n: n + 1, ttl=bad),
                 lambda: kv.touch("t", bad)):
        with pytest.raises(kvcomm.InvalidArgument, match="315360000 s"):
            call()
    with pytest.raises(kvcomm.InvalidArgument, match="315360000 s"), kv.batch() as b:
        b.put("t", 3, ttl=bad)
    item = kv.get_item("t")
    assert item.value == 1 and item.version == v and item.expires_at is None


def test_numpy_numbers_are_ttls(kv: kvcomm.Client) -> None:
    np = pytest.importorskip("numpy")
    for i, ttl in enumerate([np.float64(30.0), np.int64(30), np.float32(30.0), np.uint16(30)]):
        t0 = time.time()
        kv.put(f"n{i}", i, ttl=ttl)
        assert t0 + 29 < kv.get_item(f"n{i}").expires_at < time.time() + 31
        assert kv.touch(f"n{i}", ttl)
        kv.update(f"n{i}", lambda n: n + 1, ttl=ttl)
        with kv.batch() as b:
            b.put(f"m{i}", i, ttl=ttl)
        assert kv.get_item(f"m{i}").expires_at is not None
    for bad in (np.bool_(True), np.float64("nan"), np.float64(-1.0), np.int64(10**9)):
        with pytest.raises(kvcomm.InvalidArgument, match="ttl"):
            kv.put("x", 1, ttl=bad)
    assert kv.get("x") is None


def test_the_readmes_ttl_example_runs(kv: kvcomm.Client) -> None:
    """The code of the docs' TTL page (once the README's TTL section), as written (its
    update() on a new key raised TypeError)."""
    section = (ROOT / "docs" / "ttl-presence.md").read_text()
    code = section[section.index("```python") + 9:section.index("```", section.index("```python") + 9)]
    exec(compile(code, "docs/ttl-presence.md", "exec"), {"kv": kv, "state": {"x": 1}})
    assert kv.get("count") == 1 and kv.get("claim/shelf-4") == "robot-1"


# ---------------------------------------------------------------- writes over an expired key


def _events(w: Any, want: int) -> list[tuple[str, str]]:
    got = []
    for ev in w:
        got.append((ev.key, ev.kind))
        if len(got) >= want:
            break
    return got


def test_a_write_over_an_expired_key_records_its_expiry_first(ns: str) -> None:
    """An expired key nobody read, re-put before the sweep reached it, gave watchers
    ``put, put`` and no ``expire``; a delete of it returned True with a ``delete`` event,
    though from its deadline on the key is absent everywhere. Now: ``expire, put`` for a
    put (single, checked, batched); False and ``expire`` alone for a delete."""
    cfg = kvcomm.Config.from_mapping({**SMALL, "cache": {**SMALL["cache"], "expiry_sweep": "60s"}})
    with kvcomm.open(ns, config=cfg) as kv:
        n = 200
        with kv.batch() as b:
            for i in range(n):
                b.put(f"k/{i}", i, ttl=0.2)
        last = kv.get_item(f"k/{n - 1}").expires_at
        w = kv.watch("k/", timeout=5.0)
        _until(last)  # type: ignore[arg-type]
        assert kv.stats()["l2"]["entries"] == n  # (the sweep sleeps 60 s: nothing reclaimed)
        put, checked, batched, deleted, batch_deleted = (range(0, 40), range(40, 80),
                                                         range(80, 120), range(120, 160),
                                                         range(160, 200))
        for i in put:
            kv.put(f"k/{i}", -i)
        for i in checked:
            kv.put(f"k/{i}", -i, expect=kvcomm.ABSENT)
        with kv.batch() as b:
            for i in batched:
                b.put(f"k/{i}", -i)
        assert not any(kv.delete(f"k/{i}") for i in deleted)
        with kv.batch() as b:
            for i in batch_deleted:
                b.delete(f"k/{i}")
        assert b.versions == [False] * len(batch_deleted)
        events = _events(w, 2 * 120 + 80)
        by_key: dict[str, list[str]] = {}
        for key, kind in events:
            by_key.setdefault(key, []).append(kind)
        for i in range(n):
            want = ["expire"] if i >= 120 else ["expire", "put"]
            assert by_key.get(f"k/{i}") == want, (i, by_key.get(f"k/{i}"))
        assert kv.stats()["l2"]["entries"] == 120
        assert all(kv.get(f"k/{i}") == -i for i in range(120))
        assert kv.get_item("k/0").expires_at is None


_BYTES_TAG = 1


def _cfg(**cache: object) -> kvcomm.Config:
    return kvcomm.Config.from_mapping({**SMALL, "cache": {**SMALL["cache"], **cache}})


def _held(kv: kvcomm.Client, key: str) -> bool:
    """Whether this host's L2 physically holds ``key``'s record (a lock-free look that,
    unlike a read, never reclaims an expired one)."""
    kb = key.encode()
    return kv._seg.version(kb, key_hash(kb)) is not None


# ---------------------------------------------------------------- F1: eviction order

def test_expired_entries_are_reclaimed_before_any_live_entry_is_evicted(ns: str) -> None:
    """(found in review 14: per-key TTL and presence)"""
    value = b"x" * 60_000
    with kvcomm.open(ns, config=_cfg(expiry_sweep="60s")) as kv:  # no sweep: eviction alone
        i = 0
        while kv.stats()["l2"]["evictions"] < 40:  # the CLOCK hand has gone round
            kv.put(f"a/{i}", value)
            i += 1
        ttl_keys = [f"t/{j}" for j in range(20)]
        with kv.batch() as b:
            for k in ttl_keys:
                b.put(k, value, ttl=0.3)
        deadline = kv.get_item(ttl_keys[0]).expires_at  # type: ignore[union-attr]
        assert deadline is not None
        wait_for(lambda: time.time() > deadline + 0.01, 5, "the deadline")
        assert all(_held(kv, k) for k in ttl_keys)  # nothing has reclaimed them yet
        live_evicted_while_expired_held = 0
        for j in range(len(ttl_keys) + 5):
            before = kv.stats()["l2"]["evictions"]
            kv.put(f"b/{j}", value)
            held = [k for k in ttl_keys if _held(kv, k)]
            if kv.stats()["l2"]["evictions"] > before and held:
                live_evicted_while_expired_held += 1
        assert live_evicted_while_expired_held == 0, (
            f"{live_evicted_while_expired_held} writes evicted a live entry while expired "
            "entries still held space")
        assert not any(_held(kv, k) for k in ttl_keys)  # the writes needed their space
        assert kv._seg.check() == []  # the expiry hint included


# ---------------------------------------------------------------- F2: one reading of "e"

_PAST, _FUTURE = 1000.0, time.time() + 3600.0


def _f64(x: float) -> bytes:
    return b"\xcb" + struct.pack(">d", x)


HOSTILE = {  # fields kvcomm.core.ext accepts (string keys), read differently before F2
    "repeated e (the last is live)": b"\x82\xa1e" + _f64(_PAST) + b"\xa1e" + _f64(_FUTURE),
    "repeated e (the last is past)": b"\x82\xa1e" + _f64(_FUTURE) + b"\xa1e" + _f64(_PAST),
    "e as a str8": b"\x81\xd9\x01e" + _f64(_PAST),
    "e as a str16": b"\x81\xda\x00\x01e" + _f64(_PAST),
    "deadline as an int32": b"\x81\xa1e\xd2" + struct.pack(">i", 1000),
    "deadline as an int64": b"\x81\xa1e\xd3" + struct.pack(">q", 1000),
    "negative int16": b"\x81\xa1e\xd1" + struct.pack(">h", -5),
    "e then a string e": b"\x82\xa1e" + _f64(_PAST) + b"\xa1e\xa1x",
    "a map16 header": b"\xde\x00\x01\xa1e" + _f64(_PAST),
    "a map32 header": b"\xdf\x00\x00\x00\x01\xa1e" + _f64(_PAST),
    "float32": b"\x81\xa1e\xca" + struct.pack(">f", 1000.0),
    "uint64 max": b"\x81\xa1e\xcf" + b"\xff" * 8,
    "nan": b"\x81\xa1e" + _f64(float("nan")),
    "inf": b"\x81\xa1e" + _f64(float("inf")),
    "huge": b"\x81\xa1e" + _f64(1e308),
    "bool": b"\x81\xa1e\xc3",
    "nested e": b"\x81\xa1a\x81\xa1e" + _f64(_PAST),
}


def test_c_and_python_read_the_same_deadline_from_every_accepted_field(kv: kvcomm.Client) -> None:
    """(found in review 14: per-key TTL and presence)"""
    disagree = []
    for name, ext in HOSTILE.items():
        kb = f"h/{name}".encode()
        h = key_hash(kb)
        kv._seg.apply([(kb, h, _BYTES_TAG, b"", b"v", ext)], now_ms=int(time.time() * 1000))
        rec = kv._seg.read(kb, h)
        assert rec is not None
        c_reads = rec.deadline or None
        py_reads = deadline_of(ext)
        if c_reads != py_reads:
            disagree.append((name, c_reads, py_reads))
        gone = py_reads is not None and py_reads <= time.time()
        # every read path answers as the deadline Python (and L3) reads says
        assert (kv.get(kb.decode()) is None) == gone, name
        assert (kv.get_item(kb.decode()) is None) == gone, name
    assert disagree == [], disagree


# ---------------------------------------------------------------- F3: an idle sweep

def test_the_sweep_takes_no_lock_while_nothing_can_expire(ns: str) -> None:
    """(found in review 14: per-key TTL and presence)"""
    with kvcomm.open(ns, config=_cfg(expiry_sweep="10ms")) as kv:
        sw = _Shared.attached[ns].sweeper
        for i in range(100):
            kv.put(f"p/{i}", b"v")  # permanent keys only
        looks0 = sw.looks
        wait_for(lambda: sw.looks >= looks0 + 30, 30, "30 sweep intervals")
        assert sw.sweeps == 0, f"{sw.sweeps} sweeps took the writer lock with no deadline"
        w = kv.watch("t/", timeout=5.0)
        kv.put("t/1", b"v", ttl=0.2)
        kinds = []
        for ev in w:
            kinds.append((ev.kind, ev.key))
            if ev.kind != "put":
                break
        assert kinds == [("put", "t/1"), ("expire", "t/1")]  # the sweep reclaimed it
        assert sw.sweeps > 0
        # once the pass that reclaimed it is over no deadline is left: 30 intervals in a
        # row then go by without the lock
        seen = [sw.sweeps, sw.looks]

        def quiet() -> bool:
            if sw.sweeps != seen[0]:
                seen[:] = [sw.sweeps, sw.looks]
            return sw.looks >= seen[1] + 30
        wait_for(quiet, 30, "30 sweep intervals in a row without the lock")
        assert kv._seg.check() == []


def test_a_deadline_written_by_another_process_wakes_this_process_sweep(ns: str) -> None:
    """The hint lives in the segment: a key with a deadline written by another process
    (which exits at once, its own sweeper gone) is reclaimed by this process's sweep.
    (found in review 14: per-key TTL and presence)"""
    with kvcomm.open(ns, config=_cfg(expiry_sweep="10ms")) as kv:
        sw = _Shared.attached[ns].sweeper
        kv.put("p/keep", b"v")
        w = kv.watch("t/", timeout=10.0)
        code = textwrap.dedent(f"""
            import kvcomm
            cfg = kvcomm.Config.from_mapping({_cfg(expiry_sweep='60s').model_dump()!r})
            with kvcomm.open({ns!r}, config=cfg) as kv:
                kv.put("t/child", b"v", ttl=0.3)
        """)
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
        kinds = []
        for ev in w:
            kinds.append((ev.kind, ev.key))
            if ev.kind != "put":
                break
        assert kinds == [("put", "t/child"), ("expire", "t/child")]
        assert sw.reclaimed == 1 and kv.get("p/keep") == b"v"


def test_an_expired_dirty_record_is_kept_until_clean_then_the_hint_wakes_the_sweep(
        ns: str) -> None:
    """A record with a deadline written dirty (cluster mode: not yet in L3) is never
    reclaimed, by the sweep nor by eviction, until the daemon marks it clean; the mark
    lowers the expiry hint, so the sweep then reclaims it (with its expire event).
    (found in review 14: per-key TTL and presence)"""
    with kvcomm.open(ns, config=_cfg(expiry_sweep="10ms")) as kv:
        sw = _Shared.attached[ns].sweeper
        w = kv.watch("d/", timeout=10.0)
        kb = b"d/1"
        h = key_hash(kb)
        ext = b"\x81\xa1e" + _f64(time.time() + 0.2)
        counter, hlc, _, _, _ = kv._seg.put(kb, h, _BYTES_TAG, b"", b"v", int(time.time() * 1000),
                                            True, 0, ext)
        wait_for(lambda: sw.passes >= 1, 10, "a whole pass after the deadline")
        assert sw.sweeps >= 2 and sw.reclaimed == 0
        assert _held(kv, "d/1") and kv.get("d/1") is None  # dirty: kept, but absent
        assert not kv._seg.expiry_due(time.time())  # nothing clean can expire: no sweeps
        assert kv._seg.mark_clean(kb, h, counter, hlc)
        kinds = []
        for ev in w:
            kinds.append(ev.kind)
            if ev.kind == "expire":
                break
        assert kinds[-1] == "expire" and not _held(kv, "d/1")
        assert kv._seg.check() == []


# ---------------------------------------------------------------- probes (no fault found)

def test_kill_9_of_sweeping_processes_never_wedges_writers(ns: str) -> None:
    """Processes sweeping (and evicting over) thousands of expired entries are killed with
    SIGKILL at random moments, several times; every write after each kill completes, the
    segment checks clean, and at least one kill landed while the writer lock was held (a
    repair or an owner death counted).
    (found in review 14: per-key TTL and presence)"""
    import random
    import signal

    seed = drawn_seed(1 << 30)
    rnd = random.Random(seed)
    cfg = _cfg(expiry_sweep="1ms", lock_timeout="2s")
    child = textwrap.dedent(f"""
        import kvcomm
        from kvcomm._client.attach import _Shared
        cfg = kvcomm.Config.from_mapping({cfg.model_dump()!r})
        kv = kvcomm.open({ns!r}, config=cfg)
        sw = _Shared.attached[{ns!r}].sweeper
        print("ready", flush=True)
        i = 0
        while True:
            with kv.batch() as b:
                for j in range(200):
                    b.put(f"t/{{i}}-{{j}}", b"x" * 2000, ttl=0.001)
            i += 1
            sw.sweep_once()
    """)
    with kvcomm.open(ns, config=cfg) as kv:
        q = kv._seg._q

        def deaths() -> int:
            return int(q[H["OWNER_DEATHS"]] + q[H["RECOVERIES"]])

        kills = 0
        while deaths() == 0 and kills < 60:  # until a kill lands under the lock
            p = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
            time.sleep(rnd.uniform(0.05, 0.4))  # (where the kill lands: the point of it)
            p.send_signal(signal.SIGKILL)
            p.wait()
            kills += 1
            kv.put(f"after/{kills}", kills, ttl=60)  # never wedged: within lock_timeout
            assert kv.get(f"after/{kills}") == kills
        print(f"{kills} kills; owner deaths {q[H['OWNER_DEATHS']]}, repairs {q[H['RECOVERIES']]}")
        assert deaths() >= 1, "no kill landed while the lock was held"
        assert kv._seg.check() == []


def test_keys_nobody_reads_get_their_expire_events_within_a_wake_up_or_two(ns: str) -> None:
    """The sweep finishes its pass in the wake-up that finds a deadline due (a slice at a
    time, the lock released between slices): one slice per wake-up left a key nobody read
    for up to ceil(slots / SLICE) wake-ups before its expire event (32 on 131,072 slots),
    not one interval as the contract says. Counted in wake-ups, not wall time.
    (found in review 14: per-key TTL and presence)"""
    from kvcomm._client.sweeper import SLICE

    cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": "256MB", "expiry_sweep": "50ms"}})
    with kvcomm.open(ns, config=cfg) as kv:
        slots = kv._seg.layout.n_slots
        assert slots >= 16 * SLICE, slots  # (a pass is many slices)
        sw = _Shared.attached[ns].sweeper
        w = kv.watch("nr/", timeout=10.0)
        keys = [f"nr/{i}" for i in range(64)]  # spread over the table, never read
        for k in keys:
            kv.put(k, b"v", ttl=0.3)
        looks_at: dict[str, int] = {}
        for ev in w:
            if ev.kind == "expire":
                looks_at.setdefault(ev.key, sw.looks)
                if len(looks_at) == len(keys):
                    break
        first_due = min(looks_at.values())
        spread = max(looks_at.values()) - first_due
        print(f"{slots} slots; expire events of 64 unread keys spread over {spread} wake-ups")
        assert spread <= 2, (spread, slots)
