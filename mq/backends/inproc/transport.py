"""In-process transport: the reference implementation of :mod:`mq.transport`.

Nodes of one process find each other by name (``listen_to="inproc://learner"``,
``attach_to=["inproc://learner"]``). Each node has a bounded inbox and one I/O thread; a frame
travels as its contiguous layout (bytes), so the codec path is the one real transports use.
Useful for tests, docs and single-process experiments; it is what the conformance suite checks
every other transport against.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Any

from mq.backends.inproc import BACKEND
from mq.backends.inproc.options import SCHEME as _SCHEME
from mq.backends.inproc.options import InprocOptions
from mq.wire.codec import Frame, split
from mq.node import waits as _waits
from mq.errors import ConfigError, PeerLost, ProtocolError, Timeout
from mq.routing import Route
from mq.transport import Events, Transport

_REGISTRY: dict[str, "InprocTransport"] = {}
_REGISTRY_LOCK = threading.Lock()
_names = itertools.count()


class InprocTransport(Transport):
    """The ``inproc`` mq type's transport; its options are :class:`InprocOptions`."""

    name = "inproc"
    routes = BACKEND.routes
    Options = InprocOptions

    def __init__(self, node_id: int, options: InprocOptions, *, timeout: float = 30.0):
        self.node_id = node_id
        self.address = options.listen_to or f"{_SCHEME}node-{node_id}-{next(_names)}"
        self.attach_to = list(options.attach_to)
        self._inbox: collections.deque[tuple[str, Any]] = collections.deque()  # (sender, frame)
        self._inbox_size = options.inbox_size
        self.addresses: dict[str, str] = {}
        self._links: dict[int, InprocTransport] = {}
        self._node: Events | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def start(self, node: Events) -> list[str]:
        with _REGISTRY_LOCK:
            if self.address in _REGISTRY:
                raise ConfigError(f"listen_to {self.address!r} is taken in this process: pick another name")
            _REGISTRY[self.address] = self
        self._node = node
        self.addresses = {"inproc": self.address}
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"mq{self.node_id}-inproc-io")
        self._thread.start()
        return list(self.attach_to)

    def greet(self, target: str, frame: Frame, token: str) -> None:
        try:  # like a dial: wait (bounded) for the target to listen
            _waits.ALWAYS.until(lambda: target in _REGISTRY or self._closed, time.monotonic() + 30.0, every=0.01)
        except Timeout:
            pass
        with _REGISTRY_LOCK:
            other = _REGISTRY.get(target)
        if other is None:
            raise PeerLost(f"nothing listens on {target!r} in this process")
        other._put(self.address, frame.to_bytes(), 30.0, self._waiting())

    def reply_target(self, info: dict[str, Any]) -> str | None:
        address = (info.get("addresses") or {}).get("inproc")
        return address if isinstance(address, str) and address.startswith(_SCHEME) else None

    def connect(self, peer: int, info: dict[str, Any], route: Route) -> None:
        with _REGISTRY_LOCK:
            other = _REGISTRY.get((info.get("addresses") or {}).get("inproc", ""))
        if other is None:
            raise ProtocolError(f"node {peer} advertised no live inproc address")
        self._links[peer] = other

    def send(self, peer: int, frame: Frame, timeout: float) -> None:
        other = self._links.get(peer)
        if other is None or other._closed:
            raise PeerLost(f"node {peer} has no open link from node {self.node_id}")
        other._put(self.address, frame.to_bytes(), timeout, self._waiting(), peer)
        return None

    def disconnect(self, peer: int) -> None:
        self._links.pop(peer, None)

    def _waiting(self) -> _waits.Waits:
        return _waits.of(self._node) if self._node is not None else _waits.ALWAYS

    def _put(self, sender: str, data: bytearray, timeout: float, waits: _waits.Waits | None = None,
             peer: int | None = None) -> None:
        """Into this node's inbox; a full one makes the sender wait (through its own node's
        waits: polled, as this node wakes only its own)."""
        if len(self._inbox) >= self._inbox_size:
            (waits or _waits.ALWAYS).until(lambda: len(self._inbox) < self._inbox_size or self._closed,
                        time.monotonic() + timeout, peers=() if peer is None else (peer,), every=0.005,
                        states=_waits.LIVE_OR_STOPPING,
                        what=f"node did not take the message within {timeout:g}s: its queue is full")
        self._inbox.append((sender, data))
        self._waiting().wake(self)

    def _loop(self) -> None:
        inbox = self._inbox
        while not self._closed:
            if not inbox and not self._waiting().pause(lambda: inbox or self._closed, 0.5, on=(self,)):
                continue
            try:
                sender, data = inbox.popleft()
            except IndexError:  # (closed)
                continue
            node = self._node
            assert node is not None
            link = ("inproc", sender)
            if not node.trusts(link):
                node.on_handshake(data, link)  # a refused sender has no link to close here
                continue
            try:
                header, buffers = split(data)
            except ProtocolError as exc:
                node.on_dropped(str(exc), exc.cause)
                continue
            node.on_frame(header, buffers, link)

    def close(self, timeout: float) -> None:
        self._closed = True
        with _REGISTRY_LOCK:
            if _REGISTRY.get(self.address) is self:
                del _REGISTRY[self.address]
            others = list(_REGISTRY.values())
        for other in others:  # tell every node linked to us, as a dropped connection would
            for peer, link in list(other._links.items()):
                if link is self and other._node is not None:
                    other._node.on_link_lost(peer, "disconnected (it closed)")
        self._waiting().wake(self)
        if self._thread is not None and self._thread is not threading.current_thread():
            _waits.join(self._thread, timeout)

