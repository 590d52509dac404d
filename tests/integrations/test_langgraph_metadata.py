"""The saver's own ``_metadata`` is LangGraph's ``get_checkpoint_metadata``: the same dict,
keys in the same order, for any config a caller or a running graph passes (a ChainMap of
dicts as LangGraph builds, plain dicts, other mappings, absent parts, NUL bytes in strings).
Upgrading LangGraph to a version whose function differs fails here."""

from __future__ import annotations

from collections import ChainMap, OrderedDict
from typing import Any

import pytest

pytest.importorskip("langgraph.checkpoint.base")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from langgraph.checkpoint.base import EXCLUDED_METADATA_KEYS, get_checkpoint_metadata  # noqa: E402

from kvcomm.integrations.langgraph.saver import _metadata  # noqa: E402

# (keys that collide across parts, excluded ones, private ones, and free text)
_keys = st.sampled_from(sorted(EXCLUDED_METADATA_KEYS) + ["__pregel_x", "__", "run_id", "source",
                                                          "step", "user", "a\x00b"]) | st.text(max_size=6)
_values = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
           | st.text(alphabet="ab\x00", max_size=4) | st.lists(st.integers(), max_size=2)
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
