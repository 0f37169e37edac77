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
import heapq
import logging
import selectors
import socket
import struct
import threading
import time
from itertools import filterfalse
from typing import Any

import msgpack

from mq.node import waits
from mq.errors import ProtocolError, Timeout

log = logging.getLogger("mq.store")

MAX_MESSAGE = 1 << 20  # an entry is a few hundred bytes; a wait for 10,000 keys is ~100 KB
#: Keys one wait asks for: its answer carries their values (an nng node's entry is ~200 bytes),
#: so a rendezvous of any size stays under MAX_MESSAGE (one wait for 5,000 nodes' entries did not).
WAIT_PAGE = 2048
_LENGTH = struct.Struct(">I")
_IDLE_S = 30.0  # the store's loop looks at least this often (nothing is due while idle)
_STALLED_S = 10.0  # a connection that began a message and sent nothing more for this long is closed
_RETRY_S = (0.02, 0.5)  # first and longest pause between attempts to reach a store not up yet
_WAITS_PER_CONN = 64  # a node has one open at a time; a stranger cannot pile them up
_ANSWERS_KEPT = 64  # answers kept for the next wait for the same keys (a rendezvous has N / WAIT_PAGE)


class StoreServer:
    """The store node 0 serves on ``port`` of every interface (as torch's TCPStore does), until
    :meth:`close`. ``world_size`` bounds what it keeps: keys and connections a few per node.

    Every node of a rendezvous waits for every node's entry, so a set must not look at every
    wait (N sets times N waits: 14 CPU-seconds for 3,000 nodes). A wait is filed under one key it
    misses and looked at again only when that key is set; it then reads on through its keys from
    where it stopped (keys are never unset), so each wait reads each of its keys about once.
    """

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
        self._filed: dict[str, list[_Wait]] = {}  # a missing key -> the waits filed under it
        self._deadlines: list[tuple[float, int, _Wait]] = []  # a heap; answered waits stay until popped
        self._open_waits = 0
        # A complete wait's answer by its keys: every node of a rendezvous asks for the same pages.
        self._answers: dict[tuple[str, ...], bytes] = {}
        self._partial: set[_Conn] = set()  # connections in the middle of a message
        self._unsendable: list[_Conn] = []  # an answer to them could not be sent: dropped next
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
        due = [at for c in self._partial if (at := c.stalls_at())]
        if self._deadlines:
            due.append(self._deadlines[0][0])
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
            return
        if not conn.open:  # an answer could not be sent
            self._drop(conn)
        elif conn.stalls_at():
            self._partial.add(conn)
        else:
            self._partial.discard(conn)

    def _handle(self, conn: _Conn, request: Any) -> None:
        op = request[0] if type(request) is list and request else None
        if op == "set" and len(request) == 3 and type(request[1]) is str and type(request[2]) is bytes:
            key = request[1]
            if key not in self._values and len(self._values) >= self.max_keys:
                raise ProtocolError(f"the store holds its limit of {self.max_keys} keys")
            if key in self._values:  # set again (a node restarted): answers made before are stale
                self._answers.clear()
            self._values[key] = request[2]
            conn.send(["ok"])
            for w in self._filed.pop(key, ()):
                self._file(w)
        elif (op == "wait" and len(request) == 3 and type(request[1]) is list and len(request[1]) <= self.max_keys
              and set(map(type, request[1])) <= {str} and type(request[2]) in (int, float)):
            if len(conn.waits) >= _WAITS_PER_CONN:
                raise ProtocolError(f"over {_WAITS_PER_CONN} waits open on one connection")
            deadline = time.monotonic() + max(0.0, min(request[2], 86400.0))
            w = _Wait(conn, tuple(request[1]), deadline)
            conn.waits.add(w)
            self._open_waits += 1
            heapq.heappush(self._deadlines, (deadline, id(w), w))
            framed = self._answers.get(w.keys)
            if framed is not None:
                self._answer_packed(w, framed)
            else:
                self._file(w)
        else:
            raise ProtocolError(f"not a store request: {str(request)[:80]}")

    def _file(self, w: _Wait) -> None:
        """File ``w`` under the next key it misses, or answer it: it misses none."""
        if w.done:
            return
        missing = next(filterfalse(self._values.__contains__, w.unread), None)
        if missing is None:
            framed = self._answers.get(w.keys)
            if framed is None:
                if len(self._answers) >= _ANSWERS_KEPT:
                    self._answers.clear()
                framed = self._answers[w.keys] = _pack(["ok", [self._values[k] for k in w.keys]])
            self._answer_packed(w, framed)
        else:
            self._filed.setdefault(missing, []).append(w)

    def _expire(self, now: float) -> None:
        """Answer the waits whose time is up; close stalled connections."""
        while self._deadlines and self._deadlines[0][0] <= now:
            w = heapq.heappop(self._deadlines)[2]
            if not w.done:
                self._answer(w, ["missing", [k for k in w.keys if k not in self._values]])
        for conn in [c for c in self._partial if c.stalled(now)]:
            self._drop(conn)
        while self._unsendable:
            self._drop(self._unsendable.pop())

    def _answer(self, w: _Wait, message: Any) -> None:
        self._answer_packed(w, _pack(message))

    def _answer_packed(self, w: _Wait, framed: bytes) -> None:
        w.conn.send_packed(framed)
        self._close_wait(w)
        if not w.conn.open:
            self._unsendable.append(w.conn)

    def _close_wait(self, w: _Wait) -> None:
        w.done = True
        w.conn.waits.discard(w)
        self._open_waits -= 1
        if len(self._deadlines) > 2 * self._open_waits + 64:  # closed waits pile up: sweep them
            self._deadlines = [e for e in self._deadlines if not e[2].done]
            heapq.heapify(self._deadlines)
            self._filed = {k: live for k, ws in self._filed.items() if (live := [x for x in ws if not x.done])}

    def _drop(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock, None) is not None:
            self._select.unregister(conn.sock)
        self._partial.discard(conn)
        for w in list(conn.waits):  # nobody to answer
            self._close_wait(w)
        conn.close()


