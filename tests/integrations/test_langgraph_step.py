"""What the saver does at each step of a graph, in C (``_l2core_c/lgstep.c``), equals the
Python it stands for, written out here as the reference:

* ``_metadata`` is LangGraph's ``get_checkpoint_metadata``: the same dict, keys in the
  same order, for any config a caller or a running graph passes (a ChainMap of dicts as
  LangGraph builds, plain dicts, other mappings, absent parts, NUL bytes in strings, str
  subclasses). Upgrading LangGraph to a version whose function differs fails here.
* ``checkpoint_record`` is put's record and its inlined channels (``inline`` below: which
  values a checkpoint's record holds);
* ``task_records`` is put_writes' records, for every shape of writes;
* ``NoPickle.dumps_typed`` is the inner serializer's answer, judged.
"""

from __future__ import annotations

from collections import ChainMap, OrderedDict, deque
from typing import Any

import pytest

pytest.importorskip("langgraph.checkpoint.base")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from langgraph.checkpoint.base import (  # noqa: E402
    EXCLUDED_METADATA_KEYS,
    WRITES_IDX_MAP,
    get_checkpoint_metadata,
)

import kvcomm  # noqa: E402
from kvcomm._l2core import checkpoint_record, task_records  # noqa: E402
from kvcomm.integrations.langgraph._serde import _PICKLE_TYPES, no_pickle  # noqa: E402
from kvcomm.integrations.langgraph.saver import _metadata  # noqa: E402


class Text(str):
    """A str subclass: its replace is its own (LangGraph's function calls it)."""

    def replace(self, old: str, new: str, count: int = -1) -> str:  # type: ignore[override]
        return "replaced"

# (keys that collide across parts, excluded ones, private ones, and free text)
_keys = st.sampled_from(sorted(EXCLUDED_METADATA_KEYS) + ["__pregel_x", "__", "run_id", "source",
                                                          "step", "user", "a\x00b"]) | st.text(max_size=6)
_values = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
           | st.text(alphabet="ab\x00", max_size=4) | st.lists(st.integers(), max_size=2)
           | st.text(alphabet="a\x00", max_size=2).map(Text)
           | st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))
_dicts = st.dictionaries(_keys, _values, max_size=6)
_parts = (st.none() | _dicts | st.lists(_dicts, max_size=3).map(lambda ms: ChainMap(*ms))
          | st.lists(_dicts, min_size=1, max_size=2).map(
              lambda ms: ChainMap(OrderedDict(ms[0]), *ms[1:]))
          | _dicts.map(OrderedDict))


@st.composite
def _configs(draw: st.DrawFn) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for part in ("metadata", "configurable"):
        if draw(st.booleans()):
            config[part] = draw(_parts)
    return config


@settings(max_examples=400)
@given(_configs(), _dicts)
def test_the_savers_metadata_is_langgraphs(config: dict[str, Any], metadata: dict[str, Any]) -> None:
    want = get_checkpoint_metadata(config, dict(metadata))  # type: ignore[arg-type]
    got = _metadata(config, dict(metadata))  # type: ignore[arg-type]
    assert list(got.items()) == list(want.items())
    assert type(got) is dict


def test_a_running_graphs_config_takes_the_fast_path_and_agrees() -> None:
    # (the shape LangGraph passes: a ChainMap of dicts, a later map's key shadowed)
    config = {"metadata": ChainMap({"thread_id": "t", "user": "ann\x00"}, {"user": "bob", "k": 1}),
              "configurable": {"thread_id": "t", "checkpoint_ns": "", "__pregel_runtime": object(),
                               "checkpoint_id": "1", "tenant": "x"}}
    md = {"source": "loop", "step": 3, "parents": {}}
    got = _metadata(config, md)  # type: ignore[arg-type]
    assert list(got.items()) == list(get_checkpoint_metadata(config, md).items())  # type: ignore[arg-type]
    assert got == {"source": "loop", "step": 3, "parents": {}, "user": "ann", "k": 1, "tenant": "x"}


