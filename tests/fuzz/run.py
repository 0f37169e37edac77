"""Runs one fuzz target (:data:`tests.fuzz.targets.TARGETS`), usually through ``scripts/fuzz``.

    python -m tests.fuzz.run TARGET [libFuzzer flags] CORPUS_DIR
        coverage-guided, under atheris: the modules of mq the target tests are instrumented
        as they are imported (tests.fuzz.INSTRUMENTED), and its structure-aware mutator
        (tests.fuzz.mutate) has half of libFuzzer's mutations. Exits non-zero on a crash,
        after libFuzzer wrote the input to -artifact_prefix.
    python -m tests.fuzz.run --hypothesis TARGET SECONDS CORPUS_DIR ARTIFACT_DIR
        where atheris is not installed: random and mutated corpus inputs for SECONDS seconds,
        shrunk to a small crasher on failure; prints its stats as libFuzzer does (the
        ``stat::`` lines and ``Test unit written to``), so scripts/fuzz reads both alike.

Targets that can only make their seeds at run time (the shm pool's descriptors) add them to
CORPUS_DIR first.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from tests.fuzz import INSTRUMENTED, NAMES
from tests.fuzz.mutate import MUTATORS

#: The largest input either mode makes.
MAX_LEN = 8192


def add_dynamic_seeds(name: str, corpus: str, targets: Any) -> None:
    make = targets.DYNAMIC_SEEDS.get(name)
    for i, seed in enumerate(make() if make else ()):
        with open(os.path.join(corpus, f"seed-runtime-{i}"), "wb") as f:
            f.write(seed)


def fuzz_with_atheris(name: str, args: list[str]) -> None:
    import atheris

    others = [m for m in _mq_modules() if m not in INSTRUMENTED[name]]
    with atheris.instrument_imports(include=["mq"], exclude=others):
        from tests.fuzz import targets
    if name == "codec":
        # Before libFuzzer registers its exit handler (in Fuzz), so torch's atexit handlers run
        # after it, that is never (it _exits). Run first, at a crash, they could stall the
        # process until libFuzzer's -timeout alarm killed it, the crasher unwritten.
        import torch  # noqa: F401  (the codec loads it for tensor payloads)
    target = targets.TARGETS[name]
    corpora = [a for a in args if not a.startswith("-")]
    if corpora:
        add_dynamic_seeds(name, corpora[0], targets)

    def one_input(data: bytes) -> None:
        target(data)

    options = {}
    structural = MUTATORS.get(name)
    if structural is not None:
        options["custom_mutator"] = lambda data, max_size, seed: structural(data, max_size, seed, atheris.Mutate)
    atheris.Setup([sys.argv[0], f"-max_len={MAX_LEN}", *args], one_input, **options)
    atheris.Fuzz()


def _mq_modules() -> list[str]:
    """Every module of the mq package, found on disk (importing mq now would be too early)."""
    import importlib.util

    root = importlib.util.find_spec("mq").submodule_search_locations[0]  # type: ignore[union-attr]
    out = []
    for folder, _dirs, files in os.walk(root):
        package = "mq" if folder == root else "mq." + os.path.relpath(folder, root).replace(os.sep, ".")
        out += [package if f == "__init__.py" else f"{package}.{f[:-3]}" for f in files if f.endswith(".py")]
    return out


def fuzz_with_hypothesis(name: str, seconds: float, corpus: str, artifacts: str) -> int:
    from hypothesis import HealthCheck, given, settings

    from tests.fuzz import targets

    add_dynamic_seeds(name, corpus, targets)
    target = targets.TARGETS[name]
    runs = [0]
    failed: list[bytes] = []

    @settings(max_examples=500, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(hypothesis_inputs(name, read_corpus(corpus)))
    def batch(data: bytes) -> None:
        runs[0] += 1
        try:
            target(data)
        except BaseException:
            failed[:] = [data]  # hypothesis replays the smallest failing input last
            raise

    started = time.monotonic()
    error: BaseException | None = None
    for data in read_corpus(corpus):  # as libFuzzer does: the corpus first, crashers included
        runs[0] += 1
        try:
            target(data)
        except Exception as exc:
            error, failed[:] = exc, [data]
            break
    while time.monotonic() - started < seconds and error is None:
        try:
            batch()
        except Exception as exc:
            error = exc
    elapsed = max(time.monotonic() - started, 1e-9)
    print(f"stat::number_of_executed_units: {runs[0]}")
    print(f"stat::average_exec_per_sec: {int(runs[0] / elapsed)}")
    print("stat::new_units_added: 0")
    if error is None:
        return 0
    path = os.path.join(artifacts, f"crash-{failed[0][:8].hex() or 'empty'}")
    with open(path, "wb") as f:
        f.write(failed[0])
    print(f"=== Uncaught Python exception: ===\n{type(error).__name__}: {error}")
    print(f"Test unit written to {path}")
    return 1


def read_corpus(folder: str, prefix: str = "") -> list[bytes]:
    """The inputs in ``folder`` whose names start with ``prefix`` (``seed-``: no crashers)."""
    out = []
    for name in sorted(os.listdir(folder)):
        if name.startswith(prefix):
            with open(os.path.join(folder, name), "rb") as f:
                out.append(f.read())
    return out or [b""]


def hypothesis_inputs(name: str, seeds: list[bytes]) -> Any:
    """Inputs for target ``name`` as a hypothesis strategy: random bytes, seeds with bytes
    overwritten and cut, and seeds through the target's structure-aware mutator."""
    from hypothesis import strategies as st

    structural = MUTATORS.get(name, lambda data, max_size, seed, bytewise: data)
    return st.one_of(
        st.binary(max_size=MAX_LEN),
        st.builds(_overwrite, st.sampled_from(seeds), st.lists(st.tuples(
            st.integers(0, MAX_LEN), st.integers(0, 255)), max_size=8), st.integers(0, MAX_LEN)),
        st.builds(lambda data, seed: structural(data, MAX_LEN, seed, lambda d, _n: d),
                  st.sampled_from(seeds), st.integers(0, 2**32)))


def _overwrite(seed: bytes, edits: list[tuple[int, int]], cut: int) -> bytes:
    """``seed`` with some bytes overwritten, then cut at ``cut`` (when shorter)."""
    out = bytearray(seed)
    for pos, value in edits:
        if out:
            out[pos % len(out)] = value
    return bytes(out[:cut])


def main(argv: list[str]) -> int:
    hypothesis_mode = argv[:1] == ["--hypothesis"]
    rest = argv[1:] if hypothesis_mode else argv
    if not rest or rest[0] not in NAMES:
        print(__doc__, f"targets: {' '.join(NAMES)}", sep="\n", file=sys.stderr)
        return 2
    if hypothesis_mode:
        name, seconds, corpus, artifacts = rest
        return fuzz_with_hypothesis(name, float(seconds), corpus, artifacts)
    fuzz_with_atheris(rest[0], rest[1:])
    return 0  # not reached: libFuzzer exits the process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
