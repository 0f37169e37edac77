"""The torch RPC backend on real spawned processes over loopback.

Node programs live in tests/torchrpc_peer.py (spawned processes import them) and run through
:class:`mq.testing.Spawned`, every process joined or killed on leaving its ``with``. The
backend-agnostic behaviour (backpressure, handlers, publish filtering) is covered for
torchrpc:cpu by tests/test_conformance.py.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.rpc.is_available():
    pytest.skip("this torch build has no torch.distributed.rpc", allow_module_level=True)

import mq  # noqa: E402
import torchrpc_peer as peer  # noqa: E402
from mq.launch import free_port  # noqa: E402
from mq.routing import ROUTE_KINDS  # noqa: E402
from mq.testing import Spawned  # noqa: E402


def tcp() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def Group(program: Any, world_size: int, init_method: str | None = None, **kw: Any) -> Spawned:
    """``world_size`` spawned processes each running ``program`` (of torchrpc_peer)."""
    return Spawned(program, world_size, init_method or tcp(), **kw)


# ---------------------------------------------------------------------- exchange
@pytest.mark.timeout(180)
@pytest.mark.parametrize("public_rpc_async", [False, True], ids=["internal-issue", "public-rpc_async"])
def test_three_node_exchange_send_publish_call_order_payload(public_rpc_async):
    # public-rpc_async: frames and calls issued by rpc.rpc_async, as on a torch without the
    # internal call mq uses to skip its per-call Python.
    with Group(peer.exchange, 3, public_rpc_async=public_rpc_async) as g:
        res = g.results()
        g.join()
        assert g.exitcodes() == [0, 0, 0]
    learner, c1, c2 = res[0], res[1], res[2]
    assert learner["peers"] == [1, 2] and learner["collectors"] == [1, 2] and learner["learners"] == []
    assert c1["learners"] == [0] and c1["collectors"] == [2]
    for r in res.values():
        assert {name for name, _, _ in r["routes"].values()} == {"Route"}
        assert {kind for _, kind, _ in r["routes"].values()} <= set(ROUTE_KINDS)
        assert {gpu for _, _, gpu in r["routes"].values()} <= set(ROUTE_KINDS) - {"nvlink"}  # torchrpc:cpu
    assert learner["seq"] == list(range(peer.ORDERED)), "messages lost, duplicated or reordered"
    assert learner["payload_ok"], "numpy / tensor / bf16 / bytes payload changed in transit"
    assert learner["stats"] == [(1, {"node": 1}), (2, {"node": 2})]
    assert learner["done"] == [1, 2] and learner["extra"] is False
    assert learner["model_to"] == [2], "publish must reach only subscribers"
    assert c2["model"] == ("model", 0, [1.0, 1.0, 1.0, 1.0])
    for c in (c1, c2):
        assert c["double"] == 42
        assert c["remote_error"] == ("KeyError", "'missing'", 0)
        assert c["published_to"] == [0]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scheme", ["file", "env"])
def test_file_and_env_init_methods(scheme, tmp_path):
    if scheme == "file":
        init_method, env = f"file://{tmp_path / 'rendezvous'}", {}
    else:
        init_method, env = "env://", {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    with Group(peer.init_variant, 2, init_method, env=env) as g:
        res = g.results()
        g.join()
    assert res[0] == ("hi", 1, [1])


@pytest.mark.timeout(180)
def test_call_is_one_request_with_answers_errors_and_refused_spoofs():
    with Group(peer.calls, 2) as g:
        res = g.results()
        g.join()
    server, caller = res[0], res[1]
    assert caller["small"] == (7, [0, 1, 2, 3])
    assert caller["big"] and caller["payload_ok"]
    assert caller["fail"] == ("KeyError", "'missing'", 0)
    assert caller["nohandler"][0] == "LookupError" and "no handler for 'nohandler'" in caller["nohandler"][1]
    # One exchange each: no call went as a REQ frame, and the handler ran on a TensorPipe
    # thread (a thread Python did not start), not on mq's handler pool.
    assert caller["req_frames"] == 0 and caller["taken"] == [True] * 46, caller
    assert "-on" not in caller["thread"], caller["thread"]
    # Each TensorPipe thread keeps one Python thread state (not a new one per call: that cost
    # ~0.1 ms a call): a fresh state only on a thread's first call.
    threads = {ident for ident, _ in caller["thread_states"]}
    fresh = sum(f for _, f in caller["thread_states"])
    assert len(threads) < 40 and fresh == len(threads), caller["thread_states"]
    assert "mq: request not served" in caller["spoofed"], caller["spoofed"]
    assert server["rejected"] == {"spoofed_sender": 1}, server


# ---------------------------------------------------------------------- failures
@pytest.mark.timeout(120)
def test_call_to_a_peer_killed_mid_handler_raises_peer_lost_at_once():
    with Group(peer.call_dies, 2) as g:
        res = g.results(expect=[1])
        g.join([0, 1], timeout=10.0)
        assert g.procs[0].exitcode == -9
    kind, text = res[1]["error"]
    assert kind == "PeerLost" and "node 0" in text, res[1]
    assert res[1]["waited_s"] < 6.0, res[1]  # not the call's 30 s timeout



@pytest.mark.timeout(180)
def test_sigkilled_peer_raises_within_bound_and_stop_is_bounded():
    with Group(peer.sigkill, 3) as g:
        res = g.results(expect=[0, 1])
        g.join([0, 1], timeout=10.0)
        exited = {n: g.procs[n].exitcode for n in (0, 1)}
        exit_s = {n: time.monotonic() - g.reported[n] for n in (0, 1)}
        g.join([2], timeout=5.0)
        assert g.procs[2].exitcode == -9
    for node in (0, 1):
        r = res[node]
        assert r["error"] is not None, f"node {node} never noticed node 2 died"
        kind, text = r["error"]
        assert kind in ("PeerLost", "Timeout") and "node 2" in text, r
        # A send fails at once or through the heartbeat (1 s); a call must not wait out its
        # 20 s timeout: the heartbeat turns the death into PeerLost.
        assert r["detected_s"] < 6.0, r
        assert r["stop_s"] < 6.0, r
        assert 2 not in r["peers_after"]
        assert exited[node] == 0, f"node {node} did not exit after stop(): {exited}, {exit_s}"
    assert res[1]["error"][0] == "PeerLost", res[1]


@pytest.mark.timeout(120)
def test_frames_stay_in_order_while_the_recv_caller_and_the_delivery_thread_take_turns():
    # Node 0's frames are delivered by its recv() caller while it reads and by the delivery
    # thread while it does not: order and count must not depend on who did (both streams), a
    # handler must keep getting frames once no caller reads, and a recv() blocked in the reader
    # must end with ClosedError when the queue stops.
    with Group(peer.handover, 2) as g:
        res = g.results()
        g.join()
    r = res[0]
    assert r["r"], f"recv() stream lost, duplicated or reordered (head {r['r_head']})"
    assert r["h"], f"handler stream wrong: {r['h_count']} of 800, or out of order"
    assert r["closed"]["raised"] == "ClosedError" and r["closed"]["after_s"] < 6, r["closed"]


@pytest.mark.timeout(120)
def test_stop_abandons_a_hanging_rpc_shutdown_and_the_process_exits():
    with Group(peer.stop_abandoned, 2) as g:
        res = g.results()
        g.join(timeout=10.0)
        assert g.exitcodes() == [0, 0], "a worker whose rpc.shutdown hangs must still exit"
    assert res[0]["stop_s"] < 3.5, res


# ---------------------------------------------------------------------- safety and semantics
@pytest.mark.timeout(120)
def test_data_path_never_unpickles():
    with Group(peer.no_unpickle, 2) as g:
        res = g.results()
        g.join()
    for node, r in res.items():
        assert r["got"] == 20 and r["echo"] == [0, 1, 2]
        assert r["calls"] == [], f"node {node} unpickled network data: {r['calls']}"
    # The traps work: node 1 unpickled node 0's Python-function request, node 0 the answer.
    assert "rpc-pickler" in res[1]["control"] and "rpc-pickler" in res[0]["control"], res


@pytest.mark.timeout(180)
@pytest.mark.parametrize("options", [{}, {"copy_threshold": 0}, {"copy_threshold": 1 << 40}],
                         ids=["default", "never-copy", "always-copy"])
def test_sender_may_modify_buffers_after_send_returns(options):
    with Group(peer.copy_semantics, 2, **options) as g:
        res = g.results()
        g.join()
    assert res[0] == [(float(i), float(i)) for i in range(5)]


@pytest.mark.timeout(180)
def test_busy_poll_off_leaves_an_idle_process_asleep():
    # TensorPipe's shm transport spins a core per process (99-100% of one here while idle);
    # busy_poll=False keeps same-host frames on loopback TCP: messages, tensors and calls
    # still flow, and an idle node spends next to no CPU (a spinning one would show ~1 core).
    with Group(peer.idle_cpu, 2, busy_poll=False) as g:
        res = g.results()
        g.join()
    for node in (0, 1):
        r = res[node]
        assert "shm" not in r["transports"], r
        assert r["got"] == float(np.arange(10_000, dtype=np.float32).sum()) and r["answer"] == {"n": node}
        assert r["cores"] < 0.3, f"node {node} spent {r['cores']:.2f} cores while idle"


@pytest.mark.timeout(120)
def test_one_rpc_agent_per_process():
    with Group(peer.second_agent, 1, init_method2=tcp()) as g:
        res = g.results()
        g.join()
    assert res[0]["refused"] and "one RPC agent per process" in res[0]["refused"]
    assert res[0]["restart"] is True


@pytest.mark.timeout(180)
def test_launch_three_workers(tmp_path):
    mq.launch(peer.launch_main, n_workers=3, mq_type="torchrpc:cpu", args={"out": str(tmp_path)})
    for node in range(3):
        text = (tmp_path / f"{node}.txt").read_text()
        assert text == f"torchrpc:cpu {(node - 1) % 3} {sorted({0, 1, 2} - {node})}"


# ---------------------------------------------------------------------- what TensorPipe leaves open
_ONE_NODE = """
import logging, sys
import mq
logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
options = {"socket_ifname": sys.argv[2]} if len(sys.argv) > 2 else {}
with mq.create("torchrpc:cpu", 0, world_size=1, init_method=sys.argv[1], timeout=30, **options):
    pass
