"""Environments: Atari through ale-py's vector env, classic control through gymnasium.

Both come back as a :class:`VecEnv` with one contract, so the collector has one code path:
``step(actions)`` returns the observation to act on next *and* the true next observation of
each transition (the final observation when an episode just ended), plus the returns and
lengths of the episodes that ended. Returns are the raw game scores (no clipping here).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

ATARI_EXTRA = "pip install mq[atari]"


class SetupError(Exception):
    """A bad setup, explained in one line (the launcher prints it and exits non-zero)."""


@dataclass(frozen=True)
class EnvSpec:
    env_id: str
    family: str  # "atari" | "classic"
    obs_shape: tuple[int, ...]
    obs_dtype: str
    n_actions: int


def _missing_extra(what: str, exc: BaseException) -> SetupError:
    return SetupError(f"the Atari extra is not installed ({what}: {exc}): {ATARI_EXTRA}")


def _gym() -> Any:
    try:
        import gymnasium
    except ImportError as exc:
        raise _missing_extra("gymnasium", exc) from None
    return gymnasium


def _ale() -> Any:
    try:
        import ale_py
    except ImportError as exc:
        raise _missing_extra("ale-py", exc) from None
    return ale_py


def is_atari(env_id: str) -> bool:
    return env_id.startswith("ALE/") or "NoFrameskip" in env_id


def atari_game(env_id: str) -> str:
    """``ALE/Pong-v5`` / ``PongNoFrameskip-v4`` -> ale-py's ROM id ``pong``; SetupError if unknown."""
    name = env_id.removeprefix("ALE/")
    name = re.sub(r"(NoFrameskip)?-v\d+$", "", name)
    game = re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
    ale_py = _ale()
    known = set(ale_py.roms.get_all_rom_ids())
    if game not in known:
        raise SetupError(f"unknown env id {env_id!r}: ale-py has no Atari game {game!r} "
                         f"(e.g. ALE/Pong-v5, ALE/Breakout-v5)")
    return game


# ---------------------------------------------------------------------- the common interface
class VecEnv:
    """``num_envs`` environments stepped together, with same-step autoreset."""

    def __init__(self, env: Any, spec: EnvSpec, num_envs: int):
        self.env, self.spec, self.num_envs = env, spec, num_envs
        self.returns = np.zeros(num_envs, dtype=np.float64)
        self.lengths = np.zeros(num_envs, dtype=np.int64)

    def reset(self, seed: int) -> np.ndarray:
        obs, _ = self.env.reset(seed=seed)
        return np.asarray(obs, dtype=self.spec.obs_dtype)

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                 list[tuple[float, int]]]:
        """-> (obs to act on next, true next obs, rewards, terminated, [(return, length) of ended episodes])"""
        obs, rewards, terminated, truncated, info = self.env.step(actions)
        obs = np.asarray(obs, dtype=self.spec.obs_dtype)
        rewards = np.asarray(rewards, dtype=np.float32)
        terminated, done = np.asarray(terminated, bool), np.asarray(terminated, bool) | np.asarray(truncated, bool)
        self.returns += rewards
        self.lengths += 1
        next_obs, ended = obs, []
        if done.any():
            next_obs = obs.copy()
            final = info["final_obs"]
            for i in np.flatnonzero(done):
                next_obs[i] = np.asarray(final[i], dtype=self.spec.obs_dtype)
                ended.append((float(self.returns[i]), int(self.lengths[i])))
                self.returns[i], self.lengths[i] = 0.0, 0
        return obs, next_obs, rewards, terminated, ended

    def close(self) -> None:
        self.env.close()


def make_env(env_id: str, num_envs: int = 1) -> VecEnv:
    """A VecEnv for ``env_id``; SetupError (one line) for an unknown id or a missing extra."""
    if is_atari(env_id):
        return _make_atari(env_id, num_envs)
    return _make_classic(env_id, num_envs)


