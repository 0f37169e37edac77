"""Fuzz targets: each takes the fuzzer's bytes and feeds them to one parser of network input.

A target returns when the parser accepted the input or refused it with
:class:`~mq.errors.ProtocolError` (a refused link may also end with ``EOFError``). Anything else
escapes: an exception of another type, or a :class:`Finding` when the parser returned something
it must not (a payload owning more bytes than its frame, a handshake over the size limit).

Targets keep no state between inputs except the shared-memory pool of :func:`shm_target`, made once
per process (:func:`close` unmaps it). Input formats:

- ``handshake``, ``codec``: one frame in the contiguous layout (``codec``: also a batch of
  frames back to back, as :func:`mq.codec.split_batch` reads NNG messages).
- ``unixlink``, ``tcplink``: a mode byte (bit 0: the link already authenticated, where the
  link reader distinguishes; bit 1, tcp: large frames announced and followed, as a relay
  does; bit 2, tcp: frames flagged SHARED land in the shm pool, as a relay lends them), then
  chunks, each a length byte and that many bytes: one
  datagram each (unix), or one write each (tcp), read after every chunk.
- ``shm``: a msgpack value, the shared-memory descriptor a frame's header would carry.
- ``cuda``: a msgpack value: a CUDA descriptor as a frame's header would carry it, or (a map)
  a peer's CUDA pool description as its GPU_POOL offer would; only the host-side checks run
  (no GPU needed: they must refuse everything before any CUDA call).
"""

from __future__ import annotations

import contextlib
import inspect
import socket
import sys
from typing import Any, Callable, Iterator

import msgpack
import numpy as np

from mq import handshake
from mq.backends.nng.links import tcp as tcplink
from mq.backends.nng.links import unix as unixlink
from mq.codec import Codec, split_batch
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
    """:func:`mq.handshake.parse`: the only parser of a link that has not authenticated."""
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
    """:meth:`mq.codec.Codec.decode_frame`, and :func:`mq.codec.split_batch` with each frame
    decoded as the transports do (shared-memory descriptors resolved by a stand-in)."""
    codec = Codec()
    data = bytearray(data)  # writable, as every transport's received frames are
    try:
        _check_payload(codec.decode_frame(data).payload, data)
    except ProtocolError:
        pass
    try:
        for header, buffers in split_batch(data):
            try:
                _check_payload(codec.decode(header, buffers, _resolve).payload, data)
            except ProtocolError:
                pass
    except ProtocolError:
        pass


_SHARED = bytearray(64)  # what every descriptor "resolves" to: a peer's memory, not ours


def _resolve(sender: int, desc: Any) -> memoryview:
    """Stands in for :meth:`mq.shm.PoolReader.view`: a view for a well-shaped descriptor,
    ProtocolError otherwise (the ``shm`` target fuzzes the real one)."""
    if not (isinstance(desc, list) and len(desc) == 5 and all(type(x) is int for x in desc)):
        raise ProtocolError(f"malformed shared-memory descriptor {desc!r}")
    return memoryview(_SHARED)


def _check_payload(payload: Any, frame: bytearray) -> None:
    """A decoded payload may view its frame's memory, but may not own more bytes than the frame
    has: whatever a decoder copies or allocates for a peer must be paid for in bytes sent."""
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
    if sum(owned.values()) > len(frame):
        raise Finding(f"a {len(frame)}-byte frame decoded to a payload owning "
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
        from mq import shm

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
    """:meth:`mq.shm.PoolReader.view` with a descriptor decoded as a frame header's would be."""
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
    from mq import cuda_ipc

    pools = cuda_ipc.PeerPools(1, CUDA_PID, [CUDA_UUID], lambda *a: None)
    pools._pools[1] = cuda_ipc._Opened(dict(CUDA_POOL), 0, 1 << 40, [None] * 16, local=True)
    return pools


def cuda_target(data: bytes) -> None:
    """:meth:`mq.cuda_ipc.PeerPools.check` for a descriptor, :func:`mq.cuda_ipc.check_pool_info`
    for a pool description: what passes must lie inside the pool and name a real event."""
    from mq import cuda_ipc

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
}
assert tuple(TARGETS) == NAMES, "tests/fuzz/__init__.py lists the targets"
#: Seeds only a running target can make; :mod:`tests.fuzz.run` adds them to its corpus.
DYNAMIC_SEEDS: dict[str, Callable[[], list[bytes]]] = {"shm": shm_seeds}
