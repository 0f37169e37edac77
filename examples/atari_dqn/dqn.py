"""The DQN algorithm itself, with no messaging: Q-networks, the replay buffer, the epsilon
schedule and one gradient step. The roles (roles.py) move data between processes around it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


# ---------------------------------------------------------------------- ALGO LOGIC: networks
class NatureCNN(nn.Module):
    """Mnih et al. 2015: 3 conv layers + 512 hidden units, on 4x84x84 uint8 frames."""

    def __init__(self, n_actions: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(4, 32, 8, stride=4), nn.ReLU(),
            nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(),
            nn.Flatten(),
            nn.Linear(3136, 512), nn.ReLU(),
            nn.Linear(512, n_actions),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.float() / 255.0)


class MLP(nn.Module):
    """CleanRL's classic-control Q-network."""

    def __init__(self, obs_dim: int, n_actions: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
                                 nn.Linear(84, n_actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.float())


def make_qnet(spec: Any) -> nn.Module:
    if spec.family == "atari":
        return NatureCNN(spec.n_actions)
    return MLP(int(np.prod(spec.obs_shape)), spec.n_actions)


def linear_schedule(start_e: float, end_e: float, duration: float, t: float) -> float:
    slope = (end_e - start_e) / max(duration, 1.0)
    return max(slope * t + start_e, end_e)


def act(q: nn.Module, obs: np.ndarray, epsilon: float, n_actions: int, rng: np.random.Generator,
        device: torch.device) -> np.ndarray:
    """Epsilon-greedy actions for a batch of observations (one per env)."""
    with torch.no_grad():
        greedy = q(torch.as_tensor(obs, device=device)).argmax(dim=1).cpu().numpy()
    explore = rng.random(len(obs)) < epsilon
    return np.where(explore, rng.integers(n_actions, size=len(obs)), greedy).astype(np.int64)


# ---------------------------------------------------------------------- ALGO LOGIC: replay buffer
class ReplayBuffer:
    """A ring buffer of transitions in numpy arrays.

    For stacked frames (obs of shape (4, 84, 84)), the next observation shares 3 of its 4 frames
    with the observation, so only its newest frame is stored: 5/8 of the memory of storing both.
    """

    def __init__(self, capacity: int, obs_shape: tuple[int, ...], obs_dtype: str, seed: int = 0):
        self.capacity, self.size, self.pos = capacity, 0, 0
        self.frame_stacked = len(obs_shape) == 3
        self.obs = np.zeros((capacity, *obs_shape), dtype=obs_dtype)
        next_shape = (1, *obs_shape[1:]) if self.frame_stacked else obs_shape
        self.next_obs = np.zeros((capacity, *next_shape), dtype=obs_dtype)
        self.actions = np.zeros(capacity, dtype=np.int64)
        self.rewards = np.zeros(capacity, dtype=np.float32)
        self.dones = np.zeros(capacity, dtype=np.float32)
        self.rng = np.random.default_rng(seed)

    def add(self, obs: np.ndarray, actions: np.ndarray, rewards: np.ndarray, next_obs: np.ndarray,
            dones: np.ndarray) -> None:
        if self.frame_stacked:
            next_obs = next_obs[:, -1:]
        n = len(obs)
        for start in range(0, n, self.capacity):  # a batch larger than the buffer keeps its tail
            chunk = slice(start, min(n, start + self.capacity))
            m = chunk.stop - chunk.start
            idx = (self.pos + np.arange(m)) % self.capacity
            self.obs[idx], self.next_obs[idx] = obs[chunk], next_obs[chunk]
            self.actions[idx], self.rewards[idx], self.dones[idx] = actions[chunk], rewards[chunk], dones[chunk]
            self.pos = (self.pos + m) % self.capacity
            self.size = min(self.size + m, self.capacity)

    def sample(self, batch_size: int, device: torch.device) -> dict[str, torch.Tensor]:
        idx = self.rng.integers(self.size, size=batch_size)
        obs = self.obs[idx]
        nxt = np.concatenate([obs[:, 1:], self.next_obs[idx]], axis=1) if self.frame_stacked else self.next_obs[idx]
        out = dict(obs=obs, next_obs=nxt, actions=self.actions[idx], rewards=self.rewards[idx], dones=self.dones[idx])
        return {k: torch.as_tensor(v).to(device, non_blocking=True) for k, v in out.items()}


# ---------------------------------------------------------------------- ALGO LOGIC: one update
def td_update(q: nn.Module, target: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor],
              gamma: float, max_grad_norm: float) -> float:
    """One DQN gradient step (Huber loss on the one-step TD target); returns the loss."""
    with torch.no_grad():
        target_max = target(batch["next_obs"]).max(dim=1).values
        td_target = batch["rewards"] + gamma * target_max * (1.0 - batch["dones"])
    q_taken = q(batch["obs"]).gather(1, batch["actions"].unsqueeze(1)).squeeze(1)
    loss = F.smooth_l1_loss(q_taken, td_target)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if max_grad_norm and math.isfinite(max_grad_norm):
        nn.utils.clip_grad_norm_(q.parameters(), max_grad_norm)
    optimizer.step()
    return float(loss.detach())
