"""The Dockerfiles stay in step with the repository: COPY sources, pip extras, fork safety,
the CPU image's two stages (CPU torch only, nothing but the venv in the final image), the
.dockerignore allow-lists and scripts/docker. Static: scripts/docker builds and runs the image."""

from __future__ import annotations

import ast
import fnmatch
import re
import shlex
import shutil
import subprocess
import tomllib
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


def arg_defaults(instrs: list[tuple[str, str]]) -> dict[str, str]:
    """ARG name=default pairs (every stage's; later ones win, which is fine for these files)."""
    return dict(a.split("=", 1) for ins, a in instrs if ins == "ARG" and "=" in a)


def substitute(text: str, args: dict[str, str]) -> str:
    """${NAME} / $NAME replaced by ARG defaults (unknown names are left as they are)."""
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), text)


def stages(instrs: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """The instructions of each build stage (from its FROM on); ARGs before the first FROM dropped."""
    out: list[list[tuple[str, str]]] = []
    for ins in instrs:
        if ins[0] == "FROM":
            out.append([])
        if out:
            out[-1].append(ins)
    return out


def excluded(path: str, patterns: list[str]) -> bool:
    """Whether a .dockerignore's patterns keep ``path`` out of the context (last match wins, and
    a pattern that matches a parent folder matches everything below it, as in Docker)."""
    path = path.strip("/")
    parts = path.split("/")
    out = False
    for pat in patterns:
        neg = pat.startswith("!")
        body = pat.lstrip("!").strip("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if body.startswith("**/"):
            hit = any(fnmatch.fnmatch(p, body[3:]) for p in parts) or fnmatch.fnmatch(path, body)
        else:
            hit = any(fnmatch.fnmatch(p, body) and p.count("/") == body.count("/") for p in prefixes)
        if hit:
            out = not neg
    return out


def ignore_patterns(path: Path) -> list[str]:
    return [l.strip() for l in path.read_text().splitlines() if l.strip() and not l.startswith("#")]


def setup_extras() -> set[str]:
    """The extras pyproject.toml declares."""
    return set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])


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
    """The extras of every `pip install .[...]`, with ARG defaults (EXTRAS) substituted."""
    found = []
    defaults = arg_defaults(instrs)
    for instr, args in instrs:
        if instr == "RUN" and "pip install" in args:
            for m in re.finditer(r"""["']?\.\[([^\]]*)\]["']?""", substitute(args, defaults)):
                found.append({e.strip() for e in m.group(1).split(",") if e.strip()})
    return found


