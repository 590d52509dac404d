"""KVCOMM: shared memory for multi-agent systems.

``kv = kvcomm.open()``; ``kv.put("drone/7/pos", state)`` here, ``kv.get("drone/7/pos")``
anywhere on the host: from this process's L1, from the host's shared-memory L2.

The package is lazy (PEP 562): ``import kvcomm`` loads only the exceptions; the client
(and with it the C kernel ``kvcomm._l2core``), the config (pydantic) and the version
types load on first use of a name that needs them. So ``import kvcomm.core`` (the pure
logic: versions, conflict resolution, write window, sketch, Bloom filter, codec, backoff)
works without the C extension, and nothing here imports ``redis``: cluster mode loads it
when a client first reaches L3 (``pip install 'kvcomm[cluster]'``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import ConfigError as ConfigError
from .errors import ConflictError as ConflictError
from .errors import CorruptRecord as CorruptRecord
from .errors import InvalidArgument as InvalidArgument
from .errors import InvalidKey as InvalidKey
from .errors import InvalidNamespace as InvalidNamespace
from .errors import KVCommError as KVCommError
from .errors import KVCommWarning as KVCommWarning
from .errors import SegmentError as SegmentError
from .errors import Unavailable as Unavailable
from .errors import UnflushedWrites as UnflushedWrites
from .errors import UnsupportedValue as UnsupportedValue
from .errors import UsageError as UsageError
from .errors import ValidationError as ValidationError
from .errors import ValueTooLarge as ValueTooLarge

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ loads these
    from ._client import ABSENT as ABSENT
    from ._client import Batch as Batch
    from ._client import Client as Client
    from ._client import Event as Event
    from ._client import Item as Item
    from ._client import Presence as Presence
    from ._client import open as open  # noqa: A004
    from .config import Config as Config
    from .core.versions import Ordering as Ordering
    from .core.versions import Version as Version

__version__ = "0.1.0"

# public name -> the module that defines it, imported on first access
_LAZY = {
    "ABSENT": "._client", "Batch": "._client", "Client": "._client", "Event": "._client",
    "Item": "._client", "Presence": "._client", "open": "._client",
    "Config": ".config",
    "Ordering": ".core.versions", "Version": ".core.versions",
}

__all__ = [
    "ABSENT", "Batch", "Client", "Config", "ConfigError", "ConflictError", "CorruptRecord",
    "Event", "InvalidArgument", "InvalidKey", "InvalidNamespace", "Item", "KVCommError", "KVCommWarning",
    "Ordering", "Presence", "SegmentError", "Unavailable", "UnflushedWrites", "UnsupportedValue",
    "UsageError", "ValidationError",
    "ValueTooLarge", "Version", "open",
]

if not TYPE_CHECKING:  # hidden from mypy, which would otherwise accept any misspelt name

    def __getattr__(name: str) -> Any:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module 'kvcomm' has no attribute {name!r}")
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value  # later lookups are plain module attributes
        return value


def __dir__() -> list[str]:
    """The public names, loaded or not, and the subpackages imported so far."""
    loaded = [n for n, v in globals().items()
              if getattr(v, "__name__", "").startswith(f"{__name__}.") and not n.startswith("_")]
    return sorted({*__all__, "__version__", *loaded})
