"""Every public call of the embedded client, and every error it promises."""

from __future__ import annotations

import os
import re
import time

import pytest

import kvcomm


def test_put_get_roundtrip_all_value_types(kv: kvcomm.Client) -> None:
    values = {
        "b": b"\x00\x01bytes",
        "ba": bytearray(b"abc"),
        "mv": memoryview(b"view"),
        "s": "héllo ✓",
        "i": -(2**63),
        "f": 3.25,
        "t": True,
        "n": None,
        "l": [1, "two", [3.0, None]],
        "tu": (1, 2),
        "d": {"id": 7, "pos": [1.0, 2.0, 3.0], "tags": {"a": b"x"}},
    }
    for k, v in values.items():
        kv.put(k, v)
    assert kv.get("b") == b"\x00\x01bytes"
    assert kv.get("ba") == b"abc"
    assert kv.get("mv") == b"view"
    assert kv.get("s") == "héllo ✓"
    assert kv.get("i") == -(2**63)
    assert kv.get("f") == 3.25
    assert kv.get("t") is True
    assert kv.get("n") is None and kv.get_item("n") is not None
    assert kv.get("l") == [1, "two", [3.0, None]]
    assert kv.get("tu") == [1, 2]
    assert kv.get("d") == {"id": 7, "pos": [1.0, 2.0, 3.0], "tags": {"a": b"x"}}


def test_get_default_and_get_item(kv: kvcomm.Client) -> None:
    assert kv.get("absent") is None
    assert kv.get("absent", 5) == 5
    assert kv.get_item("absent") is None
    v = kv.put("k", 1)
    item = kv.get_item("k")
    assert item is not None
    assert (item.key, item.value, item.version, item.tier) == ("k", 1, v, "l2")
    item2 = kv.get_item("k")
    assert item2 is not None and item2.tier == "l1" and item2.version == v


def test_versions_grow_and_print(kv: kvcomm.Client) -> None:
    v1 = kv.put("k", 1)
    v2 = kv.put("k", 2)
    assert v1 != v2 and v1 < v2 and v2 > v1 and hash(v1) != hash(v2)
    assert v1.compare(v2) is kvcomm.Ordering.BEFORE
    assert "local:" in str(v2)


def test_expect_compare_and_set(kv: kvcomm.Client) -> None:
    v1 = kv.put("k", "a", expect=kvcomm.ABSENT)
    with pytest.raises(kvcomm.ConflictError):
        kv.put("k", "b", expect=kvcomm.ABSENT)
    v2 = kv.put("k", "b", expect=v1)
    with pytest.raises(kvcomm.ConflictError):
        kv.put("k", "c", expect=v1)
    assert kv.get("k") == "b"
    with pytest.raises(kvcomm.ConflictError):
        kv.delete("k", expect=v1)
    assert kv.delete("k", expect=v2) is True
    with pytest.raises(kvcomm.ConflictError):
        kv.put("k", "d", expect=v2)
    assert kv.get("k") is None


def test_delete(kv: kvcomm.Client) -> None:
    assert kv.delete("k") is False
    kv.put("k", 1)
    assert kv.get("k") == 1
    assert kv.delete("k") is True
    assert kv.get("k") is None
    assert kv.delete("k") is False


def test_update(kv: kvcomm.Client) -> None:
    assert kv.update("n", lambda x: x + 1, default=0) == 1
    assert kv.update("n", lambda x: x + 1, default=0) == 2
    assert kv.get("n") == 2


def test_batch_applies_on_exit_only(kv: kvcomm.Client) -> None:
    kv.put("gone", 1)
    with kv.batch() as b:
        b.put("a", 1)
        b.put("b", [2])
        b.delete("gone")
        assert kv.get("a") is None  # nothing applied yet
    assert (kv.get("a"), kv.get("b"), kv.get("gone")) == (1, [2], None)
    assert len(b.versions) == 3 and b.versions[2] is True
    with pytest.raises(RuntimeError), kv.batch() as b2:
        b2.put("c", 3)
        raise RuntimeError("abort")
    assert kv.get("c") is None


def test_batch_bad_value_raises_at_its_line(kv: kvcomm.Client) -> None:
    with pytest.raises(kvcomm.UnsupportedValue), kv.batch() as b:
        b.put("a", 1)
        b.put("b", object())
    assert kv.get("a") is None


