"""Trust and failure on real sockets: a stranger cannot join, inject, spoof, hijack or cut a
node off; a dead peer is known at once (SIGKILL) or within the heartbeat bound (a host gone
without FIN); oversized frames fail at the sender; the secret is private by default."""

from __future__ import annotations

import os
import random
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pynng
import pytest

import mq
from mq.testing import wait_until
from mq import auth
from mq.backends.nng.links import tcp as tcplink
from mq.wire.codec import BYE, HELLO, LINK, MSG
from tests.strangers import fake_hello, raw_frame, send_as_strangers, stranger

pytestmark = pytest.mark.timeout(90)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def learner():
    q = mq.create("nng", 0, "learner", timeout=3)
    with q:
        q.subscribe("work")
        q.on("echo", lambda x: x)
        yield q
        # These tests SIGKILL their peer: a frame it had not yet confirmed (its call's request,
        # answered but not acknowledged) is reported by stop(), rightly, and is not what they test.
        q.stop(raise_undelivered=False)


def peer(q: mq.MQ, mode: str = "hang", node_id: int = 1, pre: list[str] | None = None,
         listen: str | None = None, tls: dict | None = None, protocol: str | None = None) -> subprocess.Popen:
    import json

    env = dict(os.environ, **({"MQ_TEST_LISTEN": listen} if listen else {}),
               **({"MQ_TEST_TLS": json.dumps(tls)} if tls else {}),
               **({"MQ_TEST_PROTOCOL": protocol} if protocol else {}))
    proc = subprocess.Popen([*(pre or []), sys.executable, "-m", "tests.jobs.nng_peer", str(node_id),
                             q.addresses["tcp"], mode],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline().strip()
    assert line == "ready", proc.stderr.read()[-3000:]
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
    proc.stdout.close()
    proc.stderr.close()


# ---------------------------------------------------------------------- strangers
def test_a_node_with_another_secret_never_joins(learner):
    intruder = mq.create("nng", 7, secret="not-this-jobs-secret", attach_to=[learner.addresses["tcp"]], timeout=2)
    with intruder:
        with pytest.raises(mq.Timeout):
            intruder.wait_for_peers(1, timeout=2)
        assert intruder.stats().rejected.get("bad_proof", 0) >= 1  # our ACK failed its check too
        assert 7 not in learner.peers()
    assert wait_until(lambda: learner.stats().rejected.get("join_incomplete", 0) >= 1, 8)
    assert 7 not in learner.peers()


@pytest.mark.parametrize("family", ["tcp", "ipc", "unix", "tcplink"])
def test_frames_without_a_handshake_are_refused_counted_and_their_link_closed(learner, family):
    send_as_strangers(learner.addresses, family, [raw_frame(MSG, 1, {"cmd": "rm -rf"})] * 5)
    assert wait_until(lambda: learner.stats().rejected.get("unauthenticated", 0) >= 5)
    with pytest.raises(mq.Timeout):
        learner.recv(timeout=0.3)


@pytest.mark.parametrize("family", ["tcp", "ipc", "unix", "tcplink"])
def test_spoofed_sender_hijacked_id_and_forged_farewell_change_nothing(learner, family):
    proc = peer(learner)
    try:
        learner.wait_for_peers(ids=[1], timeout=10)
        send_as_strangers(learner.addresses, family, [
            raw_frame(MSG, 1, "spoofed: I am node 1"),                           # spoof a live id
            raw_frame(BYE, 1, {"rx": 0}),                                        # forged farewell
            raw_frame(LINK, 1, {"node_id": 1, "incarnation": "x", "read_ok": False,
                                "proof": b"0" * 32}, topic="")])                 # forged proof
        assert wait_until(lambda: sum(learner.stats().rejected.values()) >= 3)
        # A member-looking HELLO for the live id 1 from another process: refused, not a takeover.
        thief = mq.create("nng", 1, attach_to=[learner.addresses["tcp"]], timeout=2)
        with thief:
            with pytest.raises(mq.ConfigError, match=r"node id 1 is taken by a live process .*unique node id"):
                thief.wait_for_peers(1, timeout=5)
        assert learner.stats().rejected.get("duplicate_id", 0) >= 1
        assert 1 in learner.peers()
        assert learner.call(1, "echo", "still you", timeout=5) == "still you"  # the real node 1
        with pytest.raises(mq.Timeout):
            learner.recv(timeout=0.2)  # nothing spoofed reached the queue
    finally:
        stop(proc)


def test_garbage_and_a_join_flood_leave_the_node_serving_and_stop_bounded():
    q = mq.create("nng", 0, timeout=2)
    q.listen()
    try:
        rng = random.Random(7)
        garbage = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))) for _ in range(50)]
        send_as_strangers(q.addresses, "tcp", garbage)
        s = stranger(q.addresses, "tcp")
        for n in range(300):  # well-formed fake joins pointing back at an address nobody listens on
            s.send(raw_frame(HELLO, 1000 + n, fake_hello(1000 + n, "tcp://127.0.0.1:9"), topic=""))
        s.close()
        assert wait_until(lambda: sum(q.stats().rejected.values()) + q.stats().dropped_malformed >= 50, 20)
        assert wait_until(lambda: q.stats().rejected.get("join_incomplete", 0) >= 300 - 64, 20)
        assert q._join.pending_count() <= 64 and q.peers() == []
    finally:
        t0 = time.monotonic()
        q.stop(timeout=3.0)
        assert time.monotonic() - t0 < 4.5


