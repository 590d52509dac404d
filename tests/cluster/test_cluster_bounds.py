"""Every bound of a host, crossed in cluster mode on a real dev cluster: nothing acknowledged
is lost. (L2 full, change-feed ring full, outbound bound, pin table full, watch buffer full;
a trimmed L3 stream is in test_cluster.py.)"""

from __future__ import annotations

import gc
import os
import signal
from typing import Any

import numpy as np

import kvcomm
from tests.support.devcluster import dev_cluster_fixture, host, l3, stop_daemon
from tests.support.helpers import wait_for

dev = dev_cluster_fixture(2, dirname="devcluster-bounds")


def test_l2_evictions_never_delete_in_l3(dev: dict[str, Any]) -> None:
    """Item 1: writing more than host 1's L2 holds evicts clean entries there; the keys
    stay in L3 and on every other host, and host 1 reads them back from L3."""
    a, b = host(dev, 0), host(dev, 1)
    store = l3(dev)
    value = b"e" * (48 << 10)
    n = (a._seg.layout.data_size // len(value)) * 3 // 2  # 1.5x what L2 can hold
    try:
        evictions = a._seg.info()["evictions"]
        for i in range(n):  # L2 full of writes not yet in L3: Unavailable, retry (nothing lost)
            wait_for(lambda i=i: a.put(f"evict/{i}", value) or True, 30,
                     "the daemon to drain L2", retry_on=(kvcomm.Unavailable,))
        assert a._seg.info()["evictions"] > evictions  # the fault happened
        wait_for(lambda: all(store.get(f"evict/{i}") is not None for i in range(n)), 60,
                 "every key to be in L3")
        assert all(not store.get(f"evict/{i}").tombstone for i in range(n))  # type: ignore[union-attr]
        # (host 2 never read them: its agent answers "absent" from the key filter until
        # its daemon has read each key's feed entry, which follows the key's arrival in
        # L3, by a poll: the last window's keys may not be there yet)
        wait_for(lambda: all(b.get(f"evict/{i}") == value for i in range(0, n, 7)), 30,
                 "host 2 to read every key")
        assert all(a.get(f"evict/{i}") == value for i in range(0, n, 7))  # via L3
    finally:
        store.close()
        a.close(), b.close()


def test_a_delete_survives_a_feed_overflow_while_the_daemon_is_paused(dev: dict[str, Any]) -> None:
    """Item 3: the delete lived only as a feed event; the ring overflowed before the paused
    daemon read it, its rescan found only dirty puts, and the key came back from L3."""
    a, b = host(dev, 0), host(dev, 1)
    store = l3(dev)
    pid = dev["hosts"][0]["pid"]
    try:
        a.put("ovf/k", "v")
        wait_for(lambda: store.get("ovf/k") is not None, 10, "the put to reach L3")
        wait_for(lambda: b.get("ovf/k") == "v", 10, "host 2 to hold it")
        stop_daemon(pid, a)
        try:
            assert a.delete("ovf/k") is True
            head = a._seg.feed_head()
            for i in range(a._seg.layout.feed_n + 100):  # overflow the ring past the delete
                a.put("ovf/churn", i)
            assert a._seg.feed_head() - head > a._seg.layout.feed_n
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: (r := store.get("ovf/k")) is not None and r.tombstone, 20,
                 "the delete to reach L3")
        wait_for(lambda: b.get("ovf/k") is None, 20, "the delete to reach host 2")
        assert a.get("ovf/k") is None
        wait_for(lambda: a._seg.dirty_count == 0, 20, "host 1 to have nothing waiting")
    finally:
        store.close()
        a.close(), b.close()


def test_pin_table_full_in_cluster_mode(dev: dict[str, Any]) -> None:
    """More zero-copy views than cache.max_views: the rest are read-only copies, writes go
    on, every one reaches L3 and the other host, and the views never change."""
    a, b = host(dev, 0), host(dev, 1)
    store = l3(dev)
    try:
        n = a._seg.layout.n_pins + 50
        arrays = [np.full(1024, i, dtype=np.float64) for i in range(n)]  # 8 KiB each
        for i, arr in enumerate(arrays):
            a.put(f"pins/{i}", arr)
        views = [a.get(f"pins/{i}") for i in range(n)]
        assert a.stats()["l2"]["views_taken"] >= a._seg.layout.n_pins  # the table filled up
        assert all(not v.flags.writeable for v in views)
        for i in range(n):  # overwrite every one while the views are held
            a.put(f"pins/{i}", arrays[i] + 1000)
        assert all(np.array_equal(v, arr) for v, arr in zip(views, arrays, strict=True))
        wait_for(lambda: all(np.array_equal(b.get(f"pins/{i}"), arrays[i] + 1000)
                             for i in range(0, n, 17)), 30, "host 2 to read the overwrites")
        wait_for(lambda: a._seg.dirty_count == 0, 30, "every write to be in L3")
        del views
        gc.collect()
        a.put("pins/after", 1)  # the next writer sweeps the released pins
        assert a._seg.info()["pinned_deferred_blocks"] == 0
        assert a._seg.check() == []
    finally:
        store.close()
        a.close(), b.close()


def test_watch_buffer_full_in_cluster_mode(dev: dict[str, Any]) -> None:
    """A watcher on host 2 stalls while host 2's agents write more events than its feed
    ring holds (and host 1 writes keys host 2 holds): the watcher gets one overflow; both
    hosts converge to every final value (nothing lost to the full ring, the daemon's own
    cursor included)."""
    a, b = host(dev, 0), host(dev, 1)
    try:
        for i in range(20):
            a.put(f"wb/a/{i}", -1)
        wait_for(lambda: all(b.get(f"wb/a/{i}") == -1 for i in range(20)), 20, "host 2 to hold them")
        w = b.watch("wb/", timeout=1.0)
        head = b._seg.feed_head()
        rounds = b._seg.layout.feed_n // 20 + 20
        for r in range(rounds):
            for i in range(20):
                b.put(f"wb/b/{i}", r)
            if r % 50 == 0:
                a.put(f"wb/a/{r % 20}", r)
        for i in range(20):
            a.put(f"wb/a/{i}", "final")
        assert b._seg.feed_head() - head > b._seg.layout.feed_n  # the ring was overrun...
        assert next(w).kind == "overflow"  # ...and the stalled watcher was told
        wait_for(lambda: all(b.get(f"wb/a/{i}") == "final" for i in range(20)), 60,
                 "host 2 to converge")
        wait_for(lambda: all(a.get(f"wb/b/{i}") == rounds - 1 for i in range(20)), 60,
                 "host 1 to converge")
    finally:
        a.close(), b.close()
