"""The torchrpc transport's options (:class:`TorchRpcOptions`), validated once when made.

Every bad value is a :class:`~mq.errors.ConfigError` naming the option and the fix. What
depends on the node (its rank in ``world_size``, its row of the device map) is checked by
:meth:`TorchRpcOptions.device_maps_for` and the transport. The common options (``timeout``,
``heartbeat``, ...) are :class:`mq.MQ`'s, routed there by :func:`mq.create`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from mq.backends.torchrpc import device_map
from mq.backends.torchrpc.tensorpipe import check_socket_ifname, is_loopback
from mq.errors import ConfigError
from mq.locality import local
from mq.options import check_bool, check_choice, check_int, check_seconds
from mq.rendezvous import InitMethod, parse_init_method

DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class TorchRpcOptions:
    """The ``torchrpc:cpu`` and ``torchrpc:cuda`` mq types' own options (the mq type sets
    ``device``; see :func:`mq.create` for the common options).

    Args:
        device: ``"cpu"`` (CUDA tensors are staged through host memory) or ``"cuda"`` (CUDA
            tensors go device to device through TensorPipe device maps; needs a GPU).
        world_size: number of nodes in the job; node ids are 0 .. world_size-1. Default: the
            ``WORLD_SIZE`` of ``env://``.
        init_method: ``tcp://host:port`` (node 0 hosts the store), ``env://`` (MASTER_ADDR,
            MASTER_PORT), ``file:///path`` or ``ray://GROUP`` (nodes in Ray actors).
        local_cuda_devices: logical GPU indices this node uses (``torchrpc:cuda``).
        cuda_device_map: ``"1_0_1,2_0_2"``-style map (see :mod:`mq.backends.torchrpc.device_map`); default: each
            local GPU to the same index on every peer. Only with ``torchrpc:cuda``.
        rpc_timeout: seconds an RPC may take before the peer is declared lost; also torch's
            own join steps in ``init_rpc``. Default: ``max(60, timeout)``. Finding the other
            nodes at all is bounded by ``timeout``.
        num_worker_threads: TensorPipe's thread pool size.
        socket_ifname: network interface for TensorPipe's TCP transport (``TP_SOCKET_IFNAME``)
            and, unless it is ``lo`` or ``GLOO_SOCKET_IFNAME`` is set, for the gloo group
            ``init_rpc`` joins (``GLOO_SOCKET_IFNAME``).
            Default: ``lo`` when the store is on loopback (a one-host job: nothing off this
            host can reach the agent), else TensorPipe's choice.
        busy_poll: let TensorPipe carry frames to same-host peers over its ``shm`` transport,
            whose reactor thread busy-polls: each process spends one CPU core on it for as long
            as the queue listens, idle or not (measured: 99-100% of a core per idle process).
            False: those frames take loopback TCP instead, and an idle process sleeps; on the
            2-core reference VM a 1.25 KB round trip then took 1.41 instead of 0.94 ms. Large
            same-host buffers use mq's shared-memory pool either way. Turn it off where cores
            are scarce (collectors stepping environments next to the learner).
        send_window: frames in flight per peer before ``send`` waits (backpressure).
        send_window_bytes: bytes in flight per peer before ``send`` waits (a single larger frame
            still goes, alone).
        copy_threshold: frames with at most this many array/tensor bytes are copied and sent
            asynchronously; larger ones go without a copy and ``send`` waits until the peer has
            them. Either way the caller may modify its buffers once ``send`` returns.

    Liveness is the node's ``heartbeat`` (a core option): its pings are RPCs, and a peer whose
    RPC fails or that stays silent is lost.

    Raises:
        ConfigError: a bad option; ``torchrpc:cuda`` without a visible GPU; a device map with
            ``torchrpc:cpu``; torch without ``torch.distributed.rpc``.
    """

    device: str = "cpu"
    world_size: int | None = None
    init_method: str | None = None
    local_cuda_devices: Iterable[int] | None = None
    cuda_device_map: str | Mapping[int, Mapping[int, int]] | None = None
    rpc_timeout: float | None = None
    num_worker_threads: int = 16
    socket_ifname: str | None = None
    send_window: int = 64
    send_window_bytes: int = 256 << 20
    copy_threshold: int = 1 << 20
    busy_poll: bool = True
    spec: InitMethod | None = field(default=None, init=False, repr=False)

    @property
    def mq_type(self) -> str:
        return f"torchrpc:{self.device}"

    def __post_init__(self) -> None:
        check_choice(self.device, "device", DEVICES, " (mq types torchrpc:cpu, torchrpc:cuda)")
        _check_torch()
        set_ = object.__setattr__  # frozen: normalized once, here
        if self.init_method is None:
            raise ConfigError(f"{self.mq_type} needs init_method= (tcp://host:port, env:// or "
                              "file:///path), the same on every node")
        spec = parse_init_method(self.init_method)
        set_(self, "spec", spec)
        world_size = spec.world_size if self.world_size is None else self.world_size
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ConfigError(f"{self.mq_type} needs world_size= (the number of nodes, >= 1), "
                              f"got {world_size!r}")
        set_(self, "world_size", world_size)
        if self.rpc_timeout is not None:
            set_(self, "rpc_timeout", check_seconds(self.rpc_timeout, "rpc_timeout"))
        check_int(self.num_worker_threads, "num_worker_threads")
        check_int(self.send_window, "send_window")
        check_int(self.send_window_bytes, "send_window_bytes")
        check_int(self.copy_threshold, "copy_threshold", minimum=0, unit="bytes")
        check_bool(self.busy_poll, "busy_poll")
        set_(self, "socket_ifname", _socket_ifname(self.socket_ifname, spec))
        if self.local_cuda_devices is not None:
            set_(self, "local_cuda_devices",
                 tuple(device_map._check_device_list(self.local_cuda_devices, "local_cuda_devices")))
        if self.device == "cpu":
            device_map.reject_for_cpu(self.mq_type, self.cuda_device_map)
        else:
            _check_gpu()

    def device_maps_for(self, node_id: int) -> dict[int, dict[int, int]]:
        """This node's device map per peer (empty for ``torchrpc:cpu``)."""
        if self.device == "cpu":
            return {}
        assert self.world_size is not None
        return device_map.parse(self.cuda_device_map, node_id,
                                list(self.local_cuda_devices) if self.local_cuda_devices is not None else None,
                                peers=range(self.world_size))


def _socket_ifname(socket_ifname: Any, spec: InitMethod) -> str | None:
    # A job whose store is on loopback is a one-host job: TensorPipe then listens on lo only,
    # so nothing off this host can reach its agent (which accepts any connection).
    here = local()
    if socket_ifname is None and spec.scheme == "tcp" and is_loopback(spec.host):
        socket_ifname = "lo" if "lo" in here.interfaces else None
    if socket_ifname is not None:
        check_socket_ifname(here, socket_ifname)
    return socket_ifname


def _check_torch() -> None:
    import torch

    if not torch.distributed.is_available() or not torch.distributed.rpc.is_available():
        raise ConfigError("this torch build has no torch.distributed.rpc: install a torch "
                          "with distributed support, or use mq type nng")


def _check_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("mq type torchrpc:cuda needs a GPU, but none is visible to this "
                          "process (torch.cuda.is_available() is False; check "
                          "CUDA_VISIBLE_DEVICES and the driver); use torchrpc:cpu, which "
                          "stages GPU tensors through host memory")
