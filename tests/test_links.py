"""nng's own links (mq.backends.nng.links.unix: unix SEQPACKET on one host; mq.backends.nng.links.tcp: TCP
records between hosts): framing on real kernel sockets, hostile datagrams and records, a frame cut
off by a timeout, and the nng transport choosing the link per peer, falling back to NNG's own
sockets where a link cannot be opened."""

from __future__ import annotations

import contextlib
import os
import signal
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
from mq.backends.nng.links import tcp as tcplink
from mq.backends.nng.links import unix as unixlink
from mq.backends.nng.links.base import Sender
from mq.wire.codec import MSG, RELAY, Codec, split
from mq.fanout.cut_through import AHEAD, AHEAD_MIN, Arrival
from mq.errors import ProtocolError
from mq.testing import wait_until

pytestmark = pytest.mark.timeout(60)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAD = struct.Struct("<BxxxIQ")  # a tcp link record's head (its flags byte 0)
FLAGGED = struct.Struct("<BBxxIQ")  # the same, with its flags byte


def frame_of(payload, topic: str = "t"):
    return Codec().encode(MSG, topic, 1, 0, 0, payload)


def decoded(data) -> object:
    return Codec().decode(*split(data)).payload


@contextlib.contextmanager
def joined(kind: str, trusted: bool = True):
    """(Outbound, Inbound, lost-calls) of one kind of link, joined through a real listener;
    ``trusted``: whether the link passed the handshake (what core's ``trusts`` answers)."""
    lost: list[int] = []
    if kind == "unix":
        name = f"mq-test-{uuid.uuid4().hex[:12]}"
        listener = unixlink.listen(name)
        out = unixlink.Outbound(name, 5.0, lambda: lost.append(1))
    else:
        listener = tcplink.listen("127.0.0.1")
        out = tcplink.Outbound(f"tcp://127.0.0.1:{listener.getsockname()[1]}", 5.0, lambda: lost.append(1))
    listener.setblocking(True)
    conn, _ = listener.accept()
    inbound = (unixlink.Inbound if kind == "unix" else tcplink.Inbound)(conn, 64 << 20, lambda _link: trusted)
    try:
        yield out, inbound, lost
    finally:
        out.close()
        inbound.close()
        listener.close()


@pytest.fixture(params=["unix", "tcp"])
def link_pair(request):
    with joined(request.param) as pair:
        yield pair


@pytest.fixture
def unix_pair():
    with joined("unix") as pair:
        yield pair


@pytest.fixture
def tcp_pair():
    with joined("tcp") as pair:
        yield pair


def read_all(inbound, count: int, timeout: float = 10) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        frame = inbound.read()
        if frame is None:
            time.sleep(0.002)
        else:
            got.append(frame)
    assert len(got) == count, f"{len(got)} of {count} frames within {timeout}s"
    return got


def read_all_available(inbound, quiet: float = 0.5) -> list:
    got, last = [], time.monotonic()
    while time.monotonic() - last < quiet:
        frame = inbound.read()
        if frame is None:
            time.sleep(0.005)
        else:
            got.append(frame)
            last = time.monotonic()
    return got


def _raises(inbound, why: str) -> bool:
    try:
        inbound.read()
    except ProtocolError as exc:
        assert why in str(exc)
        return True
    return False


def _closed_by_peer(s: socket.socket) -> bool:
    s.settimeout(0.1)
    try:
        return s.recv(1) == b""
    except socket.timeout:
        return False
    except ConnectionError:
        return True


# ---------------------------------------------------------------------- both kinds of link
def test_small_and_chunked_frames_arrive_whole_and_in_order(link_pair):
    out, inbound, _ = link_pair
    big = np.arange(3 * tcplink.PIECE + 12_345, dtype=np.uint8)  # many datagrams / four pieces
    payloads = [1, {"blob": big}, *range(2, 200)]
    sender = threading.Thread(target=lambda: [out.send(1, frame_of(x), 5) for x in payloads])
    sender.start()  # more than the socket buffer holds: it waits for the reader
    got = read_all(inbound, len(payloads))
    sender.join(10)
    assert decoded(got[0]) == 1 and [decoded(g) for g in got[2:]] == list(range(2, 200))
    assert np.array_equal(decoded(got[1])["blob"], big)
    assert inbound.read() is None  # nothing kept back, nothing more


