"""KVCommStore's input checks: tuple-subclass and list namespaces, a refused namespace
not embedded first, scores at any float32 scale agreeing with InMemoryStore."""

from __future__ import annotations

import asyncio
from typing import Any, NamedTuple

import pytest

import kvcomm

pytest.importorskip("langgraph.store.memory")
pytest.importorskip("numpy")

from langgraph.store.memory import InMemoryStore  # noqa: E402

from kvcomm.integrations.langgraph import KVCommStore  # noqa: E402
from tests.integrations.test_store_search import DIMS, fake_embed  # noqa: E402


class UserNS(NamedTuple):
    kind: str
    user: str


def test_a_namedtuple_namespace_works_as_in_inmemorystore(kv: kvcomm.Client) -> None:
    ns = UserNS("memories", "u1")
    ref = InMemoryStore()
    ref.put(ns, "a", {"text": "x"})
    ref_item = ref.get(ns, "a")
    assert ref_item is not None and ref_item.namespace == ("memories", "u1")
    store = KVCommStore(kv)
    store.put(ns, "a", {"text": "x"})
    got = store.get(ns, "a")
    assert got is not None and got.namespace == ("memories", "u1")


def test_a_list_namespace_is_refused_with_the_right_advice(kv: kvcomm.Client) -> None:
    store = KVCommStore(kv)
    with pytest.raises(kvcomm.InvalidArgument) as info:
        store.put(["u", "1"], "a", {"text": "x"})  # type: ignore[arg-type]
    assert "(['u', '1'],)" not in str(info.value)
    assert "('u', '1')" in str(info.value)


def test_a_refused_namespace_is_not_embedded_first(kv: kvcomm.Client) -> None:
    calls: list[list[str]] = []

    def embed(texts: list[str]) -> list[list[float]]:
        calls.append(texts)
        return fake_embed(texts)

    store = KVCommStore(kv, index={"dims": DIMS, "embed": embed, "fields": ["text"]})
    with pytest.raises(kvcomm.InvalidArgument, match="tuple of str labels"):
        store.put("mem", "a", {"text": "maple river"})  # type: ignore[arg-type]
    assert calls == []


def test_a_refused_namespace_is_not_embedded_first_by_aput(ns: str,
                                                           config: kvcomm.Config) -> None:
    import kvcomm.aio

    calls: list[list[str]] = []

    async def aembed(texts: list[str]) -> list[list[float]]:
        calls.append(texts)
        return fake_embed(texts)

    async def run() -> None:
        async with kvcomm.aio.open(ns, config=config) as akv:
            store = KVCommStore(akv, index={"dims": DIMS, "embed": aembed, "fields": ["text"]})
            with pytest.raises(kvcomm.InvalidArgument, match="tuple of str labels"):
                await store.aput("mem", "a", {"text": "maple river"})  # type: ignore[arg-type]
            assert await store.aget(("mem",), "a") is None

    asyncio.run(run())
    assert calls == []


def test_aput_on_an_aio_client_gets_the_same_value_and_nan_checks(ns: str,
                                                                  config: kvcomm.Config) -> None:
    """(sound: checked) the async path refuses what the sync one refuses."""
    import kvcomm.aio

    async def aembed(texts: list[str]) -> list[list[float]]:
        return [[float("nan")] * DIMS if t == "bad" else fake_embed([t])[0] for t in texts]

    async def run() -> Any:
        async with kvcomm.aio.open(ns, config=config) as akv:
            store = KVCommStore(akv, index={"dims": DIMS, "embed": aembed, "fields": ["text"]})
            with pytest.raises(kvcomm.InvalidArgument, match="value is a dict"):
                await store.aput(("u",), "a", "text")  # type: ignore[arg-type]
            with pytest.raises(kvcomm.ConfigError, match="NaN"):
                await store.aput(("u",), "a", {"text": "bad"})
            return await store.aget(("u",), "a")

    assert asyncio.run(run()) is None


