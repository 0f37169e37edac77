"""The cuda_ipc path's host-side rules, on any machine (no GPU needed): the
checks on a peer's pool description and descriptors (all made before any CUDA call), the offer
protocol, release batching, options, and hostile CUDA frames between real nng nodes. The GPU
half runs in tests/test_cuda.py."""

from __future__ import annotations

import pytest

import mq
from mq.datapaths.nvlink import cuda_ipc
from mq.wire.codec import GPU_POOL, MSG
from mq.datapaths.nvlink.cuda_ipc import EVENTS, HANDLE_BYTES, PeerPools, check_pool_info
from mq.errors import ProtocolError
from mq.datapaths.nvlink.path import GpuPath
from mq.node.lifecycle import Lifecycle
from mq.node.peers import Peer, PeerTable
from mq.routing import Route
from mq.datapaths.base import ReleaseQueue
from mq.testing import wait_until

pytestmark = pytest.mark.timeout(60)

UUID = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
MB = 1 << 20


# ---------------------------------------------------------------------- pool descriptions
def _info(**kw):
    info = {"pool": 1, "uuid": UUID, "size": 64 * MB, "handle": b"h" * HANDLE_BYTES,
            "events": [b"e" * HANDLE_BYTES] * EVENTS, "pid": 4242, "incarnation": "abc"}
    info.update(kw)
    return info


def test_a_good_pool_description_passes():
    check_pool_info(_info(), 1, 4242, {UUID})


@pytest.mark.parametrize("change, match", [
    ({"pid": 1}, "owner pid"),  # a handle naming a third process: never opened
    ({"pid": True}, "owner pid"),
    ({"uuid": "GPU-bbbbbbbb"}, "not one the peer announced"),
    ({"uuid": 5}, "not one the peer announced"),
    ({"handle": b"h" * 63}, "64 bytes"),
    ({"handle": "h" * 64}, "64 bytes"),
    ({"events": []}, "event handles"),
    ({"events": [b"e" * 64] * 65}, "event handles"),
    ({"events": [b"e" * 65]}, "event handles"),
    ({"size": 100}, "size"),
    ({"size": 1 << 50}, "size"),
    ({"size": 64.0 * MB}, "size"),
    ({"pool": 0}, "pool id"),
    ({"pool": -1}, "pool id"),
    ({"pool": 2 ** 64}, "pool id"),
    ({"incarnation": 7}, "incarnation"),
    ({"extra": 1}, "exactly"),
])
def test_hostile_pool_descriptions_are_refused_before_any_cuda_call(change, match):
    with pytest.raises(ProtocolError, match=match):
        check_pool_info(_info(**change), 1, 4242, {UUID})


def test_a_pool_description_must_be_a_map_with_every_field():
    for bad in ("junk", None, [1], {k: v for k, v in _info().items() if k != "pid"}):
        with pytest.raises(ProtocolError):
            check_pool_info(bad, 1, 4242, {UUID})


def _pools_with_one_open(size: int = 64 * MB) -> PeerPools:
    """A reader with one (fake) opened pool: descriptors are checked against it on the host;
    the checks must refuse every bad one before anything touches CUDA."""
    pools = PeerPools(1, 4242, [UUID], lambda *a: None)
    pools._pools[1] = cuda_ipc._Opened(_info(size=size), 0, 1 << 40, [object()] * EVENTS, local=True)
    return pools


