"""``kvcomm mcp``: the tools of :mod:`kvcomm.mcp.tools` served over MCP (the official
Python SDK, ``mcp`` 2.x: ``pip install 'kvcomm[mcp]'``), on stdio or streamable HTTP.

In cluster mode every call runs in a worker thread (an L2 miss reaches Redis), so the event
loop keeps serving other requests; in the embedded mode get/put/scan are L1/L2 operations
of microseconds and run inline. A ``kv_watch`` holds no thread while it waits: it looks at
the feed (a step of microseconds, in a worker thread in cluster mode) and sleeps on the
event loop between looks, so any number of pending watches (up to :data:`MAX_WATCHES`)
never holds up another call or another watch.

Nothing but protocol messages goes to stdout: logs (the SDK's, uvicorn's, ours) go to
stderr.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from pydantic import Field

from .tools import MAX_ANNOUNCE_TTL_S, MAX_PAGE, MAX_VALUE_BYTES, MAX_WATCH_S, KVTools, ToolRefused, call

log = logging.getLogger("kvcomm.mcp")

#: kv_watch calls pending at once (beyond: refused, the message says to retry).
MAX_WATCHES = 1024
#: Pending watches that look at the feed at full rate (at most every 5 ms); beyond, each
#: looks proportionally less often, so that the looks stay bounded.
_FULL_RATE_WATCHES = 32

INSTRUCTIONS = (
    "KVCOMM: a key-value namespace shared with other agents (Python processes on this host, "
    "and every host of the cluster in cluster mode). Keys are strings such as 'tasks/42'; "
    "values are JSON (bytes as {\"$bytes\": base64}, NaN/Infinity as {\"$float\": \"NaN\"}). "
    "Read with kv_get and kv_scan; write with kv_put (expect_version for compare-and-set), "
    "kv_delete, kv_incr (counters); wait for other agents' changes with kv_watch, passing back "
    "the cursor it returned to resume without missing any; see who is alive with kv_present "
    "and announce yourself with kv_announce."
)


# the arguments' types and descriptions (their JSON schema is what the model reads)
Key = Annotated[str, Field(description="the key, a string such as 'tasks/42'")]
Prefix = Annotated[str, Field(description="a key prefix such as 'tasks/' ('' is every key "
                                          "when the server is not limited to prefixes)")]
VersionArg = Annotated[str | None, Field(
    description="compare-and-set: a version string from kv_get/kv_put (the write happens "
                "only if the key is still at that version), or \"absent\" (only if the key "
                "does not exist); omit to write unconditionally")]



def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token(path: str) -> str:
    """The bearer token in file ``path`` (surrounding whitespace stripped). Raises
    ConfigError when it cannot be read or is empty."""
    from ..errors import ConfigError

    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("", f"cannot read the token file {path!r} ({exc}); write the bearer "
                              "token clients must send into it") from None
    if not token:
        raise ConfigError("", f"the token file {path!r} is empty; write the bearer token "
                              "clients must send into it")
    return token


class BearerAuth:
    """ASGI middleware: every HTTP request must carry ``Authorization: Bearer <token>``;
    anything else gets 401 and never reaches the MCP app."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            got = dict(scope.get("headers") or ()).get(b"authorization", b"")
            if not hmac.compare_digest(got, self._expected):
                body = b'{"error": "unauthorized: send Authorization: Bearer <token>"}'
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"www-authenticate", b"Bearer"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def build_server(tools: KVTools, *, threaded: bool) -> Any:
    """The MCPServer with the tools (write tools left out when ``tools.read_only``).
    ``threaded``: run every call in a worker thread (cluster mode)."""
    import anyio
    import anyio.to_thread
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    server = MCPServer("kvcomm", instructions=INSTRUCTIONS, log_level="WARNING")
    pending = [0]  # kv_watch calls in progress (the event loop's thread only)

    async def run(name: str, args: dict[str, Any], thread: bool) -> Any:
        try:
            if thread:
                return await anyio.to_thread.run_sync(call, tools, name, args)
            return call(tools, name, args)
        except ToolRefused as exc:
            raise ToolError(str(exc)) from None

    async def result(name: str, args: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = await run(name, args, threaded)  # (a tool's result: a dict)
        return out

    def add(fn: Callable[..., Awaitable[dict[str, Any]]], description: str, write: bool) -> None:
        if write and tools.read_only:
            return  # (--read-only: write tools are not listed at all)
        server.add_tool(fn, name=fn.__name__, description=description)

    async def kv_get(key: Key) -> dict[str, Any]:
        return await result("kv_get", {"key": key})

    async def kv_put(key: Key,
                     value: Annotated[Any, Field(description="any JSON value; bytes as "
                                                 "{\"$bytes\": \"<base64>\"}")],
                     ttl: Annotated[float | None, Field(
                         description="seconds until the key expires (omit: never)")] = None,
                     expect_version: VersionArg = None) -> dict[str, Any]:
        return await result("kv_put", {"key": key, "value": value, "ttl": ttl,
                                       "expect_version": expect_version})

    async def kv_delete(key: Key, expect_version: VersionArg = None) -> dict[str, Any]:
        return await result("kv_delete", {"key": key, "expect_version": expect_version})

    async def kv_scan(prefix: Prefix,
                      limit: Annotated[int, Field(description=f"items per page, at most {MAX_PAGE}")] = 100,
                      after: Annotated[str | None, Field(
                          description="the cursor of the previous page (omit for the first)")] = None
                      ) -> dict[str, Any]:
        return await result("kv_scan", {"prefix": prefix, "limit": limit, "after": after})

    async def kv_watch(prefix: Prefix,
                       timeout: Annotated[float, Field(
                           description=f"seconds to wait for a change, 0 to {MAX_WATCH_S:g}")] = 10.0,
                       cursor: Annotated[str | None, Field(
                           description="the cursor a previous kv_watch returned: the changes since "
                                       "then (none missed); omit to wait for changes from now")] = None
                       ) -> dict[str, Any]:
        if pending[0] >= MAX_WATCHES:
            raise ToolError(f"{MAX_WATCHES} kv_watch calls are already waiting on this server: "
                            "retry in a few seconds, or watch one wider prefix instead of many")
        pending[0] += 1
        try:
            w = await run("watch_start", {"prefix": prefix, "timeout": timeout, "cursor": cursor},
                          threaded)
            while True:
                step = await run("watch_step", {"w": w}, threaded)
                if isinstance(step, dict):
                    return step
                # (many pending watches: each looks less often, the looks stay bounded)
                await anyio.sleep(step * max(1.0, pending[0] / _FULL_RATE_WATCHES))
        finally:
            pending[0] -= 1

    async def kv_incr(key: Key, delta: Annotated[int, Field(
            description="the amount to add (negative subtracts)")] = 1) -> dict[str, Any]:
        return await result("kv_incr", {"key": key, "delta": delta})

    async def kv_present(prefix: Prefix) -> dict[str, Any]:
        return await result("kv_present", {"prefix": prefix})

    async def kv_announce(prefix: Prefix,
                          agent_id: Annotated[str, Field(description="your agent id, e.g. 'planner'")],
                          ttl: Annotated[float, Field(
                              description=f"seconds the announcement lasts (0.03 to "
                                          f"{MAX_ANNOUNCE_TTL_S:g}); announce again before it ends "
                                          "to stay present")]) -> dict[str, Any]:
        return await result("kv_announce", {"prefix": prefix, "agent_id": agent_id, "ttl": ttl})

    add(kv_get, "Read one key. Returns {found, value, version, expires_at}: value is the JSON "
        "value (null when not found), version an opaque string to pass as expect_version, "
        "expires_at epoch seconds or null.", False)
    add(kv_put, "Store a JSON value under a key, shared at once with every agent of the "
        f"namespace. Values up to {MAX_VALUE_BYTES} bytes as JSON. Returns {{ok: true, version}}; "
        "with expect_version, a key that changed meanwhile is not written and the result is "
        "{ok: false, conflict, current_version}: re-read it and retry.", True)
    add(kv_delete, "Delete a key. Returns {ok: true, deleted} (deleted: whether it existed); "
        "with expect_version, {ok: false, conflict, current_version} when the key changed.", True)
    add(kv_scan, "List the keys under a prefix with their values, in key order, a page at a "
        f"time (limit at most {MAX_PAGE}). Returns {{items: [{{key, value, version, "
        "expires_at}], cursor}: pass cursor as `after` for the next page; cursor null: "
        "no more.", False)
    add(kv_watch, "Wait for changes under a prefix made by any agent. Returns {events: [{key, "
        "kind (put|delete|expire|evict), version}], cursor, overflow} as soon as there are "
        "changes, or empty events after `timeout` seconds. Pass the returned cursor to the next "
        "call to get every change since (none missed). overflow true: changes were missed (too "
        "many too fast): re-read what you track with kv_scan. Use kv_get to read a changed "
        "value.", False)
    add(kv_incr, "Add delta to an integer counter (absent: starts at 0); every agent's "
        "increments are counted exactly once. Returns {value}: the new value.", True)
    add(kv_present, "The agent ids announced under a prefix whose announcement has not expired "
        "(kv_announce, or Python agents' kv.presence). Returns {agents}.", False)
    add(kv_announce, "Announce that agent_id is alive under prefix for ttl seconds (the key "
        "prefix+agent_id); call again before it ends to stay present. Returns {key, "
        "expires_at}.", True)
    return server


def serve(kv: Any, *, prefixes: list[str], read_only: bool, transport: str, host: str,
          port: int, token: str | None) -> int:
    """Serve until the client closes stdio (stdio) or SIGINT/SIGTERM (http)."""
    import anyio

    tools = KVTools(kv, prefixes, read_only)
    server = build_server(tools, threaded=bool(kv._cluster))
    try:
        if transport == "stdio":
            from .stdio import run_stdio

            anyio.run(run_stdio, server)
            return 0
        import uvicorn
        from mcp.server.transport_security import TransportSecuritySettings

        if _loopback(host):
            # DNS-rebinding protection on every loopback address (the SDK turns it on by
            # itself only for 127.0.0.1, localhost and ::1): a web page must not reach a
            # server bound to 127.0.0.2 either
            named = [f"[{host}]" if ":" in host else host, "127.0.0.1", "localhost", "[::1]"]
            security = TransportSecuritySettings(
                enable_dns_rebinding_protection=True,
                allowed_hosts=[f"{h}:*" for h in named],
                allowed_origins=[f"http://{h}:*" for h in named])
        else:
            # (bound beyond loopback, clients name the host as they reach it: the token,
            # not the Host header, is what keeps strangers out)
            security = TransportSecuritySettings(enable_dns_rebinding_protection=False)
        app = server.streamable_http_app(host=host, transport_security=security)
        asgi: Any = BearerAuth(app, token) if token is not None else app
        config = uvicorn.Config(asgi, host=host, port=port, log_level="warning",
                                lifespan="on", access_log=False)
        print(f"kvcomm mcp: serving namespace {kv.name!r} over streamable HTTP at "
              f"http://{host}:{port}/mcp" + (" (bearer token required)" if token else ""),
              file=sys.stderr, flush=True)
        uvicorn.Server(config).run()
        return 0
    finally:
        tools.close()


def check_http_binding(host: str, token_file: str | None) -> str | None:
    """The bearer token to require, read from ``token_file``; refuses (ConfigError) an
    address beyond loopback without one."""
    from ..errors import ConfigError

    if token_file is None:
        if not _loopback(host):
            raise ConfigError("", f"refusing to serve MCP over HTTP on {host!r} without a bearer "
                                  "token: anyone who reaches that address could read and write "
                                  "the namespace. Pass --token-file FILE (a file holding the "
                                  "token clients send as 'Authorization: Bearer <token>'), or "
                                  "bind loopback (--host 127.0.0.1)")
        return None
    return read_token(token_file)
