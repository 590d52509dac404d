"""Watching: the host's change feed, filtered by prefix, as Events; in cluster mode, every
host's changes under the prefix (the node daemon installs them: node/watched.py) and strong
keys' changes from an etcd watch."""

from __future__ import annotations

import sys
import time
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

from ..errors import InvalidArgument, InvalidKey, KVCommWarning, SegmentError, Unavailable
from ..node.watched import register, unregister
from ..tiers.l2 import KIND_NAMES, KIND_PUT, key_hash
from .counting import Counting
from .items import Event

_ACK_WAIT_S = 5.0  # how long watch() waits for the node daemon to take its prefix


class _Subscription:
    """A cluster-mode watch's ties: its registration with the node daemon, the daemon's
    count of possibly missed changes it last saw, and the etcd watch of strong keys."""

    def __init__(self, path: str, missed: int, etcd_watch: Any, etcd_key: bytes) -> None:
        self.path, self.missed = path, missed
        self.etcd_watch, self.etcd_key = etcd_watch, etcd_key

    def close(self) -> None:
        unregister(self.path)
        if self.etcd_watch is not None:
            self.etcd_watch.close()
            self.etcd_watch = None


class WatchFeed:
    """One watch's position in the host's feed and its cluster ties: :meth:`step` returns
    the events under the prefix since the last step. Both faces drive it (the sync
    iterator, kvcomm.aio's async one): the rule of what a watcher sees is written once."""

    def __init__(self, client: Watching, prefix: str, cursor: int,
                 sub: _Subscription | None) -> None:
        self.client, self.prefix, self.cursor, self.sub = client, prefix, cursor, sub

    def step(self) -> list[Event]:
        """The events since the last step (an ``overflow`` first if the feed overflowed),
        lock-free; in cluster mode the daemon's missed-change count and the etcd watch's
        events after them. Raises SegmentError (the namespace was purged)."""
        c = self.client
        if c._seg.purged:
            raise SegmentError(f"namespace {c.name!r} was purged while watched; "
                               "open it again and watch anew")
        events, self.cursor, overflowed = c._feed_events(self.prefix, self.cursor)
        out = [Event("", "overflow", None), *events] if overflowed else events
        if self.sub is not None:
            out.extend(c._cluster_events(self.sub))
        return out

    def close(self) -> None:
        """Unregister from the node daemon and close the etcd watch (cluster mode)."""
        if self.sub is not None:
            self.sub.close()


