"""DI-engine on mq: a message queue for ``ding.framework.Parallel`` and ``ditask``.

Importing this module (once, in the module that holds your main function) does two things:

1. It registers ``mq:nng``, ``mq:torchrpc:cpu`` and ``mq:torchrpc:cuda`` in DI-engine's
   ``ding.utils.MQ_REGISTRY``: classes with DI-engine's six-method MQ interface (``listen``,
   ``publish(topic, bytes)``, ``subscribe``, ``unsubscribe``, ``recv() -> (topic, bytes)``,
   ``stop``) over one :class:`mq.MQ` per worker (``mq.create`` with the type after ``mq:``).
2. It wraps ``Parallel.runner`` (the one monkeypatch, in memory; nothing on disk). DI-engine's
   ``runner`` looks the per-worker argument builder up in a dict it creates on every call
   (``{"nng": ..., "redis": ...}``), so a new mq type cannot be added to it from outside. The
   wrapper calls DI-engine's own ``runner`` unchanged and, for an mq type starting with
   ``mq:`` only, adds :func:`_args_parser` to that dict (the ``args_parsers`` variable of the
   ``_runner`` closure that ``runner`` returns). Everything else (the spawned worker pool,
   ``_subprocess_runner``, ``_run``, auto recover, the listener thread) stays DI-engine's.
   Other mq types (``nng``, ``redis``) are untouched.

:func:`_args_parser` turns DI-engine's arguments (``n_parallel_workers``, ``node_ids``,
``protocol``, ``address``, ``ports``, ``attach_to``, ``topology``, ``labels``) into each worker's
``mq.create`` options with mq's own launch profiles (``Backend.launch``, as ``mq run``
does): nng workers listen on ``tcp://address:port`` and dial their topology's peers (plus
``attach_to``); torch RPC workers meet in a rendezvous store on this host (one host), or at
``env://`` (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``) when the job spans hosts.

Events reach every peer, as on DI-engine's own bus (its ``Bus0`` sends each event to every
peer, and the receiver keeps those it listens to), not only the peers whose subscriptions are
known yet: a subscription made a moment after a peer's first ``emit`` must not lose that event.
DI-engine's own bus drops an event that arrives before its listener is registered (a collector
that starts first and emits its first context before the learner's ``ContextExchanger``
subscribes: the learner then waits forever). Here such an event is held for
:data:`HOLD_S` (at most :data:`HOLD_MAX` per topic) and handed over once the topic is
subscribed; what expires unheard is counted (``metrics()["ding_expired"]``) and logged once.
A worker's queue listens and waits (up to :data:`JOIN_WAIT_S`) for the peers of its topology to
join when ``Parallel._run`` builds it, before ``main`` starts: DI-engine then sleeps 0.3 s
"waiting for network pairing" and starts ``main``, so workers whose processes started seconds
apart (spawn and imports on a loaded host) begin ``main`` together, and an early event does not
miss a peer still starting. DI-engine's later ``listen`` call (on its listener thread) finds the
queue listening.

DI-engine pickles its events into bytes; mq carries those bytes and unpickles nothing. ``recv``
waits in slices of :data:`RECV_SLICE_S` and returns None once ``stop`` was called, so the
listener thread ends; ``stop`` returns within :data:`STOP_TIMEOUT_S` (plus a little) even when
peers died; a dead or stuck peer makes ``publish`` log a warning, never hang or raise into
``main`` (DI-engine's bus drops too).

A worker spec (:class:`WorkerSpec`) is an instance of a class of this module, so unpickling it
in a spawned worker imports this module (and registers the types) even when the user's main
module does not import it at top level.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import mq
from mq.node.waits import Flag
from mq import auth
from mq.errors import ClosedError, ConfigError, MQError, PeerLost, Timeout
from mq.backend import LocalJob
from mq.launch import free_port
from mq.registry import check_mq_type, launchable_mq_types, profile_for
from mq.rendezvous import attach_targets

from ding.framework.message_queue.mq import MQ as DingMQ
from ding.framework.parallel import Parallel
from ding.utils import MQ_REGISTRY

__all__ = ["MQ_TYPES", "PREFIX", "MQOnDing", "WorkerSpec", "set_options", "cli"]

log = logging.getLogger("mq.integrations.ding")

PREFIX = "mq:"
#: DI-engine mq type -> mq type.
MQ_TYPES = {PREFIX + t: t for t in launchable_mq_types()}
#: How long one wait of ``recv`` lasts before it checks for ``stop``.
RECV_SLICE_S = 0.1
#: ``stop``'s bound: goodbyes and the transport's close.
STOP_TIMEOUT_S = 5.0
#: How long an event for a topic nobody here listens to yet is held for a late subscriber.
HOLD_S = 30.0
#: Events held per topic (the oldest go first).
HOLD_MAX = 256
#: After a late subscription, held events are handed over this much later: DI-engine's
#: ``router.on`` subscribes first and registers its handler just after.
HANDOVER_DELAY_S = 0.2
#: How long building a worker's queue waits for the topology's peers to join (``main`` waits).
JOIN_WAIT_S = 30.0
#: DI-engine's default base port for ``protocol="tcp"`` (``Parallel.get_node_addrs``).
DING_BASE_PORT = 50515

_extra_options: dict[str, Any] = {}


def set_options(**options: Any) -> None:
    """Extra ``mq.create`` options for every worker a later ``Parallel.runner`` starts from
    this process (e.g. ``busy_poll=False``, ``timeout=60``, ``secret=...``)."""
    _extra_options.clear()
    _extra_options.update(options)


@dataclass(frozen=True)
class WorkerSpec:
    """One worker's queue: what ``Parallel._run`` hands the registered class."""

    mq_type: str  # mq's own type: nng, torchrpc:cpu, torchrpc:cuda
    node_id: int
    labels: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    attach_to: tuple[str, ...] = ()  # the peers it dials, for DI-engine's Barrier (``get_attch_to_len``)
    peers: tuple[int, ...] = ()  # the job's nodes it talks to (dials or is dialed by)


