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
- It does not spin while the machine is crowded: more threads runnable than it has cores at two
  looks in a row (the kernel's count, ``/proc/loadavg``, read at most every :data:`CROWDED_S`), or a yield
  that took long (another thread ran meanwhile: :data:`CROWDED_YIELD_S`) after which the answer
  had not come (so it was not the peer we wait for). A spin then only costs the waiter its turn:
  with two CPU-bound processes beside a round trip on 2 cores, a small round trip took
  0.135 ms p50 spinning and 0.095 ms sleeping at once (raw pynng 0.075 ms; its 90th
  percentile went from ~0.2 ms to ~1.5 ms before spins yielded).

``busy_poll=False`` on the nng transport turns it off: every wait sleeps at once.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

#: the longest a single wait spins before it sleeps
WINDOW_S = 500e-6
#: a sched_yield that took this long gave the core to another thread: the machine is crowded
CROWDED_YIELD_S = 100e-6
#: ... and spinning is off for this long
CROWDED_S = 0.1
_YIELD_EVERY = 4  # polls between two sched_yield calls (each poll is a syscall of ~1 us)
_WEIGHT = 0.25  # of the newest wait in the running mean


class BusyPoll:
    """The waiting policy of one transport (shared by its waiting threads: a heuristic, so the
    unlocked updates of its mean and counters may race harmlessly).

    Args:
        enabled: False: never spin.
        window: seconds one wait may spin.
    """

    __slots__ = ("window", "typical", "spun", "found", "crowded", "_quiet_until", "_look_at", "_yield",
                 "_runnable", "_cores", "_full")

    def __init__(self, enabled: bool = True, window: float = WINDOW_S,
                 yield_: Callable[[], Any] = os.sched_yield, runnable: Callable[[], int] | None = None):
        self.window = window if enabled else 0.0
        self.typical = 0.0  # running mean of recent waits, seconds
        self.spun = 0  # waits that spun
        self.found = 0  # waits that found what they waited for while spinning
        self.crowded = 0  # times spinning was found to cost more than it saves (for CROWDED_S)
        self._quiet_until = 0.0  # no spinning before this (perf_counter): the machine was crowded
        self._look_at = 0.0  # when to look at the machine's run queue again
        self._full = False  # the last look saw more runnable threads than cores
        self._yield = yield_
        self._runnable = runnable or _runnable
        self._cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

    def wait(self, probe: Callable[[], Any], block: Callable[[], Any]) -> Any:
        """The result of ``probe()`` (non-blocking: falsy when nothing is there) once it is
        truthy within the spin, else of ``block()`` (the blocking wait)."""
        if not self.window or time.perf_counter() < self._quiet_until:
            return block()
        return probe() or self._spin_then_block(probe, block)

    def poll(self, poll: Callable[[int], Any], ms: int) -> Any:
        """:meth:`wait` for ``select.poll().poll``: its events within ``ms`` milliseconds."""
        if not self.window or time.perf_counter() < self._quiet_until:  # (crowded: one syscall, not two)
            return poll(ms)
        return poll(0) or self._spin_then_block(lambda: poll(0), lambda: poll(ms))

    def _spin_then_block(self, probe: Callable[[], Any], block: Callable[[], Any]) -> Any:
        """The wait after a first probe found nothing."""
        start = time.perf_counter()
        if self.typical < self.window and start >= self._quiet_until and (start < self._look_at or self._roomy(start)):
            self.spun += 1
            until = start + self.window
            polls = 0
            while True:
                polls += 1
                slow = False
                if polls % _YIELD_EVERY == 0:
                    before = time.perf_counter()
                    self._yield()
                    slow = time.perf_counter() - before > CROWDED_YIELD_S  # another thread had the core
                found = probe()
                now = time.perf_counter()
                if found:
                    self.found += 1
                    self._learn(now - start)
                    return found
                if slow:  # ...and it was not the peer we wait for: the cores are all taken
                    self.crowded += 1
                    self._quiet_until = now + CROWDED_S
                    break
                if now >= until:
                    break
        found = block()
        self._learn(time.perf_counter() - start)
        return found

    def _roomy(self, now: float) -> bool:
        """Whether a core is free for a spin (looked at once per CROWDED_S)."""
        self._look_at = now + CROWDED_S
        full, self._full = self._full, self._runnable() > self._cores  # (ourselves included)
        if full and self._full:  # twice in a row: not a passing thread (a timer, the heartbeat)
            self.crowded += 1
            self._quiet_until = now + CROWDED_S
            return False
        return True

    def _learn(self, waited: float) -> None:
        self.typical += (waited - self.typical) * _WEIGHT


_LOADAVG: list[int] = []  # an open /proc/loadavg (pread: no open per look)


def _runnable() -> int:
    """Threads runnable on this machine now (the kernel's count in /proc/loadavg; 0 where there
    is none: nothing to go by)."""
    try:
        if not _LOADAVG:
            _LOADAVG.append(os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC))
        return int(os.pread(_LOADAVG[0], 128, 0).split()[3].split(b"/")[0])
    except (OSError, IndexError, ValueError):
        return 0
