"""A host's presence in the cluster: its etcd lease, its published status, partition mode.

Theory of operation
-------------------
**The lease.** Each node daemon holds an etcd lease of ``cluster.lease_ttl`` seconds
(rounded up: etcd counts whole seconds) and keeps it alive every ``ttl / 3`` seconds
(:class:`HostPresence`, a thread of its own, so that a slow L3 round never lets the
lease lapse). Attached to it is ``kvc/hosts/<host_id>``, the host's status as JSON
(partition mode, outbound backlog, feed lag...), rewritten at each renewal: while the
host is alive and reaches an etcd majority the key exists; once it is cut off (or
killed) the lease expires within the TTL and the key disappears — that is how the other
hosts (and ``kvcomm cluster status``) see it leave. ``kvc/members/<host_id>`` holds the
same status without a lease (the last one seen), so that a host whose lease expired is
still listed, as ``expired``, until ``kvcomm cluster remove-host`` retires it. A lease
that etcd reports expired (the host was cut off longer than the TTL) is replaced by a
new one as soon as etcd answers again.

**Reachability.** The thread records when etcd last answered (``etcd_ok_at``) and, once
a call goes unanswered, when that first unanswered call began: ``etcd_seen_at``, the
last moment etcd is known or presumed reachable, from which partition mode counts the
TTL (counting from the last renewal, up to ``ttl / 3`` earlier, entered it up to a
third of the TTL early). After a failed renewal it probes every 200 ms instead of every
``ttl / 3``, so that a heal is seen quickly. ``etcd_unreachable`` is set from the first
failed probe (no member answered within ``cluster.timeout``: the evidence a strong
operation would get, after the same wait) to the first successful one; agents on the
host read it from the status file and fail strong operations at once meanwhile.

**Partition mode** (:class:`Reachability`, pure): the daemon is in partition mode while
Redis (any successful L3 round) or an etcd majority (``etcd_seen_at``) has been out of
reach for longer than the lease TTL. Entering it changes nothing in what agents may do
with eventual keys (they write into L2; dirty entries are never evicted; ``put`` raises
Unavailable past ``cluster.outbound_max``); leaving it makes the daemon retry at once
instead of after its backoff, replay its backlog through L3's merge and read the feeds
it missed (a gap resyncs the group). See node/daemon.py.

**The status file** ``<l2_dir>/kvcomm.<namespace>.node.json`` is the daemon's word to
the host's agents and to ``kvcomm info``: written atomically (a rename) every 200 ms at
most, read by agents at most every 50 ms, trusted only while fresh (a daemon that died
says nothing).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

from ..config import Config
from ..errors import InvalidArgument, KVCommError
from ..tiers.etcd import EtcdClient, KeyValue
from ..tiers.shm.files import create_temp, remove_dead_temps
from ..tiers.shm.files import status_path as status_path  # (the daemon's and tests' import)

log = logging.getLogger("kvcomm.node")

HOSTS_PREFIX = b"kvc/hosts/"
MEMBERS_PREFIX = b"kvc/members/"
STATUS_FRESH_S = 3.0  # an agent trusts the status file this long after it was written
# a status file larger than this is no daemon's (a few KB: its strong prefixes the most)
STATUS_MAX_BYTES = 1 << 20
PROBE_WHILE_DOWN = 0.2  # seconds between probes while etcd does not answer


_SWEPT: set[str] = set()  # (status paths whose dead writers' leftovers this process removed)


def write_status(path: str, status: dict[str, Any], permissions: int = 0o600) -> None:
    """Replace the status file atomically: written whole under a temporary name (a new
    one, never another's file or link), then renamed into place. Raises OSError. The
    temporary file is KVCOMM's kind (tiers/shm/files.py ``create_temp``: locked by its
    writer), so what a writer killed before its rename leaves is known for a dead one's:
    the first write of a path in a process removes those, and ``kvcomm list`` /
    ``kvcomm purge --dead-temps`` see them."""
    if path not in _SWEPT:
        _SWEPT.add(path)
        remove_dead_temps(path)
    tmp, fd = create_temp(path, permissions)
    try:
        os.write(fd, json.dumps(status, separators=(",", ":")).encode())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        os.close(fd)


def read_status(path: str) -> dict[str, Any] | None:
    """The status file's content, or None when absent or unreadable. Only a regular file
    of at most STATUS_MAX_BYTES is read, opened without blocking: what is at the path may
    be anything another process put there (a FIFO would hold the reader — a write refused
    at cluster.outbound_max reads it for its message — until something writes into it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > STATUS_MAX_BYTES:
            return None
        chunks: list[bytes] = []
        left = STATUS_MAX_BYTES + 1
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:  # (it grew past the bound while read)
            return None
        out = json.loads(b"".join(chunks))
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)
    return out if isinstance(out, dict) else None


