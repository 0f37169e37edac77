"""A standalone nng node for shm tests: `python -m tests.jobs.shm_peer NODE_ID ATTACH_ADDR MODE`.

Modes: ``hoard`` keeps every array it receives until told ``drop``; ``hold`` prints ``got`` after
its first message and sleeps (the test SIGKILLs it); ``send`` sends a 64 MiB array to node 0,
prints ``sent`` and sleeps (the test SIGKILLs it); ``glance`` reads each array's first byte in a
subscriber callback and keeps nothing (``seen`` answers the bytes read).
"""

from __future__ import annotations

import gc
import sys
import time

import numpy as np

import mq


def main() -> None:
    node_id, attach, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    q = mq.create("nng", node_id, "peer", attach_to=[attach], timeout=20)
    with q:
        q.wait_for_peers(1, timeout=20)
        kept = []
        q.on("count", lambda _: len(kept))

        def drop(_):
            kept.clear()
            gc.collect()
            return "dropped"

        q.on("drop", drop)
        seen: list[int] = []
        q.on("seen", lambda _: list(seen))
        q.subscribe("data", (lambda m: seen.append(int(m.payload[0]))) if mode == "glance" else None)
        print("ready", q.routes()[0].kind, flush=True)
        if mode == "send":
            q.send(0, "data", np.full(64 << 20, 7, dtype=np.uint8))
            print("sent", flush=True)
            time.sleep(600)
        while mode == "glance":
            time.sleep(1)
        while True:
            msg = q.recv(timeout=60)
            kept.append(msg.payload)
            if mode == "hold":
                print("got", int(msg.payload[0]), flush=True)
                time.sleep(600)


if __name__ == "__main__":
    main()
