"""The HTTP endpoint Prometheus scrapes: one per host (the node daemon's, or ``kvcomm
metrics``'). Needs kvcomm[metrics] (prometheus-client)."""

from __future__ import annotations

import errno
import socket
from typing import Any

from .._extras import require
from ..errors import ConfigError
from .collector import Collector
from .registry import metrics_url


class Exporter:
    """Serves one namespace's families at ``http://host:port/metrics`` from a daemon
    thread until :meth:`close`. ``port`` 0 picks a free port (``self.port`` says which).
    ``seg``: an L2Segment, or a callable returning the one to read at each scrape (see
    :class:`~kvcomm.metrics.collector.NamedSegment`). Raises ConfigError naming
    metrics.host (an address this machine cannot listen on) or metrics.port (taken)."""

    def __init__(self, seg: Any, config: Any, port: int | None = None,
                 host: str | None = None) -> None:
        require("prometheus_client", extra="metrics", purpose="the metrics exporter")
        from prometheus_client import CollectorRegistry, start_http_server

        m = config.metrics
        self.host = host if host is not None else m.host
        want = port if port is not None else m.port
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(Collector(seg, config))
        try:
            self._server, self._thread = start_http_server(want, self.host, self.registry)
        except OSError as exc:
            why = exc.strerror or str(exc)
            if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
                raise ConfigError("metrics.host", f"cannot listen on {self.host!r} ({why}); "
                                  "give an address of this machine (127.0.0.1, or 0.0.0.0 "
                                  "for every interface)") from None
            raise ConfigError("metrics.port", f"cannot serve metrics on {self.host}:{want} "
                              f"({why}); choose a free port") from None
        self.port: int = self._server.server_address[1]

    @property
    def url(self) -> str:
        return metrics_url(self.host, self.port)

    def text(self) -> str:
        """The exposition text a scrape gets now (for tests and tools)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
