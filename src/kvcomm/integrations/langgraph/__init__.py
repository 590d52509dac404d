"""LangGraph persistence on KVCOMM: ``pip install 'kvcomm[langgraph]'``.

* :class:`KVCommSaver` — a checkpointer (``BaseCheckpointSaver``): each thread's state,
  resumable on any host (``saver.py`` says what holds with and without etcd).
* :class:`KVCommStore` — a store (``BaseStore``): memories shared by threads, agents and
  hosts, searched by namespace prefix with filters and paging (``store.py``).

Both take an open client::

    import kvcomm
    from kvcomm.integrations.langgraph import KVCommSaver, KVCommStore

    kv = kvcomm.open("agents")
    graph = builder.compile(checkpointer=KVCommSaver(kv), store=KVCommStore(kv))

Both also take a ``kvcomm.aio`` client (``await kvcomm.aio.open(...)``): their async
methods are then native (on the event loop; see ``_kv.run_async``).

Importing this module without LangGraph installed raises ConfigError naming the extra.
"""

from __future__ import annotations

from ..._extras import require

require("langgraph", extra="langgraph", purpose="kvcomm.integrations.langgraph")

from .saver import KVCommSaver, RunSuperseded  # noqa: E402
from .store import KVCommStore  # noqa: E402

__all__ = ["KVCommSaver", "KVCommStore", "RunSuperseded"]
