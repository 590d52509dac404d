"""Segments of an older layout: what they still owe L3, and carrying it into a new one.

A segment made by an older KVCOMM is refused by this one (its layout version differs:
tiers/shm/layout.py). In cluster mode it may still hold **writes not yet in L3** (dirty
records): acknowledged writes that an upgrade must not drop. So an old segment is never
silently purged: opening it names the unflushed writes, ``kvcomm purge`` refuses it while
it holds any (``--force`` discards them, knowingly), and ``kvcomm migrate`` carries them
into a new segment, where the node daemon delivers them as it delivers any local write.

Reading an old segment's dirty records is tiers/shm/oldlayout.py's.

Migration (:func:`migrate`), with the old segment's users stopped:

1. the old file is renamed aside (``kvcomm.NS.v<old>.migrating``): new users now create a
   new segment, and a crash leaves the old records in the aside file, where the next
   ``kvcomm migrate`` finds them again;
2. every dirty record is written into the new segment with its own version, dirty (the
   daemon pushes it to L3, whose merge keeps whichever version is newer). Where the new
   segment already holds the key, the two are merged by L3's rule
   (:func:`kvcomm.core.resolve.l3_rule`), not by presence: what the new segment holds may
   be a write made after the upgrade (its dot is above the old ones: the new segment's
   write sequence starts at the wall clock, and step 2 raises it past the carried dots),
   but it may as well be an *older* copy from L3 (an agent's L2-miss read, the daemon's
   prewarm or a pulled change, made while a crashed migration left the records aside).
   A record that covers the old write's dot keeps its place (``superseded``); one older
   than it is replaced; a concurrent one is merged last-writer-wins with the merged
   vector (as L3 would; application resolvers are not consulted), dirty so that L3
   learns the merge;
3. the aside file is removed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from ...core.resolve import EQUAL, NEW, OLDER, l3_rule
from ...core.versions import (
    Dotted,
    as_sibling,
    decode_others,
    encode_others,
    vector_get,
)
from ...errors import ConflictError, SegmentError, Unavailable
from ..l2 import open_segment
from .files import check_side_name, segment_path
from .geometry import Layout
from .layout import LAYOUT_VERSION
from .oldlayout import READERS, OldRecord, aside_path, layout_version, unflushed
from .segment import key_hash


@dataclass(frozen=True, slots=True)
class Migrated:
    """What :func:`migrate` did: records carried (written into the new segment, alone or
    merged with what it held), records skipped because the new segment already held a
    write that covers theirs, and the old layout version (0: nothing to do)."""

    carried: int
    superseded: int
    from_version: int


def migrate(name: str, config: Any) -> Migrated:
    """Carry the unflushed writes of namespace ``name``'s older segment into a new one.

    ``config`` is the :class:`kvcomm.Config` the namespace is used with (its L2 geometry
    makes the new segment). Stop the old segment's users first. Idempotent: a migration
    that died half-way is finished by the next call (the aside file is found again).
    Raises SegmentError (the old segment is corrupt or another user's; it is left where
    it is) and what writing the new segment raises (e.g. Unavailable when more writes wait
    than ``cluster.outbound_max``: raise it for the migration).
    """
    c = config.cache
    path = segment_path(name, c.l2_dir)
    check_side_name(name, path)  # (never another namespace's own file)
    found = None
    for v in sorted(READERS):
        if os.path.exists(aside_path(path, v)):
            found = (aside_path(path, v), v)
    if found is None:
        version = layout_version(path, c.l2_permissions)
        if version is None or version == LAYOUT_VERSION:
            return Migrated(0, 0, 0)
        if version not in READERS:
            raise SegmentError(f"{path} has layout version {version}, which this KVCOMM "
                               "cannot read; migrate it with the version that wrote it")
        found = (aside_path(path, version), version)
        os.rename(path, found[0])  # new users now get a new segment; the records wait aside
    aside, version = found
    got = unflushed(aside, c.l2_permissions)
    records = [] if got is None else got[2]
    layout = Layout.plan(c.l2_size, c.max_key_bytes, c.watch_buffer, c.max_views,
                         c.max_value_size, c.l2_keys)
    seg = open_segment(name, layout, config.node.host_id, c.l2_permissions,
                       directory=c.l2_dir, lock_timeout=c.lock_timeout)
    carried = superseded = 0
    try:
        host = config.node.host_id
        old_host = "" if got is None else got[1]
        # the new segment's own dots must stay above the carried ones (first: a write made
        # while this runs must not reuse one of their dots)
        seg.raise_write_sequence(max((r.counter for r in records if old_host == host),
                                     default=0))
        for rec in records:
            if _carry(seg, host, old_host, rec):
                carried += 1
            else:
                superseded += 1
    finally:
        seg.close()
    os.unlink(aside)
    return Migrated(carried, superseded, version)


def _carry(seg: Any, host: str, old_host: str, rec: OldRecord) -> bool:
    """Write the old dirty record ``rec`` into ``seg``, merged with what ``seg`` holds of
    its key by L3's rule (see the module docstring). Returns False when ``seg`` holds a
    write that covers it (nothing written). Raises what the write raises (Unavailable
    when ``seg`` keeps changing under it)."""
    h = key_hash(rec.key)
    # the record's whole vector, told again from the new segment's host (the same one,
    # unless the config names another host: then the old entry is an "other")
    vector = tuple(sorted(decode_others(rec.vvx) + ((old_host, rec.counter),)))
    incoming = Dotted(vector, (old_host, rec.counter), rec.hlc)
    for _ in range(100):
        cur = seg.read(rec.key, h)
        op: tuple[Any, ...]
        if cur is None:
            outcome, after = NEW, incoming
        else:
            held = tuple(sorted(decode_others(cur.vvx)
                                + (((host, cur.counter),) if cur.counter else ())))
            outcome, merged = l3_rule(as_sibling(held, cur.hlc, vector), incoming)
            assert merged is not None
            after = merged
        if outcome in (OLDER, EQUAL):
            return False
        counter, vvx = vector_get(after.vector, host), encode_others(after.vector, host)
        if after.dot == incoming.dot and after.hlc == incoming.hlc:  # the old write wins
            op = (rec.key, h, rec.tag, rec.meta, rec.value, counter, after.hlc, vvx)
            if rec.ext:
                op = (*op, rec.ext)
        else:  # merged, and what the new segment holds wins: it learns the old dot
            assert cur is not None and cur.value is not None
            ext = seg.version(rec.key, h)
            op = (rec.key, h, cur.tag, cur.meta, cur.value, counter, after.hlc, vvx,
                  b"" if ext is None else ext[7])

        def unchanged(kb: bytes = rec.key, h: int = h, seen: Any = cur) -> None:
            now = seg.read(kb, h)
            if (None if now is None else (now.word, now.seq)) != (
                    None if seen is None else (seen.word, seen.seq)):
                raise ConflictError("the key changed while it was merged")

        try:
            seg.apply([op], now_ms=time.time_ns() // 1_000_000, dirty=True, check=unchanged)
        except ConflictError:
            continue  # a write raced this one: merge against it
        return True
    raise Unavailable(f"migrating {rec.key!r}: the key kept changing; run `kvcomm migrate` "
                      "again (the records wait in the aside file)")
