"""The kvcomm command as a user runs it: info, purge, config --show, demo."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

import kvcomm
from tests.support.helpers import SMALL, wait_for


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvcomm", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_config_show_defaults_and_file(tmp_path: Path) -> None:
    out = run("config", "--show")
    assert out.returncode == 0
    data = yaml.safe_load(out.stdout)
    # units as the config takes them (issue 8), and what is printed loads back
    assert data["cache"]["l2_sync_interval"] == "50ms" and data["network"]["zero_copy_threshold"] == "4KB"
    assert kvcomm.Config.from_mapping(data) == kvcomm.Config()
    f = tmp_path / "k.yaml"
    f.write_text("cache:\n  l1_size: 1GB\n")
    assert yaml.safe_load(run("config", "--show", "--config", str(f)).stdout)["cache"]["l1_size"] == "1GB"
    f.write_text("cache:\n  l1_size: lots\n")
    bad = run("config", "--show", "--config", str(f))
    assert bad.returncode == 2 and "cache.l1_size" in bad.stderr


def test_config_without_a_flag_shows_the_config() -> None:
    out = run("config")
    assert out.returncode == 0, out.stderr
    assert kvcomm.Config.from_mapping(yaml.safe_load(out.stdout)) == kvcomm.Config()


def test_info_shows_no_write_sequence_as_a_count(ns: str, config: kvcomm.Config) -> None:
    """After 50 writes ``kvcomm info`` printed "writes 1796159397065591" (the host's
    clock-seeded write sequence): every figure it prints is now a real amount."""
    with kvcomm.open(ns, config=config) as kv:
        for i in range(50):
            kv.put(f"k{i}", i)
        out = run("info", "--name", ns)
        assert out.returncode == 0, out.stderr
        figures = [int(n) for n in re.findall(r"(?<![\w.])\d+(?![\w.])", out.stdout)]
        assert 50 in figures and max(figures) < 1 << 40, out.stdout
        info = json.loads(run("info", "--name", ns, "--json").stdout)
        assert "writes" not in info and info["write_seq"] > 0


def test_info_and_purge(ns: str, config: kvcomm.Config) -> None:
    with kvcomm.open(ns, config=config) as kv:
        kv.put("a", b"x" * 1000)
        out = run("info", "--name", ns, "--json")
        assert out.returncode == 0, out.stderr
        info = json.loads(out.stdout)
        assert info["entries"] == 1 and info["used_bytes"] > 0
        text = run("info", "--name", ns).stdout  # (one entry: said so, "1 entry")
        assert "1 entry in" in text and "1 entries" not in text, text
    assert run("purge", "--name", ns).returncode == 0
    missing = run("info", "--name", ns)
    assert missing.returncode == 2 and "no L2 segment" in missing.stderr
    assert "creates it" in missing.stderr  # (what to do)
    again = run("purge", "--name", ns)
    assert again.returncode == 1 and "no L2 segment" in again.stderr, again.stderr


_HOLDER = """
import json, sys, kvcomm
kv = kvcomm.open(sys.argv[1], config=kvcomm.Config.from_mapping(json.loads(sys.argv[2])))
kv.put("k", 1)
print("open", flush=True)
sys.stdin.readline()
try:
    kv.get("k")
    print("no error")
except kvcomm.SegmentError as exc:
    print("SegmentError:", exc)