def test_a_frame_cut_off_by_a_timeout_is_dropped_and_the_next_arrives(link_pair):
    out, inbound, _ = link_pair
    out.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)  # fill up soon
    huge = frame_of(np.zeros(32 << 20, dtype=np.uint8))  # far more than the socket buffers hold
    with pytest.raises(mq.Timeout):
        out.send(1, huge, 0.3)  # nobody reads: part of it left, the rest timed out
    sender = threading.Thread(target=out.send, args=(1, frame_of("after"), 10))
    sender.start()  # sends the abort mark first (tcp: after the rest of the piece it began)
    got = read_all(inbound, 1, timeout=20)
    sender.join(10)
    assert [decoded(g) for g in got] == ["after"]  # the cut frame never surfaced
    assert inbound.read() is None


def test_a_closed_sender_reads_as_end_of_link(link_pair):
    out, inbound, _ = link_pair
    out.close()
    with pytest.raises(EOFError):
        for _ in range(500):
            inbound.read()
            time.sleep(0.01)


# ---------------------------------------------------------------------- unix datagrams
@pytest.mark.parametrize("kind, data, why", [
    ("unix", b"\x01\x02\x03", "holds no frame length"),
    ("unix", struct.pack("<Q", 1 << 40) + b"x", "exceeds max_frame_bytes"),
    ("unix", struct.pack("<Q", 10) + b"x" * 20, "begins with a 20-byte piece"),
    ("unix", struct.pack("<Q", 100_000) + b"x" * 100, "begins with a 100-byte piece"),
    ("unix", struct.pack("<Q", 200_000) + b"x" * unixlink.DATAGRAM, "longer than the 65536 bytes due"),
    ("tcp", HEAD.pack(9, 0, 0), "tag 9"),
    ("tcp", HEAD.pack(tcplink.BEGIN, 8, 1 << 40), "exceeds max_frame_bytes"),
    ("tcp", HEAD.pack(tcplink.BEGIN, 20, 10), "begins with a 20-byte piece"),
    ("tcp", HEAD.pack(tcplink.BEGIN, 0, 10), "begins with a 0-byte piece"),
    ("tcp", HEAD.pack(tcplink.BEGIN, tcplink.PIECE + 1, 10 << 20), f"begins with a {tcplink.PIECE + 1}-byte piece"),
    ("tcp", HEAD.pack(tcplink.MORE, 10, 0), "a 10-byte piece where 0 bytes were due"),
    ("tcp", HEAD.pack(tcplink.BEGIN, 10, 100) + b"x" * 10 + HEAD.pack(tcplink.BEGIN, 10, 100), "inside another"),
    ("tcp", HEAD.pack(tcplink.BEGIN, 10, 100) + b"x" * 10 + HEAD.pack(tcplink.MORE, 91, 0), "91-byte piece"),
    ("tcp", HEAD.pack(tcplink.ABORT, 5, 0), "tag 3"),
    ("tcp", FLAGGED.pack(tcplink.BEGIN, 2, 10, 100), "flags 2"),
    ("tcp", HEAD.pack(tcplink.BEGIN, 10, 100) + b"x" * 10 + FLAGGED.pack(tcplink.MORE, tcplink.SHARED, 90, 0),
     "tag 2 and flags 1"),
    ("tcp", FLAGGED.pack(tcplink.ABORT, tcplink.SHARED, 0, 0), "tag 3 and flags 1"),
])
def test_malformed_datagrams_and_records_are_protocol_errors(kind, data, why):
    with joined(kind) as (out, inbound, _):
        out.sock.send(data)  # one datagram (unix); a few bytes of a stream (tcp)
        assert wait_until(lambda: _raises(inbound, why), 5)


