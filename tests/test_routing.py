"""Route table on recorded descriptors: pure function, no hardware needed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mq.errors import ConfigError
from mq.locality import ContainerInfo, GpuInfo, Locality, RdmaDevice, read_rdma_devices
from mq.registry import backend_for
from mq.routing import (
    ALL_ROUTES,
    ROUTE_KINDS,
    Route,
    explain,
    select_route,
)
from mq.backends.torchrpc.tensorpipe import tensorpipe_options

pytestmark = pytest.mark.timeout(30)

SYSFS = Path(__file__).parent / "data" / "sysfs"
NNG = backend_for("nng").routes

BOOT_A = "3b9c4a62-5f0e-4d1a-9e7b-2c8d6f1a0b35"
BOOT_B = "9d0a7b51-2c3e-4f6a-8b9c-0d1e2f3a4b5c"
HOST_NS = dict(ipc_ns="ipc:[4026531839]", pid_ns="pid:[4026531836]", net_ns="net:[4026531840]", mnt_ns="mnt:[4026531841]")
ID_1 = "4f2a9c1bd0e83f7aa6b2c5d9e1f04a7b3c8d2e6f1a9b0c4d7e2f5a8b1c3d6e9f"
ID_2 = "8c1f0e5d2b7a4936c0e8f1d3b5a7c9e2f4a6b8d0c2e4f6a8b0d2f4a6c8e0b2d4"

H100 = "NVIDIA H100 80GB HBM3"
GPU_A, GPU_B = "GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000"
TWO_GPUS_P2P = (GpuInfo(0, GPU_A, H100, (1,)), GpuInfo(1, GPU_B, H100, (0,)))
TWO_GPUS_NO_P2P = (GpuInfo(0, GPU_A, H100, ()), GpuInfo(1, GPU_B, H100, ()))


def rdma(case: str) -> tuple[RdmaDevice, ...]:
    return read_rdma_devices(str(SYSFS / case))


def node(**kw) -> Locality:
    base = dict(hostname="gpu-node-7", boot_id=BOOT_A, pid=100, **HOST_NS)
    base.update(kw)
    return Locality(**base)


def docker(cid: str, n: int, **kw) -> Locality:
    """A process in docker container ``cid`` started with --ipc=host --network host."""
    return node(
        container=ContainerInfo(True, "docker", ("/.dockerenv exists",), cid),
        pid=1,
        pid_ns=f"pid:[40265325{n}2]",
        mnt_ns=f"mnt:[40265325{n}0]",
        **kw,
    )


def both_ways(a: Locality, b: Locality, **kw) -> Route:
    r, back = select_route(a, b, **kw), select_route(b, a, **kw)
    assert (r.kind, r.gpu, r.gpudirect) == (back.kind, back.gpu, back.gpudirect)
    return r


# --- the DESIGN table ---------------------------------------------------------------------------


def test_same_process_is_inproc():
    r = both_ways(node(), node())
    assert (r.kind, r.gpu) == ("inproc", "inproc")
    assert "same process" in r.reason


def test_same_pid_in_another_pid_namespace_is_not_same_process():
    r = both_ways(node(), node(pid_ns="pid:[4026532572]"))
    # nor shm: the peer's pool opens as /proc/<pid>/fd/<fd>, a path that names another process
    # there (in two containers both may be pid 7: the probe would open our own pool)
    assert r.kind == "ipc" and "not shm: same host but different PID namespace" in r.reason


def test_same_process_override():
    assert select_route(node(), node(pid=200), same_process=True).kind == "inproc"
    assert select_route(node(), node(), same_process=False).kind == "shm"


def test_same_host_same_container_gpus_with_p2p_take_nvlink():
    a = docker(ID_1, 1, gpus=TWO_GPUS_P2P)
    b = dataclasses.replace(a, pid=2)
    r = both_ways(a, b)
    assert (r.kind, r.gpu) == ("shm", "nvlink")
    assert "CUDA IPC" in r.reason


def test_same_host_bare_metal_p2p_pair_from_one_sides_view():
    # the peer only sees GPU B (CUDA_VISIBLE_DEVICES=1); our matrix says A <-> B works
    a = node(gpus=TWO_GPUS_P2P)
    b = node(pid=200, gpus=(GpuInfo(0, GPU_B, H100, ()),))
    r = both_ways(a, b)
    assert r.gpu == "nvlink"
    assert GPU_A in r.reason and GPU_B in r.reason


def test_same_physical_gpu_on_both_sides_takes_nvlink():
    a = node(gpus=(GpuInfo(0, GPU_A, H100),))
    r = both_ways(a, dataclasses.replace(a, pid=200))
    assert r.gpu == "nvlink"


def test_same_host_gpus_without_p2p_stage_through_shm():
    a = node(gpus=(GpuInfo(0, GPU_A, H100, ()),))
    b = node(pid=200, gpus=(GpuInfo(0, GPU_B, H100, ()),))
    r = both_ways(a, b)
    assert (r.kind, r.gpu) == ("shm", "shm")
    assert "no GPU pair with peer-to-peer access" in r.reason
    r = both_ways(node(gpus=TWO_GPUS_NO_P2P), node(pid=200, gpus=(GpuInfo(0, GPU_B, H100, ()),)))
    assert r.gpu == "nvlink"  # GPU B is visible on both sides: same device
    r = both_ways(node(gpus=(GpuInfo(0, GPU_A, H100, ()),)), node(pid=200, gpus=TWO_GPUS_NO_P2P[1:]))
    assert r.gpu == "shm"


def test_same_host_different_ipc_namespace_has_no_shared_memory():
    r = both_ways(node(), node(pid=200, ipc_ns="ipc:[4026532571]"))
    assert "same host but different IPC namespace: no shared memory" in r.reason
    assert r.kind == "ipc"  # same net and mount namespace: a unix socket still works
    r = both_ways(node(), node(pid=200, ipc_ns="ipc:[4026532571]", mnt_ns="mnt:[4026532570]"))
    assert r.kind == "tcp"
    assert "mount namespace" in r.reason


def test_same_host_across_containers_with_gpus_has_no_nvlink():
    a = docker(ID_1, 1, gpus=TWO_GPUS_P2P)
    b = docker(ID_2, 2, gpus=TWO_GPUS_P2P)
    r = both_ways(a, b)
    # --ipc=host alone does not give shared memory (--pid=host too: the pool's /proc path)
    assert (r.kind, r.gpu) == ("tcp", "tcp") and "different PID namespace" in r.reason
    assert "across containers" in r.reason and "CUDA IPC" in r.reason


def test_container_without_ids_is_judged_by_namespaces():
    a = docker(ID_1, 1, gpus=TWO_GPUS_P2P)
    a = dataclasses.replace(a, container=ContainerInfo(True, "docker", ("/.dockerenv exists",)))
    b = dataclasses.replace(a, pid=2)
    assert both_ways(a, b).gpu == "nvlink"  # same container: same pid and mount namespace
    c = node(pid=300, gpus=TWO_GPUS_P2P)  # a host process next to the container
    r = both_ways(a, c)
    assert r.gpu == "tcp" and "namespaces differ" in r.reason


def test_two_hosts_with_active_ports_take_rdma_with_gpudirect():
    a = node(rdma=rdma("active"), gpus=TWO_GPUS_P2P)
    b = node(boot_id=BOOT_B, hostname="gpu-node-8", rdma=rdma("active"), gpus=TWO_GPUS_P2P)
    r = both_ways(a, b)
    assert (r.kind, r.gpu, r.gpudirect) == ("rdma", "rdma", True)
    assert "GPUDirect" in r.reason
    assert "different boot ids" in r.reason


def test_rdma_without_gpu_on_one_side_is_staged():
    a = node(rdma=rdma("active"), gpus=TWO_GPUS_P2P)
    b = node(boot_id=BOOT_B, rdma=rdma("active"))
    r = both_ways(a, b)
    assert (r.kind, r.gpu, r.gpudirect) == ("rdma", "rdma", False)
    assert "staged through host" in r.reason


def test_rdma_without_peermem_is_staged():
    a = node(rdma=rdma("active"), gpus=TWO_GPUS_P2P, peermem=False)
    b = node(boot_id=BOOT_B, rdma=rdma("active"), gpus=TWO_GPUS_P2P, peermem=True)
    r = both_ways(a, b)
    assert (r.gpu, r.gpudirect) == ("rdma", False)
    assert "nvidia_peermem" in r.reason


def test_two_hosts_without_active_port_take_tcp():
    a = node(rdma=rdma("only_down"))
    b = node(boot_id=BOOT_B, rdma=rdma("active"))
    r = both_ways(a, b)
    assert (r.kind, r.gpu) == ("tcp", "tcp")
    assert "no ACTIVE RDMA port" in r.reason and "DOWN" in r.reason
    assert both_ways(node(rdma=rdma("no_infiniband")), node(boot_id=BOOT_B)).kind == "tcp"


def test_down_hca_next_to_active_still_counts_the_active_port():
    a = node(rdma=rdma("down_next_to_active"))
    b = node(boot_id=BOOT_B, rdma=rdma("down_next_to_active"))
    r = both_ways(a, b)
    assert r.kind == "rdma"
    assert "mlx5_0:1" in r.reason and "mlx5_1" not in r.reason


def test_rdma_link_layers_must_match():
    a = node(rdma=rdma("active"))  # InfiniBand
    b = node(boot_id=BOOT_B, rdma=rdma("roce_active"))  # Ethernet (RoCE)
    r = both_ways(a, b)
    assert r.kind == "tcp" and "no common link layer" in r.reason
    assert both_ways(node(rdma=rdma("roce_active")), node(boot_id=BOOT_B, rdma=rdma("roce_active"))).kind == "rdma"


def test_same_host_is_boot_id_plus_namespaces_never_hostname():
    r = both_ways(node(hostname="clone"), node(hostname="clone", boot_id=BOOT_B, pid=200))
    assert r.kind == "tcp"
    r = both_ways(node(hostname="a"), node(hostname="b", pid=200))
    assert r.kind == "shm"
    r = both_ways(node(), node(pid=200, net_ns="net:[4026532574]", ipc_ns="ipc:[4026532571]"))
    assert r.kind == "tcp"


def test_unknown_boot_id_is_never_the_same_host():
    r = both_ways(node(boot_id=None), node(boot_id=None, pid=200))
    assert r.kind == "tcp" and "boot id unknown" in r.reason
    r = both_ways(node(ipc_ns=None), node(ipc_ns=None, pid=200))
    assert r.kind == "ipc"


def test_old_peer_descriptor_still_routes():
    old = Locality.from_dict({"boot_id": BOOT_A, "pid": 4242})
    r = both_ways(node(), old)
    assert r.kind == "tcp"  # unknown namespaces never count as shared


# --- backend subsets ----------------------------------------------------------------------------


def test_nng_uses_ipc_where_the_table_says_shm_and_nvlink_for_gpu_payloads():
    # nvlink is mq's own cuda_ipc path: its descriptors ride any transport, NNG's too.
    r = both_ways(node(gpus=TWO_GPUS_P2P), node(pid=200, gpus=TWO_GPUS_P2P), supported=NNG)
    assert (r.kind, r.gpu) == ("ipc", "nvlink")
    assert "not shm: the backend does not support it" in r.reason
    r = both_ways(node(gpus=TWO_GPUS_P2P), node(pid=200, gpus=TWO_GPUS_P2P), supported=NNG - {"nvlink"})
    assert (r.kind, r.gpu) == ("ipc", "ipc")
    assert "not nvlink: the backend does not support it" in r.reason


# --- the nvlink rule of GPU.md ------------------------------------------------------------------


def test_nvlink_needs_the_same_pid_namespace_not_the_same_ipc_namespace():
    other_pid_ns = both_ways(node(gpus=TWO_GPUS_P2P), node(pid=200, pid_ns="pid:[4026532999]", gpus=TWO_GPUS_P2P))
    assert (other_pid_ns.kind, other_pid_ns.gpu) == ("ipc", "ipc")
    assert "different PID namespace" in other_pid_ns.reason
    other_ipc_ns = both_ways(node(gpus=TWO_GPUS_P2P), node(pid=200, ipc_ns="ipc:[4026532999]", gpus=TWO_GPUS_P2P))
    assert other_ipc_ns.gpu == "nvlink" and other_ipc_ns.kind != "shm"


def test_nvlink_is_refused_with_mig():
    mig = (GpuInfo(0, GPU_A, H100, (), mig=True),)
    r = both_ways(node(gpus=mig), node(pid=200, gpus=mig))
    assert (r.kind, r.gpu) == ("shm", "shm")
    assert "MIG" in r.reason


def test_nvlink_needs_a_gpu_on_both_sides_and_a_shared_or_p2p_pair():
    assert both_ways(node(gpus=TWO_GPUS_P2P), node(pid=200)).gpu == "shm"
    one_a, one_b = (GpuInfo(0, GPU_A, H100, ()),), (GpuInfo(0, GPU_B, H100, ()),)
    r = both_ways(node(gpus=one_a), node(pid=200, gpus=one_b))
    assert r.gpu == "shm" and "peer-to-peer" in r.reason
    assert both_ways(node(gpus=one_a), node(pid=200, gpus=one_a)).gpu == "nvlink"


def test_mig_survives_the_locality_round_trip():
    loc = node(gpus=(GpuInfo(0, GPU_A, H100, (), mig=True),))
    assert Locality.from_dict(loc.to_dict()).gpus[0].mig is True
    assert Locality.from_dict({**loc.to_dict(), "gpus": [{"index": 0, "uuid": GPU_A}]}).gpus[0].mig is False


def test_nng_same_process_is_inproc():
    assert select_route(node(), node(), supported=NNG).kind == "inproc"


def test_nng_skips_rdma_with_reason():
    a = node(rdma=rdma("active"))
    b = node(boot_id=BOOT_B, rdma=rdma("active"))
    r = both_ways(a, b, supported=NNG)
    assert r.kind == "tcp"
    assert "not rdma: the backend does not support it" in r.reason


def test_torchrpc_supports_everything():
    assert backend_for("torchrpc:cpu").routes == ALL_ROUTES == frozenset(ROUTE_KINDS)
    assert ROUTE_KINDS[0] == "inproc" and ROUTE_KINDS[-1] == "tcp"


def test_supported_errors():
    with pytest.raises(ConfigError, match="unknown route kind.*'udp'"):
        select_route(node(), node(), supported={"tcp", "udp"})
    with pytest.raises(ConfigError, match="no route to peer 3"):
        select_route(node(), node(boot_id=BOOT_B), supported={"shm"}, peer=3)


def test_peer_and_explain():
    r = select_route(node(), node(pid=200), peer=4)
    assert r.peer == 4
    text = explain(r)
    assert text.startswith("peer 4: shm") and r.reason in text


# --- symmetry property --------------------------------------------------------------------------

_GPU_POOL = [
    GpuInfo(0, GPU_A, H100, (1,)),
    GpuInfo(1, GPU_B, H100, (0,)),
    GpuInfo(0, GPU_B, H100, ()),
    GpuInfo(0, "GPU-cccc", H100, ()),
]
_RDMA_POOL = [(), rdma("active"), rdma("down_next_to_active"), rdma("only_down"), rdma("roce_active")]
_containers = st.sampled_from(
    [ContainerInfo(), ContainerInfo(True, "docker", ("/.dockerenv exists",), ID_1), ContainerInfo(True, "docker", (), ID_2), ContainerInfo(True, "podman", ())]
)
_descriptors = st.builds(
    Locality,
    boot_id=st.sampled_from([BOOT_A, BOOT_B, None]),
    pid=st.sampled_from([1, 2, None]),
    ipc_ns=st.sampled_from(["ipc:[1]", "ipc:[2]", None]),
    pid_ns=st.sampled_from(["pid:[1]", "pid:[2]", None]),
    net_ns=st.sampled_from(["net:[1]", "net:[2]", None]),
    mnt_ns=st.sampled_from(["mnt:[1]", "mnt:[2]", None]),
    container=_containers,
    gpus=st.lists(st.sampled_from(_GPU_POOL), max_size=2, unique=True).map(tuple),
    rdma=st.sampled_from(_RDMA_POOL),
    peermem=st.sampled_from([None, True, False]),
)
_supported = st.sets(st.sampled_from(ROUTE_KINDS)).map(lambda s: frozenset(s | {"tcp"}))


@settings(max_examples=300, deadline=None)
@given(_descriptors, _descriptors, _supported, st.sampled_from([None, True, False]))
def test_route_choice_is_symmetric(a, b, supported, same_process):
    ab = select_route(a, b, supported=supported, same_process=same_process)
    ba = select_route(b, a, supported=supported, same_process=same_process)
    assert (ab.kind, ab.gpu, ab.gpudirect) == (ba.kind, ba.gpu, ba.gpudirect)
    assert ab.kind in supported and ab.gpu in supported
    assert ab.kind != "nvlink"


# --- TensorPipe options -------------------------------------------------------------------------


def test_tensorpipe_cpu_same_host_no_rdma():
    me = node()
    opts = tensorpipe_options(me, {1: node(pid=200), 2: node(boot_id=BOOT_B)}, cuda=False)
    assert opts["_transports"] == ["shm", "uv"]
    assert opts["_channels"] == ["cma", "mpt_uv", "basic"]
    assert opts["env"] == {}
    assert "ibv" in opts["dropped"]


def test_frames_to_a_peer_without_cma_go_as_text_up_to_the_remote_inline_bound():
    from mq.backends.torchrpc.tensorpipe import inline_max
    from mq.backends.torchrpc.wire import INLINE_MAX, REMOTE_INLINE_MAX

    assert REMOTE_INLINE_MAX > INLINE_MAX
    me = node()
    assert inline_max(me, node(pid=200)) == INLINE_MAX  # same host and PID namespace: tensors take cma
    assert inline_max(me, node(pid=200, pid_ns="pid:[4026532999]")) == REMOTE_INLINE_MAX  # no cma
    assert inline_max(me, node(boot_id=BOOT_B)) == REMOTE_INLINE_MAX  # another host: mpt_uv
    assert inline_max(me, node(boot_id=None)) == REMOTE_INLINE_MAX  # unknown: as TensorPipe lists it
    assert inline_max(me, None) == REMOTE_INLINE_MAX


def test_tensorpipe_shm_transport_only_with_busy_poll():
    peers = {1: node(pid=200), 2: node(boot_id=BOOT_B)}
    assert "shm" in tensorpipe_options(node(), peers, cuda=False)["_transports"]
    opts = tensorpipe_options(node(), peers, cuda=False, busy_poll=False)
    assert opts["_transports"] == ["uv"]
    assert "busy_poll=False" in opts["dropped"]["shm"]


def test_tensorpipe_no_shm_when_ipc_namespace_differs_from_all_peers():
    opts = tensorpipe_options(node(), {1: node(pid=200, ipc_ns="ipc:[4026532571]"), 2: node(boot_id=BOOT_B)}, cuda=False)
    assert "shm" not in opts["_transports"]
    assert "IPC namespace" in opts["dropped"]["shm"]


def test_tensorpipe_ibv_only_with_active_port():
    peer = node(boot_id=BOOT_B, rdma=rdma("active"))
    assert "ibv" in tensorpipe_options(node(rdma=rdma("down_next_to_active")), {1: peer}, cuda=False)["_transports"]
    assert "ibv" not in tensorpipe_options(node(rdma=rdma("only_down")), {1: peer}, cuda=False)["_transports"]


def test_tensorpipe_cuda_channels():
    me = node(gpus=TWO_GPUS_P2P, rdma=rdma("active"))
    peers = {1: node(pid=200, gpus=TWO_GPUS_P2P), 2: node(boot_id=BOOT_B, gpus=TWO_GPUS_P2P, rdma=rdma("active"))}
    opts = tensorpipe_options(me, peers, cuda=True)
    # Same-host GPU tensors take mq's cuda_ipc path: never TensorPipe's cuda_ipc channel (GPU.md).
    assert opts["_channels"] == ["cuda_gdr", "cuda_basic", "cma", "mpt_uv", "basic"]
    assert "mq's cuda_ipc path" in opts["dropped"]["cuda_ipc"]
    assert opts["_transports"] == ["shm", "ibv", "uv"]
    cpu = tensorpipe_options(me, peers, cuda=False)
    assert not any(c.startswith("cuda") for c in cpu["_channels"])


def test_tensorpipe_no_cuda_ipc_across_containers_and_no_gdr_without_rdma():
    me = docker(ID_1, 1, gpus=TWO_GPUS_P2P)
    peers = {1: docker(ID_2, 2, gpus=TWO_GPUS_P2P), 2: node(boot_id=BOOT_B, gpus=TWO_GPUS_P2P)}
    opts = tensorpipe_options(me, peers, cuda=True)
    assert "cuda_ipc" not in opts["_channels"]
    assert "cuda_gdr" not in opts["_channels"]
    assert "cuda_basic" in opts["_channels"]


def test_tensorpipe_socket_ifname():
    me = node(interfaces=("eth0", "ib0", "lo"))
    # init_rpc's gloo group must take the interface too, or across hosts it times out where
    # the host name resolves to loopback (a container); a one-host job (lo) leaves gloo alone.
    assert tensorpipe_options(me, {}, cuda=False, socket_ifname="ib0")["env"] == {
        "TP_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0"}
    assert tensorpipe_options(me, {}, cuda=False, socket_ifname="lo")["env"] == {"TP_SOCKET_IFNAME": "lo"}
    with pytest.raises(ConfigError, match="'ib9' is not a network interface.*eth0, ib0, lo"):
        tensorpipe_options(me, {}, cuda=False, socket_ifname="ib9")


def test_torchrpc_cuda_gives_tensorpipe_no_device_map_for_nvlink_peers():
    # Same-host GPU payloads take mq's descriptors: TensorPipe needs no map (nor CUDA streams
    # per RPC) for those peers; peers on other hosts keep theirs.
    from types import SimpleNamespace

    from mq.backends.torchrpc.transport import TorchRpcTransport

    me = node(gpus=TWO_GPUS_P2P)
    remote = {1: node(pid=200, gpus=TWO_GPUS_P2P), 2: node(boot_id=BOOT_B, gpus=TWO_GPUS_P2P),
              3: node(pid=300, pid_ns="pid:[4026532999]", gpus=TWO_GPUS_P2P)}
    fake = SimpleNamespace(device="cuda", locality=me, routes=backend_for("torchrpc:cpu").routes,
                           device_maps={1: {0: 0}, 2: {0: 1}, 3: {1: 1}})
    assert TorchRpcTransport._maps_for_tensorpipe(fake, remote) == {2: {0: 1}, 3: {1: 1}}
    fake.device = "cpu"
    assert TorchRpcTransport._maps_for_tensorpipe(fake, remote) == {}
