"""What the launcher (:mod:`mq.launch`) knows about each backend, in one object per backend:
the shape of a worker's options, which ports its workers bind, which options conflict with a
platform, and whether a failed node's abort must be relayed. The launcher looks the profile
up once from the mq type (:func:`profile_for`) and never branches on the mq type itself.

* ``nng``: workers listen on an address and dial their topology's peers (``listen_to``,
  ``attach_to``, ``protocol``); addresses are static, or found through a rendezvous store.
* ``torchrpc``: workers meet through a rendezvous store (``init_method``, ``world_size``) and
  take the CUDA options (``local_cuda_devices``, ``cuda_device_map``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from mq.errors import ConfigError
from mq.platforms import PlatformPlan
from mq.registry import MQ_TYPES, check_mq_type
from mq.rendezvous import attach_targets

__all__ = ["LaunchProfile", "LocalJob", "launchable_mq_types", "profile_for"]

Options = dict[int, dict[str, Any]]


@dataclass(frozen=True)
class LocalJob:
    """This machine's workers under ``--platform local``, as the launcher checked them."""

    node_ids: list[int]
    world_size: int
    topology: str
    address: str
    ports: list[int]  # one per worker, or empty: none given
    attach_to: list[str]  # extra addresses every worker dials
    init_method: str | None
    pick_port: Callable[[str], int]  # a free port on an address, when the backend needs one


@dataclass(frozen=True)
class WorkerExtras:
    """The options every worker gets on top of its addresses."""

    protocol: str
    local_cuda_devices: list[int] | None
    cuda_device_map: str | None


class LaunchProfile(Protocol):
    """The launcher's view of a backend."""

    def local_options(self, job: LocalJob) -> Options:
        """Each worker's connection options for a job on this machine."""

    def platform_options(self, plan: PlatformPlan, init_method: str | None) -> Options:
        """Each worker's connection options for a Slurm or k8s plan."""

    def check_platform(self, plan: PlatformPlan, init_method: str | None) -> None:
        """ConfigError for a given option that the platform's plan contradicts."""

    def binds_plan_ports(self) -> bool:
        """Whether the workers listen on the plan's ports (the launcher checks them first)."""

    def extras(self, given: WorkerExtras) -> dict[str, Any]:
        """The options of ``given`` this backend takes, checked."""

    def relays_abort(self, topology: str) -> bool:
        """Whether a worker that got a job abort must pass it on to its own peers."""


class NngLaunch:
    """nng workers listen on an address and dial the peers their topology names."""

    def local_options(self, job: LocalJob) -> Options:
        ports = job.ports
        if not ports and not job.init_method:
            # No ports given: the launcher picks free ones. (A rendezvous store would work too,
            # but it needs torch.distributed, a one-second import for every worker.)
            ports = [job.pick_port(job.address) for _ in job.node_ids]
        if ports:  # static addresses: every node knows every other's address up front
            listen = {n: f"tcp://{job.address}:{p}" for n, p in zip(job.node_ids, ports)}
            return {n: {"listen_to": listen[n],
                        "attach_to": [listen[t] for t in attach_targets(n, job.node_ids, job.topology)]
                        + list(job.attach_to)}
                    for n in job.node_ids}
        return {n: {"listen_to": f"tcp://{job.address}:0", "init_method": job.init_method,
                    "world_size": job.world_size, "topology": job.topology,
                    "attach_to": list(job.attach_to)} for n in job.node_ids}

    def platform_options(self, plan: PlatformPlan, init_method: str | None) -> Options:
        options = {}
        for n in plan.node_ids:
            o = plan.options_for(n)
            if plan.discovery == "static":
                options[n] = {"listen_to": o["listen_to"], "attach_to": o["attach_to"]}
            else:  # the workers meet in the store at init_method and dial what they find there
                options[n] = {"listen_to": o["listen_to"], "init_method": init_method or o["init_method"],
                              "world_size": plan.world_size, "topology": plan.topology, "attach_to": []}
        return options

    def check_platform(self, plan: PlatformPlan, init_method: str | None) -> None:
        if init_method and plan.discovery == "static":
            raise ConfigError(f"--init-method conflicts with --platform {plan.platform}: nng workers find "
                              f"each other at the addresses of {plan.source}; drop --init-method")

    def binds_plan_ports(self) -> bool:
        return True

    def extras(self, given: WorkerExtras) -> dict[str, Any]:
        return {"protocol": given.protocol}

    def relays_abort(self, topology: str) -> bool:
        return topology != "mesh"  # a star leaf knows only the hub


class TorchRpcLaunch:
    """torchrpc workers meet in a rendezvous store; node 0 hosts it."""

    def local_options(self, job: LocalJob) -> Options:
        im = job.init_method or f"tcp://{job.address}:{job.pick_port(job.address)}"
        return {n: {"init_method": im, "world_size": job.world_size} for n in job.node_ids}

    def platform_options(self, plan: PlatformPlan, init_method: str | None) -> Options:
        return {n: {"init_method": init_method or plan.options_for(n)["init_method"],
                    "world_size": plan.world_size} for n in plan.node_ids}

    def check_platform(self, plan: PlatformPlan, init_method: str | None) -> None:
        return None

    def binds_plan_ports(self) -> bool:
        return False  # TensorPipe picks its own ports; only the store's is known up front

    def extras(self, given: WorkerExtras) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if given.local_cuda_devices is not None:
            out["local_cuda_devices"] = given.local_cuda_devices
        if given.cuda_device_map:
            out["cuda_device_map"] = given.cuda_device_map
        return out

    def relays_abort(self, topology: str) -> bool:
        return False  # every torchrpc worker reaches every other


_PROFILES: dict[str, LaunchProfile] = {"nng": NngLaunch(), "torchrpc": TorchRpcLaunch()}


def _family(mq_type: str) -> str:
    return mq_type.partition(":")[0]


def launchable_mq_types() -> list[str]:
    """The mq types whose nodes the launcher can start, one process each."""
    return [t for t in MQ_TYPES if _family(t) in _PROFILES]


def profile_for(mq_type: str) -> LaunchProfile:
    """The launch profile of ``mq_type``.

    Raises:
        ConfigError: an unknown mq type, or one whose nodes cannot run in separate processes.
    """
    mq_type = check_mq_type(mq_type)
    profile = _PROFILES.get(_family(mq_type))
    if profile is None:
        raise ConfigError(f"mq type {mq_type!r} cannot be launched (its nodes live in one process): "
                          f"choose one of {', '.join(launchable_mq_types())}")
    return profile

