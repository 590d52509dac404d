"""Config: units, defaults, and a ConfigError naming the key for anything wrong."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pydantic
import pytest
import yaml
from hypothesis import example, given
from hypothesis import strategies as st

import kvcomm
from kvcomm.config import (
    MAX_COUNT,
    MAX_DURATION,
    MAX_SIZE,
    CacheConfig,
    ClusterConfig,
    NetworkConfig,
    NodeConfig,
    format_duration,
    format_size,
    parse_duration,
    parse_size,
)
from kvcomm.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4KB", 4096), ("1GB", 1 << 30), ("64MiB", 64 << 20), ("512", 512), (100, 100),
     ("1.5KB", 1536), ("10 mb", 10 << 20)],
)
def test_sizes(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("50ms", 0.05), ("2s", 2.0), ("500us", 0.0005), ("1m", 60.0), (0.25, 0.25)],
)
def test_durations(text: object, expected: float) -> None:
    assert parse_duration(text) == pytest.approx(expected)


def test_defaults_need_no_file() -> None:
    c = kvcomm.Config()
    assert c.cache.l2_sync_interval == 0.05
    assert c.cache.l3_consistency == "eventual"
    assert c.cache.max_key_bytes == 250
    assert c.network.zero_copy_threshold == 4096


def test_load_yaml_file(tmp_path: Path) -> None:
    p = tmp_path / "kvcomm.yaml"
    p.write_text(
        "cache:\n  l1_size: '1GB'\n  l2_sync_interval: '50ms'\n  l3_consistency: strong\n"
        "network:\n  zero_copy_threshold: '4KB'\n"
    )
    c = kvcomm.Config.load(p)
    assert c.cache.l1_size == 1 << 30 and c.cache.l3_consistency == "strong"


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"cache": {"l1_size": "1XB"}}, "cache.l1_size"),
        ({"cache": {"l2_sync_interval": "fast"}}, "cache.l2_sync_interval"),
        ({"cache": {"l3_consistency": "sometimes"}}, "cache.l3_consistency"),
        ({"cache": {"max_key_bytes": "many"}}, "cache.max_key_bytes"),
        ({"cache": {"bogus": 1}}, "cache.bogus"),
        ({"network": {"zero_copy_threshold": -1}}, "network.zero_copy_threshold"),
        ({"nodes": {}}, "nodes"),
        ({"cache": {"l1_size": True}}, "cache.l1_size"),
    ],
)
def test_errors_name_the_key(data: dict[str, object], key: str) -> None:
    with pytest.raises(kvcomm.ConfigError) as err:
        kvcomm.Config.from_mapping(data)
    assert err.value.key == key
    assert key in str(err.value)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(kvcomm.ConfigError, match="cannot read"):
        kvcomm.Config.load(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("cache: [unclosed\n")
    with pytest.raises(kvcomm.ConfigError, match="YAML"):
        kvcomm.Config.load(bad)
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n- 2\n")
    with pytest.raises(kvcomm.ConfigError, match="mapping"):
        kvcomm.Config.load(top)


def test_open_accepts_path_and_rejects_other(tmp_path: Path, ns: str) -> None:
    p = tmp_path / "k.yaml"
    p.write_text("cache:\n  l2_size: 16MB\n")
    with kvcomm.open(ns, config=str(p)) as kv:
        assert kv.config.cache.l2_size == 16 << 20
    with pytest.raises(kvcomm.ConfigError):
        kvcomm.open(ns, config=42)  # type: ignore[arg-type]


def test_show_roundtrips() -> None:
    import yaml

    c = kvcomm.Config()
    data = yaml.safe_load(c.to_yaml())
    data["cache"]["l2_permissions"] = int(data["cache"]["l2_permissions"], 8)
    assert kvcomm.Config.from_mapping(data) == c


# ---------------------------------------------------------------- every way in: ConfigError


def _raises_config_error(call: Callable[[], object], key: str) -> kvcomm.ConfigError:
    """``call`` raises kvcomm.ConfigError (never pydantic's error) naming ``key``."""
    try:
        call()
    except kvcomm.ConfigError as exc:
        assert not isinstance(exc, pydantic.ValidationError)
        assert exc.key == key, (exc.key, str(exc))
        assert str(exc).startswith(f"{key}: ") if key else True
        return exc
    except Exception as exc:  # noqa: BLE001 - the point of the test is what else leaks
        raise AssertionError(f"{type(exc).__module__}.{type(exc).__name__} leaked: {exc}") from exc
    raise AssertionError(f"no error for {key}")


@pytest.mark.parametrize(
    ("call", "key"),
    [
        (lambda: kvcomm.Config(cache={"l1_size": "lots"}), "cache.l1_size"),
        (lambda: kvcomm.Config(cache=5), "cache"),
        (lambda: kvcomm.Config(nodes={}), "nodes"),
        (lambda: CacheConfig(l2_size="1KB"), "cache.l2_size"),
        (lambda: CacheConfig(bogus=1), "cache.bogus"),
        (lambda: NetworkConfig(zero_copy_threshold=-1), "network.zero_copy_threshold"),
        (lambda: NodeConfig(host_id="has space"), "node.host_id"),
        (lambda: ClusterConfig(timeout="soon"), "cluster.timeout"),
        (lambda: ClusterConfig(redis=["a:1", 5]), "cluster.redis[1]"),
        (lambda: ClusterConfig(redis=["no-port"]), "cluster.redis"),
        (lambda: kvcomm.Config.model_validate({"cache": {"max_views": "many"}}), "cache.max_views"),
        (lambda: kvcomm.Config.model_validate([1, 2]), ""),
        (lambda: CacheConfig.model_validate({"l1_size": True}), "cache.l1_size"),
        (lambda: kvcomm.Config.model_validate_json('{"cache": {"l1_size": "x"}}'), "cache.l1_size"),
        (lambda: kvcomm.Config.model_validate_json("{"), ""),
        (lambda: kvcomm.Config.model_validate_strings({"cache": {"max_views": "x"}}), "cache.max_views"),
        (lambda: kvcomm.Config().model_copy(update={"cache": 5}), "cache"),
        (lambda: kvcomm.Config().cache.model_copy(update={"l1_size": "x"}), "cache.l1_size"),
        (lambda: setattr(kvcomm.Config(), "cache", CacheConfig()), "cache"),
        (lambda: setattr(kvcomm.Config().cache, "l1_size", 1), "cache.l1_size"),
        (lambda: delattr(kvcomm.Config().node, "host_id"), "node.host_id"),
    ],
)
def test_every_constructor_raises_config_error_naming_the_key(
    call: Callable[[], object], key: str
) -> None:
    _raises_config_error(call, key)


def test_a_good_constructor_call_still_works() -> None:
    c = kvcomm.Config(cache=CacheConfig(l1_size="1GB"), node={"host_id": "h1"})
    assert c.cache.l1_size == 1 << 30 and c.node.host_id == "h1"
    assert c.model_copy(update={"node": {"host_id": "h2"}}).node.host_id == "h2"
    assert c.node.host_id == "h1"  # the copy left the original unchanged
    assert kvcomm.Config.from_mapping({"cache": None, "cluster": None}) == kvcomm.Config()


def test_messages_say_what_to_do() -> None:
    e = _raises_config_error(lambda: CacheConfig(l1_sise=1), "cache.l1_sise")
    assert "did you mean 'l1_size'" in str(e)
    e = _raises_config_error(lambda: CacheConfig(l2_size="512KB"), "cache.l2_size")
    assert "at least 1MB" in str(e) and "512KB" in str(e)
    e = _raises_config_error(lambda: ClusterConfig(redis_password=12345), "cluster.redis_password")
    assert "12345" not in str(e)  # a secret given with the wrong type is still not echoed


# ---------------------------------------------------------------- l2_permissions


@pytest.mark.parametrize("text", ["0o600", "'0o600'", "0600", "'0600'", "384", "0O600"])
def test_l2_permissions_as_documented_loads_from_yaml(tmp_path: Path, text: str) -> None:
    p = tmp_path / "k.yaml"
    p.write_text(f"cache:\n  l2_permissions: {text}\n")
    assert kvcomm.Config.load(p).cache.l2_permissions == 0o600


@pytest.mark.parametrize("value", [0o600, 384, "0o600", "0600", "0o660", 0o640])
def test_l2_permissions_accepted(value: object) -> None:
    assert kvcomm.Config.from_mapping({"cache": {"l2_permissions": value}}).cache.l2_permissions in (
        0o600, 0o660, 0o640)


@pytest.mark.parametrize(
    "value", ["0o800", "rw", 0o1777, True, False, 600, "600", 0o400, -1, 1.5, "0o", "", None, [0o600]]
)
def test_l2_permissions_rejected(value: object) -> None:
    e = _raises_config_error(
        lambda: kvcomm.Config.from_mapping({"cache": {"l2_permissions": value}}), "cache.l2_permissions")
    if value == 600:
        assert "0o600" in str(e)  # YAML's decimal 600 was meant as octal: say how to write it


# ---------------------------------------------------------------- to_yaml / config --show


@pytest.mark.parametrize(
    ("n", "text"),
    [(256 << 20, "256MB"), (4096, "4KB"), (1536 << 10, "1536KB"), (1000, 1000), (0, 0),
     (1 << 30, "1GB"), (3 << 40, "3TB"), (1 << 20 | 1, (1 << 20) + 1)],
)
def test_format_size(n: int, text: object) -> None:
    assert format_size(n) == text
    assert parse_size(text) == n


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.05, "50ms"), (2.0, "2s"), (600.0, "10m"), (0.0005, "500us"), (0.02, "20ms"),
     (90.0, "90s"), (0.0, "0s"), (1.5, "1500ms"), (1e-9, 1e-9), (1 / 3, 1 / 3)],
)
def test_format_duration(seconds: float, text: object) -> None:
    assert format_duration(seconds) == text
    assert parse_duration(text) == seconds  # exact, not approximately


