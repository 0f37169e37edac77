"""mq on a real Ray cluster (the pinned Ray; ``ray start --head`` here, in its own process group,
with token authentication as Ray 2.60 starts it): nodes inside users' own actors meeting through
``ray://GROUP`` (nng and torchrpc:cpu), ``mq run --platform ray`` with roles and resources, a
node that raises, an actor SIGKILLed, Ctrl-C and SIGTERM leaving no actor behind, the clear
errors (no cluster, a group of another size, a missing node 0, bad flags), and a second Ray node
on a namespace host (tests/test_ray.py::test_a_job_across_two_ray_nodes_*)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install '.[ray]' (scripts/install does)")

import mq  # noqa: E402
from mq.errors import ConfigError, Timeout  # noqa: E402

pytestmark = pytest.mark.timeout(240)
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def _free_port() -> int:
    """A free port outside Ray's own ranges (its workers take 10002-19999)."""
    import random
    import socket

    for _ in range(200):
        port = random.randrange(20000, 30000)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port in 20000-30000")


def _actors_alive() -> list[str]:
    """The command lines of mq's node actors still running on this machine."""
    out = subprocess.run(["pgrep", "-af", "ray::NodeActor"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.strip()]


def _stop_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(10)
            time.sleep(0.5)  # the group's other processes follow their raylet
        except subprocess.TimeoutExpired:
            continue


class Cluster:
    """A Ray head started here by ``ray start --head --block`` in a session of its own (so the
    test ends every Ray process it started, and none other)."""

    def __init__(self, tmp: str, node_ip: str | None = None):
        self.port = _free_port()
        self.node_ip = node_ip or ray.util.get_node_ip_address()
        self.address = f"{self.node_ip}:{self.port}"
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
                    "RAY_USAGE_STATS_ENABLED": "0", "RAY_ADDRESS": self.address,
                    "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
        self.tmp = tmp
        self.ray_tmp = tempfile.mkdtemp(prefix="mqray-")  # short: Ray's socket paths must fit 107 bytes
        self.procs: list[subprocess.Popen] = []

    def start_node(self, argv: list[str], wrap: list[str] | None = None) -> None:
        log = open(os.path.join(self.tmp, f"ray{len(self.procs)}.log"), "w")
        self.procs.append(subprocess.Popen([*(wrap or []), *argv], env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))

    def head(self, cpus: int = 8) -> "Cluster":
        self.start_node([RAY, "start", "--head", "--block", f"--port={self.port}", f"--node-ip-address={self.node_ip}",
                         f"--num-cpus={cpus}", '--resources={"headhost": 100}', "--include-dashboard=false",
                         "--disable-usage-stats",
                         f"--temp-dir={self.ray_tmp}"])
        self.wait_for_nodes(1)
        return self

    def wait_for_nodes(self, n: int, timeout: float = 90) -> None:
        probe = ("import ray,sys; ray.init(logging_level='ERROR'); "
                 "print(sum(1 for x in ray.nodes() if x['Alive']))")
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            r = subprocess.run([sys.executable, "-c", probe], env=self.env, capture_output=True, text=True, timeout=60)
            last = (r.stdout + r.stderr).strip()[-300:]
            if r.returncode == 0 and r.stdout.strip().isdigit() and int(r.stdout.strip()) >= n:
                return
            time.sleep(1)
        raise AssertionError(f"the Ray cluster did not get {n} nodes within {timeout}s: {last}")

    def stop(self) -> None:
        for proc in reversed(self.procs):
            _stop_group(proc)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(str(tmp_path_factory.mktemp("ray")))
    try:
        yield c.head()
    finally:
        c.stop()
    assert not _actors_alive(), "a node actor outlived the cluster"


def _python(cluster: Cluster, argv: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], env=cluster.env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _mq_run(cluster: Cluster, out_dir: str, main: str, *extra: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return _python(cluster, ["-m", "mq.cli.main", "run", "--platform", "ray", "--main", f"tests.jobs.ray_mains:{main}",
                             *extra, "--", out_dir], timeout=timeout)


def _reports(out_dir: str, n: int, timeout: float = 60) -> dict[int, dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = [f for f in os.listdir(out_dir) if f.endswith(".json")]
        if len(names) >= n:
            break
        time.sleep(0.2)
    out = {}
    for name in os.listdir(out_dir):
        if name.endswith(".json"):
            with open(os.path.join(out_dir, name)) as f:
                r = json.load(f)
            out[r["node"]] = r
    return out


def _no_actor_left(timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while _actors_alive() and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not _actors_alive(), f"node actors left running: {_actors_alive()}"


# ---------------------------------------------------------------------------- nodes in actors
@pytest.mark.parametrize("mq_type", ["nng", "torchrpc:cpu"])
def test_nodes_inside_users_own_actors_meet_through_ray(cluster, mq_type):
    group = f"t-{mq_type.replace(':', '-')}-{secrets.token_hex(3)}"
    r = _python(cluster, ["-m", "tests.jobs.ray_actors", mq_type, "3", group])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert sorted(report["who"]) == ["1", "2"] and [v[0] for _, v in sorted(report["who"].items())] == [1, 2]
    assert report["sums"] == [report["expected"]] * 2  # the 1 MiB arrays came back whole
    assert report["routes"] == {"1": "shm", "2": "shm"}  # actors on one Ray node: shared memory


def test_a_node_without_a_ray_cluster_is_told_how_to_start_one(tmp_path):
    env = {**os.environ, "RAY_ADDRESS": f"127.0.0.1:{_free_port()}", "PYTHONPATH": ROOT}
    code = ("import mq\n"
            "try:\n    mq.create('nng', 0, init_method='ray://lonely', world_size=2, timeout=5)\n"
            "except mq.ConfigError as e:\n    print('CONFIG', e)\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "CONFIG" in r.stdout, r.stdout + r.stderr[-2000:]
    assert "no Ray cluster to join" in r.stdout and "ray start --head" in r.stdout


@pytest.mark.parametrize("bad", ["ray://", "ray://a b", "ray://" + "x" * 101, "ray://g/h"])
def test_a_malformed_group_is_a_config_error_before_ray_is_asked(bad):
    with pytest.raises(ConfigError, match="the group after ray://"):
        mq.create("nng", 0, init_method=bad, world_size=2)


def test_wrong_world_size_and_a_missing_node_0_are_clear_errors(cluster):
    group = f"t-size-{secrets.token_hex(3)}"
    code = f"""
import mq, ray
ray.init(logging_level='ERROR')
try:
    mq.create('nng', 1, init_method='ray://{group}', world_size=3, timeout=3)
except mq.Timeout as e:
    print('TIMEOUT', e)
q = mq.create('nng', 0, init_method='ray://{group}', world_size=3, timeout=10)
try:
    mq.create('nng', 1, init_method='ray://{group}', world_size=4, timeout=10)
except mq.ConfigError as e:
    print('CONFIG', e)
try:
    mq.create('nng', 0, init_method='ray://{group}', world_size=3, timeout=10)
except mq.ConfigError as e:
    print('TWICE', e)
q.stop()
"""
    r = _python(cluster, ["-c", code])
    out = r.stdout
    assert "TIMEOUT" in out and "did not publish its rendezvous store" in out and "stage rendezvous" in out, out + r.stderr[-2000:]
    assert "CONFIG" in out, out + r.stderr[-3000:]
    assert "CONFIG" in out and "world_size 4 differs from node 0's 3" in out
    assert "TWICE" in out and "already has a node 0" in out


# ---------------------------------------------------------------------------- mq run --platform ray
@pytest.mark.parametrize("mq_type", ["nng", "torchrpc:cpu"])
def test_mq_run_starts_the_job_as_actors_with_roles_and_resources(cluster, tmp_path, mq_type):
    r = _mq_run(cluster, str(tmp_path), "report", "-n", "3", "--roles", "learner:1,collector:*", "--mq-type", mq_type,
                "--ray-resources", "learner:cpu=2", "--ray-resources", "collector:cpu=1")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    reports = _reports(str(tmp_path), 3)
    assert sorted(reports) == [0, 1, 2]
    assert reports[0]["labels"] == ["learner"] and reports[1]["labels"] == reports[2]["labels"] == ["collector"]
    for n, rep in reports.items():
        assert rep["answers"] == sorted(set(range(3)) - {n})
        assert set(rep["routes"].values()) == {"shm"}
    assert len({rep["pid"] for rep in reports.values()}) == 3  # one actor process per node
    assert "3 nodes ended on Ray" in r.stderr
    _no_actor_left()


def test_a_node_that_raises_fails_the_job_naming_it_and_no_actor_is_left(cluster, tmp_path):
    r = _mq_run(cluster, str(tmp_path), "fails", "-n", "3", timeout=120)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "node 1 failed: RuntimeError: collector 1 broke on purpose" in r.stderr
    _no_actor_left()


def test_a_sigkilled_actor_is_a_launch_error_naming_its_node(cluster, tmp_path):
    r = _mq_run(cluster, str(tmp_path), "dies", "-n", "3", timeout=120)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "node 2's Ray actor died" in r.stderr
    _no_actor_left()


@pytest.mark.parametrize("ignored", [False, True], ids=["", "started-ignoring-them"])
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_and_sigterm_leave_no_actor_behind(cluster, tmp_path, sig, code, ignored):
    """Also when mq run starts with both signals ignored, as a background job of a script does
    (SIGINT then did nothing: a CI run)."""
    def ignore() -> None:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    proc = subprocess.Popen([sys.executable, "-m", "mq.cli.main", "run", "--platform", "ray", "-n", "3",
                             "--main", "tests.jobs.ray_mains:parks", "--", str(tmp_path)], preexec_fn=ignore,
                            env=cluster.env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert len(_reports(str(tmp_path), 3, timeout=120)) == 3, "the nodes did not start"
        assert len(_actors_alive()) == 3
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, err[-3000:]
    _no_actor_left()


def test_resources_no_ray_node_has_are_an_error_not_a_wait(cluster, tmp_path):
    r = _mq_run(cluster, str(tmp_path), "report", "-n", "2", "--ray-resources", "*:cpu=1,gpu=1", timeout=120)
    assert r.returncode == 1 and "node 0 asks for cpu=1,gpu=1, which no Ray node of the cluster has" in r.stderr, \
        r.stderr[-3000:]
    _no_actor_left()


def test_timeout_ends_the_job_and_its_actors(cluster, tmp_path):
    r = _mq_run(cluster, str(tmp_path), "parks", "-n", "2", "--timeout", "20", timeout=120)
    assert r.returncode == 1 and "did not end within --timeout 20s" in r.stderr, r.stderr[-3000:]
    _no_actor_left()


@pytest.mark.parametrize("extra,says", [
    (["--ports", "5000"], "--ports does not apply to --platform ray"),
    (["--init-method", "tcp://127.0.0.1:5000"], "--init-method does not apply"),
    ([], "needs -n N"),
    (["-n", "2", "--ray-resources", "learner:cpu=1"], "no node has the role 'learner'"),
    (["-n", "2", "--roles", "learner:1,collector:*", "--ray-resources", "learner:cpus=two"], "is not NAME=AMOUNT"),
    (["-n", "2", "--protocol", "ipc", "--mq-type", "torchrpc:cpu"], "is an option of nng"),
])
def test_bad_flags_are_usage_errors_before_any_actor_starts(extra, says):
    r = subprocess.run([sys.executable, "-m", "mq.cli.main", "run", "--platform", "ray", "--main",
                        "tests.jobs.ray_mains:report", *extra], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "RAY_ADDRESS": "127.0.0.1:1"})
    assert r.returncode == 2 and says in r.stderr, r.stderr[-2000:]


def test_ray_flags_without_platform_ray_are_usage_errors():
    r = subprocess.run([sys.executable, "-m", "mq.cli.main", "run", "--main", "tests.jobs.ray_mains:report",
                        "--ray-resources", "x:cpu=1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "options of --platform ray" in r.stderr, r.stderr[-2000:]


# ---------------------------------------------------------------------------- two Ray nodes
@pytest.fixture
def two_ray_nodes(tmp_path):
    """A Ray head on this host (at its address on the namespace bridge) and a second Ray node on
    a namespace host (its own network, PID, IPC and mount namespaces); each offers a custom
    resource (``headhost``, ``nshost``) that places an actor there."""
    from mq.tools.netns import Hosts, unavailable

    if os.geteuid() != 0 or unavailable():
        pytest.skip(unavailable() or "needs root for network namespaces")
    with Hosts(1, root=True) as hosts:
        c = Cluster(str(tmp_path), node_ip=hosts.root_addr)
        try:
            c.head(cpus=4)
            c.start_node(hosts.command(0, [RAY, "start", "--block", f"--address={c.address}",
                                           f"--node-ip-address={hosts.addrs[0]}", "--num-cpus=4",
                                           '--resources={"nshost": 4}', "--disable-usage-stats"]))
            c.wait_for_nodes(2)
            yield c, hosts
        finally:
            c.stop()
    _no_actor_left()


def test_a_job_across_two_ray_nodes_takes_tcp_between_them(two_ray_nodes, tmp_path):
    c, hosts = two_ray_nodes
    r = _mq_run(c, str(tmp_path), "report", "-n", "3", "--roles", "learner:1,collector:*",
                "--ray-resources", "learner:cpu=1,headhost=1", "--ray-resources", "collector:cpu=1,nshost=1", timeout=200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    reports = _reports(str(tmp_path), 3)
    assert reports[0]["ip"] == hosts.root_addr  # the learner on the head
    assert reports[1]["ip"] == reports[2]["ip"] == hosts.addrs[0]  # the collectors on the namespace host
    assert reports[0]["routes"] == {"1": "tcp", "2": "tcp"}  # across hosts
    assert reports[1]["routes"] == {"0": "tcp", "2": "shm"}  # the collectors share their host
    assert "(2 Ray node(s)" in r.stderr


@pytest.mark.parametrize("mq_type", ["nng", "torchrpc:cpu"])
def test_nodes_in_users_actors_on_two_ray_nodes_meet_and_take_tcp(two_ray_nodes, mq_type):
    c, hosts = two_ray_nodes
    r = _python(c, ["-m", "tests.jobs.ray_actors", mq_type, "3", f"t2-{secrets.token_hex(3)}", "nshost",
                          "headhost"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["sums"] == [report["expected"]] * 2
    assert report["routes"] == {"1": "tcp", "2": "tcp"}  # node 0 on the head, the others on the namespace host
