"""L2: one shared-memory segment per namespace per host, mapped by every agent process.

The segment is a file in ``cache.l2_dir`` (``/dev/shm``; owner-only by default) whose
layout is defined once, in :mod:`kvcomm.tiers.shm.layout`. Slots form an open-addressing
hash table pointing at immutable (copy-on-write) record blocks; **readers take no lock**
(a seqlock per slot), **writers take one** robust process-shared mutex, and a writer that
finds the previous holder died mid-mutation (BUSY raised) recovers first. Batches are all
or nothing; deletes in cluster mode are tombstones; zero-copy views pin their block;
eviction (CLOCK) drops clean, unpinned entries and is never a delete.

Where each part lives (a class per noun, combined here into :class:`L2Segment`)::

    shm/layout.py    every field of the segment, named once (generates the C header)
    shm/geometry.py  Layout: a config's sizes as regions; the header check on attach
    shm/files.py     the namespace's files: names, paths (every one), owner and mode checks
    shm/segment.py   SegmentCore: open/create, the writer lock, lock-free reads, repair
    shm/writes.py    Writes: put, all-or-nothing batches, what a refused write means
    shm/pins.py      Pins: zero-copy views keep their block
    shm/feed.py      Feed: the change feed ring and its readers
    shm/hotkeys.py   HotKeys: the host's Count-Min Sketch and top-k
    shm/sync.py      SyncState: the node daemon's words (dirty keys, cursor, heartbeat)
    shm/checker.py   Checker: every invariant, walked independently of the C kernel
    shm/oldlayout.py an older layout's unflushed writes (refusals name them; migrate)
    shm/migrate.py   kvcomm migrate: those writes carried into a new segment
    _l2core_c/*.c    the C kernel, one file per noun (lock, read, heap, slots, write, ...)

Memory ordering: stores and loads through ``memoryview.cast("Q")`` are single aligned
8-byte moves, which x86-64 keeps in program order (TSO); everything that needs more goes
through the C kernel's atomics. On other architectures this module refuses to load.

Design (the theory of operation: slots, copy-on-write records, lock-free readers, the
writer lock and its recovery, batches, tombstones, pins, the feed, eviction):
docs/design/l2.md.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any

from ..errors import KVCommError, KVCommWarning, SegmentError, UnflushedWrites
from .shm.checker import Checker
from .shm.feed import Feed, FeedEvent
from .shm.files import (
    SHM_DIR,
    check_owner,
    check_side_name,
    pid_alive,
    remove_dead_temps,
    segment_path,
    watch_dir,
)
from .shm.geometry import Layout
from .shm.hotkeys import HotKeys
from .shm.layout import (
    FLAG_DIRTY,
    KIND_DELETE,
    KIND_EVICT,
    KIND_NAMES,
    KIND_PUT,
    KIND_RESYNC,
    LAYOUT_VERSION,
    SLOT,
    SLOT_WORDS,
    TAG_TOMBSTONE,
    H,
)
from .shm.oldlayout import unflushed
from .shm.pins import Pins
from .shm.segment import _H_DEFERRED, _H_FEED_HEAD, DEFAULT_LOCK_TIMEOUT, NEW_DOT, Record, key_hash
from .shm.sync import SyncState
from .shm.writes import Writes

# the names other modules import from here (the segment's public face)
__all__ = [
    "DEFAULT_LOCK_TIMEOUT", "FLAG_DIRTY", "FeedEvent", "H", "KIND_DELETE", "KIND_EVICT",
    "KIND_NAMES", "KIND_PUT", "KIND_RESYNC", "L2Segment", "LAYOUT_VERSION", "Layout", "NEW_DOT",
    "Record", "SHM_DIR", "SLOT", "SLOT_WORDS", "TAG_TOMBSTONE", "check_owner", "key_hash",
    "open_segment", "pid_alive", "purge", "segment_path",
]


class L2Segment(Writes, Pins, Feed, HotKeys, Checker, SyncState):
    """One mapped L2 segment. Thread-safe; one instance per process per namespace.

    Public methods raise SegmentError (unusable segment), ValueTooLarge (a record can never
    fit), Unavailable (full of pinned or unflushed data, lock held too long), InvalidArgument
    (a write from inside a validator). None of them leaves the segment in a state another
    process cannot use.
    """

    def info(self) -> dict[str, Any]:
        q = self._q
        lay = self.layout
        return {
            "name": self.name,
            "path": self.path,
            "host_id": self.host_id,
            "size_bytes": lay.total,
            "data_bytes": lay.data_size,
            "used_bytes": q[H["USED"]],
            "reserved_bytes": self.reserved_bytes(),
            "entries": q[H["ENTRIES"]],
            "dirty": q[H["DIRTY"]],
            "slots": lay.n_slots,
            "evictions": q[H["EVICTIONS"]],
            "recoveries": q[H["RECOVERIES"]],
            "owner_deaths": q[H["OWNER_DEATHS"]],
            "pinned_deferred_blocks": q[_H_DEFERRED],
            "write_seq": q[H["WSEQ"]],  # (the host's write sequence: clock-seeded, not a count)
            "feed_events": q[_H_FEED_HEAD],
            "feed_capacity": lay.feed_n,
            "daemon_pid": q[H["DAEMON_PID"]],
            "daemon_alive": self.daemon_alive(),
            "daemon_beat_ms": q[H["DAEMON_BEAT"]],  # its last heartbeat (0: never)
            "sync_backlog": q[H["DIRTY"]],
            "set_aside": q[H["SET_ASIDE"]],
            "max_record_bytes": self._max_record,
        }



def open_segment(name: str, layout: Layout, host_id: str, permissions: int,
                 directory: str = SHM_DIR, lock_timeout: float = DEFAULT_LOCK_TIMEOUT) -> L2Segment:
    """Attach to namespace ``name``, creating it with ``layout`` if it does not exist.

    Warns (KVCommWarning) when the namespace exists with another size than ``layout``'s:
    the existing segment is used as it is. Raises SegmentError.
    """
    try:
        seg = L2Segment(name, create_layout=layout, host_id=host_id, permissions=permissions,
                        directory=directory, lock_timeout=lock_timeout)
    except KVCommError:
        raise
    except OSError as exc:
        raise SegmentError(f"cannot map L2 segment {name!r}: {exc.strerror}") from None
    if not seg.created:
        warn_other_size(seg, layout)
    else:
        _warn_larger_than_its_directory(seg, directory)
    return seg


_DEFERRED = threading.local()  # .sink: the warnings of an open run for kvcomm.aio (below)


def deferred_warnings(sink: list[str] | None) -> None:
    """On this thread, from now on: the open's warnings go to ``sink`` (a list of their
    messages) instead of being warned; None: warned again. kvcomm.aio opens a client in
    its pool and warns them on the event loop, where the caller's line is."""
    _DEFERRED.sink = sink


