"""The key index (prefix scans) and the scans of every key: each group keeps a sorted set
``kvi:{t}`` of its live keys, kept by the push script with the record; a page of a scan
reads every group's index, one read-only script call (INDEX_LUA) per master and up to
INDEX_BATCH groups, and merges the sorted answers. Keys past their deadline leave it
through ``kvx:{t}`` (:meth:`ClusterKeyIndex.expire_index`). See "The key index" and "Expiry" in
:mod:`kvcomm.tiers.l3`'s docstring for the costs and the upgrade (backfill).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterable, Iterator
from typing import Any

from ...errors import Unavailable
from .connection import Connection, Unreached
from .meta import META_INDEX
from .records import _wire_key
from .scripts import BACKFILL_LUA, EXPIRE_INDEX_LUA, INDEX_LUA

INDEX_BATCH = 512  # group indexes one call of a scan reads on one master
NODE_MAP_S = 1.0  # how long a scan trusts its map of the groups' masters


class ClusterKeyIndex:
    """Pages through the groups' key indexes, drops expired keys from them, backfills
    them, and lists every key (scans). Keeps a map of every group's master for
    NODE_MAP_S (a page would otherwise spend more on slot lookups than on Redis)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._backfill = conn.rc.register_script(BACKFILL_LUA)
        self._index = conn.rc.register_script(INDEX_LUA)
        self._expire_index = conn.rc.register_script(EXPIRE_INDEX_LUA)
        self._nodes: list[Any] | None = None  # every group's master (_by_node_cached)
        self._nodes_at = 0.0

    def index_range(self, prefix: str, after: str, limit: int,
                    groups: Iterable[int] | None = None) -> tuple[list[str], str | None]:
        """Indexed keys under ``prefix`` after ``after``, in key order, from every group
        (or ``groups``): ``(keys, bound)``. ``keys`` is every indexed key in
        (after, bound] (``bound`` None: through the prefix's end); at most ``limit`` per
        group are read, so keys past ``bound`` need another call (from ``after=bound``).
        Cost: one ZRANGEBYLEX per group, pipelined per master (see "The key index").
        Raises Unavailable."""
        pb, ab = _wire_key(prefix), _wire_key(after)
        lo = b"(" + ab if ab >= pb else b"[" + pb  # (prefix and after "": "(" skips b"")
        hi = b"[" + pb + b"\xff" if pb else b"+"  # (no UTF-8 key holds a 0xff byte)
        rows: list[list[bytes]] = []
        bound: bytes | None = None
        for node, gs in self._by_node_cached(self.conn.groups if groups is None else groups).values():
            for at in range(0, len(gs), INDEX_BATCH):
                part = gs[at:at + INDEX_BATCH]

                def run(node: Any = node, part: list[int] = part) -> list[Any]:
                    names = [self.conn.groups.index_key(g) for g in part]
                    return list(self.conn.eval_on(node, self._index, lo, hi, limit, *names))

                for g, got in zip(part, self.conn.call(run), strict=True):
                    name = self.conn.groups.index_key(g)
                    if not isinstance(got, list):  # its slot moved: redirects followed
                        got = self.conn.call(lambda name=name: self.conn.rc.zrangebylex(
                            name, lo, hi, start=0, num=limit), name)
                    row = [k for k in got if _utf8(k)]  # (the empty member is no key either)
                    # A member that is not UTF-8 (written by something else than KVCOMM)
                    # is no key, and cannot be a page's bound (the next page starts after
                    # the bound as a str): a group read to its limit bounds the page at
                    # its last key, read further past members that are no keys.
                    while len(got) >= limit and not row:
                        last = got[-1]
                        got = self.conn.call(lambda name=name, last=last: self.conn.rc.zrangebylex(
                            name, b"(" + last, hi, start=0, num=limit), name)
                        row = [k for k in got if _utf8(k)]
                    if len(got) >= limit and (bound is None or row[-1] < bound):
                        bound = row[-1]
                    rows.append(row)
        keys = [k.decode("utf-8") for k in heapq.merge(*rows) if bound is None or k <= bound]
        return keys, None if bound is None else bound.decode("utf-8")

    def expire_index(self, now: float, groups: Iterable[int] | None = None,
                     limit: int = 256, skipped: set[int] | None = None) -> int:
        """Drop the keys past their deadline at ``now`` from the key index of ``groups``
        (None: every group; at most ``limit`` keys per group): one script call per master
        per INDEX_BATCH groups. Returns how many were dropped. Raises Unavailable.

        The groups of a master :attr:`Connection.down` (or that times out now) are left out and
        added to ``skipped`` (do them later); raises Unreached when no master answered
        (the node daemon does this once a second: it must not wait on a hung master)."""
        dropped = answered = missed = 0
        for node, gs in self._by_node_cached(self.conn.groups if groups is None else groups).values():
            for at in range(0, len(gs), INDEX_BATCH):
                part = gs[at:at + INDEX_BATCH]
                names: list[str] = []
                for g in part:
                    names += [self.conn.groups.expiry_key(g), self.conn.groups.index_key(g)]

                def run(node: Any = node, names: list[str] = names) -> Any:
                    return self.conn.eval_on(node, self._expire_index, repr(now), limit, *names)

                got = None if node.name in self.conn.down else self.conn.down_or_raise(run, node)
                if got is None:
                    missed += 1
                    if skipped is not None:
                        skipped.update(gs[at:])
                    break
                answered += 1
                dropped += int(got)
        if missed and not answered:
            raise Unreached("the Redis master(s) of the key index groups to expire are "
                            "down; expired later")
        return dropped

    def _by_node_cached(self, groups: Iterable[int]) -> dict[str, tuple[Any, list[int]]]:
        """:meth:`Connection.by_node` from a map of every group's master kept for NODE_MAP_S: a scan
        page would otherwise spend more on G slot lookups than on Redis. A stale entry
        costs a redirect (the caller reads that group again through the cluster client)."""
        now = time.monotonic()
        if self._nodes is None or now - self._nodes_at > NODE_MAP_S:
            nm = self.conn.rc.nodes_manager
            self._nodes = self.conn.call(lambda: [nm.get_node_from_slot(s) for s in self.conn.groups.slots])
            self._nodes_at = now
        nodes = self._nodes
        out: dict[str, tuple[Any, list[int]]] = {}
        for g in groups:
            node = nodes[g]
            out.setdefault(node.name, (node, []))[1].append(g)
        return out

    def index_ready(self) -> bool:
        """Whether the key index covers data written before it existed (``kvm:index``
        set by :meth:`backfill_index`). Raises Unavailable."""
        node = self.conn.master_up(META_INDEX, META_INDEX)  # (one timeout if it hangs)
        return bool(self.conn.call(lambda: self.conn.on(node, "EXISTS", META_INDEX), META_INDEX,
                               node=node))

    def backfill_index(self, batch: int = 500) -> int:
        """Index every record L3 holds (once, after an upgrade; see "The key index"):
        each group's keys are listed (its slot's keys), and each is indexed by a script
        that reads its record atomically (live: ZADD; a tombstone or gone: ZREM), so a
        push racing the backfill is never undone. Records ``kvm:index`` when done;
        idempotent. Returns the keys looked at. Raises Unavailable (run it again)."""
        seen = 0
        for g in self.conn.groups:
            names = list(self.scan_group(g))
            idx = self.conn.groups.index_key(g)
            for at in range(0, len(names), batch):
                part = names[at:at + batch]
                slot = self.conn.groups.slot(g)
                node = self.conn.call(lambda slot=slot: self.conn.rc.nodes_manager.get_node_from_slot(slot))
                prefix = self.conn.groups.record_prefix(g)

                def run(node: Any = node, part: list[bytes] = part, idx: str = idx,
                        prefix: bytes = prefix) -> list[Any]:
                    conn = self.conn.rc.get_redis_connection(node)
                    self.conn.load(node, conn, self._backfill)
                    pipe = conn.pipeline(transaction=False)
                    for k in part:
                        pipe.evalsha(self._backfill.sha, 2, prefix + k, idx, k)
                    return pipe.execute(raise_on_error=False)

                for r in self.conn.call(run):
                    if isinstance(r, Exception):
                        raise Unavailable(f"the key index backfill of group {g} was "
                                          f"refused ({r}); run it again")
                seen += len(part)
        self.conn.call(lambda: self.conn.rc.set(META_INDEX, 1), META_INDEX)
        return seen

    # ------------------------------------------------------------------ scans

    def scan_keys(self, skipped: set[int] | None = None) -> Iterator[bytes]:
        """Every KVCOMM key L3 holds, from every master (a SCAN: for rebuilds, not hot
        paths). Raises Unavailable.

        One master at a time. A master taken for :attr:`Connection.down`, or that times out or
        refuses the connection during its scan (it is then taken for down), raises
        Unreached; with ``skipped``, it is left out instead (a hung master would
        otherwise fail the whole scan), and the groups it serves (by the slot map) are
        added to ``skipped``: their keys may be missing (read them with
        :meth:`scan_group` once it answers)."""
        by_node = self.conn.by_node(self.conn.groups)
        primaries = self.conn.call(lambda: self.conn.rc.get_primaries())  # type: ignore[no-untyped-call]
        masters = {m.name: m for m in primaries}
        masters.update((name, node) for name, (node, _) in by_node.items())
        for name, node in masters.items():
            def scan(node: Any = node) -> list[bytes]:
                conn = self.conn.rc.get_redis_connection(node)
                return list(conn.scan_iter(match="kvc:{*", count=1000))

            raws = None if name in self.conn.down else self.conn.down_or_raise(scan, node)
            if raws is None:
                if skipped is None:
                    raise Unreached(f"Redis master {name} did not answer the scan of "
                                    "KVCOMM's keys; scan again once it answers")
                skipped.update(by_node.get(name, (node, []))[1])
                continue
            yield from _record_names(raws)

    def slot_keys(self, slot: int) -> list[bytes]:
        """Every key Redis holds in ``slot`` (on the master serving it: CLUSTER
        GETKEYSINSLOT). Raises Unavailable."""
        def run() -> list[bytes]:
            node = self.conn.rc.nodes_manager.get_node_from_slot(slot)
            conn = self.conn.rc.get_redis_connection(node)
            # the names as bytes: redis-py's own callback decodes them, and a name that
            # is not UTF-8 would come back altered (a slot migration would miss it)
            conn.set_response_callback("CLUSTER GETKEYSINSLOT", _raw)
            n = int(conn.execute_command("CLUSTER COUNTKEYSINSLOT", slot))  # type: ignore[no-untyped-call]
            if not n:
                return []
            return list(conn.execute_command(  # type: ignore[no-untyped-call]
                "CLUSTER GETKEYSINSLOT", slot, n + 100))

        return self.conn.call(run)  # type: ignore[no-any-return]

    def scan_group(self, group: int) -> Iterator[bytes]:
        """Every KVCOMM key of one group (the keys of its slot with its record prefix)."""
        prefix = self.conn.groups.record_prefix(group)
        for raw in self.slot_keys(self.conn.groups.slot(group)):
            if raw.startswith(prefix) and len(raw) > len(prefix):
                yield raw[len(prefix):]


def _record_names(raws: Iterable[bytes]) -> Iterator[bytes]:
    """The keys of the record names ``raws`` (``kvc:{tag}:key``)."""
    for raw in raws:
        _, sep, key = raw.partition(b"}:")
        if sep and key:  # (a foreign name under our prefix is no key of ours)
            yield key


def _raw(r: Any, **kwargs: Any) -> Any:
    return r


def _utf8(member: bytes) -> bool:
    """Whether a key index member can be a key: not empty, strict UTF-8."""
    if not member:
        return False
    try:
        member.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
