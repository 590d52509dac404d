"""Review of affinity placement (issue 12): each test is a finding, its docstring ("F:")
says what breaks and why it matters."""

from __future__ import annotations

import json
import os
import stat
import sys
import threading
from pathlib import Path
from typing import Any

import msgpack
import pytest

import kvcomm
from kvcomm.cli import main as cli_main
from kvcomm.placement import report
from kvcomm.placement.agents import with_agent
from kvcomm.placement.graph import Graph, Plan
from kvcomm.placement.launcher import Launcher
from kvcomm.placement.observe import _decode_snapshot, graph_from, host_snapshot
from tests.support.helpers import SMALL, wait_for


def _cfg(**cache: Any) -> kvcomm.Config:
    return kvcomm.Config.from_mapping({"cache": {**SMALL["cache"], **cache}})


def _graph(**edits: Any) -> dict[str, Any]:
    return {"agents": [{"id": "a", "host": "h1", "load": 1}, {"id": "b", "host": "h2", "load": 1}],
            "edges": [{"reader": "a", "writer": "b", "reads_per_s": 1, "bytes_per_s": 1}]}


# ---------------------------------------------------------------- the graph and plan contracts


def _huge_load() -> dict[str, Any]:
    g = _graph()
    g["agents"][0]["load"] = 10 ** 400  # (json.loads reads such an integer as an int)
    return g


def _list_reader() -> dict[str, Any]:
    g = _graph()
    g["edges"][0]["reader"] = ["a"]
    return g


def _dict_writer() -> dict[str, Any]:
    g = _graph()
    g["edges"][0]["writer"] = {"id": "b"}
    return g


@pytest.mark.parametrize("make", [_huge_load, _list_reader, _dict_writer])
def test_a_graph_with_a_huge_integer_or_an_unhashable_id_is_refused(make: Any) -> None:
    """F: Graph.from_json raised OverflowError (an integer beyond a float, which JSON
    allows) and TypeError (a list or object as an edge's reader/writer) instead of
    InvalidArgument: `kvcomm placement plan` died with a traceback on a hostile graph
    instead of exit status 2 and a message naming the place."""
    with pytest.raises(kvcomm.InvalidArgument):
        Graph.from_json(make())


def test_a_plan_with_an_unhashable_agent_in_moves_is_refused() -> None:
    """F: Plan.from_json raised TypeError for a move whose agent is a list: the launcher
    (`kvcomm placement launch --plan`) died with a traceback on a corrupt plan."""
    with pytest.raises(kvcomm.InvalidArgument):
        Plan.from_json({"assignment": {"a": "h1"}, "moves": [{"agent": ["a"], "to": "h1"}],
                        "predicted": {}})


