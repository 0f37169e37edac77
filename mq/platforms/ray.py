"""``mq run --platform ray``: every node of a job is a Ray actor on a Ray cluster.

One ``mq run`` (on the head, or anywhere ``RAY_ADDRESS`` / ``--ray-address`` reaches the
cluster) starts the whole job: ``-n`` nodes, each an actor that asks Ray for its role's
resources (``--ray-resources learner:cpu=2,gpu=1``; default one CPU), makes its queue with
``init_method="ray://<job>"`` (:mod:`mq.integrations.ray`: the nodes meet through Ray, their data
goes node to node) and runs ``main(ctx)``.

Guarantees:

* ``mq run`` returns when every node's main has returned; the first node that fails (its main
  raised, or its actor or Ray node died) fails the job with a :class:`~mq.launch.LaunchError`
  naming the node and why, and the other actors are killed.
* Ctrl-C, SIGTERM and ``--timeout`` kill every actor of the job: none is left on the cluster.
  The actors are owned by ``mq run``'s Ray driver, so Ray also ends them if ``mq run`` dies.
* The code must be importable on every Ray node, as under Slurm (``--package DIR`` is added to
  ``sys.path`` on each).
"""

from __future__ import annotations

import logging
import re
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

from mq.errors import ConfigError

log = logging.getLogger("mq.platforms.ray")

#: Seconds a node's queue gets to say goodbye after its main returned.
STOP_S = 5.0
_RESOURCE_RE = re.compile(r"^(cpu|gpu|memory|[A-Za-z_][A-Za-z0-9_.-]*)=([0-9]+(?:\.[0-9]+)?)$")


@dataclass(frozen=True)
class RayJob:
    """A job ``mq run --platform ray`` starts: what each node actor needs."""

    main: str
    mq_type: str
    world_size: int
    labels: dict[int, list[str]]
    resources: dict[int, dict[str, float]]
    backend_options: dict[str, Any] = field(default_factory=dict)
    topology: str = "mesh"
    args: dict[str, Any] = field(default_factory=dict)
    package: str | None = None
    log_level: str = "WARNING"
    group: str = field(default_factory=lambda: f"mq-run-{uuid.uuid4().hex[:12]}")


def parse_resources(specs: list[str] | tuple[str, ...], labels: Mapping[int, list[str]]) -> dict[int, dict[str, float]]:
    """Each node's Ray resources from ``--ray-resources ROLE:cpu=N,gpu=N[,NAME=N]`` entries
    (a role is a label given by ``--roles``/``--labels``; ``*`` is every node without an
    entry). A node without an entry asks for one CPU.

    Raises:
        ConfigError: a malformed entry, an unknown role, or a role given twice.
    """
    by_role: dict[str, dict[str, float]] = {}
    known = {label for ls in labels.values() for label in ls} | {"*"}
    for spec in specs:
        role, colon, items = spec.partition(":")
        role = role.strip()
        if not colon or not role:
            raise ConfigError(f"--ray-resources {spec!r} is not ROLE:cpu=N,gpu=N (e.g. learner:cpu=2,gpu=1)")
        if role not in known:
            raise ConfigError(f"--ray-resources {spec!r}: no node has the role {role!r} "
                              f"(roles: {', '.join(sorted(known - {'*'})) or 'none'}; '*' is every other node)")
        if role in by_role:
            raise ConfigError(f"--ray-resources: role {role!r} is given twice")
        wanted: dict[str, float] = {}
        for item in (i.strip() for i in items.split(",")):
            match = _RESOURCE_RE.match(item)
            if not match:
                raise ConfigError(f"--ray-resources {spec!r}: {item!r} is not NAME=AMOUNT "
                                  "(cpu=2, gpu=1, memory=BYTES or a custom Ray resource)")
            wanted[match.group(1)] = float(match.group(2))
        by_role[role] = wanted
    out = {}
    for n, ls in labels.items():
        mine = [by_role[label] for label in ls if label in by_role]
        if len(mine) > 1:
            raise ConfigError(f"--ray-resources: node {n} has roles {ls} with resources each; give one of them")
        out[n] = mine[0] if mine else by_role.get("*", {"cpu": 1.0})
    return out


def _actor_options(wanted: Mapping[str, float]) -> dict[str, Any]:
    """Ray's actor options for ``cpu``/``gpu``/``memory`` and custom resources."""
    custom = {k: v for k, v in wanted.items() if k not in ("cpu", "gpu", "memory")}
    options: dict[str, Any] = {"num_cpus": wanted.get("cpu", 0.0), "num_gpus": wanted.get("gpu", 0.0)}
    if "memory" in wanted:
        options["memory"] = int(wanted["memory"])
    if custom:
        options["resources"] = custom
    return options


def _check_fits(job: RayJob, offers: list[dict[str, float]]) -> None:
    """A node no Ray node can host would wait for its resources forever: a ConfigError now."""
    names = {"cpu": "CPU", "gpu": "GPU"}
    for n, wanted in sorted(job.resources.items()):
        if not any(all(offer.get(names.get(k, k), 0.0) >= v for k, v in wanted.items()) for offer in offers):
            asked = ",".join(f"{k}={v:g}" for k, v in wanted.items())
            biggest = "; ".join(",".join(f"{k}={v:g}" for k, v in sorted(o.items()) if "node:" not in k)
                                for o in offers) or "no live Ray node"
            raise ConfigError(f"node {n} asks for {asked}, which no Ray node of the cluster has ({biggest}); "
                              "lower --ray-resources or add Ray nodes")


