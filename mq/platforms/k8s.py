"""``--platform k8s``: node ids and addresses from a pod's environment (DI-engine lists, or
torchrun / Kubeflow PyTorchJob variables)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from mq.errors import ConfigError
from mq.platforms.hostlist import expand_hostlist
from mq.platforms.plan import (
    DEFAULT_BASE_PORT, PlatformPlan, build_plan, check_port, check_topology, check_workers, env_int,
    first_present, missing_error,
)

_K8S_FIX = (
    "set them in the pod spec (DI_NODES lists every pod as host or host:port in rank order; "
    "DI_RANK is this pod's index, e.g. the StatefulSet ordinal) or use --platform local"
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
    return host, check_port(int(port_text), f"DI_NODES entry {entry!r}: port")


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
    check_port(base_port, "base port")
    workers = (
        1 if workers_per_node is None else check_workers(workers_per_node, "workers_per_node")
    )
    if not env.get("DI_NODES", "").strip() and env.get("MASTER_ADDR", "").strip():
        return _k8s_torchrun(env, workers, base_port, topology)

    return _k8s_di_nodes(env, workers, base_port, topology, rendezvous_port)


def _k8s_di_nodes(env: Mapping[str, str], workers: int, base_port: int, topology: str,
                  rendezvous_port: int | None) -> PlatformPlan:
    """DI-engine variables: every pod listed in DI_NODES, this pod's rank found in the list."""
    missing: list[str] = []
    if not env.get("DI_NODES", "").strip():
        missing.append("DI_NODES (or MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK)")
    if not any(env.get(v, "").strip() for v in ("DI_RANK", "JOB_COMPLETION_INDEX", "HOSTNAME")):
        missing.append("DI_RANK")
    if missing:
        raise missing_error("k8s", missing, _K8S_FIX)

    text = env["DI_NODES"]
    try:
        entries = expand_hostlist(text)
    except ConfigError as exc:
        raise ConfigError(f"DI_NODES: {exc}") from None
    pairs = [_split_host_port(entry, text, base_port) for entry in entries]
    hosts = [host for host, _ in pairs]
    rank = _di_rank(env, hosts, text)
    first = rank * workers
    return build_plan(
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


def _di_rank(env: Mapping[str, str], hosts: list[str], text: str) -> int:
    """This pod's index in DI_NODES: DI_RANK, else JOB_COMPLETION_INDEX, else its HOSTNAME."""
    rank_var = first_present(env, ("DI_RANK", "JOB_COMPLETION_INDEX"))
    if rank_var is not None:
        rank = env_int(env, rank_var, _K8S_FIX)
        if rank >= len(hosts):
            raise ConfigError(
                f"{rank_var}={rank} is outside DI_NODES, which lists {len(hosts)} pods "
                f"(ranks 0..{len(hosts) - 1})"
            )
        return rank
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
    return matches[0]


_TORCHRUN_FIX = (
    "set MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK as a Kubeflow PyTorchJob does (an "
    "Indexed Job may give JOB_COMPLETION_INDEX instead of RANK), or list the pods in DI_NODES"
)


def _k8s_torchrun(
    env: Mapping[str, str], workers: int, base_port: int, topology: str
) -> PlatformPlan:
    """torchrun-style variables: ranks and a rendezvous address, but no list of pods."""
    rank_var = first_present(env, ("RANK", "JOB_COMPLETION_INDEX"))
    missing = [v for v in ("MASTER_PORT", "WORLD_SIZE") if not env.get(v, "").strip()]
    if rank_var is None:
        missing.append("RANK (or JOB_COMPLETION_INDEX)")
    if missing:
        raise missing_error("k8s", missing, _TORCHRUN_FIX)
    assert rank_var is not None
    master = env["MASTER_ADDR"].strip()
    if any(ch.isspace() for ch in master) or not master:
        raise ConfigError(f"MASTER_ADDR={env['MASTER_ADDR']!r} is not a host name or address")
    master_port = check_port(env_int(env, "MASTER_PORT", _TORCHRUN_FIX), "MASTER_PORT")
    pods = env_int(env, "WORLD_SIZE", _TORCHRUN_FIX)
    rank = env_int(env, rank_var, _TORCHRUN_FIX)
    if pods < 1 or rank >= pods:
        raise ConfigError(
            f"{rank_var}={rank} is outside WORLD_SIZE={pods} (ranks 0..{pods - 1}); the "
            f"variables come from different jobs"
        )
    local_rank = env_int(env, "LOCAL_RANK", _TORCHRUN_FIX) if env.get("LOCAL_RANK", "").strip() else 0
    if workers > 1 and local_rank:
        raise ConfigError(
            f"LOCAL_RANK={local_rank}: several processes per pod (torchrun --nproc-per-node) "
            f"but -n/--parallel-workers {workers} runs one launcher per pod; drop -n"
        )
    # Peers reach this pod by its IP (POD_IP from the downward API) or its host name, which
    # Kubernetes maps to the pod IP; the launcher turns a name into an address before use.
    here = (env.get("POD_IP") or env.get("HOSTNAME") or "").strip()
    if not here:
        raise missing_error("k8s", ["POD_IP (or HOSTNAME)"], _TORCHRUN_FIX)
    check_topology(topology)
    first = rank * workers
    node_ids = list(range(first, first + workers))
    ports = {n: check_port(base_port + local_rank + i, "worker port") for i, n in enumerate(node_ids)}
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
