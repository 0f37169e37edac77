"""`mq bench`: the point-to-point latency table (see docs/benchmarks.md).

Thin: parses options into :class:`mq.tools.bench.BenchConfig`, shows progress, prints or writes the
:class:`mq.tools.bench.Report`. The measuring lives in :mod:`mq.tools.bench`, the second host in
:mod:`mq.tools.netns`.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any, Sequence

import click

from mq.errors import ConfigError
from mq.tools import bench as lib

__all__ = ["bench"]

FORMATS = ("table", "json", "csv", "md")
SUITE_MAX_SECONDS = 90.0
STREAM_SIZE = 256  # bytes per stream message when --sizes is not given: 64 float32
MB = 1 << 20
# The suite's modes besides round trip stop at these sizes, so its total stays near what the
# round-trip table alone takes (the 640 MB and 1.25 GB sizes are round trip only).
SUITE_MODE_MAX_SIZE = {"oneway": 40 * MB, "fanout": 10 * MB, "call": 10 * MB}


class _OneLineErrors(click.Command):
    """Bad option values end with one line, ``Error: <reason>``, and exit code 2."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            if exc.ctx is None:
                raise
            raise click.UsageError(exc.format_message()) from None


class _BadValue(click.ClickException):
    """A bad option value found after parsing: one line, exit code 2 (like a usage error)."""

    exit_code = 2


def _fail(message: str) -> click.ClickException:
    return _BadValue(" ".join(str(message).split()))


@click.command("bench", cls=_OneLineErrors)
@click.option("--mq-type", "mq_types", multiple=True, metavar="TYPE",
              help="nng, torchrpc:cpu, torchrpc:cuda; repeatable. Default: all (rows this machine "
                   "cannot run are listed as skipped with the reason).")
@click.option("--route", "routes", multiple=True, type=click.Choice(lib.ROUTES),
              help="nng route (the nng `protocol` option); repeatable. Default: auto, tcp and ipc "
                   "(with --device cuda: auto). rdma (with --two-hosts, NIXL installed): both nodes "
                   "made with rdma='tcp', mq's rdma path over UCX's tcp transport, no RDMA device "
                   "needed; only when named. torchrpc rows always use auto.")
@click.option("--mode", "modes", multiple=True, type=click.Choice([*lib.MODES, "fleet"]),
              help="roundtrip (default): B echoes; oneway: B acks with a tiny message; fanout: A "
                   "publishes to --subscribers peers and waits for every ack (also measured with one "
                   "subscriber, for the ratio); stream: bursts of --messages small messages, "
                   "lossless and in order, against raw pynng Push0/Pull0; call: A q.call()s B's "
                   "echo handler (q.on), against raw rpc_sync / pynng Req0-Rep0; fleet: --nodes nodes in "
                   "--procs processes join a full mesh by rendezvous, then idle (join time, the idle "
                   "job's CPU, the slowest stop; mq.tools.bench.fleet). Repeatable.")
@click.option("--nodes", "fleet_nodes", default="16,64", show_default=True, metavar="LIST",
              help="fleet: job sizes, comma-separated.")
@click.option("--procs", "fleet_procs", type=click.IntRange(1), default=8, show_default=True,
              help="fleet: processes the nodes are spread over (at most one per node).")
@click.option("--subscribers", type=click.IntRange(1), default=4, show_default=True,
              help="fanout: subscribers of the publisher, each its own process.")
@click.option("--messages", type=click.IntRange(1), default=1000, show_default=True,
              help="stream: messages per sample (the receiver acks each burst once).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="where the payload tensor lives. cuda: made on cuda:0, synchronized on the GPU "
                   "at every receiver before it counts, each mq row with a '+copy' twin (the "
                   "receiver copies the view into an owned tensor), the bound a device-to-device "
                   "copy, ratios to raw torch RPC cuda, and the GPU pass lines.")
