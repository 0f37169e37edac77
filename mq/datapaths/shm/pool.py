"""The shm data path: CPU buffers between processes on one host, through a shared-memory pool.

Each node owns one :class:`Pool` of anonymous shared memory (``memfd_create``): nothing is ever
named in /dev/shm, so Docker's 64 MiB /dev/shm does not limit it and no segment outlives the
processes that map it (SIGKILL of either side leaves nothing behind). A peer on the same host
opens the pool's segments through ``/proc/<pid>/fd/<fd>`` (same boot id, IPC and PID namespace;
the join handshake probes it, see :meth:`Pool.probe_info` / :meth:`PoolReader.probe`).

Sending a buffer on this path::

    sender:   pool.place(buf, holders)   -> one memcpy into a warm slot (no copy if ``buf`` was
                                            allocated in the pool: sent "by handle")
              descriptor [seg, gen, offset, nbytes] travels in the frame header
    receiver: reader.view(descriptor)    -> zero-copy view of the slot; when the last view is
                                            garbage, a RELEASE goes back to the sender
    sender:   pool.release(peer, seg, gen) -> the slot is free again (once every holder released)

Segments are reused by size, so after the first message of a size both sides touch memory
that is already mapped and faulted (page faults, not copies, dominate large transfers on small
machines). The pool's byte bound is a backpressure bound: when every slot is held by receivers,
:meth:`Pool.place` waits up to the caller's timeout, then raises :class:`~mq.errors.Timeout`.

Each segment starts with a 64-byte header (magic, generation, state) that the receiver checks,
so a stale or forged descriptor (unknown segment, wrong generation, span past the end) is a
:class:`~mq.errors.ProtocolError` (dropped and counted), never an out-of-bounds view.

A peer that joined is still not trusted with this process's memory. The owner seals every
segment against shrinking and growing (``F_SEAL_SHRINK | F_SEAL_GROW``) before anyone maps it,
and a reader maps only sealed shmem memfds: a page of a mapping can never vanish under a view
(a shrunk file would kill the reader with SIGBUS). The probe segment is a bare header, mapped
without populating and unmapped at once. What a reader maps for one peer is bounded by the
peer's announced pool bound (and a local cap): each mapping counts at least one minimal
segment, unused mappings are unmapped first, and a descriptor that would still go over is
refused. Mappings are not populated: populating a peer's sparse segment would allocate pages
the peer never wrote, charged to this process. :meth:`PoolReader.close` unmaps everything no
view references (core calls it when the peer is lost).

Ownership (documented in the README): a receiver's numpy arrays are read-only views and its
torch tensors are writable views of the sender's slot; with ``publish`` one slot is shared by
every same-host subscriber, so copy before writing in place. A buffer from :meth:`Pool.alloc`
belongs to the sender again only when every receiver released it: :meth:`Pool.wait_released`
waits for that, and the sender's numpy view is read-only in between.
"""

from __future__ import annotations

import collections
import fcntl
import functools
import logging
import mmap
import os
import reprlib
import struct
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np
from cffi import FFI

from mq.datapaths.base import (Slot, SegmentPool, SlotPool, SlotTable, address_of as _address, as_uint8, size_class,
                         view_until_garbage)
from mq.errors import ConfigError, ProtocolError, Timeout
from mq.options import check_int
from mq.node.waits import Waits

log = logging.getLogger("mq.datapaths.shm.pool")

_ffi = FFI()
_MAGIC = b"mq-pool\x00"
_HEADER = 64  # segment header; data starts here, 64-byte aligned
_HEAD = struct.Struct("<8sQQQ")  # magic, generation, state, segment id
_LIVE, _RETIRED = 0, 1
_NAME_PREFIX = "mq-pool-"
_MIN_SEGMENT = 64 << 10
_PROBE_SIZE = _HEADER  # the probe segment is a bare header
_MAX_FD = 1 << 31  # fds are C ints
_MAX_INT = 1 << 63  # ids and generations live in u64 header fields; pids are far below
POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # mmap flag: fault every page in now, in one go

