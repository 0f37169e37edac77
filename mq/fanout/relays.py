"""Fan-out across hosts: one transfer per host, not one per subscriber.

``publish`` of a large frame (inline bytes >= ``relay_min_bytes``) groups its subscribers by
shared-memory domain (:meth:`mq.MQ.host_of`). Subscribers on this node's own domain, and
those whose domain is unknown, get the frame directly (same-host ones share one shm copy). For
every other domain with subscribers, one of them (the lowest node id) is its **relay**: it gets
the frame once, over its own link, as a RELAY frame carrying a *plan*, the subscribers it must
forward to. The relay delivers the message to itself, then forwards it to its plan through its
own pool: its tcp link reads a RELAY frame straight into a slot the pool lends
(:meth:`mq.datapaths.shm.pool.Pool.lend`), so its neighbours get descriptors of that very slot (by handle, no
copy on that host; one copy into the pool when the pool had no room to lend).

Plans nest, so hosts can form a tree or a chain instead of a star (``relay_shape``):

- ``star``: the publisher sends to every relay itself (its link carries one copy per host);
- ``auto`` (default): ``chain`` where this node's links to the relays send in pieces (mq's tcp
  links, so the relays' too: cut-through), else ``tree``;
- ``tree``: a binomial tree over the relays: the publisher sends to the first relay,
  which forwards to half of the remaining hosts while the publisher serves the other half, so
  with H remote hosts the publisher's link carries about log2(H + 1) copies, and the copies
  travel over different links at the same time;
- ``chain``: the publisher sends to the first relay, each relay to the next host's (up to
  12 hosts a chain; more hosts, more chains): every link carries one copy, and as relays send
  on while the frame arrives (cut-through, below) the last host has it about one transfer
  after the first. Best where the network, not the hosts' cores, sets the pace.

Cut-through. A relay does not wait for the whole frame before sending it to other hosts: once
the frame's header is in (:meth:`Fanout.on_begun`, from the tcp link), the hops to the plan's
peers that its tcp links reach leave from a thread of their own, each piece once it arrived
(:mod:`mq.fanout.cut_through`). The relay's own delivery and its same-host neighbours wait for the
whole frame, as before; its ack waits for both.

Wire format: kind RELAY (:mod:`mq.wire.codec`), envelope as for MSG (same topic, the sender is the
node that sent this hop). Its msgpack tree is ``[meta, payload]``: the publisher builds it by
prefixing its MSG frame's tree, so the payload's out-of-band buffers are the same objects and
nothing is copied or encoded twice. ``meta`` is either

    {"o": origin node id, "id": hop id, "to": plan, "t": seconds left, "at": origin send time}
    {"ack": hop id, "failed": {node id: [cause, why]}}     (payload None)

where ``plan`` is a list of entries, each a node id (a leaf: deliver, forward nothing) or
``[relay id, plan]``. Every RELAY hop is answered by one ack from its receiver, sent once the
receiver and its whole subtree have the message in their queues (or failed).

Trust. A relayed message reaches the user as ``Message(topic, payload, sender=origin)``.
RELAY frames are taken only on authenticated links (dispatch drops anything else first), so a
relay is always a member that proved the job secret. A receiver accepts origin ``o`` from link
peer ``L`` only when ``o == L`` (the first hop), or ``o`` is a live authenticated peer of the
receiver other than itself (a later hop). So a member can make a message appear to come from
another *member*, never from an outsider, an unknown id or the receiver itself; membership is the
trust boundary, as it already is for joining (any member could join under any free id).
Signing payloads end to end would prevent even that, at the cost of hashing every byte on every
host (about as slow as the transfer itself here), so it is not done. Refusals are counted in
``stats().rejected`` (``relay_origin``, ``relay_plan``).

Ordering (per sender->receiver, as for direct sends). ``publish`` returns only after every
relayed subscriber confirmed the message is in its queue (the ack chain), so nothing the
publisher sends afterwards, by any path, can overtake it. Before relaying, the publisher also
waits until every subscriber it reaches through someone else confirmed what was sent to it
directly so far (a receipt ping, as ``flush`` does, only for peers with unconfirmed frames), so
the relayed message cannot overtake earlier direct ones either. A relay delivers to itself on
its I/O thread, in order with the other frames of the publisher's link, and forwards from one
worker thread, in arrival order; hops sent while their frame arrives go from one stream thread,
in the order the frames began. Neither overtakes the other: a relay's worker acks a frame only
once its streamed hops are done, and its upstream sends the next frame only after that ack.

Failure. A relay that dies (link lost, or silent past ``peer_timeout``) fails the publisher's
wait at once with :class:`~mq.errors.PeerLost` naming the relay and the subscribers behind it:
they may or may not have the message, and mq does not guess (a retry could deliver twice). A
subscriber lost behind a live relay is reported the same way. A subscriber the relay cannot
reach (not its peer) is skipped by the relay and sent directly by the publisher. No answer
within the publish timeout is :class:`~mq.errors.Timeout`. ``publish`` raises after trying every
subscriber, so one dead host does not stop delivery to the others.

Backpressure. A relay forwards through its pool and its neighbours' queues; when they are full
its ack waits, so the publisher waits, up to its timeout, as with direct sends. Forward jobs
queue at most ``_JOBS`` deep; beyond that the relay's I/O thread stops reading the publisher's
link.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any, Callable

import msgpack

from mq.wire.codec import MSG, RELAY, VERSION, Codec, Frame
from mq.fanout.cut_through import Arrival, ArrivingFrame
from mq.errors import ClosedError, ConfigError, MQError, PeerLost, Timeout
from mq.node.lifecycle import Lifecycle
from mq.node.peers import PeerTable
from mq.node.queues import BoundedQueue
from mq.node.sender import Sender
from mq.node.stats import Refusals
from mq.node.waits import Flag, Waits

log = logging.getLogger("mq.fanout.relays")

__all__ = ["DEFAULT_RELAY_MIN_BYTES", "RELAY_SHAPES", "Fanout", "tree_plan"]

DEFAULT_RELAY_MIN_BYTES = 1 << 20
RELAY_SHAPES = ("auto", "tree", "star", "chain")
_CHAIN_MAX = 12  # hosts in one chain (a plan nests once per host; receivers allow _MAX_DEPTH)
_JOBS = 8  # forward jobs a relay queues before it stops reading
_MAX_PLAN = 4096  # entries in one plan, all levels together
_MAX_DEPTH = 16
_ACK_TIMEOUT_S = 5.0  # sending an ack (a tiny frame)

Plan = list  # of int | [int, Plan]


def tree_plan(groups: list[list[int]], shape: str = "tree") -> Plan:
    """The plan for ``groups`` (one list of node ids per remote host; the first id of each is
    its relay, the others its neighbours).

    >>> tree_plan([[1, 2], [3, 4], [5, 6]], "star")
    [[1, [2]], [3, [4]], [5, [6]]]
    >>> tree_plan([[1, 2], [3, 4], [5, 6]], "tree")
    [[1, [2, [3, [4]]]], [5, [6]]]
    >>> tree_plan([[1, 2], [3, 4], [5, 6]], "chain")
    [[1, [2, [3, [4, [5, [6]]]]]]]
    """
    def node(group: list[int], below: Plan) -> list[Any]:
        return [group[0], list(group[1:]) + below]

    if shape == "star":
        return [node(g, []) for g in groups]
    if shape == "chain":  # each host sends on to the next, as the frame arrives (cut-through)
        chains = []
        for start in range(0, len(groups), _CHAIN_MAX):
            below: Plan = []
            for g in reversed(groups[start:start + _CHAIN_MAX]):
                below = [node(g, below)]
            chains += below
        return chains

    def build(gs: list[list[int]]) -> Plan:
        # Send first to the relay that serves the larger half, then serve the rest ourselves.
        if not gs:
            return []
        half = (len(gs) + 1) // 2
        return [node(gs[0], build(gs[1:half]))] + build(gs[half:])

    return build(groups)


def plan_ids(plan: Plan) -> list[int]:
    """Every node id a plan reaches."""
    out: list[int] = []
    for entry in plan:
        if isinstance(entry, int):
            out.append(entry)
        else:
            out.append(entry[0])
            out.extend(plan_ids(entry[1]))
    return out


def _valid_plan(plan: Any, depth: int = 0, count: list[int] | None = None) -> bool:
    count = [0] if count is None else count
    if not isinstance(plan, list) or depth > _MAX_DEPTH:
        return False
    for entry in plan:
        count[0] += 1
        if count[0] > _MAX_PLAN:
            return False
        if type(entry) is int:
            continue
        if not (isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int
                and _valid_plan(entry[1], depth + 1, count)):
            return False
    return True


def _splice(meta: dict[str, Any], tree: bytes) -> bytes:
    """The msgpack array ``[meta, payload]`` from ``payload``'s encoded tree (no re-encoding)."""
    return b"\x92" + msgpack.packb(meta, use_bin_type=True) + tree


