"""`mq run`: start this machine's workers of a job. Thin: parse options, call mq.launch."""

from __future__ import annotations

import sys
from typing import Any, Callable

import click

from mq.errors import ConfigError, MQError
from mq.platforms import PLATFORMS
from mq.registry import DEFAULT_MQ_TYPE, backend_for, backends, launchable_mq_types
from mq.rendezvous import TOPOLOGIES


def _parsed(mq_type: str, given: dict[str, Any]) -> dict[str, Any]:
    """The backend flags given on the command line, parsed by the chosen backend's flags."""
    try:
        flags = {f.option: f for f in backend_for(mq_type).flags}
    except ConfigError:
        flags = {}  # an unknown --mq-type: make_plan says so
    return {k: flags[k].parse(v) if k in flags and flags[k].parse and isinstance(v, str) else v  # type: ignore[misc]
            for k, v in given.items() if v is not None}  # (ignore: mypy does not narrow flags[k].parse)


def _int_list(value: str | None, what: str) -> list[int] | None:
    if value is None or value == "":
        return None
    out = []
    for token in value.split(","):
        token = token.strip()
        if not token.isdigit():
            raise ConfigError(f"{what} {value!r}: {token!r} is not a non-negative integer "
                              f"(expected a comma-separated list such as 0,1,2)")
        out.append(int(token))
    return out


def _backend_flags(command: Callable[..., Any]) -> Callable[..., Any]:
    """One click option per backend flag (``Backend.flags``), named and explained by the
    backends that take it; the value reaches ``run`` as text (or a bool) in ``backend_flags``."""
    takers: dict[str, list] = {}
    for b in backends().values():
        if b.launch is not None:
            for f in b.flags:
                takers.setdefault(f.option, []).append((b, f))
    for option, pairs in sorted(takers.items(), reverse=True):
        b0, f0 = pairs[0]
        help_ = " ".join(f"{b.name}: {b.flag_help(option)}" for b, _ in pairs)
        name = f0.cli_name
        if b0.flag_is_switch(option):
            decl = click.option(f"{name}/--no-{name[2:]}", option, default=None, help=help_)
        else:
            decl = click.option(name, option, default=None, metavar=f0.metavar, help=help_)
        command = decl(command)
    return command


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--main", "main_", required=True, metavar="MODULE:FUNC",
              help="Function each worker runs as main(ctx); module:func or module.func.")
@click.option("--package", default=None, metavar="DIR|PKG",
              help="Directory added to sys.path, or package --main is relative to.")
@click.option("--parallel-workers", "-n", type=int, default=None,
              help="Workers (nodes) to start on this machine [default: 1; under --platform slurm, "
                   "one worker per srun task, while -n W runs W per host with one task per host].")
@click.option("--mq-type", default=DEFAULT_MQ_TYPE, show_default=True, metavar="|".join(launchable_mq_types()),
              help="Backend: " + "; ".join(f"{', '.join(b.mq_types)}: {b.summary}"
                                           for b in backends().values() if b.launch is not None) + ".")
@click.option("--topology", default="mesh", show_default=True, metavar="|".join(TOPOLOGIES),
              help="Who connects to whom: every pair, everyone to the first node, or nobody.")
@click.option("--address", default=None,
              help="Host/IP this machine's workers listen on [default: 127.0.0.1; derived from "
                   "the host list under --platform slurm|k8s].")
@click.option("--ports", default=None, metavar="P[,P...]",
              help="Listen ports, one per worker or a base port (consecutive). "
                   "Default: free ports picked by the launcher; base port 50515 under "
                   "--platform slurm|k8s.")
@click.option("--attach-to", default=None, metavar="ADDR[,ADDR...]",
              help="Extra peer addresses to join, e.g. tcp://10.0.0.1:50515 (mq types whose nodes "
                   "listen on addresses; the others meet through --init-method).")
@click.option("--node-ids", default=None, metavar="ID[,ID...]",
              help="Node ids of this machine's workers (one per worker, or a start id). Default 0..n-1.")
