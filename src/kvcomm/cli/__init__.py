"""``kvcomm``: thin commands over the public API (``kvcomm --help``; every option is in
docs/cli.md).

    kvcomm demo [--agents N] [--seconds S] [--rate HZ] [--neighbours K]
                [--baseline auto|redis|manager|none] [--plot FILE.png] [--cluster]
                [--name NS] [--config FILE]
    kvcomm info [--name NS] [--config FILE] [--json]
    kvcomm purge --name NS [--config FILE] [--force]
    kvcomm migrate [--name NS] [--config FILE]     an older-layout segment's unflushed writes
    kvcomm migrate --l3-index --config FILE        index L3's older records for kv.scan
    kvcomm config [--show] [--config FILE]
    kvcomm node --config FILE [--name NS]          the host daemon (cluster mode)
    kvcomm dev-cluster up --dir DIR [--hosts N] [--strong PREFIX]... [--proxies] | down --dir DIR
    kvcomm dev-cluster partition --dir DIR --host H [--mode M] | heal --dir DIR
    kvcomm dev-cluster kill-etcd --dir DIR [--leader | --member N] | restart-etcd --dir DIR
    kvcomm cluster status --config FILE [--json] | remove-host --config FILE HOST
    kvcomm jepsen [--hosts N] [--minutes M | --seconds S] [--seed N] [--partitions N] ...
    kvcomm soak [--hosts N] [--minutes M | --seconds S] [--seed N] [--faults K,...] ...
    kvcomm metrics [--name NS] [--port P] [--host ADDR] [--config FILE]
    kvcomm top [--name NS | --config FILE [--cluster]] [--interval S] [--once]
    kvcomm loadtest --scenario swarm|warehouse|hotkeys|penetration [--users N]
                [--seconds S] [--config FILE] [--baseline none|redis] [--redis HOST:PORT] ...
    kvcomm balance --config FILE [--policy threshold|learned] [--window 30s] [--once]
                   [--dry-run]                     load-aware slot balancing of L3
    kvcomm balance simulate|train ...               the slot-balancing simulator
    kvcomm placement observe|plan|launch ...      affinity placement (cli/placement.py)
    kvcomm mcp --name NS | --config FILE [--transport stdio|http] [--host 127.0.0.1 --port P]
               [--token-file F] [--prefix P ...] [--read-only]   an MCP server (kvcomm.mcp)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from collections.abc import Callable
from typing import Any

from .._extras import require_cluster
from ..balance.cli import register_balance_tools
from ..config import load_config
from ..errors import InvalidArgument, KVCommError
from .placement import add_placement


def _info(args: argparse.Namespace) -> int:
    """How much of a namespace's L2 segment is in use, its counters, and its node
    daemon's state."""
    from ..tiers.l2 import L2Segment

    cfg = load_config(args.config)
    c = cfg.cache
    seg = L2Segment(args.name or cfg.node.namespace, create_layout=None,
                    host_id="", directory=c.l2_dir, permissions=c.l2_permissions,
                    lock_timeout=c.lock_timeout)
    try:
        info = seg.info()
    finally:
        seg.close()
    from ..node.presence import (
        masters_down_text,
        read_status,
        starting_status,
        starting_text,
        status_fresh,
    )
    from ..tiers.shm.files import mapped_by, status_path

    st = read_status(status_path(info["name"], c.l2_dir))
    if not status_fresh(st):
        st = None  # (a daemon that died says nothing)
    info["node"] = st
    info["open_by"] = mapped_by(info["path"])
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    used, data = info["used_bytes"], info["data_bytes"]
    assumed = "" if args.name else " (the config's node.namespace; --name NS for another)"
    print(f"namespace      {info['name']}  ({info['path']}, host {info['host_id']}){assumed}")
    print(f"segment        {info['size_bytes'] / 2**20:.1f} MiB, data heap {data / 2**20:.1f} MiB")
    print(f"in use         {used / 2**20:.2f} MiB ({100 * used / data:.1f}%), "
          f"{_count(info['entries'], 'entry', 'entries')} in {info['slots']} slots")
    print(f"memory         {info['reserved_bytes'] / 2**20:.2f} MiB reserved of "
          f"{info['size_bytes'] / 2**20:.1f} MiB (reserved as it fills; held until purged)")
    users = info["open_by"]
    print(f"open by        {_count(len(users), 'process', 'processes')} ({_pids(users)})"
          if users else "open by        no process")
    print(f"evictions      {info['evictions']}  recoveries {info['recoveries']}  "
          f"writer lock taken over from dead processes {info['owner_deaths']}")
    print(f"views pinning  {_count(info['pinned_deferred_blocks'], 'block', 'blocks')} of "
          "replaced values (freed when the views reading them go)")
    print(f"change feed    {_count(info['feed_events'], 'event', 'events')} "
          f"({info['feed_capacity']} kept)")
    if st is not None:
        mode = f"PARTITION MODE ({st.get('partition_reason')})" if st.get("partition") \
            else "connected"
        held = st.get("lease")  # (an int: the file is another process's, it may say anything)
        lease = f"lease {held:x}" if isinstance(held, int) and held > 0 else "no etcd lease"
        etcd = ", etcd unreachable: strong keys fail at once" if st.get("etcd_unreachable") else ""
        print(f"cluster        {mode}; {lease}{etcd}; backlog {st.get('backlog', 0)}, "
              f"feed lag {st.get('feed_lag_s', 0)}s")
        down = masters_down_text(st)
        if down:  # (a partial cut: not partition mode, writes wait)
            print(f"masters down   {down} (not answering; {st.get('parked', 0)} writes of "
                  "their keys parked until they answer)")
    if info["daemon_pid"]:
        state = "alive" if info["daemon_alive"] else "NOT heartbeating"
        if not info["daemon_alive"] and st is not None and st.get("partition") \
                and st.get("pid") == info["daemon_pid"]:  # (its lease thread wrote st)
            state = "alive, in partition mode (its loop waits on Redis timeouts)"
        print(f"node daemon    pid {info['daemon_pid']}, {state}; "
              f"{info['dirty']} writes not yet in L3, {info['set_aside']} set aside")
    starting = starting_status(status_path(info["name"], c.l2_dir))
    if not info["daemon_alive"] and st is None and starting is not None:
        print(f"node daemon    runs, not started: {starting_text(starting)}; "
              f"{info['dirty']} writes waiting for L3")
    elif not info["daemon_alive"] and st is None and (
            cfg.cluster.enabled or info["daemon_pid"] or info["dirty"]):
        # (cluster mode with no daemon: writes are acknowledged into L2 and wait there)
        print(f"no node daemon: {info['dirty']} writes waiting for L3"
              f"{_since_beat(info['daemon_beat_ms'])}; start it: kvcomm node --config "
              f"{args.config or 'FILE'}")
    return 0


