"""The hybrid logical clock: the C kernel's stamps equal the pure Python rules; remote
timestamps beyond cluster.max_clock_skew are refused or counted; the per-host clock
source with its test-only offset."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvcomm
from kvcomm.clock import OffsetClock, clock_for, read_clock_offset, wall_ms, write_clock_offset
from kvcomm.core import codec
from kvcomm.core.versions import (
    ClockSkewError,
    SkewMonitor,
    hlc_ahead_ms,
    hlc_receive,
    hlc_tick,
)
from kvcomm.tiers import l2
from tests.support.helpers import drawn_seed

NOW = 1_800_000_000_000  # ms since the epoch, in 2027


def test_the_c_hlc_stamps_as_the_python_rules(kv: kvcomm.Client) -> None:
    """Random local writes, deletes, merges with a fresh dot (receive) and versioned
    writes (observe) at random, sometimes backwards, wall times: after each, the stamp
    the kernel returns is the one hlc_tick / hlc_receive give."""
    seed = drawn_seed(1 << 30)
    rng = random.Random(seed)
    seg = kv._seg
    tag, meta, payload = codec.encode(b"v")
    model = seg._q[l2.H["HLC"]]  # what the segment holds now
    now = NOW
    keys = [f"hlc/{i}".encode() for i in range(8)]
    checked = 0
    for _ in range(600):
        now += rng.choice([0, 0, 1, 2, 50, -5, -3000])  # the wall clock may step back
        kb = rng.choice(keys)
        h = l2.key_hash(kb)
        op = rng.random()
        if op < 0.4:  # a local write
            hlc = seg.apply([(kb, h, tag, meta, payload)], now_ms=now)[0][1]
            model = hlc_tick(model, now)
        elif op < 0.55:  # a delete that finds a record: a tombstone stamp (tombstones mode)
            if seg.read(kb, h) is None:
                continue
            seg.apply([(kb, h)], now_ms=now, tombstones=True)
            model = hlc_tick(model, now)
            hlc = seg._q[l2.H["HLC"]]
        elif op < 0.8:  # a merge with a remote version: a fresh dot over it (receive)
            # around the host's clock, ahead of it or behind (the clock ratchets forward)
            remote = (max(now, model >> 16) + rng.randrange(-3000, 3000)) << 16 | rng.randrange(1 << 16)
            hlc = seg.apply([(kb, h, tag, meta, payload, l2.NEW_DOT, remote, b"")],
                            now_ms=now)[0][1]
            model = hlc_receive(model, remote, now)
        else:  # a remote version stored as it is (observe: the clock only moves forward)
            remote = (max(now, model >> 16) + rng.randrange(-3000, 3000)) << 16
            counter = seg._q[l2.H["WSEQ"]] + 1
            hlc = seg.apply([(kb, h, tag, meta, payload, counter, remote, b"")], now_ms=now)[0][1]
            assert hlc == remote
            model = max(model, remote)
            hlc = seg._q[l2.H["HLC"]]
        assert hlc == model, (checked, op)
        assert seg._q[l2.H["HLC"]] == model
        checked += 1
    assert checked > 400


@given(st.integers(0, 1 << 60), st.integers(0, 1 << 44), st.integers(-10_000, 10_000),
       st.integers(0, 5000))
def test_remote_timestamps_beyond_the_skew_are_refused(last: int, now: int, lead: int,
                                                       bound: int) -> None:
    remote = max(0, now + lead) << 16
    ahead = hlc_ahead_ms(remote, now)
    if ahead > bound:
        with pytest.raises(ClockSkewError) as info:
            hlc_receive(last, remote, now, max_skew_ms=bound)
        assert info.value.ahead_ms == ahead and "max_clock_skew" in str(info.value)
    else:
        out = hlc_receive(last, remote, now, max_skew_ms=bound)
        assert out == hlc_receive(last, remote, now) and out > max(last, remote)


def test_the_skew_monitor_counts_what_it_cannot_refuse() -> None:
    m = SkewMonitor(500)
    assert not m.observe((NOW + 500) << 16, NOW)
    assert not m.observe((NOW - 10_000) << 16, NOW)  # behind is never skew that hurts
    assert m.observe((NOW + 501) << 16, NOW) and m.observe((NOW + 2000) << 16 | 7, NOW)
    assert (m.beyond, m.max_ahead_ms, m.last_ahead_ms) == (2, 2000, 2000)


def test_a_host_clock_with_a_test_offset(tmp_path: Path) -> None:
    f = tmp_path / "host-2"
    t = {"wall": NOW, "mono": 0.0}
    c = OffsetClock(f, refresh=0.05, wall=lambda: t["wall"], monotonic=lambda: t["mono"])
    assert c.now_ms() == NOW  # no file: no offset
    write_clock_offset(f, 1.5)
    assert c.now_ms() == NOW  # not re-read before refresh has passed
    t["mono"] = 0.06
    assert c.now_ms() == NOW + 1500
    write_clock_offset(f, -0.25)
    t["mono"] = 0.2
    assert c.now_ms() == NOW - 250 and read_clock_offset(f) == -250
    f.write_text("garbage")
    t["mono"] = 0.3
    assert c.now_ms() == NOW - 250 and c.errors == 1  # keeps the last good offset
    with pytest.raises(kvcomm.ConfigError, match="milliseconds"):
        read_clock_offset(f)
    with pytest.raises(kvcomm.ConfigError, match="ten years"):
        write_clock_offset(f, 1e12)


def test_the_clock_a_config_describes(tmp_path: Path) -> None:
    assert clock_for(kvcomm.Config()) is wall_ms
    f = tmp_path / "skew"
    write_clock_offset(f, 3600)
    clock = clock_for(kvcomm.Config.from_mapping({"node": {"test_clock_offset_file": str(f)}}))
    assert clock() - wall_ms() >= 3_599_000
