"""A node on another (namespace) host with the rdma path over UCX's tcp transport, for tests:
``python -m tests.jobs.rdma_peer NODE_ID ATTACH_ADDR LISTEN_ADDR MODE [MQ_TYPE]`` (torchrpc types:
ATTACH_ADDR is the init method).

Modes: ``echo`` answers every "data" message with a "sum" message (its byte count and a
checksum, and the route it came by), and sends back every "back" message's payload as
"back" (node 0 then pulls from us); ``serve`` also answers calls on "stats" (its counters).
``big`` sends node 0 one ``MQ_TEST_BYTES`` message on "big" and then sleeps (the test kills
it mid-pull).
"""

from __future__ import annotations

import os
import sys
import time
import zlib

import numpy as np

import mq


def main() -> None:
    if os.environ.get("MQ_TEST_DEBUG"):
        import logging

        logging.basicConfig(level=logging.DEBUG, format="%(asctime)s %(threadName)s %(message)s")
    node_id, attach, listen, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    mq_type = sys.argv[5] if len(sys.argv) > 5 else "nng"
    rdma = os.environ.get("MQ_TEST_RDMA", "tcp")
    if mq_type == "nng":
        q = mq.create("nng", node_id, "peer", attach_to=[attach], listen_to=listen, timeout=30, rdma=rdma)
    else:  # torch RPC: ATTACH_ADDR is the init method; TP/GLOO_SOCKET_IFNAME name our veth
        q = mq.create(mq_type, node_id, "peer", world_size=2, init_method=attach, timeout=60, rdma=rdma)
    with q:
        q.on("stats", lambda _x: q.stats().rdma)
        q.on("route", lambda _x: [q.routes()[0].kind, q.routes()[0].reason])
        q.subscribe("data")
        q.wait_for_peers(ids=[0], timeout=20)
        print("ready", flush=True)
        if mode == "big":  # a warm-up by rdma first: the offer and its verdict are done with
            q.send(0, "warm", np.ones(1 << 20, np.uint8), timeout=60)
            payload = np.full(int(os.environ["MQ_TEST_BYTES"]), 7, np.uint8)
            q.send(0, "big", payload, timeout=60)
            print("sent", flush=True)
            time.sleep(600)
        while True:
            msg = q.recv(timeout=600)
            data = msg.payload
            if msg.topic == "back":
                q.send(0, "back", data, timeout=60)
                continue
            view = memoryview(np.ascontiguousarray(data)).cast("B")
            q.send(0, "sum", {"n": view.nbytes, "crc": zlib.crc32(view)}, timeout=60)
            del data, view, msg


if __name__ == "__main__":
    main()