@pytest.mark.parametrize("kind", ["unix", "tcp"])
def test_a_frame_no_memory_can_hold_is_a_protocol_error_not_a_crash(kind):
    """A peer allowed huge frames (max_frame_bytes) claims one far past RAM: the receive
    buffer (numpy.empty for large frames) cannot be made, and that is the peer's fault."""
    huge = 1 << 61
    with joined(kind) as (out, inbound, _):
        inbound.max_frame = 1 << 62
        if kind == "unix":
            out.sock.send(struct.pack("<Q", huge) + b"x" * (unixlink.DATAGRAM - 8))
        else:
            out.sock.send(HEAD.pack(tcplink.BEGIN, 8, huge) + b"x" * 8)
        assert wait_until(lambda: _raises(inbound, "no memory for a frame"), 5)


def test_a_continuation_with_a_wrong_tag_is_a_protocol_error(unix_pair):
    out, inbound, _ = unix_pair
    out.sock.send(struct.pack("<Q", 100_000) + b"x" * (unixlink.DATAGRAM - 8))
    out.sock.send(b"\x07" + b"y" * 100)
    assert wait_until(lambda: _raises(inbound, "tag 7"), 5)


# ---------------------------------------------------------------------- tcp records
def test_a_relayed_frame_lands_in_the_pool_the_link_lends_and_reads_as_shared(tcp_pair):
    """A RELAY frame (its BEGIN flagged SHARED) lands in what ``lend`` gives, the node's shm
    pool, so the relay passes it on to its host by handle; other frames, and a SHARED one the
    pool has no room for, land in the link's own buffers."""
    from mq.datapaths.shm.pool import Pool

    out, inbound, _ = tcp_pair
    pool = Pool(max_bytes=16 << 20)
    inbound.lend = pool.lend
    reader = _Reader(inbound)  # reads as the I/O thread does, while the sender writes
    reader.start()
    try:
        data = np.arange(2 << 20, dtype=np.uint8)
        out.send(1, Codec().encode(RELAY, "w", 1, 0, 0, [{"o": 1}, data]), 10.0)
        assert wait_until(lambda: reader.frames, 10)
        assert pool.stats["lent"] == 1
        body = Codec().decode(*split(reader.frames[0])).payload[1]
        assert np.array_equal(body, data) and not body.flags.writeable  # shared with its host
        assert pool.place(body, [3], timeout=1) and pool.stats["by_handle"] == 1
        out.send(1, frame_of(data), 10.0)  # a plain MSG: not lent
        # 2 + 7 MiB lent would be over half the pool: the link's own buffer then.
        out.send(1, Codec().encode(RELAY, "w", 1, 0, 0, [{"o": 1}, np.ones(7 << 20, np.uint8)]), 10.0)
        assert wait_until(lambda: len(reader.frames) == 3, 10)
        assert np.array_equal(decoded(reader.frames[1]), data)
        assert Codec().decode(*split(reader.frames[2])).payload[1].sum() == 7 << 20
        assert pool.stats["lent"] == 1
        del body
    finally:
        reader.stop.set()
        reader.join(5)
        reader.frames.clear()
        pool.close()


def test_a_tcp_send_cut_off_mid_piece_owes_its_rest_then_an_abort(tcp_pair):
    out, inbound, _ = tcp_pair
    out.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
    with pytest.raises(mq.Timeout):
        out.send(1, frame_of(np.zeros(32 << 20, dtype=np.uint8)), 0.3)
    assert out._owed and out._abort_due  # the rest of a piece, then the abort, before anything else
    sender = threading.Thread(target=out.send, args=(1, frame_of("after"), 10))
    sender.start()
    assert [decoded(g) for g in read_all(inbound, 1, timeout=20)] == ["after"]
    sender.join(10)
    assert not out._owed and not out._abort_due


def test_a_tcp_send_that_times_out_leaves_only_whole_frames(tcp_pair):
    out, inbound, _ = tcp_pair
    out.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
    with pytest.raises(mq.Timeout):
        while True:  # fill the socket buffers with small frames until one cannot go whole
            out.send(1, frame_of(np.zeros(8 << 10, dtype=np.uint8)), 0.05)
    # Either nothing of the last one left (nothing owed) or some did (owed, then aborted): the
    # reader sees only whole frames either way.
    got = read_all_available(inbound)
    assert got and all(decoded(f).shape == (8 << 10,) for f in got)


