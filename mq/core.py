"""The MQ a user holds, and everything every backend shares.

An :class:`MQ` holds one transport (:mod:`mq.transport`: NNG, torch RPC, in-process) and owns
everything a user sees: the join handshake, subscriptions, calls, farewell, queues, drop
counting, routes and the shm data path. Data flows one way::

    publish/send/call -> codec.pack -> data path per peer (inline | shm descriptor)
        -> transport.send(peer, frame) -> wire
    wire -> transport I/O thread -> MQ.on_frame -> codec.decode (shm views) -> queue | handler
    (a link that has not authenticated yet: -> MQ.on_handshake -> mq.handshake.parse, only)

Joining: a node greets each target its transport names (``attach_to`` addresses, or the ranks of
a torch RPC group) with HELLO (node id, labels, subscriptions, addresses, locality, its pool).
The peer picks the route (:func:`mq.routing.select_route`), opens the data link
(``transport.connect``) and answers HELLO_ACK; the node does the same on the ACK. When both
have a shared-memory pool and each could open the other's (probed in the handshake; LINK frames
carry the verdicts), the route is ``shm`` and large CPU buffers travel by descriptor.

Thread rules: ``on_frame`` runs on the transport's I/O thread and never runs user code there;
subscription handlers run on one dispatcher thread (in order), ``on`` handlers on a small pool,
or, for a call the transport answers in one exchange (``on_request``), on the transport's
request thread, which it keeps apart from the threads that carry frames.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
import traceback
import uuid
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

from mq import auth as _auth
from mq import fanout as _fanout
from mq import handshake as _handshake
from mq import metrics as _metrics
from mq import shm as _shm
from mq.codec import (BYE, HELLO, HELLO_ACK, KIND_NAMES, LINK, MSG, PING, RELAY, RELEASE, REP_ERR,
                      REP_OK, REQ, SUBS, Codec, Envelope, Frame, buffer_nbytes)
from mq.errors import ClosedError, ConfigError, EncodeError, MQError, PeerLost, ProtocolError, RemoteError, Timeout
from mq.locality import Locality, local
from mq.ratelog import RateLimitedLog
from mq.routing import Route, select_route
from mq.transport import Receipt, Transport

log = logging.getLogger("mq")

DEFAULT_TIMEOUT_S = 30.0
# A greeting nobody answered is sent again after this long.
_REGREET_S = 3.0
# Joins in progress (HELLO answered, LINK not yet) kept at once; the oldest go first.
_MAX_PENDING = 64
# Frames these kinds carry are counted both ways; receipts (PING "rx") acknowledge them.
_COUNTED = frozenset({MSG, REQ, REP_OK, REP_ERR, RELAY})
# Frames accepted from a link that has not proven membership yet: the handshake itself.
_HANDSHAKE = frozenset({HELLO, HELLO_ACK, LINK})
_STOPPED = "this queue was stopped; create a new one with mq.create(...)"
# Longer waits are capped: threading refuses timeouts past ~292 years (OverflowError).
_MAX_TIMEOUT_S = 365 * 86400.0


@dataclass(frozen=True)
class Message:
    """A received message: ``topic``, ``payload`` and the ``sender``'s node id."""

    topic: str
    payload: Any
    sender: int
    sent_at: float = field(default=0.0, compare=False, repr=False)  # sender's clock, for latency


@dataclass
class Peer:
    """What this node knows of another node."""

    node_id: int
    labels: frozenset[str] = frozenset()
    subscriptions: frozenset[str] = frozenset()
    route: Route | None = None
    info: dict[str, Any] = field(default_factory=dict)  # its HELLO (addresses, locality, ...)
    lost: str | None = None  # why the peer is gone (None while it is alive)
    reader: _shm.PoolReader | None = None  # its pool, opened here (we receive by descriptor)
    shm_out: bool = False  # it opened our pool: we may send it descriptors
    max_frame_bytes: int | None = None  # the largest frame it accepts (from its HELLO)
    tx: int = 0  # counted frames sent to it
    rx: int = 0  # counted frames received from it
    acked: int = 0  # how many of ours it confirmed (receipts)
    last_seen: float = field(default_factory=time.monotonic)
    last_sent: float = 0.0


@dataclass
class Stats:
    """Counters a user can read with :meth:`MQ.stats` (dropped frames are never silent)."""

    sent: int = 0
    received: int = 0
    dropped_malformed: int = 0
    dropped_oversized: int = 0
    dropped_unexpected_reply: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # refused joins and frames, by cause
    shm: dict[str, int] = field(default_factory=dict)  # the pool's counters (placed, by_handle...)


