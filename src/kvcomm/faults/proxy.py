"""Network faults on one machine: a TCP proxy per host, in front of every server it uses.

Why a proxy
-----------
The dev cluster's hosts share one machine and its loopback: there is no cable to cut,
``tc netem`` is not available, and network namespaces need root. So each simulated host
reaches Redis and etcd only through its own proxy process, and faults act on that proxy:

* ``pass``: bytes flow both ways untouched;
* ``blackhole``: a partition. Nothing flows in either direction on any connection, old or
  new: data that arrives is held (TCP never loses bytes inside a connection, it stalls),
  and new connections are accepted but never reach the server. Clients see what a cut
  cable gives them: calls that time out. On heal, held data flows again (as TCP would
  retransmit it), by which time most clients have given up on those connections;
* ``delay``: every chunk is forwarded ``delay_ms`` late (order kept);
* ``drop`` (an action, not a mode): every live connection is reset at once, both sides,
  and new ones pass: what a restarted load balancer or a NAT timeout does.

A host is routed through its proxy by its config: ``cluster.address_remap`` maps each
server's real address (as Redis announces it in CLUSTER SLOTS and MOVED, as
``cluster.etcd`` lists it) to the proxy's port for it; ``cluster.seeds()`` and
``cluster.etcd_endpoints()`` apply it, and redis-py's ``RedisCluster(address_remap=...)``
applies it to the nodes it discovers (:func:`kvcomm.tiers.routing.follow_remap` also to
MOVED redirections, which redis-py does not remap). Every process that opens the host's config — its daemon
and its agents — goes through the proxy; other hosts are untouched.

One proxy process per host (``python -m kvcomm.faults.proxy``), asyncio, one listening
port per upstream server. It is controlled at run time through a unix socket that only
its owner can use (mode 0600 in a 0700 directory): one JSON request per connection,
``{"op": "set", "mode": "blackhole"}``, ``{"op": "set", "mode": "delay", "delay_ms":
50}``, ``{"op": "drop"}``, ``{"op": "status"}``; each answers with the proxy's status
(mode, live connections, counters), once the change has taken effect.
:class:`ProxyControl` is the client; :func:`start_proxy` starts one and returns once
its ports are known.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._wait import wait_until
from ..errors import InvalidArgument, Unavailable

MODES = ("pass", "blackhole", "delay")
Address = tuple[str, int]


def _addr(s: str) -> Address:
    host, _, port = s.rpartition(":")
    return host, int(port)


class _Conn:
    """One proxied connection: the client side and the server side."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.server: asyncio.StreamWriter | None = None
        self.tasks: list[asyncio.Task[None]] = []

    def abort(self) -> None:
        for w in (self.client, self.server):
            if w is None:
                continue
            sock = w.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):  # RST, not FIN: a dropped connection
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            w.transport.abort()
        for t in self.tasks:
            t.cancel()


class HostProxy:
    """The proxy of one host: ``upstreams`` each get a listening port on 127.0.0.1."""

    def __init__(self, upstreams: Sequence[Address]) -> None:
        self.upstreams = list(upstreams)
        self.ports: dict[str, int] = {}
        self.mode = "pass"
        self.delay_ms = 0.0
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.conns: set[_Conn] = set()
        self.counters = {"accepted": 0, "bytes": 0, "held_chunks": 0, "held_connections": 0,
                         "dropped": 0, "upstream_errors": 0}

    async def start(self) -> None:
        for up in self.upstreams:
            server = await asyncio.start_server(functools.partial(self._serve, up=up),
                                                "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            self.ports[f"{up[0]}:{up[1]}"] = int(port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     up: Address) -> None:
        conn = _Conn(writer)
        self.conns.add(conn)
        self.counters["accepted"] += 1
        try:
            if not self.flowing.is_set():
                self.counters["held_connections"] += 1
            await self.flowing.wait()  # a partitioned host's new connections go nowhere
            try:
                sr, sw = await asyncio.open_connection(up[0], up[1])
            except OSError:
                self.counters["upstream_errors"] += 1
                conn.abort()  # the server is down: the client sees a reset, as it would
                return
            conn.server = sw
            conn.tasks = [asyncio.ensure_future(self._pump(reader, sw)),
                          asyncio.ensure_future(self._pump(sr, writer))]
            await asyncio.wait(conn.tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in conn.tasks:
                t.cancel()
            for w in (conn.client, conn.server):
                if w is not None:
                    w.close()
            self.conns.discard(conn)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        while True:
            data = await src.read(65536)
            if not data:
                with contextlib.suppress(OSError):
                    dst.write_eof()
                return
            if not self.flowing.is_set():
                self.counters["held_chunks"] += 1
                await self.flowing.wait()
            if self.mode == "delay" and self.delay_ms > 0:
                await asyncio.sleep(self.delay_ms / 1000)
            dst.write(data)
            self.counters["bytes"] += len(data)
            await dst.drain()

    def set_mode(self, mode: str, delay_ms: float = 0.0) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.delay_ms = float(delay_ms) if mode == "delay" else 0.0
        if mode == "blackhole":
            self.flowing.clear()
        else:
            self.flowing.set()

    def drop(self) -> int:
        n = 0
        for conn in list(self.conns):
            conn.abort()
            n += 1
        self.counters["dropped"] += n
        return n

    def status(self) -> dict[str, Any]:
        return {"mode": self.mode, "delay_ms": self.delay_ms, "connections": len(self.conns),
                "ports": self.ports, "pid": os.getpid(), **self.counters}

    async def control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            req = json.loads(await reader.readline())
            op = req.get("op")
            out: dict[str, Any] = {}
            if op == "set":
                self.set_mode(str(req.get("mode")), float(req.get("delay_ms", 0)))
            elif op == "drop":
                out["dropped_now"] = self.drop()
            elif op != "status":
                raise ValueError(f"unknown op {op!r}")
            out.update(self.status())
            out["ok"] = True
        except (ValueError, TypeError) as exc:
            out = {"ok": False, "error": str(exc)}
        writer.write(json.dumps(out).encode() + b"\n")
        with contextlib.suppress(OSError):
            await writer.drain()
        writer.close()


async def _main(upstreams: list[Address], control: str, ports_file: str) -> None:
    proxy = HostProxy(upstreams)
    await proxy.start()
    ctl = Path(control)
    ctl.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(ctl.parent, 0o700)
    with contextlib.suppress(FileNotFoundError):
        ctl.unlink()
    old = os.umask(0o177)  # the socket is created 0600: only its owner can drive faults
    try:
        server = await asyncio.start_unix_server(proxy.control, path=str(ctl))
    finally:
        os.umask(old)
    tmp = Path(ports_file).with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "ports": proxy.ports}))
    tmp.replace(ports_file)  # the starter waits for this file: written once, whole
    async with server:
        await server.serve_forever()


