"""Sending: from an encoded frame to ``transport.send``, through each peer's data path.

:class:`Sender` owns the frame sequence numbers, this node's shared-memory pool (and the
RELEASE frames that give a peer's slots back), and the choice per peer and per buffer between
inline bytes and a shm descriptor. Data flows one way::

    facade / calls / join / liveness / fan-out -> Sender.encode -> Sender.deliver_to
        -> data path per peer and buffer -> transport.send
           CPU buffers: inline | one shm copy, descriptors (mq.shm)
           GPU buffers: one device copy, CUDA IPC descriptors (route nvlink, mq.gpu_path)
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

from mq import cuda_ipc as _cuda_ipc
from mq import metrics as _metrics
from mq import shm as _shm
from mq.codec import GPU_POOL, MSG, RELAY, REP_ERR, REP_OK, REQ, RELEASE, Codec, Frame
from mq.gpu_path import GpuPath, cuda_buffers
from mq.errors import ClosedError, ConfigError, MQError, PeerLost, Timeout
from mq.lifecycle import Lifecycle
from mq.peers import Peer, PeerTable
from mq.stats import Stats
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
            (:class:`~mq.gpu_path.GpuPath`).
    """

    def __init__(self, node_id: int, transport: Transport, codec: Codec, peers: PeerTable,
                 life: Lifecycle, stats: Stats, metrics: _metrics.Metrics, *,
                 shm: bool, shm_options: tuple[int, int], cuda: bool = True,
                 cuda_pool_bytes: int | None = None, cuda_inline_max: int = _cuda_ipc.DEFAULT_INLINE_MAX,
                 incarnation: str = ""):
        _shm.Pool.check_options(*shm_options)
        self.node_id = node_id
        self._transport = transport
        self._send = transport.send
        self._codec = codec
        self._peers = peers
        self._peer_get = peers.get
        self._life = life
        self._stats = stats
        self._metrics = metrics
        self._seq = itertools.count()
        self._shm_options = shm_options
        self._shm_wanted = bool(shm)
        self.pool: _shm.Pool | None = None
        self.shm_unavailable: str | None = None if shm else "turned off (shm=False)"
        self._releases = _shm.ReleaseQueue()
        self._releaser: threading.Thread | None = None
        # Transports that carry tensors themselves (torch RPC) stage or map GPU tensors their way.
        self._stages_gpu = not transport.keeps_tensors
        self.gpu = GpuPath(node_id, peers, self._send_gpu_pool, self._gpu_released, enabled=cuda,
                           pool_bytes=cuda_pool_bytes, inline_max=cuda_inline_max, incarnation=incarnation)

    # ------------------------------------------------------------------ frames
    def encode(self, kind: int, topic: str, payload: Any, corr: int = 0) -> Frame:
        return self._codec.encode(kind, topic, self.node_id, next(self._seq), corr, payload)

    def next_seq(self) -> int:
        return next(self._seq)

    def send_frame(self, peer: int, kind: int, topic: str, payload: Any, *, timeout: float,
                   corr: int = 0) -> None:
        self.deliver_to([peer], self.encode(kind, topic, payload, corr), time.monotonic() + timeout)

    def send_raw(self, peer: int, frame: Frame, timeout: float) -> None:
        """Control frames (handshake, farewell, releases): inline, receipt awaited."""
        receipt = self._send(peer, frame, timeout)
        if receipt is not None:
            receipt()

    def send_control(self, peer: int, kind: int, payload: Any, timeout: float, corr: int = 0) -> None:
        self.send_raw(peer, self.encode(kind, "", payload, corr), timeout)

    # ------------------------------------------------------------------ data paths
    def deliver_to(self, peers: list[int], frame: Frame, deadline: float) -> None:
        """Send one frame to ``peers`` through each one's data path, then wait for every
        receipt together (a transfer from the caller's memory must finish before we return).
        A peer the frame never reached gives back its slot references at once."""
        if len(peers) == 1 and not frame.gpu and (
                self.pool is None or not frame.sizes or not self.pool.wants(max(frame.sizes))):
            # One peer, every buffer inline: the common small message.
            receipt = self._send_checked(peers[0], frame, max(0.0, deadline - time.monotonic()))
            if frame.kind == MSG:
                self._metrics.sent(frame.head[2], frame.nbytes)
            if receipt is not None:
                receipt()
            return
        held = _Held(self)
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
        """The frame each peer gets. GPU buffers go by CUDA IPC descriptor to ``nvlink`` peers
        that opened our pool (one device copy shared by all of them), staged through host to
        the others (one host copy, unless the transport carries tensors itself). Large CPU
        buffers, staged ones too, go by shm descriptor to peers that read our pool (one copy
        shared by all of them), inline to the others. GPU tensors under ``cuda_inline_max`` are
        staged for every peer."""
        gpu_peers: list[int] = []
        if frame.gpu:
            gpu_peers, held.gpu = self.gpu.place(peers, frame.buffers, frame.sizes, deadline)
            held.gpu_peers = gpu_peers
        others = [p for p in peers if p not in gpu_peers]
        host = frame.staged() if frame.gpu and others and self._stages_gpu else frame
        pool = self.pool
        shm_peers = [p for p in peers if getattr(self._peer_get(p), "shm_out", False)] if pool is not None else []
        cpu_descs: dict[int, list[int]] = {}
        staged_descs: dict[int, list[int]] = {}
        try:
            if shm_peers:
                assert pool is not None
                cpu_big = [i for i, n in enumerate(frame.sizes) if pool.wants(n) and _on_cpu(frame.buffers[i])]
                cpu_descs = held.place_shm(cpu_big, frame, shm_peers, deadline)
                staged_peers = [p for p in shm_peers if p in others] if host is not frame else []
                if staged_peers:
                    staged = [i for i in cuda_buffers(frame.buffers, frame.sizes) if pool.wants(host.sizes[i])]
                    staged_descs = held.place_shm(staged, host, staged_peers, deadline)
        except BaseException:
            held.give_back(peers)
            raise
        frames: dict[int, Frame] = {}
        made: dict[tuple[bool, bool], Frame] = {}  # (gets CUDA descriptors, reads our pool) -> frame
        for p in peers:
            key = (p in gpu_peers, p in shm_peers)
            f = made.get(key)
            if f is None:
                shm_descs = ({**cpu_descs} if key[0] else {**cpu_descs, **staged_descs}) if key[1] else {}
                descs = {**held.gpu, **shm_descs} if key[0] else shm_descs
                # nvlink peers get the small GPU tensors staged too, the large ones by descriptor
                base = (frame.staged(skip=held.gpu) if self._stages_gpu else frame) if key[0] else host
                f = made[key] = base.with_descriptors(descs) if descs else base
            frames[p] = f
        return frames

    def checked_peer(self, peer: int, frame: Frame, what: str = "send") -> Peer:
        """The live peer ``peer`` if ``frame`` may go to it now; raises why not."""
        if self._life.state != "listening" and not (self._life.state == "stopping" and frame.kind in ANSWERS):
            raise ClosedError(self._life.not_listening(what))
        p = self._peer_get(peer)
        if p is None:
            raise PeerLost(f"node {peer} is not a known peer of node {self.node_id}; known: {self._peers.ids()}")
        if p.lost:
            raise PeerLost(f"node {peer} {p.lost}")
        if p.max_frame_bytes is not None and frame.nbytes > p.max_frame_bytes:
            raise ConfigError(f"a frame of {frame.nbytes} bytes exceeds node {peer}'s max_frame_bytes="
                              f"{p.max_frame_bytes}: send smaller pieces, or raise max_frame_bytes on "
                              f"node {peer}; nothing was sent")
        return p

    def _send_checked(self, peer: int, frame: Frame, timeout: float) -> Receipt | None:
        p = self._peer_get(peer)
        if (p is None or p.lost or self._life.state != "listening"
                or (p.max_frame_bytes is not None and frame.nbytes > p.max_frame_bytes)):
            p = self.checked_peer(peer, frame)  # raises why (inline above: the hot path)
        counted = frame.kind in COUNTED
        if counted:
            if p.tx - p.acked >= p.window:
                self._peers.wait_in_flight(p, time.monotonic() + timeout)  # flow control (mq.peers.Peer)
            with p.tx_lock:  # counted before it leaves: its receipt may beat our return
                p.tx += 1
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

    # ------------------------------------------------------------------ the pool
    def open_pool(self) -> None:
        """Make this node's pool (when wanted) and start returning peers' slots (shm and CUDA)."""
        if self._shm_wanted:
            try:
                self.pool = _shm.Pool(*self._shm_options, label=str(self.node_id))
            except OSError as exc:  # e.g. no memfd, or no memory for the probe: sockets only
                self.shm_unavailable = f"cannot make a shared-memory pool here ({exc})"
                log.warning("node %d: %s; same-host peers use a socket", self.node_id, self.shm_unavailable)
        if self.pool is None and not self.gpu.enabled:
            return
        self._releaser = threading.Thread(target=self._release_loop, daemon=True,
                                          name=f"mq{self.node_id}-shm-release")
        self._releaser.start()

    def need_pool(self) -> _shm.Pool:
        if self.pool is None:
            why = self.shm_unavailable or "the queue is not listening (use `with q:` or q.listen())"
            raise ConfigError(f"node {self.node_id} has no shared-memory pool: {why}")
        return self.pool

    def releaser_for(self, peer: int) -> Callable[[int, int], None]:
        """What a reader of ``peer``'s pool calls when our views of a slot are gone."""
        put = self._releases.put
        return lambda seg_id, gen: put(peer, seg_id, gen)

    def _send_gpu_pool(self, peer: int, payload: Any, timeout: float) -> None:
        self.send_control(peer, GPU_POOL, payload, timeout)

    def _gpu_released(self, peer: int, pool_id: int, slot_id: int, event: Any) -> None:
        """A view of ``peer``'s CUDA slot is gone here (from garbage collection)."""
        self._releases.put(peer, ("cuda", pool_id), slot_id, event)

    def on_release(self, peer: int, items: Any) -> None:
        """``peer``'s RELEASE frame: its views of our slots are gone."""
        if not isinstance(items, list):
            return
        for item in items:
            if not isinstance(item, list):
                continue
            if len(item) == 3 and self.pool is not None:
                self.pool.release(peer, *item)
            elif len(item) == 4 and item[0] == "cuda":
                self.gpu.on_release(peer, *item[1:])

    def forget(self, peer: Peer, _why: str = "") -> None:
        """``peer`` is gone: its slots in our pools are free, its pools are closed here."""
        if self.pool is not None:
            self.pool.peer_gone(peer.node_id)
        if peer.reader is not None:
            peer.reader.close()
        self.gpu.forget(peer)

    def disconnect(self, peer: Peer, _why: str = "") -> None:
        """``peer`` is gone: close its link, so every send blocked on it returns now. Not from
        this thread: it may be the transport's own callback, which must not close its socket
        under itself. A peer that said goodbye gets a moment first: our answer to its BYE (and to
        the calls it still waits for) may be queued on the link, and it closes its side anyway."""
        closer = threading.Timer(GOODBYE_LINGER_S if peer.said_goodbye else 0.0, self._disconnect, (peer.node_id,))
        closer.daemon = True
        closer.start()

    def _disconnect(self, node_id: int) -> None:
        try:
            self._transport.disconnect(node_id)
        except Exception:
            log.debug("node %d: disconnect from node %d", self.node_id, node_id, exc_info=True)

    def pool_stats(self) -> dict[str, int]:
        if self.pool is None:
            return {}
        readers = [p.reader for p in self._peers.list() if p.reader is not None]
        return dict(self.pool.stats, peers_mapped_bytes=sum(r.mapped_bytes for r in readers),
                    descriptors_refused=sum(r.refused for r in readers))

    def gpu_stats(self) -> dict[str, int]:
        """The cuda_ipc path's counters (empty while it was never used)."""
        used = self.gpu.pools or any(p.gpu_reader is not None for p in self._peers.list())
        return self.gpu.summary() if used else {}

    def close(self) -> None:
        """After the transport closed: wake the releaser, close the pools."""
        self._releases.wake()
        self.gpu.close()
        for p in self._peers.list():
            if p.gpu_reader is not None:
                p.gpu_reader.close()
        readers = [p.reader for p in self._peers.list() if p.reader is not None]
        for reader in readers:
            reader.close()
        if self.pool is not None:
            self.pool.close()

    def _release_loop(self) -> None:
        """Send RELEASE frames for slots our receivers' views no longer reference (batched)."""
        while self._life.state in ("new", "listening", "stopping"):
            for peer, items in self._releases.take(0.5).items():
                p = self._peer_get(peer)
                if p is None or p.lost:
                    continue  # its pool went with it
                try:
                    self.send_control(peer, RELEASE, items, 1.0)
                except MQError as exc:
                    log.debug("node %d: release to node %d: %s", self.node_id, peer, exc)