class MQ:
    """A node's message queue. Create one with :func:`mq.create`.

    Args:
        node_id: this node's unique integer id.
        labels: roles of this node (``{"learner"}``); peers find it with ``peers(label=)``.
        transport: what moves frames (built by :func:`mq.create` from the mq type).
        queue_size: bound of the receive queue; a full queue makes senders wait (backpressure).
        timeout: default timeout in seconds of ``send``/``publish``/``call``/``recv``.
        allow_pickle: let the codec pickle what it cannot carry, and unpickle it on receive.
            Only between trusted peers; off by default.
        handler_threads: threads serving ``on`` handlers.
        max_frame_bytes: larger incoming frames are dropped and counted.
        shm: use the shared-memory data path with same-host peers (route ``shm``).
        shm_pool_bytes: bound of this node's pool (default: a quarter of RAM, at most 4 GiB);
            receivers holding every slot make senders wait (backpressure).
        shm_inline_max: buffers smaller than this stay inline in the frame (default 64 KiB).
        queue_bytes: bound in bytes of each receive queue (messages of 64 KiB and more count;
            smaller ones are bounded by ``queue_size``); a full queue is backpressure.
        secret: the job secret peers must prove they know (default: ``MQ_SECRET``, else a
            per-user file; see :mod:`mq.auth`).
        insecure: turn authentication off: any process that reaches this node may join.
        heartbeat: seconds between liveness probes of each peer.
        peer_timeout: a peer silent this long is lost (its host crashed or the network broke):
            blocked senders and callers get :class:`~mq.errors.PeerLost`. Detection takes at most
            ``peer_timeout + heartbeat`` seconds (5 s by default). Time this process itself was
            not scheduled does not count against peers.
    """

    def __init__(self, node_id: int, labels: Iterable[str] | str | None = None, *,
                 transport: Transport, queue_size: int = 1024, timeout: float = DEFAULT_TIMEOUT_S,
                 allow_pickle: bool = False, handler_threads: int = 4, codec: Codec | None = None,
                 max_frame_bytes: int = 4 << 30, shm: bool = True,
                 shm_pool_bytes: int = _shm.DEFAULT_POOL_BYTES,
                 shm_inline_max: int = _shm.DEFAULT_INLINE_MAX, queue_bytes: int = 256 << 20,
                 secret: str | bytes | None = None, insecure: bool = False,
                 heartbeat: float = 1.0, peer_timeout: float = 4.0, mq_type: str | None = None,
                 relay_min_bytes: int | None = _fanout.DEFAULT_RELAY_MIN_BYTES, relay_shape: str = "tree"):
        if not isinstance(node_id, int) or isinstance(node_id, bool) or node_id < 0:
            raise ConfigError(f"node_id must be a non-negative int, got {node_id!r}")
        if not isinstance(queue_size, int) or queue_size < 1:
            raise ConfigError(f"queue_size must be an int >= 1, got {queue_size!r}")
        if _seconds(timeout, "timeout") <= 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        for name, value in (("max_frame_bytes", max_frame_bytes), ("queue_bytes", queue_bytes),
                            ("handler_threads", handler_threads)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        for name, value in (("heartbeat", heartbeat), ("peer_timeout", peer_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 3600:
                raise ConfigError(f"{name} must be a number of seconds in (0, 3600), got {value!r}")
        if labels is not None and not isinstance(labels, str) and not (
                hasattr(labels, "__iter__") and all(isinstance(x, str) for x in labels)):
            raise ConfigError(f"labels must be a str or an iterable of str (e.g. {{'learner'}}), got {labels!r}")
        self.node_id = node_id
        self.labels = frozenset([labels] if isinstance(labels, str) else (labels or ()))
        self.timeout = float(timeout)
        self.transport = transport
        self.backend_name = transport.name
        self.mq_type = mq_type or transport.name
        self.max_frame_bytes = max_frame_bytes
        self.codec = codec or Codec(allow_pickle=allow_pickle)
        self.codec.keep_tensors = transport.keeps_tensors
        self.codec.max_frame_bytes = max_frame_bytes
        self.locality: Locality = local()
        # host_of(node_id), asked by every publish: the descriptor's to_dict() cost ~60 us
        self._own_domain = _domain(self.locality.to_dict())
        self.incarnation = uuid.uuid4().hex
        self._secret = _auth.resolve_secret(secret, insecure)
        self.secret = self._secret  # for the transport: it signs its rendezvous values
        self.heartbeat = float(heartbeat)
        self.peer_timeout = float(peer_timeout)
        self._links: dict[Any, int] = {}  # authenticated link -> its peer's node id
        self.trusts = self._links.__contains__  # for the transport (Events.trusts), per frame
        self._greetings: dict[str, tuple[bytes, Any, float]] = {}  # token -> (our nonce, target, when)
        self._refusals_sent: dict[int, float] = {}  # node id -> when we last told a duplicate of it
        self._refusal: ConfigError | None = None  # a member refused our join, and said why
        self._pending: dict[tuple[int, str], tuple[bytes, Peer, float]] = {}  # joins awaiting LINK
        self._hostile_log = RateLimitedLog(log, f"node {node_id}: refused or dropped")
        self._stalled_until = 0.0  # our reader was blocked on a full queue: judge no peer silent
        self._beat: threading.Thread | None = None
        self._targets: list[Any] = []  # what the transport told us to greet
        self._shm_options = (shm_pool_bytes, shm_inline_max)
        _shm.Pool.check_options(shm_pool_bytes, shm_inline_max)
        self._shm_wanted = bool(shm)
        self._pool: _shm.Pool | None = None
        self.shm_unavailable: str | None = None if shm else "turned off (shm=False)"
        self._releases = _shm.ReleaseQueue()
        self._releaser: threading.Thread | None = None
        self._inbox: BoundedQueue = BoundedQueue(queue_size, queue_bytes)
        self._recv_caller = _RecvCaller()
        self._handler_queue: BoundedQueue = BoundedQueue(queue_size, queue_bytes)
        self._subscriptions: dict[str, Callable[[Message], Any] | None] = {}
        self._servers: dict[str, Callable[[Any], Any]] = {}
        self._peers: dict[int, Peer] = {}
        self._peers_changed = threading.Condition()
        self._calls: dict[int, tuple[int, Future]] = {}
        self._call_ids = itertools.count(1)
        self._seq = itertools.count()
        self._lock = threading.RLock()
        self._handler_slots = threading.BoundedSemaphore(handler_threads * 4)
        self._request_slots = threading.BoundedSemaphore(handler_threads)  # see on_request
        self._executor: ThreadPoolExecutor | None = None
        self._dispatcher: threading.Thread | None = None
        self._handler_threads = handler_threads
        self._state = "new"  # new -> listening -> stopping -> stopped
        self._stats = Stats()
        self._metrics = _metrics.Metrics()
        self._fanout = _fanout.Fanout(self, relay_min_bytes, relay_shape)
        self._answers: collections.deque[tuple[int, dict[str, Any], Peer, dict[str, Any]]] = collections.deque()
        self._answers_changed = threading.Condition()
        self._joiner: threading.Thread | None = None  # answers HELLOs when connect may block

    # ------------------------------------------------------------------ lifecycle
    def listen(self) -> "MQ":
        """Open the transport and join the peers. Idempotent."""
        if self._state == "listening":
            return self
        if self._state != "new":
            raise ClosedError(_STOPPED)
        self._executor = ThreadPoolExecutor(self._handler_threads, thread_name_prefix=f"mq{self.node_id}-on")
        self._dispatcher = threading.Thread(target=self._dispatch_loop, daemon=True,
                                            name=f"mq{self.node_id}-handlers")
        self._state = "listening"
        self._dispatcher.start()
        try:
            _preload_torch()
            self._open_pool()
            self._targets = list(self.transport.start(self))
            for target in self._targets:
                self._greet(target)
            self._beat = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                          name=f"mq{self.node_id}-heartbeat")
            self._beat.start()
        except BaseException:
            self.stop(timeout=2.0)
            raise
        return self

    def _open_pool(self) -> None:
        if not self._shm_wanted:
            return
        try:
            self._pool = _shm.Pool(*self._shm_options, label=str(self.node_id))
        except OSError as exc:  # e.g. no memfd, or no memory for the probe: sockets only
            self.shm_unavailable = f"cannot make a shared-memory pool here ({exc})"
            log.warning("node %d: %s; same-host peers use a socket", self.node_id, self.shm_unavailable)
            return
        self._releaser = threading.Thread(target=self._release_loop, daemon=True,
                                          name=f"mq{self.node_id}-shm-release")
        self._releaser.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Leave the job: tell peers, close the transport. Returns within ``timeout`` seconds
        (plus a little), even when peers died."""
        timeout = _seconds(timeout, "timeout")
        if self._state != "listening":
            self._state = "stopped"
            return
        deadline = time.monotonic() + timeout
        self._finish_handlers(deadline)  # still listening: their answers may still be sent
        self._state = "stopping"
        self._farewell(deadline)
        try:
            self.transport.close(max(0.1, deadline - time.monotonic()))
        except Exception:  # never let a broken transport keep the node alive
            log.exception("node %d: error while closing the transport", self.node_id)
        self._state = "stopped"
        self._releases.wake()
        self._fail_calls(lambda peer: ClosedError("the queue was stopped while the call was pending"))
        with self._peers_changed:
            self._peers_changed.notify_all()
            readers = [p.reader for p in self._peers.values() if p.reader is not None]
        for reader in readers:
            reader.close()
        if self._pool is not None:
            self._pool.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self._dispatcher is not None:
            self._dispatcher.join(max(0.0, deadline - time.monotonic()))

    def _finish_handlers(self, deadline: float) -> None:
        """Before saying goodbye, let call handlers already running send their answers (for
        at most half the time left): a caller whose handler ran gets its answer, not PeerLost."""
        until = time.monotonic() + max(0.0, deadline - time.monotonic()) / 2
        # (Semaphore counts read without their locks, as in _caller_may_read.)
        while ((self._request_slots._value < self._handler_threads
                or self._handler_slots._value < self._handler_threads * 4)
               and time.monotonic() < until):
            time.sleep(0.005)

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
                rx = self._peers[peer].rx
                self._send_raw(peer, self._encode(BYE, "", {"rx": rx}, corr),
                               max(0.0, min(1.0, deadline - time.monotonic())))
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

    @property
    def addresses(self) -> dict[str, str]:
        """Where peers reach this node, by kind (``tcp``, ``ipc``, ...), once listening."""
        return dict(self.transport.addresses)

    # ------------------------------------------------------------------ subscriptions
    def subscribe(self, topic: str, fn: Callable[[Message], Any] | None = None) -> None:
        """Receive ``topic``: into :meth:`recv`, or by calling ``fn(message)`` off the I/O thread."""
        _check_topic(topic)
        if fn is not None and not callable(fn):
            raise ConfigError(f"subscribe({topic!r}, fn): fn must be callable or None, got {type(fn).__name__}")
        with self._lock:
            self._subscriptions[topic] = fn
        self._announce_subscriptions()

    def unsubscribe(self, topic: str) -> None:
        _check_topic(topic)
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
            Timeout: the peer did not join, or its queue (or the shared-memory pool) stayed
                full, for ``timeout`` seconds.
            PeerLost: the peer died or left.
            EncodeError: the payload holds something the codec cannot carry.
        """
        if type(topic) is not str or not topic:
            _check_topic(topic)
        timeout = self.timeout if timeout is None else self._timeout(timeout)
        deadline = time.monotonic() + timeout
        p = self._peers.get(peer) if type(peer) is int else None
        if p is None or p.lost is not None or self._state != "listening":
            self._wait_peer(peer, timeout)  # says what is wrong, or waits for the peer to join
        self._deliver_to([peer], self._encode(MSG, topic, payload), deadline)

    def publish(self, topic: str, payload: Any, *, timeout: float | None = None) -> list[int]:
        """Send to every peer subscribed to ``topic``; returns their node ids.

        Peers that have not joined yet do not receive it: use :meth:`wait_for_subscribers`.
        The payload is encoded once; same-host subscribers share one shared-memory copy.
        """
        _check_topic(topic)
        timeout = self._timeout(timeout)
        deadline = time.monotonic() + timeout
        targets = sorted(p.node_id for p in self._peer_list() if topic in p.subscriptions and not p.lost)
        if targets:
            frame = self._encode(MSG, topic, payload)
            if not self._fanout.publish(targets, frame, deadline):  # one copy per host, if it pays
                self._deliver_to(targets, frame, deadline)
        return targets

    def _deliver_to(self, peers: list[int], frame: Frame, deadline: float) -> None:
        """Send one frame to ``peers`` through each one's data path, then wait for every
        receipt together (a transfer from the caller's memory must finish before we return).
        A peer the frame never reached gives back its slot references at once."""
        if len(peers) == 1 and (self._pool is None or not frame.sizes or not self._pool.wants(max(frame.sizes))):
            # One peer, every buffer inline: the common small message.
            receipt = self._send_checked(peers[0], frame, max(0.0, deadline - time.monotonic()))
            if frame.kind == MSG:
                self._metrics.sent(frame.head[2], frame.nbytes)
            if receipt is not None:
                receipt()
            return
        frames, descs, shm_peers = self._data_paths(peers, frame, deadline)
        receipts: list[Receipt] = []
        try:
            for n, peer in enumerate(peers):
                try:
                    receipt = self._send_checked(peer, frames[peer], max(0.0, deadline - time.monotonic()))
                except BaseException:
                    self._unhold(descs, [p for p in peers[n:] if p in shm_peers])
                    raise
                if receipt is not None:
                    receipts.append(receipt)
                if frame.kind == MSG:
                    self._metrics.sent(frame.head[2], frame.nbytes)
        finally:
            errors = []
            for receipt in receipts:
                try:
                    receipt()
                except MQError as exc:
                    errors.append(exc)
        if errors:
            raise errors[0]

    def _data_paths(self, peers: list[int], frame: Frame,
                    deadline: float) -> tuple[dict[int, Frame], dict[int, list[int]], list[int]]:
        """The frame each peer gets: large CPU buffers go by shm descriptor to peers that read
        our pool (one copy shared by all of them), inline to the others."""
        pool = self._pool
        big = [i for i, n in enumerate(frame.sizes)
               if pool is not None and pool.wants(n) and _on_cpu(frame.buffers[i])]
        shm_peers = [p for p in peers if getattr(self._peers.get(p), "shm_out", False)] if big else []
        frames = dict.fromkeys(peers, frame)
        if not shm_peers:
            return frames, {}, []
        assert pool is not None
        descs: dict[int, list[int]] = {}
        try:
            for i in big:
                descs[i] = pool.place(frame.buffers[i], shm_peers, max(0.0, deadline - time.monotonic()))
        except BaseException:
            self._unhold(descs, shm_peers)
            raise
        shared = frame.with_descriptors(descs)
        frames.update(dict.fromkeys(shm_peers, shared))
        return frames, descs, shm_peers

    def _unhold(self, descs: dict[int, list[int]], peers: list[int]) -> None:
        """The frame never reached ``peers``: give back the slot references held for them."""
        assert self._pool is not None
        for seg_id, _fd, gen, _off, _n in descs.values():
            for peer in peers:
                self._pool.release(peer, seg_id, gen)

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
        frame = self._encode(REQ, topic, payload, corr)
        try:
            if self.transport.answers_requests:
                env = self._request(peer, frame, deadline)
                if env is not None:
                    if env.kind == REP_OK:
                        return env.payload
                    raise _remote_error(env)
            return self._call_by_frames(peer, corr, frame, deadline)
        except FutureTimeout:
            raise Timeout(f"node {peer} did not answer call {topic!r} within {timeout:g}s "
                          "(pass timeout= to wait longer)") from None

    def _call_by_frames(self, peer: int, corr: int, frame: Frame, deadline: float) -> Any:
        """A call as a REQ frame; the REP frame resolves its future (:meth:`_on_reply`)."""
        fut: Future = Future()
        with self._lock:
            self._calls[corr] = (peer, fut)
        try:
            self._deliver_to([peer], frame, deadline)
            self._read_while(fut.done, deadline)
            return fut.result(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            with self._lock:
                self._calls.pop(corr, None)

    def _request(self, peer: int, frame: Frame, deadline: float) -> Envelope | None:
        """A call in one exchange (``Transport.request``): its checked reply (REP_OK/REP_ERR),
        or None when the peer did not take it as a request (the caller sends it as an ordinary
        frame). Calls travel inline this way, also to a peer on the shm route: the request is
        one exchange and the peer's transport moves the bytes (TensorPipe has its own
        same-host channels); descriptors would need a second message to give the slots back.
        Losing the peer meanwhile ends the exchange in the transport, which says how."""
        if self._state != "listening":
            raise ClosedError(self._not_listening("call"))
        p = self._peers.get(peer)
        if p is None or p.lost:
            raise PeerLost(f"node {peer} {p.lost if p else 'is not a known peer'}")
        if p.max_frame_bytes is not None and frame.nbytes > p.max_frame_bytes:
            raise ConfigError(f"a frame of {frame.nbytes} bytes exceeds node {peer}'s max_frame_bytes="
                              f"{p.max_frame_bytes}: send smaller pieces, or raise max_frame_bytes on "
                              f"node {peer}; nothing was sent")
        left = deadline - time.monotonic()
        if left <= 0:
            raise FutureTimeout()
        try:
            reply = self.transport.request(peer, frame, left)
        except Timeout:
            raise FutureTimeout() from None  # call() words it
        except MQError:
            if p.lost:  # the link broke because the peer died or left
                raise PeerLost(f"node {peer} {p.lost}") from None
            raise
        if reply is None:
            return None
        self._stats.sent += 1
        p.last_sent = time.monotonic()
        try:
            env = self.codec.decode(*reply)
        except ProtocolError as exc:
            self._dropped(exc)
            raise
        if env.kind not in (REP_OK, REP_ERR) or env.corr != frame.head[5] or env.sender != peer:
            self.on_dropped(f"node {peer} answered a request with a {KIND_NAMES[env.kind]} frame "
                            f"of call {env.corr} from node {env.sender}")
            raise ProtocolError(f"node {peer} answered call {frame.head[5]} with something else")
        self._stats.received += 1
        p.last_seen = time.monotonic()
        return env

    def on(self, topic: str, fn: Callable[[Any], Any]) -> None:
        """Serve :meth:`call` on ``topic``: ``fn(payload)`` returns the answer."""
        _check_topic(topic)
        if not callable(fn):
            raise ConfigError(f"on({topic!r}, fn): fn must be callable, got {type(fn).__name__}")
        with self._lock:
            self._servers[topic] = fn

    # ------------------------------------------------------------------ shared buffers
    def alloc(self, shape: Any, dtype: Any = "float32") -> Any:
        """A numpy array (numpy dtype) or torch tensor (torch dtype) in this node's
        shared-memory pool. Sending it to same-host peers passes a handle (no copy: the cost
        does not depend on its size); to other peers it is sent like any array.

        Ownership: receivers get views of this very memory. Write it again only after
        :meth:`wait_released`; until then the numpy array is read-only (torch tensors cannot
        be, so the rule is on you).

        Raises:
            ConfigError: the pool is not available (the reason is in ``shm_unavailable``), or a
                bad shape/dtype.
        """
        return self._need_pool().alloc(shape, dtype)

    def wait_released(self, buf: Any, timeout: float | None = None) -> None:
        """Block until every receiver dropped its view of ``buf`` (from :meth:`alloc`).

        Raises:
            Timeout: a receiver still holds it after ``timeout`` seconds.
        """
        pool = self._need_pool()
        timeout = self._timeout(timeout)
        deadline = time.monotonic() + timeout
        if pool.holders_of(buf):  # (raises ConfigError for a buffer not from alloc())
            self._read_while(lambda: not pool.holders_of(buf), deadline)
        pool.wait_released(buf, max(0.0, deadline - time.monotonic()))

    def _caller_may_read(self) -> bool:
        """Whether a thread may read the transport for itself: only while every queue a frame
        can go to has room, so its reads (which never wait on a queue) keep the bounds."""
        # (A semaphore's count, read without taking its lock: acquire() + release() per recv()
        # cost ~3 us, and only this thread takes slots while it reads.)
        return not (self._inbox.full() or self._handler_queue.full()) and self._handler_slots._value > 0

    def _read_while(self, done: Callable[[], bool], deadline: float) -> None:
        """Wait until ``done()`` or ``deadline`` reading the transport in this thread, as recv()
        does: the frame that ends the wait (a reply, a release) is handled here instead of being
        handed over by the I/O thread, a thread hop that cost a by-handle send ~0.1 ms. Reads
        only while :meth:`_caller_may_read` (what arrives meanwhile stays within the bounds, one
        transport message past them at most); otherwise leaves the waiting to the caller."""
        while not done():
            left = deadline - time.monotonic()
            if left <= 0 or self._state != "listening" or not self._caller_may_read():
                return
            self._recv_caller.active = True  # a batch's frames go in past a bound it just met
            try:
                if not self.transport.read_in_caller(min(left, 0.05), done):
                    return
            finally:
                self._recv_caller.active = False

    def _need_pool(self) -> "_shm.Pool":
        if self._pool is None:
            why = self.shm_unavailable or "the queue is not listening (use `with q:` or q.listen())"
            raise ConfigError(f"node {self.node_id} has no shared-memory pool: {why}")
        return self._pool

    # ------------------------------------------------------------------ receiving
    def recv(self, timeout: float | None = None) -> Message:
        """Next message of a subscribed topic (or sent to this node) without a handler.

        Raises:
            Timeout: nothing arrived within ``timeout`` seconds (default: the queue's timeout).
        """
        timeout = self._timeout(timeout)
        if self._state != "listening" and self._inbox.empty():
            raise ClosedError(self._not_listening("recv()"))
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._handed(self._inbox.get_nowait())
            except queue.Empty:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout(f"no message within {timeout:g}s")
            # Read the transport in this thread when it can: no hand-off from an I/O thread,
            # which is a large part of a small message's latency.
            read = False
            if self._caller_may_read():
                self._recv_caller.active = True
                try:
                    read = self.transport.read_in_caller(left, self._inbox_ready)
                finally:
                    self._recv_caller.active = False
            if not read:
                try:
                    return self._handed(self._inbox.get(timeout=left))
                except queue.Empty:
                    raise Timeout(f"no message within {timeout:g}s") from None

    def _handed(self, msg: Message) -> Message:
        self._metrics.delivered(msg.topic, msg.sent_at)
        return msg

    def _inbox_ready(self) -> bool:
        return not self._inbox.empty()

    # ------------------------------------------------------------------ peers
    def peers(self, label: str | None = None) -> list[int]:
        """Node ids of live peers, optionally only those with ``label``."""
        return sorted(p.node_id for p in self._peer_list()
                      if not p.lost and (label is None or label in p.labels))

    def routes(self) -> dict[int, Route]:
        """The route to each live peer, e.g. ``{1: Route(kind="shm", ...)}``: the path the
        bytes of a large CPU buffer take to that peer."""
        return {p.node_id: p.route for p in self._peer_list() if not p.lost and p.route}

    def wait_for_peers(self, count: int | None = None, *, ids: Iterable[int] | None = None,
                       label: str | None = None, timeout: float | None = None) -> list[int]:
        """Block until ``count`` peers (with ``label``) or the peers ``ids`` have joined."""
        if count is not None and (type(count) is not int or count < 0):
            raise ConfigError(f"count must be an int >= 0, got {count!r}")
        if ids is not None and (not hasattr(ids, "__iter__") or not all(type(i) is int for i in ids)):
            raise ConfigError(f"ids must be node ids (ints), got {ids!r}")
        if label is not None and not isinstance(label, str):
            raise ConfigError(f"label must be a str, got {label!r}")
        want = set(ids or ())

        def ready() -> bool:
            have = set(self.peers(label))
            return want <= have and (count is None or len(have) >= count)

        self._wait(ready, timeout, lambda: (f"peers {sorted(want)} / count {count} (label={label}) "
                                            f"did not join; have {self.peers(label)}{self._unanswered()}"))
        return self.peers(label)

    def wait_for_subscribers(self, topic: str, count: int = 1, *, timeout: float | None = None) -> list[int]:
        """Block until ``count`` live peers subscribe to ``topic``; returns their ids."""
        _check_topic(topic)
        if type(count) is not int or count < 0:
            raise ConfigError(f"count must be an int >= 0, got {count!r}")

        def subs() -> list[int]:
            return sorted(p.node_id for p in self._peer_list() if topic in p.subscriptions and not p.lost)

        self._wait(lambda: len(subs()) >= count, timeout,
                   lambda: f"{count} subscriber(s) of {topic!r} did not appear; have {subs()}")
        return subs()

    def metrics(self) -> dict[str, Any]:
        """Numbers of this node for dashboards: per topic messages and bytes (totals and per
        second since the previous call), p50/p99 delivery latency (sender clock to recv() or
        handler), queue depths, drops and refusals by cause, the route per peer, and what
        channels add (policy lag). See :mod:`mq.metrics`; :func:`mq.metrics.prometheus_text`
        exports it."""
        snap = self._metrics.snapshot()
        s = self.stats()
        snap.update({
            "node": self.node_id,
            "labels": sorted(self.labels),
            "mq_type": self.mq_type,
            "queues": {"recv": self._inbox.depth(), "handlers": self._handler_queue.depth()},
            "drops": {"malformed": s.dropped_malformed, "oversized": s.dropped_oversized,
                      "unexpected_reply": s.dropped_unexpected_reply},
            "rejected": dict(s.rejected),
            "routes": {p: r.kind for p, r in self.routes().items()},
            "peers_lost": {p.node_id: p.lost for p in self._peer_list() if p.lost},
            "shm": dict(s.shm),
        })
        return snap

    def set_metric(self, name: str, value: Any) -> None:
        """Publish a value under ``name`` in :meth:`metrics` (channels report policy lag so)."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"metric name must be a non-empty str, got {name!r}")
        self._metrics.gauges[name] = value

    def host_of(self, peer: int) -> str | None:
        """The shared-memory domain ``peer`` runs in (boot id and IPC namespace; None if unknown):
        peers with the same id can share one copy, so fan-out can send once per domain. Two
        containers or network-namespace "hosts" on one machine are two domains. ``host_of`` of
        this node's own id is its own domain."""
        if peer == self.node_id:
            return self._own_domain
        p = self._peers.get(peer)
        return _domain(p.info.get("locality") if p is not None else None)

    def stats(self) -> Stats:
        if self._pool is not None:
            readers = [p.reader for p in self._peer_list() if p.reader is not None]
            self._stats.shm = dict(self._pool.stats,
                                   peers_mapped_bytes=sum(r.mapped_bytes for r in readers),
                                   descriptors_refused=sum(r.refused for r in readers))
        return self._stats

    # ------------------------------------------------------------------ joining
    # The handshake (see mq.auth): HELLO carries a fresh nonce; HELLO_ACK answers with the
    # responder's nonce and its proof; LINK carries the initiator's proof. A node becomes a peer
    # only once its proof checked out, and from then on only frames on its own link count.
    def _hello_payload(self, token: str, nonce: bytes) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "labels": sorted(self.labels),
            "subscriptions": sorted(self.subscriptions()),
            "addresses": dict(self.transport.addresses),
            "locality": self.locality.to_dict(),
            "incarnation": self.incarnation,
            "token": token,
            "nonce": nonce,
            "mq_type": self.mq_type,
            "max_frame_bytes": self.max_frame_bytes,
            "shm": self._pool.probe_info() if self._pool is not None else None,
        }

    def _greet(self, target: Any) -> None:
        token, nonce = uuid.uuid4().hex, _auth.nonce()
        with self._lock:
            self._greetings[token] = (nonce, target, time.monotonic())
        self.transport.greet(target, self._encode(HELLO, "", self._hello_payload(token, nonce)), token)

    def _on_hello(self, env: Envelope, link: Any) -> None:
        """A node wants to join: answer with our nonce and proof; it is not a peer yet."""
        info = env.payload  # checked against its schema (mq.handshake)
        peer_id = info["node_id"]
        if peer_id == self.node_id and info["incarnation"] == self.incarnation:
            return  # our own greeting (a node attached to itself)
        nonce = _auth.nonce()
        ack = self._hello_payload(info["token"], nonce)
        if self._secret is not None:
            ack["proof"] = self._secret.proof("ack", nonce, info["nonce"], self.node_id, peer_id,
                                              self.incarnation)
        taken = self._taken(peer_id, info)
        if taken:
            # Never touch the live node's link; tell the newcomer why instead of letting its
            # joins time out (signed like any answer: a stranger cannot forge the refusal).
            self._tell_refused(peer_id, info, dict(ack, error=taken))
            raise _handshake.Refused("duplicate_id", taken)
        peer = self._new_peer(info)
        ack["read_ok"] = peer.reader is not None
        with self._lock:
            if len(self._pending) >= _MAX_PENDING:  # a join flood must not grow without bound
                self._drop_pending(next(iter(self._pending)), "too many joins in progress")
            self._pending[(peer_id, info["incarnation"])] = (nonce, peer, time.monotonic())
        if self.transport.connect_may_block:
            self._answer_later((peer_id, info, peer, ack))
        else:
            self._answer_hello(peer_id, info, peer, ack)

    def _answer_hello(self, peer_id: int, info: dict[str, Any], peer: Peer, ack: dict[str, Any]) -> None:
        """Open the link to a node that said HELLO and answer on it (its first frame)."""
        try:
            self.transport.connect(peer_id, info, peer.route)
            self._send_raw(peer_id, self._encode(HELLO_ACK, "", ack), min(self.timeout, 5.0))
        except (MQError, OSError) as exc:
            log.debug("node %d: could not answer the HELLO of node %d: %s", self.node_id, peer_id, exc)

    def _answer_later(self, answer: tuple[int, dict[str, Any], Peer, dict[str, Any]]) -> None:
        """Answer a HELLO from the joins thread: the transport's connect may block (a tcp link
        to a port that drops SYNs), and a HELLO proves nothing yet, so a stranger's forged ones
        must not hold up the I/O thread. At most _MAX_PENDING wait; the oldest goes first."""
        with self._answers_changed:
            if len(self._answers) >= _MAX_PENDING:
                dropped = self._answers.popleft()
                self._reject("pending_overflow", f"too many joins to answer: node {dropped[0]}'s waits")
            self._answers.append(answer)
            if self._joiner is None:
                self._joiner = threading.Thread(target=self._joins_loop, daemon=True,
                                                name=f"mq{self.node_id}-joins")
                self._joiner.start()
            self._answers_changed.notify()

    def _joins_loop(self) -> None:
        while self._state == "listening":
            with self._answers_changed:
                if not self._answers:
                    self._answers_changed.wait(0.5)
                    continue
                peer_id, info, peer, ack = self._answers.popleft()
            with self._lock:
                waiting = (peer_id, info["incarnation"]) in self._pending
            if waiting:  # not dropped meanwhile (timed out, or pushed out by a flood)
                self._answer_hello(peer_id, info, peer, ack)

    def _drop_pending(self, key: tuple[int, str], why: str) -> None:
        """Forget a join that never completed (called with the lock held)."""
        entry = self._pending.pop(key, None)
        if entry is None:
            return
        if entry[1].reader is not None:
            entry[1].reader.close()
        live = self._peers.get(key[0])
        if live is None or live.lost:  # nobody else uses that id's link: close it
            threading.Thread(target=self.transport.disconnect, args=(key[0],), daemon=True).start()
        self._reject("join_incomplete", f"node {key[0]} did not finish joining: {why}")

    def _taken(self, peer_id: int, info: dict[str, Any]) -> str | None:
        """Why a HELLO for ``peer_id`` must be refused: its id belongs to a live process."""
        if peer_id == self.node_id:
            where = self.transport.addresses
        else:
            old = self._peers.get(peer_id)
            if old is None or old.lost or old.info.get("incarnation") == info["incarnation"]:
                return None
            where = old.info.get("addresses")
        return (f"node id {peer_id} is taken by a live process (node {self.node_id} sees it at "
                f"{where}): give every node a unique node id")

    def _tell_refused(self, peer_id: int, info: dict[str, Any], answer: dict[str, Any]) -> None:
        """Send a node whose HELLO we refuse a HELLO_ACK saying why, at most once per
        _REGREET_S for each id (the HELLO is unproven: its address may be anyone's)."""
        target = self.transport.reply_target(info)
        now = time.monotonic()
        with self._lock:
            if target is None or now - self._refusals_sent.get(peer_id, -_REGREET_S) < _REGREET_S:
                return
            self._refusals_sent[peer_id] = now
        frame = self._encode(HELLO_ACK, "", answer)

        def tell() -> None:  # a greeting may wait for its target (inproc): not on the I/O thread
            try:
                self.transport.greet(target, frame, info["token"])
            except Exception as exc:  # the address is the unproven HELLO's: any library may refuse it
                log.debug("node %d: could not tell node %d it was refused: %s", self.node_id, peer_id, exc)

        threading.Thread(target=tell, daemon=True, name=f"mq{self.node_id}-refusal").start()

    def _on_ack(self, env: Envelope, link: Any) -> None:
        """Our HELLO was answered: check the proof, then the responder is a peer."""
        info = env.payload  # checked against its schema (mq.handshake)
        peer_id = info["node_id"]
        with self._lock:
            greeting = self._greetings.get(info["token"])
        if greeting is None:
            raise _handshake.Refused("unsolicited_ack", f"a HELLO_ACK claiming node {peer_id} answers "
                                     "no HELLO of ours")
        mine = greeting[0]
        if self._secret is not None and not self._secret.check(
                info["proof"], "ack", info["nonce"], mine, peer_id, self.node_id, info["incarnation"]):
            raise _handshake.Refused("bad_proof", f"a HELLO_ACK claiming node {peer_id} failed "
                                     "authentication (wrong job secret, or not a member of this job)")
        if info["error"]:  # a member refused us, and said why: the next wait raises it
            with self._peers_changed:
                self._refusal = ConfigError(f"node {peer_id} refused node {self.node_id}: {info['error']}")
                self._peers_changed.notify_all()
            log.error("node %d: %s", self.node_id, self._refusal)
            raise _handshake.Refused("refused", str(self._refusal))
        with self._lock:
            self._greetings.pop(info["token"], None)
        old = self._peers.get(peer_id)
        same = old is not None and not old.lost and old.info.get("incarnation") == info["incarnation"]
        taken = None if same else self._taken(peer_id, info)
        if taken:
            raise _handshake.Refused("duplicate_id", taken)
        peer = old if same else self._new_peer(info)
        self._bind(link, peer_id)
        if not same:
            self.transport.connect(peer_id, info, peer.route)
        link_msg: dict[str, Any] = {"node_id": self.node_id, "incarnation": self.incarnation,
                                    "read_ok": peer.reader is not None}
        if self._secret is not None:
            link_msg["proof"] = self._secret.proof("link", mine, info["nonce"], self.node_id, peer_id,
                                                   self.incarnation)
        # LINK first: the peer takes no other frame of ours before it (links are FIFO).
        self._send_raw(peer_id, self._encode(LINK, "", link_msg), self.timeout)
        if not same:
            self._peer_joined(peer)
        self._on_link_verdict(peer_id, info["read_ok"])

    def _on_link(self, env: Envelope, link: Any) -> None:
        """The initiator's proof: it joins as a peer (or, if it already has, a verdict update)."""
        msg = env.payload  # checked against its schema (mq.handshake)
        peer_id = env.sender
        with self._lock:
            entry = self._pending.get((peer_id, msg["incarnation"]))
        if entry is None:
            if self._links.get(link) != peer_id:
                raise _handshake.Refused("unsolicited_link", f"a LINK claiming node {peer_id} answers "
                                         "no join in progress")
            self._on_link_verdict(peer_id, msg["read_ok"])  # a second handshake on a live link
            return
        mine, peer, _t = entry
        if self._secret is not None and not self._secret.check(
                msg["proof"], "link", peer.info["nonce"], mine, peer_id, self.node_id, msg["incarnation"]):
            raise _handshake.Refused("bad_proof", f"a LINK claiming node {peer_id} failed authentication "
                                     "(wrong job secret, or not a member of this job)")
        with self._lock:
            self._pending.pop((peer_id, msg["incarnation"]), None)
        taken = self._taken(peer_id, peer.info)
        if taken:
            raise _handshake.Refused("duplicate_id", taken)
        self._bind(link, peer_id)
        self.transport.connect(peer_id, peer.info, peer.route)
        old = self._peers.get(peer_id)
        if old is None or old.lost or old.info.get("incarnation") != peer.info.get("incarnation"):
            self._peer_joined(peer)
        self._on_link_verdict(peer_id, msg["read_ok"])

    def _bind(self, link: Any, peer_id: int) -> None:
        with self._lock:
            self._links[link] = peer_id

    def _new_peer(self, info: dict[str, Any]) -> Peer:
        peer_id = info["node_id"]
        try:
            remote = Locality.from_dict(info.get("locality") or {})
        except Exception as exc:
            raise ProtocolError(f"node {peer_id} sent a malformed locality: {exc}") from None
        # pid AND its PID namespace: two "hosts" (namespaces) on one machine reuse small pids.
        same_process = (remote.pid == self.locality.pid and remote.boot_id == self.locality.boot_id
                        and remote.pid_ns == self.locality.pid_ns)
        supported = set(self.transport.routes)
        reader, why_not = None, None
        if (self._pool is not None and self.transport.shm_ok and info.get("shm") is not None
                and not same_process):
            try:
                # We map at most what its pool announced, and at most what ours may hold (or
                # the default, should ours be smaller than a legitimately larger peer's).
                reader = _shm.PoolReader(peer_id, info["shm"], self._releaser_for(peer_id),
                                         max_bytes=max(self._pool.max_bytes, _shm.DEFAULT_POOL_BYTES))
                why_not = reader.probe()
            except ProtocolError as exc:
                why_not = str(exc)
            if why_not:
                reader = None
            else:
                supported.add("shm")
        try:
            route = select_route(self.locality, remote, supported=supported, peer=peer_id,
                                 same_process=same_process)
        except ConfigError as exc:  # e.g. protocol=ipc towards another host: say so, use tcp
            # (rate-limited: a stranger's HELLOs, unproven yet, get here too)
            self._hostile_log("route", f"node {self.node_id}: {exc}; using tcp to node {peer_id}")
            route = select_route(self.locality, remote, supported={"tcp"}, peer=peer_id)
        if route.gpudirect and "nvlink" not in supported:  # this transport stages GPU tensors
            route = replace(route, gpudirect=False)
        if why_not and route.kind != "inproc":
            route = replace(route, reason=f"{route.reason}; not shm: {why_not}")
        elif self._pool is None and route.kind in ("ipc",):
            route = replace(route, reason=f"{route.reason}; not shm: {self.shm_unavailable}")
        if route.kind != "shm" and reader is not None:
            reader.close()
            reader = None
        limit = info.get("max_frame_bytes")
        return Peer(peer_id, frozenset(str(x) for x in info.get("labels") or ()),
                    frozenset(str(x) for x in info.get("subscriptions") or ()), route,
                    info=info, reader=reader,
                    max_frame_bytes=limit if type(limit) is int and limit > 0 else None)

    def _on_link_verdict(self, peer_id: int, read_ok: Any) -> None:
        """The peer's verdict on our pool: descriptors go to it only if it could open it."""
        with self._peers_changed:
            peer = self._peers.get(peer_id)
            if peer is None or peer.route is None or peer.route.kind != "shm":
                return
            if read_ok is True:
                peer.shm_out = True
            elif "shm" not in self.transport.routes:  # it cannot read ours: sockets both ways
                fallback = "ipc" if "ipc" in self.transport.routes else "tcp"
                peer.route = replace(peer.route, kind=fallback,
                                     reason=f"{peer.route.reason}; not shm: node {peer_id} cannot "
                                            "open this node's shared memory")
            self._peers_changed.notify_all()

    def _send_or_log(self, peer: int, kind: int, payload: Any) -> None:
        try:
            self._send_raw(peer, self._encode(kind, "", payload), self.timeout)
        except MQError as exc:
            log.warning("node %d: could not answer the handshake of node %d: %s", self.node_id, peer, exc)

    def _reject(self, cause: str, why: str) -> None:
        """Count a refused frame or join by cause, and log it (rate-limited)."""
        self._stats.rejected[cause] = self._stats.rejected.get(cause, 0) + 1
        self._hostile_log(cause, f"node {self.node_id}: refused: {why}")


    def _releaser_for(self, peer: int) -> Callable[[int, int], None]:
        put = self._releases.put
        return lambda seg_id, gen: put(peer, seg_id, gen)

    def _release_loop(self) -> None:
        """Send RELEASE frames for slots our receivers' views no longer reference (batched)."""
        while self._state in ("new", "listening", "stopping"):
            for peer, items in self._releases.take(0.5).items():
                p = self._peers.get(peer)
                if p is None or p.lost:
                    continue  # its pool went with it
                try:
                    self._send_raw(peer, self._encode(RELEASE, "", items), 1.0)
                except MQError as exc:
                    log.debug("node %d: release to node %d: %s", self.node_id, peer, exc)

    # ------------------------------------------------------------------ events from the transport
    def on_handshake(self, frame: Any, link: Any) -> bool:
        """A frame from a link that has not authenticated (the transport's I/O thread): only the
        handshake parser reads it (:mod:`mq.handshake`). False when it was refused (counted):
        the transport closes the link."""
        try:
            kind, sender, payload = _handshake.parse(frame)
            self._on_handshake_frame(Envelope(kind, "", sender, 0, 0, payload), link)
        except ProtocolError as exc:
            self._dropped(exc)
            return False
        except Exception as exc:  # a bug of ours: it must not stop the I/O thread either
            self._failed(exc)
            return False
        return True

    def _on_handshake_frame(self, env: Envelope, link: Any) -> None:
        {HELLO: self._on_hello, HELLO_ACK: self._on_ack, LINK: self._on_link}[env.kind](env, link)

    def on_frame(self, header: Any, buffers: list[Any], link: Any) -> None:
        """A frame arrived on a trusted ``link`` (the transport's I/O thread): decode and route
        it. A frame's sender is its link's peer. A malformed or refused frame is dropped and
        counted; nothing a peer sends raises out of here."""
        try:
            shared = type(header) is not list or header[8] is not None  # parsed: no descriptors
            env = self.codec.decode(header, buffers, self._resolve_for(link) if shared else None)
            if env.kind in _HANDSHAKE:  # a peer greeting again: held to the same schema
                self._on_handshake_frame(
                    env._replace(payload=_handshake.check(env.kind, env.sender, env.payload)), link)
            elif (peer := self._admit(env, link)) is None:
                pass  # refused and counted
            elif (p := self._peers[peer]).lost:
                # It left (or went silent): answers to our own farewell still count; the rest
                # of what was in flight is dropped quietly, as the sender was told (PeerLost).
                if env.kind in (REP_OK, REP_ERR):
                    self._on_reply(env)
                else:
                    log.debug("node %d: dropped a %s from node %d, which left", self.node_id,
                              KIND_NAMES[env.kind], env.sender)
            else:  # the queue's byte bound counts inline bytes (the pool bounds shared ones)
                self._deliver(env, p, sum(buffer_nbytes(b) for b in buffers) if shared else env.nbytes)
        except ProtocolError as exc:
            self._dropped(exc)
        except Exception as exc:  # a bug of ours: it must not stop the I/O thread either
            self._failed(exc)

    def _admit(self, env: Envelope, link: Any) -> int | None:
        """The peer a (non-handshake) frame on ``link`` comes from: the authenticated peer of
        that link, which must be the frame's sender. None when the frame is refused (counted)."""
        peer = self._links.get(link)
        if peer is None:
            self._reject("unauthenticated", f"a {KIND_NAMES[env.kind]} frame claiming node "
                         f"{env.sender} on a link that never proved membership")
            return None
        if env.sender != peer:
            self._reject("spoofed_sender", f"a frame on node {peer}'s link claims to come from "
                         f"node {env.sender}")
            return None
        return peer

    def on_request(self, header: Any, buffers: list[Any], link: Any) -> Frame | None:
        """A REQ frame whose reply goes back in the same exchange (``Transport.request``):
        checked like any frame (:meth:`_admit`), served in this thread, the reply returned.

        The transport calls this on a thread that may block for the handler's duration (torch
        RPC: one of its request threads, of which it keeps some free for frames). At most
        ``handler_threads`` handlers run this way at once; past that, and while the sender's
        join is still being confirmed here (its LINK frame, sent before, may not be handled
        yet), this returns None and the sender sends the request as an ordinary frame.

        Raises:
            ProtocolError: the frame is malformed or refused (counted).
        """
        if not self.trusts(link):
            # Decode nothing a link sends before it joined. Its sender may still be joining
            # (its LINK frame not handled yet): the request comes again as an ordinary frame,
            # which the handshake parser refuses unless the join finished first.
            return None
        try:
            env = self.codec.decode(header, buffers, self._resolve_for(link))
        except ProtocolError as exc:
            self._dropped(exc)
            raise
        except Exception as exc:
            self._failed(exc)
            raise ProtocolError(f"malformed request: {type(exc).__name__}") from None
        if env.kind != REQ:
            self.on_dropped(f"a {KIND_NAMES[env.kind]} frame sent as a request")
            raise ProtocolError(f"a {KIND_NAMES[env.kind]} frame is not a request")
        if self._state != "listening":
            return None
        peer = self._admit(env, link)
        if peer is None:
            raise ProtocolError(f"node {self.node_id} refused a request claiming node {env.sender}")
        p = self._peers.get(peer)
        if p is None:
            # Its link is bound but the join is not finished on our I/O thread yet (this runs on
            # another thread): the ordinary frame comes after the join in order.
            return None
        if p.lost:
            return None  # as on_frame: the ordinary frame is dropped, the caller learns PeerLost
        if not self._request_slots.acquire(blocking=False):
            return None
        try:
            self._stats.received += 1
            p.last_seen = time.monotonic()
            return self._answer(env)
        finally:
            self._request_slots.release()

    def on_link_lost(self, peer: int, why: str) -> None:
        if self._state == "listening":
            self._peer_lost(peer, why)

    def on_dropped(self, why: str, cause: str = "malformed") -> None:
        if cause == "oversized":
            self._stats.dropped_oversized += 1
        else:
            self._stats.dropped_malformed += 1
        self._hostile_log(cause, f"node {self.node_id}: dropped a {cause} frame: {why}")

    def _dropped(self, exc: ProtocolError) -> None:
        """Count a frame the boundary refused (by cause) or the decoder found malformed."""
        if isinstance(exc, _handshake.Refused):
            self._reject(exc.cause, str(exc))
        else:
            self.on_dropped(str(exc), exc.cause)

    def _failed(self, exc: Exception) -> None:
        """A frame raised what no frame should (a bug): dropped and counted like a malformed one."""
        where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        self.on_dropped(f"{type(exc).__name__}: {exc} (at {where.filename}:{where.lineno}, a bug: "
                        "please report it)" if where else f"{type(exc).__name__}: {exc}", "error")

    def _resolve_for(self, link: Any) -> Callable[[int, Any], memoryview]:
        def resolve(sender: int, desc: Any) -> memoryview:
            # Descriptors only from the authenticated peer of this link, into its own pool.
            p = self._peers.get(self._links.get(link, -1))
            if p is None or p.node_id != sender or p.reader is None:
                raise ProtocolError(f"a shared-memory descriptor claiming node {sender} on a link "
                                    "without a shm route")
            return p.reader.view(desc)
        return resolve

    # ------------------------------------------------------------------ peer bookkeeping
    def _peer_joined(self, peer: Peer) -> None:
        with self._peers_changed:
            old = self._peers.get(peer.node_id)
            if old is not None and old.lost is None and old.info.get("incarnation") != peer.info.get("incarnation"):
                log.warning("node %d: node %d rejoined as a new process", self.node_id, peer.node_id)
                self._forget_pool_state(old)
            self._peers[peer.node_id] = peer
            self._peers_changed.notify_all()
        log.debug("node %d: peer %d joined via %s", self.node_id, peer.node_id, peer.route)
        # The handshake carried our subscriptions as they were then; send the current set on the
        # new link so a subscribe() racing with the join is never lost.
        if self.subscriptions():
            self._send_or_log(peer.node_id, SUBS, sorted(self.subscriptions()))

    def _peer_lost(self, node_id: int, why: str) -> None:
        with self._peers_changed:
            peer = self._peers.get(node_id)
            if peer is None or peer.lost:
                return
            unacked = peer.tx - peer.acked
            if unacked > 0:  # never counted as delivered: the sender learns it here
                why = f"{why}; {unacked} frame(s) sent to it were never acknowledged"
            peer.lost = why
            self._peers_changed.notify_all()
        log.info("node %d: peer %d lost: %s", self.node_id, node_id, why)
        self._forget_pool_state(peer)
        self._fail_calls(lambda p: PeerLost(f"node {p} {why}") if p == node_id else None)
        # Wake every sender blocked on its link now. Not from this thread: it may be the
        # transport's own callback, which must not close its socket under itself.
        threading.Thread(target=self._disconnect, args=(node_id,), daemon=True).start()

    def _disconnect(self, node_id: int) -> None:
        try:
            self.transport.disconnect(node_id)
        except Exception:
            log.debug("node %d: disconnect from node %d", self.node_id, node_id, exc_info=True)

    def _forget_pool_state(self, peer: Peer) -> None:
        if self._pool is not None:
            self._pool.peer_gone(peer.node_id)
        if peer.reader is not None:
            peer.reader.close()

    def _deliver(self, env: Envelope, peer: Peer, nbytes: int = 0) -> None:
        """Route one decoded frame of ``peer`` (authenticated, its sender). Runs on the
        transport's I/O thread: never runs user code."""
        self._stats.received += 1
        peer.last_seen = time.monotonic()
        if env.kind in _COUNTED:
            peer.rx += 1
        if env.kind == MSG:
            self._metrics.received(env.topic, env.nbytes)
            msg = Message(env.topic, env.payload, env.sender, env.sent_at)
            fn = self._subscriptions.get(env.topic)  # a dict read is atomic: no lock per message
            if fn is not None:
                self._put_blocking(self._handler_queue, (fn, msg), nbytes)
            else:
                self._put_blocking(self._inbox, msg, nbytes)
        elif env.kind == REQ:
            # Slots bound queued calls (released when served). A thread reading for itself
            # (recv(), a call or wait_released waiting) must not wait for handlers, which may
            # wait for it: its request queues past the bound (one per read at most).
            slot = self._handler_slots.acquire(blocking=not self._recv_caller.active)
            try:
                assert self._executor is not None
                self._executor.submit(self._serve, env, slot)
            except RuntimeError:  # pool shut down: we are stopping
                if slot:
                    self._handler_slots.release()
        elif env.kind in (REP_OK, REP_ERR):
            self._on_reply(env)
        elif env.kind == SUBS:
            topics = env.payload if isinstance(env.payload, list) else []
            with self._peers_changed:
                peer = self._peers.get(env.sender)
                if peer is not None:
                    peer.subscriptions = frozenset(t for t in topics if isinstance(t, str))
                    self._peers_changed.notify_all()
        elif env.kind == RELEASE:
            if self._pool is not None and isinstance(env.payload, list):
                for item in env.payload:
                    if isinstance(item, list) and len(item) == 3:
                        self._pool.release(env.sender, *item)
        elif env.kind == PING:
            self._on_ping(env)
        elif env.kind == RELAY:
            self._fanout.on_frame(env)
        elif env.kind == BYE:
            self._on_receipt(env.sender, env.payload)
            try:  # answer first: the peer waits for it before closing its links
                self._send_raw(env.sender, self._encode(REP_OK, "", None, env.corr), 1.0)
            except Exception as exc:
                log.debug("node %d: could not answer the farewell of node %d: %s", self.node_id, env.sender, exc)
            self._peer_lost(env.sender, "stopped (it called stop())")

    def _on_ping(self, env: Envelope) -> None:
        """A heartbeat: it carries the peer's receipt for our frames; answer a flush's ping."""
        self._on_receipt(env.sender, env.payload)
        if isinstance(env.payload, dict) and env.payload.get("want") is True:
            self._ping(env.sender, want=False, timeout=1.0)

    def _on_receipt(self, peer_id: int, payload: Any) -> None:
        rx = payload.get("rx") if isinstance(payload, dict) else None
        with self._peers_changed:
            peer = self._peers.get(peer_id)
            if peer is not None and type(rx) is int and peer.acked < rx <= peer.tx:
                peer.acked = rx
                self._peers_changed.notify_all()

    def _ping(self, peer_id: int, *, want: bool, timeout: float) -> None:
        p = self._peers.get(peer_id)
        if p is None or p.lost:
            return
        try:
            self._send_raw(peer_id, self._encode(PING, "", {"rx": p.rx, "want": want}), timeout)
            p.last_sent = time.monotonic()
        except MQError as exc:  # a full link: the data itself shows we are alive
            log.debug("node %d: heartbeat to node %d: %s", self.node_id, peer_id, exc)

    def _heartbeat_loop(self) -> None:
        """Ping idle peers (a ping carries our receipt), declare silent peers lost, and forget
        joins that never finished."""
        tick = min(self.heartbeat, 0.5)
        last = time.monotonic()
        while self._state == "listening":
            time.sleep(tick)
            now = time.monotonic()
            if now - last > tick + 1.0:
                # We were not scheduled (a loaded machine, a long GIL hold): frames may be waiting
                # unread, so nobody's silence is proven. Judge again from now on.
                self._stalled_until = max(self._stalled_until, now + self.heartbeat)
            last = now
            for p in self._peer_list():
                if p.lost:
                    continue
                if now - p.last_sent >= self.heartbeat:
                    self._ping(p.node_id, want=False, timeout=min(self.heartbeat, 0.5))
                silent = now - p.last_seen
                if silent > self.peer_timeout and now > self._stalled_until:
                    self._peer_lost(p.node_id, f"went silent for {silent:.1f}s (no heartbeat: its host "
                                               "crashed or the network between us is down)")
            with self._lock:
                for key, (_n, _peer, t) in list(self._pending.items()):
                    if now - t > self.timeout:
                        self._drop_pending(key, f"no LINK within {self.timeout:g}s")
                # Greet again whoever did not answer: it may have refused us while an earlier
                # process of our node id still looked alive to it, or started after us.
                stale = [(tok, target) for tok, (_n, target, t) in self._greetings.items()
                         if now - t > _REGREET_S]
                for token, _target in stale:
                    del self._greetings[token]
            for _token, target in stale:
                try:
                    self._greet(target)
                except (MQError, OSError) as exc:
                    log.debug("node %d: greeting %s again: %s", self.node_id, target, exc)

    def flush(self, peer: int, timeout: float | None = None) -> None:
        """Block until ``peer`` confirmed every message, call and reply sent to it so far.

        Raises:
            PeerLost: the peer died first; the message says how many frames it never confirmed.
            Timeout: no confirmation within ``timeout`` seconds.
        """
        timeout = self._timeout(timeout)
        self._wait_peer(peer, timeout)
        p = self._peers[peer]
        target = p.tx
        self._ping(peer, want=True, timeout=timeout)

        def done() -> bool:
            if p.lost:
                raise PeerLost(f"node {peer} {p.lost}")
            return p.acked >= target

        self._wait(done, timeout, lambda: f"node {peer} confirmed {p.acked} of {target} frames "
                                          f"within {timeout:g}s")

    def _on_reply(self, env: Envelope) -> None:
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
                fut.set_exception(_remote_error(env))
        except InvalidStateError:  # the call already failed (peer lost, stop) or timed out
            self._stats.dropped_unexpected_reply += 1

    # ------------------------------------------------------------------ internals
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
            return self._encode(kind, env.topic, answer, env.corr)
        except EncodeError as exc:
            return self._encode(REP_ERR, env.topic, _error_payload(exc), env.corr)

    def _serve(self, env: Envelope, slot: bool = True) -> None:
        try:
            self._deliver_to([env.sender], self._answer(env), time.monotonic() + self.timeout)
        except MQError as exc:
            log.warning("node %d: could not answer call %r from node %d: %s",
                        self.node_id, env.topic, env.sender, exc)
        finally:
            if slot:
                self._handler_slots.release()

    def _dispatch_loop(self) -> None:
        while self._state in ("new", "listening") or not self._handler_queue.empty():
            try:
                fn, msg = self._handler_queue.get(timeout=0.1)
            except queue.Empty:
                if self._state not in ("new", "listening"):
                    return
                continue
            self._metrics.delivered(msg.topic, msg.sent_at)
            try:
                fn(msg)
            except Exception:
                log.exception("node %d: handler for %r raised", self.node_id, msg.topic)

    def _put_blocking(self, q: "BoundedQueue", item: Any, nbytes: int = 0) -> None:
        # Block the I/O thread while the queue is full: the transport stops reading and the
        # sender feels backpressure. Wake up now and then to notice stop(). While blocked we
        # read nobody's heartbeats, so silence is nobody's fault: liveness waits.
        if self._recv_caller.active:
            # A thread reading for itself, the queues not full when it started: the frames of
            # one transport message (a batch) go in past the bound, or it would wait on itself
            # (its inbox) or on handlers that may wait for it.
            q.put_now(item, nbytes)
            return
        while not q.put(item, 0.2, nbytes):
            self._stalled_until = time.monotonic() + self.peer_timeout
            if self._state != "listening":
                return

    def _encode(self, kind: int, topic: str, payload: Any, corr: int = 0) -> Frame:
        return self.codec.encode(kind, topic, self.node_id, next(self._seq), corr, payload)

    def _send_frame(self, peer: int, kind: int, topic: str, payload: Any, *, timeout: float,
                    corr: int = 0) -> None:
        self._deliver_to([peer], self._encode(kind, topic, payload, corr), time.monotonic() + timeout)

    def _send_checked(self, peer: int, frame: Frame, timeout: float) -> Receipt | None:
        if self._state != "listening":
            raise ClosedError(self._not_listening("send"))
        p = self._peers.get(peer)
        if p is None:
            raise PeerLost(f"node {peer} is not a known peer of node {self.node_id}; known: {self.peers()}")
        if p.lost:
            raise PeerLost(f"node {peer} {p.lost}")
        if p.max_frame_bytes is not None and frame.nbytes > p.max_frame_bytes:
            raise ConfigError(f"a frame of {frame.nbytes} bytes exceeds node {peer}'s max_frame_bytes="
                              f"{p.max_frame_bytes}: send smaller pieces, or raise max_frame_bytes on "
                              f"node {peer}; nothing was sent")
        try:
            receipt = self.transport.send(peer, frame, timeout)
        except (ClosedError, Timeout):
            if p.lost:  # the link was torn down under us because the peer died
                raise PeerLost(f"node {peer} {p.lost}") from None
            raise
        if frame.kind in _COUNTED:
            p.tx += 1
        p.last_sent = time.monotonic()
        self._stats.sent += 1
        return receipt

    def _send_raw(self, peer: int, frame: Frame, timeout: float) -> None:
        """Control frames (handshake, farewell, releases): inline, receipt awaited."""
        receipt = self.transport.send(peer, frame, timeout)
        if receipt is not None:
            receipt()

    def _wait_peer(self, peer: int, timeout: float) -> None:
        if not isinstance(peer, int) or isinstance(peer, bool):
            raise ConfigError(f"peer must be a node id (int), got {peer!r}")
        if peer == self.node_id:
            raise ConfigError(f"node {peer} is this node; send to another node id")
        if self._state != "listening":
            raise ClosedError(self._not_listening("send"))
        p = self._peers.get(peer)
        if p is not None and p.lost is None:
            return
        if p is not None and p.lost:
            raise PeerLost(f"node {peer} {p.lost}")
        self._wait(lambda: peer in self._peers, timeout,
                   lambda: f"node {peer} has not joined within {timeout:g}s; peers: {self.peers()}"
                           f"{self._unanswered()}")

    def _wait(self, ready: Callable[[], bool], timeout: float | None, what: Callable[[], str]) -> None:
        deadline = time.monotonic() + self._timeout(timeout)
        with self._peers_changed:
            while not ready():
                if self._refusal is not None:
                    raise self._refusal
                if self._state != "listening":
                    raise ClosedError("the queue is not listening")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Timeout(what())
                self._peers_changed.wait(min(left, 0.5))

    def _not_listening(self, what: str) -> str:
        if self._state == "new":
            return f"{what} on a queue that is not listening yet: use `with q:` or q.listen() first"
        return f"{what} after stop(): {_STOPPED}"

    def _unanswered(self) -> str:
        """Which of our greetings nobody answered: the addresses to check."""
        with self._lock:
            targets = sorted({str(t) for _n, t, _w in self._greetings.values()})
        refused = {k: v for k, v in self._stats.rejected.items() if k in ("refused", "bad_proof", "duplicate_id")}
        text = f"; no answer from {', '.join(targets)} (is a node listening there, with the same job secret?)" \
            if targets else ""
        return text + (f"; refused: {refused}" if refused else "")

    def _peer_list(self) -> list[Peer]:
        with self._peers_changed:
            return list(self._peers.values())

    def _live_peers(self) -> list[int]:
        return [p.node_id for p in self._peer_list() if not p.lost]

    def _fail_calls(self, error_for: Callable[[int], MQError | None]) -> None:
        """Fail the calls waiting for a REP frame (a call inside ``transport.request`` learns
        its fate from the transport: an answer sent before a peer's goodbye may still come)."""
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
        return _seconds(timeout, "timeout")

    def __repr__(self) -> str:
        return (f"<MQ {self.mq_type} node={self.node_id} labels={sorted(self.labels)} "
                f"{self._state} peers={self.peers()}>")


def _preload_torch() -> None:
    """Import torch now, if it is installed, rather than at the first tensor a peer sends.

    Importing it holds the GIL for a second or more (several on a loaded machine); mid-job
    that silences our heartbeats long enough for peers to think we died.
    """
    import importlib.util
    import sys

    if "torch" not in sys.modules and importlib.util.find_spec("torch") is not None:
        from mq.codec import _load_torch

        _load_torch()


def _domain(loc: Any) -> str | None:
    """The shared-memory domain of a wire-form locality (see :meth:`MQ.host_of`)."""
    if not isinstance(loc, dict) or not loc.get("boot_id"):
        return None
    return f"{loc['boot_id']}/{loc.get('ipc_ns')}/{loc.get('net_ns')}"


def _seconds(value: Any, name: str) -> float:
    """A finite, non-negative number of seconds, or a ConfigError that says so."""
    if type(value) in (int, float) and 0 <= value <= _MAX_TIMEOUT_S:  # the usual case, per call
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number of seconds (int or float), got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise ConfigError(f"{name} must be a finite number of seconds, got {value!r}: for a long "
                          "wait pass a large number such as 3600")
    if value < 0:
        raise ConfigError(f"{name} must be >= 0 seconds, got {value!r}")
    return min(float(value), _MAX_TIMEOUT_S)


def _on_cpu(buf: Any) -> bool:
    device = getattr(buf, "device", None)
    return device is None or getattr(device, "type", "cpu") == "cpu"


class _RecvCaller(threading.local):
    """Per thread: ``active`` while this thread is in ``recv()``, reading for itself. (A class
    default, not getattr(..., False): a missing attribute costs an exception per message.)"""

    active = False


class BoundedQueue:
    """A FIFO bounded in messages and in bytes, for one producer (the I/O thread) and any
    consumers.

    The hand-off between the I/O thread and ``recv()`` is on the small-message hot path, so items
    go through the C SimpleQueue and the count bound is its size: no Python-level lock or
    semaphore per message. Only a producer facing a full queue waits on a Condition, and a
    consumer notifies only when somebody waits. Bytes are counted (under a lock) only for items
    of at least ``BIG`` bytes: smaller ones are bounded by the count.
    """

    BIG = 64 << 10

    def __init__(self, capacity: int, max_bytes: int = 1 << 62):
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._capacity = capacity
        self._space = threading.Condition()
        self._waiting = 0  # producers waiting for space
        self._max_bytes = max_bytes
        self._bytes = 0
        self._bytes_cond = threading.Condition()

    def put(self, item: Any, timeout: float, nbytes: int = 0) -> bool:
        """Add ``item``; False if the queue stayed full for ``timeout`` seconds. One item always
        fits in an empty queue, whatever its size."""
        if nbytes >= self.BIG:
            with self._bytes_cond:
                if not self._bytes_cond.wait_for(
                        lambda: self._bytes == 0 or self._bytes + nbytes <= self._max_bytes, timeout):
                    return False
                self._bytes += nbytes
        if self._items.qsize() >= self._capacity:
            with self._space:
                self._waiting += 1  # before looking again: a consumer seeing it will notify
                try:
                    room = self._space.wait_for(lambda: self._items.qsize() < self._capacity, timeout)
                finally:
                    self._waiting -= 1
            if not room:
                self._unbytes(nbytes)
                return False
        self._items.put((item, nbytes))
        return True

    def put_now(self, item: Any, nbytes: int = 0) -> None:
        """Add ``item`` past the bounds: for a consumer's own thread, which cannot wait for
        itself to make room."""
        if nbytes >= self.BIG:
            with self._bytes_cond:
                self._bytes += nbytes
        self._items.put((item, nbytes))

    def get(self, timeout: float) -> Any:
        """Next item; raises queue.Empty after ``timeout`` seconds."""
        return self._taken(self._items.get(timeout=timeout))

    def get_nowait(self) -> Any:
        return self._taken(self._items.get_nowait())

    def _taken(self, entry: tuple[Any, int]) -> Any:
        item, nbytes = entry
        if self._waiting:
            with self._space:
                self._space.notify()
        if nbytes >= self.BIG:
            self._unbytes(nbytes)
        return item

    def _unbytes(self, nbytes: int) -> None:
        if nbytes >= self.BIG:
            with self._bytes_cond:
                self._bytes -= nbytes
                self._bytes_cond.notify_all()

    def empty(self) -> bool:
        return self._items.empty()

    def full(self) -> bool:
        return self._items.qsize() >= self._capacity

    def depth(self) -> dict[str, int]:
        return {"messages": self._items.qsize(), "bytes": self._bytes}


def _check_topic(topic: Any) -> None:
    if not isinstance(topic, str) or not topic:
        raise ConfigError(f"topic must be a non-empty str, got {topic!r}")


def _remote_error(env: Envelope) -> RemoteError:
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
