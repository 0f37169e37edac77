"""Launcher and `mq run`: workers start with their ids and labels, a crash or Ctrl-C stops
them all within seconds, and no process is left behind."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

import mq
from mq.testing import free_port_run, unix_sockets
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
    return [int(p.read_text()) for p in d.glob("*.pid")]


def test_run_starts_workers_with_ids_labels_and_routes():
    r = mq_cli("run", "--main", "tests.jobs.roles:ok", "-n", "3", "--labels", "learner",
               "--labels", "collector", "--labels", "collector")
    assert r.returncode == 0, r.stderr
    lines = sorted(r.stdout.splitlines())
    assert lines[0].startswith("node 0 labels ['learner'] peers [1, 2] routes ['shm']"), lines
    assert lines[1].startswith("node 1 labels ['collector'] peers [0, 2]"), lines


def test_run_static_ports_and_module_dot_func_form():
    base = free_port_run(3)
    r = mq_cli("run", "--main", "tests.jobs.roles.ok", "-n", "2", "--ports", f"{base},{base + 2}",
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


@pytest.mark.parametrize("launcher_sigint", [signal.SIG_DFL, signal.SIG_IGN], ids=["default", "ignored"])
def test_ctrl_c_stops_every_worker(tmp_path, launcher_sigint):
    """Ctrl-C reaches the launcher and its workers at once. "ignored": the launcher ignores
    SIGINT, as a shell without job control leaves it for a background job, so only the
    workers' exit status (130) tells it the job was interrupted (it used to say "failed")."""
    proc = subprocess.Popen([sys.executable, "-m", "mq.cli.main", "run", "--main", "tests.jobs.roles:sleep_forever",
                             "-n", "2"], cwd=REPO, env={**os.environ, "MQ_TEST_PID_DIR": str(tmp_path)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, launcher_sigint))
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


def interrupted_alone(ctx: mq.Context) -> None:
    """Node 1 ends as Ctrl-C ends a worker (exit 130) once node 0 is up, with no signal sent to
    anyone: the launcher hears of the interruption from the worker first. Node 0 waits."""
    from tests.jobs import record_pid

    record_pid(ctx)
    if ctx.node_id != 1:
        time.sleep(600)
        return
    _wait_for_pids(pathlib.Path(os.environ["MQ_TEST_PID_DIR"]), 2)
    raise KeyboardInterrupt


def test_a_worker_interrupted_before_the_launcher_stops_the_job_with_130(tmp_path):
    r = mq_cli("run", "--main", "tests.test_launch:interrupted_alone", "-n", "2",
               env={"MQ_TEST_PID_DIR": str(tmp_path)})
    assert r.returncode == 130, r.stderr
    assert "mq run: stopped by SIGINT (node 1 exited with code 130)" in r.stderr, r.stderr
    assert "worker failed" not in r.stderr
    pids = read_pids(tmp_path)
    assert len(pids) == 2 and wait_dead(pids) == []
    assert not unix_sockets(pids)


def terminated_first(ctx: mq.Context) -> None:
    """SIGTERM reaches node 1 first and the launcher later, while it stops node 0 (scancel
    signals a step's processes one at a time): node 0 sends it on its way out."""
    import atexit

    from tests.jobs import record_pid

    record_pid(ctx)
    if ctx.node_id == 0:
        atexit.register(os.kill, os.getppid(), signal.SIGTERM)
    else:
        _wait_for_pids(pathlib.Path(os.environ["MQ_TEST_PID_DIR"]), 2)
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(600)