def test_a_config_part_with_keys_that_are_not_str_raises_as_langgraphs_does() -> None:
    config = {"metadata": {1: "x"}, "configurable": {"thread_id": "t"}}
    with pytest.raises(AttributeError) as want:
        get_checkpoint_metadata(config, {})  # type: ignore[arg-type]
    with pytest.raises(AttributeError) as got:
        _metadata(config, {})  # type: ignore[arg-type]
    assert str(got.value) == str(want.value)
    # (a bool, an int subclass and a float are kept as they are; a list is not)
    config = {"metadata": {"a": True, "b": 2.5, "c": [1]}, "configurable": None}
    assert _metadata(config, {}) == get_checkpoint_metadata(config, {}) == {  # type: ignore[arg-type]
        "a": True, "b": 2.5}


# ---------------------------------------------------------------- checkpoint_record


def inline(value: Any) -> bool:
    """Whether a channel value is kept in the record of every checkpoint that has it (as
    LangGraph's Postgres saver keeps primitives in its checkpoint row), not in a record of
    its own: None, a bool, int or float, a str of at most 256 characters, exact types."""
    t = type(value)
    return t is int or t is float or t is bool or value is None or (t is str and len(value) <= 256)


def _checkpoint_record(dumps: Any, c: Any, md: dict[str, Any], parent: Any,
                       values: dict[str, Any]) -> tuple[list[Any], set[str]]:
    record = [*dumps(c), *dumps(md), parent, md.get("run_id")]
    inlined = set()
    for channel, value in values.items():
        if inline(value):
            record += (channel, *dumps(value))
            inlined.add(channel)
    return record, inlined


class Number(int):
    pass


_channel_values = (st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 63 - 1)
                   | st.floats(allow_nan=False)
                   | st.text(max_size=300) | st.integers(0, 9).map(Number) | st.binary(max_size=4)
                   | st.lists(st.integers(0, 9), max_size=2) | st.text(max_size=2).map(Text))


@settings(max_examples=300)
@given(st.dictionaries(st.text(max_size=4), _channel_values, max_size=6),
       st.none() | st.text(max_size=4),
       st.none() | st.text(max_size=4) | st.integers(-(2 ** 63), 2 ** 63 - 1))
def test_checkpoint_record_is_puts_record(values: dict[str, Any], parent: str | None,
                                          run: Any) -> None:
    serde = no_pickle(None)
    md = {"source": "loop", "step": 1} if run is None else {"run_id": run, "step": 1}
    cp = {"v": 4, "id": "1", "channel_versions": {ch: "1" for ch in values}}
    want = _checkpoint_record(serde.dumps_typed, cp, md, parent, values)
    assert checkpoint_record(serde.dumps_typed, cp, md, parent, values) == want


def test_checkpoint_record_takes_any_sequence_a_serializer_gives_and_raises_what_it_raises(
        ) -> None:
    calls: list[Any] = []

    def as_list(obj: Any) -> Any:
        calls.append(obj)
        return ["t", b"x"]

    assert checkpoint_record(as_list, {}, {}, None, {"a": 1, "b": [2]}) == (
        ["t", b"x", "t", b"x", None, None, "a", "t", b"x"], {"a"})
    assert calls == [{}, {}, 1]

    def fails(obj: Any) -> Any:
        if obj == 2:
            raise KeyError("two")
        return ("t", b"x")

    with pytest.raises(KeyError, match="two"):
        checkpoint_record(fails, {}, {}, None, {"a": 1, "b": 2})
    values = {"a": 1, "b": 2}

    def grows(obj: Any) -> Any:  # (a serializer that changes the values under the loop)
        if obj == 1:
            values["c"] = 3
        return ("t", b"x")

    with pytest.raises(RuntimeError, match="changed size"):
        checkpoint_record(grows, {}, {}, None, values)
    with pytest.raises(TypeError):
        checkpoint_record(grows, {}, [], None, values)  # type: ignore[arg-type]


