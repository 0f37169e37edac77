"""The measured side of ``mq bench``: :class:`Endpoint`, one side of a pair, which runs every
mode (round trip, one-way, fan-out, stream, call) over a few primitives its subclasses give,
and what the endpoints share (the modes, the stream's sequence check, the timeouts)."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from typing import Any, Callable


from mq.tools.bench.units import MB


CONNECT_TIMEOUT_S = 90.0  # spawn + import torch + rendezvous, on a loaded 2-core machine
LAST_BYTE = 0x5A  # every payload's last byte: a receiver of a CUDA payload checks it once per size

# Workers run a full garbage collection after every round trip of at least this many bytes,
# outside the timed region (B: after its echo has been sent), for every row kind, baselines
# included, so ratios stay fair. It was added when mq's codec still built reference cycles that
# kept large frames alive until the cyclic collector ran (an nng echo worker reached 9.3 GiB at
# 1.25 GB); the codec now breaks them, and this keeps RSS flat for the raw baselines too.
GC_EACH_BYTES = 64 * MB
# nng stream rows run with batching on (the nng option batch_window, off by default).
STREAM_BATCH_WINDOW = 100e-6


def nbytes_of(obj: Any) -> int:
    """Bytes a received message holds (an mq Message, tensor, array, bytes or zmq frame)."""
    obj = getattr(obj, "payload", obj)
    with contextlib.suppress(Exception):
        return int(obj.nbytes)
    with contextlib.suppress(Exception):
        return len(obj)
    return 0


def recv_exactly(sock: Any, n: int) -> bytes | None:
    """``n`` bytes from a blocking socket, or None if the peer closed first."""
    out = b""
    while len(out) < n:
        part = sock.recv(n - len(out))
        if not part:
            return None
        out += part
    return out


def hard_timeout(size: int) -> float:
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


def echo_back(t: Any) -> Any:
    """The raw RPC round trip's remote function (module level: B imports it by name)."""
    return t


def ack_now(t: Any) -> int:
    """The raw RPC one-way remote function: a tiny answer instead of the payload (its arrival
    time, as every one-way ack)."""
    return time.perf_counter_ns()


def ack_ready(t: Any) -> list[Any]:
    """The raw RPC one-way remote function for CUDA payloads: makes the tensor ready on the GPU
    (TensorPipe runs the function on streams that wait for the received tensors; a host sync of
    the current one is "ready", as mq's receivers do; a tensor that came in host memory is
    copied there first), then acks its arrival time and the device it arrived on."""
    import torch

    where = str(t.device)
    if not t.is_cuda:
        t = t.to("cuda:0")
    torch.cuda.current_stream(t.device).synchronize()
    return [time.perf_counter_ns(), where]


def echo_ready(t: Any) -> Any:
    """The raw RPC round trip's remote function for CUDA payloads with device maps: the tensor
    ready on the GPU (as :func:`ack_ready`), then echoed."""
    import torch

    torch.cuda.current_stream(t.device).synchronize()
    return t


class Closed(Exception):
    """B's socket or queue was closed: stop serving."""


class StreamSequence:
    """B's side of a stream: counts gaps in the counter sequence and, at the last message of
    each burst, gives the ack A checks: (next counter expected, gaps so far)."""

    def __init__(self, burst: int):
        self.burst, self.expected, self.gaps = burst, 0, 0

    def feed(self, i: int) -> tuple[int, int] | None:
        if i != self.expected:
            self.gaps += 1
        self.expected = i + 1
        return (self.expected, self.gaps) if self.expected % self.burst == 0 else None


def check_stream_ack(ack: Any, sent: int) -> None:
    expected, gaps = (int(v) for v in ack)
    if gaps or expected != sent:
        raise RuntimeError(f"stream lost or reordered messages: sent {sent}, the receiver "
                           f"expects {expected} next and saw {gaps} gap(s)")


def cuda_device(device: str) -> str:
    """``cuda`` -> ``cuda:0``: a payload on the GPU is made on device 0 (every process of a pair
    sees the same GPUs, so cuda:0 is the same device both sides)."""
    return "cuda:0" if device == "cuda" else device


