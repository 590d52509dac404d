"""kvcomm.integrations.langgraph across the hosts of a real dev cluster (Redis Cluster,
etcd, one node daemon per host): a graph stopped at an ``interrupt`` on host-1 is resumed
on host-2 by thread id alone, and memories a host-1 agent puts in the store are found by a
host-2 agent's search. The saver's heads are strong (``cache.strong_prefixes:
["lg/cp/h/"]``), as its documentation asks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from typing import Any

import pytest

import kvcomm
from tests.support.devcluster import dev_cluster_fixture, host, l3
from tests.support.helpers import wait_for

pytest.importorskip("langgraph")

from langgraph.types import Command  # noqa: E402

from kvcomm.integrations.langgraph import KVCommSaver, KVCommStore  # noqa: E402
from tests.integrations.test_langgraph import build_graph, check_one_chain, log_graph, run_two_writers  # noqa: E402
from tests.support import ROOT

dev = dev_cluster_fixture(2, strong_prefixes=["lg/cp/h/"], groups=64)


def test_a_graph_interrupted_on_host_1_is_resumed_on_host_2(dev: dict[str, Any]) -> None:
    cfg = {"configurable": {"thread_id": "ticket/42"}}
    with host(dev, 0) as a, host(dev, 1) as b:
        one = build_graph().compile(checkpointer=KVCommSaver(a))
        out = one.invoke({"steps": [], "answer": ""}, cfg)
        assert out["__interrupt__"][0].value == {"question": "go ahead?"}
        # at once, with nothing waited for: host-2 reads the head from etcd and waits for
        # the records it names if host-1's daemon has not brought them to L3 yet
        saver_b = KVCommSaver(b)
        head = b.get_item(saver_b.keys.head("ticket/42", ""))
        assert head is not None and head.tier == "etcd"  # the head is strong
        two = build_graph().compile(checkpointer=saver_b)
        state = two.get_state(cfg)
        assert state.next == ("ask",) and state.values["steps"] == ["plan"]
        assert state.tasks[0].interrupts[0].value == {"question": "go ahead?"}
        done = two.invoke(Command(resume="yes"), cfg)
        assert done["steps"] == ["plan", "ask", "act:yes"] and done["answer"] == "yes"
        # and back on host-1, the thread is the finished one (never the one it left)
        final = one.get_state(cfg)
        assert final.next == () and final.values["steps"] == ["plan", "ask", "act:yes"]
        assert head.value["id"] < KVCommSaver(a).get_tuple(cfg).checkpoint["id"]  # type: ignore[union-attr]


def test_a_resume_waits_for_records_not_yet_in_l3_and_never_reads_an_older_thread(
        dev: dict[str, Any]) -> None:
    """Host-1's node daemon is paused (SIGSTOP): its graph's records stay in its L2, only
    the strong head reaches etcd. Host-2 resuming the thread must not see an older state
    (or none): it waits, and finishes once the daemon runs again; with a short
    ``wait_timeout`` it raises Unavailable instead."""
    daemon = dev["hosts"][0]["pid"]
    with host(dev, 0) as a, host(dev, 1) as b:
        one = build_graph().compile(checkpointer=KVCommSaver(a))
        saver_b = KVCommSaver(b, wait_timeout=60)
        cfg = {"configurable": {"thread_id": "paused/1"}}
        os.kill(daemon, signal.SIGSTOP)
        try:
            one.invoke({"steps": [], "answer": ""}, cfg)
            got: dict[str, Any] = {}

            def resume() -> None:
                try:
                    graph = build_graph().compile(checkpointer=saver_b)
                    state = graph.get_state(cfg)  # (the interrupt's write included)
                    got["interrupts"] = [i.value for t in state.tasks for i in t.interrupts]
                    got["out"] = graph.invoke(Command(resume="late"), cfg)
                except BaseException as exc:  # (reported below)
                    got["error"] = exc

            t = threading.Thread(target=resume)
            t.start()
            wait_for(lambda: saver_b.counters["waits"] > 0 or not t.is_alive(), 20,
                     "host-2 to wait for host-1's records")
            assert t.is_alive() and "error" not in got, got  # waiting, not done on old state
        finally:
            os.kill(daemon, signal.SIGCONT)
        t.join(60)
        assert not t.is_alive() and "error" not in got, got
        assert got["interrupts"] == [{"question": "go ahead?"}]
        assert got["out"]["steps"] == ["plan", "ask", "act:late"]
        assert saver_b.counters["wait_timeouts"] == 0

        # the same with a short wait: Unavailable, naming the checkpoint
        impatient = KVCommSaver(b, wait_timeout=0.3)
        cfg2 = {"configurable": {"thread_id": "paused/2"}}
        os.kill(daemon, signal.SIGSTOP)
        try:
            one.invoke({"steps": [], "answer": ""}, cfg2)
            with pytest.raises(kvcomm.Unavailable, match="checkpoint .* of thread 'paused/2'"):
                impatient.get_tuple(cfg2)
        finally:
            os.kill(daemon, signal.SIGCONT)
        assert impatient.counters["wait_timeouts"] == 1
        assert wait_for(lambda: impatient.get_tuple(cfg2), 20, "the records after the daemon resumed",
                        retry_on=(kvcomm.Unavailable,))


def test_two_hosts_resuming_one_thread_at_once_never_fork_it(dev: dict[str, Any]) -> None:
    """langgraph #8796 across hosts: a process on host-1 and one on host-2 resume one
    thread from the same latest checkpoint; the strong head's compare-and-set (etcd)
    refuses the loser's move, which is told (ConflictError), retries, and the thread is
    one chain holding both runs."""
    with host(dev, 0) as a:
        saver = KVCommSaver(a)
        cfg: Any = {"configurable": {"thread_id": "shared"}}
        log_graph().compile(checkpointer=saver).invoke({"log": ["seed"]}, cfg)
        assert a.get_item(saver.keys.head("shared", "")).tier == "etcd"  # the head is strong
        outs = run_two_writers([{"config": dev["hosts"][i]["config"]} for i in (0, 1)],
                               "barrier/hosts")

        def whole() -> bool:
            """Host-2's checkpoints reached host-1: the latest holds three runs' logs and
            the chain reaches the first checkpoint. Its length is not fixed: 3 checkpoints
            a run (input, input applied, after the node), and also the input checkpoint of
            a run that lost later, on its next move, when the other's retry had resumed from
            it (ci: 10). The loser's refused checkpoints, deleted on host-2, are not there."""
            history = list(saver.list(cfg))
            if not history or len(history[0].checkpoint["channel_values"].get("log", [])) < 6:
                return False
            ids = [h.checkpoint["id"] for h in history]
            parents = [h.parent_config["configurable"]["checkpoint_id"] if h.parent_config
                       else None for h in history]
            return parents[-1] is None and parents[:-1] == ids[1:]

        wait_for(whole, 60, lambda: (
            f"one chain of three runs on host-1 (writers: {outs}; host-1 lists "
            + repr([(h.checkpoint["id"], h.metadata.get("source"), h.parent_config)
                    for h in saver.list(cfg)]) + ")"))
        check_one_chain(saver, outs)


