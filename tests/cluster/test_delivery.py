"""The delivery state machines (kvcomm.node.delivery) driven directly: no driver, no I/O.

Each test is a script of events — feed reads, L3's answers, failures, feed entries —
and checks what the machines decide: what is pushed, what each answer means, which
cursor may be persisted, when a group resyncs, how vectors are pruned.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcomm.core.backoff import Backoff
from kvcomm.core.resolve import CONFLICT, EQUAL, MERGED, NEW, NEWER, OLDER, l3_rule
from kvcomm.core.versions import Dotted, Ordering, compare_vectors, covers, merge_vectors, with_dot
from kvcomm.core.window import WriteWindow
from kvcomm.errors import CorruptRecord
from kvcomm.node.delivery import (
    CORRUPT,
    FEED_COUNT,
    GAP,
    NOT_DURABLE,
    REWIND,
    TAIL_EVERY,
    UNREACHED,
    UNSEQUENCED,
    HostActivity,
    Inbound,
    Outbound,
    Poll,
    Skipped,
)
from kvcomm.tiers.l3 import FeedEntry, L3Record, PushResult, Unreached
from tests.support.helpers import drawn_seed


def rec(actor: str, counter: int, hlc: int = 0, vector: dict[str, int] | None = None,
        tomb: bool = False, value: bytes = b"v") -> L3Record:
    vec = dict(vector or {})
    vec[actor] = counter
    return L3Record(hlc or counter, tomb, 1, b"", b"" if tomb else value,
                    tuple(sorted(vec.items())), (actor, counter))


def outbound(cursor: int = 0, interval: float = 0.01, max_ops: int = 1000,
             seed: int = 0) -> Outbound:
    return Outbound("h", cursor, WriteWindow(interval, max_ops),
                    Backoff(random.Random(seed), base=0.05, cap=2.0, floor=0.01))


WSEQ = 1000  # the host's write sequence: past every dot these tests write


def no_resolver(key: str) -> bool:
    return False


def ok(record: L3Record, outcome: str = NEW, key: str = "k", durable: bool = True) -> PushResult:
    return PushResult(key, outcome, record, durable)


# ---------------------------------------------------------------- outbound


def test_a_window_is_pushed_once_closed_and_accepted_writes_are_delivered() -> None:
    out = outbound()
    a, b = rec("h", 1), rec("h", 2)
    out.read(5, [("a", a), ("b", b), ("gone", None)], now=0.0)
    assert out.next_push(0.005, no_resolver) is None  # the window is still open
    assert out.delivered() == 0  # a and b are staged: nothing before 5 may be skipped
    push = out.next_push(0.01, no_resolver)
    assert push is not None and [(i.key, i.record) for i in push.items] == [("a", a), ("b", b)]
    assert out.next_push(0.02, no_resolver) is None  # one push in flight at a time
    answers = out.pushed(push, [ok(a, NEW, "a"), ok(b, NEWER, "b")], 0.02, WSEQ)
    assert [(x.key, x.deliver, x.take, x.set_aside) for x in answers] == [
        ("a", True, None, ""), ("b", True, None, "")]
    assert not out.staged and out.delivered() == 5


def test_a_repush_goes_out_in_the_windows_and_an_older_or_equal_answer_ends_it() -> None:
    """A record L3 lost (Puller.resync) is staged like a write: pushed in a window (in
    batches of max_ops); a key with a staged write keeps that write; an ``older``
    answer (a later delete covers it) takes L3's record, an ``equal`` one (another host
    re-pushed it first) nothing; neither stages it again."""
    out = outbound(cursor=7, max_ops=2)
    newer = rec("h", 9)
    out.read(7, [("staged", newer)], now=0.0)
    x, y, z = rec("h", 3), rec("h", 4), rec("h", 5)  # (z: another host's re-push was first)
    assert not out.repush("staged", rec("h", 2), 0.0)  # (its staged write descends from it)
    assert out.repush("x", x, 0.0) and out.repush("y", y, 0.0) and out.repush("z", z, 0.0)
    assert out.delivered() == 7  # (nothing of L2's feed waits on a re-push)
    first = out.next_push(0.0, no_resolver)
    assert first is not None and [i.key for i in first.items] == ["staged", "x"]
    out.pushed(first, [ok(newer, NEW, "staged"), ok(x, NEWER, "x")], 0.0, WSEQ)
    second = out.next_push(0.0, no_resolver)
    assert second is not None and [i.key for i in second.items] == ["y", "z"]
    tomb = rec("b", 1, vector={"h": 4}, tomb=True)
    answers = out.pushed(second, [ok(tomb, OLDER, "y"), ok(z, EQUAL, "z")], 0.0, WSEQ)
    assert [(a.outcome, a.take) for a in answers] == [(OLDER, tomb), (EQUAL, None)]
    assert not out.staged and out.next_push(1.0, no_resolver) is None
    assert out.delivered() == 7


def test_windows_waiting_together_go_out_in_one_push_each_key_once() -> None:
    """A backlog (windows closed while L3 was away) is sent MERGE windows per push: the
    keys of the first ``merge`` waiting windows, each once with its latest record; the
    answer takes those windows off the queue; the rest follow in the next push."""
    out = Outbound("h", 0, WriteWindow(10.0, 2), Backoff(random.Random(0), base=0.05,
                                                        cap=2.0, floor=0.01), merge=3)
    recs = {f"k{i}": rec("h", i + 1) for i in range(8)}
    # windows of 2 writes: [k0 k1] [k2 k1'] [k3 k4] [k5 k6] and k7 still open
    k1b = rec("h", 20)
    out.read(1, [("k0", recs["k0"]), ("k1", recs["k1"])], now=0.0)
    out.read(2, [("k2", recs["k2"]), ("k1", k1b)], now=0.0)
    out.read(3, [("k3", recs["k3"]), ("k4", recs["k4"]), ("k5", recs["k5"]),
                 ("k6", recs["k6"]), ("k7", recs["k7"])], now=0.0)
    assert len(out.unsent) == 4
    push = out.next_push(0.0, no_resolver)
    assert push is not None and len(push.more) == 2
    assert [(i.key, i.record) for i in push.items] == [
        ("k0", recs["k0"]), ("k1", k1b), ("k2", recs["k2"]), ("k3", recs["k3"]),
        ("k4", recs["k4"])]  # k1 once, with its latest write
    out.pushed(push, [ok(i.record, NEW, i.key) for i in push.items], 0.0, WSEQ)
    assert len(out.unsent) == 1 and set(out.staged) == {"k5", "k6", "k7"}
    nxt = out.next_push(0.0, no_resolver)
    assert nxt is not None and nxt.more == () and [i.key for i in nxt.items] == ["k5", "k6"]
    failed = out.push_failed(nxt, 0.0)  # a failed merged push leaves every window queued
    assert failed > 0 and len(out.unsent) == 1


@pytest.mark.parametrize("outcome, held_is, deliver, take", [
    (NEW, "sent", True, False),
    (NEWER, "sent", True, False),
    (EQUAL, "sent", True, False),
    (OLDER, "newer", True, True),  # L3 holds a write that saw this one
    (MERGED, "merged", True, True),  # L3 holds the merge: this write and a concurrent one
    (MERGED, "merged-won", True, True),  # this write won, the vector grew: L2 learns it
    (CONFLICT, "concurrent", False, True),  # a resolver's key: L2 settles it
])
def test_each_answer_means_what_the_table_says(outcome: str, held_is: str, deliver: bool,
                                              take: bool) -> None:
    sent = rec("h", 3, hlc=30, vector={"o": 1})
    held = {
        "sent": sent,
        "newer": rec("o", 2, hlc=40, vector={"h": 3}),
        "merged": rec("o", 2, hlc=40, vector={"h": 3}),
        "merged-won": sent._replace(vector=(("h", 3), ("o", 2))),
        "concurrent": rec("o", 2, hlc=40),
    }[held_is]
    out = outbound()
    out.read(1, [("k", sent)], 0.0)
    push = out.next_push(1.0, no_resolver)
    assert push is not None
    (answer,) = out.pushed(push, [ok(held, outcome)], 1.0, WSEQ)
    assert answer.outcome == outcome and answer.sent is sent
    assert answer.deliver is deliver and (answer.take is held) is take and not answer.set_aside
    assert not out.staged  # answered: out of the staged set either way


@pytest.mark.parametrize("outcome", [OLDER, MERGED])
def test_a_write_covered_only_by_dots_of_a_lost_l2_is_rebased_not_delivered(outcome: str) -> None:
    """The host's L2 was lost and its write sequence restarted: L3 holds dots of this
    host past it (an earlier life's). A new write is not older than those: rebase it."""
    sent = rec("h", 3, hlc=30)
    earlier_life = rec("h", 200, hlc=20)  # covers ("h", 3), but names another write
    out = outbound()
    out.read(1, [("k", sent)], 0.0)
    push = out.next_push(1.0, no_resolver)
    assert push is not None
    (answer,) = out.pushed(push, [ok(earlier_life, outcome)], 1.0, write_sequence=3)
    assert answer.rebase and not answer.deliver and answer.take is earlier_life
    out.read(2, [("k", sent)], 1.5)  # the same, with a sequence past 200: an honest answer
    push = out.next_push(2.0, no_resolver)
    assert push is not None
    (answer,) = out.pushed(push, [ok(earlier_life, OLDER)], 2.0, write_sequence=250)
    assert not answer.rebase and answer.deliver and answer.take is earlier_life


def test_a_skipped_remote_change_is_kept_a_while_for_a_late_fill() -> None:
    skipped = Skipped(keep_s=30.0, limit=8)
    r = rec("o", 1)
    skipped.remember("k", r, now=0.0)
    assert skipped.take("other", 1.0) is None
    assert skipped.take("k", 29.0) is r and skipped.take("k", 29.0) is None  # once
    skipped.remember("k", r, now=0.0)
    assert skipped.take("k", 30.0) is None  # too old: the fill is newer than it
    for i in range(9):
        skipped.remember(f"k{i}", r, now=float(i))
    assert skipped.take("k0", 9.0) is None and skipped.take("k8", 9.0) is r  # bounded


def test_a_write_no_replica_has_is_sent_again_and_holds_the_cursor_back() -> None:
    out = outbound()
    a = rec("h", 1)
    out.read(7, [("a", a)], 0.0)
    out.read(9, [], 0.5)
    push = out.next_push(1.0, no_resolver)
    assert push is not None
    (answer,) = out.pushed(push, [ok(a, NEW, "a", durable=False)], 1.0, WSEQ)
    assert answer.outcome == NOT_DURABLE and not answer.deliver and answer.take is None
    assert out.staged["a"].since == 0 and out.delivered() == 0  # still the cursor before a
    again = out.next_push(2.0, no_resolver)
    assert again is not None and again.items[0].staged is a
    out.pushed(again, [ok(a, EQUAL, "a")], 2.0, WSEQ)
    assert out.delivered() == 9


def test_a_foreign_value_in_l3_sets_the_write_aside_as_delivered() -> None:
    out = outbound()
    out.read(1, [("k", rec("h", 1))], 0.0)
    push = out.next_push(1.0, no_resolver)
    assert push is not None
    (answer,) = out.pushed(push, [CorruptRecord("L3 value of 'k': not ours")], 1.0, WSEQ)
    assert answer.outcome == CORRUPT and answer.deliver and "not ours" in answer.set_aside
    assert out.delivered() == 1  # retrying cannot help: it does not hold the cursor back


def test_an_unreachable_l3_is_retried_with_backoff_and_the_latest_records() -> None:
    out = outbound(seed=3)
    a1, a2 = rec("h", 1), rec("h", 2)
    out.read(1, [("a", a1)], 0.0)
    push = out.next_push(1.0, no_resolver)
    assert push is not None
    delay = out.push_failed(push, 1.0)
    assert 0.01 <= delay <= 0.05 and out.retry_at == 1.0 + delay
    assert out.next_push(1.0 + delay / 2, no_resolver) is None  # backing off
    out.read(2, [("a", a2)], 1.0 + delay / 2)  # a newer write of the key meanwhile
    second = out.push_failed(out.next_push(1.0 + delay, no_resolver), 1.0 + delay)  # type: ignore[arg-type]
    assert second <= 0.1  # the ceiling doubled
    retry = out.next_push(1.0 + delay + second, no_resolver)
    assert retry is not None and [i.record for i in retry.items] == [a2]  # once, the latest
    out.pushed(retry, [ok(a2, NEW, "a")], 5.0, WSEQ)
    assert out.delivered() == 2 and out.backoff.attempts == 0
    assert out.next_push(10.0, no_resolver) is None  # the window a2 entered went with it


def test_the_persisted_cursor_never_passes_an_unanswered_write() -> None:
    """A seeded script of feed reads, pushes and answers (accepted, not durable, L3
    down), checked against a model: every write not yet in L3 is after the cursor."""
    seed = drawn_seed(2**32)
    rng = random.Random(seed)
    out = outbound(interval=0.01, max_ops=3, seed=seed)
    feed_pos, now, counter = 0, 0.0, 0
    pending: dict[str, tuple[int, L3Record]] = {}  # key → (position of its latest event, record)
    delivered = 0
    for _ in range(3000):
        now += rng.uniform(0, 0.01)
        r = rng.random()
        if r < 0.5:  # writes, then the driver reads the feed
            writes = []
            for _ in range(rng.randrange(4)):
                counter += 1
                key = f"k{rng.randrange(6)}"
                feed_pos += 1
                record = rec("h", counter)
                pending[key] = (feed_pos, record)
                writes.append((key, record))
            out.read(feed_pos, list({k: r for k, r in writes}.items()), now)
        else:
            push = out.next_push(now, no_resolver)
            if push is None:
                continue
            if rng.random() < 0.2:
                out.push_failed(push, now)
                continue
            durable = rng.random() < 0.8
            results = [ok(i.record, NEW, i.key, durable) for i in push.items]
            for a in out.pushed(push, results, now, WSEQ):
                if a.deliver and pending.get(a.key, (0, None))[1] is a.sent:
                    del pending[a.key]
        cursor = out.delivered()
        assert cursor >= delivered, "the cursor went back"
        delivered = cursor
        for key, (pos, _) in pending.items():
            assert pos > cursor, f"{key}'s write at {pos} is not in L3, cursor {cursor}"


def test_resolved_keys_keep_siblings_but_deletes_never_do() -> None:
    out = outbound()
    out.read(1, [("r/a", rec("h", 1)), ("r/b", rec("h", 2, tomb=True)), ("p", rec("h", 3))], 0)
    push = out.next_push(1.0, lambda key: key.startswith("r/"))
    assert push is not None and push.keep_siblings == frozenset({"r/a"})


def test_answers_must_match_the_push_in_flight() -> None:
    out = outbound()
    out.read(1, [("a", rec("h", 1))], 0.0)
    push = out.next_push(1.0, no_resolver)
    assert push is not None
    with pytest.raises(ValueError):
        out.pushed(push, [], 1.0, WSEQ)
    out.pushed(push, [ok(push.items[0].record, NEW, "a")], 1.0, WSEQ)
    with pytest.raises(ValueError):
        out.pushed(push, [ok(push.items[0].record, NEW, "a")], 1.0, WSEQ)


def test_the_driver_sleeps_until_the_window_closes_or_the_retry_is_due() -> None:
    out = outbound(interval=0.05)
    assert out.wake_at() is None
    out.read(1, [("a", rec("h", 1))], 1.0)
    assert out.wake_at() == pytest.approx(1.05)
    push = out.next_push(1.05, no_resolver)
    assert push is not None
    delay = out.push_failed(push, 1.1)
    assert out.wake_at() == pytest.approx(1.1 + delay)
    out.flush(1.2)  # (nothing open: flushing is harmless)
    assert out.waiting


# ---------------------------------------------------------------- inbound


def entries(*seqs: int | None, start: int = 1) -> list[FeedEntry]:
    return [FeedEntry(b"%d-0" % (start + i), "k", b"", s) for i, s in enumerate(seqs)]


def inbound(now: float = 0.0) -> Inbound:
    return Inbound(4, 0.02, Backoff(random.Random(1), base=0.05, cap=2.0, floor=0.01), now)


def test_entries_in_sequence_are_applied_and_advance_the_cursor() -> None:
    inb = inbound()
    assert inb.resume({0: b"3-0", 1: b"1-0", 2: b"2-0"}, {0: 3, 1: 1, 3: 9}) == {2, 3}
    reading = inb.examine(0, entries(4, 5, start=4))
    assert [e.seq for e in reading.entries] == [4, 5] and reading.problem == ""
    assert inb.seqs[0] == 3  # examine changes nothing
    for e in reading.entries:
        inb.advance(0, e)
    assert (inb.cursors[0], inb.seqs[0]) == (b"5-0", 5)


@pytest.mark.parametrize("seqs, taken, problem", [
    ((4, 6), [4], GAP),  # the stream was trimmed past the cursor
    ((7,), [], GAP),
    ((4, 4), [4], REWIND),  # the stream went back: a failover lost entries
    ((2,), [], REWIND),
    ((4, None), [4], UNSEQUENCED),  # an entry someone else wrote
])
def test_a_gap_a_rewind_or_an_unsequenced_entry_stops_the_group(
        seqs: tuple[int | None, ...], taken: list[int], problem: str) -> None:
    inb = inbound()
    inb.resume({0: b"3-0"}, {0: 3})
    reading = inb.examine(0, entries(*seqs, start=4))
    assert [e.seq for e in reading.entries] == taken and reading.problem == problem


def test_the_group_counter_reveals_what_no_entry_shows() -> None:
    inb = inbound()
    inb.resume({0: b"3-0"}, {0: 3})
    assert inb.examine(0, [], counter=3).problem == ""
    assert inb.examine(0, [], counter=5).problem == GAP  # trimmed to nothing past the cursor
    assert inb.examine(0, [], counter=2).problem == REWIND
    assert inb.examine(0, entries(4, 5, start=4), counter=5).problem == ""
    assert inb.examine(0, [], counter=None).problem == ""  # not read, or not a number
    full = entries(*range(4, 4 + FEED_COUNT), start=4)
    assert inb.examine(0, full, counter=10**6).problem == ""  # more to read: not a gap yet


def test_a_sequence_number_reissued_before_the_cursor_is_a_rewind() -> None:
    """A failover lost the entry read under number 3 (id 9-0: the old master's ids ran
    ahead) and the next change took 3 again at 5-0: the counter is the last number read,
    nothing follows the cursor; only the stream's tail, read with the counter, differs."""
    inb = inbound()
    inb.resume({0: b"9-0", 1: b"9-0"}, {0: 3, 1: 3})
    assert inb.to_read({0: 3}, {0: b"9-0"}) == set()  # the tail is the cursor: nothing new
    assert inb.to_read({0: 3}, {0: None}) == set()  # (no tail known: nothing to compare)
    assert inb.to_read({0: 3}, {0: b"5-0"}) == {0}  # the same number, another entry
    assert inb.to_read({0: 3}) == set()  # (no tails: as before)
    assert inb.examine(0, [], counter=3, tail=b"5-0").problem == REWIND
    assert inb.examine(0, entries(4, start=10), counter=3, tail=b"5-0") == (
        [], REWIND)  # (nothing after a reissue is applied: the resync re-reads)
    assert inb.examine(0, [], counter=3, tail=b"9-0").problem == ""
    assert inb.examine(0, entries(4, start=10), counter=4, tail=b"10-0").problem == ""
    # the new master's ids then passed the cursor's: the next change (4) lands after it
    # and follows the last number read; the read finds the cursor's entry gone while an
    # older one is kept (a trim never does that): the entry at 5-0 (3) was missed
    assert inb.examine(0, entries(4, start=10)).problem == ""  # (the numbers cannot tell)
    assert inb.examine(0, entries(4, start=10), lost=True) == ([], REWIND)
    # a hint of the reissued entry: number 3 at 5-0 (at or before the cursor) is not the
    # entry read as 3; the group's counter and tail are checked at the next poll
    inb.polled(inb.poll_due(0.0), 0.0)  # type: ignore[arg-type]  # (the start's check)
    inb.noted_entry(0, FeedEntry(b"5-0", "k", b"", 3))
    inb.noted_entry(1, FeedEntry(b"9-0", "k", b"", 3))  # the entry read: no news
    inb.noted_entry(1, FeedEntry(b"8-0", "k", b"", 2))  # an older one read: no news
    poll = inb.poll_due(0.05)
    assert poll is not None and poll.check == frozenset({0})
    assert inb.take_noted() == {}
    assert inb.tails_for(poll) == {0}  # (a check out of turn: with its tail)


def test_the_sweep_reads_the_tails_in_one_pass_of_every_tail_every() -> None:
    inb = inbound(now=0.0)  # 4 groups: one slice is a pass
    inb.resume({g: b"5-0" for g in range(4)}, {g: 5 for g in range(4)})
    first = inb.poll_due(0.0)
    assert first is not None and inb.tails_for(first) == frozenset(range(4))  # (the start)
    inb.polled(first, 0.0)
    with_tails = []
    t = 0.0
    for _ in range(2 * TAIL_EVERY):
        t += 1.0
        poll = inb.poll_due(t)
        assert poll is not None and poll.sweep
        with_tails.append(inb.tails_for(poll) == poll.check)
        inb.polled(poll, t)
    assert with_tails == ([True] + [False] * (TAIL_EVERY - 1)) * 2
    inb.lost({2})  # out of turn: with its tail, whatever the pass
    poll = inb.poll_due(t + 0.1)
    assert poll is not None and not poll.sweep and inb.tails_for(poll) == {2}


def test_the_first_read_after_lost_hints_checks_the_cursor_s_entry() -> None:
    inb = inbound()
    assert inb.verify == set(range(4))  # (at start: every group's first read)
    inb.verified({0, 1, 2, 3})
    inb.lost({1, 99})  # (a failover broke the subscription of group 1's slot)
    assert inb.verify == {1}
    inb.verified({1})
    assert inb.verify == set()


def test_a_resync_is_pending_until_complete_and_its_cursor_is_not_saved() -> None:
    inb = inbound()
    inb.resume({g: b"1-0" for g in range(4)}, {g: 1 for g in range(4)})
    assert inb.saveable() == ({}, {})  # L3 holds what was resumed: nothing to save
    inb.advance(0, entries(2, start=2)[0])
    inb.advance(3, entries(2, start=2)[0])
    inb.begin_resync({1, 2}, missed=True)
    assert inb.positioned(1, 40, b"40-0") is True  # missed entries: scan the group's keys
    inb.scanned(1)
    assert inb.positioned(2, 7, b"7-0") is True
    cursors, seqs = inb.saveable()
    assert set(cursors) == set(seqs) == {0, 3}  # interrupted here: 1 and 2 resync again
    inb.begin_resync({1, 2}, missed=False)  # the redo keeps whether to scan
    assert inb.positioned(1, 41, b"41-0") is False and inb.positioned(2, 7, b"7-0") is True
    inb.resynced({1, 2})
    cursors, seqs = inb.saveable()
    assert cursors[1] == b"41-0" and seqs == {0: 2, 1: 41, 2: 7, 3: 2} and not inb.pending
    inb.saved(cursors, seqs)
    assert inb.saveable() == ({}, {})  # only what changed since is saved
    inb.advance(2, entries(8, start=8)[0])
    assert inb.saveable() == ({2: b"8-0"}, {2: 8})


def test_a_fresh_group_is_resynced_without_scanning() -> None:
    inb = inbound()
    inb.begin_resync({0}, missed=False)
    assert inb.positioned(0, 0, b"0-0") is False


def test_every_counter_is_checked_at_the_first_poll_then_a_sweep_slice_at_a_time() -> None:
    inb = Inbound(1024, 0.02, Backoff(random.Random(1), base=0.05, cap=2.0, floor=0.01), 10.0,
                  sweep_rate=1024, sweep_batch=256)
    assert inb.sweep_every == 0.25 and inb.sweep_period == 1.0
    first = inb.poll_due(10.0)
    assert first is not None and first.check == frozenset(range(1024)) and not first.save
    inb.polled(first, 10.0)
    assert inb.poll_due(10.1) is None  # nothing hinted, nothing to check: no call at all
    slices = []
    t = 10.0
    for _ in range(4):  # every group's counter once a second, 256 at a time
        t += 0.25
        poll = inb.poll_due(t)
        assert poll is not None and poll.sweep == 256 and len(poll.check) == 256
        slices.append(poll.check)
        inb.polled(poll, t)
    assert frozenset().union(*slices) == frozenset(range(1024))
    assert inb.poll_due(t + 0.1) is None


def test_hinted_groups_are_read_and_lost_hints_check_the_counters_at_once() -> None:
    inb = inbound(now=10.0)
    inb.resume({g: b"5-0" for g in range(4)}, {g: 5 for g in range(4)})
    inb.polled(inb.poll_due(10.0), 10.0)  # type: ignore[arg-type]  # (the start's check)
    inb.hinted({2, 99})  # (a group that is not one of ours is ignored)
    poll = inb.poll_due(10.05)
    assert poll == Poll(frozenset(), False, 0)
    assert inb.to_read({}) == {2}
    inb.read(2, 3)  # a short read: the stream's end was reached
    inb.polled(poll, 10.05)  # type: ignore[arg-type]
    assert inb.poll_due(10.1) is None
    inb.hinted({1})
    inb.read(1, FEED_COUNT)  # a full page: there may be more, read again next poll
    assert inb.to_read({}) == {1}
    inb.lost({3})
    poll = inb.poll_due(10.2)
    assert poll is not None and poll.check == frozenset({3})
    assert inb.to_read({3: 5}) == {1}  # its counter did not move: nothing was missed
    assert inb.to_read({3: 7}) == {1, 3}  # it did: read it
    assert inb.to_read({3: None}) == {1, 3}  # not a number: read (and see why)
    inb.poll_failed(10.2)  # the check failed: it is made again
    poll = inb.poll_due(11.0)
    assert poll is not None and 3 in poll.check


def test_entries_hints_carry_are_taken_only_in_sequence() -> None:
    inb = inbound(now=10.0)
    inb.resume({g: b"5-0" for g in range(4)}, {g: 5 for g in range(4)})
    inb.polled(inb.poll_due(10.0), 10.0)  # type: ignore[arg-type]  # (the start's check)
    inb.verified(range(4))  # (reads found each cursor's entry: see the test below)
    e6, e7, e8 = entries(6, 7, 8, start=6)
    inb.noted_entry(0, e6)
    inb.noted_entry(0, e7)  # follows the noted one
    inb.noted_entry(1, e7)  # a hole: 6 never came (a hint lost): read the stream
    inb.noted_entry(2, entries(5, start=5)[0])  # read already (a read overtook its hint)
    inb.noted_entry(3, FeedEntry(b"9-0", "k", b"", 4))  # lower, and new: a rewind, read
    assert inb.poll_due(10.05) is not None  # (noted entries make a poll due)
    assert inb.to_read({}) == {1, 3}
    assert inb.take_noted() == {0: [e6, e7]}  # applied as read, without an XRANGE
    assert inb.take_noted() == {}
    inb.noted_entry(0, e8)  # 8 follows 7 only once 7 is applied (advance)
    assert inb.to_read({}) == {0, 1, 3}
    for e in (e6, e7):
        inb.advance(0, e)
    inb.read(0, 0)
    inb.noted_entry(0, e8)
    assert inb.to_read({0: 9}) == {0, 1, 3}  # the counter is past it: read (it brings 8 too)
    assert inb.take_noted() == {}
    inb.read(0, 0)
    inb.noted_entry(0, e8)
    assert inb.to_read({0: 8}) == {1, 3} and inb.take_noted() == {0: [e8]}
    inb.advance(0, e8)
    inb.noted_entry(0, entries(9, start=9)[0])
    inb.begin_resync({0}, missed=True)  # a resync takes a new position: what was noted goes
    assert inb.take_noted() == {}
    inb.noted_entry(0, entries(9, start=9)[0])  # (resyncing: read once it is done)
    assert 0 in inb.to_read({})


def test_polls_keep_their_pace_save_each_second_and_back_off() -> None:
    inb = inbound(now=10.0)
    first = inb.poll_due(10.0)
    assert first is not None and not first.save  # cursors first saved a second after start
    inb.polled(first, 10.0)
    inb.hinted({0})
    assert inb.poll_due(10.01) is None  # feed_poll is 20 ms
    due = inb.poll_due(11.0)
    assert due is not None and due.save
    inb.polled(due, 11.0)
    inb.hinted({0})
    delay = inb.poll_failed(11.5)
    assert inb.poll_due(11.5 + delay / 2) is None and inb.poll_due(11.5 + delay + 0.02)


# ---------------------------------------------------------------- bounded vectors


def test_a_vector_of_many_hosts_is_pruned_before_it_is_pushed() -> None:
    hosts = HostActivity("me", now_ms=0, young_ms=60_000, old_ms=3_600_000)
    for i in range(5):
        hosts.saw(f"busy{i}", 4_000_000)  # active a moment ago
    vector = {f"idle{i:02d}": 1 for i in range(40)} | {f"busy{i}": 3 for i in range(5)}
    r = rec("w", 9, vector={**vector, "me": 2})
    # within a minute of the daemon's start, hosts it never saw count as just seen
    assert hosts.shape(r, now_ms=30_000) is r
    out = hosts.shape(r, now_ms=4_000_100)  # later: the idle ones are over an hour old
    kept = dict(out.vector)
    assert len(out.vector) <= 8 and set(dict(r.vector)) >= set(kept)
    assert kept["me"] == 2 and kept["w"] == 9  # this host's and the writer's entries stay
    assert all(kept[f"busy{i}"] == 3 for i in range(5))  # active hosts are never dropped
    assert out._replace(vector=r.vector) == r  # nothing else changed
    small = rec("w", 1, vector={"a": 1, "b": 2})
    assert hosts.shape(small, now_ms=10**9) is small  # up to `small` entries: untouched


def test_the_outbound_machine_pushes_pruned_vectors_and_delivers_the_write_l2_holds() -> None:
    hosts = HostActivity("me", now_ms=0, young_ms=10, old_ms=100, small=2, big=3)
    full = rec("me", 5, vector={"x": 1, "y": 1, "z": 1})
    out = outbound()
    out.read(1, [("k", full)], 0.0)
    push = out.next_push(1.0, no_resolver, lambda r: hosts.shape(r, 10_000))
    assert push is not None
    sent = push.items[0].record
    assert len(sent.vector) == 2 and ("me", 5) in sent.vector  # pruned down to `small`
    assert push.items[0].staged is full
    (answer,) = out.pushed(push, [ok(sent, NEW)], 1.0, WSEQ)
    assert answer.sent is full and answer.deliver and answer.take is None


def _causal_history(rng: random.Random, hosts: int, writes: int) -> list[Dotted]:
    """A causally consistent history with HLCs as hosts keep them: each host writes on
    top of what it has seen; a write's HLC exceeds that of everything it saw."""
    names = [f"h{i:02d}" for i in range(hosts)]
    seen: dict[str, tuple[tuple[tuple[str, int], ...], int]] = {h: ((), 0) for h in names}
    out: list[Dotted] = []
    for _ in range(writes):
        h = rng.choice(names)
        if rng.random() < 0.5 and out:  # sync: learn another write first
            w = rng.choice(out)
            vec, hlc = seen[h]
            seen[h] = (merge_vectors(vec, w.vector), max(hlc, w.hlc))
        vec, hlc = seen[h]
        n = dict(vec).get(h, 0) + 1
        vec = with_dot(vec, h, n)
        hlc = max(hlc + 1, rng.randrange(1, 1000))  # skewed wall clocks, causal HLC
        seen[h] = (vec, hlc)
        out.append(Dotted(vec, (h, n), hlc))
    return out


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(2, 40), st.integers(0, 2))
def test_pruning_never_makes_a_newer_write_lose_to_an_older_one(seed: int, hosts: int,
                                                                 dead: int) -> None:
    """The safety condition of kvcomm.core.versions: whatever activity says, a pruned
    newer write pushed over an older one (or an older one pushed over it) ends with the
    newer write in L3 — it may look concurrent, never older."""
    rng = random.Random(seed)
    history = _causal_history(rng, hosts, 60)
    activity = HostActivity(f"h{rng.randrange(hosts):02d}", now_ms=0, small=2, big=4,
                            young_ms=10, old_ms=100 * (dead + 1))
    for i in range(hosts):
        if rng.random() < 0.3:
            activity.saw(f"h{i:02d}", rng.randrange(1000))
    for _ in range(40):
        old, new = rng.sample(history, 2)
        if compare_vectors(new.vector, old.vector) is not Ordering.AFTER:
            continue
        r = L3Record(new.hlc, False, 1, b"", b"", new.vector, new.dot)
        pruned = activity.shape(r, now_ms=1000).version
        assert covers(pruned.vector, new.dot)
        assert compare_vectors(pruned.vector, old.vector) in (Ordering.AFTER, Ordering.CONCURRENT)
        for stored, incoming in ((old, pruned), (pruned, old)):
            outcome, after = l3_rule(stored, incoming)
            assert after is not None and after.dot == new.dot, (stored, incoming, outcome)


