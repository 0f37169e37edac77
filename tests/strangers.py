"""Raw senders from nobody: what a port scanner, a fuzzer or a buggy process writes to a node's
listening surfaces, laid out as each surface expects (NNG messages, unix link datagrams, tcp link
records), with no handshake."""

from __future__ import annotations

import os
import socket
import struct
import threading
from typing import Any

import pynng

from mq.backends.nng.links import tcp as tcplink
from mq.backends.nng.links import unix as unixlink
from mq.wire.codec import Codec

#: A node's listening surfaces, by the key of its address in ``q.addresses``.
SURFACES = ("tcp", "ipc", "unix", "tcplink")


def raw_frame(kind: int, sender: int, payload, topic: str = "work") -> bytes:
    return bytes(Codec().encode(kind, topic, sender, 0, 0, payload).to_bytes())


def fake_hello(node_id: int, address: str) -> dict:
    """A HELLO that fits the handshake schema, from nobody (no proof can follow it)."""
    return {"node_id": node_id, "labels": [], "subscriptions": [], "addresses": {"tcp": address},
            "locality": {}, "incarnation": f"i{node_id}", "token": f"t{node_id}", "nonce": os.urandom(16),
            "mq_type": "nng", "max_frame_bytes": 1 << 20, "shm": None}


def stranger(addresses: dict[str, str], family: str) -> Any:
    """A raw sender to one of a node's ``addresses`` (``q.addresses``): NNG's (``tcp``, ``ipc``),
    its unix link (``unix``, an abstract ``mq-...`` name) or its tcp link (``tcplink``)."""
    address = addresses[family]
    if family == "unix":
        return UnixStranger(address)
    if family == "tcplink":
        return TcpStranger(address)
    # No redial: a node that closed our pipe must see no second connection from us (a redial
    # within a polling interval also hid the close from closed_by_node).
    s = pynng.Push0(send_timeout=2000, reconnect_time_min=3_600_000, reconnect_time_max=3_600_000)
    s.closed_by_node = threading.Event()
    s.add_post_pipe_remove_cb(lambda pipe: s.closed_by_node.set())
    s.dial(address, block=True)
    return s


class TcpStranger:
    """Frames as the tcp link lays them out (one BEGIN record each), from nobody."""

    def __init__(self, address: str):
        self.sock = socket.create_connection(tcplink.split_address(address), 5)

    def send(self, frame: bytes) -> None:
        self.sock.sendall(struct.pack("<BxxxIQ", tcplink.BEGIN, len(frame), len(frame)) + frame)

    def announce(self, size: int) -> None:
        """The start of a frame of ``size`` bytes: its first record, one piece long."""
        piece = min(size, tcplink.PIECE)
        self.sock.sendall(struct.pack("<BxxxIQ", tcplink.BEGIN, piece, size) + bytes(piece))

    def close(self) -> None:
        self.sock.close()


class UnixStranger:
    """Frames as the unix link lays them out (length prefix, one datagram), from nobody."""

    def __init__(self, name: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.connect("\0" + name)

    def send(self, frame: bytes) -> None:
        self.sock.send(struct.pack("<Q", len(frame)) + frame)

    def announce(self, size: int) -> None:
        """The start of a frame of ``size`` bytes: its first datagram."""
        self.sock.send(struct.pack("<Q", size) + bytes(min(size, unixlink.DATAGRAM - 8)))

    def close(self) -> None:
        self.sock.close()


def send_as_strangers(addresses: dict[str, str], family: str, frames: list[bytes]) -> None:
    """Each frame from a connection of its own: the node closes a link at its first refused frame."""
    for frame in frames:
        s = stranger(addresses, family)
        try:
            s.send(frame)
            closed_by_node(s)
        finally:
            s.close()


def closed_by_node(s: Any, timeout: float = 5.0) -> None:
    """Wait until the node closed this stranger's connection (it refused what came on it)."""
    if isinstance(s, pynng.Socket):  # its pipe goes (closing ours earlier could lose the frame)
        assert s.closed_by_node.wait(timeout), "the node kept the connection of a refused frame"
    else:  # a link: we read EOF (or a reset: the node closed it with our bytes unread)
        s.sock.settimeout(timeout)
        try:
            assert s.sock.recv(16) == b""
        except ConnectionResetError:
            pass
