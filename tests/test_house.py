"""The house rules of issue 23, checked on the source: sizes a newcomer can read, no import
cycle among mq modules, tools and fan-out on public API only, route choice free of TensorPipe,
a launcher that does not branch on the backend. Each fails if the rule breaks."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_CLASS, MAX_MODULE, MAX_FUNCTION = 500, 800, 80


def _sources(*roots: str) -> dict[str, ast.Module]:
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text(), str(p))
            for root in roots for p in sorted((ROOT / root).rglob("*.py"))}


def _span(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def test_no_class_module_or_function_past_its_limit():
    too_big = []
    for path, tree in _sources("mq").items():
        lines = len((ROOT / path).read_text().splitlines())
        if path.startswith("mq/") and lines > MAX_MODULE:
            too_big.append(f"module {path}: {lines} lines > {MAX_MODULE}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and not path.startswith("mq/tools/") and _span(node) > MAX_CLASS:
                too_big.append(f"class {path}:{node.name}: {_span(node)} lines > {MAX_CLASS}")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _span(node) > MAX_FUNCTION:
                too_big.append(f"function {path}:{node.name}: {_span(node)} lines > {MAX_FUNCTION}")
    assert not too_big, "\n".join(too_big)


def _module_name(path: str) -> str:
    name = path[:-3].replace("/", ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def _imports(path: str, tree: ast.Module, modules: set[str]) -> set[str]:
    """The mq modules this one imports, anywhere in it (a function-level import counts)."""
    here = _module_name(path)
    package = here if path.endswith("__init__.py") else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != here and not here.startswith(name + "."):
                found.add(name)  # a package's __init__ imported by its own modules is not a cycle
    return found


def test_no_import_cycle_among_mq_modules():
    sources = _sources("mq")
    modules = {_module_name(p) for p in sources}
    graph = {_module_name(p): _imports(p, t, modules) for p, t in sources.items()}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [node, nxt]))
            elif nxt not in state:
                visit(nxt, stack + [node])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_tools_and_fanout_use_only_the_public_api_of_a_queue():
    """No ``q._x`` / ``node._x`` / ``self.q._x`` reach into an MQ from the tools or the fan-out."""
    offenders = []
    files = sorted((ROOT / "mq" / "tools").rglob("*.py")) + [ROOT / "mq" / "fanout" / "relays.py"]
    files += sorted((ROOT / "mq" / "cli").rglob("*.py"))
    reach = re.compile(r"\b(?:q|node|mq_|queue_|learner|self\.q|self\._q|self\.node|self\._node|g\.q)\._[a-z]\w*")
    for path in files:
        if not path.exists():
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if reach.search(line.split("#", 1)[0]):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_route_choice_names_no_tensorpipe_option():
    text = (ROOT / "mq" / "routing.py").read_text()
    for word in ("TensorPipeRpcBackendOptions", "_transports", "_channels", "rpc_timeout",
                 "num_worker_threads", "device_maps", "set_device_map"):
        assert word not in text, f"mq/routing.py names {word!r}: TensorPipe knowledge belongs to its backend"


def test_the_launcher_does_not_branch_on_the_mq_type():
    for path in (*(ROOT / "mq" / "launch").glob("*.py"), ROOT / "mq" / "cli" / "run.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(
                    isinstance(side, (ast.Name, ast.Attribute)) and
                    (getattr(side, "id", None) or getattr(side, "attr", None)) == "mq_type"
                    for side in [node.left, *node.comparators]):
                pytest.fail(f"{path.relative_to(ROOT)}:{node.lineno} compares mq_type: ask the "
                            "backend's launch profile instead")


def _imported(tree: ast.Module) -> list[tuple[int, str]]:
    """Every module an import names (``from a import b`` names ``a`` and ``a.b``)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def test_a_backend_is_imported_only_from_its_own_folder_and_the_cli():
    # mq asks the backend's Backend object (found by mq.registry); only the backend's own folder,
    # and mq/cli/ (which may show a backend's details), import a named backend.
    backends = {p.name for p in (ROOT / "mq" / "backends").iterdir() if (p / "__init__.py").exists()}
    assert {"nng", "torchrpc", "inproc"} <= backends
    offenders = []
    for path, tree in _sources("mq").items():
        parts = pathlib.Path(path).parts
        if parts[1] == "cli":
            continue
        own = parts[2] if parts[1] == "backends" and len(parts) > 3 else None
        for line, name in _imported(tree):
            seg = name.split(".")
            if seg[:2] == ["mq", "backends"] and len(seg) > 2 and seg[2] in backends and seg[2] != own:
                offenders.append(f"{path}:{line} imports {name}")
    assert not offenders, "\n".join(offenders)


