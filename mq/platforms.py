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

Slurm (:func:`from_slurm`):

* ``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST``, else ``SLURM_NODELIST``: the hosts,
  in hostlist syntax (``gpu[01-02],cpu007``; see :func:`expand_hostlist`). The step list wins
  inside ``srun`` because the step may use only part of the allocation, and ``SLURM_NODEID``
  and ``SLURM_PROCID`` are relative to the step.
* One launcher per host (``workers_per_node`` given; e.g. ``sbatch`` script or
  ``srun --ntasks-per-node=1 mq run ...``): ``SLURM_NODEID`` (this host's index), else
  ``SLURMD_NODENAME`` looked up in the host list.
* One process per Slurm task (``workers_per_node=None``; ``srun mq run ...``):
  ``SLURM_PROCID`` (becomes the node id), ``SLURM_LOCALID`` (the port offset on its host) and
  the tasks per host from ``SLURM_STEP_TASKS_PER_NODE``, else ``SLURM_TASKS_PER_NODE``, else
  ``SLURM_NTASKS_PER_NODE`` (forms ``2``, ``2(x3)``, ``2(x2),1``). Slurm's default block
  distribution is assumed (a host's tasks have consecutive ranks); anything else is detected
  and reported. ``SLURM_NODEID`` is cross-checked when present.

Kubernetes, DI-engine style (:func:`from_k8s`):

* ``DI_NODES``: comma-separated pods, in rank order, each ``host`` or ``host:port``; hostlist
  brackets are expanded (``learner-[0-3].mq.default.svc:50515``). A pod's port, when given, is
  the base port of that pod's workers.
* ``DI_RANK``: this pod's index in ``DI_NODES`` (e.g. the StatefulSet ordinal). When it is
  missing, ``HOSTNAME`` (the pod name) is looked up among the hosts, matching either the whole
  host or its first DNS label.

Every missing or malformed variable is a :class:`~mq.errors.ConfigError` that names it and says
how to fix it (run inside the allocation, or use ``--platform local``).

Hosts are used as given: IPv6 literals are not supported in host lists.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mq.errors import ConfigError

__all__ = [
    "DEFAULT_BASE_PORT",
    "PLATFORMS",
    "TOPOLOGIES",
    "PlatformPlan",
    "attach_lists",
    "expand_hostlist",
    "from_k8s",
    "from_local",
    "from_slurm",
    "parse_tasks_per_node",
    "plan_for",
]

DEFAULT_BASE_PORT = 50515
TOPOLOGIES = ("mesh", "star", "alone")
PLATFORMS = ("local", "slurm", "k8s")

# A typo such as n[1-1000000000] must fail fast instead of allocating a billion strings;
# no real job has anywhere near this many hosts.
_MAX_HOSTS = 100_000
# Capping digits keeps int() away from Python's huge-integer guard (a bare ValueError).
_MAX_DIGITS = 18
_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")
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


def _split_top_level(text: str) -> list[str]:
    """Split ``text`` at commas outside brackets, checking that brackets balance and never nest."""
    parts: list[str] = []
    start = 0
    open_at = -1
    for i, ch in enumerate(text):
        if ch == "[":
            if open_at >= 0:
                raise ConfigError(
                    f"hostlist {text!r} is malformed: '[' at position {i} opens inside the "
                    f"bracket opened at position {open_at}; brackets cannot nest"
                )
            open_at = i
        elif ch == "]":
            if open_at < 0:
                raise ConfigError(
                    f"hostlist {text!r} is malformed: ']' at position {i} has no matching '['"
                )
            open_at = -1
        elif ch == "," and open_at < 0:
            parts.append(text[start:i])
            start = i + 1
    if open_at >= 0:
        raise ConfigError(
            f"hostlist {text!r} is malformed: '[' at position {open_at} is never closed"
        )
    parts.append(text[start:])
    return parts


def _expand_bracket(body: str, token: str, text: str) -> list[str]:
    """Expand the inside of one bracket group (``01-03,07``) into its numbers, as strings."""
    if not body.strip():
        raise ConfigError(f"hostlist {text!r} is malformed: {token!r} has an empty bracket '[]'")
    out: list[str] = []
    for item in body.split(","):
        match = _RANGE_RE.match(item)
        if match is None:
            raise ConfigError(
                f"hostlist {text!r} is malformed: {item!r} inside the brackets of {token!r} "
                f"is not a number or a range lo-hi (such as 01-03)"
            )
        lo_text, hi_text = match.group(1), match.group(2)
        if max(len(lo_text), len(hi_text or "")) > _MAX_DIGITS:
            raise ConfigError(
                f"hostlist {text!r} is malformed: {item!r} in {token!r} has more than "
                f"{_MAX_DIGITS} digits"
            )
        lo = int(lo_text)
        hi = lo if hi_text is None else int(hi_text)
        if hi < lo:
            raise ConfigError(
                f"hostlist {text!r} is malformed: range {item!r} in {token!r} is reversed "
                f"({hi_text} < {lo_text}); write it as {hi_text}-{lo_text}"
            )
        if hi - lo + 1 > _MAX_HOSTS:
            raise ConfigError(
                f"hostlist {text!r} is too large: range {item!r} in {token!r} names "
                f"{hi - lo + 1} hosts (at most {_MAX_HOSTS})"
            )
        # Slurm pads to the width of the low bound: n[008-011] -> n008..n011, n[8-11] -> n8..n11.
        width = len(lo_text)
        out.extend(f"{n:0{width}d}" for n in range(lo, hi + 1))
    return out


def _expand_token(token: str, text: str) -> list[str]:
    """Expand one host entry (no top-level commas), possibly with several bracket groups."""
    if any(ch.isspace() for ch in token):
        raise ConfigError(
            f"hostlist {text!r} is malformed: entry {token!r} contains whitespace; separate "
            f"hosts with commas"
        )
    # re.split with a capture group alternates literal, bracket body, literal, ...
    pieces = re.split(r"\[([^\]]*)\]", token)
    choices: list[list[str]] = []
    total = 1
    for i, piece in enumerate(pieces):
        if i % 2 == 0:
            choices.append([piece])
        else:
            numbers = _expand_bracket(piece, token, text)
            total *= len(numbers)
            if total > _MAX_HOSTS:
                raise ConfigError(
                    f"hostlist {text!r} is too large: entry {token!r} names more than "
                    f"{_MAX_HOSTS} hosts"
                )
            choices.append(numbers)
    # itertools.product varies the last group fastest, which is Slurm's order:
    # rack[1-2]-n[01-02] -> rack1-n01, rack1-n02, rack2-n01, rack2-n02.
    return ["".join(parts) for parts in itertools.product(*choices)]


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm hostlist expression into host names, in Slurm's order.

    Supports everything Slurm prints in ``SLURM_JOB_NODELIST``: comma-separated entries,
    bracket groups with numbers and ranges (``node[01-03,07]``), zero padding that keeps the
    low bound's width (``n[008-011]`` -> ``n008`` .. ``n011``), text after a bracket
    (``gpu-a[1-2]-ib``), and several bracket groups in one entry, expanded as a cartesian
    product with the last group varying fastest (``rack[1-2]-n[01-02]``). Duplicates are kept.

    Args:
        text: the hostlist, e.g. ``"node[01-03,07],gpu-a[1-2]-ib,login1"``.

    Returns:
        The host names.

    Raises:
        ConfigError: the text is empty, has an empty entry (stray comma), unbalanced or nested
            brackets, an empty bracket, a non-numeric or reversed range, whitespace inside an
            entry, or expands to more than 100000 hosts. The message quotes the text.
    """
    if not isinstance(text, str):
        raise ConfigError(f"hostlist must be a string, got {type(text).__name__}: {text!r}")
    if not text.strip():
        raise ConfigError(f"hostlist {text!r} is empty: expected hosts such as node[01-03],login1")
    hosts: list[str] = []
    for entry in _split_top_level(text.strip()):
        entry = entry.strip()
        if not entry:
            raise ConfigError(
                f"hostlist {text!r} is malformed: it has an empty entry (a leading, trailing "
                f"or doubled comma)"
            )
        hosts.extend(_expand_token(entry, text))
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
            "attach_to": list(self.attach_to[node_id]),
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
                f"({', '.join(hosts[:8])}{', ...' if len(hosts) > 8 else ''})"
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
            f"SLURMD_NODENAME={nodename!r} is not in the node list "
            f"({', '.join(hosts[:8])}{', ...' if len(hosts) > 8 else ''}); {_SLURM_FIX}"
        )
    return by_name


def from_slurm(
    environ: Mapping[str, str] | None = None,
    *,
    workers_per_node: int | None,
    base_port: int = DEFAULT_BASE_PORT,
    topology: str = "mesh",
    rendezvous_port: int | None = None,
) -> PlatformPlan:
    """Plan from a Slurm allocation (``--platform slurm``).

    Two launch modes:

    * ``workers_per_node`` given: one launcher per host runs ``workers_per_node`` workers.
      Host ``h`` runs ids ``h * workers_per_node .. (h + 1) * workers_per_node - 1``.
    * ``workers_per_node=None``: ``srun`` started one process per task, and each runs one
      worker whose node id is ``SLURM_PROCID``; hosts may carry different task counts.

    Worker ``i`` of a host listens on ``base_port + i`` (``SLURM_LOCALID`` in srun mode).

    Args:
        environ: the environment to read; ``os.environ`` when None.
        workers_per_node: workers per host, or None for one worker per srun task.
        base_port: port of each host's first worker.
        topology: ``"mesh"``, ``"star"`` or ``"alone"``.
        rendezvous_port: torch RPC rendezvous port on the first host; default ``base_port - 1``.

    Returns:
        The plan.

    Raises:
        ConfigError: missing variables (all of them are listed), malformed values, a task
            layout that is not Slurm's block distribution, or a second launcher on one host.
    """
    env = os.environ if environ is None else environ
    _check_port(base_port, "base port")
    if workers_per_node is not None:
        _check_workers(workers_per_node, "workers_per_node")

    missing: list[str] = []
    list_var = _first_present(env, _SLURM_NODELIST_VARS)
    if list_var is None:
        missing.append("SLURM_JOB_NODELIST (or SLURM_NODELIST)")
    tasks_var = None
    if workers_per_node is None:
        missing.extend(v for v in ("SLURM_PROCID", "SLURM_LOCALID") if not env.get(v, "").strip())
        tasks_var = _first_present(env, _SLURM_TASKS_VARS)
        if tasks_var is None:
            missing.append("SLURM_TASKS_PER_NODE (or SLURM_NTASKS_PER_NODE)")
    elif not (env.get("SLURM_NODEID", "").strip() or env.get("SLURMD_NODENAME", "").strip()):
        missing.append("SLURM_NODEID (or SLURMD_NODENAME)")
    if missing:
        raise _missing_error("slurm", missing, _SLURM_FIX)
    assert list_var is not None

    try:
        hosts = expand_hostlist(env[list_var])
    except ConfigError as exc:
        raise ConfigError(f"{list_var}: {exc}") from None

    if workers_per_node is not None:
        host_index = _slurm_host_index(env, hosts)
        assert host_index is not None  # one of the two variables is set (checked above)
        if env.get("SLURM_LOCALID", "").strip() and _env_int(env, "SLURM_LOCALID", _SLURM_FIX) != 0:
            # A second launcher on the same host would claim the same node ids and ports.
            raise ConfigError(
                f"SLURM_LOCALID={env['SLURM_LOCALID'].strip()}: several launchers run on "
                f"{hosts[host_index]}, but with --parallel-workers/workers_per_node each host "
                f"needs exactly one; use srun --ntasks-per-node=1, or drop workers_per_node to "
                f"run one worker per srun task"
            )
        counts = [workers_per_node] * len(hosts)
        first = host_index * workers_per_node
        node_ids = list(range(first, first + workers_per_node))
    else:
        assert tasks_var is not None
        counts = parse_tasks_per_node(env[tasks_var], len(hosts), name=tasks_var)
        procid = _env_int(env, "SLURM_PROCID", _SLURM_FIX)
        localid = _env_int(env, "SLURM_LOCALID", _SLURM_FIX)
        world = sum(counts)
        if procid >= world:
            raise ConfigError(
                f"SLURM_PROCID={procid} is outside the {world} tasks that {tasks_var}="
                f"{env[tasks_var]!r} gives; the variables come from different steps"
            )
        offset = 0
        host_index = 0
        for host_index, count in enumerate(counts):
            if procid < offset + count:
                break
            offset += count
        # Node ids assume block distribution (a host's ranks are consecutive). Cyclic or
        # arbitrary distributions break that, and would silently give two workers one port.
        if localid != procid - offset:
            raise ConfigError(
                f"SLURM_PROCID={procid} with SLURM_LOCALID={localid} does not match block "
                f"distribution over {tasks_var}={env[tasks_var]!r} (expected local id "
                f"{procid - offset} on {hosts[host_index]}); launch with srun "
                f"--distribution=block"
            )
        if env.get("SLURM_NODEID", "").strip():
            nodeid = _env_int(env, "SLURM_NODEID", _SLURM_FIX)
            if nodeid != host_index:
                raise ConfigError(
                    f"SLURM_NODEID={nodeid} but SLURM_PROCID={procid} belongs to host "
                    f"{host_index} ({hosts[host_index]}) under block distribution; launch with "
                    f"srun --distribution=block"
                )
        node_ids = [procid]

    return _build_plan(
        platform="slurm",
        hosts=hosts,
        counts=counts,
        host_ports=[base_port] * len(hosts),
        host_index=host_index,
        node_ids=node_ids,
        topology=topology,
        rendezvous_port=rendezvous_port,
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
    """Plan from DI-engine style Kubernetes variables (``--platform k8s``).

    Pod ``r`` (its index in ``DI_NODES``) runs ids ``r * w .. (r + 1) * w - 1`` where ``w`` is
    ``workers_per_node`` (one when None). A pod's workers listen on consecutive ports from the
    port given in its ``DI_NODES`` entry, or from ``base_port``.

    Args:
        environ: the environment to read; ``os.environ`` when None.
        workers_per_node: workers per pod; None means one.
        base_port: first port of pods whose entry has no port.
        topology: ``"mesh"``, ``"star"`` or ``"alone"``.
        rendezvous_port: torch RPC rendezvous port on the first pod; default its first
            worker's port minus one.

    Returns:
        The plan.

    Raises:
        ConfigError: missing or malformed DI_NODES / DI_RANK, a rank outside the list, or
            two workers on one address.
    """
    env = os.environ if environ is None else environ
    _check_port(base_port, "base port")
    workers = (
        1 if workers_per_node is None else _check_workers(workers_per_node, "workers_per_node")
    )

    missing: list[str] = []
    if not env.get("DI_NODES", "").strip():
        missing.append("DI_NODES")
    if not env.get("DI_RANK", "").strip() and not env.get("HOSTNAME", "").strip():
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

    if env.get("DI_RANK", "").strip():
        rank = _env_int(env, "DI_RANK", _K8S_FIX)
        if rank >= len(hosts):
            raise ConfigError(
                f"DI_RANK={rank} is outside DI_NODES, which lists {len(hosts)} pods "
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
    )


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
