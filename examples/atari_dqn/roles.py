"""Distributed DQN on mq: ``main(ctx)`` runs the learner, a collector or an evaluator, chosen by
the node's labels (``mq run --main examples.atari_dqn.roles:main --labels learner``, or
``python -m examples.atari_dqn``). Arguments are in config.py, the algorithm in dqn.py.

Channels::

    learner   ==weights=====> collectors, evaluators   mq.LatestWins: {state, credit, config, stop}
    collector --transitions-> learner                  mq.Stream: numpy batches, exact counts
    evaluator --eval--------> learner                  q.send: greedy episode returns

- Latest weights win: the learner never waits for a collector; a collector loads the newest
  version and reports it (``acting``), which is the policy lag in the report and in ``mq top``.
- No transition is lost, and that is checked: the stream counts every batch per collector and
  the learner compares what arrived with what each collector says it sent.
- Pacing: one gradient update per ``train_frequency`` env steps, as single-process DQN; each
  weight version carries a step credit, so collectors cannot run ahead of the learner and a
  curve of return vs env steps does not depend on the machine. ``--unpaced`` turns it off.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import csv
import json
import math
import os
import sys
import time
from typing import Any

import numpy as np
import torch

import mq
import mq.telemetry
from examples.atari_dqn import config as cfgmod
from examples.atari_dqn.dqn import ReplayBuffer, act, linear_schedule, make_qnet, td_update
from examples.atari_dqn.envs import SetupError, check_env, make_env

ROLES = ("learner", "collector", "evaluator")
WEIGHTS, TRANSITIONS, EVAL = "weights", "transitions", "eval"


# ---------------------------------------------------------------------- setup
def fail(message: str) -> SystemExit:
    """A bad setup: one line on stderr and exit code 2."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    return SystemExit(2)


def check_roles(roles: list[str]) -> None:
    """The job needs exactly one learner and at least one collector (launcher-side check)."""
    learners, listed = roles.count("learner"), ",".join(roles)
    if learners != 1:
        raise SetupError(f"{'no' if not learners else learners} learner{'s' * (learners > 1)} in the job "
                         f"(roles: {listed}): give exactly one worker the label 'learner'")
    if "collector" not in roles:
        raise SetupError(f"no collector in the job (roles: {listed}): give at least one worker the label 'collector'")
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        raise SetupError(f"unknown role(s) {unknown}: use {', '.join(ROLES)}")


def main(ctx: mq.Context) -> dict[str, Any] | None:
    roles = sorted(set(ctx.labels) & set(ROLES))
    if len(roles) != 1:
        raise fail(f"node {ctx.node_id} has labels {sorted(ctx.labels)}: give it exactly one of "
                   f"{', '.join(ROLES)} (e.g. --labels collector)")
    mq.telemetry.serve(ctx.mq)  # `mq top --attach-to <any node>` shows the job
    args = node_args(ctx)
    learner_id = join(ctx, roles[0], args.join_timeout)
    if roles[0] == "learner":
        return learner(ctx, args)
    follower(ctx, learner_id, evaluate=roles[0] == "evaluator")
    return None


def node_args(ctx: mq.Context) -> cfgmod.Args:
    """This node's Args: from python -m examples.atari_dqn (ctx.args["config"]), from flags after
    `mq run ... --` (ctx.args["argv"]), or from $ATARI_DQN_ARGS. Only the learner's matter:
    collectors and evaluators take the learner's, which come with the weights."""
    if ctx.args.get("config"):
        return cfgmod.from_dict(ctx.args["config"])
    try:
        return cfgmod.parse(list(ctx.args["argv"])) if ctx.args.get("argv") else cfgmod.from_environment()
    except SystemExit as exc:  # argparse already printed its one-line usage error
        raise SystemExit(2) from exc


