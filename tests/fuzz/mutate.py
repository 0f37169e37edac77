"""Structure-aware mutations: what a hostile peer would change in a real frame.

Byte flips rarely get past msgpack: most of them end in the envelope's own parser. These
mutations decode a frame (the u32 header length, the msgpack envelope, the payload tree with
its extension values kept raw), change one thing a peer controls, and pack it again: an
envelope field replaced, added or removed; a node of the payload tree replaced by an
extension value with hostile metadata (zero-sized dtypes, huge shapes, buffer indices out of
range, one buffer referenced many times, deep tuples); buffers appended with sizes that
match. :func:`mutate` falls back to the byte mutator it is given half of the time, or when the
input does not decode.
"""

from __future__ import annotations

import math
import random
import struct
from typing import Any, Callable

import msgpack

_U32 = struct.Struct("<I")
ALIGN = 64

INTS = [0, 1, -1, 2, 7, 9, 10, 11, 127, 128, 255, 256, 4096, 2**15, 2**16, 2**16 + 1, 2**31 - 1,
        2**31, 2**32, 2**53, 2**63 - 1, 2**64 - 1, -2**63]
FLOATS = [0.0, -0.0, 1.0, math.nan, math.inf, -math.inf, 1e308, 5e-324]
STRINGS = ["", "t", "model", "\x00", "é", "x" * 300, "cuda:0", "cpu", "MSG", "../../etc/passwd"]
NP_DTYPES = ["|S0", "V0", "<U0", "|u1", "<f8", ">i4", "O", "|O", "V8", "<M8[ns]", "<m8[s]", "<c16",
             "|b1", "<f2", "|S3", "<U2", "int64", "float32", "[('a','O')]", "(2,3)f4", "V0,V0",
             "", 7, None]
TORCH_DTYPES = ["float32", "uint8", "bool", "bfloat16", "float8_e4m3fn", "complex128", "uint64",
                "qint8", "", 1, None]
DEVICES = ["cpu", "cuda", "cuda:0", "cuda:99", "cuda:-1", "cuda:x", "meta", "mps", "", 3, None]
SHAPES = [[], [0], [1], [4, 4], [3], [2**62], [-1], [2**20, 2**14], [0, 2**63 - 1], [1] * 40,
          [2**31, 2**31, 0], [0, 2**64 - 1], "x", None, [1.5], [True], [[1]]]
INDICES = [0, 1, 2, 3, -1, 2**16, 2**63 - 1, 2**64 - 1, None, "0", 1.0, True]
EXT_CODES = [1, 2, 3, 4, 5, 0, 6, 127]
_REPEAT_BYTES = 64 << 10  # a repeated extension value packs to at most about this much


def mutate(data: bytes, max_size: int, seed: int, bytewise: Callable[[bytes, int], bytes]) -> bytes:
    """A frame (or a batch of frames) with one hostile change; ``bytewise`` for the others."""
    rng = random.Random(seed)
    if rng.random() < 0.5:
        return bytewise(data, max_size)
    frame = _parse(data)
    if frame is None:
        return bytewise(data, max_size)
    head, body = frame
    rng.choice([_change_field, _change_tree, _change_tree, _add_buffers, _reshape])(head, body, rng)
    out = _pack(head, body)
    if rng.random() < 0.1:  # a batch: the frame twice, as a busy NNG pipe sends them
        out = out + bytes(-len(out) % ALIGN) + out
    return out if len(out) <= max_size else bytewise(data, max_size)


def mutate_value(data: bytes, max_size: int, seed: int, bytewise: Callable[[bytes, int], bytes]) -> bytes:
    """A msgpack value (a shared-memory descriptor) with one node changed."""
    rng = random.Random(seed)
    try:
        value = msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=msgpack.ExtType)
    except Exception:
        return bytewise(data, max_size)
    if rng.random() < 0.3:
        return bytewise(data, max_size)
    out = _packb(_change(value, rng, 3))
    return out if out is not None and len(out) <= max_size else bytewise(data, max_size)


