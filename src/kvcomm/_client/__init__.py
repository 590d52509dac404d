"""The client every agent opens: ``kvcomm.open()`` → :class:`Client`.

Read path: L1 (this process, revalidated by one shared-memory word) → L2 (this host's
segment, lock-free) → (cluster mode) L3. Write path: validate and encode here, then one
locked copy-on-write store into L2. Everything shared is checked on the way in, so an
error never leaves a half-done write behind.

The client is built in layers, one module each; a layer may use the ones below it:

    client.py        Client: open(), stats, keys, presence, close — the facade
    scan.py          Scanning: ordered prefix scans (an ordered key index; L3's in cluster mode)
    watch.py         Watching: the host's change feed as Events
    counting.py      Counting: incr (a counter CRDT in cluster mode)
    write.py         Writes: put, delete, update, batch; compare-and-set, validators
    cas.py           ClusterWrites: conditional writes in cluster mode, decided on L3
    read.py          Reads: get, get_item; L1, L2, zero-copy views
    cluster_read.py  ClusterReads: an L2 miss in cluster mode (negative cache, key filter, L3)
    merge.py         Merging: a version from elsewhere into L2; RemoteMerges, the node
                     daemon's face over it (node/port.py)
    hotkeys.py       HotKeys: sampled reads into the host's sketch
    base.py          ClientBase: the state, keys, versions, codec, the raw L2 read
  beside them:
    items.py         Item, Event, ABSENT
    counters.py      counters in L2 records: an incr's start, a counter's delete and merge
    batch.py         Batch (kv.batch())
    attach.py        one L2 mapping and one L1 per (process, namespace); views; fork()
    sweeper.py       the expiry sweep (one thread per process and namespace)
    presence.py      Presence (kv.presence(): a key kept alive by refreshes)
    validators.py    a validator's run and the read-modify-write retry bound (every write path)

``get`` is special: on a live client it is the C getter itself (``kvcomm._l2core.Getter``,
an instance attribute: no Python frame on an L1 hit); ``Reads.get`` is what it does.
"""

from __future__ import annotations

from .batch import Batch
from .client import Client, open  # noqa: A004
from .items import ABSENT, Event, Item
from .presence import Presence

__all__ = ["ABSENT", "Batch", "Client", "Event", "Item", "Presence", "open"]
