"""``kvcomm node``: the host daemon that keeps one host's L2 in sync with the cluster (L3).

Theory of operation
-------------------
Agents only ever touch L2 (and, on an L2 miss, read L3 once). The daemon does the rest,
in one loop:

1. **Local → L3.** It drains the host's L2 change feed from its cursor. Every ``put``
   whose record is still flagged *dirty* (written by an agent of this host, not yet in
   L3) enters the write window (:mod:`kvcomm.core.window`); deletes enter as tombstones.
   When the window closes (``cache.l2_sync_interval``, or full), its writes go to L3 in
   one pipeline of merge-script calls per master node (:class:`kvcomm.tiers.l3.L3Store`).
   L3's answer is applied back: accepted writes are marked clean (L2 may now evict
   them); where L3 held something newer, or merged a concurrent write, that record is
   written into L2 (clean). The cursor is stored in the L2 header only once everything
   before it is in L3, so a daemon killed at any point replays from there: at-least-once,
   and the merge makes a replay harmless. If the feed ring was overwritten past the
   cursor, every dirty record is pushed again (a scan).
2. **L3 → local.** It reads every group's L3 change feed (Redis Streams, one per hash-slot
   group, bounded) after its per-group cursors, which live in L3
   (``kvn:{host}:cursors``), so a restarted daemon — or one whose connection dropped
   — resumes where it was, and nothing is lost the way pub/sub loses messages. A change
   to a key this host holds is merged into L2 (its own writes echo back as no-ops; a
   record L3 merged from one of them is taken); keys it does not hold are left to the
   read path. Every entry carries its group's sequence number (:mod:`kvcomm.tiers.l3`);
   the daemon keeps the last one it saw per group, with the cursors. An entry that is
   not the next one — the stream was trimmed past the cursor (a gap), or went
   backwards (a failover lost entries the daemon had read) — and, once a second, a
   group counter that a read did not reach, make the daemon **resync** that group: take
   the group's position, add its keys to the key filter, and re-read from L3 the keys
   of that group that L2 holds. Until a resync completes, the group's old cursor is the
   one saved, so a daemon killed meanwhile resyncs again.
3. **Prewarm.** Every couple of seconds the host's hot keys (the host-wide sketch of
   agents' reads) are saved to L3 and any of them missing from L2 (evicted, say) are
   read back in; a daemon that starts prewarms L2 from the list its predecessor saved.
4. **The host's filter of existing keys** (:mod:`kvcomm.tiers.keyfilter`): built from a
   scan of L3 at start, fed with every key seen in the feeds, rotated now and then so
   deleted keys age out. Agents ask it before an L3 read: absent keys stay on the host.
5. **Heartbeat** in the L2 header and in the key filter's header, so agents and tools
   can see the daemon is alive (agents trust the filter only while it beats).

When L3 is unreachable, nothing is dropped: the unsent window is kept and retried with
capped exponential backoff with jitter (:mod:`kvcomm.core.backoff`, so that hosts do
not retry in lockstep after an outage), agents keep writing into L2, and once
``cluster.outbound_max`` writes are waiting, ``put`` raises ``Unavailable`` instead of
losing them.

Input never kills the daemon
----------------------------
Everything the daemon reads from L3 may have been written by something else. A record
that fails — it does not decode (CorruptRecord), L2 cannot take it (ValueTooLarge or
any KVCommError), its key cannot be sent to Redis, or anything unexpected happens while
handling that one record — is logged, counted (``stats.quarantined``), pushed to the
capped L3 list ``kvn:{host}:quarantine`` ("set aside") when L3 is reachable, and
skipped; the loop goes on. A round that fails as a whole is retried with backoff. The
process exits only on SIGTERM/SIGINT, on a configuration error (ConfigError: bad
cluster settings or resolvers), or when its own L2 segment or key filter cannot be used
(SegmentError: purged, foreign, or another user's).
"""

from __future__ import annotations

import logging
import random
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .._client import Client
from .._client import open as kv_open
from ..config import Config
from ..core.backoff import Backoff
from ..core.versions import vector_get
from ..core.window import ClosedWindow, WriteWindow
from ..errors import ConfigError, CorruptRecord, SegmentError, Unavailable, ValueTooLarge
from ..tiers.keyfilter import KeyFilter
from ..tiers.l2 import KIND_DELETE, KIND_PUT
from ..tiers.l3 import GROUPS, FeedEntry, L3Record, L3Store, group_of
from .port import ClientPort, HostL2