"""


def test_info_names_the_processes_that_have_a_namespace_open_and_purge_warns_of_them(
        ns: str) -> None:
    """A first hour's mistake: ``kvcomm purge`` while agents still use the namespace. It
    still purges (the one command that must always work), and says which processes had
    it open and what they see next; ``kvcomm info`` names them beforehand."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, ns, json.dumps(SMALL)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline() == "open\n"
        assert json.loads(run("info", "--name", ns, "--json").stdout)["open_by"] == [holder.pid]
        assert f"open by        1 process (pid {holder.pid})" in run("info", "--name", ns).stdout
        out = run("purge", "--name", ns)
        assert out.returncode == 0 and "purged namespace" in out.stdout
        assert f"1 process had it open (pid {holder.pid})" in out.stderr, out.stderr
        assert "SegmentError" in out.stderr and "kvcomm.open" in out.stderr
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert holder.stdout.readline().startswith("SegmentError:")  # (as the warning said)
    finally:
        holder.kill()
        holder.wait()
    with kvcomm.open(ns, config=kvcomm.Config.from_mapping(SMALL)):
        assert f"open by        1 process (pid {os.getpid()})" in run("info", "--name", ns).stdout
    assert "open by        no process" in run("info", "--name", ns).stdout  # (closed: unmapped)
    quiet = run("purge", "--name", ns)
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_list_shows_this_hosts_namespaces_and_skips_their_other_files(
        ns: str, config: kvcomm.Config, tmp_path: Path) -> None:
    """``kvcomm list``: each namespace's segment with its entries, not the namespace's
    other files (status, placement reports), nor a file that is not a segment; one of
    another layout is listed as unreadable. (a newcomer's first hour: only ls /dev/shm
    showed them)"""
    d = tmp_path / "shm"
    d.mkdir()
    cfg = kvcomm.Config.from_mapping({**config.model_dump(mode="json"),
                                      "cache": {**config.cache.model_dump(mode="json"),
                                                "l2_dir": str(d)}})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    empty = run("list", "--config", str(path))
    assert empty.returncode == 0 and "no namespace on this host" in empty.stdout, empty
    with kvcomm.open(ns, config=cfg, agent="a") as kv:
        kv.put("a", 1)
        kv.put("b", 2)
        (d / f"kvcomm.{ns}.node.json").write_text("{}")
        (d / "kvcomm.not-a-segment").write_bytes(b"hello there, not KVCOMM")
        seg = (d / f"kvcomm.{ns}").read_bytes()[:8]
        (d / f"kvcomm.{ns}.v2.migrating").write_bytes(seg)  # (a migration's aside file)
        (d / "kvcomm.older").write_bytes(seg[:7] + bytes([seg[7] - 1]) + b"\xff" * 64)
        fifo = d / "kvcomm.fifo"
        os.mkfifo(fifo)
        held = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # (a writer, and its bytes)
        os.write(held, seg + b"not for list")
        try:
            out = run("list", "--config", str(path), "--json", timeout=60)
            assert os.read(held, 100) == seg + b"not for list"  # (list read none of it)
        finally:
            os.close(held)
        assert out.returncode == 0, out.stderr
        rows = json.loads(out.stdout)
        by = {r["name"]: r for r in rows}
        assert sorted(by) == sorted([ns, "older"]) and by[ns]["entries"] == 2, rows
        assert "layout" in by["older"]["unreadable"], rows
        text = run("list", "--config", str(path))
        assert text.returncode == 0 and ns in text.stdout and "agents" not in text.stdout
        assert f"--name=NS --config {path}" in text.stdout, text.stdout
    kvcomm.tiers.l2.purge(ns, str(d))


def test_list_shows_the_files_killed_creators_left_and_purge_removes_them(tmp_path: Path) -> None:
    """A process killed while creating a namespace's file leaves its temporary file (a
    dot file, invisible to `ls`); `kvcomm list` says so, `kvcomm purge --dead-temps`
    removes it. A temporary file whose creator is still at work is left alone, and so is
    a FIFO named like one (never opened); one younger than 2 s is not listed (its creator
    may be about to lock it); one also linked into place holds no memory of its own. (a
    newcomer's first hour: stray .kvcomm.*.tmp files of killed test runs)"""
    from kvcomm.tiers.shm.files import create_temp

    d = tmp_path / "shm"
    d.mkdir()
    path = tmp_path / "c d.yaml"  # (a space: the hint quotes it)
    path.write_text(yaml.safe_dump({"cache": {"l2_dir": str(d)}}))
    old = time.time() - 60
    dead, fd = create_temp(str(d / "kvcomm.lost"), 0o600)
    os.posix_fallocate(fd, 0, 1 << 20)
    os.close(fd)  # (its lock goes with it: a killed creator's)
    linked, fd = create_temp(str(d / "kvcomm.placed"), 0o600)
    os.posix_fallocate(fd, 0, 1 << 20)
    os.close(fd)
    os.link(linked, d / "kvcomm.placed")  # (killed between the link and the unlink)
    young, fd = create_temp(str(d / "kvcomm.young"), 0o600)
    os.close(fd)
    soon = time.time() + 3600  # (changed "now" however slowly the commands below start)
    os.utime(young, (soon, soon))
    for p in (dead, linked):
        os.utime(p, (old, old))
    fifo = d / ".kvcomm.fifo.1.0123abcd.tmp"
    os.mkfifo(fifo)
    busy, held = create_temp(str(d / "kvcomm.building"), 0o600)
    os.utime(busy, (old, old))
    try:
        out = run("list", "--config", str(path))
        assert out.returncode == 0, out.stderr
        assert "2 temporary file(s)" in out.stdout and "hold 1.0 MiB" in out.stdout, out.stdout
        assert f"kvcomm purge --dead-temps --config '{path}'" in out.stdout, out.stdout
        gone = run("purge", "--dead-temps", "--config", str(path))
        assert gone.returncode == 0 and "removed 3 temporary file(s)" in gone.stdout, gone
        assert not os.path.exists(dead) and not os.path.exists(linked)
        assert os.path.exists(busy) and fifo.exists() and (d / "kvcomm.placed").exists()
        assert "temporary file" not in run("list", "--config", str(path)).stdout
    finally:
        os.close(held)
    both = run("purge", "--dead-temps", "--name", "x")
    assert both.returncode == 2 and "not allowed with" in both.stderr, both.stderr
    force = run("purge", "--dead-temps", "--force", "--config", str(path))
    assert force.returncode == 2 and "--force is for --name" in force.stderr, force.stderr
    path.write_text(yaml.safe_dump({"cache": {"l2_dir": str(tmp_path / "none")}}))
    missing = run("purge", "--dead-temps", "--config", str(path))
    assert missing.returncode == 2 and "cannot list" in missing.stderr, missing


