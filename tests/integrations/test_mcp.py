"""``kvcomm mcp``: the MCP server driven by the official SDK's own client, over stdio and
over streamable HTTP, each against a real ``kvcomm mcp`` subprocess: every tool, the
prefix allow-list and --read-only, the bearer token, bad calls (error results, the server
keeps serving), two servers incrementing one counter at once, a watch that returns another
process's put and resumes at its cursor, and the namespace shared with Python agents."""

from __future__ import annotations

import base64
import json
import math
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

import kvcomm
from kvcomm._extras import install_hint
from kvcomm.devcluster.redis_server import free_port
from tests.support import ROOT
from tests.support.helpers import SMALL, wait_for

mcp = pytest.importorskip("mcp")
anyio = pytest.importorskip("anyio")

from mcp.client.session import ClientSession  # noqa: E402
from mcp.client.stdio import StdioServerParameters, stdio_client  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402
from mcp.shared._httpx_utils import create_mcp_http_client  # noqa: E402

TOOLS = {"kv_get", "kv_put", "kv_delete", "kv_scan", "kv_watch", "kv_incr", "kv_present",
         "kv_announce"}


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvcomm", "mcp", *args]


class Conn:
    """An SDK client session on a server, with the two ways a call ends."""

    def __init__(self, session: ClientSession) -> None:
        self.s = session

    async def ok(self, tool: str, **args: Any) -> dict[str, Any]:
        r = await self.s.call_tool(tool, args)
        assert not r.is_error, f"{tool}{args}: {r.content[0].text}"  # type: ignore[union-attr]
        assert r.structured_content is not None
        # (the text content says the same, for clients that read only text)
        assert json.loads(r.content[0].text) == r.structured_content  # type: ignore[union-attr]
        return r.structured_content

    async def err(self, tool: str, **args: Any) -> str:
        r = await self.s.call_tool(tool, args)
        assert r.is_error, f"{tool}{args} succeeded: {r.structured_content}"
        return r.content[0].text  # type: ignore[union-attr,no-any-return]


@asynccontextmanager
async def stdio(*args: str) -> AsyncIterator[Conn]:
    params = StdioServerParameters(command=sys.executable, args=_cmd(*args)[1:])
    async with stdio_client(params) as (r, w), ClientSession(r, w) as s:
        await s.initialize()
        yield Conn(s)


@asynccontextmanager
async def http(url: str, token: str | None = None) -> AsyncIterator[Conn]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else None
    async with create_mcp_http_client(headers=headers) as client, \
            streamable_http_client(url, http_client=client) as (r, w), ClientSession(r, w) as s:
        await s.initialize()
        yield Conn(s)



def _wait_listening(p: subprocess.Popen[bytes], host: str, port: int) -> None:
    """Until ``kvcomm mcp --transport http`` (process ``p``) accepts connections."""

    def listening() -> bool:
        assert p.poll() is None, p.communicate()
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return True
        except OSError:
            return False

    wait_for(listening, 30, "the HTTP server listening")


