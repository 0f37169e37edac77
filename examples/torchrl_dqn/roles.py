"""The roles of the TorchRL DQN example: ``main(ctx)`` runs the learner or a collector, chosen by
the node's labels (``mq run --main examples.torchrl_dqn.roles:main --labels learner``).

- A **collector** runs a TorchRL ``Collector`` on CartPole with an epsilon-greedy copy of the
  Q-network, sends each batch (a TensorDict) to the learner over an ``mq.Stream`` (lossless,
  credit-based: a collector runs at most ``max_bytes`` ahead of the learner), and gets weights
  through the mq weight-sync scheme over the job's own queue.
- The **learner** puts every batch into a TorchRL ``ReplayBuffer``, trains with ``DQNLoss``
  (one update per ``frames_per_update`` frames received), sends weights every ``sync_every``
  batches, and stops the job when the mean return of the last 10 episodes reaches
  ``target_return`` (or the frame or time budget ends). Its report is one JSON object.
"""

from __future__ import annotations

import json
import time
from collections import deque
from typing import Any

import torch

import mq
from mq.integrations.torchrl import MQWeightSyncScheme
from mq.node.waits import Flag

DEFAULTS: dict[str, Any] = {
    "env": "CartPole-v1", "frames_per_batch": 32, "frames_per_update": 2, "batch_size": 64, "lr": 1e-3,
    "gamma": 0.99, "tau": 0.01, "eps_frames": 4000, "warmup": 500, "sync_every": 4, "buffer": 50_000,
    "target_return": 100.0, "total_frames": 30_000, "time_limit": 240.0, "seed": 0,
}
STOP = "stop"  # learner -> collectors: the run is over


def q_network(n_obs: int, n_actions: int) -> torch.nn.Module:
    from torchrl.modules import MLP

    return MLP(in_features=n_obs, out_features=n_actions, num_cells=[64, 64], activation_class=torch.nn.ReLU)


def make_env(name: str, seed: int):
    from torchrl.envs import GymEnv, RewardSum, StepCounter, TransformedEnv

    env = TransformedEnv(GymEnv(name), RewardSum())
    env.append_transform(StepCounter())
    env.set_seed(seed)
    return env


def make_actor(env):
    from torchrl.modules import QValueActor

    spec = env.action_spec
    return QValueActor(q_network(env.observation_spec["observation"].shape[-1], spec.shape[-1]),
                       in_keys=["observation"], spec=spec)


def main(ctx: mq.Context) -> dict[str, Any] | None:
    torch.set_num_threads(1)  # a few processes share a few cores
    cfg = {**DEFAULTS, **(ctx.args.get("config") or {})}
    q = ctx.mq
    q.wait_for_peers(ctx.world_size - 1, timeout=60)
    if "learner" in ctx.labels:
        return learner(ctx, cfg)
    if "collector" in ctx.labels:
        return collector(ctx, cfg)
    raise mq.ConfigError(f"node {ctx.node_id}: give it the label learner or collector, got {sorted(ctx.labels)}")


def collector(ctx: mq.Context, cfg: dict[str, Any]) -> None:
    from tensordict.nn import TensorDictSequential
    from torchrl.collectors import Collector
    from torchrl.modules import EGreedyModule

    q = ctx.mq
    learner_id = q.peers("learner")[0]
    me = sorted(q.peers("collector") + [ctx.node_id]).index(ctx.node_id)
    torch.manual_seed(cfg["seed"] + 100 * ctx.node_id)
    env = make_env(cfg["env"], cfg["seed"] + 1000 * ctx.node_id)
    actor = make_actor(env)
    explore = EGreedyModule(env.action_spec, eps_init=1.0, eps_end=0.05, annealing_num_steps=cfg["eps_frames"])
    stopped = Flag(q.waits)
    q.subscribe(STOP, lambda _msg: stopped.set())
    weights = MQWeightSyncScheme(q=q, trainer=learner_id)
    weights.init_on_receiver(model_id="policy", model=actor, worker_idx=me)
    weights.connect(worker_idx=me)  # waits for the learner's first version
    out = mq.Stream(q, "batches", to=learner_id, max_bytes=64 << 10)
    frames = Collector(env, TensorDictSequential(actor, explore), frames_per_batch=cfg["frames_per_batch"],
                       total_frames=-1)
    try:
        for batch in frames:
            if stopped.is_set():
                break
            explore.step(batch.numel())
            try:
                out.send(batch, timeout=60)
            except mq.PeerLost:  # the learner finished and left
                break
    finally:
        frames.shutdown()
        out.close(timeout=10)
        weights.shutdown()
    return None


