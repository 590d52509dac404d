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
   read path. If a group's feed was trimmed past the
   cursor, the keys of that group that L2 holds are re-read from L3 (a resync).
3. **Prewarm.** Every couple of seconds the host's hot keys (the host-wide sketch of
   agents' reads) are saved to L3 and any of them missing from L2 (evicted, say) are
   read back in; a daemon that starts prewarms L2 from the list its predecessor saved.
4. **The host's filter of existing keys** (:mod:`kvcomm.tiers.keyfilter`): built from a
   scan of L3 at start, fed with every key seen in the feeds, rotated now and then so
   deleted keys age out. Agents ask it before an L3 read: absent keys stay on the host.
5. **Heartbeat** in the L2 header, so agents and tools can see the daemon is alive.

When L3 is unreachable, nothing is dropped: the unsent window is kept and retried with
exponential backoff, agents keep writing into L2, and once ``cluster.outbound_max``
writes are waiting, ``put`` raises ``Unavailable`` instead of losing them.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .._client import Client
from .._client import open as kv_open
from ..config import Config
from ..core import codec
from ..core.versions import Version
from ..core.window import Batch, WriteWindow
from ..errors import KVCommError, Unavailable
from ..tiers.keyfilter import KeyFilter
from ..tiers.l2 import KIND_DELETE, KIND_PUT, TAG_TOMBSTONE, key_hash
from ..tiers.l3 import GROUPS, CorruptRecord, L3Record, L3Store, group_of

log = logging.getLogger("kvcomm.node")
HOT_KEYS = 64  # hot keys saved and kept in L2 per host


