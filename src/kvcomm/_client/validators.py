"""What every write path shares below the client's layers (base.py's raw L2 reads and
writes, strong.py's etcd writes, a batch): a validator's run and the bound on a
read-modify-write's retries."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..core.codec import Packed
from ..errors import ValidationError, WriteUnderLock
from .items import Item

_MAX_UPDATE_RETRIES = 100_000


def _run_validator(fn: Callable[[str, Item | None, Any], None], key: str, old: Item | None,
                   new_value: Any) -> None:
    """Run a validator: whatever it raises rejects the write as ValidationError, except a
    write it attempted (WriteUnderLock, an InvalidArgument: a bug of the validator, which
    register_validator documents as such, not its verdict). A value its caller encoded
    (codec.Packed, KVCOMM's integrations) is shown as the list it stores."""
    if type(new_value) is Packed:
        new_value = new_value.value
    try:
        fn(key, old, new_value)
    except (ValidationError, WriteUnderLock):
        raise
    except Exception as exc:
        raise ValidationError(f"write to {key!r} rejected by validator: {exc}") from exc
