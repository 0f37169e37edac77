"""Idle peers cost nothing, and a wait on one still ends when it dies (issue 49, mq.node.liveness).

A pair of nodes that trade no data or calls for ``idle_after`` (three peer timeouts) stops
probing each other: a mesh of N idle nodes would otherwise ping N*(N-1) times a heartbeat.
What must not change: a wait that depends on such a peer (a call, a flush, a blocked send)
probes it at once, and ends with PeerLost within ``peer_timeout`` + a heartbeat when the peer
froze while idle; a peer that merely does not read (a hoarding receiver) is never declared lost.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Iterator

import numpy as np
import pytest

import mq
from mq.testing import freeze
from mq.node.liveness import IDLE_AFTER_TIMEOUTS

pytestmark = pytest.mark.timeout(120)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEARTBEAT, PEER_TIMEOUT = 0.25, 1.0
IDLE_AFTER = IDLE_AFTER_TIMEOUTS * PEER_TIMEOUT


def _wait_idle(nodes: list[mq.MQ], within: float = IDLE_AFTER + 6.0) -> None:
    """Until a window of 4 heartbeats passes with no frame at all (the pair went idle)."""
    deadline = time.monotonic() + within
    while _frames_in(nodes, 4 * HEARTBEAT):
        assert time.monotonic() < deadline, f"the idle pair still exchanged frames after {within:.1f}s"


def _frames_in(nodes: list[mq.MQ], seconds: float) -> int:
    """Frames the nodes received in the next ``seconds``, heartbeats included (``sent`` counts
    data only)."""
    before = sum(q.stats().received for q in nodes)
    time.sleep(seconds)
    return sum(q.stats().received for q in nodes) - before


@contextlib.contextmanager
def _pair() -> Iterator[tuple[mq.MQ, mq.MQ]]:
    """Nodes 0 and 1 of this module's liveness settings, joined, in this process."""
    opts = dict(heartbeat=HEARTBEAT, peer_timeout=PEER_TIMEOUT, secret="idle-peers-secret", timeout=10)
    a = mq.create("nng", 0, listen_to="tcp://127.0.0.1:0", **opts)
    with a:
        b = mq.create("nng", 1, attach_to=[a.addresses["tcp"]], **opts)
        with b:
            a.wait_for_peers(ids=[1], timeout=10)
            b.wait_for_peers(ids=[0], timeout=10)
            yield a, b


def test_an_idle_pair_stops_probing_and_a_busy_pair_does_not():
    with _pair() as (a, b):
        b.send(0, "x", 1)
        a.recv(timeout=5)
        # Within idle_after of the traffic both probe each other (heartbeats flow) ...
        assert _frames_in([a, b], 4 * HEARTBEAT) >= 2
        # ... after it, nothing at all is sent while nobody sends or waits.
        _wait_idle([a, b])
        assert _frames_in([a, b], 8 * HEARTBEAT) == 0
        assert 1 in a.peers() and 0 in b.peers()
        # Traffic resumes: so does probing, and nothing is judged silent meanwhile.
        for i in range(3):
            b.send(0, "x", i)
            assert a.recv(timeout=5).payload == i
        assert 1 in a.peers() and 0 in b.peers()