def learner(ctx: mq.Context, cfg: dict[str, Any]) -> dict[str, Any]:
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.objectives import DQNLoss, SoftUpdate

    q, started = ctx.mq, time.monotonic()
    torch.manual_seed(cfg["seed"])
    collectors = sorted(q.peers("collector"))
    if not collectors:
        raise mq.ConfigError("no collector in the job: start at least one node with --labels collector")
    env = make_env(cfg["env"], cfg["seed"])
    actor = make_actor(env)
    loss = DQNLoss(actor, action_space=env.action_spec, delay_value=True)
    loss.make_value_estimator(gamma=cfg["gamma"])
    target = SoftUpdate(loss, tau=cfg["tau"])
    optim = torch.optim.Adam(loss.parameters(), lr=cfg["lr"])
    buffer = ReplayBuffer(storage=LazyTensorStorage(cfg["buffer"]), batch_size=cfg["batch_size"])
    inp = mq.Stream(q, "batches")
    weights = MQWeightSyncScheme(q=q, nodes=collectors)
    weights.init_on_sender(model=actor, num_workers=len(collectors))
    weights.connect()  # every collector acts with version 0
    returns: deque[float] = deque(maxlen=10)
    frames = updates = batches = episodes = 0
    credit = 0.0
    while True:
        mean = sum(returns) / len(returns) if len(returns) == returns.maxlen else float("nan")
        out_of_budget = frames >= cfg["total_frames"] or time.monotonic() - started > cfg["time_limit"]
        if mean >= cfg["target_return"] or out_of_budget:
            break
        batch = inp.recv(timeout=60).payload
        buffer.extend(batch.reshape(-1))
        frames += batch.numel()
        batches += 1
        done = batch["next", "done"].reshape(-1)
        for r in batch["next", "episode_reward"].reshape(-1)[done].tolist():
            returns.append(r)
            episodes += 1
        if frames < cfg["warmup"]:
            continue
        credit += batch.numel() / cfg["frames_per_update"]
        while credit >= 1:
            credit -= 1
            out = loss(buffer.sample())
            optim.zero_grad()
            out["loss"].backward()
            optim.step()
            target.step()
            updates += 1
        if batches % cfg["sync_every"] == 0:
            weights.send()
    metrics = weights.metrics()
    q.publish(STOP, True)
    streamed = _drain(inp, collectors)
    mean = sum(returns) / len(returns) if returns else float("nan")
    report = {
        "ok": mean >= cfg["target_return"], "mean_return_last_10": mean, "target_return": cfg["target_return"],
        "frames": frames, "updates": updates, "episodes": episodes, "seconds": round(time.monotonic() - started, 1),
        "mq_type": ctx.mq_type, "collectors": collectors, "weights": metrics.get("weight_sync", {}),
        "policy_lag": metrics.get("policy_lag", {}), "stream": streamed, "routes": metrics.get("routes", {}),
    }
    weights.shutdown()
    if cfg.get("report"):
        with open(cfg["report"], "w") as f:
            json.dump(report, f)
    print(json.dumps(report), flush=True)
    return report


def _drain(inp: mq.Stream, collectors: list[int]) -> dict[str, Any]:
    """Read what the collectors still send until each closed its end, then check the counts."""
    deadline = time.monotonic() + 30
    while inp.open_senders(collectors) and time.monotonic() < deadline:
        try:
            inp.recv(timeout=0.5)
        except (mq.Timeout, mq.PeerLost):
            pass
    report = inp.close(expect=collectors, timeout=5, check=False)
    return {"counts": {str(k): v for k, v in report["counts"].items()}, "problems": report["problems"]}
