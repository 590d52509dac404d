"""The soak's checker: nothing acknowledged lost, no delete undone, no phantom, one state.

Pure: it reads a history (:class:`~kvcomm.faults.history.Op`) and the final state of
every key at every place (``"l3"`` and each host, as :class:`Observed`), and returns a
:class:`Verdict`. No clocks, sockets or randomness here.

The rules, per key, for the final state F seen at one place
-------------------------------------------------------------
A write is a put or a delete whose outcome is ``ok`` (acknowledged) or ``info`` (unknown:
it may have happened). A write *c* is **superseded** when an acknowledged write *y* on
the same key certainly comes after it in the last-writer-wins order that cluster mode
documents:

* *y* is a later operation of the same process. A process runs on one host, and a host
  orders every write of a key through its L2: *y*'s version vector covers *c*'s (a put),
  or *y* is a tombstone of the same host with a later hybrid logical clock (a delete).
  Either way *c* can never win against *y*.
* (``realtime_margin`` not None) *y* started more than ``realtime_margin`` seconds after
  *c* ended. Hosts stamp writes with a hybrid logical clock that never runs ahead of the
  wall clock they share on one machine, so *y*'s timestamp is later, and
  last-writer-wins (or causality, which agrees with it here) puts *y* after *c*. Pass
  None when clocks are skewed on purpose.

Then F is allowed when it is the effect of some write that is not superseded: the put
of F's value when F is present (values are unique), or any delete when F is absent (or
the initial state, when no put was acknowledged). Otherwise:

* ``lost-write``: an acknowledged put is missing: F is absent or an older value although
  a later acknowledged put exists; or (F's version known) the dot of an acknowledged put
  is not covered by F's vector: that put never reached the merge. Sound because every
  acknowledged put either reaches L3, whose vectors only grow, or is replaced on its own
  host by a later write whose vector has a higher counter for that host.
* ``undone-delete``: F is a value that an acknowledged delete came after.
* ``phantom``: F's value was never written (or only by a write that certainly failed).
* ``dominated``: F's version is causally older than an acknowledged put's version.
* ``version-regressed``: F carries an acknowledged put's value with an older version.

With one process writing a key (the soak's *owned* keys) the first rule alone says that
F must be exactly that process's last acknowledged operation, or an unknown one after
it: that is the sharpest possible check, and it needs no clock.

Counters (``kv.incr``): a key whose writes are all increments must hold, at every place,
the sum of its acknowledged increments, plus any of those whose outcome is unknown (its
value then lies between the sum with every unknown negative one and the sum with every
unknown positive one; with none unknown, exactly the sum): ``miscounted`` otherwise (an
increment lost, or counted twice). Reads of a counter are not judged.

A key with an operation of a kind this checker does not know (a compare-and-set, say,
which a linearizability checker judges) is not judged here: it is counted in
``Verdict.unchecked`` rather than risk a false verdict.

Every place must also agree (``divergent`` otherwise: not converged), and reads are
checked as they ran: ``phantom-read`` (a value never written, or read before its write
began), and ``stale-read`` (a process reading a key only it writes, on its own host,
saw neither its last acknowledged state nor an unknown write after it: read-your-writes
on a host).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..core.versions import Ordering, Version, compare_vectors, vector_get
from .history import DELETE, FAIL, GET, INCR, OK, PUT, Op

LOSS_KINDS = ("lost-write", "undone-delete", "phantom", "dominated", "version-regressed",
              "miscounted")
READ_KINDS = ("phantom-read", "stale-read")


@dataclass(frozen=True, slots=True)
class Observed:
    """One key at one place. ``value`` is the value id (:func:`~kvcomm.faults.history.value_id`);
    ``version`` is the stored version (L3 keeps one for a tombstone; a host's absent key
    has none)."""

    present: bool
    value: str | None = None
    version: Version | None = None

    def same(self, other: Observed) -> bool:
        """The same state as a reader sees it (an absent key's tombstone version aside)."""
        if self.present != other.present:
            return False
        return not self.present or (self.value == other.value and self.version == other.version)


ABSENT = Observed(False)


@dataclass(frozen=True, slots=True)
class Anomaly:
    kind: str  # one of LOSS_KINDS, READ_KINDS, or "divergent"
    key: str
    place: str  # "l3", a host, or (reads) the reading process
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} {self.key!r} at {self.place}: {self.detail}"


