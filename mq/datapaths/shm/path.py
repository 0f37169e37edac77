"""The shm data path of one node (route ``shm``): :mod:`mq.datapaths.shm.pool`'s pool behind the
:class:`~mq.datapaths.base.DataPath` interface.

Offer and accept ride in the join handshake (the wire format predates the interface): the
HELLO's ``shm`` field is :meth:`ShmPath.offer` (the pool's probe segment), the receiver's
:meth:`ShmPath.accept` maps that probe (a :class:`~mq.datapaths.shm.pool.PoolReader` kept on the peer as
``Peer.readers[None]``), and its ``read_ok`` verdict in HELLO_ACK/LINK decides whether we send
that peer descriptors (``Peer.cpu_path``). Descriptors are untagged int lists
``[seg_id, fd, gen, offset, nbytes]``; release items ``[seg_id, gen, count]``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from mq.datapaths.shm import pool as _shm
from mq.datapaths.base import DataPath, ReleaseQueue, on_cpu
from mq.errors import ConfigError, ProtocolError

log = logging.getLogger("mq")


class ShmPath(DataPath):
    """CPU buffers to same-host peers through this node's shared-memory pool.

    Args:
        releases: the node's release queue (a reader's dropped views go back through it).
        enabled: ``shm=`` of :func:`mq.create` (``unavailable`` says why not).
        pool_bytes, inline_max: the pool's bound and inline threshold.
    """

    route = "shm"
    tag = None
    device = "cpu"

    def __init__(self, node_id: int, peers: Any, releases: ReleaseQueue, *, enabled: bool, pool_bytes: int,
                 inline_max: int, waits: Any = None):
        _shm.Pool.check_options(pool_bytes, inline_max)
        self.node_id = node_id
        self._peers = peers
        self._releases = releases
        self._enabled = bool(enabled)
        self._options = (pool_bytes, inline_max)
        self._waits = waits
        self.pool: _shm.Pool | None = None
        self.unavailable: str | None = None if enabled else "turned off (shm=False)"

    @classmethod
    def make(cls, host: Any, options: dict[str, Any]) -> "ShmPath":
        return cls(host.node_id, host.peers, host.releases, enabled=options["shm"],
                   pool_bytes=options["shm_options"][0], inline_max=options["shm_options"][1], waits=host.waits)

    def open(self) -> None:
        if not self._enabled:
            return
        try:
            self.pool = _shm.Pool(*self._options, label=str(self.node_id), waits=self._waits)
            self.wants = self.pool.wants  # type: ignore[method-assign]  # bound once: the hot path asks it
        except OSError as exc:  # e.g. no memfd, or no memory for the probe: sockets only
            self.unavailable = f"cannot make a shared-memory pool here ({exc})"
            log.warning("node %d: %s; same-host peers use a socket", self.node_id, self.unavailable)

    def need_pool(self) -> _shm.Pool:
        if self.pool is None:
            why = self.unavailable or "the queue is not listening (use `with q:` or q.listen())"
            raise ConfigError(f"node {self.node_id} has no shared-memory pool: {why}")
        return self.pool

    # ------------------------------------------------------------------ per peer
    def offer(self) -> Any:
        return self.pool.probe_info() if self.pool is not None else None

    def accept(self, peer: int, offer: Any) -> _shm.PoolReader:
        """Map ``peer``'s probe segment: its reader, or ProtocolError saying why not (the
        route then falls back to a socket, and says so)."""
        pool = self.need_pool()
        put = self._releases.put
        # We map at most what its pool announced, and at most what ours may hold (or the
        # default, should ours be smaller than a legitimately larger peer's).
        reader = _shm.PoolReader(peer, offer, lambda seg_id, gen: put(peer, seg_id, gen),
                                 max_bytes=max(pool.max_bytes, _shm.DEFAULT_POOL_BYTES))
        why_not = reader.probe()
        if why_not:
            raise ProtocolError(why_not)
        return reader

    # ------------------------------------------------------------------ sending
    def wants(self, nbytes: int) -> bool:
        """Whether a CPU buffer of ``nbytes`` goes by descriptor."""
        return self.pool is not None and self.pool.wants(nbytes)

    def takes(self, buffers: list[Any], sizes: list[int]) -> list[int]:
        """The CPU buffers large enough for a descriptor."""
        pool = self.pool
        if pool is None:
            return []
        return [i for i, n in enumerate(sizes) if pool.wants(n) and on_cpu(buffers[i])]

    def ready(self, peers: list[int], buffers: list[Any], sizes: list[int], indices: list[int],
              deadline: float) -> list[int]:
        return peers  # a peer that read our probe reads every segment

    def place(self, peers: list[int], buffers: list[Any], indices: list[int],
              deadline: float, descs: dict[int, list[Any]] | None = None) -> dict[int, list[Any]]:
        pool = self.need_pool()
        descs = {} if descs is None else descs
        for i in indices:
            descs[i] = pool.place(buffers[i], peers, max(0.0, deadline - time.monotonic()))
        return descs

    def unhold(self, descs: dict[int, list[Any]], peers: list[int]) -> None:
        pool = self.pool
        if pool is None:
            return
        for seg_id, _fd, gen, _off, _n in descs.values():
            for peer in peers:
                pool.release(peer, seg_id, gen)

    # ------------------------------------------------------------------ releasing
    def on_release(self, peer: int, item: list[Any]) -> None:
        if len(item) == 3 and self.pool is not None:
            self.pool.release(peer, *item)

    def forget(self, peer: Any) -> None:
        if self.pool is not None:
            self.pool.peer_gone(peer.node_id)
        reader = peer.readers.get(self.tag)
        if reader is not None:
            reader.close()

    def _readers(self) -> list[_shm.PoolReader]:
        """The pools of our peers opened here."""
        return [r for r in (p.readers.get(self.tag) for p in self._peers.list()) if r is not None]

    def counters(self) -> dict[str, Any]:
        if self.pool is None:
            return {}
        readers = self._readers()
        return dict(self.pool.stats, peers_mapped_bytes=sum(r.mapped_bytes for r in readers),
                    descriptors_refused=sum(r.refused for r in readers))

    def close(self) -> None:
        for reader in self._readers():
            reader.close()
        if self.pool is not None:
            self.pool.close()
