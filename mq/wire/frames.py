"""The contiguous layout of a frame: what every transport moves (issue 45 split it from
:mod:`mq.wire.codec`, which turns payloads into a frame's header tree and buffers and back).

A frame is ``u32 header length, header, padding, buffer, padding, buffer, ...``, each buffer
64-byte aligned (:data:`ALIGN`). The header is the msgpack envelope ``[VERSION, kind, topic,
sender, seq, corr, tree, sizes, descs, sent_at]``. :class:`Frame` is an encoded frame not yet
copied anywhere; :func:`split` (:func:`split_batch`) reads one (several, back to back) into the
parsed header and views of its buffers, checked against the frame's length.
"""

from __future__ import annotations

import struct
import sys
import threading
import time
from typing import Any

import msgpack
import numpy as np

from mq.errors import ProtocolError

VERSION = 2
ALIGN = 64
ZERO_PAD = bytes(ALIGN)  # padding between the parts of the contiguous layout
_U32 = struct.Struct("<I")
# Frame kinds. Data flows one way through them: the backend only looks at ``kind``.
# RELAY (last) carries a message through another node, see mq.fanout.relays.
# GPU_POOL offers a CUDA pool to a peer and carries its verdict, see mq.datapaths.nvlink.path.
# PATH carries a data path's own control frames, ``[tag, body]`` (the rdma path's offers).
MSG, REQ, REP_OK, REP_ERR, HELLO, HELLO_ACK, SUBS, BYE, RELEASE, LINK, PING, RELAY, GPU_POOL, PATH = range(14)

KIND_NAMES = ("MSG", "REQ", "REP_OK", "REP_ERR", "HELLO", "HELLO_ACK", "SUBS", "BYE", "RELEASE", "LINK",
              "PING", "RELAY", "GPU_POOL", "PATH")
_ENVELOPE_FIELDS = 10  # VERSION, kind, topic, sender, seq, corr, tree, sizes, descs, sent_at

MAX_BUFFERS = 1 << 16

#: torch, once :func:`mq.wire.codec._load_torch` imported it (nothing is a tensor before), and the
#: torch dtypes numpy can view directly (filled there too).
torch: Any = None
_NUMPY_OK: set[Any] = set()


class _Packers(threading.local):
    """A msgpack Packer per thread: ``msgpack.packb`` makes a new one per call (~0.7 us of a
    small message's ~10), and one Packer must not be shared by threads."""

    pack = msgpack.Packer(use_bin_type=True).pack  # (each thread gets its own from __init__)

    def __init__(self) -> None:
        self.pack = msgpack.Packer(use_bin_type=True).pack


_packb = _Packers()


_LAZY_MIN = 1 << 20  # from here on a receive buffer is numpy's: untouched pages, huge pages


def empty_buffer(size: int) -> Any:
    """A writable buffer of ``size`` bytes for a frame to be written into, contents undefined.

    ``bytearray(size)`` writes zeros over every page first: for 100 MB that alone cost ~60 ms
    here, more than receiving the bytes. Large buffers are ``numpy.empty`` (pages are mapped
    when the frame's bytes land in them, as huge pages where the kernel allows); small ones
    stay bytearrays, which are cheaper to make. Raises MemoryError like ``bytearray``."""
    return bytearray(size) if size < _LAZY_MIN else np.empty(size, np.uint8)


def _is_tensor(obj: Any) -> bool:
    # If torch was never imported, nothing can be a tensor.
    mod = sys.modules.get("torch")
    return mod is not None and isinstance(obj, mod.Tensor)


def _tensor_bytes(t: "torch.Tensor") -> np.ndarray:
    """A contiguous CPU tensor's memory as a numpy array (no copy); written out byte-wise."""
    if t.dim() and t.dtype in _NUMPY_OK and t.numel():
        return t.numpy()  # C-contiguous: memoryview(...).cast("B") sees its bytes
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return flat.view(torch.uint8).numpy()


def buffer_nbytes(b: Any) -> int:
    """Bytes in one frame buffer: a memoryview, numpy array, tensor or bytes-like."""
    if type(b) is memoryview or type(b) is np.ndarray:  # the common ones first: per buffer
        return b.nbytes
    if _is_tensor(b):
        return b.numel() * b.element_size()
    return memoryview(b).nbytes


