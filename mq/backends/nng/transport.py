"""The ``nng`` mq type's transport: NNG for joining, mq's own links for the data by default.

Every node listens with a Pull0 inbox (NNG) on its advertised port and on abstract/inproc
addresses, and, by default, on a unix SEQPACKET link and a TCP link of mq's own
(:mod:`mq.backends.nng.links`). Why not a Bus0 socket: a bus drops messages when a receiver is
slow. Each sender->receiver pair is one ordered stream, and a full receiver stops reading,
which blocks the sender up to its timeout (backpressure) instead of dropping.

Joining (driven by :class:`mq.node.core.MQ`): ``greet`` dials an ``attach_to`` address (or a peer
found through the rendezvous, :mod:`mq.rendezvous`) with a short-lived bootstrap NNG socket
and sends HELLO; ``connect`` opens the outgoing link on the route core chose: ``inproc`` inside
one process, a unix link (one hop where NNG's ipc takes three) for ``ipc`` and ``shm`` (the link
carries control frames and descriptors, the pool carries the bytes), and for ``tcp`` a TCP link
to the port the peer advertised in its HELLO, or NNG's tcp where that port cannot be reached,
TLS is on or batching was asked for (:class:`mq.backends.nng.outbox.Outbox`). The bootstrap
socket closes once the peer's own link is up. Every link is read by the same threads as the NNG
inbox: the I/O thread, or a ``recv()`` caller, waits in one ``poll()`` on all of them.

Liveness is core's heartbeat; a link whose peer hangs up is reported at once (``on_link_lost``).
Frames on NNG use :mod:`mq.backends.nng.wire`; options are :class:`mq.backends.nng.options.NngOptions`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
import uuid
from typing import Any, Callable

import pynng
from pynng import ffi, lib
from pynng.exceptions import check_err

from mq.wire import handshake
from mq.backends.nng import ROUTES
from mq.backends.nng.links import tcp as tcplink
from mq.backends.nng.links import unix as unixlink
from mq.backends.nng.links.base import Sender
from mq.backends.nng.busypoll import BusyPoll
from mq.backends.nng.drops import NngDrops
from mq.backends.nng import orphans  # noqa: F401  (pynng sockets GC-closed off NNG's threads)
from mq.backends.nng.options import NngOptions, check_address
from mq.backends.nng.outbox import Outbox
from mq.backends.nng.wire import msg_view, send_unless_closed
from mq.wire.codec import ALIGN, Frame, split, split_batch
from mq.errors import ClosedError, ConfigError, PeerLost, ProtocolError
from mq.locality import local
from mq.node import waits
from mq.node.reader_token import ReaderToken
from mq.rendezvous import Rendezvous, attach_targets
from mq.routing import Route
from mq.transport import Events, Transport

log = logging.getLogger("mq.nng")

#: The I/O thread's poll() while nothing happens: a frame, a link change and stop() wake it, so
#: this only bounds a wake-up somebody forgot (mq.node.waits.PAUSE_RECHECK_S); waking twice a
#: second per node was a large part of what an idle job of many nodes cost (issue 49).
_IDLE_POLL_MS = int(waits.PAUSE_RECHECK_S * 1000)
_MAX_LINKS = 1024  # accepted unix and tcp links kept at once (peers, and strangers)
_LINK_CONNECT_S = 2.0  # a tcp link not open by then (a firewall drops it): NNG's tcp instead


def _link_addresses(peer: int, addresses: dict[str, Any], *, unix: bool, tcp: bool) -> tuple[Any, Any]:
    """The unix link name and the tcp link address of ``peer`` (from its HELLO: checked) that
    this node dials, where it uses that kind of link; None where not."""
    name = addresses.get("unix") if unix else None
    if name is not None and not (isinstance(name, str) and name.startswith("mq-") and len(name) < 100
                                 and "\0" not in name):
        raise ProtocolError(f"node {peer} advertised a malformed unix link name {name!r}")
    own = addresses.get("tcplink") if tcp else None
    if own is not None and not (isinstance(own, str) and own.startswith("tcp://") and own.rpartition(":")[2].isdigit()):
        raise ProtocolError(f"node {peer} advertised a malformed tcp link address {own!r}")
    return name, own


class NngTransport(Transport):
    """The ``nng`` mq type's transport; its options are :class:`NngOptions`, the common ones
    :func:`mq.create`'s."""

    name = "nng"
    Options = NngOptions

    def __init__(self, node_id: int, options: NngOptions, *, timeout: float = 30.0):
        self.node_id = node_id
        self.options = options
        self.listen_to: str = options.listen_to  # type: ignore[assignment]  # a str once NngOptions checked it
        self.attach_to = list(options.attach_to)
        self.protocol = options.protocol
        auto = options.protocol == "auto"
        self.routes = ROUTES if auto else frozenset({"inproc", options.protocol})
        self.shm_ok = auto  # a forced protocol means that socket, bytes included
        self.timeout = timeout
        self.rendezvous = (Rendezvous(options.init_method, node_id, options.world_size, timeout=timeout)
                           if options.init_method else None)
        self.send_buffer = options.send_buffer
        self.batch_window = options.batch_window
        self.unix_links = options.unix_links
        self.tcp_links = options.tcp_links and options.tls is None
        self.connect_may_block = self.tcp_links  # a tcp link's connect waits up to _LINK_CONNECT_S
        self.busy_poll = BusyPoll(options.busy_poll)
        self._tls = options.tls_files
        self.received = 0  # NNG messages taken off the inbox: the outboxes tell streams from replies
        self.incarnation = uuid.uuid4().hex
        self.addresses: dict[str, str] = {}
        self._node: Events | None = None
        self._state = "new"
        self._inbox_sock: pynng.Pull0 | None = None
        self._out: dict[int, Outbox] = {}
        self._out_incarnation: dict[int, Any] = {}
        self._bootstrap: dict[str, pynng.Push0] = {}  # greeting token -> its socket
        self._bootstrap_to: dict[str, str] = {}  # target -> its latest greeting token
        self._reader: threading.Thread | None = None
        self._token = ReaderToken()  # who takes frames off the inbox: a recv() caller or _read_loop
        self._waits = waits.Waits()  # the node's, from start()
        self._recv_timeout_ms = -1
        self._recv_fd = -1
        self._bell: _Doorbell | None = None  # wakes the I/O thread: close(), a link change
        self._net_lock = threading.Lock()
        # Links of our own (unix, tcp): the listeners (fd -> the Inbound class of what they
        # accept), accepted links by fd, and our outgoing ones watched for the peer hanging up
        # (fd -> peer). Readers rebuild their poll set when ``_links_gen`` moves.
        self._unix_listener: Any = None
        self._listeners: dict[int, tuple[Any, Any]] = {}
        self._inbound: dict[int, Any] = {}
        self._watched: dict[int, tuple[int, Sender]] = {}
        self._links_gen = 0
        self._pollers = threading.local()
        self._drops = NngDrops()  # what NNG itself dropped on our inbox (mq.backends.nng.drops)

    # ------------------------------------------------------------------ lifecycle
    def start(self, node: Events) -> list[str]:
        self._node = node
        self._waits = waits.of(node)
        self._token = ReaderToken(self._waits)
        self._waits.reader_wanted = self._token.wake  # a wait for peers' frames: read them now
        self._state = "listening"
        tls = {"tls_config": _tls_config(self._tls, pynng.TLSConfig.MODE_SERVER)} if self._tls else {}
        sock = pynng.Pull0(recv_buffer_size=self.send_buffer, recv_max_size=node.max_frame_bytes, **tls)
        self._inbox_sock = sock
        self._bell = _Doorbell()
        listener = _listen(sock, self.listen_to, bool(self._tls))
        self.addresses["tcp"] = _advertised_tcp(self.listen_to, listener, bool(self._tls))
        token = f"{os.getpid()}-{self.node_id}-{self.incarnation[:8]}"
        # An abstract unix socket: no file in /tmp, gone with the process even after SIGKILL.
        ipc = sock.listen(f"abstract://mq-{token}")
        self.addresses["ipc"] = ipc.url
        self.addresses["inproc"] = sock.listen(f"inproc://mq-{token}").url
        self._drops.watch(sock, [listener, ipc])
        if self.unix_links:
            self._unix_listener = unixlink.listen(f"mq-{token}-link")
            self.addresses["unix"] = f"mq-{token}-link"
            self._listeners[self._unix_listener.fileno()] = (self._unix_listener, unixlink.Inbound)
        if self.tcp_links and (listener := _tcp_link_listener(self.listen_to, self.node_id)) is not None:
            self.addresses["tcplink"] = self.addresses["tcp"].rpartition(":")[0] + f":{listener.getsockname()[1]}"
            self._listeners[listener.fileno()] = (listener, tcplink.Inbound)
        # Read the fd here: a stop() racing the thread's start must not make it read a closed socket.
        self._recv_fd = sock.recv_fd
        self._reader = threading.Thread(target=self._read_loop, args=(self._recv_fd,), daemon=True,
                                        name=f"mq{self.node_id}-nng-io")
        self._reader.start()
        targets = list(self.attach_to)
        if self.rendezvous is not None:
            nodes = self.rendezvous.exchange({"addresses": dict(self.addresses)}, node.secret)
            targets += [nodes[peer]["addresses"]["tcp"]
                        for peer in attach_targets(self.node_id, list(nodes), self.options.topology)]
        return targets

    def _push(self, address: str, **options: Any) -> pynng.Push0:
        """An outgoing socket for ``address``, with a TLS client config for tls+tcp."""
        if address.startswith("tls+tcp://"):
            if not self._tls:
                raise ConfigError(f"{address} wants TLS: give this node tls={{'cert':..., 'key':..., "
                                  "'ca':...}} like its peers")
            host = tcplink.split_address(address)[0]
            options["tls_config"] = _tls_config(self._tls, pynng.TLSConfig.MODE_CLIENT, host)
        return pynng.Push0(**options)

    def close(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._state = "stopped"
        if self.rendezvous is not None:
            self.rendezvous.close()
        with self._net_lock:
            outboxes = list(self._out.values())
            sockets = list(self._bootstrap.values())
            self._out.clear()
            self._bootstrap.clear()
        for box in outboxes:  # what our last frames (answers to calls) queued still goes out
            box.close(min(0.5, max(0.0, deadline - time.monotonic()) / 2)) if isinstance(box, Outbox) else box.close()
        for s in sockets:
            s.close()
        if self._inbox_sock is not None:
            self._inbox_sock.close()
        with self._net_lock:
            inbound = list(self._inbound.values())
            self._inbound.clear()
            self._watched.clear()
            self._links_changed()
        for link in inbound:
            link.close()
        for listener, _kind in self._listeners.values():
            listener.close()
        with self._net_lock:
            if self._bell is not None:
                self._bell.ring()  # wake the I/O thread from poll()
        self._token.stop()
        if self._reader is not None and self._reader is not threading.current_thread():
            waits.join(self._reader, deadline - time.monotonic())
        with self._net_lock:  # (a link change rings it under this lock)
            if self._bell is not None:
                self._bell.close()

    # ------------------------------------------------------------------ joining
    def greet(self, target: str, frame: Frame, token: str) -> None:
        sock = self._push(check_address(target, "attach_to address"), send_buffer_size=4,
                          send_timeout=int(self.timeout * 1000))
        sock.dial(target, block=False)  # retries until the peer listens
        with self._net_lock:
            if self._state == "stopped":  # close() has run: it would never close this one
                old = sock
            else:
                self._bootstrap[token] = sock
                # A new greeting of the same target replaces the unanswered one.
                old = self._bootstrap.pop(self._bootstrap_to.pop(target, ""), None)
                self._bootstrap_to[target] = token
        if old is not None:
            old.close()
        if old is sock:
            return
        # The frame waits in the socket's buffer until the connection is up.
        send_unless_closed(sock, frame)  # close() (or a newer greeting) may have taken it meanwhile

    def greeting_connected(self, token: str) -> bool | None:
        with self._net_lock:
            sock = self._bootstrap.get(token)
        return None if sock is None else bool(sock.pipes)

    def reply_target(self, info: dict[str, Any]) -> str | None:
        address = (info.get("addresses") or {}).get("tcp")
        return address if isinstance(address, str) and address.startswith(("tcp://", "tls+tcp://")) else None

    def connect(self, peer: int, info: dict[str, Any], route: Route) -> None:
        addresses = info.get("addresses") or {}
        # shm frames go by unix socket; rdma's frames (descriptors) by tcp, their buffers beside
        kind = {"shm": "ipc", "rdma": "tcp"}.get(route.kind, route.kind)
        address = addresses.get(kind) or addresses.get("tcp")
        if not isinstance(address, str):
            raise ProtocolError(f"node {peer} advertised no address for route {route.kind}")
        unix, own_tcp = _link_addresses(peer, addresses, unix=kind == "ipc" and self._unix_listener is not None,
                                        tcp=kind == "tcp" and self.tcp_links and not self.batch_window)
        link: Sender | None = None
        if (unix or own_tcp) and not self._is_current(peer, info):
            # A link's loss concerns that link only: the link of an earlier incarnation of the
            # peer (one that stopped, in the same process) may report its end after this one is in.
            opened: list[Sender] = []
            lost = lambda: self._outbound_lost(peer, opened[0] if opened else None)  # noqa: E731
            try:  # outside the lock: a peer slow to accept must not hold up every other link
                if unix is not None:
                    link = unixlink.Outbound(unix, min(self.timeout, 5.0), lost, self._waits)
                else:
                    link = tcplink.Outbound(own_tcp, min(self.timeout, _LINK_CONNECT_S), lost, self._waits)
                opened.append(link)
            except OSError as exc:
                # A unix link's abstract name is not in our network namespace (a container
                # sharing only IPC): NNG's abstract ipc socket would not be either, tcp reaches
                # it. A tcp link's port may be firewalled where NNG's port is open.
                log.warning("node %d: cannot open the %s link to node %d (%s): using NNG's tcp",
                            self.node_id, "unix" if unix else "tcp", peer, exc)
                address = addresses.get("tcp")
                if not isinstance(address, str):
                    raise ProtocolError(f"node {peer} advertised no tcp address") from None
        with self._net_lock:
            if self._is_current(peer, info) or self._state == "stopped":
                if link is not None:
                    link.close()
                return
            if peer in self._out:
                self._forget_out(peer).close()
            if link is not None:
                box: Any = link
                self._watched[link.fd] = (peer, link)
                self._links_changed()
            else:
                box = self._dial_peer(peer, check_address(address, f"node {peer}'s address"))
            self._out[peer] = box
            self._out_incarnation[peer] = info.get("incarnation")
            boot = (self._bootstrap.pop(info.get("token"), None)  # type: ignore[arg-type]  # a str: checked below
                    if isinstance(info.get("token"), str) else None)  # an ACK echoes our HELLO's token: done with it
        if boot is not None:
            boot.close()

    def _is_current(self, peer: int, info: dict[str, Any]) -> bool:
        return peer in self._out and self._out_incarnation.get(peer) == info.get("incarnation")

    def disconnect(self, peer: int) -> None:
        with self._net_lock:
            box = self._forget_out(peer)
        if box is not None:
            box.close()  # a send waiting on it returns (ClosedError) at once

    def _forget_out(self, peer: int) -> Any:
        """Take ``peer``'s outgoing link out of the tables (``_net_lock`` held); the caller closes it."""
        box = self._out.pop(peer, None)
        self._out_incarnation.pop(peer, None)
        if isinstance(box, Sender) and self._watched.pop(box.fd, None) is not None:
            self._links_changed()
        return box

    def _dial_peer(self, peer_id: int, address: str) -> "Outbox":
        sock = self._push(address, send_buffer_size=self.send_buffer)
        box = Outbox(sock, self.send_buffer, f"mq{self.node_id}-to-{peer_id}", self.batch_window,
                      lambda: self.received, self._waits)

        def removed(_pipe: Any) -> None:
            # The peer's process died or closed: a later send fails fast with PeerLost.
            if self._state == "listening" and self._out.get(peer_id) is box and self._node:
                self._node.on_link_lost(peer_id, "disconnected (its process died or closed the link)")

        sock.add_post_pipe_remove_cb(removed)
        sock.dial(address, block=False)
        return box

    # ------------------------------------------------------------------ moving frames
    def send(self, peer: int, frame: Frame, timeout: float) -> None:
        box = self._out.get(peer)
        if box is None:
            raise PeerLost(f"node {peer} has no open link from node {self.node_id}")
        box.send(peer, frame, timeout)
        return None

    def native_drops(self) -> dict[str, int]:
        return self._drops.counts()

    def streams_to(self, peer: int) -> bool:
        # mq's tcp link sends a frame piece by piece: it can wait for each piece to arrive.
        return type(self._out.get(peer)) is tcplink.Outbound

    # Receiving. One thread at a time holds the reader token and takes frames off the inbox
    # socket, delivering each before it lets go, so frames keep their order. A thread in recv()
    # reads for itself (no hand-off from another thread); the I/O thread reads only while nobody
    # is in recv(), so handlers, call replies and handshakes are still served.
    def _read_loop(self, recv_fd: int) -> None:
        sock = self._inbox_sock
        assert sock is not None
        token = self._token
        stopped = lambda: self._state == "stopped"  # noqa: E731
        while self._state == "listening":
            # While a recv() caller reads, or just did (it is likely in a loop and back within a
            # few ms), stay out of its way: waking up per frame would cost it the GIL. We look
            # again after a while instead of being told (a caller waking this thread each time
            # it leaves recv() cost a small round trip ~150 us), less often the longer callers
            # keep reading (see mq.node.reader_token).
            token.await_turn(stopped)
            # Releases the GIL; wakes when a frame waits, a link comes or goes, or stop() pokes us.
            events = self._poller(recv_fd).poll(_IDLE_POLL_MS)
            if token.callers:
                continue
            with token.held():
                if not self._serve(events, recv_fd, 64):
                    return

    def _links_changed(self) -> None:
        """The links to read changed (``_net_lock`` held): readers rebuild their poll sets, and
        the I/O thread, asleep in poll() on its old set, is woken to do so."""
        self._links_gen += 1
        if self._bell is not None and threading.current_thread() is not self._reader:
            self._bell.ring()

    def _poller(self, recv_fd: int) -> Any:
        """This thread's poll set over every source of frames, updated when links change."""
        poller = getattr(self._pollers, "set", None)
        if poller is None:
            poller = self._pollers.set = _PollSet()
        if poller.gen != self._links_gen:
            with self._net_lock:  # each source by (fd, which link): a reused fd is a new source
                poller.gen = self._links_gen
                # The doorbell is the I/O thread's alone: a recv() caller that drained it first
                # would leave the I/O thread asleep on its old set (callers look again each frame).
                bell = self._bell.fd if self._bell and threading.current_thread() is self._reader else -1
                sources = {(recv_fd, "nng"), (bell, "wake"), *((fd, x.link) for fd, x in self._inbound.items()),
                           *((fd, x[1].serial) for fd, x in self._watched.items()),
                           *((fd, "listen") for fd in self._listeners)}
            poller.update({(fd, key) for fd, key in sources if fd >= 0})
        return poller

    def _serve(self, events: list[tuple[int, int]], recv_fd: int, budget: int) -> bool:
        """Act on what poll() saw (read token held): deliver up to ``budget`` frames per source,
        take new links, report hung-up ones. False once the inbox socket is closed."""
        for fd, _ev in events:
            if fd == recv_fd:
                if not self._read_nng(budget):
                    return False
            elif fd in self._inbound:
                self._read_link(self._inbound[fd], budget)
            elif fd in self._watched:
                self._hung_up(fd)
            elif fd in self._listeners:
                self._accept(*self._listeners[fd])
            elif self._bell is not None and fd == self._bell.fd:
                self._bell.drain()  # (the poll set was rebuilt before this poll)
        return True

    def _read_nng(self, budget: int) -> bool:
        sock = self._inbox_sock
        assert sock is not None
        msgp = ffi.new("nng_msg **")
        for _ in range(budget):  # a batch, then look again who should be reading
            rv = lib.nng_recvmsg(sock.socket, msgp, lib.NNG_FLAG_NONBLOCK)
            if rv == lib.NNG_ECLOSED:
                return False
            if rv != 0:
                break
            self._handle_frame(msgp[0])
            if self._token.callers and budget > 1:
                break
        return True

    def _read_link(self, link: Any, budget: int) -> None:
        assert self._node is not None
        for _ in range(budget):
            try:
                frame = link.read()
            except (EOFError, OSError):  # the sender closed or died (or we are closing)
                self._drop_inbound(link)  # its outgoing side reports the loss
                return
            except ProtocolError as exc:  # the link's framing is lost: it is unusable
                self._node.on_dropped(f"{link.link[0]} link {link.link}: {exc}; closed it", exc.cause)
                self._drop_inbound(link)
                return
            if frame is None:
                return
            if type(frame) is tcplink.Begun:  # a large frame's header is in, its body coming
                if self._node.trusts(link.link):
                    self._node.on_begun(frame.frame, frame.watch, link.link)
                continue
            self.received += 1
            if not self._node.trusts(link.link):
                if not self._node.on_handshake(frame, link.link):
                    self._drop_inbound(link)  # refused (counted): a stranger gets one frame
                    return
                continue
            try:
                header, buffers = split(frame)
            except ProtocolError as exc:
                self._node.on_dropped(f"frame on {link.link[0]} link {link.link}: {exc}", exc.cause)
                continue
            self._node.on_frame(header, buffers, link.link)

    def _accept(self, listener: Any, inbound: Any) -> None:
        """Take the connections waiting on ``listener`` as links of class ``inbound``."""
        assert self._node is not None
        while True:
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of fds: the pending ones wait in the backlog
                log.warning("node %d: cannot accept a link: %s", self.node_id, exc)
                return
            link = inbound(conn, self._node.max_frame_bytes, self._node.trusts)
            if inbound is tcplink.Inbound:
                link.announce = True  # large frames to relay may go on while they arrive
                link.lend = self._node.lend  # and land where same-host subscribers read them
            with self._net_lock:
                if self._state != "listening" or len(self._inbound) >= _MAX_LINKS:
                    link.close()  # a flood of connections must not take every fd
                    if self._state != "listening":
                        return
                    self._node.on_dropped(f"a link past the {_MAX_LINKS} this node keeps")
                    continue
                self._inbound[link.fd] = link
                self._links_changed()

    def _drop_inbound(self, link: Any) -> None:
        with self._net_lock:
            if self._inbound.pop(link.fd, None) is link:
                self._links_changed()
        link.close()

    def _hung_up(self, fd: int) -> None:
        """Our outgoing link (unix or tcp) to a peer hung up: its process died or closed. (Anything else
        on it ends it too: a peer never speaks on the link it accepted.)"""
        with self._net_lock:
            peer, link = self._watched.get(fd, (None, None))
        if peer is not None and link is not None:
            self._outbound_lost(peer, link)

    def _outbound_lost(self, peer: int, link: Sender | None) -> None:
        """Our ``link`` to ``peer`` is gone: forget it (a later connect opens a new one: a node still
        joining, whose first link the peer closed, must not be answered on the dead one again:
        issue 45's join that never finished) and tell the node. A link no longer the peer's
        (replaced, or still opening: ``None``) changes nothing."""
        with self._net_lock:
            box = self._out.get(peer)
            if link is None or box is not link:
                box = None
            if box is not None:
                self._forget_out(peer)
            if link is not None and self._watched.get(link.fd, (None, None))[1] is link:
                del self._watched[link.fd]
                self._links_changed()  # level-triggered: stop watching it, or poll() would spin
        if box is not None:  # the node hears first: a send the close wakes must raise PeerLost
            if self._state == "listening" and self._node:
                self._node.on_link_lost(peer, "disconnected (its process died or closed the link)")
            box.close()

    def read_in_caller(self, timeout: float, ready: Callable[[], bool]) -> bool:
        if self._inbox_sock is None or self._state != "listening":
            return False
        self._token.read(timeout, ready, self._read_one)
        return True

    def _read_one(self, timeout: float) -> None:
        """A caller's read (reader token held): deliver one NNG message, waiting up to ``timeout``."""
        sock = self._inbox_sock
        if sock is None:
            raise ClosedError("the queue was stopped during recv()")
        if self._listeners:
            # Several sources: wait on all of them at once, in this thread.
            ms = max(1, min(500, int(timeout * 1000)))
            events = self.busy_poll.poll(self._poller(self._recv_fd).poll, ms)
            if self._state != "listening":
                raise ClosedError("the queue was stopped during recv()")
            self._serve(events, self._recv_fd, 1)
            return
        # A frame already waiting (a busy link) is taken without a timeout: a timed
        # receive arms NNG's timer thread, which cost a stream ~40 us per frame.
        msgp = ffi.new("nng_msg **")

        def taken() -> tuple[int] | None:  # a receive that does not wait; None: nothing waits
            code = lib.nng_recvmsg(sock.socket, msgp, lib.NNG_FLAG_NONBLOCK)
            return None if code == lib.NNG_EAGAIN else (code,)

        def received() -> tuple[int]:
            # A power of two at most the time left: the option (a syscall-free but slow
            # setter) keeps its value across calls; a wait cut short loops in recv().
            ms = 1 << max(0, int(timeout * 1000)).bit_length() - 1 if timeout >= 0.001 else 1
            if ms != self._recv_timeout_ms:
                check_err(lib.nng_socket_set_ms(sock.socket, b"recv-timeout", ms))
                self._recv_timeout_ms = ms
            return (lib.nng_recvmsg(sock.socket, msgp, 0),)

        (rv,) = self.busy_poll.wait(taken, received)
        if rv == 0:
            self._handle_frame(msgp[0])
        elif rv == lib.NNG_ECLOSED:
            raise ClosedError("the queue was stopped during recv()")
        elif rv != lib.NNG_ETIMEDOUT:
            check_err(rv)

    def _handle_frame(self, msg: Any) -> None:
        """Deliver the frames of one NNG message (one, or a batch from a busy pipe) in order."""
        self.received += 1
        pipe = lib.nng_msg_get_pipe(msg)
        link = ("pipe", lib.nng_pipe_id(pipe))
        self._drops.delivered(pipe)
        message = msg_view(msg)
        node = self._node
        assert node is not None
        start = 0
        while not node.trusts(link):  # a batch may begin with the LINK that makes it trusted
            frame = handshake.first_frame(message, start)
            if not node.on_handshake(frame, link):
                lib.nng_pipe_close(pipe)  # refused (counted): a stranger gets one frame
                return
            start = (start + len(frame) + ALIGN - 1) & -ALIGN
            if start >= len(message):
                return
        frames = split_batch(message[start:] if start else message)
        del message  # the views of each frame keep the message alive, no longer
        try:
            for header, buffers in frames:
                node.on_frame(header, buffers, link)
        except ProtocolError as exc:  # from splitting: on_frame reports its own
            node.on_dropped(f"frame in a message from {link}: {exc}", exc.cause)


def _advertised_tcp(listen_to: str, listener: pynng.Listener, tls: bool) -> str:
    """The tcp address peers dial for a node listening on ``listen_to`` (its real port; the
    host's name, or MQ_ADVERTISE_HOST, for a wildcard address)."""
    host, _, _ = listen_to[len("tcp://"):].rpartition(":")
    # str() of the bound address carries the real port (pynng's .port is network byte order)
    port = str(listener.local_address).rpartition(":")[2]
    if host in ("0.0.0.0", "*", "", "[::]"):
        host = os.environ.get("MQ_ADVERTISE_HOST") or local().hostname
    return f"{'tls+' if tls else ''}tcp://{host}:{port}"


def _tls_config(files: dict[str, str], mode: int, server_name: str | None = None) -> pynng.TLSConfig:
    return pynng.TLSConfig(mode, ca_string=files["ca"], own_cert_string=files["cert"],
                           own_key_string=files["key"], server_name=server_name,
                           auth_mode=pynng.TLSConfig.AUTH_MODE_REQUIRED)


def _listen(sock: Any, address: str, tls: bool) -> Any:
    """The inbox's listener on ``address``, or a ConfigError that says what to change."""
    try:
        return sock.listen(("tls+" if tls else "") + address)
    except pynng.AddressInUse:
        raise ConfigError(f"listen_to {address!r} is already in use: pick another port "
                          "(or port 0 for an ephemeral one)") from None
    except pynng.NNGException as exc:
        raise ConfigError(f"cannot listen on {address!r}: {exc}") from None


def _tcp_link_listener(listen_to: str, node_id: int) -> Any:
    """A listener for tcp links beside NNG's port; None where it cannot be had (peers then
    reach the node through NNG's tcp, as without links)."""
    try:
        return tcplink.listen(tcplink.split_address(listen_to)[0])
    except OSError as exc:
        log.warning("node %d: no tcp link listener on %s (%s): NNG's tcp only", node_id, listen_to, exc)
        return None


class _Doorbell:
    """A pipe that wakes a thread asleep in ``poll()`` on :attr:`fd`: rung from any thread,
    drained by whoever reads. Rung and closed under its owner's lock (a closed fd's number may
    be reused at once: a late ring must not write into another file)."""

    __slots__ = ("fd", "_w")

    def __init__(self) -> None:
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)

    def ring(self) -> None:
        if self._w >= 0:
            with contextlib.suppress(BlockingIOError):  # full: the reader is woken already
                os.write(self._w, b"x")

    def drain(self) -> None:
        with contextlib.suppress(OSError):  # another reader drained it first, or it closed
            os.read(self.fd, 4096)

    def close(self) -> None:
        for fd in (self.fd, self._w):
            if fd >= 0:
                os.close(fd)
        self.fd = self._w = -1


