"""Links between hosts over plain TCP sockets of mq's own: the nng transport's tcp route.

Why not NNG's tcp: as over its ipc, an NNG message crosses three threads on each side (the
caller's, NNG's poller, NNG's task thread), each hop a futex wake. Here the sender's ``send()``
writes the socket and the receiving thread, waiting in ``poll()`` on it, reads the frame
itself: one hop, as :mod:`mq.backends.nng.links.unix` does on one host. NNG keeps the node's
advertised port (``listen_to``, ``--ports``): joining (HELLO) goes there, and the HELLO carries
this node's link address, an ephemeral port on the same interface. A peer that cannot open it
(a firewall that lets only the advertised port in) falls back to NNG's tcp, with a warning.

Wire: TCP is a byte stream, so frames go as records, each a 16-byte head
``<tag u8, flags u8, 2 zero bytes, length u32, frame size u64>`` (little-endian) and ``length``
bytes: ``BEGIN`` (1) starts a frame of ``frame size`` bytes with its first piece, ``MORE`` (2)
carries the next piece, ``ABORT`` (3, no bytes) drops the frame begun. ``flags`` is 0 but on a
BEGIN whose frame the receiver passes on to its own host (:data:`SHARED`, a relayed publish):
that frame lands in the receiver's shm pool when it has room (``lend``), so its same-host
subscribers get it by handle, not by a copy. A piece is at most :data:`PIECE`
bytes. A send that times out half-way through a piece owes the peer the rest of it: the link
sends that rest and an ABORT (now if it can, else before its next frame), so the receiver never
delivers part of a frame and the stream never loses its framing.

Who may connect: anyone who reaches the port. A connection is only a link: :class:`mq.node.core.MQ`
takes no frame from it before a signed handshake frame bound it to a peer, as for NNG pipes.
A record that breaks the rules (an unknown tag, a frame over ``max_frame_bytes``, a piece past
its frame) closes that connection and is counted, like a malformed frame.
"""

from __future__ import annotations

import itertools
import socket
import struct
import time
from typing import Any, Callable

from mq.backends.nng.links import warm
from mq.backends.nng.links.base import Receiver, Sender, listener
from mq.wire.codec import RELAY, Frame, empty_buffer
from mq.fanout.cut_through import Arrival, header_end
from mq.errors import MQError, ProtocolError, Timeout
from mq.node.waits import Waits

# At most this much of a frame per record: what a timed-out send may still owe. Measured across
# a veth pair (two network namespaces), 640 MB frames, p50 of 6, three interleaved rounds:
# 64 KiB 224-283 ms, 128 KiB 178-224, 256 KiB 152-180, 512 KiB 150-229, 1 MiB 203-315,
# 4 MiB 226-270 (over loopback larger pieces won: 4 MiB 126-136 ms, 256 KiB 192-435).
PIECE = 256 << 10
COPY_MAX = 64 << 10  # frames up to this size are copied into one record; larger ones gathered
BEGUN_MIN = 4 * PIECE  # frames from this size are announced when their header is in (cut-through)
_HEAD = struct.Struct("<BBxxIQ")  # tag, flags (BEGIN only), piece length, frame size (BEGIN only)
BEGIN, MORE, ABORT = 1, 2, 3
SHARED = 1  # BEGIN's flag: a frame this link's receiver passes on to same-host peers (RELAY)
_ABORT_RECORD = _HEAD.pack(ABORT, 0, 0, 0)
_serial = itertools.count(1)


def split_address(address: str) -> tuple[str, int]:
    """``tcp://host:port`` -> (host, port); IPv6 hosts in brackets."""
    host, _, port = address.partition("://")[2].rpartition(":")
    return host.strip("[]"), int(port)


