"""Hostile shared memory: what an insider (a peer that joined with the job secret) or a
stranger's HELLO can make a reader map. Real processes: a forger process owns crafted memfds
named like pool segments, the reader opens them through /proc as it would a peer's pool."""

from __future__ import annotations

import fcntl
import gc
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from mq.errors import ProtocolError
from mq.datapaths.shm.pool import _LIVE, _MIN_SEGMENT, _RETIRED, Pool, PoolReader

pytestmark = pytest.mark.timeout(60)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 1 << 20
GEN = 1

# Owns crafted segments; one command a line on stdin, one answer a line on stdout:
#   make SEG_ID SIZE SEALED HUGETLB STATE -> the fd of a memfd "mq-pool-x" with a valid header
#   truncate FD SIZE                   -> "ok", or "refused ERRNO"
FORGER = r"""
import fcntl, os, sys
from mq.datapaths.shm.pool import _HEAD, _MAGIC
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "make":
        seg_id, size, sealed, huge, state = map(int, args)
        flags = os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if huge else 0)
        try:
            fd = os.memfd_create("mq-pool-x", flags)
            os.ftruncate(fd, size)
        except OSError as exc:
            print("refused", exc.errno, flush=True)
            continue
        if not huge:  # (hugetlbfs takes no pwrite: the reader refuses it first)
            os.pwrite(fd, _HEAD.pack(_MAGIC, 1, state, seg_id), 0)
        if sealed:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        print(fd, flush=True)
    elif cmd == "truncate":
        fd, size = map(int, args)
        try:
            os.ftruncate(fd, size)
            print("ok", flush=True)
        except OSError as exc:
            print("refused", exc.errno, flush=True)
"""

# A reader in its own process (a SIGBUS must not take pytest down): views segment SEG_ID of
# process PID twice, the owner shrinking it in between, then reads the view's last page.
READER = r"""
import sys
from mq.errors import ProtocolError
from mq.datapaths.shm.pool import PoolReader
pid, seg_id, fd, nbytes = map(int, sys.argv[1:])
reader = PoolReader(1, {"pid": pid, "probe": [seg_id, fd], "max_bytes": 1 << 30}, lambda s, g: None)
desc = [seg_id, fd, 1, 0, nbytes]
try:
    view = reader.view(desc)
except ProtocolError as exc:
    print("refused:", exc, flush=True)
    sys.exit(0)
print("viewed", flush=True)
del view
sys.stdin.readline()  # the owner shrank the segment meanwhile
view = reader.view(desc)
print("read", sum(view[-4096:]), flush=True)
"""


class Forger:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", FORGER], cwd=REPO, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pid = self.proc.pid

    def ask(self, *words: object) -> str:
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def make(self, seg_id: int, size: int, sealed: bool = True, hugetlb: bool = False,
             state: int = _LIVE) -> int:
        answer = self.ask("make", seg_id, size, int(sealed), int(hugetlb), state)
        if answer.startswith("refused"):
            pytest.skip(f"this kernel cannot make that memfd ({answer})")
        return int(answer)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(10)
        self.proc.stdout.close()


@pytest.fixture
def forger():
    f = Forger()
    yield f
    f.close()


def _reader(forger: Forger, max_bytes: int = 1 << 30, local_cap: int | None = None,
            probe: list[int] | None = None) -> PoolReader:
    info = {"pid": forger.pid, "probe": probe or [1, 0], "max_bytes": max_bytes}
    cap = {} if local_cap is None else {"max_bytes": local_cap}
    return PoolReader(1, info, lambda seg, gen: None, **cap)


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def _forged_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum("memfd:mq-pool-x" in line for line in f)


def test_pool_segments_are_sealed_so_their_owner_cannot_shrink_them():
    pool = Pool(max_bytes=8 * MB, inline_max=1024, label="sealed")
    try:
        desc = pool.place(np.ones(MB, np.uint8), [1], timeout=1)
        for seg in pool._segments.values():  # the probe and the data segment
            seals = fcntl.fcntl(seg.fd, fcntl.F_GET_SEALS)
            want = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
            assert seals & want == want, f"segment {seg.seg_id} has seals {seals:#x}"
            with pytest.raises(PermissionError):
                os.ftruncate(seg.fd, 0)
        assert pool._segments[desc[0]].holders == {1: 1}
    finally:
        pool.close()


