"""The receive side: subscriptions, the bounded queues, the handler thread, and reading the
transport in the caller's thread.

:class:`Delivery` owns what a decoded message goes into: the ``recv()`` queue, or the queue of
the subscription handler thread (handlers run there, in order, never on an I/O thread), both
:class:`mq.node.queues.BoundedQueue`. A full queue blocks the producer (the transport's I/O thread):
the transport stops reading and the sender feels backpressure. Data flows::

    dispatch (MSG) | fan-out (a relayed MSG) -> Delivery.deliver -> recv queue | handler queue
    recv queue -> Delivery.recv (the user) ; handler queue -> handler thread -> fn(message)

``recv()`` and other waits (a call's reply, a release) may read the transport in their own
thread (``Transport.read_in_caller``): no hand-off from an I/O thread, which is a large part of
a small message's latency. They do so only while every queue a frame can go to has room.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from mq import metrics as _metrics
from mq.node import waits as _waits
from mq.errors import ClosedError, Timeout
from mq.node.lifecycle import Lifecycle
from mq.node.message import Message
from mq.node.queues import BoundedQueue
from mq.transport import Transport
from mq.node.waits import Waits

log = logging.getLogger("mq")


class ReadingInCaller(threading.local):
    """Per thread: ``active`` while this thread reads the transport for itself. (A class
    default, not getattr(..., False): a missing attribute costs an exception per message.)"""

    active = False


class Delivery:
    """Where node ``node_id``'s messages go (see the module docstring).

    Args:
        handler_room: whether the call handlers' queue has room (:meth:`mq.node.calls.Calls.has_room`);
            a thread reads for itself only then, so a REQ it reads never waits for handlers.
        reader_busy: entered while a full queue holds up the I/O thread (liveness judges
            nobody silent meanwhile: their frames wait unread).
    """

    def __init__(self, node_id: int, transport: Transport, life: Lifecycle, metrics: _metrics.Metrics,
                 waits: Waits, handler_room: Callable[[], bool], reader_busy: Callable[[], Any], *,
                 queue_size: int, queue_bytes: int):
        self.node_id = node_id
        self._read_in_caller = transport.read_in_caller
        self._life = life
        self._metrics = metrics
        self._waits = waits
        self._handler_room = handler_room
        self._reader_busy = reader_busy
        self.inbox = BoundedQueue(queue_size, queue_bytes, waits)
        self.handler_queue = BoundedQueue(queue_size, queue_bytes, waits)
        self.reading = ReadingInCaller()
        self.subscriptions: dict[str, Callable[[Message], Any] | None] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ subscriptions
    def subscribe(self, topic: str, fn: Callable[[Message], Any] | None) -> None:
        with self._lock:
            self.subscriptions[topic] = fn

    def unsubscribe(self, topic: str) -> None:
        with self._lock:
            self.subscriptions.pop(topic, None)

    def topics(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self.subscriptions)

    # ------------------------------------------------------------------ producing (I/O threads)
    def deliver(self, topic: str, payload: Any, sender: int, sent_at: float, nbytes: int,
                queued_bytes: int) -> None:
        """A message for the user: to its topic's handler, else to ``recv()``. ``nbytes`` is
        counted in the metrics, ``queued_bytes`` against the queue's byte bound (inline bytes:
        the pool bounds shared ones)."""
        self._metrics.received(topic, nbytes)
        msg = Message(topic, payload, sender, sent_at)
        fn = self.subscriptions.get(topic)  # a dict read is atomic: no lock per message
        if fn is not None:
            self.put_blocking(self.handler_queue, (fn, msg), queued_bytes)
        else:
            self.put_blocking(self.inbox, msg, queued_bytes)

    def put_blocking(self, q: BoundedQueue, item: Any, nbytes: int = 0) -> None:
        # Block the I/O thread while the queue is full: the transport stops reading and the
        # sender feels backpressure. A stop ends the wait (the message is dropped: its sender
        # learns what was not confirmed). While blocked we read nobody's heartbeats, so silence
        # is nobody's fault: liveness waits (reader_busy).
        if self.reading.active or (nbytes < q.BIG and len(q.items) < q.capacity) or q.room(nbytes):
            # (A thread reading for itself, the queues not full when it started: the frames of
            # one transport message, a batch, go in past the bound, or it would wait on itself,
            # its inbox, or on handlers that may wait for it.)
            q.put_now(item, nbytes)
            return
        try:
            with self._reader_busy():
                self._waits.until(lambda: q.room(nbytes), None, on=(q,))
        except ClosedError:
            return
        q.put_now(item, nbytes)

    # ------------------------------------------------------------------ consuming
    def recv(self, timeout: float) -> Message:
        """Next message of the ``recv()`` queue (see :meth:`mq.MQ.recv`)."""
        inbox = self.inbox
        if self._life.state != "listening" and inbox.empty():
            raise ClosedError(self._life.not_listening("recv()"))
        deadline = time.monotonic() + timeout
        while True:
            if not inbox.empty():  # (an empty inbox is the common case here: no exception for it)
                msg = inbox.get_nowait()
                self._metrics.delivered(msg.topic, msg.sent_at)
                return msg
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout(f"no message within {timeout:g}s")
            # Read the transport in this thread when it can: no hand-off from an I/O thread,
            # which is a large part of a small message's latency.
            read = False
            if self._may_read():
                self.reading.active = True
                try:
                    read = self._read_in_caller(left, self._inbox_ready)
                finally:
                    self.reading.active = False
            if not read:  # the I/O thread reads: wait for what it puts in the inbox
                self._waits.until(lambda: not inbox.empty(), deadline, on=(inbox,),
                                  what=f"no message within {timeout:g}s")

    def read_while(self, done: Callable[[], bool], deadline: float) -> None:
        """Wait until ``done()`` or ``deadline`` reading the transport in this thread, as recv()
        does: the frame that ends the wait (a reply, a release) is handled here instead of being
        handed over by the I/O thread, a thread hop that cost a by-handle send ~0.1 ms. Reads
        only while :meth:`_may_read` (what arrives meanwhile stays within the bounds, one
        transport message past them at most); otherwise leaves the waiting to the caller."""
        while not done():
            left = deadline - time.monotonic()
            if left <= 0 or self._life.state != "listening" or not self._may_read():
                return
            self.reading.active = True  # a batch's frames go in past a bound it just met
            try:
                if not self._read_in_caller(min(left, 0.05), done):
                    return
            finally:
                self.reading.active = False

    def _may_read(self) -> bool:
        """Whether a thread may read the transport for itself: only while every queue a frame
        can go to has room, so its reads (which never wait on a queue) keep the bounds."""
        inbox, handlers = self.inbox, self.handler_queue
        return (len(inbox.items) < inbox.capacity and len(handlers.items) < handlers.capacity
                and self._handler_room())

    def _inbox_ready(self) -> bool:
        return not self.inbox.empty()

    def depths(self) -> dict[str, dict[str, int]]:
        return {"recv": self.inbox.depth(), "handlers": self.handler_queue.depth()}

    # ------------------------------------------------------------------ the handler thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._handlers_loop, daemon=True, name=f"mq{self.node_id}-handlers")
        self._thread.start()

    def finish(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the handler thread to end (after the node stopped)."""
        if self._thread is not None:
            self.handler_queue.put_now((None, None), 0)  # wakes the loop to see the node stopped
            _waits.join(self._thread, timeout)

    def _handlers_loop(self) -> None:
        while self._life.running or not self.handler_queue.empty():
            try:
                fn, msg = self.handler_queue.get(timeout=_waits.PAUSE_RECHECK_S)  # (a stop wakes it)
            except IndexError:
                if not self._life.running:
                    return
                continue
            if fn is None:  # finish(): look at the node's state now
                continue
            self._metrics.delivered(msg.topic, msg.sent_at)
            try:
                fn(msg)
            except Exception:
                log.exception("node %d: handler for %r raised", self.node_id, msg.topic)
            # The handler is done with it: a message kept alive by this loop's variables until
            # the next one would pin its buffers (a CUDA pool slot, an shm segment) meanwhile.
            del fn, msg
