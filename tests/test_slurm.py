"""`mq run --platform slurm` under a real Slurm: munge, slurmctld and two slurmd "nodes" on
this machine (Slurm's multiple-slurmd mode: ``slurmd -N <node>``).

The two node names resolve, through /etc/hosts lines this module adds and removes, to two
loopback addresses, so the workers of each "host" listen on their own address exactly as on
two machines. Debian's slurm-wlm and munge are installed with apt-get when missing (root
only); without them, or without root, every test skips with the reason.

Checked for nng and torchrpc:cpu, in both forms a user types (one worker per task; one
launcher per host with -n) through srun and sbatch: node ids, roles by rank, peers, routes,
results and exit codes; a raising worker ends the whole step, non-zero, within seconds and
without --kill-on-bad-exit; scancel leaves no process, socket file or shared memory. The
fixture kills the daemons and removes their state, the /etc/hosts lines and its jobs.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mq.testing import free_port_run, unix_sockets

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parent.parent
MQ = [sys.executable, "-m", "mq.cli.main", "run", "--platform", "slurm"]
DAEMONS = ("slurmctld", "slurmd", "srun", "sbatch", "scancel", "sinfo", "munged")
HOSTS_FILE = Path("/etc/hosts")


# --------------------------------------------------------------------------------------------
# The cluster


def _ensure_slurm() -> str | None:
    """None when Slurm and munge are usable, else why not (the skip reason)."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root on Linux to start munged, slurmctld and slurmd"
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    if all(shutil.which(b, path=path) for b in DAEMONS):
        return None
    if not shutil.which("apt-get"):
        return "slurm-wlm and munge are not installed and there is no apt-get to install them"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # Within the first test's timeout (240 s); .ci/run installs them before pytest starts.
    try:
        lists = Path("/var/lib/apt/lists")
        if not lists.is_dir() or not any("_Packages" in p.name for p in lists.iterdir()):
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=60, check=False)
        r = subprocess.run(["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"], env=env,
                           capture_output=True, text=True, timeout=160, check=False)
    except subprocess.TimeoutExpired:
        return "installing slurm-wlm and munge with apt-get took too long"
    if r.returncode != 0:
        return f"apt-get install slurm-wlm munge failed: {r.stderr.strip()[-300:]}"
    missing = [b for b in DAEMONS if not shutil.which(b, path=path)]
    return f"still missing after apt-get: {', '.join(missing)}" if missing else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """A two-node Slurm cluster in ``state`` (config, logs, spool, munge key and socket)."""

    def __init__(self, state: Path):
        self.state = state
        self.tag = secrets.token_hex(3)
        self.nodes = [f"mqs{self.tag}n1", f"mqs{self.tag}n2"]
        subnet = secrets.randbelow(200) + 20
        self.addresses = {self.nodes[0]: f"127.{subnet}.7.1", self.nodes[1]: f"127.{subnet}.7.2"}
        self.conf = state / "slurm.conf"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        self.env.update(SLURM_CONF=str(self.conf), PATH=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin",
                        PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")

    # ---- lifecycle
    def start(self) -> None:
        self._add_hosts()
        key = self.state / "munge.key"
        key.write_bytes(secrets.token_bytes(128))
        key.chmod(0o600)
        self._run(["munged", "--force", f"--socket={self.state / 'munge.sock'}", f"--key-file={key}",
                   f"--pid-file={self.state / 'munged.pid'}", f"--log-file={self.state / 'munged.log'}",
                   f"--seed-file={self.state / 'munge.seed'}"])
        ports = [_free_port() for _ in range(3)]
        (self.state / "spool").mkdir()
        (self.state / "ctld").mkdir()
        self.conf.write_text(_SLURM_CONF.format(state=self.state, ctld=ports[0], n1=self.nodes[0],
                                                n2=self.nodes[1], p1=ports[1], p2=ports[2]))
        self._run(["slurmctld", "-i", "-f", str(self.conf)])
        for node in self.nodes:
            self._run(["slurmd", "-f", str(self.conf), "-N", node])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = self._run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout
            if out.count("idle") == 2:
                return
            time.sleep(0.3)
        raise RuntimeError(f"slurm nodes did not become idle: {out!r}; see logs in {self.state}")

    def stop(self) -> None:
        self._run(["scancel", "--full", "--quiet", "-u", "root"], check=False)
        time.sleep(0.5)
        for name in ["slurmd-" + n for n in self.nodes] + ["slurmctld", "munged"]:
            pidfile = self.state / f"{name}.pid"
            try:
                pid = int(pidfile.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            _kill(pid)
        self._remove_hosts()
        shutil.rmtree(self.state, ignore_errors=True)

    def _add_hosts(self) -> None:
        lines = "".join(f"{ip} {name} # mq-test-{self.tag}\n" for name, ip in self.addresses.items())
        text = HOSTS_FILE.read_text()
        # Written in place: in containers /etc/hosts is a bind mount that cannot be replaced.
        HOSTS_FILE.write_text(text + ("" if text.endswith("\n") else "\n") + lines)

    def _remove_hosts(self) -> None:
        text = HOSTS_FILE.read_text()
        kept = [line for line in text.splitlines(keepends=True) if f"# mq-test-{self.tag}" not in line]
        HOSTS_FILE.write_text("".join(kept))

    def _run(self, cmd: list[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout, cwd=self.state)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
        return r

    # ---- jobs
    def srun(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(["srun", *args], env=self.env, cwd=REPO, capture_output=True, text=True,
                              timeout=timeout)

    def sbatch(self, script: str, *args: str, timeout: float = 150) -> tuple[int, str, str, str]:
        """Submit ``script`` (bash lines) and wait for it; returns (exit code, out, err, job id)."""
        out_dir = Path(self.state) / f"job-{secrets.token_hex(3)}"
        out_dir.mkdir()
        path = out_dir / "job.sh"
        path.write_text("#!/bin/bash\n" + script + "\n")
        r = subprocess.run(["sbatch", "--parsable", "-W", "-D", str(REPO), "-o", str(out_dir / "out"),
                            "-e", str(out_dir / "err"), *args, str(path)], env=self.env, capture_output=True,
                           text=True, timeout=timeout)
        job = r.stdout.strip().split(";")[0]
        return (r.returncode, (out_dir / "out").read_text(), (out_dir / "err").read_text(), job)


_SLURM_CONF = """\
ClusterName=mqtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={state}/munge.sock
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
ReturnToService=2
SlurmUser=root
SlurmdUser=root
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd-%n.pid
SlurmdSpoolDir={state}/spool/%n
StateSaveLocation={state}/ctld
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/slurmd-%n.log
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
KillWait=20
MinJobAge=5
InactiveLimit=0
NodeName={n1} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p1} CPUs=4 State=UNKNOWN
NodeName={n2} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p2} CPUs=4 State=UNKNOWN
PartitionName=mqtest Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def _kill(pid: int, grace: float = 5.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    if _alive(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):  # (it may exit between open and read)
        return False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = _ensure_slurm()
    if reason:
        pytest.skip(reason)
    state = tmp_path_factory.mktemp("slurm")
    state.chmod(0o755)
    c = Cluster(state)
    try:
        c.start()
    except Exception as exc:
        c.stop()
        pytest.skip(f"could not start a Slurm cluster on this machine: {exc}")
    yield c
    c.stop()


# --------------------------------------------------------------------------------------------
# Helpers


def nodes_of(stdout: str) -> dict[int, dict]:
    """The JSON line each node of tests.jobs.cluster printed, by node id."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            info = json.loads(line)
            out[info["node"]] = info
    return out


def check_learner_and_collectors(stdout: str, hosts: dict[int, str]) -> None:
    nodes = nodes_of(stdout)
    assert sorted(nodes) == [0, 1, 2, 3], stdout
    for n, info in nodes.items():
        assert info["world"] == 4
        assert info["host"] == hosts[n], (n, info)
        assert info["peers"] == [p for p in range(4) if p != n], info
        assert info["routes"] and set(info["routes"]) <= {"ipc", "shm", "tcp"}, info
        assert info["labels"] == (["learner"] if n == 0 else ["collector"]), info
    assert nodes[0]["result"] == [1, 2, 3]
    assert [nodes[n]["result"] for n in (1, 2, 3)] == [1, 4, 9]
    assert all(nodes[n]["learners"] == [0] for n in (1, 2, 3))


def run_args(c: Cluster, mq_type: str, main: str, *extra: str) -> list[str]:
    return [*MQ, "--mq-type", mq_type, "--ports", str(free_port_run(6) + 1), "--main", main, *extra]  # base-1 (store) .. base+4


def sockets_of(pids) -> list[str]:
    return unix_sockets(pids)


class Streamed:
    """A running command whose stdout lines are read as they come (to time from "all ready")."""

    def __init__(self, cmd: list[str], env: dict, cwd: Path):
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self.err = ""
        self._out = threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")))
        self._err = threading.Thread(target=self._read_err)
        self._out.start()
        self._err.start()

    def _read_err(self) -> None:
        self.err = self.proc.stderr.read()

    def wait_nodes(self, count: int, timeout: float) -> dict[int, dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            nodes = nodes_of("".join(self.lines))
            if len(nodes) >= count:
                return nodes
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"{count} nodes did not start: {self.lines} {self.err}")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
            self._out.join(5)
            self._err.join(5)


# --------------------------------------------------------------------------------------------
# Tests


def test_srun_one_worker_per_task_nng(cluster):
    n1, n2 = cluster.nodes
    r = cluster.srun("-N2", "-n4",
                     *run_args(cluster, "nng", "tests.jobs.cluster:learn", "--roles", "learner:1,collector:*"))
    assert r.returncode == 0, r.stderr
    # Two hosts with 4 CPUs each: Slurm's block distribution packs 3 tasks on the first.
    check_learner_and_collectors(r.stdout, {0: n1, 1: n1, 2: n1, 3: n2})


def test_srun_one_launcher_per_host_torchrpc(cluster):
    n1, n2 = cluster.nodes
    r = cluster.srun("-N2", "--ntasks-per-node=1",
                     *run_args(cluster, "torchrpc:cpu", "tests.jobs.cluster:learn", "-n", "2",
                               "--roles", "learner:1,collector:*"))
    assert r.returncode == 0, r.stderr
    check_learner_and_collectors(r.stdout, {0: n1, 1: n1, 2: n2, 3: n2})


def test_sbatch_both_forms_both_mq_types(cluster):
    # Inside an allocation srun inherits its task count, so the per-host form names -n too.
    n1, n2 = cluster.nodes
    roles = "--roles 'learner:1,collector:*'"
    per_host = " ".join(run_args(cluster, "nng", "tests.jobs.cluster:learn", "-n", "2"))
    per_task = " ".join(run_args(cluster, "torchrpc:cpu", "tests.jobs.cluster:learn"))
    per_host_out = cluster.state / "per_host.out"
    script = (f"srun --ntasks-per-node=1 -n 2 {per_host} {roles} > {per_host_out} || exit 11\n"
              f"srun -n 4 {per_task} {roles} || exit 12\n")
    code, out, err, _ = cluster.sbatch(script, "-N2", "--ntasks-per-node=2")
    assert code == 0, err
    check_learner_and_collectors(per_host_out.read_text(), {0: n1, 1: n1, 2: n2, 3: n2})
    check_learner_and_collectors(out, {0: n1, 1: n1, 2: n2, 3: n2})


def test_batch_script_without_srun_is_explained(cluster):
    cmd = " ".join(run_args(cluster, "nng", "tests.jobs.cluster:learn", "-n", "2"))
    t0 = time.monotonic()
    code, _, err, _ = cluster.sbatch(cmd, "-N2")
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert re.search(r"mq run: error: --platform slurm runs outside a job step .* allocation of 2 hosts "
                     r"\(.*\).* start it with srun", lines[0]), lines[0]
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("mq_type, srun_form, mq_form", [("nng", ["-n4"], []),
                                                       ("torchrpc:cpu", ["--ntasks-per-node=1"], ["-n", "2"])],
                         ids=["nng-per-task", "torchrpc-per-host"])
def test_raising_worker_ends_the_step_everywhere(cluster, tmp_path, mq_type, srun_form, mq_form):
    # No --kill-on-bad-exit: the job-wide abort alone must end every host's launcher.
    job = Streamed(["srun", "-N2", *srun_form, *run_args(cluster, mq_type, "tests.jobs.cluster:crash_last", *mq_form)],
                   {**cluster.env, "MQ_TEST_PID_DIR": str(tmp_path)}, REPO)
    nodes = job.wait_nodes(4, timeout=90)
    ready = time.monotonic()
    code = job.wait(timeout=60)
    took = time.monotonic() - ready
    assert code != 0, job.err
    assert took < 15, f"the step took {took:.1f}s to end after the failure"
    print(f"{mq_type}: the step ended {took:.2f}s after every node had joined (node 3 raises 0.5s later)")
    n2 = cluster.nodes[1]
    assert "RuntimeError: node 3 exploded on purpose" in job.err
    assert re.search(rf"node \d stopped: node 3 on {n2} failed \(RuntimeError: node 3 exploded on purpose\)", job.err)
    assert "mq run: job aborted: node 3 on" in job.err or "node 3 exited with code 1" in job.err
    pids = [info["pid"] for info in nodes.values()]
    assert not [p for p in pids if _alive(p)]
    assert sockets_of(pids) == []


def _shm_names() -> set[str]:
    # multiprocessing's own semaphores (sem.mp-*) come and go with other processes: not ours
    names = [p.name for p in Path("/dev/shm").iterdir()] if Path("/dev/shm").is_dir() else []
    return {n for n in names if not n.startswith("sem.mp-")}


@pytest.mark.parametrize("mq_type, srun_form, mq_form", [("nng", "--ntasks-per-node=1 -n 2", ["-n", "2"]),
                                                       ("torchrpc:cpu", "-n4", [])],
                         ids=["nng-per-host", "torchrpc-per-task"])
def test_scancel_stops_gracefully_and_leaves_nothing(cluster, tmp_path, mq_type, srun_form, mq_form):
    shm_before = _shm_names()
    script = " ".join(run_args(cluster, mq_type, "tests.jobs.cluster:wait_forever", *mq_form))
    job = Streamed(["sbatch", "--parsable", "-W", "-N2", "-n4", "-D", str(REPO), "-o", str(tmp_path / "out"),
                    "-e", str(tmp_path / "err"), "--wrap", f"srun {srun_form} {script}"],
                   cluster.env, REPO)
    deadline = time.monotonic() + 90
    nodes: dict[int, dict] = {}
    while len(nodes) < 4 and time.monotonic() < deadline:
        nodes = nodes_of((tmp_path / "out").read_text()) if (tmp_path / "out").exists() else {}
        time.sleep(0.1)
    assert len(nodes) == 4, (tmp_path / "err").read_text() if (tmp_path / "err").exists() else "no output"
    job_id = "".join(job.lines).strip() or subprocess.run(["squeue", "-h", "-o", "%i"], env=cluster.env,
                                                           capture_output=True, text=True).stdout.split()[0]
    pids = [info["pid"] for info in nodes.values()] + [info["launcher"] for info in nodes.values()]
    t0 = time.monotonic()
    subprocess.run(["scancel", job_id.split(";")[0]], env=cluster.env, check=True, timeout=10)
    while time.monotonic() - t0 < 15 and [p for p in pids if _alive(p)]:
        time.sleep(0.05)
    took = time.monotonic() - t0
    job.wait(timeout=30)
    err = (tmp_path / "err").read_text()
    assert not [p for p in pids if _alive(p)], "workers or launchers outlived scancel"
    assert took < 10, f"workers took {took:.1f}s to stop"
    launchers = len({info["launcher"] for info in nodes.values()})
    assert err.count("mq run: stopped by SIGTERM") == launchers, err  # each stopped gracefully
    print(f"scancel {mq_type}: workers and launchers gone {took:.2f}s after scancel")
    assert sockets_of(pids) == []
    leaked = {n for n in _shm_names() - shm_before if re.search(r"mq|torch|tensorpipe|nng", n)}
    assert not leaked
