"""KVCommSaver: a LangGraph checkpointer (``BaseCheckpointSaver``) on a KVCOMM client.

Keys (``_keys.py`` has the layout and the escaping)::

    lg/cp/h/T/N/              head of (thread T, checkpoint namespace N): latest id
    lg/cp/c/T/N/C             checkpoint C: checkpoint (without values), metadata, parent,
                              run id, and its small values (None, bool, int, float, a str of
                              at most 256 characters), channel by channel
    lg/cp/b/T/N/CH/VER        the value of channel CH at version VER (one not inlined)
    lg/cp/w/T/N/C/TASK/IDX    a pending write of checkpoint C

Every record except the head is immutable (written once); ``put`` writes the checkpoint's
new channel values and the checkpoint, then moves the head forward: in embedded mode in
one ``kv.batch`` (the head last, its compare-and-set judged under the writer lock), in
cluster mode the records' batch *then* the head's conditional write. In cluster mode list
the heads' prefix (``lg/cp/h/``) in every host's ``cache.strong_prefixes``: the head is
then linearizable, and a read of a record it names waits for it (up to ``wait_timeout``)
rather than serve an older checkpoint. A ``get_tuple`` of the latest checkpoint marks
the config it returns, so a put of two writers that resumed the same head raises
``kvcomm.ConflictError`` for the loser.

Retention: ``ttl`` (seconds; langgraph-checkpoint-redis's counts minutes) gives every
record a put writes that lifetime; ``refresh_on_read`` (True by default) makes
``get_tuple`` give the checkpoint it returns, with its values, writes and head, its whole
ttl again (touched: never bringing back what another writer deleted or replaced since).
Values go through LangGraph's serializer protocol, never pickle (``_serde.py``).

Design (why a resume on another host never sees a stale thread, with and without etcd;
what list, prune and delete_for_runs read; async; two writers; retention):
docs/design/langgraph-saver.md.
"""

from __future__ import annotations

import builtins
import functools
import itertools
import math
import random
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Literal, TypeVar

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    EXCLUDED_METADATA_KEYS,
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    PendingWrite,
    get_checkpoint_id,
    get_checkpoint_metadata,
    writes_sort_key,
)

from ..._client import ABSENT, Client
from ..._client.batch import put_records
from ..._l2core import checkpoint_record, step_metadata, task_records
from ...aio import AsyncClient
from ...core.codec import Packed, is_text
from ...core.expiry import MAX_TTL
from ...core.versions import Version
from ...errors import (
    ConflictError,
    CorruptRecord,
    InvalidArgument,
    InvalidKey,
    KVCommError,
    KVCommWarning,
    SegmentError,
    Unavailable,
)
from ._keys import DEFAULT_ROOT, Keys, esc, version_component
from ._kv import get_referenced, runner, scan, sync_and_aio
from ._serde import NoPickleSerializer, no_pickle

R = TypeVar("R")

_ANY: Any = object()  # (a head move from any parent: forward only)
_OFF_CHAIN: Any = object()  # (_child_on_chain: the head does not descend from it)
_WALK_MAX = 10_000  # (_child_on_chain: the records it reads at most)
# LangGraph's names (langgraph._internal._constants, stable across its versions)
_START = "__start__"  # the start channel: a StateGraph's input, until its start task runs
_NULL_TASK = "00000000-0000-0000-0000-000000000000"  # the task id of a Command's update
_RESUME = "__resume__"  # the channel of a Command's resume value
_STR = {str}
_HEAD_MARGIN = 0.01  # (s: a head moved back expires this much before its checkpoint)
_NO_KWARGS: dict[str, Any] = {}  # (the async methods' calls have none; never changed)
_MAX_HEADS = 65536  # (the remembered heads, one per thread and namespace: bounded)


class _DeltaThreads(InvalidArgument, NotImplementedError):
    """prune(keep_latest) of threads that use a DeltaChannel (LangGraph's savers raise
    NotImplementedError there; KVCOMM's errors are KVCommErrors: both)."""


class RunSuperseded(KVCommError):
    """A run's put was refused after earlier steps of the run were kept: another writer
    resumed the thread from one of this run's own checkpoints and carries it on, so this
    run's input is (or may be) in the thread's state. Unlike ConflictError, running the
    same input again would apply it twice: read the thread's state and go on from there."""


class _NotHead(Exception):
    """put_writes: the checkpoint is no longer the head (the head is left alone)."""


class _Moved(Exception):
    """put: the head is not the checkpoint this run resumed from (another writer moved it)."""

    def __init__(self, head: str | None) -> None:
        self.head = head


# The configurable key a head read by get_tuple carries (its checkpoint id; None for a
# checkpoint read by its explicit id). LangGraph merges get_tuple's config into the
# config of the run's every put; a put that carries a non-None one is the continuation
# of a run that resumed from the thread's latest checkpoint: it moves the head by a
# compare-and-set against its parent, never forking the thread. ("__" keys are kept out
# of checkpoint metadata by LangGraph.)
RESUMED_HEAD = "__kvcomm_resumed_head__"
# And the run it starts: a number of this saver's, new at each such get_tuple, so that
# what a run did before its first move (put_writes: a Command's writes on the head) is
# told apart from another run's on the same head (put: _refused).
RUN = "__kvcomm_run__"


# what reading a record of another shape than KVCommSaver's raises (a planted one)
_SHAPE_ERRORS = (TypeError, ValueError, KeyError, IndexError, AttributeError,
                 NotImplementedError, RecursionError, OverflowError)


def _corrupt(what: str, exc: BaseException, kv: Client | None = None) -> KVCommError:
    """CorruptRecord naming ``what`` for ``exc``, what a read of a record of another shape
    raised; SegmentError when ``kv``, the client read, was closed meanwhile (by another
    thread: its reads then fail so, whatever the records hold)."""
    if kv is not None and kv._closed:
        return SegmentError("this kvcomm client was closed (by another thread) while this "
                            "call read the thread's records; open a new one")
    return CorruptRecord(f"a record of {what} in KVCOMM is not one KVCommSaver wrote "
                         f"({type(exc).__name__}: {str(exc)[:200]}); delete the thread "
                         "(delete_thread) or the record")


class _Reading:
    """``with _Reading(what):`` a block that reads records (untrusted: anyone with the
    namespace can write under the saver's keys); what a record of another shape makes it
    raise becomes CorruptRecord naming ``what`` (``_Reading(thread=t)``: "thread t", made
    only then). KVCommErrors pass as they are."""

    __slots__ = ("kv", "thread", "what")

    def __init__(self, what: str = "", *, thread: str = "", kv: Client | None = None) -> None:
        self.what = what
        self.thread = thread
        self.kv = kv

    def __enter__(self) -> None:
        return None

    def __exit__(self, t: Any, exc: BaseException | None, tb: Any) -> Literal[False]:
        if exc is not None and isinstance(exc, _SHAPE_ERRORS):
            _reraise_corrupt(self.what or f"thread {self.thread!r}", exc, self.kv)
        return False


def _reraise_corrupt(what: str, exc: BaseException, kv: Client | None = None) -> None:
    """What ``_Reading(what, kv=kv)`` raises for ``exc``, one of _SHAPE_ERRORS, at the end
    of its block: ``_corrupt(what, exc, kv)``; nothing (the caller re-raises) for a
    KVCommError."""
    if not isinstance(exc, KVCommError):
        raise _corrupt(what, exc, kv) from None


def _slots_ok(w: Any) -> bool:
    return type(w) is list and all(type(x) is list and len(x) == 2 and type(x[0]) is str
                                   and type(x[1]) is int for x in w)


