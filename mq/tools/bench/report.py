"""What ``mq bench`` reports and how: the :class:`Report`, its targets, the machine facts, and
its JSON / CSV / Markdown / PNG renderings. Rows here are plain dicts (see ``ROW_FIELDS``)."""

from __future__ import annotations

import contextlib
import csv
import datetime as _dt
import importlib.metadata
import io
import json
import os
import platform
import re
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from mq.tools.bench.units import GB, KB, format_size

ROW_FIELDS = (
    "kind", "mq_type", "route", "resolved_route", "hosts", "device", "size", "size_bytes",
    "samples", "warmup", "min_ms", "p50_ms", "p99_ms", "max_ms", "mean_ms", "gbps",
    "baseline", "baseline_p50_ms", "ratio", "skipped", "reason", "seconds", "link_bytes",
    "mode", "subscribers", "messages", "payloads", "bound_copies", "bound_ms", "ratio_bound", "msgs_per_s",
    "mb_per_s", "lossless", "arrival_p50_ms", "arrival_ratio",
    "owned", "arrived_on", "bound_kind", "rpc_cuda_p50_ms", "rpc_cuda_ratio", "link_fraction", "load",
)


LINK_ROW = "raw:socket"  # the link row of a mode across hosts (bench_raw.StreamEndpoint)


def add_link_fractions(rows: list[dict[str, Any]], links: list[dict[str, Any]]) -> None:
    """Each measured row's share of the link (``link_fraction``: 0.9 = 90% of the link), where
    known: the p50 of the link row of its hosts, mode and size (a plain TCP stream into a warm
    buffer, interleaved with it) over its p50; rows without one (fan-out, stream) against the
    raw socket stream measured once in the same run (``links``)."""
    ceiling = {link["hosts"]: link["gbps"] for link in links if link.get("gbps")}
    link_p50 = {(r["hosts"], r["mode"], r["size_bytes"]): r["p50_ms"] for r in rows
                if r.get("mq_type") == LINK_ROW and r.get("p50_ms")}
    for r in rows:
        r["link_fraction"] = None
        if r.get("kind") == "bound" or r.get("mq_type") == LINK_ROW:
            continue
        same = link_p50.get((r.get("hosts"), r.get("mode"), r.get("size_bytes")))
        link = ceiling.get(r.get("hosts"))
        if same and r.get("p50_ms"):
            r["link_fraction"] = round(same / r["p50_ms"], 3)
        elif link and r.get("gbps"):
            r["link_fraction"] = round(r["gbps"] / link, 3)



@dataclass
class Report:
    """What :func:`run` measured: machine facts, rows (one per row kind and size), links."""

    machine: dict[str, Any]
    rows: list[dict[str, Any]]
    links: list[dict[str, Any]]
    config: dict[str, Any]
    targets: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    # The GPU pass lines (mq.tools.bench.gpu.gpu_checks): name, value, limit, unit, passed,
    # row, note; [] for a run without CUDA payloads.
    checks: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"machine": self.machine, "config": self.config, "links": self.links,
                "targets": self.targets, "checks": self.checks, "notes": self.notes, "rows": self.rows}



def _vs_raw(r: dict[str, Any]) -> bool:
    """Rows whose ratio is to a raw library (a fan-out's is to the same fan-out to one peer)."""
    return r["kind"] == "mq" and r.get("mode") != "fanout"


