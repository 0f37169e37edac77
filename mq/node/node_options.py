"""A node's own options (every mq type's): :class:`NodeOptions`, validated once when made.

:func:`mq.create` routes each keyword to these or to the transport's options type (a name that
is both is refused when a backend is found, :func:`mq.registry.transport_options`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from mq.datapaths.nvlink import cuda_ipc as _cuda_ipc
from mq.fanout import relays as _fanout
from mq.datapaths.shm import pool as _shm
from mq.errors import ConfigError
from mq.options import check_bool, check_int

__all__ = ["DEFAULT_TIMEOUT_S", "MAX_TIMEOUT_S", "NodeOptions", "seconds"]

DEFAULT_TIMEOUT_S = 30.0
#: Longer waits are capped: threading refuses timeouts past ~292 years (OverflowError).
MAX_TIMEOUT_S = 365 * 86400.0


@dataclass(frozen=True)
class NodeOptions:
    """A node's own options.

    Args:
        queue_size: bound of the receive queue; a full queue makes senders wait (backpressure).
        timeout: default timeout in seconds of ``send``/``publish``/``call``/``recv``.
        allow_pickle: let the codec pickle what it cannot carry, and unpickle it on receive.
            Only between trusted peers; off by default.
        handler_threads: threads serving ``on`` handlers.
        max_frame_bytes: larger incoming frames are dropped and counted.
        shm: use the shared-memory data path with same-host peers (route ``shm``).
        shm_pool_bytes: bound of this node's pool (default: a quarter of RAM, at most 4 GiB);
            receivers holding every slot make senders wait (backpressure).
        shm_inline_max: buffers smaller than this stay inline in the frame (default 64 KiB).
        queue_bytes: bound in bytes of each receive queue (messages of 64 KiB and more count;
            smaller ones are bounded by ``queue_size``); a full queue is backpressure.
        cuda: use the cuda_ipc data path (route ``nvlink``) for CUDA tensors to same-host peers;
            False stages them through host memory.
        cuda_pool_bytes: bound of this node's pool on each GPU it sends from (default: a
            sixteenth of the GPU's memory, at most 4 GiB); it is also the backpressure bound.
        cuda_inline_max: GPU tensors smaller than this are staged through host memory even
            to nvlink peers (default 64 KiB: measured, a small copy beats a descriptor there).
        secret: the job secret peers must prove they know (default: ``MQ_SECRET``, else a
            per-user file; see :mod:`mq.auth`).
        insecure: turn authentication off: any process that reaches this node may join.
        heartbeat: seconds between liveness probes of a peer (of those worth probing: data or
            calls either way within three peer timeouts, or a wait of ours on it; an idle pair
            sends nothing, see :mod:`mq.node.liveness`).
        peer_timeout: a probed peer silent this long is lost (its host crashed or the network
            broke): blocked senders and callers get :class:`~mq.errors.PeerLost`. Detection takes
            at most ``peer_timeout + heartbeat`` seconds (5 s by default). Time this process itself
            was not scheduled does not count against peers.
        relay_min_bytes: a ``publish`` at least this large to peers on other hosts goes through
            relays there (:mod:`mq.fanout.relays`); None: never.
        relay_shape: how relays nest: ``auto``, ``star``, ``tree`` or ``chain``.
        rdma: the rdma data path (route ``rdma``, large CPU buffers to peers on other hosts by
            one-sided reads through NIXL/UCX): ``auto`` (when this node has an ACTIVE RDMA
            port), ``tcp`` (over UCX's tcp transport, no device needed) or False.
        rdma_pool_bytes: bound of the rdma send pool and of the landing pool (default: a quarter
            of RAM, at most 4 GiB); receivers that have not pulled yet make senders wait.
        rdma_inline_max: CPU buffers smaller than this stay inline on rdma routes (default 64 KiB).
        require_route: routes a peer must get, else sends to it raise
            :class:`~mq.errors.ConfigError` naming the peer and why (a degradation is an error,
            not a slowdown): a set of route names for every peer (``{"rdma", "shm"}``), or a
            dict of node id -> set; None: take the best route there is, and say why in ``routes()``.
    """

    queue_size: int = 1024
    timeout: float = DEFAULT_TIMEOUT_S
    allow_pickle: bool = False
    handler_threads: int = 4
    max_frame_bytes: int = 4 << 30
    shm: bool = True
    shm_pool_bytes: int = _shm.DEFAULT_POOL_BYTES
    shm_inline_max: int = _shm.DEFAULT_INLINE_MAX
    queue_bytes: int = 256 << 20
    cuda: bool = True
    cuda_pool_bytes: int | None = None
    cuda_inline_max: int = _cuda_ipc.DEFAULT_INLINE_MAX
    secret: str | bytes | None = None
    insecure: bool = False
    heartbeat: float = 1.0
    peer_timeout: float = 4.0
    relay_min_bytes: int | None = _fanout.DEFAULT_RELAY_MIN_BYTES
    relay_shape: str = "auto"
    rdma: str | bool = "auto"
    rdma_pool_bytes: int | None = None
    rdma_inline_max: int = 64 << 10
    require_route: Any = None

    @classmethod
    def names(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))

    @classmethod
    def of(cls, given: dict[str, Any]) -> "NodeOptions":
        """``NodeOptions(**given)``, or a ConfigError naming an option it does not have."""
        unknown = sorted(set(given) - cls.names())
        if unknown:
            raise ConfigError(f"unexpected keyword argument {unknown[0]!r}; node options are "
                              f"{', '.join(sorted(cls.names()))}")
        return cls(**given)

    def __post_init__(self) -> None:
        check_int(self.queue_size, "queue_size")
        if seconds(self.timeout, "timeout") <= 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        object.__setattr__(self, "timeout", seconds(self.timeout, "timeout"))
        for name in ("max_frame_bytes", "queue_bytes", "handler_threads"):
            check_int(getattr(self, name), name)
        for name in ("heartbeat", "peer_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 3600:
                raise ConfigError(f"{name} must be a number of seconds in (0, 3600), got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("allow_pickle", "insecure"):
            check_bool(getattr(self, name), name)
        object.__setattr__(self, "require_route", required_routes(self.require_route))


def required_routes(value: Any) -> dict[Any, frozenset[str]] | None:
    """``require_route=`` as ``{node id or "*": routes}``, or a ConfigError saying what is wrong."""
    from mq.routing import ALL_ROUTES, ROUTE_KINDS

    def routes(v: Any, where: str) -> frozenset[str]:
        items = [v] if isinstance(v, str) else v
        try:
            out = frozenset(items)
        except TypeError:
            raise ConfigError(f"require_route{where} must be route names, got {v!r}") from None
        bad = sorted(str(x) for x in out - ALL_ROUTES)
        if bad or not out:
            raise ConfigError(f"require_route{where}: unknown route(s) {bad or '(none given)'}; routes are "
                              f"{', '.join(ROUTE_KINDS)}")
        return out

    if value is None:
        return None
    if isinstance(value, dict):
        out: dict[Any, frozenset[str]] = {}
        for k, v in value.items():
            if isinstance(k, bool) or not (isinstance(k, int) or k == "*"):
                raise ConfigError(f"require_route keys are node ids (or '*'), got {k!r}")
            out[k] = routes(v, f"[{k!r}]")
        return out
    return {"*": routes(value, "")}


def seconds(value: Any, name: str) -> float:
    """A finite, non-negative number of seconds, or a ConfigError that says so."""
    if type(value) in (int, float) and 0 <= value <= MAX_TIMEOUT_S:  # the usual case, per call
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number of seconds (int or float), got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise ConfigError(f"{name} must be a finite number of seconds, got {value!r}: for a long "
                          "wait pass a large number such as 3600")
    if value < 0:
        raise ConfigError(f"{name} must be >= 0 seconds, got {value!r}")
    return min(float(value), MAX_TIMEOUT_S)
