"""The test harness: run one node program on a group of connected nodes, and the helpers the
tests share.

A *group* is anything with ``run(program, n=2, *, labels=None, mq_options=None, deadline_s=60)
-> {node_id: result}``: it starts ``n`` connected nodes, runs ``program(ctx)`` (``ctx`` a
:class:`mq.Context`) on every one of them between a ``start`` and an ``end`` barrier, and
returns what each returned; a failed assertion in any node fails the run. The checks of
:mod:`mq.conformance` take a group, so any transport runs them unchanged. Two kinds:

- :class:`InProcess`: every node a thread of this process, over the queues a factory builds
  (``make_nodes(n, labels, **mq_options) -> [MQ, ...]``, not listening yet) from any
  transport, registered or not (:func:`inproc_nodes` is the one for ``inproc``);
- :class:`Launched`: every node a process started by :func:`mq.launch` for a registered mq type
  (the real launcher, real sockets).

:class:`Spawned` runs programs that make their own queues (``program(node_id, n, ...)``), one
process each: what a test needs to kill a process or to start a second agent in it. A program
that runs in another process travels by reference (``module:function``): a module-level function.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import pickle
import queue
import secrets
import signal
import socket
import tempfile
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Protocol

import numpy as np

import mq
from mq.backend import import_ref
from mq.launch import main_ref, make_plan, resolve_main, run_plan

BARRIER = "_barrier"

Program = Callable[[mq.Context], Any]
#: ``make_nodes(n, labels, **mq_options)``: ``n`` queues (node ids 0..n-1, not listening yet)
#: that find each other once listening; ``labels`` has one entry per node.
MakeNodes = Callable[..., list[mq.MQ]]


class Group(Protocol):
    """Runs a node program on ``n`` connected nodes; results by node id (see the module docstring)."""

    def run(self, program: Program, n: int = 2, *, labels: Any = None,
            mq_options: dict[str, Any] | None = None, deadline_s: float = 60.0) -> dict[int, Any]: ...


def _options(mq_options: dict[str, Any] | None) -> dict[str, Any]:
    return {"timeout": 10.0, **(mq_options or {})}


@dataclass(frozen=True)
class InProcess:
    """Every node a thread of this process, over the queues ``make_nodes`` builds."""

    make_nodes: MakeNodes

    def run(self, program: Program, n: int = 2, *, labels: Any = None,
            mq_options: dict[str, Any] | None = None, deadline_s: float = 60.0) -> dict[int, Any]:
        nodes = self.make_nodes(n, labels if isinstance(labels, list) else [labels] * n, **_options(mq_options))
        results: dict[int, Any] = {}
        errors: list[BaseException] = []

        def node(q: mq.MQ) -> None:
            try:
                with q:
                    ctx = mq.Context(q.node_id, q.labels, q, q.mq_type, n, list(range(n)), {})
                    results[q.node_id] = _run_node(program, ctx)
            except BaseException as exc:  # reported below, like a worker's traceback
                errors.append(exc)

        threads = [threading.Thread(target=node, args=(q,), daemon=True) for q in nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(deadline_s)
        if errors:
            raise errors[0]
        if any(t.is_alive() for t in threads):
            raise mq.Timeout(f"{program.__name__} did not finish within {deadline_s:g}s")
        return results


class Case(NamedTuple):
    """One conformance case of a registered backend, ready to run."""

    id: str
    group: Group
    route: str  # the route kind every peer must get
    transport: str  # "module:Class" of the backend's transport (a test skips where it is not built)


def conformance_cases() -> list[Case]:
    """Every conformance case the registered backends declare (:class:`mq.backend.ConformanceCase`),
    built-in and plug-ins alike: what ``tests/test_conformance.py`` runs. A launchable backend's
    nodes are processes :func:`mq.launch` starts; another's come from its ``nodes`` factory."""
    from mq.registry import backends

    cases = []
    for backend in backends().values():
        for case in backend.conformance:
            if backend.launch is not None:
                group: Group = Launched(case.mq_type, dict(case.options))
            else:
                assert backend.nodes is not None  # (Backend checks it)
                group = InProcess(functools.partial(import_ref(backend.nodes), **case.options))
            cases.append(Case(case.id, group, case.route, backend.transport))
    return cases


def inproc_nodes(n: int, labels: list[Any], **mq_options: Any) -> list[mq.MQ]:
    """The ``inproc`` transport's nodes for :class:`InProcess`: node i attaches to nodes 0..i-1."""
    names = [f"inproc://group-{os.getpid()}-{time.monotonic_ns()}-{i}" for i in range(n)]
    return [mq.create("inproc", i, labels[i], listen_to=names[i], attach_to=names[:i], **mq_options)
            for i in range(n)]


