"""Launch platforms: turn a scheduler's environment into node ids, addresses, ports and links.

``mq run --platform slurm|k8s|local`` calls one of :func:`from_slurm`, :func:`from_k8s` or
:func:`from_local` (or :func:`plan_for`, which picks by name). Each returns a
:class:`PlatformPlan` that is the same shape whatever the platform and whatever the mq type:
``listen_to``/``attach_to`` for ``nng`` and ``init_method``/``world_size`` for ``torchrpc``.

Numbering is global and contiguous: hosts are taken in scheduler order and the workers of host
``h`` get the ids after those of hosts ``0..h-1``. With the same count ``w`` on every host this
is ``host_index * w + local_index``. Ids therefore double as torch RPC ranks. Worker ``i`` on a
host listens on ``base_port + i``; ``init_method`` is ``tcp://<first host>:<rendezvous_port>``,
with ``rendezvous_port`` defaulting to ``base_port - 1`` so it never collides with a worker.

Environment variables read
--------------------------

Slurm (:func:`from_slurm`), always inside a job step started by ``srun``:

* ``SLURM_JOB_ID`` (inside a Slurm job at all) and ``SLURM_STEP_ID`` (inside an srun step;
  without it only a one-host allocation can run, anything else is explained as an error).
* ``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST``, else ``SLURM_NODELIST``: the hosts,
  in hostlist syntax (``gpu[01-02],cpu007``; expanded by python-hostlist). The step list wins
  because the step may use only part of the allocation, and the ids below are step-relative.
* ``SLURM_PROCID``, ``SLURM_LOCALID`` and ``SLURM_STEP_TASKS_PER_NODE`` (else
  ``SLURM_TASKS_PER_NODE``; forms ``2``, ``2(x3)``, ``2(x2),1``). One process per task
  (``srun -n 4 mq run``): node id ``SLURM_PROCID``, port offset ``SLURM_LOCALID``. One launcher
  per host (``srun --ntasks-per-node=1 mq run -n W``): the host's index gives the ids. Slurm's
  default block distribution is assumed and checked; ``SLURM_NODEID`` is cross-checked.

Kubernetes (:func:`from_k8s`):

* DI-engine style: ``DI_NODES``, comma-separated pods in rank order, each ``host`` or
  ``host:port`` (hostlist brackets expanded: ``learner-[0-3].mq.default.svc:50515``), and
  ``DI_RANK`` (else ``JOB_COMPLETION_INDEX`` of an Indexed Job, else ``HOSTNAME`` looked up).
* torchrun / Kubeflow PyTorchJob style: ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``,
  ``RANK`` (else ``JOB_COMPLETION_INDEX``), ``LOCAL_RANK`` and ``POD_IP`` (else
  ``HOSTNAME``): workers meet through a store at ``MASTER_ADDR:MASTER_PORT``.

Every missing or malformed variable is a :class:`~mq.errors.ConfigError` that names it and says
how to fix it (run inside the allocation, or use ``--platform local``).

Hosts are used as given: IPv6 literals are not supported in host lists.

Modules: :mod:`~mq.platforms.plan` (the plan and the layout every platform shares),
:mod:`~mq.platforms.hostlist` (Slurm's list syntax), :mod:`~mq.platforms.local`,
:mod:`~mq.platforms.slurm`, :mod:`~mq.platforms.k8s` (one per platform),
:mod:`~mq.platforms.roles` (``--roles``) and :mod:`~mq.platforms.resolve` (host names).
"""

from __future__ import annotations


from __future__ import annotations

from collections.abc import Mapping

from mq.errors import ConfigError
from mq.platforms.hostlist import expand_hostlist, parse_tasks_per_node
from mq.platforms.k8s import from_k8s
from mq.platforms.local import from_local
from mq.platforms.plan import DEFAULT_BASE_PORT, PLATFORMS, PlatformPlan, attach_lists
from mq.platforms.resolve import resolve_hosts
from mq.platforms.roles import assign_roles
from mq.platforms.slurm import from_slurm

__all__ = [
    "DEFAULT_BASE_PORT",
    "PLATFORMS",
    "PlatformPlan",
    "assign_roles",
    "attach_lists",
    "expand_hostlist",
    "from_k8s",
    "from_local",
    "from_slurm",
    "parse_tasks_per_node",
    "plan_for",
    "resolve_hosts",
]


def plan_for(
    platform: str,
    *,
    environ: Mapping[str, str] | None = None,
    workers_per_node: int | None = None,
    address: str = "127.0.0.1",
    base_port: int = DEFAULT_BASE_PORT,
    topology: str = "mesh",
    rendezvous_port: int | None = None,
) -> PlatformPlan:
    """Dispatch ``--platform local|slurm|k8s`` to the matching ``from_*`` function.

    Args:
        platform: ``"local"``, ``"slurm"`` or ``"k8s"``.
        environ: the environment to read (slurm, k8s); ``os.environ`` when None.
        workers_per_node: workers this launcher runs per host; for local, None means one; for
            slurm, None means one worker per srun task.
        address: listen host for local.
        base_port: first worker port per host.
        topology: ``"mesh"``, ``"star"`` or ``"alone"``.
        rendezvous_port: torch RPC rendezvous port; default ``base_port - 1``.

    Returns:
        The plan.

    Raises:
        ConfigError: unknown platform, or whatever the chosen function raises.
    """
    if platform == "local":
        return from_local(
            1 if workers_per_node is None else workers_per_node,
            address=address,
            base_port=base_port,
            topology=topology,
            rendezvous_port=rendezvous_port,
        )
    if platform == "slurm":
        return from_slurm(
            environ,
            workers_per_node=workers_per_node,
            base_port=base_port,
            topology=topology,
            rendezvous_port=rendezvous_port,
        )
    if platform == "k8s":
        return from_k8s(
            environ,
            workers_per_node=workers_per_node,
            base_port=base_port,
            topology=topology,
            rendezvous_port=rendezvous_port,
        )
    raise ConfigError(f"unknown platform {platform!r}: expected one of {', '.join(PLATFORMS)}")
