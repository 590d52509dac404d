"""The Lua scripts L3 runs inside Redis, loaded once, at import, from the package's
``lua/*.lua`` files (shipped as package data).

Each constant is a script's source text, as redis-py's ``register_script`` takes it; what
each script takes and returns is written above it. The theory they implement (records,
feed entries, hints, the key index, expiry) is in :mod:`kvcomm.tiers.l3`'s docstring.
"""

from __future__ import annotations

from importlib import resources


def _load(name: str) -> str:
    """The text of ``lua/<name>.lua``, exactly as written (a script's SHA is of its text)."""
    lua = resources.files(__name__.rpartition(".")[0]) / "lua"
    return (lua / f"{name}.lua").read_text(encoding="utf-8")


# The L3 rule (kvcomm.core.resolve.l3_rule) run inside Redis, atomically per key, for the
# records of one group in one call (one EVALSHA per group and batch, not per record: a
# healed host's backlog of thousands costs a few calls, and each record costs its key and
# its bytes only; everything a group shares is sent once per call).
# KEYS[1] the group's feed stream, KEYS[2] its sequence counter, KEYS[3] its key index (a
# sorted set: see "The key index" in the package docstring), KEYS[4..3+N] the N records'
# keys (kvc:{t}:k, all of the group; the user key k is the record key past its "kvc:{t}:"
# prefix, which is one byte longer than the feed key's "kvf:{t}": not sent again)
# ARGV[1] one character per record, in order: "l" (lww) or "s" (siblings: a concurrent
# record comes back as a conflict), ARGV[2] feed MAXLEN,
# ARGV[3] the group's hint channel (an argument, not a key: during a slot migration Redis
# counts a declared key that does not exist as missing, and would refuse every push), or
# "" for no hint (a stored value-less entry's hint carries the entry: "seq id note key";
# any other hint is the sequence number); ARGV[4] "e": each change the call stores hints
# its own entry (a group with at most HINT_EACH pushes), "l": the call hints the group's
# change once, at its end, even if it stored nothing (a backlog of thousands does not send
# every subscriber thousands of hints: the change itself if the call stored exactly one,
# else the sequence number, and readers XRANGE)
# ARGV[5] the largest record (bytes) a feed entry carries inline (FEED_INLINE; "": every
# record inline), ARGV[6] cluster.tombstone_grace in ms, ARGV[7] the group's expiry index
# (kvx, same hash tag; an argument for the same reason: see "Expiry" in the package docstring),
# ARGV[8..7+N] the N incoming records, ARGV[8+N] (optional) the record bytes the replies may
# carry back (stored records L3 keeps: older, conflict, merged...): once the replies hold
# that many, the call's remaining records are not pushed and each gets a KVCOMMLATER
# error (the caller sends them again, in another call): PUSH_BATCH small records answered
# with PUSH_BATCH stored records near cache.max_value_size would be gigabytes read into
# Lua and sent back at once.
# Returns one reply per record, in order: {outcome, record L3 holds} (the record "" when L3
# holds the very bytes pushed: new, newer, equal) — for a change it stored (new, newer,
# merged) followed by the sequence number and stream id of the feed entry it wrote (the
# pusher can tell that a failover lost it before anyone read it: node/delivery.py,
# Unconfirmed) —, or an error (a
# malformed record: KVCOMMBAD; a stored record of a newer format: KVCOMMCORRUPT; a Redis
# error met while storing it, WRONGTYPE say): that record alone; the others are pushed,
# as N calls of one would have been (and, as those, what was written before an error
# stays: a script is not rolled back).
PUSH_LUA = _load("push")