@click.option("--sizes", default=None, metavar="LIST",
              help="comma-separated sizes, e.g. 1.25KB,20KB (binary units; at most 2.5GB); for "
                   "stream, the size of each message. Default: 1.25KB,20KB,1.25MB,10MB,40MB,640MB,"
                   "1.25GB (stream: 256B).")
@click.option("--max-seconds", type=float, default=None,
              help=f"time limit per row and size, warm-up included; a row past it is reported as "
                   f"skipped with its samples so far. Default 10 ({SUITE_MAX_SECONDS:g} with --suite).")
@click.option("--target-seconds", type=float, default=2.0, show_default=True,
              help="how long each row samples a size (samples adapt to the round-trip time).")
@click.option("--min-samples", type=click.IntRange(1), default=5, show_default=True)
@click.option("--max-samples", type=click.IntRange(1), default=2000, show_default=True)
@click.option("--warmup", type=click.IntRange(1), default=5, show_default=True,
              help="round trips per row and size not counted (at most ~1s of them).")
@click.option("--two-hosts", is_flag=True,
              help="run the peer in its own network, PID and IPC namespaces behind a veth pair "
                   "(root and iproute2 needed).")
@click.option("--hosts", "fan_hosts", default=None, metavar="LIST",
              help="fanout across hosts: spread --subscribers over this many network-namespace "
                   "hosts (comma list, e.g. 2,4), with relaying (tree and star) and without, against "
                   "one subscriber on another host and N vs 1 on the same host, --min-samples per row "
                   "and round, two rounds (root needed; see mq.tools.bench.fanout).")
@click.option("--link-rate", default=None, metavar="RATE",
              help="--hosts: cap every namespace host's uplink (the publisher's too) at RATE, e.g. "
                   "2gbit or 500mbit (tc tbf), so the network, not this machine's cores, sets the "
                   "pace, as between real hosts.")
@click.option("--suite", is_flag=True,
              help="the full table: every mq type and route this machine has, same host and "
                   "--two-hosts, round trip at every size plus oneway (to 40MB), fanout and call "
                   "(to 10MB) and stream; writes json/csv/md/png into --out (default bench-results/suite/).")
@click.option("--no-baseline", is_flag=True, help="skip the raw pynng / raw torch RPC rows.")
@click.option("--no-links", is_flag=True, help="skip the raw socket stream (link ceiling) measurement.")
@click.option("--split-cpus", is_flag=True,
              help="--two-hosts: run each host's workers on its own half of the CPUs, as separate "
                   "machines (default: the scheduler places them).")
@click.option("--busy-poll/--no-busy-poll", "busy_poll", default=None,
              help="the mq nodes' busy_poll option (see mq run --help). Default: the transports' "
                   "default (on).")
@click.option("--background-load", type=click.IntRange(0), default=0, show_default=True, metavar="N",
              help="measure every row twice: idle, then with N CPU-bound processes running (as collectors "
                   "stepping environments keep an RL machine busy); each loaded row follows its idle one.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True,
              help="what to print on stdout.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="also write bench.json, bench.csv and bench.md into this directory.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="write a PNG: latency vs size (log-log) and ratio vs size.")
