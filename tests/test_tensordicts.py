"""TensorDict payloads (mq/wire/tensordicts.py through mq/wire/codec.py): batch size, nested keys, names,
NonTensorData, lazy stacks round-trip with their tensors out of band and nothing pickled; what
cannot go is an EncodeError; a malformed tree is a ProtocolError; `import mq` does not import
tensordict."""

from __future__ import annotations

import subprocess
import sys

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mq.wire.codec import MSG, Codec
from mq.errors import EncodeError, ProtocolError

tdm = pytest.importorskip("tensordict", reason="tensordict is not installed (pip install '.[torchrl]')")
TensorDict, NonTensorData, NonTensorStack = tdm.TensorDict, tdm.NonTensorData, tdm.NonTensorStack
LazyStackedTensorDict = tdm.LazyStackedTensorDict

pytestmark = pytest.mark.timeout(120)


def roundtrip(payload):
    codec = Codec()
    frame = codec.encode(MSG, "t", 1, 2, 0, payload)
    assert b"tensordict" not in bytes(frame.header), "nothing of tensordict's classes may be pickled"
    return codec.decode_frame(frame.to_bytes()).payload


def same(a, b) -> bool:
    """Structure, classes, batch sizes, names and every value equal."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, NonTensorStack):
        return a.stack_dim == b.stack_dim and len(a.tensordicts) == len(b.tensordicts) and all(
            same(x, y) for x, y in zip(a.tensordicts, b.tensordicts))
    if isinstance(a, NonTensorData):
        return a.batch_size == b.batch_size and a.data == b.data
    if isinstance(a, LazyStackedTensorDict):
        return a.stack_dim == b.stack_dim and all(same(x, y) for x, y in zip(a.tensordicts, b.tensordicts))
    if isinstance(a, TensorDict):
        names = (a.names if a._has_names() else None, b.names if b._has_names() else None)
        return (a.batch_size == b.batch_size and names[0] == names[1] and list(a.keys()) == list(b.keys())
                and all(same(a.get(k), b.get(k)) for k in a.keys()))
    return a == b


DTYPES = [torch.float32, torch.int64, torch.bool, torch.uint8, torch.float16]
INTS = st.integers(-(1 << 63), (1 << 63) - 1)  # what msgpack carries (a larger int is an EncodeError)
keys = st.text(alphabet="abcxyz_", min_size=1, max_size=6)


@st.composite
def tensordicts(draw, depth=0):
    batch = draw(st.lists(st.integers(0, 3), max_size=2))
    td = TensorDict(batch_size=batch, names=draw(st.sampled_from([None, ["b0", "b1"][:len(batch)] or None])))
    for key in draw(st.lists(keys, max_size=4, unique=True)):
        kind = draw(st.sampled_from(["tensor", "nested", "text"] if depth < 2 else ["tensor", "text"]))
        if kind == "tensor":
            extra = draw(st.lists(st.integers(0, 3), max_size=2))
            dtype = draw(st.sampled_from(DTYPES))
            td.set(key, (torch.rand(tuple(batch) + tuple(extra)) * 100).to(dtype))
        elif kind == "nested":
            inner = draw(tensordicts(depth=depth + 1))
            td.set(key, TensorDict(dict(inner.items()), batch_size=batch) if inner.batch_size == torch.Size(batch)
                   else TensorDict(batch_size=batch))
        else:
            td.set_non_tensor(key, draw(st.one_of(st.text(max_size=8), INTS, st.none())))
    return td


@settings(max_examples=60, deadline=None)
@given(tensordicts())
def test_tensordicts_roundtrip(td):
    assert same(td, roundtrip(td))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=4), st.integers(0, 1))
def test_lazy_stacks_of_differently_shaped_tensordicts_roundtrip(lengths, dim):
    parts = [TensorDict({"obs": torch.arange(n, dtype=torch.float32).reshape(1, n).expand(2, n).clone()}, [2])
             for n in lengths]
    lazy = LazyStackedTensorDict(*parts, stack_dim=dim)
    out = roundtrip(lazy)
    assert same(lazy, out) and out.stack_dim == dim


def test_non_tensor_stacks_and_tensordicts_inside_plain_payloads():
    stack = NonTensorStack(NonTensorData("left"), NonTensorData({"x": [1, 2]}))
    td = TensorDict({"a": torch.ones(2, 3)}, batch_size=[2])
    out = roundtrip({"batch": td, "info": stack, "step": 7})
    assert same(out["batch"], td) and out["info"].tolist() == ["left", {"x": [1, 2]}] and out["step"] == 7


def test_tensors_travel_out_of_band():
    td = TensorDict({"obs": torch.zeros(256, 1024)}, batch_size=[256])
    frame = Codec().encode(MSG, "t", 0, 0, 0, td)
    assert len(frame.header) < 300 and frame.size >= 256 * 1024 * 4


def test_what_cannot_go_is_an_encode_error_that_says_how_to_convert_it():
    with pytest.raises(EncodeError, match="to_tensordict"):
        roundtrip(tdm.TensorDictParams(TensorDict(a=torch.zeros(2))))
    with pytest.raises(EncodeError, match="builtins.object"):
        roundtrip(TensorDict(a=NonTensorData(object())))


@pytest.mark.parametrize("tree", [
    ["td", [2], None, None, {"a": 1}, "extra"],  # a field too many
    ["td", [-1], None, None, {}],  # a negative batch size
    ["td", [2], None, ["x", "y"], {}],  # more names than dims
    ["td", [2], 5, None, {}],  # a device that is no string
    ["nope", 1],
    ["lazy", 0, []],
])
def test_malformed_trees_are_protocol_errors(tree):
    body = msgpack.packb(msgpack.ExtType(6, msgpack.packb(tree)))
    with pytest.raises(ProtocolError):
        Codec().unpack(body, [])


def test_a_tensor_that_does_not_fit_its_batch_size_is_a_protocol_error():
    codec = Codec()
    tree, buffers = codec.pack(TensorDict({"a": torch.zeros(3)}, batch_size=[3]))
    forged = tree.replace(msgpack.packb([3]), msgpack.packb([4]))
    with pytest.raises(ProtocolError):
        codec.unpack(forged, [memoryview(bytearray(b)) for b in buffers])


def test_importing_mq_does_not_import_tensordict():
    code = "import sys, mq, mq.wire.codec; assert 'tensordict' not in sys.modules, 'imported'"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
