"""Codec: every payload kind round-trips; nothing is pickled unless asked; malformed frames
raise ProtocolError and nothing else."""

from __future__ import annotations

import pickle
import struct

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mq.wire.codec import MSG, VERSION, Codec
from mq.errors import EncodeError, ProtocolError
from mq.testing import _same, sample_payload

pytestmark = pytest.mark.timeout(120)

TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
                torch.complex128]


def roundtrip(payload, codec=None):
    codec = codec or Codec()
    frame = codec.encode(MSG, "t", 3, 9, 0, payload).to_bytes()
    env = codec.decode_frame(frame)
    assert (env.kind, env.topic, env.sender, env.seq) == (MSG, "t", 3, 9)
    return env.payload


def test_sample_payload_roundtrips():
    assert _same(sample_payload(), roundtrip(sample_payload()))


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (2, 3, 4)])
def test_tensor_dtypes_and_shapes(dtype, shape):
    t = (torch.rand(shape) * 10).to(dtype) if dtype != torch.bool else torch.rand(shape) > 0.5
    out = roundtrip(t)
    assert out.dtype == dtype and out.shape == t.shape and torch.equal(out, t)


def test_non_contiguous_conj_and_grad_tensors():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    assert torch.equal(roundtrip(base.t()[1:, ::2]), base.t()[1:, ::2])
    z = torch.tensor([1 + 2j, 3 - 1j]).conj()
    assert torch.equal(roundtrip(z), z.resolve_conj())
    g = torch.ones(3, requires_grad=True) * 2
    assert not roundtrip(g).requires_grad and torch.equal(roundtrip(g), g.detach())


def test_arrays_travel_out_of_band():
    arr = np.arange(1 << 20, dtype=np.uint8)
    enc = Codec().encode(MSG, "t", 0, 0, 0, {"a": arr})
    assert len(enc.header) < 200, "array bytes must not be copied into the msgpack header"
    assert enc.size >= arr.nbytes


def test_received_arrays_are_writable_views():
    out = Codec().decode_frame(Codec().encode(MSG, "t", 0, 0, 0, np.ones(8)).to_bytes()).payload
    out[0] = 5  # a user may train on what it received in place
    assert out[0] == 5


def test_cuda_tensor_arrives_on_same_index_or_cpu():
    # A CUDA tensor is staged to host by the sender; the receiver puts it back on the same
    # device index when it has that GPU, on the CPU otherwise (documented behaviour).
    tree = msgpack.packb(msgpack.ExtType(3, msgpack.packb(["float32", [2], 0, "cuda:3"])))
    out = Codec().unpack(tree, [memoryview(bytearray(np.ones(2, np.float32).tobytes()))])
    assert torch.equal(out.cpu(), torch.ones(2))
    assert out.device.type == ("cuda" if torch.cuda.device_count() > 3 else "cpu")


class Custom:
    pass


def test_unknown_type_fails_at_send_naming_type_and_opt_in():
    with pytest.raises(EncodeError, match=r"test_codec\.Custom.*allow_pickle=True"):
        Codec().encode(MSG, "t", 0, 0, 0, {"x": [Custom()]})
    with pytest.raises(EncodeError, match="object"):
        Codec().encode(MSG, "t", 0, 0, 0, np.array([Custom()], dtype=object))


def test_pickle_needs_opt_in_on_the_receiving_side():
    frame = Codec(allow_pickle=True).encode(MSG, "t", 0, 0, 0, {"fn": len}).to_bytes()
    with pytest.raises(ProtocolError, match="does not unpickle"):
        Codec().decode_frame(frame)
    assert Codec(allow_pickle=True).decode_frame(frame).payload == {"fn": len}


def test_pickle_bomb_is_not_executed():
    class Bomb:
        def __reduce__(self):
            return (exec, ("raise SystemExit('pwned')",))

    frame = Codec(allow_pickle=True).encode(MSG, "t", 0, 0, 0, Bomb()).to_bytes()
    with pytest.raises(ProtocolError):
        Codec().decode_frame(frame)


def good_frame():
    return Codec().encode(MSG, "t", 0, 0, 0, {"a": np.arange(10), "t": torch.ones(3)}).to_bytes()


@pytest.mark.parametrize("mutate", [
    lambda f: f[:3],                                    # shorter than the length prefix
    lambda f: f[:20],                                   # truncated header
    lambda f: struct.pack("<I", 10**9) + f[4:],         # header length overruns
    lambda f: f[:-5],                                   # truncated buffer
    lambda f: struct.pack("<I", 3) + b"\xc1\xc1\xc1",   # invalid msgpack
    lambda f: b"\x00" * 64,
    lambda f: struct.pack("<I", 2) + msgpack.packb([9]),
], ids=["tiny", "trunc-header", "overrun", "trunc-buffer", "bad-msgpack", "zeros", "wrong-shape"])
def test_malformed_frames_raise_protocol_error(mutate):
    with pytest.raises(ProtocolError):
        Codec().decode_frame(mutate(bytes(good_frame())))


