"""Liveness: heartbeats, receipts, flush and farewell.

:class:`Liveness` owns the heartbeat thread and the judgement of silence: it pings the peers
worth probing (a PING carries our receipt, the count of their frames we received): those we
traded data or calls with lately and those a wait of ours depends on (:meth:`mq.node.waits.Waits.depend`);
it declares silent ones lost in the peer table, and knows when this process itself was not
scheduled (then nobody's silence is proven). A peer that is neither costs nothing: the idle
cost of a node does not grow with the size of its mesh. ``flush`` waits for a peer's receipt;
``farewell`` tells every live peer we leave (BYE) and waits for their answers. Data flows::

    heartbeat thread -> Sender (PING) ; silence -> PeerTable.lose
    dispatch: PING -> on_ping -> PeerTable.receipt (and a PING back when asked)
              BYE  -> on_bye  -> Sender (REP_OK) -> PeerTable.lose
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from typing import Any, Callable

from mq.node.calls import Calls
from mq.wire.codec import BYE, PING, REP_OK, Envelope
from mq.errors import MQError, PeerLost
from mq.node.lifecycle import Lifecycle
from mq.node.peers import Peer, PeerTable
from mq.node.sender import Sender
from mq.node.stats import Stats
from mq.node import waits
from mq.node.waits import LIVE_OR_STOPPING, Flag

log = logging.getLogger("mq")

#: A peer lost while stop() waits for its answer to our goodbye: its answer, sent just before its
#: link closed, may still be on its way on the other link of the pair; it gets this long.
ANSWER_GRACE_S = 0.25

#: why a peer that said BYE is lost
LEFT = "stopped (it called stop())"

#: A pair quiet (no data, no calls, either way) for this many peer timeouts is not probed
#: until traffic or a wait on it resumes: an idle mesh costs nothing however large.
IDLE_AFTER_TIMEOUTS = 3.0
#: The heartbeat thread's tick while no peer is probed but a join is under way (else
#: min(heartbeat, 0.5) s) ...
JOIN_TICK_S = 2.0
#: ... and while nothing at all is under way. Traffic on an idle pair is noticed as it happens
#: (:meth:`Liveness.traffic`) and a wait on a peer wakes the thread, so an idle tick has nothing
#: to look for; each is a thread wake-up, and ticking every 2 s in every node was most of what
#: an idle 256-node job cost (issue 49).
IDLE_TICK_S = 30.0
#: Two ends of a pair may see its last traffic this far apart (their ticks): a peer's silence
#: is judged only until this long before the end of its own probing.
NOTICE_MARGIN_S = 2.0


class Liveness:
    """Liveness of node ``node_id``'s peers (see the module docstring).

    Args:
        heartbeat: seconds between pings of a peer that is probed.
        peer_timeout: a probed peer silent this long is lost.

    ``idle_after`` (:data:`IDLE_AFTER_TIMEOUTS` peer timeouts): a pair with no data or calls
    for this long is no longer probed unless a wait depends on it (see :meth:`_look_at`).
    """

    def __init__(self, node_id: int, sender: Sender, peers: PeerTable, calls: Calls, life: Lifecycle,
                 stats: Stats, *, heartbeat: float, peer_timeout: float):
        self.node_id = node_id
        self._sender = sender
        self._peers = peers
        self._calls = calls
        self._life = life
        self.heartbeat = heartbeat
        self.peer_timeout = peer_timeout
        self.idle_after = IDLE_AFTER_TIMEOUTS * peer_timeout
        self._stats = stats  # its frame counts: a tick that finds them unchanged skips the peers
        self._quiet = False  # the last look found every peer idle and owed nothing
        self._stalled_until = 0.0  # our reader was blocked on a full queue: judge no peer silent
        # When the first peer judged silent passes peer_timeout (the heartbeat wakes then, not at
        # its next tick: a peer answering our pings at once falls silent in step with our ticks,
        # and a tick's rounding put every such loss off by a whole tick).
        self._verdict_at = float("inf")
        self._busy = 0  # readers working on one frame for a while (reader_busy)
        self._busy_lock = threading.Lock()
        self._waits = peers.waits
        self._wanted = Flag(self._waits)  # wakes the heartbeat thread: receipts due, or new dependents
        self._probe_now: collections.deque[int] = collections.deque()
        self._owed: collections.deque[Peer] = collections.deque()  # peers a receipt is due to
        # Peers that said BYE and wait for our answer: (peer, the BYE's corr, frames we took from it)
        self._farewells: collections.deque[tuple[Peer, int, int]] = collections.deque()
        self._waits.depending = self._depending

    def stalled(self) -> None:
        """Our reader is blocked (a full queue): frames wait unread, so silence proves nothing."""
        self._stalled_until = time.monotonic() + self.peer_timeout

    @contextlib.contextmanager
    def reader_busy(self) -> Any:
        """A reader works on one frame for a while (an rdma pull: a landing segment made, the
        bytes read): frames wait unread meanwhile, so no silence is judged until it is done and
        the frames that waited had time to be read. The work must bound itself (a pull does)."""
        with self._busy_lock:
            self._busy += 1
        self._waits.wake_all()  # a stalled reader: every wait looks again
        try:
            yield
        finally:
            with self._busy_lock:
                self._busy -= 1
            self.stalled()

    # ------------------------------------------------------------------ frames
    def on_ping(self, env: Envelope) -> None:
        """A heartbeat: it carries the peer's receipt for our frames. One that wants an answer
        (a flush, or a wait of the peer's that depends on us) gets one now, from the heartbeat
        thread (this is the reader, which must not wait on a link), and the pair counts
        as busy: our heartbeat thread probes the peer too, so the peer hears from us on our
        own schedule, not only when our reader gets to its pings."""
        self.on_receipt(env.sender, env.payload)
        if isinstance(env.payload, dict) and env.payload.get("want") is True:
            p = self._peers.receiving(env.sender)
            if p is not None:
                # Answered from the heartbeat thread, at once: a reader that waited on a full
                # link (up to a second) left every frame behind it unread, the peer's last
                # ones too, and so judged the peer's silence that much late.
                if not p.receipt_due:
                    p.receipt_due = True
                    self.receipt_due(p)
                p.last_traffic = time.monotonic()
                if not p.probed:  # it judges our silence from now: probe it now, not at our next tick
                    self._probe(p)

    def traffic(self, p: Peer) -> None:
        """Data or a call on a pair not probed (the send and receive paths check ``p.probed``
        and ``p.asked`` inline first): probe it now, so its silence counts from its traffic,
        not from our next idle tick."""
        self._probe(p)

    def on_receipt(self, peer_id: int, payload: Any) -> None:
        self._peers.receipt(peer_id, payload.get("rx") if isinstance(payload, dict) else None)

    def receipt_due(self, p: Peer) -> None:
        """Peer ``p``'s window to us is a quarter used since our last receipt (dispatch): send
        it one now, from the heartbeat thread (an I/O thread must not wait on a link)."""
        self._owed.append(p)
        self._wanted.set()

    def _depending(self, node_id: int) -> None:
        """A wait started depending on peer ``node_id`` (under the waits' lock: no blocking).
        A peer probed and depended on at the last look needs nothing, and a burst of waits
        wakes the heartbeat thread once: a send held back by flow control, many times a
        second, must not wake it each time."""
        p = self._peers.get(node_id)
        if p is not None and not (p.probed and p.depended):
            self._probe(p)

    def _probe(self, p: Peer) -> None:
        """Have the heartbeat thread look at ``p`` now (it probes it if worth it)."""
        if not p.asked:
            p.asked = True  # (once until the heartbeat thread looks: a burst of waits wakes it once)
            self._probe_now.append(p.node_id)
            self._wanted.set()

    def on_bye(self, env: Envelope) -> None:
        """The peer leaves: take its receipt, answer with ours when it asks (it waits for that
        before closing its links: links are FIFO, so the answer confirms every frame it sent
        before), and it is lost."""
        self.on_receipt(env.sender, env.payload)
        asks = True
        if isinstance(env.payload, dict):
            self._calls.promised(env.sender, env.payload.get("serving"))
            asks = env.payload.get("answer", True) is not False
        p = self._peers.get(env.sender)
        if p is None:
            return
        p.said_goodbye = True
        if asks:  # answered from the heartbeat thread (this is the reader, which must not wait on
            # a link: a leaving peer with a full queue reads slowly), then lost
            self._farewells.append((p, env.corr, p.rx))
            self._wanted.set()
        else:
            self._peers.lose(env.sender, LEFT)

    def _answer_farewells(self) -> None:
        """Answer the peers that said BYE (our receipt: links are FIFO, so it confirms every
        frame they sent before), then lose them: losing closes the link the answer takes."""
        while self._farewells:
            p, corr, rx = self._farewells.popleft()
            try:
                self._sender.send_control(p.node_id, REP_OK, {"rx": rx}, 2.0, corr)
            except Exception as exc:
                log.debug("node %d: could not answer the farewell of node %d: %s", self.node_id, p.node_id, exc)
            self._peers.lose(p.node_id, LEFT)

    def ping(self, peer_id: int, *, want: bool, timeout: float) -> None:
        """Send ``peer_id`` our receipt; ``want``: ask for its receipt back."""
        p = self._peers.get(peer_id)
        if p is None or p.lost:
            return
        rx = p.rx
        due, p.receipt_due = p.receipt_due, False
        try:
            self._sender.send_control(peer_id, PING, {"rx": rx, "want": want}, timeout)
            p.last_sent = time.monotonic()
            p.rx_told = rx
        except MQError as exc:  # a full link: the data itself shows we are alive
            # A receipt it waits for is tried again next tick: its sender may be blocked on it.
            p.receipt_due = p.receipt_due or due
            self._quiet = False  # (tried again at the next tick)
            log.debug("node %d: heartbeat to node %d: %s", self.node_id, peer_id, exc)

    # ------------------------------------------------------------------ waits
    def flush(self, peer: int, timeout: float) -> None:
        """Block until the (joined) ``peer`` confirmed every counted frame sent to it so far."""
        p = self._peers.by_id[peer]
        target = p.tx
        deadline = time.monotonic() + timeout
        self.ping(peer, want=True, timeout=timeout)

        def done() -> bool:
            if p.acked >= target:  # (a peer that left after confirming everything: flushed)
                return True
            if p.lost:
                raise PeerLost(f"node {peer} {p.lost}; it never confirmed {target - p.acked} of the "
                               f"{target} frames sent to it")
            return False

        with self._waits.depend((peer,)):
            self._waits.until(done, deadline, on=(p,), what=lambda: f"node {peer} confirmed {p.acked} of "
                                                               f"{target} frames within {timeout:g}s")

    def farewell(self, deadline: float) -> dict[int, int]:
        """Tell every live peer we leave (BYE, with our receipt) and wait until ``deadline``
        for the answers of those that have not confirmed every frame we sent them: links are
        FIFO, so an answer means it took every frame we sent before, and closing loses nothing.
        (A peer that confirmed everything is not asked to answer: with every node of a large job
        stopping at once, waiting for N-1 answers each made stopping 256 nodes take minutes.)
        Returns ``{peer: frames it never confirmed}`` for the peers that did not answer in time
        (their frames may be lost: the caller says so)."""
        live = self._peers.live()
        answered: set[int] = set()
        with contextlib.ExitStack() as calls:
            waiting: dict[int, Any] = {}  # peer -> the future of its answer (None: our goodbye failed)
            failed_at: dict[int, float] = {}
            for peer in live:
                p = self._peers.by_id[peer]
                owes = p.tx > p.acked  # frames it has not confirmed: its answer will
                corr = self._calls.new_corr() if owes else 0
                fut = calls.enter_context(self._calls.pending(peer, corr)) if owes else None
                try:
                    bye = {"rx": p.rx, "serving": self._calls.farewell(peer), "answer": owes}
                    # a dead peer fails fast (PeerLost); a slow one gets time
                    left = max(0.0, deadline - time.monotonic())
                    self._sender.send_control(peer, BYE, bye, min(left, max(1.0, left / 2)), corr)
                    if fut is not None:
                        waiting[peer] = fut
                except Exception as exc:  # a dead (or full) peer must not delay our stop
                    log.debug("node %d: no farewell to node %d: %s", self.node_id, peer, exc)
                    if owes:  # (a peer that closed as it left: its own goodbye, with its receipt,
                        waiting[peer] = None  # may still be on the way to us: a moment, see settled)
                        failed_at[peer] = time.monotonic()

            def settled() -> bool:  # every answer in, every receipt, or its peer lost meanwhile (a
                # moment ago: an answer or goodbye sent just before its link closed may still be on the way)
                now = time.monotonic()
                return all((fut is not None and fut.done()) or (p := self._peers.by_id[peer]).acked >= p.tx
                           or (p.lost and now - p.lost_at > ANSWER_GRACE_S)
                           or (fut is None and now - failed_at[peer] > ANSWER_GRACE_S) for peer, fut in waiting.items())

            try:
                with self._waits.depend(waiting):  # a peer that froze meanwhile is judged silent
                    self._waits.until(settled, deadline, states=LIVE_OR_STOPPING,
                                      on=tuple(f if f is not None else self._peers.by_id[peer]
                                               for peer, f in waiting.items()))
            except MQError:
                pass  # out of time: the peers that did not answer are reported below
            for peer, fut in waiting.items():
                if fut is not None and fut.done() and fut.exception() is None:
                    self.on_receipt(peer, waits.result(fut, 0))
                    answered.add(peer)
        unconfirmed = {}
        for peer in live:
            p = self._peers.by_id[peer]
            if peer not in answered and p.tx > p.acked:
                unconfirmed[peer] = p.tx - p.acked
        return unconfirmed

    # ------------------------------------------------------------------ the heartbeat thread
    def run(self, housekeeping: Callable[[float], bool]) -> None:
        """The heartbeat thread: probe peers (a ping carries our receipt), declare silent
        probed peers lost (:meth:`_look_at`), and call ``housekeeping(now)`` (the join's
        expiries; True while a join is under way) every tick.

        Its tick: ``min(heartbeat, 0.5)`` while a peer is probed, :data:`JOIN_TICK_S` while a
        join is under way, else :data:`IDLE_TICK_S`. A tick of a quiet node (no frame since the last
        look, which found every peer idle) costs no look at its peers: O(1), not O(peers)."""
        busy_tick = min(self.heartbeat, 0.5)
        tick = busy_tick
        self._frames = (-1, -1)
        last = time.monotonic()
        # Also while stopping: stop()'s drain waits for peers' answers, and a peer that froze
        # meanwhile must be judged silent (and the drain end) within peer_timeout.
        while self._life.state in ("listening", "stopping"):
            due = min(last + tick, self._verdict_at)
            began = time.monotonic()
            woken = self._wanted.wait(max(0.0, due - began))
            # How late the wait came back (not our own sends, which may wait on a full link).
            overslept = time.monotonic() - max(due, began)
            if woken:
                self._wanted.clear()
                self._answer_farewells()
                self._send_due_receipts()
                if self._probe_those_asked():
                    tick = busy_tick  # a peer probed now is probed every heartbeat from now on
                if time.monotonic() < last + tick:
                    continue
            now = time.monotonic()
            # (against the tick it slept for: woken early out of a long idle tick is no stall)
            if overslept > 1.0:
                # We were not scheduled (a loaded machine, a long GIL hold): frames may be waiting
                # unread, so nobody's silence is proven. Judge again from now on.
                self._stalled_until = max(self._stalled_until, now + self.heartbeat)
            last = now
            stalled = self._busy > 0  # our reader holds frames unread: everyone hears from us
            depended, idle_since = self._waits.depended, now - self.idle_after
            frames = (self._stats.sent, self._stats.received)
            probing = False
            self._verdict_at = float("inf")  # (each look below sets it anew)
            if not (self._quiet and frames == self._frames and not stalled and not depended):
                self._quiet = True
                for p in self._peers.list():
                    if p.lost:
                        continue
                    if p.marks[0] != p.tx or p.marks[1] != p.rx:  # frames counted either way since the last look
                        p.marks, p.last_traffic = (p.tx, p.rx), now
                    elif (not p.probed and p.last_traffic <= idle_since and p.rx == p.rx_told
                          and not stalled and p.node_id not in depended and not p.receipt_due):
                        continue  # idle, and known so: the common case in a large mesh (inlined)
                    self._quiet = False
                    self._look_at(p, now, stalled)
                    probing = probing or p.probed
                    if p.receipt_due and not p.lost:  # (its last try failed; after the look, which
                        # judges first: a ping may wait on a full link)
                        self.ping(p.node_id, want=False, timeout=min(self.heartbeat, 0.5))
            self._frames = (self._stats.sent, self._stats.received)  # (our own pings included)
            # Nobody to probe: tick slowly. A wait that comes to depend on a peer wakes us
            # (_depending), and traffic is noticed at the next tick (its silence counts from then).
            try:
                joining = housekeeping(now)
            except Exception:  # a bug there must not end the heartbeat: no loss would be noticed again
                log.exception("node %d: the heartbeat's housekeeping failed (the heartbeat goes on)", self.node_id)
                joining = True
            tick = busy_tick if probing else max(busy_tick, JOIN_TICK_S if joining else IDLE_TICK_S)

    def _probe_those_asked(self) -> bool:
        """Probe the peers waits came to depend on, or traffic resumed with (now, not at the
        next tick); True if any."""
        now, stalled, probed = time.monotonic(), self._busy > 0, False
        while self._probe_now:
            p = self._peers.receiving(self._probe_now.popleft())  # (one joining: its traffic may come first)
            if p is not None:
                p.asked = False
                if p.marks[0] != p.tx or p.marks[1] != p.rx:  # (as at a tick)
                    p.marks, p.last_traffic = (p.tx, p.rx), now
                if not p.lost:
                    self._look_at(p, now, stalled)
                    probed = True
        return probed

    def _look_at(self, p: Peer, now: float, stalled: bool) -> None:
        """One heartbeat tick for peer ``p``: probe it and judge its silence, while it is worth
        it. A pair that exchanged data or calls within ``idle_after``, a peer some wait of ours
        depends on, and every peer while our reader is stalled, are probed every ``heartbeat``
        and lost after ``peer_timeout`` of silence. Any other peer is idle: it costs nothing
        (a mesh of N nodes would otherwise ping N*(N-1) times a heartbeat, doing nothing),
        and its silence proves nothing until probing resumes (then counted from then on)."""
        depended = self._waits.depends_on(p.node_id) or stalled
        if not depended and now - p.last_traffic >= self.idle_after:
            p.probed = p.depended = False
            if p.rx != p.rx_told:
                self.ping(p.node_id, want=False, timeout=min(self.heartbeat, 0.5))  # the receipt it is owed
            return
        busy = now - p.last_traffic < self.idle_after - NOTICE_MARGIN_S  # it probes us on its own
        if not p.probed or (depended and not p.depended):
            # Probing resumes, or a wait came to depend on it: its silence counts from now,
            # unless it was judged already (a busy pair: its silence so far is real; counting
            # anew put off the loss of a peer frozen mid-stream by the time a socket took to fill).
            if not (p.probed and busy):
                p.judged_from = now
            p.probed = True
            p.last_sent = 0.0
        p.depended = depended
        # Its silence counts while it must be talking: it answers our pings while we depend on
        # it; otherwise it pings only until its own idle_after since the pair's traffic, which it
        # may have noticed a little before we did: we stop judging that much early. Judged
        # before the ping below, which may wait on a full link (a cut one: up to 0.5 s a tick).
        judging = depended or busy
        silent = now - max(p.last_seen, p.judged_from)
        if judging and silent <= self.peer_timeout:
            self._verdict_at = min(self._verdict_at, now + self.peer_timeout - silent + 0.001)
        elif judging and now > self._stalled_until and not self._busy:
            self._peers.lose(p.node_id, f"went silent for {silent:.1f}s (no heartbeat: its host "
                                        "crashed or the network between us is down)")
            return
        if now - p.last_sent >= self.heartbeat:
            # Asked to answer (want), a peer does so at once, and probes us from then on: while
            # we depend on it, and until we heard from it since probing resumed.
            self.ping(p.node_id, want=depended or p.last_seen < p.judged_from, timeout=min(self.heartbeat, 0.5))

    def _send_due_receipts(self) -> None:
        while self._owed:
            p = self._owed.popleft()
            if p.receipt_due and not p.lost:
                self.ping(p.node_id, want=False, timeout=min(self.heartbeat, 0.5))
