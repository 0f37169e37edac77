"""`mq doctor`: what this node sees, and which route it would take to a peer.

The command is thin: :func:`report` gathers plain facts from the library (``mq.locality``,
``mq.routing``, ``mq.datapaths.rdma.forksafe``), and the command prints them as rich tables or one JSON object.
Every section is gathered on its own, so one broken probe shows up as an ``error`` entry in
its section instead of failing the command; it must work on a laptop without GPU or RDMA.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Mapping

import click

import mq.datapaths.rdma.forksafe as forksafe
from mq.locality import Locality, local
from mq import auth as _auth
from mq.datapaths.rdma import engine as _rdma_mod
from mq.datapaths.base import PATHS
from mq.registry import backends
from mq.routing import select_route

__all__ = ["doctor", "report"]

_OTHER_BOOT_ID = "00000000-0000-0000-0000-000000000000"

def _section(fn: Callable[..., Any]) -> Any:  # called with no argument (`...`: mypy types lambdas with defaults)
    try:
        return fn()
    except Exception as exc:  # a broken probe is a finding, not a crash
        return {"error": f"{type(exc).__name__}: {exc}"}


def _torch() -> dict[str, Any]:
    try:
        import torch
    except ImportError as exc:
        return {"available": False, "version": None, "error": str(exc)}
    out: dict[str, Any] = {"available": True, "version": torch.__version__, "cuda_build": torch.version.cuda}
    try:
        import torch.distributed.rpc as rpc

        out["rpc_available"] = bool(rpc.is_available())
    except Exception as exc:
        out["rpc_available"] = False
        out["rpc_error"] = f"{type(exc).__name__}: {exc}"
    return out


def _backends(me: Locality, peers: Mapping[str, Locality]) -> dict[str, Any]:
    """Each backend: what it is, its mq types and routes, and its own section. The routes are
    its transport's and, for a backend whose nodes are processes (one ``mq run`` launches), the
    data paths' (``shm``, ``rdma``: any transport carries their descriptors)."""
    paths = set(PATHS) - {"nvlink"}  # (nvlink: only where the transport carries it, in its routes)
    return {b.name: {"summary": b.summary, "mq_types": list(b.mq_types),
                     "routes": sorted(set(b.routes) | (paths if b.launch is not None else set())),
                     "launchable": b.launch is not None, **_section(lambda b=b: b.doctor_section(me, peers))}
            for b in backends().values()}


def _plain(rep: Any) -> Any:
    """The report with the tables' colour markup (``[yellow]...[/yellow]``) taken out of its text."""
    from rich.text import Text

    if isinstance(rep, dict):
        return {k: _plain(v) for k, v in rep.items()}
    if isinstance(rep, list):
        return [_plain(v) for v in rep]
    if isinstance(rep, str) and "[/" in rep:
        return Text.from_markup(rep).plain
    return rep


def _gpus(me: Locality) -> dict[str, Any]:
    devices = [dataclasses.asdict(g) | {"p2p": list(g.p2p)} for g in me.gpus]
    # matrix[i][j]: GPU i can read GPU j peer to peer; None on the diagonal.
    matrix = [[None if g.index == h.index else h.index in g.p2p for h in me.gpus] for g in me.gpus]
    return {"count": len(devices), "devices": devices, "p2p_matrix": matrix}


def _gpu_pairs(me: Locality, probe_cuda: bool) -> dict[str, Any]:
    """Per GPU pair (i, j), i == j included: what decides the cuda_ipc route between a process on
    GPU i and one on GPU j of this host (GPU.md, "Route rule"). NVML adds compute mode and MIG;
    ``probe_cuda`` adds a two-process open of an mq pool (it spawns a process per pair)."""
    from mq.tools import gpu_probe

    gpus = {g.index: g for g in me.gpus}
    if not gpus:
        return {"count": 0, "pid_ns": me.pid_ns, "probed": False, "pairs": [], "note": "no GPU visible"}
    nvml = {d["uuid"]: d for d in gpu_probe.nvml_devices() or ()}  # compute mode and MIG

    def facts(g: Any) -> dict[str, Any]:
        d = nvml.get(g.uuid, {})
        return {"index": g.index, "uuid": g.uuid, "mig": d.get("mig", g.uuid.startswith("MIG-")),
                "compute_mode": d.get("compute_mode")}

    pairs = []
    for i, gi in gpus.items():
        for j, gj in gpus.items():
            if j < i:
                continue
            pair: dict[str, Any] = {"pair": [i, j], "gpus": [facts(gi), facts(gj)], "same_gpu": i == j,
                                    "p2p": None if i == j else [j in gi.p2p, i in gj.p2p],
                                    "pool_open": None}
            if probe_cuda:
                pair["pool_open"] = _section(lambda i=i, j=j: gpu_probe.pool_open(device=i, peer_device=j))
            pairs.append(pair)
    return {"count": len(gpus), "pid_ns": me.pid_ns, "probed": probe_cuda, "pairs": pairs}


