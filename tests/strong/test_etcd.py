"""The etcd client (kvcomm.tiers.etcd) on a real 3-member etcd cluster started here.

Every operation; failover when the member in use is killed; a leader kill; majority
loss -> Unavailable within 2 x timeout; watch resume across a member restart without a
missed or duplicated event; lease expiry when keepalives stop; auth; TLS; the request
limit. A test that kills members restarts them and waits until the cluster is healthy
again, so that no later test depends on what an earlier one broke.
"""

from __future__ import annotations

import os
import random
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvcomm
from kvcomm.devcluster.etcd_cluster import EtcdCluster, etcd_path, leader_index, member_argv
from kvcomm.devcluster.procs import running, spawn, stop
from kvcomm.tiers.etcd import (
    Compare,
    EtcdClient,
    KeepAlive,
    delete_op,
    get_op,
    prefix_end,
    put_op,
)
from tests.support.helpers import drawn_seed, wait_for
from tests.support.servers import starts


@pytest.fixture(scope="module")
@starts("etcd")
def cluster() -> Iterator[EtcdCluster]:
    with EtcdCluster() as ec:
        yield ec


@pytest.fixture
def healthy(cluster: EtcdCluster) -> Iterator[EtcdCluster]:
    """The cluster, whole again after the test (killed members restarted, paused resumed)."""
    yield cluster
    for i in range(len(cluster.names)):
        if cluster.alive(i):
            cluster.resume(i)
        else:
            cluster._spawn(i)
    cluster.wait_healthy(60)


@pytest.fixture
def client(cluster: EtcdCluster) -> Iterator[EtcdClient]:
    c = EtcdClient(cluster.endpoints, timeout=2.0)
    yield c
    c.close()


def _key(name: str) -> str:
    return f"t/{os.getpid()}/{time.monotonic_ns()}/{name}"


# ---------------------------------------------------------------- operations


def test_put_get_delete_and_serializable_reads(client: EtcdClient) -> None:
    k = _key("a")
    assert client.get(k) is None
    rev = client.put(k, b"v1")
    kv = client.get(k)
    assert kv is not None and kv.value == b"v1" and kv.mod_revision == rev and kv.version == 1
    rev2 = client.put(k, b"v2")
    assert rev2 > rev
    kv2 = client.get(k, serializable=True)
    # a serializable read may lag, never invent: it is one of the two writes
    assert kv2 is not None and kv2.value in (b"v1", b"v2")
    assert client.delete(k) == 1 and client.get(k) is None and client.delete(k) == 0


def test_range_by_prefix_in_key_order_with_limit_and_paging(client: EtcdClient) -> None:
    base = _key("r") + "/"
    names = [f"{base}{n:03d}" for n in random.Random(7).sample(range(200), 25)]
    for n in names:
        client.put(n, n.encode())
    client.put(base[:-1] + "0", b"outside")  # shares the prefix minus the slash: not in range
    want = sorted(n.encode() for n in names)
    r = client.range(base, limit=10)
    assert [kv.key for kv in r.kvs] == want[:10] and r.more and r.count == 25
    got, start = [], None
    while True:
        page = client.range(base, limit=7, start=start)
        got += [kv.key for kv in page.kvs]
        if not page.more:
            break
        start = page.kvs[-1].key + b"\0"
    assert got == want
    assert [kv.key for kv in client.range(base, keys_only=True).kvs] == want
    assert client.delete(base, prefix=True) == 25 and client.range(base).count == 0
    assert prefix_end(b"a\xff\xff") == b"b" and prefix_end(b"\xff") == b"\0"


def test_transactions_are_compare_and_set(client: EtcdClient) -> None:
    k = _key("cas")
    # create only if absent (version 0)
    r = client.txn([Compare.version(k, "=", 0)], [put_op(k, b"one")], [get_op(k)])
    assert r.succeeded and r.results == [None]
    r = client.txn([Compare.version(k, "=", 0)], [put_op(k, b"again")], [get_op(k)])
    assert not r.succeeded and r.results[0] is not None and r.results[0].value == b"one"  # type: ignore[union-attr]
    kv = client.get(k)
    assert kv is not None
    # CAS on mod_revision: the first wins, the second (same expected revision) loses
    ok = client.txn([Compare.mod(k, "=", kv.mod_revision)], [put_op(k, b"two")])
    lost = client.txn([Compare.mod(k, "=", kv.mod_revision)], [put_op(k, b"three")], [get_op(k)])
    assert ok.succeeded and not lost.succeeded
    assert lost.results[0].value == b"two"  # type: ignore[union-attr]
    # on the value, then delete in the same transaction
    r = client.txn([Compare.value(k, "=", b"two")], [delete_op(k), get_op(k)])
    assert r.succeeded and r.results == [1, None] and client.get(k) is None
    assert r.revision > ok.revision
    r = client.txn([Compare.value(k, "=", b"two")], [put_op(k, b"x")], [get_op(k)])
    assert not r.succeeded and r.results == [None]  # a value comparison with an absent key fails
    with pytest.raises(kvcomm.InvalidArgument):
        client.txn([Compare(k.encode(), "value", "~", b"x")], [])  # type: ignore[arg-type]


