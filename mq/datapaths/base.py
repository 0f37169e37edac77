"""Data paths: how one large buffer of a frame reaches one peer beside the frame.

A frame carries a small buffer inline; a large one travels by a *data path*, and the frame
carries only its descriptor. Each path is one module plus one line in :data:`PATHS`, named by
the route that takes it (tensorpipe's channels are the model)::

    route   data path (mq.datapaths.)  memory (mq.datapaths.)                         buffers
    shm     shm.path.ShmPath           shm.pool (memfd segments)                      CPU, same host
    nvlink  nvlink.path.GpuPath        nvlink.cuda_ipc (one cuMemAlloc per GPU)       CUDA, same host
    rdma    rdma.path.RdmaPath         rdma.engine (NIXL/UCX, registered segments)    CPU, other hosts

Every path does the same few things (:class:`DataPath`): it **offers** this node's memory to a
peer and **accepts** a peer's offer (opens its memory here, as a *reader*); it **places** a
buffer in a slot held for the peers that get it and **describes** it (the descriptor in the
frame); a peer's reader **views** a descriptor (zero copy) and **refuses** a hostile one before
touching anything (:class:`~mq.errors.ProtocolError`, counted); the last dropped view **releases**
the slot through one :class:`ReleaseQueue` (batched RELEASE frames); the path **accounts
holders** per peer in one :class:`SlotTable`, so a full pool is backpressure (``place`` waits,
then :class:`~mq.errors.Timeout` naming the holders) and ``wait_released`` guards rewrites of a
buffer sent by handle.

Descriptors and release items: a path's are lists whose first item is its ``tag`` (a str);
shm's, the first path, are plain int lists (``tag`` None), unchanged on the wire.

Data-path modules never import each other: what they share is here.
"""

from __future__ import annotations

import itertools
import mmap
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol, TypeVar, cast

import numpy as np
from cffi import FFI

from mq.backend import import_ref
from mq.errors import ConfigError
from mq.node.waits import Mailbox, Waits

T = TypeVar("T")

#: Route name -> ``"module:Class"`` of its data path. A new path is a module and a line here
#: (or :func:`register` from outside mq).
PATHS: dict[str, str] = {"shm": "mq.datapaths.shm.path:ShmPath", "nvlink": "mq.datapaths.nvlink.path:GpuPath",
                         "rdma": "mq.datapaths.rdma.path:RdmaPath"}

ANY_GEN = object()  # SlotTable.release without a generation check (the slot id is the generation)


def register(route: str, factory: str | Callable[..., "DataPath"]) -> None:
    """Make ``factory`` (a :class:`DataPath` class, or ``"module:Class"``) the data path of
    ``route``; nodes made afterwards use it."""
    PATHS[route] = factory  # type: ignore[assignment]


def path_class(route: str) -> Any:
    """The data path class registered for ``route``."""
    factory: Any = PATHS[route]
    return import_ref(factory) if isinstance(factory, str) else factory


_ffi = FFI()


def size_class(nbytes: int) -> int:
    """Round a request up to a size class (at most 12.5% slack, whole pages) so a buffer made
    for it is reusable by the next request of about its size (shm segments, rdma segments,
    warm link slabs)."""
    step = max(mmap.PAGESIZE, 1 << max(0, nbytes.bit_length() - 4))
    return (nbytes + step - 1) // step * step


def view_until_garbage(addr: int, nbytes: int, on_garbage: Callable[[], None]) -> memoryview:
    """A writable view of the ``nbytes`` at ``addr``; ``on_garbage()`` runs, in whichever thread
    drops the last reference, once it and every view made of it are garbage. The memory must
    stay mapped until then (``on_garbage``'s closure may hold what maps it)."""
    ptr = _ffi.gc(_ffi.cast("char *", addr), lambda _p: on_garbage())
    return memoryview(_ffi.buffer(ptr, nbytes))


def address_of(buf: Any) -> tuple[int, int]:
    """(address, nbytes) of a C-contiguous buffer (numpy array, bytes, memoryview, tensor)."""
    if isinstance(buf, np.ndarray):
        return buf.__array_interface__["data"][0], buf.nbytes
    if hasattr(buf, "data_ptr"):  # torch tensor
        return buf.data_ptr(), buf.numel() * buf.element_size()
    mv = memoryview(buf)
    return int(_ffi.cast("uintptr_t", _ffi.from_buffer(mv))), mv.nbytes


