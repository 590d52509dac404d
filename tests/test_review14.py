"""Review 14: an adversarial review of per-key TTL and presence (issue 14).

Each test reproduces one finding (it failed before its fix) on a real segment:

* F1: L2 space held by expired clean entries is reclaimed before any live entry is
  evicted (the contract); CLOCK evicted live entries whose reference bit was clear while
  expired ones further along still held their space.
* F2: the C kernel and Python read the same deadline out of every extension field L2
  accepts; they disagreed on a repeated "e", an "e" key not packed as a fixstr, and a
  deadline packed as a signed integer, so a key could be expired for one reader and live
  for another (the getter served a key whose deadline had passed).
* F3: the expiry sweep takes no writer lock while no record has a deadline (it took it
  every ``cache.expiry_sweep`` in every process), and stops taking it once every deadline
  has been reclaimed.
"""

from __future__ import annotations

import struct
import time

import kvcomm
from kvcomm.core.expiry import deadline_of
from kvcomm.tiers.l2 import key_hash
from tests.conftest import SMALL

_BYTES_TAG = 1


def _cfg(**cache: object) -> kvcomm.Config:
    return kvcomm.Config.from_mapping({**SMALL, "cache": {**SMALL["cache"], **cache}})


def _held(kv: kvcomm.Client, key: str) -> bool:
    """Whether this host's L2 physically holds ``key``'s record (a lock-free look that,
    unlike a read, never reclaims an expired one)."""
    kb = key.encode()
    return kv._seg.version(kb, key_hash(kb)) is not None


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
