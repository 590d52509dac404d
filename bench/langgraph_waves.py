"""Waves of 20 concurrent 20-step graphs (bench_langgraph's async graph) on one saver, for a
count of instructions (nothing is timed here):

    valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file=/dev/null \
        .venv/bin/python bench/langgraph_waves.py {mem|kv} WAVES

The instructions per graph of a saver are (the count with WAVES=3 less the count with
WAVES=1) / 40: the imports, the namespace's set-up and the first wave's warming left out.
``mem``: LangGraph's InMemorySaver; ``kv``: KVCommSaver over ``kvcomm.aio`` on an embedded
namespace (the shipped defaults; purged at the end).
"""

from __future__ import annotations

import asyncio
import os
import sys

from bench_langgraph import async_graph
from langgraph.checkpoint.memory import InMemorySaver

import kvcomm.aio
from kvcomm.integrations.langgraph import KVCommSaver
from kvcomm.tiers import l2


async def main(which: str, waves: int) -> None:
    ns = f"bench-lg-waves-{os.getpid()}"
    async with kvcomm.aio.open(ns) as akv:
        try:
            g = async_graph(InMemorySaver() if which == "mem" else KVCommSaver(akv))
            for w in range(waves):
                await asyncio.gather(*(g.ainvoke({"n": 0}, {"configurable": {
                    "thread_id": f"g-{w}-{i}"}}) for i in range(20)))
        finally:
            l2.purge(ns)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("mem", "kv") or not sys.argv[2].isdigit():
        sys.exit("usage: langgraph_waves.py {mem|kv} WAVES")
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
