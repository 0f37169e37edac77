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
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mq.errors import ConfigError

__all__ = [
    "DEFAULT_BASE_PORT",
    "PLATFORMS",
    "TOPOLOGIES",
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

DEFAULT_BASE_PORT = 50515
TOPOLOGIES = ("mesh", "star", "alone")
PLATFORMS = ("local", "slurm", "k8s")

# No real job has anywhere near this many hosts (python-hostlist caps a range at the same).
_MAX_HOSTS = 100_000
# Capping digits keeps int() away from Python's huge-integer guard (a bare ValueError).
_MAX_DIGITS = 18
_TASKS_RE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")

_SLURM_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_SLURM_TASKS_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
_SLURM_FIX = (
    "run inside a Slurm allocation (salloc or sbatch; srun for one process per task) "
    "or use --platform local"
)
_K8S_FIX = (
    "set them in the pod spec (DI_NODES lists every pod as host or host:port in rank order; "
    "DI_RANK is this pod's index, e.g. the StatefulSet ordinal) or use --platform local"
)


# --------------------------------------------------------------------------------------------
# Hostlists


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm hostlist expression into host names, in Slurm's order.

    The expansion itself is python-hostlist's (``hostlist.expand_hostlist``, the library
    Slurm sites use): bracket ranges with zero padding (``n[008-011]``), text after a bracket
    (``gpu-a[1-2]-ib``), several bracket groups (``rack[1-2]-n[01-02]``, last varies fastest).
    This wrapper only adds what a launcher needs on top: duplicates are kept, blanks around
    commas are ignored, and every malformed text is a ConfigError quoting it.

    Args:
        text: the hostlist, e.g. ``"node[01-03,07],gpu-a[1-2]-ib,login1"``.

    Returns:
        The host names.

    Raises:
        ConfigError: the text is empty, has an empty entry (stray comma), whitespace inside
            an entry, or is rejected by python-hostlist (unbalanced or nested brackets, a bad
            or reversed range, more than 100000 hosts).
    """
    import hostlist

    if not isinstance(text, str):
        raise ConfigError(f"hostlist must be a string, got {type(text).__name__}: {text!r}")
    # python-hostlist silently drops empty entries and keeps blanks; a job script with either
    # has a typo the user should see.
    flat = re.sub(r"\s*,\s*", ",", text.strip())
    if not flat:
        raise ConfigError(f"hostlist {text!r} is empty: expected hosts such as node[01-03],login1")
    if flat.startswith(",") or flat.endswith(",") or ",," in flat:
        raise ConfigError(
            f"hostlist {text!r} is malformed: it has an empty entry (a leading, trailing "
            f"or doubled comma)"
        )
    if any(ch.isspace() for ch in flat):
        raise ConfigError(
            f"hostlist {text!r} is malformed: an entry contains whitespace; separate hosts "
            f"with commas"
        )
    try:
        hosts = hostlist.expand_hostlist(flat, allow_duplicates=True)
    except hostlist.BadHostlist as exc:
        raise ConfigError(f"hostlist {text!r} is malformed: {exc}") from None
    if len(hosts) > _MAX_HOSTS:
        raise ConfigError(f"hostlist {text!r} is too large: more than {_MAX_HOSTS} hosts")
    return hosts


def parse_tasks_per_node(
    text: str, n_hosts: int, *, name: str = "SLURM_TASKS_PER_NODE"
) -> list[int]:
    """Parse Slurm's compressed tasks-per-node list into one count per host.

    Args:
        text: ``"2"``, ``"2(x3)"`` or ``"2(x2),1"``. A single plain count applies to every host
            (that is how ``SLURM_NTASKS_PER_NODE`` is written).
        n_hosts: the number of hosts in the node list the counts must cover.
        name: the variable the text came from, for error messages.

    Returns:
        ``n_hosts`` positive counts.

    Raises:
        ConfigError: malformed entries, a zero count, or a count list that does not match the
            number of hosts.
    """
    counts: list[int] = []
    items = [item.strip() for item in text.split(",")]
    repeated = False
    for item in items:
        match = _TASKS_RE.match(item)
        if match is None or len(item) > 2 * _MAX_DIGITS:
            raise ConfigError(
                f"{name}={text!r} is malformed: {item!r} is not a count such as 2 or 2(x3)"
            )
        count = int(match.group(1))
        repeat = 1 if match.group(2) is None else int(match.group(2))
        repeated = repeated or match.group(2) is not None
        if count < 1 or repeat < 1:
            raise ConfigError(f"{name}={text!r} is malformed: {item!r} has a zero count")
        if len(counts) + repeat > _MAX_HOSTS:
            raise ConfigError(f"{name}={text!r} covers more than {_MAX_HOSTS} hosts")
        counts.extend([count] * repeat)
    if len(items) == 1 and not repeated:
        # One bare count is SLURM_NTASKS_PER_NODE's form: the same count on every host.
        counts = counts * n_hosts
    if len(counts) != n_hosts:
        raise ConfigError(
            f"{name}={text!r} gives task counts for {len(counts)} hosts but the node list has "
            f"{n_hosts}; the two variables must come from the same allocation or step"
        )
    return counts


# --------------------------------------------------------------------------------------------
# Plans


@dataclass(frozen=True)
class PlatformPlan:
    """Where every worker of the job lives and how the workers connect.

    Every mapping covers the whole job (all ``world_size`` node ids), not just this host, so
    any worker can address any peer; ``node_ids`` says which of them this process should run.

    Attributes:
        platform: ``"local"``, ``"slurm"`` or ``"k8s"``.
        node_ids: the node ids this process (launcher or srun task) should run.
        world_size: the number of nodes in the job; node ids are ``0 .. world_size - 1``.
        host_index: this host's (or pod's) position in ``hosts``.
        hosts: the job's hosts in scheduler order (one entry per Slurm host or k8s pod).
        addresses: node id -> host it runs on.
        ports: node id -> port it listens on.
        listen_to: node id -> ``tcp://host:port`` it listens on.
        attach_to: node id -> addresses it dials, per ``topology``.
        init_method: ``tcp://<first host>:<rendezvous port>`` for torch RPC rendezvous.
        topology: ``"mesh"``, ``"star"`` or ``"alone"``.
        discovery: ``"static"`` (every address above is known up front) or ``"rendezvous"``
            (torchrun-style environments: only this host's workers are in ``listen_to``; the
            workers find each other through the store at ``init_method``).
        source: the variable the hosts came from, for messages (``SLURM_STEP_NODELIST``).
    """

    platform: str
    node_ids: list[int]
    world_size: int
    host_index: int
    hosts: list[str]
    addresses: dict[int, str] = field(repr=False)
    ports: dict[int, int] = field(repr=False)
    listen_to: dict[int, str] = field(repr=False)
    attach_to: dict[int, list[str]] = field(repr=False)
    init_method: str
    topology: str
    discovery: str = "static"
    source: str = ""

    def options_for(self, node_id: int) -> dict[str, object]:
        """The per-worker options ``mq.create`` needs, for any mq type.

        Args:
            node_id: one of the job's node ids.

        Returns:
            ``node_id``, ``world_size``, ``listen_to``, ``attach_to`` and ``init_method``.

        Raises:
            ConfigError: ``node_id`` is not in the job.
        """
        if node_id not in self.listen_to:
            raise ConfigError(
                f"node id {node_id!r} is not in this {self.platform} job "
                f"(node ids are 0..{self.world_size - 1})"
            )
        return {
            "node_id": node_id,
            "world_size": self.world_size,
            "listen_to": self.listen_to[node_id],
            "attach_to": list(self.attach_to.get(node_id, [])),
            "init_method": self.init_method,
        }


def attach_lists(listen_to: Mapping[int, str], topology: str) -> dict[int, list[str]]:
    """Who dials whom, so that each connected pair is dialled exactly once.

    Args:
        listen_to: node id -> listen address, for every node of the job.
        topology: ``"mesh"`` (each node dials every node with a lower id: all pairs, once),
            ``"star"`` (every node but the lowest id dials the lowest id) or ``"alone"``
            (nobody dials).

    Returns:
        node id -> list of addresses to attach to, in ascending peer id order.

    Raises:
        ConfigError: unknown topology.
    """
    _check_topology(topology)
    from mq.rendezvous import attach_targets  # the one place the topology rule lives

    ids = sorted(listen_to)
    return {n: [listen_to[p] for p in attach_targets(n, ids, topology)] for n in ids}


def _check_topology(topology: str) -> None:
    if topology not in TOPOLOGIES:
        raise ConfigError(
            f"unknown topology {topology!r}: expected one of {', '.join(TOPOLOGIES)}"
        )


def _check_workers(workers: object, name: str) -> int:
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ConfigError(f"{name} must be a positive integer, got {workers!r}")
    return workers


def _check_port(port: object, what: str) -> int:
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ConfigError(f"{what} {port!r} is not a TCP port (1..65535)")
    return port


def _build_plan(
    *,
    platform: str,
    hosts: Sequence[str],
    counts: Sequence[int],
    host_ports: Sequence[int],
    host_index: int,
    node_ids: list[int],
    topology: str,
    rendezvous_port: int | None,
    source: str = "",
) -> PlatformPlan:
    """Lay out ``counts[h]`` workers on each host ``h`` and derive every address from that."""
    _check_topology(topology)
    addresses: dict[int, str] = {}
    ports: dict[int, int] = {}
    node_id = 0
    for host, count, base in zip(hosts, counts, host_ports):
        for local in range(count):
            addresses[node_id] = host
            ports[node_id] = _check_port(
                base + local, f"port of worker {local} on {host} (base port {base} + {local}) ="
            )
            node_id += 1
    listen_to = {n: f"tcp://{addresses[n]}:{ports[n]}" for n in addresses}
    seen: dict[str, int] = {}
    for n, addr in listen_to.items():
        if addr in seen:
            raise ConfigError(
                f"{platform} plan gives nodes {seen[addr]} and {n} the same address {addr}: "
                f"a host is listed twice; give each entry its own port range"
            )
        seen[addr] = n
    if rendezvous_port is None:
        rendezvous_port = host_ports[0] - 1
    _check_port(rendezvous_port, "rendezvous port")
    first = f"tcp://{hosts[0]}:{rendezvous_port}"
    if first in seen:
        raise ConfigError(
            f"rendezvous address {first} is also node {seen[first]}'s listen address; "
            f"pick a rendezvous port outside the workers' ports"
        )
    return PlatformPlan(
        platform=platform,
        node_ids=node_ids,
        world_size=node_id,
        host_index=host_index,
        hosts=list(hosts),
        addresses=addresses,
        ports=ports,
        listen_to=listen_to,
        attach_to=attach_lists(listen_to, topology),
        init_method=first,
        topology=topology,
        source=source,
    )


def _env_int(environ: Mapping[str, str], name: str, fix: str) -> int:
    value = environ[name].strip()
    if not (value.isascii() and value.isdigit()) or len(value) > _MAX_DIGITS:
        raise ConfigError(f"{name}={environ[name]!r} is not a non-negative integer; {fix}")
    return int(value)


def _first_present(environ: Mapping[str, str], names: Sequence[str]) -> str | None:
    for name in names:
        if environ.get(name, "").strip():
            return name
    return None


def _missing_error(platform: str, missing: list[str], fix: str) -> ConfigError:
    return ConfigError(
        f"--platform {platform} needs environment variables that are not set: "
        f"{', '.join(missing)}; {fix}"
    )


# --------------------------------------------------------------------------------------------
# Platforms


def from_local(
    n_workers: int,
    *,
    address: str = "127.0.0.1",
    base_port: int = DEFAULT_BASE_PORT,
    topology: str = "mesh",
    rendezvous_port: int | None = None,
) -> PlatformPlan:
    """Plan for ``n_workers`` workers on this machine (``--platform local``).

    Args:
        n_workers: number of workers; node ids ``0 .. n_workers - 1``, all run here.
        address: host every worker listens on.
        base_port: worker ``i`` listens on ``base_port + i``.
        topology: ``"mesh"``, ``"star"`` or ``"alone"``.
        rendezvous_port: torch RPC rendezvous port; default ``base_port - 1``.

    Returns:
        The plan.

    Raises:
        ConfigError: bad worker count, port, address or topology.
    """
    n_workers = _check_workers(n_workers, "n_workers")
    _check_port(base_port, "base port")
    if not isinstance(address, str) or not address.strip() or any(c.isspace() for c in address):
        raise ConfigError(f"address {address!r} is not a host name or IP address")
    return _build_plan(
        platform="local",
        hosts=[address],
        counts=[n_workers],
        host_ports=[base_port],
        host_index=0,
        node_ids=list(range(n_workers)),
        topology=topology,
        rendezvous_port=rendezvous_port,
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
        index = _env_int(environ, "SLURM_NODEID", _SLURM_FIX)
        if index >= len(hosts):
            raise ConfigError(
                f"SLURM_NODEID={index} is outside the node list of {len(hosts)} hosts "
                f"({_some(hosts)})"
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
            f"SLURMD_NODENAME={nodename!r} is not in the node list ({_some(hosts)}); {_SLURM_FIX}"
        )
    return by_name


def _some(hosts: Sequence[str]) -> str:
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
    _check_port(base_port, "base port")
    if workers_per_node is not None:
        _check_workers(workers_per_node, "workers_per_node")
    if _first_present(env, ("SLURM_JOB_ID", "SLURM_JOBID")) is None:
        raise ConfigError(
            "--platform slurm: not inside a Slurm job (SLURM_JOB_ID is not set); submit with "
            "sbatch or salloc and start mq run with srun, or use --platform local"
        )
    in_step = _first_present(env, ("SLURM_STEP_ID", "SLURM_STEPID")) is not None
    if not in_step:
        return _slurm_outside_step(env, workers_per_node, base_port, topology, rendezvous_port)

    missing: list[str] = []
    list_var = _first_present(env, _SLURM_NODELIST_VARS)
    if list_var is None:
        missing.append("SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST)")
    tasks_var = _first_present(env, _SLURM_TASKS_VARS)
    if tasks_var is None:
        missing.append("SLURM_STEP_TASKS_PER_NODE (or SLURM_TASKS_PER_NODE)")
    missing.extend(v for v in ("SLURM_PROCID", "SLURM_LOCALID") if not env.get(v, "").strip())
    if missing:
        raise _missing_error("slurm", missing, _SLURM_FIX)
    assert list_var is not None and tasks_var is not None
    try:
        hosts = expand_hostlist(env[list_var])
    except ConfigError as exc:
        raise ConfigError(f"{list_var}: {exc}") from None
    tasks = parse_tasks_per_node(env[tasks_var], len(hosts), name=tasks_var)
    procid = _env_int(env, "SLURM_PROCID", _SLURM_FIX)
    localid = _env_int(env, "SLURM_LOCALID", _SLURM_FIX)
    world = sum(tasks)
    if procid >= world:
        raise ConfigError(
            f"SLURM_PROCID={procid} is outside the {world} tasks that {tasks_var}="
            f"{env[tasks_var]!r} gives; the variables come from different steps"
        )
    offset = 0
    host_index = 0
    for host_index, count in enumerate(tasks):
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
        nodeid = _env_int(env, "SLURM_NODEID", _SLURM_FIX)
        if nodeid != host_index:
            raise ConfigError(
                f"SLURM_NODEID={nodeid} but SLURM_PROCID={procid} belongs to host "
                f"{host_index} ({hosts[host_index]}) under block distribution; launch with "
                f"srun --distribution=block"
            )
    if workers_per_node is None:
        counts, node_ids = tasks, [procid]
    else:
        if tasks[host_index] > 1:
            # Every task of the host gets the same error, so none of them starts and waits.
            raise ConfigError(
                f"srun started {tasks[host_index]} tasks on {hosts[host_index]} but "
                f"-n/--parallel-workers {workers_per_node} runs one launcher per host: use "
                f"srun --ntasks-per-node=1 -n {len(hosts)} (inside an allocation srun "
                f"inherits its task count), or drop -n to run one worker per Slurm task"
            )
        counts = [workers_per_node] * len(hosts)
        first = host_index * workers_per_node
        node_ids = list(range(first, first + workers_per_node))
    return _build_plan(
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


def _slurm_outside_step(
    env: Mapping[str, str],
    workers_per_node: int | None,
    base_port: int,
    topology: str,
    rendezvous_port: int | None,
) -> PlatformPlan:
    """The batch script or an salloc shell: only a one-host allocation can run from here."""
    list_var = _first_present(env, ("SLURM_JOB_NODELIST", "SLURM_NODELIST"))
    if list_var is None:
        raise _missing_error("slurm", ["SLURM_JOB_NODELIST (or SLURM_NODELIST)"], _SLURM_FIX)
    try:
        hosts = expand_hostlist(env[list_var])
    except ConfigError as exc:
        raise ConfigError(f"{list_var}: {exc}") from None
    if len(hosts) > 1:
        raise ConfigError(
            f"--platform slurm runs outside a job step (no SLURM_STEP_ID: the batch script or "
            f"an salloc shell) in an allocation of {len(hosts)} hosts ({_some(hosts)}), so it "
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
        tasks_var = _first_present(env, ("SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"))
        workers = parse_tasks_per_node(env[tasks_var], 1, name=tasks_var)[0] if tasks_var else 1
    return _build_plan(
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


def _split_host_port(entry: str, text: str, base_port: int) -> tuple[str, int]:
    """``host`` -> (host, base_port); ``host:port`` -> (host, port)."""
    if ":" not in entry:
        return entry, base_port
    host, _, port_text = entry.rpartition(":")
    if not host or ":" in host:
        raise ConfigError(
            f"DI_NODES={text!r} has a malformed entry {entry!r}: expected host or host:port"
        )
    if not (port_text.isascii() and port_text.isdigit()) or len(port_text) > 5:
        raise ConfigError(
            f"DI_NODES={text!r} has a malformed port in {entry!r}: expected host:port with a "
            f"port in 1..65535"
        )
    return host, _check_port(int(port_text), f"DI_NODES entry {entry!r}: port")


def from_k8s(
    environ: Mapping[str, str] | None = None,
    *,
    workers_per_node: int | None = None,
    base_port: int = DEFAULT_BASE_PORT,
    topology: str = "mesh",
    rendezvous_port: int | None = None,
) -> PlatformPlan:
    """Plan from a Kubernetes pod's environment (``--platform k8s``).

    Three forms, tried in this order:

    * DI-engine lists: ``DI_NODES`` names every pod (``host`` or ``host:port``, hostlist
      brackets expanded) and the pod's rank is ``DI_RANK``, else ``JOB_COMPLETION_INDEX``
      (Indexed Job), else ``HOSTNAME`` looked up in the list (StatefulSet). Addresses are static.
    * torchrun / Kubeflow PyTorchJob: ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE`` and
      ``RANK`` (or ``JOB_COMPLETION_INDEX`` for an Indexed Job with a headless service and
      ``MASTER_ADDR=<job>-0.<service>``). No pod knows the others' addresses, so the workers
      meet in a store at ``tcp://MASTER_ADDR:MASTER_PORT`` (the plan's ``discovery`` is
      ``"rendezvous"``) and each listens on ``POD_IP`` (else its own host name) at
      ``base_port + LOCAL_RANK``.

    Pod ``r`` runs ids ``r*w .. r*w+w-1`` with ``w = workers_per_node`` (one when None).

    Args:
        environ: the environment to read; ``os.environ`` when None.
        workers_per_node: workers per pod; None means one.
        base_port: first port of pods whose entry has no port.
        topology: ``"mesh"``, ``"star"`` or ``"alone"``.
        rendezvous_port: torch RPC rendezvous port on the first pod (DI form); default its
            first worker's port minus one.

    Returns:
        The plan.

    Raises:
        ConfigError: missing or malformed variables, a rank outside the job, or two workers on
            one address.
    """
    env = os.environ if environ is None else environ
    _check_port(base_port, "base port")
    workers = (
        1 if workers_per_node is None else _check_workers(workers_per_node, "workers_per_node")
    )
    if not env.get("DI_NODES", "").strip() and env.get("MASTER_ADDR", "").strip():
        return _k8s_torchrun(env, workers, base_port, topology)

    missing: list[str] = []
    if not env.get("DI_NODES", "").strip():
        missing.append("DI_NODES (or MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK)")
    if not any(env.get(v, "").strip() for v in ("DI_RANK", "JOB_COMPLETION_INDEX", "HOSTNAME")):
        missing.append("DI_RANK")
    if missing:
        raise _missing_error("k8s", missing, _K8S_FIX)

    text = env["DI_NODES"]
    try:
        entries = expand_hostlist(text)
    except ConfigError as exc:
        raise ConfigError(f"DI_NODES: {exc}") from None
    pairs = [_split_host_port(entry, text, base_port) for entry in entries]
    hosts = [host for host, _ in pairs]

    rank_var = _first_present(env, ("DI_RANK", "JOB_COMPLETION_INDEX"))
    if rank_var is not None:
        rank = _env_int(env, rank_var, _K8S_FIX)
        if rank >= len(hosts):
            raise ConfigError(
                f"{rank_var}={rank} is outside DI_NODES, which lists {len(hosts)} pods "
                f"(ranks 0..{len(hosts) - 1})"
            )
    else:
        # StatefulSet pods are named <set>-<ordinal>, which is also the first label of the
        # pod's DNS name in the headless service, so the hostname finds the pod's own entry.
        hostname = env["HOSTNAME"].strip()
        short = hostname.split(".")[0]
        matches = [i for i, h in enumerate(hosts) if h == hostname] or [
            i for i, h in enumerate(hosts) if h.split(".")[0] == short
        ]
        if len(matches) != 1:
            raise ConfigError(
                f"DI_RANK is not set and HOSTNAME={hostname!r} matches "
                f"{'no' if not matches else len(matches)} entries of DI_NODES={text!r}; "
                f"set DI_RANK to this pod's index in DI_NODES"
            )
        rank = matches[0]

    first = rank * workers
    return _build_plan(
        platform="k8s",
        hosts=hosts,
        counts=[workers] * len(hosts),
        host_ports=[port for _, port in pairs],
        host_index=rank,
        node_ids=list(range(first, first + workers)),
        topology=topology,
        rendezvous_port=rendezvous_port,
        source="DI_NODES",
    )


_TORCHRUN_FIX = (
    "set MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK as a Kubeflow PyTorchJob does (an "
    "Indexed Job may give JOB_COMPLETION_INDEX instead of RANK), or list the pods in DI_NODES"
)


def _k8s_torchrun(
    env: Mapping[str, str], workers: int, base_port: int, topology: str
) -> PlatformPlan:
    """torchrun-style variables: ranks and a rendezvous address, but no list of pods."""
    rank_var = _first_present(env, ("RANK", "JOB_COMPLETION_INDEX"))
    missing = [v for v in ("MASTER_PORT", "WORLD_SIZE") if not env.get(v, "").strip()]
    if rank_var is None:
        missing.append("RANK (or JOB_COMPLETION_INDEX)")
    if missing:
        raise _missing_error("k8s", missing, _TORCHRUN_FIX)
    assert rank_var is not None
    master = env["MASTER_ADDR"].strip()
    if any(ch.isspace() for ch in master) or not master:
        raise ConfigError(f"MASTER_ADDR={env['MASTER_ADDR']!r} is not a host name or address")
    master_port = _check_port(_env_int(env, "MASTER_PORT", _TORCHRUN_FIX), "MASTER_PORT")
    pods = _env_int(env, "WORLD_SIZE", _TORCHRUN_FIX)
    rank = _env_int(env, rank_var, _TORCHRUN_FIX)
    if pods < 1 or rank >= pods:
        raise ConfigError(
            f"{rank_var}={rank} is outside WORLD_SIZE={pods} (ranks 0..{pods - 1}); the "
            f"variables come from different jobs"
        )
    local_rank = _env_int(env, "LOCAL_RANK", _TORCHRUN_FIX) if env.get("LOCAL_RANK", "").strip() else 0
    if workers > 1 and local_rank:
        raise ConfigError(
            f"LOCAL_RANK={local_rank}: several processes per pod (torchrun --nproc-per-node) "
            f"but -n/--parallel-workers {workers} runs one launcher per pod; drop -n"
        )
    # Peers reach this pod by its IP (POD_IP from the downward API) or its host name, which
    # Kubernetes maps to the pod IP; the launcher turns a name into an address before use.
    here = (env.get("POD_IP") or env.get("HOSTNAME") or "").strip()
    if not here:
        raise _missing_error("k8s", ["POD_IP (or HOSTNAME)"], _TORCHRUN_FIX)
    _check_topology(topology)
    first = rank * workers
    node_ids = list(range(first, first + workers))
    ports = {n: _check_port(base_port + local_rank + i, "worker port") for i, n in enumerate(node_ids)}
    return PlatformPlan(
        platform="k8s",
        node_ids=node_ids,
        world_size=pods * workers,
        host_index=rank,
        hosts=[here],
        addresses={n: here for n in node_ids},
        ports=ports,
        listen_to={n: f"tcp://{here}:{ports[n]}" for n in node_ids},
        attach_to={n: [] for n in node_ids},
        init_method=f"tcp://{master}:{master_port}",
        topology=topology,
        discovery="rendezvous",
        source="MASTER_ADDR",
    )


# --------------------------------------------------------------------------------------------
# Roles by rank and host names


_ROLE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


def assign_roles(spec: str, node_ids: Sequence[int]) -> dict[int, list[str]]:
    """Give each node of the job its role from a spec such as ``learner:1,collector:*``.

    Roles are dealt in node-id order, so the spec means the same locally, under Slurm and on
    k8s: ``learner:1,collector:*`` makes node 0 the learner and every other node a collector.
    A count is a positive integer or ``*`` (the nodes the other roles leave, at most one
    ``*``). A role may carry several labels joined by ``+`` (``learner+evaluator:1``).

    Args:
        spec: the role spec.
        node_ids: every node id of the job (not just this host's).

    Returns:
        node id -> sorted labels, for every id in ``node_ids``.

    Raises:
        ConfigError: a malformed entry, a zero or non-numeric count, a repeated role, two
            ``*``, or counts that do not add up to the job's size.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"roles {spec!r} is empty: expected a spec such as learner:1,collector:*")
    ids = sorted(node_ids)
    entries: list[tuple[list[str], int | None]] = []
    seen: set[str] = set()
    for item in (part.strip() for part in spec.split(",")):
        name, colon, count_text = item.partition(":")
        labels = [label.strip() for label in name.split("+")]
        if not colon or not all(_ROLE_RE.match(label) for label in labels):
            raise ConfigError(
                f"roles {spec!r}: {item!r} is not role:count (such as learner:1 or collector:*)"
            )
        count_text = count_text.strip()
        if count_text == "*":
            if any(count is None for _, count in entries):
                raise ConfigError(f"roles {spec!r}: only one role may take the rest ('*')")
            count = None
        elif count_text.isascii() and count_text.isdigit() and 0 < int(count_text) <= _MAX_HOSTS:
            count = int(count_text)
        else:
            raise ConfigError(
                f"roles {spec!r}: the count of {name!r} is {count_text!r}; expected a positive "
                f"integer or '*' for the rest"
            )
        if "+".join(labels) in seen:
            raise ConfigError(f"roles {spec!r}: role {name!r} is given twice; add up its counts")
        seen.add("+".join(labels))
        entries.append((labels, count))
    fixed = sum(count for _, count in entries if count is not None)
    has_rest = any(count is None for _, count in entries)
    if fixed > len(ids) or (fixed < len(ids) and not has_rest):
        raise ConfigError(
            f"roles {spec!r} name {fixed} nodes but the job has {len(ids)}; fix the counts"
            + ("" if has_rest else " or give one role the rest with '*' (collector:*)")
        )
    out: dict[int, list[str]] = {}
    position = 0
    for labels, count in entries:
        take = len(ids) - fixed if count is None else count
        for n in ids[position:position + take]:
            out[n] = sorted(set(labels))
        position += take
    return out


def resolve_hosts(hosts: Sequence[str], source: str = "", *, timeout_s: float = 10.0) -> dict[str, str]:
    """Resolve every host name to an address, all at once and within ``timeout_s``.

    Workers listen on and dial these names; a name that does not resolve would otherwise
    surface as nng's "Address invalid" or a minute of torch c10d retries.

    Args:
        hosts: host names or IP addresses (duplicates are resolved once).
        source: where the names came from (``SLURM_STEP_NODELIST``), for the message.
        timeout_s: the bound on the whole lookup (a broken DNS server can hang for minutes).

    Returns:
        host -> IP address text.

    Raises:
        ConfigError: a name that does not resolve, or did not within ``timeout_s``.
    """
    import socket
    import threading

    results: dict[str, str | BaseException] = {}
    unique = list(dict.fromkeys(hosts))
    todo = list(reversed(unique))

    def lookup() -> None:
        while todo:
            try:
                host = todo.pop()
            except IndexError:
                return
            try:
                results[host] = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
            except OSError as exc:
                results[host] = exc

    # Daemon threads, not an executor: a lookup stuck in the resolver must not hold up exit.
    threads = [threading.Thread(target=lookup, daemon=True) for _ in range(min(32, len(unique)))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    where = f" (from {source})" if source else ""
    fix = "add it to DNS or /etc/hosts on every host, or fix the name"
    for host in unique:
        got = results.get(host)
        if got is None:
            raise ConfigError(f"host name {host!r}{where} did not resolve within {timeout_s:g}s; {fix}")
        if isinstance(got, BaseException):
            reason = getattr(got, "strerror", None) or str(got)
            raise ConfigError(f"host name {host!r}{where} does not resolve ({reason}); {fix}")
    return {host: str(results[host]) for host in unique}


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
