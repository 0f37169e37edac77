"""NNG-specific behaviour: hostile frames, dead peers, bounded stop, rendezvous."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time

from fractions import Fraction

import numpy as np
import pynng
import pytest

import mq
from tests.strangers import send_as_strangers
from mq.testing import wait_until
from mq.backends.nng.options import check_address
from mq.launch import free_port

pytestmark = pytest.mark.timeout(60)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def node():
    q = mq.create("nng", 0, "learner", listen_to="tcp://127.0.0.1:0", timeout=5,
                  max_frame_bytes=1 << 20)
    with q:
        q.on("echo", lambda x: x)
        yield q


@contextlib.contextmanager
def peer_process(node, mode, **env):
    """``tests.jobs.nng_peer`` as node 1 in ``mode``, joined to ``node``; killed on exit."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.jobs.nng_peer", "1", node.addresses["tcp"], mode],
                            cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_hostile_frames_are_dropped_counted_and_the_node_keeps_serving(node):
    junk = [b"", b"\x01", b"\xff" * 10, (1 << 30).to_bytes(4, "little") + b"x" * 20,
            b"\x05\x00\x00\x00\x95\x01\x00\xa1t\x00"]  # truncated envelope
    send_as_strangers(node.addresses, "tcp", junk)  # each refused (counted), its pipe closed
    attacker = pynng.Push0(send_timeout=2000)
    attacker.dial(node.addresses["tcp"], block=True)
    try:
        attacker.send(b"\x00" * (2 << 20))  # over max_frame_bytes: NNG drops it at the socket
    finally:
        attacker.close()
    assert node.stats().rejected == {"handshake_malformed": len(junk)}
    # still serving a real peer
    peer = mq.create("nng", 1, "collector", attach_to=[node.addresses["tcp"]], timeout=5)
    with peer:
        assert peer.call(0, "echo", {"x": np.arange(3)}, timeout=5)["x"].tolist() == [0, 1, 2]


def test_pickled_payload_from_the_network_is_refused_by_default(node):
    sender = mq.create("nng", 1, attach_to=[node.addresses["tcp"]], timeout=5, allow_pickle=True)
    with sender:
        node.subscribe("x")
        sender.wait_for_subscribers("x", 1, timeout=5)
        sender.publish("x", {"obj": Fraction(1, 3)})
        sender.publish("x", "plain")
        assert node.recv(timeout=5).payload == "plain"
        assert node.stats().dropped_malformed == 1


def test_send_to_sigkilled_peer_raises_peer_lost_quickly_and_stop_is_bounded(node):
    with peer_process(node, "hang") as proc:
        node.wait_for_peers(ids=[1], timeout=10)
        assert node.call(1, "echo", 5, timeout=5) == 5
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)
        t0 = time.monotonic()
        with pytest.raises((mq.PeerLost, mq.Timeout)):
            for _ in range(1000):
                node.send(1, "work", np.zeros(1 << 16), timeout=2)
                time.sleep(0.01)
        assert time.monotonic() - t0 < 5
        with pytest.raises(mq.PeerLost):
            node.call(1, "echo", 1, timeout=2)
        assert 1 not in node.peers()
    t0 = time.monotonic()
    node.stop(timeout=3)
    assert time.monotonic() - t0 < 4


def test_pending_call_fails_with_peer_lost_when_the_peer_dies(node):
    with peer_process(node, "hang") as proc:
        node.wait_for_peers(ids=[1], timeout=10)
        killer = threading.Timer(1.0, proc.kill)
        killer.start()
        try:
            t0 = time.monotonic()
            with pytest.raises(mq.PeerLost, match="node 1"):
                node.call(1, "slow", None, timeout=30)
            assert time.monotonic() - t0 < 5
        finally:
            killer.cancel()