class Watching(Counting):
    """Watching."""

    def watch(self, prefix: str = "", *, timeout: float | None = None) -> Iterator[Event]:
        """Changes under ``prefix`` from now on, in per-key order, each with its full
        Version (the version of the write). In cluster mode, another host's write that
        was already replaced by the time the watcher reads it is coalesced into the
        change that replaced it (whose event follows), as the write window already
        coalesces a host's writes; this host's own write already replaced carries what
        L2's feed keeps of it: this host's entry and its HLC.

        Kinds: ``put``, ``delete``, ``expire`` (the key reached its deadline, seen by this
        host's sweep or a read of it: see ``put(ttl=)``), ``evict`` (L2 dropped the key to
        make room: in embedded mode it is gone, in cluster mode L3 still has it) and
        ``overflow``. In cluster mode
        the watch sees the changes made on every host: the host's node daemon learns the
        prefix and installs every change under it into this host's L2 (so the host holds
        the watched keys); this call returns once the daemon has taken the prefix (at
        most 5 s; a host whose daemon is not running gets the changes once it runs).
        Strong keys under the prefix come from an etcd watch (resumed at the last
        revision + 1 across member failures). With ``timeout``, iteration ends after
        that many seconds without an event; it also ends when the client is closed (from
        another thread, say: the way to stop a watch that has no timeout). A watcher that falls a whole feed
        (``cache.watch_buffer`` events) behind (in L2's feed, or in the etcd watch of
        strong keys), or whose daemon may have missed cluster changes (a gap in a group's
        feed), or whose etcd watch was compacted, receives
        one ``overflow`` event and continues from the newest: it should rescan what it
        tracks with :meth:`scan`. Writers are never slowed by a watcher. Raises
        InvalidKey, InvalidArgument; SegmentError (cluster mode) when the prefix cannot
        be registered with the daemon. Warns (KVCommWarning) when iterated on a thread
        that runs an asyncio event loop: waiting there for events stops its every task
        (``kvcomm.aio`` has the watch for it).
        """
        feed = self._watch_start(prefix, timeout)
        gen = self._watch(feed, timeout)
        if feed.sub is not None:  # (a watch dropped unstarted runs no finally: unregister then)
            weakref.finalize(gen, feed.close)
        return gen

    def _watch_start(self, prefix: Any, timeout: Any, subscribe: bool = True) -> WatchFeed:
        """Check watch()'s arguments and start a watch from now (in cluster mode, with
        ``subscribe``: waits for the node daemon to take the prefix, see
        :meth:`_subscribe`; kvcomm.aio subscribes off its loop). Raises as watch()."""
        if type(prefix) is not str:
            raise InvalidKey("a watch prefix is a str ('' watches every key)")
        try:
            prefix.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidKey(f"the watch prefix {prefix!r} is not valid UTF-8 (a lone "
                             "surrogate?): no key starts with it") from None
        if timeout is not None and (type(timeout) not in (int, float) or not timeout >= 0
                                    or timeout != timeout):
            raise InvalidArgument(f"timeout must be a number of seconds >= 0, got {timeout!r}")
        self._live()
        cursor = self._seg.feed_head()  # "from now": cursor taken here
        sub = self._subscribe(prefix) if self._cluster and subscribe else None
        return WatchFeed(self, prefix, cursor, sub)

    def _daemon_status(self) -> dict[str, Any] | None:
        from ..node.presence import read_status, status_fresh
        from ..tiers.shm.files import status_path

        s = read_status(status_path(self.name, self.config.cache.l2_dir))
        return s if status_fresh(s) else None

    def _subscribe(self, prefix: str) -> _Subscription:
        """Register ``prefix`` with the host's node daemon and wait (at most _ACK_WAIT_S)
        until it applies it; open the etcd watch of the strong keys under it."""
        c = self.config.cache
        try:
            path, mtime = register(self.name, c.l2_dir, prefix, c.l2_permissions)
        except OSError as exc:
            raise SegmentError(f"cannot register the watch of {prefix!r} with the node daemon "
                               f"in {c.l2_dir} ({exc.strerror}); check that directory") from None
        # (numbers read from the status file, another process's: anything else is no answer)
        status = self._daemon_status()
        applied = _number(status.get("watch_applied")) if status is not None else None
        deadline = time.monotonic() + _ACK_WAIT_S
        while applied is not None and applied < mtime and time.monotonic() < deadline:
            time.sleep(0.005)
            status = self._daemon_status()
            applied = _number(status.get("watch_applied")) if status is not None else None
        missed = (_number(status.get("watch_missed")) or 0) if status is not None else 0
        etcd_watch, key = None, b""
        if self._strong is not None and self._strong_on and self._strong_possible(prefix):
            from .strong import KEY_PREFIX

            key = KEY_PREFIX + prefix.encode("utf-8")
            etcd_watch = self._strong.etcd.watch(key, prefix=True,
                                                 max_pending=self.config.cache.watch_buffer)
            etcd_watch.created.wait(2 * self._strong.timeout)
        return _Subscription(path, missed, etcd_watch, key)

    def _strong_possible(self, prefix: str) -> bool:
        st = self._strong
        return bool(st._default_strong or any(p.startswith(prefix) or prefix.startswith(p)
                                              for p in st._prefixes))

    def _watch(self, feed: WatchFeed, timeout: float | None) -> Iterator[Event]:
        """The sync face of a watch: rounds of :meth:`WatchFeed.step`, sleeping between
        empty ones (0.1 ms, doubling up to 5 ms). kvcomm.aio drives the same steps and
        awaits the feed's bell instead."""
        aio = sys.modules.get("asyncio")  # (no loop runs in a process that never imported it)
        if aio is not None and aio._get_running_loop() is not None:
            warnings.warn("kv.watch() of the sync client waits for events on this thread, which "
                          "runs an asyncio event loop: every other task stops while it waits; "
                          "use kvcomm.aio.open() and `async for event in kv.watch(...)`",
                          KVCommWarning, stacklevel=2)
        last_event = time.monotonic()
        idle = 0.0001
        try:
            while not self._closed:
                events = feed.step()
                if events:
                    yield from events
                    last_event = time.monotonic()
                    idle = 0.0001
                    continue
                if timeout is not None and time.monotonic() - last_event >= timeout:
                    return
                time.sleep(idle)
                idle = min(idle * 2, 0.005)
        finally:
            feed.close()

    def _feed_events(self, prefix: str, cursor: int,
                     limit: int = 1 << 30) -> tuple[list[Event], int, bool]:
        """The changes under ``prefix`` in the host's feed after sequence number
        ``cursor`` (at most ``limit`` feed entries looked at): ``(events, the cursor after
        them, overflowed)``; overflowed: entries after ``cursor`` were overwritten unread
        (the cursor then is the feed's head). What :meth:`watch` reads, one page at a time."""
        seg = self._seg
        full = self._cluster  # (embedded: the feed's own entry is the whole version)
        events, cursor, overflowed = seg.feed_read(cursor, limit)
        out: list[Event] = []
        for ev in events:
            if ev.key.startswith(prefix):
                version = None
                if full:
                    kb = ev.key.encode("utf-8", "surrogateescape")
                    v = seg.version(kb, key_hash(kb))
                    if v is not None and v[3] == ev.counter and v[4] == ev.hlc:
                        version = self._version(v[3], v[4], v[5])
                if (version is None and full and not ev.counter
                        and ev.kind == KIND_PUT):
                    # another host's put replaced since: its full version is gone,
                    # and the change that replaced it (a put, delete, evict or
                    # expire) follows in this feed, or an overflow does: coalesced
                    # into it, as the cluster already coalesces a window's writes
                    continue
                if version is None:  # (this host's write replaced since: what the
                    # feed knows, this host's entry and the HLC)
                    version = self._version(ev.counter, ev.hlc, b"")
                out.append(Event(ev.key, KIND_NAMES[ev.kind], version))
        return out, cursor, overflowed

    def _cluster_events(self, sub: _Subscription) -> list[Event]:
        """An overflow when the daemon may have missed changes since the last look; the
        etcd watch's events (an overflow when it was compacted: watched anew from now)."""
        from ..tiers.etcd import WatchCompacted, WatchOverflowed
        from .strong import KEY_PREFIX, strong_version

        out: list[Event] = []
        status = self._host_status().status()
        missed = _number(status.get("watch_missed")) if status is not None else None
        if missed is not None and missed > sub.missed:
            sub.missed = missed
            out.append(Event("", "overflow", None))
        w = sub.etcd_watch
        if w is not None:
            try:
                for e in w.next(timeout=0):
                    key = e.kv.key[len(KEY_PREFIX):].decode("utf-8", "surrogateescape")
                    out.append(Event(key, e.type, strong_version(e.kv.mod_revision)))
            except WatchOverflowed:  # (a slow watcher: the events after it follow)
                out.append(Event("", "overflow", None))
            except WatchCompacted:
                w.close()
                sub.etcd_watch = self._strong.etcd.watch(
                    sub.etcd_key, prefix=True, max_pending=self.config.cache.watch_buffer)
                out.append(Event("", "overflow", None))
            except Unavailable:
                pass  # closed under us (the client is closing)
        return out


def _number(v: Any) -> int | None:
    """``v`` if it is an integer (not a bool), else None: a number of the status file."""
    return v if isinstance(v, int) and not isinstance(v, bool) else None
