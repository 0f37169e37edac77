"""The one error tree of mq. Every error a user can see is an :class:`MQError`.

::

    MQError
    ├── ConfigError(ValueError)      bad input: option, address, device map, mq type
    ├── EncodeError(TypeError)       payload the codec cannot carry (no silent pickling)
    ├── ProtocolError                a peer broke the wire protocol (bad frame, duplicate id)
    ├── Timeout(TimeoutError)        a bounded wait ran out
    ├── PeerLost(ConnectionError)    the peer died or became unreachable
    ├── RemoteError                  the peer's handler raised; type and message kept
    ├── StreamError                  a stream's counts do not add up (lost, reordered, restarted)
    ├── Undelivered                  stop() closed before peers confirmed every frame (counts)
    └── ClosedError                  you used a queue after stop()

Backends translate their native errors into this tree at one place each.
"""

from __future__ import annotations


class MQError(Exception):
    """Root of every error raised by mq."""


class ConfigError(MQError, ValueError):
    """Bad input: the message names what was wrong and how to fix it."""


class EncodeError(MQError, TypeError):
    """A payload holds a value the codec cannot carry."""


class ProtocolError(MQError):
    """A peer sent something that breaks the wire protocol. ``cause`` names the counter a
    dropped frame goes under (:class:`mq.node.stats.Stats`)."""

    cause = "malformed"


class Oversized(ProtocolError):
    """A frame larger than the receiver accepts (``max_frame_bytes``; before the handshake,
    :data:`mq.wire.handshake.MAX_FRAME`)."""

    cause = "oversized"


class PeerLeft(ProtocolError):
    """A frame from a peer that left or was lost, whose buffers went with it (its pool)."""

    cause = "peer_left"


class Timeout(MQError, TimeoutError):
    """A bounded wait ran out."""


class PeerLost(MQError, ConnectionError):
    """The peer died or can no longer be reached."""


class ClosedError(MQError):
    """The queue was stopped by this process."""


class Undelivered(MQError):
    """``stop()`` ran out of time before peers confirmed every frame this node sent them.

    Attributes:
        counts: ``{peer node id: frames sent to it that it never confirmed}``. Those frames
            may or may not have arrived; the others did.
    """

    def __init__(self, counts: dict[int, int], waited: float, lost: dict[int, str] | None = None):
        self.counts = dict(counts)
        self.waited = waited
        self.lost = dict(lost or {})  # peers lost while they had frames unconfirmed: why
        names = ", ".join(f"node {p}: {n}" + (f", which {self.lost[p]}" if p in self.lost else "")
                          for p, n in sorted(self.counts.items()))
        slow = [p for p in self.counts if p not in self.lost]
        advice = (" Give the receivers time to read (stop(timeout=...)), or q.flush(peer) before stopping"
                  if slow else "")
        head = f"stop() waited {waited:g}s and" if slow else "stop():"
        super().__init__(f"{head} {sum(self.counts.values())} frame(s) were never confirmed ({names}); they "
                         f"may be lost.{advice}")

    def __reduce__(self):  # keep picklable for multiprocessing result passing
        return (Undelivered, (self.counts, self.waited, self.lost))


class StreamError(MQError):
    """A :class:`mq.Stream` did not deliver exactly what its senders sent: a count differs, a
    sender left without closing or restarted as a new process. ``report`` holds the details."""

    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report or {}


class RemoteError(MQError):
    """The remote handler raised.

    Attributes:
        remote_type: the qualified name of the exception type raised remotely.
        remote_message: ``str()`` of the remote exception.
        remote_traceback: the formatted remote traceback (text only, never unpickled).
    """

    def __init__(self, remote_type: str, remote_message: str, remote_traceback: str = "", peer: int | None = None):
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback
        self.peer = peer
        where = f" on node {peer}" if peer is not None else ""
        super().__init__(f"{remote_type}: {remote_message} (raised by the handler{where})")

    def __reduce__(self):  # keep picklable for multiprocessing result passing
        return (RemoteError, (self.remote_type, self.remote_message, self.remote_traceback, self.peer))


__all__ = [
    "ClosedError",
    "ConfigError",
    "EncodeError",
    "MQError",
    "PeerLost",
    "ProtocolError",
    "RemoteError",
    "StreamError",
    "Timeout",
    "Undelivered",
]
