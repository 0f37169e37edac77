"""The worker side of ``mq bench``: what runs in the spawned A and B processes.

Each row kind has an endpoint class; the orchestrator (:mod:`mq.tools.bench`) drives it over
a pipe with ``connect`` / ``batch`` / ``free`` / ``stop`` commands (see :func:`_worker`).
"""

from __future__ import annotations

import contextlib
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

from mq.supervise import die_with_parent
from mq.tools.bench_units import GB, MAX_SIZE, MB

CONNECT_TIMEOUT_S = 90.0  # spawn + import torch + rendezvous, on a loaded 2-core machine

# Workers run a full garbage collection after every round trip of at least this many bytes,
# outside the timed region (B: after its echo has been sent), for every row kind, baselines
# included, so ratios stay fair. It was added when mq's codec still built reference cycles that
# kept large frames alive until the cyclic collector ran (an nng echo worker reached 9.3 GiB at
# 1.25 GB); the codec now breaks them, and this keeps RSS flat for the raw baselines too.
GC_EACH_BYTES = 64 * MB
# nng stream rows run with batching on (the nng option batch_window, off by default).
STREAM_BATCH_WINDOW = 100e-6


def _nbytes(obj: Any) -> int:
    """Bytes a received message holds (an mq Message, tensor, array, bytes or zmq frame)."""
    obj = getattr(obj, "payload", obj)
    with contextlib.suppress(Exception):
        return int(obj.nbytes)
    with contextlib.suppress(Exception):
        return len(obj)
    return 0


def _hard_timeout(size: int) -> float:
    """Longest a single round trip may take before the row is declared hung."""
    return 30.0 + size / 25e6


# What A times for one sample, per mode (B's side in brackets):
#   roundtrip  send the payload, receive it back            [echo]
#   oneway     send the payload, receive a tiny ack         [drop it, ack with its arrival time]
#              also: arrival = B's clock when its recv returned - A's send start (one way
#              proper: perf_counter is CLOCK_MONOTONIC, one clock for every process of a kernel)
#   fanout     publish to every subscriber, receive N acks  [drop it, ack] (mq only)
#   stream     send `messages` small messages, receive one ack for the burst
#                                                           [check counters in order, ack]
#   call       one request/reply: mq `q.call(1, "echo", payload)`, raw torch RPC `rpc_sync`,
#              raw pynng `Req0`                              [q.on("echo", lambda x: x) | Rep0]
MODES = ("roundtrip", "oneway", "fanout", "stream", "call")


def _echo(t: Any) -> Any:
    """The raw RPC round trip's remote function (module level: B imports it by name)."""
    return t


def _ack(t: Any) -> int:
    """The raw RPC one-way remote function: a tiny answer instead of the payload (its arrival
    time, as every one-way ack)."""
    return time.perf_counter_ns()


class _Closed(Exception):
    """B's socket or queue was closed: stop serving."""


class _Sequence:
    """B's side of a stream: counts gaps in the counter sequence and, at the last message of
    each burst, gives the ack A checks: (next counter expected, gaps so far)."""

    def __init__(self, burst: int):
        self.burst, self.expected, self.gaps = burst, 0, 0

    def feed(self, i: int) -> tuple[int, int] | None:
        if i != self.expected:
            self.gaps += 1
        self.expected = i + 1
        return (self.expected, self.gaps) if self.expected % self.burst == 0 else None


def _check_stream_ack(ack: Any, sent: int) -> None:
    expected, gaps = (int(v) for v in ack)
    if gaps or expected != sent:
        raise RuntimeError(f"stream lost or reordered messages: sent {sent}, the receiver "
                           f"expects {expected} next and saw {gaps} gap(s)")


def _host(t: Any) -> Any:
    """A tensor's bytes as a host numpy array (raw sockets only carry host memory)."""
    return (t.cpu() if t.device.type != "cpu" else t).numpy()