@click.option("--labels", multiple=True, metavar="LABEL[,LABEL]",
              help="Roles such as learner or collector. Once: for every worker; repeated once per "
                   "worker: per worker in order (local only; use --roles across hosts).")
@click.option("--roles", default=None, metavar="ROLE:COUNT[,ROLE:*]",
              help="Roles by rank over the whole job, in node-id order: learner:1,collector:* makes "
                   "node 0 the learner and the rest collectors (same locally, on Slurm and k8s).")
@click.option("--world-size", type=int, default=None,
              help="Nodes in the whole job (all machines). Default: max node id + 1.")
@click.option("--init-method", default=None, metavar="tcp://H:P|env://|file://PATH",
              help="Rendezvous store (mq types whose workers bind no given ports, and the others "
                   "without --ports).")
@click.option("--platform", default="local", show_default=True, metavar="|".join((*PLATFORMS, "ray")),
              help="Derive node ids, addresses and ports from the scheduler's environment; ray: "
                   "start all -n nodes of the job as actors on a Ray cluster.")
@click.option("--ray-address", default=None, metavar="HOST:PORT",
              help="--platform ray: the cluster's head [default: RAY_ADDRESS, else one on this machine].")
@click.option("--ray-resources", multiple=True, metavar="ROLE:cpu=N,gpu=N",
              help="--platform ray: the Ray resources of each node of a role (repeatable; '*' for "
                   "the others) [default: cpu=1].")
@click.option("--startup-interval", type=float, default=0.0, show_default=True,
              help="Seconds between starting workers.")
@click.option("--log-level", default="WARNING", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
              help="Log level of the workers.")
@click.option("--prefix/--no-prefix", "prefix_output", default=True, show_default=True,
              help="Start each line a worker prints with its node ([node 3] ), whole lines only.")
@click.option("--timeout", "job_timeout", type=float, default=None,
              help="Stop the job after this many seconds (default: no limit).")
@_backend_flags
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run(main_: str, package: str | None, parallel_workers: int | None, mq_type: str, topology: str,
        address: str | None, ports: str | None, attach_to: str | None,
        node_ids: str | None, labels: tuple[str, ...], roles: str | None, world_size: int | None,
        init_method: str | None,
        platform: str, ray_address: str | None, ray_resources: tuple[str, ...], startup_interval: float,
        log_level: str, prefix_output: bool, job_timeout: float | None, args: tuple[str, ...],
        **backend_flags: Any) -> None:
    """Launch this machine's workers of a job; each runs MAIN(ctx) with its open queue.

    Extra ARGS after `--` reach the workers as ctx.args["argv"].

    \b
    Example (3 nodes on this machine):
      mq run --main mq.tools.demo:main -n 3 --roles 'learner:1,collector:*'
    \b
    On Slurm (one worker per task, or one launcher per host with -n):
      srun -N2 -n4 mq run --platform slurm --main mypkg:main --roles 'learner:1,collector:*'
      srun -N2 --ntasks-per-node=1 mq run --platform slurm -n 2 --main mypkg:main ...
    \b
    On a Ray cluster (every node an actor; run where RAY_ADDRESS reaches the head):
      mq run --platform ray -n 9 --main mypkg:main --roles 'learner:1,collector:*' \\
        --ray-resources learner:cpu=2,gpu=1 --ray-resources collector:cpu=1
    """
    from mq.launch import make_plan, run_plan
    from mq.backends.nng.options import check_address  # --attach-to takes nng addresses

    if platform == "ray":
        _run_on_ray(main_, package, parallel_workers, mq_type, topology, labels, roles, ray_address,
                    ray_resources, log_level, job_timeout, args, backend_flags,
                    address=address, ports=ports, attach_to=attach_to, node_ids=node_ids,
                    world_size=world_size, init_method=init_method, startup_interval=startup_interval or None)
        return
    try:
        if ray_address or ray_resources:
            raise ConfigError("--ray-address and --ray-resources are options of --platform ray")
        attach = [check_address(a.strip(), "--attach-to address") for a in (attach_to or "").split(",") if a.strip()]
        given = _parsed(mq_type, backend_flags)
        if len(labels) > 1 and platform == "local" and len(labels) != (parallel_workers or 1):
            raise ConfigError(f"--labels given {len(labels)} times for {parallel_workers or 1} workers: "
                              "give it once (all workers) or once per worker")
        plan = make_plan(
            main_, n_workers=parallel_workers, mq_type=mq_type, topology=topology,
            labels=list(labels) if len(labels) > 1 else (labels[0] if labels else None), roles=roles,
            node_ids=_int_list(node_ids, "--node-ids"), world_size=world_size,
            address=address, ports=_int_list(ports, "--ports"), attach_to=attach,
            init_method=init_method, backend_options=given, platform=platform,
            startup_interval=startup_interval, log_level=log_level, package=package,
            args={"argv": list(args)}, prefix_output=prefix_output)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    _exit_on_failure(lambda: run_plan(plan, deadline_s=job_timeout), "workers stopped")


