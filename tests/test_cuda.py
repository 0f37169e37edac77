"""The cuda_ipc data path on a real GPU: the GPU path's failure modes, with two
(or four) real processes on one GPU. Every test here carries the ``cuda`` marker and skips
without a GPU; `bash scripts/gpu-check OUT` runs them on a GPU machine. The host-side rules
(descriptor and pool checks, slots, the offer protocol, routes) run on CPU in
tests/test_cuda_ipc.py."""

from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
import sys

import pytest

import mq
from mq.wire.codec import GPU_POOL, MSG
from mq.testing import read_line, stop_processes, wait_until

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(120)]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 1 << 20
DEV = "cuda:0"


def _spawn(node_id: int, address: str, mode: str = "keep", pool_bytes: int = 64 * MB,
           pre: list[str] | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([*(pre or []), sys.executable, "-m", "tests.jobs.cuda_peer", str(node_id), address,
                             mode, str(pool_bytes)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})})


def _line(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    return read_line(proc, timeout)


_stop = stop_processes


def _dev_shm() -> set[str]:
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {n for n in names if not n.startswith("sem.mp-")}


@pytest.fixture(params=[None], ids=["default"])
def learner(request):
    extra = {"cuda_inline_max": request.param} if request.param is not None else {}
    q = mq.create("nng", 0, "learner", timeout=20, cuda_pool_bytes=64 * MB, **extra)
    with q:
        yield q


@pytest.fixture
def peer(learner):
    p = _spawn(1, learner.addresses["tcp"])
    try:
        assert _line(p) == "ready nvlink"
        learner.wait_for_subscribers("data", 1, timeout=30)
        yield p
    finally:
        _stop(p)


def _close(a, b) -> bool:
    return bool(torch.equal(a.cpu(), b.cpu())) if a.dtype in (torch.bool, torch.int64) else \
        bool(torch.allclose(a.double().cpu(), b.double().cpu()))


# 1 ------------------------------------------------------------------ round trips on random data
def _payloads() -> dict[str, "torch.Tensor"]:
    g = torch.Generator(device=DEV).manual_seed(0)
    base = torch.randn(64, 48, device=DEV, generator=g)
    return {
        "bf16": torch.randn(1000, device=DEV, generator=g).bfloat16(),
        "int64": torch.randint(-1 << 40, 1 << 40, (3, 5, 7), device=DEV, generator=g),
        "bool": torch.rand(333, device=DEV, generator=g) > 0.5,
        "scalar": torch.tensor(3.25, device=DEV),
        "empty": torch.empty(0, 4, device=DEV),
        "strided": base.t(),
        "offset": base[10:20, 3:9],
        "big": torch.randn(4 * MB, device=DEV, generator=g),
    }


@pytest.mark.parametrize("learner", [None, 0], ids=["small-staged", "all-by-descriptor"], indirect=True)
def test_round_trips_of_every_shape_and_dtype_over_nvlink(learner, peer):
    sent = _payloads()
    back = learner.call(1, "echo", sent, timeout=60)
    assert learner.routes()[1].gpu == "nvlink"
    for name, t in sent.items():
        got = back[name]
        assert got.device.type == "cuda" and got.dtype == t.dtype and got.shape == t.shape, name
        assert _close(got, t), name
    cuda = learner.stats().cuda
    by_descriptor = 1 if learner._sender.gpu.inline_max > 1 else 7  # every non-empty tensor, or "big"
    assert cuda["placed"] == by_descriptor and cuda["verdicts_ok"] == 1 and cuda["peer_opens"] == 1


def test_round_trips_over_torchrpc_cuda_use_descriptors_and_no_tensorpipe_cuda_ipc():
    import torchrpc_peer
    from mq.launch import free_port
    from mq.testing import Spawned

    with Spawned(torchrpc_peer.cuda_roundtrip, 2, f"tcp://127.0.0.1:{free_port()}") as g:
        res = g.results(timeout=150)
        g.join()
    lead = res[0]
    assert lead["route"] == "nvlink", lead["reason"]
    assert "cuda_ipc" not in lead["channels"]
    assert lead["ok"] and lead["mixed_ok"]
    assert lead["placed"] > 0 and res[1]["placed"] > 0  # both ways by descriptor


# 2, 3 --------------------------------------------------------------------------- ordering
def test_a_write_after_send_does_not_reach_the_receiver(learner, peer):
    x = torch.ones(8 * MB, device=DEV)
    torch.cuda._sleep(int(2e8))  # the caller's stream is busy: the copy must wait behind it
    learner.send(1, "data", x)
    x.fill_(2.0)  # queued after the copy on the caller's stream
    sums = learner.call(1, "sums", None, timeout=30)
    assert sums[0][0] == 8 * MB and sums[0][1] == DEV


def test_a_slow_copy_is_waited_for_by_the_receiver(learner, peer):
    learner.send(1, "data", torch.zeros(MB, device=DEV))  # makes the pool
    pool = learner._sender.gpu.pools[0]
    with torch.cuda.stream(pool.stream):
        torch.cuda._sleep(int(5e8))  # the copy lands ~0.3 s late
    learner.send(1, "data", torch.full((4 * MB,), 5.0, device=DEV))
    sums = learner.call(1, "sums", None, timeout=30)
    assert sums[1][0] == 5.0 * 4 * MB and learner.stats().cuda["placed"] == 2


# 4 ------------------------------------------------------------------ release after async use
def test_a_slot_comes_back_only_after_the_receivers_gpu_work_on_it(learner):
    p = _spawn(1, learner.addresses["tcp"])
    try:
        assert _line(p) == "ready nvlink"
        learner.wait_for_subscribers("data", 1, timeout=30)
        learner.send(1, "data", torch.full((8 * MB,), 3.0, device=DEV))  # 32 MiB of the 64 MiB pool
        assert wait_until(lambda: learner.call(1, "count", timeout=5) == 1)
        assert learner.call(1, "use_async", None, timeout=10) == "queued"
        # Refill the whole pool: the first slot is reused only after the peer's kernel read it.
        for _ in range(4):
            learner.send(1, "data", torch.full((8 * MB,), 9.0, device=DEV), timeout=20)
            learner.call(1, "drop", None, timeout=10)
        assert learner.call(1, "out_sum", None, timeout=10) == 6.0 * 8 * MB
    finally:
        _stop(p)


# 5 ---------------------------------------------------------------------------- backpressure
def test_held_views_are_backpressure_then_a_timeout_naming_the_holder(learner, peer):
    blob = torch.ones(5 * MB, device=DEV)  # 20 MiB: three fit the 64 MiB pool
    sent = 0
    with pytest.raises(mq.Timeout, match=r"CUDA pool .* held by node 1"):
        for _ in range(5):
            learner.send(1, "data", blob, timeout=1.0)
            sent += 1
    assert sent == 3
    assert learner.call(1, "drop", None, timeout=10) == "dropped"
    learner.send(1, "data", blob, timeout=10)
    assert wait_until(lambda: learner.call(1, "count", timeout=5) == 1)


# 6 ----------------------------------------------------------------------------------- fan-out
def test_publish_to_three_same_host_subscribers_copies_once(learner):
    peers = [_spawn(n, learner.addresses["tcp"]) for n in (1, 2, 3)]
    try:
        for p in peers:
            assert _line(p) == "ready nvlink"
        learner.wait_for_subscribers("data", 3, timeout=30)
        t = torch.arange(2 * MB, device=DEV, dtype=torch.float32)
        assert learner.publish("data", t) == [1, 2, 3]
        cuda = learner.stats().cuda
        assert cuda["placed"] == 1 and cuda["copied_bytes"] == 8 * MB
        for n in (1, 2, 3):
            assert learner.call(n, "sums", None, timeout=30)[0][0] == float(t.double().sum())
        assert learner.stats().cuda["held_bytes"] >= 8 * MB
        for n in (1, 2):
            learner.call(n, "drop", None, timeout=10)
        assert learner.stats().cuda["held_bytes"] >= 8 * MB  # node 3 still holds it
        learner.call(3, "drop", None, timeout=10)
        assert wait_until(lambda: learner.stats().cuda["held_bytes"] == 0)
    finally:
        _stop(*peers)


# 7 --------------------------------------------------------------------------------- by handle
def test_by_handle_costs_no_copy_and_wait_released_guards_rewrites(learner, peer):
    w = learner.alloc((4 * MB,), torch.float32, device=DEV)
    w.fill_(1.5)
    learner.send(1, "data", w)
    cuda = learner.stats().cuda
    assert cuda["by_handle"] == 1 and cuda.get("copied_bytes", 0) == 0
    with pytest.raises(mq.Timeout, match="still hold"):
        learner.wait_released(w, timeout=0.5)
    assert learner.call(1, "sums", None, timeout=30)[0][0] == 1.5 * 4 * MB
    learner.call(1, "drop", None, timeout=10)
    learner.wait_released(w, timeout=10)
    w.fill_(2.5)  # ours again
    tiny = learner.alloc((16,), torch.int32, device=DEV)  # below cuda_inline_max, still by handle
    learner.send(1, "data", tiny)
    assert learner.stats().cuda["by_handle"] == 2


# 8 ---------------------------------------------------------------- hostile descriptors, pool info
def _forged(learner, descs: dict) -> None:
    frame = learner._sender.encode(MSG, "data", torch.zeros(64, dtype=torch.uint8))
    learner._sender.send_raw(1, frame.with_descriptors(descs), 5)


def test_hostile_descriptors_and_pool_info_are_dropped_counted_and_the_context_survives(learner, peer):
    learner.send(1, "data", torch.ones(MB, device=DEV))  # a real pool, opened by the peer
    pool = learner._sender.gpu.pools[0]
    size = pool.max_bytes
    bad = [
        ["cuda", pool.pool_id, 1, 0, 64, 99],  # event index past the ring
        ["cuda", pool.pool_id, 1, size - 64, 256, 0],  # past the end
        ["cuda", pool.pool_id, 1, 3, 64, 0],  # unaligned
        ["cuda", pool.pool_id, 1, -256, 64, 0],  # negative
        ["cuda", pool.pool_id + 7, 1, 0, 64, 0],  # a pool never offered
        ["cuda", pool.pool_id, 1, 0, 0, 0],  # empty
        ["cuda", pool.pool_id, 1, 0, 64.0, 0],  # a float
        ["cuda", pool.pool_id, 1, 0, True, 0],  # a bool
        ["cuda", pool.pool_id, 1, 0, 1 << 63, 0],  # huge
    ]
    for desc in bad:
        _forged(learner, {0: desc})
    info = pool.info()
    for forged in ({**info, "pid": 1}, {**info, "handle": b"x" * 63}, {**info, "uuid": "GPU-not-the-peers"},
                   {**info, "size": 7}, {**info, "events": []}, {**info, "extra": 1}, "junk"):
        learner._sender.send_control(1, GPU_POOL, {"offer": forged}, 5)
    assert wait_until(lambda: learner.call(1, "stats", None, timeout=5)["dropped_malformed"] >= len(bad)), \
        learner.call(1, "stats", None, timeout=5)
    stats = learner.call(1, "stats", None, timeout=5)
    assert stats["cuda"]["descriptors_refused"] >= len(bad) - 1, stats  # the unknown pool counts too
    # the peer's CUDA context survived: a good message still arrives intact
    learner.call(1, "drop", None, timeout=10)
    learner.send(1, "data", torch.full((MB,), 4.0, device=DEV))
    sums = learner.call(1, "sums", None, timeout=30)
    assert sums[0][0] == 4.0 * MB, (sums, learner.routes()[1])


# 9 --------------------------------------------------------------------------------- SIGKILL
def test_sigkilled_receiver_gives_its_slots_back(learner):
    p = _spawn(1, learner.addresses["tcp"], "hold")
    try:
        assert _line(p) == "ready nvlink"
        learner.wait_for_subscribers("data", 1, timeout=30)
        learner.send(1, "data", torch.full((4 * MB,), 9, dtype=torch.uint8, device=DEV))
        assert _line(p) == "got 9"
        assert learner.stats().cuda["held_bytes"] >= 4 * MB
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        assert wait_until(lambda: 1 not in learner.peers(), timeout=15)
        assert wait_until(lambda: learner.stats().cuda["held_bytes"] == 0)
    finally:
        _stop(p)


def test_sigkilled_sender_is_peer_lost_and_a_new_incarnation_works(learner):
    learner.subscribe("data")
    p = _spawn(1, learner.addresses["tcp"], "send")
    try:
        assert _line(p) == "ready nvlink"
        msg = learner.recv(timeout=30)
        assert msg.payload.is_cuda and int(msg.payload[0]) == 7
        assert _line(p) == "sent"
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        assert wait_until(lambda: 1 not in learner.peers(), timeout=15)
        del msg  # dropping a view of a dead sender's pool does not crash
        gc.collect()
        torch.cuda.synchronize()
    finally:
        _stop(p)
    p = _spawn(1, learner.addresses["tcp"], "send")
    try:
        assert _line(p) == "ready nvlink"
        msg = learner.recv(timeout=30)
        assert int(msg.payload[-1]) == 7
        del msg
    finally:
        _stop(p)


# 10 --------------------------------------------------------------------------------- routes
def _unshare_works(*flags: str) -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", *flags, "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _unshare_works("--pid", "--fork"), reason="needs root and unshare(1)")
def test_another_pid_namespace_is_staged_and_says_why(learner):
    p = _spawn(1, learner.addresses["tcp"], pre=["unshare", "--pid", "--fork"])
    try:
        assert _line(p) != "ready nvlink"
        learner.wait_for_subscribers("data", 1, timeout=30)
        assert "PID namespace" in learner.routes()[1].reason
        learner.send(1, "data", torch.full((1000,), 2.0, device=DEV))
        # Staged through host, it lands on the peer's GPU when CUDA works in its namespace.
        lands_on = DEV if learner.call(1, "mem", None, timeout=30)[1] > 0 else "cpu"
        assert learner.call(1, "sums", None, timeout=30)[0][:2] == [2000.0, lands_on]
        assert not learner.stats().cuda.get("placed")
    finally:
        _stop(p)


