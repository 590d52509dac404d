"""What one L3 client sends to and receives from Redis: commands and bytes, counted exactly.

:func:`counting_cluster` is redis-py's ``RedisCluster`` with one change: every
connection it opens (the cluster client's own and every node's, pipelines included)
counts into the client's :class:`WireCounts` — the bytes its socket sends and receives,
and the replies it reads (one per command). The counts are plain integers of this
process; the metrics flusher adds them to the host's L2 (``kvcomm_l3_commands_total``,
``kvcomm_l3_bytes_total``).

It also keeps redis-py's command table (the reply to ``COMMAND``, which ``RedisCluster``
reads at every client's start to find a command's keys) small and once per process and
cluster. From Redis 7 the whole table is ~90 kB, nearly all of a client's start-up (an
agent's first L2 miss opens its L3 client; an agent that a launcher moves to another host
is a new process and opens another). redis-py needs an entry only for the commands it
routes by their keys, and reads the whole table again when it meets a command it has no
entry for; so a client starts with ``COMMAND INFO`` of :data:`KEYED_COMMANDS` (the ones
KVCOMM sends that way, ~6 kB), and the first unknown command (a tool's, a user's) reads
the whole table, once, for every later client of the process too (before redis-py looks
up the command: it would go on with a two-word name unsplit; from redis-py's default
node, or another master when that one does not answer; one read at a time, the
threads waiting take it). ``command()`` called after the start answers the whole
table, as redis-py's does. The table depends
only on the servers' version. Bounded: :data:`COMMAND_TABLES` clusters, the oldest
forgotten first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from redis.cluster import RedisCluster


class WireCounts:
    """Commands answered and bytes sent / received by one L3 client (cumulative)."""

    __slots__ = ("commands", "sent", "received")

    def __init__(self) -> None:
        self.commands = 0
        self.sent = 0
        self.received = 0


class _CountingSocket:
    """A socket that counts the bytes through it; everything else is the socket's own."""

    __slots__ = ("_sock", "_wire")

    def __init__(self, sock: Any, wire: WireCounts) -> None:
        self._sock, self._wire = sock, wire

    def sendall(self, data: Any, *args: Any) -> None:
        self._sock.sendall(data, *args)
        self._wire.sent += len(data)

    def send(self, data: Any, *args: Any) -> int:
        n: int = self._sock.send(data, *args)
        self._wire.sent += n
        return n

    def recv(self, *args: Any) -> bytes:
        data: bytes = self._sock.recv(*args)
        self._wire.received += len(data)
        return data

    def recv_into(self, *args: Any) -> int:
        n: int = self._sock.recv_into(*args)
        self._wire.received += n
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


_CLASSES: dict[type, type] = {}
_COUNTING: set[type] = set()


def _counting(cls: type) -> type:
    """``cls`` (a redis-py Connection class) whose read_response counts one command."""
    sub = _CLASSES.get(cls)
    if sub is None:
        base: Any = cls

        def read_response(self: Any, *args: Any, **kwargs: Any) -> Any:
            reply = base.read_response(self, *args, **kwargs)
            self.kvcomm_wire.commands += 1
            return reply

        sub = _CLASSES[cls] = type(f"Counting{cls.__name__}", (cls,),
                                   {"read_response": read_response})
        _COUNTING.add(sub)
    return sub


_CLUSTER: Any = None
COMMAND_TABLES = 8  # clusters whose command table a process keeps
# The commands KVCOMM sends through the cluster client's routing by key (EVAL and EVALSHA
# excepted: redis-py reads their keys itself; everything else goes to a named node): the
# entries a client starts with. Containers (XINFO) bring their subcommands' entries.
KEYED_COMMANDS = ("get", "set", "del", "exists", "mget", "getrange", "hgetall", "lrange",
                  "zrangebylex", "xrange", "xinfo")
# cluster (its seeds' names) → (its command table, whether it is the whole table)
_TABLES: OrderedDict[frozenset[str], tuple[dict[str, Any], bool]] = OrderedDict()
_TABLES_LOCK = threading.Lock()
# one read of a cluster's table at a time (a client's threads meeting a command the part
# lacks together would each read the ~90 kB): striped by cluster, so a bounded set
_READING = tuple(threading.RLock() for _ in range(16))


def _command_table(nodes: frozenset[str], read: Any, whole: bool = True) -> dict[str, Any]:
    """A copy of the command table of the cluster of ``nodes`` (its seeds' names): the one
    kept, or else ``read()``'s, kept from then on; ``whole``: ``read`` reads the whole
    table, and one that was not whole is not enough. One read of a cluster's table at a
    time: the callers waiting take what it kept. A copy: redis-py's parser renames
    entries of the dict it is given (never the entries themselves)."""
    with _TABLES_LOCK:
        kept = _TABLES.get(nodes)
        if kept is not None:
            _TABLES.move_to_end(nodes)
    if kept is not None and (kept[1] or not whole):
        return dict(kept[0])
    with _READING[hash(nodes) % len(_READING)]:
        with _TABLES_LOCK:
            kept = _TABLES.get(nodes)
        if kept is not None and (kept[1] or not whole):  # (read meanwhile)
            return dict(kept[0])
        table = read()
        if not isinstance(table, dict) or not nodes:
            return table  # type: ignore[no-any-return]
        with _TABLES_LOCK:
            kept = _TABLES.get(nodes)
            if kept is None or whole or not kept[1]:
                # (a part never replaces the whole, kept by a read nested in this one)
                _TABLES[nodes] = (table, whole)
            _TABLES.move_to_end(nodes)
            while len(_TABLES) > COMMAND_TABLES:
                _TABLES.popitem(last=False)
    return dict(table)