def test_show_hides_secrets_and_prints_units() -> None:
    c = kvcomm.Config.from_mapping(
        {"cluster": {"redis": ["10.0.0.5:7000"], "redis_password": "s3cr3t-pw",
                     "redis_username": "agent"}})
    text = c.to_yaml()
    assert "s3cr3t-pw" not in text and "s3cr3t-pw" not in repr(c)
    assert "  # redis_password: (set; hidden)\n" in text
    for line in ("  l1_size: 256MB\n", "  l2_sync_interval: 50ms\n", "  l2_permissions: 0o600\n",
                 "  zero_copy_threshold: 4KB\n", "  key_filter_rebuild: 10m\n",
                 "  max_batch_bytes: 1MB\n", "  negative_ttl: 5s\n"):
        assert line in text
    back = kvcomm.Config.from_mapping(yaml.safe_load(text))
    assert back.cluster.redis_password is None
    assert back == _without_secrets(c)
    # unset, the password is printed as what it is: nothing to hide
    assert "  redis_password: null\n" in kvcomm.Config().to_yaml()


def _without_secrets(c: kvcomm.Config) -> kvcomm.Config:
    update: dict[str, object] = {}
    for section in type(c).model_fields:
        obj = getattr(c, section)
        secrets = {n: None for n in type(obj).model_fields if n.endswith("_password")}
        if secrets:
            update[section] = obj.model_copy(update=secrets)
    return c.model_copy(update=update) if update else c


