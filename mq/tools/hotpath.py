"""Instructions per small message on mq's hot path, counted by callgrind (stable on noisy
machines, where wall time is not).

What one "message" is here: node 1 ``send``s a typical control message to node 0 and node 0
``recv``s it, in one process and one thread, through a capture transport that hands each frame
straight to the receiver (no sockets, no threads). So the count is mq's own per-message work:
encode, envelope, data-path choice, checks, metrics, decode, delivery and the queue; a real
transport adds its syscalls on top.

    python -m mq.tools.hotpath --messages 2000            # run it (prints per-message wall time)
    scripts/hotpath                                        # callgrind it at two sizes; writes
                                                           # bench-results/hotpath.json

Counting twice (N1 and N2 messages) and dividing the difference by N2 - N1 removes start-up
(imports, handshake) from the figure.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

import mq
from mq.wire.codec import Frame, split
from mq.routing import Route
from mq.transport import Events, Transport

PAYLOADS = {
    "scalar": lambda: 7,
    "dict": lambda: {"step": 12, "reward": 0.5, "done": False, "info": "ok"},
    "array": lambda: np.zeros(320, np.float32),  # 1.25 KB
    "tensor": lambda: _torch().zeros(1280, dtype=_torch().uint8),  # 1.25 KB, what `mq bench` sends
}


def _torch() -> Any:
    import torch

    return torch


class CaptureTransport(Transport):
    """Frames go straight into the other node's on_frame, in the caller's thread."""

    name = "capture"
    routes = frozenset({"tcp"})

    def __init__(self, node_id: int, *, timeout: float = 30.0):
        self.node_id = node_id
        self.addresses = {"capture": f"capture://{node_id}"}
        self.other: CaptureTransport | None = None
        self.node: Events | None = None

    def start(self, node: Events) -> list[Any]:
        self.node = node
        return [self.other] if self.node_id == 1 else []

    def greet(self, target: Any, frame: Frame, token: str) -> None:
        self.send(-1, frame, 1.0)

    def connect(self, peer: int, info: dict[str, Any], route: Route) -> None:
        pass

    def disconnect(self, peer: int) -> None:
        pass

    def send(self, peer: int, frame: Frame, timeout: float) -> None:
        assert self.other is not None and self.other.node is not None
        head, buffers = split(frame.to_bytes())
        self.other.node.on_frame(head, buffers, ("capture", self.node_id))

    def close(self, timeout: float) -> None:
        pass


def pair() -> tuple[mq.MQ, mq.MQ]:
    t0, t1 = CaptureTransport(0), CaptureTransport(1)
    t0.other, t1.other = t1, t0
    # shm off: same-process peers never use it, and the pool's probe would add noise
    a = mq.MQ(0, transport=t0, shm=False, secret="hot-path-secret", heartbeat=3000, peer_timeout=3000)
    b = mq.MQ(1, transport=t1, shm=False, secret="hot-path-secret", heartbeat=3000, peer_timeout=3000)
    a.listen()
    b.listen()
    b.wait_for_peers(1, timeout=5)
    a.wait_for_peers(1, timeout=5)
    return a, b


def run(messages: int, payload: str) -> float:
    a, b = pair()
    make = PAYLOADS[payload]
    value = make()
    # The cyclic collector runs when allocations cross its thresholds: whether a full
    # collection (millions of instructions with torch loaded) falls inside a run or not would
    # swing the count by ~10%, so it waits until the loop is done.
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in range(messages):
            b.send(0, "ctl", value)
            a.recv(timeout=1)
        return (time.perf_counter() - t0) / messages
    finally:
        gc.enable()
        b.stop(1)
        a.stop(1)


def callgrind(messages: int, payload: str) -> int:
    """Instructions of the main thread in a whole run of ``messages`` under callgrind.

    Only the main thread, which runs every message: mq's background threads wake on timeouts,
    so their work follows wall time, which valgrind stretches by a varying amount. Counted
    with them, one commit gave 98k, 111k and 137k instructions per message in three runs;
    the main thread alone gives the same count to within 0.3%."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cg.out")
        subprocess.run(["valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={out}",
                        sys.executable, "-m", "mq.tools.hotpath", "--messages", str(messages),
                        "--payload", payload], check=True, capture_output=True, timeout=1800,
                       env={**os.environ, "PYTHONHASHSEED": "0"})  # same dict layouts every run
        with open(out + "-01") as f:  # thread 1: the main thread
            for line in f:
                if line.startswith("summary:") or line.startswith("totals:"):
                    return int(line.split()[1])
    raise RuntimeError("callgrind wrote no totals")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=2000)
    ap.add_argument("--payload", choices=sorted(PAYLOADS), default=None,
                    help="one payload (default: dict; with --callgrind: every payload)")
    ap.add_argument("--callgrind", action="store_true",
                    help="count instructions per message (two runs under valgrind) and print JSON")
    ap.add_argument("--small", type=int, default=200, help="with --callgrind: the smaller run")
    args = ap.parse_args()
    if not args.callgrind:
        print(f"{run(args.messages, args.payload or 'dict') * 1e6:.1f} us per message (send + recv, one process)")
        return
    results = {}
    for payload in [args.payload] if args.payload else sorted(PAYLOADS):
        lo, hi = callgrind(args.small, payload), callgrind(args.messages, payload)
        results[payload] = round((hi - lo) / (args.messages - args.small))
    print(json.dumps({"instructions_per_message": results, "messages": [args.small, args.messages],
                      "python": sys.version.split()[0], "commit": _commit()}))


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        return "?"


if __name__ == "__main__":
    main()