def status_fresh(status: dict[str, Any] | None, wall: float | None = None) -> bool:
    """Whether ``status`` (a status file's content) is a started daemon's, written within
    STATUS_FRESH_S of ``wall`` (default: now). False for a missing, non-numeric,
    non-finite or far-future ``updated`` (the file is advisory: what another process
    wrote there must not raise, nor make a dead daemon's word fresh for ever), and for the
    word of a daemon still starting (:func:`starting_status`). Never raises."""
    if status is None or status.get("starting"):
        return False
    return _written_lately(status, wall)


def starting_status(path: str, wall: float | None = None) -> dict[str, Any] | None:
    """The status file at ``path`` when a daemon that cannot start yet wrote it lately
    (``starting``: why, ``since``: when it first failed, ``pid``; node/daemon.py main),
    else None: for the messages of agents that wait for a daemon. Never raises."""
    status = read_status(path)
    if status is None or not status.get("starting") or not _written_lately(status, wall):
        return None
    return status


def starting_text(status: dict[str, Any]) -> str:
    """A starting daemon's word (:func:`starting_status`) for a message: its pid, for how
    long, why; printable and bounded whatever the file holds. Never raises."""
    pid = status.get("pid")
    who = f"pid {pid}" if type(pid) is int else "pid unknown"
    why = "".join(c if c.isprintable() else "?"
                  for c in str(status.get("starting"))[:300]).rstrip(".")
    since = status.get("since")
    ago = ""
    if isinstance(since, (int, float)) and not isinstance(since, bool):
        try:
            if math.isfinite(since):
                ago = f" for {max(0.0, time.time() - float(since)):.0f}s"
        except (OverflowError, ValueError):
            pass
    return f"{who} has been starting{ago}: {why}"


def _written_lately(status: dict[str, Any], wall: float | None) -> bool:
    now = time.time() if wall is None else wall
    updated = status.get("updated", 0)
    if isinstance(updated, bool) or not isinstance(updated, (int, float)):
        return False
    try:
        age = now - float(updated)
    except (OverflowError, ValueError):
        return False
    return math.isfinite(age) and -STATUS_FRESH_S <= age <= STATUS_FRESH_S


def masters_down_text(status: dict[str, Any], most: int = 8) -> str:
    """The Redis masters a status file names as down (``masters_down``), for a message:
    at most ``most`` of them (then how many more), each cut to 64 printable characters;
    "" when it names none or is not a list (the file is advisory: another process may
    have written anything there). Never raises."""
    down = status.get("masters_down")
    if not isinstance(down, list) or not down:
        return ""
    names = ["".join(c if c.isprintable() else "?" for c in str(x)[:64]) for x in down[:most]]
    more = f" and {len(down) - most} more" if len(down) > most else ""
    return ", ".join(names) + more


class StatusReader:
    """An agent's cached view of its daemon's status file (re-read at most every 50 ms)."""

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.path, self.clock, self.wall = path, clock, wall
        self._next = 0.0
        self._status: dict[str, Any] | None = None

    def status(self) -> dict[str, Any] | None:
        """The daemon's status while fresh (written within STATUS_FRESH_S), else None."""
        now = self.clock()
        if now >= self._next:
            self._next = now + 0.05
            self._status = read_status(self.path)
        s = self._status
        return s if status_fresh(s, self.wall()) else None

    def etcd_unreachable(self) -> str | None:
        s = self.status()
        if s is None or not s.get("etcd_unreachable"):
            return None
        return (f"the node daemon of host {s.get('host')!r} has not reached an etcd majority "
                f"for {s.get('etcd_down_s', 0):.1f}s")


class Reachability:
    """Partition mode, decided from when Redis and etcd last answered (pure)."""

    def __init__(self, ttl: float, now: float) -> None:
        self.ttl = ttl
        self.redis_ok_at = now
        self.partition = False
        self.since: float | None = None
        self.reason = ""
        self.entered = 0
        self.left = 0

    def redis_ok(self, now: float) -> None:
        self.redis_ok_at = now

    def redis_cut(self, now: float) -> bool:
        """Redis has not answered for longer than the TTL."""
        return now - self.redis_ok_at > self.ttl

    def overdue(self, now: float, etcd_ok_at: float | None) -> bool:
        """True when partition mode is due and not yet entered (:meth:`update` would
        return "enter"); changes nothing."""
        return not self.partition and (now - self.redis_ok_at > self.ttl or (
            etcd_ok_at is not None and now - etcd_ok_at > self.ttl))

    def update(self, now: float, etcd_ok_at: float | None) -> str | None:
        """Re-decide; returns "enter", "leave" or None (no change)."""
        why = []
        if now - self.redis_ok_at > self.ttl:
            why.append(f"Redis unreachable for {now - self.redis_ok_at:.1f}s")
        if etcd_ok_at is not None and now - etcd_ok_at > self.ttl:
            why.append(f"no etcd majority for {now - etcd_ok_at:.1f}s")
        if why and not self.partition:
            self.partition, self.since, self.reason = True, now, "; ".join(why)
            self.entered += 1
            return "enter"
        if why:
            self.reason = "; ".join(why)
        if not why and self.partition:
            self.partition, self.since, self.reason = False, None, ""
            self.left += 1
            return "leave"
        return None


