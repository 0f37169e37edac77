"""RL channels on top of :class:`mq.MQ`: latest-wins values (weights) and lossless counted
streams (transitions). Both use only the public MQ interface, so every mq type carries them.

:class:`LatestWins` (learner -> collectors)::

    weights = mq.LatestWins(q, "weights")                  # publisher
    weights.publish(state_dict)                            # -> version 0, 1, ...; never blocks
    weights.lag()                                          # {collector: versions behind}

    weights = mq.LatestWins(q, "weights", subscribe=True)  # subscriber
    v = weights.wait_newer(-1, timeout=60)                 # mq.Version(number, payload, sender)
    weights.acting(v.number)                               # reported back: policy lag

- The publisher never waits on a subscriber: each subscriber has its own sender thread holding
  only the newest version not yet sent to it, so a slow one delays only itself and skips the
  versions superseded meanwhile.
- Same host: arrays and tensors of a version are written once into one of two pool buffers
  (``q.alloc``, double buffering) and go to every shm subscriber by handle. A buffer is written
  again only when no send is using it and no receiver holds a view of it
  (``q.wait_released(buf, timeout=0)``), so a subscriber's view never changes under it; when
  both are busy the version goes as a plain message (one copy per subscriber).
- Fan-out across hosts: subscribers on another host get the version through one relay
  subscriber of that host, which republishes it to the others there through its own pool, so
  the bytes cross the network once per host (``relay=True``, the default; subscribers of one
  host must be peers of each other, as in a mesh).
- Policy lag = publisher version minus the version a subscriber acts with (``acting``): in
  :meth:`LatestWins.lag` and ``q.metrics()["policy_lag"][name]``.

:class:`Stream` (collectors -> learner)::

    out = mq.Stream(q, "transitions", to=learner)          # sending end
    out.send(batch)                                        # waits for credit (bytes), ordered
    out.close()                                            # tells the receiver how many it sent

    inp = mq.Stream(q, "transitions")                      # receiving end
    msg = inp.recv(timeout=1.0)                            # mq.Message
    inp.close(expect=collectors)                           # mq.StreamError if counts differ

- Credit-based: a sender has at most ``max_bytes`` of payload not yet consumed by the
  receiver's ``recv()``; the receiver returns credit as it consumes. So a stream never fills the
  receiver's queue for other topics, and its memory there is bounded in bytes.
- Exact: messages are numbered per sender; the receiver checks order and, at ``close``, that
  it received exactly what each sender says it sent. A sender that comes back as a new process
  (another incarnation) is reported, never merged with its predecessor's counts.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from mq.core import Message
from mq.errors import ClosedError, ConfigError, MQError, PeerLost, StreamError, Timeout

log = logging.getLogger("mq.channels")

_ALIGN = 64
_LEAF = "\x00mq.leaf"  # placeholder key of an array packed into the shared buffer
_BY_HANDLE_MIN = 64 << 10
LEFT_GRACE_S = 2.0  # a sender that left may still have its end marker in our handler queue  # smaller versions go as plain messages (as the shm inline bound)
# policy lag of every LatestWins publisher of one MQ, as one metrics gauge
_LAGS: "weakref.WeakKeyDictionary[Any, dict[str, dict[int, int]]]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Version:
    """One value of a :class:`LatestWins` channel: its ``number``, ``payload`` and ``sender``."""

    number: int
    payload: Any
    sender: int


def _check_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not name or name.startswith("_mq."):
        raise ConfigError(f"{what} name must be a non-empty str not starting with '_mq.' "
                          f"(reserved), got {name!r}")
    return name


# ---------------------------------------------------------------------- latest wins
class LatestWins:
    """A channel where only the newest value matters (weights). See the module docstring.

    Args:
        q: a listening :class:`mq.MQ`.
        name: the channel's topic.
        subscribe: receive the channel here (a collector); without it this end publishes.
        send_timeout: how long a sender thread may wait on one subscriber's link before
            giving that version up (the next one is tried; the publisher never waits).
        relay: send once per remote host through a relay subscriber there (see above).
    """

    def __init__(self, q: Any, name: str, *, subscribe: bool = False, send_timeout: float = 60.0,
                 relay: bool = True):
        self.q, self.name = q, _check_name(name, "channel")
        self._acting_topic = f"{name}._acting"
        self.send_timeout = float(send_timeout)
        self.relay = relay
        self._cond = threading.Condition()
        self.version = -1  # newest version published (publisher) or received (subscriber)
        self.stats = {"published": 0, "by_handle": 0, "plain": 0, "sent": 0, "superseded": 0,
                      "failed": 0, "received": 0, "relayed": 0}
        self._senders: dict[int, _Sender] = {}
        self._buffers: list[_Buffer] = []
        self._acting_by: dict[int, int] = {}
        self._no_relay: set[int] = set()  # peers a relay could not reach: sent to directly
        self._latest: Version | None = None
        self._last: tuple[int, Any] | None = None  # the newest version published (for late relaying)
        self._reported = -1
        self._closed = False
        # Both ends: acting reports and receipts (a relay also sends, so it takes receipts).
        q.subscribe(self._acting_topic, self._on_acting)
        if subscribe:
            q.subscribe(name, self._on_value)

    # ---- publisher
    def publish(self, payload: Any) -> int:
        """Offer ``payload`` as the next version to every subscriber; returns its number.
        Never waits on a subscriber (see the class docstring)."""
        if self._closed:
            raise ClosedError(f"LatestWins {self.name!r} was closed")
        with self._cond:
            self.version += 1
            version = self.version
            self._last = (version, payload)
        self._offer(version, payload, self._subscribers(), self.q.node_id)
        self.stats["published"] += 1
        self._update_lag()
        return version

    def _subscribers(self) -> list[int]:
        return self.q.wait_for_subscribers(self.name, 0, timeout=0)

    def _offer(self, version: int, payload: Any, subs: list[int], origin: int, relay: bool = True) -> None:
        """Hand a version to each subscriber's sender thread (one per remote host if relayed)."""
        direct, relays = self._plan(subs) if relay and self.relay else (subs, {})
        targets = direct + list(relays)
        if not targets:
            return
        message, buf = self._pack(version, payload, targets)
        message["o"] = origin  # the publisher: acting reports go there, not to a relay
        for peer in targets:
            extra = {"relay_to": relays[peer]} if peer in relays else None
            sender = self._senders.get(peer)
            if sender is None or not sender.alive:
                sender = self._senders[peer] = _Sender(self, peer)
            sender.offer(version, message, buf, extra)

    def _plan(self, subs: list[int]) -> tuple[list[int], dict[int, list[int]]]:
        """Subscribers sent to directly, and relays -> the others of their host."""
        mine = self.q.locality.boot_id
        by_host: dict[Any, list[int]] = {}
        for peer in subs:
            by_host.setdefault(self.q.host_of(peer), []).append(peer)
        direct: list[int] = []
        relays: dict[int, list[int]] = {}
        for host, peers in by_host.items():
            if host is None or host == mine or len(peers) == 1 or self._no_relay & set(peers):
                direct += peers
            else:
                relays[peers[0]] = peers[1:]
        return direct, relays

    def _pack(self, version: int, payload: Any, targets: list[int]) -> tuple[dict[str, Any], Any]:
        """The message of one version: its arrays in a shared pool buffer when a target reads
        our pool and the buffer is free, else the payload as it is."""
        routes = self.q.routes()
        if any(getattr(routes.get(p), "kind", None) == "shm" for p in targets):
            leaves: list[Any] = []
            tree = _strip(payload, leaves)
            total = _layout_bytes(leaves)
            if leaves and total >= _BY_HANDLE_MIN:
                buf = self._free_buffer(total, any(not isinstance(x, np.ndarray) for x in leaves))
                if buf is not None:
                    layout = buf.fill(leaves)
                    self.stats["by_handle"] += 1
                    return {"v": version, "tree": tree, "buf": buf.handle, "leaves": layout}, buf
        self.stats["plain"] += 1
        return {"v": version, "tree": payload}, None

    def _free_buffer(self, nbytes: int, tensors: bool) -> "_Buffer | None":
        with self._cond:
            mine = [b for b in self._buffers if (b.tensor is not None) == tensors]
            for buf in mine:
                if buf.pending == 0 and buf.nbytes >= nbytes and buf.released(self.q):
                    return buf
            if len(mine) < 2:  # double buffering: one for receivers to hold, one to write
                try:
                    buf = _Buffer(self.q, nbytes, tensors)
                except ConfigError:  # no pool here: plain messages
                    return None
                self._buffers.append(buf)
                return buf
        return None

    def _on_acting(self, msg: Message) -> None:
        p = msg.payload
        if isinstance(p, int):
            self._acting_by[msg.sender] = p
            self._update_lag()
        elif isinstance(p, dict) and isinstance(p.get("got"), int):
            sender = self._senders.get(msg.sender)
            if sender is not None:
                sender.received(p["got"])
        elif isinstance(p, dict) and isinstance(p.get("unreached"), list):
            # A relay is not linked to some peers of its host (not a mesh): send to them directly.
            missed = {x for x in p["unreached"] if isinstance(x, int)}
            self._no_relay |= missed
            latest = self._last
            if latest is not None and missed:
                self._offer(latest[0], latest[1], sorted(missed & set(self._subscribers())),
                            self.q.node_id, relay=False)

    def _update_lag(self) -> None:
        live = set(self.q.peers())
        for peer in [p for p in self._acting_by if p not in live]:
            del self._acting_by[peer]
        gauge = _LAGS.setdefault(self.q, {})
        gauge[self.name] = self.lag()
        self.q.set_metric("policy_lag", gauge)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every subscriber was sent the newest version offered to it (e.g. a final
        version, before this node stops).

        Raises:
            Timeout: some subscriber's link stayed busy for ``timeout`` seconds.
        """
        wait = self.q.timeout if timeout is None else timeout

        def done() -> bool:
            return all(s.box is None and (s.in_flight is None or s.confirmed >= s.in_flight[0])
                       for s in self._senders.values() if s.alive and s.peer in live)

        live = set(self.q.peers())
        with self._cond:
            if not self._cond.wait_for(done, wait):
                raise Timeout(f"{self.name!r}: the newest version did not reach every subscriber within "
                              f"{wait:g}s (slow or stuck subscribers: pass a longer timeout)")

    def lag(self) -> dict[int, int]:
        """Policy lag per subscriber that reported: newest version minus the one it acts with."""
        return {peer: self.version - v for peer, v in sorted(self._acting_by.items())}

    # ---- subscriber
    def _on_value(self, msg: Message) -> None:
        p = msg.payload
        if not (isinstance(p, dict) and isinstance(p.get("v"), int)):
            log.warning("node %d: %r: dropped a malformed value from node %d", self.q.node_id, self.name,
                        msg.sender)
            return
        value = _unpack(p)
        with self._cond:
            self.stats["received"] += 1
            if self._latest is not None and p["v"] <= self._latest.number:
                self.stats["superseded"] += 1
                return
            origin = p["o"] if isinstance(p.get("o"), int) else msg.sender
            self._latest = Version(p["v"], value, origin)
            self.version = p["v"]
            self._cond.notify_all()
        try:  # the receipt: the sender sends us nothing newer before it (one in flight)
            self.q.send(msg.sender, self._acting_topic, {"got": p["v"]}, timeout=1.0)
        except MQError as exc:
            log.debug("node %d: %r: receipt: %s", self.q.node_id, self.name, exc)
        relay_to = [x for x in p.get("relay_to") or () if isinstance(x, int)]
        if relay_to:  # one copy into our pool for the subscribers of this host
            peers = set(self.q.peers())
            self._offer(p["v"], value, [x for x in relay_to if x in peers], origin, relay=False)
            self.stats["relayed"] += 1
            unreached = [x for x in relay_to if x not in peers]
            if unreached:
                try:
                    self.q.send(origin, self._acting_topic, {"unreached": unreached}, timeout=1.0)
                except MQError as exc:
                    log.warning("node %d: %r: cannot relay to %s: %s", self.q.node_id, self.name, unreached, exc)

    def latest(self) -> Version | None:
        """The newest version received so far (None before the first)."""
        return self._latest

    def wait_newer(self, version: int = -1, timeout: float | None = None) -> Version:
        """The newest version once it is newer than ``version`` (-1: any).

        Raises:
            Timeout: nothing newer arrived within ``timeout`` seconds (default: the queue's).
        """
        wait = self.q.timeout if timeout is None else timeout
        with self._cond:
            if not self._cond.wait_for(lambda: self._latest is not None and self._latest.number > version,
                                       wait):
                have = "none yet" if self._latest is None else f"have {self._latest.number}"
                raise Timeout(f"no version of {self.name!r} newer than {version} within {wait:g}s "
                              f"({have}): is the publisher running and publishing?")
            return self._latest  # type: ignore[return-value]

    def acting(self, version: int) -> None:
        """Tell the publisher this node now acts with ``version`` (its policy lag). Sent only
        when it changed; a report that cannot go now is retried at the next call."""
        latest = self._latest
        if latest is None or version == self._reported:
            return
        try:
            self.q.send(latest.sender, self._acting_topic, int(version), timeout=1.0)
            self._reported = version
        except MQError as exc:
            log.debug("node %d: %r: acting report: %s", self.q.node_id, self.name, exc)

    def close(self) -> None:
        """Stop the sender threads (a publisher) and forget the latest value."""
        self._closed = True
        for sender in self._senders.values():
            sender.stop()
        self._latest = None


class _Buffer:
    """One of a publisher's two pool buffers from ``q.alloc``: a uint8 torch tensor when the
    payload holds tensors, else a numpy array (torch is never imported for numpy payloads: its
    import holds the GIL for seconds)."""

    def __init__(self, q: Any, nbytes: int, tensors: bool):
        self.tensor: Any = None
        if tensors:
            import torch

            self.tensor = self.handle = q.alloc(nbytes, torch.uint8)
            self.array = self.tensor.numpy()
        else:
            self.handle = self.array = q.alloc(nbytes, "uint8")
        self.nbytes = nbytes
        self.pending = 0  # sender threads about to send it (guarded by the channel's lock)

    def released(self, q: Any) -> bool:
        try:
            q.wait_released(self.handle, timeout=0)
            return True
        except Timeout:
            return False

    def fill(self, leaves: list[Any]) -> list[list[Any]]:
        layout, off = [], 0
        for leaf in leaves:
            n = leaf.nbytes if isinstance(leaf, np.ndarray) else leaf.numel() * leaf.element_size()
            if isinstance(leaf, np.ndarray):
                self.array[off:off + n] = np.ascontiguousarray(leaf).reshape(-1).view(np.uint8)
                layout.append(["np", leaf.dtype.str, list(leaf.shape), off, n])
            else:
                flat = leaf.detach().contiguous().reshape(-1)
                self.tensor[off:off + n].copy_(flat.view(_torch().uint8))
                layout.append(["torch", str(leaf.dtype).removeprefix("torch."), list(leaf.shape), off, n])
            off += -(-n // _ALIGN) * _ALIGN
        return layout


def _is_leaf(x: Any) -> bool:
    if isinstance(x, np.ndarray):
        return x.dtype.kind in "biufc"
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr") and x.device.type == "cpu"


def _strip(tree: Any, leaves: list[Any]) -> Any:
    """``tree`` with each CPU array/tensor replaced by a placeholder naming its index."""
    if _is_leaf(tree):
        leaves.append(tree)
        return {_LEAF: len(leaves) - 1}
    if isinstance(tree, dict):
        return {k: _strip(v, leaves) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_strip(v, leaves) for v in tree)
    return tree


def _layout_bytes(leaves: list[Any]) -> int:
    return sum(-(-_nbytes(x) // _ALIGN) * _ALIGN for x in leaves)


def _nbytes(x: Any) -> int:
    return x.nbytes if isinstance(x, np.ndarray) else x.numel() * x.element_size()


def _unpack(p: dict[str, Any]) -> Any:
    """The payload of a received value: views of the shared buffer where it came by handle."""
    if "buf" not in p:
        return p.get("tree")
    buf = p["buf"]
    views = []
    for kind, dtype, shape, off, n in p["leaves"]:
        raw = buf[off:off + n]
        if kind == "np":
            views.append((raw if isinstance(raw, np.ndarray) else raw.numpy()).view(np.dtype(dtype)).reshape(shape))
        else:
            views.append(raw.view(getattr(_torch(), dtype)).reshape(shape))
    return _fill(p["tree"], views)


def _torch() -> Any:
    import torch

    return torch


def _fill(tree: Any, views: list[Any]) -> Any:
    if isinstance(tree, dict):
        if len(tree) == 1 and _LEAF in tree:
            return views[tree[_LEAF]]
        return {k: _fill(v, views) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_fill(v, views) for v in tree)
    return tree


class _Sender(threading.Thread):
    """Sends a channel's newest version to one subscriber, one at a time: the next goes once
    the subscriber confirmed the previous (or ``send_timeout`` passed), and a newer offer
    replaces an unsent one. So a slow subscriber holds at most two versions, and skips the rest."""

    def __init__(self, channel: LatestWins, peer: int):
        super().__init__(daemon=True, name=f"mq{channel.q.node_id}-{channel.name}-to-{peer}")
        self.channel, self.peer = channel, peer
        self.box: tuple[int, dict[str, Any], _Buffer | None, dict[str, Any] | None] | None = None
        self.alive = True
        self.in_flight: tuple[int, float] | None = None  # (version, when sent) not yet confirmed
        self.confirmed = -1
        self.start()

    def received(self, version: int) -> None:
        with self.channel._cond:
            self.confirmed = max(self.confirmed, version)
            self.channel._cond.notify_all()

    def offer(self, version: int, message: dict[str, Any], buf: _Buffer | None,
              extra: dict[str, Any] | None) -> None:
        with self.channel._cond:
            if self.box is not None:
                self.channel.stats["superseded"] += 1
                if self.box[2] is not None:
                    self.box[2].pending -= 1
            if buf is not None:
                buf.pending += 1
            self.box = (version, message, buf, extra)
            self.channel._cond.notify_all()

    def stop(self) -> None:
        with self.channel._cond:
            self.alive = False
            self.channel._cond.notify_all()

    def run(self) -> None:
        ch, q = self.channel, self.channel.q
        while self.alive and q.running:
            with ch._cond:
                if self.in_flight is not None and (self.confirmed >= self.in_flight[0] or
                                                   time.monotonic() - self.in_flight[1] > ch.send_timeout):
                    self.in_flight = None  # confirmed, or no receipt: its handler is stuck or it left
                if self.box is None or self.in_flight is not None:
                    ch._cond.wait(0.5)
                    continue
                version, message, buf, extra = self.box
                self.box = None
                self.in_flight = (version, time.monotonic())
            try:
                q.send(self.peer, ch.name, {**message, **extra} if extra else message, timeout=ch.send_timeout)
                ch.stats["sent"] += 1
            except (PeerLost, ClosedError):
                self.alive = False
            except MQError as exc:  # slow or broken link: this version is given up, not the next
                self.in_flight = None
                ch.stats["failed"] += 1
                log.warning("node %d: %r: version not sent to node %d: %s", q.node_id, ch.name, self.peer, exc)
            finally:
                if buf is not None:
                    with ch._cond:
                        buf.pending -= 1


# ---------------------------------------------------------------------- lossless stream
class Stream:
    """A lossless, ordered, credit-based stream from senders to one receiver. See the module
    docstring.

    Args:
        q: a listening :class:`mq.MQ`.
        name: the stream's topic.
        to: the receiver's node id: this end sends. Without it, this end receives.
        max_bytes: (sending end) payload bytes in flight, not yet consumed by the receiver.
        timeout: default wait of ``send``/``recv``/``close`` (default: the queue's).
    """

    def __init__(self, q: Any, name: str, *, to: int | None = None, max_bytes: int = 64 << 20,
                 timeout: float | None = None):
        if type(max_bytes) is not int or max_bytes < 1:
            raise ConfigError(f"max_bytes must be an int >= 1 (bytes in flight), got {max_bytes!r}")
        self.q, self.name, self.to = q, _check_name(name, "stream"), to
        self.max_bytes = max_bytes
        self.timeout = q.timeout if timeout is None else float(timeout)
        self._credit_topic = f"{name}._credit"
        self._cond = threading.Condition()
        self._closed = False
        if to is not None:  # sending end
            self.incarnation = uuid.uuid4().hex
            self.sent = self.sent_bytes = self.consumed = 0
            self._ready = False
            q.subscribe(self._credit_topic, self._on_credit)
        else:  # receiving end
            self._items: list[tuple[int, Any, int, float]] = []
            self._head = 0
            self._from: dict[int, _Incoming] = {}
            self.restarts: list[dict[str, Any]] = []
            self._gone: dict[int, float] = {}  # sender -> when it was first seen gone
            self.problems: list[str] = []
            q.subscribe(name, self._on_data)
            self._acker = threading.Thread(target=self._ack_loop, daemon=True, name=f"mq{q.node_id}-{name}-credit")
            self._acker.start()

    # ---- sending end
    def send(self, payload: Any, *, timeout: float | None = None) -> None:
        """Send one message: waits (up to ``timeout``) until the receiver has consumed enough
        that it fits in ``max_bytes``.

        Raises:
            Timeout: no credit (the receiver does not keep up) within ``timeout`` seconds.
            PeerLost: the receiver left.
        """
        self._need(sending=True)
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        self._wait_receiver(deadline)
        n = _payload_bytes(payload)
        with self._cond:
            def fits() -> bool:
                if self.to not in self.q.peers():
                    raise PeerLost(f"stream {self.name!r}: the receiver, node {self.to}, left the job")
                out = self.sent_bytes - self.consumed
                return out == 0 or out + n <= self.max_bytes

            if not self._cond.wait_for(fits, max(0.0, deadline - time.monotonic())):
                raise Timeout(f"stream {self.name!r}: node {self.to} did not consume "
                              f"{self.sent_bytes - self.consumed} bytes in flight within {wait:g}s "
                              "(it reads slower than this node sends; raise max_bytes or timeout)")
        self.q.send(self.to, self.name, {"i": self.incarnation, "s": self.sent, "n": n, "d": payload},
                    timeout=max(0.001, deadline - time.monotonic()))
        self.sent += 1
        self.sent_bytes += n

    def _wait_receiver(self, deadline: float) -> None:
        # Until the receiver subscribed, our messages would land in its q.recv() queue.
        while not self._ready:
            if self.to in self.q.wait_for_subscribers(self.name, 0, timeout=0):
                self._ready = True
                return
            if time.monotonic() > deadline:
                raise Timeout(f"stream {self.name!r}: node {self.to} has not opened it (mq.Stream(q, "
                              f"{self.name!r}) on that node) in time")
            time.sleep(0.02)

    def _on_credit(self, msg: Message) -> None:
        p = msg.payload
        if isinstance(p, dict) and p.get("i") == self.incarnation and isinstance(p.get("consumed"), int):
            with self._cond:
                self.consumed = max(self.consumed, p["consumed"])
                self._cond.notify_all()

    # ---- receiving end
    def _on_data(self, msg: Message) -> None:
        p = msg.payload
        if not (isinstance(p, dict) and isinstance(p.get("i"), str) and isinstance(p.get("s"), int)):
            self._problem(f"node {msg.sender} sent a malformed stream message")
            return
        with self._cond:
            inc = self._from.get(msg.sender)
            if inc is None or inc.incarnation != p["i"]:
                if inc is not None:
                    self._restarted(msg.sender, inc)
                inc = self._from[msg.sender] = _Incoming(p["i"])
            if p["s"] != inc.next_seq:
                self._problem(f"node {msg.sender}: message {p['s']} arrived where {inc.next_seq} was due")
            inc.next_seq = p["s"] + 1
            if p.get("end"):
                inc.ended = p.get("count")
            else:
                inc.received += 1
                self._items.append((msg.sender, p.get("d"), int(p.get("n") or 0), msg.sent_at))
            self._cond.notify_all()

    def _restarted(self, sender: int, old: "_Incoming") -> None:
        entry = {"node": sender, "received": old.received, "sent": old.ended}
        self.restarts.append(entry)
        what = "after closing" if old.ended is not None else "without closing its stream"
        self._problem(f"node {sender} restarted as a new process {what} (the old one sent "
                      f"{old.ended if old.ended is not None else '?'}, {old.received} received): counts "
                      "are kept apart")

    def _problem(self, text: str) -> None:
        self.problems.append(text)
        log.warning("node %d: stream %r: %s", self.q.node_id, self.name, text)

    def recv(self, timeout: float | None = None) -> Message:
        """The next message of any sender, in each sender's order.

        Raises:
            Timeout: nothing within ``timeout`` seconds.
        """
        self._need(sending=False)
        wait = self.timeout if timeout is None else timeout
        with self._cond:
            if not self._cond.wait_for(lambda: self._head < len(self._items), wait):
                raise Timeout(f"stream {self.name!r}: no message within {wait:g}s")
            sender, payload, n, sent_at = self._items[self._head]
            self._items[self._head] = None  # type: ignore[call-overload]
            self._head += 1
            if self._head > 1024 and self._head * 2 > len(self._items):
                del self._items[:self._head]
                self._head = 0
            inc = self._from.get(sender)
            if inc is not None:
                inc.consumed += n
                if inc.consumed - inc.acked >= self.max_bytes // 4:
                    self._cond.notify_all()  # the acker sends credit now
        return Message(self.name, payload, sender, sent_at)

    def pending(self) -> int:
        """Messages received and not yet read."""
        return len(self._items) - self._head

    def _ack_loop(self) -> None:
        # Credit goes back from this thread, never from recv(): a slow link must not stall it.
        while not self._closed and self.q.running:
            with self._cond:
                self._cond.wait(0.01)
                due = [(s, inc.incarnation, inc.consumed) for s, inc in self._from.items()
                       if inc.consumed > inc.acked]
            for sender, incarnation, consumed in due:
                try:
                    self.q.send(sender, self._credit_topic, {"i": incarnation, "consumed": consumed}, timeout=1.0)
                    with self._cond:
                        inc = self._from.get(sender)
                        if inc is not None and inc.incarnation == incarnation:
                            inc.acked = max(inc.acked, consumed)
                except MQError as exc:
                    log.debug("node %d: stream %r: credit to node %d: %s", self.q.node_id, self.name, sender, exc)

    def open_senders(self, expect: Iterable[int] = ()) -> list[int]:
        """Senders (seen, or in ``expect``) that have not closed their end and are still in the
        job. One that left stays open for ``LEFT_GRACE_S``: its end marker may still be on its
        way through this node's handler queue."""
        now, live = time.monotonic(), set(self.q.peers())
        with self._cond:
            for s in live:
                self._gone.pop(s, None)
            out = []
            for s in sorted(set(expect) | set(self._from)):
                if self.ended(s):
                    continue
                if s not in live and now - self._gone.setdefault(s, now) > LEFT_GRACE_S:
                    continue
                out.append(s)
            return out

    def ended(self, sender: int) -> bool:
        """Whether ``sender`` closed its end (all it sent has arrived)."""
        inc = self._from.get(sender)
        return inc is not None and inc.ended is not None

    def counts(self) -> dict[int, dict[str, Any]]:
        """Per sender: ``received`` and ``sent`` (None until it closed) of its current process."""
        with self._cond:
            return {s: {"received": inc.received, "sent": inc.ended} for s, inc in sorted(self._from.items())}

    # ---- both ends
    def close(self, *, expect: Iterable[int] = (), timeout: float | None = None,
              check: bool = True) -> dict[str, Any]:
        """Sending end: tell the receiver how many messages this process sent.
        Receiving end: wait until every sender seen (and every id in ``expect``) closed or left,
        then check the counts.

        Returns:
            (receiving end) ``{"counts": ..., "restarts": [...], "problems": [...]}``.

        Raises:
            StreamError: (receiving end, ``check=True``) a count differs, a sender left without
                closing, restarted, or sent out of order; ``.report`` holds the details.
        """
        wait = self.timeout if timeout is None else timeout
        if self.to is not None:
            if not self._closed:
                self._wait_receiver(time.monotonic() + wait)
                self.q.send(self.to, self.name, {"i": self.incarnation, "s": self.sent, "end": True,
                                                 "count": self.sent}, timeout=wait)
            self._closed = True
            return {"sent": self.sent}
        deadline = time.monotonic() + wait
        want = set(expect)
        while self.open_senders(want) and time.monotonic() < deadline:
            time.sleep(0.02)
        report = self._report(want)
        self._closed = True
        if check and report["problems"]:
            raise StreamError(f"stream {self.name!r}: " + "; ".join(report["problems"]), report)
        return report

    def _report(self, want: set[int]) -> dict[str, Any]:
        problems = list(self.problems)
        counts = self.counts()
        for s in sorted(want | set(counts)):
            c = counts.get(s)
            if c is None:
                problems.append(f"node {s} never sent on this stream")
            elif c["sent"] is None:
                problems.append(f"node {s} left or did not close its end ({c['received']} received)")
            elif c["sent"] != c["received"]:
                problems.append(f"node {s} sent {c['sent']} messages, {c['received']} arrived")
        return {"counts": counts, "restarts": list(self.restarts), "problems": problems, "unread": self.pending()}

    def _need(self, *, sending: bool) -> None:
        if self._closed:
            raise ClosedError(f"stream {self.name!r} was closed")
        if sending != (self.to is not None):
            raise ConfigError(f"stream {self.name!r}: " + (
                "this is the receiving end (made without to=): use recv()" if sending else
                f"this is the sending end (to={self.to}): use send(); receive on node {self.to}"))


@dataclass
class _Incoming:
    """What the receiving end knows of one sender process."""

    incarnation: str
    next_seq: int = 0
    received: int = 0
    consumed: int = 0  # payload bytes the user read (credit to give back)
    acked: int = 0  # credit given back so far
    ended: int | None = None  # the count the sender reported at close


def _payload_bytes(tree: Any) -> int:
    """About what a payload costs in a queue: its buffers plus a little per value."""
    if isinstance(tree, dict):
        return 16 + sum(_payload_bytes(v) + len(str(k)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        return 16 + sum(_payload_bytes(v) for v in tree)
    if isinstance(tree, np.ndarray) or hasattr(tree, "element_size"):
        return 64 + _nbytes(tree)
    if isinstance(tree, (bytes, bytearray, memoryview, str)):
        return 16 + len(tree)
    return 16
