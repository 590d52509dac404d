"""The segment's file: its name and path, who may own it, creating and attaching it."""

from __future__ import annotations

import os
import pwd
import re
import stat

from ...errors import SegmentError

SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def segment_path(name: str, directory: str = SHM_DIR) -> str:
    """The file backing namespace ``name``. Raises SegmentError on a bad name."""
    if type(name) is not str or not _NAME_RE.match(name):
        raise SegmentError(
            f"namespace {name!r} is invalid: use 1-64 letters, digits, '.', '_' or '-'"
        )
    return os.path.join(directory, f"kvcomm.{name}")


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