def _exit_on_failure(job: Callable[[], Any], on_interrupt: str) -> Any:
    """Run the job; a failure exits with its code (130 on Ctrl-C) and one line saying why."""
    from mq.launch import LaunchError

    try:
        return job()
    except KeyboardInterrupt:
        click.echo(f"mq run: interrupted; {on_interrupt}", err=True)
        sys.exit(130)
    except LaunchError as exc:
        click.echo(f"mq run: {exc}", err=True)
        sys.exit(exc.exit_code)
    except MQError as exc:
        click.echo(f"mq run: {exc}", err=True)
        sys.exit(1)


def _run_on_ray(main_: str, package: str | None, n: int | None, mq_type: str, topology: str,
                labels: tuple[str, ...], roles: str | None, ray_address: str | None,
                ray_resources: tuple[str, ...], log_level: str, job_timeout: float | None,
                args: tuple[str, ...], backend_flags: dict[str, Any], **derived: Any) -> None:
    """``mq run --platform ray``: the whole job as Ray actors (:mod:`mq.platforms.ray`)."""
    from mq.launch import checked_flags, parse_labels, resolve_main
    from mq.platforms import assign_roles
    from mq.platforms import ray as on_ray
    from mq.registry import check_mq_type, profile_for

    try:
        on_ray.check_flags(**derived)
        if n is None or n < 1:
            raise ConfigError("--platform ray needs -n N: the number of nodes of the whole job")
        mq_type = check_mq_type(mq_type)
        profile_for(mq_type)  # (a ConfigError for an mq type whose nodes cannot be launched)
        resolve_main(main_, package)  # a typo fails here, not in n actors
        ids = list(range(n))
        if roles:
            if labels:
                raise ConfigError("give --roles or --labels, not both")
            node_labels = assign_roles(roles, ids)
        else:
            if len(labels) > 1 and len(labels) != n:
                raise ConfigError(f"--labels given {len(labels)} times for {n} nodes: give it once or once per node")
            node_labels = parse_labels(list(labels) if len(labels) > 1 else (labels[0] if labels else None), ids)
        job = on_ray.RayJob(main=main_, mq_type=mq_type, world_size=n, labels=node_labels,
                            resources=on_ray.parse_resources(ray_resources, node_labels),
                            backend_options=checked_flags(backend_for(mq_type), mq_type,
                                                          _parsed(mq_type, backend_flags)),
                            topology=topology, args={"argv": list(args)}, package=package, log_level=log_level)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    results = _exit_on_failure(lambda: on_ray.run(job, address=ray_address, deadline_s=job_timeout),
                               "every node's Ray actor was killed")
    hosts = sorted({r["host"] for r in results.values()})
    click.echo(f"mq run: {n} nodes ended on Ray ({len(hosts)} Ray node(s): {', '.join(hosts)})", err=True)
