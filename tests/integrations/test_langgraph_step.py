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
    """Keys.step and .step_writes (C, for ids the memo holds) give what the Python methods
    give, keys or InvalidKey, before the memo holds the thread and after."""
    from kvcomm.integrations.langgraph._keys import Keys

    keys = Keys("lg/", max_bytes)
    for _ in range(2):  # (the first call fills the memo, the second takes it)
        assert _outcome(keys.step, thread, ns, cid) == _outcome(keys._step, thread, ns, cid)
        assert _outcome(keys.step_writes, thread, ns, cid, task, indices) == _outcome(
            keys._step_writes, thread, ns, cid, task, indices)
    assert _outcome(keys.step_writes, thread, ns, cid, task, [True, 2.0]) == _outcome(
        keys._step_writes, thread, ns, cid, task, [True, 2.0])
