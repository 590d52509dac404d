"""The LangGraph records fuzzer: hostile records under KVCommSaver's and KVCommStore's keys.

Each case builds a realistic thread and store under a fresh key root (a graph run to its
interrupt: checkpoints, channel values, pending writes, the head; store items in two
namespaces), then plants one to three hostile records: a record replaced by junk, one
field of it replaced (a head's ``id``/``w``/``p``, a checkpoint's serialized parts, a
store item's times...), a serializer payload that no serializer reads back (deeply nested
JSON or msgpack, a ``pickle``, a type that is not a str), or a key of an unexpected shape
under the thread's prefixes. Every public method of the saver and the store then runs
(``OPS``); each must return or raise a KVCommError (CorruptRecord for what it read):
never another exception. (A graph run over a record that decodes, but to a value its
channel does not expect, fails in LangGraph's own code: the saver cannot know a graph's
channel types, so the graph's methods are not among ``OPS``.) Then the thread and the
namespace stay usable: deleting the thread and the planted items works, and a graph run
and a store put afterwards read back.

Used by tests/integrations/test_fuzz_langgraph.py (a bounded, seeded run in ``make test``, a longer one
marked slow). Replay one case: ``LG_FUZZ_SEED=<seed> LG_FUZZ_CASE=<n> .venv/bin/python -m
pytest -q tests/integrations/test_fuzz_langgraph.py -k bounded``.
"""

from __future__ import annotations

import json
import random
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
from langgraph.checkpoint.base import empty_checkpoint

import kvcomm
from kvcomm.integrations.langgraph import KVCommSaver, KVCommStore

DEEP = 20_000  # nesting of the deep payloads: past Python's recursion limit


@dataclass
class Failure:
    case: int
    step: str
    error: str
    where: str


@dataclass
class Outcome:
    case: int
    planted: list[str] = field(default_factory=list)
    corrupt: int = 0  # calls that raised CorruptRecord
    failures: list[Failure] = field(default_factory=list)


# ---------------------------------------------------------------- hostile values


def junk(r: random.Random, depth: int = 0) -> Any:
    """A value kv.put stores that no KVCommSaver/KVCommStore record looks like."""
    scalars: list[Any] = [None, True, False, 0, -1, 7, 2**63, -(2**63), 10**18, 1.5,
                          float("nan"), float("inf"), "", "x", "lg/", "%2F", b"", b"\x00\xff",
                          "json", "msgpack", "empty"]
    k = r.random()
    if depth >= 3 or k < 0.5:
        return r.choice(scalars)
    if k < 0.75:
        return [junk(r, depth + 1) for _ in range(r.randrange(0, 7))]
    return {r.choice(["id", "w", "p", "x", "", "0"]): junk(r, depth + 1)
            for _ in range(r.randrange(0, 4))}


def payload(r: random.Random) -> list[Any]:
    """A (type, bytes) pair a serializer cannot read back as anything KVCOMM wrote."""
    deep_json = b"[" * DEEP + b"]" * DEEP
    deep_dict = b'{"a":' * DEEP + b"1" + b"}" * DEEP
    deep_msgpack = b"\x91" * DEEP + b"\xc0"
    return r.choice([
        ["json", deep_json], ["json", deep_dict], ["msgpack", deep_msgpack],
        ["json", b"{not json"], ["msgpack", bytes(r.randrange(256) for _ in range(12))],
        ["pickle", b"\x80\x04K\x01."], ["bytes", b"raw"], ["null", b""], ["empty", b""],
        ["json", b"5"], ["json", b'"s"'], ["json", b"[1, 2]"], ["json", b'{"channel_versions": 5}'],
        ["json", json.dumps({"channel_versions": {"c": [1]}, "id": 1}).encode()],
        ["msgpack", msgpack.packb({"channel_versions": {"c": 1.5}})],
        ["msgpack", msgpack.packb([1, 2, 3])], [5, b""], ["json", "not bytes"], [None, None],
        ["unknown", b"x"],
    ])


