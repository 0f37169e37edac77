"""Launch a job's workers on this machine: one spawned process per node, each calling
``main(ctx)`` with its open message queue.

Guarantees:

* A worker that raises prints its traceback, tells every peer of the job to stop (the
  reserved topic ``_mq.abort``, sent with the public ``MQ.send``), stops its queue within a
  bound and exits at once, even if a handler thread is stuck. Workers that get ``_mq.abort``
  stop their main and exit with :data:`EXIT_ABORTED`, so a failure on one host ends the job
  on every host within seconds, with no scheduler option such as ``--kill-on-bad-exit``.
* The launcher then stops its other workers (SIGTERM, SIGKILL after :data:`GRACE_S`, which
  is longer than ``stop()``'s default 5 s) and fails with a line naming the failed node.
* SIGTERM (scancel, kubelet) and Ctrl-C are graceful stops: every worker says goodbye
  through ``stop()``; the launcher removes the unix socket file of any worker that could not
  (SIGKILL), so nothing is left in the temp directory. A worker that ended by SIGINT or
  SIGTERM (exit 130 or 143) stops the job the same way, with the same exit code, whether or
  not the launcher has seen the signal yet: Ctrl-C and scancel reach every process at once.
* Workers die with the launcher (PR_SET_PDEATHSIG), so none is left behind as an orphan.

Planning (:func:`make_plan`) checks a :class:`LaunchRequest` and asks the backend's launch
profile (``Backend.launch``, :class:`mq.backend.LaunchProfile`) for each worker's options, locally or from a platform's
plan (:mod:`mq.platforms`); running (:func:`run_plan`) spawns and supervises the workers with
:mod:`mq.supervise`.
"""

from __future__ import annotations

import atexit
import errno
import importlib
import json
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Iterable, Mapping

from mq.node import waits
from mq import platforms
from mq.backend import Backend, LaunchProfile, LocalJob
from mq.errors import ConfigError, MQError, Timeout
from mq.registry import DEFAULT_MQ_TYPE, backend_for, backends, check_mq_type, create, profile_for
from mq.rendezvous import TOPOLOGIES, parse_init_method
from mq.platforms.plan import free_port  # its home was here: mq.launch.free_port stays
from mq.supervise import die_with_parent, stop_processes, stop_signals_raise

log = logging.getLogger("mq.launch")

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
            detail = ", ".join(f"node {n} exited with {_describe_exit(c)}" for n, c in sorted(failures.items()))
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
                hosts=layout.hosts, relay_abort=profile.relays_abort(req.topology))


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


# ---------------------------------------------------------------------- running
def launch(main: Callable[[Context], Any] | str, n_workers: int | None = None, mq_type: str = DEFAULT_MQ_TYPE,
           topology: str = "mesh", labels: Any = None, **options: Any) -> None:
    """Run ``main(ctx)`` in spawned worker processes, each with an open queue.

    ``n_workers`` workers locally (default one); under ``platform="slurm"`` the default is one
    worker per Slurm task and a number means that many per host. Options are the fields of
    :class:`LaunchRequest` (the ``mq run`` flags), e.g. ``roles="learner:1,collector:*"``. Returns
    when every worker returned.

    Raises:
        ConfigError: a bad option (nothing was started).
        LaunchError: a worker failed (here or, through ``_mq.abort``, on another host) or the
            launcher got SIGTERM; the workers were stopped.
    """
    run_plan(make_plan(main, n_workers=n_workers, mq_type=mq_type, topology=topology,
                       labels=labels, **options))


#: A worker's exit status -> the stop signal it says the worker ended by: the code its own
#: handler exits with, or the signal itself when it came before the handler was installed.
_STOPPED_BY = {EXIT_INT: signal.SIGINT, -signal.SIGINT: signal.SIGINT,
               EXIT_TERM: signal.SIGTERM, -signal.SIGTERM: signal.SIGTERM}


class _JobStopped(BaseException):
    """A stop signal reached the job: SIGTERM at the launcher (scancel, kubelet), or a signal a
    worker ended by before the launcher handled it (``seen``: which worker, how)."""

    def __init__(self, signum: int, seen: str = ""):
        super().__init__(signum)
        self.signum, self.seen = signum, seen

    def error(self) -> LaunchError:
        via = f" ({self.seen})" if self.seen else ""
        return LaunchError({}, reason=f"stopped by {signal.Signals(self.signum).name}{via}; every worker "
                           "was told to stop and say goodbye", exit_code=128 + self.signum)