def test_oversized_frame_is_refused():
    with pytest.raises(ProtocolError, match="max_frame_bytes"):
        Codec(max_frame_bytes=100).decode_frame(good_frame())


def test_object_dtype_from_network_is_refused():
    codec = Codec()
    tree = msgpack.packb(msgpack.ExtType(2, msgpack.packb(["|O", [1], 0])))
    head = msgpack.packb([VERSION, MSG, "t", 0, 0, 0, tree, [8], None, 0.0], use_bin_type=True)
    frame = struct.pack("<I", len(head)) + head + b"\x00" * (64 - 4 - len(head)) + b"\x01" * 8
    with pytest.raises(ProtocolError, match="object"):
        codec.decode_frame(frame)


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_crash_the_decoder(data):
    try:
        Codec().decode_frame(data)
    except ProtocolError:
        pass


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2000), st.binary(min_size=1, max_size=8))
def test_corrupted_valid_frames_never_crash(pos, junk):
    frame = bytearray(good_frame())
    pos = pos % len(frame)
    frame[pos:pos + len(junk)] = junk
    try:
        Codec().decode_frame(bytes(frame))
    except ProtocolError:
        pass


leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=False),
    st.text(max_size=20), st.binary(max_size=40),
    hnp.arrays(hnp.scalar_dtypes().filter(lambda d: d.kind != "O"),
               hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)),
)
trees = st.recursive(leaves, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.tuples(kids, kids),
    st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-5, 5)), kids, max_size=4)), max_leaves=12)


def _eq(a, b):
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and a.tobytes() == b.tobytes())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_eq(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_eq, a, b))
    return type(a) is type(b) and a == b


@settings(max_examples=150, deadline=None)
@given(trees)
def test_property_any_payload_tree_roundtrips(payload):
    assert _eq(payload, roundtrip(payload))


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(TORCH_DTYPES), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5),
       st.booleans())
def test_property_tensors_roundtrip(dtype, shape, transpose):
    t = torch.randint(0, 2 if dtype == torch.bool else 100, shape).to(dtype)
    if transpose and t.dim() >= 2:
        t = t.transpose(0, 1)
    out = roundtrip({"t": t})["t"]
    assert out.dtype == t.dtype and out.shape == t.shape and torch.equal(out, t)


def test_pickle_module_not_used_by_default(monkeypatch):
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("pickle.loads called"))
    assert _same(sample_payload(), roundtrip(sample_payload()))


def test_a_remembered_tree_still_checks_its_buffer():
    # A one-tensor frame decoded once is then decoded from a table; a later frame with the same
    # tree but a shorter or longer buffer must still be refused, never give a wrong-size view.
    c = Codec()
    good = c.encode(MSG, "t", 1, 1, 0, torch.arange(16, dtype=torch.float32).reshape(4, 4)).to_bytes()
    for _ in range(2):  # the second decode takes the table
        assert torch.equal(c.decode_frame(good).payload, torch.arange(16, dtype=torch.float32).reshape(4, 4))
    from mq.wire.codec import split
    head, buffers = split(good)
    for wrong in (buffers[0][:-4], bytes(buffers[0]) + b"\0\0\0\0"):
        head[7] = [len(wrong)]
        with pytest.raises(ProtocolError, match="does not match"):
            c.decode(head, [memoryview(bytearray(wrong))])


def test_a_remembered_tree_decodes_torch_rpc_array_buffers():
    # torch RPC hands buffers over as 1-d uint8 arrays: the table decodes them too (a view of
    # the same memory), still checks their size, and copies a read-only one for torch.
    c = Codec(keep_tensors=True)
    for payload in (torch.arange(12, dtype=torch.float32).reshape(3, 4), np.arange(6.0).reshape(2, 3),
                    torch.arange(5, dtype=torch.uint8)):
        frame = c.encode(MSG, "t", 1, 1, 0, payload)
        raw = frame.buffers[0]
        flat = raw.reshape(-1).view(torch.uint8).numpy() if isinstance(raw, torch.Tensor) else raw
        for _ in range(2):  # the second decode takes the table
            buf = flat.copy()
            out = c.decode(bytes(frame.header), [buf]).payload
            assert _same(payload, out)
            view = out.numpy() if isinstance(out, torch.Tensor) else out
            assert np.shares_memory(view, buf) and view.flags.writeable
        frozen = flat.copy()
        frozen.flags.writeable = False
        out = c.decode(bytes(frame.header), [frozen]).payload
        assert _same(payload, out)
        if isinstance(out, torch.Tensor):
            assert not np.shares_memory(out.numpy(), frozen)  # torch cannot hold read-only memory
        strided = np.repeat(flat, 2)[::2]  # a peer's tensor may arrive with any strides
        for wrong in (flat[:-1].copy(), np.concatenate([flat, flat[:1]]), strided):
            with pytest.raises(ProtocolError, match="does not match|buffer|contiguous"):
                c.decode(bytes(frame.header), [wrong])