class HostPresence:
    """The thread that holds the host's lease and publishes its status in etcd (see the
    module docstring). ``snapshot()`` returns the status to publish (JSON-able).

    Constructing it sends nothing; :meth:`start` starts the thread. Raises ConfigError
    (bad etcd settings).
    """

    def __init__(self, config: Config, snapshot: Callable[[], dict[str, Any]],
                 clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[], None] | None = None) -> None:
        cl = config.cluster
        self.host = config.node.host_id
        self.ttl = max(1, math.ceil(cl.lease_ttl))
        self.interval = self.ttl / 3
        self.etcd = EtcdClient.from_config(cl, timeout=min(cl.timeout, self.interval))
        self.snapshot = snapshot
        # publishes the host's status locally (the status file): after every beat, from
        # this thread, so that a main loop stuck in a Redis call cannot leave it stale
        self.on_change = on_change
        self.clock = clock
        self.lease = 0
        self.etcd_ok_at = clock()  # etcd's last answer
        self.etcd_seen_at = self.etcd_ok_at  # ...or the start of the first call unanswered since
        self.etcd_unreachable = False
        self.renewals = 0
        self.grants = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvcomm-host-lease", daemon=True)
        self.key = HOSTS_PREFIX + self.host.encode()
        self.member_key = MEMBERS_PREFIX + self.host.encode()

    def start(self) -> HostPresence:
        self._thread.start()
        return self

    def lease_live(self) -> bool:
        """The host holds a lease etcd still counts live: one was granted, and etcd
        answered within the TTL (a host cut off longer has lost it, as the other hosts
        see, though it learns so only when etcd answers again)."""
        return bool(self.lease) and self.clock() - self.etcd_ok_at <= self.ttl

    def etcd_down_s(self) -> float:
        return max(0.0, self.clock() - self.etcd_ok_at) if self.etcd_unreachable else 0.0

    def _run(self) -> None:
        next_beat = self.clock()
        while True:
            ok = True
            if self.clock() >= next_beat:  # every ttl / 3 (every 200 ms while etcd is down)
                ok = self.try_beat()
                next_beat = self.clock() + (self.interval if ok else PROBE_WHILE_DOWN)
            self._changed()  # (the status file: at least every second)
            if self._stop.wait(max(0.0, min(next_beat - self.clock(), 1.0))):
                return

    def try_beat(self) -> bool:
        """:meth:`beat`; False when etcd did not answer (counted, logged once, and the
        start of the first unanswered call since its last answer kept in
        ``etcd_seen_at``). Never raises a KVCommError."""
        started = self.clock()
        try:
            self.beat()
        except KVCommError as exc:
            self.failures += 1
            if not self.etcd_unreachable:
                log.warning("etcd does not answer (%s): strong keys fail at once until it "
                            "does", exc)
                self.etcd_unreachable = True
                self.etcd_seen_at = max(self.etcd_ok_at, started)
            return False
        return True

    def beat(self) -> None:
        """Renew the lease (or take a new one) and publish the status. Raises
        Unavailable (etcd did not answer), ConfigError."""
        status = self.snapshot()
        body = json.dumps(status, separators=(",", ":")).encode()
        if self.lease:
            left = self.etcd.lease_keepalive(self.lease)
            if left <= 0:
                log.warning("lease %x of host %s expired (cut off longer than %ss): taking "
                            "a new one", self.lease, self.host, self.ttl)
                self.lease = 0
            else:
                self.renewals += 1
        if not self.lease:
            self.lease = self.etcd.lease_grant(self.ttl)
            self.grants += 1
        self.etcd.put(self.key, body, lease=self.lease)
        self.etcd.put(self.member_key, body)
        self.etcd_ok_at = self.etcd_seen_at = self.clock()
        if self.etcd_unreachable:
            log.info("etcd answers again")
            self.etcd_unreachable = False

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # (the status file is advisory: never stop the lease for it)
                log.exception("publishing the host's status failed")

    def stop(self, revoke: bool = True) -> None:
        """End the thread; with ``revoke``, revoke the lease (the host leaves at once) and
        record the host as stopped. Never raises."""
        self._stop.set()
        self._thread.join(timeout=10)
        if revoke and self.lease:
            try:
                status = dict(self.snapshot(), stopped=True)
                self.etcd.put(self.member_key, json.dumps(status).encode())
                self.etcd.lease_revoke(self.lease)
            except KVCommError as exc:
                log.warning("could not revoke the host's lease (it expires on its own): %s", exc)
        self.etcd.close()


