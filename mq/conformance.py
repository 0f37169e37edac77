"""Conformance checks every transport must pass, as ``trio.testing.check_one_way_stream`` does
for streams: each ``check_*`` takes a *group* (:mod:`mq.testing`), runs its node program on
connected nodes of it and asserts what every node saw; ``AssertionError`` says what broke. A
transport mq has never heard of runs them unchanged through a factory of its queues::

    from mq import conformance, testing

    def make_nodes(n, labels, **mq_options):  # queues 0..n-1 that find each other
        return [mq.MQ(i, labels[i], transport=MyTransport(i, ...), **mq_options) for i in range(n)]

    conformance.check_all(testing.InProcess(make_nodes), route="inproc")

The node programs (``_send_recv``, ...) are module-level: launched workers import them by
reference.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import numpy as np

import mq
from mq.testing import Group, _same, barrier, sample_payload

#: Messages node 1 streams to node 0 in :func:`check_ordering`.
ORDERED_N = 2000


# ---------------------------------------------------------------------- checks
def check_send_recv(group: Group) -> None:
    """A payload of every supported kind arrives intact."""
    assert group.run(_send_recv)[0] == "ok"


def check_empty_buffers(group: Group) -> None:
    """Empty tensors and arrays arrive, every time."""
    assert group.run(_empty_buffers)[0] == "ok"


def check_publish_filtering(group: Group) -> None:
    """publish() reaches the subscribers of its topic only."""
    res = group.run(_publish_filtering, n=3)
    assert res[0] == [("t0", "for 0")]
    assert res[1] == [("t1", "for 1")]


def check_recv_timeout(group: Group) -> None:
    """recv() with nothing sent raises Timeout after its timeout."""
    for waited in group.run(_recv_timeout).values():
        assert 0.25 <= waited < 2.0


def check_call(group: Group) -> None:
    """call() returns the handler's result, raises the remote error, times out."""
    out = group.run(_call)[1]
    assert out["double"] == 42
    assert out["obs"] == (1.0, [2.0, 2.0, 2.0, 2.0])
    assert out["fail"] == ("KeyError", "'missing'")
    assert out["nohandler"][0] == "LookupError" and "no handler for 'nohandler'" in out["nohandler"][1]
    assert 0.25 <= out["timeout_s"] < 2.0


def check_peers_and_routes(group: Group, route: str | None = None) -> None:
    """peers() by label, and a route to every peer (of kind ``route`` when given)."""
    res = group.run(_peers_routes, n=3, labels=["learner", "collector", "collector"])
    assert res[0]["all"] == [1, 2] and res[0]["collectors"] == [1, 2] and res[0]["learners"] == []
    assert res[1]["learners"] == [0] and res[1]["collectors"] == [2]
    for node, r in res.items():
        assert set(r["routes"]) == set(r["all"]), r
        if route:
            assert set(r["routes"].values()) == {route}, (node, r["routes"])


def check_ordering(group: Group) -> None:
    """Small and large messages arrive exactly once, in send order."""
    assert group.run(_ordering)[0] == list(range(ORDERED_N))


def check_backpressure(group: Group) -> None:
    """A receiver that never reads makes send() wait, then time out; nothing accepted is lost."""
    res = group.run(_backpressure, mq_options={"queue_size": 4})
    sender, receiver = res[1], res[0]
    assert sender["timed_out"], "a receiver that never reads must make send() time out"
    assert receiver["accepted"] == sender["accepted"]
    assert receiver["received"] == list(range(sender["accepted"]))


def check_handler_order(group: Group) -> None:
    """A subscription's handler runs in order, off the I/O thread."""
    out = group.run(_handler_order)[0]
    assert out["got"] == list(range(300))
    assert len(out["threads"]) == 1 and "io" not in out["threads"][0], out["threads"]


def check_peer_stopped(group: Group) -> None:
    """Sending to a peer that stopped raises PeerLost naming it."""
    assert "node 1" in group.run(_peer_stopped)[0]


def check_answer_before_goodbye(group: Group) -> None:
    """A call whose handler runs when the server stops still gets its answer."""
    assert group.run(_answer_before_goodbye)[0] == 42


def check_stop_waits_for_a_slow_receiver(group: Group) -> None:
    """A sender that stops while its receiver is slow (shorter than stop's bound) loses
    nothing: every accepted message arrives, in order, and stop() returns without error."""
    res = group.run(_stop_slow_receiver, mq_options=STOP_QUEUES, deadline_s=90)
    sender, receiver = res[1], res[0]
    assert sender["undelivered"] is None and sender["accepted"] == STOP_N, sender
    assert receiver["got"] == list(range(STOP_N)), receiver
    assert receiver["dropped"] == {}, receiver