def test_a_peer_without_a_visible_gpu_gets_staged_tensors_on_the_cpu(learner):
    p = _spawn(1, learner.addresses["tcp"], env={"CUDA_VISIBLE_DEVICES": ""})
    try:
        assert _line(p) != "ready nvlink"
        learner.wait_for_subscribers("data", 1, timeout=30)
        learner.send(1, "data", torch.full((1000,), 2.0, device=DEV))
        assert learner.call(1, "sums", None, timeout=30)[0][:2] == [2000.0, "cpu"]
    finally:
        _stop(p)


def test_expandable_segments_on_both_sides_still_take_nvlink():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    code = ("import mq, torch, sys;"
            "q = mq.create('nng', 0, 'learner', timeout=20, cuda_pool_bytes=64 << 20);"
            "q.listen(); print(q.addresses['tcp'], flush=True);"
            "q.wait_for_subscribers('data', 1, timeout=60);"
            "q.send(1, 'data', torch.full((1 << 20,), 3.0, device='cuda:0'));"
            "print(q.call(1, 'sums', None, timeout=30)[0][0], q.routes()[1].gpu, q.stats().cuda['placed'], flush=True);"
            "q.stop()")
    lead = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    p = None
    try:
        address = _line(lead)
        p = _spawn(1, address, env=env)
        assert _line(p) == "ready nvlink"
        assert _line(lead).split() == [str(3.0 * (1 << 20)), "nvlink", "1"]
    finally:
        _stop(*([lead] + ([p] if p else [])))