@dataclass(frozen=True)
class Launched:
    """Every node a process that :func:`mq.launch` starts for ``mq_type``, with its backend's
    launch ``flags`` (``{"protocol": "tcp"}`` for nng)."""

    mq_type: str
    flags: Mapping[str, Any] = field(default_factory=dict)

    def run(self, program: Program, n: int = 2, *, labels: Any = None,
            mq_options: dict[str, Any] | None = None, deadline_s: float = 60.0) -> dict[int, Any]:
        with tempfile.TemporaryDirectory(prefix="mq-group-") as out:
            plan = make_plan(_launched_main, n_workers=n, mq_type=self.mq_type, backend_options=self.flags,
                             labels=labels, mq_options=_options(mq_options),
                             args={"program": main_ref(program), "out": out})
            run_plan(plan, deadline_s=deadline_s)
            results = {}
            for node in plan.node_ids:
                with open(os.path.join(out, f"{node}.pkl"), "rb") as f:  # our own file, not the network
                    results[node] = pickle.load(f)
            return results


def _launched_main(ctx: mq.Context) -> None:
    result = _run_node(resolve_main(ctx.args["program"]), ctx)
    with open(os.path.join(ctx.args["out"], f"{ctx.node_id}.pkl"), "wb") as f:
        pickle.dump(result, f)


def _run_node(program: Program, ctx: mq.Context) -> Any:
    q = ctx.mq
    q.subscribe(BARRIER, _BarrierBox.get(q).arrive)
    q.wait_for_peers(len(ctx.node_ids) - 1, timeout=20)
    barrier(ctx, "start")
    result = program(ctx)
    if q.running:
        barrier(ctx, "end")
    return result


