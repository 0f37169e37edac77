"""A normal install works: the wheel built from a clean copy of the tree, installed
non-editable with nothing of the checkout on the path, runs a two-process nng job, a
torchrpc:cpu round trip, ``mq doctor`` and ``mq run``.

CI installs mq editable, so without this test nothing would notice a package missing from the
wheel (it happened: ``mq.backends.nng`` and ``mq.platforms`` were not in it).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(300)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JOB = textwrap.dedent('''
    import numpy as np
    import mq

    def main(ctx):
        q = ctx.mq
        assert mq.__file__.startswith(ctx.args["argv"][0]), mq.__file__  # the installed copy
        other = 1 - ctx.node_id
        q.on("double", lambda x: x * 2)
        q.wait_for_peers(ids=[other], timeout=30)
        assert q.call(other, "double", np.arange(3), timeout=30).tolist() == [0, 2, 4]
        q.send(other, "hi", {"from": ctx.node_id, "w": np.ones(1 << 18)})
        msg = q.recv(timeout=30)
        assert msg.payload["from"] == other and msg.payload["w"].sum() == 1 << 18
        print(f"node {ctx.node_id} {ctx.mq.mq_type} ok", flush=True)
''')


def _tree_copy(dest: str) -> None:
    """The files git would clone (tracked, plus new ones it does not ignore): no venv, no builds."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split()
    for rel in files:
        src = os.path.join(REPO, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    if shutil.which("git") is None or not os.path.isdir(os.path.join(REPO, ".git")):
        pytest.skip("needs a git checkout of mq")
    root = tmp_path_factory.mktemp("wheel")
    src, dist, site = (str(root / d) for d in ("src", "dist", "site"))
    _tree_copy(src)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", src, "--no-deps", "--no-build-isolation", "-w", dist], check=True, cwd=str(root))
    wheel = glob.glob(os.path.join(dist, "mq-*.whl"))
    assert len(wheel) == 1, wheel
    subprocess.run([*pip, "install", "--no-deps", "--target", site, wheel[0]], check=True, cwd=str(root))
    work = root / "work"
    work.mkdir()
    (work / "wheeljob.py").write_text(JOB)
    # Only the installed copy of mq on the path; its dependencies come from this interpreter's.
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{work}", "PYTHONSAFEPATH": "1"}
    return {"site": site, "env": env, "cwd": str(work), "mq": [sys.executable, os.path.join(site, "bin", "mq")]}


def _run(installed, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=installed["env"], cwd=installed["cwd"], capture_output=True, text=True,
                          timeout=timeout)


def test_the_wheel_holds_every_package(installed):
    out = _run(installed, sys.executable, "-c", "import mq, pkgutil, importlib; "
               "names = [m.name for m in pkgutil.walk_packages(mq.__path__, 'mq.')]; "
               "[importlib.import_module(n) for n in names if n.count('.') < 3 and 'ding' not in n]; "
               "print(mq.__file__); print(len(names))")
    assert out.returncode == 0, out.stderr
    where, count = out.stdout.split()
    assert where.startswith(installed["site"]), where  # not the checkout
    checkout = {os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "mq", "**", "*.py"), recursive=True)}
    shipped = {os.path.relpath(p, installed["site"]) for p in glob.glob(os.path.join(installed["site"], "mq", "**", "*.py"), recursive=True)}
    assert checkout - shipped == set(), f"modules missing from the wheel: {sorted(checkout - shipped)}"


@pytest.mark.parametrize("mq_type", ["nng", "torchrpc:cpu"])
def test_mq_run_from_the_wheel_runs_a_two_process_job(installed, mq_type):
    out = _run(installed, *installed["mq"], "run", "--main", "wheeljob:main", "-n", "2", "--mq-type", mq_type,
               "--", installed["site"])
    assert out.returncode == 0, out.stdout + out.stderr
    for node in (0, 1):
        assert f"node {node} {mq_type} ok" in out.stdout, out.stdout + out.stderr


def test_mq_doctor_from_the_wheel(installed):
    out = _run(installed, *installed["mq"], "doctor", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report, report