def test_sigterm_reaching_a_worker_before_the_launcher_is_a_graceful_stop(tmp_path):
    r = mq_cli("run", "--main", "tests.test_launch:terminated_first", "-n", "2",
               env={"MQ_TEST_PID_DIR": str(tmp_path)})
    assert r.returncode == 143, r.stderr
    assert r.stderr.strip().splitlines()[-1] == ("mq run: stopped by SIGTERM (node 1 exited with code 143); every "
                                                 "worker was told to stop and say goodbye"), r.stderr
    pids = read_pids(tmp_path)
    assert len(pids) == 2 and wait_dead(pids) == []
    assert not unix_sockets(pids)


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
        deadline = time.monotonic() + 20
        while len(unix_sockets(pids)) < 2:
            assert time.monotonic() < deadline, "workers did not listen"
            time.sleep(0.05)
        proc.kill()  # SIGKILL: the launcher cannot clean up; the kernel tells its workers (SIGTERM)
        proc.wait(5)
        assert wait_dead(pids) == [], "workers outlived their launcher"
        assert not unix_sockets(pids), "a worker left its socket"
    finally:
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare(1)")
def test_a_launcher_that_is_pid_1_keeps_its_workers():
    # `mq run` as a container's first process: its workers' parent is pid 1, which is not
    # init's reparenting (before: every worker exited at once, code 1, no message).
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "mq.cli.main",
                        "run", "--main", "tests.jobs.roles:ok", "-n", "2"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert sorted(line.split(" labels")[0] for line in r.stdout.splitlines()) == ["node 0", "node 1"], r.stdout


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
    (["--cuda-device-map", "1_0_1"], "cuda_device_map (--cuda-device-map) is an option of torchrpc, not of mq type 'nng'"),
    (["--mq-type", "torchrpc:cpu", "--cuda-device-map", "1_0_1"], "device maps need torchrpc:cuda"),
    (["--mq-type", "torchrpc:cpu", "--protocol", "tcp"], "protocol (--protocol) is an option of nng, not of mq type 'torchrpc:cpu'"),
    (["--mq-type", "torchrpc:cuda", "--cuda-device-map", "1_0"], "'1_0' is malformed"),
    (["--platform", "mars"], "platform must be local, slurm or k8s"),
    (["--platform", "slurm"], "SLURM"),
    (["--init-method", "http://x:1"], "must start with tcp://, env://, file:// or ray://"),
    (["--parallel-workers", "two"], "'two' is not a valid integer"),
    (["--labels", "a", "--labels", "b", "--labels", "c"], "--labels given 3 times for 1 workers"),
    (["--roles", "learner"], "'learner' is not role:count"),
    (["-n", "2", "--roles", "learner:1,collector:2"], "roles 'learner:1,collector:2' name 3 nodes but the job has 2"),
    (["--address", "no-such-host.invalid"], "host name 'no-such-host.invalid' (from --address) does not resolve"),
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
                   "--init-method", "--local-cuda-devices", "--cuda-device-map", "--busy-poll",
                   "--no-busy-poll", "--platform",
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


# A one-task Slurm step on this machine, as srun would set it (tests/test_slurm.py runs a real one).
SLURM_STEP = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "localhost",
              "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}


@pytest.mark.parametrize("args, env, reason", [
    (["--node-ids", "3"], {}, "--node-ids conflicts with --platform slurm: node ids come from SLURM_PROCID"),
    (["--address", "10.0.0.1"], {}, "--address conflicts with --platform slurm"),
    (["--attach-to", "tcp://10.0.0.1:5000"], {}, "--attach-to conflicts with --platform slurm"),
    (["--ports", "5000,5001"], {}, "--ports with several ports conflicts with --platform slurm"),
    (["--world-size", "8"], {}, "--world-size 8 conflicts with --platform slurm, whose job has 1 nodes"),
    (["--init-method", "tcp://127.0.0.1:29500"], {}, "--init-method conflicts with --platform slurm: nng workers"),
    (["-n", "2", "--labels", "a", "--labels", "b"], {}, "per-worker --labels conflict with --platform slurm"),
    ([], {"SLURM_STEP_NODELIST": "no-such-host.invalid"},
     "host name 'no-such-host.invalid' (from SLURM_STEP_NODELIST) does not resolve"),
    ([], {"SLURM_STEP_ID": "", "SLURM_JOB_NODELIST": "a[1-2]"}, "runs outside a job step"),
    (["-n", "2"], {"SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_LOCALID": "1", "SLURM_PROCID": "1"},
     "srun started 2 tasks on localhost but -n/--parallel-workers 2 runs one launcher per host"),
])
def test_platform_conflicts_and_bad_hosts_are_one_line(args, env, reason):
    t0 = time.monotonic()
    r = mq_cli("run", "--main", "tests.jobs.roles:ok", "--platform", "slurm", *args, env={**SLURM_STEP, **env})
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mq run: error: "), r.stderr
    assert reason in lines[0], lines[0]
    assert time.monotonic() - t0 < 15


