"""The transport interface: what a backend must do, and nothing more.

A transport moves frames (:class:`mq.wire.codec.Frame`) between this node and its peers. It knows
nothing about topics, calls, subscriptions, handshakes or shared memory: the node ("core":
:class:`mq.node.core.MQ` and its parts) owns all of that and holds one transport. Data paths
(:mod:`mq.datapaths.shm.pool`) ride inside frames as descriptors, so every transport carries them.

Contract (every method may be called from any thread unless it says otherwise):

``start(node) -> targets``
    Listen, fill ``addresses``, and return the targets to greet (``greet``) to join the job:
    addresses for NNG, ranks for torch RPC. ``node`` receives events (:class:`Events`): the
    node's :class:`mq.node.dispatch.Dispatch`, not the user's ``MQ``.
``greet(target, frame, token)``
    Send a HELLO frame to a target whose node id is not known yet. Best effort and
    non-blocking: the answer comes back as a frame whose HELLO_ACK payload echoes ``token``
    (``connect`` may then drop whatever it opened for the greeting). Greeting a target again
    replaces the earlier greeting (core re-greets targets that did not answer).
``connect(peer, info, route)``
    Open the data link to a peer that said HELLO (``info`` is its HELLO payload, ``route`` the
    route core chose). Idempotent for the same peer incarnation. Symmetric: both sides call it.
    Set ``connect_may_block`` when it can take seconds.
``disconnect(peer)``
    Close the link to ``peer`` now (core lost it): a ``send`` or ``request`` blocked on it
    returns at once.
``send(peer, frame, timeout) -> receipt | None``
    Move one frame to ``peer``, in order after every frame sent to it before, or raise
    :class:`~mq.errors.Timeout` (nothing sent) / :class:`~mq.errors.PeerLost` within ``timeout``.
    Returns a ``receipt()`` callable when the frame still references the caller's memory; the
    caller calls it before returning to the user (it waits until the peer has the bytes).
``read_in_caller(timeout, ready) -> bool``
    Optional: receive and deliver at most one frame in the calling thread (``recv()`` uses it
    to skip a thread hand-off), returning at once when ``ready()`` says what the caller waits
    for arrived meanwhile. False when the transport cannot.
``request(peer, frame, timeout) -> (header, buffers) | None``
    Optional (``answers_requests = True``): request and reply in one exchange. Move one REQ
    frame (inline buffers only: no shm descriptors) to ``peer``, whose transport hands it to
    its node's :meth:`Events.on_request` and carries the reply frame back as the answer; return
    that reply's ``(header, buffers)`` as :meth:`Events.on_frame` would get them, or None when
    the peer did not take the frame as a request (busy, or still joining): the caller then sends
    it as an ordinary frame. Not ordered against ``send``. Raises
    :class:`~mq.errors.Timeout` when no answer came within ``timeout`` (the peer may still run
    the handler), :class:`~mq.errors.PeerLost` at once when the link breaks or ``disconnect``
    is called for ``peer``, :class:`~mq.errors.ClosedError` when closed meanwhile, and
    :class:`~mq.errors.ProtocolError` when the peer refused it. Default: not supported.
``close(timeout)``
    Close every link within ``timeout`` seconds; never raises.

Native errors are mapped to :mod:`mq.errors` at one place in each transport.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Protocol

from mq.wire.codec import Frame
from mq.routing import Route

Receipt = Callable[[], object]  # waits until the peer has the frame; what it returns is ignored


class Events(Protocol):
    """What a transport reports to its node (:class:`mq.node.dispatch.Dispatch` implements it)."""

    max_frame_bytes: int
    secret: Any  # the job's mq.auth.Secret (None when insecure): sign what strangers could write
    #: the node's :class:`mq.node.waits.Waits`: a transport blocks only through it (a full link, no
    #: credit, the reader token), so its waits end when their peer is lost or the node stops
    waits: Any

    def trusts(self, link: Any) -> bool:
        """Whether ``link`` (a hashable key naming a connection: an NNG pipe, a unix or tcp
        link, an RPC rank) passed the handshake. Only then may the transport parse its frames
        (``split``) and hand them to ``on_frame``; before, every frame goes whole to
        ``on_handshake``, and a link reader allocates at most :data:`mq.wire.handshake.MAX_FRAME`
        bytes for one."""

    def on_handshake(self, frame: Any, link: Any) -> bool:
        """A frame (bytes-like, the contiguous layout, unparsed) from a link that ``trusts``
        does not. Only :func:`mq.wire.handshake.parse` reads it. False: refused and counted; the
        transport closes the link if it can. Same threads as ``on_frame``."""

    def on_frame(self, header: Any, buffers: list[Any], link: Any) -> None:
        """A frame arrived on a trusted ``link``, so core can tie it to the peer that proved
        itself on that link. Runs on the transport's I/O thread (or a ``read_in_caller``
        caller)."""

    def on_request(self, header: Any, buffers: list[Any], link: Any) -> Frame | None:
        """A REQ frame that wants its reply in the same exchange (``Transport.request``): check
        ``link`` as ``on_frame`` does, run the ``on`` handler in the calling thread and return
        the reply frame (REP_OK, or REP_ERR when the handler raised or none is registered).
        None: not taken here (no handler slot free, or the link is still joining); the
        requester then sends it as an ordinary frame. Raises :class:`~mq.errors.ProtocolError`
        when the frame is refused (malformed, unauthenticated link, spoofed sender: counted).
        Runs user code: call it only from a thread that may block for the handler's duration
        and that no other frame needs."""

    def on_begun(self, frame: Any, watch: Callable[[], Any], link: Any) -> None:
        """A large frame began arriving on a trusted ``link``: ``frame`` is its whole buffer,
        filled only past the header so far, and ``watch()`` its :class:`mq.fanout.cut_through.Arrival`,
        to follow the rest (:mod:`mq.fanout.cut_through`). Nothing is decoded for good here: the frame
        comes to ``on_frame`` once whole. Same threads as ``on_frame``; must not block. Only
        transports whose links read frames in pieces call it."""

    def lend(self, nbytes: int) -> Any:
        """Writable room for an arriving frame of ``nbytes`` that this node passes on to its own
        host (a relayed publish): a slot of its shm pool, so the frame goes on by handle, not
        by a copy. None when there is none now (never blocks): the transport's own buffer then.
        Called from the I/O thread, only for frames on a trusted link."""

    def on_link_lost(self, peer: int, why: str) -> None:
        """The link to ``peer`` broke (its process died, or it closed)."""

    def on_dropped(self, why: str, cause: str = "malformed") -> None:
        """A frame could not even be laid out (truncated, overrunning: ``malformed``) or was
        larger than this node accepts (``oversized``): count it, log it (rate-limited)."""


class Transport:
    """Base of every transport; see the module docstring for the contract."""

    #: backend name (``nng``, ``torchrpc``, ``inproc``)
    name = "abstract"
    #: route kinds this transport can carry by itself (the shm data path adds ``shm``)
    routes: frozenset[str] = frozenset()
    #: core may use the shm data path with same-host peers (False when a user forced a route)
    shm_ok = True
    #: the codec keeps tensors as tensors (torch RPC sends them as RPC tensors)
    keeps_tensors = False
    #: the transport implements ``request`` (request and reply in one exchange)
    answers_requests = False
    #: ``connect`` may block for seconds (a tcp connect to a port that drops SYNs): core then
    #: answers HELLOs (unproven, so a stranger's may be forged) off the I/O thread
    connect_may_block = False
    #: this node's addresses by kind, filled by start()
    addresses: dict[str, str]

    def start(self, node: Events) -> Iterable[Any]:
        raise NotImplementedError

    def greet(self, target: Any, frame: Frame, token: str) -> None:
        raise NotImplementedError

    def connect(self, peer: int, info: dict[str, Any], route: Route) -> None:
        raise NotImplementedError

    def disconnect(self, peer: int) -> None:
        raise NotImplementedError

    def send(self, peer: int, frame: Frame, timeout: float) -> Receipt | None:
        raise NotImplementedError

    def read_in_caller(self, timeout: float, ready: Callable[[], bool]) -> bool:
        return False

    def greeting_connected(self, token: str) -> bool | None:
        """Whether the greeting ``token`` reached its target's process (a connection is up),
        for an error that names the stage a join stopped at; None: this transport cannot tell."""
        return None

    def native_drops(self) -> dict[str, int]:
        """Frames (or connections) the transport's own library dropped before the node saw
        them, cumulative, by cause; the node counts them like its own drops. Default: none."""
        return {}

    def streams_to(self, peer: int) -> bool:
        """Whether ``send`` to ``peer`` can take a :class:`mq.fanout.cut_through.ArrivingFrame` (a frame
        whose body still arrives): its link sends in pieces and waits for each."""
        return False

    def request(self, peer: int, frame: Frame, timeout: float) -> tuple[Any, list[Any]] | None:
        raise NotImplementedError(f"the {self.name} transport does not answer requests in one exchange")

    def close(self, timeout: float) -> None:
        raise NotImplementedError

    def reply_target(self, info: dict[str, Any]) -> Any:
        """What to ``greet`` to reach a node that said HELLO (``info``, unproven) without
        connecting to it: core tells a node it refuses why. None: this transport cannot."""
        return None
