"""The bounded FIFO between a transport's I/O thread and the threads that take its messages.

:class:`BoundedQueue` owns nothing but its items and its two bounds (messages, bytes); the
receive side (:mod:`mq.delivery`) holds one for ``recv()`` and one for subscription handlers.
"""

from __future__ import annotations

import queue
import threading
from typing import Any


class BoundedQueue:
    """A FIFO bounded in messages and in bytes, for one producer (the I/O thread) and any
    consumers.

    The hand-off between the I/O thread and ``recv()`` is on the small-message hot path, so items
    go through the C SimpleQueue and the count bound is its size: no Python-level lock or
    semaphore per message. Only a producer facing a full queue waits on a Condition, and a
    consumer notifies only when somebody waits. Bytes are counted (under a lock) only for items
    of at least ``BIG`` bytes: smaller ones are bounded by the count.
    """

    BIG = 64 << 10

    def __init__(self, capacity: int, max_bytes: int = 1 << 62):
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._capacity = capacity
        self._space = threading.Condition()
        self._waiting = 0  # producers waiting for space
        self._max_bytes = max_bytes
        self._bytes = 0
        self._bytes_cond = threading.Condition()

    def put(self, item: Any, timeout: float, nbytes: int = 0) -> bool:
        """Add ``item``; False if the queue stayed full for ``timeout`` seconds. One item always
        fits in an empty queue, whatever its size."""
        if nbytes >= self.BIG:
            with self._bytes_cond:
                if not self._bytes_cond.wait_for(
                        lambda: self._bytes == 0 or self._bytes + nbytes <= self._max_bytes, timeout):
                    return False
                self._bytes += nbytes
        if self._items.qsize() >= self._capacity:
            with self._space:
                self._waiting += 1  # before looking again: a consumer seeing it will notify
                try:
                    room = self._space.wait_for(lambda: self._items.qsize() < self._capacity, timeout)
                finally:
                    self._waiting -= 1
            if not room:
                self._unbytes(nbytes)
                return False
        self._items.put((item, nbytes))
        return True

    def put_now(self, item: Any, nbytes: int = 0) -> None:
        """Add ``item`` past the bounds: for a consumer's own thread, which cannot wait for
        itself to make room."""
        if nbytes >= self.BIG:
            with self._bytes_cond:
                self._bytes += nbytes
        self._items.put((item, nbytes))

    def get(self, timeout: float) -> Any:
        """Next item; raises queue.Empty after ``timeout`` seconds."""
        return self._taken(self._items.get(timeout=timeout))

    def get_nowait(self) -> Any:
        return self._taken(self._items.get_nowait())

    def _taken(self, entry: tuple[Any, int]) -> Any:
        item, nbytes = entry
        if self._waiting:
            with self._space:
                self._space.notify()
        if nbytes >= self.BIG:
            self._unbytes(nbytes)
        return item

    def _unbytes(self, nbytes: int) -> None:
        if nbytes >= self.BIG:
            with self._bytes_cond:
                self._bytes -= nbytes
                self._bytes_cond.notify_all()

    def empty(self) -> bool:
        return self._items.empty()

    def full(self) -> bool:
        return self._items.qsize() >= self._capacity

    def depth(self) -> dict[str, int]:
        return {"messages": self._items.qsize(), "bytes": self._bytes}