@dataclass
class Verdict:
    anomalies: list[Anomaly] = field(default_factory=list)
    keys: int = 0
    writes: int = 0
    reads: int = 0
    unchecked: list[str] = field(default_factory=list)  # keys with operations of other kinds

    def of(self, *kinds: str) -> list[Anomaly]:
        return [a for a in self.anomalies if a.kind in kinds]

    @property
    def lost_keys(self) -> list[str]:
        """Keys whose final state breaks a rule at some place (each key once)."""
        return sorted({a.key for a in self.of(*LOSS_KINDS)})

    @property
    def divergent_keys(self) -> list[str]:
        return sorted({a.key for a in self.of("divergent")})

    @property
    def ok(self) -> bool:
        return not self.lost_keys and not self.of("phantom-read") and not self.divergent_keys


def describe(op: Op) -> str:
    what = f"{op.kind} {op.value!r}" if op.kind == PUT else op.kind
    if op.kind == DELETE and op.deleted is not None:
        what += f" (returned {op.deleted})"
    return f"{what} by {op.process} [{op.outcome}, {op.start:.3f}-{op.end:.3f}]"


class _Key:
    """What the history says about one key."""

    def __init__(self, key: str, ops: list[Op], margin: float | None) -> None:
        self.key = key
        self.margin = margin
        ops.sort(key=lambda o: (o.process, o.seq))
        self.ops = ops
        self.writes = [o for o in ops if o.kind in (PUT, DELETE) and o.outcome != FAIL]
        self.acked = [o for o in self.writes if o.outcome == OK]
        self.acked_puts = [o for o in self.acked if o.kind == PUT and o.version is not None]
        self.writers = {o.process for o in ops if o.kind in (PUT, DELETE)}
        self.put_of: dict[str | None, Op] = {
            o.value: o for o in self.writes if o.kind == PUT and o.value is not None}
        self.last_acked: dict[str, Op] = {}
        for o in self.acked:  # in (process, seq) order: the last one of each process stays
            self.last_acked[o.process] = o
        by_start = sorted(self.acked, key=lambda o: o.start, reverse=True)
        self.latest = by_start[:2]  # the two acknowledged writes that started last

    def superseded_by(self, c: Op) -> Op | None:
        last = self.last_acked.get(c.process)
        if last is not None and last.seq > c.seq:
            return last
        if self.margin is not None:
            for y in self.latest:
                if y is not c:
                    return y if y.start > c.end + self.margin else None
        return None

    def check_final(self, place: str, f: Observed, out: list[Anomaly]) -> None:
        if f.present:
            c = self.put_of.get(f.value)
            if c is None:
                out.append(Anomaly("phantom", self.key, place,
                                   f"holds {f.value!r}, which no write of this key made"))
                return
            y = self.superseded_by(c)
            if y is not None:
                kind = "undone-delete" if y.kind == DELETE else "lost-write"
                out.append(Anomaly(kind, self.key, place,
                                   f"holds the value of {describe(c)}, but {describe(y)} "
                                   "came after it"))
            if f.version is not None and c.outcome == OK and c.version is not None:
                order = compare_vectors(f.version.vector, c.version.vector)
                if order not in (Ordering.EQUAL, Ordering.AFTER):
                    out.append(Anomaly("version-regressed", self.key, place,
                                       f"holds the value of {describe(c)} at {f.version}, "
                                       f"{order.value} the version it was written with "
                                       f"({c.version})"))
        else:
            if any(o.kind == PUT for o in self.acked):
                allowed = any(o.kind == DELETE and self.superseded_by(o) is None
                              for o in self.writes)
                if not allowed:
                    last = max((o for o in self.acked if o.kind == PUT), key=lambda o: o.start)
                    why = ("no delete of the key was ever attempted"
                           if not any(o.kind == DELETE for o in self.writes)
                           else "every delete was followed by an acknowledged write")
                    tomb = f" (tombstone {f.version})" if f.version is not None else ""
                    out.append(Anomaly("lost-write", self.key, place,
                                       f"is absent{tomb}, but {why} (the last: "
                                       f"{describe(last)})"))
                    return
        if f.version is None:
            if place == "l3" and self.acked_puts:
                out.append(Anomaly("lost-write", self.key, place,
                                   f"has no record at all, yet {len(self.acked_puts)} puts "
                                   "were acknowledged"))
            return
        for p in self.acked_puts:
            assert p.version is not None
            if compare_vectors(f.version.vector, p.version.vector) is Ordering.BEFORE:
                out.append(Anomaly("dominated", self.key, place,
                                   f"version {f.version} is older than that of {describe(p)} "
                                   f"({p.version})"))
                break
            dot = vector_get(p.version.vector, p.host)
            if vector_get(f.version.vector, p.host) < dot:
                out.append(Anomaly("lost-write", self.key, place,
                                   f"version {f.version} does not cover {describe(p)} "
                                   f"(dot {p.host}:{dot}): it never reached the merge"))
                break

    def check_reads(self, out: list[Anomaly]) -> None:
        for r in self.ops:
            if r.kind != GET or r.outcome != OK or r.value is None:
                continue
            c = self.put_of.get(r.value)
            if c is None or c.start > r.end:
                why = "no write of this key made it" if c is None else f"{describe(c)} began later"
                out.append(Anomaly("phantom-read", self.key, r.process,
                                   f"read {r.value!r} [{r.start:.3f}-{r.end:.3f}]: {why}"))
        if len(self.writers) != 1:
            return
        (owner,) = self.writers
        allowed: set[str | None] = {None}  # before any write: absent
        for o in self.ops:  # sorted by (process, seq): the owner's ops are in its order
            if o.process != owner:
                continue
            if o.kind == GET:
                if o.outcome == OK and o.value not in allowed:
                    out.append(Anomaly("stale-read", self.key, o.process,
                                       f"read {o.value!r} [{o.start:.3f}], expected one of "
                                       f"{sorted(allowed, key=str)} after its own writes"))
                continue
            if o.outcome == FAIL:
                continue
            state = o.value if o.kind == PUT else None
            if o.outcome == OK:
                allowed = {state}
            else:
                allowed.add(state)