def test_a_record_split_across_segments_still_reads_whole(tcp_pair):
    out, inbound, _ = tcp_pair
    frame = frame_of("slow")
    data = HEAD.pack(tcplink.BEGIN, frame.size, frame.size) + frame.to_bytes()
    for i in range(len(data) - 1):  # a byte at a time: every read sees a partial head or piece
        out.sock.sendall(data[i:i + 1])
        time.sleep(0.001)
        assert inbound.read() is None
    out.sock.sendall(data[-1:])
    assert [decoded(f) for f in read_all(inbound, 1)] == ["slow"]


def test_a_unix_link_waits_out_a_full_backlog_instead_of_failing():
    """Regression (a 256-node join): a unix connect past a full backlog fails at once with
    EAGAIN, and the link fell back to NNG's tcp. It waits for room now, within its timeout."""
    name = f"mq-test-{uuid.uuid4().hex[:12]}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind("\0" + name)
    listener.listen(0)
    queued = []
    try:
        for _ in range(8):  # fill the backlog (its size is the kernel's choice: fill until refused)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.setblocking(False)
            try:
                s.connect("\0" + name)
            except BlockingIOError:
                s.close()
                break
            queued.append(s)
        else:
            pytest.fail("the backlog never filled")
        threading.Timer(0.3, lambda: listener.accept()[0].close()).start()  # room, later
        t0 = time.monotonic()
        out = unixlink.Outbound(name, 5.0, lambda: None)
        waited = time.monotonic() - t0
        out.close()
        assert waited >= 0.2, f"connected after {waited:.3f}s, before the listener made room"
        with pytest.raises(OSError):  # and a backlog that stays full still fails by its timeout
            unixlink.Outbound(name, 0.2, lambda: None)
    finally:
        for s in queued:
            s.close()
        listener.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "*", ""])
def test_a_tcp_link_listens_on_the_nodes_interface_or_every_one(host):
    listener = tcplink.listen(host)
    try:
        out = tcplink.Outbound(f"tcp://127.0.0.1:{listener.getsockname()[1]}", 5.0, lambda: None)
        out.close()
    finally:
        listener.close()