# A conditional write (L3Store.push_if): the expectation checked against the record L3
# holds, then, if it holds, the push script itself (PUSH_LUA, appended whole: one record,
# pushed as push() pushes it), all in one atomic call on the key's master. The call's
# keys and arguments are those of a push of the one record (L3Store._args) followed by
# three more, taken off ARGV before the push script runs: the expectation "a" (the key
# absent: no record, a tombstone, or past its deadline) or "v" (a version), then two
# msgpack arrays of flattened vectors [actor, counter, ...]: ``check`` and ``basis``.
# Passes when L3 holds no record (nothing to contradict: a write of this host not yet
# pushed, or one a failover lost); with "a" when the record is dead or its vector is
# at most ``check`` (the host's own delete not yet in L3 covers it; [] otherwise); with
# "v" when the record's vector is at most ``check`` (the expected version, or one it
# descends from: the host's own write not yet in L3 being the expected one, pushing it
# first would have been "newer"), unless it is the expected version itself and dead.
# The pushed record's vector is ``basis`` (which covers ``check``) plus a new dot, so a
# record that passes is older than it and the push stores it ("new" or "newer"); only a
# dead record "a" passes over may be newer than ``basis`` in part: then "stale" comes
# back, with that record, and the caller pushes again with its vector merged in.
# Returns a list of one reply, as the push script does: {"conflict", the record L3 holds
# ("" none)}, {"stale", that record}, or the push script's own reply.
CAS_LUA = _load("cas") + PUSH_LUA

# A group's feed position, read atomically: {sequence number, id of the last entry kept
# or "0-0"}. A reader that resumes from there misses nothing and re-reads nothing.
# KEYS[1] the group's feed stream, KEYS[2] its sequence counter
POSITION_LUA = _load("position")

# Group counters of many slots of one master in one call: a GET each (redis.pcall: a slot
# that is not this node's, or is being migrated, answers an error instead, and the caller
# reads that counter again through the cluster client), and the id of the last entry of
# each group's stream (its *tail*: a reader whose last sequence number is the counter must
# be positioned there, or the number was reissued: see "Sequence numbers" in the package
# docstring). Read-only, and declared cross-slot: Redis 7 lets a script touch keys of
# several slots of its node that way. ARGV[1] "1": read the tails too ("0": the counters
# alone); ARGV[2] the groups' hash tags, space-separated (the counter is ``kvs:{t}``, the
# stream ``kvf:{t}``): ~4 bytes a group on the wire, where the key names as arguments took
# ~22 — the sweep reads every group's counter every second, from every host. Returns one
# string, a field per group separated by commas: "" (no counter), the counter's digits,
# "?" (a foreign value), or "E" (an error: read again), then, with tails, a space and the
# tail's id when the group has one. Nothing of a value but digits goes into it (no
# separator can be smuggled).
SWEEP_LUA = _load("sweep")

# Whether a group's stream lost the entry at a reader's cursor while keeping an older
# one: 1 then, else 0 (the cursor's entry is there, or nothing at or before it is: trimmed
# past it, which removes the oldest entries first, never an entry while keeping an older
# one). Only a failover (or a foreign XDEL) loses an entry that way, and the next entries
# may then follow the reader's last sequence number while the entries that reissued its
# numbers lie before its cursor. KEYS[1] the stream, ARGV[1] the cursor. Read-only.
CURSOR_LUA = _load("cursor")

# One page of many groups' key indexes on one master in one call (L3Store.index_range):
# ZRANGEBYLEX ARGV[1] ARGV[2] LIMIT 0 ARGV[3] of each index named from ARGV[4] on. Returns,
# per index, its keys in order, or an error text (a slot not served here, or moving: the
# caller reads that group again through the cluster client). The merge is the caller's:
# Lua's string order follows the server's locale, not the bytes. Read-only, cross-slot.
INDEX_LUA = _load("index")

# Keys past their deadline leave their groups' key indexes (L3Store.expire_index): ARGV[1]
# now (epoch seconds), ARGV[2] at most this many keys per group, ARGV[3..] pairs of a
# group's expiry index (kvx) and key index (kvi), all of one master. The push script keeps
# each kvx score equal to the key's current deadline, so a due member is an expired key.
# Returns the keys dropped.
EXPIRE_INDEX_LUA = _load("expire_index")

# One record's key index entry from the record itself (L3Store.backfill_index), atomically
# with it: KEYS[1] the record, KEYS[2] the group's index; ARGV[1] the user key. A record
# the script cannot read as one (foreign) is left out of the index, as a tombstone is.
BACKFILL_LUA = _load("backfill")
