"""Metrics: what KVCOMM does on a host, for Prometheus, ``kvcomm top`` and load tests.

Theory of operation
-------------------
* **Agents count in the host's L2, exactly and cheaply.** Each process counts in plain
  integers (the C getter's hits, the client's counters, its L3 client's wire counts) and a
  background thread adds the deltas to the segment's metrics region with atomic adds once
  a second and at close (:mod:`.agent`). Nothing is counted in shared memory per
  operation, and no process writes files of its own (no ``PROMETHEUS_MULTIPROC_DIR``).
* **Latency is sampled**: one operation in ``metrics.latency_sample`` is timed (the C
  getter times its L1 and L2 hits itself), into fixed buckets
  (``tiers/shm/layout.py``: ``LATENCY_BOUNDS_NS``).
* **One process per host exposes them** with prometheus-client through a custom
  collector (:mod:`.collector`, families in :mod:`.families`): the node daemon in cluster
  mode (``metrics.port``), or ``kvcomm metrics --name NS --port P`` in embedded mode. The
  daemon adds its own counts (write window, feeds, L3 traffic) to the same region, so any
  exporter of a namespace shows the same figures.
* **Hot keys** come from the segment's sketch: the top ``metrics.hot_keys`` as a gauge
  with at most that many label values (truncated or hashed keys).
* ``kvcomm top`` reads the same families (:mod:`.snapshot`), from the host's L2 or, with
  ``--cluster``, from every host's exporter listed in the cluster's registry
  (:mod:`.registry`).

prometheus-client is imported only by the exporter (``kvcomm[metrics]``); agents need
nothing beyond the base install to count.
"""
