"""What every data path shares (mq.datapaths.base), on any machine: the slot table (first-fit
placement in one region, as the CUDA pool uses it; slots added by the pool, as shm's segments
are), holders counted per peer, stale and forged releases, backpressure and wait_released; and
that each registered path implements the one interface on that one table."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from mq.datapaths.nvlink import cuda_ipc

from mq.datapaths import base as datapath

from mq.datapaths.shm import pool as shm
from mq.datapaths.base import ANY_GEN, DataPath, Slot, SlotTable, path_class, tag_of
from mq.errors import Timeout

pytestmark = pytest.mark.timeout(60)

ALIGN = 256


# ---------------------------------------------------------------------- a region placed first fit (cuda_ipc; rdma next)
def test_slots_are_aligned_first_fit_and_coalesce_when_freed():
    t = SlotTable(4 * ALIGN)
    a, b, c = t.take(1), t.take(ALIGN + 1), t.take(ALIGN)
    assert [s.offset for s in (a, b, c)] == [0, ALIGN, 3 * ALIGN]
    assert t.take(1) is None  # full
    for s in (a, b, c):
        t.hold(s, [7])
    assert t.held_by() == {7: 4 * ALIGN}
    assert t.release(7, b.slot_id) and t.release(7, a.slot_id)
    assert t.free == [(0, 3 * ALIGN)]  # the two neighbours became one free range
    assert t.take(3 * ALIGN).offset == 0


def test_a_slot_is_free_only_when_every_holder_released_it():
    t = SlotTable(ALIGN)
    s = t.take(10)
    t.hold(s, [1, 2])
    t.hold(s, [1])
    assert t.release(1, s.slot_id, 2)
    assert t.take(1) is None
    assert t.release(2, s.slot_id)
    assert t.take(1) is not None


@pytest.mark.parametrize("forged", [("slot", 99), ("count", 0), ("count", 5), ("count", 1.0), ("slot", "1"),
                                    ("peer", 3)])
def test_forged_and_stale_releases_change_nothing(forged):
    t = SlotTable(ALIGN)
    s = t.take(10)
    t.hold(s, [1])
    what, value = forged
    args = {"peer": 1, "slot": s.slot_id, "count": 1}
    args[what] = value
    assert not t.release(args["peer"], args["slot"], args["count"])
    assert s.holders == {1: 1}


def test_a_lost_peer_gives_back_what_it_held_and_pinned_slots_stay():
    t = SlotTable(2 * ALIGN)
    s, pinned = t.take(1), t.take(1)
    pinned.pinned = True
    t.hold(s, [4])
    t.hold(pinned, [4])
    t.peer_gone(4)
    assert s.slot_id not in t.slots and pinned.slot_id in t.slots
    assert t.owner(pinned.offset + 8, 16) is pinned and t.owner(s.offset, 1) is None
    t.unpin(pinned)
    assert t.free == [(0, 2 * ALIGN)]


# ---------------------------------------------------------------------- slots added by the pool (shm)
def _shm_like() -> tuple[SlotTable, Slot, list]:
    seen: list = []
    t = SlotTable(on_released=seen.append, stats={})
    s = t.add(Slot(t.next_id(), 4096, gen=3))
    return t, s, seen


def test_a_reused_slot_checks_the_generation_and_stays_in_the_table():
    t, s, seen = _shm_like()
    t.hold(s, [1, 2])
    assert not t.release(1, s.slot_id, 1, gen=2)  # an earlier generation: stale
    assert t.stats["stale_releases"] == 1 and s.holders == {1: 1, 2: 1}
    assert t.release(1, s.slot_id, 1, gen=3) and seen == []
    assert t.release(2, s.slot_id, 1, gen=3)
    assert seen == [s] and s.free and t.slots == {s.slot_id: s}  # reusable, not freed
    assert t.free == []  # no region


@pytest.mark.parametrize("forged", [("slot", True), ("slot", 1.0), ("count", True), ("count", None),
                                    ("gen", None), ("gen", "3"), ("peer", 9)])
def test_forged_releases_of_a_reused_slot_change_nothing(forged):
    t, s, _ = _shm_like()
    t.hold(s, [1])
    args = {"peer": 1, "slot": s.slot_id, "count": 1, "gen": 3}
    args[forged[0]] = forged[1]
    assert not t.release(args["peer"], args["slot"], args["count"], gen=args["gen"])
    assert s.holders == {1: 1} and t.stats["stale_releases"] == 1


def test_a_region_slot_is_its_own_generation():
    t = SlotTable(ALIGN)
    s = t.take(1)
    t.hold(s, [1])
    assert t.release(1, s.slot_id, 1, gen=ANY_GEN) and t.take(ALIGN).slot_id != s.slot_id


def test_a_full_pool_waits_for_a_release_then_times_out_naming_what_holds_it():
    t = SlotTable(ALIGN, stats={})
    s = t.take(ALIGN)
    t.hold(s, [5])
    threading.Timer(0.2, t.release, (5, s.slot_id)).start()
    got = t.wait_for(lambda: t.take(ALIGN), 5.0, lambda: "full")  # (waits without the table's lock)
    assert got.offset == 0 and t.stats["waits"] == 1
    t.hold(got, [6])
    t0 = time.monotonic()
    with pytest.raises(Timeout, match="held by node 6"):
        t.wait_for(lambda: t.take(1), 0.2, lambda: f"held by node {sorted(got.holders)[0]}")
    assert time.monotonic() - t0 >= 0.2


def test_wait_released_returns_when_the_last_holder_lets_go_and_names_the_holders_otherwise():
    t, s, _ = _shm_like()
    s.pinned = True  # a buffer from alloc(), sent by handle
    t.hold(s, [3, 4])
    with pytest.raises(Timeout, match=r"nodes \[3, 4\] still hold views of this buffer"):
        t.wait_released(lambda: s, 0.1, "this buffer")
    threading.Timer(0.1, t.peer_gone, (3,)).start()
    threading.Timer(0.2, t.release, (4, s.slot_id, 1), {"gen": 3}).start()
    t.wait_released(lambda: s, 5.0, "this buffer")
    assert not s.holders and s.slot_id in t.slots  # pinned: still the user's


# ---------------------------------------------------------------------- one table, one interface
def test_both_pools_keep_their_holders_in_the_one_shared_table():
    assert cuda_ipc.SlotTable is SlotTable  # DevicePool's table (no GPU here to make one)
    pool = shm.Pool(max_bytes=1 << 20, inline_max=1024, label="test")
    try:
        assert type(pool._slots) is SlotTable and pool._cond is pool._slots.cond
        desc = pool.place(np.ones(4096, np.uint8), [1], timeout=1)
        assert pool._slots.held_by() == {1: pool._slots.slots[desc[0]].size}
        assert not pool.release(1, desc[0], desc[2] + 1) and pool.stats["stale_releases"] == 1
        assert pool.release(1, desc[0], desc[2])
        assert pool._slots.held_by() == {}
    finally:
        pool.close()


def test_every_registered_path_implements_the_interface():
    interface = [n for n, v in vars(DataPath).items() if callable(v) and not n.startswith("_")
                 and n not in ("open", "ready")]
    for route in datapath.PATHS:
        cls = path_class(route)
        assert issubclass(cls, DataPath) and cls.route == route
        missing = [n for n in interface if getattr(cls, n) is getattr(DataPath, n)]
        assert not missing, f"the {route} path does not implement {missing}"
    tags = [path_class(r).tag for r in datapath.PATHS]
    assert len(set(tags)) == len(tags)


def test_descriptor_tags():
    assert tag_of([1, 2, 3, 0, 8]) is None and tag_of(["cuda", 1, 2, 0, 8, 0]) == "cuda"
    assert tag_of("junk") is None and tag_of([]) is None


# ---------------------------------------------------------------------- the sender asks each peer's path
class _Buf:
    def __init__(self, name: str, cuda: bool = False):
        self.name, self.is_cuda = name, cuda

    def __repr__(self) -> str:
        return self.name


class _Frame:
    """What Sender._data_paths reads of a frame: its buffers, sizes, staging and descriptors."""

    def __init__(self, buffers: list, sizes: list[int], tag: str = "frame"):
        self.buffers, self.sizes, self.tag = buffers, sizes, tag
        self.gpu = any(getattr(b, "is_cuda", False) for b in buffers)
        self.stagings: list = []

    def staged(self, skip: Any = ()) -> "_Frame":
        self.stagings.append(sorted(skip))
        return _Frame([_Buf(f"host-{b}") if getattr(b, "is_cuda", False) and i not in skip else b
                       for i, b in enumerate(self.buffers)], self.sizes, f"staged{sorted(skip)}")

    def with_descriptors(self, descs: dict) -> tuple:
        return (self.tag, dict(sorted(descs.items())))


class _Path(DataPath):
    def __init__(self, route: str, device: str, tag: str | None, not_ready: tuple = ()):
        self.route, self.device, self.tag, self.not_ready = route, device, tag, not_ready
        self.placed: list = []
        self.unheld: list = []

    def takes(self, buffers, sizes):
        on_device = lambda b: getattr(b, "is_cuda", False) == (self.device == "cuda")  # noqa: E731
        return [i for i, b in enumerate(buffers) if sizes[i] >= 100 and on_device(b)]

    def ready(self, peers, buffers, sizes, indices, deadline):
        return [p for p in peers if p not in self.not_ready]

    def place(self, peers, buffers, indices, deadline, descs=None):
        for i in indices:
            self.placed.append((repr(buffers[i]), tuple(peers)))
            descs[i] = [self.tag, repr(buffers[i])]
        return descs

    def unhold(self, descs, peers):
        self.unheld.append((sorted(descs), sorted(peers)))


def _sender_with(cpu: _Path, gpu: _Path, peers: dict) -> Any:
    from mq.node.sender import Sender

    s = object.__new__(Sender)  # only what choosing the data paths reads
    s._peer_get = peers.get
    s._gpu_paths = {gpu.route: gpu}
    s._stages_gpu = True
    return s


def test_the_sender_asks_each_peers_chosen_path_one_copy_per_path():
    from types import SimpleNamespace as NS

    from mq.node.sender import _Held

    cpu, gpu = _Path("shm", "cpu", None), _Path("nvlink", "cuda", "cuda", not_ready=(2,))
    route = lambda g: NS(gpu=g)  # noqa: E731
    peers = {1: NS(route=route("nvlink"), cpu_path=cpu),  # GPU by descriptor, CPU by shm
             2: NS(route=route("nvlink"), cpu_path=cpu),  # nvlink not ready: GPU staged, then by shm
             3: NS(route=route("shm"), cpu_path=cpu),  # no GPU path: staged, then by shm
             4: NS(route=route("tcp"), cpu_path=None)}  # inline, GPU staged
    sender = _sender_with(cpu, gpu, peers)
    frame = _Frame([_Buf("big"), _Buf("gbig", cuda=True), _Buf("small"), _Buf("gsmall", cuda=True)],
                   [500, 500, 10, 10])
    frames = sender._data_paths([1, 2, 3, 4], frame, time.monotonic() + 5, _Held())
    # one device copy for peer 1, one host copy of each big CPU buffer for the shm peers,
    # one copy of the staged GPU buffer for the shm peers that did not get it by descriptor
    assert gpu.placed == [("gbig", (1,))]
    assert cpu.placed == [("big", (1, 2, 3)), ("host-gbig", (2, 3))]
    assert frames[1] == ("staged[1]", {0: [None, "big"], 1: ["cuda", "gbig"]})
    assert frames[2] == frames[3] == ("staged[]", {0: [None, "big"], 1: [None, "host-gbig"]})
    assert frames[4].tag == "staged[]" and frames[4].buffers[1].name == "host-gbig"
    assert frames[2] is frames[3]  # peers on the same paths share one frame


def test_a_failed_place_gives_back_what_the_frame_held_on_every_path():
    from types import SimpleNamespace as NS

    from mq.node.sender import _Held

    class _Full(_Path):
        def place(self, peers, buffers, indices, deadline, descs=None):
            descs[indices[0]] = [self.tag, "first"]
            raise Timeout("full")

    cpu, gpu = _Full("shm", "cpu", None), _Path("nvlink", "cuda", "cuda")
    peers = {1: NS(route=NS(gpu="nvlink"), cpu_path=cpu), 2: NS(route=NS(gpu="shm"), cpu_path=cpu)}
    sender = _sender_with(cpu, gpu, peers)
    frame = _Frame([_Buf("big"), _Buf("gbig", cuda=True)], [500, 500])
    with pytest.raises(Timeout):
        sender._data_paths([1, 2], frame, time.monotonic() + 5, _Held())
    assert gpu.unheld == [([1], [1])] and cpu.unheld == [([0], [1, 2])]