# ---------------------------------------------------------------------- in the nng transport
@contextlib.contextmanager
def peer_of(node: mq.MQ, **env: str):
    """tests.jobs.nng_peer as node 1 (mode hang) in another process on this host, joined to
    ``node``, with ``env`` (MQ_TEST_PROTOCOL=tcp: over the tcp route); killed on exit."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.jobs.nng_peer", "1", node.addresses["tcp"], "hang"],
                            cwd=REPO, stdout=subprocess.PIPE, text=True, env=dict(os.environ, **env))
    try:
        assert proc.stdout.readline().strip() == "ready"
        node.wait_for_peers(ids=[1], timeout=10)
        yield proc
        if node.running and 1 in node.peers():
            node.flush(1, timeout=10)  # all confirmed: the kill below loses nothing (stop() is quiet)
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()


@pytest.fixture(params=["unix", "tcp"])
def peer_proc(request):
    """(node 0, node 1's process, the kind of link between them) on the shm or tcp route."""
    protocol = "auto" if request.param == "unix" else "tcp"
    node = mq.create("nng", 0, "learner", protocol=protocol, timeout=5)
    with node, peer_of(node, MQ_TEST_PROTOCOL=protocol) as proc:
        yield node, proc, request.param


def test_a_peer_is_reached_over_a_link_of_our_own_both_ways(peer_proc):
    node, _, kind = peer_proc
    assert node.routes()[1].kind == ("shm" if kind == "unix" else "tcp")
    assert isinstance(node.transport._out[1], unixlink.Outbound if kind == "unix" else tcplink.Outbound)
    assert node.call(1, "echo", {"x": np.arange(5)}, timeout=5)["x"].tolist() == [0, 1, 2, 3, 4]
    assert node.call(1, "echo", "y" * 300_000, timeout=5) == "y" * 300_000  # inline, in pieces
    # The answers came back on a link the peer opened to us, not through NNG.
    assert [link.link[0] for link in node.transport._inbound.values()] == [kind]


def test_hostile_bytes_close_that_link_only(peer_proc):
    node, _, kind = peer_proc
    if kind == "unix":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect("\0" + node.addresses["unix"])
        garbage = b"\x00\x01"  # no frame length
    else:
        s = socket.create_connection(tcplink.split_address(node.addresses["tcplink"]), 5)
        garbage = HEAD.pack(7, 1, 1) + b"\x00"  # no such record
    try:
        s.send(garbage)  # the stranger's link is closed, counted
        assert wait_until(lambda: node.stats().dropped_malformed >= 1)
        assert wait_until(lambda: _closed_by_peer(s), 5)
    finally:
        s.close()
    assert node.call(1, "echo", "still here", timeout=5) == "still here"


def test_a_sigkilled_peer_is_lost_at_once(peer_proc):
    node, proc, _ = peer_proc
    os.kill(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    assert wait_until(lambda: 1 not in node.peers(), 5)
    assert time.monotonic() - killed < 2.0  # the link's hang-up, not the heartbeat bound
    with pytest.raises(mq.PeerLost):
        node.send(1, "work", 1)


@pytest.mark.parametrize("firewall", ["refuses", "drops"])
def test_a_link_port_that_cannot_be_reached_falls_back_to_nng_tcp(firewall):
    node = mq.create("nng", 0, protocol="tcp", timeout=5).listen()
    sink = socket.socket()  # a listener whose backlog is full: SYNs to it are dropped
    sink.bind(("127.0.0.1", 0))
    sink.listen(0)
    filler = socket.create_connection(sink.getsockname(), 2)
    try:
        if firewall == "refuses":  # as if a firewall let only NNG's port in
            for listener, kind in list(node.transport._listeners.values()):
                if kind is tcplink.Inbound:
                    listener.close()
        else:  # the port the HELLO names swallows SYNs: the peer's connect times out (2 s)
            node.transport.addresses["tcplink"] = f"tcp://127.0.0.1:{sink.getsockname()[1]}"
        with peer_of(node, MQ_TEST_PROTOCOL="tcp"):
            assert node.call(1, "echo", "via NNG", timeout=5) == "via NNG"  # the answer found a way
            assert not [link for link in node.transport._inbound.values() if link.link[0] == "tcp"]
            assert isinstance(node.transport._out[1], tcplink.Outbound)  # its port was open
    finally:
        node.stop()
        filler.close()
        sink.close()


@pytest.mark.parametrize("protocol, options", [
    ("auto", {"unix_links": False}), ("tcp", {"tcp_links": False}), ("tcp", {"batch_window": 100e-6})])
def test_links_off_or_batching_use_nng_sockets(protocol, options):
    node = mq.create("nng", 0, protocol=protocol, timeout=5, **options)
    with node, peer_of(node, MQ_TEST_PROTOCOL=protocol):
        assert not isinstance(node.transport._out[1], Sender)
        assert ("unix" in node.addresses) == options.get("unix_links", True)
        assert ("tcplink" in node.addresses) == options.get("tcp_links", True)
        assert node.call(1, "echo", 7, timeout=5) == 7


@pytest.mark.parametrize("bad", [5, "udp://1.2.3.4:5", "tcp://host:port", "tcp://host"])
def test_a_malformed_tcp_link_address_from_a_peer_is_a_protocol_error(bad):
    # What a peer advertises is the peer's fault: refused like a malformed frame, not our ConfigError.
    from mq.routing import Route

    node = mq.create("nng", 0, protocol="tcp", timeout=5).listen()
    try:
        info = {"addresses": {"tcp": "tcp://127.0.0.1:9", "tcplink": bad}, "incarnation": "x"}
        with pytest.raises(ProtocolError, match="malformed tcp link address"):
            node.transport.connect(7, info, Route(kind="tcp", gpu="tcp", reason="test", peer=7))
        assert 7 not in node.transport._out  # nothing half-made
    finally:
        node.stop()


@pytest.mark.parametrize("kind", ["unix", "tcp"])
def test_a_link_that_has_not_authenticated_gets_no_room_for_a_large_frame(kind):
    """Before the handshake a reader allocates at most handshake.MAX_FRAME bytes for a frame:
    a 64 MiB announcement is refused from its length alone (Oversized), nothing allocated;
    the same frame on a trusted link arrives whole."""
    from mq.wire import handshake
    from mq.errors import Oversized

    big = frame_of(np.zeros(handshake.MAX_FRAME, np.uint8))  # just over the bound with its header
    for trusted in (False, True):
        with joined(kind, trusted) as (out, inbound, _lost):
            sender = threading.Thread(target=lambda: _send_quietly(out, big))
            sender.start()
            if trusted:
                assert decoded(read_whole(inbound)).nbytes == handshake.MAX_FRAME
            else:
                with pytest.raises(Oversized, match="before the handshake"):
                    read_whole(inbound)
                inbound.close()  # as the transport does: the sender's wait ends
            sender.join(10)
            assert not sender.is_alive()


def _send_quietly(out, frame) -> None:
    try:
        out.send(1, frame, 5.0)
    except mq.MQError:
        pass  # the reader refused it and closed the link


def read_whole(inbound, timeout: float = 10.0):
    """The next whole frame of a link (polling its non-blocking reader)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        frame = inbound.read()
        if frame is not None:
            return frame
        time.sleep(0.001)
    raise AssertionError("no frame arrived")


# ---------------------------------------------------------------- cut-through (mq.fanout.cut_through)
class _Reader(threading.Thread):
    """Reads a link in the background, as the transport's I/O thread does: whole frames go to
    ``frames``; a large frame's header (``Begun``) to ``begun``, followed when ``follow``."""

    def __init__(self, inbound, follow: bool = False):
        super().__init__(daemon=True)
        self.inbound, self.follow = inbound, follow
        self.frames: list = []
        self.begun: list = []
        self.arrivals: list = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            frame = self.inbound.read()
            if frame is None:
                time.sleep(0.0005)
            elif type(frame) is tcplink.Begun:
                if self.follow:
                    self.arrivals.append(frame.watch())
                self.begun.append(frame)
            else:
                self.frames.append(frame)


@contextlib.contextmanager
def _relay_chain():
    """upstream -> relay -> downstream over two real tcp links: (the upstream's socket, written
    by hand, the relay's reader, the relay's link on, the downstream's reader)."""
    with joined("tcp") as (up, relay_in, _), joined("tcp") as (relay_out, down_in, _):
        relay_in.announce = down_in.announce = True
        up.sock.setblocking(True)
        readers = [_Reader(relay_in, follow=True), _Reader(down_in)]
        for r in readers:
            r.start()
        try:
            yield up.sock, readers[0], relay_out, readers[1]
        finally:
            for r in readers:
                r.stop.set()
                r.join(5)


# Records the upstream sends before holding back the rest: enough for the relay's first piece
# and what it waits for beyond it (mq.fanout.cut_through.AHEAD), so some of the frame goes on.
_FIRST = (tcplink.PIECE + AHEAD) // tcplink.PIECE + 2


def _hop_of(begun, arrival, topic: str):
    """The frame a relay sends on for ``begun``: its own header, the incoming frame's body."""
    from mq.wire.codec import Frame
    from mq.fanout.cut_through import ArrivingFrame, body_offset

    header, buffers = split(begun.frame)
    built = Frame.build(MSG, topic, 2, 0, 0, header[6], buffers)
    return ArrivingFrame(MSG, built.head, built.buffers, built.sizes, arrival, body_offset(begun.frame))


def test_a_relay_sends_a_frame_on_while_it_arrives_and_it_lands_whole():
    data = np.random.default_rng(7).integers(0, 256, 8 << 20, dtype=np.uint8)
    incoming = frame_of({"blob": data, "n": 1})
    records = [b"".join(bytes(p) for p in r) for r in tcplink._records(incoming.parts(), incoming.size)]
    with _relay_chain() as (up, relay, relay_out, down):
        up.sendall(b"".join(records[:_FIRST]))  # the header and the first pieces; the rest held back
        assert wait_until(lambda: relay.begun, 10)
        hop = _hop_of(relay.begun[0], relay.arrivals[0], "on")
        sent: list = []
        sender = threading.Thread(target=lambda: sent.append(relay_out.send(2, hop, 20)))
        sender.start()
        # The next host has the frame's header and first pieces while the rest is still upstream.
        assert wait_until(lambda: down.begun, 10), "nothing went on before the frame was whole"
        assert relay.arrivals[0].filled < incoming.size and not relay.frames and sender.is_alive()
        up.sendall(b"".join(records[_FIRST:]))
        sender.join(20)
        assert sent == [None]
        assert wait_until(lambda: down.frames and relay.frames, 10)
    assert bytes(relay.frames[0]) == incoming.to_bytes().tobytes()
    env = Codec().decode(*split(down.frames[0]))
    assert env.topic == "on" and env.sender == 2
    assert env.payload["n"] == 1 and np.array_equal(env.payload["blob"], data)


def test_a_hop_looks_ahead_about_a_millisecond_of_its_frames_arrival():
    """A relay that must wait for a piece waits for about 1 ms of the frame's arrival rate
    more (fewer wake-ups), within [AHEAD_MIN, AHEAD]: on a slow link a fixed 2 MiB would hold
    every hop of a chain back by ms (8 ms at 2 Gbit/s)."""
    def ahead(took: float, came: int) -> int:
        arrival = Arrival(1 << 40)
        arrival._t0 -= took  # the frame began arriving `took` seconds ago
        arrival.advance(came)
        return arrival.ahead()

    assert 240_000 <= ahead(1.0, 250_000_000) <= 250_000  # 2 Gbit/s: 250 KB, not 2 MiB
    assert ahead(0.001, 100 << 20) == AHEAD  # faster than 2 MiB a ms: AHEAD at most
    assert ahead(1.0, 1 << 20) == AHEAD_MIN  # a trickle: still a piece's worth, not a byte
    assert ahead(0.0, 0) == AHEAD_MIN  # nothing measured yet


def test_a_frame_cut_off_upstream_is_cut_off_downstream_and_the_links_go_on():
    incoming = frame_of(np.ones(8 << 20, dtype=np.uint8))
    records = [b"".join(bytes(p) for p in r) for r in tcplink._records(incoming.parts(), incoming.size)]
    with _relay_chain() as (up, relay, relay_out, down):
        up.sendall(b"".join(records[:_FIRST]))
        assert wait_until(lambda: relay.begun, 10)
        hop = _hop_of(relay.begun[0], relay.arrivals[0], "on")
        errors: list = []

        def send_on() -> None:
            try:
                relay_out.send(2, hop, 20)
            except mq.MQError as exc:
                errors.append(exc)

        sender = threading.Thread(target=send_on)
        sender.start()
        assert wait_until(lambda: down.begun, 10)
        up.sendall(HEAD.pack(tcplink.ABORT, 0, 0))  # the upstream sender gave up on it
        sender.join(10)
        assert len(errors) == 1 and isinstance(errors[0], mq.ClosedError), errors
        assert "cut off upstream" in str(errors[0])
        # Both links keep their framing: the next frames arrive whole, the cut one never does.
        up.sendall(b"".join(bytes(p) for r in tcplink._records(frame_of("next").parts(), frame_of("next").size)
                            for p in r))
        relay_out.send(2, frame_of("after"), 10)
        assert wait_until(lambda: relay.frames and down.frames, 10)
        time.sleep(0.2)
    assert [decoded(f) for f in relay.frames] == ["next"]
    assert [decoded(f) for f in down.frames] == ["after"]