def _pass_job_secret(plan: Plan) -> None:
    """Resolve the job secret once (MQ_SECRET, else the per-user file) and give it to every
    worker through MQ_SECRET: they prove the same secret and never race to create the file."""
    from mq import auth

    if os.environ.get(auth.ENV_VAR) or any("secret" in o or o.get("insecure") for o in plan.options.values()):
        return
    os.environ[auth.ENV_VAR] = auth.resolve_secret().key.decode()


def run_plan(plan: Plan, *, deadline_s: float | None = None) -> None:
    """Start the plan's workers and supervise them; ``deadline_s`` bounds the whole job."""
    from mq import locality

    # Set before any worker (and any verbs library in it) starts: spawn copies the environment.
    from mq.datapaths.rdma import forksafe
    os.environ.update({k: v for k, v in forksafe.fork_safe_env(os.environ, locality.local()).items()
                       if k in forksafe.FORK_SAFE_ENV})
    _pass_job_secret(plan)
    ctx = mp.get_context("spawn")
    # worker -> launcher: the abort that stopped it (a pipe read without waiting: never blocks)
    reports, report_to = ctx.Pipe(duplex=False)
    announce = ctx.Array("c", 4096)  # launcher -> workers: a failure they must tell the job about
    procs: dict[int, Any] = {}
    # SIGTERM (scancel, kubelet) stops the workers gracefully instead of killing the launcher
    # at once (and them by SIGKILL); a second one must not break off that stop.
    with stop_signals_raise(_JobStopped) as stopping:
        try:
            for i, n in enumerate(plan.node_ids):
                if i and plan.startup_interval:
                    waits.sleep(plan.startup_interval)
                p = ctx.Process(target=_worker, args=(plan, n, report_to, announce), name=f"mq-node-{n}",
                                daemon=False)
                p.start()
                procs[n] = p
            failures, aborted_by = _supervise(plan, procs, deadline_s, reports, announce)
        except (_JobStopped, KeyboardInterrupt) as stop:
            # scancel signals one process at a time: the launcher's own SIGTERM may come while
            # it stops the workers, and must not break that off.
            stopping.set()
            _stop_all(procs)
            if isinstance(stop, KeyboardInterrupt):
                raise
            raise stop.error() from None
    if failures:
        raise LaunchError(failures, aborted_by=aborted_by)
    if aborted_by:
        raise LaunchError({}, aborted_by=aborted_by)


def _supervise(plan: Plan, procs: dict[int, Any], deadline_s: float | None, reports: Any,
               announce: Any) -> tuple[dict[int, int], dict[str, Any] | None]:
    failures: dict[int, int] = {}
    aborted_by: dict[str, Any] | None = None
    deadline = time.monotonic() + deadline_s if deadline_s else None
    while True:
        if deadline is not None and time.monotonic() > deadline:
            _stop_all(procs)
            raise Timeout(f"the job did not finish within {deadline_s:g}s; its workers were stopped")
        running = aborted = False
        for n, p in procs.items():
            code = p.exitcode
            if code is None:
                running = True
            elif code in _STOPPED_BY:
                # Ctrl-C and scancel signal the launcher and its workers at once, in no order; a
                # launcher that ignores SIGINT (a shell's background job) never sees it, and one
                # cannot ask the kernel afterwards (Python's handler consumed the signal). The
                # worker's exit status is the evidence that cannot race, so it decides: a worker
                # ended by a stop signal (or exiting 130/143, which says the same) stops the job.
                raise _JobStopped(_STOPPED_BY[code], f"node {n} exited with {_describe_exit(code)}")
            elif code == EXIT_ABORTED:
                aborted = True
            elif code != 0 and n not in failures:
                failures[n] = code
        if failures or aborted:
            if any(code < 0 for code in failures.values()):
                # A worker killed by a signal told nobody: its siblings tell the job for it.
                n, code = next((n, c) for n, c in sorted(failures.items()) if c < 0)
                _announce(plan, procs, announce, {"node": n, "host": plan.hosts.get(n) or socket.gethostname(),
                                                  "error": f"its process exited with {_describe_exit(code)}"})
            _stop_all(procs)
            while reports.poll(0):  # an aborted worker reported why before it exited
                report = reports.recv()
                aborted_by = aborted_by or report
            stopped = (0, None, EXIT_ABORTED, -signal.SIGKILL, *_STOPPED_BY)
            for n, p in procs.items():  # the ones we had to stop are not failures of their own
                if n not in failures and p.exitcode not in stopped:
                    failures[n] = p.exitcode
            return failures, None if failures else (aborted_by or {"error": "another node failed"})
        if not running:
            return failures, None
        waits.sleep(0.05)  # (children's exits are polled: nothing wakes this thread)


