"""Running a planned job (:func:`run_plan`): one spawned process per node of this machine, each
calling ``main(ctx)`` with its open queue, supervised until the job ends (the guarantees are
:mod:`mq.launch`'s)."""

from __future__ import annotations

import atexit
import io
import json
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable, Mapping

from mq.node import waits
from mq.errors import MQError, Timeout
from mq.launch.plan import (ABORT_S, ABORT_TOPIC, ABORTED_STOP_S, EXIT_ABORTED, EXIT_INT, EXIT_TERM, GRACE_S,
                            STOP_S, Context, LaunchError, Plan, describe_abort, describe_exit, make_plan,
                            resolve_main)
from mq.launch.supervise import die_with_parent, stop_processes, stop_signals_raise
from mq.registry import DEFAULT_MQ_TYPE, create

log = logging.getLogger("mq.launch")

# ---------------------------------------------------------------------- running
def launch(main: Callable[[Context], Any] | str, n_workers: int | None = None, mq_type: str = DEFAULT_MQ_TYPE,
           topology: str = "mesh", labels: Any = None, **options: Any) -> None:
    """Run ``main(ctx)`` in spawned worker processes, each with an open queue.

    ``n_workers`` workers locally (default one); under ``platform="slurm"`` the default is one
    worker per Slurm task and a number means that many per host. Options are the fields of
    :class:`LaunchRequest` (the ``mq run`` flags), e.g. ``roles="learner:1,collector:*"``. Returns
    when every worker returned.

    Raises:
        ConfigError: a bad option (nothing was started).
        LaunchError: a worker failed (here or, through ``_mq.abort``, on another host) or the
            launcher got SIGTERM; the workers were stopped.
    """
    run_plan(make_plan(main, n_workers=n_workers, mq_type=mq_type, topology=topology,
                       labels=labels, **options))


#: A worker's exit status -> the stop signal it says the worker ended by: the code its own
#: handler exits with, or the signal itself when it came before the handler was installed.
_STOPPED_BY = {EXIT_INT: signal.SIGINT, -signal.SIGINT: signal.SIGINT,
               EXIT_TERM: signal.SIGTERM, -signal.SIGTERM: signal.SIGTERM}


class _JobStopped(BaseException):
    """A stop signal reached the job: SIGTERM at the launcher (scancel, kubelet), or a signal a
    worker ended by before the launcher handled it (``seen``: which worker, how)."""

    def __init__(self, signum: int, seen: str = ""):
        super().__init__(signum)
        self.signum, self.seen = signum, seen

    def error(self) -> LaunchError:
        via = f" ({self.seen})" if self.seen else ""
        return LaunchError({}, reason=f"stopped by {signal.Signals(self.signum).name}{via}; every worker "
                           "was told to stop and say goodbye", exit_code=128 + self.signum)


def _pass_job_secret(plan: Plan) -> None:
    """Resolve the job secret once (MQ_SECRET, else the per-user file) and give it to every
    worker through MQ_SECRET: they prove the same secret and never race to create the file."""
    from mq import auth

    if os.environ.get(auth.ENV_VAR) or any("secret" in o or o.get("insecure") for o in plan.options.values()):
        return
    os.environ[auth.ENV_VAR] = auth.resolve_secret().key.decode()


def run_plan(plan: Plan, *, deadline_s: float | None = None) -> None:
    """Start the plan's workers and supervise them; ``deadline_s`` bounds the whole job."""
    from mq import locality

    # Set before any worker (and any verbs library in it) starts: spawn copies the environment.
    from mq.datapaths.rdma import forksafe
    os.environ.update({k: v for k, v in forksafe.fork_safe_env(os.environ, locality.local()).items()
                       if k in forksafe.FORK_SAFE_ENV})
    _pass_job_secret(plan)
    ctx = mp.get_context("spawn")
    # worker -> launcher: the abort that stopped it (a pipe read without waiting: never blocks)
    reports, report_to = ctx.Pipe(duplex=False)
    announce = ctx.Array("c", 4096)  # launcher -> workers: a failure they must tell the job about
    procs: dict[int, Any] = {}
    # SIGTERM (scancel, kubelet) stops the workers gracefully instead of killing the launcher
    # at once (and them by SIGKILL); a second one must not break off that stop.
    with stop_signals_raise(_JobStopped) as stopping:
        try:
            for i, n in enumerate(plan.node_ids):
                if i and plan.startup_interval:
                    waits.sleep(plan.startup_interval)
                p = ctx.Process(target=_worker, args=(plan, n, report_to, announce), name=f"mq-node-{n}",
                                daemon=False)
                p.start()
                procs[n] = p
            failures, aborted_by = _supervise(plan, procs, deadline_s, reports, announce)
        except (_JobStopped, KeyboardInterrupt) as stop:
            # scancel signals one process at a time: the launcher's own SIGTERM may come while
            # it stops the workers, and must not break that off.
            stopping.set()
            _stop_all(procs)
            if isinstance(stop, KeyboardInterrupt):
                raise
            raise stop.error() from None
    if failures:
        raise LaunchError(failures, aborted_by=aborted_by)
    if aborted_by:
        raise LaunchError({}, aborted_by=aborted_by)