class _PollSet:
    """The fds one thread waits on, as ``select.poll`` takes them (``poll(ms)`` -> ``[(fd,
    events)]``) but through epoll: ``poll()`` costs the kernel a visit to every fd at every
    call, and an idle node of a large mesh waits on one fd per peer twice a second.

    It is updated in place as links come and go (only the changes reach the kernel): rebuilding
    it cost a joining node of an N-node mesh O(N) calls per new link, and a new epoll fd each
    time, which a process near its fd limit did not have (EMFILE killed the I/O thread)."""

    __slots__ = ("_epoll", "_sources", "gen")

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._sources: set[tuple[int, Any]] = set()  # (fd, which source it is)
        self.gen = -1  # the transport's links generation it reflects

    def update(self, sources: set[tuple[int, Any]]) -> None:
        """Wait on exactly ``sources`` from now on: unregister what went (first: a reused fd
        number is unregistered, then registered as the new source), register what came."""
        for fd, _ in self._sources - sources:
            try:
                self._epoll.unregister(fd)
            except (OSError, ValueError):  # closed already: the kernel dropped it itself
                pass
        kept = self._sources & sources
        for fd, key in sources - self._sources:
            try:
                self._epoll.register(fd, select.EPOLLIN)
                kept.add((fd, key))
            except FileExistsError:  # the same fd is also another source (never, but harmless)
                kept.add((fd, key))
            except OSError:  # closed since it was listed (a link went, a stop): the next update
                pass
        self._sources = kept

    def poll(self, ms: int) -> list[tuple[int, int]]:
        return self._epoll.poll(ms / 1000 if ms >= 0 else -1)

    def close(self) -> None:
        self._epoll.close()