class GpuArrival:
    """What a receiver does with a CUDA payload before a sample ends, and what it saw.

    ``ready``: synchronize the receiving thread's current stream, so the tensor is usable ("view
    ready": mq's cuda_ipc view is ready on that stream); with ``owned`` first copy it into an
    owned, preallocated CUDA tensor (allocated and zeroed once per size, as a reused buffer
    would be) and synchronize after the copy ("view + copy": what TensorPipe hands over). A
    payload that arrived in host memory is copied onto the GPU either way: it must end up there.
    Records, per size, the devices payloads arrived on (``"cpu"``: staged through host memory)."""

    def __init__(self, device: str, owned: bool):
        self.device = cuda_device(device)
        self.owned = owned
        self.seen: dict[int, set[str]] = {}
        self._dst: Any = None

    def ready(self, t: Any) -> Any:
        """``t`` usable on the GPU (see the class); checks the last byte of the first payload of
        each size. Raises RuntimeError for anything else than a tensor (a peer's error report
        arrives as a string) or for wrong bytes."""
        import torch

        if isinstance(t, str):
            raise RuntimeError(t)
        if not isinstance(t, torch.Tensor):
            raise RuntimeError(f"payload arrived as {type(t).__name__}, not a tensor")
        first = int(t.nbytes) not in self.seen
        self.seen.setdefault(int(t.nbytes), set()).add(str(t.device))
        if self.owned or not t.is_cuda:
            if self._dst is None or self._dst.shape != t.shape or self._dst.dtype != t.dtype:
                self._dst = None
                self._dst = torch.zeros(t.shape, dtype=t.dtype, device=self.device)
            self._dst.copy_(t)
            t = self._dst
        torch.cuda.current_stream(t.device).synchronize()
        if first and t.dtype == torch.uint8 and t.numel():
            last = int(t.reshape(-1)[-1])
            if last != LAST_BYTE:
                raise RuntimeError(f"a {t.nbytes}-byte CUDA payload arrived with the wrong bytes "
                                   f"(last byte {last:#x}, sent {LAST_BYTE:#x})")
        return t

    def seen_by_size(self) -> dict[int, list[str]]:
        # list(): B's serve thread may add a size meanwhile (the copy is one step under the GIL).
        return {size: sorted(devs) for size, devs in list(self.seen.items())}

    def free(self) -> None:
        self._dst = None


def host_array(t: Any) -> Any:
    """A tensor's bytes as a host numpy array (raw sockets only carry host memory)."""
    return (t.cpu() if t.device.type != "cpu" else t).numpy()