def test_forged_hellos_naming_a_port_that_drops_syns_do_not_stall_the_node(learner):
    # A HELLO proves nothing yet, and answering it opens a link to the address it names: a tcp
    # link's connect to a port that drops SYNs waits up to 2 s. Those waits happen off the I/O
    # thread, so a stranger's flood of such HELLOs leaves the node serving its real peers.
    blackhole = socket.socket()
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(0)
    filler = socket.create_connection(blackhole.getsockname(), 2)  # the backlog is full: SYNs drop
    sink = f"tcp://127.0.0.1:{blackhole.getsockname()[1]}"
    proc = peer(learner)
    s = stranger(learner.addresses, "tcp")
    try:
        learner.wait_for_peers(ids=[1], timeout=10)
        for n in range(10):
            hello = dict(fake_hello(1000 + n, sink), addresses={"tcp": sink, "tcplink": sink})
            s.send(raw_frame(HELLO, 1000 + n, hello, topic=""))
        time.sleep(0.3)  # the HELLOs arrived and wait for their answers
        t0 = time.monotonic()
        for _ in range(5):
            assert learner.call(1, "echo", "served", timeout=5) == "served"
        took = time.monotonic() - t0
        print(f"5 calls during a flood of 10 HELLOs naming a SYN sink: {took:.3f}s")
        assert took < 1.5, took  # 10 connects on the I/O thread would have taken ~20 s
    finally:
        s.close()
        stop(proc)
        filler.close()
        blackhole.close()


# ---------------------------------------------------------------------- failures
@pytest.mark.parametrize("protocol", ["auto", "tcp"])  # a unix link, a tcp link
def test_a_blocked_sender_gets_peer_lost_within_a_second_of_sigkill(protocol):
    learner = mq.create("nng", 0, "learner", protocol=protocol, timeout=3).listen()
    proc = peer(learner, "stall", protocol=protocol)
    try:
        learner.wait_for_peers(ids=[1], timeout=10)
        learner.wait_for_subscribers("work", 1, timeout=10)
        outcome: dict = {}

        def flood() -> None:
            try:
                for i in range(100_000):
                    learner.send(1, "work", np.zeros(64 << 10, np.uint8), timeout=30)
            except mq.MQError as exc:
                outcome["error"], outcome["t"] = exc, time.monotonic()

        t = threading.Thread(target=flood, daemon=True)
        t.start()
        time.sleep(1.5)  # the receiver's queue and the socket buffers are full: send() waits
        assert t.is_alive()
        killed = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        t.join(5)
        assert isinstance(outcome.get("error"), mq.PeerLost), outcome
        print(f"blocked send -> PeerLost {outcome['t'] - killed:.3f}s after SIGKILL: {outcome['error']}")
        assert outcome["t"] - killed < 1.0
        assert "never acknowledged" in str(outcome["error"])  # what was in flight is reported
        with pytest.raises(mq.PeerLost, match="never acknowledged"):
            learner.flush(1, timeout=1)
    finally:
        stop(proc)
        learner.stop()