# ---------------------------------------------------------------- pushed short of replicas


def short(record: L3Record, key: str, seq: int, call: int, outcome: str = NEW,
          node: str = "m:1", history: str = "run1:replid1") -> PushResult:
    """L3's answer to a change stored (entry ``seq`` at ``seq``-0) on master ``node`` by
    pipeline ``call``, in replication ``history``, acknowledged by fewer replicas than
    cluster.wait_replicas."""
    return PushResult(key, outcome, record, True, seq=seq, entry=b"%d-0" % seq, short=True,
                      node=node, call=call, history=history)


def _push_one(out: Outbound, key: str, record: L3Record, cursor: int, now: float,
              answer: PushResult) -> None:
    out.read(cursor, [(key, record)], now)
    push = out.next_push(now + 1.0, no_resolver)
    assert push is not None and [i.key for i in push.items] == [key]
    out.pushed(push, [answer], now + 1.0, WSEQ)


def test_a_short_push_is_held_dirty_until_a_later_full_wait_on_its_master() -> None:
    """A change acknowledged by fewer replicas than asked is not delivered (L2 keeps it
    dirty: never evicted) and holds the delivered cursor back (a restarted daemon sends
    it again); a later probe on the same master, in the same replication history, that
    cluster.wait_replicas replicas acknowledged confirms it; one on another master, or an
    earlier one, does not. A
    full acknowledgement is never held; an answer that stored nothing (equal) neither."""
    out = outbound(cursor=0)
    a, b, c = rec("h", 1), rec("h", 2), rec("h", 3)
    out.read(5, [("a", a)], 0.0)
    push = out.next_push(1.0, no_resolver)
    assert push is not None
    (answer,) = out.pushed(push, [short(a, "a", 7, call=10)], 1.0, WSEQ)
    assert answer.unconfirmed and not answer.deliver and answer.outcome == NEW
    assert len(out.unconfirmed) == 1 and out.delivered() == 0  # (a's feed position: 0)
    assert dict(out.unconfirmed.by_group) == {0: {7: b"7-0"}}
    _push_one(out, "b", b, 9, 2.0, ok(b, NEW, "b"))  # full: delivered, never held
    _push_one(out, "c", c, 11, 4.0, ok(c, EQUAL, "c")._replace(short=True))  # nothing stored
    assert list(out.unconfirmed.by_key) == ["a"] and out.delivered() == 0
    assert out.unconfirmed.confirm({"m:2": (99, "run1:replid1"),  # elsewhere; not later
                                    "m:1": (10, "run1:replid1")}) == []
    (done,) = out.unconfirmed.confirm({"m:1": (11, "run1:replid1")})
    assert done.key == "a" and done.record is a and not out.unconfirmed
    assert out.delivered() == 11 and not out.unconfirmed.by_group


