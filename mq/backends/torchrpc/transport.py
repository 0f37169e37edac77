"""The ``torchrpc:cpu`` and ``torchrpc:cuda`` mq types' transport: ``torch.distributed.rpc``
on TensorPipe.

Every node is one RPC worker: rank = node id, worker name ``mq<node id>``, a static group of
``world_size`` workers found through ``init_method`` (``tcp://``, ``env://``, ``file://``).
torch allows one RPC agent per process, so one listening torchrpc queue per process. Before
``init_rpc`` the nodes exchange locality descriptors through mq's rendezvous
(:mod:`mq.rendezvous`), from which :mod:`mq.backends.torchrpc.tensorpipe` chooses TensorPipe's
transports and channels. Frames travel as described in :mod:`mq.backends.torchrpc.wire`.

Ordering and backpressure
-------------------------
TensorPipe runs incoming requests on a thread pool, so frames of one sender can be handled out
of order. The receiver keeps, per sender, the next expected ``seq`` and the frames that came
early, and passes frames in send order to a ready queue, off TensorPipe's threads: a thread in
``recv()`` delivers from it itself, the delivery thread while nobody does (see
:mod:`~mq.backends.torchrpc.receiver`). The op never blocks: it parks the frame and returns.
Flow control is by credit: a sender may have at most ``send_window`` frames, and
``send_window_bytes`` bytes (one frame always fits), that the receiver has not yet consumed
(handed to its queue or handler). Credit comes back in every RPC's return value and in every
frame the other way; a blocked sender sends a -2 frame, and the receiver answers with a -1
credit once it has consumed half a window more, or all it had queued (batched: one control
frame per consumed frame halved small-message throughput when the receiver was the
bottleneck). A receiver whose queue is full stops consuming, so the sender's ``send`` waits
up to its timeout and raises :class:`~mq.errors.Timeout` without having sent anything
(nothing half-sent, nothing dropped). Receiver memory is bounded by ``send_window`` frames per
sender plus the queue.

The caller may change its arrays and tensors as soon as ``send``/``publish`` returns (a learner
publishing weights and then stepping its optimizer in place): frames whose array/tensor bytes
are at most ``copy_threshold`` (1 MiB) are copied and sent asynchronously (pipelined); larger
frames are sent straight from the caller's memory and ``send`` waits until the peer has them
(``publish`` waits for all its peers at once). Copying a large frame would cost a fresh,
page-faulted buffer per message, which on the reference VM made 64 MiB frames 5x slower than
waiting (265 vs 1371 MB/s). The receipt wait is bounded by ``rpc_timeout``, not by ``timeout``:
once a frame is on the wire, mq does not report a Timeout for it (it might still arrive).

Failures
--------
A failed RPC (the peer died: TensorPipe reports EOF or connection refused at once) marks the
peer lost: later sends raise :class:`~mq.errors.PeerLost`, pending calls fail with it. Peers
nobody is sending to are probed by core's heartbeat (:class:`mq.MQ`'s ``heartbeat`` option),
whose pings are frames like any other: an RPC to a dead peer fails, so a ``call`` waiting on a
killed peer fails within about a heartbeat. ``stop()`` says goodbye,
waits for frames still in flight, then runs ``rpc.shutdown(graceful=False)`` in a daemon thread
and abandons it at the deadline (torch's shutdown can hang when a peer died); the process can
still exit afterwards.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
import warnings
from typing import Any, Mapping

import torch

from mq.backends.torchrpc import tensorpipe
from mq.backends.torchrpc.options import TorchRpcOptions
from mq.backends.torchrpc.receiver import Receiver
from mq.backends.torchrpc.streams import Link
from mq.backends.torchrpc.wire import (CREDIT, NOT_SERVED, RPC_TIMED_OUT, WANT, Outgoing, buffers_for,
                                       INLINE_MAX, claim_agent, deliver_script, frame_parts,
                                       keep_thread_state, release_agent, request_script,
                                       rpc_async, settle_cuda, short, to_rpc)
from mq.node import waits
from mq.wire.codec import Frame
from mq.errors import ClosedError, ConfigError, MQError, PeerLost, ProtocolError, Timeout
from mq.locality import Locality, local
from mq.rendezvous import Rendezvous
from mq.routing import ALL_ROUTES, Route, select_route
from mq.transport import Events, Receipt, Transport
from mq.node.waits import LIVE_OR_STOPPING, Waits

log = logging.getLogger("mq.torchrpc")

_WANT_RETRY_S = 0.5  # a blocked sender asks again this often if no credit came
# A request whose link was lost waits this much longer for an answer already on its way (a dead
# peer's RPC fails at once anyway; a silent one's would only fail at the RPC timeout).
_ANSWER_GRACE_S = 1.0
# TensorPipe writes a request's answer after our handler returned, and says nothing when the
# write is done; the agent's shutdown cancels writes still queued. close() leaves answers given
# this recently this long to go out (the caller is waiting for them: its handler ran).
_REPLY_FLUSH_S = 0.3


class TorchRpcTransport(Transport):
    """The ``torchrpc:cpu`` and ``torchrpc:cuda`` mq types' transport; its options are
    :class:`TorchRpcOptions`, the common ones :func:`mq.create`'s.

    Raises:
        ConfigError: ``node_id`` outside ``world_size``, a bad device map for this node; at
            ``listen()``, a second listening queue in one process.
    """

    name = "torchrpc"
    keeps_tensors = True
    Options = TorchRpcOptions

    def __init__(self, node_id: int, options: TorchRpcOptions, *, timeout: float = 30.0):
        world_size = options.world_size
        assert world_size is not None  # resolved by the options
        if node_id >= world_size:
            raise ConfigError(f"node_id {node_id} must be in [0, world_size={world_size}): torch "
                              "RPC ranks are the node ids 0 .. world_size-1")
        self.node_id = node_id
        self.options = options
        self.timeout = float(timeout)
        self.device = options.device
        self.mq_type = options.mq_type
        # GPU tensors of torchrpc:cpu are staged through host: no CUDA IPC route.
        self.routes = ALL_ROUTES - ({"nvlink"} if self.device == "cpu" else set())
        self.addresses: dict[str, str] = {}
        self._node: Events | None = None
        self.world_size = world_size
        self.init_method = options.init_method
        self.rpc_timeout = options.rpc_timeout if options.rpc_timeout is not None else max(60.0, self.timeout)
        self.num_worker_threads = options.num_worker_threads
        # TensorPipe runs every incoming RPC (frames, credit, core's heartbeats, requests) on one
        # pool of num_worker_threads threads. A frame's op parks it and returns; a request's op
        # runs the user's handler and holds its thread until the handler returns. So requests may
        # hold at most half the pool: the other half stays free for frames and heartbeats, and a
        # slow handler never starves the links (a peer whose heartbeats go unread is declared
        # lost). A request past the bound is answered "not taken" and its caller sends it as an
        # ordinary frame, served by core's handler pool. One thread: no requests at all.
        self._request_limit = max(1, self.num_worker_threads // 2)
        self._requests_running = 0
        self._last_answer_at = -_REPLY_FLUSH_S  # (monotonic) when the last answer went to TensorPipe
        self._request_lock = threading.Lock()
        self.answers_requests = self.num_worker_threads >= 2
        self.send_window = options.send_window
        self.send_window_bytes = options.send_window_bytes
        self.copy_threshold = options.copy_threshold
        self.socket_ifname = options.socket_ifname
        self.busy_poll = options.busy_poll
        self.locality: Locality = local()
        self.local_cuda_devices = list(options.local_cuda_devices) if options.local_cuda_devices is not None else None
        self.device_maps = options.device_maps_for(node_id)
        self.tp_device_maps: dict[int, dict[int, int]] = {}  # what TensorPipe gets (see _maps_for_tensorpipe)
        self._inline_max: dict[int, int] = {}  # by peer: frames up to this go as text (tensorpipe.inline_max)
        self.incarnation = uuid.uuid4().hex
        self.tp_options: dict[str, Any] = {}
        peers = [p for p in range(world_size) if p != node_id]
        self._links = {p: Link(p) for p in peers}
        self._rx = Receiver(node_id, world_size, self._links, options,
                            lambda peer: self._control(self._links[peer], CREDIT))
        self._rpc_started = False
        self._closing = False
        self._closed = False
        self._rendezvous: Rendezvous | None = None
        self._shutdown_thread: threading.Thread | None = None
        self._waits = Waits()  # the node's, from start()

    @property
    def closed(self) -> bool:
        """close() ran (the agent may still be shutting down)."""
        return self._closed

    # ------------------------------------------------------------------ lifecycle
    def start(self, node: Events) -> list[int]:
        self._node = node
        self._waits = waits.of(node)
        for link in self._links.values():
            link.waits = self._waits
        claim_agent(self)
        self._rx.start(node)
        remote = self._exchange_localities()
        self._init_rpc(remote)
        self.addresses = {"torchrpc": f"mq{self.node_id}@{self.init_method}"}
        return list(self._links)

    def greet(self, target: int, frame: Frame, token: str) -> None:
        self.send(target, frame, self.timeout)

    def connect(self, peer: int, info: dict[str, Any], route: Route) -> None:
        """The RPC group is static: every link exists once ``init_rpc`` returned."""
        if peer not in self._links:
            raise ProtocolError(f"node {peer} is not in this torch RPC group of {self.world_size}")

    def _exchange_localities(self) -> dict[int, Locality]:
        """Publish our locality in the rendezvous store and read every peer's, before
        ``init_rpc``: TensorPipe's transports and channels are fixed when the agent starts."""
        assert self.init_method is not None
        # shared: init_rpc's own rendezvous on the same address later shares node 0's store
        self._rendezvous = Rendezvous(self.init_method, self.node_id, self.world_size, timeout=self.timeout,
                                      run="mq/torchrpc/locality", what="locality", shared=True)
        secret = self._node.secret if self._node is not None else None
        nodes = self._rendezvous.exchange(
            {"locality": self.locality.to_dict(), "incarnation": self.incarnation}, secret)
        remote = {}
        for p in self._links:
            try:
                remote[p] = Locality.from_dict(nodes[p].get("locality") or {})
            except Exception as exc:  # msgpack only: a bad entry is a protocol error, not code
                raise ProtocolError(f"node {self.node_id}: node {p}'s rendezvous entry is "
                                    f"malformed ({short(exc)}): does it run the same mq version?") from None
        return remote

    def _backend_options(self, remote: Mapping[int, Locality]) -> Any:
        from torch.distributed import rpc

        cuda = self.device == "cuda"
        tp = tensorpipe.tensorpipe_options(self.locality, remote, cuda=cuda,
                                           socket_ifname=self.socket_ifname, busy_poll=self.busy_poll)
        self.tp_options = tp
        self._inline_max = {p: tensorpipe.inline_max(self.locality, remote.get(p)) for p in self._links}
        for key, value in tp["env"].items():  # read when the agent starts
            if key == "TP_SOCKET_IFNAME" or key not in os.environ:  # a user's GLOO_SOCKET_IFNAME stays
                os.environ[key] = value
        kwargs: dict[str, Any] = {}
        needed = tensorpipe.must_restrict(tp["dropped"], self.locality, remote, cuda=cuda,
                                          busy_poll=self.busy_poll)
        if needed:
            # TensorPipe would pick these by its own (boot-id based) checks and then fail.
            log.info("node %d: TensorPipe without %s", self.node_id,
                     "; ".join(f"{n} ({tp['dropped'][n]})" for n in needed))
            kwargs = {"_transports": tp["_transports"], "_channels": tp["_channels"]}
        self.tp_device_maps = self._maps_for_tensorpipe(remote)
        devices: list[Any] | None = None  # (torch's list[int | str | device] takes no list[int])
        if cuda and self.local_cuda_devices and self.tp_device_maps:
            devices = list(self.local_cuda_devices)
        assert self.init_method is not None  # _exchange_localities, before, needed it too
        opts = rpc.TensorPipeRpcBackendOptions(
            num_worker_threads=self.num_worker_threads, rpc_timeout=self.rpc_timeout,
            init_method=self.init_method, devices=devices, **kwargs)
        for peer, mapping in self.tp_device_maps.items():
            opts.set_device_map(f"mq{peer}", dict(mapping))  # type: ignore[arg-type]  # int keys are DeviceTypes
        return opts

    def _maps_for_tensorpipe(self, remote: Mapping[int, Locality]) -> dict[int, dict[int, int]]:
        """The device maps TensorPipe gets: none for peers whose GPU payloads take mq's
        cuda_ipc path (route nvlink), whose RPCs then carry only CPU bytes. An agent with
        devices runs CUDA streams and events for every RPC, GPU tensors or not: the small
        message pays for them. A peer left without a map whose nvlink route fails later gets
        its GPU tensors staged through host memory (:func:`~.wire.buffers_for`)."""
        if self.device != "cuda":
            return {}
        return {peer: mapping for peer, mapping in self.device_maps.items()
                if peer not in remote or select_route(self.locality, remote[peer], supported=self.routes,
                                                      peer=peer).gpu != "nvlink"}

    def _init_rpc(self, remote: Mapping[int, Locality]) -> None:
        from torch.distributed import rpc

        opts = self._backend_options(remote)
        reachable = tensorpipe.reachable_listen(os.environ.get("TP_SOCKET_IFNAME"))  # what the agent reads
        if reachable:
            log.warning("node %d: torch RPC listens on %s, reachable from other hosts: TensorPipe "
                        "accepts any connection there (junk bytes abort this process, a Python-function "
                        "RPC runs code in it) and anyone who reaches the rendezvous store can read and "
                        "write it; keep this job on a private network or use nng (see mq doctor, "
                        "README 'Trust')", self.node_id, reachable)
        try:
            with warnings.catch_warnings():  # torch's own deprecated use of ProcessGroupGloo
                warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
                rpc.init_rpc(f"mq{self.node_id}",
                             backend=rpc.BackendType.TENSORPIPE,  # type: ignore[attr-defined]  # made at run time
                             rank=self.node_id, world_size=self.world_size, rpc_backend_options=opts)
        except ValueError as exc:  # torch validates device maps and devices across the group
            raise ConfigError(f"node {self.node_id}: torch RPC refused the configuration: "
                              f"{exc}".rstrip()) from None
        except RuntimeError as exc:
            if "time" in str(exc).lower():
                raise Timeout(f"node {self.node_id}: torch RPC init did not finish within "
                              f"{self.rpc_timeout:g}s: {short(exc)}") from exc
            raise ConfigError(f"node {self.node_id}: torch RPC init failed: {short(exc)} "
                              "(every node must use the same init_method, world_size and mq "
                              "type)") from exc
        self._rpc_started = True
        for peer, link in self._links.items():
            link.info = rpc.get_worker_info(f"mq{peer}")
        self._rx.rpc_ready.set()

    def close(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._closing = True
        if self._rpc_started:
            # Flush: wait for frames the peers have not confirmed yet, leaving time to shut down.
            flush_until = deadline - min(1.0, timeout / 2)
            for link in self._links.values():  # (the ignore: mypy cannot type a lambda with a default)
                self._waits.pause(lambda link=link: not link.pending or link.failed,  # type: ignore[misc]
                                  max(0.0, flush_until - time.monotonic()), on=(link,))
            self._let_answers_go(flush_until)
        self._closed = True
        self._rx.stop()
        self._waits.wake_all()  # senders and requests waiting on a link: closed
        self._rx.finish(max(0.0, min(0.5, deadline - time.monotonic())))
        if not self._rpc_started:
            self._rendezvous = None
            release_agent(self)
            return
        self._shutdown_thread = threading.Thread(target=self._shutdown_rpc, daemon=True,
                                                 name=f"mq{self.node_id}-rpc-shutdown")
        self._shutdown_thread.start()
        if not waits.join(self._shutdown_thread, deadline - time.monotonic()):
            log.warning("node %d: torch RPC shutdown did not finish within %.1fs (a peer probably "
                        "died); abandoned it: this process cannot start another torch RPC agent",
                        self.node_id, timeout)

    def _let_answers_go(self, until: float) -> None:
        """Before the agent shuts down: requests still served here (``_closing`` takes no new
        ones) return their answers, and the latest answers get :data:`_REPLY_FLUSH_S` to leave."""
        self._waits.pause(lambda: self._requests_running == 0, max(0.0, until - time.monotonic()), on=(self,))
        left = min(self._last_answer_at + _REPLY_FLUSH_S, until) - time.monotonic()
        if left > 0:
            self._waits.pause(lambda: False, left, on=(self,))

    def _shutdown_rpc(self) -> None:
        from torch.distributed import rpc

        try:
            # graceful=False: the graceful path waits for every worker (it hangs when one died)
            # and runs a round of pickled Python RPCs. Our own flush already ran.
            rpc.shutdown(graceful=False)
        except Exception as exc:
            log.debug("node %d: rpc.shutdown: %s", self.node_id, exc)
        finally:
            self._rendezvous = None
            release_agent(self)

    # ------------------------------------------------------------------ sending
    def _tensors(self, peer: int, frame: Frame, borrow: bool = False) -> Outgoing:
        """The frame as RPC arguments for ``peer`` (:func:`~mq.backends.torchrpc.wire.to_rpc`),
        converted once per frame and form: a publish shares it."""
        return to_rpc(frame, staged=self.device == "cpu", copy_threshold=self.copy_threshold, borrow=borrow,
                      inline_max=self._inline_max.get(peer, INLINE_MAX))

    def _buffers_for(self, peer: int, out: Outgoing) -> list[torch.Tensor]:
        return buffers_for(out, self.tp_device_maps.get(peer, {}) if self.device == "cuda" else None)

    def send(self, peer: int, frame: Frame, timeout: float) -> Receipt | None:
        link = self._links.get(peer)
        if link is None:
            raise PeerLost(f"node {peer} is not in this torch RPC group (world_size={self.world_size})")
        encoded = self._tensors(peer, frame)
        buffers = self._buffers_for(peer, encoded)

        def issued() -> Any:
            """The frame's RPC once the window has room for it (issued under the link's lock, so
            frames keep their order); None while the peer has not consumed enough."""
            with link.cond:
                if self._closed:
                    raise ClosedError("the queue was stopped")
                if link.failed:
                    raise PeerLost(f"node {peer} {link.failed}")
                inflight = link.next_seq - link.acked
                if not (inflight == 0 or (inflight < self.send_window
                                          and link.bytes + encoded.nbytes <= self.send_window_bytes)):
                    self._want_credit(link)
                    return None
                seq = link.next_seq
                fut = self._issue(link, seq, encoded.text, buffers)
                link.next_seq += 1
                link.sizes.append((seq, encoded.nbytes))
                link.bytes += encoded.nbytes
                link.pending += 1
                return fut

        fut = self._waits.until(issued, time.monotonic() + timeout, on=(link,), peers=(peer,),
                                states=LIVE_OR_STOPPING,
                                what=lambda: f"node {peer} did not take the message within {timeout:g}s: "
                                             f"{link.next_seq - link.acked} frame(s) ({link.bytes} bytes) wait to be "
                                             "consumed there (slow receiver or full queue); "
                                             "pass timeout= to wait longer")
        fut.add_done_callback(lambda f, link=link: self._on_reply(link, f))
        if encoded.borrowed:  # the caller waits (all peers of a publish together) before returning
            return lambda: self._wait_received(link, fut)
        return None

    def _issue(self, link: Link, seq: int, text: str, buffers: list[torch.Tensor]) -> Any:
        """Hand one frame to TensorPipe; raises (without consuming ``seq``) if it cannot."""
        ack = self._rx.report(link.peer)  # piggybacked credit for the other direction
        try:
            return rpc_async(link.info, deliver_script, (self.node_id, seq, ack, text, buffers),
                              self.rpc_timeout)
        except Exception as exc:
            if self._closed:
                raise ClosedError("the queue was stopped") from None
            if link.info is None:
                raise PeerLost(f"node {link.peer}: torch RPC is not running yet") from None
            raise PeerLost(f"node {link.peer}: torch RPC refused the frame: {short(exc)}") from exc

    def _wait_received(self, link: Link, fut: Any, raise_: bool = True) -> MQError | None:
        """Wait until the peer has a frame sent from the caller's memory (bounded: the RPC
        itself fails after ``rpc_timeout``, and a dead peer fails it at once)."""
        self._waits.pause(lambda: fut.done() or link.failed or self._closed or self._lost(link.peer),
                          float("inf"), on=(link,))
        err: MQError | None = None
        if fut.done():
            try:
                fut.value()
            except Exception as exc:  # the callback marking the link failed may still be running
                err = PeerLost(f"node {link.peer} is unreachable (torch RPC: {short(exc)})")
        elif link.failed or self._lost(link.peer):
            err = PeerLost(f"node {link.peer} {link.failed or self._lost(link.peer)}")
        else:
            err = ClosedError("the queue was stopped while a frame was in flight")
        if err is not None and raise_:
            raise err
        return err

    # ------------------------------------------------------------------ requests
    def request(self, peer: int, frame: Frame, timeout: float) -> tuple[Any, list[Any]] | None:
        """One RPC of :func:`request_script` whose return value is the reply frame (see the
        module docstring); the caller waits on it, woken at once when the link is lost."""
        link = self._links.get(peer)
        if link is None:
            raise PeerLost(f"node {peer} is not in this torch RPC group (world_size={self.world_size})")
        out = self._tensors(peer, frame, borrow=True)  # we wait for the answer: the peer has them then
        buffers = self._buffers_for(peer, out)
        with link.cond:
            if self._closed:
                raise ClosedError("the queue was stopped")
            if link.failed:
                raise PeerLost(f"node {peer} {link.failed}")
        deadline = time.monotonic() + timeout
        try:
            fut = rpc_async(link.info, request_script, (self.node_id, out.text, buffers), timeout)
        except Exception as exc:
            if self._closed:
                raise ClosedError("the queue was stopped") from None
            raise PeerLost(f"node {peer}: torch RPC refused the request: {short(exc)}") from exc
        fut.add_done_callback(lambda _f: self._answered(link))
        # torch fails the RPC itself after `timeout`; the extra second only guards that. A peer
        # lost ends the wait (its link failed); one that said goodbye first gets a grace below.
        ended = self._waits.pause(lambda: fut.done() or link.failed or self._closed or self._lost(peer),
                                  timeout + 1.0, on=(link,))
        if not ended:
            raise Timeout(f"node {peer} did not answer within {timeout:g}s")
        if not fut.done() and not self._closed and self._said_goodbye(peer):
            # The answer may be on its way all the same: a peer that stopped sent it before its
            # goodbye, but TensorPipe completes the answer and delivers the goodbye on different
            # threads, so the goodbye can win here.
            self._waits.pause(fut.done, max(0.0, min(_ANSWER_GRACE_S, deadline - time.monotonic())), on=(link,))
        if not fut.done():  # the peer was lost, or we were closed
            if link.failed or self._lost(peer):
                raise PeerLost(f"node {peer} {link.failed or self._lost(peer)}")
            raise ClosedError("the queue was stopped while a request was in flight")
        try:
            text, reply = fut.value()
        except Exception as exc:
            text = str(exc)
            if NOT_SERVED in text:
                raise ProtocolError(f"node {peer} did not serve the request: {short(exc)}") from None
            if RPC_TIMED_OUT in text:
                raise Timeout(f"node {peer} did not answer within {timeout:g}s") from None
            self._link_failed(link, exc)
            raise PeerLost(f"node {peer} {link.failed}") from None
        if not text:
            return None  # not taken as a request: send it as a frame
        if reply and any(t.is_cuda for t in reply):
            settle_cuda(reply)
        return self._frame_parts(text, reply)

    def _answered(self, link: Link) -> None:
        keep_thread_state()
        self._waits.wake(link)

    def _lost(self, peer: int) -> str | None:
        """Why the node lost ``peer`` (its heartbeat may know before the link does), or None."""
        p = self._waits.lookup(peer)
        return p.lost if p is not None else None

    def _said_goodbye(self, peer: int) -> bool:
        p = self._waits.lookup(peer)
        return bool(p is not None and p.said_goodbye)

    def on_request_rpc(self, sender: Any, text: str,
                        buffers: list[torch.Tensor]) -> tuple[str, list[torch.Tensor]]:
        """A request arrived (TensorPipe thread): serve it here and return the reply frame's
        arguments, or empty text for "not taken, send it as a frame"."""
        node = self._node
        if node is None or not isinstance(sender, int) or sender not in self._links:
            if node is not None:
                node.on_dropped(f"a request from node {sender!r}, not in this RPC group")
            raise RuntimeError(f"{NOT_SERVED}: node {self.node_id} got a request from node "
                               f"{sender!r}, which is not a peer in this group of {self.world_size}")
        with self._request_lock:
            if self._closing or self._requests_running >= self._request_limit:
                return "", []
            self._requests_running += 1
        try:
            if buffers and any(t.is_cuda for t in buffers):
                settle_cuda(buffers)
            if not node.trusts(("rank", sender)):
                return "", []  # not joined (yet): sent again as a frame, for the handshake parser
            try:
                head, views = self._frame_parts(text, buffers)
            except ProtocolError as exc:
                node.on_dropped(f"a request from node {sender}: {exc}", exc.cause)
                raise RuntimeError(f"{NOT_SERVED}: {exc}") from None
            try:
                reply = node.on_request(head, views, ("rank", sender))
            except ProtocolError as exc:
                raise RuntimeError(f"{NOT_SERVED}: {exc}") from None
            except Exception as exc:  # never let a bug look like a broken link to the caller
                log.exception("node %d: error serving a request from node %d", self.node_id, sender)
                raise RuntimeError(f"{NOT_SERVED}: {type(exc).__name__}") from None
            if reply is None:
                return "", []
            out = self._tensors(sender, reply)  # the copy rules of send: the handler's result may change
            answer = out.text, self._buffers_for(sender, out)
            self._last_answer_at = time.monotonic()
            return answer
        finally:
            with self._request_lock:
                self._requests_running -= 1
                if self._closing and self._requests_running == 0:
                    self._waits.wake(self)

    def _on_reply(self, link: Link, fut: Any) -> None:
        keep_thread_state()
        try:
            consumed = fut.value()
        except Exception as exc:
            self._link_failed(link, exc)
            consumed = None
        with link.cond:
            link.pending -= 1
        self._waits.wake(link)
        link.credit(consumed)

    def disconnect(self, peer: int) -> None:
        link = self._links.get(peer)
        if link is not None:
            with link.cond:  # blocked senders wake with PeerLost (the RPC group is static)
                link.failed = link.failed or "was lost"
            self._waits.wake(link)

    def _link_failed(self, link: Link, exc: BaseException) -> None:
        with link.cond:
            if link.failed:
                return
            link.failed = f"is unreachable (torch RPC: {short(exc)})"
        self._waits.wake(link)
        if not self._closing and self._node is not None:
            self._node.on_link_lost(link.peer, link.failed)

    def _control(self, link: Link, seq: int, on_done: Any = None) -> None:
        """Send an unordered control frame (credit, want); never blocks."""
        try:
            fut = self._issue(link, seq, "", [])
        except MQError as exc:
            if on_done:
                on_done()
            log.debug("node %d: control frame %d to node %d: %s", self.node_id, seq, link.peer, exc)
            return

        def done(f: Any) -> None:
            keep_thread_state()
            try:
                link.credit(f.value())
            except Exception as exc:
                self._link_failed(link, exc)
            if on_done:
                on_done()

        fut.add_done_callback(done)

    def _want_credit(self, link: Link) -> None:
        # Called with link.cond held, while a sender waits for credit.
        now = time.monotonic()
        if link.want_out or (link.acked == link.want_acked and now - link.want_t < _WANT_RETRY_S):
            return
        link.want_out, link.want_acked, link.want_t = True, link.acked, now

        def done() -> None:
            with link.cond:
                link.want_out = False
            self._waits.wake(link)

        self._control(link, WANT, done)

    # ------------------------------------------------------------------ receiving
    def read_in_caller(self, timeout: float, ready: Any) -> bool:
        """A thread in ``recv()`` delivers the next frame itself: see :class:`Receiver`."""
        return self._rx.read_in_caller(timeout, ready)

    def on_rpc(self, sender: Any, seq: Any, ack: Any, text: str, buffers: list[torch.Tensor]) -> int:
        """A frame arrived (TensorPipe thread, through ``mq::deliver``): see :class:`Receiver`."""
        return self._rx.on_rpc(sender, seq, ack, text, buffers)

    def _frame_parts(self, text: Any, buffers: list[Any]) -> tuple[Any, list[Any]]:
        assert self._node is not None
        return frame_parts(text, buffers, self._node.max_frame_bytes)