def _rdma(me: Locality) -> dict[str, Any]:
    return {
        "devices": me.to_dict()["rdma"],
        "active_ports": [f"{name}:{port.port}" for name, port in me.active_rdma_ports()],
        "peermem": me.peermem,
        "path": _rdma_mod.state(me),  # mq's own rdma data path (NIXL/UCX), as rdma="auto" would be
    }


def _shm() -> dict[str, Any]:
    """Can this process make a shared-memory pool, and could a same-host peer open it?"""
    from mq.datapaths.shm.pool import Pool, PoolReader

    try:
        pool = Pool(max_bytes=1 << 20, label="doctor")
    except OSError as exc:
        return {"available": False, "why": f"cannot make a shared-memory pool here ({exc})"}
    try:
        why = PoolReader(0, pool.probe_info(), lambda *_: None).probe()
    finally:
        pool.close()
    if why:
        return {"available": False, "why": why}
    return {"available": True, "why": "memfd pool; same-host peers open it through /proc/<pid>/fd "
                                      "(same boot id, IPC and PID namespace); /dev/shm size does not matter"}


def _trust() -> dict[str, Any]:
    """mq's own trust state, and per backend what it leaves open that mq cannot close."""
    return _auth.state() | {b.name: b.trust_notes() for b in backends().values() if b.trust}


def _route(route: Any) -> dict[str, Any]:
    return {"kind": route.kind, "gpu": route.gpu, "gpudirect": route.gpudirect, "reason": route.reason}


def sample_peers(me: Locality) -> dict[str, Locality]:
    """A peer on this host (same descriptor, another pid) and one on another host (another boot id)."""
    other_boot = _OTHER_BOOT_ID if me.boot_id != _OTHER_BOOT_ID else "ffffffff-ffff-ffff-ffff-ffffffffffff"
    return {
        "local": dataclasses.replace(me, pid=(me.pid or 0) + 1),
        "remote": dataclasses.replace(me, pid=(me.pid or 0) + 1, boot_id=other_boot, hostname="remote-peer"),
    }


def report(locality: Locality | None = None, *, probe_cuda: bool = False) -> dict[str, Any]:
    """Everything ``mq doctor`` prints, as one JSON-safe dict.

    Keys: node, container, fork_safety, rdma, gpus, gpu_pairs, torch, backends, shm, trust,
    routes. ``probe_cuda`` opens an mq CUDA pool from a second process per GPU pair.
    ``backends`` holds each backend's summary and own section (torchrpc: ``tensorpipe``; nng:
    ``pynng``); routes hold, per backend whose nodes run in processes of their own, the route
    to a sample local and remote peer; ``trust[<backend>]`` what a backend leaves open that mq
    cannot close.
    """
    me = local() if locality is None else locality
    peers = sample_peers(me)
    shm = _section(_shm)
    data_paths = {"shm"} if shm.get("available") else set()
    routes = {
        b.name: {
            where: _section(lambda peer=peer, supported=b.routes | (b.data_paths & data_paths):
                            _route(select_route(me, peer, supported=supported)))
            for where, peer in peers.items()
        }
        for b in backends().values() if b.launch is not None
    }
    return {
        "node": _section(
            lambda: {
                k: v
                for k, v in me.to_dict().items()
                if k in ("hostname", "boot_id", "pid", "ipc_ns", "pid_ns", "net_ns", "mnt_ns", "interfaces")
            }
        ),
        "container": _section(lambda: me.to_dict()["container"]),
        "fork_safety": _section(lambda: forksafe.state(me)),
        "rdma": _section(lambda: _rdma(me)),
        "gpus": _section(lambda: _gpus(me)),
        "gpu_pairs": _section(lambda: _gpu_pairs(me, probe_cuda)),
        "torch": _section(_torch),
        "backends": _section(lambda: _backends(me, peers)),
        "shm": shm,
        "trust": _section(_trust),
        "routes": routes,
    }


