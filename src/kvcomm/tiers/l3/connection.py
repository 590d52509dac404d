"""The connection to the Redis Cluster and its failure detector: every call of the
other parts goes through :meth:`Connection.call`, which translates redis-py's errors
(connection trouble: Unavailable; a foreign value under one key: CorruptRecord) and takes
a master that timed out or refused the connection for down (:attr:`Connection.down`).

A master taken for down is skipped (:class:`Unreached`), so that one hung master does not
hold up the work of the others, until the pinger, a thread of its own, sees it answer a
PING every DOWN_PING_EVERY seconds; while one is down only the pinger re-reads the slot
map (:meth:`Connection.refresh_topology`). Calls that reach several masters run in a pool
of MASTER_THREADS threads, so that the masters that stopped answering cost one timeout
for all of them (:meth:`Connection.on_masters`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..._extras import require_cluster
from ..._threads import start_quiet
from ...errors import ConfigError, CorruptRecord, Unavailable
from ..groups import Groups
from ..groups import groups as _groups
from .records import MAX_VALUE_SIZE, L3Record, read_record

log = logging.getLogger("kvcomm.l3")

DOWN_PING_EVERY = 0.2  # seconds between PINGs of a master taken for down (Connection.down)
# threads that call the masters at the same time (pushes, feed reads, sweeps): one per
# master, so that a call reaching many masters that stopped answering waits one timeout
# for all of them, not one per 8 (threads are started as calls need them, kept while idle)
MASTER_THREADS = 64

# Redis errors that say "not now" (a failover, a slot on the move, a restarted node)
# rather than "not this key": they become Unavailable, and the caller retries.
_TRANSIENT = ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN", "LOADING", "MASTERDOWN", "READONLY",
              "NOSCRIPT", "BUSY", "NOREPLICAS", "OOM", "NOPERM", "NOAUTH")


def _noscript(reply: object) -> bool:
    """True when ``reply`` is Redis's NOSCRIPT error (a node that lost its scripts: a
    restart). redis-py raises it as NoScriptError, whose text lacks the word."""
    return isinstance(reply, Exception) and (type(reply).__name__ == "NoScriptError"
                                             or "NOSCRIPT" in str(reply))


def _key_error(msg: str) -> bool:
    """True when a Redis error concerns the value under one key (a foreign value)."""
    return ("KVCOMMCORRUPT" in msg or "KVCOMMBAD" in msg or "WRONGTYPE" in msg
            or "not an integer" in msg)


class Unreached(Unavailable):
    """Not sent: the master that serves it did not answer lately (a timeout, a refused
    connection) and is skipped until it answers a PING (:attr:`L3Store.down`), so that
    one hung master does not hold up the work of the others. In :meth:`L3Store.push_many`'s
    answers, in the place of a record not pushed (send it again later); raised by a
    call that reached nothing."""



class Connection:
    """The cluster as this process reaches it: redis-py's RedisCluster (MOVED/ASK and
    failover are its own), the group layout, the bound on records read back, the masters
    taken for down and the pinger that lets them go, the threads that call the masters
    together, and the scripts known loaded on each node. Credentials and TLS come from
    the caller's config, never from code. The other parts of a store share one."""

    def __init__(self, seeds: Sequence[tuple[str, int]], *, password: str | None = None,
                 username: str | None = None, tls: bool = False, timeout: float = 2.0,
                 max_value_size: int = MAX_VALUE_SIZE, groups: int,
                 tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None,
                 address_remap: Callable[[tuple[str, int]], tuple[str, int]] | None = None,
                 retries: int | None = None, bounded_refresh: bool = False) -> None:
        require_cluster()  # a ConfigError naming kvcomm[cluster] when redis-py is missing
        from redis.cluster import ClusterNode

        from ...metrics.wire import counting_cluster

        extra: dict[str, Any] = {}
        if address_remap is not None:  # cluster.address_remap: every node through it
            extra["address_remap"] = address_remap
        if retries is not None:
            # redis-py retries a command that timed out up to 10 times, re-reading the slot
            # map from the seeds before each (every seed costs a timeout when the host is
            # cut off): one call could hold its caller for tens of timeouts. The node
            # daemon passes 0: its loop has its own backoff, and must come back quickly
            # to decide partition mode and to notice the heal
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            extra["retry"] = Retry(NoBackoff(), retries)
        try:
            self.groups: Groups = _groups(groups)
        except ValueError as exc:
            raise ConfigError("cluster.groups", str(exc)) from None
        try:
            self.rc = counting_cluster()(
                startup_nodes=[ClusterNode(h, p) for h, p in seeds],  # type: ignore[no-untyped-call]
                decode_responses=False,
                password=password, username=username, ssl=tls, socket_timeout=timeout,
                socket_connect_timeout=timeout, require_full_coverage=True,
                # cluster.redis_ca / redis_cert / redis_key (None: redis-py's defaults)
                ssl_ca_certs=tls_ca, ssl_certfile=tls_cert, ssl_keyfile=tls_key, **extra,
            )
        except Exception as exc:
            raise Unavailable(f"cannot reach Redis Cluster at {list(seeds)}: {exc}") from None
        if address_remap is not None:  # (MOVED and ASK too: tiers/routing.py)
            from ..routing import follow_remap

            follow_remap(self.rc, address_remap)
        if bounded_refresh:
            _bound_refresh(self.rc.nodes_manager, timeout)
        self.wire = self.rc.wire  # type: ignore[attr-defined]  # commands and bytes to and from Redis (kvcomm metrics)
        self.timeout = timeout
        self.auth = (username, password)  # (for MIGRATE's AUTH: kvcomm.balance.migrate)
        self.max_value_size = max_value_size
        self.loaded: set[tuple[str, bytes]] = set()  # (node, script sha) known loaded
        self._refreshed = 0.0
        self._pool: Any = None  # threads that send the masters' pipelines together
        # master (node name) → when it stopped answering: a master whose pipeline timed
        # out or whose connection was refused is skipped by push_many, feed_many and
        # feed_heads (Unreached: the other masters' work goes on, where one hung master
        # would otherwise hold every push and poll a timeout each) until a PING of it,
        # in a thread of its own every DOWN_PING_EVERY seconds, is answered
        self.down: dict[str, float] = {}
        self.ups = 0  # masters let out of down so far (the daemon then sends what it parked)
        self._down_lock = threading.Lock()
        self._pinger: threading.Thread | None = None
        self._closed = False
        self._ping_turn = 0  # (reachable: the masters in turn)
        # seconds between slot-map refreshes after a failed call: each one may try every
        # seed for cluster.timeout; the daemon spaces them out in partition mode
        self.refresh_every = 0.5
        self._on_close: list[Callable[[], None]] = []  # (the parts' own, see close)

    def decode(self, raw: object, key: str = "") -> L3Record:
        """:func:`read_record` under this store's bound; CorruptRecord names ``key``."""
        return read_record(raw, key, self.max_value_size)

    def reachable(self) -> bool:
        """Whether one master of the slot map answers a PING within the timeout (the
        masters in turn). On the node's own connection: no retry, no slot-map refresh,
        so that a host cut off learns it in one timeout, not in one per seed. Never
        raises."""
        try:
            masters = self.rc.get_primaries()  # type: ignore[no-untyped-call]
            node = masters[self._ping_turn % len(masters)]
            self._ping_turn += 1
            return bool(self.rc.get_redis_connection(node).ping())
        except Exception:  # unreachable, refused, no slot map: not reachable now
            return False

    def live_master_answers(self) -> bool:
        """Whether a master not taken for :attr:`down` answers a PING within the timeout:
        the daemon's evidence that Redis answers when its calls of a round all went to
        masters taken for down (skipped). Every such master is asked at the same time, and
        the first answer decides: a host cut off from some masters may not have taken
        them all for down yet (its loop still waits on one of them), and asking only one
        of them — the next in turn — found one that does not answer and put the host in
        partition mode, another master answering. False when every master is down or
        none answers (those that do not are then taken for down). Never raises."""
        try:
            masters = [m for m in self.rc.get_primaries()  # type: ignore[no-untyped-call]
                       if m.name not in self.down]
        except Exception:  # no slot map: not reachable now
            return False

        def ping(node: Any) -> bool:
            try:
                return bool(self.call(lambda: self.rc.get_redis_connection(node).ping(),
                                       node=node))
            except Exception:  # unreachable, refused: not this one
                return False

        if len(masters) <= 1:
            return bool(masters) and ping(masters[0])
        from concurrent.futures import as_completed

        try:
            futures = [self.threads().submit(ping, m) for m in masters]
        except RuntimeError:  # (closed)
            return False
        # (the PINGs still out when one answered go on: those that time out are down)
        return any(fut.result() for fut in as_completed(futures))

    def threads(self) -> Any:
        """The threads that call the masters at the same time (MASTER_THREADS)."""
        with self._down_lock:  # (the loop's and the lease thread's first calls: one pool)
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(max_workers=MASTER_THREADS,
                                                thread_name_prefix="kvcomm-push")
            return self._pool

    def call(self, fn: Any, key: str | None = None, node: Any = None) -> Any:
        """Run one Redis call; errors translated (``key`` names the value a key error is
        about; ``node``: the master the call went to, taken for down (:attr:`down`) if
        it timed out or refused the connection)."""
        from redis import exceptions as rex

        try:
            return fn()
        except rex.ResponseError as exc:
            msg = str(exc)
            if _key_error(msg) and not msg.startswith(_TRANSIENT):
                where = f"L3 value of {key!r}: " if key is not None else ""
                raise CorruptRecord(f"{where}{msg.split(' ', 1)[-1]}") from None
            raise Unavailable(f"Redis Cluster refused: {msg}") from None
        except (rex.ConnectionError, rex.TimeoutError, rex.ClusterDownError,
                rex.ClusterError, rex.RedisClusterException) as exc:
            # (RedisClusterException: redis-py re-read the slot map after a timeout and
            # no seed answered: "Redis Cluster cannot be connected")
            if node is not None and isinstance(exc, (rex.ConnectionError, rex.TimeoutError)):
                self.went_down(node, exc)
            # (a master now down: no refresh here but in the pinger, see _refresh_topology)
            self.refresh_topology()
            raise Unavailable(f"Redis Cluster unreachable: {exc}; the write stays in L2") from None

    def on(self, node: Any, *args: Any) -> Any:
        """One command for master ``node`` through the cluster client (a MOVED
        followed), without redis-py's retries: a command with its target node named is
        not retried, where one routed by key is retried after each timeout, re-reading
        the slot map each time (with the daemon's client, five timeouts and more before
        a hung master is taken for down: every round of the host held meanwhile).
        Raises what redis-py raises (the caller's call translates it). A connection
        error (not a timeout) is tried once more, on a new connection: a pooled one a
        restarted master closed fails at once, where redis-py's retry used to reconnect;
        a master that refuses fails the second try as fast."""
        from redis import exceptions as rex

        try:
            return self.rc.execute_command(*args, target_nodes=node)  # type: ignore[no-untyped-call]
        except rex.TimeoutError:
            raise
        except rex.ConnectionError:
            return self.rc.execute_command(*args, target_nodes=node)  # type: ignore[no-untyped-call]

    def master_up(self, name: str | bytes, what: str) -> Any:
        """The master serving key ``name`` (the client's slot map). Raises Unreached at
        once when it is :attr:`down` (``what``: the message's name for what is not
        served), Unavailable when there is no slot map."""
        node = self.call(lambda: self.rc.get_node_from_key(name))  # type: ignore[no-untyped-call]
        if node.name in self.down:
            raise Unreached(f"Redis master {node.name} (of {what}) is down; tried again later")
        return node

    def on_masters(self, jobs: Sequence[tuple[Any, Callable[[], Any]]]) -> list[Any]:
        """Each ``(node, run)`` of ``jobs`` as :meth:`down_or_raise` (its answer, or None
        when its master is down or timed out now), the masters' calls at the same time
        (the push pipelines' threads): a call that reaches several masters that stopped
        answering waits one timeout for all of them, not one each in turn — the daemon's
        loop must come back within the lease TTL, or a host cut off from some masters
        would enter partition mode. Answers in the order of ``jobs``; raises the first
        error (Unavailable) once every call has returned."""
        if len(jobs) <= 1:
            return [self.down_or_raise(run, node) for node, run in jobs]
        futures = [self.threads().submit(self.down_or_raise, run, node) for node, run in jobs]
        out: list[Any] = []
        first: BaseException | None = None
        for fut in futures:
            try:
                out.append(fut.result())
            except BaseException as exc:  # (every call is waited for first)
                first = first or exc
                out.append(None)
        if first is not None:
            raise first
        return out

    def down_or_raise(self, run: Callable[[], Any], node: Any) -> Any:
        """``run()`` on master ``node``: its answer, or None when it timed out or refused
        the connection (it is then :attr:`down`). Raises Unavailable for other errors."""
        try:
            return self.call(run, node=node)
        except Unavailable:
            if node.name in self.down:
                return None
            raise

    def load(self, node: Any, conn: Any, script: Any) -> None:
        """Load ``script`` on ``node`` once (EVALSHA then finds it)."""
        if (node.name, script.sha) not in self.loaded:
            conn.script_load(script.script)
            self.loaded.add((node.name, script.sha))

    def eval_on(self, node: Any, script: Any, *args: Any) -> Any:
        """``script`` run on master ``node`` with no keys (its names come in ``args``: the
        caller has grouped them by node), loaded there first if need be. A node that lost
        its scripts (restarted) raises NOSCRIPT once: the next call loads it again.
        Raises what redis-py raises (the caller's call turns it into Unavailable)."""
        conn = self.rc.get_redis_connection(node)
        self.load(node, conn, script)
        try:
            return conn.evalsha(script.sha, 0, *args)
        except Exception as exc:
            if _noscript(exc):
                self.loaded.discard((node.name, script.sha))
            raise

    def node(self, host: str, port: int) -> Any:
        """The cluster node at ``host:port`` (a redirect's target)."""
        node = self.rc.get_node(host=host, port=port)  # type: ignore[no-untyped-call]
        if node is None:  # a node the slot map does not know yet
            self.refresh_topology(force=True)
            node = self.rc.get_node(host=host, port=port)  # type: ignore[no-untyped-call]
            if node is None:
                raise Unavailable(f"Redis Cluster redirected to {host}:{port}, a node it "
                                  "does not list")
        return node

    def by_node(self, groups: Iterable[int]) -> dict[str, tuple[Any, list[int]]]:
        """``groups`` by the master serving their slot now (the client's slot map)."""
        out: dict[str, tuple[Any, list[int]]] = {}
        for g in groups:
            node = self.call(lambda g=g: self.rc.nodes_manager.get_node_from_slot(
                self.groups.slot(g)))
            out.setdefault(node.name, (node, []))[1].append(g)
        return out

    def get_own(self, name: str) -> Any:
        """GET ``name`` (a key of KVCOMM's own) on its master, without redis-py's
        retries: a hung master costs one timeout (and is taken for :attr:`down`), not
        one per retry. Raises Unavailable, CorruptRecord; Unreached at once while its
        master is down."""
        from redis import exceptions as rex

        refused: list[str] = []

        def get(node: Any) -> Any:
            try:
                return self.on(node, "GET", name)
            except rex.ConnectionError as exc:  # (not a TimeoutError, which costs one)
                if _refused(exc):  # (not AUTH, nor the server's client limit)
                    refused.append(node.name)
                raise

        node = self.master_up(name, name)
        try:
            return self.call(lambda: get(node), name, node=node)
        except Unavailable:
            if not refused:
                raise
            # a master that refuses the connection was failed over, and this client's
            # slot map (read from a node whose gossip lags) still names it: read the map
            # again and ask the successor, once (a balancer or daemon starting right
            # after a failover). Within one timeout: the pinger's refresh may be the one
            # running (ours then returns at once), or the map read from a lagging node
            deadline = time.monotonic() + self.timeout
            while True:
                self.refresh_topology(force=True)
                again = self.call(lambda: self.rc.get_node_from_key(name))  # type: ignore[no-untyped-call]
                if again.name != node.name and again.name not in self.down:
                    return self.call(lambda n=again: get(n), name, node=again)
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)

    def own_key(self, name: str, write: Any) -> None:
        """``write(name, node)`` to a key of KVCOMM's own (``kvn:``) on its master
        ``node`` (with :meth:`on`); if something else left a value of another type
        there, replace it. Raises Unavailable, CorruptRecord; Unreached at once when the
        key's master is :attr:`down`."""
        node = self.master_up(name, name)
        try:
            self.call(lambda: write(name, node), name, node=node)
        except CorruptRecord:
            self.call(lambda: self.on(node, "DEL", name), node=node)
            self.call(lambda: write(name, node), name, node=node)

    def close(self) -> None:
        """Stop the pinger (at its next turn), then close what the parts registered
        (:meth:`on_close`: the hint subscriptions), the threads, and the connections."""
        self._closed = True  # (the pinger, if any, ends at its next turn)
        for close in self._on_close:
            close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.rc.close()

    def on_close(self, close: Callable[[], None]) -> None:
        """Have :meth:`close` call ``close`` first (a part's own resources)."""
        self._on_close.append(close)

    # ------------------------------------------------------------------ masters down

    def went_down(self, node: Any, why: object) -> None:
        """Take master ``node`` for down (:attr:`down`) and make sure the pinger runs."""
        with self._down_lock:
            if node.name in self.down or self._closed:
                return
            self.down[node.name] = time.monotonic()
            log.warning("Redis master %s did not answer (%s): skipped until it answers a "
                        "PING; the other masters' pushes and feeds go on", node.name, why)
            if self._pinger is None or not self._pinger.is_alive():  # (a dead one: replaced)
                self._pinger = threading.Thread(target=self._ping_down, daemon=True,
                                                name="kvcomm-down")
                start_quiet(self._pinger)

    def _ping_down(self) -> None:
        """The pinger: PING every master taken for down, each DOWN_PING_EVERY seconds,
        and let those that answer (or that left the slot map) be used again; re-read the
        slot map while one is still down. Ends when none is down (or on close)."""
        while not self._closed:
            with self._down_lock:
                if not self.down:
                    self._pinger = None
                    return
                names = list(self.down)
            try:  # (the only way out of down: an error must not end the thread)
                self._ping_round(names)
            except Exception:
                log.exception("pinging the Redis masters taken for down failed; "
                              "pinged again in %gs", DOWN_PING_EVERY)
            time.sleep(DOWN_PING_EVERY)
        with self._down_lock:
            self._pinger = None

    def _ping_round(self, names: list[str]) -> None:
        """One round of the pinger: PING each master of ``names``; let go of those that
        answer or left the slot map; re-read the slot map if one is still down."""
        for name in names:
            node = self.rc.get_node(node_name=name)  # type: ignore[no-untyped-call]
            try:  # (gone from the slot map: nothing routes there any more)
                back = node is None or bool(self.rc.get_redis_connection(node).ping())
            except Exception:
                back = False
            if back:
                with self._down_lock:
                    since = self.down.pop(name, None)
                    self.ups += 1
                if since is not None:
                    log.warning("Redis master %s answers again (after %.1fs)", name,
                                time.monotonic() - since)
        if self.down:  # (a master dead for good: the slot map names its successor;
            self.refresh_topology()  # the calls that skip it make no call to learn it)

    def refresh_topology(self, force: bool = False) -> None:
        """Re-read the slot map (after a failover our per-node pipelines would keep
        dialling the dead master: redis-py only refreshes on its own command path); at
        most twice a second unless ``force``; while a master is :attr:`down`, only in the
        pinger's thread (unless ``force``)."""
        now = time.monotonic()
        if now - self._refreshed < self.refresh_every and not force:
            return
        if self.down and not force and threading.current_thread() is not self._pinger:
            # (the pinger re-reads the map while a master is down: here it would hold the
            # caller, the daemon's loop say, a timeout per seed that does not answer)
            return
        self._refreshed = now
        try:
            self.rc.nodes_manager.initialize()
        except Exception:  # the cluster may still be electing: the next call retries
            pass