class _Failed(dict):
    """node id -> (cause, why); cause ``skipped`` means it was never sent (safe to send again),
    ``lost`` / ``timeout`` / ``error`` that nobody knows whether it arrived."""

    def add(self, ids: list[int], cause: str, why: str) -> None:
        for i in ids:
            self.setdefault(i, (cause, why))


class Fanout:
    """The relay logic of one node (see the module docstring).

    Args:
        node_id: this node's id; ``peers``, ``sender``: its peer table and sender.
        ping: ``ping(peer, want=True, timeout=)`` asks a peer for its receipt (liveness).
        deliver: ``deliver(topic, payload, origin, sent_at, nbytes, queued_bytes)`` puts a
            message in this node's queues (:meth:`mq.node.delivery.Delivery.deliver`).
        reader_busy: entered while a full job queue holds up the I/O thread (liveness judges
            nobody silent meanwhile).
        min_bytes: frames with fewer inline bytes are never relayed; None turns relaying off.
        shape: ``auto``, ``tree``, ``star`` or ``chain`` (see the module docstring).
        keeps_tensors: the transport moves tensors itself (torch RPC): never relay.
        timeout: the longest a relay works on one message.
    """

    def __init__(self, node_id: int, peers: PeerTable, sender: Sender, codec: Codec, refusals: Refusals,
                 life: Lifecycle, *, ping: Callable[..., None],
                 deliver: Callable[[str, Any, int, float, int, int], None], reader_busy: Callable[[], Any],
                 min_bytes: int | None = DEFAULT_RELAY_MIN_BYTES, shape: str = "auto",
                 keeps_tensors: bool = False, timeout: float = 30.0,
                 streams_to: Callable[[int], bool] = lambda _peer: False):
        self.configure(min_bytes, shape)
        self.node_id = node_id
        self._peers = peers
        self._sender = sender
        self._codec = codec
        self._refusals = refusals
        self._life = life
        self._ping = ping
        self._deliver = deliver
        self._reader_busy = reader_busy
        self._waits = peers.waits
        self._keeps_tensors = keeps_tensors
        self._timeout = timeout
        self._streams_to = streams_to
        self.stats = {"relayed": 0, "forwarded": 0, "streamed": 0, "acks": 0, "fallback_direct": 0}
        self._ids = itertools.count(1)
        self._acks: dict[tuple[int, int], dict[int, tuple[str, str]] | None] = {}
        self._unreachable: set[tuple[int, int]] = set()  # (relay, node) it said it cannot reach
        self._jobs = BoundedQueue(_JOBS, waits=peers.waits)
        self._worker: threading.Thread | None = None
        # Hops sent while their frame arrives (mq.fanout.cut_through): (upstream, its hop id) -> _Stream,
        # from the frame's header until the whole frame is here; the jobs of the thread sending them.
        self._streaming: dict[tuple[int, int], _Stream] = {}
        self._stream_jobs = BoundedQueue(_JOBS, waits=peers.waits)
        self._streamer: threading.Thread | None = None
        self._lock = threading.Lock()

    def configure(self, min_bytes: int | None, shape: str) -> None:
        """Relay frames of at least ``min_bytes`` inline bytes (None: never), in ``shape``."""
        if min_bytes is not None and (type(min_bytes) is not int or min_bytes < 1):
            raise ConfigError(f"relay_min_bytes must be an int >= 1 (bytes) or None (never relay), got {min_bytes!r}")
        if shape not in RELAY_SHAPES:
            raise ConfigError(f"relay_shape must be one of {', '.join(RELAY_SHAPES)}, got {shape!r}")
        self.min_bytes = min_bytes
        self.shape = shape

    # ------------------------------------------------------------------ publisher side
    def plan(self, targets: list[int], frame: Frame) -> tuple[list[int], Plan] | None:
        """(direct targets, relay plan) for a publish, or None when relaying does not pay."""
        if self.min_bytes is None or frame.kind != MSG or frame.nbytes < self.min_bytes:
            return None
        if self._keeps_tensors:  # torch RPC moves tensors itself (and across devices)
            return None
        host_of = self._peers.host_of
        mine = host_of(self.node_id)
        by_host: dict[str, list[int]] = {}
        direct = []
        for t in targets:
            h = host_of(t)
            if h is None or h == mine:
                direct.append(t)
            else:
                by_host.setdefault(h, []).append(t)
        groups = []
        for ids in by_host.values():
            relay = ids[0]
            rest = [i for i in ids[1:] if (relay, i) not in self._unreachable]
            direct += [i for i in ids[1:] if (relay, i) in self._unreachable]
            groups.append([relay] + rest)
        # A lone subscriber gains nothing from a star; in a tree it can still carry other hosts.
        if self.shape == "star":
            direct += [g[0] for g in groups if len(g) == 1]
            groups = [g for g in groups if len(g) > 1]
        if not groups or (len(groups) == 1 and len(groups[0]) == 1):
            return None
        shape = self.shape
        if shape == "auto":  # a chain pays only where every hop is sent on while it arrives
            shape = "chain" if all(self._streams_to(g[0]) for g in groups) else "tree"
        return sorted(direct), tree_plan(groups, shape)

    def publish(self, targets: list[int], frame: Frame, deadline: float) -> bool:
        """Publish ``frame`` to ``targets`` through relays; False (nothing sent) when a plain
        send to each is the better way. Raises like ``publish`` once every target was tried."""
        planned = self.plan(targets, frame)
        if planned is None:
            return False
        direct, plan = planned
        relayed = [i for i in plan_ids(plan) if i not in {e[0] for e in plan}]
        self._confirm_direct(relayed, deadline)  # nothing sent earlier may be overtaken
        errors: list[MQError] = []
        failed = self._forward(frame.head[2], frame.head[6], frame.buffers, self.node_id,
                               frame.head[9], plan, deadline, first_hop=frame)
        self.stats["relayed"] += 1
        skipped = [i for i, (cause, _) in failed.items() if cause == "skipped"]
        for i in skipped:
            del failed[i]
        direct += skipped
        if skipped:
            self.stats["fallback_direct"] += len(skipped)
        if direct:
            try:
                self._sender.deliver_to(sorted(direct), frame, deadline)
            except MQError as exc:
                errors.append(exc)
        if failed:
            errors.append(_error_for(frame.head[2], failed))
        if errors:
            raise errors[0]
        return True

    def _confirm_direct(self, peers: list[int], deadline: float) -> None:
        """Wait until each of ``peers`` confirmed every frame we sent it directly (only those
        with unconfirmed frames get a receipt ping)."""
        table = self._peers.by_id
        wanted = {}
        for peer in peers:
            p = table.get(peer)
            if p is not None and not p.lost and p.tx > p.acked:
                wanted[peer] = p.tx
                self._ping(peer, want=True, timeout=max(0.0, deadline - time.monotonic()))
        if not wanted:
            return

        def done() -> bool:
            return all(table[i].acked >= tx or table[i].lost for i, tx in wanted.items())

        self._peers.wait(done, max(0.0, deadline - time.monotonic()),
                   lambda: f"subscribers {sorted(wanted)} did not confirm earlier messages in time")

    # ------------------------------------------------------------------ both sides
    def _forward(self, topic: str, tree: bytes, buffers: list[Any], origin: int, sent_at: float,
                 plan: Plan, deadline: float, first_hop: Frame | None = None) -> _Failed:
        """Send one hop to every entry of ``plan`` and wait for their acks. Leaves (ints) share
        one frame, so same-host leaves share one shm copy. Returns who failed and why."""
        hop, waiting, failed = self._send_hop(topic, tree, buffers, origin, sent_at, plan, deadline, first_hop)
        self._wait_acks(hop, waiting, deadline, failed)
        return failed

    def _send_hop(self, topic: str, tree: bytes, buffers: list[Any], origin: int, sent_at: float,
                  plan: Plan, deadline: float, first_hop: Frame | None = None,
                  arriving: tuple[Arrival, int] | None = None) -> tuple[int, list[tuple[int, list[int]]], _Failed]:
        """Send one hop to every entry of ``plan``: (its hop id, who must ack it and for whom,
        who failed already). ``arriving``: the buffers are still arriving (see _hop_frame)."""
        failed = _Failed()
        hop = next(self._ids)
        sends: list[tuple[list[int], Plan]] = []
        leaves = []
        for entry in plan:
            peer, below = (entry, []) if isinstance(entry, int) else (entry[0], entry[1])
            p = self._peers.get(peer)
            if peer == self.node_id or p is None or p.lost:
                why = f"node {peer} is not a live peer of relay node {self.node_id}"
                failed.add([peer], "skipped", why)
                failed.add(plan_ids(below), "skipped", f"its relay: {why}")
                continue
            if below:
                sends.append(([peer], below))
            else:
                leaves.append(peer)
        if leaves:
            sends.append((leaves, []))
        waiting: list[tuple[int, list[int]]] = []  # (peer, the ids its ack covers)
        left = max(0.0, deadline - time.monotonic())
        for peers, below in sends:
            meta = {"o": origin, "id": hop, "to": below, "t": left, "at": sent_at}
            frame = self._hop_frame(topic, meta, tree, buffers, sent_at, first_hop, arriving)
            with self._peers.changed:
                for peer in peers:
                    self._acks[(peer, hop)] = None
            try:
                self._sender.deliver_to(peers, frame, deadline)
            except MQError as exc:
                # deliver_to stops at the first failure: peers after it were not sent to, but
                # which ones is not known here, so none of them is "skipped".
                with self._peers.changed:
                    for peer in peers:
                        self._acks.pop((peer, hop), None)
                failed.add([i for peer in peers for i in [peer] + plan_ids(below)],
                           "lost" if isinstance(exc, PeerLost) else "error", str(exc))
                continue
            self.stats["forwarded"] += len(peers)
            waiting += [(peer, [peer] + plan_ids(below)) for peer in peers]
        return hop, waiting, failed

    def _hop_frame(self, topic: str, meta: dict[str, Any], tree: bytes, buffers: list[Any],
                   sent_at: float, like: Frame | None, arriving: tuple[Arrival, int] | None = None) -> Frame:
        """The frame of one hop. ``like``: the publisher's MSG frame (same buffers, same sizes);
        ``arriving``: (the incoming frame's arrival, where its body starts), ``buffers`` being
        views of that body."""
        spliced = _splice(meta, tree)
        if like is not None:
            head = [VERSION, RELAY, topic, self.node_id, like.head[4], 0, spliced, like.sizes, None, sent_at]
            return Frame(RELAY, head, like.buffers, like.sizes)
        built = Frame.build(RELAY, topic, self.node_id, self._sender.next_seq(), 0, spliced, buffers)
        if arriving is not None:
            return ArrivingFrame(RELAY, built.head[:9] + [sent_at], built.buffers, built.sizes, *arriving)
        return Frame(RELAY, built.head[:9] + [sent_at], built.buffers, built.sizes)

    def _wait_acks(self, hop: int, waiting: list[tuple[int, list[int]]], deadline: float,
                   failed: _Failed) -> None:
        pending = dict(waiting)

        def done() -> bool:
            for peer, covers in list(pending.items()):
                result = self._acks.get((peer, hop))
                p = self._peers.get(peer)
                if result is not None:
                    for i, (cause, why) in result.items():
                        failed.add([i], cause, why)
                elif p is None or p.lost:
                    why = f"relay node {peer} {p.lost if p else 'left'}"
                    failed.add(covers, "lost", why)
                else:
                    continue
                del pending[peer]
                self._acks.pop((peer, hop), None)
            return not pending

        try:
            self._peers.wait(done, max(0.0, deadline - time.monotonic()), lambda: "")
        except (Timeout, ClosedError) as exc:
            cause = "timeout" if isinstance(exc, Timeout) else "error"
            for peer, covers in pending.items():
                failed.add(covers, cause, f"node {peer} did not confirm in time" if cause == "timeout"
                           else str(exc))
        finally:
            with self._peers.changed:
                for peer in pending:
                    self._acks.pop((peer, hop), None)

    # ------------------------------------------------------------------ receiving side
    def on_frame(self, env: Any) -> None:
        """A RELAY frame from an authenticated peer (core's I/O thread): an ack for one of our
        hops, or a message to deliver here and maybe forward."""
        body = env.payload
        meta = body[0] if isinstance(body, list) and len(body) == 2 and isinstance(body[0], dict) else None
        if meta is None:
            self._refusals.reject("relay_plan", f"a malformed RELAY frame from node {env.sender}")
            return
        if "ack" in meta:
            self._on_ack(env.sender, meta)
            return
        refusal = self._refusal(env.sender, meta)
        stream = None
        if refusal is None or refusal[0] == "relay_origin":
            with self._lock:  # sent on already, from its header (on_begun)?
                stream = self._streaming.pop((env.sender, meta["id"]), None)
        deadline = self._deadline(meta)
        if refusal is not None:
            self._refusals.reject(*refusal)
            if stream is not None:  # the origin left while the frame came: end what went on
                self._queue((env.sender, meta["id"], env.topic, None, 0, 0.0, [], deadline, stream))
            elif refusal[0] == "relay_origin":
                self._send_ack(env.sender, meta["id"], _Failed())  # do not leave it waiting
            return
        origin, hop, plan = meta["o"], meta["id"], meta.get("to", [])
        if stream is not None:
            sent = {_entry_peer(e) for e in stream.plan}
            plan = [e for e in plan if _entry_peer(e) not in sent]
        sent_at: float = (meta.get("at")  # type: ignore[assignment]  # a float (mypy does not narrow a .get())
                          if isinstance(meta.get("at"), float) else env.sent_at)
        # Delivered as a MSG, with the origin as sender (not counted as a frame of its link).
        self._deliver(env.topic, body[1], origin, sent_at, env.nbytes, env.nbytes)
        if not plan and stream is None:
            self._send_ack(env.sender, hop, _Failed())
            return
        self._queue((env.sender, hop, env.topic, body[1], origin, sent_at, plan, deadline, stream))

    def on_begun(self, sender: int, header: list[Any], buffers: list[Any], body_at: int,
                 watch: Callable[[], Arrival]) -> None:
        """A RELAY hop from ``sender`` whose body still arrives (core's I/O thread, see
        :mod:`mq.fanout.cut_through`): send it on now to the peers of its plan our links can stream to
        (other hosts). Anything wrong with it is left for :meth:`on_frame` to refuse, once whole."""
        topic, tree = header[2], header[6]
        if not buffers or self._keeps_tensors or type(tree) is not bytes or type(topic) is not str:
            return
        parsed = _split_tree(tree)
        if parsed is None or "ack" in parsed[0] or self._refusal(sender, parsed[0]) is not None:
            return
        meta, payload_tree = parsed
        plan = [e for e in meta.get("to", []) if self._streamable(_entry_peer(e))]
        if not plan:
            return
        key = (sender, meta["id"])
        stream = _Stream(plan, self._waits)
        sent_at = meta.get("at") if isinstance(meta.get("at"), float) else header[9]
        arrival = watch()
        arrival.follow(self._waits, sender)  # a hop waiting for its bytes ends if the sender is lost
        job = (key, stream, arrival, body_at, topic, payload_tree, buffers, meta["o"], sent_at,
               self._deadline(meta))
        with self._lock:
            if key in self._streaming:
                return  # a hop id seen again: left to on_frame
            if not self._stream_jobs.room():
                return  # forwarded once whole, as before
            self._stream_jobs.put_now(job)
            self._streaming[key] = stream
        self._start("_streamer", self._stream_work, "stream")

    def _refusal(self, sender: int, meta: dict[str, Any]) -> tuple[str, str] | None:
        """(cause, why) a hop from ``sender`` described by ``meta`` is refused, or None."""
        origin, hop, plan = meta.get("o"), meta.get("id"), meta.get("to", [])
        if type(origin) is not int or type(hop) is not int or not _valid_plan(plan):
            return "relay_plan", f"a RELAY frame with a bad plan from node {sender}"
        if origin != sender:
            p = self._peers.get(origin)
            if origin == self.node_id or p is None or p.lost:
                return "relay_origin", (f"node {sender} relayed a message claiming node {origin}, "
                                        "which is not a live peer here")
        return None

    def _deadline(self, meta: dict[str, Any]) -> float:
        left: float = (meta.get("t")  # type: ignore[assignment]  # a number (mypy does not narrow a .get())
                       if isinstance(meta.get("t"), (int, float)) else self._timeout)
        return time.monotonic() + min(max(0.0, float(left)), self._timeout)

    def _streamable(self, peer: int) -> bool:
        p = self._peers.get(peer)
        return peer != self.node_id and p is not None and not p.lost and self._streams_to(peer)

    def _queue(self, job: tuple[Any, ...]) -> None:
        if not self._jobs.room():  # a full job queue stops this I/O thread: backpressure on the sender
            try:
                with self._reader_busy():
                    self._waits.until(self._jobs.room, None, on=(self._jobs,))
            except ClosedError:
                return
        self._jobs.put_now(job)
        self._start("_worker", self._work, "relay")

    def _on_ack(self, sender: int, meta: dict[str, Any]) -> None:
        raw = meta.get("failed")
        failed: dict[int, tuple[str, str]] = {}
        if isinstance(raw, dict):
            for k, v in raw.items():
                if type(k) is int and isinstance(v, list) and len(v) == 2:
                    failed[k] = (str(v[0]), str(v[1]))
        with self._peers.changed:
            key = (sender, meta.get("ack"))
            if key not in self._acks:
                self._refusals.stats.dropped_unexpected_reply += 1  # after its publish gave up
                return
            self._acks[key] = failed
            for i, (cause, _) in failed.items():
                if cause == "skipped":
                    self._unreachable.add((sender, i))
            self.stats["acks"] += 1
        self._waits.wake(self._peers)

    def _send_ack(self, peer: int, hop: int, failed: _Failed) -> None:
        meta = {"ack": hop, "failed": {i: list(v) for i, v in failed.items()}}
        try:
            self._sender.deliver_to([peer], self._sender.encode(RELAY, "", [meta, None]),
                                    time.monotonic() + _ACK_TIMEOUT_S)
        except MQError as exc:
            log.warning("node %d: could not confirm a relayed message to node %d: %s", self.node_id, peer, exc)

    def _start(self, attr: str, target: Callable[[], None], name: str) -> None:
        """Start the thread kept in ``attr`` unless it runs."""
        with self._lock:
            thread = getattr(self, attr)
            if thread is None or not thread.is_alive():
                thread = threading.Thread(target=target, daemon=True, name=f"mq{self.node_id}-{name}")
                setattr(self, attr, thread)
                thread.start()

    def _work(self) -> None:
        """Forward whole frames (in arrival order), wait for the acks of their hops, and of
        the hops sent while they arrived, then ack upstream."""
        while self._life.running:
            try:
                upstream, hop, topic, payload, origin, sent_at, plan, deadline, stream = self._jobs.get(0.5)
            except IndexError:
                continue
            failed = _Failed()
            try:
                if plan:
                    tree, buffers = self._codec.pack(payload)
                    del payload
                    failed = self._forward(topic, tree, buffers, origin, sent_at, plan, deadline)
                    tree = buffers = None  # type: ignore[assignment]
                if stream is not None:
                    self._join_stream(stream, deadline, failed)
            except Exception as exc:  # never leave the upstream waiting for an ack
                log.exception("node %d: relaying for node %d failed", self.node_id, origin)
                failed.add(plan_ids(plan + (stream.plan if stream else [])), "error",
                           f"relay node {self.node_id}: {type(exc).__name__}: {exc}")
            payload = None
            self._send_ack(upstream, hop, failed)

    def _stream_work(self) -> None:
        """Send hops while their frames arrive (mq.fanout.cut_through), in the order they began."""
        while self._life.running:
            try:
                key, stream, arrival, body_at, topic, tree, buffers, origin, sent_at, deadline = \
                    self._stream_jobs.get(0.5)
            except IndexError:
                continue
            try:
                stream.hop, stream.waiting, failed = self._send_hop(
                    topic, tree, buffers, origin, sent_at, stream.plan, deadline, arriving=(arrival, body_at))
                stream.failed.update(failed)
                self.stats["streamed"] += len(stream.waiting)
            except Exception as exc:
                log.exception("node %d: relaying for node %d failed", self.node_id, origin)
                stream.failed.add(plan_ids(stream.plan), "error",
                                  f"relay node {self.node_id}: {type(exc).__name__}: {exc}")
            buffers = None
            if arrival.filled < arrival.size:
                # It ended before the frame was whole (cut off, or out of time): nothing went
                # on whole, so forget it; if the frame still comes, it is forwarded as a whole.
                with self._lock:
                    self._streaming.pop(key, None)
            stream.done.set()

    def _join_stream(self, stream: "_Stream", deadline: float, failed: _Failed) -> None:
        """Wait for the hops sent while the frame arrived, and for their acks."""
        if not stream.done.wait(max(0.0, deadline - time.monotonic()) + _ACK_TIMEOUT_S):
            failed.add(plan_ids(stream.plan), "timeout",
                       f"relay node {self.node_id} did not finish forwarding in time")
            return
        for i, (cause, why) in stream.failed.items():
            failed.add([i], cause, why)
        self._wait_acks(stream.hop, stream.waiting, deadline, failed)


