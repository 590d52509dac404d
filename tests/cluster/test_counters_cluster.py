"""kv.incr across hosts, on a real dev cluster (3 hosts behind fault proxies, strong prefix
``task/``: test_partition's, and its heal after each test): increments
from several hosts at once, through a partition and its heal, a delete and a put racing
increments of a cut-off host, a daemon killed and restarted, strong keys.

Every test ends by requiring each host's value to equal the sum of every acknowledged
increment (minus what an acknowledged delete or put removed), read on every host.
"""

from __future__ import annotations

import os
import random
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvcomm
from kvcomm.devcluster import control
from kvcomm.devcluster.procs import running
from tests.cluster import test_partition
from tests.support.helpers import wait_for

# test_partition's dev cluster (module-scoped: one of this module's own) and its heal
dc, whole, _status = test_partition.dc, test_partition.whole, test_partition._status


HOSTS = ("host-1", "host-2", "host-3")


@pytest.fixture
def agents(dc: Path) -> Iterator[dict[str, kvcomm.Client]]:
    """One agent per host, opened with the host's config as a user gets it."""
    out = {h: kvcomm.open(config=dc / f"{h}.yaml") for h in HOSTS}
    yield out
    for kv in out.values():
        kv.close()


def _everywhere(agents: dict[str, kvcomm.Client], key: str, want: int | None,
                timeout: float = 30) -> None:
    """Wait until every host reads ``want`` under ``key``; the failure names each host's."""
    def same() -> bool:
        return all(kv.get(key) == want for kv in agents.values())
    try:
        wait_for(same, timeout, f"every host to read {want} under {key!r}")
    except AssertionError:
        raise AssertionError(f"{key!r}: want {want} on every host, read "
                             f"{ {h: kv.get(key) for h, kv in agents.items()} }") from None


def _cut(dc: Path, host: str) -> None:
    """Cut ``host`` off (Redis and etcd) and wait until its daemon is in partition mode."""
    control.partition(str(dc), host)
    wait_for(lambda: _status(dc, host).get("partition"), 30, f"{host} in partition mode")


def test_increments_from_three_hosts_at_once_sum_exactly(
        agents: dict[str, kvcomm.Client], seed: int) -> None:
    rng = random.Random(seed)
    key, neg = f"c/{seed}/hits", f"c/{seed}/mixed"
    n = int(os.environ.get("KVCOMM_COUNTER_INCRS", "150"))  # per host
    deltas = {h: [rng.randint(-5, 9) for _ in range(n)] for h in HOSTS}
    errors: list[BaseException] = []

    def run(host: str) -> None:
        try:
            kv = agents[host]
            for d in deltas[host]:
                kv.incr(key)
                kv.incr(neg, d)
        except BaseException as exc:  # (the test fails on it below)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(h,)) for h in HOSTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    _everywhere(agents, key, 3 * n)
    _everywhere(agents, neg, sum(sum(d) for d in deltas.values()))


def test_counting_goes_on_through_a_partition_and_is_exact_after_the_heal(
        dc: Path, agents: dict[str, kvcomm.Client], seed: int) -> None:
    key, fresh = f"c/{seed}/part", f"c/{seed}/never-held-by-2"
    a, b, c = (agents[h] for h in HOSTS)
    for kv in (a, b, c):
        kv.incr(key)
    a.incr(fresh, 10)  # host-2 has never held this one: it counts into a new entry
    _everywhere(agents, key, 3)
    _cut(dc, "host-2")
    for i in range(40):
        assert b.incr(key) == 4 + i  # host-2 goes on counting on its own
        a.incr(key)
        c.incr(key, 2)
    assert b.incr(fresh, 5) == 5  # (its view: L3 is out of reach)
    assert b.get(key) == 43  # its own and the 3 from before
    control.heal(str(dc))
    _everywhere(agents, key, 3 + 40 * 4)
    _everywhere(agents, fresh, 15)


