"""Review 14: an adversarial review of per-key TTL and presence (issue 14).

Each test reproduces one finding (it failed before its fix) on a real segment:

* F1: L2 space held by expired clean entries is reclaimed before any live entry is
  evicted (the contract); CLOCK evicted live entries whose reference bit was clear while
  expired ones further along still held their space.
* F2: the C kernel and Python read the same deadline out of every extension field L2
  accepts; they disagreed on a repeated "e", an "e" key not packed as a fixstr, and a
  deadline packed as a signed integer, so a key could be expired for one reader and live
  for another (the getter served a key whose deadline had passed).
* F3 (a known cost, not a fault): the expiry sweep takes no writer lock while no record
  has a deadline (it took it every ``cache.expiry_sweep`` in every process), and stops
  taking it once every deadline has been reclaimed; a deadline written by another process
  wakes it (the hint is in the segment: layout 5). Figures: bench/bench_sweep.py.
"""

from __future__ import annotations

import math
import shutil
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest

import kvcomm
from kvcomm import devcluster
from kvcomm._client.attach import _Shared
from kvcomm._client.strong import etcd_key
from kvcomm.core.expiry import deadline_of
from kvcomm.tiers.l2 import H, key_hash
from kvcomm.tiers.l3 import L3Record, L3Store
from tests.support.helpers import SMALL, wait_for

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
    (which exits at once, its own sweeper gone) is reclaimed by this process's sweep."""
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


# ---------------------------------------------------------------- F4: a lost bucket lease

@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if shutil.which("redis-server") is None or shutil.which("etcd") is None:
        pytest.skip("redis-server and etcd are needed")
    d = tmp_path_factory.mktemp("devcluster")
    state = devcluster.up(2, str(d), groups=64, strong_prefixes=["lock/"])
    yield state
    devcluster.down(str(d))


def test_a_strong_put_with_a_ttl_gets_a_new_lease_when_its_buckets_is_gone(
        dev: dict[str, Any]) -> None:
    """A process keeps one etcd lease per 1-second bucket of deadlines. When that lease
    is gone before the bucket's end (revoked by an operator, an etcd restored from a
    backup, or this host's wall clock stepped back past it), every later put with a
    deadline in the bucket failed with Unavailable ("requested lease not found") until the
    clock passed the bucket."""
    a = kvcomm.open(config=dev["hosts"][0]["config"])
    b = kvcomm.open(config=dev["hosts"][1]["config"])
    try:
        bucket = math.ceil(time.time() + 30)
        a.put("lock/x", "1", ttl=bucket - 0.5 - time.time())
        kv = a._strong.etcd.get(etcd_key("lock/x"))
        assert kv is not None and kv.lease
        assert a._strong.etcd.lease_revoke(kv.lease)  # the lease is gone, and its keys
        assert b.get("lock/x") is None
        a.put("lock/y", "2", ttl=bucket - 0.4 - time.time())  # the same bucket
        y = a._strong.etcd.get(etcd_key("lock/y"))
        assert y is not None and y.lease not in (0, kv.lease)
        assert b.get("lock/y") == "2"
        assert a.touch("lock/y", bucket - 0.3 - time.time())  # a touch into it too
        assert b.get_item("lock/y").expires_at is not None  # type: ignore[union-attr]
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------- F5: expect=ABSENT, strong

