"""The public API explains itself: every public method of the client (and of its asyncio
face, its batch, its presence handle and the public value types) has a signature that
``inspect.signature`` reads and a docstring of its own, as ``help()`` shows them. ``kv.get``
is the C getter (no Python frame on an L1 hit) and must still read as the method it is."""

from __future__ import annotations

import inspect
import pydoc
from collections.abc import Iterator
from typing import Any

import pytest

import kvcomm
import kvcomm.aio
from kvcomm._l2core import Getter


def _ours(cls: type) -> Iterator[tuple[str, Any]]:
    """The public callables of ``cls`` that KVCOMM defines (a pydantic or NamedTuple base's
    own methods are theirs to document), as the class hands them out."""
    seen = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("kvcomm"):
            continue
        for name in vars(klass):
            if name.startswith("_") or name in seen:
                continue
            seen.add(name)
            attr = inspect.getattr_static(cls, name)
            if isinstance(attr, property):
                continue
            value = getattr(cls, name)
            if callable(value) and not inspect.isclass(value):
                yield name, value


def _public_callables(obj: object) -> Iterator[tuple[str, Any]]:
    """The public callables of a live object, as a caller gets them (instance attributes
    included: ``kv.get`` is the C getter, ``AsyncBatch.put`` the batch's)."""
    for name in dir(obj):
        if name.startswith("_"):
            continue
        value = getattr(obj, name)
        if callable(value) and not inspect.isclass(value):
            yield name, value


def _problems(owner: str, name: str, fn: Any) -> list[str]:
    out = []
    try:
        inspect.signature(fn)
    except (TypeError, ValueError) as e:
        out.append(f"{owner}.{name}: inspect.signature fails: {e}")
    doc = inspect.getdoc(fn)
    if not doc or not doc.strip():
        out.append(f"{owner}.{name}: no docstring")
    elif doc == inspect.getdoc(type(fn)):  # (a callable object's: the C getter's, say)
        out.append(f"{owner}.{name}: the docstring is its type's ({doc[:60]!r})")
    return out


def _public_classes() -> list[type]:
    classes = []
    for module in (kvcomm, kvcomm.aio):
        for name in module.__all__:
            value = getattr(module, name)
            if inspect.isclass(value) and not issubclass(value, BaseException):
                classes.append(value)
    return classes


def test_every_public_class_method_has_a_signature_and_a_docstring() -> None:
    classes = _public_classes()
    assert kvcomm.Client in classes and kvcomm.aio.AsyncClient in classes
    problems = [p for cls in classes for name, fn in _ours(cls)
                for p in _problems(cls.__name__, name, fn)]
    for module in (kvcomm, kvcomm.aio):
        problems += _problems(module.__name__, "open", module.open)
    assert not problems, "\n".join(problems)


def test_a_live_clients_methods_explain_themselves(kv: kvcomm.Client) -> None:
    """What a caller holds: the open client (its ``get`` the C getter), a batch (``delete``
    is the C kernel's), the asyncio face over it and its batch."""
    akv = kvcomm.aio.AsyncClient(kv)
    batch = kv.batch()
    objects = {"kv": kv, "batch": batch, "akv": akv,
               "abatch": kvcomm.aio.AsyncBatch(akv, batch)}
    problems = [p for owner, obj in objects.items() for name, fn in _public_callables(obj)
                for p in _problems(owner, name, fn)]
    assert not problems, "\n".join(problems)
    assert {"get", "put", "delete", "scan", "watch", "batch"} <= {
        n for n, _ in _public_callables(kv)}


def test_kv_get_reads_as_the_method_it_stands_in_for(kv: kvcomm.Client) -> None:
    assert type(kv.get) is Getter  # still the C getter: no Python frame on an L1 hit
    assert str(inspect.signature(kv.get)) == str(inspect.signature(kvcomm.Client.get.__get__(kv)))
    assert list(inspect.signature(kv.get).parameters) == ["key", "default"]
    assert kv.get.__doc__ == kvcomm.Client.get.__doc__
    assert (kv.get.__name__, kv.get.__qualname__) == ("get", "Reads.get")
    text = pydoc.render_doc(kv.get, renderer=pydoc.plaintext)
    assert "get(key" in text and "Getter(" not in text, text
    assert type(kv.get).__doc__ is not None and type(kv.get).__doc__.startswith("kv.get: Getter(")
    kv.put("k", 1)
    assert kv.get("k") == 1 and kv.get("absent", 2) == 2 and kv.get("absent", default=3) == 3


def test_a_closed_clients_get_is_the_python_method(kv: kvcomm.Client) -> None:
    kv.close()
    assert inspect.ismethod(kv.get) and inspect.getdoc(kv.get) == inspect.getdoc(kvcomm.Client.get)


@pytest.mark.parametrize("attr", ["__doc__", "__name__", "__qualname__"])
def test_a_getter_without_a_method_reads_as_its_type(kv: kvcomm.Client, attr: str) -> None:
    """A getter nobody pointed at a method (``del g.__wrapped__``) falls back to its type's
    documentation and name, and says it has no ``__wrapped__``."""
    g = kv.get
    wrapped = g.__wrapped__
    try:
        del g.__wrapped__
        assert not hasattr(g, "__wrapped__")
        assert getattr(g, attr) == ("Getter" if attr != "__doc__" else type(g).__doc__)
    finally:
        g.__wrapped__ = wrapped
