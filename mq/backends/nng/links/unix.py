"""Same-host links over unix SOCK_SEQPACKET sockets: the nng transport's shm/ipc route.

Why not NNG's own ipc: an NNG message crosses three threads (the sender's, NNG's poller, NNG's
task thread) before the receiver's ``nng_recvmsg`` returns, and each hop is a futex wake and,
on a busy host, a context switch. Here the sender's ``send()`` wakes the receiving thread,
which waits in ``poll()`` on the socket itself: one hop. Measured with ``mq bench`` (see the
README), a same-host round trip of a small message takes about half what it took over NNG's
ipc, about what raw pynng (no envelope, no checks) takes.

Wire: a frame (the contiguous layout of :mod:`mq.wire.codec`) goes as one datagram, prefixed by its
length (u64, little-endian); a frame longer than :data:`DATAGRAM` - 8 bytes continues in
datagrams of at most :data:`DATAGRAM` bytes, each tagged ``01``. A send that times out with
part of a frame gone sends (now, or before its next frame) a ``02`` datagram: drop that frame.
SEQPACKET keeps datagrams whole and in order, and a connection belongs to one sender, so
frames of one link never interleave.

Who may connect: anyone on the host (an abstract socket has no permissions). A connection is
only a link: :class:`mq.node.core.MQ` takes no frame from it before a signed handshake frame bound
it to a peer, exactly as for NNG pipes. Abstract names vanish with the process, SIGKILL
included: nothing is left behind.
"""

from __future__ import annotations

import itertools
import socket
import struct
import time
from typing import Any, Callable

from mq.backends.nng.links.base import Receiver, Sender, listener
from mq.wire.codec import Frame, empty_buffer
from mq.errors import ProtocolError, Timeout
from mq.node import waits as node_waits
from mq.node.waits import Waits

DATAGRAM = 64 << 10  # one datagram; the kernel's default socket buffer holds three
_PREFIX = struct.Struct("<Q")
_MORE, _ABORT = b"\x01", b"\x02"  # the tag of a continuation datagram; drop the frame begun
_serial = itertools.count(1)


def listen(name: str) -> socket.socket:
    """A non-blocking SEQPACKET listener on the abstract name ``name`` (no leading NUL)."""
    return listener(socket.AF_UNIX, socket.SOCK_SEQPACKET, 0, "\0" + name)


class Inbound(Receiver):
    """One accepted connection: reads whole frames, a frame's datagrams reassembled."""

    __slots__ = ("_scratch", "_tag", "_buf", "_filled")

    def __init__(self, sock: socket.socket, max_frame: int, trusts: Callable[[Any], bool]):
        super().__init__(sock, max_frame, trusts, "unix", next(_serial))
        self._scratch = bytearray(DATAGRAM)
        self._tag = bytearray(1)
        self._buf: Any = None  # a frame in pieces, and how much of it came
        self._filled = 0

    def read(self) -> Any:
        """The next whole frame, or None when none is complete yet (nothing blocks).

        Raises:
            EOFError: the sender closed (or died).
            ProtocolError: a datagram that no frame can be made of (the link is unusable).
        """
        while True:
            buf = self._buf
            if buf is None:
                n = self._datagram([self._scratch], DATAGRAM)
                if n is None:
                    return None
                if n < _PREFIX.size:
                    raise ProtocolError(f"a {n}-byte datagram holds no frame length")
                (size,) = _PREFIX.unpack_from(self._scratch)
                self._check_size(size)
                first = n - _PREFIX.size
                if first > size or (first < size and n != DATAGRAM):
                    raise ProtocolError(f"frame of {size} bytes begins with a {first}-byte piece")
                if first == size:
                    return self._scratch[_PREFIX.size:n]  # a copy the frame's views own
                try:
                    self._buf = buf = empty_buffer(size)  # not zeroed: the frame fills it
                except MemoryError:  # e.g. many links each claiming a huge frame
                    raise ProtocolError(f"no memory for a frame of {size} bytes") from None
                buf[:first] = memoryview(self._scratch)[_PREFIX.size:n]
                self._filled = first
            want = min(DATAGRAM - 1, len(buf) - self._filled)
            n = self._datagram([self._tag, memoryview(buf)[self._filled:self._filled + want]], 1 + want)
            if n is None:
                return None
            tag = self._tag[0]
            if tag == _ABORT[0] and n == 1:
                self._buf = None  # the sender gave up on this frame (its send timed out)
                continue
            if tag != _MORE[0] or n - 1 != want:
                raise ProtocolError(f"a frame piece of {n} bytes (tag {tag}) where "
                                    f"{want + 1} were due")
            self._filled += want
            if self._filled == len(buf):
                self._buf = None
                return buf

    def _datagram(self, buffers: list[Any], room: int) -> int | None:
        """One datagram into ``buffers`` (``room`` bytes in all): its real length (MSG_TRUNC
        shows one longer than the room given), or None when none waits."""
        n = self._recv(buffers, socket.MSG_TRUNC)
        if n is not None and n > room:
            raise ProtocolError(f"a {n}-byte datagram, longer than the {room} bytes due")
        return n


