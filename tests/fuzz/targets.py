"""Fuzz targets: each takes the fuzzer's bytes and feeds them to one parser of network input.

A target returns when the parser accepted the input or refused it with
:class:`~mq.errors.ProtocolError` (a refused link may also end with ``EOFError``). Anything else
escapes: an exception of another type, or a :class:`Finding` when the parser returned something
it must not (a payload owning more bytes than its frame, a handshake over the size limit).

Targets keep no state between inputs except the shared-memory pool of :func:`shm_target`, made once
per process (:func:`close` unmaps it); the rdma target makes a fresh node per input. Input formats:

- ``handshake``, ``codec``: one frame in the contiguous layout (``codec``: also a batch of
  frames back to back, as :func:`mq.wire.codec.split_batch` reads NNG messages).
- ``unixlink``, ``tcplink``: a mode byte (bit 0: the link already authenticated, where the
  link reader distinguishes; bit 1, tcp: large frames announced and followed, as a relay
  does; bit 2, tcp: frames flagged SHARED land in the shm pool, as a relay lends them), then
  chunks, each a length byte and that many bytes: one
  datagram each (unix), or one write each (tcp), read after every chunk.
- ``shm``: a msgpack value, the shared-memory descriptor a frame's header would carry.
- ``cuda``: a msgpack value: a CUDA descriptor as a frame's header would carry it, or (a map)
  a peer's CUDA pool description as its GPU_POOL offer would; only the host-side checks run
  (no GPU needed: they must refuse everything before any CUDA call).
- ``rdma``: a msgpack value: a peer's signed rdma offer (a map, as its PATH frame carries it),
  a descriptor, or an offer followed by descriptors (see :func:`rdma_target`); the engine is a
  stand-in (no NIXL) whose ``read`` is a finding when a descriptor outside the offered memory
  reaches it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import socket
import sys
import time
from typing import Any, Callable, Iterator

import msgpack
import msgspec
import numpy as np

from mq import auth

from mq.wire import handshake

from mq.datapaths.rdma import path as rdma_path
from mq.backends.nng.links import tcp as tcplink
from mq.backends.nng.links import unix as unixlink
from mq.wire.codec import Codec, split_batch
from mq.errors import ProtocolError
from tests.fuzz import NAMES

#: The largest frame the link targets accept: bounds what a size claim may allocate.
LINK_MAX_FRAME = 1 << 16
#: Datagram and piece sizes while fuzzing a link: small, so the fuzzer's short inputs reach
#: the paths of frames that span several datagrams or records (the real ones are 64/256 KiB).
UNIX_DATAGRAM = 128
TCP_PIECE = 64
#: read() calls one link input may take before the reader counts as looping.
MAX_READS = 10_000


class Finding(AssertionError):
    """A parser returned something it must not have (not an exception it raised)."""


# ---------------------------------------------------------------------- handshake
def handshake_target(data: bytes) -> None:
    """:func:`mq.wire.handshake.parse`: the only parser of a link that has not authenticated."""
    try:
        hs = handshake.parse(data)
    except ProtocolError:
        return
    if len(data) > handshake.MAX_FRAME:
        raise Finding(f"a {len(data)}-byte handshake frame passed (limit {handshake.MAX_FRAME})")
    if hs.kind not in handshake.KINDS or not isinstance(hs.payload, dict):
        raise Finding(f"parse() returned a {hs.kind} frame with a {type(hs.payload).__name__} payload")


# ---------------------------------------------------------------------- codec
def codec_target(data: bytes) -> None:
    """:meth:`mq.wire.codec.Codec.decode_frame`, and :func:`mq.wire.codec.split_batch` with each frame
    decoded as the transports do (shared-memory descriptors resolved by a stand-in)."""
    codec = Codec()
    data = bytearray(data)  # writable, as every transport's received frames are
    try:
        _check_payload(codec.decode_frame(data).payload, data)
    except ProtocolError:
        pass
    try:
        for header, buffers in split_batch(data):
            _RESOLVED.clear()
            try:
                payload = codec.decode(header, buffers, _resolve).payload
                _check_payload(payload, data, shared_bytes=sum(_RESOLVED))
            except ProtocolError:
                pass
    except ProtocolError:
        pass


_SHARED = bytearray(64)  # what every descriptor "resolves" to: a peer's memory, not ours
_RESOLVED: list[int] = []  # the bytes of each descriptor the frame being decoded resolved


def _resolve(sender: int, desc: Any) -> memoryview:
    """Stands in for :meth:`mq.datapaths.shm.pool.PoolReader.view`: a view for a well-shaped descriptor,
    ProtocolError otherwise (the ``shm`` target fuzzes the real one)."""
    if not (isinstance(desc, list) and len(desc) == 5 and all(type(x) is int for x in desc)):
        raise ProtocolError(f"malformed shared-memory descriptor {desc!r}")
    _RESOLVED.append(len(_SHARED))
    return memoryview(_SHARED)


def _check_payload(payload: Any, frame: bytearray, shared_bytes: int = 0) -> None:
    """A decoded payload may view its frame's memory, but may not own more bytes than the frame
    has: whatever a decoder copies or allocates for a peer must be paid for in bytes sent.
    Bytes a peer put in shared memory count as sent (``shared_bytes``, one descriptor's span
    once): a large ``bytes`` value lent that way is copied out of the pool by design, and the
    codec lets a frame name each buffer once."""
    views = [_span(frame), _span(_SHARED)]
    owned: dict[str, int] = {}  # by type: which decoder path allocated it
    seen, todo = set(), [payload]
    while todo and len(seen) < 1_000_000:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.keys())
            todo.extend(obj.values())
        elif isinstance(obj, (bytes, bytearray, str)):
            owned[type(obj).__name__] = owned.get(type(obj).__name__, 0) + len(obj)
        else:
            memory = _memory_of(obj)  # (address, bytes) of an array's or tensor's memory
            if memory is not None and memory[0] not in seen and not any(
                    lo <= memory[0] < hi for lo, hi in views):
                seen.add(memory[0])
                owned[type(obj).__name__] = owned.get(type(obj).__name__, 0) + memory[1]
    if sum(owned.values()) > len(frame) + shared_bytes:
        raise Finding(f"a {len(frame)}-byte frame (and {shared_bytes} shared bytes) decoded to a payload owning "
                      f"{sum(owned.values())} bytes ({', '.join(f'{k}: {v}' for k, v in sorted(owned.items()))})")


def _span(buf: Any) -> tuple[int, int]:
    start = np.frombuffer(buf, np.uint8).ctypes.data
    return start, start + len(buf)


def _memory_of(obj: Any) -> tuple[int, int] | None:
    """(address, size) of the memory under a numpy array or torch tensor, else None."""
    if isinstance(obj, np.ndarray):
        base = obj
        while isinstance(base.base, np.ndarray):
            base = base.base
        return base.__array_interface__["data"][0], obj.nbytes
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    return None


# ---------------------------------------------------------------------- links
def unixlink_target(data: bytes) -> None:
    """:meth:`mq.backends.nng.links.unix.Inbound.read` over a SEQPACKET pair, a datagram per chunk."""
    with _patched(unixlink, "DATAGRAM", UNIX_DATAGRAM):
        _feed_link(unixlink.Inbound, socket.SOCK_SEQPACKET, data)


def tcplink_target(data: bytes) -> None:
    """:meth:`mq.backends.nng.links.tcp.Inbound.read` over a stream pair, a write per chunk."""
    with _patched(tcplink, "PIECE", TCP_PIECE), _patched(tcplink, "BEGUN_MIN", 2 * TCP_PIECE), \
            _patched(tcplink.warm, "MIN_SIZE", 2 * TCP_PIECE):
        _feed_link(tcplink.Inbound, socket.SOCK_STREAM, data)


def _feed_link(inbound: type, kind: int, data: bytes) -> None:
    """Write ``data``'s chunks into a socket pair, reading the link after each; the reader may
    end the link only with EOFError or ProtocolError."""
    if not data:
        return
    ours, theirs = socket.socketpair(socket.AF_UNIX, kind)
    link = None
    try:
        theirs.setblocking(False)  # the reader drains after each chunk: a full buffer is a bug
        link = _make_inbound(inbound, ours, trusted=bool(data[0] & 1))
        if hasattr(link, "announce"):  # tcp: large frames announced, some followed (cut-through)
            link.announce = bool(data[0] & 2)
            link.lend = shm_peer().pool.lend if data[0] & 4 else None
        for chunk in _chunks(data[1:]):
            theirs.send(chunk)
            if not _drain(link):
                return
        theirs.close()
        _drain(link)
    except (EOFError, ProtocolError):
        pass
    finally:
        theirs.close()
        if link is not None:
            link.close()
        else:
            ours.close()


def _make_inbound(inbound: type, sock: socket.socket, trusted: bool) -> Any:
    """An Inbound link over ``sock``, whatever its constructor takes besides the socket: a
    frame bound (``max_frame...``), and, where it has one, whether the link authenticated."""
    kwargs: dict[str, Any] = {}
    args: list[Any] = [sock]
    for name, param in list(inspect.signature(inbound).parameters.items())[1:]:
        if name.startswith("max_frame"):
            value: Any = LINK_MAX_FRAME
        elif name.startswith("trust"):
            value = lambda *_a: trusted  # noqa: E731  (asked per link or per frame)
        elif param.default is not param.empty:
            continue
        else:
            raise TypeError(f"{inbound.__qualname__} wants {name!r}: teach tests/fuzz/targets.py")
        if param.kind is param.KEYWORD_ONLY:
            kwargs[name] = value
        else:
            args.append(value)
    return inbound(*args, **kwargs)


def _chunks(data: bytes) -> Iterator[bytes]:
    """A length byte, then that many bytes, repeated (the last chunk may be short)."""
    pos = 0
    while pos < len(data):
        n = data[pos]
        yield data[pos + 1:pos + 1 + n]
        pos += 1 + n


def _drain(link: Any) -> bool:
    """Read whole frames until none is complete: False when the link ended (EOF)."""
    for _ in range(MAX_READS):
        try:
            frame = link.read()
        except EOFError:
            return False
        if frame is None:
            return True
        if type(frame) is tcplink.Begun:  # a large frame's header is in: follow the rest
            frame.watch()
            continue
        if len(memoryview(frame).cast("B")) > LINK_MAX_FRAME:
            raise Finding(f"a link read a {len(frame)}-byte frame (max_frame {LINK_MAX_FRAME})")
    raise Finding(f"read() returned frames {MAX_READS} times from one short input")


@contextlib.contextmanager
def _patched(module: Any, name: str, value: Any) -> Iterator[None]:
    """``module.name = value`` for the block (if the module still has that name)."""
    if not hasattr(module, name):
        yield
        return
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


# ---------------------------------------------------------------------- shared memory
class _ShmPeer:
    """A real pool of this process, read through a PoolReader as a peer's pool would be."""

    def __init__(self) -> None:
        from mq.datapaths.shm import pool as shm

        self.pool = shm.Pool(max_bytes=16 << 20, label="fuzz")
        # Live slots of a few sizes, with generations past 0: what real descriptors name.
        self.descriptors = [self.pool.place(np.full(n, 7, np.uint8), [1], 1.0)
                            for n in (64 << 10, 200_000, 1 << 20)]
        self.reader = shm.PoolReader(0, self.pool.probe_info(), lambda seg_id, gen: None)
        self.why_not = self.reader.probe()  # None: the descriptors below can really be opened

    def close(self) -> None:
        self.reader.close()
        self.pool.close()


