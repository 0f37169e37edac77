"""Peers for tests/test_hostile.py, and the frames they send.

    python -m tests.jobs.hostile_peer legit ATTACH
        joins the node at ATTACH, prints "ready", then until stdin closes sends "seq" i and calls
        "echo" i in turn; prints {"sent", "answered", "errors"} as JSON.
    python -m tests.jobs.hostile_peer insider ATTACH
        three nodes that join properly over a unix link, a tcp link and an NNG pipe; prints
        their ids and link types; at each "flood" line sends :func:`malformed_frames` raw through
        each node's own authenticated link, then an "insider-done" message behind them; prints
        what it sent.
    python -m tests.jobs.hostile_peer stranger ADDRESSES_JSON
        no secret, no handshake: for each surface named on stdin (:data:`SURFACES`) opens
        connections to it and sends mutated frames; prints per surface how many connections
        the node must count (``expected``) and how many of those it did not hang up on.

Frames a node must refuse are built here once, so the nng test (peers in processes) and the
inproc test (peers in the test's own process) send the same ones.
"""

from __future__ import annotations

import json
import os
import random
import socket
import struct
import sys
import threading
from typing import Any, Callable, Iterator

import msgpack

from mq.wire import handshake
from mq.wire.codec import ALIGN, MAX_DEPTH, MSG, VERSION
from tests.fuzz.mutate import mutate

CORPUS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fuzz", "corpus", "handshake")
SEEDS = ("seed-hello", "seed-hello-ack", "seed-link", "seed-msg-0-buffers", "seed-msg-1-buffer",
         "seed-msg-3-buffers", "seed-empty-tensor")
SURFACES = ("nng-tcp", "nng-ipc", "unix", "tcplink", "raw-tcp")
_FIELDS = ("version", "kind", "topic", "sender", "seq", "corr", "tree", "sizes", "descs", "sent_at")
_U64 = struct.Struct("<Q")
_RECORD = struct.Struct("<BxxxIQ")  # the tcp link's record head: tag, piece length, frame size
BEGIN, MORE, ABORT = 1, 2, 3


# ---------------------------------------------------------------------- frames
class RawFrame:
    """Bytes that go out as one frame through a link's own ``send``: the link lays them out in
    its framing (length prefix, records, NNG message) exactly as it does a real frame's."""

    kind = MSG

    def __init__(self, data: bytes):
        self.data = bytes(data)
        self.size = self.nbytes = len(self.data)
        self.layout: dict[str, Any] = {}

    def write_into(self, out: memoryview) -> None:
        out[:self.size] = self.data

    def parts(self) -> list[memoryview]:
        return [memoryview(self.data)]

    def to_bytes(self) -> bytearray:
        return bytearray(self.data)


def frame_of(head: list[Any], buffers: list[bytes] = ()) -> bytes:
    """The contiguous layout of any envelope, well formed or not."""
    header = msgpack.packb(head, use_bin_type=True)
    out = bytearray(struct.pack("<I", len(header)) + header)
    for b in buffers:
        out += bytes(-len(out) % ALIGN) + b
    return bytes(out)