def test_a_delete_removes_the_increments_it_saw_and_keeps_concurrent_ones(
        dc: Path, agents: dict[str, kvcomm.Client], seed: int) -> None:
    """Observed-remove: host-1 deletes a counter at 10 while host-2, cut off, counts 3 more
    it never saw; after the heal the key holds those 3 (and host-1's 2 after its delete):
    the 10 never come back. A put racing increments the same way wins over them, and
    over everything before it, also once its value has been incremented."""
    key, put = f"c/{seed}/del", f"c/{seed}/put"
    a, b = agents["host-1"], agents["host-2"]
    a.incr(key, 6)
    b.incr(key, 4)
    b.incr(put, 10)
    _everywhere(agents, key, 10)
    _everywhere(agents, put, 10)
    _cut(dc, "host-2")
    for _ in range(3):
        b.incr(key)
        b.incr(put)
    assert b.get(key) == 13 and b.get(put) == 13
    assert a.delete(key) and a.get(key) is None
    assert a.incr(key, 2) == 2
    a.put(put, 100)
    assert a.incr(put) == 101  # (a new generation: the put's, which host-2 never saw)
    control.heal(str(dc))
    _everywhere(agents, key, 3 + 2)
    _everywhere(agents, put, 101)
    # deleted again, with nothing concurrent: absent everywhere, and counting starts at 0
    assert b.delete(key)
    _everywhere(agents, key, None)
    assert agents["host-3"].incr(key) == 1
    _everywhere(agents, key, 1)


def test_a_conditional_delete_keeps_the_concurrent_increments_a_plain_one_keeps(
        dc: Path, agents: dict[str, kvcomm.Client], seed: int) -> None:
    """delete(key, expect=version) of a counter is a delete of a counter: it removes the
    increments it saw and keeps those it did not (host-2's, counted while cut off), as a
    plain delete does, and the increments counted after it on the deleting host."""
    key = f"c/{seed}/cas-del"
    a, b = agents["host-1"], agents["host-2"]
    a.incr(key, 6)
    b.incr(key, 4)
    _everywhere(agents, key, 10)
    _cut(dc, "host-2")
    for _ in range(3):
        b.incr(key)  # acknowledged on host-2, never seen by host-1's delete
    item = a.get_item(key)
    assert item is not None and item.value == 10
    assert a.delete(key, expect=item.version)
    assert a.get(key) is None
    assert a.incr(key, 2) == 2  # counted after the delete
    control.heal(str(dc))
    _everywhere(agents, key, 3 + 2)


def test_increments_after_a_put_that_reached_l3_alone_survive_a_heal(
        dc: Path, agents: dict[str, kvcomm.Client], seed: int) -> None:
    """host-1 puts 100 over a counter and, once L3 (and host-3) hold the put, increments
    it; host-2, cut off, counted on the old counter meanwhile. The put wins over
    host-2's increments (it never saw them), but host-1's increment came after the put
    (it adopted it: a new generation) and is acknowledged: after the heal every host
    reads 101, whatever order host-2 meets the put and the increment in."""
    key = f"c/{seed}/put-then-incr"
    a, b, c = (agents[h] for h in HOSTS)
    a.incr(key, 10)
    _everywhere(agents, key, 10)
    _cut(dc, "host-2")
    for _ in range(3):
        b.incr(key)
    a.put(key, 100)
    wait_for(lambda: c.get(key) == 100, 20, "the put in L3 (host-3 reads it)")
    assert a.incr(key) == 101
    wait_for(lambda: c.get(key) == 101, 20, "the increment in L3 (host-3 reads it)")
    control.heal(str(dc))
    _everywhere(agents, key, 101)


def test_a_deleted_counter_learned_from_a_refused_claim_keeps_its_state(
        dc: Path, agents: dict[str, kvcomm.Client], seed: int) -> None:
    """host-2 (its daemon down: nothing pulled) makes a conditional put that L3 refuses
    because host-1 deleted the counter; the deleted counter L3 sends back is stored in
    host-2's L2 with its state, so host-2's next increment counts from it (generation 0)
    and host-3's increments made after the delete are not superseded."""
    key = f"c/{seed}/learned-delete"
    h2 = control.load_state(dc)["hosts"][1]
    a, b, c = (agents[h] for h in HOSTS)
    a.incr(key, 10)
    _everywhere(agents, key, 10)
    item = b.get_item(key)
    assert item is not None
    os.kill(int(h2["pid"]), signal.SIGKILL)
    wait_for(lambda: not running(int(h2["pid"])), 30, "host-2's daemon gone")
    # (host-2's agent trusts its dead daemon's last status for STATUS_FRESH_S: one written
    # while a loaded loopback looked like a partition would refuse the put below)
    wait_for(lambda: not (b._host_status().status() or {}).get("partition"), 10,
             "host-2's last status no longer says partition")
    try:
        assert a.delete(key)
        wait_for(lambda: c.get(key) is None, 20, "host-3 reads the delete")
        with pytest.raises(kvcomm.ConflictError):
            b.put(key, "x", expect=item.version)
        assert b.get(key) is None  # (L3's deleted counter, now in host-2's L2)
        assert c.incr(key, 5) == 5
        assert b.incr(key) in (1, 6)
    finally:
        control.restart_daemon(str(dc), 1)
    _everywhere(agents, key, 6)


