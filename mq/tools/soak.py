"""A soak run: one sender streams many small messages to a deliberately slow receiver.

    python -m mq.tools.soak --messages 1000000 --slow-every 5000 --slow-ms 50

The receiver checks that every message arrives exactly once and in order, and samples its own
resident memory; the sender feels the backpressure (its ``send`` waits). Prints one JSON line:
messages, seconds, messages/s, lossless, ordered, the receiver's peak RSS and the bound its
queues allow. It is a script, not a test: it takes minutes and its numbers are measurements.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np

import mq

QUEUE_SIZE = 1024


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _receiver(address_q: Any, result_q: Any, n: int, slow_every: int, slow_ms: float, mq_type: str) -> None:
    q = mq.create(mq_type, 0, listen_to="tcp://127.0.0.1:0", queue_size=QUEUE_SIZE, timeout=60)
    with q:
        q.subscribe("soak")
        address_q.put(q.addresses["tcp"])
        expect, ordered, peak, base = 0, True, 0.0, _rss_mb()
        t0 = None
        while expect < n:
            msg = q.recv(timeout=60)
            t0 = t0 or time.monotonic()
            i = msg.payload["i"]
            ordered &= i == expect
            expect = i + 1
            if slow_every and i % slow_every == 0:
                time.sleep(slow_ms / 1000)  # the slow consumer: senders must wait, not pile up
            if i % 10_000 == 0:
                peak = max(peak, _rss_mb())
        seconds = time.monotonic() - (t0 or time.monotonic())
        result_q.put({"received": expect, "ordered": ordered, "seconds": seconds,
                      "rss_start_mb": round(base, 1), "rss_peak_mb": round(max(peak, _rss_mb()), 1),
                      "stats": {"dropped_malformed": q.stats().dropped_malformed}})
        deadline = time.monotonic() + 120  # stay until the sender's flush() got its receipt
        while 1 in q.peers() and time.monotonic() < deadline:
            time.sleep(0.05)


def _sender(address: str, n: int, mq_type: str) -> None:
    q = mq.create(mq_type, 1, attach_to=[address], timeout=60)
    with q:
        q.wait_for_subscribers("soak", 1, timeout=30)
        x = np.arange(64, dtype=np.float32)
        for i in range(n):
            q.send(0, "soak", {"i": i, "x": x})
        q.flush(0, timeout=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--slow-every", type=int, default=5000, help="the receiver sleeps every N messages")
    ap.add_argument("--slow-ms", type=float, default=50.0)
    ap.add_argument("--mq-type", default="nng")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    address_q, result_q = ctx.Queue(), ctx.Queue()
    rx = ctx.Process(target=_receiver, args=(address_q, result_q, args.messages, args.slow_every,
                                             args.slow_ms, args.mq_type))
    rx.start()
    tx = ctx.Process(target=_sender, args=(address_q.get(timeout=60), args.messages, args.mq_type))
    t0 = time.monotonic()
    tx.start()
    try:
        res = result_q.get(timeout=3600)
    finally:
        for p in (tx, rx):
            p.join(30)
            if p.is_alive():
                p.kill()
    sample = {"i": 0, "x": np.zeros(64, np.float32)}
    msg_bytes = len(mq.wire.codec.Codec().encode(0, "soak", 1, 0, 0, sample).to_bytes())
    print(json.dumps({
        "messages": args.messages, "wall_s": round(time.monotonic() - t0, 1),
        "msgs_per_s": round(res["received"] / max(res["seconds"], 1e-9)),
        "lossless": res["received"] == args.messages, **res,
        "frame_bytes": msg_bytes,
        "queue_bound_mb": round(QUEUE_SIZE * msg_bytes / 2**20, 2),
        "sender_exit": tx.exitcode,
    }))


if __name__ == "__main__":
    main()