def check_stop_names_what_it_could_not_deliver(group: Group) -> None:
    """A receiver slower than send's and stop's bounds: send() times out once the receiver's
    queue and the frames in flight are full (backpressure: nothing piles up), and stop() raises
    Undelivered naming the peer and how many accepted messages it never confirmed; the receiver
    got the others, in order, and counts (never silently) what reached it after the sender left."""
    res = group.run(_stop_past_bound, mq_options=STOP_QUEUES, deadline_s=90)
    sender, receiver = res[1], res[0]
    assert sender["undelivered"] is not None, "stop() returned although the receiver never confirmed"
    missing, accepted = sender["undelivered"].get(0, 0), sender["accepted"]
    assert 0 < missing <= accepted + 1, sender  # (+1: the group's start barrier, sent just before)
    assert "node 0" in sender["message"], sender
    got = receiver["got"]
    assert got == list(range(len(got))), got  # in order, nothing twice
    assert len(got) >= accepted - missing, (len(got), sender)  # what was confirmed arrived
    assert len(got) + sum(receiver["dropped"].values()) >= accepted, receiver  # the rest is counted


def check_calls_racing_stop_get_answers(group: Group) -> None:
    """Calls that reach a node while it stops: every call whose handler ran gets its answer;
    the others fail with PeerLost (or ClosedError), their handlers never run."""
    res = group.run(_calls_racing_stop, deadline_s=90)
    ran, calls = set(res[1]), res[0]
    answered = {i for i, outcome in calls if outcome == "answer"}
    assert ran, "no call reached the handler before stop()"
    assert ran <= answered, f"handlers ran for calls that got no answer: {sorted(ran - answered)}; {calls}"
    assert all(outcome in ("answer", "PeerLost", "ClosedError") for _i, outcome in calls), calls


CHECKS: tuple[Callable[[Group], None], ...] = (
    check_send_recv, check_empty_buffers, check_publish_filtering, check_recv_timeout, check_call,
    check_peers_and_routes, check_ordering, check_backpressure, check_handler_order,
    check_peer_stopped, check_answer_before_goodbye, check_stop_waits_for_a_slow_receiver,
    check_stop_names_what_it_could_not_deliver, check_calls_racing_stop_get_answers)


def check_all(group: Group, route: str | None = None) -> None:
    """Every check, in order; ``route``: the route kind every peer must get (None: any)."""
    for check in CHECKS:
        check(group, route) if check is check_peers_and_routes else check(group)


# ---------------------------------------------------------------------- node programs
def _send_recv(ctx: mq.Context) -> Any:
    """Node 1 sends a payload of every supported kind to node 0; node 0 gets it intact."""
    q = ctx.mq
    if ctx.node_id == 1:
        q.send(0, "data", sample_payload())
        return None
    msg = q.recv(timeout=10)
    assert msg.topic == "data" and msg.sender == 1, msg
    assert _same(sample_payload(), msg.payload), f"payload changed in transit: {msg.payload!r}"
    return "ok"


def empty_payloads() -> list[Any]:
    """Payloads with zero-size buffers, alone (the remembered-tree fast path after the first)
    and beside a large one (the shm data path on a same-host route)."""
    import torch

    return [torch.empty(0, 4), torch.empty(0, dtype=torch.bfloat16), np.empty((0, 3), np.float32),
            np.empty(0, np.uint8), {"obs": torch.empty(0, 2), "n": 0},
            {"big": torch.ones(1 << 18), "none": torch.empty(0, 8), "arr": np.empty((2, 0))}]


def _empty_buffers(ctx: mq.Context) -> Any:
    """Node 1 sends each empty payload three times; node 0 gets every one, intact."""
    q = ctx.mq
    if ctx.node_id == 1:
        for payload in empty_payloads():
            for _ in range(3):
                q.send(0, "empty", payload)
        return None
    got = [q.recv(timeout=10).payload for _ in range(3 * len(empty_payloads()))]
    for i, payload in enumerate(empty_payloads()):
        for copy in got[3 * i:3 * i + 3]:
            assert _same(payload, copy), f"payload {i} changed in transit: {copy!r}"
    assert q.stats().dropped_malformed == 0, q.stats()
    return "ok"


def _publish_filtering(ctx: mq.Context) -> Any:
    """Publish reaches subscribers of the topic only."""
    q = ctx.mq
    if ctx.node_id in (0, 1):
        q.subscribe(f"t{ctx.node_id}")
    barrier(ctx, "subscribed")
    if ctx.node_id == 2:
        q.wait_for_subscribers("t0", 1, timeout=10)
        q.wait_for_subscribers("t1", 1, timeout=10)
        assert q.publish("t0", "for 0") == [0]
        assert q.publish("t1", "for 1") == [1]
        assert q.publish("nobody", "lost") == []
    barrier(ctx, "published")
    if ctx.node_id == 2:
        return []
    got = [(m.topic, m.payload) for m in _drain(q, expect=1)]
    return got


