"""The hosts a cluster knows, and where each serves its metrics (``kvcomm top --cluster``).

Today the registry is L3 itself: every daemon keeps its feed cursors under
``kvn:{host}:cursors`` and, when it exports metrics, its address under
``kvn:{host}:metrics``; :class:`L3Registry` lists both. When hosts hold leases (the etcd
work), a lease-backed registry implements the same :class:`HostRegistry` protocol and
``top`` takes it instead: it is the one seam.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import KVCommError

if TYPE_CHECKING:
    from ..tiers.l3 import DaemonL3

log = logging.getLogger("kvcomm.metrics")


@dataclass(frozen=True)
class HostEntry:
    """A host the cluster knows: its id and its metrics URL (None: it exports none)."""

    host: str
    metrics_url: str | None
    state: str = "known"  # "known" (cursors or an address in L3); leases will say more


class HostRegistry(Protocol):
    def hosts(self) -> list[HostEntry]: ...


def _key(host: str) -> str:
    return f"kvn:{{{host}}}:metrics"


def metrics_url(addr: str, port: int) -> str:
    """The URL of an exporter at ``addr`` (a name, an IPv4 or an IPv6 address) and ``port``."""
    host = f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr
    return f"http://{host}:{port}/metrics"


def publish(store: DaemonL3, host: str, addr: str, port: int) -> None:
    """Record ``host``'s metrics address in L3 (``store``: the daemon's). Logged, never
    raised: metrics must not stop a daemon."""
    url = metrics_url(addr, port)
    try:
        store.set_own(_key(host), url.encode())
    except KVCommError as exc:
        log.warning("could not publish the metrics address in L3: %s", exc)


class L3Registry:
    """The hosts L3 knows (feed cursors, metrics addresses), over an L3Store."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def hosts(self) -> list[HostEntry]:
        """Every host with cursors or a metrics address in L3, sorted. Raises Unavailable."""
        st = self.store
        names: set[str] = set()

        def scan() -> list[bytes]:
            return list(st.rc.scan_iter(match="kvn:{*}:*", count=1000))

        for raw in st._call(scan):
            head, sep, rest = raw.partition(b"}:")
            if sep and head.startswith(b"kvn:{") and rest in (b"cursors", b"metrics"):
                names.add(head[5:].decode("utf-8", "replace"))
        out = []
        for host in sorted(names):
            url = st._call(lambda host=host: st.rc.get(_key(host)))
            out.append(HostEntry(host, url.decode() if isinstance(url, bytes) else None))
        return out