def listen_all(nodes):
    """listen() blocks in the rendezvous until every node registered: start them together."""
    threads = [threading.Thread(target=n.listen) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return nodes


def test_rendezvous_finds_peers_without_attach_lists():
    init = f"tcp://127.0.0.1:{free_port()}"
    nodes = listen_all([mq.create("nng", i, "collector" if i else "learner", init_method=init,
                                  world_size=3, timeout=10) for i in range(3)])
    try:
        for n in nodes:
            n.wait_for_peers(2, timeout=10)
        assert nodes[2].peers(label="learner") == [0]
        assert {r.kind for r in nodes[0].routes().values()} == {"inproc"}
    finally:
        for n in nodes:
            n.stop()


def test_rendezvous_env_and_file_forms(tmp_path, monkeypatch):
    from mq.rendezvous import parse_init_method

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    spec = parse_init_method("env://")
    assert (spec.host, spec.port, spec.rank, spec.world_size) == ("127.0.0.1", 29500, 1, 4)
    assert parse_init_method(f"file://{tmp_path}/rdv").path == f"{tmp_path}/rdv"
    path = f"file://{tmp_path}/store"
    nodes = listen_all([mq.create("nng", i, init_method=path, world_size=2, timeout=10) for i in range(2)])
    try:
        nodes[1].wait_for_peers(ids=[0], timeout=10)
    finally:
        for n in nodes:
            n.stop()


@pytest.mark.parametrize("init, reason", [
    ("env://", "MASTER_ADDR"),
    ("tcp://nohost", "needs a host and a port"),
    ("file://", "needs a path"),
    ("udp://x:1", "must start with tcp://, env://, file:// or ray://"),
])
def test_bad_init_methods(init, reason, monkeypatch):
    from mq.rendezvous import parse_init_method

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(mq.ConfigError, match=reason):
        parse_init_method(init)


@pytest.mark.parametrize("address, reason", [
    ("127.0.0.1:5000", "must start with one of"),
    ("tcp://127.0.0.1", "needs a host and a port"),
    ("tcp://:5000", "needs a host and a port"),
    ("tcp://h:99999", "needs a host and a port"),
    ("ipc://", "needs a path"),
])
def test_bad_addresses(address, reason):
    with pytest.raises(mq.ConfigError, match=reason):
        check_address(address)
    with pytest.raises(mq.ConfigError, match=reason):
        mq.create("nng", 0, listen_to=address)


def test_bad_create_options():
    with pytest.raises(mq.ConfigError, match="unknown mq type 'nngg'"):
        mq.create("nngg", 0)
    with pytest.raises(mq.ConfigError, match="node_id must be a non-negative int"):
        mq.create("nng", -1)
    with pytest.raises(mq.ConfigError, match="unexpected keyword argument 'bogus'"):
        mq.create("nng", 0, bogus=1)
    with pytest.raises(mq.ConfigError, match="protocol must be auto, tcp or ipc"):
        mq.create("nng", 0, protocol="udp")
    for bad in (-1e-6, 1.0, "100us", None, True):
        with pytest.raises(mq.ConfigError, match="batch_window must be seconds between 0 and 0.01"):
            mq.create("nng", 0, batch_window=bad)
    for bad in ("yes", 1, None, 5e-4):
        with pytest.raises(mq.ConfigError, match="busy_poll must be True or False"):
            mq.create("nng", 0, busy_poll=bad)


def test_listen_on_a_busy_port_says_so():
    with mq.create("nng", 0, listen_to="tcp://127.0.0.1:0") as a:
        port = a.addresses["tcp"].rsplit(":", 1)[1]
        with pytest.raises(mq.ConfigError, match="already in use"):
            mq.create("nng", 1, listen_to=f"tcp://127.0.0.1:{port}").listen()


def test_send_to_unknown_peer_times_out_with_the_known_peers(node):
    with pytest.raises(mq.Timeout, match="node 7 has not joined"):
        node.send(7, "x", 1, timeout=0.2)
    with pytest.raises(mq.ConfigError, match="is this node"):
        node.send(0, "x", 1)
    with pytest.raises(mq.ConfigError, match="topic must be a non-empty str"):
        node.publish("", 1)


def test_use_after_stop_is_a_clear_error():
    q = mq.create("nng", 0)
    q.listen()
    q.stop()
    with pytest.raises(mq.ClosedError, match="create a new one"):
        q.listen()
    with pytest.raises(mq.ClosedError):
        q.recv(timeout=0.1)


def test_calls_and_handlers_are_served_while_another_thread_waits_in_recv(node):
    # recv() reads the socket in the caller's thread; frames that are not for it (call
    # replies, handler topics) must still reach their owners promptly.
    peer = mq.create("nng", 1, attach_to=[node.addresses["tcp"]], timeout=5)
    with peer:
        peer.on("echo", lambda x: x)
        handled = threading.Event()
        node.subscribe("h", lambda msg: handled.set())
        node.subscribe("data")
        node.wait_for_peers(ids=[1], timeout=5)
        peer.wait_for_subscribers("data", 1, timeout=5)
        got = []
        waiter = threading.Thread(target=lambda: got.append(node.recv(timeout=10)))
        waiter.start()
        time.sleep(0.2)  # the waiter now holds the socket
        t0 = time.monotonic()
        assert node.call(1, "echo", "hi", timeout=5) == "hi"
        peer.publish("h", 1)
        assert handled.wait(5)
        assert time.monotonic() - t0 < 2
        peer.send(0, "data", 42)
        waiter.join(5)
        assert [m.payload for m in got] == [42]


def test_a_burst_behind_a_busy_pipe_is_batched_lossless_and_in_order(batching_node):
    node = batching_node
    # A stream to a receiver that reads nothing for a second: frames queue in the sender's
    # outbox and go many to an NNG message; every one arrives, in order, none twice, though the
    # receiver's queue holds 2 and its recv() reads whole batches for itself.
    n = 5000
    with peer_process(node, "count", MQ_TEST_COUNT=str(n)):
        node.subscribe("counted")
        node.wait_for_subscribers("work", 1, timeout=10)
        x = np.arange(1024, dtype=np.float32)  # 20 MB in all: more than the sockets' buffers
        for i in range(n):
            node.send(1, "work", {"i": i, "x": x}, timeout=20)
        report = node.recv(timeout=30).payload
        node.flush(1, timeout=10)  # its receipt of the last frames, before the peer is killed
    assert report["got"] == list(range(n))
    assert report["batched"] >= n // 4 and report["largest"] > 8, report


@pytest.fixture
def batching_node():
    q = mq.create("nng", 0, "learner", listen_to="tcp://127.0.0.1:0", timeout=5, batch_window=100e-6,
                  unix_links=False)  # batching is an NNG link feature
    q.listen()
    try:
        yield q
    finally:  # (the tests kill their peer mid-stream: frames it never confirmed are no failure here)
        q.stop(raise_undelivered=False)


def test_request_reply_goes_straight_to_nng_and_a_stream_is_batched(batching_node):
    node = batching_node
    # Replies in between mark request/reply: each request leaves at once, not through the
    # flusher thread (its hand-off would add latency). Back-to-back sends are a stream.
    with peer_process(node, "hang"):
        node.wait_for_peers(ids=[1], timeout=10)
        node.wait_for_subscribers("work", 1, timeout=10)
        outbox = node.transport._out[1]
        before = outbox.queued
        for i in range(200):
            assert node.call(1, "echo", i, timeout=5) == i
        # (A heartbeat sent just before a request may make that one request look like a stream.)
        assert outbox.queued - before <= 5, "request/reply exchanges went through the flusher"
        for i in range(200):
            node.send(1, "work", i, timeout=5)
        assert outbox.queued > before + 100, "a stream of sends was not queued for batching"
        assert node.call(1, "echo", "after", timeout=5) == "after"  # ordered behind the stream


def test_peer_sigkilled_mid_stream_fails_the_sender_fast(batching_node):
    node = batching_node
    # Back-to-back sends queue in the outbox (a stream); the peer dies under it. The sender
    # gets PeerLost within seconds, whether it was queueing or waiting for room, never hangs.
    with peer_process(node, "hang") as proc:
        node.wait_for_peers(ids=[1], timeout=10)
        node.wait_for_subscribers("work", 1, timeout=10)
        killer = threading.Timer(0.5, proc.kill)
        killer.start()
        t0 = time.monotonic()
        sent = 0
        with pytest.raises(mq.PeerLost):
            while time.monotonic() - t0 < 20:
                node.send(1, "work", {"i": sent, "x": np.zeros(256, np.float32)}, timeout=10)
                sent += 1
        assert time.monotonic() - t0 < 6, f"PeerLost after {time.monotonic() - t0:.1f}s"
        assert 1 not in node.peers()
        # (PeerLost may come from the send window's wait, before the link is closed: closing
        # it runs off the thread that noticed, so it follows within moments.)
        assert wait_until(lambda: node.transport._out.get(1) is None, 3)
        assert sent > 100  # it was streaming when the peer died
    t0 = time.monotonic()
    node.stop(timeout=3)
    assert time.monotonic() - t0 < 4


# Busy polling (mq.backends.nng.busypoll): a waiter spins only while answers come within the window,
# a bounded time per wait, and never with busy_poll=False. Counted, not timed.
LINKS = {"own links": {}, "NNG sockets only": {"unix_links": False, "tcp_links": False}}


@contextlib.contextmanager
def pong_pair(**options):
    """Node 0 and a pong peer; node 0 stops while the peer lives (it confirms what it got: killed
    first, its last receipt could be lost under load, and stop() said Undelivered), then the kill."""
    q = mq.create("nng", 0, listen_to="tcp://127.0.0.1:0", timeout=10, **options)
    with q, peer_process(q, "pong"):
        q.wait_for_peers(1, timeout=10)
        yield q
        q.stop()


def ping(q, n, delay):
    for i in range(n):
        q.send(1, "ping", {"i": i, "delay": delay})
        msg = q.recv(timeout=10)
        assert (msg.topic, msg.payload["i"]) == ("pong", i)


@pytest.mark.parametrize("links", LINKS)
def test_a_waiter_spins_while_answers_come_fast_and_sleeps_once_they_come_late(links):
    with pong_pair(**LINKS[links]) as q:
        spin = q.transport.busy_poll
        ping(q, 300, 0.0)
        # a prompt answer was met spinning, unless the machine was crowded (every core taken:
        # then spinning only costs the waiter its turn, and it stops: mq.backends.nng.busypoll)
        assert spin.found >= 1 or spin.crowded >= 1, (spin.spun, spin.found, spin.crowded)
        ping(q, 3, 0.02)  # answers 20 ms late: 40x the window
        spun = spin.spun
        ping(q, 30, 0.02)
        assert spin.spun - spun <= 2, f"spun {spin.spun - spun} of 30 late waits"
        assert spin.typical > spin.window


def test_a_wait_with_nothing_coming_spins_at_most_the_window():
    with pong_pair() as q:
        ping(q, 50, 0.0)  # recent waits short: the next one spins
        cpu = time.thread_time()
        with pytest.raises(mq.Timeout):
            q.recv(timeout=0.5)
        assert time.thread_time() - cpu < 0.15  # 0.5 ms of spinning, then asleep


@pytest.mark.parametrize("links", LINKS)
def test_busy_poll_off_never_spins(links):
    with pong_pair(busy_poll=False, **LINKS[links]) as q:
        ping(q, 100, 0.0)
        assert (q.transport.busy_poll.spun, q.transport.busy_poll.found) == (0, 0)


@pytest.mark.parametrize("kind", ["tcp", "ipc"])
def test_a_frame_nng_itself_drops_is_counted(kind):
    """Issue 45: a frame over max_frame_bytes sent to NNG's own port is dropped by NNG (its
    receive bound) before mq sees it; it must still be counted, by cause, like one on mq's
    links. An orderly join and goodbye count nothing."""
    import pynng

    q = mq.create("nng", 0, listen_to="tcp://127.0.0.1:0", max_frame_bytes=1 << 16, timeout=10)
    with q:
        peer = mq.create("nng", 1, attach_to=[q.addresses["tcp"]], protocol="tcp", tcp_links=False, timeout=10)
        with peer:  # an orderly peer on NNG's own tcp (bootstrap, data): joins, sends, leaves
            q.wait_for_peers(ids=[1], timeout=10)
            q.subscribe("w")
            peer.wait_for_subscribers("w", 1, timeout=10)
            peer.send(0, "w", b"ok")
            assert q.recv(timeout=10).payload == b"ok"
        time.sleep(0.5)
        assert q.stats().dropped.get("nng_closed", 0) == 0, q.stats().dropped
        push = pynng.Push0(send_timeout=2000)
        push.dial(q.addresses[kind], block=True)
        try:
            push.send(b"x" * (1 << 17))  # twice the bound: NNG closes the connection
            deadline = time.monotonic() + 10
            while q.stats().dropped.get("nng_closed", 0) < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            push.close()
        stats = q.stats()
        assert stats.dropped.get("nng_closed", 0) >= 1, stats
        assert q.metrics()["drops"]["nng_closed"] >= 1


def test_a_socket_nobody_closed_collected_on_nngs_thread_does_not_hang_the_process(tmp_path):
    # Without mq.backends.nng.orphans this process hangs in nng_close (its reaper waits for itself).
    job = subprocess.run([sys.executable, "-m", "tests.jobs.orphan_socket", str(tmp_path)],
                         capture_output=True, text=True, timeout=30)
    assert job.returncode == 0 and job.stdout.strip() == "ok", job.stderr[-2000:]


def test_the_poll_set_follows_its_sources_and_a_reused_fd_is_a_new_source():
    """The I/O thread's epoll set is updated in place as links come and go: a link closed and
    another opened on the same fd number (the kernel reuses the lowest) must be waited on, or
    its frames would never be read."""
    import socket

    from mq.backends.nng.transport import _PollSet

    poller = _PollSet()
    a, b = socket.socketpair()
    poller.update({(a.fileno(), "first")})
    b.send(b"x")
    assert poller.poll(1000) == [(a.fileno(), select.EPOLLIN)]
    fd = a.fileno()
    a.close()
    b.close()  # the kernel drops a closed fd from the set by itself
    c, d = socket.socketpair()
    if c.fileno() != fd:  # make the new link take the old number, as accept() would
        os.dup2(c.fileno(), fd)
        c.close()
        c = socket.socket(fileno=fd)
    poller.update({(fd, "second")})  # same fd, another link
    d.send(b"y")
    assert poller.poll(1000) == [(fd, select.EPOLLIN)]
    poller.update(set())  # gone: no longer waited on
    assert poller.poll(0) == []
    poller.update({(12345, "closed")})  # an fd closed since it was listed: skipped, no error
    assert poller.poll(0) == []
    c.close()
    d.close()
    poller.close()
