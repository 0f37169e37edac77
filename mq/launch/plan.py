"""Planning a job (:func:`make_plan`): which workers this machine starts, with which options.

It checks a :class:`LaunchRequest` and asks the backend's launch profile (``Backend.launch``,
:class:`mq.backend.LaunchProfile`) for each worker's options, locally or from a platform's plan
(:mod:`mq.platforms`). The result, a :class:`Plan`, is what :mod:`mq.launch.run` starts; nothing
here starts a process.
"""

from __future__ import annotations

import errno
import importlib
import os
import signal
import socket
import sys
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Iterable, Mapping

from mq import platforms
from mq.backend import Backend, LaunchProfile, LocalJob
from mq.errors import ConfigError, MQError
from mq.registry import DEFAULT_MQ_TYPE, backend_for, backends, check_mq_type, profile_for
from mq.rendezvous import TOPOLOGIES, parse_init_method
from mq.platforms.plan import free_port

#: Seconds a stopping worker gets before SIGKILL: stop() takes up to 5 s by default, and a
#: failed worker first spends up to ABORT_S telling its peers.
GRACE_S = 10.0
#: Seconds a worker's queue gets to stop (say goodbye) when its main has ended.
STOP_S = 5.0
#: Seconds a failed worker spends telling its peers to stop.
ABORT_S = 3.0
#: Seconds a worker's queue gets to stop when the job is aborted: its peers are leaving too,
#: so a farewell they can no longer answer must not hold the worker up for STOP_S.
ABORTED_STOP_S = 2.0
#: The reserved topic a failed worker sends to every peer; payload {node, host, error}.
ABORT_TOPIC = "_mq.abort"
#: Exit code of a worker stopped because another node of the job failed.
EXIT_ABORTED = 3
#: Exit codes of workers stopped by Ctrl-C and by SIGTERM.
EXIT_INT, EXIT_TERM = 130, 143


class LaunchError(MQError):
    """The job failed or was stopped.

    Attributes:
        failures: node id -> exit code, for this host's workers that failed by themselves.
        aborted_by: ``{"node", "host", "error"}`` of the node (usually on another host) whose
            failure stopped this host's workers, or None.
        exit_code: what ``mq run`` exits with: 1, or 128 + the signal (130, 143) that stopped
            the job.
    """

    def __init__(self, failures: dict[int, int], *, aborted_by: Mapping[str, Any] | None = None,
                 reason: str | None = None, exit_code: int = 1):
        self.failures = failures
        self.aborted_by = dict(aborted_by) if aborted_by else None
        self.exit_code = exit_code
        if reason is None and failures:
            detail = ", ".join(f"node {n} exited with {describe_exit(c)}" for n, c in sorted(failures.items()))
            reason = f"worker failed: {detail} (its traceback is printed above)"
        elif reason is None and self.aborted_by:
            reason = f"job aborted: {describe_abort(self.aborted_by)}; this host's workers were stopped"
        super().__init__(reason or "the job failed")


def describe_abort(info: Mapping[str, Any]) -> str:
    """``node 1 on n1 failed (RuntimeError: ...)`` for an abort payload."""
    host = f" on {info['host']}" if info.get("host") else ""
    return f"node {info.get('node', '?')}{host} failed ({info.get('error', 'unknown error')})"


@dataclass
class Context:
    """What ``main(ctx)`` gets: who it is and its open message queue."""

    node_id: int
    labels: frozenset[str]
    mq: Any
    mq_type: str
    world_size: int
    node_ids: list[int]
    args: dict[str, Any] = field(default_factory=dict)

    def peers(self, label: str | None = None) -> list[int]:
        return self.mq.peers(label)