def _recv_timeout(ctx: mq.Context) -> Any:
    t0 = time.monotonic()
    try:
        ctx.mq.recv(timeout=0.3)
    except mq.Timeout:
        return time.monotonic() - t0
    raise AssertionError("recv returned a message nobody sent")


def _call(ctx: mq.Context) -> Any:
    q = ctx.mq
    if ctx.node_id == 0:
        q.on("double", lambda x: x * 2)
        q.on("fail", lambda x: {}["missing"])  # type: ignore[index]  # a KeyError, on purpose
        q.on("slow", lambda x: time.sleep(2))
        q.on("obs", lambda x: {"mean": float(np.mean(x)), "arr": x + 1})
    barrier(ctx, "served")
    if ctx.node_id == 0:
        return None
    out: dict[str, Any] = {"double": q.call(0, "double", 21, timeout=5)}
    r = q.call(0, "obs", np.ones(4), timeout=5)
    out["obs"] = (r["mean"], r["arr"].tolist())
    for topic in ("fail", "nohandler"):
        try:
            q.call(0, topic, 1, timeout=5)
        except mq.RemoteError as exc:
            out[topic] = (exc.remote_type, exc.remote_message)
    t0 = time.monotonic()
    try:
        q.call(0, "slow", None, timeout=0.3)
    except mq.Timeout:
        out["timeout_s"] = time.monotonic() - t0
    return out


def _peers_routes(ctx: mq.Context) -> Any:
    q = ctx.mq
    return {"all": q.peers(), "learners": q.peers(label="learner"),
            "collectors": q.peers(label="collector"),
            "routes": {p: r.kind for p, r in q.routes().items()}}


def _ordering(ctx: mq.Context) -> Any:
    """Many small messages and some big ones arrive exactly once, in send order."""
    q = ctx.mq
    if ctx.node_id == 1:
        big = np.zeros(1 << 20, dtype=np.uint8)
        for i in range(ORDERED_N):
            q.send(0, "seq", {"i": i, "blob": big} if i % 500 == 0 else i)
        return None
    got = [m.payload for m in _drain(q, expect=ORDERED_N)]
    return [g["i"] if isinstance(g, dict) else g for g in got]


def _backpressure(ctx: mq.Context) -> Any:
    """A receiver that does not read makes the sender wait and then time out; nothing that
    send() accepted is lost once the receiver drains."""
    q = ctx.mq
    if ctx.node_id == 1:
        accepted, timed_out, payload = 0, False, np.zeros(256 << 10, dtype=np.uint8)
        for i in range(100_000):
            try:
                q.send(0, "flood", (i, payload), timeout=0.5)
                accepted += 1
            except mq.Timeout:
                timed_out = True
                break
        q.send(0, "count", accepted, timeout=30)  # waits for the drain: backpressure lifts
        return {"accepted": accepted, "timed_out": timed_out}
    time.sleep(0)
    barrier_deadline = time.monotonic() + 30
    seen: list[int] = []
    while time.monotonic() < barrier_deadline:
        msg = q.recv(timeout=30) if seen else _first_after_stall(q)
        if msg.topic == "count":
            return {"received": seen, "accepted": msg.payload}
        seen.append(msg.payload[0])
    raise AssertionError("sender never reported its count")


def _first_after_stall(q: mq.MQ) -> mq.Message:
    # Stall long enough for the sender to hit its 0.5 s send timeout.
    time.sleep(3.0)
    return q.recv(timeout=30)


def _handler_order(ctx: mq.Context) -> Any:
    """subscribe(topic, fn) calls fn off the I/O thread, in order."""
    q = ctx.mq
    got: list[int] = []
    threads: set[str] = set()
    done = threading.Event()
    if ctx.node_id == 0:
        def on_msg(msg: mq.Message) -> None:
            threads.add(threading.current_thread().name)
            got.append(msg.payload)
            if len(got) == 300:
                done.set()
        q.subscribe("h", on_msg)
    barrier(ctx, "subscribed")
    if ctx.node_id == 1:
        q.wait_for_subscribers("h", 1, timeout=10)
        for i in range(300):
            q.publish("h", i)
        return None
    assert done.wait(20), f"handler saw {len(got)} of 300"
    return {"got": got, "threads": sorted(threads)}


