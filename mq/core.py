"""The MQ interface every backend implements, and everything both backends share.

A backend only moves frames: it implements :meth:`MQ._start`, :meth:`MQ._close_transport`,
:meth:`MQ._transmit` and :meth:`MQ._peer_transport_ready`. Everything a user sees — queues,
subscriptions, handlers, calls, peer bookkeeping, timeouts — lives here, once.

Data flows one way::

    publish/send/call -> codec.encode -> backend._transmit(peer) -> wire
    wire -> backend I/O thread -> codec.decode -> MQ._deliver -> recv queue | handler | call future

Thread rules: ``_deliver`` runs on the backend's I/O thread and never runs user code there;
subscription handlers run on one dispatcher thread (so they see messages in order), ``on``
handlers run on a small pool (so a slow call does not stall the link).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import traceback
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from mq.codec import BYE, MSG, REP_ERR, REP_OK, REQ, SUBS, Codec, Envelope
from mq.errors import ClosedError, ConfigError, EncodeError, MQError, PeerLost, RemoteError, Timeout
from mq.routing import Route

log = logging.getLogger("mq")

DEFAULT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Message:
    """A received message: ``topic``, ``payload`` and the ``sender``'s node id."""

    topic: str
    payload: Any
    sender: int


@dataclass
class Peer:
    """What this node knows of another node."""

    node_id: int
    labels: frozenset[str] = frozenset()
    subscriptions: frozenset[str] = frozenset()
    route: Route | None = None
    info: dict[str, Any] = field(default_factory=dict)  # backend-specific (addresses, locality)
    lost: str | None = None  # why the peer is gone (None while it is alive)


@dataclass
class Stats:
    """Counters a user can read with :meth:`MQ.stats` (dropped frames are never silent)."""

    sent: int = 0
    received: int = 0
    dropped_malformed: int = 0
    dropped_oversized: int = 0
    dropped_unexpected_reply: int = 0


