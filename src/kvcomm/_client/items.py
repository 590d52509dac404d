"""What the client hands out: Item, Event, ABSENT (and the private sentinels)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.versions import Version
from ..tiers.l2 import TAG_TOMBSTONE


class _Absent:
    """``expect=kvcomm.ABSENT``: the write succeeds only if the key does not exist."""

    _instance: _Absent | None = None

    def __new__(cls) -> _Absent:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "kvcomm.ABSENT"

    def __reduce__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()


class _NoCheck:
    """``expect=``'s default: no expectation (a plain write)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<no expectation>"


_NO_CHECK: Any = _NoCheck()


@dataclass(frozen=True, slots=True)
class Item:
    """One stored value with its version and the tier that served it."""

    key: str
    value: Any
    version: Version
    tier: str  # "l1" | "l2" | "l3"
    expires_at: float | None = None  # the key's deadline, epoch seconds; None: never expires


@dataclass(frozen=True, slots=True)
class Event:
    """A change seen by :meth:`Client.watch`. ``overflow`` has key "" and version None."""

    key: str
    kind: str  # "put" | "delete" | "expire" | "evict" | "overflow"
    version: Version | None


class _TombstoneValue:
    """The value of a local tombstone while a merge weighs it against a remote version."""

    def __repr__(self) -> str:
        return "<deleted>"


_TOMBSTONE = _TombstoneValue()


_TOMB_ENCODED: tuple[int, bytes, bytes] = (TAG_TOMBSTONE, b"", b"")

