"""Affinity placement on one host: agent ids on writes, sampled edges, the per-host table,
the graph and plan contracts, the CLI, and the launcher. (Planning on random graphs:
test_placement_plan.py; end to end on a dev cluster: test_placement_cluster.py.)"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest

import kvcomm
from kvcomm.cli import main as cli_main
from kvcomm.placement import report
from kvcomm.placement.agents import agent_of, is_named, with_agent
from kvcomm.placement.graph import Agent, Edge, Graph, Plan, load_graph
from kvcomm.placement.launcher import Launcher, imbalance, replan
from kvcomm.placement.observe import _decode_snapshot, graph_from, host_snapshot, observe
from kvcomm.placement.plan import make_plan
from kvcomm.tiers import l2
from tests.support.helpers import SMALL, drawn_seed, wait_for


def _cfg(**cache: Any) -> kvcomm.Config:
    return kvcomm.Config.from_mapping({"cache": {**SMALL["cache"], **cache}})


def _ext(kv: kvcomm.Client, key: str) -> bytes:
    kb = key.encode()
    v = kv._seg.version(kb, l2.key_hash(kb))
    assert v is not None
    return v[7]


# ---------------------------------------------------------------- agent ids on writes


@pytest.mark.parametrize("bad", ["", "a" * 65, "drone 7", "drone/7", "7@host-1", "é", 7, b"d"])
def test_a_bad_agent_name_is_refused_before_anything_opens(ns: str, bad: Any) -> None:
    with pytest.raises(kvcomm.InvalidArgument, match="agent must be"):
        kvcomm.open(ns, config=_cfg(), agent=bad)
    assert not os.path.exists(l2.segment_path(ns))  # nothing was opened


def test_every_local_write_carries_its_writer(ns: str) -> None:
    cfg = _cfg()
    with kvcomm.open(ns, config=cfg, agent="drone-7") as kv, kvcomm.open(ns, config=cfg) as anon:
        assert kv.agent == "drone-7" and kv.agent_named
        assert anon.agent == f"{os.getpid()}@local" and not anon.agent_named
        assert not is_named(anon.agent)
        kv.put("a", b"raw")
        kv.put("b", {"x": 1})
        with kv.batch() as b:
            b.put("c", b"y")
            b.put("d", [1, 2])
            b.delete("never")
        # the agent's ext and the batch's compact results together: versions still right
        assert b.versions[:2] == [kv.get_item("c").version, kv.get_item("d").version]  # type: ignore[union-attr]
        assert b.versions[2] is False
        kv.put("e", 1, expect=kvcomm.ABSENT)
        kv.update("f", lambda n: n + 1, default=0)
        kv.register_validator("v/", lambda key, old, new: None)
        kv.put("v/1", 1)
        anon.put("g", 2)
        for key in "abcdef":
            assert agent_of(_ext(kv, key)) == "drone-7", key
        assert agent_of(_ext(kv, "v/1")) == "drone-7"
        assert agent_of(_ext(kv, "g")) == anon.agent
        kv.delete("a")  # (a tombstone is nobody's state to read)


def test_the_extension_map_keeps_keys_it_does_not_know() -> None:
    other = msgpack.packb({"ttl": 30, "a": "old"})
    ext = with_agent(other, "drone-8")
    assert msgpack.unpackb(ext) == {"ttl": 30, "a": "drone-8"}
    assert agent_of(ext) == "drone-8"
    for junk in (b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"a": 7}),
                 msgpack.packb({"a": "no spaces allowed"}), b"\x81" * 5000):
        assert agent_of(junk) is None
    assert msgpack.unpackb(with_agent(b"\xc1", "x")) == {"a": "x"}  # not a map: replaced


def test_writers_reads_the_extension_and_value_size_of_many_keys(kv: kvcomm.Client) -> None:
    kv.put("k1", b"x" * 100)
    kv.put("k2", b"y")
    kv.put("gone", b"z")
    kv.delete("gone")
    pairs = [(k, l2.key_hash(k)) for k in (b"k1", b"k2", b"gone", b"absent")]
    got = kv._seg._core.writers(pairs)
    assert got[0] == (kv._ext, 100) and got[1] == (kv._ext, 1)
    assert got[2] is None and got[3] is None
    with pytest.raises(TypeError):
        kv._seg._core.writers([(b"k1",)])


# ---------------------------------------------------------------- sampling into edges


def _seeded(kv: kvcomm.Client) -> int:
    seed = drawn_seed(1, 1 << 63)
    print("sampling seed", seed)
    kv._getter.rng = seed
    return seed


def test_sampled_reads_become_edges_towards_their_writers(ns: str) -> None:
    cfg = _cfg(hot_key_sample=4)
    with kvcomm.open(ns, config=cfg, agent="w1") as w1, \
            kvcomm.open(ns, config=cfg, agent="w2") as w2, \
            kvcomm.open(ns, config=cfg, agent="reader") as r:
        _seeded(r)
        w1.put("w1/state", b"a" * 100)
        w2.put("w2/state", b"b" * 10)
        r.put("reader/state", b"mine")
        r.merge_remote("foreign", b"no writer id", kvcomm.Version((("elsewhere", 1),), 1))
        for _ in range(3000):
            r.get("w1/state")
            r.get("reader/state")  # its own key: no edge
        for _ in range(1000):
            r.get("w2/state")
            r.get("foreign")  # a record without a writer id: counted as unknown
        r._flush_hot()
        obs = r._observer
        assert obs is not None
        assert set(obs.edges) == {"w1", "w2"}
        reads1, bytes1 = obs.edges["w1"]
        reads2, bytes2 = obs.edges["w2"]
        assert 2400 <= reads1 <= 3600 and bytes1 == reads1 * 100  # sampling error: ±20%
        assert 800 <= reads2 <= 1200 and bytes2 == reads2 * 10
        assert 800 <= obs.unknown <= 1200


def test_flushes_and_reports_from_many_threads_keep_the_edges(
        ns: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads of one agent flush and report at once (the getter's buffer fills from all of
    them): the edges are counted under the observer's lock, a report packs them whole, and
    nothing is lost or raised."""
    import threading

    monkeypatch.setattr(report, "REPORT_EVERY", 0.0)  # a report at every flush
    cfg = _cfg(hot_key_sample=1)
    with kvcomm.open(ns, config=cfg, agent="w") as w, \
            kvcomm.open(ns, config=cfg, agent="r") as r:
        seed = 20261130
        print("getter seed", seed)
        r._getter.rng = seed
        for i in range(300):
            w.put(f"t/{i}", i)
        errors: list[BaseException] = []

        def reader(offset: int) -> None:
            try:
                for _ in range(30):
                    for i in range(300):
                        r.get(f"t/{(i + offset) % 300}")
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # switch threads as often as CPython can
        try:
            threads = [threading.Thread(target=reader, args=(k * 37,)) for k in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            sys.setswitchinterval(old)
        r._flush_hot()
        obs = r._observer
        assert obs is not None
        assert errors == [] and obs.errors == 0 and obs.reports > 1
        reads = obs.edges["w"][0]
        assert 0.8 * 72_000 <= reads <= 1.2 * 72_000, reads  # (16 keys a flush, scaled)


def test_a_flush_of_many_keys_attributes_a_bounded_sample_without_bias(ns: str) -> None:
    cfg = _cfg(hot_key_sample=1)
    n = 40 * report.MAX_KEYS_PER_FLUSH
    with kvcomm.open(ns, config=cfg, agent="w") as w, kvcomm.open(ns, config=cfg, agent="r") as r:
        for i in range(n):
            w.put(f"k/{i}", b"v")
        looked: list[int] = []
        writers = r._seg._core.writers

        def counting(pairs: list[tuple[bytes, int]]) -> Any:
            looked.append(len(pairs))
            return writers(pairs)

        obs = r._observer
        assert obs is not None
        counts = {f"k/{i}": 1 for i in range(n)}
        for _ in range(20):
            obs.sampled(counts, r._keys, r._key_hash, counting)
        assert max(looked) <= report.MAX_KEYS_PER_FLUSH  # bounded work per flush
        assert obs.edges["w"][0] == pytest.approx(20 * n, rel=1e-9)  # scaled back up


def test_writer_bound_counts_the_rest_as_dropped(ns: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(report, "MAX_WRITERS", 3)
    cfg = _cfg(hot_key_sample=1)
    with kvcomm.open(ns, config=cfg, agent="r") as r:
        writers = [kvcomm.open(ns, config=cfg, agent=f"w{i}") for i in range(5)]
        try:
            for i, w in enumerate(writers):
                w.put(f"k/{i}", b"v")
            obs = r._observer
            assert obs is not None
            obs.sampled({f"k/{i}": 10 for i in range(5)}, r._keys, r._key_hash,
                        r._seg._core.writers)
            assert len(obs.edges) == 3 and obs.dropped == 20
        finally:
            for w in writers:
                w.close()


# ---------------------------------------------------------------- the host's table


def test_an_agent_reports_to_the_hosts_table_and_removes_its_report_at_close(ns: str) -> None:
    cfg = _cfg(hot_key_sample=2)
    table = report.agents_dir(ns, cfg.cache.l2_dir)
    with kvcomm.open(ns, config=cfg, agent="w") as w, kvcomm.open(ns, config=cfg, agent="r") as r:
        w.put("w/state", b"x" * 8)
        for _ in range(500):
            r.get("w/state")
        r.hot_keys(1)  # a flush: sampled reads attributed, the first report due
        reports = {rep["agent"]: rep for rep in report.read_reports(table)}
        assert set(reports) == {"r"}  # w has not flushed (nor reached REPORT_PUTS puts)
        rep = reports["r"]
        assert rep["host"] == "local" and rep["pid"] == os.getpid() and rep["ops"] == 500
        assert set(rep["edges"]) == {"w"} and 350 <= rep["edges"]["w"][0] <= 650
        assert oct(os.stat(table).st_mode & 0o777) == oct(0o700)
        assert oct(os.stat(os.path.join(table, rep["id"])).st_mode & 0o777) == oct(0o600)
        for _ in range(report.REPORT_PUTS):  # an agent that only writes reports too
            w.put("w/state", b"y")
        assert {rep["agent"] for rep in report.read_reports(table)} == {"r", "w"}
    assert report.read_reports(table) == []  # closed: their reports went with them
    l2.purge(ns)
    assert not os.path.exists(table)  # the table goes with the namespace


def test_reports_of_dead_processes_and_junk_are_cleaned(ns: str, tmp_path: Path) -> None:
    table = str(tmp_path / "table")
    report.ensure_dir(table, 0o600)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    base = {"f": 1, "agent": "a", "host": "h", "since": 1.0, "t": 2.0, "ops": 3, "edges": {},
            "dropped": 0, "unknown": 0}
    files = {"live": {**base, "pid": os.getpid()}, "dead": {**base, "pid": dead_pid},
             "fresh-dead": {**base, "pid": dead_pid}}
    for name, rep in files.items():
        Path(table, name).write_bytes(msgpack.packb(rep))
    Path(table, "junk").write_bytes(b"not msgpack")
    Path(table, "wrong").write_bytes(msgpack.packb({**base, "pid": 1, "edges": {"no spaces": [1, 2]}}))
    Path(table, ".x.tmp").write_bytes(b"")
    old = time.time() - report.TMP_AFTER - 5
    for name in ("dead", "junk", "wrong", ".x.tmp", "live"):
        os.utime(Path(table, name), (old, old))
    got = report.read_reports(table)
    assert sorted(r["id"] for r in got) == ["fresh-dead", "live"]  # (fresh: published once more)
    assert sorted(os.listdir(table)) == ["fresh-dead", "live"]
    report.ensure_dir(table, 0o600)  # (an existing directory of ours is fine)
    os.chmod(table, 0o777)
    with pytest.raises(kvcomm.SegmentError, match="remove it"):
        report.ensure_dir(table, 0o600)


def test_an_agent_that_cannot_report_warns_once_and_goes_on(tmp_path: Path, ns: str) -> None:
    blocker = tmp_path / "shm"
    blocker.mkdir()
    cfg = kvcomm.Config.from_mapping({"cache": {**SMALL["cache"], "l2_dir": str(blocker),
                                                "hot_key_sample": 1}})
    Path(report.agents_dir(ns, str(blocker))).write_text("a file where the table should be")
    with kvcomm.open(ns, config=cfg, agent="r") as r:
        r.put("k", 1)
        with pytest.warns(kvcomm.KVCommWarning, match="cannot report"):
            r.hot_keys(1)
        assert r.get("k") == 1
        obs = r._observer
        assert obs is not None and obs.errors == 1
    l2.purge(ns, str(blocker))


# ---------------------------------------------------------------- rates: graph_from


def _rep(agent: str, host: str, rid: str, since: float, t: float, ops: int,
         edges: dict[str, list[int]] | None = None) -> dict[str, Any]:
    return {"f": 1, "agent": agent, "host": host, "pid": 1, "since": since, "t": t, "ops": ops,
            "edges": edges or {}, "dropped": 0, "unknown": 0, "id": rid}


def _snap(host: str, *reports: dict[str, Any]) -> dict[str, Any]:
    return {"f": 1, "host": host, "t": 0.0, "reports": list(reports)}


def test_rates_come_from_each_agents_own_reports() -> None:
    before = [_snap("h1", _rep("a", "h1", "a.1", 0.0, 10.0, 100, {"b": [50, 500]})),
              _snap("h2", _rep("b", "h2", "b.1", 0.0, 10.0, 40))]
    after = [_snap("h1", _rep("a", "h1", "a.1", 0.0, 12.0, 300, {"b": [150, 1500], "9@h3": [20, 20]})),
             _snap("h2", _rep("b", "h2", "b.1", 0.0, 10.0, 40),  # no new report: idle
                   _rep("c", "h2", "c.1", 11.0, 13.0, 20, {"a": [4, 8]}),  # started since
                   _rep("c", "h1", "c.2", 12.0, 13.0, 100))]  # the same name, elsewhere too
    g = graph_from(before, after)
    agents = {a.id: a for a in g.agents}
    assert (agents["a"].host, agents["a"].load) == ("h1", 100.0)
    assert agents["b"].load == 0.0
    assert (agents["c"].host, agents["c"].load) == ("h1", 110.0)  # where it does the most
    assert (agents["9@h3"].host, agents["9@h3"].load) == ("h3", 0.0)  # only a writer
    edges = {(e.reader, e.writer): (e.reads_per_s, e.bytes_per_s) for e in g.edges}
    assert edges == {("a", "b"): (50.0, 500.0), ("a", "9@h3"): (10.0, 10.0), ("c", "a"): (2.0, 4.0)}
    assert Graph.from_json(json.loads(json.dumps(g.to_json()))) == g  # the contract holds
    since_start = graph_from([], after)
    assert {a.id: a.load for a in since_start.agents}["a"] == 25.0


def test_observe_in_embedded_mode_reads_the_hosts_table(ns: str) -> None:
    cfg = _cfg(hot_key_sample=2)
    with kvcomm.open(ns, config=cfg, agent="w") as w, kvcomm.open(ns, config=cfg, agent="r") as r:
        w.put("w/state", b"x" * 10)
        for _ in range(2000):
            r.get("w/state")
        r.hot_keys(1)
        g = observe(cfg, 0, namespace=ns)
        assert [a.id for a in g.agents] == ["r", "w"]
        assert [(e.reader, e.writer) for e in g.edges] == [("r", "w")]
        assert g.agents[0].host == "local" and g.agents[1].host is None  # w never reported
        assert g.share(g.hosts()) == 0.0
    with pytest.raises(kvcomm.InvalidArgument):
        observe(cfg, -1)


# ---------------------------------------------------------------- the contracts


GOOD = {"agents": [{"id": "d1", "host": "h1", "load": 1.5}, {"id": "12@h2", "host": "h2", "load": 0},
                   {"id": "d3", "host": None, "load": 2}],
        "edges": [{"reader": "d1", "writer": "12@h2", "reads_per_s": 3.0, "bytes_per_s": 30.0},
                  {"reader": "d3", "writer": "d1", "reads_per_s": 1, "bytes_per_s": 0}]}


def _bad(mutate: Any) -> dict[str, Any]:
    doc = json.loads(json.dumps(GOOD))
    mutate(doc)
    return doc


@pytest.mark.parametrize("doc,match", [
    ([], "a graph is a JSON object"),
    ({"agents": {}}, "agents must be a list"),
    (_bad(lambda d: d.pop("edges")), "edges must be a list"),
    (_bad(lambda d: d["agents"][0].update(id="bad id")), r"agents\[0\].id"),
    (_bad(lambda d: d["agents"][1].update(id="d1")), "appears twice"),
    (_bad(lambda d: d["agents"][0].pop("host")), r"agents\[0\].host is missing"),
    (_bad(lambda d: d["agents"][0].update(host="h 1")), r"agents\[0\].host"),
    (_bad(lambda d: d["agents"][0].update(load=-1)), r"agents\[0\].load"),
    (_bad(lambda d: d["agents"][0].update(load=float("nan"))), r"agents\[0\].load"),
    (_bad(lambda d: d["agents"][0].update(load=True)), r"agents\[0\].load"),
    (_bad(lambda d: d["edges"][0].update(writer="nobody")), r"edges\[0\].writer"),
    (_bad(lambda d: d["edges"][0].update(writer="d1")), "its own keys"),
    (_bad(lambda d: d["edges"].append(dict(d["edges"][0]))), "second edge"),
    (_bad(lambda d: d["edges"][1].update(reads_per_s="1")), r"edges\[1\].reads_per_s"),
    (_bad(lambda d: d["edges"][1].pop("bytes_per_s")), r"edges\[1\].bytes_per_s"),
])
def test_the_graph_contract_is_checked(doc: Any, match: str) -> None:
    with pytest.raises(kvcomm.InvalidArgument, match=match):
        Graph.from_json(doc)


def test_the_graph_contract_round_trips_and_ignores_unknown_keys() -> None:
    g = Graph.from_json({**GOOD, "comment": "ignored"})
    assert g.to_json() == {"agents": [{**a, "load": float(a["load"])} for a in GOOD["agents"]],
                           "edges": [{**e, "reads_per_s": float(e["reads_per_s"]),
                                      "bytes_per_s": float(e["bytes_per_s"])} for e in GOOD["edges"]]}
    assert g.share({"d1": "h", "12@h2": "h", "d3": "x"}) == pytest.approx(0.75)
    assert g.share(g.hosts()) == 0.0


@pytest.mark.parametrize("doc,match", [
    ({"moves": []}, "assignment"),
    ({"assignment": {"a b": "h"}, "moves": [], "predicted": {}}, "not an agent id"),
    ({"assignment": {"a": "h h"}, "moves": [], "predicted": {}}, "assignment"),
    ({"assignment": {"a": "h"}, "moves": [{"agent": "b", "from": "x", "to": "h"}],
      "predicted": {}}, r"moves\[0\]"),
    ({"assignment": {"a": "h"}, "moves": [{"agent": "a", "from": "x", "to": "y"}],
      "predicted": {}}, r"moves\[0\].to"),
    ({"assignment": {"a": "h"}, "moves": []}, "predicted"),
    ({"assignment": {"a": "h"}, "moves": [], "predicted": {"before": 1.5}}, "share"),
])
def test_the_plan_contract_is_checked(doc: Any, match: str) -> None:
    with pytest.raises(kvcomm.InvalidArgument, match=match):
        Plan.from_json(doc)


# ---------------------------------------------------------------- the command line


def test_observe_and_plan_from_the_command_line(ns: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    cfg_file = tmp_path / "host.yaml"
    cfg_file.write_text(f"node:\n  namespace: {ns}\ncache:\n  l2_size: 16MB\n  hot_key_sample: 2\n")
    cfg = kvcomm.Config.load(str(cfg_file))
    graph_file, plan_file = tmp_path / "graph.json", tmp_path / "plan.json"
    with kvcomm.open(config=cfg, agent="a") as a, kvcomm.open(config=cfg, agent="b") as b:
        a.put("a/state", b"x")
        b.put("b/state", b"y")
        for _ in range(500):
            a.get("b/state")
            b.get("a/state")
        a.hot_keys(1)
        b.hot_keys(1)
        assert cli_main(["placement", "observe", "--config", str(cfg_file), "--seconds", "0",
                         "--out", str(graph_file)]) == 0
        out = capsys.readouterr().out
        assert "2 agents, 2 edges" in out and "same-host share now 100.0%" in out
    g = load_graph(graph_file)
    assert {(e.reader, e.writer) for e in g.edges} == {("a", "b"), ("b", "a")}
    # a graph with a host apart: the plan brings the two agents together
    doc = g.to_json()
    doc["agents"][1]["host"] = "other"
    graph_file.write_text(json.dumps(doc))
    assert cli_main(["placement", "plan", "--graph", str(graph_file), "--hosts", "local,other",
                     "--balance", "2", "--out", str(plan_file)]) == 0
    out = capsys.readouterr().out
    assert "before 0.0%, planned 100.0%; 1 moves" in out
    plan = Plan.from_json(json.loads(plan_file.read_text()))
    assert len(set(plan.assignment.values())) == 1 and plan.share == 1.0 and plan.before == 0.0
    # errors: exit status 2 and a message that says what to do
    assert cli_main(["placement", "plan", "--graph", str(graph_file), "--hosts", "local",
                     "--balance", "0.5", "--out", str(plan_file)]) == 2
    assert "--balance must be a number >= 1" in capsys.readouterr().err
    assert cli_main(["placement", "plan", "--graph", str(tmp_path / "none.json"), "--hosts", "h",
                     "--out", str(plan_file)]) == 2
    assert "cannot read the graph" in capsys.readouterr().err
    graph_file.write_text("{")
    assert cli_main(["placement", "plan", "--graph", str(graph_file), "--hosts", "h",
                     "--out", str(plan_file)]) == 2
    assert "is not JSON" in capsys.readouterr().err


# ---------------------------------------------------------------- the launcher


AGENT = """
import json, os, sys, time
with open(sys.argv[1], "a") as f:
    f.write(json.dumps([os.environ["KVCOMM_AGENT"], os.environ["KVCOMM_HOST"],
                        os.environ["KVCOMM_CONFIG"], sys.argv[2:]]) + "\\n")
time.sleep(float(os.environ.get("STAY", "60")))
"""


def test_the_launcher_starts_agents_where_the_plan_says_and_moves_only_what_moved(
        tmp_path: Path) -> None:
    script, log = tmp_path / "agent.py", tmp_path / "started.jsonl"
    script.write_text(AGENT)
    launcher = Launcher({"h1": "/c/h1.yaml", "h2": "/c/h2.yaml"}, stop_timeout=5)
    cmd = [sys.executable, str(script), str(log), "--agent", "{agent}", "--config", "{config}"]
    plan = Plan({"a": "h1", "b": "h2", "3@h1": "h1"}, (), None, None)
    try:
        assert launcher.apply(plan, cmd) == ["a", "b"]  # (an unnamed agent is not started)

        def started() -> list[list[Any]]:
            return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

        wait_for(lambda: len(started()) == 2, 20, "two agents to start")
        assert sorted(started()) == [["a", "h1", "/c/h1.yaml", ["--agent", "a", "--config", "/c/h1.yaml"]],
                                     ["b", "h2", "/c/h2.yaml", ["--agent", "b", "--config", "/c/h2.yaml"]]]
        pid_b = launcher.running["b"][1].pid
        assert launcher.apply(Plan({"a": "h2", "b": "h2"}, (), None, None), cmd) == ["a"]
        wait_for(lambda: len(started()) == 3, 20, "the moved agent to start again")
        assert started()[-1][:2] == ["a", "h2"] and launcher.running["b"][1].pid == pid_b
        assert launcher.per_host() == {"h1": 0, "h2": 2}
        with pytest.raises(kvcomm.InvalidArgument, match="not hosts of this cluster"):
            launcher.apply(Plan({"a": "h9"}, (), None, None), cmd)
        assert launcher.per_host() == {"h1": 0, "h2": 2}  # nothing stopped
    finally:
        launcher.stop_all()
    assert launcher.running == {}


def test_launch_waits_for_its_agents_and_returns_the_first_failure(tmp_path: Path) -> None:
    launcher = Launcher({"h1": "/c/h1.yaml"})
    launcher.start("ok", "h1", [sys.executable, "-c", "pass"])
    launcher.start("bad", "h1", [sys.executable, "-c", "raise SystemExit(3)"])
    assert launcher.wait() == 3 and launcher.exited == {"ok": 0, "bad": 3}


# ---------------------------------------------------------------- re-placing as the agents run


def _pairs_graph(hosts: dict[str, str | None]) -> Graph:
    """a and b read each other, c and d read each other; every agent's load is 1."""
    return Graph(tuple(Agent(a, hosts.get(a), 1.0) for a in "abcd"),
                 tuple(Edge(r, w, 10.0, 1000.0)
                       for r, w in (("a", "b"), ("b", "a"), ("c", "d"), ("d", "c"))))


def test_replan_plans_from_where_the_agents_run_not_the_graphs_hosts() -> None:
    # the graph says each pair already shares a host (where each did most of its
    # operations); the launcher knows they run apart: the plan must start from that
    stale = _pairs_graph({"a": "h1", "b": "h1", "c": "h2", "d": "h2"})
    current = {"a": "h1", "b": "h2", "c": "h1", "d": "h2"}
    plan = replan(stale, current, ["h1", "h2"], max_moves=2, balance=1.0)
    assert plan.before == 0.0 and plan.share == 1.0 and len(plan.moves) == 2
    assert {m.source for m in plan.moves} == {"h1", "h2"}  # (a swap: balance 1.0)
    assert replan(stale, current, ["h1", "h2"], max_moves=0, balance=1.0).moves == ()
    assert replan(stale, {}, ["h1", "h2"], max_moves=2, balance=1.0).before == 1.0


def test_replan_never_stops_at_a_placement_slightly_out_of_balance() -> None:
    # measured loads vary: here h1 carries 2.3 against h2's 2.0, 1.07x the mean; no plan
    # meets --balance 1.0 from there, and make_plan refuses; replan plans within 1.07x
    g = _pairs_graph({})
    g = Graph(tuple(Agent(a.id, None, 1.3 if a.id == "a" else 1.0) for a in g.agents), g.edges)
    current = {"a": "h1", "b": "h2", "c": "h1", "d": "h2"}
    placed = Graph(tuple(Agent(a.id, current[a.id], a.load) for a in g.agents), g.edges)
    with pytest.raises(kvcomm.InvalidArgument):
        make_plan(placed, ["h1", "h2"], balance=1.0, max_moves=2)
    before = imbalance(placed.agents, ["h1", "h2"])
    assert before == pytest.approx(2.3 / 2.15)
    plan = replan(g, current, ["h1", "h2"], max_moves=2, balance=1.0)
    after = Graph(tuple(Agent(a.id, plan.assignment[a.id], a.load) for a in g.agents), g.edges)
    assert plan.share == 1.0 and imbalance(after.agents, ["h1", "h2"]) <= before + 1e-9
    assert imbalance((), ["h1"]) == 1.0


def test_the_replan_loop_moves_what_each_round_plans_until_the_agents_end(
        tmp_path: Path) -> None:
    script, log = tmp_path / "agent.py", tmp_path / "started.jsonl"
    script.write_text(AGENT)
    launcher = Launcher({"h1": "/c/h1.yaml", "h2": "/c/h2.yaml"}, stop_timeout=5)
    cmd = [sys.executable, str(script), str(log)]
    now = [100.0]
    waits: list[float] = []
    calls: list[tuple[float, float]] = []

    def lines(n: int, what: str) -> None:
        wait_for(lambda: log.exists() and len(log.read_text().splitlines()) == n, 20, what)

    def sleep(s: float) -> None:
        waits.append(s)
        now[0] += s

    def fake_observe(config: Any, window: float) -> Graph:
        calls.append((now[0], window))
        now[0] += window
        if len(calls) == 3:
            raise kvcomm.Unavailable("L3 is down")
        if len(calls) == 4:
            lines(6, "the two moved agents to start on their new hosts")
            launcher.stop_all()  # (the agents end: the loop must too)
        return _pairs_graph({})  # (no hosts: the launcher's own must be used)

    try:
        launcher.apply(Plan({"a": "h1", "b": "h2", "c": "h1", "d": "h2"}, (), None, None), cmd)
        lines(4, "the four agents to start")
        # (moves free: whether a move pays for its L3 bytes is test_placement_cost's)
        rounds = launcher.replan_loop("cfg", cmd, every=5, window=3, max_moves=1, balance=1.5,
                                      observe=fake_observe, clock=lambda: now[0], sleep=sleep,
                                      move_bytes=0)
        # every round observes the 3 s before it is due, every 5 s
        assert [c[0] for c in calls] == [102.0, 107.0, 112.0, 117.0] and waits[0] == 2.0
        assert [len(r.moves) for r in rounds] == [1, 1, 0] and rounds[0].before == 0.0
        assert rounds[1].share == 1.0 and "L3 is down" in (rounds[2].skipped or "")
        moved = [m.agent for r in rounds for m in r.moves]
        started = [json.loads(line)[:2] for line in log.read_text().splitlines()]
        assert sorted(a for a, _ in started[4:]) == sorted(moved)
        final = {a: h for a, h in started}
        assert final["a"] == final["b"] and final["c"] == final["d"]
    finally:
        launcher.stop_all()


@pytest.mark.parametrize("kwargs, match", [({"every": 0, "max_moves": 1}, "every"),
                                           ({"every": 5, "window": -1, "max_moves": 1}, "window"),
                                           ({"every": 5, "max_moves": -1}, "max_moves"),
                                           ({"every": True, "max_moves": 1}, "every")])
def test_bad_replan_loop_arguments_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(kvcomm.InvalidArgument, match=match):
        Launcher({"h1": "/c/h1.yaml"}).replan_loop("cfg", ["true"], **kwargs)


@pytest.mark.parametrize("flags, match", [(["--replan-every", "0"], "--replan-every"),
                                          (["--replan-every", "5", "--max-moves", "-1"],
                                           "--max-moves")])
def test_launch_refuses_a_bad_replan_before_starting_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], match: str) -> None:
    # (no dev cluster in tmp_path, no plan file: refused before either is looked at)
    assert cli_main(["placement", "launch", "--plan", str(tmp_path / "p.json"), "--dir",
                     str(tmp_path), *flags, "--", "true"]) == 2
    assert match in capsys.readouterr().err


# ---------------------------------------------------------------- observe: what L3 holds


def _report(**kw: Any) -> dict[str, Any]:
    r = {"f": 1, "agent": "a", "host": "h1", "pid": 1, "since": 0.0, "t": 10.0, "ops": 10,
         "edges": {"b": [5, 50]}, "dropped": 0, "unknown": 0, "id": "a.1.x"}
    r.update(kw)
    return r


def _decoded_snap(host: str, *reports: dict[str, Any]) -> dict[str, Any]:
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
    and the rest of the graph kept.
    (found in review 12: affinity placement)"""
    good = _report(agent="c", id="c.1.x", host="h2", edges={"b": [5, 50]})
    g = graph_from([], [_decoded_snap("h1", _report(**bad)), _decoded_snap("h2", good)])
    doc = json.loads(json.dumps(g.to_json(), allow_nan=False))
    assert Graph.from_json(doc) == g
    assert ("c", "b") in {(e.reader, e.writer) for e in g.edges}


# ---------------------------------------------------------------- the host's table


def test_an_agent_whose_name_starts_with_a_dot_is_observed(ns: str) -> None:
    """F: '.x' is a valid agent name (letters, digits, '_.:-'), but its report file
    '.x.PID.HEX' starts with '.', which read_reports takes for a temporary file: the agent
    never appears in the graph, and the daemon deletes its report after a minute.
    (found in review 12: affinity placement)"""
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
    regular file.
    (found in review 12: affinity placement)"""
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
    """(held) A symlink in the table, to a valid report elsewhere, is not read.
    (found in review 12: affinity placement)"""
    table = tmp_path / "t"
    report.ensure_dir(str(table), 0o600)
    target = tmp_path / "elsewhere"
    target.write_bytes(msgpack.packb({k: v for k, v in _report(pid=os.getpid()).items() if k != "id"}))
    os.symlink(target, table / "a.1.x")
    assert report.read_reports(str(table)) == []
    assert target.exists()


def test_the_hosts_snapshot_carries_only_the_report_fields(tmp_path: Path) -> None:
    """F: a report may carry keys the format does not know (readers ignore them), and the
    daemon published each report as it read it: 4096 reports of up to 1 MiB each (junk in
    an unknown key) make a snapshot of gigabytes in the daemon's memory, over Redis's
    512 MB value limit, and over observe's 64 MiB bound (so the host's agents vanish
    from the graph). The snapshot should carry the fields of the format, nothing else.
    (found in review 12: affinity placement)"""
    table = tmp_path / "t"
    report.ensure_dir(str(table), 0o600)
    rep = {k: v for k, v in _report(pid=os.getpid()).items() if k != "id"}
    (table / "a.1.x").write_bytes(msgpack.packb({**rep, "junk": "x" * (512 << 10)}))
    snap = host_snapshot("h1", str(table), 1.0)
    assert [r["agent"] for r in snap["reports"]] == ["a"]
    assert len(msgpack.packb(snap)) < 4096


# ---------------------------------------------------------------- bounded memory of sampling


def test_the_writer_names_cache_stays_small_whatever_the_extension_fields(ns: str) -> None:
    """F: AgentStats caches extension field -> writer id for up to MAX_NAMES (4096)
    fields, keyed by the whole field, which may be 4 KiB (other features' keys share the
    map): up to 16 MiB per client, for a cache whose useful content is a few hundred
    names. Records whose field differs per record (an expiry, say) fill it with garbage.
    (found in review 12: affinity placement)"""
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
    reader. Writers no longer read (unchanged since the last report) should give way.
    (found in review 12: affinity placement)"""
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
    it is a traceback. The README promises only the three fields are replaced.
    (found in review 12: affinity placement)"""
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
    exit status 2 and a message naming the command.
    (found in review 12: affinity placement)"""
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
    the daemon must refuse it too: read nothing, remove nothing.
    (found in review 12: affinity placement)"""
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
    ensure_dir refuses a table that is not theirs).
    (found in review 12: affinity placement)"""
    if os.geteuid() != 0:
        pytest.skip("making another user's file needs root")
    table = tmp_path / "t"
    report.ensure_dir(str(table), 0o660)
    rep = {k: v for k, v in _report(pid=os.getpid()).items() if k != "id"}
    (table / "a.1.x").write_bytes(msgpack.packb(rep))
    os.chown(table / "a.1.x", 65534, 65534)
    assert report.read_reports(str(table)) == []


def test_a_launch_stopped_with_sigterm_stops_its_agents(tmp_path: Path) -> None:
    """F: the README's walkthrough runs `kvcomm placement launch ... &` and then says "stop
    the first launch": `kill PID` (SIGTERM, as any supervisor or script stops a process)
    killed the launcher without its `finally` (only Ctrl-C, KeyboardInterrupt, was
    handled), leaving every agent running, unowned, beside the ones the next plan starts:
    two drone-7s on two hosts.
    (found in review 12: affinity placement)"""
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
    seconds.
    (found in review 12: affinity placement)"""
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


