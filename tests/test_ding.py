"""DI-engine on mq (mq.integrations.ding): DI-engine's own Parallel scenarios and a ditask job,
run on mq's types through DI-engine's unchanged launcher.

DI-engine needs numpy 1.x, so it lives in its own virtual environment, .ding-venv (made by
scripts/ding-env, which .ci/run calls). Every test runs a job under .ding-venv/bin/python in a
subprocess of its own session, bounded, and kills the whole session when it is done or late:
nothing is left behind. Without .ding-venv, or where it cannot import DI-engine, the module
skips and says why.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DING_PY = ROOT / ".ding-venv" / "bin" / "python"
DITASK = ROOT / ".ding-venv" / "bin" / "ditask"


def _why_not() -> str | None:
    if not DING_PY.exists():
        why = ROOT / ".ding-venv" / ".why"
        detail = f": {why.read_text().strip()}" if why.exists() else ""
        return f"no DI-engine environment (.ding-venv): run bash scripts/ding-env{detail}"
    try:
        out = subprocess.run([str(DING_PY), "-c", "import ding.framework, mq.integrations.ding"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return ".ding-venv/bin/python took over 120 s to import ding"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return f".ding-venv cannot import DI-engine with mq.integrations.ding ({last}): run bash scripts/ding-env"
    return None


_WHY = _why_not()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")


def run_job(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``args`` in a session of its own under the DI-engine environment; kill the session
    (DI-engine's spawned workers included) when it ends or runs past ``timeout``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("MQ_SECRET", None)
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(args[-4:])} ran past {timeout} s:\n{out[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # DI-engine's workers, if any outlived the parent
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(args, proc.returncode, out, "")


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


SCENARIOS = ["run", "uncaught_exception", "disconnected", "auto_recover",
             # DI-engine's distributer tests (ding/framework/middleware/tests/test_distributer.py):
             # its ContextExchanger, with and without a StorageLoader (whose forked children must
             # end on terminate). DI-engine's own nng bus fails them on a busy machine (a context
             # emitted before the listener subscribed is lost); mq holds such events.
             "context_exchanger", "context_exchanger_with_storage_loader",
             # not DI-engine's: run's main with the second worker's process 2.5 s late; both
             # must begin main together (a queue pairs with its peers before main starts)
             "late_start"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mq_type", ["mq:nng", "mq:torchrpc:cpu"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ding_parallel_scenarios(scenario: str, mq_type: str) -> None:
    """DI-engine's ding/framework/tests/test_parallel.py, through Parallel.runner(mq_type=...)."""
    out = run_job([str(DING_PY), "-m", "tests.ding_jobs.scenarios", scenario, mq_type], timeout=180)
    assert out.returncode == 0 and f"OK {scenario} {mq_type}" in out.stdout, out.stdout[-6000:]


@pytest.mark.timeout(150)
def test_ditask_two_workers_on_mq_nng() -> None:
    """The README's command: ditask --mq-type mq:nng starts a 2-worker job whose main module
    imports mq.integrations.ding; both workers exchange 1 MiB events over mq."""
    ports = free_ports(2)
    out = run_job([str(DITASK), "--package", "tests/ding_jobs", "--main", "two_workers.main",
                   "--parallel-workers", "2", "--topology", "mesh", "--mq-type", "mq:nng",
                   "--address", "127.0.0.1", "--ports", ",".join(map(str, ports)),
                   "--startup-interval", "0"], timeout=130)
    assert out.returncode == 0, out.stdout[-6000:]
    for me, other in ((0, 1), (1, 0)):
        assert f"DITASK node {me} heard node {other} (1048576 bytes) over MQOnDing_nng" in out.stdout, \
            out.stdout[-6000:]