def test_an_async_agent_on_host_2_resumes_host_1s_thread_over_kvcomm_aio(
        dev: dict[str, Any]) -> None:
    """KVCommSaver and KVCommStore on ``kvcomm.aio`` clients, a graph of async nodes: host-1
    runs it to its interrupt, host-2 resumes it (``ainvoke``); the calls that reach etcd or
    L3 left the loop for the aio client's pool (counted), the others ran on it."""
    import asyncio

    import kvcomm.aio
    from tests.integrations.test_langgraph import async_graph

    cfg: Any = {"configurable": {"thread_id": "aio/7"}}

    async def run() -> tuple[Any, int]:
        async with kvcomm.aio.open(config=dev["hosts"][0]["config"]) as a, \
                kvcomm.aio.open(config=dev["hosts"][1]["config"]) as b:
            one = async_graph().compile(checkpointer=KVCommSaver(a), store=KVCommStore(a))
            out = await one.ainvoke({"steps": [], "answer": ""}, cfg)
            assert out["__interrupt__"][0].value == {"question": "go ahead?"}
            two = async_graph().compile(checkpointer=KVCommSaver(b), store=KVCommStore(b))
            done = await two.ainvoke(Command(resume="yes"), cfg)
            final = await one.aget_state(cfg)
            assert final.values["steps"] == done["steps"]
            return done, b.off_loop

    done, off_loop = asyncio.run(run())
    assert done["steps"] == ["plan", "ask", "act:yes"] and off_loop > 0


def _wait_in_l3(dev: dict[str, Any], keys: list[str]) -> None:
    store = l3(dev)
    try:
        wait_for(lambda: all(r is not None and not isinstance(r, Exception)
                             for r in store.get_many(keys).values()),
                 20, "host-1's memories to reach L3")
    finally:
        store.close()


