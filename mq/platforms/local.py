"""``--platform local``: every worker on this machine."""

from __future__ import annotations

from mq.errors import ConfigError
from mq.platforms.plan import DEFAULT_BASE_PORT, PlatformPlan, build_plan, check_port, check_workers


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
    n_workers = check_workers(n_workers, "n_workers")
    check_port(base_port, "base port")
    if not isinstance(address, str) or not address.strip() or any(c.isspace() for c in address):
        raise ConfigError(f"address {address!r} is not a host name or IP address")
    return build_plan(
        platform="local",
        hosts=[address],
        counts=[n_workers],
        host_ports=[base_port],
        host_index=0,
        node_ids=list(range(n_workers)),
        topology=topology,
        rendezvous_port=rendezvous_port,
    )