def _announce(plan: Plan, procs: dict[int, Any], announce: Any, info: dict[str, Any]) -> None:
    data = json.dumps(info).encode()[: len(announce) - 1]
    announce.value = data
    for p in procs.values():
        if p.exitcode is None and p.pid:
            try:
                os.kill(p.pid, signal.SIGUSR2)
            except ProcessLookupError:
                pass


def _stop_all(procs: dict[int, Any]) -> None:
    stop_processes(procs.values(), GRACE_S)


# ---------------------------------------------------------------------- the worker process
class _Stop(BaseException):
    """Raised in a worker's main thread to end ``main``: a signal or another node's failure."""

    def __init__(self, code: int, why: str):
        super().__init__(why)
        self.code = code


#: Signals a worker turns into a stop of its main: launcher/scheduler stops and aborts.
_JOB_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


class _WorkerState:
    """What a worker's signal and abort handlers share with its main thread."""

    def __init__(self) -> None:
        self.stopping = False  # main has ended: handlers must not raise into the cleanup
        self.aborted_by: dict[str, Any] | None = None
        self.tell_peers: dict[str, Any] | None = None  # a failure this worker must announce
        self.relay = False


def _worker(plan: Plan, node_id: int, reports: Any, announce: Any) -> None:
    # The kernel stops this worker when the launcher dies, so no orphan survives it. SIGTERM,
    # not SIGKILL: the worker then says goodbye and removes its socket file even when the
    # launcher was SIGKILLed; a worker that cannot stop kills itself after GRACE_S.
    die_with_parent(signal.SIGTERM, exit_if_orphaned=True)
    logging.basicConfig(level=plan.log_level.upper(),
                        format=f"%(asctime)s node{node_id} %(name)s %(levelname)s: %(message)s")
    state = _WorkerState()
    main_ident = threading.main_thread().ident
    assert main_ident is not None  # the main thread runs this: it has an ident

    def on_signal(signum: int, frame: Any) -> None:
        if state.stopping:
            return
        state.stopping = True  # raise once: a second pending signal must not hit the cleanup
        if signum == signal.SIGUSR1:
            raise _Stop(EXIT_ABORTED, "another node failed")
        if signum == signal.SIGUSR2:  # the launcher: a sibling died without telling anyone
            try:
                state.tell_peers = json.loads(announce.value.decode() or "{}")
            except ValueError:
                state.tell_peers = {"node": "?", "error": "a worker on this host failed"}
            raise _Stop(EXIT_ABORTED, "a worker on this host failed")
        raise _Stop(EXIT_TERM if signum == signal.SIGTERM else EXIT_INT, signal.Signals(signum).name)

    def on_abort(msg: Any) -> None:  # runs on a handler thread of the queue
        if state.stopping or state.aborted_by is not None:
            return
        info = msg.payload if isinstance(msg.payload, dict) else {}
        state.aborted_by = {"node": info.get("node", msg.sender), "host": info.get("host", ""),
                            "error": str(info.get("error", "failed"))}
        state.relay = plan.relay_abort
        signal.pthread_kill(main_ident, signal.SIGUSR1)  # wakes main even in a blocking call

    for signum in _JOB_SIGNALS:
        signal.signal(signum, on_signal)
    _wake_main_on_signals(state, main_ident)
    code, q = 1, None
    try:
        fn = resolve_main(plan.main, plan.package)
        labels = plan.labels.get(node_id, [])
        q = create(plan.mq_type, node_id, labels, **plan.options[node_id])
        from mq import telemetry

        telemetry.serve(q)  # every launched node answers `mq top`
        q.listen()
        if node_id == min(plan.node_ids) and "tcp" in q.addresses:  # once per launch: where to watch the job
            sys.stderr.write(f"mq run: node {node_id} listens on {q.addresses['tcp']}; watch the job with "
                             f"mq top --attach-to {q.addresses['tcp']}\n")
        q.subscribe(ABORT_TOPIC, on_abort)
        fn(Context(node_id, frozenset(labels), q, plan.mq_type, plan.world_size,
                   list(plan.node_ids), dict(plan.args)))
        code = 0
    except _Stop as stop:
        state.stopping = True
        code = stop.code
    except KeyboardInterrupt:
        state.stopping = True
        code = EXIT_INT
    except SystemExit as exc:
        state.stopping = True
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:
        state.stopping = True
        sys.stderr.write(f"mq: node {node_id} failed:\n{traceback.format_exc()}")
        code = 1
        if state.aborted_by is None:  # else it failed because the job was going down anyway
            state.tell_peers = {"node": node_id, "host": plan.hosts.get(node_id) or socket.gethostname(),
                                "error": f"{type(exc).__name__}: {exc}"[:500]}
    state.stopping = True
    if state.aborted_by is not None and state.tell_peers is None:
        code = EXIT_ABORTED
        reports.send(state.aborted_by)
        sys.stderr.write(f"mq: node {node_id} stopped: {describe_abort(state.aborted_by)}\n")
    _finish(q, state, node_id, code)