def on_cpu(buf: Any) -> bool:
    """Whether a frame's buffer lies in host memory (numpy, bytes, a CPU tensor)."""
    device = getattr(buf, "device", None)
    return device is None or getattr(device, "type", "cpu") == "cpu"


def as_uint8(buf: Any) -> np.ndarray:
    """A flat uint8 numpy view of a host buffer (numpy array, CPU tensor, bytes-like): no copy."""
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    if hasattr(buf, "data_ptr"):  # a CPU torch tensor
        return buf.reshape(-1).view(__import__("torch").uint8).numpy()
    return np.frombuffer(buf, np.uint8)


def tag_of(desc: Any) -> str | None:
    """The tag of a descriptor or release item: its first item when that is a str, else None
    (shm's untagged int lists)."""
    head = desc[0] if type(desc) is list and desc else None
    return head if type(head) is str else None


def cuda_buffers(buffers: list[Any], sizes: list[int], at_least: int = 1) -> list[int]:
    """Indices of the CUDA tensors of at least ``at_least`` bytes among a frame's buffers."""
    return [i for i, b in enumerate(buffers) if sizes[i] >= at_least and getattr(b, "is_cuda", False)]


# ---------------------------------------------------------------------- slots and holders
@dataclass(eq=False)
class Slot:
    """One buffer's room in a pool, with the views each peer may still hold of it."""

    slot_id: int
    size: int
    offset: int = 0  # in the pool's one region (ranged tables); 0 where a slot is its own segment
    gen: int = 0  # bumped when the slot is reused (shm); a ranged slot's id is its generation
    holders: dict[int, int] = field(default_factory=dict)  # peer -> views it may still hold
    pinned: bool = False  # the user's (alloc): never reused while referenced

    @property
    def free(self) -> bool:
        return not self.holders and not self.pinned


