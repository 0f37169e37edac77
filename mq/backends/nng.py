"""NNG backend (pynng): one inbox per node, one outgoing pipe per peer.

Why not a Bus0 socket: a bus drops messages when a receiver is slow. Here every node listens
with a Pull0 inbox and dials each peer with its own Push0 socket, so each sender->receiver pair
is one ordered stream, and a full receiver stops reading, which blocks the sender up to its
timeout (backpressure) instead of dropping.

Joining: a node dials each ``attach_to`` address with a short-lived bootstrap socket and sends
HELLO (node id, labels, subscriptions, addresses, locality). The peer answers HELLO_ACK over its
own outgoing socket, which it opened on the best route for this pair: ``inproc`` inside one
process, ``ipc`` (a unix socket) on the same host and namespaces, ``tcp`` otherwise. The node does
the same when the ACK comes back, then closes the bootstrap socket. No data frame travels before
both sides know each other, so the route never changes under a stream.

Frames are written straight into NNG messages and received messages are decoded in place:
arrays and tensors of a received message are views of NNG's buffer, freed with the last view.
"""

from __future__ import annotations

import logging
import os
import select
import tempfile
import threading
import time
import uuid
from typing import Any, Iterable

import pynng
from pynng import ffi, lib
from pynng.exceptions import check_err

from mq.codec import HELLO, HELLO_ACK, Encoded, Envelope
from mq.core import MQ, Peer
from mq.errors import ClosedError, ConfigError, PeerLost, ProtocolError, Timeout
from mq.locality import Locality, local
from mq.rendezvous import Rendezvous, attach_targets
from mq.routing import select_route

log = logging.getLogger("mq.nng")

SUPPORTED_ROUTES = ("inproc", "ipc", "tcp")
# After a recv() caller leaves, the I/O thread waits this long before reading for itself.
_CALLER_GRACE_S = 0.002
_SCHEMES = ("tcp://", "ipc://", "inproc://")


def check_address(address: str, what: str = "address") -> str:
    """Validate an NNG address such as ``tcp://127.0.0.1:50515``; returns it unchanged."""
    if not isinstance(address, str) or not address.startswith(_SCHEMES):
        raise ConfigError(f"{what} {address!r} must start with one of {', '.join(_SCHEMES)} "
                          "(e.g. tcp://127.0.0.1:50515)")
    if address.startswith("tcp://"):
        host, sep, port = address[len("tcp://"):].rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ConfigError(f"{what} {address!r} needs a host and a port 0-65535, e.g. tcp://127.0.0.1:50515")
    elif address.rstrip("/").endswith(("ipc:", "inproc:")) or address.endswith("://"):
        raise ConfigError(f"{what} {address!r} needs a path or name after the scheme")
    return address