@pytest.mark.parametrize("desc", [
    ["cuda", 1, 1, 0, 64, EVENTS],  # event index past the ring
    ["cuda", 1, 1, 64 * MB - 256, 512, 0],  # past the end
    ["cuda", 1, 1, 3, 64, 0],  # unaligned
    ["cuda", 1, 1, -256, 64, 0],  # negative offset
    ["cuda", 1, 1, 0, 0, 0],  # empty
    ["cuda", 1, 1, 0, 64.0, 0],  # not an int
    ["cuda", 1, 1, 0, True, 0],  # a bool is no int here
    ["cuda", 1, 1, 0, 1 << 70, 0],  # huge
    ["cuda", 2, 1, 0, 64, 0],  # a pool the peer never offered
    ["cuda", 1, 1, 0, 64],  # short
    ["shm", 1, 1, 0, 64, 0],  # wrong tag
    "junk",
])
def test_hostile_descriptors_are_refused_and_counted(desc):
    pools = _pools_with_one_open()
    with pytest.raises(ProtocolError):
        pools.view(desc)
    assert pools.refused == 1 and pools._pools[1].live == 0


def test_a_pool_described_twice_differently_is_refused_and_a_closed_reader_refuses_all():
    pools = _pools_with_one_open()
    with pytest.raises(ProtocolError, match="twice"):
        pools.open(_info(size=128 * MB))
    pools.open(_info())  # the same description again: nothing to do
    pools.close()
    with pytest.raises(ProtocolError, match="closed"):
        pools.view(["cuda", 1, 1, 0, 64, 0])


# ---------------------------------------------------------------------- releases
class _Event:
    def __init__(self) -> None:
        self.waited = False

    def synchronize(self) -> None:
        self.waited = True


def test_cuda_releases_wait_for_the_receivers_gpu_work_and_batch_per_peer():
    rq = ReleaseQueue()
    events = [_Event() for _ in range(3)]
    rq.put(1, ("cuda", 5), 10, events[0])
    rq.put(1, ("cuda", 5), 10, events[1])
    rq.put(2, ("cuda", 5), 11, events[2])
    rq.put(1, 3, 4)  # a shm release beside them
    out = rq.take(1.0)
    assert all(e.waited for e in events)
    assert sorted(out[1], key=str) == sorted([["cuda", 5, 10, 2], [3, 4, 1]], key=str)
    assert out[2] == [["cuda", 5, 11, 1]]


# ---------------------------------------------------------------------- the offer protocol
def _path(route_gpu: str = "nvlink") -> tuple[GpuPath, list]:
    table = PeerTable(0, Lifecycle(), None)
    table.by_id[1] = Peer(1, route=Route(kind="shm", gpu=route_gpu, reason="test"),
                          info={"locality": {"pid": 4242, "gpus": [{"index": 0, "uuid": UUID}]}})
    sent: list = []
    path = GpuPath(0, table, lambda peer, payload, timeout: sent.append((peer, payload)),
                   lambda *a: None, enabled=True, pool_bytes=None, incarnation="x")
    return path, sent


def test_an_unsolicited_or_malformed_gpu_pool_frame_is_a_protocol_error():
    path, _ = _path()
    for payload in ({"verdict": 1, "error": None}, "junk", {"offer": {}, "more": 1}, {}):
        with pytest.raises(ProtocolError):
            path.on_frame(1, payload)


def test_an_offer_over_a_route_that_is_not_nvlink_gets_a_refusing_verdict():
    path, sent = _path(route_gpu="shm")
    path.on_frame(1, {"offer": _info()})
    assert wait_until(lambda: sent, timeout=5)
    peer, verdict = sent[0]
    assert peer == 1 and verdict["verdict"] == 1 and "do not take nvlink" in verdict["error"]


def test_a_hostile_offer_gets_a_refusing_verdict_and_opens_nothing():
    path, sent = _path()
    path.on_frame(1, {"offer": _info(pid=1)})
    assert wait_until(lambda: sent, timeout=5)
    assert "owner pid" in sent[0][1]["error"]
    assert path._peers.get(1).readers["cuda"].refused == 1 and path._peers.get(1).readers["cuda"].opens == 0