@dataclass
class Plan:
    """Everything needed to start the workers of this machine (picklable for spawn)."""

    main: str
    mq_type: str
    node_ids: list[int]
    labels: dict[int, list[str]]
    options: dict[int, dict[str, Any]]
    world_size: int
    args: dict[str, Any]
    log_level: str = "WARNING"
    startup_interval: float = 0.0
    package: str | None = None
    topology: str = "mesh"
    #: node id -> host it runs on, for messages naming a failed node (platform plans).
    hosts: dict[int, str] = field(default_factory=dict)
    #: Whether a worker passes a job abort on to its peers (they may not reach the failed node).
    relay_abort: bool = False
    #: Whether each line a worker prints starts with ``[node N] `` (whole lines, never mixed).
    prefix_output: bool = True


# ---------------------------------------------------------------------- resolving main
def main_ref(main: Callable[..., Any] | str) -> str:
    """A ``module:func`` reference for a function or a ``module:func`` / ``module.func`` string."""
    if callable(main):
        module, name = main.__module__, main.__qualname__
        if module == "__main__" or "<" in name:
            raise ConfigError(f"main {name!r} must be a module-level function importable by the "
                              "workers (spawn start method): move it into a module, or pass 'module:func'")
        return f"{module}:{name}"
    if not isinstance(main, str) or not main.strip():
        raise ConfigError(f"main must be a function or 'module:func', got {main!r}")
    main = main.strip()
    if ":" in main:
        return main
    module, dot, name = main.rpartition(".")
    if not dot or not module or not name:
        raise ConfigError(f"--main {main!r} must look like module:func or module.func")
    return f"{module}:{name}"


def resolve_main(ref: str, package: str | None = None) -> Callable[[Context], Any]:
    """Import ``module:func``; ConfigError with the reason if it cannot be found."""
    _add_package(package)
    module_name, _, attr = ref.partition(":")
    candidates = [module_name]
    if package and not os.path.isdir(package):
        candidates.insert(0, f"{package}.{module_name}")
    errors = []
    for name in candidates:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and not name.startswith(exc.name) and not (package and exc.name.startswith(package)):
                raise ConfigError(f"--main {ref!r}: importing {name} failed: {exc}") from exc
            errors.append(str(exc))
            continue
        fn: Any = module
        for part in attr.split("."):
            fn = getattr(fn, part, None)
        if not callable(fn):
            raise ConfigError(f"--main {ref!r}: module {name} has no function {attr!r}")
        return fn
    raise ConfigError(f"--main {ref!r}: cannot import module {module_name!r} ({'; '.join(errors)}); "
                      "check the name or add its directory with --package")


def _add_package(package: str | None) -> None:
    if package and os.path.isdir(package):
        path = os.path.abspath(package)
        if path not in sys.path:
            sys.path.insert(0, path)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())


# ---------------------------------------------------------------------- planning
def parse_labels(labels: Any, node_ids: list[int]) -> dict[int, list[str]]:
    """Labels for each node: a str ("learner" or "a,b") or a set for all nodes; a list with one
    entry per node; a dict {node_id: labels}; or a callable node_id -> labels."""

    def norm(value: Any) -> list[str]:
        if value is None:
            return []
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        return sorted(str(v) for v in value)

    if callable(labels):
        return {n: norm(labels(n)) for n in node_ids}
    if isinstance(labels, Mapping):
        return {n: norm(labels.get(n)) for n in node_ids}
    if isinstance(labels, (list, tuple)) and labels and not all(isinstance(v, str) for v in labels):
        if len(labels) != len(node_ids):
            raise ConfigError(f"labels has {len(labels)} entries for {len(node_ids)} workers: give one per worker")
        return {n: norm(v) for n, v in zip(node_ids, labels)}
    if isinstance(labels, list) and len(labels) == len(node_ids) > 1:
        return {n: norm(v) for n, v in zip(node_ids, labels)}
    return {n: norm(labels) for n in node_ids}


