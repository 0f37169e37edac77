"""How the nng transport lays frames into NNG messages, and reads them back.

A frame is the contiguous layout of :mod:`mq.wire.codec`, written straight into one NNG message
(one copy). Behind a busy pipe, small frames share a message: frames back to back, each on a
64-byte (:data:`mq.wire.codec.ALIGN`) boundary, zero padding between them
(:func:`mq.wire.codec.split_batch` reads them), frames of at most :data:`BATCH_FRAME_MAX` bytes up
to :data:`BATCH_BYTES` a message. A received message is split in place: arrays and tensors are
views of NNG's buffer, freed with the last view.
"""

from __future__ import annotations

from typing import Any

import pynng
from pynng import ffi, lib
from pynng.exceptions import check_err

from mq.wire.codec import ALIGN, ZERO_PAD, Frame
from mq.errors import ClosedError

# Behind a busy pipe, frames up to this size share one NNG message, up to BATCH_BYTES a message.
BATCH_FRAME_MAX = 16 << 10
BATCH_BYTES = 256 << 10


def batch_message(frames: list[bytearray]) -> Any:
    """One NNG message holding ``frames`` back to back, each on a 64-byte boundary."""
    size = 0
    for f in frames:
        size = ((size + ALIGN - 1) & -ALIGN) + len(f)
    msgp = ffi.new("nng_msg **")
    check_err(lib.nng_msg_alloc(msgp, size))
    out = memoryview(ffi.buffer(lib.nng_msg_body(msgp[0]), size))
    pos = 0
    for f in frames:
        start = (pos + ALIGN - 1) & -ALIGN
        out[pos:start] = ZERO_PAD[:start - pos]  # no stale heap bytes on the wire
        out[start:start + len(f)] = f
        pos = start + len(f)
    return msgp[0]


def raise_send_error(rv: int) -> None:
    try:
        check_err(rv)
    except pynng.Closed:
        raise ClosedError("the link was closed while sending (the queue is stopping)") from None


def new_msg(frame: Frame) -> Any:
    """A fresh NNG message holding the frame in the contiguous layout (one copy)."""
    msgp = ffi.new("nng_msg **")
    check_err(lib.nng_msg_alloc(msgp, frame.size))
    msg = msgp[0]
    frame.write_into(memoryview(ffi.buffer(lib.nng_msg_body(msg), frame.size)))
    return msg


def send_msg(sock: pynng.Socket, frame: Frame) -> None:
    """Hand the frame to NNG, waiting up to the socket's send timeout."""
    msg = new_msg(frame)
    rv = lib.nng_sendmsg(sock.socket, msg, 0)
    if rv != 0:
        lib.nng_msg_free(msg)  # on failure the message is still ours
        check_err(rv)


def send_unless_closed(sock: pynng.Socket, frame: Frame) -> None:
    """:func:`send_msg`, dropping the frame when another thread closed the socket meanwhile."""
    try:
        send_msg(sock, frame)
    except pynng.Closed:
        pass


def msg_view(msg: Any) -> memoryview:
    """A writable view of a received NNG message; the message is freed with the last view."""
    size = lib.nng_msg_len(msg)
    body = ffi.gc(lib.nng_msg_body(msg), lambda _p, m=msg: lib.nng_msg_free(m))
    return memoryview(ffi.buffer(body, size))
