"""The MQ a user holds, and everything every backend shares.

An :class:`MQ` holds one transport (:mod:`mq.transport`: NNG, torch RPC, in-process) and owns
everything a user sees: the join handshake, subscriptions, calls, farewell, queues, drop
counting, routes and the shm data path. Data flows one way::

    publish/send/call -> codec.pack -> data path per peer (inline | shm descriptor)
        -> transport.send(peer, frame) -> wire
    wire -> transport I/O thread -> MQ.on_frame -> codec.decode (shm views) -> queue | handler

Joining: a node greets each target its transport names (``attach_to`` addresses, or the ranks of
a torch RPC group) with HELLO (node id, labels, subscriptions, addresses, locality, its pool).
The peer picks the route (:func:`mq.routing.select_route`), opens the data link
(``transport.connect``) and answers HELLO_ACK; the node does the same on the ACK. When both
have a shared-memory pool and each could open the other's (probed in the handshake; LINK frames
carry the verdicts), the route is ``shm`` and large CPU buffers travel by descriptor.

Thread rules: ``on_frame`` runs on the transport's I/O thread and never runs user code there;
subscription handlers run on one dispatcher thread (in order), ``on`` handlers on a small pool.
"""

from __future__ import annotations

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

from mq import shm as _shm
from mq.codec import (BYE, HELLO, HELLO_ACK, LINK, MSG, RELEASE, REP_ERR, REP_OK, REQ, SUBS,
                      Codec, Envelope, Frame)
from mq.errors import ClosedError, ConfigError, EncodeError, MQError, PeerLost, ProtocolError, RemoteError, Timeout
from mq.locality import Locality, local
from mq.routing import Route, select_route
from mq.transport import Receipt, Transport

log = logging.getLogger("mq")

DEFAULT_TIMEOUT_S = 30.0
# Longer waits are capped: threading refuses timeouts past ~292 years (OverflowError).
_MAX_TIMEOUT_S = 365 * 86400.0


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
    info: dict[str, Any] = field(default_factory=dict)  # its HELLO (addresses, locality, ...)
    lost: str | None = None  # why the peer is gone (None while it is alive)
    reader: _shm.PoolReader | None = None  # its pool, opened here (we receive by descriptor)
    shm_out: bool = False  # it opened our pool: we may send it descriptors


