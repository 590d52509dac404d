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

A pickle is not the only way a record can run code: ``JsonPlusSerializer``'s msgpack
records may name any ``module.function`` to call with their arguments when loaded (its
"constructor" ext types), and by default (``allowed_msgpack_modules`` left unset, without
``LANGGRAPH_STRICT_MSGPACK``) it calls whatever a record names, ``os.system`` included. So
the default serializer here is strict (``allowed_msgpack_modules=None``: LangGraph's own
list of safe types; a record naming anything else loads as its raw arguments, nothing is
called), and a serializer that would call anything (``allowed_msgpack_modules=True`` or
the permissive default, ``allowed_json_modules=True``) is refused like a pickling one.
Graph states holding your own classes (dataclasses, pydantic models) name them:
``JsonPlusSerializer(allowed_msgpack_modules=[("my.module", "MyState")])``.
"""

from __future__ import annotations

from typing import Any

from langgraph.checkpoint.serde.base import SerializerProtocol
from langgraph.checkpoint.serde.encrypted import EncryptedSerializer
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

from ..._l2core import NoPickle
from ...errors import ConfigError, CorruptRecord, KVCommError, UnsupportedValue

_PICKLE_TYPES = frozenset({"pickle", "pickle5"})  # (the C half, NoPickle, refuses the same)


def _pickles(serde: Any) -> bool:
    if isinstance(serde, JsonPlusSerializer):
        return bool(serde.pickle_fallback)
    if isinstance(serde, EncryptedSerializer):
        return _pickles(serde.serde)
    return False


def _calls_anything(serde: Any) -> bool:
    """Whether ``serde`` calls any function a stored record names when it loads it."""
    if isinstance(serde, JsonPlusSerializer):
        return (getattr(serde, "_allowed_msgpack_modules", None) is True
                or getattr(serde, "_allowed_json_modules", None) is True)
    if isinstance(serde, EncryptedSerializer):
        return _calls_anything(serde.serde)
    return False


class NoPickleSerializer(NoPickle, SerializerProtocol):
    """A LangGraph serializer that refuses the ``pickle`` type in both directions.

    ``dumps_typed(obj)`` is ``self.inner.dumps_typed(obj)`` (the inner serializer looked up
    at each call), in C (``_l2core.NoPickle``: a graph writes several values a step): an
    exact (str, bytes) pair of a type not in _PICKLE_TYPES is returned as is; whatever
    else the inner serializer returns or raises is judged by :meth:`_judge`. It raises
    UnsupportedValue when the value would be a pickle or the inner serializer cannot
    serialize it (its TypeError); nothing is stored then."""

    def __init__(self, inner: SerializerProtocol) -> None:
        self.inner = inner

    @staticmethod
    def _judge(obj: Any, out: Any, exc: BaseException | None) -> tuple[str, bytes]:
        """What ``dumps_typed`` returns for ``obj`` when the inner serializer returned
        ``out`` of another shape than an exact (str, bytes) pair, or a pickle's type, or
        raised ``exc``."""
        if exc is not None:
            try:
                raise exc
            except UnsupportedValue:
                raise
            except TypeError:  # (JsonPlusSerializer: "Type is not msgpack serializable")
                raise UnsupportedValue(
                    f"{type(obj).__name__} cannot be serialized without pickle ({exc}); KVCOMM "
                    "never stores pickles: use msgpack-serializable values (a NumPy scalar such "
                    "as np.float64(2.5): its .item(), the Python number; kv.put converts those, "
                    "LangGraph's serializer does not), or name your class in "
                    "JsonPlusSerializer(allowed_msgpack_modules=[(module, name)])") from None
        try:
            type_, data = out
        except (TypeError, ValueError):  # (not a pair at all)
            raise UnsupportedValue(
                f"the serializer gave {str(out)[:80]} for a {type(obj).__name__}; a LangGraph "
                "serializer's dumps_typed returns (str, bytes): fix the serializer given as "
                "serde") from None
        if type(data) is bytes and type(type_) is str and type_ not in _PICKLE_TYPES:
            return type_, data  # (a pair of another shape: a list, a tuple subclass)
        if type(type_) is str and type_ in _PICKLE_TYPES:
            raise UnsupportedValue(f"{type(obj).__name__} would be stored as a pickle; KVCOMM "
                                   "never stores pickles: make it msgpack-serializable")
        if type(type_) is str and type(data) is bytearray:
            return type_, bytes(data)  # (LangGraph's own serializer, for a bytearray)
        raise UnsupportedValue(
            f"the serializer gave ({type(type_).__name__}, {type(data).__name__}) for a "
            f"{type(obj).__name__}; a LangGraph serializer's dumps_typed returns (str, "
            "bytes): fix the serializer given as serde")

    def loads_typed(self, data: tuple[str, bytes]) -> Any:
        """``inner.loads_typed(data)``. Raises CorruptRecord for a pickle (never loaded)
        and for anything else the inner serializer cannot read (what it raises, a
        RecursionError from deeply nested JSON included): what is read is untrusted."""
        if type(data[0]) is not str or type(data[1]) is not bytes:
            raise CorruptRecord(f"a LangGraph record in KVCOMM holds a serialized value of "
                                f"types ({type(data[0]).__name__}, {type(data[1]).__name__}), "
                                "not (str, bytes); it was not written by KVCommSaver/"
                                "KVCommStore: delete it")
        if data[0] in _PICKLE_TYPES:
            raise CorruptRecord("a LangGraph record in KVCOMM is a pickle, which KVCOMM never "
                                "loads; it was not written by KVCommSaver/KVCommStore: delete it")
        try:
            return self.inner.loads_typed(data)
        except KVCommError:
            raise
        except Exception as exc:  # (json, ormsgpack and LangGraph's hooks raise many types)
            raise CorruptRecord(
                f"a LangGraph record in KVCOMM of serialized type {data[0][:40]!r} cannot be "
                f"read ({type(exc).__name__}: {str(exc)[:200]}); it was not written by "
                "KVCommSaver/KVCommStore (or by another serializer): delete it") from None


def no_pickle(serde: Any | None) -> NoPickleSerializer:
    """The serializer a KVCommSaver or KVCommStore uses: ``serde`` (LangGraph's
    ``JsonPlusSerializer()`` when None), refusing pickles. Raises ConfigError for a
    serializer configured to pickle, one that calls any function a record names when it
    loads it (see the module docstring), or one without ``dumps_typed``/``loads_typed``."""
    if serde is None:  # (strict: see the module docstring)
        serde = JsonPlusSerializer(pickle_fallback=False, allowed_msgpack_modules=None)
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
    if _calls_anything(serde):
        raise ConfigError("", "serde would call any function a record in KVCOMM names when it "
                              "loads it (JsonPlusSerializer's default, allowed_msgpack_modules="
                              "True or allowed_json_modules=True): KVCOMM's data is shared by "
                              "every process of every host; pass JsonPlusSerializer("
                              "allowed_msgpack_modules=[(module, name), ...]) naming your own "
                              "types, or None (LangGraph's safe types only)")
    return NoPickleSerializer(serde)
