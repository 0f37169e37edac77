"""Hostile peers against a live node, on every surface it listens on (docs/concepts/trust.md).

A legit peer exchanges messages and calls with the node the whole time and must see every one
answered, in order. Meanwhile a faulty insider (joined with the job's secret) sends malformed
frames over its own authenticated links, each of which must be dropped and counted exactly
once, and a stranger (no secret) floods every surface with mutated real frames: NNG's join
port over tcp and ipc, the unix link, the tcp link, and raw TCP garbage. The node must keep
serving, keep its memory bounded, and count what it refused. Peers are processes
(tests/jobs/hostile_peer.py) for the nng node, nodes of the test's own process for inproc.
"""

from __future__ import annotations

import json
import os
import queue
import random
import subprocess
import sys
import tempfile
import threading
from typing import Any, Callable

import pytest

import mq
from mq.backends.inproc import transport as inproc
from mq.wire.codec import MSG, Codec
from mq.testing import wait_until
from tests.jobs.hostile_peer import (CONNECT, SURFACES, exchange, framed, malformed_frames, mutated,
                                     refused, seeds)

pytestmark = pytest.mark.timeout(180)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Stranger connections per surface (one frame, or a few datagrams, each).
FLOOD = {"nng-tcp": 300, "nng-ipc": 300, "unix": 600, "tcplink": 600, "raw-tcp": 200}
RSS_GROWTH_MB = 200


def hostile_counts(q: mq.MQ) -> dict[str, int]:
    """The node's counters of frames it dropped or refused, by cause."""
    s = q.stats()
    return {"malformed": s.dropped_malformed, "oversized": s.dropped_oversized, **s.rejected}


def hostile_count(q: mq.MQ) -> int:
    """Frames the node dropped or refused, whatever the cause."""
    return sum(hostile_counts(q).values())


def grown(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


class Inbox:
    """The node's receiving side, in a thread of its own: the legit peer's "seq" messages must
    come in order, one each; "insider-done" messages are kept."""

    def __init__(self, q: mq.MQ):
        self.q = q
        self.seq = 0
        self.errors: list[str] = []
        self.done: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="hostile-inbox")
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self.q.recv(timeout=0.2)
            except mq.Timeout:
                continue
            except mq.MQError as exc:  # stopped under us, or worse: the test reports it
                self.errors.append(f"recv: {type(exc).__name__}: {exc}")
                return
            if msg.topic == "seq":
                if msg.payload != self.seq:
                    self.errors.append(f"seq {msg.payload} arrived where {self.seq} was due")
                self.seq = msg.payload + 1
            else:
                self.done.append(msg.payload)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class Peer:
    """A hostile_peer.py process: lines in on stdin, lines out read with a bound."""

    def __init__(self, role: str, arg: str, env: dict[str, str] | None = None):
        self.role = role
        self.stderr = tempfile.TemporaryFile("w+")  # a file, not a pipe: its logs never block it
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.jobs.hostile_peer", role, arg], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True, env=env)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put(None)

    def line(self, timeout: float = 60) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            line = None
        if line is None:
            raise AssertionError(f"the {self.role} peer said nothing: {self.stop()[-3000:]}")
        return line

    def ask(self, line: str) -> Any:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(self.line())

    def finish(self) -> Any:
        """Close its stdin (it ends its work and reports) and read its last line."""
        self.proc.stdin.close()
        return json.loads(self.line())

    def stop(self) -> str:
        """End it (closing stdin ends each role; a stuck one is killed); its stderr."""
        if self.stderr.closed:
            return ""
        if not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc.stdout.close()
        self.stderr.seek(0)
        err = self.stderr.read()
        self.stderr.close()
        return err