@dataclass(frozen=True)
class LaunchRequest:
    """What a job asks the launcher for: the ``mq run`` flags, and :func:`launch`'s options.

    ``n_workers`` None means one worker locally and, under ``platform="slurm"``, one worker
    per Slurm task (``srun -n 4``); a number under Slurm runs that many workers per host (one
    launcher per host). ``roles`` (``"learner:1,collector:*"``) deals labels in node-id order
    over the whole job. ``check_network`` resolves every host name and checks this host's
    ports before anything starts (off for planning on another machine). ``backend_options``:
    the backend's own launch flags (``Backend.flags``: nng's ``protocol``, torchrpc's
    ``cuda_device_map``, both ``busy_poll``), checked by it; None leaves the transport's
    default. ``mq_options`` go to every worker's ``mq.create`` as given; ``args`` reach ``main``
    as ``ctx.args``.
    """

    main: Callable[..., Any] | str
    n_workers: int | None = None
    mq_type: str = DEFAULT_MQ_TYPE
    topology: str = "mesh"
    labels: Any = None
    roles: str | None = None
    node_ids: Iterable[int] | None = None
    world_size: int | None = None
    address: str | None = None
    ports: Iterable[int] | None = None
    attach_to: Iterable[str] = ()
    init_method: str | None = None
    backend_options: Mapping[str, Any] | None = None
    platform: str = "local"
    startup_interval: float = 0.0
    log_level: str = "WARNING"
    package: str | None = None
    mq_options: Mapping[str, Any] | None = None
    args: Mapping[str, Any] | None = None
    environ: Mapping[str, str] | None = None
    check_network: bool = True
    prefix_output: bool = True

    def check(self) -> None:
        """ConfigError for an option that is wrong whatever the platform and backend."""
        n = self.n_workers
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ConfigError(f"the number of workers must be >= 1, got {n!r}")
        if self.topology not in TOPOLOGIES:
            raise ConfigError(f"topology must be one of {', '.join(TOPOLOGIES)}, got {self.topology!r}")
        if self.startup_interval < 0:
            raise ConfigError(f"startup interval must be >= 0 seconds, got {self.startup_interval}")
        if self.platform not in platforms.PLATFORMS:
            raise ConfigError(f"platform must be {', '.join(platforms.PLATFORMS[:-1])} or "
                              f"{platforms.PLATFORMS[-1]}, got {self.platform!r}")
        if self.init_method:
            parse_init_method(self.init_method, self.environ)


@dataclass
class _Layout:
    """Where this machine's workers are: their ids, the job's size, their connection options
    and hosts (platform plans)."""

    node_ids: list[int]
    world_size: int
    options: dict[int, dict[str, Any]]
    hosts: dict[int, str] = field(default_factory=dict)


def make_plan(main: Callable[..., Any] | str, **options: Any) -> Plan:
    """Validate every option and decide each worker's node id, labels and queue options.

    ``options`` are the fields of :class:`LaunchRequest` (the ``mq run`` flags), and the
    backend's own flags by name (``protocol="tcp"``), which go into ``backend_options``.

    Raises:
        ConfigError: a bad option, an option the platform derives itself, a host name that
            does not resolve, or a port already in use. The message says which and the fix.
    """
    named = {f.name for f in fields(LaunchRequest)}
    flags = {k: options.pop(k) for k in list(options) if k not in named}
    req = LaunchRequest(main, **options)
    mq_type = check_mq_type(req.mq_type)
    req.check()
    backend = backend_for(mq_type)
    profile = profile_for(mq_type)
    given = checked_flags(backend, mq_type, {**(req.backend_options or {}), **flags})
    ref = main_ref(req.main)
    resolve_main(ref, req.package)  # fail in the launcher, with one line, not in every worker
    if req.platform == "local":
        layout = _plan_local(req, profile)
    else:
        layout = _plan_platform(req, profile)
    _add_worker_options(req, given, layout)
    ids = layout.node_ids
    profile.check_worker_options(mq_type, ids[0], layout.options[ids[0]])
    node_labels = parse_labels(req.labels, ids)
    if req.roles is not None:
        by_role = platforms.assign_roles(req.roles, range(layout.world_size))
        node_labels = {n: sorted(set(node_labels[n]) | set(by_role[n])) for n in ids}
    return Plan(main=ref, mq_type=mq_type, node_ids=ids, labels=node_labels, options=layout.options,
                world_size=layout.world_size, args=dict(req.args or {}), log_level=req.log_level,
                startup_interval=req.startup_interval, package=req.package, topology=req.topology,
                hosts=layout.hosts, relay_abort=profile.relays_abort(req.topology),
                prefix_output=bool(req.prefix_output))