def _pids(pids: list[int]) -> str:
    shown = ", ".join(map(str, pids[:8]))
    return f"pid {shown}" + (f" and {len(pids) - 8} more" if len(pids) > 8 else "")


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _since_beat(beat_ms: int) -> str:
    """" (its last heartbeat at HH:MM:SS, N s ago)", or "" when no daemon ever beat."""
    if not beat_ms:
        return " (none has run on this namespace)"
    import time

    at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(beat_ms / 1000))
    return f" (the last daemon's last heartbeat: {at}, {time.time() - beat_ms / 1000:.0f}s ago)"


# the names of a namespace's files that are not its segment (tiers/shm/files.py,
# tiers/shm/oldlayout.py's aside file of a migration under way): `kvcomm list` skips them


def _list(args: argparse.Namespace) -> int:
    """The namespaces whose L2 segments are on this host (in cache.l2_dir): each one's
    size, the memory it holds and its entries. A segment of another KVCOMM layout, or
    one this user may not read, is listed with what stops it being read; it reads 8
    bytes of a regular file to know a segment, and changes nothing. Exit status 0."""
    c = load_config(args.config).cache
    try:
        names = sorted(os.listdir(c.l2_dir))
    except OSError as exc:
        print(f"kvcomm: cannot list {c.l2_dir} (cache.l2_dir): {exc.strerror}", file=sys.stderr)
        return 2
    rows = [row for row in (_segment_row(c, file) for file in names) if row is not None]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    conf = f" --config {shlex.quote(args.config)}" if args.config else ""
    _list_dead_temps(c.l2_dir, conf)
    if not rows:
        print(f"no namespace on this host (no segment in {c.l2_dir}): kvcomm.open(NAME) "
              "creates one")
        return 0
    w = max(9, *(len(r["name"]) for r in rows))
    print(f"{'namespace':<{w}} {'file MiB':>9} {'held MiB':>9} {'entries':>9}  daemon")
    for r in rows:
        sizes = f"{r['name']:<{w}} {r['size_bytes'] / 2**20:9.1f} {r['reserved_bytes'] / 2**20:9.1f}"
        if "unreadable" in r:
            print(f"{sizes}  unreadable: {r['unreadable']}")
        else:
            print(f"{sizes} {r['entries']:9d}  {'alive' if r['daemon_alive'] else '-'}")
    print("(file: the segment's length, mostly unused; held: the memory it takes)")
    print(f"(`kvcomm info --name=NS{conf}` for one in detail, `kvcomm purge --name=NS{conf}` "
          "to remove one)")
    return 0


def _list_dead_temps(directory: str, conf: str) -> None:
    """Say what temporary files killed creators left in ``directory`` (not in --json)."""
    from ..tiers.shm.files import dead_temps

    try:
        dead = dead_temps(directory)
    except OSError:
        return  # (listed a moment ago: gone meanwhile; the caller's listing says so)
    if dead:
        print(f"{len(dead)} temporary file(s) in {directory}, left by processes killed while "
              f"creating a namespace's files,\nhold {sum(n for _p, n in dead) / 2**20:.1f} MiB; "
              f"nobody uses them: `kvcomm purge --dead-temps{conf}` removes them")