TARGETS = (
    ("nng 1.25 KB and 20 KB p50 <= 1.25x raw pynng (same address family)", 1.25,
     lambda r: _vs_raw(r) and r["mq_type"] == "nng" and r["size_bytes"] <= 20 * KB
     and r.get("mode") != "stream"),
    # A burst's time ratio: 1.25x the time is 0.8x the messages/s.
    ("nng stream >= 0.8x raw pynng Push0/Pull0 messages/s (burst time <= 1.25x)", 1.25,
     lambda r: _vs_raw(r) and r["mq_type"] == "nng" and r.get("mode") == "stream"),
    ("torchrpc:cpu p50 <= 1.15x raw rpc_sync at every size", 1.15,
     lambda r: _vs_raw(r) and r["mq_type"] == "torchrpc:cpu"),
    ("torchrpc:cpu call p50 <= 1.15x raw rpc_sync at 1.25 KB, 20 KB and 1.25 MB", 1.15,
     lambda r: _vs_raw(r) and r["mq_type"] == "torchrpc:cpu" and r.get("mode") == "call"
     and r["size_bytes"] in (1280, 20 * KB, 1280 * KB)),
    ("no row slower than its baseline by more than 1.5x", 1.5, _vs_raw),
    # One way proper: B's arrival time - A's send start (same kernel clock), not send -> ack.
    ("nng by handle: one way (arrival) p50 <= 0.2 ms at every size", 0.2,
     lambda r: r["kind"] == "mq" and r["route"] == "handle", "arrival_p50_ms"),
)

#: The suite's extra rows: an mq type whose point is a payload on another device.
SUITE_DEVICES = {"torchrpc:cuda": "cuda"}


def ratio_limit(r: dict[str, Any]) -> float:
    """The ratio a row's colour in the tables is judged by (its own target's, else 1.5)."""
    if r["mq_type"] == "torchrpc:cpu":
        return 1.15
    return 1.25 if r["mq_type"] == "nng" and r["size_bytes"] <= 20 * KB else 1.5


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """How the rows meet the TARGETS. Rows with CUDA payloads are left out: theirs are the GPU
    pass lines (``Report.checks``)."""
    out = []
    rows = [r for r in rows if r.get("device") != "cuda"]
    for text, limit, pick, *column in TARGETS:
        key = column[0] if column else "ratio"
        unit = "x" if key == "ratio" else " ms"
        mine = [r for r in rows if pick(r) and r.get(key) is not None]
        misses = [r for r in mine if r[key] > limit]
        worst = max(mine, key=lambda r: r[key], default=None)
        out.append({
            "target": text, "limit": limit, "rows_checked": len(mine),
            "met": bool(mine) and not misses,
            "misses": [f"{row_label(r)} {r['size']}: {r[key]:.3g}{unit}" for r in misses],
            "worst": f"{row_label(worst)} {worst['size']}: {worst[key]:.3g}{unit}" if worst else None,
        })
    return out


def row_label(r: dict[str, Any]) -> str:
    """``nng/auto->ipc``; other modes than round trip say so (``nng/ipc fanout x4``), and the
    bound says what it is."""
    if r["kind"] == "bound":
        load = f" +load{r['load']}" if r.get("load") else ""
        return ("D2D copy cuda (bound)" if r["mq_type"] == "d2d" else "memcpy (bound)") + load
    route = r["route"]
    if r.get("resolved_route") and r["resolved_route"] != route and r["kind"] == "mq":
        route = f"{route}->{r['resolved_route']}"
    where = " two-hosts" if r["hosts"] == "two" else ""
    dev = f" {r['device']}" if r["device"] != "cpu" else ""
    mode = r.get("mode") or "roundtrip"
    mode = "" if mode == "roundtrip" else f" {mode}" + (f" x{r['subscribers']}" if mode == "fanout" else "")
    load = f" +load{r['load']}" if r.get("load") else ""
    return f"{r['mq_type']}/{route}{mode}{dev}{where}{' +copy' if r.get('owned') else ''}{load}"


#: Under load (``--background-load``) small nng messages must stay within this of raw pynng
#: (same address family), and within LOADED_ZMQ_LIMIT of raw pyzmq over ipc, both measured
#: under the same load; idle, within IDLE_ZMQ_LIMIT of raw pyzmq ipc (issue 45).
LOADED_LIMIT = 1.25
LOADED_ZMQ_LIMIT = 1.5
IDLE_ZMQ_LIMIT = 1.0


