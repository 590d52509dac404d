"""Hash-slot groups: which Redis Cluster slot each KVCOMM key, feed and counter lives in.

A KVCOMM key ``k`` belongs to group ``g = xxh3(k) mod N``, where N is ``cluster.groups``
(a power of two from 16 to 16,384, one per slot). Everything of a group carries the
group's *hash tag* ``{t}``, so it all lives in one slot and one Lua call can update a
record, its group's change feed and its group's counter atomically:

==========================  ==================================================
``kvc:{t}:k``               the record of key ``k``
``kvf:{t}``                 the group's change feed (a Redis Stream)
``kvs:{t}``                 the group's sequence number (its latest feed entry)
``kvh:{t}``                 the group's hint channel (sharded pub/sub)
``kvi:{t}``                 the group's key index (a sorted set of its live keys)
==========================  ==================================================

Tags are chosen so that the groups are spread evenly over the 16,384 slots: group ``g``
of N lives in slot ``g * 16384 / N`` (so with N = 16,384 each slot holds one group, and
a slot balancer can move any sixteen-thousandth of the data on its own). A tag for slot
``s`` is the first string ``str(i) + ab`` (i = 0, 1, …; ``ab`` two characters of
``[0-9a-zA-Z]`` in that order) whose CRC16 (Redis Cluster's key hash) is ``s`` mod
16,384 — found without a search over strings: CRC16 with a zero initial value is linear,
so ``crc(p + ab) = crc(p + "\\0\\0") xor crc(ab)``, and one table of the 3,844
two-character suffixes answers every prefix. The tags are a data format: this rule must
never change (``tests/core/test_groups.py`` pins some of them).

N = 16 is the layout KVCOMM used before ``cluster.groups`` existed: tags ``{0}`` …
``{15}``, wherever Redis hashes them; a cluster initialised by such a version keeps
working with ``cluster.groups: 16``.

The count is recorded in L3 (``kvm:groups``) by the first daemon that starts, and a
host configured with another count refuses to start (:meth:`kvcomm.tiers.l3.L3Store.check_groups`).
"""

from __future__ import annotations

import functools
from binascii import crc_hqx
from collections.abc import Iterator

import xxhash

__all__ = ["DEFAULT_GROUPS", "LEGACY_GROUPS", "MAX_GROUPS", "SLOTS", "Groups", "check_count",
           "groups", "key_slot", "slot_tag"]

SLOTS = 16384  # Redis Cluster's hash slots
LEGACY_GROUPS = 16  # KVCOMM's count before cluster.groups: tags {0}..{15}
DEFAULT_GROUPS = 1024
MAX_GROUPS = SLOTS
_ALNUM = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def key_slot(key: bytes) -> int:
    """The Redis Cluster slot of ``key`` (its hash tag's, when it has one)."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1:end]
    return crc_hqx(key, 0) % SLOTS


def check_count(n: object) -> int:
    """``n`` if it is a valid group count (a power of two from 16 to 16,384); raises
    ValueError saying which counts are."""
    if type(n) is not int or n < LEGACY_GROUPS or n > MAX_GROUPS or n & (n - 1):
        raise ValueError(f"the group count must be a power of two from {LEGACY_GROUPS} to "
                         f"{MAX_GROUPS} (one group per slot), got {n!r}")
    return n


@functools.cache
def _suffixes() -> dict[int, str]:
    """The low 14 bits of crc16(ab) → the first two-character suffix ab giving them."""
    out: dict[int, str] = {}
    for a in _ALNUM:
        for b in _ALNUM:
            out.setdefault(crc_hqx((a + b).encode(), 0) % SLOTS, a + b)
    return out


@functools.cache
def _prefix_crc(i: int) -> int:
    return crc_hqx(str(i).encode() + b"\0\0", 0)


def slot_tag(slot: int) -> str:
    """The hash tag of ``slot`` (see the module's doc): ``key_slot(tag) == slot``."""
    if not 0 <= slot < SLOTS:
        raise ValueError(f"slot {slot} is not in 0..{SLOTS - 1}")
    table = _suffixes()
    i = 0
    while True:  # (each prefix reaches about a fifth of the slots: a few tries each)
        ab = table.get((_prefix_crc(i) ^ slot) % SLOTS)
        if ab is not None:
            return f"{i}{ab}"
        i += 1


class Groups:
    """The ``count`` groups of one cluster: each key's group, each group's tag, slot
    and key names. Get one with :func:`groups` (cached per count)."""

    def __init__(self, count: int) -> None:
        self.count = check_count(count)
        if count == LEGACY_GROUPS:
            self.tags = tuple(str(g) for g in range(count))
        else:
            step = SLOTS // count
            self.tags = tuple(slot_tag(g * step) for g in range(count))
        self.slots = tuple(key_slot(t.encode()) for t in self.tags)
        self._at_slot = {s: g for g, s in enumerate(self.slots)}
        self._by_tag = {t.encode(): g for g, t in enumerate(self.tags)}

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.count))

    def __repr__(self) -> str:
        return f"Groups({self.count})"

    def of(self, key: str) -> int:
        """The group of a KVCOMM key."""
        return xxhash.xxh3_64_intdigest(key.encode("utf-8", "surrogatepass")) % self.count

    def slot(self, group: int) -> int:
        """The Redis Cluster slot every key of ``group`` lives in."""
        return self.slots[group]

    def at_slot(self, slot: int) -> int | None:
        """The group living in ``slot``, or None (fewer groups than slots)."""
        return self._at_slot.get(slot)

    def record_key(self, key: str) -> str:
        return f"kvc:{{{self.tags[self.of(key)]}}}:{key}"

    def feed_key(self, group: int) -> str:
        # its own prefix (same hash tag, so the same slot): a user key named "feed" is safe
        return f"kvf:{{{self.tags[group]}}}"

    def seq_key(self, group: int) -> str:
        """The group's change counter: the sequence number of its latest feed entry."""
        return f"kvs:{{{self.tags[group]}}}"

    def expiry_key(self, group: int) -> str:
        """The group's expiry index: a sorted set of its keys whose record has a deadline,
        scored by it (epoch seconds), kept by the push script with each record; keys past
        their deadline leave the key index through it (tiers/l3.py, "Expiry")."""
        return f"kvx:{{{self.tags[group]}}}"

    def index_key(self, group: int) -> str:
        """The group's key index: a sorted set of its live keys (score 0, ordered by their
        bytes), kept by the push script with each record (see tiers/l3.py)."""
        return f"kvi:{{{self.tags[group]}}}"

    def hint_channel(self, group: int) -> str:
        """The sharded pub/sub channel the push script announces the group's changes on."""
        return f"kvh:{{{self.tags[group]}}}"

    def of_channel(self, channel: bytes) -> int | None:
        """The group whose hint channel is ``channel``, or None."""
        if channel.startswith(b"kvh:{") and channel.endswith(b"}"):
            return self._by_tag.get(channel[5:-1])
        return None

    def record_prefix(self, group: int) -> bytes:
        """What every record key of ``group`` starts with."""
        return f"kvc:{{{self.tags[group]}}}:".encode()


@functools.cache
def groups(count: int = DEFAULT_GROUPS) -> Groups:
    """The :class:`Groups` of ``count`` (built once per process: ~10 ms for 16,384).
    Raises ValueError for a count that is not a power of two from 16 to 16,384."""
    return Groups(count)
