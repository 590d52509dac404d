"""etcd v3 for strong keys and host leases: a synchronous client over etcd's JSON gateway.

Plain ``http.client`` on etcd's own JSON gateway (``/v3/kv/range``, ``/v3/kv/txn``,
``/v3/watch``...): as fast as aetcd driven from synchronous code, and no dependency at
all. So this module speaks the gateway itself, and owns failover, deadlines, keepalives
and watch resume.

What a caller must know:

* :class:`EtcdClient` tries the member that last answered, then the next, until one
  answers or the call's deadline (``timeout``, ``cluster.timeout`` by default) passes:
  then :class:`~kvcomm.errors.Unavailable`. A **write** sent without an answer is never
  repeated: it raises Unavailable saying its outcome is unknown (it may have committed).
* A write returns only once a majority committed it; reads are linearizable unless
  ``serializable=True``.
* Errors: Unavailable, :class:`~kvcomm.errors.ValueTooLarge`,
  :class:`~kvcomm.errors.ConfigError` (auth, TLS), :class:`~kvcomm.errors.InvalidArgument`;
  :class:`WatchCompacted` (an Unavailable): a watch cannot resume, re-read what it watches.
* :meth:`EtcdClient.watch` delivers every event once, in revision order, across failovers;
  :meth:`EtcdClient.lease_grant`, :meth:`~EtcdClient.lease_keepalive`,
  :meth:`~EtcdClient.lease_revoke` and :class:`KeepAlive` (renews every ``ttl / 3``).
* Connections are HTTP/1.1 keep-alive, one per member per thread, dropped in a child
  after ``fork``. The client is thread-safe.

Design (the candidates measured, and why; endpoints and failover, deadlines, errors,
auth and TLS, watches, leases): docs/design/etcd.md.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import os
import queue
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from .._threads import start_quiet
from ..errors import ConfigError, InvalidArgument, KVCommError, Unavailable, ValueTooLarge

if TYPE_CHECKING:
    from ..config import ClusterConfig

log = logging.getLogger("kvcomm.etcd")

Endpoint = tuple[str, int]
KeyLike = bytes | str

# gRPC status codes etcd answers with (in the gateway's JSON "code")
_INVALID_ARGUMENT, _DEADLINE, _NOT_FOUND, _PERMISSION, _EXHAUSTED = 3, 4, 5, 7, 8
_FAILED_PRECONDITION, _OUT_OF_RANGE, _UNAVAILABLE, _UNAUTHENTICATED = 9, 11, 14, 16

# answers that prove nothing was applied: any call may try another member
_NOT_APPLIED = ("etcdserver: no leader", "etcdserver: too many requests",
                "etcdserver: not capable")
# answers after which a write may or may not have been committed ("server stopped":
# the member stopped while its proposal waited for the commit, which raft may still make)
_UNKNOWN = ("etcdserver: server stopped", "etcdserver: request cancelled",
            "etcdserver: request timed out", "etcdserver: leader changed",
            "etcdserver: request timed out, possibly due to previous leader failure",
            "etcdserver: request timed out, possibly due to connection lost")
_TOO_LARGE = ("etcdserver: request is too large", "received message larger than max",
              "trying to send message larger than max")


def _b(key: KeyLike) -> bytes:
    if isinstance(key, bytes):
        return key
    if isinstance(key, str):
        try:
            return key.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgument(f"etcd key {key!r} is not valid UTF-8") from None
    raise InvalidArgument(f"an etcd key is bytes or str, got {type(key).__name__}")


def _enc(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _dec(data: str | None) -> bytes:
    # validate: a non-base64 character is an error, not silently skipped (which would
    # turn garbage into a shorter, wrong value)
    return base64.b64decode(data, validate=True) if data else b""


def _list(v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise TypeError(f"a list was expected, got {type(v).__name__}")
    return v


def prefix_end(prefix: bytes) -> bytes:
    """The range end that makes ``[prefix, end)`` every key starting with ``prefix``
    (etcd's rule: the prefix with its last byte below 0xff incremented; ``b"\\0"``, all
    keys from ``prefix`` on, when there is none)."""
    p = bytearray(prefix)
    while p:
        if p[-1] < 0xFF:
            p[-1] += 1
            return bytes(p)
        p.pop()
    return b"\0"


# ---------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as etcd holds it. ``version`` counts the puts since the key was created
    (0: absent); revisions are the cluster's, increasing with every write."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0

    @staticmethod
    def from_json(d: dict[str, Any]) -> KeyValue:
        """Raises ValueError, TypeError, AttributeError for what is not etcd's key-value."""
        return KeyValue(_dec(d.get("key")), _dec(d.get("value")), int(d.get("create_revision", 0)),
                        int(d.get("mod_revision", 0)), int(d.get("version", 0)),
                        int(d.get("lease", 0)))


@dataclass(frozen=True, slots=True)
class RangeResult:
    """The keys a range read found (in key order), whether more matched than ``limit``
    let through, how many matched, and the cluster revision the read saw."""

    kvs: list[KeyValue]
    more: bool
    count: int
    revision: int


