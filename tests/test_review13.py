"""Adversarial review of issue 13 (kv.scan, cluster-wide kv.watch, the LangGraph
integration): every test here reproduced a finding before its fix (docstrings "F<n>:")."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import ormsgpack
import pytest

import kvcomm

lg = pytest.importorskip("langgraph.checkpoint.serde.jsonplus")

from kvcomm.integrations.langgraph import KVCommSaver, KVCommStore  # noqa: E402

needs_cluster = [
    pytest.mark.redis,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed"),
    pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed"),
]


def _constructor_call(module: str, name: str, arg: Any) -> bytes:
    """msgpack bytes that LangGraph's default JsonPlusSerializer turns into a call of
    ``module.name(arg)`` when it loads them (its EXT_CONSTRUCTOR_SINGLE_ARG ext type)."""
    return ormsgpack.packb(ormsgpack.Ext(0, ormsgpack.packb([module, name, arg])))


def test_crafted_msgpack_in_kvcomm_never_runs_code_in_the_store(kv: kvcomm.Client,
                                                               tmp_path: Path) -> None:
    """F1: LangGraph's default JsonPlusSerializer imports any module and calls any
    function a msgpack ext record names (``os.system``...). A record planted under a
    KVCommStore key by any process that can write the namespace ran code in every reader:
    the same hazard as a pickle, which KVCOMM refuses. Now nothing is called (the record
    loads as its raw fields, LangGraph's strict mode), and a serializer that would call
    anything is refused."""
    marker = tmp_path / "pwned"
    store = KVCommStore(kv)
    store.put(("mem",), "k", {"x": 1})
    key = store.keys.item(("mem",), "k")
    raw = kv.get(key)
    kv.put(key, ["msgpack", _constructor_call("os", "system", f"touch {marker}"), raw[2], raw[3]])
    try:
        store.get(("mem",), "k")
    except kvcomm.KVCommError:
        pass
    assert not marker.exists(), "a record read from KVCOMM ran os.system"
    with pytest.raises(kvcomm.ConfigError, match="any function"):
        KVCommStore(kv, serde=lg.JsonPlusSerializer(allowed_msgpack_modules=True))
    with pytest.raises(kvcomm.ConfigError, match="any function"):
        KVCommSaver(kv, serde=lg.JsonPlusSerializer(allowed_json_modules=True))
    KVCommSaver(kv, serde=lg.JsonPlusSerializer(allowed_msgpack_modules=[("uuid", "UUID")]))


def test_crafted_msgpack_in_kvcomm_never_runs_code_in_the_saver(kv: kvcomm.Client,
                                                               tmp_path: Path) -> None:
    """F1: the same through KVCommSaver: a checkpoint whose channel value is a crafted
    constructor call ran it on get_tuple."""
    marker = tmp_path / "pwned"
    saver = KVCommSaver(kv)
    cfg = {"configurable": {"thread_id": "t", "checkpoint_ns": ""}}
    from langgraph.checkpoint.base import empty_checkpoint

    cp = empty_checkpoint()
    cp["channel_values"] = {"c": 1}
    cp["channel_versions"] = {"c": "1"}
    saver.put(cfg, cp, {}, {"c": "1"})
    blobs = [i.key for i in kv.scan(saver.keys.blobs)]
    planted = 0
    for k in blobs:
        v = kv.get(k)
        if isinstance(v, list) and v and v[0] == "msgpack":
            kv.put(k, ["msgpack", _constructor_call("os", "system", f"touch {marker}")])
            planted += 1
    assert planted, f"no msgpack record found to plant into among {blobs}"
    try:
        saver.get_tuple(cfg)
    except kvcomm.KVCommError:
        pass
    assert not marker.exists(), "a record read from KVCOMM ran os.system"
