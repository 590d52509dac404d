"""kv.incr: the counter state's merge (pure, property tests), exact counting among a host's
processes, and the value and error rules. Across hosts: tests/cluster/test_counters_cluster.py."""

from __future__ import annotations

import multiprocessing as mp

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvcomm
from kvcomm.core import codec, counter

# ---------------------------------------------------------------- the pure state

_actor = st.sampled_from(["h1~1", "h1~2", "h2~5", "h3~9", "=ab12"])


@st.composite
def states(draw: st.DrawFn) -> counter.State:
    out: counter.State = {}
    for a in draw(st.lists(_actor, max_size=5, unique=True)):
        p, n = draw(st.integers(0, 10**6)), draw(st.integers(0, 10**6))
        out[a] = [p, n, draw(st.integers(0, p)), draw(st.integers(0, n))]
    if draw(st.booleans()):  # a generation: a put this counter adopted
        out[counter.GEN] = [draw(st.integers(0, 2)), draw(st.integers(0, 2)), 7, 0]
    return out


@given(states(), states())
def test_merge_is_commutative(a: counter.State, b: counter.State) -> None:
    assert counter.merge(a, b) == counter.merge(b, a)


@given(states(), states(), states())
def test_merge_is_associative(a: counter.State, b: counter.State, c: counter.State) -> None:
    assert counter.merge(counter.merge(a, b), c) == counter.merge(a, counter.merge(b, c))


@given(states(), states())
def test_merge_is_idempotent(a: counter.State, b: counter.State) -> None:
    ab = counter.merge(a, b)
    assert counter.merge(a, a) == a
    assert counter.merge(ab, b) == ab and counter.merge(ab, a) == ab


@given(states())
def test_state_round_trips_through_the_codec(a: counter.State) -> None:
    assert counter.decode(counter.encode(a)) == a
    assert codec.decode(codec.COUNTER, b"", counter.encode(a)) == counter.value(a)


@given(states(), st.lists(st.tuples(st.sampled_from(["h1", "h2", "h3"]),
                                    st.integers(-1000, 1000)), max_size=30))
def test_increments_on_separate_replicas_sum_exactly(base: counter.State,
                                                     incs: list[tuple[str, int]]) -> None:
    """Each host counts into its own replica of ``base``; merged in any grouping, the value
    is the base's plus every increment, once."""
    replicas = {h: dict(base) for h in ("h1", "h2", "h3")}
    for host, d in incs:
        actor = counter.own_actor(replicas[host], host) or counter.new_actor(host, 77)
        replicas[host] = counter.add(replicas[host], actor, d)
    merged = counter.merge(counter.merge(replicas["h1"], replicas["h2"]), replicas["h3"])
    assert counter.value(merged) == counter.value(base) + sum(d for _, d in incs)


@given(states(), st.integers(-50, 50), st.integers(-50, 50))
def test_reset_removes_what_it_saw_and_keeps_what_it_did_not(
        a: counter.State, seen: int, unseen: int) -> None:
    """Observed-remove: a delete (reset) of a state that saw ``seen`` merged with a
    concurrent replica that counted ``unseen`` more: only ``unseen`` is left."""
    a = counter.add(a, "h1~1", seen)
    deleted = counter.reset(a)
    assert counter.value(deleted) == 0 and not counter.live(deleted)
    other = counter.add(a, "h2~5", unseen)  # made concurrently on another host
    assert counter.value(counter.merge(deleted, other)) == unseen
    assert counter.value(counter.merge(other, deleted)) == unseen


def test_a_counter_that_adopted_a_put_wins_over_counters_that_never_saw_it() -> None:
    """Increments concurrent with a put (made where the put had not arrived) never bring
    back what the put replaced, even once the put's value has been incremented."""
    before = counter.add({}, "h2~1", 10)  # the counter the put replaced
    cut_off = counter.add(before, "h2~1", 3)  # host-2 counts on, never sees the put
    adopted = counter.add(counter.adopt(100, (("h1", 7),), 5 << 16), "h1~9", 1)
    assert counter.value(adopted) == 101
    assert counter.merge(adopted, cut_off) == counter.merge(cut_off, adopted) == adopted
    # a delete of the adopted counter keeps its generation: it beats the old one too
    assert counter.value(counter.merge(counter.reset(adopted), cut_off)) == 0
    # two hosts adopting the same put count it once
    other = counter.add(counter.adopt(100, (("h1", 7),), 5 << 16), "h3~2", 5)
    assert counter.value(counter.merge(adopted, other)) == 106