_shm_peer: _ShmPeer | None = None


def shm_peer() -> _ShmPeer:
    global _shm_peer
    if _shm_peer is None:
        _shm_peer = _ShmPeer()
    return _shm_peer


def shm_target(data: bytes) -> None:
    """:meth:`mq.datapaths.shm.pool.PoolReader.view` with a descriptor decoded as a frame header's would be."""
    try:
        desc = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=False)
    except Exception:
        return  # not a msgpack value: the codec target fuzzes the envelope around descriptors
    try:
        view = shm_peer().reader.view(desc)
    except ProtocolError:
        return
    if len(view) != desc[4]:
        raise Finding(f"descriptor {desc} gave a view of {len(view)} bytes")
    del view  # its release runs now, as a receiver dropping a message


def shm_seeds() -> list[bytes]:
    """Descriptors of this process's pool (fds and generations are only known at run time)."""
    peer = shm_peer()
    return [msgpack.packb(d) for d in peer.descriptors] + [msgpack.packb(peer.pool.probe_info()["probe"])]


# ---------------------------------------------------------------------- CUDA (host-side checks)
CUDA_UUID = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
CUDA_PID = 4242
CUDA_POOL = {"pool": 1, "uuid": CUDA_UUID, "size": 64 << 20, "handle": b"h" * 64,
             "events": [b"e" * 64] * 16, "pid": CUDA_PID, "incarnation": "fuzz"}


