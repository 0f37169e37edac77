"""`mq top`: a live view of a running job, one table row per node and topic.

It joins the job as an extra node (a high node id, the job's secret as any member) attached to
the addresses given, and asks those nodes for their metrics (:mod:`mq.telemetry`; each node runs
``mq.telemetry.serve(q)``), which also brings in every peer they see. ``--once`` prints one table,
``--json`` one JSON object, ``--prometheus PORT`` serves Prometheus text at ``/metrics``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import click
from rich.console import Console
from rich.live import Live
from rich.table import Table

import mq
from mq import telemetry
from mq.registry import DEFAULT_MQ_TYPE
from mq.metrics import prometheus_registry

__all__ = ["render", "top"]


def _rate(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{prefix}{unit}"
    return f"{value:.0f}{unit}" if isinstance(value, (int, float)) else str(value)


def _ms(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}"


def render(snapshots: dict[int, dict[str, Any]]) -> Table:
    """One row per node and topic: traffic, latency, queues, drops, routes, policy lag."""
    table = Table(title=f"mq top - {len(snapshots)} node(s) - {time.strftime('%H:%M:%S')}")
    for name, justify in (("node", "right"), ("labels", "left"), ("topic", "left"), ("sent", "right"),
                          ("recv", "right"), ("sent/s", "right"), ("recv/s", "right"), ("recv B/s", "right"),
                          ("p50 ms", "right"), ("p99 ms", "right"), ("queue", "right"), ("drops", "right"),
                          ("routes", "left"), ("policy lag", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for node, snap in snapshots.items():
        if "error" in snap:
            table.add_row(str(node), "", f"[red]{snap['error']}[/red]", *[""] * 11)
            continue
        queue = sum(q.get("messages", 0) for q in snap.get("queues", {}).values())
        drops = sum(snap.get("drops", {}).values()) + sum(snap.get("rejected", {}).values())
        routes = " ".join(f"{p}:{k}" for p, k in sorted(snap.get("routes", {}).items()))
        lag = " ".join(f"{ch}[{' '.join(f'{p}:{v}' for p, v in by_peer.items())}]"
                       for ch, by_peer in snap.get("policy_lag", {}).items())
        topics = sorted((t, v) for t, v in snap.get("topics", {}).items() if not t.startswith("_mq."))
        for i, (topic, t) in enumerate(topics or [("-", {})]):
            first = i == 0
            table.add_row(str(node) if first else "", ",".join(snap.get("labels", [])) if first else "", topic,
                          _rate(t.get("sent")), _rate(t.get("received")), _rate(t.get("sent_per_s")),
                          _rate(t.get("received_per_s")), _rate(t.get("received_bytes_per_s"), "B"),
                          _ms(t.get("latency_p50_ms")), _ms(t.get("latency_p99_ms")),
                          str(queue) if first else "", str(drops) if first else "",
                          routes if first else "", lag if first else "")
    return table


class _Latest:
    """A prometheus_client collector serving the newest snapshots."""

    def __init__(self) -> None:
        self.snapshots: dict[int, dict[str, Any]] = {}

    def collect(self) -> Any:
        ok = {n: s for n, s in self.snapshots.items() if "error" not in s}
        yield from prometheus_registry(ok).collect()


@click.command()
@click.option("--attach-to", required=True, help="address(es) of running nodes, comma-separated "
              "(e.g. the learner's tcp://10.0.0.1:50515); their peers are shown too")
@click.option("--mq-type", default=DEFAULT_MQ_TYPE, show_default=True, help="the job's mq type")
@click.option("--node-id", type=int, default=None, help="this watcher's node id (default: 2**30 + pid, "
              "unused by any job)")
@click.option("--interval", type=float, default=2.0, show_default=True, help="seconds between refreshes")
@click.option("--once", is_flag=True, help="print one table and exit")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object {node: metrics} and exit")
@click.option("--prometheus", type=int, default=None, metavar="PORT",
              help="also serve Prometheus text at http://0.0.0.0:PORT/metrics")
@click.option("--timeout", type=float, default=15.0, show_default=True, help="seconds to wait for the nodes")
def top(attach_to: str, mq_type: str, node_id: int | None, interval: float, once: bool, as_json: bool,
        prometheus: int | None, timeout: float) -> None:
    """Live metrics of a running job: traffic per topic, latency, queues, drops, routes, policy lag."""
    if interval <= 0:
        raise click.BadParameter(f"must be > 0 seconds, got {interval}", param_hint="--interval")
    addresses = [a.strip() for a in attach_to.split(",") if a.strip()]
    me = (1 << 30) + os.getpid() % (1 << 20) if node_id is None else node_id
    try:
        q = mq.create(mq_type, me, {telemetry.WATCHER}, attach_to=addresses, timeout=timeout)
    except mq.ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    with q:
        try:
            q.wait_for_peers(1, timeout=timeout)
        except mq.Timeout as exc:
            raise click.ClickException(f"no node answered at {', '.join(addresses)}: {exc}") from None
        if as_json or once:
            snaps = telemetry.collect(q)
            if as_json:
                click.echo(json.dumps({str(k): v for k, v in snaps.items()}))
            else:
                Console(width=200).print(render(snaps))
            return
        latest = _Latest()
        if prometheus is not None:
            from prometheus_client import CollectorRegistry, start_http_server

            registry = CollectorRegistry()
            registry.register(latest)
            start_http_server(prometheus, registry=registry)
        console = Console()
        if not console.is_terminal:  # a pipe or a log file: one table per refresh
            while True:
                latest.snapshots = telemetry.collect(q)
                Console(width=200).print(render(latest.snapshots))
                sys.stdout.flush()
                time.sleep(interval)
        with Live(render({}), console=console, auto_refresh=False) as live:
            while True:
                latest.snapshots = telemetry.collect(q)
                live.update(render(latest.snapshots), refresh=True)
                time.sleep(interval)
