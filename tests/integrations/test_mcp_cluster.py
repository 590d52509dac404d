"""``kvcomm mcp`` in cluster mode: an MCP client on one host of a real dev cluster (Redis
Cluster, etcd, one node daemon per host) and Python agents on another share one
namespace: puts, scans, counters and watches cross the hosts both ways."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import kvcomm
from kvcomm.devcluster import control
from tests.integrations.test_mcp import _run, stdio
from tests.support.helpers import wait_for
from tests.support.servers import starts

pytest.importorskip("mcp")
anyio = pytest.importorskip("anyio")


@pytest.fixture(scope="module")
@starts("redis", "etcd")
def dc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    d = tmp_path_factory.mktemp("mcpdc")
    control.up(2, str(d))
    try:
        yield d
    finally:
        control.down(str(d))


def test_an_mcp_client_and_a_python_agent_on_two_hosts_share_the_namespace(dc: Path) -> None:
    py = kvcomm.open(config=dc / "host-2.yaml")  # the Python agent, on host 2
    try:
        async def main() -> None:
            async with stdio("--config", str(dc / "host-1.yaml")) as c:  # MCP, on host 1
                w = await c.ok("kv_watch", prefix="board/", timeout=0)  # (registers board/)
                await c.ok("kv_put", key="board/from-mcp", value={"by": "mcp"})
                wait_for(lambda: py.get("board/from-mcp") == {"by": "mcp"}, 30,
                         "host 2 reading the MCP client's put")
                py.put("board/from-python", {"by": "python"})
                events: list[str] = []
                cursor = w["cursor"]
                for _ in range(20):  # (until host 1's daemon installs host 2's put)
                    w = await c.ok("kv_watch", prefix="board/", timeout=2, cursor=cursor)
                    cursor = w["cursor"]
                    events += [e["key"] for e in w["events"] if e["kind"] == "put"]
                    if "board/from-python" in events:
                        break
                assert "board/from-python" in events
                got = await c.ok("kv_get", key="board/from-python")
                assert got["value"] == {"by": "python"}
                keys = [i["key"] for i in (await c.ok("kv_scan", prefix="board/"))["items"]]
                assert keys == ["board/from-mcp", "board/from-python"]
                # one counter, incremented on both hosts: each increment counted once
                for _ in range(5):
                    await c.ok("kv_incr", key="board/count")
                    py.incr("board/count")
                wait_for(lambda: py.get("board/count") == 10, 30, "host 2 counting 10")
                for _ in range(100):
                    if (await c.ok("kv_get", key="board/count"))["value"] == 10:
                        break
                    await anyio.sleep(0.2)
                assert (await c.ok("kv_get", key="board/count"))["value"] == 10
        _run(main)
    finally:
        py.close()