def _head_of(value: Any, key: str) -> dict[str, Any] | None:
    """``value``, the head stored under ``key`` (None: absent), checked: a dict with ``id``
    (a str, or None) and ``w`` (a list of [task, index]), and perhaps ``p`` (checkpoint id
    -> such a list). Raises CorruptRecord otherwise."""
    if value is None:
        return None
    if (type(value) is dict and (value.get("id") is None or type(value.get("id")) is str)
            and "id" in value and _slots_ok(value.get("w"))
            and ("p" not in value or type(value["p"]) is dict
                 and all(type(c) is str and _slots_ok(w) for c, w in value["p"].items()))):
        return value
    raise CorruptRecord(f"the thread head {key!r} in KVCOMM is not one KVCommSaver wrote "
                        f"({str(value)[:120]}); delete the thread (delete_thread) or that key")


# ``get_checkpoint_metadata(config, metadata)``, LangGraph's: the same dict, keys in the
# same order, in C (``_l2core.step_metadata``; in Python, iterating the ChainMap that a
# running graph's ``config["metadata"]`` is ran four methods a key, 13 µs of a put); any
# other shape of config than a running graph's is given to LangGraph's own function (and
# LangGraph's own set of excluded keys is read at each call, as that function reads it).
# A test holds the two equal (tests/integrations/test_langgraph_step.py).
_metadata: Callable[[RunnableConfig, CheckpointMetadata], dict[str, Any]] = functools.partial(
    step_metadata, EXCLUDED_METADATA_KEYS, get_checkpoint_metadata)


def _shaped(value: list[Any], n: int) -> bool:
    if n == 6:  # (a checkpoint: six fields, then (channel, type, bytes) triples)
        return len(value) >= 6 and (len(value) - 6) % 3 == 0 and all(
            type(value[i]) is str and type(value[i + 1]) is str and type(value[i + 2]) is bytes
            for i in range(6, len(value), 3))
    if len(value) != n:
        return False
    return n != 5 or (type(value[0]) is str and type(value[1]) is str and type(value[4]) is str)


def _record(value: Any, n: int, key: str) -> list[Any]:
    """``value``, a record of ``n`` fields under ``key`` (a checkpoint: 6, then its inlined
    values as (channel, type, bytes) triples; a write: 5; a channel value: 2), checked for
    its shape; CorruptRecord otherwise."""
    if type(value) is list and _shaped(value, n):
        return value
    raise CorruptRecord(f"the record {key!r} in KVCOMM is not one KVCommSaver wrote "
                        f"({str(value)[:120]}); delete the thread (delete_thread) or that key")