log = logging.getLogger("kvcomm.node")
HOT_KEYS = 64  # hot keys saved and kept in L2 per host
STATE_EVERY = 1.0  # seconds between saves of the feed cursors and checks of group counters
RECENT_S = 30.0  # how long a skipped remote change can still be applied over a late fill
RECENT_MAX = 65_536  # skipped remote changes remembered at most
QUARANTINE_QUIET = 60.0  # the same key is pushed to the quarantine list at most this often


@dataclass
class DaemonStats:
    pushed: int = 0  # records sent to L3
    windows: int = 0
    accepted: int = 0  # new / newer / equal
    refreshed: int = 0  # older / merged: L3's record written back into L2
    pulled: int = 0  # remote changes merged into L2
    skipped_remote: int = 0  # remote changes to keys this host does not hold
    corrupt: int = 0  # records that did not decode (each also counted in quarantined)
    l3_errors: int = 0
    resyncs: int = 0  # group resyncs: a gap or a rewind seen in a group's feed
    feed_overflows: int = 0
    quarantined: int = 0  # inputs set aside (logged, pushed to kvn:{host}:quarantine)
    step_errors: int = 0  # rounds that failed as a whole (retried with backoff)
    extra: dict[str, int] = field(default_factory=dict)

    def bump(self, name: str, n: int = 1) -> None:
        self.extra[name] = self.extra.get(name, 0) + n


