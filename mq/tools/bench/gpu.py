"""``mq bench --device cuda``: the pass lines of mq's GPU data path (docs/guides/gpu.md),
checked on a report's rows.

For each mq type measured with CUDA payloads on one host (``nng``, ``torchrpc:cuda``), one way:

- 1.25 GB at most 2x the device-to-device copy bound measured in the same run (``x bound``);
- 1.25 GB at most the raw torch RPC cuda row (TensorPipe with device maps), both as the view
  ready and as the view copied into an owned tensor (``+copy``: what TensorPipe hands over);
- 1.25 KB p50 (send -> ack) at most 0.5 ms.

A check whose size was not measured is left out; one whose row has no samples fails with the
row's reason. Each check: ``name``, ``value``, ``limit``, ``unit``, ``passed``, ``row``,
``note``.
"""

from __future__ import annotations

from typing import Any

from mq.tools.bench.report import row_label
from mq.tools.bench.units import MB

BIG = 1280 * MB  # 1.25 GB
SMALL = 1280  # 1.25 KB
BOUND_LIMIT = 2.0  # x the D2D copy bound
RPC_LIMIT = 1.0  # x raw torch RPC cuda
SMALL_LIMIT_MS = 0.5

__all__ = ["BIG", "SMALL", "gpu_checks"]


def _cuda_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["kind"] == "mq" and r.get("device") == "cuda" and r["hosts"] == "same"
            and r.get("mode") == "oneway" and r["route"] != "handle"]


def _check(name: str, r: dict[str, Any] | None, key: str, limit: float, unit: str) -> dict[str, Any]:
    value = r.get(key) if r is not None else None
    notes = []
    if r is None:
        notes.append("no data: the run has no such row")
    elif value is None:
        why = ("no raw:rpc-cuda row to compare with" if r.get("p50_ms") is not None
               else r.get("reason") or "no samples")
        notes.append(f"no data: {why}")
    elif r.get("skipped"):
        notes.append(f"{r['samples']} samples: {r['reason']}")
    if r is not None and r.get("arrived_on") and "cpu" in r["arrived_on"].split(","):
        notes.append(f"arrived on {r['arrived_on']}: staged through host memory")
    return {"name": name, "value": value, "limit": limit, "unit": unit,
            "passed": value is not None and value <= limit,
            "row": f"{row_label(r)} {r['size']}" if r is not None else None, "note": "; ".join(notes) or None}


def gpu_checks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pass lines (see the module docstring) for every mq type and route with CUDA rows, in
    row order; [] for a run without CUDA payloads or without one-way rows."""
    mine = _cuda_rows(rows)
    by = {(r["mq_type"], r["route"], bool(r.get("owned")), r["size_bytes"]): r for r in mine}
    sizes = {r["size_bytes"] for r in mine}
    checks = []
    for mq_type, route in dict.fromkeys((r["mq_type"], r["route"]) for r in mine):
        what = f"{mq_type}/{route}" if mq_type == "nng" else mq_type
        if BIG in sizes:
            view = by.get((mq_type, route, False, BIG))
            owned = by.get((mq_type, route, True, BIG))
            checks.append(_check(f"{what} 1.25 GB one way <= {BOUND_LIMIT:g}x the D2D copy bound", view,
                                 "ratio_bound", BOUND_LIMIT, "x"))
            checks.append(_check(f"{what} 1.25 GB one way <= raw torch RPC cuda (view ready)", view,
                                 "rpc_cuda_ratio", RPC_LIMIT, "x"))
            checks.append(_check(f"{what} 1.25 GB one way <= raw torch RPC cuda (view + copy into "
                                 f"an owned tensor)", owned, "rpc_cuda_ratio", RPC_LIMIT, "x"))
        if SMALL in sizes:
            checks.append(_check(f"{what} 1.25 KB one way p50 <= {SMALL_LIMIT_MS:g} ms",
                                 by.get((mq_type, route, False, SMALL)), "p50_ms", SMALL_LIMIT_MS, " ms"))
    return checks

