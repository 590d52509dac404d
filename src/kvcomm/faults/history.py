"""Recorded histories: every operation a soak's processes ran, with its outcome.

An :class:`Op` is one completed call: who ran it (``process``, bound to one ``host``),
its place in that process's order (``seq``), what it was (``put`` / ``delete`` /
``get``), when it started and ended (wall clock, ``time.time()``: the same clock as the
hybrid logical clocks the hosts stamp writes with), and how it ended:

* ``ok``: acknowledged (the call returned). A put carries the Version it returned, a
  delete what it returned, a get the value it read.
* ``fail``: certainly not applied (nothing in the soak's workload produces this today;
  kept for histories of operations with a definite failure, such as a refused CAS).
* ``info``: unknown. The call raised (``Unavailable``, a failed batch, anything else):
  it may or may not have taken effect, so a checker must allow its effect without
  requiring it.

Values are unique strings, ``"<process>#<n>"``, optionally followed by ``"|"`` and
padding (large values); :func:`value_id` reduces a stored value to that identity, so
histories never hold the padding and a checker compares identities only.

Histories are JSON lines, one file per process (:class:`HistoryWriter`), read back with
:func:`load_history`. The format is the same invoke/complete record that a
linearizability checker consumes (``start``/``end`` bound the operation's real-time
interval, ``outcome`` says whether it took effect).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .._client import Client
from ..core.versions import Version
from ..errors import KVCommError

OK, FAIL, INFO = "ok", "fail", "info"
PUT, DELETE, GET = "put", "delete", "get"
INCR = "incr"  # kv.incr: ``value`` is the delta (as a str), a counter key's only write


def value_id(value: Any) -> str | None:
    """The identity of a stored value: the part before ``"|"`` of a str, None for absent.

    A value of another type cannot have been written by a soak: it gets an identity
    that matches no write (``"<type>"``), so a checker reports it as a phantom.
    """
    if value is None:
        return None
    if isinstance(value, str):
        return value.split("|", 1)[0]
    if type(value) is int:  # a counter's value (kv.incr): "=<n>", never a written id
        return f"={value}"
    return f"<{type(value).__name__}>"


@dataclass(frozen=True, slots=True)
class Op:
    """One completed operation of one process (see the module docstring)."""

    process: str
    host: str
    seq: int
    kind: str  # PUT | DELETE | GET | INCR
    key: str
    value: str | None  # put: the value id written; get: the value id read (None: absent);
    # incr: the delta
    outcome: str  # OK | FAIL | INFO
    start: float
    end: float
    version: Version | None = None  # an acknowledged put's Version
    deleted: bool | None = None  # an acknowledged delete's return value
    error: str | None = None  # why an INFO operation raised

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"p": self.process, "h": self.host, "i": self.seq, "op": self.kind,
                             "k": self.key, "v": self.value, "o": self.outcome,
                             "t0": round(self.start, 6), "t1": round(self.end, 6)}
        if self.version is not None:
            d["ver"] = [[list(e) for e in self.version.vector], self.version.hlc]
        if self.deleted is not None:
            d["del"] = self.deleted
        if self.error is not None:
            d["err"] = self.error
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> Op:
        """Raises ValueError on a malformed record."""
        try:
            ver = d.get("ver")
            version = None if ver is None else Version(
                tuple((str(a), int(c)) for a, c in ver[0]), int(ver[1]))
            return Op(str(d["p"]), str(d["h"]), int(d["i"]), str(d["op"]), str(d["k"]),
                      None if d["v"] is None else str(d["v"]), str(d["o"]), float(d["t0"]),
                      float(d["t1"]), version, d.get("del"), d.get("err"))
        except (KeyError, TypeError, IndexError) as exc:
            raise ValueError(f"malformed history record {d!r}: {exc}") from None


class HistoryWriter:
    """Appends Ops as JSON lines to one file; flushed every ``flush_every`` seconds."""

    def __init__(self, path: str | os.PathLike[str], flush_every: float = 1.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f: IO[str] = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._flush_every = flush_every
        self._flushed = time.monotonic()

    def write(self, op: Op) -> None:
        self._f.write(json.dumps(op.to_json(), separators=(",", ":")) + "\n")
        if time.monotonic() - self._flushed > self._flush_every:
            self.flush()

    def flush(self) -> None:
        self._f.flush()
        self._flushed = time.monotonic()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def load_history(directory: str | os.PathLike[str]) -> list[Op]:
    """Every Op of every ``*.jsonl`` file in ``directory``. Raises ValueError on a bad line
    (a line cut short by a killed writer, the last of its file, is skipped)."""
    ops: list[Op] = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        lines = path.read_text(encoding="utf-8").split("\n")
        for n, line in enumerate(lines):
            if not line:
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                if n >= len(lines) - 2:
                    continue  # the process died mid-line: that op was never completed
                raise ValueError(f"{path}:{n + 1}: not JSON") from None
            ops.append(Op.from_json(d))
    return ops


class Recorder:
    """A client whose every call is recorded: the way soak processes (and faults that
    write) talk to a host. Calls never raise KVCommError: the outcome is recorded
    (``info``) and returned as None / False, so a workload carries on through faults.
    Exceptions outside the KVCommError tree are recorded too, then re-raised: they are
    bugs, and the caller counts them.
    """

    def __init__(self, client: Client, process: str, host: str, sink: HistoryWriter) -> None:
        self.client = client
        self.process = process
        self.host = host
        self.sink = sink
        self.seq = 0
        self.counter = 0  # values written by this process

    def new_value(self, pad: int = 0) -> str:
        """A value no other write of any process ever had (``pad`` bytes of padding)."""
        self.counter += 1
        base = f"{self.process}#{self.counter}"
        return base if pad <= 0 else base + "|" + "x" * pad

    def _record(self, kind: str, key: str, value: str | None, outcome: str, start: float,
                version: Version | None = None, deleted: bool | None = None,
                error: str | None = None) -> None:
        self.seq += 1
        self.sink.write(Op(self.process, self.host, self.seq, kind, key, value, outcome, start,
                           time.time(), version, deleted, error))

    def _call(self, kind: str, key: str, value: str | None, fn: Callable[[], Any]
              ) -> tuple[bool, Any, float]:
        """Run ``fn``: (True, its result, start) when it returned; (False, None, start)
        when it raised a KVCommError, recorded as unknown. Any other exception is
        recorded as unknown too, then re-raised (a bug: the caller counts it)."""
        start = time.time()
        try:
            return True, fn(), start
        except KVCommError as exc:
            self._record(kind, key, value, INFO, start, error=_err(exc))
            return False, None, start
        except BaseException as exc:
            self._record(kind, key, value, INFO, start, error=_err(exc))
            raise

    def put(self, key: str, value: str) -> Version | None:
        """The Version of an acknowledged put; None when it raised (recorded as unknown)."""
        ok, v, start = self._call(PUT, key, value_id(value), lambda: self.client.put(key, value))
        if ok:
            self._record(PUT, key, value_id(value), OK, start, version=v)
        return v  # type: ignore[no-any-return]

    def delete(self, key: str) -> bool | None:
        """What an acknowledged delete returned; None when it raised."""
        ok, r, start = self._call(DELETE, key, None, lambda: self.client.delete(key))
        if ok:
            self._record(DELETE, key, None, OK, start, deleted=r)
        return r  # type: ignore[no-any-return]

    def get(self, key: str) -> tuple[bool, Any]:
        """(True, value or None) when the read answered; (False, None) when it raised."""
        ok, v, start = self._call(GET, key, None, lambda: self.client.get(key))
        if ok:
            self._record(GET, key, value_id(v), OK, start)
        return ok, v

    def incr(self, key: str, delta: int) -> int | None:
        """The value an acknowledged ``kv.incr`` returned; None when it raised (recorded
        as unknown: it may have counted)."""
        ok, n, start = self._call(INCR, key, str(delta), lambda: self.client.incr(key, delta))
        if ok:
            self._record(INCR, key, str(delta), OK, start)
        return n  # type: ignore[no-any-return]

    def batch(self, ops: Sequence[tuple[str, str, str | None]]) -> bool:
        """Apply ``(PUT, key, value)`` / ``(DELETE, key, None)`` in one ``kv.batch()``.

        True when the batch was acknowledged; every operation of a batch that raised is
        recorded as unknown (a failed batch may have been applied in part).
        """
        start = time.time()
        error: BaseException | None = None
        versions: list[Any] = []
        try:
            with self.client.batch() as b:
                for kind, key, value in ops:
                    if kind == PUT:
                        b.put(key, value)
                    else:
                        b.delete(key)
            versions = list(b.versions)
        except BaseException as exc:  # recorded below, re-raised unless a KVCommError
            error = exc
        for n, (kind, key, value) in enumerate(ops):
            vid = value_id(value) if kind == PUT else None
            if error is not None:
                self._record(kind, key, vid, INFO, start, error=_err(error))
            elif kind == PUT:
                self._record(kind, key, vid, OK, start, version=versions[n])
            else:
                self._record(kind, key, vid, OK, start, deleted=bool(versions[n]))
        if error is not None and not isinstance(error, KVCommError):
            raise error
        return error is None


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]

