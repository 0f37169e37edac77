"""Payload codec: a user object <-> a msgpack tree plus out-of-band buffers, the body of a
:class:`~mq.wire.frames.Frame` (the frame's contiguous layout and envelope are :mod:`mq.wire.frames`'s;
their names are importable from here too).

The envelope's ``tree`` is the payload with every array, tensor, tuple and large bytes value
replaced by a msgpack ExtType that names its buffer; ``sizes[i]`` is buffer ``i``'s length;
``descs`` is None or ``{i: descriptor}`` for buffers that travel by a data path (:mod:`mq.datapaths.shm.pool`;
their inline size is 0). Array and tensor data never enter the msgpack body. torch RPC sends
the header as a uint8 tensor and the buffers as RPC tensors. On receive, arrays and tensors are
views of the received message or of the sender's shared memory (no copy).

Safety: nothing is unpickled unless the codec was built with ``allow_pickle=True`` on the
receiving side; object dtypes are refused; every span and shape is checked against the frame
before a view is made, so a malformed frame raises :class:`ProtocolError` and nothing else.
"""

from __future__ import annotations

import pickle
import weakref
from collections.abc import Sequence
from typing import Any, Callable, NamedTuple

import msgpack
import numpy as np

from mq.wire import frames as _frames
from mq.wire import tensordicts
from mq.errors import EncodeError, Oversized, ProtocolError
from mq.wire.frames import (ALIGN, BYE, GPU_POOL, HELLO, HELLO_ACK, KIND_NAMES, LINK, MAX_BUFFERS,  # noqa: F401
                       MSG, PATH, PING, RELAY, RELEASE, REP_ERR, REP_OK, REQ, SUBS, VERSION, ZERO_PAD, Frame,
                       _is_tensor, _NUMPY_OK, _packb,
                       _tensor_bytes, _unpack_head, buffer_nbytes, check_envelope, empty_buffer, split,
                       split_batch)




# msgpack extension codes of the payload tree.
_EXT_TUPLE, _EXT_NDARRAY, _EXT_TENSOR, _EXT_PICKLE, _EXT_BYTES, _EXT_TENSORDICT = 1, 2, 3, 4, 5, 6

# bytes values at least this large go out of band too (no copy into the msgpack body).
_OOB_BYTES_MIN = 64 * 1024

#: Tuples nested deeper than this are refused both ways: each level is a msgpack call of its
#: own, with ~41 KB of C stack (a few hundred levels overflow a thread's 8 MiB stack).
MAX_DEPTH = 32
#: Arrays, tensors and large bytes values one frame may carry (a large model's state_dict has a
#: few thousand); the receiver refuses a header listing more before making a view of any.

# torch is imported on first use: a process that never touches a tensor (a collector stepping
# numpy environments, `mq doctor`) does not pay its ~1 CPU-second import and ~180 MB. A reader
# that imports it reads nothing meanwhile: the watchers (nodes' liveness) judge no silence then.
torch: Any = None
_IMPORT_WATCHERS: list[weakref.WeakMethod] = []


def watch_torch_import(stalled: Callable[[], None]) -> None:
    """Call ``stalled()`` (a bound method, held weakly) when torch's first import begins and
    when it ends, unless torch is imported already."""
    if torch is None:
        _IMPORT_WATCHERS[:] = [ref for ref in _IMPORT_WATCHERS if ref() is not None]  # (nodes gone)
        _IMPORT_WATCHERS.append(weakref.WeakMethod(stalled))


def _tell_import_watchers() -> None:
    for ref in list(_IMPORT_WATCHERS):
        if (stalled := ref()) is not None:
            stalled()
_TORCH_DTYPES: dict[str, Any] = {}
_DTYPE_NAMES: dict[Any, str] = {}
_TENSOR_NAME_OF: dict[str, str] = {}  # numpy dtype str -> torch dtype name, for _NUMPY_OK dtypes


