"""Affinity placement: observe which agents read whose state, and plan hosts for them.

Agents that read each other's state a lot should share a host: there, a write is seen
within microseconds (one L2), while across hosts it waits for the write window and the
change feeds. This package observes who reads whom and plans where agents should run.

Modules
-------
* :mod:`~kvcomm.placement.agents`: agent ids (``kvcomm.open(..., agent="drone-7")``) and
  the writer's id in each record's extension field.
* :mod:`~kvcomm.placement.report`: what each agent samples of its reads, written to a
  small per-host table (one file per agent).
* :mod:`~kvcomm.placement.observe`: the node daemon publishes its host's table to L3;
  ``kvcomm placement observe`` turns the whole cluster's into a graph (the contract of
  :mod:`~kvcomm.placement.graph`).
* :mod:`~kvcomm.placement.graph`: the graph and plan formats (contracts), validated.
* :mod:`~kvcomm.placement.plan`: ``kvcomm placement plan``: hosts for agents (needs
  ``pip install 'kvcomm[placement]'``, networkx).
* :mod:`~kvcomm.placement.launcher`: starts agents on a dev cluster's hosts by a plan.
* :mod:`~kvcomm.placement.cost`: what a re-planning move costs in L3 bytes, and when it
  pays for itself (the launcher's re-planning loop weighs each move with it).

Importing this package loads none of them.
"""
