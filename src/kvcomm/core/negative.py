"""The negative cache: "this key was absent" remembered for ``ttl`` seconds. Pure.

A read that found nothing anywhere notes the key; reads within ``ttl`` answer "absent"
without a cluster round trip. A local put of the key forgets it at once
(:meth:`NegativeCache.invalidate`), so a host never hides its own write. At most
``max_entries`` keys are remembered; when full, the oldest note goes first. The caller
passes the time (monotonic seconds).

A note carries a *stamp* and a flag, which the caller gives and reads back
(:meth:`NegativeCache.entry`): in cluster mode, the host's count of keys learned when
the key was found absent, and whether the host's key filter already matched the key
then (:mod:`kvcomm.tiers.keyfilter`); so a note older than what the host's daemon has
learned since is asked again (:meth:`kvcomm._client.cluster_read.ClusterReads._still_absent`).
"""

from __future__ import annotations

from collections import OrderedDict


class NegativeCache:
    def __init__(self, ttl: float = 5.0, max_entries: int = 100_000) -> None:
        if ttl < 0 or max_entries < 1:
            raise ValueError("ttl must be >= 0 and max_entries >= 1")
        self.ttl, self.max_entries = ttl, max_entries
        # key -> [until, stamp, matched]
        self._until: OrderedDict[str, list[float | int | bool]] = OrderedDict()
        self.hits = 0
        self.evictions = 0

    def note_absent(self, key: str, now: float, stamp: int = 0, matched: bool = True) -> None:
        """Remember ``key`` absent until ``now + ttl``, with the caller's ``stamp`` and
        ``matched`` flag (read back by :meth:`entry`)."""
        self._until.pop(key, None)
        self._until[key] = [now + self.ttl, stamp, matched]
        if len(self._until) > self.max_entries:
            self._until.popitem(last=False)
            self.evictions += 1

    def entry(self, key: str, now: float) -> list[float | int | bool] | None:
        """The live note of ``key`` — ``[until, stamp, matched]``, which the caller may
        update in place (a new stamp) — or None (no note, or one past its ttl: dropped).
        Counts nothing: the caller says whether it answered from it (:meth:`hit`)."""
        e = self._until.get(key)
        if e is None:
            return None
        if now >= e[0]:
            del self._until[key]
            return None
        return e

    def hit(self) -> None:
        self.hits += 1

    def is_absent(self, key: str, now: float) -> bool:
        """Whether a live note of ``key`` answers "absent" (its stamp unchecked)."""
        if self.entry(key, now) is None:
            return False
        self.hits += 1
        return True

    def invalidate(self, key: str) -> None:
        self._until.pop(key, None)

    def __len__(self) -> int:
        return len(self._until)
