"""One standalone ``redis-server`` on loopback, on a free port, in a temporary directory.

The peer the demo and the benchmarks measure KVCOMM against (Redis over TCP and over a
unix socket). It is the Debian ``redis-server`` binary, never a mock.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile

from .._wait import wait_until
from ..errors import Unavailable
from .procs import Service, spawn, stop


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections take theirs
    from there), 32768 where it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(rng: random.Random | None = None) -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, below the kernel's
    ephemeral range: a port the kernel hands out (a bind to 0) may be taken by an
    outgoing connection before the server meant to listen on it binds it."""
    rng = rng or random.Random()
    hi = ephemeral_low()
    lo = 10000 if hi > 12000 else 1024
    for _ in range(1000):
        port = rng.randrange(lo, hi)
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return port
    raise Unavailable(f"no free TCP port on 127.0.0.1 in {lo}-{hi - 1}")


def redis_server_path() -> str | None:
    """Where ``redis-server`` is on PATH, or None when it is not installed."""
    return shutil.which("redis-server")


class RedisServer(Service):
    """One standalone ``redis-server`` on 127.0.0.1 plus a unix socket (mode 700).

    ``start()`` returns once it answers PING or raises Unavailable; ``stop()`` ends it
    and removes its directory. Persistence is off: it is a peer to measure, not a store.
    """

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="kvcomm-redis-")
        self.unix_socket = os.path.join(self.dir, "redis.sock")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start it; returns self once it answers PING. Raises Unavailable (nothing left
        running) when redis-server is missing, exits or stays silent for ``timeout`` s."""
        exe = redis_server_path()
        if exe is None:
            raise Unavailable("redis-server is not installed (Debian: apt-get install redis-server)")
        proc = self.proc = spawn(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--unixsocket", self.unix_socket, "--unixsocketperm", "700",
             "--dir", self.dir, "--protected-mode", "yes", "--loglevel", "warning"],
            detached=False)

        def answers() -> bool:
            if proc.poll() is not None:
                raise Unavailable(f"redis-server exited with {proc.returncode} at start")
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")

        try:
            wait_until(answers, timeout, f"redis-server to answer on port {self.port}",
                       retry_on=(OSError,))
        except Unavailable:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """End the server (if started) and remove its directory."""
        if self.proc is not None:
            stop([self.proc], timeout=5.0)
        shutil.rmtree(self.dir, ignore_errors=True)
