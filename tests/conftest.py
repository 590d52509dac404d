"""Shared fixtures: every test gets its own L2 namespace, purged afterwards."""

from __future__ import annotations

import os
import random
import uuid
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
from hypothesis import settings

import kvcomm
from kvcomm._wait import wait_until
from kvcomm.tiers import l2

from .daemon_harness import SharedRedisCluster

T = TypeVar("T")

# CI machines are shared and noisy: no per-example deadline; a failure prints the blob
# that replays it exactly (@reproduce_failure), as randomised tests here print their seed
settings.register_profile("kvcomm", deadline=None, print_blob=True)
settings.load_profile("kvcomm")

SMALL = {"cache": {"l2_size": "16MB", "watch_buffer": 4096}}


@pytest.fixture
def seed() -> int:
    """A random seed for a randomised test, printed (pytest shows it when the test fails);
    ``KVCOMM_TEST_SEED=N`` runs it again with seed N."""
    s = int(os.environ["KVCOMM_TEST_SEED"]) if os.environ.get("KVCOMM_TEST_SEED") \
        else random.randrange(2**32)
    print(f"seed={s}")
    return s


@pytest.fixture
def ns() -> Iterator[str]:
    name = f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    l2.purge(name)


@pytest.fixture
def config() -> kvcomm.Config:
    return kvcomm.Config.from_mapping(SMALL)


@pytest.fixture
def kv(ns: str, config: kvcomm.Config) -> Iterator[kvcomm.Client]:
    client = kvcomm.open(ns, config=config)
    yield client
    client.close()


@pytest.fixture(scope="session")
def shared_redis_cluster() -> Iterator[SharedRedisCluster]:
    """The Redis Cluster that modules taking ``daemon_harness.shared_cluster_fixture``
    share (started on first use, stopped at the session's end)."""
    shared = SharedRedisCluster()
    try:
        yield shared
    finally:
        shared.stop()


def wait_for(cond: Callable[[], T], timeout: float = 10.0, what: str = "condition", *,
             retry_on: tuple[type[BaseException], ...] = ()) -> T:
    """:func:`kvcomm._wait.wait_until` for tests: polls ``cond`` (every 2 ms) until it
    returns a true value, which it returns; fails the test (AssertionError) after
    ``timeout`` seconds. No sleeping-and-hoping."""
    return wait_until(cond, timeout, what, interval=0.002, retry_on=retry_on, error=AssertionError)


def mount_tmpfs(tmp_path: os.PathLike[str], size: str) -> Iterator[str]:
    """A tmpfs of ``size`` (``6m``) at ``tmp_path/shm``, unmounted afterwards (the test is
    skipped where mount is not allowed): a small /dev/shm stand-in, for cache.l2_dir."""
    import pathlib
    import subprocess

    d = pathlib.Path(tmp_path) / "shm"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)],
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode()[:200]}")
    yield str(d)
    subprocess.run(["umount", "-l", str(d)], check=False)