"""


def _routable_interface() -> str | None:
    """An interface other than lo with an IPv4 address, for TensorPipe to listen on."""
    import fcntl
    import socket
    import struct

    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:  # SIOCGIFADDR: the interface's IPv4 address
                fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        if name != "lo":
            return name
    return None


def test_which_listen_addresses_other_hosts_can_reach(monkeypatch):
    import socket

    from mq.backends.torchrpc.tensorpipe import reachable_listen as _reachable_listen

    assert _reachable_listen("lo") is None
    assert _reachable_listen("eth0") == "interface eth0"
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")  # no TP_SOCKET_IFNAME: the host name's
    assert _reachable_listen(None) is None
    monkeypatch.setattr(socket, "gethostname", lambda: "192.0.2.7")
    assert _reachable_listen(None) == "the address of host name 192.0.2.7 (TensorPipe's default)"


@pytest.mark.timeout(180)
def test_a_node_listening_beyond_loopback_warns_once_and_a_loopback_one_does_not():
    import subprocess
    import sys

    ifname = _routable_interface()
    runs = {"loopback": [tcp()]} | ({"routable": [tcp(), ifname]} if ifname else {})
    procs = {k: subprocess.Popen([sys.executable, "-c", _ONE_NODE, *argv], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for k, argv in runs.items()}
    try:
        out = {k: p.communicate(timeout=150) for k, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(5)
    assert all(p.returncode == 0 for p in procs.values()), out
    assert "listens on" not in out["loopback"][1], out["loopback"][1]
    if not ifname:
        pytest.skip("no interface but lo has an IPv4 address here: only loopback was checked")
    warnings = [line for line in out["routable"][1].splitlines() if "listens on" in line]
    assert len(warnings) == 1, out["routable"][1]
    assert warnings[0].startswith(f"mq.torchrpc WARNING node 0: torch RPC listens on interface {ifname},")
    assert "mq doctor" in warnings[0] and "use nng" in warnings[0]


def test_a_forged_store_entry_is_refused_and_logged(tmp_path, caplog):
    """What mq reads from a rendezvous store (torchrpc's localities, nng's addresses) is checked
    against the job secret before anything decodes it; a forged value stops the node and leaves
    one warning line (tests/test_trust.py checks the refusal of each)."""
    import msgpack
    import torch.distributed as dist

    from mq import auth
    from mq.rendezvous import open_entry, sign_entry

    secret = auth.resolve_secret("the-jobs-real-secret")
    stranger = auth.Secret(b"a-strangers-guess", "explicit")
    assert open_entry(secret, sign_entry(secret, {"a": 1}), "an entry") == {"a": 1}
    with pytest.raises(mq.ProtocolError, match="not signed"):
        open_entry(secret, auth.seal(stranger, b"\xc1 not msgpack either"), "an entry")
    path = tmp_path / "store"
    dist.FileStore(str(path), 2).set("mq/torchrpc/locality/1", sign_entry(stranger, {"locality": {}}))
    q = mq.create("torchrpc:cpu", 0, world_size=2, init_method=f"file://{path}", timeout=5, secret=secret.key)
    with caplog.at_level("WARNING", logger="mq.rendezvous"), pytest.raises(mq.ProtocolError, match="not signed"):
        q.listen()
    assert not q.running
    refused = [r.getMessage() for r in caplog.records if r.name == "mq.rendezvous"]
    assert [m.partition(":")[0] for m in refused] == ["refused an entry", "refused node 1's locality"], refused
    assert all("not signed with this job's secret" in m for m in refused)


# ---------------------------------------------------------------------- configuration errors
def test_device_map_with_torchrpc_cpu_is_a_config_error():
    with pytest.raises(mq.ConfigError, match="torchrpc:cuda"):
        mq.create("torchrpc:cpu", 0, world_size=2, init_method=tcp(), cuda_device_map="1_0_0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_torchrpc_cuda_without_gpu_is_a_config_error():
    with pytest.raises(mq.ConfigError, match="no.*visible|none is visible") as info:
        mq.create("torchrpc:cuda", 0, world_size=2, init_method=tcp())
    assert "torchrpc:cpu" in str(info.value)


@pytest.mark.parametrize("options, match", [
    ({"world_size": 2}, "init_method"),
    ({"init_method": "tcp://127.0.0.1:1"}, "world_size"),
    ({"init_method": "udp://x:1", "world_size": 2}, "tcp://, env://, file:// or ray://"),
    ({"init_method": "tcp://127.0.0.1:1", "world_size": 2, "node_id": 2}, r"\[0, world_size=2\)"),
    ({"init_method": "tcp://127.0.0.1:1", "world_size": 2, "device": "tpu"}, "device"),
    ({"init_method": "tcp://127.0.0.1:1", "world_size": 2, "send_window": 0}, "send_window"),
    ({"init_method": "tcp://127.0.0.1:1", "world_size": 2, "socket_ifname": "nosuch9"}, "socket_ifname"),
    ({"init_method": "tcp://127.0.0.1:1", "world_size": 2, "busy_poll": "no"}, "busy_poll"),
    ({"init_method": "tcp://127.0.0.1:1", "world_size": 2, "local_cuda_devices": [0, 0]}, "twice"),
])
def test_bad_options_are_config_errors(options, match):
    from mq.backends.torchrpc.options import TorchRpcOptions
    from mq.backends.torchrpc.transport import TorchRpcTransport

    options = dict(options)
    node_id = options.pop("node_id", 0)
    with pytest.raises(mq.ConfigError, match=match):
        TorchRpcTransport(node_id, TorchRpcOptions(**options))


# ---------------------------------------------------------------------- GPUs
@pytest.mark.cuda
@pytest.mark.timeout(180)
def test_cuda_tensor_moves_device_to_device_with_a_device_map():
    with Group(peer.cuda_transfer, 2, mq_type="torchrpc:cuda", device_map="0_0_0,1_0_0") as g:
        res = g.results()
        g.join()
    assert res[0] == {"device": "cuda:0", "ok": True, "cpu_device": "cpu"}


@pytest.mark.cuda
@pytest.mark.timeout(180)
def test_cuda_tensor_is_staged_through_host_with_torchrpc_cpu():
    with Group(peer.cuda_transfer, 2, mq_type="torchrpc:cpu", device_map=None) as g:
        res = g.results()
        g.join()
    assert res[0] == {"device": "cuda:0", "ok": True, "cpu_device": "cpu"}


def test_a_frame_goes_as_text_or_tensors_by_the_peers_inline_bound_and_both_forms_come_back():
    """to_rpc: one frame, two peers (same host: 8 KiB as text, another host: 64 KiB); each form
    is made once and decodes to the same bytes."""
    from mq.backends.torchrpc.wire import INLINE_MAX, REMOTE_INLINE_MAX, frame_parts, to_rpc
    from mq.wire.codec import MSG, Codec

    codec = Codec(keep_tensors=True)
    payload = np.arange(20 << 10, dtype=np.uint8)
    frame = codec.encode(MSG, "t", 0, 1, 0, payload)
    local = to_rpc(frame, staged=True, copy_threshold=1 << 20, inline_max=INLINE_MAX)
    remote = to_rpc(frame, staged=True, copy_threshold=1 << 20, inline_max=REMOTE_INLINE_MAX)
    assert len(local.buffers) == 1 and not remote.buffers  # 20 KB: a tensor here, text there
    assert to_rpc(frame, staged=True, copy_threshold=1 << 20, inline_max=REMOTE_INLINE_MAX) is remote
    assert to_rpc(frame, staged=True, copy_threshold=1 << 20) is local
    for out in (local, remote):
        head, views = frame_parts(out.text, list(out.buffers), 1 << 30)
        assert np.array_equal(codec.decode(head, views).payload, payload)
    big = codec.encode(MSG, "t", 0, 2, 0, np.zeros(REMOTE_INLINE_MAX + 1, np.uint8))
    assert to_rpc(big, staged=True, copy_threshold=1 << 20, inline_max=REMOTE_INLINE_MAX).buffers
