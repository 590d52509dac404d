"""A host's own keys in L3 (``kvn:{host}:*``), which its node daemon writes and reads:
its feed cursors and last sequence numbers, its write mark (no dot of the host's past
it), its hot keys (to prewarm L2 with), its per-group operation counts, and its
quarantine list (inputs set aside). Each is written on its key's master, replacing a
foreign value of another type there.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from typing import Any

import msgpack

from ...core.versions import MAX_COUNTER
from ...errors import CorruptRecord
from .connection import Connection
from .feed import _as_seq, _valid_id
from .records import _printable
from .replication import Replication

log = logging.getLogger("kvcomm.l3")

# a write mark past this is junk (load_write_mark): a write sequence starts at the clock
# in µs (~1.8e15 in 2026) and takes one per write, so no host reaches 2**52 before ~2112;
# and a new L2 lifted to MAX_COUNTER would have no dot left to give
WRITE_MARK_MAX = MAX_COUNTER >> 1
QUARANTINE_MAX = 1000  # entries kept in a host's quarantine list (kvn:{host}:quarantine)


class HostRecords:
    """Saves and loads hosts' own keys through ``conn``; the write mark is as durable as a
    push (``repl``: WAIT for the replicas a push waits for)."""

    def __init__(self, conn: Connection, repl: Replication) -> None:
        self.conn, self.repl = conn, repl

    def forget_host(self, host: str) -> int:
        """Delete a retired host's keys of KVCOMM's own (feed cursors, hot keys,
        quarantine list); returns how many existed. Raises Unavailable."""
        names = [f"kvn:{{{host}}}:{n}" for n in ("cursors", "hot", "quarantine")]
        return int(self.conn.call(lambda: self.conn.rc.delete(*names)))

    def save_hot(self, host: str, keys: list[str]) -> None:
        """This host's hot-key list, for the next daemon run to prewarm L2 with."""
        packed = msgpack.packb(keys)
        self.conn.own_key(f"kvn:{{{host}}}:hot",
                      lambda name, node: self.conn.on(node, "SET", name, packed))

    def load_hot(self, host: str) -> list[str]:
        """The hot-key list :meth:`save_hot` saved; [] when there is none or it is not
        ours. Raises Unavailable."""
        try:
            raw = self.conn.call(lambda: self.conn.rc.get(f"kvn:{{{host}}}:hot"))
        except CorruptRecord:  # another type under the name: start without a list
            return []
        try:
            keys = msgpack.unpackb(raw, max_array_len=100_000) if raw else []
        except Exception:  # written by something else: start without a list
            return []
        return [k for k in keys if isinstance(k, str)] if isinstance(keys, list) else []

    def save_write_mark(self, host: str, mark: int) -> None:
        """Record that ``host``'s daemons push no dot with a counter past ``mark`` until
        they record a higher one (``kvn:{host}:wseq``; one daemon per host writes it).
        With ``wait_replicas``, as durable as a push (ROLE and WAIT on the master's
        connection): the records it covers are kept by a failover, and so must it be, or
        dots of this host in L3 would pass it. Raises Unavailable (also when fewer
        replicas than a push waits for took it; the pushes it covers are not sent)."""
        self.conn.own_key(f"kvn:{{{host}}}:wseq",
                      lambda name, node: self.repl.set_replicated(name, int(mark), node))

    def load_write_mark(self, host: str) -> int:
        """The mark :meth:`save_write_mark` saved; 0 when there is none or it is not ours
        (not a decimal integer, or past WRITE_MARK_MAX: a host could never have written
        that far, and a sequence lifted there would leave it no dots to write with).
        Raises Unavailable."""
        try:  # (a start's first call to the host's own keys' master: one timeout if it hangs)
            raw = self.conn.get_own(f"kvn:{{{host}}}:wseq")
        except CorruptRecord:  # another type under the name: none
            return 0
        try:
            mark = int(raw) if raw else 0
        except ValueError:  # written by something else
            return 0
        if not 0 < mark <= WRITE_MARK_MAX:
            if mark:
                log.warning("ignored %s's write mark in L3 (%d: out of 1..%d)", host, mark,
                            WRITE_MARK_MAX)
            return 0
        return mark

    def save_load(self, host: str, ops: Mapping[int, int]) -> None:
        """Record ``host``'s cumulative operation counts of these groups (a hash
        ``kvn:{host}:load``: group → count). Raises Unavailable."""
        if ops:
            mapping: dict[Any, Any] = {str(g): n for g, n in ops.items()}
            self.conn.own_key(f"kvn:{{{host}}}:load", lambda name, node: self.conn.on(
                node, "HSET", name, *itertools.chain.from_iterable(mapping.items())))

    def load_counts(self, host: str) -> dict[int, int]:
        """What :meth:`save_load` recorded for ``host`` ({} when nothing, or not ours).
        Raises Unavailable."""
        try:
            raw = self.conn.call(lambda: self.conn.rc.hgetall(f"kvn:{{{host}}}:load"))
        except CorruptRecord:
            return {}
        out = {}
        for k, v in raw.items():
            n = _as_seq(v)
            if k.isdigit() and int(k) < len(self.conn.groups) and n is not None:
                out[int(k)] = n
        return out

    def hosts(self) -> list[str]:
        """The hosts whose daemons left state in L3 (their ``kvn:{host}:cursors``), by
        a SCAN of every master: for tools, not hot paths. Raises Unavailable."""
        found = set()
        for raw in self.conn.call(lambda: list(self.conn.rc.scan_iter(match="kvn:{*}:cursors", count=1000))):
            host = raw[5:raw.rfind(b"}")].decode("utf-8", "replace")
            if host:
                found.add(host)
        return sorted(found)

    def load_cursors(self, host: str) -> tuple[dict[int, bytes], dict[int, int]]:
        """The feed cursors and last sequence numbers this host saved, by group.

        Malformed fields (written by something else) are left out: those groups start
        afresh. Raises Unavailable.
        """
        try:
            raw = self.conn.call(lambda: self.conn.rc.hgetall(f"kvn:{{{host}}}:cursors"))
        except CorruptRecord:  # another type under the name: start afresh
            raw = {}
        cursors: dict[int, bytes] = {}
        seqs: dict[int, int] = {}
        for k, v in raw.items():
            name = k.decode("ascii", "replace")
            if name.isdigit() and int(name) < len(self.conn.groups) and _valid_id(v):
                cursors[int(name)] = v
            elif name[:1] == "s" and name[1:].isdigit() and int(name[1:]) < len(self.conn.groups):
                seq = _as_seq(v)
                if seq is not None:
                    seqs[int(name[1:])] = seq
        return cursors, seqs

    def save_cursors(self, host: str, cursors: dict[int, bytes],
                     seqs: dict[int, int] | None = None) -> None:
        mapping: dict[Any, Any] = {str(g): c for g, c in cursors.items()}
        mapping.update({f"s{g}": s for g, s in (seqs or {}).items()})
        if mapping:
            self.conn.own_key(f"kvn:{{{host}}}:cursors", lambda name, node: self.conn.on(
                node, "HSET", name, *itertools.chain.from_iterable(mapping.items())))

    def quarantine(self, host: str, key: str, reason: str, when: float,
                   keep: int = QUARANTINE_MAX) -> None:
        """Set an input aside: push ``[key, reason, when]`` (msgpack) onto the host's capped
        list ``kvn:{host}:quarantine`` (newest first, ``keep`` kept). Raises Unavailable."""
        entry = msgpack.packb([_printable(key)[:1000], _printable(reason)[:1000], when])

        def run(name: str, node: Any) -> None:
            self.conn.on(node, "LPUSH", name, entry)
            self.conn.on(node, "LTRIM", name, 0, keep - 1)

        self.conn.own_key(f"kvn:{{{host}}}:quarantine", run)

    def quarantined(self, host: str) -> list[tuple[str, str, float]]:
        """What :meth:`quarantine` set aside for ``host``, newest first."""
        out = []
        for raw in self.conn.call(lambda: self.conn.rc.lrange(f"kvn:{{{host}}}:quarantine", 0, -1)):
            try:
                key, reason, when = msgpack.unpackb(raw)
                out.append((str(key), str(reason), float(when)))
            except Exception:  # not an entry of ours
                continue
        return out
