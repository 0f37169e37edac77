"""The raw baselines of ``mq bench``: the same pair measured in raw pynng, raw pyzmq and raw
torch RPC (what a user of those libraries would write), each an :class:`Endpoint`."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import tempfile
import time
from typing import Any, Callable

from mq.tools.bench.endpoint import (
    CONNECT_TIMEOUT_S, Closed, Endpoint, ack_now, ack_ready, echo_back, echo_ready, hard_timeout,
    host_array, recv_exactly,
)
from mq.tools.bench.units import MAX_SIZE


class SocketEndpoint(Endpoint):
    """A raw socket library's endpoint: A listens on ``tcp`` (host, any port) or ``ipc`` (a
    unix socket path, unlinked once connected); B connects and greets."""

    # What each library gives, declared for mypy (annotations only, no attributes).
    _dial: Callable[[dict[str, Any]], None]
    _greet: Callable[[], None]
    _greeting: Callable[[], bytes]

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

    def _b_arrive(self, m: Any) -> Any:
        """A CUDA payload sent as bytes goes back onto the GPU (what a user of the library
        does); B echoes it from there (:meth:`_b_echo` takes it off again)."""
        import torch

        return self.gpu.ready(torch.frombuffer(self._b_buffer(m), dtype=torch.uint8))  # type: ignore[union-attr]

    def _b_buffer(self, m: Any) -> Any:
        return m


class PynngEndpoint(SocketEndpoint):
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
        self.tx.send(host_array(t).tobytes())

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
            raise Closed() from None

    def _b_echo(self, m: Any) -> None:
        self.tx.send(m if isinstance(m, bytes) else host_array(m).tobytes())

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


class ZmqEndpoint(SocketEndpoint):
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
        self.sock.send(host_array(t), copy=False)

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
            raise Closed() from exc

    def _b_buffer(self, m: Any) -> Any:
        return m.buffer

    def _b_echo(self, m: Any) -> None:
        self.sock.send(host_array(m) if hasattr(m, "is_cuda") else m, copy=False)

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


class StreamEndpoint(SocketEndpoint):
    """The link itself: one plain TCP connection, each message an 8-byte length and the bytes,
    sent from the payload's memory and received into a warm buffer reused per size (the best
    a hand-written socket program does). Round trip and one-way; on two hosts it is the "link"
    row every row's ``link_fraction`` is measured against (see :func:`add_link_fractions`)."""

    _LEN = struct.Struct("<Q")

    def __init__(self, role: str, spec: dict[str, Any]):
        super().__init__(role, spec)
        self.server: socket.socket | None = None
        self.sock: socket.socket | None = None
        self._buf = bytearray()

    def prepare(self) -> dict[str, Any]:
        if self.role != "A":
            return {}
        host = self.spec["host"]
        self.server = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        return {"address": [host, self.server.getsockname()[1]]}

    def _dial(self, peer: dict[str, Any]) -> None:
        self._use(socket.create_connection(tuple(peer["address"]), CONNECT_TIMEOUT_S))

    def _use(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(hard_timeout(MAX_SIZE))
        self.sock = sock

    def _greet(self) -> None:
        assert self.sock is not None
        self.sock.sendall(b"hello")

    def _greeting(self) -> bytes:
        assert self.server is not None
        self.server.settimeout(CONNECT_TIMEOUT_S)
        sock, _ = self.server.accept()
        self._use(sock)
        return self._exactly(5)

    def _exactly(self, n: int) -> bytes:
        out = recv_exactly(self.sock, n)
        if out is None:
            raise Closed()
        return out

    def _message(self) -> memoryview:
        """The next message, in the warm buffer (valid until the next one)."""
        (n,) = self._LEN.unpack(self._exactly(8))
        if len(self._buf) != n:
            self._buf = bytearray(n)  # a new size: fault it in once, outside the next sample
        view = memoryview(self._buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:])  # type: ignore[union-attr]
            if not k:
                raise Closed()
            got += k
        return view

    def _put(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self.sock.sendall(self._LEN.pack(len(view)))  # type: ignore[union-attr]
        self.sock.sendall(view)  # type: ignore[union-attr]

    # -- A
    def _set_timeout(self, timeout: float) -> None:
        if self.sock is not None:  # None while A waits for B to connect (the greeting)
            self.sock.settimeout(timeout)

    def _send(self, t: Any) -> None:
        self._put(host_array(t))

    def _recv_echo(self) -> Any:
        import numpy as np

        return self._recv_echo_array(np.frombuffer(self._message(), dtype=np.uint8), self._payload.device)

    def _recv_ack(self) -> Any:
        return self._exactly(8)

    # -- B
    def _b_recv(self, timeout: float) -> Any:
        try:
            if not select.select([self.sock], [], [], timeout)[0]:  # type: ignore[type-var]  # B dialled: a socket
                return None
            return self._message()
        except (OSError, ValueError) as exc:
            raise Closed() from exc

    def _b_echo(self, m: Any) -> None:
        self._put(m)

    def _b_ack(self, value: Any) -> None:
        self.sock.sendall(struct.pack("<q", value))  # type: ignore[union-attr]

    def _arrival(self, ack: Any) -> int:
        return struct.unpack("<q", ack)[0]

    def close(self) -> None:
        self._stop.set()
        for s in (self.sock, self.server):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
        super().close()


class RpcEndpoint(Endpoint):
    """Raw ``torch.distributed.rpc`` on TensorPipe: the baseline of torchrpc rows (round trip
    and call: ``rpc_sync(echo_back)``, one-way: ``rpc_sync(ack_now)``)."""

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
                                               rpc_timeout=hard_timeout(MAX_SIZE))
        if self.spec.get("device_maps"):
            opts.set_device_map(f"bench{1 - rank}", {0: 0})
        rpc.init_rpc(f"bench{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
        self.rpc = rpc
        return {"route": "auto"}

    def exchange(self, t: Any, timeout: float) -> tuple[int, Any]:
        """One ``rpc_sync``. A CUDA payload with device maps travels as a CUDA tensor (cuda:0
        to cuda:0) and B's function makes it ready on the GPU (:func:`ack_ready`,
        :func:`echo_ready`); without device maps it goes through host memory (staged)."""
        maps = bool(self.spec.get("device_maps"))
        stage = t.device.type != "cpu" and not maps
        echo = self.mode in ("roundtrip", "call")
        if self.gpu is None:
            fn = echo_back if echo else ack_now
        else:
            fn = (echo_ready if maps else echo_back) if echo else ack_ready
        t0 = time.perf_counter_ns()
        out = self.rpc.rpc_sync(self.PEER, fn, args=(t.cpu() if stage else t,), timeout=timeout)
        if echo and self.gpu is not None:
            out = self.gpu.ready(out)  # the echo on the GPU, synchronized (staged: copied there)
        t1 = time.perf_counter_ns()
        if self.mode == "oneway":
            if self.gpu is not None:  # [arrival time, the device B got it on]
                out, where = out
                self.gpu.seen.setdefault(int(t.nbytes), set()).add(where)
            self._arrival_ns = int(out) - t0
        return t1 - t0, out if echo else None