def _wake_main_on_signals(state: _WorkerState, main_ident: int | None) -> None:
    """Make a stop signal interrupt the main thread wherever the kernel delivered it.

    Python runs signal handlers in the main thread only, and only when it runs bytecode. A
    signal that lands on another thread (numpy's, nng's, torch's: gVisor, for one, picks any
    thread) would leave ``main`` asleep in a blocking call. The C-level handler still writes
    the signal number to the wakeup fd, so a watcher thread pokes the main thread with a
    no-op SIGURG, whose EINTR makes it run the pending handler at once. The watcher also
    bounds the stop: GRACE_S after the first stop signal the process kills itself.
    """
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    signal.signal(signal.SIGURG, lambda *_: None)
    wanted = {int(s) for s in _JOB_SIGNALS}

    def watch() -> None:
        armed = False
        while True:
            data = os.read(r, 64)
            if not wanted.intersection(data):
                continue
            if not armed:  # however stuck main is, a stop signal ends the process in GRACE_S
                armed = True
                timer = threading.Timer(GRACE_S, os.kill, (os.getpid(), signal.SIGKILL))
                timer.daemon = True
                timer.start()
            if not state.stopping and main_ident is not None:
                signal.pthread_kill(main_ident, signal.SIGURG)

    threading.Thread(target=watch, daemon=True, name="mq-signals").start()


def _finish(q: Any, state: _WorkerState, node_id: int, code: int) -> None:
    """Tell the peers if needed, stop the queue within a bound, and exit now: threads stuck in
    a user's handler must not keep a finished worker alive."""

    def stop() -> None:
        if q is None:
            return
        try:
            if state.tell_peers is not None:
                _tell_peers(q, state.tell_peers, skip=set())
            elif state.relay and state.aborted_by is not None:
                _tell_peers(q, state.aborted_by, skip={state.aborted_by["node"]})
            aborting = state.tell_peers is not None or state.aborted_by is not None
            q.stop(timeout=ABORTED_STOP_S if aborting else STOP_S)
        except Exception:
            log.exception("node %d: error while stopping the queue", node_id)

    for signum in _JOB_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    stopper = threading.Thread(target=stop, daemon=True, name=f"mq{node_id}-stop")
    stopper.start()
    waits.join(stopper, ABORT_S + STOP_S + 1.0)
    # The user's atexit hooks (checkpoints, TensorBoard writers) still run; what os._exit skips
    # is the interpreter's join of non-daemon threads, which a stuck handler would hang forever.
    try:
        atexit._run_exitfuncs()
        logging.shutdown()
    except Exception:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def _tell_peers(q: Any, info: Mapping[str, Any], skip: set[Any]) -> None:
    """Send the abort to every peer, within ABORT_S in all (a dead peer costs at most 1 s)."""
    deadline = time.monotonic() + ABORT_S
    for peer in q.peers():
        left = deadline - time.monotonic()
        if peer in skip or left <= 0:
            continue
        try:
            q.send(peer, ABORT_TOPIC, dict(info), timeout=min(1.0, left))
        except MQError as exc:
            log.debug("node %d: could not tell node %d to stop: %s", q.node_id, peer, exc)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"