def _vs_zmq_ipc(rows: list[dict[str, Any]], load: int) -> list[tuple[dict[str, Any], float]]:
    """(small nng row, its p50 / raw pyzmq ipc's p50 at its size) for the rows of ``load``."""
    zmq = {r["size_bytes"]: r["p50_ms"] for r in rows if r["mq_type"] == "raw:pyzmq" and r["route"] == "ipc"
           and (r.get("load") or 0) == load and r.get("p50_ms") and r.get("mode") in (None, "roundtrip")}
    return [(r, r["p50_ms"] / zmq[r["size_bytes"]]) for r in rows
            if _small_nng(r) and (r.get("load") or 0) == load and r["size_bytes"] in zmq and r.get("p50_ms")]


def _small_nng(r: dict[str, Any]) -> bool:
    return _vs_raw(r) and r["mq_type"] == "nng" and r["size_bytes"] <= 20 * KB and r.get("mode") in (None, "roundtrip")


def _judged(text: str, limit: float, pairs: list[tuple[dict[str, Any], float]]) -> dict[str, Any]:
    worst = max(pairs, key=lambda p: p[1], default=None)
    return {"target": text, "limit": limit, "rows_checked": len(pairs),
            "met": bool(pairs) and all(x <= limit for _r, x in pairs),
            "misses": [f"{row_label(r)} {r['size']}: {x:.3g}x" for r, x in pairs if x > limit],
            "worst": f"{row_label(worst[0])} {worst[0]['size']}: {worst[1]:.3g}x" if worst else None}


def with_load(idle: Report, loaded: Report, n: int) -> Report:
    """One report of the same rows idle and with ``n`` CPU-bound processes running
    (``mq bench --background-load N``): each loaded row right after its idle one, labelled
    ``+loadN``. The targets are judged on the idle rows; the loaded small nng rows against
    :data:`LOADED_LIMIT` (their baselines ran under the same load)."""
    for r in loaded.rows:
        r["load"] = n
    order = {row_label(r): i for i, r in enumerate(idle.rows)}
    keyed = [(order.get(row_label({**r, "load": 0}), len(order)), 1, r) for r in loaded.rows]
    keyed += [(order[row_label(r)], 0, r) for r in idle.rows]
    rows = [r for _i, _loaded, r in sorted(keyed, key=lambda k: (k[0], k[1]))]
    small = [(r, r["ratio"]) for r in loaded.rows if _small_nng(r) and r.get("ratio") is not None]
    calls = [(r, r["ratio"]) for r in loaded.rows if _vs_raw(r) and r["mq_type"] == "torchrpc:cpu"
             and r.get("mode") == "call" and r.get("ratio") is not None]
    targets = [*idle.targets,
               _judged(f"idle: nng 1.25 KB and 20 KB p50 <= {IDLE_ZMQ_LIMIT}x raw pyzmq ipc", IDLE_ZMQ_LIMIT,
                       _vs_zmq_ipc(idle.rows, 0)),
               _judged(f"under load ({n} CPU-bound processes): nng 1.25 KB and 20 KB p50 <= {LOADED_LIMIT}x "
                       "raw pynng under the same load", LOADED_LIMIT, small),
               _judged(f"under load ({n} CPU-bound processes): nng 1.25 KB and 20 KB p50 <= {LOADED_ZMQ_LIMIT}x "
                       "raw pyzmq ipc under the same load", LOADED_ZMQ_LIMIT, _vs_zmq_ipc(loaded.rows, n))]
    if calls:
        targets.append(_judged(f"under load ({n} CPU-bound processes): torchrpc:cpu call p50 <= {LOADED_LIMIT}x "
                               "raw rpc_sync under the same load", LOADED_LIMIT, calls))
    config = {**idle.config, "background_load": n}
    return Report(machine=idle.machine, rows=rows, links=idle.links + [dict(x, load=n) for x in loaded.links],
                  config=config, targets=targets, notes=idle.notes + [f"+load{n}: {x}" for x in loaded.notes],
                  checks=idle.checks)