def check(history: Iterable[Op], final: Mapping[str, Mapping[str, Observed]], *,
          realtime_margin: float | None = 0.05) -> Verdict:
    """Check a history against the final state of every key at every place.

    ``final[place][key]``: the key's state at that place (a key missing from a place's
    mapping is absent there, without a version). Keys are those of the history plus
    every key present at some place. Returns a Verdict listing every anomaly.
    """
    by_key: dict[str, list[Op]] = defaultdict(list)
    verdict = Verdict()
    for op in history:
        by_key[op.key].append(op)
        if op.kind == GET:
            verdict.reads += 1
        else:
            verdict.writes += 1
    keys = set(by_key)
    for state in final.values():
        keys.update(k for k, o in state.items() if o.present)
    verdict.keys = len(keys)
    places = sorted(final)
    out = verdict.anomalies
    for key in sorted(keys):
        ops = by_key.get(key, [])
        seen = [(p, final[p].get(key, ABSENT)) for p in places]
        if any(o.kind == INCR for o in ops):
            if any(o.kind not in (INCR, GET) for o in ops):
                verdict.unchecked.append(key)
                continue
            for place, f in seen:
                _check_counter(key, ops, place, f, out)
            if seen and not all(f.same(seen[0][1]) for _, f in seen[1:]):
                states = ", ".join(f"{p}: {_show(f)}" for p, f in seen)
                out.append(Anomaly("divergent", key, "*", states))
            continue
        if any(o.kind not in (PUT, DELETE, GET) for o in ops):
            verdict.unchecked.append(key)
            continue
        kh = _Key(key, ops, realtime_margin)
        for place, f in seen:
            kh.check_final(place, f, out)
        if seen and not all(f.same(seen[0][1]) for _, f in seen[1:]):
            states = ", ".join(f"{p}: {_show(f)}" for p, f in seen)
            out.append(Anomaly("divergent", key, "*", states))
        kh.check_reads(out)
    return verdict


def counter_bounds(ops: Iterable[Op]) -> tuple[int, int]:
    """The least and the greatest value a counter may hold after ``ops`` (its increments:
    every acknowledged one counts, an unknown one may)."""
    low = high = 0
    for o in ops:
        if o.kind != INCR or o.outcome == FAIL:
            continue
        d = int(o.value or 0)
        if o.outcome == OK:
            low, high = low + d, high + d
        elif d < 0:
            low += d
        else:
            high += d
    return low, high


def _check_counter(key: str, ops: list[Op], place: str, f: Observed,
                   out: list[Anomaly]) -> None:
    low, high = counter_bounds(ops)
    acked = sum(1 for o in ops if o.kind == INCR and o.outcome == OK)
    if not acked and not f.present:
        return  # (nothing acknowledged: never counted is allowed)
    got = f.value[1:] if f.present and f.value and f.value.startswith("=") else None
    want = f"{low}" if low == high else f"{low}..{high}"
    if got is None or not got.lstrip("-").isdigit() or not low <= int(got) <= high:
        out.append(Anomaly("miscounted", key, place,
                           f"holds {_show(f)}; its {acked} acknowledged increments "
                           f"(and unknown ones) sum to {want}"))


def _show(f: Observed) -> str:
    return f"{f.value!r} {f.version}" if f.present else "absent"