def _cuda_pools() -> Any:
    """A peer's pools as a receiver holds them once pool 1 was offered (its base a dummy: the
    target only runs the checks, which never touch it)."""
    from mq.datapaths.nvlink import cuda_ipc

    pools = cuda_ipc.PeerPools(1, CUDA_PID, [CUDA_UUID], lambda *a: None)
    pools._pools[1] = cuda_ipc._Opened(dict(CUDA_POOL), 0, 1 << 40, [None] * 16, local=True)
    return pools


def cuda_target(data: bytes) -> None:
    """:meth:`mq.datapaths.nvlink.cuda_ipc.PeerPools.check` for a descriptor, :func:`mq.datapaths.nvlink.cuda_ipc.check_pool_info`
    for a pool description: what passes must lie inside the pool and name a real event."""
    from mq.datapaths.nvlink import cuda_ipc

    try:
        value = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=False)
    except Exception:
        return
    try:
        if isinstance(value, dict):
            cuda_ipc.check_pool_info(value, 1, CUDA_PID, [CUDA_UUID])
            return
        _opened, _slot, offset, nbytes, k = _cuda_pools().check(value)
    except ProtocolError:
        return
    if offset % cuda_ipc.ALIGN or not 0 < nbytes <= CUDA_POOL["size"] - offset or not 0 <= k < 16:
        raise Finding(f"descriptor {value} passed with a span or event outside the pool")


