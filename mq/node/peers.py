"""The peer table: who this node knows, on which link, and waiting for that to change.

:class:`PeerTable` owns the peers (node id -> :class:`Peer`), the link bindings (an
authenticated link -> its peer's node id), the condition every wait on peers sleeps on, a
member's refusal of our join, and the joined/lost transitions. What losing a peer means to the
other parts (fail its calls, forget its pool, close its link) they register with
:meth:`PeerTable.on_lost`; the table only records and notifies.

Writers: the join (:mod:`mq.node.join`: joined, bound, refused), dispatch (subscriptions, receipts,
a link lost, a farewell) and liveness (a silent peer). Readers: everyone, and the user's waits.
"""

from __future__ import annotations

import builtins  # list: in PeerTable, `list` is its method
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from mq.errors import ConfigError, PeerLost
from mq.node.lifecycle import Lifecycle
from mq.routing import Route
from mq.node.waits import LIVE_OR_STOPPING, Waits

log = logging.getLogger("mq")

#: Frames in flight unconfirmed to a peer that did not say its window (its queue_size default).
DEFAULT_WINDOW = 1024
#: A node's window is its queue_size, at least this: a receipt every quarter window, so a tiny
#: queue must not cost a receipt per frame, nor stop a sender from batching.
MIN_WINDOW = 64


@dataclass
class Peer:
    """What this node knows of another node."""

    node_id: int
    labels: frozenset[str] = frozenset()
    subscriptions: frozenset[str] = frozenset()
    route: Route | None = None
    info: dict[str, Any] = field(default_factory=dict)  # its HELLO (addresses, locality, ...)
    lost: str | None = None  # why the peer is gone (None while it is alive)
    lost_at: float = 0.0  # when (time.monotonic()) it was found gone
    route_error: str | None = None  # its route is not one require_route= allows: sends raise this
    # Its memory opened here, per data path (by descriptor tag; mq.datapaths.base): we receive by
    # descriptor only into these (shm: mq.datapaths.shm.pool.PoolReader under None; nvlink:
    # mq.datapaths.nvlink.cuda_ipc.PeerPools).
    readers: dict[Any, Any] = field(default_factory=dict)
    cpu_path: Any = None  # the data path its large CPU buffers take (it opened our pool), None: inline
    max_frame_bytes: int | None = None  # the largest frame it accepts (from its HELLO)
    tx: int = 0  # counted frames sent to it
    rx: int = 0  # counted frames received from it
    acked: int = 0  # how many of ours it confirmed (receipts)
    # Flow control: at most ``window`` of our counted frames in flight to it unconfirmed (its
    # receive queue's size, from its HELLO); sends past that wait for its receipts, which it
    # sends every quarter window (``rx_told``: the last receipt we sent it).
    window: int = DEFAULT_WINDOW
    rx_told: int = 0
    receipt_due: bool = False
    # Counts ``tx`` before the frame leaves (senders to one peer run in several threads): a
    # receipt can come back before the send that it confirms has returned.
    tx_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    said_goodbye: bool = False  # it left by stop(): our answer to its BYE must still go out
    last_seen: float = field(default_factory=time.monotonic)  # any frame from it
    last_sent: float = 0.0  # any frame to it
    # Data or calls either way (not heartbeats): a pair quiet for longer than liveness's
    # ``idle_after`` is probed no more until traffic or a wait on it resumes (mq.node.liveness). The
    # heartbeat thread notices traffic by ``tx``/``rx`` moving since its last look (``marks``);
    # the per-message path only checks ``probed`` (traffic on an idle pair: probe it now). A
    # call in one exchange (torch RPC) sets it.
    # A pair that just joined is idle: a handshake is not traffic, and probing every new pair
    # for idle_after made a forming 256-node mesh ping ~65,000 pairs a second (issue 49).
    last_traffic: float = 0.0
    marks: tuple[int, int] = (0, 0)
    probed: bool = False  # (so the probing its first traffic starts counts silence from then)
    depended: bool = False  # a wait of ours depended on it at liveness's last look
    asked: bool = False  # a new wait on it woke the heartbeat thread, which has not looked yet
    judged_from: float = 0.0  # its silence counts from here (when probing resumed)