class Endpoint:
    """One side of a measured pair. A: ``prepare`` -> ``connect`` -> ``batch``...; B:
    ``connect`` then serve (echo, ack or count, by mode) until stopped.

    Message-carrying subclasses give primitives and the base runs every mode with them. A:
    ``_send(t)``, ``_recv_echo()``, ``_recv_ack()``, ``_send_item(i, x)``; B: ``_b_recv(timeout)``
    (None on timeout, raises :class:`Closed`), ``_b_echo(m)``, ``_b_counter(m)``, ``_b_ack(v)``.
    """

    # Those primitives, declared for mypy (annotations only: a subclass without one has none).
    _send: Callable[..., Any]
    _recv_echo: Callable[[], Any]
    _recv_ack: Callable[[], Any]
    _send_item: Callable[[int, Any], None]
    _b_recv: Callable[[float], Any]
    _b_echo: Callable[[Any], None]
    _b_counter: Callable[[Any], int]
    _b_ack: Callable[[Any], None]

    def __init__(self, role: str, spec: dict[str, Any]):
        self.role = role
        self.spec = spec
        self.mode = spec.get("mode", "roundtrip")
        self.acks = max(1, spec.get("subscribers", 1))  # A waits for one ack per subscriber
        self.burst = spec.get("messages", 1)  # messages per stream sample
        self.device = cuda_device(spec.get("device", "cpu"))
        self.owned = bool(spec.get("owned"))
        # CUDA payloads: every receipt ends with the tensor on the GPU and synchronized (see
        # GpuArrival); None for CPU rows, which stay as they were.
        self.gpu = GpuArrival(self.device, self.owned) if self.device.startswith("cuda") else None
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
        # CUDA payloads leave no big host buffer behind (the payload is GPU memory, a received
        # one a pool view or TensorPipe's tensor), so collecting would only add untimed tens of
        # ms per sample where a sample takes ~1 ms, and hide a view that is not released.
        self._collect_big = (spec.get("route") != "handle" and self.mode != "fanout"
                             and not (self.gpu is not None and spec.get("kind") in ("mq", "rpc", "d2d")))

    def warm_device(self) -> None:
        """Create the CUDA context before the first sample (it takes up to seconds)."""
        if self.gpu is not None:
            import torch

            torch.zeros(1, device=self.device)
            torch.cuda.synchronize()

    def arrived(self) -> dict[int, list[str]]:
        """{size: devices payloads of that size arrived on} (CUDA rows; {} otherwise)."""
        return self.gpu.seen_by_size() if self.gpu is not None else {}

    def route_now(self) -> dict[str, Any]:
        """``{"route": kind, "route_reason": why}`` of the route this side is on to its peer
        now, where the library chooses one (mq); {} otherwise."""
        return {}

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
        seq = StreamSequence(self.burst)
        while not self._stop.is_set():
            try:
                m = self._b_recv(0.5)
                if m is None:
                    continue
                if self.gpu is not None and self.mode != "stream":
                    m = self._b_arrive(m)  # on the GPU and synchronized (owned: copied first)
                    if m is None:  # it was wrong: B reported why instead of echoing or acking
                        continue
                arrived = time.perf_counter_ns()
                big = self._collect_big and nbytes_of(m) >= GC_EACH_BYTES
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
            except Closed:
                return
            except Exception as exc:  # A's next wait times out and reports the row skipped
                self.error = f"{self.mode} peer failed: {type(exc).__name__}: {exc}"
                return

    def _b_arrive(self, m: Any) -> Any:
        """CUDA rows: make the received payload ready on the GPU (:class:`GpuArrival`); returns
        what B echoes (the view, or with ``owned`` the owned copy) or drops."""
        raise NotImplementedError(f"{type(self).__name__} does not receive CUDA payloads")

    # -- A side
    def _set_timeout(self, timeout: float) -> None:
        pass

    def _settle(self, t: Any, timeout: float) -> None:
        """Untimed work between two samples (e.g. waiting until a pooled buffer is released)."""

    def _item(self, t: Any) -> Any:
        """The array each stream message carries (64 float32 at the default 256 bytes)."""
        x = host_array(t)
        return x.view("float32") if x.nbytes % 4 == 0 else x

    def exchange(self, t: Any, timeout: float) -> tuple[int, Any]:
        """One timed sample of this mode: (nanoseconds, the echo or None)."""
        self._set_timeout(timeout)
        if self.mode == "stream":
            return self._stream(t)
        if self.mode == "call":
            t0 = time.perf_counter_ns()
            out = self._call(t)
            if self.gpu is not None:
                out = self.gpu.ready(out)
            t1 = time.perf_counter_ns()
            return t1 - t0, out
        t0 = time.perf_counter_ns()
        self._send(t)
        if self.mode == "roundtrip":
            out = self._recv_echo()
            if self.gpu is not None:
                out = self.gpu.ready(out)
        else:
            out = None
            for _ in range(self.acks):
                ack = self._recv_ack()
                if isinstance(ack, str):  # B found something wrong with what it received
                    raise RuntimeError(ack)
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
        check_stream_ack(ack, self._sent)
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
            t[-1] = LAST_BYTE
            if t.is_cuda:
                torch.cuda.synchronize()  # the fill is not part of the first sample
            self._payload, self._payload_size = t, size
        return self._payload

    def free(self) -> None:
        self._payload, self._payload_size = None, -1
        if self.gpu is not None:
            self.gpu.free()
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
                check_echo(t, out)
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
        arrived_on = self.arrived().get(size, [])
        if size >= 256 * MB:  # don't sit on GBs while other rows of the group run
            self.free()
        return {"samples_ns": samples, "warm_ns": warm, "arrival_ns": arrivals, "elapsed_s": elapsed,
                "stopped": stopped, "arrived_on": arrived_on, **self.route_now()}


def check_echo(t: Any, out: Any) -> None:
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


