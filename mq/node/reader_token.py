"""Who takes a transport's incoming frames: a thread in ``recv()`` or the transport's own thread.

Frames of a transport are taken and delivered by one thread at a time, the holder of the
:class:`ReaderToken`, so they keep their order. A thread waiting in ``recv()`` (or for a reply)
takes them itself (``Transport.read_in_caller`` -> :meth:`ReaderToken.read`): the frame it waits
for then skips a hand-off from another thread, a large part of a small message's latency. The
transport's own I/O thread takes them only while no caller does, nor did in the last
:data:`GRACE_S` (a caller in a loop is back within it), so handlers, replies and handshakes are
still served when nobody reads. The I/O thread's side::

    token.await_turn(stopped)          # returns when it may read (or stopped())
    with token.held():
        ...deliver frames while not token.callers...

Both sides wait through the node's :class:`mq.node.waits.Waits`, on the token.

Why the I/O thread backs off while callers keep reading: every look it takes costs the caller
the GIL at a bad moment. On a loaded machine (other processes on every core) waking each
GRACE_S while a caller read in a loop made a small round trip ~1.4x slower than raw pynng's; it
looks less often the longer callers keep the token (up to :data:`IDLE_LOOK_S`), and a thread
that starts a wait which needs frames read (a send held by flow control) wakes it at once
(:meth:`wake`).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from mq.node.waits import ANY_STATE, Waits

# The I/O thread stays out of a caller's way this long after the caller left; a caller waits
# this long at a time for the token while the I/O thread delivers.
GRACE_S = 0.002
#: While callers keep reading, the I/O thread looks again after GRACE_S, then twice as long each
#: time, up to this.
IDLE_LOOK_S = 0.032


class ReaderToken:
    """The token, and what the I/O thread needs to know of the callers that read.

    ``callers`` counts threads in :meth:`read` (a plain read of it is a fair hint)."""

    def __init__(self, waits: Waits | None = None) -> None:
        self._lock = threading.Lock()  # the token itself: only ever tried, never waited on
        self._guard = threading.Lock()  # callers and _last_exit
        self.callers = 0
        self._last_exit = 0.0
        self.waits = waits or Waits()
        # What the I/O thread's waits are on (a caller letting go of the token wakes only the
        # callers waiting for it: waking the I/O thread per recv() would cost the GIL each time).
        self._turn = _Turn()

    # ------------------------------------------------------------------ callers
    def read(self, timeout: float, ready: Callable[[], bool], read_one: Callable[[float], None],
             wake_if: Callable[[], bool] | None = None) -> None:
        """A caller's turn: take the token and ``read_one(timeout)`` (deliver one frame, waiting
        up to ``timeout``), unless ``ready()`` (what the caller waits for arrived meanwhile) or
        the time is up first. On leaving, wake the I/O thread when this was the last caller and
        ``wake_if()`` says the thread has something to do (frames left behind)."""
        with self._guard:
            self.callers += 1
        try:
            if self._lock.acquire(False) or self._acquire(timeout, ready):
                try:
                    if not ready():
                        read_one(timeout)
                finally:
                    self._release()
        finally:
            with self._guard:
                self.callers -= 1
                self._last_exit = time.monotonic()
                wake = wake_if is not None and not self.callers and wake_if()
            if wake:
                self.waits.wake(self._turn)

    def _acquire(self, timeout: float, ready: Callable[[], bool]) -> bool:
        # The I/O thread may hold the token while it delivers, maybe what the caller waits for:
        # look at ready() while waiting (it wakes us when it lets go).
        if self._lock.acquire(False):
            return True
        try:
            got = self.waits.until(lambda: self._lock.acquire(False) or ("ready" if ready() else False),
                                   time.monotonic() + timeout, on=(self,), every=GRACE_S, states=ANY_STATE)
        except Exception:  # Timeout: the caller's time is up
            return False
        return got is True

    def _release(self) -> None:
        self._lock.release()
        if id(self) in self.waits.watched:  # a caller waits for the token
            self.waits.wake(self)

    # ------------------------------------------------------------------ the I/O thread
    def held(self) -> "ReaderToken":
        """The token as a context manager, for the I/O thread's turn."""
        return self

    def __enter__(self) -> "ReaderToken":
        self._lock.acquire(False) or self._acquire(float("inf"), lambda: False)
        return self

    def __exit__(self, *_exc: object) -> None:
        self._release()

    def wait_s(self) -> float:
        """How long the I/O thread should stay away: 0.0 - it may read now; the rest of the
        grace period after a caller left; ``inf`` - a caller reads."""
        if self.callers:
            return float("inf")
        return max(0.0, GRACE_S - (time.monotonic() - self._last_exit))

    def await_turn(self, stopped: Callable[[], bool], idle_wait: float | None = IDLE_LOOK_S) -> None:
        """The I/O thread waits until it may read (no caller reads, nor did for GRACE_S) or
        ``stopped()``. While callers keep reading it looks again after GRACE_S, then twice as
        long each time, up to ``idle_wait`` (None: until woken: a transport whose frames wake it,
        :meth:`wake`)."""
        look = GRACE_S
        while not stopped():
            wait = self.wait_s()
            if wait <= 0:
                return
            if wait == float("inf"):
                self.waits.pause(lambda: stopped() or not self.callers, look if idle_wait else 1.0, on=(self._turn,))
                if idle_wait:
                    look = min(look * 2, idle_wait)
            else:  # a caller just left: it is likely back soon
                self.waits.pause(stopped, wait, on=(self._turn,))

    def idle(self, ready: Callable[[], bool], seconds: float) -> bool:
        """The I/O thread waits (up to ``seconds``) for ``ready()``, woken by :meth:`wake`."""
        return self.waits.pause(ready, seconds, on=(self._turn,))

    def wake(self) -> None:
        """Wake the I/O thread if it waits (a frame came while nobody reads; a thread began a
        wait that needs frames read)."""
        self.waits.wake(self._turn)

    def stop(self) -> None:
        """Wake the I/O thread from its wait (it then looks at its transport's state)."""
        self.waits.wake(self._turn)
        self.waits.wake(self)


class _Turn:
    """The I/O thread's turn: what its waits are on."""

    __slots__ = ()