def cuda_seeds() -> dict[str, bytes]:
    """Good and bad descriptors and pool descriptions."""
    return {name: msgpack.packb(value, use_bin_type=True) for name, value in {
        "good": ["cuda", 1, 3, 256, 1024, 2], "last-byte": ["cuda", 1, 3, (64 << 20) - 256, 256, 15],
        "past-end": ["cuda", 1, 3, (64 << 20) - 256, 512, 0], "unaligned": ["cuda", 1, 3, 3, 8, 0],
        "event": ["cuda", 1, 3, 0, 8, 16], "bool": ["cuda", 1, 3, 0, True, 0], "pool": CUDA_POOL,
        "pool-pid": dict(CUDA_POOL, pid=1), "pool-handle": dict(CUDA_POOL, handle=b"h"),
    }.items()}


# ---------------------------------------------------------------------- rdma (offers, descriptors)
RDMA_NODE, RDMA_PEER = 1, 2
RDMA_NODE_INC, RDMA_PEER_INC = "fuzz-node", "fuzz-peer"
RDMA_SECRET = auth.Secret(b"fuzz-job-secret-0123456789", "explicit")
RDMA_AGENT = f"mq-{RDMA_PEER}-{RDMA_PEER_INC}"  # the agent name node RDMA_PEER's offers must give
RDMA_META = b"nixl-metadata:" + RDMA_AGENT.encode() + bytes(range(32))  # the one blob the engine loads
RDMA_SEGMENTS = [[1, 0x7F00_0000_0000, 1 << 20], [2, 0x7F00_0100_0000, 2 << 20]]
RDMA_POOL_BYTES = 16 << 20  # the receiver's landing pool bound
RDMA_MAX_DESCRIPTORS = 16  # descriptors read after one offer (a sequence input)