def test_a_node_that_comes_back_as_a_new_process_rejoins_once(learner):
    first = peer(learner)
    try:
        learner.wait_for_peers(ids=[1], timeout=10)
        old = learner._peers.by_id[1].info["incarnation"]
        os.kill(first.pid, signal.SIGKILL)
        second = peer(learner)  # same node id, new process, while the old one may look alive
        try:
            assert wait_until(lambda: 1 in learner.peers() and learner._peers.by_id[1].info["incarnation"] != old, 15)
            assert learner.peers() == [1]
            assert learner.call(1, "echo", "new", timeout=5) == "new"
        finally:
            stop(second)
    finally:
        stop(first)


def test_a_node_that_stops_and_comes_back_in_the_same_process_keeps_its_link():
    """The first incarnation's goodbye closes its link a moment later (GOODBYE_LINGER_S): that
    must not close the link of the second, which joined meanwhile (a TorchRL collector replacing
    its copy of the scheme lost every worker this way, seconds later)."""
    from mq.node.sender import GOODBYE_LINGER_S

    with mq.create("nng", 0, listen_to="tcp://127.0.0.1:0", timeout=10) as q:
        q.on("ping", lambda x: x)
        job = subprocess.Popen([sys.executable, "-m", "tests.jobs.same_id_again", q.addresses["tcp"], "1"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert job.stdout.readline().strip() == "again"
            until = time.monotonic() + GOODBYE_LINGER_S + 2.0
            while time.monotonic() < until:
                assert q.call(1, "echo", "x", timeout=5) == "x"
                time.sleep(0.1)
            assert q.peers() == [1]
        finally:
            job.stdin.close()
            job.wait(15)


def test_flush_confirms_what_a_live_peer_received(learner):
    proc = peer(learner)
    try:
        learner.wait_for_subscribers("work", 1, timeout=10)
        for i in range(50):
            learner.send(1, "work", i)
        learner.flush(1, timeout=5)
        assert learner._peers.by_id[1].acked == learner._peers.by_id[1].tx == 50
    finally:
        stop(proc)


def test_an_oversized_frame_fails_at_the_sender_and_the_link_survives():
    # Over a socket (protocol=ipc): by the shm route the bytes would not cross the link at all.
    learner = mq.create("nng", 0, protocol="ipc", timeout=3).listen()
    learner.on("echo", lambda x: x)
    proc = peer(learner, "small")
    try:
        learner.wait_for_subscribers("work", 1, timeout=10)
        with pytest.raises(mq.ConfigError, match="exceeds node 1's max_frame_bytes=1048576"):
            learner.send(1, "work", np.zeros(2 << 20, np.uint8))
        assert learner.call(1, "echo", "ok", timeout=5) == "ok"
        assert 1 in learner.peers()
    finally:
        stop(proc)
        learner.stop()


@pytest.mark.netns
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")
def test_a_host_that_vanishes_without_fin_is_lost_within_the_heartbeat_bound():
    from mq.tools.netns import TwoHosts, unavailable

    if unavailable():
        pytest.skip(unavailable())
    with TwoHosts() as hosts:
        q = mq.create("nng", 0, listen_to=f"tcp://{hosts.host_addr}:0", timeout=5)
        with q:
            proc = peer(q, pre=hosts.command([]), listen=f"tcp://{hosts.peer_addr}:0")
            try:
                q.wait_for_peers(ids=[1], timeout=10)
                assert q.routes()[1].kind == "tcp"
                assert isinstance(q.transport._out[1], tcplink.Outbound)  # across the veth
                # The pair trades data, so it is probed (a pair that just joined is idle, and an
                # idle pair's silence proves nothing until it is used: docs/concepts/liveness.md).
                q.send(1, "work", 0, timeout=5)
                subprocess.run(["ip", "-n", hosts.name, "link", "set", hosts.peer_if, "down"], check=True)
                proc.send_signal(signal.SIGKILL)  # no FIN can reach us: the link is down
                gone = time.monotonic()
                assert wait_until(lambda: 1 not in q.peers(), 8)
                detected = time.monotonic() - gone
                print(f"host gone without FIN: lost after {detected:.2f}s ({q._peers.by_id[1].lost})")
                assert detected <= q.peer_timeout + q.heartbeat + 0.5, detected
                assert "went silent" in q._peers.by_id[1].lost
            finally:
                stop(proc)


# ---------------------------------------------------------------------- the secret
def test_the_default_secret_file_is_private_and_shared_by_the_users_processes(tmp_path, monkeypatch):
    path = tmp_path / "mq" / "secret"
    monkeypatch.setenv("MQ_SECRET_FILE", str(path))
    monkeypatch.delenv("MQ_SECRET", raising=False)
    first = auth.resolve_secret()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert auth.resolve_secret().key == first.key and first.source == f"file:{path}"
    os.chmod(path, 0o644)
    with pytest.raises(mq.ConfigError, match="chmod 600"):
        auth.resolve_secret()
    monkeypatch.setenv("MQ_SECRET", "short")
    with pytest.raises(mq.ConfigError, match="at least 8"):
        auth.resolve_secret()
    assert repr(auth.resolve_secret("a-long-enough-secret")) == "Secret(source='explicit')"


def test_a_request_on_a_link_that_never_joined_is_refused_and_counted():
    """What a transport that answers calls in one exchange hands core (``on_request``) is not
    even decoded from a link that never proved membership: it is not taken (None), so the caller
    sends it as an ordinary frame, which only the handshake parser reads, and refuses."""
    from mq.wire.codec import REQ, split

    ran = []
    with mq.create("inproc", 0) as q:
        q.on("echo", lambda x: ran.append(x) or x)
        frame = q.codec.encode(REQ, "echo", 3, 0, 1, "hi").to_bytes()
        head, buffers = split(frame)
        assert q._dispatch.on_request(head, buffers, ("rank", 3)) is None
        assert q._dispatch.on_handshake(frame, ("rank", 3)) is False  # False: the transport closes the link
        assert q.stats().rejected == {"unauthenticated": 1}
    assert ran == []


def test_a_request_racing_its_senders_join_falls_back_to_an_ordinary_frame():
    """torch RPC serves requests on its own threads: one can arrive after the sender's link is
    bound but before core finished the join (seen under Slurm). It must not fail the call:
    core answers None and the caller sends an ordinary frame, ordered after the join."""
    from mq.wire.codec import REQ, split

    ran = []
    with mq.create("inproc", 0) as q:
        q.on("echo", lambda x: ran.append(x) or x)
        head, buffers = split(q.codec.encode(REQ, "echo", 3, 0, 1, "hi").to_bytes())
        q._peers.bind(("rank", 3), 3)  # the join's first half, as Join._on_link does before _joined
        assert q._dispatch.on_request(head, buffers, ("rank", 3)) is None
        assert q.stats().rejected == {}
    assert ran == []


def test_insecure_nodes_talk_without_a_secret_and_say_so():
    a = mq.create("inproc", 0, insecure=True, listen_to="inproc://insecure-a")
    b = mq.create("inproc", 1, insecure=True, attach_to=["inproc://insecure-a"])
    with a, b:
        b.wait_for_peers(1, timeout=5)
        b.send(0, "t", 1)
        assert a.recv(timeout=5).payload == 1
    with pytest.raises(mq.ConfigError, match="not both"):
        mq.create("inproc", 2, insecure=True, secret="a-long-enough-secret")


# ---------------------------------------------------------------------- TLS across hosts
@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    import shutil

    if not shutil.which("openssl"):
        pytest.skip("needs openssl to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "key.pem"),
                    "-out", str(d / "cert.pem"), "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost"], check=True, capture_output=True)
    return {"cert": str(d / "cert.pem"), "key": str(d / "key.pem"), "ca": str(d / "cert.pem")}


def test_tls_links_carry_messages_and_refuse_a_plain_peer(tls_files):
    a = mq.create("nng", 0, listen_to="tcp://localhost:0", protocol="tcp", tls=tls_files, timeout=3)
    with a:
        assert a.addresses["tcp"].startswith("tls+tcp://localhost:")
        proc = peer(a, listen="tcp://localhost:0", tls=tls_files)  # another process: a real link
        try:
            a.wait_for_peers(ids=[1], timeout=10)
            assert a.routes()[1].kind == "tcp"
            assert a.call(1, "echo", np.arange(1000), timeout=5).sum() == 499500
        finally:
            stop(proc)
        with pytest.raises(mq.ConfigError, match="wants TLS"):
            mq.create("nng", 2, attach_to=[a.addresses["tcp"]]).listen()


def test_bad_tls_options_are_config_errors(tmp_path):
    with pytest.raises(mq.ConfigError, match="tls must be"):
        mq.create("nng", 0, tls={"cert": "x"})
    with pytest.raises(mq.ConfigError, match="cannot be read"):
        mq.create("nng", 0, tls={"cert": str(tmp_path / "no"), "key": "k", "ca": "c"})


def test_mq_run_hands_the_job_secret_to_its_workers(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MQ_SECRET"}
    env["MQ_SECRET_FILE"] = str(tmp_path / "secret")  # not there yet: the launcher makes it once
    r = subprocess.run([sys.executable, "-m", "mq.cli.main", "run", "--main", "tests.jobs.trust_job:secret_source",
                        "-n", "3"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = sorted(line for line in r.stdout.splitlines() if line.startswith("node "))
    assert lines == [f"node {n} secret from env peers {[p for p in range(3) if p != n]}" for n in range(3)]
    assert stat.S_IMODE(os.stat(tmp_path / "secret").st_mode) == 0o600


def test_a_planted_rendezvous_entry_is_refused():
    import msgpack

    from mq.launch import free_port
    from mq.rendezvous import Rendezvous

    secret = auth.resolve_secret("the-jobs-real-secret")
    port = free_port()
    node0 = Rendezvous(f"tcp://127.0.0.1:{port}", 0, 2, timeout=5)
    stranger = auth.Secret(b"a-strangers-guess", "explicit")
    planted = auth.seal(stranger, msgpack.packb({"addresses": {"tcp": "tcp://203.0.113.9:1"}}))
    node0.store.set("mq/1", planted)  # a stranger writes node 1's entry first
    with pytest.raises(mq.ProtocolError, match="not signed with this job's secret"):
        node0.exchange({"addresses": {"tcp": "tcp://127.0.0.1:1"}}, secret)


def test_a_planted_torchrpc_locality_is_refused(tmp_path):
    import msgpack
    import torch.distributed as dist

    path = tmp_path / "store"
    store = dist.FileStore(str(path), 2)
    stranger = auth.Secret(b"a-strangers-guess", "explicit")
    store.set("mq/torchrpc/locality/1", auth.seal(stranger, msgpack.packb({"locality": {"boot_id": "x"}})))
    q = mq.create("torchrpc:cpu", 0, world_size=2, init_method=f"file://{path}", timeout=5,
                  secret="the-jobs-real-secret")
    with pytest.raises(mq.ProtocolError, match="not signed with this job's secret"):
        q.listen()
    assert not q.running
