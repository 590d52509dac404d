"""Review 18: adversarial checks of the write mark, hints carrying their entry,
interest decay, L2 layout 5 and the getter's miss path.

Run alone with ``.venv/bin/python -m pytest -q tests/test_review18.py``.
"""

from __future__ import annotations

import random
import shutil

import pytest

import kvcomm
from kvcomm.core.versions import MAX_COUNTER

from .conftest import wait_for
from .daemon_harness import Host, cluster_fixture, store_fixture  # noqa: F401 (fixtures)

needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None,
                                 reason="redis-server is not installed")


@needs_redis
@pytest.mark.parametrize("junk", [str(MAX_COUNTER), str(MAX_COUNTER - 5), "9" * 30, "-7",
                                  "abc", "1e9"])
def test_a_junk_write_mark_never_stops_the_hosts_writes(cluster, store, junk: str) -> None:  # type: ignore[no-untyped-def]
    """A write mark in L3 that no daemon of this host could have written (junk, or so
    near MAX_COUNTER that the host could not write past it) must not lift a new L2's
    write sequence to where every write is refused: the daemon starts, the host's
    writes are acknowledged and reach L3."""
    seed = random.randrange(2**32)
    print(f"seed={seed} junk={junk}")
    host = f"wm{seed % 100000}"
    store.rc.set(f"kvn:{{{host}}}:wseq", junk)
    h = Host(cluster, host, seed)
    try:
        wait_for(lambda: h.daemon is not None and h.daemon.started, 30, "the daemon to start")
        assert h.alive, h.error
        assert h.daemon is not None
        # the daemon read the mark (the fault is in place)
        assert store.rc.get(f"kvn:{{{host}}}:wseq") is not None
        key = f"wm/{seed}"
        for i in range(3):
            h.kv.put(key, f"v{i}")
        wait_for(lambda: h.kv._seg.dirty_count == 0, 30, "the writes to reach L3")
        rec = store.get(key)
        assert rec is not None and rec.dot[0] == host
        assert h.kv._seg.write_sequence < MAX_COUNTER // 2, h.kv._seg.write_sequence
        assert h.alive, h.error
    finally:
        h.close()


@pytest.mark.parametrize("how", ["raised", "merged"])
def test_a_write_with_no_dot_left_is_refused_not_acknowledged(kv, how: str) -> None:  # type: ignore[no-untyped-def]
    """A host's write sequence lifted to MAX_COUNTER (raise_write_sequence, or a merged
    version naming this host's dot there: what a junk mark or a hostile record does)
    leaves no dot for the next write: the put is refused (a KVCommError, nothing
    written), never acknowledged with a dot past MAX_COUNTER that L3 refuses."""
    from kvcomm.core.versions import Version

    kv.put("k", "before")
    if how == "raised":
        kv._seg.raise_write_sequence(MAX_COUNTER)
    else:
        kv.merge_remote("other", "x", Version(((kv._host, MAX_COUNTER),), 1 << 40))
    assert kv._seg.write_sequence == MAX_COUNTER  # (the fault is in place)
    with pytest.raises(kvcomm.KVCommError):
        kv.put("k", "after")
    with pytest.raises(kvcomm.KVCommError):
        kv.delete("k")
    kv._l1.clear()
    assert kv.get("k") == "before"
    assert kv._seg.write_sequence == MAX_COUNTER