def _render(rep: dict[str, Any]) -> None:
    from rich.console import Console

    console = Console()
    for section, render in _SECTIONS:
        value = rep[section]
        if isinstance(value, dict) and set(value) == {"error"}:
            console.print(f"[red]{section}: could not be read: {value['error']}[/red]")
        else:
            console.print(render(value))
    console.print(_software_table(rep))
    console.print(_routes_table(rep["routes"]))


def _node_tree(node: dict[str, Any]) -> Any:
    from rich.tree import Tree

    tree = Tree(f"[bold]node[/bold] {node['hostname']} pid {node['pid']}")
    tree.add(f"boot id {node['boot_id']}")
    tree.add("namespaces " + " ".join(str(node[k]) for k in ("ipc_ns", "pid_ns", "net_ns", "mnt_ns")))
    tree.add("interfaces " + (", ".join(node["interfaces"]) or "none"))
    return tree


def _container_tree(c: dict[str, Any]) -> Any:
    from rich.tree import Tree

    head = f"in a container ({c['runtime']})" if c["in_container"] else "not in a container"
    if c.get("container_id"):
        head += f", id {c['container_id'][:12]}"
    tree = Tree(f"[bold]container[/bold] {head}")
    for line in c["evidence"]:
        tree.add(line)
    return tree


def _fork_safety_tree(f: dict[str, Any]) -> Any:
    from rich.tree import Tree

    tree = Tree(f"[bold]fork safety[/bold] {'ok' if f['ok'] else '[red]NOT SAFE[/red]'}")
    for k, v in f["env"].items():
        tree.add(f"{k}={v if v is not None else '(unset)'}")
    tree.add(f"RDMA may be used: {f['rdma_may_be_used']}; started: {f['rdma_started']}; "
             f"start method: {f['start_method'] or '(default)'}")
    if f["advice"]:
        tree.add(f"[yellow]{f['advice']}[/yellow]")
    return tree


def _rdma_table(r: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title="RDMA devices", title_justify="left")
    for col in ("device", "port", "state", "phys state", "link layer", "rate"):
        table.add_column(col)
    for dev in r["devices"]:
        for p in dev["ports"] or [None]:
            if p is None:
                table.add_row(dev["name"], "-", "no ports", "", "", "")
            else:
                state = p["state"] if p["state"] != "ACTIVE" else "[green]ACTIVE[/green]"
                table.add_row(dev["name"], str(p["port"]), state, p["phys_state"], p["link_layer"], p["rate"])
    if not r["devices"]:
        table.add_row("none", "", "", "", "", "")
    path = r.get("path") or {}
    if path:
        engine = path.get("engine") or "NIXL not installed"
        how = (f"on, UCX on {path['device']}" if not path.get("off_because")
               else f"off: {path['off_because']}")
        table.caption = f"mq's rdma path (rdma='auto'): {engine}; {how}"
    return table


def _gpu_table(g: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title=f"GPUs ({g['count']}) and peer-to-peer access", title_justify="left")
    table.add_column("idx")
    table.add_column("name")
    table.add_column("uuid")
    for d in g["devices"]:
        table.add_column(f"P2P {d['index']}")
    for d, row in zip(g["devices"], g["p2p_matrix"]):
        cells = ["X" if v is None else ("OK" if v else "-") for v in row]
        table.add_row(str(d["index"]), d["name"], d["uuid"], *cells)
    if not g["devices"]:
        table.add_row("-", "no GPU visible", "")
    return table


