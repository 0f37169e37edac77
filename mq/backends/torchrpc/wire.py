"""The torchrpc backend's wire format: frames as TorchScript RPCs, and the per-process agent.

Wire format
-----------
A frame is one RPC to the TorchScript function :func:`deliver_script`, which calls the custom op
``mq::deliver(int sender, int seq, int ack, str frame, Tensor[] buffers) -> int``:

* ``frame``: bytes as latin-1 text (one character per byte). A small frame (buffers of at most
  ``INLINE_MAX`` = 8 KiB, all in host memory; ``REMOTE_INLINE_MAX`` = 64 KiB to a peer whose
  tensors cannot take TensorPipe's ``cma`` channel) travels whole in it, in the codec's contiguous
  layout (:mod:`mq.wire.codec`, the one NNG sends), and ``buffers`` is empty: no RPC tensor, each
  of which costs TensorPipe a channel transfer (~0.1 ms here). Otherwise it holds the u32
  length prefix and the codec's frame header (the same envelope every transport carries; shm
  descriptors ride in it for same-host peers), and:
* ``buffers``: the frame's inline buffers as RPC tensors (``Codec(keep_tensors=True)``):
  numpy arrays and large bytes as flat uint8 tensors, torch tensors as themselves. With
  ``torchrpc:cuda`` a CUDA tensor goes device to device through the TensorPipe device map for
  that peer; without a map entry for its device (and always with ``torchrpc:cpu``) it is
  copied to host first, and the receiver puts it back on the same device index if it has one.
* ``seq``: the frame's number in the sender->receiver stream (0, 1, 2, ...);
  negative numbers are unordered control frames (empty ``frame``): -1 credit, -2 "I am
  blocked, credit me when you consume"; -3 (a heartbeat of older mq versions) is taken as a
  plain credit report. Liveness is core's heartbeat, an ordinary frame.
* ``ack``: how many frames of the *receiver's* stream to the sender the sender has consumed
  (credit piggybacked on every frame); the RPC's return value is the same count the other way.

A call is one RPC to :func:`request_script`: ``mq::request(int sender, str frame, Tensor[]
buffers) -> (str, Tensor[])`` carries a REQ frame laid out as above, and its return value is
the reply frame (REP_OK / REP_ERR) laid out the same way; empty text means "not taken here"
(the server's request threads are busy, or the caller's join is not confirmed yet) and the
caller sends the REQ as an ordinary frame. The server runs the ``on`` handler on the TensorPipe
thread that received the request (:meth:`mq.node.dispatch.Dispatch.on_request`); requests hold at most half
of TensorPipe's ``num_worker_threads``, so frames and heartbeats always find a thread. Calls are
not ordered against frames (only frames are numbered).

No pickle on the data path
--------------------------
torch RPC has three request kinds. A Python function target (``PYTHON_CALL``) is pickled with
Python's pickle and the receiver unpickles it, which can run arbitrary code. A builtin
operator and a TorchScript function (``SCRIPT_CALL``) are serialized with the TorchScript
pickler: the receiver's TorchScript unpickler only rebuilds TorchScript values (ints, strings,
tensors from the out-of-band tensor table, lists, tuples) and resolves nothing but TorchScript
types, so it cannot run arbitrary code. Calling ``mq::deliver`` itself as a builtin does not
work from Python: ``rpc_async`` only matches builtins in the ``aten`` namespace (torch
2.13: "Failed to match operator name mq::deliver ... to a builtin operator"). So mq calls the
scripted function ``deliver_script`` (public ``rpc.rpc_async(to, script_fn, args)``), which
travels as ``SCRIPT_CALL`` with only its qualified name and TorchScript arguments; on the
receiver the TorchScript interpreter runs it and the op's Python kernel hands the frame to this
module. Checked with traps on ``pickle.load(s)`` and torch's internal RPC unpickler
(``_InternalRPCPickler.deserialize``) while messages, tensors and calls flow both ways
(``tests/test_torchrpc.py::test_data_path_never_unpickles``): none fires on either side, while
one Python-function ``rpc_sync`` sent as a control fires them on both. The payload inside the
frame is decoded by :class:`mq.wire.codec.Codec` only, so nothing from the network is unpickled
unless the user opted in with ``allow_pickle=True``.

What torch itself still unpickles, and why that is acceptable: ``init_rpc`` builds the static
group with a Gloo ``all_gather_object`` and one ``_all_gather`` round of Python-function RPCs
(both pickled), and the TensorPipe agent will unpickle a ``PYTHON_CALL`` request from any
process that connects to its port. That is torch RPC's own trust model: every member of one RPC
group can run code in every other. mq never sends Python-function RPCs (shutdown is
non-graceful, which skips torch's pickled shutdown round), but it cannot stop the agent from
accepting them: run torchrpc only between nodes of one job on a network you trust, or use
``nng``.
"""