_ident = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True)
_unicode = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)  # no lone surrogates


def _size(lo: int, hi: int = MAX_SIZE) -> st.SearchStrategy[object]:
    exact = st.sampled_from([1 << 10, 1 << 20, 1 << 30, 1 << 40]).flatmap(
        lambda unit: st.integers(max(1, -(-lo // unit)), max(1, hi // unit)).map(lambda k: k * unit))
    return st.one_of(st.integers(lo, hi), exact.filter(lambda v: lo <= v <= hi))


_path = st.none() | st.sampled_from(["/etc/kvcomm/ca.pem", "certs/client.pem", "a b.pem"])
_address = st.builds(lambda h, p: f"{h}:{p}", st.sampled_from(["127.0.0.1", "10.0.0.5", "h"]),
                     st.integers(1, 65535))


def _duration(positive: bool) -> st.SearchStrategy[object]:
    lo = 0.0 if not positive else 1e-9
    per_unit = {"us": 10**6, "ms": 1000, "s": 1, "m": 1 / 60}
    units = st.sampled_from(list(per_unit)).flatmap(lambda u: st.integers(
        1 if positive else 0, int(MAX_DURATION * per_unit[u])).map(lambda k: f"{k}{u}"))
    return st.one_of(st.floats(lo, MAX_DURATION, allow_nan=False), units)


# one strategy per key: test_strategies_cover_every_key fails when a key is added without one
_VALID: dict[str, dict[str, st.SearchStrategy[object]]] = {
    "cache": {
        "l1_size": _size(0), "l2_size": _size(1 << 20), "l2_sync_interval": _duration(True),
        "l3_consistency": st.sampled_from(["eventual", "strong"]),
        "max_key_bytes": st.integers(1, 4096), "max_value_size": _size(1),
        "watch_buffer": st.integers(16, 1 << 22), "max_views": st.integers(0, 1 << 16),
        "l2_keys": st.integers(0, 1 << 31),
        "l2_permissions": st.integers(0, 0o777).map(lambda m: m | 0o600).flatmap(
            lambda m: st.sampled_from([m, oct(m), "0" + oct(m)[2:]])),
        "max_batch_ops": st.integers(1, MAX_COUNT), "max_batch_bytes": _size(1),
        "negative_ttl": _duration(False), "negative_max_entries": st.integers(1, MAX_COUNT),
        "expiry_sweep": st.floats(0.001, 60, allow_nan=False),
        "bloom_capacity": st.integers(1, MAX_COUNT),
        # (below ~1e-12 a small capacity needs more hash functions than the filter tests)
        "bloom_fpr": st.floats(1e-12, 1, exclude_max=True),
        "hot_key_sample": st.integers(0, 1 << 20),
        "strong_prefixes": st.lists(_unicode.filter(lambda t: t and "\0" not in t
                                                    and len(t.encode()) <= 8), max_size=3,
                                    unique=True),
        "l2_dir": st.sampled_from(["/dev/shm", "/run/kvcomm", "/tmp/a dir"]),
        "lock_timeout": st.floats(1e-3, 3600, allow_nan=False),
    },
    "network": {"zero_copy_threshold": _size(0)},
    "node": {"host_id": st.from_regex(r"[A-Za-z0-9_.:-]{1,64}", fullmatch=True),
             "namespace": st.from_regex(r"[A-Za-z0-9_.-]{1,64}", fullmatch=True),
             "test_clock_offset_file": st.none() | _unicode.filter(bool)},
    "cluster": {
        "redis": st.lists(st.builds(lambda h, p: f"{h}:{p}", _unicode.filter(bool),
                                    st.integers(1, 65535)), max_size=3),
        "redis_username": st.none() | _unicode, "redis_password": st.none() | _unicode,
        "redis_tls": st.booleans(), "timeout": _duration(True),
        "outbound_max": st.integers(1, MAX_COUNT), "feed_poll": _duration(True),
        "feed_maxlen": st.integers(100, MAX_COUNT), "wait_replicas": st.integers(0, 16),
        "groups": st.sampled_from([16 << i for i in range(11)]),
        "feed_total": st.integers(1_638_400, MAX_COUNT), "feed_sweep_rate": st.integers(1, MAX_COUNT),
        "feed_inline": st.integers(0, 1 << 20), "unread_changes": st.integers(0, 1 << 20),
        "wait_timeout": _duration(True),
        "resolvers": st.dictionaries(_unicode, st.builds(
            lambda m, f: f"{'.'.join(m)}:{f}", st.lists(_ident, min_size=1, max_size=3), _ident),
            max_size=3),
        "key_filter_rebuild": _duration(True),
        "redis_ca": _path, "redis_cert": _path, "redis_key": _path,
        "etcd": st.lists(st.builds(lambda h, p: f"{h}:{p}", _unicode.filter(bool),
                                   st.integers(1, 65535)), max_size=3),
        "etcd_username": st.none() | _unicode, "etcd_password": st.none() | _unicode,
        "etcd_tls": st.booleans(), "etcd_ca": _path, "etcd_cert": _path, "etcd_key": _path,
        "address_remap": st.dictionaries(_address, _address, max_size=3),
        "lease_ttl": st.floats(1, 3600, allow_nan=False),
        "shutdown_flush_timeout": st.floats(0, 3600, allow_nan=False) | st.sampled_from(
            ["0s", "250ms", "5s", "60m"]),
        "tombstone_grace": st.floats(60, 86400 * 30, allow_nan=False),
        "daemon_wait": st.floats(0, 3600, allow_nan=False) | st.sampled_from(
            ["0s", "300ms", "5s", "60m"]),
        "max_clock_skew": st.sampled_from(["1ms", "500ms", "2s", 0.25]),
    },
    "metrics": {
        "port": st.integers(0, 65535), "host": _unicode.filter(bool), "advertise": _unicode,
        "flush_interval": st.floats(0, 3600, allow_nan=False),
        "latency_sample": st.integers(0, 1 << 20), "hot_keys": st.integers(0, 100),
        "hot_key_label": st.sampled_from(["truncate", "hash"]),
        "hot_key_chars": st.integers(8, 1024),
    },
}


def _fix_cross_key_rules(data: dict[str, dict[str, object]]) -> dict[str, dict[str, object]]:
    """Drop what a valid config cannot hold together: TLS files without TLS on, a key
    file without its certificate, a strong prefix over cache.max_key_bytes."""
    cl = data.get("cluster", {})
    for system in ("redis", "etcd"):
        if not cl.get(f"{system}_tls"):
            for part in ("ca", "cert", "key"):
                cl.pop(f"{system}_{part}", None)
        if cl.get(f"{system}_cert") is None:
            cl.pop(f"{system}_key", None)
    cache = data.get("cache", {})
    if "strong_prefixes" in cache:
        limit = int(cache.get("max_key_bytes", 250))  # type: ignore[call-overload]
        cache["strong_prefixes"] = [p for p in cache["strong_prefixes"]  # type: ignore[attr-defined]
                                    if len(p.encode()) <= limit]
    return data


def test_strategies_cover_every_key() -> None:
    assert set(_VALID) == set(kvcomm.Config.model_fields)
    for section, fields in _VALID.items():
        assert set(fields) == set(kvcomm.Config.model_fields[section].annotation.model_fields)  # type: ignore[union-attr]


@st.composite
def _valid_configs(draw: st.DrawFn) -> dict[str, dict[str, object]]:
    return _fix_cross_key_rules(
        {section: {k: draw(s) for k, s in fields.items() if draw(st.booleans())}
         for section, fields in _VALID.items()})


@given(_valid_configs())
# found at 3000 examples: blank lines inside a quoted scalar are the value's newlines
@example({"cluster": {"resolvers": {"a\n\nb": "m:f"}, "redis_username": "x\n y \n\n"}})
def test_show_loads_back_to_an_equal_config(tmp_path_factory: pytest.TempPathFactory,
                                            data: dict[str, dict[str, object]]) -> None:
    c = kvcomm.Config.from_mapping(data)
    p = tmp_path_factory.mktemp("show") / "shown.yaml"
    p.write_text(c.to_yaml(), encoding="utf-8")
    back = kvcomm.Config.load(p)
    assert back == _without_secrets(c), c.to_yaml()
    if c.cluster.redis_password:
        assert "# redis_password: (set; hidden)" in c.to_yaml()


# ---------------------------------------------------------------- hostile input


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"cache": {"l1_size": "1e400"}}, "cache.l1_size"),
        ({"cache": {"l1_size": "9" * 400 + "GB"}}, "cache.l1_size"),
        ({"cache": {"l1_size": "9" * 5000}}, "cache.l1_size"),
        ({"cache": {"l1_size": 10**5000}}, "cache.l1_size"),
        ({"cache": {"max_views": 10**5000}}, "cache.max_views"),
        ({"cache": {"l2_size": 1 << 64}}, "cache.l2_size"),
        ({"cache": {"negative_ttl": float("nan")}}, "cache.negative_ttl"),
        ({"cache": {"negative_ttl": float("inf")}}, "cache.negative_ttl"),
        ({"cluster": {"timeout": "inf"}}, "cluster.timeout"),
        ({"cluster": {"timeout": 10**400}}, "cluster.timeout"),
        ({"cluster": {"feed_poll": "9" * 30 + "s"}}, "cluster.feed_poll"),
        ({"cache": {"max_views": True}}, "cache.max_views"),
        ({"cache": {"bloom_fpr": True}}, "cache.bloom_fpr"),
        ({"cache": {"bloom_fpr": 1e-20}}, "cache.bloom_fpr"),  # 66 hash functions: over 64
        ({"cache": {"bloom_fpr": 1e-14, "bloom_capacity": 1}}, "cache.bloom_fpr"),  # 89
        ({"cluster": {"redis_username": "\ud800"}}, "cluster.redis_username"),
        ({"cluster": {"redis": ["host:99999"]}}, "cluster.redis"),
        ({"cluster": {"resolvers": {"p/": "not a path:f"}}}, "cluster.resolvers"),
        ({1: {}}, "[1]"),
    ],
)
def test_hostile_values_are_config_errors(data: dict[object, object], key: str) -> None:
    _raises_config_error(lambda: kvcomm.Config.from_mapping(data), key)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"- 1\n- 2\n", "mapping"),
        (b"cache:\n  l1_size: \xff\xfe\n", "UTF-8"),
        (b"cache:\n  l1_size: 2024-13-45\n", "YAML"),
        (b"cache:\n  l1_size: " + b"9" * 5000 + b"\n", "YAML"),
        (b"cache:\n  l1_size: 1e400\n", "l1_size"),
        (b"cache:\n  negative_ttl: .nan\n", "finite"),
        (b"cache:\n  negative_ttl: .inf\n", "finite"),
        (b"cache: &a\n  x: *a\n", "cache.x"),
        (b"cache: !!python/object:os.system {}\n", "YAML"),
        (b"a: " + b"[" * 10000 + b"]" * 10000 + b"\n", "nested too deeply"),
        (b"x" * ((1 << 20) + 1), "MiB"),
    ],
)
def test_hostile_files_are_config_errors(tmp_path: Path, content: bytes, match: str) -> None:
    p = tmp_path / "k.yaml"
    p.write_bytes(content)
    with pytest.raises(kvcomm.ConfigError, match=match):
        kvcomm.Config.load(p)


