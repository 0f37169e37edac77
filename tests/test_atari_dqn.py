"""examples/atari_dqn: the distributed DQN example, run as users run it (subprocesses, real
processes, real messaging): --smoke on every mq type, a CartPole learning run through the same
distributed code path, a job started one node at a time (the `mq run` way), and bad setups.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# CartPole transition budget for the learning test. Measured with exactly the command of the
# test (2-core VM, nng, 2 collectors, --total-steps 15000 --target-return 100, seeds 1-20): the
# mean return of the last 10 episodes first reached 100 after 3,384-4,384 env steps (median
# 3,824); with --total-steps 60000 (slower epsilon decay) after 4,624-6,864. The learner paces
# the collectors to one update per 2 env steps, so this does not depend on the machine's speed.
# 15,000 is 3.4x the worst seed; the run stops at the target, so the margin costs no time.
CARTPOLE_BUDGET = 15_000


def _have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _torchrpc_available() -> bool:
    try:
        importlib.import_module("mq.backends.torchrpc.transport")
    except Exception:
        return False
    return True


needs_atari = pytest.mark.skipif(not (_have("gymnasium") and _have("ale_py")),
                                 reason="the Atari extra is not installed: pip install mq[atari]")
needs_gym = pytest.mark.skipif(not _have("gymnasium"), reason="gymnasium is not installed: pip install mq[atari]")
needs_torchrpc = pytest.mark.skipif(not _torchrpc_available(),
                                    reason="mq.backends.torchrpc does not import yet")


def _env(extra_path: str | None = None, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    paths = [p for p in (extra_path, str(ROOT), env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(extra)
    return env


def run_example(*args: str, timeout: float, extra_path: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "examples.atari_dqn", *args], cwd=ROOT, env=_env(extra_path),
                          capture_output=True, text=True, timeout=timeout)


def last_json(p: subprocess.CompletedProcess) -> dict:
    lines = p.stdout.strip().splitlines()
    assert lines, f"no output; stderr:\n{p.stderr[-4000:]}"
    return json.loads(lines[-1])


def explain(p: subprocess.CompletedProcess) -> str:
    return f"exit {p.returncode}\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"


def assert_counts_match(report: dict, n_collectors: int) -> None:
    sent = report["transitions_sent"]
    assert len(sent) == n_collectors, report
    assert report["transitions_received"] == sum(sent.values()) > 0, report
    assert report["transitions_received_per_collector"] == sent, report


# ---------------------------------------------------------------------- smoke, every mq type
@needs_atari
@pytest.mark.timeout(150)
@pytest.mark.parametrize("mq_type", [
    "nng",
    pytest.param("torchrpc:cpu", marks=needs_torchrpc),
    pytest.param("torchrpc:cuda", marks=[pytest.mark.cuda, needs_torchrpc]),
])
def test_smoke(mq_type):
    p = run_example("--smoke", "--mq-type", mq_type, timeout=140)
    assert p.returncode == 0, explain(p)
    r = last_json(p)
    assert r["ok"] is True and r["mq_type"] == mq_type and r["env"] == "ALE/Pong-v5"
    assert_counts_match(r, 2)
    assert r["learner_updates"] > 0
    assert isinstance(r["loss"], float) and math.isfinite(r["loss"])
    versions = r["collector_weight_versions"]
    assert set(versions) == set(r["transitions_sent"]) and all(v >= 1 for v in versions.values()), r
    # RL channels: policy lag of the weights channel, per-topic metrics from q.metrics()
    lag = r["policy_lag"]
    assert 0 <= lag["mean"] <= lag["max"] <= r["weights_version"], lag
    topics = r["metrics"]["topics"]
    assert topics["weights"]["sent"] >= 2, topics["weights"]  # superseded versions are skipped
    # every transitions message arrived (plus one end marker per collector)
    messages = r["transition_messages"]
    assert topics["transitions"]["received"] == sum(m["sent"] + 1 for m in messages.values()), (topics, messages)


# ---------------------------------------------------------------------- learning
@needs_gym
@pytest.mark.timeout(240)
def test_cartpole_learns_within_budget(tmp_path):
    p = run_example("--env", "CartPole-v1", "--collectors", "2", "--seed", "1", "--total-steps", str(CARTPOLE_BUDGET),
                    "--target-return", "100", "--log-dir", str(tmp_path), timeout=230)
    assert p.returncode == 0, explain(p)
    r = last_json(p)
    assert_counts_match(r, 2)
    assert r["best_mean_return_10"] is not None and r["best_mean_return_10"] >= 100, r
    assert r["target_reached_at"] is not None and r["target_reached_at"] <= CARTPOLE_BUDGET, r
    assert r["transitions_received"] <= CARTPOLE_BUDGET
    episodes = (tmp_path / "episodes.csv").read_text().splitlines()
    assert episodes[0].startswith("time_s,env_steps,collector,return") and len(episodes) > 10
    assert (tmp_path / "progress.csv").exists()
    assert "env steps" in p.stdout and "updates" in p.stdout  # live progress lines


# ---------------------------------------------------------------------- one launch per node
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_gym
@pytest.mark.timeout(150)
@pytest.mark.parametrize("mq_type", ["nng", pytest.param("torchrpc:cpu", marks=needs_torchrpc)])
def test_mq_run_one_command_per_node(tmp_path, mq_type):
    """The several-machines recipe of the README, on one machine: one `mq run` per node; only the
    learner gets the example's flags (after --), collectors take the config from the learner."""
    init = f"tcp://127.0.0.1:{_free_port()}"
    report = tmp_path / "report.json"
    procs = []
    try:
        for node, label in ((0, "learner"), (1, "collector"), (2, "collector")):
            cmd = [sys.executable, "-m", "mq.cli.main", "run", "--main", "examples.atari_dqn.roles:main",
                   "--labels", label, "--node-ids", str(node), "--world-size", "3", "--init-method", init,
                   "--mq-type", mq_type]
            if label == "learner":
                cmd += ["--", "--env", "CartPole-v1", "--total-steps", "3000", "--log-every", "2",
                        "--report", str(report)]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=130) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"exit {p.returncode}\n{out[-3000:]}\n{err[-3000:]}"
    r = json.loads(report.read_text())
    assert r["ok"] is True and r["mq_type"] == mq_type, r
    assert_counts_match(r, 2)
    assert r["transitions_received"] == 3000
    assert "final |" in outs[0][0]  # the learner's summary line