def test_port_in_use_is_named_before_any_worker_starts():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = mq_cli("run", "--main", "tests.jobs.roles:ok", "--ports", str(port))
        assert r.returncode == 2, r.stderr
        assert f"port {port} on 127.0.0.1 (node 0) is already in use" in r.stderr
        r = mq_cli("run", "--main", "tests.jobs.roles:ok", "--platform", "slurm", "--ports", str(port), env=SLURM_STEP)
        assert r.returncode == 2 and f"port {port} on localhost (node 0) is already in use" in r.stderr, r.stderr


def test_roles_by_rank_locally():
    r = mq_cli("run", "--main", "tests.jobs.roles:ok", "-n", "3", "--roles", "learner:1,collector:*")
    assert r.returncode == 0, r.stderr
    lines = sorted(r.stdout.splitlines())
    assert lines[0].startswith("node 0 labels ['learner']") and lines[2].startswith("node 2 labels ['collector']")


@pytest.mark.parametrize("mq_type", ["torchrpc:cpu", "nng"])
def test_busy_poll_reaches_every_worker_and_only_when_asked(mq_type):
    def plan(**kw):
        return make_plan("tests.jobs.roles:ok", n_workers=2, mq_type=mq_type, check_network=False, **kw)

    assert all(o["busy_poll"] is False for o in plan(busy_poll=False).options.values())
    assert all("busy_poll" not in o for o in plan().options.values())
    for bad in ("off", 1, 0.5):
        with pytest.raises(mq.ConfigError, match="True or False"):
            plan(busy_poll=bad)


@pytest.mark.parametrize("flag, window", [([], "0.0005"), (["--busy-poll"], "0.0005"), (["--no-busy-poll"], "0.0")])
def test_mq_run_busy_poll_flags_reach_nng_workers(flag, window):
    r = mq_cli("run", "--main", "tests.jobs.roles:waits", "-n", "2", "--mq-type", "nng", *flag)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == [f"node {i} spins up to {window}" for i in (0, 1)]


def test_plan_honours_platform_init_method_for_torchrpc():
    plan = make_plan("tests.jobs.roles:ok", platform="slurm", environ=SLURM_STEP, mq_type="torchrpc:cpu",
                     init_method="tcp://127.0.0.1:29999", check_network=False)
    assert plan.options[0]["init_method"] == "tcp://127.0.0.1:29999"