# ---------------------------------------------------------------------- frames
def _parse(data: bytes) -> tuple[list[Any], list[bytes]] | None:
    """(envelope fields, the bytes after the header) of a contiguous frame, or None."""
    if len(data) < 4:
        return None
    (hlen,) = _U32.unpack_from(data)
    try:
        head = msgpack.unpackb(data[4:4 + hlen], raw=False, strict_map_key=False,
                               ext_hook=msgpack.ExtType)
    except Exception:
        return None
    body = data[(4 + hlen + ALIGN - 1) & -ALIGN:]
    return (head if isinstance(head, list) else [head]), [body]


def _pack(head: list[Any], body: list[bytes]) -> bytes:
    header = _packb(head) or b"\x90"
    out = bytearray(_U32.pack(len(header)) + header)
    for part in body:
        out += bytes(-len(out) % ALIGN) + part
    return bytes(out)


def _packb(value: Any) -> bytes | None:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except Exception:  # an int out of msgpack's range, a key type it refuses
        return None


def _change_field(head: list[Any], body: list[bytes], rng: random.Random) -> None:
    """One envelope field replaced, inserted or removed."""
    op = rng.random()
    if op < 0.1 and head:
        del head[rng.randrange(len(head))]
    elif op < 0.2:
        head.insert(rng.randrange(len(head) + 1), _value(rng, 2))
    elif head:
        i = rng.randrange(len(head))
        head[i] = _field_value(i, rng)


def _field_value(i: int, rng: random.Random) -> Any:
    """A hostile value for envelope field ``i`` (version, kind, ... sent_at)."""
    if i == 1 and rng.random() < 0.5:
        return rng.randrange(-1, 14)  # every kind, and just past them
    if i == 7 and rng.random() < 0.5:
        return rng.choice([[0] * rng.randrange(1, 300), [2**64 - 1], [-1], ["1"], [0.0], {}])
    if i == 8 and rng.random() < 0.5:
        return {rng.choice(INDICES): rng.choice([[1, 3, 1, 0, 64], [0] * 5, None, "d", [2**64 - 1] * 5])}
    return _value(rng, 2)


def _change_tree(head: list[Any], body: list[bytes], rng: random.Random) -> None:
    """One node of the payload tree (field 6) changed, however deep."""
    if len(head) < 7 or not isinstance(head[6], (bytes, bytearray)):
        _change_field(head, body, rng)
        return
    try:
        tree = msgpack.unpackb(head[6], raw=False, strict_map_key=False, ext_hook=msgpack.ExtType)
    except Exception:
        tree = None
    head[6] = _packb(_change(tree, rng, 6)) or head[6]


def _add_buffers(head: list[Any], body: list[bytes], rng: random.Random) -> None:
    """Buffers appended, sizes listing them all (the frame stays well formed): the tree's
    buffer references then point at real bytes."""
    if len(head) < 8:
        return
    sizes = head[7] if isinstance(head[7], list) else []
    for _ in range(rng.randrange(1, 4)):
        n = rng.choice([0, 1, 3, 8, 16, 64, 100])
        sizes.append(n)
        body.append(bytes(rng.randrange(256) for _ in range(n)))
    head[7] = sizes
    _change_tree(head, body, rng)


def _reshape(head: list[Any], body: list[bytes], rng: random.Random) -> None:
    """The frame cut short or padded: a header that overruns, buffers that overrun."""
    if body[-1] and rng.random() < 0.5:
        body[-1] = body[-1][:rng.randrange(len(body[-1]))]
    else:
        body.append(bytes(rng.choice([1, 63, 64, 65, 200])))