def malformed_frames(sender: int, framing_ok: bool = True) -> list[tuple[str, bytes]]:
    """Frames an authenticated peer may send by mistake, each of which the node must drop and
    count exactly once, leaving the link up. With ``framing_ok`` False, also frames whose own
    layout is broken (header length, field count, buffer sizes): a unix or tcp link delivers
    those one by one, but in an NNG message batching several frames, one would hide the rest."""
    def env(**fields: Any) -> list[Any]:
        head = [VERSION, MSG, "t", sender, 0, 0, msgpack.packb(1), [], None, 1.0]
        for name, value in fields.items():
            head[_FIELDS.index(name)] = value
        return head

    ext = msgpack.ExtType
    deep = msgpack.packb([])
    for _ in range(MAX_DEPTH + 8):
        deep = msgpack.packb([ext(1, deep)])
    frames = [
        ("version", frame_of(env(version=VERSION + 97))),
        ("kind", frame_of(env(kind=99))),
        ("negative-kind", frame_of(env(kind=-1))),
        ("topic-type", frame_of(env(topic=5))),
        ("sender-type", frame_of(env(sender="me"))),
        ("corr-type", frame_of(env(corr=None))),
        ("tree-type", frame_of(env(tree=5))),
        ("tree-garbage", frame_of(env(tree=b"\xc1\xc1"))),
        ("tree-trailing", frame_of(env(tree=msgpack.packb(1) + b"\x01"))),
        ("deep-tuples", frame_of(env(tree=deep))),
        ("unknown-ext", frame_of(env(tree=msgpack.packb(ext(77, b"x"))))),
        ("pickle", frame_of(env(tree=msgpack.packb(ext(4, b"\x80\x05N."))))),
        ("missing-buffer", frame_of(env(tree=msgpack.packb(ext(2, msgpack.packb(["<f8", [2], 3])))))),
        ("shape-mismatch", frame_of(env(tree=msgpack.packb(ext(2, msgpack.packb(["<f8", [5], 0]))),
                                        sizes=[16]), [bytes(16)])),
        ("object-dtype", frame_of(env(tree=msgpack.packb(ext(2, msgpack.packb(["|O", [2], 0]))),
                                      sizes=[16]), [bytes(16)])),
        ("tensor-dtype", frame_of(env(tree=msgpack.packb(ext(3, msgpack.packb(["qint8", [4], 0, "cpu"]))),
                                      sizes=[4]), [bytes(4)])),
        ("sent-at-type", frame_of(env(sent_at="now"))),
        ("forged-descriptor", frame_of(env(tree=msgpack.packb(ext(5, msgpack.packb(0))), sizes=[0],
                                           descs={0: [999, 999, 1, 0, 8]}), [b""])),
        ("descs-type", frame_of(env(descs="x"))),
    ]
    if not framing_ok:
        frames += [
            ("header-overrun", struct.pack("<I", 500) + msgpack.packb(env())),
            ("eight-fields", bytes.fromhex("0c000000980200a174090000c401c090")),
            ("header-not-list", frame_of(7)),  # type: ignore[arg-type]
            ("sizes-overrun", frame_of(env(sizes=[1000]))),
            ("sizes-negative", frame_of(env(sizes=[-1]))),
            ("sizes-type", frame_of(env(sizes="x"))),
            ("three-bytes", b"\x01\x00\x00"),
        ]
    return frames


def seeds() -> list[bytes]:
    """Real frames to mutate: a node's HELLO, HELLO_ACK and LINK, and MSG frames."""
    out = []
    for name in SEEDS:
        with open(os.path.join(CORPUS, name), "rb") as f:
            out.append(f.read())
    return out


def mutated(rng: random.Random, originals: list[bytes]) -> bytes:
    """A real frame with bits flipped, cut short, a field changed, grown past the handshake
    limit, or plain random bytes."""
    frame = bytearray(rng.choice(originals))
    how = rng.randrange(6)
    if how == 0:
        for _ in range(rng.randrange(1, 9)):
            frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
    elif how == 1:
        frame = frame[:rng.randrange(len(frame))]
    elif how in (2, 3):
        frame = bytearray(mutate(bytes(frame), 60_000, rng.randrange(2**32), lambda d, _n: d))
    elif how == 4:
        frame = bytearray(rng.randbytes(rng.randrange(1, 2000)))
    else:
        frame += bytes(handshake.MAX_FRAME)
    return bytes(frame)


def refused(frame: bytes) -> bool:
    """Whether the handshake parser refuses ``frame`` (then the node counts it): a mutation can
    leave a HELLO valid, and a valid HELLO is a join attempt, not a refused frame."""
    try:
        handshake.parse(frame)
    except Exception:  # a ProtocolError, or a bug that core also counts (as an error)
        return True
    return False


# ---------------------------------------------------------------------- the stranger
def stranger_items(surface: str, rng: random.Random, originals: list[bytes], count: int
                   ) -> Iterator[tuple[list[bytes], bool]]:
    """For one surface: what each connection sends (datagrams, records or NNG messages) and
    whether the node must count it (False where it may legitimately wait for more bytes)."""
    for _ in range(count):
        frame = mutated(rng, originals)
        if surface.startswith("nng"):
            first = bytes(handshake.first_frame(memoryview(frame), 0))
            yield [frame], refused(first)
        elif surface == "unix":
            yield unix_datagrams(frame, rng)
        elif surface == "tcplink":
            yield tcp_records(frame, rng)
        else:
            yield [rng.randbytes(rng.randrange(1, 4000))], False


def framed(surface: str, frame: bytes) -> list[bytes]:
    """``frame`` as a member's link would send it on ``surface`` (one NNG message, one unix
    datagram, one tcp record)."""
    if surface == "unix":
        return [_U64.pack(len(frame)) + frame]
    if surface == "tcplink":
        return [_RECORD.pack(BEGIN, len(frame), len(frame)) + frame]
    return [frame]