class NngMQ(MQ):
    """The ``nng`` mq type. See :func:`mq.create` for the common options.

    Args:
        listen_to: this node's TCP address (``tcp://host:port``). Default: an ephemeral port on
            127.0.0.1 (peers on other hosts then cannot dial back: give a routable address).
        attach_to: addresses of peers to join. The peers dial back, so one side is enough.
        protocol: ``auto`` (best route per peer), ``tcp`` or ``ipc`` (force one for every peer
            except peers in this process).
        send_buffer: frames buffered per outgoing pipe before ``send`` waits.
        max_frame_bytes: larger incoming frames are dropped and counted.
        init_method: ``tcp://host:port``, ``env://`` or ``file://path``: find peers through a
            rendezvous store instead of ``attach_to`` (needs ``world_size``).
        topology: with ``init_method``, which peers to dial: ``mesh``, ``star`` or ``alone``.
    """

    backend_name = "nng"

    def __init__(self, node_id: int, labels: Iterable[str] | str | None = None, *,
                 listen_to: str | None = None, attach_to: Iterable[str] = (),
                 protocol: str = "auto", send_buffer: int = 64,
                 max_frame_bytes: int = 4 << 30, init_method: str | None = None,
                 world_size: int | None = None, topology: str = "mesh", **kwargs: Any):
        super().__init__(node_id, labels, **kwargs)
        if protocol not in ("auto", "tcp", "ipc"):
            raise ConfigError(f"protocol must be auto, tcp or ipc, got {protocol!r}")
        self.listen_to = check_address(listen_to, "listen_to") if listen_to else "tcp://127.0.0.1:0"
        if isinstance(attach_to, str):
            attach_to = [a for a in attach_to.split(",") if a]
        self.attach_to = [check_address(a, "attach_to address") for a in attach_to]
        self.protocol = protocol
        self.rendezvous = Rendezvous(init_method, node_id, world_size, timeout=self.timeout) if init_method else None
        attach_targets(node_id, [], topology)  # validates the topology name early
        self.topology = topology
        self.send_buffer = send_buffer
        self.codec.max_frame_bytes = max_frame_bytes
        self.max_frame_bytes = max_frame_bytes
        self.incarnation = uuid.uuid4().hex
        self.locality: Locality = local()
        self.addresses: dict[str, str] = {}
        self._inbox_sock: pynng.Pull0 | None = None
        self._out: dict[int, pynng.Push0] = {}
        self._out_locks: dict[int, threading.Lock] = {}
        self._out_timeout: dict[int, int] = {}
        self._bootstrap: dict[str, pynng.Push0] = {}
        self._reader: threading.Thread | None = None
        self._read_token = threading.Lock()
        self._readers_changed = threading.Condition()
        self._callers_reading = 0
        self._last_caller_exit = 0.0
        self._recv_timeout_ms = -1
        self._wake_r = self._wake_w = -1  # a pipe that wakes the I/O thread on stop()
        self._ipc_path: str | None = None
        self._net_lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle
    def _start(self) -> None:
        sock = pynng.Pull0(recv_buffer_size=self.send_buffer, recv_max_size=self.max_frame_bytes)
        self._inbox_sock = sock
        self._wake_r, self._wake_w = os.pipe()
        try:
            listener = sock.listen(self.listen_to)
        except pynng.AddressInUse:
            raise ConfigError(f"listen_to {self.listen_to!r} is already in use: pick another port "
                              "(or port 0 for an ephemeral one)") from None
        except pynng.NNGException as exc:
            raise ConfigError(f"cannot listen on {self.listen_to!r}: {exc}") from None
        self.addresses["tcp"] = self._advertised_tcp(listener)
        token = f"{os.getpid()}-{self.node_id}-{self.incarnation[:8]}"
        self._ipc_path = os.path.join(tempfile.gettempdir(), f"mq-{token}.sock")
        self.addresses["ipc"] = sock.listen(f"ipc://{self._ipc_path}").url
        self.addresses["inproc"] = sock.listen(f"inproc://mq-{token}").url
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name=f"mq{self.node_id}-nng-io")
        self._reader.start()
        if self.rendezvous is not None:
            nodes = self.rendezvous.exchange({"addresses": dict(self.addresses)})
            for peer in attach_targets(self.node_id, list(nodes), self.topology):
                self.attach_to.append(nodes[peer]["addresses"]["tcp"])
        for address in self.attach_to:
            self._attach(address)

    def _advertised_tcp(self, listener: pynng.Listener) -> str:
        host, _, _ = self.listen_to[len("tcp://"):].rpartition(":")
        # str() of the bound address carries the real port (pynng's .port is network byte order)
        port = str(listener.local_address).rpartition(":")[2]
        if host in ("0.0.0.0", "*", "", "[::]"):
            host = os.environ.get("MQ_ADVERTISE_HOST") or self.locality.hostname
        return f"tcp://{host}:{port}"

    def _close_transport(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._net_lock:
            sockets = list(self._out.values()) + list(self._bootstrap.values())
            self._out.clear()
            self._bootstrap.clear()
        for s in sockets:
            s.close()
        if self._inbox_sock is not None:
            self._inbox_sock.close()
        if self._wake_w >= 0:
            os.write(self._wake_w, b"x")  # wake the I/O thread from poll()
        with self._readers_changed:
            self._readers_changed.notify_all()
        if self._reader is not None:
            self._reader.join(max(0.0, deadline - time.monotonic()))
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        if self._ipc_path:
            try:
                os.unlink(self._ipc_path)
            except OSError:
                pass

    # ------------------------------------------------------------------ joining
    def _hello_payload(self, token: str = "") -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "labels": sorted(self.labels),
            "subscriptions": sorted(self.subscriptions()),
            "addresses": dict(self.addresses),
            "locality": self.locality.to_dict(),
            "incarnation": self.incarnation,
            "token": token,
        }

    def _attach(self, address: str) -> None:
        token = uuid.uuid4().hex
        sock = pynng.Push0(send_buffer_size=4, send_timeout=int(self.timeout * 1000))
        sock.dial(address, block=False)  # retries in the background until the peer listens
        with self._net_lock:
            self._bootstrap[token] = sock
        hello = self.codec.encode(HELLO, "", self.node_id, 0, 0, self._hello_payload(token))
        # The frame waits in the socket's buffer until the connection is up.
        _send_msg(sock, hello, block=True)

    def _on_control(self, env: Envelope) -> None:
        if env.kind not in (HELLO, HELLO_ACK):
            return
        info = env.payload
        if not isinstance(info, dict) or not isinstance(info.get("node_id"), int):
            raise ProtocolError(f"malformed HELLO from node {env.sender}")
        peer_id = info["node_id"]
        if peer_id == self.node_id:
            if info.get("incarnation") != self.incarnation:
                log.error("node %d: another process uses the same node id (addresses %s); "
                          "give every node a unique node id", self.node_id, info.get("addresses"))
            self._close_bootstrap(info.get("token", ""))
            return
        self._connect_peer(info)
        if env.kind == HELLO:
            ack = self.codec.encode(HELLO_ACK, "", self.node_id, 0, 0, self._hello_payload(info.get("token", "")))
            try:
                self._send_encoded(peer_id, ack, self.timeout)
            except Exception as exc:
                log.warning("node %d: could not answer HELLO of node %d: %s", self.node_id, peer_id, exc)
        else:
            self._close_bootstrap(info.get("token", ""))

    def _connect_peer(self, info: dict[str, Any]) -> None:
        peer_id = info["node_id"]
        remote = Locality.from_dict(info.get("locality") or {})
        same_process = remote.pid == self.locality.pid and remote.boot_id == self.locality.boot_id
        supported = SUPPORTED_ROUTES if self.protocol == "auto" else ("inproc", self.protocol)
        try:
            route = select_route(self.locality, remote, supported=supported, peer=peer_id,
                                 same_process=same_process)
        except ConfigError as exc:  # e.g. protocol=ipc towards another host: say so, use tcp
            log.error("node %d: %s; using tcp to node %d", self.node_id, exc, peer_id)
            route = select_route(self.locality, remote, supported=("tcp",), peer=peer_id)
        addresses = info.get("addresses") or {}
        address = addresses.get(route.kind) or addresses.get("tcp")
        with self._net_lock:
            old = self._peers.get(peer_id)
            reuse = (peer_id in self._out and old is not None and not old.lost
                     and old.info.get("incarnation") == info.get("incarnation"))
            if not reuse:
                if peer_id in self._out:
                    self._out.pop(peer_id).close()
                self._out[peer_id] = self._dial_peer(peer_id, address)
                self._out_timeout.pop(peer_id, None)
                self._out_locks.setdefault(peer_id, threading.Lock())
        peer = Peer(peer_id, frozenset(info.get("labels") or ()), frozenset(info.get("subscriptions") or ()),
                    route, info=info)
        if reuse and old is not None:
            peer.subscriptions = old.subscriptions if not info.get("subscriptions") else peer.subscriptions
        self._peer_joined(peer)

    def _dial_peer(self, peer_id: int, address: str) -> pynng.Push0:
        sock = pynng.Push0(send_buffer_size=self.send_buffer)

        def removed(_pipe: Any) -> None:
            # The peer's process died or closed: a later send fails fast with PeerLost.
            if self._state == "listening" and self._out.get(peer_id) is sock:
                self._peer_lost(peer_id, "disconnected (its process died or closed the link)")

        sock.add_post_pipe_remove_cb(removed)
        sock.dial(address, block=False)
        return sock

    def _close_bootstrap(self, token: str) -> None:
        with self._net_lock:
            sock = self._bootstrap.pop(token, None)
        if sock is not None:
            sock.close()

    # ------------------------------------------------------------------ moving frames
    def _transmit(self, peer: int, encoded: Encoded, timeout: float) -> None:
        self._send_encoded(peer, encoded, timeout)

    def _send_encoded(self, peer: int, encoded: Encoded, timeout: float) -> None:
        sock = self._out.get(peer)
        if sock is None:
            raise PeerLost(f"node {peer} has no open link from node {self.node_id}")
        with self._out_locks[peer]:  # one writer per pipe keeps frames in order
            ms = max(0, int(timeout * 1000))
            if self._out_timeout.get(peer) != ms:  # reading the option back costs ~10 us
                sock.send_timeout = ms
                self._out_timeout[peer] = ms
            try:
                _send_msg(sock, encoded, block=True)
            except pynng.Timeout:
                p = self._peers.get(peer)
                if p is not None and p.lost:
                    raise PeerLost(f"node {peer} {p.lost}") from None
                raise Timeout(f"node {peer} did not take the message within {timeout:g}s: its queue "
                              "is full (slow receiver) or it is unreachable; pass timeout= to wait longer") from None
            except pynng.Closed:
                raise ClosedError("the link was closed while sending (the queue is stopping)") from None

    # Receiving. One thread at a time holds the reader token and takes frames off the inbox
    # socket, delivering each before it lets go, so frames keep their order. A thread in recv()
    # reads for itself (no hand-off from another thread); the I/O thread reads only while nobody
    # is in recv(), so handlers, call replies and handshakes are still served.
    def _read_loop(self) -> None:
        sock = self._inbox_sock
        assert sock is not None
        poller = select.poll()
        poller.register(sock.recv_fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        msgp = ffi.new("nng_msg **")
        while self._state in ("new", "listening", "stopping"):
            with self._readers_changed:
                # While a recv() caller reads, or just did (it is likely in a loop and back within
                # a few ms), stay out of its way: waking up per frame would cost it the GIL.
                while self._state != "stopped":
                    quiet = time.monotonic() - self._last_caller_exit
                    if not self._callers_reading and quiet >= _CALLER_GRACE_S:
                        break
                    self._readers_changed.wait(0.5 if self._callers_reading else _CALLER_GRACE_S - quiet)
            poller.poll(500)  # releases the GIL; wakes when a frame waits or stop() pokes us
            if self._callers_reading:
                continue
            with self._read_token:
                for _ in range(64):  # a batch, then look again who should be reading
                    rv = lib.nng_recvmsg(sock.socket, msgp, lib.NNG_FLAG_NONBLOCK)
                    if rv == lib.NNG_ECLOSED:
                        return
                    if rv != 0:
                        break
                    self._handle_frame(msgp[0])
                    if self._callers_reading:
                        break

    def _read_in_caller(self, timeout: float) -> bool:
        sock = self._inbox_sock
        if sock is None or self._state != "listening":
            return False
        with self._readers_changed:
            self._callers_reading += 1
        try:
            if not self._read_token.acquire(timeout=timeout):
                return True
            try:
                if not self._inbox.empty():  # the I/O thread delivered while we waited
                    return True
                ms = max(1, int(timeout * 1000))
                if ms != self._recv_timeout_ms:
                    check_err(lib.nng_socket_set_ms(sock.socket, b"recv-timeout", ms))
                    self._recv_timeout_ms = ms
                msgp = ffi.new("nng_msg **")
                rv = lib.nng_recvmsg(sock.socket, msgp, 0)
                if rv == 0:
                    self._handle_frame(msgp[0])
                elif rv == lib.NNG_ECLOSED:
                    raise ClosedError("the queue was stopped during recv()")
                elif rv != lib.NNG_ETIMEDOUT:
                    check_err(rv)
                return True
            finally:
                self._read_token.release()
        finally:
            with self._readers_changed:
                self._callers_reading -= 1
                self._last_caller_exit = time.monotonic()
                self._readers_changed.notify_all()

    def _handle_frame(self, msg: Any) -> None:
        frame = _msg_view(msg)
        try:
            self._deliver(self.codec.decode(frame))
        except ProtocolError as exc:
            self._stats.dropped_malformed += 1
            log.warning("node %d: dropped a malformed frame (%d bytes): %s", self.node_id, len(frame), exc)
        except Exception:
            self._stats.dropped_malformed += 1
            log.exception("node %d: error handling a frame", self.node_id)
        finally:
            del frame  # do not hold the last message while waiting for the next


def _send_msg(sock: pynng.Socket, encoded: Encoded, *, block: bool) -> None:
    """Write the frame into a fresh NNG message (one copy) and hand it to NNG."""
    msgp = ffi.new("nng_msg **")
    check_err(lib.nng_msg_alloc(msgp, encoded.size))
    msg = msgp[0]
    encoded.write_into(memoryview(ffi.buffer(lib.nng_msg_body(msg), encoded.size)))
    rv = lib.nng_sendmsg(sock.socket, msg, 0 if block else lib.NNG_FLAG_NONBLOCK)
    if rv != 0:
        lib.nng_msg_free(msg)  # on failure the message is still ours
        check_err(rv)


def _msg_view(msg: Any) -> memoryview:
    """A writable view of a received NNG message; the message is freed with the last view."""
    size = lib.nng_msg_len(msg)
    body = ffi.gc(lib.nng_msg_body(msg), lambda _p, m=msg: lib.nng_msg_free(m))
    return memoryview(ffi.buffer(body, size))