def test_a_report_after_close_does_not_bring_the_file_back(ns: str) -> None:
    """F: Client.close() removed the agent's report without the observer's lock, and
    AgentStats.report() after close() wrote it again: a thread whose read flushed while
    another thread closed the client (it passed the closed check just before) left a
    report of a closed client in the table for as long as the process lived, published
    as a live agent. A closed observer writes nothing, and close waits for a report in
    progress.
    (found in review 12: affinity placement)"""
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
    flush's samples are counted as unknown instead.
    (found in review 12: affinity placement)"""
    cfg = _cfg(hot_key_sample=1)
    with kvcomm.open(ns, config=cfg, agent="r") as r:
        obs = r._observer
        assert obs is not None

        def broken(pairs: list[tuple[bytes, int]]) -> list[tuple[bytes, int] | None]:
            raise kvcomm.SegmentError("the segment is corrupt (simulated)")

        obs.sampled({"k": 3}, {}, lambda k: (k.encode(), 0), broken)
        assert obs.unknown == 3


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
    temporary file), and the daemon's cleaning removes everything once it is gone.
    (found in review 12: affinity placement)"""
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


UNCLOSED_AGENT = """
import os, sys, kvcomm
from kvcomm.placement import report
cfg = kvcomm.Config.from_mapping({"cache": {"l2_size": "16MB", "watch_buffer": 4096}})
kv = kvcomm.open(sys.argv[1], config=cfg, agent="gone")
for _ in range(report.REPORT_PUTS):  # (an agent that writes reports)
    kv.put("gone/state", b"x")
os._exit(0)  # (no close: its report stays)
"""