from __future__ import annotations

import ctypes
import struct
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, List, Tuple

import numpy as np
import torch

from mq.wire.codec import ALIGN, Frame, split
from mq.errors import ConfigError, Oversized, ProtocolError

CREDIT, WANT = -1, -2  # unordered control frames (negative seq; see above)
EMPTY = torch.empty(0, dtype=torch.uint8)
U32 = struct.Struct("<I")
# Frames whose buffers hold at most this many bytes travel whole as one text argument, no RPC
# tensor: TensorPipe spends ~0.1 ms per tensor (a channel transfer each), while TorchScript
# strings get slow as they grow (random bytes as latin-1 text; both ways of a script echo on the
# 2-core reference VM: 8 KiB 0.20 ms as text, 0.28 ms as a tensor; 20 KiB 0.35 against 0.28).
# An mq call of 4 KB / 8 KB took 0.52-0.56 ms inline against 0.62-0.66 ms with a 2 KiB bound.
INLINE_MAX = 8 << 10
# A peer on another host (or in another PID namespace) gets its tensors over TensorPipe's
# multiplexed channel (mpt_uv), which costs far more per RPC than cma: across a veth (two
# namespace hosts, 2-core VM) a script RPC took 0.65-0.75 ms with a 1-64 KiB tensor against
# 0.27-0.37 ms with the same bytes as text (256 KiB: 0.64-1.45 as text, 0.65 as a tensor).
REMOTE_INLINE_MAX = 64 << 10


# ---------------------------------------------------------------------- the wire entry point
_THREAD = threading.local()  # per Python thread state: gone with it, so "kept" means kept


def keep_thread_state() -> None:
    """Let the calling TensorPipe thread keep its Python thread state from now on.

    torch enters Python from its own C++ threads (op kernels, future callbacks) through
    pybind11, which creates a thread state, takes the GIL, runs, and deletes the thread state
    again: every frame, reply and callback paid that (measured on the 2-core reference VM: a
    1.25 KB ``call`` 0.52 -> 0.43-0.45 ms, 20 KB 0.80 -> 0.66 ms once kept). One unmatched
    ``PyGILState_Ensure`` (public C API; nesting is allowed while the GIL is held) keeps it
    for the life of the thread; threads Python started itself are left alone."""
    if getattr(_THREAD, "kept", False):
        return
    _THREAD.kept = True
    if isinstance(threading.current_thread(), threading._DummyThread) and hasattr(ctypes, "pythonapi"):
        ctypes.pythonapi.PyGILState_Ensure()


def _deliver_impl(sender: int, seq: int, ack: int, frame: str, buffers: List[torch.Tensor]) -> int:
    """Python kernel of ``mq::deliver``: runs on a TensorPipe worker thread of the receiver."""
    keep_thread_state()
    node = _ACTIVE
    if node is None:
        raise RuntimeError("mq: no torchrpc queue is listening in this process (it stopped)")
    return node.on_rpc(sender, seq, ack, frame, buffers)


def _request_impl(sender: int, frame: str, buffers: List[torch.Tensor]) -> Tuple[str, List[torch.Tensor]]:
    """Python kernel of ``mq::request``: runs on a TensorPipe worker thread of the server."""
    keep_thread_state()
    node = _ACTIVE
    if node is None:
        raise RuntimeError("mq: no torchrpc queue is listening in this process (it stopped)")
    return node.on_request_rpc(sender, frame, buffers)


def _define_op() -> Any:
    lib = torch.library.Library("mq", "DEF")
    # CONSERVATIVE: the op has side effects; TorchScript must never drop or reorder the call.
    lib.define("deliver(int sender, int seq, int ack, str frame, Tensor[] buffers) -> int",
               alias_analysis="CONSERVATIVE")
    lib.impl("deliver", _deliver_impl, "CompositeExplicitAutograd")
    lib.define("request(int sender, str frame, Tensor[] buffers) -> (str, Tensor[])",
               alias_analysis="CONSERVATIVE")
    lib.impl("request", _request_impl, "CompositeExplicitAutograd")
    return lib


_LIB = _define_op()


def deliver_script(sender: int, seq: int, ack: int, frame: str, buffers: List[torch.Tensor]) -> int:
    return torch.ops.mq.deliver(sender, seq, ack, frame, buffers)


def request_script(sender: int, frame: str, buffers: List[torch.Tensor]) -> Tuple[str, List[torch.Tensor]]:
    return torch.ops.mq.request(sender, frame, buffers)


