"""KVCOMM: shared memory for multi-agent systems.

``kv = kvcomm.open()``; ``kv.put("drone/7/pos", state)`` here, ``kv.get("drone/7/pos")``
anywhere on the host: from this process's L1, from the host's shared-memory L2.
"""

from ._client import ABSENT as ABSENT
from ._client import Batch as Batch
from ._client import Client as Client
from ._client import Event as Event
from ._client import Item as Item
from ._client import open as open  # noqa: A004
from .config import Config as Config
from .core.versions import Ordering as Ordering
from .core.versions import Version as Version
from .errors import ConfigError as ConfigError
from .errors import ConflictError as ConflictError
from .errors import CorruptRecord as CorruptRecord
from .errors import InvalidArgument as InvalidArgument
from .errors import InvalidKey as InvalidKey
from .errors import KVCommError as KVCommError
from .errors import KVCommWarning as KVCommWarning
from .errors import SegmentError as SegmentError
from .errors import Unavailable as Unavailable
from .errors import UnsupportedValue as UnsupportedValue
from .errors import ValidationError as ValidationError
from .errors import ValueTooLarge as ValueTooLarge

__version__ = "0.1.0"
