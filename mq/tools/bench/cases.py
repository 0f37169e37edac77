"""The pieces ``mq bench`` measures with: a spawned worker and its command pipe
(:class:`WorkerProc`), a row kind with its workers (:class:`Case`) and its samples per size
(:class:`SizeResult`), and why a kind of row cannot run on this machine."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import multiprocessing.spawn as mp_spawn
from dataclasses import dataclass, field
from typing import Any, Mapping

from mq.launch.supervise import stop_processes
from mq.tools.bench.workers import worker

log = logging.getLogger("mq.tools.bench")

#: Where a pair runs: one host, or two (network namespaces, :mod:`mq.tools.netns`).
HOSTS = ("same", "two")


class WorkerFailed(Exception):
    """A worker answered with an error, died, or did not answer in time."""


class WorkerProc:
    """One spawned worker and its command pipe."""

    def __init__(self, ctx: Any, role: str, spec: dict[str, Any], executable: str | None = None):
        self.role = role
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker, args=(role, spec, child), daemon=True,
                                name=f"mq-bench-{spec['kind']}-{role}")
        old = mp_spawn.get_executable()
        if executable:
            mp_spawn.set_executable(executable)
        try:
            self.proc.start()
        finally:
            if executable:
                mp_spawn.set_executable(old)
        child.close()

    def send(self, op: str, arg: Any = None) -> None:
        try:
            self.conn.send((op, arg))
        except (OSError, ValueError) as exc:
            raise WorkerFailed(f"worker {self.role} is gone ({self._exit()}): {exc}") from None

    def recv(self, want: str, timeout: float) -> Any:
        try:
            if not self.conn.poll(timeout):
                raise WorkerFailed(f"worker {self.role} did not answer within {timeout:.0f}s")
            msg = self.conn.recv()
        except (EOFError, OSError):
            raise WorkerFailed(f"worker {self.role} died ({self._exit()})") from None
        if msg[0] == "error":
            log.debug("worker %s failed:\n%s", self.role, msg[2])
            raise WorkerFailed(f"worker {self.role}: {msg[1]}")
        if msg[0] != want:
            raise WorkerFailed(f"worker {self.role} answered {msg[0]!r}, expected {want!r}")
        return msg[1]

    def request(self, op: str, arg: Any, want: str, timeout: float) -> Any:
        self.send(op, arg)
        return self.recv(want, timeout)

    def _exit(self) -> str:
        self.proc.join(0.5)
        code = self.proc.exitcode
        if code is None:
            return "still running"
        return f"exit code {code}" if code >= 0 else f"killed by signal {-code}"

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            stop_processes([self.proc], grace_s=0)
        with contextlib.suppress(Exception):
            self.conn.close()


@dataclass(eq=False)
class Case:
    """One row kind: an mq configuration, a raw baseline or a physical bound, with its workers
    (A, and one B per subscriber: none for a bound)."""

    kind: str  # "mq" | "raw" | "bound"
    # nng, torchrpc:cpu, torchrpc:cuda | raw:pynng, raw:pyzmq, raw:socket, raw:rpc, raw:rpc-cuda | memcpy, d2d
    mq_type: str
    route: str  # requested: auto/tcp/ipc/rdma/handle (mq), tcp/ipc (raw sockets), auto (rpc), warm (bound)
    device: str
    hosts: str
    mode: str = "roundtrip"  # see MODES; "bound" for the memcpy row
    subscribers: int = 1  # B processes
    # CUDA payloads: the receiver copies each one into an owned CUDA tensor before it counts as
    # arrived ("view + copy", the row ``... +copy``); False: the view is ready ("view ready").
    owned: bool = False
    resolved_route: str | None = None
    baseline: "Case | None" = None
    unavailable: str | None = None  # never started: why
    broken: str | None = None  # stopped working: why
    broken_at: int | None = None
    a: WorkerProc | None = None
    bs: list[WorkerProc] = field(default_factory=list)
    listen_info: dict[str, Any] = field(default_factory=dict)
    results: dict[int, "SizeResult"] = field(default_factory=dict)

    @property
    def name(self) -> str:
        where = " (two hosts)" if self.hosts == "two" else ""
        fan = f" x{self.subscribers}" if self.mode == "fanout" else ""
        return f"{self.mq_type}/{self.route} {self.mode}{fan}{where}{' +copy' if self.owned else ''}"

    @property
    def procs(self) -> list[WorkerProc]:
        return [p for p in (self.a, *self.bs) if p is not None]

    @property
    def alive(self) -> bool:
        return self.unavailable is None and self.broken is None and self.a is not None

    def copies(self, messages: int) -> tuple[int, int]:
        """(payloads one sample moves, memcpys its physical bound is): a round trip moves the
        payload there and back (bound: 2 memcpy), a fan-out N payloads but shared memory copies
        it once (bound: 1 memcpy), a stream `messages` payloads (bound: that many memcpys)."""
        return {"roundtrip": (2, 2), "call": (2, 2), "fanout": (self.subscribers, 1),
                "stream": (messages, messages)}.get(self.mode, (1, 1))

    def spec(self, host: str, messages: int) -> dict[str, Any]:
        kind = {"mq": "mq", "bound": "bound"}.get(self.kind) or _RAW_KINDS[self.mq_type.split("-")[0]]
        if self.kind == "bound" and self.device == "cuda":
            kind = "d2d"
        return {"kind": kind, "mq_type": self.mq_type, "route": self.route, "device": self.device,
                "host": host, "device_maps": self.mq_type == "raw:rpc-cuda", "mode": self.mode,
                "subscribers": self.subscribers, "messages": messages, "owned": self.owned}


_RAW_KINDS = {"raw:pynng": "pynng", "raw:pyzmq": "zmq", "raw:socket": "socket", "raw:rpc": "rpc"}


@dataclass
class SizeResult:
    samples_ns: list[int] = field(default_factory=list)
    warm_ns: list[int] = field(default_factory=list)
    arrival_ns: list[int] = field(default_factory=list)  # one way proper (oneway rows)
    used_s: float = 0.0
    rt_s: float = 0.0
    target: int = 0
    done: bool = False
    skipped: str | None = None
    link_bytes: int | None = None
    arrived_on: set[str] = field(default_factory=set)  # CUDA rows: devices payloads arrived on
    route_taken: str | None = None  # mq rows: the route A's node was on after this size's last batch


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def rpc_unavailable(cuda: bool = False) -> str | None:
    try:
        import torch.distributed.rpc as rpc

        if not rpc.is_available():
            return "this torch build has no torch.distributed.rpc"
    except Exception as exc:
        return f"torch.distributed.rpc does not import: {type(exc).__name__}: {exc}"
    if cuda and not cuda_available():
        return "no CUDA GPU visible"
    return None


def mq_type_unavailable(mq_type: str) -> str | None:
    """Why rows of ``mq_type`` cannot be measured on this machine, or None."""
    from mq.registry import backend_class

    if mq_type.startswith("torchrpc"):
        reason = rpc_unavailable(cuda=mq_type == "torchrpc:cuda")
        if reason:
            return reason
    try:
        backend_class(mq_type)
    except Exception as exc:
        return f"its backend does not import ({type(exc).__name__}: {exc})"
    return None


def rdma_unavailable() -> str | None:
    """Why rows on route rdma cannot run here (NIXL, which the rdma path loads, not installed),
    or None. Looked up, not imported: the workers load it."""
    from mq.datapaths.rdma import engine as rdma

    if any(importlib.util.find_spec(name.split(".")[0]) is not None for name in rdma._API_MODULES):
        return None
    return "NIXL is not installed (pip install 'mq[rdma]', or nixl-cu13): the rdma path needs it"


def pool_api_missing(device: str = "cpu") -> str | None:
    """Why the by-handle row cannot run: mq's shared-memory pool API (alloc / wait_released);
    for a CUDA payload, an ``alloc`` that takes a ``device`` (mq's CUDA pool)."""
    import inspect

    import mq

    if not (hasattr(mq.MQ, "alloc") and hasattr(mq.MQ, "wait_released")):  # what mq.create returns
        return "mq has no shared-memory pool API"
    if device != "cpu":
        params: Mapping[str, Any]  # a signature's, or none
        try:
            params = inspect.signature(mq.MQ.alloc).parameters
        except (TypeError, ValueError):
            params = {}
        if "device" not in params:
            return "mq's alloc takes no device= yet: no CUDA payload by handle"
    return None


def zmq_installed() -> bool:
    return importlib.util.find_spec("zmq") is not None


