"""Cut-through relaying: a relay forwards a large frame to the next host while its bytes still
arrive, instead of after the whole frame came in.

A relayed hop (:mod:`mq.fanout.relays`) carries the same body as the frame its relay receives: the
payload's buffers, each on a 64-byte boundary from the first, so the body's bytes are the same
in both frames and only the header in front differs (the hop's plan, its sender). A relay's
tcp link (:mod:`mq.backends.nng.links.tcp`) tells core when a large frame's header is in
(``Events.on_begun``); for a RELAY frame whose plan names peers on other hosts, :mod:`mq.fanout.relays`
watches the frame's :class:`Arrival` and sends each of those peers an :class:`ArrivingFrame`: its
own header, then the incoming body, each piece going out once it came in. With H hosts in a
chain the last one has the message about one transfer after the first, not H transfers.

Nothing else changes: the relay still delivers the whole frame to itself and its same-host
neighbours once it is in, acks only when its subtree acked, and a frame cut off upstream (its
sender's ABORT, a dropped link) is cut off downstream too (the tcp link's ABORT record), so no
host ever delivers part of a message.
"""

from __future__ import annotations

import time
from typing import Any

from mq.wire.codec import ALIGN, Frame
from mq.errors import ClosedError
from mq.node.waits import Waits

__all__ = ["AHEAD", "AHEAD_MIN", "LOOK_AHEAD_S", "Arrival", "ArrivingFrame", "body_offset", "header_end"]

#: The most a hop waits for beyond what it needs next (see ready_through): under a ms of a
#: fast link. On a slower one it waits for about LOOK_AHEAD_S of the frame's arrival instead
#: (at least AHEAD_MIN), so each hop of a chain adds about that much, not AHEAD's worth.
AHEAD = 2 << 20
AHEAD_MIN = 64 << 10
LOOK_AHEAD_S = 0.001


def header_end(frame: Any) -> int:
    """Where the header of a frame in the contiguous layout (:mod:`mq.wire.codec`) ends: its length
    (u32) and the header. Only the first 4 bytes need be in."""
    return 4 + int.from_bytes(memoryview(frame)[:4], "little")


def body_offset(frame: Any) -> int:
    """Where the first buffer of a frame starts: the header's end, padded to the alignment."""
    return (header_end(frame) + ALIGN - 1) & -ALIGN


class Arrival:
    """The bytes of one frame as its link receives them. The link's reader calls
    :meth:`advance` and :meth:`abort`; another thread :meth:`wait`\\ s for a prefix, through
    the waits of the node that :meth:`follow`\\ s it (so a sender lost meanwhile ends it)."""

    __slots__ = ("size", "filled", "_want", "_why", "_t0", "_filled0", "_waits", "_peer")

    def __init__(self, size: int, filled: int = 0):
        self.size = size
        self.filled = filled
        self._t0, self._filled0 = time.monotonic(), filled  # for the arrival rate (ahead)
        self._want = size + 1  # what a waiter waits for: the reader wakes it only then
        self._why: str | None = None
        self._waits = Waits()
        self._peer: int | None = None

    def follow(self, waits: Waits, peer: int) -> None:
        """Waits for this frame go through ``waits`` and end when ``peer`` (its sender) is lost."""
        self._waits, self._peer = waits, peer

    def advance(self, filled: int) -> None:
        """The first ``filled`` bytes are in (the reader's thread, per read: kept cheap)."""
        self.filled = filled
        if filled >= self._want:
            self._waits.wake(self)

    def abort(self, why: str) -> None:
        """The frame will never be whole (its sender dropped it, or the link broke)."""
        if self.filled < self.size:
            self._why = why
        self._waits.wake(self)

    def ahead(self) -> int:
        """Bytes worth waiting for past what a hop needs next: about LOOK_AHEAD_S of this
        frame's arrival so far, within [AHEAD_MIN, AHEAD]."""
        took = time.monotonic() - self._t0
        rate = (self.filled - self._filled0) / took if took > 0 else 0.0
        return min(AHEAD, max(AHEAD_MIN, int(rate * LOOK_AHEAD_S)))

    def wait(self, end: int, deadline: float) -> None:
        """Return once the first ``end`` bytes are in.

        Raises:
            ClosedError: the frame was cut off before that.
            PeerLost: its sender was lost meanwhile.
            Timeout: not by ``deadline`` (``time.monotonic()``).
        """
        end = min(end, self.size)
        if self.filled >= end:
            return

        def arrived() -> bool:
            if self.filled >= end:
                return True
            if self._why is not None:
                raise ClosedError(f"the relayed frame was cut off upstream: {self._why}")
            return False

        self._want = end
        try:
            self._waits.until(arrived, deadline, on=(self,), peers=() if self._peer is None else (self._peer,),
                              what=lambda: f"the relayed frame did not arrive in time ({self.filled} of "
                                           f"{self.size} bytes came)")
        finally:
            self._want = self.size + 1


class ArrivingFrame(Frame):
    """A hop frame whose body is the body of a frame still arriving (see the module docstring):
    ``buffers`` are views of the incoming frame, whose first buffer starts at ``body_at``. A link
    that sends it in pieces calls :meth:`ready_through` before each piece."""

    __slots__ = ("_arrival", "_shift")

    def __init__(self, kind: int, head: list[Any], buffers: list[Any], sizes: list[int],
                 arrival: Arrival, body_at: int):
        super().__init__(kind, head, buffers, sizes)
        self._arrival = arrival
        # Where a byte of this frame's body lies in the incoming one.
        self._shift = body_at - (self._offsets[0] if sizes else self.size)

    def ready_through(self, end: int, deadline: float) -> None:
        """Block until this frame's first ``end`` bytes can be read (see :meth:`Arrival.wait`).
        When it must wait, it waits for :meth:`Arrival.ahead` more: a wake-up per ms or per
        2 MiB, not per piece (each costs both threads a GIL hand-off)."""
        arrival = self._arrival
        end += self._shift
        if arrival.filled < end:
            arrival.wait(end + arrival.ahead(), deadline)
