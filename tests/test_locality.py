"""Locality readers on recorded /proc and /sys trees, the wire form, and the live machine."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mq.locality as L
from mq.errors import ProtocolError
from mq.locality import ContainerInfo, GpuInfo, Locality, RdmaDevice, RdmaPort

pytestmark = pytest.mark.timeout(30)

DATA = Path(__file__).parent / "data"
SYSFS = DATA / "sysfs"
CONTAINERS = DATA / "locality" / "containers"
DESCRIPTORS = DATA / "locality" / "descriptors"
DOCKER_ID = "4f2a9c1bd0e83f7aa6b2c5d9e1f04a7b3c8d2e6f1a9b0c4d7e2f5a8b1c3d6e9f"


# --- RDMA devices from recorded sysfs trees ----------------------------------------------------


def test_rdma_active_port():
    (dev,) = L.read_rdma_devices(str(SYSFS / "active"))
    assert dev == RdmaDevice(
        "mlx5_0", (RdmaPort(1, "ACTIVE", "InfiniBand", "LinkUp", "200 Gb/sec (4X HDR)"),)
    )


def test_rdma_down_next_to_active_keeps_both_and_only_active_counts():
    devices = L.read_rdma_devices(str(SYSFS / "down_next_to_active"))
    assert [(d.name, [p.state for p in d.ports]) for d in devices] == [
        ("mlx5_0", ["ACTIVE"]),
        ("mlx5_1", ["DOWN"]),
    ]
    loc = Locality(rdma=devices)
    assert [(name, p.port) for name, p in loc.active_rdma_ports()] == [("mlx5_0", 1)]


def test_rdma_only_down_has_no_active_port():
    devices = L.read_rdma_devices(str(SYSFS / "only_down"))
    assert [p.state for d in devices for p in d.ports] == ["DOWN", "DOWN"]
    assert [p.phys_state for d in devices for p in d.ports] == ["Polling", "Disabled"]
    assert Locality(rdma=devices).active_rdma_ports() == ()


def test_rdma_no_infiniband_dir():
    assert L.read_rdma_devices(str(SYSFS / "no_infiniband")) == ()
    assert L.read_rdma_devices("/nonexistent-root") == ()


def test_roce_link_layer():
    (dev,) = L.read_rdma_devices(str(SYSFS / "roce_active"))
    assert dev.ports[0].link_layer == "Ethernet"


def test_interfaces():
    assert L.read_interfaces(str(SYSFS / "down_next_to_active")) == ("eth0", "ib0", "ib1", "lo")
    assert L.read_interfaces("/nonexistent-root") == ()


# --- container detection ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case, runtime, must_mention, container_id",
    [
        ("docker_v1", "docker", ["/.dockerenv exists", f"12:pids:/docker/{DOCKER_ID}", "/var/lib/docker/containers/"], DOCKER_ID),
        ("docker_v2", "docker", [f"0::/system.slice/docker-{DOCKER_ID}.scope", "overlay root"], DOCKER_ID),
        ("docker_v2_private_cgroupns", "docker", ["/.dockerenv exists", "/var/lib/docker/containers/"], DOCKER_ID),
        ("podman", "podman", ["/run/.containerenv exists", "/overlay-containers/"], "8c1f0e5d2b7a4936c0e8f1d3b5a7c9e2f4a6b8d0c2e4f6a8b0d2f4a6c8e0b2d4"),
        ("k8s", "kubernetes", ["/kubepods/burstable/", "/var/lib/kubelet/pods/"], "0123456789abcdef" * 4),
    ],
)
def test_detect_container(case, runtime, must_mention, container_id):
    info = L.detect_container(str(CONTAINERS / case), environ={})
    assert info.in_container
    assert info.runtime == runtime
    text = "\n".join(info.evidence)
    for needle in must_mention:
        assert needle in text
    assert info.container_id == container_id
    # one evidence line per source, however many cgroup controllers repeat the path
    assert len(info.evidence) == len(set(info.evidence)) <= 6


@pytest.mark.parametrize("case", ["bare_metal", "bare_metal_dockerd"])
def test_bare_metal_is_not_a_container(case):
    assert L.detect_container(str(CONTAINERS / case), environ={}) == ContainerInfo()


def test_kubernetes_env_alone_is_evidence():
    info = L.detect_container(str(CONTAINERS / "bare_metal"), environ={"KUBERNETES_SERVICE_HOST": "10.96.0.1"})
    assert info.in_container and info.runtime == "kubernetes"
    assert info.evidence == ("KUBERNETES_SERVICE_HOST=10.96.0.1",)


def test_container_env_variable_and_mq_marker():
    info = L.detect_container(str(CONTAINERS / "bare_metal"), environ={"container": "lxc"})
    assert (info.in_container, info.runtime) == (True, "lxc")
    info = L.detect_container(str(CONTAINERS / "bare_metal"), environ={"MQ_CONTAINER": "mq-cpu"})
    assert info.in_container and info.evidence == ("MQ_CONTAINER=mq-cpu",)


def test_kubernetes_wins_over_docker_runtime():
    info = L.detect_container(str(CONTAINERS / "docker_v1"), environ={"KUBERNETES_SERVICE_HOST": "10.96.0.1"})
    assert info.runtime == "kubernetes"
    assert "/.dockerenv exists" in info.evidence


# --- describe() on a recorded tree and on this machine -----------------------------------------


def test_describe_recorded_tree(monkeypatch):
    monkeypatch.setattr(L, "probe_gpus", lambda **kw: pytest.fail("GPUs probed for a recorded tree"))
    loc = L.describe(root=str(CONTAINERS / "podman"), environ={"IBV_FORK_SAFE": "1"}, probe_gpus=False)
    assert loc.hostname == "collector-1"
    assert loc.boot_id == "3b9c4a62-5f0e-4d1a-9e7b-2c8d6f1a0b35"
    assert (loc.ipc_ns, loc.pid_ns, loc.net_ns, loc.mnt_ns) == (
        "ipc:[4026532871]",
        "pid:[4026532872]",
        "net:[4026532874]",
        "mnt:[4026532870]",
    )
    assert loc.container.runtime == "podman"
    assert loc.fork_safe
    assert loc.pid == os.getpid()


def test_describe_recorded_tree_never_probes_live_gpus():
    # root != "/" must not report the live machine's GPUs as the recorded tree's
    assert L.probe_gpus(root=str(CONTAINERS / "podman")) == ()


def test_describe_missing_root_does_not_raise():
    loc = L.describe(root="/nonexistent-root", environ={})
    assert loc.boot_id is None and loc.ipc_ns is None and loc.rdma == () and not loc.container.in_container


def test_describe_live_machine():
    loc = L.describe()
    assert loc.pid == os.getpid()
    # sandboxes may hide /proc/self/ns; when readable, ids look like the kernel's links
    for ns in (loc.ipc_ns, loc.pid_ns, loc.net_ns, loc.mnt_ns):
        assert ns is None or ns.endswith("]")
    nvidia, rocm = L._gpu_drivers()
    if not (nvidia or rocm):
        assert loc.gpus == ()
    json.dumps(loc.to_dict())


def test_fork_safe_means_either_variable_present():
    assert L.describe(root="/nonexistent-root", environ={"RDMAV_FORK_SAFE": "1"}).fork_safe
    assert not L.describe(root="/nonexistent-root", environ={}).fork_safe


def test_local_is_cached_per_process(monkeypatch):
    a = L.local()
    assert L.local() is a
    # a forked child has another pid: it must describe itself, not reuse the parent's result
    monkeypatch.setattr(L.os, "getpid", lambda: a.pid + 100000)
    b = L.local()
    assert b is not a and b.pid == a.pid + 100000


# --- GPU probing without GPUs ------------------------------------------------------------------


def test_probe_gpus_without_driver_is_empty_and_imports_nothing(monkeypatch):
    monkeypatch.setattr(L, "_gpu_drivers", lambda: (False, False))
    monkeypatch.setitem(sys.modules, "pynvml", None)  # an import would raise ImportError
    assert L.probe_gpus() == ()


def _fake_pynvml(uuids, p2p_ok):
    class NVMLError(Exception):
        pass

    m = types.SimpleNamespace(
        NVMLError=NVMLError,
        NVML_P2P_CAPS_INDEX_READ=0,
        NVML_P2P_STATUS_OK=0,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(uuids),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUUID=lambda h: uuids[h],
        nvmlDeviceGetName=lambda h: b"NVIDIA H100 80GB HBM3",
        nvmlDeviceGetP2PStatus=lambda a, b, cap: 0 if (a, b) in p2p_ok else 4,
    )
    return m


def test_probe_gpus_nvml_respects_cuda_visible_devices(monkeypatch):
    uuids = ["GPU-aaaa", "GPU-bbbb", "GPU-cccc"]
    p2p = {(0, 1), (1, 0), (1, 2), (2, 1)}
    monkeypatch.setattr(L, "_gpu_drivers", lambda: (True, False))
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(uuids, p2p))
    all_gpus = L.probe_gpus(environ={})
    assert [(g.index, g.uuid, g.p2p) for g in all_gpus] == [
        (0, "GPU-aaaa", (1,)),
        (1, "GPU-bbbb", (0, 2)),
        (2, "GPU-cccc", (1,)),
    ]
    assert all_gpus[0].name == "NVIDIA H100 80GB HBM3"
    # logical indices follow CUDA_VISIBLE_DEVICES order; p2p uses logical indices too
    gpus = L.probe_gpus(environ={"CUDA_VISIBLE_DEVICES": "2,GPU-bbbb"})
    assert [(g.index, g.uuid, g.p2p) for g in gpus] == [(0, "GPU-cccc", (1,)), (1, "GPU-bbbb", (0,))]
    assert L.probe_gpus(environ={"CUDA_VISIBLE_DEVICES": ""}) == ()
    # CUDA stops at the first entry it cannot resolve
    assert [g.uuid for g in L.probe_gpus(environ={"CUDA_VISIBLE_DEVICES": "0,7,1"})] == ["GPU-aaaa"]


def test_probe_gpus_never_raises_when_nvml_breaks(monkeypatch):
    broken = _fake_pynvml(["GPU-aaaa"], set())

    def boom():
        raise broken.NVMLError("driver/library version mismatch")

    broken.nvmlInit = boom
    monkeypatch.setattr(L, "_gpu_drivers", lambda: (True, False))
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    assert isinstance(L.probe_gpus(environ={}), tuple)


# --- wire form ----------------------------------------------------------------------------------

RICH = Locality(
    hostname="learner-0",
    boot_id="9d0a7b51-2c3e-4f6a-8b9c-0d1e2f3a4b5c",
    pid=17,
    ipc_ns="ipc:[4026532571]",
    pid_ns="pid:[4026532572]",
    net_ns="net:[4026531840]",
    mnt_ns="mnt:[4026532570]",
    container=ContainerInfo(True, "docker", ("/.dockerenv exists",), DOCKER_ID),
    gpus=(GpuInfo(0, "GPU-aaaa", "H100", (1,)), GpuInfo(1, "GPU-bbbb", "H100", (0,))),
    rdma=(RdmaDevice("mlx5_0", (RdmaPort(1, "ACTIVE", "InfiniBand", "LinkUp", "400 Gb/sec (4X NDR)"),)),),
    fork_safe=True,
    interfaces=("eth0", "ib0", "lo"),
    peermem=True,
)


def _only_plain(value) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _only_plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_only_plain(v) for v in value)
    return value is None or isinstance(value, (str, int, bool))


def test_to_dict_is_plain_and_round_trips():
    d = RICH.to_dict()
    assert _only_plain(d)
    assert Locality.from_dict(d) == RICH
    assert Locality.from_dict(json.loads(json.dumps(d))) == RICH
    msgpack = pytest.importorskip("msgpack")
    assert Locality.from_dict(msgpack.unpackb(msgpack.packb(d))) == RICH


def test_from_dict_old_peer_gets_defaults():
    loc = Locality.from_dict(json.loads((DESCRIPTORS / "old_peer.json").read_text()))
    assert loc.pid_ns is None and loc.net_ns is None and loc.mnt_ns is None
    assert loc.container == ContainerInfo()
    assert loc.gpus == (GpuInfo(0, "GPU-1f2e3d4c-0000-1111-2222-333344445555"),)
    assert loc.rdma[0].ports == (RdmaPort(1, "ACTIVE"),)
    assert loc.fork_safe is False and loc.interfaces == () and loc.peermem is None
    assert Locality.from_dict({}) == Locality()


def test_from_dict_newer_peer_ignores_unknown_keys():
    loc = Locality.from_dict(json.loads((DESCRIPTORS / "newer_peer.json").read_text()))
    assert loc.gpus[1].p2p == (0,)
    assert loc.rdma[0].ports[0].rate == "400 Gb/sec (4X NDR)"
    assert loc.container.runtime == "docker"


@pytest.mark.parametrize(
    "bad, path",
    [
        ({"pid": "17"}, "$.pid"),
        ({"pid": True}, "$.pid"),
        ({"gpus": [{"index": 0}]}, "$.gpus[0]"),
        ({"gpus": [{"index": "0", "uuid": "GPU-a"}]}, "$.gpus[0].index"),
        ({"rdma": [{"name": "mlx5_0", "ports": [{"port": 1, "state": 4}]}]}, "$.rdma[0].ports[0].state"),
        ({"container": ["docker"]}, "$.container"),
        ({"interfaces": "eth0"}, "$.interfaces"),
    ],
)
def test_from_dict_names_the_bad_field(bad, path):
    with pytest.raises(ProtocolError, match=path.replace("[", r"\[").replace("$", r"\$")):
        Locality.from_dict(bad)


def test_from_dict_rejects_non_mapping():
    with pytest.raises(ProtocolError, match="mapping"):
        Locality.from_dict(["not", "a", "dict"])  # type: ignore[arg-type]


_text = st.text(min_size=0, max_size=8)
_port = st.builds(RdmaPort, st.integers(1, 4), st.sampled_from(["ACTIVE", "DOWN", "INIT"]), _text, _text, _text)
_localities = st.builds(
    Locality,
    hostname=_text,
    boot_id=st.none() | _text,
    pid=st.none() | st.integers(0, 2**31),
    ipc_ns=st.none() | _text,
    pid_ns=st.none() | _text,
    net_ns=st.none() | _text,
    mnt_ns=st.none() | _text,
    container=st.builds(ContainerInfo, st.booleans(), st.none() | _text, st.tuples(_text), st.none() | _text),
    gpus=st.lists(st.builds(GpuInfo, st.integers(0, 7), _text, _text, st.lists(st.integers(0, 7)).map(tuple)), max_size=3).map(tuple),
    rdma=st.lists(st.builds(RdmaDevice, _text, st.lists(_port, max_size=2).map(tuple)), max_size=2).map(tuple),
    fork_safe=st.booleans(),
    interfaces=st.lists(_text, max_size=3).map(tuple),
    peermem=st.none() | st.booleans(),
)


@settings(max_examples=100, deadline=None)
@given(_localities)
def test_round_trip_property(loc):
    d = loc.to_dict()
    assert _only_plain(d)
    assert Locality.from_dict(d) == loc


# --- mq doctor ------------------------------------------------------------------------------------

DOCTOR_KEYS = {"container", "fork_safety", "rdma", "gpus", "torch", "backends", "routes"}


def _doctor():
    from click.testing import CliRunner

    doctor = pytest.importorskip("mq.cli.doctor")
    return CliRunner(), doctor


def test_doctor_json_on_this_machine():
    runner, doctor = _doctor()
    result = runner.invoke(doctor.doctor, ["--json"])
    assert result.exit_code == 0, result.output
    rep = json.loads(result.output)
    assert DOCTOR_KEYS <= set(rep)
    assert set(rep["routes"]) == {"nng", "torchrpc"}  # inproc's nodes share one process: no routes
    assert set(rep["backends"]) >= {"nng", "torchrpc", "inproc"}
    assert rep["backends"]["nng"]["pynng"]["available"] and rep["backends"]["nng"]["mq_types"] == ["nng"]
    assert rep["backends"]["torchrpc"]["mq_types"] == ["torchrpc:cpu", "torchrpc:cuda"]
    assert rep["backends"]["inproc"]["launchable"] is False
    path = rep["rdma"]["path"]  # mq's rdma path: why it is off here, in words
    assert path["mode"] == "auto" and (path["off_because"] is None) == bool(rep["rdma"]["active_ports"] and path["engine"])
    for backend, by_peer in rep["routes"].items():
        assert by_peer["local"]["kind"] in ("shm", "ipc", "tcp")
        assert by_peer["remote"]["kind"] in ("rdma", "tcp")
        assert by_peer["remote"]["reason"]
    # nng takes the shm data path on the same host exactly when this host can make a pool
    assert rep["routes"]["nng"]["local"]["kind"] == ("shm" if rep["shm"]["available"] else "ipc")
    assert rep["torch"]["available"] in (True, False)
    # a backend's routes include what the data paths add; JSON text carries no colour markup
    assert {"shm", "rdma", "tcp", "ipc"} <= set(rep["backends"]["nng"]["routes"])
    assert rep["backends"]["inproc"]["routes"] == ["inproc"]
    assert "[/" not in result.output and "[yellow]" not in result.output, "colour markup in the JSON"


def test_doctor_human_output_exits_0():
    runner, doctor = _doctor()
    result = runner.invoke(doctor.doctor, [])
    assert result.exit_code == 0, result.output
    for title in ("container", "fork safety", "RDMA devices", "GPUs", "TensorPipe", "routes"):
        assert title in result.output
    condensed = "".join(c for c in result.output if not c.isspace() and c != "│")  # rich wraps
    assert "poll up to 0.5 ms before sleeping".replace(" ", "") in condensed  # nng's busy_poll
    rep = json.loads(runner.invoke(doctor.doctor, ["--json"]).output)
    if "shm" in rep["backends"]["torchrpc"]["tensorpipe"].get("options", {}).get("_transports", []):
        # TensorPipe's same-host transport spins a core per process: doctor says how to avoid it
        condensed = "".join(c for c in result.output if not c.isspace() and c != "│")  # rich wraps
        assert "busy-polls" in condensed and "--no-busy-poll" in condensed


def test_doctor_states_what_torchrpc_leaves_open():
    runner, doctor = _doctor()
    risk = json.loads(runner.invoke(doctor.doctor, ["--json"]).output)["trust"]["torchrpc"]
    assert "accepts any connection" in risk["summary"] and "use nng" in risk["summary"]
    assert "random bytes" in risk["hostile_input"] and "abort the node" in risk["hostile_input"]
    assert "open to anyone who reaches it" in risk["store"] and "mq signs what it writes" in risk["store"]
    assert "logs one warning" in risk["warning"]
    result = runner.invoke(doctor.doctor, [])
    assert result.exit_code == 0, result.output
    condensed = "".join(c for c in result.output if not c.isspace() and c != "│")  # rich wraps
    for text in risk.values():
        assert "".join(text.split()) in condensed


def test_doctor_with_gpus_and_rdma(monkeypatch):
    runner, doctor = _doctor()
    monkeypatch.setattr(doctor, "local", lambda: RICH)
    rep = json.loads(runner.invoke(doctor.doctor, ["--json"]).output)
    assert rep["gpus"]["p2p_matrix"] == [[None, True], [True, None]]
    assert rep["rdma"]["active_ports"] == ["mlx5_0:1"]
    assert rep["routes"]["torchrpc"]["remote"] == {
        "kind": "rdma", "gpu": "rdma", "gpudirect": True, "reason": rep["routes"]["torchrpc"]["remote"]["reason"]
    }
    assert rep["routes"]["nng"]["remote"]["kind"] == "tcp"
    assert "cuda_gdr" in rep["backends"]["torchrpc"]["tensorpipe"]["options"]["_channels"]
    result = runner.invoke(doctor.doctor, [])
    assert result.exit_code == 0, result.output
    assert "mlx5_0" in result.output and "GPU-aaaa" in result.output


def test_doctor_survives_a_broken_probe(monkeypatch):
    runner, doctor = _doctor()

    def boom(*a, **kw):
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(doctor.forksafe, "state", boom)
    result = runner.invoke(doctor.doctor, ["--json"])
    assert result.exit_code == 0, result.output
    assert "probe exploded" in json.loads(result.output)["fork_safety"]["error"]
    assert runner.invoke(doctor.doctor, []).exit_code == 0
