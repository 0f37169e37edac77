"""The worker side of ``mq bench``: what runs in the spawned A and B processes.

Each row kind has an endpoint class (mq's and the physical bounds here, the raw libraries' in
:mod:`mq.tools.bench.raw`, their base in :mod:`mq.tools.bench.endpoint`); the orchestrator
(:mod:`mq.tools.bench`) drives it over a pipe with ``connect`` / ``batch`` / ``free`` /
``stop`` commands (see :func:`worker`).
"""

from __future__ import annotations

import contextlib
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

from mq.launch.supervise import die_with_parent
from mq.tools.bench.endpoint import (
    CONNECT_TIMEOUT_S, STREAM_BATCH_WINDOW, Closed, Endpoint, echo_back, hard_timeout, host_array,
    recv_exactly,
)
from mq.tools.bench.raw import PynngEndpoint, RpcEndpoint, StreamEndpoint, ZmqEndpoint
from mq.tools.bench.units import GB, MAX_SIZE, MB


class _BoundEndpoint(Endpoint):
    """The physical bound, in A alone: one memcpy of the payload into warm memory (allocated
    once per size and faulted in before timing, as a reused pool slot would be)."""

    _dst: Any = None

    def connect(self, peer: dict[str, Any]) -> dict[str, Any]:
        return {"route": "warm"}

    def exchange(self, t: Any, timeout: float) -> tuple[int, Any]:
        import numpy as np

        src = host_array(t)
        if self._dst is None or self._dst.nbytes != src.nbytes:
            self._dst = None
            self._dst = np.empty_like(src)
            self._dst.fill(0)  # page faults are not part of the bound
        t0 = time.perf_counter_ns()
        np.copyto(self._dst, src)
        return time.perf_counter_ns() - t0, None

    def free(self) -> None:
        self._dst = None
        super().free()


class _D2DBoundEndpoint(Endpoint):
    """The physical bound of CUDA rows, in A alone: one ``dst.copy_(src)`` of the payload into
    a warm CUDA tensor of the same size on the same GPU (allocated and written once per size),
    timed by CUDA events around the copy (device time: no launch or host sync in it)."""

    _dst: Any = None
    _events: Any = None

    def connect(self, peer: dict[str, Any]) -> dict[str, Any]:
        return {"route": "warm"}

    def exchange(self, t: Any, timeout: float) -> tuple[int, Any]:
        import torch

        if self._dst is None or self._dst.numel() != t.numel():
            self._dst = None
            self._dst = torch.zeros_like(t)
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            torch.cuda.synchronize()
        start, end = self._events
        start.record()
        self._dst.copy_(t)
        end.record()
        end.synchronize()
        return round(start.elapsed_time(end) * 1e6), None

    def free(self) -> None:
        self._dst = None
        super().free()