class _Endpoint:
    """One side of a measured pair. A: ``prepare`` -> ``connect`` -> ``batch``...; B:
    ``connect`` then serve (echo, ack or count, by mode) until stopped.

    Message-carrying subclasses give primitives and the base runs every mode with them. A:
    ``_send(t)``, ``_recv_echo()``, ``_recv_ack()``, ``_send_item(i, x)``; B: ``_b_recv(timeout)``
    (None on timeout, raises :class:`_Closed`), ``_b_echo(m)``, ``_b_counter(m)``, ``_b_ack(v)``.
    """

    def __init__(self, role: str, spec: dict[str, Any]):
        self.role = role
        self.spec = spec
        self.mode = spec.get("mode", "roundtrip")
        self.acks = max(1, spec.get("subscribers", 1))  # A waits for one ack per subscriber
        self.burst = spec.get("messages", 1)  # messages per stream sample
        self.device = spec.get("device", "cpu")
        self.error: str | None = None
        self._payload: Any = None
        self._payload_size = -1
        self._sent = 0  # stream counter, continued across bursts
        self._arrival_ns: int | None = None  # the last one-way sample's arrival - send start
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # A and B collect after a big message (GC_EACH_BYTES), but not by handle, where nothing
        # big is allocated per sample (the payload is a pool slot, B gets a view of it), nor in
        # a fan-out (N subscribers collecting at once while A's next sample starts). A full
        # collection walks every object (torch's too) and leaves the caches cold: at 640 MB by
        # handle, a sample right after one took ~0.45 ms one way where 40 MB (no collection)
        # took ~0.12 ms, and 8 subscribers doubled a 100 MB fan-out.
        self._collect_big = spec.get("route") != "handle" and self.mode != "fanout"

    # -- life cycle
    def prepare(self) -> dict[str, Any]:
        return {}

    def connect(self, peer: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:  # let B's loop leave its socket before it is closed
            self._thread.join(2.0)

    # -- B side
    def _serve_in_thread(self) -> None:
        self._thread = threading.Thread(target=self._serve, daemon=True, name="bench-serve")
        self._thread.start()

    def _serve(self) -> None:
        seq = _Sequence(self.burst)
        while not self._stop.is_set():
            try:
                m = self._b_recv(0.5)
                if m is None:
                    continue
                arrived = time.perf_counter_ns()
                big = self._collect_big and _nbytes(m) >= GC_EACH_BYTES
                if self.mode in ("roundtrip", "call"):
                    self._b_echo(m)
                elif self.mode == "stream":
                    ack = seq.feed(self._b_counter(m))
                    if ack:
                        self._b_ack(ack)
                else:
                    del m  # drop the view first: a pooled slot can go back before the ack
                    self._b_ack(arrived)
                m = None
                if big:
                    gc.collect()  # after the reply left: A is receiving it meanwhile
            except _Closed:
                return
            except Exception as exc:  # A's next wait times out and reports the row skipped
                self.error = f"{self.mode} peer failed: {type(exc).__name__}: {exc}"
                return

    # -- A side
    def _set_timeout(self, timeout: float) -> None:
        pass

    def _settle(self, t: Any, timeout: float) -> None:
        """Untimed work between two samples (e.g. waiting until a pooled buffer is released)."""

    def _item(self, t: Any) -> Any:
        """The array each stream message carries (64 float32 at the default 256 bytes)."""
        x = _host(t)
        return x.view("float32") if x.nbytes % 4 == 0 else x

    def exchange(self, t: Any, timeout: float) -> tuple[int, Any]:
        """One timed sample of this mode: (nanoseconds, the echo or None)."""
        self._set_timeout(timeout)
        if self.mode == "stream":
            return self._stream(t)
        if self.mode == "call":
            t0 = time.perf_counter_ns()
            out = self._call(t)
            t1 = time.perf_counter_ns()
            return t1 - t0, out
        t0 = time.perf_counter_ns()
        self._send(t)
        if self.mode == "roundtrip":
            out = self._recv_echo()
        else:
            out = None
            for _ in range(self.acks):
                ack = self._recv_ack()
        t1 = time.perf_counter_ns()
        if self.mode == "oneway":
            self._arrival_ns = self._arrival(ack) - t0
        self._settle(t, timeout)
        return t1 - t0, out

    def _arrival(self, ack: Any) -> int:
        """B's arrival time from a one-way ack."""
        return int(ack)

    def _call(self, t: Any) -> Any:
        """One request/reply with the payload; returns the answer (the echo)."""
        self._send(t)
        return self._recv_echo()

    def _stream(self, t: Any) -> tuple[int, Any]:
        x = self._item(t)
        t0 = time.perf_counter_ns()
        for _ in range(self.burst):
            self._send_item(self._sent, x)
            self._sent += 1
        ack = self._recv_ack()
        t1 = time.perf_counter_ns()
        _check_stream_ack(ack, self._sent)
        return t1 - t0, None

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
        arrivals: list[int] = []
        stopped = None
        start = time.monotonic()
        for i in range(warmup):
            ns, out = self.exchange(t, timeout_s)
            if verify and i == 0 and out is not None:
                _check_echo(t, out)
            del out
            warm.append(ns)
            if self._collect_big and size >= GC_EACH_BYTES:
                gc.collect()
            if time.monotonic() - start >= min(warm_cap_s, cap_s):
                break
        last = (warm[-1] / 1e9) if warm else rt_hint_s
        for _ in range(n):
            if time.monotonic() - start + last > cap_s:
                stopped = "budget"
                break
            ns, out = self.exchange(t, timeout_s)
            del out
            samples.append(ns)
            if self._arrival_ns is not None:
                arrivals.append(self._arrival_ns)
                self._arrival_ns = None
            last = ns / 1e9
            if self._collect_big and size >= GC_EACH_BYTES:
                gc.collect()  # not timed; see GC_EACH_BYTES
        elapsed = time.monotonic() - start
        if size >= 256 * MB:  # don't sit on GBs while other rows of the group run
            self.free()
        return {"samples_ns": samples, "warm_ns": warm, "arrival_ns": arrivals, "elapsed_s": elapsed,
                "stopped": stopped}


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


class _BoundEndpoint(_Endpoint):
    """The physical bound, in A alone: one memcpy of the payload into warm memory (allocated
    once per size and faulted in before timing, as a reused pool slot would be)."""

    _dst: Any = None

    def connect(self, peer: dict[str, Any]) -> dict[str, Any]:
        return {"route": "warm"}

    def exchange(self, t: Any, timeout: float) -> tuple[int, Any]:
        import numpy as np

        src = _host(t)
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


class _MqEndpoint(_Endpoint):
    """``mq.create(mq_type, ...)``: A is node 0, B (or fan-out subscriber ``index``) node
    1 + index. Route ``handle`` sends a payload allocated in mq's shared-memory pool."""

    def __init__(self, role: str, spec: dict[str, Any]):
        super().__init__(role, spec)
        self.mq_type = spec["mq_type"]
        self.node_id = 0 if role == "A" else 1 + spec.get("index", 0)
        self.by_handle = spec["route"] == "handle"
        self.protocol = "auto" if self.by_handle else spec["route"]
        self.q: Any = None
        self._timeout = CONNECT_TIMEOUT_S
        self._slot: Any = None

    def _create(self, **options: Any) -> Any:
        import mq

        if self.mode == "stream" and self.mq_type == "nng":
            options["batch_window"] = STREAM_BATCH_WINDOW  # what a streaming user turns on
        if self.spec.get("busy_poll") is not None:
            options["busy_poll"] = self.spec["busy_poll"]
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
        route = self.q.routes().get(others[0])
        if self.role == "B":
            import torch  # noqa: F401 (decoding the first tensor would import it: ~2 s, not a sample)

            if self.mode == "call":
                self.q.on("echo", _echo)  # served by mq itself: no loop of ours
            else:
                self._serve_in_thread()
        return {"route": getattr(route, "kind", None), "route_reason": getattr(route, "reason", None)}

    # -- A
    def payload(self, size: int) -> Any:
        t = super().payload(size)
        if not self.by_handle:
            return t
        if self._slot is None or self._slot.nbytes != size:
            import numpy as np

            self._slot = None
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
    def _b_recv(self, timeout: float) -> Any:
        import mq

        try:
            return self.q.recv(timeout=timeout)
        except mq.Timeout:
            return None
        except mq.MQError as exc:
            raise _Closed() from exc

    def _b_echo(self, m: Any) -> None:
        self.q.send(m.sender, m.topic, m.payload, timeout=_hard_timeout(1 << 31))

    def _b_counter(self, m: Any) -> int:
        return int(m.payload["i"])

    def _b_ack(self, value: Any) -> None:
        self.q.send(0, "ack", list(value) if isinstance(value, tuple) else value, timeout=CONNECT_TIMEOUT_S)

    def close(self) -> None:
        super().close()
        if self.q is not None:
            with contextlib.suppress(Exception):
                self.q.stop(timeout=2.0)


class _SocketEndpoint(_Endpoint):
    """A raw socket library's endpoint: A listens on ``tcp`` (host, any port) or ``ipc`` (a
    unix socket path, unlinked once connected); B connects and greets."""

    def __init__(self, role: str, spec: dict[str, Any]):
        super().__init__(role, spec)
        self._ipc_paths: list[str] = []

    def _address(self, n: int) -> str:
        if self.spec["route"] == "ipc":
            path = os.path.join(tempfile.gettempdir(), f"mqbench-raw-{os.getpid()}-{n}.sock")
            self._ipc_paths.append(path)
            return f"ipc://{path}"
        return f"tcp://{self.spec['host']}"

    def _unlink(self) -> None:
        for path in self._ipc_paths:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._ipc_paths = []

    def connect(self, peer: dict[str, Any]) -> dict[str, Any]:
        """B dials and greets, then serves; A waits for the greeting (so the link is up before
        the first timed sample) and drops its unix socket paths."""
        if self.role == "B":
            self._dial(peer)
            self._greet()
            self._serve_in_thread()
        else:
            self._set_timeout(CONNECT_TIMEOUT_S)
            if self._greeting() != b"hello":
                raise RuntimeError(f"{self.spec['kind']} peer sent an unexpected greeting")
            self._unlink()  # connected: the paths are not needed any more
        return {"route": "ipc" if self.spec["route"] == "ipc" else "tcp"}

    def _recv_echo_array(self, buf: Any, device: Any) -> Any:
        import torch

        out = torch.frombuffer(buf, dtype=torch.uint8)
        return out.to(device) if device.type != "cpu" else out


class _PynngEndpoint(_SocketEndpoint):
    """Raw pynng, what a pynng user writes (bytes in, bytes out): ``Pair0`` for round trips and
    one-way, ``Push0``/``Pull0`` for streams (a second pair carries B's acks back), ``Pub0``
    (A) / ``Sub0`` (each B) for fan-outs, acked over ``Push0``/``Pull0``, ``Req0`` (A) /
    ``Rep0`` (B) for calls. The baseline of nng rows (fan-out: a row of its own)."""

    def __init__(self, role: str, spec: dict[str, Any]):
        super().__init__(role, spec)
        self.tx: Any = None
        self.rx: Any = None
        self._timeout_ms = -2

    def _open(self, **opts: Any) -> list[Any]:
        """Opens tx/rx; returns the sockets in the order A listens and B dials them."""
        import pynng

        if self.mode == "call":
            kind = pynng.Req0 if self.role == "A" else pynng.Rep0
            self.tx = self.rx = kind(recv_max_size=0, **opts)
            return [self.tx]
        if self.mode not in ("stream", "fanout"):
            self.tx = self.rx = pynng.Pair0(recv_max_size=0, **opts)
            return [self.tx]
        if self.mode == "fanout":  # NNG's pub shares one message with every pipe (no copy each)
            if self.role == "A":
                self.tx, self.rx = pynng.Pub0(**opts), pynng.Pull0(recv_max_size=0, **opts)
            else:
                self.rx, self.tx = pynng.Sub0(recv_max_size=0, **opts), pynng.Push0(**opts)
                self.rx.subscribe(b"")
        else:
            self.tx, self.rx = pynng.Push0(**opts), pynng.Pull0(recv_max_size=0, **opts)
        return [self.tx, self.rx] if self.role == "A" else [self.rx, self.tx]

    def prepare(self) -> dict[str, Any]:
        if self.role != "A":
            return {}
        addresses = []
        for n, sock in enumerate(self._open()):
            address = self._address(n)
            listener = sock.listen(address if address.startswith("ipc") else f"{address}:0")
            if not address.startswith("ipc"):
                address += ":" + str(listener.local_address).rpartition(":")[2]
            addresses.append(address)
        return {"addresses": addresses}

    def _dial(self, peer: dict[str, Any]) -> None:
        for sock, address in zip(self._open(send_timeout=int(CONNECT_TIMEOUT_S * 1000)), peer["addresses"]):
            sock.dial(address, block=True)

    def _greet(self) -> None:
        if self.mode != "call":  # a Rep0 speaks only when asked: A's greeting is a request
            self.tx.send(b"hello")

    def _greeting(self) -> bytes:
        if self.mode == "call":
            self.tx.send(b"hello")  # B's serve loop echoes it
        greetings = {self.rx.recv() for _ in range(self.acks)}  # fan-out: one per subscriber
        return greetings.pop() if len(greetings) == 1 else b"?"

    # -- A
    def _set_timeout(self, timeout: float) -> None:
        ms = int(timeout * 1000)
        if ms != self._timeout_ms:
            for sock in {self.tx, self.rx}:
                sock.send_timeout = sock.recv_timeout = ms
            self._timeout_ms = ms

    def _send(self, t: Any) -> None:
        self.tx.send(_host(t).tobytes())

    def _recv_echo(self) -> Any:
        return self._recv_echo_array(self.rx.recv(), self._payload.device)

    def _recv_ack(self) -> Any:
        m = self.rx.recv()
        return struct.unpack("<QQ", m) if self.mode == "stream" else m

    def _item(self, t: Any) -> Any:
        return super()._item(t).tobytes()

    def _send_item(self, i: int, x: Any) -> None:
        self.tx.send(struct.pack("<Q", i) + x)

    # -- B
    def _b_recv(self, timeout: float) -> Any:
        import pynng

        try:
            return self.rx.recv()  # blocks until a message or close()
        except pynng.Closed:
            raise _Closed() from None

    def _b_echo(self, m: Any) -> None:
        self.tx.send(m)

    def _b_counter(self, m: Any) -> int:
        return struct.unpack_from("<Q", m)[0]

    def _b_ack(self, value: Any) -> None:
        self.tx.send(struct.pack("<QQ", *value) if isinstance(value, tuple) else struct.pack("<q", value))

    def _arrival(self, ack: Any) -> int:
        return struct.unpack("<q", ack)[0]

    def close(self) -> None:
        self._stop.set()
        for sock in {self.tx, self.rx} - {None}:
            sock.close()  # wakes B's blocking recv
        super().close()
        self._unlink()


class _ZmqEndpoint(_SocketEndpoint):
    """Raw pyzmq ``PAIR`` with zero-copy sends and receives (``copy=False``, the receiver reads
    the frame's buffer in place). Round trip and one-way; not the baseline of an mq row."""

    def __init__(self, role: str, spec: dict[str, Any]):
        super().__init__(role, spec)
        self.ctx: Any = None
        self.sock: Any = None

    def _open(self) -> Any:
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PAIR)
        self.sock.linger = 0
        return self.sock

    def prepare(self) -> dict[str, Any]:
        if self.role != "A":
            return {}
        address = self._address(0)
        if address.startswith("ipc"):
            self._open().bind(address)
        else:
            address += f":{self._open().bind_to_random_port(address)}"
        return {"address": address}

    def _dial(self, peer: dict[str, Any]) -> None:
        self._open().connect(peer["address"])
        self.sock.sndtimeo = int(CONNECT_TIMEOUT_S * 1000)

    def _greet(self) -> None:
        self.sock.send(b"hello")

    def _greeting(self) -> bytes:
        return self.sock.recv()

    # -- A
    def _set_timeout(self, timeout: float) -> None:
        self.sock.rcvtimeo = self.sock.sndtimeo = int(timeout * 1000)

    def _send(self, t: Any) -> None:
        self.sock.send(_host(t), copy=False)

    def _recv_echo(self) -> Any:
        import numpy as np

        frame = self.sock.recv(copy=False)
        return self._recv_echo_array(np.frombuffer(frame.buffer, dtype=np.uint8), self._payload.device)

    def _recv_ack(self) -> Any:
        return self.sock.recv(copy=False)

    # -- B (only this thread touches the socket until close() has joined it)
    def _b_recv(self, timeout: float) -> Any:
        import zmq

        try:
            if not self.sock.poll(int(timeout * 1000)):
                return None
            return self.sock.recv(copy=False)
        except zmq.ZMQError as exc:
            raise _Closed() from exc

    def _b_echo(self, m: Any) -> None:
        self.sock.send(m, copy=False)

    def _b_ack(self, value: Any) -> None:
        self.sock.send(struct.pack("<q", value))

    def _arrival(self, ack: Any) -> int:
        return struct.unpack("<q", ack.bytes)[0]

    def close(self) -> None:
        super().close()
        if self.sock is not None:
            self.sock.close(linger=0)
            self.ctx.term()
        self._unlink()


