"""Hyperparameters and the command line of the distributed DQN example.

Every knob lives in :class:`Args`. A field left at ``None`` takes its value from the preset of the
environment family (``atari`` for ``ALE/...`` ids, ``classic`` for classic-control ids such as
``CartPole-v1``); ``--smoke`` swaps in a tiny Pong run. The same ``Args`` travels, as a dict, from
the launcher to the learner, and from the learner to every collector and evaluator (collectors need
no flags of their own: ``mq run --labels collector`` is enough).
"""

from __future__ import annotations

import argparse
import os
import shlex
from dataclasses import asdict, dataclass, fields
from typing import Any

# Flags for nodes started with `mq run` (which has no flags of its own for the example): the
# learner reads them from this environment variable, e.g. ATARI_DQN_ARGS="--env CartPole-v1".
ENV_VAR = "ATARI_DQN_ARGS"


@dataclass
class Args:
    # --- job
    env: str = "CartPole-v1"
    """gymnasium id: ``ALE/Pong-v5`` (Atari, Nature-DQN CNN) or a classic-control id (MLP)"""
    seed: int = 1
    collectors: int = 2
    """number of collector workers (python -m examples.atari_dqn only)"""
    evaluator: bool = False
    """also start an evaluator worker that plays greedy episodes with the latest weights"""
    roles: str | None = None
    """explicit comma-separated role per worker, e.g. ``learner,collector,collector`` (overrides
    --collectors/--evaluator)"""
    mq_type: str = "nng"
    total_steps: int | None = None
    """env steps summed over all collectors"""
    target_return: float | None = None
    """stop early once the mean return of the last 10 episodes reaches this"""
    smoke: bool = False

    # --- ALGO: DQN
    learning_rate: float | None = None
    buffer_size: int | None = None
    gamma: float = 0.99
    batch_size: int | None = None
    learning_starts: int | None = None
    """env steps (all collectors) in the replay buffer before the first update"""
    train_frequency: int | None = None
    """env steps per gradient update; the learner paces the collectors to this ratio"""
    target_update: int | None = None
    """gradient updates between hard copies of the online network into the target network"""
    start_e: float = 1.0
    end_e: float | None = None
    exploration_fraction: float | None = None
    """fraction of total_steps over which epsilon decays from start_e to end_e"""
    eval_epsilon: float | None = None
    eval_interval: float = 5.0
    """seconds between the starts of the evaluator's greedy episodes"""
    max_grad_norm: float = 10.0

    # --- distribution
    num_envs: int = 1
    """environments per collector (stepped as one vector env, acting in one forward pass)"""
    send_every: int | None = None
    """env steps a collector batches into one transitions message"""
    publish_every: int | None = None
    """gradient updates between weight publications"""
    unpaced: bool = False
    """let collectors run as fast as they can (Ape-X style) instead of pacing them to
    train_frequency; learning per env step then depends on the machine"""
    learner_device: str = "auto"
    """auto (cuda when available), cpu or cuda"""
    collector_device: str = "cpu"
    torch_threads: int = 1
    """torch intra-op threads per worker (1 is fastest when workers share a few cores)"""
    join_timeout: float = 120.0
    """seconds to wait for all nodes of the job to join"""
    stall_timeout: float = 120.0
    """seconds without progress (no weights / no transitions) before a node gives up"""

    # --- output
    log_every: float = 5.0
    """seconds between progress lines"""
    log_dir: str | None = None
    """write progress.csv, episodes.csv (and evals.csv) here"""
    report: str | None = None
    """write the final JSON report to this file"""


# Presets: CleanRL's dqn_atari.py for Atari (buffer shrunk to fit a workstation's memory), and
# a faster-learning setting for classic control (CartPole passes a mean return of 100 in ~4-7k
# env steps, under a minute on 2 cores; see README.md).
PRESETS: dict[str, dict[str, Any]] = {
    "atari": dict(total_steps=10_000_000, learning_rate=1e-4, buffer_size=100_000, batch_size=32,
                  learning_starts=80_000, train_frequency=4, target_update=250, end_e=0.01,
                  exploration_fraction=0.10, eval_epsilon=0.05, send_every=64, publish_every=50),
    "classic": dict(total_steps=60_000, learning_rate=1e-3, buffer_size=50_000, batch_size=64,
                    learning_starts=1_000, train_frequency=2, target_update=250, end_e=0.05,
                    exploration_fraction=0.15, eval_epsilon=0.0, send_every=32, publish_every=20),
}
SMOKE = dict(env="ALE/Pong-v5", collectors=2, total_steps=800, learning_starts=256, buffer_size=2_000,
             train_frequency=4, target_update=50, publish_every=10, send_every=32,
             exploration_fraction=0.5, log_every=5.0, join_timeout=45.0, stall_timeout=45.0)


def env_family(env_id: str) -> str:
    return "atari" if env_id.startswith("ALE/") or "NoFrameskip" in env_id else "classic"


def finalize(args: Args) -> Args:
    """Apply --smoke and the env family's preset to every field left at None."""
    if args.smoke:
        for k, v in SMOKE.items():
            if getattr(args, k) in (None, getattr(Args, k, None)):  # not set on the command line
                setattr(args, k, v)
    for k, v in PRESETS[env_family(args.env)].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def to_dict(args: Args) -> dict[str, Any]:
    return asdict(args)


def from_dict(d: dict[str, Any]) -> Args:
    names = {f.name for f in fields(Args)}
    return finalize(Args(**{k: v for k, v in d.items() if k in names}))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m examples.atari_dqn",
        description="Distributed DQN on mq: one learner, N collectors, optional evaluator.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in fields(Args):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(Args, f.name)
        if f.type in ("bool",) or isinstance(default, bool):
            p.add_argument(flag, action="store_true", help=_doc(f.name))
            continue
        kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        p.add_argument(flag, type=kind, default=default, help=_doc(f.name),
                       metavar=f.name.upper())
    return p


def parse(argv: list[str] | None = None) -> Args:
    ns = parser().parse_args(argv)
    return finalize(Args(**vars(ns)))


def from_environment() -> Args:
    """Args for a node started by `mq run`: the flags in $ATARI_DQN_ARGS, else the defaults."""
    return parse(shlex.split(os.environ.get(ENV_VAR, "")))


def _doc(name: str) -> str:
    return _DOCS.get(name, name.replace("_", " "))


# Field docstrings (the strings under each field above), for --help.
def _field_docs() -> dict[str, str]:
    import ast
    import inspect

    docs: dict[str, str] = {}
    try:
        tree = ast.parse(inspect.getsource(Args))
    except (OSError, TypeError):
        return docs
    body = tree.body[0].body  # type: ignore[attr-defined]
    for prev, node in zip(body, body[1:]):
        if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name)
                and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            docs[prev.target.id] = " ".join(str(node.value.value).split())
    return docs


_DOCS = _field_docs()
