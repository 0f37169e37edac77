"""A DI-engine worker on mq (node 0 of two, in DI-engine's worker pool) forks a child as DI-engine's ``Supervisor`` does (``StorageLoader``)
and stops it with ``terminate()``: ``python -m tests.ding_jobs.forked_child <mq type>`` prints
``CHILD exitcode=<code>``. The child catches every exception, as ``Supervisor``'s child loop does,
so it ends only if SIGTERM's default action reaches it rather than the worker pool's handler
(which raises into the child)."""

import sys
import time

import mq.integrations.ding  # noqa: F401
from ding.framework import Parallel
from ding.framework.supervisor import get_mp_ctx


def _child_loop() -> None:
    while True:
        try:
            time.sleep(0.05)
        except Exception:  # noqa: BLE001  (Supervisor's child: log and go on)
            pass


def main() -> None:
    if Parallel().node_id != 0:
        return
    child = get_mp_ctx().Process(target=_child_loop, daemon=True)
    child.start()
    time.sleep(0.5)
    child.terminate()
    child.join(10)
    print(f"CHILD exitcode={child.exitcode}", flush=True)
    if child.is_alive():
        child.kill()
        child.join()


if __name__ == "__main__":
    Parallel.runner(n_parallel_workers=2, mq_type=sys.argv[1])(main)
