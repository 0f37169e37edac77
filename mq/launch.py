"""Launch a job's workers on this machine: one spawned process per node, each calling
``main(ctx)`` with its open message queue.

Guarantees: a worker that raises prints its traceback and makes the launch fail; the other
workers are then stopped (SIGTERM, then SIGKILL after a grace period); Ctrl-C stops them all;
workers die with the launcher (PR_SET_PDEATHSIG), so none is left behind as an orphan.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from mq.errors import ConfigError, MQError, Timeout
from mq.registry import check_mq_type, create
from mq.rendezvous import TOPOLOGIES, attach_targets, parse_init_method

log = logging.getLogger("mq.launch")

GRACE_S = 3.0


class LaunchError(MQError):
    """A worker failed; ``failures`` maps node id -> exit code."""

    def __init__(self, failures: dict[int, int]):
        self.failures = failures
        detail = ", ".join(f"node {n} exited with {_describe_exit(c)}" for n, c in sorted(failures.items()))
        super().__init__(f"worker failed: {detail} (its traceback is printed above)")


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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def make_plan(main: Callable[..., Any] | str, *, n_workers: int = 1, mq_type: str = "nng",
              topology: str = "mesh", labels: Any = None, node_ids: Iterable[int] | None = None,
              world_size: int | None = None, protocol: str = "auto", address: str = "127.0.0.1",
              ports: Iterable[int] | None = None, attach_to: Iterable[str] = (),
              init_method: str | None = None, local_cuda_devices: Iterable[int] | None = None,
              cuda_device_map: str | None = None, platform: str = "local",
              startup_interval: float = 0.0, log_level: str = "WARNING", package: str | None = None,
              mq_options: Mapping[str, Any] | None = None, args: Mapping[str, Any] | None = None,
              environ: Mapping[str, str] | None = None) -> Plan:
    """Validate every option and decide each worker's node id, labels and queue options."""
    mq_type = check_mq_type(mq_type)
    if not isinstance(n_workers, int) or n_workers < 1:
        raise ConfigError(f"the number of workers must be >= 1, got {n_workers!r}")
    if topology not in TOPOLOGIES:
        raise ConfigError(f"topology must be one of {', '.join(TOPOLOGIES)}, got {topology!r}")
    if protocol not in ("auto", "tcp", "ipc"):
        raise ConfigError(f"protocol must be auto, tcp or ipc, got {protocol!r}")
    if startup_interval < 0:
        raise ConfigError(f"startup interval must be >= 0 seconds, got {startup_interval}")
    if init_method:
        parse_init_method(init_method, environ)
    ref = main_ref(main)
    resolve_main(ref, package)  # fail in the launcher, with one line, not in every worker
    from mq import device_map

    cuda_devices = list(local_cuda_devices) if local_cuda_devices is not None else None
    if cuda_device_map:
        device_map.reject_for_cpu(mq_type, cuda_device_map)
    options: dict[int, dict[str, Any]] = {}
    if platform in ("slurm", "k8s"):
        from mq import platforms

        pplan = platforms.plan_for(platform, environ=environ, workers_per_node=n_workers,
                                   topology=topology, base_port=(list(ports)[0] if ports else platforms.DEFAULT_BASE_PORT))
        ids = list(pplan.node_ids)
        world = pplan.world_size
        for n in ids:
            o = pplan.options_for(n)
            options[n] = ({"listen_to": o["listen_to"], "attach_to": o["attach_to"]} if mq_type == "nng"
                          else {"init_method": o["init_method"], "world_size": o["world_size"]})
    elif platform == "local":
        ids = list(node_ids) if node_ids is not None else []
        if len(ids) == 1 and n_workers > 1:
            ids = list(range(ids[0], ids[0] + n_workers))  # a start id
        ids = ids or list(range(n_workers))
        if len(ids) != n_workers or len(set(ids)) != len(ids) or min(ids) < 0:
            raise ConfigError(f"node ids {ids} must be {n_workers} distinct non-negative ints (one per worker)")
        world = world_size if world_size is not None else max(ids) + 1
        if world < max(ids) + 1:
            raise ConfigError(f"world size {world} is too small for node ids {ids}")
        port_list = list(ports) if ports else []
        if port_list and len(port_list) == 1 and n_workers > 1:
            port_list = [port_list[0] + i for i in range(n_workers)]
        if port_list and len(port_list) != n_workers:
            raise ConfigError(f"--ports gives {len(port_list)} ports for {n_workers} workers: give one, "
                              "or a base port")
        if mq_type == "nng":
            options = _nng_options(ids, topology, protocol, address, port_list, list(attach_to),
                                   init_method, world)
        else:
            im = init_method or f"tcp://{address}:{free_port(address)}"
            options = {n: {"init_method": im, "world_size": world} for n in ids}
    else:
        raise ConfigError(f"platform must be local, slurm or k8s, got {platform!r}")
    for n in ids:
        if mq_type == "nng":
            options[n]["protocol"] = protocol
        else:
            if cuda_devices is not None:
                options[n]["local_cuda_devices"] = cuda_devices
            if cuda_device_map:
                options[n]["cuda_device_map"] = cuda_device_map
        options[n].update(mq_options or {})
    return Plan(main=ref, mq_type=mq_type, node_ids=ids, labels=parse_labels(labels, ids),
                options=options, world_size=world, args=dict(args or {}), log_level=log_level,
                startup_interval=startup_interval, package=package)


