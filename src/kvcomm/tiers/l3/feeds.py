"""Feed reads: the groups' change feeds (XRANGE, one pipeline per master), their
sequence numbers and tails (the sweep, SWEEP_LUA), a group's position, and the hints
that say which groups to read (:class:`kvcomm.tiers.hints.Hints`). The entries are parsed
by :mod:`kvcomm.tiers.l3.feed`; the theory (sequence numbers, gaps, rewinds, reissued
numbers, lost hints) is in :mod:`kvcomm.tiers.l3`'s docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Set
from typing import Any

from ...errors import CorruptRecord, Unavailable
from ..hints import Hints
from .connection import Connection, Unreached, _key_error, _noscript
from .feed import FeedEntry, _as_id, _as_seq, _entry, _hint_entry, _valid_id
from .scripts import CURSOR_LUA, POSITION_LUA, SWEEP_LUA

HINT_ENTRIES_MAX = 100_000  # entries hints carried kept for hint_entries at most
SWEEP_BATCH = 256  # group counters one sweep call reads (~0.7 ms of one master's time)


class FeedReader:
    """Reads the groups' change feeds and counters, and takes the hints. Keeps where each
    group's feed was last read (a read elsewhere checks the cursor) and the hint
    subscriptions, closed with the connection."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._position = conn.rc.register_script(POSITION_LUA)
        self._sweep = conn.rc.register_script(SWEEP_LUA)
        self._cursor = conn.rc.register_script(CURSOR_LUA)
        # group -> the node its feed was last read from (feed_many: a read from another
        # node, a failover's new master say, checks the cursor's entry)
        self._feed_node: dict[int, str] = {}
        self._hints: Hints | None = None
        self._hint_entries: list[tuple[int, FeedEntry]] = []  # (hint_entries)
        conn.on_close(self._close_hints)

    def _close_hints(self) -> None:
        if self._hints is not None:
            self._hints.close()

    def feed(self, group: int, after: bytes = b"0-0", count: int = 1000) -> list[FeedEntry]:
        """Change-feed entries of one group after stream id ``after``."""
        name = self.conn.groups.feed_key(group)
        rows = self.conn.call(lambda: self.conn.rc.xrange(name, min=b"(" + after, count=count))
        return [_entry(eid, f) for eid, f in rows]

    def feed_many(self, cursors: Mapping[int, bytes], count: int = 500,
                  verify: Set[int] = frozenset(), checked: dict[int, bool] | None = None,
                  ) -> dict[int, list[FeedEntry] | CorruptRecord]:
        """:meth:`feed` for many groups: one pipeline of XRANGEs per master node.

        A group whose stream cannot be read as one (a foreign value under its key) gets
        a CorruptRecord in place of its entries. The XRANGE of each group of ``verify``
        is followed by a check of its cursor (CURSOR_LUA, one integer back), whose
        answer goes into ``checked``: True when the stream lost the cursor's entry while
        keeping an older one — a failover lost what the reader read there, and the
        entries read now may follow its last sequence number only because the lost
        numbers were reissued before the cursor —, False when it did not (a group whose
        check got no answer is left out). With ``checked``, a group read from another
        node than its last read (a failover's new master, a migrated slot) or read again
        through the cluster client (its slot moved) is checked too, whether in ``verify``
        or not. Raises Unavailable when the cluster cannot be reached.

        The groups of a master taken for down (:attr:`Connection.down`), or that times out now, are
        left out (read them later); raises Unreached when no master answered.
        """
        out: dict[int, list[FeedEntry] | CorruptRecord] = {}
        skipped = answered = 0
        jobs: list[tuple[Any, Callable[[], Any]]] = []
        by_node: list[list[int]] = []
        for node, gs in self.conn.by_node(cursors).values():
            if node.name in self.conn.down:
                skipped += 1
                continue

            def run(node: Any = node, gs: list[int] = gs) -> list[Any]:
                conn = self.conn.rc.get_redis_connection(node)
                mine = [g for g in gs if checked is not None and (
                    g in verify or self._feed_node.get(g) != node.name)]
                if mine:
                    self.conn.load(node, conn, self._cursor)
                pipe = conn.pipeline(transaction=False)
                for g in gs:
                    pipe.xrange(self.conn.groups.feed_key(g), min=b"(" + cursors[g], count=count)
                for g in mine:  # (after the reads: their replies keep their places)
                    pipe.evalsha(self._cursor.sha, 1, self.conn.groups.feed_key(g), cursors[g])
                raws: list[Any] = pipe.execute(raise_on_error=False)
                answers = raws[len(gs):]
                if any(_noscript(r) for r in answers):
                    self.conn.loaded.discard((node.name, self._cursor.sha))  # (restarted)
                for g, lost in zip(mine, answers, strict=True):
                    if lost in (0, 1) and checked is not None:
                        checked[g] = lost == 1
                return raws[:len(gs)]

            jobs.append((node, run))
            by_node.append(gs)
        # (where each group was read, noted only once the read is returned: a read that
        # ends in Unavailable — another master's error — is discarded with its checks, and
        # the next read of a group that changed node must check again)
        read_at: dict[int, str] = {}
        for (node, _), gs, replies in zip(jobs, by_node, self.conn.on_masters(jobs), strict=True):
            if replies is None:
                skipped += 1
                continue
            answered += 1
            read_at.update((g, node.name) for g, rows in zip(gs, replies, strict=False)
                           if not isinstance(rows, Exception))
            for g, rows in zip(gs, replies, strict=True):
                name = self.conn.groups.feed_key(g)
                try:
                    if isinstance(rows, Exception):  # the slot moved: one call, redirects followed
                        if _key_error(str(rows)):
                            raise CorruptRecord(f"L3 feed of group {g}: {rows}")
                        rows = self.conn.call(lambda g=g, name=name: self.conn.rc.xrange(
                            name, min=b"(" + cursors[g], count=count), name)
                        self._feed_node.pop(g, None)  # (the next read checks, and notes it)
                        if checked is not None:  # (a new master's, maybe: checked too)
                            lost = self.conn.call(lambda g=g, name=name: self._cursor(
                                keys=[name], args=[cursors[g]]), name)
                            if lost in (0, 1):
                                checked[g] = lost == 1
                    out[g] = [_entry(eid, f) for eid, f in rows]
                except CorruptRecord as exc:
                    out[g] = exc
        if skipped and not answered:
            raise Unreached(f"the Redis master(s) of {len(cursors)} feed(s) are down; "
                            "read again later")
        self._feed_node.update(read_at)
        return out

    def feed_heads(self, groups: Iterable[int], tails: bool = True,
                   ) -> dict[int, tuple[int | None, bytes | None]]:
        """Each group's (sequence number, tail) now: the counter (0: no change yet; None:
        a foreign value) and, with ``tails``, the id of the stream's last entry, read
        together (None: not asked, no entry, not a stream, or the counter had to be read
        on its own).

        One read-only script call per master per SWEEP_BATCH groups (SWEEP_LUA); a
        counter that call cannot read (its slot moved or is moving) is read again through
        the cluster client, redirects followed, without its tail. Raises Unavailable.
        The groups of a master :attr:`Connection.down` (or that times out now) are left out;
        raises Unreached when no master answered.
        """
        out: dict[int, tuple[int | None, bytes | None]] = {}
        skipped = answered = 0
        jobs: list[tuple[Any, Callable[[], Any]]] = []
        for node, gs in self.conn.by_node(groups).values():
            if node.name in self.conn.down:
                skipped += 1
                continue

            def run(node: Any = node, gs: list[int] = gs) -> list[tuple[list[int], Any]]:
                # (a master's slices in turn; one that times out leaves the rest out:
                # _down_or_raise answers None for the master)
                parts = [gs[at:at + SWEEP_BATCH] for at in range(0, len(gs), SWEEP_BATCH)]
                return [(part, self.conn.eval_on(node, self._sweep, "1" if tails else "0",
                                             " ".join(self.conn.groups.tags[g] for g in part)))
                        for part in parts]

            jobs.append((node, run))
        for slices in self.conn.on_masters(jobs):
            if slices is None:
                skipped += 1
                continue
            answered += 1
            for part, reply in slices:
                fields = reply.split(b",") if isinstance(reply, bytes) else []
                if len(fields) != len(part):  # (not SWEEP_LUA's answer: read each again)
                    fields = [b"E"] * len(part)
                for g, f in zip(part, fields, strict=True):
                    raw, _, tail = f.partition(b" ")
                    if raw == b"E":  # not served here (its slot moved, or is moving)
                        name = self.conn.groups.seq_key(g)
                        try:
                            got = self.conn.call(lambda name=name: self.conn.rc.get(name), name)
                        except CorruptRecord:
                            got = b"?"
                        out[g] = (0 if got is None else _as_seq(got), None)  # (no tail read)
                        continue
                    out[g] = (0 if raw == b"" else _as_seq(raw),
                              tail if tails and _valid_id(tail) else None)
        if skipped and not answered:
            raise Unreached("the Redis masters of the groups to sweep are down; swept later")
        return out

    def down_groups(self, groups: Iterable[int]) -> set[int]:
        """The groups of ``groups`` whose master is taken for :attr:`Connection.down` (by the slot
        map). Raises Unavailable (no slot map)."""
        if not self.conn.down:
            return set()
        return {g for node, gs in self.conn.by_node(groups).values() if node.name in self.conn.down
                for g in gs}

    def feed_position(self, group: int) -> tuple[int | None, bytes]:
        """(sequence number, id of the last entry kept or ``0-0``) of one group, read
        atomically: resuming from there misses no later change. Raises Unavailable;
        Unreached at once when the group's master is :attr:`Connection.down`."""
        from redis import exceptions as rex

        fk, sk = self.conn.groups.feed_key(group), self.conn.groups.seq_key(group)
        node = self.conn.master_up(fk, f"group {group}")

        def run() -> Any:
            try:  # (on its master: one timeout, no redis-py retry, if it hangs)
                return self._position(keys=[fk, sk], client=self.conn.rc.get_redis_connection(node))
            except (rex.MovedError, rex.AskError):  # (its slot moved: redirects followed)
                return self._position(keys=[fk, sk])

        raw = self.conn.call(run, fk, node=node)
        seq = raw[0] if type(raw[0]) is int and raw[0] >= 0 else None
        return seq, _as_id(raw[1])

    def feed_bounds(self, group: int) -> tuple[bytes | None, bytes]:
        """(first id still kept, or None when trimmed empty; last id ever added)."""
        name = self.conn.groups.feed_key(group)
        try:
            info = self.conn.call(lambda: self.conn.rc.xinfo_stream(name), name)
        except Unavailable as exc:
            if "no such key" in str(exc).lower():
                return None, b"0-0"
            raise
        first = info.get("first-entry")
        return (_as_id(first[0]) if first else None,
                _as_id(info.get("last-generated-id", b"0-0")))

    # ------------------------------------------------------------------ hints

    def hints(self) -> tuple[set[int], set[int]]:
        """(groups hinted since the last call, groups whose hints may have been lost
        since the last call); the first call subscribes every group's hint channel
        (:class:`kvcomm.tiers.hints.Hints`). Never blocks; never raises for what Redis
        does (trouble is reported as lost hints)."""
        if self._hints is None:
            self._hints = Hints(self.conn.rc, self.conn.groups, self.conn.refresh_topology,
                                down=self.conn.down)
        hinted, lost = self._hints.poll()
        for g, data in self._hints.take_entries():
            entry = _hint_entry(data)
            if entry is None:  # (not one we can use: read the group's stream instead)
                hinted.add(g)
            else:
                self._hint_entries.append((g, entry))
        if len(self._hint_entries) > HINT_ENTRIES_MAX:  # (not taken: their streams are read)
            hinted.update(g for g, _ in self._hint_entries)
            self._hint_entries.clear()
        return hinted, lost

    def hint_entries(self) -> list[tuple[int, FeedEntry]]:
        """The value-less feed entries that hints carried since the last call, (group,
        entry), in the order they arrived: collected by :meth:`hints`. Never raises."""
        out, self._hint_entries = self._hint_entries, []
        return out

    @property
    def hint_stats(self) -> dict[str, int]:
        """Counts of the hint subscriptions: hints, breaks, moved, subscribed."""
        return dict(self._hints.stats) if self._hints is not None else {}
