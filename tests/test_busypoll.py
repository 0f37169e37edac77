"""The waiting policy of mq.backends.nng.busypoll on its own: what it spins, for how long, when it
stops (the transport-level behaviour is in tests/test_nng.py, over real links)."""

from __future__ import annotations

import time

from mq.backends.nng.busypoll import BusyPoll


class Source:
    """A probe that finds something on its ``ready_at``-th look; counts the looks."""

    def __init__(self, ready_at=None):
        self.ready_at = ready_at
        self.looks = 0

    def probe(self):
        self.looks += 1
        return "frame" if self.ready_at is not None and self.looks >= self.ready_at else None


def test_a_prompt_frame_is_found_spinning_without_blocking():
    bp, src = BusyPoll(), Source(ready_at=5)
    assert bp.wait(src.probe, lambda: "blocked") == "frame"
    assert (bp.spun, bp.found, src.looks) == (1, 1, 5)


def test_a_spin_lasts_the_window_then_blocks():
    bp, src = BusyPoll(window=0.01), Source()
    start = time.perf_counter()
    assert bp.wait(src.probe, lambda: "blocked") == "blocked"
    assert time.perf_counter() - start >= 0.01
    assert (bp.spun, bp.found) == (1, 0) and src.looks > 1


def test_after_long_waits_it_blocks_at_once_and_spins_again_once_waits_are_short():
    bp = BusyPoll(window=0.001)
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
