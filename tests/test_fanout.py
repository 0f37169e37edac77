"""Fan-out across hosts (mq.fanout.relays): real processes on network-namespace hosts.

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
from mq.fanout import relays as fanout
from mq.fanout.relays import tree_plan
from mq.testing import wait_until

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tree_and_star_plans():
    groups = [[1, 2], [3, 4], [5, 6], [7, 8]]
    assert tree_plan(groups, "star") == [[1, [2]], [3, [4]], [5, [6]], [7, [8]]]
    # binomial: the publisher sends to 1 (which then serves host 2), then to 5 and 7
    assert tree_plan(groups, "tree") == [[1, [2, [3, [4]]]], [5, [6]], [7, [8]]]
    assert tree_plan(groups, "chain") == [[1, [2, [3, [4, [5, [6, [7, [8]]]]]]]]]
    # Past 12 hosts, another chain: every plan stays within what receivers accept.
    long = tree_plan([[i] for i in range(1, 30)], "chain")
    assert len(long) == 3 and fanout._valid_plan(long) and sorted(fanout.plan_ids(long)) == list(range(1, 30))


def test_bad_relay_options_are_config_errors():
    with pytest.raises(mq.ConfigError, match="relay_shape"):
        mq.create("inproc", 0, relay_shape="ring")
    with pytest.raises(mq.ConfigError, match="relay_min_bytes"):
        mq.create("inproc", 0, relay_min_bytes=0)


class Cluster:
    """The publisher (node 0, here) and ``per_host`` subscribers on each host, numbered from 1
    host by host: with two hosts and two per host, nodes 1, 2 on host 0, 3, 4 on host 1."""

    def __init__(self, hosts, modes: dict[int, str] | None = None, per_host: int = 2):
        self.hosts = hosts
        self.procs: dict[int, subprocess.Popen] = {}
        self.q = mq.create("nng", 0, listen_to=f"tcp://{hosts.root_addr}:46000", protocol="tcp", timeout=20)
        self.q.listen()
        n = per_host * len(hosts.addrs)
        self.got: dict[int, list] = {i: [] for i in range(1, n + 1)}
        self.cv = threading.Condition()
        self.q.subscribe("got", self._got)
        addrs = {0: f"tcp://{hosts.root_addr}:46000"}
        for i in range(1, n + 1):
            host = (i - 1) // per_host
            addrs[i] = f"tcp://{hosts.addrs[host]}:{46000 + i}"
            argv = [sys.executable, "-m", "tests.jobs.fanout_peer", str(i), addrs[i], (modes or {}).get(i, "ok"),
                    *[addrs[j] for j in range(i)]]
            self.procs[i] = subprocess.Popen(hosts.command(host, argv), cwd=ROOT, stdout=subprocess.PIPE,
                                             env={**os.environ, "MQ_TEST_PEERS": str(n)}, text=True)
        for i, p in self.procs.items():
            assert p.stdout.readline().strip() == "ready", f"subscriber {i} did not start"
        self.q.wait_for_subscribers("w", n, timeout=30)

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


def _publish_in_background(q: mq.MQ, x: np.ndarray, timeout: float) -> tuple[threading.Thread, list]:
    """A thread publishing ``x`` on "w", and the list its error lands in."""
    errors: list[BaseException] = []

    def publish() -> None:
        try:
            q.publish("w", x, timeout=timeout)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=publish)
    t.start()
    return t, errors


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
@pytest.mark.parametrize("shape, copies", [("tree", 2), ("chain", 1)])
def test_relayed_publish_reaches_every_subscriber_once_with_the_publishers_id(cluster, shape, copies):
    q = cluster.q
    q.set_relay(1 << 20, shape)
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
    # One copy per host: the publisher sends to each relay (tree) or to the first (chain).
    assert st["relayed"] == 1 and st["forwarded"] == copies and st["fallback_direct"] == 0, st
    # Each relay took the frame into its pool as it arrived and gave it to its neighbour by
    # handle: nothing copied on either host (the arrays above are read-only on all four).
    for relay in (1, 3):
        shm = q.call(relay, "shm_stats", timeout=10)
        assert shm["lent"] == 1 and shm["by_handle"] == 1 and shm["copied_bytes"] == 0, (relay, shm)


@pytest.mark.netns
@pytest.mark.parametrize("cluster", [{1: "hoard", 3: "hoard"}], indirect=True)
def test_relays_that_keep_every_message_still_pass_each_on_whole(cluster):
    """Relays 1 and 3 keep what they get, so the pool slots their links read frames into stay
    lent: past half their pool (16 MiB of 32) the next frames land in the links' own buffers and
    reach the neighbours by one copy each. Nothing waits, nothing is lost."""
    q = cluster.q
    q.set_relay(1 << 20, "chain")
    xs = [np.full(6 << 20, i, dtype=np.uint8) for i in range(4)]
    for x in xs:
        assert q.publish("w", x, timeout=20) == [1, 2, 3, 4]
    cluster.wait_got(range(1, 5), len(xs))
    want = [[0, "array", [x.nbytes, int(x[::4099].sum())]] for x in xs]
    for i in range(1, 5):
        assert cluster.got[i] == want, (i, cluster.got[i])
    for relay in (1, 3):
        shm = q.call(relay, "shm_stats", timeout=10)
        # 6 MiB frames take 6.5 MiB slots: two fit in half the pool, the other two are copied.
        assert shm["lent"] == 2 and shm["by_handle"] == 2 and shm["copied_bytes"] == 2 * (6 << 20), (relay, shm)


@pytest.mark.netns
@pytest.mark.parametrize("cluster", [{2: "stall"}], indirect=True)
def test_a_relay_killed_mid_forward_is_an_error_at_the_publisher_not_a_silent_loss(cluster):
    q = cluster.q
    q.set_relay(1 << 20, "tree")  # relays 1 and 3, each with one neighbour
    x = np.ones(4 << 20, dtype=np.uint8)
    q.publish("w", x, timeout=20)  # node 2's one-message queue is now full: it never reads
    cluster.wait_got([1, 3, 4], 1)
    t, errors = _publish_in_background(q, x, timeout=60)
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


@pytest.fixture
def chain(request):
    """Subscribers 1, 2, 3 on three hosts, in a chain (the default shape over mq's tcp links):
    the publisher sends to 1, 1 to 2, 2 to 3. ``request.param``: every uplink's tc rate."""
    from mq.tools.netns import Hosts, unavailable

    if os.geteuid() != 0 or unavailable():
        pytest.skip(unavailable() or "needs root for network namespaces")
    with Hosts(3, root=True, rate=getattr(request, "param", None)) as hosts:
        c = Cluster(hosts, per_host=1)
        try:
            yield c
        finally:
            c.close()


@pytest.mark.netns
def test_a_relay_sends_on_to_the_next_host_while_the_message_still_arrives(chain):
    q = chain.q
    xs = [np.random.default_rng(seed).integers(0, 256, 12 << 20, dtype=np.uint8) for seed in range(3)]
    for x in xs:
        assert q.publish("w", x) == [1, 2, 3]
    q.publish("w", "small")
    chain.wait_got(range(1, 4), 4)
    time.sleep(0.5)  # anything extra (a duplicate) would show up now
    want = [[0, "array", [x.nbytes, int(x[::4099].sum())]] for x in xs] + [[0, "other", "small"]]
    for i in range(1, 4):
        assert chain.got[i] == want, (i, chain.got[i])
    assert q.stats().relay["relayed"] == 3 and q.stats().relay["forwarded"] == 3
    # Nodes 1 and 2 sent each message on to the next host from its header on (mq.fanout.cut_through).
    for relay in (1, 2):
        st = q.call(relay, "relay_stats", timeout=10)
        assert st["streamed"] == 3 and st["forwarded"] == 3, (relay, st)


@pytest.mark.netns
@pytest.mark.parametrize("chain", ["200mbit"], indirect=True)  # 12 MB: 0.5 s a link
def test_a_relay_killed_while_it_streams_cuts_the_message_off_downstream_and_nothing_half_arrives(chain):
    q = chain.q
    t, errors = _publish_in_background(q, np.ones(12 << 20, dtype=np.uint8), timeout=30)
    time.sleep(0.3)  # node 1 has part of it and is sending that part on to node 2
    os.kill(_leaf(chain.procs[1].pid), signal.SIGKILL)
    t.join(15)
    assert not t.is_alive(), "publish hung after a relay died mid-stream"
    assert len(errors) == 1 and isinstance(errors[0], mq.PeerLost), errors
    assert "[1, 2, 3]" in str(errors[0]), errors[0]
    assert wait_until(lambda: 1 not in q.peers(), 10)
    # Nodes 2 and 3 dropped the part they had; the next message reaches them whole, once.
    y = np.full(3 << 20, 7, dtype=np.uint8)
    assert q.publish("w", y, timeout=30) == [2, 3]
    chain.wait_got([2, 3], 1)
    time.sleep(0.5)
    want = [[0, "array", [y.nbytes, int(y[::4099].sum())]]]
    assert chain.got[2] == want and chain.got[3] == want, chain.got
