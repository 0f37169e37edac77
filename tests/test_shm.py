"""The shm data path: slots, release on drop, backpressure from held views, by-handle sends,
hostile descriptors, and no leak when either side is SIGKILLed; with real processes."""

from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import mq
from mq.testing import read_line, stop_processes, wait_until
from mq.errors import ProtocolError
from mq.datapaths.base import ReleaseQueue
from mq.datapaths.shm.pool import Pool, PoolReader

pytestmark = pytest.mark.timeout(90)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 1 << 20


# ---------------------------------------------------------------------- one process: pool + reader
@pytest.fixture
def pool():
    p = Pool(max_bytes=8 * MB, inline_max=1024, label="test")
    yield p
    p.close()


@pytest.fixture
def reader(pool):
    releases = ReleaseQueue()
    r = PoolReader(1, pool.probe_info(), lambda seg, gen: releases.put(1, seg, gen))
    assert r.probe() is None
    r.releases = releases
    yield r
    r.close()


def test_view_is_zero_copy_and_dropping_it_releases_the_slot(pool, reader):
    data = np.arange(MB, dtype=np.uint8)
    desc = pool.place(data, [1], timeout=1)
    view = reader.view(desc)
    arr = np.frombuffer(view, np.uint8)
    assert np.array_equal(arr, data)
    assert reader.releases.take(0.05) == {}  # still referenced
    del view, arr
    released = reader.releases.take(1.0)
    assert released == {1: [[desc[0], desc[2], 1]]}
    assert pool.release(1, desc[0], desc[2], 1)
    # The slot is free and warm: the next message of that size reuses it (no new segment).
    segments = pool.stats["segments"]
    desc2 = pool.place(data, [1], timeout=1)
    assert desc2[0] == desc[0] and desc2[2] == desc[2] + 1
    assert pool.stats["segments"] == segments


def test_held_views_are_backpressure_then_timeout(pool, reader):
    held = [reader.view(pool.place(np.ones(3 * MB, np.uint8), [1], timeout=1)) for _ in range(2)]
    t0 = time.monotonic()
    with pytest.raises(mq.Timeout, match="held by receivers"):
        pool.place(np.ones(3 * MB, np.uint8), [1], timeout=0.3)
    assert 0.25 <= time.monotonic() - t0 < 2.0
    del held
    for peer, items in reader.releases.take(1.0).items():
        for seg, gen, n in items:
            assert pool.release(peer, seg, gen, n)
    pool.place(np.ones(3 * MB, np.uint8), [1], timeout=1)  # room again


@pytest.mark.parametrize("mutate, match", [
    (lambda d: [d[0] + 1000, d[1], d[2], d[3], d[4]], "not its segment"),
    (lambda d: [d[0] + 1000, 0, d[2], d[3], d[4]], "not an mq pool|cannot be opened"),  # fd 0: not ours
    (lambda d: [d[0], d[1], d[2] + 1, d[3], d[4]], "stale descriptor"),
    (lambda d: [d[0], d[1], d[2], d[3] + 8 * MB, d[4]], "overruns"),
    (lambda d: [d[0], d[1], d[2], -1, d[4]], "overruns"),
    (lambda d: [d[0], d[1], d[2], 0, 1 << 40], "overruns"),
    (lambda d: [d[0], d[1], d[2], d[3]], "malformed"),
    (lambda d: [d[0], d[1], "x", d[3], d[4]], "malformed"),
    (lambda d: {"seg": 1}, "malformed"),
])
def test_hostile_descriptors_are_protocol_errors(pool, reader, mutate, match):
    desc = pool.place(np.ones(MB, np.uint8), [1], timeout=1)
    with pytest.raises(ProtocolError, match=match):
        reader.view(mutate(desc))
    assert np.frombuffer(reader.view(desc), np.uint8).sum() == MB  # the reader still works


def test_forged_and_stale_releases_change_nothing(pool):
    desc = pool.place(np.ones(MB, np.uint8), [1], timeout=1)
    assert not pool.release(2, desc[0], desc[2])       # not a holder
    assert not pool.release(1, desc[0], desc[2] + 1)   # wrong generation
    assert not pool.release(1, desc[0], desc[2], 5)    # more than it holds
    assert not pool.release(1, "x", desc[2])
    assert pool.stats["stale_releases"] == 4
    assert pool.release(1, desc[0], desc[2])


