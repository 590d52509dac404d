"""What each agent observes, and the host's table of it: one small file per agent.

Sampling
--------
The C getter already counts 1 read in ``cache.hot_key_sample`` (16) for the host's hot
keys, into a per-client buffer of key → reads (scaled back up) that the client flushes
about once a second (``_client/hotkeys.py``). Placement rides on that flush, never on a
read: :meth:`AgentStats.sampled` looks up who wrote each sampled key — the writer's agent
id in the record's extension field and the value's size, read lock-free in C for all the
keys at once (``Core.writers``) — and adds (reads, bytes) to the edge towards that writer.
Reads of the agent's own keys are not edges. A flush attributes at most
``MAX_KEYS_PER_FLUSH`` keys: beyond that, every k-th key (from a rotating start) with its
count scaled by k, so an agent reading thousands of distinct keys pays a bounded price
per flush and the estimate stays unbiased. An L1 hit costs exactly what it did.

Memory is bounded: at most ``MAX_WRITERS`` writers per agent — when full, a writer not
read since the agent's previous report gives way to a new one (its edge leaves the
report: a reader's neighbours change, and unnamed writers come and go with every
restart), and reads of further writers are counted in ``dropped`` — and a cache of at
most ``MAX_NAMES`` extension fields → ids, ``MAX_NAMES_BYTES`` bytes of fields in all.

The host's table
----------------
Every ``REPORT_EVERY`` seconds (at a flush when the agent reads; an agent that only
writes looks at the clock every ``REPORT_PUTS`` puts) an agent replaces its
file in ``{cache.l2_dir}/kvcomm.{namespace}.agents/`` with its running totals since it
started — operations, and (reads, bytes) per writer — so that any two reports give rates
over the time between them. A file is written whole under a temporary name and renamed:
a reader sees the old report or the new one. The node daemon reads the directory,
publishes it to L3 (:mod:`kvcomm.placement.observe`) and removes the files of processes
that are gone; a client that closes removes its own, and a client that opens removes those
of processes gone without closing (so a host without a daemon keeps one file per live
agent, not one per agent that ever crashed). The table is read (and cleaned) only
when it is a directory of this user, reached without following a symlink, and only this
user's regular files in it are reports (opened without following symlinks or waiting on
a FIFO): /dev/shm is world-writable, and a planted name must not lead the daemon to read
or delete anything else. A report's name begins with its agent's name (which may begin
with "."): temporary files are those that begin with "." and end with ".tmp". Writing a
report never raises into the agent's call: a failure is counted, warned about once, and
retried at the next one.

Report format (msgpack map; ``f`` is 1): ``agent``, ``host``, ``pid``, ``since`` and ``t``
(wall-clock seconds: the agent's start and this report), ``ops`` (gets, puts and deletes
so far), ``edges`` ({writer: [reads, bytes]}, estimated from the samples), ``dropped`` and
``unknown`` (sampled reads past the writer bound, and of records with no writer id).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import msgpack

from ..errors import KVCommError, KVCommWarning, SegmentError
from ..tiers.shm.files import SHM_DIR, agents_dir, pid_alive
from .agents import agent_of, is_agent_id

FORMAT = 1
REPORT_EVERY = 1.0  # seconds between an agent's reports
# puts between two looks at the clock (for agents that only write): a clock read per 16
# puts is ~0.1% of a put, and a writer at 20 puts/s reports within a second, not 51 s
REPORT_PUTS = 16
MAX_WRITERS = 1024  # edges kept per agent
MAX_KEYS_PER_FLUSH = 16  # sampled keys whose writer one flush looks up
MAX_NAMES = 4096  # extension fields → writer ids remembered per agent
MAX_NAMES_BYTES = 256 << 10  # ... and their bytes (a field may be 4 KiB: MAX_EXT)
MAX_REPORT_BYTES = 1 << 20  # a larger file is not a report of ours
GONE_AFTER = 10.0  # seconds a dead process's report stays (the daemon publishes it once more)
TMP_AFTER = 60.0  # seconds after which a left-over temporary file is removed


def _dir_mode(permissions: int) -> int:
    """A directory mode for files of ``permissions``: search wherever reading is allowed."""
    return permissions | ((permissions & 0o444) >> 2)


def ensure_dir(path: str, permissions: int) -> None:
    """Create the table's directory (``permissions`` plus search bits), or check the one
    there is a directory of this user. Raises SegmentError saying what to remove."""
    try:
        os.mkdir(path, _dir_mode(permissions))
        os.chmod(path, _dir_mode(permissions))  # (mkdir's mode passed through the umask)
        return
    except FileExistsError:
        pass
    except OSError as exc:
        raise SegmentError(f"cannot create {path}: {exc.strerror}") from None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() \
            or stat.S_IMODE(st.st_mode) & ~_dir_mode(permissions):
        raise SegmentError(
            f"{path} is not a directory of this user with mode at most "
            f"{oct(_dir_mode(permissions))} (cache.l2_permissions); remove it (as its owner) "
            "so that agents can report there")


class AgentStats:
    """One client's observations: sampled reads of other agents' keys, by writer, and the
    report file they go to. ``clock`` is the wall clock (reports of different processes
    are compared)."""

    def __init__(self, agent: str, host: str, namespace: str, directory: str,
                 permissions: int, *, clock: Callable[[], float] = time.time,
                 purged: Callable[[], bool] = lambda: False) -> None:
        self.agent, self.host = agent, host
        self.clock = clock
        self.since = clock()
        self.edges: dict[str, list[float]] = {}  # writer → [reads, bytes]
        self.dropped = 0.0  # sampled reads of writers past MAX_WRITERS
        self.unknown = 0.0  # sampled reads of records without a writer id
        self.errors = 0  # reports that could not be written
        self.reports = 0
        self._names: dict[bytes, str | None] = {}
        self._names_bytes = 0
        self._touched: set[str] = set()  # writers read since the last report
        self._idle: list[str] = []  # writers not read between the last two reports
        self._rot = 0
        self._permissions = permissions
        self._dir = agents_dir(namespace, directory)
        self._pid = os.getpid()
        # (the file's name is only an id; an unnamed agent's id carries the host id the
        # segment's header holds, which a damaged header may fill with any byte)
        self._file = f"{_SAFE.sub('_', agent)[:100]}.{self._pid}.{secrets.token_hex(4)}"
        self._next = 0.0
        self._warned = False
        self._written = False
        self._closed = False
        # ``purged()``: whether the namespace's segment was purged. Its files are then
        # gone, and this agent never makes them again (they would be left for good): not
        # at open (a purge that landed since the segment was attached: the directory just
        # made is removed again), not at a report (one that finds the directory gone stops
        # reporting, quietly, once the segment says purged; otherwise it makes it again)
        self._purged = purged
        try:
            ensure_dir(self._dir, permissions)
        except (OSError, KVCommError):
            pass  # (the first report tries again, and warns)
        else:  # (the reports of processes gone without closing: a host with no node
            read_reports(self._dir, only_clean=True)  # daemon, the embedded default, has
            # nobody else to remove them; with one, its cleaning does the same)
        if purged():
            self._closed = True
            with contextlib.suppress(OSError):
                os.rmdir(self._dir)

    # ------------------------------------------------------------------ sampling

    def sampled(self, counts: Mapping[str, int], keys: Mapping[str, tuple[bytes, int]],
                key_hash: Callable[[str], tuple[bytes, int]],
                writers: Callable[[list[tuple[bytes, int]]], list[tuple[bytes, int] | None]],
                ) -> None:
        """Attribute the sampled reads ``counts`` (key → estimated reads) to their writers:
        ``writers(pairs)`` is ``Core.writers`` (the extension field and value size of each
        (key bytes, hash)); ``keys`` the client's key memo, ``key_hash`` its validator.
        Never raises a KVCommError of ``writers``: the reads are counted as unknown."""
        picked = list(counts)  # (keys only: no tuple per key of a full buffer)
        scale = 1.0
        if len(picked) > MAX_KEYS_PER_FLUSH:  # every k-th key, its count scaled by k
            step = -(-len(picked) // MAX_KEYS_PER_FLUSH)
            start = self._rot % step
            self._rot += 1
            scale = len(picked) / len(picked[start::step])
            picked = picked[start::step]
        pairs = []
        for key in picked:
            kh = keys.get(key)
            pairs.append(kh if kh is not None else key_hash(key))
        try:
            looked = writers(pairs)
        except KVCommError:  # (a corrupt segment: the read path repairs it; a sample can wait)
            self.unknown += sum(counts[key] for key in picked) * scale
            return
        names, edges = self._names, self.edges
        for key, found in zip(picked, looked, strict=True):
            n = counts[key]
            if found is None:
                continue  # gone meanwhile: a sample can do without it
            ext, size = found
            if ext in names:
                writer = names[ext]
            else:
                writer = agent_of(ext)
                if len(names) >= MAX_NAMES or self._names_bytes + len(ext) > MAX_NAMES_BYTES:
                    names.clear()
                    self._names_bytes = 0
                names[ext] = writer
                self._names_bytes += len(ext)
            reads = n * scale
            if writer is None:
                self.unknown += reads
                continue
            if writer == self.agent:
                continue  # its own key: not an edge
            e = edges.get(writer)
            if e is None:
                if len(edges) >= MAX_WRITERS and not self._evict_idle():
                    self.dropped += reads
                    continue
                e = edges[writer] = [0.0, 0.0]
            e[0] += reads
            e[1] += reads * size
            self._touched.add(writer)

    def _evict_idle(self) -> bool:
        """Forget one writer not read between the last two reports (nor since); False
        when every writer kept is being read."""
        while self._idle:
            w = self._idle.pop()
            if w in self.edges and w not in self._touched:
                del self.edges[w]
                return True
        return False

    # ------------------------------------------------------------------ the report file

    def report_due(self) -> bool:
        return self.clock() >= self._next

    def report(self, ops: int) -> bool:
        """Replace this agent's report with its totals now (``ops``: its operations so
        far). Returns whether it was written; never raises (a failure is counted, and
        warned about once per client)."""
        now = self.clock()
        self._next = now + REPORT_EVERY
        if self._closed:
            return False  # (a late flush of another thread: the agent is gone)
        if self._purged():  # (its files are gone: a report would make them again)
            self._closed = True
            return False
        self._idle = [w for w in self.edges if w not in self._touched]
        self._touched.clear()
        if ops <= 0 and not self.edges:
            return False  # nothing done yet (the node daemon's own client, say)
        data = msgpack.packb({
            "f": FORMAT, "agent": self.agent, "host": self.host, "pid": self._pid,
            "since": self.since, "t": now, "ops": ops,
            "edges": {w: [round(e[0]), round(e[1])] for w, e in self.edges.items()},
            "dropped": round(self.dropped), "unknown": round(self.unknown)})
        try:
            try:
                self._write(data)
            except FileNotFoundError:  # (the directory is gone: purged, or removed by hand)
                if self._purged():
                    self._closed = True
                    return False
                ensure_dir(self._dir, self._permissions)
                self._write(data)
        except (OSError, ValueError, KVCommError) as exc:  # (ValueError: a path it refuses)
            self.errors += 1
            if not self._warned:
                self._warned = True
                warnings.warn(f"agent {self.agent!r} cannot report what it reads to {self._dir} "
                              f"({exc}); placement will not see it until it can",
                              KVCommWarning, stacklevel=2)
            return False
        self._written = True
        self.reports += 1
        return True

    def _write(self, data: bytes) -> None:
        """Replace this agent's report file with ``data`` (a temporary file renamed)."""
        tmp = os.path.join(self._dir, f".{self._file}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     self._permissions)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, os.path.join(self._dir, self._file))

    def close(self) -> None:
        """Remove this agent's report (it no longer runs here); later reports write
        nothing. Never raises."""
        self._closed = True
        if self._written:
            try:
                os.unlink(os.path.join(self._dir, self._file))
            except OSError:
                pass
            self._written = False


_SAFE = re.compile(r"[^A-Za-z0-9_.@:=+-]")  # (what a report file's name may hold)
_FIELDS = ("f", "agent", "host", "pid", "since", "t", "ops", "edges", "dropped", "unknown")
_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:-")


def _number(v: Any) -> bool:
    """A finite number >= 0 (an int beyond a float too: it would overflow later)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    try:
        return 0 <= v < float("inf") and float(v) < float("inf")
    except OverflowError:
        return False


def _valid(r: Any) -> bool:
    """True for a report of ours (every field of the right type and range)."""
    if not isinstance(r, dict) or r.get("f") != FORMAT:
        return False
    host = r.get("host")
    if not is_agent_id(r.get("agent")) or type(host) is not str \
            or not 1 <= len(host) <= 64 or not set(host) <= _HOST_CHARS:
        return False
    for k in ("since", "t", "ops", "dropped", "unknown"):
        if not _number(r.get(k)):
            return False
    if type(r.get("pid")) is not int or not isinstance(r.get("edges"), dict):
        return False
    if len(r["edges"]) > MAX_WRITERS:
        return False
    for w, e in r["edges"].items():
        if not is_agent_id(w) or not isinstance(e, list) or len(e) != 2:
            return False
        if not all(_number(x) for x in e):
            return False
    return True


def _own_dir(path: str) -> int | None:
    """A descriptor of the table ``path`` if it is a directory of this user, reached
    without following a symlink; None otherwise (it is not ours to read or clean)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        return None
    return fd


def _read_report(dfd: int, name: str) -> Any:
    """The msgpack document in the table's file ``name``, or None: not a regular file of
    this user (never following a symlink, never waiting on a FIFO), too large, not
    msgpack."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)  # (what was opened, whatever the name pointed to a moment ago)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() \
                or st.st_size > MAX_REPORT_BYTES:
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_REPORT_BYTES + 1)
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception:  # half-written by something else, or not msgpack
        return None
    finally:
        os.close(fd)


def read_reports(path: str, *, clean: bool = True, now: float | None = None,
                 only_clean: bool = False) -> list[dict[str, Any]]:
    """The valid reports in the table ``path`` ([] when there is none, or when ``path`` is
    not a directory of this user: a symlink is never followed), each with its file name
    under ``"id"`` and the fields of the format only. With ``clean``, removes the reports
    of processes that are gone (after GONE_AFTER seconds), left-over temporary files, and
    files that are not reports. Never raises for what it finds: a file that is not a
    report (another user's, a symlink, a FIFO...) is skipped. ``only_clean``: the cleaning
    alone (a client's, at open), which reads no file younger than GONE_AFTER (none it
    could remove), and returns []."""
    now = time.time() if now is None else now
    dfd = _own_dir(path)
    if dfd is None:
        return []
    try:
        return _read_table(dfd, clean or only_clean, now, only_clean)
    finally:
        os.close(dfd)


def _read_table(dfd: int, clean: bool, now: float, only_clean: bool = False
                ) -> list[dict[str, Any]]:
    try:
        names = os.listdir(dfd)
    except OSError:
        return []
    out = []
    for name in sorted(names):
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            continue
        age = now - st.st_mtime
        if only_clean and age <= GONE_AFTER:
            continue  # (nothing this young is removed: a live agent's report, say)
        if name.startswith(".") and name.endswith(".tmp"):  # (an agent may be named ".x")
            if clean and age > TMP_AFTER:
                _unlink(name, dfd)
            continue
        report = _read_report(dfd, name) if stat.S_ISREG(st.st_mode) else None
        if not _valid(report):
            if clean and age > TMP_AFTER:
                _unlink(name, dfd)
            continue
        assert isinstance(report, dict)
        if clean and age > GONE_AFTER and not pid_alive(int(report["pid"])):
            _unlink(name, dfd)
            continue
        if only_clean:
            continue
        clean_report = {k: report[k] for k in _FIELDS}  # (unknown keys are not published)
        clean_report["id"] = name
        out.append(clean_report)
    return out


def _unlink(name: str, dfd: int) -> None:
    try:
        os.unlink(name, dir_fd=dfd)
    except OSError:
        pass


def remove_table(namespace: str, directory: str = SHM_DIR) -> None:
    """Remove the namespace's table of agent reports (with the namespace: ``purge``).
    Leaves alone a path that is not a directory of this user. Never raises for what it
    finds there."""
    import shutil

    path = agents_dir(namespace, directory)
    try:
        st = os.lstat(path)
    except OSError:
        return
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
        shutil.rmtree(path, ignore_errors=True)
