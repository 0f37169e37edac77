"""`mq top` and metrics against a running 3-node job (real processes): the table shows every
node and topic, the JSON numbers agree with what the nodes sent, Prometheus text is served."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytestmark = pytest.mark.timeout(120)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SENT = 40

# One node of the job: node 0 sends SENT messages of 1000 bytes on "obs" to node 1 and publishes
# weights (LatestWins) that nodes 1 and 2 act with; every node serves its metrics.
_NODE = """
import os, sys, time
import numpy as np
import mq, mq.telemetry
me, ports, stop_file = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]
addr = [f"tcp://127.0.0.1:{p}" for p in ports]
q = mq.create("nng", me, {"learner" if me == 0 else "collector"}, listen_to=addr[me], attach_to=addr[:me],
              timeout=20)
with q:
    mq.telemetry.serve(q)
    q.wait_for_peers(2, timeout=30)
    if me == 0:
        weights = mq.LatestWins(q, "weights")
        q.wait_for_subscribers("weights", 2, timeout=30)
        for i in range(%(sent)d):
            q.send(1, "obs", np.zeros(1000, np.uint8))
        for v in range(3):
            weights.publish({"w": np.full(10, v)})
    else:
        weights = mq.LatestWins(q, "weights", subscribe=True)
        if me == 1:
            q.subscribe("obs")
            for i in range(%(sent)d):
                q.recv(timeout=20)
        v = weights.wait_newer(1, timeout=30)
        weights.acting(v.number - (me == 2))  # node 2 acts one version behind
    print("ready", flush=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(stop_file) and time.monotonic() < deadline:
        time.sleep(0.05)
""" % {"sent": SENT}


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _mq(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mq.cli.main", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    stop = tmp_path_factory.mktemp("job") / "stop"
    ports = _free_ports(3)
    procs = [subprocess.Popen([sys.executable, "-c", _NODE, str(i), ",".join(map(str, ports)), str(stop)],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(3)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", p.stderr.read() if p.poll() is not None else ""
        yield f"tcp://127.0.0.1:{ports[0]}"
    finally:
        stop.write_text("")
        for p in procs:
            _reap(p, 20)


def _reap(proc: subprocess.Popen, timeout: float) -> None:
    """Wait for a process we started; kill it if it does not end in time."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_top_once_renders_every_node(job):
    p = _mq("top", "--attach-to", job, "--once")
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    assert "mq top - 3 node(s)" in out, out
    for cell in ("learner", "collector", "obs", "weights", "policy lag", "shm"):
        assert cell in out, out
    assert "weights[1:0 2:1]" in out, out  # node 2 acts one version behind


def test_top_json_numbers_agree_with_what_was_sent(job):
    p = _mq("top", "--attach-to", job, "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    nodes = json.loads(p.stdout)
    assert sorted(nodes) == ["0", "1", "2"]
    sent, got = nodes["0"]["topics"]["obs"], nodes["1"]["topics"]["obs"]
    assert sent["sent"] == got["received"] == SENT
    assert got["received_bytes"] >= SENT * 1000
    assert 0 <= got["received_per_s"] <= SENT / 0.001  # a rate over the window since the last call
    assert got["latency_p50_ms"] is not None and 0 <= got["latency_p50_ms"] <= got["latency_p99_ms"] < 5000
    assert nodes["0"]["policy_lag"] == {"weights": {"1": 0, "2": 1}}
    assert nodes["0"]["routes"]["1"] == nodes["0"]["routes"]["2"] == "shm"
    assert sorted(nodes["0"]["routes"]) == ["1", "2"], "the watcher (mq top's own node) shows as a peer"


def test_top_serves_prometheus_text(job):
    port = _free_ports(1)[0]
    proc = subprocess.Popen([sys.executable, "-m", "mq.cli.main", "top", "--attach-to", job, "--interval", "0.5",
                             "--prometheus", str(port)], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        text, deadline = "", time.monotonic() + 30
        while 'mq_messages_sent{node="0",topic="obs"} 40.0' not in text and time.monotonic() < deadline:
            time.sleep(0.3)
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            except OSError:
                continue
        assert 'mq_messages_sent{node="0",topic="obs"} 40.0' in text, text[-2000:]
        assert 'mq_policy_lag{channel="weights",node="0",peer="2"} 1.0' in text
    finally:
        proc.terminate()
        _reap(proc, 10)


def test_top_live_view_refreshes(job):
    proc = subprocess.Popen([sys.executable, "-m", "mq.cli.main", "top", "--attach-to", job, "--interval", "0.3"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate(timeout=8)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
    assert out.count("mq top - 3 node(s)") >= 2, out[-3000:]  # refreshed, every node each time


def test_top_says_when_nobody_answers():
    port = _free_ports(1)[0]
    p = _mq("top", "--attach-to", f"tcp://127.0.0.1:{port}", "--once", "--timeout", "1")
    assert p.returncode == 1 and "no node answered at" in p.stderr, p.stderr