@dataclass(frozen=True, slots=True)
class Compare:
    """One comparison of a transaction: ``target`` of ``key`` ``op`` ``operand``.

    Targets: ``"value"`` (bytes), ``"version"`` (puts since creation; 0 = absent),
    ``"mod"`` (mod_revision), ``"create"`` (create_revision), ``"lease"``. An absent key
    has version, mod and create revision 0 and no value (a value comparison with it
    fails).
    """

    key: bytes
    target: Literal["value", "version", "mod", "create", "lease"]
    op: Literal["=", "!=", "<", ">"]
    operand: bytes | int

    @staticmethod
    def value(key: KeyLike, op: Literal["=", "!=", "<", ">"], value: bytes) -> Compare:
        return Compare(_b(key), "value", op, bytes(value))

    @staticmethod
    def version(key: KeyLike, op: Literal["=", "!=", "<", ">"], version: int) -> Compare:
        return Compare(_b(key), "version", op, int(version))

    @staticmethod
    def mod(key: KeyLike, op: Literal["=", "!=", "<", ">"], revision: int) -> Compare:
        return Compare(_b(key), "mod", op, int(revision))

    @staticmethod
    def create(key: KeyLike, op: Literal["=", "!=", "<", ">"], revision: int) -> Compare:
        return Compare(_b(key), "create", op, int(revision))

    def to_json(self) -> dict[str, Any]:
        results = {"=": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}
        if self.op not in results or self.target not in _TARGETS:
            raise InvalidArgument(f"a Compare needs op in {list(results)} and target in "
                                  f"{list(_TARGETS)}, got {self.op!r} {self.target!r}")
        target, field_name = _TARGETS[self.target]
        operand: Any = _enc(self.operand) if isinstance(self.operand, bytes) else str(self.operand)
        return {"key": _enc(self.key), "target": target, "result": results[self.op],
                field_name: operand}


_TARGETS = {"value": ("VALUE", "value"), "version": ("VERSION", "version"),
            "mod": ("MOD", "mod_revision"), "create": ("CREATE", "create_revision"),
            "lease": ("LEASE", "lease")}


@dataclass(frozen=True, slots=True)
class Put:
    """A put inside a transaction."""

    key: bytes
    value: bytes
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Delete:
    """A delete inside a transaction (of every key under ``key`` with ``prefix``)."""

    key: bytes
    prefix: bool = False


@dataclass(frozen=True, slots=True)
class Get:
    """A (linearizable) read inside a transaction."""

    key: bytes


TxnOp = Put | Delete | Get


def put_op(key: KeyLike, value: bytes, lease: int = 0) -> Put:
    return Put(_b(key), bytes(value), lease)


def delete_op(key: KeyLike, prefix: bool = False) -> Delete:
    return Delete(_b(key), prefix)


def get_op(key: KeyLike) -> Get:
    return Get(_b(key))


@dataclass(frozen=True, slots=True)
class TxnResult:
    """Whether every comparison held (``succeeded``: the success branch ran), the
    revision after the transaction, and one result per operation of the branch that ran:
    a Get's KeyValue or None, a Put's None, a Delete's count of deleted keys."""

    succeeded: bool
    revision: int
    results: list[KeyValue | int | None]


@dataclass(frozen=True, slots=True)
class Event:
    """One change a watch saw: ``"put"`` (``kv`` the new key-value) or ``"delete"``
    (``kv`` has the key and the deleting revision as ``mod_revision``)."""

    type: Literal["put", "delete"]
    kv: KeyValue

    @property
    def revision(self) -> int:
        return self.kv.mod_revision


class WatchOverflowed(Unavailable):
    """Raised once by :meth:`Watch.next`: more than its ``max_pending`` events waited to
    be read, and they were dropped. Re-read what is watched; the events after come next."""


class WatchCompacted(Unavailable):
    """A watch cannot resume: etcd compacted the revisions from ``last_revision + 1`` on
    (``compact_revision`` is the oldest it still has). Re-read what is watched, then
    watch again from that read's revision + 1."""

    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


# ---------------------------------------------------------------- transport


class _NotSent(Exception):
    """The request certainly did not reach the member (connect failed, or closed)."""


class _Lost(Exception):
    """The request was sent (or may have been) and no answer came back."""


class _Answer(Exception):
    """etcd answered with an error (gRPC code and message)."""

    def __init__(self, code: int, message: str, status: int) -> None:
        super().__init__(f"{message} (gRPC code {code}, HTTP {status})")
        self.code, self.message, self.status = code, message, status


class _Local(threading.local):
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.conns: dict[Endpoint, http.client.HTTPConnection] = {}


def _dropped(conn: http.client.HTTPConnection) -> bool:
    """True when an idle keep-alive connection was closed by the peer (or has stray
    data): it would fail a request sent on it before the request is read."""
    sock = conn.sock
    if sock is None:
        return True
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


@dataclass
class EtcdStats:
    """Counters of one client (for tests and ``cluster status``)."""

    calls: int = 0
    failovers: int = 0  # attempts that moved on to another member
    reauths: int = 0  # tokens renewed
    unknown: int = 0  # writes whose outcome was unknown (raised Unavailable)
    by_endpoint: dict[str, int] = field(default_factory=dict)  # answered calls per member