def stream_note(r: dict[str, Any]) -> str:
    """``12.3k msg/s, 3.1 MB/s, lossless`` for a stream row with samples, else ``""``."""
    if not r.get("msgs_per_s"):
        return ""
    # (the ignore: a row without "lossless" gets "")
    order = {True: ", lossless", False: ", LOST MESSAGES"}.get(r.get("lossless"), "")  # type: ignore[arg-type]
    return f"{r['msgs_per_s'] / 1e3:.3g}k msg/s, {r['mb_per_s']:.3g} MB/s{order}"


def bound_note(r: dict[str, Any]) -> str:
    """What a row's ``x bound`` is relative to, e.g. ``bound: 2 memcpy``, ``bound: 1 D2D copy``."""
    n = r.get("bound_copies")
    what = "D2D copy" if r.get("bound_kind") == "d2d" else "memcpy"
    return f"bound: {n} {what}" if n and r["kind"] != "bound" else ""


def device_note(r: dict[str, Any]) -> str:
    """Where a CUDA payload arrived, when not (only) on the GPU: ``arrived on cpu: staged
    through host memory``; and ``view + copy`` for an owned row."""
    parts = []
    arrived = (r.get("arrived_on") or "").split(",")
    if r.get("device") == "cuda" and "cpu" in arrived:
        parts.append(f"arrived on {r['arrived_on']}: staged through host memory")
    if r.get("owned"):
        parts.append("view + copy into an owned tensor")
    return "; ".join(parts)


def rpc_cuda_note(r: dict[str, Any]) -> str:
    """``1.8x raw rpc-cuda`` for a CUDA row compared with raw torch RPC cuda (not its baseline)."""
    if r.get("rpc_cuda_ratio") is None or (r.get("baseline") or "").startswith("raw:rpc-cuda"):
        return ""
    return f"{r['rpc_cuda_ratio']:.3g}x raw rpc-cuda"


def arrival_note(r: dict[str, Any]) -> str:
    """``one way (arrival) 0.12 ms (1.05x)`` for a oneway row that has it, else ``""``."""
    if r.get("arrival_p50_ms") is None:
        return ""
    ratio = f" ({r['arrival_ratio']:.2f}x)" if r.get("arrival_ratio") is not None else ""
    return f"one way (arrival) {r['arrival_p50_ms']:.3g} ms{ratio}"


def row_note(r: dict[str, Any]) -> str:
    """The note column: why a row was skipped, stream throughput, one-way arrival, and what
    its bound is."""
    return "; ".join(x for x in (r["reason"], device_note(r), stream_note(r), arrival_note(r),
                                 rpc_cuda_note(r), bound_note(r)) if x)


# ================================================================================== machine
def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """Facts a reader needs to compare numbers: CPU, cores, memory, kernel, versions."""
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor() or platform.machine())
    mem = re.search(r"MemTotal:\s+(\d+) kB", _read("/proc/meminfo"))
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory": f"{int(mem.group(1)) / 2**20:.1f} GiB" if mem else None,
        "memory_gib": round(int(mem.group(1)) / 2**20, 1) if mem else None,
        "kernel": platform.release(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": None,
        "pynng": _version("pynng"),
        "numpy": _version("numpy"),
        "msgpack": _version("msgpack"),
        "mq": None,
        "git_commit": None,
        "gpus": [],
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "loadavg": _read("/proc/loadavg").split()[:3] or None,  # other work on the machine
        "command": " ".join(["mq", *sys.argv[1:]]) if sys.argv and sys.argv[0].endswith("mq") else None,
    }
    with contextlib.suppress(Exception):
        import mq

        info["mq"] = mq.__version__
    with contextlib.suppress(Exception):
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    with contextlib.suppress(Exception):
        here = os.path.dirname(os.path.abspath(__file__))
        done = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5)
        if done.returncode == 0:
            # Which tree ran (a worktree run through PYTHONPATH from another checkout imports
            # that checkout's mq instead), and whether it had changes not committed.
            dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=5).stdout.strip()
            info["git_commit"] = done.stdout.strip() + ("+changes" if dirty else "")
            info["mq_path"] = os.path.dirname(here)
    return info



