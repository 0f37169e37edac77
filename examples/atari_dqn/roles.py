"""The roles of distributed DQN, chosen by each node's labels: ``learner``, ``collector``,
``evaluator``. Entry point for every launcher: ``main(ctx)`` (``mq run --main
examples.atari_dqn.roles:main --labels learner``, or ``python -m examples.atari_dqn``).

Message flow (topics)::

    collector --transitions--> learner      numpy batches + the weight version acted with, env steps, episodes
    collector --done---------> learner      final totals: transitions sent, env steps
    evaluator --eval---------> learner      greedy episode returns
    learner   ==weights======> all          publish: {version, state, credit, config}; latest wins
    learner   --stop---------> collectors   target return reached: stop early
    learner   --finish-------> collector    your totals were counted (sent after its "done"): exit

Only the MQ interface is used (send / publish / subscribe / recv / peers), so every mq type runs
this unchanged. Because send is ordered per sender->receiver pair, when the learner reads a
collector's "done" every transition that collector sent has already been read: the counts in the
final report are exact, and the learner checks them.

Pacing: the learner does one gradient update per ``train_frequency`` env steps, as single-process
DQN does, and gives each collector a step budget ("credit") with every weight publication, so a
fast collector cannot run far ahead of the learner (this also bounds the weight lag) and a curve
of return vs env steps does not depend on the machine's speed. ``--unpaced`` turns this off.
"""

from __future__ import annotations

import collections
import copy
import csv
import json
import math
import os
import sys
import threading
import time
from typing import Any

import numpy as np
import torch

import mq
from examples.atari_dqn import config as cfgmod
from examples.atari_dqn.dqn import ReplayBuffer, act, linear_schedule, make_qnet, td_update
from examples.atari_dqn.envs import SetupError, check_env, make_env

ROLES = ("learner", "collector", "evaluator")
TRANSITIONS, DONE, EVAL, WEIGHTS, STOP, FINISH = "transitions", "done", "eval", "weights", "stop", "finish"


def fail(message: str) -> "SystemExit":
    """A bad setup: one line on stderr and exit code 2."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    return SystemExit(2)


def role_of(node_id: int, labels: Any) -> str:
    roles = sorted(set(labels) & set(ROLES))
    if len(roles) != 1:
        raise fail(f"node {node_id} has labels {sorted(labels)}: give it exactly one of "
                   f"{', '.join(ROLES)} (e.g. --labels collector)")
    return roles[0]


def check_roles(roles: list[str]) -> None:
    """The job needs exactly one learner and at least one collector (launcher-side check)."""
    learners = roles.count("learner")
    if learners == 0:
        raise SetupError(f"no learner in the job (roles: {','.join(roles)}): give exactly one worker "
                         "the label 'learner'")
    if learners > 1:
        raise SetupError(f"{learners} learners in the job (roles: {','.join(roles)}): give exactly one "
                         "worker the label 'learner'")
    if "collector" not in roles:
        raise SetupError(f"no collector in the job (roles: {','.join(roles)}): give at least one worker "
                         "the label 'collector'")
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        raise SetupError(f"unknown role(s) {unknown}: use {', '.join(ROLES)}")


# ---------------------------------------------------------------------- entry point
def main(ctx: mq.Context) -> dict[str, Any] | None:
    role = role_of(ctx.node_id, ctx.labels)
    args = node_args(ctx)
    learner = join(ctx, role, args.join_timeout)
    if role == "learner":
        return Learner(ctx, args).run()
    if role == "collector":
        Collector(ctx, learner).run()
    else:
        Evaluator(ctx, learner).run()
    return None


def node_args(ctx: mq.Context) -> cfgmod.Args:
    """This node's Args: from python -m examples.atari_dqn (ctx.args["config"]), from flags after
    `mq run ... --` (ctx.args["argv"]), or from $ATARI_DQN_ARGS. Only the learner's matter for
    training: collectors and evaluators take the learner's, which come with the weights."""
    if ctx.args.get("config"):
        return cfgmod.from_dict(ctx.args["config"])
    try:
        if ctx.args.get("argv"):
            return cfgmod.parse(list(ctx.args["argv"]))
        return cfgmod.from_environment()
    except SystemExit as exc:  # argparse already printed its one-line usage error
        raise SystemExit(2) from exc