def _peer(node: mq.MQ, mode: str, **env: str) -> subprocess.Popen:
    env = {**os.environ, "MQ_TEST_LIVENESS": f"{HEARTBEAT},{PEER_TIMEOUT}", **env}
    proc = subprocess.Popen([sys.executable, "-m", "tests.jobs.nng_peer", "1", node.addresses["tcp"], mode],
                            cwd=REPO, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "ready"
    node.wait_for_peers(ids=[1], timeout=20)
    return proc


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
    proc.wait(10)


@pytest.mark.parametrize("op", ["call", "flush", "send", "stream-recv"])
def test_a_wait_on_a_peer_that_froze_while_idle_ends_with_peer_lost(op):
    """call, flush and send first send something (traffic: probing resumes); a stream's recv
    sends nothing: only the wait's dependency on its sender makes it probed."""
    node = mq.create("nng", 0, listen_to="tcp://127.0.0.1:0", heartbeat=HEARTBEAT, peer_timeout=PEER_TIMEOUT,
                     timeout=30, queue_size=4)
    with node:
        stream = mq.Stream(node, "s") if op == "stream-recv" else None
        proc = _peer(node, "streamer" if stream else "hang")
        try:
            if stream is not None:
                assert stream.recv(timeout=20).payload == 1
            _wait_idle([node])  # the pair is idle: nothing is probed
            freeze(proc.pid)  # frozen (every thread): its sockets stay open, it answers nothing
            began = time.monotonic()
            with pytest.raises(mq.PeerLost, match="node 1 (went silent|left the job)"):
                if stream is not None:
                    stream.recv(timeout=30)
                elif op == "call":
                    node.call(1, "echo", "hi", timeout=30)
                elif op == "flush":
                    node.send(1, "work", 1)
                    node.flush(1, timeout=30)
                else:  # its window (64 frames) fills, then the send waits for receipts
                    for _ in range(10_000):
                        node.send(1, "work", np.zeros(1024, np.uint8), timeout=30)
            took = time.monotonic() - began
            assert took <= PEER_TIMEOUT + HEARTBEAT + 1.5, f"{op}: PeerLost after {took:.2f}s"
        finally:
            _end(proc)


def test_a_sender_blocked_on_a_peer_that_hoards_for_longer_than_idle_after_is_not_told_it_died():
    hoard_s = IDLE_AFTER + PEER_TIMEOUT + 2.0
    node = mq.create("nng", 0, listen_to="tcp://127.0.0.1:0", heartbeat=HEARTBEAT, peer_timeout=PEER_TIMEOUT,
                     timeout=30)
    with node:
        proc = _peer(node, "hoard", MQ_TEST_HOARD_S=str(hoard_s))
        try:
            began = time.monotonic()
            for _ in range(200):  # far past its queue and our window: blocks until it reads
                node.send(1, "work", np.zeros(1024, np.uint8), timeout=30)
            node.flush(1, timeout=30)
            assert time.monotonic() - began >= hoard_s - 1.0, "the sends never waited: nothing was tested"
            assert 1 in node.peers()
        finally:
            _end(proc)


def test_a_wait_on_an_idle_live_peer_times_out_and_is_never_told_it_died():
    """The idle peer does not probe us: our probes ask it to answer (``want``), so its silence
    is never mistaken for a death."""
    node = mq.create("nng", 0, listen_to="tcp://127.0.0.1:0", heartbeat=HEARTBEAT, peer_timeout=PEER_TIMEOUT,
                     timeout=30)
    with node:
        stream = mq.Stream(node, "s")
        proc = _peer(node, "streamer")
        try:
            assert stream.recv(timeout=20).payload == 1
            _wait_idle([node])
            with pytest.raises(mq.Timeout):
                stream.recv(timeout=PEER_TIMEOUT * 3 + 1)
            assert 1 in node.peers()
        finally:
            _end(proc)


def test_traffic_on_an_idle_pair_starts_probing_at_once_at_both_ends():
    """Neither end waits for its heartbeat's idle tick (30 s) to notice traffic: the send and
    the receive wake it, and the first ping asks the other end to answer and probe too. (An end
    that noticed late was judged silent by the other after peer_timeout: a live peer lost.)"""
    with _pair() as (a, b):
        _wait_idle([a, b])
        assert not a._peers.by_id[1].probed and not b._peers.by_id[0].probed
        b.send(0, "x", 1)
        deadline = time.monotonic() + PEER_TIMEOUT
        while not (a._peers.by_id[1].probed and b._peers.by_id[0].probed):
            assert time.monotonic() < deadline, "traffic on an idle pair was not noticed at once"
            time.sleep(0.01)
        assert a.recv(timeout=5).payload == 1
        time.sleep(3 * PEER_TIMEOUT)  # both ends ping: neither is taken for dead
        assert 1 in a.peers() and 0 in b.peers()


def test_stop_asks_no_answer_of_a_peer_that_confirmed_everything():
    """A frozen peer that confirmed every frame holds up no stop(): only a peer that still owes
    a receipt is asked to answer the goodbye (every node of a 256-node job stopping at once,
    each waiting for 255 answers, took minutes). Default liveness: waiting on the frozen peer
    would take its peer_timeout (4 s)."""
    node = mq.create("nng", 0, listen_to="tcp://127.0.0.1:0", timeout=30)
    node.listen()
    proc = _peer(node, "hang")
    try:
        node.send(1, "work", 1, timeout=10)
        node.flush(1, timeout=10)  # confirmed
        freeze(proc.pid)
        began = time.monotonic()
        assert node.stop(timeout=5) is None  # nothing undelivered
        took = time.monotonic() - began
        assert took < 2.0, f"stop() waited {took:.2f}s for a peer that owed nothing"
    finally:
        node.stop(timeout=1, raise_undelivered=False)
        _end(proc)