@click.option("-q", "--quiet", is_flag=True, help="no progress display.")
def bench(mq_types: tuple[str, ...], routes: tuple[str, ...], modes: tuple[str, ...],
          subscribers: int, messages: int, device: str, sizes: str | None,
          max_seconds: float | None, target_seconds: float, min_samples: int, max_samples: int,
          warmup: int, two_hosts: bool, fan_hosts: str | None, link_rate: str | None, suite: bool,
          no_baseline: bool, no_links: bool, split_cpus: bool, busy_poll: bool | None, background_load: int, fmt: str,
          out_dir: str | None, plot_path: str | None, quiet: bool, fleet_nodes: str = "16,64",
          fleet_procs: int = 8) -> None:
    """Latency (round trip, one-way, fan-out) and stream throughput between processes per mq
    type, route and size, against raw pynng, raw pyzmq and raw torch RPC and the memcpy bound
    measured in the same run (interleaved), with the mq / raw and mq / bound p50 ratios."""
    from mq.registry import MQ_TYPES, check_mq_type

    try:
        types = [check_mq_type(t) for t in (mq_types or MQ_TYPES)]
        size_list = lib.parse_sizes(sizes) if sizes else list(lib.DEFAULT_SIZES)
    except ConfigError as exc:
        raise _fail(f"{'--mq-type' if 'mq type' in str(exc) else '--sizes'}: {exc}") from None
    if max_seconds is not None and max_seconds <= 0:
        raise _fail("--max-seconds must be positive")
    if target_seconds <= 0:
        raise _fail("--target-seconds must be positive")
    if max_samples < min_samples:
        raise _fail("--max-samples must be >= --min-samples")

    if "fleet" in modes:
        _fleet(fleet_nodes, fleet_procs, modes, fmt)
        return
    if fan_hosts is not None:
        _fanout_across_hosts(fan_hosts, modes, size_list if sizes else [], subscribers, min_samples, quiet,
                             link_rate)
        return
    if link_rate is not None:
        raise _fail("--link-rate goes with --hosts (fan-out across namespace hosts)")
    hosts = ["same", "two"] if suite else (["two"] if two_hosts else ["same"])
    if two_hosts and not suite:
        from mq.tools.netns import unavailable

        reason = unavailable()
        if reason:
            raise click.ClickException(f"--two-hosts: {reason}")
    devices: dict[str, str] = {}
    modes = tuple(lib.MODES) if suite else (modes or ("roundtrip",))
    # A stream message is small unless --sizes says otherwise (the suite's always is).
    mode_sizes: dict[str, Sequence[int]] = {} if sizes and not suite else {"stream": [STREAM_SIZE]}
    if suite:
        mode_sizes.update({m: [s for s in size_list if s <= cap] or size_list[:1]
                           for m, cap in SUITE_MODE_MAX_SIZE.items()})
        out_dir = out_dir or "bench-results/suite"
        plot_path = plot_path or os.path.join(out_dir, "bench.png")
        if device == "cpu" and lib.cuda_available():
            devices.update(lib.SUITE_DEVICES)  # the point of those mq types
    if not routes:  # a CUDA payload over tcp or ipc is staged through host memory: not the point
        routes = ("auto",) if device == "cuda" else tuple(lib.NNG_ROUTES)
    cfg = lib.BenchConfig(
        mq_types=types, routes=list(routes), device=device, devices=devices,
        sizes=size_list, hosts=hosts,
        max_seconds=max_seconds if max_seconds is not None else (SUITE_MAX_SECONDS if suite else 10.0),
        target_seconds=target_seconds, min_samples=min_samples, max_samples=max_samples,
        warmup=warmup, baselines=not no_baseline, links=not no_links, split_cpus=split_cpus, modes=list(modes),
        subscribers=subscribers, messages=messages, mode_sizes=mode_sizes, busy_poll=busy_poll,
    )
    report = _measure(cfg, quiet)
    if background_load:
        from mq.tools.load import BackgroundLoad

        with BackgroundLoad(background_load):
            report = lib.with_load(report, _measure(cfg, quiet), background_load)
    _output(report, fmt, out_dir, plot_path)


def _measure(cfg: Any, quiet: bool) -> Any:
    """Run the benchmark ``cfg`` (a BenchConfig) describes, with progress unless ``quiet``."""
    try:
        cfg.validate()
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    try:
        with _progress(quiet) as progress:
            return lib.run(cfg, progress=progress)
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    except KeyboardInterrupt:
        click.echo("interrupted: workers stopped, namespaces removed", err=True)
        sys.exit(130)


