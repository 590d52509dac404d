"""A namespace's files: their names and paths, who may own them, creating and attaching
the segment.

Every file of namespace ``NS`` lies in ``cache.l2_dir`` (``/dev/shm`` by default), named
here and nowhere else:

=============================  ==========================================================
``kvcomm.NS``                  the L2 segment (tiers/l2.py, tiers/shm/)
``kvcomm.NS.keys``             the node daemon's filter of existing keys (tiers/keyfilter.py)
``kvcomm.NS.node.json``        the node daemon's status for the host's agents (node/presence.py)
``kvcomm.NS.watch/``           the watchers' registered prefixes (node/watched.py)
``kvcomm.NS.agents/``          the agents' placement reports (placement/report.py)
``kvcomm.NS.vec.ID``           a LangGraph store's vector index (tiers/vectors.py)
=============================  ==========================================================

:func:`kvcomm.tiers.l2.purge` removes them with the namespace (the status file excepted:
the daemon that wrote it owns it).
"""

from __future__ import annotations

import fcntl
import os
import pwd
import re
import secrets
import stat
import time

from ...errors import InvalidNamespace, SegmentError

SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # (a segment's: made by any version)
_NEW_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # (a namespace made now)
SIDE_FILES = re.compile(r"\.(keys|node\.json|watch|agents|vec\.[0-9a-f]{16}|v\d+\.migrating)$")
"""The ends of the names of a namespace's other files (the table above; a migration's
``kvcomm.NS.vN.migrating``): no namespace's name ends so, or its segment would be
another namespace's file."""
_VECTOR_ID_RE = re.compile(r"^[0-9a-f]{16}$")