def test_bad_arguments_and_a_closed_client(cluster: EtcdCluster) -> None:
    c = EtcdClient(cluster.endpoints)
    with pytest.raises(kvcomm.InvalidArgument):
        c.range("x", limit=-1)
    with pytest.raises(kvcomm.InvalidArgument):
        c.lease_grant(0)
    with pytest.raises(kvcomm.InvalidArgument):
        c.get(5)  # type: ignore[arg-type]
    with pytest.raises(kvcomm.ConfigError, match="cluster.etcd"):
        EtcdClient([])
    c.close()
    with pytest.raises(kvcomm.Unavailable, match="closed"):
        c.get("x")


def test_a_value_over_the_request_limit_is_value_too_large(client: EtcdClient) -> None:
    k = _key("big")
    for size in (1600 << 10, 3 << 20):  # over etcd's 1.5 MiB, over the gateway's 2 MiB
        with pytest.raises(kvcomm.ValueTooLarge, match="max-request-bytes"):
            client.put(k, b"x" * size)
    with pytest.raises(kvcomm.ValueTooLarge):
        client.txn([], [put_op(k, b"y" * (1600 << 10))])
    assert client.get(k) is None
    client.put(k, b"z" * (1 << 20))  # 1 MiB fits
    assert len(client.get(k).value) == 1 << 20  # type: ignore[union-attr]


# ---------------------------------------------------------------- failures


def test_failover_when_the_member_in_use_is_killed(healthy: EtcdCluster,
                                                   client: EtcdClient) -> None:
    k = _key("fo")
    client.put(k, b"before")
    used = client.endpoint
    i = healthy.endpoints.index(used)
    healthy.kill(i)
    assert not healthy.alive(i)
    before = client.stats.failovers
    t0 = time.monotonic()
    # a read on the pooled connection to the dead member fails over; when that member was
    # the leader, the others first elect one (longer than cluster.timeout on a loaded
    # machine), and the read is Unavailable until then: never a stale answer
    kv = wait_for(lambda: client.get(k), 60, "a read after the member in use was killed",
                  retry_on=(kvcomm.Unavailable,))
    took = time.monotonic() - t0
    assert kv is not None and kv.value == b"before"
    assert client.endpoint != used and client.stats.failovers > before
    # a write too: the dead member is not tried first any more
    wait_for(lambda: client.put(k, b"after") or True, 60, "a write after the failover",
             retry_on=(kvcomm.Unavailable,))
    assert client.get(k).value == b"after"  # type: ignore[union-attr]
    print(f"failover after killing the member in use: {took * 1000:.1f} ms")


def test_leader_kill(healthy: EtcdCluster) -> None:
    lead = healthy.leader()
    c = EtcdClient([healthy.endpoints[lead]] + [e for j, e in enumerate(healthy.endpoints)
                                                if j != lead], timeout=2.0)
    try:
        k = _key("leader")
        c.put(k, b"1")
        healthy.kill(lead)
        t0 = time.monotonic()

        def written() -> bool:
            try:
                c.put(k, b"2")
            except kvcomm.Unavailable:
                return False  # electing: no leader yet (or the write's outcome is unknown)
            return True

        wait_for(written, 60, "a write after the leader was killed")
        took = time.monotonic() - t0
        assert c.get(k).value == b"2"  # type: ignore[union-attr]
        new = healthy.leader()
        assert new != lead and healthy.alive(new)
        print(f"first write acknowledged {took:.2f}s after the leader was killed "
              f"(election timeout {healthy.election_ms} ms)")
    finally:
        c.close()


