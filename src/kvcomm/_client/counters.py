"""Counters in L2 records: the state an ``incr`` starts from, the delete that keeps what it
saw, and the merge of a counter with a concurrent version (the state: core/counter.py).

A live counter is a record of tag ``codec.COUNTER`` whose payload is its state; a deleted
counter, in cluster mode, is a tombstone (tag 0) whose meta is ``counter.TOMBSTONE_META``
and whose payload is the state it saw, every baseline raised (it travels through L3 as a
tombstone record with those meta and value bytes; L3's push script merges it as a
counter: ``PUSH_LUA``).
"""

from __future__ import annotations

from typing import Any

from ..core import codec, counter
from ..errors import InvalidArgument, SegmentError
from ..tiers import l2 as l2mod
from ..tiers.l2 import TAG_TOMBSTONE, Record

Encoded = tuple[int, bytes, bytes | memoryview]


def state_of(encoded: Encoded) -> counter.State | None:
    """The counter state an encoded value (or tombstone) holds, None for any other value
    (a plain value, a plain tombstone). Raises ValueError for a malformed state."""
    tag, meta, payload = encoded
    if tag == codec.COUNTER or (tag == TAG_TOMBSTONE and bytes(meta) == counter.TOMBSTONE_META):
        return counter.decode(payload)
    return None


def encoded_state(state: counter.State) -> Encoded:
    """A state as the record that holds it: a counter, or a deleted one when not live."""
    if counter.live(state):
        return codec.COUNTER, b"", counter.encode(state)
    return TAG_TOMBSTONE, counter.TOMBSTONE_META, counter.encode(state)


def start_of(key: str, rec: Record | None, version: Any, now: float
             ) -> tuple[counter.State, float | None]:
    """What an increment of ``key`` counts from, given the host's record ``rec`` (read under
    the writer lock; ``version`` its Version, or None when ``rec`` is None): the state and
    the deadline to keep (None: none). Absent, deleted or expired: nothing counts (an
    expired or deleted counter's state with every baseline raised, so that its increments
    never come back; after a plain tombstone, a new generation: core/counter.py); a plain
    int: adopted (a new generation too). Raises InvalidArgument for any other value (the
    record is unchanged), SegmentError for a stored state that does not decode."""
    if rec is None:
        return {}, None
    expired = 0 < rec.deadline <= now
    try:
        state = None if rec.value is None else state_of((rec.tag, rec.meta, rec.value))
    except ValueError as exc:
        raise SegmentError(f"the counter state of {key!r} cannot be decoded ({exc}); "
                           "delete the key") from None
    if state is not None:
        if expired or rec.tag == TAG_TOMBSTONE:
            return counter.reset(state), None
        return state, rec.deadline or None
    if rec.tag == TAG_TOMBSTONE or expired:
        # a plain delete (or a plain value's expiry) won over every counter it did not see:
        # what counts from here is a generation of its own, which wins whole over theirs
        return {counter.GEN: counter.generation(version.vector, version.hlc)}, None
    old: Any = None
    if rec.value is not None and rec.tag == codec.PACKED:
        try:
            old = codec.decode(rec.tag, rec.meta, rec.value)
        except ValueError:
            old = None
    if type(old) is not int or not -counter.MAX_COUNT <= old <= counter.MAX_COUNT:
        raise InvalidArgument(
            f"incr: {key!r} holds {_what(rec, old)}, not an int (at most 2**53-1 in "
            "magnitude): incr counts only ints; delete the key, or put an int, first")
    return counter.adopt(old, version.vector, version.hlc), rec.deadline or None


def _what(rec: Record, old: Any) -> str:
    if rec.tag == codec.PACKED and old is not None:
        return f"a {type(old).__name__}"
    return {codec.BYTES: "bytes", codec.STR: "a str", codec.NDARRAY: "a numpy array"}.get(
        rec.tag, "a value")


def add(key: str, state: counter.State, host: str, epoch: int, delta: int) -> counter.State:
    """``state`` after ``delta`` counted by ``host`` (into its own entry, or a new one of
    ``epoch``). An increment of 0 of a counter that is not live makes it live at its value
    (+1 and -1). Raises InvalidArgument past the bounds (nothing written)."""
    actor = counter.own_actor(state, host) or counter.new_actor(host, epoch)
    try:
        if delta == 0 and not counter.live(state):
            return counter.add(counter.add(state, actor, 1), actor, -1)
        return counter.add(state, actor, delta)
    except ValueError as exc:
        raise InvalidArgument(f"incr of {key!r}: {exc}; delete the key to start again") from None


def delete_check(seg: Any, kb: bytes, h: int, ops: list[tuple[Any, ...]], now_ms: int,
                 check: Any) -> Any:
    """The check a cluster-mode delete runs under the writer lock (after ``check``, the
    caller's): when the record it deletes is a live counter, the delete op in ``ops`` is
    replaced by a tombstone that carries the counter's state, every baseline raised (a
    new local write over the record: NEW_DOT, its vector's other entries): increments it
    saw never come back, concurrent ones do (core/counter.py)."""
    def run() -> None:
        if check is not None:
            check()
        rec = seg.read(kb, h)
        if rec is None or rec.tag != codec.COUNTER or rec.value is None:
            return
        if 0 < rec.deadline <= now_ms / 1000:
            return  # (expired: a plain delete; the next incr resets it as expired)
        try:
            state = counter.decode(rec.value)
        except ValueError:
            return  # (a corrupt state: deleted as any record, which repairs the key)
        ops[0] = (kb, h, TAG_TOMBSTONE, counter.TOMBSTONE_META,
                  counter.encode(counter.reset(state)), l2mod.NEW_DOT, rec.hlc, rec.vvx)

    return run


def merge_plan(local: Encoded, remote: Encoded) -> tuple[str, Encoded] | None:
    """Two concurrent versions of a key, either of them a counter (or a deleted one): what
    to keep, as (``"new"``, the merged state) when both are counters (a new value: the
    caller stores it as a new local write), else the plain side, whatever the clocks (a
    plain put or delete resets the counter): (``"local"`` or ``"remote"``, its encoding).
    None when neither is a counter (the ordinary rule decides). A malformed state counts
    as a plain value."""
    try:
        a = state_of(local)
    except ValueError:
        a = None
    try:
        b = state_of(remote)
    except ValueError:
        b = None
    if a is None and b is None:
        return None
    if a is not None and b is not None:
        try:
            return "new", encoded_state(counter.merge(a, b))
        except ValueError:  # (over MAX_ACTORS: the larger state is kept whole)
            return ("local", local) if len(a) >= len(b) else ("remote", remote)
    return ("local", local) if a is None else ("remote", remote)
