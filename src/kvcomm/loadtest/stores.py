"""The two stores a load test drives: KVCOMM (embedded or a host of a cluster) and Redis
directly (the baseline). Same operations, each returning what the scenario needs and the
tier that answered, so that every operation can be reported with its own name."""

from __future__ import annotations

import os
from typing import Any

import msgpack

from ..errors import ConflictError


class KvcommStore:
    """KVCOMM through one client per process. ``get`` says which tier served the read:
    ``l1``, ``l2``, ``l3``, ``guard`` (absent, said by the host's key filter or negative
    cache) or ``absent`` (from the client's counts, without extra work)."""

    kind = "kvcomm"

    def __init__(self, name: str | None, config: Any) -> None:
        import kvcomm

        self.kv = kvcomm.open(name, config=config)
        self._g = self.kv._getter

    def get(self, key: str) -> tuple[Any, str]:
        g, kv = self._g, self.kv
        c = kv.counters
        hits, l2, slow_l2, l3 = g.hits, g.l2_hits, kv._l2_hits, c["l3_hits"]
        guards = c["filter_hits"] + c["negative_hits"]
        value = kv.get(key)
        if g.hits != hits:
            return value, "l1"
        if g.l2_hits != l2 or kv._l2_hits != slow_l2:
            return value, "l2"
        if c["l3_hits"] != l3:
            return value, "l3"
        if c["filter_hits"] + c["negative_hits"] != guards:
            return value, "guard"
        return value, "absent"

    def put(self, key: str, value: Any) -> None:
        self.kv.put(key, value)

    def read_versioned(self, key: str) -> tuple[Any, Any]:
        """(value or None, the token a compare-and-set needs)."""
        import kvcomm

        item = self.kv.get_item(key)
        return (None, kvcomm.ABSENT) if item is None else (item.value, item.version)

    def cas(self, key: str, value: Any, token: Any) -> bool:
        """Write ``value`` if ``key`` is still at ``token``; False when another agent won.
        Raises ValidationError when the shelf's validator refuses it."""
        try:
            self.kv.put(key, value, expect=token)
        except ConflictError:
            return False
        return True

    def register_validator(self, prefix: str, fn: Any) -> None:
        self.kv.register_validator(prefix, fn)

    def close(self) -> None:
        self.kv.close()


# compare-and-set by the exact stored bytes (ARGV[3] == "1": the key must be absent)
_CAS = """
local cur = redis.call('GET', KEYS[1])
if (ARGV[3] == '1' and not cur) or (ARGV[3] == '0' and cur == ARGV[2]) then
  redis.call('SET', KEYS[1], ARGV[1])
  return 1
end
return 0
"""


class RedisStore:
    """Redis directly, values as msgpack (the baseline: what agents sharing state through
    a central store do). ``get``'s tier is ``hit`` or ``absent``."""

    kind = "redis"

    def __init__(self, address: str) -> None:
        import redis

        host, _, port = address.rpartition(":")
        self.r = redis.Redis(host=host, port=int(port), socket_timeout=5)
        self._cas = self.r.register_script(_CAS)

    def get(self, key: str) -> tuple[Any, str]:
        raw = self.r.get(key)
        if raw is None:
            return None, "absent"
        return msgpack.unpackb(raw), "hit"

    def put(self, key: str, value: Any) -> None:
        self.r.set(key, msgpack.packb(value))

    def read_versioned(self, key: str) -> tuple[Any, Any]:
        raw = self.r.get(key)
        return (None, None) if raw is None else (msgpack.unpackb(raw), raw)

    def cas(self, key: str, value: Any, token: Any) -> bool:
        new = msgpack.packb(value)
        return bool(self._cas(keys=[key], args=[new, token or b"", "1" if token is None else "0"]))

    def register_validator(self, prefix: str, fn: Any) -> None:
        pass  # (Redis has no validators: the compare-and-set alone guards the claim)

    def close(self) -> None:
        self.r.close()


_STORE: dict[int, Any] = {}


def store_for(options: Any) -> Any:
    """This process's store for the run (one per process: Locust's users are greenlets
    sharing it, as agents of one process share a client)."""
    pid = os.getpid()
    s = _STORE.get(pid)
    if s is None:
        if options.kvcomm_backend == "redis":
            s = RedisStore(options.kvcomm_redis)
        else:
            s = KvcommStore(options.kvcomm_name or None, options.kvcomm_config or None)
        _STORE[pid] = s
    return s


def close_stores() -> None:
    s = _STORE.pop(os.getpid(), None)
    if s is not None:
        s.close()
