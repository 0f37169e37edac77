"""Fork-safety environment and the fork-after-RDMA warning, in real subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import mq.datapaths.rdma.forksafe as fs
from mq.locality import Locality, read_rdma_devices

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[1]
SYSFS = Path(__file__).parent / "data" / "sysfs"
VARS = ("IBV_FORK_SAFE", "RDMAV_FORK_SAFE")


def loc(case: str) -> Locality:
    return Locality(rdma=read_rdma_devices(str(SYSFS / case)))


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def test_fork_safe_env_constant():
    assert dict(fs.FORK_SAFE_ENV) == {"IBV_FORK_SAFE": "1", "RDMAV_FORK_SAFE": "1"}


@pytest.mark.parametrize(
    "case, expected",
    [("active", True), ("down_next_to_active", True), ("only_down", False), ("no_infiniband", False)],
)
def test_rdma_may_be_used(case, expected):
    assert fs.rdma_may_be_used(loc(case)) is expected


def test_fork_safe_env_sets_vars_only_when_rdma_may_be_used():
    base = {"PATH": "/usr/bin"}
    env = fs.fork_safe_env(base, loc("active"))
    assert env == {"PATH": "/usr/bin", "IBV_FORK_SAFE": "1", "RDMAV_FORK_SAFE": "1"}
    assert base == {"PATH": "/usr/bin"}  # the input is not modified
    assert fs.fork_safe_env(base, loc("only_down")) == base
    # a user's explicit value is kept: libibverbs only checks that the variable exists
    assert fs.fork_safe_env({"IBV_FORK_SAFE": "yes"}, loc("active"))["IBV_FORK_SAFE"] == "yes"


def test_fork_safe_env_reaches_a_real_subprocess():
    env = fs.fork_safe_env(clean_env(), loc("down_next_to_active"))
    code = textwrap.dedent(
        """
        import os
        import mq.locality as L
        print(os.environ.get("IBV_FORK_SAFE"), os.environ.get("RDMAV_FORK_SAFE"),
              L.describe(probe_gpus=False).fork_safe)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1", "True"]


_FORK_SCRIPT = textwrap.dedent(
    """
    import logging, os, sys
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    import mq.datapaths.rdma.forksafe as fs

    def fork_and_wait():
        pid = os.fork()
        if pid == 0:
            os._exit(0)  # the warning, if any, was logged by the at-fork hook before this
        _, status = os.waitpid(pid, 0)
        assert status == 0

    fs.install_fork_warning()
    fs.install_fork_warning()  # idempotent: still one hook, one warning per fork
    fork_and_wait()            # before RDMA started: silent
    print("rdma_started", fs.state()["rdma_started"], flush=True)
    fs.mark_rdma_started("TensorPipe ibv")
    fork_and_wait()            # after: the child warns
    print("rdma_started", fs.state()["rdma_started"], flush=True)
    """
)


def test_fork_after_rdma_started_logs_a_warning():
    out = subprocess.run(
        [sys.executable, "-c", _FORK_SCRIPT], env=clean_env(), capture_output=True, text=True, timeout=20
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["rdma_started False", "rdma_started True"]
    warnings = [line for line in out.stderr.splitlines() if line.startswith("mq WARNING")]
    assert len(warnings) == 1, out.stderr
    (w,) = warnings
    assert "forked" in w and "after TensorPipe ibv started" in w
    assert "'spawn'" in w and "IBV_FORK_SAFE=1" in w and "RDMAV_FORK_SAFE=1" in w
    assert "were not set" in w


def test_fork_warning_with_vars_set_says_so():
    env = clean_env() | dict(fs.FORK_SAFE_ENV)
    out = subprocess.run([sys.executable, "-c", _FORK_SCRIPT], env=env, capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    assert "must not use the parent's RDMA connections" in out.stderr


def test_state_for_doctor():
    s = fs.state(loc("active"), environ={})
    assert s["rdma_may_be_used"] and not s["fork_safe"] and not s["ok"]
    assert "IBV_FORK_SAFE=1" in s["advice"]
    assert s["env"] == {"IBV_FORK_SAFE": None, "RDMAV_FORK_SAFE": None}
    s = fs.state(loc("active"), environ=dict(fs.FORK_SAFE_ENV))
    assert s["ok"] and s["fork_safe"] and s["advice"] is None
    s = fs.state(loc("no_infiniband"), environ={})
    assert s["ok"] and not s["rdma_may_be_used"]
    assert set(s) == {"env", "fork_safe", "rdma_may_be_used", "rdma_started", "fork_warning_installed", "start_method", "ok", "advice"}