def test_a_peer_route_is_written_only_by_its_owner():
    # mq/node/peer_route.py decides a peer's route and every change to it (keeping the reason);
    # everyone else reads Peer.route. Peer(...) in the join takes the owner's choice.
    offenders = []
    for path, tree in _sources("mq").items():
        if path == "mq/node/peer_route.py":
            continue
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr == "route":
                    offenders.append(f"{path}:{node.lineno} assigns .route")
    assert not offenders, "\n".join(offenders)


def test_data_paths_do_not_import_each_other():
    """Issue 37: a data path is a module (and the memory module only it uses) plus a line in
    ``mq.datapaths.base.PATHS``; what the paths share lives in ``mq.datapaths.base``, which imports none of
    them. So no path's modules import another path's."""
    from mq.datapaths.base import PATHS

    sources = _sources("mq")
    modules = {_module_name(p) for p in sources}
    graph = {_module_name(p): _imports(p, t, modules) for p, t in sources.items()}
    families = {}
    for route, factory in PATHS.items():
        module = factory.partition(":")[0] if isinstance(factory, str) else factory.__module__
        # the path's module, and the memory modules it builds on (those that import mq.datapaths.base)
        families[route] = {module} | {m for m in graph[module] if "mq.datapaths.base" in graph[m]}
    assert len(families) >= 2 and all(len(f) >= 1 for f in families.values())
    crossing = [f"{a} ({ra}) imports {b} ({rb})"
                for ra, fa in families.items() for rb, fb in families.items() if ra != rb
                for a in sorted(fa) for b in sorted(graph[a] & fb)]
    assert not crossing, "data paths import each other:\n" + "\n".join(crossing)
    shared = sorted(graph["mq.datapaths.base"] & set().union(*families.values()))
    assert not shared, f"mq.datapaths.base (what the paths share) imports a path: {shared}"
    assert families["shm"] >= {"mq.datapaths.shm.path", "mq.datapaths.shm.pool"} and families["nvlink"] >= {"mq.datapaths.nvlink.path", "mq.datapaths.nvlink.cuda_ipc"}


# ---------------------------------------------------------------------- one way to wait (issue 45)
#: Where code may block on a lock, condition, event or queue: the one waiting module. Tools
#: (bench, load, netns), and the test kits mq ships for users' own tests, are not the library.
WAITING_MODULE = "mq/node/waits.py"
NOT_THE_LIBRARY = ("mq/tools/", "mq/cli/", "mq/testing.py", "mq/conformance.py")  # commands and tools, not a queue
#: Primitives a thread can block on: made only in the waiting module (a lock for a short
#: critical section, ``with lock:``, is fine anywhere; waiting on one is not).
_PRIMITIVES = {"Condition", "Event", "Semaphore", "BoundedSemaphore", "Barrier", "Queue", "SimpleQueue",
               "LifoQueue", "PriorityQueue", "JoinableQueue", "Timer"}