class _MqEndpoint(Endpoint):
    """``mq.create(mq_type, ...)``: A is node 0, B (or fan-out subscriber ``index``) node
    1 + index. Route ``handle`` sends a payload allocated in mq's shared-memory pool; route
    ``rdma`` makes both nodes with ``rdma="tcp"`` (the rdma path over UCX's tcp transport) and
    links over tcp."""

    def __init__(self, role: str, spec: dict[str, Any]):
        super().__init__(role, spec)
        self.mq_type = spec["mq_type"]
        self.node_id = 0 if role == "A" else 1 + spec.get("index", 0)
        self.by_handle = spec["route"] == "handle"
        self.rdma = spec["route"] == "rdma"
        self.protocol = "auto" if self.by_handle else ("tcp" if self.rdma else spec["route"])
        self.q: Any = None
        self._timeout = CONNECT_TIMEOUT_S
        self._slot: Any = None

    def _create(self, **options: Any) -> Any:
        import mq

        if self.mode == "stream" and self.mq_type == "nng":
            options["batch_window"] = STREAM_BATCH_WINDOW  # what a streaming user turns on
        if self.spec.get("busy_poll") is not None:
            options["busy_poll"] = self.spec["busy_poll"]
        if self.rdma:  # other routes keep the default (auto: off without an RDMA device)
            options["rdma"] = "tcp"
        q = mq.create(self.mq_type, self.node_id, {"bench"}, timeout=CONNECT_TIMEOUT_S, **options)
        if self.mode == "fanout" and self.role == "B":
            q.subscribe("bench")  # before joining: the handshake carries it
        q.listen()
        return q

    def prepare(self) -> dict[str, Any]:
        host = self.spec["host"]
        if self.role != "A":
            return {}
        if self.mq_type == "nng":
            self.q = self._create(listen_to=f"tcp://{host}:0", protocol=self.protocol)
            return {"address": self.q.addresses["tcp"]}
        from mq.launch import free_port

        return {"init_method": f"tcp://{host}:{free_port(host)}"}

    def connect(self, peer: dict[str, Any]) -> dict[str, Any]:
        if self.mq_type == "nng":
            if self.role == "B":
                self.q = self._create(listen_to=f"tcp://{self.spec['host']}:0",
                                      attach_to=[peer["address"]], protocol=self.protocol)
        else:
            self.q = self._create(world_size=2, init_method=peer["init_method"])
        others = list(range(1, self.acks + 1)) if self.role == "A" else [0]
        self.q.wait_for_peers(ids=others, timeout=CONNECT_TIMEOUT_S)
        if self.role == "A" and self.mode == "fanout":
            self.q.wait_for_subscribers("bench", self.acks, timeout=CONNECT_TIMEOUT_S)
        if self.by_handle and not hasattr(self.q, "alloc"):
            raise RuntimeError("mq has no shared-memory pool API")
        if self.role == "B":
            import torch  # noqa: F401 (decoding the first tensor would import it: ~2 s, not a sample)

            if self.mode == "call":
                self.q.on("echo", echo_back)  # served by mq itself: no loop of ours
            else:
                self._serve_in_thread()
        return self.route_now()

    def route_now(self) -> dict[str, Any]:
        peer = 1 if self.role == "A" else 0
        try:
            route = self.q.routes().get(peer) if self.q is not None else None
        except Exception:  # stopping, or its peer gone: no route to report
            route = None
        return {"route": getattr(route, "kind", None), "route_reason": getattr(route, "reason", None)}

    # -- A
    def payload(self, size: int) -> Any:
        t = super().payload(size)
        if not self.by_handle:
            return t
        if self._slot is None or self._slot.nbytes != size:
            import numpy as np

            self._slot = None
            if t.is_cuda:  # mq's CUDA pool (pool_api_missing checked alloc takes a device)
                import torch

                self._slot = self.q.alloc((size,), torch.uint8, device=str(t.device))
                self._slot.copy_(t)
                torch.cuda.synchronize()
            else:
                self._slot = self.q.alloc((size,), np.uint8)
                self._slot[:] = t.numpy()
        return self._slot

    def free(self) -> None:
        self._slot = None
        super().free()

    def _set_timeout(self, timeout: float) -> None:
        self._timeout = timeout

    def _settle(self, t: Any, timeout: float) -> None:
        if self.by_handle:
            self.q.wait_released(t, timeout=timeout)

    def _send(self, t: Any) -> None:
        if self.mode != "fanout":
            self.q.send(1, "bench", t, timeout=self._timeout)
            return
        reached = self.q.publish("bench", t, timeout=self._timeout)
        if len(reached) != self.acks:
            raise RuntimeError(f"publish reached {len(reached)} of {self.acks} subscribers")

    def _recv_echo(self) -> Any:
        return self.q.recv(timeout=self._timeout).payload

    _recv_ack = _recv_echo

    def _call(self, t: Any) -> Any:
        return self.q.call(1, "echo", t, timeout=self._timeout)

    def _send_item(self, i: int, x: Any) -> None:
        self.q.send(1, "bench", {"i": i, "x": x}, timeout=self._timeout)

    # -- B
    def _b_arrive(self, m: Any) -> Any:
        import types

        try:
            t = self.gpu.ready(m.payload)  # type: ignore[union-attr]
        except Exception as exc:  # tell A at once (its next receive raises it), not by a timeout
            self.q.send(m.sender, "ack" if self.mode != "roundtrip" else m.topic,
                        f"receiver: {exc}", timeout=CONNECT_TIMEOUT_S)
            return None
        return types.SimpleNamespace(sender=m.sender, topic=m.topic, payload=t)

    def _b_recv(self, timeout: float) -> Any:
        import mq

        try:
            return self.q.recv(timeout=timeout)
        except mq.Timeout:
            return None
        except mq.MQError as exc:
            raise Closed() from exc

    def _b_echo(self, m: Any) -> None:
        self.q.send(m.sender, m.topic, m.payload, timeout=hard_timeout(1 << 31))

    def _b_counter(self, m: Any) -> int:
        return int(m.payload["i"])

    def _b_ack(self, value: Any) -> None:
        self.q.send(0, "ack", list(value) if isinstance(value, tuple) else value, timeout=CONNECT_TIMEOUT_S)

    def close(self) -> None:
        super().close()
        if self.q is not None:
            with contextlib.suppress(Exception):
                self.q.stop(timeout=2.0)




class _LinkEndpoint(Endpoint):
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
            self.sock.settimeout(hard_timeout(MAX_SIZE))
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
                head = recv_exactly(sock, 8)
                if head is None:
                    return
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

    def link(self, seconds: float) -> dict[str, Any]:
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


_ENDPOINTS = {"mq": _MqEndpoint, "pynng": PynngEndpoint, "zmq": ZmqEndpoint, "socket": StreamEndpoint,
              "rpc": RpcEndpoint,
              "bound": _BoundEndpoint, "d2d": _D2DBoundEndpoint, "link": _LinkEndpoint}


def worker(role: str, spec: dict[str, Any], conn: Any) -> None:
    """Entry point of a spawned A or B process; obeys commands from the orchestrator."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the orchestrator's to handle
    die_with_parent()
    os.environ.update(spec.get("env") or {})
    if spec.get("cpus"):  # a two-host run gives each host its own CPUs (bench.host_cpus)
        os.sched_setaffinity(0, spec["cpus"])
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # TensorPipe's shutdown warnings
    warnings.filterwarnings("ignore")
    # Worker failures come back through the pipe; library log noise (e.g. from stop()) would
    # only garble the progress display. MQ_BENCH_LOG=DEBUG|INFO|... shows it.
    level = os.environ.get("MQ_BENCH_LOG", "CRITICAL").upper()
    logging.basicConfig(level=getattr(logging, level, logging.CRITICAL))
    ep: Endpoint | None = None
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
                ep.warm_device()
                conn.send(("ready", ep.connect(arg)))
            elif op == "batch":
                conn.send(("batch", ep.batch(**arg)))
            elif op == "link":
                assert isinstance(ep, _LinkEndpoint)
                conn.send(("link", ep.link(**arg)))
            elif op == "free":
                ep.free()
                conn.send(("ok", None))
            elif op == "stop":
                # B's receipts end here: the devices its payloads arrived on, per size.
                conn.send(("stopped", {"error": ep.error, "arrived_on": ep.arrived(), **ep.route_now()}))
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