def test_a_command_piped_into_a_reader_that_stops_exits_quietly() -> None:
    """``kvcomm ... | head -1``: no BrokenPipeError traceback; a broken pipe that is not
    stdout still raises."""
    code = ("import sys, kvcomm.cli as cli\n"
            "def big(args):\n"
            "    for i in range(200000): print('line', i)\n"
            "    return 0\n"
            "cli._config = big\n"
            "sys.exit(cli.main(['config']))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"line 0\n"
    proc.stdout.close()
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and b"Traceback" not in err, err
    import socket

    import kvcomm.cli as cli

    a, b = socket.socketpair()
    b.close()

    def sends(args: object) -> int:
        for _ in range(100):
            a.send(b"x" * 65536)
        return 0

    real = cli._config
    cli._config = sends  # type: ignore[assignment]
    try:
        with pytest.raises(BrokenPipeError):
            cli.main(["config"])
    finally:
        cli._config = real  # type: ignore[assignment]
        a.close()


def test_info_in_partition_mode_says_so_instead_of_a_dead_daemon(ns: str,
                                                                 config: kvcomm.Config) -> None:
    """In partition mode the daemon's loop waits on Redis timeouts and its L2 heartbeat
    goes stale, while its lease thread keeps the status file fresh: ``kvcomm info`` says
    partition mode, not "NOT heartbeating" (which it still says once the status is stale
    too: a dead daemon)."""
    import time

    from kvcomm.node.presence import status_path, write_status
    from kvcomm.tiers.shm.layout import H

    with kvcomm.open(ns, config=config) as kv:
        seg = kv._seg
        seg.daemon_heartbeat(os.getpid())
        seg._q[H["DAEMON_BEAT"]] = time.time_ns() // 1_000_000 - 10_000  # 10 s old
        path = status_path(ns, config.cache.l2_dir)
        status = {"host": "h", "pid": os.getpid(), "updated": time.time(), "partition": True,
                  "partition_reason": "Redis unreachable for 3.0s", "backlog": 5,
                  "feed_lag_s": 3.0}
        stop = threading.Event()

        def lease_thread() -> None:  # (as the daemon's: the status kept fresh, however
            while not stop.is_set():  # long the command takes to start on a loaded machine)
                write_status(path, {**status, "updated": time.time()})
                stop.wait(0.5)

        keeper = threading.Thread(target=lease_thread, daemon=True)
        try:
            keeper.start()
            try:
                out = run("info", "--name", ns)
            finally:
                stop.set()
                keeper.join(10)
            assert out.returncode == 0, out.stderr
            line = next(ln for ln in out.stdout.splitlines() if ln.startswith("node daemon"))
            assert "PARTITION MODE" in out.stdout and "NOT heartbeating" not in line, out.stdout
            assert "partition mode" in line, line
            write_status(path, {**status, "updated": time.time() - 60})  # a dead daemon
            out = run("info", "--name", ns)
            assert "NOT heartbeating" in out.stdout and "PARTITION" not in out.stdout, out.stdout
        finally:
            os.unlink(path)


@pytest.mark.multiprocess
def test_demo_smoke(tmp_path: Path) -> None:
    plot = tmp_path / "lat.png"
    shm = tmp_path / "shm"  # (--config's l2_dir: the demo's namespace is purged there)
    shm.mkdir()
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"cache": {"l2_dir": str(shm)}}))
    out = run("demo", "--agents", "3", "--seconds", "1", "--rate", "20", "--baseline", "manager",
              "--name", f"demo-test-{tmp_path.name}", "--plot", str(plot), "--config", str(config))
    assert out.returncode == 0, out.stderr
    assert os.listdir(shm) == [], os.listdir(shm)
    assert "get latency p50" in out.stdout and "3/3" in out.stdout
    # (one header line at the width of a pipe, and a gain that says which way it goes)
    assert "kvcomm's gain" in out.stdout, out.stdout
    assert "L2 misses (L3 in a cluster)" in out.stdout and "baseline: manager;" in out.stdout
    assert re.search(r"get latency p50 \(µs\).* \d+(\.\d)?x (faster|slower)", out.stdout), out.stdout
    assert plot.stat().st_size > 1000