def test_common_payloads_decode_like_the_general_path():
    # The fast encoder covers one tensor/array, scalars, strings and flat dicts of them; what
    # it does not cover (subclasses, nested containers, non-str keys) goes the general way.
    c = Codec()
    payloads = [7, 2.5, "s", None, True, b"small", np.arange(6).reshape(2, 3),
                torch.ones(3, dtype=torch.bfloat16), {"a": torch.ones(2), "b": 1, "c": b"x"},
                {1: "int key"}, {"nested": {"x": np.zeros(2)}}, (1, 2)]
    for p in payloads:
        out = c.decode_frame(c.encode(MSG, "t", 1, 1, 0, p).to_bytes()).payload
        assert _same(p, out), (p, out)


def _batch(*frames: bytes) -> bytearray:
    """Frames back to back, each on a 64-byte boundary: how a busy NNG pipe batches them."""
    out = bytearray()
    for f in frames:
        out += bytes(-len(out) % 64) + f
    return out


def test_a_batch_splits_into_its_frames_in_order():
    from mq.wire.codec import split_batch
    c = Codec()
    payloads = [{"i": 0, "x": np.arange(5)}, "no buffers", torch.ones(3), {"i": 3, "x": np.zeros(0)}]
    frames = [c.encode(MSG, "t", 1, i, 0, p).to_bytes() for i, p in enumerate(payloads)]
    got = [c.decode(h, b) for h, b in split_batch(_batch(*frames))]
    assert [e.seq for e in got] == [0, 1, 2, 3]
    assert all(_same(p, e.payload) for p, e in zip(payloads, got))
    # One frame alone is a batch of one.
    assert len(list(split_batch(frames[0]))) == 1


def test_a_malformed_frame_in_a_batch_stops_there_after_the_good_ones():
    from mq.wire.codec import split_batch
    c = Codec()
    good = c.encode(MSG, "t", 1, 0, 0, np.arange(4)).to_bytes()
    frames = split_batch(_batch(good, good, b"\xff" * 10))
    assert next(frames)[0][4] == 0 and next(frames)[0][4] == 0
    with pytest.raises(ProtocolError):
        next(frames)


def test_padding_in_the_contiguous_layout_is_zeroed():
    # NNG messages are fresh heap memory: the gaps between header and buffers must not carry
    # whatever the allocator left there to the peer.
    c = Codec()
    frame = c.encode(MSG, "t", 1, 0, 0, {"a": np.arange(3, dtype=np.int8), "b": np.ones(1)})
    out = bytearray(b"\xee" * frame.size)
    frame.write_into(memoryview(out))
    assert out == frame.to_bytes()  # to_bytes writes into zeroed memory


@pytest.mark.parametrize("payload", [7, {"a": np.arange(3, dtype=np.int8), "b": np.ones(1), "c": b"x" * 70_000},
                                     np.zeros(0), [np.arange(5), np.arange(100_000, dtype=np.float32)]])
def test_the_gathered_parts_are_the_contiguous_layout(payload):
    # The tcp link sends large frames as these views (sendmsg), the same bytes as to_bytes().
    frame = Codec().encode(MSG, "t", 1, 0, 0, payload)
    assert b"".join(frame.parts()) == frame.to_bytes()


def test_a_large_receive_buffer_is_not_written_before_the_frame_lands():
    """bytearray(n) zeroes every page (for 100 MB ~60 ms here, more than receiving it): a
    large buffer for a frame to be received into must map its pages only as bytes land."""
    import resource

    from mq.wire.codec import empty_buffer

    size = 64 << 20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buf = empty_buffer(size)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert len(buf) == memoryview(buf).nbytes == size and not memoryview(buf).readonly
    assert faults < 64, f"{faults} page faults making an empty {size}-byte buffer"
    memoryview(buf)[size - 3:] = b"end"  # writable to the last byte, a frame fits
    assert bytes(memoryview(buf)[-3:]) == b"end"
    small = empty_buffer(100)
    assert isinstance(small, bytearray) and len(small) == 100
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    zeroed = bytearray(size)  # what the links used before: this check tells the two apart
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before >= 64 and len(zeroed) == size
