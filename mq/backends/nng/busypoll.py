"""Spin, then sleep: how a thread waiting in ``recv()`` or ``call()`` waits for its next frame.

Why: on the VMs measured here, waking a thread that sleeps in ``poll()`` (an idle CPU halts and
must be woken by an interrupt) costs about as much as the rest of a small message's round trip.
A waiter that keeps polling without sleeping for a short while finds a prompt answer without
being woken: a same-host round trip of a 1.25 KB tensor took 0.26 ms sleeping and 0.13 ms
spinning (``mq bench``, README).

What it costs, and the bounds on it:
- A wait spins at most :data:`WINDOW_S`, then sleeps as before: a receiver with nothing coming
  burns at most that per ``recv()`` call, never a core.
- It spins only while it pays: while the waits of the recent past were shorter than the window
  (an exponentially weighted mean of them). A collector whose answers take milliseconds, or a
  node that waits for rare messages, sleeps at once.
- It yields the CPU between polls (``sched_yield``): where cores are oversubscribed (collectors
  stepping environments on every core), a spinning waiter lets the peer it waits for, or any
  other runnable thread, take its core. Measured with a busy process beside a round trip, the
  round trip was as fast as without spinning; spinning without yielding made it 2.6x slower.

``busy_poll=False`` on the nng transport turns it off: every wait sleeps at once.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

#: the longest a single wait spins before it sleeps
WINDOW_S = 500e-6
_YIELD_EVERY = 4  # polls between two sched_yield calls (each poll is a syscall of ~1 us)
_WEIGHT = 0.25  # of the newest wait in the running mean


class BusyPoll:
    """The waiting policy of one transport (shared by its waiting threads: a heuristic, so the
    unlocked updates of its mean and counters may race harmlessly).

    Args:
        enabled: False: never spin.
        window: seconds one wait may spin.
    """

    __slots__ = ("window", "typical", "spun", "found")

    def __init__(self, enabled: bool = True, window: float = WINDOW_S):
        self.window = window if enabled else 0.0
        self.typical = 0.0  # running mean of recent waits, seconds
        self.spun = 0  # waits that spun
        self.found = 0  # waits that found what they waited for while spinning

    def wait(self, probe: Callable[[], Any], block: Callable[[], Any]) -> Any:
        """The result of ``probe()`` (non-blocking: falsy when nothing is there) once it is
        truthy within the spin, else of ``block()`` (the blocking wait)."""
        if not self.window:
            return block()
        return probe() or self._spin_then_block(probe, block)

    def poll(self, poll: Callable[[int], Any], ms: int) -> Any:
        """:meth:`wait` for ``select.poll().poll``: its events within ``ms`` milliseconds."""
        if not self.window:
            return poll(ms)
        return poll(0) or self._spin_then_block(lambda: poll(0), lambda: poll(ms))

    def _spin_then_block(self, probe: Callable[[], Any], block: Callable[[], Any]) -> Any:
        """The wait after a first probe found nothing."""
        start = time.perf_counter()
        if self.typical < self.window:
            self.spun += 1
            until = start + self.window
            polls = 0
            while True:
                polls += 1
                if polls % _YIELD_EVERY == 0:
                    os.sched_yield()
                found = probe()
                now = time.perf_counter()
                if found:
                    self.found += 1
                    self._learn(now - start)
                    return found
                if now >= until:
                    break
        found = block()
        self._learn(time.perf_counter() - start)
        return found

    def _learn(self, waited: float) -> None:
        self.typical += (waited - self.typical) * _WEIGHT