class NodeActor:
    """One node of the job (a Ray actor): its queue, and ``main(ctx)``."""

    def run(self, job: RayJob, node_id: int) -> dict[str, Any]:
        import ray

        from mq import telemetry
        from mq.backend import LocalJob
        from mq.launch import Context, resolve_main
        from mq.platforms.plan import free_port
        from mq.registry import create, profile_for

        logging.basicConfig(level=job.log_level.upper(),
                            format=f"%(asctime)s node{node_id} %(name)s %(levelname)s: %(message)s")
        host = ray.util.get_node_ip_address()
        fn = resolve_main(job.main, job.package)
        local = LocalJob(node_ids=[node_id], world_size=job.world_size, topology=job.topology, address=host,
                         ports=[], attach_to=[], init_method=f"ray://{job.group}", pick_port=free_port)
        options = {**profile_for(job.mq_type).local_options(local)[node_id], **job.backend_options}
        labels = job.labels.get(node_id, [])
        q = create(job.mq_type, node_id, labels, **options)
        try:
            telemetry.serve(q)  # `mq top` reaches it as any launched node
            q.listen()
            fn(Context(node_id, frozenset(labels), q, job.mq_type, job.world_size,
                       list(range(job.world_size)), dict(job.args)))
        finally:
            q.stop(STOP_S, raise_undelivered=False)
        return {"node": node_id, "host": host}


def run(job: RayJob, *, address: str | None = None, deadline_s: float | None = None) -> dict[int, dict[str, Any]]:
    """Start ``job`` on the Ray cluster at ``address`` (else ``RAY_ADDRESS``) and wait for it.

    Returns:
        node id -> ``{"node", "host"}`` (the Ray node's IP) of every node.

    Raises:
        ConfigError: no Ray, or no cluster there.
        LaunchError: a node failed or its actor died (named), the job timed out, or it was
            stopped by Ctrl-C or SIGTERM (exit codes 130, 143). The job's actors are killed
            in every case.
    """
    from mq.integrations.ray import connect
    from mq.launch import EXIT_INT, EXIT_TERM, LaunchError

    ray = connect("mq run --platform ray", address, show_output=True)
    _check_fits(job, [n["Resources"] for n in ray.nodes() if n.get("Alive")])
    cls = ray.remote(max_restarts=0)(NodeActor)
    actors: dict[int, Any] = {}
    # Ctrl-C and SIGTERM, also where this process was started with them ignored (a background
    # job of a script): a handler must not raise inside Ray's own wait, so it is looked at each turn.
    stopped_by: list[int] = []
    previous = ({sig: signal.signal(sig, lambda signum, frame: stopped_by.append(signum))
                 for sig in (signal.SIGINT, signal.SIGTERM)}
                if threading.current_thread() is threading.main_thread() else {})
    try:
        for n in range(job.world_size):
            actors[n] = cls.options(name=None, **_actor_options(job.resources[n])).remote()
        pending = {actors[n].run.remote(job, n): n for n in actors}
        results: dict[int, dict[str, Any]] = {}
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        while pending:
            if stopped_by:
                sig = stopped_by[0]
                raise LaunchError({}, reason=f"stopped by {signal.Signals(sig).name}; every node's actor was killed",
                                  exit_code=EXIT_INT if sig == signal.SIGINT else EXIT_TERM)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise LaunchError({}, reason=f"the job did not end within --timeout {deadline_s:g}s; "
                                             f"nodes {sorted(pending.values())} were still running")
            done, _ = ray.wait(list(pending), num_returns=1, timeout=min(1.0, left) if left else 1.0)
            for ref in done:
                n = pending.pop(ref)
                results[n] = _result(ray, ref, n)
        return results
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for actor in actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # an actor already gone: nothing to kill
                log.debug("kill: %s", exc)


def _result(ray: Any, ref: Any, node: int) -> dict[str, Any]:
    from mq.launch import LaunchError

    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        text = f"{type(cause).__name__}: {cause}".splitlines()[0][:300]
        raise LaunchError({node: 1}, reason=f"node {node} failed: {text} (its traceback is in the Ray "
                                            "worker's log and above)") from None
    except ray.exceptions.RayActorError as exc:
        text = str(exc).strip().splitlines()[0][:300]
        raise LaunchError({node: 1}, reason=f"node {node}'s Ray actor died before its main returned "
                                            f"(killed, out of memory, or its Ray node left): {text}") from None


def check_flags(**given: Any) -> None:
    """Options ``mq run --platform ray`` derives itself: a ConfigError naming the first given."""
    for flag, value in given.items():
        if value not in (None, (), [], ""):
            raise ConfigError(f"--{flag.replace('_', '-')} does not apply to --platform ray: Ray places the "
                              "nodes and they meet through Ray (give -n, --roles and --ray-resources)")