@pytest.mark.parametrize(
    "key", ["", "a\x00b", "x" * 251, 5, b"bytes", None, ("t",)]
)
def test_invalid_keys(kv: kvcomm.Client, key: object) -> None:
    with pytest.raises(kvcomm.InvalidKey):
        kv.put(key, 1)  # type: ignore[arg-type]
    with pytest.raises(kvcomm.InvalidKey):
        kv.get(key)  # type: ignore[arg-type]
    with pytest.raises(kvcomm.InvalidKey):
        kv.delete(key)  # type: ignore[arg-type]


def test_key_limit_is_utf8_bytes(kv: kvcomm.Client) -> None:
    kv.put("é" * 125, 1)  # 250 bytes
    with pytest.raises(kvcomm.InvalidKey):
        kv.put("é" * 126, 1)


@pytest.mark.parametrize(
    "value",
    [object(), {1: "int key"}, {"ok": {("t",): 1}}, [set()], 2**70, {"a": [object()]}],
)
def test_unsupported_values_store_nothing(kv: kvcomm.Client, value: object) -> None:
    kv.put("k", "before")
    with pytest.raises(kvcomm.UnsupportedValue):
        kv.put("k", value)
    assert kv.get("k") == "before"


def test_value_too_large(ns: str) -> None:
    cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": "16MB", "max_value_size": "1KB"}})
    with kvcomm.open(ns, config=cfg) as kv:
        kv.put("k", b"small")
        with pytest.raises(kvcomm.ValueTooLarge, match="max_value_size"):
            kv.put("k", b"x" * 2000)
        assert kv.get("k") == b"small"


def test_value_larger_than_l2_can_hold(kv: kvcomm.Client) -> None:
    kv.put("k", b"small")
    with pytest.raises(kvcomm.ValueTooLarge, match="raise cache.l2_size"):
        kv.put("k", b"x" * (15 << 20))
    with pytest.raises(kvcomm.ValueTooLarge, match="cache.l2_size"), kv.batch() as b:
        b.put("k", b"x" * (15 << 20))
    assert kv.get("k") == b"small"


def test_the_default_max_value_size_fits_the_default_l2(ns: str) -> None:
    """cache.max_value_size (64 MB) once allowed what the default 256 MB L2 could never
    hold (32 MiB records): a value of the default limit is stored; one byte more names
    cache.max_value_size (and a value a smaller L2 cannot hold, cache.l2_size: above)."""
    defaults = kvcomm.Config()
    limit = defaults.cache.max_value_size
    with kvcomm.open(ns, config=defaults) as kv:
        kv.put("big", b"x" * limit)
        assert len(kv.get("big")) == limit
        with pytest.raises(kvcomm.ValueTooLarge, match="raise cache.max_value_size"):
            kv.put("big", b"y" * (limit + 1))
        assert kv.get("big")[:1] == b"x"


def test_bad_consistency_and_expect(kv: kvcomm.Client) -> None:
    kv.put("k", 1, consistency="strong")
    kv.put("k", 2, consistency="eventual")
    with pytest.raises(kvcomm.InvalidArgument):
        kv.put("k", 3, consistency="sometimes")
    with pytest.raises(kvcomm.InvalidArgument):
        kv.put("k", 3, expect="v1")
    assert kv.get("k") == 2


def test_errors_share_one_root() -> None:
    for name in ("InvalidKey", "UnsupportedValue", "ValueTooLarge", "ConflictError",
                 "ConfigError", "SegmentError", "Unavailable", "ValidationError",
                 "InvalidArgument", "InvalidNamespace", "UsageError"):
        assert issubclass(getattr(kvcomm, name), kvcomm.KVCommError)
    with pytest.raises(kvcomm.InvalidArgument, match="is invalid: use 1-64"):
        kvcomm.open("my app/1")  # (a SegmentError too, as it always was)


def test_closed_client_refuses(ns: str, config: kvcomm.Config) -> None:
    kv = kvcomm.open(ns, config=config)
    kv.put("k", 1)
    kv.close()
    kv.close()  # idempotent
    with pytest.raises(kvcomm.SegmentError, match="closed"):
        kv.get("k")
    with pytest.raises(kvcomm.SegmentError):
        kv.put("k", 2)
    with kvcomm.open(ns, config=config) as kv2:
        assert kv2.get("k") == 1