_SCALE_REASON = ("an embedding whose numbers are finite in float32 but whose float32 sum of "
                 "squares is not normal is normalised in float32 (SemanticIndex.unit, and "
                 "blobs' general path after unit_f32 declines): at 1e19 the norm overflows to "
                 "inf and the row (and a query) becomes all zeros, every score 0.0 where "
                 "InMemoryStore scores 1.0 and 0.195; at 1e-22 the squares underflow and scores "
                 "are off by ~2e-3, beyond the differential test's 1e-5; finite=True lets both "
                 "through silently. Fix: take the norm in float64 (np.linalg.norm of a float64 "
                 "copy, and in unit_f32 drop the ss<=FLT_MAX / ss>=FLT_MIN limits: ss is a "
                 "double) and divide before rounding to float32")


@pytest.mark.parametrize("scale", [
    pytest.param(1e-22, ),
    pytest.param(1e19, ),
])
@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_scores_agree_with_inmemorystore_for_an_embedding_of_any_float32_scale(
        kv: kvcomm.Client, scale: float) -> None:
    def embed(texts: list[str]) -> list[list[float]]:
        return [[x * scale for x in v] for v in fake_embed(texts)]

    cfg: Any = {"dims": DIMS, "embed": embed, "fields": ["text"]}
    ours, ref = KVCommStore(kv, index=cfg), InMemoryStore(index=cfg)
    for store in (ours, ref):
        store.put(("s",), "1", {"text": "maple river"})
        store.put(("s",), "2", {"text": "orbit ember"})
    got = [(i.key, i.score) for i in ours.search(("s",), query="river maple")]
    want = [(i.key, i.score) for i in ref.search(("s",), query="river maple")]
    assert [k for k, _s in got] == [k for k, _s in want]
    assert [s for _k, s in got] == pytest.approx([s for _k, s in want], abs=1e-5)


_NESTED = """
import sys, kvcomm
from kvcomm.integrations.langgraph import KVCommStore
from kvcomm.tiers import l2
kv = kvcomm.open(sys.argv[1])
def index():
    return {"dims": 4, "embed": lambda texts: [[float(len(t)), 1.0, 0.5, 0.25] for t in texts],
            "fields": ["text"]}
store = KVCommStore(kv, index=index())
inner = store if sys.argv[2] == "same" else KVCommStore(kv, index=index())  # (its own VectorFile)
told = []
def validator(key, old, new):
    if not told:
        try:
            inner.put(("other",), "n", {"text": "nested"})
        except kvcomm.KVCommError as exc:
            told.append(type(exc).__name__)
            raise
kv.register_validator("", validator)
try:
    store.put(("a",), "k", {"text": "hello"})
    print("stored")
except kvcomm.KVCommError as exc:
    print("outer", type(exc).__name__)
kv.unregister_validator("") if hasattr(kv, "unregister_validator") else None
print("told", *told)
print("found", store.get(("a",), "k") is not None, store.get(("other",), "n") is not None)
kv.close()
l2.purge(sys.argv[1])
"""


@pytest.mark.parametrize("through", ["same", "second"])
def test_a_validator_writing_to_an_indexed_store_is_told_not_left_waiting(
        ns: str, through: str) -> None:
    """An indexed put runs a validator (under the host's writer lock) that puts into the
    indexed store, or into a second store on the same index (a VectorFile of its own):
    a write from under the write; it waited forever on the vector index's thread lock, or
    30 s on its mutex. It is told (WriteUnderLock), and neither item is stored. (In a
    child process, with a deadline: a regression hangs the child, not the suite.)"""
    import subprocess
    import sys

    try:
        out = subprocess.run([sys.executable, "-c", _NESTED, ns, through], capture_output=True,
                             text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("the nested indexed put waited on itself")
    assert out.stdout.split("\n")[:3] == ["outer WriteUnderLock", "told WriteUnderLock",
                                          "found False False"], (out.stdout, out.stderr[-2000:])