with warnings.catch_warnings():  # torch.jit.script is deprecated in 2.x but still what RPC runs
    warnings.simplefilter("ignore")
    deliver_script = torch.jit.script(deliver_script)
    request_script = torch.jit.script(request_script)

try:  # what rpc_async ends in for a ScriptFunction
    from torch.distributed.rpc.api import _invoke_rpc_torchscript
except ImportError:  # a torch without it: the public call
    _invoke_rpc_torchscript = None  # type: ignore[assignment]  # the public call, then
_SCRIPT_NAMES = {f: torch._jit_internal._qualified_name(f) for f in (deliver_script, request_script)}


def rpc_async(info: Any, script: Any, args: tuple, timeout: float) -> Any:
    """``rpc.rpc_async(info, script, args)`` without its per-call Python: builtin lookup,
    profiler hooks and name resolution cost ~20 us of the ~75 us it takes to issue an RPC
    (2-core reference VM, a 20 KB tensor). Same request (``SCRIPT_CALL``), same future."""
    if _invoke_rpc_torchscript is None:
        from torch.distributed import rpc
        return rpc.rpc_async(info, script, args=args, timeout=timeout)
    return _invoke_rpc_torchscript(info.name, _SCRIPT_NAMES[script], args, {}, float(timeout), False)

# The text of the RPC error a server raises for a request it refused (not a broken link).
NOT_SERVED = "mq: request not served"
# torch's RPC timeout error (rpc_agent.h kRpcTimeoutErrorStr), not a broken link either.
RPC_TIMED_OUT = "ran for more than set timeout"


# ---------------------------------------------------------------------- per-process agent
_AGENT_LOCK = threading.Lock()
_ACTIVE: Any = None  # the transport owning this process's RPC agent


def claim_agent(transport: Any) -> None:
    """Make ``transport`` this process's RPC agent owner (torch allows one agent per process).

    Raises:
        ConfigError: another mq queue, or someone else, holds the agent.
    """
    global _ACTIVE
    with _AGENT_LOCK:
        if _ACTIVE is not None:
            other = _ACTIVE
            state = ("is still shutting down" if other.closed else "is listening")
            raise ConfigError(
                f"node {transport.node_id}: this process already has a torch RPC agent (node "
                f"{other.node_id}'s {other.mq_type} queue {state}); torch allows one RPC agent "
                "per process: run each torchrpc node in its own process (mq.launch / mq run), "
                "or stop() the other queue first")
        if _rpc_agent_running():
            raise ConfigError(
                f"node {transport.node_id}: torch.distributed.rpc is already initialized in this "
                "process and torch allows one RPC agent per process: call "
                "rpc.shutdown() first, or run the mq node in its own process")
        _ACTIVE = transport


def release_agent(transport: Any) -> None:
    """``transport`` no longer owns the agent (its shutdown finished or never started)."""
    global _ACTIVE
    with _AGENT_LOCK:
        if _ACTIVE is transport:
            _ACTIVE = None


def _rpc_agent_running() -> bool:
    """Whether torch RPC was initialized in this process by someone other than mq."""
    try:
        from torch.distributed.rpc.api import _is_current_rpc_agent_set
        return bool(_is_current_rpc_agent_set())
    except Exception:  # private API moved: rely on our own bookkeeping
        return False


def short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


# ---------------------------------------------------------------------- frames
@dataclass
class Outgoing:
    """One frame as RPC tensors, shared by every peer it goes to (publish converts once)."""

    text: str  # the frame's text argument (see the module docstring)
    buffers: list[torch.Tensor]
    nbytes: int
    borrowed: bool  # buffers alias caller memory: wait until the peer has them
    staged: dict[int, torch.Tensor] = field(default_factory=dict)  # CUDA buffer index -> host copy


