"""What a node counts of what it refused or dropped, and says so (dropped frames are never silent).

:class:`Stats` is the record a user reads with :meth:`mq.MQ.stats`; every part of the node adds
to it. :class:`Refusals` counts a refused join or frame, or a dropped frame, by cause and logs
it (rate-limited: a stranger can send many): the join, dispatch and fan-out share one.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass, field
from typing import Any

from mq.wire import handshake as _handshake
from mq.errors import ProtocolError
from mq.node.ratelog import RateLimitedLog

log = logging.getLogger("mq")


@dataclass
class Stats:
    """Counters a user can read with :meth:`MQ.stats` (dropped frames are never silent)."""

    sent: int = 0
    received: int = 0
    dropped_malformed: int = 0
    dropped_oversized: int = 0
    dropped_unexpected_reply: int = 0
    # frames a peer sent that were dropped after they arrived, by cause ("peer_left": it had
    # left or was lost; "stopping": a call that reached this node after it said goodbye)
    dropped: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)  # refused joins and frames, by cause
    shm: dict[str, int] = field(default_factory=dict)  # the pool's counters (placed, by_handle...)
    relay: dict[str, int] = field(default_factory=dict)  # fan-out (relayed, forwarded, acks...)
    rdma: dict[str, Any] = field(default_factory=dict)  # the rdma path's (offers, pulls, refusals, pools...)
    cuda: dict[str, int] = field(default_factory=dict)  # the CUDA pools' (placed, held_bytes, opens...)


class Refusals:
    """Counts into ``stats`` what was refused or dropped, by cause, and logs it (rate-limited)."""

    def __init__(self, node_id: int, stats: Stats):
        self.node_id = node_id
        self.stats = stats
        self.log = RateLimitedLog(log, f"node {node_id}: refused or dropped")

    def reject(self, cause: str, why: str) -> None:
        """A refused frame or join."""
        self.stats.rejected[cause] = self.stats.rejected.get(cause, 0) + 1
        self.log(cause, f"node {self.node_id}: refused: {why}")

    def dropped(self, why: str, cause: str = "malformed", count: int = 1) -> None:
        """A frame that could not be read (``malformed``), was too large (``oversized``), or
        another cause (``Stats.dropped``); ``count`` of them."""
        if cause == "oversized":
            self.stats.dropped_oversized += count
        elif cause in ("malformed", "error"):
            self.stats.dropped_malformed += count
        else:
            self.stats.dropped[cause] = self.stats.dropped.get(cause, 0) + count
        self.log(cause, f"node {self.node_id}: dropped a {cause} frame: {why}")

    def discarded(self, cause: str, why: str) -> None:
        """A well-formed frame from a peer that nobody will get (see ``Stats.dropped``)."""
        self.stats.dropped[cause] = self.stats.dropped.get(cause, 0) + 1
        self.log(cause, f"node {self.node_id}: dropped {why}")

    def refused(self, exc: ProtocolError) -> None:
        """Count a frame the boundary refused (by cause) or the decoder found malformed."""
        if isinstance(exc, _handshake.Refused):
            self.reject(exc.cause, str(exc))
        else:
            self.dropped(str(exc), exc.cause)

    def failed(self, exc: Exception) -> None:
        """A frame raised what no frame should (a bug): dropped and counted like a malformed one."""
        where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        self.dropped(f"{type(exc).__name__}: {exc} (at {where.filename}:{where.lineno}, a bug: "
                     "please report it)" if where else f"{type(exc).__name__}: {exc}", "error")
