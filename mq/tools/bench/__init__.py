"""``mq bench``: point-to-point latency and throughput of mq against raw pynng, raw pyzmq, raw
torch RPC and the physical bound.

What is measured (``modes``; A and B are processes started with the ``spawn`` method; with
``two_hosts`` B runs in its own network, PID and IPC namespaces joined to A by a veth pair,
:mod:`mq.tools.netns`). A times each sample with ``perf_counter_ns``:

- ``roundtrip`` (default): A sends a tensor of ``size`` bytes, B echoes it (``recv`` then ``send``).
- ``oneway``: A sends it, B drops it and answers a tiny ack carrying its arrival time: a sample
  is send -> ack, and the row also reports one way proper, arrival - send start (both read
  ``CLOCK_MONOTONIC``, one clock for every process of a kernel, namespace hosts included).
- ``fanout``: A ``publish``-es it to ``subscribers`` B processes and waits for every ack; the same
  run measures the fan-out to one subscriber, the baseline of the N row, and raw pynng's fan-out
  (``Pub0`` to N ``Sub0`` processes, acks over ``Push0``/``Pull0``) to N and to one: what N
  processes cost this machine, whatever the library.
- ``stream``: A sends ``messages`` small messages (``{"i": counter, "x": size bytes}``) as fast as
  backpressure lets it, B checks the counters arrive in order without gaps and acks each burst.
- ``call``: A calls ``q.call(1, "echo", tensor)``, B serves it with ``q.on("echo", lambda x: x)``;
  the raw rows are the same request/reply in the raw library (``rpc_sync(_echo)``, pynng
  ``Req0``/``Rep0``).

Every mq row has a baseline measured in the same run, interleaved with it batch by batch so
machine noise hits both:

==================  ===========================================================================
mq row              baseline
==================  ===========================================================================
nng, route tcp      raw pynng ``Pair0`` over tcp (loopback, or the veth with two hosts)
nng, route ipc      raw pynng ``Pair0`` over ipc (unix socket)
nng, route auto     the raw pynng family of the route mq took (``ipc`` same host, ``tcp`` across)
nng, route rdma     (two hosts; asked for by name, never by default) raw pynng ``Pair0`` over tcp:
                    both nodes made with ``rdma="tcp"``, mq's rdma data path (NIXL, buffers of
                    ``rdma_inline_max`` and up pulled by the receiver) over UCX's tcp transport on
                    the veth, no RDMA device needed. The row says the route A's node took
                    (``nng/rdma``; ``nng/rdma->tcp`` where it fell back), read again after
                    every batch, so a fallback mid-run shows at the sizes it hit.
nng, route handle   (one-way, same host) the payload lives in mq's shared-memory pool
                    (``q.alloc``) and goes by handle; baseline raw pynng ipc. Skipped while mq
                    has no ``alloc``/``wait_released``.
nng stream          raw pynng ``Push0``/``Pull0`` streaming the same count, acks on a second pair
nng call            raw pynng ``Req0`` -> ``Rep0`` echo (the address family of the route)
nng fan-out N       the same fan-out to one subscriber
torchrpc:cpu        raw ``rpc_sync(peer, _echo, args=(tensor,))`` on TensorPipe, no device maps
                    (round trip and call alike)
torchrpc:cuda       raw ``rpc_sync`` with device maps (tensors stay on the GPU)
==================  ===========================================================================

Raw pynng only sends ``bytes``, so its round trip is ``tensor.numpy().tobytes()`` -> ``send``
... ``recv()`` -> ``torch.frombuffer``: what a user of pynng would write. Raw pyzmq rows (round
trip and one-way, when pyzmq is installed) use its zero-copy API (``send(copy=False)``,
``np.frombuffer(frame.buffer)``): nobody's baseline, a reference of what zero-copy sockets do.

Across hosts (``--two-hosts``) each mode of round trip and one-way also gets the link row,
``raw:socket/tcp``, with or without baselines (``--no-links`` drops it): a plain TCP connection,
an 8-byte length then the bytes, sent from the payload and received into a warm buffer reused
per size, interleaved with the other rows. A row's ``link_fraction`` is the link row's p50 at
its size over its own (1.0: as fast as the plain socket program); rows without one (fan-out,
stream) are compared with the raw socket stream the run measures once (``links``).

The physical bound is one memcpy of ``size`` bytes into warm memory (allocated once per size and
faulted in first), measured by its own worker interleaved with the first group that has that
size. Each row's ``ratio_bound`` is its p50 over the memcpys it needs at least
(``bound_copies``: 2 for a round trip, 1 for one-way and fan-out, ``messages`` for a stream).

CUDA payloads (``device="cuda"``): A makes the payload on cuda:0; every receiver (B, and A for
an echo) synchronizes its current stream before the payload counts as arrived, so a sample ends
with the bytes usable on the GPU (a payload that arrived in host memory is first copied there,
and the row's ``arrived_on`` and note say so). Each mq row has a ``+copy`` twin (``owned``):
the receiver also copies the view into an owned, preallocated CUDA tensor ("view + copy", what
TensorPipe hands over) before it counts. The bound of CUDA rows is one device-to-device copy
(``d2d``: ``dst.copy_(src)`` into a warm tensor on the same GPU, timed by CUDA events), and
every mq CUDA row also gets its ratio to raw torch RPC cuda (``rpc_cuda_ratio``). The report's
``checks`` are the GPU pass lines (:mod:`mq.tools.bench.gpu`).

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
import logging
import math
import multiprocessing as mp
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence, cast

from mq.errors import ConfigError
from mq.registry import launchable_mq_types
from mq.launch.supervise import stop_signals_raise
from mq.tools.bench.report import (  # noqa: F401 (re-exported: mq.tools.bench is the API)
    ROW_FIELDS, SUITE_DEVICES, TARGETS, add_link_fractions, Report, _read, _targets, check_line, fmt_ms, fmt_ratio,
    gpu_pivot, machine_info, machine_line, pivot, plot, ratio_limit, row_label, row_note, to_csv, to_json,
    to_markdown, with_load, write_all,
)
from mq.tools.bench.units import (  # noqa: F401
    DEFAULT_SIZES, GB, KB, MAX_SIZE, MB, format_size, parse_size, parse_sizes,
)
from mq.tools.bench.cases import (  # cuda_available: the CLI's
    HOSTS, Case, SizeResult, WorkerFailed, WorkerProc, cuda_available, mq_type_unavailable,
    pool_api_missing, rdma_unavailable, rpc_unavailable, zmq_installed,
)
from mq.tools.bench.endpoint import CONNECT_TIMEOUT_S, MODES, hard_timeout
from mq.tools.bench.gpu import gpu_checks
from mq.tools.bench.rows import report_rows

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
#: The nng routes a run measures unless told otherwise.
NNG_ROUTES = ("auto", "tcp", "ipc")
#: Every route a row may ask for: ``rdma`` only by name (it needs NIXL and another host).
ROUTES = (*NNG_ROUTES, "rdma")


@dataclass
class BenchConfig:
    """What to measure. See the module docstring for the sampling rules."""

    mq_types: Sequence[str] = field(default_factory=launchable_mq_types)  # one process per node
    routes: Sequence[str] = NNG_ROUTES  # for nng (any of ROUTES); torch RPC rows are always "auto"
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
    # Two hosts: each side's workers on its own half of this machine's CPUs, as separate
    # machines have their own (see host_cpus); False (default) lets the scheduler place them.
    split_cpus: bool = False
    link_seconds: float = 2.0
    modes: Sequence[str] = ("roundtrip",)
    subscribers: int = 4  # fan-out: N subscribers (and the same run with 1, for the ratio)
    messages: int = 1000  # stream: messages per sample (one ack per burst)
    mode_sizes: dict[str, Sequence[int]] = field(default_factory=dict)  # sizes per mode, if not `sizes`
    busy_poll: bool | None = None  # the mq nodes' busy_poll option; None: the transport's default

    def validate(self) -> "BenchConfig":
        from mq.registry import check_mq_type

        self.mq_types = list(dict.fromkeys(check_mq_type(t) for t in self.mq_types))
        if not self.mq_types:
            raise ConfigError("no mq type to measure: give --mq-type nng (or torchrpc:cpu, torchrpc:cuda)")
        for r in self.routes:
            if r not in ROUTES:
                raise ConfigError(f"route {r!r} is not one of {', '.join(ROUTES)}")
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
        for m in self.modes:
            if m not in MODES:
                raise ConfigError(f"mode {m!r} is not one of {', '.join(MODES)}")
        self.modes = list(dict.fromkeys(self.modes)) or ["roundtrip"]
        if self.busy_poll is not None and type(self.busy_poll) is not bool:
            raise ConfigError(f"busy_poll must be True, False or None, got {self.busy_poll!r}")
        if self.subscribers < 1 or self.messages < 1:
            raise ConfigError("subscribers and messages must be >= 1")
        for m, sizes in self.mode_sizes.items():
            if m not in MODES or any(s < 1 or s > MAX_SIZE for s in sizes):
                raise ConfigError(f"mode_sizes[{m!r}]: a mode with sizes between 1 byte and 2.5GB")
        return self

    def device_for(self, mq_type: str) -> str:
        return self.devices.get(mq_type, self.device)

    def sizes_for(self, mode: str) -> list[int]:
        return [int(s) for s in (self.mode_sizes.get(mode) or self.sizes)]

    def all_sizes(self) -> list[int]:
        """Every size some mode measures: the sizes of the physical-bound row."""
        return sorted({s for m in self.modes for s in self.sizes_for(m)})



# ============================================================================= orchestrator
def _exit_by_signal(signum: int) -> SystemExit:
    return SystemExit(128 + signum)


Progress = Callable[[dict[str, Any]], None]
NNG_ONLY_MODES = ("fanout", "stream")  # mq's publish / many small sends; no torch RPC rows
ZMQ_MODES = ("roundtrip", "oneway")  # modes with a raw pyzmq row


class _Runner:
    def __init__(self, cfg: BenchConfig, progress: Progress | None):
        self.cfg = cfg
        self.progress = progress or (lambda event: None)
        self.ctx = mp.get_context("spawn")
        self.cases: list[Case] = []
        self.links: list[dict[str, Any]] = []
        self._linked: set[tuple[str, str]] = set()  # (hosts, mode) with a link row (_link_cases)
        self.notes: list[str] = []
        self.procs: list[WorkerProc] = []
        self.two: Any = None  # mq.tools.netns.TwoHosts while running two-hosts rows
        self.bounds = plan_bounds(cfg)

    # -------------------------------------------------------------- plan
    def plan(self) -> list[tuple[str, str, list[Case]]]:
        """(hosts, group name, mq cases) in run order; raw cases are added per group later."""
        cfg = self.cfg
        rpc_types = [t for t in ("torchrpc:cpu", "torchrpc:cuda") if t in cfg.mq_types]
        nng_only = [m for m in cfg.modes if m in NNG_ONLY_MODES]
        if rpc_types and nng_only:
            self.notes.append(f"{' and '.join(nng_only)} measured for nng only (not {', '.join(rpc_types)})")
        groups = []
        if "rdma" in cfg.routes:
            self.notes.append("route rdma: both nodes made with rdma='tcp', mq's rdma path (NIXL) over UCX's "
                              "tcp transport, no RDMA device; buffers under rdma_inline_max (64 KiB) "
                              "stay inline on the link")
        for hosts in cfg.hosts:
            for mode in cfg.modes:
                if "nng" in cfg.mq_types:
                    groups.append((hosts, "pynng", self._nng_cases(hosts, mode)))
                for mq_type in rpc_types if mode not in NNG_ONLY_MODES else ():
                    c = Case("mq", mq_type, "auto", cfg.device_for(mq_type), hosts, mode)
                    c.unavailable = mq_type_unavailable(mq_type)
                    cases = [c]
                    if "rdma" in cfg.routes and hosts == "two":  # torch RPC carries rdma's descriptors too
                        r = Case("mq", mq_type, "rdma", c.device, hosts, mode)
                        r.unavailable = c.unavailable or rdma_unavailable()
                        cases.append(r)
                    groups.append((hosts, mq_type, [*cases, *_owned_twins(cases)]))
        return groups

    def _nng_cases(self, hosts: str, mode: str) -> list[Case]:
        cfg = self.cfg
        cases = []
        for route in cfg.routes:
            c = Case("mq", "nng", route, cfg.device_for("nng"), hosts, mode,
                      subscribers=cfg.subscribers if mode == "fanout" else 1)
            if hosts == "two" and route == "ipc":
                c.unavailable = "ipc (a unix socket) does not cross hosts"
            elif route == "rdma":
                c.unavailable = ("rdma carries buffers between hosts (one host: shm): measure it with "
                                 "--two-hosts") if hosts == "same" else rdma_unavailable()
            cases.append(c)
            if mode == "fanout" and c.subscribers > 1:  # fan-out N is compared with fan-out 1
                c.baseline = Case("mq", "nng", route, c.device, hosts, mode, unavailable=c.unavailable)
                cases.append(c.baseline)
        cases += _owned_twins(cases)
        if mode == "oneway" and hosts == "same":
            c = Case("mq", "nng", "handle", cfg.device_for("nng"), hosts, mode)
            c.unavailable = mq_type_unavailable("nng") or pool_api_missing(c.device)
            cases.append(c)
        return cases

    # -------------------------------------------------------------- run
    def run(self) -> None:
        groups = self.plan()
        self.progress({"event": "start"})
        # SIGTERM and SIGHUP end the run through the finally below: namespaces removed, workers killed.
        with stop_signals_raise(_exit_by_signal, (signal.SIGTERM, signal.SIGHUP), sigint_raises=True):
            try:
                self._start_bound()
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
                        self.notes.append(two_hosts_cpus_note(self.cfg.split_cpus))
                    try:
                        if self.cfg.links:
                            self._measure_links(hosts)
                        for _, name, cases in mine:
                            self._run_group(hosts, name, cases)
                    finally:
                        if hosts == "two":
                            self._leave_two_hosts()
            finally:
                self._stop_pairs(list(self.bounds.values()))
                self._kill_all()
                self._leave_two_hosts()

    def _start_bound(self) -> None:
        """The bound rows (memcpy for CPU payloads, the D2D copy for CUDA ones): one worker each
        for the whole run; each joins every group (see _run_group) and measures each size once,
        interleaved with the first group that has that size."""
        bounds = list(self.bounds.values())
        self.cases.extend(bounds)
        self.progress({"event": "total", "add": len(bounds) * len(self.cfg.all_sizes())})
        self._start_pairs("same", bounds)

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
    def _start_pairs(self, hosts: str, cases: list[Case]) -> None:
        """Start A and the Bs of every case (concurrently) and connect them; failures mark cases."""
        host_a, host_b = self._addr(hosts)
        started = []
        for c in cases:
            if c.unavailable:
                continue
            try:
                c.a = self._spawn("A", self._spec(c, host_a, hosts, "A"), hosts)
                started.append(c)
            except Exception as exc:
                c.unavailable = f"could not start: {exc}"
        for c in list(started):
            try:
                c.listen_info = c.a.recv("listening", CONNECT_TIMEOUT_S)  # type: ignore[union-attr]
                c.bs = [self._spawn("B", self._spec(c, host_b, hosts, "B", i), hosts)
                        for i in range(c.subscribers)]
            except WorkerFailed as exc:
                self._break(c, f"could not start: {exc}", None)
                started.remove(c)
        for c in list(started):
            try:
                for b in c.bs:
                    b.recv("listening", CONNECT_TIMEOUT_S)
                for p in c.procs:
                    p.send("connect", c.listen_info)
            except WorkerFailed as exc:
                self._break(c, f"could not start: {exc}", None)
                started.remove(c)
        for c in started:
            try:
                info = c.a.recv("ready", CONNECT_TIMEOUT_S)  # type: ignore[union-attr]
                for b in c.bs:
                    b.recv("ready", CONNECT_TIMEOUT_S)
                c.resolved_route = info.get("route")
            except WorkerFailed as exc:
                self._break(c, f"could not connect: {exc}", None)

    def _spec(self, c: Case, host: str, hosts: str, side: str, index: int = 0) -> dict[str, Any]:
        return {**c.spec(host, self.cfg.messages), "env": self._env(hosts, side), "index": index,
                "busy_poll": self.cfg.busy_poll}

    def _spawn(self, role: str, spec: dict[str, Any], hosts: str) -> WorkerProc:
        exe = None
        if hosts == "two" and role == "B":
            exe = self.two.wrapper()
        if hosts == "two" and self.cfg.split_cpus:
            spec = {**spec, "cpus": host_cpus(role)}
        p = WorkerProc(self.ctx, role, spec, executable=exe)
        self.procs.append(p)
        return p

    def _break(self, c: Case, why: str, size: int | None) -> None:
        if c.broken is None and c.unavailable is None:
            c.broken, c.broken_at = why, size
        for p in c.procs:
            p.kill()
        self.progress({"event": "note", "text": f"{c.name}: {why}"})

    def _stop_pairs(self, cases: list[Case]) -> None:
        procs = {p: c for c in cases for p in c.procs}
        for p, info in self._stop_procs(list(procs)).items():
            c = procs[p]
            if info.get("error"):
                self.notes.append(f"{c.name} side {p.role}: {info['error']}")
            a_route = next((r.route_taken for r in reversed(c.results.values()) if r.route_taken), c.resolved_route)
            if p.role == "B" and info.get("route") and a_route and info["route"] != a_route:
                self.notes.append(f"{c.name}: side B ended on route {info['route']} to A "
                                  f"(A: {a_route}): {info.get('route_reason')}")
            for size, devices in (info.get("arrived_on") or {}).items():
                if size in c.results:  # B's receipts: where CUDA payloads arrived, per size
                    c.results[size].arrived_on.update(devices)

    def _stop_procs(self, procs: list[WorkerProc]) -> dict[WorkerProc, dict[str, Any]]:
        """Ask workers to stop (they clean up sockets), then kill whatever is left. Returns
        what workers reported on the way out (``error``, ``arrived_on``)."""
        infos = {}
        for p in procs:
            if p.proc.is_alive():
                with contextlib.suppress(WorkerFailed):
                    p.send("stop")
        for p in procs:
            # Also from a worker that already exited: its answer waits in the pipe (a dead one
            # with nothing there raises at once).
            with contextlib.suppress(WorkerFailed):
                info = p.recv("stopped", 3.0)
                if info:
                    infos[p] = info
            p.proc.join(2.0)
            p.kill()
        return infos

    def _kill_all(self) -> None:
        for p in self.procs:
            p.kill()
        self.procs = [p for p in self.procs if p.proc.is_alive()]

    # -------------------------------------------------------------- groups
    def _raw_cases(self, hosts: str, name: str, mq_cases: list[Case], reason: str | None = None) -> list[Case]:
        if not self.cfg.baselines:
            return []
        raws: dict[tuple[str, str, int], Case] = {}  # (mq type, route, subscribers) -> its one case

        def raw(mq_type: str, route: str, device: str, mode: str, subscribers: int = 1) -> Case:
            if (mq_type, route, subscribers) not in raws:
                r = raws[mq_type, route, subscribers] = Case("raw", mq_type, route, device, hosts, mode,
                                                              subscribers=subscribers)
                if mq_type.startswith("raw:rpc"):
                    r.unavailable = rpc_unavailable(cuda=mq_type == "raw:rpc-cuda")
                r.unavailable = reason or r.unavailable
            return raws[mq_type, route, subscribers]

        for c in mq_cases:
            if c.mode == "fanout":
                # Its baseline is the same fan-out to one subscriber; raw pynng's fan-out (and to
                # one, its baseline) is a row of its own: what N processes cost on this machine.
                if name == "pynng" and c.subscribers > 1:
                    fam = _family(c, hosts)
                    r = raw("raw:pynng", fam, c.device, c.mode, c.subscribers)
                    r.baseline = raw("raw:pynng", fam, c.device, c.mode)
                continue
            if name == "pynng":
                fam = _family(c, hosts)
                c.baseline = raw("raw:pynng", fam, c.device, c.mode)
                # A row of its own, nobody's baseline: zero-copy sockets on host memory (not for
                # CUDA payloads, which it could only stage).
                if c.mode in ZMQ_MODES and zmq_installed() and c.device != "cuda":
                    raw("raw:pyzmq", fam, c.device, c.mode)
            elif c.mq_type == "torchrpc:cuda":
                c.baseline = raw("raw:rpc-cuda", "auto", c.device, c.mode)
            else:
                c.baseline = raw("raw:rpc", "auto", c.device, c.mode)
        return sorted(raws.values(), key=lambda r: (r.route, r.mq_type))

    def _link_cases(self, hosts: str, mq_cases: list[Case]) -> list[Case]:
        """Across hosts, the link row of each mode (``raw:socket``: a plain TCP stream into a
        warm buffer), interleaved with the rows like a baseline, with or without baselines: a
        row's ``link_fraction`` is this row's p50 over its own, same size, same moment. Once
        per mode and run (the first group that has the mode measures it)."""
        if hosts != "two" or not self.cfg.links:
            return []
        out = []
        for mode in sorted({c.mode for c in mq_cases if c.mode in ZMQ_MODES}):
            if (hosts, mode) not in self._linked:
                self._linked.add((hosts, mode))
                out.append(Case("raw", "raw:socket", "tcp", "cpu", hosts, mode))
        return out

    def _run_group(self, hosts: str, name: str, cases: list[Case]) -> None:
        self.progress({"event": "group", "text": f"{'two hosts' if hosts == 'two' else 'same host'}: "
                                                  f"starting {name} workers"})
        self._start_pairs(hosts, cases)
        raws = self._raw_cases(hosts, name, cases) + self._link_cases(hosts, cases)
        self._start_pairs(hosts, raws)
        everything = cases + raws
        self.cases.extend(everything)
        sizes = self.cfg.sizes_for(cases[0].mode)
        self.progress({"event": "total", "add": len(everything) * len(sizes)})
        try:
            for i, size in enumerate(sizes):
                bound = [b for b in self.bounds.values() if size not in b.results]
                self._run_size(everything + bound, size, i)
        finally:
            self._stop_pairs(everything)

    def _record_unrun(self, cases: list[Case]) -> None:
        self.cases.extend(cases)
        self.progress({"event": "total", "add": sum(len(self.cfg.sizes_for(c.mode)) for c in cases)})
        for c in cases:
            for size in self.cfg.sizes_for(c.mode):
                c.results[size] = SizeResult(done=True, skipped=c.unavailable)
                self.progress({"event": "advance", "text": f"{c.name} {format_size(size)}: skipped"})

    # -------------------------------------------------------------- one size
    def _run_size(self, cases: list[Case], size: int, index: int) -> None:
        live = []
        for c in cases:
            res = c.results[size] = SizeResult()
            if not c.alive:
                res.done = True
                res.skipped = c.unavailable or f"not run: {c.broken}" + (
                    f" (at {format_size(c.broken_at)})" if c.broken_at else "")
                self.progress({"event": "advance", "text": f"{c.name} {format_size(size)}: skipped"})
                continue
            prev = _previous(c, size)
            if prev is not None and prev.skipped and not prev.samples_ns:
                res.done = True
                res.skipped = f"not run: {format_size(cast(int, _prev_size(c, size)))} already reached --max-seconds"
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
                with contextlib.suppress(WorkerFailed):
                    c.a.request("free", None, "ok", 30.0)  # type: ignore[union-attr]

    def _step(self, c: Case, size: int, warm: bool) -> None:
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
                    timeout_s=hard_timeout(size), verify=warm)
        link0 = self.two.link_bytes() if (self.two is not None and c.hosts == "two") else None
        try:
            moved = c.copies(cfg.messages)[0] * size  # a stream sample is a whole burst
            out = c.a.request("batch", args, "batch", remaining + hard_timeout(moved) + 30)  # type: ignore[union-attr]
        except WorkerFailed as exc:
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
        res.arrival_ns += out.get("arrival_ns", [])
        res.arrived_on.update(out.get("arrived_on", []))
        if out.get("route"):  # the route A's node is on now (an rdma route may fall back to tcp)
            res.route_taken = out["route"]
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
                a = self._spawn("A", {"kind": "link", "route": route, "host": host_a,
                                      "env": self._env(hosts, "A")}, hosts)
                addr = a.recv("listening", CONNECT_TIMEOUT_S)
                b = self._spawn("B", {"kind": "link", "route": route, "host": host_b,
                                      "env": self._env(hosts, "B")}, hosts)
                b.recv("listening", CONNECT_TIMEOUT_S)
                a.send("connect", {})
                b.send("connect", addr)
                a.recv("ready", CONNECT_TIMEOUT_S)
                b.recv("ready", CONNECT_TIMEOUT_S)
                link0 = self.two.link_bytes() if hosts == "two" else None
                out = a.request("link", {"seconds": self.cfg.link_seconds}, "link",
                                self.cfg.link_seconds * 4 + 120)
                row.update(gbps=round(out["gbps"], 3), bytes=out["bytes"], seconds=round(out["seconds"], 4))
                if link0 is not None:
                    row["link_bytes"] = self.two.link_bytes() - link0
            except WorkerFailed as exc:
                row["error"] = str(exc)
            finally:
                self._stop_procs([p for p in (a, b) if p is not None])
            self.links.append(row)
            self.progress({"event": "note", "text": f"{label} ceiling: "
                                                     f"{row['gbps'] if row['gbps'] else row['error']} Gbit/s"})


def host_cpus(role: str) -> list[int] | None:
    """The CPUs of host ``role`` (A: the first half of ours, B: the rest) in a two-host run, or
    None with fewer than two. Two namespace hosts on one small machine otherwise share cores
    as the scheduler likes: on the 2-core VM a 640 MB one-way took 370-410 ms with both sides on
    one CPU and 155-185 ms on one each, and unpinned runs fell into the first mode now and then,
    for the whole run. Separate machines never share a core; but one core per host also
    serializes each side's threads: with it, 1.25 MB and 10 MB one-way rows got slower than raw
    pyzmq in 2 of 3 runs, so it is an option (``--split-cpus``), not the default."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return cpus[:half] if role == "A" else cpus[half:]