def test_a_wait_in_another_history_of_the_same_master_confirms_nothing() -> None:
    """A failback: a held write's master (same name) later runs another replication
    history — it failed over (losing the write), was resynced from the new master and
    made master again, or restarted. A later WAIT there reaching the target does not
    confirm the write; the master seen in another history (or as a replica) makes its
    group a rewind (resynced: the write sent again). The write's own history confirms
    it, its other held records staying; a write whose history was not known is never
    confirmed, and is a rewind once its master is seen."""
    out = outbound(cursor=0)
    a, b, c = rec("h", 1), rec("h", 2), rec("h", 3)
    _push_one(out, "a", a, 5, 1.0, short(a, "a", 7, call=10))
    _push_one(out, "b", b, 6, 2.0, short(b, "b", 8, call=12, history="run1:replid3"))
    _push_one(out, "c", c, 7, 3.0, short(c, "c", 9, call=13, history=""))
    held = out.unconfirmed
    assert len(held) == 3
    assert held.rewound({}) == set() and held.rewound({"m:2": "run9:x"}) == set()
    # the group's slot moved off m:1 (a migration: its history unchanged)
    assert held.rewound({}, {("m:1", 0)}) == {0} and held.rewound({}, {("m:2", 0)}) == set()
    assert held.rewound({}, {("m:1", 5)}) == set()  # (another group moved off m:1)
    # the failback: m:1 now runs replid3 (a's replid1 was left), WAIT reached the target
    assert [h.key for h in held.confirm({"m:1": (20, "run1:replid3")})] == ["b"]
    assert list(held.by_key) == ["a", "c"]
    assert held.rewound({"m:1": "run1:replid3"}) == {0}  # (a's and c's group)
    assert held.rewound({"m:1": ""}) == {0}  # (m:1 a replica now: replid1 left for good)
    # a restart: same replid (reloaded), another run: not the history a was written in
    assert held.confirm({"m:1": (20, "run2:replid1")}) == []
    assert held.rewound({"m:1": "run1:replid1"}) == {0}  # (c only: its history unknown)
    assert [h.key for h in held.confirm({"m:1": (20, "run1:replid1")})] == ["a"]
    assert held.confirm({"m:1": (99, "")}) == [] and list(held.by_key) == ["c"]
    assert held.rewound({"m:1": ""}) == {0}  # (c: never confirmable, once m:1 is seen)
    (gone,) = held.drop_groups(held.rewound({"m:1": "run1:replid1"}))
    assert gone.key == "c" and not held


