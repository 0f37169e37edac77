"""Route choice: a pure function of two locality descriptors.

Every node publishes a :class:`~mq.locality.Locality` at rendezvous; :func:`select_route`
compares ours with a peer's and returns the fastest route both sides can use, in the order of
:data:`ROUTE_KINDS`:

=========  ==================================================  =================================
route      viable when                                         GPU payloads
=========  ==================================================  =================================
inproc     same process (boot id, pid and PID namespace)       handed over, no copy
nvlink     (GPU only) same boot id and PID namespace, no    CUDA IPC, device to device
           MIG, the same GPU or a pair with P2P access
shm        same boot id, IPC and PID namespace                 staged through host shared memory
ipc        same boot id, network and mount namespace           staged through host, unix socket
           (the socket path must be visible to both)
rdma       both sides have an ACTIVE RDMA port on a common     GPUDirect RDMA where both sides
           link layer (a DOWN port next to it is ignored)      have GPUs, else staged
tcp        always                                              staged through host
=========  ==================================================  =================================

"Same host" is boot id plus namespaces, never the hostname: containers and cloned VMs share
hostnames, and two network namespaces on one kernel cannot reach each other's abstract sockets.
An unknown fact (None in a descriptor) never counts as shared, so a missing probe only ever
costs speed, not correctness.

Every viability test is symmetric (the same verdict for ``(a, b)`` and ``(b, a)``), so both
ends of a link pick the same route kind without talking about it, as TensorPipe's
``canCommunicateWithRemote`` contract requires. The facts routes are built from
(:func:`known_same`, :func:`across_containers`, :func:`p2p_pair`) serve backends that must make
the same judgements about their own engines.

A backend passes the route kinds it can carry as ``supported``; where the table says a route
the backend lacks, the next viable one is taken and the reason says which better one was
skipped and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

from mq.errors import ConfigError
from mq.locality import Locality

__all__ = [
    "ALL_ROUTES",
    "ROUTE_KINDS",
    "Route",
    "Verdict",
    "explain",
    "across_containers",
    "known_same",
    "p2p_pair",
    "rdma_ports_text",
    "select_route",
]

#: Every route kind, fastest first. ``nvlink`` only ever carries GPU payloads.
ROUTE_KINDS: tuple[str, ...] = ("inproc", "nvlink", "shm", "ipc", "rdma", "tcp")
ALL_ROUTES: frozenset[str] = frozenset(ROUTE_KINDS)

_CPU_CANDIDATES = ("inproc", "shm", "ipc", "rdma", "tcp")
_GPU_CANDIDATES = ("inproc", "nvlink", "shm", "ipc", "rdma", "tcp")


@dataclass(frozen=True)
class Route:
    """The route to one peer.

    Attributes:
        kind: route for CPU payloads: ``inproc``, ``shm``, ``ipc``, ``rdma`` or ``tcp``.
        gpu: route for GPU payloads: ``inproc``, ``nvlink`` (CUDA IPC), or the CPU route with
            tensors staged through host memory (``rdma`` with ``gpudirect`` skips the staging).
        reason: why this route, and why each faster one was not taken.
        peer: the peer's node id, when known.
        gpudirect: GPU payloads go NIC to GPU memory over RDMA, without a host copy.
    """

    kind: str
    gpu: str
    reason: str
    peer: int | None = None
    gpudirect: bool = False


@dataclass(frozen=True)
class Verdict:
    """Whether this node and a peer can use a data path (as the rdma path's ``viable`` says):
    decisions read ``ok`` and ``needs_device``; ``why`` is for people (``routes()``, ``mq doctor``).

    Attributes:
        ok: both ends can use it.
        why: why (not), in words.
        needs_device: it runs only where the route's device is (an ACTIVE RDMA port for rdma);
            False where it runs without one (rdma over UCX's tcp transport), so the route is
            taken where the device check alone would refuse it.
    """

    ok: bool
    why: str = ""
    needs_device: bool = True


def known_same(a: object, b: object) -> bool:
    """``a == b`` where both are known: an unknown fact (None) never matches, so routing never
    assumes what it could not read."""
    return a is not None and a == b


class _Pair:
    """Facts about two descriptors that several routes need; computed once per call."""

    def __init__(self, a: Locality, b: Locality, same_process: bool | None):
        self.a, self.b = a, b
        self.same_boot = known_same(a.boot_id, b.boot_id)
        if same_process is None:
            same_process = self.same_boot and known_same(a.pid, b.pid) and known_same(a.pid_ns, b.pid_ns)
        self.same_process = same_process

    def host_why(self) -> str | None:
        """Why these two are not on one kernel, or None when they are."""
        if self.same_boot:
            return None
        if self.a.boot_id is None or self.b.boot_id is None:
            return "boot id unknown on one side: cannot prove the same host"
        return "different boot ids: different hosts"


def _inproc(p: _Pair) -> tuple[bool, str]:
    return (True, "same process") if p.same_process else (False, "different processes")


def _shm(p: _Pair) -> tuple[bool, str]:
    why = p.host_why()
    if why:
        return False, why
    if not known_same(p.a.ipc_ns, p.b.ipc_ns):
        return False, "same host but different IPC namespace: no shared memory"
    if not known_same(p.a.pid_ns, p.b.pid_ns):  # a pool opens by /proc/<pid>/fd/<fd>
        return False, ("same host but different PID namespace: the pool's /proc/<pid>/fd path "
                       "names another process (docker: --pid=host beside --ipc=host)")
    return True, "same boot id, IPC and PID namespace: shared memory"


def _ipc(p: _Pair) -> tuple[bool, str]:
    why = p.host_why()
    if why:
        return False, why
    if not known_same(p.a.net_ns, p.b.net_ns):
        return False, "same host but different network namespace: unix sockets unreachable"
    if not known_same(p.a.mnt_ns, p.b.mnt_ns):
        return False, "same host but different mount namespace: a unix socket path is not visible"
    return True, "same boot id, network and mount namespace: unix socket"


def across_containers(a: Locality, b: Locality) -> str | None:
    """Why CUDA IPC would break between ``a`` and ``b`` because of containers, or None.

    CUDA IPC handles are only usable from processes the driver can see as neighbours; across
    container boundaries (separate PID/mount namespaces) opening them fails, even with a shared
    IPC namespace. Outside containers we trust the namespaces to be set up on purpose.
    """
    if not (a.container.in_container or b.container.in_container):
        return None
    ids = (a.container.container_id, b.container.container_id)
    if all(ids) and ids[0] != ids[1]:  # (the ignore: all() made both a str)
        return f"across containers ({ids[0][:12]} vs {ids[1][:12]}): CUDA IPC breaks there"  # type: ignore[index]
    differ = [ns for ns in ("pid_ns", "mnt_ns") if not known_same(getattr(a, ns), getattr(b, ns))]
    if differ:
        names = " and ".join(ns.replace("_ns", "") for ns in differ)
        runtime = a.container.runtime or b.container.runtime
        return f"across containers ({runtime}; {names} namespaces differ): CUDA IPC breaks there"
    return None


def p2p_pair(a: Locality, b: Locality) -> tuple[str, str] | None:
    """A (uuid on a, uuid on b) pair CUDA IPC can join, or None.

    The same physical GPU seen from both sides always works; otherwise either side's P2P
    matrix must connect one of its GPUs to a GPU (by UUID) the other side uses. Checking both
    views keeps the test symmetric.
    """
    for side, other, flip in ((a, b, False), (b, a, True)):
        index_of = {g.uuid: g.index for g in side.gpus}
        for g in side.gpus:
            for h in other.gpus:
                if g.uuid == h.uuid or index_of.get(h.uuid) in g.p2p:
                    return (h.uuid, g.uuid) if flip else (g.uuid, h.uuid)
    return None


def _nvlink(p: _Pair) -> tuple[bool, str]:
    """CUDA IPC (GPU.md): one kernel, one PID namespace (the driver refuses handles across
    PID namespaces, whatever the IPC namespace), no MIG, and a GPU pair the two can share."""
    why = p.host_why()
    if why:
        return False, why
    if not known_same(p.a.pid_ns, p.b.pid_ns):
        reason = "same host but different PID namespace: CUDA IPC refuses handles across them"
        containers = across_containers(p.a, p.b)
        return False, f"{reason} ({containers})" if containers else reason
    if not p.a.gpus:
        return False, "no GPU on this node"
    if not p.b.gpus:
        return False, "no GPU on the peer"
    mig = [g.uuid for g in (*p.a.gpus, *p.b.gpus) if g.mig]
    if mig:
        return False, f"MIG on {mig[0]}: no CUDA IPC with MIG"
    pair = p2p_pair(p.a, p.b)
    if pair is None:
        return False, "no GPU pair with peer-to-peer access between the two processes"
    if pair[0] == pair[1]:
        return True, f"same host, both use {pair[0]}: CUDA IPC"
    return True, f"same host, {pair[0]} <-> {pair[1]} have P2P access: CUDA IPC"


def rdma_ports_text(loc: Locality) -> str:
    """Every RDMA port of ``loc`` and its state, for reasons ("mlx5_0:1 DOWN")."""
    return ", ".join(f"{d.name}:{p.port} {p.state}" for d in loc.rdma for p in d.ports) or "no RDMA device"


def _rdma(p: _Pair) -> tuple[bool, str]:
    active_a, active_b = p.a.active_rdma_ports(), p.b.active_rdma_ports()
    if not active_a:
        return False, f"no ACTIVE RDMA port on this node ({rdma_ports_text(p.a)})"
    if not active_b:
        return False, f"no ACTIVE RDMA port on the peer ({rdma_ports_text(p.b)})"
    layers_a = {port.link_layer for _, port in active_a}
    layers_b = {port.link_layer for _, port in active_b}
    # An unknown link layer ("") is given the benefit of the doubt; a known mismatch
    # (InfiniBand here, RoCE there) cannot talk.
    if not ("" in layers_a or "" in layers_b or layers_a & layers_b):
        return False, (
            f"ACTIVE RDMA ports on both sides but no common link layer "
            f"({'/'.join(sorted(layers_a))} here, {'/'.join(sorted(layers_b))} on the peer)"
        )
    here = ", ".join(f"{name}:{port.port}" for name, port in active_a)
    there = ", ".join(f"{name}:{port.port}" for name, port in active_b)
    return True, f"ACTIVE RDMA ports on both sides ({here} here, {there} on the peer)"


def _tcp(p: _Pair) -> tuple[bool, str]:
    return True, "always available"


_CHECKS = {
    "inproc": _inproc,
    "nvlink": _nvlink,
    "shm": _shm,
    "ipc": _ipc,
    "rdma": _rdma,
    "tcp": _tcp,
}


def _gpudirect(p: _Pair) -> tuple[bool, str]:
    """Whether GPU payloads on an rdma route can skip the host copy."""
    if not p.a.gpus or not p.b.gpus:
        side = "this node" if not p.a.gpus else "the peer"
        return False, f"staged through host (no GPU on {side})"
    if p.a.peermem is False or p.b.peermem is False:
        side = "this node" if p.a.peermem is False else "the peer"
        return False, f"staged through host (nvidia_peermem not loaded on {side})"
    return True, "with GPUDirect RDMA (GPUs on both sides)"


def _walk(
    candidates: tuple[str, ...], p: _Pair, supported: frozenset[str]
) -> tuple[str, str, list[tuple[str, str]]] | None:
    """First viable and supported candidate: (kind, why, [(skipped kind, why not)])."""
    skipped: list[tuple[str, str]] = []
    for kind in candidates:
        ok, why = _CHECKS[kind](p)
        if ok and kind in supported:
            return kind, why, skipped
        skipped.append((kind, why if not ok else f"the backend does not support it ({why})"))
    return None


def _skips(skipped: list[tuple[str, str]]) -> str:
    return "".join(f"; not {kind}: {why}" for kind, why in skipped)


def select_route(
    local: Locality,
    remote: Locality,
    *,
    supported: Collection[str] = ALL_ROUTES,
    same_process: bool | None = None,
    peer: int | None = None,
) -> Route:
    """Pick the fastest route from ``local`` to ``remote`` that the backend can carry.

    Pure and symmetric: ``select_route(a, b).kind == select_route(b, a).kind`` (and the same for
    ``gpu``), so two peers agree without negotiating.

    Args:
        local: this node's descriptor.
        remote: the peer's descriptor.
        supported: route kinds the calling backend can use (its ``Backend.routes``).
        same_process: override the same-process test (boot id, pid and PID namespace equal),
            e.g. for two queues one test creates in one process with fake descriptors.
        peer: the peer's node id, copied into the result.

    Returns:
        The chosen :class:`Route`, whose ``reason`` names each faster route and why it was not
        taken.

    Raises:
        ConfigError: ``supported`` names an unknown route kind, or leaves no viable route.
    """
    supported = frozenset(supported)
    unknown = supported - ALL_ROUTES
    if unknown:
        raise ConfigError(
            f"unknown route kind(s) {sorted(unknown)} in supported; known: {', '.join(ROUTE_KINDS)}"
        )
    p = _Pair(local, remote, same_process)
    cpu = _walk(_CPU_CANDIDATES, p, supported)
    gpu = _walk(_GPU_CANDIDATES, p, supported)
    if cpu is None or gpu is None:
        viable = [k for k in _GPU_CANDIDATES if _CHECKS[k](p)[0]]
        raise ConfigError(
            f"no route to peer {peer if peer is not None else '?'}: the backend supports only "
            f"{sorted(supported)}, but only {viable} can reach it; include 'tcp' (always viable)"
        )
    kind, why, skipped = cpu
    gpu_kind, gpu_why, gpu_skipped = gpu

    gpudirect = False
    if gpu_kind == "rdma":
        gpudirect, gpu_why = _gpudirect(p)
    elif gpu_kind in ("shm", "ipc", "tcp"):
        gpu_why = "staged through host"
    # The GPU walk repeats most of the CPU walk's skips; only list the ones that differ.
    gpu_only = [s for s in gpu_skipped if s not in skipped]
    if gpu_kind == kind and not gpu_only:
        gpu_text = f"{gpu_kind}, {gpu_why}" if kind != "inproc" else "inproc"
    else:
        gpu_text = f"{gpu_kind}, {gpu_why}{_skips(gpu_only)}"
    reason = f"{kind}: {why}{_skips(skipped)}. GPU payloads: {gpu_text}"
    return Route(kind=kind, gpu=gpu_kind, reason=reason, peer=peer, gpudirect=gpudirect)


def explain(route: Route) -> str:
    """One human line: where the route goes, what it carries, and why."""
    to = f"peer {route.peer}" if route.peer is not None else "peer"
    gpu = route.gpu + (" + GPUDirect" if route.gpudirect else "")
    return f"{to}: {route.kind} (GPU: {gpu}) because {route.reason}"