def _load_torch() -> Any:
    global torch
    if torch is None:
        _tell_import_watchers()
        import torch as _torch

        names = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16",
                 "float32", "float64", "complex64", "complex128",
                 "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2"]
        _TORCH_DTYPES.update({n: getattr(_torch, n) for n in names if hasattr(_torch, n)})
        _DTYPE_NAMES.update({dt: n for n, dt in _TORCH_DTYPES.items()})
        # dtypes numpy can view directly (the others go through a uint8 view)
        _NUMPY_OK.update(_TORCH_DTYPES[n] for n in names[:7] + ["float32", "float64"])
        _TENSOR_NAME_OF.update({np.dtype(str(_torch.empty(0, dtype=dt).numpy().dtype)).str: _DTYPE_NAMES[dt]
                                for dt in _NUMPY_OK})
        torch = _frames.torch = _torch
        _tell_import_watchers()
        _IMPORT_WATCHERS.clear()
    return torch


class Envelope(NamedTuple):
    """One decoded frame. (A named tuple: made per received frame, and a frozen dataclass's
    constructor costs four times as much.)"""

    kind: int
    topic: str
    sender: int
    seq: int
    corr: int
    payload: Any
    sent_at: float = 0.0  # the sender's time.time() when it encoded the frame
    nbytes: int = 0  # the payload's buffer bytes, inline and shared


def _prepare_tensor(t: "torch.Tensor") -> "torch.Tensor":
    if t.is_contiguous() and not t.requires_grad and t.layout == torch.strided and not (
            t.is_conj() or t.is_neg() or t.is_quantized):
        return t  # the common case, checked cheaply
    if t.layout != torch.strided or t.is_quantized:
        raise EncodeError(
            f"cannot send a {t.layout} tensor (quantized={t.is_quantized}): convert it with "
            ".to_dense() / .dequantize() first"
        )
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.contiguous()