def test_two_clients_one_process_share_data(ns: str, config: kvcomm.Config) -> None:
    with kvcomm.open(ns, config=config) as a, kvcomm.open(ns, config=config) as b:
        a.put("k", "from a")
        assert b.get("k") == "from a"
        b.put("k", "from b")
        assert a.get("k") == "from b"  # L1 of a revalidated against L2


def test_namespaces_are_separate(ns: str, config: kvcomm.Config) -> None:
    other = ns + "-b"
    try:
        with kvcomm.open(ns, config=config) as a, kvcomm.open(other, config=config) as b:
            a.put("k", 1)
            assert b.get("k") is None
    finally:
        kvcomm.tiers.l2.purge(other)


@pytest.mark.parametrize("name", [7, b"my-app", ["my-app"], "", "a/b", "x" * 65, ".", "..",
                                  ".hidden", "-foo", "_x"])
def test_a_bad_namespace_is_an_invalid_argument_that_says_what_a_name_is(name: object) -> None:
    """(a newcomer's first hour: open(7) raised a bare SegmentError)"""
    with pytest.raises(kvcomm.InvalidNamespace, match="1-64 letters, digits") as e:
        kvcomm.open(name)  # type: ignore[arg-type]
    assert isinstance(e.value, kvcomm.InvalidArgument) and isinstance(e.value, kvcomm.SegmentError)


def test_a_namespace_named_as_another_namespaces_file_is_refused(ns: str,
                                                                 config: kvcomm.Config) -> None:
    """``kvcomm.open("app.agents")`` opened the directory of namespace app's agent reports
    (a bare "Is a directory"), and ``"app.watch"`` made a segment where app's watchers
    register, one ``kvcomm list`` never showed (a newcomer's first hour)."""
    with kvcomm.open(ns, config=config) as kv:
        kv.put("k", 1)
        for end in (".agents", ".watch", ".keys", ".node.json", ".vec.0123456789abcdef",
                    ".v3.migrating"):
            with pytest.raises(kvcomm.InvalidNamespace, match=f"namespace {ns!r}'s own file"):
                kvcomm.open(ns + end, config=config)
        with kvcomm.open(ns + ".agents2", config=config) as other:  # (a dot is fine)
            assert other.get("k") is None
        kvcomm.tiers.l2.purge(ns + ".agents2")
        assert kv.get("k") == 1