# ---------------------------------------------------------------- task_records


def _task_records(dumps: Any, writes: Any, task_id: str, task_path: str,
                  idx_map: dict[str, int]) -> tuple[list[Any], list[int], list[int]]:
    records: list[Any] = []
    indices: list[int] = []
    regular: list[int] = []
    for idx, (channel, value) in enumerate(writes):
        i = idx_map.get(channel, idx)
        if i >= 0:
            regular.append(len(indices))
        indices.append(i)
        records.append([task_id, channel, *dumps(value), task_path])
    return records, indices, regular


_writes = st.lists(st.tuples(st.sampled_from(["a", "b", *WRITES_IDX_MAP]), _channel_values),
                   max_size=6)


@settings(max_examples=300)
@given(_writes, st.sampled_from([list, tuple, deque]), st.booleans())
def test_task_records_is_put_writes_records(writes: list[tuple[str, Any]], shape: Any,
                                            as_lists: bool) -> None:
    serde = no_pickle(None)
    pairs = [list(w) if as_lists else w for w in writes]
    want = _task_records(serde.dumps_typed, pairs, "task", "path", WRITES_IDX_MAP)
    assert task_records(serde.dumps_typed, shape(pairs), "task", "path", WRITES_IDX_MAP) == want


def test_task_records_leaves_every_other_shape_to_the_python_loop() -> None:
    class Pair(tuple):  # type: ignore[type-arg]
        pass

    class Writes(list):  # type: ignore[type-arg]
        pass

    dumps = no_pickle(None).dumps_typed
    gen = (w for w in [("a", 1)])
    for writes in [[("a", 1, 2)], [("a",)], ["ab"], [(1, 1)], [Pair(("a", 1))],
                   [(Text("a"), 1)], Writes([("a", 1)]), gen, {"a": 1}]:
        assert task_records(dumps, writes, "t", "", WRITES_IDX_MAP) is None, writes
    assert next(gen) == ("a", 1)  # (nothing consumed)


def test_put_writes_takes_any_shape_of_pairs_and_refuses_anything_else(kv: kvcomm.Client) -> None:
    """Writes as a generator, tuple subclasses or lists are stored as the pairs they are;
    a write that is not a pair with a str channel raises InvalidArgument, and then no
    write of the call is serialized or stored."""
    from langgraph.checkpoint.base import empty_checkpoint

    from kvcomm.integrations.langgraph import KVCommSaver

    class Pair(tuple):  # type: ignore[type-arg]
        pass

    saver = KVCommSaver(kv)
    config = saver.put({"configurable": {"thread_id": "t-shapes", "checkpoint_ns": ""}},
                       empty_checkpoint(), {}, {})
    saver.put_writes(config, (w for w in [Pair(("a", 1)), ["b", 2]]), "task-1")
    tup = saver.get_tuple(config)
    assert tup is not None and tup.pending_writes == [("task-1", "a", 1), ("task-1", "b", 2)]
    seen: list[Any] = []
    inner = saver.serde.inner
    saver.serde.inner = type("Seeing", (), {"dumps_typed": staticmethod(
        lambda obj: (seen.append(obj), inner.dumps_typed(obj))[1])})()
    for bad in [[("c", 3), ("ab")], [("c", 3), (1, 2)], [("c", 3), ("c", 3, 4)], [("c", 3), None]]:
        with pytest.raises(kvcomm.InvalidArgument, match=r"\(channel, value\) pairs"):
            saver.put_writes(config, bad, "task-2")
    assert seen == []
    saver.serde.inner = inner
    tup = saver.get_tuple(config)
    assert tup is not None and len(tup.pending_writes or []) == 2


# ---------------------------------------------------------------- NoPickle.dumps_typed


