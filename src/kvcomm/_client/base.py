"""The client's state and the primitives every layer uses: keys, versions, codec, L2 reads."""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from .._l2core import KEY_MEMO, Getter, WouldBlock, inline_wait, key_of
from ..config import Config
from ..core import codec
from ..core.expiry import ExtCache
from ..core.negative import NegativeCache
from ..core.resolve import PrefixTable
from ..core.versions import Version, decode_others
from ..errors import (
    InvalidArgument,
    InvalidKey,
    KVCommError,
    KVCommWarning,
    SegmentError,
    ValueTooLarge,
)
from ..placement.agents import check_agent, process_agent, with_agent
from ..placement.report import REPORT_PUTS, AgentStats
from ..tiers import l2 as l2mod
from ..tiers.l1 import process_budget
from ..tiers.l2 import TAG_TOMBSTONE, Record, key_hash
from ..tiers.shm.counters import Histogram
from ..tiers.shm.layout import MAX_KEY
from .attach import _CLIENTS, _Shared
from .items import Item

_new_version = tuple.__new__  # skips NamedTuple's Python-level __new__
_BYTES, _NDARRAY = codec.BYTES, codec.NDARRAY
_CONSISTENCY = (None, "eventual", "strong")
_KEY_MEMO = KEY_MEMO  # validated keys remembered per client (cleared when full; 65536: the
# batch's C kernel memoises new keys as _key_hash does)
# An L3 read fills L2 only if it took less than this: the node daemon applies a remote
# change of a key not held here over a fill for 30 s (node/daemon.py RECENT_S)
_FILL_WITHIN = 10.0
_HUGE = 1 << 62  # a zero-copy threshold no value reaches: always a copy
_NEVER = 1 << 62  # (ms: never reached)
DAEMON_CHECK_MS = 1000  # a cluster-mode write asks whether the node daemon beats this often


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class NetworkWait(WouldBlock):
    """The WouldBlock of a call about to leave the host (_network); a plain WouldBlock is
    the C kernel's, a held writer lock (kvcomm.aio tells the two apart)."""


def _network(where: str) -> None:
    """Called just before a call leaves the host (``where``: "L3", "etcd"), with nothing
    done yet. On an event loop's thread (kvcomm.aio's inline attempt: an inline budget is
    set, see ``_l2core.set_inline_wait``) raise WouldBlock: the call runs again, whole, in
    a thread. Elsewhere nothing."""
    if inline_wait() >= 0:
        raise NetworkWait(f"{where} is a network round trip")