class _Held:
    """The slots one frame holds for its peers, given back to the peers it never reached."""

    def __init__(self, sender: Sender):
        self._sender = sender
        self.gpu: dict[int, list[Any]] = {}  # buffer index -> CUDA descriptor
        self.gpu_peers: list[int] = []
        self._shm: list[tuple[dict[int, list[int]], list[int]]] = []  # (descriptors, their holders)

    def place_shm(self, indices: list[int], frame: Frame, peers: list[int], deadline: float) -> dict[int, list[int]]:
        pool = self._sender.pool
        assert pool is not None
        descs: dict[int, list[int]] = {}
        self._shm.append((descs, peers))
        for i in indices:
            descs[i] = pool.place(frame.buffers[i], peers, max(0.0, deadline - time.monotonic()))
        return descs

    def give_back(self, peers: list[int]) -> None:
        """The frame never reached ``peers``: give back the slot references held for them."""
        pool = self._sender.pool
        for descs, holders in self._shm:
            for seg_id, _fd, gen, _off, _n in descs.values():
                for peer in peers:
                    if pool is not None and peer in holders:
                        pool.release(peer, seg_id, gen)
        if self.gpu:
            self._sender.gpu.unhold(self.gpu, [p for p in peers if p in self.gpu_peers])


def _on_cpu(buf: Any) -> bool:
    device = getattr(buf, "device", None)
    return device is None or getattr(device, "type", "cpu") == "cpu"
