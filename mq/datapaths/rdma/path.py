"""The rdma data path of one node (route ``rdma``): large CPU buffers to peers on other hosts,
pulled by the receiver with one-sided reads (:mod:`mq.datapaths.rdma.engine`, NIXL with its UCX backend).

Sending places a buffer in this node's *send pool* (host memory registered with the engine in
reusable segments: registered once when a segment is made, never per message) and puts its
descriptor ``["rdma", seg_id, gen, offset, nbytes]`` in the frame. The receiver checks the
descriptor against the segments this peer offered, pulls the bytes into its own *landing pool*
(registered the same way), hands its user a zero-copy view of the landing slot, and gives the
sender's slot back at once (a RELEASE item ``["rdma", seg_id, gen, count]``): the sender's slot
is held for one pull, the receiver's for as long as its user keeps the view.

Why the receiver reads rather than the sender writes: the receiver knows where it has room (its
landing pool never waits on a peer), and only memory that holds data placed for sending is ever
exposed: a peer's keys open our send pool to reads, never our landing memory to writes.

The offer (frame kind ``PATH``, tag ``rdma``, on the authenticated link, after the join)::

    sender -> peer:  {"offer": {"seq", "agent", "meta", "segments", "mac"}}
    peer -> sender:  {"verdict": seq, "error": None or why}

``meta`` is the engine's metadata (UCX address, memory keys); ``segments`` lists ``[seg_id,
addr, size]``. ``mac`` binds them to both nodes' ids and incarnations and a sequence number with
the job secret (:meth:`mq.auth.Secret.proof`): a stranger cannot forge an offer, and one
replayed from another incarnation or out of order is refused and counted. The peer's metadata
reaches NIXL's parser only after that check. The first offer waits for its verdict (a failure
leaves the peer on tcp, with the reason in ``routes()``); a new segment is offered again, on the
same link, before the first frame that names it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import itertools
import logging
import mmap
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import msgspec
import numpy as np

from mq.node import peer_route
from mq.datapaths.rdma import engine as _rdma
from mq.node import waits as _waits
from mq.wire.codec import PATH
from mq.datapaths.base import (DataPath, SegmentPool, Slot, SlotTable, address_of, as_uint8, on_cpu,
                               size_class, view_until_garbage)
from mq.routing import Verdict
from mq.errors import ConfigError, MQError, PeerLeft, PeerLost, ProtocolError, Timeout
from mq.options import check_int
from mq.node.waits import Waits

log = logging.getLogger("mq")

TAG = "rdma"
#: Default bound of each pool (send and landing): a quarter of RAM, at most 4 GiB; a 640 MB
#: weight tensor fits.
DEFAULT_POOL_BYTES = min(4 << 30, (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // 4)
#: Buffers smaller than this stay inline in the frame, on the link: a pull is a round trip.
DEFAULT_INLINE_MAX = 64 << 10
_MIN_SEGMENT = 1 << 20
#: How long the first send to a peer waits for its verdict on our offer.
VERDICT_WAIT_S = 5.0
#: Offers a peer left unanswered before its route falls back to tcp (with the reason).
MAX_UNANSWERED = 3
#: How long a frame waits for the offer of the segment it names, when another thread reads it.
OFFER_WAIT_S = 2.0
#: Only a segment id at most this far past the newest loaded is waited for (ids grow by one per
#: segment); a wilder one is refused at once.
_NEWER_SEGMENTS = 64
#: How long a pull that NIXL cannot start yet (memory not found) is tried again.
START_RETRY_S = 1.0
#: Buffers are copied into segments in pieces this large, letting other threads (the
#: heartbeat) take the GIL in between: a 512 MB buffer must not silence a node for seconds.
_PIECE = 64 << 20
#: A pull that makes no progress this long gives up (the peer's host vanished without a FIN);
#: a pull of n bytes may take n / _SLOWEST_BPS longer.
PULL_STALL_S = 10.0
_SLOWEST_BPS = 50e6
_MAX_SEGMENTS = 4096
_MAX_META = 1 << 20
_MAX_SEGMENT = 1 << 40


@dataclass(eq=False, kw_only=True)
class _Segment(Slot):
    """One registered region: a slot holding one buffer at a time (``gen`` bumped on reuse)."""

    memory: np.ndarray
    base: int
    registration: Any


class RegisteredPool(SegmentPool):
    """Host memory registered with ``engine`` in reusable segments, at most ``max_bytes``
    (:class:`~mq.datapaths.base.SegmentPool`).

    ``waits``: a full send pool makes ``take`` wait for releases (backpressure, then Timeout
    naming what is held); a landing pool never waits on a peer: past its bound it retires free
    segments, and grows anyway when its user holds every one (counted as ``over_bound``),
    as an inline receive would allocate.
    """

    def __init__(self, engine: Any, max_bytes: int, *, waits: bool, label: str, node_waits: Any = None):
        self.engine = engine
        self.max_bytes = max_bytes
        self.waits = waits
        self.label = label
        self.stats = {"segments": 0, "registered_bytes": 0, "registrations": 0, "over_bound": 0}
        self.slots = self._slots = SlotTable(stats=self.stats, waits=node_waits)
        self.closed_text = f"the rdma {label} pool is closed (the queue stopped)"
        self.version = 0  # bumped when a segment is made or retired: peers must hear of it
        self._bytes = 0
        self._closed = False

    def take(self, nbytes: int, timeout: float, claim: Callable[[_Segment], None] = lambda _seg: None,
             peers: Iterable[int] = ()) -> _Segment:
        """A free segment for ``nbytes`` (best fit), a new one, or (send pool) wait while
        ``peers`` live; ``claim(seg)`` runs under the lock as it is found (nobody else takes it)."""
        cap = size_class(max(nbytes, _MIN_SEGMENT))
        if cap > self.max_bytes and self.waits:
            raise ConfigError(f"a {nbytes}-byte buffer does not fit the rdma {self.label} pool "
                              f"({self.max_bytes} bytes): raise rdma_pool_bytes")
        if not self.waits:
            with self.slots.cond:
                seg = self._fit(nbytes, cap)
                if seg is None:
                    self.stats["over_bound"] += 1
                    seg = self._new_segment(cap)
                claim(seg)
                return seg
        return self._wait_for_segment(nbytes, cap, timeout, claim, peers)

    def _new_segment(self, cap: int, populate: bool = False) -> _Segment:  # (always populated)
        memory = _populated(cap)
        base = address_of(memory)[0]
        registration = self.engine.register(base, cap)
        seg = self.slots.add(_Segment(slot_id=self.slots.next_id(), size=cap, memory=memory, base=base,
                                      registration=registration))
        self._bytes += cap
        self.version += 1
        self.stats["segments"] += 1
        self.stats["registrations"] += 1
        self.stats["registered_bytes"] = self._bytes
        return seg

    def _drop(self, seg: _Segment) -> None:
        self.slots.remove(seg)
        self._bytes -= seg.size
        self.version += 1
        self.stats["segments"] -= 1
        self.stats["registered_bytes"] = self._bytes
        self.engine.deregister(seg.registration)

    def _full(self, timeout: float) -> str:
        held = self.slots.held_by()
        return (f"the rdma send pool stayed full for {timeout:g}s ({sum(held.values()) >> 20} MiB of "
                f"{self.max_bytes >> 20} MiB held for nodes {sorted(held)} that have not pulled yet): "
                "raise rdma_pool_bytes or pass timeout= to wait longer")

    def segments(self) -> list[list[int]]:
        """``[seg_id, addr, size]`` of every segment (what an offer lists)."""
        with self.slots.cond:
            return [[s.slot_id, s.base, s.size] for s in self.slots.slots.values()]  # type: ignore[attr-defined]

    def get(self, seg_id: int) -> _Segment | None:
        return self.slots.slots.get(seg_id)  # type: ignore[return-value]

    def close(self) -> None:
        with self.slots.cond:
            self._closed = True
            for seg in list(self.slots.slots.values()):
                if not seg.holders and not seg.pinned:
                    self._drop(seg)  # type: ignore[arg-type]


class _Offer(msgspec.Struct, forbid_unknown_fields=True):
    seq: int
    agent: str
    meta: bytes
    segments: list[tuple[int, int, int]]
    mac: bytes | None = None


class RdmaReader:
    """A peer's send pool as it offered it, opened here: views of its descriptors are pulled
    into our landing pool (kept on the peer as ``Peer.readers["rdma"]``)."""

    def __init__(self, path: "RdmaPath", peer: int, agent: str):
        self._path = path
        self.peer = peer
        self.agent = agent
        self.segments: dict[int, tuple[int, int]] = {}  # seg_id -> (addr, size)
        # Offers and frames may be read by two threads (the I/O thread, and one reading for
        # itself): a frame naming a segment whose offer another thread is loading waits for it
        # (on this reader, through the node's waits).
        self.loading = threading.Lock()
        self.waits = getattr(path, "waits", None) or Waits()
        self.seq = 0
        self.refused = 0
        self.closed = False

    def view(self, desc: Any) -> memoryview:
        """Pull the buffer ``desc`` names into our landing pool; a zero-copy view of it.

        Raises:
            ProtocolError: a malformed descriptor, or one outside what the peer offered (counted
                in ``refused``); PeerLeft: the peer died during the pull.
        """
        if not (type(desc) is list and len(desc) == 5 and all(type(x) is int for x in desc[1:])):
            self.refused += 1
            raise ProtocolError(f"malformed rdma descriptor from node {self.peer}")
        _tag, seg_id, gen, offset, nbytes = desc
        seg = self.segments.get(seg_id)
        newest = max(self.segments, default=0)
        if seg is None and newest < seg_id <= newest + _NEWER_SEGMENTS:  # an offer not loaded yet
            try:
                self.waits.until(lambda: seg_id in self.segments or self.closed,
                                       time.monotonic() + OFFER_WAIT_S, on=(self,), peers=(self.peer,))
            except MQError:
                pass  # (not in time, or its peer is gone): refused below
            seg = self.segments.get(seg_id)
        if seg is None or offset < 0 or nbytes <= 0 or offset + nbytes > seg[1]:
            self.refused += 1
            raise ProtocolError(f"an rdma descriptor from node {self.peer} outside the memory it offered "
                                f"(segment {seg_id}, {offset}+{nbytes})")
        if self.closed:
            raise PeerLeft(f"node {self.peer}'s rdma memory is closed here")
        return self._path.pull(self, seg[0] + offset, nbytes, seg_id, gen)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.waits.wake(self)
            self._path.drop_reader(self)


class RdmaPath(DataPath):
    """The rdma path of node ``node_id`` (see the module docstring).

    Args:
        mode: ``rdma=`` of :func:`mq.create` (:data:`mq.datapaths.rdma.engine.MODES`).
        pool_bytes: bound of the send pool and of the landing pool.
        inline_max: CPU buffers smaller than this stay inline.
    """

    route = "rdma"
    tag = TAG
    device = "cpu"

    def __init__(self, node_id: int, host: Any, *, mode: Any, pool_bytes: int, inline_max: int,
                 secret: Any, incarnation: str, locality: Any, required: Any = None):
        self.mode = _rdma.check_mode(mode)
        check_int(pool_bytes, "rdma_pool_bytes", minimum=_MIN_SEGMENT, unit="bytes")
        check_int(inline_max, "rdma_inline_max", minimum=0, unit="bytes")
        self.node_id = node_id
        self._host = host
        self._peers = host.peers
        self._releases = host.releases
        self.pool_bytes = pool_bytes
        self.inline_max = max(1, inline_max)
        self._secret = secret
        self.incarnation = incarnation
        self._locality = locality
        self._required = required
        #: entered while a pull holds the thread that reads frames (liveness must not judge peers
        #: silent meanwhile: their frames wait unread)
        self.reader_busy: Any = contextlib.nullcontext
        self.unavailable: str | None = "not opened yet"
        self.engine: Any = None
        self.send_pool: RegisteredPool | None = None
        self.landing: RegisteredPool | None = None
        self._cond = threading.RLock()  # offers and verdicts; waits for them: ``self.waits``
        self.waits = getattr(host, "waits", None) or Waits()
        self._offered: dict[int, int] = {}  # peer -> pool version it has been offered
        self._unanswered: dict[int, set[int]] = {}  # peer -> offers (seq) awaiting its verdict
        self._timeouts: dict[int, int] = {}  # peer -> first offers it left unanswered
        self._seqs = itertools.count(1)  # offer sequence numbers: a peer refuses one not above the last
        self._verdicts: dict[int, str | None] = {}  # peer -> None (opened our memory) or why not
        self._peer_locks: dict[int, threading.Lock] = {}
        self.stats = {"offers": 0, "offers_refused": 0, "verdicts_ok": 0, "verdicts_failed": 0, "verdict_timeouts": 0,
                      "placed": 0, "copied_bytes": 0, "pulls": 0, "pulled_bytes": 0, "pull_failures": 0,
                      "start_retries": 0,
                      "descriptors_refused": 0}

    @classmethod
    def make(cls, host: Any, options: dict[str, Any]) -> "RdmaPath":
        return cls(host.node_id, host, mode=options.get("rdma", "auto"),
                   pool_bytes=options.get("rdma_pool_bytes") or DEFAULT_POOL_BYTES,
                   inline_max=options.get("rdma_inline_max", DEFAULT_INLINE_MAX),
                   secret=options.get("secret"), incarnation=options.get("incarnation", ""),
                   locality=options.get("locality"), required=options.get("require_route"))

    def open(self) -> None:
        from mq.locality import local

        locality = self._locality or local()
        why = _rdma.why_off(self.mode, locality)
        if why:
            self.unavailable = why
            return
        device = _rdma.choose_device(locality) if self.mode == "auto" else None
        try:
            self.engine = _rdma.shared_engine(self.mode, device)
        except Exception as exc:  # NIXL missing, or UCX would not start: say so, use tcp
            self.unavailable = f"the RDMA engine did not start: {exc}"
            log.warning("node %d: rdma path off: %s", self.node_id, self.unavailable)
            return
        self.send_pool = RegisteredPool(self.engine, self.pool_bytes, waits=True, label="send", node_waits=self.waits)
        self.landing = RegisteredPool(self.engine, self.pool_bytes, waits=False, label="landing",
                                      node_waits=self.waits)
        self.unavailable = None

    # ------------------------------------------------------------------ joining
    def caps(self) -> dict[str, Any] | None:
        """What a HELLO says of this path (no keys: those travel only in signed offers)."""
        if self.unavailable or self.engine is None:
            return None
        return {"engine": f"nixl {self.engine.version}", "mode": self.mode, "device": self.engine.device,
                "transport": self.engine.transport, "agent": self.engine.name}

    def viable(self, theirs: Any) -> Verdict:
        """Whether this node and a peer whose HELLO said ``theirs`` can use the path, and why."""
        mine = self.caps()
        if mine is None:
            return Verdict(False, f"this node: {self.unavailable}")
        if type(theirs) is not dict or type(theirs.get("mode")) is not str:
            return Verdict(False, "the peer has no rdma path (rdma off, or NIXL missing there)")
        if theirs["mode"] != mine["mode"]:
            return Verdict(False, f"rdma='{mine['mode']}' here but '{theirs['mode']}' on the peer")
        if mine["mode"] == "tcp":
            return Verdict(True, f"{mine['engine']} over UCX's tcp transport on both sides (rdma='tcp': "
                                 "no RDMA device carries it)", needs_device=False)
        return Verdict(True, f"{mine['engine']}, UCX on {mine['device']} here, {theirs.get('device')} on the "
                             f"peer ({mine['transport']})")

    # ------------------------------------------------------------------ offers
    def _proof(self, me: int, my_inc: str, them: int, their_inc: str, offer: _Offer) -> bytes:
        digest = hashlib.sha256(offer.meta + msgspec.msgpack.encode([offer.seq, offer.agent, offer.segments]))
        return self._secret.proof("rdma-offer", digest.digest(), their_inc.encode(), me, them, my_inc)

    def _offer(self, peer: int, deadline: float) -> None:
        """Offer ``peer`` our send pool as it is now (called with the peer's lock held)."""
        assert self.send_pool is not None and self.engine is not None
        with self.send_pool.slots.cond:
            version = self.send_pool.version
            segments = [tuple(s) for s in self.send_pool.segments()]
            # all of it each time (address and every segment's key): a peer that loaded only a
            # partial update before its connection was up could not find our memory (seen:
            # NIXL_ERR_NOT_FOUND), and the whole is a few hundred bytes
            meta = self.engine.metadata()
        p = self._peers.get(peer)
        their_inc = str(p.info.get("incarnation", "")) if p is not None else ""
        offer = _Offer(seq=next(self._seqs), agent=self.engine.name, meta=meta,
                       segments=segments)  # type: ignore[arg-type]
        if self._secret is not None:
            offer.mac = self._proof(self.node_id, self.incarnation, peer, their_inc, offer)
        with self._cond:  # before it goes: the verdict may come before the send returns
            self._unanswered.setdefault(peer, set()).add(offer.seq)
        try:
            self._host.send_control(peer, PATH, [TAG, {"offer": msgspec.structs.asdict(offer)}],
                                    max(0.1, deadline - time.monotonic()))
        except BaseException:
            with self._cond:
                self._unanswered.get(peer, set()).discard(offer.seq)
            raise
        with self._cond:
            self._offered[peer] = version
        self.stats["offers"] += 1

    def on_frame(self, peer: int, body: Any) -> None:
        """A PATH frame for this path from an authenticated peer: an offer or a verdict."""
        if type(body) is not dict or len(body) not in (1, 2):
            raise ProtocolError(f"node {peer}: an rdma frame is an offer or a verdict")
        if "offer" in body:
            try:
                self.accept(peer, body["offer"])
                error = None
            except ProtocolError as exc:
                error = str(exc)
            seq = body["offer"].get("seq") if type(body["offer"]) is dict else None
            if type(seq) is int:
                self._host.send_control(peer, PATH, [TAG, {"verdict": seq, "error": error}], 5.0)
        elif "verdict" in body:
            error = body.get("error")
            if not (error is None or isinstance(error, str)):
                error = "a malformed verdict"
            seq = body.get("verdict")
            with self._cond:
                if seq not in self._unanswered.get(peer, ()):
                    return  # a verdict on nothing we offered: ignore
                self._unanswered[peer].discard(seq)
                first = peer not in self._verdicts
                if first or error is not None:
                    self._verdicts[peer] = error
            self.waits.wake(self)
            self.stats["verdicts_ok" if error is None else "verdicts_failed"] += 1
            p = self._peers.get(peer)
            if error is not None and not first and p is not None:  # a later offer failed
                peer_route.degrade_cpu(p, f"node {peer} could not load this node's rdma offer: {error}",
                                       self._required)
        else:
            raise ProtocolError(f"node {peer}: an rdma frame is an offer or a verdict")

    def offer(self) -> Any:
        """What a HELLO carries: the path's capabilities (its keys go in signed offers, later)."""
        return self.caps()

    def accept(self, peer: int, offer: Any) -> RdmaReader:
        """Check and load a peer's signed offer: its reader (made or updated).

        Raises:
            ProtocolError: the offer is refused, and why (counted in ``offers_refused``).
        """
        why = self._load(peer, offer)
        if why is not None:
            self.stats["offers_refused"] += 1
            log.warning("node %d: rdma offer of node %d refused: %s", self.node_id, peer, why)
            raise ProtocolError(why)
        p = self._peers.get(peer)
        return p.readers[TAG]

    def _load(self, peer: int, raw: Any) -> str | None:
        """Load a peer's offer; None when loaded, else why it is refused."""
        try:
            offer = msgspec.convert(raw, _Offer)
        except msgspec.ValidationError as exc:
            return f"malformed offer: {exc}"
        p = self._peers.get(peer)
        if p is None or self.engine is None or self.landing is None:
            return "this node has no rdma path" if self.engine is None else "not a peer"
        their_inc = str(p.info.get("incarnation", ""))
        caps = p.info.get("rdma")
        if type(caps) is not dict or offer.agent != caps.get("agent"):
            return f"offer names agent {offer.agent[:80]!r}, not the one node {peer} joined with"
        if len(offer.meta) > _MAX_META or len(offer.segments) > _MAX_SEGMENTS or any(
                not (0 < a < 1 << 64 and 0 < n <= _MAX_SEGMENT and 0 < i < 1 << 62)
                for i, a, n in offer.segments):
            return "offer out of bounds (metadata, segment count or sizes)"
        if self._secret is not None and (offer.mac is None or not _equal(
                offer.mac, self._proof(peer, their_inc, self.node_id, self.incarnation, offer))):
            return "offer not signed with the job secret (forged, or from another incarnation)"
        reader = p.readers.get(TAG) or RdmaReader(self, peer, offer.agent)
        with reader.loading:
            if TAG in p.readers and offer.seq <= reader.seq:
                return f"offer {offer.seq} replayed (already at {reader.seq})"
            began = time.monotonic()
            try:
                name = self.engine.add_peer(offer.meta)
            except Exception as exc:
                return f"the engine refused its metadata: {exc}"
            took = time.monotonic() - began
            if took > 1.0:  # UCX connects when it loads a peer: a slow network shows here
                log.warning("node %d: loading node %d's rdma metadata took %.1fs", self.node_id, peer, took)
            if name != offer.agent:
                return f"metadata of agent {name[:80]!r}, not {offer.agent[:80]!r}"
            reader.segments = {i: (a, n) for i, a, n in offer.segments}
            reader.seq = offer.seq
            if TAG not in p.readers:
                self.engine.hold_peer(name)
            p.readers[TAG] = reader
        self.waits.wake(reader)
        log.debug("node %d: rdma offer %d of node %d loaded (%d segments)", self.node_id, offer.seq, peer,
                  len(offer.segments))
        return None

    # ------------------------------------------------------------------ sending
    def wants(self, nbytes: int) -> bool:
        return self.send_pool is not None and nbytes >= self.inline_max

    def takes(self, buffers: list[Any], sizes: list[int]) -> list[int]:
        if self.send_pool is None:
            return []
        return [i for i, n in enumerate(sizes) if n >= self.inline_max and on_cpu(buffers[i])]

    def ready(self, peers: list[int], buffers: list[Any], sizes: list[int], indices: list[int],
              deadline: float) -> list[int]:
        """The ``peers`` that loaded our offer; offers it first (the first send waits for the
        verdict). A peer that refused it falls back to its socket, with the reason."""
        if self.send_pool is None:
            return []
        out = []
        for peer in peers:
            with self._cond:
                verdict = self._verdicts.get(peer, "?")
            if verdict is None:
                out.append(peer)
                continue
            if verdict == "?" and self._ask(peer, deadline):
                out.append(peer)
        return out

    def _ask(self, peer: int, deadline: float) -> bool:
        with self._lock_of(peer):
            if peer not in self._offered:
                self._offer(peer, deadline)
        until = min(deadline, time.monotonic() + VERDICT_WAIT_S)
        try:
            self.waits.until(lambda: peer in self._verdicts, until, on=(self,), peers=(peer,))
        except PeerLost:
            return False
        except Timeout:  # this frame goes inline; the next send offers again
            with self._cond:
                return self._unanswered_offer(peer)
        with self._cond:
            verdict = self._verdicts.get(peer)
            if peer not in self._verdicts:  # forgotten meanwhile (the peer left)
                return False
        if verdict is not None:
            p = self._peers.get(peer)
            if p is not None:
                peer_route.degrade_cpu(p, f"node {peer} could not load this node's rdma offer: {verdict}",
                                       self._required)
                log.warning("node %d: rdma to node %d failed (%s): tcp instead", self.node_id, peer, verdict)
        return verdict is None

    def _unanswered_offer(self, peer: int) -> bool:
        """No verdict came in time (called with ``_cond`` held): offer again on the next send,
        or after :data:`MAX_UNANSWERED` tries, give up on the path for this peer, saying why."""
        self.stats["verdict_timeouts"] += 1
        tries = self._timeouts[peer] = self._timeouts.get(peer, 0) + 1
        self._offered.pop(peer, None)
        if tries >= MAX_UNANSWERED:
            self._verdicts[peer] = f"no answer to {tries} offers of {VERDICT_WAIT_S:g}s each"
            p = self._peers.get(peer)
            if p is not None:
                peer_route.degrade_cpu(p, f"node {peer} never answered this node's rdma offer "
                                          f"({tries} tries)", self._required)
            log.warning("node %d: node %d never answered our rdma offer: tcp instead", self.node_id, peer)
        return False

    def _lock_of(self, peer: int) -> threading.Lock:
        with self._cond:
            return self._peer_locks.setdefault(peer, threading.Lock())

    def place(self, peers: list[int], buffers: list[Any], indices: list[int], deadline: float,
              descs: dict[int, list[Any]] | None = None) -> dict[int, list[Any]]:
        pool = self.send_pool
        if pool is None:
            raise ConfigError(f"node {self.node_id} has no rdma path: {self.unavailable}")
        descs = {} if descs is None else descs
        for i in indices:
            addr, nbytes = address_of(buffers[i])

            def claim(seg: _Segment) -> None:
                seg.gen += 1
                pool.slots.hold(seg, peers)

            seg = pool.take(nbytes, max(0.0, deadline - time.monotonic()), claim, peers)
            _copy_in_pieces(seg.memory[:nbytes], as_uint8(buffers[i]))  # outside the lock
            descs[i] = [TAG, seg.slot_id, seg.gen, 0, nbytes]
            self.stats["placed"] += 1
            self.stats["copied_bytes"] += nbytes
        for peer in peers:  # a segment made for these buffers is offered before the frame goes
            if self._offered.get(peer, -1) < pool.version:
                with self._lock_of(peer):
                    if self._offered.get(peer, -1) < pool.version:
                        self._offer(peer, deadline)
        return descs

    def unhold(self, descs: dict[int, list[Any]], peers: list[int]) -> None:
        if self.send_pool is None:
            return
        for _tag, seg_id, gen, _off, _n in descs.values():
            for peer in peers:
                self.send_pool.slots.release(peer, seg_id, 1, gen)

    # ------------------------------------------------------------------ receiving
    def pull(self, reader: RdmaReader, remote_addr: int, nbytes: int, seg_id: int, gen: int) -> memoryview:
        """Read ``nbytes`` at ``remote_addr`` of ``reader``'s peer into a landing slot."""
        landing, engine = self.landing, self.engine
        if landing is None or engine is None:
            raise ProtocolError("an rdma descriptor reached a node without an rdma path")
        seg = None
        try:
            # a new landing segment may be made and registered first: with the read, it takes a
            # while under load, and frames wait unread meanwhile
            with self.reader_busy():
                seg = landing.take(nbytes, 0.0, _pin)  # never waits: past its bound it grows
                self._transfer(reader, remote_addr, seg.base, nbytes)
        except BaseException:
            self.stats["pull_failures"] += 1
            if seg is not None:
                landing.slots.unpin(seg)
            raise
        finally:
            # the sender's slot is free once we are done with it, pulled or not
            self._releases.put(reader.peer, (TAG, seg_id), gen)
        self.stats["pulls"] += 1
        self.stats["pulled_bytes"] += nbytes
        return view_until_garbage(seg.base, nbytes, lambda: landing.slots.unpin(seg))

    def _transfer(self, reader: RdmaReader, remote_addr: int, local_addr: int, nbytes: int) -> None:
        engine = self.engine
        start_by = time.monotonic() + START_RETRY_S
        while True:
            try:
                handle = engine.read(reader.agent, remote_addr, local_addr, nbytes)
                break
            except Exception as exc:
                gone = self._gone(reader)
                if gone is not None:  # its memory was forgotten here when it was lost: say that
                    raise gone from None
                # NIXL may not find memory it has just been told of yet (seen once in a few
                # dozen runs: NIXL_ERR_NOT_FOUND right after the offer loaded): try again briefly
                if "NOT_FOUND" not in str(exc) or time.monotonic() > start_by:
                    raise self._failed(reader, f"could not start a pull: {exc}") from None
                self.stats["start_retries"] += 1
                _waits.sleep(0.005)
        deadline = time.monotonic() + PULL_STALL_S + nbytes / _SLOWEST_BPS
        pause = 0.0
        try:
            while True:
                state = engine.state(handle)
                if state == "DONE":
                    return
                if state == "ERR":
                    raise self._failed(reader, "the transfer failed (its process or host is gone)")
                gone = self._gone(reader)
                if gone is not None:
                    raise gone
                if time.monotonic() > deadline:
                    raise self._failed(reader, f"a pull of {nbytes} bytes made no progress in "
                                               f"{PULL_STALL_S + nbytes / _SLOWEST_BPS:.0f}s")
                if pause:
                    _waits.sleep(pause)  # (NIXL's state is polled: nothing wakes this thread)
                pause = min(2e-4, pause * 2 or 2e-5)  # a pull of 1 MB takes ~1 ms over tcp
        finally:
            engine.release(handle)

    def _gone(self, reader: RdmaReader) -> PeerLeft | None:
        """PeerLeft, saying why, when ``reader``'s peer is lost or left; else None."""
        p = self._peers.get(reader.peer)
        if p is None or p.lost or reader.closed:
            return PeerLeft(f"node {reader.peer} {p.lost if p is not None and p.lost else 'left'} "
                            "during an rdma pull")
        return None

    def _failed(self, reader: RdmaReader, why: str) -> PeerLeft:
        """A pull from ``reader``'s peer failed: the peer is lost now (its link may not know
        yet), so every send and call to it fails at once instead of waiting."""
        text = f"rdma pull from node {reader.peer} failed: {why}"
        self._peers.lose(reader.peer, text)
        return PeerLeft(text)

    def drop_reader(self, reader: RdmaReader) -> None:
        if self.engine is not None:
            self.engine.remove_peer(reader.agent)

    # ------------------------------------------------------------------ releasing
    def on_release(self, peer: int, item: list[Any]) -> None:
        if len(item) == 4 and self.send_pool is not None:
            _tag, seg_id, gen, count = item
            self.send_pool.slots.release(peer, seg_id, count, gen)

    def forget(self, peer: Any) -> None:
        if self.send_pool is not None:
            self.send_pool.slots.peer_gone(peer.node_id)
        with self._cond:
            self._offered.pop(peer.node_id, None)
            self._unanswered.pop(peer.node_id, None)
            self._timeouts.pop(peer.node_id, None)
            self._verdicts.pop(peer.node_id, None)
            self._peer_locks.pop(peer.node_id, None)
        self.waits.wake(self)
        reader = peer.readers.get(TAG)
        if reader is not None:
            reader.close()

    def counters(self) -> dict[str, Any]:
        if self.send_pool is None or self.landing is None:
            return {}
        readers = [r for r in (p.readers.get(TAG) for p in self._peers.list()) if r is not None]
        out = dict(self.stats, descriptors_refused=sum(r.refused for r in readers),
                   send_pool=dict(self.send_pool.stats), landing_pool=dict(self.landing.stats),
                   transport=self.engine.transport, mode=self.mode, device=self.engine.device)
        return out

    def close(self) -> None:
        for p in self._peers.list():
            reader = p.readers.get(TAG)
            if reader is not None:
                reader.close()
        for pool in (self.send_pool, self.landing):
            if pool is not None:
                pool.close()


def _pin(seg: Any) -> None:
    seg.pinned = True


def _equal(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


def _copy_in_pieces(dst: np.ndarray, src: np.ndarray) -> None:
    for at in range(0, dst.nbytes, _PIECE):
        np.copyto(dst[at:at + _PIECE], src[at:at + _PIECE])
        _waits.sleep(0)  # let the heartbeat thread in


def _populated(nbytes: int) -> np.ndarray:
    """``nbytes`` of anonymous memory with every page faulted in by the kernel at once
    (``MAP_POPULATE``, without the GIL; NIXL runs on Linux only): a pull must not wait on page
    faults, and touching 1 GiB page by page from Python took 3 s idle (0.35 s this way), past
    the heartbeat under load. Unmapped when the last view of it is gone."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=flags), np.uint8)