def _supervise(plan: Plan, procs: dict[int, Any], deadline_s: float | None, reports: Any,
               announce: Any) -> tuple[dict[int, int], dict[str, Any] | None]:
    failures: dict[int, int] = {}
    aborted_by: dict[str, Any] | None = None
    deadline = time.monotonic() + deadline_s if deadline_s else None
    while True:
        if deadline is not None and time.monotonic() > deadline:
            _stop_all(procs)
            raise Timeout(f"the job did not finish within {deadline_s:g}s; its workers were stopped")
        running = aborted = False
        for n, p in procs.items():
            code = p.exitcode
            if code is None:
                running = True
            elif code in _STOPPED_BY:
                # Ctrl-C and scancel signal the launcher and its workers at once, in no order; a
                # launcher that ignores SIGINT (a shell's background job) never sees it, and one
                # cannot ask the kernel afterwards (Python's handler consumed the signal). The
                # worker's exit status is the evidence that cannot race, so it decides: a worker
                # ended by a stop signal (or exiting 130/143, which says the same) stops the job.
                raise _JobStopped(_STOPPED_BY[code], f"node {n} exited with {describe_exit(code)}")
            elif code == EXIT_ABORTED:
                aborted = True
            elif code != 0 and n not in failures:
                failures[n] = code
        if failures or aborted:
            if any(code < 0 for code in failures.values()):
                # A worker killed by a signal told nobody: its siblings tell the job for it.
                n, code = next((n, c) for n, c in sorted(failures.items()) if c < 0)
                _announce(plan, procs, announce, {"node": n, "host": plan.hosts.get(n) or socket.gethostname(),
                                                  "error": f"its process exited with {describe_exit(code)}"})
            _stop_all(procs)
            while reports.poll(0):  # an aborted worker reported why before it exited
                report = reports.recv()
                aborted_by = aborted_by or report
            stopped = (0, None, EXIT_ABORTED, -signal.SIGKILL, *_STOPPED_BY)
            for n, p in procs.items():  # the ones we had to stop are not failures of their own
                if n not in failures and p.exitcode not in stopped:
                    failures[n] = p.exitcode
            return failures, None if failures else (aborted_by or {"error": "another node failed"})
        if not running:
            return failures, None
        waits.sleep(0.05)  # (children's exits are polled: nothing wakes this thread)


def _announce(plan: Plan, procs: dict[int, Any], announce: Any, info: dict[str, Any]) -> None:
    data = json.dumps(info).encode()[: len(announce) - 1]
    announce.value = data
    for p in procs.values():
        if p.exitcode is None and p.pid:
            try:
                os.kill(p.pid, signal.SIGUSR2)
            except ProcessLookupError:
                pass


def _stop_all(procs: dict[int, Any]) -> None:
    stop_processes(procs.values(), GRACE_S)


# ---------------------------------------------------------------------- the worker process
class _Stop(BaseException):
    """Raised in a worker's main thread to end ``main``: a signal or another node's failure."""

    def __init__(self, code: int, why: str):
        super().__init__(why)
        self.code = code


#: Signals a worker turns into a stop of its main: launcher/scheduler stops and aborts.
_JOB_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


class _WorkerState:
    """What a worker's signal and abort handlers share with its main thread."""

    def __init__(self) -> None:
        self.stopping = False  # main has ended: handlers must not raise into the cleanup
        self.aborted_by: dict[str, Any] | None = None
        self.tell_peers: dict[str, Any] | None = None  # a failure this worker must announce
        self.relay = False


class _LinePrefix(io.TextIOBase):
    """A worker's stdout or stderr: each line starts with its node (``[node 3] ``) and is written
    whole, so the lines of a job's workers say whose they are and never run together. A partial
    line waits for its end, or for an explicit ``flush()`` (a progress line)."""

    def __init__(self, stream: Any, prefix: str):
        self._stream, self._prefix = stream, prefix
        self._pending = ""
        self._at_start = True
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self._lock:
            self._pending += text
            if "\n" in self._pending:
                whole, _, self._pending = self._pending.rpartition("\n")
                self._emit(whole + "\n")
        return len(text)

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                self._emit(self._pending)
                self._pending = ""
            self._stream.flush()

    def _emit(self, text: str) -> None:
        out = []
        for line in text.splitlines(keepends=True):
            out.append(self._prefix + line if self._at_start else line)
            self._at_start = line.endswith("\n")
        self._stream.write("".join(out))
        self._stream.flush()

    def fileno(self) -> int:
        return self._stream.fileno()


def _worker(plan: Plan, node_id: int, reports: Any, announce: Any) -> None:
    # The kernel stops this worker when the launcher dies, so no orphan survives it. SIGTERM,
    # not SIGKILL: the worker then says goodbye and removes its socket file even when the
    # launcher was SIGKILLed; a worker that cannot stop kills itself after GRACE_S.
    die_with_parent(signal.SIGTERM, exit_if_orphaned=True)
    if plan.prefix_output:
        sys.stdout = _LinePrefix(sys.stdout, f"[node {node_id}] ")
        sys.stderr = _LinePrefix(sys.stderr, f"[node {node_id}] ")
    logging.basicConfig(level=plan.log_level.upper(),
                        format=f"%(asctime)s node{node_id} %(name)s %(levelname)s: %(message)s")
    state = _WorkerState()
    main_ident = threading.main_thread().ident
    assert main_ident is not None  # the main thread runs this: it has an ident

    def on_signal(signum: int, frame: Any) -> None:
        if state.stopping:
            return
        state.stopping = True  # raise once: a second pending signal must not hit the cleanup
        if signum == signal.SIGUSR1:
            raise _Stop(EXIT_ABORTED, "another node failed")
        if signum == signal.SIGUSR2:  # the launcher: a sibling died without telling anyone
            try:
                state.tell_peers = json.loads(announce.value.decode() or "{}")
            except ValueError:
                state.tell_peers = {"node": "?", "error": "a worker on this host failed"}
            raise _Stop(EXIT_ABORTED, "a worker on this host failed")
        raise _Stop(EXIT_TERM if signum == signal.SIGTERM else EXIT_INT, signal.Signals(signum).name)

    def on_abort(msg: Any) -> None:  # runs on a handler thread of the queue
        if state.stopping or state.aborted_by is not None:
            return
        info = msg.payload if isinstance(msg.payload, dict) else {}
        state.aborted_by = {"node": info.get("node", msg.sender), "host": info.get("host", ""),
                            "error": str(info.get("error", "failed"))}
        state.relay = plan.relay_abort
        signal.pthread_kill(main_ident, signal.SIGUSR1)  # wakes main even in a blocking call

    for signum in _JOB_SIGNALS:
        signal.signal(signum, on_signal)
    _wake_main_on_signals(state, main_ident)
    code, q = 1, None
    try:
        fn = resolve_main(plan.main, plan.package)
        labels = plan.labels.get(node_id, [])
        q = create(plan.mq_type, node_id, labels, **plan.options[node_id])
        from mq import telemetry

        telemetry.serve(q)  # every launched node answers `mq top`
        q.listen()
        if node_id == min(plan.node_ids) and "tcp" in q.addresses:  # once per launch: where to watch the job
            (sys.__stderr__ or sys.stderr).write(  # the launcher's line, not the worker's: no prefix
                f"mq run: node {node_id} listens on {q.addresses['tcp']}; watch the job with "
                f"mq top --attach-to {q.addresses['tcp']}\n")
        q.subscribe(ABORT_TOPIC, on_abort)
        fn(Context(node_id, frozenset(labels), q, plan.mq_type, plan.world_size,
                   list(plan.node_ids), dict(plan.args)))
        code = 0
    except _Stop as stop:
        state.stopping = True
        code = stop.code
    except KeyboardInterrupt:
        state.stopping = True
        code = EXIT_INT
    except SystemExit as exc:
        state.stopping = True
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:
        state.stopping = True
        sys.stderr.write(f"mq: node {node_id} failed:\n{traceback.format_exc()}")
        code = 1
        if state.aborted_by is None:  # else it failed because the job was going down anyway
            state.tell_peers = {"node": node_id, "host": plan.hosts.get(node_id) or socket.gethostname(),
                                "error": f"{type(exc).__name__}: {exc}"[:500]}
    state.stopping = True
    if state.aborted_by is not None and state.tell_peers is None:
        code = EXIT_ABORTED
        reports.send(state.aborted_by)
        sys.stderr.write(f"mq: node {node_id} stopped: {describe_abort(state.aborted_by)}\n")
    _finish(q, state, node_id, code)


