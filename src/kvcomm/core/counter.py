"""Counters: a PN-counter with an observed-remove baseline, the state ``kv.incr`` keeps. Pure.

Theory of operation
-------------------
A counter's state maps **actors** to four non-negative integers ``[p, n, bp, bn]``:

* ``p`` / ``n``: the sum of the positive increments / of the magnitudes of the negative
  ones the actor made (each only ever grows: a PN-counter, as Riak's counters or Redis
  Enterprise's active-active counters);
* ``bp`` / ``bn``: the **baseline**, the part of ``p`` / ``n`` that a delete (or an expiry)
  of the key has seen, and that no longer counts.

The value is ``sum(p - n) - sum(bp - bn)``. Two states of the same **generation** (see
below) merge by taking, actor by actor, the greatest of each of the four numbers; of two
generations the later one wins whole (:func:`merge`): commutative, associative and
idempotent, so every host and L3's push script (``kvcomm.tiers.l3.PUSH_LUA``, the same
rule in Lua) reach the same state whatever order the states arrive in, and a state
merged twice counts nothing twice. A state is **live** when some actor counts more than
its baseline (:func:`live`); a state with none is a deleted counter (an L2/L3 tombstone
that carries the state: :data:`TOMBSTONE_META`).

Actors. Each host counts into an actor of its own, ``"<host>~<epoch>"``: a host adds to
the entry with its host id it already has in the state it holds; a host that holds no
such entry (its first increment of the key, or it lost the record: evicted, a new L2)
starts a new one, whose epoch (the host's write sequence, or any number never used for
the key on that host) is new: a host never starts an entry again from 0 under a name
whose higher count is somewhere in the cluster (the merge's maximum would hide the new
increments). A plain int the counter adopts (``incr`` of a key holding ``5``) is the
entry ``"=<id>"`` of the write that stored it (:func:`adopted_actor`), the same on every
host that adopts it: two hosts adopting the same ``5`` count it once.

Deletes (observed-remove). A delete of a counter writes a tombstone that carries the
state it saw with the baseline raised to it (:func:`reset`): merged with an increment it
did not see (made concurrently on another host), only that increment counts — the key
reappears holding it —, while every increment the delete saw stays gone. An increment
after the delete on the same host starts from the tombstone's state (so from 0). A put
of a plain value is a reset too, but a coarser one: it carries no state, so a plain
record concurrent with a counter wins over it, increments the put never saw included
(both L2's merge and L3's script apply that rule). The counter that then adopts the put
value starts a new **generation**, named after that put (its HLC, then a hash of its
version: :func:`generation`, the entry :data:`GEN`): merged with a counter of an older
generation — one that never saw the put, still out there (a host cut off) — the newer
generation wins whole, so the increments the put replaced never come back, and those
made concurrently with it stay lost with them. A counter never reset by a put is of
generation 0; a delete keeps the generation it saw.

Bounds: every number is at most :data:`MAX_COUNT` (2**53 - 1, where Lua's doubles stop
counting exactly); a state has at most :data:`MAX_ACTORS` entries.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import msgpack

#: the most a p, n (or a counter's value, in magnitude) may reach: Lua numbers are doubles
MAX_COUNT = (1 << 53) - 1
#: entries one state holds at most (one per host and lost record, and adopted ints)
MAX_ACTORS = 4096
#: the meta bytes of an L2/L3 tombstone that carries a counter's state (a deleted counter)
TOMBSTONE_META = b"c"
#: the entry that holds a state's generation: [hlc >> 32, hlc & 0xffffffff, tie-break, 0]
#: of the put it adopted (absent: generation 0); "" is no actor's name
GEN = ""
_NO_GEN = [0, 0, 0, 0]
_SEP = "~"  # host ids are [A-Za-z0-9_.:-]: never this

State = dict[str, list[int]]  # actor -> [p, n, bp, bn]


def encode(state: Mapping[str, list[int]]) -> bytes:
    """The state as msgpack (a map of str to 4-int arrays, sorted: the same state is the
    same bytes)."""
    return msgpack.packb({a: list(state[a]) for a in sorted(state)},  # type: ignore[no-any-return]
                         use_bin_type=False)


def decode(data: bytes | memoryview) -> State:
    """Inverse of :func:`encode`. Raises ValueError for anything that is not a valid state
    (Lua's cmsgpack writes an empty state as an empty array: read as empty)."""
    try:
        raw = msgpack.unpackb(bytes(data), raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"malformed counter state: {exc}") from None
    if raw == []:
        return {}
    if type(raw) is not dict or len(raw) > MAX_ACTORS:
        raise ValueError("malformed counter state: not a map of at most "
                         f"{MAX_ACTORS} actors")
    out: State = {}
    for a, e in raw.items():
        if type(a) is not str or type(e) is not list or len(e) != 4 or not all(
                type(x) is int and 0 <= x <= MAX_COUNT for x in e):
            raise ValueError("malformed counter state entry")
        if a != GEN and (e[2] > e[0] or e[3] > e[1]):
            raise ValueError("malformed counter state entry: a baseline over its count")
        out[a] = e
    return out


def value(state: Mapping[str, list[int]]) -> int:
    """The counter's value."""
    return sum(p - n - bp + bn for a, (p, n, bp, bn) in state.items() if a != GEN)


def live(state: Mapping[str, list[int]]) -> bool:
    """Whether some actor counts more than its baseline (False: a deleted counter)."""
    return any(p != bp or n != bn for a, (p, n, bp, bn) in state.items() if a != GEN)


def merge(a: Mapping[str, list[int]], b: Mapping[str, list[int]]) -> State:
    """The later generation whole; of one generation, actor by actor, the greatest of each
    number (commutative, associative, idempotent). Raises ValueError when the result has
    more than MAX_ACTORS entries."""
    ga, gb = a.get(GEN, _NO_GEN)[:3], b.get(GEN, _NO_GEN)[:3]
    if ga != gb:
        return {k: list(v) for k, v in (a if ga > gb else b).items()}
    out: State = {k: list(v) for k, v in a.items()}
    for k, v in b.items():
        mine = out.get(k)
        out[k] = list(v) if mine is None else [max(x, y) for x, y in zip(mine, v, strict=True)]
    if len(out) > MAX_ACTORS:
        raise ValueError(f"a counter with more than {MAX_ACTORS} actors")
    return out


def reset(state: Mapping[str, list[int]]) -> State:
    """The state with every baseline raised to its count: value 0, not live (a delete, an
    expiry, or the start of a counter over a deleted one)."""
    return {k: list(e) if k == GEN else [e[0], e[1], e[0], e[1]] for k, e in state.items()}


def own_actor(state: Mapping[str, list[int]], host: str) -> str | None:
    """The entry of ``host`` to count into (its latest epoch), or None when it has none."""
    best: tuple[int, str] | None = None
    prefix = host + _SEP
    for a in state:
        if a.startswith(prefix):
            try:
                epoch = int(a[len(prefix):], 16)
            except ValueError:
                continue
            if best is None or epoch > best[0]:
                best = (epoch, a)
    return None if best is None else best[1]


def new_actor(host: str, epoch: int) -> str:
    """A new entry of ``host`` (``epoch``: a number the host never used for the key)."""
    return f"{host}{_SEP}{epoch:x}"


def _version_hash(vector: Any, hlc: int) -> str:
    return hashlib.blake2b(repr((tuple(map(tuple, vector)), hlc)).encode(),
                           digest_size=8).hexdigest()


def adopted_actor(vector: Any, hlc: int) -> str:
    """The entry of a plain int adopted as the counter's start: named after the write that
    stored it (its version), so that every host adopting that write names it alike."""
    return "=" + _version_hash(vector, hlc)


def generation(vector: Any, hlc: int) -> list[int]:
    """The generation a counter that adopts the plain write of this version starts: its
    HLC, then 48 bits of a hash of the version (the same on every host)."""
    return [hlc >> 32, hlc & 0xFFFFFFFF, int(_version_hash(vector, hlc)[:12], 16), 0]


def add(state: Mapping[str, list[int]], actor: str, delta: int) -> State:
    """``state`` with ``delta`` counted into ``actor``'s entry (made when absent). Raises
    ValueError when a number would pass MAX_COUNT or the state MAX_ACTORS entries."""
    out: State = {k: list(v) for k, v in state.items()}
    e = out.get(actor)
    if e is None:
        if len(out) >= MAX_ACTORS:
            raise ValueError(f"a counter with more than {MAX_ACTORS} actors")
        e = out[actor] = [0, 0, 0, 0]
    if delta >= 0:
        e[0] += delta
    else:
        e[1] -= delta
    if e[0] > MAX_COUNT or e[1] > MAX_COUNT:
        raise ValueError(f"a counter's increments past {MAX_COUNT} (2**53-1)")
    return out


def adopt(n: int, vector: Any, hlc: int) -> State:
    """A state holding the plain int ``n`` of the write of version (``vector``, ``hlc``):
    the generation of that write, ``n`` under its entry (:func:`adopted_actor`)."""
    return add({GEN: generation(vector, hlc)}, adopted_actor(vector, hlc), n)

