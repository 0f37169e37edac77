"""A standalone nng node for tests: `python -m tests.jobs.nng_peer NODE_ID ATTACH_ADDR MODE`.

Every mode answers calls on "echo", "slow" and "stats" (its counters). Modes: ``hang`` serves and sleeps; ``pong`` answers each "ping" message from ``recv()`` with a
"pong" of the same payload after ``payload["delay"]`` seconds; ``stall`` never reads "work" with a 2-message queue (its
senders block); ``hoard`` reads nothing for ``MQ_TEST_HOARD_S`` seconds through a 2-message queue,
then reads everything; ``streamer`` sends node 0 one message on stream "s"; ``small`` accepts frames of at most 1 MiB; ``count`` reads nothing for a
second, then takes ``MQ_TEST_COUNT`` "work" messages through a 2-message queue (a batch holds more) and sends node 0 what arrived: their
counters in order, and how many came batched (several frames to an NNG message).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import mq


def main() -> None:
    node_id, attach, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    options = {"stall": {"queue_size": 2}, "small": {"max_frame_bytes": 1 << 20},
               "count": {"queue_size": 2}, "hoard": {"queue_size": 2}}.get(mode, {})
    if os.environ.get("MQ_TEST_TLS"):  # {"cert","key","ca"} as JSON: links over TLS
        options.update(tls=json.loads(os.environ["MQ_TEST_TLS"]), protocol="tcp")
    if os.environ.get("MQ_TEST_PROTOCOL"):  # e.g. tcp: a same-host peer over the tcp route
        options["protocol"] = os.environ["MQ_TEST_PROTOCOL"]
    if os.environ.get("MQ_TEST_QUEUE"):  # "size,bytes": where a stalled peer blocks its senders
        size, nbytes = os.environ["MQ_TEST_QUEUE"].split(",")
        options.update(queue_size=int(size), queue_bytes=int(nbytes))
    if os.environ.get("MQ_TEST_LISTEN"):  # another "host": listen where the test can dial back
        options["listen_to"] = os.environ["MQ_TEST_LISTEN"]
    if os.environ.get("MQ_TEST_LIVENESS"):  # "heartbeat,peer_timeout" (seconds)
        heartbeat, peer_timeout = os.environ["MQ_TEST_LIVENESS"].split(",")
        options.update(heartbeat=float(heartbeat), peer_timeout=float(peer_timeout))
    q = mq.create("nng", node_id, "peer", attach_to=[attach], timeout=10, **options)
    with q:
        q.on("echo", lambda x: x)
        q.on("slow", lambda x: time.sleep(60))
        q.on("stats", lambda _x: dataclasses.asdict(q.stats()))  # the counters a test checks
        q.subscribe("work")
        q.subscribe("ping")
        q.wait_for_peers(1, timeout=20)
        print("ready", flush=True)
        if mode == "count":
            count(q, int(os.environ["MQ_TEST_COUNT"]))
        if mode == "hoard":  # reads nothing for MQ_TEST_HOARD_S seconds, then every "work"
            time.sleep(float(os.environ["MQ_TEST_HOARD_S"]))
            while True:
                q.recv(timeout=600)
        if mode == "streamer":  # one message on stream "s" to node 0, then nothing
            mq.Stream(q, "s", to=0).send(1, timeout=20)
        if mode == "pong":
            while True:
                msg = q.recv(timeout=600)
                time.sleep(msg.payload["delay"])
                q.send(0, "pong", msg.payload)
        time.sleep(600)  # the test stops or SIGKILLs us


def count(q: mq.MQ, n: int) -> None:
    per_message: list[int] = []  # frames in each NNG message received
    handle, on_frame = q.transport._handle_frame, q._dispatch.on_frame

    def counted_message(msg):
        per_message.append(0)
        handle(msg)

    def counted_frame(*args):
        if per_message:
            per_message[-1] += 1
        on_frame(*args)

    q.transport._handle_frame, q._dispatch.on_frame = counted_message, counted_frame
    time.sleep(1.0)  # the sender's pipe backs up meanwhile
    got = [q.recv(timeout=20).payload["i"] for _ in range(n)]
    q.send(0, "counted", {"got": got, "batched": sum(k for k in per_message if k > 1),
                          "largest": max(per_message)})


if __name__ == "__main__":
    main()
