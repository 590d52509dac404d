"""``kvcomm mcp`` on stdio: the SDK's transport, and an answer to every request line it
refuses.

The SDK's stdio reader passes a line it cannot read as a JSON-RPC message on as an
exception, which its session drops: the client's call then waits forever. Two kinds:

- lines its JSON parser refuses (arrays or objects nested 200 levels deep or more, a lone
  surrogate escape such as ``"\\ud800"``, an integer of thousands of digits): answered
  with -32700 (parse error);
- JSON that is not a JSON-RPC 2.0 message (no ``"jsonrpc": "2.0"``, a ``method`` that
  is not a string, ``params`` that are not an object): answered with -32600 (invalid
  request).

Either is answered when the line is an object with a ``method`` and an int or str ``id``
(read by :func:`request_head`, which skips nested values without recursing: a line
nested a million deep is read in one pass); other lines (not an object, a notification,
a response) stay unanswered, as JSON-RPC has it.
"""

from __future__ import annotations

import re
from json.decoder import scanstring  # type: ignore[attr-defined]  # (the C scanner)
from typing import Any

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_INT = re.compile(r"-?(?:0|[1-9][0-9]*)")
_BRACKET_OR_QUOTE = re.compile(r'["{}\[\]]')
_SPACE = re.compile(r"[ \t\n\r]*")
_NO_ID: Any = object()


async def run_stdio(server: Any) -> None:
    """``server.run_stdio_async()`` (an MCPServer's), with the refused lines answered.
    The messages reach the server through a plain memory stream: the sender's context
    (the SDK's ``last_context``) is not carried, which on stdio holds nothing."""
    import anyio
    from mcp.server.stdio import stdio_server

    low = server._lowlevel_server  # (MCPServer.run_stdio_async runs this one too)
    async with stdio_server() as (read_stream, write_stream):
        forward, received = anyio.create_memory_object_stream[Any](0)

        async def answer_refused() -> None:
            async with forward:
                async for item in read_stream:
                    reply = refusal_reply(item) if isinstance(item, Exception) else None
                    if reply is None:
                        await forward.send(item)
                    else:
                        await write_stream.send(reply)

        async with anyio.create_task_group() as tg:
            tg.start_soon(answer_refused)
            await low.run(received, write_stream, low.create_initialization_options())
            tg.cancel_scope.cancel()


def refusal_reply(exc: Exception) -> Any:
    """The SessionMessage answering the line the SDK's reader refused with ``exc`` (a
    pydantic ValidationError, which carries the line or the object read from it), or None
    when there is no request id to answer."""
    from mcp import types
    from mcp.shared.message import SessionMessage
    from pydantic import ValidationError

    if not isinstance(exc, ValidationError):
        return None
    errors = exc.errors()
    if not errors:
        return None
    first = errors[0]
    if first.get("type") == "json_invalid":
        line = first.get("input")
        head = request_head(line) if isinstance(line, str) else None
        code, message = types.PARSE_ERROR, (
            f"the request is not JSON the MCP SDK reads ({str(first.get('msg'))[:200]}); it "
            "refuses, among others, arrays or objects nested 200 levels deep or more and lone "
            "surrogate escapes (such as \"\\ud800\"): send the value flatter, or as "
            "{\"$bytes\": base64}")
    else:  # (JSON, but no JSON-RPC message: the object is the input of its top-level errors)
        top = next((e["input"] for e in errors if len(e.get("loc", ())) <= 2
                    and isinstance(e.get("input"), dict)), None)
        head = None if top is None else (top.get("id", _NO_ID), "method" in top)
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or "the message"
        code, message = types.INVALID_REQUEST, (
            f"the request is not a JSON-RPC 2.0 request ({where}: {first.get('msg')}): it needs "
            "\"jsonrpc\": \"2.0\", an int or str \"id\", a str \"method\" and, if any, "
            "object \"params\"")
    if head is None or not head[1] or type(head[0]) not in (int, str):
        return None
    rid = head[0]
    if type(rid) is str and not rid.isascii():
        try:
            rid.encode("utf-8")
        except UnicodeEncodeError:  # (a lone surrogate: no id can be written back)
            rid = None
    return SessionMessage(types.JSONRPCError(jsonrpc="2.0", id=rid, error=types.ErrorData(
        code=code, message=message)))


def request_head(line: str) -> tuple[Any, bool] | None:
    """``(id, has_method)`` of the JSON object ``line``, read from its top-level keys only
    (nested values are skipped, bracket by bracket, never recursed into); the last of
    duplicate keys wins, as ``json.loads``. The id as ``json.loads`` reads it when it is a
    str or an int (a number of over 4300 digits, or any other value: ``_NO_ID``). None when
    ``line`` is not an object it can read (it is lenient: this only finds what to answer)."""
    end = len(line)
    i = _SPACE.match(line, 0).end()  # type: ignore[union-attr]
    if i >= end or line[i] != "{":
        return None
    rid: Any = _NO_ID
    has_method = False
    i += 1
    try:
        while True:
            i = _SPACE.match(line, i).end()  # type: ignore[union-attr]
            if i < end and line[i] == "}":
                return rid, has_method
            if i >= end or line[i] != '"':
                return None
            key, i = scanstring(line, i + 1)
            i = _SPACE.match(line, i).end()  # type: ignore[union-attr]
            if i >= end or line[i] != ":":
                return None
            start = _SPACE.match(line, i + 1).end()  # type: ignore[union-attr]
            i = _skip_value(line, start)
            if i < 0:
                return None
            if key == "id":
                rid = _id_value(line[start:i])
            elif key == "method":
                has_method = True
            i = _SPACE.match(line, i).end()  # type: ignore[union-attr]
            if i < end and line[i] == ",":
                i += 1
    except ValueError:  # (a string scanstring cannot read)
        return None


def _skip_value(line: str, i: int) -> int:
    """The index just past the JSON value at ``i``; -1 when there is none to read."""
    if i >= len(line):
        return -1
    c = line[i]
    if c == '"':
        return int(scanstring(line, i + 1)[1])
    if c in "{[":
        depth = 0
        while True:
            m = _BRACKET_OR_QUOTE.search(line, i)
            if m is None:
                return -1
            i = m.start()
            c = line[i]
            if c == '"':
                i = scanstring(line, i + 1)[1]
                continue
            depth += 1 if c in "{[" else -1
            i += 1
            if depth == 0:
                return i
    for literal in ("true", "false", "null", "NaN", "Infinity", "-Infinity"):  # (as json's)
        if line.startswith(literal, i):
            return i + len(literal)
    m = _NUMBER.match(line, i)
    return -1 if m is None else m.end()


def _id_value(text: str) -> Any:
    if text.startswith('"'):
        return scanstring(text, 1)[0]
    if _INT.fullmatch(text):
        try:
            return int(text)
        except ValueError:  # (over Python's 4300 digits)
            return _NO_ID
    return _NO_ID
