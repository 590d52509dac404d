"""Each process's counts, flushed into the host's L2: the agents' side of the metrics.

A client counts in plain integers of its own — the C getter's L1/L2 hit counts, the
client's counters, its L3 client's wire counts, sampled latency histograms — and never
touches shared memory to count. Its :class:`Meter` turns those cumulative counts into
deltas and adds them to the segment's metrics region with atomic adds
(:class:`~kvcomm.tiers.shm.counters.MetricsRegion`): every ``metrics.flush_interval``
from one background thread per process (:func:`_flusher`, which also hands the getter's
sampled reads to the host's hot keys), when the client closes or is garbage-collected
unclosed (``Client.__del__``), and at interpreter exit. So the region's counters are
exact host-wide totals, at most one flush interval behind what the processes did; a
process killed outright loses its counts since its last flush (never more), and none is
ever counted twice (a forked child starts with no meters: the parent's counts stay the
parent's).

Errors (``kvcomm.errors.MADE``) are counted per process, not per client: they are added
to whichever namespace flushes first after they happen (a forked child's count starts at
zero, as its meters do).

Sources: the node daemon adds its own counts (:meth:`Meter.add_source`) and gauges
(:meth:`Meter.add_gauges`), flushed the same way.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .. import errors
from .._threads import start_quiet
from .._weak import WeakRegistry
from ..tiers.shm.counters import MetricsRegion, deltas, hist_word, series_word
from ..tiers.shm.layout import HIST_WORDS, LATENCY_BOUNDS_NS

if TYPE_CHECKING:
    from .._client.client import Client

log = logging.getLogger("kvcomm.metrics")

_W = series_word
_READS = {(t, r): _W(f"reads_total{{tier={t},result={r}}}") for t, r in (
    ("l1", "hit"), ("l1", "miss"), ("l2", "hit"), ("l2", "miss"), ("l2", "absent"),
    ("l3", "hit"), ("l3", "absent"))}
_ERROR_WORDS = {name: _W(f"errors_total{{type={name}}}") for name in (
    "InvalidKey", "UnsupportedValue", "ValueTooLarge", "ConflictError", "ValidationError",
    "InvalidArgument", "ConfigError", "SegmentError", "Unavailable", "CorruptRecord",
    "UnflushedWrites")}
_ERROR_OTHER = _W("errors_total{type=other}")
_COUNTER_WORDS = {  # client.counters name → series
    "conflicts": _W("conflicts_total"), "merges": _W("merges_total"),
    "resolver_failures": _W("resolver_failures_total"), "views": _W("views_total"),
    "batches": _W("batches_total"), "updates": _W("updates_total"),
    "filter_hits": _W("guard_answers_total{guard=filter}"),
    "negative_hits": _W("guard_answers_total{guard=negative}"),
}


def client_counts(client: Client) -> dict[int, int]:
    """Everything ``client`` counted so far (cumulative), by metrics word."""
    g = client._getter
    c = client.counters
    l2_hits = g.l2_hits + client._l2_hits
    misses = client._l2_misses
    out = {
        _READS["l1", "hit"]: g.hits + client._l1_hits,
        _READS["l1", "miss"]: l2_hits + misses,
        _READS["l2", "hit"]: l2_hits,
        _READS["l2", "miss"]: misses - c["l2_absent"],
        _READS["l2", "absent"]: c["l2_absent"],
        _READS["l3", "hit"]: c["l3_hits"],
        _READS["l3", "absent"]: c["l3_absent"],
    }
    strong = c["puts_strong"]
    out[_W("writes_total{kind=put,consistency=eventual}")] = client._puts - strong
    out[_W("writes_total{kind=put,consistency=strong}")] = strong
    deletes = "strong" if client._default_strong else "eventual"
    out[_W(f"writes_total{{kind=delete,consistency={deletes}}}")] = c["deletes"]
    for name, word in _COUNTER_WORDS.items():
        out[word] = c[name]
    l3 = client._l3
    if l3 is not None:
        wire_counts(l3.wire, out)
    for tier, row in zip(("l1", "l2"), g.latency, strict=True):
        if row[-1]:
            _hist(out, ("get", tier), row)
    for series, h in list(client._lat.items()):  # (a snapshot, taken in C: another thread's
        _hist(out, series, h.counts, add=series == ("get", "l2"))  # first write of a series
    # adds one meanwhile, and the dict's own iterator would raise, failing kv.close())
    return out


def wire_counts(wire: Any, out: dict[int, int]) -> None:
    """Add an L3 client's :class:`~kvcomm.metrics.wire.WireCounts` to ``out``."""
    for word, n in ((_W("l3_commands_total"), wire.commands),
                    (_W("l3_bytes_total{direction=sent}"), wire.sent),
                    (_W("l3_bytes_total{direction=received}"), wire.received)):
        out[word] = out.get(word, 0) + n


def _hist(out: dict[int, int], series: tuple[str, str], row: Any, add: bool = False) -> None:
    base = hist_word(*series)
    for i in range(HIST_WORDS):
        out[base + i] = (out.get(base + i, 0) if add else 0) + int(row[i])


