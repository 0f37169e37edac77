"""One conformance suite for every backend, on real processes over real sockets.

Parametrized over nng on tcp, nng on unix sockets (ipc) and torch RPC (CPU). The scenarios live
in mq/testing.py so a new backend gets the same checks by adding one parameter.
"""

from __future__ import annotations

import importlib.util

import pytest

from mq.testing import ORDERED_N, run_group

pytestmark = pytest.mark.timeout(120)

BACKENDS = [
    pytest.param(("nng", "tcp"), id="nng-tcp"),
    pytest.param(("nng", "ipc"), id="nng-ipc"),
    pytest.param(("nng", "auto"), id="nng-shm"),
    pytest.param(("inproc", "auto"), id="inproc"),
    pytest.param(("torchrpc:cpu", "auto"), id="torchrpc-cpu",
                 marks=pytest.mark.skipif(importlib.util.find_spec("mq.backends.torchrpc") is None,
                                          reason="torch RPC backend not built")),
]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def run(backend, scenario, **kw):
    mq_type, protocol = backend
    return run_group(mq_type, scenario, protocol=protocol if mq_type == "nng" else "auto", **kw)


def test_send_recv_carries_every_payload_kind(backend):
    assert run(backend, "check_send_recv")[0] == "ok"


def test_empty_tensors_and_arrays_arrive_every_time(backend):
    assert run(backend, "check_empty_buffers")[0] == "ok"


def test_publish_reaches_only_subscribers(backend):
    res = run(backend, "check_publish_filtering", n=3)
    assert res[0] == [("t0", "for 0")]
    assert res[1] == [("t1", "for 1")]


def test_recv_times_out(backend):
    res = run(backend, "check_recv_timeout")
    for waited in res.values():
        assert 0.25 <= waited < 2.0


def test_call_result_remote_error_and_timeout(backend):
    out = run(backend, "check_call")[1]
    assert out["double"] == 42
    assert out["obs"] == (1.0, [2.0, 2.0, 2.0, 2.0])
    assert out["fail"] == ("KeyError", "'missing'")
    assert out["nohandler"][0] == "LookupError" and "no handler for 'nohandler'" in out["nohandler"][1]
    assert 0.25 <= out["timeout_s"] < 2.0


def test_peers_by_label_and_routes(backend):
    res = run(backend, "check_peers_routes", n=3, labels=["learner", "collector", "collector"])
    assert res[0]["all"] == [1, 2] and res[0]["collectors"] == [1, 2] and res[0]["learners"] == []
    assert res[1]["learners"] == [0] and res[1]["collectors"] == [2]
    mq_type, protocol = backend
    expected = {"nng": {"tcp": "tcp", "ipc": "ipc", "auto": "shm"}.get(protocol),
                "inproc": "inproc", "torchrpc:cpu": "shm"}.get(mq_type)
    for node, r in res.items():
        assert set(r["routes"]) == set(r["all"]), r
        if expected:
            assert set(r["routes"].values()) == {expected}, (node, r["routes"])


def test_ordering_exactly_once(backend):
    assert run(backend, "check_ordering")[0] == list(range(ORDERED_N))


def test_backpressure_waits_then_times_out_and_loses_nothing(backend):
    res = run(backend, "check_backpressure", mq_options={"queue_size": 4})
    sender, receiver = res[1], res[0]
    assert sender["timed_out"], "a receiver that never reads must make send() time out"
    assert receiver["accepted"] == sender["accepted"]
    assert receiver["received"] == list(range(sender["accepted"]))


def test_subscription_handler_runs_in_order_off_the_io_thread(backend):
    out = run(backend, "check_handler_order")[0]
    assert out["got"] == list(range(300))
    assert len(out["threads"]) == 1 and "io" not in out["threads"][0], out["threads"]


def test_send_to_stopped_peer_raises_peer_lost(backend):
    msg = run(backend, "check_peer_stopped")[0]
    assert "node 1" in msg


def test_a_call_whose_handler_runs_when_the_server_stops_gets_its_answer(backend):
    assert run(backend, "check_answer_before_goodbye")[0] == 42
