"""Calls: the corr -> future table of this node's calls, and serving its ``on`` handlers.

:class:`Calls` owns the pending calls (a REP frame resolves one: :meth:`Calls.on_reply`), the
handlers registered with ``on``, the thread pool that serves REQ frames and the slots that
bound it, and calls in one exchange (``Transport.request``). Data flows::

    facade.call -> Calls.pending / Calls.request -> sender | transport.request
    dispatch: REQ -> Calls.submit -> pool thread -> handler -> sender (REP)
              REP -> Calls.on_reply -> the caller's future (its wait: Calls.answered)
    transport.request on the peer -> dispatch.on_request -> Calls.serve_now (its thread)
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import traceback
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Iterator

from mq.wire.codec import KIND_NAMES, REP_ERR, REP_OK, Codec, Envelope, Frame
from mq.errors import ClosedError, EncodeError, MQError, PeerLost, ProtocolError, RemoteError, Timeout
from mq.node.lifecycle import Lifecycle
from mq.node.peers import Peer, PeerTable
from mq.node.sender import Sender
from mq.node.stats import Refusals, Stats
from mq.transport import Transport
from mq.node.waits import LIVE_OR_STOPPING, Waits

log = logging.getLogger("mq")

LINK_GRACE_S = 1.0  # see Calls.link_lost


class Calls:
    """The calls and call handlers of node ``node_id`` (see the module docstring).

    Args:
        handler_threads: threads serving ``on`` handlers; as many more may serve requests in
            one exchange (on the transport's threads), and 4x as many REQ frames may queue.
    """

    def __init__(self, node_id: int, sender: Sender, peers: PeerTable, transport: Transport,
                 codec: Codec, life: Lifecycle, stats: Stats, refusals: Refusals, waits: Waits, *,
                 handler_threads: int, timeout: float):
        self.node_id = node_id
        self._sender = sender
        self._peers = peers
        self._transport = transport
        self._codec = codec
        self._life = life
        self._stats = stats
        self._refusals = refusals
        self._waits = waits
        self._timeout = timeout
        self._threads = handler_threads
        self._calls: dict[int, tuple[int, Future]] = {}
        # Stopping (see farewell): the calls we serve per peer (corr ids), the peers we said
        # goodbye to (their later REQs are dropped: they failed those calls at our BYE), and
        # per peer the calls it promised to answer in its own goodbye.
        self._serving: dict[int, set[int]] = {}
        self._farewelled: set[int] = set()
        self._promised: dict[int, set[int]] = {}
        self._ids = itertools.count(1)
        self._servers: dict[str, Callable[[Any], Any]] = {}
        self._lock = threading.Lock()
        # REQ frames queued or running on the pool, at most handler_slots: a full pool holds up
        # the reader (backpressure), which tells liveness (reader_busy) that silence proves nothing.
        self.handler_slots = handler_threads * 4
        self.queued = 0
        self._requests_running = 0  # handlers running in a transport's thread (serve_now)
        self.reader_busy: Callable[[], Any] = contextlib.nullcontext  # set by the node (liveness)
        self._executor: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ calling
    def new_corr(self) -> int:
        return next(self._ids)

    @contextlib.contextmanager
    def pending(self, peer: int, corr: int) -> Iterator[Future]:
        """The future a REP frame for ``corr`` from ``peer`` resolves, while inside; waits
        ``on`` it are woken when it is done."""
        fut: Future = Future()
        fut.add_done_callback(self._waits.wake)
        with self._lock:
            self._calls[corr] = (peer, fut)
        try:
            yield fut
        finally:
            with self._lock:
                self._calls.pop(corr, None)

    def answered(self, peer: int, corr: int, fut: Future) -> Callable[[], bool]:
        """What a caller waits for: True once call ``corr`` to ``peer`` is answered (or failed);
        raises PeerLost once the peer is lost, unless it promised the answer in its goodbye
        (then :meth:`link_lost` ends the call if the answer never comes)."""
        def settled() -> bool:
            if fut.done():
                return True
            p = self._peers.get(peer)
            if p is not None and p.lost and corr not in self._promised.get(peer, ()):
                raise PeerLost(f"node {peer} {p.lost}")
            return False
        return settled

    def request(self, peer: int, frame: Frame, deadline: float) -> Envelope | None:
        """A call in one exchange (``Transport.request``): its checked reply (REP_OK/REP_ERR),
        or None when the peer did not take it as a request (the caller sends it as an ordinary
        frame). Calls travel inline this way, also to a peer on the shm route: the request is
        one exchange and the peer's transport moves the bytes (TensorPipe has its own
        same-host channels); descriptors would need a second message to give the slots back.
        Losing the peer meanwhile ends the exchange in the transport, which says how."""
        p = self._sender.checked_peer(peer, frame, "call", max(0.0, deadline - time.monotonic()))
        if self._sender.by_descriptor(peer, frame):
            return None  # GPU tensors to an nvlink peer go by CUDA IPC descriptor, as a REQ frame
        left = deadline - time.monotonic()
        if left <= 0:
            raise FutureTimeout()
        try:
            with self._waits.depend((peer,)):  # probed while we wait: a frozen peer is judged silent
                reply = self._transport.request(peer, frame, left)
        except Timeout:
            raise FutureTimeout() from None  # the caller words it
        except MQError:
            if p.lost:  # the link broke because the peer died or left
                raise PeerLost(f"node {peer} {p.lost}") from None
            raise
        if reply is None:
            return None
        self._stats.sent += 1
        p.last_sent = time.monotonic()
        try:
            env = self._codec.decode(*reply)
        except ProtocolError as exc:
            self._refusals.refused(exc)
            raise
        if env.kind not in (REP_OK, REP_ERR) or env.corr != frame.head[5] or env.sender != peer:
            self._refusals.dropped(f"node {peer} answered a request with a {KIND_NAMES[env.kind]} "
                                   f"frame of call {env.corr} from node {env.sender}")
            raise ProtocolError(f"node {peer} answered call {frame.head[5]} with something else")
        self._stats.received += 1
        p.last_seen = p.last_traffic = time.monotonic()
        return env

    def on_reply(self, env: Envelope) -> None:
        """A REP frame (dispatch): resolve its call, or count it when nobody waits any more."""
        with self._lock:
            entry = self._calls.get(env.corr)
        if entry is None:
            self._stats.dropped_unexpected_reply += 1  # a reply after its call timed out
            return
        _peer, fut = entry
        try:
            if env.kind == REP_OK:
                fut.set_result(env.payload)
            else:
                fut.set_exception(remote_error(env))
        except InvalidStateError:  # the call already failed (peer lost, stop) or timed out
            self._stats.dropped_unexpected_reply += 1

    def promised(self, peer: int, corrs: Any) -> None:
        """``peer`` said goodbye and will still answer these calls of ours (they reached it
        before it began to stop)."""
        if isinstance(corrs, list):
            with self._lock:
                self._promised[peer] = {c for c in corrs if type(c) is int}

    def link_lost(self, peer: int) -> None:
        """The link to ``peer`` is gone for good: the answers it promised in its goodbye get a
        moment's grace (they may still wait unread on the other link of the pair), then fail."""
        with self._lock:
            promised = self._promised.get(peer)
            pending = [fut for corr, (p, fut) in self._calls.items() if p == peer and corr in (promised or ())]
        if promised is None:
            return
        # The promise holds through the grace (a caller woken by the loss keeps waiting).
        timer = threading.Timer(LINK_GRACE_S, self._break_promise, (peer, promised, pending))
        timer.daemon = True
        timer.start()

    def _break_promise(self, peer: int, promised: set[int], pending: list[Future]) -> None:
        with self._lock:
            if self._promised.get(peer) is promised:  # (not a later goodbye of a new incarnation)
                del self._promised[peer]
        _fail_all(pending, PeerLost(f"node {peer} left before answering the call "
                                    "(its stop(timeout=...) ran out)"))

    # ------------------------------------------------------------------ stopping
    def farewell(self, peer: int) -> list[int]:
        """We say goodbye to ``peer`` now: the calls of its we serve (we answer them before
        closing; it waits for those), and from now on its REQs are dropped (it fails them at
        our BYE: their handlers never run)."""
        with self._lock:
            self._farewelled.add(peer)
            return sorted(self._serving.get(peer, ()))

    def _admit(self, env: Envelope) -> bool:
        """Record a REQ we will serve, unless we said goodbye to its sender (then counted)."""
        with self._lock:
            if env.sender not in self._farewelled:
                self._serving.setdefault(env.sender, set()).add(env.corr)
                return True
        self._refusals.discarded("stopping", f"call {env.topic!r} from node {env.sender}, which came "
                                 "after this node said goodbye (the caller got PeerLost)")
        return False

    def _served(self, env: Envelope) -> None:
        with self._lock:
            self._serving.get(env.sender, set()).discard(env.corr)
        self._waits.wake(self)

    def serving(self) -> int:
        """Calls being served (queued or running): stop() lets them answer."""
        with self._lock:
            return sum(len(s) for s in self._serving.values())

    # ------------------------------------------------------------------ serving
    def serve(self, topic: str, fn: Callable[[Any], Any]) -> None:
        with self._lock:
            self._servers[topic] = fn

    def start(self) -> None:
        self._executor = ThreadPoolExecutor(self._threads, thread_name_prefix=f"mq{self.node_id}-on")

    def has_room(self) -> bool:
        """Whether a REQ frame can be queued without waiting for a handler slot."""
        return self.queued < self.handler_slots

    def submit(self, env: Envelope, wait: bool) -> None:
        """Serve a REQ frame on the pool. ``handler_slots`` bound queued calls; while they are
        all taken the reader waits here (backpressure). A thread reading for itself must not
        ``wait`` for handlers, which may wait for it: its request queues past the bound (one
        per read at most)."""
        if not self._admit(env):
            return
        if wait and not self.has_room():
            try:
                with self.reader_busy():  # frames wait unread meanwhile: nobody's silence counts
                    self._waits.until(self.has_room, None, on=(self,), states=LIVE_OR_STOPPING)
            except ClosedError:
                self._served(env)  # stopped while it waited: its caller learns it from our goodbye
                return
        with self._lock:
            self.queued += 1
        try:
            assert self._executor is not None
            self._executor.submit(self._serve, env)
        except RuntimeError:  # pool shut down: we are stopping
            self._served(env)
            self._slot_free()

    def _slot_free(self) -> None:
        with self._lock:
            self.queued -= 1
        self._waits.wake(self)

    def serve_now(self, env: Envelope, peer: Peer) -> Frame | None:
        """Serve a request in this thread (``on_request``) and return its reply; None when
        ``handler_threads`` already run this way (the requester sends an ordinary frame)."""
        with self._lock:
            if self._requests_running >= self._threads:
                return None
            self._requests_running += 1
        try:
            if not self._admit(env):
                return None
            self._stats.received += 1
            peer.last_seen = peer.last_traffic = time.monotonic()
            try:
                return self._answer(env)
            finally:
                self._served(env)
        finally:
            with self._lock:
                self._requests_running -= 1

    def finish(self, deadline: float) -> None:
        """After saying goodbye: let the calls we serve (they reached us before, and their
        callers wait for them) send their answers, until ``deadline``; a caller whose handler
        still runs then gets a REP_ERR saying so, not a silent PeerLost."""
        try:
            self._waits.until(lambda: not self.serving(), deadline, on=(self,), states=LIVE_OR_STOPPING)
        except MQError:
            pass  # (out of time, or closed): the late ones are answered below
        with self._lock:
            late = [(peer, corr) for peer, corrs in self._serving.items() for corr in corrs]
        for peer, corr in late:
            error = {"type": "mq.ClosedError", "message": f"node {self.node_id} stopped before its handler "
                     "answered (its stop(timeout=...) ran out)", "traceback": ""}
            try:
                self._sender.deliver_to([peer], self._sender.encode(REP_ERR, "", error, corr),
                                        time.monotonic() + 0.2)
            except MQError:
                pass

    def close(self) -> None:
        # (A call inside ``transport.request`` learns its fate from the transport instead.)
        with self._lock:
            pending = [fut for _peer, fut in self._calls.values()]
        _fail_all(pending, ClosedError("the queue was stopped while the call was pending"))
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _answer(self, env: Envelope) -> Frame:
        """Run the ``on`` handler of a REQ and encode its reply: REP_OK with the result, or
        REP_ERR with the error's type and message (also when no handler is registered, or the
        result cannot be encoded)."""
        with self._lock:
            fn = self._servers.get(env.topic)
        try:
            if fn is None:
                raise LookupError(f"node {self.node_id} has no handler for {env.topic!r}; "
                                  f"register one with q.on({env.topic!r}, fn)")
            kind, answer = REP_OK, fn(env.payload)
        except Exception as exc:
            kind, answer = REP_ERR, _error_payload(exc)
        try:
            return self._sender.encode(kind, env.topic, answer, env.corr)
        except EncodeError as exc:
            return self._sender.encode(REP_ERR, env.topic, _error_payload(exc), env.corr)

    def _serve(self, env: Envelope) -> None:
        try:
            self._sender.deliver_to([env.sender], self._answer(env), time.monotonic() + self._timeout)
        except MQError as exc:
            log.warning("node %d: could not answer call %r from node %d: %s",
                        self.node_id, env.topic, env.sender, exc)
        finally:
            self._served(env)
            self._slot_free()


def _fail_all(futures: list[Future], error: MQError) -> None:
    for fut in futures:
        try:
            fut.set_exception(error)
        except InvalidStateError:  # answered meanwhile
            pass


def remote_error(env: Envelope) -> RemoteError:
    """The error a REP_ERR frame carries, rebuilt from its text."""
    p = env.payload if isinstance(env.payload, dict) else {}
    return RemoteError(str(p.get("type", "?")), str(p.get("message", "")), str(p.get("traceback", "")),
                       peer=env.sender)


def _error_payload(exc: BaseException) -> dict[str, str]:
    # Only text crosses the wire: the caller rebuilds a RemoteError, never the remote object.
    return {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }
