"""``mq bench``: point-to-point round-trip latency of mq against raw pynng and raw torch RPC.

What is measured: node A sends a tensor of ``size`` bytes to node B, B echoes it back
(``recv`` then ``send``), and A times ``send`` -> ``recv`` with ``perf_counter_ns``. A and B are
two processes started with the ``spawn`` method; with ``two_hosts`` B runs in its own network,
PID and IPC namespaces joined to A by a veth pair (:mod:`mq.tools.netns`).

Every mq row has a baseline measured in the same run, interleaved with it batch by batch so
machine noise hits both:

==================  ===========================================================================
mq row              baseline
==================  ===========================================================================
nng, route tcp      raw pynng ``Pair0`` echo over tcp (loopback, or the veth with two hosts)
nng, route ipc      raw pynng ``Pair0`` echo over ipc (unix socket)
nng, route auto     the raw pynng family of the route mq took (``ipc`` same host, ``tcp`` across)
torchrpc:cpu        raw ``rpc_sync(peer, _echo, args=(tensor,))`` on TensorPipe, no device maps
torchrpc:cuda       raw ``rpc_sync`` with device maps (tensors stay on the GPU)
==================  ===========================================================================

Raw pynng only sends ``bytes``, so its round trip is ``tensor.numpy().tobytes()`` -> ``send``
... ``recv()`` -> ``torch.frombuffer``: what a user of pynng would write. Its B side echoes
the received bytes as they are.

Sampling: per (row, size) a warm-up (excluded) estimates one round trip; the row then takes
``target_seconds`` worth of samples (clamped to ``min_samples..max_samples``) in batches of
about ``batch_seconds``, alternating with the other rows of its group. ``max_seconds`` bounds
each (row, size) including its warm-up: a row that reaches it stops and is reported
``skipped`` with the samples it has. Every wait has a timeout and every worker is killed at
the end, so a hung peer turns into a skipped row with a reason, never a hung benchmark.

The library part (:func:`run`) returns a :class:`Report`; :mod:`mq.cli.bench` prints it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import logging
import math
import multiprocessing as mp
import multiprocessing.spawn as mp_spawn
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from mq.errors import ConfigError
from mq.tools.bench_report import (  # noqa: F401 (re-exported: mq.tools.bench is the API)
    ROW_FIELDS, TARGETS, Report, _read, _targets, fmt_ms, fmt_ratio, machine_info, machine_line,
    pivot, plot, row_label, to_csv, to_json, to_markdown, write_all,
)
from mq.tools.bench_units import (  # noqa: F401
    DEFAULT_SIZES, GB, KB, MAX_SIZE, MB, format_size, parse_size, parse_sizes,
)
from mq.tools.bench_workers import CONNECT_TIMEOUT_S, _hard_timeout, _worker

log = logging.getLogger("mq.tools.bench")

__all__ = [
    "BenchConfig",
    "DEFAULT_SIZES",
    "Report",
    "ROW_FIELDS",
    "format_size",
    "machine_info",
    "parse_size",
    "parse_sizes",
    "plot",
    "run",
    "to_csv",
    "to_json",
    "to_markdown",
]

# ---------------------------------------------------------------------------------- config
NNG_ROUTES = ("auto", "tcp", "ipc")
HOSTS = ("same", "two")


@dataclass
class BenchConfig:
    """What to measure. See the module docstring for the sampling rules."""

    mq_types: Sequence[str] = ("nng", "torchrpc:cpu", "torchrpc:cuda")
    routes: Sequence[str] = NNG_ROUTES  # for nng; torch RPC rows are always "auto"
    device: str = "cpu"  # payload device for every row...
    devices: dict[str, str] = field(default_factory=dict)  # ...unless set per mq type here
    sizes: Sequence[int] = DEFAULT_SIZES
    hosts: Sequence[str] = ("same",)
    max_seconds: float = 10.0
    target_seconds: float = 2.0
    batch_seconds: float = 0.25
    min_samples: int = 5
    max_samples: int = 2000
    warmup: int = 5
    baselines: bool = True
    links: bool = True  # measure raw socket stream ceilings (loopback/unix, veth)
    link_seconds: float = 2.0

    def validate(self) -> "BenchConfig":
        from mq.registry import check_mq_type

        self.mq_types = list(dict.fromkeys(check_mq_type(t) for t in self.mq_types))
        if not self.mq_types:
            raise ConfigError("no mq type to measure: give --mq-type nng (or torchrpc:cpu, torchrpc:cuda)")
        for r in self.routes:
            if r not in NNG_ROUTES:
                raise ConfigError(f"route {r!r} is not one of {', '.join(NNG_ROUTES)}")
        self.routes = list(dict.fromkeys(self.routes)) or ["auto"]
        for d in [self.device, *self.devices.values()]:
            if d not in ("cpu", "cuda"):
                raise ConfigError(f"device {d!r} must be cpu or cuda")
        for h in self.hosts:
            if h not in HOSTS:
                raise ConfigError(f"hosts {h!r} must be one of {', '.join(HOSTS)}")
        self.sizes = [int(s) for s in self.sizes]
        if not self.sizes or any(s < 1 or s > MAX_SIZE for s in self.sizes):
            raise ConfigError("sizes must be between 1 byte and 2.5GB")
        if self.max_seconds <= 0 or self.target_seconds <= 0 or self.batch_seconds <= 0:
            raise ConfigError("max_seconds, target_seconds and batch_seconds must be positive")
        if self.min_samples < 1 or self.max_samples < self.min_samples:
            raise ConfigError("need 1 <= min_samples <= max_samples")
        if self.warmup < 1:
            raise ConfigError("warmup must be >= 1 (the first round trip of a size is never a sample)")
        return self

    def device_for(self, mq_type: str) -> str:
        return self.devices.get(mq_type, self.device)



# ============================================================================= orchestrator
class _WorkerFailed(Exception):
    """A worker answered with an error, died, or did not answer in time."""


class _Proc:
    """One spawned worker and its command pipe."""

    def __init__(self, ctx: Any, role: str, spec: dict[str, Any], executable: str | None = None):
        self.role = role
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(role, spec, child), daemon=True,
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
            raise _WorkerFailed(f"worker {self.role} is gone ({self._exit()}): {exc}") from None

    def recv(self, want: str, timeout: float) -> Any:
        try:
            if not self.conn.poll(timeout):
                raise _WorkerFailed(f"worker {self.role} did not answer within {timeout:.0f}s")
            msg = self.conn.recv()
        except (EOFError, OSError):
            raise _WorkerFailed(f"worker {self.role} died ({self._exit()})") from None
        if msg[0] == "error":
            log.debug("worker %s failed:\n%s", self.role, msg[2])
            raise _WorkerFailed(f"worker {self.role}: {msg[1]}")
        if msg[0] != want:
            raise _WorkerFailed(f"worker {self.role} answered {msg[0]!r}, expected {want!r}")
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
            if self.proc.is_alive():
                self.proc.kill()
        with contextlib.suppress(Exception):
            self.proc.join(5)
        with contextlib.suppress(Exception):
            self.conn.close()


@dataclass(eq=False)
class _Case:
    """One row kind: an mq configuration or a raw baseline, with its worker pair."""

    kind: str  # "mq" | "raw"
    mq_type: str  # nng, torchrpc:cpu, torchrpc:cuda | raw:pynng, raw:rpc, raw:rpc-cuda
    route: str  # requested: auto/tcp/ipc (mq), tcp/ipc (raw pynng), auto (rpc)
    device: str
    hosts: str
    resolved_route: str | None = None
    baseline: "_Case | None" = None
    unavailable: str | None = None  # never started: why
    broken: str | None = None  # stopped working: why
    broken_at: int | None = None
    a: _Proc | None = None
    b: _Proc | None = None
    listen_info: dict[str, Any] = field(default_factory=dict)
    results: dict[int, "_SizeResult"] = field(default_factory=dict)

    @property
    def name(self) -> str:
        where = " (two hosts)" if self.hosts == "two" else ""
        return f"{self.mq_type}/{self.route}{where}"

    @property
    def alive(self) -> bool:
        return self.unavailable is None and self.broken is None and self.a is not None

    def spec(self, host: str) -> dict[str, Any]:
        kind = "mq" if self.kind == "mq" else ("pynng" if self.mq_type == "raw:pynng" else "rpc")
        return {"kind": kind, "mq_type": self.mq_type, "route": self.route, "device": self.device,
                "host": host, "device_maps": self.mq_type == "raw:rpc-cuda"}


@dataclass
class _SizeResult:
    samples_ns: list[int] = field(default_factory=list)
    warm_ns: list[int] = field(default_factory=list)
    used_s: float = 0.0
    rt_s: float = 0.0
    target: int = 0
    done: bool = False
    skipped: str | None = None
    link_bytes: int | None = None


Progress = Callable[[dict[str, Any]], None]


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _rpc_unavailable(cuda: bool = False) -> str | None:
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
        reason = _rpc_unavailable(cuda=mq_type == "torchrpc:cuda")
        if reason:
            return reason
    try:
        backend_class(mq_type)
    except Exception as exc:
        module = importlib.util.find_spec("mq.backends.torchrpc") if mq_type.startswith("torchrpc") else True
        what = "mq.backends.torchrpc is not written yet" if module is None else "its backend does not import"
        return f"{what} ({type(exc).__name__}: {exc})"
    return None


class _Runner:
    def __init__(self, cfg: BenchConfig, progress: Progress | None):
        self.cfg = cfg
        self.progress = progress or (lambda event: None)
        self.ctx = mp.get_context("spawn")
        self.cases: list[_Case] = []
        self.links: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.procs: list[_Proc] = []
        self.two: Any = None  # mq.tools.netns.TwoHosts while running two-hosts rows

    # -------------------------------------------------------------- plan
    def plan(self) -> list[tuple[str, str, list[_Case]]]:
        """(hosts, group name, mq cases) in run order; raw cases are added per group later."""
        cfg = self.cfg
        groups = []
        for hosts in cfg.hosts:
            if "nng" in cfg.mq_types:
                cases = []
                for route in cfg.routes:
                    c = _Case("mq", "nng", route, cfg.device_for("nng"), hosts)
                    if hosts == "two" and route == "ipc":
                        c.unavailable = "ipc (a unix socket) does not cross hosts"
                    cases.append(c)
                groups.append((hosts, "pynng", cases))
            for mq_type in ("torchrpc:cpu", "torchrpc:cuda"):
                if mq_type in cfg.mq_types:
                    c = _Case("mq", mq_type, "auto", cfg.device_for(mq_type), hosts)
                    c.unavailable = mq_type_unavailable(mq_type)
                    groups.append((hosts, mq_type, [c]))
        return groups

    # -------------------------------------------------------------- run
    def run(self) -> None:
        from mq.tools.netns import signals_raise

        groups = self.plan()
        self.progress({"event": "start"})
        with signals_raise():
            try:
                for hosts in self.cfg.hosts:
                    mine = [g for g in groups if g[0] == hosts]
                    if hosts == "two":
                        reason = self._enter_two_hosts()
                        if reason:
                            for _, name, cases in mine:
                                for c in cases:
                                    c.unavailable = c.unavailable or reason
                                self._record_unrun(cases + self._raw_cases(hosts, name, cases, reason))
                            self.notes.append(f"two hosts not measured: {reason}")
                            continue
                    try:
                        if self.cfg.links:
                            self._measure_links(hosts)
                        for _, name, cases in mine:
                            self._run_group(hosts, name, cases)
                    finally:
                        if hosts == "two":
                            self._leave_two_hosts()
            finally:
                self._kill_all()
                self._leave_two_hosts()

    def _enter_two_hosts(self) -> str | None:
        from mq.tools.netns import NetnsError, TwoHosts, unavailable

        reason = unavailable()
        if reason:
            return reason
        try:
            self.two = TwoHosts().create()
        except NetnsError as exc:
            return str(exc)
        self.progress({"event": "note", "text": f"second host: {self.two!r}"})
        return None

    def _leave_two_hosts(self) -> None:
        if self.two is not None:
            self._kill_all()
            self.two.remove()
            self.two = None

    def _addr(self, hosts: str) -> tuple[str, str]:
        """(A's address, B's address) for a pair."""
        if hosts == "two":
            return self.two.host_addr, self.two.peer_addr
        return "127.0.0.1", "127.0.0.1"

    def _env(self, hosts: str, side: str) -> dict[str, str]:
        if hosts != "two":
            return {}
        ifname = self.two.host_if if side == "A" else self.two.peer_if
        # TensorPipe and gloo pick their interface from these; the hostname resolves to an
        # address the second host cannot reach.
        return {"TP_SOCKET_IFNAME": ifname, "GLOO_SOCKET_IFNAME": ifname}

    # -------------------------------------------------------------- pairs
    def _start_pairs(self, hosts: str, cases: list[_Case]) -> None:
        """Start A and B of every case (concurrently) and connect them; failures mark cases."""
        host_a, host_b = self._addr(hosts)
        started = []
        for c in cases:
            if c.unavailable:
                continue
            try:
                spec = c.spec(host_a)
                spec["env"] = self._env(hosts, "A")
                c.a = self._spawn("A", spec, hosts)
                started.append(c)
            except Exception as exc:
                c.unavailable = f"could not start: {exc}"
        for c in list(started):
            try:
                c.listen_info = c.a.recv("listening", CONNECT_TIMEOUT_S)  # type: ignore[union-attr]
                spec = c.spec(host_b)
                spec["env"] = self._env(hosts, "B")
                c.b = self._spawn("B", spec, hosts)
            except _WorkerFailed as exc:
                self._break(c, f"could not start: {exc}", None)
                started.remove(c)
        for c in list(started):
            try:
                c.b.recv("listening", CONNECT_TIMEOUT_S)  # type: ignore[union-attr]
                c.a.send("connect", c.listen_info)  # type: ignore[union-attr]
                c.b.send("connect", c.listen_info)  # type: ignore[union-attr]
            except _WorkerFailed as exc:
                self._break(c, f"could not start: {exc}", None)
                started.remove(c)
        for c in started:
            try:
                info = c.a.recv("ready", CONNECT_TIMEOUT_S)  # type: ignore[union-attr]
                c.b.recv("ready", CONNECT_TIMEOUT_S)  # type: ignore[union-attr]
                c.resolved_route = info.get("route")
            except _WorkerFailed as exc:
                self._break(c, f"could not connect: {exc}", None)

    def _spawn(self, role: str, spec: dict[str, Any], hosts: str) -> _Proc:
        exe = None
        if hosts == "two" and role == "B":
            exe = self.two.wrapper()
        p = _Proc(self.ctx, role, spec, executable=exe)
        self.procs.append(p)
        return p

    def _break(self, c: _Case, why: str, size: int | None) -> None:
        if c.broken is None and c.unavailable is None:
            c.broken, c.broken_at = why, size
        for p in (c.a, c.b):
            if p is not None:
                p.kill()
        self.progress({"event": "note", "text": f"{c.name}: {why}"})

    def _stop_pairs(self, cases: list[_Case]) -> None:
        procs = {p: c for c in cases for p in (c.a, c.b) if p is not None}
        for p, why in self._stop_procs(list(procs)).items():
            self.notes.append(f"{procs[p].name} side {p.role}: {why}")

    def _stop_procs(self, procs: list[_Proc]) -> dict[_Proc, str]:
        """Ask workers to stop (they clean up sockets), then kill whatever is left. Returns
        the errors workers reported on the way out."""
        errors = {}
        for p in procs:
            if p.proc.is_alive():
                with contextlib.suppress(_WorkerFailed):
                    p.send("stop")
        for p in procs:
            with contextlib.suppress(_WorkerFailed):
                info = p.recv("stopped", 3.0) if p.proc.is_alive() else None
                if info and info.get("error"):
                    errors[p] = info["error"]
            p.proc.join(2.0)
            p.kill()
        return errors

    def _kill_all(self) -> None:
        for p in self.procs:
            p.kill()
        self.procs = [p for p in self.procs if p.proc.is_alive()]

    # -------------------------------------------------------------- groups
    def _raw_cases(self, hosts: str, name: str, mq_cases: list[_Case], reason: str | None = None) -> list[_Case]:
        if not self.cfg.baselines:
            return []
        raws: dict[str, _Case] = {}
        for c in mq_cases:
            if name == "pynng":
                fam = _family(c, hosts)
                key, mq_type, route = f"pynng-{fam}", "raw:pynng", fam
            elif c.mq_type == "torchrpc:cuda":
                key, mq_type, route = "rpc-cuda", "raw:rpc-cuda", "auto"
            else:
                key, mq_type, route = "rpc", "raw:rpc", "auto"
            if key not in raws:
                raws[key] = _Case("raw", mq_type, route, c.device, hosts)
                if mq_type.startswith("raw:rpc"):
                    raws[key].unavailable = _rpc_unavailable(cuda=mq_type == "raw:rpc-cuda")
                if reason:
                    raws[key].unavailable = reason
            c.baseline = raws[key]
        return sorted(raws.values(), key=lambda r: r.route)

    def _run_group(self, hosts: str, name: str, cases: list[_Case]) -> None:
        self.progress({"event": "group", "text": f"{'two hosts' if hosts == 'two' else 'same host'}: "
                                                  f"starting {name} workers"})
        self._start_pairs(hosts, cases)
        raws = self._raw_cases(hosts, name, cases)
        self._start_pairs(hosts, raws)
        everything = cases + raws
        self.cases.extend(everything)
        self.progress({"event": "total", "add": len(everything) * len(self.cfg.sizes)})
        try:
            for i, size in enumerate(self.cfg.sizes):
                self._run_size(everything, size, i)
        finally:
            self._stop_pairs(everything)

    def _record_unrun(self, cases: list[_Case]) -> None:
        self.cases.extend(cases)
        self.progress({"event": "total", "add": len(cases) * len(self.cfg.sizes)})
        for c in cases:
            for size in self.cfg.sizes:
                c.results[size] = _SizeResult(done=True, skipped=c.unavailable)
                self.progress({"event": "advance", "text": f"{c.name} {format_size(size)}: skipped"})

    # -------------------------------------------------------------- one size
    def _run_size(self, cases: list[_Case], size: int, index: int) -> None:
        live = []
        for c in cases:
            res = c.results[size] = _SizeResult()
            if not c.alive:
                res.done = True
                res.skipped = c.unavailable or f"not run: {c.broken}" + (
                    f" (at {format_size(c.broken_at)})" if c.broken_at else "")
                self.progress({"event": "advance", "text": f"{c.name} {format_size(size)}: skipped"})
                continue
            prev = _previous(c, size)
            if prev is not None and prev.skipped and not prev.samples_ns:
                res.done = True
                res.skipped = f"not run: {format_size(_prev_size(c, size))} already reached --max-seconds"
                self.progress({"event": "advance", "text": f"{c.name} {format_size(size)}: skipped"})
                continue
            live.append(c)
        rnd = index  # alternate who goes first, size to size and round to round
        pending = list(live)
        first = True
        while pending:
            order = pending[rnd % len(pending):] + pending[: rnd % len(pending)]
            for c in order:
                self._step(c, size, warm=first)
            first = False
            pending = [c for c in pending if not c.results[size].done]
            rnd += 1
        for c in live:
            if c.alive:
                with contextlib.suppress(_WorkerFailed):
                    c.a.request("free", None, "ok", 30.0)  # type: ignore[union-attr]

    def _step(self, c: _Case, size: int, warm: bool) -> None:
        cfg = self.cfg
        res = c.results[size]
        if res.done:
            return
        remaining = cfg.max_seconds - res.used_s
        if warm:
            args = {"n": 0, "warmup": cfg.warmup, "rt_hint_s": 0.0}
        else:
            n = max(1, min(res.target - len(res.samples_ns), int(cfg.batch_seconds / max(res.rt_s, 1e-9))))
            args = {"n": n, "warmup": 0, "rt_hint_s": res.rt_s}
        args.update(size=size, warm_cap_s=min(1.0, cfg.max_seconds / 4), cap_s=remaining,
                    timeout_s=_hard_timeout(size), verify=warm)
        link0 = self.two.link_bytes() if (self.two is not None and c.hosts == "two") else None
        try:
            out = c.a.request("batch", args, "batch", remaining + _hard_timeout(size) + 30)  # type: ignore[union-attr]
        except _WorkerFailed as exc:
            res.done = True
            res.skipped = f"failed: {exc}"
            self._break(c, str(exc), size)
            self.progress({"event": "advance", "text": f"{c.name} {format_size(size)}: failed"})
            return
        if link0 is not None and link0 >= 0:
            res.link_bytes = (res.link_bytes or 0) + self.two.link_bytes() - link0
        res.used_s += out["elapsed_s"]
        res.samples_ns += out["samples_ns"]
        res.warm_ns += out["warm_ns"]
        # One round trip's estimate: the median of what this size has done so far (warm-ups
        # only until there are samples: the first round trips of a size are the slow ones).
        w = sorted(res.samples_ns or res.warm_ns[len(res.warm_ns) // 2:])
        res.rt_s = w[len(w) // 2] / 1e9
        res.target = max(len(res.samples_ns), min(cfg.max_samples, max(
            cfg.min_samples, math.ceil(cfg.target_seconds / max(res.rt_s, 1e-9)))))
        have = len(res.samples_ns)
        if have >= res.target:
            res.done = True
        elif out["stopped"] == "budget" or cfg.max_seconds - res.used_s < res.rt_s:
            res.done = True
            res.skipped = (f"--max-seconds {cfg.max_seconds:g} reached after {have} of {res.target} samples "
                           f"(one round trip ~{res.rt_s * 1e3:.4g} ms)")
        self.progress({"event": "advance" if res.done else "update",
                       "text": f"{c.name} {format_size(size)}: {have}/{res.target} samples"})

    # -------------------------------------------------------------- link ceilings
    def _measure_links(self, hosts: str) -> None:
        kinds = [("tcp", "veth tcp")] if hosts == "two" else [("tcp", "loopback tcp"), ("unix", "unix socket")]
        host_a, host_b = self._addr(hosts)
        for route, label in kinds:
            self.progress({"event": "group", "text": f"measuring the {label} ceiling"})
            row = {"hosts": hosts, "link": label, "gbps": None, "bytes": None, "seconds": None, "error": None}
            a = b = None
            try:
                a = self._spawn("A", {"kind": "stream", "route": route, "host": host_a,
                                      "env": self._env(hosts, "A")}, hosts)
                addr = a.recv("listening", CONNECT_TIMEOUT_S)
                b = self._spawn("B", {"kind": "stream", "route": route, "host": host_b,
                                      "env": self._env(hosts, "B")}, hosts)
                b.recv("listening", CONNECT_TIMEOUT_S)
                a.send("connect", {})
                b.send("connect", addr)
                a.recv("ready", CONNECT_TIMEOUT_S)
                b.recv("ready", CONNECT_TIMEOUT_S)
                link0 = self.two.link_bytes() if hosts == "two" else None
                out = a.request("stream", {"seconds": self.cfg.link_seconds}, "stream",
                                self.cfg.link_seconds * 4 + 120)
                row.update(gbps=round(out["gbps"], 3), bytes=out["bytes"], seconds=round(out["seconds"], 4))
                if link0 is not None:
                    row["link_bytes"] = self.two.link_bytes() - link0
            except _WorkerFailed as exc:
                row["error"] = str(exc)
            finally:
                self._stop_procs([p for p in (a, b) if p is not None])
            self.links.append(row)
            self.progress({"event": "note", "text": f"{label} ceiling: "
                                                     f"{row['gbps'] if row['gbps'] else row['error']} Gbit/s"})


def _family(c: _Case, hosts: str) -> str:
    """The raw pynng address family an nng row is compared with."""
    route = c.resolved_route or c.route
    if hosts == "two":
        return "tcp"
    if route in ("ipc", "shm", "inproc"):
        return "ipc"
    if route == "auto":  # never connected: what auto takes on one host
        return "ipc"
    return "tcp"


def _previous(c: _Case, size: int) -> _SizeResult | None:
    p = _prev_size(c, size)
    return c.results.get(p) if p is not None else None


def _prev_size(c: _Case, size: int) -> int | None:
    smaller = [s for s in c.results if s < size]
    return max(smaller) if smaller else None


# ================================================================================== results

def _stats(samples_ns: list[int]) -> dict[str, float]:
    import numpy as np

    ms = np.asarray(samples_ns, dtype=np.float64) / 1e6
    p50, p99 = np.percentile(ms, [50, 99])
    return {"min_ms": float(ms.min()), "p50_ms": float(p50), "p99_ms": float(p99),
            "max_ms": float(ms.max()), "mean_ms": float(ms.mean())}


def _row(c: _Case, size: int) -> dict[str, Any]:
    res = c.results.get(size) or _SizeResult(skipped=c.unavailable or "not run")
    row: dict[str, Any] = {
        "kind": c.kind, "mq_type": c.mq_type, "route": c.route,
        "resolved_route": c.resolved_route, "hosts": c.hosts, "device": c.device,
        "size": format_size(size), "size_bytes": size, "samples": len(res.samples_ns),
        "warmup": len(res.warm_ns), "min_ms": None, "p50_ms": None, "p99_ms": None,
        "max_ms": None, "mean_ms": None, "gbps": None,
        "baseline": (c.baseline.mq_type + "/" + c.baseline.route) if c.baseline else None,
        "baseline_p50_ms": None, "ratio": None, "skipped": bool(res.skipped),
        "reason": res.skipped, "seconds": round(res.used_s, 3),
        "link_bytes": res.link_bytes,
    }
    if res.samples_ns:
        st = _stats(res.samples_ns)
        row.update({k: round(v, 6) for k, v in st.items()})
        row["gbps"] = round(2 * size * 8 / (st["p50_ms"] / 1e3) / 1e9, 4)
        if c.baseline is not None:
            b = c.baseline.results.get(size)
            if b is not None and b.samples_ns:
                bp50 = _stats(b.samples_ns)["p50_ms"]
                row["baseline_p50_ms"] = round(bp50, 6)
                row["ratio"] = round(st["p50_ms"] / bp50, 4)
    return row


_ORDER = {"nng": 0, "raw:pynng": 1, "torchrpc:cpu": 2, "raw:rpc": 3, "torchrpc:cuda": 4, "raw:rpc-cuda": 5}
_ROUTE_ORDER = {"auto": 0, "tcp": 1, "ipc": 2}


def _rows(cases: list[_Case], sizes: Sequence[int]) -> list[dict[str, Any]]:
    cases = sorted(cases, key=lambda c: (HOSTS.index(c.hosts), _ORDER.get(c.mq_type, 9),
                                         _ROUTE_ORDER.get(c.route, 9), c.device))
    return [_row(c, s) for c in cases for s in sizes]


# ================================================================================== entry
def run(cfg: BenchConfig, progress: Progress | None = None) -> Report:
    """Measure everything ``cfg`` asks for and return the report. Always kills its workers and
    removes its namespaces before returning (also on Ctrl-C / SIGTERM, which propagate)."""
    cfg.validate()
    if any(cfg.device_for(t) == "cuda" for t in cfg.mq_types) and not cuda_available():
        raise ConfigError("--device cuda needs a CUDA GPU, and none is visible")
    runner = _Runner(cfg, progress)
    started = time.monotonic()
    load_before = _read("/proc/loadavg").split()[:3] or None
    runner.run()
    rows = _rows(runner.cases, cfg.sizes)
    config = asdict(cfg)
    config["sizes"] = [format_size(s) for s in cfg.sizes]
    config["seconds_total"] = round(time.monotonic() - started, 1)
    config["loadavg_before"] = load_before
    return Report(machine=machine_info(), rows=rows, links=runner.links, config=config,
                  targets=_targets(rows), notes=runner.notes)
