"""How ``mq run`` starts torchrpc workers (:class:`mq.backend.LaunchProfile`): they meet
in a rendezvous store (``init_method``, ``world_size``) that node 0 hosts, and take the CUDA
options (``local_cuda_devices``, ``cuda_device_map``), checked before any starts."""

from __future__ import annotations

from typing import Any

from mq.backends.torchrpc import device_map
from mq.backend import LocalJob, Options
from mq.platforms import PlatformPlan

__all__ = ["TorchRpcLaunch"]


class TorchRpcLaunch:
    """torchrpc workers meet in a rendezvous store; node 0 hosts it."""

    #: The mq types that take a CUDA device map.
    device_map_types = frozenset({"torchrpc:cuda"})

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

    def check_worker_options(self, mq_type: str, node_id: int, options: dict[str, Any]) -> None:
        spec = options.get("cuda_device_map")
        if spec:  # the map names this host's GPUs: checked here, before any worker starts
            device_map.reject_for_cpu(mq_type, spec, self.device_map_types)
            device_map.parse(spec, node_id, options.get("local_cuda_devices"))

    def relays_abort(self, topology: str) -> bool:
        return False  # every torchrpc worker reaches every other
