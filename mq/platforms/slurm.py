"""``--platform slurm``: node ids, hosts and ports from a Slurm job step's environment."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from mq.errors import ConfigError
from mq.platforms.hostlist import expand_hostlist, parse_tasks_per_node
from mq.platforms.plan import (
    DEFAULT_BASE_PORT, PlatformPlan, build_plan, check_port, check_workers, env_int, first_present,
    missing_error,
)

_SLURM_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_SLURM_TASKS_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
_SLURM_FIX = (
    "run inside a Slurm allocation (salloc or sbatch; srun for one process per task) "
    "or use --platform local"
)


def _slurm_host_index(environ: Mapping[str, str], hosts: list[str]) -> int | None:
    """This host's index from SLURM_NODEID, else SLURMD_NODENAME; None when neither is set."""
    by_name: int | None = None
    nodename = environ.get("SLURMD_NODENAME", "").strip()
    if nodename:
        # Exact names first; then the first DNS label, for sites whose node list and
        # SLURMD_NODENAME disagree on the domain part.
        short = nodename.split(".")[0]
        exact = [i for i, host in enumerate(hosts) if host == nodename]
        loose = [i for i, host in enumerate(hosts) if host.split(".")[0] == short]
        if exact or len(loose) == 1:
            by_name = (exact or loose)[0]
    if environ.get("SLURM_NODEID", "").strip():
        index = env_int(environ, "SLURM_NODEID", _SLURM_FIX)
        if index >= len(hosts):
            raise ConfigError(
                f"SLURM_NODEID={index} is outside the node list of {len(hosts)} hosts "
                f"({_some_hosts(hosts)})"
            )
        if by_name is not None and by_name != index:
            raise ConfigError(
                f"SLURM_NODEID={index} says this is {hosts[index]} but SLURMD_NODENAME="
                f"{nodename!r} is host {by_name} of the node list; the variables come from "
                f"different steps or allocations"
            )
        return index
    if nodename and by_name is None:
        raise ConfigError(
            f"SLURMD_NODENAME={nodename!r} is not in the node list ({_some_hosts(hosts)}); {_SLURM_FIX}"
        )
    return by_name


def _some_hosts(hosts: Sequence[str]) -> str:
    return f"{', '.join(hosts[:8])}{', ...' if len(hosts) > 8 else ''}"


def from_slurm(
    environ: Mapping[str, str] | None = None,
    *,
    workers_per_node: int | None,
    base_port: int = DEFAULT_BASE_PORT,
    topology: str = "mesh",
    rendezvous_port: int | None = None,
) -> PlatformPlan:
    """Plan from a Slurm job (``--platform slurm``).

    The two forms a Slurm user writes, both started by ``srun``:

    * ``workers_per_node=None`` (``srun -N2 -n4 mq run ...``): one worker per Slurm task. Its
      node id is ``SLURM_PROCID`` and the world is every task of the step; hosts may carry
      different task counts (``3,1``).
    * ``workers_per_node=W`` (``srun -N2 --ntasks-per-node=1 mq run -n W ...``): one launcher
      per host runs ``W`` workers; host ``h`` of the step runs ids ``h*W .. h*W+W-1``. A step
      with more than one task on a host is an error (the launchers would collide).

    Outside a step (the batch script itself, or an ``salloc`` shell) only a one-host
    allocation works: it runs ``W`` workers (default: the allocation's tasks on this host).
    A multi-host allocation without ``srun`` would start one host and wait for the others
    forever, so it is an error saying to use ``srun``.

    Worker ``i`` of a host listens on ``base_port + i`` (``SLURM_LOCALID`` per task).

    Args:
        environ: the environment to read; ``os.environ`` when None.
        workers_per_node: workers per host, or None for one worker per srun task.
        base_port: port of each host's first worker.
        topology: ``"mesh"``, ``"star"`` or ``"alone"``.
        rendezvous_port: torch RPC rendezvous port on the first host; default ``base_port - 1``.

    Returns:
        The plan.

    Raises:
        ConfigError: not inside a Slurm job, a multi-host job without srun, missing variables
            (all of them are listed), malformed values, a task layout that is not Slurm's
            block distribution, or several tasks on a host with ``workers_per_node``.
    """
    env = os.environ if environ is None else environ
    check_port(base_port, "base port")
    if workers_per_node is not None:
        check_workers(workers_per_node, "workers_per_node")
    if first_present(env, ("SLURM_JOB_ID", "SLURM_JOBID")) is None:
        raise ConfigError(
            "--platform slurm: not inside a Slurm job (SLURM_JOB_ID is not set); submit with "
            "sbatch or salloc and start mq run with srun, or use --platform local"
        )
    in_step = first_present(env, ("SLURM_STEP_ID", "SLURM_STEPID")) is not None
    if not in_step:
        return _slurm_outside_step(env, workers_per_node, base_port, topology, rendezvous_port)

    list_var, tasks_var = _step_variables(env)
    hosts = _hosts_from(env, list_var)
    tasks = parse_tasks_per_node(env[tasks_var], len(hosts), name=tasks_var)
    procid, host_index = _task_place(env, hosts, tasks, tasks_var)
    if workers_per_node is None:
        counts, node_ids = tasks, [procid]
    else:
        counts, node_ids = _launcher_per_host(hosts, tasks, host_index, workers_per_node)
    return build_plan(
        platform="slurm",
        hosts=hosts,
        counts=counts,
        host_ports=[base_port] * len(hosts),
        host_index=host_index,
        node_ids=node_ids,
        topology=topology,
        rendezvous_port=rendezvous_port,
        source=list_var,
    )


