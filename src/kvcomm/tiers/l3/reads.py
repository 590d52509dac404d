"""Record reads: one key's record, or many keys' in one pipeline of GETs per master."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ...errors import CorruptRecord, KVCommError
from .connection import _TRANSIENT, Connection, _key_error
from .records import L3Record, _wire_key


class RecordReads:
    """Reads records through ``conn``, decoded under its bound (``max_value_size``)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def get(self, key: str) -> L3Record | None:
        """The record of ``key``, or None. Raises Unavailable, CorruptRecord; Unreached
        at once while its master is :attr:`Connection.down`."""
        name = _wire_key(self.conn.groups.record_key(key))
        node = self.conn.master_up(name, f"{key!r}")
        raw = self.conn.call(lambda: self.conn.rc.get(name), key, node=node)
        return None if raw is None else self.conn.decode(raw, key)

    def get_many(self, keys: Iterable[str]) -> dict[str, L3Record | None | CorruptRecord]:
        """The records of ``keys`` (None: absent): one pipeline of GETs per master node
        (by the client's slot map); a GET redirected (its slot moved) is sent again
        through the cluster client, redirects followed. A key whose value is foreign or
        that cannot be sent gets a CorruptRecord in its place. Raises Unavailable; a
        read changes nothing, so the caller may simply read again. Raises Unreached at
        once, nothing read, when a key's master is :attr:`Connection.down` (a daemon's refetch of
        skipped changes would otherwise wait a timeout on it every round)."""
        out: dict[str, L3Record | None | CorruptRecord] = {}
        by_node: dict[str, tuple[Any, list[tuple[str, bytes]]]] = {}
        for key in dict.fromkeys(keys):
            try:
                name = _wire_key(self.conn.groups.record_key(key))
            except CorruptRecord as exc:
                out[key] = exc
                continue
            node = self.conn.master_up(name, f"{key!r}")  # (as get: the caller reads again)
            by_node.setdefault(node.name, (node, []))[1].append((key, name))
        for node, names in by_node.values():
            self._replies(names, self.conn.call(self._pipeline(node, names), node=node), out)
        return out

    def get_each(self, keys: Iterable[str]) -> dict[str, L3Record | None | KVCommError]:
        """:meth:`get_many` with each key's own answer: the masters' pipelines at the
        same time, and a master that is down, or stops answering, or fails, answers for
        its own keys (Unreached, Unavailable in their place), after one timeout for all
        of them, not one per master in turn; the other keys are read all the same. Never
        raises for a key's master (kvcomm.aio's gathered reads: one read per key)."""
        out: dict[str, L3Record | None | KVCommError] = {}
        by_node: dict[str, tuple[Any, list[tuple[str, bytes]]]] = {}
        for key in dict.fromkeys(keys):
            try:
                name = _wire_key(self.conn.groups.record_key(key))
                node = self.conn.master_up(name, f"{key!r}")
            except KVCommError as exc:  # (CorruptRecord; Unreached: its master is down)
                out[key] = exc
                continue
            by_node.setdefault(node.name, (node, []))[1].append((key, name))
        groups = list(by_node.values())
        if len(groups) == 1:  # (one master: no thread hop)
            node, names = groups[0]
            try:
                self._replies(names, self.conn.call(self._pipeline(node, names), node=node), out)
            except KVCommError as exc:
                out.update((key, exc) for key, _name in names)
            return out
        pool = self.conn.threads()
        futures = [(names, pool.submit(self.conn.call, self._pipeline(node, names), None, node))
                   for node, names in groups]
        for names, fut in futures:  # (every master's answer, or its own error)
            try:
                self._replies(names, fut.result(), out)
            except KVCommError as exc:
                out.update((key, exc) for key, _name in names)
        return out

    def _pipeline(self, node: Any, names: list[tuple[str, bytes]]) -> Callable[[], list[Any]]:
        """A pipeline of GETs of ``names`` on master ``node``, to call."""
        def run() -> list[Any]:
            pipe = self.conn.rc.get_redis_connection(node).pipeline(transaction=False)
            for _, name in names:
                pipe.get(name)
            return pipe.execute(raise_on_error=False)

        return run

    def _replies(self, names: list[tuple[str, bytes]], replies: list[Any],
                 out: dict[str, Any]) -> None:
        """Decode a pipeline's ``replies`` into ``out``: a GET redirected (its slot moved)
        or refused for a foreign type is sent again alone; a foreign value is a
        CorruptRecord in the key's place."""
        for (key, name), raw in zip(names, replies, strict=True):
            try:
                if isinstance(raw, Exception):  # moved, or a foreign type: one GET
                    if _key_error(str(raw)) and not str(raw).startswith(_TRANSIENT):
                        raise CorruptRecord(f"L3 value of {key!r}: {raw}")
                    raw = self.conn.call(lambda name=name: self.conn.rc.get(name), key)
                out[key] = None if raw is None else self.conn.decode(raw, key)
            except CorruptRecord as exc:
                out[key] = exc