def test_the_cli_plan_of_a_huge_integer_graph_exits_2(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """F: the same, from the command line: a traceback instead of exit status 2."""
    gfile = tmp_path / "g.json"
    gfile.write_text(json.dumps(_huge_load()))
    assert cli_main(["placement", "plan", "--graph", str(gfile), "--hosts", "h1,h2",
                     "--out", str(tmp_path / "p.json")]) == 2
    assert "agents[0].load" in capsys.readouterr().err


def test_huge_but_finite_rates_give_a_plan_the_launcher_accepts() -> None:
    """F: rates near the float limit (1e308, valid by the contract: finite, >= 0) overflow
    in the sums: the plan's predicted share was NaN (written to plan.json as `NaN`, which
    is not JSON, and refused by load_plan/the launcher), and loads that overflow to inf
    made every host "within balance" (both agents of load 1e308 on one host)."""
    from kvcomm.placement.plan import make_plan

    g = _graph()
    g["edges"][0]["reads_per_s"] = 1e308
    g["edges"].append({"reader": "b", "writer": "a", "reads_per_s": 1e308, "bytes_per_s": 0})
    plan = make_plan(Graph.from_json(g), ["h1", "h2"], balance=2)
    back = Plan.from_json(json.loads(json.dumps(plan.to_json(), allow_nan=False)))
    assert back.share == 1.0 and back.before == 0.0
    g = _graph()
    g["agents"][0]["load"] = g["agents"][1]["load"] = 1e308
    plan = make_plan(Graph.from_json(g), ["h1", "h2"], balance=1.5)
    assert sorted(plan.assignment.values()) == ["h1", "h2"]  # 2e308 on one host breaks 1.5x


# ---------------------------------------------------------------- observe: what L3 holds


def _rep(**kw: Any) -> dict[str, Any]:
    r = {"f": 1, "agent": "a", "host": "h1", "pid": 1, "since": 0.0, "t": 10.0, "ops": 10,
         "edges": {"b": [5, 50]}, "dropped": 0, "unknown": 0, "id": "a.1.x"}
    r.update(kw)
    return r


def _snap(host: str, *reports: dict[str, Any]) -> dict[str, Any]:
    s = _decode_snapshot(msgpack.packb({"f": 1, "host": host, "t": 1.0, "reports": list(reports)}))
    assert s is not None
    return s


@pytest.mark.parametrize("bad", [
    {"host": "evil host/1"},  # not a host id
    {"host": "h" * 100},  # too long for one
    {"since": 0.0, "t": 5e-324, "ops": 10 ** 18},  # a rate beyond a float
    {"id": "z.1.y", "since": 0.0, "t": 1e-300, "edges": {"b": [10 ** 18, 10 ** 18]}},
])
def test_observe_keeps_its_own_contract_whatever_another_host_published(bad: dict[str, Any]) -> None:
    """F: graph_from trusted every report that _valid let through from L3 (any host's
    snapshot, or a process of the host that wrote its table): a report's host that is
    not a host id, or rates that overflow to inf, went into graph.json, which then
    `kvcomm placement plan` refused as breaking the contract: one odd report anywhere in
    the cluster stopped the whole observe -> plan loop. The odd report must be left out
    and the rest of the graph kept."""
    good = _rep(agent="c", id="c.1.x", host="h2", edges={"b": [5, 50]})
    g = graph_from([], [_snap("h1", _rep(**bad)), _snap("h2", good)])
    doc = json.loads(json.dumps(g.to_json(), allow_nan=False))
    assert Graph.from_json(doc) == g
    assert ("c", "b") in {(e.reader, e.writer) for e in g.edges}


# ---------------------------------------------------------------- the host's table


def test_an_agent_whose_name_starts_with_a_dot_is_observed(ns: str) -> None:
    """F: '.x' is a valid agent name (letters, digits, '_.:-'), but its report file
    '.x.PID.HEX' starts with '.', which read_reports takes for a temporary file: the agent
    never appears in the graph, and the daemon deletes its report after a minute."""
    cfg = _cfg(hot_key_sample=1)
    table = report.agents_dir(ns, cfg.cache.l2_dir)
    with kvcomm.open(ns, config=cfg, agent=".x") as r, kvcomm.open(ns, config=cfg, agent="w") as w:
        w.put("k", b"v")
        for _ in range(100):
            r.get("k")
        r.hot_keys(1)
        assert r._observer is not None and r._observer.reports >= 1
        got = {rep["agent"] for rep in report.read_reports(table, now=1e12)}  # (all aged)
        assert ".x" in got
        assert any(name.startswith(".x.") for name in os.listdir(table))  # not cleaned away


def test_a_report_swapped_for_a_fifo_never_blocks_the_daemon(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """F: read_reports lstat()s a file, then open()s it by name: a file replaced between
    the two by a FIFO (or a symlink to one, or to /dev/...) is opened and read, and a
    FIFO with no writer blocks open() forever: the node daemon's loop (which publishes
    the table from its step) hangs. Here the swap is simulated by an lstat that saw a
    regular file."""
    table = tmp_path / "t"
    report.ensure_dir(str(table), 0o600)
    fifo = table / "a.1.x"
    os.mkfifo(fifo)
    def as_before_the_swap(real: Any) -> Any:
        def look(path: Any, *a: Any, **kw: Any) -> os.stat_result:
            st = real(path, *a, **kw)
            if os.path.basename(os.fspath(path)) == fifo.name:  # a moment before the swap
                return os.stat_result((stat.S_IFREG | 0o600,) + tuple(st)[1:])
            return st
        return look

    monkeypatch.setattr(report.os, "lstat", as_before_the_swap(os.lstat))
    monkeypatch.setattr(report.os, "stat", as_before_the_swap(os.stat))
    done: list[Any] = []
    t = threading.Thread(target=lambda: done.append(report.read_reports(str(table))), daemon=True)
    t.start()
    try:
        wait_for(lambda: done, 10, "read_reports to return")
    finally:
        if not done:  # unblock the thread: a writer opens the FIFO
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
    assert done == [[]]


def test_a_symlinked_report_is_not_followed(tmp_path: Path) -> None:
    """(held) A symlink in the table, to a valid report elsewhere, is not read."""
    table = tmp_path / "t"
    report.ensure_dir(str(table), 0o600)
    target = tmp_path / "elsewhere"
    target.write_bytes(msgpack.packb({k: v for k, v in _rep(pid=os.getpid()).items() if k != "id"}))
    os.symlink(target, table / "a.1.x")
    assert report.read_reports(str(table)) == []
    assert target.exists()


def test_the_hosts_snapshot_carries_only_the_report_fields(tmp_path: Path) -> None:
    """F: a report may carry keys the format does not know (readers ignore them), and the
    daemon published each report as it read it: 4096 reports of up to 1 MiB each (junk in
    an unknown key) make a snapshot of gigabytes in the daemon's memory, over Redis's
    512 MB value limit, and over observe's 64 MiB bound (so the host's agents vanish
    from the graph). The snapshot should carry the fields of the format, nothing else."""
    table = tmp_path / "t"
    report.ensure_dir(str(table), 0o600)
    rep = {k: v for k, v in _rep(pid=os.getpid()).items() if k != "id"}
    (table / "a.1.x").write_bytes(msgpack.packb({**rep, "junk": "x" * (512 << 10)}))
    snap = host_snapshot("h1", str(table), 1.0)
    assert [r["agent"] for r in snap["reports"]] == ["a"]
    assert len(msgpack.packb(snap)) < 4096


# ---------------------------------------------------------------- bounded memory of sampling


def test_the_writer_names_cache_stays_small_whatever_the_extension_fields(ns: str) -> None:
    """F: AgentStats caches extension field -> writer id for up to MAX_NAMES (4096)
    fields, keyed by the whole field, which may be 4 KiB (other features' keys share the
    map): up to 16 MiB per client, for a cache whose useful content is a few hundred
    names. Records whose field differs per record (an expiry, say) fill it with garbage."""
    cfg = _cfg(hot_key_sample=1)
    with kvcomm.open(ns, config=cfg, agent="r") as r:
        obs = r._observer
        assert obs is not None
        n = 0
        for i in range(report.MAX_NAMES):
            ext = with_agent(msgpack.packb({"pad": "p" * 3900, "i": i}), "w")
            obs.sampled({f"k{i}": 1}, {}, lambda k: (k.encode(), 1),
                        lambda pairs, ext=ext: [(ext, 10)] * len(pairs))
            n += 1
        held = sum(len(k) for k in obs._names)
        assert obs.edges["w"][0] == n
        assert held <= 1 << 20, f"{held} bytes of extension fields cached"


def test_a_full_writer_table_still_learns_writers_that_came_later(
        ns: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """F: the edge table keeps running totals of up to MAX_WRITERS writers since the
    agent started, and never forgets one: once a long-lived agent has read MAX_WRITERS
    distinct writers (unnamed PID@HOST ones come and go with every restart), every read
    of a new writer is only counted as dropped, forever: placement goes blind for that
    reader. Writers no longer read (unchanged since the last report) should give way."""
    monkeypatch.setattr(report, "MAX_WRITERS", 3)
    t = [0.0]
    cfg = _cfg(hot_key_sample=1)
    with kvcomm.open(ns, config=cfg, agent="r"):  # (the table's directory exists)
        obs = report.AgentStats("r", "local", ns, cfg.cache.l2_dir, 0o600, clock=lambda: t[0])

        def look(pairs: list[tuple[bytes, int]]) -> list[tuple[bytes, int] | None]:
            return [(with_agent(b"", kb.decode()), 1) for kb, _ in pairs]

        obs.sampled({"old1": 5, "old2": 5, "old3": 5}, {}, lambda k: (k.encode(), 0), look)
        assert obs.report(10)
        for i in range(5):  # later: only the new writer is read, report after report
            t[0] += 2.0
            obs.sampled({"new": 50}, {}, lambda k: (k.encode(), 0), look)
            assert obs.report(20 + i)
        try:
            assert obs.edges.get("new", [0.0])[0] > 0, f"dropped {obs.dropped}"
        finally:
            obs.close()


# ---------------------------------------------------------------- the launcher


def test_the_launcher_leaves_other_braces_in_the_command_alone(tmp_path: Path) -> None:
    """F: the launcher replaced {agent}/{host}/{config} with str.format_map, so any other
    brace in the command (a JSON argument, `python -c "d = {}"`, awk '{print $1}')
    raised KeyError/ValueError: the agent cannot be launched, and from the command line
    it is a traceback. The README promises only the three fields are replaced."""
    out = tmp_path / "out.txt"
    launcher = Launcher({"h1": "/c/h1.yaml"})
    code = "import sys; d = {'k': 1}; open(sys.argv[1], 'w').write(sys.argv[2] + ' ' + sys.argv[3])"
    try:
        launcher.apply(Plan({"a": "h1"}, (), None, None),
                       [sys.executable, "-c", code, str(out), "{agent}", '{"json": [1]}'])
        assert launcher.wait() == 0
    finally:
        launcher.stop_all()
    assert out.read_text() == 'a {"json": [1]}'


def test_launch_of_a_command_that_cannot_run_exits_2(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """F: `kvcomm placement launch ... -- no-such-program` died with a FileNotFoundError
    traceback (the CLI catches only KVCommError), where a newcomer's typo should get
    exit status 2 and a message naming the command."""
    (tmp_path / "cluster.json").write_text(json.dumps({"hosts": [{"host": "h1", "config": "/c/h1.yaml"}]}))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"assignment": {"a": "h1"}, "moves": [], "predicted": {}}))
    assert cli_main(["placement", "launch", "--plan", str(plan), "--dir", str(tmp_path), "--",
                     str(tmp_path / "no-such-program"), "{agent}"]) == 2
    assert "no-such-program" in capsys.readouterr().err


def _planted(tmp_path: Path, how: str) -> tuple[Path, Path]:
    """A table at ``tmp_path/table`` that is not this user's (``how``), and a file of
    someone's, old enough to be cleaned, where the table leads."""
    victim = tmp_path / "victim"
    victim.mkdir()
    precious = victim / "precious.txt"
    precious.write_text("not a report")
    old = os.stat(precious).st_mtime - report.TMP_AFTER - 5
    os.utime(precious, (old, old))
    table = tmp_path / "table"
    if how == "symlink":  # /dev/shm is world-writable: anyone can plant the table's name
        os.symlink(victim, table)
    else:  # a directory another user made (and filled), under the table's name
        table.mkdir(mode=0o777)
        (table / "precious.txt").write_text("not a report")
        os.utime(table / "precious.txt", (old, old))
        os.chown(table / "precious.txt", 65534, 65534)
        os.chown(table, 65534, 65534)
        precious = table / "precious.txt"
    return table, precious


@pytest.mark.parametrize("how", ["symlink", "other-user"])
def test_the_daemon_never_cleans_a_table_that_is_not_its_users_own(tmp_path: Path, how: str) -> None:
    """F: read_reports(clean=True), which the node daemon runs every second on
    /dev/shm/kvcomm.NS.agents, listed the path with os.listdir, which follows a symlink,
    and took no notice of who owns the directory. /dev/shm is world-writable: any local
    user can plant that name, as a symlink to a directory the daemon's user can write
    (its home, another namespace's data), and the daemon then deletes every file there
    older than a minute that is not a report. Agents refuse such a table (ensure_dir);
    the daemon must refuse it too: read nothing, remove nothing."""
    if os.geteuid() != 0 and how == "other-user":
        pytest.skip("making another user's directory needs root")
    table, precious = _planted(tmp_path, how)
    assert report.read_reports(str(table)) == []
    assert precious.exists(), "the daemon deleted a file outside its own table"


def test_a_report_of_another_user_is_not_read(tmp_path: Path) -> None:
    """F: read_reports read (and published to L3) a file in the table whatever its owner:
    in the table of a group-shared namespace (cache.l2_permissions 0o660: the directory is
    group-writable), another user's planted report speaks for any agent name. Only the
    table owner's files are reports (agents of other users cannot write there anyway:
    ensure_dir refuses a table that is not theirs)."""
    if os.geteuid() != 0:
        pytest.skip("making another user's file needs root")
    table = tmp_path / "t"
    report.ensure_dir(str(table), 0o660)
    rep = {k: v for k, v in _rep(pid=os.getpid()).items() if k != "id"}
    (table / "a.1.x").write_bytes(msgpack.packb(rep))
    os.chown(table / "a.1.x", 65534, 65534)
    assert report.read_reports(str(table)) == []


def test_a_launch_stopped_with_sigterm_stops_its_agents(tmp_path: Path) -> None:
    """F: the README's walkthrough runs `kvcomm placement launch ... &` and then says "stop
    the first launch": `kill PID` (SIGTERM, as any supervisor or script stops a process)
    killed the launcher without its `finally` (only Ctrl-C, KeyboardInterrupt, was
    handled), leaving every agent running, unowned, beside the ones the next plan starts:
    two drone-7s on two hosts."""
    import signal
    import subprocess

    (tmp_path / "cluster.json").write_text(json.dumps({"hosts": [{"host": "h1", "config": "/c/h1.yaml"}]}))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"assignment": {"a": "h1"}, "moves": [], "predicted": {}}))
    pidfile = tmp_path / "agent.pid"
    code = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)"
    cli = "import sys; from kvcomm.cli import main; sys.exit(main())"
    launcher = subprocess.Popen([sys.executable, "-c", cli, "placement", "launch", "--plan",
                                 str(plan), "--dir", str(tmp_path), "--", sys.executable, "-c", code,
                                 str(pidfile)], start_new_session=True)
    try:
        wait_for(lambda: pidfile.exists() and pidfile.read_text(), 30, "the agent to start")
        agent = int(pidfile.read_text())
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(30)

        def gone() -> bool:
            try:
                with open(f"/proc/{agent}/stat", "rb") as f:
                    return f.read().rsplit(b")", 1)[1][1:2] == b"Z"
            except OSError:
                return True

        try:
            wait_for(gone, 15, "the agent to stop with its launcher")
        finally:
            if not gone():
                os.kill(agent, signal.SIGKILL)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_an_agent_that_only_writes_at_a_modest_rate_is_reported(ns: str) -> None:
    """F: an agent that only writes looked at the clock every REPORT_PUTS (1024) puts: a
    sensor writing 20 times a second first reported after 51 s and then every 51 s. Until
    then `observe` saw it only as the writer of what others read (host null, load 0): the
    plan gives it a host as if it ran nowhere, the launcher starts a second copy of it,
    and its load is missing from the balance. At ~100 puts/s it must report within a few
    seconds."""
    import time

    cfg = _cfg(hot_key_sample=16)
    table = report.agents_dir(ns, cfg.cache.l2_dir)
    with kvcomm.open(ns, config=cfg, agent="sensor") as w:
        deadline = time.monotonic() + 8.0  # (at most ~800 puts: under REPORT_PUTS)
        puts = 0
        while time.monotonic() < deadline:
            w.put("sensor/state", puts)
            puts += 1
            if {r["agent"] for r in report.read_reports(table, clean=False)} == {"sensor"}:
                break
            time.sleep(0.01)
        assert {r["agent"] for r in report.read_reports(table, clean=False)} == {"sensor"}, \
            f"no report after {puts} puts"


