"""The servers a test needs (markers ``redis`` and ``etcd``), for tests/conftest.py's
collection hook: a fixture that starts one says so with :func:`starts`, so every test
using it (directly or through another fixture) gets the marker; a test that starts one
itself carries the marker. A marked test is skipped where the server's binary is missing."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import TypeVar

from kvcomm.devcluster.etcd_cluster import etcd_path

F = TypeVar("F", bound=Callable[..., object])

SERVERS = ("redis", "etcd")


def starts(*markers: str) -> Callable[[F], F]:
    """Tag a fixture's function (under ``@pytest.fixture``) with the servers it starts."""
    assert set(markers) <= set(SERVERS), markers

    def tag(fn: F) -> F:
        fn.kvcomm_servers = markers  # type: ignore[attr-defined]
        return fn

    return tag


def started_by(fn: object) -> tuple[str, ...]:
    """The markers :func:`starts` gave ``fn`` (none for other fixtures)."""
    return getattr(fn, "kvcomm_servers", ())


def missing() -> dict[str, str]:
    """Marker -> why its tests are skipped here, for each server whose binary is missing."""
    out = {}
    if shutil.which("redis-server") is None:
        out["redis"] = "redis-server is not installed"
    if etcd_path() is None:
        out["etcd"] = "needs etcd (apt-get install etcd-server)"
    return out