def test_hostile_paths_are_config_errors(tmp_path: Path) -> None:
    for path in (tmp_path, "bad\0path", 42, b"/etc/hostname"):
        with pytest.raises(kvcomm.ConfigError):
            kvcomm.Config.load(path)  # type: ignore[arg-type]


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.sampled_from([10**400, -(1 << 64), 1 << 63])
    | st.floats() | st.text() | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8) | st.integers(),
                                                                  inner, max_size=4),
    max_leaves=12,
)
_TRICKY = ["1e400", "9" * 40 + "GB", "nan", "inf", "-inf", ".nan", ".inf", "0o800", "0o600",
           "0600", "600", "-1", "1.5", "1.5KB", "0.3MB", "50 ms", "1:30", "2024-13-45",
           "2024-01-01", "yes", "~", "null", "[]", "{}", "!!binary AAAA", "&a [*a]", "'\\ud800'",
           "\"\\ud800\"", "1_000", "0x10", "0b11", "+12", "1e3", "9" * 5000, "10 mb", "µs"]


def _documents() -> st.SearchStrategy[object]:
    keys = st.sampled_from([k for f in _VALID.values() for k in f]) | st.text(max_size=8)
    sections = st.sampled_from(list(_VALID)) | st.text(max_size=8)
    section = st.dictionaries(keys, _json, max_size=4) | _json
    return st.dictionaries(sections, section, max_size=4) | _json