def _wake_main_on_signals(state: _WorkerState, main_ident: int | None) -> None:
    """Make a stop signal interrupt the main thread wherever the kernel delivered it.

    Python runs signal handlers in the main thread only, and only when it runs bytecode. A
    signal that lands on another thread (numpy's, nng's, torch's: gVisor, for one, picks any
    thread) would leave ``main`` asleep in a blocking call. The C-level handler still writes
    the signal number to the wakeup fd, so a watcher thread pokes the main thread with a
    no-op SIGURG, whose EINTR makes it run the pending handler at once. The watcher also
    bounds the stop: GRACE_S after the first stop signal the process kills itself.
    """
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    signal.signal(signal.SIGURG, lambda *_: None)
    wanted = {int(s) for s in _JOB_SIGNALS}

    def watch() -> None:
        armed = False
        while True:
            data = os.read(r, 64)
            if not wanted.intersection(data):
                continue
            if not armed:  # however stuck main is, a stop signal ends the process in GRACE_S
                armed = True
                timer = threading.Timer(GRACE_S, os.kill, (os.getpid(), signal.SIGKILL))
                timer.daemon = True
                timer.start()
            if not state.stopping and main_ident is not None:
                signal.pthread_kill(main_ident, signal.SIGURG)

    threading.Thread(target=watch, daemon=True, name="mq-signals").start()


def _finish(q: Any, state: _WorkerState, node_id: int, code: int) -> None:
    """Tell the peers if needed, stop the queue within a bound, and exit now: threads stuck in
    a user's handler must not keep a finished worker alive."""

    def stop() -> None:
        if q is None:
            return
        try:
            if state.tell_peers is not None:
                _tell_peers(q, state.tell_peers, skip=set())
            elif state.relay and state.aborted_by is not None:
                _tell_peers(q, state.aborted_by, skip={state.aborted_by["node"]})
            aborting = state.tell_peers is not None or state.aborted_by is not None
            q.stop(timeout=ABORTED_STOP_S if aborting else STOP_S)
        except Exception:
            log.exception("node %d: error while stopping the queue", node_id)

    for signum in _JOB_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    stopper = threading.Thread(target=stop, daemon=True, name=f"mq{node_id}-stop")
    stopper.start()
    waits.join(stopper, ABORT_S + STOP_S + 1.0)
    # The user's atexit hooks (checkpoints, TensorBoard writers) still run; what os._exit skips
    # is the interpreter's join of non-daemon threads, which a stuck handler would hang forever.
    try:
        atexit._run_exitfuncs()
        logging.shutdown()
    except Exception:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def _tell_peers(q: Any, info: Mapping[str, Any], skip: set[Any]) -> None:
    """Send the abort to every peer, within ABORT_S in all (a dead peer costs at most 1 s)."""
    deadline = time.monotonic() + ABORT_S
    for peer in q.peers():
        left = deadline - time.monotonic()
        if peer in skip or left <= 0:
            continue
        try:
            q.send(peer, ABORT_TOPIC, dict(info), timeout=min(1.0, left))
        except MQError as exc:
            log.debug("node %d: could not tell node %d to stop: %s", q.node_id, peer, exc)
