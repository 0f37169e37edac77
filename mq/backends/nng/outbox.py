"""One peer's outgoing NNG pipe and the frames queued behind it (:class:`Outbox`).

A frame goes to NNG at once while its pipe is free; behind a busy pipe, frames wait in the
peer's outbox (``send_buffer`` of them before ``send`` waits) and a flusher thread sends them,
small ones many to one NNG message (:mod:`mq.backends.nng.wire`), so a stream pays NNG's
per-message cost per batch.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import pynng
from pynng import ffi, lib

from mq.backends.nng.wire import (BATCH_BYTES, BATCH_FRAME_MAX, batch_message, new_msg,
                                  raise_send_error)
from mq.wire.codec import ALIGN, Frame
from mq.errors import ClosedError
from mq.node.waits import LIVE_OR_STOPPING, Waits

log = logging.getLogger("mq.nng")


class Outbox:
    """One peer's outgoing pipe. A frame goes straight to NNG while the link is idle (its
    latency is one NNG send). Behind a busy pipe, or in a stream (a frame within
    ``batch_window`` of the previous one, nothing received in between), frames queue here, at
    most ``limit`` before ``send`` waits, and a flusher thread sends them in order, small ones
    many to an NNG message (the contiguous layout back to back, :func:`mq.wire.codec.split_batch`):
    a stream pays NNG's per-message cost once per batch instead of once per frame.

    Small queued frames are kept as bytes, not NNG messages: making one is a C call that lets
    the flusher take the GIL, which splits a stream into batches of one or two."""

    def __init__(self, sock: pynng.Push0, limit: int, name: str, batch_window: float = 0.0,
                 received: Callable[[], int] = lambda: 0, waits: Waits | None = None):
        self.sock = sock
        self.limit = limit
        self.name = name
        self.batch_window = batch_window
        self.received = received  # the transport's count of messages received
        self._last_sent = -1.0  # perf_counter() of the last send, and what had been received then
        self._last_received = -1
        self.cond = threading.RLock()  # its state; waits go through the node's (on the outbox)
        self.waits = waits or Waits()
        # Copies of the frames, oldest first: bytearrays (small, batched) or NNG messages (sent alone).
        self.pending: list[Any] = []
        self.flushing = False  # the flusher holds a batch taken from ``pending``
        self.closed = False
        self._flusher: threading.Thread | None = None
        self._flusher_idle = False  # (kept for the tests' view of it)
        self.queued = 0  # frames that went through ``pending`` (the rest went straight to NNG)

    def send(self, peer: int, frame: Frame, timeout: float) -> None:
        if len(self.pending) >= self.limit and not self.closed:  # behind a full outbox: wait for room
            self.waits.until(lambda: len(self.pending) < self.limit or self.closed, time.monotonic() + timeout,
                             on=(self,), peers=(peer,), states=LIVE_OR_STOPPING,
                             what=f"node {peer} did not take the message within {timeout:g}s: its queue is "
                                  "full (slow receiver) or it is unreachable; pass timeout= to wait longer")
        with self.cond:
            streaming = False
            if self.batch_window:  # off by default: no clock read per send then
                now, received = time.perf_counter(), self.received()
                streaming = now - self._last_sent < self.batch_window and received == self._last_received
                self._last_sent, self._last_received = now, received
            if not self.pending and not self.flushing and not self.closed and not streaming:
                msg = new_msg(frame)
                rv = lib.nng_sendmsg(self.sock.socket, msg, lib.NNG_FLAG_NONBLOCK)
                if rv == 0:
                    return
                if rv != lib.NNG_EAGAIN:
                    lib.nng_msg_free(msg)  # on failure the message is still ours
                    raise_send_error(rv)
                self._queue(msg)  # the pipe is busy (or still connecting)
                return
            if self.closed:
                raise ClosedError("the link was closed while sending (the queue is stopping)")
            self._queue(frame.to_bytes() if frame.size <= BATCH_FRAME_MAX else new_msg(frame))

    def _queue(self, item: Any) -> None:
        self.pending.append(item)
        self.queued += 1
        if self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_loop, daemon=True, name=self.name)
            self._flusher.start()
        else:  # else it finds the frame when its send returns
            self.waits.wake(self)

    def _flush_loop(self) -> None:
        # No send timeout: a blocking send with one arms NNG's timer thread per message; close()
        # ends a send waiting on a peer that stopped reading.
        self.sock.send_timeout = -1
        while True:
            if not self.pending and not self.closed:
                self._flusher_idle = True
                self.waits.pause(lambda: self.pending or self.closed, 1.0, on=(self,))
                self._flusher_idle = False
                continue
            with self.cond:
                if self.closed:
                    return
                batch = self._take_batch()
                self.flushing = True
            self.waits.wake(self)  # room in ``pending`` for waiting senders
            msg = batch_message(batch) if type(batch[0]) is bytearray else batch[0]
            rv = lib.nng_sendmsg(self.sock.socket, msg, 0)
            with self.cond:
                self.flushing = False
                if rv != 0:
                    lib.nng_msg_free(msg)
                    if rv != lib.NNG_ECLOSED:
                        log.warning("%s: dropped %d frame(s): %s", self.name, len(batch),
                                    ffi.string(lib.nng_strerror(rv)).decode())
                    self._close_locked()
            self.waits.wake(self)  # (a close lingering for the last frames)
            if rv != 0:
                return

    def _take_batch(self) -> list[Any]:
        """The oldest pending frame, plus the small ones after it that fit one message."""
        n = 1
        if type(self.pending[0]) is bytearray:
            total = len(self.pending[0])
            for item in self.pending[1:]:
                if type(item) is not bytearray:
                    break
                total = ((total + ALIGN - 1) & -ALIGN) + len(item)
                if total > BATCH_BYTES:
                    break
                n += 1
        batch, self.pending = self.pending[:n], self.pending[n:]
        return batch

    def close(self, linger: float = 0.0) -> None:
        """Close now, dropping what is still queued; with ``linger``, first let the flusher send
        it for up to that many seconds (our own stop: answers queued last still go out)."""
        if linger > 0:
            self.waits.pause(lambda: self.closed or not (self.pending or self.flushing), linger, on=(self,))
        with self.cond:
            self._close_locked()
        self.sock.close()  # ends a flusher's send waiting on the peer

    def _close_locked(self) -> None:
        self.closed = True
        for item in self.pending:
            if type(item) is not bytearray:
                lib.nng_msg_free(item)
        self.pending = []
        self.waits.wake(self)
