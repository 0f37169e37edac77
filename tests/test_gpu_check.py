"""scripts/gpu-check, mq.tools.gpu_probe and `mq doctor`'s GPU pairs, checked without a GPU: the
script runs end to end in bounded time and says what it skipped, its wheel list covers what a GPU
image lacks, and the probe and doctor say "no GPU" instead of failing."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-check"
OUT_FILES = {"env.txt", "tests.log", "junit.xml", "bench.json", "bench.csv", "bench.md", "bench.png", "bench.txt"}
#: What the GPU image ships (GPU.md, "One command on a GPU machine"); the rest comes from .whl/.
GPU_IMAGE = {"torch", "numpy", "msgpack", "click", "rich", "hypothesis", "pytest", "pytest-timeout",
             "prometheus-client", "nvidia-ml-py", "matplotlib", "cloudpickle", "pyyaml", "psutil"}
GPU_PYTHON = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "extra": ""}


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


no_gpu_only = pytest.mark.skipif(_cuda(), reason="checks the no-GPU path; on a GPU machine gpu-check runs it all")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ------------------------------------------------------------------------------- the script
@no_gpu_only
@pytest.mark.timeout(180)
def test_gpu_check_runs_end_to_end_without_a_gpu(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, GPU_CHECK_PYTHON=sys.executable, GPU_CHECK_SITE=str(tmp_path / "site"))
    p = subprocess.run(["bash", str(SCRIPT), str(out)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=170)
    assert p.returncode == 0, p.stdout + p.stderr
    files = {f.name for f in out.iterdir()}
    assert {"env.txt", "tests.log", "bench.txt"} <= files <= OUT_FILES, files
    env_txt = (out / "env.txt").read_text()
    for heading in ("== date", "== uname -a", "== nproc", "== nvidia-smi -L", "== versions",
                    "== namespaces", "ptrace_scope", "== mq doctor --json", "== python3 -m mq.tools.gpu_probe"):
        assert heading in env_txt, heading
    assert "no CUDA GPU visible" in env_txt  # the probe said so
    doctor = env_txt.split("== mq doctor --json", 1)[1].split("\n== ", 1)[0]
    rep = json.loads(doctor[doctor.index("{"):])
    assert rep["gpu_pairs"]["note"] == "no GPU visible"
    assert "gpu-check summary" in p.stdout and "skipped: no GPU" in p.stdout
    assert "no CUDA GPU visible" in (out / "bench.txt").read_text() and "gpu-check summary" in (out / "tests.log").read_text()


def test_gpu_check_usage_and_help():
    p = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert p.returncode != 0 and "--fetch-wheels" in p.stdout
    p = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and "bash scripts/gpu-check --fetch-wheels" in p.stdout


def _header_and_lists() -> tuple[str, set[str], set[str]]:
    text = SCRIPT.read_text()
    header = text[: text.index("\nset -uo pipefail")]
    variables = {}
    for var in ("WHEELS", "BUILT_WHEELS"):
        m = re.search(rf'^{var}="([^"]*)"', text, re.M)
        assert m, var
        variables[var] = {_norm(n) for n in m.group(1).split()}
    return header, variables["WHEELS"], variables["BUILT_WHEELS"]


def _setup_requirements() -> list[str]:
    """pyproject.toml's dependencies and its test, bench, gpu and atari extras."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return project["dependencies"] + [r for key in ("test", "bench", "gpu", "atari") for r in extras[key]]


