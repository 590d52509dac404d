"""Resolvers the test cluster's daemons import by name (``cluster.resolvers`` in config)."""

from __future__ import annotations

from typing import Any


def union(key: str, siblings: list[Any]) -> list[str]:
    """Concurrent sets merge into their union: order-independent, so every host agrees."""
    out: set[str] = set()
    for s in siblings:
        out.update(s.value)
    return sorted(out)
