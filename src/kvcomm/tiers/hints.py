"""The change feeds' hints: every group's sharded pub/sub channel, subscribed on the
master that serves it, read without blocking.

The push script publishes ``SPUBLISH kvh:{t} <seq>`` for every change it stores
(:mod:`kvcomm.tiers.l3`), so a daemon reads a group's stream only when told it changed,
instead of polling every group. The hint of a value-less entry carries the entry itself
(``<seq> <id> <note> <key>``): a daemon that follows the group's sequence applies it
without reading the stream (:meth:`Hints.take_entries`).

Redis Cluster's sharded pub/sub delivers a message only to the subscribers of the
channel's shard, and a channel lives in its slot: so one connection per master, each
subscribed to the channels of the slots that master serves (``SSUBSCRIBE`` takes
channels of one slot at a time: one command per group, once).

Hints are not reliable, and are not relied on: :meth:`Hints.poll` returns, besides the
groups hinted, the groups whose hints *may have been lost* — every group of a
subscription whose connection broke or reconnected, every channel the server
unsubscribed (its slot moved to another master: Redis 7 does that at ``CLUSTER SETSLOT``),
every group subscribed at a node that no longer serves its slot — and the daemon reads
their counters at once (:meth:`kvcomm.node.delivery.Inbound.lost`). Those groups are
subscribed again where their slots are now. What pub/sub loses without saying so (a
server that cannot publish, a hint published on a master during a migration, before
the slot is handed over) the daemon's sweep of every counter finds.

redis-py resubscribes a reconnected pub/sub connection with one ``SSUBSCRIBE`` of every
channel, which Redis Cluster refuses (channels of many slots); :class:`_PubSub` instead
notes the reconnection, and the groups are subscribed again one by one, as lost.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container
from typing import Any

from .groups import Groups

log = logging.getLogger("kvcomm.hints")

MAX_MESSAGES = 100_000  # messages read from one connection per poll at most
ROUTE_EVERY = 1.0  # seconds between checks that each group is subscribed where its slot is
RETRY_EVERY = 0.5  # seconds between attempts to subscribe groups that could not be


def _pubsub_class() -> type[Any]:
    from redis.client import PubSub

    class _PubSub(PubSub):
        """A PubSub that counts reconnections instead of resubscribing (see the module's doc)."""

        reconnects = 0

        def _resubscribe_shard_channels(self) -> None:
            self.reconnects += 1
            self.shard_channels = {}

    return _PubSub


def _own_pool(pool: Any) -> Any:
    """A pool of its own for one master's subscription, dialling as ``pool`` (the node's,
    which redis-py resets at each slot-map refresh read from that node: redis-py >= 5.1
    marks its connections for reconnection, and a subscription's connection, reconnected,
    had lost every group's hints; while a master is down the map is re-read twice a
    second)."""
    from redis import ConnectionPool

    return ConnectionPool(connection_class=pool.connection_class, max_connections=1,
                          **pool.connection_kwargs)


class _Sub:
    def __init__(self, node: Any, ps: Any) -> None:
        self.node, self.ps = node, ps
        self.groups: set[int] = set()
        self.reconnects = 0


class Hints:
    """The hint subscriptions of one daemon, over ``rc`` (a redis-py RedisCluster) and the
    cluster's ``groups``. ``refresh()`` re-reads the cluster's slot map (throttled by the
    caller). Never raises for what Redis does: trouble becomes lost hints."""

    def __init__(self, rc: Any, groups: Groups, refresh: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic,
                 down: Container[str] = frozenset()) -> None:
        self.rc, self.groups, self.refresh, self.clock = rc, groups, refresh, clock
        # masters taken for down (L3Store.down): not subscribed at (each group's attempt
        # would wait a connection timeout, redis-py's retries included, on a hung one)
        self.down = down
        self.subs: dict[str, _Sub] = {}  # node name → its subscription
        self.where: dict[int, str] = {}  # group → node name it is subscribed at
        self.unrouted: set[int] = set(groups)  # groups to subscribe (again)
        self.lost: set[int] = set()  # groups whose hints may have been lost, not yet told
        # hints that carry their feed entry ("seq id note key"), in arrival order, for the
        # caller to take (L3Store.hints parses them)
        self.entries: list[tuple[int, bytes]] = []
        self.routed_at = clock()
        self.retry_at = float("-inf")
        # (bytes: of the hint messages received, as RESP sends them)
        self.stats = {"hints": 0, "breaks": 0, "moved": 0, "subscribed": 0, "bytes": 0}
        self._cls = _pubsub_class()

    def poll(self) -> tuple[set[int], set[int]]:
        """(groups hinted since the last poll, groups whose hints may have been lost since
        the last poll). Reads what has arrived without blocking; subscribes what must
        be (the first call subscribes every group)."""
        hinted: set[int] = set()
        for name, sub in list(self.subs.items()):
            try:
                self._drain(sub, hinted)
            except Exception as exc:  # a broken or refused connection: its hints are lost
                self.stats["breaks"] += 1
                log.info("hint subscription at %s broke (%s): its %d groups are checked and "
                         "subscribed again", name, exc, len(sub.groups))
                self._drop(name)
                self.refresh()
        now = self.clock()
        if now - self.routed_at >= ROUTE_EVERY:
            self.routed_at = now
            self._reroute()
        if self.unrouted and now >= self.retry_at:
            self._subscribe(now)
        lost, self.lost = self.lost, set()
        return hinted, lost

    def take_entries(self) -> list[tuple[int, bytes]]:
        """The hints that carried a feed entry since the last call, (group, payload), in
        the order they arrived (a group's hints come in its publishing order)."""
        out, self.entries = self.entries, []
        return out

    def close(self) -> None:
        for name in list(self.subs):
            self._drop(name)

    # ------------------------------------------------------------------ internals

    def _drain(self, sub: _Sub, hinted: set[int]) -> None:
        ps = sub.ps
        for _ in range(MAX_MESSAGES):
            msg = ps.get_message(timeout=0.0)
            if msg is None:
                break
            kind, channel = msg.get("type"), msg.get("channel")
            g = self.groups.of_channel(channel) if isinstance(channel, bytes) else None
            if g is None:
                continue
            if kind == "smessage":
                self.stats["hints"] += 1
                data = msg.get("data")
                self.stats["bytes"] += _resp_size(channel, data)
                if isinstance(data, bytes) and b" " in data:  # it carries its feed entry
                    self.entries.append((g, data))
                else:
                    hinted.add(g)
            elif kind == "sunsubscribe" and g in sub.groups:  # the server's: the slot moved
                self.stats["moved"] += 1
                ps.shard_channels.pop(channel, None)
                self._unroute(sub, g)
        if ps.reconnects != sub.reconnects:  # hints sent while it was down are lost
            sub.reconnects = ps.reconnects
            self.stats["breaks"] += 1
            for g in list(sub.groups):
                self._unroute(sub, g)

    def _unroute(self, sub: _Sub, g: int) -> None:
        sub.groups.discard(g)
        self.where.pop(g, None)
        self.unrouted.add(g)
        self.lost.add(g)

    def _drop(self, name: str) -> None:
        sub = self.subs.pop(name)
        for g in list(sub.groups):
            self._unroute(sub, g)
        for release in (sub.ps.close, sub.ps.connection_pool.disconnect):  # (its own pool)
            try:
                release()
            except Exception:  # closing a broken connection: nothing left to release
                pass

    def _owner(self, g: int) -> Any:
        return self.rc.nodes_manager.get_node_from_slot(self.groups.slot(g))

    def _reroute(self) -> None:
        """Groups subscribed at a node that no longer serves their slot (a failover, a
        migration we were not told of) are subscribed again where they are."""
        for g, name in list(self.where.items()):
            try:
                owner = self._owner(g)
            except Exception:  # the slot map is being refreshed: next time
                return
            if owner.name != name:
                sub = self.subs[name]
                try:
                    sub.ps.sunsubscribe(self.groups.hint_channel(g))
                except Exception:  # a broken connection is noticed at the next drain
                    pass
                self._unroute(sub, g)

    def _subscribe(self, now: float) -> None:
        todo, self.unrouted = self.unrouted, set()
        failed: set[int] = set()
        skip: set[str] = set()  # (nodes that failed this round: their other groups wait too)
        for g in sorted(todo):
            node = None
            try:
                node = self._owner(g)
                if node.name in self.down or node.name in skip:
                    failed.add(g)
                    continue
                sub = self.subs.get(node.name)
                if sub is None:
                    sub = self.subs[node.name] = _Sub(node, self._cls(_own_pool(
                        self.rc.get_redis_connection(node).connection_pool)))
                sub.ps.ssubscribe(self.groups.hint_channel(g))
            except Exception as exc:  # no owner known, or the node is unreachable: retry
                log.debug("could not subscribe to group %d's hints: %s", g, exc)
                if node is not None:
                    skip.add(node.name)
                failed.add(g)
                continue
            sub.groups.add(g)
            self.where[g] = node.name
            self.stats["subscribed"] += 1
        if failed:
            self.unrouted |= failed
            self.lost |= failed
            self.retry_at = now + RETRY_EVERY
            self.refresh()


def _resp_size(channel: bytes, data: object) -> int:
    """Bytes of one ``smessage`` push (``*3``, the kind, the channel, the payload)."""
    n = len(data) if isinstance(data, bytes) else 0
    return 18 + sum(len(str(x)) + x + 5 for x in (len(channel), n))
