"""The one way to wait (mq.node.waits, issue 45): each promise of its docstring, each shown to fail
when broken. A wait ends on its condition, a lost peer, a stop or its deadline; a wake-up that
comes between a look and the sleep is never lost; a forgotten one costs at most the re-check
interval, never the whole timeout."""

from __future__ import annotations

import gc
import socket
import threading
import time
from types import SimpleNamespace

import pytest

import mq
from mq.node import waits as w
from mq.errors import ClosedError, PeerLost, Timeout

pytestmark = pytest.mark.timeout(60)


def _later(seconds: float, fn) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(seconds), fn()), daemon=True)
    t.start()
    return t


def test_a_ready_condition_returns_its_value_without_sleeping():
    waits = w.Waits()
    t0 = time.monotonic()
    assert waits.until(lambda: 42, time.monotonic() + 5) == 42
    assert time.monotonic() - t0 < 0.05
    assert waits.waiting() == 0


def test_a_wake_on_the_object_ends_the_wait_at_once():
    waits, box = w.Waits(), {"v": None}
    _later(0.1, lambda: (box.update(v="here"), waits.wake(box)))
    t0 = time.monotonic()
    assert waits.until(lambda: box["v"], time.monotonic() + 10, on=(box,), every=10.0) == "here"
    assert time.monotonic() - t0 < 1.0  # every=10: only the wake-up can have ended it
    assert waits.waiting() == 0


def test_a_wake_between_the_look_and_the_sleep_is_not_lost():
    # The state changes (and the wake-up comes) while the waiter looks, after it registered and
    # before it sleeps: the classic missed wake-up. The wait must not sleep its 10 s re-check.
    waits, box, looks = w.Waits(), {"v": False}, [0]

    def ready():
        looks[0] += 1
        if looks[0] == 2:  # the look after registering: a producer slips in here
            box["v"] = True
            waits.wake(box)
            return False  # (this look saw the old state)
        return box["v"]

    t0 = time.monotonic()
    assert waits.until(ready, time.monotonic() + 30, on=(box,), every=10.0)
    assert time.monotonic() - t0 < 1.0, "the wake-up between look and sleep was lost"


def test_a_forgotten_wake_costs_at_most_the_recheck_interval():
    waits, box = w.Waits(), {"v": False}
    _later(0.05, lambda: box.update(v=True))  # changes state, wakes nobody
    t0 = time.monotonic()
    assert waits.until(lambda: box["v"], time.monotonic() + 30, on=(box,), every=0.2)
    assert time.monotonic() - t0 < 1.0
    assert w.RECHECK_S <= 0.1  # the default bound every wait of mq has


def test_a_lost_peer_ends_the_wait_with_peer_lost_naming_it_even_if_nobody_wakes_it():
    waits = w.Waits()
    peer = SimpleNamespace(node_id=7, lost=None)
    waits.lookup = {7: peer}.get
    _later(0.1, lambda: setattr(peer, "lost", "died (test)"))  # no wake: the re-check finds it
    t0 = time.monotonic()
    with pytest.raises(PeerLost, match=r"node 7 died \(test\)"):
        waits.until(lambda: False, time.monotonic() + 30, peers=(7,))
    assert time.monotonic() - t0 < 1.0


