"""Flow control's bookkeeping (mq.node.peers.Peer: tx, acked, rx, rx_told), where a receipt races
the send it confirms. The transports here hand frames over in the caller's thread (as
mq.tools.hotpath does), so the race is made to happen every time; the backends' own tests
(conformance: backpressure, stop) run the same code over real sockets."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest

import mq
from mq.wire.codec import MSG, PING
from mq.tools.hotpath import CaptureTransport

pytestmark = pytest.mark.timeout(60)

QUEUE = 64  # the receiver's window: a receipt every 16 messages


class ReceiptFirst(CaptureTransport):
    """The sender's ``send`` returns only once the receipt its frame made due has come back:
    the order a busy machine produces now and then (the receiver's heartbeat thread runs
    before the sender's thread gets the CPU back)."""

    def __init__(self, node_id: int, pinged: threading.Event, each: bool = True):
        super().__init__(node_id)
        self.pinged = pinged
        self.each = each  # False: ``pinged`` says some receipt came, not this frame's
        self.receipt_due = lambda: False

    def send(self, peer: int, frame: Any, timeout: float) -> None:
        if frame.kind == MSG and self.each:
            self.pinged.clear()
        super().send(peer, frame, timeout)
        if frame.kind == PING:
            self.pinged.set()
        elif frame.kind == MSG and self.receipt_due():
            assert self.pinged.wait(5), "the receiver never sent the receipt it owed"


@contextlib.contextmanager
def joined(receiver_transport: CaptureTransport, sender_transport: CaptureTransport, **receiver_options):
    """Node 0 (the receiver) and node 1 (the sender) over two capture transports, joined; both
    stopped after (whatever they still owe is not the point of these tests)."""
    receiver_transport.other, sender_transport.other = sender_transport, receiver_transport
    common = dict(shm=False, secret="flow-control-secret", heartbeat=3000, peer_timeout=3000)
    receiver = mq.MQ(0, transport=receiver_transport, **receiver_options, **common)
    sender = mq.MQ(1, transport=sender_transport, **common)
    receiver.listen()
    sender.listen()
    try:
        sender.wait_for_peers(1, timeout=5)
        receiver.wait_for_peers(1, timeout=5)
        yield sender, receiver
    finally:
        sender.stop(2, raise_undelivered=False)
        receiver.stop(2, raise_undelivered=False)


@pytest.fixture
def racing_pair():
    pinged = threading.Event()
    t0, t1 = ReceiptFirst(0, pinged), ReceiptFirst(1, pinged)
    with joined(t0, t1, queue_size=QUEUE) as (sender, receiver):
        t1.receipt_due = lambda: receiver._peers.get(1).rx % (QUEUE // 4) == 0  # (Dispatch)
        yield sender, receiver


def test_a_receipt_that_beats_its_send_still_opens_the_window(racing_pair):
    sender, receiver = racing_pair
    # Ten windows: before the fix every receipt arrived while its frame was not yet counted as
    # sent, was refused, and the sender stopped at the first full window (Timeout).
    for i in range(10 * QUEUE):
        sender.send(0, "t", i, timeout=2)
        assert receiver.recv(timeout=2).payload == i
    p = sender._peers.get(0)
    assert p.tx == 10 * QUEUE and p.tx - p.acked < QUEUE


def test_a_receipt_for_more_than_was_sent_confirms_what_was(racing_pair):
    sender, _ = racing_pair
    sender.send(0, "t", 1, timeout=2)
    p = sender._peers.get(0)
    sender._peers.receipt(0, p.tx + 5)  # a frame whose send failed after it left, counted there
    assert p.acked == p.tx
    sender._peers.receipt(0, p.tx - 1)  # an old receipt never takes confirmations back
    assert p.acked == p.tx


class ReceiptsFail(CaptureTransport):
    """After the first, the receiver's receipts do not get through (its link full for a
    while) until the sender has filled its window, nor the first one after. The first one
    counts as a heartbeat: the next is not due for a long time."""

    def __init__(self, node_id: int, pinged: threading.Event):
        super().__init__(node_id)
        self.pinged = pinged
        self.received = lambda: 0
        self.failed_at_full = False

    def send(self, peer: int, frame: Any, timeout: float) -> None:
        if frame.kind == PING and self.pinged.is_set() and (
                self.received() < QUEUE or not self.failed_at_full):
            self.failed_at_full = self.received() >= QUEUE
            raise mq.Timeout("the link stayed full (test)")
        super().send(peer, frame, timeout)
        if frame.kind == PING:
            self.pinged.set()


def test_a_receipt_that_failed_is_sent_again_without_new_frames():
    # The sender stops at its full window and sends nothing more: only the receiver's retry,
    # a heartbeat tick later, lets it go on (before, it waited for the next heartbeat: 3000 s).
    pinged = threading.Event()
    t0, t1 = ReceiptsFail(0, pinged), ReceiptFirst(1, pinged, each=False)
    with joined(t0, t1, queue_size=QUEUE) as (sender, receiver):
        pinged.clear()
        t0.received = lambda: receiver._peers.get(1).rx
        t1.receipt_due = lambda: not pinged.is_set() and t0.received() == QUEUE // 4  # the first
        for i in range(2 * QUEUE):
            sender.send(0, "t", i, timeout=5)
            assert receiver.recv(timeout=2).payload == i
        assert t0.failed_at_full


def test_flush_towards_a_peer_that_left_after_confirming_everything_returns():
    # Its goodbye carried its receipt: everything arrived, so flush() has nothing to report
    # (before: PeerLost, as if frames were lost).
    with joined(CaptureTransport(0), CaptureTransport(1)) as (sender, receiver):
        for i in range(5):
            sender.send(0, "t", i, timeout=2)
        assert [receiver.recv(timeout=2).payload for _ in range(5)] == list(range(5))
        receiver.stop(2)
        assert sender._peers.get(0).lost
        sender.flush(0, timeout=2)
