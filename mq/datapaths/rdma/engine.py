"""The RDMA engine: one NIXL agent (its UCX backend) per node, behind the few calls the rdma
data path needs (:mod:`mq.datapaths.rdma.path`): register a region once, hand out this agent's metadata,
load a peer's, and read ``n`` bytes of a peer's registered memory into ours (one-sided).

NIXL is loaded only when a node turns the path on (``rdma=`` of :func:`mq.create`):

``"auto"`` (default)
    on when this node has an ACTIVE RDMA port; UCX picks its RDMA transport, on the device
    :func:`choose_device` names (``UCX_NET_DEVICES``), and NIXL must be installed.
``"tcp"``
    on, over UCX's tcp transport (``UCX_TLS=tcp``): the same registration, descriptors, pulls
    and releases as over a NIC, between hosts (or namespaces) that have none. For tests and
    for clusters whose RDMA is broken; ``routes()`` says so.
``False``
    off.

The variables UCX reads (``UCX_TLS``, ``UCX_NET_DEVICES``) and the fork-safety variables
(:mod:`mq.datapaths.rdma.forksafe`) are set before NIXL loads, unless the user set them: theirs win, and
``routes()`` reports what they said. NIXL's own descriptor (de)serialisation pickles: mq never
calls it; a peer's metadata reaches NIXL's parser only after its MAC checked out
(:mod:`mq.datapaths.rdma.path`).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import uuid
from typing import Any

from mq.datapaths.rdma import forksafe
from mq.errors import ConfigError
from mq.locality import Locality

log = logging.getLogger("mq")

MODES = ("auto", "tcp", "off")
#: Where NIXL's Python API lives: the meta package picks its CUDA build; either build runs on a
#: CPU-only host (seen: nixl-cu13 1.5.1 with UCX over tcp on a machine without a GPU).
_API_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")
_load_lock = threading.Lock()
_api: Any = None


def check_mode(value: Any) -> str:
    """``rdma=`` as one of :data:`MODES` (True means ``"auto"``), or a ConfigError."""
    if value is True:
        return "auto"
    if value is False or value is None:
        return "off"
    if isinstance(value, str) and value in MODES:
        return value
    raise ConfigError(f"rdma must be 'auto', 'tcp' or False, got {value!r}: 'auto' uses an ACTIVE "
                      "RDMA device when this node has one, 'tcp' runs the rdma path over UCX's tcp "
                      "transport (no device needed)")


def choose_device(locality: Locality) -> str | None:
    """The RDMA port UCX should use (``mlx5_0:1``): the first ACTIVE one. With several GPUs
    and NICs, the NIC nearest the GPU would be better; mq does not read that topology yet,
    and says which port it took."""
    ports = locality.active_rdma_ports()
    return f"{ports[0][0]}:{ports[0][1].port}" if ports else None


def why_off(mode: str, locality: Locality, dev_root: str = "/dev/infiniband") -> str | None:
    """Why the rdma path stays off on this node in ``mode`` (None: try to load the engine)."""
    if mode == "off":
        return "turned off (rdma=False)"
    if mode != "auto":
        return None
    inside = locality.container.in_container and not os.path.isdir(dev_root)
    # A container sees the host's /sys/class/infiniband, but verbs needs the device files.
    mount = (f"; in a container ({locality.container.runtime or 'detected'}) without {dev_root}: "
             f"start it with --device={dev_root} (and the RDMA ulimits)") if inside else ""
    if not locality.active_rdma_ports():
        return f"no ACTIVE RDMA port on this node{mount} (rdma='tcp' runs the path over UCX's tcp transport)"
    if inside:
        return f"ACTIVE RDMA ports, but{mount[1:]}"
    return None


def state(locality: Locality, mode: str = "auto") -> dict[str, Any]:
    """What ``mq doctor`` says of the rdma path on this node, without starting an engine:
    whether NIXL is installed (and which), the port ``auto`` would use, the UCX variables set,
    and why the path would be off (None: it would start)."""
    import importlib.util

    found = next((m for m in _API_MODULES if importlib.util.find_spec(m.partition(".")[0]) is not None), None)
    why = why_off(mode, locality) or (None if found else "NIXL is not installed (pip install 'mq[rdma]')")
    return {"mode": mode, "engine": f"nixl {_version()}" if found else None, "device": choose_device(locality),
            "ucx_env": {k: os.environ.get(k) for k in ("UCX_TLS", "UCX_NET_DEVICES")}, "off_because": why}


def load_api() -> Any:
    """NIXL's Python API module; ImportError saying how to install it."""
    global _api
    with _load_lock:
        if _api is not None:
            return _api
        missing = []
        for name in _API_MODULES:
            try:
                _api = importlib.import_module(name)
                return _api
            except ImportError as exc:
                missing.append(f"{name}: {exc}")
        raise ImportError("NIXL is not installed (pip install 'mq[rdma]', or nixl-cu13): " + "; ".join(missing))


_engines: dict[tuple[int, str, str | None], "Engine"] = {}


