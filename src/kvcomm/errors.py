"""KVCOMM's exceptions: one tree, every message says what to do next.

::

    KVCommError
    ├── InvalidKey          key is not a non-empty str, too long, or holds NUL
    ├── UnsupportedValue    value type cannot be stored (never pickled)
    ├── ValueTooLarge       over cache.max_value_size, or over what L2 can ever hold
    ├── ConflictError       expect= did not match the stored version
    ├── ValidationError     an application validator rejected the write
    ├── InvalidArgument     another argument is wrong (consistency=, expect=, timeout=)
    │   └── WriteUnderLock  a write from a validator (code that runs under the writer lock)
    ├── ConfigError         bad config; .key names the offending key
    ├── SegmentError        L2 segment is foreign, of another layout, corrupt or purged
    │   └── UnflushedWrites a purge refused: the segment holds writes not yet in L3
    ├── CorruptRecord       an L3 value (or change-feed entry) of one key is not a KVCOMM record
    └── Unavailable         a tier cannot serve now (L2 full of pinned data, cluster down)

    KVCommWarning (a UserWarning, not an error): a setting was ignored, e.g. cache.l2_size of
    a namespace that already exists with another size.

After any of these, nothing stored before the failing call has been changed.
Lower-layer errors (OS, msgpack, redis) are translated at the boundary, never leaked.
"""

from __future__ import annotations

import os
import threading

MADE: dict[str, int] = {}
"""Errors made in this process, by class name (``kvcomm_errors_total{type}``: flushed to
the host's L2 with the other counters). Counted when made, so it includes those KVCOMM
handles itself: a compare-and-set that ``update()`` retries, an L3 call retried. Exact
under threads (counted under a lock); a forked child starts from zero (what its parent
made before the fork is the parent's to flush)."""

_MADE_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    global _MADE_LOCK
    _MADE_LOCK = threading.Lock()  # (another thread of the parent may have held it)
    MADE.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class KVCommError(Exception):
    """Root of every error KVCOMM raises on purpose."""

    def __new__(cls, *args: object, **kwargs: object) -> KVCommError:
        name = cls.__name__
        with _MADE_LOCK:  # (a read-modify-write: threads making errors at once lose counts)
            MADE[name] = MADE.get(name, 0) + 1
        return super().__new__(cls, *args, **kwargs)


class InvalidKey(KVCommError, ValueError):
    """The key is not a non-empty str within cache.max_key_bytes of UTF-8 without NUL."""


class UnsupportedValue(KVCommError, TypeError):
    """The value's type cannot be stored; see docs/getting-started.md, "A first program"."""


class ValueTooLarge(KVCommError, ValueError):
    """The encoded value is over cache.max_value_size or larger than L2 can ever hold."""


class ConflictError(KVCommError):
    """A compare-and-set (expect=) did not match; nothing was changed."""


class ValidationError(KVCommError):
    """An application validator registered for the key's prefix rejected the write."""


class InvalidArgument(KVCommError, ValueError):
    """An argument other than the key or value is wrong; the message names it."""


class UsageError(InvalidArgument, TypeError):
    """A client used in a way it does not work (subscripted or iterated like a dict, the
    other face's ``with``): the message says what to write instead. Also a TypeError,
    what Python raises for such a use."""


class WriteUnderLock(InvalidArgument):
    """A write was attempted from a validator (or other code that runs under the host's L2
    writer lock): validators may read, not write. It reaches the caller of the write
    being validated as it is (an InvalidArgument, never turned into ValidationError)."""


class ConfigError(KVCommError, ValueError):
    """The configuration is invalid. ``key`` is the dotted name of the offending key."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)


class SegmentError(KVCommError):
    """The L2 shared-memory segment cannot be used as it is (foreign, old layout, corrupt)."""


class InvalidNamespace(SegmentError, InvalidArgument):
    """The namespace name is not 1-64 letters, digits, '.', '_' or '-' (an argument error:
    also an InvalidArgument and a ValueError; a SegmentError as it always was)."""


class UnflushedWrites(SegmentError):
    """``kvcomm purge`` refused: the segment holds acknowledged writes L3 has not got yet.
    Let the node daemon deliver them (or ``kvcomm migrate`` an older segment's), or pass
    ``--force`` to discard them knowingly."""


class CorruptRecord(KVCommError):
    """A value read from L3 under a KVCOMM key is not a valid KVCOMM record (written by
    something else, truncated, or hostile). It concerns that key only: remove or rewrite
    the key in Redis; other keys are unaffected."""


class Unavailable(KVCommError):
    """The operation cannot be served right now; the message says which tier and why."""


class KVCommWarning(UserWarning):
    """Something was not done as configured; the message says what and why."""


__all__ = [
    "KVCommWarning",
    "KVCommError",
    "InvalidKey",
    "UnsupportedValue",
    "ValueTooLarge",
    "ConflictError",
    "ValidationError",
    "InvalidArgument",
    "WriteUnderLock",
    "ConfigError",
    "SegmentError",
    "CorruptRecord",
    "Unavailable",
]
