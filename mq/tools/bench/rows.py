"""``mq bench``'s results: one report row per (case, size), with its statistics, its ratios
to its baseline and to the physical bound, in the report's order."""

from __future__ import annotations

from typing import Any

from mq.tools.bench.cases import HOSTS, Case, SizeResult
from mq.tools.bench.endpoint import MODES
from mq.tools.bench.units import format_size


def _stats(samples_ns: list[int]) -> dict[str, float]:
    import numpy as np

    ms = np.asarray(samples_ns, dtype=np.float64) / 1e6
    p50, p99 = np.percentile(ms, [50, 99])
    return {"min_ms": float(ms.min()), "p50_ms": float(p50), "p99_ms": float(p99),
            "max_ms": float(ms.max()), "mean_ms": float(ms.mean())}


def _baseline_name(b: Case) -> str:
    return f"{b.mq_type}/{b.route}" + (f" fanout x{b.subscribers}" if b.mode == "fanout" else "")


def _p50(res: SizeResult | None) -> float | None:
    return _stats(res.samples_ns)["p50_ms"] if res is not None and res.samples_ns else None


def _row(c: Case, size: int, bound: Case | None, messages: int) -> dict[str, Any]:
    res = c.results.get(size) or SizeResult(skipped=c.unavailable or "not run")
    moved, memcpys = c.copies(messages)
    row: dict[str, Any] = {
        "kind": c.kind, "mq_type": c.mq_type, "route": c.route,
        "resolved_route": res.route_taken or c.resolved_route, "hosts": c.hosts, "device": c.device,
        "size": format_size(size), "size_bytes": size, "samples": len(res.samples_ns),
        "warmup": len(res.warm_ns), "min_ms": None, "p50_ms": None, "p99_ms": None,
        "max_ms": None, "mean_ms": None, "gbps": None,
        "baseline": _baseline_name(c.baseline) if c.baseline else None,
        "baseline_p50_ms": None, "ratio": None, "skipped": bool(res.skipped),
        "reason": res.skipped, "seconds": round(res.used_s, 3),
        "link_bytes": res.link_bytes, "mode": c.mode,
        "subscribers": c.subscribers if c.mode == "fanout" else None,
        "messages": messages if c.mode == "stream" else None, "payloads": moved, "bound_copies": memcpys,
        "bound_ms": None, "ratio_bound": None, "msgs_per_s": None, "mb_per_s": None,
        "lossless": None, "arrival_p50_ms": None, "arrival_ratio": None,
        "owned": c.owned if c.device == "cuda" and c.kind == "mq" else None,
        "arrived_on": ",".join(sorted(res.arrived_on)) or None,
        "bound_kind": bound.mq_type if bound is not None else None,
        "rpc_cuda_p50_ms": None, "rpc_cuda_ratio": None, "link_fraction": None, "load": 0,
    }
    if c.mode == "stream" and (res.samples_ns or "lost or reordered" in (res.skipped or "")):
        row["lossless"] = "lost or reordered" not in (res.skipped or "")  # B checks every counter
    if not res.samples_ns:
        return row
    st = _stats(res.samples_ns)
    p50_s = st["p50_ms"] / 1e3
    row.update({k: _ms(v) for k, v in st.items()})
    row["gbps"] = round(moved * size * 8 / p50_s / 1e9, 4)
    if c.mode == "stream":
        row["msgs_per_s"] = round(messages / p50_s, 1)
        row["mb_per_s"] = round(messages * size / p50_s / 1e6, 3)
    base_p50 = _p50(c.baseline.results.get(size)) if c.baseline is not None else None
    if base_p50:
        row["baseline_p50_ms"] = _ms(base_p50)
        row["ratio"] = round(st["p50_ms"] / base_p50, 4)
    if res.arrival_ns:
        row["arrival_p50_ms"] = _ms(_stats(res.arrival_ns)["p50_ms"])
        base = c.baseline.results.get(size) if c.baseline is not None else None
        if base is not None and base.arrival_ns:
            row["arrival_ratio"] = round(row["arrival_p50_ms"] / _stats(base.arrival_ns)["p50_ms"], 4)
    bound_p50 = _p50(bound.results.get(size)) if bound is not None else None
    if bound_p50:
        row["bound_ms"] = _ms(memcpys * bound_p50)
        row["ratio_bound"] = round(st["p50_ms"] / (memcpys * bound_p50), 4)
    return row


def _ms(value: float) -> float:
    # Significant digits, not decimals: a 1 KB memcpy takes ~0.0001 ms, and six decimals left
    # it two digits, so a row's ratio to it disagreed with its own columns by ~0.5%.
    return float(f"{value:.6g}")


_ORDER = {"memcpy": -2, "d2d": -1, "nng": 0, "raw:pynng": 1, "raw:pyzmq": 2, "torchrpc:cpu": 3, "raw:rpc": 4,
          "torchrpc:cuda": 5, "raw:rpc-cuda": 6}
_ROUTE_ORDER = {"auto": 0, "tcp": 1, "ipc": 2, "rdma": 3, "handle": 4}
_MODE_ORDER = ("bound", *MODES)


def report_rows(cases: list[Case], bounds: dict[str, Case], cfg: Any) -> list[dict[str, Any]]:
    """Every row of the report: each case at each of its sizes (``cfg``: the BenchConfig). A
    row's ``x bound`` is to the bound of its payload's device (``bounds``: device -> bound case;
    memcpy for CPU payloads, the device-to-device copy for CUDA ones)."""
    ordered = sorted(cases, key=lambda c: (
        _MODE_ORDER.index(c.mode), HOSTS.index(c.hosts), _ORDER.get(c.mq_type, 9),
        _ROUTE_ORDER.get(c.route, 9), -c.subscribers, c.owned, c.device))
    rows = [_row(c, s, c if c.kind == "bound" else bounds.get(c.device), cfg.messages) for c in ordered
            for s in (cfg.all_sizes() if c.kind == "bound" else cfg.sizes_for(c.mode))]
    add_rpc_cuda_ratios(rows)
    return rows


def add_rpc_cuda_ratios(rows: list[dict[str, Any]]) -> None:
    """Give every mq row with a CUDA payload its p50 over the raw torch RPC cuda row (TensorPipe
    with device maps) of the same mode, hosts and size, measured in the same run: the GPU
    transport to beat, whatever the row's own baseline (raw pynng for nng)."""
    raw = {(r["mode"], r["hosts"], r["size_bytes"]): r["p50_ms"] for r in rows
           if r["kind"] == "raw" and r["mq_type"] == "raw:rpc-cuda" and r["p50_ms"]}
    for r in rows:
        ref = raw.get((r["mode"], r["hosts"], r["size_bytes"]))
        if r["kind"] == "mq" and r["device"] == "cuda" and ref:
            r["rpc_cuda_p50_ms"] = ref
            if r["p50_ms"] is not None:
                r["rpc_cuda_ratio"] = round(r["p50_ms"] / ref, 4)
