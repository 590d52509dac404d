"""The node daemon's side of the metrics: its own counts into L2, its exporter, and its
entry in the cluster's registry of hosts."""

from __future__ import annotations

import logging
import socket
from typing import Any

from ..tiers.shm.counters import series_word
from .agent import wire_counts
from .exporter import Exporter
from .registry import publish

log = logging.getLogger("kvcomm.metrics")
_W = series_word


def daemon_counts(daemon: Any) -> dict[int, int]:
    """The daemon's cumulative counts (DaemonStats, its L3 client's traffic), by word."""
    s = daemon.stats
    out = {
        _W("window_writes_total{side=in}"): s.extra.get("window_in", 0),
        _W("window_writes_total{side=out}"): s.pushed,
        _W("window_batches_total"): s.windows,
        _W("feed_events_total{feed=cluster}"): s.pulled + s.skipped_remote,
        _W("daemon_resyncs_total"): s.resyncs,
        _W("daemon_set_aside_total"): s.quarantined,
        _W("daemon_l3_errors_total"): s.l3_errors,
    }
    wire = getattr(daemon.l3, "wire", None)
    if wire is not None:
        wire_counts(wire, out)
    return out


def cluster_lag(daemon: Any) -> int:
    """Cluster feed entries the daemon has not read yet, as of its last check of the
    groups' counters (0 before the first)."""
    counters = daemon.feed_counters or {}
    seqs = daemon.inb.seqs
    return sum(max(0, c - (seqs.get(g) or 0)) for g, c in counters.items() if c is not None)


def cluster_state(daemon: Any) -> dict[int, int]:
    """Partition mode, the host's lease, and how often it was partitioned, by word."""
    reach, presence = getattr(daemon, "reach", None), getattr(daemon, "presence", None)
    return {_W("partition_mode"): int(bool(reach and reach.partition)),
            _W("lease_live"): int(bool(presence and _lease_live(presence))),
            _W("partitions_total"): int(reach.entered) if reach else 0}


def _lease_live(presence: Any) -> bool:
    live = getattr(presence, "lease_live", None)  # (HostPresence; a stand-in: its lease)
    return bool(live()) if callable(live) else bool(presence.lease)


def attach_daemon(daemon: Any) -> Exporter | None:
    """Flush ``daemon``'s counts with its client's, and (``metrics.port`` set) serve the
    host's metrics and publish where in the cluster's registry. Returns the exporter
    (None without a port); raises ConfigError (kvcomm[metrics] missing, port taken)."""
    meter = daemon.kv._meter
    meter.add_source(lambda: daemon_counts(daemon))
    meter.add_gauges(lambda: {_W("feed_lag_events{feed=cluster}"): cluster_lag(daemon),
                              **cluster_state(daemon)})
    config = daemon.config
    if not config.metrics.port:
        return None
    exporter = Exporter(daemon.kv._seg, config)
    log.info("metrics at %s", exporter.url)
    publish(daemon.store, daemon.host, advertised(config.metrics.advertise, exporter.host),
            exporter.port)
    return exporter


_EVERY_INTERFACE = ("", "0.0.0.0", "::", "[::]")


def advertised(advertise: str, listen: str) -> str:
    """The address to publish for other machines: ``advertise`` if set, else the listen
    address, or this machine's name when that is every interface (a wildcard in the
    registry would make each reader scrape its own host)."""
    if advertise:
        return advertise
    if listen not in _EVERY_INTERFACE:
        return listen
    name = socket.gethostname()
    log.info("metrics listen on every interface (%s): publishing this machine's name %r "
             "for kvcomm top --cluster; set metrics.advertise if others reach it otherwise",
             listen or "''", name)
    return name
