"""Pushes: records into L3 by the push script (PUSH_LUA), one call per group and up to
PUSH_BATCH records (PUSH_BATCH_BYTES of them), one pipeline per master, then ROLE and WAIT
on the same connection; and the conditional write (CAS_LUA, :meth:`L3Pushes.push_if`).

A push is idempotent (a repeated record is ``equal``), so a redirected or retried push
never stores anything twice. The theory (the L3 rule, feed entries, hints, the key index
and expiry the script keeps) is in :mod:`kvcomm.tiers.l3`'s docstring; the script's
arguments and replies are written above it in :mod:`kvcomm.tiers.l3.scripts`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence, Set
from typing import Any, NamedTuple

from ...core.resolve import CONFLICT, EQUAL, MERGED, NEW, NEWER, OLDER
from ...core.versions import Vector
from ...errors import CorruptRecord, Unavailable
from .connection import _TRANSIENT, Connection, Unreached, _key_error, _noscript
from .feed import FEED_INLINE, FEED_MAXLEN, FEED_MIN, FEED_TOTAL, _as_id, _as_seq, _valid_id
from .records import L3Record, _packed_vector, _wire_key, approx_size
from .replication import Replication
from .scripts import CAS_LUA, PUSH_LUA

HINT_EACH = 4  # a group's pushes in one pipeline up to which each hints its own entry
PUSH_BATCH = 256  # records of one group one push script call takes at most (~5 ms of Redis)
# record bytes one push script call takes at most (a record larger goes alone): Redis holds
# a call's arguments, and the script copies them into Lua, all at once; PUSH_BATCH records
# near cache.max_value_size would be gigabytes
PUSH_BATCH_BYTES = 1 << 20
# Redis commands one push costs (as INFO counts them, a script's own calls included):
PUSH_STORED = 6  # GET, ZADD, INCR, XADD, SET, SPUBLISH (a delete: ZREM and ZADD: 7)
PUSH_KEPT = 1  # GET (equal, older, conflict: nothing stored)
PUSH_CALL = 1  # EVALSHA: once per call, for up to PUSH_BATCH records of one group
OUTCOMES = (NEW, NEWER, OLDER, EQUAL, MERGED, CONFLICT)


class PushResult(NamedTuple):
    """L3's answer to one pushed record."""

    key: str
    outcome: str  # one of OUTCOMES
    record: L3Record  # what L3 holds afterwards (for "conflict": what it holds now)
    durable: bool = True  # a replica acknowledged it (WAIT), so a failover keeps it
    # new, newer (and equal, when L3 held these very bytes): the record's bytes as pushed,
    # which L3 holds (a new or newer one's feed entry carries them, when inline): the
    # pusher can tell its own echo without decoding it
    sent: bytes = b""
    # a change stored (new, newer, merged): its feed entry's sequence number and stream id
    seq: int | None = None
    entry: bytes = b""
    # acknowledged (durable) by fewer replicas than cluster.wait_replicas asked: the master
    # had fewer connected, and the wait was lowered to those (Replication.replicas_to_wait); a
    # failover may still lose it. ``node`` and ``call`` name the master and the pipeline
    # that wrote it, ``history`` the replication history that master ran when last seen
    # before the pipeline (L3Store.histories): a later probe there that reaches the
    # target in that same history (``L3Store.confirmed``) covers it, since WAIT counts
    # replicas up to the connection's last write
    short: bool = False
    node: str = ""
    call: int = 0
    history: str = ""


class CasResult(NamedTuple):
    """L3's answer to a conditional write (:meth:`L3Store.push_if`)."""

    outcome: str  # "won" (stored), "conflict" (refused), "stale" (push again: see CAS_LUA)
    record: L3Record | None  # won: the record pushed; else what L3 holds (None: nothing)
    durable: bool = True  # won: cluster.wait_replicas replicas (those connected) took it


