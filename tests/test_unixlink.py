"""Same-host unix SEQPACKET links (mq.backends.unixlink): framing on real kernel sockets, hostile
datagrams, a frame cut off by a timeout, and the nng transport choosing the link per peer."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

import mq
from mq.backends import unixlink
from mq.codec import MSG, Codec, split
from mq.errors import ProtocolError
from mq.testing import wait_until

pytestmark = pytest.mark.timeout(60)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def frame_of(payload, topic: str = "t"):
    return Codec().encode(MSG, topic, 1, 0, 0, payload)


def decoded(data) -> object:
    return Codec().decode(*split(data)).payload


@pytest.fixture
def link_pair():
    """(Outbound, Inbound, lost-calls) joined through a real abstract listener."""
    name = f"mq-test-{uuid.uuid4().hex[:12]}"
    listener = unixlink.listen(name)
    lost: list[int] = []
    out = unixlink.Outbound(name, 5.0, lambda: lost.append(1))
    conn, _ = listener.accept()
    inbound = unixlink.Inbound(conn, 64 << 20)
    try:
        yield out, inbound, lost
    finally:
        out.close()
        inbound.close()
        listener.close()


def read_all(inbound: unixlink.Inbound, count: int, timeout: float = 10) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        frame = inbound.read()
        if frame is None:
            time.sleep(0.005)
        else:
            got.append(frame)
    assert len(got) == count, f"{len(got)} of {count} frames within {timeout}s"
    return got


def test_small_and_chunked_frames_arrive_whole_and_in_order(link_pair):
    out, inbound, _ = link_pair
    big = np.arange(300_001, dtype=np.uint8)  # several datagrams, the last one short
    sender = threading.Thread(target=lambda: [out.send(1, frame_of(x), 5) for x in (1, {"blob": big}, 3)])
    sender.start()  # more than the socket buffer holds: it waits for the reader
    first, second, third = read_all(inbound, 3)
    sender.join(10)
    assert decoded(first) == 1 and decoded(third) == 3
    assert np.array_equal(decoded(second)["blob"], big)


def test_a_frame_cut_off_by_a_timeout_is_dropped_and_the_next_arrives(link_pair):
    out, inbound, _ = link_pair
    huge = frame_of(np.zeros(4 << 20, dtype=np.uint8))  # more than the socket buffer holds
    with pytest.raises(mq.Timeout):
        out.send(1, huge, 0.2)  # nobody reads: part of it left, the rest timed out
    sender = threading.Thread(target=out.send, args=(1, frame_of("after"), 5))
    sender.start()  # sends the abort mark first, waiting for room the reader makes
    got = read_all(inbound, 1)
    sender.join(10)
    assert [decoded(g) for g in got] == ["after"]  # the cut frame never surfaced
    assert inbound.read() is None


@pytest.mark.parametrize("datagram, why", [
    (b"\x01\x02\x03", "holds no frame length"),
    (struct.pack("<Q", 1 << 40) + b"x", "exceeds max_frame_bytes"),
    (struct.pack("<Q", 10) + b"x" * 20, "begins with a 20-byte piece"),
    (struct.pack("<Q", 100_000) + b"x" * 100, "begins with a 100-byte piece"),
    (struct.pack("<Q", 200_000) + b"x" * unixlink.DATAGRAM, "longer than the 65536 bytes due"),
])
def test_malformed_datagrams_are_protocol_errors(link_pair, datagram, why):
    out, inbound, _ = link_pair
    out.sock.send(datagram)
    assert wait_until(lambda: _raises(inbound, why), 5)


def test_a_continuation_with_a_wrong_tag_is_a_protocol_error(link_pair):
    out, inbound, _ = link_pair
    out.sock.send(struct.pack("<Q", 100_000) + b"x" * (unixlink.DATAGRAM - 8))
    out.sock.send(b"\x07" + b"y" * 100)
    assert wait_until(lambda: _raises(inbound, "tag 7"), 5)


def _raises(inbound: unixlink.Inbound, why: str) -> bool:
    try:
        inbound.read()
    except ProtocolError as exc:
        assert why in str(exc)
        return True
    return False


def test_a_closed_sender_reads_as_end_of_link(link_pair):
    out, inbound, _ = link_pair
    out.close()
    with pytest.raises(EOFError):
        for _ in range(500):
            inbound.read()
            time.sleep(0.01)


# ---------------------------------------------------------------------- in the nng transport
@contextlib.contextmanager
def hang_peer(node: mq.MQ):
    """tests.jobs.nng_peer as node 1 (mode hang) in another process on this host, joined to
    ``node``; killed on exit."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.jobs.nng_peer", "1", node.addresses["tcp"], "hang"],
                            cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        node.wait_for_peers(ids=[1], timeout=10)
        yield proc
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()


@pytest.fixture
def peer_proc():
    node = mq.create("nng", 0, "learner", timeout=5)
    with node, hang_peer(node) as proc:
        yield node, proc


def test_a_same_host_peer_is_reached_over_a_unix_link(peer_proc):
    node, _ = peer_proc
    assert node.routes()[1].kind == "shm"
    assert isinstance(node.transport._out[1], unixlink.Outbound)
    assert node.call(1, "echo", {"x": np.arange(5)}, timeout=5)["x"].tolist() == [0, 1, 2, 3, 4]
    assert node.call(1, "echo", "y" * 300_000, timeout=5) == "y" * 300_000  # inline, chunked


def test_hostile_datagrams_close_that_link_only(peer_proc):
    node, _ = peer_proc
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect("\0" + node.addresses["unix"])
    try:
        s.send(b"\x00\x01")  # no frame length: the stranger's link is closed, counted
        assert wait_until(lambda: node.stats().dropped_malformed >= 1)
        assert wait_until(lambda: _closed_by_peer(s), 5)
    finally:
        s.close()
    assert node.call(1, "echo", "still here", timeout=5) == "still here"


def _closed_by_peer(s: socket.socket) -> bool:
    s.settimeout(0.1)
    try:
        return s.recv(1) == b""
    except socket.timeout:
        return False
    except ConnectionError:
        return True


def test_unix_links_off_uses_nng_ipc():
    a = mq.create("nng", 0, timeout=5, unix_links=False)
    with a, hang_peer(a):
        assert "unix" not in a.addresses
        assert not isinstance(a.transport._out[1], unixlink.Outbound)
        assert a.call(1, "echo", 7, timeout=5) == 7