def test_majority_loss_is_unavailable_within_twice_the_timeout(healthy: EtcdCluster) -> None:
    timeout = 1.5
    c = EtcdClient(healthy.endpoints, timeout=timeout)
    try:
        k = _key("maj")
        c.put(k, b"1")
        lead = healthy.leader()
        victims = [lead, (lead + 1) % 3]  # the leader and a follower: no majority left
        for v in victims:
            healthy.kill(v)
        assert all(not running(healthy.pids[v]) for v in victims)  # really down
        assert healthy.alive((lead + 2) % 3)
        times: dict[str, list[float]] = {"put": [], "get": [], "txn": []}
        for _ in range(3):
            for what, call in (("put", lambda: c.put(k, b"2")), ("get", lambda: c.get(k)),
                               ("txn", lambda: c.txn([Compare.version(k, ">", 0)],
                                                     [put_op(k, b"3")]))):
                t0 = time.monotonic()
                with pytest.raises(kvcomm.Unavailable):
                    call()  # never a silent success, never a stale read
                times[what].append(time.monotonic() - t0)
        # the contract: within 2 x timeout. A machine stall can stretch one call; three
        # calls of each kind over the bound is the signature of a real bug
        for what, ts in times.items():
            assert min(ts) < 2 * timeout, (what, ts)
        print("Unavailable on majority loss after (s):",
              {w: [round(t, 2) for t in ts] for w, ts in times.items()})
    finally:
        c.close()


def test_a_paused_member_does_not_stall_reads(healthy: EtcdCluster) -> None:
    # a paused follower (a paused leader stalls every read until the next election)
    used = (healthy.leader() + 1) % 3
    c = EtcdClient([healthy.endpoints[used]] + [e for j, e in enumerate(healthy.endpoints)
                                                if j != used], timeout=2.0)
    try:
        k = _key("pause")
        c.put(k, b"1")
        assert c.endpoint == healthy.endpoints[used]
        healthy.pause(used)  # SIGSTOP: connections stay open, nothing answers
        assert c.get(k).value == b"1"  # type: ignore[union-attr]  # half the budget, then the next
        assert c.endpoint != healthy.endpoints[used] and c.stats.failovers >= 1
    finally:
        healthy.resume(used)
        c.close()


def test_watch_resumes_across_a_member_restart_without_missed_or_duplicated_events(
        healthy: EtcdCluster, client: EtcdClient) -> None:
    seed = drawn_seed(1 << 30)
    rng = random.Random(seed)
    base = _key("w") + "/"
    start = client.put(base + "start", b"-") + 1
    # the watch streams from a follower: killing it must not disturb the writer, whose
    # writes then never have an unknown outcome (a killed leader would give some)
    follower = (healthy.leader() + 1) % 3
    wclient = EtcdClient([healthy.endpoints[follower]], timeout=2.0)
    wclient.endpoints += [e for j, e in enumerate(healthy.endpoints) if j != follower]
    w = wclient.watch(base, prefix=True, start_revision=start)
    try:
        assert w.created.wait(10)
        n = 120
        written: list[tuple[int, bytes, bytes]] = []  # (revision, key, value) acknowledged
        writer_errors: list[BaseException] = []
        half = threading.Event()

        # the writer talks to the members the watch does not use: its writes are never
        # of unknown outcome, so the events expected are exactly the acknowledged writes
        streaming = healthy.endpoints.index(w.endpoint)  # type: ignore[arg-type]
        assert streaming == follower
        others = [e for j, e in enumerate(healthy.endpoints) if j != streaming]

        def writer() -> None:
            wc = EtcdClient(others, timeout=5.0)
            try:
                for j in range(n):
                    key = f"{base}{rng.randrange(10)}".encode()
                    value = f"v{j}".encode()
                    while True:
                        try:
                            if rng.random() < 0.2:
                                r = wc.txn([], [delete_op(key)])
                                if r.results == [1]:  # (deleting nothing is no event)
                                    written.append((r.revision, key, b""))
                            else:
                                rev = wc.put(key, value)
                                written.append((rev, key, value))
                            break
                        except kvcomm.Unavailable as exc:
                            if "outcome unknown" in str(exc):
                                raise  # not expected: the killed member is not the writer's
                            # an election in progress (the killed member was the leader)
                    if j == n // 2:
                        half.set()
            except BaseException as exc:  # noqa: BLE001 - reported by the test below
                writer_errors.append(exc)
                half.set()

        t = threading.Thread(target=writer)
        t.start()
        assert half.wait(60)
        healthy.kill(streaming)  # the watch's stream dies with it
        wait_for(lambda: w.resumes >= 1, 30, "the watch to resume on another member")
        healthy._spawn(streaming)
        healthy.wait_healthy(60)
        t.join(120)
        assert not writer_errors, writer_errors
        seen = []
        deadline_revision = max(r for r, _, _ in written)
        while not seen or seen[-1].revision < deadline_revision:
            got = w.next(30)
            assert got, f"no event for 30s; last {w.last_revision}, want {deadline_revision}"
            seen += got
        want = sorted(written)
        assert [(e.revision, e.kv.key, e.kv.value if e.type == "put" else b"") for e in seen] == want
        assert w.resumes >= 1
        print(f"{len(seen)} events, {w.resumes} resumes, none missed or duplicated")
    finally:
        w.close()
        wclient.close()


