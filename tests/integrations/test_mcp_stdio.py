"""``kvcomm.mcp.stdio.request_head`` reads what ``json.loads`` reads of a line's id and
method, without recursing: a property test against ``json.loads`` on any JSON object
(nested values, odd whitespace, escapes, duplicate keys), then the lines ``json.loads``
cannot read (nested 100,000 deep, integers of 5000 digits)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

pytest.importorskip("mcp")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvcomm.mcp.stdio import _NO_ID, request_head  # noqa: E402

_scalars = (st.none() | st.booleans() | st.integers() | st.floats()  # (NaN, Infinity too)
            | st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=6))
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=12)
_keys = st.sampled_from(["id", "method", "jsonrpc", "params", "i", "ids", "id\x00"]) \
    | st.text(max_size=4)


def _expected(pairs: list[tuple[str, Any]]) -> tuple[Any, bool]:
    obj = json.loads(_dumped(pairs, 0))  # (what json.loads reads of the same pairs)
    rid = obj.get("id", _NO_ID)
    return (rid if type(rid) in (int, str) else _NO_ID), "method" in obj


def _dumped(pairs: list[tuple[str, Any]], seed: int) -> str:
    """``pairs`` as one JSON object, duplicates kept, with random whitespace."""
    r = random.Random(seed)
    sp = lambda: r.choice(["", " ", "\t", "\n ", "\r\n"])  # noqa: E731
    body = ",".join(f"{sp()}{json.dumps(k)}{sp()}:{sp()}{json.dumps(v, ensure_ascii=r.random() < .5)}"
                    for k, v in pairs)
    return f"{sp()}{{{body}{sp()}}}{sp()}"


@settings(max_examples=500)
@given(st.lists(st.tuples(_keys, _json), max_size=6), st.integers(0, 2**32))
def test_request_head_reads_what_json_loads_reads(pairs: list[tuple[str, Any]], seed: int) -> None:
    print(f"seed={seed}")
    assert request_head(_dumped(pairs, seed)) == _expected(pairs)


@pytest.mark.parametrize(("line", "head"), [
    ('{"id": 7, "method": "m", "params": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}}",
     (7, True)),
    ('{"params": ' + "{\"a\":" * 50_000 + "1" + "}" * 50_000 + ', "id": "s", "method": 1}',
     ("s", True)),
    ('{"id": 8, "method": "m", "v": ' + "9" * 5000 + "}", (8, True)),
    ('{"id": ' + "9" * 5000 + ', "method": "m"}', (_NO_ID, True)),  # (over 4300 digits)
    ('{"id": 1, "id": "two", "method": "m"}', ("two", True)),  # (the last, as json.loads)
    ('{"id": "\\ud800", "method": "m"}', ("\ud800", True)),
    ('{"v": "]}{[\\"", "id": 3}', (3, False)),  # (brackets inside strings are text)
    ('{"id": 1.0, "method": "m"}', (_NO_ID, True)), ('{"id": true}', (_NO_ID, False)),
    ("[1, 2]", None), ("not json", None), ("", None), ('{"id": 1', None),
    ('{"id": "unterminated', None), ('{"a": [1, 2', None)])
def test_request_head_reads_lines_json_loads_cannot(line: str, head: Any) -> None:
    assert request_head(line) == head