class _RdmaEngine:
    """Stands in for :class:`mq.datapaths.rdma.engine.Engine` (no NIXL): registers nothing, loads only the
    metadata blob :data:`RDMA_META` (as node :data:`RDMA_PEER`'s agent), and "reads" by checking
    the span against what the peer really offered. A read outside it is a finding: a
    descriptor the checks should have refused reached the transfer (recorded here, because
    the path turns an exception of ``read`` into PeerLeft, a ProtocolError)."""

    version = "fuzz"
    device = None
    transport = "tcp"

    def __init__(self, name: str, meta: bytes = b"") -> None:
        self.name = name
        self._meta = meta
        self.loaded: set[str] = set()
        self.registered: dict[int, tuple[int, int]] = {}  # handle -> (addr, nbytes)
        self.offered: list[Any] = []  # the segments the peer offered: what it registered
        self.reads = 0
        self.findings: list[str] = []

    def register(self, addr: int, nbytes: int) -> int:
        handle = len(self.registered) + 1
        self.registered[handle] = (addr, nbytes)
        return handle

    def deregister(self, handle: int) -> None:
        del self.registered[handle]

    def metadata(self, regions=None) -> bytes:
        return self._meta

    def add_peer(self, meta: bytes) -> str:
        if type(meta) is not bytes or meta != RDMA_META:
            raise RuntimeError("NIXL: not a metadata blob this test knows")
        self.loaded.add(RDMA_AGENT)
        return RDMA_AGENT

    def hold_peer(self, name: str) -> None:
        pass

    def remove_peer(self, name: str) -> None:
        self.loaded.discard(name)

    def read(self, peer: str, remote_addr: int, local_addr: int, nbytes: int) -> str:
        self.reads += 1
        why = None
        if peer not in self.loaded:
            why = f"a read from agent {peer!r}, whose metadata is not loaded"
        elif not any(type(a) is int and type(n) is int and a <= remote_addr and remote_addr + nbytes <= a + n
                     for _i, a, n in self.offered):
            why = f"a read of {nbytes} bytes at {remote_addr:#x}, outside the segments the peer offered"
        elif not any(a <= local_addr and local_addr + nbytes <= a + n for a, n in self.registered.values()):
            why = f"a read of {nbytes} bytes into {local_addr:#x}, outside our registered memory"
        if why:
            self.findings.append(why)
            raise Finding(why)
        return "handle"

    def state(self, handle: str) -> str:
        return "DONE"

    def release(self, handle: str) -> None:
        pass


class _RdmaPeer:
    def __init__(self, node_id: int, incarnation: str) -> None:
        self.node_id = node_id
        self.info = {"incarnation": incarnation, "rdma": {"agent": RDMA_AGENT}}  # its HELLO's caps
        self.readers: dict[str, Any] = {}
        self.lost: str | None = None


class _RdmaPeers:
    """Stands in for a node's peer table: one peer."""

    def __init__(self, node_id: int, incarnation: str) -> None:
        self.peer = _RdmaPeer(node_id, incarnation)

    def get(self, node_id: Any) -> _RdmaPeer | None:
        return self.peer if node_id == self.peer.node_id else None

    def list(self) -> list[_RdmaPeer]:
        return [self.peer]

    def lose(self, node_id: int, why: str) -> None:
        self.peer.lost = why