class MQOnDing(DingMQ):
    """DI-engine's MQ interface over one :class:`mq.MQ`.

    Built by ``Parallel._run`` in the worker's main thread: ``mq.create`` (bad options fail
    there), ``listen`` and the wait for the topology's peers (module docstring), all before
    ``main``. DI-engine's listener thread then calls ``listen`` (already done) and loops on
    ``recv``.
    """

    def __init__(self, mq_spec: WorkerSpec, **_ignored: Any) -> None:
        self.spec = mq_spec
        self.attach_to = list(mq_spec.attach_to)
        self.q = mq.create(mq_spec.mq_type, node_id=mq_spec.node_id, labels=set(mq_spec.labels),
                           **mq_spec.options)
        self._stopped = Flag()
        self._held = _HeldEvents()
        self._warned: set[str] = set()
        _children_take_their_stop_signal()
        # Parallel._run imports DI-engine's middleware (about 1 s, seconds on a loaded host)
        # between building this queue and main: imported here, before the pairing, that time
        # does not come between the paired workers' mains.
        importlib.import_module("ding.framework.middleware.barrier")
        self._pair()

    def _pair(self) -> None:
        """Listen and wait for the topology's peers; a queue that cannot listen is stopped and
        the error ends the worker (DI-engine's pool re-raises it in the parent)."""
        try:
            self.q.listen()
        except BaseException:
            self.q.stop(timeout=STOP_TIMEOUT_S, raise_undelivered=False)
            raise
        if self.spec.peers:
            try:
                self.q.wait_for_peers(ids=list(self.spec.peers), timeout=JOIN_WAIT_S)
            except Timeout as exc:
                log.warning("node %d: %s; events go to the peers that joined", self.spec.node_id, exc)

    # ------------------------------------------------------------------ DI-engine's interface
    def listen(self) -> None:
        """Already listening (the queue listened when it was built)."""

    def publish(self, topic: str, data: bytes) -> None:
        if self._stopped.is_set():
            return
        for peer in self.q.peers():  # every peer, as DI-engine's bus (module docstring)
            try:
                self.q.send(peer, topic, data)
            except (PeerLost, Timeout) as exc:  # DI-engine's emit is fire and forget: say so, go on
                self._warn(f"publish:{type(exc).__name__}", "node %d: publish %r: %s (DI-engine's emit goes on)",
                           self.spec.node_id, topic, exc)
            except ClosedError:
                if not self._stopped.is_set():
                    raise
                return

    def subscribe(self, topic: str) -> None:
        self.q.subscribe(topic)
        self._held.release(topic, time.monotonic() + HANDOVER_DELAY_S)

    def unsubscribe(self, topic: str) -> None:
        if topic in self.q.subscriptions():
            self.q.unsubscribe(topic)

    def recv(self) -> tuple[str, bytes] | None:
        """The next (topic, bytes); None once stopped (DI-engine's listener loop then ends)."""
        while not self._stopped.is_set():
            due = self._held.due(time.monotonic())
            if due is not None:
                return due
            try:
                msg = self.q.recv(timeout=RECV_SLICE_S)
            except Timeout:
                continue
            except (ClosedError, MQError) as exc:
                if not self._stopped.is_set():
                    log.warning("node %d: recv: %s", self.spec.node_id, exc)
                return None
            payload = msg.payload
            if isinstance(payload, (bytearray, memoryview)):
                payload = bytes(payload)
            if not isinstance(payload, bytes):  # not from a DI-engine emit: never unpickled here
                self._warn(f"type:{msg.topic}", "node %d: dropped a %s payload on topic %r from node %s "
                           "(DI-engine events are bytes)", self.spec.node_id, type(payload).__name__,
                           msg.topic, msg.sender)
                continue
            if msg.topic in self.q.subscriptions():
                if not self._held.behind(msg.topic, payload):  # held ones of its topic go first
                    return msg.topic, payload
                continue
            expired = self._held.hold(msg.topic, payload, time.monotonic())
            if expired:
                self._warn("expired", "node %d: %d event(s) expired unheard after %.0f s (first: %r): "
                           "nothing here subscribed to their topics", self.spec.node_id, expired,
                           HOLD_S, msg.topic)
        return None

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        # DI-engine's shutdown has no place for our error: what was never confirmed is logged
        # (mq.Undelivered names each peer and the count).
        self.q.stop(timeout=STOP_TIMEOUT_S, raise_undelivered=False)

    # ------------------------------------------------------------------ helpers
    def metrics(self) -> dict[str, Any]:
        """The queue's metrics (``mq.MQ.metrics``) plus ``ding_held`` and ``ding_expired``
        (events for topics nobody here listens to): ``task.router._mq.metrics()``."""
        return {**self.q.metrics(), "ding_held": self._held.count(), "ding_expired": self._held.expired}

    def _warn(self, key: str, fmt: str, *args: Any) -> None:
        if key not in self._warned:  # once per cause: emit loops would flood the log
            self._warned.add(key)
            log.warning(fmt, *args)


