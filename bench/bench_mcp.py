"""``kvcomm mcp``: a kv_get and a kv_put round trip through the official MCP SDK's client,
over stdio and over streamable HTTP (each against a real ``kvcomm mcp`` subprocess),
beside the same operation through the Python API (``kv.get`` / ``kv.put`` on one host).

    python bench/bench_mcp.py [--n 2000] [--json]

Each round trip is timed alone (a client call awaited to its result); p50 and p99 in
microseconds. The value is a small JSON object (a task record, ~60 bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

import kvcomm
from kvcomm.devcluster.redis_server import free_port  # (below the ephemeral range)

VALUE = {"title": "summarise the report", "state": "open", "owner": None, "n": 7}


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def stats(samples_ns: list[float]) -> dict[str, float]:
    return {"p50_us": pct(samples_ns, 50) / 1e3, "p99_us": pct(samples_ns, 99) / 1e3,
            "mean_us": statistics.fmean(samples_ns) / 1e3}


async def time_calls(call: Callable[[int], Awaitable[Any]], n: int) -> list[float]:
    for i in range(min(200, n)):  # (warm-up)
        await call(i)
    out = []
    for i in range(n):
        t = time.perf_counter_ns()
        await call(i)
        out.append(time.perf_counter_ns() - t)
    return out


async def bench_session(s: ClientSession, n: int) -> dict[str, dict[str, float]]:
    await s.initialize()

    async def put(i: int) -> None:
        r = await s.call_tool("kv_put", {"key": f"bench/{i % 100}", "value": VALUE})
        assert not r.is_error

    async def get(i: int) -> None:
        r = await s.call_tool("kv_get", {"key": f"bench/{i % 100}"})
        assert not r.is_error

    return {"kv_put": stats(await time_calls(put, n)), "kv_get": stats(await time_calls(get, n))}


def bench_python(ns: str, n: int) -> dict[str, dict[str, float]]:
    kv = kvcomm.open(ns)
    try:
        out = {}
        for name, fn in (("kv_put", lambda i: kv.put(f"bench/{i % 100}", VALUE)),
                         ("kv_get", lambda i: kv.get(f"bench/{i % 100}"))):
            for i in range(200):
                fn(i)
            samples = []
            for i in range(n):
                t = time.perf_counter_ns()
                fn(i)
                samples.append(time.perf_counter_ns() - t)
            out[name] = stats(samples)
        return out
    finally:
        kv.close()


async def bench_http(ns: str, n: int) -> dict[str, dict[str, float]]:
    port = free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".token", delete=False) as f:
        f.write(uuid.uuid4().hex)
    token = open(f.name).read()
    p = subprocess.Popen([sys.executable, "-m", "kvcomm", "mcp", "--name", ns, "--transport",
                          "http", "--port", str(port), "--token-file", f.name],
                         stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or p.poll() is not None:
                    raise SystemExit("the HTTP server did not start") from None
                time.sleep(0.05)
        async with create_mcp_http_client(headers={"Authorization": f"Bearer {token}"}) as c, \
                streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=c) as (r, w), \
                ClientSession(r, w) as s:
            return await bench_session(s, n)
    finally:
        p.terminate()
        p.wait(30)
        os.unlink(f.name)


async def bench_stdio(ns: str, n: int) -> dict[str, dict[str, float]]:
    params = StdioServerParameters(command=sys.executable,
                                   args=["-m", "kvcomm", "mcp", "--name", ns])
    async with stdio_client(params, errlog=open(os.devnull, "w")) as (r, w), \
            ClientSession(r, w) as s:
        return await bench_session(s, n)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="round trips per operation (default 2000)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args()
    ns = f"bench-mcp-{os.getpid()}"
    try:
        res = {"python": bench_python(ns, args.n),
               "stdio": anyio.run(bench_stdio, ns, args.n),
               "http": anyio.run(bench_http, ns, args.n)}
    finally:
        subprocess.run([sys.executable, "-m", "kvcomm", "purge", "--name", ns, "--force"],
                       capture_output=True)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"round trip, {args.n} each (microseconds)      p50        p99")
    for via in ("python", "stdio", "http"):
        for op in ("kv_get", "kv_put"):
            s = res[via][op]
            label = {"python": f"Python API  kv.{op[3:]}", "stdio": f"MCP stdio   {op}",
                     "http": f"MCP HTTP    {op}"}[via]
            print(f"{label:<38} {s['p50_us']:>9.1f} {s['p99_us']:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