def unix_datagrams(frame: bytes, rng: random.Random) -> tuple[list[bytes], bool]:
    """One connection's datagrams on the unix link: the frame well framed (counted if refused),
    or a framing the node must refuse at once (a giant or lying length, a datagram too short),
    or an empty datagram (an EOF to the node: nothing to count)."""
    how = rng.randrange(8)
    if how < 3:
        return framed("unix", frame), refused(frame)
    if how == 3:  # a giant length prefix
        return [_U64.pack(rng.choice([handshake.MAX_FRAME + 1, 1 << 40, 2**64 - 1])) + frame[:100]], True
    if how == 4:  # a length shorter than the datagram
        return [_U64.pack(rng.randrange(len(frame) or 1)) + frame + b"x"], True
    if how == 5:  # a length longer than the datagram (a first piece must fill a whole datagram)
        return [_U64.pack(len(frame) + rng.randrange(1, 1000)) + frame], True
    if how == 6:
        return [rng.randbytes(rng.randrange(1, _U64.size))], True
    if len(frame) < 60_000:  # the frame, then more frames after it is refused: counted once
        return framed("unix", frame) * 3, refused(frame)
    return [b""], False


def tcp_records(frame: bytes, rng: random.Random) -> tuple[list[bytes], bool]:
    """One connection's bytes on the tcp link, as :func:`unix_datagrams` for its records."""
    how = rng.randrange(9)
    if how < 3:
        return framed("tcplink", frame), bool(frame) and refused(frame)
    if how == 3:
        return [_RECORD.pack(BEGIN, 100, rng.choice([handshake.MAX_FRAME + 1, 1 << 40, 2**64 - 1]))], True
    if how == 4:  # an unknown tag
        return [_RECORD.pack(rng.choice([0, 4, 255]), len(frame), len(frame)) + frame], True
    if how == 5:  # a piece longer than its frame, or a piece with no frame begun
        return [rng.choice([_RECORD.pack(BEGIN, 10, 5), _RECORD.pack(MORE, 10, 0)]) + bytes(10)], True
    if how == 6:  # an ABORT that carries bytes
        return [_RECORD.pack(ABORT, 8, 0) + bytes(8)], True
    if how == 7 and len(frame) > 2:  # a frame cut short, then closed: the node waits for the rest
        return [(_RECORD.pack(BEGIN, len(frame), len(frame)) + frame)[:16 + len(frame) // 2]], False
    return [rng.randbytes(rng.randrange(1, 3000))], False  # raw garbage: may wait for more bytes


def flood(surface: str, addresses: dict[str, str], items: Iterator[tuple[list[bytes], bool]]) -> dict[str, int]:
    """Each item over a connection of its own. A connection the node must count is one it must
    also hang up on: waiting for that both proves delivery and paces the flood."""
    connect = CONNECT[surface]
    out = {"connections": 0, "expected": 0, "not_closed": 0}
    for payloads, expected in items:
        hung_up = connect(addresses, payloads, 5.0 if expected and out["not_closed"] < 5 else 0.05)
        out["connections"] += 1
        out["expected"] += expected
        out["not_closed"] += expected and not hung_up
    return out


def _nng(address: str) -> Callable[[dict[str, str], list[bytes], float], bool]:
    def send(addresses: dict[str, str], messages: list[bytes], wait: float) -> bool:
        import pynng

        gone = threading.Event()
        with pynng.Push0(send_timeout=2000) as s:
            s.add_post_pipe_remove_cb(lambda _pipe: gone.set())
            s.dial(addresses[address], block=True)
            for message in messages:
                s.send(message)
            return gone.wait(wait)
    return send


def _stream(family: int, kind: int, where: Callable[[dict[str, str]], Any]
            ) -> Callable[[dict[str, str], list[bytes], float], bool]:
    def send(addresses: dict[str, str], payloads: list[bytes], wait: float) -> bool:
        sock = socket.socket(family, kind)
        try:
            sock.settimeout(5)
            sock.connect(where(addresses))
            try:
                for payload in payloads:
                    sock.send(payload) if kind == socket.SOCK_SEQPACKET else sock.sendall(payload)
            except OSError:
                return True  # the node hung up already (it refused an earlier datagram)
            return _hung_up(sock, wait)
        finally:
            sock.close()
    return send


def _hung_up(sock: socket.socket, wait: float) -> bool:
    """Whether the node closes this connection within ``wait`` seconds (it never writes to it)."""
    sock.settimeout(wait)
    try:
        return sock.recv(1) == b""
    except socket.timeout:
        return False
    except OSError:  # reset: closed with our bytes unread
        return True


def _tcp_address(key: str) -> Callable[[dict[str, str]], tuple[str, int]]:
    def where(addresses: dict[str, str]) -> tuple[str, int]:
        host, _, port = addresses[key].partition("://")[2].rpartition(":")
        return host.strip("[]"), int(port)
    return where


_raw_ports = [0]


def _raw_tcp(addresses: dict[str, str], payloads: list[bytes], wait: float) -> bool:
    """Garbage to NNG's port and the tcp link's port in turn (NNG drops it below mq)."""
    _raw_ports[0] ^= 1
    key = ("tcp", "tcplink")[_raw_ports[0]]
    return _stream(socket.AF_INET, socket.SOCK_STREAM, _tcp_address(key))(addresses, payloads, wait)


CONNECT: dict[str, Callable[[dict[str, str], list[bytes], float], bool]] = {
    "nng-tcp": _nng("tcp"),
    "nng-ipc": _nng("ipc"),
    "unix": _stream(socket.AF_UNIX, socket.SOCK_SEQPACKET, lambda a: "\0" + a["unix"]),
    "tcplink": _stream(socket.AF_INET, socket.SOCK_STREAM, _tcp_address("tcplink")),
    "raw-tcp": _raw_tcp,
}


def stranger_main(addresses: dict[str, str]) -> None:
    rng = random.Random(int(os.environ.get("MQ_TEST_SEED", "1")))
    originals = seeds()
    counts = json.loads(os.environ.get("MQ_TEST_COUNTS", "{}"))
    print("ready", flush=True)
    for line in sys.stdin:
        surface = line.strip()
        items = stranger_items(surface, rng, originals, counts.get(surface, 200))
        print(json.dumps({"surface": surface, **flood(surface, addresses, items)}), flush=True)


# ---------------------------------------------------------------------- members
def exchange(q: Any, peer: int, stop: Callable[[], bool]) -> dict[str, Any]:
    """What a legit peer does the whole time: a message, then a call, in turn, until ``stop()``."""
    out: dict[str, Any] = {"sent": 0, "answered": 0, "errors": []}
    i = 0
    while not stop():
        try:
            q.send(peer, "seq", i, timeout=10)
            out["sent"] += 1
            answer = q.call(peer, "echo", i, timeout=10)
            if answer != i:
                out["errors"].append(f"call {i} answered {answer!r}")
            out["answered"] += 1
        except Exception as exc:
            out["errors"].append(f"{i}: {type(exc).__name__}: {exc}")
            break
        i += 1
    return out


def send_raw(q: Any, peer: int, frames: list[bytes]) -> None:
    """Frames through ``q``'s own outgoing link to ``peer`` (a unix or tcp link, or an NNG
    pipe), as if its codec had made them."""
    box = q.transport._out[peer]
    for frame in frames:
        box.send(peer, RawFrame(frame), 10.0)


def insider_main(attach: str) -> None:
    import mq

    kinds = {"unix": {}, "tcp": {"protocol": "tcp"}, "pipe": {"unix_links": False, "tcp_links": False}}
    nodes = {name: mq.create("nng", 11 + i, "insider", attach_to=[attach], timeout=10, **options)
             for i, (name, options) in enumerate(kinds.items())}
    try:
        for q in nodes.values():
            q.listen()
        for q in nodes.values():
            q.wait_for_peers(ids=[0], timeout=20)
        links = {name: type(q.transport._out[0]).__module__ + "." + type(q.transport._out[0]).__name__
                 for name, q in nodes.items()}
        print(json.dumps({"ids": {n: q.node_id for n, q in nodes.items()}, "links": links}), flush=True)
        for line in sys.stdin:
            if line.strip() != "flood":
                break
            sent = {}
            for name, q in nodes.items():
                frames = [f for _, f in malformed_frames(q.node_id, framing_ok=name == "pipe")] * 10
                send_raw(q, 0, frames)
                q.send(0, "insider-done", {"node": q.node_id, "sent": len(frames)}, timeout=10)
                sent[name] = len(frames)
            print(json.dumps(sent), flush=True)
    finally:
        for q in nodes.values():
            q.stop(timeout=3)


def legit_main(attach: str) -> None:
    import mq

    q = mq.create("nng", 1, "legit", attach_to=[attach], timeout=10)
    with q:
        q.wait_for_peers(ids=[0], timeout=20)
        print("ready", flush=True)
        done = threading.Event()
        threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
        print(json.dumps(exchange(q, 0, done.is_set)), flush=True)


if __name__ == "__main__":
    role, arg = sys.argv[1], sys.argv[2]
    {"legit": legit_main, "insider": insider_main,
     "stranger": lambda a: stranger_main(json.loads(a))}[role](arg)