@given(_documents())
def test_any_json_like_value_is_a_config_or_a_config_error(doc: object) -> None:
    for call in (lambda: kvcomm.Config.from_mapping(doc), lambda: kvcomm.Config.model_validate(doc)):
        try:
            c = call()
        except kvcomm.ConfigError:
            continue
        # what is accepted can be shown, and what is shown loads back
        assert kvcomm.Config.from_mapping(yaml.safe_load(c.to_yaml())) == _without_secrets(c)
    if isinstance(doc, dict):
        for section, cls in (("cache", CacheConfig), ("cluster", ClusterConfig)):
            fields = doc.get(section)
            if isinstance(fields, dict) and all(isinstance(k, str) for k in fields):
                try:
                    cls(**fields)
                except kvcomm.ConfigError as exc:
                    assert exc.key.startswith(section)


def _load_or_config_error(path: Path, section: str, key: str) -> None:
    try:
        kvcomm.Config.load(path)
    except kvcomm.ConfigError as exc:
        assert exc.key == "" or exc.key.startswith(f"{section}.{key}"), exc
    except Exception as exc:  # noqa: BLE001 - what leaks is what this test looks for
        raise AssertionError(f"{section}.{key}: {type(exc).__name__} leaked: {exc}") from exc


def test_every_tricky_yaml_scalar_in_every_key(tmp_path: Path) -> None:
    p = tmp_path / "k.yaml"
    for section, fields in _VALID.items():
        for key in fields:
            for scalar in _TRICKY:
                p.write_text(f"{section}:\n  {key}: {scalar}\n", encoding="utf-8")
                _load_or_config_error(p, section, key)