def join(ctx: mq.Context, role: str, timeout: float) -> int:
    """Wait for the job's nodes, check there is exactly one learner, return its node id. The
    learner waits for everyone; others accept seeing only the learner (a star) after 5 s."""
    q, deadline, learner_seen_at = ctx.mq, time.monotonic() + timeout, None
    while True:
        peers = q.peers()
        learners = sorted(q.peers("learner") + ([ctx.node_id] if role == "learner" else []))
        if len(learners) > 1:
            raise fail(f"{len(learners)} learners in the job (nodes {learners}): start exactly one node "
                       "with the label 'learner'")
        everyone = len(peers) >= ctx.world_size - 1
        if everyone and not learners:
            raise fail(f"no learner in the job: none of its {ctx.world_size} nodes has the label "
                       "'learner' (start one node with --labels learner)")
        learner_seen_at = learner_seen_at or (time.monotonic() if learners else None)
        if everyone or (role != "learner" and learner_seen_at and time.monotonic() - learner_seen_at > 5.0):
            return learners[0]
        if time.monotonic() > deadline:
            if not learners:
                raise fail(f"no learner joined within {timeout:g}s ({len(peers) + 1} of {ctx.world_size} "
                           "nodes are up): start one node with --labels learner")
            raise fail(f"only {len(peers) + 1} of {ctx.world_size} nodes joined within {timeout:g}s: "
                       f"start the missing nodes (have {sorted(peers + [ctx.node_id])})")
        time.sleep(0.05)


