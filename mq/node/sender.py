"""Sending: from an encoded frame to ``transport.send``, through each peer's data path.

:class:`Sender` owns the frame sequence numbers, this node's data paths (one per registered
route, :data:`mq.datapaths.base.PATHS`), the one release queue and the RELEASE frames that give a
peer's slots back. Per peer it asks the peer's chosen path for each buffer, never the path's
kind. Data flows one way::

    facade / calls / join / liveness / fan-out -> Sender.encode -> Sender.deliver_to
        -> data path per peer and buffer -> transport.send
           CPU buffers: inline | the peer's CPU path (Peer.cpu_path: shm or rdma), one copy, descriptors
           GPU buffers: the path its route names (Route.gpu: nvlink), one device copy, descriptors
                        | staged through host once, then as CPU buffers

Counts what it sends (``Stats.sent``, per-peer ``tx``/``last_sent``, per-topic metrics); reads
the peer table, never changes who is a peer.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any, Callable

from mq.datapaths import base as _datapath
from mq import metrics as _metrics
from mq.wire.codec import MSG, RELAY, REP_ERR, REP_OK, REQ, RELEASE, Codec, Frame
from mq.datapaths.base import DataPath, cuda_buffers, tag_of
from mq.errors import ClosedError, ConfigError, MQError, PeerLost, ProtocolError, Timeout
from mq.node.lifecycle import Lifecycle
from mq.node.waits import PAUSE_RECHECK_S
from mq.node.peers import Peer, PeerTable
from mq.node.stats import Stats
from mq.transport import Receipt, Transport

log = logging.getLogger("mq")

# Frames these kinds carry are counted both ways; receipts (PING "rx") acknowledge them.
COUNTED = frozenset({MSG, REQ, REP_OK, REP_ERR, RELAY})
GOODBYE_LINGER_S = 1.0  # see Sender.disconnect
# Frames a stopping node still sends: the answers to calls that reached it before its goodbye.
ANSWERS = frozenset({REP_OK, REP_ERR})


class Sender:
    """Sends the frames of node ``node_id`` (see the module docstring).

    Args:
        shm_options: ``(pool_bytes, inline_max)`` of the pool :meth:`open_pool` makes.
        shm: whether to make one at all (``shm_unavailable`` says why not).
        cuda, cuda_pool_bytes, cuda_inline_max, incarnation: the cuda_ipc path's
            (:class:`~mq.datapaths.nvlink.path.GpuPath`).
        path_options: the other paths' options (``rdma``, ``rdma_pool_bytes``, ``secret``, ...:
            :class:`~mq.datapaths.rdma.path.RdmaPath`).
    """

    def __init__(self, node_id: int, transport: Transport, codec: Codec, peers: PeerTable,
                 life: Lifecycle, stats: Stats, metrics: _metrics.Metrics, *,
                 shm: bool, shm_options: tuple[int, int], cuda: bool = True,
                 cuda_pool_bytes: int | None = None, cuda_inline_max: int | None = None,
                 incarnation: str = "", path_options: dict[str, Any] | None = None):
        self.node_id = node_id
        self._transport = transport
        self._send = transport.send
        self._codec = codec
        self.peers = peers
        self._peers = peers
        self._peer_get = peers.get
        self._life = life
        self._stats = stats
        self._metrics = metrics
        self._seq = itertools.count()
        self.waits = peers.waits  # the data paths' waits (pool slots) go through the node's
        #: called on a counted frame to a peer not probed (liveness: probing resumes now)
        self.on_traffic: Callable[[Peer], None] = lambda _p: None
        self.releases = _datapath.ReleaseQueue(self.waits)  # every path's: one releaser thread sends them
        self._releaser: threading.Thread | None = None
        # Transports that carry tensors themselves (torch RPC) stage or map GPU tensors their way.
        self._stages_gpu = not transport.keeps_tensors
        options = {"shm": shm, "shm_options": shm_options, "cuda": cuda, "cuda_pool_bytes": cuda_pool_bytes,
                   "cuda_inline_max": cuda_inline_max, "incarnation": incarnation, **(path_options or {})}
        #: route name -> this node's data path for it (mq.datapaths.base.PATHS)
        self.paths: dict[str, DataPath] = {route: _datapath.path_class(route).make(self, options)
                                           for route in _datapath.PATHS}
        self._by_tag = {path.tag: path for path in self.paths.values()}
        self.tags = frozenset(self._by_tag)  # descriptor tags of our paths (None: untagged, shm)
        self._gpu_paths = {route: path for route, path in self.paths.items() if path.device == "cuda"}
        # Whether a CPU buffer of n bytes leaves the inline fast path (None: no CPU path here).
        self._wants_cpu: Callable[[int], bool] | None = None

    # ------------------------------------------------------------------ the paths by name
    @property
    def shm(self) -> Any:
        """The shm path (its offer and accept ride in the join handshake)."""
        return self.paths["shm"]

    @property
    def gpu(self) -> Any:
        """The nvlink path (CUDA IPC; its GPU_POOL frames, alloc on a GPU)."""
        return self.paths["nvlink"]

    @property
    def rdma(self) -> Any:
        """The rdma path (its capabilities ride in the HELLO, its offers in PATH frames)."""
        return self.paths["rdma"]

    @property
    def pool(self) -> Any:
        """This node's shared-memory pool, None without one (fan-out lends from it)."""
        return self.shm.pool

    @property
    def shm_unavailable(self) -> str | None:
        return self.shm.unavailable

    # ------------------------------------------------------------------ frames
    def encode(self, kind: int, topic: str, payload: Any, corr: int = 0) -> Frame:
        return self._codec.encode(kind, topic, self.node_id, next(self._seq), corr, payload)

    def next_seq(self) -> int:
        return next(self._seq)

    def send_frame(self, peer: int, kind: int, topic: str, payload: Any, *, timeout: float,
                   corr: int = 0) -> None:
        self.deliver_to([peer], self.encode(kind, topic, payload, corr), time.monotonic() + timeout)

    def send_raw(self, peer: int, frame: Frame, timeout: float) -> None:
        """Control frames (handshake, farewell, releases, a data path's offers): inline, receipt
        awaited. A link torn down because the peer died says PeerLost, as a data frame's does."""
        try:
            receipt = self._send(peer, frame, timeout)
            if receipt is not None:
                receipt()
        except (ClosedError, Timeout):
            p = self._peer_get(peer)
            if p is not None and p.lost:
                raise PeerLost(f"node {peer} {p.lost}") from None
            raise

    def send_control(self, peer: int, kind: int, payload: Any, timeout: float, corr: int = 0) -> None:
        self.send_raw(peer, self.encode(kind, "", payload, corr), timeout)

    # ------------------------------------------------------------------ data paths
    def deliver_to(self, peers: list[int], frame: Frame, deadline: float) -> None:
        """Send one frame to ``peers`` through each one's data path, then wait for every
        receipt together (a transfer from the caller's memory must finish before we return).
        A peer the frame never reached gives back its slot references at once."""
        if len(peers) == 1 and not frame.gpu and (
                self._wants_cpu is None or not frame.sizes or not self._wants_cpu(max(frame.sizes))):
            # One peer, every buffer inline: the common small message.
            receipt = self._send_checked(peers[0], frame, max(0.0, deadline - time.monotonic()))
            if frame.kind == MSG:
                self._metrics.sent(frame.head[2], frame.nbytes)
            if receipt is not None:
                receipt()
            return
        held = _Held()
        frames = self._data_paths(peers, frame, deadline, held)
        receipts: list[Receipt] = []
        try:
            for n, peer in enumerate(peers):
                try:
                    receipt = self._send_checked(peer, frames[peer], max(0.0, deadline - time.monotonic()))
                except BaseException:
                    held.give_back(peers[n:])
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

    def _data_paths(self, peers: list[int], frame: Frame, deadline: float, held: "_Held") -> dict[int, Frame]:
        """The frame each peer gets. GPU buffers go by descriptor to peers whose route's GPU
        path (nvlink) is ready for them (one device copy shared by all of them), staged through
        host to the others (one host copy, unless the transport carries tensors itself). Large
        CPU buffers, staged ones too, go by descriptor through each peer's CPU path (shm: one
        copy shared by all of them), inline to the others. GPU tensors under a GPU path's
        inline bound are staged for every peer."""
        gpu_of: dict[int, dict[int, list[Any]]] = {}  # peer -> its GPU descriptors
        cpu_of: dict[int, tuple[dict[int, list[Any]], dict[int, list[Any]]]] = {}  # peer -> (CPU, staged)
        try:
            if frame.gpu:
                for path, group in self._grouped(peers, self._gpu_path_of):
                    idx = path.takes(frame.buffers, frame.sizes)
                    ready = path.ready(group, frame.buffers, frame.sizes, idx, deadline) if idx else []
                    if ready:
                        descs = held.place(path, ready, frame.buffers, idx, deadline)
                        gpu_of.update(dict.fromkeys(ready, descs))
            others = [p for p in peers if p not in gpu_of]
            host = frame.staged() if frame.gpu and others and self._stages_gpu else frame
            on_gpu = set(cuda_buffers(frame.buffers, frame.sizes)) if host is not frame else set()
            for path, group in self._grouped(peers, self._cpu_path_of):
                idx = path.takes(frame.buffers, frame.sizes)
                if idx or on_gpu:  # peers not ready for the path get these buffers inline
                    group = path.ready(group, frame.buffers, frame.sizes, idx, deadline)
                    if not group:
                        continue
                cpu = held.place(path, group, frame.buffers, idx, deadline)
                staged_peers = [p for p in group if p in others] if on_gpu else []
                staged: dict[int, list[Any]] = {}
                if staged_peers:
                    idx = [i for i in path.takes(host.buffers, host.sizes) if i in on_gpu]
                    staged = held.place(path, staged_peers, host.buffers, idx, deadline)
                ours, theirs = (cpu, cpu), (cpu, staged)  # one per kind of peer: frames are shared
                for p in group:
                    cpu_of[p] = ours if p in gpu_of else theirs
        except BaseException:
            held.give_back(peers)
            raise
        frames: dict[int, Frame] = {}
        made: dict[tuple[int, int], Frame] = {}  # (its GPU descriptors, its CPU ones) -> frame
        for p in peers:
            g, c = gpu_of.get(p), cpu_of.get(p)
            key = (id(g), id(c))
            f = made.get(key)
            if f is None:
                cpu_descs = ({**c[0], **c[1]} if c[1] is not c[0] else {**c[0]}) if c is not None else {}
                descs = {**g, **cpu_descs} if g is not None else cpu_descs
                # peers with GPU descriptors get the small GPU tensors staged, the large by descriptor
                base = (frame.staged(skip=g) if self._stages_gpu else frame) if g is not None else host
                f = made[key] = base.with_descriptors(descs) if descs else base
            frames[p] = f
        return frames

    def _grouped(self, peers: list[int], path_of: Callable[[int], DataPath | None]) -> list[tuple[DataPath, list[int]]]:
        """``peers`` by the data path ``path_of`` chose for each (those with none left out)."""
        groups: dict[DataPath, list[int]] = {}
        for p in peers:
            path = path_of(p)
            if path is not None:
                groups.setdefault(path, []).append(p)
        return list(groups.items())

    def _cpu_path_of(self, peer: int) -> DataPath | None:
        p = self._peer_get(peer)
        return p.cpu_path if p is not None else None

    def _gpu_path_of(self, peer: int) -> DataPath | None:
        p = self._peer_get(peer)
        return self._gpu_paths.get(p.route.gpu) if p is not None and p.route is not None else None

    def by_descriptor(self, peer: int, frame: Frame) -> bool:
        """Whether ``frame``'s GPU buffers would go to ``peer`` by descriptor (its route's GPU
        path is usable), so the frame must travel as a frame, not inline."""
        path = self._gpu_path_of(peer) if frame.gpu else None
        return path is not None and not path.unavailable and bool(path.takes(frame.buffers, frame.sizes))

    def checked_peer(self, peer: int, frame: Frame, what: str = "send", timeout: float = 0.0) -> Peer:
        """The live peer ``peer`` if ``frame`` may go to it now (one joining this moment: within
        ``timeout``); raises why not."""
        if self._life.state != "listening" and not (self._life.state == "stopping" and frame.kind in ANSWERS):
            raise ClosedError(self._life.not_listening(what))
        p = self._peer_get(peer)
        if p is None and peer in self._peers.joining:  # its LINK is out: it is a member in a moment
            self._peers.wait(lambda: peer in self._peers.by_id or peer not in self._peers.joining, timeout,
                             lambda: f"node {peer} finished joining within {timeout:g}s")
            p = self._peer_get(peer)
        if p is None:
            raise PeerLost(f"node {peer} is not a known peer of node {self.node_id}; known: {self._peers.ids()}")
        if p.lost:
            raise PeerLost(f"node {peer} {p.lost}")
        if p.route_error:
            raise ConfigError(p.route_error)
        if p.max_frame_bytes is not None and frame.nbytes > p.max_frame_bytes:
            raise ConfigError(f"a frame of {frame.nbytes} bytes exceeds node {peer}'s max_frame_bytes="
                              f"{p.max_frame_bytes}: send smaller pieces, or raise max_frame_bytes on "
                              f"node {peer}; nothing was sent")
        return p

    def _send_checked(self, peer: int, frame: Frame, timeout: float) -> Receipt | None:
        p = self._peer_get(peer)
        if (p is None or p.lost or p.route_error or self._life.state != "listening"
                or (p.max_frame_bytes is not None and frame.nbytes > p.max_frame_bytes)):
            p = self.checked_peer(peer, frame, timeout=timeout)  # raises why (inline above: the hot path)
        counted = frame.kind in COUNTED
        if counted:
            if p.tx - p.acked >= p.window:
                self._peers.wait_in_flight(p, time.monotonic() + timeout)  # flow control (mq.node.peers.Peer)
            with p.tx_lock:  # counted before it leaves: its receipt may beat our return
                p.tx += 1
            if not p.probed and not p.asked:  # traffic on an idle pair: probe it now (mq.node.liveness)
                self.on_traffic(p)
        try:
            receipt = self._send(peer, frame, timeout)
        except BaseException as exc:
            if counted:
                with p.tx_lock:
                    p.tx -= 1  # it did not leave (a receipt saying otherwise is clamped)
            if isinstance(exc, (ClosedError, Timeout)) and p.lost:
                # the link was torn down under us because the peer died
                raise PeerLost(f"node {peer} {p.lost}") from None
            raise
        p.last_sent = time.monotonic()
        self._stats.sent += 1
        return receipt

    # ------------------------------------------------------------------ the pools
    def open_pool(self) -> None:
        """Make this node's pools (when wanted) and start returning peers' slots."""
        for path in self.paths.values():
            path.open()
        # The inline fast path asks the CPU paths only whether a buffer is large enough for them.
        cpu = [path.wants for path in self.paths.values() if path.device == "cpu" and not path.unavailable]
        self._wants_cpu = cpu[0] if len(cpu) == 1 else (lambda n: any(w(n) for w in cpu)) if cpu else None
        if all(path.unavailable for path in self.paths.values()):
            return
        self._releaser = threading.Thread(target=self._release_loop, daemon=True,
                                          name=f"mq{self.node_id}-shm-release")
        self._releaser.start()

    def need_pool(self) -> Any:
        return self.shm.need_pool()

    def on_release(self, peer: int, items: Any) -> None:
        """``peer``'s RELEASE frame: its views of our slots are gone (each item to its path)."""
        if not isinstance(items, list):
            return
        for item in items:
            if isinstance(item, list) and item:
                path = self._by_tag.get(tag_of(item))
                if path is not None:
                    path.on_release(peer, item)

    def on_path_frame(self, peer: int, payload: Any) -> None:
        """A PATH frame ``[tag, body]``: a data path's own control frame (rdma offers)."""
        if not (type(payload) is list and len(payload) == 2):
            raise ProtocolError(f"node {peer}: a PATH frame is [tag, body]")
        path = self._by_tag.get(payload[0]) if type(payload[0]) is str else None
        handler = getattr(path, "on_frame", None)
        if handler is None:
            raise ProtocolError(f"node {peer}: a PATH frame for a data path this node does not have")
        handler(peer, payload[1])

    def forget(self, peer: Peer, _why: str = "") -> None:
        """``peer`` is gone: its slots in our pools are free, its pools are closed here."""
        for path in self.paths.values():
            path.forget(peer)

    def disconnect(self, peer: Peer, _why: str = "") -> None:
        """``peer`` is gone: close its link, so every send blocked on it returns now. Not from
        this thread: it may be the transport's own callback, which must not close its socket
        under itself. A peer that said goodbye gets a moment first: our answer to its BYE (and to
        the calls it still waits for) may be queued on the link, and it closes its side anyway."""
        closer = threading.Timer(GOODBYE_LINGER_S if peer.said_goodbye else 0.0, self._disconnect, (peer,))
        closer.daemon = True
        closer.start()

    def _disconnect(self, peer: Peer) -> None:
        now = self._peer_get(peer.node_id)
        if now is not None and now is not peer:
            return  # it joined again meanwhile (a new incarnation): the link is the new one's
        try:
            self._transport.disconnect(peer.node_id)
        except Exception:
            log.debug("node %d: disconnect from node %d", self.node_id, peer.node_id, exc_info=True)

    def pool_stats(self) -> dict[str, int]:
        return self.shm.counters()

    def gpu_stats(self) -> dict[str, int]:
        """The cuda_ipc path's counters (empty while it was never used)."""
        return self.gpu.counters()

    def close(self) -> None:
        """After the transport closed: wake the releaser, close the paths."""
        self.releases.wake()
        for path in reversed(self.paths.values()):
            path.close()

    def _release_loop(self) -> None:
        """Send RELEASE frames for slots our receivers' views no longer reference (batched)."""
        while self._life.state in ("new", "listening", "stopping"):
            for peer, items in self.releases.take(PAUSE_RECHECK_S).items():  # (a stop wakes it)
                p = self._peer_get(peer)
                if p is None or p.lost:
                    continue  # its pool went with it
                try:
                    self.send_control(peer, RELEASE, items, 1.0)
                except MQError as exc:
                    log.debug("node %d: release to node %d: %s", self.node_id, peer, exc)


class _Held:
    """The slots one frame holds for its peers, given back to the peers it never reached."""

    def __init__(self) -> None:
        self._placed: list[tuple[DataPath, dict[int, list[Any]], list[int]]] = []  # (path, descriptors, holders)

    def place(self, path: DataPath, peers: list[int], buffers: list[Any], indices: list[int],
              deadline: float) -> dict[int, list[Any]]:
        descs: dict[int, list[Any]] = {}
        if indices:
            self._placed.append((path, descs, peers))  # before placing: a partial place is held too
            path.place(peers, buffers, indices, deadline, descs)
        return descs

    def give_back(self, peers: list[int]) -> None:
        """The frame never reached ``peers``: give back the slot references held for them."""
        for path, descs, holders in self._placed:
            gone = [p for p in peers if p in holders]
            if gone and descs:
                path.unhold(descs, gone)
