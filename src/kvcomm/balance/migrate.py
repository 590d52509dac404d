"""Moving one hash slot between Redis masters while writes keep flowing, nothing lost.

Redis Cluster's own protocol (as ``redis-cli --cluster reshard`` does it), slot by slot:

1. ``CLUSTER SETSLOT s IMPORTING <source>`` on the target, then ``CLUSTER SETSLOT s
   MIGRATING <target>`` on the source. From now on the source serves the slot's keys it
   still holds and answers ``ASK target`` for the others; the target serves a command
   preceded by ``ASKING``.
2. ``MIGRATE target "" 0 <timeout> REPLACE KEYS k1 … kn`` in batches, from ``CLUSTER
   GETKEYSINSLOT`` of the source, until it holds none. A group's change feed and counter
   (``kvf:{t}``, ``kvs:{t}``: same hash tag, same slot) move together, in the last
   batch, so the position script always sees both or neither, and pushes to records
   not yet moved keep running on the source meanwhile.
3. ``CLUSTER SETSLOT s NODE <target>`` on the target first (it bumps its config epoch,
   so the rest of the cluster learns it), then on the source (which refuses while it
   still holds keys of the slot: the loop goes back to 2), then on every other master.

Writes during a move: the push script declares a record, its feed and its counter.
On the source, if all three are there the push runs there; if none are, the answer is
``ASK`` and the push runs on the target after ``ASKING``; if some are (a record moved,
its feed not yet; or a new key), Redis answers ``TRYAGAIN``. The node daemon
(:meth:`kvcomm.tiers.l3.L3Store.push_many`) follows ASK and MOVED and retries TRYAGAIN
with a short backoff; pushes are idempotent (versioned: a repeated record is
``equal``), so a retry never stores anything twice, and a retried push counts as
durable only when a replica of the node that ran it acknowledged it (WAIT on the same
connection).

Nothing lost across a failed batch. ``MIGRATE`` copies the keys to the target, and only
once the target has answered deletes them from the source. An ``IOERR`` or a timeout
may come after the target stored some keys and before the source deleted them: the
keys are then on both sides. The source's copy is the right one — while a key is on the
source every write of it goes to the source (the target only serves keys the source
does not hold) — so the batch is simply sent again with ``REPLACE`` (counted as
reconciled: ``MoveResult.reconciled`` keys were found on both sides). A key is never
deleted anywhere but by MIGRATE's own delete after the target's acknowledgement.

Moves left open. A move interrupted (the balancer killed, a node that stopped
answering, the source failed over: a replica promoted knows nothing of MIGRATING)
leaves the slot importing on its target and perhaps migrating on its source, with the
keys already moved out of everyone's sight (the source no longer redirects to them) or
the group's writes refused (``TRYAGAIN``: its feed on one side, a record on the other).
When the source failed over, the target, which ignores news of a slot it imports,
still names the failed node as the slot's owner, so its whole cluster state fails:
CLUSTERDOWN for every slot it serves. So before every move, :meth:`SlotMover.move`
first settles an open move of the same slot: every importer is told the slot's owner,
every other master that holds some of its keys gets the rest (the open move is
finished there first; the slot then goes on to where it was asked to go), and nodes
left importing or migrating with no keys elsewhere are made stable.
:meth:`SlotMover.recover` does that for every open slot; the balancer calls it when it
starts and every cycle. A node shows its own importing/migrating slots only in its own
line of ``CLUSTER NODES``, so these are read from every master
(:meth:`SlotMover.own_views`). Two balancers (or a balancer and ``redis-cli --cluster
reshard``) must not run at once: each would settle the other's move.

Every Redis call of a move goes through :meth:`kvcomm.tiers.l3.L3Store._call`: a node
that does not answer is Unavailable (the move stops, left open, and is settled by the
next move of the slot or the next :meth:`SlotMover.recover`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgument, Unavailable
from ..tiers.l3 import L3Store

log = logging.getLogger("kvcomm.balance")

BATCH = 100  # keys per MIGRATE
MIGRATE_TIMEOUT_MS = 5000  # MIGRATE's own timeout for one batch
RETRIES = 20  # failed batches (IOERR, timeout) tolerated in one move before giving up
# how long a settle waits for an importer to hear of a failover's promotion (gossip: a
# node timeout and a few pings on a loaded machine) before it leaves the slot to the
# next cycle
PROMOTION_WAIT_S = 10.0


@dataclass(frozen=True)
class NodeInfo:
    """One node of ``CLUSTER NODES``."""

    id: str
    name: str  # "host:port"
    master: bool
    slots: frozenset[int]
    importing: dict[int, str]  # slot → id of the node it imports it from
    migrating: dict[int, str]  # slot → id of the node it migrates it to


def parse_nodes(text: str) -> list[NodeInfo]:
    """The nodes of a ``CLUSTER NODES`` reply (a node marked failed is left out)."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 8:
            continue
        flags = parts[2].split(",")
        if "fail" in flags or "noaddr" in flags:
            continue
        slots: set[int] = set()
        importing: dict[int, str] = {}
        migrating: dict[int, str] = {}
        for spec in parts[8:]:
            if spec.startswith("["):  # [slot->-id] migrating, [slot-<-id] importing
                body = spec.strip("[]")
                if "->-" in body:
                    s, node = body.split("->-")
                    migrating[int(s)] = node
                elif "-<-" in body:
                    s, node = body.split("-<-")
                    importing[int(s)] = node
            elif "-" in spec:
                lo, hi = spec.split("-")
                slots.update(range(int(lo), int(hi) + 1))
            else:
                slots.add(int(spec))
        out.append(NodeInfo(parts[0], parts[1].split("@")[0], "master" in flags,
                            frozenset(slots), importing, migrating))
    return out