def check_env(env_id: str) -> EnvSpec:
    """Validate ``env_id`` (and that the packages it needs are installed); returns its spec."""
    env = make_env(env_id, 1)
    env.close()
    return env.spec


# ---------------------------------------------------------------------- Atari
def _make_atari(env_id: str, num_envs: int) -> VecEnv:
    """84x84 grayscale, frame-skip 4 with max-pooling, 4-frame stack, up to 30 no-ops and FIRE
    on reset, no sticky actions, full episodes (no life loss), raw rewards (the learner clips)."""
    game = atari_game(env_id)
    ale_py = _ale()
    if _vector_env_ok(ale_py):  # ale-py >= 0.12: preprocessing in C++, no OpenCV
        env = ale_py.AtariVectorEnv(game, num_envs=num_envs, num_threads=1, autoreset_mode="SameStep",
                                    reward_clipping=False, episodic_life=False, repeat_action_probability=0.0,
                                    img_height=84, img_width=84, grayscale=True, stack_num=4,
                                    frameskip=4, noop_max=30, use_fire_reset=True)
        n_actions = int(env.single_action_space.n)
    else:  # older ale-py: gymnasium's wrappers (they need OpenCV)
        env, n_actions = _make_atari_gym(env_id, game, num_envs)
    return VecEnv(env, EnvSpec(env_id, "atari", (4, 84, 84), "uint8", n_actions), num_envs)


def _vector_env_ok(ale_py: Any) -> bool:
    """ale-py has AtariVectorEnv with an autoreset_mode option (same-step autoreset, final_obs)."""
    import inspect

    cls = getattr(ale_py, "AtariVectorEnv", None)
    try:
        return cls is not None and "autoreset_mode" in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False


def _make_atari_gym(env_id: str, game: str, num_envs: int) -> tuple[Any, int]:
    gym, ale_py = _gym(), _ale()
    gym.register_envs(ale_py)
    try:
        import cv2  # noqa: F401  (AtariPreprocessing resizes with OpenCV)
    except ImportError as exc:
        raise SetupError(f"ale-py {ale_py.__version__} has no AtariVectorEnv with same-step autoreset and "
                         f"gymnasium's AtariPreprocessing needs OpenCV ({exc}): pip install -U 'ale-py>=0.12' "
                         f"(or pip install opencv-python-headless)") from None
    from gymnasium.vector import AutoresetMode
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    rom = "".join(part.capitalize() for part in game.split("_"))

    def one() -> Any:
        e = gym.make(f"ALE/{rom}-v5", frameskip=1, repeat_action_probability=0.0)
        e = AtariPreprocessing(e, noop_max=30, frame_skip=4, screen_size=84, grayscale_obs=True)
        return FrameStackObservation(e, 4)

    env = gym.vector.SyncVectorEnv([one] * num_envs, autoreset_mode=AutoresetMode.SAME_STEP)
    return env, int(env.single_action_space.n)


# ---------------------------------------------------------------------- classic control
def _make_classic(env_id: str, num_envs: int) -> VecEnv:
    gym = _gym()
    from gymnasium.vector import AutoresetMode

    try:
        env = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="sync",
                           vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP})
    except gym.error.Error as exc:
        raise SetupError(f"unknown env id {env_id!r}: {exc} (try CartPole-v1 or ALE/Pong-v5)") from None
    obs_space, act_space = env.single_observation_space, env.single_action_space
    if not isinstance(act_space, gym.spaces.Discrete) or not isinstance(obs_space, gym.spaces.Box) \
            or len(obs_space.shape) != 1:
        env.close()
        raise SetupError(f"env {env_id!r} has observations {obs_space} and actions {act_space}: this DQN "
                         "needs a flat Box observation and Discrete actions (e.g. CartPole-v1, Acrobot-v1)")
    spec = EnvSpec(env_id, "classic", tuple(obs_space.shape), "float32", int(act_space.n))
    return VecEnv(env, spec, num_envs)