def segment_path(name: str, directory: str = SHM_DIR) -> str:
    """The file backing namespace ``name``. Raises SegmentError on a bad name (names
    that earlier versions made namespaces with are good here: they can still be opened,
    listed and purged; :func:`check_new_name` is the rule for a namespace made now)."""
    if type(name) is not str or not _NAME_RE.match(name):
        raise InvalidNamespace(
            f"namespace {name!r} is invalid: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return os.path.join(directory, f"kvcomm.{name}")


def check_side_name(name: str, path: str) -> None:
    """Raise InvalidNamespace when ``name`` ends as a namespace's own files do and
    ``path`` (its segment's) is not a segment: another namespace's file, never to be
    opened, purged or migrated as one (a namespace an earlier version made under such a
    name holds a segment there)."""
    side = SIDE_FILES.search(name)
    if side and (side[0].endswith(".migrating") or not _holds_a_segment(path)):
        _refuse_side_name(name, side)


def _holds_a_segment(path: str) -> bool:
    """Whether ``path`` is a regular file that begins as a KVCOMM segment of any layout."""
    from .layout import is_segment_magic

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        head = os.pread(fd, 8, 0) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    finally:
        os.close(fd)
    return len(head) == 8 and is_segment_magic(int.from_bytes(head, "little"))


def _refuse_side_name(name: str, side: re.Match[str]) -> None:
    raise InvalidNamespace(
        f"namespace {name!r} is invalid: a name ending in {side[0]!r} is the name of "
        f"namespace {name[:side.start()]!r}'s own file (its key filter, status, watches, "
        "agents, vector index or a migration); choose another name"
    )


def check_new_name(name: str) -> None:
    """Raise InvalidNamespace unless a namespace may be made under ``name`` now: it
    starts with a letter or digit (a name starting with '-' cannot be given on a command
    line, one starting with '.' is hidden), and it does not end as a namespace's own
    files do (``kvcomm.open("app.agents")`` would open namespace app's agents directory)."""
    if not _NEW_NAME_RE.match(name):
        raise InvalidNamespace(f"namespace {name!r} is invalid: use 1-64 letters, digits, '.', "
                               "'_' or '-', starting with a letter or digit")
    side = SIDE_FILES.search(name)
    if side:
        _refuse_side_name(name, side)


def filter_path(namespace: str, directory: str = SHM_DIR) -> str:
    """The node daemon's filter of the keys that exist (tiers/keyfilter.py). Raises
    SegmentError on a bad name."""
    segment_path(namespace)  # validates the name
    return os.path.join(directory, f"kvcomm.{namespace}.keys")


def status_path(namespace: str, directory: str) -> str:
    """Where the node daemon of ``namespace`` writes its status for the host's agents."""
    return os.path.join(directory, f"kvcomm.{namespace}.node.json")


def watch_dir(namespace: str, directory: str) -> str:
    """The directory where the watchers of ``namespace`` register their prefixes."""
    return os.path.join(directory, f"kvcomm.{namespace}.watch")


def agents_dir(namespace: str, directory: str = SHM_DIR) -> str:
    """The host's table of agent reports for ``namespace``. Raises SegmentError on a bad
    namespace."""
    return segment_path(namespace, directory) + ".agents"


def vector_path(namespace: str, index_id: str, directory: str = SHM_DIR) -> str:
    """The vector index ``index_id`` (16 hex digits) of ``namespace`` (tiers/vectors.py).
    Raises SegmentError on a bad namespace, ValueError on a bad index id."""
    segment_path(namespace)  # validates the name
    if not _VECTOR_ID_RE.match(index_id):
        raise ValueError(f"bad index id {index_id!r}")
    return os.path.join(directory, f"kvcomm.{namespace}.vec.{index_id}")


def vector_paths_re(namespace: str) -> re.Pattern[str]:
    """Matches the names (not paths) of ``namespace``'s vector index files."""
    return re.compile(rf"kvcomm\.{re.escape(namespace)}\.vec\.[0-9a-f]{{16}}")


def pid_alive(pid: int) -> bool:
    """True when ``pid`` runs and is not a zombie (a zombie cannot release anything)."""
    if pid <= 0 or pid > 1 << 22:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    # the state letter follows the command name, which is in parentheses
    end = data.rfind(b")")
    return data[end + 2 : end + 3] not in (b"Z", b"X")


def mapped_by(path: str) -> list[int]:
    """The pids of the processes, this one excepted, that have the file ``path`` mapped:
    the clients that have its namespace open, as far as ``/proc`` shows them (another
    user's processes only to root, another PID namespace's not at all). [] when the file
    is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return []
    # a maps line: address perms offset dev inode path; the dev as the kernel prints it
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}".encode()
    ino = str(st.st_ino).encode()
    me, users = os.getpid(), []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            with open(f"/proc/{entry.name}/maps", "rb") as f:
                data = f.read()
        except OSError:
            continue  # (gone meanwhile, or not ours to read)
        if b" " + ino + b" " not in data:
            continue
        for line in data.splitlines():
            fields = line.split(None, 5)
            if len(fields) >= 5 and fields[4] == ino and fields[3] == dev:
                users.append(int(entry.name))
                break
    return sorted(users)


def check_owner(path: str, st: os.stat_result, permissions: int) -> None:
    """Refuse a shared file another user could have planted or can reach.

    Raises SegmentError naming the owner and the mode when ``st`` is not owned by this
    process's effective user or grants more than ``permissions``.
    """
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid() or mode & ~permissions:
        try:
            owner = pwd.getpwuid(st.st_uid).pw_name
        except KeyError:
            owner = str(st.st_uid)
        raise SegmentError(
            f"{path} is owned by {owner!r} with mode {oct(mode)}; this process runs as uid "
            f"{os.geteuid()} and allows {oct(permissions)} (cache.l2_permissions): not using a "
            "file another user could have created or can read. Remove it (as its owner) or "
            "use another namespace"
        )


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass



# A file built under a temporary name (a segment, a key filter) is linked or renamed into
# place only once whole. Its builder holds an flock on it meanwhile: a temporary file
# nobody holds locked is a dead builder's (whatever its pid or PID namespace), and
# whoever builds the same file next removes it. The name begins with "." so that it can
# never be a namespace's own file (those begin with "kvcomm.").
_TEMP_RE = r"\.{base}\.\d+\.[0-9a-f]{{8}}\.tmp"


def create_temp(path: str, permissions: int) -> tuple[str, int]:
    """A new, empty file beside ``path`` under a temporary name, of mode exactly
    ``permissions``, locked by this process (see :func:`remove_dead_temps`) until its fd is
    closed. Returns ``(temporary path, fd)``. Raises OSError."""
    directory, base = os.path.split(path)
    while True:
        tmp = os.path.join(directory, f".{base}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     permissions & 0o777)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            # a cleaner may have taken it for a dead builder's before the lock: then its
            # name is gone (or names another file), and this one starts again
            st, here = os.fstat(fd), os.stat(tmp, follow_symlinks=False)
            if (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino):
                os.fchmod(fd, permissions & 0o777)  # exactly, whatever the umask
                return tmp, fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            _unlink_quietly(tmp)
            raise
        os.close(fd)


def remove_dead_temps(path: str) -> None:
    """Remove the temporary files of ``path`` (:func:`create_temp`) whose builders are
    gone: killed, or interrupted before they could remove them. Files of other users,
    and those still locked by their builder, are left alone."""
    directory, base = os.path.split(path)
    try:
        dead_temps(directory, re.escape(base), remove=True)
    except OSError:
        pass  # (the directory unreadable: the build that follows says so)


_ANY_BASE = r"kvcomm\..+"  # (a temporary file of any of KVCOMM's files)
_NEWBORN_S = 2.0  # (dead_temps' listing: a younger file may be a builder's not yet locked)


def dead_temps(directory: str, base: str = _ANY_BASE, *,
               remove: bool = False) -> list[tuple[str, int]]:
    """``(path, bytes it alone holds)`` of each temporary file in ``directory``
    (:func:`create_temp`) of a file whose name matches the regex ``base`` (default: any of
    KVCOMM's) whose builder is gone. With ``remove``, each is removed too, under its lock
    (a builder that opened its file and has not locked it yet finds its name gone and
    starts again); without, it only looks (a shared lock, and files changed in the last
    2 s are left out: a builder may be about to lock one). Only regular files of this
    user are opened; those still locked by their builder are left out. A temporary file
    that is also linked into place (a builder killed between the link and the unlink)
    holds no memory of its own: 0 bytes. Raises OSError when ``directory`` cannot be
    listed."""
    pattern = re.compile(_TEMP_RE.format(base=base))
    names = [n for n in os.listdir(directory or ".") if pattern.fullmatch(n)]
    found = []
    for name in names:
        tmp = os.path.join(directory, name)
        try:
            before = os.lstat(tmp)  # (never open a FIFO, a device or a link)
            if not stat.S_ISREG(before.st_mode) or before.st_uid != os.geteuid() or (
                    not remove and time.time() - before.st_mtime < _NEWBORN_S):
                continue
            fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
                continue
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if remove else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its builder is at work
            here = os.stat(tmp, follow_symlinks=False)
            if (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino):
                if remove:
                    os.unlink(tmp)
                found.append((tmp, st.st_blocks * 512 if st.st_nlink == 1 else 0))
        except OSError:
            pass
        finally:
            os.close(fd)
    return found