def test_planning_work_outside_the_partitioner_grows_linearly(monkeypatch: pytest.MonkeyPatch) -> None:
    """F: the guided re-placement tried each pending community with a full balance check
    (every movable agent's host looked at) per trial: trials grow with the communities
    and each costs O(agents), so that work grew quadratically (1000 agents on a ring:
    383k agent checks, 2000: 1.57M, 4000: 5.1M), on the way to the issue's 100k agents.
    Counted here as agents looked at by balance checks, not as time."""
    from kvcomm.placement import plan as P

    n = 2000
    agents = [{"id": f"d{i}", "host": f"h{i % 3 + 1}", "load": 1.0 + (i * 7919 % 100) / 100}
              for i in range(n)]
    edges = [{"reader": f"d{i}", "writer": f"d{(i + j) % n}", "reads_per_s": 1.0, "bytes_per_s": 1.0}
             for i in range(n) for j in (1, 2)]
    g = Graph.from_json({"agents": agents, "edges": edges})
    looked = [0]
    real = P._Problem.balanced

    def balanced(self: Any, s: Any) -> bool:
        looked[0] += len(self.movable)
        return bool(real(self, s))

    monkeypatch.setattr(P._Problem, "balanced", balanced)
    plan = P.make_plan(g, ["h1", "h2", "h3"])
    assert plan.share is not None and plan.share > 0.9
    assert looked[0] <= 20 * n, f"{looked[0]} agents looked at by balance checks for {n} agents"