def start(args: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mq.cli.main", "run", *args], cwd=REPO,
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def finish(*procs: subprocess.Popen, timeout: float = 60) -> list[tuple[int, str, str]]:
    out = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=timeout)
            out.append((p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
    return out


def two_hosts(main: str, env: dict | None = None) -> tuple[subprocess.Popen, subprocess.Popen]:
    """The DI-engine-style launch of two hosts by hand: the learner's host, then the collectors'
    host dialling it; one role spec for both."""
    a = free_port_run(4)  # the learner on a, the three collectors on a+1 .. a+3
    b = a + 1
    common = ["--main", main, "--world-size", "4", "--roles", "learner:1,collector:*", "--protocol", "tcp"]
    learner = start([*common, "-n", "1", "--node-ids", "0", "--ports", str(a)], env)
    collectors = start([*common, "-n", "3", "--node-ids", "1", "--ports", str(b),
                        "--attach-to", f"tcp://127.0.0.1:{a}"], env)
    return learner, collectors


def test_two_launchers_with_one_role_spec():
    import json

    results = finish(*two_hosts("tests.jobs.cluster:learn"))
    assert [code for code, _, _ in results] == [0, 0], results
    nodes = {json.loads(line)["node"]: json.loads(line) for _, out, _ in results for line in out.splitlines()}
    assert {n: info["labels"] for n, info in nodes.items()} == {0: ["learner"], 1: ["collector"],
                                                                 2: ["collector"], 3: ["collector"]}
    assert nodes[0]["result"] == [1, 2, 3]


def test_failure_on_one_launcher_ends_the_other_within_seconds(tmp_path):
    learner, collectors = two_hosts("tests.jobs.cluster:crash_last", {"MQ_TEST_PID_DIR": str(tmp_path)})
    (lc, _, le), (cc, _, ce) = finish(learner, collectors)
    assert cc == 1 and "node 3 exited with code 1" in ce, ce
    assert lc == 1, le
    assert re.search(r"mq run: job aborted: node 3 on \S+ failed \(RuntimeError: node 3 exploded on purpose\)", le), le
    pids = read_pids(tmp_path)
    assert len(pids) == 4 and wait_dead(pids) == []
    assert not unix_sockets(pids)


def _wait_for_pids(d, n: int, timeout: float = 40) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(read_pids(d)) < n and time.monotonic() < deadline:  # pid files appear whole (os.replace)
        time.sleep(0.05)
    pids = read_pids(d)
    assert len(pids) == n, "workers did not start"
    return pids


def test_sigterm_is_a_graceful_stop_that_leaves_no_socket(tmp_path):
    proc = start(["--main", "tests.jobs.cluster:wait_forever", "-n", "2"], {"MQ_TEST_PID_DIR": str(tmp_path)})
    pids = _wait_for_pids(tmp_path, 2)
    deadline = time.monotonic() + 20
    while len(unix_sockets(pids[:2])) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)  # the launcher only, as kubelet does; scancel: tests/test_slurm.py
    [(code, _, err)] = finish(proc, timeout=30)
    assert code == 143, err
    assert "mq run: stopped by SIGTERM" in err
    assert time.monotonic() - t0 < 8
    assert wait_dead(pids) == []
    assert not unix_sockets(pids)


def test_sigkilled_worker_stops_the_job_and_its_socket_is_removed(tmp_path):
    proc = start(["--main", "tests.jobs.cluster:wait_forever", "-n", "3"], {"MQ_TEST_PID_DIR": str(tmp_path)})
    _wait_for_pids(tmp_path, 3)
    victim = int((tmp_path / "1.pid").read_text())
    deadline = time.monotonic() + 20
    while not unix_sockets([victim]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(victim, signal.SIGKILL)
    [(code, _, err)] = finish(proc, timeout=30)
    assert code == 1 and "node 1 exited with signal SIGKILL" in err, err
    pids = read_pids(tmp_path)
    assert wait_dead(pids) == []
    assert not unix_sockets(pids)


def test_failed_worker_exits_promptly_despite_a_stuck_handler(tmp_path):
    t0 = time.monotonic()
    r = mq_cli("run", "--main", "tests.jobs.cluster:stuck_handler", "-n", "2", env={"MQ_TEST_PID_DIR": str(tmp_path)})
    took = time.monotonic() - t0
    assert r.returncode == 1 and "failed while a handler is stuck" in r.stderr, r.stderr
    assert took < 25, f"{took:.0f}s: the failed worker waited on its stuck handler thread"
    assert wait_dead(read_pids(tmp_path)) == []


@pytest.mark.parametrize("mq_type", ["nng", "torchrpc:cpu"])
def test_k8s_torchrun_environment_meets_through_master(mq_type):
    """Two "pods" with PyTorchJob's variables (MASTER_ADDR/PORT, WORLD_SIZE, RANK) on loopback."""
    import json

    base = free_port_run(5)  # each pod's two workers listen on port and port+1; the store on base+4
    master = base + 4
    pods = []
    for rank, port in enumerate([base, base + 2]):
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master), "WORLD_SIZE": "2", "RANK": str(rank),
               "POD_IP": "127.0.0.1", "DI_NODES": ""}
        pods.append(start(["--platform", "k8s", "--mq-type", mq_type, "--main", "tests.jobs.cluster:learn",
                           "-n", "2", "--ports", str(port), "--roles", "learner:1,collector:*"], env))
    results = finish(*pods, timeout=80)
    assert [code for code, _, _ in results] == [0, 0], results
    nodes = {json.loads(line)["node"]: json.loads(line) for _, out, _ in results
             for line in out.splitlines() if line.startswith("{")}
    assert sorted(nodes) == [0, 1, 2, 3]
    assert nodes[0]["labels"] == ["learner"] and nodes[0]["result"] == [1, 2, 3]
    assert all(nodes[n]["peers"] == [p for p in range(4) if p != n] for n in nodes)


