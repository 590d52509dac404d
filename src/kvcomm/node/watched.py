"""Watched prefixes: how a host's watchers tell its node daemon which keys it wants.

In cluster mode a host's L2 holds only the keys it used, and the daemon applies the
cluster's changes only to those; a watcher on a prefix must see every change under it,
made on any host. So each watch registers its prefix in a directory next to the
segment (``kvcomm.NS.watch/``, one small file per watch, named ``PID-ID``, holding the
prefix), and the daemon (:class:`WatchedPrefixes`) reads that directory when its mtime
changes: from then on a change from L3 to a key under a watched prefix is applied into
L2 even when the host did not hold the key, and so appears in L2's change feed, where
the watchers read it. The daemon reports the directory mtime it has applied
(``watch_applied``) and how many times it may have missed changes (``watch_missed``: a
group resynced after a gap in its feed) in its status file; a watch waits for the first,
and tells its reader to rescan (an ``overflow`` event) when the second moves.

:meth:`WatchedPrefixes.wants` is the predicate "keys this host wants beyond those it
holds" that the daemon's delivery asks for every remote change.

Files of processes that are gone are removed by the daemon (every few seconds); the
directory goes with the namespace (``kvcomm purge``). The
files never hold anything but a prefix (UTF-8): nothing is unpickled, and a file that
is not valid UTF-8 is ignored.

The directory is in a place every user can write (/dev/shm): a watch refuses one that is
not a directory of this user with at most ``cache.l2_permissions`` (plus search bits)
— another user's could drop a watcher's registration or plant prefixes — and the daemon
reads only regular files of its user, never following a symlink nor waiting on a FIFO.
"""

from __future__ import annotations

import os
import stat
import uuid

from ..errors import SegmentError
from ..tiers.shm.files import pid_alive, watch_dir

PRUNE_EVERY_S = 5.0


def register(namespace: str, directory: str, prefix: str, permissions: int) -> tuple[str, int]:
    """Register a watch of ``prefix``: ``(its file, the directory's mtime after it)``.
    Raises SegmentError (the directory is another user's, a symlink, or has a wider mode
    than ``permissions``: nothing is written), OSError."""
    d = watch_dir(namespace, directory)
    mode = (permissions | (permissions & 0o444) >> 2) & 0o777
    try:
        os.mkdir(d, mode)
        os.chmod(d, mode)  # (mkdir's mode passed through the umask)
    except FileExistsError:
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() \
                or stat.S_IMODE(st.st_mode) & ~mode:
            raise SegmentError(
                f"{d} is not a directory of this user with mode at most {oct(mode)} "
                "(cache.l2_permissions): another user could drop or plant watch "
                "registrations there; remove it (as its owner) and watch again") from None
    path = os.path.join(d, f"{os.getpid()}-{uuid.uuid4().hex[:12]}")
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, permissions & 0o666)
    try:
        os.write(fd, prefix.encode("utf-8"))
    finally:
        os.close(fd)
    os.replace(tmp, path)  # (whole: the daemon never reads half a prefix)
    return path, os.stat(d).st_mtime_ns


def unregister(path: str) -> None:
    """Remove a watch's registration (nothing happens when it is gone already)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def _read_registration(path: str) -> str | None:
    """The prefix in the registration ``path``, or None: not a regular file of this user
    (never following a symlink, never waiting on a FIFO), or not UTF-8."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)  # (what was opened, whatever the name pointed to a moment ago)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        return os.read(fd, 4096).decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)


class WatchedPrefixes:
    """The daemon's view of its host's watched prefixes (see the module docstring)."""

    def __init__(self, namespace: str, directory: str) -> None:
        self.dir = watch_dir(namespace, directory)
        self.prefixes: tuple[str, ...] = ()
        self.applied = 0  # the directory mtime whose registrations are in ``prefixes``
        self._next_prune = 0.0

    def poll(self, now: float) -> bool:
        """Re-read the registrations if the directory changed (and prune those of dead
        processes every PRUNE_EVERY_S); True when the prefixes changed. Never raises."""
        prune = now >= self._next_prune
        if prune:
            self._next_prune = now + PRUNE_EVERY_S
        try:
            mtime = os.stat(self.dir).st_mtime_ns
        except OSError:
            changed = bool(self.prefixes)
            self.prefixes, self.applied = (), 0
            return changed
        if mtime == self.applied and not prune:
            return False
        found: set[str] = set()
        try:
            names = os.listdir(self.dir)
        except OSError:
            return False
        for name in names:
            pid, sep, _ = name.partition("-")
            if not sep or not pid.isdigit() or name.endswith(".tmp"):
                continue
            path = os.path.join(self.dir, name)
            if prune and not pid_alive(int(pid)):
                unregister(path)
                continue
            prefix = _read_registration(path)
            if prefix is not None:
                found.add(prefix)
        old = self.prefixes
        self.prefixes = tuple(sorted(found))
        self.applied = mtime
        return self.prefixes != old

    def wants(self, key: str) -> bool:
        """Whether a watcher of this host watches a prefix of ``key``."""
        return key.startswith(self.prefixes)  # (any of them; none: False)