def test_a_racing_delete_never_brings_back_what_it_saw(
        agents: dict[str, kvcomm.Client], seed: int) -> None:
    """Increments on host-2 and host-3 while host-1 deletes, all connected: whatever the
    delete saw is gone for good; every host ends at the same value, at most the
    increments made after the delete was acknowledged plus those it could not see."""
    key = f"c/{seed}/race"
    a = agents["host-1"]
    a.incr(key, 1_000_000)  # (more than any number of increments below: it shows)
    _everywhere(agents, key, 1_000_000)
    done = threading.Event()
    counts = {"host-2": 0, "host-3": 0}

    def run(host: str) -> None:
        while not done.is_set() and counts[host] < 2000:
            agents[host].incr(key)
            counts[host] += 1

    threads = [threading.Thread(target=run, args=(h,)) for h in counts]
    for t in threads:
        t.start()
    wait_for(lambda: min(counts.values()) >= 20, 30, "increments under way")
    assert a.delete(key)
    wait_for(lambda: min(counts.values()) >= 60, 30, "increments after the delete")
    done.set()
    for t in threads:
        t.join()
    total = sum(counts.values())
    wait_for(lambda: len({kv.get(key) for kv in agents.values()}) == 1, 30, "one value")
    final = a.get(key)
    print(f"{total} increments, the delete at 1,000,000 + some; final value {final}")
    assert final is not None and 0 < final <= total  # the million it saw never came back


def test_increments_waiting_in_l2_survive_a_daemon_kill_and_restart(
        dc: Path, agents: dict[str, kvcomm.Client], seed: int) -> None:
    key = f"c/{seed}/restart"
    state = control.load_state(dc)
    h2 = state["hosts"][1]
    b = agents["host-2"]
    b.incr(key)
    _everywhere(agents, key, 1)
    os.kill(int(h2["pid"]), signal.SIGKILL)
    wait_for(lambda: not running(int(h2["pid"])), 30, "host-2's daemon gone")
    for _ in range(25):
        b.incr(key)  # into host-2's L2: no daemon to push it
        agents["host-1"].incr(key)
    control.restart_daemon(str(dc), 1)
    _everywhere(agents, key, 51)


def test_strong_counters_are_one_etcd_transaction_each(agents: dict[str, kvcomm.Client],
                                                         seed: int) -> None:
    key = f"task/{seed}/n"
    n = 30

    def run(kv: kvcomm.Client) -> None:
        for _ in range(n):
            kv.incr(key)

    threads = [threading.Thread(target=run, args=(kv,)) for kv in agents.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for kv in agents.values():
        assert kv.get(key) == 3 * n
    agents["host-1"].put(f"task/{seed}/s", "x")
    with pytest.raises(kvcomm.InvalidArgument, match="not an int"):
        agents["host-2"].incr(f"task/{seed}/s")


@pytest.mark.slow
def test_many_increments_from_three_hosts_through_four_partitions(
        dc: Path, agents: dict[str, kvcomm.Client], seed: int) -> None:
    rng = random.Random(seed)
    key = f"c/{seed}/long"
    total = 0
    for round_ in range(4):
        cut = HOSTS[round_ % 3]
        _cut(dc, cut)
        for _ in range(1500):
            h = rng.choice(HOSTS)
            d = rng.randint(-3, 7)
            agents[h].incr(key, d)
            total += d
        control.heal(str(dc))
        _everywhere(agents, key, total, 60)