def _unpack_head(header: Any) -> Any:
    return msgpack.unpackb(header, raw=False, use_list=True, strict_map_key=False)


def split(frame: Any) -> tuple[list[Any], list[memoryview]]:
    """The contiguous layout (see the module docstring) -> (parsed header, buffer views), the
    buffers checked against the frame's length; :class:`ProtocolError` if they overrun it."""
    head, buffers, _next = _split_at(memoryview(frame).cast("B"), 0)
    return head, buffers


def split_batch(message: Any) -> Any:
    """Yield (parsed header, buffer views) for each frame of a message holding one or more
    frames in the contiguous layout back to back, each starting on a 64-byte boundary (how
    the nng transport batches a stream's small frames). A malformed frame raises
    :class:`ProtocolError` when reached; the frames before it were already yielded."""
    view = memoryview(message).cast("B")
    start = 0
    while True:
        head, buffers, start = _split_at(view, start)
        yield head, buffers
        if start >= len(view):
            return


def _split_at(view: memoryview, start: int) -> tuple[list[Any], list[memoryview], int]:
    """One frame at ``start`` -> (header, buffers, where the next frame would start)."""
    end = len(view)
    if end - start < 4:
        raise ProtocolError(f"truncated frame of {end - start} bytes")
    (hlen,) = _U32.unpack_from(view, start)
    if start + 4 + hlen > end:
        raise ProtocolError(f"header of {hlen} bytes overruns a {end - start}-byte frame")
    try:
        head = _unpack_head(view[start + 4:start + 4 + hlen])
    except Exception as exc:
        raise ProtocolError(f"malformed envelope: {type(exc).__name__}: {exc}") from exc
    if type(head) is not list or len(head) != _ENVELOPE_FIELDS:
        raise ProtocolError(f"an envelope must be a list of {_ENVELOPE_FIELDS} fields")
    sizes = head[7]
    if type(sizes) is not list or len(sizes) > MAX_BUFFERS:
        raise ProtocolError(f"envelope buffer sizes are not a list of at most {MAX_BUFFERS}")
    buffers, pos = [], start + ((4 + hlen + ALIGN - 1) & -ALIGN)
    for n in sizes:
        if not (type(n) is int and 0 <= n and pos + n <= end):
            raise ProtocolError(f"buffer of {n!r} bytes at offset {pos - start} overruns the "
                                f"{end - start}-byte frame")
        buffers.append(view[pos:pos + n])
        pos += (n + ALIGN - 1) & -ALIGN
    return head, buffers, pos


def check_envelope(version: Any, kind: Any, topic: Any, sender: Any, corr: Any, tree: Any,
                   *, expected_version: int = VERSION) -> None:
    """Validate decoded envelope fields (every backend's wire shares this check)."""
    if version != expected_version:
        raise ProtocolError(f"frame version {version!r}, this node speaks {expected_version}")
    if not (isinstance(kind, int) and 0 <= kind < len(KIND_NAMES) and isinstance(topic, str)
            and isinstance(sender, int) and isinstance(corr, int) and isinstance(tree, bytes)):
        raise ProtocolError("envelope fields have the wrong types")