def blocking_outside_waits(source: str) -> list[str]:
    """What in ``source`` blocks, or makes something to block on, other than through
    :mod:`mq.node.waits`: a condition, event, semaphore or queue made here; a lock acquired in any way
    but a non-blocking try; a sleep; a thread, process or future waited for."""
    found = []
    tree = ast.parse(source)
    waits = {"waits"} | {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                         and node.module in ("mq", "mq.node") for a in node.names if a.name == "waits"}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func, text = node.func, ast.unparse(node)[:80]
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        receiver = func.value if isinstance(func, ast.Attribute) else None
        if isinstance(receiver, ast.Name) and receiver.id in waits:
            continue  # mq.node.waits' own helpers
        if receiver is not None and ast.unparse(receiver).endswith("cuda"):
            continue  # a CUDA event orders GPU work; no thread waits on it here
        if name in _PRIMITIVES and name != "Timer":
            found.append(f"{node.lineno}: makes a {name} ({text})")
        elif name == "acquire" and not (
                (node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value is False)
                or any(k.arg == "blocking" and isinstance(k.value, ast.Constant) and k.value.value is False
                       for k in node.keywords)):
            found.append(f"{node.lineno}: waits for a lock ({text})")
        elif name == "sleep" and (receiver is None or (isinstance(receiver, ast.Name) and receiver.id == "time")):
            found.append(f"{node.lineno}: sleeps ({text})")
        elif name == "result":
            found.append(f"{node.lineno}: waits for a future ({text})")
        elif name == "join" and receiver is not None and not isinstance(receiver, ast.Constant) and not (
                (isinstance(receiver, ast.Attribute) and receiver.attr == "path")
                or (isinstance(receiver, ast.Name) and receiver.id in ("os", "posixpath", "shlex"))):
            found.append(f"{node.lineno}: waits for a thread or process ({text})")
    return found


def test_code_in_mq_blocks_only_through_the_waiting_module():
    """Issue 45: every blocking operation goes through mq.node.waits, which ends it on a lost peer,
    a stop or its deadline, and looks again at a bounded interval. Anything that blocks
    elsewhere could miss the wake-up that ends it (a dead peer's, a stop's)."""
    offenders = []
    for path in sorted((ROOT / "mq").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel == WAITING_MODULE or rel.startswith(NOT_THE_LIBRARY):
            continue
        offenders += [f"{rel}:{hit}" for hit in blocking_outside_waits(path.read_text())]
    assert not offenders, "blocks outside mq/node/waits.py (use mq.node.waits):\n" + "\n".join(offenders)


@pytest.mark.parametrize("snippet", [
    "import threading\nc = threading.Condition()",
    "import queue\nq = queue.SimpleQueue()",
    "from threading import Event\ne = Event()",
    "lock.acquire(timeout=1.0)",
    "lock.acquire()",
    "import time\ntime.sleep(0.1)",
    "fut.result(timeout=3)",
    "self._thread.join(2.0)",
])
def test_the_waiting_rule_catches_each_way_to_block(snippet):
    assert blocking_outside_waits(snippet), snippet


@pytest.mark.parametrize("snippet", [
    "with self._lock:\n    x = 1",
    "self._lock.acquire(False)",
    "lock.acquire(blocking=False)",
    "', '.join(names)",
    "os.path.join(a, b)",
    "from mq import waits as _w\n_w.join(thread, 1.0)",  # the waiting module's own helpers
])
def test_the_waiting_rule_lets_critical_sections_and_strings_be(snippet):
    assert not blocking_outside_waits(snippet), snippet


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def test_only_the_registry_names_a_backend_outside_its_folder():
    """Issue 47: a backend is a plug-in. mq asks its Backend object (capabilities, launch
    profile), never compares mq types: outside ``mq/backends/<name>/`` a string that is one of its
    mq types appears only in the registry (``DEFAULT_MQ_TYPE``). Exempt: the tools (each bench row
    compares a backend with its own raw baseline) and names that are also route kinds or address
    families (``inproc``), which a string cannot tell apart."""
    from mq.registry import backends
    from mq.routing import ROUTE_KINDS

    names: dict[str, str] = {}
    for backend in backends().values():
        for name in (backend.name, *backend.mq_types, *backend.aliases):
            if name not in ROUTE_KINDS:
                names[name] = backend.name
    assert {"nng", "torchrpc:cpu"} <= set(names)
    offenders = []
    for path, tree in _sources("mq").items():
        parts = pathlib.Path(path).parts
        if path == "mq/registry.py" or path.startswith("mq/tools/"):
            continue
        own = parts[2] if parts[1] == "backends" and len(parts) > 3 else None
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
                    and names.get(node.value, own) != own):
                offenders.append(f"{path}:{node.lineno} names {node.value!r}")
    assert not offenders, "ask the backend (mq.backend.Backend), do not name it:\n" + "\n".join(offenders)