class _RdmaHost:
    """What RdmaPath asks of its node: peers, the release queue, control frames (kept)."""

    def __init__(self, node_id: int, peer: int, peer_incarnation: str) -> None:
        self.node_id = node_id
        self.peers = _RdmaPeers(peer, peer_incarnation)
        self.released: list[tuple[Any, ...]] = []
        self.sent: list[tuple[int, int, Any]] = []
        self.releases = self

    def put(self, peer: int, seg_id: Any, gen: int, event: Any = None) -> None:
        self.released.append((peer, seg_id, gen))

    def send_control(self, peer: int, kind: int, body: Any, timeout: float) -> None:
        self.sent.append((peer, kind, body))


class RdmaNode:
    """One node's rdma path with the stand-in engine, opened as :meth:`RdmaPath.open` would
    (send and landing pools on the engine): node :data:`RDMA_NODE`, whose one peer is node
    :data:`RDMA_PEER` (``sender=True``: the other way round)."""

    def __init__(self, sender: bool = False) -> None:
        me, them = (RDMA_PEER, RDMA_NODE) if sender else (RDMA_NODE, RDMA_PEER)
        my_inc, their_inc = (RDMA_PEER_INC, RDMA_NODE_INC) if sender else (RDMA_NODE_INC, RDMA_PEER_INC)
        self.host = _RdmaHost(me, them, their_inc)
        self.path = rdma_path.RdmaPath(me, self.host, mode="tcp", pool_bytes=RDMA_POOL_BYTES,
                                       inline_max=64 << 10, secret=RDMA_SECRET, incarnation=my_inc,
                                       locality=None)
        self.engine = _RdmaEngine(f"mq-{me}-{my_inc}", RDMA_META if sender else b"")
        self.path.engine = self.engine
        self.path.send_pool = rdma_path.RegisteredPool(self.engine, RDMA_POOL_BYTES, waits=True, label="send")
        self.path.landing = rdma_path.RegisteredPool(self.engine, RDMA_POOL_BYTES, waits=False, label="landing")
        self.path.unavailable = None
        self.peer = self.host.peers.peer

    def accept(self, offer: Any) -> Any:
        """:meth:`RdmaPath.accept`, checked: a refused offer is counted and leaves the peer's
        reader as it was; a loaded one names the peer's agent and only segments in bounds.
        The peer's reader, or ProtocolError."""
        refused, before = self.path.stats["offers_refused"], self.peer.readers.get("rdma")
        state = None if before is None else (before.seq, dict(before.segments))
        try:
            reader = self.path.accept(RDMA_PEER, offer)
        except ProtocolError:
            after = self.peer.readers.get("rdma")
            if self.path.stats["offers_refused"] != refused + 1:
                raise Finding(f"offer {offer!r:.300} refused but not counted") from None
            if after is not before or (after is not None and (after.seq, after.segments) != state):
                raise Finding(f"refused offer {offer!r:.300} changed the peer's reader") from None
            raise
        if reader is not self.peer.readers.get("rdma") or reader.agent != RDMA_AGENT or \
                RDMA_AGENT not in self.engine.loaded:
            raise Finding(f"offer {offer!r:.300} loaded as agent {reader.agent!r}")
        for seg_id, (addr, size) in reader.segments.items():
            if not (type(seg_id) is int and type(addr) is int and type(size) is int and 0 < seg_id
                    and 0 < addr < 1 << 64 and 0 < size <= 1 << 40):
                raise Finding(f"offer {offer!r:.300} loaded segment {seg_id!r}: {addr!r}, {size!r}")
        self.engine.offered = [[i, a, n] for i, (a, n) in reader.segments.items()]
        return reader

    def view(self, reader: Any, desc: Any) -> None:
        """:meth:`RdmaReader.view`, checked: a refused descriptor is counted and never reaches
        the engine; one taken is read whole from the peer's offered memory into ours."""
        refused, reads = reader.refused, self.engine.reads
        try:
            try:
                view = reader.view(desc)
            finally:
                if self.engine.findings:
                    raise Finding(f"descriptor {desc!r:.200}: {self.engine.findings[0]}")
        except ProtocolError:
            if self.engine.reads != reads:
                raise Finding(f"descriptor {desc!r:.200} was refused after the engine read it") from None
            if reader.refused != refused + 1:
                raise Finding(f"descriptor {desc!r:.200} refused but not counted") from None
            raise
        if self.engine.reads != reads + 1 or len(view) != desc[4]:
            raise Finding(f"descriptor {desc!r:.200} gave a view of {len(view)} bytes "
                          f"after {self.engine.reads - reads} reads")
        if self.host.released[-1:] != [(RDMA_PEER, ("rdma", desc[1]), desc[2])]:
            raise Finding(f"descriptor {desc!r:.200}: the sender's slot was not released")
        del view  # the landing slot is unpinned now, as a receiver dropping a message

    def close(self) -> None:
        self.path.close()


