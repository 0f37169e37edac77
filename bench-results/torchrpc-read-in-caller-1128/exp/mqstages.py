"""Where mq's torchrpc one-way time goes across namespace hosts: per sample, A's send start (t0),
B's on_rpc entry, B's recv return, A's send return, A's ack recv return (one monotonic clock).
    ip netns exec mqx-a unshare --pid --ipc --fork python mqstages.py 0 10.211.0.1 mqx-va &
    ip netns exec mqx-b unshare --pid --ipc --fork python mqstages.py 1 10.211.0.1 mqx-vb
"""
import os, sys, time
import numpy as np
import mq
from mq.backends.torchrpc import receiver

rank, addr, ifname = int(sys.argv[1]), sys.argv[2], sys.argv[3]
size = int(float(os.environ.get("SIZE", "1.25")) * 1e6)
n = int(os.environ.get("N", "300"))
onrpc = []
orig = receiver.Receiver.on_rpc
def on_rpc(self, sender, seq, ack, text, buffers):
    if buffers:
        onrpc.append(time.perf_counter_ns())
    return orig(self, sender, seq, ack, text, buffers)
receiver.Receiver.on_rpc = on_rpc
with mq.create("torchrpc:cpu", rank, world_size=2, init_method=f"tcp://{addr}:29522",
               socket_ifname=ifname, timeout=60) as q:
    q.wait_for_peers(1, timeout=60)
    if rank == 0:
        x = np.ones(size, np.uint8)
        rows = []
        for i in range(n + 20):
            t0 = time.perf_counter_ns()
            q.send(1, "d", x)
            t1 = time.perf_counter_ns()
            m = q.recv(timeout=30)
            t2 = time.perf_counter_ns()
            b_onrpc, b_recv = m.payload
            rows.append((b_onrpc - t0, b_recv - b_onrpc, t1 - t0, t2 - b_recv, t2 - t0))
        rows = np.array(rows[20:]) / 1e6
        names = ["t0->B on_rpc", "B on_rpc->recv returns", "A send() (receipt)", "B recv->A ack", "total"]
        for k, name in enumerate(names):
            c = np.sort(rows[:, k])
            print(f"{name:24s} p50 {np.median(c):.3f} ms  p10 {c[len(c)//10]:.3f}  p90 {c[9*len(c)//10]:.3f}")
    else:
        for i in range(n + 20):
            m = q.recv(timeout=30)
            t = time.perf_counter_ns()
            q.send(0, "a", [onrpc[-1], t])
        time.sleep(1)