def test_both_images_exist():
    assert {p.name for p in DOCKERFILES} == {"Dockerfile.cpu", "Dockerfile.cuda"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_exist_in_repo(dockerfile):
    sources = copy_sources(instructions(dockerfile))
    assert {"pyproject.toml", "constraints.txt", "mq"} <= set(sources)
    for src in sources:
        assert (REPO / src).exists(), f"{dockerfile.name}: COPY {src} but {src} is not in the repository"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_pip_extras_exist_in_pyproject(dockerfile):
    installs = pip_extras(instructions(dockerfile))
    assert installs, f"{dockerfile.name}: no pip install .[extras]"
    known = setup_extras()
    # The README's example runs the Atari DQN roles; the CUDA image adds NVML. Runtime images
    # carry no test tools (pytest, hypothesis, atheris): `--build-arg EXTRAS=...` adds them.
    want = {"atari", "gpu"} if dockerfile.name == "Dockerfile.cuda" else {"atari"}
    for extras in installs:
        assert extras <= known, f"{dockerfile.name}: extras {sorted(extras - known)} not in pyproject.toml {sorted(known)}"
        assert want <= extras, f"{dockerfile.name}: default extras {sorted(extras)} lack {sorted(want - extras)}"
        assert not extras & {"test", "dev"}, f"{dockerfile.name}: test tools in the runtime image"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_pip_installs_are_pinned_by_constraints(dockerfile):
    for ins, args in instructions(dockerfile):
        if ins == "RUN" and "pip install" in args:
            for cmd in re.findall(r"pip install[^;&]*", args):
                assert "-c /tmp/constraints.txt" in cmd, f"{dockerfile.name}: unpinned `{cmd.strip()}`"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_fork_safety_and_container_marker_are_set(dockerfile):
    final = stages(instructions(dockerfile))[-1]  # what the image ships with
    env = env_vars(final)
    for key, value in FORK_SAFE.items():
        assert env.get(key) == value, f"{dockerfile.name}: ENV {key}={value} missing"
    assert env.get("MQ_CONTAINER"), f"{dockerfile.name}: ENV MQ_CONTAINER marker missing"
    assert env.get("PATH", "").startswith("/opt/venv/bin:"), f"{dockerfile.name}: the venv is not on PATH"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_fork_safety_is_set_before_anything_is_installed(dockerfile):
    # Nothing python-side may run before the variables exist (a RUN that imports torch would
    # load verbs without them), so in every stage that installs, ENV must precede pip install.
    for stage in stages(instructions(dockerfile)):
        pip_at = next((i for i, (ins, args) in enumerate(stage) if ins == "RUN" and "pip install" in args), None)
        if pip_at is None:
            continue
        env_at = next(i for i, (ins, args) in enumerate(stage) if ins == "ENV" and "IBV_FORK_SAFE" in args)
        assert env_at < pip_at, f"{dockerfile.name}: pip install before ENV IBV_FORK_SAFE in stage {stage[0]}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_rdma_userspace_packages_and_init(dockerfile):
    final = stages(instructions(dockerfile))[-1]
    runs = " ".join(args for ins, args in final if ins == "RUN")
    for pkg in ("rdma-core", "libibverbs1", "ibverbs-providers", "ibverbs-utils", "iproute2", "tini"):
        assert re.search(rf"apt-get install[^&]*\b{re.escape(pkg)}\b", runs), f"{dockerfile.name}: {pkg} not installed"
    for compiler in ("build-essential", "gcc", "g++", "clang", "python3-dev"):
        assert not re.search(rf"apt-get install[^&]*(?<![\w-]){re.escape(compiler)}(?![\w-])", runs), \
            f"{dockerfile.name}: {compiler} left in the image"
    # `mq run` must never be PID 1: its workers read a parent pid of 1 as "the launcher died".
    entry = [a for ins, a in final if ins == "ENTRYPOINT"]
    assert entry and ast.literal_eval(entry[-1])[0] == "tini", f"{dockerfile.name}: ENTRYPOINT is not tini"
    assert [a for ins, a in final if ins == "CMD"][-1] == '["mq", "doctor"]'


def test_bases_and_gpu_extra():
    cpu = instructions(DOCKER / "Dockerfile.cpu")
    cpu_args = arg_defaults(cpu)
    assert cpu_args.get("BASE") == "python:3.11-slim"  # users with a registry keep working
    froms = [substitute(a, cpu_args) for ins, a in cpu if ins == "FROM"]
    assert froms == ["python:3.11-slim AS build", "python:3.11-slim"]
    cuda = instructions(DOCKER / "Dockerfile.cuda")
    base = substitute(next(a for ins, a in cuda if ins == "FROM"), arg_defaults(cuda))
    assert base.startswith("nvidia/cuda:") and "runtime" in base
    assert any("gpu" in extras for extras in pip_extras(cuda))


def test_cpu_image_takes_cpu_torch_only_and_ships_only_the_venv():
    build, final = stages(instructions(DOCKER / "Dockerfile.cpu"))
    runs = " ".join(a for ins, a in build if ins == "RUN")
    # torch: the copied +cpu wheel, else the pinned +cpu build from PyTorch's CPU index (PyPI's
    # default torch is the multi-GB CUDA build); checked after each install.
    assert "/tmp/local/torch-*+cpu-*.whl" in runs
    assert "https://download.pytorch.org/whl/cpu" in runs and '+cpu"' in runs
    assert runs.count("torch.version.cuda is None") >= 2
    assert [a for ins, a in build if ins == "COPY" and "docker/local" in a], "build stage does not copy docker/local/"
    # The final stage: no pip, no build context but the examples, the venv from the build stage.
    assert not [a for ins, a in final if ins == "RUN" and "pip" in a]
    copies = [a for ins, a in final if ins == "COPY"]
    assert "--from=build /opt/venv /opt/venv" in copies
    assert copy_sources(final) == ["examples"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerignore_keeps_copy_sources(dockerfile):
    for ignore in (DOCKER / f"{dockerfile.name}.dockerignore", REPO / ".dockerignore"):
        assert ignore.exists(), f"{ignore.relative_to(REPO)} is missing"
        patterns = ignore_patterns(ignore)
        for src in copy_sources(instructions(dockerfile)):
            assert not excluded(src, patterns), f"{ignore.relative_to(REPO)} excludes COPY source {src}"


@pytest.mark.parametrize("ignore", [REPO / ".dockerignore", *sorted(DOCKER.glob("*.dockerignore"))],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_dockerignore_keeps_local_state_out_of_the_context(ignore):
    # BuildKit reads docker/<Dockerfile>.dockerignore, the legacy builder (Debian's docker.io
    # without DOCKER_BUILDKIT=1) the repository's .dockerignore: both must keep these out.
    patterns = ignore_patterns(ignore)
    for path in (".venv/bin/python", ".ding-venv/bin/python", ".git/HEAD", "bench-results/x.json",
                 "bench-out/x", "tests/test_docker_files.py", "docs/index.md", ".whl/torch.whl",
                 "mq/__pycache__/core.cpython-311.pyc", ".pytest_cache/v", ".hypothesis/x",
                 "mq.egg-info/PKG-INFO", "build/lib/mq/core.py"):
        assert excluded(path, patterns), f"{ignore.relative_to(REPO)} lets {path} into the build context"


def test_local_build_inputs_are_git_ignored():
    # scripts/docker copies the torch wheel and a CA bundle into docker/local/: never committed.
    lines = (DOCKER / "local" / ".gitignore").read_text().splitlines()
    assert "*" in lines and "!README.md" in lines
    if shutil.which("git") and (REPO / ".git").exists():
        for name in ("torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", "ca-bundle.crt"):
            r = subprocess.run(["git", "check-ignore", "-q", f"docker/local/{name}"], cwd=REPO)
            assert r.returncode == 0, f"docker/local/{name} is not git-ignored"


def test_scripts_docker_is_valid_bash_and_bounded():
    script = REPO / "scripts" / "docker"
    text = script.read_text()
    assert "set -euo pipefail" in text
    assert "trap cleanup EXIT" in text  # containers, the network and a started dockerd go
    assert "--build-arg \"BASE=$BASE_IMAGE\"" in text and "BASE_IMAGE=mq-base:bookworm" in text
    assert "--variant=minbase" in text and "docker import" in text
    assert "--require" in text and "skipped:" in text
    for line in text.splitlines():  # every container run and wait has a time limit
        stripped = line.strip()
        if re.match(r"(\S+=\S+ )*(if ! )?docker (run|wait|build)\b", stripped) or "$(docker wait" in stripped:
            raise AssertionError(f"scripts/docker: unbounded `{stripped}`")
    if shutil.which("bash"):
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def test_check_job_parses():
    ast.parse((DOCKER / "check_job.py").read_text())


def test_readme_documents_the_run_flags():
    text = (DOCKER / "README.md").read_text()
    for flag in ("--ipc=host", "--pid=host", "MQ_SECRET", "--gpus all", "--device /dev/infiniband",
                 "--cap-add IPC_LOCK", "--ulimit memlock=-1", "--network host", "mq run", "mq doctor",
                 "scripts/docker", "--build-arg BASE=mq-base:bookworm"):
        assert flag in text, f"docker/README.md does not mention {flag}"
    assert re.search(r"mq run .*--labels learner", text, re.S)
    assert re.search(r"mq run .*--labels collector", text, re.S)
    assert re.search(r"\*\*Size: \d+ MB\*\*", text), "docker/README.md does not give the measured image size"
    # Every docker run that starts mq run passes the job secret.
    for cmd in re.findall(r"docker run[^`]*?mq run", text, re.S):
        assert "MQ_SECRET" in cmd, f"a docker run without -e MQ_SECRET: {cmd[:80]}..."