class _HeldEvents:
    """Events for topics nobody here subscribed to yet, per topic, until a late subscription
    hands them over or :data:`HOLD_S` passes (module docstring). Thread-safe: ``recv`` holds
    and hands over on the listener thread, ``subscribe`` releases on DI-engine's main thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, list[tuple[float, bytes]]] = {}
        self._ready: list[tuple[float, str, bytes]] = []  # (handover time, topic, event)
        self.expired = 0

    def hold(self, topic: str, event: bytes, now: float) -> int:
        """Keep ``event``; returns how many held events just expired (oldest first)."""
        with self._lock:
            before = self.expired
            for t in list(self._held):
                kept = [(at, e) for at, e in self._held[t] if now - at < HOLD_S]
                self.expired += len(self._held[t]) - len(kept)
                if kept:
                    self._held[t] = kept
                else:
                    del self._held[t]
            events = self._held.setdefault(topic, [])
            events.append((now, event))
            if len(events) > HOLD_MAX:
                del events[0]
                self.expired += 1
            return self.expired - before

    def release(self, topic: str, at: float) -> None:
        """``topic`` was subscribed: its held events are handed over from ``at``, in order."""
        with self._lock:
            self._ready.extend((at, topic, e) for _, e in self._held.pop(topic, ()))

    def behind(self, topic: str, event: bytes) -> bool:
        """Queue ``event`` behind held events of its topic still to be handed over (order kept);
        False when there are none (deliver it now)."""
        if not self._ready:  # the common case, per event: no lock (a list's truth is atomic)
            return False
        with self._lock:
            at = max((a for a, t, _ in self._ready if t == topic), default=None)
            if at is None:
                return False
            self._ready.append((at, topic, event))
            return True

    def due(self, now: float) -> tuple[str, bytes] | None:
        if not self._ready:  # the common case, per recv: no lock
            return None
        with self._lock:
            if self._ready and self._ready[0][0] <= now:
                _, topic, event = self._ready.pop(0)
                return topic, event
        return None

    def count(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._held.values()) + len(self._ready)


def _queue_class(ding_type: str) -> type:
    return type(f"MQOnDing_{MQ_TYPES[ding_type].replace(':', '_')}", (MQOnDing,),
                {"__module__": __name__, "__doc__": f"DI-engine mq type {ding_type!r} on mq."})


_CLASSES = {t: _queue_class(t) for t in MQ_TYPES}
for _name, _cls in _CLASSES.items():
    globals()[_cls.__name__] = _cls  # picklable by name
    MQ_REGISTRY.register(_name, _cls, force_overwrite=True)  # idempotent: a re-import overwrites


# ---------------------------------------------------------------------- forked children
_POOL_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_fork_hook_installed = False


def _children_take_their_stop_signal() -> None:
    """A child forked by this worker gets SIGTERM's and SIGHUP's default action where the
    worker's handlers are those of DI-engine's worker pool (mpire). Idempotent.

    DI-engine's ``Supervisor`` forks its children (``StorageLoader``) from a worker and stops
    them with a SHUTDOWN message followed at once by ``terminate()``. The child inherits mpire's
    handler, which raises ``RuntimeError`` into whatever it runs; the child's loop catches it
    and goes on. When SIGTERM lands while the SHUTDOWN message is being read, that message is
    lost, the queue's framing breaks, and the child never exits: ``shutdown()`` then hangs in
    ``join()`` (or fails on ``close()``), and the job with it.
    """
    global _fork_hook_installed
    if not _fork_hook_installed:
        os.register_at_fork(after_in_child=_reset_pool_handlers)
        _fork_hook_installed = True


def _reset_pool_handlers() -> None:
    for signum in _POOL_SIGNALS:
        handler = signal.getsignal(signum)
        if getattr(handler, "__module__", "").startswith("mpire."):  # the pool's, not the user's
            signal.signal(signum, signal.SIG_DFL)


# ---------------------------------------------------------------------- worker arguments
def _worker_count_check(n: int, ids: list[int]) -> None:
    if len(ids) != n or len(set(ids)) != n or min(ids) < 0:
        raise ConfigError(f"node ids {ids} must be {n} distinct non-negative ints (one per worker)")


def _pass_job_secret(options: dict[str, Any]) -> None:
    """Resolve the job secret once in the parent and hand it to the spawned workers through
    MQ_SECRET (as ``mq run`` does), so they never race to create the per-user file."""
    if os.environ.get(auth.ENV_VAR) or "secret" in options or options.get("insecure"):
        return
    os.environ[auth.ENV_VAR] = auth.resolve_secret().key.decode()


def _args_parser(cls: Any, n_parallel_workers: int, mq_type: str, attach_to: Any = None,  # cls: DI-engine's Parallel
                 protocol: str = "ipc", address: str | None = None, ports: Any = None,
                 topology: str = "mesh", labels: Any = None, node_ids: Any = None,
                 auto_recover: bool = False, max_retries: Any = float("inf"),
                 startup_interval: Any = 1, **_unused: Any) -> list[dict[str, Any]]:
    """DI-engine's ``Parallel.runner`` arguments -> one ``_run`` kwargs dict per worker."""
    kind = MQ_TYPES.get(mq_type)
    if kind is None:
        raise ConfigError(f"unknown mq type {mq_type!r}: choose one of {', '.join(MQ_TYPES)}")
    profile = profile_for(check_mq_type(kind))
    n = n_parallel_workers
    ids = list(cls.padding_param(node_ids, n, 0))  # DI-engine's own reading of node_ids
    _worker_count_check(n, ids)
    extra_attach = [a.strip() for a in (attach_to.split(",") if isinstance(attach_to, str) else attach_to or [])]
    if protocol == "ipc":  # one host: mq picks free ports; same-host peers take shm/unix links anyway
        address, port_list = "127.0.0.1", []
    elif protocol == "tcp":
        address = address or cls.get_ip()
        port_list = list(cls.padding_param(ports, n, DING_BASE_PORT))
        if len(port_list) != n:
            raise ConfigError(f"ports {port_list} must be {n}, one per worker (or one base port)")
    else:
        raise ConfigError(f"protocol must be ipc or tcp, got {protocol!r}")
    options = dict(_extra_options)
    init_method = None
    world_size = max(ids) + 1
    if not profile.binds_plan_ports():  # its workers pick their own ports: they meet in a store
        if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
            init_method = "env://"  # torchrun's variables: a job across hosts
            world_size = int(os.environ.get("WORLD_SIZE") or world_size)
        elif extra_attach:
            raise ConfigError(f"{mq_type} across hosts meets in a rendezvous store: set MASTER_ADDR, "
                              "MASTER_PORT and WORLD_SIZE (torchrun's variables) on every host; "
                              "attach_to is for the mq types whose nodes listen on addresses")
    job = LocalJob(node_ids=ids, world_size=world_size, topology=topology, address=address,
                   ports=port_list, attach_to=extra_attach, init_method=init_method, pick_port=free_port)
    per_node = profile.local_options(job)
    _pass_job_secret(options)
    label_set = tuple(sorted(labels or ()))
    params = []
    for n_id in ids:
        opts = {**per_node[n_id], **options}
        dials = opts.get("attach_to") or [f"node:{t}" for t in attach_targets(n_id, ids, topology)]
        talks_to = sorted(set(attach_targets(n_id, ids, topology))
                          | {m for m in ids if n_id in attach_targets(m, ids, topology)})
        spec = WorkerSpec(kind, n_id, label_set, opts, tuple(dials), tuple(talks_to))
        params.append({"node_id": n_id, "n_parallel_workers": n, "labels": set(label_set),
                       "auto_recover": auto_recover, "max_retries": max_retries, "mq_type": mq_type,
                       "startup_interval": startup_interval, "mq_spec": spec})
    return params