class SlotTable:
    """The slots of one pool and their holders per peer: every data path's bookkeeping, no
    device, so its rules run on any machine.

    Two shapes: with ``size``, :meth:`take` places slots first fit in one region of ``size``
    bytes (``align``-aligned; a freed slot's range coalesces with its neighbours), as a CUDA
    pool or a registered RDMA region is; without, the pool adds its own slots (:meth:`add`,
    shm's segments) and reuses them.

    ``cond`` is the pool's lock: release and peer_gone take it, then wake whoever waits ``on``
    the table (through the node's :class:`mq.node.waits.Waits`) for room (:meth:`wait_for`) or for a
    buffer to come back (:meth:`wait_released`). ``on_released(slot)`` runs (lock held) when a
    slot's last holder released it. ``stats`` (the pool's dict) counts ``stale_releases`` and
    ``waits``.
    """

    def __init__(self, size: int | None = None, align: int = 256,
                 on_released: Callable[[Slot], None] | None = None, stats: dict[str, int] | None = None,
                 waits: Waits | None = None):
        self.size = size
        self.align = align
        self.free: list[tuple[int, int]] = [(0, size)] if size is not None else []  # (offset, length)
        self.slots: dict[int, Slot] = {}
        self.cond = threading.RLock()
        self.waits = waits or Waits()
        self.stats = stats if stats is not None else {}
        self.stats.setdefault("stale_releases", 0)
        self.stats.setdefault("waits", 0)
        self._on_released = on_released
        self._ids = itertools.count(1)

    def next_id(self) -> int:
        return next(self._ids)

    # ------------------------------------------------------------------ placing
    def rounded(self, nbytes: int) -> int:
        return (max(nbytes, 1) + self.align - 1) // self.align * self.align

    def take(self, nbytes: int) -> Slot | None:
        """A new slot of ``nbytes`` (rounded up) in the region, first fit; None when full."""
        need = self.rounded(nbytes)
        for i, (off, length) in enumerate(self.free):
            if length >= need:
                if length == need:
                    del self.free[i]
                else:
                    self.free[i] = (off + need, length - need)
                return self.add(Slot(self.next_id(), need, off))
        return None

    def add(self, slot: Slot) -> Any:
        self.slots[slot.slot_id] = slot
        return slot

    def remove(self, slot: Slot) -> None:
        del self.slots[slot.slot_id]

    def hold(self, slot: Slot, peers: list[int]) -> None:
        for peer in peers:
            slot.holders[peer] = slot.holders.get(peer, 0) + 1

    def wait_for(self, get: Callable[[], T | None], timeout: float, full: Callable[[], str],
                 peers: Iterable[Any] = ()) -> T:
        """``get()`` (called with ``cond`` held) until it gives something, waiting up to
        ``timeout`` for releases (the backpressure bound). Called without ``cond`` held.

        Raises:
            Timeout: with ``full()`` as its message.
            PeerLost: one of ``peers`` (the ones the slot is for) was lost meanwhile.
        """
        def got() -> T | None:
            with self.cond:
                return get()

        found = got()
        if found is not None:
            return found
        self.stats["waits"] += 1
        # until() returns what got() returned once true: not None
        return cast(T, self.waits.until(got, time.monotonic() + timeout, on=(self,), peers=peers, what=full))

    # ------------------------------------------------------------------ releasing
    def release(self, peer: int, slot_id: Any, count: Any = 1, gen: Any = ANY_GEN) -> bool:
        """``peer`` dropped ``count`` views of slot ``slot_id`` (generation ``gen`` where the
        pool reuses slots). False (and counted) when that does not match what ``peer`` holds:
        stale or forged."""
        with self.cond:
            slot = self.slots.get(slot_id) if type(slot_id) is int else None
            held = slot.holders.get(peer, 0) if slot is not None else 0
            if (slot is None or (gen is not ANY_GEN and gen != slot.gen)
                    or type(count) is not int or not 0 < count <= held):
                self.stats["stale_releases"] += 1
                return False
            if held == count:
                del slot.holders[peer]
            else:
                slot.holders[peer] = held - count
            self._released(slot)
        self.waits.wake(self)
        return True

    def peer_gone(self, peer: int) -> None:
        """A peer left or died: whatever it held is free again."""
        with self.cond:
            for slot in list(self.slots.values()):
                if slot.holders.pop(peer, None) is not None:
                    self._released(slot)
        self.waits.wake(self)

    def unpin(self, slot: Slot) -> None:
        with self.cond:
            slot.pinned = False
            self._released(slot)
        self.waits.wake(self)

    def _released(self, slot: Slot) -> None:
        if slot.holders:
            return
        if self._on_released is not None:
            self._on_released(slot)
        if self.size is not None and not slot.pinned and slot.slot_id in self.slots:
            self.remove(slot)
            self._free_range(slot.offset, slot.size)

    def _free_range(self, offset: int, size: int) -> None:
        self.free.append((offset, size))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for off, length in self.free:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((off, length))
        self.free = merged

    # ------------------------------------------------------------------ accounting
    def held_by(self) -> dict[int, int]:
        """Bytes each peer holds."""
        out: dict[int, int] = {}
        for slot in self.slots.values():
            for peer in slot.holders:
                out[peer] = out.get(peer, 0) + slot.size
        return out

    def held_bytes(self) -> int:
        return sum(s.size for s in self.slots.values() if s.holders)

    def owner(self, offset: int, nbytes: int) -> Slot | None:
        """The pinned slot (alloc) of the region that holds ``nbytes`` at ``offset``."""
        for slot in self.slots.values():
            if slot.pinned and slot.offset <= offset and offset + nbytes <= slot.offset + slot.size:
                return slot
        return None

    def wait_released(self, slot_of: Callable[[], Slot | None], timeout: float, what: str) -> None:
        """Block until no peer holds the slot ``slot_of()`` names (a buffer sent by handle).

        Raises:
            Timeout: a peer still holds it after ``timeout`` seconds.
        """
        def free() -> bool:
            with self.cond:
                slot = slot_of()
                return slot is None or not slot.holders

        def held() -> str:
            slot = slot_of()
            return (f"nodes {sorted(slot.holders) if slot else []} still hold views of {what} after "
                    f"{timeout:g}s: they must drop (or copy) what they received")

        self.waits.until(free, time.monotonic() + timeout, on=(self,), what=held)


class SlotPool:
    """What a pool whose buffers may be sent by handle (``alloc``) answers from its
    :class:`SlotTable` (``_slots``): who still holds such a buffer, and the wait until nobody
    does. A pool says which slot a buffer is (``_slot_of``, ConfigError for one not from
    alloc()) and how to name it in a timeout (``handle_name``)."""

    _slots: SlotTable
    handle_name = "this buffer"

    def _slot_of(self, buf: Any) -> Slot:
        raise NotImplementedError

    def holders_of(self, buf: Any) -> int:
        """How many views of the pool buffer ``buf`` receivers may still hold."""
        with self._slots.cond:
            return sum(self._slot_of(buf).holders.values())

    def wait_released(self, buf: Any, timeout: float) -> None:
        """Block until no receiver holds a view of pool buffer ``buf``; then the sender may
        write it again.

        Raises:
            Timeout: a receiver still holds it after ``timeout`` seconds.
        """
        self._slots.wait_released(lambda: self._slot_of(buf), timeout, self.handle_name)

    def peer_gone(self, peer: int) -> None:
        """A peer left or died: whatever it held is free again."""
        self._slots.peer_gone(peer)


