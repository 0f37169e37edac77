"""Latest-wins channels (weights) on top of :class:`mq.MQ`, using only its public interface, so
every mq type carries them.

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

Lossless streams for transitions are in :mod:`mq.stream`.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from mq.node.message import Message
from mq.errors import ClosedError, ConfigError, MQError, PeerLost, Timeout

log = logging.getLogger("mq.channels")

_ALIGN = 64
_LEAF = "\x00mq.leaf"  # placeholder key of an array packed into the shared buffer
_BY_HANDLE_MIN = 64 << 10  # smaller versions go as plain messages (as the shm inline bound)
# policy lag of every LatestWins publisher of one MQ, as one metrics gauge
_LAGS: "weakref.WeakKeyDictionary[Any, dict[str, dict[int, int]]]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Version:
    """One value of a :class:`LatestWins` channel: its ``number``, ``payload`` and ``sender``."""

    number: int
    payload: Any
    sender: int


def check_name(name: Any, what: str) -> str:
    """``name`` as a channel or stream topic; ConfigError if empty or reserved."""
    if not isinstance(name, str) or not name or name.startswith("_mq."):
        raise ConfigError(f"{what} name must be a non-empty str not starting with '_mq.' "
                          f"(reserved), got {name!r}")
    return name


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
        self.q, self.name = q, check_name(name, "channel")
        self._acting_topic = f"{name}._acting"
        self.send_timeout = float(send_timeout)
        self.relay = relay
        self._cond = threading.RLock()  # its state; waits go through the node's (q.waits, on self)
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
        Never waits on a subscriber (see the class docstring). Its arrays and tensors are copied
        once (into a pool buffer, or a private copy), so the caller may change them right after."""
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
        mine = self.q.host_of(self.q.node_id)
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
        # Sender threads send it later: a private copy, so the caller may change its arrays now.
        return {"v": version, "tree": _snapshot(payload)}, None

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

        def done() -> bool:  # (a subscriber lost meanwhile no longer counts)
            live = set(self.q.peers())
            with self._cond:
                return all(s.box is None and (s.in_flight is None or s.confirmed >= s.in_flight[0])
                           for s in self._senders.values() if s.alive and s.peer in live)

        self.q.waits.until(done, time.monotonic() + wait, on=(self,),
                           what=f"{self.name!r}: the newest version did not reach every subscriber within "
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
        try:  # the receipt: the sender sends us nothing newer before it (one in flight)
            self.q.send(msg.sender, self._acting_topic, {"got": p["v"]}, timeout=1.0)
        except MQError as exc:
            log.debug("node %d: %r: receipt: %s", self.q.node_id, self.name, exc)
        value = _unpack(p)
        with self._cond:
            self.stats["received"] += 1
            if self._latest is not None and p["v"] <= self._latest.number:
                self.stats["superseded"] += 1
                return
            origin = p["o"] if isinstance(p.get("o"), int) else msg.sender
            self._latest = Version(p["v"], value, origin)
            self.version = p["v"]
        self.q.waits.wake(self)
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

        def newer() -> Version | None:
            latest = self._latest
            return latest if latest is not None and latest.number > version else None

        def late() -> str:
            have = "none yet" if self._latest is None else f"have {self._latest.number}"
            return (f"no version of {self.name!r} newer than {version} within {wait:g}s "
                    f"({have}): is the publisher running and publishing?")

        return self.q.waits.until(newer, time.monotonic() + wait, on=(self,), what=late)

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
            n = nbytes_of(leaf)
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


def _snapshot(tree: Any) -> Any:
    """``tree`` with every array and tensor (any device) copied."""
    if isinstance(tree, np.ndarray):
        return tree.copy()
    if type(tree).__module__.startswith("torch") and hasattr(tree, "clone"):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _snapshot(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_snapshot(v) for v in tree)
    return tree


def _layout_bytes(leaves: list[Any]) -> int:
    return sum(-(-nbytes_of(x) // _ALIGN) * _ALIGN for x in leaves)


def nbytes_of(x: Any) -> int:
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
        self.channel.q.waits.wake(self.channel)

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
        self.channel.q.waits.wake(self.channel)

    def stop(self) -> None:
        with self.channel._cond:
            self.alive = False
        self.channel.q.waits.wake(self.channel)

    def _due(self) -> bool:
        """Work to do: stop, or a version to send while none is in flight unconfirmed."""
        return not self.alive or (self.box is not None and (self.in_flight is None
                                                            or self.confirmed >= self.in_flight[0]))

    def run(self) -> None:
        ch, q = self.channel, self.channel.q
        while self.alive and q.running:
            with ch._cond:
                if self.in_flight is not None and (self.confirmed >= self.in_flight[0] or
                                                   time.monotonic() - self.in_flight[1] > ch.send_timeout):
                    self.in_flight = None  # confirmed, or no receipt: its handler is stuck or it left
                idle = self.box is None or self.in_flight is not None
            if idle:
                q.waits.pause(self._due, 0.5, on=(ch,))
                continue
            with ch._cond:
                assert self.box is not None  # not idle, and only this thread empties the box
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