def test_an_expired_strong_key_is_absent_to_expect_absent_and_update(
        dev: dict[str, Any]) -> None:
    """A strong key stays in etcd until its bucket's lease ends (up to a second, or etcd's
    minimum lease TTL, after its deadline) although every read finds it absent from its
    deadline on; put(expect=ABSENT) raised ConflictError in that window, and update()
    (which writes with expect=ABSENT over an absent key) lost every race."""
    a = kvcomm.open(config=dev["hosts"][0]["config"])
    b = kvcomm.open(config=dev["hosts"][1]["config"])
    try:
        a.put("lock/shelf", "robot-1", ttl=0.3)
        a.put("lock/count", 5, ttl=0.3)
        d = a.get_item("lock/shelf").expires_at  # type: ignore[union-attr]
        assert d is not None
        wait_for(lambda: time.time() > d, 5, "the deadline")
        assert b.get("lock/shelf") is None
        # the fault's condition: etcd still holds both (their lease has not ended)
        assert a._strong.etcd.get(etcd_key("lock/shelf")) is not None
        assert a._strong.etcd.get(etcd_key("lock/count")) is not None
        b.put("lock/shelf", "robot-2", expect=kvcomm.ABSENT)  # the claim lapsed: take it
        assert a.get("lock/shelf") == "robot-2"
        assert a.get_item("lock/shelf").expires_at is None  # type: ignore[union-attr]
        assert b.update("lock/count", lambda n: n + 1, default=0) == 1  # absent: from 0
        assert a.get("lock/count") == 1
        with pytest.raises(kvcomm.ConflictError):  # a live key still conflicts
            a.put("lock/shelf", "robot-3", expect=kvcomm.ABSENT)
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------- F6: expect=Version, strong

def test_an_expired_strong_key_is_not_at_its_old_version(dev: dict[str, Any]) -> None:
    """After its deadline a key is absent: put(expect=its old Version) raises
    ConflictError, as on an eventual key (tests/embedded/test_ttl.py); on a strong key etcd still
    held it at that revision until the lease ended, and the put succeeded, reviving it
    (as touch() did for a key that expired between its read and its write)."""
    a = kvcomm.open(config=dev["hosts"][0]["config"])
    try:
        v1 = a.put("lock/v", "robot-1", ttl=0.3)
        d = a.get_item("lock/v").expires_at  # type: ignore[union-attr]
        assert d is not None
        wait_for(lambda: time.time() > d, 5, "the deadline")
        assert a.get("lock/v") is None
        assert a._strong.etcd.get(etcd_key("lock/v")) is not None  # still in etcd
        with pytest.raises(kvcomm.ConflictError):
            a.put("lock/v", "robot-1-again", expect=v1)
        assert a.get("lock/v") is None
    finally:
        a.close()


def test_an_expired_dirty_record_is_kept_until_clean_then_the_hint_wakes_the_sweep(
        ns: str) -> None:
    """A record with a deadline written dirty (cluster mode: not yet in L3) is never
    reclaimed, by the sweep nor by eviction, until the daemon marks it clean; the mark
    lowers the expiry hint, so the sweep then reclaims it (with its expire event)."""
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


# ---------------------------------------------------------------- F7: a far deadline in L3

def test_a_record_with_a_far_deadline_is_pushed_to_l3_without_error(dev: dict[str, Any]) -> None:
    """Every reader takes a deadline up to 1e300 s; L3's push script gave such a key
    ``PEXPIREAT deadline*1000 + grace``, which Lua formats as "1e+15" from 1e14 ms on
    (about the year 5138): Redis refused it and the script stopped after storing the
    record, so the push raised CorruptRecord — every time, for a host whose update()
    carried such a deadline (update keeps the deadline it read), whose write then never
    left its backlog."""
    store = L3Store([(a.rpartition(":")[0], int(a.rpartition(":")[2])) for a in dev["redis"]],
                    groups=64)
    try:
        for i, d in enumerate((1e12, 1e17, 1e200)):
            rec = L3Record(hlc=1 << 20, tombstone=False, tag=_BYTES_TAG, meta=b"", value=b"v",
                           vector=(("far", i + 1),), dot=("far", i + 1),
                           ext=b"\x81\xa1e" + _f64(d))
            out = store.push(f"far/{i}", rec)  # raised CorruptRecord
            assert out.outcome == "new"
            got = store.get(f"far/{i}")
            assert got is not None and got.deadline == d and not got.tombstone
    finally:
        store.close()


# ---------------------------------------------------------------- probes (no fault found)

def test_kill_9_of_sweeping_processes_never_wedges_writers(ns: str) -> None:
    """Processes sweeping (and evicting over) thousands of expired entries are killed with
    SIGKILL at random moments, several times; every write after each kill completes, the
    segment checks clean, and at least one kill landed while the writer lock was held (a
    repair or an owner death counted)."""
    import random
    import signal

    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
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
    not one interval as the contract says. Counted in wake-ups, not wall time."""
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