def test_an_unsealed_segment_is_refused_before_its_owner_can_shrink_it(forger):
    # Before the seal check the reader viewed it, the owner truncated it, and the reader's
    # second view (checked against the size it saw at first) touched pages gone: SIGBUS.
    fd = forger.make(7, 64 + 4 * MB, sealed=False)
    reader = subprocess.Popen([sys.executable, "-c", READER, str(forger.pid), "7", str(fd), str(4 * MB)],
                              cwd=REPO, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    try:
        first = reader.stdout.readline().strip()
        if first == "viewed":
            assert forger.ask("truncate", fd, 64) == "ok"
            reader.stdin.write("\n")
            reader.stdin.flush()
        reader.stdin.close()
        rc = reader.wait(30)
        died = f"died with {signal.Signals(-rc).name}" if rc < 0 else f"exited {rc}"
        assert first.startswith("refused:"), (
            f"the reader mapped an unsealed segment; after its owner shrank it the reader {died}")
        assert "not sealed against shrinking" in first and rc == 0
    finally:
        if reader.poll() is None:
            reader.kill()
        reader.wait(10)
        reader.stdout.close()
        reader.stderr.close()


def test_a_sealed_forged_segment_cannot_be_shrunk_under_a_view(forger):
    fd = forger.make(7, 64 + MB)
    reader = _reader(forger)
    view = reader.view([7, fd, GEN, 0, MB])
    assert forger.ask("truncate", fd, 64).startswith("refused")  # EPERM: the seal holds
    assert sum(view[-4096:]) == 0
    reader.close()
    del view


def test_a_huge_probe_is_refused_without_mapping_it(forger):
    # A HELLO (before authentication) names a 128 MiB sparse memfd as its probe segment.
    fd = forger.make(1, 128 * MB)
    gc.collect()
    before = _rss()
    reader = _reader(forger, probe=[1, fd])
    why = reader.probe()
    grown = _rss() - before
    assert grown < 8 * MB, f"probing grew this process by {grown >> 20} MiB"
    assert why is not None and "a probe segment has 64 bytes, this one 134217728" in why
    assert _forged_maps() == 0 and reader.mapped_bytes == 0
    reader.close()


def test_a_real_probe_is_unmapped_at_once():
    pool = Pool(max_bytes=8 * MB, inline_max=1024, label="probe")
    try:
        maps = _pool_maps("mq-pool-probe")
        reader = PoolReader(1, pool.probe_info(), lambda seg, gen: None)
        assert reader.probe() is None
        assert _pool_maps("mq-pool-probe") == maps and reader.mapped_bytes == 0
        reader.close()
    finally:
        pool.close()


def _pool_maps(name: str) -> int:
    with open("/proc/self/maps") as f:
        return sum(f"memfd:{name}" in line for line in f)


def test_an_unsealed_probe_is_refused(forger):
    fd = forger.make(1, 64, sealed=False)
    why = _reader(forger, probe=[1, fd]).probe()
    assert why is not None and "not sealed against shrinking" in why


def test_a_hugetlb_segment_is_refused(forger):
    # Punching a hole in hugetlbfs takes pages away under a mapping even when sealed.
    fd = forger.make(7, 2 * MB, hugetlb=True)
    reader = _reader(forger)
    with pytest.raises(ProtocolError, match="not a plain shared-memory file"):
        reader.view([7, fd, GEN, 0, MB])


def test_a_segment_forged_as_retired_is_a_stale_descriptor(forger):
    # The reader unmaps retired segments no view uses; it must not unmap the one it just opened.
    fd = forger.make(7, 64 + MB, state=_RETIRED)
    reader = _reader(forger)
    with pytest.raises(ProtocolError, match="stale descriptor"):
        reader.view([7, fd, GEN, 0, MB])
    reader.close()


def test_a_flood_of_forged_segments_stays_within_the_bound(forger):
    # Each frame names another sealed, sparse 64 MiB memfd. The reader maps at most the
    # smaller of the peer's announced bound (1 GiB here) and its own cap (160 MiB here).
    fds = [forger.make(100 + i, 64 + 64 * MB) for i in range(8)]
    reader = _reader(forger, max_bytes=1 << 30, local_cap=160 * MB)
    gc.collect()
    before = _rss()
    held, refused = [], 0
    for i, fd in enumerate(fds):
        try:
            held.append(reader.view([100 + i, fd, GEN, 0, 64 * MB]))
        except ProtocolError as exc:
            assert "would exceed the bound of 167772160 bytes mapped for node 1" in str(exc)
            refused += 1
        assert reader.mapped_bytes <= 160 * MB
    assert len(held) == 2 and refused == 6 == reader.refused
    assert _forged_maps() == 2
    assert _rss() - before < 8 * MB  # mapped, not populated
    # Views dropped: their mappings make room for the next segment instead of a refusal.
    del held
    gc.collect()
    assert reader.view([107, fds[7], GEN, 0, MB]) is not None
    assert reader.mapped_bytes == 64 * MB and _forged_maps() == 1
    reader.close()


def test_the_announced_bound_applies_and_tiny_segments_count_as_minimal_ones(forger):
    # A peer announcing a 1 MiB pool gets at most 16 mappings of 64 KiB, however small.
    fds = [forger.make(200 + i, 64 + 4096) for i in range(20)]
    reader = _reader(forger, max_bytes=MB)
    held = []
    for i, fd in enumerate(fds):
        try:
            held.append(reader.view([200 + i, fd, GEN, 0, 4096]))
        except ProtocolError:
            pass
    assert len(held) == MB // _MIN_SEGMENT and reader.refused == 4
    assert reader.mapped_bytes == MB
    reader.close()
    del held


def test_close_unmaps_everything_no_view_references(forger):
    fds = [forger.make(300 + i, 64 + MB) for i in range(3)]
    reader = _reader(forger)
    views = [reader.view([300 + i, fd, GEN, 0, MB]) for i, fd in enumerate(fds)]
    kept = views[1]
    del views
    gc.collect()
    assert _forged_maps() == 3  # cached for the next descriptor naming them
    reader.close()  # the peer is lost
    assert _forged_maps() == 1 and reader.mapped_bytes == 0
    with pytest.raises(ProtocolError, match="closed"):
        reader.view([300, fds[0], GEN, 0, MB])
    assert sum(kept[:16]) == 0  # still valid: its segment stays mapped while it lives
    del kept
    gc.collect()
    assert _forged_maps() == 0


@pytest.mark.parametrize("desc", [
    [-1, 3, GEN, 0, 1], [7, -1, GEN, 0, 1], [7, 1 << 31, GEN, 0, 1], [1 << 63, 3, GEN, 0, 1],
    [7, 3, GEN, 0, True], "x" * 10_000,
])
def test_insane_descriptors_are_malformed(forger, desc):
    reader = _reader(forger)
    with pytest.raises(ProtocolError, match="malformed shared-memory descriptor") as info:
        reader.view(desc)
    assert len(str(info.value)) < 200 and reader.refused == 1


@pytest.mark.parametrize("info", [
    {"pid": 1, "probe": [1, 3]},  # no bound announced
    {"pid": 1, "probe": [1, 3], "max_bytes": -1},
    {"pid": 0, "probe": [1, 3], "max_bytes": MB},
    {"pid": 1 << 40, "probe": [1, 3], "max_bytes": MB},
    {"pid": 1, "probe": [1, -3], "max_bytes": MB},
    {"pid": 1, "probe": [1, 3.0], "max_bytes": MB},
    {"pid": 1, "probe": [1, 3, 4], "max_bytes": MB},
    [1, 2],
])
def test_malformed_pool_descriptions_are_protocol_errors(info):
    with pytest.raises(ProtocolError, match="malformed shared-memory pool description"):
        PoolReader(1, info, lambda seg, gen: None)