def test_a_failed_verdict_stages_gpu_payloads_and_says_why_in_the_route():
    path, _ = _path()
    path._asked[(1, 3)] = 0.0
    path.on_frame(1, {"verdict": 3, "error": "cuIpcOpenMemHandle failed: CUDA error 1", "open_ms": 1.0})
    route = path._peers.get(1).route
    assert route.gpu == "shm" and "cuIpcOpenMemHandle failed" in route.reason
    with pytest.raises(ProtocolError):  # a second verdict for the same offer
        path.on_frame(1, {"verdict": 3, "error": None})


# ---------------------------------------------------------------------- options
def test_cuda_options_are_checked():
    with pytest.raises(mq.ConfigError, match="cuda must be True or False"):
        mq.create("nng", 0, cuda="yes")
    with pytest.raises(mq.ConfigError, match="cuda_pool_bytes"):
        mq.create("nng", 0, cuda_pool_bytes=-1)
    with pytest.raises(mq.ConfigError, match="cuda_pool_bytes"):
        mq.create("nng", 0, cuda_pool_bytes="4g")
    with pytest.raises(mq.ConfigError, match="cuda_inline_max"):
        mq.create("nng", 0, cuda_inline_max=-1)
    with pytest.raises(mq.ConfigError, match="cuda_inline_max"):
        mq.create("nng", 0, cuda_inline_max=1.5)
    q = mq.create("nng", 0)
    with q:
        with pytest.raises(mq.ConfigError, match="device must be"):
            q.alloc(4, "float32", device="tpu:0")
        try:
            import torch
        except ImportError:
            return
        if not torch.cuda.is_available():
            with pytest.raises(mq.ConfigError, match="no CUDA pool"):
                q.alloc(4, torch.float32, device="cuda:0")


# ---------------------------------------------------------------------- hostile frames, real nodes
def test_forged_cuda_descriptors_and_offers_from_a_peer_are_dropped_and_both_keep_working():
    import numpy as np

    a = mq.create("nng", 0, "a", listen_to="tcp://127.0.0.1:0", timeout=10)
    with a:
        b = mq.create("nng", 1, "b", attach_to=[a.addresses["tcp"]], timeout=10)
        with b:
            b.subscribe("data")
            a.wait_for_subscribers("data", 1, timeout=10)
            frame = a._sender.encode(MSG, "data", np.zeros(8, np.uint8))
            for desc in (["cuda", 1, 1, 0, 8, 0], ["cuda", "x"], ["cuda"]):
                a._sender.send_raw(1, frame.with_descriptors({0: desc}), 5)
            a._sender.send_control(1, GPU_POOL, {"verdict": 9, "error": None}, 5)  # never asked
            a._sender.send_control(1, GPU_POOL, {"offer": _info()}, 5)  # no nvlink route here
            assert wait_until(lambda: b.stats().dropped_malformed >= 4)
            a.send(1, "data", np.arange(5))
            assert list(b.recv(timeout=10).payload) == [0, 1, 2, 3, 4]
            # b refused the offer with a verdict a never asked for: counted there, nothing else
            assert wait_until(lambda: a.stats().dropped_malformed >= 1)
            b.send(0, "x", 1)
            a.subscribe("x")


def test_a_tensor_larger_than_the_pool_is_staged_and_the_route_says_so_but_stays_nvlink():
    path, _ = _path()

    class _Pool:  # the bookkeeping face of a 1 MiB DevicePool: no CUDA needed to refuse
        max_bytes = MB

        def fits(self, n: int) -> bool:
            return 0 < n <= self.max_bytes

    class _Big:  # what place() reads of a CUDA tensor
        is_cuda = True
        device = type("D", (), {"index": 0})()

        def data_ptr(self) -> int:
            return 1 << 40

    path.pools[0] = _Pool()
    assert path.ready([1], [_Big()], [2 * MB], [0], deadline=0.0) == []
    route = path._peers.get(1).route
    assert route.gpu == "nvlink" and "raise cuda_pool_bytes" in route.reason
    assert path.stats["staged_frames"] == 1