def test_a_compacted_watch_says_so(client: EtcdClient) -> None:
    k = _key("compact")
    first = client.put(k, b"1")
    client.put(k, b"2")
    last = client.put(k, b"3")
    client.request("/v3/kv/compaction", {"revision": str(last), "physical": True}, write=True)
    w = client.watch(k, start_revision=first)
    try:
        with pytest.raises(kvcomm.Unavailable) as info:
            w.next(10)
        assert getattr(info.value, "compact_revision", 0) == last
    finally:
        w.close()


def test_lease_expires_when_keepalives_stop(client: EtcdClient) -> None:
    ttl = 3  # etcd's minimum here: 1.5 election timeouts
    lease = client.lease_grant(ttl)
    k = _key("lease")
    client.put(k, b"held", lease=lease)
    ka = KeepAlive(client, lease, ttl, interval=0.5)
    try:
        granted = time.monotonic()
        # kept alive past twice its TTL, the key is still there
        wait_for(lambda: time.monotonic() - granted > 2 * ttl and ka.renewals >= 4, 30,
                 "keepalives past twice the TTL")
        assert client.get(k) is not None and not ka.expired.is_set()
        assert 0 < client.lease_ttl(lease) <= ttl
    finally:
        ka.stop()
    stopped = time.monotonic()
    wait_for(lambda: client.get(k) is None, 30, "the key to go with its lease")
    assert time.monotonic() - stopped > 1.0  # it outlived the last keepalive for a while
    assert client.lease_ttl(lease) == -1 and client.lease_keepalive(lease) == 0
    assert client.lease_revoke(lease) is False
    # a KeepAlive of an expired lease says so
    ka2 = KeepAlive(client, lease, ttl, interval=0.1)
    try:
        assert ka2.expired.wait(10)
    finally:
        ka2.stop()


def test_revoking_a_lease_deletes_its_keys(client: EtcdClient) -> None:
    lease = client.lease_grant(30)
    k = _key("revoke")
    client.put(k, b"x", lease=lease)
    assert client.get(k).lease == lease  # type: ignore[union-attr]
    assert client.lease_revoke(lease) is True and client.get(k) is None


# ---------------------------------------------------------------- auth and TLS


@pytest.mark.etcd
def test_user_and_password(tmp_path: Path) -> None:
    with EtcdCluster(members=1) as one:
        admin = EtcdClient(one.endpoints)
        for path, body in (("/v3/auth/role/add", {"name": "root"}),
                           ("/v3/auth/user/add", {"name": "root", "password": "rootpw"}),
                           ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
                           ("/v3/auth/enable", {})):
            admin.request(path, body, write=True)
        admin.close()
        anonymous = EtcdClient(one.endpoints)
        with pytest.raises(kvcomm.ConfigError, match="etcd_username"):
            anonymous.get("x")
        anonymous.close()
        wrong = EtcdClient(one.endpoints, username="root", password="nope")
        with pytest.raises(kvcomm.ConfigError, match="etcd_password"):
            wrong.put("x", b"1")
        wrong.close()
        cfg = kvcomm.Config.from_mapping({"cluster": {
            "etcd": one.addresses, "etcd_username": "root", "etcd_password": "rootpw"}})
        c = EtcdClient.from_config(cfg.cluster)
        c.put("x", b"1")
        assert c.get("x").value == b"1"  # type: ignore[union-attr]
        c._token = "expired.token"  # as after etcd's token TTL: renewed once, transparently
        assert c.get("x").value == b"1"  # type: ignore[union-attr]
        assert c.stats.reauths == 2
        c.close()