def _segment_row(c: Any, file: str) -> dict[str, Any] | None:
    """What `kvcomm list` says of ``file`` in ``c.l2_dir``: None when it is not a
    namespace's segment (or is gone by now)."""
    import stat

    from ..tiers.shm.files import _NAME_RE, SIDE_FILES
    from ..tiers.shm.layout import LAYOUT_VERSION, is_segment_magic

    name = file[len("kvcomm."):]
    if not file.startswith("kvcomm.") or not _NAME_RE.match(name):
        return None
    # (a namespace's other file, or a namespace an earlier version let be named so: only a
    # segment of this layout is the latter; a migration's copy of a segment never is)
    side = SIDE_FILES.search(name)
    if side and side[0].endswith(".migrating"):
        return None
    path = os.path.join(c.l2_dir, file)
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):  # (a FIFO, a socket, a link, a directory: never opened)
        return None
    row: dict[str, Any] = {"name": name, "path": path, "size_bytes": st.st_size,
                           "reserved_bytes": st.st_blocks * 512}
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            head = os.pread(fd, 8, 0)
        finally:
            os.close(fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if side:
            return None
        row["unreadable"] = (f"cannot read it ({exc.strerror}; owner uid {st.st_uid}, mode "
                             f"{oct(stat.S_IMODE(st.st_mode))})")
        return row
    word = int.from_bytes(head, "little") if len(head) == 8 else 0
    if not is_segment_magic(word) or side and word >> 56 != LAYOUT_VERSION:
        return None  # (not a segment: no KVCOMM magic)
    if word >> 56 != LAYOUT_VERSION:  # (its header is not read further: it may lie)
        row["unreadable"] = (f"a segment of KVCOMM layout {word >> 56} (this kvcomm reads "
                             f"{LAYOUT_VERSION}): `kvcomm info --name={name}` says what it holds")
        return row
    try:
        from ..tiers.l2 import L2Segment

        seg = L2Segment(name, create_layout=None, host_id="", directory=c.l2_dir,
                        permissions=c.l2_permissions, lock_timeout=c.lock_timeout,
                        attach_timeout=0)
        try:
            info = seg.info()
        finally:
            seg.close()
        row.update(entries=info["entries"], daemon_alive=info["daemon_alive"])
    except Exception as exc:  # (listed all the same, with why it cannot be read)
        if not os.path.lexists(path):
            return None  # (purged meanwhile)
        row["unreadable"] = str(exc)
    return row


def _purge(args: argparse.Namespace) -> int:
    """Remove a namespace's L2 segment. It refuses a segment that holds writes not yet in
    L3 (of this layout or an older one) unless --force. Exit status 0: removed; 1: there
    was none; 2: it could not be removed, or was refused (the message says why). With
    --dead-temps instead of --name: remove every temporary file a killed creator left
    (exit status 0; 2 when cache.l2_dir cannot be read)."""
    from ..tiers.l2 import purge, segment_path
    from ..tiers.shm.files import dead_temps, mapped_by

    name = args.name
    if name is None and not args.dead_temps:
        print("kvcomm purge: give --name NS (the namespace to remove) or --dead-temps",
              file=sys.stderr)
        return 2
    directory = load_config(args.config).cache.l2_dir
    if args.dead_temps:
        if args.force:
            print("kvcomm purge: --force is for --name (a segment holding writes not yet in "
                  "L3); --dead-temps removes only files nobody uses", file=sys.stderr)
            return 2
        try:
            gone = dead_temps(directory, remove=True)
        except OSError as exc:
            print(f"kvcomm: cannot list {directory} (cache.l2_dir): {exc.strerror}",
                  file=sys.stderr)
            return 2
        print(f"removed {len(gone)} temporary file(s) left by killed creators in {directory}, "
              f"{sum(n for _p, n in gone) / 2**20:.1f} MiB held")
        return 0
    try:
        users = mapped_by(segment_path(name, directory))
        removed = purge(name, directory, keep_unflushed=not args.force)
    except KVCommError as exc:
        print(f"kvcomm: cannot purge namespace {name!r}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvcomm: cannot purge namespace {name!r}: {_purge_os_advice(name, exc)}",
              file=sys.stderr)
        return 2
    except Exception as exc:  # the one command that must work whatever the file holds
        path = segment_path(name, directory)
        print(f"kvcomm: cannot purge namespace {name!r}: {path} could not be read as a segment "
              f"({type(exc).__name__}: {exc}); if no process uses it, remove it by hand "
              f"(rm {path}) and report this as a bug", file=sys.stderr)
        return 2
    if removed:
        print(f"purged namespace {name!r}")
        if users:
            print(f"kvcomm: {_count(len(users), 'process', 'processes')} had it open "
                  f"({_pids(users)}): their next call raises SegmentError; to go on, each "
                  f"opens the namespace again (kvcomm.open), which makes a new, empty segment",
                  file=sys.stderr)
        return 0
    conf = f" --config {shlex.quote(args.config)}" if args.config else ""
    print(f"kvcomm: no L2 segment for namespace {name!r} on this host (its other files, if "
          f"any, were removed); `kvcomm list{conf}` lists the namespaces there are",
          file=sys.stderr)
    return 1


def _migrate(args: argparse.Namespace) -> int:
    """Carry the writes not yet in L3 of a namespace's segment of an older layout into a
    new segment (stop the old segment's users first). Exit status 0: done or nothing to
    do; 2: it failed (the old segment is left as it was; the message says why)."""
    from ..tiers.shm.migrate import migrate

    cfg = load_config(args.config)
    if args.l3_index:
        return _migrate_l3_index(cfg)
    name = args.name or cfg.node.namespace
    try:
        done = migrate(name, cfg)
    except (KVCommError, OSError) as exc:
        print(f"kvcomm: cannot migrate namespace {name!r}: {exc}", file=sys.stderr)
        return 2
    if not done.from_version:
        print(f"namespace {name!r} has no segment of an older layout: nothing to migrate")
        return 0
    print(f"migrated namespace {name!r} from layout {done.from_version}: {done.carried} "
          f"writes carried (the node daemon delivers them), {done.superseded} already "
          "superseded by newer writes")
    return 0


def _migrate_l3_index(cfg: Any) -> int:
    """Index every record of L3 for prefix scans (L3Store.backfill_index; the node daemons
    do it once by themselves). Exit status 0: done; 2: it failed (run it again)."""
    from ..tiers.l3 import L3Store

    if not cfg.cluster.enabled:
        print("kvcomm: --l3-index needs a config with cluster.redis", file=sys.stderr)
        return 2
    try:
        l3 = L3Store.from_config(cfg.cluster)
        try:
            n = l3.backfill_index()
        finally:
            l3.close()
    except KVCommError as exc:
        print(f"kvcomm: the L3 key index backfill failed: {exc}; run it again", file=sys.stderr)
        return 2
    print(f"L3 key index backfilled: {n} records looked at")
    return 0


def _purge_os_advice(name: str, exc: OSError) -> str:
    """What went wrong removing a segment, and what the user can do about it."""
    import errno
    import pwd

    path = exc.filename or "the segment file"
    if exc.errno == errno.EISDIR or isinstance(exc, IsADirectoryError):
        return (f"{path} is a directory, not a kvcomm segment; nothing was removed: "
                f"remove it by hand (rm -r {path}) if nothing else uses it")
    if isinstance(exc, PermissionError):
        try:
            uid = os.lstat(path).st_uid
            owner = f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
        except (OSError, KeyError):
            owner = "another user"
        return (f"permission denied on {path}, which belongs to {owner}: run "
                f"`kvcomm purge --name {name}` as that user or as root")
    return f"{path}: {exc.strerror or exc}; check that path and run the command again"


def _config(args: argparse.Namespace) -> int:
    """Print the effective config as YAML that loads back to the same config
    (secrets shown as a comment, never their value)."""
    print(load_config(args.config).to_yaml(), end="")
    return 0


def _node(args: argparse.Namespace) -> int:
    """The host's node daemon: keeps the host's L2 and the Redis Cluster (L3) in sync
    until SIGTERM or SIGINT. Needs pip install 'kvcomm[cluster]'."""
    from ..node.daemon import main as node_main

    cfg = load_config(args.config)
    if cfg.cluster.redis:  # (without it, the daemon says what is missing from the config)
        require_cluster("kvcomm node")
    return node_main(cfg, args.name)


def _dev_cluster(args: argparse.Namespace) -> int:
    """A whole cluster on this machine (kvcomm.devcluster): a Redis Cluster of 3
    masters and 3 replicas and a 3-member etcd cluster on free loopback ports, and one
    node daemon per simulated host. `up` writes DIR/host-N.yaml, the config agents of
    host N open; `down` stops it all and removes the hosts' L2 segments. Faults:
    `partition` cuts a host off from Redis and etcd (needs `up --proxies`) until `heal`;
    `kill-etcd` and `restart-etcd` kill and bring back etcd members. Needs redis-server,
    redis-cli, etcd (Debian: etcd-server) and pip install 'kvcomm[cluster]'."""
    from .. import devcluster
    from ..devcluster import control

    a = args.action
    if a == "up":
        state = devcluster.up(args.hosts, args.dir, strong_prefixes=args.strong or (),
                              proxies=args.proxies)
        print(f"Redis Cluster: {' '.join(state['redis'])}")
        print(f"etcd: {' '.join(f'127.0.0.1:{p}' for p in state['etcd']['client_ports'])}")
        for h in state["hosts"]:
            via = " (through its fault proxy)" if h.get("proxy") else ""
            print(f"{h['host']}: daemon pid {h['pid']}, agents open "
                  f"kvcomm.open(config={h['config']!r}){via}, metrics at {h['metrics']}")
        return 0
    if a == "down":
        if devcluster.down(args.dir):
            print(f"dev cluster in {args.dir} stopped")
            return 0
        print(f"no dev cluster in {args.dir}", file=sys.stderr)
        return 1
    if a == "partition":
        if not args.host:
            raise InvalidArgument("partition needs --host HOST (e.g. --host host-2)")
        st = control.partition(args.dir, args.host, args.mode, args.delay)
        if args.mode == "drop":
            print(f"{args.host}: {st['dropped_now']} live connections reset")
        else:
            print(f"{args.host}: {st['mode']}" + (f" {st['delay_ms']:g} ms" if args.mode == "delay"
                                                  else "") + " until `dev-cluster heal`")
        return 0
    if a == "heal":
        healed = control.heal(args.dir, args.host)
        print(f"healed: {', '.join(healed) or 'nothing (no host has a fault proxy)'}")
        return 0
    if a == "kill-etcd":
        if args.leader and args.member is not None:
            raise InvalidArgument("kill-etcd takes --leader or --member N, not both")
        member = None if args.member is None else args.member - 1
        killed = control.kill_etcd(args.dir, member, leader=args.leader)
        print(f"etcd member {killed + 1} killed" + (" (it was the leader)" if args.leader else ""))
        return 0
    member = None if args.member is None else args.member - 1
    restarted = control.restart_etcd(args.dir, member)
    print(f"etcd members restarted: {', '.join(str(i + 1) for i in restarted) or 'none'}; "
          "the cluster is healthy")
    return 0


def _cluster(args: argparse.Namespace) -> int:
    """The cluster as etcd sees it. `status`: every host, its lease (live, expired,
    stopped), whether it is in partition mode, its outbound backlog (writes not yet in
    L3) and feed lag, as its daemon last published them. `remove-host HOST`: retire a
    host that will not come back: revoke its lease, delete its records in etcd and its
    feed cursors, hot keys and quarantine list in L3. Its backlog lives in its own L2:
    run its daemon once (it flushes on SIGTERM) before removing it if it can still run.
    A host whose lease is live is refused (its daemon runs) unless --force."""
    from ..node.presence import cluster_status, masters_down_text, remove_host
    from ..tiers.etcd import EtcdClient

    cfg = load_config(args.config)
    if not cfg.cluster.etcd:
        raise InvalidArgument("kvcomm cluster needs cluster.etcd in the config (the etcd members)")
    with EtcdClient.from_config(cfg.cluster) as etcd:
        if args.action == "status":
            hosts = cluster_status(etcd)
            for h in hosts:
                _known_backlog(h, cfg, args.config)
            if args.json:
                print(json.dumps({"hosts": hosts}, indent=2))
                return 0
            print(f"{'host':<16} {'lease':<18} {'partition':<9} {'backlog':>8} {'feed lag':>9} "
                  "masters down")
            for h in hosts:
                backlog = h["backlog"] if h["backlog_known"] else f"{h['backlog']}?"
                print(f"{h['host']:<16} {h['lease']:<18} {'yes' if h['partition'] else 'no':<9} "
                      f"{backlog:>8} {h['feed_lag_s']:>8.2f}s "
                      f"{masters_down_text(h) or '-'}")
                if h["daemon"] != "running":
                    print(f"{'':<16} {h['note']}")
            return 0
        found = remove_host(etcd, args.host, force=args.force)
    l3_keys = 0
    if cfg.cluster.redis:
        require_cluster("kvcomm cluster remove-host")
        from ..tiers.l3 import L3Store

        cl = cfg.cluster
        store = L3Store.from_config(cl)
        try:
            l3_keys = store.forget_host(args.host)
        finally:
            store.close()
    last = found.get("last_status") or {}
    print(f"{args.host}: lease {'revoked' if found['lease_revoked'] else 'already gone'}, "
          f"{found['keys_deleted']} etcd records and {l3_keys} L3 records deleted; its "
          f"last published backlog was {last.get('backlog', 'unknown')} writes")
    return 0


def _known_backlog(h: dict[str, Any], cfg: Any, config_file: str) -> None:
    """Add to ``h`` (a host of ``cluster_status``) what is known of its daemon and its
    backlog, and since when: ``daemon`` ("running": its lease is live and, on this host,
    it heartbeats; "gone": its lease was revoked or expired, or its heartbeat stopped),
    ``daemon_gone_since`` (epoch s: its last report in etcd, or its last heartbeat in
    this host's L2), ``backlog_known`` (False: the backlog is the last one its daemon
    published, and writes made since are not counted), ``note`` (for the table).

    On the host itself (the config's ``node.host_id``), the host's L2 says more than
    etcd: ``backlog`` is then its count of writes waiting for L3 (``backlog_source``
    "l2"), whatever the daemon last published."""
    import time

    now = time.time()
    updated = h.get("updated")
    reported = float(updated) if isinstance(updated, (int, float)) and not isinstance(
        updated, bool) and math.isfinite(updated) else None
    live = h["lease"].startswith("live")
    h.update(daemon="running" if live else "gone", backlog_known=live,
             backlog_source="etcd", daemon_gone_since=None if live else reported, note="")
    local = _local_l2(cfg) if h["host"] == cfg.node.host_id else None
    if local is not None:
        h.update(backlog=local["dirty"], backlog_known=True, backlog_source="l2")
        if not local["daemon_alive"] and not local["status_fresh"]:
            beat = local["daemon_beat_ms"] / 1000 or None
            h.update(daemon="gone", daemon_gone_since=beat or reported)
    if h["daemon"] == "running":
        return
    since = h["daemon_gone_since"]
    when = "at an unknown time" if since is None else (
        f"since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))} "
        f"({max(0.0, now - since):.0f}s ago)")
    if local is not None:
        h["note"] = (f"no node daemon {when}: {h['backlog']} writes waiting for L3 in this "
                     f"host's L2 (start it: kvcomm node --config {config_file})")
    else:
        h["note"] = (f"no node daemon {when}: backlog {h['backlog']} is its last report "
                     "to etcd; writes made on the host since are not counted (kvcomm info "
                     "there says)")


def _local_l2(cfg: Any) -> dict[str, Any] | None:
    """This host's L2 segment of the config's namespace: its ``info()`` and whether its
    daemon's status file is fresh (``status_fresh``: its lease thread writes it while
    the loop waits on Redis, in partition mode), or None when there is no segment (or
    it cannot be read)."""
    from ..node.presence import read_status, status_fresh
    from ..tiers.l2 import L2Segment
    from ..tiers.shm.files import status_path

    c = cfg.cache
    try:
        seg = L2Segment(cfg.node.namespace, create_layout=None, host_id="", directory=c.l2_dir,
                        permissions=c.l2_permissions, lock_timeout=c.lock_timeout,
                        attach_timeout=0)
    except (KVCommError, OSError):
        return None
    try:
        info = seg.info()
    finally:
        seg.close()
    info["status_fresh"] = status_fresh(read_status(status_path(info["name"], c.l2_dir)))
    return info


def _soak(args: argparse.Namespace) -> int:
    """Brings up a dev cluster, runs agents on every host and a seeded nemesis
    injecting faults, then checks the recorded history: exit 0 only when nothing
    acknowledged was lost. Needs redis-server and pip install 'kvcomm[cluster]'."""
    from ..faults import soak

    require_cluster("kvcomm soak")
    opts: dict[str, object] = {
        "hosts": args.hosts, "seconds": args.seconds if args.seconds else args.minutes * 60,
        "seed": args.seed, "directory": args.dir, "workers": args.workers, "rate": args.rate,
        "faults": [f for f in args.faults.split(",") if f] if args.faults else None,
        "shared_deletes": not args.no_shared_deletes, "strict_reads": args.strict_reads,
        "converge_timeout": args.converge_timeout, "counter_keys": args.counter_keys}
    if args.quiet:
        opts["log"] = lambda line: None
    return soak.main(opts, as_json=args.json)


def _jepsen(args: argparse.Namespace) -> int:
    """The soak (see `kvcomm soak --help`) turned on strong keys: CLIENTS processes per
    host doing get/put/compare-and-set/update/delete with unique values on a handful of
    strong keys while the nemesis partitions hosts, kills and pauses etcd members (the
    leader included) and drops connections; the recorded history is checked by the
    linearizability checker (kvcomm.faults.linearizability), the eventual keys as the
    soak checks them (nothing acknowledged lost, every host converged), and every
    partition's heal -> convergence time is measured (p50, p99). Exit 0 only when all
    of it holds. Needs redis-server, etcd and pip install 'kvcomm[cluster]'."""
    from ..faults import soak

    require_cluster("kvcomm jepsen")
    opts: dict[str, object] = {
        "hosts": args.hosts, "seconds": args.seconds if args.seconds else args.minutes * 60,
        "seed": args.seed, "directory": args.dir, "workers": args.workers,
        "rate": args.rate, "strong_clients": args.clients, "strong_keys": args.strong_keys,
        "faults": [f for f in args.faults.split(",") if f] if args.faults else None,
        "converge_timeout": args.converge_timeout, "partitions": args.partitions}
    if args.quiet:
        opts["log"] = lambda line: None
    return soak.jepsen_main(opts, as_json=args.json)


def _demo(args: argparse.Namespace) -> int:
    """A drone swarm flying on KVCOMM, then the same swarm on a central store; prints
    latencies side by side. Needs pip install 'kvcomm[demo]'."""
    from .demo import run_demo

    return run_demo(args)


def _mcp(args: argparse.Namespace) -> int:
    """Serve the namespace to MCP clients (Claude and other LLM runtimes, tools in any
    language): the tools kv_get, kv_put, kv_delete, kv_scan, kv_watch, kv_incr, kv_present
    and kv_announce, over stdio (the default: the client starts this command) or
    streamable HTTP (at http://HOST:PORT/mcp). HTTP binds loopback by default; any other
    address needs --token-file (clients send 'Authorization: Bearer <token>'). Logs go to
    stderr, never stdout. Needs pip install 'kvcomm[mcp]'."""
    from .._extras import require

    require("mcp", extra="mcp", purpose="kvcomm mcp")
    from ..mcp.server import check_http_binding, serve

    if not args.name and not args.config:
        raise InvalidArgument("mcp needs --name NS (the namespace to serve) or --config "
                              "FILE (a host config: its node.namespace)")
    token = None
    if args.transport == "http":
        token = check_http_binding(args.host, args.token_file)
    elif args.token_file:
        raise InvalidArgument("--token-file is for --transport http (stdio needs none: only the "
                              "process that started the server can talk to it)")
    for p in args.prefix or ():
        if not p:
            raise InvalidArgument("--prefix takes a non-empty key prefix such as 'tasks/' (no "
                                  "--prefix at all serves every key)")
    from .._client import open as kv_open

    kv = kv_open(args.name, config=args.config, agent=None)
    try:
        return serve(kv, prefixes=args.prefix or [], read_only=args.read_only,
                     transport=args.transport, host=args.host, port=args.port, token=token)
    finally:
        kv.close()


def _command(sub: Any, name: str, run: Callable[[argparse.Namespace], int],
             summary: str) -> argparse.ArgumentParser:
    """The subcommand ``name``: ``summary`` in ``kvcomm --help``, and ``run``'s docstring
    (written for users, then) as ``kvcomm NAME --help``'s description; ``run(args)``
    returns the exit status."""
    parser: argparse.ArgumentParser = sub.add_parser(name, help=summary, description=run.__doc__)
    parser.set_defaults(func=run)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command; each option has its help (docs/cli.md)."""
    p = argparse.ArgumentParser(
        prog="kvcomm", description="KVCOMM: shared memory for agents. "
        "Run `kvcomm COMMAND --help` for the options of a command.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = _command(sub, "demo", _demo, "drone swarm on the embedded default, against a central store")
    d.add_argument("--agents", type=int, default=16, metavar="N",
                   help="drone processes, at least 2 (default 16)")
    d.add_argument("--seconds", type=float, default=8.0, metavar="S",
                   help="flight time per run (default 8)")
    d.add_argument("--rate", type=float, default=50.0, metavar="HZ",
                   help="state updates per second per drone (default 50)")
    d.add_argument("--neighbours", type=int, default=8, metavar="K",
                   help="states read per tick (default 8)")
    d.add_argument("--baseline", choices=["auto", "redis", "manager", "none"], default="auto",
                   help="central store to compare with (auto: Redis if redis-server and "
                   "kvcomm[cluster] are installed, else a multiprocessing manager)")
    d.add_argument("--plot", metavar="FILE.png",
                   help="write a latency plot (needs pip install 'kvcomm[plot]')")
    d.add_argument("--cluster", action="store_true",
                   help="3 hosts on a local Redis Cluster, against every agent on Redis "
                   "Cluster (needs redis-server and kvcomm[cluster])")
    d.add_argument("--name", default="demo", metavar="NS",
                   help="L2 namespace to use (purged before and after; default demo)")
    d.add_argument("--config", metavar="FILE", help="a kvcomm YAML config (default: built-in defaults)")

    i = _command(sub, "info", _info, "show a namespace's L2 segment use")
    i.add_argument("--name", metavar="NS",
                   help="the namespace (default: node.namespace of the config)")
    i.add_argument("--config", metavar="FILE",
                   help="a kvcomm YAML config (for cache.l2_dir and the namespace)")
    i.add_argument("--json", action="store_true", help="print every field as JSON")

    ls = _command(sub, "list", _list, "list this host's namespaces (their L2 segments)")
    ls.add_argument("--config", metavar="FILE", help="a kvcomm YAML config (for cache.l2_dir)")
    ls.add_argument("--json", action="store_true", help="print every field as JSON")

    u = _command(sub, "purge", _purge, "remove a namespace's L2 segment")
    what = u.add_mutually_exclusive_group()  # (one of them: _purge says so)
    what.add_argument("--name", metavar="NS", help="the namespace to remove")
    what.add_argument("--dead-temps", action="store_true",
                      help="remove the temporary files that processes killed while creating a "
                      "namespace's files left (`kvcomm list` shows them); nobody uses them")
    u.add_argument("--config", metavar="FILE", help="a kvcomm YAML config (for cache.l2_dir)")
    u.add_argument("--force", action="store_true",
                   help="remove it even if it holds writes not yet in L3 (they are lost)")

    mg = _command(sub, "migrate", _migrate,
                  "carry an older-layout segment's writes not yet in L3 into a new segment")
    mg.add_argument("--name", metavar="NS", help="the namespace (default: the config's)")
    mg.add_argument("--config", metavar="FILE",
                    help="a kvcomm YAML config (the new segment's sizes, host id, l2_dir)")
    mg.add_argument("--l3-index", action="store_true",
                    help="instead: index every record of L3 for prefix scans (kv.scan), once "
                         "after an upgrade (node daemons do it by themselves at start)")

    n = _command(sub, "node", _node, "run the host daemon (cluster mode)")
    n.add_argument("--config", required=True, metavar="FILE",
                   help="the host's YAML config (cluster.redis set)")
    n.add_argument("--name", metavar="NS",
                   help="L2 namespace (default: node.namespace from the config)")

    dc = _command(sub, "dev-cluster", _dev_cluster,
                  "a local Redis Cluster + etcd + one daemon per host, and its faults")
    dc.add_argument("action", choices=["up", "down", "partition", "heal", "kill-etcd",
                                       "restart-etcd"],
                    help="up: start it and wait until every daemon heartbeats; down: stop it; "
                    "partition: cut --host off from Redis and etcd; heal: end every partition; "
                    "kill-etcd: SIGKILL an etcd member; restart-etcd: bring killed members back")
    dc.add_argument("--hosts", type=int, default=3, metavar="N",
                    help="simulated hosts, 1 to 32 (up only; default 3)")
    dc.add_argument("--dir", required=True, metavar="DIR",
                    help="where its configs, logs and state (cluster.json) live")
    dc.add_argument("--strong", action="append", metavar="PREFIX",
                    help="a key prefix for every host's cache.strong_prefixes (up only; repeatable)")
    dc.add_argument("--proxies", action="store_true",
                    help="route each host through its own fault proxy, so that it can be "
                    "partitioned (up only)")
    dc.add_argument("--host", metavar="HOST",
                    help="the host to partition (partition; heal: only this one)")
    dc.add_argument("--mode", choices=["blackhole", "delay", "drop"], default="blackhole",
                    help="partition: blackhole (default: nothing flows), delay (every chunk "
                    "--delay ms late) or drop (reset every live connection once)")
    dc.add_argument("--delay", type=float, default=100.0, metavar="MS",
                    help="milliseconds added by --mode delay (default 100)")
    dc.add_argument("--leader", action="store_true",
                    help="kill-etcd: kill the member that leads now")
    dc.add_argument("--member", type=int, metavar="N",
                    help="kill-etcd / restart-etcd: member N (1 to 3); default: the first "
                    "member running / every member down")

    sk = _command(sub, "soak", _soak,
                  "a dev cluster under a random workload and a nemesis: is anything "
                  "acknowledged lost?")
    sk.add_argument("--hosts", type=int, default=3, metavar="N",
                    help="simulated hosts (default 3)")
    sk.add_argument("--minutes", type=float, default=10.0, metavar="M",
                    help="workload time in minutes (default 10)")
    sk.add_argument("--seconds", type=float, metavar="S",
                    help="workload time in seconds (over --minutes)")
    sk.add_argument("--seed", type=int, metavar="N",
                    help="replay the run of this seed (default: a random seed, printed)")
    sk.add_argument("--faults", metavar="KIND,...",
                    help="comma-separated fault kinds (default: all; docs/cli.md)")
    sk.add_argument("--dir", metavar="DIR",
                    help="keep the cluster's logs, histories and report here (default: a "
                    "temporary directory, removed after a clean run)")
    sk.add_argument("--workers", type=int, default=2, metavar="N",
                    help="agent processes per host (default 2)")
    sk.add_argument("--rate", type=float, default=50.0, metavar="HZ",
                    help="operations per second per agent (default 50)")
    sk.add_argument("--no-shared-deletes", action="store_true",
                    help="agents never delete keys other hosts write")
    sk.add_argument("--counter-keys", type=int, default=8, metavar="N",
                    help="counters every agent kv.incr's (default 8; 0: none); the final "
                    "value must be the sum of the acknowledged increments")
    sk.add_argument("--strict-reads", action="store_true",
                    help="a stale read of an agent's own key fails the run too")
    sk.add_argument("--converge-timeout", type=float, default=60.0, metavar="S",
                    help="seconds to wait for every host to agree with L3 (default 60)")
    sk.add_argument("--json", action="store_true", help="print the whole report as JSON")
    sk.add_argument("--quiet", action="store_true", help="no progress lines on stderr")

    cl = _command(sub, "cluster", _cluster, "hosts, leases and partition mode (cluster mode)")
    actions = cl.add_subparsers(dest="action", required=True, metavar="ACTION",
                                help="status: list the hosts; remove-host HOST: retire one")
    st = actions.add_parser("status", help="list the hosts, their leases, partition mode, "
                            "backlog and feed lag",
                            description="Every host etcd knows: its lease (live, expired, "
                            "stopped), partition mode, outbound backlog, feed lag and the Redis "
                            "masters it cannot reach (a partial cut), as each "
                            "daemon last published them; a table, or JSON with --json.")
    st.add_argument("--json", action="store_true",
                    help='as JSON: {"hosts": [{"host", "lease", "partition", "backlog", '
                    '"feed_lag_s", "masters_down"}]}')
    rm = actions.add_parser("remove-host", help="retire a host that will not come back",
                            description="Retire a host that will not come back: revoke its "
                            "lease, delete its etcd records, its feed cursors, hot keys and "
                            "quarantine list in L3. Its unflushed backlog lives in its own L2: "
                            "SIGTERM its daemon first, if it can still run.")
    rm.add_argument("host", metavar="HOST", help="the host id (node.host_id)")
    rm.add_argument("--force", action="store_true",
                    help="retire it even though its lease is live (its daemon runs: it "
                    "registers again at its next beat unless it stays cut off)")
    for q in (st, rm):
        q.add_argument("--config", required=True, metavar="FILE",
                       help="a host's kvcomm YAML config (its cluster.etcd and cluster.redis)")

    jp = _command(sub, "jepsen", _jepsen, "strong keys under partitions and etcd faults: is "
                  "the history linearizable, is anything acknowledged lost?")
    jp.add_argument("--hosts", type=int, default=3, metavar="N", help="simulated hosts (default 3)")
    jp.add_argument("--minutes", type=float, default=5.0, metavar="M",
                    help="workload time in minutes (default 5)")
    jp.add_argument("--seconds", type=float, metavar="S", help="workload time in seconds")
    jp.add_argument("--seed", type=int, metavar="N", help="replay the faults of this seed")
    jp.add_argument("--clients", type=int, default=3, metavar="N",
                    help="strong-key clients per host (default 3)")
    jp.add_argument("--strong-keys", type=int, default=5, metavar="N",
                    help="strong keys they share (default 5)")
    jp.add_argument("--workers", type=int, default=1, metavar="N",
                    help="eventual-key agent processes per host (default 1)")
    jp.add_argument("--rate", type=float, default=30.0, metavar="HZ",
                    help="eventual operations per second per agent (default 30)")
    jp.add_argument("--faults", metavar="KIND,...", help="fault kinds (default: "
                    "partition-host, kill-etcd-member, pause-etcd-member, drop-connections)")
    jp.add_argument("--partitions", type=int, default=0, metavar="N",
                    help="first N partition-host faults in a row (partition, both sides keep "
                    "writing, heal, heal -> convergence measured): the count healed and "
                    "converged, p50 and p99; the run fails with fewer (default 0)")
    jp.add_argument("--dir", metavar="DIR", help="keep logs, histories and report here")
    jp.add_argument("--converge-timeout", type=float, default=60.0, metavar="S",
                    help="seconds to wait for every host to agree with L3 (default 60)")
    jp.add_argument("--json", action="store_true", help="print the whole report as JSON")
    jp.add_argument("--quiet", action="store_true", help="no progress lines on stderr")

    from .operate import add_commands

    add_commands(sub, _command)  # metrics, top, loadtest
    register_balance_tools(sub)  # kvcomm balance [simulate|train] (kvcomm.balance.cli)
    add_placement(sub, _command)  # kvcomm placement observe | plan | launch

    m = _command(sub, "mcp", _mcp, "serve the namespace to MCP clients (LLM agents, any language)")
    m.add_argument("--name", metavar="NS", help="the namespace (default: node.namespace of --config)")
    m.add_argument("--config", metavar="FILE",
                   help="a kvcomm YAML config (a host config in cluster mode)")
    m.add_argument("--transport", choices=["stdio", "http"], default="stdio",
                   help="stdio (default: the MCP client starts this command) or http "
                   "(streamable HTTP at http://HOST:PORT/mcp)")
    m.add_argument("--host", default="127.0.0.1",
                   help="http: the address to bind (default 127.0.0.1; any other needs --token-file)")
    m.add_argument("--port", type=int, default=8765, metavar="P", help="http: the port (default 8765)")
    m.add_argument("--token-file", metavar="F",
                   help="http: a file holding the bearer token every request must carry "
                   "(Authorization: Bearer <token>)")
    m.add_argument("--prefix", action="append", metavar="P",
                   help="serve only keys starting with P (repeatable; keys stay absolute; "
                   "default: every key)")
    m.add_argument("--read-only", action="store_true",
                   help="serve the read tools only (kv_get, kv_scan, kv_watch, kv_present)")

    c = _command(sub, "config", _config, "print the effective config")
    c.add_argument("--show", action="store_true",
                   help="print it (the one action, also without --show)")
    c.add_argument("--config", metavar="FILE",
                   help="a kvcomm YAML config (default: built-in defaults)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # (argparse's own error, with what a namespace given bare should have been)
        bare = len(extra) == 1 and not extra[0].startswith("-") \
            and getattr(args, "name", "") is None  # (a command of a --name not given)
        parser.error(f"unrecognized arguments: {' '.join(extra)}"
                     + (f" (a namespace is named with --name {extra[0]})" if bare else ""))
    try:
        return int(args.func(args))
    except KVCommError as exc:
        print(f"kvcomm: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # (another pipe, a socket: a real error)
        # (its output piped into a reader that stopped, `| head`: done, quietly)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (no error at exit)
        return 1


def _stdout_closed() -> bool:
    """Whether nothing reads stdout any more (the read end of its pipe is closed)."""
    import select

    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _fd, ev in poll.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


if __name__ == "__main__":
    sys.exit(main())
