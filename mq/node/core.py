"""The MQ a user holds: the public API, its options and its lifecycle.

:class:`MQ` is a facade. It checks what the user passes and hands the work to the parts that
own it, each in its own module::

    mq.node.waits      Waits       the one way its threads block (ended by peer loss and stop)
    mq.node.peers      PeerTable   peers, link bindings, joined/lost transitions, routes
    mq.node.join       Join        greetings, HELLO/HELLO_ACK/LINK, proofs, route choice per peer
    mq.node.dispatch   Dispatch    the transport's Events: admission, the switch on frame kind
    mq.node.delivery   Delivery    subscriptions, the bounded queues, the handler thread, recv()
    mq.node.calls      Calls       the corr -> future table, serving ``on`` handlers
    mq.node.liveness   Liveness    heartbeat, receipts, flush, farewell
    mq.node.sender     Sender      per-peer data paths (inline | shm), sequence numbers, releases
    mq.fanout.relays     Fanout      one transfer per host for large publishes (relays)

Data flows one way::

    user -> MQ -> Sender -> transport.send -> wire
    wire -> transport I/O thread -> Dispatch -> Join | Delivery (queues, handlers) | Calls
                                               | Liveness | Fanout

Thread rules: frames arrive on the transport's I/O thread, which never runs user code;
subscription handlers run on one thread (in order), ``on`` handlers on a small pool, or, for a
call the transport answers in one exchange, on the transport's request thread.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Iterable

from mq import auth as _auth
from mq.fanout import relays as _fanout
from mq import metrics as _metrics
from mq.node import peer_route
from mq.node.calls import Calls, remote_error
from mq.wire.codec import MSG, REP_OK, REQ, SUBS, Codec, watch_torch_import
from mq.node.delivery import Delivery
from mq.node.dispatch import Dispatch
from mq.errors import ClosedError, ConfigError, MQError, Timeout, Undelivered
from mq.node.join import Join
from mq.node.lifecycle import STOPPED, Lifecycle
from mq.node.liveness import Liveness
from mq.locality import Locality, local
from mq.node.message import Message
from mq.node.node_options import MAX_TIMEOUT_S, NodeOptions
from mq.node.node_options import seconds as _seconds
from mq.node.peers import MIN_WINDOW, PeerTable, domain
from mq.routing import Route
from mq.node.sender import Sender
from mq.node.stats import Refusals, Stats
from mq.transport import Transport
from mq.node import waits as waits_mod
from mq.node.waits import LIVE_OR_STOPPING, Waits

log = logging.getLogger("mq")

# How often the heartbeat reads the transport library's drop counters (stats() reads them too,
# so whoever looks sees them all). NNG's statistics come as a copy of the whole process's tree
# (every socket and pipe, ~2 ms for 16 nodes of a mesh in one process): every 30 s in each node
# of a large job was a few per cent of a core.
NATIVE_DROPS_EVERY_S = 300.0


class MQ:
    """A node's message queue. Create one with :func:`mq.create`.

    Args:
        node_id: this node's unique integer id.
        labels: roles of this node (``{"learner"}``); peers find it with ``peers(label=)``.
        transport: what moves frames (built by :func:`mq.create` from the mq type).
        codec: how payloads become frames (default: mq's, with ``allow_pickle``).
        mq_type: the mq type it was made as (peers see it in the join).
        options: the node's own options (:class:`~mq.node.node_options.NodeOptions`: ``queue_size``,
            ``timeout``, ``heartbeat``, ...), given as keywords; validated once, here.
    """

    def __init__(self, node_id: int, labels: Iterable[str] | str | None = None, *,
                 transport: Transport, codec: Codec | None = None, mq_type: str | None = None,
                 **options: Any):
        _check_identity(node_id, labels)
        self.options = opts = NodeOptions.of(options)
        self.node_id = node_id
        self.labels = frozenset([labels] if isinstance(labels, str) else (labels or ()))
        self.timeout = opts.timeout
        self.transport = transport
        self.backend_name = transport.name
        self.mq_type = mq_type or transport.name
        self.max_frame_bytes = opts.max_frame_bytes
        self.codec = codec or Codec(allow_pickle=opts.allow_pickle)
        self.codec.keep_tensors = transport.keeps_tensors
        self.codec.max_frame_bytes = opts.max_frame_bytes
        self.locality: Locality = local()
        self.incarnation = uuid.uuid4().hex
        self.secret = _auth.resolve_secret(opts.secret, opts.insecure)  # the transport signs with it too
        self.heartbeat = opts.heartbeat
        self.peer_timeout = opts.peer_timeout
        # The collaborators, each built from what it needs and only from those built before it:
        # state (life, stats, metrics, peers), then sending, calls, liveness, delivery, joining,
        # fan-out, and dispatch, which reads every frame and so takes all of them.
        self._life = life = Lifecycle()
        self._waits = waits = Waits(lambda: life.state)
        life.moved = waits.wake_all  # a stop wakes every wait and loop of the node
        self._stats = stats = Stats()
        self._metrics = metrics = _metrics.Metrics()
        self._refusals = refusals = Refusals(node_id, stats)
        # host_of(node_id), asked by every large publish: the descriptor's to_dict() cost ~60 us
        self._peers = peers = PeerTable(node_id, life, domain(self.locality.to_dict()), waits)
        self._sender = sender = Sender(node_id, transport, self.codec, peers, life, stats, metrics,
                                       shm=opts.shm, shm_options=(opts.shm_pool_bytes, opts.shm_inline_max),
                                       cuda=opts.cuda, cuda_pool_bytes=opts.cuda_pool_bytes,
                                       cuda_inline_max=opts.cuda_inline_max,
                                       incarnation=self.incarnation, path_options={
                                           "rdma": opts.rdma, "rdma_pool_bytes": opts.rdma_pool_bytes,
                                           "rdma_inline_max": opts.rdma_inline_max, "secret": self.secret,
                                           "locality": self.locality, "require_route": opts.require_route})
        self._calls = calls = Calls(node_id, sender, peers, transport, self.codec, life, stats, refusals, waits,
                                    handler_threads=opts.handler_threads, timeout=self.timeout)
        self._liveness = liveness = Liveness(node_id, sender, peers, calls, life, stats, heartbeat=self.heartbeat,
                                             peer_timeout=self.peer_timeout)
        sender.on_traffic = liveness.traffic
        # A reader held up (an rdma pull, handlers all busy, a full queue): silence proves nothing.
        sender.rdma.reader_busy = calls.reader_busy = liveness.reader_busy
        self._delivery = delivery = Delivery(node_id, transport, life, metrics, waits, calls.has_room,
                                             liveness.reader_busy, queue_size=opts.queue_size,
                                             queue_bytes=opts.queue_bytes)
        window = max(opts.queue_size, MIN_WINDOW)
        hello = {"labels": sorted(self.labels), "locality": self.locality.to_dict(),
                 "incarnation": self.incarnation, "mq_type": self.mq_type,
                 "max_frame_bytes": opts.max_frame_bytes, "window": window}
        self._subs_order = threading.Lock()  # see _announce_subscriptions
        self._join = join = Join(node_id, hello, self.locality, delivery.topics, self._announce_subscriptions,
                                 transport, sender, peers, refusals, life, secret=self.secret, timeout=self.timeout,
                                 required=opts.require_route,
                                 world_size=getattr(getattr(transport, "rendezvous", None), "world_size", None))
        self._fanout = fanout = _fanout.Fanout(
            node_id, peers, sender, self.codec, refusals, life, ping=liveness.ping, deliver=delivery.deliver,
            reader_busy=liveness.reader_busy, min_bytes=opts.relay_min_bytes, shape=opts.relay_shape,
            keeps_tensors=transport.keeps_tensors, timeout=self.timeout, streams_to=transport.streams_to)
        self._native_seen: dict[str, int] = {}  # the transport's own drops counted so far
        self._native_due = 0.0
        self._dispatch = Dispatch(node_id, self.codec, peers, join, delivery, calls, liveness, sender, fanout,
                                  life, stats, refusals, max_frame_bytes=opts.max_frame_bytes, secret=self.secret,
                                  window=window)
        # A lost peer: its pools are freed, its link closed (waits on it end by themselves: mq.node.waits).
        for hook in (sender.forget, sender.disconnect):
            peers.on_lost(hook)
        # The send path, bound once (see scripts/hotpath).
        self._encode = sender.encode
        self._deliver_to = sender.deliver_to
        self._peer_get = peers.get
        self._beat: Any = None

    # ------------------------------------------------------------------ lifecycle
    def listen(self) -> "MQ":
        """Open the transport and join the peers. Idempotent."""
        if self._life.state == "listening":
            return self
        if self._life.state != "new":
            raise ClosedError(STOPPED)
        self._calls.start()
        self._delivery.start()
        self._life.move("listening")
        try:
            watch_torch_import(self._liveness.stalled)  # a first tensor in: our reader imports torch
            self._sender.open_pool()
            peer_route.check_required_here(self.options.require_route, self._sender.rdma.unavailable)
            for target in list(self.transport.start(self._dispatch)):
                self._join.greet(target)
            self._beat = threading.Thread(target=self._liveness.run, args=(self._housekeeping,), daemon=True,
                                          name=f"mq{self.node_id}-heartbeat")
            self._beat.start()
        except BaseException:
            self.stop(timeout=2.0, raise_undelivered=False)
            raise
        return self

    def stop(self, timeout: float = 5.0, *, raise_undelivered: bool = True) -> Undelivered | None:
        """Leave the job: wait (up to ``timeout`` seconds) until every peer confirmed what was
        sent to it, tell peers, close the transport. Returns within ``timeout`` seconds (plus
        a little), even when peers died.

        Raises:
            Undelivered: live peers did not confirm every message sent to them in time (their
                receivers were slower than ``timeout``); it names each peer and how many. With
                ``raise_undelivered=False`` it is logged and returned instead.
        """
        timeout = _seconds(timeout, "timeout")
        if self._life.state != "listening":
            self._life.move("stopped")
            return None
        deadline = time.monotonic() + timeout
        self._life.move("stopping")  # no new sends; answers to calls still go (waits look now)
        # Most of the time is the receivers' to confirm; the rest closes the links.
        until = deadline - min(0.5, timeout / 5)
        unconfirmed = self._liveness.farewell(until)
        self._calls.finish(until)  # calls that reached us before our goodbye are answered
        try:
            self.transport.close(max(0.1, deadline - time.monotonic()))
        except Exception:  # never let a broken transport keep the node alive
            log.exception("node %d: error while closing the transport", self.node_id)
        self._life.move("stopped")
        self._sender.close()
        self._calls.close()
        self._peers.wake()
        self._delivery.finish(max(0.0, deadline - time.monotonic()))
        if not unconfirmed:
            return None
        lost = {peer: p.lost for peer in unconfirmed if (p := self._peer_get(peer)) is not None and p.lost}
        error = Undelivered(unconfirmed, timeout, lost)
        if raise_undelivered:
            raise error
        log.warning("node %d: %s", self.node_id, error)
        return error

    def __enter__(self) -> "MQ":
        return self.listen()

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        # An exception on its way out is the news; what stop() could not deliver is logged.
        self.stop(raise_undelivered=exc_type is None)

    @property
    def running(self) -> bool:
        return self._life.state == "listening"

    @property
    def addresses(self) -> dict[str, str]:
        """Where peers reach this node, by kind (``tcp``, ``ipc``, ...), once listening."""
        return dict(self.transport.addresses)

    @property
    def waits(self) -> Waits:
        """This node's waits (:class:`mq.node.waits.Waits`), for code built on a node (streams,
        channels): ``waits.until(ready, deadline, on=..., peers=...)`` ends when a peer it
        depends on is lost or the node stops; ``waits.wake(obj)`` wakes the waits on ``obj``."""
        return self._waits

    @property
    def shm_unavailable(self) -> str | None:
        """Why this node has no shared-memory pool (None when it has one, or before listen())."""
        return self._sender.shm_unavailable

    # ------------------------------------------------------------------ subscriptions
    def subscribe(self, topic: str, fn: Callable[[Message], Any] | None = None) -> None:
        """Receive ``topic``: into :meth:`recv`, or by calling ``fn(message)`` off the I/O thread."""
        _check_topic(topic)
        if fn is not None and not callable(fn):
            raise ConfigError(f"subscribe({topic!r}, fn): fn must be callable or None, got {type(fn).__name__}")
        self._delivery.subscribe(topic, fn)
        self._announce_subscriptions()

    def unsubscribe(self, topic: str) -> None:
        _check_topic(topic)
        self._delivery.unsubscribe(topic)
        self._announce_subscriptions()

    def subscriptions(self) -> frozenset[str]:
        return self._delivery.topics()

    def _announce_subscriptions(self, to: list[int] | None = None) -> None:
        """Send our topics to ``to`` (a peer that just joined) or to every live peer.

        One thread at a time from taking the set to sending it: a join's announcement (on the
        I/O thread) and a subscribe() racing with it reach the peer in the order their sets
        were taken. Taken in one order and sent in the other, the older set arrived last and
        undid the newer: a topic subscribed as the peer joined never reached it."""
        with self._subs_order:
            topics = sorted(self.subscriptions())
            if to is None:
                if self._life.state != "listening":
                    return  # announced in the handshake instead
                to = self._peers.live()
            for peer in to:
                try:
                    self._sender.send_control(peer, SUBS, topics, self.timeout)
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
        p = self._peer_get(peer) if type(peer) is int else None
        if p is None or p.lost is not None or self._life.state != "listening":
            # says what is wrong, or waits for the peer to join
            self._peers.wait_peer(peer, timeout, self._join.unanswered)
        self._deliver_to([peer], self._encode(MSG, topic, payload), deadline)

    def publish(self, topic: str, payload: Any, *, timeout: float | None = None) -> list[int]:
        """Send to every peer subscribed to ``topic``; returns their node ids.

        Peers that have not joined yet do not receive it: use :meth:`wait_for_subscribers`.
        The payload is encoded once; same-host subscribers share one shared-memory copy.
        """
        _check_topic(topic)
        timeout = self._timeout(timeout)
        deadline = time.monotonic() + timeout
        targets = self._peers.subscribers(topic)
        if targets:
            frame = self._encode(MSG, topic, payload)
            if not self._fanout.publish(targets, frame, deadline):  # one copy per host, if it pays
                self._deliver_to(targets, frame, deadline)
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
        self._peers.wait_peer(peer, timeout, self._join.unanswered)
        corr = self._calls.new_corr()
        frame = self._encode(REQ, topic, payload, corr)
        try:
            if self.transport.answers_requests:
                env = self._calls.request(peer, frame, deadline)
                if env is not None:
                    if env.kind == REP_OK:
                        return env.payload
                    raise remote_error(env)
            # A REQ frame; the REP frame resolves the future (dispatch -> Calls.on_reply).
            with self._calls.pending(peer, corr) as fut, self._waits.depend((peer,)):
                self._deliver_to([peer], frame, deadline)
                answered = self._calls.answered(peer, corr, fut)  # True, or PeerLost (not promised)
                self._delivery.read_while(answered, deadline)
                self._waits.until(answered, deadline, on=(fut,), states=LIVE_OR_STOPPING,
                                  what=lambda: _no_answer(peer, topic, timeout))
                return waits_mod.result(fut, 0)
        except FutureTimeout:
            raise Timeout(_no_answer(peer, topic, timeout)) from None

    def on(self, topic: str, fn: Callable[[Any], Any]) -> None:
        """Serve :meth:`call` on ``topic``: ``fn(payload)`` returns the answer."""
        _check_topic(topic)
        if not callable(fn):
            raise ConfigError(f"on({topic!r}, fn): fn must be callable, got {type(fn).__name__}")
        self._calls.serve(topic, fn)

    def flush(self, peer: int, timeout: float | None = None) -> None:
        """Block until ``peer`` confirmed every message, call and reply sent to it so far.

        Raises:
            PeerLost: the peer died first; the message says how many frames it never confirmed.
            Timeout: no confirmation within ``timeout`` seconds.
        """
        timeout = self._timeout(timeout)
        p = self._peer_get(peer) if type(peer) is int else None
        if p is None or p.lost is None:  # (one that left is judged by what it confirmed)
            self._peers.wait_peer(peer, timeout, self._join.unanswered)
        self._liveness.flush(peer, timeout)

    # ------------------------------------------------------------------ shared buffers
    def alloc(self, shape: Any, dtype: Any = "float32", device: Any = None) -> Any:
        """A numpy array (numpy dtype) or torch tensor (torch dtype) in this node's
        shared-memory pool, or with ``device="cuda:N"`` a tensor in its CUDA pool on that GPU.
        Sending it to same-host peers passes a handle (no copy: the cost does not depend on
        its size); to other peers it is sent like any array.

        Ownership: receivers get views of this very memory. Write it again only after
        :meth:`wait_released`; until then the numpy array is read-only (torch tensors cannot
        be, so the rule is on you).

        Raises:
            ConfigError: the pool is not available (the reason is in ``shm_unavailable``), or a
                bad shape/dtype/device.
        """
        index = _cuda_index(device)
        if index is None:
            return self._sender.need_pool().alloc(shape, dtype)
        try:
            return self._sender.gpu.pool_for(index).alloc(shape, dtype)
        except MQError as exc:
            raise ConfigError(str(exc)) from None

    def wait_released(self, buf: Any, timeout: float | None = None) -> None:
        """Block until every receiver dropped its view of ``buf`` (from :meth:`alloc`).

        Raises:
            Timeout: a receiver still holds it after ``timeout`` seconds.
        """
        if getattr(buf, "is_cuda", False):
            try:
                pool: Any = self._sender.gpu.pool_of(buf)
            except MQError as exc:
                raise ConfigError(str(exc)) from None
        else:
            pool = self._sender.need_pool()
        timeout = self._timeout(timeout)
        deadline = time.monotonic() + timeout
        if pool.holders_of(buf):  # (raises ConfigError for a buffer not from alloc())
            self._delivery.read_while(lambda: not pool.holders_of(buf), deadline)
        pool.wait_released(buf, max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ receiving
    def recv(self, timeout: float | None = None) -> Message:
        """Next message of a subscribed topic (or sent to this node) without a handler.

        Raises:
            Timeout: nothing arrived within ``timeout`` seconds (default: the queue's timeout).
        """
        if timeout is None:
            timeout = self.timeout
        elif type(timeout) is not float or not 0 <= timeout <= MAX_TIMEOUT_S:  # (the check, off the hot path)
            timeout = _seconds(timeout, "timeout")
        return self._delivery.recv(timeout)

    # ------------------------------------------------------------------ peers
    def peers(self, label: str | None = None) -> list[int]:
        """Node ids of live peers, optionally only those with ``label``."""
        return self._peers.ids(label)

    def routes(self) -> dict[int, Route]:
        """The route to each live peer, e.g. ``{1: Route(kind="shm", ...)}``: the path the
        bytes of a large CPU buffer take to that peer."""
        return self._peers.routes()

    def labels_of(self, peer: int) -> frozenset[str] | None:
        """The labels ``peer`` joined with (None for a node that is not a peer)."""
        p = self._peer_get(peer)
        return p.labels if p is not None else None

    def host_of(self, peer: int) -> str | None:
        """The shared-memory domain ``peer`` runs in (boot id and IPC namespace; None if unknown):
        peers with the same id can share one copy, so fan-out can send once per domain. Two
        containers or network-namespace "hosts" on one machine are two domains. ``host_of`` of
        this node's own id is its own domain."""
        return self._peers.host_of(peer)

    def wait_for_peers(self, count: int | None = None, *, ids: Iterable[int] | None = None,
                       label: str | None = None, timeout: float | None = None) -> list[int]:
        """Block until ``count`` peers (with ``label``) or the peers ``ids`` have joined."""
        if self._life.state == "new":  # (a stopped queue answers as before: peers gone)
            self._life.check("wait_for_peers()")
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

        self._peers.wait(ready, self._timeout(timeout), lambda: (
            f"peers {sorted(want)} / count {count} (label={label}) did not join; have "
            f"{self.peers(label)}{self._join.unanswered()}"))
        return self.peers(label)

    def wait_for_subscribers(self, topic: str, count: int = 1, *, timeout: float | None = None) -> list[int]:
        """Block until ``count`` live peers subscribe to ``topic``; returns their ids."""
        if self._life.state == "new":  # (a stopped queue answers as before: peers gone)
            self._life.check("wait_for_subscribers()")
        _check_topic(topic)
        if type(count) is not int or count < 0:
            raise ConfigError(f"count must be an int >= 0, got {count!r}")
        subs = self._peers.subscribers
        self._peers.wait(lambda: len(subs(topic)) >= count, self._timeout(timeout),
                         lambda: f"{count} subscriber(s) of {topic!r} did not appear; have {subs(topic)}")
        return subs(topic)

    # ------------------------------------------------------------------ numbers and options
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
            "queues": self._delivery.depths(),
            "drops": {"malformed": s.dropped_malformed, "oversized": s.dropped_oversized,
                      "unexpected_reply": s.dropped_unexpected_reply, **s.dropped},
            "rejected": dict(s.rejected),
            "routes": {p: r.kind for p, r in self.routes().items()},
            "peers_lost": {p.node_id: p.lost for p in self._peers.list() if p.lost},
            "shm": dict(s.shm),
        })
        return snap

    def set_metric(self, name: str, value: Any) -> None:
        """Publish a value under ``name`` in :meth:`metrics` (channels report policy lag so)."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"metric name must be a non-empty str, got {name!r}")
        self._metrics.gauges[name] = value

    def set_relay(self, min_bytes: int | None, shape: str = "auto") -> None:
        """Change fan-out across hosts (``relay_min_bytes``/``relay_shape`` of the
        constructor; see :mod:`mq.fanout.relays`): None turns relaying off."""
        self._fanout.configure(min_bytes, shape)

    def stats(self) -> Stats:
        """Counters: frames sent/received, drops and refusals by cause (the transport's own
        library's drops too, e.g. NNG's), the pool's and fan-out's (``relay``)."""
        self._count_native_drops()
        if self._sender.pool is not None:
            self._stats.shm = self._sender.pool_stats()
        self._stats.cuda = self._sender.gpu_stats()
        self._stats.rdma = self._sender.rdma.counters()
        self._stats.relay = dict(self._fanout.stats)
        return self._stats

    def _housekeeping(self, now: float) -> bool:
        """The heartbeat thread's chores: the join's expiries; now and then, what the
        transport's library dropped (logged as it is counted). True while a join is under way."""
        if now >= self._native_due:
            self._native_due = now + NATIVE_DROPS_EVERY_S
            self._count_native_drops()
        if self._life.listening:
            self._join.expire(now)
            return self._join.under_way()
        return False

    def _count_native_drops(self) -> None:
        try:
            counts = self.transport.native_drops()
        except Exception:  # counters are no reason to disturb the node
            log.debug("node %d: reading the transport's drop counters", self.node_id, exc_info=True)
            return
        for cause, total in counts.items():
            new = total - self._native_seen.get(cause, 0)
            if new > 0:
                self._native_seen[cause] = total
                self._refusals.dropped(f"{new} frame(s) or connection(s) dropped by {self.backend_name} itself "
                                       f"({cause})", cause, new)

    def _timeout(self, timeout: float | None) -> float:
        if timeout is None:
            return self.timeout
        return _seconds(timeout, "timeout")

    def __repr__(self) -> str:
        return (f"<MQ {self.mq_type} node={self.node_id} labels={sorted(self.labels)} "
                f"{self._life.state} peers={self.peers()}>")