class SegmentPool:
    """The shape of a pool made of segments, each holding one buffer at a time (shm's memfds,
    the rdma path's registered regions): a buffer takes the smallest free segment of at most
    twice its size class, else a new segment while the pool stays within ``max_bytes``, free
    segments retiring (largest first) to make room; a full pool waits for releases through its
    :class:`SlotTable` while the peers holding them live, then times out saying what is held.

    A pool makes and drops its segments (``_new_segment``, ``_drop``, keeping ``_bytes``) and
    says what "full" means to its user (``_full``)."""

    max_bytes: int
    closed_text = "the pool is closed (the queue stopped)"
    _slots: SlotTable
    _bytes: int
    _closed: bool

    def _new_segment(self, capacity: int, populate: bool = False) -> Any:
        raise NotImplementedError

    def _drop(self, seg: Any) -> None:
        raise NotImplementedError

    def _full(self, timeout: float) -> str:
        raise NotImplementedError

    def _wait_for_segment(self, nbytes: int, cap: int, timeout: float, claim: Callable[[Any], None],
                          peers: Iterable[int], reuse: bool = True, populate: bool = False) -> Any:
        """A segment for ``nbytes`` (size class ``cap``), waiting (without the lock: releases
        need it) while ``peers`` live; ``claim(seg)`` runs under the lock as it is found, so
        nobody else takes it."""
        def fit() -> Any:
            seg = self._fit(nbytes, cap, reuse, populate)
            if seg is not None:
                claim(seg)
            return seg

        return self._slots.wait_for(fit, timeout, lambda: self._full(timeout), peers)

    def _fit(self, nbytes: int, cap: int, reuse: bool = True, populate: bool = False) -> Any:
        """A free segment that fits (with ``reuse`` off: always a fresh one), a new one, or None
        (lock held)."""
        if self._closed:
            raise ConfigError(self.closed_text)
        if reuse:
            fits = [s for s in self._slots.slots.values() if s.free and nbytes <= s.size <= 2 * cap]
            if fits:
                return min(fits, key=lambda s: s.size)
        if self._bytes + cap > self.max_bytes:
            self._retire_free(self._bytes + cap - self.max_bytes)
        return self._new_segment(cap, populate) if self._bytes + cap <= self.max_bytes else None

    def _retire_free(self, need: int) -> None:
        """Drop free segments (largest first) until ``need`` bytes are available."""
        for seg in sorted((s for s in self._slots.slots.values() if s.free and s.size), key=lambda s: -s.size):
            if need <= 0:
                return
            need -= seg.size
            self._drop(seg)


# ---------------------------------------------------------------------- releases
class ReleaseQueue:
    """Collects releases from garbage collection (any thread, any moment) without locks, and
    hands them out in batches per peer: one queue for every data path. A CUDA view's release
    carries an event recorded on the stream of the thread that dropped it: :meth:`take` waits
    for it (the receiver's GPU work on the view is done) before the slot is handed back."""

    def __init__(self, waits: Waits | None = None) -> None:
        self._q = Mailbox(waits or Waits())

    def put(self, peer: int, seg_id: Any, gen: int, event: Any = None) -> None:
        """``seg_id``: a shm segment id, or ``(tag, pool id)`` with ``gen`` the slot id."""
        self._q.put((peer, seg_id, gen, event))

    def take(self, timeout: float) -> dict[int, list[list[Any]]]:
        """Releases by peer as ``[[seg_id, gen, count], ...]`` (shm) and ``[tag, pool, slot,
        count]`` (tagged paths); waits up to ``timeout`` for one."""
        try:
            first = self._q.get(timeout)
        except TimeoutError:
            return {}
        counts: dict[tuple[int, Any, int], int] = {}
        events = []
        item = first
        while True:
            if item is not None:
                peer, seg_id, gen, event = item
                counts[peer, seg_id, gen] = counts.get((peer, seg_id, gen), 0) + 1
                if event is not None:
                    events.append(event)
            try:
                item = self._q.get_nowait()
            except IndexError:
                break
        for event in events:
            event.synchronize()
        out: dict[int, list[list[Any]]] = {}
        for (peer, seg_id, gen), n in counts.items():
            out.setdefault(peer, []).append([*seg_id, gen, n] if type(seg_id) is tuple else [seg_id, gen, n])
        return out

    def wake(self) -> None:
        self._q.put(None)


