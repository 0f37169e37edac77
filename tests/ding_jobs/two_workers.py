"""A 2-worker DI-engine job for ``ditask --mq-type mq:nng`` (tests/test_ding.py): each worker
greets the other until it hears back, then prints what it heard and over which queue."""

import time

import mq.integrations.ding  # noqa: F401  (the one line a DI-engine user adds)
from ding.framework import Parallel


def main():
    router = Parallel()
    heard = []
    router.on("hello", lambda sender, blob: heard.append((sender, len(blob))))
    blob = bytes(range(256)) * 4096  # 1 MiB: DI-engine pickles it, mq carries the bytes
    deadline = time.monotonic() + 30
    while not heard and time.monotonic() < deadline:
        router.emit("hello", router.node_id, blob)
        time.sleep(0.1)
    assert heard, f"node {router.node_id} heard nothing"
    for _ in range(10):  # the other worker may have subscribed after our first greetings
        router.emit("hello", router.node_id, blob)
        time.sleep(0.1)
    q = router._mq
    print(f"DITASK node {router.node_id} heard node {heard[0][0]} ({heard[0][1]} bytes) over "
          f"{type(q).__name__} routes={ {p: r.kind for p, r in q.q.routes().items()} }", flush=True)
