"""Real servers on loopback, on free ports, in temporary directories: for tests, benchmarks
and the demo's baseline. Nothing here is a mock: these are the Debian ``redis-server``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from types import TracebackType

from ..errors import Unavailable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def terminate(procs: list[subprocess.Popen[bytes]], timeout: float = 5.0) -> None:
    """SIGTERM (after SIGCONT, in case a test paused them), then SIGKILL stragglers."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def redis_server_path() -> str | None:
    return shutil.which("redis-server")


class RedisServer:
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
        exe = redis_server_path()
        if exe is None:
            raise Unavailable("redis-server is not installed (Debian: apt-get install redis-server)")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--unixsocket", self.unix_socket, "--unixsocketperm", "700",
             "--dir", self.dir, "--protected-mode", "yes", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise Unavailable(f"redis-server exited with {self.proc.returncode} at start")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            time.sleep(0.01)
        self.stop()
        raise Unavailable(f"redis-server did not answer on port {self.port} within {timeout}s")

    def stop(self) -> None:
        if self.proc is not None:
            terminate([self.proc])
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
