"""The change feed's entries and the hints that carry them: parsing, never raising.
Pure: no Redis, no I/O.

An entry is value-less ``{k, q, n}`` (the key, its sequence number, a note of the
record's version) or inline ``{k, r, s}`` (the record itself); a hint is a sequence
number, or a value-less entry as ``seq id note key``. See :mod:`kvcomm.tiers.l3`
("Change feed", "Sequence numbers", "Hints, and the sweep").
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from .records import _ACTOR, _valid_counter

FEED_MAXLEN = 100_000  # events kept per group stream at most (approximate: MAXLEN ~)
FEED_TOTAL = 1_638_400  # events kept over all groups' streams (cluster.feed_total, >= 100 x groups)
FEED_MIN = 100  # events kept per group stream at least, however many groups
FEED_INLINE = 128  # records up to this size (bytes) ride in their feed entry; larger: value-less


class FeedNote(NamedTuple):
    """The version a value-less feed entry announces, the record's dot and two flags
    (the record itself stays in L3)."""

    writer: str  # the host of the write that made the record (its dot's actor)
    counter: int  # the dot's counter
    tombstone: bool
    merged: bool  # the push script merged two hosts' records (the vector is a new one)


class FeedEntry(NamedTuple):
    """One change-feed entry. ``key`` is None and ``problem`` says why when the entry
    cannot be used (a key field that is not strict UTF-8, say); ``seq`` is None when
    the entry has no valid sequence number (written by something else). An entry
    carries either the record (``record``, ``note`` None: inline) or only its version
    (``note``, ``record`` b"": value-less; read the record from L3 if the key is wanted)."""

    id: bytes
    key: str | None
    record: bytes
    seq: int | None
    problem: str = ""
    note: FeedNote | None = None


def _seq(raw: object) -> int | None:
    return int(raw) if isinstance(raw, bytes) and raw.isdigit() and len(raw) < 20 else None


def _note(raw: bytes) -> FeedNote | None:
    """A value-less entry's note (``counter:flags:actor``), or None if it is not one."""
    parts = raw.split(b":", 2)
    if len(parts) != 3:
        return None
    counter, flags, actor = parts
    if (not counter.isdigit() or len(counter) > 16 or not _valid_counter(int(counter))
            or not _ACTOR.match(actor) or flags not in (b"", b"d", b"m", b"dm")):
        return None
    return FeedNote(actor.decode("ascii"), int(counter), b"d" in flags, b"m" in flags)


def _entry(eid: Any, fields: Any) -> FeedEntry:
    """Parse one XRANGE row, never raising: whatever is wrong goes into ``problem``.
    Both kinds of entry are read: inline ``{k, r, s}`` (every entry before value-less
    ones existed) and value-less ``{k, q, n}``."""
    eid = eid if isinstance(eid, bytes) else str(eid).encode()
    if not isinstance(fields, dict):
        return FeedEntry(eid, None, b"", None, "entry fields are not a map")
    kb, rec, raw_note = fields.get(b"k"), fields.get(b"r"), fields.get(b"n")
    note = None
    if isinstance(raw_note, bytes) and rec is None:  # value-less
        seq = _seq(fields.get(b"q"))
        note = _note(raw_note)
        if note is None:
            return FeedEntry(eid, None, b"", seq, f"entry's version note {raw_note[:80]!r} "
                             "is not counter:flags:host")
        rec = b""
    else:
        seq = _seq(fields.get(b"s"))
    if not isinstance(kb, bytes) or not isinstance(rec, bytes):
        return FeedEntry(eid, None, b"", seq, "entry lacks its key (k) or record (r) field")
    try:
        key = kb.decode("utf-8")  # strict: no lone surrogates, nothing redis-py cannot send
    except UnicodeDecodeError:
        return FeedEntry(eid, None, rec, seq, f"key {kb[:80]!r} is not valid UTF-8")
    if not key or "\0" in key:
        return FeedEntry(eid, None, rec, seq, f"key {kb[:80]!r} is empty or holds NUL")
    return FeedEntry(eid, key, rec, seq, "", note)


def _hint_entry(data: bytes) -> FeedEntry | None:
    """The value-less feed entry a hint carries (``seq id note key``: see the push
    script), or None when ``data`` is not one (never raising: a hint may come from
    anything that can publish)."""
    parts = data.split(b" ", 3)
    if len(parts) != 4:
        return None
    raw_seq, eid, raw_note, kb = parts
    seq, note = _seq(raw_seq), _note(raw_note)
    if seq is None or note is None or not _valid_id(eid):
        return None
    try:
        key = kb.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if not key or "\0" in key:
        return None
    return FeedEntry(eid, key, b"", seq, "", note)


def _as_id(v: Any) -> bytes:
    return v if isinstance(v, bytes) else str(v).encode()


_ID = re.compile(rb"\d{1,20}-\d{1,20}\Z")


def _valid_id(v: object) -> bool:
    return isinstance(v, bytes) and bool(_ID.match(v))


def _as_seq(v: object) -> int | None:
    """A sequence number from Redis (bytes of digits), or None if it is not one."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v if v >= 0 else None
    if isinstance(v, bytes) and v.isdigit() and len(v) < 20:
        return int(v)
    return None