class Codec:
    """Turns payloads into frames and back.

    Args:
        allow_pickle: on send, pickle values the codec cannot carry natively; on receive,
            unpickle such values. Off by default: a frame from the network is never unpickled
            unless the receiving side opted in.
        keep_tensors: keep torch tensors (CPU or CUDA) as tensor objects in the buffer list
            instead of turning them into bytes; the torch RPC backend sends them as RPC tensors.
        max_frame_bytes: frames larger than this are refused on receive.
    """

    def __init__(self, *, allow_pickle: bool = False, keep_tensors: bool = False,
                 max_frame_bytes: int = 4 << 30):
        self.allow_pickle = allow_pickle
        self.keep_tensors = keep_tensors
        self.max_frame_bytes = max_frame_bytes

    # ------------------------------------------------------------------ encode
    def pack(self, payload: Any) -> tuple[bytes, list[Any]]:
        """Payload -> (msgpack tree, buffers). Buffers are uint8 numpy arrays, bytes, or tensors."""
        fast = _pack_common(payload, self.keep_tensors)
        if fast is not None:
            return fast
        buffers: list[Any] = []
        depth = [0]  # tuples being packed inside each other (see MAX_DEPTH)

        def nested(code: int, items: list[Any]) -> msgpack.ExtType:
            if depth[0] >= MAX_DEPTH:
                raise EncodeError(f"cannot send tuples or TensorDicts nested more than {MAX_DEPTH} deep: "
                                  "use lists for deep structures")
            depth[0] += 1
            try:
                return msgpack.ExtType(code, packb(items))  # noqa: F821 (del below)
            finally:
                depth[0] -= 1

        def default(obj: Any) -> msgpack.ExtType:
            if isinstance(obj, tuple):
                return nested(_EXT_TUPLE, list(obj))  # noqa: F821 (del below)
            if isinstance(obj, np.ndarray):
                return self._pack_ndarray(obj, buffers)
            if _is_tensor(obj):
                return self._pack_tensor(obj, buffers)
            if isinstance(obj, (bytearray, memoryview)):
                return default(bytes(obj))  # noqa: F821 (del below)
            if isinstance(obj, bytes):  # only large ones reach here (see below)
                buffers.append(obj)
                return msgpack.ExtType(_EXT_BYTES, packb(len(buffers) - 1))  # noqa: F821 (del below)
            if isinstance(obj, np.generic):
                return default(np.asarray(obj)) if obj.dtype.kind in "mMV" else obj.item()  # noqa: F821 (del below)
            base: Any  # a declaration, no code: mypy cannot pair each type with the value it matched
            for base in (bool, int, float, str, dict, list):  # subclasses: IntEnum, OrderedDict
                if isinstance(obj, base):
                    return base(obj)
            if tensordicts.is_tensordict(obj):  # its tensors are leaves: out of band, as any tensor
                return nested(_EXT_TENSORDICT, tensordicts.to_tree(obj))  # noqa: F821 (del below)
            if self.allow_pickle:
                return msgpack.ExtType(_EXT_PICKLE, pickle.dumps(obj, protocol=5))
            raise EncodeError(
                f"cannot send a value of type {type(obj).__module__}.{type(obj).__qualname__}: "
                "mq carries dict/list/tuple/str/bytes/int/float/bool/None, numpy arrays, torch "
                "tensors and TensorDicts. Convert it, or opt in to pickling with mq.create(..., allow_pickle=True) "
                "on both sides (only between peers you trust)."
            )

        lift = [False]

        def packb(obj: Any) -> bytes:
            return msgpack.packb(_lift_big_bytes(obj) if lift[0] else obj, default=default,  # noqa: F821 (del below)
                                 strict_types=True, use_bin_type=True)

        try:
            tree = packb(payload)
            if len(tree) >= _OOB_BYTES_MIN:
                # Large bytes went into the msgpack body: pack again with them out of band.
                # Small payloads (the common case) never pay for looking for them.
                lift[0] = True
                buffers.clear()
                tree = packb(payload)
            if len(buffers) > MAX_BUFFERS:
                raise EncodeError(f"cannot send {len(buffers)} arrays/tensors/large bytes values in "
                                  f"one message (at most {MAX_BUFFERS}): split it, or stack them")
            return tree, buffers
        except (TypeError, ValueError, OverflowError) as exc:
            if isinstance(exc, EncodeError):
                raise
            raise EncodeError(f"cannot encode payload: {exc}") from exc
        finally:
            # The two closures refer to each other through their cells: a reference cycle that
            # would keep the payload alive until the cyclic GC runs (gigabytes for big frames).
            # Emptying the cells breaks it, so memory is freed as soon as the caller lets go.
            # (ruff's F821 above reads this del as if it ran before the closures' calls: it does not.)
            del default, packb, nested

    def _pack_ndarray(self, arr: np.ndarray, buffers: list[Any]) -> msgpack.ExtType:
        if arr.dtype.hasobject:
            raise EncodeError(
                f"cannot send a numpy array of dtype {arr.dtype}: object arrays would need "
                "pickling; convert to a numeric dtype or pass allow_pickle=True"
            )
        if not arr.dtype.itemsize:
            raise EncodeError(f"cannot send a numpy array of dtype {arr.dtype!r}: its items have "
                              "no bytes (give the string or void type a length, e.g. 'S8')")
        shape = list(arr.shape)  # ascontiguousarray turns 0-d into 1-d: keep the real shape
        arr = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
        buffers.append(arr.reshape(-1).view(np.uint8) if arr.size else np.empty(0, np.uint8))
        meta = [arr.dtype.str, shape, len(buffers) - 1]
        return msgpack.ExtType(_EXT_NDARRAY, msgpack.packb(meta))

    def _pack_tensor(self, t: "torch.Tensor", buffers: list[Any]) -> msgpack.ExtType:
        _load_torch()
        dtype = _DTYPE_NAMES.get(t.dtype)
        if dtype is None:
            raise EncodeError(f"cannot send a tensor of dtype {t.dtype}: not supported by mq")
        t = _prepare_tensor(t)
        on_cpu = t.device.type == "cpu"
        if self.keep_tensors or not on_cpu:
            # CUDA tensors stay tensors: the sender picks per peer between a CUDA IPC descriptor
            # and staging through host (Frame.staged; the receiver puts them back on the index).
            buffers.append(t)
        else:
            buffers.append(_tensor_bytes(t))
        meta = [dtype, list(t.shape), len(buffers) - 1, "cpu" if on_cpu else str(t.device)]
        return msgpack.ExtType(_EXT_TENSOR, msgpack.packb(meta))

    def encode(self, kind: int, topic: str, sender: int, seq: int, corr: int,
               payload: Any) -> "Frame":
        tree, buffers = self.pack(payload)
        return Frame.build(kind, topic, sender, seq, corr, tree, buffers)

    # ------------------------------------------------------------------ decode
    def unpack(self, tree: bytes, buffers: Sequence[Any], shared: Any = ()) -> Any:
        """(msgpack tree, buffers) -> payload. Buffers are memoryviews (or tensors); numpy
        arrays over the buffer indices in ``shared`` (another process's memory) are read-only."""
        known = _ONE_BUFFER_TREES.get(tree) if len(buffers) == 1 else None
        if known is not None and not shared:
            out = known(buffers[0])
            if out is not None:
                return out
        # Without buffers, the ext hook only runs for tuples and pickles: no reader to make.
        reader = _TreeReader(self, buffers, shared) if buffers else self
        try:
            out = msgpack.unpackb(tree, ext_hook=reader.ext_hook, raw=False, strict_map_key=False,
                                  use_list=True)
        except ProtocolError:
            raise
        except Exception as exc:  # any malformed tree is a protocol error, never a crash
            raise ProtocolError(f"malformed payload: {type(exc).__name__}: {exc}") from exc
        if len(buffers) == 1 and not shared:
            _remember_one_buffer_tree(tree, out)
        return out

    def ext_hook(self, code: int, data: bytes) -> Any:
        """The ext hook of a frame without buffers: tuples and (opted-in) pickles only."""
        return _TreeReader(self, (), _NOTHING_SHARED).ext_hook(code, data)

    def _unpack_ndarray(self, data: bytes, buffers: Sequence[Any], shared: Any) -> np.ndarray:
        meta = _NDARRAY_META.get(data)
        if meta is not None:  # seen before (a stream of same-shaped arrays): checked then
            dtype, shape, index, nbytes = meta
            buf = _buffer_at(buffers, index)
            if len(buf) != nbytes:
                raise ProtocolError(f"shape {list(shape)} x {dtype.itemsize} bytes does not match "
                                    f"buffer of {len(buf)} bytes")
        else:
            dtype_str, shape, index = msgpack.unpackb(data)
            dtype = np.dtype(dtype_str)
            if dtype.hasobject or not dtype.itemsize:  # zero-size items: any shape, no bytes
                raise ProtocolError(f"refusing numpy dtype {dtype_str!r} (object fields or items of 0 bytes)")
            buf = _buffer_at(buffers, index)
            _check_size(shape, dtype.itemsize, len(buf))
            if len(_NDARRAY_META) >= _TREES_MAX:
                _NDARRAY_META.clear()
            _NDARRAY_META[data] = (dtype, tuple(shape), index, len(buf))
        if len(buf) == 0:
            return np.empty(shape, dtype=dtype)
        arr = np.frombuffer(buf, dtype=dtype).reshape(shape)
        if index in shared:
            arr.flags.writeable = False  # a view of the sender's slot, maybe shared: copy to write
        return arr

    def _unpack_tensor(self, data: bytes, buffers: Sequence[Any], shared: Any = ()) -> Any:
        dtype_name, shape, index, device = msgpack.unpackb(data)
        _load_torch()
        dtype = _TORCH_DTYPES.get(dtype_name)
        if dtype is None:
            raise ProtocolError(f"unknown tensor dtype {dtype_name!r}")
        if not isinstance(index, int) or not 0 <= index < len(buffers):
            raise ProtocolError(f"tensor refers to buffer {index!r}, frame has {len(buffers)}")
        buf = buffers[index]
        if index in shared and _is_tensor(buf):  # a CUDA IPC view: raw bytes of the peer's slot
            _check_size(shape, dtype.itemsize, buf.numel())
            return buf.view(dtype).view(shape)
        if _is_tensor(buf):  # keep_tensors transports (torch RPC) deliver tensor objects
            if buf.dtype != dtype or list(buf.shape) != shape:
                raise ProtocolError(f"tensor buffer {index} is {buf.dtype} {list(buf.shape)}, "
                                    f"the header says {dtype_name} {shape}")
            if buf.device.type != "cpu":
                return buf  # the transport's device map already put it where it belongs
            t = buf
        else:
            _check_size(shape, dtype.itemsize, len(buf))
            if len(buf) == 0:
                t = torch.empty(shape, dtype=dtype)
            else:
                if memoryview(buf).readonly:
                    buf = bytearray(buf)  # torch wants writable memory (a copy, no zeroing)
                t = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)
        return _place(t, device)

    def decode(self, header: Any, buffers: list[Any],
               resolve: Callable[[int, Any], Any] | None = None) -> Envelope:
        """One frame -> :class:`Envelope`; :class:`ProtocolError` if malformed.

        Args:
            header: the msgpack envelope (bytes-like), or the list :func:`split` parsed.
            buffers: the inline buffers (memoryviews or tensors), one per ``sizes`` entry.
            resolve: turns a shm descriptor into a view (:meth:`mq.datapaths.shm.pool.PoolReader.view`); a
                frame with descriptors and no resolver is malformed.
        """
        try:
            head = header if isinstance(header, list) else _unpack_head(header)
            version, kind, topic, sender, seq, corr, tree, sizes, descs, sent_at = head
        except Exception as exc:
            raise ProtocolError(f"malformed envelope: {type(exc).__name__}: {exc}") from exc
        check_envelope(version, kind, topic, sender, corr, tree)
        if type(sizes) is not list or len(sizes) != len(buffers) or len(sizes) > MAX_BUFFERS:
            raise ProtocolError(f"envelope lists {sizes!r} buffer sizes, the frame has {len(buffers)}")
        shared: Any = _NOTHING_SHARED
        if descs is not None:
            shared = set()
            if not isinstance(descs, dict) or resolve is None:
                raise ProtocolError("frame carries shared-memory descriptors this link cannot resolve")
            buffers = list(buffers)
            for index, desc in descs.items():
                if not (isinstance(index, int) and 0 <= index < len(buffers)) or sizes[index] != 0:
                    raise ProtocolError(f"descriptor for buffer {index!r} does not match the frame")
                buffers[index] = resolve(sender, desc)
                shared.add(index)
        elif kind == RELAY:  # it may lie in the relay's pool, shared with its host (mq.fanout.relays)
            shared = _EVERY_BUFFER  # so its numpy views are read-only, as its neighbours' are
        if not isinstance(sent_at, float):
            raise ProtocolError("envelope send time is not a float")
        if descs is None and isinstance(header, list):
            nbytes = sum(sizes)  # split() checked them against the buffers
        else:
            nbytes = 0
            for b in buffers:
                nbytes += buffer_nbytes(b)
        return Envelope(kind, topic, sender, seq, corr, self.unpack(tree, buffers, shared), sent_at, nbytes)

    def decode_frame(self, frame: Any) -> Envelope:
        """A frame in the contiguous layout -> :class:`Envelope` (no shm descriptors);
        :class:`ProtocolError` if it is malformed or larger than ``max_frame_bytes``."""
        if memoryview(frame).nbytes > self.max_frame_bytes:
            raise Oversized(f"frame of {memoryview(frame).nbytes} bytes exceeds "
                                f"max_frame_bytes={self.max_frame_bytes}")
        return self.decode(*split(frame))


