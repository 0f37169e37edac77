"""A peer's route: decided here when it joins, and changed only here afterwards, each change
adding to the route's reason (so ``routes()`` says why a peer is on its route, and what it
lost on the way). Everyone else reads ``Peer.route``; nobody else writes it
(``tests/test_house.py`` keeps it so).

The decisions, in the order a peer meets them:

* :func:`choose` (the join): the fastest viable route both ends' transports carry
  (:func:`mq.routing.select_route`), ``shm`` only where this node opened the peer's pool;
* :func:`refused_our_pool` (its LINK verdict): it cannot open our pool, so frames go by socket;
* :func:`degrade_cpu` (the rdma path's verdict): it could not load our rdma offer, so large
  CPU buffers go by socket;
* :func:`stage_gpu` (the cuda_ipc path's verdict): GPU payloads go through host memory, not
  ``nvlink``; :func:`note` adds a remark that changes nothing (once).
"""

from __future__ import annotations

import re
from dataclasses import replace
import logging
from typing import Any, Callable, Collection, Mapping

from mq.errors import ConfigError
from mq.locality import Locality
from mq.node.peers import Peer
from mq.routing import Route, Verdict, select_route

log = logging.getLogger("mq")

#: no data path offered beside the transport's routes
NOT_OFFERED = Verdict(False)

__all__ = ["check_required_here", "choose", "enforce", "degrade_cpu", "note", "refused_our_pool", "stage_gpu"]


def choose(here: Locality, remote: Locality, carried: Collection[str], *, peer_id: int,
           same_process: bool, gpu: bool, opened_pool: bool, why_not_shm: str | None,
           no_pool: str | None, on_refused: Callable[[str], None],
           rdma: Verdict = NOT_OFFERED) -> Route:
    """The route to a peer that joins.

    Args:
        carried: the route kinds this node's transport carries.
        gpu: whether the cuda_ipc path is on (``cuda=``); off, ``nvlink`` is not offered.
        opened_pool: this node opened the peer's shared-memory pool (``shm`` is offered).
        why_not_shm: why the peer's pool could not be opened here, if it could not.
        no_pool: why this node has no pool of its own, if it has none (said on ``ipc`` routes).
        on_refused: told when no route the transport carries is viable (``protocol=ipc``
            towards another host); ``tcp`` is taken then.
        rdma: whether both ends' rdma data paths can talk (:meth:`mq.datapaths.rdma.path.RdmaPath.viable`),
            and why (not). One that needs no device (``rdma='tcp'``: over UCX's tcp transport)
            takes the peers the device check alone would send by tcp.
    """
    supported = set(carried)
    if not gpu:
        supported.discard("nvlink")
    if opened_pool:
        supported.add("shm")
    if rdma.ok:
        supported.add("rdma")
    try:
        route = select_route(here, remote, supported=supported, peer=peer_id, same_process=same_process)
    except ConfigError as exc:
        on_refused(str(exc))
        route = select_route(here, remote, supported={"tcp"}, peer=peer_id)
    if route.gpudirect and "nvlink" not in supported:  # this transport stages GPU tensors
        route = replace(route, gpudirect=False)
    if rdma.ok and route.kind == "tcp" and not rdma.needs_device:
        # no RDMA port needed (the path runs without one): the device check's "not rdma" goes
        reason = re.sub(r"; not rdma: [^;.]*", "", route.reason)
        reason = reason.replace("tcp: always available", f"rdma: {rdma.why}", 1)
        route = replace(route, kind="rdma", gpu="rdma" if route.gpu == "tcp" else route.gpu,
                        reason=reason.replace("GPU payloads: tcp", "GPU payloads: rdma", 1))
    elif not rdma.ok and rdma.why and route.kind in ("rdma", "tcp"):
        route = replace(route, reason=f"{route.reason}; mq's rdma path: {rdma.why}")
    if why_not_shm and route.kind != "inproc":
        route = replace(route, reason=f"{route.reason}; not shm: {why_not_shm}")
    elif no_pool and route.kind == "ipc":
        route = replace(route, reason=f"{route.reason}; not shm: {no_pool}")
    return route


def refused_our_pool(peer: Peer, carried: Collection[str]) -> bool:
    """The peer cannot open this node's pool: where the transport cannot carry ``shm`` frames
    itself, they go by ``ipc`` (else ``tcp``). True when the route changed."""
    if peer.route is None or peer.route.kind != "shm" or "shm" in carried:
        return False
    fallback = "ipc" if "ipc" in carried else "tcp"
    peer.route = replace(peer.route, kind=fallback, reason=f"{peer.route.reason}; not shm: node "
                         f"{peer.node_id} cannot open this node's shared memory")
    return True


def degrade_cpu(peer: Peer, why: str, required: Mapping[Any, frozenset[str]] | None) -> None:
    """The rdma path to ``peer`` does not hold: its large CPU buffers go inline on the link."""
    peer.cpu_path = None
    if peer.route is not None and peer.route.kind == "rdma":
        peer.route = replace(peer.route, kind="tcp", gpu="tcp" if peer.route.gpu == "rdma" else peer.route.gpu,
                             reason=f"{peer.route.reason}; not rdma after all: {why}")
    enforce(peer, required)


def enforce(peer: Peer, required: Mapping[Any, frozenset[str]] | None) -> None:
    """``require_route=``: a peer on a route it does not allow gets ``route_error`` (its sends
    raise it), named with the route's reason. Also logged, once."""
    allowed = None if required is None or peer.route is None else required.get(peer.node_id, required.get("*"))
    if allowed is None or peer.route is None or peer.route.kind in allowed:  # (no route: allowed is None)
        peer.route_error = None
        return
    peer.route_error = (f"node {peer.node_id} is on route {peer.route.kind}, but require_route allows only "
                        f"{sorted(allowed)} for it: {peer.route.reason}")
    log.error("%s", peer.route_error)


def check_required_here(required: Mapping[Any, frozenset[str]] | None, rdma_unavailable: str | None) -> None:
    """A node whose ``require_route`` asks for rdma alone must be able to use rdma itself.

    Raises:
        ConfigError: it cannot, and why (e.g. no ACTIVE RDMA port, NIXL missing).
    """
    for key, allowed in (required or {}).items():
        if rdma_unavailable and "rdma" in allowed and not allowed & {"tcp", "ipc"}:
            who = "every peer" if key == "*" else f"node {key}"
            raise ConfigError(f"require_route asks rdma for {who}, but this node cannot use rdma: "
                              f"{rdma_unavailable}")


def stage_gpu(peer: Peer, why: str) -> None:
    """``nvlink`` to ``peer`` does not hold: its GPU payloads take the CPU route."""
    if peer.route is not None and peer.route.gpu == "nvlink":
        peer.route = replace(peer.route, gpu=peer.route.kind,
                             reason=f"{peer.route.reason}; GPU payloads staged through host, not nvlink: {why}")


def note(peer: Peer, text: str) -> None:
    """Add ``text`` to the reason of the peer's route (once)."""
    if peer.route is not None and text not in peer.route.reason:
        peer.route = replace(peer.route, reason=f"{peer.route.reason}; {text}")