@pytest.mark.etcd
def test_user_and_password_through_two_leader_failovers_with_expired_tokens() -> None:
    """With user and password, the token is re-fetched wherever a member rejects it:
    after two leader failovers (each killed leader restarted, which forgets its tokens),
    with the token expired while the cluster elects, every call either succeeds or
    raises Unavailable (never ConfigError: an election is not bad credentials), and
    calls succeed again once a leader is elected."""
    with EtcdCluster(members=3) as ec:
        admin = EtcdClient(ec.endpoints, timeout=5.0)
        for path, body in (("/v3/auth/role/add", {"name": "root"}),
                           ("/v3/auth/user/add", {"name": "root", "password": "rootpw"}),
                           ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
                           ("/v3/auth/enable", {})):
            admin.request(path, body, write=True)
        admin.close()
        cfg = kvcomm.Config.from_mapping({"cluster": {
            "etcd": ec.addresses, "etcd_username": "root", "etcd_password": "rootpw",
            "timeout": 1.0}})
        c = EtcdClient.from_config(cfg.cluster)
        try:
            c.put("x", b"0")
            unavailable = 0

            def leader() -> int:  # (ec.leader()'s health read needs no credentials)
                live = [p for i, p in enumerate(ec.client_ports) if ec.alive(i)]
                got = wait_for(lambda: (j := leader_index(live)) is not None and j + 1, 60,
                               "an etcd leader")
                return ec.client_ports.index(live[got - 1])

            for round_ in (1, 2):
                lead = leader()
                ec.kill(lead)
                c._token = "expired.token"  # as after the token's TTL, mid-election
                n = round_

                def written(n: int = n) -> bool:
                    nonlocal unavailable
                    try:
                        c.put("x", str(n).encode())
                    except kvcomm.Unavailable:
                        unavailable += 1
                        return False
                    return True

                wait_for(written, 60, f"a write after leader failover {round_}")
                assert c.get("x").value == str(n).encode()  # type: ignore[union-attr]
                ec._spawn(lead)  # the old leader comes back (its tokens forgotten)
                wait_for(lambda: leader_index(ec.client_ports) is not None, 60,
                         "every member following one leader")
                c._preferred = ec.endpoints.index(ec.endpoints[lead])  # asked first next
                c._token = "expired.token"
                assert c.get("x").value == str(n).encode()  # type: ignore[union-attr]
            print(f"re-authentications {c.stats.reauths}, failovers {c.stats.failovers}, "
                  f"Unavailable while electing {unavailable}")
            assert c.stats.reauths >= 5 and c.stats.failovers >= 2
        finally:
            c.close()


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.mark.etcd
def test_tls_with_ca_certificate_and_key(tmp_path: Path) -> None:
    if not etcd_path() or subprocess.run(["which", "openssl"], capture_output=True).returncode:
        pytest.skip("needs openssl")
    d = tmp_path
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kvc-ca",
             "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"))
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "extendedKeyUsage=clientAuth")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"))
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.pem"),
                 "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-days", "1",
                 "-extfile", str(d / f"{name}.ext"), "-out", str(d / f"{name}.pem"))
    from kvcomm.devcluster.redis_cluster import free_cluster_port

    cport, pport = free_cluster_port(), free_cluster_port()
    argv = member_argv("tls1", str(d / "data"), cport, pport, f"tls1=http://127.0.0.1:{pport}",
                       "tls-test")
    argv = [a.replace(f"http://127.0.0.1:{cport}", f"https://127.0.0.1:{cport}") for a in argv]
    argv += ["--cert-file", str(d / "server.pem"), "--key-file", str(d / "server.key"),
             "--trusted-ca-file", str(d / "ca.pem"), "--client-cert-auth"]
    proc = spawn(argv, d / "etcd.log", detached=False)
    try:
        cfg = kvcomm.Config.from_mapping({"cluster": {
            "etcd": [f"127.0.0.1:{cport}"], "etcd_tls": True, "etcd_ca": str(d / "ca.pem"),
            "etcd_cert": str(d / "client.pem"), "etcd_key": str(d / "client.key")}})
        c = EtcdClient.from_config(cfg.cluster)
        wait_for(lambda: c.put("tls", b"ok") > 0, 30, "etcd over TLS",
                 retry_on=(kvcomm.Unavailable,))
        assert c.get("tls").value == b"ok"  # type: ignore[union-attr]
        c.close()
        # the system CAs do not know our CA: a verification failure is a ConfigError
        plain = EtcdClient([("127.0.0.1", cport)], tls=True)
        with pytest.raises(kvcomm.ConfigError, match="etcd_ca"):
            plain.get("tls")
        plain.close()
        # no client certificate: the server refuses the handshake
        nocert = EtcdClient([("127.0.0.1", cport)], tls=True, ca=str(d / "ca.pem"))
        with pytest.raises((kvcomm.ConfigError, kvcomm.Unavailable)):
            nocert.get("tls")
        nocert.close()
        with pytest.raises(kvcomm.ConfigError, match="etcd_ca"):
            EtcdClient([("127.0.0.1", cport)], tls=True, ca=str(d / "missing.pem"))
        with pytest.raises(kvcomm.ConfigError, match="etcd_cert"):
            EtcdClient([("127.0.0.1", cport)], tls=True, cert=str(d / "ca.key"))
    finally:
        stop([proc])
