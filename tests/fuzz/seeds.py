"""Writes the seed inputs of every fuzz target into ``tests/fuzz/corpus/<target>/``.

    python -m tests.fuzz.seeds

Seeds are real frames (a node's HELLO, MSG frames with 0, 1 and 3 buffers, an empty tensor)
and the frames that once broke a node (a header of 8 fields; 250 nested tuples), laid out as
each target reads them. Files are named ``seed-<what>``; rerunning rewrites them (the
HELLOs then carry the new node's addresses and incarnation; the rest is byte for byte the same)
and leaves other files, such as crashers, alone.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import msgpack
import numpy as np

import mq
from mq.backends.nng.links import tcp as tcplink
from mq.wire.codec import ALIGN, HELLO, HELLO_ACK, LINK, MSG, Codec, Frame
from tests.fuzz import targets

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")

#: A header list of 8 fields instead of 10: it used to kill a node's I/O thread.
EIGHT_FIELD_HEADER = bytes.fromhex("0c000000980200a174090000c401c090")
NESTED_TUPLES = 250


def fixed(frame: Frame) -> bytes:
    """The contiguous layout of ``frame`` with its send time fixed (seeds stay byte-identical)."""
    head = list(frame.head)
    head[9] = 1.0
    return bytes(Frame(frame.kind, head, frame.buffers, frame.sizes).to_bytes())


def hello_payload() -> dict[str, Any]:
    """What a real node says in its HELLO (its addresses, locality, shm pool...)."""
    q = mq.create("nng", 1, {"collector"}, timeout=2)
    with q:
        q.subscribe("model")
        return q._join.hello_payload("0" * 32, b"n" * 16)


def handshake_frames() -> dict[str, bytes]:
    payload = hello_payload()
    tree = Codec().pack(payload)[0]
    ack = dict(payload, proof=b"p" * 32, read_ok=True)
    link = {"node_id": 1, "incarnation": payload["incarnation"], "read_ok": True, "proof": b"p" * 32}
    return {
        "hello": fixed(Frame.build(HELLO, "", 1, 0, 0, tree, [])),
        "hello-ack": fixed(Frame.build(HELLO_ACK, "", 1, 0, 0, Codec().pack(ack)[0], [])),
        "link": fixed(Frame.build(LINK, "", 1, 0, 0, Codec().pack(link)[0], [])),
    }


def nested_tuples(depth: int = NESTED_TUPLES) -> bytes:
    """A frame whose payload is ``depth`` tuples inside each other, as the codec packs them
    (ExtType 1 holding the packing of a list): each level a msgpack call of its own."""
    tree = msgpack.packb([])
    for _ in range(depth):
        tree = msgpack.packb([msgpack.ExtType(1, tree)])
    return fixed(Frame.build(MSG, "t", 1, 0, 0, tree, []))


def message_frames() -> dict[str, bytes]:
    import torch

    codec = Codec()

    def msg(payload: Any, seq: int = 0) -> bytes:
        return fixed(codec.encode(MSG, "transitions", 1, seq, 0, payload))

    return {
        "msg-0-buffers": msg({"cmd": "step", "n": 3, "eps": 0.05, "tag": b"ok", "t": (1, "a")}),
        "msg-1-buffer": msg(np.arange(16, dtype=np.float32).reshape(4, 4)),
        "msg-3-buffers": msg({"obs": np.zeros((2, 3), np.uint8), "act": torch.arange(5),
                              "rew": np.ones(3, np.float64)}, seq=7),
        "empty-tensor": msg(torch.empty(0, 4)),
        "eight-field-header": EIGHT_FIELD_HEADER,
        "nested-tuples": nested_tuples(),
    }


def batch(frames: list[bytes]) -> bytes:
    """Frames back to back, each on a 64-byte boundary: an NNG message of a busy stream."""
    out = bytearray()
    for frame in frames:
        out += frame + bytes(-len(frame) % ALIGN)
    return bytes(out[:len(out) - (-len(frames[-1]) % ALIGN)])


def shm_frame() -> bytes:
    """A MSG whose buffer went by the shm data path: a descriptor in place of its bytes."""
    frame = Codec().encode(MSG, "model", 1, 0, 0, np.ones(1 << 16, np.uint8))
    return fixed(frame.with_descriptors({0: [2, 5, 1, 0, 1 << 16]}))


def chunked(mode: int, pieces: list[bytes]) -> bytes:
    """The link targets' input: a mode byte, then each piece as chunks of at most 255 bytes."""
    out = bytearray([mode])
    for piece in pieces:
        for i in range(0, max(len(piece), 1), 255):
            part = piece[i:i + 255]
            out += bytes([len(part)]) + part
    return bytes(out)