def listen(host: str) -> socket.socket:
    """A non-blocking TCP listener on an ephemeral port of ``host`` (the node's interface)."""
    wildcard = host in ("", "*", "0.0.0.0", "::")
    family, kind, proto, _, addr = socket.getaddrinfo(None if wildcard else host, 0, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    return listener(family, kind, proto, addr)


class Begun:
    """What :meth:`Inbound.read` gives, once per large frame, when the frame's header is in:
    ``frame`` is the whole frame's buffer, filled up to past the header so far, and ``watch()``
    the frame's :class:`~mq.fanout.cut_through.Arrival` (made on the first call) to follow the rest."""

    __slots__ = ("frame", "watch")

    def __init__(self, frame: Any, watch: Any):
        self.frame = frame
        self.watch = watch


class Inbound(Receiver):
    """One accepted connection: reads its records, a frame's pieces straight into the frame."""

    __slots__ = ("announce", "lend", "_head", "_head_got", "_buf", "_filled", "_piece_end", "_begun_at", "_arrival")

    def __init__(self, sock: socket.socket, max_frame: int, trusts: Callable[[Any], bool]):
        super().__init__(sock, max_frame, trusts, "tcp", next(_serial))
        self.announce = False  # read() gives a Begun for large frames (their reader follows them)
        self.lend: Callable[[int], Any] | None = None  # room for a SHARED frame (the shm pool's)
        self._head = bytearray(_HEAD.size)
        self._head_got = 0
        self._buf: Any = None  # the frame being filled, how much of it came, and
        self._filled = 0                    # where the current piece ends
        self._piece_end = 0
        self._begun_at = 0  # filled bytes at which to announce the frame begun (0: never)
        self._arrival: Arrival | None = None  # someone follows the frame being filled

    def read(self) -> Any:
        """The next whole frame, or None when none is complete yet (nothing blocks, and nothing
        is kept back: what the socket holds past one frame stays in the socket, so a level-
        triggered poll() still sees it); with ``announce``, a :class:`Begun` once a large
        frame's header is in.

        Raises:
            EOFError: the sender closed (or died).
            ProtocolError: a record no frame can be made of (the link is unusable).
        """
        while True:
            buf = self._buf
            if buf is not None and self._filled < self._piece_end:
                n = self._recv([memoryview(buf)[self._filled:self._piece_end]])
                if n is None:
                    return None
                self._filled += n
                if self._arrival is not None:
                    self._arrival.advance(self._filled)
                if self._filled == len(buf):
                    self._buf = self._arrival = None
                    return buf
                if self._begun_at and self._filled >= self._begun_at:
                    begun = self._begun()
                    if begun is not None:
                        return begun
                continue
            n = self._recv([memoryview(self._head)[self._head_got:]])
            if n is None:
                return None
            self._head_got += n
            if self._head_got == _HEAD.size:
                self._head_got = 0
                self._record(*_HEAD.unpack(self._head))

    def _begun(self) -> Begun | None:
        """The frame's header is in (``_begun_at`` reached): announce it, or wait for more."""
        buf = self._buf
        if self._begun_at == 4:  # its length is in: the whole header ends there
            self._begun_at = header_end(buf)
            if self._begun_at >= len(buf):
                self._begun_at = 0  # no body to follow
            elif self._filled < self._begun_at:
                return None
        self._begun_at = 0
        return Begun(buf, self._watch)

    def _watch(self) -> Arrival:
        """The frame being filled, followed from now on (the reader's thread)."""
        if self._arrival is None:
            self._arrival = Arrival(len(self._buf), self._filled)
        return self._arrival

    def _cut_off(self, why: str) -> None:
        if self._arrival is not None:
            self._arrival.abort(why)
            self._arrival = None

    def _record(self, tag: int, flags: int, length: int, size: int) -> None:
        """Act on a record's head: start a frame, a piece, or drop the frame begun."""
        buf = self._buf
        if flags and (tag != BEGIN or flags != SHARED):
            raise ProtocolError(f"a record with tag {tag} and flags {flags}")
        if tag == BEGIN:
            if buf is not None:
                raise ProtocolError("a frame begins inside another")
            self._check_size(size)
            if not 0 < length <= min(size, PIECE):
                raise ProtocolError(f"frame of {size} bytes begins with a {length}-byte piece")
            try:
                # A large frame lands in the shm pool (SHARED, when it has room) or a warm slab
                # (no page faults while it arrives), else in a fresh buffer, not zeroed: the
                # frame fills it.
                lend = self.lend if flags and size >= warm.MIN_SIZE else None
                self._buf = (lend and lend(size)) or warm.shared().take(size) or empty_buffer(size)
            except MemoryError:  # e.g. many links each claiming a huge frame
                raise ProtocolError(f"no memory for a frame of {size} bytes") from None
            self._filled, self._piece_end = 0, length
            self._begun_at = 4 if self.announce and size >= BEGUN_MIN else 0
        elif tag == MORE:
            if buf is None or not 0 < length <= min(PIECE, len(buf) - self._filled) or size:
                raise ProtocolError(f"a {length}-byte piece where "
                                    f"{0 if buf is None else len(buf) - self._filled} bytes were due")
            self._piece_end = self._filled + length
        elif tag == ABORT and not length and not size:
            self._buf = None  # the sender gave up on this frame (its send timed out)
            self._filled = self._piece_end = self._begun_at = 0
            self._cut_off("its sender dropped it")
        else:
            raise ProtocolError(f"a record with tag {tag}, length {length}, size {size}")

    def close(self) -> None:
        self._cut_off("the link to its sender closed")
        super().close()


class Outbound(Sender):
    """This node's link to one peer on another host (or in another network namespace)."""

    def __init__(self, address: str, timeout: float, lost: Callable[[], None], waits: Waits | None = None):
        sock = socket.create_connection(split_address(address), timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # frames are whole already
        except OSError:
            sock.close()
            raise
        super().__init__(sock, lost, waits)
        self._owed: list[Any] = []  # the rest of a record a timed-out send began
        self._abort_due = False  # and the frame it belonged to must be dropped at the peer

    def send(self, peer: int, frame: Frame, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        size = frame.size
        buf = records = None
        if size <= COPY_MAX:  # small: one copy, one record, usually one syscall
            buf = bytearray(_HEAD.size + size)
            _HEAD.pack_into(buf, 0, BEGIN, 0, size, size)
            frame.write_into(memoryview(buf)[_HEAD.size:])
        else:  # large: the frame's own buffers, gathered by the kernel (no copy, no page faults)
            records = _records(frame.parts(), size, SHARED if frame.kind == RELAY else 0)
        self._hold(peer, timeout)
        try:
            if self._owed or self._abort_due:
                self._settle(peer, deadline)
            if buf is not None:
                sent = 0
                if not self._owed:
                    try:
                        sent = self.sock.send(buf)
                    except BlockingIOError:
                        pass
                    except OSError as exc:
                        raise self._broken(exc) from None
                if sent < len(buf):
                    self._record(peer, [memoryview(buf)[sent:]], deadline, begun=sent > 0)
                return
            # A frame relayed while it arrives (mq.fanout.cut_through): each piece once it is in.
            ready = getattr(frame, "ready_through", None)
            for i, record in enumerate(records or ()):
                if ready is not None:
                    self._wait_ready(peer, ready, min((i + 1) * PIECE, size), deadline, begun=i > 0)
                self._record(peer, record, deadline, begun=i > 0)
        finally:
            self._let_go()

    def _wait_ready(self, peer: int, ready: Callable[[int, float], None], end: int, deadline: float,
                    begun: bool) -> None:
        """Wait until the frame's first ``end`` bytes can be sent; if they never can, drop what
        of the frame went already (the peer gets the ABORT) and raise."""
        try:
            ready(end, deadline)
        except MQError:
            if begun:
                self._abort_due = True
                try:
                    self._settle(peer, time.monotonic())
                except Timeout:
                    pass  # sent before the next frame
            raise

    def _record(self, peer: int, parts: list[Any], deadline: float, begun: bool) -> None:
        """Send (the rest of) one record, or raise Timeout. ``begun``: bytes of this frame went
        already, so a timeout leaves the frame for the peer to drop."""
        total = sum(len(p) for p in parts)
        self._owed = parts
        try:
            self._drain(peer, deadline)
        except Timeout:
            if not begun and sum(len(p) for p in self._owed) == total:
                self._owed = []  # nothing of this frame left: nothing is owed, nothing to drop
            else:
                # Part of the frame left: the peer drops it on the abort, sent (after the rest
                # of this record) now or before the next frame. The caller's frame was not
                # delivered, as Timeout says.
                self._abort_due = True
                try:
                    self._settle(peer, time.monotonic())
                except Timeout:
                    pass
            raise

    def _settle(self, peer: int, deadline: float) -> None:
        """Finish what a timed-out send left: the rest of its record, then the abort."""
        self._drain(peer, deadline)
        if self._abort_due:
            self._owed, self._abort_due = [memoryview(_ABORT_RECORD)], False
            self._drain(peer, deadline)

    def _drain(self, peer: int, deadline: float) -> None:
        """Send all of ``_owed`` (a partial send leaves the rest in it), or raise Timeout."""
        owed = self._owed
        poller = None
        while owed:
            try:
                n = self.sock.sendmsg(owed)
            except BlockingIOError:
                n = 0
            except OSError as exc:
                raise self._broken(exc) from None
            while n:
                head = owed[0]
                if n >= len(head):
                    n -= len(head)
                    owed.pop(0)
                else:
                    owed[0] = memoryview(head)[n:]
                    n = 0
            if owed:
                poller = self._wait_writable(peer, deadline, poller)


def _records(parts: list[memoryview], size: int, flags: int = 0) -> list[list[Any]]:
    """A frame's parts cut into records of at most :data:`PIECE` bytes, each led by its head
    (``flags`` on the first)."""
    pieces: list[list[memoryview]] = [[]]
    room = PIECE
    for part in parts:
        while len(part):
            if not room:
                pieces.append([])
                room = PIECE
            pieces[-1].append(part[:room])
            taken = min(room, len(part))
            part, room = part[taken:], room - taken
    return [[_HEAD.pack(MORE if i else BEGIN, 0 if i else flags, sum(len(v) for v in piece), 0 if i else size),
             *piece] for i, piece in enumerate(pieces)]