def device_of(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise fail(f"device {name!r} asked for, but torch sees no CUDA GPU on this node")
    return torch.device(name)


def env_for(env_id: str, num_envs: int) -> Any:
    try:
        return make_env(env_id, num_envs)
    except SetupError as exc:
        raise fail(str(exc)) from None


# ---------------------------------------------------------------------- learner
def learner(ctx: mq.Context, a: cfgmod.Args) -> dict[str, Any]:
    q = ctx.mq
    try:
        spec = check_env(a.env)
    except SetupError as exc:
        raise fail(str(exc)) from None
    torch.set_num_threads(a.torch_threads)
    torch.manual_seed(a.seed)
    device = device_of(a.learner_device)
    # GPU tensors only where the backend carries them device to device to collectors on a GPU
    on_device = ctx.mq_type == "torchrpc:cuda" and a.collector_device.startswith("cuda")
    collectors, evaluators = q.peers("collector"), q.peers("evaluator")
    if not collectors:
        raise fail(f"no collector in the job (peers {q.peers()}): start at least one node with --labels collector")
    n = len(collectors)

    # ALGO LOGIC: networks, optimizer, replay buffer
    qnet = make_qnet(spec).to(device)
    target = copy.deepcopy(qnet)
    optimizer = torch.optim.Adam(qnet.parameters(), lr=a.learning_rate)
    rb = ReplayBuffer(a.buffer_size, spec.obs_shape, spec.obs_dtype, seed=a.seed)
    clip_rewards = spec.family == "atari"
    # step credit: each collector may run this far beyond its share of the paced total
    slack = a.send_every * a.num_envs + math.ceil(a.publish_every * a.train_frequency / n)
    quota = math.ceil(a.total_steps / n / a.num_envs) * a.num_envs

    # channels
    weights = mq.LatestWins(q, WEIGHTS)
    transitions = mq.Stream(q, TRANSITIONS)
    q.subscribe(EVAL)
    logs = Logs(a.log_dir)
    received = dict.fromkeys(collectors, 0)
    sent_t: dict[int, int] = {}  # transitions each collector says it sent (running total)
    env_steps = dict.fromkeys(collectors, 0)
    acted = dict.fromkeys(collectors, -1)
    epsilon = dict.fromkeys(collectors, a.start_e)
    losses: collections.deque[float] = collections.deque(maxlen=100)
    returns: collections.deque[float] = collections.deque(maxlen=10)
    lags: list[int] = []
    problems: list[str] = []
    total = updates = published_at = episodes = evals = 0
    best, reached_at, stop = -math.inf, None, False

    def can_update() -> bool:
        if total < a.learning_starts or rb.size < a.batch_size:
            return False
        return a.unpaced or updates < (total - a.learning_starts) // a.train_frequency

    def publish(finished: bool = False) -> None:
        nonlocal published_at
        state = {k: v if on_device else v.cpu() for k, v in qnet.state_dict().items()}  # publish copies
        credit = -1 if a.unpaced else math.ceil((a.learning_starts + updates * a.train_frequency) / n) + slack
        weights.publish({"state": state, "credit": credit, "quota": quota, "stop": stop,
                         "finished": finished, "config": cfgmod.to_dict(a)})
        published_at = updates

    q.wait_for_subscribers(WEIGHTS, count=n + len(evaluators), timeout=a.join_timeout)
    t0 = last_log = last_msg = last_pub = time.monotonic()
    progress = Progress(t0)
    say(f"learner node {ctx.node_id} | {a.env} ({spec.family}, {spec.n_actions} actions) | mq {ctx.mq_type} "
        f"| device {device} | collectors {collectors} | evaluators {evaluators} | total {a.total_steps:,} env "
        f"steps | {'unpaced' if a.unpaced else f'1 update per {a.train_frequency} env steps'}")
    publish()
    while transitions.open_senders(collectors) or transitions.pending():
        # 1. read transitions (bounded, so updates keep going under a flood) and evaluations
        for _ in range(256):
            try:
                msg = transitions.recv(timeout=0.0 if can_update() else 0.02)
            except mq.Timeout:
                break
            c, p, last_msg = msg.sender, msg.payload, time.monotonic()
            k = len(p["actions"])
            rb.add(p["obs"], p["actions"], np.sign(p["rewards"]) if clip_rewards else p["rewards"],
                   p["next_obs"], p["dones"])
            received[c] += k
            total += k
            sent_t[c] = int(p["sent"])
            env_steps[c], acted[c], epsilon[c] = int(p["env_steps"]), int(p["version"]), float(p["epsilon"])
            if c in weights.lag():
                lags.append(weights.lag()[c])
            for ret, length in p["episodes"]:
                episodes += 1
                returns.append(float(ret))
                if len(returns) == returns.maxlen:
                    best = max(best, float(np.mean(returns)))
                logs.write("episodes", [f"{time.monotonic() - t0:.2f}", total, c, ret, length, p["version"]])
        while True:
            try:
                e = q.recv(timeout=0.0).payload
            except mq.Timeout:
                break
            evals += 1
            logs.write("evals", [f"{time.monotonic() - t0:.2f}", total, e["version"], e["return"], e["length"]])

        # 2. ALGO LOGIC: train, copy the target network, publish weights
        for _ in range(16):
            if not can_update():
                break
            losses.append(td_update(qnet, target, optimizer, rb.sample(a.batch_size, device), a.gamma,
                                    a.max_grad_norm))
            updates += 1
            if updates % a.target_update == 0:
                target.load_state_dict(qnet.state_dict())
            if updates % a.publish_every == 0:
                publish()
        now = time.monotonic()
        # a paced learner waiting for data publishes what it has, so collectors get credit
        if not a.unpaced and updates > published_at and not can_update() and now - last_pub > 0.25:
            publish()
        if published_at == updates:
            last_pub = now

        # 3. progress, early stop, stalls
        mean_return = float(np.mean(returns)) if returns else float("nan")
        if now - last_log >= a.log_every:
            last_log = now
            progress.log(now, logs, total, updates, weights, epsilon, episodes, mean_return, losses)
        if a.target_return is not None and not stop and len(returns) >= 10 and mean_return >= a.target_return:
            reached_at, stop = total, True
            say(f"target return {a.target_return:g} reached at {total:,} env steps: stopping the collectors")
            publish()
        if now - last_msg > a.stall_timeout:
            problems.append(f"no transitions for {a.stall_timeout:g}s; still open: "
                            f"{transitions.open_senders(collectors)}")
            break
    progress.log(time.monotonic(), logs, total, updates, weights, epsilon, episodes,
                 float(np.mean(returns)) if returns else float("nan"), losses)
    publish(finished=True)  # evaluators stop
    with contextlib.suppress(mq.Timeout):  # a stuck evaluator must not fail the run
        weights.flush(timeout=5.0)
    stream = transitions.close(expect=collectors, timeout=5.0, check=False)
    problems += stream["problems"]

    # report
    sent = {c: sent_t.get(c, 0) for c, v in stream["counts"].items() if v["sent"] is not None}
    loss = float(np.mean(list(losses)[-10:])) if losses else float("nan")
    checks = {
        "all_collectors_done": set(sent) == set(collectors),
        # the stream checked every message arrived; each carries its collector's running total
        "received_equals_sent": not stream["problems"] and all(received[c] == sent_t.get(c) for c in sent),
        "learner_updates": updates > 0,
        "finite_loss": math.isfinite(loss),
        "collectors_acted_with_trained_weights": all(v >= 1 for v in acted.values()),
    }
    wall = time.monotonic() - t0
    metrics = q.metrics()
    report = {
        "ok": all(checks.values()) and not problems, "checks": checks, "problems": problems,
        "env": a.env, "mq_type": ctx.mq_type, "collectors": collectors,
        "transitions_received": total,
        "transitions_received_per_collector": {str(c): v for c, v in received.items()},
        "transitions_sent": {str(c): v for c, v in sent.items()},
        "transition_messages": {str(c): v for c, v in stream["counts"].items()},
        "env_steps": {str(c): v for c, v in env_steps.items()},
        "learner_updates": updates, "loss": loss, "weights_version": weights.version,
        "collector_weight_versions": {str(c): v for c, v in acted.items()},
        "policy_lag": {"mean": float(np.mean(lags)) if lags else None, "max": max(lags, default=None),
                       "last": {str(c): v for c, v in weights.lag().items()}},
        "episodes": episodes, "mean_return_last10": float(np.mean(returns)) if returns else None,
        "best_mean_return_10": best if math.isfinite(best) else None, "target_reached_at": reached_at,
        "evaluations": evals, "wall_s": round(wall, 2),
        "env_steps_per_s": round(total / max(wall, 1e-9), 1), "updates_per_s": round(updates / max(wall, 1e-9), 2),
        "weights_channel": dict(weights.stats),
        "metrics": {"topics": metrics["topics"], "queues": metrics["queues"], "drops": metrics["drops"],
                    "routes": metrics["routes"]},
    }
    say("final | collector  messages sent/received  transitions sent/received  env_steps  version | " + " | ".join(
        f"{c}: {stream['counts'].get(c, {}).get('sent')}/{stream['counts'].get(c, {}).get('received')} "
        f"{sent_t.get(c, 0)}/{received[c]} {env_steps[c]} v{acted[c]}" for c in collectors)
        + f" | total received {total} | " + ("OK" if report["ok"] else "NOT OK: " + "; ".join(
            [k for k, v in checks.items() if not v] + problems)))
    logs.close()
    return write_report(report, ctx.args.get("report") or a.report)


# ---------------------------------------------------------------------- collector and evaluator
def follower(ctx: mq.Context, learner_id: int, evaluate: bool) -> None:
    """A collector (epsilon-greedy, streams transitions) or an evaluator (greedy episodes)."""
    q = ctx.mq
    weights = mq.LatestWins(q, WEIGHTS, subscribe=True)
    transitions = None if evaluate else mq.Stream(q, TRANSITIONS, to=learner_id)
    try:
        w = weights.wait_newer(-1, timeout=node_args(ctx).join_timeout)
    except mq.Timeout:
        raise fail(f"node {ctx.node_id}: no weights from the learner (node {learner_id}) in time") from None
    a = cfgmod.from_dict(w.payload["config"])  # the learner's configuration
    torch.set_num_threads(a.torch_threads)
    torch.manual_seed(a.seed + ctx.node_id)
    device = device_of(a.collector_device)
    env = env_for(a.env, 1 if evaluate else a.num_envs)
    qnet = make_qnet(env.spec).to(device).eval()
    rng = np.random.default_rng(a.seed + 7919 * ctx.node_id)
    obs = env.reset(seed=a.seed + 1000 * ctx.node_id)
    version, credit, stalled_since, evaluated = -1, 0, None, (-1, -math.inf)
    steps = sent = 0
    batch: list[tuple[np.ndarray, ...]] = []
    ended_episodes: list[tuple[float, int]] = []
    epsilon = a.eval_epsilon if evaluate else a.start_e

    def flush() -> None:
        nonlocal batch, ended_episodes, sent
        if transitions is None or not batch:
            return
        o, actions, rewards, next_o, dones = (np.concatenate(x) for x in zip(*batch))
        sent += len(actions)
        try:
            transitions.send({"obs": o, "actions": actions, "rewards": rewards, "next_obs": next_o, "dones": dones,
                              "version": version, "env_steps": steps, "epsilon": epsilon, "sent": sent,
                              "episodes": ended_episodes}, timeout=a.stall_timeout)
        except mq.MQError as exc:
            raise fail(f"collector {ctx.node_id}: cannot stream transitions to the learner: {exc}") from None
        batch, ended_episodes = [], []

    while True:
        # 1. the newest weights, if newer than those in use (latest wins)
        w = weights.latest()
        if w is not None and w.number > version:
            qnet.load_state_dict({k: torch.as_tensor(v) for k, v in w.payload["state"].items()})
            version, credit = w.number, w.payload["credit"]
            weights.acting(version)
        if w.payload["stop"] or w.payload["finished"] or (not evaluate and steps >= w.payload["quota"]):
            break
        if learner_id not in q.peers():
            if evaluate:
                break
            raise fail(f"node {ctx.node_id}: the learner (node {learner_id}) left the job")
        # 2. paced: wait for credit (new weights) from the learner
        if not evaluate and credit >= 0 and steps + env.num_envs > credit:
            flush()
            stalled_since = stalled_since or time.monotonic()
            if time.monotonic() - stalled_since > a.stall_timeout:
                raise fail(f"collector {ctx.node_id}: no new step credit from the learner for "
                           f"{a.stall_timeout:g}s (at {steps} steps, credit {credit})")
            try:
                weights.wait_newer(version, timeout=0.5)
            except mq.Timeout:
                pass
            continue
        stalled_since = None
        # an evaluator plays one greedy episode per version, at most one per eval_interval
        if evaluate and (version == evaluated[0] or time.monotonic() - evaluated[1] < a.eval_interval):
            try:
                weights.wait_newer(version, timeout=0.2)
            except mq.Timeout:
                pass
            continue
        # 3. ALGO LOGIC: act, step, batch the transitions
        if not evaluate:
            epsilon = linear_schedule(a.start_e, a.end_e, a.exploration_fraction * w.payload["quota"], steps)
        actions = act(qnet, obs, epsilon, env.spec.n_actions, rng, device)
        next_act_obs, next_obs, rewards, terminated, ended = env.step(actions)
        if evaluate:
            obs = next_act_obs
            for ret, length in ended:
                with contextlib.suppress(mq.MQError):  # the learner may have finished meanwhile
                    q.send(learner_id, EVAL, {"version": version, "return": ret, "length": length}, timeout=10.0)
                evaluated = (version, time.monotonic())
            continue
        batch.append((obs, actions, rewards, next_obs, terminated))
        ended_episodes.extend(ended)
        obs = next_act_obs
        steps += env.num_envs
        if len(batch) >= a.send_every:
            flush()
    flush()
    if transitions is not None:
        transitions.close(timeout=a.stall_timeout)  # tells the learner how many batches it sent
    env.close()


# ---------------------------------------------------------------------- logs and report
def say(line: str) -> None:
    print(line, flush=True)


class Logs:
    """progress.csv, episodes.csv and evals.csv under --log-dir (nothing without it)."""

    HEADERS = {"progress": ["time_s", "env_steps", "updates", "env_steps_per_s", "updates_per_s", "weights_version",
                            "max_policy_lag", "epsilon", "episodes", "mean_return_10", "loss"],
               "episodes": ["time_s", "env_steps", "collector", "return", "length", "weights_version"],
               "evals": ["time_s", "env_steps", "weights_version", "return", "length"]}

    def __init__(self, log_dir: str | None):
        self.files: dict[str, Any] = {}
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
            for name, header in self.HEADERS.items():
                f = open(os.path.join(log_dir, f"{name}.csv"), "w", newline="")
                self.files[name] = (f, csv.writer(f))
                self.write(name, header)

    def write(self, name: str, row: list[Any]) -> None:
        if name in self.files:
            self.files[name][1].writerow(row)
            self.files[name][0].flush()

    def close(self) -> None:
        for f, _w in self.files.values():
            f.close()


class Progress:
    """The learner's progress line every --log-every seconds (and a row of progress.csv)."""

    def __init__(self, t0: float):
        self.t0, self.last = t0, (t0, 0, 0)

    def log(self, now: float, logs: Logs, total: int, updates: int, weights: mq.LatestWins,
            epsilon: dict[int, float], episodes: int, mean_return: float, losses: Any) -> None:
        t_prev, steps_prev, updates_prev = self.last
        dt = max(now - t_prev, 1e-9)
        sps, ups = (total - steps_prev) / dt, (updates - updates_prev) / dt
        self.last = (now, total, updates)
        lag = weights.lag()
        loss = float(np.mean(losses)) if losses else float("nan")
        eps = float(np.mean(list(epsilon.values())))
        say(f"{now - self.t0:7.1f}s | env steps {total:>9,} ({sps:6.0f}/s) | updates {updates:>7,} ({ups:5.1f}/s) "
            f"| weights v{weights.version} lag " + " ".join(f"{c}:{v}" for c, v in lag.items())
            + f" | eps {eps:.2f} | episodes {episodes} | return(10) {mean_return:7.2f} | loss {loss:.4f}")
        logs.write("progress", [f"{now - self.t0:.2f}", total, updates, f"{sps:.1f}", f"{ups:.2f}", weights.version,
                                max(lag.values(), default=""), f"{eps:.4f}", episodes, f"{mean_return:.3f}",
                                f"{loss:.6f}"])


def json_safe(obj: Any) -> Any:
    """NaN / inf -> None, so the report is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_report(report: dict[str, Any], path: str | None) -> dict[str, Any]:
    report = json_safe(report)
    if path:
        with open(f"{path}.tmp", "w") as f:
            json.dump(report, f)
        os.replace(f"{path}.tmp", path)
    return report
