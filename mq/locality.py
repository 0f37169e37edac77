"""Who am I: the locality descriptor a node publishes to its peers at rendezvous.

A :class:`Locality` says where this process runs (boot id, namespaces, container evidence),
which GPUs it sees and which of them can reach each other peer to peer, and which RDMA ports
it has. :func:`mq.routing.select_route` compares two of them to pick a route; nothing in this
module decides anything.

Every reader takes the filesystem ``root`` it reads ``/proc`` and ``/sys`` from, so tests point
it at recorded trees instead of mocking ``open``. Readers never raise on a missing or unreadable
file: an absent fact is ``None`` or empty, and routing treats an unknown fact as "not shared".

Wire form: :meth:`Locality.to_dict` gives plain dict/list/str/int/bool/None (msgpack- and
JSON-safe); :meth:`Locality.from_dict` ignores unknown keys and fills missing ones with
defaults, so peers running an older or newer mq still interoperate.
"""

from __future__ import annotations

import functools
import os
import re
import socket
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from mq.errors import ProtocolError

__all__ = [
    "ContainerInfo",
    "FORK_SAFE_VARS",
    "GpuInfo",
    "Locality",
    "RdmaDevice",
    "RdmaPort",
    "describe",
    "detect_container",
    "local",
    "probe_gpus",
    "read_boot_id",
    "read_interfaces",
    "read_namespaces",
    "read_rdma_devices",
]

# libibverbs turns on ibv_fork_init() when either variable is present (any value: rdma-core
# only checks getenv() != NULL), so presence, not truthiness, is what "fork safe" means.
FORK_SAFE_VARS = ("IBV_FORK_SAFE", "RDMAV_FORK_SAFE")

# Namespaces that decide which routes can work between two processes on one kernel.
_NAMESPACES = ("ipc", "pid", "net", "mnt")


