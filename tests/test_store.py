"""The rendezvous store of tcp:// and env:// for nng (mq.store): nodes meet without torch, and
the store holds against strangers on its port."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mq
from mq import store as store_mod
from mq.platforms.plan import free_port
from mq.rendezvous import Rendezvous
from mq.store import Missing, StoreClient, StoreServer
from mq.testing import wait_until

pytestmark = pytest.mark.timeout(120)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def server():
    s = StoreServer(free_port(), world_size=4)
    yield s
    s.close()


def _frame(message) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def _raw(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    return s


def _closed_by_peer(s: socket.socket, timeout: float = 5.0) -> bool:
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def _serves(port: int) -> bool:
    c = StoreClient("127.0.0.1", port, timeout=5)
    try:
        c.set("probe", b"x")
        return c.wait(["probe"], 1.0) == [b"x"]
    finally:
        c.close()


def test_nng_nodes_meet_through_tcp_and_env_without_importing_torch():
    # In a process of its own: this one imported torch long ago.
    port = free_port()
    code = textwrap.dedent(f"""
        import os, sys, threading
        import mq
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
        qs = [mq.create("nng", i, init_method="tcp://127.0.0.1:{port}" if i % 2 else "env://",
                        world_size=4, listen_to="tcp://127.0.0.1:0", timeout=30) for i in range(4)]
        ts = [threading.Thread(target=lambda q=q: (q.listen(), q.wait_for_peers(3, timeout=30))) for q in qs]
        [t.start() for t in ts]; [t.join() for t in ts]
        print(sorted(len(q.peers()) for q in qs), "torch" in sys.modules)
        qs[1].send(2, "x", {{"a": 1}}); print(qs[2].recv(timeout=10).payload)
        for q in qs: q.stop()
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["[3, 3, 3, 3] False", "{'a': 1}"]


def test_a_first_tensor_imports_torch_at_the_receiver_and_the_pair_stays():
    code = textwrap.dedent("""
        import sys
        import mq
        q = mq.create("nng", 1, attach_to=[sys.argv[1]], timeout=30, peer_timeout=2)
        with q:
            q.wait_for_peers(1, timeout=30)
            q.subscribe("t")
            print("ready", "torch" in sys.modules, flush=True)
            msg = q.recv(timeout=30)
            print(type(msg.payload).__name__, float(msg.payload.sum()), q.peers(), flush=True)
            q.flush(0, timeout=10)
    """)
    import torch

    with mq.create("nng", 0, timeout=30, peer_timeout=2) as q:
        peer = subprocess.Popen([sys.executable, "-c", code, q.addresses["tcp"]], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert peer.stdout.readline().split() == ["ready", "False"]
            q.wait_for_subscribers("t", 1, timeout=30)
            q.send(1, "t", torch.ones(1000))
            out, err = peer.communicate(timeout=60)
            assert peer.returncode == 0, err[-3000:]
            assert out.split() == ["Tensor", "1000.0", "[0]"]
        finally:
            if peer.poll() is None:
                peer.kill()
                peer.communicate()


def test_a_node_missing_from_the_rendezvous_is_named():
    port = free_port()
    nodes = [Rendezvous(f"tcp://127.0.0.1:{port}", i, 3, timeout=1.0) for i in range(2)]
    try:
        results: list = []
        t = threading.Thread(target=lambda: results.append(_exchange(nodes[1])))
        t.start()
        with pytest.raises(mq.Timeout, match=r"node 0: nodes 2 did not join the rendezvous within 1s \(stage rendezvous"):
            nodes[0].exchange({"n": 0})
        t.join(10)
        assert isinstance(results[0], mq.Timeout) and "nodes 2 did not join" in str(results[0])
    finally:
        for n in nodes:
            n.close()


def _exchange(node):
    try:
        return node.exchange({"n": node.node_id})
    except mq.MQError as exc:
        return exc


def test_no_node_0_is_a_timeout_that_says_where_it_looked():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(mq.Timeout, match=rf"node 1: rendezvous at tcp://127.0.0.1:{port} failed within 1s: "
                                         r"no rendezvous store answered .*is node 0 running"):
        Rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=1.0)
    assert time.monotonic() - t0 < 5


def test_something_else_on_the_port_is_a_protocol_error_not_a_hang():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def talk_nonsense():
        conn, _ = listener.accept()
        conn.recv(1000)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        conn.close()

    t = threading.Thread(target=talk_nonsense)
    t.start()
    try:
        node = Rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=5)
        with pytest.raises(mq.ProtocolError, match="is something else listening there"):
            node.exchange({"n": 1})
        node.close()
    finally:
        t.join(5)
        listener.close()


def test_a_wait_answers_when_its_keys_are_set_or_says_which_are_missing(server):
    a, b = StoreClient("127.0.0.1", server.port, 5), StoreClient("127.0.0.1", server.port, 5)
    try:
        got: list = []
        t = threading.Thread(target=lambda: got.append(a.wait(["k1", "k2"], 10)))
        t.start()
        b.set("k1", b"one")
        b.set("k2", b"two")
        t.join(10)
        assert got == [[b"one", b"two"]]
        with pytest.raises(Missing) as info:
            a.wait(["k1", "k3"], 0.2)
        assert info.value.keys == ["k3"]
    finally:
        a.close()
        b.close()