def _gpu_pairs_table(g: dict[str, Any]) -> Any:
    from rich.table import Table

    probed = " (pool opened by a second process)" if g["probed"] else " (mq doctor --probe-cuda: also open a pool)"
    table = Table(title=f"GPU pairs for cuda_ipc, PID namespace {g['pid_ns']}{probed}", title_justify="left")
    for col in ("pair", "UUIDs", "P2P i->j / j->i", "MIG", "compute mode", "pool open"):
        table.add_column(col, overflow="fold")
    for p in g["pairs"]:
        a, b = p["gpus"]
        p2p = "same GPU" if p["same_gpu"] else " / ".join("OK" if v else "[red]no[/red]" for v in p["p2p"])
        mig = " / ".join("[red]on[/red]" if d["mig"] else "off" for d in p["gpus"])
        modes = " / ".join(str(d["compute_mode"] or "?") for d in p["gpus"])
        uuids = a["uuid"] if p["same_gpu"] else f"{a['uuid']}\n{b['uuid']}"
        table.add_row(f"{p['pair'][0]}-{p['pair'][1]}", uuids, p2p, mig, modes, _pool_open_cell(p["pool_open"]))
    if not g["pairs"]:
        table.add_row("-", "no GPU visible", "", "", "", "")
    return table


def _pool_open_cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return "-"
    if r.get("ok"):
        times = [f"{k.removesuffix('_ms').replace('_', ' ')} {v:.3g} ms" for k, v in r.items()
                 if k.endswith("_ms") and isinstance(v, (int, float))]
        return "ok" + (": " + ", ".join(times) if times else "")
    from rich.markup import escape

    why = escape(str(r.get("error")))
    return f"[red]failed: {why}[/red]" if r.get("ok") is False else why


#: The report's sections drawn one by one, each unless it could not be read.
_SECTIONS = (("node", _node_tree), ("container", _container_tree), ("fork_safety", _fork_safety_tree),
             ("rdma", _rdma_table), ("gpus", _gpu_table), ("gpu_pairs", _gpu_pairs_table))


def _software_table(rep: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title="software", title_justify="left")
    table.add_column("component")
    table.add_column("status")
    _torch_rows(table, rep["torch"])
    for name, b in rep["backends"].items() if "error" not in rep["backends"] else ():
        table.add_row(f"backend {name}", f"{b['summary']} (mq types {', '.join(b['mq_types'])})")
        if "error" in b:
            table.add_row("", f"[red]{b['error']}[/red]")
        for component, status in b.get("rows", ()):
            table.add_row(component, status)
    tr = rep["trust"]
    if "error" not in tr:
        table.add_row("trust", f"joins authenticated; secret from {tr['secret']}; {tr['opt_out']}")
        for name, notes in tr.items():
            if isinstance(notes, dict):
                for key, text in notes.items():
                    table.add_row(f"  {name}" if key == "summary" else "", f"[yellow]{text}[/yellow]")
    sh = rep["shm"]
    table.add_row("shm data path", ("available: " if sh.get("available") else "[yellow]unavailable[/yellow]: ")
                  + str(sh.get("why") or sh.get("error")))
    return table


def _torch_rows(table: Any, t: dict[str, Any]) -> None:
    if "error" in t and not t.get("available"):
        table.add_row("torch", f"[red]missing[/red] ({t['error']})")
    else:
        table.add_row("torch", f"{t.get('version')} (CUDA build {t.get('cuda_build') or 'none'})")
        table.add_row("torch.distributed.rpc", "available" if t.get("rpc_available") else "[red]unavailable[/red]")


def _routes_table(routes: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title="routes this node would take", title_justify="left", show_lines=True)
    for col in ("backend", "peer", "CPU", "GPU", "why"):
        table.add_column(col, overflow="fold")
    for backend, by_peer in routes.items():
        for where, r in by_peer.items():
            peer = "same host, other pid" if where == "local" else "other host"
            if "error" in r:
                table.add_row(backend, peer, "-", "-", f"[red]{r['error']}[/red]")
            else:
                gpu = r["gpu"] + (" + GPUDirect" if r["gpudirect"] else "")
                table.add_row(backend, peer, r["kind"], gpu, r["reason"])
    return table


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@click.option("--probe-cuda", is_flag=True,
              help="Also open an mq CUDA pool from a second process for each GPU pair, timed (spawns processes).")
def doctor(as_json: bool, probe_cuda: bool) -> None:
    """Show what this node sees: container, fork safety, RDMA, GPUs and GPU pairs, torch/TensorPipe, routes."""
    rep = report(probe_cuda=probe_cuda)
    if as_json:
        click.echo(json.dumps(_plain(rep), indent=2, sort_keys=True, default=str))
    else:
        _render(rep)