def test_wake_all_ends_every_wait_at_once():
    waits, peers = w.Waits(), {i: SimpleNamespace(node_id=i, lost=None) for i in range(4)}
    waits.lookup = peers.get
    outcomes = []

    def wait_on(i):
        try:
            waits.until(lambda: False, time.monotonic() + 30, peers=(i,), every=10.0)
        except PeerLost as exc:
            outcomes.append((i, str(exc), time.monotonic()))

    threads = [threading.Thread(target=wait_on, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while waits.waiting() < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    lost_at = time.monotonic()
    for p in peers.values():
        p.lost = "was lost"
    waits.wake_all()
    for t in threads:
        t.join(5)
    assert sorted(i for i, _, _ in outcomes) == [0, 1, 2, 3]
    assert all(at - lost_at < 1.0 for _, _, at in outcomes)  # every=10: the wake-up did it


def test_a_stop_ends_waits_that_need_a_listening_node():
    state = ["listening"]
    waits = w.Waits(lambda: state[0])
    _later(0.1, lambda: (state.__setitem__(0, "stopping"), waits.wake_all()))
    with pytest.raises(ClosedError):
        waits.until(lambda: False, time.monotonic() + 30, every=10.0)
    # ...but not the drain of stop(), which may go on while stopping
    _later(0.1, lambda: state.__setitem__(0, "stopped"))
    with pytest.raises(ClosedError):
        waits.until(lambda: False, time.monotonic() + 30, states=w.LIVE_OR_STOPPING)


def test_a_deadline_raises_timeout_with_the_message_given():
    waits = w.Waits()
    t0 = time.monotonic()
    with pytest.raises(Timeout, match="node 3 confirmed 1 of 5"):
        waits.until(lambda: False, time.monotonic() + 0.2, what=lambda: "node 3 confirmed 1 of 5")
    assert 0.15 < time.monotonic() - t0 < 1.0
    assert not waits.pause(lambda: False, 0.05)


def test_a_socket_wait_ends_when_the_peer_is_lost_though_the_socket_stays_open():
    waits = w.Waits()
    peer = SimpleNamespace(node_id=2, lost=None)
    waits.lookup = {2: peer}.get
    a, b = socket.socketpair()
    try:
        a.setblocking(False)
        while True:  # fill it: nobody reads b
            try:
                a.send(b"x" * 65536)
            except BlockingIOError:
                break
        _later(0.1, lambda: setattr(peer, "lost", "went silent (test)"))
        t0 = time.monotonic()
        with pytest.raises(PeerLost, match="node 2 went silent"):
            waits.for_fd(a.fileno(), __import__("select").POLLOUT, time.monotonic() + 30, peers=(2,))
        assert time.monotonic() - t0 < 1.0
        b.recv(1 << 20)  # room again: the wait returns
        waits.for_fd(a.fileno(), __import__("select").POLLOUT, time.monotonic() + 5)
    finally:
        a.close()
        b.close()


def test_a_wake_from_inside_a_wake_does_not_deadlock():
    # Garbage collection may run a release callback (which wakes) on a thread that already holds
    # the waits' lock: the lock is re-entrant.
    waits, box = w.Waits(), object()
    done = threading.Event()

    def nested():
        with waits._lock:
            waits.wake(box)
            waits.wake_all()
        done.set()

    t = threading.Thread(target=nested, daemon=True)
    t.start()
    assert done.wait(5), "a wake-up from a thread holding the waits' lock deadlocked"


def test_mailbox_and_flag():
    waits = w.Waits()
    box = w.Mailbox(waits)
    with pytest.raises(TimeoutError):
        box.get(0.05)
    _later(0.05, lambda: box.put("item"))
    assert box.get(5) == "item"
    flag = w.Flag(waits)
    assert not flag.wait(0.05)
    _later(0.05, flag.set)
    assert flag.wait(5) and flag.is_set()


def test_a_node_s_waits_end_when_it_stops():
    # A recv blocked on an empty inbox (nothing will come) ends with ClosedError at stop().
    q = mq.create("inproc", 0)
    q.listen()
    errors = []

    def recv():
        try:
            q.recv(timeout=30)
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            errors.append((exc, time.monotonic()))

    t = threading.Thread(target=recv, daemon=True)
    t.start()
    time.sleep(0.2)
    stopped = time.monotonic()
    q.stop(timeout=1)
    t.join(5)
    assert errors and isinstance(errors[0][0], ClosedError), errors
    assert errors[0][1] - stopped < 2.0
    gc.collect()


def test_an_answer_promised_in_a_goodbye_is_awaited_though_the_link_closes_first():
    """A peer that stops answers the calls it promised in its goodbye, then closes. Its link-lost
    can overtake the answer (inproc: the close is told at once, the answer waits in the inbox;
    a CI flake): the caller keeps waiting through the grace, and gets the answer. An answer
    that never comes fails the call with PeerLost once the grace is over."""
    from mq.node import calls as c
    from mq.wire.codec import REP_OK

    peer = SimpleNamespace(lost=None)
    calls = c.Calls(0, None, {1: peer}, None, None, None, SimpleNamespace(dropped_unexpected_reply=0),
                    None, w.Waits(), handler_threads=1, timeout=5)
    with calls.pending(1, 7) as answered_fut, calls.pending(1, 8) as never_fut:
        answered = calls.answered(1, 7, answered_fut)
        never = calls.answered(1, 8, never_fut)
        calls.promised(1, [7, 8])
        peer.lost = "stopped (it called stop())"
        calls.link_lost(1)
        assert answered() is False and never() is False  # promised: no PeerLost yet
        calls.on_reply(SimpleNamespace(kind=REP_OK, corr=7, payload=42, sender=1))
        assert answered() is True and answered_fut.result() == 42
        with pytest.raises(PeerLost, match="left before answering"):
            never_fut.result(timeout=c.LINK_GRACE_S + 5)