def test_a_rendezvous_of_thousands_gets_every_entry_and_names_every_missing_one():
    # An nng node's entry is ~200 bytes: one answer with 6,000 of them (1.2 MB) was over the
    # 1 MiB message cap, so a rendezvous of more than ~5,000 nodes could never finish.
    n, entry = 6000, b"e" * 200
    server = StoreServer(free_port(), world_size=n)
    c = StoreClient("127.0.0.1", server.port, 5)
    try:
        keys = [f"mq/{i}" for i in range(n)]
        left_out = {keys[10], keys[3000], keys[5999]}  # in the first, second and last page
        for k in keys:
            if k not in left_out:
                c.set(k, entry + k.encode())
        with pytest.raises(Missing) as info:
            c.wait(keys, 0.5)
        assert info.value.keys == [keys[10], keys[3000], keys[5999]]
        for k in sorted(left_out):
            c.set(k, entry + k.encode())
        values = c.wait(keys, 5)
        assert values == [entry + k.encode() for k in keys]
        assert len(values) * len(entry) > store_mod.MAX_MESSAGE  # what one answer could not carry
    finally:
        c.close()
        server.close()


@pytest.mark.parametrize("junk", [
    b"\xff\xff\xff\xff",  # a length over the limit
    _frame(["set", 1, b"x"]),  # a key that is not a string
    _frame(["wait", "k", 1]),  # keys that are not a list
    _frame({"op": "set"}),
    _frame(["drop-table"]),
    struct.pack(">I", 3) + b"\xc1\xc1\xc1",  # not msgpack
], ids=["oversized", "int-key", "keys-not-list", "dict", "unknown-op", "not-msgpack"])
def test_a_stranger_sending_nonsense_is_cut_off_and_the_store_serves_on(server, junk):
    s = _raw(server.port)
    s.sendall(junk)
    assert _closed_by_peer(s)
    s.close()
    assert _serves(server.port)


def test_a_stalled_message_is_cut_off(server, monkeypatch):
    monkeypatch.setattr(store_mod, "_STALLED_S", 0.3)
    s = _raw(server.port)
    s.sendall(struct.pack(">I", 100) + b"half")  # and never the rest
    assert _closed_by_peer(s, timeout=5)
    s.close()


def _is_closed(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_a_connection_flood_is_refused_and_the_store_serves_after(server):
    flood = [_raw(server.port) for _ in range(server.max_conns + 5)]
    try:
        assert wait_until(lambda: sum(_is_closed(s) for s in flood) >= 5, timeout=10)
        assert not _is_closed(flood[0])  # those within the bound stay
    finally:
        for s in flood:
            s.close()
    assert wait_until(lambda: _serves(server.port), timeout=10)


def test_a_key_flood_stops_at_the_bound(server):
    c = StoreClient("127.0.0.1", server.port, 5)
    try:
        for i in range(server.max_keys):
            c.set(f"k{i}", b"v")
        with pytest.raises(mq.ProtocolError):
            c.set("one-too-many", b"v")
    finally:
        c.close()
    assert _serves_existing(server.port)


def _serves_existing(port: int) -> bool:
    c = StoreClient("127.0.0.1", port, timeout=5)
    try:
        return c.wait(["k0"], 1.0) == [b"v"]
    finally:
        c.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=200))
def test_random_bytes_never_stop_the_store(server, data):
    s = _raw(server.port)
    try:
        s.sendall(data)
    except OSError:
        pass
    s.close()
    assert _serves(server.port)


def test_a_key_set_again_is_what_later_waits_get(server):
    # Answers are kept for the next wait on the same keys; a node that restarted and set its
    # entry again must not be answered with the old one.
    c = StoreClient("127.0.0.1", server.port, 5)
    try:
        c.set("a", b"old")
        c.set("b", b"b")
        assert c.wait(["a", "b"], 1.0) == [b"old", b"b"]
        c.set("a", b"new")
        assert c.wait(["a", "b"], 1.0) == [b"new", b"b"]
    finally:
        c.close()


def test_waits_are_answered_whatever_order_their_keys_are_set_in(server):
    keys = [f"k{i}" for i in range(40)]
    clients = [StoreClient("127.0.0.1", server.port, 5) for _ in range(3)]
    got: list = []
    threads = [threading.Thread(target=lambda c=c, ks=ks: got.append(c.wait(ks, 20)))
               for c, ks in zip(clients, [keys, keys[::-1], keys[5:25]])]
    try:
        for t in threads:
            t.start()
        setter = StoreClient("127.0.0.1", server.port, 5)
        for k in keys[::2] + keys[1::2]:  # neither the order of the keys nor its reverse
            setter.set(k, k.encode())
        setter.close()
        for t in threads:
            t.join(20)
        assert sorted(got) == sorted([[k.encode() for k in ks] for ks in (keys, keys[::-1], keys[5:25])])
    finally:
        for c in clients:
            c.close()


def test_waits_a_stranger_leaves_behind_are_let_go_and_piling_them_up_is_refused(server):
    s = _raw(server.port)
    s.sendall(b"".join(_frame(["wait", [f"never-{i}"], 3600]) for i in range(64)))
    assert wait_until(lambda: server._open_waits == 64, timeout=5)
    s.sendall(_frame(["wait", ["one-too-many"], 3600]))
    assert _closed_by_peer(s)  # over the bound on open waits per connection
    s.close()
    assert wait_until(lambda: server._open_waits == 0, timeout=5)  # nobody to answer: let go
    assert _serves(server.port)