@dataclass(frozen=True)
class MoveResult:
    """What one slot move did."""

    slot: int
    source: str  # node names ("host:port")
    target: str
    keys: int  # keys moved
    bytes: int  # their size (MEMORY USAGE, taken before each batch)
    batches: int  # MIGRATE calls that moved keys
    retries: int  # batches sent again after an IOERR or a timeout
    reconciled: int  # keys found on both sides after a failed batch (the source's kept)
    seconds: float


class SlotMover:
    """Moves slots of the Redis Cluster behind ``store`` (its credentials, its nodes).
    ``batch`` keys per MIGRATE, each with MIGRATE's own ``timeout_ms``; ``clock`` and
    ``sleep`` are passed in for tests."""

    def __init__(self, store: L3Store, *, batch: int = BATCH,
                 timeout_ms: int = MIGRATE_TIMEOUT_MS, retries: int = RETRIES,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 before_batch: Callable[[int, list[bytes]], None] | None = None) -> None:
        if batch < 1 or timeout_ms < 1:
            raise InvalidArgument("batch and timeout_ms must be at least 1")
        self.store, self.batch, self.timeout_ms, self.retries = store, batch, timeout_ms, retries
        self.clock, self.sleep = clock, sleep
        self.before_batch = before_batch  # (a test's hook: a fault between batches)

    # ------------------------------------------------------------------ topology

    def nodes(self) -> list[NodeInfo]:
        """Every live node, as the cluster sees it now (one node's view: its line for
        another node does not show that node's importing/migrating slots). Raises
        Unavailable."""
        rc: Any = self.store.rc
        last: Exception | None = None
        for node in rc.get_primaries():
            try:
                conn = rc.get_redis_connection(node)
                conn.set_response_callback("CLUSTER NODES", _raw)  # the text, not redis-py's dict
                raw = conn.execute_command("CLUSTER NODES")
            except Exception as exc:  # that node is down: ask another
                last = exc
                continue
            text = raw.decode() if isinstance(raw, bytes) else str(raw)
            return parse_nodes(text)
        raise Unavailable(f"no Redis master answered CLUSTER NODES ({last})")

    def masters(self) -> list[NodeInfo]:
        return [n for n in self.nodes() if n.master]

    def own_views(self) -> dict[str, NodeInfo]:
        """Every master as it sees itself (its own line of its own CLUSTER NODES: the
        only one that shows its importing and migrating slots), by name. Raises
        Unavailable when a master does not answer."""
        out = {}
        for m in self.masters():
            conn = self._conn(m.name)

            def run(conn: Any = conn) -> Any:
                conn.set_response_callback("CLUSTER NODES", _raw)
                return conn.execute_command("CLUSTER NODES")

            raw = self.store._call(run)
            text = raw.decode() if isinstance(raw, bytes) else str(raw)
            me = next((n for n in parse_nodes(text) if n.id == m.id), None)
            out[m.name] = me if me is not None else m
        return out

    def owner(self, slot: int) -> NodeInfo:
        """The master serving ``slot``. Raises Unavailable when none does."""
        for n in self.masters():
            if slot in n.slots:
                return n
        raise Unavailable(f"no master serves slot {slot}")

    def _conn(self, name: str) -> Any:
        host, _, port = name.rpartition(":")
        rc: Any = self.store.rc
        node = rc.get_node(host=host, port=int(port))
        if node is None:
            self.store._refresh_topology(force=True)
            node = rc.get_node(host=host, port=int(port))
            if node is None:
                raise Unavailable(f"Redis node {name} is not in the cluster's slot map")
        return rc.get_redis_connection(node)

    def _cmd(self, name: str, *args: Any) -> Any:
        """One command on the node ``name``; Redis errors as Unavailable."""
        conn = self._conn(name)
        return self.store._call(lambda: conn.execute_command(*args))

    def _count(self, name: str, slot: int) -> int:
        return int(self._cmd(name, "CLUSTER COUNTKEYSINSLOT", slot))

    # ------------------------------------------------------------------ open moves

    def open_slots(self, views: dict[str, NodeInfo] | None = None) -> dict[int, set[str]]:
        """The slots some master imports or migrates: slot → the names of the masters
        it is open towards (importers, and the targets its owner migrates it to)."""
        views = self.own_views() if views is None else views
        by_id = {n.id: name for name, n in views.items()}
        out: dict[int, set[str]] = {}
        for name, n in views.items():
            for s in n.importing:
                out.setdefault(s, set()).add(name)
            for s, to in n.migrating.items():
                out.setdefault(s, set()).update([by_id[to]] if to in by_id else [])
        return out

    def _settle(self, slot: int, target: str | None) -> list[MoveResult]:
        """Settle an open move of ``slot`` before it goes to ``target`` (None: settle
        only; see the module's doc). Returns the moves made. Raises Unavailable."""
        views = self.own_views()
        importers = {n for n, v in views.items() if slot in v.importing}
        if not importers and not any(slot in v.migrating for v in views.values()):
            return []  # (the usual case: one CLUSTER NODES per master, nothing else)
        owner = next((n for n, v in views.items() if slot in v.slots), None)
        if owner is not None:
            # An importer ignores what the cluster says of the slot's owner: after a
            # failover of the source it still names the failed node, so its whole
            # cluster state fails (CLUSTERDOWN for every slot it serves). Tell it.
            for name in sorted(importers - {owner}):
                self._tell_owner(name, slot, views[owner])
        holders = sorted(n for n in views if n != owner and self._count(n, slot) > 0)
        done: list[MoveResult] = []
        for name in holders:  # keys out of sight there: they get the rest of the slot
            log.warning("slot %d: a move to %s was left open with keys there; finishing "
                        "it", slot, name)
            done.append(self._move(slot, name))
        views = self.own_views()
        owner = next((n for n, v in views.items() if slot in v.slots), None)
        for name, v in sorted(views.items()):
            if name == target and name != owner:
                continue  # (the move about to be made sets it importing again)
            if slot in v.importing or (slot in v.migrating and target is None):
                log.warning("slot %d: %s was left %s without keys elsewhere; made stable",
                            slot, name, "importing" if slot in v.importing else "migrating")
                self._cmd(name, "CLUSTER SETSLOT", slot, "STABLE")
        return done

    def _tell_owner(self, name: str, slot: int, owner: NodeInfo) -> None:
        """``CLUSTER SETSLOT slot NODE <owner>`` on the importer ``name``. Right after a
        failover the importer may not have heard yet that the promoted replica is a
        master (gossip): it answers "not a master". Then wait for it to hear (at most
        PROMOTION_WAIT_S, its view polled) and tell it again, rather than leave the
        slot's keys out of sight until the balancer's next cycle. Raises Unavailable."""
        deadline = self.clock() + PROMOTION_WAIT_S
        for attempt in itertools.count():
            try:
                self._cmd(name, "CLUSTER SETSLOT", slot, "NODE", owner.id)
                return
            except Unavailable as exc:
                if "not a master" not in str(exc) or self.clock() >= deadline:
                    raise
                if not attempt:  # (once: it is told again every 0.1 s)
                    log.info("slot %d: %s does not know %s for a master yet (a failover's "
                             "gossip); told again for up to %gs", slot, name, owner.name,
                             PROMOTION_WAIT_S)
                self.sleep(0.1)

    def recover(self) -> list[MoveResult]:
        """Settle every move left open (see the module's doc): no slot is left importing
        or migrating, and no key out of sight. Returns the moves it finished. Raises
        Unavailable (what was settled stays settled; call it again)."""
        done: list[MoveResult] = []
        for slot in sorted(self.open_slots()):
            done.extend(self._settle(slot, None))
        return done

    # ------------------------------------------------------------------ the move

    def move(self, slot: int, target: str) -> MoveResult:
        """Move ``slot`` to the master named ``target`` ("host:port"), first settling a
        move of it left open (see the module's doc). Returns what was moved (the last
        move). Raises InvalidArgument (no such master, or it already serves the slot),
        Unavailable (a node cannot be reached, or too many batches failed: the slot is
        left importing/migrating — the next move or :meth:`recover` settles it). Keys
        are never lost: see the module's doc.
        """
        if not 0 <= slot < 16384:
            raise InvalidArgument(f"slot {slot} is not in 0..16383")
        settled = self._settle(slot, target)
        if settled and settled[-1].target == target:
            return settled[-1]
        return self._move(slot, target)

    def _move(self, slot: int, target: str) -> MoveResult:
        t0 = self.clock()
        masters = {n.name: n for n in self.masters()}
        if target not in masters:
            raise InvalidArgument(f"{target} is not a master of the cluster "
                                  f"({', '.join(sorted(masters))})")
        src = next((n for n in masters.values() if slot in n.slots), None)
        if src is None:
            raise Unavailable(f"no master serves slot {slot}")
        dst = masters[target]
        if src.name == dst.name:
            raise InvalidArgument(f"slot {slot} is already served by {target}")
        source, dest = self._conn(src.name), self._conn(dst.name)
        self._cmd(dst.name, "CLUSTER SETSLOT", slot, "IMPORTING", src.id)
        self._cmd(src.name, "CLUSTER SETSLOT", slot, "MIGRATING", dst.id)
        keys = size = batches = retries = reconciled = 0
        host, _, port = dst.name.rpartition(":")
        while True:
            listed = self.store._call(lambda: self._keys(source, slot))
            # the group's feed and counter last, together (see the module's doc)
            last = [k for k in listed if k.startswith((b"kvf:{", b"kvs:{"))]
            batch = [k for k in listed if not k.startswith((b"kvf:{", b"kvs:{"))][:self.batch]
            if not batch:
                batch = last
            if not batch:
                break
            if self.before_batch is not None:
                self.before_batch(slot, batch)
            nbytes = self.store._call(lambda batch=batch: self._sizes(source, batch))
            try:
                reply = source.execute_command(
                    "MIGRATE", host, int(port), "", 0, self.timeout_ms, "REPLACE",
                    *self._auth(), "KEYS", *batch)
            except Exception as exc:  # IOERR, a timeout, a dropped connection
                retries += 1
                if retries > self.retries:
                    raise Unavailable(f"moving slot {slot} to {target}: {retries} batches "
                                      f"failed (last: {exc}); it stays migrating: the next "
                                      "move of it, or the balancer's next cycle, settles "
                                      "it") from None
                both = self._on_both_sides(dest, batch, source)
                reconciled += both
                log.warning("slot %d: MIGRATE of %d keys failed (%s); %d on both sides, "
                            "sent again from the source", slot, len(batch), exc, both)
                self.sleep(min(1.0, 0.05 * retries))
                continue
            if reply not in (b"NOKEY", "NOKEY"):
                keys += len(batch)
                size += nbytes
                batches += 1
        self._hand_over(slot, src, dst, masters.values())
        self.store._refresh_topology(force=True)
        result = MoveResult(slot, src.name, dst.name, keys, size, batches, retries, reconciled,
                            self.clock() - t0)
        log.info("moved slot %d from %s to %s: %d keys, %d bytes, %d batches, %d retried, "
                 "%d reconciled, %.3fs", slot, src.name, dst.name, keys, size, batches,
                 retries, reconciled, result.seconds)
        return result

    def _keys(self, source: Any, slot: int) -> list[bytes]:
        source.set_response_callback("CLUSTER GETKEYSINSLOT", _raw)  # names as bytes
        return list(source.execute_command("CLUSTER GETKEYSINSLOT", slot, self.batch + 2))

    def _sizes(self, source: Any, batch: list[bytes]) -> int:
        pipe = source.pipeline(transaction=False)
        for k in batch:
            pipe.execute_command("MEMORY USAGE", k, "SAMPLES", "0")
        return sum(int(n) for n in pipe.execute(raise_on_error=False) if isinstance(n, int))

    def _auth(self) -> list[str]:
        user, password = self.store.auth
        if password is None:
            return []
        return ["AUTH2", user, password] if user else ["AUTH", password]

    def _on_both_sides(self, dest: Any, batch: list[bytes], source: Any) -> int:
        """How many keys of ``batch`` are on the target and still on the source (a
        MIGRATE that failed after the target stored them); 0 if it cannot tell."""
        try:
            pipe = dest.pipeline(transaction=False)
            for k in batch:
                pipe.execute_command("ASKING")
                pipe.exists(k)
            there = pipe.execute(raise_on_error=False)[1::2]
            pipe = source.pipeline(transaction=False)
            for k in batch:
                pipe.exists(k)
            here = pipe.execute(raise_on_error=False)
        except Exception:  # the target is still unreachable: the retry will tell
            return 0
        return sum(1 for a, b in zip(there, here, strict=True) if a == 1 and b == 1)

    def _hand_over(self, slot: int, src: NodeInfo, dst: NodeInfo,
                   masters: Any) -> None:
        """SETSLOT NODE on the target, then the source, then every other master."""
        self._cmd(dst.name, "CLUSTER SETSLOT", slot, "NODE", dst.id)
        self._cmd(src.name, "CLUSTER SETSLOT", slot, "NODE", dst.id)
        for n in masters:
            if n.name not in (src.name, dst.name):
                try:
                    self._cmd(n.name, "CLUSTER SETSLOT", slot, "NODE", dst.id)
                except Exception as exc:  # gossip tells it anyway (the target's epoch won)
                    log.warning("slot %d: %s did not take SETSLOT NODE (%s); gossip will "
                                "tell it", slot, n.name, exc)


def _raw(r: Any, **kwargs: Any) -> Any:
    return r