def _nng_options(ids: list[int], topology: str, protocol: str, address: str, ports: list[int],
                 extra_attach: list[str], init_method: str | None, world: int) -> dict[int, dict[str, Any]]:
    if ports:  # static addresses: every node knows every other's address up front
        listen = {n: f"tcp://{address}:{p}" for n, p in zip(ids, ports)}
        return {n: {"listen_to": listen[n],
                    "attach_to": [listen[t] for t in attach_targets(n, ids, topology)] + extra_attach}
                for n in ids}
    if not init_method:
        # No ports given: the launcher picks free ones. (A rendezvous store would work too, but
        # it needs torch.distributed, a one-second import for every worker.)
        return _nng_options(ids, topology, protocol, address, [free_port(address) for _ in ids],
                            extra_attach, None, world)
    im = init_method
    return {n: {"listen_to": f"tcp://{address}:0", "init_method": im, "world_size": world,
                "topology": topology, "attach_to": list(extra_attach)} for n in ids}


# ---------------------------------------------------------------------- running
def launch(main: Callable[[Context], Any] | str, n_workers: int = 1, mq_type: str = "nng",
           topology: str = "mesh", labels: Any = None, **options: Any) -> None:
    """Run ``main(ctx)`` in ``n_workers`` spawned processes, each with an open queue.

    Options are those of :func:`make_plan` (the ``mq run`` flags). Returns when every worker
    returned.

    Raises:
        ConfigError: a bad option (nothing was started).
        LaunchError: a worker failed; the others were stopped.
    """
    run_plan(make_plan(main, n_workers=n_workers, mq_type=mq_type, topology=topology,
                       labels=labels, **options))


def run_plan(plan: Plan, *, deadline_s: float | None = None) -> None:
    """Start the plan's workers and supervise them; ``deadline_s`` bounds the whole job."""
    from mq import forksafe, locality

    # Set before any worker (and any verbs library in it) starts: spawn copies the environment.
    os.environ.update({k: v for k, v in forksafe.fork_safe_env(os.environ, locality.local()).items()
                       if k in forksafe.FORK_SAFE_ENV})
    ctx = mp.get_context("spawn")
    procs: dict[int, Any] = {}
    try:
        for i, n in enumerate(plan.node_ids):
            if i and plan.startup_interval:
                time.sleep(plan.startup_interval)
            p = ctx.Process(target=_worker, args=(plan, n), name=f"mq-node-{n}", daemon=False)
            p.start()
            procs[n] = p
        failures = _supervise(procs, deadline_s)
    except KeyboardInterrupt:
        _stop_all(procs)
        raise
    if failures:
        raise LaunchError(failures)


def _supervise(procs: dict[int, Any], deadline_s: float | None) -> dict[int, int]:
    failures: dict[int, int] = {}
    deadline = time.monotonic() + deadline_s if deadline_s else None
    while True:
        if deadline is not None and time.monotonic() > deadline:
            _stop_all(procs)
            raise Timeout(f"the job did not finish within {deadline_s:g}s; its workers were stopped")
        running = False
        for n, p in procs.items():
            code = p.exitcode
            if code is None:
                running = True
            elif code != 0 and n not in failures:
                failures[n] = code
        if failures:
            _stop_all(procs)
            for n, p in procs.items():  # the ones we had to stop are not failures of their own
                if n not in failures and p.exitcode not in (0, None, 130, -signal.SIGTERM, -signal.SIGKILL):
                    failures[n] = p.exitcode
            return failures
        if not running:
            return failures
        time.sleep(0.05)


def _stop_all(procs: dict[int, Any]) -> None:
    for p in procs.values():
        if p.exitcode is None:
            p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in procs.values():
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs.values():
        if p.exitcode is None:
            p.kill()
            p.join(1.0)


def _worker(plan: Plan, node_id: int) -> None:
    _die_with_parent()
    logging.basicConfig(level=plan.log_level.upper(),
                        format=f"%(asctime)s node{node_id} %(name)s %(levelname)s: %(message)s")
    # SIGTERM from the launcher unwinds like Ctrl-C, so `with q:` stops the queue cleanly.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        fn = resolve_main(plan.main, plan.package)
        labels = plan.labels.get(node_id, [])
        q = create(plan.mq_type, node_id, labels, **plan.options[node_id])
        with q:
            fn(Context(node_id, frozenset(labels), q, plan.mq_type, plan.world_size,
                       list(plan.node_ids), dict(plan.args)))
    except KeyboardInterrupt:
        sys.exit(130)
    except SystemExit:
        raise
    except BaseException:
        sys.stderr.write(f"mq: node {node_id} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        sys.exit(1)


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker when the launcher dies, so no orphan survives it."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the launcher died before prctl took effect
            os._exit(1)
    except OSError:
        pass


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"