_NOTHING_SHARED: frozenset[int] = frozenset()
_EVERY_BUFFER = range(MAX_BUFFERS)


class _EachOnce(Sequence):
    """A frame's buffers, each of which the payload tree may name once: the encoder never names
    one twice, and a tree naming a 1 MiB buffer a thousand times would decode to a GiB of
    copies (3 bytes of frame each)."""

    __slots__ = ("_buffers", "_taken")

    def __init__(self, buffers: Sequence[Any]):
        self._buffers = buffers
        self._taken: set[int] = set()

    def __len__(self) -> int:
        return len(self._buffers)

    def __getitem__(self, index: Any) -> Any:
        if index in self._taken:
            raise ProtocolError(f"payload names buffer {index} twice")
        self._taken.add(index)
        return self._buffers[index]


class _TreeReader:
    """Turns one frame's payload tree back into objects: the ext hook msgpack calls for every
    extension value, with the frame's buffers at hand and the tuple nesting counted, so a
    hostile tree cannot recurse into the C stack (each level is a msgpack call of its own)."""

    __slots__ = ("codec", "buffers", "shared", "depth")

    def __init__(self, codec: Codec, buffers: Sequence[Any], shared: Any):
        self.codec = codec
        self.buffers = _EachOnce(buffers)
        self.shared = shared
        self.depth = 0

    def ext_hook(self, code: int, data: bytes) -> Any:
        if code == _EXT_TUPLE:
            if self.depth >= MAX_DEPTH:
                raise ProtocolError(f"payload nests tuples more than {MAX_DEPTH} deep")
            self.depth += 1
            try:
                items = msgpack.unpackb(data, ext_hook=self.ext_hook, raw=False,
                                        strict_map_key=False, use_list=True)
            finally:
                self.depth -= 1
            # The encoder packs a tuple as a list. Anything else would be iterated: a tensor
            # of shape [2**31, ...] named by a 30-byte tuple made 2**31 objects (the fuzzer).
            if type(items) is not list:
                raise ProtocolError(f"a tuple must hold a list, not a {type(items).__name__}")
            return tuple(items)
        if code == _EXT_TENSORDICT:
            if self.depth >= MAX_DEPTH:
                raise ProtocolError(f"payload nests TensorDicts more than {MAX_DEPTH} deep")
            self.depth += 1
            try:
                tree = msgpack.unpackb(data, ext_hook=self.ext_hook, raw=False, strict_map_key=False, use_list=True)
            finally:
                self.depth -= 1
            return tensordicts.from_tree(tree)
        if code == _EXT_NDARRAY:
            return self.codec._unpack_ndarray(data, self.buffers, self.shared)
        if code == _EXT_TENSOR:
            return self.codec._unpack_tensor(data, self.buffers, self.shared)
        if code == _EXT_BYTES:
            return bytes(_buffer_at(self.buffers, msgpack.unpackb(data)))
        if code == _EXT_PICKLE:
            if not self.codec.allow_pickle:
                raise ProtocolError("received a pickled value but this node does not unpickle network "
                                    "data; create it with allow_pickle=True if the sender is trusted")
            return pickle.loads(data)
        raise ProtocolError(f"unknown extension code {code} in payload")


