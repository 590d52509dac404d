"""The client every agent opens: ``kvcomm.open()`` → :class:`Client`, the top layer."""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

from .._extras import require_cluster
from .._l2core import Getter
from ..config import Config, load_config
from ..core import codec
from ..errors import InvalidKey, InvalidNamespace, KVCommError, UsageError
from ..metrics import agent as metrics_agent
from ..placement.agents import check_agent
from ..tiers.l1 import process_budget
from .attach import _Shared
from .presence import Presence, start_presence
from .read import Reads
from .scan import Scanning

_NOT_SENT = ("a kvcomm client cannot be copied, nor sent to another process (pickled, as "
             "multiprocessing's spawn and forkserver do with a Process's arguments): in this "
             "process share the client itself; to another, send its namespace and config "
             "and call {open}(name, config=config) there")


class Client(Scanning):
    """An agent's handle on KVCOMM. Thread-safe. Use :func:`kvcomm.open` to make one."""

    def __init__(self, name: str = "default", config: Config | None = None,
                 agent: str | None = None, wait_daemon: bool = True,
                 _config_file: str | None = None) -> None:
        super().__init__(name, config, agent, wait_daemon, _config_file)
        # kv.get is the C getter itself (an instance attribute: no Python frame on a hit);
        # Reads.get (read.py) is what it does, and what a closed client falls back to
        self._getter = Getter(self._l1, self._seg._core, self._keys, codec.decode,
                              self._get_slow, self._flush_hot, self._sample_every,
                              self._zc, self._l1_on)
        self._getter.__wrapped__ = Reads.get.__get__(self)  # help(kv.get), inspect.signature
        self.get = self._getter  # type: ignore[method-assign]
        self._batch_ops = (self._keys, self._key_hash, self._encode, self._max_value,
                           self._getter, self._live, self._ext, self._max_key)  # (Batch)
        self._meter = metrics_agent.attach(self)  # counts flushed into L2 (kvcomm metrics)
        if type(self) is Client:
            self.__class__ = _OpenClient  # (close() makes it a Client again: no __del__)

    def presence(self, prefix: str, agent_id: str, ttl: float = 2.0,
                 value: Any = b"") -> Presence:
        """Keep ``prefix + agent_id`` present while this process lives: it is written with
        ``ttl`` now and re-written every ``ttl / 3`` by a background thread; stopping the
        returned handle, or the process dying, lets it lapse within ``ttl``. ``value`` is
        what the key holds. Returns the :class:`Presence` handle. Raises InvalidKey,
        InvalidArgument (a ttl that is not finite and at least 0.03 s), and what
        :meth:`put` raises for the first write (then no thread is started)."""
        return start_presence(self, prefix, agent_id, ttl, value)

    def present(self, prefix: str) -> list[str]:
        """The agent ids whose presence under ``prefix`` is live now (whose key has not
        reached its deadline), in key order; cluster-wide in cluster mode (through
        :meth:`scan`). Raises what :meth:`scan` raises."""
        n = len(prefix) if type(prefix) is str else 0
        return [item.key[n:] for item in self.scan(prefix)]

    def stats(self) -> dict[str, Any]:
        """Per-tier hits/misses of this process, entries, bytes used and evictions."""
        c = self.counters
        l1_hits = self._l1_hits + self._getter.hits
        l2_hits, l2_misses = self._l2_hits + self._getter.l2_hits, self._l2_misses
        l2_lookups = l2_hits + l2_misses
        info = self._seg.info() if not self._closed else {}
        return {
            "l1": {"hits": l1_hits, "misses": l2_lookups, "entries": len(self._l1_entries),
                   "bytes": self._l1.bytes, "max_bytes": self._l1.max_bytes,
                   "evictions": self._l1.evictions},
            "l2": {"hits": l2_hits, "misses": l2_misses,
                   "entries": info.get("entries", 0), "bytes": info.get("used_bytes", 0),
                   "capacity_bytes": info.get("data_bytes", 0),
                   "evictions": info.get("evictions", 0),
                   "recoveries": info.get("recoveries", 0),
                   "dirty": info.get("dirty", 0),
                   "views_taken": c["views"]},
            "l3": {"reads": c["l3_reads"], "negative_hits": c["negative_hits"],
                   "filter_hits": c["filter_hits"],
                   "negative_rechecks": c["negative_rechecks"]},
            "ops": {"puts": self._puts, "deletes": c["deletes"],
                    "conflicts": c["conflicts"], "merges": c["merges"],
                    "resolver_failures": c["resolver_failures"]},
            # strong keys (cluster mode): etcd operations of this client
            "strong": dict(self._strong.counters) if self._strong is not None else {},
        }

    def keys(self, prefix: str = "") -> list[str]:
        """The keys under ``prefix``, in key order: ``[i.key for i in kv.scan(prefix)]``
        (a thin wrapper over :meth:`scan`, with its contract: in cluster mode every live
        key of the cluster under the prefix, not only this host's). Reads every value:
        for many keys, page through :meth:`scan` instead. Raises as :meth:`scan`."""
        if type(prefix) is not str:
            raise InvalidKey(f"a key prefix is a str ('' lists every key), got {type(prefix).__name__}")
        return [item.key for item in self.scan(prefix)]

    def close(self) -> None:
        """Release this client's share of the process's L2 mapping and L1. Idempotent. A
        call of this client that another thread has under way while it waits for the
        host's writer lock ends in SegmentError, nothing written; every later call raises
        SegmentError."""
        if self._closed:
            return
        if not self._unusable:
            try:
                self._flush_hot(wait=True)
            except KVCommError:
                pass  # e.g. the namespace was purged: its counts no longer matter
            metrics_agent.detach(self._meter)
        self._closed = self._unusable = True
        if type(self) is _OpenClient:
            self.__class__ = Client  # type: ignore[assignment]  # (closed: the plain class again)
        if self._observer is not None and not self._forked:  # (a forked child's is the parent's)
            with self._obs_lock:  # (after a report another thread has under way)
                self._observer.close()
        if self._l3 is not None:
            self._l3.close()
        elif self._l3_opening is not None:  # (still opening: closed once open)
            self._l3_opening.add_done_callback(
                lambda f: f.exception() is None and f.result().close())
        self._kf = None  # (dropped, not closed: a get in another thread may be testing it)
        if self._strong is not None:
            self._strong.close()
        self._l1_entries = {}
        self._getter.close()
        self.__dict__.pop("get", None)  # Client.get: it says the client is closed
        if not self._forked:
            process_budget().unregister(self.config.cache.l1_size)
            _Shared.release(self._attached)

    def __enter__(self) -> Client:
        self._live()  # (a closed client: SegmentError saying so, not a block that fails later)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # (what a newcomer tries first, answered with what to write: Python's own errors name
    # the client's private class)
    def __getitem__(self, key: object) -> NoReturn:
        raise UsageError(f"a kvcomm client is not a dict: read with kv.get({key!r}) (or "
                         "kv.get_item(key) for the version too), write with kv.put(key, value)")

    def __setitem__(self, key: object, value: object) -> NoReturn:
        raise UsageError(f"a kvcomm client is not a dict: write with kv.put({key!r}, value)")

    def __delitem__(self, key: object) -> NoReturn:
        raise UsageError(f"a kvcomm client is not a dict: delete with kv.delete({key!r})")

    def __contains__(self, key: object) -> NoReturn:
        raise UsageError(f"a kvcomm client is not a dict: ask kv.get({key!r}) is not None")

    def __iter__(self) -> NoReturn:
        raise UsageError("a kvcomm client is not a dict: list keys with kv.scan(prefix)")

    def __reduce__(self) -> NoReturn:
        raise UsageError(_NOT_SENT.format(open="kvcomm.open"))

    async def __aenter__(self) -> NoReturn:
        self.close()  # (opened by the call before it: closed, as the block will not run)
        raise UsageError("kvcomm.open() is the sync client: write `with kvcomm.open(...) as "
                         "kv:`, or `async with kvcomm.aio.open(...) as kv:` for the asyncio face")

    async def __aexit__(self, *exc: object) -> None:
        return None

    def __repr__(self) -> str:
        return f"<kvcomm.Client name={self.name!r} host={self._host!r}{' closed' if self._closed else ''}>"


