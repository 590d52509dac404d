"""``kvcomm top``: a live terminal view of a host (its L2's metrics) or of every host the
cluster knows (their exporters). Plain text through rich: works over SSH and in narrow
terminals (tables shrink, columns wrap), and ``--once`` prints a single frame."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..errors import KVCommError
from ..metrics.collector import Snapshot
from ..metrics.snapshot import View, quantile


def _us(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f}µs"
    return f"{seconds * 1e3:.1f}ms"


def _n(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.1f}M"
    if x >= 1e4:
        return f"{x / 1e3:.0f}k"
    if x >= 100:
        return f"{x:.0f}"
    return f"{x:.1f}" if x else "0"


def _pct(num: float, den: float) -> str:
    return f"{100 * num / den:.1f}%" if den else "-"


def host_frame(v: View, title: str) -> Any:
    """The renderable of one host: tiers, the node, hot keys."""
    from rich.console import Group
    from rich.table import Table

    R = "kvcomm_reads_total"
    tiers = Table(title=title, title_justify="left", expand=False, pad_edge=False)
    for col, just in (("tier", "left"), ("reads/s", "right"), ("hit", "right"),
                      ("p50", "right"), ("p99", "right")):
        tiers.add_column(col, justify=just)  # type: ignore[arg-type]
    for tier, results in (("l1", ("hit", "miss")), ("l2", ("hit", "miss", "absent")),
                          ("l3", ("hit", "absent"))):
        total = sum(v.rate(R, tier=tier, result=r) for r in results)
        hit_rate = _pct(*v.hit_rate(tier))  # (over the interval, as the rates)
        h = v.histo("get", tier)
        tiers.add_row(tier.upper(), _n(total), hit_rate, _us(quantile(h, 0.5)),
                      _us(quantile(h, 0.99)))
    W = "kvcomm_writes_total"
    puts = v.rate(W, kind="put")
    h = v.histo("put", "l2")
    tiers.add_row("put", _n(puts), "", _us(quantile(h, 0.5)), _us(quantile(h, 0.99)))
    tiers.add_row("delete", _n(v.rate(W, kind="delete")), "", "", "")
    node = Table(show_header=False, box=None, pad_edge=False)
    node.add_column("what")
    node.add_column("value", justify="right")
    s = v.new
    used, cap = s.value("kvcomm_l2_bytes"), s.value("kvcomm_l2_capacity_bytes")
    node.add_row("L2 in use", f"{used / 2**20:.1f}/{cap / 2**20:.0f} MiB ({_pct(used, cap)}), "
                 f"{int(s.value('kvcomm_l2_entries'))} entries")
    node.add_row("evictions/s", _n(v.rate("kvcomm_l2_evictions_total")))
    node.add_row("daemon", "up" if s.value("kvcomm_daemon_up") else "down")
    node.add_row("backlog (to L3)", str(int(s.value("kvcomm_outbound_backlog"))))
    node.add_row("feed lag local/cluster", f"{int(s.value('kvcomm_feed_lag_events', feed='local'))}"
                 f"/{int(s.value('kvcomm_feed_lag_events', feed='cluster'))}")
    node.add_row("window in/out /s", f"{_n(v.rate('kvcomm_window_writes_total', side='in'))}"
                 f"/{_n(v.rate('kvcomm_window_writes_total', side='out'))}")
    node.add_row("L3 cmds/s, KiB/s out/in",
                 f"{_n(v.rate('kvcomm_l3_commands_total'))}, "
                 f"{_n(v.rate('kvcomm_l3_bytes_total', direction='sent') / 1024)}/"
                 f"{_n(v.rate('kvcomm_l3_bytes_total', direction='received') / 1024)}")
    node.add_row("guards filter/negative /s",
                 f"{_n(v.rate('kvcomm_guard_answers_total', guard='filter'))}/"
                 f"{_n(v.rate('kvcomm_guard_answers_total', guard='negative'))}")
    node.add_row("errors/s", _n(v.rate("kvcomm_errors_total")))
    parts: list[Any] = [tiers, node]
    if s.hot:
        hot = Table(title="hot keys", title_justify="left", show_header=False, box=None,
                    pad_edge=False)
        hot.add_column("key", overflow="ellipsis", no_wrap=True, max_width=48)
        hot.add_column("reads", justify="right")
        for key, n in s.hot[:10]:
            hot.add_row(key, str(int(n)))
        parts.append(hot)
    return Group(*parts)


def cluster_frame(views: list[tuple[str, str, View | None]]) -> Any:
    """The renderable of every host: one row each."""
    from rich.table import Table

    t = Table(title="hosts", title_justify="left", pad_edge=False)
    for col in ("host", "state", "reads/s", "L1 hit", "L2 hit", "p99 get", "puts/s", "backlog",
                "lag"):
        t.add_column(col, justify="left" if col in ("host", "state") else "right")
    R = "kvcomm_reads_total"
    for host, state, v in views:
        if v is None:
            t.add_row(host, state, *["-"] * 7)
            continue
        s = v.new
        h = v.histo("get", "l2") or v.histo("get", "l1")
        t.add_row(host, state, _n(v.rate(R, tier="l1")),
                  _pct(*v.hit_rate("l1")), _pct(*v.hit_rate("l2")),
                  _us(quantile(h, 0.99)), _n(v.rate("kvcomm_writes_total", kind="put")),
                  str(int(s.value("kvcomm_outbound_backlog"))),
                  str(int(s.value("kvcomm_feed_lag_events"))))
    return t


def run(snapshot: Callable[[], Any], render: Callable[[Any, Any, float], Any],
        interval: float, once: bool, console: Any = None) -> int:
    """Show frames until Ctrl-C (``once``: a single one, after one interval so that rates
    can be computed). ``snapshot()`` returns what ``render(new, old, dt)`` draws."""
    from rich.console import Console
    from rich.live import Live

    console = console or Console()
    old, t_old = snapshot(), time.monotonic()
    if once:
        time.sleep(interval)
        new, t_new = snapshot(), time.monotonic()
        console.print(render(new, old, t_new - t_old))
        return 0
    try:
        with Live(render(old, None, 0.0), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                new, t_new = snapshot(), time.monotonic()
                live.update(render(new, old, t_new - t_old), refresh=True)
                old, t_old = new, t_new
    except KeyboardInterrupt:
        return 0


def local_source(name: str, config: Any) -> tuple[Callable[[], Snapshot], Callable[[], None]]:
    """Snapshots of namespace ``name`` on this host, read from its L2; and a closer.
    Raises SegmentError when there is no such segment."""
    from ..metrics.collector import open_segment, read

    seg = open_segment(name, config)
    return (lambda: read(seg, config)), seg.close


def cluster_source(config: Any) -> tuple[Callable[[], list[tuple[str, str, Snapshot | None]]],
                                         Callable[[], None]]:
    """Snapshots of every host the cluster's registry lists (scraped from their
    exporters); and a closer. Raises Unavailable (L3), ConfigError."""
    from .._extras import require_cluster
    from ..metrics.registry import L3Registry
    from ..metrics.snapshot import scrape
    from ..tiers.l3 import L3Store

    require_cluster("kvcomm top --cluster")
    cl = config.cluster
    store = L3Store.from_config(cl)
    registry = L3Registry(store)  # (lease-backed once hosts hold leases: same protocol)

    def snap() -> list[tuple[str, str, Snapshot | None]]:
        out: list[tuple[str, str, Snapshot | None]] = []
        for entry in registry.hosts():
            if entry.metrics_url is None:
                out.append((entry.host, "no metrics", None))
                continue
            try:
                out.append((entry.host, entry.state, scrape(entry.metrics_url)))
            except KVCommError:
                out.append((entry.host, "unreachable", None))
        return out

    return snap, store.close