class L3Pushes:
    """Pushes records into L3 (the push script) and makes conditional writes. ``feed_maxlen``
    is each group's stream bound (``feed_total / groups``, within FEED_MIN..``feed_maxlen``);
    a push's feed entry carries its record when that is at most ``feed_inline`` bytes,
    else only the key and the record's dot (value-less; None: every entry inline).
    ``repl`` waits for the replicas and notes what they took."""

    def __init__(self, conn: Connection, repl: Replication, *, feed_maxlen: int = FEED_MAXLEN,
                 feed_total: int = FEED_TOTAL, feed_inline: int | None = FEED_INLINE,
                 tombstone_grace: float = 86400.0) -> None:
        self.conn, self.repl = conn, repl
        self.feed_maxlen = min(feed_maxlen, max(FEED_MIN, feed_total // len(conn.groups)))
        # a push's feed entry carries the record up to this size (None: always)
        self.feed_inline = feed_inline
        self.tombstone_grace_ms = int(tombstone_grace * 1000)  # (cluster.tombstone_grace)
        self.redirects: dict[str, int] = {"moved": 0, "ask": 0, "tryagain": 0}  # pushes retried
        self._script = conn.rc.register_script(PUSH_LUA)
        self._cas = conn.rc.register_script(CAS_LUA)  # (push_if)

    def push_many(self, items: Sequence[tuple[str, L3Record]],
                  keep_siblings: Set[str] = frozenset(),
                  ) -> list[PushResult | CorruptRecord | Unreached]:
        """Push many records: one pipeline of script calls per master node (a call per
        group and PUSH_BATCH records of it), then (with ``wait_replicas``) a WAIT on the
        same connection. The keys in ``keep_siblings``
        get ``conflict`` for a concurrent record (as :meth:`L3Store.push`).

        Returns one answer per item, in order. A key whose stored value is foreign, or
        that cannot be sent (not strict UTF-8), yields a CorruptRecord in its place; the
        others are pushed. A push redirected (its slot moved: MOVED; or is moving: ASK,
        TRYAGAIN) is sent again where Redis says, with its own WAIT — a retried push is
        durable only when a replica acknowledged it there — until ``timeout`` seconds
        have passed; pushes are idempotent (a repeated record is ``equal``), so a retry
        never stores anything twice. Raises Unavailable when the cluster cannot be
        reached, or a slot stayed on the move past the timeout; what was pushed before
        stays pushed, and pushing it again is harmless.

        A master taken for down (:attr:`Connection.down`: it timed out or refused the connection,
        now or before, and has not answered a PING since) is not waited for: its items
        get an Unreached in their place, the others are pushed. Raises Unreached when no
        item reached a master.
        """
        from redis.exceptions import AskError, MovedError, TryAgainError

        out: list[PushResult | CorruptRecord | Unreached | None] = [None] * len(items)
        route: dict[int, tuple[Any, bool]] = {}  # item → (node, send ASKING first)
        at: dict[int, Any] = {}  # group → its master (every key of a group shares a slot)
        for i, (key, _) in enumerate(items):
            try:
                _wire_key(key)
            except CorruptRecord as exc:
                out[i] = exc
                continue
            g = self.conn.groups.of(key)
            node = at.get(g)
            if node is None:
                node = at[g] = self.conn.call(lambda key=key: self.conn.rc.get_node_from_key(  # type: ignore[no-untyped-call]
                    self.conn.groups.record_key(key)))
            route[i] = (node, False)
        deadline = time.monotonic() + self.conn.timeout
        waits = 0
        sent: dict[int, tuple[bytes, L3Record]] = {}  # item → (its encoding, its record)
        alone: set[int] = set()  # items sent in calls of their own (after a TRYAGAIN)
        while route:
            batches: dict[tuple[str, bool], tuple[Any, list[int]]] = {}
            for i, (node, asking) in route.items():
                if node.name in self.conn.down:  # (not waited for: see down)
                    out[i] = Unreached(f"Redis master {node.name} is down; sent again later")
                    continue
                batches.setdefault((node.name, asking), (node, []))[1].append(i)
            route = {}
            busy = ""
            later: set[int] = set()  # items a call's spent reply budget left (KVCOMMLATER)
            replies = self._pipelines(
                [(node, idxs, asking) for (_, asking), (node, idxs) in batches.items()],
                items, keep_siblings, sent, alone)
            for (_, asking), (node, idxs) in batches.items():
                reply = replies[node.name, asking]
                if isinstance(reply, Unreached):  # (that master timed out: now down)
                    for i in idxs:
                        out[i] = reply
                    continue
                raws, durable, short, call, history = reply
                for i, raw in zip(idxs, raws, strict=True):
                    key = items[i][0]
                    if not isinstance(raw, Exception):
                        try:
                            out[i] = self._result(key, raw, items[i][1], sent.get(i)
                                                  )._replace(durable=durable, short=short,
                                                             node=node.name, call=call,
                                                             history=history)
                        except CorruptRecord as exc:
                            out[i] = exc
                    elif _key_error(str(raw)):
                        out[i] = CorruptRecord(f"L3 value of {key!r}: {str(raw).split(' ', 1)[-1]}")
                    elif isinstance(raw, MovedError):  # (a MovedError is an AskError: first)
                        self.redirects["moved"] += 1
                        self.conn.rc.nodes_manager.move_slot(raw)
                        route[i] = (self.conn.node(raw.host, raw.port), False)
                    elif isinstance(raw, AskError):
                        self.redirects["ask"] += 1
                        route[i] = (self.conn.node(raw.host, raw.port), True)
                    elif "KVCOMMLATER" in str(raw):  # (the call's reply budget was spent)
                        route[i] = (node, asking)
                        later.add(i)
                    elif isinstance(raw, TryAgainError) or _noscript(raw):
                        # a multi-key call in a slot half migrated, or a node that lost
                        # the script (loaded again by _pipeline): again, by the slot map
                        # (after a TRYAGAIN one record a call, as before calls took many:
                        # the call of a whole group would wait for all its keys to move)
                        self.redirects["tryagain"] += not _noscript(raw)
                        if not _noscript(raw):
                            alone.add(i)
                        busy = busy or str(raw)
                        route[i] = (self.conn.call(lambda key=key: self.conn.rc.get_node_from_key(  # type: ignore[no-untyped-call]
                            self.conn.groups.record_key(key))), False)
                    else:
                        raise Unavailable(f"Redis Cluster refused a push: {raw}")
            if route:
                # (only redirects count against the deadline: each call answers one record
                # at least, so the rounds of a spent reply budget end by themselves)
                if time.monotonic() > deadline and route.keys() - later:
                    raise Unavailable(f"{len(route)} push(es) still redirected after "
                                      f"{self.conn.timeout:g}s ({busy or 'MOVED/ASK'}): a slot "
                                      "is on the move; retried later")
                if busy:  # TRYAGAIN: the migration of a batch of keys is under way
                    waits += 1
                    time.sleep(min(0.1, 0.002 * 2 ** min(waits, 6)))
        if out and all(isinstance(o, Unreached) for o in out):
            raise out[0]  # type: ignore[misc]
        return out  # type: ignore[return-value]

    def _pipelines(self, jobs: list[tuple[Any, list[int], bool]],
                   items: Sequence[tuple[str, L3Record]], keep_siblings: Set[str],
                   sent: dict[int, tuple[bytes, L3Record]], alone: Set[int] = frozenset(),
                   ) -> dict[tuple[str, bool], tuple[list[Any], bool, bool, int, str] | Unreached]:
        """:meth:`_pipeline` for each (node, item indexes, asking) of ``jobs``, the
        nodes' pipelines in flight together (threads: each master runs its scripts while
        the others do, instead of one master after another). Returns the replies by
        (node name, asking); an Unreached for a master that timed out or refused the
        connection (now :attr:`Connection.down`). Raises what another pipeline raised (Unavailable,
        CorruptRecord), once every pipeline has returned: what was pushed stays pushed."""
        replies = self.conn.on_masters([
            (node, functools.partial(self._pipeline, node, items, idxs, keep_siblings,
                                     asking, sent, alone))
            for node, idxs, asking in jobs])
        return {(node.name, asking): reply if reply is not None else Unreached(
                    f"Redis master {node.name} did not answer; sent again later")
                for (node, _, asking), reply in zip(jobs, replies, strict=True)}

    def _pipeline(self, node: Any, items: Sequence[tuple[str, L3Record]], idxs: list[int],
                  keep_siblings: Set[str], asking: bool = False,
                  sent: dict[int, tuple[bytes, L3Record]] | None = None,
                  alone: Set[int] = frozenset(),
                  ) -> tuple[list[Any], bool, bool, int, str]:
        """The push script for ``items[idxs]`` on ``node``: one call per group and
        PUSH_BATCH records of it, in the items' order (each call after ASKING if
        ``asking``; the items of ``alone`` in calls of their own), then ROLE and WAIT on
        the same connection. A group with at most HINT_EACH records here hints each change;
        one with more is hinted once, by its last call. With ``wait_replicas``, a node
        not seen as a master before (:attr:`Replication.histories`) is seen first, in the same
        pipeline (INFO: once per node and history, not per push). Returns (one reply or
        exception per item of ``idxs``, in order: a call refused as a whole, MOVED say,
        gives each of its items that exception; whether a replica acknowledged them;
        whether fewer than ``wait_replicas`` did (:attr:`PushResult.short`); this
        pipeline's number; the history ``node`` ran when last seen before these writes:
        a probe that sees it still (:meth:`Replication.confirm_replicated`) covers them);
        ``sent`` gets each item's encoding."""
        call = next(self.repl.calls)
        conn = self.conn.rc.get_redis_connection(node)
        self.conn.load(node, conn, self._script)
        pipe = conn.pipeline(transaction=False)
        # (a node seen as a master keeps its history until a probe sees another: a write
        # made in a history it left since is then sent again, never confirmed)
        see = (bool(self.repl.wait_replicas) and not self.repl.histories.get(node.name)
               and self.repl.unseen.get(node.name, 0.0) <= time.monotonic())
        if see:
            pipe.execute_command("INFO", "server")  # type: ignore[no-untyped-call]
            pipe.execute_command("INFO", "replication")  # type: ignore[no-untyped-call]
        by_group: dict[int, list[int]] = {}
        for i in idxs:
            by_group.setdefault(self.conn.groups.of(items[i][0]), []).append(i)
        calls: list[list[int]] = []
        for g, members in by_group.items():
            each = len(members) <= HINT_EACH
            batches: list[list[int]] = [[]]
            size = 0  # (record bytes in the last batch)
            for i in members:  # (in order: a key pushed twice is pushed in that order)
                n = approx_size(items[i][1])  # (near enough: not encoded twice)
                if (i in alone or len(batches[-1]) >= PUSH_BATCH
                        or (batches[-1] and size + n > PUSH_BATCH_BYTES)):
                    batches.append([])
                    size = 0
                batches[-1].append(i)
                size += n
                if i in alone:
                    batches.append([])
                    size = 0
            batches = [b for b in batches if b]
            for b, batch in enumerate(batches):
                keys, args = self._batch_args(
                    g, [(items[i][0], items[i][1], items[i][0] in keep_siblings) for i in batch],
                    # (a backlog: the group's last call hints for all of them)
                    hint=each or b == len(batches) - 1, each=each)
                if sent is not None:
                    for n, i in enumerate(batch):
                        sent[i] = (args[7 + n], items[i][1])
                if asking:  # (it holds for the next command only)
                    pipe.execute_command("ASKING")  # type: ignore[no-untyped-call]
                pipe.evalsha(self._script.sha, len(keys), *keys, *args)
                calls.append(batch)
        if self.repl.wait_replicas:
            # wait only for the replicas the master had last time (none: no wait at all)
            want = min(self.repl.wait_replicas, self.repl.connected.get(node.name, self.repl.wait_replicas))
            pipe.execute_command("ROLE")  # type: ignore[no-untyped-call]
            pipe.execute_command("WAIT", want, self.repl.wait_ms)  # type: ignore[no-untyped-call]
        raws: list[Any] = pipe.execute(raise_on_error=False)
        if see:
            self.repl.see(node.name, raws.pop(0), raws.pop(0))
        history = self.repl.histories.get(node.name, "")
        if any(_noscript(r) for r in raws):
            self.conn.loaded.discard((node.name, self._script.sha))  # a restarted node
        durable, short = True, False
        if self.repl.wait_replicas:
            acked, role = raws.pop(), raws.pop()
            durable = isinstance(acked, int) and acked >= self.repl.replicas_to_wait(node, role)
            short = not isinstance(acked, int) or acked < self.repl.wait_replicas
        got: dict[int, Any] = {}
        for batch, raw in zip(calls, raws[1::2] if asking else raws, strict=True):
            if isinstance(raw, Exception):  # the call as a whole: each of its records
                got.update((i, raw) for i in batch)
            elif not isinstance(raw, list) or len(raw) != len(batch):
                raise Unavailable(f"Redis Cluster answered a push of {len(batch)} record(s) "
                                  f"with {raw!r:.200}")
            else:
                got.update(zip(batch, raw, strict=True))
        return [got[i] for i in idxs], durable, short, call, history

    def push_if(self, key: str, record: L3Record, absent: bool, check: Vector,
                basis: Vector, wait_replicas: int = 0, wait_ms: int = 100) -> CasResult:
        """Push ``record`` if L3's record of ``key`` meets the expectation, in one atomic
        call on the key's master (CAS_LUA): ``absent`` (no record, a tombstone, past its
        deadline; or, with ``check``, a vector at most ``check``) or a record whose vector
        is at most ``check`` (not itself when dead); ``record``'s vector is ``basis``
        plus a new dot. With ``wait_replicas``, WAIT on the same connection for that many
        replicas (those the master has connected, if fewer: :meth:`Replication.replicas_to_wait`),
        up to ``wait_ms``; ``durable`` says whether they took it. A redirect (MOVED, ASK)
        is followed within ``timeout``. Raises Unavailable (nothing decided, or not known
        to be: a timeout may leave the write stored), Unreached (the master is
        :attr:`Connection.down`: nothing sent), CorruptRecord (the key cannot be sent, or L3's record
        has a newer format)."""
        from redis.exceptions import AskError, MovedError

        keys, args = self.args(key, record, False)
        args += ["a" if absent else "v", _packed_vector(check), _packed_vector(basis)]
        node = self.conn.master_up(keys[-1], f"{key!r}")
        asking = False
        deadline = time.monotonic() + self.conn.timeout
        while True:
            def run(node: Any = node, asking: bool = asking) -> list[Any]:
                conn = self.conn.rc.get_redis_connection(node)
                self.conn.load(node, conn, self._cas)
                pipe = conn.pipeline(transaction=False)
                if asking:
                    pipe.execute_command("ASKING")  # type: ignore[no-untyped-call]
                pipe.evalsha(self._cas.sha, len(keys), *keys, *args)
                if wait_replicas:
                    pipe.execute_command("ROLE")  # type: ignore[no-untyped-call]
                    pipe.execute_command("WAIT", wait_replicas, wait_ms)  # type: ignore[no-untyped-call]
                return pipe.execute(raise_on_error=False)

            raws = self.conn.call(run, key, node=node)
            reply = raws[1 if asking else 0]
            if isinstance(reply, MovedError):  # (a MovedError is an AskError: first)
                self.redirects["moved"] += 1
                self.conn.rc.nodes_manager.move_slot(reply)
                node, asking = self.conn.node(reply.host, reply.port), False
            elif isinstance(reply, AskError):
                self.redirects["ask"] += 1
                node, asking = self.conn.node(reply.host, reply.port), True
            elif _noscript(reply):
                self.conn.loaded.discard((node.name, self._cas.sha))
            elif isinstance(reply, Exception) or not isinstance(reply, list) or len(reply) != 1:
                return self._cas_refused(key, reply)
            else:
                break
            if time.monotonic() > deadline:
                raise Unavailable(f"a conditional write of {key!r} was still redirected after "
                                  f"{self.conn.timeout:g}s: a slot is on the move; retry")
        one = reply[0]
        if isinstance(one, Exception):
            return self._cas_refused(key, one)
        try:
            outcome, data = one[0].decode(), one[1]
        except Exception:
            raise CorruptRecord(f"unexpected conditional write reply {one!r:.200} for "
                                f"{key!r}") from None
        if outcome in ("conflict", "stale"):
            return CasResult(outcome, self.conn.decode(data, key) if data else None)
        if outcome not in (NEW, NEWER):  # (the script's check makes the record newer)
            return CasResult("conflict", self._result(key, one, record).record)
        durable = True
        if wait_replicas:
            role, acked = raws[-2], raws[-1]
            durable = isinstance(acked, int) and acked >= self.repl.replicas_to_wait(node, role)
        return CasResult("won", record, durable)

    def _cas_refused(self, key: str, reply: object) -> CasResult:
        """Raise what an error reply to a conditional write means."""
        msg = str(reply)
        if _key_error(msg) and not msg.startswith(_TRANSIENT):
            raise CorruptRecord(f"L3 value of {key!r}: {msg.split(' ', 1)[-1]}")
        raise Unavailable(f"Redis Cluster refused a conditional write of {key!r}: {msg:.200}")

    def args(self, key: str, record: L3Record, keep_siblings: bool, hint: bool = True,
              speak: bool | None = None) -> tuple[list[bytes | str], list[Any]]:
        """The push script's keys and arguments for one record alone (its reply is a list
        of one reply). ``hint``: a change this push stores is hinted; ``speak`` (default:
        ``hint``): the call hints at its end even if it stores nothing (as the last call of
        a backlog's group does)."""
        speak = hint if speak is None else speak
        return self._batch_args(self.conn.groups.of(key), [(key, record, keep_siblings)],
                                hint=hint or speak, each=not speak)

    def _batch_args(self, group: int, records: Sequence[tuple[str, L3Record, bool]],
                    hint: bool = True, each: bool = True,
                    ) -> tuple[list[bytes | str], list[Any]]:
        """The push script's keys and arguments for ``records`` (key, record, keep
        siblings), every key of ``group``, in order (see PUSH_LUA). ``hint``: the call
        hints its changes on the group's channel (``each``: each change its own entry;
        else once, at the end of the call, even if it stores nothing). Raises
        CorruptRecord when a key cannot be sent."""
        g = self.conn.groups
        return ([g.feed_key(group), g.seq_key(group), g.index_key(group),
                 *(_wire_key(g.record_key(k)) for k, _, _ in records)],
                ["".join("s" if s else "l" for _, _, s in records), self.feed_maxlen,
                 g.hint_channel(group) if hint else "", "e" if each else "l",
                 # ("": every entry inline, as a daemon before value-less ones)
                 "" if self.feed_inline is None else self.feed_inline,
                 self.tombstone_grace_ms, g.expiry_key(group),
                 *(r.encode() for _, r, _ in records), PUSH_BATCH_BYTES])

    def _result(self, key: str, raw: Any, pushed: L3Record,
                sent: tuple[bytes, L3Record] | None = None,
                ) -> PushResult:
        """One push's reply. ``pushed``: the record pushed (a new or newer reply does not
        send it back: L3 holds it); ``sent``: the record pushed and its encoding; a reply that
        holds those very bytes (a push stored as sent, or found equal) is that record,
        not decoded again (a backlog of thousands is answered mostly so)."""
        try:
            outcome = raw[0].decode()
            data = raw[1]
        except Exception:
            raise CorruptRecord(f"unexpected push reply {raw!r:.200} for {key!r}") from None
        if outcome not in OUTCOMES:
            raise CorruptRecord(f"unexpected push outcome {outcome!r} for {key!r}")
        seq, entry = (_as_seq(raw[2]), _as_id(raw[3])) if len(raw) >= 4 else (None, b"")
        if seq is None or not _valid_id(entry):  # (a script before entries were returned)
            seq, entry = None, b""
        if outcome in (NEW, NEWER, EQUAL) and data == b"":  # L3 holds what was pushed
            return PushResult(key, outcome, pushed, sent=b"" if sent is None else sent[0],
                              seq=seq, entry=entry)
        if sent is not None and data == sent[0]:
            return PushResult(key, outcome, sent[1], seq=seq, entry=entry)
        return PushResult(key, outcome, self.conn.decode(data, key), seq=seq, entry=entry)
