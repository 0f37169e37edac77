"""A node that stops and comes back under the same id in the same process, as a TorchRL
collector does when it replaces its copy of a weight-sync scheme:
`python -m tests.jobs.same_id_again ADDRESS NODE_ID`.

The first node joins ADDRESS and stops; the second (same id, new incarnation) joins at once,
answers "echo" calls, has its "ping" call to node 0 answered and prints "again"; it serves until
stdin closes."""

from __future__ import annotations

import sys

import mq


def main() -> None:
    address, node_id = sys.argv[1], int(sys.argv[2])
    first = mq.create("nng", node_id, attach_to=[address], timeout=10).listen()
    first.wait_for_peers(ids=[0], timeout=30)
    first.stop(timeout=2.0, raise_undelivered=False)
    with mq.create("nng", node_id, attach_to=[address], timeout=10) as again:
        again.on("echo", lambda x: x)
        again.wait_for_peers(ids=[0], timeout=30)
        again.call(0, "ping", None, timeout=30)  # answered: node 0 has taken this incarnation in too
        print("again", flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
