"""The typed configuration: one YAML file, every key defaulted, units parsed here only.

Sizes accept ``"4KB"``, ``"64MiB"``, ``"1GB"`` or a plain integer of bytes; KB/MB/GB are
binary (1 KB = 1024 bytes), as in Redis. Durations accept ``"500us"``, ``"50ms"``,
``"2s"``, ``"1m"`` or a number of seconds. Anything unknown or malformed raises
:class:`~kvcomm.errors.ConfigError` naming the dotted key.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from .errors import ConfigError

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40,
}
_TIME_UNITS = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "": 1.0, "m": 60.0, "min": 60.0}
_NUM_UNIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Zµ]*)\s*$")


def parse_size(value: Any) -> int:
    """``"4KB"`` → 4096. Raises ValueError with the accepted forms."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as '4KB' or a number of bytes, got a bool")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a size cannot be negative")
        return value
    if isinstance(value, str):
        m = _NUM_UNIT.match(value)
        if m and m.group(2).lower() in _SIZE_UNITS:
            return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    raise ValueError(f"expected a size such as '4KB', '64MB', '1GB' or bytes, got {value!r}")


def parse_duration(value: Any) -> float:
    """``"50ms"`` → 0.05 (seconds). Raises ValueError with the accepted forms."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as '50ms', got a bool")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError("a duration cannot be negative")
        return float(value)
    if isinstance(value, str):
        m = _NUM_UNIT.match(value)
        if m and m.group(2).lower() in _TIME_UNITS:
            return float(m.group(1)) * _TIME_UNITS[m.group(2).lower()]
    raise ValueError(f"expected a duration such as '500us', '50ms', '2s', got {value!r}")


Size = Annotated[int, BeforeValidator(parse_size)]
Duration = Annotated[float, BeforeValidator(parse_duration)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True)


class CacheConfig(_Section):
    l1_size: Size = Field(default=256 << 20, ge=0,
                          description="decoded values a process keeps in L1, bytes (0: no L1)")
    l2_size: Size = Field(default=256 << 20, ge=1 << 20, description="L2 segment size per host")
    l2_dir: str = Field(default="/dev/shm", min_length=1,
                        description="directory (a tmpfs) that holds the L2 segments")
    lock_timeout: Duration = Field(default=10.0, gt=0, le=3600,
                                   description="wait at most this long for the L2 writer lock")
    l2_sync_interval: Duration = Field(default=0.05, gt=0)
    l3_consistency: Literal["eventual", "strong"] = "eventual"
    max_key_bytes: int = Field(default=250, ge=1, le=4096)
    max_value_size: Size = Field(default=64 << 20, ge=1)
    watch_buffer: int = Field(
        default=16384, ge=16, le=1 << 22, description="change-feed events (at most 1/8 of l2_size)"
    )
    max_views: int = Field(default=1024, ge=0, le=1 << 16, description="zero-copy views held")
    l2_permissions: int = Field(default=0o600, ge=0, le=0o777)
    max_batch_ops: int = Field(default=1000, ge=1, description="writes per coalesced batch")
    max_batch_bytes: Size = Field(default=1 << 20, ge=1, description="bytes per batch")
    negative_ttl: Duration = Field(default=5.0, ge=0, description="how long 'absent' is trusted")
    negative_max_entries: int = Field(default=100_000, ge=1)
    bloom_capacity: int = Field(default=1_000_000, ge=1, description="keys the Bloom filter holds")
    bloom_fpr: float = Field(default=0.001, gt=0, lt=1, description="its false-positive rate")
    hot_key_sample: int = Field(default=16, ge=0, le=1 << 20,
                                description="count 1 read in N for hot keys (0: off)")


class NetworkConfig(_Section):
    zero_copy_threshold: Size = Field(default=4 << 10, ge=0)


class NodeConfig(_Section):
    host_id: str = Field(
        default="local", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$"
    )
    namespace: str = Field(default="default", pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                           description="the L2 namespace kvcomm.open() uses by default")


class ClusterConfig(_Section):
    """Cluster mode: set ``redis`` to the Redis Cluster seed nodes ("host:port")."""

    redis: list[str] = Field(default_factory=list)
    redis_username: str | None = None
    redis_password: str | None = None
    redis_tls: bool = False
    timeout: Duration = Field(default=2.0, gt=0)
    outbound_max: int = Field(default=8192, ge=1,
                              description="writes waiting for L3 before put raises Unavailable")
    feed_poll: Duration = Field(default=0.02, gt=0, description="how often remote changes are read")
    feed_maxlen: int = Field(default=100_000, ge=100, description="events kept per group stream")
    wait_replicas: int = Field(default=1, ge=0, le=16,
                               description="replicas that must acknowledge a write (WAIT)")
    wait_timeout: Duration = Field(default=0.1, gt=0)
    resolvers: dict[str, str] = Field(
        default_factory=dict,
        description="key prefix -> 'module:function' the daemon imports to resolve conflicts")
    key_filter_rebuild: Duration = Field(default=600.0, gt=0,
                                         description="rotate the host's key filter this often")

    @property
    def enabled(self) -> bool:
        return bool(self.redis)

    @field_validator("resolvers")
    @classmethod
    def _resolver_paths(cls, v: dict[str, str]) -> dict[str, str]:
        for prefix, path in v.items():
            module, _, attr = path.partition(":")
            if not module or not attr:
                raise ValueError(f"resolver for {prefix!r} must be 'module:function', got {path!r}")
        return v

    def seeds(self) -> list[tuple[str, int]]:
        out = []
        for s in self.redis:
            host, _, port = s.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError("cluster.redis", f"{s!r} is not host:port")
            out.append((host, int(port)))
        return out


class Config(_Section):
    """The whole configuration. ``Config()`` is the embedded default."""

    cache: CacheConfig = CacheConfig()
    network: NetworkConfig = NetworkConfig()
    node: NodeConfig = NodeConfig()
    cluster: ClusterConfig = ClusterConfig()

    @classmethod
    def from_mapping(cls, data: Any) -> Config:
        """Validate a parsed mapping. Raises ConfigError naming the first bad key."""
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError("", f"the config must be a mapping of sections, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            key = ".".join(str(p) for p in err["loc"])
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg = "unknown key (see `kvcomm config --show` for the valid ones)"
            raise ConfigError(key, msg) from None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Config:
        """Read and validate a YAML file. Raises ConfigError (missing file, bad YAML, bad key)."""
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError("", f"cannot read config file {p}: {exc.strerror}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError("", f"{p} is not valid YAML: {exc}") from None
        return cls.from_mapping(data)

    def to_yaml(self) -> str:
        """The effective config as YAML, sizes in bytes and durations in seconds."""
        data = self.model_dump()
        data["cache"]["l2_permissions"] = oct(self.cache.l2_permissions)
        return yaml.safe_dump(data, sort_keys=False)


def resolve(config: Config | str | os.PathLike[str] | None) -> Config:
    """A Config from what ``kvcomm.open(config=...)`` accepts."""
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, str | os.PathLike):
        return Config.load(config)
    raise ConfigError("", f"config must be a path or a kvcomm.Config, got {type(config).__name__}")