# ---------------------------------------------------------------- cluster status


def cluster_status(etcd: EtcdClient) -> list[dict[str, Any]]:
    """Every host etcd knows of: ``{"host", "lease", "partition", "backlog",
    "feed_lag_s", "masters_down"}`` plus what its daemon published (``lease``: "live" with its TTL left,
    "expired", or "stopped"). Raises Unavailable."""
    # (what hosts publish is read defensively: one host's odd record must not hide the
    # others; a name that is not UTF-8 is shown with its bytes escaped)
    live = {_name(kv.key, HOSTS_PREFIX): kv for kv in etcd.range(HOSTS_PREFIX).kvs}
    members = {_name(kv.key, MEMBERS_PREFIX): kv for kv in etcd.range(MEMBERS_PREFIX).kvs}
    out = []
    for host in sorted(set(live) | set(members)):
        kv: KeyValue = live.get(host) or members[host]
        try:
            s = json.loads(kv.value)
        except ValueError:
            s = {}
        if not isinstance(s, dict):
            s = {}
        if host in live:
            ttl = etcd.lease_ttl(kv.lease) if kv.lease else -1
            lease = f"live ({ttl}s left)" if ttl >= 0 else "expired"
        else:
            lease = "stopped" if s.get("stopped") else "expired"
        out.append({"host": host, "lease": lease, "partition": bool(s.get("partition")),
                    "backlog": int(_number(s.get("backlog"))),
                    "feed_lag_s": round(_number(s.get("feed_lag_s")), 3),
                    "masters_down": _names(s.get("masters_down")),
                    "namespace": s.get("namespace"), "pid": s.get("pid"),
                    "updated": s.get("updated")})
    return out


def _names(v: Any) -> list[str]:
    """A published list of names (the masters a host takes for down), [] when it is not
    a list; its entries as strings."""
    # (bounded: what another host published; 64 names of 200 characters at most)
    return [str(x)[:200] for x in v[:64]] if isinstance(v, list) else []


def _name(key: bytes, prefix: bytes) -> str:
    return key[len(prefix):].decode("utf-8", "backslashreplace")


def _number(v: Any) -> float:
    """A published figure, 0.0 when it is not a finite number."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return 0.0
    return f if math.isfinite(f) else 0.0


def live_lease(etcd: EtcdClient, host: str) -> int:
    """The seconds ``host``'s lease has left, or -1 when it holds none (expired,
    revoked, never taken). Raises Unavailable."""
    kv = etcd.get(HOSTS_PREFIX + host.encode())
    if kv is None or not kv.lease:
        return -1
    return etcd.lease_ttl(kv.lease)


def remove_host(etcd: EtcdClient, host: str, *, force: bool = False) -> dict[str, Any]:
    """Retire ``host`` from etcd: revoke its lease, delete its keys. Returns what was
    found. Raises Unavailable, InvalidArgument (no such host; or its lease is live: its
    daemon runs, and would take a new lease and publish itself again at its next beat,
    unless ``force``; nothing changed)."""
    found: dict[str, Any] = {"host": host, "lease_revoked": False, "keys_deleted": 0}
    kv = etcd.get(HOSTS_PREFIX + host.encode())
    if kv is not None and kv.lease and not force:
        left = etcd.lease_ttl(kv.lease)
        if left >= 0:
            raise InvalidArgument(
                f"host {host!r} holds a live lease ({left}s left): its daemon is running and "
                "would register again at its next beat. Stop it first (SIGTERM flushes its "
                "backlog to L3 and revokes the lease), or pass --force if it is cut off for "
                "good; nothing was changed")
    if kv is not None and kv.lease:
        found["lease_revoked"] = etcd.lease_revoke(kv.lease)
    member = etcd.get(MEMBERS_PREFIX + host.encode())
    if member is not None:
        try:
            found["last_status"] = json.loads(member.value)
        except ValueError:
            pass
    found["keys_deleted"] = (etcd.delete(HOSTS_PREFIX + host.encode())
                             + etcd.delete(MEMBERS_PREFIX + host.encode()))
    if kv is None and member is None:
        raise InvalidArgument(f"etcd knows no host {host!r}: see `kvcomm cluster status`")
    return found