class PeerTable:
    """The peers of node ``node_id`` (see the module docstring).

    ``by_id`` and ``links`` are plain dicts, read without the lock on the hot path (a dict read
    is atomic); they change only under ``changed`` (a lock: waits go through ``waits``).
    """

    def __init__(self, node_id: int, life: Lifecycle, own_domain: str | None, waits: Waits | None = None):
        self.node_id = node_id
        self._own_domain = own_domain
        self._life = life
        self.waits = waits = waits or Waits(lambda: life.state)
        self.by_id: dict[int, Peer] = {}
        self.get = self.by_id.get
        waits.lookup = self.get  # a wait's peers are looked up here
        self.links: dict[Any, int] = {}  # authenticated link -> its peer's node id
        # Peers whose link is bound but whose join is not recorded yet: our LINK is out, so the
        # peer may send at once, and its first frames can beat joined() (a reader or recv()
        # thread takes them meanwhile). They count on the joining peer; sends to it wait.
        self.joining: dict[int, Peer] = {}
        self.changed = threading.RLock()
        self.refusal: ConfigError | None = None  # a member refused our join, and said why
        self._lost_hooks: list[Callable[[Peer, str], None]] = []

    # ------------------------------------------------------------------ reading
    def list(self) -> list[Peer]:
        with self.changed:
            return list(self.by_id.values())

    def live(self) -> builtins.list[int]:
        return [p.node_id for p in self.list() if not p.lost]

    def ids(self, label: str | None = None) -> builtins.list[int]:
        """Node ids of live peers, optionally only those with ``label``."""
        return sorted(p.node_id for p in self.list() if not p.lost and (label is None or label in p.labels))

    def subscribers(self, topic: str) -> builtins.list[int]:
        return sorted(p.node_id for p in self.list() if topic in p.subscriptions and not p.lost)

    def routes(self) -> dict[int, Route]:
        return {p.node_id: p.route for p in self.list() if not p.lost and p.route}

    def host_of(self, peer: int) -> str | None:
        """The shared-memory domain ``peer`` runs in (see :meth:`mq.MQ.host_of`)."""
        if peer == self.node_id:
            return self._own_domain
        p = self.by_id.get(peer)
        return domain(p.info.get("locality") if p is not None else None)

    # ------------------------------------------------------------------ transitions
    def receiving(self, peer_id: int) -> Peer | None:
        """The peer whose frames arrive as ``peer_id``'s: one joining now, else the member."""
        return self.joining.get(peer_id) or self.by_id.get(peer_id)

    def bind(self, link: Any, peer_id: int, joining: Peer | None = None) -> None:
        """``link`` proved it is ``peer_id``'s: its frames count from now on, on ``joining``
        until :meth:`joined` records it (or :meth:`abandon` drops it)."""
        with self.changed:
            self.links[link] = peer_id
            if joining is not None and self.by_id.get(peer_id) is not joining:
                self.joining[peer_id] = joining

    def abandon(self, peer: Peer) -> None:
        """``peer``'s join failed after its link was bound: sends waiting for it go on."""
        with self.changed:
            if self.joining.get(peer.node_id) is peer:
                del self.joining[peer.node_id]
        self.waits.wake(self)

    def joined(self, peer: Peer) -> Peer | None:
        """``peer`` is a member now; returns the earlier process of its id it replaces, if any."""
        with self.changed:
            old = self.by_id.get(peer.node_id)
            replaced = old is not None and old.lost is None and \
                old.info.get("incarnation") != peer.info.get("incarnation")
            if replaced:
                log.warning("node %d: node %d rejoined as a new process", self.node_id, peer.node_id)
            self.by_id[peer.node_id] = peer
            if self.joining.get(peer.node_id) is peer:
                del self.joining[peer.node_id]
        self.waits.wake(self)
        log.debug("node %d: peer %d joined via %s", self.node_id, peer.node_id, peer.route)
        return old if replaced else None

    def on_lost(self, hook: Callable[[Peer, str], None]) -> None:
        """Call ``hook(peer, why)`` whenever a peer is lost (on the thread that noticed)."""
        self._lost_hooks.append(hook)

    def lose(self, node_id: int, why: str) -> None:
        """The peer died, left or went silent: senders and waiters learn it now."""
        with self.changed:
            peer = self.by_id.get(node_id)
            if peer is None or peer.lost:
                return
            unacked = peer.tx - peer.acked
            if unacked > 0:  # never counted as delivered: the sender learns it here
                why = f"{why}; {unacked} frame(s) sent to it were never acknowledged"
            peer.lost = why
            peer.lost_at = time.monotonic()
        self.waits.wake_all()
        log.info("node %d: peer %d lost: %s", self.node_id, node_id, why)
        for hook in self._lost_hooks:
            hook(peer, why)

    def wake(self) -> None:
        """Wake every wait (the node stopped: they raise ClosedError)."""
        self.waits.wake_all()

    def refused(self, error: ConfigError) -> None:
        """A member refused our join: the next wait raises ``error``."""
        self.refusal = error
        self.waits.wake(self)

    def set_subscriptions(self, peer_id: int, topics: Any) -> None:
        with self.changed:
            peer = self.receiving(peer_id)
            if peer is not None:
                peer.subscriptions = frozenset(t for t in topics if isinstance(t, str))
        self.waits.wake(self)

    def receipt(self, peer_id: int, rx: Any) -> None:
        """``peer_id`` confirmed it received ``rx`` of our counted frames. More than we count
        as sent (a frame whose send failed after it left) confirms all of them."""
        with self.changed:
            peer = self.by_id.get(peer_id)
            if peer is None or type(rx) is not int or peer.acked >= rx:
                return
            peer.acked = min(rx, peer.tx)
        self.waits.wake(peer)
        self.waits.wake(self)  # (a fan-out waits on several peers' receipts: on the table)

    # ------------------------------------------------------------------ waiting
    def wait(self, ready: Callable[[], bool], timeout: float, what: Callable[[], str]) -> None:
        """Until ``ready()`` (looked at whenever the table changes), or Timeout saying ``what()``.
        Raises a member's refusal of our join, and ClosedError once the node stops."""
        def refused_or_ready() -> bool:
            if self.refusal is not None:
                raise self.refusal
            return ready()

        self.waits.until(refused_or_ready, time.monotonic() + timeout, on=(self,), what=what)

    def wait_in_flight(self, peer: Peer, deadline: float) -> None:
        """Until fewer than ``peer.window`` of our counted frames are in flight to ``peer``
        unconfirmed (flow control: its receipts open the window again). Raises PeerLost when
        it is gone, Timeout at ``deadline`` (nothing was sent)."""
        self.waits.until(lambda: peer.tx - peer.acked < peer.window, deadline, on=(peer,), peers=(peer,),
                         states=LIVE_OR_STOPPING,
                         what=lambda: f"node {peer.node_id} did not confirm the last {peer.tx - peer.acked} "
                         "messages sent to it in time: it reads slowly (its receive queue, "
                         f"{peer.window} messages, is full) or is stuck; pass timeout= to wait longer")

    def wait_peer(self, peer: int, timeout: float, unanswered: Callable[[], str]) -> None:
        """Until ``peer`` joined; PeerLost when it is gone, ConfigError for a bad id."""
        if not isinstance(peer, int) or isinstance(peer, bool):
            raise ConfigError(f"peer must be a node id (int), got {peer!r}")
        if peer == self.node_id:
            raise ConfigError(f"node {peer} is this node; send to another node id")
        self._life.check("send")
        p = self.by_id.get(peer)
        if p is not None and p.lost is None:
            return
        if p is not None and p.lost:
            raise PeerLost(f"node {peer} {p.lost}")
        self.wait(lambda: peer in self.by_id, timeout,
                  lambda: f"node {peer} has not joined within {timeout:g}s; peers: {self.ids()}{unanswered()}")


def domain(loc: Any) -> str | None:
    """The shared-memory domain of a wire-form locality: boot id, IPC and network namespaces."""
    if not isinstance(loc, dict) or not loc.get("boot_id"):
        return None
    return f"{loc['boot_id']}/{loc.get('ipc_ns')}/{loc.get('net_ns')}"
