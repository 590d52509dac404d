"""The node daemon's upkeep of the host's filter of existing keys
(:mod:`kvcomm.tiers.keyfilter`; docs/design/daemon.md, theory of operation, 4): built
from a scan of L3 at start, fed with every key seen in the feeds, rotated now and then so
deleted keys age out. A master that does not answer the start's scan (it hangs) is left
out, and the filter distrusted as during a heal's catch-up until its groups are scanned,
once it answers (:attr:`KeyFilterKeeper.unscanned`); no rotation is made while a master
is taken for down.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ..errors import Unavailable

if TYPE_CHECKING:
    from .daemon import Daemon

log = logging.getLogger("kvcomm.node")


class KeyFilterKeeper:
    """Fills, rotates and completes the key filter; owns when it was built and which
    groups it lacks."""

    def __init__(self, d: Daemon) -> None:
        self.d = d
        self.port, self.l3, self.keys, self.config = d.port, d.l3, d.keys, d.config
        self.clock, self.stats = d.clock, d.stats
        self.rebuild_every = d.config.cluster.key_filter_rebuild
        self.filter_built = d.clock()  # (set by fill)
        # the keys L2 holds (tombstones too) that the start's scan found in L3: the
        # start's resync re-reads them (then cleared)
        self.held_at_start: set[str] = set()
        # groups whose keys the key filter may lack: their master did not answer the
        # start's scan (it hangs); scanned once it answers (scan_unscanned), the filter
        # distrusted until then (the catch-up's: PartitionMode.caught_up)
        self.unscanned: set[int] = set()
        self.unscanned_ups = -1  # DaemonL3.ups at the last try of those scans

    def fill(self, initial: bool = False) -> None:
        """Initial fill (both generations) or a rotation (the older one, refilled)."""
        skipped: set[int] = set()  # (groups of masters that did not answer: not scanned)
        if initial:  # (and note the keys L2 holds, tombstones too, for the start's resync)
            self.keys.set_ready(False)
            self.scan_into(self.scanned_into(self.held_at_start), self.l3.scan_keys(skipped))
            if skipped:
                # a hung master must not keep the host from starting, nor its keys be
                # answered "absent": agents ask L3 (which answers Unreached for them)
                # until they are scanned and every feed is read
                self.unscanned = skipped
                self.stats.bump("unscanned_at_start", len(skipped))
                log.warning("the key filter lacks the keys of %d group(s) whose Redis master "
                            "did not answer: agents read L3 until it answers and they are "
                            "scanned", len(skipped))
                self.d.partition.distrust_filter()
            else:
                self.keys.set_ready(True)
        else:
            target = self.keys.begin_rotation()
            self.scan_into(target.add, self.l3.scan_keys(skipped))
            if skipped:  # (a master hung meanwhile: the current generation keeps answering;
                self.stats.bump("key_filter_rotations_put_off")  # tried again once it answers)
                return
            self.keys.end_rotation()
            self.stats.bump("key_filter_rotations")
        self.filter_built = self.clock()

    def scan_unscanned(self) -> None:
        """Scan into the key filter the groups the start's scan left out (their master
        did not answer), those whose master answers now: tried at start and after each
        master the pinger let go of (DaemonL3.ups). Raises Unavailable; the groups not
        scanned yet stay :attr:`unscanned`."""
        ups = self.l3.ups
        if ups == self.unscanned_ups:
            return
        self.unscanned_ups = ups
        down = self.l3.down_groups(self.unscanned)
        try:
            for g in sorted(self.unscanned - down):
                self.scan_into(self.keys.add, self.l3.scan_group(g))
                self.unscanned.discard(g)
        except Unavailable:
            self.unscanned_ups = -1  # (tried again next round, not at the next ups only)
            raise
        if not self.unscanned:
            log.info("the key filter holds the keys of every group again")

    def scan_into(self, add: Any, keys: Iterable[bytes]) -> None:
        for n, kb in enumerate(keys):
            add(kb)
            if n % 4096 == 0:  # a long scan must not look like a dead daemon to agents
                self.keys.beat()
                if self.d.started:  # (L2's heartbeat also says "started": not before that)
                    self.port.heartbeat()

    def scanned(self, kb: bytes, held: set[str]) -> None:
        """A key exists in L3: into the key filter; and if L2 holds it, a tombstone
        included (``held_keys`` leaves those out), into ``held``: the keys a resync
        re-reads, since the missed entries may have brought it back."""
        self.keys.add(kb)
        try:
            key = kb.decode("utf-8")
        except UnicodeDecodeError:  # not a key of ours: L3 keys are strict UTF-8
            return
        if key not in held and self.port.holds(key):
            held.add(key)

    def scanned_into(self, held: set[str]) -> Callable[[bytes], None]:
        """:meth:`scanned` with ``held`` bound: what a scan calls for each key."""
        return lambda kb: self.scanned(kb, held)

    def maybe_rotate(self) -> None:
        if (self.clock() - self.filter_built > self.rebuild_every
                or self.keys.adds_since_rotation >= self.config.cache.bloom_capacity):
            if self.unscanned or self.l3.down:
                return  # (a scan now would leave a hung master's keys out: once it answers)
            self.fill()