# ---------------------------------------------------------------------- the common payloads
# RL control traffic is mostly one tensor or array, a scalar or string, or a flat dict of those.
# They skip msgpack's per-object ``default`` callback, and a one-tensor/array tree seen before
# is decoded from a table instead of being parsed again: these paths run per message.
_SCALARS = frozenset({int, float, str, bool, type(None)})
_TREES_MAX = 512  # distinct (dtype, shape) trees remembered; cleared when full
_ENCODED_TREES: dict[Any, bytes] = {}  # (kind, dtype, shape) -> tree
_ONE_BUFFER_TREES: dict[bytes, Callable[[Any], Any]] = {}  # tree -> buffer -> payload (or None)
_NDARRAY_META: dict[bytes, tuple[Any, tuple, int, int]] = {}  # ext data -> checked (dtype, shape, index, nbytes)


def _pack_common(payload: Any, keep_tensors: bool) -> tuple[bytes, list[Any]] | None:
    """(tree, buffers) for a common payload, or None: the general encoder handles it."""
    t = type(payload)
    try:
        if t in _SCALARS:
            return _packb.pack(payload), []
        if t is dict and len(payload) <= 16:
            buffers: list[Any] = []
            tree: dict[Any, Any] = {}
            for k, v in payload.items():
                vt = type(v)
                if type(k) is not str:
                    return None
                if vt in _SCALARS or (vt is bytes and len(v) < _OOB_BYTES_MIN):
                    tree[k] = v
                    continue
                ext = _common_buffer(v, vt, len(buffers), keep_tensors, buffers)
                if ext is None:
                    return None
                tree[k] = ext
            return _packb.pack(tree), buffers
        buffers = []
        ext = _common_buffer(payload, t, 0, keep_tensors, buffers)
        return None if ext is None else (_packb.pack(ext), buffers)
    except (OverflowError, ValueError, TypeError, RuntimeError):
        return None  # the general encoder says what is wrong