# ---------------------------------------------------------------- starting and driving


def start_proxy(upstreams: Sequence[str], control: str | os.PathLike[str],
                ports_file: str | os.PathLike[str], log: str | os.PathLike[str] | None = None,
                timeout: float = 30.0) -> tuple[int, dict[str, str]]:
    """Start a proxy process for ``upstreams`` (``host:port``); returns its pid and the
    remap (upstream ``host:port`` → ``127.0.0.1:port`` of the proxy) once it listens.
    Raises Unavailable when it does not start within ``timeout``."""
    from ..devcluster.procs import running, spawn, stop

    Path(ports_file).unlink(missing_ok=True)
    argv = [sys.executable, "-m", "kvcomm.faults.proxy", "--control", str(control),
            "--ports-file", str(ports_file)] + [a for u in upstreams for a in ("--upstream", u)]
    proc: subprocess.Popen[bytes] = spawn(argv, log, detached=True)

    def ready() -> dict[str, Any]:
        if not running(proc.pid):
            raise Unavailable(f"the fault proxy exited at start (see {log})")
        try:
            return json.loads(Path(ports_file).read_text())  # type: ignore[no-any-return]
        except (OSError, ValueError):
            return {}  # not written yet

    try:
        info: dict[str, Any] = wait_until(ready, timeout, "the fault proxy to listen",
                                          interval=0.02)
    except BaseException:
        stop([proc])  # (a timeout, or Ctrl-C: nothing recorded it yet)
        raise
    remap = {up: f"127.0.0.1:{port}" for up, port in info["ports"].items()}
    return proc.pid, remap


class ProxyControl:
    """Drives one host's proxy through its control socket. Every method returns the
    proxy's status after the change; raises Unavailable when the proxy does not answer,
    InvalidArgument for a bad mode."""

    def __init__(self, path: str | os.PathLike[str], timeout: float = 5.0) -> None:
        self.path = str(path)
        self.timeout = timeout

    def _ask(self, req: dict[str, Any]) -> dict[str, Any]:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(self.timeout)
                s.connect(self.path)
                s.sendall(json.dumps(req).encode() + b"\n")
                data = b""
                while not data.endswith(b"\n"):
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    data += chunk
        except OSError as exc:
            raise Unavailable(f"the fault proxy at {self.path} does not answer: {exc}") from None
        try:
            out: dict[str, Any] = json.loads(data)
        except ValueError:
            raise Unavailable(f"the fault proxy at {self.path} answered {data[:100]!r}") from None
        if not out.get("ok"):
            raise InvalidArgument(f"the fault proxy refused {req}: {out.get('error')}")
        return out

    def set(self, mode: str, delay_ms: float = 0.0) -> dict[str, Any]:
        """Switch to ``mode`` (``pass``, ``blackhole``, ``delay`` with ``delay_ms``)."""
        if mode not in MODES:
            raise InvalidArgument(f"a proxy mode is one of {', '.join(MODES)}, got {mode!r}")
        return self._ask({"op": "set", "mode": mode, "delay_ms": delay_ms})

    def drop(self) -> dict[str, Any]:
        """Reset every live connection (``dropped_now`` says how many)."""
        return self._ask({"op": "drop"})

    def status(self) -> dict[str, Any]:
        return self._ask({"op": "status"})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvcomm.faults.proxy",
                                description="One host's fault proxy (see kvcomm.faults.proxy).")
    p.add_argument("--upstream", action="append", required=True, metavar="HOST:PORT",
                   help="a server this host reaches through the proxy (repeatable)")
    p.add_argument("--control", required=True, metavar="PATH", help="the control socket")
    p.add_argument("--ports-file", required=True, metavar="PATH",
                   help="where the listening ports are written once known")
    args = p.parse_args(argv)
    asyncio.run(_main([_addr(u) for u in args.upstream], args.control, args.ports_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
