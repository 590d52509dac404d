"""``kvcomm balance`` (balance/driver.py, signals.py) on a real Redis Cluster: the load
the daemons report makes a hot master visible, the threshold policy moves slots off it
while hosts keep writing, --once prints its JSON contract, --dry-run moves nothing, and
a learned policy whose model is missing is a clear ConfigError. The policies are the
simulator's (balance/policy.py), through the one contract (balance/model.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvcomm.balance.driver import Balancer, load_policy
from kvcomm.balance.migrate import SlotMover
from kvcomm.balance.policy import make_policy
from kvcomm.devcluster.redis_cluster import RedisCluster
from kvcomm.errors import ConfigError
from kvcomm.tiers.l3 import L3Store
from tests.support.daemon_harness import Host, cluster_fixture  # noqa: F401 (the fixture)
from tests.support.helpers import wait_for

# a few of the daemons' load-count saves (every HOT_EVERY = 2 s): a 2 s window sees 0 or 1
WINDOW = 6.0


@pytest.fixture(scope="module", name="swarm")
def swarm_fixture(cluster: RedisCluster) -> Iterator[dict[str, Any]]:
    """Three hosts whose agents write keys of three groups that all live on one master
    (the hot one), and background keys everywhere, until the module's tests end."""
    store = L3Store(cluster.seeds)
    mover = SlotMover(store)
    masters = sorted(n.name for n in mover.masters())
    hot_master = masters[0]
    hot_groups = _groups_on(store, mover, hot_master, 3)
    keys = [k for g in hot_groups for k in _keys_in(store, g, 20)]
    background = [f"bg/{i}" for i in range(30)]
    hosts = [Host(cluster, f"bh-{i}", seed=i) for i in range(3)]
    stop = threading.Event()
    written: dict[str, int] = {}
    errors: list[BaseException] = []

    def writer(h: Host, mine: list[str]) -> None:
        n = 0
        try:
            while not stop.is_set():
                n += 1
                for k in mine:
                    h.kv.put(k, n)
                    written[k] = n
                time.sleep(0.005)
        except BaseException as exc:  # an agent's put failed: the tests say so
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(h, keys[i::3] + background[i::3]),
                                daemon=True) for i, h in enumerate(hosts)]
    for t in threads:
        t.start()
    wait_for(lambda: len(written) == len(keys) + len(background), 60, "every key written")
    # (the balancer sees a slot's load only once the daemons have saved their counts)
    wait_for(lambda: all(set(hot_groups) <= set(store.load_counts(h.config.node.host_id))
                         for h in hosts), 60, "every host's counts of the hot groups saved")
    yield {"store": store, "mover": mover, "hosts": hosts, "hot": hot_master,
           "groups": hot_groups, "errors": errors, "written": written, "stop": stop}
    stop.set()
    for t in threads:
        t.join(30)
    for h in hosts:
        h.close()
    store.close()


def _groups_on(store: L3Store, mover: SlotMover, master: str, n: int) -> list[int]:
    slots = next(m.slots for m in mover.masters() if m.name == master)
    return [g for g in store.groups if store.groups.slot(g) in slots][:n]


def _keys_in(store: L3Store, g: int, n: int) -> list[str]:
    out, i = [], 0
    while len(out) < n:
        k = f"hotg{g}/{i}"
        if store.groups.of(k) == g:
            out.append(k)
        i += 1
    return out


def test_a_dry_run_decides_and_moves_nothing(swarm: dict[str, Any]) -> None:
    cfg = swarm["hosts"][0].config
    owners = {s: swarm["mover"].owner(s).name
              for s in (swarm["store"].groups.slot(g) for g in swarm["groups"])}
    b = Balancer(cfg, make_policy("threshold", monitor_s=0, grace_s=0, min_utilisation=0),
                 window=WINDOW, dry_run=True)
    try:
        report = b.once()
    finally:
        b.close()
    print(json.dumps(report))
    assert report["dry_run"] and report["predicted"] and report["bytes_moved"] == 0
    assert report["moves"] and all(m["from"] == swarm["hot"] for m in report["moves"])
    assert {s: swarm["mover"].owner(s).name for s in owners} == owners  # nothing moved
    assert set(report["load_before"]) == set(report["load_after"]) == set(owners.values()) | {
        n.name for n in swarm["mover"].masters()}
    hot = report["load_before"][swarm["hot"]]
    assert hot == max(report["load_before"].values())  # the daemons' load made it visible
    assert report["load_after"][swarm["hot"]] < hot  # (predicted)