@dataclass(frozen=True)
class ContainerInfo:
    """Whether this process runs in a container, and the evidence for it.

    Attributes:
        in_container: True when any evidence was found.
        runtime: best guess of the engine (``docker``, ``podman``, ``kubernetes``,
            ``containerd``, ``lxc``, or what the ``container`` variable says), None on bare metal.
        evidence: human-readable facts that led to the verdict, one per source.
        container_id: the container id when cgroup or mountinfo paths reveal it.
    """

    in_container: bool = False
    runtime: str | None = None
    evidence: tuple[str, ...] = ()
    container_id: str | None = None


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as this process sees it.

    Attributes:
        index: logical index (after ``CUDA_VISIBLE_DEVICES``), the one device maps use.
        uuid: the driver's UUID (``GPU-...``); identifies the physical device across processes.
        name: the marketing name, for humans.
        p2p: logical indices (in this process's view) this GPU can read peer to peer.
        mig: the GPU runs in MIG mode (or is a MIG instance): no CUDA IPC there.
    """

    index: int
    uuid: str
    name: str = ""
    p2p: tuple[int, ...] = ()
    mig: bool = False


@dataclass(frozen=True)
class RdmaPort:
    """One port of an RDMA device, as ``/sys/class/infiniband/<dev>/ports/<n>`` reports it.

    Attributes:
        port: the port number (1-based, as in sysfs).
        state: logical state without its numeric prefix: ``ACTIVE``, ``DOWN``, ``INIT``, ``ARMED``.
        link_layer: ``InfiniBand`` or ``Ethernet`` (RoCE); empty when unknown.
        phys_state: physical state (``LinkUp``, ``Disabled``, ``Polling``); empty when unknown.
        rate: the negotiated rate string (``200 Gb/sec (4X HDR)``); empty when unknown.
    """

    port: int
    state: str
    link_layer: str = ""
    phys_state: str = ""
    rate: str = ""

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"


@dataclass(frozen=True)
class RdmaDevice:
    """One RDMA device (HCA) and its ports."""

    name: str
    ports: tuple[RdmaPort, ...] = ()


@dataclass(frozen=True)
class Locality:
    """Everything a peer needs to know about this process to pick a route to it.

    Attributes:
        hostname: for humans only; routing never trusts it (containers and clones share names).
        boot_id: ``/proc/sys/kernel/random/boot_id``; equal boot ids mean the same kernel.
        pid: the process id, as seen in ``pid_ns``.
        ipc_ns, pid_ns, net_ns, mnt_ns: namespace ids such as ``'ipc:[4026531839]'``,
            None when unreadable.
        container: container verdict and evidence.
        gpus: visible GPUs, in logical order.
        rdma: RDMA devices with their ports (ACTIVE or not).
        fork_safe: ``IBV_FORK_SAFE`` or ``RDMAV_FORK_SAFE`` is set in this process.
        interfaces: network interface names (what ``TP_SOCKET_IFNAME`` may name).
        peermem: the GPUDirect RDMA kernel module (nvidia_peermem / nv_peer_mem) is loaded;
            None when it does not matter or is unknown (no GPU or no RDMA device).
    """

    hostname: str = ""
    boot_id: str | None = None
    pid: int | None = None
    ipc_ns: str | None = None
    pid_ns: str | None = None
    net_ns: str | None = None
    mnt_ns: str | None = None
    container: ContainerInfo = field(default_factory=ContainerInfo)
    gpus: tuple[GpuInfo, ...] = ()
    rdma: tuple[RdmaDevice, ...] = ()
    fork_safe: bool = False
    interfaces: tuple[str, ...] = ()
    peermem: bool | None = None

    def active_rdma_ports(self) -> tuple[tuple[str, RdmaPort], ...]:
        """(device name, port) for every ACTIVE port; a DOWN port next to them is ignored."""
        return tuple((dev.name, port) for dev in self.rdma for port in dev.ports if port.active)

    def to_dict(self) -> dict[str, Any]:
        """This descriptor as plain dict/list/str/int/bool/None, safe for msgpack and JSON."""
        return _plain(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Locality:
        """Rebuild a descriptor received from a peer.

        Unknown keys are ignored and missing keys take their defaults, so a peer running an
        older or newer mq still yields a usable descriptor (routing treats unknowns as "not
        shared", which only ever picks a slower, working route).

        Raises:
            ProtocolError: ``d`` is not a mapping or a field has the wrong type; the message
                names the path (``$.gpus[0].index``).
        """
        if not isinstance(d, Mapping):
            raise ProtocolError(f"locality descriptor must be a mapping, got {type(d).__name__}")
        return Locality(
            hostname=_get(d, "hostname", str, "", "$"),
            boot_id=_get(d, "boot_id", str, None, "$"),
            pid=_get(d, "pid", int, None, "$"),
            ipc_ns=_get(d, "ipc_ns", str, None, "$"),
            pid_ns=_get(d, "pid_ns", str, None, "$"),
            net_ns=_get(d, "net_ns", str, None, "$"),
            mnt_ns=_get(d, "mnt_ns", str, None, "$"),
            container=_container_from(d.get("container"), "$.container"),
            gpus=tuple(_gpu_from(g, f"$.gpus[{i}]") for i, g in enumerate(_seq(d, "gpus", "$"))),
            rdma=tuple(_rdma_from(r, f"$.rdma[{i}]") for i, r in enumerate(_seq(d, "rdma", "$"))),
            fork_safe=_get(d, "fork_safe", bool, False, "$"),
            interfaces=tuple(_str_item(x, f"$.interfaces[{i}]") for i, x in enumerate(_seq(d, "interfaces", "$"))),
            peermem=_get(d, "peermem", bool, None, "$"),
        )


# ---------------------------------------------------------------------------------------------
# wire form helpers


def _plain(obj: Any) -> Any:
    """Dataclasses -> dicts, tuples -> lists; everything else is already a plain value."""
    if hasattr(obj, "__dataclass_fields__"):
        return {f.name: _plain(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [_plain(x) for x in obj]
    return obj


def _check(value: Any, typ: type, path: str) -> Any:
    # bool is an int subclass: an int field must not silently accept True, and vice versa.
    ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
    if not ok:
        raise ProtocolError(
            f"locality descriptor: expected {typ.__name__}, got {type(value).__name__} - at {path}"
        )
    return value


def _get(d: Mapping[str, Any], key: str, typ: type, default: Any, path: str) -> Any:
    value = d.get(key)
    if value is None:  # missing, or sent as unknown
        return default
    return _check(value, typ, f"{path}.{key}")


def _seq(d: Mapping[str, Any], key: str, path: str) -> list[Any]:
    value = d.get(key)
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ProtocolError(
            f"locality descriptor: expected list, got {type(value).__name__} - at {path}.{key}"
        )
    return list(value)


def _str_item(value: Any, path: str) -> str:
    return _check(value, str, path)


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ProtocolError(
            f"locality descriptor: expected mapping, got {type(value).__name__} - at {path}"
        )
    return value


def _container_from(value: Any, path: str) -> ContainerInfo:
    if value is None:
        return ContainerInfo()
    d = _mapping(value, path)
    return ContainerInfo(
        in_container=_get(d, "in_container", bool, False, path),
        runtime=_get(d, "runtime", str, None, path),
        evidence=tuple(_str_item(x, f"{path}.evidence[{i}]") for i, x in enumerate(_seq(d, "evidence", path))),
        container_id=_get(d, "container_id", str, None, path),
    )


def _gpu_from(value: Any, path: str) -> GpuInfo:
    d = _mapping(value, path)
    if "index" not in d or "uuid" not in d:
        raise ProtocolError(f"locality descriptor: a GPU needs 'index' and 'uuid' - at {path}")
    return GpuInfo(
        index=_check(d["index"], int, f"{path}.index"),
        uuid=_check(d["uuid"], str, f"{path}.uuid"),
        name=_get(d, "name", str, "", path),
        p2p=tuple(_check(x, int, f"{path}.p2p[{i}]") for i, x in enumerate(_seq(d, "p2p", path))),
        mig=_get(d, "mig", bool, False, path),
    )


def _rdma_from(value: Any, path: str) -> RdmaDevice:
    d = _mapping(value, path)
    ports = []
    for i, p in enumerate(_seq(d, "ports", path)):
        ppath = f"{path}.ports[{i}]"
        pd = _mapping(p, ppath)
        ports.append(
            RdmaPort(
                port=_check(pd.get("port"), int, f"{ppath}.port"),
                state=_check(pd.get("state"), str, f"{ppath}.state"),
                link_layer=_get(pd, "link_layer", str, "", ppath),
                phys_state=_get(pd, "phys_state", str, "", ppath),
                rate=_get(pd, "rate", str, "", ppath),
            )
        )
    return RdmaDevice(name=_check(d.get("name"), str, f"{path}.name"), ports=tuple(ports))


# ---------------------------------------------------------------------------------------------
# readers: each takes the filesystem root so tests can point it at a recorded tree


def _path(root: str, *parts: str) -> str:
    return os.path.join(root, *(p.lstrip("/") for p in parts))


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _strip_state(text: str | None) -> str:
    # sysfs writes "4: ACTIVE" / "5: LinkUp"; the number is the enum, the word is for people.
    if not text:
        return ""
    text = text.strip()
    _, sep, word = text.partition(":")
    return word.strip() if sep else text


def read_boot_id(root: str = "/") -> str | None:
    """The kernel's boot id, or None when unreadable."""
    text = _read_text(_path(root, "proc/sys/kernel/random/boot_id"))
    return text.strip() or None if text else None


def read_namespaces(root: str = "/") -> dict[str, str | None]:
    """Namespace ids of this process: ``{'ipc': 'ipc:[4026531839]', 'pid': ..., ...}``.

    In a recorded tree the entries may be dangling symlinks (as in ``/proc``) or plain files
    holding the link text.
    """
    out: dict[str, str | None] = {}
    for ns in _NAMESPACES:
        path = _path(root, "proc/self/ns", ns)
        try:
            out[ns] = os.readlink(path)
        except OSError:
            text = _read_text(path)
            out[ns] = text.strip() or None if text else None
    return out


def read_interfaces(root: str = "/") -> tuple[str, ...]:
    """Network interface names from ``<root>/sys/class/net``."""
    try:
        return tuple(sorted(os.listdir(_path(root, "sys/class/net"))))
    except OSError:
        return ()


def read_rdma_devices(root: str = "/") -> tuple[RdmaDevice, ...]:
    """RDMA devices and their ports from ``<root>/sys/class/infiniband``.

    Every port is reported, DOWN ones included; routing looks for ACTIVE ones. No
    ``infiniband`` directory (no driver, or a container without ``--device /dev/infiniband``
    and sysfs) yields an empty tuple.
    """
    base = _path(root, "sys/class/infiniband")
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return ()
    devices = []
    for name in names:
        ports_dir = os.path.join(base, name, "ports")
        try:
            port_names = sorted((p for p in os.listdir(ports_dir) if p.isdigit()), key=int)
        except OSError:
            port_names = []
        ports = []
        for p in port_names:
            pdir = os.path.join(ports_dir, p)
            state = _strip_state(_read_text(os.path.join(pdir, "state")))
            if not state:
                continue
            ports.append(
                RdmaPort(
                    port=int(p),
                    state=state,
                    link_layer=(_read_text(os.path.join(pdir, "link_layer")) or "").strip(),
                    phys_state=_strip_state(_read_text(os.path.join(pdir, "phys_state"))),
                    rate=(_read_text(os.path.join(pdir, "rate")) or "").strip(),
                )
            )
        devices.append(RdmaDevice(name=name, ports=tuple(ports)))
    return tuple(devices)


def _read_peermem(root: str) -> bool:
    # GPUDirect RDMA needs the peer-memory kernel module: nvidia_peermem (driver >= 465) or the
    # older out-of-tree nv_peer_mem. Without it, verbs cannot register GPU memory.
    return any(os.path.isdir(_path(root, "sys/module", m)) for m in ("nvidia_peermem", "nv_peer_mem"))


# cgroup path markers -> runtime. Order matters: kubepods paths also contain "containerd" or
# "docker" (the CRI underneath), and the orchestrator is the more useful answer.
_CGROUP_MARKERS = (
    ("kubepods", "kubernetes"),
    ("libpod", "podman"),
    ("docker", "docker"),
    ("containerd", "containerd"),
    ("lxc", "lxc"),
)
_ID_PATTERNS = (
    re.compile(r"docker[-/]([0-9a-f]{12,64})"),
    re.compile(r"libpod-(?:conmon-)?([0-9a-f]{12,64})"),
    re.compile(r"cri-containerd-([0-9a-f]{12,64})"),
    re.compile(r"crio-(?:conmon-)?([0-9a-f]{12,64})"),
    re.compile(r"/docker/containers/([0-9a-f]{12,64})"),
    re.compile(r"/overlay-containers/([0-9a-f]{12,64})"),
    re.compile(r"kubepods[^\s]*/([0-9a-f]{64})"),
)
_MOUNT_MARKERS = (
    ("/docker/containers/", "docker"),
    ("/overlay-containers/", "podman"),
    ("/kubelet/pods/", "kubernetes"),
)


def _find_id(text: str) -> str | None:
    for pattern in _ID_PATTERNS:
        m = pattern.search(text)
        if m:
            return m.group(1)
    return None


def _summarize(source: str, hits: list[str]) -> list[str]:
    if not hits:
        return []
    more = f" (+{len(hits) - 1} more)" if len(hits) > 1 else ""
    return [f"{source}: {hits[0]}{more}"]


def detect_container(root: str = "/", environ: Mapping[str, str] | None = None) -> ContainerInfo:
    """Decide whether this process runs in a container, keeping every piece of evidence.

    Sources: ``/.dockerenv`` (docker), ``/run/.containerenv`` (podman, whose content names the
    engine), ``/proc/self/cgroup`` (v1 ``N:ctrl:/docker/<id>`` lines, v2 ``0::/...`` paths with
    a docker/kubepods/containerd/lxc/libpod marker), ``/proc/self/mountinfo`` (an overlay root
    filesystem, or files bind-mounted from ``/var/lib/docker/containers``), and the environment
    (``KUBERNETES_SERVICE_HOST``, the ``container`` variable set by podman/systemd-nspawn/lxc,
    and ``MQ_CONTAINER`` set by mq's own images).

    Args:
        root: filesystem root to read from.
        environ: the environment to inspect; ``os.environ`` when None.

    Returns:
        The verdict; ``runtime`` is the most specific engine found.
    """
    env = os.environ if environ is None else environ
    found = _Findings()
    _marker_files(root, found)
    _cgroup_evidence(root, found)
    _mount_evidence(root, found)
    _env_evidence(env, found)
    evidence = list(dict.fromkeys(found.evidence))  # one line per fact, first-seen order
    runtime: str | None = None
    for preferred in ("kubernetes", "podman", "docker", "containerd", "lxc"):
        if preferred in found.runtimes:
            runtime = preferred
            break
    if runtime is None and found.runtimes:
        runtime = found.runtimes[0]
    if runtime is None and evidence:
        runtime = "unknown"
    return ContainerInfo(in_container=bool(evidence), runtime=runtime, evidence=tuple(evidence),
                         container_id=found.cid)


@dataclass
class _Findings:
    """What the sources of :func:`detect_container` found, in the order they were read."""

    evidence: list[str] = field(default_factory=list)
    runtimes: list[str] = field(default_factory=list)
    cid: str | None = None  # the first container id any source names

    def runtime(self, runtime: str, cid: str | None = None) -> None:
        self.runtimes.append(runtime)
        self.cid = self.cid or cid


def _marker_files(root: str, found: _Findings) -> None:
    """``/.dockerenv`` (docker) and ``/run/.containerenv`` (podman; its content names the engine)."""
    if os.path.exists(_path(root, ".dockerenv")):
        found.evidence.append("/.dockerenv exists")
        found.runtime("docker")
    containerenv = _path(root, "run/.containerenv")
    if os.path.exists(containerenv):
        text = _read_text(containerenv) or ""
        engine = re.search(r'^engine="([a-z]+)', text, re.M)
        found.evidence.append("/run/.containerenv exists")
        cid = re.search(r'^id="([0-9a-f]+)"', text, re.M)
        found.runtime(engine.group(1) if engine else "podman", cid.group(1) if cid else None)


def _cgroup_evidence(root: str, found: _Findings) -> None:
    """``/proc/self/cgroup`` paths with a container engine's marker."""
    # One evidence line per source: a v1 cgroup file repeats the same path for every controller.
    cgroup_hits: list[str] = []
    for line in (_read_text(_path(root, "proc/self/cgroup")) or "").splitlines():
        # v1: "12:devices:/docker/<id>"; v2: "0::/system.slice/docker-<id>.scope". A bare "/"
        # (host, or a private cgroup namespace) carries no evidence either way.
        _, _, cgpath = line.partition(":")
        _, _, cgpath = cgpath.partition(":")
        if cgpath.rstrip("/").endswith(".service"):
            continue  # docker.service / containerd.service: the host daemon itself, not a container
        for marker, runtime in _CGROUP_MARKERS:
            if marker in cgpath:
                cgroup_hits.append(line.strip())
                found.runtime(runtime, _find_id(cgpath))
                break
    found.evidence.extend(_summarize("/proc/self/cgroup", cgroup_hits))


def _mount_evidence(root: str, found: _Findings) -> None:
    """``/proc/self/mountinfo``: an overlay root, or files mounted from an engine's directory."""
    mount_hits: list[str] = []
    for line in (_read_text(_path(root, "proc/self/mountinfo")) or "").splitlines():
        # "36 35 98:0 <root> <mount point> <opts> ... - <fstype> <source> <super opts>"
        pre, sep, post = line.partition(" - ")
        parts = pre.split()
        if not sep or len(parts) < 5:
            continue
        fstype = post.split()[0] if post.split() else ""
        if parts[4] == "/" and fstype == "overlay":
            found.evidence.append("/proc/self/mountinfo: overlay root filesystem")
        for marker, runtime in _MOUNT_MARKERS:
            if marker in parts[3]:
                mount_hits.append(f"{parts[4]} mounted from {parts[3]}")
                found.runtime(runtime, _find_id(parts[3]))
                break
    found.evidence.extend(_summarize("/proc/self/mountinfo", mount_hits))


def _env_evidence(env: Mapping[str, str], found: _Findings) -> None:
    """KUBERNETES_SERVICE_HOST, ``container`` (podman, systemd-nspawn, lxc) and MQ_CONTAINER."""
    if env.get("KUBERNETES_SERVICE_HOST"):
        found.evidence.append(f"KUBERNETES_SERVICE_HOST={env['KUBERNETES_SERVICE_HOST']}")
        found.runtime("kubernetes")
    if env.get("container"):
        found.evidence.append(f"container={env['container']}")
        found.runtime(env["container"])
    if env.get("MQ_CONTAINER"):
        found.evidence.append(f"MQ_CONTAINER={env['MQ_CONTAINER']}")


def _visible_nvml_indices(count: int, uuids: list[str], environ: Mapping[str, str]) -> list[int]:
    """NVML enumerates every GPU; map CUDA_VISIBLE_DEVICES to the physical indices CUDA uses."""
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return list(range(count))
    out: list[int] = []
    for token in (t.strip() for t in cvd.split(",")):
        # CUDA accepts an index or a (unique prefix of a) UUID, and stops at the first entry
        # it cannot resolve: devices after it are invisible, and so they are here.
        if token.isdigit():
            phys = int(token) if int(token) < count else None
        else:
            prefix = token if token.startswith("GPU-") else f"GPU-{token}"
            matches = [i for i, u in enumerate(uuids) if u.startswith(prefix)] if token else []
            phys = matches[0] if len(matches) == 1 else None
        if phys is None or phys in out:
            break
        out.append(phys)
    return out


def _probe_nvml(environ: Mapping[str, str]) -> tuple[GpuInfo, ...] | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver / library: NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        uuids = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in handles]
        visible = _visible_nvml_indices(count, uuids, environ)
        gpus = []
        for logical, phys in enumerate(visible):
            p2p = []
            for other_logical, other in enumerate(visible):
                if other == phys:
                    continue
                try:
                    status = pynvml.nvmlDeviceGetP2PStatus(
                        handles[phys], handles[other], pynvml.NVML_P2P_CAPS_INDEX_READ
                    )
                except Exception:
                    continue
                if status == pynvml.NVML_P2P_STATUS_OK:
                    p2p.append(other_logical)
            gpus.append(
                GpuInfo(
                    index=logical,
                    uuid=uuids[phys],
                    name=_text(pynvml.nvmlDeviceGetName(handles[phys])),
                    p2p=tuple(p2p),
                    mig=_nvml_mig(pynvml, handles[phys]) or uuids[phys].startswith("MIG-"),
                )
            )
        return tuple(gpus)
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _nvml_mig(pynvml: Any, handle: Any) -> bool:
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except Exception:  # not a MIG-capable GPU, or an old driver
        return False
    return current == getattr(pynvml, "NVML_DEVICE_MIG_ENABLE", 1)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _probe_torch() -> tuple[GpuInfo, ...]:
    try:
        import torch
    except ImportError:
        return ()
    try:
        if not torch.cuda.is_available():
            return ()
        n = torch.cuda.device_count()
        gpus = []
        for i in range(n):
            props = torch.cuda.get_device_properties(i)
            uuid = getattr(props, "uuid", None)
            uuid_text = f"GPU-{uuid}" if uuid is not None else f"torch-cuda:{i}"
            p2p = tuple(j for j in range(n) if j != i and torch.cuda.can_device_access_peer(i, j))
            gpus.append(GpuInfo(index=i, uuid=uuid_text, name=props.name, p2p=p2p,
                                mig=uuid_text.startswith("GPU-MIG-")))
        return tuple(gpus)
    except Exception:
        return ()


def _gpu_drivers() -> tuple[bool, bool]:
    """(NVIDIA driver present, ROCm driver present), from device nodes: no library is loaded."""
    nvidia = os.path.exists("/dev/nvidiactl") or os.path.isdir("/proc/driver/nvidia")
    return nvidia, os.path.exists("/dev/kfd")


def probe_gpus(*, root: str = "/", environ: Mapping[str, str] | None = None) -> tuple[GpuInfo, ...]:
    """Visible GPUs with their peer-to-peer matrix; never raises.

    Uses NVML (``nvidia-ml-py``) when importable and a driver answers, else ``torch.cuda``, else
    reports none. Without a GPU device node it returns at once without importing either, so
    calling it on a CPU-only machine costs microseconds.

    Args:
        root: filesystem root; GPUs are only probed on the live system (``root='/'``), since
            NVML and CUDA cannot be pointed at a recorded tree.
        environ: environment for ``CUDA_VISIBLE_DEVICES``; ``os.environ`` when None.
    """
    if os.path.abspath(root) != "/":
        return ()
    env = os.environ if environ is None else environ
    nvidia, rocm = _gpu_drivers()
    if not nvidia and not rocm:
        return ()
    if nvidia:
        gpus = _probe_nvml(env)
        if gpus is not None:
            return gpus
    return _probe_torch()


def _gpus(**kwargs: Any) -> tuple[GpuInfo, ...]:
    # describe() has a parameter named probe_gpus; call the module function through here.
    return probe_gpus(**kwargs)


def describe(
    *, root: str = "/", environ: Mapping[str, str] | None = None, probe_gpus: bool = True
) -> Locality:
    """Read this process's locality from the system (or a recorded tree under ``root``).

    Never raises for missing facts; see the module docstring. Prefer :func:`local` in hot
    paths: it caches the live result per process.

    Args:
        root: filesystem root for ``/proc`` and ``/sys``.
        environ: environment to inspect; ``os.environ`` when None.
        probe_gpus: False skips the GPU probe (and never touches NVML or CUDA).
    """
    env = os.environ if environ is None else environ
    if os.path.abspath(root) == "/":
        hostname = socket.gethostname()
    else:
        hostname = (_read_text(_path(root, "proc/sys/kernel/hostname")) or "").strip()
    ns = read_namespaces(root)
    gpus = _gpus(root=root, environ=env) if probe_gpus else ()
    rdma = read_rdma_devices(root)
    return Locality(
        hostname=hostname,
        boot_id=read_boot_id(root),
        pid=os.getpid(),
        ipc_ns=ns["ipc"],
        pid_ns=ns["pid"],
        net_ns=ns["net"],
        mnt_ns=ns["mnt"],
        container=detect_container(root, env),
        gpus=gpus,
        rdma=rdma,
        fork_safe=any(v in env for v in FORK_SAFE_VARS),
        interfaces=read_interfaces(root),
        peermem=_read_peermem(root) if gpus and rdma else None,
    )


@functools.lru_cache(maxsize=1)
def _local_for_pid(pid: int) -> Locality:
    return describe()


def local() -> Locality:
    """The live :func:`describe` result, computed once per process.

    Backends call this per connection, and the GPU probe is not free. The cache is keyed on
    the pid so a forked child describes itself rather than reusing its parent's pid.
    """
    return _local_for_pid(os.getpid())