def two_hosts_cpus_note(split: bool) -> str:
    """What the report says of the CPUs the two namespace hosts ran on."""
    n = len(os.sched_getaffinity(0))
    if split and n >= 2:
        return f"two hosts: each namespace host's workers on its own {n // 2} of this machine's {n} CPUs (--split-cpus)"
    note = f"two hosts: both namespace hosts share this machine's {n} CPU{'s' if n > 1 else ''}"
    if n < 4:  # too few for each side of a large transfer to keep a core (host_cpus)
        note += (": a large transfer then also measures whether the scheduler put both sides on one "
                 "CPU (about 2x slower at 640 MB on a 2-core VM, any socket program alike); "
                 "--split-cpus gives each host its own")
    return note


def plan_bounds(cfg: BenchConfig) -> dict[str, Case]:
    """The physical-bound rows a run needs, by payload device: ``memcpy`` (one memcpy into warm
    host memory) where some row's payload is on the CPU, ``d2d`` (one device-to-device copy into
    a warm CUDA tensor) where some row's is on the GPU. Each row's ``x bound`` is to its
    device's bound."""
    devices = {cfg.device_for(t) for t in cfg.mq_types} or {"cpu"}
    bounds = {}
    for device, name in (("cpu", "memcpy"), ("cuda", "d2d")):
        if device in devices:
            bounds[device] = Case("bound", name, "warm", device, "same", "bound", subscribers=0)
    return bounds