def test_the_partitioner_never_runs_on_more_than_a_few_thousand_nodes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """F: networkx's Louvain grows faster than quadratically on the sparse graphs agents
    make (a ring of drones: 1,000 agents 0.5 s of CPU, 2,000 2.0 s, 4,000 10.8 s, 6,000
    41 s): a plan for the issue's 100k agents would take hours. Louvain should only ever
    see a coarsened graph of a bounded size (counted here as the nodes it is given)."""
    import networkx as nx

    from kvcomm.placement import plan as P

    n = 6000
    agents = [{"id": f"d{i}", "host": f"h{i % 3 + 1}", "load": 1.0 + (i * 7919 % 100) / 100}
              for i in range(n)]
    edges = [{"reader": f"d{i}", "writer": f"d{(i + j) % n}", "reads_per_s": 1.0, "bytes_per_s": 1.0}
             for i in range(n) for j in (1, 2)]
    g = Graph.from_json({"agents": agents, "edges": edges})
    sizes: list[int] = []
    real = nx.community.louvain_communities

    def louvain(h: Any, *a: Any, **kw: Any) -> Any:
        sizes.append(h.number_of_nodes())
        if h.number_of_nodes() > 2000:
            raise AssertionError(f"Louvain given {h.number_of_nodes()} nodes")
        return real(h, *a, **kw)

    monkeypatch.setattr(nx.community, "louvain_communities", louvain)
    plan = P.make_plan(g, ["h1", "h2", "h3"])
    assert sizes and max(sizes) <= 2000
    assert plan.share is not None and plan.share > 0.95  # (the ring still cut in 3 places or so)


