"""One run of the kill-anywhere stress harness (:mod:`mq.tools.stress`): what V does, what S
does, and how S's operation is timed, hit and judged.

- :func:`victim` is V's life in its (forked) process: join S, set up what the operation needs,
  say ready over its socket, then do nothing (or hoard) until killed.
- :func:`execute` is the measured part, in S's process: the operation in a thread, the hit
  once it is blocked, the outcome or, at the hang limit, S's stacks. :func:`classify` judges it.
- :func:`torch_survivor` is S of a torchrpc run, in a forked process of its own.

Built on mq's public API only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import pickle
import random
import re
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from typing import Any, Callable

__all__ = ["KILLS", "OPS", "ROUTES", "Config", "PidHitter", "classify", "execute", "recv_obj", "send_obj",
           "torch_survivor", "victim"]

#: Operations, in round-robin order. ``selftest-recv`` is a deliberately broken operation
#: (``S.recv()``, which no peer's death ends): only run when asked for, to show the harness fails.
OPS = ["send-window", "send-pool", "send-socket", "flush", "call", "stop", "stream-send", "stream-recv"]
SELFTEST_OPS = ["selftest-recv"]
KILLS = ["sigkill", "sigstop", "cut"]
ROUTES = ["tcp", "ipc", "shm", "tcp-hosts", "torchrpc", "rdma"]

NNG_PROTOCOL = {"tcp": "tcp", "ipc": "ipc", "shm": "auto", "tcp-hosts": "tcp", "rdma": "auto"}
ROUTE_KIND = {"tcp": "tcp", "ipc": "ipc", "shm": "shm", "tcp-hosts": "tcp", "rdma": "rdma"}  # S.routes()[V].kind
ON_HOSTS = {"tcp-hosts", "rdma"}  # V on a namespace host
POOL_ROUTES = {"shm", "rdma"}
POOL_BYTES = 16 << 20

SMALL = 1 << 10
LARGE = 1 << 20
SOCKET_MSG = 256 << 10
PRE_SENDS = 40  # flush / stop: messages sent first (they fit the window)
OP_TIMEOUT = 60.0
SURVIVOR_ID = 1000  # nng: S is node 1001, 1002, ... (one per S made); victims are 1, 2, ...


def ops_for(route: str) -> list[str]:
    return [op for op in OPS if op != "send-pool" or route in POOL_ROUTES]


def kills_for(route: str) -> list[str]:
    return KILLS if route in ON_HOSTS else ["sigkill", "sigstop"]


@dataclasses.dataclass
class Config:
    peer_timeout: float = 4.0
    heartbeat: float = 1.0
    seed: int = 0
    blocked_s: float = 0.3  # S is blocked once its operation has not returned for this long
    jitter_s: float = 0.5  # then a further uniform 0..jitter_s before the hit
    slack_s: float = 1.0  # pass: ended within peer_timeout + slack_s of the hit
    hang_s: float = 10.0  # hang: still blocked peer_timeout + hang_s after the hit
    setup_s: float = 60.0  # a victim (and for torchrpc S) joins within this
    never_blocked_s: float = 30.0  # an operation that has not blocked by then is a setup error
    fresh_survivor: bool = False  # a new S for every run (nng routes)
    verbose: bool = False

    @property
    def bound_s(self) -> float:
        return self.peer_timeout + self.slack_s

    @property
    def hang_limit_s(self) -> float:
        return self.peer_timeout + self.hang_s


# ------------------------------------------------------------------------------ small helpers
def send_obj(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj)
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes | None:
    buf = b""
    while len(buf) < n:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([sock], [], [], wait)
        if not ready:
            raise TimeoutError
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def recv_obj(sock: socket.socket, timeout: float | None) -> Any:
    """The next object on ``sock``; None at EOF; TimeoutError after ``timeout`` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    head = _recv_exact(sock, 4, deadline)
    if head is None:
        return None
    data = _recv_exact(sock, struct.unpack("!I", head)[0], deadline)
    return None if data is None else pickle.loads(data)


