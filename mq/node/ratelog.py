"""Logging what strangers and faulty peers send, without letting them flood the log.

A node under a flood of hostile frames logged a WARNING with a traceback per frame: 110,401
lines (14.6 MB) in one test. :class:`RateLimitedLog` logs the first few events as they come,
then at most one summary line per period with the counts by cause since the last line.
"""

from __future__ import annotations

import logging
import threading
import time


class RateLimitedLog:
    """``log(cause, message)``: the first ``burst`` messages, then a summary every ``period`` s.

    Args:
        logger: where lines go (at WARNING).
        what: names the events in a summary line ("node 3: refused or dropped").
        burst: messages logged as they come before summaries take over.
        period: seconds between summary lines.
    """

    def __init__(self, logger: logging.Logger, what: str, burst: int = 5, period: float = 10.0):
        self._logger = logger
        self._what = what
        self._burst = burst
        self._period = period
        self._lock = threading.Lock()
        self._logged = 0
        self._held: dict[str, int] = {}  # causes not logged since the last line
        self._last = 0.0

    def __call__(self, cause: str, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            if self._logged < self._burst:
                self._logged += 1
                self._last = now
                line = message + ("" if self._logged < self._burst else
                                  f" (more are summarised every {self._period:g}s)")
            else:
                self._held[cause] = self._held.get(cause, 0) + 1
                if now - self._last < self._period:
                    return
                held, self._held, self._last = self._held, {}, now
                line = (f"{self._what}: {sum(held.values())} more since the last line, by cause {held}; "
                        f"latest: {message}")
        self._logger.warning("%s", line)