# 12 ------------------------------------------------------------------- nothing leaks over time
def test_ten_thousand_messages_leave_nothing_held_or_leaked(learner, peer):
    before_shm = _dev_shm()
    small = torch.ones(16 * 1024, device=DEV)  # 64 KiB: the smallest that goes by descriptor
    learner.send(1, "data", small)
    learner.call(1, "drop", None, timeout=10)
    free_before = learner.call(1, "mem", None, timeout=10)[0]
    for i in range(10_000):
        learner.send(1, "data", small)
        if i % 500 == 499:
            learner.call(1, "drop", None, timeout=10)
    # Subscriber callbacks and call handlers run on different threads: let every message land
    # before the last drop.
    assert wait_until(lambda: learner.call(1, "received", None, timeout=10) == 10_001, timeout=60)
    learner.call(1, "drop", None, timeout=10)
    assert wait_until(lambda: learner.stats().cuda["held_bytes"] == 0, timeout=20)
    peer_stats = learner.call(1, "stats", None, timeout=10)["cuda"]
    assert peer_stats["peer_opens"] == 1
    assert learner.stats().cuda["verdicts_ok"] == 1
    free_after = learner.call(1, "mem", None, timeout=10)[0]
    assert abs(free_after - free_before) <= 64 * MB
    assert _dev_shm() == before_shm