def test_a_client_that_opens_removes_the_reports_of_processes_gone_without_closing(
        ns: str, tmp_path: Path) -> None:
    """Embedded mode has no daemon to clean the host's table: each process that exited
    without closing its client left its report file in /dev/shm for good (one per crashed
    agent, never bounded). A client that opens the namespace removes those (older than
    GONE_AFTER), and keeps a live agent's."""
    cfg = _cfg()
    table = report.agents_dir(ns, cfg.cache.l2_dir)
    with kvcomm.open(ns, config=cfg, agent="live") as live:
        for _ in range(report.REPORT_PUTS):
            live.put("live/state", b"y")
        script = tmp_path / "agent.py"
        script.write_text(UNCLOSED_AGENT)
        subprocess.run([sys.executable, str(script), ns], check=True, timeout=60)
        got = {r["agent"]: r["id"] for r in report.read_reports(table, clean=False)}
        assert set(got) == {"live", "gone"}
        old = time.time() - report.GONE_AFTER - 5
        for name in got.values():
            os.utime(os.path.join(table, name), (old, old))
        with kvcomm.open(ns, config=cfg, agent="next"):
            assert sorted(os.listdir(table)) == [got["live"]]


def test_a_client_that_opens_reads_no_report_it_could_not_remove(
        ns: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cleaning at open parsed every report in the table, young ones included (which
    it never removes): 1,000 reports of 1,024 edges each made an open take 3.6-4.9 s (the
    review's find). It now reads only those older than GONE_AFTER."""
    cfg = _cfg()
    table = report.agents_dir(ns, cfg.cache.l2_dir)
    with kvcomm.open(ns, config=cfg):
        base = {"f": 1, "agent": "a", "host": "h", "since": 1.0, "t": 2.0, "ops": 3,
                "edges": {}, "dropped": 0, "unknown": 0, "pid": os.getpid()}
        for i in range(50):
            Path(table, f"a{i}.{os.getpid()}.x").write_bytes(msgpack.packb(base))
        reads: list[str] = []
        real = report._read_report

        def counted(dfd: int, name: str) -> Any:
            reads.append(name)
            return real(dfd, name)

        monkeypatch.setattr(report, "_read_report", counted)
        kvcomm.open(ns, config=cfg).close()
        assert reads == []  # (all young: none could be removed, none read)
        old = time.time() - report.GONE_AFTER - 5
        for name in os.listdir(table):
            os.utime(os.path.join(table, name), (old, old))
        kvcomm.open(ns, config=cfg).close()
        assert len(reads) == 50 and len(os.listdir(table)) == 50  # (a live pid's: kept)


def test_observe_with_l3_unreachable_exits_2_saying_so(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """(held) `kvcomm placement observe` against a Redis Cluster that cannot be reached
    exits with status 2 and says which address, and writes no graph.
    (found in review 12: affinity placement)"""
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
    unknown writer: no edge, no error in the reader.
    (found in review 12: affinity placement)"""
    cfg = _cfg(hot_key_sample=1)
    with kvcomm.open(ns, config=cfg, agent="w") as w, kvcomm.open(ns, config=cfg, agent="r") as r:
        w._ext = msgpack.packb({"a": agent, "x": 1}, use_bin_type=True)
        w.put("k", b"v")
        for _ in range(50):
            assert r.get("k") == b"v"
        r.hot_keys(1)
        obs = r._observer
        assert obs is not None and obs.edges == {} and obs.unknown >= 1


def test_an_agent_id_carrying_a_damaged_host_id_still_reports(tmp_path: Path, ns: str) -> None:
    """An unnamed agent's id is PID@HOST, HOST read from the segment's header: a damaged
    header may put a NUL or a slash in it. The report file's name keeps only safe
    characters and the report is written (it used to raise ValueError, "embedded null
    byte", out of a client's flush: found by the segment fuzzer, FUZZ_SEED=180826016
    FUZZ_CASE=9)."""
    obs = report.AgentStats("123@h\x00st/../x", "h\x00st", ns, str(tmp_path), 0o600)
    obs.edges["w"] = [1.0, 10.0]
    assert obs.report(5) is True and obs.errors == 0
    (name,) = os.listdir(report.agents_dir(ns, str(tmp_path)))
    assert "\x00" not in name and "/" not in name
    # (its readers refuse such an agent id: placement skips it, nothing crashes)
    assert report.read_reports(report.agents_dir(ns, str(tmp_path)), clean=False) == []
    obs.close()
