"""Fan-out across hosts (mq.fanout): real processes on network-namespace hosts.

The publisher is this process, on this host; subscribers run two per namespace host
(mq.tools.netns.Hosts: own network, PID and IPC namespaces per host, one bridge).
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
from mq.fanout import tree_plan

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tree_and_star_plans():
    groups = [[1, 2], [3, 4], [5, 6], [7, 8]]
    assert tree_plan(groups, "star") == [[1, [2]], [3, [4]], [5, [6]], [7, [8]]]
    # binomial: the publisher sends to 1 (which then serves host 2), then to 5 and 7
    assert tree_plan(groups, "tree") == [[1, [2, [3, [4]]]], [5, [6]], [7, [8]]]


def test_bad_relay_options_are_config_errors():
    with pytest.raises(mq.ConfigError, match="relay_shape"):
        mq.create("inproc", 0, relay_shape="ring")
    with pytest.raises(mq.ConfigError, match="relay_min_bytes"):
        mq.create("inproc", 0, relay_min_bytes=0)


@pytest.fixture
def two_hosts():
    from mq.tools.netns import Hosts, unavailable

    if os.geteuid() != 0 or unavailable():
        pytest.skip(unavailable() or "needs root for network namespaces")
    with Hosts(2, root=True) as hosts:
        yield hosts


class Cluster:
    """The publisher (node 0, here) and subscribers 1..4: nodes 1, 2 on host 0, 3, 4 on host 1."""

    def __init__(self, hosts, modes: dict[int, str] | None = None):
        self.hosts = hosts
        self.procs: dict[int, subprocess.Popen] = {}
        self.q = mq.create("nng", 0, listen_to=f"tcp://{hosts.root_addr}:46000", protocol="tcp", timeout=20)
        self.q.listen()
        self.got: dict[int, list] = {i: [] for i in range(1, 5)}
        self.cv = threading.Condition()
        self.q.subscribe("got", self._got)
        addrs = {0: f"tcp://{hosts.root_addr}:46000"}
        for i in range(1, 5):
            host = (i - 1) // 2
            addrs[i] = f"tcp://{hosts.addrs[host]}:{46000 + i}"
            argv = [sys.executable, "-m", "tests.jobs.fanout_peer", str(i), addrs[i], (modes or {}).get(i, "ok"),
                    *[addrs[j] for j in range(i)]]
            self.procs[i] = subprocess.Popen(hosts.command(host, argv), cwd=ROOT, stdout=subprocess.PIPE,
                                             env={**os.environ, "MQ_TEST_PEERS": "4"}, text=True)
        for i, p in self.procs.items():
            assert p.stdout.readline().strip() == "ready", f"subscriber {i} did not start"
        self.q.wait_for_subscribers("w", 4, timeout=30)

    def _got(self, m: mq.Message) -> None:
        with self.cv:
            self.got[m.sender].append(m.payload)
            self.cv.notify_all()

    def wait_got(self, ids, n: int, timeout: float = 30) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: all(len(self.got[i]) >= n for i in ids), timeout), self.got

    def close(self) -> None:
        try:
            self.q.stop(timeout=2)
        finally:
            for p in self.procs.values():
                if p.poll() is None:
                    p.kill()
                p.wait(10)


def _leaf(pid: int) -> int:
    """The last descendant of ``pid`` (nsenter forks once to enter the PID namespace)."""
    while True:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = f.read().split()
        if not kids:
            return pid
        pid = int(kids[0])


@pytest.fixture
def cluster(two_hosts, request):
    c = Cluster(two_hosts, getattr(request, "param", None))
    yield c
    c.close()


@pytest.mark.netns
def test_relayed_publish_reaches_every_subscriber_once_with_the_publishers_id(cluster):
    q = cluster.q
    assert len({q.host_of(i) for i in range(1, 5)}) == 2
    assert q.host_of(1) != q.host_of(0)
    x = np.random.default_rng(1).integers(0, 256, 8 << 20, dtype=np.uint8)
    assert q.publish("w", x) == [1, 2, 3, 4]
    q.send(2, "w", "after")  # a small direct message must not overtake the relayed one
    q.publish("w", "small")  # below relay_min_bytes: direct to each
    cluster.wait_got(range(1, 5), 2)
    cluster.wait_got([2], 3)
    time.sleep(0.5)  # anything extra (a duplicate) would show up now
    for i in range(1, 5):
        want = [[0, "array", [x.nbytes, int(x[::4099].sum())]]] + ([[0, "other", "after"]] if i == 2 else [])
        assert cluster.got[i] == want + [[0, "other", "small"]], (i, cluster.got[i])
    st = q.stats().relay
    assert st["relayed"] == 1 and st["forwarded"] == 2 and st["fallback_direct"] == 0, st  # one copy per host


@pytest.mark.netns
@pytest.mark.parametrize("cluster", [{2: "stall"}], indirect=True)
def test_a_relay_killed_mid_forward_is_an_error_at_the_publisher_not_a_silent_loss(cluster):
    q = cluster.q
    x = np.ones(4 << 20, dtype=np.uint8)
    q.publish("w", x, timeout=20)  # node 2's one-message queue is now full: it never reads
    cluster.wait_got([1, 3, 4], 1)
    errors: list[BaseException] = []

    def publish() -> None:
        try:
            q.publish("w", x, timeout=60)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=publish)
    t.start()
    cluster.wait_got([1, 3, 4], 2)  # node 1 (the relay) has it and now waits on node 2
    time.sleep(0.5)
    assert t.is_alive()
    os.kill(_leaf(cluster.procs[1].pid), signal.SIGKILL)  # the python under nsenter
    killed = time.monotonic()
    t.join(15)
    assert not t.is_alive(), "publish hung after its relay died"
    took = time.monotonic() - killed
    assert len(errors) == 1 and isinstance(errors[0], mq.PeerLost), errors
    text = str(errors[0])
    assert "[1, 2]" in text and "relay node 1" in text, text
    assert took < q.peer_timeout + q.heartbeat + 1, took
    print(f"publisher learned in {took:.2f}s: {text}")
