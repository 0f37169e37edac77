"""What every link of mq's own shares: a non-blocking listener, the receiving side of an
accepted connection (:class:`Receiver`: frame size bounds before and after the handshake) and
the sending side of an outgoing one (:class:`Sender`: one frame at a time, deadlines, the
peer's loss reported once).

The links (:mod:`mq.backends.nng.links.unix` on one host, :mod:`mq.backends.nng.links.tcp` between
hosts) subclass these with their own wire format; the nng transport reads and writes them.
"""

from __future__ import annotations

import errno
import itertools
import select
import socket
import threading
import time
from typing import Any, Callable

from mq.wire import handshake
from mq.errors import ClosedError, Oversized
from mq.node.waits import LIVE_OR_STOPPING, Waits

_SERIALS = itertools.count()  # one per outgoing link of this process: its identity beside its fd


def listener(family: int, kind: int, proto: int, address: Any) -> socket.socket:
    """A non-blocking socket listening on ``address`` (closed again if that fails)."""
    sock = socket.socket(family, kind | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC, proto)
    try:
        sock.bind(address)
        # The kernel's most (net.core.somaxconn): a job's nodes all connect to a new member at
        # once, and a unix connect past a full backlog fails at once (EAGAIN), not later.
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


class Receiver:
    """The receiving side of one accepted link: ``read()`` gives its next whole frame.

    Until ``trusts(link)`` says the link passed the handshake, a frame may be at most
    :data:`mq.wire.handshake.MAX_FRAME` bytes: a stranger cannot make this node allocate more."""

    __slots__ = ("sock", "fd", "link", "max_frame", "_limit", "_trusts")

    def __init__(self, sock: socket.socket, max_frame: int, trusts: Callable[[Any], bool],
                 family: str, serial: int):
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()
        self.link = (family, serial)  # what core binds to a peer at its handshake
        self.max_frame = min(max_frame, handshake.MAX_FRAME)
        self._limit = max_frame  # once trusted
        self._trusts = trusts

    def read(self) -> Any:
        raise NotImplementedError

    def _check_size(self, size: int) -> None:
        """Raise Oversized unless a frame of ``size`` bytes may come on this link now."""
        if size > self.max_frame and self.max_frame < self._limit and self._trusts(self.link):
            self.max_frame = self._limit
        if size > self.max_frame == self._limit:
            raise Oversized(f"frame of {size} bytes exceeds max_frame_bytes={self.max_frame}")
        if size > self.max_frame:
            raise Oversized(f"frame of {size} bytes from a link that has not authenticated (at "
                            f"most {self.max_frame} before the handshake)")

    def _recv(self, buffers: list[Any], flags: int = 0) -> int | None:
        """Bytes read into ``buffers``, or None when none wait.

        Raises:
            EOFError: the sender closed (or died).
        """
        try:
            n = self.sock.recvmsg_into(buffers, 0, flags)[0]
        except BlockingIOError:
            return None
        except ConnectionError:
            raise EOFError from None
        if n == 0:
            raise EOFError
        return n

    def close(self) -> None:
        self.sock.close()


class Sender:
    """The sending side of one link over a non-blocking socket: one frame at a time (several
    threads may send), waits for room until the caller's deadline, and reports a peer gone.

    ``lost()`` is called (once) when a send finds the peer gone, before the send raises
    :class:`ClosedError`: the transport tells core, which then says PeerLost with what it knows."""

    def __init__(self, sock: socket.socket, lost: Callable[[], None], waits: Waits | None = None):
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()
        self.serial = next(_SERIALS)
        self._lost = lost
        self._lock = threading.Lock()  # the link, one frame at a time: only tried, waited on through waits
        self.waits = waits or Waits()
        self.closed = False

    def _hold(self, peer: int, timeout: float) -> None:
        """Take the link for one frame (release with :meth:`_let_go`), or raise Timeout (or
        PeerLost: the node's waits end when the peer is lost)."""
        if self._lock.acquire(False):
            return
        self.waits.until(lambda: self._lock.acquire(False), time.monotonic() + max(timeout, 0.0), on=(self,),
                         peers=(peer,), states=LIVE_OR_STOPPING,
                         what=f"node {peer} did not take the message within {timeout:g}s: other threads' "
                              "frames to it are still going out; pass timeout= to wait longer")

    def _wait_writable(self, peer: int, deadline: float, poller: Any = None) -> Any:
        """The peer's socket buffer is full (it reads slowly): wait for room, for its end, or
        for the node to lose the peer (its heartbeat: a frozen peer keeps its socket open)."""
        self.waits.for_fd(self.fd, select.POLLOUT, deadline, peers=(peer,), states=LIVE_OR_STOPPING,
                          what=f"node {peer} did not take the message in time: its queue is full "
                               "(slow receiver) or it is unreachable; pass timeout= to wait longer")
        if self.closed:
            raise ClosedError("the link was closed while sending (its peer is gone, or the queue is stopping)")
        return None

    def _broken(self, exc: OSError) -> Exception:
        if not self.closed and exc.errno != errno.EBADF:
            self.closed = True
            self._lost()  # core marks the peer lost; the caller's ClosedError becomes PeerLost
        return ClosedError(f"the link was closed while sending: {exc.strerror}")

    def _let_go(self) -> None:
        """Release the link after one frame; close its socket if close() came meanwhile (it
        could not: we held the link)."""
        self._lock.release()
        if self.closed and self._lock.acquire(False):
            try:
                self.sock.close()  # (idempotent: close() may have closed it meanwhile)
            finally:
                self._lock.release()
        if id(self) in self.waits.watched:  # another thread's frame waits for the link
            self.waits.wake(self)

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a sender waiting in poll()
        except OSError:
            pass
        # The fd is closed only while no sender uses it: a sender polling a closed fd whose number
        # was reused (a new link, a pipe) would wait on somebody else's file until its deadline.
        if self._lock.acquire(False):
            try:
                self.sock.close()
            finally:
                self._lock.release()
        # else the sender holding it closes it as it lets go (_let_go)
