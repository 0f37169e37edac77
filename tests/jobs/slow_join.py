"""A node that answers its first HELLO late: `python -m tests.jobs.slow_join NODE_ID DELAY_S`.

It prints its tcp address, then answers the first greeting it gets only after DELAY_S seconds
(longer than mq.node.join.REGREET_S: its greeter has greeted again meanwhile), as a node on a loaded
machine may. It serves until killed."""

from __future__ import annotations

import sys
import time

import mq
from mq.node import join


def main() -> None:
    node_id, delay = int(sys.argv[1]), float(sys.argv[2])
    answer, delayed = join.Join._answer_hello, []

    def slow_answer(self, *args):
        if not delayed:
            delayed.append(True)
            time.sleep(delay)  # the loaded machine: this answer comes after the next greeting
        return answer(self, *args)

    join.Join._answer_hello = slow_answer
    q = mq.create("nng", node_id, listen_to="tcp://127.0.0.1:0", timeout=30)
    with q:
        print(q.addresses["tcp"], flush=True)
        q.wait_for_peers(1, timeout=60)
        print("joined", flush=True)
        time.sleep(600)  # the test kills us


if __name__ == "__main__":
    main()