def _common_buffer(v: Any, vt: type, index: int, keep_tensors: bool, buffers: list[Any]) -> Any:
    """The ExtType of one contiguous CPU tensor or numeric numpy array (appending its buffer),
    or None when the general encoder must look at it."""
    if vt is np.ndarray:
        if not (v.flags.c_contiguous and v.nbytes and v.ndim) or v.dtype.hasobject:
            return None
        key: Any = (_EXT_NDARRAY, v.dtype.str, v.shape, index)
        buffers.append(v.reshape(-1).view(np.uint8))
    elif torch is not None and vt is torch.Tensor:
        # Looked at through numpy: a tensor's attributes go through torch's dispatcher (~10 of
        # them cost ~3 us per message); numpy() itself refuses what must take the long way (a
        # tensor that needs grad, is not on the CPU or not strided, a conjugate or negated view).
        try:
            arr = v.numpy()
        except (RuntimeError, TypeError, ValueError):
            return None
        name = _TENSOR_NAME_OF.get(arr.dtype.str)
        if name is None or not (arr.flags.c_contiguous and arr.ndim and arr.size):
            return None
        key = (_EXT_TENSOR, name, arr.shape, index)
        buffers.append(v if keep_tensors else arr)
    else:
        return None
    ext = _ENCODED_TREES.get(key)
    if ext is None:
        if len(_ENCODED_TREES) >= _TREES_MAX:
            _ENCODED_TREES.clear()
        meta = [key[1], list(key[2]), index] if vt is np.ndarray else [key[1], list(key[2]), index, "cpu"]
        ext = _ENCODED_TREES[key] = msgpack.ExtType(key[0], msgpack.packb(meta))
    return ext


