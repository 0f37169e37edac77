"""Background load: N CPU-bound processes at normal priority, as an RL machine has (collectors
stepping environments on every core). The tests run their liveness checks under it, and
``mq bench --background-load N`` measures beside it: busy-polling and thread hand-offs must be
judged where RL runs them, not on an idle machine.

    with BackgroundLoad(2):
        ...  # every core busy

Each process spins in pure Python (the GIL of its own interpreter, so a real core each) until
the context exits; they are killed, never left behind, also when the body raises.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any


def _spin(stop_at: float) -> None:
    # A bound even if our parent dies without killing us (SIGKILL of the test runner).
    x = 0
    while time.monotonic() < stop_at:
        for _ in range(100_000):
            x += 1
        if os.getppid() == 1:
            return


class BackgroundLoad:
    """``n`` CPU-bound processes for the life of the ``with`` block (at most ``max_s`` s)."""

    def __init__(self, n: int, max_s: float = 3600.0):
        if type(n) is not int or n < 0:
            raise ValueError(f"background load must be a number of processes >= 0, got {n!r}")
        self.n = n
        self.max_s = max_s
        self._procs: list[Any] = []

    def __enter__(self) -> "BackgroundLoad":
        ctx = mp.get_context("spawn")  # no copy of the caller's threads or sockets
        stop_at = time.monotonic() + self.max_s  # CLOCK_MONOTONIC is system-wide on Linux
        for i in range(self.n):
            p = ctx.Process(target=_spin, args=(stop_at,), daemon=True, name=f"mq-load-{i}")
            p.start()
            self._procs.append(p)
        time.sleep(0.5 if self.n else 0)  # a load that died at start (a spawn error) is no load
        dead = [p for p in self._procs if not p.is_alive()]
        if dead:
            self.__exit__()
            raise RuntimeError(f"{len(dead)} of {self.n} background load processes died at start (exit codes "
                               f"{[p.exitcode for p in dead]}): run BackgroundLoad under `if __name__ == '__main__':`")
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in self._procs:
            p.kill()
        for p in self._procs:
            p.join(5)
        self._procs.clear()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]
