"""What a user receives: :class:`Message`. A plain record; every receiving part builds it
(:mod:`mq.node.dispatch` for direct frames, :mod:`mq.fanout.relays` for relayed ones)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Message:
    """A received message: ``topic``, ``payload`` and the ``sender``'s node id."""

    topic: str
    payload: Any
    sender: int
    sent_at: float = field(default=0.0, compare=False, repr=False)  # sender's clock, for latency
