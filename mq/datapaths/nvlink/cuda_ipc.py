"""The cuda_ipc data path: CUDA tensors between processes on one host, device to device.

The twin of :mod:`mq.datapaths.shm.pool` for GPU memory (docs/guides/gpu.md describes it). Each node owns one
:class:`DevicePool` per GPU it sends from: one allocation made with the driver API
(``cuMemAlloc``, never torch's caching allocator, whose blocks may not be exported safely), made
lazily at the first GPU send to a same-host peer, plus a ring of interprocess events made once.
A peer opens the pool once (``cuIpcOpenMemHandle``) and caches it; after that a buffer costs a
descriptor::

    sender:   pool.place(tensor, holders)   -> copy stream waits on the caller's stream, copies
                                               into a 256-byte aligned slot, records ring event k;
                                               the caller's stream waits on that event (a later
                                               in-place write cannot overtake the copy)
              descriptor ["cuda", pool, slot, offset, nbytes, k] travels in the frame header
    receiver: reader.view(descriptor)       -> zero-copy tensor over the slot; the consuming
                                               stream waits on event k on the GPU (no host sync)
              last reference dropped        -> an event recorded on the dropping thread's stream;
                                               the release thread waits for it, then sends RELEASE
    sender:   pool.release(peer, slot)      -> the slot is free again (once every holder released)

The pool's bound is the backpressure bound: :meth:`DevicePool.place` waits, then raises
:class:`~mq.errors.Timeout` naming the peers that hold slots.

Hostile input: a peer's pool description (:func:`check_pool_info`) and every descriptor
(:meth:`PeerPools.view`) are checked on the host before any CUDA call, since a bad address
would fault this process's CUDA context: exact int types, a pool this peer offered on this
link, offset aligned and in bounds, an event index in the ring, the owner pid equal to the
peer's (a handle is a capability: never open one naming a third process), a GPU UUID the peer
announced. Failures are :class:`~mq.errors.ProtocolError` (dropped and counted).

Only this module touches the CUDA driver; it loads ``libcuda.so.1`` on first use, so CPU-only
machines never need it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import reprlib
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from cffi import FFI

from mq.datapaths.base import Slot, SlotPool, SlotTable
from mq.errors import ConfigError, ProtocolError
from mq.options import check_int

log = logging.getLogger("mq.datapaths.nvlink.cuda_ipc")

TAG = "cuda"  # first item of a CUDA descriptor (shm descriptors are plain int lists)
ALIGN = 256  # slot alignment: any dtype's view of a slot is aligned
EVENTS = 16  # interprocess events per pool, recorded round robin
HANDLE_BYTES = 64  # CUipcMemHandle and cudaIpcEventHandle_t
MAX_POOL_BYTES = 1 << 42
_MAX_INT = 1 << 63
#: Default pool bound per GPU: min(4 GiB, a sixteenth of the GPU's memory).
DEFAULT_POOL_BYTES = 4 << 30
#: GPU tensors smaller than this are staged through host memory instead. Measured on an H200
#: (mq bench --device cuda, nng one way, p50): by descriptor 0.42 ms at 1.25 KB and 20 KB, 0.42
#: ms at 1.25 MB; staged (raw pynng, device to host to device) 0.17 ms at 1.25 KB, 0.22 ms at
#: 20 KB, 1.9 ms at 1.25 MB: a descriptor, its event and its RELEASE cost more than a small copy.
DEFAULT_INLINE_MAX = 64 << 10

_CDEF = """
typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef struct { char reserved[64]; } CUipcMemHandle;
CUresult cuInit(unsigned int flags);
CUresult cuDeviceGet(CUdevice *device, int ordinal);
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult cuCtxPushCurrent_v2(CUcontext ctx);
CUresult cuCtxPopCurrent_v2(CUcontext *pctx);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr);
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int flags);
CUresult cuIpcCloseMemHandle(CUdeviceptr dptr);
CUresult cuGetErrorString(CUresult error, const char **pStr);
"""
_LAZY_ENABLE_PEER_ACCESS = 1


class CudaError(RuntimeError):
    """A CUDA driver call failed (the message names the call and the driver's text)."""


@functools.cache
def _driver() -> tuple[FFI, Any]:
    ffi = FFI()
    ffi.cdef(_CDEF)
    lib = ffi.dlopen("libcuda.so.1")
    _check(ffi, lib, lib.cuInit(0), "cuInit")
    return ffi, lib


def _check(ffi: FFI, lib: Any, rc: int, what: str) -> None:
    if rc != 0:
        text = ffi.new("const char **")
        lib.cuGetErrorString(rc, text)
        msg = ffi.string(text[0]).decode() if text[0] != ffi.NULL else "unknown error"
        raise CudaError(f"{what} failed: CUDA error {rc} ({msg})")


def available() -> str | None:
    """Why this process cannot use the cuda_ipc path, or None when it can (a GPU, torch with
    CUDA, the driver library). Loads nothing when torch was never imported with CUDA."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to this process"
    try:
        _driver()
    except (OSError, CudaError) as exc:
        return f"the CUDA driver library cannot be used ({exc})"
    return None


class _Context:
    """The primary context of one device (torch's own), current around each driver call."""

    def __init__(self, device: int):
        import torch

        torch.cuda.init()
        with torch.cuda.device(device):
            torch.cuda.current_stream()  # makes torch create the primary context
        self.ffi, self.lib = _driver()
        dev = self.ffi.new("CUdevice *")
        self.check(self.lib.cuDeviceGet(dev, device), "cuDeviceGet")
        ctx = self.ffi.new("CUcontext *")
        self.check(self.lib.cuDevicePrimaryCtxRetain(ctx, dev[0]), "cuDevicePrimaryCtxRetain")
        self.ctx = ctx[0]
        self._lock = threading.RLock()  # reentrant: see PeerPools._lock

    def check(self, rc: int, what: str) -> None:
        _check(self.ffi, self.lib, rc, what)

    def call(self, fn: Callable[[], int], what: str) -> None:
        with self._lock:
            self.check(self.lib.cuCtxPushCurrent_v2(self.ctx), "cuCtxPushCurrent")
            try:
                self.check(fn(), what)
            finally:
                self.lib.cuCtxPopCurrent_v2(self.ffi.new("CUcontext *"))


@functools.cache
def _context(device: int) -> _Context:
    return _Context(device)


class _Memory:
    """``nbytes`` of device memory at ``ptr`` as torch sees it (``__cuda_array_interface__``).
    torch keeps this object alive as long as any tensor over it: its finalizer is the "last
    reference dropped" hook of a received view."""

    __slots__ = ("__cuda_array_interface__", "__weakref__")

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 2}


def _as_tensor(ptr: int, nbytes: int, device: int) -> Any:
    import torch

    return torch.as_tensor(_Memory(ptr, nbytes), device=f"cuda:{device}")


def _uuid_text(value: Any) -> str:
    """A GPU UUID as NVML writes it (``GPU-xxxxxxxx-...``), from torch's or NVML's form."""
    text = str(value)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def same_uuid(a: Any, b: Any) -> bool:
    """Whether two GPU UUIDs name one device, whatever their spelling (NVML's ``GPU-`` prefix
    and hyphens, torch's bare form, case)."""
    def norm(x: Any) -> str:
        return str(x).lower().removeprefix("gpu-").replace("-", "")
    return type(a) is str and type(b) is str and norm(a) == norm(b) != ""


def device_uuid(device: int) -> str:
    import torch

    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return _uuid_text(uuid) if uuid is not None else f"torch-cuda:{device}"


def _device_of(uuid: str) -> int | None:
    """The logical index of the GPU with ``uuid`` in this process, or None."""
    import torch

    for i in range(torch.cuda.device_count()):
        if same_uuid(device_uuid(i), uuid):
            return i
    return None


def default_pool_bytes(device: int) -> int:
    import torch

    return min(DEFAULT_POOL_BYTES, torch.cuda.get_device_properties(device).total_memory // 16)


def check_pool_bytes(value: Any) -> None:
    check_int(value, "cuda_pool_bytes", minimum=ALIGN, unit="bytes")


def _round(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


# ---------------------------------------------------------------------- the sender side
class DevicePool(SlotPool):
    """This node's pool on GPU ``device`` (the sender side of the cuda_ipc path).

    Thread-safe. ``place`` never synchronizes the host with the GPU.
    """

    handle_name = "this CUDA buffer"

    _ids = itertools.count(1)

    def __init__(self, device: int, max_bytes: int | None = None, incarnation: str = "", waits: Any = None):
        import torch

        self.device = device
        self.max_bytes = _round(max_bytes if max_bytes is not None else default_pool_bytes(device))
        check_pool_bytes(self.max_bytes)
        self.pool_id = next(self._ids)
        self.incarnation = incarnation
        self.uuid = device_uuid(device)
        self._ctx = _context(device)
        ffi, lib = self._ctx.ffi, self._ctx.lib
        ptr = ffi.new("CUdeviceptr *")
        self._ctx.call(lambda: lib.cuMemAlloc_v2(ptr, self.max_bytes), f"cuMemAlloc({self.max_bytes})")
        self.base = int(ptr[0])
        handle = ffi.new("CUipcMemHandle *")
        try:
            self._ctx.call(lambda: lib.cuIpcGetMemHandle(handle, self.base), "cuIpcGetMemHandle")
        except CudaError:
            self._free()
            raise
        self.handle = bytes(ffi.buffer(handle, HANDLE_BYTES))
        self.memory = _as_tensor(self.base, self.max_bytes, device)  # uint8 over the whole pool
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device)
            self.events = [torch.cuda.Event(interprocess=True) for _ in range(EVENTS)]
            for ev in self.events:  # an event must be recorded once before its handle is taken
                ev.record(self.stream)
            self.event_handles = [bytes(ev.ipc_handle()) for ev in self.events]
        self._next_event = itertools.cycle(range(EVENTS))
        self.stats = {"placed": 0, "by_handle": 0, "copied_bytes": 0, "waits": 0, "stale_releases": 0}
        # Slots first fit in the one allocation, holders per peer: the table every data path shares.
        self._slots = SlotTable(self.max_bytes, ALIGN, stats=self.stats, waits=waits)
        self._cond = self._slots.cond
        self._closed = False

    def info(self) -> dict[str, Any]:
        """What a peer needs to open this pool (checked there by :func:`check_pool_info`)."""
        return {"pool": self.pool_id, "uuid": self.uuid, "size": self.max_bytes, "handle": self.handle,
                "events": list(self.event_handles), "pid": os.getpid(), "incarnation": self.incarnation}

    def fits(self, nbytes: int) -> bool:
        return 0 < nbytes and _round(nbytes) <= self.max_bytes

    # ------------------------------------------------------------------ sending
    def place(self, tensor: Any, holders: list[int], timeout: float) -> list[Any]:
        """Put CUDA ``tensor`` (on this pool's device) in a slot for ``holders`` and return its
        descriptor. No copy when it lies in the pool already (:meth:`alloc`).

        Raises:
            Timeout: the pool stayed full (slots held by receivers) for ``timeout`` seconds.
        """
        import torch

        nbytes = tensor.numel() * tensor.element_size()
        ptr = tensor.data_ptr()
        caller = torch.cuda.current_stream(self.device)
        with self._cond:
            slot = self._slots.owner(ptr - self.base, nbytes) if self.base <= ptr < self.base + self.max_bytes else None
            if slot is not None:  # by handle: ready once the caller's queued writes are done
                self._slots.hold(slot, holders)
                k = next(self._next_event)
                # Recorded on the copy stream like every ring event, so a reused event index
                # never orders less than it did: the stream runs its records in order.
                self.stream.wait_stream(caller)
                self.events[k].record(self.stream)
                self.stats["by_handle"] += 1
                return [TAG, self.pool_id, slot.slot_id, ptr - self.base, nbytes, k]
        slot = self._take(nbytes, timeout, holders)  # (waits without the lock: releases need it)
        with self._cond:
            k = next(self._next_event)
            # Issued under the lock: the event ring is recorded in the order slots are handed out.
            dst = self.memory[slot.offset:slot.offset + nbytes]
            self.stream.wait_stream(caller)
            with torch.cuda.stream(self.stream):
                if tensor.dim():
                    dst.view(tensor.dtype).view(tensor.shape).copy_(tensor, non_blocking=True)
                else:
                    dst.view(tensor.dtype)[0].copy_(tensor, non_blocking=True)
                self.events[k].record(self.stream)
            caller.wait_event(self.events[k])
            tensor.record_stream(self.stream)  # the allocator must not recycle it under the copy
        self.stats["placed"] += 1
        self.stats["copied_bytes"] += nbytes
        return [TAG, self.pool_id, slot.slot_id, slot.offset, nbytes, k]

    def _take(self, nbytes: int, timeout: float, holders: list[int] | None = None) -> Slot:
        """A slot of ``nbytes`` held for ``holders`` (pinned for alloc() when None), waiting
        for releases while those peers live."""
        if not self.fits(nbytes):
            raise ConfigError(f"a {nbytes}-byte tensor does not fit the CUDA pool of "
                              f"{self.max_bytes} bytes: raise cuda_pool_bytes")

        def claim() -> Slot | None:
            slot = self._fit(nbytes)
            if slot is not None:
                if holders is None:
                    slot.pinned = True
                else:
                    self._slots.hold(slot, holders)
            return slot

        return self._slots.wait_for(claim, timeout, lambda: self._full(timeout), holders or ())

    def _fit(self, nbytes: int) -> Slot | None:
        if self._closed:
            raise ConfigError("the CUDA pool is closed (the queue stopped)")
        return self._slots.take(nbytes)

    def _full(self, timeout: float) -> str:
        held = self._slots.held_by()
        who = ", ".join(f"node {p}: {n >> 20} MiB" for p, n in sorted(held.items())) or "alloc() buffers"
        return (f"the CUDA pool on cuda:{self.device} stayed full for {timeout:g}s "
                f"({self.max_bytes >> 20} MiB; held by {who}): receivers must drop or "
                "copy the tensors they keep, or raise cuda_pool_bytes / pass timeout=")

    # ------------------------------------------------------------------ releasing
    def release(self, peer: int, slot_id: Any, count: Any = 1) -> bool:
        """``peer`` dropped ``count`` views of slot ``slot_id``; False (counted) when stale or forged."""
        return self._slots.release(peer, slot_id, count)

    def held_bytes(self) -> int:
        with self._cond:
            return self._slots.held_bytes()

    # ------------------------------------------------------------------ by handle
    def alloc(self, shape: Any, dtype: Any, timeout: float = 0.0) -> Any:
        """A tensor of ``shape`` and torch ``dtype`` in this pool: sending it to a same-host GPU
        peer costs a descriptor. Its slot returns to the pool when the tensor is garbage and
        no receiver holds it."""
        import torch

        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if not all(type(d) is int and d >= 0 for d in shape):
            raise ConfigError(f"shape must be ints >= 0, got {shape!r}")
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"a CUDA buffer needs a torch dtype (e.g. torch.float32), got {dtype!r}")
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype, device=f"cuda:{self.device}")
        slot = self._take(nbytes, timeout)
        # Its own storage object (not a slice of self.memory), so its lifetime is the user's
        # tensor's: when the last view of it is garbage, the slot is unpinned.
        memory = _Memory(self.base + slot.offset, nbytes)
        weakref.finalize(memory, self._slots.unpin, slot)
        return torch.as_tensor(memory, device=f"cuda:{self.device}").view(dtype).view(shape)

    def _slot_of(self, tensor: Any) -> Slot:
        slot = self._slots.owner(tensor.data_ptr() - self.base, tensor.numel() * tensor.element_size())
        if slot is None:
            raise ConfigError("this tensor was not allocated with q.alloc(..., device='cuda:N'): "
                              "only pool buffers are sent by handle")
        return slot

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop placing. The memory itself lives as long as the process: peers may still read
        slots they hold, and freeing exported memory under an importer is undefined."""
        with self._cond:
            self._closed = True
        self._slots.waits.wake(self._slots)

    def _free(self) -> None:
        self._ctx.call(lambda: self._ctx.lib.cuMemFree_v2(self.base), "cuMemFree")


# ---------------------------------------------------------------------- the receiver side
def _exact_int(value: Any, lo: int = 0, hi: int = _MAX_INT) -> bool:
    return type(value) is int and lo <= value < hi


def check_pool_info(info: Any, peer: int, peer_pid: Any, peer_uuids: Any) -> None:
    """A peer's pool description, checked on the host before any CUDA call.

    Raises:
        ProtocolError: what is wrong with it.
    """
    if type(info) is not dict:
        raise ProtocolError(f"node {peer}: a CUDA pool description must be a map")
    want = {"pool", "uuid", "size", "handle", "events", "pid", "incarnation"}
    if set(info) != want:
        raise ProtocolError(f"node {peer}: a CUDA pool description has exactly {sorted(want)}, "
                            f"got {sorted(map(str, info))}")
    if not _exact_int(info["pool"], 1):
        raise ProtocolError(f"node {peer}: bad CUDA pool id {reprlib.repr(info['pool'])}")
    if not _exact_int(info["size"], ALIGN, MAX_POOL_BYTES + 1) or info["size"] % ALIGN:
        raise ProtocolError(f"node {peer}: bad CUDA pool size {reprlib.repr(info['size'])}")
    if type(info["handle"]) is not bytes or len(info["handle"]) != HANDLE_BYTES:
        raise ProtocolError(f"node {peer}: a CUDA memory handle has {HANDLE_BYTES} bytes")
    events = info["events"]
    if type(events) is not list or not 0 < len(events) <= 64 or not all(
            type(e) is bytes and len(e) == HANDLE_BYTES for e in events):
        raise ProtocolError(f"node {peer}: CUDA event handles must be 1-64 blobs of {HANDLE_BYTES} bytes")
    if not _exact_int(info["pid"], 1, 1 << 31) or info["pid"] != peer_pid:
        # A handle is a capability: never open one that names a process other than the peer.
        raise ProtocolError(f"node {peer}: the CUDA pool's owner pid {reprlib.repr(info['pid'])} is not "
                            f"the peer's ({peer_pid})")
    if type(info["uuid"]) is not str or not any(same_uuid(info["uuid"], u) for u in peer_uuids):
        raise ProtocolError(f"node {peer}: the CUDA pool's GPU {reprlib.repr(info['uuid'])} is not one "
                            "the peer announced")
    if type(info["incarnation"]) is not str:
        raise ProtocolError(f"node {peer}: bad CUDA pool incarnation")


@dataclass
class _Opened:
    """One peer pool opened here."""

    info: dict[str, Any]
    device: int  # where it is mapped here
    base: int
    events: list[Any]
    local: bool  # the same physical GPU as ours: views are zero-copy
    live: int = 0
    orphan: bool = False


class PeerPools:
    """The pools of one peer, opened here (the receiver side).

    Args:
        peer: the peer's node id.
        peer_pid, peer_uuids: from its authenticated HELLO (locality).
        on_release: ``on_release(pool_id, slot_id, event)`` when the last reference to a view
            is gone (``event`` is recorded on the dropping thread's stream: wait for it before
            telling the sender). Runs from garbage collection in any thread: must not block.
    """

    def __init__(self, peer: int, peer_pid: Any, peer_uuids: Any,
                 on_release: Callable[[int, int, Any], None]):
        self.peer = peer
        self.peer_pid = peer_pid
        self.peer_uuids = frozenset(peer_uuids)
        self._on_release = on_release
        self._pools: dict[int, _Opened] = {}
        # Reentrant: a view's finalizer takes it, and the cyclic GC may run that finalizer on
        # any allocation, inside a section that already holds it.
        self._lock = threading.RLock()
        self._closed = False
        self.refused = 0
        self.opens = 0
        self.open_seconds = 0.0

    def open(self, info: Any) -> None:
        """Open the peer's pool described by ``info`` (idempotent for the same description).

        Raises:
            ProtocolError: the description is refused (nothing was opened).
            CudaError: the driver could not open it (the route falls back to staging).
        """
        try:
            check_pool_info(info, self.peer, self.peer_pid, self.peer_uuids)
        except ProtocolError:
            self.refused += 1
            raise
        with self._lock:
            known = self._pools.get(info["pool"])
            if known is not None:
                if known.info != info:
                    self.refused += 1
                    raise ProtocolError(f"node {self.peer} described CUDA pool {info['pool']} twice, "
                                        "differently")
                return
            self._pools[info["pool"]] = self._open(info)

    def _open(self, info: dict[str, Any]) -> _Opened:
        import torch

        here = _device_of(info["uuid"])
        device = here if here is not None else torch.cuda.current_device()
        ctx = _context(device)
        ffi, lib = ctx.ffi, ctx.lib
        handle = ffi.new("CUipcMemHandle *")
        ffi.memmove(handle, info["handle"], HANDLE_BYTES)
        ptr = ffi.new("CUdeviceptr *")
        t0 = time.perf_counter()
        ctx.call(lambda: lib.cuIpcOpenMemHandle_v2(ptr, handle[0], _LAZY_ENABLE_PEER_ACCESS),
                 f"cuIpcOpenMemHandle (node {self.peer}'s pool on {info['uuid']})")
        try:
            events = [torch.cuda.Event.from_ipc_handle(device, h) for h in info["events"]]
        except Exception:
            ctx.call(lambda: lib.cuIpcCloseMemHandle(ptr[0]), "cuIpcCloseMemHandle")
            raise
        self.opens += 1
        self.open_seconds += time.perf_counter() - t0
        return _Opened(info, device, int(ptr[0]), events, local=here is not None)

    def view(self, desc: Any) -> Any:
        """A CUDA tensor (uint8, flat) for descriptor ``["cuda", pool, slot, offset, nbytes,
        event]``, ready on this thread's current stream.

        Raises:
            ProtocolError: malformed, an unknown pool, out of bounds (counted in ``refused``).
        """
        try:
            return self._view(desc)
        except ProtocolError:
            self.refused += 1
            raise

    def check(self, desc: Any) -> tuple[_Opened, int, int, int, int]:
        """The host-side checks of a descriptor, no CUDA call: ``(opened pool, slot, offset,
        nbytes, event index)`` of a descriptor that lies inside a pool this peer offered.

        Raises:
            ProtocolError: what is wrong with it.
        """
        if not (type(desc) is list and len(desc) == 6 and desc[0] == TAG
                and all(_exact_int(x) for x in desc[1:])):
            raise ProtocolError(f"malformed CUDA descriptor {reprlib.repr(desc)}")
        _tag, pool_id, slot_id, offset, nbytes, k = desc
        with self._lock:
            if self._closed:
                raise ProtocolError(f"node {self.peer}'s CUDA pools are closed here")
            opened = self._pools.get(pool_id)
        if opened is None:
            raise ProtocolError(f"a CUDA descriptor names pool {pool_id}, which node {self.peer} "
                                "never offered on this link")
        size = opened.info["size"]
        if offset % ALIGN or not 0 < nbytes <= size - offset or k >= len(opened.events):
            raise ProtocolError(f"CUDA descriptor {offset}+{nbytes} (event {k}) is outside node "
                                f"{self.peer}'s pool of {size} bytes")
        return opened, slot_id, offset, nbytes, k

    def _view(self, desc: Any) -> Any:
        import torch

        with self._lock:  # checked and counted at once: close() cannot slip in between
            opened, slot_id, offset, nbytes, k = self.check(desc)
            opened.live += 1
        pool_id = desc[1]
        memory = _Memory(opened.base + offset, nbytes)
        weakref.finalize(memory, self._released, opened, pool_id, slot_id)
        view = torch.as_tensor(memory, device=f"cuda:{opened.device}")
        torch.cuda.current_stream(opened.device).wait_event(opened.events[k])
        del memory
        if not opened.local:
            # Another GPU: one copy over NVLink into memory of ours, then the slot goes back.
            view = view.clone()
        return view

    def _released(self, opened: _Opened, pool_id: int, slot_id: int) -> None:
        try:
            import torch

            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(opened.device))
        except Exception:  # interpreter shutdown: nobody is left to tell
            return
        with self._lock:
            opened.live -= 1
            close = opened.orphan and opened.live == 0
        if close:
            self._close(opened)
        self._on_release(pool_id, slot_id, done)

    def live_views(self) -> int:
        with self._lock:
            return sum(o.live for o in self._pools.values())

    def close(self) -> None:
        """The peer is gone: close what no view references (the rest when its views go)."""
        with self._lock:
            self._closed = True
            pools, self._pools = list(self._pools.values()), {}
            for opened in pools:
                opened.orphan = True
            idle = [o for o in pools if o.live == 0]
        for opened in idle:
            self._close(opened)

    def _close(self, opened: _Opened) -> None:
        try:
            ctx = _context(opened.device)
            ctx.call(lambda: ctx.lib.cuIpcCloseMemHandle(opened.base), "cuIpcCloseMemHandle")
        except Exception as exc:
            log.debug("closing node %d's CUDA pool: %s", self.peer, exc)


# ---------------------------------------------------------------------- probe (doctor, gpu-check)
def probe_two_process(device: int = 0, nbytes: int = 2 << 20, timeout: float = 60.0) -> dict[str, Any]:
    """Open a pool of this process in a second process: the real test of CUDA IPC here.
    Returns ``{"ok", "error", "first_open_ms", "cached_open_ms", "event_wait_ms"}``."""
    import json
    import subprocess
    import sys

    out: dict[str, Any] = {"ok": False, "error": None, "first_open_ms": None, "cached_open_ms": None,
                           "event_wait_ms": None}
    why = available()
    if why:
        out["error"] = why
        return out
    try:
        pool = DevicePool(device, max(nbytes, ALIGN), incarnation="probe")
        info = pool.info()
        enc = {k: (v.hex() if isinstance(v, bytes) else [e.hex() for e in v] if k == "events" else v)
               for k, v in info.items()}
        proc = subprocess.run([sys.executable, "-m", "mq.datapaths.nvlink.cuda_ipc", "--probe-child", json.dumps(enc)],
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            out["error"] = (proc.stderr.strip().splitlines() or ["child failed"])[-1]
            return out
        out.update(json.loads(proc.stdout.strip().splitlines()[-1]))
        out["ok"] = out.get("error") is None
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def _probe_child(encoded: str) -> None:
    import json

    import torch

    raw = json.loads(encoded)
    info = {k: (bytes.fromhex(v) if k == "handle" else [bytes.fromhex(e) for e in v] if k == "events" else v)
            for k, v in raw.items()}
    pools = PeerPools(0, info["pid"], [info["uuid"]], lambda *a: None)
    t0 = time.perf_counter()
    pools.open(info)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    pools.open(info)
    cached = time.perf_counter() - t0
    t0 = time.perf_counter()
    view = pools.view([TAG, info["pool"], 1, 0, ALIGN, 0])
    torch.cuda.current_stream(view.device).synchronize()
    waited = time.perf_counter() - t0
    print(json.dumps({"first_open_ms": first * 1e3, "cached_open_ms": cached * 1e3,
                      "event_wait_ms": waited * 1e3, "error": None}))


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "--probe-child":
        _probe_child(sys.argv[2])
    else:
        import json

        print(json.dumps(probe_two_process(), indent=2))