def _output(report: Any, fmt: str, out_dir: str | None, plot_path: str | None) -> None:
    """Write the report's files and plot, and print it in ``fmt``."""
    written = []
    if out_dir:
        written += lib.write_all(report, out_dir)
    if plot_path:
        try:
            written.append(lib.plot(report, plot_path))
        except ImportError as exc:
            click.echo(f"no plot: {exc} (pip install matplotlib)", err=True)
    if fmt == "json":
        click.echo(lib.to_json(report))
    elif fmt == "csv":
        click.echo(lib.to_csv(report), nl=False)
    elif fmt == "md":
        click.echo(lib.to_markdown(report))
    else:
        _print_tables(report)
    for path in written:
        click.echo(f"wrote {path}", err=True)


# ------------------------------------------------------------------------------- progress
class _progress:
    """A rich progress display on stderr fed by mq.tools.bench's progress events."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.bar: Any = None
        self.task: Any = None

    def __enter__(self) -> Any:
        if self.quiet:
            return None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        console = Console(stderr=True)
        self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                            MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True)
        self.bar.__enter__()
        self.task = self.bar.add_task("starting workers", total=0)
        return self.event

    def event(self, e: dict[str, Any]) -> None:
        kind = e.get("event")
        if kind == "total":
            total = (self.bar.tasks[0].total or 0) + e["add"]
            self.bar.update(self.task, total=total)
        elif kind == "advance":
            self.bar.update(self.task, advance=1, description=e["text"])
        elif kind in ("update", "group"):
            self.bar.update(self.task, description=e["text"])
        elif kind == "note":
            self.bar.console.print(f"[dim]{e['text']}[/dim]")

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


# ------------------------------------------------------------------------------- tables
def _ratio_style(r: dict[str, Any]) -> str:
    ratio = r["ratio"]
    if ratio is None or r.get("mode") == "fanout":  # compared with itself, not a raw library
        return ""
    limit = lib.ratio_limit(r)
    return "green" if ratio <= limit else ("yellow" if ratio <= 1.5 else "red")


def _print_tables(report: lib.Report) -> None:
    from rich.console import Console
    from rich.table import Table

    # A pipe or file gets the full width rather than rich's 80-column default.
    console = Console(width=None if sys.stdout.isatty() else 180)
    console.print(f"[bold]mq bench[/bold]  {lib.machine_line(report.machine)}")
    if report.links:
        t = Table(title="link ceilings (raw socket stream, one direction)", title_justify="left")
        for col in ("hosts", "link", "Gbit/s", "note"):
            t.add_column(col)
        for link in report.links:
            t.add_row(link["hosts"], link["link"], "-" if link["gbps"] is None else f"{link['gbps']:.1f}",
                      link.get("error") or "")
        console.print(t)
    t = Table(title="ms per sample: round trip (A send -> B recv+send -> A recv) unless the row names "
                    "its mode; ratio = mq p50 / raw p50 (the raw library, same run, interleaved); "
                    "x bound = p50 / the copies the note names", title_justify="left")
    for col, just in (("row", "left"), ("size", "right"), ("samples", "right"), ("min", "right"),
                      ("p50", "right"), ("p99", "right"), ("max", "right"), ("Gbit/s", "right"),
                      ("raw p50", "right"), ("ratio", "right"), ("x bound", "right"), ("note", "left")):
        t.add_column(col, justify=just, overflow="fold")  # type: ignore[arg-type]  # "left" or "right": a str to mypy
    last = None
    for r in report.rows:
        label = lib.row_label(r)
        if last is not None and label != last:
            t.add_section()
        style = _ratio_style(r)
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        t.add_row(label if label != last else "", r["size"], str(r["samples"]), lib.fmt_ms(r["min_ms"]),
                  lib.fmt_ms(r["p50_ms"]), lib.fmt_ms(r["p99_ms"]), lib.fmt_ms(r["max_ms"]),
                  "-" if r["gbps"] is None else f"{r['gbps']:.3g}", lib.fmt_ms(r["baseline_p50_ms"]),
                  f"[{style}]{ratio}[/{style}]" if style else ratio, lib.fmt_ratio(r.get("ratio_bound")),
                  lib.row_note(r))
        last = label
    console.print(t)
    _print_gpu(console, report)
    for target in report.targets:
        mark = ("[green]met[/green]" if target["met"] else
                ("[dim]not judged (no row of its kind ran)[/dim]" if not target["rows_checked"] else
                 "[red]missed[/red]"))
        console.print(f"{mark}: {target['target']} (worst: {target['worst']})")
    for note in report.notes:
        console.print(f"[dim]note: {note}[/dim]")


def _print_gpu(console: Any, report: lib.Report) -> None:
    """CUDA rows against the D2D copy bound and raw torch RPC cuda, and the GPU pass lines."""
    from rich.markup import escape
    from rich.table import Table

    sizes, rows = lib.gpu_pivot(report)
    if rows:
        t = Table(title="CUDA payloads: p50 ms (x the D2D copy bound, x raw torch RPC cuda); +copy: "
                        "the receiver copies the view into an owned tensor", title_justify="left")
        t.add_column("row")
        for size in sizes:
            t.add_column(size, justify="right")
        for label, cells in rows:
            t.add_row(label, *cells)
        console.print(t)
    if report.checks:
        console.print("[bold]GPU pass lines[/bold]")
    for c in report.checks:
        color = "green" if c["passed"] else ("yellow" if c["value"] is None else "red")
        console.print(f"[{color}]{escape(lib.check_line(c))}[/{color}]")


def _fleet(nodes: str, procs: int, modes: tuple[str, ...], fmt: str) -> None:
    from mq.tools.bench import fleet as bench_fleet

    if tuple(modes) != ("fleet",):
        raise _fail("--mode fleet goes alone (no other --mode)")
    try:
        sizes = [int(n) for n in nodes.split(",") if n.strip()]
    except ValueError:
        raise _fail(f"--nodes {nodes!r}: give job sizes as whole numbers, e.g. 16,64") from None
    if not sizes or min(sizes) < 2:
        raise _fail(f"--nodes {nodes!r}: every job needs at least 2 nodes")
    # Each job over the most processes (up to --procs) that hold the same number of nodes.
    rows = [bench_fleet.run(n, max(d for d in range(1, min(procs, n) + 1) if n % d == 0), idle=10.0, timeout=120.0)
            for n in sizes]
    click.echo(json.dumps(rows, indent=1) if fmt == "json" else bench_fleet.table(rows))
    if any(r["errors"] for r in rows):
        raise SystemExit(1)


def _fanout_across_hosts(fan_hosts: str, modes: tuple[str, ...], sizes: list[int], subscribers: int,
                         samples: int, quiet: bool, link_rate: str | None = None) -> None:
    from mq.tools.bench import fanout as bench_fanout
    from mq.tools.netns import unavailable

    try:
        counts = sorted({int(h) for h in fan_hosts.split(",") if h.strip()})
    except ValueError:
        raise _fail(f"--hosts: a comma list of host counts such as 2,4, got {fan_hosts!r}") from None
    if not counts or min(counts) < 1 or max(counts) > 16:
        raise _fail(f"--hosts: host counts between 1 and 16, got {fan_hosts!r}")
    if tuple(modes) != ("fanout",):
        raise _fail("--hosts goes with --mode fanout (and no other mode)")
    if link_rate is not None and not re.fullmatch(r"[0-9]+(\.[0-9]+)?[kmg]?bit", link_rate):
        raise _fail(f"--link-rate: a tc rate such as 2gbit, 500mbit or 100kbit, got {link_rate!r}")
    reason = unavailable()
    if reason:
        raise click.ClickException(f"--hosts: {reason}")
    for size in sizes or [100 * MB]:
        rows, info = bench_fanout.run(size, counts, subscribers=subscribers, samples=samples, link_rate=link_rate,
                                      progress=(lambda s: None) if quiet else (lambda s: click.echo(s, err=True)))
        click.echo(bench_fanout.table(rows, info))
