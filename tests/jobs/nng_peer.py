"""A standalone nng node for tests: `python -m tests.jobs.nng_peer NODE_ID ATTACH_ADDR MODE`."""

from __future__ import annotations

import sys
import time

import mq


def main() -> None:
    node_id, attach, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    q = mq.create("nng", node_id, "peer", attach_to=[attach], timeout=10)
    with q:
        q.on("echo", lambda x: x)
        q.on("slow", lambda x: time.sleep(60))
        q.subscribe("work")
        q.wait_for_peers(1, timeout=20)
        print("ready", flush=True)
        if mode == "hang":
            time.sleep(600)  # the test SIGKILLs us


if __name__ == "__main__":
    main()
