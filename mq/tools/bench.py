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
import csv
import ctypes
import datetime as _dt
import gc
import importlib
import importlib.metadata
import importlib.util
import io
import json
import logging
import math
import multiprocessing as mp
import multiprocessing.spawn as mp_spawn
import os
import platform
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Sequence

from mq.errors import ConfigError

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

# ---------------------------------------------------------------------------------- sizes
KB, MB, GB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_SIZES = (1280, 20 * KB, 1280 * KB, 10 * MB, 40 * MB, 640 * MB, 1280 * MB)  # 1.25 KB .. 1.25 GB
MAX_SIZE = 2560 * MB  # 2.5 GB
_UNITS = {"": 1, "b": 1, "k": KB, "kb": KB, "kib": KB, "m": MB, "mb": MB, "mib": MB,
          "g": GB, "gb": GB, "gib": GB}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """``"1.25KB"`` -> 1280. Units are binary (KB = 1024 bytes, as in the design's table);
    KiB/MiB/GiB and bare byte counts are accepted too. At most 2.5 GB.

    Raises:
        ConfigError: not a size, zero, or larger than 2.5 GB.
    """
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ConfigError(f"{text!r} is not a size: use a number with B, KB, MB or GB, e.g. 1.25KB")
    value = round(float(m.group(1)) * _UNITS[unit])
    if value < 1:
        raise ConfigError(f"size {text!r} is less than one byte")
    if value > MAX_SIZE:
        raise ConfigError(f"size {text!r} is larger than the 2.5GB the benchmark allows")
    return value


def parse_sizes(text: str | Iterable[str]) -> list[int]:
    """``"1.25KB,20KB"`` -> ``[1280, 20480]`` (order kept, duplicates dropped)."""
    items = text.split(",") if isinstance(text, str) else list(text)
    items = [i for i in (s.strip() for s in items) if i]
    if not items:
        raise ConfigError("no sizes given: e.g. --sizes 1.25KB,20KB")
    return list(dict.fromkeys(parse_size(i) for i in items))


def format_size(n: int) -> str:
    """1280 -> ``"1.25 KB"``, 671088640 -> ``"640 MB"``."""
    for unit, mult in (("GB", GB), ("MB", MB), ("KB", KB)):
        if n >= mult:
            return f"{n / mult:.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{n} B"


# ---------------------------------------------------------------------------------- config
NNG_ROUTES = ("auto", "tcp", "ipc")
HOSTS = ("same", "two")
CONNECT_TIMEOUT_S = 90.0  # spawn + import torch + rendezvous, on a loaded 2-core machine


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


# Workers run a full garbage collection after every round trip of at least this many bytes,
# outside the timed region (B: after its echo has been sent), for every row kind, baselines
# included, so ratios stay fair. It was added when mq's codec still built reference cycles that
# kept large frames alive until the cyclic collector ran (an nng echo worker reached 9.3 GiB at
# 1.25 GB); the codec now breaks them, and this keeps RSS flat for the raw baselines too.
GC_EACH_BYTES = 64 * MB


def _nbytes(obj: Any) -> int:
    try:
        return int(obj.numel() * obj.element_size())
    except Exception:
        return 0


def _hard_timeout(size: int) -> float:
    """Longest a single round trip may take before the row is declared hung."""
    return 30.0 + size / 25e6


# ================================================================================== workers
# Everything below up to "orchestrator" runs in the spawned A/B processes.

def _echo(t: Any) -> Any:
    """The raw RPC baseline's remote function (module level: B imports it by name)."""
    return t


