"""The Dockerfiles stay in step with the repository: COPY sources, pip extras, fork safety."""

from __future__ import annotations

import ast
import fnmatch
import re
import shlex
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
DOCKERFILES = sorted(p for p in DOCKER.glob("Dockerfile.*") if p.suffix != ".dockerignore")
FORK_SAFE = {"IBV_FORK_SAFE": "1", "RDMAV_FORK_SAFE": "1"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with comments dropped and continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        instr, _, args = full.partition(" ")
        out.append((instr.upper(), args.strip()))
    assert not pending, f"{path.name}: dangling line continuation"
    return out


def setup_extras() -> set[str]:
    """extras_require keys, read from setup.py's AST (importing it would run setup())."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "setup":
            for kw in call.keywords:
                if kw.arg == "extras_require":
                    return {ast.literal_eval(key) for key in kw.value.keys}  # values may name constants
    raise AssertionError("setup.py has no setup(extras_require=...)")


def env_vars(instrs: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for instr, args in instrs:
        if instr == "ENV":
            for token in shlex.split(args):
                key, sep, value = token.partition("=")
                assert sep, f"use ENV key=value, got {token!r}"
                env[key] = value
    return env


def copy_sources(instrs: list[tuple[str, str]]) -> list[str]:
    sources = []
    for instr, args in instrs:
        if instr in ("COPY", "ADD"):
            tokens = shlex.split(args)
            if any(t.startswith("--from") for t in tokens):
                continue  # copies from another stage, not from the build context
            sources.extend([t for t in tokens if not t.startswith("--")][:-1])
    return sources


def pip_extras(instrs: list[tuple[str, str]]) -> list[set[str]]:
    found = []
    for instr, args in instrs:
        if instr == "RUN" and "pip install" in args:
            for m in re.finditer(r"""["']?\.\[([^\]]*)\]["']?""", args):
                found.append({e.strip() for e in m.group(1).split(",") if e.strip()})
    return found


def test_both_images_exist():
    assert {p.name for p in DOCKERFILES} == {"Dockerfile.cpu", "Dockerfile.cuda"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_exist_in_repo(dockerfile):
    sources = copy_sources(instructions(dockerfile))
    assert {"setup.py", "mq", "cli"} <= set(sources)
    for src in sources:
        assert (REPO / src).exists(), f"{dockerfile.name}: COPY {src} but {src} is not in the repository"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_pip_extras_exist_in_setup_py(dockerfile):
    installs = pip_extras(instructions(dockerfile))
    assert installs, f"{dockerfile.name}: no pip install .[extras]"
    known = setup_extras()
    for extras in installs:
        assert extras <= known, f"{dockerfile.name}: extras {sorted(extras - known)} not in setup.py {sorted(known)}"
        assert {"test", "atari", "bench"} <= extras


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_fork_safety_and_container_marker_are_set(dockerfile):
    env = env_vars(instructions(dockerfile))
    for key, value in FORK_SAFE.items():
        assert env.get(key) == value, f"{dockerfile.name}: ENV {key}={value} missing"
    assert env.get("MQ_CONTAINER"), f"{dockerfile.name}: ENV MQ_CONTAINER marker missing"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_fork_safety_is_set_before_anything_is_installed(dockerfile):
    # Nothing python-side may run before the variables exist (a RUN that imports torch would
    # load verbs without them), so ENV must precede the pip install.
    instrs = instructions(dockerfile)
    env_at = next(i for i, (ins, args) in enumerate(instrs) if ins == "ENV" and "IBV_FORK_SAFE" in args)
    pip_at = next(i for i, (ins, args) in enumerate(instrs) if ins == "RUN" and "pip install" in args)
    assert env_at < pip_at


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_rdma_userspace_packages(dockerfile):
    runs = " ".join(args for ins, args in instructions(dockerfile) if ins == "RUN")
    for pkg in ("rdma-core", "libibverbs1", "ibverbs-providers", "iproute2"):
        assert re.search(rf"apt-get install[^&]*\b{re.escape(pkg)}\b", runs), f"{dockerfile.name}: {pkg} not installed"


def test_bases_and_gpu_extra():
    cpu = instructions(DOCKER / "Dockerfile.cpu")
    assert ("FROM", "python:3.11-slim") in cpu
    cuda = instructions(DOCKER / "Dockerfile.cuda")
    args = dict(a.split("=", 1) for ins, a in cuda if ins == "ARG" and "=" in a)
    base = next(a for ins, a in cuda if ins == "FROM")
    base = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), base)
    assert base.startswith("nvidia/cuda:") and "runtime" in base
    assert any("gpu" in extras for extras in pip_extras(cuda))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerignore_keeps_copy_sources(dockerfile):
    ignore = DOCKER / f"{dockerfile.name}.dockerignore"
    if not ignore.exists():
        pytest.skip("no per-Dockerfile ignore file")
    patterns = [l.strip() for l in ignore.read_text().splitlines() if l.strip() and not l.startswith("#")]
    for src in copy_sources(instructions(dockerfile)):
        excluded = False
        for pat in patterns:  # last match wins, as in Docker
            neg = pat.startswith("!")
            if fnmatch.fnmatch(src, pat.lstrip("!")):
                excluded = not neg
        assert not excluded, f"{ignore.name} excludes COPY source {src}"


def test_readme_documents_the_run_flags():
    text = (DOCKER / "README.md").read_text()
    for flag in ("--ipc=host", "--gpus all", "--device /dev/infiniband", "--cap-add IPC_LOCK",
                 "--ulimit memlock=-1", "--network host", "mq run", "mq doctor"):
        assert flag in text, f"docker/README.md does not mention {flag}"
    assert re.search(r"mq run .*--labels learner", text, re.S)
    assert re.search(r"mq run .*--labels collector", text, re.S)