@pytest.fixture
def http_server(ns: str, kv: kvcomm.Client, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """``kvcomm mcp --transport http`` on a free loopback port with a token file, serving
    the namespace ``kv`` opened: (its URL, the token)."""
    token = "s3cret-" + ns
    (tmp_path / "token").write_text(token + "\n")
    port = free_port()
    p = subprocess.Popen(_cmd("--name", ns, "--transport", "http", "--port", str(port),
                              "--token-file", str(tmp_path / "token")),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    try:
        _wait_listening(p, "127.0.0.1", port)
        yield f"http://127.0.0.1:{port}/mcp", token
    finally:
        p.terminate()
        out, _ = p.communicate(timeout=30)
        assert out == b""  # (nothing on stdout, whatever the transport)


def _run(fn: Any) -> None:
    anyio.run(fn)


def test_every_tool_over_stdio_shares_the_namespace_with_python(ns: str,
                                                                 kv: kvcomm.Client) -> None:
    async def main() -> None:
        async with stdio("--name", ns) as c:
            listed = (await c.s.list_tools()).tools
            assert {t.name for t in listed} == TOOLS
            for t in listed:  # (what a model reads: a description and an input schema)
                assert len(t.description or "") > 40 and t.input_schema["type"] == "object"
            put = next(t for t in listed if t.name == "kv_put").input_schema
            assert set(put["required"]) == {"key", "value"}

            # an MCP put, a Python read, and the other way round; bytes and NaN by the rule
            value = {"title": "fix bug", "n": [1, 2.5, None, True],
                     "blob": {"$bytes": base64.b64encode(b"\x00\xff").decode()},
                     "nan": {"$float": "NaN"}}
            v1 = (await c.ok("kv_put", key="tasks/1", value=value))["version"]
            got = kv.get("tasks/1")
            assert got["blob"] == b"\x00\xff" and math.isnan(got["nan"])
            assert got["n"] == [1, 2.5, None, True] and got["title"] == "fix bug"
            kv.put("tasks/2", {"by": "python", "raw": b"hi", "inf": -math.inf})
            r = await c.ok("kv_get", key="tasks/2")
            assert r["found"] and r["value"] == {"by": "python", "raw": {"$bytes": "aGk="},
                                                 "inf": {"$float": "-Infinity"}}
            assert r["expires_at"] is None and r["version"] != v1
            assert (await c.ok("kv_get", key="tasks/none")) == {
                "found": False, "value": None, "version": None, "expires_at": None}

            # compare-and-set: a version string or "absent"; a failure is a result
            r = await c.ok("kv_put", key="tasks/1", value=1, expect_version="absent")
            assert r["ok"] is False and "exists" in r["conflict"] and r["current_version"] == v1
            v2 = (await c.ok("kv_put", key="tasks/1", value=2, expect_version=v1))["version"]
            r = await c.ok("kv_put", key="tasks/1", value=3, expect_version=v1)
            assert r["ok"] is False and r["current_version"] == v2
            assert kv.get("tasks/1") == 2
            assert (await c.ok("kv_put", key="tasks/new", value="x",
                               expect_version="absent"))["ok"] is True
            r = await c.ok("kv_delete", key="tasks/1", expect_version=v1)
            assert r["ok"] is False and kv.get("tasks/1") == 2
            assert await c.ok("kv_delete", key="tasks/1", expect_version=v2) == {
                "ok": True, "deleted": True}
            assert kv.get("tasks/1") is None
            assert (await c.ok("kv_delete", key="tasks/1"))["deleted"] is False

            # ttl
            r = await c.ok("kv_put", key="tasks/ttl", value="soon", ttl=30)
            item = kv.get_item("tasks/ttl")
            assert item is not None and item.expires_at is not None
            got_ttl = await c.ok("kv_get", key="tasks/ttl")
            assert got_ttl["expires_at"] == pytest.approx(item.expires_at)

            # scan: pages and their cursor; the limit is capped at 1000
            for i in range(5):
                kv.put(f"page/{i}", i)
            first = await c.ok("kv_scan", prefix="page/", limit=2)
            assert [i["key"] for i in first["items"]] == ["page/0", "page/1"]
            rest = await c.ok("kv_scan", prefix="page/", limit=10, after=first["cursor"])
            assert [i["value"] for i in rest["items"]] == [2, 3, 4] and rest["cursor"] is None
            for i in range(1001):
                kv.put(f"many/{i:05d}", i)
            big = await c.ok("kv_scan", prefix="many/", limit=5000)
            assert len(big["items"]) == 1000 and big["cursor"] == "many/00999"

            # incr, Python and MCP on one counter
            assert await c.ok("kv_incr", key="count") == {"value": 1}
            kv.incr("count", 10)
            assert await c.ok("kv_incr", key="count", delta=-2) == {"value": 9}
            assert kv.get("count") == 9

            # presence: an MCP agent and a Python agent
            with kv.presence("alive/", "py-agent", ttl=5):
                r = await c.ok("kv_announce", prefix="alive/", agent_id="mcp-agent", ttl=5)
                assert r["key"] == "alive/mcp-agent"
                assert (await c.ok("kv_present", prefix="alive/"))["agents"] == [
                    "mcp-agent", "py-agent"]
                assert kv.present("alive/") == ["mcp-agent", "py-agent"]

            # watch: from now (nothing: empty after the timeout), then from its cursor
            w = await c.ok("kv_watch", prefix="board/", timeout=0.05)
            assert w["events"] == [] and w["overflow"] is False
            kv.put("board/a", 1)
            kv.put("other/x", 1)
            kv.delete("board/a")
            w2 = await c.ok("kv_watch", prefix="board/", timeout=5, cursor=w["cursor"])
            assert [(e["key"], e["kind"]) for e in w2["events"]] == [
                ("board/a", "put"), ("board/a", "delete")]
            assert w2["overflow"] is False
    _run(main)


def test_bad_calls_are_error_results_and_the_server_keeps_serving(ns: str,
                                                                  kv: kvcomm.Client) -> None:
    async def main() -> None:
        async with stdio("--name", ns) as c:
            assert "Unknown tool" in await c.err("kv_nope", key="a")
            assert "key" in await c.err("kv_get")  # missing argument
            assert "string" in await c.err("kv_get", key=5)  # wrong type
            assert "integer" in await c.err("kv_incr", key="c", delta="x")
            assert "InvalidKey" in await c.err("kv_put", key="k" * 5000, value=1)
            deep: Any = 1
            for _ in range(80):
                deep = [deep]
            assert "UnsupportedValue" in await c.err("kv_put", key="deep", value=deep)
            msg = await c.err("kv_put", key="huge", value="x" * (2 << 20))
            assert "bound" in msg and "smaller pieces" in msg
            assert "base64" in await c.err("kv_put", key="b", value={"$bytes": "not base64!"})
            assert "NaN" in await c.err("kv_put", key="f", value={"$float": "nan?"})
            assert "version" in await c.err("kv_put", key="a", value=1, expect_version="v7")
            assert "version" in await c.err("kv_put", key="a", value=1, expect_version="v1.@@")
            assert "cursor" in await c.err("kv_watch", prefix="", cursor="zz", timeout=0)
            assert "timeout" in await c.err("kv_watch", prefix="", timeout=61)
            assert "limit" in await c.err("kv_scan", prefix="", limit=0)
            assert "ttl" in await c.err("kv_announce", prefix="a/", agent_id="x", ttl=0)
            assert "InvalidArgument" in await c.err("kv_put", key="t", value=1, ttl=-1)
            kv.put("text", "not a counter")
            assert "InvalidArgument" in await c.err("kv_incr", key="text")
            # nothing of the refused calls was stored, and the server still serves
            for k in ("deep", "huge", "b", "f", "a", "t"):
                assert kv.get(k) is None
            assert (await c.ok("kv_put", key="after", value=1))["ok"] is True
            assert kv.get("after") == 1
    _run(main)


def test_the_prefix_allow_list_and_read_only(ns: str, kv: kvcomm.Client) -> None:
    kv.put("secret/x", "no")
    kv.put("tasks/1", "yes")

    async def main() -> None:
        async with stdio("--name", ns, "--prefix", "tasks/", "--prefix", "alive/") as c:
            assert "outside" in await c.err("kv_get", key="secret/x")
            assert "outside" in await c.err("kv_put", key="secret/x", value="mine")
            assert "outside" in await c.err("kv_delete", key="secret/x")
            assert "outside" in await c.err("kv_incr", key="secret/n")
            assert "outside" in await c.err("kv_scan", prefix="")
            assert "outside" in await c.err("kv_scan", prefix="task")
            assert "outside" in await c.err("kv_watch", prefix="secret/", timeout=0)
            assert "outside" in await c.err("kv_present", prefix="")
            assert "outside" in await c.err("kv_announce", prefix="", agent_id="tasks/x", ttl=1)
            # keys stay absolute
            assert (await c.ok("kv_get", key="tasks/1"))["value"] == "yes"
            assert [i["key"] for i in (await c.ok("kv_scan", prefix="tasks/"))["items"]] == ["tasks/1"]
            await c.ok("kv_put", key="tasks/2", value="from mcp")
            await c.ok("kv_announce", prefix="alive/", agent_id="me", ttl=5)
        assert kv.get("secret/x") == "no" and kv.get("tasks/2") == "from mcp"
        assert kv.get("secret/n") is None

        async with stdio("--name", ns, "--read-only") as c:
            listed = {t.name for t in (await c.s.list_tools()).tools}
            assert listed == {"kv_get", "kv_scan", "kv_watch", "kv_present"}
            assert "Unknown tool" in await c.err("kv_put", key="tasks/1", value="changed")
            assert "Unknown tool" in await c.err("kv_delete", key="tasks/1")
            assert (await c.ok("kv_get", key="tasks/1"))["value"] == "yes"
        assert kv.get("tasks/1") == "yes"
    _run(main)


def test_http_needs_the_token_and_serves_every_tool(http_server: tuple[str, str],
                                                     kv: kvcomm.Client) -> None:
    url, token = http_server
    import httpx2

    body = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                       "clientInfo": {"name": "t", "version": "0"}}}
    hdr = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    assert httpx2.post(url, json=body, headers=hdr).status_code == 401
    assert httpx2.post(url, json=body, headers={**hdr, "Authorization": "Bearer wrong"}
                       ).status_code == 401
    assert httpx2.post(url, json=body, headers={**hdr, "Authorization": f"Bearer {token}"}
                       ).status_code == 200

    async def main() -> None:
        with pytest.raises(BaseException):  # noqa: B017 (the SDK wraps the 401 in groups)
            async with http(url, "wrong"):
                pass
        async with http(url, token) as c:
            assert {t.name for t in (await c.s.list_tools()).tools} == TOOLS
            v = (await c.ok("kv_put", key="h/1", value={"a": 1}))["version"]
            assert kv.get("h/1") == {"a": 1}
            assert (await c.ok("kv_get", key="h/1"))["version"] == v
            assert (await c.ok("kv_put", key="h/1", value=0, expect_version="absent"))["ok"] is False
            assert (await c.ok("kv_scan", prefix="h/"))["items"][0]["key"] == "h/1"
            assert (await c.ok("kv_incr", key="h/n", delta=5))["value"] == 5
            await c.ok("kv_announce", prefix="h/alive/", agent_id="a", ttl=5)
            assert (await c.ok("kv_present", prefix="h/alive/"))["agents"] == ["a"]
            w = await c.ok("kv_watch", prefix="h/w", timeout=0)
            kv.put("h/w", 1)
            w = await c.ok("kv_watch", prefix="h/w", timeout=5, cursor=w["cursor"])
            assert [e["key"] for e in w["events"]] == ["h/w"]
            assert (await c.ok("kv_delete", key="h/1"))["deleted"] is True
            assert "Unknown tool" in await c.err("nope")
    _run(main)