# ---------------------------------------------------------------------- bad setups
def _one_error_line(p: subprocess.CompletedProcess) -> str:
    lines = [line for line in p.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, explain(p)
    assert lines[0].startswith("error: "), explain(p)
    return lines[0]


@needs_atari
@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, expected", [
    (["--roles", "collector,collector"], "no learner in the job"),
    (["--roles", "learner,learner,collector"], "2 learners in the job"),
    (["--roles", "learner"], "no collector in the job"),
    (["--env", "NoSuchEnv-v0"], "unknown env id 'NoSuchEnv-v0'"),
    (["--env", "ALE/NoSuchGame-v5"], "unknown env id 'ALE/NoSuchGame-v5'"),
    (["--mq-type", "carrier-pigeon"], "unknown mq type 'carrier-pigeon'"),
])
def test_bad_setup_one_line(args, expected):
    p = run_example(*args, timeout=50)
    assert p.returncode == 2, explain(p)
    assert expected in _one_error_line(p)
    assert p.stdout.strip() == ""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hidden, args", [("ale_py", ["--smoke"]), ("gymnasium", ["--env", "CartPole-v1"])])
def test_atari_extra_missing(tmp_path, hidden, args):
    """A package of the extra that cannot be imported (shadowed here) names the extra to install."""
    (tmp_path / hidden).mkdir()
    (tmp_path / hidden / "__init__.py").write_text(f"raise ImportError('No module named {hidden}', name='{hidden}')\n")
    p = run_example(*args, timeout=50, extra_path=str(tmp_path))
    assert p.returncode == 2, explain(p)
    line = _one_error_line(p)
    assert "pip install mq[atari]" in line and hidden.replace("_", "-") in line


@needs_gym
@pytest.mark.timeout(90)
@pytest.mark.parametrize("labels, expected", [
    (["collector", "collector"], "error: no learner in the job"),
    (["learner", "learner", "collector"], "error: 2 learners in the job"),
])
def test_bad_job_found_by_the_nodes(labels, expected):
    """Started without the launcher's check (as with `mq run` on several machines), the nodes
    themselves find the bad job, say so in one line and fail."""
    code = (f"import mq; mq.launch('examples.atari_dqn.roles:main', n_workers={len(labels)}, labels={labels!r}, "
            "args={'config': {'env': 'CartPole-v1', 'join_timeout': 30}})")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=80)
    assert p.returncode != 0, explain(p)
    # (each line of a worker starts with its node, as mq run prints it: "[node 0] error: ...")
    assert any(re.sub(r"^\[node \d+\] ", "", line).startswith(expected) for line in p.stderr.splitlines()), explain(p)