class MQ:
    """A node's message queue. Create one with :func:`mq.create`.

    Args:
        node_id: this node's unique integer id.
        labels: roles of this node (``{"learner"}``); peers find it with ``peers(label=)``.
        queue_size: bound of the receive queue; a full queue makes senders wait (backpressure).
        timeout: default timeout in seconds of ``send``/``publish``/``call``/``recv``.
        allow_pickle: let the codec pickle what it cannot carry, and unpickle it on receive.
            Only between trusted peers; off by default.
        handler_threads: threads serving ``on`` handlers.
    """

    backend_name = "abstract"

    def __init__(self, node_id: int, labels: Iterable[str] | str | None = None, *,
                 queue_size: int = 1024, timeout: float = DEFAULT_TIMEOUT_S,
                 allow_pickle: bool = False, handler_threads: int = 4,
                 codec: Codec | None = None):
        if not isinstance(node_id, int) or isinstance(node_id, bool) or node_id < 0:
            raise ConfigError(f"node_id must be a non-negative int, got {node_id!r}")
        if queue_size < 1:
            raise ConfigError(f"queue_size must be >= 1, got {queue_size}")
        if timeout is None or timeout <= 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.node_id = node_id
        self.labels = frozenset([labels] if isinstance(labels, str) else (labels or ()))
        self.timeout = float(timeout)
        self.codec = codec or Codec(allow_pickle=allow_pickle)
        self._inbox: BoundedQueue = BoundedQueue(queue_size)
        self._handler_queue: BoundedQueue = BoundedQueue(queue_size)
        self._subscriptions: dict[str, Callable[[Message], Any] | None] = {}
        self._servers: dict[str, Callable[[Any], Any]] = {}
        self._peers: dict[int, Peer] = {}
        self._peers_changed = threading.Condition()
        self._calls: dict[int, tuple[int, Future]] = {}
        self._call_ids = itertools.count(1)
        self._seq = itertools.count()
        self._lock = threading.RLock()
        self._handler_slots = threading.BoundedSemaphore(handler_threads * 4)
        self._pool: ThreadPoolExecutor | None = None
        self._dispatcher: threading.Thread | None = None
        self._handler_threads = handler_threads
        self._state = "new"  # new -> listening -> stopped
        self._stats = Stats()

    # ------------------------------------------------------------------ lifecycle
    def listen(self) -> "MQ":
        """Open the transport and join the peers. Idempotent."""
        if self._state == "listening":
            return self
        if self._state == "stopped":
            raise ClosedError("this queue was stopped; create a new one with mq.create(...)")
        self._pool = ThreadPoolExecutor(self._handler_threads, thread_name_prefix=f"mq{self.node_id}-on")
        self._dispatcher = threading.Thread(target=self._dispatch_loop, daemon=True,
                                            name=f"mq{self.node_id}-handlers")
        self._state = "listening"
        self._dispatcher.start()
        try:
            self._start()
        except BaseException:
            self.stop(timeout=2.0)
            raise
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Leave the job: tell peers, close the transport. Returns within ``timeout`` seconds
        (plus a little), even when peers died."""
        if self._state != "listening":
            self._state = "stopped"
            return
        self._state = "stopping"
        deadline = time.monotonic() + timeout
        self._farewell(deadline)
        try:
            self._close_transport(max(0.1, deadline - time.monotonic()))
        except Exception:  # never let a broken transport keep the node alive
            log.exception("node %d: error while closing the transport", self.node_id)
        self._state = "stopped"
        self._fail_calls(lambda peer: ClosedError("the queue was stopped while the call was pending"))
        with self._peers_changed:
            self._peers_changed.notify_all()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._dispatcher is not None:
            self._dispatcher.join(max(0.0, deadline - time.monotonic()))

    def _farewell(self, deadline: float) -> None:
        """Tell every live peer we leave and wait for its answer: links are FIFO, so an answer
        means everything sent before it was received, and closing loses nothing."""
        waiting = []
        for peer in self._live_peers():
            corr = next(self._call_ids)
            fut: Future = Future()
            with self._lock:
                self._calls[corr] = (peer, fut)
            try:
                bye = self._encode(BYE, "", None, corr)
                self._transmit(peer, bye, max(0.0, min(1.0, deadline - time.monotonic())))
                waiting.append((corr, fut))
            except Exception as exc:  # a dead peer must not delay our stop
                log.debug("node %d: no farewell to node %d: %s", self.node_id, peer, exc)
                with self._lock:
                    self._calls.pop(corr, None)
        for corr, fut in waiting:
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic() - 0.5))
            except Exception:
                pass
            with self._lock:
                self._calls.pop(corr, None)

    def __enter__(self) -> "MQ":
        return self.listen()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._state == "listening"

    # ------------------------------------------------------------------ subscriptions
    def subscribe(self, topic: str, fn: Callable[[Message], Any] | None = None) -> None:
        """Receive ``topic``: into :meth:`recv`, or by calling ``fn(message)`` off the I/O thread."""
        _check_topic(topic)
        with self._lock:
            self._subscriptions[topic] = fn
        self._announce_subscriptions()

    def unsubscribe(self, topic: str) -> None:
        with self._lock:
            self._subscriptions.pop(topic, None)
        self._announce_subscriptions()

    def subscriptions(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._subscriptions)

    def _announce_subscriptions(self) -> None:
        if self._state != "listening":
            return  # announced in the handshake instead
        topics = sorted(self.subscriptions())
        for peer in self._live_peers():
            try:
                self._send_frame(peer, SUBS, "", topics, timeout=self.timeout)
            except MQError as exc:
                log.warning("node %d: could not tell node %d about subscriptions: %s",
                            self.node_id, peer, exc)

    # ------------------------------------------------------------------ sending
    def send(self, peer: int, topic: str, payload: Any, *, timeout: float | None = None) -> None:
        """Send to one peer by node id. Ordered and lossless per sender->receiver pair.

        Raises:
            Timeout: the peer did not join, or its queue stayed full, for ``timeout`` seconds.
            PeerLost: the peer died or left.
            EncodeError: the payload holds something the codec cannot carry.
        """
        _check_topic(topic)
        timeout = self._timeout(timeout)
        self._wait_peer(peer, timeout)
        self._send_frame(peer, MSG, topic, payload, timeout=timeout)

    def publish(self, topic: str, payload: Any, *, timeout: float | None = None) -> list[int]:
        """Send to every peer subscribed to ``topic``; returns their node ids.

        Peers that have not joined yet do not receive it: use :meth:`wait_for_subscribers`.
        The payload is encoded once and shared by all peers.
        """
        _check_topic(topic)
        timeout = self._timeout(timeout)
        targets = [p.node_id for p in self._peer_list() if topic in p.subscriptions and not p.lost]
        if not targets:
            return []
        encoded = self._encode(MSG, topic, payload)
        for peer in targets:
            self._transmit_checked(peer, encoded, timeout)
        return targets

    def call(self, peer: int, topic: str, payload: Any = None, *, timeout: float | None = None) -> Any:
        """Call the handler a peer registered with :meth:`on` and return its result.

        Raises:
            RemoteError: the handler raised (its type and message are kept).
            Timeout: no answer within ``timeout`` seconds.
            PeerLost: the peer died before answering.
        """
        _check_topic(topic)
        timeout = self._timeout(timeout)
        deadline = time.monotonic() + timeout
        self._wait_peer(peer, timeout)
        corr = next(self._call_ids)
        fut: Future = Future()
        with self._lock:
            self._calls[corr] = (peer, fut)
        try:
            self._send_frame(peer, REQ, topic, payload, timeout=max(0.0, deadline - time.monotonic()), corr=corr)
            return fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            raise Timeout(f"node {peer} did not answer call {topic!r} within {timeout:g}s "
                          "(pass timeout= to wait longer)") from None
        finally:
            with self._lock:
                self._calls.pop(corr, None)

    def on(self, topic: str, fn: Callable[[Any], Any]) -> None:
        """Serve :meth:`call` on ``topic``: ``fn(payload)`` returns the answer."""
        _check_topic(topic)
        if not callable(fn):
            raise ConfigError(f"on({topic!r}, fn): fn must be callable, got {type(fn).__name__}")
        with self._lock:
            self._servers[topic] = fn

    # ------------------------------------------------------------------ receiving
    def recv(self, timeout: float | None = None) -> Message:
        """Next message of a subscribed topic (or sent to this node) without a handler.

        Raises:
            Timeout: nothing arrived within ``timeout`` seconds (default: the queue's timeout).
        """
        timeout = self._timeout(timeout)
        if self._state not in ("listening",) and self._inbox.empty():
            raise ClosedError("recv() on a queue that is not listening: use `with q:` or q.listen()")
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._inbox.get_nowait()
            except queue.Empty:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout(f"no message within {timeout:g}s")
            # Read the transport in this thread when the backend can: no hand-off from an I/O
            # thread, which is a large part of a small message's latency.
            if not self._read_in_caller(left):
                try:
                    return self._inbox.get(timeout=left)
                except queue.Empty:
                    raise Timeout(f"no message within {timeout:g}s") from None

    # ------------------------------------------------------------------ peers
    def peers(self, label: str | None = None) -> list[int]:
        """Node ids of live peers, optionally only those with ``label``."""
        return sorted(p.node_id for p in self._peer_list()
                      if not p.lost and (label is None or label in p.labels))

    def routes(self) -> dict[int, Route]:
        """The route to each live peer, e.g. ``{1: Route(kind="ipc", ...)}``."""
        return {p.node_id: p.route for p in self._peer_list() if not p.lost and p.route}

    def wait_for_peers(self, count: int | None = None, *, ids: Iterable[int] | None = None,
                       label: str | None = None, timeout: float | None = None) -> list[int]:
        """Block until ``count`` peers (with ``label``) or the peers ``ids`` have joined."""
        want = set(ids or ())

        def ready() -> bool:
            have = set(self.peers(label))
            return want <= have and (count is None or len(have) >= count)

        self._wait(ready, timeout, lambda: (f"peers {sorted(want)} / count {count} (label={label}) "
                                            f"did not join; have {self.peers(label)}"))
        return self.peers(label)

    def wait_for_subscribers(self, topic: str, count: int = 1, *, timeout: float | None = None) -> list[int]:
        """Block until ``count`` live peers subscribe to ``topic``; returns their ids."""

        def subs() -> list[int]:
            return sorted(p.node_id for p in self._peer_list() if topic in p.subscriptions and not p.lost)

        self._wait(lambda: len(subs()) >= count, timeout,
                   lambda: f"{count} subscriber(s) of {topic!r} did not appear; have {subs()}")
        return subs()

    def stats(self) -> Stats:
        return self._stats

    # ------------------------------------------------------------------ backend hooks
    def _start(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _close_transport(self, timeout: float) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _transmit(self, peer: int, encoded: Any, timeout: float) -> None:  # pragma: no cover
        """Move one encoded frame to ``peer`` or raise Timeout/PeerLost within ``timeout``."""
        raise NotImplementedError

    def _read_in_caller(self, timeout: float) -> bool:
        """Receive and deliver at most one frame in the calling thread, waiting up to
        ``timeout``. Backends that cannot return False (recv() then waits on the queue)."""
        return False

    def _encode(self, kind: int, topic: str, payload: Any, corr: int = 0) -> Any:
        """Backends may override to encode for their wire (the default: one contiguous frame)."""
        return self.codec.encode(kind, topic, self.node_id, next(self._seq), corr, payload)

    # ------------------------------------------------------------------ peer bookkeeping (backends call these)
    def _peer_joined(self, peer: Peer) -> None:
        with self._peers_changed:
            old = self._peers.get(peer.node_id)
            if old is not None and old.lost is None and old.info.get("incarnation") != peer.info.get("incarnation"):
                log.warning("node %d: node %d rejoined as a new process", self.node_id, peer.node_id)
            self._peers[peer.node_id] = peer
            self._peers_changed.notify_all()
        log.debug("node %d: peer %d joined via %s", self.node_id, peer.node_id, peer.route)
        # The handshake carried our subscriptions as they were then; send the current set on the
        # new link so a subscribe() racing with the join is never lost.
        if self.subscriptions():
            try:
                self._send_frame(peer.node_id, SUBS, "", sorted(self.subscriptions()), timeout=self.timeout)
            except MQError as exc:
                log.warning("node %d: could not send subscriptions to node %d: %s", self.node_id, peer.node_id, exc)

    def _peer_lost(self, node_id: int, why: str) -> None:
        with self._peers_changed:
            peer = self._peers.get(node_id)
            if peer is None or peer.lost:
                return
            peer.lost = why
            self._peers_changed.notify_all()
        log.info("node %d: peer %d lost: %s", self.node_id, node_id, why)
        self._fail_calls(lambda p: PeerLost(f"node {p} {why}") if p == node_id else None)

    def _deliver(self, env: Envelope) -> None:
        """Route one decoded frame. Runs on the backend's I/O thread: never runs user code."""
        self._stats.received += 1
        if env.kind == MSG:
            msg = Message(env.topic, env.payload, env.sender)
            with self._lock:
                fn = self._subscriptions.get(env.topic)
            if fn is not None:
                self._put_blocking(self._handler_queue, (fn, msg))
            else:
                self._put_blocking(self._inbox, msg)
        elif env.kind == REQ:
            self._handler_slots.acquire()  # bounds queued calls; released when served
            try:
                assert self._pool is not None
                self._pool.submit(self._serve, env)
            except RuntimeError:  # pool shut down: we are stopping
                self._handler_slots.release()
        elif env.kind in (REP_OK, REP_ERR):
            with self._lock:
                entry = self._calls.get(env.corr)
            if entry is None:
                self._stats.dropped_unexpected_reply += 1  # a reply after its call timed out
                return
            peer, fut = entry
            try:
                if env.kind == REP_OK:
                    fut.set_result(env.payload)
                else:
                    p = env.payload if isinstance(env.payload, dict) else {}
                    fut.set_exception(RemoteError(str(p.get("type", "?")), str(p.get("message", "")),
                                                  str(p.get("traceback", "")), peer=env.sender))
            except InvalidStateError:  # the call already failed (peer lost, stop) or timed out
                self._stats.dropped_unexpected_reply += 1
        elif env.kind == SUBS:
            topics = env.payload if isinstance(env.payload, list) else []
            with self._peers_changed:
                peer = self._peers.get(env.sender)
                if peer is not None:
                    peer.subscriptions = frozenset(t for t in topics if isinstance(t, str))
                    self._peers_changed.notify_all()
        elif env.kind == BYE:
            try:  # answer first: the peer waits for it before closing its links
                self._transmit(env.sender, self._encode(REP_OK, "", None, env.corr), 1.0)
            except Exception as exc:
                log.debug("node %d: could not answer the farewell of node %d: %s", self.node_id, env.sender, exc)
            self._peer_lost(env.sender, "stopped (it called stop())")
        else:
            self._on_control(env)

    def _on_control(self, env: Envelope) -> None:
        """Backend-specific control frames (handshakes)."""

    # ------------------------------------------------------------------ internals
    def _serve(self, env: Envelope) -> None:
        try:
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
                self._send_frame(env.sender, kind, env.topic, answer, timeout=self.timeout, corr=env.corr)
            except EncodeError as exc:
                self._send_frame(env.sender, REP_ERR, env.topic, _error_payload(exc),
                                 timeout=self.timeout, corr=env.corr)
        except MQError as exc:
            log.warning("node %d: could not answer call %r from node %d: %s",
                        self.node_id, env.topic, env.sender, exc)
        finally:
            self._handler_slots.release()

    def _dispatch_loop(self) -> None:
        while self._state in ("new", "listening") or not self._handler_queue.empty():
            try:
                fn, msg = self._handler_queue.get(timeout=0.1)
            except queue.Empty:
                if self._state not in ("new", "listening"):
                    return
                continue
            try:
                fn(msg)
            except Exception:
                log.exception("node %d: handler for %r raised", self.node_id, msg.topic)

    def _put_blocking(self, q: "BoundedQueue", item: Any) -> None:
        # Block the I/O thread while the queue is full: the transport stops reading and the
        # sender feels backpressure. Wake up now and then to notice stop().
        while not q.put(item, timeout=0.2):
            if self._state != "listening":
                return

    def _send_frame(self, peer: int, kind: int, topic: str, payload: Any, *, timeout: float,
                    corr: int = 0) -> None:
        self._transmit_checked(peer, self._encode(kind, topic, payload, corr), timeout)

    def _transmit_checked(self, peer: int, encoded: Any, timeout: float) -> None:
        if self._state != "listening":
            raise ClosedError("send on a queue that is not listening: use `with q:` or q.listen()")
        p = self._peers.get(peer)
        if p is None:
            raise PeerLost(f"node {peer} is not a known peer of node {self.node_id}; known: {self.peers()}")
        if p.lost:
            raise PeerLost(f"node {peer} {p.lost}")
        self._transmit(peer, encoded, timeout)
        self._stats.sent += 1

    def _wait_peer(self, peer: int, timeout: float) -> None:
        if peer == self.node_id:
            raise ConfigError(f"node {peer} is this node; send to another node id")
        p = self._peers.get(peer)
        if p is not None and p.lost is None:
            return
        if p is not None and p.lost:
            raise PeerLost(f"node {peer} {p.lost}")
        self._wait(lambda: peer in self._peers, timeout,
                   lambda: f"node {peer} has not joined within {timeout:g}s; peers: {self.peers()}")

    def _wait(self, ready: Callable[[], bool], timeout: float | None, what: Callable[[], str]) -> None:
        deadline = time.monotonic() + self._timeout(timeout)
        with self._peers_changed:
            while not ready():
                if self._state != "listening":
                    raise ClosedError("the queue is not listening")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Timeout(what())
                self._peers_changed.wait(min(left, 0.5))

    def _peer_list(self) -> list[Peer]:
        with self._peers_changed:
            return list(self._peers.values())

    def _live_peers(self) -> list[int]:
        return [p.node_id for p in self._peer_list() if not p.lost]

    def _fail_calls(self, error_for: Callable[[int], MQError | None]) -> None:
        with self._lock:
            pending = list(self._calls.values())
        for peer, fut in pending:
            err = error_for(peer)
            if err is not None:
                try:
                    fut.set_exception(err)
                except InvalidStateError:  # answered in the meantime
                    pass

    def _timeout(self, timeout: float | None) -> float:
        if timeout is None:
            return self.timeout
        if timeout < 0:
            raise ConfigError(f"timeout must be >= 0 seconds, got {timeout}")
        return float(timeout)

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} node={self.node_id} labels={sorted(self.labels)} "
                f"{self._state} peers={self.peers()}>")