def proc_state(pid: int) -> str | None:
    """The state letter of ``pid`` (R, S, T, Z, ...), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[0]


_BOOTSTRAP = {"_bootstrap", "_bootstrap_inner", "run"}
_MQ_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def current_frames() -> dict[int, Any]:
    """``sys._current_frames()`` with the cyclic collector held off meanwhile: on CPython 3.11 a
    collection that starts inside it can deadlock the process (it allocates while it holds the
    runtime's lock, and a finalizer the collection runs takes that lock: cpython gh-106883,
    fixed in 3.12). A 200-run stress count hung that way, in the harness, at run 49."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return sys._current_frames()
    finally:
        if enabled:
            gc.enable()


def _blocked_in(ident: int | None, depth: int = 3) -> str:
    """Where in mq thread ``ident`` waits: its innermost frames in mq (not in mq.tools, nor the
    waiting primitive itself)."""
    frame = current_frames().get(ident)  # type: ignore[arg-type]
    if frame is None:
        return "-"
    # (mq/node/waits.py is where every wait ends up: the frames that called it say which wait it is)
    ours = [f for f in traceback.extract_stack(frame)
            if f.filename.startswith(_MQ_DIR) and not f.filename.startswith(os.path.join(_MQ_DIR, "tools"))
            and f.filename != os.path.join(_MQ_DIR, "node", "waits.py")]
    if not ours:
        return "-"
    names = [f"{os.path.relpath(f.filename, _MQ_DIR)}:{f.name}" for f in ours]
    return " > ".join(names if len(names) <= depth else [names[0], "..."] + names[1 - depth:])


def _stacks(focus: int | None, sid: int) -> tuple[str, str]:
    """S's stacks: (thread ``focus``, S's operation; S's own threads, named ``mq<sid>-...``)."""
    frames = current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}

    def one(ident: int) -> str:
        stack = traceback.extract_stack(frames[ident])
        while stack and stack[0].filename.endswith("threading.py") and stack[0].name in _BOOTSTRAP:
            stack.pop(0)
        return f"--- thread {names.get(ident, ident)}:\n" + "".join(traceback.format_list(stack)).rstrip()

    op = one(focus) if focus in frames else "(the operation's thread is gone)"
    others = [one(i) for i in frames if i != focus and str(names.get(i, "")).startswith(f"mq{sid}-")]
    return op, "\n".join(others)


# ------------------------------------------------------------------------------ the victim
def victim(sock: socket.socket, spec: dict[str, Any]) -> None:
    """V: join S, set up what ``op`` needs, say ready, then do what the op says (mostly
    nothing) until killed."""
    import numpy as np

    import mq

    op, topic = spec["op"], spec["topic"]
    options: dict[str, Any] = dict(timeout=OP_TIMEOUT, peer_timeout=spec["peer_timeout"], heartbeat=spec["heartbeat"])
    if op in ("send-window", "flush", "stop", "selftest-recv"):
        options["queue_size"] = 8
    elif op == "send-socket":
        options.update(queue_size=2, queue_bytes=1 << 20)
    elif op == "send-pool" and spec["rdma"]:
        # A hoarder does not fill S's pool over rdma: V pulls each buffer into its own landing
        # pool (which grows past its bound rather than wait) and S's slot is free at once. A
        # reader stalled on a full queue pulls nothing: S's slots stay held and its pool fills.
        options.update(queue_size=8, queue_bytes=POOL_BYTES)
    if spec["mq_type"] == "nng":
        options.update(attach_to=[spec["attach"]], protocol=spec["protocol"], rdma=spec["rdma"])
        if spec.get("listen"):
            options["listen_to"] = spec["listen"]
        if spec["rdma"]:
            options["rdma_pool_bytes"] = POOL_BYTES  # bounds its landing pool (memory), as S's
    else:
        options.update(world_size=2, init_method=spec["init_method"])
    q = mq.create(spec["mq_type"], spec["vid"], "victim", **options)
    q.listen()
    stream = None
    if op == "call":
        q.on("hang", lambda _x: time.sleep(3600))
    elif op == "stream-send":
        stream = mq.Stream(q, topic)  # the receiving end; never read
    elif op != "stream-recv":
        q.subscribe(topic)
    q.wait_for_peers(ids=[spec["sid"]], timeout=spec["setup_s"])
    route = q.routes().get(spec["sid"])
    send_obj(sock, {"ready": True, "pid": os.getpid(), "route": route.kind if route else None})
    if op == "send-pool" and not spec["rdma"]:  # read everything, keep everything: S's pool fills
        hoard = []
        while True:
            with contextlib.suppress(mq.Timeout):
                hoard.append(q.recv(timeout=600))
    if op == "stream-recv":  # the sending end: one message, then nothing
        stream = mq.Stream(q, topic, to=spec["sid"])
        stream.send(np.zeros(SMALL, np.uint8), timeout=spec["setup_s"])
        send_obj(sock, {"sent": 1})
    del stream
    while recv_obj(sock, None) is not None:  # until the harness closes us (or kills us)
        pass


# ------------------------------------------------------------------------------ S's operations
class _Marks:
    """When S's current blocking call began (the monitor judges 'blocked' from it)."""

    def __init__(self) -> None:
        self.began: float | None = None
        self.calls = 0

    def begin(self) -> None:
        self.calls += 1
        self.began = time.monotonic()


def _prepare(op: str, S: Any, vid: int, topic: str, cfg: Config) -> dict[str, Any]:
    """What comes before the measured operation (not timed, not hit)."""
    import numpy as np

    import mq

    ctx: dict[str, Any] = {}
    if op in ("flush", "stop"):
        small = np.zeros(SMALL, np.uint8)
        for _ in range(PRE_SENDS):
            S.send(vid, topic, small, timeout=cfg.setup_s)
    elif op == "stream-send":
        ctx["stream"] = mq.Stream(S, topic, to=vid, max_bytes=1 << 20)
        ctx["stream"].send(np.zeros(1, np.uint8), timeout=cfg.setup_s)  # waits for V's end to open
    elif op == "stream-recv":
        ctx["stream"] = mq.Stream(S, topic)
        ctx["stream"].recv(timeout=cfg.setup_s)  # V's one message
    return ctx


def _operate(op: str, S: Any, vid: int, topic: str, ctx: dict[str, Any], marks: _Marks, cfg: Config) -> Any:
    """The measured operation: blocks on V. Returns what it returned, or raises."""
    import numpy as np

    if op in ("send-window", "send-pool", "send-socket"):
        payload = np.zeros({"send-window": SMALL, "send-pool": LARGE, "send-socket": SOCKET_MSG}[op], np.uint8)
        while True:
            marks.begin()
            S.send(vid, topic, payload, timeout=OP_TIMEOUT)
    if op == "stream-send":
        payload = np.zeros(SOCKET_MSG, np.uint8)
        while True:
            marks.begin()
            ctx["stream"].send(payload, timeout=OP_TIMEOUT)
    marks.begin()
    if op == "flush":
        return S.flush(vid, timeout=OP_TIMEOUT)
    if op == "call":
        return S.call(vid, "hang", None, timeout=OP_TIMEOUT)
    if op == "stop":
        return S.stop(timeout=OP_TIMEOUT, raise_undelivered=False)
    if op == "stream-recv":
        return ctx["stream"].recv(timeout=OP_TIMEOUT)
    if op == "selftest-recv":  # broken on purpose: nothing but a message ends it
        return S.recv(timeout=cfg.hang_limit_s + 30)
    raise ValueError(f"unknown operation {op!r}")