class _Reader:
    """What redis-py's command parser reads its table from: ``command()``, and (redis-py
    8.2 on) the encoder of the node it asked, ``get_encoder()``."""

    __slots__ = ("command", "get_encoder")

    def __init__(self, command: Any, get_encoder: Any) -> None:
        self.command = command
        self.get_encoder = get_encoder


def counting_cluster() -> type[RedisCluster]:
    """The ``RedisCluster`` subclass whose connections count into ``self.wire``. Imports
    redis-py (the caller has checked that kvcomm[cluster] is installed)."""
    global _CLUSTER
    if _CLUSTER is None:
        from redis.cluster import RedisCluster
        from redis.exceptions import ConnectionError as Unanswered
        from redis.exceptions import RedisError
        from redis.exceptions import TimeoutError as TimedOut

        class CountingRedisCluster(RedisCluster):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                self.wire = WireCounts()
                # the cluster, for its command table: the seeds it was given (the nodes it
                # then found vary with replicas joining and failovers)
                self.kvcomm_seeds = frozenset(
                    f"{getattr(n, 'host', '')}:{getattr(n, 'port', '')}"
                    for n in kwargs.get("startup_nodes") or ())
                self.kvcomm_starting = True  # (command(): the part table, for the parser)
                super().__init__(*args, **kwargs)
                self.kvcomm_starting = False
                self.commands_parser.initialize = self._kvcomm_reinitialize  # type: ignore[method-assign]
                self.commands_parser.get_keys = self._kvcomm_get_keys  # type: ignore[method-assign]

            def on_connect(self, connection: Any) -> None:
                # before the handshake: the reply parser takes the socket in on_connect
                # (a connection that reconnects comes here again with a new socket)
                if not isinstance(connection._sock, _CountingSocket):
                    connection._sock = _CountingSocket(connection._sock, self.wire)
                connection.kvcomm_wire = self.wire
                if type(connection) not in _COUNTING:
                    connection.__class__ = _counting(type(connection))
                super().on_connect(connection)  # type: ignore[no-untyped-call]

            def command(self, **kwargs: Any) -> Any:
                # the table redis-py reads at start: KEYED_COMMANDS' entries, or the whole
                # table when the process has it (see the module's docstring); called
                # after the start (redis-py's public COMMAND, "all Redis commands"): the
                # whole table
                if kwargs:
                    return super().command(**kwargs)
                if getattr(self, "kvcomm_starting", False):
                    return _command_table(self.kvcomm_seeds, self._kvcomm_keyed, whole=False)
                return _command_table(self.kvcomm_seeds, super().command)

            def _kvcomm_reinitialize(self, node: Any) -> None:
                # what redis-py does on meeting a command its table has no entry for (it
                # reads COMMAND with ``node``, a node's client): the whole table, kept
                parser = self.commands_parser
                seeds = self.kvcomm_seeds
                type(parser).initialize(parser, _Reader(  # type: ignore[no-untyped-call]
                    lambda: _command_table(seeds, lambda: self._kvcomm_whole(node)),
                    node.get_encoder))

            def _kvcomm_whole(self, node: Any) -> Any:
                # ``node`` (redis-py's default node) first, then the other masters: redis-py
                # asks outside its retries, and a client that started with the whole table
                # would send the command to its key's master, up while the default is down
                try:
                    return node.command()
                except (Unanswered, TimedOut) as exc:
                    last = exc
                for other in self.get_primaries():  # type: ignore[no-untyped-call]
                    conn = other.redis_connection
                    if conn is None or conn is node:
                        continue
                    try:
                        return conn.command()
                    except (Unanswered, TimedOut) as exc:
                        last = exc
                raise last

            def _kvcomm_get_keys(self, node: Any, *args: Any) -> Any:
                # redis-py, meeting a name its table lacks, reads the table again but goes
                # on with a two-word name (MEMORY USAGE, OBJECT ENCODING) unsplit: it finds
                # no key and raises "No way to dispatch". The whole table before it looks
                parser = self.commands_parser
                if len(args) >= 2 and isinstance(args[0], str):
                    name = args[0].lower()
                    words = name.split()
                    if name not in parser.commands and words and words[0] not in parser.commands:
                        parser.initialize(node)  # type: ignore[no-untyped-call]
                return type(parser).get_keys(parser, node, *args)  # type: ignore[no-untyped-call]

            def _kvcomm_keyed(self) -> Any:
                try:
                    # (parsed as COMMAND's reply: the same entries, for these names only)
                    table = self.execute_command(  # type: ignore[no-untyped-call]
                        "COMMAND", "INFO", *KEYED_COMMANDS)
                except (RedisError, TypeError, IndexError):
                    table = None  # (no COMMAND INFO, or a name unknown there: a nil entry)
                if not isinstance(table, dict) or len(table) != len(KEYED_COMMANDS):
                    return super().command()
                return table

        _CLUSTER = CountingRedisCluster
    return _CLUSTER  # type: ignore[no-any-return]