@pytest.mark.timeout(330)
def test_ding_example_dqn_trains_on_mq_nng(tmp_path: Path) -> None:
    """DI-engine's own distributed DQN (ding.example.dqn: learner, evaluator, 2 collectors
    exchanging contexts and models through ContextExchanger/ModelExchanger) on CartPole under
    ditask --parallel-workers 4 --topology mesh --mq-type mq:nng, through
    python -m mq.integrations.ding (the example's module does not import mq). It stops by
    itself at the evaluation return 195 (about 2,500 env steps here; DI-engine's first exchanges
    can wait 60 s each at start-up, on its own bus too); past 300 s the test asserts what the
    pipeline did by then: the learner trained on collected steps and the evaluator got models."""
    ports = free_ports(4)
    args = [str(DING_PY), "-m", "mq.integrations.ding", "--package", str(tmp_path), "--main",
            "ding.example.dqn.main", "--parallel-workers", "4", "--topology", "mesh", "--mq-type", "mq:nng",
            "--address", "127.0.0.1", "--ports", ",".join(map(str, ports)), "--startup-interval", "0"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
        finished = proc.returncode == 0
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        finished = False
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    import re
    evals = [(int(i), int(e), float(r)) for i, e, r in
             re.findall(r"Evaluation: Train Iter\((\d+)\) Env Step\((\d+)\) Episode Return\(([\d.]+)\)", out)]
    assert evals, out[-6000:]
    best = max(evals, key=lambda t: t[2])
    print(f"dqn on mq:nng: finished={finished}, {len(evals)} evaluations, last {evals[-1]}, best {best}")
    assert evals[-1][0] >= 100 and evals[-1][1] >= 300, out[-6000:]  # models and contexts flowed
    if finished:
        assert best[2] >= 195, out[-6000:]


@pytest.mark.timeout(240)
def test_emit_benchmark_runs_on_every_bus(tmp_path: Path) -> None:
    """The README's emit/on benchmark (tests/ding_jobs/bench.py), tiny: one run, a 0.1 MB model,
    a few samples; a job per bus (DI-engine's nng, mq:nng, mq:torchrpc:cpu) and the table."""
    out_md = tmp_path / "ding-emit.md"
    out = run_job([str(DING_PY), "-m", "tests.ding_jobs.bench", "--runs", "1", "--lat-small", "10",
                   "--lat-model", "3", "--burst-small", "50", "--burst-model", "3", "--bursts", "1",
                   "--model-mb", "0.1", "--wait", "5", "--job-timeout", "70", "--out", str(out_md)],
                  timeout=225)
    assert out_md.exists(), out.stdout[-6000:]
    table = out_md.read_text()
    for bus in ("nng", "mq:nng", "mq:torchrpc:cpu"):
        row = next((line for line in table.splitlines() if line.startswith(f"| `{bus}` |")), None)
        assert row is not None and "failed" not in row, table
    for bus in ("mq:nng", "mq:torchrpc:cpu"):  # mq's buses are lossless
        row = next(line for line in table.splitlines() if line.startswith(f"| `{bus}` |"))
        assert row.rstrip(" |").endswith("0 / 0 / 0 / 0"), table
    assert out.returncode == 0, out.stdout[-6000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mq_type", ["mq:nng", "mq:torchrpc:cpu"])
def test_a_forked_child_of_a_worker_ends_on_terminate(mq_type: str) -> None:
    """DI-engine's StorageLoader forks its children from a worker and stops them with
    terminate(); the worker pool's SIGTERM handler, inherited, turned that into an exception
    the child caught, and shutdown() hung in join() (mq:torchrpc:cpu: 2 runs of 10 under load)."""
    out = run_job([str(DING_PY), "-m", "tests.ding_jobs.forked_child", mq_type], timeout=100)
    assert f"CHILD exitcode={-signal.SIGTERM}" in out.stdout, out.stdout[-4000:]


@pytest.mark.timeout(60)
def test_unknown_mq_type_is_one_clear_error() -> None:
    code = ("import mq.integrations.ding\nfrom ding.framework import Parallel\n"
            "try:\n    Parallel.runner(n_parallel_workers=2, mq_type='mq:zmq')\n"
            "except Exception as e:\n    print('ERR', type(e).__name__, e)\n")
    out = run_job([str(DING_PY), "-c", code], timeout=50)
    assert "ERR ConfigError unknown mq type 'mq:zmq': choose one of mq:nng, mq:torchrpc:cpu, mq:torchrpc:cuda" \
        in out.stdout, out.stdout[-3000:]



def test_torchrpc_across_hosts_without_a_store_is_one_clear_error() -> None:
    """torch RPC's workers pick their own ports (its launch profile binds none of ours), so they
    meet in a rendezvous store: attach_to without torchrun's variables says what to set (the
    runner's argument parser, which DI-engine calls before it starts any worker)."""
    code = ("import os\nimport mq.integrations.ding\nfrom ding.framework import Parallel\n"
            "os.environ.pop('MASTER_ADDR', None)\n"
            "try:\n    mq.integrations.ding._args_parser(Parallel, 2, 'mq:torchrpc:cpu', attach_to='tcp://10.0.0.1:5000')\n"
            "except Exception as e:\n    print('ERR', type(e).__name__, e)\n")
    out = run_job([str(DING_PY), "-c", code], timeout=50)
    assert ("ERR ConfigError mq:torchrpc:cpu across hosts meets in a rendezvous store: set MASTER_ADDR, MASTER_PORT "
            "and WORLD_SIZE") in out.stdout, out.stdout[-3000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
