"""The docs stay true: the mkdocs site builds with --strict, the quickstart's code runs as
written (its Python files, the output it shows, its `mq run` command), and every relative link
and every repository path the README and docs/ name exists."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
QUICKSTART = DOCS / "quickstart.md"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
RUN_S = 150  # one process of the quickstart (a spawned node imports torch: seconds when loaded)

_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
_REPO_PATH = re.compile(r"^(?:mq|scripts|tests|examples|docker|docs|bench-results)/[\w./-]*$")
_FILE_NAME = re.compile(r"^#\s*([\w-]+\.py)\b")


def _blocks(text: str) -> list[tuple[str, str]]:
    """The fenced code blocks of a Markdown text: ``[(language, code), ...]`` in order."""
    blocks, lang, fence, lines = [], None, "", []
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence and m and m.group(1).startswith(fence) and not m.group(2):
            blocks.append((lang, "\n".join(lines) + "\n"))
            fence, lines = "", []
        elif fence:
            lines.append(line)
        elif m:
            fence, lang = m.group(1), m.group(2)
    assert not fence, "a code fence is never closed"
    return blocks


def _prose(text: str) -> str:
    """The text outside fenced code blocks."""
    out, fence = [], ""
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence:
            if m and m.group(1).startswith(fence) and not m.group(2):
                fence = ""
        elif m:
            fence = m.group(1)
        else:
            out.append(line)
    return "\n".join(out)


# ---------------------------------------------------------------------- processes
def _group(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    found = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(stat.parent.name))
    return found


def _run(cmd: list[str], cwd: pathlib.Path, timeout: float = RUN_S) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a session of its own; whatever it started is gone when this returns."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{shlex.join(cmd)} ran past {timeout:g}s\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    deadline = time.monotonic() + 15
    while _group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _group(proc.pid)
    if left:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"{shlex.join(cmd)} left processes {left} behind")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


# ---------------------------------------------------------------------- the site
def test_mkdocs_builds_strict(tmp_path):
    site = tmp_path / "site"
    r = _run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], ROOT, timeout=240)
    assert r.returncode == 0, (f"mkdocs build --strict failed (bash scripts/install installs mkdocs):\n"
                               f"{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    api = (site / "reference" / "api" / "index.html").read_text()
    for name in ("mq.create", "mq.MQ.stop", "mq.errors.Undelivered", "mq.launch.launch", "mq.testing.InProcess"):
        assert f'id="{name}"' in api, f"the API reference lost {name}"


# ---------------------------------------------------------------------- the quickstart
def test_quickstart_code_runs_as_written(tmp_path):
    """Each Python block is saved under the name its first line gives (``# job.py: ...``) and run
    with ``python NAME`` in a fresh process; a ```text block right after one is what it prints.
    Then the page's ``mq run`` commands run there."""
    blocks = _blocks(QUICKSTART.read_text())
    programs = []
    for i, (lang, code) in enumerate(blocks):
        if lang != "python":
            continue
        m = _FILE_NAME.match(code)
        name = m.group(1) if m else f"block_{i}.py"
        (tmp_path / name).write_text(code)
        shown = blocks[i + 1][1] if i + 1 < len(blocks) and blocks[i + 1][0] == "text" else None
        programs.append((name, shown))
    names = [name for name, _ in programs]
    assert "first_job.py" in names, f"the quickstart's main example (first_job.py) is gone: {names}"
    for name, shown in programs:
        r = _run([sys.executable, name], tmp_path)
        assert r.returncode == 0, f"{name} of docs/quickstart.md failed:\n{r.stdout}\n{r.stderr[-4000:]}"
        if shown is not None:
            assert r.stdout == shown, (
                f"{name} printed\n{r.stdout}\nbut docs/quickstart.md shows\n{shown}")
    commands = [line.strip() for lang, code in blocks if lang == "bash"
                for line in code.splitlines() if line.strip().startswith("mq run ")]
    assert commands, "the quickstart no longer shows an `mq run` command"
    for command in commands:
        args = shlex.split(command.split("#", 1)[0])[2:]
        r = _run([sys.executable, "-m", "mq.cli.main", "run", *args], tmp_path)
        assert r.returncode == 0, f"`{command}` of docs/quickstart.md failed:\n{r.stdout}\n{r.stderr[-4000:]}"
        assert "learner:" in r.stdout, r.stdout


# ---------------------------------------------------------------------- links and paths
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_named_paths_exist(page):
    text = _prose(page.read_text())
    spans = [m.group(2).strip() for m in _CODE_SPAN.finditer(text)]
    missing = []
    for target in _LINK.findall(_CODE_SPAN.sub("", text)):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        path = target.split("#", 1)[0]
        if path and not (page.parent / path).exists():
            missing.append(f"link {target}")
    for span in spans:  # `mq/fanout/relays.py`, `bench-results/`: paths of this repository
        if _REPO_PATH.match(span) and not (ROOT / span).exists():
            missing.append(f"path `{span}`")
    assert not missing, f"{page.relative_to(ROOT)} names what does not exist: {missing}"


def test_the_layout_table_names_every_module_of_mq():
    """docs/index.md's layout: every module and package directly under mq/ is in it (a newcomer
    finds each concern there); that the paths it names exist, the test above checks."""
    text = (DOCS / "index.md").read_text()
    table = text[text.index("| path | concern |"):]
    named = set(re.findall(r"`(mq/[A-Za-z0-9_/]+(?:\.py)?)`", table))
    here = {f"mq/{p.name}" for p in (ROOT / "mq").glob("*.py")}
    here |= {f"mq/{p.name}/" for p in (ROOT / "mq").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    for package in ("node", "wire", "datapaths", "fanout", "launch"):  # the library's own layers: every module
        here |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "mq" / package).rglob("*.py")
                 if p.name != "__init__.py"}
    missing = sorted(m for m in here if m not in named and m.rstrip("/") not in named)
    assert not missing, f"docs/index.md's layout table lacks {missing}: add a row (or a name to a row)"


def test_the_readme_snippet_runs_with_the_command_it_gives(tmp_path):
    """README's "Use it": its Python block is roles.py, run by the `mq run` its first line gives."""
    code = next(code for lang, code in _blocks((ROOT / "README.md").read_text()) if lang == "python")
    first = code.splitlines()[0]
    assert first.startswith("# roles.py, run with:") and "mq run " in first, first
    (tmp_path / "roles.py").write_text(code)
    args = shlex.split(first.split("mq run ", 1)[1])
    r = _run([sys.executable, "-m", "mq.cli.main", "run", *args], tmp_path)
    assert r.returncode == 0, f"README's snippet failed:\n{r.stdout}\n{r.stderr[-4000:]}"
    lines = r.stdout.splitlines()
    assert any(re.search(r"learner: routes \{1: '(shm|ipc)', 2: '(shm|ipc)'\}", line) for line in lines), r.stdout
    assert sum("transitions from node" in line for line in lines) == 2, r.stdout


def test_readme_commands_name_existing_scripts():
    scripts = [line.split()[1] for lang, code in _blocks((ROOT / "README.md").read_text()) if lang == "bash"
               for line in code.splitlines() if line.startswith("bash ")]
    assert {"scripts/demo", "scripts/test"} <= set(scripts), scripts
    assert all((ROOT / s).is_file() for s in scripts), scripts


def test_the_quickstart_names_the_extras_scripts_install_installs():
    install = (ROOT / "scripts" / "install").read_text()
    extras = re.search(r'-e "\.\[([a-z,]+)\]"', install).group(1)
    assert f'-e ".[{extras}]"' in QUICKSTART.read_text(), f"docs/quickstart.md does not say scripts/install's .[{extras}]"