class BoundedQueue:
    """A bounded FIFO for one producer (the I/O thread) and any consumers.

    queue.Queue pays for a Python-level Condition on every put and get; the hand-off between the
    I/O thread and ``recv()`` is on the small-message hot path, so items go through the C
    SimpleQueue and only the capacity is counted with a semaphore.
    """

    def __init__(self, capacity: int):
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._slots = threading.Semaphore(capacity)

    def put(self, item: Any, timeout: float) -> bool:
        """Add ``item``; False if the queue stayed full for ``timeout`` seconds."""
        if not self._slots.acquire(timeout=timeout):
            return False
        self._items.put(item)
        return True

    def get(self, timeout: float) -> Any:
        """Next item; raises queue.Empty after ``timeout`` seconds."""
        item = self._items.get(timeout=timeout)
        self._slots.release()
        return item

    def get_nowait(self) -> Any:
        item = self._items.get_nowait()
        self._slots.release()
        return item

    def empty(self) -> bool:
        return self._items.empty()


def _check_topic(topic: Any) -> None:
    if not isinstance(topic, str) or not topic:
        raise ConfigError(f"topic must be a non-empty str, got {topic!r}")


def _error_payload(exc: BaseException) -> dict[str, str]:
    # Only text crosses the wire: the caller rebuilds a RemoteError, never the remote object.
    return {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }
