"""Node programs for tests/test_torchrpc.py, importable by spawned processes.

Each is ``program(node_id, world_size, init_method, **kw) -> result``, run by
:class:`mq.testing.Spawned` (one process per node, the program passed by reference); a
program makes its own queue (:func:`_create`), so it may start a second RPC agent or kill its
own process.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
from typing import Any

import numpy as np
import torch

import mq
from mq.testing import _same

ORDERED = 500


def _create(node_id: int, world_size: int, init_method: str, labels: Any = None, **options: Any) -> mq.MQ:
    mq_type = options.pop("mq_type", "torchrpc:cpu")
    return mq.create(mq_type, node_id, labels, world_size=world_size, init_method=init_method,
                     timeout=options.pop("timeout", 15.0), **options)


def payload() -> dict[str, Any]:
    return {
        "obs": np.arange(24, dtype=np.uint8).reshape(2, 3, 4),
        "f64": np.linspace(0, 1, 7),
        "strided": np.arange(20, dtype=np.float32).reshape(4, 5)[:, ::2],
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
        "bf16": torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16),
        "u8": torch.arange(5, dtype=torch.uint8),
        "empty": torch.zeros(0, 3),
        "big": b"x" * 100_000,
        "meta": {"step": 3, "name": "ü", "t": (1, 2.0)},
    }


def _recv_until(q: mq.MQ, want: int, timeout: float = 20.0) -> list[mq.Message]:
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < want:
        out.append(q.recv(timeout=max(0.01, deadline - time.monotonic())))
    return out


# ---------------------------------------------------------------------- scenarios
def exchange(node_id: int, world_size: int, init_method: str, public_rpc_async: bool = False) -> Any:
    """Node 0 serves calls and receives; node 1 streams 500 ordered messages and a mixed
    payload; node 2 subscribes to what node 0 publishes; everyone publishes stats.
    ``public_rpc_async``: as mq does on a torch without the internal call it uses."""
    if public_rpc_async:
        import mq.backends.torchrpc.wire as backend
        backend._invoke_rpc_torchscript = None
    labels = ["learner"] if node_id == 0 else ["collector"]
    with _create(node_id, world_size, init_method, labels) as q:
        q.wait_for_peers(world_size - 1, timeout=20)
        res: dict[str, Any] = {
            "peers": q.peers(), "collectors": q.peers(label="collector"),
            "learners": q.peers(label="learner"),
            "routes": {p: (type(r).__name__, r.kind, r.gpu) for p, r in q.routes().items()},
        }
        if node_id == 0:
            q.on("fail", lambda x: {}["missing"])
            q.on("double", lambda x: x * 2)  # last: the others poll it to know both are served
            q.subscribe("stats")
            q.wait_for_subscribers("model", 1, timeout=20)
            res["model_to"] = q.publish("model", {"weights": torch.ones(4)})
            msgs = _recv_until(q, ORDERED + 1 + 2 + 2)  # seq, payload, stats x2, done x2
            res["seq"] = [m.payload for m in msgs if m.topic == "seq"]
            res["payload_ok"] = _same(payload(), [m.payload for m in msgs if m.topic == "payload"][0])
            res["stats"] = sorted((m.sender, m.payload) for m in msgs if m.topic == "stats")
            res["done"] = sorted(m.sender for m in msgs if m.topic == "done")
            try:
                q.recv(timeout=0.3)
                res["extra"] = True
            except mq.Timeout:
                res["extra"] = False
            return res
        if node_id == 2:
            q.subscribe("model")
        q.wait_for_subscribers("stats", 1, timeout=20)
        deadline = time.monotonic() + 20
        while True:
            try:
                res["double"] = q.call(0, "double", 21, timeout=5)
                break
            except mq.RemoteError:  # not registered yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        try:
            q.call(0, "fail", None, timeout=5)
        except mq.RemoteError as exc:
            res["remote_error"] = (exc.remote_type, exc.remote_message, exc.peer)
        if node_id == 1:
            for i in range(ORDERED):
                q.send(0, "seq", i)
            q.send(0, "payload", payload())
        else:
            m = q.recv(timeout=20)
            res["model"] = (m.topic, m.sender, m.payload["weights"].tolist())
        res["published_to"] = q.publish("stats", {"node": node_id})
        q.send(0, "done", None)
        return res


def sigkill(node_id: int, world_size: int, init_method: str) -> Any:
    """Node 2 dies by SIGKILL; node 0 keeps sending to it, node 1 keeps calling it."""
    q = _create(node_id, world_size, init_method, timeout=10.0)
    q.listen()
    q.wait_for_peers(world_size - 1, timeout=20)
    if node_id == 2:
        q.on("echo", lambda x: x)
        _recv_until(q, 2)  # both others joined everyone: our death cannot race their join
        for peer in (0, 1):
            q.send(peer, "dying", None)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    q.send(2, "ready", None)
    assert q.recv(timeout=20).topic == "dying"
    t0 = time.monotonic()
    error = None
    while time.monotonic() - t0 < 30:
        try:
            if node_id == 0:
                q.send(2, "data", np.zeros(1000), timeout=5)
            else:
                q.call(2, "echo", 1, timeout=20)
        except (mq.PeerLost, mq.Timeout) as exc:
            error = (type(exc).__name__, str(exc))
            break
        time.sleep(0.02)
    detected = time.monotonic() - t0
    t1 = time.monotonic()
    q.stop(timeout=5.0)
    return {"error": error, "detected_s": detected, "stop_s": time.monotonic() - t1,
            "peers_after": q.peers()}


def calls(node_id: int, world_size: int, init_method: str) -> Any:
    """Node 1 calls node 0's handlers: each call must be one request (no REQ frame), served
    off mq's handler pool; then node 1 sends a request whose envelope claims node 5."""
    import threading

    from torch.distributed import rpc

    from mq.backends.torchrpc.wire import inline_text as _inline_text, request_script as _request_script
    from mq.wire.codec import REQ

    with _create(node_id, world_size, init_method) as q:
        q.wait_for_peers(1, timeout=20)
        if node_id == 0:
            q.on("echo", lambda x: x)
            q.on("fail", lambda x: {}["missing"])
            q.on("thread", lambda x: threading.current_thread().name)
            state = threading.local()  # per Python thread state: new if torch made a new one

            def thread_state(x: Any) -> tuple[int, bool]:
                fresh = not getattr(state, "seen", False)
                state.seen = True
                return threading.get_ident(), fresh

            q.on("thread_state", thread_state)
            q.send(1, "served", None)
            assert q.recv(timeout=30).topic == "done"
            return {"rejected": dict(q.stats().rejected)}
        assert q.recv(timeout=20).topic == "served"
        kinds: list[int] = []
        taken: list[bool] = []
        send, request = q.transport.send, q.transport.request

        def counting_send(peer: int, frame: Any, timeout: float) -> Any:
            kinds.append(frame.kind)
            return send(peer, frame, timeout)

        def counting_request(peer: int, frame: Any, timeout: float) -> Any:
            reply = request(peer, frame, timeout)
            taken.append(reply is not None)
            return reply

        q.transport.send, q.transport.request = counting_send, counting_request  # type: ignore[method-assign]
        res: dict[str, Any] = {}
        small = q.call(0, "echo", {"n": 7, "t": torch.arange(4)}, timeout=10)
        res["small"] = (small["n"], small["t"].tolist())
        big = torch.arange(100_000, dtype=torch.float32)  # 400 KB: RPC tensors, not text
        res["big"] = bool(torch.equal(q.call(0, "echo", big, timeout=10), big))
        res["payload_ok"] = _same(payload(), q.call(0, "echo", payload(), timeout=10))
        res["thread"] = q.call(0, "thread", None, timeout=10)
        res["thread_states"] = [q.call(0, "thread_state", None, timeout=10) for _ in range(40)]
        for topic in ("fail", "nohandler"):
            try:
                q.call(0, topic, 1, timeout=10)
            except mq.RemoteError as exc:
                res[topic] = (exc.remote_type, exc.remote_message, exc.peer)
        res["req_frames"] = kinds.count(REQ)
        res["taken"] = taken
        # A request on node 1's link whose envelope says node 5 sent it.
        forged = q.codec.encode(REQ, "echo", 5, 0, 12345, "hi")
        try:
            rpc.rpc_sync("mq0", _request_script, args=(1, _inline_text(forged), []), timeout=10)
            res["spoofed"] = "answered"
        except RuntimeError as exc:
            res["spoofed"] = str(exc)
        q.send(0, "done", None)
        return res


def call_dies(node_id: int, world_size: int, init_method: str) -> Any:
    """Node 0's handler SIGKILLs its own process mid-call; node 1's call must fail fast."""
    q = _create(node_id, world_size, init_method, timeout=10.0)
    q.listen()
    q.wait_for_peers(1, timeout=20)
    if node_id == 0:
        q.on("die", lambda x: os.kill(os.getpid(), signal.SIGKILL))
        q.send(1, "served", None)
        time.sleep(60)  # killed by its own handler long before
        return None
    assert q.recv(timeout=20).topic == "served"
    t0 = time.monotonic()
    try:
        q.call(0, "die", None, timeout=30)
        error = None
    except mq.MQError as exc:
        error = (type(exc).__name__, str(exc))
    waited = time.monotonic() - t0
    q.stop(timeout=5.0)
    return {"error": error, "waited_s": waited}


def stop_abandoned(node_id: int, world_size: int, init_method: str) -> Any:
    """rpc.shutdown hangs (as torch's does when a peer died): stop() still returns in time."""
    q = _create(node_id, world_size, init_method)
    q.listen()
    if node_id == 0:
        q.wait_for_peers(world_size - 1, timeout=20)
        import torch.distributed.rpc as rpc

        rpc.shutdown = lambda *a, **k: time.sleep(3600)  # type: ignore[assignment]
        q.send(1, "x", 1)
        t0 = time.monotonic()
        q.stop(timeout=2.0)
        return {"stop_s": time.monotonic() - t0}
    q.subscribe("x")
    q.recv(timeout=20)
    q.stop(timeout=2.0)
    return {}


def no_unpickle(node_id: int, world_size: int, init_method: str) -> Any:
    """After joining, neither side unpickles anything while messages, calls and tensors flow."""
    from torch.distributed.rpc import internal

    calls: list[str] = []

    def trap(name: str, fn: Any) -> Any:
        def wrapped(*a: Any, **k: Any) -> Any:
            calls.append(name)
            return fn(*a, **k)
        return wrapped

    with _create(node_id, world_size, init_method) as q:
        q.wait_for_peers(world_size - 1, timeout=20)
        pickle.loads = trap("pickle.loads", pickle.loads)
        pickle.load = trap("pickle.load", pickle.load)
        rpc_pickler = internal._InternalRPCPickler
        rpc_pickler.deserialize = trap("rpc-pickler", rpc_pickler.deserialize)
        q.on("echo", lambda x: x)
        q.subscribe("data")
        other = 1 - node_id
        q.wait_for_subscribers("data", 1, timeout=20)
        for i in range(20):
            q.send(other, "data", {"i": i, "t": torch.randn(3), "a": np.ones(5)})
        got = _recv_until(q, 20)
        deadline = time.monotonic() + 20
        while True:
            try:
                echoed = q.call(other, "echo", {"t": torch.arange(3)}, timeout=5)
                break
            except mq.RemoteError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        q.send(other, "data", "end")
        _recv_until(q, 1)
        clean = list(calls)
        # Both snapshots are taken before the control below: node 1's agent threads could
        # otherwise run node 0's control request before node 1's main thread reads "end".
        q.send(other, "data", "snapshot taken")
        _recv_until(q, 1)
        # Positive control: a Python-function RPC (what mq never sends) does hit the traps.
        if node_id == 0:
            import torch.distributed.rpc as rpc

            assert rpc.rpc_sync("mq1", _python_udf, args=(20,)) == 21
        q.send(other, "data", "control done")
        _recv_until(q, 1)
    return {"calls": clean, "control": calls[len(clean):], "got": len(got),
            "echo": echoed["t"].tolist()}


def idle_cpu(node_id: int, world_size: int, init_method: str, **options: Any) -> Any:
    """Messages and a call go both ways, then both nodes sit idle for 2 s: the CPU this
    process spent meanwhile (cores), and the TensorPipe transports it allowed."""
    import resource

    with _create(node_id, world_size, init_method, **options) as q:
        q.on("echo", lambda x: x)
        q.wait_for_peers(1, timeout=20)
        other = 1 - node_id
        q.send(other, "hi", np.arange(10_000, dtype=np.float32))  # 40 KB: an RPC tensor
        got = q.recv(timeout=20).payload
        answer = q.call(other, "echo", {"n": node_id}, timeout=20)
        time.sleep(0.5)  # the other node's call ends too
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        time.sleep(2.0)
        r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        cores = (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / (t1 - t0)
        return {"cores": cores, "transports": q.transport.tp_options["_transports"],
                "got": float(got.sum()), "answer": answer}


def handover(node_id: int, world_size: int, init_method: str) -> Any:
    """Who delivers node 0's frames keeps changing: its recv() caller (reading for itself) and
    its delivery thread (while no caller reads), with pauses around the caller's grace period.
    Node 1 streams numbered "r" messages (for recv) and "h" ones (for a handler) in bursts; node
    0 checks both orders, then lets its handler take more "h" with no caller at all, then stops
    the queue under a blocked recv()."""
    import random
    import sys
    import threading

    total_r, first_h, more_h = 1500, 500, 300
    rng = random.Random(node_id)
    sys.setswitchinterval(1e-5)  # threads interleave often: a race in the hand-over shows
    with _create(node_id, world_size, init_method) as q:
        handled: list[int] = []
        if node_id == 0:  # before node 1 can send: an "h" must never reach recv()
            q.subscribe("h", lambda m: handled.append(m.payload))
        q.wait_for_peers(1, timeout=20)
        if node_id == 1:
            h = 0
            for i in range(total_r):
                q.send(0, "r", i)
                if i % 3 == 0:
                    q.send(0, "h", h)
                    h += 1
                if i % 50 == 0:
                    time.sleep(rng.uniform(0, 0.006))
            assert h == first_h
            _recv_until(q, 1)  # "go": node 0's caller has left for good
            for _ in range(more_h):
                q.send(0, "h", h)
                h += 1
            _recv_until(q, 1)  # "bye"
            return {}
        got: list[int] = []
        timeouts = 0
        while len(got) < total_r:
            try:
                got.append(q.recv(timeout=rng.choice([0.0005, 0.002, 0.02])).payload)
            except mq.Timeout:
                timeouts += 1
            if rng.random() < 0.1:
                time.sleep(rng.uniform(0, 0.005))  # sometimes longer than the grace period
        q.send(1, "go", None)
        deadline = time.monotonic() + 15
        while len(handled) < first_h + more_h and time.monotonic() < deadline:
            time.sleep(0.01)
        q.send(1, "bye", None)
        # A recv() blocked (holding the reader token) when the queue stops: ClosedError, soon.
        outcome: dict[str, Any] = {}

        def blocked() -> None:
            t0 = time.monotonic()
            try:
                q.recv(timeout=30)
                outcome["raised"] = None
            except Exception as exc:
                outcome["raised"] = type(exc).__name__
            outcome["after_s"] = time.monotonic() - t0

        reader = threading.Thread(target=blocked)
        reader.start()
        time.sleep(0.3)
        q.stop(timeout=5)
        reader.join(10)
        return {"r": got == list(range(total_r)), "r_head": got[:5], "timeouts": timeouts,
                "h": handled == list(range(first_h + more_h)), "h_count": len(handled),
                "closed": outcome}


def _python_udf(x: int) -> int:
    return x + 1


def copy_semantics(node_id: int, world_size: int, init_method: str, **options: Any) -> Any:
    """The sender changes its buffers right after send()/publish() returns; the receiver must
    never see the change, for small (copied) and large (sent in place) frames alike."""
    with _create(node_id, world_size, init_method, **options) as q:
        q.subscribe("w")
        q.wait_for_peers(1, timeout=20)
        if node_id == 1:
            arr = np.zeros(1 << 20, dtype=np.float32)  # 4 MiB: above the default copy threshold
            ten = torch.zeros(1 << 20)
            small = np.zeros(16)
            q.wait_for_subscribers("w", 1, timeout=20)
            for i in range(5):
                arr[:], ten[:], small[:] = i, i, i
                q.send(0, "w", {"arr": arr, "ten": ten})
                q.send(0, "w", {"small": small})
                arr[:], ten[:], small[:] = -1, -1, -1
                q.publish("w", {"arr": arr * 0 + i, "ten": ten * 0 + i})
            q.send(0, "end", None)
            q.recv(timeout=20)
            return None
        msgs = _recv_until(q, 16)
        seen = sorted({(float(v.min()), float(v.max())) for m in msgs if m.topic == "w"
                       for v in m.payload.values()})
        q.send(1, "w", "ack")
        return seen


def second_agent(node_id: int, world_size: int, init_method: str, init_method2: str) -> Any:
    """One RPC agent per process: a second listening queue is a ConfigError; after stop() a
    new one may start."""
    first = _create(node_id, world_size, init_method)
    first.listen()
    second = _create(node_id, world_size, init_method2)
    try:
        second.listen()
        refused = None
    except mq.ConfigError as exc:
        refused = str(exc)
    first.stop()
    third = _create(node_id, world_size, init_method2)
    third.listen()
    running = third.running
    third.stop()
    return {"refused": refused, "restart": running}


def init_variant(node_id: int, world_size: int, init_method: str, env: dict[str, str]) -> Any:
    os.environ.update(env)
    with _create(node_id, world_size, init_method) as q:
        q.wait_for_peers(world_size - 1, timeout=20)
        if node_id == 1:
            q.send(0, "hi", torch.tensor([node_id]))
            q.subscribe("bye")
            q.recv(timeout=20)
            return None
        m = q.recv(timeout=20)
        q.wait_for_subscribers("bye", 1, timeout=20)
        q.send(1, "bye", None)
        return (m.topic, m.sender, m.payload.tolist())


def cuda_transfer(node_id: int, world_size: int, init_method: str, mq_type: str,
                  device_map: str | None) -> Any:
    """Node 1 sends a CUDA tensor to node 0: with torchrpc:cuda it moves device to device by the
    map; with torchrpc:cpu it is staged through host and put back on the GPU."""
    opts: dict[str, Any] = {"mq_type": mq_type}
    if device_map is not None:
        opts["cuda_device_map"] = device_map
    with _create(node_id, world_size, init_method, **opts) as q:
        q.wait_for_peers(1, timeout=30)
        if node_id == 1:
            t = torch.arange(1 << 20, dtype=torch.float32, device="cuda:0")
            q.send(0, "t", {"t": t, "cpu": torch.ones(3)})
            q.subscribe("ack")
            q.recv(timeout=30)
            return None
        m = q.recv(timeout=30)
        t = m.payload["t"]
        ok = bool(torch.equal(t.cpu(), torch.arange(1 << 20, dtype=torch.float32)))
        q.wait_for_subscribers("ack", 1, timeout=30)
        q.send(1, "ack", None)
        return {"device": str(t.device), "ok": ok, "cpu_device": str(m.payload["cpu"].device)}


# ---------------------------------------------------------------------- through mq.launch
def launch_main(ctx: mq.Context) -> None:
    """A ring: every node sends its id to the next one and checks what the previous sent."""
    q = ctx.mq
    n = len(ctx.node_ids)
    q.subscribe("ring")
    q.subscribe("done")
    q.wait_for_peers(n - 1, timeout=20)
    nxt, prev = (ctx.node_id + 1) % n, (ctx.node_id - 1) % n
    q.wait_for_subscribers("ring", n - 1, timeout=20)
    q.send(nxt, "ring", {"from": ctx.node_id, "t": torch.full((2,), float(ctx.node_id))})
    ring, done = [], 0
    deadline = time.monotonic() + 20
    while not ring or done < n - 1:  # leave together: an early stop would look like a loss
        m = q.recv(timeout=max(0.01, deadline - time.monotonic()))
        if m.topic == "done":
            done += 1
            continue
        ring.append(m)
        assert m.sender == prev and m.payload["from"] == prev, m
        assert m.payload["t"].tolist() == [float(prev)] * 2
        with open(os.path.join(ctx.args["out"], f"{ctx.node_id}.txt"), "w") as f:
            f.write(f"{ctx.mq_type} {m.sender} {sorted(q.peers())}")
        q.wait_for_subscribers("done", n - 1, timeout=20)
        q.publish("done", ctx.node_id)


def cuda_roundtrip(node_id: int, world_size: int, init_method: str) -> Any:
    """torchrpc:cuda on one GPU (tests/test_cuda.py): node 0 calls node 1's echo with GPU, CPU
    and mixed payloads; same-host GPU tensors must take mq's descriptors, not TensorPipe."""
    with _create(node_id, world_size, init_method, mq_type="torchrpc:cuda", local_cuda_devices=[0],
                 cuda_pool_bytes=64 << 20, timeout=60.0) as q:
        q.wait_for_peers(world_size - 1, timeout=60)
        other = 1 - node_id
        res: dict[str, Any] = {"route": q.routes()[other].gpu, "reason": q.routes()[other].reason,
                               "channels": list(q.transport.tp_options.get("_channels") or [])}
        if node_id == 1:
            q.on("echo", lambda x: x)
            q.subscribe("done")
            q.recv(timeout=120)
        else:
            q.wait_for_subscribers("done", 1, timeout=60)
            sent = {"gpu": torch.randn(1 << 20, device="cuda:0"),
                    "bf16": torch.randn(999, device="cuda:0").bfloat16(),
                    "strided": torch.randn(64, 32, device="cuda:0").t(),
                    "cpu": torch.arange(100_000), "np": np.arange(50_000), "meta": {"step": 3}}
            back = q.call(1, "echo", sent, timeout=120)
            res["ok"] = all(torch.equal(back[k].cpu(), sent[k].cpu()) for k in ("gpu", "bf16", "strided", "cpu"))
            res["mixed_ok"] = (back["gpu"].is_cuda and back["cpu"].device.type == "cpu"
                               and bool((back["np"] == sent["np"]).all()) and back["meta"] == {"step": 3})
            q.publish("done", 1)
        res["placed"] = q.stats().cuda.get("placed", 0)
    return res