def test_a_report_after_close_does_not_bring_the_file_back(ns: str) -> None:
    """F: Client.close() removed the agent's report without the observer's lock, and
    AgentStats.report() after close() wrote it again: a thread whose read flushed while
    another thread closed the client (it passed the closed check just before) left a
    report of a closed client in the table for as long as the process lived, published
    as a live agent. A closed observer writes nothing, and close waits for a report in
    progress."""
    cfg = _cfg(hot_key_sample=1)
    table = report.agents_dir(ns, cfg.cache.l2_dir)
    with kvcomm.open(ns, config=cfg, agent="r") as kv:
        obs = kv._observer
        assert obs is not None
        assert obs.report(5)
        assert len(report.read_reports(table, clean=False)) == 1
    assert report.read_reports(table, clean=False) == []
    obs._next = 0.0
    obs.report(6)  # (the late flush of another thread)
    assert report.read_reports(table, clean=False) == []


def test_a_failing_writer_lookup_never_raises_into_a_read(ns: str) -> None:
    """F: the flush of sampled reads runs inside a kv.get (an L1 hit, even), and
    AgentStats.sampled let Core.writers' SegmentError (a segment found corrupt, which the
    read path itself repairs) out of that get: observing must never fail a read. The
    flush's samples are counted as unknown instead."""
    cfg = _cfg(hot_key_sample=1)
    with kvcomm.open(ns, config=cfg, agent="r") as r:
        obs = r._observer
        assert obs is not None

        def broken(pairs: list[tuple[bytes, int]]) -> list[tuple[bytes, int] | None]:
            raise kvcomm.SegmentError("the segment is corrupt (simulated)")

        obs.sampled({"k": 3}, {}, lambda k: (k.encode(), 0), broken)
        assert obs.unknown == 3


