"""The typed configuration: one YAML file, every key defaulted, units parsed here only.

Sizes accept ``"4KB"``, ``"64MiB"``, ``"1GB"`` or a plain integer of bytes; KB/MB/GB/TB are
binary (1 KB = 1024 bytes), as in Redis; a fraction of a byte is dropped (``"0.3MB"`` is
314572). Durations accept ``"500us"``, ``"50ms"``, ``"2s"``, ``"1m"`` or a finite number of
seconds, at most 365 days. ``cache.l2_permissions`` is a file mode: ``0o600``, ``"0o600"``,
``"0600"`` or ``384``, owner read and write included.

Every way in validates and raises :class:`~kvcomm.errors.ConfigError` naming the dotted
key (``cache.l1_size``, ``cluster.redis[0]``): ``Config(...)``, each section's constructor
(``CacheConfig(...)``), ``Config.model_validate`` and its JSON/strings variants,
``model_copy(update=...)``, ``Config.from_mapping`` and ``Config.load``. pydantic's own
ValidationError never leaves this module. A Config is immutable: assigning to a field
raises ConfigError too.

``Config.to_yaml`` prints what ``Config.load`` reads back to an equal Config: sizes and
durations in the largest unit that is exact, the file mode in octal, and secrets (every
key whose name ends in ``_password``) as a comment line, never their value.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import reprlib
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Self

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from .errors import ConfigError

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40,
}
_TIME_UNITS = {
    "us": Fraction(1, 10**6), "µs": Fraction(1, 10**6), "ms": Fraction(1, 1000),
    "s": Fraction(1), "": Fraction(1), "m": Fraction(60), "min": Fraction(60),
}
# digit counts are bounded so that no input, however long, reaches int()'s digit limit
_NUM_UNIT = re.compile(r"^\s*([0-9]{1,30}(?:\.[0-9]{1,30})?)\s*([a-zA-Zµ]{0,3})\s*$")

MAX_SIZE = (1 << 63) - 1
"""The largest size any key takes: what a signed 64-bit file offset can address."""
MAX_DURATION = 365 * 24 * 3600.0
"""The longest duration any key takes, in seconds: below every OS timer's limit."""
MAX_COUNT = (1 << 63) - 1
"""The largest plain integer any key takes (Redis and the C kernel count in int64)."""

