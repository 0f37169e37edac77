"""The trust boundary: the only parser that reads bytes from a link that has not authenticated.

A link (an NNG pipe, a unix or tcp link, an RPC rank) carries the join handshake first: HELLO,
HELLO_ACK and LINK (see :mod:`mq.auth` and :class:`mq.node.core.MQ`). Until core has bound the link
to a peer that proved the job secret, its frames never reach the general decoder
(:mod:`mq.wire.codec`, with its payload trees, extension types and buffers). They come here:

- at most :data:`MAX_FRAME` bytes, refused before anything is parsed (a reader does not even
  allocate more for an unauthenticated link, see :mod:`mq.backends.nng.links.base`);
- the contiguous layout of a frame without buffers: a u32 header length, then exactly that
  many bytes of header;
- the header: exactly the envelope's ten fields with their types, no buffer sizes, no shared-
  memory descriptors, a handshake kind;
- the payload: one schema per kind (:class:`Greeting`, :class:`LinkProof`), exact field names
  and types, unknown fields refused, no extension types, decoded by msgspec (which bounds its
  own nesting; nothing here recurses).

Whatever fails is a :class:`Refused` naming its cause (:class:`~mq.errors.Oversized` for size);
the caller counts it and closes the link.
"""

from __future__ import annotations

import struct
from typing import Annotated, Any, NamedTuple

import msgspec

from mq.wire.codec import HELLO, HELLO_ACK, KIND_NAMES, LINK, VERSION
from mq.errors import Oversized, ProtocolError

#: The largest frame an unauthenticated link may send. Measured: a HELLO_ACK is 783 bytes from
#: a host without GPUs, 1,851 from one with 8 GPUs and 4 RDMA devices.
MAX_FRAME = 16 << 10
KINDS = frozenset({HELLO, HELLO_ACK, LINK})

_U32 = struct.Struct("<I")
_NodeId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
_Short = Annotated[str, msgspec.Meta(max_length=256)]
_Names = Annotated[list[_Short], msgspec.Meta(max_length=1024)]
_Bytes = Annotated[bytes, msgspec.Meta(max_length=64)]


class Refused(ProtocolError):
    """A frame the boundary refused; ``cause`` is the counter it goes under."""

    def __init__(self, cause: str, why: str):
        super().__init__(why)
        self.cause = cause


class Greeting(msgspec.Struct, forbid_unknown_fields=True):
    """A HELLO, or a HELLO_ACK answering one (``proof``/``read_ok``; ``error`` when refused)."""

    node_id: _NodeId
    labels: _Names
    subscriptions: _Names
    addresses: dict[_Short, _Short]
    locality: dict[str, Any]  # checked field by field by mq.locality.Locality.from_dict
    incarnation: _Short
    token: _Short
    nonce: _Bytes
    mq_type: _Short
    max_frame_bytes: Annotated[int, msgspec.Meta(ge=1)]
    shm: dict[str, Any] | None  # checked by mq.datapaths.shm.pool.PoolReader
    # frames a sender may have in flight to this node unconfirmed (its receive queue's size)
    window: Annotated[int, msgspec.Meta(ge=1, le=1 << 24)] | None = None
    proof: _Bytes | None = None
    read_ok: bool | None = None
    error: Annotated[str, msgspec.Meta(max_length=1024)] | None = None
    # what its rdma path is (engine, mode, device): no addresses or keys, which travel only in
    # signed offers after the join (mq.datapaths.rdma.path)
    rdma: dict[_Short, _Short | None] | None = None


class LinkProof(msgspec.Struct, forbid_unknown_fields=True):
    """A LINK: the initiator's proof, and whether it could open our pool."""

    node_id: _NodeId
    incarnation: _Short
    read_ok: bool
    proof: _Bytes | None = None


class _Envelope(msgspec.Struct, array_like=True):
    """The codec's envelope as a handshake frame has it: no buffers, no descriptors."""

    version: int
    kind: int
    topic: str
    sender: _NodeId
    seq: int
    corr: int
    tree: bytes
    sizes: Annotated[list[int], msgspec.Meta(max_length=0)]
    descs: None
    sent_at: float


_SCHEMAS = {HELLO: Greeting, HELLO_ACK: Greeting, LINK: LinkProof}
_DECODERS = {kind: msgspec.msgpack.Decoder(schema) for kind, schema in _SCHEMAS.items()}
_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)
# What msgspec raises for bytes that are no such value (invalid UTF-8 surfaces as itself).
_UNDECODABLE = (msgspec.MsgspecError, RecursionError, UnicodeDecodeError)


class Handshake(NamedTuple):
    """A handshake frame that passed the boundary: its kind, its claimed sender and payload
    (a plain dict, as core reads it). Nothing in it is proven yet: core checks the proof."""

    kind: int
    sender: int
    payload: dict[str, Any]


def parse(frame: Any) -> Handshake:
    """A frame from an unauthenticated link, in the contiguous layout -> :class:`Handshake`.

    Raises:
        Oversized: more than :data:`MAX_FRAME` bytes.
        Refused: anything but a well-formed handshake frame.
    """
    view = memoryview(frame).cast("B")
    size = len(view)
    if size > MAX_FRAME:
        raise Oversized(f"a {size}-byte frame from a link that has not authenticated (at most "
                        f"{MAX_FRAME} before the handshake)")
    if size < 4 or _U32.unpack_from(view)[0] != size - 4:
        raise Refused("handshake_malformed", f"a {size}-byte frame whose header length does not "
                      "match it (a handshake frame carries no buffers)")
    try:
        head = _ENVELOPE.decode(view[4:])
    except _UNDECODABLE as exc:
        raise Refused("handshake_malformed", f"not a handshake envelope: {exc}") from None
    if head.version != VERSION:
        raise Refused("handshake_version", f"frame version {head.version}, this node speaks {VERSION}")
    if head.kind not in KINDS:
        name = KIND_NAMES[head.kind] if 0 <= head.kind < len(KIND_NAMES) else head.kind
        raise Refused("unauthenticated", f"a {name} frame on a link that never proved membership")
    return Handshake(head.kind, head.sender, check(head.kind, head.sender, head.tree))


def check(kind: int, sender: int, tree: Any) -> dict[str, Any]:
    """A handshake payload (msgpack bytes, or a tree the codec decoded on an authenticated link)
    checked against its kind's schema -> dict; :class:`Refused` if it does not fit."""
    try:
        if isinstance(tree, (bytes, bytearray, memoryview)):
            payload = _DECODERS[kind].decode(tree)
        else:
            payload = msgspec.convert(tree, _SCHEMAS[kind])
    except _UNDECODABLE as exc:
        raise Refused("handshake_malformed", f"malformed {KIND_NAMES[kind]}: {exc}") from None
    if payload.node_id != sender:
        raise Refused("handshake_malformed", f"a {KIND_NAMES[kind]} of node {payload.node_id} "
                      f"sent as node {sender}")
    return msgspec.structs.asdict(payload)


def first_frame(message: memoryview, start: int) -> memoryview:
    """The frame at ``start`` of a message that may hold several back to back (an NNG batch),
    cut by its own header length alone (a handshake frame has no buffers): nothing is parsed,
    and a lying length only cuts a frame :func:`parse` refuses."""
    end = len(message)
    if end - start >= 4:
        end = min(end, start + 4 + _U32.unpack_from(message, start)[0])
    return message[start:end]
