"""Dispatch: what the transport reports (the :class:`mq.transport.Events` of a node), and where
each frame goes.

:class:`Dispatch` is the object a transport holds (``transport.start(dispatch)``). It admits a
frame only from the peer that proved itself on its link, decodes it (shm descriptors only into
that peer's pool) and switches on its kind::

    transport I/O thread -> Dispatch.on_frame -> codec.decode -> admission
        HELLO/HELLO_ACK/LINK -> Join          MSG -> Delivery (queues | handler thread)
        REQ -> Calls (pool)   REP -> Calls    PING/BYE -> Liveness   SUBS -> PeerTable
        RELEASE -> Sender (our pools)         RELAY -> Fanout
        GPU_POOL -> Sender's GpuPath (CUDA pool offers and verdicts)
        PATH -> Sender -> the data path its tag names (rdma offers and verdicts)
    a link not trusted yet -> Dispatch.on_handshake -> mq.wire.handshake.parse -> Join, only
    a large frame's header, its body still coming -> Dispatch.on_begun -> Fanout (RELAY only)

It never runs user code on an I/O thread (``on_request`` runs a call handler on the
transport's request thread, which it keeps apart from the threads that carry frames). Nothing
a peer sends raises out of here: a malformed or refused frame is dropped and counted.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from mq.wire import handshake as _handshake
from mq.node.calls import Calls
from mq.wire.codec import (BYE, GPU_POOL, HELLO, HELLO_ACK, KIND_NAMES, LINK, MSG, PATH, PING, RELAY, RELEASE, REP_ERR,
                      REP_OK, REQ, SUBS, Codec, Envelope, Frame, buffer_nbytes, split)
from mq.datapaths.base import tag_of
from mq.fanout.cut_through import body_offset
from mq.node.delivery import Delivery
from mq.errors import PeerLeft, ProtocolError
from mq.fanout.relays import Fanout
from mq.node.join import Join
from mq.node.lifecycle import Lifecycle
from mq.node.liveness import Liveness
from mq.node.peers import PeerTable
from mq.node.sender import COUNTED, Sender
from mq.node.stats import Refusals, Stats

log = logging.getLogger("mq")

# Frames accepted from a link that has not proven membership yet: the handshake itself.
_HANDSHAKE = frozenset({HELLO, HELLO_ACK, LINK})


class Dispatch:
    """The transport events of node ``node_id`` (see the module docstring and
    :class:`mq.transport.Events`, whose names and signatures these are).

    Args:
        max_frame_bytes: larger incoming frames are dropped (the transport checks).
        secret: the job's :class:`mq.auth.Secret` (None when insecure): the transport signs its
            rendezvous values with it.
        window: the frames in flight peers may send us unconfirmed (our queue size, said in our
            HELLO): we confirm every quarter of it.
    """

    def __init__(self, node_id: int, codec: Codec, peers: PeerTable, join: Join, delivery: Delivery,
                 calls: Calls, liveness: Liveness, sender: Sender, fanout: Fanout, life: Lifecycle,
                 stats: Stats, refusals: Refusals, *, max_frame_bytes: int, secret: Any, window: int):
        self.node_id = node_id
        self._receipt_every = max(1, window // 4)  # a quarter of the window peers keep to us
        self.max_frame_bytes = max_frame_bytes
        self.secret = secret
        self.waits = peers.waits  # the transport's waits (a full link, credit) go through the node's
        # Bound once: on_frame runs per message (see scripts/hotpath).
        self._decode = codec.decode
        self._peers = peers
        self._peer_of = peers.by_id
        self._links = peers.links
        self._joining = peers.joining  # (empty but for a join's last moments: see PeerTable.bind)
        self.trusts = peers.links.__contains__
        self._join = join
        self._deliver = delivery.deliver
        self._reading = delivery.reading
        self._calls = calls
        self._liveness = liveness
        self._sender = sender
        self._fanout = fanout
        self._life = life
        self._stats = stats
        self._refusals = refusals

    # ------------------------------------------------------------------ Events
    def on_handshake(self, frame: Any, link: Any) -> bool:
        """A frame from a link that has not authenticated (the transport's I/O thread): only the
        handshake parser reads it (:mod:`mq.wire.handshake`). False when it was refused (counted):
        the transport closes the link."""
        try:
            kind, sender, payload = _handshake.parse(frame)
            self._join.handle(Envelope(kind, "", sender, 0, 0, payload), link)
        except ProtocolError as exc:
            self._refusals.refused(exc)
            return False
        except Exception as exc:  # a bug of ours: it must not stop the I/O thread either
            self._refusals.failed(exc)
            return False
        return True

    def on_frame(self, header: Any, buffers: list[Any], link: Any) -> None:
        """A frame arrived on a trusted ``link`` (the transport's I/O thread): decode and route
        it. A frame's sender is its link's peer. A malformed or refused frame is dropped and
        counted; nothing a peer sends raises out of here."""
        try:
            shared = type(header) is not list or header[8] is not None  # parsed: no descriptors
            env = self._decode(header, buffers, self._resolve_for(link) if shared else None)
            if env.kind in _HANDSHAKE:  # a peer greeting again: held to the same schema
                self._join.handle(env._replace(payload=_handshake.check(env.kind, env.sender, env.payload)), link)
            # (admission: the frame's sender is its link's peer; checked inline, refused by _admit)
            elif (peer := self._links.get(link)) != env.sender and (peer := self._admit(env, link)) is None:
                pass  # refused and counted
            elif (p := (self._joining.get(peer) if self._joining else None) or self._peer_of[peer]).lost:
                # It left (or went silent): answers to our own farewell still count; the rest
                # of what was in flight is dropped quietly, as the sender was told (PeerLost).
                if env.kind in (REP_OK, REP_ERR):
                    self._calls.on_reply(env)
                elif env.kind in (PING, BYE):
                    # Its receipt still counts: a link's loss may be told before the frames
                    # read before it (inproc, NNG's pipe events), and a BYE's receipt is what
                    # tells our stop() that what we sent it arrived.
                    self._liveness.on_receipt(env.sender, env.payload)
                elif env.kind in COUNTED:  # counted: its sender learnt it (PeerLost, Undelivered)
                    self._refusals.discarded("peer_left", f"a {KIND_NAMES[env.kind]} frame from node "
                                             f"{env.sender}, which {p.lost}")
            else:
                self._stats.received += 1
                p.last_seen = time.monotonic()
                if env.kind in COUNTED:
                    p.rx += 1
                    if not p.probed and not p.asked:  # traffic on an idle pair: probing resumes now
                        self._liveness.traffic(p)
                    if p.rx - p.rx_told >= self._receipt_every and not p.receipt_due:
                        p.receipt_due = True  # its window is closing: confirm what we took
                        self._liveness.receipt_due(p)
                if env.kind == MSG:  # the queue's byte bound counts inline bytes (the pool bounds shared ones)
                    self._deliver(env.topic, env.payload, env.sender, env.sent_at, env.nbytes,
                                  sum(buffer_nbytes(b) for b in buffers) if shared else env.nbytes)
                else:
                    self._route(env)
        except ProtocolError as exc:
            self._refusals.refused(exc)
        except Exception as exc:  # a bug of ours: it must not stop the I/O thread either
            self._refusals.failed(exc)

    def on_begun(self, frame: Any, watch: Callable[[], Any], link: Any) -> None:
        """A large frame's header is in (see :meth:`mq.transport.Events.on_begun`): a RELAY hop
        from the live peer of ``link`` may be forwarded while it arrives (:mod:`mq.fanout.cut_through`).
        Anything else waits to be judged whole by :meth:`on_frame`, so nothing is counted here."""
        try:
            header, buffers = split(frame)  # the body's views: bytes still to come
            peer = self._links.get(link)
            p = self._peer_of.get(peer) if peer is not None else None
            if header[1] != RELAY or header[3] != peer or p is None or p.lost or header[8] is not None:
                return
            assert peer is not None  # p is not None: it is peer's
            self._fanout.on_begun(peer, header, buffers, body_offset(frame), watch)
        except ProtocolError:
            pass  # on_frame refuses it (counted) once it is whole
        except Exception as exc:  # a bug of ours: it must not stop the I/O thread either
            self._refusals.failed(exc)

    def on_request(self, header: Any, buffers: list[Any], link: Any) -> Frame | None:
        """A REQ frame whose reply goes back in the same exchange (``Transport.request``):
        checked like any frame (:meth:`_admit`), served in this thread, the reply returned.

        The transport calls this on a thread that may block for the handler's duration (torch
        RPC: one of its request threads, of which it keeps some free for frames). At most
        ``handler_threads`` handlers run this way at once; past that, and while the sender's
        join is still being confirmed here (its LINK frame, sent before, may not be handled
        yet), this returns None and the sender sends the request as an ordinary frame.

        Raises:
            ProtocolError: the frame is malformed or refused (counted).
        """
        if not self.trusts(link):
            # Decode nothing a link sends before it joined. Its sender may still be joining
            # (its LINK frame not handled yet): the request comes again as an ordinary frame,
            # which the handshake parser refuses unless the join finished first.
            return None
        try:
            env = self._decode(header, buffers, self._resolve_for(link))
        except ProtocolError as exc:
            self._refusals.refused(exc)
            raise
        except Exception as exc:
            self._refusals.failed(exc)
            raise ProtocolError(f"malformed request: {type(exc).__name__}") from None
        if env.kind != REQ:
            self.on_dropped(f"a {KIND_NAMES[env.kind]} frame sent as a request")
            raise ProtocolError(f"a {KIND_NAMES[env.kind]} frame is not a request")
        if not self._life.listening:
            return None
        peer = self._admit(env, link)
        if peer is None:
            raise ProtocolError(f"node {self.node_id} refused a request claiming node {env.sender}")
        p = self._peer_of.get(peer)
        if p is None:
            # Its link is bound but the join is not finished on our I/O thread yet (this runs on
            # another thread): the ordinary frame comes after the join in order.
            return None
        if p.lost:
            return None  # as on_frame: the ordinary frame is dropped, the caller learns PeerLost
        return self._calls.serve_now(env, p)

    def lend(self, nbytes: int) -> Any:
        pool = self._sender.pool
        return pool.lend(nbytes) if pool is not None else None

    def on_link_lost(self, peer: int, why: str) -> None:
        if self._life.state in ("listening", "stopping"):  # (stop()'s drain must hear of it too)
            self._peers.lose(peer, why)
            self._calls.link_lost(peer)  # a goodbye's promised answers cannot come any more

    def on_dropped(self, why: str, cause: str = "malformed") -> None:
        self._refusals.dropped(why, cause)

    # ------------------------------------------------------------------ admission and routing
    def _admit(self, env: Envelope, link: Any) -> int | None:
        """The peer a (non-handshake) frame on ``link`` comes from: the authenticated peer of
        that link, which must be the frame's sender. None when the frame is refused (counted)."""
        peer = self._links.get(link)
        if peer is None:
            self._refusals.reject("unauthenticated", f"a {KIND_NAMES[env.kind]} frame claiming node "
                                  f"{env.sender} on a link that never proved membership")
            return None
        if env.sender != peer:
            self._refusals.reject("spoofed_sender", f"a frame on node {peer}'s link claims to come from "
                                  f"node {env.sender}")
            return None
        return peer

    def _route(self, env: Envelope) -> None:
        """A decoded frame other than MSG from a live, authenticated peer (its sender). Runs
        on the transport's I/O thread: never runs user code."""
        kind = env.kind
        if kind == REQ:
            # A thread reading for itself (recv(), a call or wait_released waiting) must not
            # wait for handlers, which may wait for it.
            self._calls.submit(env, wait=not self._reading.active)
        elif kind in (REP_OK, REP_ERR):
            self._calls.on_reply(env)
        elif kind == SUBS:
            self._peers.set_subscriptions(env.sender, env.payload if isinstance(env.payload, list) else [])
        elif kind == RELEASE:
            self._sender.on_release(env.sender, env.payload)
        elif kind == PING:
            self._liveness.on_ping(env)
        elif kind == RELAY:
            self._fanout.on_frame(env)
        elif kind == GPU_POOL:
            self._sender.gpu.on_frame(env.sender, env.payload)
        elif kind == PATH:
            self._sender.on_path_frame(env.sender, env.payload)
        elif kind == BYE:
            self._liveness.on_bye(env)

    def _resolve_for(self, link: Any) -> Callable[[int, Any], Any]:
        tags = self._sender.tags
        def resolve(sender: int, desc: Any) -> Any:
            # Descriptors only from the authenticated peer of this link, into its own pools.
            peer = self._links.get(link, -1)
            p = self._peer_of.get(peer) if not self._joining else self._peers.receiving(peer)
            if p is not None and p.lost:  # its pools went with it: say so, not "malformed"
                raise PeerLeft(f"a frame from node {sender}, which {p.lost}, whose buffers were in its pool")
            # The descriptor's tag names its data path (untagged or unknown: shm, which refuses
            # what it cannot read); that path's reader on the peer checks the rest.
            tag = tag_of(desc)
            if tag not in tags:
                tag = None
            reader = p.readers.get(tag) if p is not None and p.node_id == sender else None
            if reader is None:
                raise ProtocolError(f"a {tag or 'shared-memory'} descriptor claiming node {sender} on a "
                                    "link whose peer never offered that memory here")
            return reader.view(desc)
        return resolve
