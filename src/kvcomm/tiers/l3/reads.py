"""Record reads: one key's record, or many keys' in one pipeline of GETs per master."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ...errors import CorruptRecord
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
            def run(node: Any = node, names: list[tuple[str, bytes]] = names) -> list[Any]:
                pipe = self.conn.rc.get_redis_connection(node).pipeline(transaction=False)
                for _, name in names:
                    pipe.get(name)
                return pipe.execute(raise_on_error=False)

            for (key, name), raw in zip(names, self.conn.call(run, node=node), strict=True):
                try:
                    if isinstance(raw, Exception):  # moved, or a foreign type: one GET
                        if _key_error(str(raw)) and not str(raw).startswith(_TRANSIENT):
                            raise CorruptRecord(f"L3 value of {key!r}: {raw}")
                        raw = self.conn.call(lambda name=name: self.conn.rc.get(name), key)
                    out[key] = None if raw is None else self.conn.decode(raw, key)
                except CorruptRecord as exc:
                    out[key] = exc
        return out