class NodeDaemon:
    """One host's sync loop. ``step()`` does one round; ``run()`` loops until stopped.

    Raises ConfigError (bad cluster settings or resolvers), SegmentError (the host's L2
    or key filter cannot be used), Unavailable (L3 cannot be reached: retry later). A
    failed start releases everything it opened.
    """

    def __init__(self, config: Config, name: str | None = None,
                 rng: random.Random | None = None) -> None:
        if not config.cluster.enabled:
            raise ConfigError("cluster.redis",
                              "kvcomm node needs the Redis Cluster seed nodes (host:port list)")
        self.config = config
        self.started = False  # __init__ done: the L2 heartbeat says so to tools
        seeds = config.cluster.seeds()  # validate before touching the host's L2
        # jitter must differ between hosts: an unseeded Random draws its seed from the OS
        self.rng = rng if rng is not None else random.Random()
        self.kv: Client = kv_open(name, config=config)
        try:
            self.port: HostL2 = ClientPort(self.kv)  # the one way to the host's L2
            self.host = self.port.host_id
            cl = config.cluster
            c = config.cache
            resolvers = {prefix: _import(path) for prefix, path in cl.resolvers.items()}
            self.l3 = L3Store(seeds, username=cl.redis_username, password=cl.redis_password,
                              tls=cl.redis_tls, timeout=cl.timeout, feed_maxlen=cl.feed_maxlen,
                              wait_replicas=cl.wait_replicas, wait_ms=int(cl.wait_timeout * 1000),
                              max_value_size=c.max_value_size)
            self.window = WriteWindow(c.l2_sync_interval, c.max_batch_ops, c.max_batch_bytes)
            self.staged: dict[str, L3Record] = {}
            self.cursor = self.port.delivered_cursor  # local feed: all before it is in L3
            self.stats = DaemonStats()
            self.unsent: list[ClosedWindow] = []
            self.push_backoff = Backoff(self.rng, base=0.05, cap=2.0, floor=0.01)
            self.pull_backoff = Backoff(self.rng, base=0.05, cap=2.0, floor=0.01)
            self.retry_at = 0.0
            self.pull_at = 0.0
            self.last_pull = 0.0
            self.state_at = time.monotonic() + STATE_EVERY
            self.set_aside_at: dict[str, float] = {}  # key → when last pushed to quarantine
            # remote changes to keys not held here, for a while (see _remember_skipped)
            self.recent_remote: dict[str, tuple[float, L3Record]] = {}
            self.feed_cursors: dict[int, bytes] = {}
            self.feed_seqs: dict[int, int | None] = {}  # last sequence number seen, by group
            # groups whose resync has not completed → whether their keys go to the filter
            self.resync_pending: dict[int, bool] = {}
            for prefix, fn in resolvers.items():  # the operator's own code, named in config
                self.kv.register_resolver(prefix, fn)  # (agents of the host register theirs)
            self.keys = KeyFilter.create(self.kv.name, c.bloom_capacity, c.bloom_fpr,
                                         permissions=c.l2_permissions, directory=c.l2_dir)
            self.rebuild_every = cl.key_filter_rebuild
            self._fill_key_filter(initial=True)
            self._start_feeds()
            self.hot_saved = time.monotonic()
            self.stats.bump("prewarmed", self._prewarm(self.l3.load_hot(self.host)))
            self.started = True
        except BaseException:  # L3 unreachable at start, say: release what we opened
            if getattr(self, "keys", None) is not None:
                self.keys.close()
            if getattr(self, "l3", None) is not None:
                self.l3.close()
            self.kv.close()
            raise

    # ------------------------------------------------------------------ bad input

    def _set_aside(self, key: str, reason: str) -> None:
        """Count, log and (if L3 answers) record an input the daemon skips. A key that
        keeps failing is logged and recorded once a minute, counted every time."""
        self.stats.quarantined += 1
        now = time.monotonic()
        if now - self.set_aside_at.get(key, -QUARANTINE_QUIET) < QUARANTINE_QUIET:
            log.debug("set aside %r again: %s", key, reason)
            return
        log.error("set aside %r: %s", key, reason)
        if len(self.set_aside_at) > 10_000:
            self.set_aside_at.clear()
        self.set_aside_at[key] = now
        try:
            self.l3.quarantine(self.host, key, reason, time.time())
        except Unavailable as exc:
            log.warning("could not record %r in the quarantine list: %s", key, exc)

    def _guarded(self, key: str, where: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` for one record, or False when it failed. Any failure but
        Unavailable (which means "not now": the caller's round is retried) sets the
        record aside."""
        try:
            return fn(*args)
        except Unavailable:
            raise
        except Exception as exc:  # one record's failure, whatever it is, stops nothing else
            if isinstance(exc, CorruptRecord):
                self.stats.corrupt += 1
            self._set_aside(key, f"{where}: {type(exc).__name__}: {exc}")
            return False

    # ------------------------------------------------------------------ local → L3

    def _stage_put(self, key: str, now: float) -> None:
        """Stage the key's record if it is dirty: a put, or a delete's tombstone (which
        carries the vector of the value it deleted, so it supersedes it in L3)."""
        record = self.port.dirty_record(key)
        if record is None:
            return  # evicted (clean), or not an agent's write (already in L3)
        if not record.tombstone:
            self.keys.add(key.encode("utf-8", "surrogateescape"))
        self._stage(key, record, now)

    def _refill(self, key: str, now: float) -> None:
        """A key whose remote change was skipped (not held) was written here since: an
        agent's fill from L3, maybe older than that change. Apply the change over it (a
        newer one replaces the fill, an older or equal one changes nothing)."""
        seen, rec = self.recent_remote.pop(key)
        if now - seen < RECENT_S:
            self.stats.bump("refills")
            self._guarded(key, "feed", self._apply_or_forget, key, rec)

    def _stage(self, key: str, record: L3Record, now: float) -> None:
        self.staged[key] = record
        size_hint = None if record.tombstone else record.value
        closed = self.window.add(key, size_hint, record.vector, record.hlc, now)
        if closed is not None:
            self.unsent.append(closed)

    def push_local(self, now: float) -> None:
        events, cursor, overflowed = self.port.feed_read(self.cursor)
        if overflowed:
            self.stats.feed_overflows += 1
            for key in self.port.dirty_keys():
                self._guarded(key, "local write", self._stage_put, key, now)
        for ev in events:
            if ev.kind in (KIND_PUT, KIND_DELETE):  # (evictions are local: never sent)
                self._guarded(ev.key, "local write", self._stage_put, ev.key, now)
                if ev.key in self.recent_remote:
                    self._refill(ev.key, now)
        self.cursor = cursor
        closed = self.window.poll(now)
        if closed is not None:
            self.unsent.append(closed)
        if now >= self.retry_at:
            self._send_unsent()
        if not self.unsent and not len(self.window):
            self.port.delivered_up_to(self.cursor)  # everything before it is in L3

    def _send_unsent(self) -> None:
        while self.unsent:
            batch = self.unsent[0]
            items = [(w.key, self.staged[w.key]) for w in batch.writes if w.key in self.staged]
            try:
                results = self._push(items)
            except Unavailable as exc:
                self.retry_at = time.monotonic() + self._l3_failed(self.push_backoff,
                                                                   "sending to L3", exc)
                return
            self.push_backoff.succeeded()
            self.unsent.pop(0)
            self.stats.windows += 1
            for (key, sent), res in zip(items, results, strict=True):
                if self.staged.get(key) is sent:
                    del self.staged[key]
                self.stats.pushed += 1
                self._guarded(key, "push to L3", self._handle_result, key, sent, res)

    def _handle_result(self, key: str, sent: L3Record, res: Any) -> None:
        """Apply L3's answer to one pushed record."""
        if isinstance(res, CorruptRecord):
            self._mark_clean(key, sent)  # retrying cannot help: set aside (and counted)
            raise res
        if not res.durable:  # no replica has it yet: send again next window
            self.stats.bump("not_durable")
            if key not in self.staged:  # (a newer staged write descends from it anyway)
                self._stage(key, sent, time.monotonic())
        elif res.outcome in ("new", "newer", "equal"):
            self.stats.accepted += 1
            self._mark_clean(key, sent)
        elif res.outcome == "conflict":  # a resolver's prefix: settle it here
            self.stats.bump("resolved")
            self._apply(key, res.record)  # concurrent → resolver → a new dirty write
        elif (res.outcome == "older" and sent.dot[0] == self.host
              and vector_get(res.record.vector, self.host) > self.port.write_sequence()):
            # L3 knows dots of this host that the host does not: its write sequence
            # restarted (its L2 was lost). This write is new, not older: write it again
            # over L3's version, with a dot past everything L3 has seen from this host
            self.stats.bump("rebased")
            if not self.port.rebase(key, res.record):
                self._apply(key, res.record)
        else:  # older / merged: L3 holds another record; take it
            self.stats.refreshed += 1
            self._apply(key, res.record)

    def _push(self, items: list[tuple[str, L3Record]]) -> list[Any]:
        """Push into L3; keys with a resolver keep concurrent versions apart (``conflict``)."""
        # deletes always merge last-writer-wins (with merged vectors): a resolver settles
        # concurrent values, and must not bring a deleted key back
        with_hook = [i for i, (k, r) in enumerate(items)
                     if not r.tombstone and self.port.has_resolver(k)]
        if not with_hook:
            return self.l3.push_many(items)
        hooked = set(with_hook)
        plain_idx = [i for i in range(len(items)) if i not in hooked]
        out: list[Any] = [None] * len(items)
        for idxs, siblings in ((plain_idx, False), (with_hook, True)):
            if idxs:
                part = [items[i] for i in idxs]
                res = self.l3.push_many(part, {k for k, _ in part} if siblings else frozenset())
                for i, r in zip(idxs, res, strict=True):
                    out[i] = r
        return out

    def _mark_clean(self, key: str, sent: L3Record) -> None:
        self.port.mark_delivered(key, sent)

    def _apply(self, key: str, record: L3Record) -> bool:
        """Write an L3 record into L2 (clean), unless L2 already holds something newer.
        Returns True.

        Raises CorruptRecord (the value does not decode), ValueTooLarge or another
        KVCommError (L2 cannot take it): the caller sets the record aside.
        """
        self.port.apply_remote(key, record)
        return True

    # ------------------------------------------------------------------ the key filter

    def _fill_key_filter(self, initial: bool = False) -> None:
        """Initial fill (both generations) or a rotation (the older one, refilled)."""
        if initial:
            self.keys.set_ready(False)
            self._scan_into(self.keys.add, self.l3.scan_keys())
            self.keys.set_ready(True)
        else:
            target = self.keys.begin_rotation()
            self._scan_into(target.add, self.l3.scan_keys())
            self.keys.end_rotation()
            self.stats.bump("key_filter_rotations")
        self.filter_built = time.monotonic()

    def _scan_into(self, add: Any, keys: Iterable[bytes]) -> None:
        for n, kb in enumerate(keys):
            add(kb)
            if n % 4096 == 0:  # a long scan must not look like a dead daemon to agents
                self.keys.beat()
                if self.started:  # (L2's heartbeat also says "started": not before that)
                    self.port.heartbeat()

    def _maybe_rotate_filter(self) -> None:
        if (time.monotonic() - self.filter_built > self.rebuild_every
                or self.keys.adds_since_rotation >= self.config.cache.bloom_capacity):
            self._fill_key_filter()

    # ------------------------------------------------------------------ prewarm

    def _prewarm(self, keys: list[str]) -> int:
        """Read into L2 the keys of ``keys`` it does not hold; returns how many came in.

        A key whose L3 record fails is set aside. Raises Unavailable."""
        n = 0
        for key in keys:
            if self.port.holds(key):
                continue
            n += bool(self._guarded(key, "prewarm", self._fetch_and_apply, key, False))
        return n

    def _fetch_and_apply(self, key: str, tombstones: bool) -> bool:
        """Read ``key``'s record from L3 into L2 (a tombstone only if ``tombstones``);
        True if there was one to apply."""
        rec = self.l3.get(key)
        if rec is None or (rec.tombstone and not tombstones):
            return False
        return self._apply(key, rec)

    def _maybe_prewarm(self) -> None:
        if time.monotonic() - self.hot_saved < 2.0:
            return
        self.hot_saved = time.monotonic()
        hot = self.port.hot_keys(HOT_KEYS)
        if hot:
            self.l3.save_hot(self.host, hot)
            self.stats.bump("prewarmed", self._prewarm(hot))

    # ------------------------------------------------------------------ L3 → local

    def _start_feeds(self) -> None:
        """Resume every group's feed from the saved cursor and sequence number; a group
        without both (a new host) starts from its current position, re-reading any keys
        L2 already holds."""
        saved, seqs = self.l3.load_cursors(self.host)
        fresh = set()
        for g in range(GROUPS):
            if g in saved and g in seqs:
                self.feed_cursors[g], self.feed_seqs[g] = saved[g], seqs[g]
            else:
                fresh.add(g)
        if fresh:
            self._resync(fresh, reason="")

    def _resync(self, groups: set[int], reason: str) -> None:
        """Take ``groups``' current feed positions, then re-read from L3 the keys of those
        groups that L2 holds (changes after the position come through the feed). A
        ``reason`` (a gap, a rewind) counts as a resync and adds the groups' keys to the
        key filter, since the missed entries may have created keys.

        Raises Unavailable; the groups stay pending (their old cursors are what is
        saved) and are resynced again on the next round.
        """
        for g in groups:
            self.resync_pending[g] = self.resync_pending.get(g, False) or bool(reason)
        if reason:
            self.stats.resyncs += len(groups)
            self.stats.bump(f"resync_{reason}", len(groups))
            log.warning("resyncing group(s) %s of the L3 feed (%s)", sorted(groups), reason)
        for g in sorted(groups):
            try:
                seq, last_id = self.l3.feed_position(g)
            except CorruptRecord as exc:  # a foreign value under the group's stream key
                self._set_aside(f"feed of group {g}", f"resync: {exc}")
                seq, last_id = None, b"0-0"  # (the first real entry then resyncs it again)
            self.feed_cursors[g], self.feed_seqs[g] = last_id, seq
            if self.resync_pending[g]:  # the missed entries may have created keys
                self._scan_into(self.keys.add, self.l3.scan_group(g))
                self.resync_pending[g] = False
        for key in self.port.held_keys():
            if group_of(key) in groups:
                self._guarded(key, "resync", self._fetch_and_apply, key, True)
        for g in groups:
            del self.resync_pending[g]

    def pull_remote(self, check_seqs: bool = False) -> None:
        """Read every group's feed after its cursor and apply what this host holds.

        ``check_seqs``: first read the groups' counters, to catch a group whose stream
        lost entries that no read returned (a read that returns nothing carries no
        sequence number). Raises Unavailable.
        """
        if self.resync_pending:  # an earlier resync was interrupted
            self._resync(set(self.resync_pending), reason="")  # (keeps whether to scan)
        counters = self.l3.feed_seqs(range(GROUPS)) if check_seqs else {}
        count = 500
        feeds = self.l3.feed_many(self.feed_cursors, count=count)
        gaps: dict[int, str] = {}
        for g, rows in feeds.items():
            if isinstance(rows, CorruptRecord):
                self._guarded(f"feed of group {g}", "feed read", _raise, rows)
                continue
            before = self.feed_seqs.get(g)
            for entry in rows:
                last = self.feed_seqs.get(g)
                if entry.seq is None or last is None or entry.seq != last + 1:
                    gaps[g] = ("unsequenced" if entry.seq is None or last is None
                               else "gap" if entry.seq > last + 1 else "rewind")
                    break
                self._pull_entry(g, entry)
                self.feed_cursors[g], self.feed_seqs[g] = entry.id, entry.seq
            now_seq = counters.get(g)
            if g in gaps or now_seq is None or before is None:
                continue
            if now_seq < before:
                gaps[g] = "rewind"  # the counter went backwards: a failover lost entries
            elif len(rows) < count and (self.feed_seqs[g] or 0) < now_seq:
                gaps[g] = "gap"  # changes counted before this read, and the read missed them
        if gaps:
            for why in sorted(set(gaps.values())):
                self._resync({g for g, w in gaps.items() if w == why}, reason=why)

    def _pull_entry(self, g: int, entry: FeedEntry) -> None:
        """Apply one feed entry (set aside if it fails). Raises Unavailable."""
        if entry.key is None:
            self._set_aside(f"feed entry {entry.id.decode(errors='replace')} of group {g}",
                            entry.problem)
            return
        key = entry.key
        try:
            rec = self.l3.decode(entry.record, key)
        except CorruptRecord as exc:
            self.stats.corrupt += 1
            self._set_aside(key, f"feed: {exc}")
            return
        # our own writes come back too: the merge finds them equal (a no-op), but a
        # record L3 merged from ours and another host's must still be taken
        if not rec.tombstone:
            self.keys.add(key.encode("utf-8"))
        if not self.port.holds(key):
            self.stats.skipped_remote += 1
            self._remember_skipped(key, rec)
            return  # not held here: the next read goes to L3
        if self._guarded(key, "feed", self._apply_or_forget, key, rec):
            self.stats.pulled += 1

    def _apply_or_forget(self, key: str, rec: L3Record) -> bool:
        """Apply a remote record; if this host's L2 can never hold it, drop the host's
        stale copy instead (its reads then go to L3), and still set it aside (counted)."""
        try:
            return self._apply(key, rec)
        except ValueTooLarge:
            if self.port.forget(key):
                self.stats.bump("forgotten")
            raise

    def _remember_skipped(self, key: str, rec: L3Record) -> None:
        """A change to a key this host does not hold, kept a while: an agent that read
        the key from L3 just before it may fill L2 with the older record just after
        (push_local sees that fill, and applies this one over it)."""
        recent = self.recent_remote
        if len(recent) >= RECENT_MAX:
            for k in list(recent)[: RECENT_MAX // 4]:  # the oldest quarter
                del recent[k]
        recent.pop(key, None)
        recent[key] = (time.monotonic(), rec)

    def _save_state(self) -> None:
        """Save the feed cursors and sequence numbers (not those of a pending resync).
        Raises Unavailable."""
        done = [g for g in self.feed_cursors if g not in self.resync_pending]
        self._guarded(f"kvn:{{{self.host}}}:cursors", "saving feed cursors",
                      self.l3.save_cursors, self.host,
                      {g: self.feed_cursors[g] for g in done},
                      {g: s for g in done if (s := self.feed_seqs.get(g)) is not None})

    # ------------------------------------------------------------------ the loop

    def step(self) -> None:
        """One round: heartbeat, local changes to L3, and (every feed_poll) L3's changes.

        Raises Unavailable only from the local half (the remote half backs off by itself)
        and SegmentError when the host's L2 can no longer be used.
        """
        now = time.monotonic()
        self.port.heartbeat()
        self.keys.beat()
        self.push_local(now)
        if now - self.last_pull < self.config.cluster.feed_poll or now < self.pull_at:
            return  # the feed costs GROUPS reads per poll: keep to feed_poll, not window pace
        self.last_pull = now
        try:
            state_due = now >= self.state_at
            self.pull_remote(check_seqs=state_due)
            if state_due:
                self._save_state()
                self.state_at = now + STATE_EVERY
            self._maybe_rotate_filter()
            self._maybe_prewarm()
            self.pull_backoff.succeeded()
        except Unavailable as exc:
            self.pull_at = time.monotonic() + self._l3_failed(self.pull_backoff,
                                                              "reading the L3 feed", exc)

    def _l3_failed(self, backoff: Backoff, what: str, exc: Exception) -> float:
        """Count an L3 failure; returns the delay before the next try. Logged at the 1st,
        2nd, 4th, 8th… failure in a row, so a long outage does not flood the log."""
        self.stats.l3_errors += 1
        delay = backoff.failed()
        if backoff.attempts & (backoff.attempts - 1) == 0:
            log.warning("%s failed (%s); retry %d in %.2fs", what, exc, backoff.attempts, delay)
        return delay

    def run(self, stop: threading.Event) -> None:
        """Step until ``stop`` is set, then flush. A failed round is logged, counted and
        retried with backoff; only SegmentError (the host's L2 or key filter is gone or
        foreign) ends the loop early, raised."""
        poll = self.config.cluster.feed_poll
        backoff = Backoff(self.rng, base=max(poll, 0.01), cap=2.0)
        while not stop.is_set():
            try:
                self.step()
                backoff.succeeded()
            except SegmentError:
                raise
            except Exception as exc:  # never die of one bad round: back off and go on
                if isinstance(exc, Unavailable):
                    self.stats.l3_errors += 1
                    log.warning("%s", exc)
                else:
                    self.stats.step_errors += 1
                    log.exception("a daemon round failed; retrying")
                stop.wait(backoff.failed())
                continue
            deadline = self.window.deadline()
            wait = poll if deadline is None else max(0.0, min(poll, deadline - time.monotonic()))
            stop.wait(wait)
        self.flush()

    def flush(self, timeout: float = 5.0) -> None:
        """Send what is waiting (on shutdown); gives up after ``timeout`` seconds."""
        end = time.monotonic() + timeout
        closed = self.window.flush(time.monotonic())
        if closed is not None:
            self.unsent.append(closed)
        while self.unsent and time.monotonic() < end:
            self._send_unsent()
            if self.unsent:  # failed: wait as the backoff says (retry_at), within the timeout
                time.sleep(max(0.0, min(self.retry_at, end) - time.monotonic()))
        if not self.unsent:
            self.push_local(time.monotonic())
        try:
            self._save_state()
        except Unavailable:
            pass

    def close(self) -> None:
        self.keys.set_ready(False)  # agents stop trusting it now, not in STALE_MS
        self.keys.close()
        self.l3.close()
        self.kv.close()


def _raise(exc: BaseException) -> None:
    raise exc


def _import(path: str) -> Any:
    """``"module:function"`` → the function. Raises ConfigError naming the config entry."""
    import importlib

    module, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except Exception as exc:  # ImportError, AttributeError, or the module's own failure
        raise ConfigError("cluster.resolvers",
                          f"cannot load {path!r} ({type(exc).__name__}: {exc}); give "
                          "\"module:function\" of an importable module") from None
    if not callable(fn):
        raise ConfigError("cluster.resolvers", f"{path!r} is not callable")
    return fn


def main(config: Config, name: str | None = None) -> int:
    """Run until SIGTERM/SIGINT. Returns the exit status.

    Waits (with backoff and jitter) for a cluster that cannot be reached yet; raises
    ConfigError or SegmentError, which the CLI reports, for what waiting cannot fix.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s kvcomm-node %(message)s")
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    rng = random.Random()  # seeded by the OS: hosts that boot together wait differently
    backoff = Backoff(rng, base=0.1, cap=5.0, floor=0.05)
    while True:  # a host may boot before its cluster: agents write into L2 meanwhile
        try:
            daemon = NodeDaemon(config, name, rng=rng)
            break
        except Unavailable as exc:
            delay = backoff.failed()
            log.warning("cannot start yet (%s); retrying in %.1fs", exc, delay)
            if stop.wait(delay):
                return 0
    log.info("host %s, namespace %s, %d seed nodes; %d hot keys prewarmed", daemon.host,
             daemon.kv.name, len(config.cluster.redis), daemon.stats.extra.get("prewarmed", 0))
    try:
        daemon.run(stop)
    finally:
        daemon.close()
    return 0
