"""Processes of the kill-anywhere stress harness (:mod:`mq.tools.stress`): a *zygote* imports
mq (and torch) once and forks a victim (or a torchrpc survivor) per run in milliseconds, on this
host or, started through ``TwoHosts.command``, on the second one (where it is PID 1 of its own
PID namespace: a child's pid here is found by its ``NSpid``).

Every process started here dies with its parent (PDEATHSIG): a zygote with the harness, a
child with its zygote; a zygote whose socket closes kills its children and exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

from mq.tools.stress_run import proc_state, recv_obj, send_obj, torch_survivor, victim

__all__ = ["Child", "Zygote", "die_with_parent", "zygote_main"]


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """This process gets ``sig`` when its parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    if sys.platform != "linux":
        return
    parent = os.getppid()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, sig, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the prctl
        os.kill(os.getpid(), sig)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        out = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        stat = f.read()
                except OSError:
                    continue
                if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                    out.append(int(entry))
        return out


def _inner_pid(pid: int) -> int | None:
    """``pid``'s id in its own (innermost) PID namespace."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except OSError:
        return None
    return None


class Zygote:
    """A process that imported mq (and torch) once and forks victims (and torchrpc survivors)
    on request. ``prefix`` runs it elsewhere (``TwoHosts.command([])``: on the second host,
    where it is PID 1 of its own PID namespace)."""

    def __init__(self, name: str, prefix: list[str] | None = None, torch: bool = False):
        self.name = name
        self._ctrl, theirs = socket.socketpair()
        self._log = tempfile.TemporaryFile("w+")
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1")
        argv = [*(prefix or []), sys.executable, "-m", "mq.tools.stress", "--zygote", str(theirs.fileno())]
        if torch:
            argv.append("--torch")
        self.proc = subprocess.Popen(argv, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=self._log, env=env, preexec_fn=die_with_parent)
        theirs.close()
        self.in_namespace = bool(prefix)
        self._lock = threading.Lock()
        try:
            hello = recv_obj(self._ctrl, 180)
        except TimeoutError:
            hello = None
        if not (isinstance(hello, dict) and hello.get("ready")):
            self.close()
            raise RuntimeError(f"zygote {name} did not start: {hello!r}; its log:\n{self.log_tail()}")
        self.outer = self.proc.pid
        if self.in_namespace:  # ip netns exec -> unshare (the Popen pid) -> python (PID 1 there)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                kids = _children(self.proc.pid)
                if kids:
                    self.outer = kids[0]
                    break
                time.sleep(0.01)

    def fork(self, spec: dict[str, Any], timeout: float = 30.0) -> "Child":
        with self._lock:
            send_obj(self._ctrl, {"fork": spec})
            self._ctrl.settimeout(timeout)
            try:
                data, fds, _flags, _addr = socket.recv_fds(self._ctrl, 8, 1)
            finally:
                self._ctrl.settimeout(None)
            while 0 < len(data) < 8:
                data += self._ctrl.recv(8 - len(data))
        if len(data) != 8 or not fds:
            raise RuntimeError(f"zygote {self.name} did not fork: {data!r}; its log:\n{self.log_tail()}")
        inner = struct.unpack("!q", data)[0]
        return Child(self, inner, self._outer_pid(inner), socket.socket(fileno=fds[0]))

    def _outer_pid(self, inner: int) -> int:
        if not self.in_namespace:
            return inner
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            for pid in _children(self.outer):
                if _inner_pid(pid) == inner:
                    return pid
            time.sleep(0.005)
        raise RuntimeError(f"zygote {self.name}: child {inner} not found under pid {self.outer}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 3000) -> str:
        with contextlib.suppress(Exception):
            self._log.seek(0)
            return self._log.read()[-n:]
        return ""

    def close(self) -> None:
        """Kill the zygote; its children die with it (PDEATHSIG, or their PID namespace)."""
        with contextlib.suppress(Exception):
            self._ctrl.close()
        if self.proc.poll() is None:
            try:
                self.proc.wait(3)  # EOF on its socket: it kills its children and exits
            except subprocess.TimeoutExpired:
                self.proc.kill()
                with contextlib.suppress(Exception):
                    self.proc.wait(5)
        with contextlib.suppress(Exception):
            self._log.close()


class Child:
    """A process forked by a zygote: its pid here and its socket to us."""

    def __init__(self, zygote: Zygote, inner: int, pid: int, sock: socket.socket):
        self.zygote, self.inner, self.pid, self.sock = zygote, inner, pid, sock

    def recv(self, timeout: float | None) -> Any:
        return recv_obj(self.sock, timeout)

    def send(self, obj: Any) -> None:
        send_obj(self.sock, obj)

    def alive(self) -> bool:
        return proc_state(self.pid) not in (None, "Z", "X")

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def kill(self, wait: float = 5.0) -> None:
        """SIGKILL, then wait until it is gone (its socket at EOF)."""
        self.signal(signal.SIGKILL)
        deadline = time.monotonic() + wait
        with contextlib.suppress(Exception):
            while time.monotonic() < deadline:
                ready, _, _ = select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))
                if ready and not self.sock.recv(65536):
                    break
        with contextlib.suppress(Exception):
            self.sock.close()


def zygote_main(fd: int, torch: bool) -> None:
    """The zygote: import once, then fork a child per request; on EOF kill them all and exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # this run's harness cleans up on Ctrl-C
    die_with_parent()
    ctrl = socket.socket(fileno=fd)
    import numpy  # noqa: F401 - imported once, here, not in every victim

    import mq

    list(mq.MQ_TYPES)  # finds the backends (imports them) once
    with contextlib.suppress(ImportError):  # a victim may be sent tensors: import torch once, here
        import torch as _torch

        _torch.set_num_threads(1)
    if torch:
        import torch.distributed.rpc  # type: ignore[assignment]  # once, here (rebinds the flag torch: not read after)
    send_obj(ctrl, {"ready": True, "pid": os.getpid()})
    children: set[int] = set()

    def reap() -> None:  # ours, and (PID 1 of a namespace) any orphan
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                return
            if pid == 0:
                return
            children.discard(pid)

    try:
        while True:
            ready, _, _ = select.select([ctrl], [], [], 0.2)
            reap()
            if not ready:
                continue
            try:
                msg = recv_obj(ctrl, 10)
            except (TimeoutError, OSError):
                msg = None
            if msg is None:
                return
            ours, theirs = socket.socketpair()
            pid = os.fork()
            if pid == 0:  # the child
                code = 1
                try:
                    ctrl.close()
                    theirs.close()
                    die_with_parent()
                    code = _child_main(ours, msg["fork"])
                except BaseException:  # any: reported to the harness, then exit
                    with contextlib.suppress(Exception):
                        send_obj(ours, {"error": traceback.format_exc()})
                finally:
                    os._exit(code)
            children.add(pid)
            socket.send_fds(ctrl, [struct.pack("!q", pid)], [theirs.fileno()])
            ours.close()
            theirs.close()
    finally:
        for pid in list(children):
            with contextlib.suppress(Exception):
                os.kill(pid, signal.SIGKILL)
        for pid in list(children):
            with contextlib.suppress(Exception):
                os.waitpid(pid, 0)


def _child_main(sock: socket.socket, spec: dict[str, Any]) -> int:
    if spec["role"] == "victim":
        victim(sock, spec)
    elif spec["role"] == "survivor":
        torch_survivor(sock, spec)
    return 0