def _step_variables(env: Mapping[str, str]) -> tuple[str, str]:
    """The node-list and tasks-per-node variables a step has; every missing one is named."""
    missing: list[str] = []
    list_var = first_present(env, _SLURM_NODELIST_VARS)
    if list_var is None:
        missing.append("SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST)")
    tasks_var = first_present(env, _SLURM_TASKS_VARS)
    if tasks_var is None:
        missing.append("SLURM_STEP_TASKS_PER_NODE (or SLURM_TASKS_PER_NODE)")
    missing.extend(v for v in ("SLURM_PROCID", "SLURM_LOCALID") if not env.get(v, "").strip())
    if missing:
        raise missing_error("slurm", missing, _SLURM_FIX)
    assert list_var is not None and tasks_var is not None
    return list_var, tasks_var


def _hosts_from(env: Mapping[str, str], list_var: str) -> list[str]:
    try:
        return expand_hostlist(env[list_var])
    except ConfigError as exc:
        raise ConfigError(f"{list_var}: {exc}") from None


def _task_place(env: Mapping[str, str], hosts: list[str], tasks: list[int],
                tasks_var: str) -> tuple[int, int]:
    """This task's (SLURM_PROCID, host index), checked against block distribution."""
    procid = env_int(env, "SLURM_PROCID", _SLURM_FIX)
    localid = env_int(env, "SLURM_LOCALID", _SLURM_FIX)
    world = sum(tasks)
    if procid >= world:
        raise ConfigError(
            f"SLURM_PROCID={procid} is outside the {world} tasks that {tasks_var}="
            f"{env[tasks_var]!r} gives; the variables come from different steps"
        )
    offset = 0
    host_index = 0
    for host_index, count in enumerate(tasks):  # noqa: B007 - read after the loop: the task's host
        if procid < offset + count:
            break
        offset += count
    # Node ids and ports assume block distribution (a host's ranks are consecutive). Cyclic or
    # arbitrary distributions break that, and would silently give two workers one port.
    if localid != procid - offset:
        raise ConfigError(
            f"SLURM_PROCID={procid} with SLURM_LOCALID={localid} does not match block "
            f"distribution over {tasks_var}={env[tasks_var]!r} (expected local id "
            f"{procid - offset} on {hosts[host_index]}); launch with srun --distribution=block"
        )
    if env.get("SLURM_NODEID", "").strip():
        nodeid = env_int(env, "SLURM_NODEID", _SLURM_FIX)
        if nodeid != host_index:
            raise ConfigError(
                f"SLURM_NODEID={nodeid} but SLURM_PROCID={procid} belongs to host "
                f"{host_index} ({hosts[host_index]}) under block distribution; launch with "
                f"srun --distribution=block"
            )
    return procid, host_index


def _launcher_per_host(hosts: list[str], tasks: list[int], host_index: int,
                       workers_per_node: int) -> tuple[list[int], list[int]]:
    """(workers per host, this host's node ids) when one launcher per host runs W workers."""
    if tasks[host_index] > 1:
        # Every task of the host gets the same error, so none of them starts and waits.
        raise ConfigError(
            f"srun started {tasks[host_index]} tasks on {hosts[host_index]} but "
            f"-n/--parallel-workers {workers_per_node} runs one launcher per host: use "
            f"srun --ntasks-per-node=1 -n {len(hosts)} (inside an allocation srun "
            f"inherits its task count), or drop -n to run one worker per Slurm task"
        )
    first = host_index * workers_per_node
    return [workers_per_node] * len(hosts), list(range(first, first + workers_per_node))


def _slurm_outside_step(
    env: Mapping[str, str],
    workers_per_node: int | None,
    base_port: int,
    topology: str,
    rendezvous_port: int | None,
) -> PlatformPlan:
    """The batch script or an salloc shell: only a one-host allocation can run from here."""
    list_var = first_present(env, ("SLURM_JOB_NODELIST", "SLURM_NODELIST"))
    if list_var is None:
        raise missing_error("slurm", ["SLURM_JOB_NODELIST (or SLURM_NODELIST)"], _SLURM_FIX)
    hosts = _hosts_from(env, list_var)
    if len(hosts) > 1:
        raise ConfigError(
            f"--platform slurm runs outside a job step (no SLURM_STEP_ID: the batch script or "
            f"an salloc shell) in an allocation of {len(hosts)} hosts ({_some_hosts(hosts)}), so it "
            f"would start one host and wait for the others; start it with srun: "
            f"'srun mq run --platform slurm ...' (one worker per task) or 'srun "
            f"--ntasks-per-node=1 mq run --platform slurm -n W ...' (W workers per host)"
        )
    host_index = _slurm_host_index(env, hosts)
    if host_index is None:
        raise ConfigError(
            f"--platform slurm runs outside the allocation's host {hosts[0]} (SLURMD_NODENAME "
            f"and SLURM_NODEID are not set: an salloc shell on the submit host); start it "
            f"with srun"
        )
    workers = workers_per_node
    if workers is None:
        tasks_var = first_present(env, ("SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"))
        workers = parse_tasks_per_node(env[tasks_var], 1, name=tasks_var)[0] if tasks_var else 1
    return build_plan(
        platform="slurm",
        hosts=hosts,
        counts=[workers],
        host_ports=[base_port],
        host_index=0,
        node_ids=list(range(workers)),
        topology=topology,
        rendezvous_port=rendezvous_port,
        source=list_var,
    )
