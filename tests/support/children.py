"""Child processes that a test forks one per round (a reader or a looper it interrupts)."""

from __future__ import annotations

import os
from multiprocessing.process import BaseProcess


def reap(p: BaseProcess, *fds: int) -> None:
    """The end of a round: kill the child if it still runs, reap it (10 s at most) and
    close the pipe ends ``fds`` it was given."""
    if p.is_alive():
        p.kill()
    p.join(10)
    for fd in fds:
        os.close(fd)
