"""The waiting policy of mq.backends.nng.busypoll on its own: what it spins, for how long, when it
stops (the transport-level behaviour is in tests/test_nng.py, over real links)."""

from __future__ import annotations

import time

import pytest

from mq.backends.nng.busypoll import BusyPoll


class Source:
    """A probe that finds something on its ``ready_at``-th look; counts the looks."""

    def __init__(self, ready_at=None):
        self.ready_at = ready_at
        self.looks = 0

    def probe(self):
        self.looks += 1
        return "frame" if self.ready_at is not None and self.looks >= self.ready_at else None


def idle(**options) -> BusyPoll:
    """A BusyPoll on an idle machine, whatever this one is doing: a yield returns at once and
    the run queue is empty (on a loaded CI machine the real ones turned spinning off)."""
    return BusyPoll(yield_=lambda: None, runnable=lambda: 0, **options)


@pytest.fixture
def calm(monkeypatch):
    """No yield counts as slow: on a loaded machine this thread may lose its core around one."""
    from mq.backends.nng import busypoll

    monkeypatch.setattr(busypoll, "CROWDED_YIELD_S", 60.0)


def test_a_prompt_frame_is_found_spinning_without_blocking(calm):
    bp, src = idle(), Source(ready_at=5)
    assert bp.wait(src.probe, lambda: "blocked") == "frame"
    assert (bp.spun, bp.found, src.looks) == (1, 1, 5)


def test_a_spin_lasts_the_window_then_blocks(calm):
    bp, src = idle(window=0.01), Source()
    start = time.perf_counter()
    assert bp.wait(src.probe, lambda: "blocked") == "blocked"
    assert time.perf_counter() - start >= 0.01
    assert (bp.spun, bp.found) == (1, 0) and src.looks > 1


def test_after_long_waits_it_blocks_at_once_and_spins_again_once_waits_are_short(calm):
    bp = idle(window=0.001)
    for _ in range(2):
        bp.wait(Source().probe, lambda: time.sleep(0.01) or "late")  # 10x the window
    spun = bp.spun
    src = Source()
    assert bp.wait(src.probe, lambda: "late") == "late"
    assert (bp.spun, src.looks) == (spun, 1)  # one look, no spin
    for _ in range(20):  # frames waiting already: waits of ~0 s pull the mean down
        bp.wait(Source(ready_at=2).probe, lambda: "late")
    assert bp.typical < bp.window
    src = Source(ready_at=3)
    assert bp.wait(src.probe, lambda: "late") == "frame" and src.looks == 3


def test_disabled_never_probes():
    bp, src = BusyPoll(enabled=False), Source(ready_at=1)
    assert bp.wait(src.probe, lambda: "blocked") == "blocked"
    assert (bp.spun, src.looks) == (0, 0)


def test_a_crowded_machine_turns_spinning_off_for_a_while():
    """A yield that takes long means another thread had the core: every core is taken (an RL
    machine stepping environments), and spinning only costs the waiter its turn. It blocks at
    once then, for CROWDED_S, and spins again afterwards."""
    from mq.backends.nng import busypoll

    slow_yield = lambda: time.sleep(0.0005)  # noqa: E731 - the scheduler ran somebody else for 0.5 ms
    bp = BusyPoll(yield_=slow_yield, runnable=lambda: 0, window=1.0)  # (a long window: a busy CI machine)
    assert bp.wait(Source().probe, lambda: "blocked") == "blocked"
    assert bp.crowded == 1
    src = Source(ready_at=2)
    assert bp.wait(src.probe, lambda: "blocked") == "blocked" and src.looks == 0  # no probe, no spin while crowded
    bp._quiet_until = 0.0  # CROWDED_S later
    bp._yield = lambda: None  # an idle machine: a yield returns at once
    src = Source(ready_at=6)
    assert bp.wait(src.probe, lambda: "blocked") == "frame"
    assert busypoll.CROWDED_S >= 0.05


def test_more_runnable_threads_than_cores_twice_in_a_row_turns_spinning_off():
    """The run queue, looked at every CROWDED_S: once full is a passing thread, twice in a row
    is a crowded machine (every core stepping environments): no spinning until it empties."""
    import os

    from mq.backends.nng import busypoll

    cores = len(os.sched_getaffinity(0))
    queue = [cores + 2]
    bp = BusyPoll(runnable=lambda: queue[0], yield_=lambda: None)
    src = Source(ready_at=3)
    assert bp.wait(src.probe, lambda: "blocked") == "frame" and bp.crowded == 0  # the first full look
    bp._look_at = 0.0  # CROWDED_S later: full again
    src = Source(ready_at=3)
    assert bp.wait(src.probe, lambda: "blocked") == "blocked" and src.looks == 1 and bp.crowded == 1
    bp._quiet_until = bp._look_at = 0.0
    queue[0] = 1  # the machine emptied
    src = Source(ready_at=3)
    assert bp.wait(src.probe, lambda: "blocked") == "frame"
    assert busypoll._runnable() >= 1  # the real count: at least this thread
