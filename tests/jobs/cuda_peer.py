"""A standalone nng node for the cuda_ipc tests (tests/test_cuda.py):
`python -m tests.jobs.cuda_peer NODE_ID ATTACH_ADDR MODE`.

It keeps every payload of topic ``data`` it receives (CUDA views of the sender's pool) until told
``drop``, and answers calls the tests use to look inside it: ``count``, ``received`` (in all), ``drop``, ``sums`` (a
float64 sum per kept tensor, and where it lives), ``echo`` (the payload back), ``use_async``
(reads the oldest kept view in a kernel queued behind a long sleep, then drops it before the
kernel ran), ``out_sum``, ``stats``, ``route``, ``mem``.

Modes: ``keep`` (the above); ``hold``: prints ``got`` after the first message and sleeps (the
test SIGKILLs it); ``send``: sends a CUDA tensor of 7s to node 0, prints ``sent`` and sleeps.
"""

from __future__ import annotations

import gc
import sys
import time
from typing import Any

import torch

import mq

MB = 1 << 20


def _sum(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return [float(x.double().sum()) if x.numel() else 0.0, str(x.device), str(x.dtype), list(x.shape)]
    if isinstance(x, dict):
        return {k: _sum(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_sum(v) for v in x]
    return x


def main() -> None:
    node_id, attach, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    pool_bytes = int(sys.argv[4]) if len(sys.argv) > 4 else 64 * MB
    q = mq.create("nng", node_id, "peer", attach_to=[attach], timeout=20, cuda_pool_bytes=pool_bytes)
    kept: list[Any] = []
    out: list[Any] = []
    received = [0]

    def keep(message: mq.Message) -> None:
        kept.append(message.payload)
        received[0] += 1
    with q:
        q.wait_for_peers(1, timeout=30)

        def drop(_: Any) -> str:
            kept.clear()
            gc.collect()
            return "dropped"

        def use_async(_: Any) -> str:
            view = kept.pop(0)
            torch.cuda._sleep(int(5e8))  # ~0.3 s of GPU time on the current stream
            out.append(view.double() * 2)  # queued behind the sleep
            del view
            gc.collect()  # the release is recorded now, behind the read, on this stream
            return "queued"

        q.on("count", lambda _: len(kept))
        q.on("received", lambda _: received[0])
        q.on("drop", drop)
        q.on("sums", lambda _: _sum(kept))
        q.on("echo", lambda payload: payload)
        q.on("use_async", use_async)
        q.on("out_sum", lambda _: float(out[-1].sum()))
        q.on("stats", lambda _: {"cuda": dict(q.stats().cuda), "dropped_malformed": q.stats().dropped_malformed})
        q.on("route", lambda _: [q.routes()[0].gpu, q.routes()[0].reason])
        q.on("mem", lambda _: list(torch.cuda.mem_get_info()) if torch.cuda.is_available() else [0, 0])
        q.subscribe("data", keep)
        print("ready", q.routes()[0].gpu, flush=True)
        if mode == "send":
            q.send(0, "data", torch.full((16 * MB,), 7, dtype=torch.uint8, device="cuda:0"))
            print("sent", flush=True)
            time.sleep(600)
        while True:
            time.sleep(0.05)
            if mode == "hold" and kept:
                print("got", int(kept[0][0]), flush=True)
                time.sleep(600)


if __name__ == "__main__":
    main()
