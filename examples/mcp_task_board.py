"""Two agents, one task board: a Python agent and an MCP client (what an LLM runtime such
as Claude does, through the same tools) share it through KVCOMM.

    python examples/mcp_task_board.py [--tasks 5] [--name NS] [--config FILE]

* **planner** (Python, ``kvcomm.open``): numbers each task with ``kv.incr("board/next")``,
  puts it as ``board/tasks/<n>`` = ``{"title", "state": "open"}``, then waits (``kv.watch``)
  until the worker has finished them all (``board/done`` counts them);
* **worker** (an MCP client over stdio, talking to ``kvcomm mcp --prefix board/``): waits
  for tasks with ``kv_watch``, resuming at the cursor each call returns so that none is
  missed, claims each open task with ``kv_put`` and ``expect_version`` (compare-and-set: a
  second worker could not claim it too), "does" it, marks it done and ``kv_incr``'s
  ``board/done``.

The worker here is scripted; an LLM given the same server picks the same tools from their
descriptions. Exits 0 when every task is done (1 otherwise). Needs pip install
'kvcomm[mcp]'. In cluster mode (``--config`` a dev-cluster host config) the two agents
could as well run on different hosts.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from typing import Any

import anyio
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

import kvcomm
from kvcomm.tiers.l2 import purge


def planner(kv: kvcomm.Client, n: int, ready: threading.Event, out: dict[str, Any]) -> None:
    """The Python agent: posts ``n`` tasks, then waits until they are done."""
    ready.wait()
    for title in (f"summarise chapter {i + 1}" for i in range(n)):
        task_id = kv.incr("board/next")
        kv.put(f"board/tasks/{task_id}", {"title": title, "state": "open"})
        print(f"planner: posted task {task_id}: {title}")
    changes = kv.watch("board/done", timeout=30)  # (from now: taken before the check)
    if kv.get("board/done") != n:
        for _ in changes:
            if kv.get("board/done") == n:
                break
    out["done"] = kv.get("board/done")
    out["tasks"] = {i.key: i.value for i in kv.scan("board/tasks/")}


async def call(s: ClientSession, tool: str, **args: Any) -> dict[str, Any]:
    r = await s.call_tool(tool, args)
    if r.is_error:
        raise RuntimeError(f"{tool}: {r.content[0].text}")  # type: ignore[union-attr]
    return r.structured_content or {}


async def worker(server: list[str], n: int, ready: threading.Event) -> None:
    """The MCP client: claims and finishes tasks through kv_watch, kv_put and kv_incr."""
    params = StdioServerParameters(command=sys.executable, args=server)
    async with stdio_client(params) as (r, w), ClientSession(r, w) as s:
        await s.initialize()
        await call(s, "kv_announce", prefix="board/agents/", agent_id="mcp-worker", ttl=60)
        cursor = (await call(s, "kv_watch", prefix="board/tasks/", timeout=0))["cursor"]
        ready.set()  # (watching from here: no task posted after this is missed)
        finished = 0
        while finished < n:
            page = await call(s, "kv_watch", prefix="board/tasks/", timeout=30, cursor=cursor)
            cursor = page["cursor"]
            if page["overflow"]:  # (changes missed: look at the whole board instead)
                keys = [i["key"] for i in (await call(s, "kv_scan", prefix="board/tasks/"))["items"]]
            else:
                keys = [e["key"] for e in page["events"] if e["kind"] == "put"]
            for key in keys:
                task = await call(s, "kv_get", key=key)
                if not task["found"] or task["value"]["state"] != "open":
                    continue
                claim = await call(s, "kv_put", key=key, expect_version=task["version"],
                                   value={**task["value"], "state": "working", "by": "mcp-worker"})
                if not claim["ok"]:  # (another worker was first)
                    continue
                await call(s, "kv_put", key=key, value={**task["value"], "state": "done",
                                                        "by": "mcp-worker"})
                done = (await call(s, "kv_incr", key="board/done"))["value"]
                finished += 1
                print(f"worker: finished {key} ({done} done)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=5)
    ap.add_argument("--name", help="the namespace (default: taskboard-PID, purged at the end)")
    ap.add_argument("--config", help="a kvcomm YAML config (a host config in cluster mode)")
    args = ap.parse_args()
    kv = kvcomm.open(args.name or f"taskboard-{os.getpid()}", config=args.config)
    server = ["-m", "kvcomm", "mcp", "--name", kv.name, "--prefix", "board/"]
    if args.config:
        server += ["--config", args.config]
    ready, out = threading.Event(), {}
    t = threading.Thread(target=planner, args=(kv, args.tasks, ready, out))
    t.start()
    try:
        anyio.run(worker, server, args.tasks, ready)
    finally:
        ready.set()
        t.join()
        kv.close()
        if args.name is None and not kv.config.cluster.enabled:  # (a namespace of its own,
            purge(kv.name, kv.config.cache.l2_dir)  # made up for this run: not left behind)
    ok = out.get("done") == args.tasks and all(v["state"] == "done" for v in out["tasks"].values())
    print(f"board: {out.get('done')} of {args.tasks} tasks done" + ("" if ok else " (INCOMPLETE)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
