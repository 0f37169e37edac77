"""``python -m mq.tools.gpu_probe [--json]``: what CUDA offers mq on this machine (GPU.md).

Reports, per GPU, name, UUID, compute mode and MIG (NVML when importable, else torch); the
peer-to-peer matrix; the device-to-device copy time per bench size (the bound a CUDA message
cannot beat); whether torch's CUDA IPC works with ``expandable_segments:True``; and a
two-process open of an mq pool (``mq.datapaths.nvlink.cuda_ipc.probe_two_process``). Each part is guarded: a
failure becomes that part's ``error`` and the rest still runs. Without a CUDA GPU it says
"no CUDA GPU visible" and exits 0. ``scripts/gpu-check`` writes its output into env.txt.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import Any, Callable, Mapping

KB, MB, GB = 1 << 10, 1 << 20, 1 << 30
#: The sizes of ``mq bench`` (binary units), as (label, bytes).
SIZES = (("1.25KB", 1280), ("20KB", 20 * KB), ("1.25MB", 1280 * KB), ("10MB", 10 * MB),
         ("40MB", 40 * MB), ("640MB", 640 * MB), ("1.25GB", 1280 * MB))
COMPUTE_MODES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}
NO_GPU = "no CUDA GPU visible"
IPC_TIMEOUT_S = 90.0


def guarded(fn: Callable[..., Any]) -> Any:  # called with no argument (`...`: mypy types lambdas with defaults)
    """``fn()``, or ``{"error": "Type: text"}`` if it raised: one broken part never stops the rest."""
    try:
        return fn()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_devices() -> list[dict[str, Any]] | None:
    """Every GPU NVML sees (physical indices, CUDA_VISIBLE_DEVICES ignored); None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            dev: dict[str, Any] = {"index": i, "name": _text(pynvml.nvmlDeviceGetName(h)),
                                   "uuid": _text(pynvml.nvmlDeviceGetUUID(h))}
            mode = guarded(lambda h=h: pynvml.nvmlDeviceGetComputeMode(h))
            dev["compute_mode"] = COMPUTE_MODES.get(mode, str(mode)) if isinstance(mode, int) else None
            mig = guarded(lambda h=h: pynvml.nvmlDeviceGetMigMode(h))  # (current, pending); raises if unsupported
            dev["mig"] = bool(mig[0]) if isinstance(mig, (list, tuple)) else False
            dev["memory_bytes"] = guarded(lambda h=h: int(pynvml.nvmlDeviceGetMemoryInfo(h).total))
            out.append(dev)
        return out
    finally:
        guarded(pynvml.nvmlShutdown)


def torch_devices(torch: Any) -> list[dict[str, Any]]:
    """The GPUs torch sees (logical indices); compute mode unknown, MIG from a ``MIG-`` UUID."""
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        uuid = f"GPU-{p.uuid}" if getattr(p, "uuid", None) is not None else None
        out.append({"index": i, "name": p.name, "uuid": uuid, "compute_mode": None,
                    "mig": bool(uuid and uuid.startswith("MIG-")), "memory_bytes": int(p.total_memory)})
    return out


def p2p_matrix(torch: Any) -> list[list[bool | None]]:
    """matrix[i][j]: device i can access device j peer to peer; None on the diagonal."""
    n = torch.cuda.device_count()
    return [[None if i == j else bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)]
            for i in range(n)]