# printed by to_yaml, largest first; each entry is (suffix, multiple)
_SIZE_OUT = (("TB", 1 << 40), ("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10))
_TIME_OUT = (("m", Fraction(60)), ("s", Fraction(1)), ("ms", Fraction(1, 1000)),
             ("us", Fraction(1, 10**6)))
_SECRET_SUFFIX = "_password"
_HIDDEN = "(set; hidden)"
_MAX_FILE_BYTES = 1 << 20
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxlong = 2, 4, 4, 60, 40


def parse_size(value: Any) -> int:
    """``"4KB"`` → 4096. Returns bytes in [0, MAX_SIZE]; raises ValueError with the accepted forms."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as '4KB' or a number of bytes, got a bool")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a size cannot be negative")
        if value > MAX_SIZE:
            raise ValueError(f"a size must be at most {MAX_SIZE} bytes (8 EiB)")
        return value
    if isinstance(value, str):
        m = _NUM_UNIT.match(value)
        if m and m.group(2).lower() in _SIZE_UNITS:
            return parse_size(math.floor(Fraction(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]))
    raise ValueError(f"expected a size such as '4KB', '64MB', '1GB' or bytes, got {_show(value)}")


def parse_duration(value: Any) -> float:
    """``"50ms"`` → 0.05. Returns seconds, finite, in [0, MAX_DURATION].

    A string is converted exactly and rounded once, so ``"50ms"`` is the float nearest to
    1/20. Raises ValueError with the accepted forms.
    """
    if isinstance(value, bool):
        raise ValueError("expected a duration such as '50ms', got a bool")
    if isinstance(value, int | float):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"a duration must be a finite number of seconds, got {value!r}")
        if value < 0:
            raise ValueError("a duration cannot be negative")
        if value > MAX_DURATION:
            raise ValueError(f"a duration must be at most {MAX_DURATION:.0f}s (365 days)")
        return float(value)
    if isinstance(value, str):
        m = _NUM_UNIT.match(value)
        if m and m.group(2).lower() in _TIME_UNITS:
            exact = Fraction(m.group(1)) * _TIME_UNITS[m.group(2).lower()]
            if exact > MAX_DURATION:
                raise ValueError(f"a duration must be at most {MAX_DURATION:.0f}s (365 days)")
            return float(exact)
    raise ValueError(f"expected a duration such as '500us', '50ms', '2s', '10m', got {_show(value)}")


def parse_permissions(value: Any) -> int:
    """``0o600``, ``"0o600"``, ``"0600"`` or ``384`` → 384.

    YAML reads ``0o600`` as the string ``"0o600"`` and ``0600`` as the int 384: both are
    meant. Returns a mode within 0o777 that grants the owner read and write (the segment's
    own processes need both); raises ValueError otherwise.
    """
    forms = "a file mode such as 0o600 (owner only) or 0o660 (owner and group)"
    mode: int | None = None
    if isinstance(value, bool):
        raise ValueError(f"expected {forms}, got a bool")
    if isinstance(value, int):
        mode = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*0[oO]?([0-7]{1,4})\s*", value)
        if m is None:
            hint = f"; write 0o{value.strip()} for an octal mode" if value.strip().isdigit() else ""
            raise ValueError(f"expected {forms}, got {_show(value)}{hint}")
        mode = int(m.group(1), 8)
    if mode is None:
        raise ValueError(f"expected {forms}, got {_show(value)}")
    if not 0 <= mode <= 0o777:
        hint = ""
        if isinstance(value, int) and re.fullmatch(r"[0-7]{3}", str(value)):
            hint = f"; write 0o{value} for an octal mode (YAML reads {value} as decimal)"
        raise ValueError(f"expected {forms} (only the 0o777 bits apply), got {_show_mode(mode)}{hint}")
    if mode & 0o600 != 0o600:
        raise ValueError(f"{oct(mode)} denies the owner read or write; the owner's processes "
                         f"need both (e.g. 0o600)")
    return mode


def format_size(n: int) -> str | int:
    """Bytes in the largest binary unit that is exact (``"1536KB"``), else plain bytes."""
    if n > 0:
        for suffix, mult in _SIZE_OUT:
            if n % mult == 0:
                return f"{n // mult}{suffix}"
    return n


def format_duration(seconds: float) -> str | float:
    """Seconds in the largest unit that parses back to exactly ``seconds`` (``"50ms"``).

    Falls back to the plain number of seconds (a float that YAML reads back unchanged).
    """
    if seconds == 0:
        return "0s"
    for suffix, unit in _TIME_OUT:
        n = round(Fraction(seconds) / unit)
        if n > 0 and float(n * unit) == seconds:
            return f"{n}{suffix}"
    return seconds


def _show(value: Any) -> str:
    # bounded: an input can be a YAML alias bomb whose full repr would never finish, or an
    # int whose repr raises (over sys.get_int_max_str_digits())
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    try:
        return _REPR.repr(value)
    except Exception:  # a user's object whose __repr__ fails still gets its error named
        return f"a {type(value).__name__}"


def _show_mode(value: Any) -> str:
    return oct(value) if isinstance(value, int) and not isinstance(value, bool) else _show(value)


def _no_bool(value: Any) -> Any:
    # pydantic's lax mode reads True as 1: a bool where a number belongs is a mistake
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    return value


def _utf8(value: str) -> str:
    # lone surrogates cannot go to YAML, Redis or a file name: refuse them here
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (it holds a lone surrogate)") from None
    return value


Size = Annotated[int, BeforeValidator(parse_size)]
Duration = Annotated[float, BeforeValidator(parse_duration)]
Permissions = Annotated[int, BeforeValidator(parse_permissions)]
Count = Annotated[int, BeforeValidator(_no_bool), Field(le=MAX_COUNT)]
Ratio = Annotated[float, BeforeValidator(_no_bool)]
Text = Annotated[str, AfterValidator(_utf8)]


def _kind(info: FieldInfo | None) -> str | None:
    """'size', 'duration' or 'mode' for a field of that unit, else None."""
    for meta in info.metadata if info is not None else ():
        func = getattr(meta, "func", None)
        if func is parse_size:
            return "size"
        if func is parse_duration:
            return "duration"
        if func is parse_permissions:
            return "mode"
    return None


def _format(info: FieldInfo | None, value: Any) -> Any:
    kind = _kind(info)
    if kind == "size" and isinstance(value, int):
        return format_size(value)
    if kind == "duration" and isinstance(value, float):
        return format_duration(value)
    if kind == "mode" and isinstance(value, int):
        return oct(value)
    return value


def _is_secret(name: str) -> bool:
    return name.endswith(_SECRET_SUFFIX)


class _Section(BaseModel):
    """A frozen group of keys whose every way in raises ConfigError, never pydantic's error."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True)
    _prefix: ClassVar[str] = ""

    def __init__(self, /, **data: Any) -> None:
        """Validate ``data``; raises ConfigError naming the first bad dotted key."""
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _translate(exc, type(self)) from None

    # pydantic calls a model's own __init__ for every nested section it validates, with the
    # input as keyword arguments (a key that is not a str would raise TypeError there);
    # marked as pydantic's base __init__ it is called only by a user's CacheConfig(...)
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> Self:
        """As pydantic's, raising ConfigError naming the first bad dotted key."""
        try:
            return super().model_validate(obj, *args, **kwargs)
        except ValidationError as exc:
            raise _translate(exc, cls) from None

    @classmethod
    def model_validate_json(cls, json_data: Any, *args: Any, **kwargs: Any) -> Self:
        """As pydantic's, raising ConfigError (bad JSON included)."""
        try:
            return super().model_validate_json(json_data, *args, **kwargs)
        except ValidationError as exc:
            raise _translate(exc, cls) from None

    @classmethod
    def model_validate_strings(cls, obj: Any, *args: Any, **kwargs: Any) -> Self:
        """As pydantic's, raising ConfigError naming the first bad dotted key."""
        try:
            return super().model_validate_strings(obj, *args, **kwargs)
        except ValidationError as exc:
            raise _translate(exc, cls) from None

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy with ``update`` applied and validated (pydantic's skips validation).

        Raises ConfigError naming the first bad dotted key; ``self`` is unchanged.
        """
        if not update:
            return super().model_copy(deep=deep)
        if not isinstance(update, Mapping):
            raise ConfigError(self._prefix, f"update must be a mapping of keys, got {_show(update)}")
        data = {name: getattr(self, name) for name in type(self).model_fields}
        data.update(update)
        return type(self).model_validate(data)

    def __setattr__(self, name: str, value: Any) -> None:
        raise ConfigError(_join(self._prefix, name),
                          "a config is immutable; build a new one with model_copy(update={...})")

    def __delattr__(self, name: str) -> None:
        raise ConfigError(_join(self._prefix, name), "a config is immutable")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _field_at(cls: type[BaseModel], loc: tuple[Any, ...]) -> FieldInfo | None:
    """The field a pydantic error location points at (None for list items, map keys...)."""
    info: FieldInfo | None = None
    model: Any = cls
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if not isinstance(part, str) or not fields or part not in fields:
            return None
        info = fields[part]
        model = info.annotation
    return info


def _translate(exc: ValidationError, cls: type[_Section]) -> ConfigError:
    """pydantic's first error as a ConfigError naming the dotted key and what to do."""
    err = exc.errors()[0]
    inner = err.get("ctx", {}).get("error")
    loc = tuple(err["loc"])
    key = cls._prefix
    for part in loc:
        if part == "[key]":
            continue
        key = f"{key}[{part}]" if isinstance(part, int) else _join(key, str(part))
    etype = err["type"]
    info = _field_at(cls, loc)
    name = next((p for p in reversed(loc) if isinstance(p, str) and p != "[key]"), "")
    value = err.get("input")
    if etype == "extra_forbidden":
        parent = _field_at(cls, loc[:-1]) if len(loc) > 1 else None
        model: Any = parent.annotation if parent is not None else cls
        known = list(getattr(model, "model_fields", {}))
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return ConfigError(key, f"unknown key; {hint}the valid keys are {', '.join(known)}")
    if etype in ("model_type", "model_attributes_type", "dict_type") and (not loc or _is_model(info)):
        if not key:
            return ConfigError(key, "the config must be a mapping of sections "
                               f"({', '.join(cls.model_fields)}), got {_show(value)}")
        return ConfigError(key, f"a section must be a mapping of keys, got {_show(value)}")
    if etype == "value_error" and inner is not None:
        return ConfigError(key, str(inner))
    if etype == "json_invalid":
        return ConfigError(key, f"not valid JSON: {err['msg']}")
    msg = str(err["msg"]).replace("Input should be", "must be").replace("Keys should be", "keys must be")
    msg = msg.replace("greater than or equal to", "at least").replace("less than or equal to", "at most")
    ctx = err.get("ctx", {})
    for bound in ("ge", "gt", "le", "lt"):
        if bound in ctx:
            # pydantic prints a float bound of 1.0 as "1": match the number as printed
            shown_bound = str(_format(info, ctx[bound]))
            msg = re.sub(r"\b(least|most|than) [0-9.e+-]+",
                         lambda m, b=shown_bound: f"{m.group(1)} {b}", msg)  # type: ignore[misc]
    shown = "(hidden)" if _is_secret(name) else _show(_format(info, value))
    return ConfigError(key, f"{msg}: {shown}" if ", got " in msg else f"{msg}, got {shown}")


def _is_model(info: FieldInfo | None) -> bool:
    ann = info.annotation if info is not None else None
    return isinstance(ann, type) and issubclass(ann, BaseModel)


class CacheConfig(_Section):
    _prefix: ClassVar[str] = "cache"

    l1_size: Size = Field(default=256 << 20, ge=0,
                          description="decoded values a process keeps in L1, bytes (0: no L1)")
    l2_size: Size = Field(default=256 << 20, ge=1 << 20, description="L2 segment size per host")
    l2_keys: Count = Field(
        default=0, ge=0, le=1 << 31,
        description="keys L2 holds before its slot table (not its bytes) makes it evict: "
                    "slots for 1.75 per key (0: a slot per 256 bytes of l2_size, so about "
                    "l2_size / 400 keys of small records; see docs/configuration.md)")
    l2_dir: str = Field(default="/dev/shm", min_length=1,
                        description="directory (a tmpfs) that holds the L2 segments")
    lock_timeout: Duration = Field(default=10.0, gt=0, le=3600,
                                   description="wait at most this long for the L2 writer lock")
    l2_sync_interval: Duration = Field(default=0.05, gt=0)
    l3_consistency: Literal["eventual", "strong"] = "eventual"
    max_key_bytes: Count = Field(default=250, ge=1, le=4096)
    max_value_size: Size = Field(
        default=16 << 20, ge=1,
        description="the largest value a put takes (encoded bytes); L2 itself holds values "
                    "up to about l2_size/8 (the default 256MB: 32 MiB less a few KiB) and "
                    "refuses larger ones (ValueTooLarge naming cache.l2_size)")
    watch_buffer: Count = Field(
        default=16384, ge=16, le=1 << 22, description="change-feed events (at most 1/8 of l2_size)"
    )
    max_views: Count = Field(default=1024, ge=0, le=1 << 16, description="zero-copy views held")
    l2_permissions: Permissions = Field(default=0o600, description="file mode of the segment")
    max_batch_ops: Count = Field(default=1000, ge=1, description="writes per coalesced batch")
    max_batch_bytes: Size = Field(default=1 << 20, ge=1, description="bytes per batch")
    negative_ttl: Duration = Field(default=5.0, ge=0, description="how long 'absent' is trusted")
    negative_max_entries: Count = Field(default=100_000, ge=1)
    expiry_sweep: Duration = Field(
        default=0.1, gt=0, le=60,
        description="how often each process sweeps L2 for keys past their deadline (a "
                    "bounded slice of the slots each time; see docs/ttl-presence.md)")
    bloom_capacity: Count = Field(default=1_000_000, ge=1, description="keys the Bloom filter holds")
    bloom_fpr: Ratio = Field(default=0.001, gt=0, lt=1, description="its false-positive rate")
    hot_key_sample: Count = Field(default=16, ge=0, le=1 << 20,
                                  description="count 1 read in N for hot keys (0: off)")
    strong_prefixes: list[Text] = Field(
        default_factory=list,
        description="key prefixes whose keys are strong (linearizable, on etcd) in cluster mode")

    @field_validator("bloom_fpr")
    @classmethod
    def _bloom_fpr_fits_the_filter(cls, v: float, info: ValidationInfo) -> float:
        from .core.bloom import MAX_HASHES, optimal_params

        capacity = info.data.get("bloom_capacity")
        if capacity is None:  # it failed its own check
            return v
        k = optimal_params(capacity, v)[1]
        if k > MAX_HASHES:
            raise ValueError(
                f"{v!r} with cache.bloom_capacity={capacity} needs {k} hash functions; the key "
                f"filter uses at most {MAX_HASHES}: raise cache.bloom_fpr (1e-12 or more always "
                "fits) or cache.bloom_capacity")
        return v

    @field_validator("strong_prefixes")
    @classmethod
    def _strong_prefixes_are_key_prefixes(cls, v: list[str], info: ValidationInfo) -> list[str]:
        max_key = info.data.get("max_key_bytes", 250)  # absent: it failed its own check
        seen: set[str] = set()
        for i, prefix in enumerate(v):
            where = f"entry {i}"
            if not prefix:
                raise ValueError(f"{where}: a strong prefix is a non-empty key prefix such as "
                                 "'task/' (an empty one would make every key strong: use "
                                 "cache.l3_consistency: strong for that)")
            if "\0" in prefix:
                raise ValueError(f"{where}: {_show(prefix)} holds NUL, which no key can hold")
            if len(prefix.encode("utf-8")) > max_key:
                raise ValueError(f"{where}: {_show(prefix)} is longer than cache.max_key_bytes="
                                 f"{max_key}: no key could have it")
            if prefix in seen:
                raise ValueError(f"{where}: {_show(prefix)} is listed twice")
            seen.add(prefix)
        return v

    def strong_prefix(self, key: str) -> str | None:
        """The longest prefix in ``strong_prefixes`` that ``key`` starts with, or None
        (the key then follows ``l3_consistency``)."""
        best: str | None = None
        for prefix in self.strong_prefixes:
            if key.startswith(prefix) and (best is None or len(prefix) > len(best)):
                best = prefix
        return best


class NetworkConfig(_Section):
    _prefix: ClassVar[str] = "network"

    zero_copy_threshold: Size = Field(default=4 << 10, ge=0)


class NodeConfig(_Section):
    _prefix: ClassVar[str] = "node"

    host_id: str = Field(
        default="local", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$"
    )
    namespace: str = Field(default="default", pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                           description="the L2 namespace kvcomm.open() uses by default")
    # test-only: the fault tools skew one host's clock through this file (kvcomm.clock)
    test_clock_offset_file: Text | None = Field(
        default=None, min_length=1,
        description="TEST ONLY: a file holding a clock offset added to this host's wall clock")


class ClusterConfig(_Section):
    """Cluster mode: set ``redis`` to the Redis Cluster seed nodes ("host:port")."""

    _prefix: ClassVar[str] = "cluster"

    redis: list[Text] = Field(default_factory=list)
    redis_username: Text | None = None
    # repr=False: a Config printed in a log or a traceback never shows the password
    redis_password: Text | None = Field(default=None, repr=False)
    redis_tls: bool = False
    redis_ca: Text | None = Field(default=None, min_length=1,
                                  description="CA bundle (PEM) that verifies the Redis nodes")
    redis_cert: Text | None = Field(default=None, min_length=1,
                                    description="client certificate (PEM) shown to Redis")
    redis_key: Text | None = Field(default=None, min_length=1,
                                   description="its private key (PEM), unless in redis_cert")
    etcd: list[Text] = Field(default_factory=list,
                             description="etcd members (host:port) that hold strong keys and leases")
    etcd_username: Text | None = None
    etcd_password: Text | None = Field(default=None, repr=False)
    etcd_tls: bool = False
    etcd_ca: Text | None = Field(default=None, min_length=1,
                                 description="CA bundle (PEM) that verifies the etcd members")
    etcd_cert: Text | None = Field(default=None, min_length=1,
                                   description="client certificate (PEM) shown to etcd")
    etcd_key: Text | None = Field(default=None, min_length=1,
                                  description="its private key (PEM), unless in etcd_cert")
    address_remap: dict[Text, Text] = Field(
        default_factory=dict,
        description="host:port a Redis node or etcd member announces -> host:port this host "
                    "reaches it at (a NAT, a tunnel, the dev cluster's fault proxies)")
    lease_ttl: Duration = Field(default=6.0, ge=1.0, le=3600,
                                description="a host's etcd lease (etcd counts whole seconds)")
    shutdown_flush_timeout: Duration = Field(
        default=5.0, ge=0, le=3600,
        description="how long `kvcomm node` stopped by SIGTERM/SIGINT may spend sending its "
                    "backlog to L3 before it exits (what is left stays dirty in L2)")
    tombstone_grace: Duration = Field(
        default=86400.0, ge=60,
        description="how long L3 keeps an expired key's tombstone (its version) before Redis "
                    "reclaims it: at least the longest backlog a partitioned host may replay")
    max_clock_skew: Duration = Field(default=0.5, gt=0, le=3600,
                                     description="remote HLC timestamps further ahead are counted")
    timeout: Duration = Field(default=2.0, gt=0)
    daemon_wait: Duration = Field(
        default=5.0, ge=0, le=3600,
        description="how long kvcomm.open() waits for the host's node daemon (`kvcomm node`) "
                    "to heartbeat before it raises Unavailable (open(..., wait_daemon=False) "
                    "does not wait)")
    outbound_max: Count = Field(default=8192, ge=1,
                                description="writes waiting for L3 before put raises Unavailable")
    feed_poll: Duration = Field(default=0.02, gt=0, description="how often remote changes are read")
    feed_maxlen: Count = Field(default=100_000, ge=100, description="events kept per group stream")
    groups: Count = Field(default=1024, ge=16, le=16384,
                          description="hash-slot groups, a power of two (16384: one per slot); "
                          "fixed when L3 is first used")
    feed_total: Count = Field(default=1_638_400, ge=100,
                              description="events kept over all groups' streams (each keeps "
                              "feed_total / groups, at least 100, at most feed_maxlen); at "
                              "least 100 x groups")
    feed_inline: Size = Field(default=128, ge=0, le=1 << 20,
                              description="records up to this size ride in their feed entry; "
                              "larger ones are announced by key and version, and only hosts "
                              "that want the key read the record (0: none inline)")
    unread_changes: Count = Field(default=0, ge=0, le=1 << 20,
                                  description="a key a host's L2 holds leaves it at the Nth "
                                  "remote change in a row that no agent of the host read it "
                                  "before (instead of being read from L3: fewer L3 bytes; its "
                                  "next read, if any, goes to L3, and fails while L3 is out "
                                  "of reach); 0: never, every held key is refreshed at every "
                                  "change")
    feed_sweep_rate: Count = Field(default=1024, ge=1,
                                   description="group counters each daemon reads per second "
                                   "to find changes whose hint was lost")
    wait_replicas: Count = Field(default=1, ge=0, le=16,
                                 description="replicas that must acknowledge a write (WAIT)")
    wait_timeout: Duration = Field(default=0.1, gt=0)
    resolvers: dict[Text, Text] = Field(
        default_factory=dict,
        description="key prefix -> 'module:function' the daemon imports to resolve conflicts")
    key_filter_rebuild: Duration = Field(default=600.0, gt=0,
                                         description="rotate the host's key filter this often")

    @property
    def enabled(self) -> bool:
        return bool(self.redis)

    @field_validator("redis", "etcd")
    @classmethod
    def _seed_addresses(cls, v: list[str]) -> list[str]:
        for s in v:
            _host_port(s)
        return v

    @field_validator("groups")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"must be a power of two from 16 to 16384 (one group per slot), got {v}")
        return v

    @field_validator("feed_total")
    @classmethod
    def _feed_total_holds(cls, v: int, info: ValidationInfo) -> int:
        # each stream keeps at least FEED_MIN (100) entries (MAXLEN ~ trims whole nodes of
        # 100), so a total under 100 x groups could not be the bound it claims to be
        groups = info.data.get("groups")
        if groups is not None and v < 100 * groups:
            raise ValueError(
                f"{v} cannot bound {groups} groups' streams (each keeps at least 100 events): "
                f"set it to at least {100 * groups} or use fewer cluster.groups")
        return v

    @field_validator("address_remap")
    @classmethod
    def _remap_addresses(cls, v: dict[str, str]) -> dict[str, str]:
        for announced, reached in v.items():
            _host_port(announced)
            _host_port(reached)
        return v

    @field_validator("redis_ca", "redis_cert", "redis_key", "etcd_ca", "etcd_cert", "etcd_key")
    @classmethod
    def _tls_files_need_tls(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None or info.field_name is None:
            return v
        system, _, part = info.field_name.partition("_")
        if not info.data.get(f"{system}_tls", True):  # (absent: it failed its own check)
            raise ValueError(f"it is set but {system}_tls is false: set cluster.{system}_tls: "
                             "true to use it (or remove it)")
        if part == "key" and info.data.get(f"{system}_cert", "") is None:
            raise ValueError(f"a key without {system}_cert: set both (or remove it)")
        return v

    @field_validator("resolvers")
    @classmethod
    def _resolver_paths(cls, v: dict[str, str]) -> dict[str, str]:
        for prefix, path in v.items():
            module, _, attr = path.partition(":")
            if not all(p.isidentifier() for p in module.split(".")) or not attr.isidentifier():
                raise ValueError(
                    f"resolver for {prefix!r} must be 'module:function', got {_show(path)}")
        return v

    def seeds(self) -> list[tuple[str, int]]:
        """The Redis seed nodes as (host, port), each routed through ``address_remap``
        (where this host reaches it). Raises ConfigError on an entry that is not host:port."""
        return [self.remap_address(a) for a in _addresses(self.redis, "cluster.redis")]

    def etcd_endpoints(self) -> list[tuple[str, int]]:
        """The etcd members as (host, port), each routed through ``address_remap``.
        Raises ConfigError on an entry that is not host:port."""
        return [self.remap_address(a) for a in _addresses(self.etcd, "cluster.etcd")]

    def remap_address(self, address: tuple[str, int]) -> tuple[str, int]:
        """Where this host reaches ``address`` (as a server announces itself): its entry
        in ``address_remap``, else itself. Has the signature of redis-py's
        ``RedisCluster(address_remap=...)``: servers announce real ports in MOVED replies
        and CLUSTER SLOTS; a host behind proxies must connect to their ports instead."""
        if not self.address_remap:
            return address
        routed = self.address_remap.get(f"{address[0]}:{address[1]}")
        return address if routed is None else _host_port(routed)


def _addresses(entries: list[str], key: str) -> list[tuple[str, int]]:
    out = []
    for s in entries:
        try:
            out.append(_host_port(s))
        except ValueError as exc:
            raise ConfigError(key, str(exc)) from None
    return out


def _host_port(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    if not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{_show(s)} is not host:port (a port from 1 to 65535)")
    return host, int(port)


class MetricsConfig(_Section):
    """Prometheus metrics (kvcomm/metrics): agents count into the host's L2; one process
    per host serves them (the node daemon, or ``kvcomm metrics`` in embedded mode)."""

    _prefix: ClassVar[str] = "metrics"

    port: Count = Field(default=0, ge=0, le=65535,
                        description="the exporter's HTTP port (0: no exporter)")
    host: Text = Field(default="127.0.0.1", min_length=1,
                       description="the address it listens on (0.0.0.0: every interface)")
    advertise: Text = Field(default="", description="the address other machines scrape it "
                            "at, published in the cluster's registry for kvcomm top "
                            "--cluster ('': metrics.host, or this machine's name when that "
                            "is every interface)")
    flush_interval: Duration = Field(default=1.0, ge=0, le=3600,
                                     description="each process adds its counts to L2 this often "
                                     "(0: only when a client closes)")
    latency_sample: Count = Field(default=64, ge=0, le=1 << 20,
                                  description="time 1 operation in N for the latency "
                                  "histograms (0: off)")
    hot_keys: Count = Field(default=10, ge=0, le=100,
                            description="hot keys exported as kvcomm_hot_key_reads (0: none)")
    hot_key_label: Literal["truncate", "hash"] = Field(
        default="truncate", description="a hot key's label: its first hot_key_chars "
        "characters, or a hash of it (keys that must not leave the host)")
    hot_key_chars: Count = Field(default=64, ge=8, le=1024)


class Config(_Section):
    """The whole configuration. ``Config()`` is the embedded default."""

    cache: CacheConfig = CacheConfig()
    network: NetworkConfig = NetworkConfig()
    node: NodeConfig = NodeConfig()
    cluster: ClusterConfig = ClusterConfig()
    metrics: MetricsConfig = MetricsConfig()

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data: Any) -> Any:
        # `cluster:` with every key commented out is None in YAML: it means the defaults
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in cls.model_fields):
            return {k: ({} if v is None and k in cls.model_fields else v) for k, v in data.items()}
        return data

    @classmethod
    def from_mapping(cls, data: Any) -> Config:
        """Validate a parsed mapping (None is the defaults). Raises ConfigError naming the first bad key."""
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError("", "the config must be a mapping of sections "
                              f"({', '.join(cls.model_fields)}), got {type(data).__name__}")
        return cls.model_validate(dict(data))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Config:
        """Read and validate a YAML file (UTF-8, at most 1 MiB).

        Raises ConfigError for a missing or unreadable file, bytes that are not UTF-8, bad
        YAML and any bad key.
        """
        if not isinstance(path, str | os.PathLike):
            raise ConfigError("", f"a config path must be a str or a path, got {type(path).__name__}")
        try:
            p = Path(path)
            with open(p, "rb") as f:
                raw = f.read(_MAX_FILE_BYTES + 1)
        except OSError as exc:
            raise ConfigError("", f"cannot read config file {path}: {exc.strerror or exc}") from None
        except (ValueError, TypeError) as exc:  # a NUL in the path, a path of bytes
            raise ConfigError("", f"cannot read config file {path!r}: {exc}") from None
        if len(raw) > _MAX_FILE_BYTES:
            raise ConfigError("", f"{p} is over {_MAX_FILE_BYTES >> 20} MiB: is it a config file?")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError("", f"{p} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError("", f"{p} is not valid YAML: {exc}") from None
        except RecursionError:
            raise ConfigError("", f"{p} is nested too deeply to be a config") from None
        except (ValueError, TypeError, OverflowError) as exc:
            # PyYAML's constructors leak these: a date such as 2024-13-45, an int of 5000 digits
            raise ConfigError("", f"{p} is not valid YAML: {exc}") from None
        return cls.from_mapping(data)

    def to_yaml(self) -> str:
        """The effective config as YAML that ``Config.load`` reads back to an equal Config.

        Sizes and durations are printed in the largest unit that is exact, the file mode in
        octal; a secret that is set is printed as a comment line (``# redis_password: (set;
        hidden)``), so it reads back as unset.
        """
        lines: list[str] = []
        for section in type(self).model_fields:
            obj = getattr(self, section)
            lines.append(f"{section}:\n")
            for name, info in type(obj).model_fields.items():
                value = getattr(obj, name)
                if _is_secret(name) and value is not None:
                    lines.append(f"  # {name}: {_HIDDEN}\n")
                    continue
                # one key at a time, indented under its section: a value's own text can
                # never be taken for another key's line
                text = yaml.safe_dump({name: _format(info, value)}, sort_keys=False,
                                      allow_unicode=False, width=1 << 16)
                # blank lines inside a quoted scalar are newlines of the value: keep them
                lines.extend(f"  {line}\n" for line in text.removesuffix("\n").split("\n"))
        return "".join(lines)


def load_config(config: Config | str | os.PathLike[str] | None) -> Config:
    """The Config that ``kvcomm.open(config=...)`` and the ``--config`` option of every
    command mean: the defaults for None, the Config itself, or the YAML file at a path
    (:meth:`Config.load`). Raises ConfigError (a file that cannot be read or is invalid,
    or another type); reads nothing else."""
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, str | os.PathLike):
        return Config.load(config)
    hint = ": pass kvcomm.Config.from_mapping(it)" if isinstance(config, dict) else ""
    raise ConfigError("", f"config must be a path or a kvcomm.Config, got "
                          f"{type(config).__name__}{hint}")