def join(ctx: mq.Context, role: str, timeout: float) -> int:
    """Wait for the job's nodes; check there is exactly one learner; return its node id.

    The learner waits for all ``world_size - 1`` peers (it must know every collector). Others
    also wait for all of them, but accept a job where they see only the learner (star topology).
    """
    q = ctx.mq
    deadline = time.monotonic() + timeout
    learner_seen_at: float | None = None
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
        if learners and learner_seen_at is None:
            learner_seen_at = time.monotonic()
        if everyone or (role != "learner" and learner_seen_at and time.monotonic() - learner_seen_at > 5.0):
            return learners[0]
        if time.monotonic() > deadline:
            if not learners:
                raise fail(f"no learner joined within {timeout:g}s ({len(peers) + 1} of {ctx.world_size} "
                           "nodes are up): start one node with --labels learner")
            raise fail(f"only {len(peers) + 1} of {ctx.world_size} nodes joined within {timeout:g}s: "
                       f"start the missing nodes (have {sorted(peers + [ctx.node_id])})")
        time.sleep(0.05)


def _device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise fail(f"device {name!r} asked for, but torch sees no CUDA GPU on this node")
    return torch.device(name)


def _setup_env(env_id: str, num_envs: int = 1):
    try:
        return make_env(env_id, num_envs)
    except SetupError as exc:
        raise fail(str(exc)) from None