@dataclass
class Stats:
    """Counters a user can read with :meth:`MQ.stats` (dropped frames are never silent)."""

    sent: int = 0
    received: int = 0
    dropped_malformed: int = 0
    dropped_oversized: int = 0
    dropped_unexpected_reply: int = 0
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
    """

    def __init__(self, node_id: int, labels: Iterable[str] | str | None = None, *,
                 transport: Transport, queue_size: int = 1024, timeout: float = DEFAULT_TIMEOUT_S,
                 allow_pickle: bool = False, handler_threads: int = 4, codec: Codec | None = None,
                 max_frame_bytes: int = 4 << 30, shm: bool = True,
                 shm_pool_bytes: int = _shm.DEFAULT_POOL_BYTES,
                 shm_inline_max: int = _shm.DEFAULT_INLINE_MAX, mq_type: str | None = None):
        if not isinstance(node_id, int) or isinstance(node_id, bool) or node_id < 0:
            raise ConfigError(f"node_id must be a non-negative int, got {node_id!r}")
        if not isinstance(queue_size, int) or queue_size < 1:
            raise ConfigError(f"queue_size must be an int >= 1, got {queue_size!r}")
        if timeout is None or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if not isinstance(max_frame_bytes, int) or max_frame_bytes < 1:
            raise ConfigError(f"max_frame_bytes must be an int >= 1, got {max_frame_bytes!r}")
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
        self.incarnation = uuid.uuid4().hex
        self._shm_options = (shm_pool_bytes, shm_inline_max)
        _shm.Pool.check_options(shm_pool_bytes, shm_inline_max)
        self._shm_wanted = bool(shm)
        self._pool: _shm.Pool | None = None
        self.shm_unavailable: str | None = None if shm else "turned off (shm=False)"
        self._releases = _shm.ReleaseQueue()
        self._releaser: threading.Thread | None = None
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
        self._executor: ThreadPoolExecutor | None = None
        self._dispatcher: threading.Thread | None = None
        self._handler_threads = handler_threads
        self._state = "new"  # new -> listening -> stopping -> stopped
        self._stats = Stats()

    # ------------------------------------------------------------------ lifecycle
    def listen(self) -> "MQ":
        """Open the transport and join the peers. Idempotent."""
        if self._state == "listening":
            return self
        if self._state != "new":
            raise ClosedError("this queue was stopped; create a new one with mq.create(...)")
        self._executor = ThreadPoolExecutor(self._handler_threads, thread_name_prefix=f"mq{self.node_id}-on")
        self._dispatcher = threading.Thread(target=self._dispatch_loop, daemon=True,
                                            name=f"mq{self.node_id}-handlers")
        self._state = "listening"
        self._dispatcher.start()
        try:
            self._open_pool()
            targets = list(self.transport.start(self))
            for target in targets:
                token = uuid.uuid4().hex
                self.transport.greet(target, self._encode(HELLO, "", self._hello_payload(token)), token)
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
        if self._state != "listening":
            self._state = "stopped"
            return
        self._state = "stopping"
        deadline = time.monotonic() + timeout
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
                self._send_raw(peer, self._encode(BYE, "", None, corr),
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
        _check_topic(topic)
        timeout = self._timeout(timeout)
        deadline = time.monotonic() + timeout
        self._wait_peer(peer, timeout)
        self._deliver_to([peer], self._encode(MSG, topic, payload), deadline)

    def publish(self, topic: str, payload: Any, *, timeout: float | None = None) -> list[int]:
        """Send to every peer subscribed to ``topic``; returns their node ids.

        Peers that have not joined yet do not receive it: use :meth:`wait_for_subscribers`.
        The payload is encoded once; same-host subscribers share one shared-memory copy.
        """
        _check_topic(topic)
        timeout = self._timeout(timeout)
        deadline = time.monotonic() + timeout
        targets = [p.node_id for p in self._peer_list() if topic in p.subscriptions and not p.lost]
        if targets:
            self._deliver_to(targets, self._encode(MSG, topic, payload), deadline)
        return targets

    def _deliver_to(self, peers: list[int], frame: Frame, deadline: float) -> None:
        """Send one frame to ``peers`` through each one's data path, then wait for every
        receipt together (a transfer from the caller's memory must finish before we return).
        A peer the frame never reached gives back its slot references at once."""
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
        fut: Future = Future()
        with self._lock:
            self._calls[corr] = (peer, fut)
        try:
            self._deliver_to([peer], self._encode(REQ, topic, payload, corr), deadline)
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
        self._need_pool().wait_released(buf, self._timeout(timeout))

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
            # Read the transport in this thread when it can: no hand-off from an I/O thread,
            # which is a large part of a small message's latency.
            if not self.transport.read_in_caller(left):
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
        """The route to each live peer, e.g. ``{1: Route(kind="shm", ...)}``: the path the
        bytes of a large CPU buffer take to that peer."""
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
        if self._pool is not None:
            self._stats.shm = dict(self._pool.stats)
        return self._stats

    # ------------------------------------------------------------------ joining
    def _hello_payload(self, token: str) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "labels": sorted(self.labels),
            "subscriptions": sorted(self.subscriptions()),
            "addresses": dict(self.transport.addresses),
            "locality": self.locality.to_dict(),
            "incarnation": self.incarnation,
            "token": token,
            "mq_type": self.mq_type,
            "shm": self._pool.probe_info() if self._pool is not None else None,
        }

    def _on_hello(self, env: Envelope) -> None:
        info = env.payload
        if not isinstance(info, dict) or not isinstance(info.get("node_id"), int) or isinstance(info["node_id"], bool):
            raise ProtocolError(f"malformed HELLO from node {env.sender}")
        peer_id = info["node_id"]
        if peer_id == self.node_id:
            if info.get("incarnation") != self.incarnation:
                log.error("node %d: another process uses the same node id (addresses %s); "
                          "give every node a unique node id", self.node_id, info.get("addresses"))
            return
        if info.get("mq_type") not in (None, self.mq_type):
            log.warning("node %d: node %d runs %s, this node %s: GPU tensors may take a different "
                        "path each way", self.node_id, peer_id, info.get("mq_type"), self.mq_type)
        old = self._peers.get(peer_id)
        same = old is not None and not old.lost and old.info.get("incarnation") == info.get("incarnation")
        # Both sides may greet each other (torch RPC does): a second HELLO or ACK of the same
        # incarnation reuses the link and only carries its pool verdict.
        peer = old if same else self._new_peer(info)
        if not same:
            self.transport.connect(peer_id, info, peer.route)
            self._peer_joined(peer)
        read_ok = peer.reader is not None
        if env.kind == HELLO:
            ack = self._hello_payload(info.get("token", ""))
            ack["read_ok"] = read_ok
            self._send_or_log(peer_id, HELLO_ACK, ack)
        else:
            self._on_link(peer_id, info.get("read_ok"))
            self._send_or_log(peer_id, LINK, {"read_ok": read_ok})

    def _new_peer(self, info: dict[str, Any]) -> Peer:
        peer_id = info["node_id"]
        remote = Locality.from_dict(info.get("locality") or {})
        same_process = remote.pid == self.locality.pid and remote.boot_id == self.locality.boot_id
        supported = set(self.transport.routes)
        reader, why_not = None, None
        if (self._pool is not None and self.transport.shm_ok and info.get("shm") is not None
                and not same_process):
            try:
                reader = _shm.PoolReader(peer_id, info["shm"], self._releaser_for(peer_id))
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
            log.error("node %d: %s; using tcp to node %d", self.node_id, exc, peer_id)
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
        return Peer(peer_id, frozenset(str(x) for x in info.get("labels") or ()),
                    frozenset(str(x) for x in info.get("subscriptions") or ()), route,
                    info=info, reader=reader)

    def _on_link(self, peer_id: int, read_ok: Any) -> None:
        """The peer's verdict on our pool: descriptors go to it only if it could open it."""
        with self._peers_changed:
            peer = self._peers.get(peer_id)
            if peer is None or peer.route is None or peer.route.kind != "shm":
                return
            if read_ok is True:
                peer.shm_out = True
            else:  # we can read theirs but they cannot read ours: sockets both ways
                fallback = self.transport.routes & {"ipc", "tcp"}
                peer.route = replace(peer.route, kind="ipc" if "ipc" in fallback else "tcp",
                                     reason=f"{peer.route.reason}; not shm: node {peer_id} cannot "
                                            "open this node's shared memory")
            self._peers_changed.notify_all()

    def _send_or_log(self, peer: int, kind: int, payload: Any) -> None:
        try:
            self._send_raw(peer, self._encode(kind, "", payload), self.timeout)
        except MQError as exc:
            log.warning("node %d: could not answer the handshake of node %d: %s", self.node_id, peer, exc)

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
    def on_frame(self, header: Any, buffers: list[Any], peer: int | None = None) -> None:
        """A frame arrived (the transport's I/O thread): decode and route it; a malformed one
        is dropped and counted, never raised into the transport."""
        try:
            env = self.codec.decode(header, buffers, self._resolve)
            if peer is not None and env.sender != peer:
                raise ProtocolError(f"a frame on node {peer}'s link claims to come from node {env.sender}")
            self._deliver(env)
        except ProtocolError as exc:
            self._stats.dropped_malformed += 1
            log.warning("node %d: dropped a malformed frame: %s", self.node_id, exc)
        except Exception:
            self._stats.dropped_malformed += 1
            log.exception("node %d: error handling a frame", self.node_id)

    def on_link_lost(self, peer: int, why: str) -> None:
        if self._state == "listening":
            self._peer_lost(peer, why)

    def on_dropped(self, why: str) -> None:
        self._stats.dropped_malformed += 1
        log.warning("node %d: dropped a malformed frame: %s", self.node_id, why)

    def _resolve(self, sender: int, desc: Any) -> memoryview:
        p = self._peers.get(sender)
        if p is None or p.reader is None:
            raise ProtocolError(f"node {sender} sent a shared-memory descriptor without a shm link")
        return p.reader.view(desc)

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
            peer.lost = why
            self._peers_changed.notify_all()
        log.info("node %d: peer %d lost: %s", self.node_id, node_id, why)
        self._forget_pool_state(peer)
        self._fail_calls(lambda p: PeerLost(f"node {p} {why}") if p == node_id else None)

    def _forget_pool_state(self, peer: Peer) -> None:
        if self._pool is not None:
            self._pool.peer_gone(peer.node_id)
        if peer.reader is not None:
            peer.reader.close()

    def _deliver(self, env: Envelope) -> None:
        """Route one decoded frame. Runs on the transport's I/O thread: never runs user code."""
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
                assert self._executor is not None
                self._executor.submit(self._serve, env)
            except RuntimeError:  # pool shut down: we are stopping
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
        elif env.kind in (HELLO, HELLO_ACK):
            self._on_hello(env)
        elif env.kind == LINK:
            self._on_link(env.sender, env.payload.get("read_ok") if isinstance(env.payload, dict) else None)
        elif env.kind == BYE:
            try:  # answer first: the peer waits for it before closing its links
                self._send_raw(env.sender, self._encode(REP_OK, "", None, env.corr), 1.0)
            except Exception as exc:
                log.debug("node %d: could not answer the farewell of node %d: %s", self.node_id, env.sender, exc)
            self._peer_lost(env.sender, "stopped (it called stop())")

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
                p = env.payload if isinstance(env.payload, dict) else {}
                fut.set_exception(RemoteError(str(p.get("type", "?")), str(p.get("message", "")),
                                              str(p.get("traceback", "")), peer=env.sender))
        except InvalidStateError:  # the call already failed (peer lost, stop) or timed out
            self._stats.dropped_unexpected_reply += 1

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

    def _encode(self, kind: int, topic: str, payload: Any, corr: int = 0) -> Frame:
        return self.codec.encode(kind, topic, self.node_id, next(self._seq), corr, payload)

    def _send_frame(self, peer: int, kind: int, topic: str, payload: Any, *, timeout: float,
                    corr: int = 0) -> None:
        self._deliver_to([peer], self._encode(kind, topic, payload, corr), time.monotonic() + timeout)

    def _send_checked(self, peer: int, frame: Frame, timeout: float) -> Receipt | None:
        if self._state != "listening":
            raise ClosedError("send on a queue that is not listening: use `with q:` or q.listen()")
        p = self._peers.get(peer)
        if p is None:
            raise PeerLost(f"node {peer} is not a known peer of node {self.node_id}; known: {self.peers()}")
        if p.lost:
            raise PeerLost(f"node {peer} {p.lost}")
        receipt = self.transport.send(peer, frame, timeout)
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
            raise ClosedError("send on a queue that is not listening: use `with q:` or q.listen()")
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
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout != timeout:
            raise ConfigError(f"timeout must be a number of seconds (int or float), got {timeout!r}")
        if timeout < 0:
            raise ConfigError(f"timeout must be >= 0 seconds, got {timeout}")
        return min(float(timeout), _MAX_TIMEOUT_S)

    def __repr__(self) -> str:
        return (f"<MQ {self.mq_type} node={self.node_id} labels={sorted(self.labels)} "
                f"{self._state} peers={self.peers()}>")


def _on_cpu(buf: Any) -> bool:
    device = getattr(buf, "device", None)
    return device is None or getattr(device, "type", "cpu") == "cpu"


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
