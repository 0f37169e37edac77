"""Fan-out across namespace hosts with capped uplinks: publish p50 per relay shape, and what
each relay streamed. argv: CODE_ROOT RATE PER_HOST HOSTS SHAPE... (run with cwd CODE_ROOT)."""
import os, sys, time, statistics
root, rate, per_host, nhosts, shapes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
sys.path.insert(0, root)
import numpy as np
import mq
from mq.tools.netns import Hosts
from tests.test_fanout import Cluster

assert mq.__file__.startswith(root), mq.__file__
with Hosts(nhosts, root=True, rate=None if rate == "none" else rate) as hosts:
    c = Cluster(hosts, per_host=per_host)
    try:
        q = c.q
        x = np.random.default_rng(0).integers(0, 256, 25 << 20, dtype=np.uint8)
        for shape in shapes:
            q.set_relay(1 << 20, shape)
            q.publish("w", x, timeout=60)  # warm-up
            ts = []
            for _ in range(8):
                t0 = time.perf_counter(); q.publish("w", x, timeout=60); ts.append((time.perf_counter() - t0) * 1e3)
            print(f"{root} rate={rate} {nhosts} hosts x {per_host}, {shape}: publish p50 {statistics.median(ts):.1f} ms "
                  f"(min {min(ts):.1f}, max {max(ts):.1f})", flush=True)
        streamed = sum(q.call(i, "relay_stats", timeout=10)["streamed"] for i in sorted(c.got))
        print(f"  hops streamed by relays, all shapes: {streamed}")
    finally:
        c.close()