def to_rpc(frame: Frame, *, staged: bool, copy_threshold: int, borrow: bool = False,
           inline_max: int = INLINE_MAX) -> Outgoing:
    """The frame as RPC arguments, converted once per frame and form (publish shares them):
    all of it as text when its buffers hold at most ``inline_max`` bytes, else its header as
    text and its buffers as RPC tensors. ``staged``: CUDA tensors go through host memory
    (torchrpc:cpu). ``borrow``: never copy the caller's buffers (it waits until the peer has
    them anyway)."""
    if sum(frame.sizes) <= inline_max:
        out = frame.layout.get("torchrpc-text")
        if out is None:
            text = inline_text(frame, inline_max)
            if text is not None:  # copied into the text: the caller may change its buffers at once
                out = frame.layout["torchrpc-text"] = Outgoing(text, [], len(text), borrowed=False)
        if out is not None:
            return out
    out = frame.layout.get("torchrpc")
    if out is not None:
        return out
    text = (U32.pack(len(frame.header)) + frame.header).decode("latin-1")
    raw = frame.buffers
    # Bytes of the caller's memory (bytes cannot change; a CUDA tensor staged is a copy).
    shared = sum(n for b, n in zip(raw, frame.sizes) if isinstance(b, np.ndarray)
                 or (isinstance(b, torch.Tensor) and (b.is_cpu or not staged)))
    copy = not borrow and shared <= copy_threshold
    buffers: list[torch.Tensor] = []
    for b in raw:
        if isinstance(b, torch.Tensor):
            if staged and not b.is_cpu:
                t = b.cpu()  # a host copy already
            else:
                t = b.clone() if copy else b
        elif isinstance(b, np.ndarray):
            # torch wants writable memory: a read-only array is copied whatever its size
            t = torch.from_numpy(b.copy() if copy or not b.flags.writeable else b)
        else:  # bytes: immutable, and torch wants writable memory
            t = torch.frombuffer(bytearray(b), dtype=torch.uint8) if len(b) else EMPTY
        buffers.append(t)
    nbytes = len(text) + sum(frame.sizes)  # each buffer as many bytes as it was
    out = frame.layout["torchrpc"] = Outgoing(text, buffers, nbytes, borrowed=not copy and shared > 0)
    return out


def buffers_for(out: Outgoing, device_map: Any) -> list[torch.Tensor]:
    """The frame's tensors for one peer: CUDA tensors without an entry for their device in the
    peer's ``device_map`` (None: torchrpc:cpu, nothing to stage) are staged through host
    memory (TensorPipe refuses them otherwise)."""
    if device_map is None:
        return out.buffers
    bufs = []
    for i, t in enumerate(out.buffers):
        if t.device.type == "cuda" and t.device.index not in device_map:
            if i not in out.staged:
                out.staged[i] = t.cpu()
            t = out.staged[i]
        bufs.append(t)
    return bufs


def frame_parts(text: Any, buffers: list[Any], max_frame_bytes: int) -> tuple[Any, list[Any]]:
    """RPC arguments -> the codec's (header, buffers). Without tensors the text is the
    whole frame (split in place, writable views); else it is the header, and flat uint8
    host tensors become buffer-protocol views (arrays, bytes), other tensors stay tensors."""
    if not isinstance(text, str):
        raise ProtocolError("frame text is not a str")
    size = len(text) + sum(t.nbytes for t in buffers)
    if size > max_frame_bytes:
        raise Oversized(f"{size} bytes exceeds max_frame_bytes={max_frame_bytes}")
    data = latin1(text)
    if not buffers:
        return split(data)
    if len(data) < 4 or U32.unpack_from(data)[0] != len(data) - 4:
        raise ProtocolError(f"frame header of {len(data)} bytes does not match its length prefix")
    views = [t.numpy() if t.is_cpu and t.dtype == torch.uint8 and t.dim() == 1 else t for t in buffers]
    return memoryview(data)[4:], views


def latin1(text: str) -> bytearray:
    """A frame's text as the bytes it carries (each char one byte)."""
    try:
        return bytearray(text, "latin-1")
    except UnicodeEncodeError:
        raise ProtocolError("frame text is not latin-1 (bytes)") from None


def inline_text(frame: Frame, limit: int = INLINE_MAX) -> str | None:
    """A small frame whole, in the codec's contiguous layout (:mod:`mq.wire.codec`), as latin-1
    text; None when its buffers hold more than ``limit`` bytes or a tensor off the host."""
    if sum(frame.sizes) > limit:
        return None
    out = bytearray(frame.size)
    U32.pack_into(out, 0, len(frame.header))
    out[4:4 + len(frame.header)] = frame.header
    pos = 4 + len(frame.header)
    for b, n in zip(frame.buffers, frame.sizes):
        pos = -(-pos // ALIGN) * ALIGN
        if isinstance(b, torch.Tensor):
            if not b.is_cpu:
                return None
            b = b.reshape(-1).view(torch.uint8).numpy() if n else b""
        out[pos:pos + n] = memoryview(b).cast("B")
        pos += n
    return out.decode("latin-1")


def settle_cuda(buffers: list[torch.Tensor]) -> None:
    """Make received CUDA tensors safe to hand to another thread.

    TensorPipe fills them on the RPC's streams (current while the op runs): wait for those
    copies, and tell the caching allocator the user's default stream will use the memory, so
    it is not recycled under a kernel still reading it.
    """
    devices = {t.device for t in buffers if t.device.type == "cuda"}
    for dev in devices:
        torch.cuda.current_stream(dev).synchronize()
    for t in buffers:
        if t.device.type == "cuda":
            t.record_stream(torch.cuda.default_stream(t.device))
