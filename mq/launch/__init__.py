"""Launch a job's workers on this machine: one spawned process per node, each calling
``main(ctx)`` with its open message queue.

Guarantees:

* A worker that raises prints its traceback, tells every peer of the job to stop (the
  reserved topic ``_mq.abort``, sent with the public ``MQ.send``), stops its queue within a
  bound and exits at once, even if a handler thread is stuck. Workers that get ``_mq.abort``
  stop their main and exit with :data:`EXIT_ABORTED`, so a failure on one host ends the job
  on every host within seconds, with no scheduler option such as ``--kill-on-bad-exit``.
* The launcher then stops its other workers (SIGTERM, SIGKILL after :data:`GRACE_S`, which
  is longer than ``stop()``'s default 5 s) and fails with a line naming the failed node.
* SIGTERM (scancel, kubelet) and Ctrl-C are graceful stops: every worker says goodbye
  through ``stop()``; the launcher removes the unix socket file of any worker that could not
  (SIGKILL), so nothing is left in the temp directory. A worker that ended by SIGINT or
  SIGTERM (exit 130 or 143) stops the job the same way, with the same exit code, whether or
  not the launcher has seen the signal yet: Ctrl-C and scancel reach every process at once.
* Workers die with the launcher (PR_SET_PDEATHSIG), so none is left behind as an orphan.

Planning (:func:`make_plan`) checks a :class:`LaunchRequest` and asks the backend's launch
profile (``Backend.launch``, :class:`mq.backend.LaunchProfile`) for each worker's options, locally or from a platform's
plan (:mod:`mq.platforms`); running (:func:`run_plan`) spawns and supervises the workers with
:mod:`mq.launch.supervise`.
"""

from mq.launch.plan import (  # noqa: F401 (the package is the API)
    ABORT_S, ABORT_TOPIC, ABORTED_STOP_S, EXIT_ABORTED, EXIT_INT, EXIT_TERM, GRACE_S, STOP_S, Context,
    LaunchError, LaunchRequest, Plan, checked_flags, describe_abort, free_port, main_ref, make_plan,
    parse_labels, resolve_main,
)
from mq.launch.run import launch, run_plan  # noqa: F401