# ---------------------------------------------------------------------- learner
class Learner:
    def __init__(self, ctx: mq.Context, args: cfgmod.Args):
        self.ctx, self.q, self.args = ctx, ctx.mq, args
        self.report_path = ctx.args.get("report") or args.report
        try:
            self.spec = check_env(args.env)
        except SetupError as exc:
            raise fail(str(exc)) from None
        torch.set_num_threads(args.torch_threads)
        torch.manual_seed(args.seed)
        self.device = _device(args.learner_device)
        # Weights go as GPU tensors only where the backend carries them device to device and
        # the collectors act on a GPU; otherwise as CPU tensors.
        self.weights_on_device = ctx.mq_type == "torchrpc:cuda" and args.collector_device.startswith("cuda")

    # ---- ALGO LOGIC: the learner loop
    def run(self) -> dict[str, Any]:
        a, q = self.args, self.q
        self.collectors = q.peers("collector")
        self.evaluators = q.peers("evaluator")
        if not self.collectors:
            raise fail(f"no collector in the job (peers {q.peers()}): start at least one node with "
                       "--labels collector")
        n = len(self.collectors)
        self.qnet = make_qnet(self.spec).to(self.device)
        self.target = copy.deepcopy(self.qnet)
        self.optimizer = torch.optim.Adam(self.qnet.parameters(), lr=a.learning_rate)
        self.rb = ReplayBuffer(a.buffer_size, self.spec.obs_shape, self.spec.obs_dtype, seed=a.seed)
        self.clip_rewards = self.spec.family == "atari"
        # credit: each collector may run this many steps beyond its share of the paced total
        batch_steps = a.send_every * a.num_envs
        self.credit_slack = batch_steps + math.ceil(a.publish_every * a.train_frequency / n)
        self.quota = math.ceil(a.total_steps / n / a.num_envs) * a.num_envs

        # counters, per collector
        self.received = {c: 0 for c in self.collectors}
        self.env_steps = {c: 0 for c in self.collectors}
        self.acted_version = {c: -1 for c in self.collectors}
        self.epsilon = {c: a.start_e for c in self.collectors}
        self.done: dict[int, dict[str, Any]] = {}
        self.lost: dict[int, str] = {}
        self.problems: list[str] = []
        self.total_received = 0
        self.updates = 0
        self.version = 0
        self.published_at_update = 0
        self.losses: collections.deque[float] = collections.deque(maxlen=100)
        self.returns: collections.deque[float] = collections.deque(maxlen=10)
        self.episodes = 0
        self.best_mean_return = -math.inf
        self.target_reached_at: int | None = None
        self.stop_sent = False
        self.evals: list[dict[str, Any]] = []
        self._open_logs()

        for topic in (TRANSITIONS, DONE, EVAL):
            q.subscribe(topic)
        q.wait_for_subscribers(WEIGHTS, count=n + len(self.evaluators), timeout=a.join_timeout)
        self.t0 = time.monotonic()
        self._say(f"learner node {self.ctx.node_id} | {a.env} ({self.spec.family}, {self.spec.n_actions} actions) "
                  f"| mq {self.ctx.mq_type} | device {self.device} | collectors {self.collectors} "
                  f"| evaluators {self.evaluators} | total {a.total_steps:,} env steps "
                  f"| {'unpaced' if a.unpaced else f'1 update per {a.train_frequency} env steps'}")
        self.publish()
        last_log = last_msg = last_pub = time.monotonic()
        self._last = (last_log, 0, 0)
        while len(self.done) + len(self.lost) < n:
            # 1. read what has arrived (bounded, so updates keep going under a flood)
            for _ in range(256):
                try:
                    msg = q.recv(timeout=0.0 if self.can_update() else 0.02)
                except mq.Timeout:
                    break
                last_msg = time.monotonic()
                self.handle(msg)
            # 2. train
            for _ in range(16):
                if not self.can_update():
                    break
                self.train_step()
            # a paced learner waiting for data publishes what it has, so collectors get credit
            now = time.monotonic()
            if not a.unpaced and self.updates > self.published_at_update and not self.can_update() \
                    and now - last_pub > 0.25:
                self.publish()
            if self.published_at_update == self.updates:
                last_pub = now
            # 3. progress, early stop, lost collectors, stalls
            if now - last_log >= a.log_every:
                self.log_progress(now)
                last_log = now
                for c in self.collectors:
                    if c not in self.done and c not in self.lost and c not in q.peers():
                        self.lost[c] = "left the job before sending 'done'"
                        self.problems.append(f"collector {c} left the job before sending 'done'")
            if a.target_return is not None and not self.stop_sent and len(self.returns) >= 10 \
                    and self.mean_return() >= a.target_return:
                self.target_reached_at = self.total_received
                self._say(f"target return {a.target_return:g} reached at {self.total_received:,} env steps: "
                          "stopping the collectors")
                self.broadcast(STOP, {"reason": "target return reached"}, self.collectors)
                self.stop_sent = True
            if now - last_msg > a.stall_timeout:
                waiting = [c for c in self.collectors if c not in self.done and c not in self.lost]
                self.problems.append(f"no message for {a.stall_timeout:g}s; still waiting for 'done' from {waiting}")
                break
        self.log_progress(time.monotonic())
        self.broadcast(FINISH, {}, self.evaluators)
        return self.finish()

    def can_update(self) -> bool:
        a = self.args
        if self.total_received < a.learning_starts or self.rb.size < a.batch_size:
            return False
        return a.unpaced or self.updates < (self.total_received - a.learning_starts) // a.train_frequency

    def train_step(self) -> None:
        a = self.args
        batch = self.rb.sample(a.batch_size, self.device)
        self.losses.append(td_update(self.qnet, self.target, self.optimizer, batch, a.gamma, a.max_grad_norm))
        self.updates += 1
        if self.updates % a.target_update == 0:
            self.target.load_state_dict(self.qnet.state_dict())
        if self.updates % a.publish_every == 0:
            self.publish()

    def publish(self) -> None:
        """Weights, with a version and each collector's step credit, to every subscriber."""
        a = self.args
        self.version = self.updates and self.version + 1  # version 0 = the initial weights
        state = {k: (v.detach().clone() if self.weights_on_device else v.detach().to("cpu", copy=True))
                 for k, v in self.qnet.state_dict().items()}
        n = len(self.collectors)
        credit = -1 if a.unpaced else math.ceil((a.learning_starts + self.updates * a.train_frequency) / n) \
            + self.credit_slack
        payload = {"version": self.version, "state": state, "credit": credit, "quota": self.quota,
                   "updates": self.updates, "config": cfgmod.to_dict(a)}
        self.q.publish(WEIGHTS, payload, timeout=a.stall_timeout)
        self.published_at_update = self.updates

    def handle(self, msg: mq.Message) -> None:
        c, p = msg.sender, msg.payload
        if msg.topic == TRANSITIONS:
            k = len(p["actions"])
            rewards = np.sign(p["rewards"]) if self.clip_rewards else p["rewards"]
            self.rb.add(p["obs"], p["actions"], rewards, p["next_obs"], p["dones"])
            self.received[c] = self.received.get(c, 0) + k
            self.total_received += k
            self.env_steps[c] = int(p["env_steps"])
            self.acted_version[c] = int(p["version"])
            self.epsilon[c] = float(p["epsilon"])
            for ret, length in p["episodes"]:
                self.episodes += 1
                self.returns.append(float(ret))
                if len(self.returns) == self.returns.maxlen:
                    self.best_mean_return = max(self.best_mean_return, self.mean_return())
                self._write(self.episodes_csv, [f"{self._t():.2f}", self.total_received, c, ret, length, p["version"]])
        elif msg.topic == DONE:
            self.done[c] = dict(p)
            self.acted_version[c] = int(p["version"])
            self.env_steps[c] = int(p["env_steps"])
            self.broadcast(FINISH, {"received": self.received.get(c, 0)}, [c])
        elif msg.topic == EVAL:
            self.evals.append(dict(p, env_steps=self.total_received))
            self._write(self.evals_csv, [f"{self._t():.2f}", self.total_received, p["version"], p["return"], p["length"]])

    def broadcast(self, topic: str, payload: Any, nodes: list[int]) -> None:
        for node in nodes:
            if node in self.lost:
                continue
            try:
                self.q.send(node, topic, payload, timeout=10.0)
            except mq.MQError as exc:
                self.problems.append(f"could not send {topic!r} to node {node}: {exc}")

    def mean_return(self) -> float:
        return float(np.mean(self.returns)) if self.returns else float("nan")

    # ---- progress and results
    def log_progress(self, now: float) -> None:
        t_prev, steps_prev, updates_prev = self._last
        dt = max(now - t_prev, 1e-9)
        sps = (self.total_received - steps_prev) / dt
        ups = (self.updates - updates_prev) / dt
        self._last = (now, self.total_received, self.updates)
        lag = {c: self.version - v for c, v in self.acted_version.items() if v >= 0}
        loss = float(np.mean(self.losses)) if self.losses else float("nan")
        eps = float(np.mean(list(self.epsilon.values())))
        self._say(f"{self._t():7.1f}s | env steps {self.total_received:>9,} ({sps:6.0f}/s) | updates {self.updates:>7,} "
                  f"({ups:5.1f}/s) | weights v{self.version} lag " + " ".join(f"{c}:{v}" for c, v in sorted(lag.items()))
                  + f" | eps {eps:.2f} | episodes {self.episodes} | return(10) {self.mean_return():7.2f} | loss {loss:.4f}")
        self._write(self.progress_csv, [f"{self._t():.2f}", self.total_received, self.updates, f"{sps:.1f}", f"{ups:.2f}",
                                        self.version, max(lag.values(), default=""), f"{eps:.4f}", self.episodes,
                                        f"{self.mean_return():.3f}", f"{loss:.6f}"])

    def finish(self) -> dict[str, Any]:
        loss = float(np.mean(list(self.losses)[-10:])) if self.losses else float("nan")
        sent = {c: int(d["sent"]) for c, d in self.done.items()}
        checks = {
            "all_collectors_done": len(self.done) == len(self.collectors),
            "received_equals_sent": all(self.received.get(c, 0) == s for c, s in sent.items())
            and sum(self.received.values()) == sum(sent.values()),
            "learner_updates": self.updates > 0,
            "finite_loss": math.isfinite(loss),
            "collectors_acted_with_trained_weights": all(self.acted_version.get(c, -1) >= 1 for c in self.collectors),
        }
        wall = time.monotonic() - self.t0
        report = {
            "ok": all(checks.values()) and not self.problems,
            "checks": checks,
            "problems": self.problems,
            "env": self.args.env,
            "mq_type": self.ctx.mq_type,
            "collectors": self.collectors,
            "transitions_received": int(self.total_received),
            "transitions_received_per_collector": {str(c): int(v) for c, v in self.received.items()},
            "transitions_sent": {str(c): v for c, v in sent.items()},
            "env_steps": {str(c): int(v) for c, v in self.env_steps.items()},
            "learner_updates": self.updates,
            "loss": loss,
            "weights_version": self.version,
            "collector_weight_versions": {str(c): int(v) for c, v in self.acted_version.items()},
            "episodes": self.episodes,
            "mean_return_last10": self.mean_return(),
            "best_mean_return_10": self.best_mean_return if math.isfinite(self.best_mean_return) else None,
            "target_reached_at": self.target_reached_at,
            "evaluations": len(self.evals),
            "wall_s": round(wall, 2),
            "env_steps_per_s": round(self.total_received / max(wall, 1e-9), 1),
            "updates_per_s": round(self.updates / max(wall, 1e-9), 2),
        }
        self._say("final | collector  sent  received  env_steps  version | " + " | ".join(
            f"{c}: {sent.get(c, '?')} {self.received.get(c, 0)} {self.env_steps.get(c, 0)} v{self.acted_version.get(c)}"
            for c in self.collectors) + f" | total sent {sum(sent.values())} received {self.total_received} "
            f"| {'OK' if report['ok'] else 'NOT OK: ' + '; '.join([k for k, v in checks.items() if not v] + self.problems)}")
        for f in self._files:
            f.close()
        report = _json_safe(report)
        if self.report_path:
            tmp = f"{self.report_path}.tmp"
            with open(tmp, "w") as f:
                json.dump(report, f)
            os.replace(tmp, self.report_path)
        return report

    def _open_logs(self) -> None:
        self._files: list[Any] = []
        self.progress_csv = self.episodes_csv = self.evals_csv = None
        if not self.args.log_dir:
            return
        os.makedirs(self.args.log_dir, exist_ok=True)

        def open_csv(name: str, header: list[str]) -> Any:
            f = open(os.path.join(self.args.log_dir, name), "w", newline="")
            self._files.append(f)
            w = csv.writer(f)
            w.writerow(header)
            return (f, w)

        self.progress_csv = open_csv("progress.csv", ["time_s", "env_steps", "updates", "env_steps_per_s",
                                                      "updates_per_s", "weights_version", "max_weight_lag",
                                                      "epsilon", "episodes", "mean_return_10", "loss"])
        self.episodes_csv = open_csv("episodes.csv", ["time_s", "env_steps", "collector", "return", "length",
                                                      "weights_version"])
        self.evals_csv = open_csv("evals.csv", ["time_s", "env_steps", "weights_version", "return", "length"])

    @staticmethod
    def _write(handle: Any, row: list[Any]) -> None:
        if handle is not None:
            handle[1].writerow(row)
            handle[0].flush()

    def _t(self) -> float:
        return time.monotonic() - getattr(self, "t0", time.monotonic())

    @staticmethod
    def _say(line: str) -> None:
        print(line, flush=True)


