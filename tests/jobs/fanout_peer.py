"""A fan-out subscriber for tests: `python -m tests.jobs.fanout_peer NODE_ID LISTEN MODE ATTACH...`.

It subscribes to "w" and reports every message to node 0 on topic "got": [sender, kind, value]
(kind "array": a read-only numpy array, value [nbytes, checksum]; "writable array": the same,
writable; else the payload itself). Modes: ``ok``; ``stall``
(a one-message queue it never reads: its senders block once the first message is in);
``hoard`` (keeps every message it gets, with a 32 MiB shm pool).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import mq


def main() -> None:
    node_id, listen, mode, attach = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
    if os.environ.get("MQ_TEST_LOG"):
        import logging

        logging.basicConfig(level=os.environ["MQ_TEST_LOG"], format=f"[{node_id}] %(message)s")
    options = {"stall": {"queue_size": 1}, "hoard": {"shm_pool_bytes": 32 << 20}}.get(mode, {})
    kept = []
    q = mq.create("nng", node_id, "sub", listen_to=listen, attach_to=attach, timeout=20, **options)
    with q:
        if mode != "stall":
            def report(m: mq.Message) -> None:
                if isinstance(m.payload, np.ndarray):
                    kind = "array" if not m.payload.flags.writeable else "writable array"
                    value = [kind, [int(m.payload.nbytes), int(m.payload[::4099].sum())]]
                else:
                    value = ["other", m.payload]
                q.send(0, "got", [m.sender] + value, timeout=20)
                if mode == "hoard":
                    kept.append(m.payload)

            q.subscribe("w", report)
        else:
            q.subscribe("w")
        q.on("relay_stats", lambda _: q.stats().relay)  # what this node relayed, and how
        q.on("shm_stats", lambda _: q.stats().shm)  # and what its pool copied
        q.wait_for_peers(int(os.environ.get("MQ_TEST_PEERS", "1")), timeout=30)
        print("ready", flush=True)
        time.sleep(600)  # the test stops or SIGKILLs us


if __name__ == "__main__":
    main()