class _OpenClient(Client):
    """A Client until it is closed. Only an open client has a ``__del__``: Python runs a
    pending signal's handler inside ``__del__`` and drops what it raises ("Exception
    ignored in ..."), so a Ctrl-C landing as a closed client goes (``with kvcomm.open()
    as kv:`` in a loop) would be lost; a closed client has nothing left to do there."""

    def __del__(self) -> None:
        # a client dropped without close(): its counts live in it and its getter, so they
        # are flushed now or never (a weakref.finalize could not reach them: the client
        # and its getter reference each other, and the cycle's collector clears weak
        # references before it runs finalisers)
        meter = self.__dict__.get("_meter")
        if meter is None or self._unusable:  # (not fully made; closed; a fork's copy)
            return
        if sys.is_finalizing():  # (flushed at exit already; and a daemon thread frozen
            return  # by the interpreter's shutdown may hold the metrics lock for ever)
        try:
            metrics_agent.detach(meter, self)
        except Exception:  # (at interpreter exit the modules may be half torn down)
            pass


def open(name: str | None = None, *,  # noqa: A001
         config: Config | str | os.PathLike[str] | None = None,
         agent: str | None = None, wait_daemon: bool = True) -> Client:
    """Open namespace ``name`` on this host (creating its L2 segment if needed).

    ``name`` defaults to the config's ``node.namespace`` ("default"). ``config`` is a
    path to a YAML file or a :class:`kvcomm.Config`; with ``cluster.redis`` set, the
    client works in cluster mode (a node daemon syncs the host with L3). ``agent`` names
    the agent using the client (1-64 letters, digits, ``_.:-``, e.g. ``"drone-7"``): its
    writes carry the name, and placement (``kvcomm placement``) observes and may move
    it; without one, the agent is ``PID@HOST``, observed but never moved.

    In cluster mode, ``open`` waits up to ``cluster.daemon_wait`` seconds for the host's
    node daemon (``kvcomm node``) to heartbeat, and raises Unavailable (naming the
    command that starts it) when none does: without it, this host's writes would never
    reach the other hosts. Writes made while a daemon that was running has stopped are
    still acknowledged into L2 (at most ``cluster.outbound_max`` waiting; one
    KVCommWarning says so) and reach L3 once a daemon runs again.
    ``wait_daemon=False`` neither waits nor warns: for tools that work without a daemon
    (and the daemon's own client).

    Raises InvalidArgument (a bad agent name), ConfigError, SegmentError, Unavailable (no
    node daemon); nothing is opened then.
    """
    if agent is not None:
        check_agent(agent)
    cfg = load_config(config)
    if cfg.cluster.redis:
        require_cluster()  # at open(), not at the first L2 miss
    if name is None:
        name = cfg.node.namespace
    if type(name) is not str:
        raise InvalidNamespace(f"a namespace is a str such as 'my-app' (1-64 letters, digits, "
                               f"'.', '_' or '-'), got {type(name).__name__}")
    path = None if config is None or isinstance(config, Config) else os.fspath(config)
    return Client(name, cfg, agent, wait_daemon, _config_file=path)