def test_malformed_states_are_refused() -> None:
    for bad in (b"\x01", b"\x81\xa1a\x93\x01\x02\x03", b"\x81\xa1a\x94\x01\x00\x02\x00",
                b"not msgpack \xc1"):
        with pytest.raises(ValueError):
            counter.decode(bad)
    assert counter.decode(b"\x90") == {}  # (Lua's cmsgpack writes an empty map so)


# ---------------------------------------------------------------- one host


def test_incr_counts_returns_the_value_and_get_reads_the_int(kv: kvcomm.Client) -> None:
    assert kv.incr("c") == 1
    assert kv.incr("c", 41) == 42
    assert kv.incr("c", -50) == -8
    assert kv.get("c") == -8 and type(kv.get("c")) is int
    assert kv.get_item("c").value == -8  # type: ignore[union-attr]
    assert kv.incr("zero", 0) == 0 and kv.get("zero") == 0  # (0 creates the counter)


def test_incr_adopts_a_plain_int_and_refuses_anything_else(kv: kvcomm.Client) -> None:
    kv.put("n", 10)
    assert kv.incr("n", 5) == 15 and kv.get("n") == 15
    for v in ("10", 1.5, b"x", [1], True, None):
        kv.put("x", v)
        with pytest.raises(kvcomm.InvalidArgument, match="not an int"):
            kv.incr("x")
        assert kv.get("x") == v  # unchanged
    for d in (1.0, "1", None, True, 2**53):
        with pytest.raises(kvcomm.InvalidArgument, match="delta"):
            kv.incr("n", d)  # type: ignore[arg-type]
    assert kv.get("n") == 15


def test_put_and_delete_reset_a_counter(kv: kvcomm.Client) -> None:
    kv.incr("c", 7)
    kv.put("c", 100)
    assert kv.incr("c") == 101
    assert kv.delete("c") and kv.get("c") is None
    assert kv.incr("c", 2) == 2  # counts from 0 after a delete
    kv.put("c", 0, ttl=0.05)
    assert kv.incr("c") == 1


def test_incr_keeps_the_deadline_and_counts_from_zero_once_it_passed(kv: kvcomm.Client) -> None:
    kv.put("t", 5, ttl=30)
    assert kv.incr("t") == 6
    item = kv.get_item("t")
    assert item is not None and item.expires_at is not None  # kept
    kv.put("e", 5, ttl=0.01)
    from tests.support.helpers import wait_for
    wait_for(lambda: kv.get("e") is None, 5, "the deadline to pass")
    assert kv.incr("e") == 1


def _count(ns: str, n: int) -> None:
    from tests.support.helpers import SMALL

    with kvcomm.open(ns, config=kvcomm.Config.from_mapping(SMALL)) as kv:
        for _ in range(n):
            kv.incr("shared")
            kv.incr("down", -1)


def test_increments_from_several_processes_sum_exactly(ns: str, kv: kvcomm.Client) -> None:
    procs, n = 3, 400
    ctx = mp.get_context("fork")  # (each child opens its own client)
    ps = [ctx.Process(target=_count, args=(ns, n)) for _ in range(procs)]
    for p in ps:
        p.start()
    for _ in range(n):
        kv.incr("shared")
    for p in ps:
        p.join(120)
        assert p.exitcode == 0
    assert kv.get("shared") == (procs + 1) * n
    assert kv.get("down") == -procs * n


def test_counting_after_a_plain_delete_starts_a_generation_of_its_own() -> None:
    """A plain tombstone (a batch's delete, say) won over the counters it did not see: an
    increment after it counts in a generation named after it, which wins whole over those
    counters when they arrive, so what the delete removed never comes back."""
    from kvcomm._client import counters
    from kvcomm.core.versions import Version
    from kvcomm.tiers.l2 import TAG_TOMBSTONE, Record

    tomb = Record(0, 0, TAG_TOMBSTONE, b"", b"", 9, 5 << 16, b"", 0, 0.0)
    state, deadline = counters.start_of("k", tomb, Version((("h1", 9),), 5 << 16), 0.0)
    after = counters.add("k", state, "h1", 10, 2)
    concurrent = counter.add({}, "h2~1", 10)  # counted before the delete, elsewhere
    assert counter.value(counter.merge(after, concurrent)) == 2 and deadline is None
