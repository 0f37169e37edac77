"""How ``mq run`` starts nng workers (:class:`mq.backend.LaunchProfile`): each listens on
an address and dials the peers its topology names; addresses are static, or found through a
rendezvous store."""

from __future__ import annotations

from typing import Any

from mq.errors import ConfigError
from mq.backend import LocalJob, Options
from mq.platforms import PlatformPlan
from mq.rendezvous import attach_targets

__all__ = ["NngLaunch"]


class NngLaunch:
    """nng workers listen on an address and dial the peers their topology names."""

    def local_options(self, job: LocalJob) -> Options:
        ports = job.ports
        if not ports and not job.init_method:
            # No ports given: the launcher picks free ones. (A rendezvous store would work too,
            # but it needs torch.distributed, a one-second import for every worker.)
            ports = job.pick_ports(len(job.node_ids))
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

    def check_worker_options(self, mq_type: str, node_id: int, options: dict[str, Any]) -> None:
        return None

    def relays_abort(self, topology: str) -> bool:
        return topology != "mesh"  # a star leaf knows only the hub