def _remember_one_buffer_tree(tree: bytes, out: Any) -> None:
    """After a one-buffer frame decoded the long way: if its payload was a plain CPU tensor or
    a writable array, remember how to decode that exact tree again from its buffer alone."""
    if tree in _ONE_BUFFER_TREES or not _holds_bytes(out):
        return  # (an empty buffer goes the long way: torch.frombuffer refuses zero bytes)
    if type(out) is np.ndarray and out.flags.writeable and out.ndim:
        dtype, shape, nbytes = out.dtype, out.shape, out.nbytes

        def decode(buf: Any) -> Any:
            if type(buf) is memoryview and len(buf) == nbytes:
                return np.frombuffer(buf, dtype=dtype).reshape(shape)
            if _flat_bytes(buf, nbytes):  # torch RPC's buffers, as arrays
                return buf.view(dtype).reshape(shape)
            return None  # the long way
    elif torch is not None and type(out) is torch.Tensor and out.is_cpu and out.dim():
        tdtype, tshape, tbytes = out.dtype, tuple(out.shape), out.numel() * out.element_size()
        flat = len(tshape) == 1 and tdtype is torch.uint8

        def decode(buf: Any) -> Any:
            if type(buf) is memoryview and len(buf) == tbytes and not buf.readonly:
                t = torch.frombuffer(buf, dtype=torch.uint8)
            elif _flat_bytes(buf, tbytes) and buf.flags.writeable:
                t = torch.from_numpy(buf)
            else:
                return None  # read-only memory or another kind of buffer: the long way
            return t if flat else t.view(tdtype).view(*tshape)  # (a torch.Size costs ~2 us more)
    else:
        return
    if len(_ONE_BUFFER_TREES) >= _TREES_MAX:
        _ONE_BUFFER_TREES.clear()
    _ONE_BUFFER_TREES[tree] = decode