def test_held_records_are_bounded_the_oldest_released() -> None:
    """Past the bound the oldest held record is released (the driver delivers it: clean
    and evictable, its loss no longer watched for); a key answered again replaces its
    held record, and a later write of it that is delivered forgets it."""
    out = Outbound("h", 0, WriteWindow(0.01, 1000),
                   Backoff(random.Random(0), base=0.05, cap=2.0, floor=0.01),
                   unconfirmed_max=2)
    for n, key in enumerate(("a", "b", "c"), start=1):
        r = rec("h", n)
        _push_one(out, key, r, n, 2.0 * n, short(r, key, 10 + n, call=n))
    assert [h.key for h in out.released] == ["a"] and list(out.unconfirmed.by_key) == ["b", "c"]
    b2 = rec("h", 5)
    _push_one(out, "b", b2, 8, 20.0, short(b2, "b", 20, call=8))  # (in place of b's)
    assert list(out.unconfirmed.by_key) == ["c", "b"] and out.unconfirmed.by_key["b"].seq == 20
    assert dict(out.unconfirmed.by_group) == {0: {13: b"13-0", 20: b"20-0"}}
    c2 = rec("h", 6)
    _push_one(out, "c", c2, 9, 30.0, ok(c2, NEWER, "c"))
    assert list(out.unconfirmed.by_key) == ["b"] and out.delivered() == 3  # (b's, re-read at 3)
    (gone,) = out.unconfirmed.drop_groups({0})  # (a resync of its group sends it again)
    assert gone.key == "b" and not out.unconfirmed and out.delivered() == 9


