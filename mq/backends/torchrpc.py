"""torch RPC transport: ``torch.distributed.rpc`` on TensorPipe (mq types ``torchrpc:cpu`` and
``torchrpc:cuda``).

Every node is one RPC worker: rank = node id, worker name ``mq<node id>``, a static group of
``world_size`` workers found through ``init_method`` (``tcp://``, ``env://``, ``file://``).
torch allows one RPC agent per process, so one listening torchrpc queue per process.

Wire format
-----------
A frame is one RPC to the TorchScript function :func:`_deliver_script`, which calls the custom op
``mq::deliver(int sender, int seq, int ack, str frame, Tensor[] buffers) -> int``:

* ``frame``: bytes as latin-1 text (one character per byte). A small frame (buffers of at most
  ``_INLINE_MAX`` = 8 KiB, all in host memory) travels whole in it, in the codec's contiguous
  layout (:mod:`mq.codec`, the one NNG sends), and ``buffers`` is empty: no RPC tensor, each
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
  blocked, credit me when you consume", -3 heartbeat.
* ``ack``: how many frames of the *receiver's* stream to the sender the sender has consumed
  (credit piggybacked on every frame); the RPC's return value is the same count the other way.

A call is one RPC to :func:`_request_script`: ``mq::request(int sender, str frame, Tensor[]
buffers) -> (str, Tensor[])`` carries a REQ frame laid out as above, and its return value is
the reply frame (REP_OK / REP_ERR) laid out the same way; empty text means "not taken here"
(the server's request threads are busy, or the caller's join is not confirmed yet) and the
caller sends the REQ as an ordinary frame. The server runs the ``on`` handler on the TensorPipe
thread that received the request (:meth:`mq.core.MQ.on_request`); requests hold at most half
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
scripted function ``_deliver_script`` (public ``rpc.rpc_async(to, script_fn, args)``), which
travels as ``SCRIPT_CALL`` with only its qualified name and TorchScript arguments; on the
receiver the TorchScript interpreter runs it and the op's Python kernel hands the frame to this
module. Checked with traps on ``pickle.load(s)`` and torch's internal RPC unpickler
(``_InternalRPCPickler.deserialize``) while messages, tensors and calls flow both ways
(``tests/test_torchrpc.py::test_data_path_never_unpickles``): none fires on either side, while
one Python-function ``rpc_sync`` sent as a control fires them on both. The payload inside the
frame is decoded by :class:`mq.codec.Codec` only, so nothing from the network is unpickled
unless the user opted in with ``allow_pickle=True``.

What torch itself still unpickles, and why that is acceptable: ``init_rpc`` builds the static
group with a Gloo ``all_gather_object`` and one ``_all_gather`` round of Python-function RPCs
(both pickled), and the TensorPipe agent will unpickle a ``PYTHON_CALL`` request from any
process that connects to its port. That is torch RPC's own trust model: every member of one RPC
group can run code in every other. mq never sends Python-function RPCs (shutdown is
non-graceful, which skips torch's pickled shutdown round), but it cannot stop the agent from
accepting them: run torchrpc only between nodes of one job on a network you trust, or use
``nng``.

Ordering and backpressure
-------------------------
TensorPipe runs incoming requests on a thread pool, so frames of one sender can be handled out
of order. The receiver keeps, per sender, the next expected ``seq`` and the frames that came
early, and passes frames in send order to one delivery thread (which runs
:meth:`mq.core.MQ._deliver`, off TensorPipe's threads). The op never blocks: it parks the frame
and returns. Flow control is by credit: a sender may have at most ``send_window`` frames, and
``send_window_bytes`` bytes (one frame always fits), that the receiver has not yet consumed
(handed to its queue or handler). Credit comes back in every RPC's return value and in every
frame the other way; a blocked sender sends a -2 frame, and the receiver answers with a -1
credit once it has consumed half a window more, or all it had queued (batched: one control
frame per consumed frame halved small-message throughput when the receiver was the
bottleneck). A receiver whose queue is full stops consuming,
so the sender's ``send`` waits up to its timeout and raises :class:`~mq.errors.Timeout` without
having sent anything (nothing half-sent, nothing dropped). Receiver memory is bounded by
``send_window`` frames per sender plus the queue.

The caller may change its arrays and tensors as soon as ``send``/``publish`` returns (a learner
publishing weights and then stepping its optimizer in place): frames whose array/tensor bytes
are at most ``copy_threshold`` (1 MiB) are copied and sent asynchronously (pipelined); larger
frames are sent straight from the caller's memory and ``send`` waits until the peer has them
(``publish`` waits for all its peers at once). Copying a large frame would cost a fresh,
page-faulted buffer per message, which on the reference VM made 64 MiB frames 5x slower than
waiting (265 vs 1371 MB/s). The receipt wait is bounded by ``rpc_timeout``, not by ``timeout``:
once a frame is on the wire, mq does not report a Timeout for it (it might still arrive).

Failures
--------
A failed RPC (the peer died: TensorPipe reports EOF or connection refused at once) marks the
peer lost: later sends raise :class:`~mq.errors.PeerLost`, pending calls fail with it. A
heartbeat (a -3 frame every ``heartbeat`` seconds) finds dead peers that nobody is sending to,
so a ``call`` waiting on a killed peer fails within about a heartbeat. ``stop()`` says goodbye,
waits for frames still in flight, then runs ``rpc.shutdown(graceful=False)`` in a daemon thread
and abandons it at the deadline (torch's shutdown can hang when a peer died); the process can
still exit afterwards.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import queue
import struct
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterable, List, Mapping, Tuple

import numpy as np
import torch

from mq import device_map
from mq.codec import ALIGN, Frame, split
from mq.errors import ClosedError, ConfigError, MQError, PeerLost, Oversized, ProtocolError, Timeout
from mq.locality import Locality, local
from mq.rendezvous import open_entry, parse_init_method, sign_entry
from mq.routing import BACKEND_ROUTES, Route, tensorpipe_options
from mq.transport import Events, Receipt, Transport

log = logging.getLogger("mq.torchrpc")

_CREDIT, _WANT, _PING = -1, -2, -3  # unordered control frames (negative seq)
_WANT_RETRY_S = 0.5  # a blocked sender asks again this often if no credit came
# A request whose link was lost waits this much longer for an answer already on its way (a dead
# peer's RPC fails at once anyway; a silent one's would only fail at the RPC timeout).
_ANSWER_GRACE_S = 1.0
_EMPTY = torch.empty(0, dtype=torch.uint8)
_U32 = struct.Struct("<I")
# Frames whose buffers hold at most this many bytes travel whole as one text argument, no RPC
# tensor: TensorPipe spends ~0.1 ms per tensor (a channel transfer each), while TorchScript
# strings get slow as they grow (random bytes as latin-1 text; both ways of a script echo on the
# 2-core reference VM: 8 KiB 0.20 ms as text, 0.28 ms as a tensor; 20 KiB 0.35 against 0.28).
# An mq call of 4 KB / 8 KB took 0.52-0.56 ms inline against 0.62-0.66 ms with a 2 KiB bound.
_INLINE_MAX = 8 << 10


# ---------------------------------------------------------------------- the wire entry point
_THREAD = threading.local()  # per Python thread state: gone with it, so "kept" means kept


def _keep_thread_state() -> None:
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
    _keep_thread_state()
    node = _ACTIVE
    if node is None:
        raise RuntimeError("mq: no torchrpc queue is listening in this process (it stopped)")
    return node._on_rpc(sender, seq, ack, frame, buffers)


def _request_impl(sender: int, frame: str, buffers: List[torch.Tensor]) -> Tuple[str, List[torch.Tensor]]:
    """Python kernel of ``mq::request``: runs on a TensorPipe worker thread of the server."""
    _keep_thread_state()
    node = _ACTIVE
    if node is None:
        raise RuntimeError("mq: no torchrpc queue is listening in this process (it stopped)")
    return node._on_request_rpc(sender, frame, buffers)


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


def _deliver_script(sender: int, seq: int, ack: int, frame: str, buffers: List[torch.Tensor]) -> int:
    return torch.ops.mq.deliver(sender, seq, ack, frame, buffers)


def _request_script(sender: int, frame: str, buffers: List[torch.Tensor]) -> Tuple[str, List[torch.Tensor]]:
    return torch.ops.mq.request(sender, frame, buffers)


with warnings.catch_warnings():  # torch.jit.script is deprecated in 2.x but still what RPC runs
    warnings.simplefilter("ignore")
    _deliver_script = torch.jit.script(_deliver_script)  # type: ignore[assignment]
    _request_script = torch.jit.script(_request_script)  # type: ignore[assignment]

try:  # what rpc_async ends in for a ScriptFunction
    from torch.distributed.rpc.api import _invoke_rpc_torchscript
except ImportError:  # a torch without it: the public call
    _invoke_rpc_torchscript = None
_SCRIPT_NAMES = {f: torch._jit_internal._qualified_name(f) for f in (_deliver_script, _request_script)}


def _rpc_async(info: Any, script: Any, args: tuple, timeout: float) -> Any:
    """``rpc.rpc_async(info, script, args)`` without its per-call Python: builtin lookup,
    profiler hooks and name resolution cost ~20 us of the ~75 us it takes to issue an RPC
    (2-core reference VM, a 20 KB tensor). Same request (``SCRIPT_CALL``), same future."""
    if _invoke_rpc_torchscript is None:
        from torch.distributed import rpc
        return rpc.rpc_async(info, script, args=args, timeout=timeout)
    return _invoke_rpc_torchscript(info.name, _SCRIPT_NAMES[script], args, {}, float(timeout), False)

# The text of the RPC error a server raises for a request it refused (not a broken link).
_NOT_SERVED = "mq: request not served"
# torch's RPC timeout error (rpc_agent.h kRpcTimeoutErrorStr), not a broken link either.
_RPC_TIMED_OUT = "ran for more than set timeout"


# ---------------------------------------------------------------------- per-process agent
_AGENT_LOCK = threading.Lock()
_ACTIVE: "TorchRpcTransport | None" = None  # the queue owning this process's RPC agent


def _rpc_agent_running() -> bool:
    """Whether torch RPC was initialized in this process by someone other than mq."""
    try:
        from torch.distributed.rpc.api import _is_current_rpc_agent_set
        return bool(_is_current_rpc_agent_set())
    except Exception:  # private API moved: rely on our own bookkeeping
        return False


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


# ---------------------------------------------------------------------- frames
@dataclass
class _Outgoing:
    """One frame as RPC tensors, shared by every peer it goes to (publish converts once)."""

    text: str  # the frame's text argument (see the module docstring)
    buffers: list[torch.Tensor]
    nbytes: int
    borrowed: bool  # buffers alias caller memory: wait until the peer has them
    staged: dict[int, torch.Tensor] = field(default_factory=dict)  # CUDA buffer index -> host copy


class _Link:
    """Sender side of one stream (this node -> peer): sequence numbers and credit."""

    def __init__(self, peer: int):
        self.peer = peer
        self.cond = threading.Condition(threading.RLock())
        self.info: Any = None  # rpc.WorkerInfo
        self.next_seq = 0
        self.acked = 0  # frames the peer has consumed
        self.sizes: collections.deque[tuple[int, int]] = collections.deque()  # (seq, nbytes) unacked
        self.bytes = 0
        self.pending = 0  # RPCs not yet answered
        self.requests: set[Any] = set()  # locks callers of request() wait on (see _wake)
        self.want_out = False
        self.want_acked = -1
        self.want_t = 0.0
        self.ping_out = False
        self.failed: str | None = None

    def credit(self, consumed: Any) -> None:
        if not isinstance(consumed, int):
            return
        with self.cond:
            consumed = min(consumed, self.next_seq)
            if consumed <= self.acked:
                return
            self.acked = consumed
            while self.sizes and self.sizes[0][0] < consumed:
                self.bytes -= self.sizes.popleft()[1]
            self.cond.notify_all()


class _Inbound:
    """Receiver side of one stream (peer -> this node): reorder state and consumption count."""

    def __init__(self) -> None:
        self.expect = 0
        self.held: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self.queued = 0  # in-order frames waiting for the delivery thread
        self.consumed = 0
        self.reported = 0  # the consumption count the sender last heard of
        self.unreported_bytes = 0  # consumed since then
        self.waiting = False  # the sender is blocked: credit it soon

    def report(self) -> int:
        if self.consumed > self.reported:
            self.reported, self.unreported_bytes = self.consumed, 0
        return self.consumed


class TorchRpcTransport(Transport):
    """The ``torchrpc:cpu`` and ``torchrpc:cuda`` mq types' transport. See :func:`mq.create`
    for the common options (``queue_size``, ``timeout``, ``allow_pickle``, ``handler_threads``).

    Args:
        device: ``"cpu"`` (CUDA tensors are staged through host memory) or ``"cuda"`` (CUDA
            tensors go device to device through TensorPipe device maps; needs a GPU).
        world_size: number of nodes in the job; node ids are 0 .. world_size-1.
        init_method: ``tcp://host:port`` (node 0 hosts the store), ``env://`` (MASTER_ADDR,
            MASTER_PORT) or ``file:///path``.
        local_cuda_devices: logical GPU indices this node uses (``torchrpc:cuda``).
        cuda_device_map: ``"1_0_1,2_0_2"``-style map (see :mod:`mq.device_map`); default: each
            local GPU to the same index on every peer. Only with ``torchrpc:cuda``.
        rpc_timeout: seconds an RPC may take before the peer is declared lost; also torch's
            own join steps in ``init_rpc``. Default: ``max(60, timeout)``. Finding the other
            nodes at all is bounded by ``timeout``.
        num_worker_threads: TensorPipe's thread pool size.
        socket_ifname: network interface for TensorPipe's TCP transport (``TP_SOCKET_IFNAME``).
        busy_poll: let TensorPipe carry frames to same-host peers over its ``shm`` transport,
            whose reactor thread busy-polls: each process spends one CPU core on it for as long
            as the queue listens, idle or not (measured: 99-100% of a core per idle process).
            False: those frames take loopback TCP instead, and an idle process sleeps; on the
            2-core reference VM a 1.25 KB round trip then took 1.41 instead of 0.94 ms. Large
            same-host buffers use mq's shared-memory pool either way. Turn it off where cores
            are scarce (collectors stepping environments next to the learner).
        send_window: frames in flight per peer before ``send`` waits (backpressure).
        send_window_bytes: bytes in flight per peer before ``send`` waits (a single larger frame
            still goes, alone).
        copy_threshold: frames with at most this many array/tensor bytes are copied and sent
            asynchronously; larger ones go without a copy and ``send`` waits until the peer has
            them. Either way the caller may modify its buffers once ``send`` returns.
        heartbeat: seconds between liveness probes of idle peers.

    Raises:
        ConfigError: a bad option; ``torchrpc:cuda`` without a visible GPU; a device map with
            ``torchrpc:cpu``; at ``listen()``, a second listening queue in one process.
    """

    name = "torchrpc"
    keeps_tensors = True

    def __init__(self, node_id: int, *, device: str = "cpu", world_size: int | None = None,
                 init_method: str | None = None, local_cuda_devices: Iterable[int] | None = None,
                 cuda_device_map: str | Mapping[int, Mapping[int, int]] | None = None,
                 rpc_timeout: float | None = None, num_worker_threads: int = 16,
                 socket_ifname: str | None = None, send_window: int = 64,
                 send_window_bytes: int = 256 << 20, copy_threshold: int = 1 << 20,
                 heartbeat: float = 1.0, busy_poll: bool = True, timeout: float = 30.0):
        if device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu' or 'cuda' (mq types torchrpc:cpu, "
                              f"torchrpc:cuda), got {device!r}")
        self.node_id = node_id
        self.timeout = float(timeout)
        self.device = device
        # GPU tensors of torchrpc:cpu are staged through host: no CUDA IPC route.
        self.routes = BACKEND_ROUTES["torchrpc"] - ({"nvlink"} if device == "cpu" else set())
        self.addresses: dict[str, str] = {}
        self._node: Events | None = None
        self.mq_type = f"torchrpc:{device}"
        if not torch.distributed.is_available() or not torch.distributed.rpc.is_available():
            raise ConfigError("this torch build has no torch.distributed.rpc: install a torch "
                              "with distributed support, or use mq type nng")
        if init_method is None:
            raise ConfigError(f"{self.mq_type} needs init_method= (tcp://host:port, env:// or "
                              "file:///path), the same on every node")
        spec = parse_init_method(init_method)
        if world_size is None:
            world_size = spec.world_size
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ConfigError(f"{self.mq_type} needs world_size= (the number of nodes, >= 1), "
                              f"got {world_size!r}")
        if node_id >= world_size:
            raise ConfigError(f"node_id {node_id} must be in [0, world_size={world_size}): torch "
                              "RPC ranks are the node ids 0 .. world_size-1")
        self.world_size = world_size
        self.init_method = init_method
        if rpc_timeout is not None and rpc_timeout <= 0:
            raise ConfigError(f"rpc_timeout must be a positive number of seconds, got {rpc_timeout!r}")
        self.rpc_timeout = float(rpc_timeout) if rpc_timeout is not None else max(60.0, self.timeout)
        if not isinstance(num_worker_threads, int) or num_worker_threads < 1:
            raise ConfigError(f"num_worker_threads must be an int >= 1, got {num_worker_threads!r}")
        self.num_worker_threads = num_worker_threads
        # TensorPipe runs every incoming RPC (frames, credit, heartbeats, requests) on one pool
        # of num_worker_threads threads. A frame's op parks it and returns; a request's op runs
        # the user's handler and holds its thread until the handler returns. So requests may
        # hold at most half the pool: the other half stays free for frames and heartbeats, and a
        # slow handler never starves the links (a peer whose heartbeats go unread is declared
        # lost). A request past the bound is answered "not taken" and its caller sends it as an
        # ordinary frame, served by core's handler pool. One thread: no requests at all.
        self._request_limit = max(1, num_worker_threads // 2)
        self._requests_running = 0
        self._request_lock = threading.Lock()
        self.answers_requests = num_worker_threads >= 2
        if not isinstance(send_window, int) or send_window < 1:
            raise ConfigError(f"send_window must be an int >= 1, got {send_window!r}")
        if not isinstance(send_window_bytes, int) or send_window_bytes < 1:
            raise ConfigError(f"send_window_bytes must be an int >= 1, got {send_window_bytes!r}")
        if heartbeat is None or heartbeat <= 0:
            raise ConfigError(f"heartbeat must be a positive number of seconds, got {heartbeat!r}")
        self.send_window = send_window
        self.send_window_bytes = send_window_bytes
        if not isinstance(copy_threshold, int) or copy_threshold < 0:
            raise ConfigError(f"copy_threshold must be an int >= 0 (bytes), got {copy_threshold!r}")
        self.copy_threshold = copy_threshold
        self.heartbeat = float(heartbeat)
        # A job whose store is on loopback is a one-host job: TensorPipe then listens on lo only,
        # so nothing off this host can reach its agent (which accepts any connection).
        if socket_ifname is None and spec.scheme == "tcp" and _is_loopback(spec.host):
            socket_ifname = "lo" if "lo" in local().interfaces else None
        self.socket_ifname = socket_ifname
        if not isinstance(busy_poll, bool):
            raise ConfigError(f"busy_poll must be True or False, got {busy_poll!r}")
        self.busy_poll = busy_poll
        self.locality: Locality = local()
        tensorpipe_options(self.locality, {}, cuda=False, socket_ifname=socket_ifname)  # validates
        peers = [p for p in range(world_size) if p != node_id]
        self.local_cuda_devices = (device_map._check_device_list(local_cuda_devices, "local_cuda_devices")
                                   if local_cuda_devices is not None else None)
        if device == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError("mq type torchrpc:cuda needs a GPU, but none is visible to this "
                                  "process (torch.cuda.is_available() is False; check "
                                  "CUDA_VISIBLE_DEVICES and the driver); use torchrpc:cpu, which "
                                  "stages GPU tensors through host memory")
            self.device_maps = device_map.parse(cuda_device_map, node_id, self.local_cuda_devices,
                                                peers=range(world_size))
        else:
            device_map.reject_for_cpu(self.mq_type, cuda_device_map)
            self.device_maps = {}
        self.incarnation = uuid.uuid4().hex
        self.tp_options: dict[str, Any] = {}
        self._links = {p: _Link(p) for p in peers}
        self._inbound = {p: _Inbound() for p in peers}
        self._rx_lock = threading.Lock()  # per-sender order and counts (self._inbound)
        # (sender, (text, buffers)) in delivery order, None to stop: a C queue, as this hand-off
        # (TensorPipe thread -> delivery thread) is on every frame's path
        self._ready: queue.SimpleQueue[tuple[int, Any] | None] = queue.SimpleQueue()
        self._rx_stop = False
        self._rpc_ready = threading.Event()
        self._hb_stop = threading.Event()
        self._rx_thread: threading.Thread | None = None
        self._hb_thread: threading.Thread | None = None
        self._rpc_started = False
        self._closing = False
        self._closed = False
        self._store: Any = None
        self._shutdown_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, node: Events) -> list[int]:
        global _ACTIVE
        self._node = node
        with _AGENT_LOCK:
            if _ACTIVE is not None:
                other = _ACTIVE
                state = ("is still shutting down" if other._closed else "is listening")
                raise ConfigError(
                    f"node {self.node_id}: this process already has a torch RPC agent (node "
                    f"{other.node_id}'s {other.mq_type} queue {state}); torch allows one RPC agent "
                    "per process: run each torchrpc node in its own process (mq.launch / mq run), "
                    "or stop() the other queue first")
            if _rpc_agent_running():
                raise ConfigError(
                    f"node {self.node_id}: torch.distributed.rpc is already initialized in this "
                    "process and torch allows one RPC agent per process: call "
                    "rpc.shutdown() first, or run the mq node in its own process")
            _ACTIVE = self
        self._rx_thread = threading.Thread(target=self._delivery_loop, daemon=True,
                                           name=f"mq{self.node_id}-rpc-io")
        self._rx_thread.start()
        remote = self._exchange_localities()
        self._init_rpc(remote)
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                           name=f"mq{self.node_id}-rpc-heartbeat")
        self._hb_thread.start()
        self.addresses = {"torchrpc": f"mq{self.node_id}@{self.init_method}"}
        return list(self._links)

    def greet(self, target: int, frame: Frame, token: str) -> None:
        self.send(target, frame, self.timeout)

    def connect(self, peer: int, info: dict[str, Any], route: Route) -> None:
        """The RPC group is static: every link exists once ``init_rpc`` returned."""
        if peer not in self._links:
            raise ProtocolError(f"node {peer} is not in this torch RPC group of {self.world_size}")

    def _exchange_localities(self) -> dict[int, Locality]:
        """Publish our locality in the rendezvous store and read every peer's, before
        ``init_rpc``: TensorPipe's transports and channels are fixed when the agent starts."""
        import torch.distributed as dist

        wait = timedelta(seconds=self.timeout)
        try:
            # tcp:// and env:// give a multi-tenant TCPStore: init_rpc's own rendezvous on the
            # same address later shares node 0's server instead of binding the port twice.
            store = next(dist.rendezvous(self.init_method, rank=self.node_id,
                                         world_size=self.world_size, timeout=wait))[0]
        except (RuntimeError, ValueError, OSError) as exc:
            text = str(exc)
            if "address already in use" in text.lower() or "EADDRINUSE" in text:
                raise ConfigError(f"node {self.node_id}: cannot host the rendezvous store at "
                                  f"{self.init_method}: the port is in use; pick a free port") from None
            raise Timeout(f"node {self.node_id}: rendezvous at {self.init_method} failed within "
                          f"{self.timeout:g}s: {_short(exc)} (is node 0 running, with the same "
                          "init_method and world_size?)") from exc
        store.set_timeout(wait)
        self._store = store
        prefix = "mq/torchrpc/locality/"
        secret = self._node.secret if self._node is not None else None
        store.set(f"{prefix}{self.node_id}", sign_entry(
            secret, {"locality": self.locality.to_dict(), "incarnation": self.incarnation}))
        keys = [f"{prefix}{p}" for p in self._links]
        try:
            if keys:
                store.wait(keys, wait)
        except RuntimeError:
            missing = [k.rpartition("/")[2] for k in keys if not store.check([k])]
            raise Timeout(f"node {self.node_id}: nodes {', '.join(missing)} did not join within "
                          f"{self.timeout:g}s (world_size={self.world_size}, init_method="
                          f"{self.init_method}): are all nodes started?") from None
        remote = {}
        for p in self._links:
            try:
                info = open_entry(secret, store.get(f"{prefix}{p}"), f"node {p}'s locality")
                remote[p] = Locality.from_dict(info.get("locality") or {})
            except ProtocolError:
                raise
            except Exception as exc:  # msgpack only: a bad entry is a protocol error, not code
                raise ProtocolError(f"node {self.node_id}: node {p}'s rendezvous entry is "
                                    f"malformed ({_short(exc)}): does it run the same mq version?") from None
        return remote

    def _backend_options(self, remote: Mapping[int, Locality]) -> Any:
        from torch.distributed import rpc

        tp = tensorpipe_options(self.locality, remote, cuda=self.device == "cuda",
                                socket_ifname=self.socket_ifname, busy_poll=self.busy_poll)
        self.tp_options = tp
        os.environ.update(tp["env"])  # TP_SOCKET_IFNAME: read when the agent starts
        kwargs: dict[str, Any] = {}
        needed = self._must_restrict(tp["dropped"], remote)
        if needed:
            # TensorPipe would pick these by its own (boot-id based) checks and then fail.
            log.info("node %d: TensorPipe without %s", self.node_id,
                     "; ".join(f"{n} ({tp['dropped'][n]})" for n in needed))
            kwargs = {"_transports": tp["_transports"], "_channels": tp["_channels"]}
        devices = None
        if self.device == "cuda" and self.local_cuda_devices:
            devices = list(self.local_cuda_devices)
        opts = rpc.TensorPipeRpcBackendOptions(
            num_worker_threads=self.num_worker_threads, rpc_timeout=self.rpc_timeout,
            init_method=self.init_method, devices=devices, **kwargs)
        for peer, mapping in self.device_maps.items():
            opts.set_device_map(f"mq{peer}", dict(mapping))
        return opts

    def _must_restrict(self, dropped: Mapping[str, str], remote: Mapping[int, Locality]) -> list[str]:
        """Dropped transports/channels TensorPipe would still try on its own."""
        loc = self.locality
        needed = []
        if "shm" in dropped and not self.busy_poll:  # TensorPipe would take it for same-host peers
            needed.append("shm")
        if "ibv" in dropped and loc.rdma:  # a device but no ACTIVE port: TensorPipe tries it
            needed.append("ibv")
        if self.device == "cuda" and loc.gpus:
            same_host_gpu = any(r.boot_id == loc.boot_id and r.gpus for r in remote.values())
            if "cuda_ipc" in dropped and same_host_gpu:
                needed.append("cuda_ipc")
            if "cuda_gdr" in dropped and loc.active_rdma_ports():
                needed.append("cuda_gdr")
        return needed

    def _init_rpc(self, remote: Mapping[int, Locality]) -> None:
        from torch.distributed import rpc

        opts = self._backend_options(remote)
        reachable = _reachable_listen(os.environ.get("TP_SOCKET_IFNAME"))  # what the agent reads
        if reachable:
            log.warning("node %d: torch RPC listens on %s, reachable from other hosts: TensorPipe "
                        "accepts any connection there (junk bytes abort this process, a Python-function "
                        "RPC runs code in it) and anyone who reaches the rendezvous store can read and "
                        "write it; keep this job on a private network or use nng (see mq doctor, "
                        "README 'Trust')", self.node_id, reachable)
        try:
            with warnings.catch_warnings():  # torch's own deprecated use of ProcessGroupGloo
                warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
                rpc.init_rpc(f"mq{self.node_id}", backend=rpc.BackendType.TENSORPIPE,
                             rank=self.node_id, world_size=self.world_size, rpc_backend_options=opts)
        except ValueError as exc:  # torch validates device maps and devices across the group
            raise ConfigError(f"node {self.node_id}: torch RPC refused the configuration: "
                              f"{exc}".rstrip()) from None
        except RuntimeError as exc:
            if "time" in str(exc).lower():
                raise Timeout(f"node {self.node_id}: torch RPC init did not finish within "
                              f"{self.rpc_timeout:g}s: {_short(exc)}") from exc
            raise ConfigError(f"node {self.node_id}: torch RPC init failed: {_short(exc)} "
                              "(every node must use the same init_method, world_size and mq "
                              "type)") from exc
        self._rpc_started = True
        for peer, link in self._links.items():
            link.info = rpc.get_worker_info(f"mq{peer}")
        self._rpc_ready.set()

    def close(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._closing = True
        self._hb_stop.set()
        if self._rpc_started:
            # Flush: wait for frames the peers have not confirmed yet, leaving time to shut down.
            flush_until = deadline - min(1.0, timeout / 2)
            for link in self._links.values():
                with link.cond:
                    while link.pending and not link.failed and time.monotonic() < flush_until:
                        link.cond.wait(min(0.05, max(0.0, flush_until - time.monotonic())))
        self._closed = True
        self._rx_stop = True
        self._ready.put(None)
        self._rpc_ready.set()
        for link in self._links.values():
            with link.cond:
                link.cond.notify_all()
                _wake(link.requests)
        if self._rx_thread is not None and self._rx_thread is not threading.current_thread():
            self._rx_thread.join(max(0.0, min(0.5, deadline - time.monotonic())))
        if not self._rpc_started:
            self._store = None
            self._release_agent()
            return
        self._shutdown_thread = threading.Thread(target=self._shutdown_rpc, daemon=True,
                                                 name=f"mq{self.node_id}-rpc-shutdown")
        self._shutdown_thread.start()
        self._shutdown_thread.join(max(0.0, deadline - time.monotonic()))
        if self._shutdown_thread.is_alive():
            log.warning("node %d: torch RPC shutdown did not finish within %.1fs (a peer probably "
                        "died); abandoned it: this process cannot start another torch RPC agent",
                        self.node_id, timeout)

    def _shutdown_rpc(self) -> None:
        from torch.distributed import rpc

        try:
            # graceful=False: the graceful path waits for every worker (it hangs when one died)
            # and runs a round of pickled Python RPCs. Our own flush already ran.
            rpc.shutdown(graceful=False)
        except Exception as exc:
            log.debug("node %d: rpc.shutdown: %s", self.node_id, exc)
        finally:
            self._store = None
            self._release_agent()

    def _release_agent(self) -> None:
        global _ACTIVE
        with _AGENT_LOCK:
            if _ACTIVE is self:
                _ACTIVE = None

    # ------------------------------------------------------------------ sending
    def _tensors(self, frame: Frame, borrow: bool = False) -> _Outgoing:
        """The frame as RPC arguments, converted once per frame (publish shares it): all of it
        as text when it is small, else its header as text and its buffers as RPC tensors.
        ``borrow``: never copy the caller's buffers (it waits until the peer has them anyway)."""
        out = frame.layout.get("torchrpc")
        if out is not None:
            return out
        text = _inline_text(frame)
        if text is not None:  # copied into the text: the caller may change its buffers at once
            out = frame.layout["torchrpc"] = _Outgoing(text, [], len(text), borrowed=False)
            return out
        text = (_U32.pack(len(frame.header)) + frame.header).decode("latin-1")
        staged = self.device == "cpu"
        raw = frame.buffers
        # Bytes of the caller's memory (bytes cannot change; a CUDA tensor staged is a copy).
        shared = sum(n for b, n in zip(raw, frame.sizes) if isinstance(b, np.ndarray)
                     or (isinstance(b, torch.Tensor) and (b.is_cpu or not staged)))
        copy = not borrow and shared <= self.copy_threshold
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
                t = torch.frombuffer(bytearray(b), dtype=torch.uint8) if len(b) else _EMPTY
            buffers.append(t)
        nbytes = len(text) + sum(frame.sizes)  # each buffer as many bytes as it was
        out = frame.layout["torchrpc"] = _Outgoing(text, buffers, nbytes, borrowed=not copy and shared > 0)
        return out

    def _buffers_for(self, peer: int, out: _Outgoing) -> list[torch.Tensor]:
        """The frame's tensors for one peer: CUDA tensors without a device map entry for that
        peer are staged through host memory (TensorPipe refuses them otherwise)."""
        if self.device != "cuda":
            return out.buffers
        mapping = self.device_maps.get(peer, {})
        bufs = []
        for i, t in enumerate(out.buffers):
            if t.device.type == "cuda" and t.device.index not in mapping:
                if i not in out.staged:
                    out.staged[i] = t.cpu()
                t = out.staged[i]
            bufs.append(t)
        return bufs

    def send(self, peer: int, frame: Frame, timeout: float) -> Receipt | None:
        link = self._links.get(peer)
        if link is None:
            raise PeerLost(f"node {peer} is not in this torch RPC group (world_size={self.world_size})")
        encoded = self._tensors(frame)
        buffers = self._buffers_for(peer, encoded)
        deadline = time.monotonic() + timeout
        with link.cond:
            while True:
                if self._closed:
                    raise ClosedError("the queue was stopped")
                if link.failed:
                    raise PeerLost(f"node {peer} {link.failed}")
                inflight = link.next_seq - link.acked
                if inflight == 0 or (inflight < self.send_window
                                     and link.bytes + encoded.nbytes <= self.send_window_bytes):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Timeout(f"node {peer} did not take the message within {timeout:g}s: "
                                  f"{inflight} frame(s) ({link.bytes} bytes) wait to be consumed "
                                  "there (slow receiver or full queue); pass timeout= to wait longer")
                self._want_credit(link)
                link.cond.wait(min(left, 0.1))
            seq = link.next_seq
            fut = self._issue(link, seq, encoded.text, buffers)
            link.next_seq += 1
            link.sizes.append((seq, encoded.nbytes))
            link.bytes += encoded.nbytes
            link.pending += 1
        fut.add_done_callback(lambda f, link=link: self._on_reply(link, f))
        if encoded.borrowed:  # the caller waits (all peers of a publish together) before returning
            return lambda: self._wait_received(link, fut)
        return None

    def _issue(self, link: _Link, seq: int, text: str, buffers: list[torch.Tensor]) -> Any:
        """Hand one frame to TensorPipe; raises (without consuming ``seq``) if it cannot."""
        ack = self._inbound[link.peer].report()  # piggybacked credit for the other direction
        try:
            return _rpc_async(link.info, _deliver_script, (self.node_id, seq, ack, text, buffers),
                              self.rpc_timeout)
        except Exception as exc:
            if self._closed:
                raise ClosedError("the queue was stopped") from None
            if link.info is None:
                raise PeerLost(f"node {link.peer}: torch RPC is not running yet") from None
            raise PeerLost(f"node {link.peer}: torch RPC refused the frame: {_short(exc)}") from exc

    def _wait_received(self, link: _Link, fut: Any, raise_: bool = True) -> MQError | None:
        """Wait until the peer has a frame sent from the caller's memory (bounded: the RPC
        itself fails after ``rpc_timeout``, and a dead peer fails it at once)."""
        with link.cond:
            while not fut.done() and not link.failed and not self._closed:
                link.cond.wait(0.05)
        err: MQError | None = None
        if fut.done():
            try:
                fut.value()
            except Exception as exc:  # the callback marking the link failed may still be running
                err = PeerLost(f"node {link.peer} is unreachable (torch RPC: {_short(exc)})")
        elif link.failed:
            err = PeerLost(f"node {link.peer} {link.failed}")
        else:
            err = ClosedError("the queue was stopped while a frame was in flight")
        if err is not None and raise_:
            raise err
        return err

    # ------------------------------------------------------------------ requests
    def request(self, peer: int, frame: Frame, timeout: float) -> tuple[Any, list[Any]] | None:
        """One RPC of :func:`_request_script` whose return value is the reply frame (see the
        module docstring); the caller waits on it, woken at once when the link is lost."""
        link = self._links.get(peer)
        if link is None:
            raise PeerLost(f"node {peer} is not in this torch RPC group (world_size={self.world_size})")
        out = self._tensors(frame, borrow=True)  # we wait for the answer: the peer has them then
        buffers = self._buffers_for(peer, out)
        answered = threading.Lock()  # released by the answer, or by _wake (lost link, close)
        answered.acquire()
        with link.cond:
            if self._closed:
                raise ClosedError("the queue was stopped")
            if link.failed:
                raise PeerLost(f"node {peer} {link.failed}")
            link.requests.add(answered)
        deadline = time.monotonic() + timeout
        try:
            try:
                fut = _rpc_async(link.info, _request_script, (self.node_id, out.text, buffers), timeout)
            except Exception as exc:
                if self._closed:
                    raise ClosedError("the queue was stopped") from None
                raise PeerLost(f"node {peer}: torch RPC refused the request: {_short(exc)}") from exc
            fut.add_done_callback(lambda _f: _answered(answered))
            # torch fails the RPC itself after `timeout`; the extra second only guards that.
            if not answered.acquire(timeout=timeout + 1.0) and not fut.done():
                raise Timeout(f"node {peer} did not answer within {timeout:g}s")
        finally:
            with link.cond:
                link.requests.discard(answered)
        if not fut.done() and link.failed and not self._closed:
            # Woken by disconnect(). The answer may be on its way all the same: a peer that
            # stopped sent it before its goodbye, but TensorPipe completes the answer and
            # delivers the goodbye on different threads, so the goodbye can win here.
            answered.acquire(timeout=max(0.0, min(_ANSWER_GRACE_S, deadline - time.monotonic())))
        if not fut.done():  # woken by disconnect() or close()
            if link.failed:
                raise PeerLost(f"node {peer} {link.failed}")
            raise ClosedError("the queue was stopped while a request was in flight")
        try:
            text, reply = fut.value()
        except Exception as exc:
            text = str(exc)
            if _NOT_SERVED in text:
                raise ProtocolError(f"node {peer} did not serve the request: {_short(exc)}") from None
            if _RPC_TIMED_OUT in text:
                raise Timeout(f"node {peer} did not answer within {timeout:g}s") from None
            self._link_failed(link, exc)
            raise PeerLost(f"node {peer} {link.failed}") from None
        if not text:
            return None  # not taken as a request: send it as a frame
        if reply and any(t.is_cuda for t in reply):
            _settle_cuda(reply)
        return self._frame_parts(text, reply)

    def _on_request_rpc(self, sender: Any, text: str,
                        buffers: list[torch.Tensor]) -> tuple[str, list[torch.Tensor]]:
        """A request arrived (TensorPipe thread): serve it here and return the reply frame's
        arguments, or empty text for "not taken, send it as a frame"."""
        node = self._node
        if node is None or not isinstance(sender, int) or sender not in self._inbound:
            if node is not None:
                node.on_dropped(f"a request from node {sender!r}, not in this RPC group")
            raise RuntimeError(f"{_NOT_SERVED}: node {self.node_id} got a request from node "
                               f"{sender!r}, which is not a peer in this group of {self.world_size}")
        with self._request_lock:
            if self._closing or self._requests_running >= self._request_limit:
                return "", []
            self._requests_running += 1
        try:
            if buffers and any(t.is_cuda for t in buffers):
                _settle_cuda(buffers)
            if not node.trusts(("rank", sender)):
                return "", []  # not joined (yet): sent again as a frame, for the handshake parser
            try:
                head, views = self._frame_parts(text, buffers)
            except ProtocolError as exc:
                node.on_dropped(f"a request from node {sender}: {exc}", exc.cause)
                raise RuntimeError(f"{_NOT_SERVED}: {exc}") from None
            try:
                reply = node.on_request(head, views, ("rank", sender))
            except ProtocolError as exc:
                raise RuntimeError(f"{_NOT_SERVED}: {exc}") from None
            except Exception as exc:  # never let a bug look like a broken link to the caller
                log.exception("node %d: error serving a request from node %d", self.node_id, sender)
                raise RuntimeError(f"{_NOT_SERVED}: {type(exc).__name__}") from None
            if reply is None:
                return "", []
            text = _inline_text(reply)
            if text is not None:
                return text, []
            out = self._tensors(reply)  # the copy rules of send: the handler's result may change
            return out.text, self._buffers_for(sender, out)
        finally:
            with self._request_lock:
                self._requests_running -= 1

    def _on_reply(self, link: _Link, fut: Any) -> None:
        _keep_thread_state()
        try:
            consumed = fut.value()
        except Exception as exc:
            self._link_failed(link, exc)
            consumed = None
        with link.cond:
            link.pending -= 1
            link.cond.notify_all()
        link.credit(consumed)

    def disconnect(self, peer: int) -> None:
        link = self._links.get(peer)
        if link is not None:
            with link.cond:  # blocked senders wake with PeerLost (the RPC group is static)
                link.failed = link.failed or "was lost"
                link.cond.notify_all()
                _wake(link.requests)

    def _link_failed(self, link: _Link, exc: BaseException) -> None:
        with link.cond:
            if link.failed:
                return
            link.failed = f"is unreachable (torch RPC: {_short(exc)})"
            link.cond.notify_all()
            _wake(link.requests)
        if not self._closing and self._node is not None:
            self._node.on_link_lost(link.peer, link.failed)

    def _control(self, link: _Link, seq: int, on_done: Any = None) -> None:
        """Send an unordered control frame (credit, want, ping); never blocks."""
        try:
            fut = self._issue(link, seq, "", [])
        except MQError as exc:
            if on_done:
                on_done()
            log.debug("node %d: control frame %d to node %d: %s", self.node_id, seq, link.peer, exc)
            return

        def done(f: Any) -> None:
            _keep_thread_state()
            try:
                link.credit(f.value())
            except Exception as exc:
                self._link_failed(link, exc)
            if on_done:
                on_done()

        fut.add_done_callback(done)

    def _want_credit(self, link: _Link) -> None:
        # Called with link.cond held, while a sender waits for credit.
        now = time.monotonic()
        if link.want_out or (link.acked == link.want_acked and now - link.want_t < _WANT_RETRY_S):
            return
        link.want_out, link.want_acked, link.want_t = True, link.acked, now

        def done() -> None:
            with link.cond:
                link.want_out = False
                link.cond.notify_all()

        self._control(link, _WANT, done)

    def _heartbeat_loop(self) -> None:
        while not self._hb_stop.wait(self.heartbeat):
            for link in self._links.values():
                if link.ping_out or link.failed:
                    continue
                link.ping_out = True

                def done(link: _Link = link) -> None:
                    link.ping_out = False

                self._control(link, _PING, done)

    # ------------------------------------------------------------------ receiving
    def _on_rpc(self, sender: Any, seq: Any, ack: Any, text: str, buffers: list[torch.Tensor]) -> int:
        """A frame arrived (TensorPipe thread): park it in order; never blocks."""
        inbound = self._inbound.get(sender) if isinstance(sender, int) else None
        if inbound is None:
            if self._node is not None:
                self._node.on_dropped(f"a frame from node {sender!r}, not in this RPC group")
            raise RuntimeError(f"mq: node {self.node_id} got a frame from node {sender!r}, which is "
                               f"not a peer in this group of {self.world_size}")
        self._links[sender].credit(ack)
        if seq < 0:
            with self._rx_lock:
                if seq == _WANT:
                    inbound.waiting = True
                return inbound.report()
        if any(t.is_cuda for t in buffers):
            _settle_cuda(buffers)
        with self._rx_lock:
            if seq < inbound.expect or seq in inbound.held:
                if self._node is not None:  # a duplicate: never deliver twice
                    self._node.on_dropped(f"duplicate frame {seq} from node {sender}")
                return inbound.report()
            inbound.held[seq] = (text, buffers)
            while inbound.expect in inbound.held:
                self._ready.put((sender, inbound.held.pop(inbound.expect)))
                inbound.expect += 1
                inbound.queued += 1
            return inbound.report()

    def _delivery_loop(self) -> None:
        self._rpc_ready.wait()  # HELLO from a fast peer waits until our agent can answer
        while True:
            item = self._ready.get()
            if item is None or self._rx_stop:
                return
            sender, (text, buffers) = item
            self._deliver(("rank", sender), text, buffers)
            inbound = self._inbound[sender]
            with self._rx_lock:
                inbound.consumed += 1
                inbound.queued -= 1
                inbound.unreported_bytes += len(text) + sum(t.nbytes for t in buffers)
                # A blocked sender gets credit in batches (half a window of frames or bytes, or
                # all we had once we caught up), not one control frame per consumed frame.
                credit = inbound.waiting and (
                    inbound.queued == 0
                    or inbound.consumed - inbound.reported >= max(1, self.send_window // 2)
                    or inbound.unreported_bytes >= self.send_window_bytes // 2)
                if credit:
                    inbound.waiting = False
                    inbound.report()
            if credit:
                self._control(self._links[sender], _CREDIT)

    def _deliver(self, link: tuple[str, int], text: Any, buffers: list[Any]) -> None:
        """One frame of a rank to core: whole to the handshake parser until the rank proved
        itself (a handshake frame is text alone), split for ``on_frame`` after."""
        node = self._node
        assert node is not None
        try:
            if not node.trusts(link):
                if buffers or not isinstance(text, str):
                    raise ProtocolError("a frame with tensors from a rank that has not joined")
                node.on_handshake(_latin1(text), link)  # a rank's connection cannot be closed
                return
            head, views = self._frame_parts(text, buffers)
        except ProtocolError as exc:
            node.on_dropped(f"from node {link[1]}: {exc}", exc.cause)
        else:
            node.on_frame(head, views, link)

    def _frame_parts(self, text: Any, buffers: list[Any]) -> tuple[Any, list[Any]]:
        """RPC arguments -> the codec's (header, buffers). Without tensors the text is the
        whole frame (split in place, writable views); else it is the header, and flat uint8
        host tensors become buffer-protocol views (arrays, bytes), other tensors stay tensors."""
        if not isinstance(text, str):
            raise ProtocolError("frame text is not a str")
        assert self._node is not None
        size = len(text) + sum(t.nbytes for t in buffers)
        if size > self._node.max_frame_bytes:
            raise Oversized(f"{size} bytes exceeds max_frame_bytes={self._node.max_frame_bytes}")
        data = _latin1(text)
        if not buffers:
            return split(data)
        if len(data) < 4 or _U32.unpack_from(data)[0] != len(data) - 4:
            raise ProtocolError(f"frame header of {len(data)} bytes does not match its length prefix")
        views = [t.numpy() if t.is_cpu and t.dtype == torch.uint8 and t.dim() == 1 else t for t in buffers]
        return memoryview(data)[4:], views


def _latin1(text: str) -> bytearray:
    """A frame's text as the bytes it carries (each char one byte)."""
    try:
        return bytearray(text, "latin-1")
    except UnicodeEncodeError:
        raise ProtocolError("frame text is not latin-1 (bytes)") from None


def _inline_text(frame: Frame) -> str | None:
    """A small frame whole, in the codec's contiguous layout (:mod:`mq.codec`), as latin-1
    text; None when its buffers hold more than ``_INLINE_MAX`` bytes or a tensor off the host."""
    if sum(frame.sizes) > _INLINE_MAX:
        return None
    out = bytearray(frame.size)
    _U32.pack_into(out, 0, len(frame.header))
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


def _wake(waiters: set[Any]) -> None:
    for lock in waiters:
        _release(lock)


def _answered(lock: Any) -> None:
    _release(lock)  # the caller first: it waits
    _keep_thread_state()


def _release(lock: Any) -> None:
    try:
        lock.release()
    except RuntimeError:  # released already: answered and woken both
        pass


def _is_loopback(host: str) -> bool:
    import ipaddress
    import socket

    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _reachable_listen(ifname: str | None) -> str | None:
    """Where TensorPipe's agent will listen when hosts other than this one can reach it, else
    None. It binds the address of interface ``TP_SOCKET_IFNAME``, or without one the address
    this host's name resolves to."""
    import socket

    if ifname:
        return None if ifname == "lo" else f"interface {ifname}"
    host = socket.gethostname()
    return None if _is_loopback(host) else f"the address of host name {host} (TensorPipe's default)"


def _settle_cuda(buffers: list[torch.Tensor]) -> None:
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