def _file_of(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _purged_test(seg: Any) -> Callable[[], bool]:
    """Whether ``seg``'s namespace was purged: the segment says so, or its file is gone
    or another (a purge that could not mark it: a lock held by a stopped process)."""
    mine = _file_of(seg.path)

    def purged() -> bool:
        return bool(seg.purged) or _file_of(seg.path) != mine

    return purged


class ClientBase:
    """What every layer stands on: the state of a client (made here) and its primitives."""

    _getter: Getter  # made by Client.__init__ (it calls later layers)
    _batch_ops: tuple[Any, ...]  # made by Client.__init__: BatchOps's arguments (Batch)

    def __init__(self, name: str = "default", config: Config | None = None,
                 agent: str | None = None, wait_daemon: bool = True,
                 _config_file: str | None = None) -> None:
        if agent is not None:
            check_agent(agent)  # (before anything is opened)
        self.config = config or Config()
        self.name = name
        c = self.config.cache
        self._attached = _Shared.acquire(name, self.config)
        self._seg = self._attached.seg
        self._core_read = self._seg._core.read
        self._q = self._seg._q
        self._host = self._seg.host_id
        self._l1 = self._attached.l1
        self._l1_on = c.l1_size > 0
        process_budget().register(c.l1_size)
        self._l1_entries = self._l1.entries if self._l1_on else {}
        # (the segment's: a namespace that exists with another config's is used as it is,
        # as open warns; its keys all within it, readable by every client)
        self._max_key = self._seg.layout.max_key
        self._max_value = c.max_value_size  # (L2 refuses what its largest block cannot hold)
        self._zc = self.config.network.zero_copy_threshold
        self._default_consistency = c.l3_consistency
        self._validators: PrefixTable[Callable[[str, Item | None, Any], None]] = PrefixTable()
        self._resolvers: PrefixTable[Callable[[str, list[Item]], Any]] = PrefixTable()
        self._sample_every = c.hot_key_sample
        cluster = self.config.cluster
        self._cluster = cluster.enabled  # writes are dirty (await L3); deletes are tombstones
        self._max_dirty = cluster.outbound_max if self._cluster else 0
        self._dirty_flag = l2mod.FLAG_DIRTY if self._cluster else 0
        self._lock_timeout = float(c.lock_timeout)
        self._core_put = self._seg._core.put
        self._core_step = self._seg._core.put_step  # (put_records)
        self._has_validators = False
        self._l3: Any = None  # the L3 adapter, opened on the first L2 miss
        self._l3_opening: Any = None  # its open in flight (a Future: cluster_read._open_l3)
        self._kf: Any = None  # the daemon's filter of existing keys
        self._kf_retry = 0.0
        self._negative = NegativeCache(c.negative_ttl, c.negative_max_entries)
        self._closed = False
        self._forked = False
        self._unusable = False  # closed, or inherited through fork(): every call checks this
        _CLIENTS.add(self)
        self.counters = dict.fromkeys(
            ("deletes", "conflicts", "views", "merges", "resolver_failures",
             "l3_reads", "negative_hits", "filter_hits", "negative_rechecks",
             "l2_absent", "l3_hits", "l3_absent", "puts_strong", "batches", "updates",
             "lost_dots"), 0
        )
        self._keys: dict[str, tuple[bytes, int]] = {}  # validated keys (the getter reads it)
        self._l1_hits = 0  # (get_item's; get's are counted by the getter)
        self._l2_hits = 0
        self._l2_misses = 0
        self._puts = 0
        self._stepped: Version | None = None  # (batch.put_records: the last Version it made)
        self._hot_pending: dict[str, int] = {}  # sampled reads the sketch has not got yet
        self._hot_lock = threading.Lock()  # (for _hot_pending)
        self._host_vec = ((self._host, 0),)
        # sampled latency of the Python paths (the getter times L1/L2 hits itself): one
        # call in latency_sample of put, delete, update, batch and a slow get is timed
        self._lat_every = self.config.metrics.latency_sample
        # (when off: never reaches 0. Threads count down at once, so an operation tests
        # ``<= 0``: one may step over 0, and a test of ``== 0`` would then never time again)
        self._lat_left = self._lat_every or 1 << 62
        self._lat: dict[tuple[str, str], Histogram] = {}
        self._default_strong = c.l3_consistency == "strong"
        # placement: who this agent is (every local write carries it in the record's
        # extension field, packed once here) and what it observes (placement/report.py)
        self.agent = agent if agent is not None else process_agent(os.getpid(), self._host)
        self.agent_named = agent is not None
        self._ext = with_agent(b"", self.agent)
        self._extc = ExtCache(self._ext)  # the field of a write with a deadline (core/expiry.py)
        self._observer = None if self._sample_every <= 0 else AgentStats(
            self.agent, self._host, name, c.l2_dir, c.l2_permissions,
            purged=_purged_test(self._seg))
        self._report_at = REPORT_PUTS if self._observer is not None else 1 << 62
        self._obs_lock = threading.Lock()  # (the observer's edges, between threads' flushes)
        self._strong: Any = None  # StrongStore: cluster mode with cluster.etcd (_client/strong.py)
        self._strong_on = False  # some keys are strong: every operation asks is_strong
        self._strong_unknown = False  # (no daemon status seen yet: _check_no_strong_keys)
        self._status_reader: Any = None  # the node daemon's status file (partition mode)
        # cluster mode: open() waits for the host's node daemon (cluster.daemon_wait), and
        # a write finds out, at most every DAEMON_CHECK_MS, whether it still heartbeats
        # (one KVCommWarning when it stopped). wait_daemon=False: a tool, or the daemon's
        # own client, that works without one: neither
        self._daemon_watch = self._cluster and wait_daemon
        # (wall-clock ms, which put reads anyway: a clock set back delays the next look
        # by as much)
        self._daemon_check_ms = 0 if self._daemon_watch else _NEVER
        self._daemon_command = self._daemon_cmd(_config_file)
        # a beat this old still counts: a round of a loop cut off from Redis (and without
        # etcd, whose lease thread keeps the status file fresh) may wait 2 x cluster.timeout
        self._beat_within_ms = int(max(2.0, 2 * cluster.timeout + 1.0) * 1000)
        if self._cluster and (cluster.etcd or c.strong_prefixes or c.l3_consistency == "strong"):
            self._open_strong()  # (a ConfigError comes before any wait)
            if self._daemon_watch:
                self._await_daemon(cluster.daemon_wait)
        elif self._cluster:
            if self._daemon_watch:  # (first: the daemon's status then says which keys are strong)
                self._await_daemon(cluster.daemon_wait)
            self._check_no_strong_keys()

    def _daemon_beats(self) -> bool:
        """Whether the host's node daemon of this namespace is alive: it heartbeats in L2
        (every round of its loop; within 2 x cluster.timeout + 1 s, at least 2 s), or its
        status file is fresh (its lease thread writes it while the loop waits on Redis
        timeouts, in partition mode)."""
        return (self._seg.daemon_alive(self._beat_within_ms)
                or self._host_status().status() is not None)

    def _daemon_silence(self) -> str:
        """When the last daemon heartbeat, for a message."""
        beat_ms = self._seg.daemon_last_beat_ms()
        if not beat_ms:
            return "none has run on this namespace"
        ago = max(0.0, time.time() - beat_ms / 1000)
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(beat_ms / 1000))
        return f"the last one, pid {self._seg.daemon_pid}, last heartbeat at {at}, {ago:.1f}s ago"

    def _daemon_starting(self) -> str:
        """What a node daemon of this namespace that cannot start yet says (its pid, why,
        since when), for a message; "" when none says so lately."""
        from ..node.presence import starting_status, starting_text
        from ..tiers.shm.files import status_path

        st = starting_status(status_path(self.name, self.config.cache.l2_dir))
        return "" if st is None else starting_text(st)

    def _daemon_cmd(self, config_file: str | None) -> str:
        """The command that starts this namespace's node daemon, for a message."""
        name = "" if self.name == self.config.node.namespace else f" --name {self.name}"
        return f"kvcomm node --config {config_file or 'FILE'}{name}"

    def _await_daemon(self, wait: float) -> None:
        """Wait up to ``wait`` seconds for the host's node daemon to heartbeat. Raises
        Unavailable naming the command that starts it (the client is then closed)."""
        from .._wait import wait_until
        from ..errors import Unavailable

        try:
            wait_until(self._daemon_beats, wait, "the node daemon", interval=0.02)
        except Unavailable:
            starting = self._daemon_starting()
            if starting:
                msg = (f"the node daemon of namespace {self.name!r} on host {self._host!r} "
                       f"runs but has not started (waited {wait:g}s, cluster.daemon_wait): "
                       f"{starting}. Check cluster.redis and that the cluster is up; it "
                       "starts by itself once it can reach it (a tool that works without "
                       "it opens with kvcomm.open(..., wait_daemon=False))")
            else:
                msg = (f"no node daemon heartbeats for namespace {self.name!r} on host "
                       f"{self._host!r} (waited {wait:g}s, cluster.daemon_wait; "
                       f"{self._daemon_silence()}): without it this host's writes never "
                       f"reach L3 and no other host sees them. Start it: "
                       f"`{self._daemon_command}` (a tool that works without one opens "
                       "with kvcomm.open(..., wait_daemon=False))")
            self._refuse_open()
            raise Unavailable(msg) from None
        except BaseException:
            self._refuse_open()
            raise

    def _check_daemon(self, now_ms: int = 0) -> None:
        """From a write in cluster mode, at most every DAEMON_CHECK_MS: when the host's
        daemon no longer heartbeats, one KVCommWarning (per namespace and process, until
        a daemon beats again) says that writes now wait in L2."""
        self._daemon_check_ms = (now_ms or _now_ms()) + DAEMON_CHECK_MS
        att = self._attached
        if self._daemon_beats():
            att.daemon_warned = False
            return
        if att.daemon_warned:
            return
        att.daemon_warned = True
        warnings.warn(
            f"the node daemon of namespace {self.name!r} on host {self._host!r} does not "
            f"heartbeat ({self._daemon_silence()}): writes are still acknowledged into L2 "
            f"and wait there for L3 ({self._seg.dirty_count} so far; at "
            f"cluster.outbound_max, {self._max_dirty}, put raises Unavailable), and reach "
            f"the other hosts once a daemon runs again: start it with `{self._daemon_command}`",
            KVCommWarning, stacklevel=3)  # (the caller of put, delete)

    def _check_no_strong_keys(self) -> None:
        """A cluster-mode agent without ``cluster.etcd`` cannot ask etcd which keys the
        cluster keeps strong, so it reads L3's copy of etcd's record (every daemon with
        ``cluster.etcd`` copies it at start: L3Store.strong_config), through the L3
        client it opens anyway. An agent that would treat the cluster's strong keys as
        eventual ones must not start: raises ConfigError (the cluster keeps strong keys;
        a junk copy in L3), and the client is then closed.

        When L3 cannot answer (within 2 x cluster.timeout), or holds no copy (no daemon
        with etcd started since the copy existed), or the host's daemon says it is in
        partition mode, it asks that daemon instead: its status file (while fresh)
        carries the cache.strong_prefixes and cache.l3_consistency it runs with. With no
        daemon status either, every write asks the status again (:meth:`_recheck_strong`)
        until one says: never written as eventual while nobody has said."""
        from ..errors import ConfigError, Unavailable

        st = self._host_status().status()
        found: tuple[list[str], str] | None = None
        if st is None or not st.get("partition"):  # (cut off: do not wait for L3)
            try:
                l3 = self._l3_store()  # type: ignore[attr-defined]
            except (Unavailable, ConfigError):
                l3 = None  # (a ConfigError of L3's own, cluster.groups: the first miss's)
            try:
                found = None if l3 is None else l3.strong_config()
            except Unavailable:
                found = None  # (the status file decides, as below)
            except ConfigError:
                self._refuse_open()
                raise
        if found is not None:
            st = {"strong_prefixes": found[0], "l3_consistency": found[1]}
            source = "says L3's copy of etcd's record, kvm:strong"
        elif st is None:
            # no daemon yet (starting, restarting): every write asks again until one says
            # (_is_strong), or strong keys would be written into L2 as eventual ones
            self._strong_unknown = self._strong_on = True
            return
        else:
            source = f"says the node daemon of host {st.get('host')!r}"
        refused = self._strong_refused(st, source)
        if refused is not None:
            self._refuse_open()
            raise refused

    def _refuse_open(self) -> None:
        """Release what the constructor took (a refused open leaves nothing behind)."""
        if self._l3 is not None:
            self._l3.close()
            self._l3 = None
        if self._strong is not None:
            self._strong.close()
            self._strong = None
        process_budget().unregister(self.config.cache.l1_size)
        _Shared.release(self._attached)
        self._closed = self._unusable = True

    @staticmethod
    def _strong_refused(st: dict[str, Any], source: str = "") -> Exception | None:
        """The ConfigError for an agent without ``cluster.etcd`` in a cluster that keeps
        strong keys, as ``st`` (a daemon's status, or L3's copy) says, or None.
        ``source`` names who said it."""
        from ..errors import ConfigError

        theirs = st.get("strong_prefixes") or []
        if not (theirs or st.get("l3_consistency") == "strong"):
            return None
        source = source or f"says the node daemon of host {st.get('host')!r}"
        return ConfigError("cluster.etcd", f"the cluster keeps strong keys in etcd "
                           f"(cache.strong_prefixes {theirs}, cache.l3_consistency "
                           f"{st.get('l3_consistency')!r}, {source}) and this config lists "
                           "no etcd members: give this agent the host's cluster.etcd and "
                           "cache.strong_prefixes")

    def _recheck_strong(self) -> None:
        """An agent without ``cluster.etcd`` opened while no daemon status was fresh: ask
        the status again. Fresh and without strong keys: no more asking; with strong
        keys: ConfigError (each time: nothing is written). Not fresh yet: eventual."""
        st = self._status_reader.status()
        if st is None:
            return
        refused = self._strong_refused(st)
        if refused is not None:
            raise refused
        self._strong_unknown = False
        self._strong_on = self._strong is not None

    def _open_strong(self) -> None:
        """Open the strong-key store and check this config's prefixes against the
        cluster's. Raises ConfigError (no cluster.etcd; prefixes that disagree). When etcd
        cannot answer now, the check is left to the first strong operation."""
        from ..errors import ConfigError, Unavailable
        from .strong import StrongStore

        c = self.config.cache
        if not self.config.cluster.etcd:
            raise ConfigError("cluster.etcd", "cache.strong_prefixes (or cache.l3_consistency: "
                              "strong) in cluster mode keeps strong keys in etcd: list the "
                              "etcd members in cluster.etcd")
        try:
            self._strong = StrongStore(self.config, self.name, self._etcd_unreachable)
            if not self._etcd_unreachable():  # (partitioned: do not wait cluster.timeout)
                self._strong.check()
        except Unavailable:
            pass  # partitioned at start: eventual keys work; strong ones check first
        except BaseException:
            if self._strong is not None:
                self._strong.close()
            process_budget().unregister(c.l1_size)
            _Shared.release(self._attached)
            self._closed = self._unusable = True
            raise
        self._strong_on = bool(c.strong_prefixes) or c.l3_consistency == "strong"
        if self._strong_on:  # L1 copies of strong keys from before they were declared
            for key in [k for k in list(self._l1_entries) if self._strong.is_strong(k)]:
                self._forget_strong(key)

    def _is_strong(self, key: str, consistency: str | None) -> bool:
        """Whether ``key`` is strong (cluster mode; see _client/strong.py). Raises
        InvalidKey, and InvalidArgument when ``consistency`` names the other kind."""
        self._key_hash(key)  # (validates the key)
        if self._strong_unknown:
            self._recheck_strong()
        strong = self._strong is not None and self._strong_on and self._strong.is_strong(key)
        if strong:  # never served by a cache: see _forget_strong
            self._forget_strong(key)
            _network("etcd")  # (every operation of a strong key asks etcd next)
        if consistency is not None and self._cluster and (consistency == "strong") != strong:
            raise InvalidArgument(
                f"{key!r} is {'a strong' if strong else 'an eventual'} key in cluster mode, "
                f"and consistency={consistency!r} asks otherwise: which keys are strong is "
                "the cluster's choice, set by cache.strong_prefixes (longest prefix wins; "
                "others follow cache.l3_consistency); drop consistency= or change the prefixes")
        return strong

    def _forget_strong(self, key: str) -> None:
        """Keep strong ``key`` out of the read caches: out of the key memo (the C getter
        reads L2 only for memoised keys, so an L2 record of the key, written before its
        prefix was declared, is never served) and out of L1 (shared by the process's
        clients of the namespace). Its reads then always reach the slow path, which
        asks etcd. The L2 record itself is left alone: it may be a dirty write the node
        daemon must still send to L3, and no read of this config looks at it."""
        self._keys.pop(key, None)
        if self._l1_on and key in self._l1_entries:
            self._l1.discard(key)

    def _etcd_unreachable(self) -> str | None:
        """Why the host's node daemon finds etcd's majority out of reach, or None (its
        status file, read at most every 50 ms; see node/presence.py)."""
        return self._host_status().etcd_unreachable()  # type: ignore[no-any-return]

    def _host_status(self) -> Any:
        """The reader of the host's node daemon's status file (node/presence.py
        StatusReader), made at its first use."""
        r = self._status_reader
        if r is None:
            from ..node.presence import StatusReader
            from ..tiers.shm.files import status_path

            r = self._status_reader = StatusReader(status_path(self.name,
                                                               self.config.cache.l2_dir))
        return r

    def _timed(self, op: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, timed into the latency histogram of ``op`` (tier l2, or
        for a read the tier that answered: ``fn`` then returns an Item or None, whose tier
        is this read's own, whatever other threads read meanwhile). Called by an operation
        whose turn it was to be sampled; the countdown starts again, so ``fn`` (the
        operation itself) runs untimed inside."""
        # (``fn`` counts itself down once; sampling switched off meanwhile: never again)
        self._lat_left = self._lat_every + 1 if self._lat_every else 1 << 62
        t0 = time.perf_counter_ns()
        out = fn(*args, **kwargs)
        ns = time.perf_counter_ns() - t0
        self._note_latency(op, "l2" if op != "get" else "absent" if out is None else out.tier,
                           ns)
        return out

    def _note_latency(self, op: str, tier: str, ns: int) -> None:
        h = self._lat.get((op, tier))
        if h is None:
            h = self._lat[(op, tier)] = Histogram()
        h.note(ns)

    def _key_hash(self, key: Any) -> tuple[bytes, int]:
        """(UTF-8 bytes, stable hash) of a valid key, memoised: agents reuse their keys."""
        kh = self._keys.get(key) if type(key) is str else None
        if kh is None:
            kh = key_of(self._keys, key, self._max_key)  # (in C: checked, hashed, memoised)
            if kh is not None:
                return kh
            kb = self._key(key)  # (InvalidKey for a key the C check did not take)
            kh = (kb, key_hash(kb))
            if len(self._keys) >= _KEY_MEMO:
                self._keys.clear()
            self._keys[key] = kh
        return kh

    def _key(self, key: Any) -> bytes:
        if type(key) is not str:
            raise InvalidKey(f"keys are str, got {type(key).__name__}: {key!r}")
        try:
            kb = key.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidKey(
                f"key {key!r} is not valid Unicode (a lone surrogate); keys must encode to UTF-8"
            ) from None
        if not kb or len(kb) > self._max_key or b"\x00" in kb:
            if not kb:
                raise InvalidKey("the key is empty; use a non-empty str such as 'drone/7/pos'")
            if b"\x00" in kb:
                raise InvalidKey(f"key {key!r} contains NUL; remove it")
            mine = self.config.cache.max_key_bytes
            if mine != self._max_key:  # (a namespace made with another config's)
                fix = (f"shorten it, or purge the namespace (`kvcomm purge --name {self.name}`) "
                       f"and open it again, to make it with your {mine}" if len(kb) <= mine
                       else "shorten it")
                raise InvalidKey(
                    f"key is {len(kb)} bytes of UTF-8, over the {self._max_key} namespace "
                    f"{self.name!r} takes (it was made with cache.max_key_bytes={self._max_key}; "
                    f"this client's {mine} is ignored until it is purged and made again): {fix}")
            raise InvalidKey(
                f"key is {len(kb)} bytes of UTF-8, over cache.max_key_bytes={self._max_key}: "
                f"shorten it (a hash of its tail, say), or raise cache.max_key_bytes, the "
                f"same on every host (at most {MAX_KEY}; a namespace made already keeps its "
                f"own until purged)"
            )
        return kb

    def _live(self) -> None:
        if self._closed:
            raise SegmentError("this kvcomm client is closed; open a new one")
        if self._forked:
            raise SegmentError(
                "this client was opened before fork(); call kvcomm.open() in the child process"
            )

    def _version(self, counter: int, hlc: int, vvx: bytes) -> Version:
        """The Version of a record: this host's entry (``counter``) and the others (``vvx``)."""
        if not vvx:  # tuple.__new__ skips NamedTuple's Python-level __new__ (hot path)
            return _new_version(Version, (((self._host, counter),), hlc))
        try:
            others = decode_others(vvx)
        except ValueError as exc:
            raise SegmentError(f"a stored version vector is corrupt ({exc}); purge the namespace") from None
        own = ((self._host, counter),) if counter else ()
        return Version(tuple(sorted(others + own)), hlc)

    def _encode(self, value: Any) -> tuple[int, bytes, bytes | memoryview]:
        """(tag, meta, payload) of a value. Raises UnsupportedValue, ValueTooLarge."""
        tag, meta, payload = codec.encode(value)
        if len(payload) > self._max_value:
            self._too_large(len(payload))
        return tag, meta, payload

    def _too_large(self, size: int) -> None:
        """Raise ValueTooLarge for a value of ``size`` bytes, naming the setting to change."""
        raise ValueTooLarge(
            f"value is {size} bytes, over cache.max_value_size={self._max_value}: store less, "
            "or raise cache.max_value_size in every host's config (and cache.l2_size with it: "
            "L2 holds values up to about l2_size/8)")

    def _decode(self, key: str, tag: int, meta: bytes, raw: bytes | memoryview) -> Any:
        try:
            return codec.decode(tag, meta, raw)
        except KVCommError:
            raise
        except Exception as exc:  # msgpack and numpy raise many unrelated types
            raise SegmentError(f"stored value of {key!r} cannot be decoded ({exc}); "
                               "overwrite or delete it") from None

    def _item_of(self, key: str, rec: Record | None) -> Item | None:
        """The Item of a record read under the lock (None for absent, a tombstone or an
        expired record)."""
        if rec is None or rec.tag == TAG_TOMBSTONE or 0 < rec.deadline <= time.time():
            return None
        value = self._decode(key, rec.tag, rec.meta, rec.value or b"")
        return Item(key, value, self._version(rec.counter, rec.hlc, rec.vvx), "l2",
                    rec.deadline or None)

    def _read_l2(self, kb: bytes, h: int, zc: int) -> Any:
        """The raw L2 record (tombstones too) or None. Repairs a corrupt segment once."""
        try:
            rec = self._core_read(kb, h, zc)
        except SegmentError:
            return self._seg.read(kb, h, zc)  # repairs once, or raises
        if type(rec) is int:  # a slot stayed odd: a slow, stopped or dead writer
            return self._seg.read(kb, h, zc)
        return rec