#: Default bound of one node's pool: a quarter of RAM, at most 4 GiB.
DEFAULT_POOL_BYTES = min(4 << 30, (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // 4)
#: Buffers smaller than this stay inline in the frame. Measured on the reference VM (mq bench,
#: nng same host): below ~64 KiB a descriptor plus a RELEASE costs more than the socket copy.
DEFAULT_INLINE_MAX = 64 << 10


def available() -> str | None:
    """Why this process cannot make a pool, or None when it can."""
    if not hasattr(os, "memfd_create"):
        return "os.memfd_create is missing (needs Linux >= 3.17)"
    if not hasattr(fcntl, "F_ADD_SEALS"):
        return "fcntl.F_ADD_SEALS is missing (memfd sealing needs Linux >= 3.17)"
    return None


def _capacity(nbytes: int) -> int:
    """A segment's size for a request: its size class, at least a minimal segment."""
    return size_class(max(nbytes, _MIN_SEGMENT))


@dataclass(eq=False, kw_only=True)
class _Segment(Slot):
    """One memfd of the pool: a slot holding one buffer at a time (``gen`` bumped on reuse)."""

    fd: int
    mm: mmap.mmap
    base: int  # address of the data (after the header)
    user_view: Any = None  # the numpy array handed out by alloc()
    lent: bool = False  # a frame from another host lies in it (lend): views of it may live here

    @property
    def seg_id(self) -> int:
        return self.slot_id

    @property
    def capacity(self) -> int:
        return self.size

    @property
    def free(self) -> bool:
        return not self.holders and not self.pinned and not self.lent

    def write_header(self, state: int = _LIVE) -> None:
        _HEAD.pack_into(self.mm, 0, _MAGIC, self.gen, state, self.slot_id)


class Pool(SegmentPool, SlotPool):
    """This node's shared memory for the shm data path (the sender side).

    Args:
        max_bytes: bound of all segments together; a buffer larger than this goes inline.
        inline_max: buffers smaller than this stay inline in the frame.
        label: shows in ``/proc/<pid>/fd`` as ``memfd:mq-pool-<label>`` (for humans).

    Thread-safe: ``place``, ``release`` and ``alloc`` may be called from any thread.
    """

    closed_text = "the shared-memory pool is closed (the queue stopped)"

    def __init__(self, max_bytes: int = DEFAULT_POOL_BYTES, inline_max: int = DEFAULT_INLINE_MAX,
                 label: str = "", waits: Waits | None = None):
        self.check_options(max_bytes, inline_max)
        why = available()
        if why:
            raise OSError(why)
        self.max_bytes = max_bytes
        self.inline_max = inline_max
        self.label = label
        self.stats = {"placed": 0, "by_handle": 0, "copied_bytes": 0, "waits": 0,
                      "stale_releases": 0, "segments": 0, "lent": 0}
        # Holders per peer, releases, backpressure: the table every data path shares.
        self._slots = SlotTable(on_released=_writable_again, stats=self.stats, waits=waits)
        self._cond = self._slots.cond
        self._segments: dict[int, _Segment] = self._slots.slots  # type: ignore[assignment]
        self._by_address: list[tuple[int, int, _Segment]] = []  # (start, end, seg) for handles
        self._bytes = 0
        self._closed = False
        self._lent_bytes = 0
        # lent segments whose views are gone (appended by garbage collection, any thread: no lock)
        self._returned: collections.deque[_Segment] = collections.deque()
        # A tiny segment peers open during the handshake to prove they can read this pool.
        self._probe = self._new_segment(0)
        self._probe.pinned = True

    @staticmethod
    def check_options(max_bytes: Any, inline_max: Any) -> None:
        check_int(max_bytes, "shm_pool_bytes", minimum=0, unit="bytes")
        check_int(inline_max, "shm_inline_max", minimum=0, unit="bytes")

    # ------------------------------------------------------------------ handshake
    def probe_info(self) -> dict[str, Any]:
        """What a peer needs to open this pool: pid, the probe segment and the pool's bound
        (the most a peer's reader maps for it)."""
        return {"pid": os.getpid(), "probe": [self._probe.seg_id, self._probe.fd],
                "max_bytes": self.max_bytes}

    # ------------------------------------------------------------------ sending
    def wants(self, nbytes: int) -> bool:
        """Whether a buffer of ``nbytes`` should travel by descriptor."""
        return self.inline_max <= nbytes and 0 < nbytes and _capacity(nbytes) <= self.max_bytes

    def place(self, buf: Any, holders: list[int], timeout: float) -> list[int]:
        """Put ``buf`` in a slot for ``holders`` (peer ids) and return its descriptor
        ``[seg_id, fd, gen, offset, nbytes]``. No copy if ``buf`` already lies in the pool.

        Raises:
            Timeout: every slot stayed held by receivers for ``timeout`` seconds.
        """
        addr, nbytes = _address(buf)
        with self._cond:
            seg = self._owner(addr, nbytes)
            if seg is not None:  # sent by handle: share the user's slot
                self._slots.hold(seg, holders)
                self.stats["by_handle"] += 1
                if seg.user_view is not None:
                    seg.user_view.flags.writeable = False  # the sender's copy is shared now
                return [seg.seg_id, seg.fd, seg.gen, addr - seg.base, nbytes]

        def claim(seg: _Segment) -> None:
            seg.gen += 1
            seg.write_header()
            self._slots.hold(seg, holders)

        seg = self._take(nbytes, timeout, claim=claim, peers=holders)
        # Copy outside the lock: other senders may place meanwhile.
        dst = np.frombuffer(seg.mm, np.uint8, nbytes, _HEADER)
        np.copyto(dst, as_uint8(buf))
        self.stats["placed"] += 1
        self.stats["copied_bytes"] += nbytes
        return [seg.seg_id, seg.fd, seg.gen, 0, nbytes]

    def _owner(self, addr: int, nbytes: int) -> _Segment | None:
        for start, end, seg in self._by_address:
            if start <= addr and addr + nbytes <= end:
                return seg
        return None

    def _take(self, nbytes: int, timeout: float, reuse: bool = True, populate: bool = False,
              claim: Callable[[_Segment], None] = lambda _seg: None, peers: Iterable[int] = ()) -> _Segment:
        """A segment for ``nbytes`` (:class:`~mq.datapaths.base.SegmentPool`: best fit; with
        ``reuse`` off always a fresh one), waiting while ``peers`` live.

        Every segment counts against the bound, alloc()'s too: readers refuse to map more of
        this pool than its announced bound."""
        cap = _capacity(nbytes)
        if cap > self.max_bytes:
            raise ConfigError(f"a {nbytes}-byte buffer does not fit the shared-memory pool "
                              f"({self.max_bytes} bytes): raise shm_pool_bytes")
        return self._wait_for_segment(nbytes, cap, timeout, claim, peers, reuse, populate)

    def _fit(self, nbytes: int, cap: int, reuse: bool = True, populate: bool = False) -> _Segment | None:
        self._collect_lent()  # lent segments whose views are gone are free again
        return super()._fit(nbytes, cap, reuse, populate)

    def _full(self, timeout: float) -> str:
        held = sum(s.capacity for s in self._segments.values() if not s.free)
        return (f"the shared-memory pool stayed full for {timeout:g}s ({held >> 20} MiB of "
                f"{self.max_bytes >> 20} MiB held by receivers that still reference earlier "
                "messages, or by alloc() buffers): receivers must drop or copy what they "
                "keep, or raise shm_pool_bytes / pass timeout= to wait longer")

    def _new_segment(self, capacity: int, populate: bool = False) -> _Segment:
        fd = os.memfd_create(f"{_NAME_PREFIX}{self.label}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, _HEADER + capacity)
            # Sealed before any peer sees it: readers refuse segments that could shrink.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL)
            mm = mmap.mmap(fd, _HEADER + capacity, flags=mmap.MAP_SHARED | (POPULATE if populate else 0))
        except OSError:
            os.close(fd)
            raise
        base = int(_ffi.cast("uintptr_t", _ffi.from_buffer(mm))) + _HEADER
        seg = self._slots.add(_Segment(slot_id=self._slots.next_id(), size=capacity, fd=fd, mm=mm, base=base))
        seg.write_header()
        self._bytes += capacity
        self.stats["segments"] += 1
        return seg

    def _drop(self, seg: _Segment) -> None:
        # Readers still mapping it see RETIRED and unmap it once their views are gone.
        seg.write_header(_RETIRED)
        del self._segments[seg.seg_id]
        self._bytes -= seg.capacity
        self._forget_address(seg)
        try:
            seg.mm.close()
        except BufferError:  # a user view still exports it: the mapping goes with that view
            pass
        os.close(seg.fd)

    # ------------------------------------------------------------------ releasing
    def release(self, peer: int, seg_id: Any, gen: Any, count: Any = 1) -> bool:
        """``peer`` dropped ``count`` views of slot ``seg_id`` generation ``gen``. False (and
        counted) when that does not match what the peer holds: stale or forged."""
        return self._slots.release(peer, seg_id, count, gen)

    # ------------------------------------------------------------------ lending
    def lend(self, nbytes: int) -> memoryview | None:
        """``nbytes`` writable bytes in a slot, for a frame arriving from another host that this
        node passes on to same-host peers: :meth:`place` finds its buffers here and sends them by
        handle (no copy). The slot is lent until every view of it is garbage, and then free once
        the peers it was placed for released it.

        None (never waits) when the pool has no free room now, or lending would take more than
        half of it: the rest stays for what this node sends, whatever receivers keep."""
        cap = _capacity(nbytes)
        with self._cond:
            self._collect_lent()
            if self._closed or self._lent_bytes + cap > self.max_bytes // 2:
                return None
            try:
                seg = self._take(nbytes, 0.0, populate=True)  # no faults while the frame arrives
            except (Timeout, ConfigError):
                return None
            seg.lent = True
            seg.gen += 1
            seg.write_header()
            self._lent_bytes += seg.capacity
            self._by_address.append((seg.base, seg.base + seg.capacity, seg))
            self.stats["lent"] += 1
        # `keep` exports the mapping while lent, so close() cannot unmap it under a view; the
        # last view's garbage collection (any thread) returns the slot through a queue, no lock.
        # (The ignore: mypy cannot type a lambda with a default argument.)
        keep, back = memoryview(seg.mm), self._returned.append
        return view_until_garbage(seg.base, nbytes, lambda keep=keep: back(seg))  # type: ignore[misc]

    def _collect_lent(self) -> None:
        """Take back the lent slots no view references any more. Called with the lock held."""
        while self._returned:
            seg = self._returned.popleft()
            seg.lent = False
            self._lent_bytes -= seg.capacity
            self._forget_address(seg)
            self._slots.waits.wake(self._slots)

    def _forget_address(self, seg: _Segment) -> None:
        """``seg`` no longer holds a buffer that place() may send by handle."""
        self._by_address = [e for e in self._by_address if e[2] is not seg]

    # ------------------------------------------------------------------ by handle
    def alloc(self, shape: Any, dtype: Any, timeout: float = 0.0) -> Any:
        """A numpy array (numpy dtype) or torch tensor (torch dtype) of ``shape`` in the pool.
        Sending it, anywhere in a payload, to a same-host shm peer costs a descriptor.

        Raises:
            ConfigError: bad shape/dtype, or larger than the pool's bound.
            Timeout: the pool stayed too full for ``timeout`` seconds (slots held by receivers).
        """
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ConfigError(f"shape must be ints >= 0, got {shape!r}")
        torch_dtype = _torch_dtype(dtype)
        try:
            np_dtype = np.dtype(np.uint8 if torch_dtype is not None else dtype)
        except TypeError:
            raise ConfigError(f"dtype must be a numpy or torch dtype (e.g. 'float32', "
                              f"torch.float32), got {dtype!r}") from None
        if np_dtype.hasobject:
            raise ConfigError(f"dtype {np_dtype} holds Python objects: shared memory needs plain data")
        itemsize = torch_dtype.itemsize if torch_dtype is not None else np_dtype.itemsize
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        def claim(seg: _Segment) -> None:
            seg.pinned = True
            seg.gen += 1
            seg.write_header()
            self._by_address.append((seg.base, seg.base + seg.capacity, seg))

        seg = self._take(nbytes, timeout, reuse=False, claim=claim)
        raw = np.frombuffer(seg.mm, np.uint8, nbytes, _HEADER)
        if torch_dtype is not None:
            import torch

            return torch.frombuffer(raw, dtype=torch.uint8).view(torch_dtype).reshape(shape) \
                if nbytes else torch.empty(shape, dtype=torch_dtype)
        arr = raw.view(np_dtype).reshape(shape)
        seg.user_view = arr
        return arr

    def _slot_of(self, buf: Any) -> _Segment:
        seg = self._owner(*_address(buf))
        if seg is None:
            raise ConfigError("this buffer was not allocated with q.alloc(): only pool "
                              "buffers are sent by handle")
        return seg

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        with self._cond:
            self._closed = True
            for seg in list(self._segments.values()):
                if not seg.pinned or seg is self._probe:
                    self._drop(seg)
                else:  # the user may still use an alloc() buffer: leave its mapping alive
                    seg.write_header(_RETIRED)
                    os.close(seg.fd)
                    del self._segments[seg.seg_id]
        self._slots.waits.wake(self._slots)


def _writable_again(seg: Any) -> None:
    """Every receiver released an alloc() buffer: the sender's numpy view is its own again."""
    if seg.user_view is not None:
        seg.user_view.flags.writeable = True


def _torch_dtype(dtype: Any) -> Any:
    import sys

    torch = sys.modules.get("torch")
    return dtype if torch is not None and isinstance(dtype, torch.dtype) else None


@functools.cache
def _shmem_dev() -> int:
    """st_dev of plain memfds: all live on the kernel's one internal shmem mount."""
    fd = os.memfd_create("mq-dev", os.MFD_CLOEXEC)
    try:
        return os.fstat(fd).st_dev
    finally:
        os.close(fd)


def _sane(value: Any, bound: int = _MAX_INT) -> bool:
    return type(value) is int and 0 <= value < bound


def _charge(size: int) -> int:
    """What mapping a segment of ``size`` bytes counts against a peer's bound: its data, and at
    least a minimal segment (a real pool has no smaller one), so the bound also caps the count."""
    return max(size - _HEADER, _MIN_SEGMENT)


def _sealed_size(mfd: int) -> int:
    """The size of an opened peer segment, final. Checked on the opened fd, not on the name the
    peer showed: it may have swapped its fd in between."""
    # A file that can shrink could pull mapped pages out from under a view (SIGBUS).
    if not fcntl.fcntl(mfd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
        raise ProtocolError("it is not sealed against shrinking")
    st = os.fstat(mfd)  # after the seal check: the seal makes this size final
    if st.st_dev != _shmem_dev():  # e.g. hugetlbfs, where punching a hole takes pages away
        raise ProtocolError("it is not a plain shared-memory file")
    if st.st_size < _HEADER:
        raise ProtocolError("it is truncated")
    return st.st_size


class _Mapping:
    """One peer segment mapped here."""

    __slots__ = ("mm", "base", "size", "live", "orphan")

    def __init__(self, mm: mmap.mmap):
        self.mm = mm
        self.base = int(_ffi.cast("uintptr_t", _ffi.from_buffer(mm)))
        self.size = len(mm)
        self.live = 0  # views handed out and not yet released
        self.orphan = False  # unmap when the last view goes (the reader closed meanwhile)


class PoolReader:
    """Views of one peer's pool (the receiver side).

    Args:
        peer: the peer's node id (for messages).
        info: the peer's :meth:`Pool.probe_info`.
        on_release: called as ``on_release(seg_id, gen)`` when the last reference to a view is
            dropped. Runs from garbage collection, in any thread: it must not block or lock
            (a ``SimpleQueue.put`` is fine).
        max_bytes: this node's cap on what it maps for one peer; the bound is the smaller of
            this and the peer's announced pool bound.

    Counters (read them from any thread): ``mapped_bytes`` (as counted against ``limit``) and
    ``refused`` (descriptors :meth:`view` refused).
    """

    def __init__(self, peer: int, info: Any, on_release: Callable[[int, int], None],
                 max_bytes: int = DEFAULT_POOL_BYTES):
        probe = info.get("probe") if isinstance(info, dict) else None
        if not (isinstance(probe, list) and len(probe) == 2 and _sane(probe[0])
                and _sane(probe[1], _MAX_FD) and _sane(info.get("pid"), _MAX_FD) and info["pid"] > 0
                and _sane(info.get("max_bytes"))):
            raise ProtocolError(f"node {peer}: malformed shared-memory pool description")
        self.peer = peer
        self.pid = info["pid"]
        self.limit = min(info["max_bytes"], max_bytes)
        self.refused = 0
        self._probe = probe
        self._on_release = on_release
        self._maps: dict[int, _Mapping] = {}
        self._lock = threading.Lock()
        self._closed = False

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the peer's segments mapped here, as counted against ``limit``."""
        return sum(_charge(m.size) for m in list(self._maps.values()))

    def probe(self) -> str | None:
        """Open the peer's probe segment: None when this process can read the peer's pool,
        else why not (the route then falls back to a socket, and says so). Runs before the
        peer authenticated: it maps one page, unpopulated, and unmaps it again."""
        try:
            self._map(*self._probe, self._check_probe_size).close()  # type: ignore[call-arg]  # [seg_id, fd]: checked
        except ProtocolError as exc:
            return f"cannot open node {self.peer}'s shared memory ({exc})"
        return None

    @staticmethod
    def _check_probe_size(size: int) -> None:
        if size != _PROBE_SIZE:
            raise ProtocolError(f"a probe segment has {_PROBE_SIZE} bytes, this one {size}")

    def _map(self, seg_id: int, fd: int, admit: Callable[[int], None]) -> mmap.mmap:
        """Map the peer's segment ``seg_id`` (its ``fd``) once ``admit(size)`` let its size in.
        Not populated: populating a sparse segment would allocate pages the peer never wrote,
        charged to this process; a view faults in only what is read."""
        path = f"/proc/{self.pid}/fd/{fd}"
        try:
            target = os.readlink(path)
            if not target.startswith(f"/memfd:{_NAME_PREFIX}"):
                raise ProtocolError(f"it is not an mq pool segment ({target!r})")
            # The peer may swap its fd for anything before the open: no blocking, no tty.
            mfd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
            try:
                size = _sealed_size(mfd)
                admit(size)
                mm = mmap.mmap(mfd, size, flags=mmap.MAP_SHARED)
            finally:
                os.close(mfd)
        except (OSError, ProtocolError) as exc:
            raise ProtocolError(f"segment {seg_id} of node {self.peer} ({path}) is refused: "
                                f"{exc}") from None
        magic, _gen, _state, real_id = _HEAD.unpack_from(mm, 0)
        if magic != _MAGIC or real_id != seg_id:
            mm.close()
            raise ProtocolError(f"fd {fd} of node {self.peer} is not its segment {seg_id}")
        return mm

    def _open(self, seg_id: int, fd: int) -> _Mapping:
        m = self._maps.get(seg_id)
        if m is None:
            self._unmap_retired()
            m = self._maps[seg_id] = _Mapping(self._map(seg_id, fd, self._make_room))
        return m

    def _make_room(self, size: int) -> None:
        """Keep what is mapped for this peer within its bound: unmap what no view uses (it is
        mapped again when named again), else refuse."""
        need = _charge(size)
        if self.mapped_bytes + need > self.limit:
            for seg_id in [s for s, m in self._maps.items() if not m.live]:
                self._unmap(seg_id)
        if self.mapped_bytes + need > self.limit:
            raise ProtocolError(f"mapping {need} more bytes would exceed the bound of "
                                f"{self.limit} bytes mapped for node {self.peer} "
                                f"({self.mapped_bytes} held by views)")

    def view(self, desc: Any) -> memoryview:
        """A zero-copy view for descriptor ``[seg_id, fd, gen, offset, nbytes]``.

        Raises:
            ProtocolError: the descriptor is malformed, stale, out of bounds or names a segment
                this reader refuses to map (counted in ``refused``).
        """
        try:
            return self._view(desc)
        except ProtocolError:
            self.refused += 1
            raise

    def _view(self, desc: Any) -> memoryview:
        if not (isinstance(desc, list) and len(desc) == 5 and all(type(x) is int for x in desc)
                and _sane(desc[0]) and _sane(desc[1], _MAX_FD)):
            raise ProtocolError(f"malformed shared-memory descriptor {reprlib.repr(desc)}")
        seg_id, fd, gen, offset, nbytes = desc
        with self._lock:
            if self._closed:
                raise ProtocolError("the peer's pool is closed")
            m = self._open(seg_id, fd)
            _magic, live_gen, state, _id = _HEAD.unpack_from(m.mm, 0)
            if gen != live_gen or state != _LIVE:
                raise ProtocolError(f"stale descriptor: segment {seg_id} is at generation "
                                    f"{live_gen}, the frame says {gen}")
            if offset < 0 or nbytes < 0 or _HEADER + offset + nbytes > m.size:
                raise ProtocolError(f"descriptor span {offset}+{nbytes} overruns segment {seg_id} "
                                    f"of {m.size - _HEADER} bytes")
            m.live += 1

        def released(_p: Any, m: _Mapping = m) -> None:
            m.live -= 1
            if m.live == 0 and m.orphan:
                m.mm.close()
            self._on_release(seg_id, gen)

        ptr = _ffi.gc(_ffi.cast("char *", m.base + _HEADER + offset), released)
        return memoryview(_ffi.buffer(ptr, nbytes))

    def _unmap_retired(self) -> None:
        for seg_id, m in list(self._maps.items()):
            if m.live == 0 and _HEAD.unpack_from(m.mm, 0)[2] == _RETIRED:
                self._unmap(seg_id)

    def _unmap(self, seg_id: int) -> None:
        # Views are raw pointers into the mapping: never unmap under a live one.
        m = self._maps.pop(seg_id)
        if m.live:
            m.orphan = True
        else:
            m.mm.close()

    def close(self) -> None:
        """Unmap what no view references; live views keep their segment mapped until dropped."""
        with self._lock:
            self._closed = True
            for seg_id in list(self._maps):
                self._unmap(seg_id)