@pytest.mark.parametrize(("ours", "theirs", "better", "cell"), [
    (4.9, 83.5, "lower", "17x faster"), (100.0, 50.0, "lower", "2.0x slower"),
    (80, 40, "higher", "2.0x more"), (40, 80, "higher", "2.0x fewer"),
    (1.0, 1.04, "lower", "same"), (1001, 1000, "higher", "same"), (80, 80, "higher", "same"),
    (1.0, 1.6, "lower", "1.6x faster"),
    (float("nan"), 5.0, "lower", ""), (5.0, float("nan"), "lower", ""),  # (nothing timed)
    (0, 100, "higher", "none"), (100, 0, "higher", "more (baseline: none)"),
    (0.0, 1.0, "lower", ""), (5.0, None, "lower", ""), (80, 80, "", "")])
def test_the_demos_gain_cell_says_which_way_and_never_nan(ours: float, theirs: float | None,
                                                          better: str, cell: str) -> None:
    from kvcomm.cli.demo import _gain

    assert _gain(ours, theirs, better) == cell


def test_demo_rejects_bad_arguments() -> None:
    out = run("demo", "--agents", "1")
    assert out.returncode == 2


@pytest.mark.redis
def test_dev_cluster_up_and_down_as_a_user_runs_it(tmp_path: Path) -> None:
    d = tmp_path / "dc"
    up = run("dev-cluster", "up", "--hosts", "2", "--dir", str(d))
    assert up.returncode == 0, up.stderr
    try:
        assert (d / "host-1.yaml").exists() and (d / "host-2.yaml").exists()
        assert run("dev-cluster", "up", "--hosts", "2", "--dir", str(d)).returncode == 2
        code = (
            "import kvcomm, time, sys\n"
            f"a = kvcomm.open(config={str(d / 'host-1.yaml')!r})\n"
            f"b = kvcomm.open(config={str(d / 'host-2.yaml')!r})\n"
            "a.put('drone/1/state', {'pos': [1, 2]})\n"
            "deadline = time.monotonic() + 10\n"
            "while b.get('drone/1/state') is None and time.monotonic() < deadline:\n"
            "    time.sleep(0.02)\n"
            "sys.exit(0 if b.get('drone/1/state') == {'pos': [1, 2]} else 1)\n"
        )
        agent = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               timeout=60)
        assert agent.returncode == 0, agent.stderr
    finally:
        down = run("dev-cluster", "down", "--dir", str(d))
    assert down.returncode == 0, down.stderr
    namespaces = [yaml.safe_load((d / f"host-{i}.yaml").read_text())["node"]["namespace"]
                  for i in (1, 2)]
    assert not any(Path(f"/dev/shm/kvcomm.{ns}").exists() for ns in namespaces)
    assert run("dev-cluster", "down", "--dir", str(d)).returncode == 1


def test_node_refuses_a_config_without_a_cluster(tmp_path: Path) -> None:
    f = tmp_path / "h.yaml"
    f.write_text("node:\n  host_id: h1\n")
    out = run("node", "--config", str(f))
    assert out.returncode == 2 and "cluster.redis" in out.stderr
    f.write_text("cluster:\n  redis: ['no-port']\n")
    out = run("node", "--config", str(f))
    assert out.returncode == 2 and "host:port" in out.stderr


def test_node_waits_for_an_unreachable_cluster_until_stopped(tmp_path: Path, ns: str) -> None:
    import signal

    f = tmp_path / "h.yaml"
    f.write_text(f"node:\n  namespace: {ns}\ncluster:\n  redis: ['127.0.0.1:1']\n  timeout: 100ms\n")
    proc = subprocess.Popen([sys.executable, "-m", "kvcomm", "node", "--config", str(f)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                              daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        wait_for(lambda: any("retrying" in x for x in lines) or proc.poll() is not None, 20,
                 "the daemon to report that it is waiting")
        assert proc.poll() is None, "".join(lines)  # still running, not exited
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0


def test_config_show_hides_the_password_and_loads_back(tmp_path: Path) -> None:
    f = tmp_path / "k.yaml"
    f.write_text("cache:\n  l2_permissions: 0o640\n  l1_size: 1536KB\n  negative_ttl: 500us\n"
                 "cluster:\n  redis: ['10.0.0.5:7000']\n  redis_password: hunter2-secret\n"
                 "  feed_poll: 0.0125\n")
    out = run("config", "--show", "--config", str(f))
    assert out.returncode == 0, out.stderr
    assert "hunter2-secret" not in out.stdout + out.stderr
    assert "  # redis_password: (set; hidden)\n" in out.stdout
    for line in ("l2_permissions: 0o640", "l1_size: 1536KB", "negative_ttl: 500us",
                 "feed_poll: 12500us", "l2_size: 256MB", "key_filter_rebuild: 10m"):
        assert f"  {line}\n" in out.stdout, line
    shown = tmp_path / "shown.yaml"
    shown.write_text(out.stdout)
    expected = kvcomm.Config.load(f)
    expected = expected.model_copy(
        update={"cluster": expected.cluster.model_copy(update={"redis_password": None})})
    assert kvcomm.Config.load(shown) == expected
    again = run("config", "--show", "--config", str(shown))  # a fixpoint from then on
    assert again.returncode == 0 and again.stdout == out.stdout.replace(
        "  # redis_password: (set; hidden)\n", "  redis_password: null\n")


def _no_traceback(out: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("kvcomm: "), out.stderr


def test_purge_of_a_directory_says_what_to_do(ns: str) -> None:
    path = Path(f"/dev/shm/kvcomm.{ns}")
    (path / "sub").mkdir(parents=True)
    try:
        out = run("purge", "--name", ns)
        assert out.returncode == 2
        _no_traceback(out)
        assert "is a directory" in out.stderr and f"rm -r {path}" in out.stderr
        assert path.is_dir()  # a directory is not ours to remove
    finally:
        shutil.rmtree(path)


def test_purge_of_an_invalid_name_is_a_message() -> None:
    out = run("purge", "--name", "../etc")
    assert out.returncode == 2
    _no_traceback(out)
    assert "invalid" in out.stderr


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to run the command as another user")
def test_purge_of_another_users_segment_says_whose_it_is(ns: str, config: kvcomm.Config) -> None:
    kvcomm.open(ns, config=config).close()
    path = Path(f"/dev/shm/kvcomm.{ns}")
    assert path.stat().st_uid == 0
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          sys.executable, "-m", "kvcomm", "purge", "--name", ns],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    _no_traceback(out)
    assert "permission denied" in out.stderr and "user root (uid 0)" in out.stderr
    assert path.exists()
    assert run("purge", "--name", ns).returncode == 0  # its owner can
    assert not path.exists()


@pytest.mark.parametrize("size", [8192, 4096, 100, 0])
def test_purge_removes_a_corrupt_or_foreign_segment(ns: str, size: int) -> None:
    path = Path(f"/dev/shm/kvcomm.{ns}")
    path.write_bytes((bytes(range(256)) * (size // 256 + 1))[:size])
    out = run("purge", "--name", ns)
    assert out.returncode == 0, out.stderr
    assert not path.exists()
    missing = run("purge", "--name", ns)
    assert missing.returncode == 1 and "no L2 segment" in missing.stderr


def test_purge_of_an_unreadable_segment_never_prints_a_traceback(ns: str) -> None:
    path = Path(f"/dev/shm/kvcomm.{ns}")
    path.write_bytes(bytes(range(256)) * 16 + b"xyz")  # not a whole number of 8-byte words
    try:
        out = run("purge", "--name", ns)
        assert out.returncode in (0, 2), out.stderr
        if out.returncode == 2:
            _no_traceback(out)
            assert f"rm {path}" in out.stderr
    finally:
        path.unlink(missing_ok=True)


def test_purge_removes_a_segment_of_odd_size(ns: str) -> None:
    path = Path(f"/dev/shm/kvcomm.{ns}")
    path.write_bytes(bytes(range(256)) * 16 + b"xyz")
    try:
        out = run("purge", "--name", ns)
        assert out.returncode == 0, out.stderr
        assert not path.exists()
    finally:
        path.unlink(missing_ok=True)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to run the command as another user")
def test_a_failed_purge_leaves_the_segment_working(ns: str) -> None:
    """A purge that cannot remove the file (another user's, in sticky /dev/shm) must not
    mark it purged either: its users would fail while new ones reopened the old data."""
    cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": "4MB", "l2_permissions": 0o666}})
    with kvcomm.open(ns, config=cfg) as kv:
        kv.put("k", 1)
        out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                              sys.executable, "-m", "kvcomm", "purge", "--name", ns],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr
        kv.put("k", 2)  # still a working segment
        assert kv.get("k") == 2


@pytest.mark.multiprocess
def test_a_creator_killed_on_a_real_process_leaves_a_file_list_shows_and_purge_removes(
        tmp_path: Path) -> None:
    """The fault itself, on real processes: a child that holds its temporary file (alive:
    neither listed nor removed) is SIGKILLed; then `kvcomm list` shows its file and
    `kvcomm purge --dead-temps` removes it, and the next namespace opened there works."""
    import signal

    from kvcomm.tiers.shm.files import create_temp, dead_temps

    d = tmp_path / "shm"
    d.mkdir()
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"cache": {"l2_dir": str(d), "l2_size": "16MB"}}))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # (the creator: its file made and locked, then killed mid-build)
        try:
            tmp, fd = create_temp(str(d / "kvcomm.built"), 0o600)
            os.posix_fallocate(fd, 0, 1 << 20)
            os.write(w, tmp.encode())
            time.sleep(60)
        finally:
            os._exit(1)
    try:
        tmp = os.read(r, 4096).decode()
        assert dead_temps(str(d), remove=True) == [] and os.path.exists(tmp)  # (alive: kept)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        os.close(w)
    old = time.time() - 60
    os.utime(tmp, (old, old))
    out = run("list", "--config", str(config))
    assert "1 temporary file(s)" in out.stdout and "hold 1.0 MiB" in out.stdout, out.stdout
    gone = run("purge", "--dead-temps", "--config", str(config))
    assert gone.returncode == 0 and "removed 1 temporary file(s)" in gone.stdout, gone
    assert not os.path.exists(tmp)
    with kvcomm.open("built", config=str(config)) as kv:
        kv.put("k", 1)
        assert kv.get("k") == 1
    kvcomm.tiers.l2.purge("built", str(d))


def test_a_bare_namespace_says_to_name_it_with_name_and_mcp_says_kvcomm_once() -> None:
    """(a newcomer's first hour: ``kvcomm info my-app`` printed the top-level usage and
    "unrecognized arguments"; ``kvcomm mcp`` said "kvcomm: kvcomm mcp needs")"""
    out = run("info", "my-app")
    assert out.returncode == 2 and "(a namespace is named with --name my-app)" in out.stderr
    out = run("purge", "my-app")  # (the likeliest: nothing removed)
    assert out.returncode == 2 and "(a namespace is named with --name my-app)" in out.stderr
    for args in (("list", "extra"), ("purge", "--name", "ns", "extra"), ("demo", "extra")):
        out = run(*args)  # (no namespace to name, or named already: no hint)
        assert out.returncode == 2 and "unrecognized arguments: extra" in out.stderr, args
        assert "--name extra" not in out.stderr, args
    out = run("purge")
    assert out.returncode == 2 and "give --name NS" in out.stderr
    pytest.importorskip("mcp")
    out = run("mcp")
    assert out.returncode == 2 and out.stderr.startswith("kvcomm: mcp needs --name NS")