def copy_times(torch: Any, device: int = 0, reps: int = 7) -> list[dict[str, Any]]:
    """Median ``dst.copy_(src)`` time per bench size on one device, timed with CUDA events after
    warm-up; GB/s counts the bytes read plus the bytes written (2 x size)."""
    rows = []
    for label, n in SIZES:
        def one(n: int = n) -> dict[str, Any]:
            src = torch.empty(n, dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(3):
                dst.copy_(src)
            torch.cuda.synchronize(device)
            times = []
            for _ in range(reps):
                start.record()
                dst.copy_(src)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            ms = statistics.median(times)
            return {"ms": ms, "gb_per_s": 2 * n / (ms / 1e3) / 1e9 if ms > 0 else None}

        with torch.cuda.device(device):
            rows.append({"size": label, "bytes": n, **guarded(one)})
            torch.cuda.empty_cache()
    return rows


def _ipc_reader(inbox: Any, outbox: Any) -> None:
    """Second process of the expandable-segments check: rebuild the shared tensor and sum it."""
    try:
        t = inbox.get(timeout=60)
        outbox.put(("ok", float(t.sum().item())))
        del t
    except Exception as exc:
        outbox.put(("error", f"{type(exc).__name__}: {exc}"))


def _ipc_child() -> None:
    """Runs with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: shares a CUDA tensor with a
    spawned process through torch.multiprocessing (reduce_tensor / rebuild_cuda_tensor)."""
    import torch
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    reader = ctx.Process(target=_ipc_reader, args=(inbox, outbox), daemon=True)
    reader.start()
    x = torch.arange(4096, dtype=torch.float32, device="cuda")
    inbox.put(x)
    status, value = outbox.get(timeout=IPC_TIMEOUT_S - 20)
    reader.join(10)
    expected = float(x.sum().item())
    if status == "ok" and value != expected:
        status, value = "error", f"the reader summed {value}, expected {expected}"
    print(json.dumps({"ok": status == "ok", "error": None if status == "ok" else value}), flush=True)


def expandable_segments_ipc() -> dict[str, Any]:
    """Does torch's CUDA IPC work when both processes set expandable_segments:True (pidfd_getfd)?"""
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    try:
        p = subprocess.run([sys.executable, "-m", "mq.tools.gpu_probe", "--ipc-child"], env=env,
                           capture_output=True, text=True, timeout=IPC_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"no answer within {IPC_TIMEOUT_S:.0f} s"}
    lines = p.stdout.strip().splitlines()
    if p.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = " | ".join(p.stderr.strip().splitlines()[-3:])
    return {"ok": False, "error": f"exit {p.returncode}: {tail or p.stdout.strip()[-300:]}"}


def pool_open(device: int = 0, peer_device: int | None = None, timeout: float = 45.0) -> dict[str, Any]:
    """A two-process open of an mq CUDA pool: ``mq.datapaths.nvlink.cuda_ipc.probe_two_process`` (guarded).
    ``peer_device`` and ``timeout`` are passed only where that function takes them."""
    import inspect

    try:
        from mq.datapaths.nvlink.cuda_ipc import probe_two_process
    except (ImportError, AttributeError) as exc:
        return {"ok": False, "error": f"mq.datapaths.nvlink.cuda_ipc not available: {exc}"}
    params: Mapping[str, Any]  # a signature's, or none
    try:
        params = inspect.signature(probe_two_process).parameters
    except (TypeError, ValueError):
        params = {}
    kwargs: dict[str, Any] = {"device": device}
    if "timeout" in params:
        kwargs["timeout"] = timeout
    if peer_device is not None and peer_device != device:
        if "peer_device" not in params:
            return {"ok": None,
                    "error": "not measured: mq.datapaths.nvlink.cuda_ipc.probe_two_process takes one device"}
        kwargs["peer_device"] = peer_device
    try:
        return dict(probe_two_process(**kwargs))
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def probe() -> dict[str, Any]:
    """Everything the probe reports, as one JSON-safe dict; ``cuda`` False (with ``reason``)
    when torch sees no CUDA GPU."""
    rep: dict[str, Any] = {"nvml_devices": guarded(nvml_devices)}
    try:
        import torch
    except Exception as exc:
        return rep | {"cuda": False, "reason": f"{NO_GPU} (torch does not import: {exc})"}
    rep["torch"] = {"version": torch.__version__, "cuda_build": torch.version.cuda}
    if guarded(torch.cuda.is_available) is not True:
        return rep | {"cuda": False, "reason": NO_GPU}
    rep["cuda"] = True
    rep["device_count"] = guarded(torch.cuda.device_count)
    rep["torch_devices"] = guarded(lambda: torch_devices(torch))
    rep["p2p"] = guarded(lambda: p2p_matrix(torch))
    rep["copy"] = guarded(lambda: copy_times(torch))
    rep["expandable_segments_ipc"] = guarded(expandable_segments_ipc)
    rep["pool_open"] = guarded(pool_open)
    return rep


def _ms(v: Any) -> str:
    return f"{v:.3f} ms" if isinstance(v, (int, float)) else "?"


def _devices_lines(title: str, devices: Any) -> list[str]:
    if not isinstance(devices, list):
        return [f"{title}: {devices['error'] if isinstance(devices, dict) else 'unavailable'}"]
    lines = [f"{title}: {len(devices)}"]
    for d in devices:
        mem = f"{d['memory_bytes'] / GB:.1f} GiB" if isinstance(d.get("memory_bytes"), int) else "?"
        lines.append(f"  {d['index']}  {d['name']}  {d['uuid']}  compute mode {d['compute_mode'] or '?'}"
                     f"  MIG {'on' if d['mig'] else 'off'}  {mem}")
    return lines


def _copy_lines(rows: Any) -> list[str]:
    if not isinstance(rows, list):
        return [f"device-to-device copy: {rows.get('error')}"]
    lines = ["device-to-device copy on cuda:0 (median, CUDA events; GB/s counts bytes read + written):"]
    for r in rows:
        if "error" in r:
            lines.append(f"  {r['size']:>7}  {r['error']}")
        else:
            gbs = f"{r['gb_per_s']:.1f} GB/s" if r.get("gb_per_s") else "?"
            lines.append(f"  {r['size']:>7}  {_ms(r['ms']):>12}  {gbs}")
    return lines


def _result_line(title: str, r: Any) -> str:
    if not isinstance(r, dict):
        return f"{title}: {r}"
    if r.get("ok"):
        extra = ", ".join(f"{k.removesuffix('_ms').replace('_', ' ')} {_ms(v)}"
                          for k, v in r.items() if k.endswith("_ms"))
        return f"{title}: ok" + (f"; {extra}" if extra else "")
    return f"{title}: FAILED: {r.get('error')}" if r.get("ok") is False else f"{title}: {r.get('error')}"


def render(rep: dict[str, Any]) -> str:
    """The report as text, one fact a line."""
    lines = _devices_lines("GPUs (NVML)", rep["nvml_devices"]) if rep.get("nvml_devices") is not None \
        else ["GPUs (NVML): NVML not available"]
    if not rep.get("cuda"):
        return "\n".join([rep["reason"], *lines])
    t = rep["torch"]
    lines.insert(0, f"CUDA probe: torch {t['version']}, CUDA build {t['cuda_build']}")
    lines += [f"torch.cuda.device_count: {rep['device_count']}"]
    lines += _devices_lines("GPUs (torch)", rep["torch_devices"])
    p2p = rep["p2p"]
    if isinstance(p2p, list):
        lines.append("P2P (row i can access column j): " + ("; ".join(
            f"{i}: " + " ".join("X" if v is None else ("OK" if v else "-") for v in row)
            for i, row in enumerate(p2p)) or "none"))
    else:
        lines.append(f"P2P: {p2p.get('error')}")
    lines += _copy_lines(rep["copy"])
    lines.append(_result_line("expandable_segments:True IPC (torch reductions, two processes)",
                              rep["expandable_segments_ipc"]))
    lines.append(_result_line("mq pool, two-process open on cuda:0", rep["pool_open"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "--ipc-child" in args:
        _ipc_child()
        return 0
    rep = probe()
    print(json.dumps(rep, indent=2, sort_keys=True, default=str) if "--json" in args else render(rep), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