@dataclass
class DaemonStats:
    pushed: int = 0  # records sent to L3
    windows: int = 0
    accepted: int = 0  # new / newer / equal
    refreshed: int = 0  # older / merged: L3's record written back into L2
    pulled: int = 0  # remote changes merged into L2
    skipped_remote: int = 0  # remote changes to keys this host does not hold
    corrupt: int = 0
    l3_errors: int = 0
    resyncs: int = 0
    feed_overflows: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class NodeDaemon:
    """One host's sync loop. ``step()`` does one round; ``run()`` loops until stopped."""

    def __init__(self, config: Config, name: str | None = None) -> None:
        if not config.cluster.enabled:
            raise KVCommError("kvcomm node needs cluster.redis (the Redis Cluster seed nodes)")
        self.config = config
        seeds = config.cluster.seeds()  # validate before touching the host's L2
        self.kv: Client = kv_open(name, config=config)
        try:
            self.seg = self.kv._seg
            self.host = self.seg.host_id
            cl = config.cluster
            self.l3 = L3Store(seeds, username=cl.redis_username, password=cl.redis_password,
                              tls=cl.redis_tls, timeout=cl.timeout, feed_maxlen=cl.feed_maxlen,
                              wait_replicas=cl.wait_replicas, wait_ms=int(cl.wait_timeout * 1000))
            c = config.cache
            self.window = WriteWindow(c.l2_sync_interval, c.max_batch_ops, c.max_batch_bytes)
            self.staged: dict[str, L3Record] = {}
            self.cursor = self.seg.sync_cursor  # local feed: everything before it is in L3
            self.stats = DaemonStats()
            self.unsent: list[Batch] = []
            self.backoff = 0.0
            self.retry_at = 0.0
            self.feed_cursors = self._initial_feed_cursors()
            self.cursors_saved = time.monotonic()
            self.last_pull = 0.0
            for prefix, path in cl.resolvers.items():  # the operator's own code, named in config
                self.kv.register_resolver(prefix, _import(path))
            self.keys = KeyFilter(self.kv.name, c.bloom_capacity, c.bloom_fpr, create=True,
                                  permissions=c.l2_permissions)
            self.rebuild_every = cl.key_filter_rebuild
            self._fill_key_filter(initial=True)
            self.hot_saved = time.monotonic()
            self.stats.extra["prewarmed"] = self._prewarm(self.l3.load_hot(self.host))
        except BaseException:  # L3 unreachable at start, say: release what we opened
            if getattr(self, "keys", None) is not None:
                self.keys.close()
            if getattr(self, "l3", None) is not None:
                self.l3.close()
            self.kv.close()
            raise

    # ------------------------------------------------------------------ local → L3

    def _stage_put(self, key: str, now: float) -> None:
        """Stage the key's record if it is dirty: a put, or a delete's tombstone (which
        carries the vector of the value it deleted, so it supersedes it in L3)."""
        kb = key.encode("utf-8", "surrogatepass")
        rec = self.seg.read(kb, key_hash(kb))
        if rec is None or not self.seg.is_dirty(rec.word):
            return  # evicted (clean), or not an agent's write (already in L3)
        version = self.kv._version(rec.counter, rec.hlc, rec.vvx)
        if rec.tag == TAG_TOMBSTONE:
            record = L3Record(rec.hlc, True, 0, b"", b"", version.vector, (self.host, rec.counter))
        else:
            value = rec.value or b""  # read() copies every value unless asked for views
            self.keys.add(kb)
            record = L3Record(rec.hlc, False, rec.tag, rec.meta, value, version.vector,
                              (self.host, rec.counter))
        self._stage(key, record, now)

    def _stage(self, key: str, record: L3Record, now: float) -> None:
        self.staged[key] = record
        size_hint = None if record.tombstone else record.value
        closed = self.window.add(key, size_hint, record.vector, record.hlc, now)
        if closed is not None:
            self.unsent.append(closed)

    def push_local(self, now: float) -> None:
        events, cursor, overflowed = self.seg.feed_read(self.cursor)
        if overflowed:
            self.stats.feed_overflows += 1
            for kb in self.seg.dirty_keys():
                self._stage_put(kb.decode("utf-8", "surrogatepass"), now)
        for ev in events:
            if ev.kind in (KIND_PUT, KIND_DELETE):  # (evictions are local: never sent)
                self._stage_put(ev.key, now)
        self.cursor = cursor
        closed = self.window.poll(now)
        if closed is not None:
            self.unsent.append(closed)
        if now >= self.retry_at:
            self._send_unsent()
        if not self.unsent and not len(self.window):
            self.seg.sync_cursor = self.cursor  # everything before it is in L3

    def _send_unsent(self) -> None:
        while self.unsent:
            batch = self.unsent[0]
            items = [(w.key, self.staged[w.key]) for w in batch.writes if w.key in self.staged]
            try:
                results = self._merge(items)
            except Unavailable as exc:
                self.stats.l3_errors += 1
                if self.backoff < 2.0:  # log while backing off, then once per 2 s plateau
                    log.warning("L3 unavailable (%s); retrying in %.2fs", exc,
                                min(2.0, max(0.05, self.backoff * 2)))
                self.backoff = min(2.0, max(0.05, self.backoff * 2))
                self.retry_at = time.monotonic() + self.backoff
                return
            self.backoff = 0.0
            self.unsent.pop(0)
            self.stats.windows += 1
            for (key, sent), res in zip(items, results, strict=True):
                if self.staged.get(key) is sent:
                    del self.staged[key]
                self.stats.pushed += 1
                if isinstance(res, CorruptRecord):
                    self.stats.corrupt += 1
                    log.error("%s", res)
                    self._mark_clean(key, sent)  # reported; retrying cannot help
                elif not res.durable:  # no replica has it yet: send again next window
                    self.stats.extra["not_durable"] = self.stats.extra.get("not_durable", 0) + 1
                    if key not in self.staged:  # (a newer staged write descends from it anyway)
                        self._stage(key, sent, time.monotonic())
                elif res.outcome in ("new", "newer", "equal"):
                    self.stats.accepted += 1
                    self._mark_clean(key, sent)
                elif res.outcome == "conflict":  # a resolver's prefix: settle it here
                    self.stats.extra["resolved"] = self.stats.extra.get("resolved", 0) + 1
                    self._apply(key, res.record)  # concurrent → resolver → a new dirty write
                else:  # older / merged: L3 holds another record; take it
                    self.stats.refreshed += 1
                    self._apply(key, res.record)

    def _merge(self, items: list[tuple[str, L3Record]]) -> list[Any]:
        """Merge into L3; keys with a resolver keep concurrent versions apart (``conflict``)."""
        resolvers = self.kv._resolvers
        if not resolvers:
            return self.l3.merge_many(items)
        # deletes always merge last-writer-wins (with merged vectors): a resolver settles
        # concurrent values, and must not bring a deleted key back
        with_hook = [i for i, (k, r) in enumerate(items)
                     if not r.tombstone and resolvers.lookup(k) is not None]
        if not with_hook:
            return self.l3.merge_many(items)
        hooked = set(with_hook)
        plain_idx = [i for i in range(len(items)) if i not in hooked]
        out: list[Any] = [None] * len(items)
        for idxs, siblings in ((plain_idx, False), (with_hook, True)):
            if idxs:
                res = self.l3.merge_many([items[i] for i in idxs], keep_siblings=siblings)
                for i, r in zip(idxs, res, strict=True):
                    out[i] = r
        return out

    def _mark_clean(self, key: str, sent: L3Record) -> None:
        kb = key.encode("utf-8", "surrogatepass")
        self.seg.mark_clean(kb, key_hash(kb), sent.dot[1], sent.hlc)

    def _apply(self, key: str, record: L3Record) -> None:
        """Write an L3 record into L2 (clean), unless L2 already holds something newer."""
        version = Version(record.vector, record.hlc)
        if record.tombstone:  # kept as a clean tombstone; merges last-writer-wins
            self.kv._merge(key, None, version, (TAG_TOMBSTONE, b"", b""))
            return
        try:
            value = codec.decode(record.tag, record.meta, record.value)
        except (ValueError, TypeError) as exc:
            self.stats.corrupt += 1
            log.error("L3 record of %r cannot be decoded: %s", key, exc)
            return
        self.kv._merge(key, value, version, (record.tag, record.meta, record.value))

    # ------------------------------------------------------------------ the key filter

    def _fill_key_filter(self, initial: bool = False) -> None:
        """Initial fill (both generations) or a rotation (the older one, refilled)."""
        if initial:
            self.keys.set_ready(False)
            for kb in self.l3.scan_keys():
                self.keys.add(kb)
            self.keys.set_ready(True)
        else:
            target = self.keys.begin_rotation()
            for kb in self.l3.scan_keys():
                target.add(kb)
            self.keys.end_rotation()
            self.stats.extra["key_filter_rotations"] = self.stats.extra.get(
                "key_filter_rotations", 0) + 1
        self.filter_built = time.monotonic()

    def _maybe_rotate_filter(self) -> None:
        if (time.monotonic() - self.filter_built > self.rebuild_every
                or self.keys.adds_since_rotation >= self.config.cache.bloom_capacity):
            self._fill_key_filter()

    # ------------------------------------------------------------------ prewarm

    def _prewarm(self, keys: list[str]) -> int:
        """Read into L2 the keys of ``keys`` it does not hold; returns how many came in."""
        n = 0
        for key in keys:
            kb = key.encode("utf-8", "surrogatepass")
            if self.seg.read(kb, key_hash(kb), 0) is not None:
                continue
            rec = self.l3.get(key)
            if rec is not None and not rec.tombstone:
                self._apply(key, rec)
                n += 1
        return n

    def _maybe_prewarm(self) -> None:
        if time.monotonic() - self.hot_saved < 2.0:
            return
        self.hot_saved = time.monotonic()
        hot = [k for k, _ in self.kv.hot_keys(HOT_KEYS)]
        if hot:
            self.l3.save_hot(self.host, hot)
            self.stats.extra["prewarmed"] = self.stats.extra.get("prewarmed", 0) + self._prewarm(hot)

    # ------------------------------------------------------------------ L3 → local

    def _initial_feed_cursors(self) -> dict[int, bytes]:
        saved = self.l3.load_cursors(self.host)
        cursors: dict[int, bytes] = {}
        for g in range(GROUPS):
            first, last = self.l3.feed_bounds(g)
            if g not in saved:
                cursors[g] = last  # a new host needs no history: the read path has L3
            else:
                cursors[g] = saved[g]
                # behind, and the entry after our cursor is no longer kept: it was trimmed
                if _id_lt(saved[g], last) and (first is None or _id_lt(saved[g], first)):
                    self._resync_group(g)
        return cursors

    def _resync_group(self, group: int) -> None:
        self.stats.resyncs += 1
        for key in self.kv.keys():
            if group_of(key) == group:
                rec = self.l3.get(key)
                if rec is not None:
                    self._apply(key, rec)

    def pull_remote(self) -> None:
        feeds = self.l3.feed_many(self.feed_cursors)
        for g, rows in feeds.items():
            for eid, key, raw in rows:
                self.feed_cursors[g] = eid
                try:
                    rec = L3Record.decode(raw)
                except CorruptRecord:
                    self.stats.corrupt += 1
                    continue
                # our own writes come back too: the merge finds them equal (a no-op), but a
                # record L3 merged from ours and another host's must still be taken
                kb = key.encode("utf-8", "surrogatepass")
                if not rec.tombstone:
                    self.keys.add(kb)
                if self.seg.read(kb, key_hash(kb), 0) is None:
                    self.stats.skipped_remote += 1
                    continue  # not held here: the next read goes to L3
                self.stats.pulled += 1
                self._apply(key, rec)
        if time.monotonic() - self.cursors_saved > 1.0:
            self.l3.save_cursors(self.host, self.feed_cursors)
            self.cursors_saved = time.monotonic()

    # ------------------------------------------------------------------ the loop

    def step(self) -> None:
        now = time.monotonic()
        self.seg.daemon_heartbeat(os.getpid())
        self.push_local(now)
        if now - self.last_pull < self.config.cluster.feed_poll:
            return  # the feed costs GROUPS reads per poll: keep to feed_poll, not window pace
        self.last_pull = now
        try:
            self.pull_remote()
            self._maybe_rotate_filter()
            self._maybe_prewarm()
        except Unavailable as exc:
            self.stats.l3_errors += 1
            log.warning("reading the L3 feed failed: %s", exc)

    def run(self, stop: threading.Event) -> None:
        poll = self.config.cluster.feed_poll
        while not stop.is_set():
            try:
                self.step()
            except Unavailable as exc:
                self.stats.l3_errors += 1
                log.warning("%s", exc)
                stop.wait(min(2.0, max(poll, self.backoff)))
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
            self.retry_at = 0.0
            self._send_unsent()
            if self.unsent:
                time.sleep(0.05)
        if not self.unsent:
            self.push_local(time.monotonic())
        try:
            self.l3.save_cursors(self.host, self.feed_cursors)
        except Unavailable:
            pass

    def close(self) -> None:
        self.keys.close()
        self.l3.close()
        self.kv.close()


