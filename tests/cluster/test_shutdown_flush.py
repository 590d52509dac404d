"""``cluster.shutdown_flush_timeout``: how long a stopped node daemon may spend sending its
backlog to L3. The daemon runs over the in-memory fakes with a scripted clock, so the
bound is checked in the clock's seconds, not the machine's."""

from __future__ import annotations

import random
import threading

import pytest

import kvcomm
from kvcomm.node.daemon import Daemon
from tests.sim.test_delivery_sim import Clock
from tests.support.delivery_fakes import GROUPS, FakeKeys, FakeL2, FakeL3


def _config(**cluster: object) -> kvcomm.Config:
    return kvcomm.Config.from_mapping({
        "node": {"host_id": "h1", "namespace": "flush-h1"},
        "cache": {"l2_sync_interval": "10ms", "max_batch_ops": 4},
        "cluster": {"redis": ["127.0.0.1:1"], "feed_poll": "10ms", "groups": GROUPS,
                    **cluster},
    })


def _daemon(cfg: kvcomm.Config) -> tuple[Daemon, FakeL2, FakeL3, Clock]:
    clock = Clock()
    l3 = FakeL3(random.Random(1))
    l2 = FakeL2("h1", clock=clock)
    d = Daemon(cfg, l2, l3.view(), FakeKeys(), rng=random.Random(2),  # type: ignore[arg-type]
               clock=clock, sleep=clock.sleep, wall=clock)
    return d, l2, l3, clock


def test_the_key_parses_defaults_and_is_validated() -> None:
    assert kvcomm.Config().cluster.shutdown_flush_timeout == 5.0
    assert _config(shutdown_flush_timeout="250ms").cluster.shutdown_flush_timeout == 0.25
    assert _config(shutdown_flush_timeout=0).cluster.shutdown_flush_timeout == 0.0
    for bad, why in ((-1, "cannot be negative"), (7200, "at most 60m"),
                     ("soon", "")):
        with pytest.raises(kvcomm.ConfigError, match="cluster.shutdown_flush_timeout") as e:
            _config(shutdown_flush_timeout=bad)
        assert why in str(e.value)


@pytest.mark.parametrize("timeout", [0.0, 1.5, 30.0])
def test_a_stopped_daemon_gives_up_flushing_after_the_configured_timeout(timeout: float) -> None:
    d, l2, l3, clock = _daemon(_config(shutdown_flush_timeout=timeout))
    for i in range(6):
        l2.put(f"k/{i}", b"v%d" % i)
    l3.cut = True  # nothing can be sent: the flush waits out its bound, then stops
    stop = threading.Event()
    stop.set()
    t0 = clock()
    d.run(stop)  # stopped at once: only the flush runs
    report = d.last_flush
    assert report is not None and report["sent"] == 0, report
    assert sum(r.dirty for r in l2.recs.values()) == 6  # still waiting, in L2
    assert timeout <= clock() - t0 < timeout + 2.5, (clock() - t0, report)  # (its backoff)
    # it did try (a push starts by recording the host's write mark: the first call made)
    assert l3.calls.get("push_many", 0) + l3.calls.get("save_write_mark", 0) >= 1


def test_with_l3_reachable_the_flush_sends_everything_even_with_timeout_zero() -> None:
    d, l2, l3, _ = _daemon(_config(shutdown_flush_timeout=0))
    for i in range(3):
        l2.put(f"k/{i}", b"v")
    stop = threading.Event()
    stop.set()
    d.run(stop)
    assert d.last_flush is not None and d.last_flush["sent"] == 3, d.last_flush
    assert not any(r.dirty for r in l2.recs.values())
    assert d.last_flush["seconds"] == 0.0 and set(l3.records) == {"k/0", "k/1", "k/2"}