class _Endpoint:
    """One side of a measured pair. A: ``prepare`` -> ``connect`` -> ``batch``...; B:
    ``connect`` then echo until stopped."""

    def __init__(self, role: str, spec: dict[str, Any]):
        self.role = role
        self.spec = spec
        self.device = spec.get("device", "cpu")
        self.error: str | None = None
        self._payload: Any = None
        self._payload_size = -1

    # -- life cycle
    def prepare(self) -> dict[str, Any]:
        return {}

    def connect(self, peer: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    # -- A side
    def roundtrip(self, t: Any, timeout: float) -> tuple[int, Any]:
        raise NotImplementedError

    def payload(self, size: int) -> Any:
        import torch

        if self._payload_size != size:
            self._payload = None
            gc.collect()
            t = torch.empty(size, dtype=torch.uint8, device=self.device)
            if size <= 64 * MB:
                t.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
            else:  # faults every page in; random fill of GBs would take seconds
                t.fill_(0xA5)
                t[:: 1 << 20].copy_(torch.arange(t[:: 1 << 20].numel()).to(torch.uint8))
            t[-1] = 0x5A
            self._payload, self._payload_size = t, size
        return self._payload

    def free(self) -> None:
        self._payload, self._payload_size = None, -1
        gc.collect()

    def batch(self, size: int, n: int, warmup: int, warm_cap_s: float, cap_s: float,
              rt_hint_s: float, timeout_s: float, verify: bool) -> dict[str, Any]:
        t = self.payload(size)
        warm: list[int] = []
        samples: list[int] = []
        stopped = None
        start = time.monotonic()
        for i in range(warmup):
            ns, out = self.roundtrip(t, timeout_s)
            if verify and i == 0:
                _check_echo(t, out)
            del out
            warm.append(ns)
            if size >= GC_EACH_BYTES:
                gc.collect()
            if time.monotonic() - start >= min(warm_cap_s, cap_s):
                break
        last = (warm[-1] / 1e9) if warm else rt_hint_s
        for _ in range(n):
            if time.monotonic() - start + last > cap_s:
                stopped = "budget"
                break
            ns, out = self.roundtrip(t, timeout_s)
            del out
            samples.append(ns)
            last = ns / 1e9
            if size >= GC_EACH_BYTES:
                gc.collect()  # not timed; see GC_EACH_BYTES
        elapsed = time.monotonic() - start
        if size >= 256 * MB:  # don't sit on GBs while other rows of the group run
            self.free()
        return {"samples_ns": samples, "warm_ns": warm, "elapsed_s": elapsed, "stopped": stopped}


def _check_echo(t: Any, out: Any) -> None:
    import torch

    if not isinstance(out, torch.Tensor):
        raise RuntimeError(f"echo came back as {type(out).__name__}, not a tensor")
    if out.numel() != t.numel():
        raise RuntimeError(f"echo came back with {out.numel()} bytes, sent {t.numel()}")
    idx = sorted({0, t.numel() // 2, t.numel() - 1})
    a = t.flatten()[idx].cpu()
    b = out.flatten()[idx].to("cpu", torch.uint8)
    if not torch.equal(a, b):
        raise RuntimeError("echo came back with different bytes than were sent")


class _MqEndpoint(_Endpoint):
    """``mq.create(mq_type, ...)``: A sends and receives, B echoes on a thread."""

    def __init__(self, role: str, spec: dict[str, Any]):
        super().__init__(role, spec)
        self.mq_type = spec["mq_type"]
        self.node_id = 0 if role == "A" else 1
        self.q: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _create(self, **options: Any) -> Any:
        import mq

        q = mq.create(self.mq_type, self.node_id, {"bench"}, timeout=CONNECT_TIMEOUT_S, **options)
        q.listen()
        return q

    def prepare(self) -> dict[str, Any]:
        host = self.spec["host"]
        if self.role != "A":
            return {}
        if self.mq_type == "nng":
            self.q = self._create(listen_to=f"tcp://{host}:0", protocol=self.spec["route"])
            return {"address": self.q.addresses["tcp"]}
        from mq.launch import free_port

        return {"init_method": f"tcp://{host}:{free_port(host)}"}

    def connect(self, peer: dict[str, Any]) -> dict[str, Any]:
        if self.mq_type == "nng":
            if self.role == "B":
                self.q = self._create(listen_to=f"tcp://{self.spec['host']}:0",
                                      attach_to=[peer["address"]], protocol=self.spec["route"])
        else:
            self.q = self._create(world_size=2, init_method=peer["init_method"])
        other = 1 - self.node_id
        self.q.wait_for_peers(ids=[other], timeout=CONNECT_TIMEOUT_S)
        route = self.q.routes().get(other)
        if self.role == "B":
            self._thread = threading.Thread(target=self._echo_loop, daemon=True, name="bench-echo")
            self._thread.start()
        return {"route": getattr(route, "kind", None), "route_reason": getattr(route, "reason", None)}

    def _echo_loop(self) -> None:
        import mq

        q = self.q
        while not self._stop.is_set():
            try:
                m = q.recv(timeout=0.5)
            except mq.Timeout:
                continue
            except mq.MQError:
                return
            try:
                q.send(m.sender, m.topic, m.payload, timeout=_hard_timeout(1 << 31))
            except mq.MQError as exc:
                self.error = f"echo failed: {exc}"
            big = _nbytes(m.payload) >= GC_EACH_BYTES
            del m
            if big:
                gc.collect()  # after the echo left: A is receiving it meanwhile

    def roundtrip(self, t: Any, timeout: float) -> tuple[int, Any]:
        q = self.q
        t0 = time.perf_counter_ns()
        q.send(1, "bench", t, timeout=timeout)
        m = q.recv(timeout=timeout)
        t1 = time.perf_counter_ns()
        return t1 - t0, m.payload

    def close(self) -> None:
        self._stop.set()
        if self.q is not None:
            with contextlib.suppress(Exception):
                self.q.stop(timeout=2.0)


class _PynngEndpoint(_Endpoint):
    """Raw pynng ``Pair0``: the baseline of nng rows."""

    def __init__(self, role: str, spec: dict[str, Any]):
        super().__init__(role, spec)
        self.sock: Any = None
        self._thread: threading.Thread | None = None
        self._ipc_path: str | None = None
        self._timeout_ms = -2

    def prepare(self) -> dict[str, Any]:
        import pynng

        if self.role != "A":
            return {}
        self.sock = pynng.Pair0(recv_max_size=0)
        if self.spec["route"] == "ipc":
            self._ipc_path = os.path.join(tempfile.gettempdir(), f"mqbench-raw-{os.getpid()}.sock")
            self.sock.listen(f"ipc://{self._ipc_path}")
            return {"address": f"ipc://{self._ipc_path}"}
        listener = self.sock.listen(f"tcp://{self.spec['host']}:0")
        port = str(listener.local_address).rpartition(":")[2]
        return {"address": f"tcp://{self.spec['host']}:{port}"}

    def connect(self, peer: dict[str, Any]) -> dict[str, Any]:
        import pynng

        if self.role == "B":
            self.sock = pynng.Pair0(recv_max_size=0, send_timeout=int(CONNECT_TIMEOUT_S * 1000))
            self.sock.dial(peer["address"], block=True)
            self.sock.send(b"hello")
            self._thread = threading.Thread(target=self._echo_loop, daemon=True, name="bench-echo")
            self._thread.start()
        else:
            self.sock.recv_timeout = int(CONNECT_TIMEOUT_S * 1000)
            if self.sock.recv() != b"hello":
                raise RuntimeError("raw pynng peer sent an unexpected greeting")
            if self._ipc_path:  # connected (Pair0 takes one peer): drop the path now
                with contextlib.suppress(OSError):
                    os.unlink(self._ipc_path)
                self._ipc_path = None
        return {"route": "ipc" if self.spec["route"] == "ipc" else "tcp"}

    def _echo_loop(self) -> None:
        import pynng

        sock = self.sock
        while True:
            try:
                sock.send(sock.recv())
            except pynng.Closed:
                return
            except pynng.NNGException as exc:
                self.error = f"echo failed: {exc}"

    def roundtrip(self, t: Any, timeout: float) -> tuple[int, Any]:
        import torch

        ms = int(timeout * 1000)
        if ms != self._timeout_ms:
            self.sock.send_timeout = self.sock.recv_timeout = self._timeout_ms = ms
        cuda = t.device.type != "cpu"
        t0 = time.perf_counter_ns()
        self.sock.send((t.cpu() if cuda else t).numpy().tobytes())
        data = self.sock.recv()
        out = torch.frombuffer(data, dtype=torch.uint8)
        if cuda:
            out = out.to(t.device)
        t1 = time.perf_counter_ns()
        return t1 - t0, out

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        if self._ipc_path:
            with contextlib.suppress(OSError):
                os.unlink(self._ipc_path)


class _RpcEndpoint(_Endpoint):
    """Raw ``torch.distributed.rpc`` on TensorPipe: the baseline of torchrpc rows."""

    PEER = "bench1"

    def prepare(self) -> dict[str, Any]:
        if self.role != "A":
            return {}
        from mq.launch import free_port

        host = self.spec["host"]
        return {"init_method": f"tcp://{host}:{free_port(host)}"}

    def connect(self, peer: dict[str, Any]) -> dict[str, Any]:
        import torch.distributed.rpc as rpc

        rank = 0 if self.role == "A" else 1
        opts = rpc.TensorPipeRpcBackendOptions(init_method=peer["init_method"],
                                               rpc_timeout=_hard_timeout(MAX_SIZE))
        if self.spec.get("device_maps"):
            opts.set_device_map(f"bench{1 - rank}", {0: 0})
        rpc.init_rpc(f"bench{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
        self.rpc = rpc
        return {"route": "auto"}

    def roundtrip(self, t: Any, timeout: float) -> tuple[int, Any]:
        stage = t.device.type != "cpu" and not self.spec.get("device_maps")
        t0 = time.perf_counter_ns()
        out = self.rpc.rpc_sync(self.PEER, _echo, args=(t.cpu() if stage else t,), timeout=timeout)
        if stage:
            out = out.to(t.device)
        t1 = time.perf_counter_ns()
        return t1 - t0, out


class _StreamEndpoint(_Endpoint):
    """A plain socket stream (tcp or unix): the link's ceiling. A sends, B counts and acks."""

    CHUNK = 4 * MB

    def __init__(self, role: str, spec: dict[str, Any]):
        super().__init__(role, spec)
        self.server: socket.socket | None = None
        self.sock: socket.socket | None = None
        self._path: str | None = None

    def prepare(self) -> dict[str, Any]:
        if self.role != "A":
            return {}
        if self.spec["route"] == "unix":
            self._path = os.path.join(tempfile.gettempdir(), f"mqbench-stream-{os.getpid()}.sock")
            self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.server.bind(self._path)
            addr: Any = self._path
        else:
            self.server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.server.bind((self.spec["host"], 0))
            addr = list(self.server.getsockname())
        self.server.listen(1)
        self.server.settimeout(CONNECT_TIMEOUT_S)
        return {"address": addr}

    def connect(self, peer: dict[str, Any]) -> dict[str, Any]:
        if self.role == "A":
            assert self.server is not None
            self.sock, _ = self.server.accept()
            self.sock.settimeout(_hard_timeout(MAX_SIZE))
            self._unlink()  # connected: the path is not needed any more
        else:
            family = socket.AF_UNIX if self.spec["route"] == "unix" else socket.AF_INET
            self.sock = socket.socket(family, socket.SOCK_STREAM)
            self.sock.settimeout(CONNECT_TIMEOUT_S)
            addr = peer["address"]
            self.sock.connect(addr if isinstance(addr, str) else tuple(addr))
            self.sock.settimeout(None)
            threading.Thread(target=self._sink, daemon=True, name="bench-sink").start()
        return {"route": self.spec["route"]}

    def _sink(self) -> None:
        sock = self.sock
        assert sock is not None
        buf = bytearray(self.CHUNK)
        view = memoryview(buf)
        try:
            while True:
                head = b""
                while len(head) < 8:
                    part = sock.recv(8 - len(head))
                    if not part:
                        return
                    head += part
                (left,) = struct.unpack("!Q", head)
                while left:
                    got = sock.recv_into(view[: min(left, self.CHUNK)])
                    if not got:
                        return
                    left -= got
                sock.sendall(b"k")
        except OSError:
            return

    def _send(self, nbytes: int) -> float:
        sock = self.sock
        assert sock is not None
        buf = memoryview(bytearray(b"\x5a" * self.CHUNK))
        t0 = time.perf_counter()
        sock.sendall(struct.pack("!Q", nbytes))
        left = nbytes
        while left:
            n = min(left, self.CHUNK)
            sock.sendall(buf[:n])
            left -= n
        if sock.recv(1) != b"k":
            raise RuntimeError("stream peer did not acknowledge")
        return time.perf_counter() - t0

    def stream(self, seconds: float) -> dict[str, Any]:
        probe = 64 * MB
        dt = self._send(probe)
        nbytes = int(min(32 * GB, max(probe, probe / max(dt, 1e-6) * seconds)))
        dt = self._send(nbytes)
        return {"bytes": nbytes, "seconds": dt, "gbps": nbytes * 8 / dt / 1e9}

    def _unlink(self) -> None:
        if self._path:
            with contextlib.suppress(OSError):
                os.unlink(self._path)
            self._path = None

    def close(self) -> None:
        for s in (self.sock, self.server):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.close()
        self._unlink()


_ENDPOINTS = {"mq": _MqEndpoint, "pynng": _PynngEndpoint, "rpc": _RpcEndpoint, "stream": _StreamEndpoint}


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _worker(role: str, spec: dict[str, Any], conn: Any) -> None:
    """Entry point of a spawned A or B process; obeys commands from the orchestrator."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the orchestrator's to handle
    _die_with_parent()
    os.environ.update(spec.get("env") or {})
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # TensorPipe's shutdown warnings
    warnings.filterwarnings("ignore")
    # Worker failures come back through the pipe; library log noise (e.g. from stop()) would
    # only garble the progress display. MQ_BENCH_LOG=DEBUG|INFO|... shows it.
    level = os.environ.get("MQ_BENCH_LOG", "CRITICAL").upper()
    logging.basicConfig(level=getattr(logging, level, logging.CRITICAL))
    ep: _Endpoint | None = None
    try:
        ep = _ENDPOINTS[spec["kind"]](role, spec)
        conn.send(("listening", ep.prepare()))
        while True:
            try:
                cmd = conn.recv()
            except (EOFError, OSError):
                break  # the orchestrator is gone
            op, arg = cmd
            if op == "connect":
                conn.send(("ready", ep.connect(arg)))
            elif op == "batch":
                conn.send(("batch", ep.batch(**arg)))
            elif op == "stream":
                assert isinstance(ep, _StreamEndpoint)
                conn.send(("stream", ep.stream(**arg)))
            elif op == "free":
                ep.free()
                conn.send(("ok", None))
            elif op == "stop":
                conn.send(("stopped", {"error": ep.error}))
                break
    except BaseException as exc:  # report, then die: the orchestrator decides what it means
        with contextlib.suppress(Exception):
            conn.send(("error", f"{type(exc).__name__}: {exc}".strip(), traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):
            if ep is not None:
                ep.close()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(0)


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


@dataclass
class Report:
    """What :func:`run` measured: machine facts, rows (one per row kind and size), links."""

    machine: dict[str, Any]
    rows: list[dict[str, Any]]
    links: list[dict[str, Any]]
    config: dict[str, Any]
    targets: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"machine": self.machine, "config": self.config, "links": self.links,
                "targets": self.targets, "notes": self.notes, "rows": self.rows}


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
        cfg = self.cfg
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
ROW_FIELDS = (
    "kind", "mq_type", "route", "resolved_route", "hosts", "device", "size", "size_bytes",
    "samples", "warmup", "min_ms", "p50_ms", "p99_ms", "max_ms", "mean_ms", "gbps",
    "baseline", "baseline_p50_ms", "ratio", "skipped", "reason", "seconds", "link_bytes",
)


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


TARGETS = (
    ("nng 1.25 KB and 20 KB p50 <= 1.25x raw pynng (same address family)", 1.25,
     lambda r: r["mq_type"] == "nng" and r["size_bytes"] <= 20 * KB),
    ("torchrpc:cpu p50 <= 1.15x raw rpc_sync at every size", 1.15,
     lambda r: r["mq_type"] == "torchrpc:cpu"),
    ("no row slower than its baseline by more than 1.5x", 1.5, lambda r: r["kind"] == "mq"),
)


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for text, limit, pick in TARGETS:
        mine = [r for r in rows if pick(r) and r["ratio"] is not None]
        misses = [r for r in mine if r["ratio"] > limit]
        worst = max(mine, key=lambda r: r["ratio"], default=None)
        out.append({
            "target": text, "limit": limit, "rows_checked": len(mine),
            "met": bool(mine) and not misses,
            "misses": [f"{row_label(r)} {r['size']}: {r['ratio']:.3g}x" for r in misses],
            "worst": f"{row_label(worst)} {worst['size']}: {worst['ratio']:.3g}x" if worst else None,
        })
    return out


def row_label(r: dict[str, Any]) -> str:
    route = r["route"]
    if r.get("resolved_route") and r["resolved_route"] != route and r["kind"] == "mq":
        route = f"{route}->{r['resolved_route']}"
    where = " two-hosts" if r["hosts"] == "two" else ""
    dev = f" {r['device']}" if r["device"] != "cpu" else ""
    return f"{r['mq_type']}/{route}{dev}{where}"


# ================================================================================== machine
def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """Facts a reader needs to compare numbers: CPU, cores, memory, kernel, versions."""
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor() or platform.machine())
    mem = re.search(r"MemTotal:\s+(\d+) kB", _read("/proc/meminfo"))
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory": f"{int(mem.group(1)) / 2**20:.1f} GiB" if mem else None,
        "memory_gib": round(int(mem.group(1)) / 2**20, 1) if mem else None,
        "kernel": platform.release(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": None,
        "pynng": _version("pynng"),
        "numpy": _version("numpy"),
        "msgpack": _version("msgpack"),
        "mq": None,
        "git_commit": None,
        "gpus": [],
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "loadavg": _read("/proc/loadavg").split()[:3] or None,  # other work on the machine
        "command": " ".join(["mq", *sys.argv[1:]]) if sys.argv and sys.argv[0].endswith("mq") else None,
    }
    with contextlib.suppress(Exception):
        import mq

        info["mq"] = mq.__version__
    with contextlib.suppress(Exception):
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    with contextlib.suppress(Exception):
        here = os.path.dirname(os.path.abspath(__file__))
        done = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5)
        if done.returncode == 0:
            info["git_commit"] = done.stdout.strip()
    return info


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


# ================================================================================== output
def to_json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2)


def to_csv(report: Report) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(ROW_FIELDS), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in report.rows:
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in ROW_FIELDS})
    return buf.getvalue()


def fmt_ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if v < 100 else f"{v:.0f}"


def fmt_ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def pivot(report: Report, what: str = "p50") -> tuple[list[str], list[tuple[str, list[str]]]]:
    """Rows = row kinds, columns = sizes, cells = ``p50 ms (ratio x)``."""
    sizes: list[str] = list(dict.fromkeys(r["size"] for r in report.rows))
    table: dict[str, dict[str, str]] = {}
    for r in report.rows:
        cell = "skipped" if r["p50_ms"] is None else fmt_ms(r["p50_ms"])
        if r["ratio"] is not None:
            cell += f" ({r['ratio']:.2f}x)"
        if r["skipped"] and r["p50_ms"] is not None:
            cell += "*"
        table.setdefault(row_label(r), {})[r["size"]] = cell
    return sizes, [(label, [cells.get(s, "") for s in sizes]) for label, cells in table.items()]


def machine_line(m: dict[str, Any]) -> str:
    return (f"{m.get('cpu')}, {m.get('cores')} cores, {m.get('memory_gib')} GiB, kernel "
            f"{m.get('kernel')}, Python {m.get('python')}, torch {m.get('torch')}, pynng "
            f"{m.get('pynng')}, host {m.get('hostname')}"
            + (f", GPUs: {', '.join(m['gpus'])}" if m.get("gpus") else ", no GPU"))


def to_markdown(report: Report) -> str:
    m = report.machine
    out = ["# mq bench", "",
           f"Machine: {machine_line(m)}. Run {m.get('date_utc')}"
           + (f", commit {m['git_commit']}" if m.get("git_commit") else "") + ".", "",
           "Round trip: A sends a tensor, B echoes it (recv then send), A times send -> recv. "
           "Ratio = mq p50 / raw p50 of its baseline, measured interleaved in the same run. "
           "Gbit/s = 2 x size / p50. `*` = stopped by --max-seconds before its target sample count.", ""]
    if report.links:
        out += ["## Link ceilings (raw socket stream, one direction)", "", "| hosts | link | Gbit/s | note |",
                "|---|---|---|---|"]
        for l in report.links:
            note = l.get("error") or (f"{l['bytes'] / GB:.1f} GiB in {l['seconds']:.2f}s" if l.get("bytes") else "")
            out.append(f"| {l['hosts']} | {l['link']} | {l['gbps'] if l['gbps'] is not None else '-'} | {note} |")
        out.append("")
    sizes, prow = pivot(report)
    out += ["## p50 ms (ratio to baseline)", "", "| row | " + " | ".join(sizes) + " |",
            "|---|" + "---|" * len(sizes)]
    out += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in prow]
    out.append("")
    if report.targets:
        out += ["## Targets", ""]
        for t in report.targets:
            mark = "met" if t["met"] else ("no data" if not t["rows_checked"] else "MISSED")
            detail = f"; misses: {', '.join(t['misses'])}" if t["misses"] else ""
            out.append(f"- **{mark}**: {t['target']} (worst: {t['worst']}){detail}")
        out.append("")
    out += ["## All rows", "",
            "| row | size | samples | min ms | p50 ms | p99 ms | max ms | Gbit/s | baseline p50 ms | ratio | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report.rows:
        note = (r["reason"] or "").replace("|", "/")
        if r.get("link_bytes") is not None and r["samples"]:
            trips = r["samples"] + r["warmup"]
            note = (note + " " if note else "") + f"veth carried {r['link_bytes'] / max(1, 2 * r['size_bytes'] * trips):.2f}x the payload"
        out.append(f"| {row_label(r)} | {r['size']} | {r['samples']} | {fmt_ms(r['min_ms'])} | {fmt_ms(r['p50_ms'])} | "
                   f"{fmt_ms(r['p99_ms'])} | {fmt_ms(r['max_ms'])} | {r['gbps'] if r['gbps'] is not None else '-'} | "
                   f"{fmt_ms(r['baseline_p50_ms'])} | {fmt_ratio(r['ratio'])} | {note} |")
    if report.notes:
        out += ["", "## Notes", ""] + [f"- {n}" for n in report.notes]
    out.append("")
    return "\n".join(out)


def plot(report: Report, path: str) -> str:
    """Latency vs size (log-log, one line per row kind) and ratio vs size, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float, float | None]]] = {}
    kinds: dict[str, str] = {}
    for r in report.rows:
        if r["p50_ms"] is None:
            continue
        label = row_label(r)
        series.setdefault(label, []).append((r["size_bytes"], r["p50_ms"], r["ratio"]))
        kinds[label] = r["kind"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(15, 6.5), gridspec_kw={"width_ratios": [3, 2]})
    colors = plt.get_cmap("tab20").colors
    for i, (label, pts) in enumerate(series.items()):
        pts.sort()
        raw = kinds[label] == "raw"
        style = dict(color=colors[i % len(colors)], ls="--" if raw else "-",
                     marker=("x" if raw else "o") if "two-hosts" not in label else ("+" if raw else "s"),
                     lw=1.5, ms=4, label=label)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], **style)
        rp = [(p[0], p[2]) for p in pts if p[2] is not None]
        if rp:
            ax2.plot([p[0] for p in rp], [p[1] for p in rp], **style)
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xlabel("message size (bytes)")
        a.grid(True, which="both", alpha=0.3)
        sizes = sorted({r["size_bytes"] for r in report.rows})
        a.set_xticks(sizes)
        a.set_xticklabels([format_size(s).replace(" ", "") for s in sizes], rotation=45)
    ax.set_yscale("log")
    ax.set_ylabel("round trip p50 (ms)")
    ax.set_title("mq round trip vs raw baselines (dashed); squares: two hosts")
    ax.legend(fontsize=7)
    for y, c in ((1.0, "k"), (1.15, "g"), (1.25, "orange"), (1.5, "r")):
        ax2.axhline(y, color=c, lw=0.8, ls=":")
    ax2.set_ylabel("p50 ratio mq / raw baseline")
    ax2.set_title("ratio (targets 1.15 / 1.25 / 1.5)")
    ax2.legend(fontsize=7)
    fig.suptitle(machine_line(report.machine), fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(report: Report, out_dir: str, stem: str = "bench") -> list[str]:
    """Write ``stem``.json/.csv/.md into ``out_dir``; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for ext, text in (("json", to_json(report)), ("csv", to_csv(report)), ("md", to_markdown(report))):
        path = os.path.join(out_dir, f"{stem}.{ext}")
        with open(path, "w") as f:
            f.write(text)
        paths.append(path)
    return paths