def shared_engine(mode: str, device: str | None) -> "Engine":
    """This process's engine for ``mode`` (made on first use): one NIXL agent per process,
    shared by its nodes. Successive agents in one process lost track of peers' memory in tests
    (NIXL_ERR_NOT_FOUND on a pull after several nodes had come and gone); NIXL is built for one
    agent per process anyway. A forked child makes its own (the parent's does not survive a fork)."""
    key = (os.getpid(), mode, device)
    with _load_lock:
        engine = _engines.get(key)
    if engine is None:
        engine = Engine(f"mq-{os.getpid()}-{uuid.uuid4().hex[:12]}", mode, device)
        with _load_lock:
            engine = _engines.setdefault(key, engine)
    return engine


class Engine:
    """One NIXL agent with its UCX backend.

    Args:
        name: the agent's name, unique in the job (peers load our metadata under it).
        mode: ``"auto"`` or ``"tcp"`` (see the module docstring).
        device: the RDMA port UCX uses in ``auto`` mode.

    Raises:
        ImportError: NIXL is missing.
        RuntimeError: NIXL loaded but its UCX backend did not start.
    """

    def __init__(self, name: str, mode: str, device: str | None = None):
        _prepare_env(mode, device)
        api = load_api()
        # NIXL logs each agent it makes at INFO, on stdout: not in a user's output
        logging.getLogger("nixl").setLevel(max(logging.WARNING, logging.getLogger("nixl").level))
        forksafe.mark_rdma_started("the rdma data path (NIXL/UCX)")
        forksafe.install_fork_warning()
        config = api.nixl_agent_config(backends=["UCX"], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.agent = api.nixl_agent(name, config)
        if "UCX" not in self.agent.backends:
            raise RuntimeError(f"NIXL has no UCX backend here (plugins: {self.agent.get_plugin_list()})")
        self.name = name
        self.mode = mode
        self.device = device
        #: what carries the bytes, as UCX was told (its own choice where not told)
        self.transport = os.environ.get("UCX_TLS") or "UCX's choice of RDMA transport"
        self.version = getattr(api, "__version__", None) or _version()
        self._loaded: dict[str, int] = {}  # peer agent -> readers using it (nodes share the agent)
        self._peers_lock = threading.Lock()

    # ------------------------------------------------------------------ memory
    def register(self, addr: int, nbytes: int) -> Any:
        """Register ``nbytes`` of host memory at ``addr`` (once per region, never per message)."""
        return self.agent.register_memory([(addr, nbytes, 0, "")], "DRAM")

    def deregister(self, handle: Any) -> None:
        self.agent.deregister_memory(handle)

    def metadata(self) -> bytes:
        """This agent's metadata: its UCX address and the keys of every registered region."""
        return bytes(self.agent.get_agent_metadata())

    # ------------------------------------------------------------------ peers
    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata (again, when it registered more); its agent's name."""
        with self._peers_lock:
            name = self.agent.add_remote_agent(metadata)
            return name.decode() if isinstance(name, bytes) else str(name)

    def hold_peer(self, name: str) -> None:
        """One more reader of this process uses peer agent ``name``."""
        with self._peers_lock:
            self._loaded[name] = self._loaded.get(name, 0) + 1

    def remove_peer(self, name: str) -> None:
        """One reader is done with peer agent ``name``: forgotten when none is left."""
        with self._peers_lock:
            left = self._loaded.get(name, 0) - 1
            if left > 0:
                self._loaded[name] = left
                return
            self._loaded.pop(name, None)
            try:
                self.agent.remove_remote_agent(name)
            except Exception as exc:  # already gone, or never loaded
                log.debug("rdma: remove agent %s: %s", name, exc)

    # ------------------------------------------------------------------ transfers
    def read(self, peer: str, remote_addr: int, local_addr: int, nbytes: int) -> Any:
        """Start reading ``nbytes`` at ``remote_addr`` of ``peer`` into ``local_addr``; the handle.

        Raises:
            RuntimeError: NIXL refused to start it (unknown region, peer unreachable).
        """
        agent = self.agent
        local = agent.get_xfer_descs([(local_addr, nbytes, 0)], "DRAM")
        remote = agent.get_xfer_descs([(remote_addr, nbytes, 0)], "DRAM")
        handle = agent.initialize_xfer("READ", local, remote, peer)
        if agent.transfer(handle) == "ERR":
            agent.release_xfer_handle(handle)
            raise RuntimeError("NIXL could not post the read")
        return handle

    def state(self, handle: Any) -> str:
        """``DONE``, ``PROC`` or ``ERR``."""
        return self.agent.check_xfer_state(handle)

    def release(self, handle: Any) -> None:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception as exc:  # a transfer still in flight to a dead peer
            log.debug("rdma: release transfer: %s", exc)


def _prepare_env(mode: str, device: str | None) -> None:
    """What UCX reads when NIXL loads it: set here unless the user set it."""
    for key, value in forksafe.FORK_SAFE_ENV.items():
        os.environ.setdefault(key, value)
    if mode == "tcp":
        os.environ.setdefault("UCX_TLS", "tcp")
    elif device:
        os.environ.setdefault("UCX_NET_DEVICES", device)


def _version() -> str:
    from importlib import metadata

    for dist in ("nixl", "nixl-cu13", "nixl-cu12"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"