def warn_other_size(seg: L2Segment, layout: Layout) -> None:
    """Warn (KVCommWarning, at the caller's first line outside kvcomm) when ``seg``, an
    existing namespace's segment, is not the size ``layout`` asks for: it is used as it is."""
    if seg.layout.total != layout.total:
        name = seg.name
        sink = getattr(_DEFERRED, "sink", None)
        (sink.append if sink is not None else warn_outside_kvcomm)(
            f"namespace {name!r} already exists with a segment of {seg.layout.total} bytes; "
            f"the configured cache (l2_size, l2_keys, max_key_bytes, watch_buffer, max_views: "
            f"a {layout.total}-byte segment) is ignored until the namespace is purged "
            f"(`kvcomm purge --name {name}`)")


def _warn_larger_than_its_directory(seg: L2Segment, directory: str) -> None:
    """Warn when the new segment ``seg`` is larger than the filesystem it is in can ever
    hold (its file is sparse: the memory is taken as it fills)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return
    room = st.f_blocks * st.f_frsize
    if seg.layout.total > room:
        sink = getattr(_DEFERRED, "sink", None)
        (sink.append if sink is not None else warn_outside_kvcomm)(
            f"namespace {seg.name!r} was made {seg.layout.total / 2**30:.1f} GiB large "
            f"(cache.l2_size), more than cache.l2_dir {directory!r} holds "
            f"({room / 2**30:.1f} GiB, shared with every file there): once that is full its "
            "writes fail with SegmentError (nothing lost); lower cache.l2_size, or grow that "
            "tmpfs, then purge the namespace and open it again")


def warn_outside_kvcomm(message: str) -> None:
    """A KVCommWarning at the caller's first line outside kvcomm."""
    warnings.warn(message, KVCommWarning, stacklevel=_outside_kvcomm())