def test_a_lost_unread_short_push_is_a_rewind() -> None:
    """The host pushed entry 4 (at 40-0) short of replicas and read nothing since (its
    last number: 3). A failover that lost it and kept 3 leaves the counter at 3 and the
    stream's tail at the cursor — nothing a reader's check sees; the held number shows
    it. So does another entry under number 4 (a reissue), read or hinted."""
    inb = inbound()
    inb.resume({0: b"3-0"}, {0: 3})
    inb.expected = {0: {4: b"40-0"}}
    assert inb.to_read({0: 3}, {0: b"3-0"}) == {0}
    assert inb.examine(0, [], counter=3, tail=b"3-0") == ([], REWIND)
    assert inb.examine(0, [FeedEntry(b"40-0", "k", b"", 4)], counter=4).problem == ""
    assert inb.examine(0, [FeedEntry(b"5-0", "j", b"", 4)]) == ([], REWIND)
    inb.polled(inb.poll_due(0.0), 0.0)  # type: ignore[arg-type]  # (the start's check)
    inb.noted_entry(0, FeedEntry(b"5-0", "j", b"", 4))  # reissued: read, not taken
    assert 0 in inb.due and inb.take_noted() == {}
    inb.expected = {}
    assert inb.to_read({0: 3}, {0: b"3-0"}) == {0}  # (due from the hint)
    inb.read(0, 0)
    assert inb.to_read({0: 3}, {0: b"3-0"}) == set()  # (without the held number: nothing)