def checked_flags(backend: Backend, mq_type: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` backend flags (None: not given), each checked by ``backend``.

    Raises:
        ConfigError: a flag another backend takes, or that none does, or a bad value.
    """
    ours = {f.option: f for f in backend.flags}
    out = {}
    for name, value in given.items():
        if value is None:
            continue
        flag = ours.get(name)
        if flag is None:
            others = sorted(b.name for b in backends().values() if any(f.option == name for f in b.flags))
            if others:
                raise ConfigError(f"{name} (--{name.replace('_', '-')}) is an option of {' and '.join(others)}, "
                                  f"not of mq type {mq_type!r}: drop it or choose another mq type")
            known = sorted({f.name for f in fields(LaunchRequest)} - {"main"} | set(ours))
            raise ConfigError(f"unexpected launch option {name!r}; options are {', '.join(known)}")
        out[name] = flag.check(value) if flag.check else value
    return out


def _add_worker_options(req: LaunchRequest, flags: dict[str, Any], layout: _Layout) -> None:
    """The options every worker takes on top of its addresses, then the user's own."""
    for n in layout.node_ids:
        layout.options[n].update(flags)
        layout.options[n].update(req.mq_options or {})


def _plan_local(req: LaunchRequest, profile: LaunchProfile) -> _Layout:
    """``--platform local``: node ids, ports and addresses from the options."""
    workers = 1 if req.n_workers is None else req.n_workers
    ids = list(req.node_ids) if req.node_ids is not None else []
    if len(ids) == 1 and workers > 1:
        ids = list(range(ids[0], ids[0] + workers))  # a start id
    ids = ids or list(range(workers))
    if len(ids) != workers or len(set(ids)) != len(ids) or min(ids) < 0:
        raise ConfigError(f"node ids {ids} must be {workers} distinct non-negative ints (one per worker)")
    world = req.world_size if req.world_size is not None else max(ids) + 1
    if world < max(ids) + 1:
        raise ConfigError(f"world size {world} is too small for node ids {ids}")
    address = req.address or "127.0.0.1"
    port_list = list(req.ports) if req.ports else []
    if port_list and len(port_list) == 1 and workers > 1:
        port_list = [port_list[0] + i for i in range(workers)]
    if port_list and len(port_list) != workers:
        raise ConfigError(f"--ports gives {len(port_list)} ports for {workers} workers: give one, "
                          "or a base port")
    twice = sorted({p for p in port_list if port_list.count(p) > 1})
    if twice:
        raise ConfigError(f"--ports gives port(s) {twice} to more than one worker: each worker listens on its "
                          f"own port (give {workers} different ports, or one base port)")
    if req.check_network:
        ip = platforms.resolve_hosts([address], "--address")[address]
        _check_ports_free([(address, ip, p, f"node {n}") for n, p in zip(ids, port_list)])
    job = LocalJob(node_ids=ids, world_size=world, topology=req.topology, address=address,
                   ports=port_list, attach_to=list(req.attach_to), init_method=req.init_method,
                   pick_port=free_port)
    return _Layout(ids, world, profile.local_options(job))


def _plan_platform(req: LaunchRequest, profile: LaunchProfile) -> _Layout:
    """``--platform slurm|k8s``: everything from the scheduler's environment."""
    port_list = list(req.ports) if req.ports else []
    _reject_derived(req.platform, node_ids=req.node_ids, address=req.address,
                    attach_to=list(req.attach_to), ports=port_list, labels=req.labels)
    pplan = platforms.plan_for(req.platform, environ=req.environ, workers_per_node=req.n_workers,
                               topology=req.topology,
                               base_port=port_list[0] if port_list else platforms.DEFAULT_BASE_PORT)
    world = pplan.world_size
    if req.world_size is not None and req.world_size != world:
        raise ConfigError(f"--world-size {req.world_size} conflicts with --platform {req.platform}, whose "
                          f"job has {world} nodes; drop --world-size")
    profile.check_platform(pplan, req.init_method)
    if req.check_network:
        pplan = _check_platform_network(pplan, profile, req.init_method)
    return _Layout(list(pplan.node_ids), world, profile.platform_options(pplan, req.init_method),
                   hosts=dict(pplan.addresses))


def _reject_derived(platform: str, *, node_ids: Any, address: str | None,
                    attach_to: list[str], ports: list[int], labels: Any) -> None:
    """Options a platform derives from the scheduler cannot also be given: say which."""
    where = "SLURM_PROCID / the host's place in the node list" if platform == "slurm" else "the pod's rank"
    given = [(node_ids is not None, "--node-ids", f"node ids come from {where}"),
             (address is not None, "--address", "each host's address is its name in the job's host list"),
             (bool(attach_to), "--attach-to", "every worker already dials the job's other workers"),
             (len(ports) > 1, "--ports with several ports", "give one base port (--ports 50515)")]
    for is_given, option, why in given:
        if is_given:
            raise ConfigError(f"{option} conflicts with --platform {platform}: {why}; drop it")
    if isinstance(labels, (list, tuple)) and len(labels) > 1:
        raise ConfigError(f"per-worker --labels conflict with --platform {platform}: they would repeat "
                          "on every host; give roles by rank with --roles learner:1,collector:*")


def _check_platform_network(pplan: platforms.PlatformPlan, profile: LaunchProfile,
                            init_method: str | None) -> platforms.PlatformPlan:
    """Resolve the plan's host names and check this host's ports, before any worker starts."""
    hosts = list(pplan.hosts)
    rendezvous = parse_init_method(init_method or pplan.init_method)
    if rendezvous.scheme == "tcp":
        hosts.append(rendezvous.host)
    ips = platforms.resolve_hosts(hosts, pplan.source)
    here = pplan.addresses[pplan.node_ids[0]]
    if pplan.discovery == "rendezvous" and ips[here] != here:
        # Peers learn this address from the store: give them the IP, not a pod-local name.
        listen = {n: f"tcp://{ips[here]}:{pplan.ports[n]}" for n in pplan.node_ids}
        pplan = replace(pplan, listen_to={**pplan.listen_to, **listen})
    binds = []
    if profile.binds_plan_ports():
        binds = [(here, ips[here], pplan.ports[n], f"node {n}") for n in pplan.node_ids]
    if rendezvous.scheme == "tcp" and 0 in pplan.node_ids:  # node 0 hosts the store
        binds.append((rendezvous.host, ips[rendezvous.host], rendezvous.port, "the rendezvous store"))
    _check_ports_free(binds)
    return pplan


def _check_ports_free(binds: list[tuple[str, str, int, str]]) -> None:
    """Fail fast, naming host and port, when a port is taken or the host is not this machine."""
    for host, ip, port, who in binds:
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not a clash
            try:
                s.bind((ip, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise ConfigError(f"port {port} on {host} ({who}) is already in use, perhaps by "
                                      "another job on this host: pick another base port with --ports") from None
                if exc.errno == errno.EADDRNOTAVAIL:
                    raise ConfigError(f"{host} resolves to {ip}, which is not an address of this "
                                      f"machine, so {who} cannot listen there: fix the name's "
                                      "DNS or /etc/hosts entry") from None
                raise ConfigError(f"cannot listen on {host}:{port} ({who}): {exc.strerror}") from None


def describe_exit(code: int) -> str:
    """``signal SIGKILL`` or ``code 1``, for a worker's exit code (negative: the signal that ended it)."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"