class Meter:
    """One client's flushes into its segment's metrics region."""

    def __init__(self, client: Client) -> None:
        self._client = weakref.ref(client)
        self.interval = client.config.metrics.flush_interval  # (0: only when closed)
        self.due = 0.0
        self._region = MetricsRegion(client._seg)
        self._before: dict[int, int] = {}
        self._sources: list[Callable[[], Mapping[int, int]]] = []
        self._gauges: list[Callable[[], Mapping[int, int]]] = []

    def add_source(self, fn: Callable[[], Mapping[int, int]]) -> None:
        """Also flush the cumulative counts ``fn()`` returns (by word)."""
        self._sources.append(fn)

    def add_gauges(self, fn: Callable[[], Mapping[int, int]]) -> None:
        """Also store the gauges ``fn()`` returns (by word) at every flush."""
        self._gauges.append(fn)

    def flush(self, client: Client | None = None) -> None:
        """Add what was counted since the last flush, store the gauges and hand the
        getter's sampled reads to the host's hot keys (never waiting for the writer lock).
        ``client``: the client being finalised (its weak reference is already dead then;
        its sampled reads are not flushed: that takes locks a finaliser must not).
        Raises what the segment raises (SegmentError: purged; the counts stay to be added
        next time) and what a gauge source raises (the counts were added: only the gauges
        are missing)."""
        final = client
        with _STATE.lock:
            client = client if client is not None else self._client()
            if client is None:
                return
            now = client_counts(client)
            for fn in self._sources:
                for word, n in fn().items():
                    now[word] = now.get(word, 0) + n
            adds = deltas(now, self._before)
            err_now: dict[int, int] = {}
            for name, n in list(errors.MADE.items()):
                word = _ERROR_WORDS.get(name, _ERROR_OTHER)
                err_now[word] = err_now.get(word, 0) + n
            err_adds = deltas(err_now, _STATE.errors_before)
            try:
                self._region.add(adds + err_adds)
            except BaseException:  # nothing was added (a closed segment): next time
                for word, d in adds:
                    self._before[word] -= d
                for word, d in err_adds:
                    _STATE.errors_before[word] -= d
                raise
            for fn in self._gauges:
                for word, value in fn().items():
                    self._region.store(word, value)
        if client is not final:
            # (outside the process's lock: it only tries the writer lock, and keeps the
            # counts for later when that is held)
            client._flush_hot()


class _State:
    """The process's meters and its flusher thread (reset in a forked child)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.meters: WeakRegistry[Meter] = WeakRegistry()  # (never a WeakSet: _weak.py)
        self.errors_before: dict[int, int] = {}
        self.interval = 0.0
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None
        self.pid = os.getpid()


_STATE = _State()


def attach(client: Client) -> Meter:
    """Start metering ``client``: its getter times one read in ``metrics.latency_sample``,
    and its counts are flushed every ``metrics.flush_interval`` (and by :func:`detach`)."""
    m = client.config.metrics
    if m.latency_sample:
        client._getter.time_every(m.latency_sample, LATENCY_BOUNDS_NS)
    meter = Meter(client)
    meter.due = time.monotonic() + m.flush_interval
    with _STATE.lock:
        _STATE.meters.add(meter)
        interval = m.flush_interval
        if interval > 0 and (not _STATE.interval or interval < _STATE.interval):
            _STATE.interval = interval
            _STATE.wake.set()
        if _STATE.interval and (_STATE.thread is None or not _STATE.thread.is_alive()):
            _STATE.thread = threading.Thread(target=_flusher, name="kvcomm-metrics",
                                             daemon=True)
            start_quiet(_STATE.thread)
    return meter


def detach(meter: Meter, client: Client | None = None) -> None:
    """A last flush, then stop metering (``client``: the client being finalised, see
    :meth:`Meter.flush`). Never raises a KVCommError (a purged namespace's counts no
    longer matter)."""
    with _STATE.lock:
        _STATE.meters.discard(meter)
        try:
            meter.flush(client)
        except errors.KVCommError:
            pass


def flush_all(due_only: bool = False) -> None:
    """Flush every meter of this process now (tests, tools, exit); ``due_only``: those
    whose interval has passed (the flusher's round). A meter whose segment fails is
    skipped."""
    now = time.monotonic()
    with _STATE.lock:
        meters = [m for m in _STATE.meters
                  if not due_only or (m.interval > 0 and now >= m.due)]
    for meter in meters:
        if meter.interval > 0:
            meter.due = now + meter.interval
        try:
            meter.flush()
        except Exception as exc:  # a purged or closed namespace: nothing to count into
            log.debug("metrics flush skipped: %s", exc)


def _flusher() -> None:
    state = _STATE
    while True:
        state.wake.wait(state.interval)
        state.wake.clear()
        if state.pid != os.getpid():
            return
        flush_all(due_only=True)


def _after_fork_in_child() -> None:
    global _STATE
    _STATE = _State()  # the parent's meters, lock and thread are the parent's


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(flush_all)
