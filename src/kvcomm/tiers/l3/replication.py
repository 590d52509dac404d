"""Replication confirmation: how many replicas took a write, and when a write that
fewer took (the master had fewer connected) is confirmed after all.

A push pipeline ends with ROLE and WAIT on the master's connection
(:meth:`Replication.replicas_to_wait`); a write acknowledged by fewer replicas than
``cluster.wait_replicas`` is *short*, and the node daemon holds it until a later probe
on that master (:meth:`Replication.confirm_replicated`) reaches the target in the same
replication history (:attr:`Replication.histories`: ``run_id:master_replid`` from INFO),
since WAIT counts replicas up to the connection's last write.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

from ...errors import Unavailable
from .connection import Connection

log = logging.getLogger("kvcomm.l3")

HISTORIES_MAX = 1024  # nodes whose replication history Replication.histories keeps at most
UNSEEN_RETRY = 60.0  # seconds before a node whose INFO was refused or odd is asked again


class Replication:
    """What this store knows of the masters' replicas: ``wait_replicas`` and ``wait_ms``
    (``cluster.wait_replicas`` and ``cluster.wait_timeout``: 0, no WAIT), each master's
    replicas connected at its last write, its replication history when last seen, the
    latest probe confirmed there, and the masters with writes acknowledged short."""

    def __init__(self, conn: Connection, wait_replicas: int = 0, wait_ms: int = 100) -> None:
        self.conn = conn
        self.wait_replicas, self.wait_ms = wait_replicas, wait_ms
        self.degraded: dict[str, int] = {}  # master → writes acknowledged by fewer replicas
        # master → (the latest probe (confirm_replicated) there that cluster.wait_replicas
        # replicas acknowledged, the replication history the master ran after that WAIT):
        # every write on that master before the probe, in that history, is on that many
        # replicas (WAIT counts up to the connection's last write). A node name alone is
        # not enough: a failback (the master fails over, losing a write, then is made
        # master again at the same address) or a restart keeps the name, not the write
        self.confirmed: dict[str, tuple[int, str]] = {}
        # node → its replication history when last seen (INFO): "<run_id>:<master_replid>"
        # while a master, "" while not one. A master's replid changes whenever its data
        # may stop being a prefix of what it had (promoted, demoted and resynced, full
        # sync) and run_id on every restart (which may reload the replid from the RDB
        # file: the replid alone would not do), and neither ever comes back: a node seen
        # twice with one history was a master throughout, appending to the same data
        self.histories: dict[str, str] = {}
        # node → monotonic time before which its INFO is not asked again: it was refused
        # (an ACL without INFO, a proxy) or not INFO's — else every push pipeline there
        # would send it again, forever; its history stays unknown (what it took short
        # of its replicas is held until the bound: never confirmable)
        self.unseen: dict[str, float] = {}
        # (node, group) pairs whose probe the node refused with MOVED since the daemon
        # last took them: the group's slot moved off the master that took its held
        # records (a migration), so no WAIT there could ever confirm them
        self.unserved: set[tuple[str, int]] = set()
        self.calls = itertools.count(1)  # (next() is atomic: pipelines run in threads)
        self.connected: dict[str, int] = {}  # master → replicas it had at the last write

    def replicas_to_wait(self, node: Any, role: Any) -> int:
        """``cluster.wait_replicas``, or every replica the master has connected if it has
        fewer: after a failover the promoted master has none until its old master comes
        back, and its writes must not wait for a replica that does not exist (they would
        stay dirty, and the host would stop taking writes). Counted and logged."""
        try:
            connected = len(role[2]) if role[0] in (b"master", "master") else self.wait_replicas
        except (TypeError, IndexError):
            connected = self.wait_replicas
        self.connected[node.name] = connected
        if connected < self.wait_replicas:
            self.degraded[node.name] = self.degraded.get(node.name, 0) + 1
            if self.degraded[node.name] == 1:
                log.warning("Redis master %s has %d replica(s) connected, fewer than "
                            "cluster.wait_replicas=%d: its writes wait for those only",
                            node.name, connected, self.wait_replicas)
        else:
            self.degraded.pop(node.name, None)
        return min(self.wait_replicas, connected)

    def see(self, name: str, server: Any, repl: Any) -> str:
        """Note node ``name``'s replication history from its ``INFO server`` and ``INFO
        replication`` replies (:attr:`histories`; and its replicas connected,
        :attr:`connected`). Returns it ("" when the node is not a master, or the replies
        are not INFO's: an error, say — then nothing is noted)."""
        try:
            master = str(repl["role"]) == "master"
            history = f"{server['run_id']}:{repl['master_replid']}" if master else ""
            connected = int(repl.get("connected_slaves", 0))
        except (KeyError, TypeError, ValueError, AttributeError):
            if name not in self.unseen:
                log.warning("Redis node %s answered INFO with %.200r: its replication history "
                            "cannot be seen, so writes it acknowledges short of "
                            "cluster.wait_replicas are never confirmed (held until the bound); "
                            "asked again in %gs", name, repl, UNSEEN_RETRY)
            if len(self.unseen) >= HISTORIES_MAX:
                self.unseen.clear()
            self.unseen[name] = time.monotonic() + UNSEEN_RETRY
            return ""
        self.unseen.pop(name, None)
        self.note(name, history)
        if master:
            self.connected[name] = connected
        return history

    def note(self, name: str, history: str) -> None:
        """:attr:`histories`: node ``name`` seen in ``history`` ("" not a master)."""
        if name not in self.histories and len(self.histories) >= HISTORIES_MAX:
            try:  # (the oldest seen: bounded; push pipelines run in threads)
                del self.histories[next(iter(self.histories))]
            except (KeyError, RuntimeError, StopIteration):
                pass
        self.histories[name] = history

    def confirm_replicated(self, group: int, node_name: str = "") -> bool:
        """With ``wait_replicas``: a probe write on node ``node_name`` (the master that
        took the records to confirm; ``group``'s master when empty or not in the slot
        map) under ``kvw:{t}`` (the group's tag, gone after 10 s: a node that no longer
        serves the group refuses it), then WAIT there and INFO (server, replication), in
        one pipeline: when ``wait_replicas`` replicas acknowledge it and the master still
        runs the history it ran when it was seen before (:attr:`histories`), every
        earlier write on that master in that history is on that many replicas too, and
        :attr:`confirmed` records (this probe's number, the history) (a host with
        records pushed short, and nothing more to push there, learns when they became
        durable). The INFO notes the master's history (and its replicas) every time:
        a master seen in another history than a record was written in (a failover and
        back, a restart) has left that history, which may have lost the record. Nothing
        is written, and nothing waited for, while the master was last seen with fewer
        replicas connected than ``wait_replicas`` (or not as a master): that probe only
        looks. Returns whether it was confirmed. Raises Unavailable."""
        if not self.wait_replicas:
            return False
        from redis.exceptions import MovedError

        probe = "kvw:" + self.conn.groups.feed_key(group)[4:]
        # (that very node: demoted since, a failover's replica, it shows that its history
        # was left — which the group's new master would not)
        node = self.conn.rc.get_node(node_name=node_name) if node_name else None  # type: ignore[no-untyped-call]
        if node is None and node_name:
            # gone from the slot map (dead for good, readdressed, or serving no slot):
            # not seen as a master, so the records it took are sent again — else
            # nothing would ever confirm them, or show a history left
            self.note(node_name, "")
            return False
        if node is None:
            node = self.conn.call(lambda: self.conn.rc.get_node_from_key(probe))  # type: ignore[no-untyped-call]
        if node.name in self.conn.down:
            return False  # (not waited for: probed again once it answers a PING)
        call = next(self.calls)
        conn = self.conn.rc.get_redis_connection(node)
        before = self.histories.get(node.name, "")
        if not before and self.unseen.get(node.name, 0.0) > time.monotonic():
            return False  # (its INFO was refused just now: asked again later)
        write = bool(before) and self.connected.get(node.name, 0) >= self.wait_replicas

        def run() -> list[Any]:
            pipe = conn.pipeline(transaction=False)
            if write:
                pipe.execute_command("SET", probe, b"1", "PX", 10_000)  # type: ignore[no-untyped-call]
                pipe.execute_command("WAIT", self.wait_replicas, self.wait_ms)  # type: ignore[no-untyped-call]
            pipe.execute_command("INFO", "server")  # type: ignore[no-untyped-call]
            pipe.execute_command("INFO", "replication")  # type: ignore[no-untyped-call]
            return pipe.execute(raise_on_error=False)

        try:
            raws = self.conn.call(run, node=node)
        except Unavailable:
            # a master that cannot be reached, and that the slot map (re-read by call)
            # no longer has serving the group: failed over, dead for good maybe — it
            # left the history (redis-py may keep it in its slot map: the probe would
            # fail every second, and the records it took stay held)
            try:
                serving = self.conn.rc.get_node_from_key(probe).name  # type: ignore[no-untyped-call]
            except Exception:
                serving = node.name
            if not node_name or serving == node.name:
                raise
            self.note(node.name, "")
            return False
        history = self.see(node.name, raws[-2], raws[-1])  # (after the WAIT: seen since)
        if not write or not history or history != before:
            return False
        stored, acked = raws[0], raws[1]
        if isinstance(stored, MovedError):  # (an AskError too: ASK is not one)
            # the group's slot left this master (a migration; ASK, a migration under
            # way, is waited out): its records here are to be sent again, to the slot's
            # master now
            self.unserved.add((node.name, group))
            self.conn.refresh_topology()
            return False
        if isinstance(stored, Exception) or not isinstance(acked, int):
            return False  # (moved, say: the node is no longer the group's master)
        if acked < self.wait_replicas:
            return False
        self.confirmed[node.name] = (call, history)
        return True

    def set_replicated(self, name: str, value: int, node: Any) -> None:
        """``SET name value``, then (``wait_replicas``) WAIT for the replicas a push
        waits for. Raises what redis-py raises (the caller's call translates it),
        Unavailable (too few replicas took it; it may be on the master)."""
        if not self.wait_replicas:
            self.conn.on(node, "SET", name, value)
            return
        from redis import exceptions as rex

        pipe = self.conn.rc.get_redis_connection(node).pipeline(transaction=False)
        pipe.set(name, value)
        pipe.execute_command("ROLE")  # type: ignore[no-untyped-call]
        pipe.execute_command("WAIT", self.wait_replicas, self.wait_ms)  # type: ignore[no-untyped-call]
        try:
            _, role, acked = pipe.execute()
        except rex.ResponseError as exc:
            if str(exc).startswith(("MOVED", "ASK")):  # (the slot moved: re-read the map)
                self.conn.refresh_topology(force=True)
            raise
        want = self.replicas_to_wait(node, role)
        if not isinstance(acked, int) or acked < want:
            raise Unavailable(f"the write mark {name} reached {acked} of {want} replica(s) "
                              f"within cluster.wait_timeout; the pushes it covers wait")