def rdma_sign(offer: dict[str, Any]) -> dict[str, Any] | None:
    """``offer`` with the MAC node :data:`RDMA_PEER` would put on it (a job member: it holds
    the secret, so every check past the MAC must hold too); None if it is not an offer."""
    try:
        parsed = msgspec.convert(offer, rdma_path._Offer)
    except msgspec.ValidationError:
        return None
    return dict(offer, mac=_rdma_mac(parsed, RDMA_PEER_INC))


def _rdma_mac(offer: Any, incarnation: str) -> bytes:
    """The MAC node RDMA_PEER (in ``incarnation``) puts on ``offer`` (an ``_Offer``), by the
    code of a real sender's path."""
    global _rdma_signer
    if _rdma_signer is None:
        _rdma_signer = RdmaNode(sender=True).path
    return _rdma_signer._proof(RDMA_PEER, incarnation, RDMA_NODE, RDMA_NODE_INC, offer)


_rdma_signer: Any = None


#: Node RDMA_PEER's offer of RDMA_SEGMENTS, signed: what passes; the fuzzer has no key to sign another.
RDMA_OFFER = rdma_sign({"seq": 1, "agent": RDMA_AGENT, "meta": RDMA_META, "segments": RDMA_SEGMENTS})
assert RDMA_OFFER is not None


def rdma_target(data: bytes) -> None:
    """:meth:`mq.datapaths.rdma.path.RdmaPath.accept` (its ``_load``) and :meth:`mq.datapaths.rdma.path.RdmaReader.view`
    on a receiver whose engine is a stand-in (no NIXL). The input is a msgpack value:

    - a map: an offer as a PATH frame carries it; only one signed with the job secret may load
      (the fuzzer has no key: whatever loads must be :data:`RDMA_OFFER`'s content), and it
      again is a replay. The same offer signed as a job member would sign it is tried too.
    - a list starting with a map: that offer (signed here if it has no ``mac``), then the
      descriptors after it read against what it offered.
    - anything else: a descriptor, read against :data:`RDMA_OFFER`.
    """
    try:
        value = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=False)
    except Exception:
        return
    # a refused offer is logged (millions, here); a frame naming a segment whose offer another
    # thread may be loading waits for it (no other thread here: nothing to wait for)
    with _patched(rdma_path, "log", _QUIET), _patched(rdma_path, "OFFER_WAIT_S", 0.0):
        _rdma_input(value)


_QUIET = logging.getLogger("mq.fuzz.quiet")
_QUIET.propagate = False
_QUIET.disabled = True


def _rdma_input(value: Any) -> None:
    if type(value) is dict:
        _rdma_offer(value, signed_here=False)
        signed = rdma_sign(value)
        if signed is not None:
            _rdma_offer(signed, signed_here=True)
        return
    if type(value) is list and value and type(value[0]) is dict:
        offer, descs = value[0], value[1:RDMA_MAX_DESCRIPTORS + 1]
        if "mac" not in offer:
            offer = rdma_sign(offer) or offer
    else:
        offer, descs = RDMA_OFFER, [value]
    node = RdmaNode()
    try:
        try:
            reader = node.accept(offer)
        except ProtocolError:
            return
        for desc in descs:
            try:
                node.view(reader, desc)
            except ProtocolError:
                pass
    finally:
        node.close()


