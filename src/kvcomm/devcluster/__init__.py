"""A whole KVCOMM cluster on one machine, for people trying cluster mode, for the soak and
the fault tools, for tests and for benchmarks: real servers, never mocks.

``kvcomm dev-cluster up --hosts 3 --dir DIR`` (or :func:`up`) starts a Redis Cluster, a
3-member etcd cluster and one node daemon per simulated host and writes each host's
config into ``DIR``; ``kvcomm dev-cluster down --dir DIR`` (:func:`down`) stops it.
Needs Debian's ``redis-server``, ``redis-cli`` and ``etcd`` (package ``etcd-server``) and
``pip install 'kvcomm[cluster]'``.

Modules
-------
* :mod:`~kvcomm.devcluster.control`: :func:`up`, :func:`down` and the levers faults pull
  (:func:`restart_daemon`, :func:`kill_redis`, :func:`restart_redis`,
  :func:`wait_redis_whole`, :func:`daemon_alive`, :func:`kill_etcd`,
  :func:`restart_etcd`, :func:`partition`, :func:`heal`, :func:`set_clock_offset`),
  over the state in ``DIR/cluster.json``.
* :mod:`~kvcomm.devcluster.etcd_cluster`: :class:`EtcdCluster`, etcd members on free
  loopback ports with their data on tmpfs, with kill, pause and restart.
* :mod:`~kvcomm.devcluster.redis_cluster`: :class:`RedisCluster`, a Redis Cluster of
  ``redis-server`` processes on free loopback ports (3 masters + 3 replicas by default),
  with kill, pause, restart and "wait until whole" for fault tests; talks to the nodes
  over plain sockets, so it needs no client library.
* :mod:`~kvcomm.devcluster.redis_server`: :class:`RedisServer`, one standalone
  ``redis-server`` (the peer the demo and benchmarks compare with).
* :mod:`~kvcomm.devcluster.procs`: starting, signalling and stopping those processes.
"""

from .control import (
    daemon_alive,
    down,
    drop_connections,
    etcd_leader,
    heal,
    kill_etcd,
    kill_redis,
    load_state,
    partition,
    pause_etcd,
    restart_daemon,
    restart_etcd,
    restart_redis,
    save_state,
    set_clock_offset,
    spawn_daemon,
    up,
    wait_redis_whole,
)
from .etcd_cluster import EtcdCluster, etcd_path
from .redis_cluster import RedisCluster
from .redis_server import RedisServer, redis_server_path

__all__ = ["EtcdCluster", "RedisCluster", "RedisServer", "daemon_alive", "down",
           "drop_connections", "etcd_leader", "etcd_path", "heal", "kill_etcd", "kill_redis",
           "load_state", "partition", "pause_etcd", "redis_server_path", "restart_daemon",
           "restart_etcd", "restart_redis", "save_state", "set_clock_offset", "spawn_daemon",
           "up", "wait_redis_whole"]
