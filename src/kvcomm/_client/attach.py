"""What a process shares between its clients: one L2 mapping and one L1 per namespace,
the live zero-copy views, and what fork() does to them."""

from __future__ import annotations

import functools
import os
import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Any

from .._weak import WeakRegistry
from ..config import Config
from ..errors import KVCommError, KVCommWarning
from ..tiers import l2 as l2mod
from ..tiers.l1 import L1Cache, process_budget
from ..tiers.l2 import L2Segment, Layout
from .sweeper import Sweeper

if TYPE_CHECKING:
    from .base import ClientBase


class _Attached:
    """A namespace this process has mapped: its segment, its L1 and how many clients use it."""

    __slots__ = ("seg", "l1", "refs", "index", "lock", "sweeper", "daemon_warned")

    def __init__(self, seg: L2Segment, l1: L1Cache, sweep: float) -> None:
        self.seg, self.l1, self.refs = seg, l1, 0
        self.daemon_warned = False  # "the node daemon does not heartbeat" was said (base.py)
        self.index: Any = None  # the ordered key index, made at the first scan (scan.py)
        self.lock = threading.Lock()
        self.sweeper = Sweeper(seg, sweep)  # keys past their deadline (sweeper.py)


class _Shared:
    """One L2 mapping and one L1 per (process, namespace), shared by every Client on it."""

    lock = threading.Lock()
    attached: dict[str, _Attached] = {}

    @classmethod
    def acquire(cls, name: str, config: Config) -> _Attached:
        with cls.lock:
            entry = cls.attached.get(name)
            if entry is not None and entry.seg.purged:
                del cls.attached[name]  # its clients keep it (and get SegmentError) until closed
                entry = None
            c = config.cache
            layout = Layout.plan(c.l2_size, c.max_key_bytes, c.watch_buffer, c.max_views,
                                 c.max_value_size, c.l2_keys)
            if entry is not None:  # (attached already in this process: as it is)
                l2mod.warn_other_size(entry.seg, layout)
            else:
                seg = l2mod.open_segment(name, layout, config.node.host_id, c.l2_permissions,
                                         directory=c.l2_dir, lock_timeout=c.lock_timeout)
                entry = cls.attached[name] = _Attached(seg, process_budget().cache(),
                                                       c.expiry_sweep)
            entry.refs += 1
            return entry

    @classmethod
    def release(cls, entry: _Attached) -> None:
        with cls.lock:
            entry.refs -= 1
            if entry.refs > 0:
                return
            if cls.attached.get(entry.seg.name) is entry:
                del cls.attached[entry.seg.name]
        process_budget().drop(entry.l1)
        entry.sweeper.stop()
        entry.seg.close()


_CLIENTS: WeakRegistry[ClientBase] = WeakRegistry()  # (never a WeakSet: _weak.py)


_VIEWS: dict[int, tuple[Any, Any, tuple[int, int]]] = {}  # id(weakref) -> (the weakref, the
# kernel's Core the pin is in, the pin): the Core outlives its segment's close while views do


def _register_view(arr: Any, core: Any, pin: tuple[int, int]) -> None:
    """Tie ``pin`` (taken through ``core``, the segment's kernel object) to the life of
    ``arr``: released when the last reference goes. Once registered, the pin is the
    view's (``core.pin_kept``): no longer the caller's to drop."""
    # The weakref's callback is C alone (a partial of the kernel's unpin: it removes the
    # registry's entry and releases exactly this pin, never a later pin of the same entry,
    # never the parent's in a forked child): a Python callback would let a pending
    # SIGINT's handler run inside it, and its KeyboardInterrupt be dropped. A weakref
    # callback costs a tenth of weakref.finalize; the registry keeps the weakref.
    ref = weakref.ref(arr, functools.partial(core.unpin, pin[0], pin[1], _VIEWS))
    _VIEWS[id(ref)] = (ref, core, pin)
    core.pin_kept()


def _mark_forked() -> None:
    """In a child of fork(): the parent's clients are unusable here (their locks and caches
    are the parent's), and the views the child inherited get pins of their own, so they stay
    valid when the parent drops its copies (and the child dropping them frees nothing of
    the parent's)."""
    for c in list(_CLIENTS):
        c._forked = c._unusable = True
        c._l1_entries = {}
        c._getter.close()
        c.__dict__.pop("get", None)
    _Shared.attached = {}
    _Shared.lock = threading.Lock()
    process_budget().forget()
    inherited = list(_VIEWS.values())
    _VIEWS.clear()
    forked: set[int] = set()
    for ref, core, pin in inherited:
        arr = ref()
        if arr is None:
            continue
        if id(core) not in forked:  # (also a closed segment's Core, which no fork handler
            core.forked()  # reaches: the parent's token and pins are not the child's)
            forked.add(id(core))
        try:
            off = core.pinned_block(pin[0])
            new = core.pin_block(off) if off else (-1, 0)
        except (KVCommError, ValueError) as exc:
            warnings.warn(f"a zero-copy view inherited through fork() could not be pinned "
                          f"({exc}); copy it if the child keeps it", KVCommWarning, stacklevel=1)
            continue
        if new[0] >= 0:
            _register_view(arr, core, new)



os.register_at_fork(after_in_child=_mark_forked)