def _rdma_offer(offer: dict[Any, Any], signed_here: bool) -> None:
    node = RdmaNode()
    try:
        try:
            reader = node.accept(offer)
        except ProtocolError:
            return
        loaded = [reader.seq, reader.agent, sorted([i, a, n] for i, (a, n) in reader.segments.items())]
        if not signed_here and loaded != [RDMA_OFFER["seq"], RDMA_AGENT, sorted(RDMA_SEGMENTS)]:
            raise Finding(f"offer {offer!r:.300} loaded without the job secret's signature: {loaded}")
        try:
            node.accept(offer)
        except ProtocolError:
            pass
        else:
            raise Finding(f"offer {offer!r:.300} loaded twice (a replay)")
    finally:
        node.close()


def rdma_runtime_offers() -> list[dict[str, Any]]:
    """What a real sender's path puts in its PATH frames (:meth:`RdmaPath.place`, then its
    ``_offer``), the stand-in engine under it: the offer, twice (a new segment offered
    again), as sequence inputs with the descriptors placed."""
    sender = RdmaNode(sender=True)
    out = []
    try:
        for n in (100_000, 3 << 20):
            descs = sender.path.place([RDMA_NODE], [np.full(n, 7, np.uint8)], [0], time.monotonic() + 5)
            (_peer, _kind, (_tag, body)), = sender.host.sent[-1:]
            out.append([body["offer"], descs[0]])
            sender.path.unhold(descs, [RDMA_NODE])
    finally:
        sender.close()
    return out


def rdma_seeds() -> dict[str, bytes]:
    """Offers (good, forged, replayed from another incarnation...) and descriptors."""
    good = RDMA_OFFER
    stale = dict(good, mac=_rdma_mac(msgspec.convert(dict(good, mac=None), rdma_path._Offer), "another-incarnation"))
    big = [[1, 0x7F00_0000_0000, 1 << 20], [2, 0x7F00_0100_0000, 1 << 40]]
    unsigned = {k: v for k, v in good.items() if k != "mac"}
    return {name: msgpack.packb(value, use_bin_type=True) for name, value in {
        "offer-good": good, "offer-forged-segments": dict(good, segments=big),
        "offer-unsigned": unsigned, "offer-other-incarnation": stale,
        "offer-other-agent": dict(good, agent=f"mq-{RDMA_PEER}-x"), "offer-extra-field": dict(good, x=1),
        "desc-good": ["rdma", 1, 1, 0, 4096], "desc-last-byte": ["rdma", 2, 1, (2 << 20) - 1, 1],
        "desc-whole-segment": ["rdma", 2, 7, 0, 2 << 20], "desc-past-end": ["rdma", 1, 1, 1, 1 << 20],
        "desc-negative": ["rdma", 1, 1, -4096, 4096], "desc-unknown-segment": ["rdma", 3, 1, 0, 64],
        "desc-bool": ["rdma", 1, 1, 0, True], "desc-short": ["rdma", 1, 1, 0],
        "then-descs": [unsigned, ["rdma", 1, 1, 0, 64], ["rdma", 2, 1, 4096, 1 << 20], ["rdma", 1, 2, 1 << 20, 1]],
    }.items()}


def close() -> None:
    """Unmap what the targets made (the shared-memory pool)."""
    global _shm_peer
    if _shm_peer is not None:
        _shm_peer.close()
        _shm_peer = None


TARGETS: dict[str, Callable[[bytes], None]] = {
    "handshake": handshake_target,
    "codec": codec_target,
    "unixlink": unixlink_target,
    "tcplink": tcplink_target,
    "shm": shm_target,
    "cuda": cuda_target,
    "rdma": rdma_target,
}
assert tuple(TARGETS) == NAMES, "tests/fuzz/__init__.py lists the targets"
#: Seeds only a running target can make; :mod:`tests.fuzz.run` adds them to its corpus.
DYNAMIC_SEEDS: dict[str, Callable[[], list[bytes]]] = {
    "shm": shm_seeds, "rdma": lambda: [msgpack.packb(v, use_bin_type=True) for v in rdma_runtime_offers()]}