def to_json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2)


def to_csv(report: Report) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(ROW_FIELDS), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in report.rows:
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in ROW_FIELDS})
    return buf.getvalue()


def fmt_ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if v < 100 else f"{v:.0f}"


def fmt_ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def pivot(report: Report, what: str = "p50") -> tuple[list[str], list[tuple[str, list[str]]]]:
    """Rows = row kinds, columns = sizes, cells = ``p50 ms (ratio x)``."""
    sizes: list[str] = list(dict.fromkeys(r["size"] for r in report.rows))
    table: dict[str, dict[str, str]] = {}
    for r in report.rows:
        cell = "skipped" if r["p50_ms"] is None else fmt_ms(r["p50_ms"])
        if r["ratio"] is not None:
            cell += f" ({r['ratio']:.2f}x)"
        if r["skipped"] and r["p50_ms"] is not None:
            cell += "*"
        table.setdefault(row_label(r), {})[r["size"]] = cell
    return sizes, [(label, [cells.get(s, "") for s in sizes]) for label, cells in table.items()]


def gpu_pivot(report: Report) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The CUDA rows (and their D2D bound) as rows x sizes, cells ``p50 ms (x bound, x rpc)``:
    the ratio to the device-to-device copy bound and to raw torch RPC cuda, same run."""
    mine = [r for r in report.rows if r.get("device") == "cuda"]
    sizes: list[str] = list(dict.fromkeys(r["size"] for r in mine))
    table: dict[str, dict[str, str]] = {}
    for r in mine:
        cell = "skipped" if r["p50_ms"] is None else fmt_ms(r["p50_ms"])
        ratios = [f"{v:.2f}x {what}" for v, what in ((r.get("ratio_bound"), "D2D"),
                                                     (r.get("rpc_cuda_ratio"), "rpc"))
                  if v is not None and r["kind"] != "bound"]
        if ratios:
            cell += f" ({', '.join(ratios)})"
        if r["skipped"] and r["p50_ms"] is not None:
            cell += "*"
        table.setdefault(row_label(r), {})[r["size"]] = cell
    return sizes, [(label, [cells.get(s, "") for s in sizes]) for label, cells in table.items()]


def check_line(c: dict[str, Any]) -> str:
    """``PASS: nng/auto 1.25 GB one way <= 2x the D2D copy bound: 1.43x (row ...)``."""
    mark = "PASS" if c["passed"] else ("NO DATA" if c["value"] is None else "FAIL")
    value = "-" if c["value"] is None else f"{c['value']:.3g}{c['unit']}"
    tail = "; ".join(x for x in (c.get("row"), c.get("note")) if x)
    return f"{mark}: {c['name']}: {value}" + (f" ({tail})" if tail else "")


def machine_line(m: dict[str, Any]) -> str:
    return (f"{m.get('cpu')}, {m.get('cores')} cores, {m.get('memory_gib')} GiB, kernel "
            f"{m.get('kernel')}, Python {m.get('python')}, torch {m.get('torch')}, pynng "
            f"{m.get('pynng')}, host {m.get('hostname')}"
            + (f", GPUs: {', '.join(m['gpus'])}" if m.get("gpus") else ", no GPU"))


def to_markdown(report: Report) -> str:
    m = report.machine
    out = ["# mq bench", "",
           f"Machine: {machine_line(m)}. Run {m.get('date_utc')}"
           + (f", commit {m['git_commit']}" if m.get("git_commit") else "")
           + (f", mq nodes with busy_poll={report.config['busy_poll']}"
              if report.config.get("busy_poll") is not None else "") + ".", "",
           ("Round trip: A sends a tensor, B echoes it (recv then send), A times send -> recv. "
            "oneway: B answers a tiny ack instead, times send -> ack; its note also gives one way "
            "proper, \"one way (arrival)\": B's clock when its recv returned minus A's send start "
            "(one kernel's monotonic clock, shared by every process and namespace host). fanout xN: "
            "A publishes to N subscribers and waits for all N acks (raw:pynng: Pub0 to N Sub0 "
            "processes, acks over Push0/Pull0). stream: one sample is a burst of small messages, "
            "ordered and checked, acked once. Ratio = mq p50 / raw p50 of its baseline, measured "
            "interleaved in the same run (fan-out N: / the same fan-out to 1). x bound = p50 / the physical bound, one "
            "memcpy into warm memory (CUDA payloads: one device-to-device copy) measured in the "
            "same run, times the copies the note says. "
            "Gbit/s = payloads moved x size / p50. `*` = stopped by --max-seconds before its target "
            "sample count."), ""]
    if report.links:
        out += ["## Link ceilings (raw socket stream, one direction)", "", "| hosts | link | Gbit/s | note |",
                "|---|---|---|---|"]
        for link in report.links:
            note = link.get("error") or (f"{link['bytes'] / GB:.1f} GiB in {link['seconds']:.2f}s"
                                         if link.get("bytes") else "")
            gbps = link['gbps'] if link['gbps'] is not None else '-'
            out.append(f"| {link['hosts']} | {link['link']} | {gbps} | {note} |")
        out.append("")
    sizes, prow = pivot(report)
    out += ["## p50 ms (ratio to baseline)", "", "| row | " + " | ".join(sizes) + " |",
            "|---|" + "---|" * len(sizes)]
    out += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in prow]
    out.append("")
    gsizes, grows = gpu_pivot(report)
    if grows:
        out += ["## CUDA payloads: p50 ms (x the D2D copy bound, x raw torch RPC cuda)", "",
                ("Every receiver synchronizes its current stream before a CUDA payload counts as "
                 "arrived (the view ready); `+copy` rows also copy it into an owned CUDA tensor first "
                 "(TensorPipe hands over an owned tensor). The bound is one device-to-device copy "
                 "into a warm tensor, timed by CUDA events in the same run."), "",
                "| row | " + " | ".join(gsizes) + " |", "|---|" + "---|" * len(gsizes)]
        out += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in grows]
        out.append("")
    if report.checks:
        out += ["## Pass lines", ""] + [f"- {check_line(c)}" for c in report.checks] + [""]
    if report.targets:
        out += ["## Targets", ""]
        for t in report.targets:
            mark = "met" if t["met"] else ("no data" if not t["rows_checked"] else "MISSED")
            detail = f"; misses: {', '.join(t['misses'])}" if t["misses"] else ""
            out.append(f"- **{mark}**: {t['target']} (worst: {t['worst']}){detail}")
        out.append("")
    out += ["## All rows", "",
            ("| row | size | samples | min ms | p50 ms | p99 ms | max ms | Gbit/s | baseline p50 ms "
             "| ratio | x bound | note |"),
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report.rows:
        note = row_note(r).replace("|", "/")
        if r.get("link_bytes") is not None and r["samples"]:
            moved = (r.get("payloads") or 2) * r["size_bytes"] * (r["samples"] + r["warmup"])
            note = (note + " " if note else "") + f"veth carried {r['link_bytes'] / max(1, moved):.2f}x the payload"
        if r.get("link_fraction") is not None:
            note = (note + "; " if note else "") + f"{r['link_fraction']:.2f}x the link"
        out.append(f"| {row_label(r)} | {r['size']} | {r['samples']} | {fmt_ms(r['min_ms'])} | {fmt_ms(r['p50_ms'])} | "
                   f"{fmt_ms(r['p99_ms'])} | {fmt_ms(r['max_ms'])} | {r['gbps'] if r['gbps'] is not None else '-'} | "
                   f"{fmt_ms(r['baseline_p50_ms'])} | {fmt_ratio(r['ratio'])} | {fmt_ratio(r.get('ratio_bound'))} | "
                   f"{note} |")
    if report.notes:
        out += ["", "## Notes", ""] + [f"- {n}" for n in report.notes]
    out.append("")
    return "\n".join(out)


def plot(report: Report, path: str) -> str:
    """Latency vs size (log-log, one line per row kind), ratio to baseline and ratio to the
    memcpy bound vs size, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float, float | None, float | None]]] = {}
    kinds: dict[str, str] = {}
    for r in report.rows:
        if r["p50_ms"] is None:
            continue
        label = row_label(r)
        series.setdefault(label, []).append((r["size_bytes"], r["p50_ms"], r["ratio"], r.get("ratio_bound")))
        kinds[label] = r["kind"]
    fig, (ax, ax2, ax3) = plt.subplots(1, 3, figsize=(20, 6.5), gridspec_kw={"width_ratios": [3, 2, 2]})
    colors = plt.get_cmap("tab20").colors  # type: ignore[attr-defined]  # tab20 is a ListedColormap
    for i, (label, pts) in enumerate(series.items()):
        pts.sort()
        raw = kinds[label] == "raw"
        style = dict(color=colors[i % len(colors)], ls="--" if raw else "-",
                     marker=("x" if raw else "o") if "two-hosts" not in label else ("+" if raw else "s"),
                     lw=1.5, ms=4, label=label)
        if kinds[label] == "bound":
            style.update(color="k", ls=":", marker=".")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], **style)
        for axis, col in ((ax2, 2), (ax3, 3)):
            rp = [(p[0], p[col]) for p in pts if p[col] is not None]
            if rp:
                axis.plot([p[0] for p in rp], [p[1] for p in rp], **style)
    for a in (ax, ax2, ax3):
        a.set_xscale("log", base=2)
        a.set_xlabel("message size (bytes)")
        a.grid(True, which="both", alpha=0.3)
        sizes = sorted({r["size_bytes"] for r in report.rows})
        a.set_xticks(sizes)
        a.set_xticklabels([format_size(s).replace(" ", "") for s in sizes], rotation=45)
    ax.set_yscale("log")
    ax.set_ylabel("p50 per sample (ms)")
    ax.set_title("mq vs raw baselines (dashed), memcpy bound (dotted); squares: two hosts")
    ax.legend(fontsize=7)
    for y, c in ((1.0, "k"), (1.15, "g"), (1.25, "orange"), (1.5, "r")):
        ax2.axhline(y, color=c, lw=0.8, ls=":")
    ax2.set_ylabel("p50 ratio mq / raw baseline")
    ax2.set_title("ratio (targets 1.15 / 1.25 / 1.5)")
    ax2.legend(fontsize=7)
    ax3.set_yscale("log")
    ax3.axhline(1.0, color="k", lw=0.8, ls=":")
    ax3.set_ylabel("p50 / physical bound (memcpy, or D2D copy for cuda rows)")
    ax3.set_title("x bound (1 = as fast as the memcpys the row needs)")
    fig.suptitle(machine_line(report.machine), fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(report: Report, out_dir: str, stem: str = "bench") -> list[str]:
    """Write ``stem``.json/.csv/.md into ``out_dir``; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for ext, text in (("json", to_json(report)), ("csv", to_csv(report)), ("md", to_markdown(report))):
        path = os.path.join(out_dir, f"{stem}.{ext}")
        with open(path, "w") as f:
            f.write(text)
        paths.append(path)
    return paths
