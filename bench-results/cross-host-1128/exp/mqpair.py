"""Two mq nodes across namespace hosts, 640 MB one way with an ack, per-sample times.

    ip netns exec mqx-a unshare --pid --ipc --fork python mqpair.py send 10.211.0.1 640 10 &
    ip netns exec mqx-b unshare --pid --ipc --fork python mqpair.py recv 10.211.0.1 640 10

BP=0 turns the nodes' busy_poll off. Prints the sender's times (first = warm-up) and the THP
backing of its payload (AnonHugePages of the process)."""
import gc
import os
import sys
import time

import numpy as np

import mq

BP = os.environ.get("BP", "1") == "1"
role, addr, size, n = sys.argv[1], sys.argv[2], int(float(sys.argv[3]) * (1 << 20)), int(sys.argv[4])
if role == "send":
    with mq.create("nng", 0, "a", listen_to=f"tcp://{addr}:7799", timeout=60, busy_poll=BP) as q:
        q.subscribe("ack")
        q.wait_for_subscribers("data", 1, timeout=30)
        x = np.ones(size, np.uint8)
        thp = [line for line in open("/proc/self/smaps_rollup") if "AnonHuge" in line][0].split()[1]
        times = []
        for i in range(n):
            t0 = time.perf_counter()
            q.send(1, "data", x)
            q.recv(timeout=60)
            times.append(time.perf_counter() - t0)
            gc.collect()
        ms = sorted(t * 1e3 for t in times[1:])
        print(f"mq thp {thp} kB {sys.argv[3]}MB p50 {ms[len(ms) // 2]:.1f} min {ms[0]:.1f}:",
              " ".join(f"{t * 1e3:.0f}" for t in times), flush=True)
else:
    with mq.create("nng", 1, "b", listen_to="tcp://10.211.0.2:7798", attach_to=[f"tcp://{addr}:7799"],
                   timeout=60, busy_poll=BP) as q:
        q.subscribe("data")
        for i in range(n):
            m = q.recv(timeout=30)
            del m
            q.send(0, "ack", 1)
        time.sleep(1)
