"""A linearizability checker for registers: Wing & Gong's search with Lowe's memoisation.

Pure: a history in, a verdict out (no clocks, sockets or randomness). It judges what
strong keys promise: every operation appears to take effect at one instant between its
invocation and its completion, in an order that a single register would produce.

Histories
---------
A history is a sequence of :class:`Event` s, in the order they happened (or with times:
``time`` orders them when given; operations of different processes that touch at one
instant overlap, one process's never do). Each process runs one operation at a time: an
``invoke`` then its completion, one of

* ``ok``: it took effect, with this result;
* ``fail``: it certainly did not take effect (a refused request, an error before it was
  sent): it is removed from the history;
* ``info``: unknown (a timeout, a dropped connection): it may or may not have taken
  effect, and if it did, at any instant after its invocation — its completion time is
  unbounded. A read of unknown outcome tells nothing and is removed.

Operations (``f``) on a register per key, whose state is a value or None (absent):

=========  ===================  ==================================================
``put``    value                state := value
``get``    (none)               result: the state (None: absent)
``delete`` (none)               state := None; result: whether a value was there
                                (None: not reported)
``cas``    (expected, new)      if state == expected: state := new, result True;
                                else result False (expected None: create if absent)
=========  ===================  ==================================================

The search
----------
Registers are independent, so each key is checked alone (P-compositionality, as
Porcupine and Knossos do). For one key, the invocations and completions form a list in
time order; the search (Wing & Gong 1993) walks it: at an invocation it tries to
linearize that operation now (the model accepts its result from the current state), and
if it can, removes the operation and starts again from the head; reaching a completion
whose operation is not yet linearized means an earlier choice was wrong: it backtracks.
Lowe's improvement (2017) memoises every (set of linearized operations, state) reached:
a configuration seen once is never explored again, which turns the exponential search
into one that is fast on real histories. An ``info`` operation has no completion: it can
be linearized at any point after its invocation, or never; the history is linearizable
once every ``ok`` operation is linearized.

Bounded: the search counts its steps, and past ``max_steps`` for a key it gives up and
says ``"unknown"`` for that key rather than run for ever (many concurrent operations of
unknown outcome on one key make the space large). Keep few operations per key in flight
(a handful of keys, a few clients) and the search stays small.

A verdict names, for a key that is not linearizable, the operations it could not place:
the first completion that no order could precede, and the longest prefix it found.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import InvalidArgument

INVOKE, OK, FAIL, INFO = "invoke", "ok", "fail", "info"
PUT, GET, DELETE, CAS = "put", "get", "delete", "cas"
FUNCTIONS = (PUT, GET, DELETE, CAS)
Verdict = Literal["ok", "illegal", "unknown"]


@dataclass(frozen=True, slots=True)
class Event:
    """One invocation or completion. ``value``: at ``invoke`` the argument (put: the value;
    cas: ``(expected, new)``), at ``ok`` the result (get: the value read, None for absent;
    cas: True/False; delete: True/False or None). ``time`` is optional: given, events are
    ordered by it (ties: operations of different processes overlap; one process's
    events at one instant keep their list order)."""

    process: Hashable
    type: Literal["invoke", "ok", "fail", "info"]
    f: str
    key: str
    value: Any = None
    time: float | None = None


@dataclass(slots=True)
class Operation:
    """One operation with its interval: ``call`` and ``ret`` positions (``ret`` None:
    unknown outcome, unbounded), its argument, its result (``ok`` only) and status."""

    process: Hashable
    f: str
    key: str
    arg: Any
    result: Any
    status: Literal["ok", "info"]
    call: float
    ret: float | None
    index: int = 0

    def __str__(self) -> str:
        arg = "" if self.f in (GET, DELETE) else f"({self.arg!r})"
        res = f" -> {self.result!r}" if self.status == OK else " -> ?"
        end = "inf" if self.ret is None else f"{self.ret:g}"
        return f"{self.process}: {self.f}{arg}{res} [{self.call:g}, {end}]"


@dataclass
class KeyResult:
    key: str
    verdict: Verdict
    operations: int
    steps: int
    # when illegal: the completed operation that no linearization could precede, and
    # the longest linearization found
    stuck: Operation | None = None
    longest: list[Operation] = field(default_factory=list)

    def explain(self) -> str:
        if self.verdict == "ok":
            return f"{self.key!r}: linearizable ({self.operations} ops, {self.steps} steps)"
        if self.verdict == "unknown":
            return (f"{self.key!r}: unknown: gave up after {self.steps} steps "
                    f"({self.operations} ops)")
        order = "; ".join(str(o) for o in self.longest[-6:])
        return (f"{self.key!r}: NOT linearizable: no order of the operations lets "
                f"[{self.stuck}] complete; longest order found ends with: {order}")


@dataclass
class Result:
    """The verdict over every key: ``"illegal"`` if any key is, else ``"unknown"`` if
    any key is, else ``"ok"``."""

    keys: dict[str, KeyResult]

    @property
    def verdict(self) -> Verdict:
        verdicts = {r.verdict for r in self.keys.values()}
        if "illegal" in verdicts:
            return "illegal"
        return "unknown" if "unknown" in verdicts else "ok"

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"

    def bad(self) -> list[KeyResult]:
        return [r for r in self.keys.values() if r.verdict != "ok"]


# ---------------------------------------------------------------- history -> operations


def operations(history: Iterable[Event]) -> list[Operation]:
    """Pair invocations with completions. Raises InvalidArgument for a malformed history
    (a completion without an invocation, two invocations in flight on one process, an
    unknown function). Failed operations and reads of unknown outcome are dropped;
    invocations never completed count as ``info``."""
    events = list(history)
    if any(e.time is not None for e in events):
        if not all(e.time is not None for e in events):
            raise InvalidArgument("either every event has a time or none has")
        # pairing is per process: each process's events in time order, where a tie
        # between its completion and its next invocation (one clock reading) is read
        # the only way it can be. Across processes, equal times overlap (check_key).
        by_process: dict[Hashable, list[int]] = {}
        for i in sorted(range(len(events)), key=lambda i: (events[i].time, i)):
            by_process.setdefault(events[i].process, []).append(i)
        order = [i for idxs in by_process.values() for i in _alternate(events, idxs)]
        pos: dict[int, float] = {i: float(events[i].time) for i in order}  # type: ignore[arg-type]
    else:
        order = list(range(len(events)))
        pos = {i: float(i) for i in order}
    pending: dict[Hashable, tuple[int, Event]] = {}
    out: list[Operation] = []
    for i in order:
        e = events[i]
        if e.f not in FUNCTIONS:
            raise InvalidArgument(f"unknown function {e.f!r}; a register has {FUNCTIONS}")
        if e.type == INVOKE:
            if e.process in pending:
                raise InvalidArgument(f"process {e.process!r} invoked {e.f} while its "
                                      f"{pending[e.process][1].f} is in flight")
            if e.f == CAS and not (isinstance(e.value, tuple) and len(e.value) == 2):
                raise InvalidArgument(f"a cas is invoked with (expected, new), got {e.value!r}")
            pending[e.process] = (i, e)
            continue
        if e.type not in (OK, FAIL, INFO):
            raise InvalidArgument(f"unknown event type {e.type!r}")
        if e.process not in pending:
            raise InvalidArgument(f"process {e.process!r} completed {e.f} it never invoked")
        j, inv = pending.pop(e.process)
        if (inv.f, inv.key) != (e.f, e.key):
            raise InvalidArgument(f"process {e.process!r} completed {e.f} {e.key!r} but "
                                  f"invoked {inv.f} {inv.key!r}")
        if e.type == FAIL or (e.type == INFO and e.f == GET):
            continue
        status: Literal["ok", "info"] = "ok" if e.type == OK else "info"
        out.append(Operation(e.process, e.f, e.key, inv.value, e.value if e.type == OK else None,
                             status, pos[j], pos[i] if e.type == OK else None))
    for j, inv in pending.values():  # never completed: unknown
        if inv.f != GET:
            out.append(Operation(inv.process, inv.f, inv.key, inv.value, None, "info", pos[j], None))
    return out


def _alternate(events: Sequence[Event], idxs: list[int]) -> list[int]:
    """One process's events (indexes, in time order; ties in list order) with ties
    arranged so that invocations and completions alternate: while an operation is in
    flight, its completion first; else an invocation. What cannot alternate stays as it
    is (and is refused as malformed by the caller)."""
    out: list[int] = []
    rest = list(idxs)
    inflight: Event | None = None
    while rest:
        t = events[rest[0]].time
        pick = 0
        for j, i in enumerate(rest):
            e = events[i]
            if e.time != t:
                break
            if inflight is None and e.type == INVOKE or inflight is not None and \
                    e.type != INVOKE and (e.f, e.key) == (inflight.f, inflight.key):
                pick = j
                break
        i = rest.pop(pick)
        out.append(i)
        inflight = events[i] if events[i].type == INVOKE else None
    return out


# ---------------------------------------------------------------- the model


def step(state: Any, op: Operation) -> tuple[bool, Any]:
    """The register: can ``op`` (with its result) happen in ``state``, and the state
    after it. An operation of unknown outcome accepts any result."""
    f = op.f
    if f == PUT:
        return True, op.arg
    if f == GET:
        return op.result == state, state
    if f == DELETE:
        if op.status == INFO or op.result is None:
            return True, None
        return bool(op.result) == (state is not None), None
    expected, new = op.arg
    matches = state == expected
    if op.status == INFO:
        return True, new if matches else state
    if op.result:
        return matches, new
    return not matches, state


# ---------------------------------------------------------------- the search


class _Entry:
    __slots__ = ("op", "is_call", "match", "prev", "next")

    def __init__(self, op: Operation | None, is_call: bool) -> None:
        self.op = op
        self.is_call = is_call
        self.match: _Entry | None = None  # a call's completion (None: unknown outcome)
        self.prev: _Entry | None = None
        self.next: _Entry | None = None


def check_key(key: str, ops: Sequence[Operation], initial: Any = None,
              max_steps: int = 1_000_000) -> KeyResult:
    """Is the history of one key linearizable from ``initial``? (See the module
    docstring.) Never runs more than ``max_steps`` steps."""
    ops = list(ops)
    for n, o in enumerate(ops):
        o.index = n
    # at equal times, calls come before completions (operations that touch overlap),
    # except a call that follows its own process's completion at that instant (and its
    # completion, if at the same instant too): one process's operations never overlap,
    # whatever the clock's resolution. Those come after, in the process's order.
    ended: dict[tuple[Hashable, float], int] = {}
    for o in ops:
        if o.ret is not None:
            ended[(o.process, o.ret)] = ended.get((o.process, o.ret), 0) + 1
    seq = {id(o): n for n, o in enumerate(sorted(
        ops, key=lambda o: (o.call, float("inf") if o.ret is None else o.ret, o.index)))}
    points: list[tuple[tuple[float, int, int, int], _Entry]] = []
    for o in ops:
        call = _Entry(o, True)
        follows = ended.get((o.process, o.call), 0) - (1 if o.ret == o.call else 0) > 0
        phase = 2 if follows else 0
        points.append(((o.call, phase, seq[id(o)], 0), call))
        if o.ret is not None:
            ret = _Entry(o, False)
            call.match = ret
            points.append(((o.ret, 2 if follows and o.ret == o.call else 1, seq[id(o)], 1),
                           ret))
    points.sort(key=lambda p: p[0])
    head = _Entry(None, True)
    prev = head
    for _, e in points:
        prev.next, e.prev = e, prev
        prev = e
    returns = sum(1 for o in ops if o.ret is not None)

    def lift(e: _Entry) -> None:
        for x in (e, e.match):
            if x is not None:
                assert x.prev is not None
                x.prev.next = x.next
                if x.next is not None:
                    x.next.prev = x.prev

    def unlift(e: _Entry) -> None:
        for x in (e.match, e):
            if x is not None:
                assert x.prev is not None
                x.prev.next = x
                if x.next is not None:
                    x.next.prev = x

    state = initial
    linearized = 0
    seen: set[tuple[int, Any]] = set()
    stack: list[tuple[_Entry, Any]] = []
    longest: list[Operation] = []
    deepest, stuck = -1, None
    steps = 0
    entry = head.next
    while returns:
        steps += 1
        if steps > max_steps:
            return KeyResult(key, "unknown", len(ops), steps)
        assert entry is not None  # a completion always precedes the end while returns > 0
        op = entry.op
        assert op is not None
        if entry.is_call:
            legal, after = step(state, op)
            if legal:
                lin = linearized | (1 << op.index)
                config = (lin, _hashable(after))
                if config not in seen:
                    seen.add(config)
                    stack.append((entry, state))
                    if len(stack) > len(longest):
                        longest = [e.op for e, _ in stack]  # type: ignore[misc]
                    state, linearized = after, lin
                    if entry.match is not None:
                        returns -= 1
                    lift(entry)
                    entry = head.next
                    continue
            entry = entry.next
            continue
        # a completion whose operation is not linearized yet: an earlier choice was wrong
        if len(stack) >= deepest:  # the completion that blocked the longest order
            deepest, stuck = len(stack), op
        if not stack:
            return KeyResult(key, "illegal", len(ops), steps, stuck=stuck, longest=longest)
        entry, state = stack.pop()
        assert entry.op is not None
        linearized &= ~(1 << entry.op.index)
        if entry.match is not None:
            returns += 1
        unlift(entry)
        entry = entry.next
    return KeyResult(key, "ok", len(ops), steps)


def _hashable(v: Any) -> Any:
    try:
        hash(v)
    except TypeError:
        return repr(v)
    return v


def check(history: Iterable[Event], *, initial: Any = None,
          max_steps: int = 1_000_000) -> Result:
    """Check a whole history, key by key (each from ``initial``, None: absent).
    ``max_steps`` bounds the search of each key. Raises InvalidArgument for a malformed
    history."""
    by_key: dict[str, list[Operation]] = {}
    for op in operations(history):
        by_key.setdefault(op.key, []).append(op)
    return Result({k: check_key(k, ops, initial, max_steps) for k, ops in sorted(by_key.items())})
