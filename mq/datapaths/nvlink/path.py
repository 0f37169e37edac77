"""The nvlink data path of one node: CUDA tensors by CUDA IPC descriptor to same-host peers.

:class:`GpuPath` is the cuda_ipc memory (:mod:`mq.datapaths.nvlink.cuda_ipc`) behind the
:class:`~mq.datapaths.base.DataPath` interface; it decides which GPU buffers of a frame go by
descriptor and to which of the peers whose route chose it. It owns this node's
:class:`~mq.datapaths.nvlink.cuda_ipc.DevicePool` per GPU, made at the first GPU send to an ``nvlink`` peer,
and each peer's verdict on each of our pools: the first real
open of a pool by the peer confirms the route, or drops it to staging through host memory with
the CUDA error in ``routes()``. Receiving, it opens the pools peers offer
(:class:`~mq.datapaths.nvlink.cuda_ipc.PeerPools`, kept on the peer) and answers with its verdict.

The offer, on the authenticated link, after the join (frame kind ``GPU_POOL``)::

    sender -> peer:   {"offer": pool info}             (mq.datapaths.nvlink.cuda_ipc.check_pool_info)
    peer -> sender:   {"verdict": pool id, "error": None or why, "open_ms": float}

A send waits for the verdict (at most its own timeout); without one in time, that frame is
staged and the next send asks again. A new incarnation of a peer is a new :class:`Peer`, so
its pools are offered and opened again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from mq.datapaths.nvlink import cuda_ipc

from mq.node import peer_route
from mq.wire.codec import GPU_POOL
from mq.datapaths.base import DataPath, cuda_buffers
from mq.errors import ConfigError, MQError, ProtocolError
from mq.options import check_int
from mq.node.peers import Peer, PeerTable
from mq.node.waits import Waits

log = logging.getLogger("mq")

#: How long the first GPU send to a peer waits for its verdict on our pool (opening a CUDA IPC
#: handle takes milliseconds, sometimes hundreds).
VERDICT_WAIT_S = 30.0


class GpuPath(DataPath):
    """The cuda_ipc path of node ``node_id`` (see the module docstring), route ``nvlink``.

    Args:
        send_control: ``send_control(peer, payload, timeout)`` sends a GPU_POOL frame.
        release: ``release(peer, pool_id, slot_id, event)``: a view of a peer's slot is gone
            (called from garbage collection; must not block).
        enabled: ``cuda=`` of :func:`mq.create`.
        pool_bytes: each pool's bound (None: min(4 GiB, a sixteenth of the GPU)).
        inline_max: GPU tensors smaller than this are staged through host memory.
    """

    route = "nvlink"
    tag = cuda_ipc.TAG
    device = "cuda"

    def __init__(self, node_id: int, peers: PeerTable, send_control: Callable[[int, Any, float], None],
                 release: Callable[[int, int, int, Any], None], *, enabled: bool,
                 pool_bytes: int | None, incarnation: str, inline_max: int = cuda_ipc.DEFAULT_INLINE_MAX):
        if type(enabled) is not bool:
            raise ConfigError(f"cuda must be True or False, got {enabled!r}")
        if pool_bytes is not None:
            cuda_ipc.check_pool_bytes(pool_bytes)
        check_int(inline_max, "cuda_inline_max", minimum=0, unit="bytes")
        self.inline_max = max(1, inline_max)
        self.node_id = node_id
        self._peers = peers
        self._send_control = send_control
        self._release = release
        self.enabled = bool(enabled)
        self.pool_bytes = pool_bytes
        self.incarnation = incarnation
        self.unavailable: str | None = None if enabled else "turned off (cuda=False)"
        self.pools: dict[int, cuda_ipc.DevicePool] = {}  # device index -> our pool there
        self._verdicts: dict[tuple[int, int], str | None] = {}  # (peer, pool id) -> None (open) or why not
        self._asked: dict[tuple[int, int], float] = {}  # offers awaiting a verdict -> when sent
        self._cond = threading.RLock()  # verdicts; waits for them go through the node's waits
        self._waits = getattr(peers, "waits", None) or Waits()  # (stub peers in tests have none)
        self._closed = False
        self.stats = {"offers": 0, "verdicts_ok": 0, "verdicts_failed": 0, "staged_frames": 0}

    @classmethod
    def make(cls, host: Any, options: dict[str, Any]) -> "GpuPath":
        releases, send_control = host.releases, host.send_control
        inline_max = options["cuda_inline_max"]

        def send(peer: int, payload: Any, timeout: float) -> None:
            send_control(peer, GPU_POOL, payload, timeout)

        def released(peer: int, pool_id: int, slot_id: int, event: Any) -> None:
            releases.put(peer, (cuda_ipc.TAG, pool_id), slot_id, event)

        return cls(host.node_id, host.peers, send, released, enabled=options["cuda"],
                   pool_bytes=options["cuda_pool_bytes"], incarnation=options["incarnation"],
                   inline_max=cuda_ipc.DEFAULT_INLINE_MAX if inline_max is None else inline_max)

    # ------------------------------------------------------------------ sending
    def wants(self, nbytes: int) -> bool:
        return nbytes >= self.inline_max

    def takes(self, buffers: list[Any], sizes: list[int]) -> list[int]:
        """The CUDA buffers that go by descriptor: large ones, and any in our pool already."""
        return self._by_descriptor(buffers, sizes)

    def ready(self, peers: list[int], buffers: list[Any], sizes: list[int], indices: list[int],
              deadline: float) -> list[int]:
        """The ``peers`` (their route is nvlink) that opened the pools these buffers go to;
        offers them first. None when the frame must be staged (no pool, too large)."""
        if not indices or not peers or self.unavailable:
            return []
        pools: dict[int, cuda_ipc.DevicePool] = {}
        for i in indices:
            device = buffers[i].device.index
            pool = pools.get(device) or self._pool(device)
            if pool is None:
                return []
            if not pool.fits(sizes[i]):
                # this frame is staged; the route stays nvlink
                self.stats["staged_frames"] += 1
                self._note(peers, f"tensors larger than the CUDA pool ({pool.max_bytes} bytes) are "
                           "staged through host: raise cuda_pool_bytes")
                return []
            pools[device] = pool
        ready = [p for p in peers if all(self._opened(p, pool, deadline) for pool in pools.values())]
        if not ready:
            self.stats["staged_frames"] += 1
        return ready

    def place(self, peers: list[int], buffers: list[Any], indices: list[int], deadline: float,
              descs: dict[int, list[Any]] | None = None) -> dict[int, list[Any]]:
        """One device copy per buffer into our pool on its GPU, held for ``peers``."""
        descs = {} if descs is None else descs
        for i in indices:
            t = buffers[i]
            descs[i] = self.pools[t.device.index].place(t, peers, max(0.0, deadline - time.monotonic()))
        return descs

    def unhold(self, descs: dict[int, list[Any]], peers: list[int]) -> None:
        """The frame never reached ``peers``: give back the slots held for them."""
        for _tag, pool_id, slot_id, *_rest in descs.values():
            pool = self._pool_by_id(pool_id)
            for peer in peers:
                if pool is not None:
                    pool.release(peer, slot_id)

    def _by_descriptor(self, buffers: list[Any], sizes: list[int]) -> list[int]:
        # Small tensors are staged, unless they lie in our pool already (alloc: no copy at all).
        return [i for i in cuda_buffers(buffers, sizes) if sizes[i] >= self.inline_max or self._in_pool(buffers[i])]

    def _pool(self, device: int) -> cuda_ipc.DevicePool | None:
        with self._cond:
            pool = self.pools.get(device)
            if pool is not None or self.unavailable:
                return pool
            try:
                why = cuda_ipc.available()
                if why:
                    raise OSError(why)
                pool = self.pools[device] = cuda_ipc.DevicePool(device, self.pool_bytes, self.incarnation,
                                                                waits=self._waits)
            except (OSError, cuda_ipc.CudaError, MQError, RuntimeError) as exc:
                self.unavailable = f"cannot make a CUDA pool on cuda:{device} ({exc})"
                log.warning("node %d: %s; GPU tensors are staged through host memory",
                            self.node_id, self.unavailable)
                self._note_staged([p.node_id for p in self._peers.list()], self.unavailable)
                return None
            return pool

    def _in_pool(self, tensor: Any) -> bool:
        ptr = tensor.data_ptr()
        return any(p.base <= ptr < p.base + p.max_bytes for p in list(self.pools.values()))

    def _pool_by_id(self, pool_id: Any) -> cuda_ipc.DevicePool | None:
        for pool in list(self.pools.values()):
            if pool.pool_id == pool_id:
                return pool
        return None

    def _opened(self, peer: int, pool: cuda_ipc.DevicePool, deadline: float) -> bool:
        """Whether ``peer`` opened ``pool``; offers it first if never asked. Waits for the
        verdict until ``deadline`` (at most :data:`VERDICT_WAIT_S`)."""
        key = (peer, pool.pool_id)
        with self._cond:
            if key in self._verdicts:
                return self._verdicts[key] is None
            asked = key in self._asked
            if not asked:
                self._asked[key] = time.monotonic()
        if not asked:
            self.stats["offers"] += 1
            try:
                self._send_control(peer, {"offer": pool.info()}, max(0.0, deadline - time.monotonic()))
            except MQError as exc:
                with self._cond:
                    self._asked.pop(key, None)
                log.debug("node %d: CUDA pool offer to node %d: %s", self.node_id, peer, exc)
                return False
        until = min(deadline, self._asked.get(key, time.monotonic()) + VERDICT_WAIT_S)
        try:
            self._waits.until(lambda: key in self._verdicts or self._closed, until, on=(self,), peers=(peer,))
        except MQError:  # no verdict in time (or the peer is gone): this frame is staged
            return False
        with self._cond:
            return self._verdicts.get(key, "closed") is None

    def _note_staged(self, peers: list[int], why: str) -> None:
        """Route ``nvlink`` to ``peers`` does not hold: GPU payloads take the CPU route."""
        with self._peers.changed:
            for peer in peers:
                p = self._peers.get(peer)
                if p is not None:
                    peer_route.stage_gpu(p, why)
        self._waits.wake(self._peers)

    def _note(self, peers: list[int], text: str) -> None:
        """Add ``text`` to the route's reason of ``peers`` (once)."""
        with self._peers.changed:
            for peer in peers:
                p = self._peers.get(peer)
                if p is not None:
                    peer_route.note(p, text)

    def on_verdict(self, peer: int, payload: dict[str, Any]) -> None:
        pool_id, error = payload.get("verdict"), payload.get("error")
        key = (peer, pool_id)
        with self._cond:
            if key not in self._asked or key in self._verdicts:
                raise ProtocolError(f"node {peer} answered a CUDA pool offer nobody made")
            if not (error is None or type(error) is str):
                raise ProtocolError(f"node {peer}: a CUDA pool verdict's error must be text")
            self._verdicts[key] = error
            del self._asked[key]
        self._waits.wake(self)
        if error is None:
            self.stats["verdicts_ok"] += 1
            log.debug("node %d: node %d opened CUDA pool %s in %.1f ms", self.node_id, peer, pool_id,
                      payload.get("open_ms") or 0.0)
        else:
            self.stats["verdicts_failed"] += 1
            log.warning("node %d: node %d cannot open this node's CUDA pool (%s): GPU tensors to it are "
                        "staged through host memory", self.node_id, peer, error)
            self._note_staged([peer], f"node {peer} could not open this node's CUDA pool: {error}")

    # ------------------------------------------------------------------ receiving
    def on_offer(self, peer: int, info: Any) -> None:
        """A peer offers its pool: open it off the I/O thread (it may take a while), answer."""
        threading.Thread(target=self._answer_offer, args=(peer, info), daemon=True,
                         name=f"mq{self.node_id}-cuda-open").start()

    def _answer_offer(self, peer: int, info: Any) -> None:
        pool_id = info.get("pool") if type(info) is dict else None
        error: str | None = None
        t0 = time.perf_counter()
        try:
            self.accept(peer, info)
        except (MQError, cuda_ipc.CudaError, RuntimeError, OSError) as exc:
            error = str(exc)
            log.warning("node %d: cannot open node %d's CUDA pool: %s", self.node_id, peer, error)
        verdict = {"verdict": pool_id if type(pool_id) is int else -1, "error": error,
                   "open_ms": (time.perf_counter() - t0) * 1e3}
        try:
            self._send_control(peer, verdict, 10.0)
        except MQError as exc:
            log.debug("node %d: CUDA pool verdict to node %d: %s", self.node_id, peer, exc)

    def reader_for(self, peer: int) -> cuda_ipc.PeerPools:
        """``peer``'s pools opened here (made on its first offer).

        Raises:
            ProtocolError: the route to ``peer`` is not nvlink here, or it is no live peer.
        """
        with self._peers.changed:
            p = self._peers.get(peer)
            if p is None or p.lost:
                raise ProtocolError(f"node {peer} is not a live peer")
            if p.route is None or p.route.gpu != "nvlink":
                raise ProtocolError(f"GPU payloads from node {peer} do not take nvlink here "
                                    f"({p.route.reason if p.route else 'no route'})")
            reader = p.readers.get(self.tag)
            if reader is None:
                loc = p.info.get("locality") or {}
                uuids = [g.get("uuid") for g in loc.get("gpus") or () if isinstance(g, dict)]
                release = self._release
                reader = p.readers[self.tag] = cuda_ipc.PeerPools(
                    peer, loc.get("pid"), uuids,
                    lambda pool_id, slot_id, event, peer=peer:  # type: ignore[misc]  # mypy: a lambda's default
                    release(peer, pool_id, slot_id, event))
            return reader

    def offer(self, device: int = 0) -> Any:
        """Our pool on ``device`` as a peer opens it (sent in a GPU_POOL frame at the first
        send to each nvlink peer)."""
        return self.pool_for(device).info()

    def accept(self, peer: int, offer: Any) -> cuda_ipc.PeerPools:
        """Open ``peer``'s pool described by ``offer`` here (idempotent); its reader.

        Raises:
            ProtocolError: the description is refused (nothing was opened).
            CudaError: the driver could not open it.
        """
        reader = self.reader_for(peer)
        reader.open(offer)
        return reader

    def on_frame(self, peer: int, payload: Any) -> None:
        """A GPU_POOL frame from an authenticated peer (its offer, or its verdict on ours)."""
        if type(payload) is not dict:
            raise ProtocolError(f"node {peer}: a GPU_POOL frame must carry a map")
        if "offer" in payload and len(payload) == 1:
            self.on_offer(peer, payload["offer"])
        elif "verdict" in payload:
            self.on_verdict(peer, payload)
        else:
            raise ProtocolError(f"node {peer}: a GPU_POOL frame is an offer or a verdict")

    def on_release(self, peer: int, item: list[Any]) -> None:
        if len(item) == 4:
            pool = self._pool_by_id(item[1])
            if pool is not None:
                pool.release(peer, item[2], item[3])

    # ------------------------------------------------------------------ housekeeping
    def forget(self, peer: Peer) -> None:
        """``peer`` is gone: its slots in our pools are free; its pools are closed here."""
        for pool in list(self.pools.values()):
            pool.peer_gone(peer.node_id)
        with self._cond:
            for key in [k for k in (*self._verdicts, *self._asked) if k[0] == peer.node_id]:
                self._verdicts.pop(key, None)
                self._asked.pop(key, None)
        self._waits.wake(self)
        reader = peer.readers.get(self.tag)
        if reader is not None:
            live = reader.live_views()
            if live:
                log.warning("node %d: node %d is gone while %d view(s) of its GPU memory are held here: "
                            "their contents are undefined now (clone() what you keep)",
                            self.node_id, peer.node_id, live)
            reader.close()

    def pool_for(self, device: int) -> cuda_ipc.DevicePool:
        """Our pool on ``device`` (for alloc)."""
        pool = self._pool(device)
        if pool is None:
            raise MQError(f"node {self.node_id} has no CUDA pool: {self.unavailable}")
        return pool

    def pool_of(self, tensor: Any) -> cuda_ipc.DevicePool:
        pool = self.pools.get(tensor.device.index) if getattr(tensor, "is_cuda", False) else None
        if pool is None:
            raise MQError("this tensor was not allocated with q.alloc(..., device='cuda:N')")
        return pool

    def _readers(self) -> list[cuda_ipc.PeerPools]:
        return [r for r in (p.readers.get(self.tag) for p in self._peers.list()) if r is not None]

    def counters(self) -> dict[str, Any]:
        """The cuda_ipc path's counters (empty while it was never used)."""
        return self.summary() if self.pools or self._readers() else {}

    def summary(self) -> dict[str, Any]:
        readers = self._readers()
        out: dict[str, Any] = dict(self.stats)
        for pool in self.pools.values():
            for k, v in pool.stats.items():
                out[k] = out.get(k, 0) + v
        out["held_bytes"] = sum(pool.held_bytes() for pool in self.pools.values())
        out["pools"] = len(self.pools)
        out["peer_opens"] = sum(r.opens for r in readers)
        out["peer_open_ms"] = sum(r.open_seconds for r in readers) * 1e3
        out["descriptors_refused"] = sum(r.refused for r in readers)
        return out

    def close(self) -> None:
        with self._cond:
            self._closed = True
        self._waits.wake(self)
        for pool in list(self.pools.values()):
            pool.close()
        for reader in self._readers():
            reader.close()