# ---------------------------------------------------------------------- values
def _change(node: Any, rng: random.Random, depth: int) -> Any:
    """``node`` with one descendant (or itself) replaced by a hostile value."""
    if depth > 0 and rng.random() < 0.7:
        if isinstance(node, list) and node:
            i = rng.randrange(len(node))
            node[i] = _change(node[i], rng, depth - 1)
            return node
        if isinstance(node, dict) and node:
            key = rng.choice(list(node))
            op = rng.random()
            if op < 0.15:
                del node[key]
            elif op < 0.3:
                node[_value(rng, 0)] = _value(rng, 2)
            else:
                node[key] = _change(node[key], rng, depth - 1)
            return node
        if isinstance(node, msgpack.ExtType):
            return _change_ext(node, rng, depth)
        if isinstance(node, int) and not isinstance(node, bool):
            return node + rng.choice([-2, -1, 1, 2, 64, 4096])
    return _value(rng, 3)


def _change_ext(ext: msgpack.ExtType, rng: random.Random, depth: int) -> Any:
    """An extension value with its contents changed (a tuple's items, an array's metadata)."""
    try:
        inner = msgpack.unpackb(ext.data, raw=False, strict_map_key=False, ext_hook=msgpack.ExtType)
    except Exception:
        return _ext(rng, depth)
    data = _packb(_change(inner, rng, depth - 1))
    return msgpack.ExtType(ext.code, data) if data is not None else _ext(rng, depth)


def _value(rng: random.Random, depth: int) -> Any:
    """A hostile msgpack value: an edge-case scalar, a container, or an extension value."""
    kind = rng.randrange(10 if depth > 0 else 5)
    if kind == 0:
        return rng.choice(INTS)
    if kind == 1:
        return rng.choice(FLOATS)
    if kind == 2:
        return rng.choice(STRINGS)
    if kind == 3:
        return rng.choice([b"", b"\x00", bytes(range(16)), b"\xc1" * 9, None, True, False])
    if kind == 4:
        return rng.randrange(-300, 300)
    if kind == 5:
        return [_value(rng, depth - 1) for _ in range(rng.randrange(4))]
    if kind == 6:
        return {_value(rng, 0): _value(rng, depth - 1) for _ in range(rng.randrange(4))}
    if kind == 7:  # one extension value many times: amplification through repeated references
        ext = _ext(rng, depth - 1)
        # Packed, the references are copies: nested inside each other they multiply, and one
        # mutation once packed ~1 GB here (libFuzzer's rss limit, in the harness, not in mq).
        most = max(2, _REPEAT_BYTES // max(1, len(ext.data)))
        return [ext] * min(rng.choice([2, 50, 500]), most)
    return _ext(rng, depth - 1)


def _ext(rng: random.Random, depth: int) -> msgpack.ExtType:
    """An extension value as the codec writes them, with hostile contents."""
    code = rng.choice(EXT_CODES)
    if code == 1:  # a tuple, nested deeper than any sender may
        inner = _packb([_value(rng, max(depth, 0))]) or b"\x90"
        for _ in range(rng.choice([0, 1, 31, 32, 33, 200])):
            inner = msgpack.packb([msgpack.ExtType(1, inner)])
        return msgpack.ExtType(1, inner)
    if code == 2:
        meta: list[Any] = [rng.choice(NP_DTYPES), rng.choice(SHAPES), rng.choice(INDICES)]
    elif code == 3:
        meta = [rng.choice(TORCH_DTYPES), rng.choice(SHAPES), rng.choice(INDICES), rng.choice(DEVICES)]
    elif code == 5:
        meta = rng.choice(INDICES)
    else:
        return msgpack.ExtType(code, bytes(rng.randrange(256) for _ in range(rng.randrange(12))))
    if isinstance(meta, list) and rng.random() < 0.2:
        meta = meta[:rng.randrange(len(meta))] if rng.random() < 0.5 else meta + [0]
    return msgpack.ExtType(code, _packb(meta) or b"\xc0")


#: The structure-aware mutator of each target that has one (the link targets' framing is a
#: few integers: libFuzzer's own mutations, guided by comparisons, find their edges).
MUTATORS: dict[str, Callable[[bytes, int, int, Callable[[bytes, int], bytes]], bytes]] = {
    "handshake": mutate, "codec": mutate, "shm": mutate_value,
    "rdma": mutate_value}