def test_the_serializers_c_half_refuses_every_pickle_type_and_converts_type_errors() -> None:
    from unittest import mock

    serde = no_pickle(None)
    for name in _PICKLE_TYPES:
        serde.inner = mock.Mock(dumps_typed=mock.Mock(return_value=(name, b"x")))
        with pytest.raises(kvcomm.UnsupportedValue, match="as a pickle"):
            serde.dumps_typed(1)
    for exc, want in [(TypeError("not msgpack serializable"), kvcomm.UnsupportedValue),
                      (kvcomm.UnsupportedValue("own"), kvcomm.UnsupportedValue),
                      (KeyError("k"), KeyError), (KeyboardInterrupt(), KeyboardInterrupt)]:
        serde.inner = mock.Mock(dumps_typed=mock.Mock(side_effect=exc))
        with pytest.raises(want) as got:
            serde.dumps_typed(object())
        if want is not kvcomm.UnsupportedValue or type(exc) is kvcomm.UnsupportedValue:
            assert got.value is exc  # (raised as it was)
        else:
            assert "cannot be serialized without pickle" in str(got.value)


# ---------------------------------------------------------------- keys

_ids = (st.sampled_from(["t", "", "1f1f0408-1c93-668a-bfff-b6e2fff6bbbf", "a/b", "%", "é" * 3,
                         "\udcff", "x" * 200]) | st.text(max_size=8))


