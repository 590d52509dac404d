"""Load-aware slot balancing for the Redis Cluster that serves as L3.

* :mod:`~kvcomm.balance.model`: :class:`ClusterView` (the cluster at one moment, per
  node and per slot) and :class:`Move`; the :class:`Policy` protocol.
* :mod:`~kvcomm.balance.policy_threshold`: the threshold policy (a node is hot when its
  load exceeds the mean plus k standard deviations, for a monitor period; a moved slot
  rests for a grace period).
* :mod:`~kvcomm.balance.signals`: the load of a real cluster (INFO, LATENCY, the hosts'
  per-group write counts and hot keys) as a ClusterView.
* :mod:`~kvcomm.balance.migrate`: moving one slot between masters with Redis Cluster's
  own protocol, writes flowing, nothing lost.
* :mod:`~kvcomm.balance.driver`: ``kvcomm balance``: watch, decide, move, log.
"""
