"""The plan every platform returns (:class:`PlatformPlan`), its layout of workers on hosts
(:func:`build_plan`), and the checks and environment readers the platforms share."""

from __future__ import annotations

import random
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mq.errors import ConfigError
from mq.platforms.hostlist import MAX_DIGITS
from mq.rendezvous import TOPOLOGIES, attach_targets

DEFAULT_BASE_PORT = 50515
PLATFORMS = ("local", "slurm", "k8s")



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
    check_topology(topology)
    ids = sorted(listen_to)
    return {n: [listen_to[p] for p in attach_targets(n, ids, topology)] for n in ids}


def check_topology(topology: str) -> None:
    """The topology vocabulary is :data:`mq.rendezvous.TOPOLOGIES`, the module that applies it."""
    if topology not in TOPOLOGIES:
        raise ConfigError(
            f"unknown topology {topology!r}: expected one of {', '.join(TOPOLOGIES)}"
        )


def check_workers(workers: object, name: str) -> int:
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ConfigError(f"{name} must be a positive integer, got {workers!r}")
    return workers


def check_port(port: object, what: str) -> int:
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ConfigError(f"{what} {port!r} is not a TCP port (1..65535)")
    return port


def build_plan(
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
    check_topology(topology)
    addresses: dict[int, str] = {}
    ports: dict[int, int] = {}
    node_id = 0
    for host, count, base in zip(hosts, counts, host_ports):
        for local in range(count):
            addresses[node_id] = host
            ports[node_id] = check_port(
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
    check_port(rendezvous_port, "rendezvous port")
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


def env_int(environ: Mapping[str, str], name: str, fix: str) -> int:
    value = environ[name].strip()
    if not (value.isascii() and value.isdigit()) or len(value) > MAX_DIGITS:
        raise ConfigError(f"{name}={environ[name]!r} is not a non-negative integer; {fix}")
    return int(value)


def first_present(environ: Mapping[str, str], names: Sequence[str]) -> str | None:
    for name in names:
        if environ.get(name, "").strip():
            return name
    return None


def missing_error(platform: str, missing: list[str], fix: str) -> ConfigError:
    return ConfigError(
        f"--platform {platform} needs environment variables that are not set: "
        f"{', '.join(missing)}; {fix}"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, below the kernel's ephemeral range where there is room.
    A port the kernel hands out for port 0 (a worker's own link listener, an outgoing
    connection) could be taken by another worker of the job before the one it was picked for
    binds it; ports below the range are never handed out that way."""
    low = _ephemeral_low()
    if low > _LOWEST_PICKED + 1024:
        for _ in range(64):
            port = random.randrange(_LOWEST_PICKED, low)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_LOWEST_PICKED = 10000  # below: well-known and registered services


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (0 when unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
