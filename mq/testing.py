"""Conformance checks every backend must pass, run on real processes through the real launcher.

Each ``check_*`` scenario is a function ``(ctx) -> result`` executed by every node of a job
started with :func:`run_group`; a failed assertion inside any node fails the job (its traceback is
printed) and :func:`run_group` raises. Backends plug in by mq type, so the same suite runs on
``nng`` (over tcp and unix sockets) and ``torchrpc:cpu``::

    results = run_group("nng", "check_ordering", n=2, protocol="ipc")
"""

from __future__ import annotations

import os
import pickle
import secrets
import socket
import tempfile
import threading
import time
from typing import Any

import numpy as np

import mq
from mq.launch import make_plan, run_plan

BARRIER = "_barrier"


def run_group(mq_type: str, scenario: str, *, n: int = 2, protocol: str = "auto",
              labels: Any = None, mq_options: dict[str, Any] | None = None,
              deadline_s: float = 60.0) -> dict[int, Any]:
    """Run ``scenario`` (a ``check_*`` name in this module) on ``n`` nodes; results by node id."""
    if mq_type == "inproc":
        return _run_threads(scenario, n, labels, {"timeout": 10.0, **(mq_options or {})}, deadline_s)
    with tempfile.TemporaryDirectory(prefix="mq-conformance-") as out:
        plan = make_plan("mq.testing:_node_main", n_workers=n, mq_type=mq_type, protocol=protocol,
                         labels=labels, mq_options={"timeout": 10.0, **(mq_options or {})},
                         args={"scenario": scenario, "out": out})
        run_plan(plan, deadline_s=deadline_s)
        results = {}
        for node in plan.node_ids:
            with open(os.path.join(out, f"{node}.pkl"), "rb") as f:  # our own file, not the network
                results[node] = pickle.load(f)
        return results


def unix_sockets(pids: Any) -> list[str]:
    """The unix sockets mq nodes of ``pids`` listen on (abstract ``@mq-<pid>-...`` names, or
    files ``/tmp/mq-<pid>-...``), read from /proc/net/unix: what a leak check looks for."""
    prefixes = tuple(p for pid in pids for p in (f"@mq-{pid}-", f"/tmp/mq-{pid}-"))
    with open("/proc/net/unix") as f:
        return sorted({line.split()[-1] for line in f if line.split()[-1].startswith(prefixes)})


def free_port_run(width: int = 1) -> int:
    """A port ``p`` with ``p .. p+width-1`` free on every address right now, picked below the
    kernel's ephemeral range: a port from ``bind(0)`` lies inside it, where any process's next
    outgoing connection may take it (or its neighbour, for a worker listening on base+1)."""
    for _ in range(200):
        base = 10000 + secrets.randbelow(20000)
        socks = []
        try:
            for port in range(base, base + width):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {width} free ports in 10000..30000")


def wait_until(cond: Any, timeout: float = 10.0) -> bool:
    """Poll ``cond()`` until it is true or ``timeout`` seconds pass (never a bare sleep)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def _run_threads(scenario: str, n: int, labels: Any, options: dict[str, Any],
                 deadline_s: float) -> dict[int, Any]:
    """The in-process transport's job: every node is a thread of this process."""
    names = [f"inproc://conformance-{os.getpid()}-{time.monotonic_ns()}-{i}" for i in range(n)]
    label_list = labels if isinstance(labels, list) else [labels] * n
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def node(i: int) -> None:
        q = mq.create("inproc", i, label_list[i], listen_to=names[i], attach_to=names[:i], **options)
        try:
            with q:
                ctx = mq.Context(i, q.labels, q, "inproc", n, list(range(n)), {"scenario": scenario})
                results[i] = _run_scenario(ctx)
        except BaseException as exc:  # reported below, like a worker's traceback
            errors.append(exc)

    threads = [threading.Thread(target=node, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(deadline_s)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise mq.Timeout(f"scenario {scenario} did not finish within {deadline_s:g}s")
    return results


def _node_main(ctx: mq.Context) -> None:
    result = _run_scenario(ctx)
    with open(os.path.join(ctx.args["out"], f"{ctx.node_id}.pkl"), "wb") as f:
        pickle.dump(result, f)


def _run_scenario(ctx: mq.Context) -> Any:
    q = ctx.mq
    q.subscribe(BARRIER, _BarrierBox.get(q).arrive)
    q.wait_for_peers(len(ctx.node_ids) - 1, timeout=20)
    barrier(ctx, "start")
    result = globals()[ctx.args["scenario"]](ctx)
    if q.running:
        barrier(ctx, "end")
    return result


class _BarrierBox:
    _boxes: dict[int, "_BarrierBox"] = {}

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.seen: dict[str, set[int]] = {}

    @classmethod
    def get(cls, q: mq.MQ) -> "_BarrierBox":
        return cls._boxes.setdefault(id(q), cls())

    def arrive(self, msg: mq.Message) -> None:
        with self.cond:
            self.seen.setdefault(msg.payload, set()).add(msg.sender)
            self.cond.notify_all()


def barrier(ctx: mq.Context, name: str, timeout: float = 20.0) -> None:
    """Every node waits until every other node reached ``name``."""
    q = ctx.mq
    others = [n for n in ctx.node_ids if n != ctx.node_id and (name == "start" or n in q.peers())]
    q.wait_for_subscribers(BARRIER, len(others), timeout=timeout)
    for peer in others:
        q.send(peer, BARRIER, name, timeout=timeout)
    box = _BarrierBox.get(q)
    with box.cond:
        ok = box.cond.wait_for(lambda: box.seen.get(name, set()) >= set(others), timeout)
    assert ok, f"node {ctx.node_id}: barrier {name!r} timed out; seen {box.seen.get(name)}"


# ---------------------------------------------------------------------- scenarios
def sample_payload() -> dict[str, Any]:
    import torch

    return {
        "step": 7, "ratio": 0.5, "name": "ünïcode", "flag": True, "none": None, "raw": b"\x00\x01",
        "big": b"x" * 100_000, "tuple": (1, (2, "3")), "list": [1.5, [2, {"k": "v"}]],
        "obs": np.arange(24, dtype=np.uint8).reshape(2, 3, 4),
        "strided": np.arange(20, dtype=np.float64).reshape(4, 5)[:, ::2],
        "empty": np.zeros((0, 3), dtype=np.float32),
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
        "bf16": torch.ones(5, dtype=torch.bfloat16),
        "mask": torch.tensor([True, False]),
        "z": torch.tensor([1 + 2j], dtype=torch.complex64),
        1: "int key",
    }


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, torch.Tensor):  # equal values, whichever device the copy landed on
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b.to(a.device)))
    return type(a) is type(b) and a == b


def check_send_recv(ctx: mq.Context) -> Any:
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


def check_empty_buffers(ctx: mq.Context) -> Any:
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


def check_publish_filtering(ctx: mq.Context) -> Any:
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


def check_recv_timeout(ctx: mq.Context) -> Any:
    t0 = time.monotonic()
    try:
        ctx.mq.recv(timeout=0.3)
    except mq.Timeout:
        return time.monotonic() - t0
    raise AssertionError("recv returned a message nobody sent")


def check_call(ctx: mq.Context) -> Any:
    q = ctx.mq
    if ctx.node_id == 0:
        q.on("double", lambda x: x * 2)
        q.on("fail", lambda x: {}["missing"])
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


def check_peers_routes(ctx: mq.Context) -> Any:
    q = ctx.mq
    return {"all": q.peers(), "learners": q.peers(label="learner"),
            "collectors": q.peers(label="collector"),
            "routes": {p: r.kind for p, r in q.routes().items()}}


ORDERED_N = 2000


def check_ordering(ctx: mq.Context) -> Any:
    """Many small messages and some big ones arrive exactly once, in send order."""
    q = ctx.mq
    if ctx.node_id == 1:
        big = np.zeros(1 << 20, dtype=np.uint8)
        for i in range(ORDERED_N):
            q.send(0, "seq", {"i": i, "blob": big} if i % 500 == 0 else i)
        return None
    got = [m.payload for m in _drain(q, expect=ORDERED_N)]
    return [g["i"] if isinstance(g, dict) else g for g in got]


def check_backpressure(ctx: mq.Context) -> Any:
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


def check_handler_order(ctx: mq.Context) -> Any:
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


def check_peer_stopped(ctx: mq.Context) -> Any:
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


def check_answer_before_goodbye(ctx: mq.Context) -> Any:
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