def _connect(sock: socket.socket, address: str, timeout: float) -> None:
    """Connect, waiting out a full backlog: a unix connect past it fails at once (EAGAIN) where
    tcp would wait, and in a large job's join every node connects to the same member at once."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    sock.settimeout(timeout)
    while True:
        try:
            sock.connect(address)
            return
        except BlockingIOError:
            if time.monotonic() + pause > deadline:
                raise
            node_waits.sleep(pause)  # (a back-off)
            pause = min(2 * pause, 0.05)


class Outbound(Sender):
    """This node's link to one same-host peer: frames in order, several sending threads."""

    def __init__(self, name: str, timeout: float, lost: Callable[[], None], waits: Waits | None = None):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            _connect(sock, "\0" + name, timeout)
        except OSError:
            sock.close()
            raise
        super().__init__(sock, lost, waits)
        self._abort_due = False  # a frame was cut off by a timeout: the peer must drop its start

    def send(self, peer: int, frame: Frame, timeout: float) -> None:
        size = frame.size
        buf = bytearray(_PREFIX.size + size)
        _PREFIX.pack_into(buf, 0, size)
        frame.write_into(memoryview(buf)[_PREFIX.size:])
        if size <= DATAGRAM - _PREFIX.size and not self._abort_due and self._lock.acquire(False):
            # The common small frame, the link free and room in the socket: one sendmsg.
            try:
                self.sock.sendmsg([buf])
                return
            except BlockingIOError:
                pass  # full: wait for room below, as any frame does
            except OSError as exc:
                raise self._broken(exc) from None
            finally:
                self._let_go()
        deadline = time.monotonic() + timeout
        self._hold(peer, timeout)
        try:
            if len(buf) <= DATAGRAM and not self._abort_due:  # the common small frame: one datagram
                self._send(peer, [buf], deadline)
                return
            if self._abort_due:
                self._send(peer, [_ABORT], deadline)
                self._abort_due = False
            view = memoryview(buf)
            self._send(peer, [view[:DATAGRAM]], deadline)
            for start in range(DATAGRAM, len(buf), DATAGRAM - 1):
                try:
                    self._send(peer, [_MORE, view[start:start + DATAGRAM - 1]], deadline)
                except Timeout:
                    # Part of the frame left: the peer drops it on the abort mark, sent now or
                    # before the next frame. The caller's frame was not delivered, as Timeout says.
                    self._abort_due = True
                    try:
                        self.sock.sendmsg([_ABORT])
                        self._abort_due = False
                    except OSError:
                        pass
                    raise
        finally:
            self._let_go()

    def _send(self, peer: int, parts: list[Any], deadline: float) -> None:
        poller = None
        while True:
            try:
                self.sock.sendmsg(parts)  # one datagram: all of it or nothing
                return
            except BlockingIOError:
                pass
            except OSError as exc:
                raise self._broken(exc) from None
            poller = self._wait_writable(peer, deadline, poller)
