"""Joining: greetings, the signed handshake (HELLO, HELLO_ACK, LINK) and the route per peer.

:class:`Join` owns the greetings this node sent (token -> nonce, target), the joins in progress
(HELLO answered, LINK not yet), refusals it told duplicates, and the thread that answers HELLOs
when the transport's ``connect`` may block. A node becomes a peer (:meth:`mq.node.peers.PeerTable.joined`)
only once its proof checked out (:mod:`mq.auth`); from then on its link is bound to it.

    HELLO (node id, labels, subscriptions, addresses, locality, pool, nonce)
        -> HELLO_ACK (our nonce, our proof; or why it is refused)
        -> LINK (the initiator's proof; later: its verdict on our pool)

Data flows: dispatch -> Join.handle -> (PeerTable, Sender, transport.connect/greet). The route
to each peer is chosen by :func:`mq.node.peer_route.choose` here, with a probe of its pool.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from typing import Any, Callable

from mq import auth as _auth
from mq.wire import handshake as _handshake
from mq.node import peer_route
from mq.wire.codec import HELLO, HELLO_ACK, LINK, Envelope
from mq.errors import ConfigError, MQError, ProtocolError
from mq.node.lifecycle import Lifecycle
from mq.locality import Locality
from mq.node.peers import DEFAULT_WINDOW, Peer, PeerTable
from mq.node.sender import Sender
from mq.node.stats import Refusals
from mq.transport import Transport
from mq.node.waits import PAUSE_RECHECK_S, Mailbox

log = logging.getLogger("mq")

# A greeting nobody answered is sent again after this long. The earlier ones stay valid until
# the join's timeout: on a loaded machine an answer may come after the next greeting went out,
# and refusing it (then closing the link it came on) made joins fail for good (issue 45).
REGREET_S = 3.0
# ... and each later time twice as long after the last, up to this (plus up to a quarter, at
# random): when every node of a large job greets at once, answers come slower than REGREET_S,
# and greeting again at a fixed pace multiplied the work until no join finished (issue 49).
REGREET_MAX_S = 24.0
# Joins in progress (HELLO answered, LINK not yet) kept at once; the oldest go first.
MAX_PENDING = 64
# HELLOs of one joining node answered and awaiting its LINK (it greets again, backing off);
# past them its HELLOs are refused (join_flood) until one is proven or they expire.
MAX_ANSWERS = 8


def _close_readers(peer: Peer) -> None:
    """Close the pools of ``peer`` opened here (a join not taken: its memory goes)."""
    for reader in peer.readers.values():
        reader.close()


class Join:
    """The joins of node ``node_id`` (see the module docstring).

    Args:
        hello: what this node tells others of itself: ``labels`` (sorted), ``locality`` (wire
            form), ``incarnation``, ``mq_type``, ``max_frame_bytes``.
        subscriptions: the topics this node subscribes to now.
        announce: sends them to the given peers (after a join: they may have changed since
            the handshake carried them).
        secret: the job's :class:`mq.auth.Secret`, None when insecure.
        timeout: how long a join may wait for its LINK.
    """

    def __init__(self, node_id: int, hello: dict[str, Any], locality: Locality,
                 subscriptions: Callable[[], frozenset[str]], announce: Callable[[list[int]], None],
                 transport: Transport, sender: Sender,
                 peers: PeerTable, refusals: Refusals, life: Lifecycle, *, secret: Any, timeout: float,
                 required: Any = None, world_size: int | None = None):
        self.node_id = node_id
        self._hello = hello
        self._locality = locality
        self._subscriptions = subscriptions
        self._announce = announce
        self._transport = transport
        self._sender = sender
        self._peers = peers
        self._refusals = refusals
        self._life = life
        self._secret = secret
        self._timeout = timeout
        self._required = required  # require_route=, normalised (mq.node.node_options.required_routes)
        # Joins in progress at once: bounded (a flood of HELLOs proves nothing), but never below
        # what the job itself brings: all its nodes greet a new member at once. With a bound
        # under that, a 256-node mesh never formed: each node dropped the joins it was finishing.
        self._max_pending = max(MAX_PENDING, 2 * (world_size or 0))
        self.greetings: dict[str, tuple[bytes, Any, float]] = {}  # token -> (our nonce, target, when)
        self._refused_by: dict[str, str] = {}  # target -> why its answer was refused (auth, id)
        self._refusals_sent: dict[int, float] = {}  # node id -> when we last told a duplicate of it
        self._regreet_due: dict[Any, tuple[float, float]] = {}  # target -> (when, the pause after)
        # joins awaiting LINK, by (node id, incarnation): each HELLO of it answered (our nonce, the
        # peer it describes, when); its LINK proves one of them
        self._pending: dict[tuple[int, str], list[tuple[bytes, Peer, float]]] = {}
        self.lock = threading.RLock()  # greetings, pending joins, refusals told
        self._answers = Mailbox(peers.waits)  # HELLOs the joins thread answers
        self._joiner: threading.Thread | None = None  # answers HELLOs when connect may block
        self._joiner_lock = threading.Lock()

    # ------------------------------------------------------------------ greeting
    def hello_payload(self, token: str, nonce: bytes) -> dict[str, Any]:
        me = self._hello
        return {
            "node_id": self.node_id,
            "labels": me["labels"],
            "subscriptions": sorted(self._subscriptions()),
            "addresses": dict(self._transport.addresses),
            "locality": me["locality"],
            "incarnation": me["incarnation"],
            "token": token,
            "nonce": nonce,
            "mq_type": me["mq_type"],
            "max_frame_bytes": me["max_frame_bytes"],
            "window": me["window"],
            "shm": self._sender.shm.offer(),
            "rdma": self._sender.rdma.caps(),
        }

    def greet(self, target: Any, again: bool = False) -> None:
        """Send ``target`` a HELLO; ``again``: only if it has not answered meanwhile."""
        token, nonce = uuid.uuid4().hex, _auth.nonce()
        with self.lock:
            if again and target not in self._regreet_due:
                return  # (answered while expire() greeted others: a second LINK would follow)
            now = time.monotonic()
            self.greetings[token] = (nonce, target, now)
            # until it answers, expire() greets it again after REGREET_S, then backs off
            self._regreet_due.setdefault(target, (now + REGREET_S, REGREET_S / 2))
        self._transport.greet(target, self._sender.encode(HELLO, "", self.hello_payload(token, nonce)), token)

    def handle(self, env: Envelope, link: Any) -> None:
        """A handshake frame (checked against its schema: :mod:`mq.wire.handshake`)."""
        {HELLO: self._on_hello, HELLO_ACK: self._on_ack, LINK: self._on_link}[env.kind](env, link)

    # ------------------------------------------------------------------ the responder
    def _on_hello(self, env: Envelope, link: Any) -> None:
        """A node wants to join: answer with our nonce and proof; it is not a peer yet."""
        info = env.payload
        peer_id = info["node_id"]
        if peer_id == self.node_id and info["incarnation"] == self._hello["incarnation"]:
            return  # our own greeting (a node attached to itself)
        nonce = _auth.nonce()
        ack = self.hello_payload(info["token"], nonce)
        if self._secret is not None:
            ack["proof"] = self._secret.proof("ack", nonce, info["nonce"], self.node_id, peer_id,
                                              self._hello["incarnation"])
        taken = self._taken(peer_id, info)
        if taken:
            # Never touch the live node's link; tell the newcomer why instead of letting its
            # joins time out (signed like any answer: a stranger cannot forge the refusal).
            self._tell_refused(peer_id, info, dict(ack, error=taken))
            raise _handshake.Refused("duplicate_id", taken)
        peer = self._new_peer(info)
        ack["read_ok"] = self._sender.shm.tag in peer.readers
        with self.lock:
            if len(self._pending) >= self._max_pending:  # a join flood must not grow without bound
                self._drop_pending(next(iter(self._pending)), "too many joins in progress")
            entries = self._pending.setdefault((peer_id, info["incarnation"]), [])
            if len(entries) >= MAX_ANSWERS:
                # The answers already sent stay provable: it takes the first that reaches it
                # (the oldest), so pushing that out refused its LINK (issue 49's 256-node join).
                _close_readers(peer)
                raise _handshake.Refused("join_flood", f"node {peer_id} greeted again with {MAX_ANSWERS} "
                                         "answers of ours still unproven")
            entries.append((nonce, peer, time.monotonic()))
        if self._transport.connect_may_block:
            self._answer_later((peer_id, info, peer, ack))
        else:
            self._answer_hello(peer_id, info, peer, ack)

    def _answer_hello(self, peer_id: int, info: dict[str, Any], peer: Peer, ack: dict[str, Any]) -> None:
        """Open the link to a node that said HELLO and answer on it (its first frame)."""
        try:
            assert peer.route is not None  # _new_peer chose it
            self._transport.connect(peer_id, info, peer.route)
            self._sender.send_control(peer_id, HELLO_ACK, ack, min(self._timeout, 5.0))
        except (MQError, OSError) as exc:
            log.debug("node %d: could not answer the HELLO of node %d: %s", self.node_id, peer_id, exc)
            self._unanswered(peer_id, info["incarnation"], peer)

    def _unanswered(self, peer_id: int, incarnation: str, peer: Peer) -> None:
        """An answer that never went out: nothing can prove it, so it holds no place."""
        with self.lock:
            entries = self._pending.get((peer_id, incarnation), [])
            entries[:] = [e for e in entries if e[1] is not peer]
            if not entries:
                self._pending.pop((peer_id, incarnation), None)
        _close_readers(peer)

    def _answer_later(self, answer: tuple[int, dict[str, Any], Peer, dict[str, Any]]) -> None:
        """Answer a HELLO from the joins thread: the transport's connect may block (a tcp link
        to a port that drops SYNs), and a HELLO proves nothing yet, so a stranger's forged ones
        must not hold up the I/O thread. At most ``_max_pending`` wait; the oldest goes first."""
        with self._joiner_lock:
            if len(self._answers) >= self._max_pending:
                dropped = self._answers.get_nowait()
                self._unanswered(dropped[0], dropped[1]["incarnation"], dropped[2])
                self._refusals.reject("pending_overflow", f"too many joins to answer: node {dropped[0]}'s waits")
            self._answers.put(answer)
            if self._joiner is None:
                self._joiner = threading.Thread(target=self._joins_loop, daemon=True,
                                                name=f"mq{self.node_id}-joins")
                self._joiner.start()

    def _joins_loop(self) -> None:
        while self._life.listening:
            try:
                peer_id, info, peer, ack = self._answers.get(PAUSE_RECHECK_S)  # (a stop wakes it)
            except (TimeoutError, IndexError):
                continue
            with self.lock:
                waiting = (peer_id, info["incarnation"]) in self._pending
            if waiting:  # not dropped meanwhile (timed out, or pushed out by a flood)
                self._answer_hello(peer_id, info, peer, ack)

    def _drop_pending(self, key: tuple[int, str], why: str) -> None:
        """Forget a join that never completed (called with the lock held)."""
        entries = self._pending.pop(key, None)
        if not entries:
            return
        for _nonce, peer, _t in entries:
            _close_readers(peer)
        live = self._peers.get(key[0])
        if live is None or live.lost:  # nobody else uses that id's link: close it
            threading.Thread(target=self._transport.disconnect, args=(key[0],), daemon=True).start()
        self._refusals.reject("join_incomplete", f"node {key[0]} did not finish joining: {why}")

    def _taken(self, peer_id: int, info: dict[str, Any]) -> str | None:
        """Why a HELLO for ``peer_id`` must be refused: its id belongs to a live process."""
        if peer_id == self.node_id:
            where: Any = self._transport.addresses
        else:
            old = self._peers.get(peer_id)
            if old is None or old.lost or old.info.get("incarnation") == info["incarnation"]:
                return None
            where = old.info.get("addresses")
        return (f"node id {peer_id} is taken by a live process (node {self.node_id} sees it at "
                f"{where}): give every node a unique node id")

    def _tell_refused(self, peer_id: int, info: dict[str, Any], answer: dict[str, Any]) -> None:
        """Send a node whose HELLO we refuse a HELLO_ACK saying why, at most once per
        REGREET_S for each id (the HELLO is unproven: its address may be anyone's)."""
        target = self._transport.reply_target(info)
        now = time.monotonic()
        with self.lock:
            if target is None or now - self._refusals_sent.get(peer_id, -REGREET_S) < REGREET_S:
                return
            self._refusals_sent[peer_id] = now
        frame = self._sender.encode(HELLO_ACK, "", answer)

        def tell() -> None:  # a greeting may wait for its target (inproc): not on the I/O thread
            try:
                self._transport.greet(target, frame, info["token"])
            except Exception as exc:  # the address is the unproven HELLO's: any library may refuse it
                log.debug("node %d: could not tell node %d it was refused: %s", self.node_id, peer_id, exc)

        threading.Thread(target=tell, daemon=True, name=f"mq{self.node_id}-refusal").start()

    # ------------------------------------------------------------------ the initiator
    def _on_ack(self, env: Envelope, link: Any) -> None:
        """Our HELLO was answered: check the proof, then the responder is a peer."""
        info = env.payload
        peer_id = info["node_id"]
        with self.lock:
            greeting = self.greetings.get(info["token"])
        if greeting is None:
            live = self._peers.get(peer_id)
            if live is not None and not live.lost and self._peers.links.get(link) == peer_id \
                    and live.info.get("incarnation") == info["incarnation"]:
                return  # a late answer to an earlier greeting of a peer that joined meanwhile
            raise _handshake.Refused("unsolicited_ack", f"a HELLO_ACK claiming node {peer_id} answers "
                                     "no HELLO of ours")
        mine, target = greeting[0], greeting[1]
        if self._secret is not None and not self._secret.check(
                info["proof"], "ack", info["nonce"], mine, peer_id, self.node_id, info["incarnation"]):
            self._refused_by[str(target)] = (f"its answer (node {peer_id}) failed authentication: "
                                             "a different job secret?")
            raise _handshake.Refused("bad_proof", f"a HELLO_ACK claiming node {peer_id} failed "
                                     "authentication (wrong job secret, or not a member of this job)")
        if info["error"]:  # a member refused us, and said why: the next wait raises it
            refusal = ConfigError(f"node {peer_id} refused node {self.node_id}: {info['error']}")
            self._peers.refused(refusal)
            log.error("node %d: %s", self.node_id, refusal)
            raise _handshake.Refused("refused", str(refusal))
        with self.lock:  # each greeting is answered once (a replayed answer proves nothing)
            self.greetings.pop(info["token"], None)
            late = self._regreet_due.pop(target, None) is None
        old = self._peers.get(peer_id)
        same = old is not None and not old.lost and old.info.get("incarnation") == info["incarnation"]
        if late and same:
            # A proven answer to an earlier greeting of a peer that joined meanwhile, perhaps on
            # a link it opened since: that link is its. (No LINK: one per join; refusing this
            # answer would close the peer's link.)
            self._peers.bind(link, peer_id)
            return
        taken = None if same else self._taken(peer_id, info)
        if taken:
            raise _handshake.Refused("duplicate_id", taken)
        peer = old if same else self._new_peer(info)
        assert peer is not None and peer.route is not None  # same: old is that live peer; _new_peer chose a route
        self._peers.bind(link, peer_id, peer)
        try:
            if not same:
                self._transport.connect(peer_id, info, peer.route)
            link_msg: dict[str, Any] = {"node_id": self.node_id, "incarnation": self._hello["incarnation"],
                                        "read_ok": self._sender.shm.tag in peer.readers}
            if self._secret is not None:
                link_msg["proof"] = self._secret.proof("link", mine, info["nonce"], self.node_id, peer_id,
                                                       self._hello["incarnation"])
            # LINK first: the peer takes no other frame of ours before it (links are FIFO).
            self._sender.send_control(peer_id, LINK, link_msg, self._timeout)
        except BaseException:
            self._peers.abandon(peer)
            raise
        if not same:
            self._joined(peer)
        self._on_link_verdict(peer_id, info["read_ok"])

    def _on_link(self, env: Envelope, link: Any) -> None:
        """The initiator's proof: it joins as a peer (or, if it already has, a verdict update)."""
        msg = env.payload
        peer_id = env.sender
        with self.lock:
            entries = list(self._pending.get((peer_id, msg["incarnation"]), ()))
        if not entries:
            if self._peers.links.get(link) != peer_id:
                raise _handshake.Refused("unsolicited_link", f"a LINK claiming node {peer_id} answers "
                                         "no join in progress")
            self._on_link_verdict(peer_id, msg["read_ok"])  # a second handshake on a live link
            return
        # It proves one of the HELLOs we answered (it greeted again while our answer was slow).
        proven = [peer for mine, peer, _t in entries if self._secret is None or self._secret.check(
            msg["proof"], "link", peer.info["nonce"], mine, peer_id, self.node_id, msg["incarnation"])]
        if not proven:
            raise _handshake.Refused("bad_proof", f"a LINK claiming node {peer_id} failed authentication "
                                     "(wrong job secret, or not a member of this job)")
        peer = proven[0]
        for _mine, other, _t in entries:  # the answers not taken: their pools opened here go
            if other is not peer:
                _close_readers(other)
        with self.lock:
            self._pending.pop((peer_id, msg["incarnation"]), None)
        taken = self._taken(peer_id, peer.info)
        if taken:
            raise _handshake.Refused("duplicate_id", taken)
        old = self._peers.get(peer_id)
        first = old is None or old.lost or old.info.get("incarnation") != peer.info.get("incarnation")
        self._peers.bind(link, peer_id, peer if first else None)
        assert peer.route is not None  # _new_peer chose it
        try:
            self._transport.connect(peer_id, peer.info, peer.route)
        except BaseException:
            self._peers.abandon(peer)
            raise
        if first:
            self._joined(peer)
        else:  # it joined already (a greeting answered twice): keep the first, close this one's memory
            _close_readers(peer)
        self._on_link_verdict(peer_id, msg["read_ok"])

    def _joined(self, peer: Peer) -> None:
        replaced = self._peers.joined(peer)
        if replaced is not None:
            self._sender.forget(replaced)
        # The handshake carried our subscriptions as they were then; send the current set on the
        # new link so a subscribe() racing with the join is never lost.
        self._announce([peer.node_id])

    # ------------------------------------------------------------------ routes
    def _new_peer(self, info: dict[str, Any]) -> Peer:
        peer_id = info["node_id"]
        try:
            remote = Locality.from_dict(info.get("locality") or {})
        except Exception as exc:
            raise ProtocolError(f"node {peer_id} sent a malformed locality: {exc}") from None
        here = self._locality
        # pid AND its PID namespace: two "hosts" (namespaces) on one machine reuse small pids.
        same_process = remote.pid == here.pid and remote.boot_id == here.boot_id and remote.pid_ns == here.pid_ns
        reader, why_not = self._open_reader(peer_id, info, same_process)
        # (rate-limited: a stranger's HELLOs, unproven yet, reach the refusal too)
        route = peer_route.choose(
            here, remote, self._transport.routes, peer_id=peer_id, same_process=same_process,
            gpu=self._sender.gpu.enabled, opened_pool=reader is not None, why_not_shm=why_not,
            no_pool=self._sender.shm_unavailable if self._sender.pool is None else None,
            rdma=self._sender.rdma.viable(info.get("rdma")),
            on_refused=lambda why: self._refusals.log("route", f"node {self.node_id}: {why}; using tcp "
                                                               f"to node {peer_id}"))
        if route.kind != "shm" and reader is not None:
            reader.close()
            reader = None
        limit, window = info.get("max_frame_bytes"), info.get("window")
        peer = Peer(peer_id, frozenset(str(x) for x in info.get("labels") or ()),
                    frozenset(str(x) for x in info.get("subscriptions") or ()), route,
                    info=info, readers={self._sender.shm.tag: reader} if reader is not None else {},
                    cpu_path=self._sender.rdma if route.kind == "rdma" and not self._sender.rdma.unavailable else None,
                    max_frame_bytes=limit if type(limit) is int and limit > 0 else None,
                    window=window if type(window) is int and window > 0 else DEFAULT_WINDOW)
        peer_route.enforce(peer, self._required)
        return peer

    def _open_reader(self, peer_id: int, info: dict[str, Any], same_process: bool) -> tuple[Any, str | None]:
        """The peer's pool opened here (the shm path accepts its offer), or why not (None,
        None: it has none, or no use)."""
        shm = self._sender.shm
        if shm.pool is None or not self._transport.shm_ok or info.get("shm") is None or same_process:
            return None, None
        try:
            return shm.accept(peer_id, info["shm"]), None
        except ProtocolError as exc:
            return None, str(exc)

    def _on_link_verdict(self, peer_id: int, read_ok: Any) -> None:
        """The peer's verdict on our pool: descriptors go to it only if it could open it."""
        with self._peers.changed:
            peer = self._peers.get(peer_id)
            if peer is None or peer.route is None or peer.route.kind != "shm":
                return
            if read_ok is True:  # it opened our pool: its large CPU buffers take the path
                peer.cpu_path = self._sender.paths.get(peer.route.kind)
            else:  # it cannot read ours: sockets both ways
                peer_route.refused_our_pool(peer, self._transport.routes)
                peer_route.enforce(peer, self._required)
        self._peers.waits.wake(self._peers)

    # ------------------------------------------------------------------ housekeeping
    def expire(self, now: float) -> None:
        """Forget joins that never finished; greet again whoever did not answer (heartbeat tick)."""
        with self.lock:
            for key, entries in list(self._pending.items()):
                if now - entries[-1][2] > self._timeout:
                    if self._live(*key):
                        self._pending.pop(key)  # it joined through another of its greetings
                        for _nonce, peer, _t in entries:
                            _close_readers(peer)
                        continue
                    self._drop_pending(key, f"no LINK within {self._timeout:g}s")
            # Greet again whoever did not answer: it may have refused us while an earlier
            # process of our node id still looked alive to it, or started after us. Earlier
            # greetings stay valid (a slow answer still counts) until the join's timeout.
            for token, (_n, _target, t) in list(self.greetings.items()):  # one always valid:
                if now - t > max(self._timeout, 1.25 * REGREET_MAX_S):  # outlives the pause after it
                    del self.greetings[token]
            stale = [target for target, (due, _pause) in self._regreet_due.items() if now >= due]
            for target in stale:
                self._back_off(target, now)
        for target in stale:
            try:
                self.greet(target, again=True)
            except (MQError, OSError) as exc:
                log.debug("node %d: greeting %s again: %s", self.node_id, target, exc)

    def _back_off(self, target: Any, now: float) -> None:
        """Greeting ``target`` again now: the next time comes twice as long after (capped)."""
        pause = min(2 * self._regreet_due[target][1], REGREET_MAX_S)
        self._regreet_due[target] = (now + pause * random.uniform(1.0, 1.25), pause)

    def _live(self, peer_id: int, incarnation: str) -> bool:
        """Whether that process of ``peer_id`` is our peer (a join of it still open here is
        one more greeting of it answered after it joined)."""
        peer = self._peers.get(peer_id)
        return peer is not None and not peer.lost and peer.info.get("incarnation") == incarnation

    def under_way(self) -> bool:
        """Whether a join waits for something timed (an answer, a greeting to send again)."""
        return bool(self._pending or self._regreet_due)

    def pending_count(self) -> int:
        with self.lock:
            return len(self._pending)

    def unanswered(self) -> str:
        """Where each join of ours stopped, for a join that timed out: per greeted address the
        stage (connect, handshake, auth), and the nodes that began to join us but never proved
        themselves (no LINK)."""
        with self.lock:
            newest: dict[str, str] = {}
            for token, (_n, target, _when) in sorted(self.greetings.items(), key=lambda e: e[1][2]):
                if target in self._regreet_due:  # (not answered yet)
                    newest[str(target)] = token
            half = sorted(key[0] for key in self._pending if not self._live(*key))
            refused_by = dict(self._refused_by)
        stages = []
        for target, token in sorted(newest.items()):
            if target in refused_by:
                stages.append(f"{target}: stage auth ({refused_by[target]})")
            elif self._transport.greeting_connected(token) is False:
                stages.append(f"{target}: stage connect (no connection: is a node listening there? a firewall?)")
            else:
                stages.append(f"{target}: stage handshake (our HELLO got no answer: a node that is busy, "
                              "another job's, or not an mq node)")
        text = f"; {'; '.join(stages)}" if stages else ""
        if half:
            text += (f"; nodes {half} greeted us but never proved themselves (stage auth: no LINK; a "
                     "different job secret?)")
        refused = {k: v for k, v in self._refusals.stats.rejected.items()
                   if k in ("refused", "bad_proof", "duplicate_id")}
        return text + (f"; refused: {refused}" if refused else "")
