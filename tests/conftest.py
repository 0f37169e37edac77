"""Shared test setup: every test is bounded, GPU tests skip without a GPU, and no test may
leave child processes behind."""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import sys

import pytest

# The conformance checks assert in the library: show their operands as pytest does in tests.
pytest.register_assert_rewrite("mq.conformance")

# UCX (the rdma tests, in this process and their peers) warns at exit about a request that a pull
# cut short by a killed peer left in flight ("... was not returned to mpool"): expected there, and
# it printed after pytest's summary. The tests assert behaviour; UCX keeps its errors.
os.environ.setdefault("UCX_LOG_LEVEL", "error")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--background-load", type=int, default=0, metavar="N",
                     help="run the tests with N CPU-bound processes busy the whole session (mq.tools.load): "
                          "what must hold on a saturated machine holds there")
    parser.addoption("--long", action="store_true", default=os.environ.get("MQ_LONG") == "1",
                     help="also run the tests marked long (the stress counts and the longest "
                          "scenarios); MQ_LONG=1 does the same")


@pytest.fixture(scope="session", autouse=True)
def background_load(request: pytest.FixtureRequest):
    """``--background-load N``: N CPU-bound processes for the whole session."""
    from mq.tools.load import BackgroundLoad

    with BackgroundLoad(request.config.getoption("--background-load")) as load:
        yield load


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    skip = pytest.mark.skip(reason="no CUDA GPU visible")
    short = pytest.mark.skip(reason="long: run with `bash scripts/test --long` (or MQ_LONG=1)")
    long_too = config.getoption("--long")
    for item in items:
        # The marker, not the keyword: a parameter id such as "cuda" is a keyword too.
        if item.get_closest_marker("cuda") is not None and not has_gpu:
            item.add_marker(skip)
        if item.get_closest_marker("long") is not None and not long_too:
            item.add_marker(short)


_REAL_STDERR: list[int] = []  # a copy of fd 2 from before pytest captures it


def pytest_configure(config: pytest.Config) -> None:
    _REAL_STDERR.append(os.dup(sys.__stderr__.fileno()))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    """pytest-timeout's signal ends a test stuck in Python, but never one stuck inside a C call
    (a library's deadlock: NNG's reaper once waited for itself and CI sat out its 90 minutes).
    Past twice its timeout and a minute, every thread's stack is printed and the run ends."""
    marker = item.get_closest_marker("timeout")
    timeout = float(marker.args[0] if marker is not None and marker.args else item.config.getini("timeout") or 0)
    if timeout > 0:
        faulthandler.dump_traceback_later(2 * timeout + 60, exit=True, file=_REAL_STDERR[0])
    try:
        yield
    finally:
        if timeout > 0:
            faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def no_leaked_children():
    """Fail a test that leaves child processes running."""
    before = {p.pid for p in multiprocessing.active_children()}
    yield
    leaked = [p for p in multiprocessing.active_children() if p.pid not in before]
    for p in leaked:
        p.kill()
        p.join(2)
    assert not leaked, f"test left {len(leaked)} child process(es) running: {leaked}"


@pytest.fixture
def two_hosts():
    """Two network-namespace hosts joined to this one (mq.tools.netns.Hosts, root=True); the
    test skips, saying why, without root or iproute2."""
    from mq.tools.netns import Hosts, unavailable

    if os.geteuid() != 0 or unavailable():
        pytest.skip(unavailable() or "needs root for network namespaces")
    with Hosts(2, root=True) as hosts:
        yield hosts


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config):
    """Last: what did not run, grouped by why (each reason says what makes it run), so that a
    skip does not pass for a pass (DI-engine tests without .ding-venv, GPU tests without a GPU)."""
    yield
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    groups: dict[str, int] = {}
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        groups[reason] = groups.get(reason, 0) + 1
    terminalreporter.section(f"not run: {len(skipped)} tests, by reason")
    for reason, n in sorted(groups.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{n:5d}  {reason}")