class KVCommSaver(BaseCheckpointSaver[str]):
    """A LangGraph checkpointer storing threads in KVCOMM (see the module docstring for
    the key layout; what holds across hosts: docs/design/langgraph-saver.md).

    ``kv`` is an open client (``kvcomm.open(...)``), which the saver uses and never
    closes. ``serde`` is a LangGraph serializer (default ``JsonPlusSerializer(
    allowed_msgpack_modules=None)``, strict); one that pickles, or calls any function a
    stored record names, is refused (ConfigError; see ``_serde.py``). ``root`` is the
    key prefix of everything the saver writes (default ``"lg/"``; heads under
    ``root + "cp/h/"``). ``wait_timeout`` is how long, in cluster mode, a read waits for
    a record the thread's head names. ``ttl`` (seconds, or None: kept until deleted) and
    ``refresh_on_read``: see Retention in the module docstring. ``kv`` may be a
    ``kvcomm.aio`` client: the async methods are then native.

    Methods raise what the client raises (kvcomm.KVCommError: InvalidKey for an id too
    long for ``cache.max_key_bytes``, Unavailable...) and LangGraph's serializer errors;
    a ``put`` that raises may have written the checkpoint's records but not moved the
    head: the thread is then as before.
    """

    serde: NoPickleSerializer

    def __init__(self, kv: Client | AsyncClient, *, serde: Any | None = None,
                 root: str = DEFAULT_ROOT, wait_timeout: float = 10.0, ttl: float | None = None,
                 refresh_on_read: bool = True) -> None:
        kv, self.aio = sync_and_aio(kv, "KVCommSaver")
        if not wait_timeout > 0:
            raise InvalidArgument(f"wait_timeout must be > 0 seconds, got {wait_timeout!r}")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int | float)
                                or not math.isfinite(ttl) or not 0 < ttl <= MAX_TTL):
            raise InvalidArgument(f"ttl is a thread's lifetime in SECONDS (a number > 0, at most "
                                  f"ten years; "
                                  f"langgraph-checkpoint-redis counts minutes: multiply by 60), "
                                  f"or None to keep threads until deleted; got {ttl!r}")
        super().__init__(serde=no_pickle(serde))
        self.kv = kv
        self.ttl: float | None = None if ttl is None else float(ttl)
        self.refresh_on_read = bool(refresh_on_read)
        self.keys = Keys(root, kv.config.cache.max_key_bytes)
        self._step_keys, self._write_keys = self.keys.in_c()  # (a step's keys, in C)
        self.wait_timeout = float(wait_timeout)
        # cluster mode: reads of records a head names that had to wait for them, and
        # those that gave up (Unavailable) after wait_timeout
        self.counters: dict[str, int] = {"waits": 0, "wait_timeouts": 0}
        # the last head this saver wrote or read, per head key, with its Version: a head
        # is moved by one compare-and-set on it (a strong head: one etcd round trip, not
        # a read and a write); when another writer moved it meanwhile, read it again
        self._heads: dict[str, tuple[Version, Any]] = {}
        # per (thread, namespace), the last checkpoint this saver put (its id and record),
        # so that a put after it need not read it back (_inlined_by); as bounded as _heads
        self._last: dict[tuple[str, str], tuple[str, list[Any]]] = {}
        # run (RUN) -> (thread, namespace, checkpoint): the run stored a Command's writes
        # (update, resume) on the head it resumed, before its first move; gone at its
        # first put (kept or refused). A refused first move then may have had them applied
        # by the writer that won (put: _refused). As bounded as _heads (a run that failed
        # before its first put leaves its entry: its number never comes again).
        self._commands: dict[int | None, tuple[str, str, str]] = {}
        self._runs = itertools.count(1)
        self._cluster = kv.config.cluster.enabled
        self._attempt = runner(self.aio)  # (the async methods' runner: see _kv.run_async)
        if self._cluster and kv.config.cache.strong_prefix(self.keys.heads + "t/n/") is None \
                and kv.config.cache.l3_consistency != "strong":
            warnings.warn(f"KVCommSaver in cluster mode with eventual heads: a thread resumed on "
                          f"another host may start from an older checkpoint; add "
                          f"{self.keys.heads!r} to cache.strong_prefixes (with cluster.etcd)",
                          KVCommWarning, stacklevel=2)

    # ---------------------------------------------------------------- helpers
    def _loads(self, t: str, b: bytes) -> Any:
        return self.serde.loads_typed((t, b))

    @staticmethod
    def _ids(config: RunnableConfig) -> tuple[str, str]:
        try:
            c = config["configurable"]
            thread_id = c["thread_id"]
            return (thread_id if type(thread_id) is str else _thread(thread_id),
                    c.get("checkpoint_ns", ""))
        except (KeyError, TypeError, AttributeError):
            raise InvalidArgument(f"a LangGraph config names its thread: "
                                  f"{{'configurable': {{'thread_id': ...}}}}, got "
                                  f"{str(config)[:200]}") from None

    def with_allowlist(self, extra_allowlist: Any) -> KVCommSaver:
        """A shallow clone whose serializer also allows ``extra_allowlist`` (LangGraph's
        msgpack allowlist), still refusing pickles."""
        import copy

        from langgraph.checkpoint.base import _with_msgpack_allowlist

        inner = _with_msgpack_allowlist(self.serde.inner, extra_allowlist)
        if inner is self.serde.inner:
            return self
        clone = copy.copy(self)
        clone.serde = no_pickle(inner)
        return clone

    def get_next_version(self, current: str | None, channel: None) -> str:
        """``"<n+1, 32 digits>.<random>"``, as LangGraph's own savers: ordered, and two
        hosts forking a thread never make the same version."""
        if current is None:
            n = 0
        elif isinstance(current, int):
            n = current
        else:
            n = int(str(current).split(".")[0])
        return f"{n + 1:032}.{random.random():016}"

    # ---------------------------------------------------------------- put
    def put(self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata,
            new_versions: ChannelVersions) -> RunnableConfig:
        """Store ``checkpoint`` (the checkpoint and its new channel values, then the
        head); returns the config naming it.

        A put continuing a run that resumed from the thread's latest checkpoint (its
        config carries what :meth:`get_tuple` read as the head) moves the head only if
        the head is still its parent: when another writer moved it meanwhile, nothing of
        the checkpoint is kept (embedded: not written; cluster mode: its records deleted
        again) and ``kvcomm.ConflictError`` is raised
        (run again from the thread's latest checkpoint to retry), or RunSuperseded when
        this run's input is, or may be, in the thread's latest state (do not run that
        input again; see ``_refused``). Any other put (a run
        from an explicit past ``checkpoint_id``: a fork, as LangGraph intends) moves the
        head forward to it only when it is newer."""
        thread_id, ns = self._ids(config)
        conf = config["configurable"]
        parent = conf.get("checkpoint_id")
        if parent is not None and type(parent) is not str:  # (it is the record's parent)
            raise InvalidKey(f"a checkpoint_id is a str, got the {type(parent).__name__} "
                             f"{parent!r}")
        c: dict[str, Any] = dict(checkpoint)
        values: dict[str, Any] = c.pop("channel_values", None)
        if type(values) is not dict:
            raise InvalidArgument(f"a checkpoint holds its channel_values (a dict), got "
                                  f"{str(checkpoint)[:200]}")
        cid, versions = c.get("id"), c.get("channel_versions")
        if type(cid) is not str or not cid or not is_text(cid):
            raise InvalidKey(f"a checkpoint's id is a non-empty str of text, no lone surrogate "
                             f"(LangGraph's uuid6()), got the {type(cid).__name__} {cid!r}")
        if type(versions) is not dict:
            raise InvalidArgument(f"a checkpoint holds its channel_versions (a dict), got "
                                  f"{str(checkpoint)[:200]}")
        if not ({*map(type, values), *map(type, versions), *map(type, new_versions)} <= _STR):
            # (each set made in C: a step's few channels)
            raise InvalidArgument(f"a checkpoint's channels are named by str (the keys of its "
                                  f"channel_values and channel_versions, and of new_versions), "
                                  f"got {str(checkpoint)[:200]} and {str(new_versions)[:200]}")
        md = _metadata(config, metadata)
        k, ttl = self.keys, self.ttl
        dumps = self.serde.dumps_typed
        # (each record a list of plain fields, stored as codec.Packed stores it; kept for a
        # retry of the head's compare-and-set)
        ckey, blobs, head = self._step_keys(thread_id, ns, cid)
        keys = [ckey]
        # (the checkpoint, its metadata, parent and run id, then its small values, channel
        # by channel, as LangGraph's Postgres saver keeps primitives in its checkpoint row:
        # a step then writes one record, not one per changed channel. Small: None, a bool,
        # int or float, a str of at most 256 characters, exact types; a function of the value
        # alone, so that a version's value is inlined by every checkpoint or by none. In C:
        # ``[*dumps(c), *dumps(md), parent, md.get("run_id")]``, then ``(channel,
        # *dumps(value))`` for each small value, and the set of those channels.)
        record, inline = checkpoint_record(dumps, c, md, parent, values)
        # (channels it names at an older version without their values: LangGraph passes
        # every value, a caller of put may not; their values are its ancestors')
        inherited = versions.keys() - values.keys() - new_versions.keys()
        if inherited and parent is not None:
            try:
                record += self._inlined_by(thread_id, ns, parent, inherited, versions)
            except _SHAPE_ERRORS as exc:  # (as `with _Reading(thread=...)`, made only then)
                _reraise_corrupt(f"thread {thread_id!r}", exc, self.kv)
                raise
        records: builtins.list[builtins.list[Any]] = [record]
        own = 1  # (the checkpoint and its new values' records: keys[:own], its own)
        if ttl is not None or not inline.issuperset(new_versions):  # (else all in the record)
            channels = builtins.list(new_versions.items())
            if ttl is not None:  # (the values it shares with its ancestors live as long as it)
                channels += [(ch, v) for ch, v in versions.items()
                             if ch not in new_versions and ch in values]
            for n, (channel, version) in enumerate(channels):
                if channel in inline:
                    continue  # (in the checkpoint's record)
                keys.append(k.fit(blobs + esc(channel) + "/" + version_component(version),
                                  "channel {!r} of thread {!r}", channel, thread_id))
                records.append([*dumps(values[channel])] if channel in values
                               else ["empty", b""])
                own += n < len(new_versions)

        try:
            self._update_head(head, functools.partial(
                _forward, cid, parent if conf.get(RESUMED_HEAD) is not None else _ANY),
                (keys, records))
        except _SHAPE_ERRORS as exc:  # (as `with _Reading(thread=...)`, made only then)
            _reraise_corrupt(f"thread {thread_id!r}", exc, self.kv)
            raise
        except _Moved as moved:
            if self._cluster:  # (written before the head's compare-and-set: gone again)
                self._delete_keys(keys[:own])
            first = parent == conf.get(RESUMED_HEAD)
            stored = self._commands.pop(_run_of(conf), None) if self._commands else None
            raise self._refused(thread_id, ns, parent, moved.head, first=first,
                                commands=first and stored == (thread_id, ns, parent)) from None
        if self._commands:
            self._commands.pop(_run_of(conf), None)  # (its first move made: kept)
        self._last[thread_id, ns] = (cid, record)
        if len(self._last) > _MAX_HEADS:
            self._last.pop(next(iter(self._last)))
        if ttl is not None:  # (values only its ancestors' records hold live as long as it:
            # counted from now, after its deadline was, so never a microsecond less)
            inlined, written = set(record[6::3]), time.time()
            for ch in inherited:
                if ch not in inlined:
                    self.kv.touch(k.blob(thread_id, ns, ch, versions[ch]), self._left(written))
        return {"configurable": {"thread_id": thread_id, "checkpoint_ns": ns,
                                 "checkpoint_id": cid}}

    def _refused(self, thread_id: str, ns: str, parent: str | None, head: str | None, *,
                 first: bool, commands: bool) -> KVCommError:
        """What a put refused because the head moved on from ``parent`` raises (``head``:
        where it is now; ``first``: ``parent`` is the head the run resumed from, so this
        is the run's first move; ``commands``: the run stored a Command's writes on it
        before). ConflictError when a retry is safe: nothing of this
        run's input is in the thread's latest state. RunSuperseded when it is, or may be:
        running the same input again could apply it twice. The table of cases, and why:
        docs/design/langgraph-saver.md, "Two writers never fork a thread by accident"."""
        where = f"thread {thread_id!r} (checkpoint_ns {ns!r})"
        if head is None:  # (deleted, or expired, meanwhile: none of its state is left)
            return ConflictError(
                f"{where} was deleted (delete_thread, prune, or its ttl) while this run was "
                "going: nothing of it is left and this step was not kept; run again to start "
                "the thread anew")
        if parent is None or first and not commands:
            return ConflictError(
                f"{where} moved on while this run was going: its latest checkpoint is "
                f"{head!r}, this run resumed from {parent!r}; another writer resumed the "
                "thread at the same time and won. Nothing of this run was kept: run again "
                "from the thread's latest checkpoint (without checkpoint_id) to retry, or "
                "fork from the old one explicitly (with its checkpoint_id)")
        try:
            with _Reading(thread=thread_id, kv=self.kv):
                child = self._child_on_chain(thread_id, ns, head, parent)
                dropped = not first and child is not None and child is not _OFF_CHAIN \
                    and self._input_only(thread_id, ns, parent) \
                    and self._meta(thread_id, ns, child)[0].get("source") == "input"
        except KVCommError:  # (a record unreadable now: the input may be in, say so)
            child, dropped = None, False
        if child is _OFF_CHAIN:
            return ConflictError(
                f"{where} moved on while this run was going, to checkpoint {head!r}, which "
                f"does not descend from this run's checkpoint {parent!r} (another writer forked "
                "the thread from an older checkpoint): nothing of this run is in the thread's "
                "latest state. Run again from the thread's latest checkpoint (without "
                "checkpoint_id) to retry")
        if dropped:
            return ConflictError(
                f"{where} moved on while this run was going: another writer resumed it from "
                f"this run's input checkpoint {parent!r} with input of its own (its latest "
                f"checkpoint is now {head!r}), which discards that checkpoint's unfinished "
                "tasks: this run's input is not in the thread's state, and nothing of this step "
                "was kept. Run again from the thread's latest checkpoint (without "
                "checkpoint_id) to retry")
        if first:
            return RunSuperseded(
                f"{where} moved on while this run was going, after this run stored its "
                f"Command's writes (update, resume) on checkpoint {parent!r}, the one it resumed "
                f"from: another writer resumed that checkpoint (its latest checkpoint is now "
                f"{head!r}) and may have applied them. This run's step was not kept. Do not "
                "send the same Command again unread (it could be applied twice): read the "
                "thread's state (graph.get_state) and go on from there")
        return RunSuperseded(
            f"{where} was taken over while this run was going: another writer resumed it "
            f"from this run's own checkpoint {parent!r} (its latest checkpoint is now "
            f"{head!r}); this run's steps up to that checkpoint stay in the thread, so its "
            "input is (or may be) in the thread's state, and the rest of this run was not "
            "kept. Do not run the same input again (it would be applied twice): read the "
            "thread's state (graph.get_state) and go on from there")

    def _input_only(self, thread_id: str, ns: str, cid: str) -> bool:
        """Whether checkpoint ``cid`` is an input checkpoint whose input is only in the
        start channel (a StateGraph's, an entrypoint's): not yet in the state, which its
        start task applies. (A Pregel whose input channels are state channels has it in
        the state at once: not so.)"""
        md, cp = self._meta(thread_id, ns, cid)
        updated = cp.get("updated_channels")
        return md.get("source") == "input" and type(updated) is list \
            and all(ch == _START for ch in updated)

    def _meta(self, thread_id: str, ns: str, cid: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """(metadata, checkpoint without values) of checkpoint ``cid``; ({}, {}) when it is
        gone or not dicts."""
        body = self._body(thread_id, ns, cid)
        if body is None:
            return {}, {}
        md, cp = self._loads(body[2], body[3]), self._loads(body[0], body[1])
        return (md if type(md) is dict else {}), (cp if type(cp) is dict else {})

    def _body(self, thread_id: str, ns: str, cid: str) -> list[Any] | None:
        """The record of checkpoint ``cid`` (checked), None when it is gone: the last one
        this saver put is known without a read (a record it built: no check)."""
        last = self._last.get((thread_id, ns))
        if last is not None and last[0] == cid:
            return last[1]
        key = self.keys.checkpoint(thread_id, ns, cid)
        body = self.kv.get(key)
        return None if body is None else _record(body, 6, key)

    def _child_on_chain(self, thread_id: str, ns: str, head: str, ancestor: str) -> Any:
        """The checkpoint whose parent is ``ancestor``, found by following parents back
        from ``head``; _OFF_CHAIN when ``head`` does not descend from ``ancestor`` (the
        walk reached the thread's first checkpoint); None when that is not known (a record
        gone or not well formed, a loop, or more than _WALK_MAX records on the way). Ids
        are not compared: they are times of the hosts that made them, whose clocks differ."""
        cid, seen = head, set()
        for _ in range(_WALK_MAX):
            body = self._body(thread_id, ns, cid)
            if body is None:
                return None
            up = body[4]
            if up == ancestor:
                return cid
            if up is None:
                return _OFF_CHAIN
            seen.add(cid)
            if type(up) is not str or up in seen:
                return None  # (not a record this saver wrote)
            cid = up
        return None

    def _inlined_by(self, thread_id: str, ns: str, parent: str, channels: AbstractSet[str],
                    versions: dict[str, Any]) -> builtins.list[Any]:
        """The (channel, type, bytes) fields of ``channels`` at ``versions`` that the
        record of checkpoint ``parent`` holds: a checkpoint put without the values of
        channels it shares with its parent carries them on, as the parent does (a small
        value is in the record of every checkpoint that has it: put). [] when the
        parent is gone or holds none of them (then they have records of their own).
        LangGraph passes every value but the empty channels': the parent is then the last
        checkpoint this saver put, known without a read."""
        body = self._body(thread_id, ns, parent)
        if body is None or channels.isdisjoint(body[6::3]):  # (LangGraph's own puts: only
            return []  # empty channels come without values)
        found = [i for i in range(6, len(body), 3) if body[i] in channels]
        theirs = self._loads(body[0], body[1])["channel_versions"]
        return [x for i in found if theirs.get(body[i]) == versions[body[i]]
                for x in body[i:i + 3]]

    def _left(self, start: float) -> float | None:
        """The saver's ttl less the time since ``start`` (None without a ttl)."""
        return None if self.ttl is None else max(self.ttl - (time.time() - start), 0.001)

    def _update_head(self, key: str, fn: Callable[[Any], dict[str, Any]],
                     records: tuple[builtins.list[str], builtins.list[Any]] | None = None,
                     start: float | None = None) -> None:
        """``kv.update(key, fn)``, starting from the head this saver last saw (no read
        when it is still current); ``fn`` returning its argument itself writes no head.
        ``fn`` may run more than once; what it raises on the head read now propagates
        and nothing is written (on a remembered head: the head is read again first).

        ``records`` (put: the checkpoint's keys and records) are records the head will
        name, put before it: in embedded mode in one batch with the head, whose compare-and-set
        is judged under the writer lock (one lock hold; a lost race writes nothing); in
        cluster mode in a batch of their own, then the head (strong: in etcd; eventual:
        decided on L3). Records and head get the saver's ttl counted from before the
        records (the head never outlives them); without ``records`` the head is written
        without a deadline (put_writes calls it so only when the saver has no ttl; with
        one it uses kv.update, which keeps the head's deadline). ``start``: when records
        the head names were written before this call (copy_thread), the time their ttl
        counts from (default now). Raises what ``kv.put`` raises (Unavailable...); a put
        whose head move raised may have written the records."""
        cached = self._heads.get(key)
        head_ttl = self.ttl if start is None else self._left(start)  # (embedded: see below)
        start = time.time() if start is None else start
        if records is not None and self._cluster:
            put_records(self.kv, *records, self.ttl)
        for _ in range(10_000):
            if cached is None:
                item = self.kv.get_item(key)
                expect, old = (ABSENT, None) if item is None else (item.version,
                                                                     _head_of(item.value, key))
            else:
                expect, old = cached
            try:
                new = fn(old)
            except (_Moved, _NotHead):
                if cached is None:
                    raise
                cached = None  # (judged on what this saver last saw: read the head now)
                continue
            unchanged = new is old and old is not None
            if unchanged and cached is not None:
                cached = None  # (judged on what this saver last saw: read the head now)
                continue
            version: Version | None = None
            try:
                if records is not None and not self._cluster:
                    # (the records' ttl and the head's, counted from one instant in
                    # put_records: one deadline, the head never outlives them)
                    version = put_records(self.kv, *records, self.ttl, last=None if unchanged
                                          else (key, Packed.built(new), expect, head_ttl))
                elif not unchanged:
                    version = self.kv.put(key, new, expect=expect,
                                          ttl=None if records is None else self._left(start))
            except ConflictError:
                self._heads.pop(key, None)
                cached = None
                continue
            if version is not None:
                self._heads[key] = (version, new)
                if len(self._heads) > _MAX_HEADS:
                    self._heads.pop(next(iter(self._heads)))
            return
        raise Unavailable(f"the head {key!r} lost 10000 compare-and-sets in a row")

    def put_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str,
                   task_path: str = "") -> None:
        """Store the pending writes of task ``task_id`` at the checkpoint ``config`` names.
        A regular write (index >= 0) already stored is kept, as in LangGraph's savers;
        special ones (errors, interrupts...) replace theirs."""
        thread_id, ns = self._ids(config)
        conf = config["configurable"]
        cid = conf.get("checkpoint_id")
        if cid is None:
            raise InvalidArgument("put_writes stores a task's writes at a checkpoint: its "
                                  "config names one ('checkpoint_id'), as put returned it")
        if type(cid) is not str or not cid:
            raise InvalidKey(f"a checkpoint_id is a non-empty str, got the {type(cid).__name__} "
                             f"{cid!r}")
        if type(task_id) is not str or type(task_path) is not str:
            raise InvalidArgument(f"a task's id and path are str (LangGraph's), got "
                                  f"{task_id!r} and {task_path!r}")
        dumps = self.serde.dumps_typed
        # (records: [task_id, channel, *dumps(value), task_path] a write; indices: of the
        # writes, as keyed; regular: their places in keys, of the writes kept when stored
        # already. In C, for a list, tuple or deque of plain pairs, as LangGraph passes)
        got = task_records(dumps, writes, task_id, task_path, WRITES_IDX_MAP)
        if got is None:  # (any other shape: checked, then made such a list)
            got = task_records(dumps, _pairs(writes), task_id, task_path, WRITES_IDX_MAP)
        records, indices, regular = got  # type: ignore[misc]
        keys = self._write_keys(thread_id, ns, cid, task_id, indices)
        if keys and conf.get(RESUMED_HEAD) == cid and (run := _run_of(conf)) is not None and (
                task_id == _NULL_TASK or any(r[1] == _RESUME for r in records)):
            self._commands[run] = (thread_id, ns, cid)  # (before they are stored: see put)
            if len(self._commands) > _MAX_HEADS:
                self._commands.pop(next(iter(self._commands)))
        if keys:
            self._put_new_writes(keys, records, regular)
        if keys and self._cluster:  # (all of them, even those stored already: see
            with _Reading(thread=thread_id, kv=self.kv):  # _kv.run_async)
                self._note_writes(thread_id, ns, cid, [[task_id, i] for i in indices])

    def _put_new_writes(self, keys: list[str], records: list[list[Any]],
                        regular: list[int]) -> None:
        """Put the records of a task's writes; those at ``regular`` (indices) only where
        their key is not stored yet. Embedded mode: in one batch that expects them absent
        (judged by the C kernel under the writer lock), and only when one is there, again
        without those stored. Cluster mode: each looked up first (L3 holds them)."""
        if regular and not self._cluster:
            try:
                put_records(self.kv, keys, records, self.ttl, absent=regular)
                return
            except ConflictError:
                pass  # (a task run again: its writes stored already are kept, below)
        stored = {j for j in regular if self.kv.get(keys[j]) is not None}
        if stored:
            keep = [j for j in range(len(keys)) if j not in stored]
            keys, records = [keys[j] for j in keep], [records[j] for j in keep]
        if keys:
            put_records(self.kv, keys, records, self.ttl)

    def _note_writes(self, thread_id: str, ns: str, cid: str, slots: list[list[Any]]) -> None:
        """Cluster mode: list the writes of checkpoint ``cid`` in the head, so that a read
        on another host waits for them. LangGraph may store a checkpoint's writes before
        the checkpoint itself (its puts run in the background): the head then keeps them
        aside (``"p"``: checkpoint id -> writes) until ``put`` moves it to ``cid``."""
        def add(old: dict[str, Any] | None) -> dict[str, Any]:
            if old is not None and old["id"] is not None and old["id"] > cid:
                raise _NotHead
            head = {"id": None, "w": []} if old is None else dict(old)
            if head["id"] == cid:
                head["w"] = _merged(head["w"], slots)
            else:
                pending = dict(head.get("p", {}))
                pending[cid] = _merged(pending.get(cid, []), slots)
                head["p"] = pending
            return head

        try:
            key = self.keys.head(thread_id, ns)
            if self.ttl is None:
                self._update_head(key, add)
            else:  # (kv.update keeps the head's deadline: it never outlives its checkpoint)
                self._heads.pop(key, None)
                self.kv.update(key, lambda v: add(_head_of(v, key)))
        except _NotHead:
            pass  # an older checkpoint's writes: readers of it scan for them

    # ---------------------------------------------------------------- reads
    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The checkpoint ``config`` names, or the thread's latest (its head); None when
        there is none. Raises Unavailable (cluster mode) when a record the head names
        has not reached this host within ``wait_timeout``; CorruptRecord when a record
        under the thread's keys is not one KVCommSaver wrote."""
        thread_id, ns = self._ids(config)
        try:
            return self._get_tuple(config, thread_id, ns)
        except KVCommError:
            raise
        except _SHAPE_ERRORS as exc:
            raise _corrupt(f"thread {thread_id!r}", exc, self.kv) from None

    def _get_tuple(self, config: RunnableConfig, thread_id: str,
                   ns: str) -> CheckpointTuple | None:
        k = self.keys
        cid = get_checkpoint_id(config)
        referenced: list[list[Any]] | None = None
        head_item = None
        if cid:
            key = k.checkpoint(thread_id, ns, cid)
            body = self.kv.get(key)
        else:
            head_item = self.kv.get_item(k.head(thread_id, ns))
            head = None if head_item is None else _head_of(head_item.value, k.head(thread_id, ns))
            if head is None or head["id"] is None:  # (None: writes came before any checkpoint)
                return None
            cid = head["id"]
            referenced = head["w"]
            key = k.checkpoint(thread_id, ns, cid)
            body = get_referenced(self.kv, key, self.wait_timeout,
                                  f"checkpoint {cid!r} of thread {thread_id!r}", self.counters)
        if body is None:
            return None
        body = _record(body, 6, key)
        if referenced is not None and self._cluster:
            # the head lists every write of its checkpoint (put_writes adds them while it is
            # the head): read those, no scan (a cluster scan costs a read of every group)
            writes = self._referenced_writes(thread_id, ns, cid, referenced)
        else:  # (each write with its index, which its key ends with)
            writes = [[*_record(item.value, 5, item.key), int(item.key.rsplit("/", 1)[1])]
                      for item in scan(self.kv, k.write_prefix(thread_id, ns, cid))]
        raw: dict[str, Any] | None = {} if self.ttl is not None and self.refresh_on_read else None
        tup = self._tuple(thread_id, ns, cid, body, writes, referenced is not None, raw)
        # (a run resuming from it moves the head from it, or not at all: see put)
        tup.config["configurable"][RESUMED_HEAD] = None if head_item is None else cid
        if head_item is not None:
            tup.config["configurable"][RUN] = next(self._runs)
        if self.ttl is not None and self.refresh_on_read:
            self._refresh(thread_id, ns, cid, raw or {}, writes, head_item)
        return tup

    def _refresh(self, thread_id: str, ns: str, cid: str, blobs: dict[str, Any],
                 writes: list[Any], head_item: Any) -> None:
        """Give the checkpoint read (its record, values, writes, and the head when read)
        the saver's ttl again, from now: each a conditional write, of what is there now
        (a thread another writer deleted since this read stays deleted, a special write it
        replaced stays replaced), and the head only at the version this read saw (one moved
        since, by a put, prune or delete_for_runs, keeps the deadline its mover gave it).
        Embedded: one batch, its compare-and-sets judged under the writer lock; when one
        fails (another writer meanwhile), each record is touched on its own. Cluster mode:
        each decided on L3 (a round trip each). The head's deadline is never after its
        checkpoint's."""
        k, ttl, kv = self.keys, self.ttl, self.kv
        start = time.time()
        keys = [k.checkpoint(thread_id, ns, cid), *blobs,
                *(k.write(thread_id, ns, cid, w[0], w[-1]) for w in writes)]
        head_key = k.head(thread_id, ns)
        if not self._cluster:
            items = [(key, kv.get_item(key)) for key in keys]
            try:
                with kv.batch() as b:  # (the head first: its ttl counts from before theirs)
                    for key, item in [(head_key, head_item), *items]:
                        if item is not None:
                            b.put(key, item.value, ttl=ttl)
                            b._expect(key, item.version, count=False)
                return
            except ConflictError:
                pass  # (another writer meanwhile: each on its own, below)
        for key in keys:
            kv.touch(key, ttl)
        now = None if head_item is None else kv.get_item(head_key)
        if now is not None and now.version == head_item.version:  # (moved or gone since
            try:  # this read: its mover gave it its deadline, nothing to refresh)
                kv.put(head_key, head_item.value, expect=head_item.version,
                       ttl=self._left(start))
            except ConflictError:
                pass  # (moved in between, as above)

    def _referenced_writes(self, thread_id: str, ns: str, cid: str,
                           referenced: list[list[Any]]) -> list[Any]:
        out = []
        for task_id, idx in referenced:
            key = self.keys.write(thread_id, ns, cid, task_id, idx)
            w = get_referenced(self.kv, key, self.wait_timeout,
                               f"a pending write of checkpoint {cid!r}", self.counters)
            if w is not None:
                out.append([*_record(w, 5, key), idx])
        return out

    def _tuple(self, thread_id: str, ns: str, cid: str, body: list[Any], writes: list[Any],
               wait: bool, blobs: dict[str, Any] | None = None) -> CheckpointTuple:
        """The tuple of checkpoint ``cid`` (``body``: its record); ``blobs``, when given,
        gets the raw records of its channel values, by key."""
        cp_t, cp_b, md_t, md_b, parent, _run = body[:6]
        inlined = {body[i]: (body[i + 1], body[i + 2]) for i in range(6, len(body), 3)}
        checkpoint: dict[str, Any] = self._loads(cp_t, cp_b)
        metadata = self._loads(md_t, md_b)
        if (type(checkpoint) is not dict or type(checkpoint.get("channel_versions")) is not dict
                or type(metadata) is not dict or not (parent is None or type(parent) is str)):
            raise CorruptRecord(f"checkpoint {cid!r} of thread {thread_id!r} in KVCOMM is not "
                                "one KVCommSaver wrote (its checkpoint, metadata or parent "
                                "have other types); delete the thread (delete_thread)")
        values: dict[str, Any] = {}
        for channel, version in checkpoint["channel_versions"].items():
            if channel in inlined:
                values[channel] = self._loads(*inlined[channel])
                continue
            key = self.keys.blob(thread_id, ns, channel, version)
            blob = (get_referenced(self.kv, key, self.wait_timeout,
                                   f"channel {channel!r} of checkpoint {cid!r}", self.counters)
                    if wait and self._cluster else self.kv.get(key))
            if blob is not None:
                blob = _record(blob, 2, key)
                if blobs is not None:
                    blobs[key] = blob
                if blob[0] != "empty":
                    values[channel] = self._loads(blob[0], blob[1])
        checkpoint["channel_values"] = values
        ordered = sorted(writes, key=lambda w: writes_sort_key(w[4], w[0], w[5]))
        pending: list[PendingWrite] = [(w[0], w[1], self._loads(w[2], w[3])) for w in ordered]
        return CheckpointTuple(
            config={"configurable": {"thread_id": thread_id, "checkpoint_ns": ns,
                                     "checkpoint_id": cid}},
            checkpoint=checkpoint,  # type: ignore[arg-type]
            metadata=metadata,  # type: ignore[arg-type]
            parent_config=({"configurable": {"thread_id": thread_id, "checkpoint_ns": ns,
                                             "checkpoint_id": parent}} if parent else None),
            pending_writes=pending)

    def list(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
             before: RunnableConfig | None = None, limit: int | None = None
             ) -> Iterator[CheckpointTuple]:
        """Checkpoints newest first within each (thread, namespace), threads and
        namespaces in key order; ``config`` narrows to a thread (and namespace, and
        checkpoint id), ``filter`` to metadata equal on each key, ``before`` to older ids,
        ``limit`` to that many."""
        k = self.keys
        thread_id = ns = cid = None
        if filter is not None and not isinstance(filter, dict):
            raise InvalidArgument(f"list's filter is a dict of metadata key -> value, or None, "
                                  f"got {filter!r}")
        if limit is not None and (type(limit) is not int or limit < 0):
            raise InvalidArgument(f"list's limit is an int >= 0, or None, got {limit!r}")
        if config:
            thread_id, _ns = self._ids(config)
            if thread_id is None:  # (a thread named None: none, as in LangGraph's savers;
                return  # not every thread's checkpoints, as no config lists them)
            ns = config["configurable"].get("checkpoint_ns")
            cid = _checkpoint_id(config, "config")
        if thread_id is None:
            suffix = ""
        elif ns is None:
            suffix = k.thread("", thread_id)
        else:
            suffix = k.ns("", thread_id, ns)
        before_id = _checkpoint_id(before, "before") if before else None
        records = self._list(suffix, cid, before_id, filter, limit)
        while True:
            try:
                tup = next(records)
            except StopIteration:
                return
            except KVCommError:
                raise
            except _SHAPE_ERRORS as exc:
                raise _corrupt("a checkpoint listed", exc, self.kv) from None
            yield tup

    def _list(self, suffix: str, cid: str | None, before_id: str | None,
              filter: dict[str, Any] | None, limit: int | None) -> Iterator[CheckpointTuple]:
        k = self.keys
        groups: dict[tuple[str, str], list[tuple[str, list[Any]]]] = {}
        for item in scan(self.kv, k.checkpoints + suffix):
            t, n, c = Keys.split(item.key, k.checkpoints)
            groups.setdefault((t, n), []).append((c, _record(item.value, 6, item.key)))
        writes: dict[tuple[str, str, str], list[Any]] = {}
        if groups:
            for item in scan(self.kv, k.writes + suffix):
                t, n, c, _task, idx = Keys.split(item.key, k.writes)
                writes.setdefault((t, n, c), []).append([*_record(item.value, 5, item.key),
                                                         int(idx)])
        left = limit
        for (t, n), entries in groups.items():
            for c, body in sorted(entries, key=lambda e: e[0], reverse=True):
                if cid and c != cid:
                    continue
                if before_id and c >= before_id:
                    continue
                if filter:
                    md = self._loads(body[2], body[3])
                    if type(md) is not dict:
                        raise CorruptRecord(f"the metadata of checkpoint {c!r} of thread {t!r} "
                                            "in KVCOMM is not a dict; delete the thread")
                    if not all(md.get(fk) == fv for fk, fv in filter.items()):
                        continue
                if left is not None:
                    if left <= 0:
                        return
                    left -= 1
                yield self._tuple(t, n, c, body, writes.get((t, n, c), []), False)

    # ---------------------------------------------------------------- deletes, copy, prune
    def _thread_keys(self, thread_id: str) -> builtins.list[str]:
        k = self.keys
        return [item.key for prefix in (k.checkpoints, k.blobs, k.writes)
                for item in scan(self.kv, k.thread(prefix, thread_id))]

    def _delete_keys(self, keys: Iterable[str]) -> None:
        batch: builtins.list[str] = []
        for key in keys:
            batch.append(key)
            if len(batch) >= 256:
                self._delete_now(batch)
                batch = []
        if batch:
            self._delete_now(batch)

    def _delete_now(self, keys: builtins.list[str]) -> None:
        with self.kv.batch() as b:
            for key in keys:
                b.delete(key)

    def delete_thread(self, thread_id: str) -> None:
        """Delete every checkpoint, value and write of ``thread_id`` (heads first, so that
        no reader finds a head whose records are going)."""
        thread_id = _thread(thread_id)
        for item in list(scan(self.kv, self.keys.thread(self.keys.heads, thread_id))):
            self._heads.pop(item.key, None)
            self.kv.delete(item.key)
        self._delete_keys(self._thread_keys(thread_id))

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint, value and write of ``source_thread_id`` to
        ``target_thread_id`` (records first, then the heads). A namespace the target has
        already keeps its latest checkpoint when that is newer than the source's (the
        head only moves forward, as a put's). With the saver's ttl the copies are written
        with it, the heads never outliving them. Raises CorruptRecord for a head of the
        source that is not one KVCommSaver wrote (its records are copied)."""
        source_thread_id, target_thread_id = _thread(source_thread_id), _thread(target_thread_id)
        with _Reading(thread=source_thread_id, kv=self.kv):
            self._copy_thread(source_thread_id, target_thread_id)

    def _copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        k = self.keys
        start = time.time()
        for prefix in (k.blobs, k.checkpoints, k.writes):
            src, dst = k.thread(prefix, source_thread_id), k.thread(prefix, target_thread_id)
            items = list(scan(self.kv, src))
            for i in range(0, len(items), 256):
                with self.kv.batch() as b:
                    for item in items[i:i + 256]:
                        b.put(k.fit(dst + item.key[len(src):], f"a copy into thread "
                                    f"{target_thread_id!r}"), item.value, ttl=self.ttl)
        src = k.thread(k.heads, source_thread_id)
        for item in list(scan(self.kv, src)):
            (ns,) = Keys.split(item.key, src)
            head = _head_of(item.value, item.key)
            if head is not None and head["id"] is not None:
                self._update_head(k.head(target_thread_id, ns),
                                  functools.partial(_copied, head), ([], []), start=start)

    def _set_head(self, thread_id: str, ns: str, cid: str | None, slots: builtins.list[Any]) -> None:
        """Point the head of (``thread_id``, ``ns``) at checkpoint ``cid`` (None: no head).
        With the saver's ttl the head expires with that checkpoint, never after it (no
        head when it is gone already)."""
        key = self.keys.head(thread_id, ns)
        self._heads.pop(key, None)
        ttl = None
        if cid is not None and self.ttl is not None:
            item = self.kv.get_item(self.keys.checkpoint(thread_id, ns, cid))
            if item is not None and item.expires_at is not None:
                # (a ttl counts from the put's own clock reading, a little later: the
                # margin keeps the head's deadline before the checkpoint's)
                ttl = item.expires_at - time.time() - _HEAD_MARGIN
            if item is None or ttl is not None and ttl <= 0:
                cid = None
        if cid is None:
            self.kv.delete(key)
        else:
            self.kv.put(key, {"id": cid, "w": list(slots)}, ttl=ttl)

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete the checkpoints (and their writes) whose metadata's run id is in
        ``run_ids``, in every thread; heads move back to the latest remaining checkpoint.
        Reads every checkpoint's run id."""
        runs = set(_names(run_ids, "run_ids"))
        if not runs:
            return
        k = self.keys
        threads = []
        with _Reading("a checkpoint", kv=self.kv):
            for item in scan(self.kv, k.checkpoints):
                run = _record(item.value, 6, item.key)[5]
                if type(run) is str and run in runs:
                    t = Keys.split(item.key, k.checkpoints)[0]
                    if t not in threads:
                        threads.append(t)
        for t in threads:
            with _Reading(thread=t, kv=self.kv):
                _rewrite(self, t, lambda _ns, _c, body: type(body[5]) is str and body[5] in runs)

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """``keep_latest``: keep only the latest checkpoint of each namespace of each
        thread (with its writes and values); ``delete``: delete the threads. Raises
        InvalidArgument for another strategy, and for ``keep_latest`` of threads that use
        a LangGraph ``DeltaChannel`` (whose latest value is rebuilt from the checkpoints
        before it: LangGraph's Postgres saver refuses them too; the error is also a
        NotImplementedError, as its); nothing deleted then."""
        if strategy not in ("keep_latest", "delete"):
            raise InvalidArgument(f"prune strategy is 'keep_latest' or 'delete', got {strategy!r}")
        thread_ids = [_thread(t) for t in _names(thread_ids, "thread_ids", ints=True)]
        if strategy == "keep_latest":
            delta = sorted(t for t in thread_ids if self._uses_delta_channels(t))
            if delta:
                raise _DeltaThreads(
                    "keep_latest can't prune threads that use a DeltaChannel: "
                    f"{', '.join(delta)} (their values are rebuilt from the checkpoints "
                    "before the latest); nothing was pruned: prune the others, or delete "
                    "these (strategy='delete')")
        for t in thread_ids:
            if strategy == "delete":
                self.delete_thread(t)
                continue
            with _Reading(thread=t, kv=self.kv):
                latest: dict[str, str] = {}
                for item in scan(self.kv, self.keys.thread(self.keys.checkpoints, t)):
                    _t, ns, c = Keys.split(item.key, self.keys.checkpoints)
                    latest[ns] = max(c, latest.get(ns, c))
                _rewrite(self, t, functools.partial(_not_latest, latest))

    def _uses_delta_channels(self, thread_id: str) -> bool:
        """Whether a checkpoint of ``thread_id`` was written by a graph with a
        ``DeltaChannel`` (its metadata counts deltas, as LangGraph writes it)."""
        with _Reading(thread=thread_id, kv=self.kv):
            for item in scan(self.kv, self.keys.thread(self.keys.checkpoints, thread_id)):
                body = _record(item.value, 6, item.key)
                md = self._loads(body[2], body[3])
                if type(md) is dict and ("counters_since_delta_snapshot" in md
                                         or "delta_writes_versioned" in md):
                    return True
        return False

    # ---------------------------------------------------------------- async
    def _run(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> Awaitable[R]:
        return self._attempt(fn, args, kwargs)

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """:meth:`get_tuple`, native on a ``kvcomm.aio`` client (see ``_kv.run_async``)."""
        return await self._attempt(self.get_tuple, (config,), _NO_KWARGS)

    async def alist(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
                    before: RunnableConfig | None = None, limit: int | None = None
                    ) -> AsyncIterator[CheckpointTuple]:
        """:meth:`list`, run whole as :meth:`aget_tuple` runs, then yielded."""
        items = await self._run(lambda: list(self.list(config, filter=filter, before=before,
                                                        limit=limit)))
        for item in items:
            yield item

    async def aput(self, config: RunnableConfig, checkpoint: Checkpoint,
                   metadata: CheckpointMetadata, new_versions: ChannelVersions) -> RunnableConfig:
        """:meth:`put`, native on a ``kvcomm.aio`` client (see ``_kv.run_async``)."""
        return await self._attempt(self.put, (config, checkpoint, metadata, new_versions),
                                   _NO_KWARGS)

    async def aput_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]],
                          task_id: str, task_path: str = "") -> None:
        """:meth:`put_writes`, native on a ``kvcomm.aio`` client (see ``_kv.run_async``)."""
        await self._attempt(self.put_writes, (config, writes, task_id, task_path), _NO_KWARGS)

    async def adelete_thread(self, thread_id: str) -> None:
        """:meth:`delete_thread`, native on a ``kvcomm.aio`` client (see ``_kv.run_async``)."""
        await self._run(self.delete_thread, thread_id)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        """:meth:`delete_for_runs`, native on a ``kvcomm.aio`` client (see ``_kv.run_async``)."""
        await self._run(self.delete_for_runs, run_ids)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """:meth:`copy_thread`, native on a ``kvcomm.aio`` client (see ``_kv.run_async``)."""
        await self._run(self.copy_thread, source_thread_id, target_thread_id)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """:meth:`prune`, native on a ``kvcomm.aio`` client (see ``_kv.run_async``)."""
        await self._run(self.prune, thread_ids, strategy=strategy)


