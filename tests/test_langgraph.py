"""kvcomm.integrations.langgraph on one host (embedded mode): KVCommSaver against
LangGraph's own conformance suite, KVCommStore against LangGraph's InMemoryStore on random
operations, the key escaping, and the refusal of pickles. The cross-host checks are in
test_langgraph_cluster.py."""

from __future__ import annotations

import asyncio
import operator
import pickle
import random
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any, TypedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcomm

pytest.importorskip("langgraph.checkpoint.conformance")

from langgraph.checkpoint.conformance import checkpointer_test, validate  # noqa: E402
from langgraph.checkpoint.conformance.capabilities import (  # noqa: E402
    BASE_CAPABILITIES,
    EXTENDED_CAPABILITIES,
)
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer  # noqa: E402
from langgraph.graph import END, START, StateGraph  # noqa: E402
from langgraph.store.memory import InMemoryStore  # noqa: E402
from langgraph.types import Command, interrupt  # noqa: E402

from kvcomm.integrations.langgraph import KVCommSaver, KVCommStore  # noqa: E402
from kvcomm.integrations.langgraph._keys import Keys, esc, unesc  # noqa: E402

# ---------------------------------------------------------------- the conformance suite


def test_kvcommsaver_passes_langgraphs_conformance_suite(kv: kvcomm.Client,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Every base and extended capability of langgraph-checkpoint-conformance passes."""
    @checkpointer_test(name="KVCommSaver")
    async def factory() -> AsyncIterator[KVCommSaver]:
        yield KVCommSaver(kv)

    report = asyncio.run(validate(factory))
    report.print_report()
    printed = capsys.readouterr().out
    with capsys.disabled():
        print(printed)  # the report, in the test's output for the record
    for cap in BASE_CAPABILITIES | EXTENDED_CAPABILITIES:
        result = report.results[cap.value]
        assert result.detected and result.passed is True, (cap.value, result.failures, printed)
        assert result.tests_passed > 0 and result.tests_failed == 0
    assert report.conformance_level() == "FULL"


# ---------------------------------------------------------------- a graph, stopped and resumed


class State(TypedDict):
    steps: Annotated[list[str], operator.add]
    answer: str


def build_graph() -> StateGraph[State]:
    def plan(s: State) -> dict[str, Any]:
        return {"steps": ["plan"]}

    def ask(s: State) -> dict[str, Any]:
        answer = interrupt({"question": "go ahead?"})
        return {"steps": ["ask"], "answer": answer}

    def act(s: State) -> dict[str, Any]:
        return {"steps": [f"act:{s['answer']}"]}

    g = StateGraph(State)
    g.add_node("plan", plan)
    g.add_node("ask", ask)
    g.add_node("act", act)
    g.add_edge(START, "plan")
    g.add_edge("plan", "ask")
    g.add_edge("ask", "act")
    g.add_edge("act", END)
    return g


def test_a_graph_stopped_at_an_interrupt_resumes_from_another_client(ns: str,
                                                                       config: kvcomm.Config) -> None:
    """Two clients (as two processes of a host): one runs to the interrupt, the other,
    with only the thread id, resumes and finishes; the history is listed by both."""
    cfg = {"configurable": {"thread_id": "chat/7 %="}}  # (an id that needs escaping)
    with kvcomm.open(ns, config=config) as a, kvcomm.open(ns, config=config) as b:
        first = build_graph().compile(checkpointer=KVCommSaver(a))
        out = first.invoke({"steps": [], "answer": ""}, cfg)
        assert out["__interrupt__"][0].value == {"question": "go ahead?"}
        second = build_graph().compile(checkpointer=KVCommSaver(b))
        assert second.get_state(cfg).next == ("ask",)
        done = second.invoke(Command(resume="yes"), cfg)
        assert done["steps"] == ["plan", "ask", "act:yes"] and done["answer"] == "yes"
        assert first.get_state(cfg).values["steps"] == ["plan", "ask", "act:yes"]
        history = list(KVCommSaver(a).list(cfg))
        assert len(history) >= 4 and [h.checkpoint["id"] for h in history] == sorted(
            (h.checkpoint["id"] for h in history), reverse=True)


def test_the_async_methods_run_a_graph(kv: kvcomm.Client) -> None:
    cfg = {"configurable": {"thread_id": "async-1"}}
    graph = build_graph().compile(checkpointer=KVCommSaver(kv))

    async def run() -> dict[str, Any]:
        await graph.ainvoke({"steps": [], "answer": ""}, cfg)
        return await graph.ainvoke(Command(resume="ok"), cfg)

    assert asyncio.run(run())["steps"] == ["plan", "ask", "act:ok"]


def test_a_thread_id_too_long_for_a_key_says_what_to_do(kv: kvcomm.Client) -> None:
    graph = build_graph().compile(checkpointer=KVCommSaver(kv))
    with pytest.raises(kvcomm.InvalidKey, match="max_key_bytes"):
        graph.invoke({"steps": [], "answer": ""}, {"configurable": {"thread_id": "t" * 300}})


# ---------------------------------------------------------------- keys


_IDS = st.text(alphabet=st.sampled_from("ab/%=é\x01 .:"), max_size=6)


@given(_IDS, _IDS, _IDS, _IDS)
def test_escaped_ids_are_injective_and_keep_prefixes_apart(a: str, b: str, c: str, d: str) -> None:
    assert unesc(esc(a)) == a and "/" not in esc(a) and "=" not in esc(a)
    k = Keys("lg/", 4096)
    # (thread, ns) pairs map to distinct keys; a thread's prefix holds only its own keys
    assert (k.head(a, b) == k.head(c, d)) == ((a, b) == (c, d))
    assert k.checkpoint(a, b, "x").startswith(k.thread(k.checkpoints, c)) == (a == c)
    if a and c:
        ns1, ns2 = (a,), (a, c)
        assert k.parse_item(k.item(ns2, b)) == (ns2, b)
        assert k.item(ns2, b).startswith(k.store_prefix(ns1))
        assert not k.item((a + c,), b).startswith(k.store_prefix(ns1))


# ---------------------------------------------------------------- never pickle


class _Opaque:
    pass


def test_a_serializer_that_pickles_is_refused(kv: kvcomm.Client) -> None:
    with pytest.raises(kvcomm.ConfigError, match="pickle"):
        KVCommSaver(kv, serde=JsonPlusSerializer(pickle_fallback=True))
    with pytest.raises(kvcomm.ConfigError, match="pickle"):
        KVCommStore(kv, serde=pickle)  # an untyped dumps/loads object
    saver = KVCommSaver(kv)
    assert saver.serde.inner.pickle_fallback is False  # type: ignore[attr-defined]
    with pytest.raises(Exception, match="serializ|Type is not"):  # (msgpack's own error)
        saver.serde.dumps_typed(_Opaque())


def test_a_state_value_only_pickle_could_store_is_unsupportedvalue(kv: kvcomm.Client) -> None:
    """The README promises UnsupportedValue; LangGraph's serializer raised its own
    ``TypeError: Type is not msgpack serializable``. Nothing is stored."""
    saver, store = KVCommSaver(kv), KVCommStore(kv)
    with pytest.raises(kvcomm.UnsupportedValue, match="pickle"):
        saver.serde.dumps_typed(_Opaque())

    class State(TypedDict):
        x: Any

    g = StateGraph(State)
    g.add_node("n", lambda s: {"x": _Opaque()})
    g.add_edge(START, "n")
    g.add_edge("n", END)
    graph = g.compile(checkpointer=saver)
    with pytest.raises(kvcomm.UnsupportedValue, match="pickle"):
        graph.invoke({"x": 1}, {"configurable": {"thread_id": "t-opaque"}})
    with pytest.raises(kvcomm.UnsupportedValue, match="pickle"):
        store.put(("ns",), "k", {"v": _Opaque()})
    assert store.get(("ns",), "k") is None


def test_a_pickle_planted_in_kvcomm_is_never_loaded(kv: kvcomm.Client,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    store = KVCommStore(kv)
    store.put(("mem",), "k", {"x": 1})
    key = store.keys.item(("mem",), "k")
    raw = kv.get(key)
    kv.put(key, ["pickle", pickle.dumps({"x": 2}), raw[2], raw[3]])

    def refuse(*a: Any, **k: Any) -> Any:
        raise AssertionError("pickle.loads was called")

    monkeypatch.setattr(pickle, "loads", refuse)
    with pytest.raises(kvcomm.CorruptRecord, match="pickle"):
        store.get(("mem",), "k")


# ---------------------------------------------------------------- the store against InMemoryStore


_LABELS = ["a", "b", "ab", "x/y", "%", "=", "é", "a b"]
_KEYS = ["k1", "k2", "k/3", "=", "%2F", "ü"]


def _value(r: random.Random) -> dict[str, Any]:
    return {"n": r.randrange(5), "tag": r.choice(["red", "blue"]),
            "nested": {"k": r.randrange(3), "l": [r.randrange(2)]}}


def _namespace(r: random.Random, min_len: int = 1) -> tuple[str, ...]:
    return tuple(r.choice(_LABELS) for _ in range(r.randint(min_len, 3)))


def _filter(r: random.Random) -> dict[str, Any] | None:
    return r.choice([None, {"n": r.randrange(5)}, {"tag": "red"},
                     {"n": {"$gt": r.randrange(4)}}, {"n": {"$lte": 2, "$ne": 1}},
                     {"nested": {"k": r.randrange(3)}}, {"nested": {"l": [1]}}])


def _same(a: Any, b: Any) -> bool:
    return (a is None and b is None) or (
        a is not None and b is not None and (a.namespace, a.key, a.value) == (b.namespace, b.key, b.value)
        and a.created_at <= a.updated_at)


@settings(max_examples=25)
@given(st.integers(0, 2**32 - 1))
def test_kvcommstore_gives_inmemorystores_results(seed: int) -> None:
    """The same random operations on KVCommStore and LangGraph's InMemoryStore give the
    same results. Two documented differences are taken out of the reference: search
    results come in key order (InMemoryStore: insertion order), so the reference's full
    result is sorted by KVCOMM key before paging; and a namespace lists while it holds an
    item (InMemoryStore also keeps namespaces emptied by deletes or touched by a get)."""
    print(f"seed={seed}")
    r = random.Random(seed)
    from kvcomm.tiers import l2

    name = f"test-lgstore-{seed}-{r.randrange(1 << 30)}"
    try:
        with kvcomm.open(name, config=kvcomm.Config.from_mapping(
                {"cache": {"l2_size": "16MB", "watch_buffer": 4096}})) as kv:
            ours, ref = KVCommStore(kv), InMemoryStore()
            for step in range(60):
                op = r.choice(["put", "put", "put", "delete", "get", "search", "search", "list"])
                where = f"seed={seed} step={step} op={op}"
                if op == "put":
                    ns, key, val = _namespace(r), r.choice(_KEYS), _value(r)
                    ours.put(ns, key, val)
                    ref.put(ns, key, val)
                elif op == "delete":
                    ns, key = _namespace(r), r.choice(_KEYS)
                    ours.delete(ns, key)
                    ref.delete(ns, key)
                elif op == "get":
                    ns, key = _namespace(r), r.choice(_KEYS)
                    assert _same(ours.get(ns, key), ref.get(ns, key)), where
                elif op == "search":
                    prefix = _namespace(r, 0)
                    flt, limit, offset = _filter(r), r.choice([1, 2, 5, 100]), r.choice([0, 0, 1, 3])
                    got = ours.search(prefix, filter=flt, limit=limit, offset=offset)
                    full = sorted(ref.search(prefix, filter=flt, limit=10**6),
                                  key=lambda i: ours.keys.item(i.namespace, i.key).encode())
                    want = full[offset:offset + limit]
                    assert len(got) == len(want), (where, got, want)
                    assert all(_same(g, w) for g, w in zip(got, want, strict=True)), where
                else:
                    for gone in [n for n, items in ref._data.items() if not items]:
                        del ref._data[gone]  # (the reference's empty namespaces: see above)
                    kw: dict[str, Any] = {"limit": r.choice([2, 100]), "offset": r.choice([0, 1])}
                    if r.random() < 0.5:
                        kw["prefix"] = _namespace(r)[: r.randint(1, 2)]
                    if r.random() < 0.3:
                        kw["suffix"] = (r.choice(_LABELS + ["*"]),)
                    if r.random() < 0.4:
                        kw["max_depth"] = r.randint(1, 2)
                    assert ours.list_namespaces(**kw) == ref.list_namespaces(**kw), (where, kw)
    finally:
        l2.purge(name)


def test_a_put_keeps_created_at_and_moves_updated_at(kv: kvcomm.Client) -> None:
    store = KVCommStore(kv)
    store.put(("u", "1"), "prefs", {"theme": "dark"})
    first = store.get(("u", "1"), "prefs")
    store.put(("u", "1"), "prefs", {"theme": "light"})
    second = store.get(("u", "1"), "prefs")
    assert first is not None and second is not None and second.value == {"theme": "light"}
    assert second.created_at == first.created_at and second.updated_at >= first.updated_at


def test_a_query_without_an_index_is_refused_clearly(kv: kvcomm.Client) -> None:
    with pytest.raises(kvcomm.InvalidArgument, match="semantic"):
        KVCommStore(kv).search(("docs",), query="python")


def test_the_async_store_methods(kv: kvcomm.Client) -> None:
    store = KVCommStore(kv)

    async def run() -> list[Any]:
        await store.aput(("m", "a"), "x", {"v": 1})
        await store.aput(("m", "b"), "y", {"v": 2})
        return [await store.aget(("m", "a"), "x"), await store.asearch(("m",), filter={"v": 2}),
                await store.alist_namespaces(prefix=("m",))]

    got, found, namespaces = asyncio.run(run())
    assert got.value == {"v": 1} and [i.key for i in found] == ["y"]
    assert namespaces == [("m", "a"), ("m", "b")]



# ---------------------------------------------------------------- the README's example


def test_the_three_agent_example_runs(ns: str) -> None:
    """examples/langgraph_agents.py: three processes share memories through the store."""
    example = Path(__file__).resolve().parent.parent / "examples" / "langgraph_agents.py"
    out = subprocess.run([sys.executable, str(example), "--namespace", ns],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "report: 12 observations, mean 21.86 C, 1 over 30 C: obs-02" in out.stdout, out.stdout
    for role in ("scout", "analyst", "writer"):
        assert f"[{role}] done" in out.stdout


def test_heads_only_move_forward_whoever_moved_them_last(ns: str, config: kvcomm.Config) -> None:
    """Two savers (two processes of a host) put checkpoints of one thread in turns: each
    saver's remembered head goes stale, its compare-and-set fails and it reads again;
    the head is always the greatest id put, an older put never moves it back."""
    from langgraph.checkpoint.base import empty_checkpoint

    with kvcomm.open(ns, config=config) as a, kvcomm.open(ns, config=config) as b:
        sa, sb = KVCommSaver(a), KVCommSaver(b)
        cps = [empty_checkpoint() for _ in range(6)]
        assert [c["id"] for c in cps] == sorted(c["id"] for c in cps)
        cfg: Any = {"configurable": {"thread_id": "shared", "checkpoint_ns": ""}}
        for i, cp in enumerate(cps[1:], start=1):
            (sa if i % 2 else sb).put(cfg, cp, {"step": i}, {})
            assert a.get(sa.keys.head("shared", ""))["id"] == cp["id"]
            assert sb.get_tuple(cfg).checkpoint["id"] == cp["id"]  # type: ignore[union-attr]
        sa.put(cfg, cps[0], {"step": 0}, {})  # an older checkpoint (a replay, a copy)
        assert sb.get_tuple(cfg).checkpoint["id"] == cps[-1]["id"]  # type: ignore[union-attr]
        assert len(list(sa.list(cfg))) == 6
        # (the stale remembered heads were refused: each saver's client counted conflicts)
        assert a.counters["conflicts"] >= 2 and b.counters["conflicts"] >= 1