def test_a_deeply_nested_graph_file_is_refused(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """F: load_json caught OSError and ValueError, but json raises RecursionError on a
    deeply nested document ("[" * 200000): `kvcomm placement plan` (and launch, for a
    plan) died with a traceback instead of exit status 2 saying the file is not a graph."""
    gfile = tmp_path / "g.json"
    gfile.write_text("[" * 200_000 + "]" * 200_000)
    assert cli_main(["placement", "plan", "--graph", str(gfile), "--hosts", "h1",
                     "--out", str(tmp_path / "p.json")]) == 2
    assert "g.json" in capsys.readouterr().err


def test_writing_the_output_never_follows_a_planted_temporary_name(tmp_path: Path) -> None:
    """F: write_json wrote to OUT.tmp with open("w"), which follows a symlink: anyone who
    can create OUT.tmp beside the output (a shared directory such as /tmp) makes
    `kvcomm placement observe/plan --out` overwrite the file it points to with JSON."""
    from kvcomm.placement.graph import write_json

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "graph.json"
    os.symlink(victim, str(out) + ".tmp")
    write_json(out, {"agents": [], "edges": []})
    assert victim.read_text() == "precious"
    assert json.loads(out.read_text()) == {"agents": [], "edges": []}


KILLED_AGENT = """
import sys, kvcomm
cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": "16MB", "watch_buffer": 4096,
                                            "hot_key_sample": 1}})
kv = kvcomm.open(sys.argv[1], config=cfg, agent="doomed")
kv.put("other", b"x")  # (its own key: reads of it are no edge, but they flush and report)
while True:
    kv.get("other")
    kv._observer._next = 0.0  # (a report at every flush)
"""


def test_an_agent_killed_mid_report_leaves_a_table_that_cleans_up(ns: str, tmp_path: Path) -> None:
    """(held) An agent SIGKILLed while it reports at every flush (the kill may or may not
    land inside a report: not asserted) leaves whole reports only (and perhaps a
    temporary file), and the daemon's cleaning removes everything once it is gone."""
    import signal
    import subprocess
    import time

    cfg = _cfg()
    table = report.agents_dir(ns, cfg.cache.l2_dir)
    with kvcomm.open(ns, config=cfg):  # (the namespace, created here and purged by the fixture)
        script = tmp_path / "agent.py"
        script.write_text(KILLED_AGENT)
        proc = subprocess.Popen([sys.executable, str(script), ns])
        try:
            wait_for(lambda: any(r["agent"] == "doomed" for r in report.read_reports(table, clean=False)),
                     30, "the agent to report")
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        got = report.read_reports(table, clean=False)
        assert [r["agent"] for r in got] == ["doomed"]  # (whole, whatever the kill cut)
        later = time.time() + report.TMP_AFTER + 5
        assert report.read_reports(table, now=later) == []
        assert os.listdir(table) == []


def test_observe_with_l3_unreachable_exits_2_saying_so(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """(held) `kvcomm placement observe` against a Redis Cluster that cannot be reached
    exits with status 2 and says which address, and writes no graph."""
    import socket

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f'cluster:\n  redis: ["127.0.0.1:{port}"]\n  timeout: 0.5\n')
    out = tmp_path / "g.json"
    assert cli_main(["placement", "observe", "--config", str(cfg), "--seconds", "0",
                     "--out", str(out)]) == 2
    assert f"127.0.0.1', {port}" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("agent", [123, "x" * 3000, ["drone-1"], "drone 1", None, b"drone-1"])
def test_a_hostile_writer_id_in_a_record_is_an_unknown_writer(ns: str, agent: Any) -> None:
    """(held) A record whose extension field names its writer with something that is not
    an agent id (as another host's record could, through L3) is counted as a read of an
    unknown writer: no edge, no error in the reader."""
    cfg = _cfg(hot_key_sample=1)
    with kvcomm.open(ns, config=cfg, agent="w") as w, kvcomm.open(ns, config=cfg, agent="r") as r:
        w._ext = msgpack.packb({"a": agent, "x": 1}, use_bin_type=True)
        w.put("k", b"v")
        for _ in range(50):
            assert r.get("k") == b"v"
        r.hot_keys(1)
        obs = r._observer
        assert obs is not None and obs.edges == {} and obs.unknown >= 1


def test_refinement_stops_when_its_rounds_gain_crumbs(monkeypatch: pytest.MonkeyPatch) -> None:
    """F: refinement ran passes of O(agents x hosts) "until none helps" (up to 1000
    rounds): on a graph without communities (random reads) every round finds a few
    crumbs, so 10,000 agents took 324 passes and 77 s of CPU, on the way to the issue's
    100k. Rounds worth less than a small share of all reads should end it (counted here
    as passes, not time). Seed 1."""
    import random

    from kvcomm.placement import plan as P

    n, rng = 3000, random.Random(1)
    agents = [{"id": f"d{i}", "host": f"h{i % 3 + 1}", "load": rng.random()} for i in range(n)]
    pairs: set[tuple[int, int]] = set()
    while len(pairs) < 5 * n:
        a, b = rng.randrange(n), rng.randrange(n)
        if a != b:
            pairs.add((a, b))
    edges = [{"reader": f"d{a}", "writer": f"d{b}", "reads_per_s": rng.random(), "bytes_per_s": 1.0}
             for a, b in sorted(pairs)]
    g = Graph.from_json({"agents": agents, "edges": edges})
    passes = [0]
    real = P._Problem._moves_pass

    def counted(self: Any, s: Any, budget: float) -> bool:
        passes[0] += 1
        return bool(real(self, s, budget))

    monkeypatch.setattr(P._Problem, "_moves_pass", counted)
    plan = P.make_plan(g, ["h1", "h2", "h3"])
    assert plan.share is not None and plan.before is not None and plan.share > plan.before + 0.2
    assert passes[0] <= 60, f"{passes[0]} refinement passes"