def test_alloc_sends_by_handle_and_guards_writes_until_released(pool, reader):
    w = pool.alloc((256, 1024), np.float32)
    w[:] = 1.5
    desc = pool.place(w, [1], timeout=1)
    assert pool.stats["by_handle"] == 1 and pool.stats["copied_bytes"] == 0
    assert not w.flags.writeable  # shared with a receiver now
    with pytest.raises(ValueError):
        w[0, 0] = 2.0
    view = np.frombuffer(reader.view(desc), np.float32)
    assert view[0] == 1.5
    with pytest.raises(mq.Timeout, match="still hold"):
        pool.wait_released(w, timeout=0.2)
    del view
    for peer, items in reader.releases.take(1.0).items():
        for seg, gen, n in items:
            pool.release(peer, seg, gen, n)
    pool.wait_released(w, timeout=1)
    assert w.flags.writeable
    w[0, 0] = 2.0


def test_alloc_counts_against_the_bound_the_pool_announces(pool):
    # Readers map no more of a pool than its announced bound: alloc() buffers must fit in it.
    assert pool.probe_info()["max_bytes"] == 8 * MB
    with pytest.raises(mq.ConfigError, match="does not fit the shared-memory pool"):
        pool.alloc(9 * MB, np.uint8)
    kept = pool.alloc(6 * MB, np.uint8)
    with pytest.raises(mq.Timeout, match=r"stayed full for 0s .* or by alloc\(\) buffers"):
        pool.alloc(3 * MB, np.uint8)
    assert pool.wants(MB) and not pool.wants(8 * MB + 1)
    del kept


def _release_all(pool, reader):
    for peer, items in reader.releases.take(1.0).items():
        for seg, gen, n in items:
            assert pool.release(peer, seg, gen, n)


def test_a_lent_slot_goes_on_by_handle_and_is_free_only_when_both_sides_let_go(pool, reader):
    # A frame from another host lands in a lent slot (the tcp link writes it); passed on to a
    # same-host peer, its buffers go by handle: no copy.
    room = pool.lend(2 * MB)
    assert len(room) == 2 * MB and not room.readonly and pool.stats["lent"] == 1
    body = np.frombuffer(room, np.uint8)
    body[:] = 9
    desc = pool.place(body[64:MB + 64], [1], timeout=1)
    assert pool.stats["by_handle"] == 1 and pool.stats["copied_bytes"] == 0
    view = np.frombuffer(reader.view(desc), np.uint8)
    assert view.nbytes == MB and (view == 9).all()
    del view
    _release_all(pool, reader)  # the peer let go; our own views still hold the slot
    assert pool.lend(4 * MB) is None  # 2 + 4 MiB: over half the 8 MiB pool
    segments = pool.stats["segments"]
    del body, room
    gc.collect()
    again = pool.lend(2 * MB)  # the same warm slot, lent again
    assert again is not None and pool.stats["segments"] == segments
    del again


def test_lending_never_waits_and_leaves_half_the_pool_to_sending(pool):
    held = pool.place(np.ones(5 * MB, np.uint8), [1], timeout=1)  # a receiver holds 5 of 8 MiB
    t0 = time.monotonic()
    assert pool.lend(3 * MB + 1) is None  # no room now: None at once (the link uses its own)
    assert time.monotonic() - t0 < 0.1
    assert pool.release(1, held[0], held[2])
    lent = [pool.lend(2 * MB), pool.lend(2 * MB)]
    assert all(r is not None for r in lent) and pool.lend(MB) is None  # half is lendable
    pool.place(np.ones(3 * MB, np.uint8), [1], timeout=0.5)  # the other half still sends
    del lent


def test_a_lent_view_outlives_the_closed_pool(pool):
    room = pool.lend(MB)
    room[:4] = b"kept"
    pool.close()  # the queue stopped while the user still holds its message
    assert bytes(room[:4]) == b"kept"  # still mapped: no crash, same bytes
    assert pool.lend(MB) is None