@pytest.mark.parametrize("legacy", ["_x", "-x", "team.agents", "prod.keys"])
def test_a_namespace_an_earlier_version_made_under_a_name_now_refused_still_works(
        legacy: str, config: kvcomm.Config, monkeypatch: pytest.MonkeyPatch) -> None:
    """Names refused for a new namespace now were accepted before: such a namespace still
    opens, lists and purges (refusing them everywhere left 240 MB segments that only rm
    could remove)."""
    import contextlib
    import json
    import subprocess
    import sys

    from kvcomm.tiers.shm import files, segment

    name = f"{legacy}-{os.getpid()}" if legacy[0] in "_-" else \
        legacy.replace(".", f"{os.getpid()}.", 1)
    with monkeypatch.context() as m:  # (as an earlier version made it)
        m.setattr(segment, "check_new_name", lambda _n: None)
        m.setattr(files, "_holds_a_segment", lambda _p: True)
        kvcomm.open(name, config=config).close()
    try:
        with kvcomm.open(name, config=config) as kv:  # (it exists: opened as it is)
            kv.put("k", 1)
        listed = subprocess.run([sys.executable, "-m", "kvcomm", "list", "--json"],
                                capture_output=True, text=True, timeout=60)
        assert name in {r["name"] for r in json.loads(listed.stdout)}, listed.stdout
        out = subprocess.run([sys.executable, "-m", "kvcomm", "purge", f"--name={name}"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        with pytest.raises(kvcomm.InvalidNamespace, match="invalid"):
            kvcomm.open(name, config=config)  # (gone: not made again under that name)
    finally:
        with contextlib.suppress(kvcomm.InvalidNamespace):  # (purged: the name is refused)
            kvcomm.tiers.l2.purge(name)


def test_a_namespaces_own_files_are_never_opened_purged_or_migrated_as_a_namespace(
        ns: str, config: kvcomm.Config) -> None:
    """``kvcomm purge --name app.keys`` removed namespace app's key filter (and
    ``app.vec.ID`` its vector index), saying "purged namespace"; open and migrate said to
    remove them. A side file's name is a namespace only when it holds a segment (one an
    earlier version made so)."""
    import subprocess
    import sys

    from kvcomm.tiers.shm.migrate import migrate

    with kvcomm.open(ns, config=config):
        d = config.cache.l2_dir
        planted = {end: os.path.join(d, f"kvcomm.{ns}{end}")
                   for end in (".keys", ".node.json", ".vec.0123456789abcdef")}
        for path in planted.values():
            with open(path, "wb") as f:
                f.write(b"not a segment, a namespace's own file")
        try:
            for end, path in planted.items():
                for call in (lambda e=end: migrate(ns + e, config),
                             lambda e=end: kvcomm.open(ns + e, config=config),
                             lambda e=end: kvcomm.tiers.l2.purge(ns + e, d)):
                    with pytest.raises(kvcomm.InvalidNamespace, match="own file"):
                        call()
                out = subprocess.run([sys.executable, "-m", "kvcomm", "purge", "--name",
                                      ns + end], capture_output=True, text=True, timeout=60)
                assert out.returncode == 2 and "own file" in out.stderr, out
                assert os.path.exists(path)  # (left alone)
        finally:
            for path in planted.values():
                os.unlink(path)


def test_stats(kv: kvcomm.Client) -> None:
    kv.put("k", b"x" * 100)
    kv.get("k")
    kv.get("k")
    kv.get("missing")
    s = kv.stats()
    assert s["l1"]["hits"] == 1 and s["l2"]["hits"] == 1 and s["l2"]["misses"] == 1
    assert s["l2"]["entries"] == 1 and s["l2"]["bytes"] > 0 and s["ops"]["puts"] == 1


def test_keys_listing(kv: kvcomm.Client) -> None:
    for i in range(5):
        kv.put(f"drone/{i}/state", i)
    kv.put("other", 1)
    assert sorted(kv.keys("drone/")) == [f"drone/{i}/state" for i in range(5)]


def test_validators_reject_and_store_nothing(kv: kvcomm.Client) -> None:
    def no_occupied_cell(key: str, old: kvcomm.Item | None, new: object) -> None:
        if isinstance(new, dict) and new.get("cell") == "occupied":
            raise ValueError("cell is occupied")

    kv.register_validator("shelf/", no_occupied_cell)
    kv.put("shelf/1", {"cell": "A1"})
    with pytest.raises(kvcomm.ValidationError, match="occupied"):
        kv.put("shelf/1", {"cell": "occupied"})
    with pytest.raises(kvcomm.ValidationError), kv.batch() as b:
        b.put("shelf/2", {"cell": "occupied"})
    assert kv.get("shelf/1") == {"cell": "A1"} and kv.get("shelf/2") is None
    kv.put("other/1", {"cell": "occupied"})  # prefix does not match


def test_longest_validator_prefix_wins(kv: kvcomm.Client) -> None:
    seen: list[str] = []
    kv.register_validator("a/", lambda k, o, n: seen.append("short"))
    kv.register_validator("a/b/", lambda k, o, n: seen.append("long"))
    kv.put("a/b/c", 1)
    kv.put("a/x", 1)
    assert seen == ["long", "short"]


def test_lone_surrogates_are_invalid_keys(kv: kvcomm.Client) -> None:
    """Item 13: such a key was accepted here and killed the node daemon later."""
    for key in ("bad\udc80", "\ud800", "a/\udfff/b"):
        with pytest.raises(kvcomm.InvalidKey, match="surrogate"):
            kv.put(key, 1)
        with pytest.raises(kvcomm.InvalidKey):
            kv.get(key)
        with pytest.raises(kvcomm.InvalidKey):
            with kv.batch() as b:
                b.put(key, 1)
    assert kv.keys() == []


def test_update_needs_a_callable(kv: kvcomm.Client) -> None:
    with pytest.raises(kvcomm.InvalidArgument, match="callable"):
        kv.update("k", "not callable")  # type: ignore[arg-type]
    assert kv.get("k") is None


@pytest.mark.parametrize("timeout", [float("nan"), -1, "1", True])
def test_watch_timeout_is_validated(kv: kvcomm.Client, timeout: object) -> None:
    with pytest.raises(kvcomm.InvalidArgument):
        kv.watch("", timeout=timeout)  # type: ignore[arg-type]


def test_l1_is_bounded_per_process_by_decoded_size(ns: str) -> None:
    """Item 18: four clients of 1 MB each held 36.7 MiB (L1 per client, counted encoded).
    The bound is per process, on what the decoded values hold."""
    import tracemalloc

    cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": "64MB", "l1_size": "1MB"}})
    clients = [kvcomm.open(ns, config=cfg) for _ in range(4)]
    try:
        value = {"pos": list(range(200)), "tags": [f"t{i}" for i in range(50)]}  # small ints
        for i in range(400):
            clients[0].put(f"k{i}", value)
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for kv in clients:
            for i in range(400):
                kv.get(f"k{i}")
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert held < 3 * (1 << 20), f"L1 holds {held / 2**20:.1f} MiB for a 1 MiB bound"
        assert sum(c.stats()["l1"]["entries"] for c in clients[:1]) > 0
        assert clients[0].stats()["l1"]["bytes"] <= 1 << 20
    finally:
        for kv in clients:
            kv.close()


def test_l1_is_bounded_in_bytes(ns: str) -> None:
    cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": "16MB", "l1_size": "10KB"}})
    with kvcomm.open(ns, config=cfg) as kv:
        for i in range(100):
            kv.put(f"k{i}", b"x" * 500)
            kv.get(f"k{i}")
        s = kv.stats()["l1"]
        assert s["bytes"] <= 10 * 1024 and s["evictions"] > 0
        assert kv.get("k0") == b"x" * 500  # evicted from L1, still served by L2


def test_numpy_scalars_are_stored_as_python_numbers(kv: kvcomm.Client) -> None:
    np = pytest.importorskip("numpy")
    kv.put("f", np.float64(2.5))
    kv.put("i", np.int64(-7))
    kv.put("b", np.bool_(True))
    kv.put("nested", {"xs": [np.float32(0.5), np.uint8(3)], "ok": np.bool_(False)})
    with kv.batch() as b:
        b.put("bf", np.float64(1.25))
    for key, want, typ in (("f", 2.5, float), ("i", -7, int), ("b", True, bool), ("bf", 1.25, float)):
        got = kv.get(key)
        assert got == want and type(got) is typ
    assert kv.get("nested") == {"xs": [0.5, 3], "ok": False}
    kv.put("k", "before")
    for bad in (np.complex128(1j), np.datetime64("2020-01-01"), {"a": [np.complex64(1)]}):
        with pytest.raises(kvcomm.UnsupportedValue, match="numpy"):
            kv.put("k", bad)
    assert kv.get("k") == "before"


@pytest.mark.parametrize("value", ["x\ud800", {"a": "x\ud800"}, ["ok", {"b": "\udfff"}]])
def test_a_lone_surrogate_is_refused_at_any_depth(kv: kvcomm.Client, value: object) -> None:
    """One rule for a str with a lone surrogate (not UTF-8 text): refused at the top level
    as nested (the top level once stored it), in put and in a batch, nothing written."""
    kv.put("k", "before")
    with pytest.raises(kvcomm.UnsupportedValue, match="lone surrogate"):
        kv.put("k", value)
    with pytest.raises(kvcomm.UnsupportedValue, match="lone surrogate"), kv.batch() as b:
        b.put("k", value)
    assert kv.get("k") == "before"


def _cfg(**cache: object) -> kvcomm.Config:
    return kvcomm.Config.from_mapping({"cache": {"l2_size": "16MB", "watch_buffer": 256, **cache}})


def test_keys_with_a_non_str_prefix(name: str) -> None:
    """F13 (wrong error). keys(5) leaks TypeError from str.startswith
    (_client/client.py Client.keys); every other entry point raises InvalidKey for a non-str
    prefix (watch, register_validator).
    (found in review 7: embedded and cluster mode on real processes)"""
    with kvcomm.open(name, config=_cfg()) as kv:
        kv.put("a", 1)
        with pytest.raises(kvcomm.KVCommError):
            kv.keys(5)  # type: ignore[arg-type]


def test_a_msgpack_extension_planted_in_l2_is_refused_on_every_read(
        ns: str, config: kvcomm.Config) -> None:
    """A value kv.put could never have written (a msgpack ExtType: put refuses it) planted
    in the host's L2 by another program: every read of it raises the error of an
    undecodable stored value (SegmentError, which says to overwrite or delete it), never
    hands an ExtType to the caller; the key can be overwritten."""
    import msgpack

    from kvcomm.core import codec

    with kvcomm.open(ns, config=config) as kv:
        kb, h = kv._key_hash("planted")
        kv._seg.put(kb, h, codec.PACKED, b"", msgpack.packb([1, msgpack.ExtType(5, b"x")]),
                    int(time.time() * 1000), False, 0)
        with kvcomm.open(ns, config=config) as other:
            for read in (lambda: other.get("planted"), lambda: other.get_item("planted"),
                         lambda: list(other.scan("plan"))):
                with pytest.raises(kvcomm.SegmentError, match="extension type 5"):
                    read()
            other.put("planted", [1, 2])
            assert kv.get("planted") == [1, 2]


def _with_max_key(config: kvcomm.Config, n: int) -> kvcomm.Config:
    return kvcomm.Config.from_mapping({**config.model_dump(mode="json"),
                                       "cache": {**config.cache.model_dump(mode="json"),
                                                 "max_key_bytes": n}})


def test_a_namespace_keeps_the_max_key_bytes_it_was_made_with(ns: str,
                                                              config: kvcomm.Config) -> None:
    """Opened with another cache.max_key_bytes, a namespace is used as it is, as the
    warning says: a client asking 20 read another process's 30-byte key as InvalidKey
    (scans failed part-way), and one asking 250 of a namespace made with 20 was told to
    raise its config, which did nothing."""
    long_key = "k" * 30
    with kvcomm.open(ns, config=config) as made:  # (made with the default, 250)
        made.put(long_key, 1)
        with pytest.warns(kvcomm.KVCommWarning, match="is ignored until"):
            small = kvcomm.open(ns, config=_with_max_key(config, 20))
        with small:
            assert small.get(long_key) == 1 and [i.key for i in small.scan("k")] == [long_key]
            small.put(long_key, 2)
            assert made.get(long_key) == 2
    kvcomm.tiers.l2.purge(ns)
    with kvcomm.open(ns, config=_with_max_key(config, 20)) as made:
        with pytest.warns(kvcomm.KVCommWarning, match="is ignored until"):
            big = kvcomm.open(ns, config=config)
        with big:
            with pytest.raises(kvcomm.InvalidKey, match=r"made with cache\.max_key_bytes=20; "
                                                        r"this client's 250 is ignored.*or purge"):
                big.put(long_key, 1)
            with pytest.raises(kvcomm.InvalidKey, match=r"is ignored until .*\): shorten it$"):
                big.put("k" * 300, 1)  # (over both: purging would not help)
        with pytest.raises(kvcomm.InvalidKey, match=r"over cache\.max_key_bytes=20: shorten"):
            made.put(long_key, 1)


def test_a_second_client_in_one_process_is_told_its_size_is_ignored(
        ns: str, config: kvcomm.Config) -> None:
    """The namespace is attached in this process already: a client asking another
    ``cache.l2_size`` is warned, at its own line, as one in another process is.
    (a newcomer's first hour, stop 37: no warning in the same process)"""
    other = kvcomm.Config.from_mapping({**config.model_dump(mode="json"),
                                        "cache": {**config.cache.model_dump(mode="json"),
                                                  "l2_size": "8MB"}})
    with kvcomm.open(ns, config=config) as a:
        with pytest.warns(kvcomm.KVCommWarning, match="is ignored until") as seen:
            b = kvcomm.open(ns, config=other)
        assert seen[0].filename == __file__, seen[0].filename
        b.put("k", 1)
        assert a.get("k") == 1
        b.close()


def test_first_hour_mistakes_say_what_to_do(kv: kvcomm.Client) -> None:
    """Each error of a newcomer's first hour names the fix. (stop 37's newcomer review)"""
    with pytest.raises(kvcomm.UnsupportedValue, match=r"store such a number as a str"):
        kv.put("big", 2**70)
    with pytest.raises(kvcomm.UnsupportedValue, match=r"str\(n\)"):
        kv.put("big", {"n": [-(2**64)]})
    with pytest.raises(kvcomm.InvalidKey, match="shorten it.*raise cache.max_key_bytes"):
        kv.put("x" * 251, 1)
    with pytest.raises(kvcomm.ConfigError, match=r"Config.from_mapping"):
        kvcomm.open("x", config={"cache": {}})  # type: ignore[arg-type]
    from kvcomm.tiers.l2 import L2Segment

    with pytest.raises(kvcomm.SegmentError, match=r"kvcomm.open\('never-opened-ns'\) creates"):
        L2Segment("never-opened-ns", create_layout=None, host_id="")
    assert kv.get("big") is None


def test_a_client_used_like_a_dict_says_what_to_write(kv: kvcomm.Client) -> None:
    """(a newcomer's first hour: Python's own errors named the client's private class)"""
    kv.put("k", 1)
    for use, hint in ((lambda: kv["k"], "kv.get('k')"), (lambda: kv.__setitem__("k", 2), "kv.put('k'"),
                      (lambda: kv.__delitem__("k"), "kv.delete('k')"), (lambda: "k" in kv, "kv.get('k')"),
                      (lambda: list(kv), "kv.scan(prefix)")):
        with pytest.raises(kvcomm.UsageError, match=re.escape(hint)) as e:
            use()
        assert isinstance(e.value, TypeError) and isinstance(e.value, kvcomm.InvalidArgument)
    assert kv.get("k") == 1  # (nothing changed)


def test_the_other_faces_with_says_which_to_write(ns: str, config: kvcomm.Config) -> None:
    import asyncio

    import kvcomm.aio

    async def main() -> None:
        opened = kvcomm.open(ns, config=config)
        with pytest.raises(kvcomm.UsageError, match="with kvcomm.open"):
            async with opened:
                pass
        assert opened._closed  # (the block never ran: what the call opened is closed)
        with pytest.raises(kvcomm.UsageError, match="async with kvcomm.aio.open"):
            with kvcomm.aio.open(ns, config=config):  # type: ignore[attr-defined]
                pass
        akv = await kvcomm.aio.open(ns, config=config)  # (an awaited client: the same)
        with pytest.raises(kvcomm.UsageError, match="async with kvcomm.aio.open"):
            with akv:  # type: ignore[attr-defined]
                pass
        await akv.aclose()

    asyncio.run(main())


def _never_runs(kv: kvcomm.Client) -> None:
    raise AssertionError("a client reached another process")


def test_a_client_sent_to_another_process_says_to_open_one_there(ns: str,
                                                                 config: kvcomm.Config) -> None:
    """multiprocessing's spawn (and forkserver, Python 3.14's default) pickle a Process's
    arguments: a client among them raised a bare TypeError naming the C core's class."""
    import asyncio
    import copy
    import multiprocessing as mp
    import pickle

    import kvcomm.aio

    with kvcomm.open(ns, config=config) as kv:
        with pytest.raises(kvcomm.UsageError, match=r"kvcomm\.open\(name, config=config\)"):
            pickle.dumps(kv)
        with pytest.raises(kvcomm.UsageError, match="nor sent to another process"):
            mp.get_context("spawn").Process(target=_never_runs, args=(kv,)).start()
        with pytest.raises(kvcomm.UsageError, match="cannot be copied"):
            copy.copy(kv)

    async def main() -> None:
        async with kvcomm.aio.open(ns, config=config) as akv:
            with pytest.raises(kvcomm.UsageError, match=r"kvcomm\.aio\.open\(name"):
                pickle.dumps(akv)

    asyncio.run(main())


def test_a_closed_client_entered_again_says_it_is_closed(ns: str, config: kvcomm.Config) -> None:
    import asyncio

    import kvcomm.aio

    kv = kvcomm.open(ns, config=config)
    kv.close()
    with pytest.raises(kvcomm.SegmentError, match="closed"):
        with kv:
            pass

    async def main() -> None:
        akv = await kvcomm.aio.open(ns, config=config)
        await akv.aclose()
        with pytest.raises(kvcomm.SegmentError, match="closed"):
            async with akv:
                pass

    asyncio.run(main())