def insider_flood(q: mq.MQ, inbox: Inbox, flood: Callable[[], dict[str, int]]) -> dict[str, int]:
    """The insider's malformed frames, sent by ``flood`` with an "insider-done" message behind
    them on each link: once those arrived, every frame before them was handled. Returns what
    was sent per link and what the node counted meanwhile."""
    before, done = hostile_count(q), len(inbox.done)
    sent = flood()
    assert wait_until(lambda: len(inbox.done) - done >= len(sent), 30), "the insider's last messages never came"
    return {**sent, "total": sum(sent.values()), "counted": hostile_count(q) - before}


def assert_insider_counted(report: dict[str, int]) -> None:
    # Every malformed frame on an authenticated link is dropped and counted on its own (the
    # frames stay within the link's framing, so none of them costs the link or its successors).
    assert report["counted"] == report["total"], report


def assert_legit_served(q: mq.MQ, inbox: Inbox, legit: dict[str, Any], rss_before: float) -> None:
    assert legit["errors"] == [] and legit["answered"] == legit["sent"] > 0, legit
    assert wait_until(lambda: inbox.seq == legit["sent"], 20), (inbox.seq, legit)
    assert inbox.errors == [], inbox.errors[:5]
    grew = rss_mb() - rss_before
    print(f"node RSS grew {grew:.1f} MB; final counters: {q.stats()}")
    assert grew < RSS_GROWTH_MB, f"the node's RSS grew {grew:.0f} MB under the flood"


# ---------------------------------------------------------------------- nng, peers in processes
@pytest.fixture
def node():
    q = mq.create("nng", 0, "learner", timeout=5)
    q.on("echo", lambda x: x)
    q.subscribe("seq")
    q.subscribe("insider-done")
    with q:
        yield q


def stranger_flood(q: mq.MQ, stranger: Peer, surface: str) -> dict[str, Any]:
    """One surface flooded; the node's counters must grow by what it must count there."""
    before = hostile_counts(q)
    report = stranger.ask(surface)
    wait_until(lambda: hostile_count(q) - sum(before.values()) >= report["expected"], 20)
    report["by_cause"] = grown(before, hostile_counts(q))
    report["counted"] = sum(report["by_cause"].values())
    print(f"stranger on {surface}: {report}")
    return report


def test_a_node_serves_its_peer_through_a_faulty_insider_and_a_stranger_on_every_surface(node):
    inbox = Inbox(node)
    stranger_env = {k: v for k, v in os.environ.items() if k != "MQ_SECRET"}
    stranger_env["MQ_TEST_COUNTS"] = json.dumps(FLOOD)
    peers = [Peer("legit", node.addresses["tcp"]), Peer("insider", node.addresses["tcp"]),
             Peer("stranger", json.dumps(node.addresses), stranger_env)]
    legit, insider, stranger = peers
    try:
        assert legit.line() == "ready" and stranger.line() == "ready"
        links = json.loads(insider.line())
        print(f"insider links: {links}")
        node.wait_for_peers(ids=[1, *links["ids"].values()], timeout=20)
        rss_before = rss_mb()
        # The insider goes first, while nothing else is refused: its count must be exact.
        report = insider_flood(node, inbox, lambda: insider.ask("flood"))
        print(f"insider: {report}")
        floods = [stranger_flood(node, stranger, surface) for surface in SURFACES]
        served = node.running and node.transport._reader.is_alive()
        kept = 1 in node.peers()
        result = legit.finish()
        print(f"legit peer: {result}")

        assert served, "the node stopped or its I/O thread died"
        assert kept, "the legit peer was lost"
        assert_legit_served(node, inbox, result, rss_before)
        assert_insider_counted(report)
        assert len(set(links["links"].values())) == 3, f"the insider did not get three kinds of link: {links}"
        for flood in floods:
            assert flood["not_closed"] == 0, f"the node kept refused links open: {flood}"
            assert flood["counted"] >= flood["expected"], f"refused frames went uncounted: {flood}"
    finally:
        for p in peers:
            p.stop()
        inbox.stop()