def test_http_refuses_an_address_beyond_loopback_without_a_token(ns: str) -> None:
    r = subprocess.run(_cmd("--name", ns, "--transport", "http", "--host", "0.0.0.0",
                            "--port", str(free_port())),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert "--token-file" in r.stderr and "refusing" in r.stderr


def test_a_missing_sdk_names_the_extra(ns: str, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    from kvcomm.cli import main

    monkeypatch.setitem(sys.modules, "mcp", None)  # (import mcp: ModuleNotFoundError)
    assert main(["mcp", "--name", ns]) == 2
    assert install_hint("mcp") in capsys.readouterr().err


def test_bad_command_lines_say_what_to_pass(ns: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    from kvcomm.cli import main

    assert main(["mcp"]) == 2
    assert "--name NS" in capsys.readouterr().err
    assert main(["mcp", "--name", ns, "--prefix", ""]) == 2
    assert "non-empty key prefix" in capsys.readouterr().err
    assert main(["mcp", "--name", ns, "--token-file", "x"]) == 2
    assert "--transport http" in capsys.readouterr().err
    (tmp_path / "empty").write_text("\n")
    assert main(["mcp", "--name", ns, "--transport", "http", "--host", "0.0.0.0",
                 "--token-file", str(tmp_path / "empty")]) == 2
    assert "is empty" in capsys.readouterr().err


def test_two_servers_incrementing_one_counter_at_once_is_exact(
        ns: str, kv: kvcomm.Client, http_server: tuple[str, str]) -> None:
    url, token = http_server
    n = 150

    async def bump(c: Conn, seen: list[int]) -> None:
        for _ in range(n):
            seen.append((await c.ok("kv_incr", key="hits"))["value"])

    async def main() -> None:
        a: list[int] = []
        b: list[int] = []
        async with stdio("--name", ns) as c1, http(url, token) as c2:
            async with anyio.create_task_group() as tg:
                tg.start_soon(bump, c1, a)
                tg.start_soon(bump, c2, b)
        assert kv.get("hits") == 2 * n
        # every increment returned a distinct value: none counted twice, none lost
        assert sorted(a + b) == list(range(1, 2 * n + 1))
    _run(main)


_PUTTER = """
import sys, kvcomm
kv = kvcomm.open(sys.argv[1])
for k in sys.argv[2:]:
    kv.put(k, {"from": "another process", "key": k})
kv.close()
"""


def _put_from_another_process(ns: str, *keys: str) -> None:
    subprocess.run([sys.executable, "-c", _PUTTER, ns, *keys], check=True, timeout=60)


def test_a_watch_returns_another_process_put_and_resumes_at_its_cursor(ns: str,
                                                                      kv: kvcomm.Client) -> None:
    async def main() -> None:
        async with stdio("--name", ns) as c:
            got: dict[str, Any] = {}
            start = (await c.ok("kv_watch", prefix="board/", timeout=0))["cursor"]

            async def watch() -> None:
                got.update(await c.ok("kv_watch", prefix="board/", timeout=30, cursor=start))

            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                await anyio.sleep(0.2)  # (the watch's request first: then the get below
                # shows the loop free while it waits; the cursor makes the put's event
                # certain whichever the server takes first)
                # the watch is waiting (it can end only with the put below, or its 30 s):
                # other calls of the same session are served meanwhile
                assert (await c.ok("kv_get", key="board/none"))["found"] is False
                assert not got
                await anyio.to_thread.run_sync(_put_from_another_process, ns, "board/t1")
            assert [(e["key"], e["kind"]) for e in got["events"]] == [("board/t1", "put")]
            assert got["events"][0]["version"] == (await c.ok("kv_get", key="board/t1"))["version"]
            # changes made between two calls are not missed: the cursor resumes exactly
            _put_from_another_process(ns, "board/t2", "elsewhere/x", "board/t3")
            w = await c.ok("kv_watch", prefix="board/", timeout=5, cursor=got["cursor"])
            assert [e["key"] for e in w["events"]] == ["board/t2", "board/t3"]
            w = await c.ok("kv_watch", prefix="board/", timeout=0, cursor=w["cursor"])
            assert w["events"] == [] and w["overflow"] is False
    _run(main)


def test_a_watch_overrun_by_the_feed_says_overflow(ns: str, tmp_path: Path) -> None:
    cfg = {"cache": {**SMALL["cache"], "watch_buffer": 16}}
    path = tmp_path / "small.yaml"
    path.write_text(json.dumps(cfg))  # (YAML reads JSON)
    kv = kvcomm.open(ns, config=path)
    try:
        async def main() -> None:
            async with stdio("--name", ns, "--config", str(path)) as c:
                w = await c.ok("kv_watch", prefix="o/", timeout=0)
                for i in range(100):  # (far more than the feed keeps)
                    kv.put(f"o/{i}", i)
                w = await c.ok("kv_watch", prefix="o/", timeout=5, cursor=w["cursor"])
                assert w["overflow"] is True
                # from the new cursor on, exact again
                kv.put("o/after", 1)
                w = await c.ok("kv_watch", prefix="o/", timeout=5, cursor=w["cursor"])
                assert [e["key"] for e in w["events"]] == ["o/after"] and not w["overflow"]
        _run(main)
    finally:
        kv.close()


def test_stdout_carries_only_protocol_messages(ns: str) -> None:
    msgs = [
        {"jsonrpc": "2.0", "id": 1, "method": "initialize",
         "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                    "clientInfo": {"name": "raw", "version": "0"}}},
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
         "params": {"name": "kv_put", "arguments": {"key": "a", "value": 1}}},
        {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
         "params": {"name": "kv_get", "arguments": {"key": 7}}},
        {"jsonrpc": "2.0", "id": 4, "method": "tools/call", "params": {"name": "nope"}},
    ]
    p = subprocess.Popen(_cmd("--name", ns), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdin is not None and p.stdout is not None
    for m in msgs:
        p.stdin.write(json.dumps(m) + "\n")
        p.stdin.flush()
    replies = []
    while len(replies) < 4:
        line = p.stdout.readline()
        assert line, p.communicate()
        replies.append(json.loads(line))  # (every line a JSON-RPC message)
    p.stdin.close()
    rest = p.stdout.read()
    assert p.wait(timeout=30) == 0
    assert rest == "" and all(r["jsonrpc"] == "2.0" for r in replies)
    by_id = {r["id"]: r for r in replies}
    assert by_id[3]["result"]["isError"] and by_id[4]["result"]["isError"]


def test_the_task_board_example_runs_and_leaves_no_namespace(tmp_path: Path) -> None:
    """As docs/integrations/mcp.md runs it (no --name: a namespace of its own, purged at
    the end; it left one in /dev/shm at each run)."""
    example = ROOT / "examples" / "mcp_task_board.py"
    shm = tmp_path / "shm"
    shm.mkdir()
    config = tmp_path / "c.yaml"
    config.write_text(f"cache:\n  l2_dir: {shm}\n")
    r = subprocess.run([sys.executable, str(example), "--tasks", "3", "--config", str(config)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "board: 3 of 3 tasks done" in r.stdout
    assert os.listdir(shm) == [], os.listdir(shm)


def test_many_pending_watches_hold_up_no_other_watch(ns: str, kv: kvcomm.Client) -> None:
    """More watches than a thread pool would hold wait at once; a watch whose change is
    already in the feed still returns while they all wait."""
    n = 40

    async def main() -> None:
        async with stdio("--name", ns) as c:
            start = (await c.ok("kv_watch", prefix="ready/", timeout=0))["cursor"]
            kv.put("ready/1", 1)
            ended: list[int] = []

            async def idle_watch(i: int) -> None:
                await c.ok("kv_watch", prefix=f"quiet{i}/", timeout=20)
                ended.append(i)

            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(idle_watch, i)
                await anyio.sleep(0.5)  # (their requests first; ended then shows they wait)
                w = await c.ok("kv_watch", prefix="ready/", timeout=5, cursor=start)
                assert [e["key"] for e in w["events"]] == ["ready/1"]
                assert not ended  # (it did not wait for a pending watch to end)
                assert (await c.ok("kv_get", key="ready/1"))["value"] == 1
                tg.cancel_scope.cancel()
    _run(main)


def test_hostile_arguments_get_error_results_that_say_what_to_pass(ns: str,
                                                                   kv: kvcomm.Client) -> None:
    async def main() -> None:
        async with stdio("--name", ns) as c:
            for bad in ([], {}, 1, None):
                msg = await c.err("kv_put", key="f", value={"$float": bad})
                assert '"NaN", "Infinity" or "-Infinity"' in msg
            for cursor in ("f\u00b2", "f" + "1" * 5000, "f1e3"):
                assert "cursor" in await c.err("kv_watch", prefix="", timeout=0, cursor=cursor)
            assert kv.get("f") is None
            # a namespace purged under the server: a watch says so (not "no changes")
            w = await c.ok("kv_watch", prefix="", timeout=0)
            r = subprocess.run([sys.executable, "-m", "kvcomm", "purge", "--name", ns, "--force"],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            assert "purged" in await c.err("kv_watch", prefix="", timeout=1, cursor=w["cursor"])
            assert "purged" in await c.err("kv_get", key="a")
    _run(main)


def test_any_loopback_address_keeps_dns_rebinding_protection(ns: str) -> None:
    """Bound to a loopback address without a token, a request naming a foreign host (a
    web page reaching the port by DNS rebinding) is refused, whichever loopback address."""
    import httpx2

    port = free_port()
    p = subprocess.Popen(_cmd("--name", ns, "--transport", "http", "--host", "127.0.0.2",
                              "--port", str(port)),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    url = f"http://127.0.0.2:{port}/mcp"

    body = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                       "clientInfo": {"name": "t", "version": "0"}}}
    hdr = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    try:
        _wait_listening(p, "127.0.0.2", port)
        assert httpx2.post(url, json=body, headers=hdr).status_code == 200
        for foreign in ({"Host": "evil.example:80"},
                        {"Host": f"127.0.0.2:{port}", "Origin": "http://evil.example"}):
            # (421 for a foreign Host, 403 for a foreign Origin)
            assert httpx2.post(url, json=body, headers={**hdr, **foreign}).status_code in (403, 421)
    finally:
        p.terminate()
        out, _ = p.communicate(timeout=30)
        assert out == b""


def test_an_unparseable_request_gets_a_reply(ns: str) -> None:
    """The SDK's stdio reader drops a line it cannot read as a JSON-RPC message without a
    reply, and the client's call waited forever: kvcomm answers each request among them
    with its id (-32700 for JSON its parser refuses, -32600 for JSON that is no JSON-RPC
    request), in order, and serves on (kvcomm/mcp/stdio.py)."""
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                       "clientInfo": {"name": "raw", "version": "0"}}}

    def call(rid: str, value: str) -> str:
        return ('{"jsonrpc": "2.0", "id": ' + rid + ', "method": "tools/call", "params": '
                '{"name": "kv_put", "arguments": {"key": "d", "value": ' + value + '}}}')

    deep = "[" * 300 + "1" + "]" * 300
    lines = [json.dumps(init), json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}),
             call("2", deep),
             # (a notification nested as deep: nothing to answer, and nothing breaks)
             '{"jsonrpc": "2.0", "method": "notifications/x", "params": {"v": ' + deep + '}}',
             call('"s"', '"\\ud800"'),
             call('"\\ud800"', "1"),  # (an id that cannot be written back: null)
             call("20", "[" * 100_000 + "]" * 100_000),  # (past Python's json too)
             call("21", "1" * 5000),  # (an integer of 5000 digits)
             '{"jsonrpc": "2.0", "id": 22, "method": 5}',  # (JSON, no JSON-RPC request)
             '{"id": 23, "method": "ping"}',
             "not json at all", "", "[1, 2]",
             json.dumps({"jsonrpc": "2.0", "id": 3, "method": "tools/call",
                         "params": {"name": "kv_get", "arguments": {"key": "d"}}})]
    p = subprocess.Popen(_cmd("--name", ns), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdin is not None and p.stdout is not None
    try:
        p.stdin.write("\n".join(lines) + "\n")
        p.stdin.flush()
        replies: list[dict[str, Any]] = []
        while not replies or replies[-1].get("id") != 3:  # (the kv_get after them: served)
            line = p.stdout.readline()
            assert line, p.communicate()
            replies.append(json.loads(line))
        assert [r.get("id") for r in replies] == [1, 2, "s", None, 20, 21, 22, 23, 3], replies
        codes = [r["error"]["code"] for r in replies[1:-1]]
        assert codes == [-32700] * 5 + [-32600] * 2, replies
        assert "nested 200 levels" in replies[1]["error"]["message"], replies[1]
        assert '"jsonrpc": "2.0"' in replies[6]["error"]["message"], replies[6]
        assert replies[-1]["result"]["structuredContent"]["found"] is False, replies[-1]
    finally:
        p.stdin.close()
        assert p.wait(timeout=30) == 0


def test_a_scan_page_of_large_values_is_bounded_in_bytes(ns: str, kv: kvcomm.Client) -> None:
    """Python agents may store values far over kv_put's bound: a kv_scan page stops at
    4 MiB of JSON (one item at least) and its cursor pages on through all."""

    big = b"\x07" * (5 << 18)  # (1.25 MiB: 1.7 MiB as base64, over kv_put's bound)
    for i in range(5):
        kv.put(f"big/{i}", big)

    async def main() -> None:
        async with stdio("--name", ns) as c:
            keys: list[str] = []
            after = None
            pages = 0
            while True:
                page = await c.ok("kv_scan", prefix="big/", limit=10,
                                  **({"after": after} if after else {}))
                assert len(page["items"]) == 1 or len(json.dumps(page)) <= (4 << 20) + 4096
                assert all(base64.b64decode(i["value"]["$bytes"]) == big for i in page["items"])
                keys += [i["key"] for i in page["items"]]
                pages += 1
                after = page["cursor"]
                if after is None:
                    break
            assert keys == [f"big/{i}" for i in range(5)]
            assert pages >= 3  # (2 items a page: 5 in one page would be 8.5 MiB)
    _run(main)