def _refused(exc: BaseException) -> bool:
    """Whether redis-py's ``exc`` came of a refused connection (the OSError it was raised
    from: nothing listens there, a dead or failed-over master), not of an AUTH error or
    the server's client limit, which a new slot map does not mend."""
    seen: BaseException | None = exc
    for _ in range(8):  # (a chain of causes, bounded)
        if seen is None:
            return False
        if isinstance(seen, ConnectionRefusedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _bound_refresh(nodes_manager: Any, timeout: float) -> None:
    """Make ``nodes_manager.initialize`` (redis-py re-reads the slot map from every seed
    after a timeout, inside the failed call: each seed of a cut-off host costs a
    timeout) return after at most ``timeout`` seconds: it runs in a thread of its own,
    one at a time; the caller that starts it waits for it that long, one that finds it
    running does not wait (the refresh goes on, and later calls find its result). An
    agent's operation then fails within about twice ``cluster.timeout`` (its own call,
    then this) instead of one timeout per seed."""
    real = nodes_manager.initialize
    lock = threading.Lock()
    running: list[threading.Thread] = []

    def run(*args: Any, **kwargs: Any) -> None:
        try:
            real(*args, **kwargs)
        except Exception:  # (unreachable: the caller's call already failed; next time)
            pass

    def initialize(*args: Any, **kwargs: Any) -> None:
        with lock:
            if running and running[0].is_alive():
                return
            t = threading.Thread(target=run, args=args, kwargs=kwargs, daemon=True,
                                 name="kvcomm-slot-map")
            running[:] = [t]
            start_quiet(t)
        t.join(timeout)

    nodes_manager.initialize = initialize

