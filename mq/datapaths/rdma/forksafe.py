"""Fork safety for RDMA.

Memory registered with an RDMA device is pinned, and after ``fork()`` the kernel's
copy-on-write can hand the parent a fresh page the NIC does not know about: transfers then
silently read or write the wrong memory. libibverbs avoids this (``ibv_fork_init()``, marking
registered ranges ``MADV_DONTFORK``) only when ``IBV_FORK_SAFE`` or ``RDMAV_FORK_SAFE`` is in
the environment *before* the verbs library initialises, which in a Python worker means before
torch/TensorPipe loads. Hence:

* the launcher builds every worker's environment with :func:`fork_safe_env` when RDMA may be
  used on this node;
* a backend that opens RDMA resources calls :func:`mark_rdma_started`, and
  :func:`install_fork_warning` makes any later ``fork()`` log a warning naming the fix;
* ``mq doctor`` reports :func:`state`.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from typing import Any, Mapping

from mq.locality import FORK_SAFE_VARS, Locality, local

__all__ = [
    "FORK_SAFE_ENV",
    "fork_safe_env",
    "install_fork_warning",
    "mark_rdma_started",
    "rdma_may_be_used",
    "state",
]

FORK_SAFE_ENV: Mapping[str, str] = {"IBV_FORK_SAFE": "1", "RDMAV_FORK_SAFE": "1"}

logger = logging.getLogger("mq")

_lock = threading.Lock()
_rdma_started: str | None = None  # what started RDMA, for the warning
_warning_installed = False


def rdma_may_be_used(locality: Locality | None = None) -> bool:
    """True when this node has an ACTIVE RDMA port (a DOWN-only HCA cannot carry traffic)."""
    loc = local() if locality is None else locality
    return bool(loc.active_rdma_ports())


def fork_safe_env(environ: Mapping[str, str], locality: Locality | None = None) -> dict[str, str]:
    """A copy of ``environ`` with the fork-safety variables set when RDMA may be used.

    Apply it to every worker's environment before the worker starts: setting the variables
    inside a running process is too late once libibverbs has initialised. A value the user
    already set is kept (libibverbs only checks that the variable exists).

    Args:
        environ: the environment to start from (not modified).
        locality: this node's descriptor; :func:`mq.locality.local` when None.
    """
    env = dict(environ)
    if rdma_may_be_used(locality):
        for key, value in FORK_SAFE_ENV.items():
            env.setdefault(key, value)
    return env


def mark_rdma_started(what: str = "RDMA") -> None:
    """Record that this process opened RDMA resources (call it from the backend that does)."""
    global _rdma_started
    with _lock:
        if _rdma_started is None:
            _rdma_started = what


def _fork_message(environ: Mapping[str, str]) -> str:
    if any(k in environ for k in FORK_SAFE_VARS):
        risk = (
            "the fork-safety variables are set, so the parent's registered memory stays intact, "
            "but the child must not use the parent's RDMA connections"
        )
    else:
        risk = (
            "IBV_FORK_SAFE/RDMAV_FORK_SAFE were not set, so copy-on-write may silently corrupt "
            "memory registered with the NIC"
        )
    return (
        f"mq: process {os.getppid()} forked (child pid {os.getpid()}) after {_rdma_started} "
        f"started: {risk}. Fix: start workers with the 'spawn' start method "
        f"(multiprocessing.set_start_method('spawn')) or `mq run`, and set IBV_FORK_SAFE=1 "
        f"RDMAV_FORK_SAFE=1 in the environment before the process starts."
    )


def _after_fork_in_child() -> None:
    if _rdma_started is not None:
        logger.warning(_fork_message(os.environ))


def install_fork_warning() -> None:
    """Log a warning in any child forked after :func:`mark_rdma_started`. Idempotent.

    ``os.register_at_fork`` hooks cannot be removed, so this installs one hook per process
    and the hook checks the flag at fork time.
    """
    global _warning_installed
    with _lock:
        if _warning_installed:
            return
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _warning_installed = True


def state(locality: Locality | None = None, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Fork-safety facts for ``mq doctor``; plain JSON-safe values.

    Keys: ``env`` (each variable's value or None), ``fork_safe`` (either variable present),
    ``rdma_may_be_used``, ``rdma_started``, ``fork_warning_installed``, ``start_method``
    (multiprocessing's, None when not chosen yet), ``ok`` and ``advice`` (None when ok).
    """
    env = os.environ if environ is None else environ
    may = rdma_may_be_used(locality)
    fork_safe = any(k in env for k in FORK_SAFE_VARS)
    ok = fork_safe or not may
    return {
        "env": {k: env.get(k) for k in FORK_SAFE_VARS},
        "fork_safe": fork_safe,
        "rdma_may_be_used": may,
        "rdma_started": _rdma_started is not None,
        "fork_warning_installed": _warning_installed,
        "start_method": multiprocessing.get_start_method(allow_none=True),
        "ok": ok,
        "advice": None
        if ok
        else "an ACTIVE RDMA port is present: set IBV_FORK_SAFE=1 RDMAV_FORK_SAFE=1 before "
        "starting workers (mq run does), or use the 'spawn' start method",
    }
