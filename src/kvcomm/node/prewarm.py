"""The node daemon's prewarm and load saves (docs/design/daemon.md, theory of
operation, 3 and 5): every couple of seconds the host's hot keys (the host-wide sketch of
agents' reads) are saved to L3 and any of them missing from L2 read back in, and the
per-group operation counts that changed are saved (``kvn:{host}:load``, for
``kvcomm balance``); a daemon that starts prewarms L2 from the list its predecessor saved.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..tiers.l3 import Unreached

if TYPE_CHECKING:
    from .daemon import Daemon

HOT_KEYS = 64  # hot keys saved and kept in L2 per host
HOT_EVERY = 2.0  # seconds between saves of the hot keys (and the prewarm that follows)


class Prewarm:
    """Saves the hot keys and the load counts, and reads the hot keys into L2; owns
    what L3 was last sent of both."""

    def __init__(self, d: Daemon) -> None:
        self.d = d
        self.port, self.l3, self.q = d.port, d.l3, d.quarantine
        self.clock, self.host, self.stats, self.load = d.clock, d.host, d.stats, d.load
        self.load_saved: dict[int, int] = {}  # what L3 holds of the load counts
        self.hot_list: list[str] = []  # the hot keys last saved
        self.hot_saved = d.clock()

    def warm(self, keys: list[str]) -> int:
        """Read into L2 the keys of ``keys`` it does not hold; returns how many came in.

        A key whose L3 record fails is set aside. Raises Unavailable."""
        n = 0
        for key in keys:
            if self.port.holds(key):
                continue
            try:
                n += bool(self.q.guarded(key, "prewarm", self._fetch_and_apply, key, False))
            except Unreached:  # (its master is taken for down: the others' keys come in)
                self.stats.bump("unreached_prewarm")
        return n

    def _fetch_and_apply(self, key: str, tombstones: bool) -> bool:
        """Read ``key``'s record from L3 into L2 (a tombstone only if ``tombstones``);
        True if there was one to apply."""
        rec = self.l3.get(key)
        if rec is None or (rec.tombstone and not tombstones):
            return False
        return self.d.puller.apply_or_forget(key, rec)

    def maybe_prewarm(self) -> None:
        if self.clock() - self.hot_saved < HOT_EVERY:
            return
        self.hot_saved = self.clock()
        hot = self.port.hot_keys(HOT_KEYS)
        try:
            if hot and hot != self.hot_list:  # (unchanged: L3 has it; an idle host sends nothing)
                self.l3.save_hot(self.host, hot)
                self.hot_list = hot
            if hot:
                self.stats.bump("prewarmed", self.warm(hot))
            self.save_load()
        except Unreached:  # (a master down: the host's own keys', or a hot key's; next time)
            self.stats.bump("unreached_saves")

    def save_load(self) -> None:
        """Save the per-group operation counts that changed (for ``kvcomm balance``).
        Raises Unavailable."""
        changed = {g: n for g, n in self.load.items() if self.load_saved.get(g) != n}
        if changed:
            self.q.guarded(f"kvn:{{{self.host}}}:load", "saving load counts",
                           self.l3.save_load, self.host, changed)
            self.load_saved.update(changed)

