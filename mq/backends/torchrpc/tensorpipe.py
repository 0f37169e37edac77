"""What the torchrpc backend tells TensorPipe: which of its transports and channels to use,
and where its agent listens.

TensorPipe picks a transport and channels per pipe from one node-wide list, matching peers by
its own domain descriptors (mostly the boot id). Listing a transport or channel that cannot
work for a peer it nevertheless matches makes the pipe fail instead of falling back, so
:func:`tensorpipe_options` drops what the locality descriptors (:mod:`mq.locality`, judged with
the same facts as :mod:`mq.routing`) say would break: ``shm`` when no peer shares our IPC
namespace, ``ibv`` without an ACTIVE port here, ``cuda_gdr`` where GPUDirect RDMA is
impossible, and ``cuda_ipc`` always: same-host GPU tensors take mq's own cuda_ipc path.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any, Mapping

from mq.backends.torchrpc.wire import INLINE_MAX, REMOTE_INLINE_MAX
from mq.errors import ConfigError
from mq.locality import Locality
from mq.routing import known_same, rdma_ports_text

__all__ = ["TP_CHANNELS", "TP_TRANSPORTS", "inline_max", "must_restrict", "reachable_listen", "is_loopback",
           "check_socket_ifname", "tensorpipe_options"]

# TensorPipe's own names, in its priority order.
TP_TRANSPORTS = ("shm", "ibv", "uv")
TP_CHANNELS = ("cuda_ipc", "cuda_gdr", "cuda_basic", "cma", "mpt_uv", "basic")
_CUDA_CHANNELS = ("cuda_ipc", "cuda_gdr", "cuda_basic")


def tensorpipe_options(
    local: Locality,
    remote_by_peer: Mapping[int, Locality],
    *,
    cuda: bool,
    socket_ifname: str | None = None,
    busy_poll: bool = True,
) -> dict[str, Any]:
    """TensorPipe transports and channels that can work for this node and its peers.

    Args:
        local: this node's descriptor.
        remote_by_peer: each peer's descriptor, by node id.
        cuda: the backend moves CUDA tensors (``torchrpc:cuda``); False drops CUDA channels.
        socket_ifname: network interface TensorPipe's TCP transport should bind to (and, but
            for ``lo``, the gloo group that ``init_rpc`` joins).
        busy_poll: allow TensorPipe's ``shm`` transport, whose reactor thread spins: one CPU
            core per process for as long as the agent runs, idle or not. Without it same-host
            frames take loopback TCP (``uv``), slower per message but asleep when idle.

    Returns:
        ``{"_transports": [...], "_channels": [...], "env": {...}, "dropped": {name: why}}``;
        pass the first two to ``TensorPipeRpcBackendOptions`` and set ``env`` before
        ``init_rpc``.

    Raises:
        ConfigError: ``socket_ifname`` is not an interface of this node.
    """
    peers = list(remote_by_peer.values())
    dropped: dict[str, str] = {}
    transports = _transports(local, peers, busy_poll, dropped)
    channels = _channels(local, peers, cuda, dropped)
    env: dict[str, str] = {}
    if socket_ifname:
        env["TP_SOCKET_IFNAME"] = check_socket_ifname(local, socket_ifname)
        if socket_ifname != "lo":
            # init_rpc also joins a gloo group, which binds the address this host's name
            # resolves to (often 127.0.0.1 in a container): across hosts it must take the
            # same interface, or init_rpc times out ("Gloo connectFullMesh failed").
            env["GLOO_SOCKET_IFNAME"] = socket_ifname
    return {
        "_transports": [t for t in TP_TRANSPORTS if t in transports],
        "_channels": [c for c in TP_CHANNELS if c in channels],
        "env": env,
        "dropped": dropped,
    }


def check_socket_ifname(local: Locality, socket_ifname: str) -> str:
    """``socket_ifname`` if it is a network interface of this node (or interfaces are unknown)."""
    if local.interfaces and socket_ifname not in local.interfaces:
        raise ConfigError(
            f"socket_ifname {socket_ifname!r} is not a network interface of this node; "
            f"it has: {', '.join(local.interfaces)}"
        )
    return socket_ifname


def inline_max(local: Locality, remote: Locality | None) -> int:
    """The most buffer bytes a frame to ``remote`` carries as text rather than as RPC tensors:
    more where its tensors cannot take ``cma`` (another host, another PID namespace, or not
    known) and take the costlier ``mpt_uv`` (see :data:`~.wire.REMOTE_INLINE_MAX`)."""
    return INLINE_MAX if remote is not None and _can_cma(local, remote) else REMOTE_INLINE_MAX


def _can_cma(local: Locality, r: Locality) -> bool:
    return _same_host(local, r) and known_same(local.pid_ns, r.pid_ns)


def _same_host(local: Locality, r: Locality) -> bool:
    return known_same(local.boot_id, r.boot_id)


def _same_ipc(local: Locality, r: Locality) -> bool:
    return _same_host(local, r) and known_same(local.ipc_ns, r.ipc_ns)


def _transports(local: Locality, peers: list[Locality], busy_poll: bool, dropped: dict[str, str]) -> list[str]:
    transports = []
    if not any(_same_ipc(local, r) for r in peers):
        dropped["shm"] = "no peer shares this node's boot id and IPC namespace"
    elif not busy_poll:
        dropped["shm"] = "busy_poll=False (TensorPipe's shm transport spins a CPU core per process)"
    else:
        transports.append("shm")
    if local.active_rdma_ports():
        transports.append("ibv")
    else:
        dropped["ibv"] = f"no ACTIVE RDMA port on this node ({rdma_ports_text(local)})"
    transports.append("uv")
    return transports


def _channels(local: Locality, peers: list[Locality], cuda: bool, dropped: dict[str, str]) -> list[str]:
    channels = []
    if cuda and local.gpus:
        channels += _cuda_channels(local, peers, dropped)
    else:
        why = "no GPU on this node" if cuda else "CPU-only backend (cuda=False)"
        dropped.update({name: why for name in _CUDA_CHANNELS})
    if any(_can_cma(local, r) for r in peers):
        channels.append("cma")
    else:
        dropped["cma"] = "no peer shares this node's boot id and PID namespace"
    if any(not _same_host(local, r) for r in peers):
        channels.append("mpt_uv")
    else:
        dropped["mpt_uv"] = "every peer is on this host"
    channels.append("basic")
    return channels


def _cuda_channels(local: Locality, peers: list[Locality], dropped: dict[str, str]) -> list[str]:
    channels: list[str] = []
    # Same-host GPU tensors take mq's own cuda_ipc path (route nvlink, mq.datapaths.nvlink.path): the RPC
    # carries only CPU bytes for them. TensorPipe's channel would copy twice through a staging
    # outbox, and its negotiation can break a pipe even for CPU-only traffic (GPU.md).
    dropped["cuda_ipc"] = "same-host GPU tensors take mq's cuda_ipc path (route nvlink)"
    if not local.active_rdma_ports():
        dropped["cuda_gdr"] = "no ACTIVE RDMA port on this node"
    elif local.peermem is False:
        dropped["cuda_gdr"] = "nvidia_peermem not loaded on this node"
    elif not any(r.gpus and r.active_rdma_ports() and r.peermem is not False for r in peers):
        dropped["cuda_gdr"] = "no peer with both a GPU and an ACTIVE RDMA port"
    else:
        channels.append("cuda_gdr")
    channels.append("cuda_basic")
    return channels


def must_restrict(dropped: Mapping[str, str], local: Locality, remote: Mapping[int, Locality], *,
                  cuda: bool, busy_poll: bool) -> list[str]:
    """Dropped transports/channels TensorPipe would still try on its own (so the agent must be
    given the lists explicitly)."""
    needed = []
    if "shm" in dropped and not busy_poll:  # TensorPipe would take it for same-host peers
        needed.append("shm")
    if "ibv" in dropped and local.rdma:  # a device but no ACTIVE port: TensorPipe tries it
        needed.append("ibv")
    if cuda and local.gpus:
        same_host_gpu = any(r.boot_id == local.boot_id and r.gpus for r in remote.values())
        if "cuda_ipc" in dropped and same_host_gpu:
            needed.append("cuda_ipc")
        if "cuda_gdr" in dropped and local.active_rdma_ports():
            needed.append("cuda_gdr")
    return needed


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def reachable_listen(ifname: str | None) -> str | None:
    """Where TensorPipe's agent will listen when hosts other than this one can reach it, else
    None. It binds the address of interface ``TP_SOCKET_IFNAME``, or without one the address
    this host's name resolves to."""
    if ifname:
        return None if ifname == "lo" else f"interface {ifname}"
    host = socket.gethostname()
    return None if is_loopback(host) else f"the address of host name {host} (TensorPipe's default)"