def _outside_kvcomm() -> int:
    """The ``stacklevel`` of warnings.warn, called in this function's caller, that names
    the first frame outside the kvcomm package (the user's line)."""
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame: Any = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(root):
        frame, level = frame.f_back, level + 1
    return level


def purge(name: str, directory: str = SHM_DIR, *, keep_unflushed: bool = False) -> bool:
    """Remove namespace ``name``'s files and mark its segment purged (its users get
    SegmentError from then on, L1 hits included).

    Always removes the segment file, even a corrupt, foreign or locked one; the segment
    is marked purged only once its file is gone (a file that cannot be removed is left as
    it was, unmarked). With ``keep_unflushed`` (what ``kvcomm purge`` does unless
    ``--force``), a segment holding writes not yet in L3 — of this layout (its dirty
    counter and its slots' dirty flags agree that writes wait; its mode may be any) or of
    an older one (see tiers/shm/migrate.py) — is left alone: UnflushedWrites says how many
    and what to do. Returns False when there was no segment. Raises SegmentError for a bad name,
    OSError when the file cannot be removed (the caller says what to do).
    """
    path = segment_path(name, directory)
    check_side_name(name, path)  # (never another namespace's own file)
    remove_dead_temps(path)  # (creators killed while creating it)
    if not os.path.lexists(path):
        from ..placement.report import remove_table
        from .keyfilter import remove

        remove(name, directory)
        remove_table(name, directory)
        _remove_watches(name, directory)
        _remove_vectors(name, directory)
        return False
    try:
        # any mode (cache.l2_permissions may be wider than the default; the file is being
        # removed, not used): a segment made with 0o660 must still be looked into
        seg: L2Segment | None = L2Segment(name, create_layout=None, host_id="", attach_timeout=0,
                                          permissions=0o777, directory=directory,
                                          lock_timeout=1.0)
    except Exception:  # foreign, broken or not ours: removing the file is all we can do
        seg = None
    if keep_unflushed:
        _refuse_unflushed(name, path, seg)
    try:
        os.unlink(path)
        if seg is not None:
            try:
                seg.mark_purged()
            except (KVCommError, OSError, ValueError):
                pass  # a lock held by a stopped process, say: new users get a new segment
    finally:
        if seg is not None:
            seg.close()
    from ..placement.report import remove_table
    from .keyfilter import remove

    remove(name, directory)  # the daemon's filter of existing keys goes with the namespace
    remove_table(name, directory)  # and so do the agents' placement reports
    _remove_watches(name, directory)  # and the watchers' registrations
    _remove_vectors(name, directory)  # and the LangGraph store's vector indexes
    return True


def _remove_vectors(name: str, directory: str) -> None:
    from .vectors import remove_all

    remove_all(name, directory)


def _remove_watches(name: str, directory: str) -> None:
    import shutil

    shutil.rmtree(watch_dir(name, directory), ignore_errors=True)


def _refuse_unflushed(name: str, path: str, seg: L2Segment | None) -> None:
    """Raise UnflushedWrites when the segment at ``path`` holds writes not yet in L3."""
    if seg is not None:
        # The header's counter and the slots' flags must agree that writes wait: a corrupt
        # counter alone (or one flag bit) is no unflushed write, and must not make a
        # corrupt segment unremovable. (Both corrupt at once: refused, --force removes it.)
        try:
            n = min(seg.dirty_count, len(seg.dirty_keys())) if seg.dirty_count else 0
        except Exception:  # slots that cannot be scanned: nothing can be saved from them
            n = 0
        if n:
            seg.close()
            raise UnflushedWrites(
                f"namespace {name!r} holds {n} writes not yet in L3; start (or wait for) its "
                f"node daemon (`kvcomm node`), or discard them: `kvcomm purge --name {name} "
                "--force`")
        return
    try:
        old = unflushed(path, 0o7777)
    except SegmentError:
        return  # not readable as any layout: nothing can be saved from it
    if old is not None and old[2]:
        raise UnflushedWrites(
            f"namespace {name!r} has a segment of layout {old[0]} holding {len(old[2])} writes "
            f"not yet in L3; carry them over with `kvcomm migrate --name {name}`, or discard "
            f"them: `kvcomm purge --name {name} --force`")

