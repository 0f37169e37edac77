"""TorchRL's RPCCollector (launcher "mp", 2 remote collectors) with mq's weight-sync scheme:
`python -m tests.jobs.torchrl_rpc UPDATES`. After each update every remote collector's policy
equals the trainer's (read over TorchRL's own RPC) and collection goes on; prints "ok N"."""

from __future__ import annotations

import os
import socket
import sys

import torch
from tensordict.nn import TensorDictModule
from torchrl.collectors.distributed import RPCCollector
from torchrl.envs import GymEnv

from mq.integrations.torchrl import MQWeightSyncScheme

WORKERS = int(os.environ.get("WORKERS", "2"))


def make_env():
    return GymEnv("Pendulum-v1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def same_as(policy: torch.nn.Module, theirs: dict) -> bool:
    mine = policy.state_dict()
    return set(theirs) == set(mine) and all(torch.equal(theirs[k].cpu(), mine[k].cpu()) for k in mine)


def main() -> None:
    updates = int(sys.argv[1])
    net = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["action"])
    scheme = MQWeightSyncScheme(timeout=60)
    collector = RPCCollector([make_env] * WORKERS, policy=policy, launcher="mp", sync=True,
                             frames_per_batch=20 * WORKERS, total_frames=20 * WORKERS * (updates + 2),
                             tcp_port=str(free_port()), weight_sync_schemes={"policy": scheme})
    try:
        batches = iter(collector)
        next(batches)
        for n in range(1, updates + 1):
            with torch.no_grad():
                for p in policy.parameters():
                    p += torch.randn_like(p)
            collector.update_policy_weights_()
            for i, rref in enumerate(collector.collector_rrefs):
                theirs = rref.rpc_sync().state_dict()["policy_state_dict"]
                assert same_as(policy, theirs), f"update {n}: worker {i} acts with other weights"
            assert next(batches).numel() > 0
        lag = scheme.metrics()["policy_lag"]["torchrl.policy"]
        assert lag == {n: 0 for n in range(1, WORKERS + 1)}, lag
        print(f"ok {updates}", flush=True)
    finally:
        collector.shutdown()
        scheme.shutdown()
    os._exit(0)  # TorchRL's RPC agent must not hold the exit


if __name__ == "__main__":
    main()
