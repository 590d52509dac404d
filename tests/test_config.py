"""Config: units, defaults, and a ConfigError naming the key for anything wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvcomm
from kvcomm.config import parse_duration, parse_size


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