class PidHitter:
    """Hits V by signal (or cuts its link); ``finish`` kills it and restores the link."""

    def __init__(self, pid: int, cut: Callable[[bool], None] | None = None):
        self.pid, self.cut = pid, cut
        self.mode: str | None = None

    def victim_alive(self) -> bool:
        return proc_state(self.pid) not in (None, "Z", "X")

    def hit(self, mode: str) -> float:
        self.mode = mode
        if mode == "sigkill":
            os.kill(self.pid, signal.SIGKILL)
        elif mode == "sigstop":
            os.kill(self.pid, signal.SIGSTOP)
        elif mode == "cut":
            if self.cut is None:
                raise RuntimeError("kill mode cut needs V on another host")
            self.cut(True)
        else:
            raise ValueError(f"unknown kill mode {mode!r}")
        return time.monotonic()

    def finish(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        if self.mode == "cut" and self.cut is not None:
            self.cut(False)


def execute(S: Any, vid: int, op: str, kill: str, topic: str, hitter: PidHitter, rng: random.Random,
            cfg: Config) -> dict[str, Any]:
    """One run's measured part, in S's process: prepare, start the operation, wait until it is
    blocked, hit V, wait for the end (or the hang limit). Returns the raw outcome."""
    import mq

    res: dict[str, Any] = {"hit": None, "seconds": None, "raised": None, "returned": None, "stack": None}
    try:
        ctx = _prepare(op, S, vid, topic, cfg)
    except Exception as err:  # any: a setup error, reported (err: mypy wants exc for the outcome below)
        res["error"] = f"preparing {op}: {type(err).__name__}: {err}"
        hitter.finish()
        return res
    marks, ended = _Marks(), threading.Event()
    got: dict[str, Any] = {}

    def body() -> None:
        try:
            got["value"] = _operate(op, S, vid, topic, ctx, marks, cfg)
        except BaseException as exc:  # any: the outcome under test
            got["exc"] = exc
        finally:
            got["at"] = time.monotonic()
            ended.set()

    th = threading.Thread(target=body, daemon=True, name=f"stress-{op}")
    th.start()
    try:
        deadline = time.monotonic() + cfg.never_blocked_s
        while True:  # blocked: the current call has not returned for blocked_s
            if ended.is_set():
                break
            began = marks.began
            if began is not None and time.monotonic() - began >= cfg.blocked_s:
                break
            if time.monotonic() > deadline:
                res["error"] = f"{op} never blocked within {cfg.never_blocked_s:g}s ({marks.calls} calls returned)"
                return res
            time.sleep(0.005)
        if not ended.is_set():
            time.sleep(rng.uniform(0.0, cfg.jitter_s))
        if not hitter.victim_alive():
            res["error"] = "the victim died before the hit"
            return res
        res["calls"] = marks.calls
        res["ended_before_hit"] = ended.is_set()
        res["blocked_in"] = _blocked_in(th.ident)
        hit = res["hit"] = hitter.hit(kill)
        if not ended.wait(max(0.0, hit + cfg.hang_limit_s - time.monotonic())):
            res["stack"], res["mq_threads"] = _stacks(th.ident, S.node_id)
            res["hang"] = True
            return res
        res["seconds"] = got["at"] - hit
        if "exc" in got:
            exc = got["exc"]
            res["raised"] = f"{type(exc).__name__}: {exc}"
            res["raised_type"] = type(exc).__name__
            if not isinstance(exc, mq.PeerLost):  # a wrong outcome: where it came from
                res["raised_traceback"] = "".join(traceback.format_exception(exc)).rstrip()
        else:
            value = got.get("value")
            res["returned"] = repr(value)[:300]
            res["returned_type"] = type(value).__name__
            if isinstance(value, mq.Undelivered):
                res["undelivered"] = {str(k): v for k, v in value.counts.items()}
        return res
    finally:
        hitter.finish()


def classify(res: dict[str, Any], op: str, vid: int, cfg: Config) -> str:
    """pass, slow (ended with the right outcome but late), wrong, hang or error."""
    if res.get("error"):
        return "error"
    if res.get("hang"):
        return "hang"
    if res.get("ended_before_hit"):
        return "wrong"
    if op == "stop":
        right = res["raised"] is None and (res.get("returned_type") == "NoneType"
                                           or str(vid) in (res.get("undelivered") or {}))
    else:
        right = (res.get("raised_type") == "PeerLost"
                 and re.search(rf"\bnode {vid}\b", res["raised"] or "") is not None)
    if not right:
        return "wrong"
    return "slow" if res["seconds"] > cfg.bound_s else "pass"


def torch_survivor(sock: socket.socket, spec: dict[str, Any]) -> None:
    """S of a torchrpc run, in its own (forked) process: join, run the operation, report."""
    import mq

    cfg = Config(**spec["cfg"])
    S = mq.create("torchrpc:cpu", 0, "survivor", world_size=2, init_method=spec["init_method"], timeout=OP_TIMEOUT,
                  peer_timeout=cfg.peer_timeout, heartbeat=cfg.heartbeat)
    S.listen()
    S.wait_for_peers(ids=[1], timeout=cfg.setup_s)
    route = S.routes().get(1)
    rng = random.Random()
    rng.setstate(spec["rng"])
    res = {"route_kind": route.kind if route else None}
    res.update(execute(S, 1, spec["op"], spec["kill"], spec["topic"], PidHitter(spec["victim_pid"]), rng, cfg))
    send_obj(sock, {"result": res})
    os._exit(0)  # no stop(): torch RPC's shutdown may hang after its peer died; the harness kills us