def _pack(message: Any) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return _LENGTH.pack(len(body)) + body


class _Wait:
    """A client waiting for ``keys`` until ``deadline``; ``unread``: its keys not read yet (those
    read were set, and keys are never unset). They are read in the order of a set (the keys'
    hashes), not as listed: nodes set their entries in about the order of their ids, and waits
    reading in that order would each be filed again at every set."""

    __slots__ = ("conn", "keys", "unread", "deadline", "done")

    def __init__(self, conn: _Conn, keys: tuple[str, ...], deadline: float):
        self.conn = conn
        self.keys = keys
        self.unread = iter(set(keys))
        self.deadline = deadline
        self.done = False


class _Conn:
    """One client connection of the server: the bytes of its unfinished message."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.open = True
        self.waits: set[_Wait] = set()  # its open waits
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
        self.send_packed(_pack(message))

    def send_packed(self, framed: bytes) -> None:
        """Answer (at most a page of entries, ~400 KB; a client that does not take it within 1 s
        is dropped: the store serves everyone from one thread)."""
        try:
            self.sock.setblocking(True)
            self.sock.settimeout(1.0)
            self.sock.sendall(framed)
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
        """Every key's value, once all are set (asked for :data:`WAIT_PAGE` keys at a time).

        Raises:
            Missing: ``timeout`` passed first (it names every key still unset).
        """
        deadline = time.monotonic() + timeout
        values: list[bytes] = []
        missing: list[str] = []
        for start in range(0, len(keys), WAIT_PAGE):
            page = keys[start:start + WAIT_PAGE]
            left = 0.0 if missing else max(0.0, deadline - time.monotonic())  # late: only name the rest
            try:
                values += self._wait_page(page, left)
            except Missing as exc:
                missing += exc.keys
        if missing:
            raise Missing(missing)
        return values

    def _wait_page(self, keys: list[str], timeout: float) -> list[bytes]:
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
