"""A dead peer always ends a wait: a sender blocked on a consumer that is SIGKILLed gets
PeerLost, on every nng route, whichever wait it is blocked in, idle and with every core busy.

Each case runs several times in a row: the race this guards against (a send blocked towards a
slow consumer on the tcp route that never learnt of its death) showed 1 run in 3 on a loaded
machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import mq
from mq.tools.load import BackgroundLoad

pytestmark = pytest.mark.timeout(240)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = int(os.environ.get("MQ_TEST_DEATH_RUNS", "4"))  # 10 for a closing note's counts
# The consumer's queue and the sender's messages: where the sender ends up waiting differs by
# route (its window of unconfirmed frames, a full socket, the peer's shm pool).
STREAMS = {"small": ("8,268435456", 1 << 10), "large": ("1024,1", 256 << 10)}


def _one_run(route: str, queue: str, size: int) -> tuple[str, float]:
    """Block a sender on a stalled consumer, SIGKILL it; what the send raised, and when."""
    node = mq.create("nng", 0, "learner", listen_to="tcp://127.0.0.1:0", protocol=route, timeout=30)
    with node:
        env = {**os.environ, "MQ_TEST_PROTOCOL": route, "MQ_TEST_QUEUE": queue}
        proc = subprocess.Popen([sys.executable, "-m", "tests.jobs.nng_peer", "1", node.addresses["tcp"], "hang"],
                                cwd=REPO, stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert proc.stdout.readline().strip() == "ready"
            node.wait_for_peers(ids=[1], timeout=20)
            sent, outcome = [0], {}
            payload = np.zeros(size, np.uint8)

            def flood() -> None:
                try:
                    while True:
                        node.send(1, "work", payload, timeout=30)
                        sent[0] += 1
                except BaseException as exc:  # noqa: BLE001 - the outcome under test
                    outcome["error"], outcome["at"] = exc, time.monotonic()

            sender = threading.Thread(target=flood, daemon=True)
            sender.start()
            last, still_since = -1, time.monotonic()
            while time.monotonic() - still_since < 0.5:  # blocked: nothing accepted for 0.5 s
                if sent[0] != last:
                    last, still_since = sent[0], time.monotonic()
                assert sender.is_alive(), outcome
                time.sleep(0.05)
            killed = time.monotonic()
            os.kill(proc.pid, signal.SIGKILL)
            sender.join(15)
            assert not sender.is_alive(), f"route {route}: the send blocked on a dead peer never returned"
            return type(outcome["error"]).__name__, outcome["at"] - killed
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("load", [0, 2], ids=["idle", "loaded"])
@pytest.mark.parametrize("stream", sorted(STREAMS))
@pytest.mark.parametrize("route", ["tcp", "ipc", "auto"])
def test_a_send_blocked_on_a_sigkilled_peer_raises_peer_lost(route, stream, load):
    with BackgroundLoad(load):
        outcomes = [_one_run(route, *STREAMS[stream]) for _ in range(RUNS)]
    for error, after in outcomes:
        assert error == "PeerLost", outcomes
        # The link's end is seen at once; the heartbeat (peer_timeout 4 s) is only the backstop.
        assert after < 3.0, outcomes
