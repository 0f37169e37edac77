"""A lossless, ordered, credit-based stream (transitions from collectors to a learner) on
top of :class:`mq.MQ`, using only its public interface, so every mq type carries it.

::

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
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from mq.wire import tensordicts
from mq.channels import check_name, nbytes_of
from mq.node.message import Message
from mq.errors import ClosedError, ConfigError, MQError, PeerLost, StreamError, Timeout

log = logging.getLogger("mq.stream")

LEFT_GRACE_S = 2.0  # a sender that left may still have its end marker in our handler queue
# recv() raises PeerLost once every sender left without closing its end this long ago (what
# they sent before may still be on its way through our handler queue: it is delivered first).
LOST_GRACE_S = 0.5


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
        self.q, self.name, self.to = q, check_name(name, "stream"), to
        self.max_bytes = max_bytes
        self.timeout = q.timeout if timeout is None else float(timeout)
        self._credit_topic = f"{name}._credit"
        self._cond = threading.RLock()  # its state; waits go through the node's (q.waits, on self)
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

        def fits() -> bool:
            if self.to not in self.q.peers():
                raise PeerLost(f"stream {self.name!r}: the receiver, node {self.to}, left the job")
            out = self.sent_bytes - self.consumed
            return out == 0 or out + n <= self.max_bytes

        self.q.waits.until(fits, deadline, on=(self,), peers=(self.to,),
                           what=lambda: f"stream {self.name!r}: node {self.to} did not consume "
                                        f"{self.sent_bytes - self.consumed} bytes in flight within {wait:g}s "
                                        "(it reads slower than this node sends; raise max_bytes or timeout)")
        self.q.send(self.to, self.name, {"i": self.incarnation, "s": self.sent, "n": n, "d": payload},
                    timeout=max(0.001, deadline - time.monotonic()))
        self.sent += 1
        self.sent_bytes += n

    def _wait_receiver(self, deadline: float) -> None:
        # Until the receiver subscribed, our messages would land in its q.recv() queue.
        if not self._ready:
            self.q.waits.until(lambda: self.to in self.q.wait_for_subscribers(self.name, 0, timeout=0),
                               deadline, peers=(self.to,), every=0.02,
                               what=f"stream {self.name!r}: node {self.to} has not opened it (mq.Stream(q, "
                                    f"{self.name!r}) on that node) in time")
            self._ready = True

    def _on_credit(self, msg: Message) -> None:
        p = msg.payload
        if isinstance(p, dict) and p.get("i") == self.incarnation and isinstance(p.get("consumed"), int):
            with self._cond:
                self.consumed = max(self.consumed, p["consumed"])
            self.q.waits.wake(self)

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
        self.q.waits.wake(self)

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
            PeerLost: nothing is left to read and every sender of the stream so far left the
                job without closing its end (none can send any more); names them.
        """
        self._need(sending=False)
        wait = self.timeout if timeout is None else timeout
        if self._head >= len(self._items):  # nothing waits: the open senders' loss must be noticed
            with self._cond:
                senders = [s for s, inc in self._from.items() if inc.ended is None]
            with self.q.waits.depend(senders):
                self.q.waits.until(self._readable, time.monotonic() + wait, on=(self,),
                                   what=f"stream {self.name!r}: no message within {wait:g}s")
        with self._cond:
            sender, payload, n, sent_at = self._items[self._head]
            self._items[self._head] = None  # type: ignore[call-overload]
            self._head += 1
            if self._head > 1024 and self._head * 2 > len(self._items):
                del self._items[:self._head]
                self._head = 0
            inc = self._from.get(sender)
            due = inc is not None and inc.consumed + n - inc.acked >= self.max_bytes // 4
            if inc is not None:
                inc.consumed += n
        if due:
            self.q.waits.wake(self._acker)  # the acker sends credit now
        return Message(self.name, payload, sender, sent_at)

    def _readable(self) -> bool:
        """A message waits (the reader's condition); PeerLost when none can come any more."""
        if self._head < len(self._items):
            return True
        with self._cond:
            open_ = [s for s, inc in self._from.items() if inc.ended is None]
        if not open_:
            return False
        now, live = time.monotonic(), set(self.q.peers())
        with self._cond:
            for s in open_:
                if s in live:
                    self._gone.pop(s, None)
            gone = [s for s in open_ if s not in live and now - self._gone.setdefault(s, now) > LOST_GRACE_S]
        if len(gone) == len(open_):
            raise PeerLost(f"stream {self.name!r}: nothing more can come: its sender(s) "
                           f"{', '.join(f'node {s}' for s in gone)} left the job without closing the stream")
        return False

    def pending(self) -> int:
        """Messages received and not yet read."""
        return len(self._items) - self._head

    def _ack_loop(self) -> None:
        # Credit goes back from this thread, never from recv(): a slow link must not stall it.
        while not self._closed and self.q.running:
            self.q.waits.pause(lambda: False, 0.01, on=(self._acker,))  # (woken by recv when due)
            with self._cond:
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
        try:
            self.q.waits.until(lambda: not self.open_senders(want), deadline, on=(self,), every=0.02)
        except Timeout:
            pass  # the report says who did not close
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
        return 64 + nbytes_of(tree)
    if isinstance(tree, (bytes, bytearray, memoryview, str)):
        return 16 + len(tree)
    if tensordicts.is_tensordict(tree):  # a batch of transitions: its tensors' bytes
        return tensordicts.nbytes(tree)
    return 16