def test_memories_put_on_host_1_are_found_by_a_search_on_host_2(dev: dict[str, Any]) -> None:
    with host(dev, 0) as a, host(dev, 1) as b:
        writer, reader = KVCommStore(a), KVCommStore(b)
        facts = {f"fact-{i}": {"text": f"likes {i}", "score": i} for i in range(12)}
        for key, value in facts.items():
            writer.put(("users", "u1", "memories"), key, value)
        writer.put(("users", "u2", "memories"), "other", {"text": "not u1", "score": 99})
        keys = [writer.keys.item(("users", "u1", "memories"), k) for k in facts]
        _wait_in_l3(dev, keys)
        # acknowledged by L3 before the search began: every one is found on host-2, which
        # never read any of them
        found = reader.search(("users", "u1"), limit=100)
        assert {i.key: i.value for i in found} == facts
        assert [i.key for i in reader.search(("users",), filter={"score": {"$gte": 10}})] == [
            "fact-10", "fact-11", "other"]
        page1 = reader.search(("users", "u1"), limit=5)
        page2 = reader.search(("users", "u1"), limit=5, offset=5)
        assert len(page1) == len(page2) == 5 and not {i.key for i in page1} & {i.key for i in page2}
        assert reader.list_namespaces(prefix=("users",)) == [("users", "u1", "memories"),
                                                             ("users", "u2", "memories")]
        # a delete on host-2 is seen by host-1's search once it is in L3
        reader.delete(("users", "u1", "memories"), "fact-0")
        wait_for(lambda: "fact-0" not in {i.key for i in writer.search(("users", "u1"), limit=100)},
                 20, "host-2's delete to reach host-1's search")


def test_a_semantic_search_on_host_2_finds_host_1s_memories_by_their_vectors(
        dev: dict[str, Any]) -> None:
    from langgraph.store.memory import InMemoryStore

    from tests.integrations.test_store_search import fake_embed, index_config

    embedded_on_b: list[str] = []

    def embed_b(texts: list[str]) -> list[list[float]]:
        embedded_on_b.extend(texts)
        return fake_embed(texts)

    with host(dev, 0) as a, host(dev, 1) as b:
        writer = KVCommStore(a, index=index_config())
        reader = KVCommStore(b, index=index_config(embed=embed_b))
        ref = InMemoryStore(index=index_config())
        facts = {"m1": {"text": "apple pear"}, "m2": {"text": "rust stone"},
                 "m3": {"text": "river stone cloud"}, "m4": {"text": "apple", "extra": "tiger"}}
        for key, value in facts.items():
            writer.put(("vusers", "u1", "memories"), key, value)
            ref.put(("vusers", "u1", "memories"), key, value)
        writer.put(("vusers", "u2", "memories"), "other", {"text": "stone stone"})
        keys = [writer.keys.item(("vusers", "u1", "memories"), k) for k in facts]
        _wait_in_l3(dev, [*keys, writer.keys.item(("vusers", "u2", "memories"), "other")])
        got = reader.search(("vusers", "u1"), query="stone", limit=10)
        want = ref.search(("vusers", "u1"), query="stone", limit=10)
        assert [i.key for i in got] == [i.key for i in want]
        assert [i.score for i in got] == pytest.approx([i.score for i in want], abs=1e-5)
        assert embedded_on_b == ["stone"], "host-2 embedded the query only: the vectors came " \
                                           "with the items"
        assert [i.key for i in reader.search(("vusers", "u2"), query="apple")] == ["other"]
        # a re-put on host-2 is what host-1's search scores, once in L3
        reader.put(("vusers", "u1", "memories"), "m1", {"text": "stone"})
        wait_for(lambda: writer.search(("vusers", "u1"), query="stone", limit=1)[0].key == "m1",
                 20, "host-2's re-put to reach host-1's search")


@pytest.mark.slow
def test_the_three_agent_example_across_hosts(dev: dict[str, Any]) -> None:
    """examples/langgraph_agents.py with its agents on host-1, host-2 and host-1: the
    analyst (host-2) finds the scout's (host-1) memories by search, the writer (host-1)
    the analyst's. (`make test-slow`: `make test` runs the example on one host in
    test_langgraph.py and a search across hosts above.)"""
    example = ROOT / "examples" / "langgraph_agents.py"
    h = [x["config"] for x in dev["hosts"]]
    out = subprocess.run([sys.executable, str(example), "--configs", h[0], h[1], h[0]],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "report: 12 observations, mean 21.86 C, 1 over 30 C: obs-02" in out.stdout, out.stdout