def _json_safe(obj: Any) -> Any:
    """NaN / inf -> None, so the report is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


# ---------------------------------------------------------------------- collector and evaluator
class _Follower:
    """What collectors and evaluators share: the latest weights from the learner (latest wins)."""

    def __init__(self, ctx: mq.Context, learner: int):
        self.ctx, self.q, self.learner = ctx, ctx.mq, learner
        self._lock = threading.Lock()
        self._latest: dict[str, Any] | None = None
        self.new_weights = threading.Event()
        self.stop = threading.Event()
        self.finished = threading.Event()
        self.weights_received = 0
        self.version = -1
        self.q.subscribe(STOP, lambda m: self.stop.set())
        self.q.subscribe(FINISH, lambda m: self.finished.set())
        self.q.subscribe(WEIGHTS, self._on_weights)  # last: the learner waits for this subscription

    def _on_weights(self, msg: mq.Message) -> None:
        # Runs on mq's handler thread: only keep the newest, never queue a backlog of stale ones.
        with self._lock:
            self.weights_received += 1
            if self._latest is None or msg.payload["version"] > self._latest["version"]:
                self._latest = msg.payload
        self.new_weights.set()

    def first_weights(self, timeout: float) -> dict[str, Any]:
        if not self.new_weights.wait(timeout):
            raise fail(f"node {self.ctx.node_id}: no weights from the learner (node {self.learner}) "
                       f"within {timeout:g}s")
        with self._lock:
            assert self._latest is not None
            return self._latest

    def setup(self, num_envs: int | None = None) -> None:
        """Wait for the first weights; build env and network from the config they carry."""
        w = self.first_weights(node_args(self.ctx).join_timeout)
        self.args = a = cfgmod.from_dict(w["config"])
        torch.set_num_threads(a.torch_threads)
        self.device = _device(a.collector_device)
        self.env = _setup_env(a.env, num_envs or a.num_envs)
        self.qnet = make_qnet(self.env.spec).to(self.device)
        self.qnet.eval()
        self.credit, self.quota = w["credit"], w["quota"]
        self.refresh()

    def refresh(self) -> bool:
        """Load the newest weights if newer than the ones in use; True if it did."""
        with self._lock:
            w = self._latest
            self.new_weights.clear()
        if w is None or w["version"] <= self.version:
            return False
        self.qnet.load_state_dict({k: torch.as_tensor(v) for k, v in w["state"].items()})
        self.version, self.credit = w["version"], w["credit"]
        return True

    def learner_alive(self) -> bool:
        return self.learner in self.q.peers()

    def wait_finished(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.finished.wait(0.1):
            if not self.learner_alive() or time.monotonic() > deadline:
                return


class Collector(_Follower):
    # ---- ALGO LOGIC: act epsilon-greedy, stream transitions
    def run(self) -> None:
        self.setup()
        a, env = self.args, self.env
        rng = np.random.default_rng(a.seed + 7919 * self.ctx.node_id)
        torch.manual_seed(a.seed + self.ctx.node_id)
        obs = env.reset(seed=a.seed + 1000 * self.ctx.node_id)
        self.steps = self.sent = 0
        self.buf: list[tuple[np.ndarray, ...]] = []
        self.episodes: list[tuple[float, int]] = []
        self.epsilon = a.start_e
        quota = self.quota
        stalled_since: float | None = None
        while self.steps < quota and not self.stop.is_set():
            self.refresh()
            if self.credit >= 0 and self.steps + env.num_envs > self.credit:  # paced: wait for the learner
                self.flush()
                stalled_since = stalled_since or time.monotonic()
                if time.monotonic() - stalled_since > a.stall_timeout:
                    raise fail(f"collector {self.ctx.node_id}: no new step credit from the learner for "
                               f"{a.stall_timeout:g}s (at {self.steps} steps, credit {self.credit})")
                if not self.learner_alive():
                    raise fail(f"collector {self.ctx.node_id}: the learner (node {self.learner}) left the job")
                self.new_weights.wait(0.5)
                continue
            stalled_since = None
            self.epsilon = linear_schedule(a.start_e, a.end_e, a.exploration_fraction * quota, self.steps)
            actions = act(self.qnet, obs, self.epsilon, env.spec.n_actions, rng, self.device)
            next_act_obs, next_obs, rewards, terminated, ended = env.step(actions)
            self.buf.append((obs, actions, rewards, next_obs, terminated))
            self.episodes.extend(ended)
            obs = next_act_obs
            self.steps += env.num_envs
            if len(self.buf) >= a.send_every:
                self.flush()
        self.flush()
        self.send(DONE, {"sent": self.sent, "env_steps": self.steps, "version": self.version,
                         "weights_received": self.weights_received,
                         "stopped_early": self.stop.is_set()})
        self.wait_finished(timeout=60.0)
        env.close()

    def flush(self) -> None:
        if not self.buf:
            return
        obs, actions, rewards, next_obs, dones = (np.concatenate(x) for x in zip(*self.buf))
        self.send(TRANSITIONS, {"obs": obs, "actions": actions, "rewards": rewards, "next_obs": next_obs,
                                "dones": dones, "version": self.version, "env_steps": self.steps,
                                "epsilon": self.epsilon, "episodes": self.episodes})
        self.sent += len(actions)
        self.buf, self.episodes = [], []

    def send(self, topic: str, payload: Any) -> None:
        try:
            self.q.send(self.learner, topic, payload, timeout=self.args.stall_timeout)
        except mq.MQError as exc:
            raise fail(f"collector {self.ctx.node_id}: cannot send {topic!r} to the learner "
                       f"(node {self.learner}): {exc}") from None


class Evaluator(_Follower):
    """Plays greedy (eval_epsilon) episodes with the newest weights, at most one per
    eval_interval seconds and per weight version, until the learner finishes."""

    def run(self) -> None:
        self.setup(num_envs=1)
        a, env = self.args, self.env
        rng = np.random.default_rng(a.seed + 7919 * self.ctx.node_id)
        obs = env.reset(seed=a.seed + 1000 * self.ctx.node_id)
        evaluated, started = -1, -math.inf
        while not self.finished.is_set() and self.learner_alive():
            self.refresh()
            if self.version == evaluated or time.monotonic() - started < a.eval_interval:
                self.finished.wait(0.2)
                continue
            evaluated, version, started = self.version, self.version, time.monotonic()
            while not self.finished.is_set():
                actions = act(self.qnet, obs, a.eval_epsilon, env.spec.n_actions, rng, self.device)
                obs, _, _, _, ended = env.step(actions)
                if ended:
                    ret, length = ended[0]
                    try:
                        self.q.send(self.learner, EVAL, {"version": version, "return": ret, "length": length},
                                    timeout=10.0)
                    except mq.MQError:
                        return
                    break
        env.close()