def test_outbound_parks_unreached_writes_until_unpark() -> None:
    """Outbound alone: a write answered Unreached stays staged (the delivered cursor
    held: it is dirty) but in no window, so no push takes it again, until ``unpark``;
    a newer write of a parked key is windowed at once (and no longer parked).
    (found in review 21: one hung Redis master)"""
    out = outbound()
    out.read(1, [("a", rec("h", 1)), ("b", rec("h", 2))], 0.0)
    push = out.next_push(1.0, lambda k: False)
    assert push is not None and {i.key for i in push.items} == {"a", "b"}
    answers = out.pushed(push, [Unreached("down")] * 2, 1.0, WSEQ)
    assert [a.outcome for a in answers] == [UNREACHED] * 2
    assert not any(a.deliver for a in answers)
    assert out.parked == {"a", "b"} and out.delivered() == 0
    assert out.next_push(5.0, lambda k: False) is None  # (parked: nothing to send)
    out.read(2, [("b", rec("h", 3))], 5.0)  # a newer write of b: sent, not parked
    assert out.parked == {"a"}
    push = out.next_push(6.0, lambda k: False)
    assert push is not None and [i.key for i in push.items] == ["b"]
    out.pushed(push, [Unreached("down")], 6.0, WSEQ)
    assert out.unpark(7.0) == 2 and not out.parked
    push = out.next_push(8.0, lambda k: False)
    assert push is not None and {i.key for i in push.items} == {"a", "b"}
    assert {i.record.dot for i in push.items} == {("h", 1), ("h", 3)}
    assert out.delivered() == 0  # (still not answered)


def test_entries_hints_carry_for_a_group_whose_hints_were_lost_are_read() -> None:
    """A group whose hints were told lost (or not read since the start) is read, not
    taken from the entries hints bring, until a read finds its cursor's entry: those
    entries may follow a sequence number L3 reissued after a failover, where the entry
    the host applied under it is gone and the write L3 reissued it for was never read
    (the simulation's seed 213642, found by the adversary's review)."""
    inb = inbound(now=10.0)
    inb.resume({g: b"5-0" for g in range(4)}, {g: 5 for g in range(4)})
    inb.polled(inb.poll_due(10.0), 10.0)  # type: ignore[arg-type]  # (the start's check)
    (e6,) = entries(6, start=6)
    inb.noted_entry(0, e6)
    assert inb.to_read({0: 6}) == {0}  # not verified since the start: read
    inb.verified({1, 2, 3})
    inb.noted_entry(2, e6)
    assert inb.to_read({2: 6}) == set() and inb.take_noted() == {2: [e6]}  # verified: taken
    inb.lost({1})
    inb.noted_entry(1, e6)
    assert inb.to_read({1: 6}) == {1}  # the counter agrees, but its hints were lost: read