@given(st.sampled_from(list(_VALID)), st.data())
def test_any_yaml_scalar_in_any_key_loads_or_is_a_config_error(
    tmp_path_factory: pytest.TempPathFactory, section: str, data: st.DataObject
) -> None:
    key = data.draw(st.sampled_from(list(_VALID[section])))
    scalar = data.draw(st.text(max_size=20).map(lambda t: t.replace("\n", " ")))
    p = tmp_path_factory.mktemp("yaml") / "k.yaml"
    p.write_bytes(f"{section}:\n  {key}: {scalar}\n".encode("utf-8", "surrogatepass"))
    _load_or_config_error(p, section, key)


@given(st.binary(max_size=200) | st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_any_file_loads_or_is_a_config_error(tmp_path_factory: pytest.TempPathFactory,
                                             content: bytes) -> None:
    p = tmp_path_factory.mktemp("raw") / "k.yaml"
    p.write_bytes(content)
    try:
        kvcomm.Config.load(p)
    except kvcomm.ConfigError:
        pass


# ---------------------------------------------------------------- etcd, TLS, strong keys, routing


def test_etcd_tls_and_routing_keys() -> None:
    c = kvcomm.Config.from_mapping({
        "cache": {"strong_prefixes": ["task/", "task/urgent/", "shelf/"]},
        "cluster": {"redis": ["10.0.0.5:7000"], "etcd": ["10.0.0.7:2379", "10.0.0.8:2379"],
                    "etcd_username": "kvc", "etcd_password": "etcd-s3cr3t", "etcd_tls": True,
                    "etcd_ca": "/etc/kvcomm/ca.pem", "etcd_cert": "/etc/kvcomm/c.pem",
                    "etcd_key": "/etc/kvcomm/k.pem", "redis_tls": True,
                    "redis_ca": "/etc/kvcomm/ca.pem",
                    "address_remap": {"10.0.0.5:7000": "127.0.0.1:17000",
                                      "10.0.0.8:2379": "127.0.0.1:12379"},
                    "lease_ttl": "10s", "max_clock_skew": "250ms"}})
    cl = c.cluster
    assert cl.seeds() == [("127.0.0.1", 17000)]  # seeds go through the remap, like MOVED targets
    assert cl.etcd_endpoints() == [("10.0.0.7", 2379), ("127.0.0.1", 12379)]
    assert cl.remap_address(("10.0.0.9", 7000)) == ("10.0.0.9", 7000)
    assert (cl.lease_ttl, cl.max_clock_skew) == (10.0, 0.25)
    assert kvcomm.Config().cluster.lease_ttl == 6.0 and kvcomm.Config().cluster.max_clock_skew == 0.5
    # longest prefix wins; a key that matches none follows cache.l3_consistency
    assert c.cache.strong_prefix("task/urgent/1") == "task/urgent/"
    assert c.cache.strong_prefix("task/1") == "task/" and c.cache.strong_prefix("tas") is None
    text = c.to_yaml()
    assert "etcd-s3cr3t" not in text and "etcd-s3cr3t" not in repr(c)
    assert "  # etcd_password: (set; hidden)\n" in text and "  lease_ttl: 10s\n" in text
    assert kvcomm.Config.from_mapping(yaml.safe_load(text)) == _without_secrets(c)


@pytest.mark.parametrize(("data", "key", "match"), [
    ({"cache": {"strong_prefixes": [""]}}, "cache.strong_prefixes", "non-empty"),
    ({"cache": {"strong_prefixes": ["a/", "a/"]}}, "cache.strong_prefixes", "twice"),
    ({"cache": {"strong_prefixes": ["a\0"]}}, "cache.strong_prefixes", "NUL"),
    ({"cache": {"max_key_bytes": 4, "strong_prefixes": ["tasks/"]}}, "cache.strong_prefixes",
     "max_key_bytes=4"),
    ({"cache": {"strong_prefixes": "task/"}}, "cache.strong_prefixes", "list"),
    ({"cluster": {"etcd": ["no-port"]}}, "cluster.etcd", "host:port"),
    ({"cluster": {"redis_ca": "/ca.pem"}}, "cluster.redis_ca", "redis_tls: true"),
    ({"cluster": {"etcd_cert": "/c.pem"}}, "cluster.etcd_cert", "etcd_tls: true"),
    ({"cluster": {"etcd_tls": True, "etcd_key": "/k.pem"}}, "cluster.etcd_key", "etcd_cert"),
    ({"cluster": {"address_remap": {"a:1": "b:0"}}}, "cluster.address_remap", "host:port"),
    ({"cluster": {"lease_ttl": "500ms"}}, "cluster.lease_ttl", "at least 1s"),
    ({"cluster": {"max_clock_skew": 0}}, "cluster.max_clock_skew", "greater than 0"),
    ({"cluster": {"etcd_password": 5}}, "cluster.etcd_password", "(hidden)"),
])
def test_etcd_and_strong_keys_are_validated(data: dict[str, object], key: str, match: str) -> None:
    with pytest.raises(kvcomm.ConfigError, match=re.escape(match)) as info:
        kvcomm.Config.from_mapping(data)
    assert info.value.key == key


def test_a_feed_total_that_cannot_be_honoured_is_refused() -> None:
    """F: cluster.feed_total is documented as the bound on all groups' streams together,
    but each stream keeps at least FEED_MIN (100) entries: feed_total 100,000 with 16,384
    groups keeps 1.6 million entries (16x the bound) silently. A config whose bound
    cannot hold must say so.
    (found in review 11: slot balancing)"""
    with pytest.raises(ConfigError, match="feed_total"):
        kvcomm.Config.from_mapping({"cluster": {"redis": ["127.0.0.1:7000"], "groups": 16384,
                                                "feed_total": 100_000}})