def _outcome(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except kvcomm.KVCommError as exc:
        return type(exc), str(exc)


@settings(max_examples=400)
@given(_ids, _ids, _ids, _ids, st.lists(st.integers(-4, 12), max_size=3),
       st.sampled_from([60, 120, 250]))
def test_the_step_keys_in_c_are_the_python_methods(thread: str, ns: str, cid: str, task: str,
                                                   indices: list[int], max_bytes: int) -> None:
    """Keys.step and .step_writes in C (``Keys.in_c()``, for ids the memo holds) give what
    the methods give, keys or InvalidKey, before the memo holds the thread and after."""
    from kvcomm.integrations.langgraph._keys import Keys

    keys = Keys("lg/", max_bytes)
    step, step_writes = keys.in_c()
    for _ in range(2):  # (the first call fills the memo, the second takes it)
        assert _outcome(step, thread, ns, cid) == _outcome(keys.step, thread, ns, cid)
        assert _outcome(step_writes, thread, ns, cid, task, indices) == _outcome(
            keys.step_writes, thread, ns, cid, task, indices)
    assert _outcome(step_writes, thread, ns, cid, task, [True, 2.0]) == _outcome(
        keys.step_writes, thread, ns, cid, task, [True, 2.0])


# ---------------------------------------------------------------- what a review tried

_HOSTILE = r'''
from collections import ChainMap
from langgraph.checkpoint.base import get_checkpoint_metadata
from kvcomm.integrations.langgraph.saver import _metadata

def outcome(fn, make):
    config, metadata = make()
    try:
        return ("ok", sorted(map(repr, fn(config, metadata).items())))
    except Exception as exc:
        return (type(exc).__name__, str(exc)[:40])

def clearing_config():  # (a metadata key whose __eq__ empties the config's part)
    key = "".join(["us", "er"]); h = hash(key)
    class K:
        def __hash__(self): return h
        def __eq__(self, o): config["metadata"].clear(); return False
    config = {"metadata": {key: "".join(["v"] * 40)}, "configurable": {}}
    return config, {K(): 1}

def clearing_maps():  # (a key of a ChainMap's map whose __eq__ empties its maps)
    class K:
        def __hash__(self): return 7
        def __eq__(self, o): cm.maps.clear(); return False
    cm = ChainMap(*[{"a%d" % i: "x"} for i in range(30)], {K(): 1}, {K(): 2})
    return {"metadata": cm}, {}

def raising_first():  # (metadata's key raises on hashing, the config's on comparing)
    armed = []
    class H:
        def __hash__(self):
            if armed: raise ValueError("hash")
            return 1
    class E:
        def __hash__(self): return hash("metadata")
        def __eq__(self, o):
            if armed: raise KeyError("eq")
            return False
    config, metadata = {E(): 1, "metadata": {}}, {H(): 1}
    armed.append(1)
    return config, metadata

for make in (clearing_config, clearing_maps, raising_first):
    got, want = outcome(_metadata, make), outcome(get_checkpoint_metadata, make)
    print(make.__name__, "same" if got == want else f"differs: {got} != {want}")
'''


def test_keys_whose_code_changes_the_config_are_judged_as_langgraph_judges_them() -> None:
    """Keys whose ``__eq__`` empties the dict or ChainMap being merged (a use after free
    in C when the review found it) and keys that raise: the same outcome as LangGraph's
    function, in a process of its own (a crash fails the test, not the suite)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _HOSTILE], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["clearing_config", "same", "clearing_maps", "same",
                                  "raising_first", "same"], out.stdout


def test_values_whose_class_is_faked_are_judged_as_isinstance_judges_them() -> None:
    from unittest import mock

    for value in [mock.Mock(spec=str, replace=lambda *a: "spoofed"), mock.Mock(spec=int)]:
        for config, md in [({"metadata": {"k": value}}, {}), ({}, {"k": value})]:
            want = get_checkpoint_metadata(config, md)  # type: ignore[arg-type]
            assert list(_metadata(config, md).items()) == list(want.items())  # type: ignore[arg-type]


def test_a_serializer_answer_of_any_iterable_shape_is_unpacked_as_python_unpacks_it() -> None:
    from collections import namedtuple

    Pair = namedtuple("Pair", "type data")
    for answer in [Pair("t", b"x"), ("t", b"x", "z"), ("ab",), "ab", ["t", b"x"]]:
        dumps: Any = lambda obj, answer=answer: answer  # noqa: E731
        assert checkpoint_record(dumps, {}, {}, None, {"a": 1}) == _checkpoint_record(
            dumps, {}, {}, None, {"a": 1})
        assert task_records(dumps, [("a", 1)], "t", "", WRITES_IDX_MAP) == _task_records(
            dumps, [("a", 1)], "t", "", WRITES_IDX_MAP)


def test_a_serializer_changing_what_it_serializes_meets_what_python_meets() -> None:
    def outcome(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except RuntimeError as exc:
            return str(exc)

    for change in ["swap", "add", "drop", "add after the last"]:
        got = []
        for fn in (checkpoint_record, _checkpoint_record):
            values = {"a": 1, "b": 2}

            def changes(obj: Any, values: dict[str, Any] = values, change: str = change) -> Any:
                if obj == (2 if change == "add after the last" else 1):
                    if change in ("swap", "drop"):
                        del values["b"]
                    if change != "drop":
                        values["c"] = 3
                return ("t", b"x")

            got.append(outcome(fn, changes, {}, {}, None, values))
        assert got[0] == got[1], change
    for shape in (list, deque):
        seen = []
        for fn in (task_records, _task_records):
            writes: Any = shape([("a", 1), ("b", 2)])

            def grows(obj: Any, writes: Any = writes) -> Any:
                if obj == 1:
                    writes.append(("c", 3))
                return ("t", b"x")

            seen.append(outcome(fn, grows, writes, "t", "", WRITES_IDX_MAP))
        assert seen[0] == seen[1], shape


def test_only_a_real_deque_is_taken_for_one() -> None:
    Fake = type("collections.deque", (), {"__iter__": lambda self: iter(self.items)})
    fake = Fake()
    fake.items = iter([("a", 1), "ab"])  # (one pass only)
    assert task_records(no_pickle(None).dumps_typed, fake, "t", "", WRITES_IDX_MAP) is None
    assert next(fake.items) == ("a", 1)  # (nothing consumed)


def test_an_index_is_regular_as_python_compares_it() -> None:
    dumps = no_pickle(None).dumps_typed
    for idx_map in [{"a": float("nan")}, {"a": -0.0}, {"a": 2}]:
        assert task_records(dumps, [("a", 1)], "t", "", idx_map) == _task_records(
            dumps, [("a", 1)], "t", "", idx_map)


def test_the_serializers_c_half_is_called_as_a_python_method_is() -> None:
    import inspect

    serde = no_pickle(None)
    assert serde.dumps_typed(obj=1) == serde.dumps_typed(1)
    assert list(inspect.signature(serde.dumps_typed).parameters) == ["obj"]
    with pytest.raises(TypeError):
        serde.dumps_typed(1, 2)  # type: ignore[call-arg]

    class Broken(type(serde)):  # type: ignore[misc]
        @property
        def inner(self) -> Any:
            raise TypeError("no inner")

        @inner.setter
        def inner(self, value: Any) -> None:
            pass

    with pytest.raises(kvcomm.UnsupportedValue) as got:
        Broken(None).dumps_typed(1)
    assert isinstance(got.value.__context__, TypeError) and got.value.__suppress_context__


def test_langgraphs_own_set_of_excluded_keys_is_read_at_each_call() -> None:
    config = {"metadata": {"tenant": "x"}, "configurable": {"thread_id": "t"}}
    EXCLUDED_METADATA_KEYS.add("tenant")
    try:
        assert _metadata(config, {}) == get_checkpoint_metadata(config, {}) == {}  # type: ignore[arg-type]
    finally:
        EXCLUDED_METADATA_KEYS.discard("tenant")
    assert _metadata(config, {}) == {"tenant": "x"}  # type: ignore[arg-type]


def test_an_id_that_is_not_text_is_an_invalid_key_not_a_corrupt_record(kv: kvcomm.Client) -> None:
    """A lone surrogate in a checkpoint, thread, namespace or task id: InvalidKey, and
    nothing stored (a checkpoint id's was once reported as a corrupt record)."""
    from langgraph.checkpoint.base import empty_checkpoint

    from kvcomm.integrations.langgraph import KVCommSaver

    saver = KVCommSaver(kv)
    for conf, cid, task in [({"thread_id": "t-s1", "checkpoint_ns": ""}, "\ud800", "task"),
                            ({"thread_id": "t-s2\ud800", "checkpoint_ns": ""}, "c1", "task"),
                            ({"thread_id": "t-s3", "checkpoint_ns": "\ud800"}, "c1", "task"),
                            ({"thread_id": "t-s4", "checkpoint_ns": ""}, "c1", "t\ud800")]:
        cp = empty_checkpoint()
        cp["id"] = cid
        with pytest.raises(kvcomm.InvalidKey):
            saver.put_writes(saver.put({"configurable": conf}, cp, {}, {}), [("a", 1)], task)
    assert [i.key for i in kv.scan("lg/") if "t-s4" not in i.key] == []


_COLLECTING = r'''
import gc, sys
from kvcomm.integrations.langgraph._keys import Keys
uu = "1ef4f797-8335-6428-8001-8a1503f9b875"; tid = "thread-" + "x" * 20
keys = Keys("lg/", 250); step, step_writes = keys.in_c(); step(tid, "", uu)
which, j = sys.argv[1], int(sys.argv[2])
L = [10 ** 30 + i for i in range(8)]
class B:
    def __del__(self): keys._tn.clear(); L.clear()
class A:
    def __del__(self):
        global keep; keep = [[] for _ in range(50)]; b = B(); b.self = b
keep2 = [[] for _ in range(200)]
gc.collect(); gc.disable(); a = A(); a.self = a; del a
gc.set_threshold(gc.get_count()[0] + j if which == "writes" else 1); gc.enable()
r = step(tid, "", uu) if which == "step" else step_writes(tid, "", uu, uu, L)
assert all(sys.getrefcount(x) < 100 for x in r), [sys.getrefcount(x) for x in r]
print(r[0] if which == "step" else len(r))
'''


def test_the_keys_in_c_hold_what_they_use_while_a_collection_runs_a_finalizer() -> None:
    """A collection inside step_keys or write_keys whose finalizer clears the memo and the
    indices (use-after-frees when reviews found them), each in a process of its own under
    PYTHONMALLOC=debug: a crash fails the test, not the suite."""
    import os
    import subprocess
    import sys

    runs = [("step", 0)] + [("writes", j) for j in range(7)]  # (j: where the collection lands)
    for which, j in runs:
        out = subprocess.run([sys.executable, "-X", "dev", "-c", _COLLECTING, which, str(j)],
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONMALLOC": "debug"})
        assert out.returncode == 0, (which, j, out.stderr[-2000:])
        if which == "step":
            assert out.stdout.strip() == ("lg/cp/c/thread-xxxxxxxxxxxxxxxxxxxx//"
                                          "1ef4f797-8335-6428-8001-8a1503f9b875")


def test_keys_hold_no_cycle_and_their_c_partials_outlive_their_holder() -> None:
    """A Keys dropped is freed at once, its memo with it; the C partials a caller keeps
    work on after that caller dropped the Keys (and a copy of a Keys is a Keys)."""
    import copy
    import gc
    import weakref

    from kvcomm.integrations.langgraph._keys import Keys

    keys = Keys("lg/", 250)
    step, step_writes = keys.in_c()
    step("t", "", "c")
    gone = weakref.ref(keys)
    copied = copy.copy(keys)
    gc.disable()
    try:
        del keys
        assert gone() is not None  # (the partials hold it)
        assert step("t", "", "a/b") == ("lg/cp/c/t//a%2Fb", "lg/cp/b/t//", "lg/cp/h/t//")
        assert step_writes("t", "", "a/b", "k", [0]) == ["lg/cp/w/t//a%2Fb/k/0"]
        del step, step_writes
        assert gone() is None
    finally:
        gc.enable()
    assert copied.step("t", "", "c") == ("lg/cp/c/t//c", "lg/cp/b/t//", "lg/cp/h/t//")


def test_a_saver_whose_key_memo_is_cleared_at_every_step_keeps_every_thread(
        kv: kvcomm.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """The memo of threads' keys full (``_TN_MEMO``, cleared all at once): with a bound of 2
    and four threads written in turn, the C keys miss the memo at every step and the Python
    fills it again; every checkpoint and write acknowledged reads back, under its keys."""
    from langgraph.checkpoint.base import empty_checkpoint

    from kvcomm.integrations.langgraph import KVCommSaver, _keys

    monkeypatch.setattr(_keys, "_TN_MEMO", 2)
    saver = KVCommSaver(kv)
    threads = [f"t-memo-{i}" for i in range(4)]
    heads: dict[str, Any] = {t: {"configurable": {"thread_id": t, "checkpoint_ns": ""}}
                             for t in threads}
    for step in range(5):
        for t in threads:
            cp = empty_checkpoint()
            heads[t] = saver.put(heads[t], cp, {"step": step}, {})
            saver.put_writes(heads[t], [("a", step)], f"task-{step}")
            assert len(saver.keys._tn) <= 2
    for t in threads:
        tup = saver.get_tuple({"configurable": {"thread_id": t, "checkpoint_ns": ""}})
        assert tup is not None
        assert tup.config["configurable"]["checkpoint_id"] == heads[t]["configurable"]["checkpoint_id"]
        assert tup.metadata["step"] == 4 and tup.pending_writes == [("task-4", "a", 4)]
        assert len(list(saver.list({"configurable": {"thread_id": t}}))) == 5
