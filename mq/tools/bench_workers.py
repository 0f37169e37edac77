"""The worker side of ``mq bench``: what runs in the spawned A and B processes.

Each row kind has an endpoint class; the orchestrator (:mod:`mq.tools.bench`) drives it over
a pipe with ``connect`` / ``batch`` / ``free`` / ``stop`` commands (see :func:`_worker`).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import traceback
import warnings
from typing import Any

from mq.tools.bench_units import GB, MB, MAX_SIZE

CONNECT_TIMEOUT_S = 90.0  # spawn + import torch + rendezvous, on a loaded 2-core machine

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
