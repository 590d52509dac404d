"""The tools of ``kvcomm mcp``, as plain synchronous functions over a :class:`kvcomm.Client`.

Nothing here knows about MCP: :class:`KVTools` takes JSON-shaped arguments and returns
JSON-shaped dicts, or raises :class:`ToolRefused` (a bad call: the message says what to
do). ``kvcomm.mcp.server`` registers each method as an MCP tool; a later async server can
call the same methods.

Values (one rule, both ways). JSON values are stored as they are: objects as dicts, arrays
as lists, strings, numbers, true/false/null; a Python agent reads back exactly that. What
JSON cannot carry travels as a one-key object whose key starts with ``$``:

- ``{"$bytes": "<base64>"}``: bytes (accepted on input, given on output);
- ``{"$float": "NaN" | "Infinity" | "-Infinity"}``: the floats JSON has no literal for
  (both ways);
- ``{"$unsupported": "<what it is>"}``: a value a Python agent stored that has no JSON form
  (a numpy array, a dict with non-str keys); output only.

A one-key object ``{"$bytes": ...}`` or ``{"$float": ...}`` is therefore never a plain
dict to this server. Tuples come back as arrays (as they do to Python agents).

Versions and cursors are opaque strings: pass back what a tool gave. A version names one
write of one key (``expect_version`` of ``kv_put``/``kv_delete`` compares with it); a
watch cursor is a position in the host's change feed.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import threading
import time
from collections import OrderedDict
from typing import Any

from ..core.versions import Version, decode_vector, encode_vector
from ..errors import ConflictError, KVCommError

#: The largest value kv_put stores, as JSON text (bytes counted base64-encoded).
MAX_VALUE_BYTES = 1 << 20
#: The most items a kv_scan page holds, and events a kv_watch call returns.
MAX_PAGE = 1000
#: The most a kv_scan page holds, as JSON text (one item at least, whatever its size: a
#: Python agent may store values up to cache.max_value_size).
MAX_PAGE_BYTES = 4 << 20
#: The longest a kv_watch call waits, in seconds.
MAX_WATCH_S = 60.0
#: The longest ttl of kv_announce, in seconds (an announcement is renewed by calling again).
MAX_ANNOUNCE_TTL_S = 3600.0
#: Prefixes a cluster-mode server keeps registered with its node daemon for kv_watch.
MAX_WATCHED_PREFIXES = 64

_FLOATS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class ToolRefused(Exception):
    """A call the server refuses (bad argument, outside the allow-list, too large, a
    KVCOMM error): an error result whose message tells the model what to do."""


# ------------------------------------------------------------------ values


def value_from_json(v: Any) -> Any:
    """A JSON value as KVCOMM stores it (the ``$bytes`` / ``$float`` forms decoded).
    Raises ToolRefused."""
    t = type(v)
    if t is dict:
        if len(v) == 1:
            (k, x), = v.items()
            if k == "$bytes":
                if type(x) is not str:
                    raise ToolRefused('{"$bytes": ...} holds a base64 string')
                try:
                    return base64.b64decode(x, validate=True)
                except (binascii.Error, ValueError):
                    raise ToolRefused('{"$bytes": ...} holds a string that is not valid base64') from None
            if k == "$float":
                if type(x) is not str or x not in _FLOATS:
                    raise ToolRefused('{"$float": ...} holds "NaN", "Infinity" or "-Infinity"')
                return _FLOATS[x]
        return {k: value_from_json(x) for k, x in v.items()}
    if t is list:
        return [value_from_json(x) for x in v]
    return v


def value_to_json(v: Any) -> Any:
    """A stored value in the JSON form of the module docstring's rule."""
    t = type(v)
    if t is bytes:
        return {"$bytes": base64.b64encode(v).decode("ascii")}
    if t is float and not math.isfinite(v):
        return {"$float": "NaN" if v != v else ("Infinity" if v > 0 else "-Infinity")}
    if t is dict:
        if not all(type(k) is str for k in v):
            return {"$unsupported": "a dict with keys that are not str"}
        return {k: value_to_json(x) for k, x in v.items()}
    if t is list or t is tuple:
        return [value_to_json(x) for x in v]
    if v is None or t in (str, int, bool, float):
        return v
    shape = getattr(v, "shape", None)
    what = f"{type(v).__module__}.{type(v).__name__}" + (f" of shape {list(shape)}" if shape else "")
    return {"$unsupported": what}


