"""Routing a host's Redis connections through the addresses it can reach.

``cluster.address_remap`` maps the address a Redis node announces (in CLUSTER SLOTS, in
MOVED redirections) to the address this host reaches it at: a NAT, a tunnel, or the dev
cluster's fault proxy (:mod:`kvcomm.faults.proxy`). redis-py's
``RedisCluster(address_remap=...)`` applies the map to the nodes CLUSTER SLOTS lists but
follows a MOVED redirection (after a failover, say) to the announced address as it is
(redis-py issue 3382): behind a proxy that connection would bypass it, and a partitioned
host would still reach that node. :func:`follow_remap` closes that gap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Address = tuple[str, int]


def follow_remap(rc: Any, remap: Callable[[Address], Address]) -> None:
    """Make redis-py's RedisCluster ``rc`` apply ``remap`` to MOVED and ASK redirections
    too: it applies ``address_remap`` to the nodes CLUSTER SLOTS lists, but follows a
    MOVED (after a failover, say) to the address the node announces, which would bypass
    the host's proxy (redis-py issue 3382). ``remap`` must leave an address it does not
    know unchanged (``ClusterConfig.remap_address`` does)."""
    nm = rc.nodes_manager
    move_slot, initialize, get_node = nm.move_slot, nm.initialize, rc.get_node

    def remapped_move_slot(e: Any) -> Any:
        e.host, e.port = remap((e.host, int(e.port)))
        e.node_addr = (e.host, e.port)
        return move_slot(e)

    def remapped_initialize(*args: Any, **kwargs: Any) -> Any:
        extra = kwargs.get("additional_startup_nodes_info")
        if extra:
            kwargs["additional_startup_nodes_info"] = [remap((h, int(p))) for h, p in extra]
        return initialize(*args, **kwargs)

    def remapped_get_node(host: str | None = None, port: int | None = None,
                          node_name: str | None = None) -> Any:
        if node_name is not None and host is None:
            h, _, p = node_name.rpartition(":")
            if p.isdigit():
                h, pp = remap((h, int(p)))
                node_name = f"{h}:{pp}"
        elif host is not None and port is not None:
            host, port = remap((host, int(port)))
        return get_node(host, port, node_name)

    nm.move_slot = remapped_move_slot
    nm.initialize = remapped_initialize
    rc.get_node = remapped_get_node