def test_launch_api_takes_a_role_spec(capfd):
    mq.launch("tests.jobs.cluster:learn", n_workers=3, roles="learner:1,collector:*")
    out = capfd.readouterr().out
    assert '"node": 0, "labels": ["learner"]' in out and out.count('"labels": ["collector"]') == 2


def test_the_inproc_type_cannot_be_launched_and_says_why():
    with pytest.raises(mq.errors.ConfigError, match="cannot be launched .its nodes live in one process"):
        make_plan("tests.jobs.roles:ok", n_workers=2, mq_type="inproc", check_network=False)


def test_a_port_given_to_two_workers_is_a_config_error_before_any_starts():
    with pytest.raises(mq.ConfigError, match=r"--ports gives port\(s\) \[47411\] to more than one worker"):
        make_plan("tests.jobs.roles:ok", n_workers=3, ports=[47411, 47412, 47411], check_network=False)
    r = mq_cli("run", "--main", "tests.jobs.roles:ok", "-n", "2", "--ports", "47411,47411")
    assert r.returncode != 0 and "to more than one worker" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_mq_run_says_where_to_watch_the_job():
    r = mq_cli("run", "--main", "tests.jobs.roles:ok", "-n", "2", "--mq-type", "nng")
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stderr.splitlines() if "mq top --attach-to tcp://" in line]
    assert len(said) == 1 and said[0].startswith("mq run: node 0 listens on tcp://"), r.stderr


def test_the_ports_a_launch_picks_are_different_even_when_two_picks_are_the_same():
    """Two free-port picks can return the same port (CI once got it: node 1 'already in use')."""
    from mq.backend import LocalJob

    picks = iter([24389, 24389, 24390, 24389, 24391])
    job = LocalJob(node_ids=[0, 1, 2], world_size=3, topology="mesh", address="127.0.0.1", ports=[], attach_to=[],
                   init_method=None, pick_port=lambda _host: next(picks))
    assert job.pick_ports(3) == [24389, 24390, 24391]
    same = LocalJob(**{**job.__dict__, "pick_port": lambda _host: 24389})
    with pytest.raises(mq.ConfigError, match="could not find 2 different free ports"):
        same.pick_ports(2)
    from mq.registry import backend_for

    repeating = LocalJob(**{**job.__dict__, "pick_port": lambda _host, seq=iter([30001, 30001, 30002, 30003]): next(seq)})
    listen = [o["listen_to"] for o in backend_for("nng").launch.local_options(repeating).values()]
    assert sorted(listen) == [f"tcp://127.0.0.1:{p}" for p in (30001, 30002, 30003)], listen


def test_mq_run_keeps_each_workers_lines_whole_and_says_whose_they_are():
    r = mq_cli("run", "--main", "tests.jobs.roles:chatty", "-n", "3", "--mq-type", "nng")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 60, r.stdout
    for line in lines:
        m = re.fullmatch(r"\[node (\d)\] piece \d+ of node (\d) end", line)
        assert m and m.group(1) == m.group(2), f"a line run together or without its node: {line!r}"
    for n in range(3):
        assert f"[node {n}] stderr of node {n}" in r.stderr.splitlines(), r.stderr
    raw = mq_cli("run", "--main", "tests.jobs.roles:chatty", "-n", "1", "--mq-type", "nng", "--no-prefix")
    assert raw.returncode == 0 and raw.stdout.splitlines()[0] == "piece 0 of node 0 end", raw.stdout