@pytest.mark.parametrize("surface", ["nng-tcp", "nng-ipc", "unix", "tcplink"])
def test_connections_that_send_nothing_count_as_no_dropped_frame(node, surface):
    # Counters count frames: a port scan, or a peer that connects and leaves, drops none. One
    # refused frame after them is the only thing to count (and shows the node looked).
    before = hostile_counts(node)
    for _ in range(10):
        CONNECT[surface](node.addresses, [], 0.05)
    frame = bytes(Codec().encode(MSG, "t", 5, 0, 0, "from nobody").to_bytes())
    assert CONNECT[surface](node.addresses, framed(surface, frame), 5.0), "a refused link stayed open"
    wait_until(lambda: hostile_count(node) - sum(before.values()) >= 1, 10)
    assert grown(before, hostile_counts(node)) == {"unauthenticated": 1}


# ---------------------------------------------------------------------- inproc, peers in this process
def test_an_inproc_node_serves_its_peer_through_a_faulty_insider_and_a_stranger():
    address = "inproc://hostile-node"
    node = mq.create("inproc", 0, listen_to=address, timeout=5)
    node.on("echo", lambda x: x)
    node.subscribe("seq")
    node.subscribe("insider-done")
    legit = mq.create("inproc", 1, attach_to=[address], timeout=10)
    insider = mq.create("inproc", 2, attach_to=[address], timeout=10)
    stop = threading.Event()
    result: dict[str, Any] = {}
    exchanging = threading.Thread(target=lambda: result.update(exchange(legit, 0, stop.is_set)), daemon=True)
    with node, legit, insider:
        inbox = Inbox(node)
        try:
            node.wait_for_peers(ids=[1, 2], timeout=10)
            legit.wait_for_peers(ids=[0], timeout=10)
            exchanging.start()
            rss_before = rss_mb()
            report = insider_flood(node, inbox, lambda: inproc_insider_flood(insider))
            print(f"insider: {report}")
            flood = inproc_stranger_flood(node, address)
            print(f"stranger: {flood}")
            stop.set()
            exchanging.join(20)
            print(f"legit peer: {result}")

            assert flood["sent"] == flood["frames"], f"the node's I/O thread stalled for 5 s: {flood}"
            assert not exchanging.is_alive() and node.running
            assert node.peers() == [1, 2], node.peers()
            assert_legit_served(node, inbox, result, rss_before)
            assert_insider_counted(report)
            assert flood["counted"] >= flood["expected"], f"refused frames went uncounted: {flood}"
        finally:
            stop.set()
            inbox.stop()


def inproc_insider_flood(insider: mq.MQ) -> dict[str, int]:
    """The malformed frames into the node's inbox as the insider's own link puts frames there,
    then an ordinary message behind them."""
    frames = [f for _, f in malformed_frames(insider.node_id, framing_ok=False)] * 10
    link = insider.transport._links[0]
    for frame in frames:
        link._put(insider.transport.address, bytearray(frame), 5.0)
    insider.send(0, "insider-done", {"node": insider.node_id, "sent": len(frames)})
    return {"inproc": len(frames)}


def inproc_stranger_flood(node: mq.MQ, address: str) -> dict[str, int]:
    """A node of another job (another secret): its join fails; then mutated frames from it."""
    stranger = mq.create("inproc", 3, attach_to=[address], secret="another job's secret", timeout=2)
    with stranger:
        before = hostile_count(node)
        rng = random.Random(3)
        originals = seeds()
        frames = [mutated(rng, originals) for _ in range(2000)]
        target = inproc._REGISTRY[address]  # where a greeting goes: there is no link to use
        sent = 0
        try:
            for frame in frames:
                target._put(stranger.transport.address, bytearray(frame), 5.0)
                sent += 1
        except mq.Timeout:
            pass  # the node took nothing for 5 s: the assertions say so
        expected = sum(refused(f) for f in frames[:sent])
        wait_until(lambda: hostile_count(node) - before >= expected, 20)
        assert 3 not in node.peers()
        return {"frames": len(frames), "sent": sent, "expected": expected,
                "counted": hostile_count(node) - before}