def mutate(r: random.Random, value: Any) -> Any:
    """``value`` (a record KVCOMM holds) with one part made hostile, or replaced whole."""
    k = r.random()
    if k < 0.25 or not isinstance(value, list | dict) or not value:
        return junk(r) if r.random() < 0.7 else payload(r)
    if isinstance(value, dict):
        v = dict(value)
        key = r.choice([*v, "p", "w", "id"])
        if r.random() < 0.2:
            v.pop(key, None)
        elif r.random() < 0.3 and key in ("w", "p"):
            v[key] = r.choice([[junk(r)], [[junk(r), junk(r)]], {"c": junk(r)},
                               {"9" * 32: [[1]]}, [[1, 2, 3]]])
        else:
            v[key] = junk(r)
        return v
    v = list(value)
    i = r.randrange(len(v))
    c = r.random()
    if c < 0.35 and len(v) >= 2:  # a serialized part (type, bytes) made hostile
        j = r.randrange(0, len(v) - 1, 2) if len(v) > 2 else 0
        v[j:j + 2] = payload(r)
    elif c < 0.55:
        del v[r.randrange(len(v)):]
    elif c < 0.65:
        v.extend(junk(r) for _ in range(r.randrange(1, 3)))
    else:
        v[i] = junk(r)
    return v


# ---------------------------------------------------------------- the realistic base


class World:
    """One case's thread and store under their own key root."""

    def __init__(self, kv: kvcomm.Client, case: int) -> None:
        from tests.integrations.test_langgraph import build_graph  # (the conformance tests' graph)

        self.kv = kv
        self.root = f"fz{case}/"
        self.thread = f"t{case}"
        self.saver = KVCommSaver(kv, root=self.root)
        self.store = KVCommStore(kv, root=self.root)
        self.cfg = {"configurable": {"thread_id": self.thread}}
        graph = build_graph().compile(checkpointer=self.saver)
        graph.invoke({"steps": [], "answer": ""}, self.cfg)  # (stops at the interrupt)
        self.graph = graph
        self.cids = [t.checkpoint["id"] for t in self.saver.list(self.cfg)]
        self.run_ids = sorted({str(t.metadata.get("run_id")) for t in self.saver.list(self.cfg)})
        self.items = [(("mem", "a"), "k1"), (("mem", "a"), "k2"), (("mem",), "k3"),
                      (("other",), "k4")]
        for i, (ns, key) in enumerate(self.items):
            self.store.put(ns, key, {"n": i, "tag": "red" if i % 2 else "blue",
                                     "nested": {"k": i}})

    def keys(self) -> list[str]:
        return [it.key for it in self.kv.scan(self.root)]


def plant(r: random.Random, w: World) -> list[str]:
    """Plant 1-3 hostile records; returns what was planted (for the report)."""
    done = []
    k = w.saver.keys
    t, n, c = w.thread, "", w.cids[0]
    odd_keys = [
        k.checkpoints + f"{t}/{n}/{c}/extra",  # (a checkpoint key of four components)
        k.checkpoints + f"{t}/x",  # (two)
        k.writes + f"{t}/{n}/{c}/task/notint",  # (a write index that is not an int)
        k.writes + f"{t}/{n}/{c}/task",
        k.heads + f"{t}/a/b/",  # (a head of two namespaces)
        k.blobs + f"{t}/{n}/steps",
        k.store + "a/b",  # (a store key without its '/=' mark)
        k.store + "=k",
    ]
    for _ in range(r.randint(1, 3)):
        if r.random() < 0.2:
            key = r.choice(odd_keys)
            value = junk(r) if r.random() < 0.5 else mutate(r, w.kv.get(r.choice(w.keys())))
        else:
            key = r.choice(w.keys())
            value = mutate(r, w.kv.get(key))
        try:
            w.kv.put(key, value)
        except kvcomm.KVCommError:  # (a value kv.put refuses: nothing planted)
            continue
        done.append(f"{key} = {_short(value)}")
    return done


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) < 120 else s[:100] + f"... ({len(s)} chars)"


# ---------------------------------------------------------------- every method


