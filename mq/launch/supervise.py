"""Process supervision shared by the launcher (:mod:`mq.launch`) and the tools (``mq bench``,
:mod:`mq.tools.netns`): children that die with their parent, stop signals turned into
exceptions so ``finally`` blocks run, and stopping a set of processes within a bound.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import threading
import time
from typing import Any, Callable, Iterable, Iterator

from mq.node import waits

__all__ = ["die_with_parent", "stop_processes", "stop_signals_raise"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int = signal.SIGKILL, *, exit_if_orphaned: bool = False) -> None:
    """Linux: the kernel sends this process ``signum`` when its parent dies, so no orphan
    survives it. Usable as a ``preexec_fn``; elsewhere than Linux a no-op.

    ``exit_if_orphaned``: exit at once when the parent already died before the call took
    effect (this process was reparented). The parent is the one ``multiprocessing`` started
    this process from, when it did; else any parent but init (pid 1). (A launcher that is
    itself pid 1, as ``mq run`` as a container's first process, keeps its workers.)
    """
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if exit_if_orphaned:
            parent = multiprocessing.parent_process()
            expected = parent.pid if parent is not None else None
            if (os.getppid() != expected) if expected is not None else os.getppid() == 1:
                os._exit(1)


@contextlib.contextmanager
def stop_signals_raise(error: Callable[[int], BaseException],
                       signals: Iterable[int] = (signal.SIGTERM,), *,
                       sigint_raises: bool = False) -> Iterator[waits.Flag]:
    """While the block runs, the first of ``signals`` raises ``error(signum)`` in the main
    thread, so the caller stops its children gracefully instead of dying at once; later ones
    are ignored, so they cannot break off that stop. Set the event it yields when stopping for
    another reason: the signals are then ignored too. ``sigint_raises``: Ctrl-C raises
    KeyboardInterrupt even where SIGINT was ignored (a shell's background job). Only in the
    main thread; elsewhere the block runs unchanged."""
    stopping = waits.Flag()
    if threading.current_thread() is not threading.main_thread():
        yield stopping
        return

    def on_signal(signum: int, _frame: Any) -> None:
        if not stopping.is_set():
            stopping.set()
            raise error(signum)

    old = {}
    for sig in signals:
        with contextlib.suppress(ValueError, OSError):
            old[sig] = signal.signal(sig, on_signal)
    if sigint_raises and signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
        old[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield stopping
    finally:
        for sig, handler in old.items():
            with contextlib.suppress(ValueError, OSError):
                signal.signal(sig, handler)


def stop_processes(procs: Iterable[Any], grace_s: float) -> None:
    """SIGTERM every running process (``multiprocessing.Process``), give them ``grace_s`` in
    all to exit, then SIGKILL the rest. ``grace_s`` 0: SIGKILL at once."""
    procs = list(procs)
    if grace_s > 0:
        for p in procs:
            if p.exitcode is None:
                p.terminate()
        deadline = time.monotonic() + grace_s
        for p in procs:
            waits.join(p, deadline - time.monotonic())
    for p in procs:
        if p.exitcode is None:
            p.kill()
            waits.join(p, 1.0)