def _thread(thread_id: Any) -> Any:
    """A thread id as KVCommSaver keys it: an int or a UUID as its str, as LangGraph's
    graphs key them (``invoke`` and ``get_state`` with ``thread_id=1`` use ``"1"``), so
    that a direct call finds what a graph stored; anything else as it is (a key builder
    raises InvalidKey for what is not a str)."""
    if type(thread_id) is int or type(thread_id) is uuid.UUID:
        try:
            return str(thread_id)
        except ValueError:  # (an int of more digits than Python converts)
            raise InvalidKey("a thread id is a str (or an int or UUID, used as its str), "
                             "got an int too large to write as a str") from None
    return thread_id


def _names(ids: Any, what: str, *, ints: bool = False) -> builtins.list[str]:
    """``ids``, a collection of str ids (``ints``: or ints and UUIDs, thread ids), as a
    list: InvalidArgument for a str (which would be taken as its characters: prune("t1")
    deleted threads "t" and "1") or anything else."""
    if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
        raise InvalidArgument(f"{what} is a list of ids, got {ids!r}"
                              + (f": write [{ids!r}]" if isinstance(ids, str) else ""))
    out = builtins.list(ids)
    bad = [i for i in out if type(i) is not str and not (ints and type(i) in (int, uuid.UUID))]
    if bad:
        raise InvalidArgument(f"{what} are str ids{' (or ints or UUIDs)' if ints else ''}, "
                              f"got {bad[0]!r}")
    return out