class _RpcEndpoint(_Endpoint):
    """Raw ``torch.distributed.rpc`` on TensorPipe: the baseline of torchrpc rows (round trip
    and call: ``rpc_sync(_echo)``, one-way: ``rpc_sync(_ack)``)."""

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

    def exchange(self, t: Any, timeout: float) -> tuple[int, Any]:
        stage = t.device.type != "cpu" and not self.spec.get("device_maps")
        echo = self.mode in ("roundtrip", "call")
        t0 = time.perf_counter_ns()
        out = self.rpc.rpc_sync(self.PEER, _echo if echo else _ack, args=(t.cpu() if stage else t,),
                                timeout=timeout)
        if stage and echo:
            out = out.to(t.device)
        t1 = time.perf_counter_ns()
        if self.mode == "oneway":
            self._arrival_ns = int(out) - t0
        return t1 - t0, out if echo else None


class _LinkEndpoint(_Endpoint):
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


_ENDPOINTS = {"mq": _MqEndpoint, "pynng": _PynngEndpoint, "zmq": _ZmqEndpoint, "rpc": _RpcEndpoint,
              "bound": _BoundEndpoint, "link": _LinkEndpoint}


def _worker(role: str, spec: dict[str, Any], conn: Any) -> None:
    """Entry point of a spawned A or B process; obeys commands from the orchestrator."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the orchestrator's to handle
    die_with_parent()
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
            elif op == "link":
                assert isinstance(ep, _LinkEndpoint)
                conn.send(("link", ep.link(**arg)))
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