def _json_size(v: Any) -> int:
    """The size of ``v`` as JSON text (bytes as their base64), without building it whole
    for the common small case."""
    try:
        return len(json.dumps(value_to_json(v), separators=(",", ":"), allow_nan=False))
    except (TypeError, ValueError):
        return 0


# ------------------------------------------------------------------ versions, cursors


def version_str(v: Version | None) -> str | None:
    """An opaque string naming version ``v`` (``"v1."`` + URL-safe base64)."""
    if v is None:
        return None
    raw = encode_vector(v.vector, v.hlc)
    return "v1." + base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def version_of(s: Any) -> Version:
    """The Version a :func:`version_str` string names. Raises ToolRefused."""
    if type(s) is not str or not s.startswith("v1."):
        raise ToolRefused(f"expect_version takes a version string a tool returned (\"v1....\") "
                          f"or \"absent\", got {s!r}")
    body = s[3:]
    try:
        vector, hlc = decode_vector(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    except (binascii.Error, ValueError):
        raise ToolRefused(f"expect_version {s!r} is not a version this server gave out: pass "
                          "the version kv_get or kv_put returned") from None
    return Version(vector, hlc)


def _cursor_of(s: str) -> int:
    if (not s.startswith("f") or not s[1:].isascii() or not s[1:].isdigit()
            or len(s) > 21):
        raise ToolRefused(f"cursor {s!r} is not a watch cursor this server gave out: pass the "
                          "cursor of the previous kv_watch, or none to start from now")
    return int(s[1:])


class Watch:
    """A kv_watch call in progress (see :meth:`KVTools.watch_start`)."""

    __slots__ = ("prefix", "sub", "at", "deadline", "overflow", "idle")

    def __init__(self, prefix: str, sub: Any, at: int, deadline: float) -> None:
        self.prefix, self.sub, self.at, self.deadline = prefix, sub, at, deadline
        self.overflow = False
        self.idle = 0.0001


class KVTools:
    """The tools over ``kv`` (a :class:`kvcomm.Client`), under the allow-list ``prefixes``
    (empty: every key) and, with ``read_only``, reads only. Thread-safe as the client is:
    the server may run calls in worker threads."""

    READ_TOOLS = ("kv_get", "kv_scan", "kv_watch", "kv_present")
    WRITE_TOOLS = ("kv_put", "kv_delete", "kv_incr", "kv_announce")

    def __init__(self, kv: Any, prefixes: list[str] | tuple[str, ...] = (),
                 read_only: bool = False) -> None:
        self.kv = kv
        self.prefixes = tuple(prefixes)
        self.read_only = read_only
        self._subs: OrderedDict[str, Any] = OrderedDict()  # cluster mode: watched prefixes
        self._subs_lock = threading.Lock()  # (watches run in several worker threads)

    # -------------------------------------------------------------- checks

    def _key(self, key: Any) -> str:
        if type(key) is not str or not key:
            raise ToolRefused(f"key must be a non-empty string, got {key!r}")
        return self._inside("key", key)

    def _prefix(self, prefix: Any) -> str:
        if type(prefix) is not str:
            raise ToolRefused(f"prefix must be a string ('' means every key), got {prefix!r}")
        return self._inside("prefix", prefix)

    def _inside(self, what: str, s: str) -> str:
        """``s`` (a key or a prefix) when it lies inside the allow-list; else ToolRefused."""
        if self.prefixes and not s.startswith(self.prefixes):
            raise ToolRefused(f"{what} {s!r} is outside what this server serves: it must start "
                              f"with one of {list(self.prefixes)}")
        return s

    def _writable(self, tool: str) -> None:
        if self.read_only:
            raise ToolRefused(f"{tool}: this server is read-only (--read-only)")

    @staticmethod
    def _expect(expect_version: Any) -> Any:
        if expect_version is None:
            from .._client.items import _NO_CHECK

            return _NO_CHECK
        if expect_version == "absent":
            from .._client.items import ABSENT

            return ABSENT
        return version_of(expect_version)

    def _conflict(self, key: str, exc: ConflictError) -> dict[str, Any]:
        item = self.kv.get_item(key)
        return {"ok": False, "conflict": str(exc),
                "current_version": None if item is None else version_str(item.version)}

    # -------------------------------------------------------------- tools

    def kv_get(self, key: str) -> dict[str, Any]:
        item = self.kv.get_item(self._key(key))
        if item is None:
            return {"found": False, "value": None, "version": None, "expires_at": None}
        return {"found": True, "value": value_to_json(item.value),
                "version": version_str(item.version), "expires_at": item.expires_at}

    def kv_put(self, key: str, value: Any, ttl: float | None = None,
               expect_version: str | None = None) -> dict[str, Any]:
        self._writable("kv_put")
        key = self._key(key)
        stored = value_from_json(value)
        size = _json_size(stored)
        if size > MAX_VALUE_BYTES:
            raise ToolRefused(f"the value is {size} bytes as JSON, over this server's bound of "
                              f"{MAX_VALUE_BYTES} bytes: store it in smaller pieces under "
                              "several keys")
        expect = self._expect(expect_version)
        try:
            version = self.kv.put(key, stored, ttl=ttl, expect=expect)
        except ConflictError as exc:
            return self._conflict(key, exc)
        return {"ok": True, "version": version_str(version)}

    def kv_delete(self, key: str, expect_version: str | None = None) -> dict[str, Any]:
        self._writable("kv_delete")
        key = self._key(key)
        expect = self._expect(expect_version)
        try:
            deleted = self.kv.delete(key, expect=expect)
        except ConflictError as exc:
            return self._conflict(key, exc)
        return {"ok": True, "deleted": deleted}

    def kv_scan(self, prefix: str, limit: int = 100, after: str | None = None) -> dict[str, Any]:
        prefix = self._prefix(prefix)
        if type(limit) is not int or limit < 1:
            raise ToolRefused(f"limit must be an integer of at least 1, got {limit!r}")
        limit = min(limit, MAX_PAGE)
        if after is not None and type(after) is not str:
            raise ToolRefused(f"after must be a key string (the previous page's cursor), got {after!r}")
        out: list[dict[str, Any]] = []
        size = 0
        more = False
        for i in self.kv.scan(prefix, limit=limit + 1, after=after or None):
            value = value_to_json(i.value)
            n = len(json.dumps(value, separators=(",", ":"))) + len(i.key)
            if len(out) == limit or (out and size + n > MAX_PAGE_BYTES):
                more = True  # (a page of at most limit items and MAX_PAGE_BYTES, one at least)
                break
            size += n
            out.append({"key": i.key, "value": value, "version": version_str(i.version),
                        "expires_at": i.expires_at})
        return {"items": out, "cursor": out[-1]["key"] if more else None}

    def kv_watch(self, prefix: str, timeout: float = 10.0,
                 cursor: str | None = None) -> dict[str, Any]:
        w = self.watch_start(prefix, timeout, cursor)
        while True:
            step = self.watch_step(w)
            if isinstance(step, dict):
                return step
            time.sleep(step)

    def watch_start(self, prefix: str, timeout: float = 10.0,
                    cursor: str | None = None) -> Watch:
        """A kv_watch call's state (arguments checked; in cluster mode the prefix
        registered, which may wait for the node daemon): :meth:`watch_step` polls it."""
        prefix = self._prefix(prefix)
        if type(timeout) not in (int, float) or not 0 <= timeout <= MAX_WATCH_S:
            raise ToolRefused(f"timeout is a number of seconds from 0 to {MAX_WATCH_S:g}, got {timeout!r}")
        kv = self.kv
        kv._live()
        sub = self._subscription(prefix) if kv._cluster else None
        at = kv._seg.feed_head() if cursor is None else _cursor_of(cursor)
        return Watch(prefix, sub, at, time.monotonic() + timeout)

    def watch_step(self, w: Watch) -> dict[str, Any] | float:
        """One look at the feed (never waits): kv_watch's result when there are changes,
        an overflow or the deadline passed; else the seconds to wait before the next look
        (0: read on at once)."""
        kv = self.kv
        kv._live()
        if kv._seg.purged:
            raise ToolRefused(f"namespace {kv.name!r} was purged while watched: nothing will "
                              "change in it; restart this server (kvcomm mcp) to serve the "
                              "namespace anew")
        events, w.at, overflowed = kv._feed_events(w.prefix, w.at, MAX_PAGE)
        w.overflow = w.overflow or overflowed
        out = [{"key": e.key, "kind": e.kind, "version": version_str(e.version)}
               for e in events]
        if w.sub is not None:
            for e in kv._cluster_events(w.sub):
                if e.kind == "overflow":
                    w.overflow = True
                else:
                    out.append({"key": e.key, "kind": e.kind, "version": version_str(e.version)})
        if out or w.overflow or time.monotonic() >= w.deadline:
            return {"events": out, "cursor": f"f{w.at}", "overflow": w.overflow}
        if w.at < kv._seg.feed_head():
            return 0.0  # (a page of other prefixes' changes: read on at once)
        idle = w.idle
        w.idle = min(idle * 2, 0.005)
        return min(idle, max(0.0, w.deadline - time.monotonic()))

    def _subscription(self, prefix: str) -> Any:
        """Cluster mode: ``prefix`` registered with the host's node daemon (so that other
        hosts' changes under it reach this host's feed), kept while the server runs; the
        least recently watched of more than MAX_WATCHED_PREFIXES is dropped."""
        with self._subs_lock:
            sub = self._subs.get(prefix)
            if sub is None:
                sub = self.kv._subscribe(prefix)
                self._subs[prefix] = sub
                while len(self._subs) > MAX_WATCHED_PREFIXES:
                    self._subs.popitem(last=False)[1].close()
            self._subs.move_to_end(prefix)
            return sub

    def kv_incr(self, key: str, delta: int = 1) -> dict[str, Any]:
        self._writable("kv_incr")
        key = self._key(key)
        if type(delta) is not int:
            raise ToolRefused(f"delta must be an integer, got {delta!r}")
        return {"value": self.kv.incr(key, delta)}

    def kv_present(self, prefix: str) -> dict[str, Any]:
        prefix = self._prefix(prefix)
        return {"agents": self.kv.present(prefix)}

    def kv_announce(self, prefix: str, agent_id: str, ttl: float) -> dict[str, Any]:
        self._writable("kv_announce")
        if type(agent_id) is not str or not agent_id:
            raise ToolRefused(f"agent_id must be a non-empty string, got {agent_id!r}")
        key = self._key(self._prefix(prefix) + agent_id)
        if type(ttl) not in (int, float) or not 0.03 <= ttl <= MAX_ANNOUNCE_TTL_S:
            raise ToolRefused(f"ttl is a number of seconds from 0.03 to {MAX_ANNOUNCE_TTL_S:g}, "
                              f"got {ttl!r}")
        self.kv.put(key, b"", ttl=ttl)
        return {"key": key, "expires_at": time.time() + ttl}

    def close(self) -> None:
        """Drop the watched prefixes' registrations (cluster mode)."""
        with self._subs_lock:
            while self._subs:
                self._subs.popitem()[1].close()


def call(tools: KVTools, name: str, args: dict[str, Any]) -> dict[str, Any]:
    """``tools.<name>(**args)``, with every KVCOMM error as a ToolRefused whose message names
    the error (the server turns it into an error result)."""
    try:
        return getattr(tools, name)(**args)  # type: ignore[no-any-return]
    except KVCommError as exc:
        raise ToolRefused(f"{type(exc).__name__}: {exc}") from None
    except RecursionError:  # (a JSON value nested thousands deep)
        raise ToolRefused("the value nests too deeply: flatten it") from None
