"""Fault injection and a cluster soak that ship with the package: ``kvcomm soak``.

Modules
-------
* :mod:`~kvcomm.faults.fault`: the :class:`~kvcomm.faults.fault.Fault` interface and
  registry.
* :mod:`~kvcomm.faults.nemesis`: the seeded schedule, the :class:`~kvcomm.faults.nemesis.Nemesis` that runs it
  and records every injection.
* :mod:`~kvcomm.faults.kinds`: the built-in faults (pause, kill and restart a node
  daemon; kill a Redis master and bring it back as a replica; trim a change-feed
  stream; overflow a host's L2 change feed; force L2 evictions; kill or pause an etcd
  member, the leader included; partition a host; drop a host's connections).
* :mod:`~kvcomm.faults.proxy`: the fault proxy in front of every server a host uses
  (blackhole, delay, drop connections), driven through an owner-only control socket.
* :mod:`~kvcomm.faults.linearizability`: the pure Wing-Gong/Lowe checker of register
  histories (put, get, delete, compare-and-set; operations of unknown outcome).
* :mod:`~kvcomm.faults.target`: the dev cluster as faults see it (processes, Redis
  nodes, L3, a recording client per host).
* :mod:`~kvcomm.faults.history`: recorded operations (JSON lines) and the recording
  client.
* :mod:`~kvcomm.faults.checker`: the pure checker: nothing acknowledged lost, no delete
  undone, no phantom, every place in the same state.
* :mod:`~kvcomm.faults.soak`: the whole run behind ``kvcomm soak``.

Adding a fault: derive from :class:`~kvcomm.faults.fault.Fault`, give it a ``name``,
what it ``requires`` of the target and how long it is held, implement ``inject(rng)``
(choose only with ``rng``, return what was done) and ``heal()``, decorate it with
:func:`~kvcomm.faults.fault.register`, and import its module before the nemesis
starts. ``kvcomm soak --faults NAME`` then runs it; nothing in the runner changes.
"""

from .checker import Anomaly, Observed, Verdict, check
from .fault import FAULTS, Fault, register
from .history import Op, Recorder, load_history
from .nemesis import Injection, Nemesis, fault_kinds, plan

__all__ = ["FAULTS", "Anomaly", "Fault", "Injection", "Nemesis", "Observed", "Op", "Recorder",
           "Verdict", "check", "fault_kinds", "load_history", "plan", "register"]