# ---------------------------------------------------------------------- the one patch
_ding_runner = Parallel.__dict__["runner"].__func__
if getattr(_ding_runner, "_mq_wrapped", False):  # a second copy of this module (python -m)
    _ding_runner = _ding_runner.__wrapped__
_DING_DEFAULT = inspect.signature(_ding_runner).parameters["mq_type"].default  # DI-engine's own default


@functools.wraps(_ding_runner)
def _runner(cls: type, n_parallel_workers: int, mq_type: str = _DING_DEFAULT, *args: Any, **kwargs: Any) -> Any:
    run = _ding_runner(cls, n_parallel_workers, mq_type, *args, **kwargs)
    if isinstance(mq_type, str) and mq_type.startswith(PREFIX):
        if mq_type not in MQ_TYPES:
            raise ConfigError(f"unknown mq type {mq_type!r}: choose one of {', '.join(MQ_TYPES)}")
        try:
            cell = run.__closure__[run.__code__.co_freevars.index("args_parsers")]
            parsers = cell.cell_contents
        except (TypeError, ValueError, AttributeError):
            raise ConfigError("mq.integrations.ding: this DI-engine's Parallel.runner has no args_parsers "
                              "table to extend (written against DI-engine 0.5.3)") from None
        parsers[mq_type] = functools.partial(_args_parser, cls)
    return run


_runner._mq_wrapped = True  # type: ignore[attr-defined]
Parallel.runner = classmethod(_runner)


def cli() -> None:
    """``ditask`` with mq's types registered: ``python -m mq.integrations.ding --main ... --mq-type mq:nng``
    runs a DI-engine main module that does not import this module itself."""
    from ding.entry.cli_ditask import cli_ditask

    cli_ditask(prog_name="python -m mq.integrations.ding")


if __name__ == "__main__":
    from mq.integrations import ding as _registered  # the importable copy registers the types

    _registered.cli()
