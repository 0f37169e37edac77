"""pynng sockets nobody closed, closed where they cannot deadlock the process.

Every pynng socket is in a reference cycle (it keeps a cffi handle to itself for NNG's pipe
callbacks), so one that nobody closed is finalized by Python's cycle collector, on whatever
thread happens to run it. That is often NNG's reaper thread, inside a pipe callback (pynng runs
Python there for every socket). Closing a socket that still has pipes waits for the reaper to
remove them: from the reaper itself, that wait never ends, and every later ``nng_close`` in the
process (mq's ``stop()``, a test's ``with`` block) waits behind it. CI hung there for 90 minutes.

Importing this module makes such a socket close on a short-lived thread of its own instead; a
socket closed explicitly (as mq closes all of its own) is left alone by its finalizer.
"""

from __future__ import annotations

import threading

import pynng

_close = pynng.Socket.close


def _closed_explicitly(self: pynng.Socket) -> None:
    self._mq_closed = True
    _close(self)


def _finalize(self: pynng.Socket) -> None:
    if getattr(self, "_mq_closed", False) or not hasattr(self, "_socket"):
        return
    if isinstance(threading.current_thread(), threading._DummyThread):  # a thread NNG started
        try:
            threading.Thread(target=self.close, name="mq-nng-orphan", daemon=True).start()
            return
        except RuntimeError:  # the interpreter is shutting down: no new threads
            pass
    self.close()


if pynng.Socket.__del__ is not _finalize:
    pynng.Socket.close = _closed_explicitly
    pynng.Socket.__del__ = _finalize