def _closure(names: set[str], Requirement) -> set[str]:
    """names plus everything they require on the GPU machine's Python, per installed metadata."""
    seen, todo = set(), list(names)
    while todo:
        name = _norm(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for text in requires:
            r = Requirement(text)
            if r.marker is None or r.marker.evaluate(GPU_PYTHON):
                todo.append(r.name)
    return seen


def test_wheel_list_covers_what_the_gpu_image_lacks():
    """Every distribution of install_requires and the test/bench/gpu/atari extras (with what they
    pull in) that the GPU image lacks is fetched into .whl/, named in the header, pinned."""
    Requirement = pytest.importorskip("packaging.requirements").Requirement
    header, wheels, built = _header_and_lists()
    needed = {r.name for r in map(Requirement, _setup_requirements())
              if r.marker is None or r.marker.evaluate(GPU_PYTHON)}
    lacking = _closure(needed, Requirement) - _closure(GPU_IMAGE, Requirement)
    assert lacking >= {"pynng", "python-hostlist", "msgspec", "gymnasium", "ale-py"}, lacking
    assert lacking <= wheels | built, f"not fetched into .whl/: {lacking - wheels - built}"
    listed = header.split("lacks of", 1)[1]
    assert all(re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", listed, re.I) for n in wheels | built), listed
    pins = {_norm(line.split("==")[0]) for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line}
    assert wheels | built <= pins, f"no pin in constraints.txt: {(wheels | built) - pins}"
    assert "bash scripts/gpu-check --fetch-wheels" in header and "pip wheel --no-deps -w .whl" in header


def test_wheel_folder_is_ignored_and_fits():
    assert "/.whl/" in (ROOT / ".gitignore").read_text().split()
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    if not wheels:
        pytest.skip(".whl/ is not filled here (bash scripts/gpu-check --fetch-wheels)")
    ok = re.compile(r"-(py3-none-any|py2\.py3-none-any|cp312-(cp312|abi3)-.*manylinux.*x86_64)\.whl$")
    assert all(ok.search(w.name) for w in wheels), [w.name for w in wheels if not ok.search(w.name)]
    assert sum(w.stat().st_size for w in wheels) < 40 << 20


def test_bench_and_example_options_the_script_passes_exist():
    """gpu-check's mq bench and Atari command lines use options those commands have."""
    text = SCRIPT.read_text()
    bench_fn = text[text.index("\nbench() {"):text.index("\natari_smoke() {")]
    used = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", bench_fn.split("mq.cli.main bench", 1)[1]))
    cli_bench = pytest.importorskip("mq.cli.bench")
    have = {opt for param in cli_bench.bench.params for opt in param.opts}
    assert used <= have, f"mq bench has no {used - have}"
    config = (ROOT / "examples" / "atari_dqn" / "config.py").read_text()
    assert "smoke" in config and "mq_type" in config.replace("mq-type", "mq_type")


# ------------------------------------------------------------------------------- the probe
@no_gpu_only
@pytest.mark.parametrize("args", [[], ["--json"]])
def test_gpu_probe_without_a_gpu_says_so(args):
    p = subprocess.run([sys.executable, "-m", "mq.tools.gpu_probe", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=50)
    assert p.returncode == 0, p.stderr
    if args:
        rep = json.loads(p.stdout)
        assert rep["cuda"] is False and "no CUDA GPU visible" in rep["reason"]
    else:
        assert p.stdout.startswith("no CUDA GPU visible")


def test_gpu_probe_renders_every_part_and_its_failures():
    from mq.tools import gpu_probe

    dev = {"index": 0, "name": "NVIDIA H100", "uuid": "GPU-aaaa", "compute_mode": "Default", "mig": False,
           "memory_bytes": 80 << 30}
    rep = {"cuda": True, "torch": {"version": "2.11.0+cu130", "cuda_build": "13.0"}, "nvml_devices": [dev],
           "device_count": 1, "torch_devices": {"error": "RuntimeError: boom"}, "p2p": [[None]],
           "copy": [{"size": "1.25KB", "bytes": 1280, "ms": 0.004, "gb_per_s": 0.64},
                    {"size": "1.25GB", "bytes": 1280 << 20, "error": "OutOfMemoryError: no"}],
           "expandable_segments_ipc": {"ok": False, "error": "pidfd_getfd: Operation not permitted"},
           "pool_open": {"ok": True, "error": None, "first_open_ms": 12.0, "cached_open_ms": 0.01,
                         "event_wait_ms": 0.02}}
    text = gpu_probe.render(rep)
    for part in ("torch 2.11.0+cu130", "GPU-aaaa", "compute mode Default", "MIG off", "RuntimeError: boom",
                 "P2P", "0.004 ms", "OutOfMemoryError", "FAILED: pidfd_getfd", "first open 12.000 ms",
                 "event wait 0.020 ms"):
        assert part in text, part
    assert gpu_probe.guarded(lambda: 1 / 0) == {"error": "ZeroDivisionError: division by zero"}


def test_pool_open_without_the_cuda_ipc_hook(monkeypatch):
    from mq.tools import gpu_probe

    monkeypatch.setitem(sys.modules, "mq.datapaths.nvlink.cuda_ipc", types.ModuleType("mq.datapaths.nvlink.cuda_ipc"))
    r = gpu_probe.pool_open(0)
    assert r["ok"] is False and r["error"].startswith("mq.datapaths.nvlink.cuda_ipc not available")
    hook = types.ModuleType("mq.datapaths.nvlink.cuda_ipc")
    hook.probe_two_process = lambda device=0: {"ok": True, "error": None, "first_open_ms": 1.0}
    monkeypatch.setitem(sys.modules, "mq.datapaths.nvlink.cuda_ipc", hook)
    assert gpu_probe.pool_open(0)["ok"] is True
    assert "takes one device" in gpu_probe.pool_open(0, peer_device=1)["error"]


# ------------------------------------------------------------------------------- mq doctor
def _doctor():
    from click.testing import CliRunner

    return CliRunner(), pytest.importorskip("mq.cli.doctor")


def test_doctor_gpu_pairs_without_a_gpu(monkeypatch):
    import dataclasses

    from mq.locality import local

    runner, doctor = _doctor()
    monkeypatch.setattr(doctor, "local", lambda: dataclasses.replace(local(), gpus=()))
    rep = json.loads(runner.invoke(doctor.doctor, ["--json", "--probe-cuda"]).output)
    assert rep["gpu_pairs"]["pairs"] == [] and rep["gpu_pairs"]["note"] == "no GPU visible"
    result = runner.invoke(doctor.doctor, [])
    assert result.exit_code == 0, result.output
    assert "GPU pairs" in result.output and result.output.count("no GPU visible") >= 2


def test_doctor_gpu_pairs_with_two_gpus(monkeypatch):
    import dataclasses

    from mq.locality import GpuInfo, local
    from mq.tools import gpu_probe

    runner, doctor = _doctor()
    gpus = (GpuInfo(0, "GPU-aaaa", "H100", (1,)), GpuInfo(1, "MIG-bbbb", "H100", ()))
    monkeypatch.setattr(doctor, "local", lambda: dataclasses.replace(local(), gpus=gpus))
    monkeypatch.setattr(gpu_probe, "nvml_devices", lambda: [{"uuid": "GPU-aaaa", "mig": False,
                                                              "compute_mode": "Exclusive_Process"}])
    calls = []

    def pool_open(device=0, peer_device=None):
        calls.append((device, peer_device))
        return {"ok": True, "error": None, "first_open_ms": 9.5, "cached_open_ms": 0.02}

    monkeypatch.setattr(gpu_probe, "pool_open", pool_open)
    rep = json.loads(runner.invoke(doctor.doctor, ["--json"]).output)["gpu_pairs"]
    assert [p["pair"] for p in rep["pairs"]] == [[0, 0], [0, 1], [1, 1]] and not calls
    mixed = rep["pairs"][1]
    assert mixed["p2p"] == [True, False] and [g["mig"] for g in mixed["gpus"]] == [False, True]
    assert mixed["gpus"][0]["compute_mode"] == "Exclusive_Process" and rep["pid_ns"] == local().pid_ns
    assert rep["pairs"][0]["p2p"] is None and rep["pairs"][0]["pool_open"] is None
    rep = json.loads(runner.invoke(doctor.doctor, ["--json", "--probe-cuda"]).output)["gpu_pairs"]
    assert calls == [(0, 0), (0, 1), (1, 1)] and rep["pairs"][2]["pool_open"]["first_open_ms"] == 9.5
    result = runner.invoke(doctor.doctor, ["--probe-cuda"])
    assert result.exit_code == 0, result.output
    assert "GPU pairs" in result.output and "GPU-aaaa" in result.output and "MIG-bbbb" in result.output
    assert "9.5" in result.output