def test_bad_pool_options_are_config_errors():
    with pytest.raises(mq.ConfigError, match="shm_pool_bytes"):
        mq.create("nng", 0, shm_pool_bytes=-1)
    with pytest.raises(mq.ConfigError, match="shm_inline_max"):
        mq.create("nng", 0, shm_inline_max="64k")
    q = mq.create("nng", 0, shm=False)
    with q:
        with pytest.raises(mq.ConfigError, match="no shared-memory pool: turned off"):
            q.alloc(4)


# ---------------------------------------------------------------------- real processes
def _spawn(node_id: int, address: str, mode: str, pre: list[str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([*(pre or []), sys.executable, "-m", "tests.jobs.shm_peer", str(node_id), address, mode],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _line(proc: subprocess.Popen, timeout: float = 30.0) -> str:
    return read_line(proc, timeout)


_stop = stop_processes


def _pool_maps(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum("memfd:mq-pool" in line for line in f)


def _pool_inodes_open_in(pid: int) -> set[int]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if "memfd:mq-pool" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                out.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        except OSError:
            pass
    return out


def _mapped_pool_inodes() -> set[int]:
    with open("/proc/self/maps") as f:
        return {int(line.split()[4]) for line in f if "memfd:mq-pool" in line}


def _dev_shm() -> set[str]:
    # multiprocessing's own semaphores (sem.mp-*) come and go with other processes: not ours
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {n for n in names if not n.startswith("sem.mp-")}


@pytest.fixture
def learner():
    q = mq.create("nng", 0, "learner", timeout=10, shm_pool_bytes=64 * MB)
    with q:
        yield q


def test_a_receiver_hoarding_views_makes_the_sender_wait_then_time_out(learner):
    peer = _spawn(1, learner.addresses["tcp"], "hoard")
    try:
        assert _line(peer) == "ready shm"
        learner.wait_for_subscribers("data", 1, timeout=10)
        assert learner.routes()[1].kind == "shm"
        blob = np.ones(20 * MB, np.uint8)
        sent = 0
        with pytest.raises(mq.Timeout, match="shared-memory pool stayed full"):
            for _ in range(10):  # 64 MiB pool: the fourth 20 MiB message finds no free slot
                learner.send(1, "data", blob, timeout=1.0)
                sent += 1
        assert sent == 3
        assert wait_until(lambda: learner.call(1, "count", timeout=5) == 3)
        assert learner.call(1, "drop", timeout=5) == "dropped"
        learner.send(1, "data", blob, timeout=5)  # the released slots are free again
        assert wait_until(lambda: learner.call(1, "count", timeout=5) == 1)
        assert learner.stats().shm["copied_bytes"] == 4 * 20 * MB
        learner.flush(1, timeout=5)  # all confirmed: killing the peer loses nothing (stop() is quiet)
    finally:
        _stop(peer)


def test_a_message_a_subscriber_callback_let_go_is_released_at_once(learner):
    # The handler thread must not pin the last message it ran (its slot would stay held until
    # the next message on that node, forever on a quiet topic).
    peer = _spawn(1, learner.addresses["tcp"], "glance")
    try:
        assert _line(peer) == "ready shm"
        learner.wait_for_subscribers("data", 1, timeout=10)
        w = learner.alloc((8 * MB,), np.uint8)
        w[:] = 5
        learner.send(1, "data", w)
        assert wait_until(lambda: learner.call(1, "seen", timeout=5) == [5])
        learner.wait_released(w, timeout=5)
    finally:
        _stop(peer)


def test_publish_to_same_host_subscribers_copies_once(learner):
    peers = [_spawn(n, learner.addresses["tcp"], "hoard") for n in (1, 2)]
    try:
        for p in peers:
            assert _line(p) == "ready shm"
        learner.wait_for_subscribers("data", 2, timeout=10)
        assert learner.publish("data", np.full(10 * MB, 3, np.uint8)) == [1, 2]
        assert learner.stats().shm["placed"] == 1
        assert learner.stats().shm["copied_bytes"] == 10 * MB
        for n in (1, 2):
            assert wait_until(lambda n=n: learner.call(n, "count", timeout=5) == 1)
            learner.flush(n, timeout=5)
    finally:
        _stop(*peers)


def test_sigkilled_receiver_frees_its_slots_and_leaves_nothing(learner):
    before = _dev_shm()
    peer = _spawn(1, learner.addresses["tcp"], "hold")
    try:
        assert _line(peer) == "ready shm"
        learner.wait_for_subscribers("data", 1, timeout=10)
        learner.send(1, "data", np.full(40 * MB, 9, np.uint8))
        assert _line(peer) == "got 9"
        assert _pool_maps(peer.pid) >= 1
        os.kill(peer.pid, signal.SIGKILL)
        peer.wait(10)
        assert wait_until(lambda: 1 not in learner.peers())
        # What the dead receiver held is free: the whole pool is usable again at once.
        learner_pool = learner._sender.pool
        assert learner_pool is not None and wait_until(
            lambda: all(s.free for s in learner_pool._segments.values() if s is not learner_pool._probe))
    finally:
        _stop(peer)
    assert _dev_shm() == before


def test_sigkilled_sender_leaves_no_mapping_once_views_are_dropped(learner):
    before = _dev_shm()
    learner.subscribe("data")
    peer = _spawn(1, learner.addresses["tcp"], "send")
    try:
        assert _line(peer) == "ready shm"
        msg = learner.recv(timeout=20)
        assert msg.payload[0] == 7 and not msg.payload.flags.writeable
        assert _line(peer) == "sent"
        theirs = _pool_inodes_open_in(peer.pid)  # its pool's memfds (ours map the same files)
        os.kill(peer.pid, signal.SIGKILL)
        peer.wait(10)
        assert wait_until(lambda: 1 not in learner.peers())
        assert msg.payload[-1] == 7  # a view outlives its sender: the mapping keeps it valid
        assert _mapped_pool_inodes() & theirs
        del msg
        gc.collect()
        # (counted by file, not by number of mappings: other nodes of this test process, from
        # earlier tests, may still be letting go of their own pools)
        assert wait_until(lambda: not _mapped_pool_inodes() & theirs)
    finally:
        _stop(peer)
    assert _dev_shm() == before


def _unshare_works(*flags: str) -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", *flags, "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _unshare_works("--mount"), reason="needs root and unshare(1)")
def test_a_64_mib_dev_shm_does_not_limit_the_pool(learner):
    # Docker's default: /dev/shm is a 64 MiB tmpfs. The pool is memfd, never in /dev/shm.
    pre = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
           'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"', "sh"]
    peer = _spawn(1, learner.addresses["tcp"], "hoard", pre=pre)
    try:
        assert _line(peer) == "ready shm"
        learner.wait_for_subscribers("data", 1, timeout=10)
        learner.send(1, "data", np.ones(48 * MB, np.uint8))  # over Docker's whole /dev/shm
        learner.send(1, "data", np.ones(8 * MB, np.uint8))
        assert wait_until(lambda: learner.call(1, "count", timeout=5) == 2)
        assert learner.stats().shm["copied_bytes"] == 56 * MB
        learner.flush(1, timeout=5)
    finally:
        _stop(peer)


@pytest.mark.skipif(not _unshare_works("--pid", "--fork", "--mount-proc"), reason="needs root and unshare(1)")
def test_a_peer_that_cannot_open_the_pool_falls_back_to_a_socket_and_says_why(learner):
    # In its own PID namespace with its own /proc, neither side can open the other's pool.
    peer = _spawn(1, learner.addresses["tcp"], "hoard", pre=["unshare", "--pid", "--fork", "--mount-proc"])
    try:
        assert _line(peer).startswith("ready ")
        learner.wait_for_subscribers("data", 1, timeout=10)
        # A socket route (tcp here: --mount-proc also gives it its own mount namespace).
        assert wait_until(lambda: learner.routes()[1].kind in ("ipc", "tcp"))
        assert "not shm: cannot open node 1's shared memory" in learner.routes()[1].reason
        learner.send(1, "data", np.ones(8 * MB, np.uint8))  # still delivered, over the socket
        assert wait_until(lambda: learner.call(1, "count", timeout=5) == 1)
        assert learner.stats().shm["placed"] == 0
        learner.flush(1, timeout=5)
    finally:
        _stop(peer)