def _holds_bytes(out: Any) -> bool:
    return (type(out) is np.ndarray and out.nbytes > 0) or (
        torch is not None and type(out) is torch.Tensor and out.numel() > 0)


def _flat_bytes(buf: Any, nbytes: int) -> bool:
    """Whether ``buf`` is a contiguous 1-d uint8 numpy array of ``nbytes`` bytes (a peer's
    tensor may arrive strided: that one goes the long way, which refuses it)."""
    return (type(buf) is np.ndarray and buf.dtype == np.uint8 and buf.ndim == 1 and buf.nbytes == nbytes
            and buf.flags.c_contiguous)


def _lift_big_bytes(obj: Any) -> Any:
    """Large bytes go out of band; msgpack would copy them into its body otherwise."""
    if isinstance(obj, bytes) and len(obj) >= _OOB_BYTES_MIN:
        return _BigBytes(obj)
    if type(obj) is dict:
        return {k: _lift_big_bytes(v) for k, v in obj.items()} if _has_big_bytes(obj) else obj
    if type(obj) is list:
        return [_lift_big_bytes(v) for v in obj] if _has_big_bytes(obj) else obj
    return obj


def _has_big_bytes(obj: Any) -> bool:
    items = obj.values() if type(obj) is dict else obj
    return any((isinstance(v, bytes) and len(v) >= _OOB_BYTES_MIN)
               or (type(v) in (dict, list) and _has_big_bytes(v)) for v in items)


class _BigBytes(bytes):
    """A bytes subclass: with strict_types msgpack hands it to ``default`` (out of band)."""


def _buffer_at(buffers: Sequence[Any], index: Any) -> Any:
    if not isinstance(index, int) or not 0 <= index < len(buffers):
        raise ProtocolError(f"payload refers to buffer {index!r}, frame has {len(buffers)}")
    return buffers[index]


def _check_size(shape: Any, itemsize: int, nbytes: int) -> None:
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ProtocolError(f"bad shape {shape!r}")
    count = 1
    for d in shape:
        count *= d
    if count * itemsize != nbytes:
        raise ProtocolError(f"shape {shape} x {itemsize} bytes does not match buffer of {nbytes} bytes")


def _place(t: Any, device: Any) -> Any:
    """Put a received tensor on the device it was sent from when this node has it, else CPU."""
    if not isinstance(device, str) or not device.startswith("cuda") or not torch.cuda.is_available():
        return t
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        return t
    return t.to(f"cuda:{index}", non_blocking=False)

