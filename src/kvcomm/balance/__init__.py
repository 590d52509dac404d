"""Load-aware slot balancing for the Redis Cluster that serves as L3.

* :mod:`~kvcomm.balance.model`: the one contract: :class:`ClusterView` (the cluster at
  one moment, per node and per slot), :class:`Move` and the :class:`Policy` protocol,
  which the live driver and the simulator both feed.
* :mod:`~kvcomm.balance.policy`: the two policies behind it, threshold (Anna's rule,
  its knobs tuned in the simulator) and learned (a cost model trained in the
  simulator), shipped as JSON numbers (``balance_model.json``); ``make_policy``.
* :mod:`~kvcomm.balance.signals`: the load of a real cluster (INFO, LATENCY, the hosts'
  per-group command counts and hot keys) as a ClusterView.
* :mod:`~kvcomm.balance.migrate`: moving one slot between masters with Redis Cluster's
  own protocol, writes flowing, nothing lost.
* :mod:`~kvcomm.balance.driver`: ``kvcomm balance``: watch, decide, move, log.
* :mod:`~kvcomm.balance.sim`, :mod:`~kvcomm.balance.workloads`,
  :mod:`~kvcomm.balance.train`: a slot-level simulator, its workloads, the training
  of the learned policy and the tuning of the threshold one.
* :mod:`~kvcomm.balance.cli`: ``kvcomm balance`` (live), ``simulate`` and ``train``.
"""
