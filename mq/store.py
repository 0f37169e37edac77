"""The rendezvous store of ``tcp://`` and ``env://`` for backends that do not run on torch:
node 0 serves it from a thread, every node sets its entry and waits for everyone's. Importing
torch for its TCPStore cost each process ~1 CPU-second and ~180 MB before its first message (a
fleet of collectors stepping numpy environments pays that N times, on busy cores).

The wire: every message is a 4-byte big-endian length, then msgpack.

- ``["set", key, value]`` answers ``["ok"]``;
- ``["wait", [keys], seconds]`` answers ``["ok", [values]]`` once every key is set, or
  ``["missing", [keys]]`` when ``seconds`` pass first.

The store trusts nobody and nobody trusts it: values are opaque bytes that nodes sign and check
(:func:`mq.rendezvous.sign_entry`). A stranger can only fill it up to its bounds (keys,
connections, message size), and a connection that sends nonsense or stalls mid-message is
closed.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import struct
import threading
import time
from typing import Any, NamedTuple

import msgpack

from mq.node import waits
from mq.errors import ProtocolError, Timeout

log = logging.getLogger("mq.store")

MAX_MESSAGE = 1 << 20  # an entry is a few hundred bytes; a wait for 10,000 keys is ~100 KB
_LENGTH = struct.Struct(">I")
_IDLE_S = 30.0  # the store's loop looks at least this often (nothing is due while idle)
_STALLED_S = 10.0  # a connection that began a message and sent nothing more for this long is closed
_RETRY_S = (0.02, 0.5)  # first and longest pause between attempts to reach a store not up yet


class StoreServer:
    """The store node 0 serves on ``port`` of every interface (as torch's TCPStore does), until
    :meth:`close`. ``world_size`` bounds what it keeps: keys and connections a few per node."""

    def __init__(self, port: int, world_size: int):
        self.max_keys = 64 + 8 * world_size
        self.max_conns = 64 + 4 * world_size
        if socket.has_dualstack_ipv6():
            self._sock = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True,
                                              backlog=min(4096, self.max_conns))
        else:
            self._sock = socket.create_server(("", port), backlog=min(4096, self.max_conns))
        self._sock.setblocking(False)
        self.port = self._sock.getsockname()[1]
        self._values: dict[str, bytes] = {}
        self._conns: dict[socket.socket, _Conn] = {}
        self._waiting: list[_Wait] = []
        self._select = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._select.register(self._sock, selectors.EVENT_READ)
        self._select.register(self._wake_r, selectors.EVENT_READ)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, daemon=True, name="mq-rendezvous-store")
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        waits.join(self._thread, 2.0)

    def _serve(self) -> None:
        try:
            while not self._closed:
                for key, _ in self._select.select(self._next_timeout()):
                    if key.fileobj is self._sock:
                        self._accept()
                    elif key.fileobj is not self._wake_r:
                        self._read(self._conns[key.fileobj])  # type: ignore[index]
                self._expire(time.monotonic())
        finally:
            for conn in list(self._conns.values()):
                self._drop(conn)
            self._select.close()
            for s in (self._sock, self._wake_r, self._wake_w):
                s.close()

    def _next_timeout(self) -> float:
        """Until the next thing due: a wait's deadline, a stalled connection's; a store nobody
        uses sleeps (a request or close() wakes it): it serves a job that may idle for days."""
        now = time.monotonic()
        due = [w.deadline for w in self._waiting]
        due += [at for c in self._conns.values() if (at := c.stalls_at())]
        return max(0.0, min(due, default=now + _IDLE_S) - now)

    def _accept(self) -> None:
        try:
            sock, _ = self._sock.accept()
        except OSError:
            return
        if len(self._conns) >= self.max_conns:
            log.warning("rendezvous store: refused a connection: %d are open (a stranger filling it?)",
                        len(self._conns))
            sock.close()
            return
        sock.setblocking(False)
        self._conns[sock] = _Conn(sock)
        self._select.register(sock, selectors.EVENT_READ)

    def _read(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(conn)
            return
        try:
            for request in conn.take(chunk):
                self._handle(conn, request)
        except (ProtocolError, ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
                msgpack.StackError) as exc:
            log.warning("rendezvous store: closed a connection that sent a bad request: %s", exc)
            self._drop(conn)

    def _handle(self, conn: _Conn, request: Any) -> None:
        op = request[0] if type(request) is list and request else None
        if op == "set" and len(request) == 3 and type(request[1]) is str and type(request[2]) is bytes:
            if request[1] not in self._values and len(self._values) >= self.max_keys:
                raise ProtocolError(f"the store holds its limit of {self.max_keys} keys")
            self._values[request[1]] = request[2]
            conn.send(["ok"])
            for w in self._waiting:
                w.missing.discard(request[1])
            self._expire(time.monotonic())  # waits this set completed are answered now
        elif (op == "wait" and len(request) == 3 and type(request[1]) is list and len(request[1]) <= self.max_keys
              and all(type(k) is str for k in request[1]) and type(request[2]) in (int, float)):
            keys = request[1]
            deadline = time.monotonic() + max(0.0, min(request[2], 86400.0))
            self._waiting.append(_Wait(conn, keys, {k for k in keys if k not in self._values}, deadline))
            self._expire(time.monotonic())
        else:
            raise ProtocolError(f"not a store request: {str(request)[:80]}")

    def _expire(self, now: float) -> None:
        """Answer the waits whose keys are all set, or whose time is up; close stalled conns."""
        still = []
        for w in self._waiting:
            if not w.missing:
                w.conn.send(["ok", [self._values[k] for k in w.keys]])
            elif now >= w.deadline:
                w.conn.send(["missing", [k for k in w.keys if k in w.missing]])
            elif w.conn.open:
                still.append(w)
        self._waiting = still
        for conn in [c for c in self._conns.values() if c.stalled(now) or not c.open]:
            self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock, None) is not None:
            self._select.unregister(conn.sock)
        conn.close()


class _Wait(NamedTuple):
    """A client waiting for ``keys``: those still unset, and until when it waits."""

    conn: _Conn
    keys: list[str]
    missing: set[str]
    deadline: float


class _Conn:
    """One client connection of the server: the bytes of its unfinished message."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.open = True
        self._buf = bytearray()
        self._since = 0.0  # when the unfinished message began (0: none)

    def take(self, chunk: bytes) -> list[Any]:
        """The whole requests ``chunk`` completes, decoded."""
        self._buf += chunk
        out = []
        while len(self._buf) >= _LENGTH.size:
            (n,) = _LENGTH.unpack_from(self._buf)
            if n > MAX_MESSAGE:
                raise ProtocolError(f"a message of {n} bytes (at most {MAX_MESSAGE})")
            if len(self._buf) < _LENGTH.size + n:
                break
            out.append(msgpack.unpackb(bytes(self._buf[_LENGTH.size:_LENGTH.size + n]), raw=False))
            del self._buf[:_LENGTH.size + n]
        self._since = (self._since or time.monotonic()) if self._buf else 0.0
        return out

    def stalled(self, now: float) -> bool:
        return bool(self._since) and now - self._since > _STALLED_S

    def stalls_at(self) -> float:
        """When an unfinished message makes it stalled (0.0: none is unfinished)."""
        return self._since + _STALLED_S + 0.01 if self._since else 0.0

    def send(self, message: Any) -> None:
        """Answer (small: it fits the socket's buffer; a client that does not read is dropped)."""
        body = msgpack.packb(message, use_bin_type=True)
        try:
            self.sock.setblocking(True)
            self.sock.settimeout(1.0)
            self.sock.sendall(_LENGTH.pack(len(body)) + body)
            self.sock.setblocking(False)
        except OSError:
            self.open = False

    def close(self) -> None:
        self.open = False
        self.sock.close()


class StoreClient:
    """A node's connection to the store at ``host:port``; tries to reach it until ``timeout``
    (node 0 may start after us).

    Raises:
        Timeout: the store could not be reached in time.
    """

    def __init__(self, host: str, port: int, timeout: float):
        deadline = time.monotonic() + timeout
        pause, last = _RETRY_S[0], None
        while True:
            try:
                self._sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
                break
            except OSError as exc:
                last = exc
            if time.monotonic() + pause > deadline:
                raise Timeout(f"no rendezvous store answered at {host}:{port} within {timeout:g}s ({last})")
            waits.sleep(pause)
            pause = min(pause * 2, _RETRY_S[1])
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def set(self, key: str, value: bytes) -> None:
        if self._ask(["set", key, value], 30.0) != ["ok"]:
            raise ProtocolError("the rendezvous store did not take our entry")

    def wait(self, keys: list[str], timeout: float) -> list[bytes]:
        """Every key's value, once all are set.

        Raises:
            Missing: ``timeout`` passed first (it names the keys still unset).
        """
        answer = self._ask(["wait", keys, timeout], timeout + 5.0)
        if type(answer) is list and len(answer) == 2 and answer[0] in ("ok", "missing") and type(answer[1]) is list:
            if answer[0] == "ok" and len(answer[1]) == len(keys) and all(type(v) is bytes for v in answer[1]):
                return answer[1]
            if answer[0] == "missing":
                raise Missing(answer[1])
        raise ProtocolError("the rendezvous store's answer is not one (is something else listening there?)")

    def close(self) -> None:
        self._sock.close()

    def _ask(self, request: Any, timeout: float) -> Any:
        body = msgpack.packb(request, use_bin_type=True)
        self._sock.settimeout(timeout)
        try:
            self._sock.sendall(_LENGTH.pack(len(body)) + body)
            (n,) = _LENGTH.unpack(self._read(_LENGTH.size))
            if n > MAX_MESSAGE:
                raise ProtocolError(f"the rendezvous store answered {n} bytes (is something else listening there?)")
            return msgpack.unpackb(self._read(n), raw=False)
        except TimeoutError:
            raise Timeout(f"the rendezvous store did not answer within {timeout:g}s") from None
        except OSError as exc:
            raise ProtocolError(f"lost the connection to the rendezvous store ({exc}): node 0 stopped, or it "
                                "refused us (see node 0's log)") from None
        except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as exc:
            raise ProtocolError(f"the rendezvous store's answer is not msgpack ({exc}): is something else "
                                "listening there?") from None

    def _read(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self._sock.recv(n - len(out))
            if not chunk:
                raise ProtocolError("the rendezvous store closed the connection (node 0 stopped, or it "
                                    "refused us: see node 0's log)")
            out += chunk
        return bytes(out)


class Missing(Exception):
    """A wait ended with these keys still unset."""

    def __init__(self, keys: list[str]):
        super().__init__(keys)
        self.keys = keys
