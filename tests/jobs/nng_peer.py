"""A standalone nng node for tests: `python -m tests.jobs.nng_peer NODE_ID ATTACH_ADDR MODE`.

Modes: ``hang`` serves and sleeps; ``stall`` never reads "work" with a 2-message queue (its
senders block); ``small`` accepts frames of at most 1 MiB.
"""

from __future__ import annotations

import json
import os
import sys
import time

import mq


def main() -> None:
    node_id, attach, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    options = {"stall": {"queue_size": 2}, "small": {"max_frame_bytes": 1 << 20}}.get(mode, {})
    if os.environ.get("MQ_TEST_TLS"):  # {"cert","key","ca"} as JSON: links over TLS
        options.update(tls=json.loads(os.environ["MQ_TEST_TLS"]), protocol="tcp")
    if os.environ.get("MQ_TEST_LISTEN"):  # another "host": listen where the test can dial back
        options["listen_to"] = os.environ["MQ_TEST_LISTEN"]
    q = mq.create("nng", node_id, "peer", attach_to=[attach], timeout=10, **options)
    with q:
        q.on("echo", lambda x: x)
        q.on("slow", lambda x: time.sleep(60))
        q.subscribe("work")
        q.wait_for_peers(1, timeout=20)
        print("ready", flush=True)
        time.sleep(600)  # the test stops or SIGKILLs us


if __name__ == "__main__":
    main()