def test_once_moves_slots_off_the_hot_master_and_writes_go_on(swarm: dict[str, Any]) -> None:
    cfg = swarm["hosts"][0].config
    b = Balancer(cfg, make_policy("threshold", monitor_s=0, grace_s=0, min_utilisation=0),
                 window=WINDOW)
    try:
        report = b.once()
    finally:
        b.close()
    print(json.dumps(report))
    assert set(report) >= {"moves", "bytes_moved", "load_before", "load_after"}
    assert report["moves"] and not report["failed"] and not report["predicted"]
    mover = swarm["mover"]
    for m in report["moves"]:
        assert set(m) == {"slot", "from", "to", "keys", "bytes"}
        assert m["from"] == swarm["hot"] and mover.owner(m["slot"]).name == m["to"]
        assert m["keys"] > 0 and m["bytes"] > 0
        n = int(mover._conn(m["to"]).execute_command("CLUSTER COUNTKEYSINSLOT", m["slot"]))
        assert n >= m["keys"]  # the keys are counted on the target
    assert report["bytes_moved"] == sum(m["bytes"] for m in report["moves"])
    for d in report["decisions"]:
        assert "above mean" in d["reason"]
    # the writes went on through the moves, and every host still converges on L3
    assert not swarm["errors"], swarm["errors"]
    store, written = swarm["store"], dict(swarm["written"])

    def settled() -> bool:
        return all((r := store.get(k)) is not None and r.decode_value(k) >= n
                   for k, n in written.items())

    wait_for(settled, 60, "L3 to hold every write made before the check")
    for h in swarm["hosts"]:
        assert h.alive and h.stats.l3_errors == 0 and h.stats.step_errors == 0, h.stats


def test_the_command_prints_its_json_on_the_last_line(swarm: dict[str, Any],
                                                      tmp_path: Path) -> None:
    cfg_file = tmp_path / "balance.yaml"
    cfg = swarm["hosts"][0].config
    cfg_file.write_text(yaml.safe_dump({"cluster": {"redis": list(cfg.cluster.redis)}}))
    out = subprocess.run([sys.executable, "-m", "kvcomm", "balance", "--config", str(cfg_file),
                          "--once", "--dry-run", "--window", "1s"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(report) >= {"moves", "bytes_moved", "load_before", "load_after"}
    assert "window of 1s" in out.stderr  # the decisions and their reasons are logged
    assert report["policy"] == "threshold"
    # the learned policy (trained in the simulator) decides on the live view as well
    out = subprocess.run([sys.executable, "-m", "kvcomm", "balance", "--config", str(cfg_file),
                          "--once", "--dry-run", "--window", "6s", "--policy", "learned"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    print(out.stderr, report)
    assert report["policy"] == "learned" and report["dry_run"] and report["bytes_moved"] == 0
    assert set(report["load_before"]) == set(report["load_after"])
    assert all(m["from"] in report["load_before"] for m in report["moves"])


def test_bad_options_and_a_missing_learned_model_are_config_errors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cluster: RedisCluster) -> None:
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump({"cluster": {"redis": [f"127.0.0.1:{cluster.ports[0]}"]}}))
    out = subprocess.run([sys.executable, "-m", "kvcomm", "balance", "--config", str(cfg_file),
                          "--once", "--window", "soon"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "--window" in out.stderr
    # the learned policy's model: gone from the package, or not a model
    import kvcomm.balance.policy as policy

    monkeypatch.setattr(policy, "MODEL_FILE", "gone.json")
    with pytest.raises(ConfigError, match="cannot read the balancing model gone.json"):
        load_policy("learned")
    monkeypatch.setattr(policy, "MODEL_FILE", "__init__.py")
    with pytest.raises(ConfigError, match="cannot read the balancing model"):
        load_policy("learned")
    with pytest.raises(ConfigError, match="unknown policy"):
        load_policy("random")