class Spawned:
    """``n`` spawned processes, node ``i`` running ``program(i, n, *args, **kw)``; each reports
    ``(node_id, "ok" | "error", result, time)`` on a multiprocessing queue (our own processes
    talking, not network data of the queue under test). Every process is joined, or killed, on
    leaving the ``with`` block."""

    def __init__(self, program: Callable[..., Any], n: int, *args: Any, **kw: Any):
        main_ref(program)  # a clear error for a function the children cannot import
        self.ctx = mp.get_context("spawn")
        self.out = self.ctx.Queue()
        self.n = n
        self.procs = [self.ctx.Process(target=_spawned_main, name=f"{program.__name__}-node-{i}",
                                       args=(program, i, n, args, kw, self.out))
                      for i in range(n)]
        self.reported: dict[int, float] = {}

    def __enter__(self) -> "Spawned":
        for p in self.procs:
            p.start()
        return self

    def results(self, expect: list[int] | None = None, timeout: float = 90.0) -> dict[int, Any]:
        """Wait for the nodes in ``expect`` (default: all) to report; raise on a node's error.
        The default is generous: a spawned node imports torch, seconds on a loaded machine."""
        expect = list(range(self.n)) if expect is None else expect
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while set(results) < set(expect):
            try:
                node, status, value, _ = self.out.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"nodes {sorted(set(expect) - set(results))} did not report "
                                     f"within {timeout:g}s; exit codes {self.exitcodes()}") from None
            self.reported[node] = time.monotonic()
            if status != "ok":
                raise AssertionError(f"node {node} failed:\n{value}")
            results[node] = value
        return results

    def exitcodes(self) -> list[int | None]:
        return [p.exitcode for p in self.procs]

    def join(self, nodes: list[int] | None = None, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        for i in nodes if nodes is not None else range(self.n):
            self.procs[i].join(max(0.0, deadline - time.monotonic()))

    def __exit__(self, *exc: Any) -> None:
        for p in self.procs:
            if p.exitcode is None:
                p.join(0.1 if exc[0] else 10.0)
            if p.exitcode is None:
                p.kill()
                p.join(5)
        self.out.close()
        self.out.join_thread()


def _spawned_main(program: Callable[..., Any], node_id: int, n: int, args: tuple[Any, ...],
                  kw: dict[str, Any], out: Any) -> None:
    try:
        result = program(node_id, n, *args, **kw)
        out.put((node_id, "ok", result, time.monotonic()))
    except BaseException:
        out.put((node_id, "error", traceback.format_exc(), time.monotonic()))


# ---------------------------------------------------------------------- barrier
class _BarrierBox:
    # Keyed by the node itself, weakly: keyed by id(), a later group's node could reuse a freed
    # node's id and find that node's arrivals, passing a barrier nobody reached.
    _boxes: "weakref.WeakKeyDictionary[mq.MQ, _BarrierBox]" = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.seen: dict[str, set[int]] = {}

    @classmethod
    def get(cls, q: mq.MQ) -> "_BarrierBox":
        return cls._boxes.setdefault(q, cls())

    def arrive(self, msg: mq.Message) -> None:
        with self.cond:
            self.seen.setdefault(msg.payload, set()).add(msg.sender)
            self.cond.notify_all()


def barrier(ctx: mq.Context, name: str, timeout: float = 20.0) -> None:
    """Every node waits until every other node reached ``name``."""
    q = ctx.mq
    others = [n for n in ctx.node_ids if n != ctx.node_id and (name == "start" or n in q.peers())]
    q.wait_for_subscribers(BARRIER, len(others), timeout=timeout)
    for peer in others:
        q.send(peer, BARRIER, name, timeout=timeout)
    box = _BarrierBox.get(q)
    with box.cond:
        ok = box.cond.wait_for(lambda: box.seen.get(name, set()) >= set(others), timeout)
    assert ok, f"node {ctx.node_id}: barrier {name!r} timed out; seen {box.seen.get(name)}"



# ---------------------------------------------------------------------- helpers
def unix_sockets(pids: Any) -> list[str]:
    """The unix sockets mq nodes of ``pids`` listen on (abstract ``@mq-<pid>-...`` names, or
    files ``/tmp/mq-<pid>-...``), read from /proc/net/unix: what a leak check looks for."""
    prefixes = tuple(p for pid in pids for p in (f"@mq-{pid}-", f"/tmp/mq-{pid}-"))
    with open("/proc/net/unix") as f:
        return sorted({line.split()[-1] for line in f if line.split()[-1].startswith(prefixes)})


def free_port_run(width: int = 1) -> int:
    """A port ``p`` with ``p .. p+width-1`` free on every address right now, picked below the
    kernel's ephemeral range: a port from ``bind(0)`` lies inside it, where any process's next
    outgoing connection may take it (or its neighbour, for a worker listening on base+1)."""
    for _ in range(200):
        base = 10000 + secrets.randbelow(20000)
        socks = []
        try:
            for port in range(base, base + width):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {width} free ports in 10000..30000")


def read_line(proc: Any, timeout: float = 30.0) -> str:
    """The next line a peer process (``Popen`` with text pipes) prints, within ``timeout``; it is
    killed, and its stderr's tail shown, when it prints nothing or exits."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        proc.kill()
        raise AssertionError(f"peer printed nothing in {timeout}s: {proc.stderr.read()[-3000:]}")
    line = proc.stdout.readline().strip()
    assert line, f"peer exited: {proc.stderr.read()[-3000:]}"
    return line


def stop_processes(*procs: Any) -> None:
    """Kill and reap peer processes (``Popen`` with pipes) and close their pipes."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)
        p.stdout.close()
        p.stderr.close()


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped. Not at once on a busy
    machine: the kernel hands SIGSTOP to one thread, and the others run on (reading a frame,
    answering it) until that thread gets a CPU and stops the group."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        try:
            states = [open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()[0]
                      for tid in os.listdir(f"/proc/{pid}/task")]
        except (FileNotFoundError, ProcessLookupError):  # it died meanwhile: nothing answers either
            return True
        return all(state in "tTZX" for state in states)

    if not wait_until(stopped, timeout):
        raise TimeoutError(f"process {pid} did not stop within {timeout:g}s of SIGSTOP")


def wait_until(cond: Any, timeout: float = 10.0) -> bool:
    """Poll ``cond()`` until it is true or ``timeout`` seconds pass (never a bare sleep)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False



# ---------------------------------------------------------------------- payloads
def sample_payload() -> dict[str, Any]:
    import torch

    return {
        "step": 7, "ratio": 0.5, "name": "ünïcode", "flag": True, "none": None, "raw": b"\x00\x01",
        "big": b"x" * 100_000, "tuple": (1, (2, "3")), "list": [1.5, [2, {"k": "v"}]],
        "obs": np.arange(24, dtype=np.uint8).reshape(2, 3, 4),
        "strided": np.arange(20, dtype=np.float64).reshape(4, 5)[:, ::2],
        "empty": np.zeros((0, 3), dtype=np.float32),
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
        "bf16": torch.ones(5, dtype=torch.bfloat16),
        "mask": torch.tensor([True, False]),
        "z": torch.tensor([1 + 2j], dtype=torch.complex64),
        1: "int key",  # type: ignore[dict-item]  # a non-str key, on purpose
    }


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, torch.Tensor):  # equal values, whichever device the copy landed on
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b.to(a.device)))
    return type(a) is type(b) and a == b
