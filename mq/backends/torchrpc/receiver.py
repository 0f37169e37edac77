"""Receiving on the torchrpc transport: every peer's frames in, in send order (:class:`Receiver`).

TensorPipe runs incoming requests on a thread pool, so frames of one sender can arrive out of
order. The ``mq::deliver`` op parks each frame by its sequence number and returns at once (it
never blocks a TensorPipe thread); frames in order go to one delivery thread, which hands them
to core (the handshake parser until the rank proved itself, ``on_frame`` after) and counts
what was consumed: that count is the sender's credit, piggybacked on every RPC's answer, or
sent in a credit frame to a blocked sender.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Mapping

import torch

from mq.backends.torchrpc.streams import Inbound, Link
from mq.backends.torchrpc.wire import WANT, frame_parts, latin1, settle_cuda
from mq.errors import ProtocolError
from mq.transport import Events


class Receiver:
    """The receiving ends of every peer's stream and the thread that delivers their frames.

    Args:
        node_id: this node.
        world_size: the RPC group's size (for messages).
        links: the sending ends by peer: credit that comes in with a frame goes there.
        options: the transport's options (``send_window``, ``send_window_bytes``).
        send_credit: ``send_credit(peer)`` sends a credit frame to a blocked peer.
    """

    def __init__(self, node_id: int, world_size: int, links: Mapping[int, Link], options: Any,
                 send_credit: Callable[[int], None]):
        self.node_id = node_id
        self.world_size = world_size
        self.send_window = options.send_window
        self.send_window_bytes = options.send_window_bytes
        self._links = links
        self._send_credit = send_credit
        self._inbound = {p: Inbound() for p in links}
        self._lock = threading.Lock()  # per-sender order and counts (self._inbound)
        # (sender, (text, buffers)) in delivery order, None to stop: a C queue, as this hand-off
        # (TensorPipe thread -> delivery thread) is on every frame's path
        self._ready: queue.SimpleQueue[tuple[int, Any] | None] = queue.SimpleQueue()
        self._stop = False
        self.rpc_ready = threading.Event()  # the agent can answer: delivery may start
        self._thread: threading.Thread | None = None
        self._node: Events | None = None

    def start(self, node: Events) -> None:
        self._node = node
        self._thread = threading.Thread(target=self._delivery_loop, daemon=True,
                                        name=f"mq{self.node_id}-rpc-io")
        self._thread.start()

    def report(self, peer: int) -> int:
        """How many of ``peer``'s frames were consumed (the credit to piggyback on a frame to it)."""
        return self._inbound[peer].report()

    def stop(self) -> None:
        """Deliver nothing more (the thread ends after the frame it may be delivering)."""
        self._stop = True
        self._ready.put(None)
        self.rpc_ready.set()

    def join(self, timeout: float) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def on_rpc(self, sender: Any, seq: Any, ack: Any, text: str, buffers: list[torch.Tensor]) -> int:
        """A frame arrived (TensorPipe thread): park it in order; never blocks."""
        inbound = self._inbound.get(sender) if isinstance(sender, int) else None
        if inbound is None:
            if self._node is not None:
                self._node.on_dropped(f"a frame from node {sender!r}, not in this RPC group")
            raise RuntimeError(f"mq: node {self.node_id} got a frame from node {sender!r}, which is "
                               f"not a peer in this group of {self.world_size}")
        self._links[sender].credit(ack)
        if seq < 0:
            with self._lock:
                if seq == WANT:
                    inbound.waiting = True
                return inbound.report()
        if any(t.is_cuda for t in buffers):
            settle_cuda(buffers)
        with self._lock:
            if seq < inbound.expect or seq in inbound.held:
                if self._node is not None:  # a duplicate: never deliver twice
                    self._node.on_dropped(f"duplicate frame {seq} from node {sender}")
                return inbound.report()
            inbound.held[seq] = (text, buffers)
            while inbound.expect in inbound.held:
                self._ready.put((sender, inbound.held.pop(inbound.expect)))
                inbound.expect += 1
                inbound.queued += 1
            return inbound.report()

    def _delivery_loop(self) -> None:
        self.rpc_ready.wait()  # HELLO from a fast peer waits until our agent can answer
        while True:
            item = self._ready.get()
            if item is None or self._stop:
                return
            sender, (text, buffers) = item
            self._deliver(("rank", sender), text, buffers)
            inbound = self._inbound[sender]
            with self._lock:
                inbound.consumed += 1
                inbound.queued -= 1
                inbound.unreported_bytes += len(text) + sum(t.nbytes for t in buffers)
                # A blocked sender gets credit in batches (half a window of frames or bytes, or
                # all we had once we caught up), not one control frame per consumed frame.
                credit = inbound.waiting and (
                    inbound.queued == 0
                    or inbound.consumed - inbound.reported >= max(1, self.send_window // 2)
                    or inbound.unreported_bytes >= self.send_window_bytes // 2)
                if credit:
                    inbound.waiting = False
                    inbound.report()
            if credit:
                self._send_credit(sender)

    def _deliver(self, link: tuple[str, int], text: Any, buffers: list[Any]) -> None:
        """One frame of a rank to core: whole to the handshake parser until the rank proved
        itself (a handshake frame is text alone), split for ``on_frame`` after."""
        node = self._node
        assert node is not None
        try:
            if not node.trusts(link):
                if buffers or not isinstance(text, str):
                    raise ProtocolError("a frame with tensors from a rank that has not joined")
                node.on_handshake(latin1(text), link)  # a rank's connection cannot be closed
                return
            head, views = frame_parts(text, buffers, node.max_frame_bytes)
        except ProtocolError as exc:
            node.on_dropped(f"from node {link[1]}: {exc}", exc.cause)
        else:
            node.on_frame(head, views, link)
