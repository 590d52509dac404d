"""Every metric family KVCOMM exports, once: name, type, help, and where its samples come
from. The collector (:mod:`.collector`) and ``kvcomm top`` read this table only.

A family's samples come from the segment's metrics region (the series of
``tiers/shm/layout.py`` whose name starts with the family's stem: the counters agents and
the daemon flush, the gauges the daemon stores), from the segment's header and tables
(``header``: a function of :meth:`MetricsRegion.header`'s dict), or both.

Adding a family is one line here (plus, for a counted one, its series appended to
``METRIC_SERIES``). Families still to come with the cluster features: partition mode,
lease state, strong-operation latency, slot migrations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

Labels = tuple[tuple[str, str], ...]
HeaderFn = Callable[[dict[str, int]], Sequence[tuple[Labels, float]]]


@dataclass(frozen=True)
class Family:
    """One exported family. ``stem``: its series' name in the metrics region (the name
    without ``kvcomm_``, ``_total`` kept); ``header``: samples derived from the segment's
    header, if any."""

    name: str
    kind: str
    help: str
    header: HeaderFn | None = field(default=None, compare=False)

    @property
    def stem(self) -> str:
        return self.name.removeprefix("kvcomm_")


def _one(key: str) -> HeaderFn:
    return lambda h: [((), h[key])]


FAMILIES: tuple[Family, ...] = (
    Family("kvcomm_reads_total", COUNTER,
           "Reads, by the tier asked and what it had: l1 hit|miss; l2 hit|miss (went on to "
           "the cluster)|absent (the final answer); l3 hit|absent"),
    Family("kvcomm_writes_total", COUNTER, "Writes that succeeded (put, or a delete that "
           "deleted), by consistency"),
    Family("kvcomm_op_seconds", HISTOGRAM, "Latency of sampled operations (1 in "
           "metrics.latency_sample), by op and the tier that served it"),
    Family("kvcomm_l2_entries", GAUGE, "Records in the host's L2 (tombstones included)",
           _one("entries")),
    Family("kvcomm_l2_bytes", GAUGE, "Bytes of L2's data heap in use", _one("bytes")),
    Family("kvcomm_l2_capacity_bytes", GAUGE, "Bytes of L2's data heap", _one("capacity")),
    Family("kvcomm_l2_evictions_total", COUNTER, "Clean entries L2 evicted to make room",
           _one("evictions")),
    Family("kvcomm_l2_recoveries_total", COUNTER, "Repairs of L2 after a writer died "
           "mid-write", _one("recoveries")),
    Family("kvcomm_l2_pins", GAUGE, "Zero-copy views pinning an L2 block now", _one("pins")),
    Family("kvcomm_feed_events_total", COUNTER, "Change-feed events: local (appended to L2's "
           "feed), cluster (read by the daemon from the cluster's feeds)",
           lambda h: [((("feed", "local"),), h["feed_head"])]),
    Family("kvcomm_feed_lag_events", GAUGE, "Events not yet taken: local (L2 feed events the "
           "daemon has not delivered), cluster (cluster feed entries the daemon has not read, "
           "as of its last check)",
           lambda h: [((("feed", "local"),), max(0, h["feed_head"] - h["sync_cursor"])
                       if h["cluster"] else 0)]),
    Family("kvcomm_window_writes_total", COUNTER, "Writes into the daemon's write window "
           "(in) and records pushed to L3 (out)"),
    Family("kvcomm_window_batches_total", COUNTER, "Write windows pushed to L3"),
    Family("kvcomm_l3_commands_total", COUNTER, "Redis commands sent by the host (daemon and "
           "agents' L3 reads)"),
    Family("kvcomm_l3_bytes_total", COUNTER, "Bytes to and from Redis, by direction"),
    Family("kvcomm_outbound_backlog", GAUGE, "Writes in L2 waiting for L3 (dirty records)",
           _one("dirty")),
    Family("kvcomm_guard_answers_total", COUNTER, "Reads of absent keys answered on the host "
           "without L3: by the key filter or the negative cache"),
    Family("kvcomm_errors_total", COUNTER, "KVCOMM errors made in the host's processes, by "
           "class (including those KVCOMM handled itself: a retried compare-and-set, a retried "
           "L3 call)"),
    Family("kvcomm_daemon_up", GAUGE, "1 while the host's node daemon heartbeats",
           _one("daemon_up")),
    Family("kvcomm_conflicts_total", COUNTER, "Compare-and-set writes refused (expect= did "
           "not match)"),
    Family("kvcomm_merges_total", COUNTER, "Versions from elsewhere merged into L2"),
    Family("kvcomm_resolver_failures_total", COUNTER, "Resolver calls that failed (LWW used)"),
    Family("kvcomm_views_total", COUNTER, "Zero-copy views handed out"),
    Family("kvcomm_batches_total", COUNTER, "kv.batch() blocks applied"),
    Family("kvcomm_updates_total", COUNTER, "kv.update() calls"),
    Family("kvcomm_daemon_resyncs_total", COUNTER, "Cluster feed groups the daemon resynced "
           "(a gap or a rewind)"),
    Family("kvcomm_daemon_set_aside_total", COUNTER, "Inputs the daemon set aside "
           "(quarantine)"),
    Family("kvcomm_daemon_l3_errors_total", COUNTER, "Daemon rounds that could not reach L3"),
    Family("kvcomm_partition_mode", GAUGE, "1 while the host's daemon is in partition mode "
           "(no Redis Cluster or no etcd majority for longer than cluster.lease_ttl)"),
    Family("kvcomm_lease_live", GAUGE, "1 while the host holds its etcd lease "
           "(kvc/hosts/<host>; 0 without cluster.etcd)"),
    Family("kvcomm_partitions_total", COUNTER, "Times the host's daemon entered partition mode "
           "since it started"),
)
BY_NAME = {f.name: f for f in FAMILIES}
HOT_KEYS = Family("kvcomm_hot_key_reads", GAUGE, "The host's most read keys (estimated reads, "
                  "a count-min sketch of sampled reads); at most metrics.hot_keys labels")
INFO = Family("kvcomm_host_info", GAUGE, "1, labelled with the host id and namespace")


def parse_series(series: str) -> tuple[str, Labels]:
    """``"reads_total{tier=l1,result=hit}"`` → ``("reads_total", (("tier", "l1"),
    ("result", "hit")))``."""
    name, _, rest = series.lstrip("=").partition("{")
    labels = tuple(tuple(p.split("=", 1)) for p in rest.rstrip("}").split(",") if p)
    return name, labels  # type: ignore[return-value]
