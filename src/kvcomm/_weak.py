"""A set of weakly held objects whose members leave without running Python code."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class WeakRegistry(Generic[T]):
    """What ``weakref.WeakSet`` does, for the process's registries (clients, segments,
    meters), but Ctrl-C safe.

    A WeakSet's callback is a Python function: when a member goes, the pending SIGINT
    handler can run inside it, and Python drops any exception raised in a weakref callback
    ("Exception ignored in ..."), a KeyboardInterrupt included: the Ctrl-C is lost and the
    program runs on. Here the callback is the set's own ``discard``, a C builtin that runs
    no bytecode, so the KeyboardInterrupt is raised at the caller's next bytecode instead.
    Members are compared by identity (their classes define no ``__eq__``).
    """

    __slots__ = ("_refs",)

    def __init__(self) -> None:
        self._refs: set[weakref.ref[T]] = set()

    def add(self, obj: T) -> None:
        self._refs.add(weakref.ref(obj, self._refs.discard))

    def discard(self, obj: T) -> None:
        self._refs.discard(weakref.ref(obj))  # (equal to the member's ref while obj lives)

    def __iter__(self) -> Iterator[T]:
        return iter([o for r in list(self._refs) if (o := r()) is not None])

    def __len__(self) -> int:
        return sum(1 for r in list(self._refs) if r() is not None)
