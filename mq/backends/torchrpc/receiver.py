"""Receiving on the torchrpc transport: every peer's frames in, in send order (:class:`Receiver`).

TensorPipe runs incoming requests on a thread pool, so frames of one sender can arrive out of
order. The ``mq::deliver`` op parks each frame by its sequence number and returns at once (it
never blocks a TensorPipe thread); frames in order wait in one ready queue. Whoever holds the
reader token takes them off it, one at a time (so they stay in order), hands each to core (the
handshake parser until the rank proved itself, ``on_frame`` after) and counts what was
consumed: that count is the sender's credit, piggybacked on every RPC's answer, or sent in a
credit frame to a blocked sender.

Two kinds of thread read (:mod:`mq.node.reader_token`): a thread in ``recv()`` (or waiting for a
reply) reads for itself (:meth:`Receiver.read_in_caller`), so the frame it waits for skips a
hand-off between threads (a wake-up on each side of a send and its answer); the delivery thread
reads while no caller does. A caller never waits on a full queue (core lets it read only while
its queues have room); the delivery thread may, which is the backpressure. Nothing polls: a
frame wakes the delivery thread while nobody reads, a caller wakes it only when it leaves
frames behind.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Mapping

import torch

from mq.backends.torchrpc.streams import Inbound, Link
from mq.backends.torchrpc.wire import WANT, frame_parts, latin1, settle_cuda
from mq.errors import ClosedError, ProtocolError
from mq.node import waits
from mq.node.reader_token import ReaderToken
from mq.transport import Events
from mq.node.waits import Flag, Waits

# Frames the delivery thread delivers before it looks again whether a caller came.
_BATCH = 64


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
        # (sender, (text, buffers)) in delivery order, None to stop: a deque (append and popleft
        # are atomic), as this hand-off (TensorPipe thread -> reader) is on every frame's path
        self._ready: collections.deque[tuple[int, Any] | None] = collections.deque()
        self._token = ReaderToken()  # held by the one thread taking frames off _ready
        self._idle = False  # the delivery thread waits for a frame: on_rpc must wake it
        self._stop = False
        self.rpc_ready = Flag()  # the agent can answer: delivery may start
        self._thread: threading.Thread | None = None
        self._node: Events | None = None
        self._waits = Waits()

    def start(self, node: Events) -> None:
        self._node = node
        self._waits = waits.of(node)
        self._token = ReaderToken(self._waits)
        self.rpc_ready = Flag(self._waits)
        self._thread = threading.Thread(target=self._delivery_loop, daemon=True,
                                        name=f"mq{self.node_id}-rpc-io")
        self._thread.start()

    def report(self, peer: int) -> int:
        """How many of ``peer``'s frames were consumed (the credit to piggyback on a frame to it)."""
        return self._inbound[peer].report()

    def stop(self) -> None:
        """Deliver nothing more (the thread ends after the frame it may be delivering; a caller
        reading gets :class:`~mq.errors.ClosedError`)."""
        self._stop = True
        self._ready.append(None)
        self._waits.wake(self._ready)
        self.rpc_ready.set()
        self._token.stop()

    def finish(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the delivery thread to end (after :meth:`stop`)."""
        if self._thread is not None and self._thread is not threading.current_thread():
            waits.join(self._thread, timeout)

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
                self._ready.append((sender, inbound.held.pop(inbound.expect)))
                inbound.expect += 1
                inbound.queued += 1
            credit = inbound.report()
        self._waits.wake(self._ready)  # a caller waiting in _read_one
        # Wake the delivery thread only when it waits and no caller will take the frame (a caller
        # that leaves frames behind wakes it). _idle is set before the thread looks at _ready,
        # and a caller's count drops before it looks: no wake-up is lost.
        if self._idle and not self._token.callers:
            self._token.wake()
        return credit

    def read_in_caller(self, timeout: float, ready: Callable[[], bool]) -> bool:
        """Deliver at most one frame in the calling thread, waiting up to ``timeout`` for it;
        return at once when ``ready()`` (what the caller waits for arrived meanwhile). False
        when this receiver cannot be read yet (the agent is not answering)."""
        if self._stop or not self.rpc_ready.is_set():
            return False
        self._token.read(timeout, ready, self._read_one, self._left_behind)
        return True

    def _read_one(self, timeout: float) -> None:
        """A caller's read (reader token held): deliver the next frame, waiting up to ``timeout``."""
        ready = self._ready
        try:
            item = ready.popleft()
        except IndexError:
            if not self._waits.pause(lambda: ready, timeout, on=(ready,)):
                return
            try:
                item = ready.popleft()
            except IndexError:  # (a stop's None is taken by one reader and put back)
                return
        if item is None:
            self._ready.append(None)  # for the delivery thread and other callers
            raise ClosedError("the queue was stopped during recv()")
        self._consume(*item)

    def _left_behind(self) -> bool:
        return self._idle and bool(self._ready)

    def _delivery_loop(self) -> None:
        while not self.rpc_ready.wait(1.0):  # HELLO from a fast peer waits until our agent can answer
            if self._stop:
                return
        while self._wait_for_turn():
            with self._token.held():
                for _ in range(_BATCH):
                    try:
                        item = self._ready.popleft()
                    except IndexError:
                        break
                    if item is None:
                        return
                    self._consume(*item)
                    if self._token.callers:
                        break

    def _wait_for_turn(self) -> bool:
        """Wait until frames are ready and no recv() caller reads (or just did); False: stop.
        Nothing polls: a frame wakes this thread while nobody reads (``on_rpc``), a caller
        wakes it only when it leaves frames behind."""
        token = self._token
        while not self._stop:
            token.await_turn(lambda: self._stop, idle_wait=None)
            if self._stop:
                return False
            if self._ready:
                return True
            self._idle = True  # (before looking at _ready: see on_rpc)
            try:
                token.idle(lambda: self._stop or (not token.callers and bool(self._ready)), 1.0)
            finally:
                self._idle = False
        return False

    def _consume(self, sender: int, frame: tuple[Any, list[Any]]) -> None:
        """Deliver one in-order frame (reader token held) and count it; credit a blocked sender."""
        text, buffers = frame
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
