"""Launcher and `mq run`: workers start with their ids and labels, a crash or Ctrl-C stops
them all within seconds, and no process is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import mq
from mq.launch import make_plan, parse_labels

pytestmark = pytest.mark.timeout(90)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mq_cli(*args: str, timeout: float = 60, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mq.cli.main", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})}, **kw)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def wait_dead(pids: list[int], timeout: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [p for p in pids if alive(p)]
        if not pids:
            return []
        time.sleep(0.1)
    return pids


def read_pids(d) -> list[int]:
    return [int(p.read_text()) for p in d.iterdir()]


def test_run_starts_workers_with_ids_labels_and_routes():
    r = mq_cli("run", "--main", "tests.jobs.roles:ok", "-n", "3", "--labels", "learner",
               "--labels", "collector", "--labels", "collector")
    assert r.returncode == 0, r.stderr
    lines = sorted(r.stdout.splitlines())
    assert lines[0].startswith("node 0 labels ['learner'] peers [1, 2] routes ['ipc']"), lines
    assert lines[1].startswith("node 1 labels ['collector'] peers [0, 2]"), lines


def test_run_static_ports_and_module_dot_func_form():
    from mq.launch import free_port

    base = free_port()
    r = mq_cli("run", "--main", "tests.jobs.roles.ok", "-n", "2", "--ports", f"{base},{free_port()}",
               "--protocol", "tcp", "--topology", "star")
    assert r.returncode == 0, r.stderr
    assert "routes ['tcp']" in r.stdout


def test_crashing_worker_stops_the_others_and_fails_the_run(tmp_path):
    t0 = time.monotonic()
    r = mq_cli("run", "--main", "tests.jobs.roles:crash_one", "-n", "3", env={"MQ_TEST_PID_DIR": str(tmp_path)})
    took = time.monotonic() - t0
    assert r.returncode == 1
    assert "collector exploded on purpose" in r.stderr and "Traceback" in r.stderr
    assert "node 1 exited with code 1" in r.stderr
    assert took < 30, f"the other workers were not stopped promptly ({took:.0f}s)"
    assert len(read_pids(tmp_path)) == 3
    assert wait_dead(read_pids(tmp_path)) == []


def test_ctrl_c_stops_every_worker(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "mq.cli.main", "run", "--main", "tests.jobs.roles:sleep_forever",
                             "-n", "2"], cwd=REPO, env={**os.environ, "MQ_TEST_PID_DIR": str(tmp_path)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 40
        while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = read_pids(tmp_path)
        assert len(pids) == 2, "workers did not start"
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends on Ctrl-C
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 130, err
        assert wait_dead(pids) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def test_killed_launcher_leaves_no_orphans(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "mq.cli.main", "run", "--main", "tests.jobs.roles:sleep_forever",
                             "-n", "2"], cwd=REPO, env={**os.environ, "MQ_TEST_PID_DIR": str(tmp_path)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 40
        while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = read_pids(tmp_path)
        proc.kill()  # SIGKILL: the launcher cannot clean up, the kernel must
        proc.wait(5)
        assert wait_dead(pids) == [], "workers outlived their launcher"
    finally:
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.parametrize("args, reason", [
    (["--mq-type", "zmq"], "unknown mq type 'zmq'"),
    (["--parallel-workers", "0"], "number of workers must be >= 1"),
    (["--main", "no_such_module_xyz:main"], "cannot import module 'no_such_module_xyz'"),
    (["--main", "tests.jobs.roles:missing"], "has no function 'missing'"),
    (["--main", "justaname"], "must look like module:func"),
    (["--attach-to", "10.0.0.1:5000"], "must start with one of tcp://"),
    (["--attach-to", "tcp://hostonly"], "needs a host and a port"),
    (["--topology", "ring"], "topology must be one of mesh, star, alone"),
    (["--protocol", "udp"], "protocol must be auto, tcp or ipc"),
    (["--node-ids", "0,x"], "'x' is not a non-negative integer"),
    (["--ports", "5000,5001"], "gives 2 ports for 1 workers"),
    (["--cuda-device-map", "1_0_1"], "device maps need torchrpc:cuda"),
    (["--mq-type", "torchrpc:cuda", "--cuda-device-map", "1_0"], "'1_0' is malformed"),
    (["--platform", "mars"], "platform must be local, slurm or k8s"),
    (["--platform", "slurm"], "SLURM"),
    (["--init-method", "http://x:1"], "must start with tcp://, env:// or file://"),
    (["--parallel-workers", "two"], "'two' is not a valid integer"),
    (["--labels", "a", "--labels", "b", "--labels", "c"], "--labels given 3 times for 1 workers"),
])
def test_bad_options_exit_nonzero_with_one_line(args, reason):
    base = ["run", "--main", "tests.jobs.roles:ok"]
    r = mq_cli(*base, *args, env={k: "" for k in os.environ if k.startswith("SLURM")})
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert reason in lines[0], lines[0]
    assert lines[0].startswith("mq run: error: ")


def test_help_documents_every_option():
    r = mq_cli("run", "--help")
    assert r.returncode == 0
    for option in ["--package", "--main", "--parallel-workers", "--mq-type", "--topology", "--protocol",
                   "--address", "--ports", "--attach-to", "--node-ids", "--labels", "--world-size",
                   "--init-method", "--local-cuda-devices", "--cuda-device-map", "--platform",
                   "--startup-interval", "--log-level"]:
        assert option in r.stdout, option


def test_launch_api_raises_launch_error_naming_the_node(tmp_path):
    with pytest.raises(mq.LaunchError, match="node 1 exited with code 1") as info:
        mq.launch("tests.jobs.roles:crash_one", n_workers=2, args={"pid_dir": str(tmp_path)})
    assert info.value.failures == {1: 1}
    assert wait_dead(read_pids(tmp_path)) == []


def test_launch_rejects_unimportable_main_before_starting_anything():
    def local_main(ctx):
        pass

    with pytest.raises(mq.ConfigError, match="module-level function"):
        mq.launch(local_main, n_workers=2)


@pytest.mark.parametrize("labels, expected", [
    ("learner", {0: ["learner"], 1: ["learner"]}),
    ("a,b", {0: ["a", "b"], 1: ["a", "b"]}),
    (["learner", "collector"], {0: ["learner"], 1: ["collector"]}),
    ({0: "learner"}, {0: ["learner"], 1: []}),
    ({"x"}, {0: ["x"], 1: ["x"]}),
    (lambda n: "learner" if n == 0 else "collector", {0: ["learner"], 1: ["collector"]}),
    (None, {0: [], 1: []}),
])
def test_labels_forms(labels, expected):
    assert parse_labels(labels, [0, 1]) == expected


def test_plan_slurm_from_recorded_environment():
    env = {"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "gpu[01-02]",
           "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
           "SLURM_NODEID": "1"}
    plan = make_plan("tests.jobs.roles:ok", n_workers=2, platform="slurm", environ=env,
                     roles="learner:1,collector:*", check_network=False)
    assert plan.node_ids == [2, 3] and plan.world_size == 4
    assert plan.options[2]["listen_to"].startswith("tcp://gpu02:")
    assert any("gpu01" in a for a in plan.options[2]["attach_to"])
    assert plan.labels == {2: ["collector"], 3: ["collector"]}
    per_task = make_plan("tests.jobs.roles:ok", platform="slurm", environ=dict(env, SLURM_STEP_TASKS_PER_NODE="2(x2)",
                         SLURM_PROCID="0", SLURM_NODEID="0"), roles="learner:1,collector:*",
                         mq_type="torchrpc:cpu", check_network=False)
    assert per_task.node_ids == [0] and per_task.world_size == 4 and per_task.labels == {0: ["learner"]}
    assert per_task.options[0] == {"init_method": "tcp://gpu01:50514", "world_size": 4}