def _checkpoint_id(config: Any, what: str) -> str | None:
    """The checkpoint id ``config`` (list's ``config`` or ``before``) names, or None:
    InvalidArgument for what is no config, InvalidKey for an id that is no str."""
    try:
        cid = get_checkpoint_id(config)
    except (KeyError, TypeError, AttributeError):
        raise InvalidArgument(f"list's {what} is a LangGraph config ({{'configurable': "
                              f"{{...}}}}), got {str(config)[:200]}") from None
    if cid is not None and type(cid) is not str:
        raise InvalidKey(f"a checkpoint_id is a str, got the {type(cid).__name__} {cid!r}")
    return cid


def _pairs(writes: Iterable[Any]) -> builtins.list[tuple[str, Any]]:
    """A task's ``writes`` as a list of (channel, value) tuples; InvalidArgument for one
    that is not a pair (a tuple or list) whose channel is a str."""
    out = []
    for write in writes:
        try:
            channel, value = write
        except (TypeError, ValueError):
            channel = None
        if type(channel) is not str or not isinstance(write, (tuple, list)):  # (a str of
            raise InvalidArgument(  # two characters unpacks as a pair)
                f"a task's writes are (channel, value) pairs, channel a str, got "
                f"{str(write)[:200]} in {str(writes)[:200]}")
        out.append((channel, value))
    return out


