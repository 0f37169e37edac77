"""Warm receive buffers: large frames from another host land in memory already mapped and
faulted, not in fresh pages.

A frame read into a fresh buffer faults every page while its bytes arrive (about 2 us per
4 KiB page on small VMs, more while other processes churn memory): on the critical path of
every large transfer. :class:`WarmBuffers` keeps slabs (anonymous mappings, populated once) by
size class and lends one per frame; the frame's views (arrays, tensors, the frame itself) keep
it lent, and when the last of them is garbage the slab comes back for the next frame of its
class. Nothing waits: past the bound (slabs lent plus idle), a frame gets a fresh buffer, as
before. One per process, shared by its links (:func:`shared`).
"""

from __future__ import annotations

import collections
import mmap
import os
import threading
from typing import Any

from cffi import FFI

from mq.datapaths.base import size_class, view_until_garbage
from mq.datapaths.shm.pool import POPULATE

_ffi = FFI()

#: Frames smaller than this take a fresh buffer (cheap to fault, not worth a slab).
MIN_SIZE = 1 << 20
#: Slabs lent or idle at once, per process: min(2 GiB, an eighth of RAM) (two of a 640 MB frame:
#: the next frame arrives while the receiver still holds the last).
DEFAULT_MAX_BYTES = min(2 << 30, (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // 8)


capacity = size_class  # a request's slab size: the shm pool's size classes


class WarmBuffers:
    """Slabs lent to received frames (see the module docstring). Thread-safe; a slab comes back
    from garbage collection in any thread, through a queue (no lock taken there)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, min_size: int = MIN_SIZE):
        self.max_bytes = max_bytes
        self.min_size = min_size
        self._idle: dict[int, list[mmap.mmap]] = {}  # capacity -> slabs nobody uses
        self._back: collections.deque[tuple[int, Any]] = collections.deque()  # (capacity, slab) given back
        self._lock = threading.Lock()
        self.mapped = 0  # bytes of slabs, lent and idle
        self.stats = {"lent": 0, "reused": 0, "fresh": 0}

    def take(self, size: int) -> memoryview | None:
        """``size`` writable bytes in a warm slab, or None (small, or over the bound: the
        caller makes a fresh buffer). The slab is lent until every view of it is garbage."""
        if size < self.min_size:
            return None
        cap = capacity(size)
        with self._lock:
            self._collect()
            idle = self._idle.get(cap)
            if idle:
                slab: mmap.mmap | None = idle.pop()
                self.stats["reused"] += 1
            else:
                slab = self._new(cap)
            if slab is None:
                self.stats["fresh"] += 1
                return None
            self.stats["lent"] += 1
        addr = int(_ffi.cast("uintptr_t", _ffi.from_buffer(slab)))
        back = self._back.append
        return view_until_garbage(addr, size, lambda: back((cap, slab)))

    def _collect(self) -> None:
        while True:
            try:
                cap, slab = self._back.popleft()
            except IndexError:
                return
            self._idle.setdefault(cap, []).append(slab)

    def _new(self, cap: int) -> mmap.mmap | None:
        if self.mapped + cap > self.max_bytes:
            self._evict(self.mapped + cap - self.max_bytes)
        if self.mapped + cap > self.max_bytes:
            return None
        try:
            # Populated now, in one go (cheaper than a fault per page while a frame arrives).
            # Not madvised for huge pages: here that made the first frame 5x slower and the
            # others no faster.
            slab = mmap.mmap(-1, cap, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | POPULATE)
        except OSError:
            return None
        self.mapped += cap
        return slab

    def _evict(self, need: int) -> None:
        """Unmap idle slabs (the largest first) until ``need`` bytes are free."""
        for cap in sorted(self._idle, reverse=True):
            slabs = self._idle[cap]
            while slabs and need > 0:
                slabs.pop().close()
                self.mapped -= cap
                need -= cap
            if not slabs:
                del self._idle[cap]

    def idle_bytes(self) -> int:
        with self._lock:
            self._collect()
            return sum(cap * len(s) for cap, s in self._idle.items())


_shared: WarmBuffers | None = None
_shared_lock = threading.Lock()


def shared() -> WarmBuffers:
    """This process's warm buffers (made on first use)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = WarmBuffers()
        return _shared