def _id_cfg(w: World, cid: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": w.thread, "checkpoint_ns": "", "checkpoint_id": cid}}


def _new_checkpoint(w: World) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    cp = empty_checkpoint()
    version = w.saver.get_next_version(None, None)
    cp["channel_values"] = {"steps": ["fuzz"]}
    cp["channel_versions"] = {"steps": version}
    return cp, {"source": "update", "step": 9, "run_id": "fuzz-run"}, {"steps": version}


OPS: list[tuple[str, Callable[[World], Any]]] = [
    ("saver.get_tuple", lambda w: w.saver.get_tuple(w.cfg)),
    ("saver.get_tuple(id)", lambda w: [w.saver.get_tuple(_id_cfg(w, c)) for c in w.cids]),
    ("saver.list", lambda w: list(w.saver.list(w.cfg))),
    ("saver.list(None)", lambda w: list(w.saver.list(None))),
    ("saver.list(filter)", lambda w: list(w.saver.list(w.cfg, filter={"step": 1}))),
    ("saver.list(before)", lambda w: list(w.saver.list(w.cfg, before=_id_cfg(w, w.cids[0]),
                                                       limit=2))),
    ("saver.put_writes", lambda w: w.saver.put_writes(_id_cfg(w, w.cids[0]),
                                                      [("steps", ["x"])], "task-fz")),
    ("saver.put", lambda w: w.saver.put(w.cfg, *_new_checkpoint(w))),
    ("saver.copy_thread", lambda w: w.saver.copy_thread(w.thread, w.thread + "-copy")),
    ("saver.list(copy)", lambda w: list(w.saver.list(
        {"configurable": {"thread_id": w.thread + "-copy"}}))),
    ("saver.delete_for_runs", lambda w: w.saver.delete_for_runs(w.run_ids[:1])),
    ("saver.prune", lambda w: w.saver.prune([w.thread])),
    ("store.get", lambda w: [w.store.get(ns, k) for ns, k in w.items]),
    ("store.search", lambda w: w.store.search(("mem",), limit=50)),
    ("store.search(all)", lambda w: w.store.search((), limit=50)),
    ("store.search(filter)", lambda w: w.store.search(("mem",), filter={"nested": {"k": 1}})),
    ("store.search($gt)", lambda w: w.store.search((), filter={"n": {"$gt": 0}})),
    ("store.list_namespaces", lambda w: w.store.list_namespaces(prefix=("mem",))),
    ("store.put", lambda w: [w.store.put(ns, k, {"n": 9}) for ns, k in w.items]),
]


def run_case(kv: kvcomm.Client, seed: int, case: int) -> Outcome:
    """Build, plant, run every method, then check the thread and namespace stay usable."""
    r = random.Random(seed * 1_000_003 + case)
    w = World(kv, case)
    out = Outcome(case, plant(r, w))
    ops = list(OPS)
    r.shuffle(ops)
    for name, op in ops:
        _step(out, name, lambda op=op: op(w))
    # usable afterwards: the thread deleted and run again, the planted items deleted
    def again() -> None:
        w.saver.delete_thread(w.thread)
        w.saver.delete_thread(w.thread + "-copy")
        w.graph.invoke({"steps": [], "answer": ""}, w.cfg)
        got = w.saver.get_tuple(w.cfg)
        assert got is not None and got.checkpoint["channel_values"]["steps"] == ["plan"], got
        for ns, k in w.items:
            w.store.delete(ns, k)
        for key in w.keys():
            if key.startswith(w.saver.keys.store):
                w.kv.delete(key)  # (planted keys of no item: kv.delete, as a user would)
        w.store.put(("mem", "a"), "k1", {"n": 1})
        item = w.store.get(("mem", "a"), "k1")
        assert item is not None and item.value == {"n": 1}
        assert [i.key for i in w.store.search(("mem",))] == ["k1"]

    _step(out, "usable afterwards", again, allow_corrupt=False)
    for key in w.keys():
        kv.delete(key)
    return out


def _step(out: Outcome, name: str, fn: Callable[[], Any], allow_corrupt: bool = True) -> None:
    try:
        fn()
    except kvcomm.CorruptRecord as exc:
        if allow_corrupt:
            out.corrupt += 1
        else:
            out.failures.append(Failure(out.case, name, f"CorruptRecord: {exc}", _where(exc)))
    except kvcomm.KVCommError:
        pass
    except Exception as exc:  # (what the fuzzer looks for: anything else)
        out.failures.append(Failure(out.case, name, f"{type(exc).__name__}: {str(exc)[:200]}",
                                    _where(exc)))


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "kvcomm" in f.filename] or frames
    f = ours[-1]
    return f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}"


def summarize(outcomes: list[Outcome], seed: int) -> str:
    failures = [f for o in outcomes for f in o.failures]
    lines = [f"LG_FUZZ_SEED={seed}: {len(outcomes)} cases, "
             f"{sum(o.corrupt for o in outcomes)} calls raised CorruptRecord, "
             f"{len(failures)} raised something else"]
    by_kind: dict[tuple[str, str], list[Failure]] = {}
    for f in failures:
        by_kind.setdefault((f.step, f.error.split(":")[0] + " @ " + f.where), []).append(f)
    for (step, kind), fs in sorted(by_kind.items(), key=lambda kv: -len(kv[1])):
        o = next(o for o in outcomes if o.case == fs[0].case)
        lines.append(f"  {len(fs)} x {step}: {kind} (first: case {fs[0].case}: "
                     f"{fs[0].error[:160]}; planted {o.planted})")
    return "\n".join(lines)