def unix_datagrams(frame: bytes) -> list[bytes]:
    """``frame`` as the unix link sends it, with the fuzzing datagram size."""
    size = targets.UNIX_DATAGRAM
    wire = struct.pack("<Q", len(frame)) + frame
    return [wire[:size]] + [b"\x01" + wire[i:i + size - 1] for i in range(size, len(wire), size - 1)]


def tcp_records(frame: bytes, flags: int = 0) -> list[bytes]:
    """``frame`` as the tcp link sends it, with the fuzzing piece size (``flags`` on BEGIN)."""
    size = targets.TCP_PIECE
    head = struct.Struct("<BBxxIQ")
    out = []
    for i in range(0, len(frame), size):
        piece = frame[i:i + size]
        out.append(head.pack(tcplink.MORE if i else tcplink.BEGIN, 0 if i else flags, len(piece),
                             0 if i else len(frame)) + piece)
    return out


def link_seeds(frames: dict[str, bytes]) -> dict[str, dict[str, bytes]]:
    """Each frame (and a frame the sender aborted half way) as both link targets read it."""
    unix, tcp = {}, {}
    for name, frame in frames.items():
        for mode in (0, 1):
            unix[f"{name}-{mode}"] = chunked(mode, unix_datagrams(frame))
            tcp[f"{name}-{mode}"] = chunked(mode, [b"".join(tcp_records(frame))])
        tcp[f"{name}-3"] = chunked(3, [b"".join(tcp_records(frame))])  # large ones announced, followed
        tcp[f"{name}-7"] = chunked(7, [b"".join(tcp_records(frame, tcplink.SHARED))])  # and lent
    hello = frames["hello"]
    unix["aborted-then-hello-1"] = chunked(1, unix_datagrams(hello)[:3] + [b"\x02"] + unix_datagrams(hello))
    tcp["aborted-then-hello-1"] = chunked(1, [*tcp_records(hello)[:3], struct.pack("<BxxxIQ", tcplink.ABORT, 0, 0),
                                              *tcp_records(hello)])
    tcp["aborted-then-hello-3"] = chunked(3, [*tcp_records(hello)[:3], struct.pack("<BxxxIQ", tcplink.ABORT, 0, 0),
                                              *tcp_records(hello)])
    return {"unixlink": unix, "tcplink": tcp}


def shm_shapes() -> dict[str, bytes]:
    """Descriptors of the wrong shape (real ones are made at run time, see targets.shm_seeds)."""
    return {name: msgpack.packb(value) for name, value in {
        "short": [1, 3, 0], "floats": [1, 3, 0, 0.0, 8], "negative": [1, 3, 1, -64, 64],
        "huge": [1, 3, 1, 0, 2**64 - 1], "dict": {"seg": 1}, "nested": [[1, 3, 1, 0, 8]] * 5,
    }.items()}


def all_seeds() -> dict[str, dict[str, bytes]]:
    frames = {**handshake_frames(), **message_frames()}
    codec = dict(frames, **{"batch-of-3": batch([frames["msg-0-buffers"], frames["msg-3-buffers"],
                                                 frames["empty-tensor"]]), "shm-descriptor": shm_frame()})
    from tests.fuzz.targets import cuda_seeds, rdma_seeds

    return {"handshake": frames, "codec": codec, **link_seeds(frames), "shm": shm_shapes(),
            "cuda": cuda_seeds(), "rdma": rdma_seeds()}


def write(seeds: dict[str, dict[str, bytes]]) -> None:
    for target, files in seeds.items():
        folder = os.path.join(CORPUS, target)
        os.makedirs(folder, exist_ok=True)
        for name, data in files.items():
            with open(os.path.join(folder, f"seed-{name}"), "wb") as f:
                f.write(data)
        print(f"{target}: {len(files)} seeds in {os.path.relpath(folder)}")


if __name__ == "__main__":
    write(all_seeds())
