"""Cluster metadata: KVCOMM's own keys that describe the whole cluster — the group count
L3 was initialised with (``kvm:groups``: a host configured with another refuses to start),
whether the key index covers every record (``kvm:index``), and L3's copy of which keys the
cluster keeps strong (``kvm:strong``, copied from etcd for agents without it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from ...errors import ConfigError, CorruptRecord
from ..groups import LEGACY_GROUPS
from ..groups import groups as _groups
from .connection import Connection
from .feed import _as_seq
from .records import seq_key

META_GROUPS = "kvm:groups"  # the group count L3 was initialised with
META_INDEX = "kvm:index"  # set once the key index covers every record (backfill_index)
# which keys the cluster keeps strong, copied from etcd (kvc/config/*) by every daemon that
# checked its config there, for agents without cluster.etcd (L3Store.strong_config)
META_STRONG = "kvm:strong"
STRONG_MAX = 65536  # the most bytes of META_STRONG read: more is not a value we wrote

class ClusterMeta:
    """Reads and records the cluster's metadata (:data:`META_GROUPS`,
    :data:`META_STRONG`) through ``conn``."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def record_strong_config(self, prefixes: Sequence[str], default: str) -> None:
        """Record which keys the cluster keeps strong (``cache.strong_prefixes`` and
        ``cache.l3_consistency``) in L3's :data:`META_STRONG`, replacing what is there. Only
        a daemon whose config etcd just confirmed calls it: etcd holds the cluster's
        choice, this is its copy for agents without ``cluster.etcd``. Raises Unavailable
        (nothing written)."""
        doc = {"strong_prefixes": sorted(set(prefixes)), "l3_consistency": default}
        data = json.dumps(doc, separators=(",", ":")).encode()
        self.conn.call(lambda: self.conn.rc.set(META_STRONG, data), META_STRONG)

    def strong_config(self) -> tuple[list[str], str] | None:
        """The cluster's strong prefixes and ``cache.l3_consistency`` as L3's copy of etcd's
        records them (:meth:`record_strong_config`), or None when none is recorded (no
        daemon with ``cluster.etcd`` has started since KVCOMM copied it; an empty value
        reads the same). Raises ConfigError when :data:`META_STRONG` holds anything else
        (not JSON, over STRONG_MAX bytes, not a string, wrong types: parsed as JSON data
        only, never run), Unavailable when L3 cannot be reached."""
        def bad(what: str) -> ConfigError:
            return ConfigError("cluster.etcd", f"L3's {META_STRONG} (which keys the cluster "
                               f"keeps strong, copied from etcd) {what}: it was not written "
                               "by KVCOMM; give this agent the host's cluster.etcd (it then "
                               f"asks etcd), or DEL {META_STRONG} and restart a node daemon "
                               "that has cluster.etcd (it copies etcd's again)")

        try:
            raw = self.conn.call(lambda: self.conn.rc.getrange(META_STRONG, 0, STRONG_MAX), META_STRONG)
        except CorruptRecord:  # (WRONGTYPE: a list, a hash... under that name)
            raise bad("is not a string") from None
        if not raw:
            return None
        if len(raw) > STRONG_MAX:
            raise bad(f"is over {STRONG_MAX} bytes")
        try:
            doc = json.loads(bytes(raw).decode("utf-8"))
        except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
            raise bad(f"is not JSON ({bytes(raw)[:40]!r})") from None
        prefixes = doc.get("strong_prefixes") if isinstance(doc, dict) else None
        default = doc.get("l3_consistency") if isinstance(doc, dict) else None
        if (not isinstance(prefixes, list) or not all(isinstance(p, str) for p in prefixes)
                or default not in ("eventual", "strong")):
            raise bad("is not {\"strong_prefixes\": [str, ...], \"l3_consistency\": "
                      "\"eventual\" | \"strong\"}")
        return sorted(set(prefixes)), str(default)

    def check_groups(self, record: bool = False) -> int:
        """Check ``cluster.groups`` against the count L3 was initialised with; with
        ``record`` (a daemon starting), record it when L3 has none yet. Returns the count.

        Raises ConfigError naming both counts when they differ, or when L3 holds data an
        earlier KVCOMM wrote with 16 groups (before the count was recorded) and this host
        is configured with another, or (recording) when no count is recorded but a
        sample of the records (a SCAN) shows another count wrote them (``kvm:groups``
        lost: a failover before it replicated, a deletion); Unavailable when L3 cannot be
        reached. Nothing is written then.
        """
        count = len(self.conn.groups)
        raw = self.conn.get_own(META_GROUPS)
        if raw is None:
            if count != LEGACY_GROUPS and record and self._legacy_data():
                raise ConfigError(
                    "cluster.groups",
                    f"L3 holds data that an earlier KVCOMM wrote with {LEGACY_GROUPS} groups "
                    f"({seq_key(0, LEGACY_GROUPS)} …), and this host is configured with "
                    f"{count}: set cluster.groups: {LEGACY_GROUPS} on every host to keep "
                    "using that data (the count of an L3 cannot change while it holds data)")
            if not record:
                return count
            foreign = self._foreign_record()
            if foreign is not None:
                raise ConfigError(
                    "cluster.groups",
                    f"L3 holds records that another group count wrote ({foreign!r:.80} is "
                    f"not where {count} groups put its key), and {META_GROUPS}, which "
                    "recorded that count, is gone (lost in a failover, or deleted): set "
                    "cluster.groups to the count the data was written with on every host, "
                    f"then SET {META_GROUPS} <count> in the Redis Cluster")
            self.conn.call(lambda: self.conn.rc.set(META_GROUPS, count, nx=True), META_GROUPS)
            raw = self.conn.get_own(META_GROUPS)
        stored = _as_seq(raw)
        if stored is None:
            raise ConfigError("cluster.groups", f"L3's {META_GROUPS} holds {raw!r:.40}, not a "
                              "group count: it was written by something else; remove it")
        if stored != count:
            raise ConfigError(
                "cluster.groups",
                f"L3 was initialised with {stored} groups, and this host is configured with "
                f"{count}: set cluster.groups: {stored} (the count of an L3 cannot change "
                "while it holds data)")
        return count

    def _foreign_record(self, sample: int = 64) -> bytes | None:
        """The name of a record (of the first ``sample`` a SCAN finds) whose hash tag is
        not the one this store's group count gives its key, or None. Raises
        Unavailable."""
        def run() -> bytes | None:
            seen = 0
            for raw in self.conn.rc.scan_iter(match="kvc:{*", count=1000):
                tag, sep, key = raw[5:].partition(b"}:")
                if not sep or not key:
                    continue  # (a foreign name under our prefix is no record of ours)
                try:
                    name = key.decode("utf-8")
                except UnicodeDecodeError:
                    continue
                if self.conn.groups.tags[self.conn.groups.of(name)].encode() != tag:
                    return bytes(raw)
                seen += 1
                if seen >= sample:
                    break
            return None

        return self.conn.call(run)  # type: ignore[no-any-return]

    def _legacy_data(self) -> bool:
        """Whether any of the 16 groups of the layout before cluster.groups was written."""
        old = _groups(LEGACY_GROUPS)
        return any(self.conn.call(lambda g=g: self.conn.rc.exists(old.seq_key(g))) for g in old)
