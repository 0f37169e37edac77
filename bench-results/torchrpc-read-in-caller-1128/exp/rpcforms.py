"""Raw torch RPC between two namespace hosts: how long a 1.25 MB (or SIZE) tensor one-way takes
per RPC form. rank 0 sends; rank 1 serves.
    ip netns exec mqx-a unshare --pid --ipc --fork python rpcforms.py 0 10.211.0.1 &
    ip netns exec mqx-b unshare --pid --ipc --fork python rpcforms.py 1 10.211.0.1
"""
import os, sys, time
from typing import List
import torch
import torch.distributed.rpc as rpc

def udf1(t):
    return time.perf_counter_ns()

def udf5(a, b, c, s, bufs):
    return time.perf_counter_ns()

@torch.jit.script
def ts5(a: int, b: int, c: int, s: str, bufs: List[torch.Tensor]) -> int:
    return a + len(bufs)

@torch.jit.script
def ts1(t: torch.Tensor) -> int:
    return 1

def main():
    rank, addr = int(sys.argv[1]), sys.argv[2]
    size = int(float(os.environ.get("SIZE", "1.25")) * 1e6)
    n = int(os.environ.get("N", "300"))
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{addr}:29511", rpc_timeout=60,
                                           _transports=["uv"], _channels=["mpt_uv", "basic"])
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        x = torch.ones(size // 4, dtype=torch.float32)
        text = "h" * 200
        forms = {
            "udf1": lambda: rpc.rpc_sync("w1", udf1, args=(x,)),
            "udf5": lambda: rpc.rpc_sync("w1", udf5, args=(1, 2, 3, text, [x])),
            "ts1": lambda: rpc.rpc_sync("w1", ts1, args=(x,)),
            "ts5": lambda: rpc.rpc_sync("w1", ts5, args=(1, 2, 3, text, [x])),
        }
        res = {k: [] for k in forms}
        for f in forms.values():
            for _ in range(20):
                f()
        for r in range(n):
            for k, f in forms.items():
                t0 = time.perf_counter_ns()
                f()
                res[k].append((time.perf_counter_ns() - t0) / 1e6)
        for k, v in res.items():
            v.sort()
            print(f"{k}: p50 {v[len(v)//2]:.3f} ms  p10 {v[len(v)//10]:.3f} p90 {v[9*len(v)//10]:.3f}", flush=True)
    rpc.shutdown()

main()