def _owned_twins(cases: list[Case]) -> list[Case]:
    """For each mq case with a CUDA payload, its "view + copy" twin (``owned``): the receiver
    copies the view into an owned CUDA tensor before the payload counts as arrived, as a user
    who keeps it would (TensorPipe hands over an owned tensor). Same baseline rules."""
    twins = {c: Case("mq", c.mq_type, c.route, c.device, c.hosts, c.mode, subscribers=c.subscribers,
                     owned=True, unavailable=c.unavailable)
             for c in cases if c.kind == "mq" and c.device == "cuda" and c.route != "handle" and not c.owned}
    for c, twin in twins.items():  # a fan-out N +copy: to the same fan-out to one, +copy too
        if c.baseline is not None:
            twin.baseline = twins.get(c.baseline)
    return list(twins.values())


def _family(c: Case, hosts: str) -> str:
    """The raw pynng address family an nng row is compared with."""
    route = c.resolved_route or c.route
    if hosts == "two":
        return "tcp"
    if route in ("ipc", "shm", "inproc"):
        return "ipc"
    if route in ("auto", "handle"):  # never connected: what auto takes on one host
        return "ipc"
    return "tcp"


def _previous(c: Case, size: int) -> SizeResult | None:
    p = _prev_size(c, size)
    return c.results.get(p) if p is not None else None


def _prev_size(c: Case, size: int) -> int | None:
    smaller = [s for s in c.results if s < size]
    return max(smaller) if smaller else None


# ================================================================================== results

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
    rows = report_rows(runner.cases, runner.bounds, cfg)
    add_link_fractions(rows, runner.links)
    config = asdict(cfg)
    config["sizes"] = [format_size(s) for s in cfg.sizes]
    config["mode_sizes"] = {m: [format_size(s) for s in cfg.sizes_for(m)] for m in cfg.modes}
    config["seconds_total"] = round(time.monotonic() - started, 1)
    config["loadavg_before"] = load_before
    return Report(machine=machine_info(), rows=rows, links=runner.links, config=config,
                  targets=_targets(rows), notes=runner.notes, checks=gpu_checks(rows))