class EtcdClient:
    """A synchronous etcd v3 client with failover across ``endpoints`` (see the module
    docstring). ``timeout`` bounds every call (override per call with ``timeout=``).

    Raises ConfigError when TLS files cannot be read or ``endpoints`` is empty. Connects
    lazily: constructing it sends nothing.
    """

    def __init__(self, endpoints: Sequence[Endpoint], *, timeout: float = 2.0,
                 username: str | None = None, password: str | None = None, tls: bool = False,
                 ca: str | None = None, cert: str | None = None, key: str | None = None) -> None:
        if not endpoints:
            raise ConfigError("cluster.etcd", "no etcd endpoint: list the members as host:port")
        if not timeout > 0:
            raise InvalidArgument(f"timeout must be > 0 seconds, got {timeout!r}")
        self.endpoints: list[Endpoint] = [(str(h), int(p)) for h, p in endpoints]
        self.timeout = float(timeout)
        self.username, self._password = username, password
        self._ssl = _ssl_context(ca, cert, key) if tls else None
        self._preferred = 0
        self._token: str | None = None
        self._lock = threading.Lock()
        self._local = _Local()
        self._all: list[http.client.HTTPConnection] = []
        self.stats = EtcdStats()
        self._closed = False

    @classmethod
    def from_config(cls, cluster: ClusterConfig, timeout: float | None = None) -> EtcdClient:
        """The client a host's config describes: ``cluster.etcd`` routed through
        ``cluster.address_remap``, its credentials and TLS, ``cluster.timeout``. Raises
        ConfigError (no ``cluster.etcd``, unreadable TLS files)."""
        return cls(cluster.etcd_endpoints(), timeout=timeout or cluster.timeout,
                   username=cluster.etcd_username, password=cluster.etcd_password,
                   tls=cluster.etcd_tls, ca=cluster.etcd_ca, cert=cluster.etcd_cert,
                   key=cluster.etcd_key)

    # ------------------------------------------------------------ connections

    @property
    def endpoint(self) -> Endpoint:
        """The member the next call tries first (the last one that answered)."""
        return self.endpoints[self._preferred]

    def _conn(self, ep: Endpoint, timeout: float) -> tuple[http.client.HTTPConnection, bool]:
        """A connection to ``ep`` for this thread (new, or reused and still open) and
        whether it is new. Raises _NotSent when it cannot be opened."""
        local = self._local
        if local.pid != os.getpid():  # a forked child: the parent's sockets are not ours
            for c in local.conns.values():
                c.close()
            local.conns, local.pid = {}, os.getpid()
        conn = local.conns.get(ep)
        if conn is not None and not _dropped(conn):
            assert conn.sock is not None
            conn.sock.settimeout(timeout)
            return conn, False
        if conn is not None:
            conn.close()
        conn = self._new_conn(ep, timeout)
        local.conns[ep] = conn
        with self._lock:
            self._all.append(conn)
        return conn, True

    def _new_conn(self, ep: Endpoint, timeout: float) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection
        if self._ssl is not None:
            conn = http.client.HTTPSConnection(ep[0], ep[1], timeout=timeout, context=self._ssl)
        else:
            conn = http.client.HTTPConnection(ep[0], ep[1], timeout=timeout)
        try:
            conn.connect()
        except ssl.SSLCertVerificationError as exc:
            conn.close()
            raise ConfigError("cluster.etcd_ca", f"etcd member {ep[0]}:{ep[1]}'s certificate "
                              f"failed verification ({exc.verify_message}): check "
                              "cluster.etcd_ca and the member's certificate") from None
        except ssl.SSLError as exc:
            conn.close()
            raise ConfigError("cluster.etcd_tls", f"TLS with etcd member {ep[0]}:{ep[1]} "
                              f"failed ({exc.reason or exc}): does it serve TLS, and does it "
                              "accept cluster.etcd_cert?") from None
        except OSError as exc:
            conn.close()
            raise _NotSent(f"{ep[0]}:{ep[1]}: {exc}") from None
        if conn.sock is not None:
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _drop(self, ep: Endpoint) -> None:
        conn = self._local.conns.pop(ep, None)
        if conn is not None:
            conn.close()

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", "Grpc-Metadata-hasleader": "true"}
        if self._token is not None:
            h["Authorization"] = self._token
        return h

    def _once(self, ep: Endpoint, path: str, body: bytes, timeout: float) -> dict[str, Any]:
        """One request to one member. Returns the JSON answer; raises _NotSent, _Lost,
        _Answer (etcd's error), ConfigError (TLS)."""
        conn, _ = self._conn(ep, timeout)
        try:
            # headers and body go out in one send: if it fails, the member has at most
            # part of the request, which it cannot apply
            conn.request("POST", path, body=body, headers=self._headers())
        except (OSError, http.client.HTTPException) as exc:
            self._drop(ep)
            raise _NotSent(f"{ep[0]}:{ep[1]}: {exc!r}") from None
        try:
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            self._drop(ep)
            what = "no answer in time" if isinstance(exc, TimeoutError) else repr(exc)
            raise _Lost(f"{ep[0]}:{ep[1]}: {what}") from None
        try:
            out = json.loads(data) if data else {}
        except ValueError:
            out = None
        if not isinstance(out, dict):  # (etcd answers every call with a JSON object)
            self._drop(ep)
            raise _Lost(f"{ep[0]}:{ep[1]}: an answer that is not a JSON object (HTTP "
                        f"{resp.status}): {data[:200]!r}") from None
        if resp.status != 200 or "error" in out and "code" in out:
            raise _Answer(_code(out), str(out.get("message") or out.get("error")), resp.status)
        return out

    # ------------------------------------------------------------ the call loop

    def _call(self, path: str, payload: dict[str, Any], *, write: bool,
              timeout: float | None = None) -> dict[str, Any]:
        """POST ``payload`` to ``path`` on the preferred member, failing over as the
        module docstring says. Raises Unavailable, ValueTooLarge, ConfigError."""
        if self._closed:
            raise Unavailable("this etcd client is closed")
        budget = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        body = json.dumps(payload, separators=(",", ":")).encode()
        self.stats.calls += 1
        errors: list[str] = []
        reauthed: set[Endpoint] = set()  # (a rejected token is renewed once per member)
        n = len(self.endpoints)
        i = self._preferred
        tries = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ep = self.endpoints[i % n]
            # a read may be repeated elsewhere: give a silent member half of what is left,
            # so that a paused or cut-off one cannot eat the whole call
            attempt = left if write or tries % n == n - 1 else left / 2
            try:
                out = self._once(ep, path, body, attempt)
            except _NotSent as exc:
                errors.append(str(exc))
            except _Lost as exc:
                self._preferred = (i + 1) % n  # the next call starts elsewhere
                if write:
                    self.stats.unknown += 1
                    raise Unavailable(
                        f"etcd: {exc} after the write was sent; it may or may not have been "
                        "applied (outcome unknown): read the key to find out") from None
                errors.append(str(exc))
            except _Answer as exc:
                if self.username and ep not in reauthed and (
                        exc.code == _UNAUTHENTICATED or "user name is empty" in exc.message
                        or "invalid auth token" in exc.message):
                    reauthed.add(ep)
                    try:  # (a restarted member forgot its tokens; the TTL passed...)
                        self._authenticate(ep, deadline)
                        continue  # the same member, with a fresh token
                    except Unavailable as why:  # (electing, say): try another member
                        errors.append(str(why))
                else:
                    self._raise_for(exc, ep, write)  # returns only when another member may serve
                errors.append(f"{ep[0]}:{ep[1]}: {exc.message}")
            else:
                if i % n != self._preferred:
                    self._preferred = i % n
                key = f"{ep[0]}:{ep[1]}"
                self.stats.by_endpoint[key] = self.stats.by_endpoint.get(key, 0) + 1
                return out
            self.stats.failovers += 1
            i += 1
            tries += 1
            if tries % n == 0:  # every member failed fast (electing?): wait a little
                time.sleep(max(0.0, min(0.05 * (tries // n), deadline - time.monotonic())))
        raise Unavailable(f"etcd: no member answered within {budget:g}s (cluster.timeout) "
                          f"at {', '.join(f'{h}:{p}' for h, p in self.endpoints)}; a majority "
                          f"may be down or cut off: {'; '.join(errors[-3:]) or 'no answer'}")

    def _raise_for(self, exc: _Answer, ep: Endpoint, write: bool) -> None:
        """Translate etcd's error answer; return (nothing raised) when another member may
        serve the call."""
        msg = exc.message
        where = f"etcd member {ep[0]}:{ep[1]}"
        if any(m in msg for m in _TOO_LARGE) or exc.code == _EXHAUSTED and "larger" in msg:
            raise ValueTooLarge(f"{where} refused the request: {msg}. etcd limits a request "
                                "to --max-request-bytes (1.5 MiB by default; its JSON gateway "
                                "to 2 MiB): store a smaller value under a strong key") from None
        if exc.code == _UNAUTHENTICATED or "authentication failed" in msg or \
                "user name is empty" in msg or "invalid auth token" in msg:
            raise ConfigError("cluster.etcd_username", f"{where} refused the credentials: {msg}; "
                              "check cluster.etcd_username and etcd_password") from None
        if exc.code == _PERMISSION:
            raise ConfigError("cluster.etcd_username", f"{where}: {msg}; grant the etcd user "
                              f"{self.username!r} a role with read-write on KVCOMM's keys") from None
        if any(m in msg for m in _NOT_APPLIED):
            return
        if any(m in msg for m in _UNKNOWN) or exc.code in (_DEADLINE, _UNAVAILABLE):
            if write:
                self.stats.unknown += 1
                raise Unavailable(f"{where}: {msg}; the write may or may not have been applied "
                                  "(outcome unknown): read the key to find out") from None
            return
        if exc.code == _NOT_FOUND and "lease" in msg:
            raise _LeaseNotFound(msg)
        if exc.code in (_INVALID_ARGUMENT, _OUT_OF_RANGE, _FAILED_PRECONDITION):
            raise InvalidArgument(f"{where} refused the request: {msg}") from None
        raise Unavailable(f"{where}: {msg}") from None

    def _authenticate(self, ep: Endpoint, deadline: float) -> None:
        """Fetch a token from ``ep``. Raises ConfigError (refused), Unavailable."""
        self._token = None
        body = json.dumps({"name": self.username, "password": self._password or ""}).encode()
        try:
            out = self._once(ep, "/v3/auth/authenticate", body, max(0.05, deadline - time.monotonic()))
        except (_NotSent, _Lost) as exc:
            raise Unavailable(f"etcd: cannot authenticate at {ep[0]}:{ep[1]}: {exc}") from None
        except _Answer as exc:
            if _refused(exc):
                raise ConfigError("cluster.etcd_username", f"etcd refused user "
                                  f"{self.username!r}: {exc.message}; check "
                                  "cluster.etcd_username and etcd_password") from None
            # an election, a timeout, a member that is stopping: not the credentials
            raise Unavailable(f"etcd: cannot authenticate at {ep[0]}:{ep[1]}: "
                              f"{exc.message}") from None
        self._token = str(out.get("token", "")) or None
        self.stats.reauths += 1

    def _ensure_auth(self) -> None:
        if self.username and self._token is None:
            deadline = time.monotonic() + self.timeout
            last: Exception | None = None
            for k in range(len(self.endpoints)):
                ep = self.endpoints[(self._preferred + k) % len(self.endpoints)]
                try:
                    self._authenticate(ep, deadline)
                    return
                except Unavailable as exc:
                    last = exc
            raise Unavailable(str(last))

    def request(self, path: str, payload: dict[str, Any], *, write: bool,
                timeout: float | None = None) -> dict[str, Any]:
        """Any gateway call (``/v3/...``) with this client's failover, auth and errors:
        the escape hatch for what the methods below do not cover. ``write`` says whether
        repeating it on another member could apply it twice."""
        self._ensure_auth()
        return self._call(path, payload, write=write, timeout=timeout)

    # ------------------------------------------------------------ key-value

    def get(self, key: KeyLike, *, serializable: bool = False,
            timeout: float | None = None) -> KeyValue | None:
        """The key, or None when absent. Linearizable (confirmed by a majority) unless
        ``serializable`` (the answering member's own state, possibly stale). Raises
        Unavailable."""
        r = self.range(key, serializable=serializable, timeout=timeout, _exact=True)
        return r.kvs[0] if r.kvs else None

    def range(self, prefix: KeyLike, *, limit: int = 0, serializable: bool = False,
              keys_only: bool = False, start: KeyLike | None = None,
              timeout: float | None = None, _exact: bool = False) -> RangeResult:
        """Every key starting with ``prefix``, in key order, at most ``limit`` (0: all);
        from ``start`` on when given (the next page: the last key seen + b"\\0").
        Linearizable unless ``serializable``. Raises Unavailable, InvalidArgument."""
        if not isinstance(limit, int) or limit < 0:
            raise InvalidArgument(f"limit must be an int >= 0, got {limit!r}")
        p = _b(prefix)
        payload: dict[str, Any] = {"key": _enc(p if start is None else _b(start))}
        if not _exact:
            payload["range_end"] = _enc(prefix_end(p))
        if limit:
            payload["limit"] = limit
        if serializable:
            payload["serializable"] = True
        if keys_only:
            payload["keys_only"] = True
        out = self.request("/v3/kv/range", payload, write=False, timeout=timeout)
        with _shaped("/v3/kv/range", False):
            kvs = [KeyValue.from_json(d) for d in _list(out.get("kvs", []))]
            return RangeResult(kvs, bool(out.get("more", False)),
                               int(out.get("count", len(kvs))), _revision(out))

    def put(self, key: KeyLike, value: bytes, *, lease: int = 0,
            timeout: float | None = None) -> int:
        """Store ``value``; returns the revision of the write once a majority has it.
        Raises Unavailable (outcome unknown when it says so), ValueTooLarge."""
        payload: dict[str, Any] = {"key": _enc(_b(key)), "value": _enc(bytes(value))}
        if lease:
            payload["lease"] = str(lease)
        out = self.request("/v3/kv/put", payload, write=True, timeout=timeout)
        with _shaped("/v3/kv/put", True, self.stats):
            return _revision(out)

    def delete(self, key: KeyLike, *, prefix: bool = False, timeout: float | None = None) -> int:
        """Delete the key (every key under it with ``prefix``); returns how many were
        deleted. Raises Unavailable."""
        k = _b(key)
        payload: dict[str, Any] = {"key": _enc(k)}
        if prefix:
            payload["range_end"] = _enc(prefix_end(k))
        out = self.request("/v3/kv/deleterange", payload, write=True, timeout=timeout)
        with _shaped("/v3/kv/deleterange", True, self.stats):
            return int(out.get("deleted", 0))

    def txn(self, compare: Sequence[Compare], success: Sequence[TxnOp],
            failure: Sequence[TxnOp] = (), *, timeout: float | None = None) -> TxnResult:
        """If every comparison holds, apply ``success``, else ``failure``, atomically —
        the primitive of compare-and-set. Raises Unavailable (outcome unknown when it
        says so), ValueTooLarge, InvalidArgument."""
        payload = {"compare": [c.to_json() for c in compare],
                   "success": [_op_json(o) for o in success],
                   "failure": [_op_json(o) for o in failure]}
        out = self.request("/v3/kv/txn", payload, write=True, timeout=timeout)
        with _shaped("/v3/kv/txn", True, self.stats):
            ok = bool(out.get("succeeded", False))
            ops = success if ok else failure
            responses = _list(out.get("responses", []))
            if len(responses) != len(ops):  # (one response per operation of the branch)
                raise ValueError(f"{len(responses)} responses to {len(ops)} operations")
            results: list[KeyValue | int | None] = []
            for op, r in zip(ops, responses, strict=True):
                if isinstance(op, Get):
                    kvs = _list(r.get("response_range", {}).get("kvs", []))
                    results.append(KeyValue.from_json(kvs[0]) if kvs else None)
                elif isinstance(op, Delete):
                    results.append(int(r.get("response_delete_range", {}).get("deleted", 0)))
                else:
                    results.append(None)
            return TxnResult(ok, _revision(out), results)

    # ------------------------------------------------------------ leases

    def lease_grant(self, ttl: int, *, timeout: float | None = None) -> int:
        """A new lease of ``ttl`` whole seconds (etcd raises a shorter one to its minimum,
        1.5 election timeouts); returns its id. Raises Unavailable, InvalidArgument."""
        if not isinstance(ttl, int) or ttl < 1:
            raise InvalidArgument(f"a lease TTL is a whole number of seconds >= 1, got {ttl!r}")
        out = self.request("/v3/lease/grant", {"TTL": str(ttl)}, write=True, timeout=timeout)
        with _shaped("/v3/lease/grant", True, self.stats):
            return int(out["ID"])

    def lease_keepalive(self, lease: int, *, timeout: float | None = None) -> int:
        """Renew ``lease``; returns the TTL it now has, 0 when it has expired (or never
        existed). Raises Unavailable."""
        out = self.request("/v3/lease/keepalive", {"ID": str(lease)}, write=False,
                           timeout=timeout)
        with _shaped("/v3/lease/keepalive", False):
            return int(out.get("result", {}).get("TTL", 0))

    def lease_ttl(self, lease: int, *, timeout: float | None = None) -> int:
        """The seconds ``lease`` has left, -1 when it has expired (or never existed).
        Raises Unavailable."""
        out = self.request("/v3/kv/lease/timetolive", {"ID": str(lease)}, write=False,
                           timeout=timeout)
        with _shaped("/v3/kv/lease/timetolive", False):
            return int(out.get("TTL", -1))

    def lease_revoke(self, lease: int, *, timeout: float | None = None) -> bool:
        """Revoke ``lease`` (its keys are deleted); False when it had already expired.
        Raises Unavailable."""
        try:
            self.request("/v3/kv/lease/revoke", {"ID": str(lease)}, write=True, timeout=timeout)
        except _LeaseNotFound:
            return False
        return True

    def keep_alive(self, lease: int, ttl: float, *, interval: float | None = None) -> KeepAlive:
        """Start a :class:`KeepAlive` thread renewing ``lease`` (of ``ttl`` seconds)."""
        return KeepAlive(self, lease, ttl, interval)

    # ------------------------------------------------------------ cluster

    def status(self, endpoint: Endpoint, *, timeout: float | None = None) -> dict[str, Any]:
        """One member's ``/v3/maintenance/status`` (its id, the leader it follows, raft
        term and index), asked of that member only. Raises Unavailable."""
        self._ensure_auth()
        try:
            return self._once(endpoint, "/v3/maintenance/status", b"{}",
                              self.timeout if timeout is None else timeout)
        except (_NotSent, _Lost, _Answer) as exc:
            raise Unavailable(f"etcd member {endpoint[0]}:{endpoint[1]}: {exc}") from None

    def members(self, *, timeout: float | None = None) -> list[dict[str, Any]]:
        """The cluster's members (``ID``, ``name``, ``clientURLs``...). Raises Unavailable."""
        out = self.request("/v3/cluster/member/list", {}, write=False, timeout=timeout)
        with _shaped("/v3/cluster/member/list", False):
            return [dict(m) for m in _list(out.get("members", []))]

    # ------------------------------------------------------------ watch

    def watch(self, key: KeyLike, *, prefix: bool = False, start_revision: int = 0,
              idle: float = 30.0, max_pending: int = 0) -> Watch:
        """Watch ``key`` (every key under it with ``prefix``) from ``start_revision``
        (0: from now on); see :class:`Watch` (``max_pending``: events queued unread at
        most, 0 for no bound). Raises InvalidArgument."""
        if not isinstance(start_revision, int) or start_revision < 0:
            raise InvalidArgument(f"start_revision must be an int >= 0, got {start_revision!r}")
        k = _b(key)
        return Watch(self, k, prefix_end(k) if prefix else b"", start_revision, idle, max_pending)

    def _open_stream(self, ep: Endpoint, path: str, payload: dict[str, Any], timeout: float
                     ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse, socket.socket]:
        """A dedicated connection streaming the answer to ``payload`` (a watch), and its
        socket (http.client forgets it once an answer says ``Connection: close``, while
        the answer still reads from it). Raises _NotSent, _Lost, _Answer, ConfigError."""
        self._ensure_auth()
        conn = self._new_conn(ep, timeout)
        sock = conn.sock
        assert sock is not None  # (connected by _new_conn)
        try:
            conn.request("POST", path, body=json.dumps(payload).encode(), headers=self._headers())
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise _Lost(f"{ep[0]}:{ep[1]}: {exc!r}") from None
        if resp.status != 200:
            data = resp.read()
            conn.close()
            try:
                out = json.loads(data)
            except ValueError:
                out = {"code": 2, "message": data[:200].decode(errors="replace")}
            raise _Answer(_code(out) if isinstance(out, dict) else 2,
                          str(out.get("message") if isinstance(out, dict) else out), resp.status)
        return conn, resp, sock

    def close(self) -> None:
        """Close every connection (other threads' included). Calls after it raise
        Unavailable."""
        self._closed = True
        with self._lock:
            conns, self._all = self._all, []
        for c in conns:
            c.close()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _LeaseNotFound(Unavailable):
    pass


def _refused(exc: _Answer) -> bool:
    """Whether an answer to /v3/auth/authenticate refuses the credentials (rather than
    saying the member cannot serve now: no leader, a timeout, stopping)."""
    if any(m in exc.message for m in (*_NOT_APPLIED, *_UNKNOWN)):
        return False
    return exc.code not in (_DEADLINE, _UNAVAILABLE)


def _revision(out: dict[str, Any]) -> int:
    return int(out.get("header", {}).get("revision", 0))


def _code(out: dict[str, Any]) -> int:
    """The gRPC code of an error answer (2, UNKNOWN, when it is not a number)."""
    try:
        return int(out.get("code", 2))
    except (ValueError, TypeError):
        return 2


@contextlib.contextmanager
def _shaped(path: str, write: bool, stats: EtcdStats | None = None) -> Iterator[None]:
    """Parse an answer of ``path`` inside this: JSON that is not what etcd sends (a
    list where an object belongs, base64 that is not, a revision that is no number)
    raises Unavailable — for a write, saying its outcome is unknown — rather than
    whatever Python error the parse met."""
    try:
        yield
    except KVCommError:
        raise
    except (ValueError, TypeError, AttributeError, KeyError, IndexError) as exc:
        unknown = ""
        if write:
            if stats is not None:
                stats.unknown += 1
            unknown = ("; the write may or may not have been applied (outcome unknown): read "
                       "the key to find out")
        raise Unavailable(f"etcd answered {path} with JSON that is not what etcd sends "
                          f"({type(exc).__name__}: {exc}){unknown}") from None


def _op_json(op: TxnOp) -> dict[str, Any]:
    if isinstance(op, Put):
        d: dict[str, Any] = {"key": _enc(op.key), "value": _enc(op.value)}
        if op.lease:
            d["lease"] = str(op.lease)
        return {"request_put": d}
    if isinstance(op, Delete):
        d = {"key": _enc(op.key)}
        if op.prefix:
            d["range_end"] = _enc(prefix_end(op.key))
        return {"request_delete_range": d}
    if isinstance(op, Get):
        return {"request_range": {"key": _enc(op.key)}}
    raise InvalidArgument(f"a transaction holds Put, Delete and Get, got {type(op).__name__}")


def _ssl_context(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext:
    """The TLS context for etcd. Raises ConfigError naming the file that cannot be used."""
    try:
        ctx = ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError("cluster.etcd_ca", f"cannot use {ca!r} as a CA bundle: {exc}") from None
    if cert is not None:
        try:
            ctx.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError("cluster.etcd_cert", f"cannot use certificate {cert!r} "
                              f"(key {key!r}): {exc}") from None
    return ctx


# ---------------------------------------------------------------- watch


class Watch:
    """A watch that survives member failures (see the module docstring).

    :meth:`next` returns the next events (in revision order, each once), or ``[]`` when
    none came within its timeout; iterate to block for ever. ``last_revision`` is the
    revision of the last event delivered (or the start); ``resumes`` counts streams
    re-opened after a drop; ``endpoint`` is the member streaming now. Raises
    WatchCompacted from :meth:`next` when it cannot resume.
    """

    def __init__(self, client: EtcdClient, key: bytes, range_end: bytes, start_revision: int,
                 idle: float, max_pending: int = 0) -> None:
        self.client = client
        # (0: no bound) events queued for the reader at most: past it they are dropped
        # and next() raises WatchOverflowed once, so a reader that does not keep up holds
        # bounded memory and learns that it must re-read
        self.max_pending = max_pending
        self._pending = 0
        self._pending_lock = threading.Lock()
        self.key, self.range_end = key, range_end
        self.idle = idle
        self.last_revision = start_revision - 1 if start_revision > 0 else 0
        self._from_now = start_revision == 0
        self.resumes = 0
        self.endpoint: Endpoint | None = None
        self.created = threading.Event()
        self._queue: queue.Queue[list[Event] | BaseException] = queue.Queue()
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread = threading.Thread(target=self._run, name="kvcomm-etcd-watch", daemon=True)
        start_quiet(self._thread)

    def next(self, timeout: float | None = None) -> list[Event]:
        """The next batch of events, or [] after ``timeout`` seconds without any (None:
        wait for ever). Raises WatchCompacted, Unavailable (closed)."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return []
        if isinstance(item, WatchOverflowed):
            raise item  # (once: the events after it follow)
        if isinstance(item, BaseException):
            self._queue.put(item)  # every later call says the same
            raise item
        with self._pending_lock:
            self._pending -= len(item)
        return item

    def __iter__(self) -> Iterator[Event]:
        while True:
            yield from self.next()

    def close(self) -> None:
        """Stop the reader thread (and its stream)."""
        self._stop.set()
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=5)
        self._queue.put(Unavailable("the watch is closed"))

    def _payload(self) -> dict[str, Any]:
        req: dict[str, Any] = {"key": _enc(self.key), "progress_notify": True}
        if self.range_end:
            req["range_end"] = _enc(self.range_end)
        if not self._from_now:
            req["start_revision"] = str(self.last_revision + 1)
        return {"create_request": req}

    def _run(self) -> None:
        c = self.client
        n = len(c.endpoints)
        i = c._preferred
        failures = 0
        while not self._stop.is_set():
            ep = c.endpoints[i % n]
            try:
                self._stream(ep)
                failures = 0  # a stream that ended after working: resume at once
            except WatchCompacted as exc:
                self._queue.put(exc)
                return
            except (_NotSent, _Lost, _Answer, OSError, http.client.HTTPException, ValueError,
                    KVCommError):
                failures += 1
            except Exception:  # a bug here must not end the watch silently: log, go on
                log.exception("the etcd watch reader failed; resuming the stream")
                failures += 1
            if self._stop.is_set():
                return
            if self.created.is_set():
                self.resumes += 1
            i += 1
            if failures and failures % n == 0:  # every member failed: back off a little
                self._stop.wait(min(1.0, 0.05 * failures / n))

    def _stream(self, ep: Endpoint) -> None:
        """Read one stream from ``ep`` until it ends or fails."""
        conn, resp, sock = self.client._open_stream(ep, "/v3/watch", self._payload(),
                                                    self.client.timeout)
        self._sock = sock
        try:
            line = resp.readline()  # the "created" answer, within cluster.timeout
            first = self._parse(line)
            if not first.get("created"):
                raise _Lost(f"{ep[0]}:{ep[1]}: the watch was not created: {line[:200]!r}")
            if self._from_now:
                with _shaped("/v3/watch", False):
                    self.last_revision = _revision(first)
                self._from_now = False
            self.endpoint = ep
            self.created.set()
            sock.settimeout(self.idle)
            while not self._stop.is_set():
                line = resp.readline()
                if not line:
                    return  # the member ended the stream (shutting down)
                self._deliver(self._parse(line))
        finally:
            self._sock = None
            conn.close()
            resp.close()

    def _parse(self, line: bytes) -> dict[str, Any]:
        """One message of the stream. Raises _Lost (ended; not what etcd sends: the
        stream is not trusted further), _Answer, WatchCompacted."""
        if not line:
            raise _Lost("the stream ended")
        with _shaped("/v3/watch", False):
            return self._result(json.loads(line))

    def _result(self, msg: Any) -> dict[str, Any]:
        if not isinstance(msg, dict):
            raise TypeError(f"a watch message is a JSON object, got {type(msg).__name__}")
        if "error" in msg:
            err: Any = msg["error"]
            if not isinstance(err, dict):
                raise TypeError(f"a watch error is a JSON object, got {type(err).__name__}")
            raise _Answer(int(err.get("grpc_code", err.get("code", 2)) or 2),
                          str(err.get("message")), int(err.get("http_code", 200)))
        result: Any = msg.get("result", {})
        if not isinstance(result, dict):
            raise TypeError(f"a watch result is a JSON object, got {type(result).__name__}")
        if int(result.get("compact_revision", 0)) > 0:
            rev = int(result["compact_revision"])
            raise WatchCompacted(f"etcd compacted revisions before {rev}; the watch needed "
                                 f"{self.last_revision + 1}: re-read, then watch again", rev)
        if result.get("canceled"):
            raise _Lost(f"the member cancelled the watch: {result.get('cancel_reason', '')}")
        return result

    def _deliver(self, result: dict[str, Any]) -> None:
        with _shaped("/v3/watch", False):
            self._deliver_events(result)

    def _deliver_events(self, result: dict[str, Any]) -> None:
        events = []
        for e in _list(result.get("events", [])):
            kv = KeyValue.from_json(e.get("kv", {}))
            if kv.mod_revision <= self.last_revision:
                continue  # already delivered before the stream was resumed
            events.append(Event("delete" if e.get("type") == "DELETE" else "put", kv))
        if events:
            self.last_revision = events[-1].revision
            with self._pending_lock:
                if self.max_pending and self._pending + len(events) > self.max_pending:
                    dropped = 0
                    while True:
                        try:
                            old = self._queue.get_nowait()
                        except queue.Empty:
                            break
                        if isinstance(old, list):
                            dropped += len(old)
                    self._pending = 0
                    self._queue.put(WatchOverflowed(
                        f"{dropped + len(events)} watch events were not read in time and were "
                        "dropped: re-read what is watched"))
                    return
                self._pending += len(events)
                self._queue.put(events)
        elif not result.get("events"):
            # a progress notification: every event up to its revision was sent, so a
            # resume may start after it (what they are for: an idle watch is not
            # stranded behind a compaction of revisions it had nothing to see in)
            rev = _revision(result)
            if rev > self.last_revision:
                self.last_revision = rev


# ---------------------------------------------------------------- keepalive


class KeepAlive:
    """A thread renewing ``lease`` every ``interval`` seconds (``ttl / 3`` by default).

    ``expired`` is set once etcd says the lease is gone, or no renewal succeeded for
    ``ttl`` seconds (it may still exist, but whoever holds it must act as if not);
    ``renewals`` counts successful ones, ``errors`` failed ones. :meth:`stop` ends it
    (the lease then runs out on its own unless revoked).
    """

    def __init__(self, client: EtcdClient, lease: int, ttl: float, interval: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client, self.lease, self.ttl = client, lease, ttl
        self.interval = interval if interval is not None else max(0.1, ttl / 3)
        self.expired = threading.Event()
        self.renewals = 0
        self.errors = 0
        self.last_renewal = clock()
        self._clock = clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvcomm-etcd-keepalive",
                                        daemon=True)
        start_quiet(self._thread)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                left = self.client.lease_keepalive(self.lease, timeout=min(self.client.timeout,
                                                                           self.interval))
            except KVCommError:
                self.errors += 1
                if self._clock() - self.last_renewal > self.ttl:
                    self.expired.set()
                continue
            if left <= 0:
                self.expired.set()
                return
            self.renewals += 1
            self.last_renewal = self._clock()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
