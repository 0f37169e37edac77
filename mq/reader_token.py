"""Who takes a transport's incoming frames: a thread in ``recv()`` or the transport's own thread.

Frames of a transport are taken and delivered by one thread at a time, the holder of the
:class:`ReaderToken`, so they keep their order. A thread waiting in ``recv()`` (or for a reply)
takes them itself (``Transport.read_in_caller`` -> :meth:`ReaderToken.read`): the frame it waits
for then skips a hand-off from another thread, a large part of a small message's latency. The
transport's own I/O thread takes them only while no caller does, nor did in the last
:data:`GRACE_S` (a caller in a loop is back within it), so handlers, replies and handshakes are
still served when nobody reads. The I/O thread's side::

    with token.changed:
        while running and token.wait_s() > 0:
            token.changed.wait(...)
    with token.held():
        ...deliver frames while not token.callers...
"""

from __future__ import annotations

import threading
import time
from typing import Callable

# The I/O thread stays out of a caller's way this long after the caller left; a caller waits
# this long at a time for the token while the I/O thread delivers.
GRACE_S = 0.002


class ReaderToken:
    """The token, and what the I/O thread needs to know of the callers that read.

    ``changed`` is the condition the I/O thread waits on (:meth:`wait_s` says for how long);
    ``callers`` counts threads in :meth:`read` (a plain read of it is a fair hint)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.changed = threading.Condition()
        self.callers = 0
        self._last_exit = 0.0

    # ------------------------------------------------------------------ callers
    def read(self, timeout: float, ready: Callable[[], bool], read_one: Callable[[float], None],
             wake_if: Callable[[], bool] | None = None) -> None:
        """A caller's turn: take the token and ``read_one(timeout)`` (deliver one frame, waiting
        up to ``timeout``), unless ``ready()`` (what the caller waits for arrived meanwhile) or
        the time is up first. On leaving, wake the I/O thread when this was the last caller and
        ``wake_if()`` says the thread has something to do (frames left behind)."""
        with self.changed:
            self.callers += 1
        try:
            if self._acquire(timeout, ready):
                try:
                    if not ready():
                        read_one(timeout)
                finally:
                    self._lock.release()
        finally:
            with self.changed:
                self.callers -= 1
                self._last_exit = time.monotonic()
                if wake_if is not None and not self.callers and wake_if():
                    self.changed.notify()

    def _acquire(self, timeout: float, ready: Callable[[], bool]) -> bool:
        # The I/O thread may hold the token while it delivers, maybe what the caller waits for:
        # look at ready() between short waits.
        if self._lock.acquire(False):
            return True
        deadline = time.monotonic() + timeout
        while not self._lock.acquire(timeout=GRACE_S):
            if ready() or time.monotonic() >= deadline:
                return False
        return True

    # ------------------------------------------------------------------ the I/O thread
    def held(self) -> threading.Lock:
        """The token as a context manager, for the I/O thread's turn."""
        return self._lock

    def wait_s(self) -> float:
        """How long the I/O thread should stay away (call with ``changed`` held): 0.0 - it may
        read now; the rest of the grace period after a caller left; ``inf`` - a caller reads."""
        if self.callers:
            return float("inf")
        return max(0.0, GRACE_S - (time.monotonic() - self._last_exit))

    def wake(self) -> None:
        """Wake the I/O thread if it waits on ``changed`` (a frame came while nobody reads)."""
        with self.changed:
            self.changed.notify()

    def stop(self) -> None:
        """Wake the I/O thread from its wait (it then looks at its transport's state)."""
        with self.changed:
            self.changed.notify_all()