def _no_answer(peer: int, topic: str, timeout: float) -> str:
    return f"node {peer} did not answer call {topic!r} within {timeout:g}s (pass timeout= to wait longer)"


def _check_topic(topic: Any) -> None:
    if not isinstance(topic, str) or not topic:
        raise ConfigError(f"topic must be a non-empty str, got {topic!r}")


def _cuda_index(device: Any) -> int | None:
    """None for host memory, else the CUDA device index ``device`` names."""
    if device is None or device == "cpu" or getattr(device, "type", None) == "cpu":
        return None
    text = str(device)
    if text == "cuda":
        import torch

        return torch.cuda.current_device()
    head, _, index = text.partition(":")
    if head != "cuda" or not index.isdigit():
        raise ConfigError(f"device must be None, 'cpu' or 'cuda:N', got {device!r}")
    return int(index)


def _check_identity(node_id: Any, labels: Any) -> None:
    if not isinstance(node_id, int) or isinstance(node_id, bool) or node_id < 0:
        raise ConfigError(f"node_id must be a non-negative int, got {node_id!r}")
    if labels is not None and not isinstance(labels, str) and not (
            hasattr(labels, "__iter__") and all(isinstance(x, str) for x in labels)):
        raise ConfigError(f"labels must be a str or an iterable of str (e.g. {{'learner'}}), got {labels!r}")
