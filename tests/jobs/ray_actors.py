"""mq nodes inside a user's own Ray actors, meeting through ``ray://GROUP``:
``python -m tests.jobs.ray_actors MQ_TYPE NODES GROUP [RESOURCE RESOURCE0]`` (RAY_ADDRESS names
the cluster; with them, every node but node 0 asks for one unit of the custom resource RESOURCE,
node 0 for one of RESOURCE0).

Each actor makes its node in its constructor; node 0 then calls every other node and sends each
a 1 MiB array that comes back. Prints one JSON line: the answers, the echoes' checksums and the
routes node 0 chose, per peer, and the Ray node each actor ran on."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import ray


@ray.remote(num_cpus=0)
class Node:
    def __init__(self, mq_type: str, rank: int, world: int, group: str):
        import mq

        self.rank = rank
        self.q = mq.create(mq_type, rank, init_method=f"ray://{group}", world_size=world, timeout=60)
        self.q.on("who", lambda _: (self.rank, ray.get_runtime_context().get_node_id()))
        self.q.listen()

    def ready(self, world: int) -> list[int]:
        return self.q.wait_for_peers(world - 1, timeout=60)

    def echo(self, n: int) -> None:
        for _ in range(n):
            m = self.q.recv(timeout=60)
            self.q.send(m.sender, "back", m.payload)

    def lead(self, world: int) -> dict:
        q = self.q
        who = {p: q.call(p, "who", None, timeout=60) for p in range(1, world)}
        data = np.arange(1 << 17, dtype=np.float64)  # 1 MiB
        for p in range(1, world):
            q.send(p, "data", data)
        sums = sorted(float(np.asarray(q.recv(timeout=60).payload).sum()) for _ in range(1, world))
        return {"who": {str(p): list(v) for p, v in who.items()}, "sums": sums, "expected": float(data.sum()),
                "routes": {str(p): r.kind for p, r in q.routes().items()}}

    def stop(self) -> None:
        self.q.stop()


def main() -> None:
    mq_type, world, group = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    place = [{"resources": {name: 1}} for name in sys.argv[4:6]] or [{}, {}]  # [the others, node 0]
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False, logging_level="ERROR")
    nodes = [Node.options(**place[0 if r else 1]).remote(mq_type, r, world, group) for r in range(world)]
    ray.get([n.ready.remote(world) for n in nodes], timeout=120)
    echoes = [n.echo.remote(1) for n in nodes[1:]]
    report = ray.get(nodes[0].lead.remote(world), timeout=120)
    ray.get(echoes, timeout=60)
    ray.get([n.stop.remote() for n in nodes], timeout=60)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
