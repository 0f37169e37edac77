"""The bounded FIFO between a transport's I/O thread and the threads that take its messages.

:class:`BoundedQueue` owns nothing but its items and its two bounds (messages, bytes); the
receive side (:mod:`mq.node.delivery`) holds one for ``recv()`` and one for subscription handlers.
Producers and consumers that must wait do so through the node's :class:`mq.node.waits.Waits`,
``on`` the queue: whoever puts or takes wakes them.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from mq.node.waits import Waits


class BoundedQueue:
    """A FIFO bounded in messages and in bytes, for one producer (the I/O thread) and any
    consumers.

    The hand-off between the I/O thread and ``recv()`` is on the small-message hot path: items
    go through a deque (append and popleft are atomic), and a put or take costs one dict lookup
    in the node's waits when nobody waits. Bytes are counted (under a lock) only for items of at
    least ``BIG`` bytes: smaller ones are bounded by the count.
    """

    BIG = 64 << 10

    def __init__(self, capacity: int, max_bytes: int = 1 << 62, waits: Waits | None = None):
        # (read directly by the receive side's per-message checks: a call each costs more)
        self.items: collections.deque[tuple[Any, int]] = collections.deque()
        self._items = self.items
        self.capacity = self._capacity = capacity
        self._max_bytes = max_bytes
        self._bytes = 0
        self._bytes_lock = threading.Lock()
        self.waits = waits or Waits()
        self._watched, self._key = self.waits.watched, id(self)  # (per message: no call unless waited on)

    def room(self, nbytes: int = 0) -> bool:
        """Whether an item of ``nbytes`` fits now. One item always fits an empty queue,
        whatever its size."""
        if len(self._items) >= self._capacity:
            return False
        return nbytes < self.BIG or self._bytes == 0 or self._bytes + nbytes <= self._max_bytes

    def put(self, item: Any, timeout: float, nbytes: int = 0) -> bool:
        """Add ``item``; False if the queue stayed full for ``timeout`` seconds."""
        if not self.room(nbytes) and not self.waits.pause(lambda: self.room(nbytes), timeout, on=(self,)):
            return False
        self.put_now(item, nbytes)
        return True

    def put_now(self, item: Any, nbytes: int = 0) -> None:
        """Add ``item`` past the bounds: for a consumer's own thread, which cannot wait for
        itself to make room, or a producer that waited for :meth:`room`."""
        if nbytes >= self.BIG:
            with self._bytes_lock:
                self._bytes += nbytes
        self._items.append((item, nbytes))
        if self._key in self._watched:
            self.waits.wake(self)

    def get(self, timeout: float) -> Any:
        """Next item; raises :class:`IndexError` after ``timeout`` seconds with none."""
        items = self._items
        deadline = None
        while True:
            try:
                return self._taken(items.popleft())
            except IndexError:  # (another consumer may take the item this one was woken for)
                pass
            deadline = deadline or time.monotonic() + timeout
            left = deadline - time.monotonic()
            if left <= 0 or not self.waits.pause(lambda: items, left, on=(self,)):
                raise IndexError("no item in time")

    def get_nowait(self) -> Any:
        """Next item; raises :class:`IndexError` when there is none."""
        return self._taken(self._items.popleft())

    def _taken(self, entry: tuple[Any, int]) -> Any:
        item, nbytes = entry
        if nbytes >= self.BIG:
            with self._bytes_lock:
                self._bytes -= nbytes
        if self._key in self._watched:  # a producer waiting for room
            self.waits.wake(self)
        return item

    def empty(self) -> bool:
        return not self._items

    def full(self) -> bool:
        return len(self._items) >= self._capacity

    def depth(self) -> dict[str, int]:
        return {"messages": len(self._items), "bytes": self._bytes}