class Frame:
    """An encoded frame not yet copied anywhere: the header plus buffer objects.

    ``buffers`` are numpy uint8 arrays, bytes or tensors (``keep_tensors``); a buffer that goes
    by the shm data path is an empty placeholder in :meth:`with_descriptors`'s copy.
    ``layout`` caches what a transport derived from the frame (publish lays out once).
    """

    __slots__ = ("kind", "head", "header", "buffers", "sizes", "_offsets", "size", "nbytes", "layout", "gpu")

    def __init__(self, kind: int, head: list[Any], buffers: list[Any], sizes: list[int]):
        self.kind = kind
        self.head = head  # the envelope fields, for with_descriptors
        self.header = _packb.pack(head)
        self.buffers = buffers
        self.sizes = sizes
        self.layout: dict[Any, Any] = {}
        # The contiguous layout's offsets: header after its u32 length, each buffer 64-aligned.
        pos = (4 + len(self.header) + ALIGN - 1) & -ALIGN
        offsets = []
        inline = 0
        for n in sizes:
            offsets.append(pos)
            inline += n
            pos = (pos + n + ALIGN - 1) & -ALIGN
        self._offsets = offsets
        self.size = offsets[-1] + sizes[-1] if sizes else 4 + len(self.header)
        self.nbytes = len(self.header) + inline  # header plus inline bytes: what crosses the transport
        # Holds CUDA tensors: the sender must give each peer descriptors or a staged copy.
        # (A plain loop: this runs per frame, see scripts/hotpath.)
        gpu = False
        if torch is not None:
            for b in buffers:
                if type(b) is torch.Tensor and b.is_cuda:
                    gpu = True
                    break
        self.gpu = gpu

    @classmethod
    def build(cls, kind: int, topic: str, sender: int, seq: int, corr: int, tree: bytes,
              buffers: list[Any]) -> "Frame":
        if not buffers:
            sizes = []
        elif len(buffers) == 1 and type(buffers[0]) is np.ndarray:  # (the common one: no call, no loop)
            sizes = [buffers[0].nbytes]
        else:
            sizes = [buffer_nbytes(b) for b in buffers]
        head = [VERSION, kind, topic, sender, seq, corr, tree, sizes, None, time.time()]
        return cls(kind, head, buffers, sizes)

    def with_descriptors(self, descs: dict[int, Any]) -> "Frame":
        """This frame with buffers ``descs`` names replaced by shm descriptors."""
        sizes = [0 if i in descs else n for i, n in enumerate(self.sizes)]
        buffers = [b"" if i in descs else b for i, b in enumerate(self.buffers)]
        head = self.head[:7] + [sizes, descs, self.head[9]]
        return Frame(self.kind, head, buffers, sizes)

    def staged(self, skip: Any = ()) -> "Frame":
        """This frame with its CUDA tensors copied to host memory, but those at the indices in
        ``skip`` (they go by descriptor). One copy, cached: publish stages once for all the
        peers that need it."""
        key = ("staged", *sorted(skip))
        out = self.layout.get(key)
        if out is None:
            cuda = [i for i, b in enumerate(self.buffers) if type(b) is torch.Tensor and b.is_cuda and i not in skip]
            if not cuda:
                return self
            buffers = [_tensor_bytes(b.cpu()) if i in cuda else b for i, b in enumerate(self.buffers)]
            out = self.layout[key] = Frame(self.kind, self.head, buffers, self.sizes)
        return out

    def write_into(self, out: memoryview) -> None:
        """The contiguous layout into ``out`` (exactly ``self.size`` writable bytes), padding
        zeroed: ``out`` may be fresh heap memory, which must not reach the wire."""
        end = 4 + len(self.header)
        _U32.pack_into(out, 0, len(self.header))
        out[4:end] = self.header
        for off, buf, n in zip(self._offsets, self.buffers, self.sizes):
            out[end:off] = ZERO_PAD[:off - end]
            if n:
                out[off:off + n] = memoryview(buf).cast("B")
            end = off + n

    def parts(self) -> list[memoryview]:
        """The contiguous layout as views to gather (``sendmsg``), in order: the buffers are
        not copied, so they must not change until the views are sent."""
        end = 4 + len(self.header)
        prefix = bytearray(self._offsets[0] if self.sizes else end)  # length, header, padding
        _U32.pack_into(prefix, 0, len(self.header))
        prefix[4:end] = self.header
        out = [memoryview(prefix)]
        pos = len(prefix)
        for off, buf, n in zip(self._offsets, self.buffers, self.sizes):
            if off > pos:
                out.append(memoryview(ZERO_PAD)[:off - pos])
            if n:
                out.append(memoryview(buf).cast("B"))
            pos = off + n
        return out

    def to_bytes(self) -> Any:
        """The contiguous layout in one new buffer (bytearray, numpy uint8 when large)."""
        out = empty_buffer(self.size)
        self.write_into(memoryview(out))
        return out