class _Stream:
    """The hops one relay sends while their frame arrives: the plan entries they serve, then
    (once ``done``) their hop id, who must ack it, and who failed already."""

    __slots__ = ("plan", "hop", "waiting", "failed", "done")

    def __init__(self, plan: Plan, waits: Waits):
        self.plan = plan
        self.hop = 0
        self.waiting: list[tuple[int, list[int]]] = []
        self.failed = _Failed()
        self.done = Flag(waits)


def _entry_peer(entry: Any) -> int:
    return entry if isinstance(entry, int) else entry[0]


def _split_tree(tree: bytes) -> tuple[dict[str, Any], bytes] | None:
    """A hop's tree ``[meta, payload]`` -> (meta, the payload's encoded tree), or None."""
    try:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(1, len(tree)))
        unpacker.feed(tree)
        if unpacker.read_array_header() != 2:
            return None
        meta = unpacker.unpack()
        return (meta, tree[unpacker.tell():]) if isinstance(meta, dict) else None
    except Exception:
        return None


def _error_for(topic: str, failed: dict[int, tuple[str, str]]) -> MQError:
    ids = sorted(failed)
    first = failed[ids[0]][1]
    text = (f"publish {topic!r}: subscribers {ids} did not confirm the message ({first}); "
            "they may or may not have it")
    if any(cause == "lost" for cause, _ in failed.values()):
        return PeerLost(text)
    if all(cause == "timeout" for cause, _ in failed.values()):
        return Timeout(text + "; pass timeout= to wait longer")
    return MQError(text)