def _run_of(conf: dict[str, Any]) -> int | None:
    """The run number get_tuple gave the config (RUN); None for none, or anything else
    a caller's config put there."""
    run = conf.get(RUN)
    return run if type(run) is int else None


def _forward(cid: str, parent: Any, old: dict[str, Any] | None) -> dict[str, Any]:
    """The head moved to checkpoint ``cid`` from ``old``: only forward (``parent`` is
    ``_ANY``), or only from ``parent`` (_Moved otherwise); ``old`` itself when it stays."""
    at = None if old is None else old["id"]
    if parent is not _ANY:
        if at == cid:
            return old  # type: ignore[return-value]  # (already there)
        if at != parent:
            raise _Moved(at)
    elif at is not None and at >= cid:
        return old  # type: ignore[return-value]
    pending = None if old is None else old.get("p")
    if not pending:  # (writes noted before their checkpoint: cluster mode's, rare)
        return {"id": cid, "w": []}
    head = {"id": cid, "w": pending.get(cid, [])}
    later = {c: w for c, w in pending.items() if c > cid}
    if later:
        head["p"] = later
    return head


def _copied(head: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
    """A target's head after a copy of ``head`` into it: moved forward to its checkpoint as
    a put moves it (:func:`_forward`: ``old`` itself when that names one as new or newer),
    listing the copied head's writes besides those the target noted for it."""
    new = _forward(head["id"], _ANY, old)
    if new is not old:
        new["w"] = _merged(new["w"], head["w"])
    return new


def _not_latest(latest: dict[str, str], ns: str, cid: str, _body: builtins.list[Any]) -> bool:
    return cid != latest[ns]


def _merged(have: builtins.list[Any], slots: builtins.list[builtins.list[Any]]) -> builtins.list[Any]:
    seen = {tuple(x) for x in have}
    return have + [x for x in slots if tuple(x) not in seen]


def _rewrite(saver: KVCommSaver, thread_id: str,
             drop: Callable[[str, str, builtins.list[Any]], bool]) -> None:
    """Delete the checkpoints of ``thread_id`` that ``drop(ns, id, body)`` selects,
    with their writes, then the values no remaining checkpoint names; then point
    each namespace's head at its latest remaining checkpoint."""
    k = saver.keys
    by_ns: dict[str, builtins.list[tuple[str, builtins.list[Any]]]] = {}
    for item in scan(saver.kv, k.thread(k.checkpoints, thread_id)):
        _t, ns, c = Keys.split(item.key, k.checkpoints)
        by_ns.setdefault(ns, []).append((c, _record(item.value, 6, item.key)))
    if not by_ns:
        return
    doomed: builtins.list[str] = []
    for ns, entries in by_ns.items():
        gone = [(c, body) for c, body in entries if drop(ns, c, body)]
        if not gone:
            continue
        kept = [(c, body) for c, body in entries if not drop(ns, c, body)]
        latest = max((c for c, _body in kept), default=None)
        head = _head_of(saver.kv.get(k.head(thread_id, ns)), k.head(thread_id, ns))
        if head is not None and head["id"] == latest:
            slots = head["w"]
        else:  # (the head moves back: it lists the writes of its new checkpoint)
            slots = [] if latest is None else [
                [_record(i.value, 5, i.key)[0], int(i.key.rsplit("/", 1)[1])]
                for i in scan(saver.kv, k.write_prefix(thread_id, ns, latest))]
        saver._set_head(thread_id, ns, latest, slots)  # (first: never a head on a gone id)
        for c, _body in gone:
            doomed.append(k.checkpoint(thread_id, ns, c))
            doomed.extend(i.key for i in scan(saver.kv, k.write_prefix(thread_id, ns, c)))
        named: set[str] = set()
        for _c, body in kept:
            cp = saver._loads(body[0], body[1])
            if type(cp) is not dict or type(cp.get("channel_versions")) is not dict:
                raise CorruptRecord(f"a checkpoint of thread {thread_id!r} in KVCOMM is not "
                                    "one KVCommSaver wrote; delete the thread")
            named.update(k.blob(thread_id, ns, ch, v)
                         for ch, v in cp["channel_versions"].items())
        doomed.extend(i.key for i in scan(saver.kv, k.ns(k.blobs, thread_id, ns))
                      if i.key not in named)
    saver._delete_keys(doomed)