def _import(path: str) -> Any:
    """``"module:function"`` → the function. Raises KVCommError naming the config entry."""
    import importlib

    module, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise KVCommError(f"cluster.resolvers: cannot load {path!r}: {exc}") from None
    if not callable(fn):
        raise KVCommError(f"cluster.resolvers: {path!r} is not callable")
    return fn


def _id_lt(a: bytes, b: bytes) -> bool:
    ams, _, aseq = a.partition(b"-")
    bms, _, bseq = b.partition(b"-")
    return (int(ams), int(aseq or 0)) < (int(bms), int(bseq or 0))


def main(config: Config, name: str | None = None) -> int:
    """Run until SIGTERM/SIGINT. Returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s kvcomm-node %(message)s")
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    backoff = 0.1
    while True:  # a host may boot before its cluster: agents write into L2 meanwhile
        try:
            daemon = NodeDaemon(config, name)
            break
        except Unavailable as exc:
            log.warning("cannot start yet (%s); retrying in %.1fs", exc, backoff)
            if stop.wait(backoff):
                return 0
            backoff = min(5.0, backoff * 2)
    log.info("host %s, namespace %s, %d seed nodes", daemon.host, daemon.kv.name,
             len(config.cluster.redis))
    try:
        daemon.run(stop)
    finally:
        daemon.close()
    return 0