# ---------------------------------------------------------------------- the interface
class Reader(Protocol):
    """A peer's memory opened here (what :meth:`DataPath.accept` returns), kept on the peer as
    ``Peer.readers[tag]``; dispatch hands it the descriptors of that peer's frames."""

    refused: int  # descriptors refused so far

    def view(self, desc: Any) -> Any:
        """A zero-copy view of the buffer ``desc`` names; its last reference dropped queues
        the release. Every check runs before anything is touched.

        Raises:
            ProtocolError: a malformed, stale, out-of-bounds or unknown descriptor (counted
                in ``refused``): hostile input never maps or faults anything.
        """
        ...

    def close(self) -> None:
        """The peer is gone: unmap/close what no view references (the rest when views go)."""
        ...


class DataPath:
    """One data path of one node (see the module docstring). A path is made by its route's
    entry in :data:`PATHS` as ``cls.make(host, options)``: ``host`` is the node's sender
    (``node_id``, ``peers``, ``send_control(peer, kind, payload, timeout)``, ``releases``),
    ``options`` the node's data-path options (``shm``, ``shm_options``, ``cuda``,
    ``cuda_pool_bytes``, ``cuda_inline_max``, ``incarnation``).

    Attributes:
        route: the route name that takes it (``Route.kind`` for CPU paths, ``Route.gpu`` for
            GPU ones).
        tag: the first item of its descriptors and release items (None: untagged, shm).
        device: ``"cpu"`` or ``"cuda"``: the buffers it carries.
        unavailable: why this node cannot use it (None when it can).
    """

    route: str = ""
    tag: str | None = None
    device: str = "cpu"
    unavailable: str | None = None

    @classmethod
    def make(cls, host: Any, options: dict[str, Any]) -> "DataPath":
        raise NotImplementedError

    def open(self) -> None:
        """The node starts listening: make what the path needs before the first peer joins."""

    # per peer
    def offer(self) -> Any:
        """What a peer needs to open this node's memory (None: nothing to offer)."""
        raise NotImplementedError

    def accept(self, peer: int, offer: Any) -> Reader:
        """Open ``peer``'s offered memory here: its reader (``view(desc)``, ``close()``,
        ``refused``), kept on the peer (``Peer.readers[tag]``).

        Raises:
            ProtocolError: the offer is refused (nothing was opened).
        """
        raise NotImplementedError

    # sending
    def wants(self, nbytes: int) -> bool:
        """Whether a buffer of ``nbytes`` (on this path's device) is large enough to go by
        descriptor (smaller ones stay inline)."""
        raise NotImplementedError

    def takes(self, buffers: list[Any], sizes: list[int]) -> list[int]:
        """Indices of the buffers of a frame that this path carries by descriptor."""
        raise NotImplementedError

    def ready(self, peers: list[int], buffers: list[Any], sizes: list[int], indices: list[int],
              deadline: float) -> list[int]:
        """Those of ``peers`` (whose route chose this path) that can take these buffers now;
        the others get them inline or staged."""
        return peers

    def place(self, peers: list[int], buffers: list[Any], indices: list[int], deadline: float,
              descs: dict[int, list[Any]] | None = None) -> dict[int, list[Any]]:
        """Place ``buffers[i]`` (``i`` in ``indices``) in slots held for ``peers`` and describe
        them: their descriptors by index, filled into ``descs`` as they are placed. One copy
        shared by every peer; none for a buffer already in the pool (sent by handle).

        Raises:
            Timeout: the pool stayed full (slots held by receivers) until ``deadline``.
        """
        raise NotImplementedError

    def unhold(self, descs: dict[int, list[Any]], peers: list[int]) -> None:
        """The frame never reached ``peers``: give back the slots held for them."""
        raise NotImplementedError

    # releasing and accounting
    def on_release(self, peer: int, item: list[Any]) -> None:
        """One item of ``peer``'s RELEASE frame for this path (checked: stale or forged ones
        change nothing and are counted)."""
        raise NotImplementedError

    def forget(self, peer: Any) -> None:
        """``peer`` (a :class:`mq.node.peers.Peer`) is gone: what it held is free, its memory closed here."""
        raise NotImplementedError

    def counters(self) -> dict[str, Any]:
        """Counters for ``q.stats()`` (empty while the path was never used)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError
