"""The two ends of one torchrpc stream: :class:`Link` (this node -> a peer: sequence numbers,
credit, the RPCs in flight) and :class:`Inbound` (a peer -> this node: reordering and the
consumption count that becomes the peer's credit). See :mod:`mq.backends.torchrpc.transport`
for how credit flows."""

from __future__ import annotations

import collections
import threading
from typing import Any

import torch

from mq.node.waits import Waits


class Link:
    """Sender side of one stream (this node -> peer): sequence numbers and credit."""

    def __init__(self, peer: int, waits: Waits | None = None):
        self.peer = peer
        self.cond = threading.RLock()  # its state; waits on it go through the node's (on the link)
        self.waits = waits or Waits()
        self.info: Any = None  # rpc.WorkerInfo
        self.next_seq = 0
        self.acked = 0  # frames the peer has consumed
        self.sizes: collections.deque[tuple[int, int]] = collections.deque()  # (seq, nbytes) unacked
        self.bytes = 0
        self.pending = 0  # RPCs not yet answered
        self.want_out = False
        self.want_acked = -1
        self.want_t = 0.0
        self.failed: str | None = None

    def credit(self, consumed: Any) -> None:
        if not isinstance(consumed, int):
            return
        with self.cond:
            consumed = min(consumed, self.next_seq)
            if consumed <= self.acked:
                return
            self.acked = consumed
            while self.sizes and self.sizes[0][0] < consumed:
                self.bytes -= self.sizes.popleft()[1]
        self.waits.wake(self)


class Inbound:
    """Receiver side of one stream (peer -> this node): reorder state and consumption count."""

    def __init__(self) -> None:
        self.expect = 0
        self.held: dict[int, tuple[str, list[torch.Tensor]]] = {}
        self.queued = 0  # in-order frames in the ready queue, not yet delivered
        self.consumed = 0
        self.reported = 0  # the consumption count the sender last heard of
        self.unreported_bytes = 0  # consumed since then
        self.waiting = False  # the sender is blocked: credit it soon

    def report(self) -> int:
        if self.consumed > self.reported:
            self.reported, self.unreported_bytes = self.consumed, 0
        return self.consumed