def _peer_stopped(ctx: mq.Context) -> Any:
    """After a peer stops, sending to it raises PeerLost (not a silent drop)."""
    q = ctx.mq
    if ctx.node_id == 1:
        q.stop()
        return "stopped"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            q.send(1, "x", 1, timeout=1)
        except mq.PeerLost as exc:
            return str(exc)
        time.sleep(0.05)
    raise AssertionError("send to a stopped peer kept succeeding")


def _answer_before_goodbye(ctx: mq.Context) -> Any:
    """Node 1 stops while its handler for node 0's call is still running: the call still
    gets its answer (stop lets running handlers answer first), not PeerLost."""
    q = ctx.mq
    if ctx.node_id == 1:
        running = threading.Event()

        def slow(x: int) -> int:
            running.set()
            time.sleep(0.3)
            return x + 1

        q.on("slow", slow)
        q.send(0, "go", None)
        if not running.wait(10):
            raise AssertionError("node 0's call never reached the handler")
        q.stop()
        return "stopped"
    assert q.recv(timeout=10).topic == "go"
    answer = q.call(1, "slow", 41, timeout=10)
    deadline = time.monotonic() + 10  # node 1's goodbye follows: no "end" barrier with it
    while 1 in q.peers() and time.monotonic() < deadline:
        time.sleep(0.02)
    return answer


#: The shutdown scenario: small receive queues, and a stream of small and large messages.
STOP_QUEUES = {"queue_size": 8, "queue_bytes": 1 << 20}
STOP_N = 62


def _stop_stream() -> list[Any]:
    small = list(range(30))
    return [*small, b"x" * 2_000_000, np.ones(10_000_000 // 8), *small]


def _stop_sender_then_stop(q: mq.MQ, stop_timeout: float, send_timeout: float) -> dict[str, Any]:
    accepted = 0
    for i, payload in enumerate(_stop_stream()):
        try:
            q.send(0, "last", (i, payload), timeout=send_timeout)
        except mq.Timeout:  # backpressure: the receiver's queue and the window are full
            break
        accepted += 1
    out: dict[str, Any] = {"accepted": accepted, "undelivered": None}
    try:
        q.stop(timeout=stop_timeout)
    except mq.Undelivered as exc:
        out.update(undelivered=dict(exc.counts), message=str(exc))
    return out


def _stop_receiver(q: mq.MQ, stall: float) -> dict[str, Any]:
    time.sleep(stall)  # the slow receiver: reads nothing meanwhile
    got = []
    while True:
        try:
            got.append(q.recv(timeout=3).payload[0])
        except mq.Timeout:
            break
    return {"got": got, "dropped": dict(q.stats().dropped)}


def _stop_slow_receiver(ctx: mq.Context) -> Any:
    if ctx.node_id == 1:
        return _stop_sender_then_stop(ctx.mq, stop_timeout=20, send_timeout=30)
    return _stop_receiver(ctx.mq, stall=3)


def _stop_past_bound(ctx: mq.Context) -> Any:
    if ctx.node_id == 1:
        return _stop_sender_then_stop(ctx.mq, stop_timeout=1, send_timeout=0.5)
    return _stop_receiver(ctx.mq, stall=5)


def _calls_racing_stop(ctx: mq.Context) -> Any:
    """Node 0 keeps four threads calling node 1, which stops 0.5 s in: node 1 returns the
    calls its handler ran, node 0 what each call got."""
    q = ctx.mq
    if ctx.node_id == 1:
        ran: list[int] = []

        def act(i: int) -> int:
            ran.append(i)
            time.sleep(0.002 * (i % 5))  # handlers of several lengths are running at the stop
            return i

        q.on("act", act)
        barrier(ctx, "serving")
        time.sleep(0.5)
        q.stop(timeout=5)
        return ran
    barrier(ctx, "serving")
    outcomes: list[tuple[int, str]] = []
    counter = iter(range(1_000_000))
    lock = threading.Lock()

    def caller() -> None:
        while True:
            with lock:
                i = next(counter)
            try:
                assert q.call(1, "act", i, timeout=10) == i
                outcome = "answer"
            except (mq.PeerLost, mq.ClosedError) as exc:
                outcome = type(exc).__name__
            with lock:
                outcomes.append((i, outcome))
            if outcome != "answer":
                return

    threads = [threading.Thread(target=caller, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return outcomes


def _drain(q: mq.MQ, expect: int, timeout: float = 20.0) -> list[mq.Message]:
    out: list[mq.Message] = []
    deadline = time.monotonic() + timeout
    while len(out) < expect and time.monotonic() < deadline:
        try:
            out.append(q.recv(timeout=max(0.01, deadline - time.monotonic())))
        except mq.Timeout:
            break
    try:  # anything beyond the expected count is a duplicate or a leak
        out.append(q.recv(timeout=0.3))
    except mq.Timeout:
        pass
    return out
