"""LangGraph's serializer protocol, locked so that nothing is ever pickled or unpickled.

LangGraph's ``JsonPlusSerializer`` falls back to ``pickle`` when it is made with
``pickle_fallback=True`` (and accepts ``("pickle", bytes)`` from storage then). KVCOMM's
data is shared by every process of every host: a pickle in it would run code in each
reader. :func:`no_pickle` therefore

* refuses a serializer configured to pickle (a ``JsonPlusSerializer`` with
  ``pickle_fallback``, one wrapped in ``EncryptedSerializer``, an untyped ``dumps``/
  ``loads`` object such as the ``pickle`` module itself), and
* wraps whatever it accepts so that a ``"pickle"`` type is refused both ways: a value the
  serializer could only pickle raises, and a ``("pickle", ...)`` record read from KVCOMM
  (written by another program) raises rather than being loaded.

Both raise :class:`kvcomm.UnsupportedValue` (writing) or :class:`kvcomm.CorruptRecord`
(reading), and nothing is stored or returned then.
"""

from __future__ import annotations

from typing import Any

from langgraph.checkpoint.serde.base import SerializerProtocol
from langgraph.checkpoint.serde.encrypted import EncryptedSerializer
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

from ...errors import ConfigError, CorruptRecord, UnsupportedValue

_PICKLE_TYPES = frozenset({"pickle", "pickle5"})


def _pickles(serde: Any) -> bool:
    if isinstance(serde, JsonPlusSerializer):
        return bool(serde.pickle_fallback)
    if isinstance(serde, EncryptedSerializer):
        return _pickles(serde.serde)
    return False


class NoPickleSerializer(SerializerProtocol):
    """A LangGraph serializer that refuses the ``pickle`` type in both directions."""

    def __init__(self, inner: SerializerProtocol) -> None:
        self.inner = inner

    def dumps_typed(self, obj: Any) -> tuple[str, bytes]:
        """``inner.dumps_typed(obj)``. Raises UnsupportedValue when it would be a pickle
        (nothing is stored), and what the inner serializer raises."""
        type_, data = self.inner.dumps_typed(obj)
        if type_ in _PICKLE_TYPES:
            raise UnsupportedValue(f"{type(obj).__name__} would be stored as a pickle; KVCOMM "
                                   "never stores pickles: make it msgpack-serializable")
        return type_, data

    def loads_typed(self, data: tuple[str, bytes]) -> Any:
        """``inner.loads_typed(data)``. Raises CorruptRecord for a pickle (never loaded)."""
        if data[0] in _PICKLE_TYPES:
            raise CorruptRecord("a LangGraph record in KVCOMM is a pickle, which KVCOMM never "
                                "loads; it was not written by KVCommSaver/KVCommStore: delete it")
        return self.inner.loads_typed(data)


def no_pickle(serde: Any | None) -> NoPickleSerializer:
    """The serializer a KVCommSaver or KVCommStore uses: ``serde`` (LangGraph's
    ``JsonPlusSerializer()`` when None), refusing pickles. Raises ConfigError for a
    serializer configured to pickle or one without ``dumps_typed``/``loads_typed``."""
    if serde is None:
        serde = JsonPlusSerializer(pickle_fallback=False)
    if isinstance(serde, NoPickleSerializer):
        return serde
    if not (callable(getattr(serde, "dumps_typed", None))
            and callable(getattr(serde, "loads_typed", None))):
        raise ConfigError("", f"serde={serde!r} has no dumps_typed/loads_typed: pass a LangGraph "
                              "SerializerProtocol such as JsonPlusSerializer() (an untyped "
                              "dumps/loads object, pickle above all, is refused)")
    if _pickles(serde):
        raise ConfigError("", "serde is configured with pickle_fallback=True: KVCOMM never "
                              "stores pickles; use JsonPlusSerializer() without it")
    return NoPickleSerializer(serde)
