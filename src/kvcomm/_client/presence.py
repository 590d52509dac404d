"""Agent presence on top of per-key expiry: ``kv.presence()`` and ``kv.present()``.

An agent that is alive keeps the key ``prefix + agent_id`` written with ``ttl``: a
background thread re-puts it every ``ttl / 3``, each put pushing its deadline ``ttl``
ahead. When the agent stops the handle, or its process dies (kill -9 included: nothing
has to run at death), the refreshes stop and the key expires at most ``ttl`` after the
last one — on every host at once, since every read compares the record's deadline with
the clock (hosts' clocks are assumed within ``cluster.max_clock_skew``). So within
``ttl + ttl / 3`` of a death, no host lists the agent. ``kv.present(prefix)`` lists the
live ones through :meth:`Client.scan` (cluster-wide in cluster mode), in key order.

A refresh that fails (a partitioned host, L2 full) is retried at the next tick and
counted (``Presence.failures``); while it keeps failing the key lapses, which is what its
neighbours should believe about an agent they cannot hear from.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from .._threads import start_quiet
from ..core.expiry import check_ttl
from ..errors import InvalidArgument, InvalidKey, KVCommError

if TYPE_CHECKING:
    from .client import Client


class Presence:
    """The handle of an agent's presence (see the module docstring). Use it as a context
    manager, or call :meth:`stop`."""

    def __init__(self, client: Client, prefix: str, agent_id: str, ttl: float,
                 value: Any) -> None:
        self.key = prefix + agent_id
        self.ttl = ttl
        self.interval = ttl / 3
        self.refreshes = 0
        self.failures = 0
        self.last_error: KVCommError | None = None
        self._client = client
        self._value = value
        self._stop = threading.Event()
        client.put(self.key, value, ttl=ttl)  # (raises here: a bad key, no room...)
        self.refreshes = 1
        self._thread = threading.Thread(target=self._run, name=f"kvcomm-presence-{self.key}",
                                        daemon=True)
        start_quiet(self._thread)

    def _run(self) -> None:
        nxt = time.monotonic() + self.interval
        while not self._stop.wait(max(0.0, nxt - time.monotonic())):
            nxt += self.interval
            try:
                self._client.put(self.key, self._value, ttl=self.ttl)
                self.refreshes += 1
            except KVCommError as exc:  # (closed, partitioned: counted, tried again)
                self.failures += 1
                self.last_error = exc
                if self._client._closed:
                    return
            if nxt < time.monotonic():  # (a stalled process: no burst of catch-up puts)
                nxt = time.monotonic() + self.interval

    @property
    def alive(self) -> bool:
        """Whether the refresh thread still runs."""
        return self._thread.is_alive()

    def stop(self, *, remove: bool = False) -> None:
        """Stop refreshing: the key lapses at its deadline (at most ``ttl`` from now); with
        ``remove`` it is deleted now. Waits for the refresh thread (at most one put).
        Raises what :meth:`Client.delete` raises (``remove`` only)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, self.ttl))
        if remove:
            self._client.delete(self.key)

    def __enter__(self) -> Presence:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<kvcomm.Presence {self.key!r} ttl={self.ttl} {'alive' if self.alive else 'stopped'}>"


def start_presence(client: Client, prefix: str, agent_id: str, ttl: Any, value: Any) -> Presence:
    """Validate and start (see :meth:`Client.presence`)."""
    if type(prefix) is not str or type(agent_id) is not str:
        raise InvalidKey("presence(prefix, agent_id): both are str, such as ('alive/', 'drone-7')")
    if not agent_id:
        raise InvalidKey("presence needs a non-empty agent_id (the key is prefix + agent_id)")
    t = check_ttl(ttl, allow_none=False)
    assert t is not None
    if t < 0.03:
        raise InvalidArgument(f"a presence ttl of {t} s is refreshed every {t / 3:.4f} s: use "
                              "at least 0.03 s (2 s is the default)")
    return Presence(client, prefix, agent_id, t, value)
